//! A node's liveness lease in the control store, kept alive by `LeaseKeeper` (one per node,
//! shared by all its volumes).
//!
//! The keeper measures validity from when it *sent* the renewal: the store extends the lease
//! from when it *received* it, which is later, so the node always believes its lease ends no
//! later than the store does. A primary serves only while its lease is valid by this measure,
//! and the manager promotes another node only once the store says the lease expired; with
//! clocks that run at the same rate, the two periods never overlap.

use crate::store::{StoreCall, StoreReply, StoreRequest};
use crate::{Config, LeaseId, NodeId, StoreRequestId};

/// The lease a node holds and until when (its own clock) it may rely on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseStatus {
    pub lease: LeaseId,
    pub valid_until_ms: u64,
}

impl LeaseStatus {
    pub fn valid(&self, now_ms: u64) -> bool {
        now_ms < self.valid_until_ms
    }
}

/// Renews a node's lease: one request in flight at a time.
#[derive(Debug)]
pub struct LeaseKeeper {
    node: NodeId,
    incarnation: u64,
    lease_ms: u64,
    keepalive_interval_ms: u64,
    store_timeout_ms: u64,
    status: Option<LeaseStatus>,
    in_flight: Option<(StoreRequestId, u64)>,
    last_sent_ms: Option<u64>,
    next_request: u64,
}

impl LeaseKeeper {
    /// `incarnation` must differ at every start of the node (the wiring persists a counter): it
    /// keeps a grant request of an earlier process from being answered with that process's
    /// lease.
    pub fn new(node: NodeId, incarnation: u64, config: &Config) -> Self {
        assert!(incarnation < 1 << 32, "incarnations are counted in 32 bits");
        Self {
            node,
            incarnation,
            lease_ms: config.lease_ms,
            keepalive_interval_ms: config.keepalive_interval_ms,
            store_timeout_ms: config.store_timeout_ms,
            status: None,
            in_flight: None,
            last_sent_ms: None,
            next_request: 1,
        }
    }

    pub fn status(&self) -> Option<LeaseStatus> {
        self.status
    }

    /// Called on every tick: the renewal to send, if it is time.
    pub fn tick(&mut self, now_ms: u64) -> Option<StoreCall> {
        if let Some((_, sent_ms)) = self.in_flight {
            if sent_ms + self.store_timeout_ms > now_ms {
                return None;
            }
            self.in_flight = None;
        }
        if self.last_sent_ms.is_some_and(|sent| sent + self.keepalive_interval_ms > now_ms) {
            return None;
        }
        let counter = self.next_request;
        self.next_request += 1;
        assert!(counter < 1 << 32, "request counter overflow");
        let id = StoreRequestId(counter);
        self.in_flight = Some((id, now_ms));
        self.last_sent_ms = Some(now_ms);
        let request = StoreRequest::KeepAlive {
            node: self.node,
            lease: self.status.map(|status| status.lease),
            nonce: self.incarnation << 32 | counter,
        };
        Some(StoreCall { id, request })
    }

    /// A store reply for one of the keeper's requests; returns the new status when it changed.
    pub fn on_reply(&mut self, id: StoreRequestId, reply: &StoreReply) -> Option<LeaseStatus> {
        let (expected, sent_ms) = self.in_flight?;
        if expected != id {
            return None;
        }
        let StoreReply::Lease { lease } = reply else {
            return None;
        };
        self.in_flight = None;
        let valid_until_ms = sent_ms + self.lease_ms;
        let status = match self.status {
            Some(old) if old.lease == *lease => LeaseStatus {
                lease: *lease,
                valid_until_ms: valid_until_ms.max(old.valid_until_ms),
            },
            _ => LeaseStatus { lease: *lease, valid_until_ms },
        };
        self.status = Some(status);
        Some(status)
    }
}
