//! The control store's view of a volume, the requests the state machines make of it, and
//! `MemStore`, a linearizable in-memory implementation used by the simulation and tests.
//!
//! The real store is etcd (`meta::EtcdStore`): the volume record is one key whose
//! `mod_revision` is the version, a compare-and-swap is a transaction guarded by that revision,
//! a lease is an etcd lease, and the lease conditions are compares on keys attached to those
//! leases (such a key exists exactly while its lease lives). Everything the protocol needs from
//! the store is here: single-key compare-and-swap, leases that expire on the store's clock and
//! cannot be revived once expired, and linearizable reads.

use std::collections::{BTreeMap, BTreeSet};

use crate::{LeaseId, NodeId, StoreRequestId};

/// Lease grants remembered per node, so a duplicated grant request gets the same lease back
/// instead of a second one.
pub const GRANTS_REMEMBERED_MAX: usize = 16;

/// The replication state of one volume, as the control store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeState {
    /// Raised by every promotion; every message carries it.
    pub epoch: u64,
    /// The node serving the volume in this epoch (`None` before the first promotion).
    pub primary: Option<NodeId>,
    /// The lease the primary held when promoted; the primary serves only while it holds this
    /// very lease, and the manager promotes another node only once it is no longer live.
    pub primary_lease: LeaseId,
    /// Replicas holding every completed write. Changed only by the epoch's primary (and by a
    /// promotion, which drops the old primary).
    pub in_sync: BTreeSet<NodeId>,
    /// The nodes holding a replica of the volume, in sync or not.
    pub members: BTreeSet<NodeId>,
}

/// A value and the version the store gave it; every change is a compare-and-swap on `version`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    pub version: u64,
    pub value: T,
}

/// A live lease and its holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseInfo {
    pub lease: LeaseId,
    pub node: NodeId,
}

/// What a state machine asks of the control store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreRequest {
    /// Read the volume's state.
    Get,
    /// Read the volume's state and every live lease (the manager's view).
    Snapshot,
    /// Replace the volume's state if its version is still `expected_version` and the lease
    /// conditions hold, all at one instant of the store's clock.
    Cas {
        expected_version: u64,
        new: VolumeState,
        require_live: Option<LeaseId>,
        require_not_live: Option<LeaseId>,
    },
    /// Renew `lease` if it is still live, else grant a new one. `nonce` makes a grant
    /// idempotent: the same (node, nonce) always gets the same lease.
    KeepAlive { node: NodeId, lease: Option<LeaseId>, nonce: u64 },
}

/// A request to send to the control store; its reply comes back with the same `id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreCall {
    pub id: StoreRequestId,
    pub request: StoreRequest,
}

/// Why a compare-and-swap was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasFailure {
    VersionMismatch,
    LeaseNotLive,
    LeaseLive,
}

/// The store's answer to a `StoreRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreReply {
    Volume(Versioned<VolumeState>),
    Snapshot {
        volume: Versioned<VolumeState>,
        leases: Vec<LeaseInfo>,
    },
    CasDone(Versioned<VolumeState>),
    CasFailed {
        current: Versioned<VolumeState>,
        reason: CasFailure,
    },
    /// The lease the node holds after a `KeepAlive`.
    Lease {
        lease: LeaseId,
    },
}

#[derive(Debug, Clone, Copy)]
struct LeaseRecord {
    node: NodeId,
    expiry_ms: u64,
}

/// A linearizable in-memory control store for one volume: each `handle` call is one atomic
/// step at the store's clock `now_ms`.
#[derive(Debug)]
pub struct MemStore {
    volume: Versioned<VolumeState>,
    leases: BTreeMap<LeaseId, LeaseRecord>,
    grants: BTreeMap<NodeId, Vec<(u64, LeaseId)>>,
    next_lease: u64,
    lease_ms: u64,
}

impl MemStore {
    pub fn new(initial: VolumeState, lease_ms: u64) -> Self {
        assert!(lease_ms > 0, "a lease must live for some time");
        Self {
            volume: Versioned { version: 1, value: initial },
            leases: BTreeMap::new(),
            grants: BTreeMap::new(),
            next_lease: 1,
            lease_ms,
        }
    }

    /// The volume's state now (for tests and the simulation's checker).
    pub fn volume(&self) -> &Versioned<VolumeState> {
        &self.volume
    }

    /// Whether `lease` is live at `now_ms`. A lease is live strictly before its expiry.
    pub fn lease_live(&self, lease: LeaseId, now_ms: u64) -> bool {
        self.leases.get(&lease).is_some_and(|record| now_ms < record.expiry_ms)
    }

    /// Answers one request at `now_ms`. Time must not go backwards between calls.
    pub fn handle(&mut self, now_ms: u64, request: &StoreRequest) -> StoreReply {
        self.leases.retain(|_, record| now_ms < record.expiry_ms);
        match request {
            StoreRequest::Get => StoreReply::Volume(self.volume.clone()),
            StoreRequest::Snapshot => StoreReply::Snapshot {
                volume: self.volume.clone(),
                leases: self
                    .leases
                    .iter()
                    .map(|(&lease, record)| LeaseInfo { lease, node: record.node })
                    .collect(),
            },
            StoreRequest::Cas { expected_version, new, require_live, require_not_live } => {
                let reason = if self.volume.version != *expected_version {
                    Some(CasFailure::VersionMismatch)
                } else if require_live.is_some_and(|lease| !self.lease_live(lease, now_ms)) {
                    Some(CasFailure::LeaseNotLive)
                } else if require_not_live.is_some_and(|lease| self.lease_live(lease, now_ms)) {
                    Some(CasFailure::LeaseLive)
                } else {
                    None
                };
                match reason {
                    Some(reason) => StoreReply::CasFailed { current: self.volume.clone(), reason },
                    None => {
                        self.volume =
                            Versioned { version: self.volume.version + 1, value: new.clone() };
                        StoreReply::CasDone(self.volume.clone())
                    }
                }
            }
            StoreRequest::KeepAlive { node, lease, nonce } => {
                if let Some(lease) = lease {
                    if let Some(record) = self.leases.get_mut(lease) {
                        if record.node == *node {
                            record.expiry_ms = now_ms + self.lease_ms;
                            return StoreReply::Lease { lease: *lease };
                        }
                    }
                }
                let grants = self.grants.entry(*node).or_default();
                if let Some(&(_, granted)) = grants.iter().find(|(seen, _)| seen == nonce) {
                    return StoreReply::Lease { lease: granted };
                }
                let granted = LeaseId(self.next_lease);
                self.next_lease += 1;
                self.leases.insert(
                    granted,
                    LeaseRecord { node: *node, expiry_ms: now_ms + self.lease_ms },
                );
                if grants.len() == GRANTS_REMEMBERED_MAX {
                    grants.remove(0);
                }
                grants.push((*nonce, granted));
                StoreReply::Lease { lease: granted }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(epoch: u64) -> VolumeState {
        VolumeState {
            epoch,
            primary: None,
            primary_lease: LeaseId::NONE,
            in_sync: BTreeSet::new(),
            members: BTreeSet::new(),
        }
    }

    #[test]
    fn cas_checks_version_and_leases() {
        let mut store = MemStore::new(state(0), 100);
        let StoreReply::Lease { lease } =
            store.handle(0, &StoreRequest::KeepAlive { node: NodeId(1), lease: None, nonce: 7 })
        else {
            panic!("a keepalive answers with a lease");
        };
        let cas = |version, live, not_live| StoreRequest::Cas {
            expected_version: version,
            new: state(1),
            require_live: live,
            require_not_live: not_live,
        };
        assert!(matches!(
            store.handle(10, &cas(9, None, None)),
            StoreReply::CasFailed { reason: CasFailure::VersionMismatch, .. }
        ));
        assert!(matches!(
            store.handle(10, &cas(1, None, Some(lease))),
            StoreReply::CasFailed { reason: CasFailure::LeaseLive, .. }
        ));
        assert!(matches!(store.handle(10, &cas(1, Some(lease), None)), StoreReply::CasDone(_)));
        // Expired at 100: a renewal of it grants a new lease instead.
        assert!(!store.lease_live(lease, 100));
        let reply = store.handle(
            100,
            &StoreRequest::KeepAlive { node: NodeId(1), lease: Some(lease), nonce: 8 },
        );
        assert!(matches!(reply, StoreReply::Lease { lease: renewed } if renewed != lease));
        // A duplicated grant request gets the same lease.
        let again = store.handle(
            101,
            &StoreRequest::KeepAlive { node: NodeId(1), lease: Some(lease), nonce: 8 },
        );
        assert_eq!(reply, again);
    }
}
