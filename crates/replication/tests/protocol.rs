//! Targeted protocol tests: small scripted clusters (instant storage and network, links cut by
//! hand) that check one rule each: a stale epoch is refused; a write completes as soon as it is
//! durable everywhere, whatever the order the primary's local writes finish in; a write waits
//! until a laggard is removed from the in-sync set; a deposed primary fails its pending writes; a resync copies
//! only the blocks written while the replica was away; a deallocate is replicated, ordered and
//! resynced exactly like a write of unmapped blocks; a primary that steps down fails its pending
//! commands, resigns, and another member serves within a few store polls; an old primary (or an
//! unprobed replica) that comes back after a failover is copied only the blocks changed while
//! it was away and those of its uncommitted writes (with its process alive) or of its persisted
//! write intent (after a restart), and one that restarted without its intent is copied in full;
//! a primary whose copy of a block is damaged serves the read from an in-sync replica and
//! rewrites its own copy, unless a host write to the block came first, and fails only that read
//! when no replica has a good copy; a volume grown on the primary before its replicas takes
//! writes beyond the old end once every in-sync replica has grown (or was removed), and the
//! replica promoted next serves them.

use std::collections::{BTreeSet, VecDeque};

use replication::{
    Action, BlockData, Config, Entry, EntryKind, Event, HostError, HostOp, HostOpId, HostReply,
    LeaseId, LeaseKeeper, Manager, MemStore, Message, NodeId, ResyncProgress, StorageOpId,
    StorageResult, StoreReply, StoreRequest, StreamId, VolumeNode, VolumeState, WriteIntent,
    BLOCKS_PER_OP_MAX, DEALLOCATE_BLOCKS_PER_OP_MAX, OWN_STALL_LATE_FACTOR,
};

const BLOCK_BYTES: usize = 16;

fn config() -> Config {
    Config {
        volume_blocks: 32,
        block_size_bytes: BLOCK_BYTES,
        lease_ms: 400,
        keepalive_interval_ms: 100,
        store_poll_ms: 50,
        store_timeout_ms: 150,
        heartbeat_ms: 30,
        retransmit_ms: 40,
        ack_timeout_ms: 150,
        hello_interval_ms: 100,
        copy_blocks_per_tick: 4,
        dirty_lbas_max: 16,
        divergence_ranges_max: 16,
        intent_region_blocks: 4,
        intent_regions_max: 16,
        intent_linger_ms: 1_000,
        grace_ms: 60_000,
    }
}

fn block(byte: u8) -> replication::Block {
    replication::Block::from(vec![byte; BLOCK_BYTES])
}

#[derive(Debug)]
enum Input {
    Node(usize, Event),
    Lease(usize, replication::StoreRequestId, StoreReply),
    Manager(replication::StoreRequestId, StoreReply),
}

struct Node {
    volume: VolumeNode,
    lease: LeaseKeeper,
    disk: Vec<BlockData>,
    incarnation: u64,
    persisted_epoch: u64,
    /// What the last `PersistIntent` made durable.
    persisted_intent: Option<WriteIntent>,
    /// The intent the current process started with.
    started_with: Option<WriteIntent>,
    /// Blocks whose data fails its checksum here: a read of any of them answers `Damaged`
    /// until a write replaces it.
    damaged: BTreeSet<u64>,
}

/// Three nodes, a store and a manager; storage and messages are instant. `cut` links drop
/// messages in both directions; `store_cut` nodes cannot reach the store.
struct Cluster {
    config: Config,
    now_ms: u64,
    store: MemStore,
    manager: Manager,
    nodes: Vec<Node>,
    queue: VecDeque<Input>,
    cut: BTreeSet<(usize, usize)>,
    store_cut: BTreeSet<usize>,
    completions: Vec<(u64, HostOpId, u64, Result<HostReply, HostError>)>,
    next_host_op: u64,
    /// Every change of each node's `resync_progress`, in order.
    progress: Vec<Vec<Vec<ResyncProgress>>>,
    /// Nodes whose local writes stay in flight until `finish_write` (they still land on disk).
    storage_held: BTreeSet<usize>,
    /// The completions of those writes, in the order they were issued.
    held_writes: Vec<(usize, StorageOpId)>,
    /// Nodes whose intent persists stay in flight until `finish_intents` (they still land).
    intents_held: BTreeSet<usize>,
    /// The completions of those persists: node and version.
    held_intents: Vec<(usize, u64)>,
}

impl Cluster {
    fn new(config: Config) -> Cluster {
        Cluster::with_nodes(config, 3)
    }

    fn with_nodes(config: Config, count: u32) -> Cluster {
        let members: BTreeSet<NodeId> = (0..count).map(NodeId).collect();
        let initial = VolumeState {
            epoch: 0,
            primary: None,
            primary_lease: replication::LeaseId::NONE,
            in_sync: members.clone(),
            members,
        };
        let nodes = (0..count)
            .map(|index| Node {
                volume: VolumeNode::new(config.clone(), NodeId(index), 1, 0, None),
                lease: LeaseKeeper::new(NodeId(index), 1, &config),
                disk: vec![None; config.volume_blocks as usize],
                incarnation: 1,
                persisted_epoch: 0,
                persisted_intent: None,
                started_with: None,
                damaged: BTreeSet::new(),
            })
            .collect();
        Cluster {
            config: config.clone(),
            now_ms: 0,
            store: MemStore::new(initial, config.lease_ms),
            manager: Manager::new(&config),
            nodes,
            queue: VecDeque::new(),
            cut: BTreeSet::new(),
            store_cut: BTreeSet::new(),
            completions: Vec::new(),
            next_host_op: 1,
            progress: vec![Vec::new(); count as usize],
            storage_held: BTreeSet::new(),
            held_writes: Vec::new(),
            intents_held: BTreeSet::new(),
            held_intents: Vec::new(),
        }
    }

    /// Completes, oldest first, the writes held in flight for `lag_ms` or longer: a storage that
    /// takes that long for each write. `issued_ms` is the caller's record of when each held
    /// write was first seen (the writes held since its last call are stamped now).
    fn finish_writes_held(&mut self, issued_ms: &mut VecDeque<u64>, lag_ms: u64) {
        loop {
            while issued_ms.len() < self.held_writes.len() {
                issued_ms.push_back(self.now_ms);
            }
            if issued_ms.front().is_none_or(|&at| at + lag_ms > self.now_ms) {
                return;
            }
            issued_ms.pop_front();
            self.finish_write(0);
        }
    }

    /// Completes the `index`th write held in flight (in issue order) and what it causes.
    fn finish_write(&mut self, index: usize) {
        let (node, id) = self.held_writes.remove(index);
        let event = Event::Storage { id, result: StorageResult::Written };
        self.queue.push_back(Input::Node(node, event));
        self.drain();
    }

    /// Completes every intent persist of `node` held in flight, and what that causes.
    fn finish_intents(&mut self, node: usize) {
        let (done, held) = self.held_intents.drain(..).partition(|(held, _)| *held == node);
        self.held_intents = held;
        for (node, version) in done {
            self.queue.push_back(Input::Node(node, Event::IntentPersisted { version }));
        }
        self.drain();
    }

    fn state(&self) -> VolumeState {
        self.store.volume().value.clone()
    }

    /// The process of `node` restarts: its disk, persisted epoch and persisted write intent
    /// survive, nothing else.
    fn restart(&mut self, node: usize) {
        let id = NodeId(node as u32);
        let sim = &mut self.nodes[node];
        sim.incarnation += 1;
        let intent = sim.persisted_intent.clone();
        sim.started_with = intent.clone();
        let config = Config { volume_blocks: sim.disk.len() as u64, ..self.config.clone() };
        sim.volume = VolumeNode::new(config, id, sim.incarnation, sim.persisted_epoch, intent);
        sim.lease = LeaseKeeper::new(id, sim.incarnation, &self.config);
    }

    /// The volume grows to `volume_blocks` on `node` alone: its disk, then its state machine,
    /// as a node does when it learns the new size. A restart starts with the grown size.
    fn grow(&mut self, node: usize, volume_blocks: u64) {
        let sim = &mut self.nodes[node];
        sim.disk.resize(volume_blocks as usize, None);
        sim.volume.grow(volume_blocks);
    }

    /// Cuts `node` off from the other nodes and from the store.
    fn isolate(&mut self, node: usize) {
        for other in 0..self.nodes.len() {
            if other != node {
                self.cut_link(node, other);
            }
        }
        self.store_cut.insert(node);
    }

    fn cut_link(&mut self, a: usize, b: usize) {
        self.cut.insert((a.min(b), a.max(b)));
    }

    fn heal(&mut self) {
        self.cut.clear();
        self.store_cut.clear();
    }

    fn linked(&self, a: usize, b: usize) -> bool {
        !self.cut.contains(&(a.min(b), a.max(b)))
    }

    /// Advances time by `ms`, ticking everyone every 5 ms and delivering everything at once.
    fn run(&mut self, ms: u64) {
        let end = self.now_ms + ms;
        while self.now_ms < end {
            self.now_ms += 1;
            if self.now_ms % 5 == 0 {
                for node in 0..self.nodes.len() {
                    if let Some(call) = self.nodes[node].lease.tick(self.now_ms) {
                        if !self.store_cut.contains(&node) {
                            let reply = self.store.handle(self.now_ms, &call.request);
                            self.queue.push_back(Input::Lease(node, call.id, reply));
                        }
                    }
                    self.queue.push_back(Input::Node(node, Event::Tick));
                }
                if let Some(call) = self.manager.tick(self.now_ms) {
                    let reply = self.store.handle(self.now_ms, &call.request);
                    self.queue.push_back(Input::Manager(call.id, reply));
                }
            }
            self.drain();
        }
    }

    fn drain(&mut self) {
        let mut steps = 0;
        while let Some(input) = self.queue.pop_front() {
            steps += 1;
            assert!(steps < 1_000_000, "the cluster does not quiesce");
            self.process(input);
        }
    }

    /// Delivers one input; what it causes is queued.
    fn process(&mut self, input: Input) {
        match input {
            Input::Node(node, event) => self.node_event(node, event),
            Input::Lease(node, id, reply) => {
                if let Some(status) = self.nodes[node].lease.on_reply(id, &reply) {
                    self.node_event(node, Event::Lease(status));
                }
            }
            Input::Manager(id, reply) => {
                if let Some(call) = self.manager.on_reply(self.now_ms, id, &reply) {
                    let reply = self.store.handle(self.now_ms, &call.request);
                    self.queue.push_back(Input::Manager(call.id, reply));
                }
            }
        }
    }

    fn node_event(&mut self, node: usize, event: Event) {
        let mut actions = Vec::new();
        self.nodes[node].volume.handle(self.now_ms, event, &mut actions);
        let progress = self.nodes[node].volume.resync_progress();
        if self.progress[node].last().is_none_or(|last| *last != progress) {
            self.progress[node].push(progress);
        }
        self.apply(node, actions);
    }

    /// Node `node` steps down; returns what it asked for (already carried out).
    fn step_down(&mut self, node: usize) -> Vec<Action> {
        let mut actions = Vec::new();
        self.nodes[node].volume.step_down(self.now_ms, &mut actions);
        self.apply(node, actions.clone());
        self.drain();
        actions
    }

    /// The node serving `epoch` now, if any.
    fn serving(&self, epoch: u64) -> Option<usize> {
        let now_ms = self.now_ms;
        self.nodes.iter().position(|node| node.volume.serving_epoch(now_ms) == Some(epoch))
    }

    fn apply(&mut self, node: usize, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Send { to, message } => {
                    let to = to.0 as usize;
                    if self.linked(node, to) {
                        let event = Event::Message { from: NodeId(node as u32), message };
                        self.queue.push_back(Input::Node(to, event));
                    }
                }
                Action::StorageWrite { id, lba, blocks } => {
                    let sim = &mut self.nodes[node];
                    for (index, data) in blocks.into_iter().enumerate() {
                        sim.disk[lba as usize + index] = data;
                        sim.damaged.remove(&(lba + index as u64));
                    }
                    if self.storage_held.contains(&node) {
                        self.held_writes.push((node, id));
                        continue;
                    }
                    let event = Event::Storage { id, result: StorageResult::Written };
                    self.queue.push_back(Input::Node(node, event));
                }
                Action::StorageRead { id, lba, count } => {
                    let range = lba as usize..(lba + u64::from(count)) as usize;
                    let sim = &self.nodes[node];
                    let result = if sim.damaged.range(lba..lba + u64::from(count)).next().is_some()
                    {
                        StorageResult::Damaged
                    } else {
                        StorageResult::Read(sim.disk[range].to_vec())
                    };
                    let event = Event::Storage { id, result };
                    self.queue.push_back(Input::Node(node, event));
                }
                Action::PersistEpoch { epoch } => {
                    let persisted = &mut self.nodes[node].persisted_epoch;
                    *persisted = (*persisted).max(epoch);
                    self.queue.push_back(Input::Node(node, Event::EpochPersisted { epoch }));
                }
                Action::PersistIntent { version, intent } => {
                    self.nodes[node].persisted_intent = Some(intent);
                    if self.intents_held.contains(&node) {
                        self.held_intents.push((node, version));
                        continue;
                    }
                    self.queue.push_back(Input::Node(node, Event::IntentPersisted { version }));
                }
                Action::Store { id, request } => {
                    if !self.store_cut.contains(&node) {
                        let reply = self.store.handle(self.now_ms, &request);
                        self.queue.push_back(Input::Node(node, Event::Store { id, reply }));
                    }
                }
                Action::CompleteHost { id, epoch, result } => {
                    self.completions.push((self.now_ms, id, epoch, result));
                }
            }
        }
    }

    fn host(&mut self, node: usize, op: HostOp) -> HostOpId {
        let id = HostOpId(self.next_host_op);
        self.next_host_op += 1;
        self.queue.push_back(Input::Node(node, Event::Host { id, op }));
        self.drain();
        id
    }

    /// Submits several commands before anything completes (storage replies queue behind them).
    fn host_batch(&mut self, node: usize, ops: Vec<HostOp>) -> Vec<HostOpId> {
        let mut ids = Vec::new();
        for op in ops {
            let id = HostOpId(self.next_host_op);
            self.next_host_op += 1;
            self.queue.push_back(Input::Node(node, Event::Host { id, op }));
            ids.push(id);
        }
        self.drain();
        ids
    }

    fn result(&self, id: HostOpId) -> Result<HostReply, HostError> {
        self.completion(id).expect("the command completed").3.clone()
    }

    fn write(&mut self, node: usize, lba: u64, byte: u8) -> HostOpId {
        self.host(node, HostOp::Write { lba, blocks: vec![block(byte)] })
    }

    fn completion(
        &self,
        id: HostOpId,
    ) -> Option<&(u64, HostOpId, u64, Result<HostReply, HostError>)> {
        let mut found = self.completions.iter().filter(|(_, done, _, _)| *done == id);
        let first = found.next();
        assert!(found.next().is_none(), "a host command completes once");
        first
    }

    /// Starts the cluster and waits until node 0 serves epoch 1.
    fn started(config: Config) -> Cluster {
        Cluster::started_with_nodes(config, 3)
    }

    fn started_with_nodes(config: Config, count: u32) -> Cluster {
        let mut cluster = Cluster::with_nodes(config, count);
        cluster.run(200);
        let state = cluster.state();
        assert_eq!((state.epoch, state.primary), (1, Some(NodeId(0))));
        assert_eq!(cluster.nodes[0].volume.serving_epoch(cluster.now_ms), Some(1));
        cluster
    }
}

#[test]
fn a_stale_epoch_is_refused() {
    let mut node = VolumeNode::new(config(), NodeId(1), 1, 5, None);
    let append = Message::Append {
        epoch: 4,
        stream: StreamId(1),
        incarnation: 1,
        seq: 1,
        commit_op: 0,
        entry: Entry { kind: EntryKind::Write { op: 2 }, lba: 0, blocks: vec![Some(block(1))] },
    };
    for message in [
        append,
        Message::Probe { epoch: 4 },
        Message::Heartbeat { epoch: 4, stream: StreamId(1), incarnation: 1, commit_op: 0 },
    ] {
        let mut actions = Vec::new();
        node.handle(0, Event::Message { from: NodeId(0), message }, &mut actions);
        assert_eq!(
            actions,
            vec![Action::Send { to: NodeId(0), message: Message::Stale { epoch: 5 } }],
            "an older epoch gets Stale and nothing else: no write, no acknowledgement"
        );
    }
    // The same entry under the node's own epoch is applied.
    let mut actions = Vec::new();
    let append = Message::Append {
        epoch: 5,
        stream: StreamId(1),
        incarnation: 1,
        seq: 1,
        commit_op: 0,
        entry: Entry { kind: EntryKind::Write { op: 2 }, lba: 0, blocks: vec![Some(block(1))] },
    };
    node.handle(0, Event::Message { from: NodeId(0), message: append }, &mut actions);
    assert!(matches!(actions.as_slice(), [Action::StorageWrite { lba: 0, .. }]), "{actions:?}");
}

/// A replica applies nothing of an epoch before the epoch is durable: a process that never
/// persisted an epoch restarts believing it applied nothing (its divergence known and empty).
#[test]
fn a_replica_applies_nothing_of_an_epoch_before_it_is_durable() {
    let mut node = VolumeNode::new(config(), NodeId(1), 1, 0, None);
    let append = Message::Append {
        epoch: 1,
        stream: StreamId(1),
        incarnation: 1,
        seq: 1,
        commit_op: 0,
        entry: Entry { kind: EntryKind::Write { op: 2 }, lba: 0, blocks: vec![Some(block(1))] },
    };
    let mut actions = Vec::new();
    node.handle(0, Event::Message { from: NodeId(0), message: append }, &mut actions);
    assert_eq!(actions, vec![Action::PersistEpoch { epoch: 1 }], "no write before the epoch");
    let mut actions = Vec::new();
    node.handle(0, Event::EpochPersisted { epoch: 1 }, &mut actions);
    let writes: Vec<StorageOpId> = actions
        .iter()
        .filter_map(|action| match action {
            Action::StorageWrite { id, lba: 0, .. } => Some(*id),
            _ => None,
        })
        .collect();
    let [id] = writes[..] else {
        panic!("the entry is applied once the epoch is durable: {actions:?}");
    };
    let mut actions = Vec::new();
    node.handle(0, Event::Storage { id, result: StorageResult::Written }, &mut actions);
    let ack = Message::Ack { epoch: 1, stream: StreamId(1), durable_seq: 1 };
    assert_eq!(actions, vec![Action::Send { to: NodeId(0), message: ack }]);
}

#[test]
fn a_write_completes_only_after_the_laggard_is_removed() {
    let mut cluster = Cluster::started(config());
    // Node 2 stops answering, and node 0 cannot reach the store for now.
    cluster.cut_link(0, 2);
    cluster.store_cut.insert(0);
    let write = cluster.write(0, 3, 7);
    let cut_ms = cluster.now_ms;
    cluster.run(200);
    assert!(cluster.completion(write).is_none(), "node 2 never acknowledged and is still in sync");
    assert!(cluster.state().in_sync.contains(&NodeId(2)));
    // The store is reachable again (before the lease runs out): the laggard goes, then the
    // write completes.
    cluster.store_cut.clear();
    let healed_ms = cluster.now_ms;
    cluster.run(100);
    let (done_ms, _, epoch, result) = cluster.completion(write).expect("completed").clone();
    assert_eq!((epoch, result), (1, Ok(HostReply::Written)));
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());
    assert!(done_ms > healed_ms && healed_ms > cut_ms, "not before the CAS that removed node 2");
    assert_eq!(cluster.nodes[1].disk[3], Some(block(7)), "the in-sync replica holds it");
    assert_eq!(cluster.nodes[2].disk[3], None);
}

/// The index in `held_writes` of `node`'s first write held in flight.
fn held_write_of(cluster: &Cluster, node: usize) -> usize {
    cluster.held_writes.iter().position(|(held, _)| *held == node).expect("a write is held")
}

/// The disk under the primary and node 2 pauses (one disk both share), just after the
/// primary's copy of a first write landed and before node 2's did; a second write arrives
/// during the pause. Node 2 keeps answering heartbeats. Returns the cluster, when the first
/// write was sent, and the two writes.
fn shared_pause_after_a_write() -> (Cluster, u64, HostOpId, HostOpId) {
    let mut cluster = Cluster::started(config());
    cluster.storage_held.extend([0, 2]);
    let sent_ms = cluster.now_ms;
    let first = cluster.write(0, 3, 7);
    cluster.finish_write(held_write_of(&cluster, 0));
    let second = cluster.write(0, 9, 8);
    (cluster, sent_ms, first, second)
}

#[test]
fn a_replica_is_not_late_while_the_primary_s_own_storage_is_stalled_too() {
    let timeout = config().ack_timeout_ms;
    let (mut cluster, sent_ms, first, second) = shared_pause_after_a_write();
    cluster.run(2 * timeout);
    assert!(cluster.completion(first).is_none(), "node 2 has not acknowledged it");
    assert!(cluster.state().in_sync.contains(&NodeId(2)), "a pause the primary shares is no lag");
    // The primary's storage moves again; node 2's not yet. It gets one more timeout.
    let ended_ms = cluster.now_ms;
    cluster.finish_write(held_write_of(&cluster, 0));
    cluster.run(timeout - 10);
    assert!(cluster.completion(first).is_none() && cluster.completion(second).is_none());
    assert!(cluster.state().in_sync.contains(&NodeId(2)));
    cluster.run(50);
    let (done_ms, _, epoch, result) = cluster.completion(first).expect("completed").clone();
    assert_eq!((epoch, result), (1, Ok(HostReply::Written)));
    assert!((ended_ms + timeout..=ended_ms + timeout + 40).contains(&done_ms), "{done_ms}");
    assert!(done_ms < sent_ms + timeout * OWN_STALL_LATE_FACTOR);
    assert_eq!(cluster.result(second), Ok(HostReply::Written));
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());

    // A pause that lasts: node 2 goes after OWN_STALL_LATE_FACTOR timeouts all the same.
    let (mut cluster, sent_ms, first, second) = shared_pause_after_a_write();
    let cap_ms = sent_ms + timeout * OWN_STALL_LATE_FACTOR;
    cluster.run(cap_ms + 40 - cluster.now_ms);
    let (done_ms, _, _, result) = cluster.completion(first).expect("completed").clone();
    assert_eq!(result, Ok(HostReply::Written));
    assert!((cap_ms..=cap_ms + 40).contains(&done_ms), "{done_ms} against {cap_ms}");
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());
    assert!(cluster.completion(second).is_none(), "the primary's own copy is still held");
    cluster.finish_write(held_write_of(&cluster, 0));
    assert_eq!(cluster.result(second), Ok(HostReply::Written));

    // With the primary's own writes quick, a replica that stops is removed after one timeout:
    // no other write tells the primary its own storage takes writes, its probe does.
    let mut cluster = Cluster::started(config());
    cluster.storage_held.insert(2);
    let sent_ms = cluster.now_ms;
    let write = cluster.write(0, 3, 7);
    cluster.run(timeout + 40);
    let (done_ms, _, _, result) = cluster.completion(write).expect("completed").clone();
    assert_eq!(result, Ok(HostReply::Written));
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());
    assert!((sent_ms + timeout..=sent_ms + timeout + 40).contains(&done_ms), "{done_ms}");
    assert_eq!(cluster.nodes[0].volume.stats().storage_probes, 1);
}

/// The disk under the primary and node 2 pauses just after the primary's copy of a write
/// landed and before node 2's did, and no other write comes: the primary has no write of its
/// own in flight to tell it that its storage stalled too. Its storage probe (an intent persist)
/// stalls, so node 2 stays in sync; when the pause ends, the write completes with every copy.
#[test]
fn a_shared_pause_with_no_write_of_the_primary_s_own_in_flight_removes_no_replica() {
    let timeout = config().ack_timeout_ms;
    let mut cluster = Cluster::started(config());
    cluster.storage_held.extend([0, 2]);
    let write = cluster.write(0, 3, 7);
    cluster.finish_write(held_write_of(&cluster, 0));
    // The pause begins: the primary's intent persists stall from now on.
    cluster.intents_held.insert(0);
    let probes = cluster.nodes[0].volume.stats().storage_probes;
    cluster.run(3 * timeout);
    assert!(cluster.completion(write).is_none(), "node 2 has not acknowledged it");
    assert_eq!(cluster.state().in_sync.len(), 3, "a pause the primary shares is no lag");
    assert_eq!(cluster.nodes[0].volume.stats().storage_probes, probes + 1, "one probe, held");
    // The pause ends for both.
    cluster.intents_held.clear();
    cluster.finish_intents(0);
    cluster.storage_held.clear();
    cluster.finish_write(held_write_of(&cluster, 2));
    cluster.run(50);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    assert_eq!(cluster.state().in_sync.len(), 3);
    assert_eq!(cluster.nodes[0].volume.stats().replicas_removed, 0);
}

#[test]
fn each_write_completes_once_durable_on_the_primary_whatever_the_order_its_writes_finish_in() {
    let mut cluster = Cluster::started(config());
    cluster.storage_held.insert(0);
    let ops = (0..4u8).map(|index| write_op(u64::from(index) * 5, &[index + 1])).collect();
    let ids = cluster.host_batch(0, ops);
    cluster.run(20);
    assert_eq!(cluster.held_writes.len(), 4, "every local write is in flight");
    for id in &ids {
        assert!(cluster.completion(*id).is_none(), "both replicas acked, the primary did not");
    }
    // The third finishes first, then the first, the last and the second.
    for (finish, done) in [(2, vec![2]), (0, vec![0, 2]), (1, vec![0, 2, 3]), (0, vec![0, 1, 2, 3])]
    {
        cluster.finish_write(finish);
        let completed: Vec<usize> =
            (0..ids.len()).filter(|&index| cluster.completion(ids[index]).is_some()).collect();
        assert_eq!(completed, done);
    }
    for id in ids {
        assert_eq!(cluster.result(id), Ok(HostReply::Written));
    }
}

#[test]
fn a_deposed_primary_fails_its_pending_writes() {
    let mut cluster = Cluster::started(config());
    // Node 0 loses both replicas; its writes wait for acks it will never get.
    cluster.cut_link(0, 1);
    cluster.cut_link(0, 2);
    let write = cluster.write(0, 4, 9);
    cluster.run(20);
    assert!(cluster.completion(write).is_none());
    // Meanwhile a new epoch is created (as a manager would, once node 0's lease is gone; here by
    // hand, so node 0 still believes it is primary).
    let current = cluster.store.volume().clone();
    let mut next = current.value.clone();
    next.epoch = 2;
    next.primary = Some(NodeId(1));
    next.in_sync.remove(&NodeId(0));
    let request = StoreRequest::Cas {
        expected_version: current.version,
        new: next,
        require_live: None,
        require_not_live: None,
    };
    assert!(matches!(cluster.store.handle(cluster.now_ms, &request), StoreReply::CasDone(_)));
    // Node 0 times the replicas out; its CAS fails on the new epoch; it is deposed.
    cluster.run(300);
    let (_, _, epoch, result) = cluster.completion(write).expect("the write was answered").clone();
    assert_eq!((epoch, result), (1, Err(HostError::NotPrimary)));
    assert!(cluster.nodes[0].volume.epoch() >= 2);
    assert_eq!(cluster.nodes[0].volume.serving_epoch(cluster.now_ms), None);
    let late = cluster.write(0, 5, 1);
    assert!(matches!(cluster.completion(late), Some((_, _, _, Err(HostError::NotPrimary)))));
}

/// Node 2 is cut off while `lbas` are written (one block each), then comes back.
fn resync_after_writes(config: Config, lbas: &[u64]) -> Cluster {
    let mut cluster = Cluster::started(config);
    for lba in 10..14 {
        cluster.write(0, lba, 1);
    }
    cluster.run(50);
    cluster.cut_link(0, 2);
    for (index, &lba) in lbas.iter().enumerate() {
        cluster.write(0, lba, 2 + index as u8);
        cluster.run(10);
    }
    cluster.run(300);
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());
    assert!(cluster.completions.iter().all(|(_, _, _, result)| result.is_ok()));
    cluster.heal();
    cluster.run(500);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 2 is back in sync");
    assert_eq!(cluster.nodes[2].disk, cluster.nodes[0].disk);
    assert_eq!(cluster.nodes[1].disk, cluster.nodes[0].disk);
    cluster
}

#[test]
fn a_resync_copies_only_the_blocks_written_while_away() {
    let lbas = [0, 3, 5, 6, 20];
    let cluster = resync_after_writes(config(), &lbas);
    let stats = cluster.nodes[0].volume.stats();
    assert_eq!((stats.resyncs_started, stats.resyncs_full, stats.resyncs_completed), (1, 0, 1));
    assert_eq!(stats.blocks_resynced, lbas.len() as u64);
}

/// The primary reports a returning replica's copy as it goes: from nothing copied to every
/// block, never more copied than to copy, and the job is gone once the replica is back.
#[test]
fn resync_progress_counts_up_to_the_total_and_ends() {
    let config = Config { dirty_lbas_max: 3, ..config() };
    let volume_blocks = config.volume_blocks;
    let cluster = resync_after_writes(config, &[0, 3, 5, 6, 20]);
    let seen: Vec<ResyncProgress> = cluster.progress[0]
        .iter()
        .filter_map(|jobs| jobs.iter().find(|job| job.peer == NodeId(2)).cloned())
        .collect();
    let first = seen.first().expect("the primary reported the copy");
    assert_eq!((first.full, first.blocks_copied, first.blocks_total), (true, 0, volume_blocks));
    let last = seen.last().expect("reported");
    assert_eq!((last.blocks_copied, last.blocks_total), (volume_blocks, volume_blocks));
    assert!(seen.windows(2).all(|pair| pair[0].blocks_copied <= pair[1].blocks_copied));
    assert!(seen.iter().all(|job| job.blocks_copied <= job.blocks_total));
    assert!(seen.len() > 2, "the copy took several ticks: {seen:?}");
    assert_eq!(cluster.nodes[0].volume.resync_progress(), vec![], "the job is gone when done");
    for node in [1, 2] {
        assert!(cluster.progress[node].iter().all(Vec::is_empty), "only a primary copies");
    }
}

#[test]
fn a_resync_copies_everything_when_too_much_changed() {
    let config = Config { dirty_lbas_max: 3, ..config() };
    let volume_blocks = config.volume_blocks;
    let cluster = resync_after_writes(config, &[0, 3, 5, 6, 20]);
    let stats = cluster.nodes[0].volume.stats();
    assert_eq!((stats.resyncs_started, stats.resyncs_full), (1, 1));
    assert_eq!(stats.blocks_resynced, volume_blocks);
}

/// The `index`th of the `per_ms` one-block host writes of millisecond `step` of a steady load
/// that cycles over `range`, so a block is written again only every `range.len() / per_ms` ms.
fn steady_write(
    step: u64,
    index: u64,
    per_ms: u64,
    range: std::ops::Range<u64>,
    byte: u8,
) -> HostOp {
    let lba = range.start + (step * per_ms + index) % (range.end - range.start);
    HostOp::Write { lba, blocks: vec![block(byte)] }
}

/// A resync makes progress while hosts keep writing and the returning replica acknowledges
/// their writes some way behind (as a replica on a busy disk does): its copies have their own
/// share of the stream's window. Before, copies started only while the stream held fewer than
/// `STREAM_WINDOW_MAX - INFLIGHT_WRITES_MAX` (64) unacknowledged entries of any kind, so a
/// replica some 80 live writes behind was copied nothing more and never came back in sync (seen
/// in `make compare-ceph`'s 32K mix: 44 restarts of a resync in 25 s, none finished).
#[test]
fn a_resync_progresses_while_the_replica_acknowledges_live_writes_behind() {
    const DIRTY_BLOCKS: u64 = 200;
    const HOST_LBA: u64 = 512;
    const HOST_BLOCKS: u64 = 128;
    // Hosts write WRITES_PER_MS blocks a millisecond, and each write takes the replicas'
    // storage LAG_MS: about 80 live writes unacknowledged by each at any moment.
    const WRITES_PER_MS: u64 = 8;
    const LAG_MS: u64 = 10;
    let config =
        Config { volume_blocks: 1024, dirty_lbas_max: 1024, intent_regions_max: 256, ..config() };
    let mut cluster = Cluster::started(config);
    cluster.cut_link(0, 2);
    for lba in 0..DIRTY_BLOCKS {
        cluster.write(0, lba, 2);
        cluster.run(1);
    }
    cluster.run(300);
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());
    // Node 2 comes back, and from now on each write of either replica takes LAG_MS.
    cluster.storage_held.extend([1, 2]);
    cluster.heal();
    let mut issued_ms: VecDeque<u64> = VecDeque::new();
    let mut back_at = None;
    for step in 0..3_000u64 {
        let byte = 3 + (step % 200) as u8;
        let ops = (0..WRITES_PER_MS)
            .map(|index| {
                steady_write(step, index, WRITES_PER_MS, HOST_LBA..HOST_LBA + HOST_BLOCKS, byte)
            })
            .collect();
        cluster.host_batch(0, ops);
        cluster.run(1);
        cluster.finish_writes_held(&mut issued_ms, LAG_MS);
        if cluster.state().in_sync.len() == 3 {
            back_at = Some(step);
            break;
        }
    }
    let stats = cluster.nodes[0].volume.stats();
    assert!(
        back_at.is_some(),
        "node 2 never came back in sync under load: {} blocks copied, {} resyncs started \
         ({} full), {} completed",
        stats.blocks_resynced,
        stats.resyncs_started,
        stats.resyncs_full,
        stats.resyncs_completed
    );
    assert_eq!(stats.replicas_removed, 1, "only the removal while it was away");
    // Everything it holds back lands, and every copy is the same.
    cluster.storage_held.clear();
    while !cluster.held_writes.is_empty() {
        cluster.finish_write(0);
    }
    cluster.run(500);
    assert_eq!(cluster.state().in_sync.len(), 3);
    assert!(cluster.completions.iter().all(|(_, _, _, result)| result.is_ok()));
    assert_eq!(cluster.nodes[2].disk, cluster.nodes[0].disk);
    assert_eq!(cluster.nodes[1].disk, cluster.nodes[0].disk);
}

/// A returning replica slower than the in-sync one (its writes take LAG_MS, the other's are
/// instant) comes back in sync while hosts keep writing, if the wiring gives host writes only
/// while the primary admits them (`VolumeNode::admits_write`, as `node::replicate` does): the
/// hosts then write at its pace. Given every write at once, its stream fills with live writes
/// it has not acknowledged and it leaves the resync again and again, never back.
#[test]
fn a_slower_returning_replica_comes_back_when_writes_wait_for_admission() {
    let run = |admission: bool| -> (bool, replication::Stats, usize) {
        const HOST_LBA: u64 = 512;
        const HOST_BLOCKS: u64 = 128;
        const WRITES_PER_MS: u64 = 8;
        const LAG_MS: u64 = 40;
        let config = Config {
            volume_blocks: 1024,
            dirty_lbas_max: 1024,
            intent_regions_max: 256,
            ..config()
        };
        let mut cluster = Cluster::started(config);
        cluster.cut_link(0, 2);
        for lba in 0..100 {
            cluster.write(0, lba, 2);
            cluster.run(1);
        }
        cluster.run(300);
        cluster.storage_held.insert(2);
        cluster.heal();
        let mut issued_ms: VecDeque<u64> = VecDeque::new();
        let mut held_back = 0;
        let mut back = false;
        for step in 0..3_000u64 {
            for index in 0..WRITES_PER_MS {
                if admission && !cluster.nodes[0].volume.admits_write() {
                    held_back += 1;
                    break;
                }
                let byte = 3 + (step % 200) as u8;
                let range = HOST_LBA..HOST_LBA + HOST_BLOCKS;
                cluster.host(0, steady_write(step, index, WRITES_PER_MS, range, byte));
            }
            cluster.run(1);
            cluster.finish_writes_held(&mut issued_ms, LAG_MS);
            if cluster.state().in_sync.len() == 3 {
                back = true;
                break;
            }
        }
        cluster.storage_held.clear();
        while !cluster.held_writes.is_empty() {
            cluster.finish_write(0);
        }
        cluster.run(500);
        assert_eq!(cluster.state().in_sync.len(), 3, "back once the load is gone either way");
        assert!(cluster.completions.iter().all(|(_, _, _, result)| result.is_ok()));
        assert_eq!(cluster.nodes[2].disk, cluster.nodes[0].disk);
        assert_eq!(cluster.nodes[1].disk, cluster.nodes[0].disk);
        (back, cluster.nodes[0].volume.stats().clone(), held_back)
    };
    let (back, stats, held_back) = run(true);
    assert!(back, "never back under load with admission: {stats:?}");
    assert!(held_back > 0, "the primary held writes back at some point");
    assert_eq!(stats.resyncs_started, 1, "one resync, never restarted");
    // Without admission, the same replica does not come back while the load lasts.
    let (back, stats, _) = run(false);
    assert!(!back, "back under load without admission: {stats:?}");
    assert!(stats.resyncs_started > 1, "{stats:?}");
}

#[test]
fn failover_reconciles_a_write_only_some_replicas_got() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 1, 1);
    cluster.run(50);
    // A write reaches node 1 only, then node 0 dies before it completes.
    cluster.cut_link(0, 2);
    let lost = cluster.write(0, 1, 2);
    cluster.cut_link(0, 1);
    cluster.store_cut.insert(0);
    assert_eq!(cluster.nodes[1].disk[1], Some(block(2)));
    assert_eq!(cluster.nodes[2].disk[1], Some(block(1)));
    cluster.run(1_000);
    let state = cluster.state();
    assert!(state.epoch >= 2 && state.primary != Some(NodeId(0)), "{state:?}");
    assert!(cluster.completion(lost).is_none_or(|(_, _, _, result)| result.is_err()));
    // Whichever replica was promoted, both now hold the same version of block 1.
    assert_eq!(cluster.nodes[1].disk[1], cluster.nodes[2].disk[1]);
    let primary = state.primary.map(|node| node.0 as usize).expect("a primary");
    assert!(cluster.nodes[primary].volume.stats().blocks_pushed >= 1);
    // And the new primary serves it.
    let read = cluster.host(primary, HostOp::Read { lba: 1, count: 1 });
    let (_, _, _, result) = cluster.completion(read).expect("read").clone();
    assert_eq!(result, Ok(HostReply::Read(vec![cluster.nodes[1].disk[1].clone()])));
}

fn deallocate(lba: u64, count: u32) -> HostOp {
    HostOp::Deallocate { lba, count }
}

fn write_op(lba: u64, bytes: &[u8]) -> HostOp {
    HostOp::Write { lba, blocks: bytes.iter().map(|&byte| block(byte)).collect() }
}

#[test]
fn a_deallocate_unmaps_blocks_on_every_replica() {
    let mut cluster = Cluster::started(config());
    let written = cluster.host(0, write_op(0, &[1, 2, 3, 4]));
    assert_eq!(cluster.result(written), Ok(HostReply::Written));
    let deallocated = cluster.host(0, deallocate(1, 2));
    let (_, _, epoch, result) = cluster.completion(deallocated).expect("completed").clone();
    assert_eq!((epoch, result), (1, Ok(HostReply::Deallocated)));
    let expected = [Some(block(1)), None, None, Some(block(4))];
    for node in &cluster.nodes {
        assert_eq!(node.disk[..4], expected, "every replica holds the deallocate");
    }
    let read = cluster.host(0, HostOp::Read { lba: 0, count: 4 });
    assert_eq!(cluster.result(read), Ok(HostReply::Read(expected.to_vec())));
    let stats = cluster.nodes[0].volume.stats();
    assert_eq!((stats.writes_completed, stats.deallocates_completed), (1, 1));
    assert_eq!(stats.blocks_deallocated, 2);
}

#[test]
fn a_deallocate_may_be_longer_than_a_write_and_no_longer_than_its_limit() {
    let max = DEALLOCATE_BLOCKS_PER_OP_MAX;
    let config = Config { volume_blocks: u64::from(max) + 8, ..config() };
    let volume_blocks = config.volume_blocks;
    let mut cluster = Cluster::started(config);
    let written = cluster.host(0, write_op(0, &[7; BLOCKS_PER_OP_MAX as usize]));
    assert_eq!(cluster.result(written), Ok(HostReply::Written));
    let longest = cluster.host(0, deallocate(0, max));
    assert_eq!(cluster.result(longest), Ok(HostReply::Deallocated));
    for node in &cluster.nodes {
        assert!(node.disk.iter().all(Option::is_none), "the whole range is unmapped everywhere");
    }
    let refused = [
        (deallocate(0, 0), HostError::BadLength { count: 0, max }),
        (deallocate(0, max + 1), HostError::BadLength { count: u64::from(max) + 1, max }),
        (
            deallocate(9, max),
            HostError::OutOfRange { lba: 9, count: u64::from(max), volume_blocks },
        ),
        (deallocate(u64::MAX, 1), HostError::OutOfRange { lba: u64::MAX, count: 1, volume_blocks }),
    ];
    for (op, error) in refused {
        let id = cluster.host(0, op);
        assert_eq!(cluster.result(id), Err(error));
    }
    assert_eq!(cluster.nodes[0].volume.stats().deallocates_completed, 1);
}

#[test]
fn a_deallocate_and_a_write_to_the_same_blocks_apply_in_order() {
    let mut cluster = Cluster::started(config());
    // The write goes first: the deallocate waits for it and wins.
    let ids = cluster.host_batch(0, vec![write_op(4, &[5, 6]), deallocate(3, 4)]);
    assert_eq!(cluster.result(ids[0]), Ok(HostReply::Written));
    assert_eq!(cluster.result(ids[1]), Ok(HostReply::Deallocated));
    // The deallocate goes first: the write waits for it and wins.
    let ids = cluster.host_batch(0, vec![deallocate(10, 4), write_op(11, &[8])]);
    assert_eq!(cluster.result(ids[0]), Ok(HostReply::Deallocated));
    assert_eq!(cluster.result(ids[1]), Ok(HostReply::Written));
    for node in &cluster.nodes {
        assert_eq!(node.disk[3..7], [None, None, None, None]);
        assert_eq!(node.disk[10..14], [None, Some(block(8)), None, None]);
    }
}

#[test]
fn a_resync_copies_the_blocks_deallocated_while_away() {
    let mut cluster = Cluster::started(config());
    cluster.host(0, write_op(0, &[1; 8]));
    cluster.run(50);
    cluster.cut_link(0, 2);
    let deallocated = cluster.host(0, deallocate(2, 5));
    cluster.run(300);
    assert_eq!(cluster.result(deallocated), Ok(HostReply::Deallocated));
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());
    assert_eq!(cluster.nodes[2].disk[2], Some(block(1)), "node 2 missed it");
    cluster.heal();
    cluster.run(500);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 2 is back in sync");
    assert_eq!(cluster.nodes[2].disk, cluster.nodes[0].disk);
    assert_eq!(
        cluster.nodes[2].disk[1..8],
        [Some(block(1)), None, None, None, None, None, Some(block(1))]
    );
    let stats = cluster.nodes[0].volume.stats();
    assert_eq!((stats.resyncs_full, stats.blocks_resynced), (0, 5));
}

/// A replica takes entries of unmapped blocks up to the deallocate limit, entries with data
/// only up to the write limit, and applies an entry only after an earlier write to its blocks.
#[test]
fn a_replica_applies_a_long_unmapped_entry_after_the_write_it_overlaps() {
    let config = Config { volume_blocks: 4096, ..config() };
    let mut node = VolumeNode::new(config, NodeId(1), 1, 5, None);
    let append = |seq: u64, lba: u64, blocks: Vec<BlockData>| Message::Append {
        epoch: 5,
        stream: StreamId(1),
        incarnation: 1,
        seq,
        commit_op: 0,
        entry: Entry { kind: EntryKind::Write { op: seq + 1 }, lba, blocks },
    };
    let deliver = |node: &mut VolumeNode, message: Message| {
        let mut actions = Vec::new();
        node.handle(0, Event::Message { from: NodeId(0), message }, &mut actions);
        actions
    };
    // Data in an entry longer than a write is refused (dropped, never applied nor acknowledged).
    let mut long_with_data = vec![None; BLOCKS_PER_OP_MAX as usize + 1];
    long_with_data[0] = Some(block(3));
    assert_eq!(deliver(&mut node, append(1, 0, long_with_data)), vec![]);
    let too_long = vec![None; DEALLOCATE_BLOCKS_PER_OP_MAX as usize + 1];
    assert_eq!(deliver(&mut node, append(1, 0, too_long)), vec![]);

    let actions = deliver(&mut node, append(1, 100, vec![Some(block(1))]));
    let [Action::StorageWrite { id: first, lba: 100, .. }] = actions[..] else {
        panic!("the write is applied at once: {actions:?}");
    };
    let longest = vec![None; DEALLOCATE_BLOCKS_PER_OP_MAX as usize];
    let actions = deliver(&mut node, append(2, 0, longest.clone()));
    assert!(actions.iter().all(|action| !matches!(action, Action::StorageWrite { .. })));
    let mut actions = Vec::new();
    node.handle(0, Event::Storage { id: first, result: StorageResult::Written }, &mut actions);
    let writes: Vec<&Action> =
        actions.iter().filter(|action| matches!(action, Action::StorageWrite { .. })).collect();
    assert!(
        matches!(writes[..], [Action::StorageWrite { lba: 0, blocks, .. }] if *blocks == longest),
        "the deallocate goes once the write it overlaps is durable: {actions:?}"
    );
}

/// The store's record carries no lease for the primary: it resigned.
fn resigned(actions: &[Action]) -> bool {
    actions.iter().any(|action| {
        matches!(action, Action::Store { request: StoreRequest::Cas { new, .. }, .. }
            if new.primary_lease == LeaseId::NONE)
    })
}

#[test]
fn a_step_down_moves_the_primary_long_before_the_lease_would_expire() {
    step_down_moves_the_primary(config());
}

/// The default timings (10 s leases, 500 ms polls) meet the goal for planned moves: hosts
/// resume within about 2 s.
#[test]
fn a_step_down_moves_the_primary_within_two_seconds_with_default_timings() {
    let took_ms = step_down_moves_the_primary(Config {
        volume_blocks: 32,
        block_size_bytes: BLOCK_BYTES,
        ..Config::default()
    });
    assert!(took_ms < 2_000, "{took_ms} ms");
}

/// Node 0 steps down with commands pending; returns how long until another node served.
fn step_down_moves_the_primary(config: Config) -> u64 {
    let (lease_ms, poll_ms) = (config.lease_ms, config.store_poll_ms);
    let mut cluster = Cluster::new(config);
    while cluster.serving(1) != Some(0) {
        assert!(cluster.now_ms < lease_ms, "node 0 is promoted first");
        cluster.run(5);
    }
    let done = cluster.write(0, 3, 7);
    assert_eq!(cluster.result(done), Ok(HostReply::Written));
    cluster.run(20);
    // A write that node 1 never receives stays pending (node 2 holds it); a read waits for
    // its storage reply, which stays queued.
    cluster.cut_link(0, 1);
    let pending = cluster.write(0, 4, 8);
    cluster.run(20);
    assert!(cluster.completion(pending).is_none());
    assert_eq!(cluster.nodes[2].disk[4], Some(block(8)));
    let read = HostOpId(cluster.next_host_op);
    cluster.next_host_op += 1;
    let op = HostOp::Read { lba: 3, count: 1 };
    cluster.process(Input::Node(0, Event::Host { id: read, op }));
    assert!(cluster.completion(read).is_none() && !cluster.queue.is_empty());

    let started_ms = cluster.now_ms;
    let actions = cluster.step_down(0);
    assert!(resigned(&actions), "{actions:?}");
    assert!(cluster.nodes[0].volume.stepping_down());
    assert_eq!(cluster.nodes[0].volume.stats().step_downs, 1);
    for id in [pending, read] {
        assert_eq!(cluster.result(id), Err(HostError::NotPrimary), "pending commands fail");
    }
    let state = cluster.state();
    assert_eq!((state.epoch, state.primary), (1, Some(NodeId(0))));
    assert_eq!(state.primary_lease, LeaseId::NONE);
    assert_eq!(cluster.serving(1), None, "node 0 stopped serving at once");
    let refused = cluster.write(0, 5, 1);
    assert_eq!(cluster.result(refused), Err(HostError::NotPrimary));

    // The manager promotes another in-sync member at its next poll, not after the lease.
    let new = loop {
        cluster.run(1);
        if let Some(node) = cluster.serving(2) {
            break node;
        }
        assert!(cluster.now_ms < started_ms + lease_ms, "no new primary within a lease");
    };
    let took_ms = cluster.now_ms - started_ms;
    println!("the new primary served {took_ms} ms after the step-down (lease {lease_ms} ms)");
    assert!(took_ms <= 3 * poll_ms, "{took_ms} ms: more than a few store polls");
    assert_ne!(new, 0);
    let state = cluster.state();
    assert_eq!((state.epoch, state.primary), (2, Some(NodeId(new as u32))));
    assert!(!state.in_sync.contains(&NodeId(0)) && state.primary_lease != LeaseId::NONE);

    // The acknowledged write survives; the failed one was reconciled one way on both.
    let read = cluster.host(new, HostOp::Read { lba: 3, count: 1 });
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(7))])));
    assert_eq!(cluster.nodes[1].disk[4], cluster.nodes[2].disk[4]);
    let written = cluster.write(new, 6, 9);
    assert_eq!(cluster.result(written), Ok(HostReply::Written));

    // Node 0 learns the new epoch, ends its step-down, never serves again, and resyncs.
    cluster.heal();
    cluster.run(lease_ms * 2);
    let old = &cluster.nodes[0].volume;
    assert!(!old.stepping_down());
    assert_eq!((old.epoch(), old.serving_epoch(cluster.now_ms)), (2, None));
    assert_eq!(old.stats().terms_started, 1);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 0 is back in sync");
    assert_eq!(cluster.nodes[0].disk, cluster.nodes[new].disk);
    // Its process lived through the move: it was copied block 4 (its failed write), block 6
    // (written since) and block 3 (in the new primary's own divergence: it took over before a
    // heartbeat told it that write 3 committed), not the volume.
    let stats = cluster.nodes[new].volume.stats();
    assert_eq!((stats.resyncs_full, stats.returns_incremental), (0, 1));
    assert_eq!((stats.blocks_pushed, stats.blocks_resynced), (2, 3), "{stats:?}");
    let refused = cluster.write(0, 5, 1);
    assert_eq!(cluster.result(refused), Err(HostError::NotPrimary));
    assert_eq!(cluster.serving(2), Some(new));
    took_ms
}

#[test]
fn a_step_down_does_nothing_on_a_replica_or_when_repeated() {
    let mut cluster = Cluster::started(config());
    assert_eq!(cluster.step_down(1), vec![]);
    assert!(!cluster.nodes[1].volume.stepping_down());
    assert_eq!(cluster.serving(1), Some(0));

    let first = cluster.step_down(0);
    assert!(resigned(&first) && first.len() == 1, "{first:?}");
    assert_eq!(cluster.step_down(0), vec![], "the store already shows the resignation");
    assert!(cluster.nodes[0].volume.stepping_down());
    assert_eq!(cluster.nodes[0].volume.stats().step_downs, 1);
    // A duplicate of the resignation fails on the version and changes nothing.
    let [Action::Store { id, request }] = &first[..] else { unreachable!("checked above") };
    let version = cluster.store.volume().version;
    let reply = cluster.store.handle(cluster.now_ms, request);
    assert!(matches!(reply, StoreReply::CasFailed { .. }), "{reply:?}");
    assert_eq!(cluster.store.volume().version, version);
    let mut actions = Vec::new();
    cluster.nodes[0].volume.handle(cluster.now_ms, Event::Store { id: *id, reply }, &mut actions);
    assert_eq!(actions, vec![]);
}

#[test]
fn a_step_down_with_no_other_in_sync_member_gives_the_role_back() {
    let config = config();
    let lease_ms = config.lease_ms;
    let mut cluster = Cluster::started(config);
    // Both replicas are cut off and removed from the in-sync set.
    cluster.cut_link(0, 1);
    cluster.cut_link(0, 2);
    let write = cluster.write(0, 1, 5);
    cluster.run(300);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    assert_eq!(cluster.state().in_sync, [NodeId(0)].into_iter().collect());

    let started_ms = cluster.now_ms;
    assert!(resigned(&cluster.step_down(0)));
    // No other member holds every completed write: the manager names node 0 again, in a new
    // epoch, which ends its step-down.
    while cluster.serving(2).is_none() {
        cluster.run(1);
        assert!(cluster.now_ms < started_ms + lease_ms, "the volume stays without a primary");
    }
    assert_eq!(cluster.serving(2), Some(0));
    assert!(!cluster.nodes[0].volume.stepping_down());
    let state = cluster.state();
    assert_eq!((state.epoch, state.primary), (2, Some(NodeId(0))));
    let read = cluster.host(0, HostOp::Read { lba: 1, count: 1 });
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(5))])));
}

/// A node the store names primary, whose term has not started (its lease has not arrived),
/// resigns when it steps down and starts no term in that epoch; a newer epoch naming it again
/// ends the step-down.
#[test]
fn a_node_named_primary_steps_down_before_its_term_starts() {
    let mut node = VolumeNode::new(config(), NodeId(0), 1, 0, None);
    let lease = LeaseId(7);
    let named = |epoch: u64, version: u64| replication::Versioned {
        version,
        value: VolumeState {
            epoch,
            primary: Some(NodeId(0)),
            primary_lease: lease,
            in_sync: [NodeId(0)].into_iter().collect(),
            members: [NodeId(0)].into_iter().collect(),
        },
    };
    // A tick, and the store's reply to the read of the volume it makes; all the node did.
    let poll = |node: &mut VolumeNode, now_ms: u64, reply: StoreReply| {
        let mut actions = Vec::new();
        node.handle(now_ms, Event::Tick, &mut actions);
        let id = actions.iter().find_map(|action| match action {
            Action::Store { id, request: StoreRequest::Get } => Some(*id),
            _ => None,
        });
        let id = id.expect("a poll is due");
        node.handle(now_ms, Event::Store { id, reply }, &mut actions);
        actions
    };
    let persist = |node: &mut VolumeNode, epoch: u64| {
        let mut actions = Vec::new();
        node.handle(0, Event::EpochPersisted { epoch }, &mut actions);
    };
    poll(&mut node, 0, StoreReply::Volume(named(1, 2)));
    persist(&mut node, 1);
    assert_eq!(node.serving_epoch(0), None, "no lease yet");
    assert_eq!(node.serving_until(0), None);

    let mut actions = Vec::new();
    node.step_down(1, &mut actions);
    assert!(node.stepping_down());
    let [Action::Store { request: StoreRequest::Cas { expected_version: 2, new, .. }, .. }] =
        &actions[..]
    else {
        panic!("one resignation: {actions:?}");
    };
    assert_eq!((new.epoch, new.primary_lease), (1, LeaseId::NONE));
    // The lease arrives, and the store still names it (the resignation was lost): no term.
    let status = replication::LeaseStatus { lease, valid_until_ms: 10_000 };
    let mut actions = Vec::new();
    node.handle(2, Event::Lease(status), &mut actions);
    assert_eq!(actions, vec![]);
    let actions = poll(&mut node, 200, StoreReply::Volume(named(1, 2)));
    assert_eq!(node.serving_epoch(200), None);
    assert_eq!(node.serving_until(200), None, "a lease, but no term: nothing may be read");
    assert!(resigned(&actions), "the resignation is made again: {actions:?}");

    // The manager had no one else to promote: epoch 2 names the node again, and it serves.
    let actions = poll(&mut node, 400, StoreReply::Volume(named(2, 4)));
    assert!(!node.stepping_down());
    assert!(actions.contains(&Action::PersistEpoch { epoch: 2 }), "{actions:?}");
    persist(&mut node, 2);
    assert_eq!(node.serving_epoch(400), Some(2));
    // Until the lease it serves under expires, and not a millisecond longer.
    assert_eq!(node.serving_until(400), Some(10_000));
    assert_eq!(node.serving_until(9_999), Some(10_000));
    assert_eq!(node.serving_until(10_000), None);
}

/// Runs until node 1 serves epoch 2 (node 0's lease expired while it was cut off).
fn fail_over_to_node_1(cluster: &mut Cluster) {
    let deadline_ms = cluster.now_ms + 4 * cluster.config.lease_ms;
    while cluster.serving(2) != Some(1) {
        assert!(cluster.now_ms < deadline_ms, "no failover: {:?}", cluster.state());
        cluster.run(5);
    }
    let state = cluster.state();
    assert_eq!((state.epoch, state.primary), (2, Some(NodeId(1))));
    assert!(!state.in_sync.contains(&NodeId(0)), "the promotion took node 0 out");
}

/// What happens to node 0's process while it is away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Away {
    /// It lives on (a partition).
    Alive,
    /// It is killed and restarts from what it persisted.
    Restarted,
    /// It restarts and cannot read its write-intent file.
    RestartedWithoutIntent,
}

/// Node 0 (primary of epoch 1) is cut off with a write to block 20 pending that only its own
/// disk holds; node 1 takes over and writes `written`, then everything heals. Returns the
/// pending write.
fn old_primary_away_while(cluster: &mut Cluster, written: &[u64], away: Away) -> HostOpId {
    for lba in 0..8 {
        cluster.write(0, lba, 1);
    }
    cluster.run(50);
    cluster.isolate(0);
    let pending = cluster.write(0, 20, 9);
    assert!(cluster.completion(pending).is_none());
    assert_eq!(cluster.nodes[0].disk[20], Some(block(9)), "the write reached node 0 only");
    fail_over_to_node_1(cluster);
    for &lba in written {
        let id = cluster.write(1, lba, 7);
        assert_eq!(cluster.result(id), Ok(HostReply::Written));
    }
    if away == Away::RestartedWithoutIntent {
        cluster.nodes[0].persisted_intent = None;
    }
    if away != Away::Alive {
        cluster.restart(0);
    }
    cluster.heal();
    cluster.run(500);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 0 is back in sync");
    for node in [0, 2] {
        assert_eq!(cluster.nodes[node].disk, cluster.nodes[1].disk, "node {node} converged");
    }
    pending
}

/// (a) An old primary cut off by a partition (its process survives) comes back after the
/// failover and is sent exactly the blocks written while it was away, plus the block of its
/// write that never completed; nothing else of the volume crosses the network.
#[test]
fn a_partitioned_old_primary_gets_only_the_blocks_changed_while_away() {
    let mut cluster = Cluster::started(config());
    let written = [3, 5, 6, 30];
    assert!(!cluster.nodes[0].volume.primary_elsewhere(), "node 0 is the primary");
    let pending = old_primary_away_while(&mut cluster, &written, Away::Alive);
    assert_eq!(cluster.result(pending), Err(HostError::NotPrimary));
    // The old primary knows the volume moved; the new one does not think so of itself.
    assert!(cluster.nodes[0].volume.primary_elsewhere());
    assert!(cluster.nodes[2].volume.primary_elsewhere());
    assert!(!cluster.nodes[1].volume.primary_elsewhere());
    let stats = cluster.nodes[1].volume.stats();
    assert_eq!((stats.resyncs_started, stats.resyncs_full, stats.resyncs_completed), (1, 0, 1));
    assert_eq!((stats.returns_incremental, stats.returns_full), (1, 0));
    assert_eq!(stats.blocks_resynced, written.len() as u64 + 1, "the writes and block 20");
    assert_eq!(stats.blocks_pushed, 0, "the in-sync replicas did not diverge");
    assert_eq!(cluster.nodes[0].disk[3], Some(block(7)));
}

/// (b) The old primary's last write never completed: when it comes back, the new primary's
/// version of that block (the older, completed write) replaces it, on node 0 as on the replica
/// that also got it; reads see the completed value.
#[test]
fn a_returning_old_primary_loses_its_write_that_never_completed() {
    let mut cluster = Cluster::started(config());
    let done = cluster.write(0, 20, 1);
    assert_eq!(cluster.result(done), Ok(HostReply::Written));
    cluster.run(50);
    // The write reaches node 0 and node 2, never node 1; then node 0 is cut off entirely.
    cluster.cut_link(0, 1);
    cluster.store_cut.insert(0);
    let pending = cluster.write(0, 20, 9);
    cluster.isolate(0);
    assert_eq!(cluster.nodes[2].disk[20], Some(block(9)));
    assert_eq!(cluster.nodes[1].disk[20], Some(block(1)));
    fail_over_to_node_1(&mut cluster);
    assert_eq!(cluster.nodes[2].disk[20], Some(block(1)), "reconciled to node 1's version");
    assert_eq!(cluster.nodes[0].disk[20], Some(block(9)), "node 0 still holds its own");
    cluster.heal();
    cluster.run(500);
    assert_eq!(cluster.result(pending), Err(HostError::NotPrimary));
    assert_eq!(cluster.state().in_sync.len(), 3);
    for node in &cluster.nodes {
        assert_eq!(node.disk[20], Some(block(1)), "the completed write, everywhere");
        assert_eq!(node.disk, cluster.nodes[1].disk);
    }
    let read = cluster.host(1, HostOp::Read { lba: 20, count: 1 });
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(1))])));
    let stats = cluster.nodes[1].volume.stats();
    assert_eq!((stats.blocks_pushed, stats.blocks_resynced), (1, 1), "block 20 to each");
    assert_eq!((stats.returns_incremental, stats.resyncs_full), (1, 0));
}

/// (c) An old primary killed while away (kill -9) restarts from its persisted write intent: it
/// still knows which epoch it was primary of and which regions may hold its uncommitted
/// writes, so it is copied the blocks written while it was away and those regions, not the
/// whole volume; its write that never completed is replaced.
#[test]
fn a_restarted_old_primary_gets_only_the_changes_and_its_intent_regions() {
    let config = config();
    let volume_blocks = config.volume_blocks;
    let mut cluster = Cluster::started(config);
    let written = [3, 5];
    old_primary_away_while(&mut cluster, &written, Away::Restarted);
    let stats = cluster.nodes[1].volume.stats();
    assert_eq!((stats.resyncs_started, stats.resyncs_full), (1, 0));
    assert_eq!((stats.returns_incremental, stats.returns_full), (1, 0));
    let intent = cluster.nodes[0].started_with.clone().expect("node 0 restarted with its intent");
    assert_eq!(intent.term_epoch, 1, "it was the primary of epoch 1");
    let ranges = intent.lbas.expect("its intent is known");
    assert!(ranges.iter().any(|range| range.contains(&20)), "the pending write: {ranges:?}");
    let mut copied: BTreeSet<u64> = written.into_iter().collect();
    copied.extend(ranges.iter().flat_map(Clone::clone));
    assert_eq!(stats.blocks_resynced, copied.len() as u64, "{ranges:?}");
    assert!(stats.blocks_resynced < volume_blocks);
    assert_eq!(cluster.nodes[0].disk[20], None, "its lost write is gone");
}

/// (d) An old primary that restarts without its write intent (the file is gone or cannot be
/// read) cannot know what it may hold: it is copied in full.
#[test]
fn a_restarted_old_primary_without_its_intent_gets_a_full_copy() {
    let config = config();
    let volume_blocks = config.volume_blocks;
    let mut cluster = Cluster::started(config);
    old_primary_away_while(&mut cluster, &[3, 5], Away::RestartedWithoutIntent);
    let stats = cluster.nodes[1].volume.stats();
    assert_eq!((stats.resyncs_started, stats.resyncs_full), (1, 1));
    assert_eq!((stats.returns_incremental, stats.returns_full), (0, 1));
    assert_eq!(stats.blocks_resynced, volume_blocks);
    assert_eq!(cluster.nodes[0].disk[20], None, "its lost write is gone");
}

/// A replica in sync when the new term started, which the new primary could not probe (cut
/// off), is removed and later copied only what the term wrote and what its divergence lists
/// (here the block of the old primary's write that reached it and never completed).
#[test]
fn an_unprobed_replica_gets_only_the_blocks_changed_and_its_divergence() {
    let mut cluster = Cluster::started(config());
    cluster.cut_link(0, 1);
    cluster.store_cut.insert(0);
    let pending = cluster.write(0, 20, 9);
    cluster.isolate(0);
    cluster.cut_link(1, 2);
    assert_eq!(cluster.nodes[2].disk[20], Some(block(9)));
    fail_over_to_node_1(&mut cluster);
    assert_eq!(cluster.state().in_sync, [NodeId(1)].into_iter().collect(), "node 2 removed");
    for lba in [3, 5] {
        let done = cluster.write(1, lba, 7);
        assert_eq!(cluster.result(done), Ok(HostReply::Written));
    }
    cluster.heal();
    cluster.run(500);
    assert_eq!(cluster.result(pending), Err(HostError::NotPrimary));
    assert_eq!(cluster.state().in_sync.len(), 3);
    for node in &cluster.nodes {
        assert_eq!(node.disk, cluster.nodes[1].disk);
    }
    assert_eq!(cluster.nodes[2].disk[20], None);
    let stats = cluster.nodes[1].volume.stats();
    assert_eq!((stats.resyncs_started, stats.resyncs_full), (2, 0));
    assert_eq!((stats.returns_incremental, stats.returns_full), (2, 0));
    assert_eq!(stats.blocks_resynced, 3 + 3, "blocks 3, 5 and 20 to each of nodes 0 and 2");
}

fn read_op(lba: u64, count: u32) -> HostOp {
    HostOp::Read { lba, count }
}

#[test]
fn a_block_damaged_on_the_primary_is_read_from_a_replica_and_rewritten() {
    let mut cluster = Cluster::started(config());
    let write = cluster.write(0, 3, 7);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    cluster.nodes[0].damaged.insert(3);
    // Blocks 2..5 span two regions of the write intent, and only the one block 3's write
    // used is in it: the host gets its data at once, the rewrite waits for the intent.
    let read = cluster.host(0, read_op(2, 3));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![None, Some(block(7)), None])));
    let served: u64 = (1..3).map(|node| cluster.nodes[node].volume.stats().peer_reads_served).sum();
    assert_eq!(served, 1, "one replica was asked");
    assert_eq!(cluster.nodes[0].volume.stats().blocks_repaired, 0);
    cluster.run(100);
    assert!(cluster.nodes[0].damaged.is_empty(), "the primary rewrote its copy");
    assert_eq!(cluster.nodes[0].disk[3], Some(block(7)));
    let stats = cluster.nodes[0].volume.stats().clone();
    assert_eq!((stats.reads_repaired, stats.blocks_repaired, stats.reads_unrecovered), (1, 3, 0));
    assert!(!cluster.nodes[0].volume.latched(), "damaged data is not a failed drive");
    assert_eq!(cluster.nodes[0].volume.serving_epoch(cluster.now_ms), Some(1));
    // Read again: the block is whole here now.
    let again = cluster.host(0, read_op(3, 1));
    assert_eq!(cluster.result(again), Ok(HostReply::Read(vec![Some(block(7))])));
    assert_eq!(cluster.nodes[0].volume.stats().reads_repaired, 1);
    // Writes still complete, and the next read of the block sees them.
    let write = cluster.write(0, 3, 8);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    let after = cluster.host(0, read_op(3, 1));
    assert_eq!(cluster.result(after), Ok(HostReply::Read(vec![Some(block(8))])));
}

#[test]
fn a_replica_with_a_damaged_copy_too_sends_the_primary_to_the_next_one() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 5, 9);
    for node in 0..2 {
        cluster.nodes[node].damaged.insert(5);
    }
    let read = cluster.host(0, read_op(5, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(9))])));
    assert_eq!(cluster.nodes[2].volume.stats().peer_reads_served, 1);
    assert!(!cluster.nodes[1].volume.latched());
    // Node 1 learnt that its copy is damaged: the primary, whole again, sends it its copy.
    assert_eq!(cluster.nodes[1].volume.stats().damaged_noted, 1);
    cluster.run(200);
    assert!(cluster.nodes[1].damaged.is_empty());
    assert_eq!(cluster.nodes[1].disk[5], Some(block(9)));
    assert_eq!(cluster.nodes[0].volume.stats().blocks_sent_for_repair, 1);
}

#[test]
fn a_block_damaged_on_every_copy_fails_only_its_read() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 5, 9);
    cluster.write(0, 6, 10);
    for node in 0..3 {
        cluster.nodes[node].damaged.insert(5);
    }
    let read = cluster.host(0, read_op(4, 2));
    assert_eq!(cluster.result(read), Err(HostError::Damaged { lba: 4, count: 2 }));
    assert_eq!(cluster.nodes[0].volume.stats().reads_unrecovered, 1);
    let other = cluster.host(0, read_op(6, 1));
    assert_eq!(cluster.result(other), Ok(HostReply::Read(vec![Some(block(10))])));
    let write = cluster.write(0, 5, 11);
    assert_eq!(cluster.result(write), Ok(HostReply::Written), "the volume still takes writes");
    let read = cluster.host(0, read_op(5, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(11))])));
    assert!((0..3).all(|node| !cluster.nodes[node].volume.latched()));
}

#[test]
fn a_repair_does_not_write_a_copy_older_than_a_host_write_to_the_block() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 3, 7);
    cluster.nodes[0].damaged.insert(3);
    // The read and a write of the same block arrive together: the write is pending when the
    // replica is asked, so its copy answers the read but is not written over the new data.
    let ids = cluster.host_batch(0, vec![read_op(3, 1), write_op(3, &[8])]);
    let read = cluster.result(ids[0]);
    assert!(
        [Ok(HostReply::Read(vec![Some(block(7))])), Ok(HostReply::Read(vec![Some(block(8))]))]
            .contains(&read),
        "{read:?}"
    );
    assert_eq!(cluster.result(ids[1]), Ok(HostReply::Written));
    let stats = cluster.nodes[0].volume.stats().clone();
    assert_eq!((stats.reads_repaired, stats.blocks_repaired), (1, 0));
    assert_eq!(cluster.nodes[0].disk[3], Some(block(8)));
    cluster.run(100);
    let after = cluster.host(0, read_op(3, 1));
    assert_eq!(cluster.result(after), Ok(HostReply::Read(vec![Some(block(8))])));
}

#[test]
fn a_repair_asks_again_when_its_replica_is_silent_and_the_term_end_fails_it() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 3, 7);
    cluster.nodes[0].damaged.insert(3);
    // Neither replica answers: the read waits (asked again, then the next replica, until each
    // is removed from the in-sync set), then fails as damaged once no replica is left.
    cluster.cut_link(0, 1);
    cluster.cut_link(0, 2);
    let read = cluster.host(0, read_op(3, 1));
    assert!(cluster.completion(read).is_none());
    cluster.run(100);
    assert!(cluster.completion(read).is_none(), "still waiting for the replicas");
    cluster.run(400);
    let (_, _, _, result) = cluster.completion(read).expect("completed").clone();
    assert!(
        [Err(HostError::Damaged { lba: 3, count: 1 }), Err(HostError::NotPrimary)]
            .contains(&result),
        "{result:?}"
    );
}

#[test]
fn a_block_the_scrub_found_damaged_on_a_replica_is_sent_again_by_the_primary() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 3, 7);
    cluster.nodes[1].damaged.insert(3);
    assert!(cluster.nodes[1].volume.note_damaged(3));
    assert!(cluster.nodes[1].volume.is_damaged(3));
    cluster.run(100);
    assert!(cluster.nodes[1].damaged.is_empty(), "the primary's copy replaced it");
    assert!(!cluster.nodes[1].volume.is_damaged(3));
    assert!(!cluster.nodes[1].volume.note_damaged(1 << 20), "outside the volume");
    assert_eq!(cluster.nodes[1].disk[3], Some(block(7)));
    let replica = cluster.nodes[1].volume.stats().clone();
    assert_eq!((replica.damaged_noted, replica.damaged_rewritten), (1, 1));
    assert_eq!(cluster.nodes[0].volume.stats().blocks_sent_for_repair, 1);
    // Nothing more is asked once it is whole, and writes go on as before.
    cluster.run(300);
    assert_eq!(cluster.nodes[0].volume.stats().blocks_sent_for_repair, 1);
    let write = cluster.write(0, 3, 8);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    assert_eq!(cluster.nodes[1].disk[3], Some(block(8)));
}

/// The primary's copy for a replica's damaged block goes out while hosts keep writing, though
/// the replica's stream then always holds tens of live writes it has not acknowledged yet:
/// a repair counts against the copies on the stream, not against everything on it. Before,
/// it was dropped whenever the stream held `COPY_WINDOW_MAX` entries of any kind, so under a
/// steady load a damaged replica block was never rewritten.
#[test]
fn a_replica_s_damaged_block_is_repaired_while_hosts_keep_writing() {
    const HOST_LBA: u64 = 512;
    const HOST_BLOCKS: u64 = 128;
    const WRITES_PER_MS: u64 = 4;
    const LAG_MS: u64 = 20;
    let config = Config { volume_blocks: 1024, intent_regions_max: 256, ..config() };
    let mut cluster = Cluster::started(config);
    cluster.write(0, 3, 7);
    cluster.storage_held.extend([1, 2]);
    let mut issued_ms: VecDeque<u64> = VecDeque::new();
    let mut step = 0u64;
    let mut load = |cluster: &mut Cluster, ms: u64| {
        for _ in 0..ms {
            let ops = (0..WRITES_PER_MS)
                .map(|index| {
                    steady_write(step, index, WRITES_PER_MS, HOST_LBA..HOST_LBA + HOST_BLOCKS, 9)
                })
                .collect();
            cluster.host_batch(0, ops);
            cluster.run(1);
            cluster.finish_writes_held(&mut issued_ms, LAG_MS);
            step += 1;
        }
    };
    load(&mut cluster, 100);
    cluster.nodes[1].damaged.insert(3);
    assert!(cluster.nodes[1].volume.note_damaged(3));
    load(&mut cluster, 1_000);
    assert_eq!(cluster.state().in_sync.len(), 3, "both replicas kept up");
    assert!(cluster.nodes[0].volume.stats().blocks_sent_for_repair >= 1, "the copy went out");
    assert!(cluster.nodes[1].damaged.is_empty(), "the primary's copy replaced it");
    assert!(!cluster.nodes[1].volume.is_damaged(3));
    assert_eq!(cluster.nodes[1].disk[3], Some(block(7)));
}

#[test]
fn a_block_the_scrub_found_damaged_on_the_primary_is_rewritten_from_a_replica() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 3, 7);
    cluster.nodes[0].damaged.insert(3);
    assert!(cluster.nodes[0].volume.note_damaged(3));
    cluster.run(100);
    assert!(cluster.nodes[0].damaged.is_empty());
    let stats = cluster.nodes[0].volume.stats().clone();
    assert_eq!((stats.blocks_repaired, stats.damaged_rewritten, stats.reads_repaired), (1, 1, 0));
    let read = cluster.host(0, read_op(3, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(7))])));
}

#[test]
fn a_damaged_block_a_host_write_replaces_needs_no_repair() {
    let mut cluster = Cluster::started(config());
    cluster.write(0, 3, 7);
    for node in 0..2 {
        cluster.nodes[node].damaged.insert(3);
        assert!(cluster.nodes[node].volume.note_damaged(3));
    }
    // The write is handled before the next tick acts on the damaged blocks.
    let write = cluster.write(0, 3, 9);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    cluster.run(100);
    for node in 0..2 {
        let stats = cluster.nodes[node].volume.stats().clone();
        assert_eq!(stats.damaged_rewritten, 1, "node {node}: {stats:?}");
        assert_eq!(cluster.nodes[node].disk[3], Some(block(9)));
    }
    let sent = cluster.nodes[0].volume.stats();
    assert_eq!((sent.blocks_sent_for_repair, sent.blocks_repaired), (0, 0));
}

/// Node 2 misses a write to block 5 (cut off until it is removed from the in-sync set), then
/// node 0's copy of block 5 is damaged and node 2 is let back: its resync must copy block 5.
fn resync_meets_damage(damaged_on: &[usize]) -> Cluster {
    let mut cluster = Cluster::started(config());
    cluster.cut_link(0, 2);
    cluster.cut_link(1, 2);
    let write = cluster.write(0, 5, 9);
    cluster.run(400);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    assert!(!cluster.state().in_sync.contains(&NodeId(2)), "node 2 was removed");
    for &node in damaged_on {
        cluster.nodes[node].damaged.insert(5);
    }
    cluster.heal();
    cluster.run(1_000);
    cluster
}

#[test]
fn a_resync_that_meets_a_damaged_block_has_it_repaired_from_another_replica_first() {
    let mut cluster = resync_meets_damage(&[0]);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 2 is back in sync: {:?}", cluster.state());
    assert_eq!(cluster.nodes[2].disk[5], Some(block(9)));
    assert!(cluster.nodes[0].damaged.is_empty(), "node 0's copy was repaired from node 1");
    let stats = cluster.nodes[0].volume.stats().clone();
    assert!(stats.damaged_noted >= 1 && stats.blocks_repaired >= 1, "{stats:?}");
    assert!(!cluster.nodes[0].volume.latched());
    let read = cluster.host(0, read_op(5, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(9))])));
}

#[test]
fn a_resync_waits_while_no_good_copy_is_in_sync_and_the_volume_still_serves() {
    let mut cluster = resync_meets_damage(&[0, 1]);
    assert_eq!(cluster.state().in_sync.len(), 2, "node 2 cannot be copied block 5 yet");
    assert!(!cluster.nodes[0].volume.latched(), "the primary serves on");
    let read = cluster.host(0, read_op(5, 1));
    assert_eq!(cluster.result(read), Err(HostError::Damaged { lba: 5, count: 1 }));
    let other = cluster.write(0, 6, 3);
    assert_eq!(cluster.result(other), Ok(HostReply::Written));
    // A host write replaces the block: the resync goes on and ends.
    let write = cluster.write(0, 5, 10);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    cluster.run(1_000);
    assert_eq!(cluster.state().in_sync.len(), 3, "{:?}", cluster.state());
    assert_eq!(cluster.nodes[2].disk[5], Some(block(10)));
    assert_eq!(cluster.nodes[2].disk[6], Some(block(3)));
}

/// Node 0 writes block 1 (byte 1) on every node, then a second write of it (byte 2) reaches
/// node 2 alone before node 0 is cut off for good; node 1, whose copy of block 1 is damaged
/// (`damaged_on`), is promoted and reconciles. Returns the cluster once node 1 serves epoch 2.
fn reconcile_meets_damage(nodes: u32, damaged_on: &[usize]) -> Cluster {
    let mut cluster = Cluster::started_with_nodes(config(), nodes);
    let first = cluster.write(0, 1, 1);
    assert_eq!(cluster.result(first), Ok(HostReply::Written));
    // Heartbeats tell the replicas the write committed: it leaves their divergence lists.
    cluster.run(50);
    for other in (1..nodes as usize).filter(|&node| node != 2) {
        cluster.cut_link(0, other);
    }
    let lost = cluster.write(0, 1, 2);
    assert!(cluster.completion(lost).is_none());
    assert_eq!(cluster.nodes[2].disk[1], Some(block(2)), "the write reached node 2");
    assert_eq!(cluster.nodes[1].disk[1], Some(block(1)));
    cluster.isolate(0);
    for &node in damaged_on {
        cluster.nodes[node].damaged.insert(1);
    }
    cluster
}

#[test]
fn a_reconciliation_takes_a_block_damaged_on_the_new_primary_from_a_probed_member() {
    let mut cluster = reconcile_meets_damage(3, &[1]);
    // Node 2's divergence lists block 1, so node 1 pushes its copy, which it cannot read:
    // it takes node 2's, writes it, pushes it, and serves.
    fail_over_to_node_1(&mut cluster);
    let stats = cluster.nodes[1].volume.stats().clone();
    assert_eq!((stats.reconcile_damaged, stats.reconcile_repaired), (1, 1), "{stats:?}");
    assert_eq!(stats.reconcile_unrecovered, 0);
    assert!(!cluster.nodes[1].volume.latched());
    assert!(cluster.nodes[1].damaged.is_empty(), "the new primary rewrote its copy");
    for node in [1, 2] {
        assert_eq!(cluster.nodes[node].disk[1], Some(block(2)), "node {node}");
    }
    assert_eq!(cluster.nodes[2].volume.stats().peer_reads_served, 1);
    let read = cluster.host(1, read_op(1, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(2))])));
    // The old primary comes back and ends with the same blocks.
    cluster.heal();
    cluster.run(500);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 0 is back in sync");
    for node in [0, 2] {
        assert_eq!(cluster.nodes[node].disk, cluster.nodes[1].disk, "node {node} converged");
    }
}

#[test]
fn a_block_a_reconciliation_took_from_a_member_reaches_the_members_already_reconciled() {
    // Four nodes: node 3 never got the second write, so nothing of it needs pushing (it is
    // reconciled at once), but node 1 takes node 2's copy of block 1: node 3 must get it too.
    let mut cluster = reconcile_meets_damage(4, &[1]);
    fail_over_to_node_1(&mut cluster);
    assert_eq!(cluster.nodes[1].volume.stats().reconcile_repaired, 1);
    assert!(!cluster.nodes[1].volume.latched());
    for node in 1..4 {
        assert_eq!(cluster.nodes[node].disk[1], Some(block(2)), "node {node} holds the copy");
    }
    let write = cluster.write(1, 1, 3);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
}

#[test]
fn a_reconciliation_with_no_good_copy_of_a_damaged_block_stops_the_node() {
    // Node 2's copy is damaged too: no probed member has one, and node 1 stops as on an I/O
    // error rather than serve a volume whose members may differ on the block.
    let mut cluster = reconcile_meets_damage(3, &[1, 2]);
    cluster.run(4 * cluster.config.lease_ms);
    let stats = cluster.nodes[1].volume.stats().clone();
    assert_eq!((stats.reconcile_damaged, stats.reconcile_unrecovered), (1, 1), "{stats:?}");
    assert!(cluster.nodes[1].volume.latched());
    assert_eq!(cluster.nodes[1].volume.serving_epoch(cluster.now_ms), None);
}

/// Grows every node but those in `late` to 64 blocks, then writes block 40 on node 0.
fn grow_and_write_beyond_the_old_end(cluster: &mut Cluster, late: &[usize]) -> HostOpId {
    let before = cluster.write(0, 5, 1);
    assert_eq!(cluster.result(before), Ok(HostReply::Written));
    let refused = cluster.host(0, write_op(40, &[2]));
    assert!(matches!(cluster.result(refused), Err(HostError::OutOfRange { .. })));
    for node in (0..cluster.nodes.len()).filter(|node| !late.contains(node)) {
        cluster.grow(node, 64);
    }
    cluster.host(0, write_op(40, &[3]))
}

/// The primary grows first: its replicas refuse the entry beyond their size, so the write
/// waits; once they grow, the entry sent again lands and the write completes with every
/// replica in sync. After a failover the new primary serves it.
#[test]
fn a_write_beyond_the_old_end_waits_until_the_replicas_have_grown_too() {
    let mut cluster = Cluster::started(config());
    let write = grow_and_write_beyond_the_old_end(&mut cluster, &[1, 2]);
    cluster.run(60);
    assert!(cluster.completion(write).is_none(), "no replica holds block 40 yet");
    for node in [1, 2] {
        assert!(cluster.nodes[node].volume.stats().entries_refused > 0);
        assert_eq!(cluster.nodes[node].disk[5], Some(block(1)));
        cluster.grow(node, 64);
    }
    cluster.run(100);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    assert_eq!(cluster.state().in_sync.len(), 3, "every replica stayed in sync");
    for node in [1, 2] {
        assert_eq!(cluster.nodes[node].disk, cluster.nodes[0].disk, "node {node}");
    }
    let read = cluster.host(0, read_op(39, 3));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![None, Some(block(3)), None])));

    cluster.isolate(0);
    fail_over_to_node_1(&mut cluster);
    let read = cluster.host(1, read_op(40, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![Some(block(3))])));
    let write = cluster.host(1, write_op(63, &[4]));
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
}

/// A replica that never grows holds the write only until it is removed from the in-sync set;
/// grown later, it is resynced with the blocks beyond the old end like any other.
#[test]
fn a_replica_that_does_not_grow_is_removed_then_resynced_once_it_has() {
    let mut cluster = Cluster::started(config());
    let write = grow_and_write_beyond_the_old_end(&mut cluster, &[2]);
    cluster.run(400);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    assert_eq!(cluster.state().in_sync, [NodeId(0), NodeId(1)].into_iter().collect());
    cluster.grow(2, 64);
    cluster.run(500);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 2 is back in sync");
    assert_eq!(cluster.nodes[2].disk, cluster.nodes[0].disk);
    assert_eq!(cluster.nodes[2].disk[40], Some(block(3)));
}

/// A replica out of sync with the whole volume to copy when the volume grows gets the new
/// blocks copied too.
#[test]
fn a_full_copy_under_way_when_the_volume_grows_reaches_the_new_end() {
    let config = Config { dirty_lbas_max: 3, ..config() };
    let mut cluster = Cluster::started(config);
    cluster.cut_link(0, 2);
    for lba in [0, 3, 5, 6, 20] {
        cluster.write(0, lba, 2);
        cluster.run(10);
    }
    cluster.run(300);
    assert_eq!(cluster.state().in_sync.len(), 2);
    for node in 0..3 {
        cluster.grow(node, 64);
    }
    let write = cluster.host(0, write_op(50, &[6]));
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    cluster.heal();
    cluster.run(800);
    assert_eq!(cluster.state().in_sync.len(), 3, "node 2 is back in sync");
    let stats = cluster.nodes[0].volume.stats();
    assert_eq!((stats.resyncs_full, stats.blocks_resynced), (1, 64));
    assert_eq!(cluster.nodes[2].disk, cluster.nodes[0].disk);
}

/// A replica grown before the new primary holds an uncommitted write beyond the primary's end:
/// the primary takes its divergence only once it has grown too, so the copy that settles the
/// member reaches that block (a copy of the old size would leave it behind, and a later
/// failover to the member would read a write that never completed after reads saw none).
#[test]
fn a_primary_smaller_than_a_member_copies_its_divergence_only_once_grown() {
    let mut cluster = Cluster::started(config());
    cluster.grow(0, 64);
    cluster.grow(1, 64);
    // Block 40 reaches node 1 only (node 2 refuses it), and node 0 is cut off before the
    // write completes; node 1 cannot reach the store, so node 2 is promoted.
    let pending = cluster.host(0, write_op(40, &[3]));
    assert_eq!(cluster.nodes[1].disk[40], Some(block(3)));
    cluster.isolate(0);
    cluster.store_cut.insert(1);
    let deadline_ms = cluster.now_ms + 4 * cluster.config.lease_ms;
    while cluster.serving(2) != Some(2) {
        assert!(cluster.now_ms < deadline_ms, "no failover to node 2: {:?}", cluster.state());
        cluster.run(5);
    }
    cluster.store_cut.remove(&1);
    cluster.run(300);
    assert!(cluster.completion(pending).is_none_or(|(_, _, _, result)| result.is_err()));
    let read = cluster.host(2, read_op(0, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![None])));
    cluster.grow(2, 64);
    cluster.run(600);
    let state = cluster.state();
    assert_eq!(state.primary, Some(NodeId(2)));
    assert!(state.in_sync.contains(&NodeId(1)), "node 1 is in sync: {state:?}");
    let read = cluster.host(2, read_op(40, 1));
    assert_eq!(cluster.result(read), Ok(HostReply::Read(vec![None])));
    assert_eq!(cluster.nodes[1].disk[40], None, "the write that never completed is undone");
    assert_eq!(cluster.nodes[1].disk, cluster.nodes[2].disk);
}

/// A snapshot of a replicated volume is taken when `quiet_copies` answers: only while no
/// write is pending, and naming exactly the replicas whose copies match the primary's.
#[test]
fn quiet_copies_names_the_replicas_alike_only_while_no_write_is_pending() {
    let mut cluster = Cluster::started(config());
    let ids = [NodeId(1), NodeId(2)];
    assert_eq!(cluster.nodes[0].volume.quiet_copies(cluster.now_ms), Some((1, ids.to_vec())));
    assert_eq!(cluster.nodes[1].volume.quiet_copies(cluster.now_ms), None, "not on a replica");

    // A write in flight on the primary's own storage: not quiet until it completes.
    cluster.storage_held.insert(0);
    let write = cluster.write(0, 4, 9);
    cluster.run(20);
    assert_eq!(cluster.nodes[0].volume.quiet_copies(cluster.now_ms), None);
    cluster.storage_held.clear();
    cluster.finish_write(0);
    cluster.run(20);
    assert_eq!(cluster.result(write), Ok(HostReply::Written));
    assert_eq!(cluster.nodes[0].volume.quiet_copies(cluster.now_ms), Some((1, ids.to_vec())));
    for node in 1..3 {
        assert_eq!(cluster.nodes[node].disk, cluster.nodes[0].disk);
    }

    // Node 2 misses writes and leaves the in-sync set: no longer named, nor while it is
    // copied back, until it is in sync again.
    cluster.cut_link(0, 2);
    cluster.write(0, 5, 1);
    cluster.run(300);
    assert_eq!(cluster.nodes[0].volume.quiet_copies(cluster.now_ms), Some((1, vec![NodeId(1)])));
    assert_ne!(cluster.nodes[2].disk, cluster.nodes[0].disk);
    cluster.heal();
    let mut named_while_different = false;
    for _ in 0..100 {
        cluster.run(5);
        if let Some((_, copies)) = cluster.nodes[0].volume.quiet_copies(cluster.now_ms) {
            for node in copies {
                let node = node.0 as usize;
                named_while_different |= cluster.nodes[node].disk != cluster.nodes[0].disk;
            }
        }
    }
    assert!(!named_while_different, "a replica is named only once its copy matches");
    assert_eq!(cluster.nodes[0].volume.quiet_copies(cluster.now_ms), Some((1, ids.to_vec())));
}
