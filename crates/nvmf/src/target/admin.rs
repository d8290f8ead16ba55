//! Fabrics and admin commands: Connect, properties, Disconnect, Identify, Get Log Page,
//! features, Keep Alive, Asynchronous Event Request and Abort.
//!
//! Not on the I/O path: these may allocate (the discovery log, Identify strings). The data they
//! return is built in the queue's scratch buffer and sent as C2HData before the response.

use std::sync::atomic::Ordering;

use super::queue::{
    HostData, Outcome, Queue, SlotCommand, SlotState, ASYNC_EVENT_ANA_CHANGE,
    ASYNC_EVENT_DISCOVERY_CHANGE, ASYNC_EVENT_NAMESPACE_ATTRIBUTE,
};
use super::{
    AER_OUTSTANDING_MAX, ANA_GROUP_ID, ANA_TRANSITION_SECONDS, IOCCSZ, IORCSZ, IO_QUEUES_MAX,
    KEEP_ALIVE_GRANULARITY_MS, MDTS, QUEUE_ENTRIES_MAX, VERSION,
};
use crate::command::{
    admin_opcode, cns, connect_invalid_parameter_result, csi, fctype, feature, log_page, property,
    ConnectData, PropertySize, Sqe, Status, CNTLID_DYNAMIC, CONNECT_DATA_BYTES, FABRICS_OPCODE,
};
use crate::structures::{
    cmic, controller_type, encode_active_namespace_list, encode_firmware_slot_log,
    encode_identify_namespace_independent, encode_smart_log, AnaGroup, AnaLog, IdentifyController,
    IdentifyControllerNvm, IdentifyNamespace, NamespaceIdentifiers, CHANGED_NAMESPACE_LOG_BYTES,
    ERROR_LOG_ENTRY_BYTES, FIRMWARE_SLOT_LOG_BYTES, IDENTIFY_BYTES, SMART_LOG_BYTES,
};

/// Offsets of Connect SQE fields, reported as IPO with IATTR = 0.
const CONNECT_QID_OFFSET: u16 = 42;
const CONNECT_SQSIZE_OFFSET: u16 = 44;

/// CAP: MQES (0's based), CQR, TO in 500 ms units, CSS = NVM command set, MPSMIN = MPSMAX = 0.
const CAP: u64 = (QUEUE_ENTRIES_MAX as u64 - 1) | (1 << 16) | (15 << 24) | (1 << 37);
/// Identify Controller ELPE (0's based): one error log entry.
const ERROR_LOG_ENTRIES: usize = 1;
/// SQES/CQES: required and maximum entry sizes as powers of two (64 and 16 bytes).
const SQES: u8 = 0x66;
const CQES: u8 = 0x44;
/// CC.IOSQES/IOCQES the controller requires of an I/O controller.
const IOSQES: u32 = 6;
const IOCQES: u32 = 4;
/// Async event configuration bits (and OAES) of an I/O controller and of a discovery controller.
const ASYNC_EVENTS_IO: u32 = ASYNC_EVENT_NAMESPACE_ATTRIBUTE | ASYNC_EVENT_ANA_CHANGE;
const ASYNC_EVENTS_DISCOVERY: u32 = ASYNC_EVENT_DISCOVERY_CHANGE;
/// ANACAP: optimized, non-optimized, inaccessible, persistent loss and change states are
/// reported (bits 0..4); ANAGRPID does not change while the namespace is attached (bit 6).
const ANACAP: u8 = 0x1F | (1 << 6);
/// Get Log Page LSP bit 0 of the ANA log: Return Groups Only (no NSID lists).
const ANA_LSP_RETURN_GROUPS_ONLY: u32 = 1;
/// Get Log Page CDW10 LSP field (bits 14:8).
const LSP_SHIFT: u32 = 8;
const LSP_MASK: u32 = 0x7F;
/// Get Features SEL = 3 capability bit: changeable.
const FEATURE_CHANGEABLE: u64 = 1 << 2;

const _: () = assert!(AER_OUTSTANDING_MAX >= 1 && AER_OUTSTANDING_MAX <= 256);

impl Queue {
    // --- Connect ---

    /// A Connect on a queue that has none yet: checks the SQE, then gets the 1024 bytes of data
    /// from the capsule or by R2T.
    pub(super) fn begin_connect(&mut self, sqe: Sqe, capsule_data: &[u8], now_ms: u64) -> Outcome {
        if sqe.connect_record_format() != 0 {
            return Outcome::rejected(Status::CONNECT_INCOMPATIBLE_FORMAT);
        }
        match Queue::host_data(&sqe, capsule_data) {
            Err(status) => Outcome::rejected(status),
            Ok(HostData::InCapsule(data)) if data.len() == CONNECT_DATA_BYTES => {
                self.connect(sqe, data, now_ms)
            }
            Ok(HostData::Transport(length)) if length as usize == CONNECT_DATA_BYTES => {
                let buf = self.pool.take(CONNECT_DATA_BYTES);
                let index = self.allocate_slot(
                    sqe.cid(),
                    SlotCommand::Connect(sqe),
                    length,
                    Some(buf),
                    SlotState::ReceivingData,
                );
                self.send_r2t(index);
                Outcome::Deferred
            }
            Ok(_) => Outcome::rejected(Status::DATA_SGL_LENGTH_INVALID),
        }
    }

    /// Executes a Connect with its data.
    pub(super) fn connect(&mut self, sqe: Sqe, data: &[u8], now_ms: u64) -> Outcome {
        let invalid_parameter = |in_data: bool, offset: u16| Outcome::Complete {
            status: Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
            result: u64::from(connect_invalid_parameter_result(in_data, offset)),
        };
        let connect_data = match ConnectData::decode(data) {
            Ok(connect_data) => connect_data,
            Err(error) => return invalid_parameter(true, error.offset),
        };
        let (qid, sqsize) = (sqe.connect_qid(), sqe.connect_sqsize());
        let entries_max = self.target.config().queue_entries_max;
        if sqsize == 0 || u32::from(sqsize) + 1 > u32::from(entries_max) {
            return invalid_parameter(false, CONNECT_SQSIZE_OFFSET);
        }
        let controller = if qid == 0 {
            // Dynamic controller model: the host must ask for any controller (FFFFh).
            if connect_data.cntlid != CNTLID_DYNAMIC {
                return Outcome::rejected(Status::INVALID_FIELD);
            }
            match self.target.create_controller(&connect_data, self.port_id) {
                Ok(controller) => controller,
                Err(refusal) => {
                    return Outcome::Complete {
                        status: refusal.status,
                        result: u64::from(refusal.result),
                    }
                }
            }
        } else {
            let Some(controller) = self.target.find_controller(connect_data.cntlid) else {
                return invalid_parameter(true, ConnectData::CNTLID_OFFSET);
            };
            if controller.closed.load(Ordering::Acquire) {
                return invalid_parameter(true, ConnectData::CNTLID_OFFSET);
            }
            if controller.subnqn != connect_data.subnqn {
                return invalid_parameter(true, ConnectData::SUBNQN_OFFSET);
            }
            if controller.hostnqn != connect_data.hostnqn {
                return invalid_parameter(true, ConnectData::HOSTNQN_OFFSET);
            }
            if controller.host_id != connect_data.host_id {
                return invalid_parameter(true, ConnectData::HOST_ID_OFFSET);
            }
            // Every queue of a controller comes in through the port of its admin queue.
            if controller.port_id != self.port_id {
                return invalid_parameter(true, ConnectData::CNTLID_OFFSET);
            }
            let granted = controller.io_queues_granted.load(Ordering::Acquire);
            let qid_max = if granted == u32::MAX {
                u32::from(self.target.config().io_queues_max)
            } else {
                granted + 1
            };
            if controller.is_discovery() || u32::from(qid) > qid_max || qid > IO_QUEUES_MAX {
                return invalid_parameter(false, CONNECT_QID_OFFSET);
            }
            if !controller.ready() {
                return Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR);
            }
            if !controller.claim_io_queue(qid) {
                return Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR);
            }
            controller
        };
        let cntlid = controller.cntlid;
        self.sq_flow_control_disabled = sqe.connect_sq_flow_control_disabled();
        self.connected(controller, qid, sqsize, sqe.connect_kato_ms(), now_ms);
        // DW0: CNTLID; AUTHREQ (bits 17:16) = 0, no authentication required.
        Outcome::success(u64::from(cntlid))
    }

    // --- Fabrics commands on a connected queue ---

    fn execute_fabrics(&mut self, sqe: Sqe) -> Outcome {
        match (sqe.fctype(), self.qid == 0) {
            (fctype::CONNECT, _) => Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR),
            (fctype::PROPERTY_GET, true) => Outcome::settle(self.property_get(&sqe)),
            (fctype::PROPERTY_SET, true) => Outcome::settle(self.property_set(&sqe)),
            (fctype::DISCONNECT, false) => {
                self.mark_disconnected();
                Outcome::success(0)
            }
            (fctype::PROPERTY_GET | fctype::PROPERTY_SET, false) | (fctype::DISCONNECT, true) => {
                Outcome::rejected(Status::INVALID_QUEUE_TYPE)
            }
            // In-band authentication is not configured, so its commands are not supported.
            _ => Outcome::rejected(Status::INVALID_OPCODE),
        }
    }

    /// Fabrics commands on an I/O queue.
    pub(super) fn execute_io_fabrics(&mut self, sqe: Sqe) -> Outcome {
        self.execute_fabrics(sqe)
    }

    fn property_get(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        let controller = self.controller.as_ref().ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
        let value = match (sqe.property_size(), sqe.property_offset()) {
            (Some(PropertySize::Bytes8), property::CAP) => CAP,
            (Some(PropertySize::Bytes4), property::VS) => u64::from(VERSION),
            (Some(PropertySize::Bytes4), property::CC) => {
                u64::from(controller.cc.load(Ordering::Acquire))
            }
            (Some(PropertySize::Bytes4), property::CSTS) => {
                u64::from(controller.csts.load(Ordering::Acquire))
            }
            _ => return Err(Status::INVALID_FIELD),
        };
        Ok(Outcome::success(value))
    }

    fn property_set(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        use property::*;
        let controller = self.controller.as_ref().ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
        if sqe.property_size() != Some(PropertySize::Bytes4) || sqe.property_offset() != CC {
            return Err(Status::INVALID_FIELD);
        }
        let new = sqe.property_value() as u32;
        let old = controller.cc.swap(new, Ordering::AcqRel);
        let mut csts = controller.csts.load(Ordering::Acquire);
        let enable = new & CC_ENABLE != 0;
        if enable && old & CC_ENABLE == 0 {
            let css = (new >> CC_CSS_SHIFT) & CC_CSS_MASK;
            let mps = (new >> CC_MPS_SHIFT) & CC_MPS_MASK;
            let ams = (new >> CC_AMS_SHIFT) & CC_AMS_MASK;
            let iosqes = (new >> CC_IOSQES_SHIFT) & CC_ES_MASK;
            let iocqes = (new >> CC_IOCQES_SHIFT) & CC_ES_MASK;
            // Discovery controllers have no I/O queues, so their entry sizes are not checked.
            let sizes_valid = controller.is_discovery() || (iosqes == IOSQES && iocqes == IOCQES);
            if css == 0 && mps == 0 && ams == 0 && sizes_valid {
                csts |= CSTS_READY;
            } else {
                csts |= CSTS_FATAL;
            }
        } else if !enable && old & CC_ENABLE != 0 {
            // Controller reset: not ready until enabled again.
            csts &= !(CSTS_READY | CSTS_FATAL);
        }
        let shutdown_requested = (new >> CC_SHN_SHIFT) & CC_SHN_MASK != 0;
        let shutdown_was_requested = (old >> CC_SHN_SHIFT) & CC_SHN_MASK != 0;
        if shutdown_requested && !shutdown_was_requested {
            // Nothing is cached: a shutdown completes at once.
            csts = (csts & !CSTS_SHST_MASK) | CSTS_SHST_COMPLETE;
        } else if !shutdown_requested && shutdown_was_requested {
            csts &= !CSTS_SHST_MASK;
        }
        controller.csts.store(csts, Ordering::Release);
        Ok(Outcome::success(0))
    }

    // --- Admin commands ---

    /// A command on the connected admin queue.
    pub(super) fn execute_admin(&mut self, sqe: Sqe, _data: &[u8], now_ms: u64) -> Outcome {
        if sqe.opcode() == FABRICS_OPCODE {
            return self.execute_fabrics(sqe);
        }
        let Some(controller) = self.controller.clone() else {
            return Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR);
        };
        if !controller.ready() {
            return Outcome::rejected(Status::COMMAND_SEQUENCE_ERROR);
        }
        if sqe.fuse() != 0 {
            return Outcome::rejected(Status::INVALID_FIELD);
        }
        let discovery = controller.is_discovery();
        match sqe.opcode() {
            admin_opcode::IDENTIFY => Outcome::settle(self.identify(&sqe)),
            admin_opcode::GET_LOG_PAGE => Outcome::settle(self.get_log_page(&sqe)),
            admin_opcode::SET_FEATURES => Outcome::settle(self.set_features(&sqe)),
            admin_opcode::GET_FEATURES => Outcome::settle(self.get_features(&sqe)),
            admin_opcode::KEEP_ALIVE => {
                self.admin.keep_alive_last_ms = now_ms;
                Outcome::success(0)
            }
            admin_opcode::ASYNC_EVENT_REQUEST => {
                if self.admin.aer_cids.len() >= AER_OUTSTANDING_MAX {
                    return Outcome::rejected(Status::ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED);
                }
                self.admin.aer_cids.push_back(sqe.cid());
                Outcome::Deferred
            }
            // Commands complete too fast to be aborted: DW0 bit 0 = 1, not aborted.
            admin_opcode::ABORT if !discovery => Outcome::success(1),
            _ => Outcome::rejected(Status::INVALID_OPCODE),
        }
    }

    fn identify(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        let length = Queue::controller_to_host_length(sqe)? as usize;
        if length != IDENTIFY_BYTES {
            return Err(Status::DATA_SGL_LENGTH_INVALID);
        }
        let controller = self.controller.clone().ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
        let structure = (sqe.cdw(10) & 0xFF) as u8;
        let command_set = (sqe.cdw(11) >> 24) as u8;
        let nsid = sqe.nsid();
        self.scratch.clear();
        self.scratch.resize(IDENTIFY_BYTES, 0);
        let config = self.target.config();
        let namespace = match (&controller.namespace, structure) {
            (_, cns::CONTROLLER) => None,
            (None, _) => return Err(Status::INVALID_FIELD),
            (Some(namespace), _) => Some(namespace),
        };
        match structure {
            cns::CONTROLLER => {
                let (serial, controller_kind, oaes, nn, oncs, ioccsz, iorcsz) =
                    match &controller.namespace {
                        None => (
                            config.discovery_serial_number.clone(),
                            controller_type::DISCOVERY,
                            ASYNC_EVENTS_DISCOVERY,
                            0,
                            0,
                            0,
                            0,
                        ),
                        Some(namespace) => (
                            namespace.serial_number.clone(),
                            controller_type::IO,
                            ASYNC_EVENTS_IO,
                            1,
                            // ONCS: Dataset Management (bit 2) and Write Zeroes (bit 3).
                            (1 << 2) | (1 << 3),
                            IOCCSZ,
                            IORCSZ,
                        ),
                    };
                let io = controller.namespace.is_some();
                // An I/O controller belongs to a subsystem reachable through several ports and
                // controllers, with ANA reporting (one group: the namespace's). Linux requires
                // MNAN to be non-zero and at most NN once ANA is reported.
                let (cmic, anacap, ana_groups, mnan) = if io {
                    (cmic::MULTI_PORT | cmic::MULTI_CONTROLLER | cmic::ANA_REPORTING, ANACAP, 1, 1)
                } else {
                    (cmic::MULTI_CONTROLLER, 0, 0, 0)
                };
                IdentifyController {
                    serial_number: serial,
                    model_number: config.model_number.clone(),
                    firmware_revision: config.firmware_revision.clone(),
                    cmic,
                    mdts: MDTS,
                    cntlid: controller.cntlid,
                    version: VERSION,
                    oaes,
                    // CTRATT bit 0: 128-bit host identifier.
                    ctratt: 1,
                    cntrltype: controller_kind,
                    aerl: (AER_OUTSTANDING_MAX - 1) as u8,
                    // One read-only firmware slot.
                    frmw: (1 << 1) | 1,
                    // LPA bit 2: extended data for Get Log Page (NUMDU, LPOL/LPOU).
                    lpa: 1 << 2,
                    elpe: (ERROR_LOG_ENTRIES - 1) as u8,
                    kas: (KEEP_ALIVE_GRANULARITY_MS / 100) as u16,
                    anatt: if io { ANA_TRANSITION_SECONDS } else { 0 },
                    anacap,
                    anagrpmax: ana_groups,
                    nanagrpid: ana_groups,
                    mnan,
                    sqes: SQES,
                    cqes: CQES,
                    maxcmd: config.queue_entries_max,
                    nn,
                    oncs,
                    // No volatile write cache: writes are durable when completed.
                    vwc: 0,
                    // SGLs supported without alignment (bit 0) and with in-capsule offsets
                    // (bit 20).
                    sgls: 1 | (1 << 20),
                    subnqn: controller.subnqn.as_str().to_owned(),
                    ioccsz,
                    iorcsz,
                    icdoff: 0,
                    // FCATT bit 0 clear: dynamic controller model.
                    fcatt: 0,
                    msdbd: 1,
                    // OFCS bit 0: Disconnect is supported.
                    ofcs: 1,
                    ..Default::default()
                }
                .encode(&mut self.scratch);
            }
            cns::NAMESPACE | cns::NAMESPACE_DESCRIPTORS | cns::CSI_INDEPENDENT_NAMESPACE => {
                let Some(namespace) = namespace else { return Err(Status::INVALID_FIELD) };
                if nsid != 1 {
                    return Err(Status::INVALID_NAMESPACE_OR_FORMAT);
                }
                match structure {
                    cns::NAMESPACE => {
                        let size_blocks = namespace.size_blocks();
                        IdentifyNamespace {
                            nsze: size_blocks,
                            ncap: size_blocks,
                            nuse: size_blocks,
                            // NMIC bit 0: may be attached to two or more controllers.
                            nmic: 1,
                            // NSATTR bit 0: write protected (a snapshot).
                            nsattr: u8::from(namespace.read_only),
                            // Deallocated blocks read as zeros (001b); Write Zeroes may
                            // deallocate (bit 3).
                            dlfeat: 0x01 | 0x08,
                            nvmcap: u128::from(size_blocks)
                                * u128::from(namespace.block_size_bytes),
                            anagrpid: ANA_GROUP_ID,
                            nguid: namespace.nguid,
                            eui64: namespace.eui64,
                            lbaf0_lbads: namespace.block_size_bytes.trailing_zeros() as u8,
                            ..Default::default()
                        }
                        .encode(&mut self.scratch);
                    }
                    cns::NAMESPACE_DESCRIPTORS => NamespaceIdentifiers {
                        eui64: namespace.eui64,
                        nguid: namespace.nguid,
                        uuid: namespace.uuid,
                        csi: csi::NVM,
                    }
                    .encode(&mut self.scratch),
                    _ => encode_identify_namespace_independent(
                        &mut self.scratch,
                        1,
                        ANA_GROUP_ID,
                        true,
                    ),
                }
            }
            cns::ACTIVE_NAMESPACE_LIST | cns::CSI_ACTIVE_NAMESPACE_LIST => {
                if structure == cns::CSI_ACTIVE_NAMESPACE_LIST && command_set != csi::NVM {
                    // No namespace of another command set exists: an empty list.
                    encode_active_namespace_list(&mut self.scratch, &[]);
                    self.send_scratch(sqe.cid(), length);
                    return Ok(Outcome::success(0));
                }
                if nsid >= 0xFFFF_FFFE {
                    return Err(Status::INVALID_NAMESPACE_OR_FORMAT);
                }
                // NSID 1 is the only namespace: listed when the host asks for NSIDs above 0.
                let nsids: &[u32] = if nsid == 0 { &[1] } else { &[] };
                encode_active_namespace_list(&mut self.scratch, nsids);
            }
            cns::CSI_NAMESPACE => {
                if command_set != csi::NVM {
                    return Err(Status::INVALID_FIELD);
                }
                if nsid != 1 {
                    return Err(Status::INVALID_NAMESPACE_OR_FORMAT);
                }
                // The NVM command set namespace structure: no extended formats; all zeros.
            }
            cns::CSI_CONTROLLER => {
                if command_set != csi::NVM {
                    return Err(Status::INVALID_FIELD);
                }
                // No size limits beyond MDTS and the commands' own fields.
                IdentifyControllerNvm::default().encode(&mut self.scratch);
            }
            cns::IO_COMMAND_SET => {
                // One I/O command set combination: the NVM command set alone.
                self.scratch[0..8].copy_from_slice(&1u64.to_le_bytes());
            }
            _ => return Err(Status::INVALID_FIELD),
        }
        self.send_scratch(sqe.cid(), length);
        Ok(Outcome::success(0))
    }

    fn get_log_page(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        let length = Queue::controller_to_host_length(sqe)? as usize;
        let controller = self.controller.clone().ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
        let cdw10 = sqe.cdw(10);
        let lid = (cdw10 & 0xFF) as u8;
        let retain_async_event = cdw10 & (1 << 15) != 0;
        let dwords = u64::from((cdw10 >> 16) | ((sqe.cdw(11) & 0xFFFF) << 16)) + 1;
        let offset = u64::from(sqe.cdw(12)) | (u64::from(sqe.cdw(13)) << 32);
        let offset_is_index = sqe.cdw(14) & (1 << 23) != 0;
        if dwords * 4 != length as u64 {
            return Err(Status::DATA_SGL_LENGTH_INVALID);
        }
        if offset_is_index || offset % 4 != 0 {
            return Err(Status::INVALID_FIELD);
        }
        self.scratch.clear();
        let discovery = controller.is_discovery();
        match lid {
            log_page::ERROR_INFORMATION => {
                self.scratch.resize(ERROR_LOG_ENTRY_BYTES * ERROR_LOG_ENTRIES, 0);
            }
            log_page::SMART_HEALTH if !discovery => {
                self.scratch.resize(SMART_LOG_BYTES, 0);
                encode_smart_log(&mut self.scratch);
            }
            log_page::FIRMWARE_SLOT if !discovery => {
                self.scratch.resize(FIRMWARE_SLOT_LOG_BYTES, 0);
                encode_firmware_slot_log(
                    &mut self.scratch,
                    &self.target.config().firmware_revision,
                );
            }
            log_page::CHANGED_NAMESPACE_LIST if !discovery => {
                self.scratch.resize(CHANGED_NAMESPACE_LOG_BYTES, 0);
                if controller.namespace_changed.swap(false, Ordering::AcqRel) {
                    self.scratch[0..4].copy_from_slice(&1u32.to_le_bytes());
                }
                if !retain_async_event {
                    self.admin.namespace_notice_masked = false;
                }
            }
            log_page::ANA if !discovery => {
                let groups_only = (cdw10 >> LSP_SHIFT) & LSP_MASK & ANA_LSP_RETURN_GROUPS_ONLY != 0;
                let state = controller.ana();
                let change_count = self.target.ana_change_count();
                AnaLog {
                    change_count,
                    groups: vec![AnaGroup {
                        grpid: ANA_GROUP_ID,
                        change_count,
                        state: state.code(),
                        nsids: if groups_only { Vec::new() } else { vec![1] },
                    }],
                }
                .encode(&mut self.scratch);
                if !retain_async_event {
                    self.admin.ana_notice_masked = false;
                }
            }
            log_page::DISCOVERY if discovery => {
                self.target.encode_discovery_log(&mut self.scratch, &controller.hostnqn);
                if !retain_async_event {
                    self.admin.discovery_notice_masked = false;
                }
            }
            _ => return Err(Status::INVALID_LOG_PAGE),
        }
        if offset > self.scratch.len() as u64 {
            return Err(Status::INVALID_FIELD);
        }
        // The requested window of the log; bytes past its end read as zeros.
        self.scratch.drain(..offset as usize);
        self.scratch.resize(length, 0);
        self.send_scratch(sqe.cid(), length);
        Ok(Outcome::success(0))
    }

    fn set_features(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        let controller = self.controller.clone().ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
        let cdw10 = sqe.cdw(10);
        let cdw11 = sqe.cdw(11);
        let fid = (cdw10 & 0xFF) as u8;
        if cdw10 & (1 << 31) != 0 {
            return Err(Status::FEATURE_NOT_SAVEABLE);
        }
        let discovery = controller.is_discovery();
        match fid {
            feature::NUMBER_OF_QUEUES if !discovery => {
                let (submission, completion) = (cdw11 & 0xFFFF, cdw11 >> 16);
                if submission == 0xFFFF || completion == 0xFFFF {
                    return Err(Status::INVALID_FIELD);
                }
                if controller.io_queues_connected() {
                    return Err(Status::COMMAND_SEQUENCE_ERROR);
                }
                // Queues come in pairs over Fabrics: grant the same number of each.
                let limit = u32::from(self.target.config().io_queues_max) - 1;
                let granted = submission.max(completion).min(limit);
                controller.io_queues_granted.store(granted, Ordering::Release);
                Ok(Outcome::success(u64::from(granted | (granted << 16))))
            }
            feature::ASYNC_EVENT_CONFIGURATION => {
                let supported = if discovery { ASYNC_EVENTS_DISCOVERY } else { ASYNC_EVENTS_IO };
                self.admin.async_event_configuration = cdw11 & supported;
                Ok(Outcome::success(0))
            }
            feature::KEEP_ALIVE_TIMER => {
                self.admin.kato_ms = cdw11;
                Ok(Outcome::success(0))
            }
            // VOLATILE_WRITE_CACHE among them: there is none (VWC = 0).
            _ => Err(Status::INVALID_FIELD),
        }
    }

    fn get_features(&mut self, sqe: &Sqe) -> Result<Outcome, Status> {
        let controller = self.controller.clone().ok_or(Status::COMMAND_SEQUENCE_ERROR)?;
        let cdw10 = sqe.cdw(10);
        let fid = (cdw10 & 0xFF) as u8;
        let select = (cdw10 >> 8) & 0x7;
        let discovery = controller.is_discovery();
        let supported = match fid {
            feature::NUMBER_OF_QUEUES => !discovery,
            feature::ASYNC_EVENT_CONFIGURATION | feature::KEEP_ALIVE_TIMER => true,
            _ => false,
        };
        if !supported {
            return Err(Status::INVALID_FIELD);
        }
        if select == 3 {
            return Ok(Outcome::success(FEATURE_CHANGEABLE));
        }
        if select > 3 {
            return Err(Status::INVALID_FIELD);
        }
        // Nothing is saveable, so the saved value (2) is the default (1).
        let current = select == 0;
        let value = match fid {
            feature::NUMBER_OF_QUEUES => {
                let granted = controller.io_queues_granted.load(Ordering::Acquire);
                let count = if granted == u32::MAX || !current {
                    u32::from(self.target.config().io_queues_max) - 1
                } else {
                    granted
                };
                count | (count << 16)
            }
            feature::ASYNC_EVENT_CONFIGURATION if current => self.admin.async_event_configuration,
            feature::KEEP_ALIVE_TIMER if current => self.admin.kato_ms,
            _ => 0,
        };
        Ok(Outcome::success(u64::from(value)))
    }
}
