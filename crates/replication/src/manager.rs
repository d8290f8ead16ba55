//! The cluster manager's decisions for one volume: promote a new primary when the primary's
//! lease is gone, and replace a member that has been away longer than the grace period.
//!
//! In a cluster one manager is elected (etcd election); but every decision is a CAS on the
//! volume's version guarded by lease conditions evaluated by the store itself, so two managers
//! acting at once (an old leader that has not noticed yet) can only duplicate work, never make
//! a wrong change. The manager keeps nothing that matters across a restart: what it remembers
//! (since when a member has been away) only delays a rebuild if lost.

use std::collections::BTreeMap;

use crate::store::{LeaseInfo, StoreCall, StoreReply, StoreRequest, Versioned, VolumeState};
use crate::{Config, LeaseId, NodeId, StoreRequestId};

/// One manager's state machine: poll the store, decide, CAS.
#[derive(Debug)]
pub struct Manager {
    store_poll_ms: u64,
    store_timeout_ms: u64,
    grace_ms: u64,
    in_flight: Option<(StoreRequestId, u64)>,
    last_poll_ms: Option<u64>,
    next_request: u64,
    /// Members without a live lease, and since when (this manager's observation).
    away_since_ms: BTreeMap<NodeId, u64>,
}

impl Manager {
    pub fn new(config: &Config) -> Self {
        Self {
            store_poll_ms: config.store_poll_ms,
            store_timeout_ms: config.store_timeout_ms,
            grace_ms: config.grace_ms,
            in_flight: None,
            last_poll_ms: None,
            next_request: 1,
            away_since_ms: BTreeMap::new(),
        }
    }

    fn call(&mut self, now_ms: u64, request: StoreRequest) -> StoreCall {
        let id = StoreRequestId(self.next_request);
        self.next_request += 1;
        self.in_flight = Some((id, now_ms));
        StoreCall { id, request }
    }

    /// Called on every tick: the store request to make, if any.
    pub fn tick(&mut self, now_ms: u64) -> Option<StoreCall> {
        if let Some((_, sent_ms)) = self.in_flight {
            if sent_ms + self.store_timeout_ms > now_ms {
                return None;
            }
            self.in_flight = None;
        }
        if self.last_poll_ms.is_some_and(|last| last + self.store_poll_ms > now_ms) {
            return None;
        }
        self.last_poll_ms = Some(now_ms);
        Some(self.call(now_ms, StoreRequest::Snapshot))
    }

    /// A store reply; returns the change to make, if one is due.
    pub fn on_reply(
        &mut self,
        now_ms: u64,
        id: StoreRequestId,
        reply: &StoreReply,
    ) -> Option<StoreCall> {
        if self.in_flight.is_none_or(|(expected, _)| expected != id) {
            return None;
        }
        self.in_flight = None;
        let StoreReply::Snapshot { volume, leases } = reply else {
            // A CAS answered; the next poll shows its effect.
            return None;
        };
        let request = self.decide(now_ms, volume, leases)?;
        Some(self.call(now_ms, request))
    }

    fn decide(
        &mut self,
        now_ms: u64,
        volume: &Versioned<VolumeState>,
        leases: &[LeaseInfo],
    ) -> Option<StoreRequest> {
        let state = &volume.value;
        // A node may hold more than one live lease for a moment (a grant after an expiry it did
        // not see); the newest is the one it renews.
        let mut live: BTreeMap<NodeId, LeaseId> = BTreeMap::new();
        for info in leases {
            let newest = live.entry(info.node).or_insert(info.lease);
            *newest = (*newest).max(info.lease);
        }
        for member in &state.members {
            if live.contains_key(member) {
                self.away_since_ms.remove(member);
            } else {
                self.away_since_ms.entry(*member).or_insert(now_ms);
            }
        }
        self.away_since_ms.retain(|node, _| state.members.contains(node));

        let primary_live = state.primary.is_some()
            && state.primary_lease != LeaseId::NONE
            && leases.iter().any(|info| info.lease == state.primary_lease);
        if !primary_live {
            return promotion(volume, &live);
        }
        self.rebuild(now_ms, volume, &live)
    }

    /// Replaces one member that is out of sync and has been away longer than the grace period
    /// by a live node that holds no replica yet. The primary copies everything to it.
    fn rebuild(
        &self,
        now_ms: u64,
        volume: &Versioned<VolumeState>,
        live: &BTreeMap<NodeId, LeaseId>,
    ) -> Option<StoreRequest> {
        let state = &volume.value;
        let gone = state.members.iter().find(|member| {
            !state.in_sync.contains(member)
                && Some(**member) != state.primary
                && self
                    .away_since_ms
                    .get(member)
                    .is_some_and(|&since| since + self.grace_ms <= now_ms)
        })?;
        let (&spare, &spare_lease) = live.iter().find(|(node, _)| !state.members.contains(node))?;
        let mut new = state.clone();
        new.members.remove(gone);
        new.members.insert(spare);
        Some(StoreRequest::Cas {
            expected_version: volume.version,
            new,
            require_live: Some(spare_lease),
            require_not_live: None,
        })
    }
}

/// Promotes an in-sync member with a live lease: epoch + 1, the old primary out of the in-sync
/// set. The CAS holds only if the old primary's lease is still not live and the new one's is,
/// at the store's instant of the change. The old primary itself is chosen only if no other
/// member can be (it came back with a new lease and was the only in-sync one).
fn promotion(
    volume: &Versioned<VolumeState>,
    live: &BTreeMap<NodeId, LeaseId>,
) -> Option<StoreRequest> {
    let state = &volume.value;
    let others = state.in_sync.iter().filter(|node| Some(**node) != state.primary);
    let candidate = others
        .filter_map(|node| live.get(node).map(|lease| (*node, *lease)))
        .next()
        .or_else(|| {
            let old = state.primary?;
            let lease = live.get(&old)?;
            (state.in_sync.contains(&old) && *lease != state.primary_lease).then_some((old, *lease))
        });
    let (node, lease) = candidate?;
    let mut new = state.clone();
    new.epoch += 1;
    new.primary = Some(node);
    new.primary_lease = lease;
    if let Some(old) = state.primary {
        if old != node {
            new.in_sync.remove(&old);
        }
    }
    Some(StoreRequest::Cas {
        expected_version: volume.version,
        new,
        require_live: Some(lease),
        require_not_live: Some(state.primary_lease),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn volume(primary: u32, lease: u64, in_sync: &[u32]) -> Versioned<VolumeState> {
        let nodes = |ids: &[u32]| ids.iter().map(|&id| NodeId(id)).collect::<BTreeSet<_>>();
        Versioned {
            version: 5,
            value: VolumeState {
                epoch: 3,
                primary: Some(NodeId(primary)),
                primary_lease: LeaseId(lease),
                in_sync: nodes(in_sync),
                members: nodes(&[0, 1, 2]),
            },
        }
    }

    fn live(pairs: &[(u32, u64)]) -> Vec<LeaseInfo> {
        pairs
            .iter()
            .map(|&(node, lease)| LeaseInfo { node: NodeId(node), lease: LeaseId(lease) })
            .collect()
    }

    #[test]
    fn promotes_an_in_sync_member_only_when_the_primary_lease_is_gone() {
        let config = Config::default();
        let mut manager = Manager::new(&config);
        let state = volume(0, 10, &[0, 1, 2]);
        assert_eq!(manager.decide(0, &state, &live(&[(0, 10), (1, 11), (2, 12)])), None);
        let Some(StoreRequest::Cas { new, require_live, require_not_live, .. }) =
            manager.decide(0, &state, &live(&[(1, 11), (2, 12)]))
        else {
            panic!("the primary's lease is gone: promote");
        };
        assert_eq!((new.epoch, new.primary, new.primary_lease), (4, Some(NodeId(1)), LeaseId(11)));
        assert_eq!(new.in_sync, [NodeId(1), NodeId(2)].into_iter().collect());
        assert_eq!((require_live, require_not_live), (Some(LeaseId(11)), Some(LeaseId(10))));
        // Only the old primary is in sync: wait for it, then take it back under a new lease.
        let alone = volume(0, 10, &[0]);
        assert_eq!(manager.decide(0, &alone, &live(&[(1, 11)])), None);
        let Some(StoreRequest::Cas { new, .. }) = manager.decide(0, &alone, &live(&[(0, 20)]))
        else {
            panic!("the old primary came back");
        };
        assert_eq!(
            (new.primary, new.primary_lease, new.in_sync.len()),
            (Some(NodeId(0)), LeaseId(20), 1)
        );
    }

    #[test]
    fn replaces_a_member_away_longer_than_the_grace_period() {
        let config = Config { grace_ms: 100, ..Config::default() };
        let mut manager = Manager::new(&config);
        let state = volume(0, 10, &[0, 1]);
        let leases = live(&[(0, 10), (1, 11), (3, 13)]);
        assert_eq!(manager.decide(0, &state, &leases), None);
        assert_eq!(manager.decide(99, &state, &leases), None);
        let Some(StoreRequest::Cas { new, require_live, .. }) =
            manager.decide(100, &state, &leases)
        else {
            panic!("member 2 has been away for the grace period");
        };
        assert_eq!(new.members, [NodeId(0), NodeId(1), NodeId(3)].into_iter().collect());
        assert_eq!(require_live, Some(LeaseId(13)));
    }
}
