//! The simulated cluster: nodes (a `VolumeNode` and a `LeaseKeeper` over a simulated disk),
//! the control store (`MemStore`), the manager, one host, and a network between them, all
//! driven by one event queue in simulated time and one seeded random generator, so a seed
//! replays exactly.
//!
//! The host writes, deallocates (small ranges, and now and then most of the volume, as mkfs
//! does), reads and flushes. Every message between nodes goes through the wire format (encoded
//! in an envelope and decoded again), as it would over TCP.
//!
//! Faults injected: message loss, duplication, delay and reordering (delay spikes); partitions
//! (one node from everyone, the primary from everyone but the host, the primary from the store
//! only, the host from the primary, random splits); node crashes (in-flight messages and
//! storage requests are lost; a random part of the in-flight writes reaches the disk; the disk,
//! the persisted epoch and the persisted write intent survive, a persist in flight landing or
//! not) and restarts, alone or a replica then the primary within an ack timeout (so the new
//! primary probes the restarted replica); manager crashes; disk write and read errors;
//! planned moves (the primary steps down, and now and then stops once the store named the next
//! primary, as in a rolling restart).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use replication::wire::{self, Envelope};
use replication::{
    Action, BlockData, Config, Event, HostError, HostOp, HostOpId, HostReply, LeaseKeeper, Manager,
    MemStore, Message, NodeId, Stats, StorageOpId, StorageResult, StoreReply, StoreRequest,
    StoreRequestId, VolumeNode, VolumeState, WriteIntent, DEALLOCATE_BLOCKS_PER_OP_MAX,
};

use super::checker::{encode, Checker, VALUE_BYTES};

const NODE_TICK_MS: u64 = 10;
/// Kinds of fault `World::inject_fault` knows.
const FAULT_KINDS: u16 = 13;
const FAULT_KINDS_ALL: u16 = (1 << FAULT_KINDS) - 1;
const HOST_TICK_MS: u64 = 5;
const MANAGER_TICK_MS: u64 = 20;
const HOST_TIMEOUT_MS: u64 = 250;
const HOST_RETRY_MS: u64 = 15;
const TRACE_LINES_MAX: usize = 400_000;
/// Simulated time allowed, after the faults stop, for the cluster to heal and settle.
const QUIESCE_MS_MAX: u64 = 40_000;
/// The volume id every frame of the simulation carries.
const VOLUME_ID: u64 = 0xF0_1D;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Endpoint {
    Node(usize),
    Host,
    Store,
    Manager,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Volume,
    Lease,
    /// One of the managers (two run at once in some runs: an old leader that has not noticed).
    Manager(usize),
}

#[derive(Debug, Clone)]
enum Payload {
    Message(Message),
    /// Host commands travel on a connection (one per node process, re-made after the host
    /// gives up on it): like TCP, they are never duplicated, and a command still in flight on a
    /// connection the host reset, or to a process that has since restarted, is lost.
    HostRequest {
        op: u64,
        attempt: u32,
        command: HostOp,
        connection: u64,
        incarnation: u64,
    },
    HostResponse {
        op: u64,
        attempt: u32,
        result: Result<HostReply, HostError>,
        connection: u64,
    },
    StoreRequest {
        origin: Origin,
        id: StoreRequestId,
        request: StoreRequest,
    },
    StoreResponse {
        origin: Origin,
        id: StoreRequestId,
        reply: StoreReply,
    },
}

#[derive(Debug)]
enum SimEvent {
    NodeTick(usize),
    HostTick,
    ManagerTick(usize),
    Deliver {
        from: Endpoint,
        to: Endpoint,
        payload: Payload,
    },
    StorageDone {
        node: usize,
        incarnation: u64,
        id: StorageOpId,
    },
    PersistDone {
        node: usize,
        incarnation: u64,
        epoch: u64,
    },
    IntentPersistDone {
        node: usize,
        incarnation: u64,
        version: u64,
    },
    Fault,
    Restart(usize),
    /// Crash a node (the second half of a double fault).
    Crash(usize),
    /// A node that stepped down stops (and restarts later) once the step-down is over or at
    /// `deadline_ms`, as a node does on SIGTERM.
    StopWhenMoved {
        node: usize,
        incarnation: u64,
        deadline_ms: u64,
    },
    ManagerRestart(usize),
    Heal(u64),
    /// The volume's record grows to this many blocks (the control plane's resize).
    Grow(u64),
    /// A node learns of the grow and grows its storage and state machine.
    NodeGrow(usize),
}

#[derive(Debug)]
enum DiskOp {
    Write { lba: u64, blocks: Vec<BlockData> },
    Read { lba: u64, count: u32 },
}

struct SimNode {
    up: bool,
    incarnation: u64,
    persisted_epoch: u64,
    disk: Vec<BlockData>,
    disk_ops: BTreeMap<StorageOpId, DiskOp>,
    persist_in_flight: Option<u64>,
    /// The write intent on disk, like the epoch: only what a persist made durable survives a
    /// crash (a persist in flight lands whole or not at all, as a rename does).
    persisted_intent: Option<WriteIntent>,
    intent_in_flight: Option<(u64, WriteIntent)>,
    volume: VolumeNode,
    lease: LeaseKeeper,
    disk_fault_until_ms: u64,
    /// Blocks whose data fails its checksum here (a crash keeps them): a read of any answers
    /// `Damaged` until a write replaces it.
    damaged: BTreeSet<u64>,
    /// Host commands in flight here: id -> (host op, attempt, connection).
    host_commands: BTreeMap<HostOpId, (u64, u32, u64)>,
}

#[derive(Debug, Clone)]
enum Command {
    Write { lba: u64, count: u64 },
    Deallocate { lba: u64, count: u32 },
    Read { lba: u64, count: u32 },
    Flush,
}

#[derive(Debug)]
struct HostCommand {
    command: Command,
    attempt_sent_ms: Vec<u64>,
    retry_at_ms: Option<u64>,
    /// The node and connection the current attempt went to.
    sent_on: Option<(usize, u64)>,
}

struct Partition {
    /// Endpoint pairs that cannot talk (both directions).
    blocked: BTreeSet<(Endpoint, Endpoint)>,
}

/// Per-seed settings, drawn from the seed.
#[derive(Debug, Clone)]
pub struct Settings {
    pub nodes: usize,
    pub members: usize,
    pub block_bytes: usize,
    pub host_depth: usize,
    pub fault_ms: u64,
    pub drop_probability: f64,
    pub duplicate_probability: f64,
    pub spike_probability: f64,
    /// Which kinds of fault this run injects (a bit per kind of `World::inject_fault`), so
    /// some runs hammer one kind.
    pub fault_kinds: u16,
    /// Extra delay of each node's outgoing messages, so one replica lags the other.
    pub node_delay_ms: Vec<u64>,
    /// How often the host gives up a write that failed instead of retrying it, so the blocks of
    /// writes in flight at a failover stay as the failover left them.
    pub abandon_probability: f64,
    /// Managers running at once.
    pub managers: usize,
    /// The volume grows during the faulty phase: when, and to how many blocks (the record's
    /// new size; each node learns it after a delay of its own, some after `ack_timeout_ms`).
    pub grows: Vec<(u64, u64)>,
    pub config: Config,
}

impl Settings {
    pub fn draw(rng: &mut StdRng) -> Settings {
        let volume_blocks = [64, 128, 256][rng.random_range(0..3)];
        let small = rng.random_bool(0.3);
        let config = Config {
            volume_blocks,
            block_size_bytes: 32,
            lease_ms: 400,
            keepalive_interval_ms: 100,
            store_poll_ms: 50,
            store_timeout_ms: 150,
            heartbeat_ms: 30,
            retransmit_ms: 40,
            ack_timeout_ms: 150,
            hello_interval_ms: 100,
            copy_blocks_per_tick: rng.random_range(1..=16),
            dirty_lbas_max: if small { rng.random_range(2..=8) } else { 1024 },
            divergence_ranges_max: if small { rng.random_range(2..=8) } else { 1024 },
            intent_region_blocks: [1, 4, 16, 64][rng.random_range(0..4)],
            intent_regions_max: if rng.random_bool(0.2) { rng.random_range(1..=4) } else { 256 },
            // Short lingers leave regions cold, so writes often wait for the intent to grow
            // and a crash often finds a grow in flight.
            intent_linger_ms: if rng.random_bool(0.5) {
                rng.random_range(10..=100)
            } else {
                rng.random_range(100..=2_000)
            },
            grace_ms: rng.random_range(500..=3000),
        };
        let nodes = rng.random_range(3..=4);
        let fault_kinds = match rng.random_range(0..4) {
            0 => FAULT_KINDS_ALL,
            1 => 1 << rng.random_range(0..FAULT_KINDS),
            _ => rng.random_range(1..=FAULT_KINDS_ALL),
        };
        let node_delay_ms = (0..nodes)
            .map(|_| if rng.random_bool(0.3) { rng.random_range(0..=8) } else { 0 })
            .collect();
        let abandon_probability =
            if rng.random_bool(0.7) { rng.random_range(0.2..0.9) } else { 0.0 };
        let managers = if rng.random_bool(0.2) { 2 } else { 1 };
        let mut settings = Settings {
            nodes,
            managers,
            abandon_probability,
            fault_kinds,
            node_delay_ms,
            members: 3,
            block_bytes: 32,
            host_depth: rng.random_range(1..=8),
            fault_ms: rng.random_range(2000..=5000),
            drop_probability: rng.random_range(0.0..0.05),
            duplicate_probability: rng.random_range(0.0..0.03),
            spike_probability: rng.random_range(0.0..0.05),
            grows: Vec::new(),
            config,
        };
        // Drawn last, so a seed's other settings are what they were before the volume grew.
        if rng.random_bool(0.4) {
            let mut blocks = volume_blocks;
            let mut grows = Vec::new();
            for _ in 0..rng.random_range(1..=2) {
                // Often not a multiple of the intent's regions: a short last region.
                blocks += rng.random_range(1..=volume_blocks);
                grows.push((rng.random_range(300..settings.fault_ms), blocks));
            }
            // Sizes only grow with time.
            let mut times: Vec<u64> = grows.iter().map(|&(at_ms, _)| at_ms).collect();
            times.sort_unstable();
            for (grow, at_ms) in grows.iter_mut().zip(times) {
                grow.0 = at_ms;
            }
            settings.grows = grows;
        }
        settings
    }
}

/// What a run found, for the report.
#[derive(Debug, Default)]
pub struct Outcome {
    pub violations: Vec<String>,
    pub writes_completed: u64,
    pub reads_checked: u64,
    pub final_epoch: u64,
    pub end_ms: u64,
    pub faults: u64,
    pub stats: Stats,
    /// For each step-down of the store's primary: how long until the store held a newer epoch
    /// (faults injected meanwhile may delay it; one still waiting at the end is left out).
    pub move_ms: Vec<u64>,
    pub trace_tail: Vec<String>,
    /// Returns of old primaries whose process restarted (kill -9) since their term.
    pub restarted_returns: Returns,
}

/// How members that came back were copied.
#[derive(Debug, Default, Clone, Copy)]
pub struct Returns {
    pub incremental: u64,
    pub full: u64,
}

/// Adds `more` to `total`, counter by counter.
pub fn add_stats(total: &mut Stats, more: &Stats) {
    total.terms_started += more.terms_started;
    total.terms_ended += more.terms_ended;
    total.writes_completed += more.writes_completed;
    total.deallocates_completed += more.deallocates_completed;
    total.blocks_deallocated += more.blocks_deallocated;
    total.writes_failed += more.writes_failed;
    total.replicas_removed += more.replicas_removed;
    total.resyncs_started += more.resyncs_started;
    total.resyncs_full += more.resyncs_full;
    total.returns_incremental += more.returns_incremental;
    total.returns_full += more.returns_full;
    total.resyncs_completed += more.resyncs_completed;
    total.blocks_resynced += more.blocks_resynced;
    total.blocks_pushed += more.blocks_pushed;
    total.reconciled_full += more.reconciled_full;
    total.step_downs += more.step_downs;
    total.intent_persists += more.intent_persists;
    total.reads_repaired += more.reads_repaired;
    total.blocks_repaired += more.blocks_repaired;
    total.reads_unrecovered += more.reads_unrecovered;
    total.peer_reads_served += more.peer_reads_served;
    total.damaged_noted += more.damaged_noted;
    total.damaged_rewritten += more.damaged_rewritten;
    total.blocks_sent_for_repair += more.blocks_sent_for_repair;
    total.reconcile_damaged += more.reconcile_damaged;
    total.reconcile_repaired += more.reconcile_repaired;
    total.reconcile_unrecovered += more.reconcile_unrecovered;
}

pub struct World {
    rng: StdRng,
    now_ms: u64,
    queue: BTreeMap<(u64, u64), SimEvent>,
    next_event: u64,
    settings: Settings,
    nodes: Vec<SimNode>,
    store: MemStore,
    managers: Vec<Option<Manager>>,
    host: BTreeMap<u64, HostCommand>,
    next_host_op: u64,
    next_host_command: u64,
    host_issuing: bool,
    /// The host's current connection to each node.
    host_connections: Vec<u64>,
    partitions: BTreeMap<u64, Partition>,
    next_partition: u64,
    faults_on: bool,
    faults: u64,
    /// Blocks damaged on some node at some time (`damage_block`).
    ever_damaged: BTreeSet<u64>,
    /// Counters of node processes that have ended.
    stats: Stats,
    /// A step-down of the store's primary waiting for a promotion: (its epoch, when).
    moving: Option<(u64, u64)>,
    move_ms: Vec<u64>,
    /// The node the store named primary of each epoch, and its incarnation then.
    primary_of_epoch: BTreeMap<u64, (usize, u64)>,
    restarted_returns: Returns,
    checker: Checker,
    trace: Option<Vec<String>>,
    trace_all: bool,
}

impl World {
    pub fn new(seed: u64, trace: bool) -> World {
        let mut rng = StdRng::seed_from_u64(seed);
        let settings = Settings::draw(&mut rng);
        let settings_nodes = settings.nodes;
        let settings_managers = settings.managers;
        let config = &settings.config;
        let members: BTreeSet<NodeId> = (0..settings.members as u32).map(NodeId).collect();
        let initial = VolumeState {
            epoch: 0,
            primary: None,
            primary_lease: replication::LeaseId::NONE,
            in_sync: members.clone(),
            members,
        };
        let nodes = (0..settings.nodes)
            .map(|index| SimNode {
                up: true,
                incarnation: 1,
                persisted_epoch: 0,
                disk: vec![None; config.volume_blocks as usize],
                disk_ops: BTreeMap::new(),
                persist_in_flight: None,
                persisted_intent: None,
                intent_in_flight: None,
                volume: VolumeNode::new(config.clone(), NodeId(index as u32), 1, 0, None),
                lease: LeaseKeeper::new(NodeId(index as u32), 1, config),
                disk_fault_until_ms: 0,
                damaged: BTreeSet::new(),
                host_commands: BTreeMap::new(),
            })
            .collect();
        let mut world = World {
            rng,
            now_ms: 0,
            queue: BTreeMap::new(),
            next_event: 0,
            store: MemStore::new(initial, config.lease_ms),
            managers: (0..settings_managers).map(|_| Some(Manager::new(config))).collect(),
            settings,
            nodes,
            host: BTreeMap::new(),
            next_host_op: 1,
            next_host_command: 1,
            host_issuing: true,
            host_connections: vec![1; settings_nodes],
            partitions: BTreeMap::new(),
            next_partition: 1,
            faults_on: true,
            faults: 0,
            ever_damaged: BTreeSet::new(),
            stats: Stats::default(),
            moving: None,
            move_ms: Vec::new(),
            primary_of_epoch: BTreeMap::new(),
            restarted_returns: Returns::default(),
            checker: Checker::default(),
            trace: trace.then(Vec::new),
            trace_all: std::env::var_os("FERRITE_SIM_TRACE_ALL").is_some(),
        };
        for node in 0..world.nodes.len() {
            world.schedule(node as u64 % NODE_TICK_MS, SimEvent::NodeTick(node));
        }
        world.schedule(1, SimEvent::HostTick);
        for manager in 0..world.managers.len() {
            world.schedule(3 + manager as u64 * 7, SimEvent::ManagerTick(manager));
        }
        world.schedule(500, SimEvent::Fault);
        for (at_ms, blocks) in world.settings.grows.clone() {
            world.schedule(at_ms, SimEvent::Grow(blocks));
        }
        world
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    fn schedule(&mut self, delay_ms: u64, event: SimEvent) {
        self.next_event += 1;
        self.queue.insert((self.now_ms + delay_ms, self.next_event), event);
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if let Some(trace) = &mut self.trace {
            if trace.len() == TRACE_LINES_MAX {
                trace.drain(..TRACE_LINES_MAX / 2);
            }
            let line = line();
            trace.push(format!("{:>6} {line}", self.now_ms));
        }
    }

    /// Runs the faulty phase, then heals and waits for the cluster to settle, then checks.
    pub fn run(mut self) -> Outcome {
        let fault_end_ms = self.settings.fault_ms;
        while self.now_ms < fault_end_ms {
            self.step();
            if !self.checker.violations.is_empty() {
                return self.finish();
            }
        }
        self.heal_everything();
        let deadline_ms = fault_end_ms + QUIESCE_MS_MAX;
        let mut settled_since: Option<u64> = None;
        while self.now_ms < deadline_ms {
            self.step();
            if !self.checker.violations.is_empty() {
                return self.finish();
            }
            if self.settled() {
                let since = *settled_since.get_or_insert(self.now_ms);
                if self.now_ms >= since + 300 {
                    self.final_checks();
                    return self.finish();
                }
            } else {
                settled_since = None;
            }
        }
        let state = self.store.volume().value.clone();
        let pending: Vec<_> =
            self.host.iter().map(|(op, cmd)| (op, &cmd.command)).take(5).collect();
        let problem = format!(
            "the cluster did not settle within {QUIESCE_MS_MAX} ms of healing: store {state:?}, \
             host commands pending {} (first {pending:?})",
            self.host.len()
        );
        self.checker.violations.push(problem);
        self.finish()
    }

    fn finish(mut self) -> Outcome {
        for node in &self.nodes {
            add_stats(&mut self.stats, node.volume.stats());
        }
        Outcome {
            stats: self.stats,
            move_ms: self.move_ms,
            violations: self.checker.violations,
            writes_completed: self.checker.writes_completed,
            reads_checked: self.checker.reads_checked,
            final_epoch: self.store.volume().value.epoch,
            end_ms: self.now_ms,
            faults: self.faults,
            trace_tail: self.trace.unwrap_or_default(),
            restarted_returns: self.restarted_returns,
        }
    }

    /// Nothing left to do: no host command pending, every member in sync, a primary serving,
    /// every node grown to the volume's size.
    fn settled(&self) -> bool {
        let state = &self.store.volume().value;
        let Some(primary) = state.primary else { return false };
        let node = &self.nodes[primary.0 as usize];
        self.host.is_empty()
            && state.in_sync == state.members
            && node.up
            && node.volume.serving_epoch(self.now_ms) == Some(state.epoch)
            && self.nodes.iter().all(|node| node.disk_ops.is_empty())
            && self
                .nodes
                .iter()
                .all(|node| node.disk.len() as u64 == self.settings.config.volume_blocks)
    }

    fn final_checks(&mut self) {
        let state = self.store.volume().value.clone();
        let Some(primary) = state.primary else { return };
        let reference = self.nodes[primary.0 as usize].disk.clone();
        for (lba, block) in reference.iter().enumerate() {
            self.checker.check_read(lba as u64, block, self.now_ms, self.now_ms);
        }
        for member in &state.in_sync {
            let disk = &self.nodes[member.0 as usize].disk;
            if disk.len() != reference.len() {
                self.checker.violations.push(format!(
                    "in-sync replica {member} holds {} blocks, primary {primary} {}",
                    disk.len(),
                    reference.len()
                ));
                continue;
            }
            let differing: Vec<usize> =
                (0..disk.len()).filter(|&lba| disk[lba] != reference[lba]).take(8).collect();
            if !differing.is_empty() {
                self.checker.violations.push(format!(
                    "in-sync replica {member} differs from primary {primary} at blocks {differing:?}"
                ));
            }
        }
    }

    fn heal_everything(&mut self) {
        self.log(|| "faults stop: heal partitions, restart nodes and manager".into());
        self.faults_on = false;
        self.host_issuing = false;
        self.partitions.clear();
        self.settings.drop_probability = 0.0;
        self.settings.duplicate_probability = 0.0;
        self.settings.spike_probability = 0.0;
        for node in 0..self.nodes.len() {
            self.nodes[node].disk_fault_until_ms = 0;
            // Damaged blocks go too, as if restored from a backup, and their node restarts (it
            // remembers them as damaged otherwise): a block damaged on the only in-sync copy
            // holds up every resync that must copy it, so the cluster could never settle.
            if !self.nodes[node].damaged.is_empty() {
                self.nodes[node].damaged.clear();
                self.crash(node);
            }
            if !self.nodes[node].up {
                self.schedule(1, SimEvent::Restart(node));
            }
        }
        for manager in 0..self.managers.len() {
            if self.managers[manager].is_none() {
                self.schedule(1, SimEvent::ManagerRestart(manager));
            }
        }
    }

    fn step(&mut self) {
        let Some(((at_ms, _), event)) = self.queue.pop_first() else {
            unreachable!("ticks keep the queue non-empty");
        };
        assert!(at_ms >= self.now_ms, "time never goes back");
        self.now_ms = at_ms;
        match event {
            SimEvent::NodeTick(node) => {
                self.schedule(NODE_TICK_MS, SimEvent::NodeTick(node));
                if self.nodes[node].up && self.nodes[node].volume.latched() {
                    // The operator's answer to a failed drive: replace it, restart the process.
                    self.log(|| format!("n{node} is latched: restart it"));
                    self.crash(node);
                }
                if self.nodes[node].up {
                    // Asserts its own bounds (nothing copied beyond what is to copy).
                    let _ = self.nodes[node].volume.resync_progress();
                    if let Some(call) = self.nodes[node].lease.tick(self.now_ms) {
                        let payload = Payload::StoreRequest {
                            origin: Origin::Lease,
                            id: call.id,
                            request: call.request,
                        };
                        self.send(Endpoint::Node(node), Endpoint::Store, payload);
                    }
                    self.node_event(node, Event::Tick);
                }
            }
            SimEvent::HostTick => {
                self.schedule(HOST_TICK_MS, SimEvent::HostTick);
                self.host_tick();
            }
            SimEvent::ManagerTick(manager) => {
                self.schedule(MANAGER_TICK_MS, SimEvent::ManagerTick(manager));
                let now_ms = self.now_ms;
                let call = self.managers[manager].as_mut().and_then(|manager| manager.tick(now_ms));
                if let Some(call) = call {
                    let payload = Payload::StoreRequest {
                        origin: Origin::Manager(manager),
                        id: call.id,
                        request: call.request,
                    };
                    self.send(Endpoint::Manager, Endpoint::Store, payload);
                }
            }
            SimEvent::Deliver { from, to, payload } => self.deliver(from, to, payload),
            SimEvent::StorageDone { node, incarnation, id } => {
                self.storage_done(node, incarnation, id)
            }
            SimEvent::PersistDone { node, incarnation, epoch } => {
                let sim = &mut self.nodes[node];
                if sim.up && sim.incarnation == incarnation {
                    sim.persist_in_flight = None;
                    sim.persisted_epoch = sim.persisted_epoch.max(epoch);
                    self.node_event(node, Event::EpochPersisted { epoch });
                }
            }
            SimEvent::IntentPersistDone { node, incarnation, version } => {
                let sim = &mut self.nodes[node];
                if sim.up && sim.incarnation == incarnation {
                    if let Some((in_flight, intent)) = sim.intent_in_flight.take() {
                        assert_eq!(in_flight, version, "one intent persist in flight at a time");
                        sim.persisted_intent = Some(intent);
                    }
                    self.node_event(node, Event::IntentPersisted { version });
                }
            }
            SimEvent::Fault => {
                if self.faults_on {
                    self.inject_fault();
                    let next = self.rng.random_range(200..900);
                    self.schedule(next, SimEvent::Fault);
                }
            }
            SimEvent::Restart(node) => self.restart(node),
            SimEvent::Crash(node) => {
                if self.faults_on {
                    self.crash(node);
                }
            }
            SimEvent::StopWhenMoved { node, incarnation, deadline_ms } => {
                let sim = &self.nodes[node];
                if sim.up && sim.incarnation == incarnation {
                    if sim.volume.stepping_down() && self.now_ms < deadline_ms {
                        let event = SimEvent::StopWhenMoved { node, incarnation, deadline_ms };
                        self.schedule(NODE_TICK_MS, event);
                    } else {
                        self.log(|| format!("n{node} stops for a restart"));
                        self.crash(node);
                    }
                }
            }
            SimEvent::ManagerRestart(manager) => {
                if self.managers[manager].is_none() {
                    self.log(|| format!("manager {manager} restarts"));
                    self.managers[manager] = Some(Manager::new(&self.settings.config));
                }
            }
            SimEvent::Heal(partition) => {
                if self.partitions.remove(&partition).is_some() {
                    self.log(|| format!("partition {partition} heals"));
                }
            }
            SimEvent::Grow(blocks) => {
                self.log(|| format!("the volume grows to {blocks} blocks"));
                self.settings.config.volume_blocks = blocks;
                for node in 0..self.nodes.len() {
                    // Mostly soon, sometimes after a replica would be removed for its silence.
                    let delay_ms = if self.rng.random_bool(0.2) {
                        self.rng.random_range(150..1500)
                    } else {
                        self.rng.random_range(0..100)
                    };
                    self.schedule(delay_ms, SimEvent::NodeGrow(node));
                }
            }
            SimEvent::NodeGrow(node) => self.grow(node),
        }
    }

    /// `node` grows to the record's size, as the node's reconciler does (a node that is down
    /// grows when it restarts).
    fn grow(&mut self, node: usize) {
        let blocks = self.settings.config.volume_blocks;
        let sim = &mut self.nodes[node];
        if !sim.up || sim.disk.len() as u64 >= blocks {
            return;
        }
        sim.disk.resize(blocks as usize, None);
        sim.volume.grow(blocks);
        self.log(|| format!("n{node} grows to {blocks} blocks"));
    }

    fn blocked(&self, from: Endpoint, to: Endpoint) -> bool {
        let pair = (from.min(to), from.max(to));
        self.partitions.values().any(|partition| partition.blocked.contains(&pair))
    }

    fn send(&mut self, from: Endpoint, to: Endpoint, payload: Payload) {
        let manager_link = from == Endpoint::Manager || to == Endpoint::Manager;
        let host_link = from == Endpoint::Host || to == Endpoint::Host;
        if !manager_link && self.rng.random_bool(self.settings.drop_probability) {
            return;
        }
        let duplicate = !manager_link
            && !host_link
            && self.rng.random_bool(self.settings.duplicate_probability);
        let copies = if duplicate { 2 } else { 1 };
        let lag_ms = match from {
            Endpoint::Node(node) => self.settings.node_delay_ms[node],
            _ => 0,
        };
        for _ in 0..copies {
            let mut delay_ms = self.rng.random_range(1..=4) + lag_ms;
            if self.rng.random_bool(self.settings.spike_probability) {
                delay_ms += self.rng.random_range(10..=120);
            }
            let payload = payload.clone();
            self.schedule(delay_ms, SimEvent::Deliver { from, to, payload });
        }
    }

    fn deliver(&mut self, from: Endpoint, to: Endpoint, payload: Payload) {
        // A partition that starts while a message is in flight stops it too.
        if self.blocked(from, to) {
            return;
        }
        match (to, payload) {
            (Endpoint::Store, Payload::StoreRequest { origin, id, request }) => {
                let before = self.store.volume().value.epoch;
                let in_sync_before = self.store.volume().value.in_sync.clone();
                let reply = self.store.handle(self.now_ms, &request);
                let after = self.store.volume().value.epoch;
                self.check_joined(after == before, &in_sync_before);
                if after != before {
                    if let Some(primary) = self.store.volume().value.primary {
                        let node = primary.0 as usize;
                        self.primary_of_epoch.insert(after, (node, self.nodes[node].incarnation));
                    }
                    if let Some((epoch, since_ms)) = self.moving {
                        if after > epoch {
                            self.move_ms.push(self.now_ms - since_ms);
                            self.moving = None;
                        }
                    }
                    let primary = self.store.volume().value.primary;
                    self.log(|| format!("store: epoch {before} -> {after}, primary {primary:?}"));
                    if self.trace.is_some() {
                        let state = self.store.volume().value.clone();
                        if let Some(primary) = state.primary {
                            for member in &state.in_sync {
                                let (a, b) = (
                                    &self.nodes[primary.0 as usize].disk,
                                    &self.nodes[member.0 as usize].disk,
                                );
                                let differing: Vec<usize> =
                                    (0..a.len()).filter(|&lba| a[lba] != b[lba]).collect();
                                self.log(|| format!("at promotion, {member} differs from {primary} at {differing:?}"));
                            }
                        }
                    }
                }
                if let StoreReply::CasDone(state) = &reply {
                    self.log(|| format!("store: {from:?} set {state:?}"));
                }
                self.send(Endpoint::Store, from, Payload::StoreResponse { origin, id, reply });
            }
            (
                Endpoint::Manager,
                Payload::StoreResponse { id, reply, origin: Origin::Manager(manager) },
            ) => {
                let now_ms = self.now_ms;
                let call = self.managers[manager]
                    .as_mut()
                    .and_then(|state| state.on_reply(now_ms, id, &reply));
                if let Some(call) = call {
                    self.log(|| format!("manager: {:?}", call.request));
                    let payload = Payload::StoreRequest {
                        origin: Origin::Manager(manager),
                        id: call.id,
                        request: call.request,
                    };
                    self.send(Endpoint::Manager, Endpoint::Store, payload);
                }
            }
            (Endpoint::Node(node), payload) => {
                if !self.nodes[node].up {
                    return;
                }
                match payload {
                    Payload::Message(message) => {
                        let Endpoint::Node(sender) = from else { return };
                        let routine =
                            matches!(message, Message::Heartbeat { .. } | Message::Ack { .. });
                        if !routine || self.trace_all {
                            self.log(|| format!("n{sender} -> n{node}: {}", short(&message)));
                        }
                        let last_term = match message {
                            Message::Hello { last_term_epoch, .. } => Some(last_term_epoch),
                            _ => None,
                        };
                        let before = self.nodes[node].volume.stats().clone();
                        let event = Event::Message { from: NodeId(sender as u32), message };
                        self.node_event(node, event);
                        if let Some(last_term) = last_term {
                            self.count_restarted_return(node, sender, last_term, &before);
                        }
                    }
                    Payload::StoreResponse { origin: Origin::Lease, id, reply } => {
                        if let Some(status) = self.nodes[node].lease.on_reply(id, &reply) {
                            self.node_event(node, Event::Lease(status));
                        }
                    }
                    Payload::StoreResponse { origin: _, id, reply } => {
                        self.node_event(node, Event::Store { id, reply });
                    }
                    Payload::HostRequest { op, attempt, command, connection, incarnation } => {
                        if connection != self.host_connections[node]
                            || incarnation != self.nodes[node].incarnation
                        {
                            return;
                        }
                        self.log(|| format!("n{node}: host {op}.{attempt} {}", brief_op(&command)));
                        let id = HostOpId(self.next_host_command);
                        self.next_host_command += 1;
                        self.nodes[node].host_commands.insert(id, (op, attempt, connection));
                        self.node_event(node, Event::Host { id, op: command });
                    }
                    _ => {}
                }
            }
            (Endpoint::Host, Payload::HostResponse { op, attempt, result, connection }) => {
                let Endpoint::Node(node) = from else { return };
                if connection == self.host_connections[node] {
                    self.host_response(op, attempt, result);
                }
            }
            _ => {}
        }
    }

    /// Counts the return of an old primary whose process restarted since its term: the `Hello`
    /// that `primary` just took from `sender` started its resync, and `sender` names the term
    /// of a process older than its current one.
    fn count_restarted_return(
        &mut self,
        primary: usize,
        sender: usize,
        last_term: u64,
        before: &Stats,
    ) {
        let restarted =
            self.primary_of_epoch.get(&last_term).is_some_and(|&(node, incarnation)| {
                node == sender && incarnation < self.nodes[sender].incarnation
            });
        if !restarted {
            return;
        }
        let after = self.nodes[primary].volume.stats().clone();
        if after.returns_incremental > before.returns_incremental {
            self.restarted_returns.incremental += 1;
            self.log(|| format!("n{sender} returns incrementally after a restart"));
        }
        if after.returns_full > before.returns_full {
            self.restarted_returns.full += 1;
            self.log(|| format!("n{sender} returns with a full copy after a restart"));
        }
    }

    /// Check 2 for every member the last store change added to the in-sync set (within an
    /// epoch: a promotion adds none).
    fn check_joined(&mut self, same_epoch: bool, in_sync_before: &BTreeSet<NodeId>) {
        let state = &self.store.volume().value;
        let Some(primary) = state.primary.map(|node| node.0 as usize) else { return };
        if !same_epoch {
            return;
        }
        let joined: Vec<usize> =
            state.in_sync.difference(in_sync_before).map(|node| node.0 as usize).collect();
        for member in joined {
            self.log(|| format!("store: n{member} joins the in-sync set"));
            let (member_disk, primary_disk) = (&self.nodes[member].disk, &self.nodes[primary].disk);
            self.checker.joined_in_sync(self.now_ms, member, member_disk, primary, primary_disk);
        }
    }

    fn node_event(&mut self, node: usize, event: Event) {
        let mut actions = Vec::new();
        self.nodes[node].volume.handle(self.now_ms, event, &mut actions);
        for action in actions {
            self.node_action(node, action);
        }
    }

    fn node_action(&mut self, node: usize, action: Action) {
        match action {
            Action::Send { to, message } => {
                let message = through_the_wire(NodeId(node as u32), message);
                let payload = Payload::Message(message);
                self.send(Endpoint::Node(node), Endpoint::Node(to.0 as usize), payload);
            }
            Action::StorageWrite { id, lba, blocks } => {
                self.log(|| {
                    format!("n{node}: disk write {} at {lba}: {}", id.0, describe(lba, &blocks))
                });
                self.nodes[node].disk_ops.insert(id, DiskOp::Write { lba, blocks });
                self.schedule_storage(node, id);
            }
            Action::StorageRead { id, lba, count } => {
                self.nodes[node].disk_ops.insert(id, DiskOp::Read { lba, count });
                self.schedule_storage(node, id);
            }
            Action::PersistEpoch { epoch } => {
                let sim = &mut self.nodes[node];
                sim.persist_in_flight = Some(epoch);
                let incarnation = sim.incarnation;
                let delay_ms = self.rng.random_range(1..=3);
                self.schedule(delay_ms, SimEvent::PersistDone { node, incarnation, epoch });
            }
            Action::PersistIntent { version, intent } => {
                let sim = &mut self.nodes[node];
                assert!(sim.intent_in_flight.is_none(), "n{node}: two intent persists in flight");
                // The file as the node writes it must read back the same.
                let bytes = intent.to_bytes();
                assert_eq!(WriteIntent::from_bytes(&bytes).as_ref(), Ok(&intent));
                sim.intent_in_flight = Some((version, intent));
                let incarnation = sim.incarnation;
                // A file, its fsync and a rename: now and then slow, which widens the window in
                // which a crash finds a persist in flight.
                let mut delay_ms = self.rng.random_range(1..=3);
                if self.rng.random_bool(0.2) {
                    delay_ms += self.rng.random_range(10..=100);
                }
                let event = SimEvent::IntentPersistDone { node, incarnation, version };
                self.schedule(delay_ms, event);
            }
            Action::Store { id, request } => {
                let payload = Payload::StoreRequest { origin: Origin::Volume, id, request };
                self.send(Endpoint::Node(node), Endpoint::Store, payload);
            }
            Action::CompleteHost { id, epoch, result } => {
                let host_op = self.nodes[node].host_commands.get(&id).copied();
                self.log(|| {
                    format!(
                        "n{node}: host {host_op:?} done under epoch {epoch}: {}",
                        brief(&result)
                    )
                });
                if result.is_ok() {
                    let store_epoch = self.store.volume().value.epoch;
                    self.checker.node_completed(self.now_ms, node, epoch, store_epoch);
                }
                if let Some((op, attempt, connection)) = self.nodes[node].host_commands.remove(&id)
                {
                    let payload = Payload::HostResponse { op, attempt, result, connection };
                    self.send(Endpoint::Node(node), Endpoint::Host, payload);
                }
            }
        }
    }

    fn schedule_storage(&mut self, node: usize, id: StorageOpId) {
        let mut delay_ms = self.rng.random_range(1..=3);
        if self.rng.random_bool(0.02) {
            delay_ms += self.rng.random_range(5..=40);
        }
        let incarnation = self.nodes[node].incarnation;
        self.schedule(delay_ms, SimEvent::StorageDone { node, incarnation, id });
    }

    fn storage_done(&mut self, node: usize, incarnation: u64, id: StorageOpId) {
        let faulty =
            self.nodes[node].disk_fault_until_ms > self.now_ms && self.rng.random_bool(0.3);
        let sim = &mut self.nodes[node];
        if !sim.up || sim.incarnation != incarnation {
            return;
        }
        let Some(op) = sim.disk_ops.remove(&id) else { return };
        let result = match op {
            DiskOp::Write { lba, blocks } => {
                for (index, block) in blocks.into_iter().enumerate() {
                    // A failed write may have reached the disk in part.
                    if !faulty || self.rng.random_bool(0.5) {
                        sim.disk[lba as usize + index] = block;
                        sim.damaged.remove(&(lba + index as u64));
                    }
                }
                if faulty {
                    StorageResult::Failed
                } else {
                    StorageResult::Written
                }
            }
            DiskOp::Read { lba, count } => {
                if faulty {
                    StorageResult::Failed
                } else if sim.damaged.range(lba..lba + u64::from(count)).next().is_some() {
                    StorageResult::Damaged
                } else {
                    let range = lba as usize..lba as usize + count as usize;
                    StorageResult::Read(sim.disk[range].to_vec())
                }
            }
        };
        self.log(|| format!("n{node}: disk op {} done, failed: {faulty}", id.0));
        self.node_event(node, Event::Storage { id, result });
    }

    fn crash(&mut self, node: usize) {
        if !self.nodes[node].up {
            return;
        }
        self.log(|| format!("n{node} crashes"));
        add_stats(&mut self.stats, self.nodes[node].volume.stats());
        // A machine that loses power loses what it had not sent yet: each message of its still
        // in flight is lost or not.
        let unsent: Vec<(u64, u64)> = self
            .queue
            .iter()
            .filter(|(_, event)| matches!(event, SimEvent::Deliver { from: Endpoint::Node(from), .. } if *from == node))
            .map(|(&key, _)| key)
            .collect();
        for key in unsent {
            if self.rng.random_bool(0.5) {
                self.queue.remove(&key);
            }
        }
        let sim = &mut self.nodes[node];
        // Every write a serving primary has in flight is one of its pending host writes.
        let serving = sim.volume.serving_epoch(self.now_ms).is_some();
        sim.up = false;
        // Writes in flight reach the disk or not, block by block.
        let mut landed = Vec::new();
        for (_, op) in std::mem::take(&mut sim.disk_ops) {
            if let DiskOp::Write { lba, blocks } = op {
                for (index, block) in blocks.into_iter().enumerate() {
                    if self.rng.random_bool(0.5) {
                        sim.disk[lba as usize + index] = block;
                        landed.push(lba + index as u64);
                    }
                }
            }
        }
        if let Some(epoch) = sim.persist_in_flight.take() {
            if self.rng.random_bool(0.5) {
                sim.persisted_epoch = sim.persisted_epoch.max(epoch);
            }
        }
        if let Some((_, intent)) = sim.intent_in_flight.take() {
            if self.rng.random_bool(0.5) {
                sim.persisted_intent = Some(intent);
            }
        }
        // Check 4: the write intent that survives covers every uncommitted write that landed
        // (crate docs, "Write intent"), unless it says unknown.
        let known = sim.persisted_intent.as_ref().and_then(|intent| intent.lbas.as_ref());
        if let (true, Some(ranges)) = (serving, known) {
            let outside: Vec<u64> = landed
                .into_iter()
                .filter(|lba| !ranges.iter().any(|range| range.contains(lba)))
                .take(8)
                .collect();
            if !outside.is_empty() {
                self.checker.violations.push(format!(
                    "n{node} crashed as primary with host writes landing at blocks {outside:?}, \
                     outside its persisted write intent {ranges:?}"
                ));
            }
        }
        sim.host_commands.clear();
        let down_ms = self.rng.random_range(50..1500);
        self.schedule(down_ms, SimEvent::Restart(node));
    }

    fn restart(&mut self, node: usize) {
        let config = self.settings.config.clone();
        let sim = &mut self.nodes[node];
        if sim.up {
            return;
        }
        sim.up = true;
        sim.incarnation += 1;
        sim.disk_fault_until_ms = 0;
        let id = NodeId(node as u32);
        let intent = sim.persisted_intent.clone();
        // A node starts with the size its volume's record has now.
        sim.disk.resize(config.volume_blocks as usize, None);
        sim.volume =
            VolumeNode::new(config.clone(), id, sim.incarnation, sim.persisted_epoch, intent);
        sim.lease = LeaseKeeper::new(id, sim.incarnation, &config);
        // The scrub's first pass after a start finds the damage the disk holds.
        for &lba in &sim.damaged {
            sim.volume.note_damaged(lba);
        }
        let (incarnation, epoch) = (sim.incarnation, sim.persisted_epoch);
        self.log(|| format!("n{node} restarts (incarnation {incarnation}, epoch {epoch})"));
    }

    fn partition(&mut self, blocked: BTreeSet<(Endpoint, Endpoint)>, what: String) {
        let id = self.next_partition;
        self.next_partition += 1;
        self.log(|| format!("partition {id}: {what}"));
        self.partitions.insert(id, Partition { blocked });
        let heal_ms = self.rng.random_range(100..1500);
        self.schedule(heal_ms, SimEvent::Heal(id));
    }

    fn endpoints(&self) -> Vec<Endpoint> {
        let mut all: Vec<Endpoint> = (0..self.nodes.len()).map(Endpoint::Node).collect();
        all.push(Endpoint::Host);
        all.push(Endpoint::Store);
        all
    }

    /// Cuts `node` off from every endpoint except those in `keep`.
    fn isolate(&mut self, node: usize, keep: &[Endpoint], what: &str) {
        let me = Endpoint::Node(node);
        let blocked = self
            .endpoints()
            .into_iter()
            .filter(|other| *other != me && !keep.contains(other))
            .map(|other| (me.min(other), me.max(other)))
            .collect();
        self.partition(blocked, format!("{what} n{node}"));
    }

    fn inject_fault(&mut self) {
        self.faults += 1;
        let nodes = self.nodes.len();
        let primary = self.store.volume().value.primary.map(|node| node.0 as usize);
        let random_node = self.rng.random_range(0..nodes);
        let target = primary.unwrap_or(random_node);
        let forced = std::env::var("FERRITE_SIM_FAULTS").ok().and_then(|mask| mask.parse().ok());
        let kinds = forced.unwrap_or(self.settings.fault_kinds);
        let allowed: Vec<u16> = (0..FAULT_KINDS).filter(|kind| kinds & (1 << kind) != 0).collect();
        let kind = allowed[self.rng.random_range(0..allowed.len())];
        match kind {
            0 => self.crash(random_node),
            1 => self.crash(target),
            2 => self.isolate(target, &[Endpoint::Host], "cut off all but the host:"),
            3 => {
                let me = Endpoint::Node(target);
                let blocked = [(me.min(Endpoint::Store), me.max(Endpoint::Store))].into();
                self.partition(blocked, format!("n{target} from the store"));
            }
            4 => self.isolate(random_node, &[], "cut off completely:"),
            5 => {
                let endpoints = self.endpoints();
                let side: Vec<bool> = endpoints.iter().map(|_| self.rng.random_bool(0.5)).collect();
                let mut blocked = BTreeSet::new();
                for (a, &x) in endpoints.iter().enumerate() {
                    for (b, &y) in endpoints.iter().enumerate() {
                        if a < b && side[a] != side[b] {
                            blocked.insert((x.min(y), x.max(y)));
                        }
                    }
                }
                self.partition(blocked, format!("split {endpoints:?} by {side:?}"));
            }
            6 => {
                let until_ms = self.now_ms + self.rng.random_range(20..300);
                self.nodes[random_node].disk_fault_until_ms = until_ms;
                self.log(|| format!("n{random_node}: disk faults until {until_ms}"));
            }
            7 => {
                let manager = self.rng.random_range(0..self.managers.len());
                if self.managers[manager].take().is_some() {
                    self.log(|| format!("manager {manager} crashes"));
                    let down_ms = self.rng.random_range(100..1500);
                    self.schedule(down_ms, SimEvent::ManagerRestart(manager));
                }
            }
            8 => {
                let me = Endpoint::Node(target);
                let blocked = [(me.min(Endpoint::Host), me.max(Endpoint::Host))].into();
                self.partition(blocked, format!("the host from n{target}"));
            }
            9 => {
                let until_ms = self.now_ms + self.rng.random_range(20..300);
                self.nodes[target].disk_fault_until_ms = until_ms;
                self.log(|| format!("n{target} (primary): disk faults until {until_ms}"));
            }
            10 => self.step_down(target),
            12 => self.damage_block(target, random_node),
            _ => {
                // A replica is killed, then the primary before it could be removed from the
                // in-sync set: the new primary probes the restarted replica, whose divergence
                // is then what its write intent kept.
                let replica = (target + 1 + self.rng.random_range(0..nodes - 1)) % nodes;
                self.crash(replica);
                let delay_ms = self.rng.random_range(0..=self.settings.config.ack_timeout_ms);
                self.schedule(delay_ms, SimEvent::Crash(target));
            }
        }
    }

    /// The data of one block on one node fails its checksum from now on (the primary half the
    /// time): never a block already damaged on another node, so the members together always
    /// hold a good copy of every block, though perhaps not an in-sync one. Half the time it is
    /// a block a host write in flight is writing, which a failover then leaves in some
    /// divergence list, so a new primary's reconciliation meets it.
    fn damage_block(&mut self, primary: usize, random_node: usize) {
        let node = if self.rng.random_bool(0.5) { primary } else { random_node };
        let written: Vec<u64> = self
            .host
            .values()
            .filter_map(|command| match command.command {
                Command::Write { lba, .. } => Some(lba),
                _ => None,
            })
            .collect();
        let lba = if !written.is_empty() && self.rng.random_bool(0.5) {
            written[self.rng.random_range(0..written.len())]
        } else {
            self.rng.random_range(0..self.nodes[node].disk.len() as u64)
        };
        if lba >= self.nodes[node].disk.len() as u64
            || self.nodes.iter().any(|sim| sim.damaged.contains(&lba))
        {
            return;
        }
        self.nodes[node].damaged.insert(lba);
        self.ever_damaged.insert(lba);
        // Half the time the node's scrub finds it before any read does.
        let scrubbed = self.nodes[node].up && self.rng.random_bool(0.5);
        if scrubbed {
            self.nodes[node].volume.note_damaged(lba);
        }
        self.log(|| format!("n{node}: block {lba} damaged (found by the scrub: {scrubbed})"));
    }

    /// A planned move of the primary (`target` is the node the store names, or any node when
    /// it names none): the node steps down, and half the time it then stops once the store
    /// named the next primary (or after a lease), as on SIGTERM in a rolling restart.
    fn step_down(&mut self, node: usize) {
        if !self.nodes[node].up {
            return;
        }
        let now_ms = self.now_ms;
        let mut actions = Vec::new();
        self.nodes[node].volume.step_down(now_ms, &mut actions);
        let stepping_down = self.nodes[node].volume.stepping_down();
        self.log(|| format!("n{node} steps down (stepping down: {stepping_down})"));
        for action in actions {
            self.node_action(node, action);
        }
        let state = &self.store.volume().value;
        if stepping_down && state.primary == Some(NodeId(node as u32)) && self.moving.is_none() {
            self.moving = Some((state.epoch, now_ms));
        }
        if self.rng.random_bool(0.5) {
            let incarnation = self.nodes[node].incarnation;
            let deadline_ms = now_ms + self.settings.config.lease_ms;
            self.schedule(NODE_TICK_MS, SimEvent::StopWhenMoved { node, incarnation, deadline_ms });
        }
    }

    fn host_tick(&mut self) {
        let now_ms = self.now_ms;
        // A command without an answer for too long: reset its connection (which loses every
        // command still on it) and send them all again.
        let timed_out: Vec<(usize, u64)> = self
            .host
            .values()
            .filter(|command| command.retry_at_ms.is_none())
            .filter(|command| {
                command.attempt_sent_ms.last().is_some_and(|sent| sent + HOST_TIMEOUT_MS <= now_ms)
            })
            .filter_map(|command| command.sent_on)
            .collect();
        for (node, connection) in timed_out {
            if self.host_connections[node] == connection {
                self.host_connections[node] += 1;
                self.log(|| format!("host resets its connection to n{node}"));
                for command in self.host.values_mut() {
                    if command.sent_on == Some((node, connection)) && command.retry_at_ms.is_none()
                    {
                        command.retry_at_ms = Some(now_ms);
                    }
                }
            }
        }
        let due: Vec<u64> = self
            .host
            .iter()
            .filter(|(_, command)| command.retry_at_ms.is_some_and(|at| at <= now_ms))
            .map(|(&op, _)| op)
            .collect();
        for op in due {
            self.host_send(op);
        }
        let volume_blocks = self.settings.config.volume_blocks;
        if self.host_issuing && self.host.len() < self.settings.host_depth {
            let hot = self.rng.random_bool(0.3);
            let lba = if hot {
                self.rng.random_range(0..8)
            } else {
                self.rng.random_range(0..volume_blocks)
            };
            let count = self.rng.random_range(1..=3u64).min(volume_blocks - lba);
            let command = match self.rng.random_range(0..20) {
                0 => Command::Flush,
                1..=7 => Command::Read { lba, count: count as u32 },
                8 => {
                    // A discard of a long range, as mkfs does: from the start of the volume,
                    // or from anywhere to (nearly) its end.
                    let start = if self.rng.random_bool(0.5) { 0 } else { lba };
                    let longest = (volume_blocks - start).min(DEALLOCATE_BLOCKS_PER_OP_MAX.into());
                    let count = self.rng.random_range(1..=longest) as u32;
                    Command::Deallocate { lba: start, count }
                }
                9 | 10 => Command::Deallocate { lba, count: count as u32 },
                _ => Command::Write { lba, count },
            };
            let op = self.next_host_op;
            self.next_host_op += 1;
            match command {
                Command::Write { lba, count } => {
                    self.checker.write_issued(op, false, lba..lba + count, now_ms)
                }
                Command::Deallocate { lba, count } => {
                    self.checker.write_issued(op, true, lba..lba + u64::from(count), now_ms)
                }
                Command::Read { .. } | Command::Flush => {}
            }
            let command = HostCommand {
                command,
                attempt_sent_ms: Vec::new(),
                retry_at_ms: None,
                sent_on: None,
            };
            self.host.insert(op, command);
            self.host_send(op);
        }
    }

    /// Sends (or re-sends) a command to the primary the store names now.
    fn host_send(&mut self, op: u64) {
        let Some(command) = self.host.get(&op) else { return };
        let retry = !command.attempt_sent_ms.is_empty();
        if retry
            && self.host_issuing
            && matches!(command.command, Command::Write { .. } | Command::Deallocate { .. })
            && self.rng.random_bool(self.settings.abandon_probability)
        {
            // It stays a write that never completed: its value may show up at any time.
            self.log(|| format!("host abandons write {op}"));
            self.host.remove(&op);
            return;
        }
        let Some(command) = self.host.get_mut(&op) else { return };
        let Some(primary) = self.store.volume().value.primary else {
            command.retry_at_ms = Some(self.now_ms + HOST_RETRY_MS);
            return;
        };
        let node = primary.0 as usize;
        let connection = self.host_connections[node];
        let incarnation = self.nodes[node].incarnation;
        command.sent_on = Some((node, connection));
        command.retry_at_ms = None;
        command.attempt_sent_ms.push(self.now_ms);
        let attempt = command.attempt_sent_ms.len() as u32 - 1;
        let block_bytes = self.settings.block_bytes;
        let payload = match command.command {
            Command::Flush => HostOp::Flush,
            Command::Read { lba, count } => HostOp::Read { lba, count },
            Command::Deallocate { lba, count } => HostOp::Deallocate { lba, count },
            Command::Write { lba, count } => HostOp::Write {
                lba,
                blocks: (lba..lba + count)
                    .map(|block| replication::Block::from(encode(block, op, block_bytes)))
                    .collect(),
            },
        };
        let payload =
            Payload::HostRequest { op, attempt, command: payload, connection, incarnation };
        self.send(Endpoint::Host, Endpoint::Node(node), payload);
    }

    fn host_response(&mut self, op: u64, attempt: u32, result: Result<HostReply, HostError>) {
        let Some(command) = self.host.get_mut(&op) else { return };
        let now_ms = self.now_ms;
        match result {
            Ok(reply) => {
                let sent_ms = command.attempt_sent_ms[attempt as usize];
                let command = command.command.clone();
                self.host.remove(&op);
                match (command, reply) {
                    (Command::Write { lba, count }, HostReply::Written) => {
                        self.checker.write_completed(op, lba..lba + count, now_ms);
                    }
                    (Command::Deallocate { lba, count }, HostReply::Deallocated) => {
                        self.checker.write_completed(op, lba..lba + u64::from(count), now_ms);
                    }
                    (Command::Read { lba, count }, HostReply::Read(blocks)) => {
                        if blocks.len() != count as usize {
                            self.checker
                                .violations
                                .push(format!("read of {count} blocks got {}", blocks.len()));
                        }
                        for (index, block) in blocks.iter().enumerate() {
                            self.checker.check_read(lba + index as u64, block, sent_ms, now_ms);
                        }
                    }
                    (Command::Flush, HostReply::Flushed) => {}
                    (command, reply) => {
                        self.checker.violations.push(format!("{command:?} answered with {reply:?}"))
                    }
                }
            }
            Err(HostError::Damaged { lba, count })
                if self.ever_damaged.range(lba..lba + u64::from(count)).next().is_some() =>
            {
                // No in-sync replica had a good copy when the primary looked (a damaged block
                // whose good copies sat on members out of sync): an answer, not a retry.
                self.host.remove(&op);
            }
            Err(HostError::NotPrimary | HostError::Busy) => {
                if attempt as usize + 1 == command.attempt_sent_ms.len() {
                    command.retry_at_ms = Some(now_ms + HOST_RETRY_MS);
                }
            }
            // Within the record's size, beyond the primary's: it has not learned of the grow
            // yet (a host sees the new size from it only once it has), so ask again.
            Err(HostError::OutOfRange { lba, count, .. })
                if lba + count <= self.settings.config.volume_blocks
                    && !self.settings.grows.is_empty() =>
            {
                if attempt as usize + 1 == command.attempt_sent_ms.len() {
                    command.retry_at_ms = Some(now_ms + HOST_RETRY_MS);
                }
            }
            Err(error) => {
                self.checker.violations.push(format!("host command {op} failed: {error}"))
            }
        }
    }
}

/// Encodes a message as a node sends it and decodes it as the receiver does: every message the
/// state machines produce must fit the wire format and come back the same.
fn through_the_wire(sender: NodeId, message: Message) -> Message {
    let envelope = Envelope { volume: VOLUME_ID, sender, message };
    let mut frame = Vec::new();
    let frame_bytes = match wire::encode(&envelope, &mut frame) {
        Ok(bytes) => bytes,
        Err(error) => {
            panic!("{sender} sent a message the wire cannot carry: {error}: {envelope:?}")
        }
    };
    match wire::decode(&frame) {
        Ok((decoded, used)) if used == frame_bytes && decoded == envelope => decoded.message,
        other => panic!("{envelope:?} did not come back from the wire: {other:?}"),
    }
}

fn short(message: &Message) -> String {
    let mut text = String::new();
    match message {
        Message::Append { epoch, stream, seq, commit_op, entry, .. } => {
            let _ = write!(
                text,
                "Append e{epoch} s{} #{seq} c{commit_op} {:?} lba {}+{}",
                stream.0,
                entry.kind,
                entry.lba,
                entry.blocks.len()
            );
        }
        other => {
            let _ = write!(text, "{other:?}");
        }
    }
    text
}

const _: () = assert!(VALUE_BYTES <= 32);

fn describe(lba: u64, blocks: &[BlockData]) -> String {
    let ids: Vec<String> = blocks
        .iter()
        .enumerate()
        .map(|(index, block)| match super::checker::decode(lba + index as u64, block) {
            Ok(id) => format!("w{id}"),
            Err(problem) => problem,
        })
        .collect();
    ids.join(",")
}

fn brief(result: &Result<HostReply, HostError>) -> String {
    match result {
        Ok(HostReply::Read(blocks)) => format!("read {} blocks", blocks.len()),
        Ok(reply) => format!("{reply:?}"),
        Err(error) => format!("{error:?}"),
    }
}

fn brief_op(op: &HostOp) -> String {
    match op {
        HostOp::Write { lba, blocks } => format!("write {lba}+{}", blocks.len()),
        HostOp::Deallocate { lba, count } => format!("deallocate {lba}+{count}"),
        other => format!("{other:?}"),
    }
}
