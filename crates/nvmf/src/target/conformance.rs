//! Conformance tests of the target beyond the happy path: host access control and the per-host
//! discovery log, keep-alive teardown, ANA over several ports, and the limits and malformed
//! input table (each case gets the specification's status or one C2HTermReq and a clean close
//! of that connection only).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use types::Nqn;

use super::tests::{
    assert_status, fixture, io_queue, namespace, pattern, read, subnqn, write, Fixture, Host,
    Received, Storage, BLOCK, HOSTNQN,
};
use super::*;
use crate::command::{
    cns, feature, log_page, property, PropertySize, SglDescriptor, Sqe, Status, CNTLID_DYNAMIC,
    NSID_ALL,
};
use crate::pdu::{self, DataHeader, FatalErrorStatus, ICReq};
use crate::structures::{
    ana_state, AnaLog, DiscoveryLogEntry, DiscoveryLogHeader, IdentifyController,
    IdentifyNamespace, DISCOVERY_LOG_RECORD_BYTES,
};

/// A catalog whose subsystems each have an allowed-hosts list that the test changes.
struct AllowListCatalog {
    namespaces: Vec<(Nqn, NamespaceInfo)>,
    allowed: Mutex<HashMap<Nqn, Vec<Nqn>>>,
}

impl Catalog for AllowListCatalog {
    fn subsystems(&self) -> Vec<SubsystemInfo> {
        self.namespaces.iter().map(|(nqn, _)| SubsystemInfo { nqn: nqn.clone() }).collect()
    }
    fn namespace(&self, subnqn: &Nqn) -> Option<NamespaceInfo> {
        self.namespaces.iter().find(|(nqn, _)| nqn == subnqn).map(|(_, info)| info.clone())
    }
    fn host_allowed(&self, subnqn: &Nqn, hostnqn: &Nqn) -> bool {
        let allowed = self.allowed.lock().unwrap();
        allowed.get(subnqn).is_some_and(|hosts| hosts.contains(hostnqn))
    }
}

const ALICE: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000a11c";
const BOB: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000b0";

fn nqn(text: &str) -> Nqn {
    Nqn::new(text).unwrap()
}

fn allow_list_target() -> (Arc<Target>, Arc<AllowListCatalog>) {
    let size = Arc::new(AtomicU64::new(1024));
    let catalog = Arc::new(AllowListCatalog {
        namespaces: vec![
            (subnqn("db"), namespace(7, &size)),
            (subnqn("logs"), namespace(8, &size)),
        ],
        allowed: Mutex::new(HashMap::from([
            (subnqn("db"), vec![nqn(ALICE)]),
            (subnqn("logs"), vec![nqn(ALICE), nqn(BOB)]),
        ])),
    });
    let target = Arc::new(Target::new(TargetConfig::default(), Arc::clone(&catalog) as _));
    (target, catalog)
}

/// The NVM subsystems of the discovery log as `hostnqn` reads it, and its generation.
fn discovered(target: &Arc<Target>, hostnqn: &str) -> (Vec<String>, u64) {
    let mut host = Host::new(target);
    host.initialize(false, false, 0);
    let cqe = host.connect(0, 31, CNTLID_DYNAMIC, &Nqn::discovery(), hostnqn);
    assert!(cqe.status.is_success(), "{cqe:?}");
    host.enable();
    let (_, data) = host.admin(Sqe::get_log_page(0, 0, log_page::DISCOVERY, 0, 1024));
    let header = DiscoveryLogHeader::decode(&data).unwrap();
    let total = DISCOVERY_LOG_RECORD_BYTES * (1 + header.record_count as usize);
    let (_, data) = host.admin(Sqe::get_log_page(0, 0, log_page::DISCOVERY, 0, total as u32));
    let names = data[DISCOVERY_LOG_RECORD_BYTES..]
        .chunks_exact(DISCOVERY_LOG_RECORD_BYTES)
        .map(|entry| DiscoveryLogEntry::decode(entry).unwrap())
        .filter(|entry| entry.subtype == crate::structures::subtype::NVM)
        .map(|entry| entry.subnqn)
        .collect();
    (names, header.generation)
}

#[test]
fn unknown_host_gets_connect_invalid_host() {
    let (target, _) = allow_list_target();
    let mut host = Host::new(&target);
    host.initialize(false, false, 0);
    let cqe = host.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), BOB);
    // SCT 1, SC 84h, with DNR, and IPO pointing at HOSTNQN in the Connect data.
    assert_eq!(cqe.status.raw(), 0x4184, "{cqe:?}");
    assert_eq!(cqe.dw0(), 0x1_0200);
    assert_eq!(target.controller_count(), 0);
    // The same host may use the subsystem it is allowed on, on the same connection.
    assert!(host.connect(0, 31, CNTLID_DYNAMIC, &subnqn("logs"), BOB).status.is_success());
    // An unknown subsystem is still Invalid Parameters, whoever asks.
    let mut other = Host::new(&target);
    other.initialize(false, false, 0);
    let cqe = other.connect(0, 31, CNTLID_DYNAMIC, &subnqn("nope"), BOB);
    assert_status(&cqe, Status::CONNECT_INVALID_PARAMETERS);
}

#[test]
fn discovery_log_shows_each_host_its_subsystems() {
    let (target, catalog) = allow_list_target();
    let (alice, generation) = discovered(&target, ALICE);
    assert_eq!(alice, [subnqn("db").as_str(), subnqn("logs").as_str()]);
    let (bob, _) = discovered(&target, BOB);
    assert_eq!(bob, [subnqn("logs").as_str()]);
    let (stranger, _) = discovered(&target, "nqn.2014-08.org.example:stranger");
    assert!(stranger.is_empty(), "the discovery subsystem itself is still listed");

    // `ferrite host allow db BOB`: the node changes its list and tells the target.
    catalog.allowed.lock().unwrap().get_mut(&subnqn("db")).unwrap().push(nqn(BOB));
    target.notify_subsystems_changed();
    let (bob, bumped) = discovered(&target, BOB);
    assert_eq!(bob.len(), 2);
    assert_eq!(bumped, generation + 1);

    // `ferrite host deny db ALICE`: a connected controller of hers is closed too.
    let mut admin = Host::new(&target);
    admin.initialize(false, false, 0);
    assert!(admin.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), ALICE).status.is_success());
    catalog.allowed.lock().unwrap().get_mut(&subnqn("db")).unwrap().retain(|h| h != &nqn(ALICE));
    target.notify_subsystems_changed();
    assert_eq!(target.disconnect_host(&subnqn("db"), &nqn(ALICE)), 1);
    assert!(admin.queue.wants_close());
    assert_eq!(discovered(&target, ALICE).0, [subnqn("logs").as_str()]);
}

/// A host that goes silent: after KATO its admin queue expires, the driver closes it, the
/// controller goes away and its I/O queues close; storage work in flight still completes into
/// the void and nothing is sent.
#[test]
fn silent_host_is_torn_down_after_kato() {
    let fixture = fixture();
    let (mut admin, mut io) = io_queue(&fixture);
    let mut second = Host::new(&fixture.target);
    second.initialize(false, false, 0);
    let cntlid = admin.queue.cntlid().unwrap();
    assert!(second.connect(2, 31, cntlid, &subnqn("db"), HOSTNQN).status.is_success());
    // A read is with the driver when the host falls silent.
    let mut bytes = Vec::new();
    let mut sqe = read(0, 1);
    sqe.set_cid(77);
    pdu::encode_capsule_cmd(&mut bytes, &io.framing, &sqe, &[]);
    io.send(&bytes);
    let request = io.queue.next_request().expect("the read goes to storage");

    // KATO 5000 ms from the Connect, rounded up to the 1 s granularity; the driver's timer.
    for now_ms in (0..=5000).step_by(200) {
        admin.queue.poll(now_ms);
        assert!(!admin.queue.keep_alive_expired(now_ms), "{now_ms}");
    }
    assert!(admin.queue.keep_alive_expired(5200));
    assert!(!io.queue.keep_alive_expired(5200), "the admin queue decides");
    drop(admin);
    assert_eq!(fixture.target.controller_count(), 0);
    for queue in [&mut io.queue, &mut second.queue] {
        assert!(queue.wants_close());
        queue.poll(5200);
        assert_eq!(queue.receive(&[], 5200), Err(Terminated::ControllerClosed));
    }
    let StorageOperation::Read { buf, .. } = request.operation else { panic!("a read") };
    io.queue.complete(request.id, Ok(()), Some(buf));
    assert_eq!(io.queue.output_len(), 0, "nothing is sent for a dead controller");
    // The controller ID is free again: a new association gets going.
    let (_admin, _io) = io_queue(&fixture);
    assert_eq!(fixture.target.controller_count(), 1);
}

#[test]
fn keep_alive_timer_feature_and_zero_kato() {
    let fixture = fixture();
    let mut admin = Host::new(&fixture.target);
    admin.initialize(false, false, 0);
    let cqe = admin.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN);
    assert!(cqe.status.is_success());
    admin.enable();
    let (cqe, _) = admin.admin(Sqe::get_features(0, feature::KEEP_ALIVE_TIMER, 0));
    assert_eq!(cqe.dw0(), 5000);
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::KEEP_ALIVE_TIMER, 0));
    assert!(cqe.status.is_success());
    assert!(!admin.queue.keep_alive_expired(1 << 40), "KATO 0: no keep-alive");
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::KEEP_ALIVE_TIMER, 1500));
    assert!(cqe.status.is_success());
    assert!(!admin.queue.keep_alive_expired(2000), "1500 ms rounds up to 2000");
    assert!(admin.queue.keep_alive_expired(2001));
    // Volatile write cache: none, so Set and Get Features 06h are Invalid Field with DNR.
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::VOLATILE_WRITE_CACHE, 1));
    assert_eq!(cqe.status, Status::INVALID_FIELD.with_dnr());
}

/// A target with two listeners, as a node with two listen addresses has.
fn two_port_target() -> Fixture {
    let size = Arc::new(AtomicU64::new(1024));
    let catalog =
        super::tests::TestCatalog { namespaces: vec![(subnqn("db"), namespace(7, &size))] };
    let listener = |address: &str, port_id| Listener {
        traddr: address.to_owned(),
        trsvcid: "4420".to_owned(),
        port_id,
    };
    let config = TargetConfig {
        listeners: vec![listener("10.0.0.1", 1), listener("10.0.1.1", 2)],
        ..TargetConfig::default()
    };
    Fixture { target: Arc::new(Target::new(config, Arc::new(catalog))), size }
}

/// An enabled admin queue on `port_id` with ANA change notices on and one AER outstanding.
fn admin_on_port(target: &Arc<Target>, port_id: u16) -> Host {
    let mut admin = Host::new_on_port(target, port_id);
    admin.initialize(false, false, 0);
    assert!(admin.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN).status.is_success());
    admin.enable();
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::ASYNC_EVENT_CONFIGURATION, 1 << 11));
    assert!(cqe.status.is_success());
    let mut bytes = Vec::new();
    pdu::encode_capsule_cmd(&mut bytes, &admin.framing, &Sqe::async_event_request(900), &[]);
    admin.send(&bytes);
    admin
}

fn ana_log(admin: &mut Host, lsp: u32) -> AnaLog {
    let mut sqe = Sqe::get_log_page(0, NSID_ALL, log_page::ANA, 0, 4096);
    sqe.set_cdw(10, sqe.cdw(10) | (lsp << 8));
    let (cqe, data) = admin.admin(sqe);
    assert!(cqe.status.is_success(), "{cqe:?}");
    AnaLog::decode(&data).unwrap()
}

#[test]
fn ana_states_per_port_with_notices_and_path_statuses() {
    let fixture = two_port_target();
    let target = &fixture.target;
    let nqn = subnqn("db");
    let mut first = admin_on_port(target, 1);
    let mut second = admin_on_port(target, 2);
    let (_, data) = first.admin(Sqe::identify(0, cns::CONTROLLER, 0, 0, 4096));
    let identify = IdentifyController::decode(&data).unwrap();
    assert_eq!(identify.cmic, 0b1011, "multi-port, multi-controller, ANA reporting");
    assert_eq!((identify.anagrpmax, identify.nanagrpid, identify.mnan), (1, 1, 1));
    let (_, data) = first.admin(Sqe::identify(0, cns::NAMESPACE, 1, 0, 4096));
    assert_eq!(IdentifyNamespace::decode(&data).unwrap().anagrpid, ANA_GROUP_ID);

    // An I/O queue of each controller, on its own port; crossing ports is refused.
    let mut io = [1u16, 2].map(|port_id| Host::new_on_port(target, port_id));
    for (index, queue) in io.iter_mut().enumerate() {
        let admin = if index == 0 { &first } else { &second };
        queue.initialize(false, false, 0);
        let cntlid = admin.queue.cntlid().unwrap();
        assert!(queue.connect(1, 31, cntlid, &nqn, HOSTNQN).status.is_success());
    }
    let mut crossing = Host::new_on_port(target, 2);
    crossing.initialize(false, false, 0);
    let cqe = crossing.connect(2, 31, first.queue.cntlid().unwrap(), &nqn, HOSTNQN);
    assert_eq!(cqe.dw0(), 0x1_0010, "CNTLID names a controller of another port");

    let mut storage = Storage::default();
    let cases = [
        (AnaState::Inaccessible, ana_state::INACCESSIBLE, Some(Status::ANA_INACCESSIBLE)),
        (AnaState::PersistentLoss, ana_state::PERSISTENT_LOSS, Some(Status::ANA_PERSISTENT_LOSS)),
        (AnaState::Change, ana_state::CHANGE, Some(Status::ANA_TRANSITION)),
        (AnaState::NonOptimized, ana_state::NON_OPTIMIZED, None),
        (AnaState::Optimized, ana_state::OPTIMIZED, None),
    ];
    let mut change_count = ana_log(&mut second, 0).change_count;
    for (cid, (state, code, status)) in (901u16..).zip(cases) {
        target.set_ana_state(&nqn, 1, state);
        assert_eq!(target.ana_state(&nqn, 1), state);
        first.queue.poll(0);
        first.pump(&mut storage);
        match first.receive_all().as_slice() {
            [Received::Response(cqe)] => assert_eq!(cqe.dw0(), 0x000C_0302, "{state:?}"),
            other => panic!("{state:?}: {other:?}"),
        }
        let log = ana_log(&mut first, 0);
        assert_eq!((log.groups[0].state, log.groups[0].nsids.as_slice()), (code, &[1][..]));
        assert!(log.change_count > change_count);
        change_count = log.change_count;
        let mut bytes = Vec::new();
        pdu::encode_capsule_cmd(&mut bytes, &first.framing, &Sqe::async_event_request(cid), &[]);
        first.send(&bytes);
        for sqe in [read(0, 1), write(0, 1), Sqe::flush(0, 1)] {
            let data = if sqe.opcode() == 1 { pattern(BLOCK, 1) } else { Vec::new() };
            let (cqe, _) = io[0].exchange(&mut storage, sqe, &data, true);
            match status {
                Some(expected) => {
                    assert_status(&cqe, expected);
                    assert!(!cqe.status.do_not_retry());
                }
                None => assert!(cqe.status.is_success(), "{state:?} {cqe:?}"),
            }
        }
        // The other port is untouched: no notice, optimized, I/O served.
        second.pump(&mut storage);
        assert!(second.receive_all().is_empty());
        assert_eq!(ana_log(&mut second, 0).groups[0].state, ana_state::OPTIMIZED);
        let (cqe, _) = io[1].exchange(&mut storage, read(0, 1), &[], false);
        assert!(cqe.status.is_success());
    }
    // Return Groups Only: no NSID list. Admin commands are served whatever the state.
    target.set_ana_state(&nqn, 1, AnaState::Inaccessible);
    first.queue.poll(0);
    first.pump(&mut storage);
    assert!(matches!(first.receive_all().as_slice(), [Received::Response(cqe)] if cqe.cid == 905));
    assert!(ana_log(&mut first, 1).groups[0].nsids.is_empty());
    let (cqe, _) = first.admin(Sqe::identify(0, cns::NAMESPACE, 1, 0, 4096));
    assert!(cqe.status.is_success());
    // A new controller on the port starts in the state the node set; forgetting clears it.
    let mut later = admin_on_port(target, 1);
    assert_eq!(ana_log(&mut later, 0).groups[0].state, ana_state::INACCESSIBLE);
    target.forget_ana_states(&nqn);
    assert_eq!(target.ana_state(&nqn, 1), AnaState::Optimized);
}

#[test]
fn ana_notices_respect_the_async_event_configuration() {
    let fixture = two_port_target();
    let mut admin = admin_on_port(&fixture.target, 1);
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::ASYNC_EVENT_CONFIGURATION, 1 << 8));
    assert!(cqe.status.is_success());
    let (cqe, _) = admin.admin(Sqe::get_features(0, feature::ASYNC_EVENT_CONFIGURATION, 0));
    assert_eq!(cqe.dw0(), 1 << 8);
    fixture.target.set_ana_state(&subnqn("db"), 1, AnaState::Inaccessible);
    admin.queue.poll(0);
    admin.pump(&mut Storage::default());
    assert!(admin.receive_all().is_empty(), "ANA notices are off");
    // Unsupported bits are dropped, supported ones kept.
    let (cqe, _) =
        admin.admin(Sqe::set_features(0, feature::ASYNC_EVENT_CONFIGURATION, 0xFFFF_FFFF));
    assert!(cqe.status.is_success());
    let (cqe, _) = admin.admin(Sqe::get_features(0, feature::ASYNC_EVENT_CONFIGURATION, 0));
    assert_eq!(cqe.dw0(), (1 << 8) | (1 << 11));
}

/// One fatal case: the bytes a host sends after bring-up, and the termination expected.
struct Fatal {
    name: &'static str,
    bytes: fn(&Host) -> Vec<u8>,
    fes: FatalErrorStatus,
    fei: u32,
}

#[test]
fn malformed_pdus_terminate_only_their_connection() {
    use FatalErrorStatus::*;
    let cases = [
        Fatal {
            name: "second ICReq",
            bytes: |_| {
                let mut bytes = Vec::new();
                let icreq =
                    ICReq { pfv: 0, hpda: 0, header_digest: false, data_digest: false, maxr2t: 0 };
                pdu::encode_ic_req(&mut bytes, &icreq);
                bytes
            },
            fes: PduSequenceError,
            fei: 0,
        },
        Fatal {
            name: "a controller PDU type",
            bytes: |host| {
                let mut bytes = Vec::new();
                pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(1), &[]);
                bytes[0] = 0x05;
                bytes
            },
            fes: InvalidHeaderField,
            fei: 0,
        },
        Fatal {
            name: "PLEN beyond the largest PDU",
            bytes: |host| {
                let mut bytes = Vec::new();
                pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(1), &[]);
                bytes[4..8].copy_from_slice(&(PDU_SIZE_MAX + 4).to_le_bytes());
                bytes
            },
            fes: InvalidHeaderField,
            fei: 4,
        },
        Fatal {
            name: "H2CData beyond the largest PDU",
            bytes: |host| {
                let mut bytes = Vec::new();
                let header = DataHeader {
                    cccid: 1,
                    ttag: 0,
                    datao: 0,
                    datal: 8,
                    last: true,
                    success: false,
                };
                pdu::encode_data_pdu(&mut bytes, &host.framing, &header, &[0; 8]);
                bytes[4..8].copy_from_slice(&(PDU_SIZE_MAX + 8).to_le_bytes());
                bytes
            },
            fes: DataTransferLimitExceeded,
            fei: 0,
        },
        Fatal {
            name: "header digest flag not negotiated",
            bytes: |host| {
                let mut bytes = Vec::new();
                pdu::encode_capsule_cmd(&mut bytes, &host.framing, &Sqe::keep_alive(1), &[]);
                bytes[1] |= pdu::flags::HEADER_DIGEST;
                bytes
            },
            fes: InvalidHeaderField,
            fei: 1,
        },
        Fatal {
            name: "H2CData for no transfer",
            bytes: |host| {
                let mut bytes = Vec::new();
                let header = DataHeader {
                    cccid: 1,
                    ttag: 5,
                    datao: 0,
                    datal: 8,
                    last: true,
                    success: false,
                };
                pdu::encode_data_pdu(&mut bytes, &host.framing, &header, &[0; 8]);
                bytes
            },
            fes: InvalidHeaderField,
            fei: 10,
        },
        Fatal {
            name: "PDO into the header",
            bytes: |host| {
                let mut bytes = Vec::new();
                let sqe = Sqe::write(1, 1, 0, 1).with_sgl(SglDescriptor::in_capsule(0, 8));
                pdu::encode_capsule_cmd(&mut bytes, &host.framing, &sqe, &[0; 8]);
                bytes[3] = 60;
                bytes
            },
            fes: InvalidHeaderField,
            fei: 3,
        },
    ];
    for case in cases {
        let fixture = fixture();
        let (mut admin, mut io) = io_queue(&fixture);
        let mut bystander = Host::new(&fixture.target);
        bystander.initialize(false, false, 0);
        let cntlid = admin.queue.cntlid().unwrap();
        assert!(bystander.connect(2, 31, cntlid, &subnqn("db"), HOSTNQN).status.is_success());
        let bytes = (case.bytes)(&io);
        io.send(&bytes);
        io.pump(&mut Storage::default());
        match io.receive_all().last() {
            Some(Received::Term { fes, fei, .. }) => {
                assert_eq!((*fes, *fei), (case.fes as u16, case.fei), "{}", case.name)
            }
            other => panic!("{}: expected C2HTermReq, got {other:?}", case.name),
        }
        assert!(io.queue.wants_close(), "{}", case.name);
        // The admin queue and the other I/O queue go on.
        let (cqe, _) = admin.admin(Sqe::keep_alive(0));
        assert!(cqe.status.is_success(), "{}", case.name);
        let (cqe, _) = bystander.exchange(&mut Storage::default(), read(0, 1), &[], false);
        assert!(cqe.status.is_success(), "{}", case.name);
    }
}

#[test]
fn limits_get_their_status() {
    let fixture = fixture();
    let (mut admin, mut io) = io_queue(&fixture);
    let mut storage = Storage::default();
    // In-capsule data up to IOCCSZ (8 KiB) is taken; beyond it, Data SGL Length Invalid.
    let (cqe, _) = io.exchange(&mut storage, write(0, 2), &pattern(2 * BLOCK, 2), true);
    assert!(cqe.status.is_success(), "{cqe:?}");
    let (cqe, _) = io.exchange(&mut storage, write(0, 3), &pattern(3 * BLOCK, 1), true);
    assert_status(&cqe, Status::DATA_SGL_LENGTH_INVALID);
    assert!(!io.queue.wants_close());
    // An SGL longer than MDTS on an admin command, a log page too large.
    let (cqe, _) = admin.admin(Sqe::identify(0, cns::CONTROLLER, 0, 0, 2 << 20));
    assert_status(&cqe, Status::INVALID_FIELD);
    let (cqe, _) = admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::SMART_HEALTH, 0, 2 << 20));
    assert_status(&cqe, Status::INVALID_FIELD);
    // Properties of the wrong size or unknown offset.
    let (cqe, _) = admin.admin(Sqe::property_get(0, property::CAP, PropertySize::Bytes4));
    assert_status(&cqe, Status::INVALID_FIELD);
    let (cqe, _) = admin.admin(Sqe::property_get(0, 0x40, PropertySize::Bytes4));
    assert_status(&cqe, Status::INVALID_FIELD);
    // Number of Queues of 65536 is invalid; after I/O queues exist it is a sequence error.
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::NUMBER_OF_QUEUES, 0xFFFF));
    assert_status(&cqe, Status::INVALID_FIELD);
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::NUMBER_OF_QUEUES, 1));
    assert_status(&cqe, Status::COMMAND_SEQUENCE_ERROR);
}

#[test]
fn queue_and_controller_limits() {
    // Two I/O queues granted: a third Connect is refused with IPO QID.
    let fixture = fixture();
    let mut admin = Host::new(&fixture.target);
    let cntlid = admin.bring_up_admin(&subnqn("db"));
    let (cqe, _) = admin.admin(Sqe::set_features(0, feature::NUMBER_OF_QUEUES, 1 | (1 << 16)));
    assert_eq!(cqe.dw0(), 1 | (1 << 16));
    for qid in 1..=3u16 {
        let mut io = Host::new(&fixture.target);
        io.initialize(false, false, 0);
        let cqe = io.connect(qid, 31, cntlid, &subnqn("db"), HOSTNQN);
        if qid <= 2 {
            assert!(cqe.status.is_success());
        } else {
            assert_status(&cqe, Status::CONNECT_INVALID_PARAMETERS);
            assert_eq!(cqe.dw0(), 42, "IPO QID");
        }
    }
    // A target full of controllers answers Controller Busy.
    let size = Arc::new(AtomicU64::new(64));
    let catalog =
        super::tests::TestCatalog { namespaces: vec![(subnqn("db"), namespace(1, &size))] };
    let config = TargetConfig { controllers_max: 1, ..TargetConfig::default() };
    let target = Arc::new(Target::new(config, Arc::new(catalog)));
    let mut first = Host::new(&target);
    first.bring_up_admin(&subnqn("db"));
    let mut second = Host::new(&target);
    second.initialize(false, false, 0);
    let cqe = second.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN);
    assert_status(&cqe, Status::CONTROLLER_BUSY);
}

#[test]
fn controller_ids_stay_within_the_configured_range() {
    let size = Arc::new(AtomicU64::new(64));
    let catalog =
        super::tests::TestCatalog { namespaces: vec![(subnqn("db"), namespace(1, &size))] };
    let config =
        TargetConfig { controllers_max: 2, cntlids: 1025..=1026, ..TargetConfig::default() };
    let target = Arc::new(Target::new(config, Arc::new(catalog)));
    let mut first = Host::new(&target);
    first.bring_up_admin(&subnqn("db"));
    let mut second = Host::new(&target);
    second.bring_up_admin(&subnqn("db"));
    let mut ids = [first.queue.cntlid().unwrap(), second.queue.cntlid().unwrap()];
    ids.sort_unstable();
    assert_eq!(ids, [1025, 1026]);
    // The range is full: a third host is refused, never given an ID outside it.
    let mut third = Host::new(&target);
    third.initialize(false, false, 0);
    let cqe = third.connect(0, 31, CNTLID_DYNAMIC, &subnqn("db"), HOSTNQN);
    assert_status(&cqe, Status::CONTROLLER_BUSY);
}

#[test]
fn log_pages_an_io_controller_serves() {
    let fixture = fixture();
    let (mut admin, _io) = io_queue(&fixture);
    // Error information: one zeroed 64-byte entry, the rest of the window zeros.
    let (cqe, data) =
        admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::ERROR_INFORMATION, 0, 128));
    assert!(cqe.status.is_success() && data.len() == 128 && data.iter().all(|b| *b == 0));
    // SMART / health: available spare 100 %, threshold 10 %, no critical warning.
    let (_, data) = admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::SMART_HEALTH, 0, 512));
    assert_eq!((data[0], data[3], data[4]), (0, 100, 10));
    // Firmware slot: slot 1 active, holding the firmware revision of Identify Controller.
    let (_, data) = admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::FIRMWARE_SLOT, 0, 512));
    assert_eq!(data[0], 1);
    let revision = fixture.target.config().firmware_revision.clone();
    assert_eq!(String::from_utf8_lossy(&data[8..16]).trim_end(), revision);
    // The ANA log at an offset: the group descriptor alone.
    let (_, data) = admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::ANA, 16, 36));
    assert_eq!((data[0], data[4], data[16], data[32]), (1, 1, ana_state::OPTIMIZED, 1));
    // The discovery log is not an I/O controller's.
    let (cqe, _) = admin.admin(Sqe::get_log_page(0, NSID_ALL, log_page::DISCOVERY, 0, 1024));
    assert_status(&cqe, Status::INVALID_LOG_PAGE);
}
