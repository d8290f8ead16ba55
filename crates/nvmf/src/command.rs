//! NVMe commands and completions as they travel inside capsules: the 64-byte submission queue
//! entry (SQE), the 16-byte completion queue entry (CQE), SGL descriptors, opcodes, status codes
//! and the Fabrics command fields (NVMe base specification 2.0, NVMe over Fabrics).
//!
//! The SQE is kept as its 64 raw bytes with typed accessors, because the target reads different
//! fields per opcode and the host builds them; nothing is decoded that is not needed. Builders
//! for the commands Ferrite uses let the initiator and the tests write no byte layout of their
//! own. All integers are little-endian.

use std::fmt;

/// Size of a submission queue entry.
pub const SQE_BYTES: usize = 64;
/// Size of a completion queue entry.
pub const CQE_BYTES: usize = 16;
/// Size of the data of a Fabrics Connect command.
pub const CONNECT_DATA_BYTES: usize = 1024;
/// The NSID that names every namespace (broadcast).
pub const NSID_ALL: u32 = 0xFFFF_FFFF;
/// Connect CATTR bit 2: disable SQ flow control.
pub const CONNECT_ATTRIBUTE_DISABLE_SQ_FLOW_CONTROL: u8 = 1 << 2;
/// Controller ID a host puts in an admin queue Connect to ask for any controller (dynamic model).
pub const CNTLID_DYNAMIC: u16 = 0xFFFF;
/// Largest controller ID a subsystem may hand out (FFF0h..FFFFh are reserved).
pub const CNTLID_MAX: u16 = 0xFFEF;

/// Admin command opcodes (NVMe base specification 2.0, figure 28).
pub mod admin_opcode {
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const DELETE_IO_CQ: u8 = 0x04;
    pub const CREATE_IO_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0A;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    pub const NAMESPACE_MANAGEMENT: u8 = 0x0D;
    pub const FIRMWARE_COMMIT: u8 = 0x10;
    pub const FIRMWARE_DOWNLOAD: u8 = 0x11;
    pub const DEVICE_SELF_TEST: u8 = 0x14;
    pub const NAMESPACE_ATTACHMENT: u8 = 0x15;
    pub const KEEP_ALIVE: u8 = 0x18;
    pub const DIRECTIVE_SEND: u8 = 0x19;
    pub const DIRECTIVE_RECEIVE: u8 = 0x1A;
    pub const DOORBELL_BUFFER_CONFIG: u8 = 0x7C;
    pub const FORMAT_NVM: u8 = 0x80;
    pub const SECURITY_SEND: u8 = 0x81;
    pub const SECURITY_RECEIVE: u8 = 0x82;
    pub const SANITIZE: u8 = 0x84;
    pub const GET_LBA_STATUS: u8 = 0x86;
}

/// NVM command set I/O opcodes (NVM command set specification 1.0, figure 18).
pub mod io_opcode {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_UNCORRECTABLE: u8 = 0x04;
    pub const COMPARE: u8 = 0x05;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
    pub const VERIFY: u8 = 0x0C;
    pub const RESERVATION_REGISTER: u8 = 0x0D;
    pub const RESERVATION_REPORT: u8 = 0x0E;
    pub const RESERVATION_ACQUIRE: u8 = 0x11;
    pub const RESERVATION_RELEASE: u8 = 0x15;
    pub const COPY: u8 = 0x19;
}

/// The opcode shared by every Fabrics command; the FCTYPE field (SQE byte 4) tells them apart.
pub const FABRICS_OPCODE: u8 = 0x7F;

/// Fabrics command types (FCTYPE).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTHENTICATION_SEND: u8 = 0x05;
    pub const AUTHENTICATION_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

/// Controller or Namespace Structure values of the Identify command (CDW10 bits 7:0).
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NAMESPACE_LIST: u8 = 0x02;
    pub const NAMESPACE_DESCRIPTORS: u8 = 0x03;
    pub const NVM_SET_LIST: u8 = 0x04;
    pub const CSI_NAMESPACE: u8 = 0x05;
    pub const CSI_CONTROLLER: u8 = 0x06;
    pub const CSI_ACTIVE_NAMESPACE_LIST: u8 = 0x07;
    pub const CSI_INDEPENDENT_NAMESPACE: u8 = 0x08;
    pub const IO_COMMAND_SET: u8 = 0x1C;
}

/// Command Set Identifiers.
pub mod csi {
    pub const NVM: u8 = 0x00;
    pub const KEY_VALUE: u8 = 0x01;
    pub const ZONED: u8 = 0x02;
}

/// Log page identifiers.
pub mod log_page {
    pub const ERROR_INFORMATION: u8 = 0x01;
    pub const SMART_HEALTH: u8 = 0x02;
    pub const FIRMWARE_SLOT: u8 = 0x03;
    pub const CHANGED_NAMESPACE_LIST: u8 = 0x04;
    pub const COMMANDS_SUPPORTED_AND_EFFECTS: u8 = 0x05;
    /// Asymmetric Namespace Access.
    pub const ANA: u8 = 0x0C;
    pub const DISCOVERY: u8 = 0x70;
}

/// Feature identifiers.
pub mod feature {
    pub const ARBITRATION: u8 = 0x01;
    pub const POWER_MANAGEMENT: u8 = 0x02;
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIGURATION: u8 = 0x0B;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
    pub const HOST_BEHAVIOR_SUPPORT: u8 = 0x16;
}

/// Controller property offsets (Property Get/Set OFST) and register bits.
pub mod property {
    pub const CAP: u32 = 0x00;
    pub const VS: u32 = 0x08;
    pub const INTMS: u32 = 0x0C;
    pub const INTMC: u32 = 0x10;
    pub const CC: u32 = 0x14;
    pub const CSTS: u32 = 0x1C;
    pub const NSSR: u32 = 0x20;

    /// CC.EN: enable.
    pub const CC_ENABLE: u32 = 1 << 0;
    pub const CC_CSS_SHIFT: u32 = 4;
    pub const CC_CSS_MASK: u32 = 0x7;
    pub const CC_MPS_SHIFT: u32 = 7;
    pub const CC_MPS_MASK: u32 = 0xF;
    pub const CC_AMS_SHIFT: u32 = 11;
    pub const CC_AMS_MASK: u32 = 0x7;
    pub const CC_SHN_SHIFT: u32 = 14;
    pub const CC_SHN_MASK: u32 = 0x3;
    pub const CC_IOSQES_SHIFT: u32 = 16;
    pub const CC_IOCQES_SHIFT: u32 = 20;
    pub const CC_ES_MASK: u32 = 0xF;
    /// CSTS.RDY: ready.
    pub const CSTS_READY: u32 = 1 << 0;
    /// CSTS.CFS: controller fatal status.
    pub const CSTS_FATAL: u32 = 1 << 1;
    pub const CSTS_SHST_SHIFT: u32 = 2;
    /// CSTS.SHST = 10b: shutdown processing complete.
    pub const CSTS_SHST_COMPLETE: u32 = 2 << 2;
    pub const CSTS_SHST_MASK: u32 = 3 << 2;

    /// The value of VS (and Identify Controller VER) for a version.
    pub const fn version(major: u32, minor: u32, tertiary: u32) -> u32 {
        (major << 16) | (minor << 8) | tertiary
    }
}

/// Status Code Types (CQE status bits 10:8 of the status field).
pub mod status_code_type {
    pub const GENERIC: u8 = 0x0;
    pub const COMMAND_SPECIFIC: u8 = 0x1;
    pub const MEDIA_AND_DATA_INTEGRITY: u8 = 0x2;
    pub const PATH_RELATED: u8 = 0x3;
    pub const VENDOR_SPECIFIC: u8 = 0x7;
}

/// The 15-bit Status field of a CQE (DW3 bits 31:17): SC, SCT, CRD, More and DNR. The phase tag
/// (bit 16 of DW3) is not part of it; Fabrics reserve it and it is always sent as 0.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(u16);

impl Status {
    pub const SUCCESS: Status = Status(0);

    // Generic command status (SCT 0).
    pub const INVALID_OPCODE: Status = Status::new(status_code_type::GENERIC, 0x01);
    pub const INVALID_FIELD: Status = Status::new(status_code_type::GENERIC, 0x02);
    pub const COMMAND_ID_CONFLICT: Status = Status::new(status_code_type::GENERIC, 0x03);
    pub const DATA_TRANSFER_ERROR: Status = Status::new(status_code_type::GENERIC, 0x04);
    pub const INTERNAL_ERROR: Status = Status::new(status_code_type::GENERIC, 0x06);
    pub const ABORT_REQUESTED: Status = Status::new(status_code_type::GENERIC, 0x07);
    pub const INVALID_NAMESPACE_OR_FORMAT: Status = Status::new(status_code_type::GENERIC, 0x0B);
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::new(status_code_type::GENERIC, 0x0C);
    pub const INVALID_SGL_SEGMENT_DESCRIPTOR: Status = Status::new(status_code_type::GENERIC, 0x0D);
    pub const INVALID_SGL_DESCRIPTOR_COUNT: Status = Status::new(status_code_type::GENERIC, 0x0E);
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::new(status_code_type::GENERIC, 0x0F);
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::new(status_code_type::GENERIC, 0x11);
    pub const SGL_OFFSET_INVALID: Status = Status::new(status_code_type::GENERIC, 0x16);
    pub const NAMESPACE_WRITE_PROTECTED: Status = Status::new(status_code_type::GENERIC, 0x20);
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::new(status_code_type::GENERIC, 0x22);
    pub const LBA_OUT_OF_RANGE: Status = Status::new(status_code_type::GENERIC, 0x80);
    pub const CAPACITY_EXCEEDED: Status = Status::new(status_code_type::GENERIC, 0x81);
    pub const NAMESPACE_NOT_READY: Status = Status::new(status_code_type::GENERIC, 0x82);

    // Command specific status (SCT 1), admin commands.
    pub const INVALID_QUEUE_IDENTIFIER: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x01);
    pub const INVALID_QUEUE_SIZE: Status = Status::new(status_code_type::COMMAND_SPECIFIC, 0x02);
    pub const ABORT_COMMAND_LIMIT_EXCEEDED: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x03);
    pub const ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x05);
    pub const INVALID_LOG_PAGE: Status = Status::new(status_code_type::COMMAND_SPECIFIC, 0x09);
    pub const FEATURE_NOT_SAVEABLE: Status = Status::new(status_code_type::COMMAND_SPECIFIC, 0x0D);
    pub const FEATURE_NOT_CHANGEABLE: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x0E);
    pub const FEATURE_NOT_NAMESPACE_SPECIFIC: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x0F);
    // Command specific status (SCT 1), NVM I/O commands.
    pub const CONFLICTING_ATTRIBUTES: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x80);
    pub const ATTEMPTED_WRITE_TO_READ_ONLY_RANGE: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x82);
    // Command specific status (SCT 1), Fabrics commands.
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x80);
    pub const CONTROLLER_BUSY: Status = Status::new(status_code_type::COMMAND_SPECIFIC, 0x81);
    pub const CONNECT_INVALID_PARAMETERS: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x82);
    pub const CONNECT_RESTART_DISCOVERY: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x83);
    pub const CONNECT_INVALID_HOST: Status = Status::new(status_code_type::COMMAND_SPECIFIC, 0x84);
    pub const INVALID_QUEUE_TYPE: Status = Status::new(status_code_type::COMMAND_SPECIFIC, 0x85);
    pub const DISCOVER_RESTART: Status = Status::new(status_code_type::COMMAND_SPECIFIC, 0x90);
    pub const AUTHENTICATION_REQUIRED: Status =
        Status::new(status_code_type::COMMAND_SPECIFIC, 0x91);

    // Media and data integrity errors (SCT 2).
    pub const WRITE_FAULT: Status = Status::new(status_code_type::MEDIA_AND_DATA_INTEGRITY, 0x80);
    pub const UNRECOVERED_READ_ERROR: Status =
        Status::new(status_code_type::MEDIA_AND_DATA_INTEGRITY, 0x81);
    pub const ACCESS_DENIED: Status = Status::new(status_code_type::MEDIA_AND_DATA_INTEGRITY, 0x86);

    // Path related status (SCT 3): a host retries these on another path, so they never carry DNR.
    pub const INTERNAL_PATH_ERROR: Status = Status::new(status_code_type::PATH_RELATED, 0x00);
    pub const ANA_PERSISTENT_LOSS: Status = Status::new(status_code_type::PATH_RELATED, 0x01);
    pub const ANA_INACCESSIBLE: Status = Status::new(status_code_type::PATH_RELATED, 0x02);
    pub const ANA_TRANSITION: Status = Status::new(status_code_type::PATH_RELATED, 0x03);

    const DNR_BIT: u16 = 1 << 14;
    const MORE_BIT: u16 = 1 << 13;

    /// A status from its type and code, with DNR, More and CRD clear.
    pub const fn new(status_code_type: u8, status_code: u8) -> Status {
        Status((((status_code_type & 0x7) as u16) << 8) | status_code as u16)
    }

    /// The status field as carried in CQE bytes 14..16 shifted right by one (without phase).
    pub const fn from_raw(raw: u16) -> Status {
        Status(raw & 0x7FFF)
    }

    pub const fn raw(self) -> u16 {
        self.0
    }

    /// The same status with Do Not Retry set: retrying the same command will fail the same way.
    pub const fn with_dnr(self) -> Status {
        Status(self.0 | Self::DNR_BIT)
    }

    pub const fn status_code(self) -> u8 {
        (self.0 & 0xFF) as u8
    }

    pub const fn status_code_type(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }

    pub const fn do_not_retry(self) -> bool {
        self.0 & Self::DNR_BIT != 0
    }

    pub const fn more(self) -> bool {
        self.0 & Self::MORE_BIT != 0
    }

    /// Path related (SCT 3): the command may succeed on another path to the namespace.
    pub const fn is_path_error(self) -> bool {
        self.status_code_type() == status_code_type::PATH_RELATED
    }

    pub const fn is_success(self) -> bool {
        self.status_code() == 0 && self.status_code_type() == 0
    }

    /// Compares type and code only, ignoring DNR, More and CRD.
    pub const fn same_code(self, other: Status) -> bool {
        (self.0 & 0x7FF) == (other.0 & 0x7FF)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Status(sct={:#x}, sc={:#04x}{})",
            self.status_code_type(),
            self.status_code(),
            if self.do_not_retry() { ", dnr" } else { "" }
        )
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// SGL descriptor type bytes (byte 15 of a descriptor: type in bits 7:4, subtype in bits 3:0).
pub mod sgl_type {
    /// Data Block descriptor, Offset subtype: data is in the capsule at the given offset.
    pub const DATA_BLOCK_OFFSET: u8 = 0x01;
    /// Transport SGL Data Block descriptor, transport subtype Ah: the data moves in H2CData or
    /// C2HData PDUs (NVMe/TCP transport specification).
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5A;
}

/// One 16-byte SGL descriptor (the SQE's SGL1 at bytes 24..40).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SglDescriptor {
    /// Address, or the offset into the in-capsule data for [`sgl_type::DATA_BLOCK_OFFSET`].
    pub address: u64,
    pub length: u32,
    /// Byte 15: descriptor type and subtype, one of [`sgl_type`].
    pub descriptor_type: u8,
}

impl SglDescriptor {
    /// Data carried in the command capsule, starting `offset` bytes into the in-capsule data.
    pub const fn in_capsule(offset: u64, length: u32) -> Self {
        Self { address: offset, length, descriptor_type: sgl_type::DATA_BLOCK_OFFSET }
    }

    /// Data moved by H2CData/C2HData PDUs (or no data when `length` is 0).
    pub const fn transport(length: u32) -> Self {
        Self { address: 0, length, descriptor_type: sgl_type::TRANSPORT_DATA_BLOCK }
    }

    pub fn encode(&self) -> [u8; 16] {
        let mut bytes = [0u8; 16];
        bytes[0..8].copy_from_slice(&self.address.to_le_bytes());
        bytes[8..12].copy_from_slice(&self.length.to_le_bytes());
        bytes[15] = self.descriptor_type;
        bytes
    }

    pub fn decode(bytes: &[u8; 16]) -> Self {
        Self {
            address: le_u64(&bytes[0..8]),
            length: le_u32(&bytes[8..12]),
            descriptor_type: bytes[15],
        }
    }
}

/// PSDT values (CDW0 bits 15:14): how the data pointer is to be read.
pub mod psdt {
    pub const PRP: u8 = 0;
    /// SGL for data, metadata as a contiguous buffer: what Fabrics hosts send.
    pub const SGL_METADATA_BUFFER: u8 = 1;
    pub const SGL_METADATA_SGL: u8 = 2;
}

/// Size of a Property Get/Set access (ATTRIB bits 2:0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PropertySize {
    Bytes4,
    Bytes8,
}

/// Data direction of a command, from the low two bits of its opcode (or FCTYPE for Fabrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataDirection {
    None,
    HostToController,
    ControllerToHost,
    Bidirectional,
}

impl DataDirection {
    pub const fn from_opcode(opcode: u8) -> Self {
        match opcode & 0x3 {
            0 => DataDirection::None,
            1 => DataDirection::HostToController,
            2 => DataDirection::ControllerToHost,
            _ => DataDirection::Bidirectional,
        }
    }
}

/// A submission queue entry: the 64 bytes, with typed accessors and builders.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sqe([u8; SQE_BYTES]);

impl Default for Sqe {
    fn default() -> Self {
        Self([0; SQE_BYTES])
    }
}

impl fmt::Debug for Sqe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sqe")
            .field("opcode", &format_args!("{:#04x}", self.opcode()))
            .field("cid", &self.cid())
            .field("nsid", &self.nsid())
            .field("sgl", &self.sgl())
            .field("cdw10", &format_args!("{:#x}", self.cdw(10)))
            .field("cdw11", &format_args!("{:#x}", self.cdw(11)))
            .field("cdw12", &format_args!("{:#x}", self.cdw(12)))
            .finish()
    }
}

impl Sqe {
    /// A zeroed SQE with the opcode and command identifier set, and PSDT = SGL, as every Fabrics
    /// host sends.
    pub fn new(opcode: u8, cid: u16) -> Self {
        let mut sqe = Self::default();
        sqe.0[0] = opcode;
        sqe.0[1] = psdt::SGL_METADATA_BUFFER << 6;
        sqe.set_cid(cid);
        sqe
    }

    pub const fn from_bytes(bytes: [u8; SQE_BYTES]) -> Self {
        Self(bytes)
    }

    pub const fn as_bytes(&self) -> &[u8; SQE_BYTES] {
        &self.0
    }

    pub const fn opcode(&self) -> u8 {
        self.0[0]
    }

    /// FUSE (CDW0 bits 9:8).
    pub const fn fuse(&self) -> u8 {
        self.0[1] & 0x3
    }

    /// PSDT (CDW0 bits 15:14), one of [`psdt`].
    pub const fn psdt(&self) -> u8 {
        self.0[1] >> 6
    }

    pub fn cid(&self) -> u16 {
        le_u16(&self.0[2..4])
    }

    pub fn set_cid(&mut self, cid: u16) {
        self.0[2..4].copy_from_slice(&cid.to_le_bytes());
    }

    pub fn nsid(&self) -> u32 {
        le_u32(&self.0[4..8])
    }

    pub fn set_nsid(&mut self, nsid: u32) {
        self.0[4..8].copy_from_slice(&nsid.to_le_bytes());
    }

    /// Command dword `index` (0..=15), little-endian at bytes `4 * index`.
    pub fn cdw(&self, index: usize) -> u32 {
        assert!(index < 16, "command dword {index} does not exist");
        le_u32(&self.0[4 * index..4 * index + 4])
    }

    pub fn set_cdw(&mut self, index: usize, value: u32) {
        assert!(index < 16, "command dword {index} does not exist");
        self.0[4 * index..4 * index + 4].copy_from_slice(&value.to_le_bytes());
    }

    /// SGL1, the data pointer (bytes 24..40).
    pub fn sgl(&self) -> SglDescriptor {
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&self.0[24..40]);
        SglDescriptor::decode(&bytes)
    }

    pub fn set_sgl(&mut self, sgl: SglDescriptor) {
        self.0[24..40].copy_from_slice(&sgl.encode());
    }

    /// Builder form of [`Sqe::set_sgl`].
    pub fn with_sgl(mut self, sgl: SglDescriptor) -> Self {
        self.set_sgl(sgl);
        self
    }

    /// FCTYPE of a Fabrics command (byte 4).
    pub const fn fctype(&self) -> u8 {
        self.0[4]
    }

    /// Direction of the command's data: from FCTYPE for Fabrics commands, else from the opcode.
    pub const fn data_direction(&self) -> DataDirection {
        if self.opcode() == FABRICS_OPCODE {
            DataDirection::from_opcode(self.fctype())
        } else {
            DataDirection::from_opcode(self.opcode())
        }
    }

    fn u16_at(&self, offset: usize) -> u16 {
        le_u16(&self.0[offset..offset + 2])
    }

    fn set_u16_at(&mut self, offset: usize, value: u16) {
        self.0[offset..offset + 2].copy_from_slice(&value.to_le_bytes());
    }

    // --- Fabrics fields ---

    fn fabrics(fctype: u8, cid: u16) -> Self {
        let mut sqe = Sqe::new(FABRICS_OPCODE, cid);
        sqe.0[4] = fctype;
        sqe
    }

    /// Connect: RECFMT (bytes 40..42).
    pub fn connect_record_format(&self) -> u16 {
        self.u16_at(40)
    }
    /// Connect: QID (bytes 42..44).
    pub fn connect_qid(&self) -> u16 {
        self.u16_at(42)
    }
    /// Connect: SQSIZE, 0's based (bytes 44..46).
    pub fn connect_sqsize(&self) -> u16 {
        self.u16_at(44)
    }
    /// Connect: CATTR (byte 46).
    pub const fn connect_attributes(&self) -> u8 {
        self.0[46]
    }
    /// Connect: CATTR bit 2, the host disables SQ flow control for this queue (SQHD is then not
    /// maintained and a controller may complete reads with a C2HData SUCCESS flag).
    pub const fn connect_sq_flow_control_disabled(&self) -> bool {
        self.0[46] & CONNECT_ATTRIBUTE_DISABLE_SQ_FLOW_CONTROL != 0
    }
    /// Connect: KATO in milliseconds (bytes 48..52).
    pub fn connect_kato_ms(&self) -> u32 {
        le_u32(&self.0[48..52])
    }

    /// A Connect command; its 1024 bytes of [`ConnectData`] go in the capsule or by R2T, as the
    /// SGL (set by the caller) says.
    pub fn connect(cid: u16, qid: u16, sqsize: u16, kato_ms: u32) -> Self {
        let mut sqe = Sqe::fabrics(fctype::CONNECT, cid);
        sqe.set_u16_at(42, qid);
        sqe.set_u16_at(44, sqsize);
        sqe.0[48..52].copy_from_slice(&kato_ms.to_le_bytes());
        sqe
    }

    /// Connect: sets CATTR (byte 46), for example
    /// [`CONNECT_ATTRIBUTE_DISABLE_SQ_FLOW_CONTROL`].
    pub fn set_connect_attributes(&mut self, cattr: u8) {
        self.0[46] = cattr;
    }

    /// Property Get/Set: ATTRIB size (byte 40 bits 2:0).
    pub const fn property_size(&self) -> Option<PropertySize> {
        match self.0[40] & 0x7 {
            0 => Some(PropertySize::Bytes4),
            1 => Some(PropertySize::Bytes8),
            _ => None,
        }
    }
    /// Property Get/Set: OFST (bytes 44..48).
    pub fn property_offset(&self) -> u32 {
        le_u32(&self.0[44..48])
    }
    /// Property Set: VALUE (bytes 48..56).
    pub fn property_value(&self) -> u64 {
        le_u64(&self.0[48..56])
    }

    pub fn property_get(cid: u16, offset: u32, size: PropertySize) -> Self {
        let mut sqe = Sqe::fabrics(fctype::PROPERTY_GET, cid);
        sqe.0[40] = if size == PropertySize::Bytes8 { 1 } else { 0 };
        sqe.0[44..48].copy_from_slice(&offset.to_le_bytes());
        sqe
    }

    pub fn property_set(cid: u16, offset: u32, size: PropertySize, value: u64) -> Self {
        let mut sqe = Sqe::fabrics(fctype::PROPERTY_SET, cid);
        sqe.0[40] = if size == PropertySize::Bytes8 { 1 } else { 0 };
        sqe.0[44..48].copy_from_slice(&offset.to_le_bytes());
        sqe.0[48..56].copy_from_slice(&value.to_le_bytes());
        sqe
    }

    pub fn disconnect(cid: u16) -> Self {
        Sqe::fabrics(fctype::DISCONNECT, cid)
    }

    // --- Admin builders ---

    /// Identify; the host receives `length` bytes (normally 4096) by C2HData.
    pub fn identify(cid: u16, cns: u8, nsid: u32, csi: u8, length: u32) -> Self {
        let mut sqe = Sqe::new(admin_opcode::IDENTIFY, cid);
        sqe.set_nsid(nsid);
        sqe.set_cdw(10, u32::from(cns));
        sqe.set_cdw(11, u32::from(csi) << 24);
        sqe.with_sgl(SglDescriptor::transport(length))
    }

    /// Get Log Page of `length` bytes (a multiple of 4, at least 4) from byte `offset`.
    pub fn get_log_page(cid: u16, nsid: u32, lid: u8, offset: u64, length: u32) -> Self {
        assert!(length >= 4 && length % 4 == 0, "log page length {length} is not whole dwords");
        let numd = length / 4 - 1;
        let mut sqe = Sqe::new(admin_opcode::GET_LOG_PAGE, cid);
        sqe.set_nsid(nsid);
        sqe.set_cdw(10, u32::from(lid) | ((numd & 0xFFFF) << 16));
        sqe.set_cdw(11, numd >> 16);
        sqe.set_cdw(12, offset as u32);
        sqe.set_cdw(13, (offset >> 32) as u32);
        sqe.with_sgl(SglDescriptor::transport(length))
    }

    pub fn set_features(cid: u16, fid: u8, cdw11: u32) -> Self {
        let mut sqe = Sqe::new(admin_opcode::SET_FEATURES, cid);
        sqe.set_cdw(10, u32::from(fid));
        sqe.set_cdw(11, cdw11);
        sqe.with_sgl(SglDescriptor::transport(0))
    }

    /// Get Features; `select` is SEL (0 current, 1 default, 2 saved, 3 supported capabilities).
    pub fn get_features(cid: u16, fid: u8, select: u8) -> Self {
        let mut sqe = Sqe::new(admin_opcode::GET_FEATURES, cid);
        sqe.set_cdw(10, u32::from(fid) | (u32::from(select & 0x7) << 8));
        sqe.with_sgl(SglDescriptor::transport(0))
    }

    pub fn keep_alive(cid: u16) -> Self {
        Sqe::new(admin_opcode::KEEP_ALIVE, cid).with_sgl(SglDescriptor::transport(0))
    }

    pub fn async_event_request(cid: u16) -> Self {
        Sqe::new(admin_opcode::ASYNC_EVENT_REQUEST, cid).with_sgl(SglDescriptor::transport(0))
    }

    pub fn abort(cid: u16, sqid: u16, target_cid: u16) -> Self {
        let mut sqe = Sqe::new(admin_opcode::ABORT, cid);
        sqe.set_cdw(10, u32::from(sqid) | (u32::from(target_cid) << 16));
        sqe
    }

    // --- NVM I/O builders (the caller sets the SGL for commands with data) ---

    fn lba_command(opcode: u8, cid: u16, nsid: u32, slba: u64, blocks: u32) -> Self {
        assert!((1..=65536).contains(&blocks), "{blocks} blocks do not fit in NLB");
        let mut sqe = Sqe::new(opcode, cid);
        sqe.set_nsid(nsid);
        sqe.set_cdw(10, slba as u32);
        sqe.set_cdw(11, (slba >> 32) as u32);
        sqe.set_cdw(12, blocks - 1);
        sqe
    }

    pub fn read(cid: u16, nsid: u32, slba: u64, blocks: u32) -> Self {
        Sqe::lba_command(io_opcode::READ, cid, nsid, slba, blocks)
    }

    pub fn write(cid: u16, nsid: u32, slba: u64, blocks: u32) -> Self {
        Sqe::lba_command(io_opcode::WRITE, cid, nsid, slba, blocks)
    }

    pub fn write_zeroes(cid: u16, nsid: u32, slba: u64, blocks: u32, deallocate: bool) -> Self {
        let mut sqe = Sqe::lba_command(io_opcode::WRITE_ZEROES, cid, nsid, slba, blocks);
        if deallocate {
            sqe.set_cdw(12, sqe.cdw(12) | (1 << 25));
        }
        sqe.with_sgl(SglDescriptor::transport(0))
    }

    pub fn flush(cid: u16, nsid: u32) -> Self {
        let mut sqe = Sqe::new(io_opcode::FLUSH, cid);
        sqe.set_nsid(nsid);
        sqe.with_sgl(SglDescriptor::transport(0))
    }

    /// Dataset Management over `ranges` 16-byte [`DsmRange`]s (1..=256), with the Deallocate
    /// attribute when `deallocate`; the caller sets the SGL for the range data.
    pub fn dataset_management(cid: u16, nsid: u32, ranges: u32, deallocate: bool) -> Self {
        assert!((1..=DSM_RANGES_MAX as u32).contains(&ranges), "{ranges} DSM ranges");
        let mut sqe = Sqe::new(io_opcode::DATASET_MANAGEMENT, cid);
        sqe.set_nsid(nsid);
        sqe.set_cdw(10, ranges - 1);
        sqe.set_cdw(11, if deallocate { DSM_ATTRIBUTE_DEALLOCATE } else { 0 });
        sqe
    }

    /// Read/Write/Write Zeroes: starting LBA (CDW11:CDW10).
    pub fn slba(&self) -> u64 {
        u64::from(self.cdw(10)) | (u64::from(self.cdw(11)) << 32)
    }

    /// Read/Write/Write Zeroes: number of logical blocks, converted from 0's based NLB.
    pub fn block_count(&self) -> u32 {
        (self.cdw(12) & 0xFFFF) + 1
    }
}

/// Largest number of ranges in one Dataset Management command.
pub const DSM_RANGES_MAX: usize = 256;
/// Size of one Dataset Management range.
pub const DSM_RANGE_BYTES: usize = 16;
/// Dataset Management attribute AD (CDW11 bit 2): deallocate the ranges.
pub const DSM_ATTRIBUTE_DEALLOCATE: u32 = 1 << 2;

/// One Dataset Management range: context attributes, length in blocks (1's based), start LBA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DsmRange {
    pub context_attributes: u32,
    pub blocks: u32,
    pub slba: u64,
}

impl DsmRange {
    pub fn encode(&self) -> [u8; DSM_RANGE_BYTES] {
        let mut bytes = [0u8; DSM_RANGE_BYTES];
        bytes[0..4].copy_from_slice(&self.context_attributes.to_le_bytes());
        bytes[4..8].copy_from_slice(&self.blocks.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.slba.to_le_bytes());
        bytes
    }

    /// Decodes the first 16 bytes of `bytes`, which must hold at least that many.
    pub fn decode(bytes: &[u8]) -> Self {
        assert!(bytes.len() >= DSM_RANGE_BYTES, "a DSM range is 16 bytes");
        Self {
            context_attributes: le_u32(&bytes[0..4]),
            blocks: le_u32(&bytes[4..8]),
            slba: le_u64(&bytes[8..16]),
        }
    }
}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cqe {
    /// Command specific result: DW0 in the low half, DW1 in the high half.
    pub result: u64,
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
}

impl Cqe {
    pub fn encode(&self) -> [u8; CQE_BYTES] {
        let mut bytes = [0u8; CQE_BYTES];
        bytes[0..8].copy_from_slice(&self.result.to_le_bytes());
        bytes[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        bytes[10..12].copy_from_slice(&self.sqid.to_le_bytes());
        bytes[12..14].copy_from_slice(&self.cid.to_le_bytes());
        // Phase tag (bit 0) is reserved in Fabrics and sent as 0.
        bytes[14..16].copy_from_slice(&(self.status.raw() << 1).to_le_bytes());
        bytes
    }

    pub fn decode(bytes: &[u8; CQE_BYTES]) -> Self {
        Self {
            result: le_u64(&bytes[0..8]),
            sqhd: le_u16(&bytes[8..10]),
            sqid: le_u16(&bytes[10..12]),
            cid: le_u16(&bytes[12..14]),
            status: Status::from_raw(le_u16(&bytes[14..16]) >> 1),
        }
    }

    /// DW0 of the result.
    pub const fn dw0(&self) -> u32 {
        self.result as u32
    }
}

/// Why the data of a Connect command was refused: the byte offset of the bad field in the data
/// (what a Connect Invalid Parameters completion reports as IPO with IATTR = 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("invalid Connect data field at byte {offset}")]
pub struct ConnectDataError {
    pub offset: u16,
}

/// The 1024 bytes of data of a Connect command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectData {
    pub host_id: [u8; 16],
    pub cntlid: u16,
    pub subnqn: types::Nqn,
    pub hostnqn: types::Nqn,
}

impl ConnectData {
    pub const HOST_ID_OFFSET: u16 = 0;
    pub const CNTLID_OFFSET: u16 = 16;
    pub const SUBNQN_OFFSET: u16 = 256;
    pub const HOSTNQN_OFFSET: u16 = 512;
    const NQN_FIELD_BYTES: usize = 256;

    /// Appends the 1024-byte encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.resize(start + CONNECT_DATA_BYTES, 0);
        let data = &mut out[start..];
        data[0..16].copy_from_slice(&self.host_id);
        data[16..18].copy_from_slice(&self.cntlid.to_le_bytes());
        let subnqn = self.subnqn.as_str().as_bytes();
        data[256..256 + subnqn.len()].copy_from_slice(subnqn);
        let hostnqn = self.hostnqn.as_str().as_bytes();
        data[512..512 + hostnqn.len()].copy_from_slice(hostnqn);
    }

    /// Decodes and validates Connect data; `data` must be exactly 1024 bytes.
    pub fn decode(data: &[u8]) -> Result<Self, ConnectDataError> {
        if data.len() != CONNECT_DATA_BYTES {
            return Err(ConnectDataError { offset: 0 });
        }
        let mut host_id = [0u8; 16];
        host_id.copy_from_slice(&data[0..16]);
        let nqn = |offset: u16| -> Result<types::Nqn, ConnectDataError> {
            let start = usize::from(offset);
            let field = &data[start..start + Self::NQN_FIELD_BYTES];
            // NUL-terminated within the field; a field with no NUL is not a valid string.
            let length = field.iter().position(|b| *b == 0).ok_or(ConnectDataError { offset })?;
            let text =
                std::str::from_utf8(&field[..length]).map_err(|_| ConnectDataError { offset })?;
            types::Nqn::new(text).map_err(|_| ConnectDataError { offset })
        };
        Ok(Self {
            host_id,
            cntlid: le_u16(&data[16..18]),
            subnqn: nqn(Self::SUBNQN_OFFSET)?,
            hostnqn: nqn(Self::HOSTNQN_OFFSET)?,
        })
    }
}

/// The DW0 of a Connect Invalid Parameters completion: IPO in bits 15:0, IATTR in bits 23:16
/// (bit 16 set when the offset is into the Connect data rather than the SQE).
pub const fn connect_invalid_parameter_result(in_data: bool, offset: u16) -> u32 {
    (offset as u32) | if in_data { 1 << 16 } else { 0 }
}

pub(crate) fn le_u16(bytes: &[u8]) -> u16 {
    let mut raw = [0u8; 2];
    raw.copy_from_slice(&bytes[..2]);
    u16::from_le_bytes(raw)
}

pub(crate) fn le_u32(bytes: &[u8]) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&bytes[..4]);
    u32::from_le_bytes(raw)
}

pub(crate) fn le_u64(bytes: &[u8]) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_layout_matches_linux_values() {
        // Linux writes status as (SCT << 8 | SC), DNR = 0x4000.
        assert_eq!(Status::CONNECT_INVALID_PARAMETERS.raw(), 0x182);
        assert_eq!(Status::CONNECT_INVALID_HOST.raw(), 0x184);
        assert_eq!(Status::INVALID_QUEUE_TYPE.raw(), 0x185);
        assert_eq!(Status::LBA_OUT_OF_RANGE.raw(), 0x080);
        assert_eq!(Status::UNRECOVERED_READ_ERROR.raw(), 0x281);
        assert_eq!(Status::INVALID_LOG_PAGE.raw(), 0x109);
        assert_eq!(Status::TRANSIENT_TRANSPORT_ERROR.raw(), 0x022);
        assert_eq!(Status::ANA_INACCESSIBLE.raw(), 0x302);
        assert!(Status::ANA_TRANSITION.is_path_error());
        assert!(!Status::INVALID_FIELD.is_path_error());
        assert_eq!(Status::INVALID_FIELD.with_dnr().raw(), 0x4002);
        assert!(Status::INVALID_FIELD.with_dnr().do_not_retry());
        assert!(Status::INVALID_FIELD.with_dnr().same_code(Status::INVALID_FIELD));
        assert!(Status::SUCCESS.is_success());
        assert!(!Status::INVALID_OPCODE.is_success());
    }

    #[test]
    fn cqe_golden_bytes() {
        let cqe = Cqe {
            result: 0x0000_0000_0000_0007,
            sqhd: 3,
            sqid: 1,
            cid: 0xBEEF,
            status: Status::INVALID_FIELD.with_dnr(),
        };
        let bytes = cqe.encode();
        assert_eq!(bytes, [7, 0, 0, 0, 0, 0, 0, 0, 3, 0, 1, 0, 0xEF, 0xBE, 0x04, 0x80]);
        assert_eq!(Cqe::decode(&bytes), cqe);
    }

    #[test]
    fn sqe_fields_and_builders() {
        let sqe = Sqe::read(9, 1, 0x1_0000_0002, 8).with_sgl(SglDescriptor::transport(32768));
        let bytes = sqe.as_bytes();
        assert_eq!(bytes[0], io_opcode::READ);
        assert_eq!(bytes[1], 0x40, "PSDT 01b");
        assert_eq!(&bytes[2..4], &[9, 0]);
        assert_eq!(&bytes[4..8], &[1, 0, 0, 0]);
        assert_eq!(&bytes[40..44], &[2, 0, 0, 0]);
        assert_eq!(&bytes[44..48], &[1, 0, 0, 0]);
        assert_eq!(&bytes[48..52], &[7, 0, 0, 0]);
        assert_eq!(bytes[39], 0x5A);
        assert_eq!(&bytes[32..36], &32768u32.to_le_bytes());
        assert_eq!(sqe.slba(), 0x1_0000_0002);
        assert_eq!(sqe.block_count(), 8);
        assert_eq!(sqe.data_direction(), DataDirection::ControllerToHost);
        assert_eq!(Sqe::from_bytes(*bytes), sqe);

        let connect = Sqe::connect(1, 3, 127, 5000);
        assert_eq!(connect.opcode(), FABRICS_OPCODE);
        assert_eq!(connect.fctype(), fctype::CONNECT);
        assert_eq!(connect.connect_qid(), 3);
        assert_eq!(connect.connect_sqsize(), 127);
        assert_eq!(connect.connect_kato_ms(), 5000);
        assert_eq!(connect.connect_record_format(), 0);
        assert_eq!(connect.data_direction(), DataDirection::HostToController);

        let get = Sqe::property_get(2, property::CAP, PropertySize::Bytes8);
        assert_eq!(get.property_size(), Some(PropertySize::Bytes8));
        assert_eq!(get.property_offset(), 0);
        let set = Sqe::property_set(2, property::CC, PropertySize::Bytes4, 0x460001);
        assert_eq!(set.property_offset(), 0x14);
        assert_eq!(set.property_value(), 0x460001);

        let log = Sqe::get_log_page(4, NSID_ALL, log_page::DISCOVERY, 1 << 33, 0x40000 * 4 + 8);
        let numd = (log.cdw(10) >> 16) | ((log.cdw(11) & 0xFFFF) << 16);
        assert_eq!(numd + 1, 0x40002);
        assert_eq!(log.cdw(13), 2);
    }

    #[test]
    fn connect_data_round_trip_and_errors() {
        let data = ConnectData {
            host_id: [7; 16],
            cntlid: CNTLID_DYNAMIC,
            subnqn: types::Nqn::new("nqn.2024-01.io.ferrite:vol:a").unwrap(),
            hostnqn: types::Nqn::new("nqn.2014-08.org.nvmexpress:uuid:1").unwrap(),
        };
        let mut bytes = Vec::new();
        data.encode(&mut bytes);
        assert_eq!(bytes.len(), 1024);
        assert_eq!(&bytes[16..18], &[0xFF, 0xFF]);
        assert_eq!(ConnectData::decode(&bytes), Ok(data));

        let mut no_terminator = bytes.clone();
        no_terminator[256..512].fill(b'a');
        assert_eq!(ConnectData::decode(&no_terminator), Err(ConnectDataError { offset: 256 }));
        let mut bad_host = bytes.clone();
        bad_host[512..516].copy_from_slice(b"iqn.");
        assert_eq!(ConnectData::decode(&bad_host), Err(ConnectDataError { offset: 512 }));
        assert!(ConnectData::decode(&bytes[..1000]).is_err());
        assert_eq!(connect_invalid_parameter_result(true, 256), 0x1_0100);
    }

    #[test]
    fn dsm_range_round_trip() {
        let range = DsmRange { context_attributes: 0, blocks: 16, slba: 1 << 40 };
        assert_eq!(DsmRange::decode(&range.encode()), range);
    }
}
