//! Synchronous replication, failover and fencing of one volume, as sans-IO state machines.
//!
//! Each node holding a replica of a volume runs one [`VolumeNode`]; each node runs one
//! [`LeaseKeeper`]; the cluster runs a [`Manager`] (one elected leader; more are harmless). They
//! take events (a host command, a message from another node, a storage or control-store reply,
//! a tick with the time `now_ms`) and return [`Action`]s (send a message, read or write local
//! storage, persist the epoch, ask the control store, complete a host command). They own no
//! thread, clock, socket or file: the node crate wires them to TCP, etcd and the engine, and
//! the simulation in `tests/sim.rs` wires them to a seeded fake world.
//!
//! # The control store
//!
//! One record per volume ([`VolumeState`], changed only by compare-and-swap on its version):
//! `epoch`, `primary`, `primary_lease` (the lease the primary held when promoted), `in_sync`
//! (replicas holding every completed write) and `members` (nodes holding a replica). Who may
//! change what:
//!
//! - the manager *promotes*: `epoch + 1`, a new primary chosen from `in_sync`, the old primary
//!   out of `in_sync`; the CAS also requires, at the store's instant, that the old
//!   `primary_lease` is not live and the new primary's lease is;
//! - the manager *rebuilds*: it replaces a member that is not in sync and has had no live lease
//!   for `grace_ms` by a live node holding no replica (which the primary then copies in full);
//! - the primary of the current epoch, and nobody else, moves replicas in and out of `in_sync`;
//! - a primary whose storage failed, or that steps down for a planned move, *resigns* (sets
//!   `primary_lease` to `LeaseId::NONE`, which the manager treats as an expired lease).
//!
//! Leases ([`LeaseKeeper`]) expire on the store's clock and are never revived: a node whose
//! lease expired gets a new lease id. A node measures its lease from when it *sent* the renewal,
//! so it believes the lease ends no later than the store does.
//!
//! # Streams
//!
//! A primary sends each replica one ordered stream of entries ([`Message::Append`]): host writes
//! (numbered `op` in the epoch, sent to every replica that takes live writes) and copies of the
//! primary's blocks (resync and reconciliation). A stream is identified by (epoch, stream id)
//! and opened for one replica process (`incarnation`); a replica that restarted refuses it
//! (`Resync`) and must be taken back. The replica applies entries strictly in sequence order
//! (early ones wait in a bounded buffer, duplicates are acknowledged again, an entry waits for
//! an earlier write to the same block) and acknowledges cumulatively ([`Message::Ack`]) what is
//! durable. Lost entries are sent again; every append and heartbeat carries `commit_op`, the
//! highest op such that it and every earlier op completed. Because both sides apply one stream
//! in one order, a replica's blocks go through the same sequence of values as the primary's.
//!
//! # Writes
//!
//! The primary numbers a host write, sends it to every peer taking live writes, and writes it
//! locally (after any earlier write to the same blocks). It completes the write when it is
//! durable locally and every peer in `InSync` or `Adding` acknowledged it, while no peer is
//! `Removing`, and while the primary holds its lease. A peer that acknowledges nothing for
//! `ack_timeout_ms` (or restarts, or reports a storage error) becomes `Removing` (while a
//! local write of the primary's own has been in flight for half that time, its storage
//! paused too, and for an ack timeout after, only after [`OWN_STALL_LATE_FACTOR`] times as
//! long: a pause of a disk the nodes share is nobody's lag, and a peer whose storage hangs
//! alone still goes; nor while the primary has no evidence that its own storage takes writes:
//! a write of its own issued half a timeout or more after the peer's oldest unacknowledged
//! entry, completed (a write issued before a pause began may complete, one issued after it
//! cannot); without one, once the peer is half late, the primary persists its write intent as
//! it stands, a storage probe, counted in `Stats::storage_probes`): the primary
//! CASes it out of `in_sync` under its own epoch and only after the store confirms completes the
//! writes waiting for it. If the CAS finds another epoch or another primary, or any node
//! answers `Stale`, the primary is deposed: pending writes fail with
//! [`HostError::NotPrimary`] (the host retries on the new primary), never complete. Reads are
//! served from the primary's storage under the same conditions. Flush completes at once (every
//! completed write is already durable everywhere it must be).
//!
//! A host deallocate (NVMe Deallocate or Write Zeroes, NBD trim) is a write of unmapped blocks
//! (`None`: storage deallocates them and they read as zeros). It is numbered, streamed, ordered
//! against overlapping writes and completed exactly like a write; it only may be longer
//! ([`DEALLOCATE_BLOCKS_PER_OP_MAX`] blocks against [`BLOCKS_PER_OP_MAX`]), since it carries no
//! data (one byte per block on the wire).
//!
//! # Fencing
//!
//! Every message carries the sender's epoch. A node keeps the highest epoch it has seen (from
//! messages and from the store) and refuses anything older with `Stale`. It persists the epoch
//! ([`Action::PersistEpoch`]) and acknowledges entries, or answers a probe, only once their
//! epoch is durable, so a restart never takes it back to an older epoch. A promoted node
//! persists its new epoch before it does anything else in the term.
//!
//! # Failover and reconciliation
//!
//! When the store names a node primary of a newer epoch, with the lease it holds, it starts a
//! term: persist the epoch, then `Probe` every other in-sync replica. A probed replica adopts
//! the epoch (so it applies nothing more of the old one), and replies with its *divergence*:
//! the blocks of every entry it applied whose data reflects a write beyond the commit point it
//! had been told ([`DivergenceReport`], LBA ranges; after a restart, the ranges of its write
//! intent; `Unknown` past `divergence_ranges_max`, or after a restart without a known intent).
//! Writes in flight at the old primary may have reached some replicas and
//! not others; those blocks, and only those, are in some divergence list. For each replica the
//! new primary copies its own version of the blocks in its own list and the replica's (all
//! blocks if either is unknown), tagged as uncommitted op 1 of the new epoch. Once every in-sync
//! replica holds them (or was removed through the store), op 1 commits and the term serves.
//! A replica drops divergence entries when a commit point covers them, and all entries of older
//! epochs when it learns a newer epoch committed op 1. A primary whose term ends (deposed, lease
//! lost, step-down) adds the blocks of its pending writes to its own list, and takes no host
//! write after. Any value is acceptable for a block whose write never completed; what matters
//! is that every in-sync replica ends with the primary's.
//!
//! # Resync
//!
//! For each member out of sync the primary keeps a *dirty set*, the blocks on which that
//! member's replica may differ from its own, and copies exactly those when the member comes
//! back. The new primary's blocks change only through its own host writes of the term
//! (reconciliation writes only to replicas), each of which joins every dirty set. A member:
//!
//! - removed during the term (it stopped acknowledging, restarted or failed) owes the blocks its
//!   stream had not acknowledged, the pushes of its reconciliation not yet made if it was
//!   being reconciled, and every block written since. What it acknowledged is durable there and
//!   was the primary's value, even if its process restarts meanwhile.
//! - out of the in-sync set when the term started (the previous primary, which the promotion
//!   took out, or a member removed in an earlier term), or in it but never probed (no
//!   `ProbeReply` within `ack_timeout_ms`) owes the blocks of the new primary's divergence at
//!   the term's start, every block written in the term, and, from its first `Hello` of the
//!   term, the blocks of the divergence that `Hello` carries. A `Hello` also carries the newest
//!   epoch in which the sender started a term (kept in its write intent, so a restart keeps
//!   it); the divergence is used for a member out of sync at the start only if that epoch is
//!   the one just before the term's.
//!
//! Why that is enough: such a member was in sync until the promotion. A member of the in-sync
//! set the term started with plainly was; so was the primary of the epoch just before (the store
//! names one primary per epoch, only from `in_sync`, and a primary never leaves `in_sync` in its
//! own epoch). Then the reconciliation argument holds for it as for a probed replica: the blocks
//! of older epochs on which it and the new primary differ are those of writes that never
//! completed, each in one of their two divergence lists (the old primary's pending writes went
//! into its own list when its term ended). The divergence in the `Hello` is final: the member
//! applies nothing of older epochs once it adopted the new one, and its list changes in the new
//! epoch only through the new primary's stream, which opens only for a `Hello`; the primary takes
//! the first one it serves and then keeps what is left in the dirty set (a later `Hello`, or a
//! restart, changes nothing: what the member acknowledged stays durable).
//!
//! The member is copied the whole volume instead when the new primary cannot know what it
//! missed: it was out of sync since an earlier epoch (dirty sets are not handed over between
//! primaries), its divergence is `Unknown` (the list passed `divergence_ranges_max`, or its
//! process restarted without a known write intent: the intent passed `intent_regions_max`,
//! or its file was lost), the new primary's own divergence was unknown, or the dirty set
//! passed `dirty_lbas_max`. A process that restarted otherwise (kill -9, a crash) knows its
//! divergence and its last term from its write intent (below), so it comes back incrementally
//! like a living one, copied also the whole regions its intent held. A member the
//! manager adds in a rebuild holds nothing and is copied in full too. [`Stats`] counts the
//! returns of members out of sync since the term started that were incremental and full.
//!
//! When the member asks to come back (`Hello`), the primary opens a new stream, sends it live
//! writes from then on, and copies the dirty blocks (at most `copy_blocks_per_tick` per tick,
//! at most `COPY_WINDOW_MAX` read or unacknowledged at once, whatever else the stream holds:
//! under a steady host load a member acknowledges live writes some way behind, and copies
//! that waited for an empty window would never progress).
//! A copy reads a block only when no local write to it is in flight or waiting, and is dropped
//! if a host write to the block is issued before the read returns (the member gets that write
//! live, after in its stream); a host write sent live to the member also takes its blocks out
//! of the dirty set, since it brings them up to date (were the member to leave before
//! acknowledging it, its unacknowledged entries are owed again, as above), so blocks that hosts
//! keep writing are not copied as well, which would have the member's in-order stream wait
//! behind its own writes to them; a copy reflecting a pending write is tagged with it, so it
//! counts as uncommitted. On the member, a copy waits for its own write still in flight to the
//! block (an old primary's last writes), so the copy lands last. When nothing is left to copy,
//! every copy and every completed write has been acknowledged and every pending write went to
//! it live, the peer is `Adding`: writes now wait for it too, and the primary CASes it into
//! `in_sync`. A member that acknowledges more slowly than the hosts write (on a busy disk)
//! would fill its stream with live writes and leave the resync, or, once copied, never reach
//! that moment while the load lasts; so the wiring gives the state machine host writes only
//! while [`VolumeNode::admits_write`] says so: not while a member being resynced holds
//! `STREAM_WINDOW_MAX - COPY_WINDOW_MAX` live writes unacknowledged, nor, once its copies are
//! acknowledged, until it has acknowledged every completed write. Hosts then write at its pace,
//! as they do for an in-sync member; one that stops acknowledging is still removed after
//! `ack_timeout_ms`, and the writes flow again. A CAS whose reply was lost is settled only by
//! a later CAS reply, never by a read, since the lost one could still be applied.
//! [`VolumeNode::resync_progress`] reports each copy as it goes.
//!
//! # Write intent
//!
//! The divergence list lives in memory. What a restarted process (kill -9, a crash) knows of it
//! is its *write intent*, like md RAID's write-intent bitmap: a set of coarse regions
//! (`intent_region_blocks` blocks each) that may hold a write this node applied and that is not
//! known to be on every in-sync replica, and the newest epoch in which the node started a term.
//! The node persists it with [`Action::PersistIntent`] (the wiring replaces a file atomically;
//! [`WriteIntent`] holds it as LBA ranges, or unknown, and defines the file) and gives it back to
//! [`VolumeNode::new`] at the next start. The rules:
//!
//! - A write whose data may be uncommitted is issued only once every region it touches is in
//!   every intent that may be durable: the last one persisted and the one being persisted, if
//!   any (a crash may leave either). Those writes are exactly the ones that make a divergence
//!   mark, or would when the term ends: the primary's local write of a host write (uncommitted
//!   until it completes), and a replica's stream entry beyond the commit point it was told (a
//!   host write, a copy reflecting pending writes, a reconciliation push). Until then the write
//!   waits where it already waits for an earlier write to its blocks (the primary's pending
//!   writes, at most `INFLIGHT_WRITES_MAX`; the replica's ready entries, at most
//!   `STREAM_WINDOW_MAX`, applied in order) for `Event::IntentPersisted`. Every region wanted
//!   while a persist is in flight goes into the next one (group commit; at most one in flight).
//!   A write to a region already durable does not wait: the common path adds nothing.
//! - A region leaves only when a persist without it is built, on a tick at most once per
//!   `intent_linger_ms`, and only if no unresolved divergence mark, no pending host write and no
//!   storage write in flight touches it, and no write wanted it for `intent_linger_ms` (so a
//!   hot region is not persisted again and again). Leaving never waits; from then on a write to
//!   the region waits again for a persist that holds it.
//! - Past `intent_regions_max` regions, or while the divergence list has lost marks (it is
//!   `Unknown`: they may lie anywhere), every intent persisted says unknown, until a later tick
//!   finds the regions still needed fit again, or the lost marks resolved.
//! - The term epoch joins the intent once the term's epoch is durable.
//!
//! Why it is enough: at every instant, every block where this node's disk may hold (or a write
//! in flight may leave) the data of an unresolved divergence mark, or of a pending host write
//! of its term (which joins its list when the term ends), is in a region of every intent that
//! may be durable, or that intent is unknown. Such data is written only once its regions are
//! covered; a region is left out of a persist only once no such data, and no write, is left in
//! it, and a write to it after that waits for a persist that holds it again; marks lost to an
//! overflow lay in covered regions when they were lost, and every persist built until they
//! resolve says unknown. So at a restart every pending local write of the old primary that may
//! have reached the disk, and every entry of a replica applied beyond its commit point and not
//! resolved since, is inside the persisted ranges. The new process takes each range as a mark of
//! its persisted epoch (the newest it applied anything of) beyond every commit point, resolved
//! exactly as the lost marks of a restart without an intent were (by a commit point of a newer
//! epoch with op 1 or more): its list contains the one the old process would have reported,
//! and a larger list only makes a primary copy more. "Failover and reconciliation" and
//! "Resync" hold for it unchanged. Its `Hello` names the term epoch of the intent, never newer
//! than its last term (older if the crash came first: the return is then full); a node that was
//! the primary of the epoch just before was in sync until the promotion whatever became of its
//! process, so it returns incrementally. A restart with no intent (`None`, or a file that does
//! not read) is unknown unless the node never persisted an epoch (then it applied nothing).
//!
//! # Why a completed write is never lost
//!
//! Let write W complete at primary P in epoch e. The peers W waited for include every member of
//! the store's `in_sync` (P adds a peer to the set only after it takes live writes, and removes
//! one only after the store confirms), so every member of `in_sync` at that moment holds W
//! durably, and any member added later got W or a newer value by copy. The manager promotes only
//! a member of `in_sync`, so the next primary holds W; reconciliation overwrites only blocks
//! whose writes had not completed. By induction over epochs, W (or a later completed write to its
//! blocks) stays on every in-sync replica, and on every primary.
//!
//! # Why there is no split brain
//!
//! Epochs alone keep P from completing anything once a newer primary N serves: N was in P's
//! `in_sync`, so every write of P waits for N's ack or for a CAS removing N under epoch e; N
//! persisted epoch e+1 before its term began and refuses epoch e, and the CAS fails because the
//! epoch moved. Leases make the two periods disjoint in time, reads included: P serves and
//! completes only while its lease is valid by its own clock; the manager promotes only when the
//! store says that lease expired, which by the lease rule above is no earlier. This needs clocks
//! that run at the same rate (bounded drift, absorbed by a margin in `lease_ms`), not clocks that
//! agree. Every change to the store is a CAS, so concurrent managers or primaries cannot both
//! succeed on one version.
//!
//! A driver may serve host reads from local storage without handing them to the state machine
//! (the node does, to keep them off the service's thread): [`VolumeNode::serving_until`] says
//! until when the term's lease allows it, and changes otherwise only with an event. A read is
//! then checked against it when it starts and when its data is back, as the state machine
//! checks the reads it runs, and the driver must stop trusting the answer before it carries out
//! the actions of an event that ended the term (a resignation lets the manager promote another
//! node before the lease would have expired).
//!
//! # Read repair
//!
//! Storage answers a read whose data failed its checksum with `StorageResult::Damaged`: the
//! drive works, this copy does not, so nothing latches. A primary then asks an in-sync replica
//! that holds a stream of the term for the blocks (`Message::Read`, asked again every
//! `retransmit_ms`, given up for the next in-sync replica after `ack_timeout_ms`, or at once
//! when the replica answers without blocks or leaves the in-sync set). The replica reads them
//! from its storage only if it is the process the primary streams to, or answered a probe of,
//! in this epoch, so it applied every write the primary completed before asking (a probed
//! process was in sync when the term started and applies nothing of older epochs after its
//! reply); its own damaged copy is answered
//! with no blocks and joins its damaged blocks (below), which the primary sends it once its own
//! copy is whole. The host gets the replica's blocks. The
//! primary also writes them over its own copy, ordered like any write (no write of those
//! blocks in flight; later ones wait for it), unless a host write to one of them was pending
//! when it asked or started since: the replica's copy may then be older than what the primary
//! must hold, and a read beside a write may return either, so it answers the read only. The
//! rewrite goes inside the durable write intent like any write of a primary (if its regions
//! are not there yet, the blocks are repaired again once they are), though its data is what
//! every in-sync replica already holds. When
//! no in-sync replica gives the blocks, the read fails with `HostError::Damaged` (an
//! unrecovered read error for those blocks only) and the volume goes on serving. A resync copy
//! that meets damaged data here puts the block back among those it owes and waits for it,
//! while the block is repaired as below (from another in-sync replica, or replaced by a host
//! write); with no good copy in sync that resync waits, and the volume still serves.
//!
//! A reconciliation that meets a block damaged on the new primary takes the block from a
//! member it probed (`Message::Read` as above, to the probed members in turn): its pushes of
//! the block wait, the copy is written here inside the durable write intent and joins this
//! node's divergence (a term that ends before the reconciliation does leaves it to the next
//! primary), and then every member gets it: members being pushed and those already
//! reconciled (pushed again before the term serves), the dirty sets of members out of sync, and
//! those made later from this node's divergence. Any probed member's copy will do: it was in
//! sync when the term started, so it holds every completed write to the block, or a later
//! write that never completed, which may take effect as long as every member ends with it.
//! Only when no probed member gives the block does the node stop as an I/O error would, so
//! another in-sync member may be promoted. Reads run by the wiring outside the state machine
//! (`serving_until`) hand a failed read to it to get the repairs above.
//!
//! Damage no host read met: the wiring reports blocks its scrub found damaged
//! ([`VolumeNode::note_damaged`]); the node remembers them (at most `DAMAGED_BLOCKS_MAX`) until
//! a write of any kind replaces them, and every `hello_interval_ms` acts on a few
//! (`DAMAGED_PER_ROUND_MAX`). A primary repairs them as it would for a host read, without a
//! host to answer (a block with a write pending waits: the write replaces it). A replica sends
//! `Message::Damaged` to the primary streaming to it, which reads its own copy and sends it on
//! that stream as a `Copy` entry covering only completed writes, so the replica applies it in
//! order with the host writes; the primary sends nothing while a host write to the blocks is
//! pending or in flight, or if one starts before its read is back (that write's own entry
//! replaces them), at most `PEER_REPAIRS_MAX` reads at once and only while the stream holds
//! fewer than `COPY_WINDOW_MAX` copies unacknowledged (host writes keep their window, and under
//! a steady load the live writes always unacknowledged do not hold repairs up). Lost messages
//! cost a round: the replica asks again until the block is rewritten. A primary whose own copy
//! turns out damaged too notes it and repairs it from another replica.
//!
//! # Planned moves
//!
//! A node that stops cleanly (SIGTERM, a rolling restart), or that an operator moves a volume
//! away from, calls [`VolumeNode::step_down`]. As primary it ends its term at once (pending
//! host writes and reads fail with `NotPrimary`; the blocks of the writes join its divergence
//! list) and only then resigns, by a CAS under its view (sent again from each newer view while
//! the store still names it primary with a lease). The manager promotes a primary whose lease
//! is `NONE` at its next poll, choosing another in-sync member with a live lease if there is
//! one, and that member learns it at its own next poll: hosts wait about two store polls
//! instead of a lease. Until the node sees a newer epoch it starts no term, even if named;
//! after, it is a replica like any other (out of `in_sync`, it resyncs from the new primary,
//! which copies it only what changed, after a restart too while its write intent is known),
//! so a volume can move back
//! later. If no other in-sync member is live, the manager names the
//! same node again in a new epoch, which ends the step-down: it serves again rather than
//! leave the volume without a primary, since no other replica is known to hold every
//! completed write.
//!
//! The arguments above still hold (for a latched node's resignation too). No split brain: the
//! lease only makes the old primary stop before the store allows a promotion; a resigning
//! node has stopped before it sends the CAS (it asserts that it holds no term), never starts
//! another term in that epoch (a process serves an epoch once, and `step_down` forbids a term
//! until the epoch moves), and a later process of it holds another lease, which does not match
//! the store's. So when the store allows the promotion, no node serves the old epoch. Epoch fencing is untouched. No
//! lost write: the resignation changes only `primary_lease` (not `in_sync`, not the epoch), the
//! promotion still picks a member of `in_sync`, which holds every completed write, and the
//! writes the old primary failed never completed. Every step is a CAS on the version, so a
//! lost, duplicated or late resignation either applies to the view it was made for or fails and
//! is made again from the store's answer; setting `NONE` twice changes nothing.
//!
//! # Growing the volume
//!
//! Volumes only grow. The wiring learns a new size from the volume's record (the control plane
//! writes it first, so a node that starts later starts with it), grows its storage, then
//! calls [`VolumeNode::grow`]: from then on the node takes host commands, stream entries and
//! reads up to the new end. Nodes learn it each at their own time, and nothing orders them:
//!
//! - A primary grown before a replica sends entries the replica refuses as outside its volume;
//!   it acknowledges nothing from that entry on, the primary sends it again every
//!   `retransmit_ms`, and it lands once the replica has grown (after `ack_timeout_ms`, the
//!   replica leaves the in-sync set like any laggard, and a later resync copies it the blocks
//!   beyond its old end with the rest). So a write beyond the old end completes only when
//!   every in-sync replica holds the new size, and a replica promoted later serves it.
//! - A primary smaller than a member may meet that member's divergence beyond its own end
//!   (uncommitted writes of an earlier, grown primary). Its copy could not reach those blocks,
//!   and once it grew the member would hold a write that never completed where the primary
//!   reads none, so a `ProbeReply` or `Hello` from a larger member (both carry the sender's
//!   size) waits until the primary has grown: probes are sent again and hellos repeat.
//! - The write intent persists the old last region only up to the old end; if that region was
//!   short it no longer counts as held, so a write there waits for a persist that lists it
//!   whole. A copy under way (resync, reconciliation) reaches the new end.
//!
//! # Snapshots
//!
//! A snapshot of a replicated volume is taken on each copy by the copy's own storage; the
//! protocol's part is to say when those copies are alike. The wiring of the serving primary
//! stops giving host writes to its `VolumeNode` (reads go on) and waits until
//! [`VolumeNode::quiet_copies`] answers: the primary serves, no write it took is pending, and
//! the replicas it names (those in sync, or caught up and being added) acknowledged every
//! completed write, with no entry in flight to any of them. Those copies then hold exactly
//! what the primary's holds, and stay so while writes are held and the term lasts: nothing
//! but the primary's stream changes a replica's copy within its term, and any later term
//! starts only once this one's lease has lapsed. So the wiring snapshots each of those
//! replicas, then the primary's own copy, and keeps the snapshot only if, still holding the
//! writes, the primary serves the same epoch under the same lease at the end: then no other
//! term served in between, and every snapshot taken is the same point in time, one that
//! holds every write completed before the snapshot was asked for and none given after.
//! A replica out of sync at that moment gets no snapshot (its resync copies the volume, not
//! its snapshots), so a snapshot lives on the copies that were alike when it was taken.
//!
//! # What the wiring must provide
//!
//! - Storage: a write completes only when durable; the machine never has two writes to one block
//!   in flight; after a crash each write in flight may or may not have reached the disk. A write
//!   holds at most `BLOCKS_PER_OP_MAX` blocks, or `DEALLOCATE_BLOCKS_PER_OP_MAX` when every
//!   block is unmapped (a deallocate).
//! - Storage tells damaged data (a checksum that fails on a working drive:
//!   `StorageResult::Damaged`) from a failed drive (`StorageResult::Failed`), and reports the
//!   blocks its own scrub finds damaged (`VolumeNode::note_damaged`), so that they are read or
//!   copied from another replica instead of stopping the node ("Read repair").
//! - Messages travel between nodes in a [`wire`] frame that names the volume and the sender
//!   ([`Envelope`]); the wiring hands the message to that volume's `VolumeNode` with the sender.
//! - `PersistEpoch` durable with the node's state; `incarnation` different at every start.
//! - `PersistIntent` durable with the node's state, replacing the previous intent atomically
//!   (write a new file, sync it, rename it over the old one, sync the directory), and what the
//!   file holds given back to `VolumeNode::new` at the next start (`None` if there is none or
//!   it does not read: safe, the node then returns with a full copy).
//! - One `VolumeNode` per volume for the life of the node's lease: a new one does not know
//!   which epoch the old one served, stepped down from or resigned, so the wiring does not
//!   re-create it (to reopen the volume) in a process whose lease the store may still name.
//! - Messages may be lost, duplicated, delayed and reordered, but not corrupted or cut.
//! - The control store: linearizable single-key CAS and leases (etcd; [`MemStore`] in tests).
//! - Host connections: a host that gives up on a command resets the connection to that node
//!   before retrying elsewhere (as NVMe/TCP multipath does), so a stale copy of the command
//!   cannot run after the retry completed.
//!
//! The deterministic simulation (`tests/sim.rs`) checks all of this over many seeds:
//! `FERRITE_SIM_SEED=N cargo test -p replication --test sim -- --nocapture` replays one seed
//! with a trace.

mod dirty;
mod divergence;
mod intent;
pub mod lease;
pub mod manager;
pub mod message;
mod primary;
mod replica;
pub mod store;
mod volume;
pub mod wire;

pub use intent::{
    IntentFileError, WriteIntent, INTENT_FILE_BYTES_MAX, INTENT_FILE_HEADER_BYTES,
    INTENT_FILE_MAGIC, INTENT_FILE_VERSION,
};
pub use lease::{LeaseKeeper, LeaseStatus};
pub use manager::Manager;
pub use message::{DivergenceReport, Entry, EntryKind, Envelope, Message};
pub use store::{
    CasFailure, LeaseInfo, MemStore, StoreCall, StoreReply, StoreRequest, Versioned, VolumeState,
};
pub use volume::{Action, Event, HostError, HostOp, HostReply, Stats, StorageResult, VolumeNode};

/// One replica being copied to by this primary: the resync of a returning member, the rebuild
/// of a new one, or a reconciliation push after a failover ([`VolumeNode::resync_progress`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResyncProgress {
    pub peer: NodeId,
    /// The whole volume is being copied (a new member, or what it missed is unknown).
    pub full: bool,
    /// Blocks this copy has had to send so far (the dirty set at start plus blocks dirtied
    /// again later).
    pub blocks_total: u64,
    /// Blocks of those already sent. Never above `blocks_total`.
    pub blocks_copied: u64,
}

/// One node of the cluster, as the control store names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u32);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// A liveness lease granted by the control store. `LeaseId::NONE` is never live: a volume whose
/// primary holds it (new volume, or a primary that resigned) is promoted at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseId(pub u64);

impl LeaseId {
    pub const NONE: LeaseId = LeaseId(0);
}

/// One ordered stream of entries from a primary to one replica, unique within an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(pub u64);

/// A host command, named by whoever submitted it; echoed in its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostOpId(pub u64);

/// A local storage request, named by the state machine; the wiring echoes it in the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StorageOpId(pub u64);

/// A control store request, named by the state machine; the wiring echoes it in the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoreRequestId(pub u64);

/// The contents of one block and their CRC-32C. The bytes are shared, so one host write feeds
/// every replica without a copy, and a block received from a peer is a slice of the buffer its
/// frame was read into. The checksum is computed once, where the block enters (a host write, a
/// storage read: [`Block::new`]), or checked once, where it arrives from a peer
/// ([`crate::wire`]); every frame it travels in carries it and the storage that writes it keeps
/// it, so no node hashes the bytes again.
///
/// **Invariant:** `crc` is the CRC-32C of `bytes` (checked in debug builds wherever a block is
/// written).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Block {
    bytes: bytes::Bytes,
    crc: u32,
}

impl Block {
    /// A block of `bytes`, hashing them.
    pub fn new(bytes: bytes::Bytes) -> Self {
        let crc = crc32c::crc32c(&bytes);
        Self { bytes, crc }
    }

    /// A block whose checksum the caller has checked against the bytes (the wire, before it
    /// hands the block out).
    pub(crate) fn checked(bytes: bytes::Bytes, crc: u32) -> Self {
        debug_assert_eq!(crc32c::crc32c(&bytes), crc, "a block's checksum is checked first");
        Self { bytes, crc }
    }

    /// The CRC-32C of the block's bytes.
    pub fn crc(&self) -> u32 {
        self.crc
    }

    /// The block's bytes, shared.
    pub fn bytes(&self) -> &bytes::Bytes {
        &self.bytes
    }
}

impl std::ops::Deref for Block {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl From<bytes::Bytes> for Block {
    fn from(bytes: bytes::Bytes) -> Self {
        Self::new(bytes)
    }
}

impl From<Vec<u8>> for Block {
    fn from(bytes: Vec<u8>) -> Self {
        Self::new(bytes.into())
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Block({} bytes, crc {:#010x})", self.bytes.len(), self.crc)
    }
}

/// A block as storage holds it: `None` is a block never written (or deallocated): it reads as
/// zeros, and copying it to a replica deallocates it there.
pub type BlockData = Option<Block>;

/// Host writes pending on a primary at once; more are refused with `HostError::Busy`. Above a
/// host's usual queue depth (fio's 4 x 32 of `make compare-ceph` measured 17-18K 4K writes/s
/// on three copies at 64, 20-22K at 256).
pub const INFLIGHT_WRITES_MAX: usize = 256;
/// Host reads pending on a primary at once; more are refused with `HostError::Busy`.
pub const INFLIGHT_READS_MAX: usize = 256;
/// Blocks in one host read or write.
pub const BLOCKS_PER_OP_MAX: u32 = 64;
/// Blocks in one host deallocate (8 MiB of 4 KiB blocks). A deallocate carries no data (one
/// byte per block on the wire), so it may be much longer than a write; the caller splits
/// longer ranges (a whole-device discard at mkfs time) into ops of at most this many blocks.
pub const DEALLOCATE_BLOCKS_PER_OP_MAX: u32 = 2048;
/// Copies (resync or reconciliation) read or unacknowledged on one stream at once.
pub const COPY_WINDOW_MAX: usize = 32;
/// While a primary's own storage is stalled too (a write of its own in flight for half of
/// `ack_timeout_ms`), and for an ack timeout after, a replica's missing acknowledgement removes
/// it only after this many ack timeouts, not one: a pause of a disk the nodes share is nobody's
/// lag, and the replicas finish what the pause held a little after the primary does.
pub const OWN_STALL_LATE_FACTOR: u64 = 4;
/// Entries sent and not yet acknowledged on one stream. An in-sync replica holds at most
/// `INFLIGHT_WRITES_MAX` (every pending write) plus nothing else; a resyncing one also holds
/// copies (at most `COPY_WINDOW_MAX`) and writes that completed without it, the live ones
/// admitted only while fewer than `STREAM_WINDOW_MAX - COPY_WINDOW_MAX`
/// ([`VolumeNode::admits_write`]). A stream that fills up is a laggard.
pub const STREAM_WINDOW_MAX: usize = INFLIGHT_WRITES_MAX + 2 * COPY_WINDOW_MAX;
/// Entries re-sent per tick on one stream.
pub const RETRANSMITS_PER_TICK_MAX: usize = 16;
/// LBAs examined per tick when a copy has to skip blocks with a local write in flight.
pub const COPY_SCAN_MAX: usize = 64;
/// Blocks a node remembers as damaged here (found by its scrub) until a write replaces them;
/// more are dropped (the next scrub pass finds them again).
pub const DAMAGED_BLOCKS_MAX: usize = 4096;
/// Damaged blocks a node acts on per `hello_interval_ms`: a primary starts that many repairs at
/// most, a replica reports that many to its primary.
pub const DAMAGED_PER_ROUND_MAX: usize = 16;
/// Reads a primary runs at once for replicas whose copies are damaged.
pub const PEER_REPAIRS_MAX: usize = 64;
/// LBA ranges a persisted write intent holds at most (each region of `intent_regions_max` is at
/// most one): bounds the intent file and the divergence of a restart.
pub const INTENT_RANGES_MAX: usize = 1 << 16;

const _: () = assert!(BLOCKS_PER_OP_MAX <= DEALLOCATE_BLOCKS_PER_OP_MAX);
const _: () = assert!(COPY_WINDOW_MAX < STREAM_WINDOW_MAX);
const _: () = assert!(INFLIGHT_WRITES_MAX < STREAM_WINDOW_MAX);

/// Timing and size parameters of one volume's replication. Times are in milliseconds of the
/// caller's clock, which must advance at the same rate on every node as on the control store
/// (the lease argument in the crate documentation needs it; it does not need them to agree).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Blocks in the volume; LBAs are `0..volume_blocks`.
    pub volume_blocks: u64,
    /// Bytes in one block; host writes of any other size are refused.
    pub block_size_bytes: usize,
    /// How long a lease lives after the control store last heard from its holder.
    pub lease_ms: u64,
    /// How often a node renews its lease; well below `lease_ms`.
    pub keepalive_interval_ms: u64,
    /// How often a node reads the volume's state from the control store.
    pub store_poll_ms: u64,
    /// A control store request without a reply after this long is given up (and re-read).
    pub store_timeout_ms: u64,
    /// How often a primary sends a heartbeat on every stream (and the commit point with it).
    pub heartbeat_ms: u64,
    /// An entry without an acknowledgement after this long is sent again.
    pub retransmit_ms: u64,
    /// A replica that acknowledges nothing for this long is removed from the in-sync set
    /// ([`OWN_STALL_LATE_FACTOR`] times as long while the primary's own writes are stalled).
    pub ack_timeout_ms: u64,
    /// A replica without a live stream asks the primary to take it back this often.
    pub hello_interval_ms: u64,
    /// Resync and reconciliation copy at most this many blocks per tick, over all replicas.
    pub copy_blocks_per_tick: u32,
    /// A primary remembers at most this many changed LBAs per out-of-sync replica (the blocks
    /// written while it is away, and those of divergence lists); beyond, that replica gets a
    /// full copy.
    pub dirty_lbas_max: usize,
    /// A replica remembers at most this many uncommitted entries (each an LBA range; after a
    /// restart, each range of its write intent); beyond, its divergence is unknown and a
    /// reconciliation copies the whole volume to it.
    pub divergence_ranges_max: usize,
    /// Blocks in one region of the write intent (crate docs, "Write intent"): a write to a
    /// region not yet in the persisted intent waits for one more persist first.
    pub intent_region_blocks: u64,
    /// Regions the write intent holds at most; beyond, it is persisted as unknown (a restart
    /// then needs a full copy) until enough regions drop out again. At most
    /// [`INTENT_RANGES_MAX`].
    pub intent_regions_max: usize,
    /// A region leaves the write intent once nothing uncommitted is left in it and no write
    /// touched it for this long; the shrunk intent is persisted at most once per this period.
    pub intent_linger_ms: u64,
    /// The cluster manager replaces a member that has been gone this long (when a spare node
    /// is live).
    pub grace_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            volume_blocks: 1 << 18,
            block_size_bytes: 4096,
            lease_ms: 10_000,
            keepalive_interval_ms: 2_000,
            store_poll_ms: 500,
            store_timeout_ms: 2_000,
            heartbeat_ms: 200,
            retransmit_ms: 200,
            ack_timeout_ms: 3_000,
            hello_interval_ms: 1_000,
            copy_blocks_per_tick: 256,
            dirty_lbas_max: 1 << 16,
            divergence_ranges_max: 1 << 12,
            intent_region_blocks: 256,
            intent_regions_max: 1 << 12,
            intent_linger_ms: 2_000,
            grace_ms: 600_000,
        }
    }
}

/// A configuration that cannot work; the message says which setting to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("volume_blocks and block_size_bytes must be above zero")]
    EmptyVolume,
    #[error("keepalive_interval_ms ({keepalive_ms}) must be below half of lease_ms ({lease_ms})")]
    KeepaliveTooSlow { keepalive_ms: u64, lease_ms: u64 },
    #[error("every interval and timeout must be above zero")]
    ZeroInterval,
    #[error(
        "copy_blocks_per_tick, dirty_lbas_max, divergence_ranges_max, intent_region_blocks and \
         intent_regions_max must be above zero"
    )]
    ZeroLimit,
    #[error("intent_regions_max ({regions}) must be at most {INTENT_RANGES_MAX}")]
    IntentRegionsTooMany { regions: usize },
}

impl Config {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.volume_blocks == 0 || self.block_size_bytes == 0 {
            return Err(ConfigError::EmptyVolume);
        }
        let intervals = [
            self.lease_ms,
            self.keepalive_interval_ms,
            self.store_poll_ms,
            self.store_timeout_ms,
            self.heartbeat_ms,
            self.retransmit_ms,
            self.ack_timeout_ms,
            self.hello_interval_ms,
            self.intent_linger_ms,
        ];
        if intervals.contains(&0) {
            return Err(ConfigError::ZeroInterval);
        }
        if self.keepalive_interval_ms * 2 >= self.lease_ms {
            return Err(ConfigError::KeepaliveTooSlow {
                keepalive_ms: self.keepalive_interval_ms,
                lease_ms: self.lease_ms,
            });
        }
        if self.copy_blocks_per_tick == 0
            || self.dirty_lbas_max == 0
            || self.divergence_ranges_max == 0
            || self.intent_region_blocks == 0
            || self.intent_regions_max == 0
        {
            return Err(ConfigError::ZeroLimit);
        }
        if self.intent_regions_max > INTENT_RANGES_MAX {
            return Err(ConfigError::IntentRegionsTooMany { regions: self.intent_regions_max });
        }
        Ok(())
    }
}
