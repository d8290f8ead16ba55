//! The NVMe/TCP PDU codec (NVMe/TCP transport specification 1.0): every PDU type, the common
//! header, header and data digests (CRC32C), PDU data alignment padding, and an incremental
//! decoder that both the target and the host use.
//!
//! Hot path. Decoding borrows the input: a decoded PDU is a small header struct plus a slice of
//! the caller's bytes for its data, so nothing is allocated or copied. Encoders append to a
//! caller-provided `Vec<u8>` and allocate nothing else.
//!
//! Layout of every PDU:
//!
//! ```text
//! 0      1      2      3      4             8                hlen      +4
//! +------+------+------+------+-------------+--- ... ---------+---------+-----+---- ... ---+-------+
//! | type | flags| hlen | pdo  | plen (LE)   | type specific   | HDGST?  | PAD | DATA       |DDGST? |
//! +------+------+------+------+-------------+--- ... ---------+---------+-----+---- ... ---+-------+
//! ```
//!
//! `pdo` is the offset of DATA from the start of the PDU, `plen` the length of the whole PDU. The
//! header digest covers bytes `0..hlen`; the data digest covers DATA only.
//!
//! The decoder validates everything the transport specification defines before a byte of data is
//! trusted: the type and its direction, HLEN, PLEN against the type and a maximum PDU size, PDO
//! against the header, alignment and PLEN, the digest flags against what was negotiated, and both
//! digests. A violation is a [`PduError`] that names the fatal error status (FES) and field offset
//! a termination request must carry. A data digest mismatch is not fatal in NVMe/TCP: it comes
//! back as [`Decoded::DataDigestMismatch`] with the header, so the receiver fails just the command.

use crate::command::{le_u16, le_u32, Cqe, Sqe, CQE_BYTES, SQE_BYTES};

/// Size of the common header.
pub const COMMON_HEADER_BYTES: usize = 8;
/// Size of a header or data digest.
pub const DIGEST_BYTES: usize = 4;
/// HLEN and PLEN of ICReq and ICResp.
pub const IC_PDU_BYTES: usize = 128;
/// HLEN of H2CTermReq and C2HTermReq.
pub const TERM_REQ_HEADER_BYTES: usize = 24;
/// The most bytes of the offending PDU header a termination request carries (PLEN <= 152).
pub const TERM_REQ_DATA_BYTES_MAX: usize = 128;
/// HLEN of CapsuleCmd: common header plus the SQE.
pub const CAPSULE_CMD_HEADER_BYTES: usize = COMMON_HEADER_BYTES + SQE_BYTES;
/// HLEN of CapsuleResp: common header plus the CQE.
pub const CAPSULE_RESP_HEADER_BYTES: usize = COMMON_HEADER_BYTES + CQE_BYTES;
/// HLEN of H2CData and C2HData.
pub const DATA_PDU_HEADER_BYTES: usize = 24;
/// HLEN of R2T.
pub const R2T_HEADER_BYTES: usize = 24;
/// Largest PDU header with its digest and the largest padding: a bound for buffer sizing.
pub const PDU_HEADER_BYTES_MAX: usize = IC_PDU_BYTES + DIGEST_BYTES + 4 * (PDA_MAX as usize + 1);
/// PDU format version 1.0, the only one defined.
pub const PFV_1_0: u16 = 0;
/// Largest HPDA or CPDA value (0's based dwords).
pub const PDA_MAX: u8 = 31;
/// Smallest MAXH2CDATA a controller may announce.
pub const MAXH2CDATA_MIN: u32 = 4096;

const _: () = assert!(CAPSULE_CMD_HEADER_BYTES == 72);
const _: () = assert!(CAPSULE_RESP_HEADER_BYTES == 24);
const _: () = assert!(TERM_REQ_HEADER_BYTES + TERM_REQ_DATA_BYTES_MAX == 152);

/// PDU flag bits (common header byte 1).
pub mod flags {
    /// HDGSTF: a header digest follows the header.
    pub const HEADER_DIGEST: u8 = 1 << 0;
    /// DDGSTF: a data digest follows the data.
    pub const DATA_DIGEST: u8 = 1 << 1;
    /// LAST_PDU (H2CData, C2HData): the last data PDU of an R2T or of a command's C2H data.
    pub const LAST_PDU: u8 = 1 << 2;
    /// SUCCESS (C2HData): the command completed successfully and no CapsuleResp follows.
    pub const SUCCESS: u8 = 1 << 3;
}

/// ICReq/ICResp DGST byte bits.
const DGST_HEADER: u8 = 1 << 0;
const DGST_DATA: u8 = 1 << 1;

/// PDU types (common header byte 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PduType {
    ICReq = 0x00,
    ICResp = 0x01,
    H2CTermReq = 0x02,
    C2HTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2CData = 0x06,
    C2HData = 0x07,
    R2T = 0x09,
}

impl PduType {
    pub const fn from_u8(value: u8) -> Option<PduType> {
        Some(match value {
            0x00 => PduType::ICReq,
            0x01 => PduType::ICResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            _ => return None,
        })
    }

    /// The fixed HLEN of this type.
    pub const fn header_bytes(self) -> usize {
        match self {
            PduType::ICReq | PduType::ICResp => IC_PDU_BYTES,
            PduType::H2CTermReq | PduType::C2HTermReq => TERM_REQ_HEADER_BYTES,
            PduType::CapsuleCmd => CAPSULE_CMD_HEADER_BYTES,
            PduType::CapsuleResp => CAPSULE_RESP_HEADER_BYTES,
            PduType::H2CData | PduType::C2HData => DATA_PDU_HEADER_BYTES,
            PduType::R2T => R2T_HEADER_BYTES,
        }
    }

    /// Who sends this type.
    pub const fn sender(self) -> Role {
        match self {
            PduType::ICReq | PduType::H2CTermReq | PduType::CapsuleCmd | PduType::H2CData => {
                Role::Host
            }
            _ => Role::Controller,
        }
    }

    /// Whether digests apply: all but the connection set-up and termination PDUs.
    pub const fn has_digests(self) -> bool {
        !matches!(
            self,
            PduType::ICReq | PduType::ICResp | PduType::H2CTermReq | PduType::C2HTermReq
        )
    }

    /// Whether the type may carry data after its header (termination requests carry the
    /// offending header, which is handled apart).
    pub const fn may_carry_data(self) -> bool {
        matches!(self, PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData)
    }
}

/// The two ends of an NVMe/TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Host,
    Controller,
}

/// The parameters negotiated by ICReq/ICResp that decide how PDUs are framed, as seen by one end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Framing {
    /// The end that uses this framing: it decodes PDUs its peer sends and encodes its own.
    pub role: Role,
    pub header_digest: bool,
    pub data_digest: bool,
    /// The PDU data alignment this end asked for (0's based dwords): HPDA for a host, CPDA for a
    /// controller. Data in received PDUs must start at a multiple of it.
    pub receive_pda: u8,
    /// The PDU data alignment the peer asked for: data in PDUs this end sends is padded to it.
    pub send_pda: u8,
    /// The largest PDU (PLEN) this end accepts.
    pub pdu_size_max: u32,
}

impl Framing {
    /// Framing before ICReq/ICResp: no digests, dword alignment.
    pub const fn new(role: Role, pdu_size_max: u32) -> Self {
        assert!(pdu_size_max as usize >= IC_PDU_BYTES);
        Self {
            role,
            header_digest: false,
            data_digest: false,
            receive_pda: 0,
            send_pda: 0,
            pdu_size_max,
        }
    }

    const fn header_digest_bytes(&self) -> usize {
        if self.header_digest {
            DIGEST_BYTES
        } else {
            0
        }
    }

    const fn data_digest_bytes(&self) -> usize {
        if self.data_digest {
            DIGEST_BYTES
        } else {
            0
        }
    }
}

/// Rounds `offset` up to the alignment `(pda + 1) * 4`.
const fn align_data_offset(offset: usize, pda: u8) -> usize {
    let alignment = (pda as usize + 1) * 4;
    offset.div_ceil(alignment) * alignment
}

/// Fatal error status values of H2CTermReq and C2HTermReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum FatalErrorStatus {
    InvalidHeaderField = 0x01,
    PduSequenceError = 0x02,
    HeaderDigestError = 0x03,
    DataTransferOutOfRange = 0x04,
    /// Named "R2T Limit Exceeded" in the first transport specification and "Data Transfer Limit
    /// Exceeded" since; the value is the same.
    DataTransferLimitExceeded = 0x05,
    UnsupportedParameter = 0x06,
}

/// A fatal transport error: the connection must be terminated with a termination request that
/// carries [`PduError::fatal_error_status`] and [`PduError::fatal_error_information`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PduError {
    #[error("invalid PDU header field at byte {offset}: {reason}")]
    InvalidHeaderField { offset: u32, reason: &'static str },
    #[error("PDU sequence error: {reason}")]
    SequenceError { reason: &'static str },
    #[error(
        "header digest mismatch: PDU carries {received:#010x}, header hashes to {computed:#010x}"
    )]
    HeaderDigest { received: u32, computed: u32 },
    #[error("data transfer out of range: {reason}")]
    DataOutOfRange { reason: &'static str },
    #[error("data transfer limit exceeded: {reason}")]
    DataLimitExceeded { reason: &'static str },
    #[error("unsupported parameter at byte {offset}: {reason}")]
    UnsupportedParameter { offset: u32, reason: &'static str },
}

impl PduError {
    pub const fn fatal_error_status(&self) -> FatalErrorStatus {
        match self {
            PduError::InvalidHeaderField { .. } => FatalErrorStatus::InvalidHeaderField,
            PduError::SequenceError { .. } => FatalErrorStatus::PduSequenceError,
            PduError::HeaderDigest { .. } => FatalErrorStatus::HeaderDigestError,
            PduError::DataOutOfRange { .. } => FatalErrorStatus::DataTransferOutOfRange,
            PduError::DataLimitExceeded { .. } => FatalErrorStatus::DataTransferLimitExceeded,
            PduError::UnsupportedParameter { .. } => FatalErrorStatus::UnsupportedParameter,
        }
    }

    /// FEI: the byte offset of the bad field for the two statuses that define one, else 0.
    pub const fn fatal_error_information(&self) -> u32 {
        match self {
            PduError::InvalidHeaderField { offset, .. }
            | PduError::UnsupportedParameter { offset, .. } => *offset,
            _ => 0,
        }
    }
}

const fn invalid(offset: u32, reason: &'static str) -> PduError {
    PduError::InvalidHeaderField { offset, reason }
}

/// Field offsets used in FEI values.
mod offset {
    pub const TYPE: u32 = 0;
    pub const FLAGS: u32 = 1;
    pub const HLEN: u32 = 2;
    pub const PDO: u32 = 3;
    pub const PLEN: u32 = 4;
    pub const IC_PDA: u32 = 10;
    pub const ICRESP_MAXH2CDATA: u32 = 12;
    pub const DATA_DATAL: u32 = 16;
    pub const R2T_R2TL: u32 = 16;
}

/// Initialize Connection Request, sent by the host first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ICReq {
    pub pfv: u16,
    /// Host PDU data alignment (0's based dwords) for data the controller sends.
    pub hpda: u8,
    pub header_digest: bool,
    pub data_digest: bool,
    /// Most R2Ts the host accepts outstanding per command, 0's based.
    pub maxr2t: u32,
}

/// Initialize Connection Response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ICResp {
    pub pfv: u16,
    /// Controller PDU data alignment (0's based dwords) for data the host sends.
    pub cpda: u8,
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data in one H2CData PDU, in bytes.
    pub maxh2cdata: u32,
}

/// H2CTermReq or C2HTermReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermReq<'a> {
    /// FES as received; [`FatalErrorStatus`] names the defined values.
    pub fes: u16,
    pub fei: u32,
    /// The header of the PDU in error, as much as was sent.
    pub pdu_header: &'a [u8],
}

/// CapsuleCmd: an SQE and its in-capsule data (possibly empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsuleCmd<'a> {
    pub sqe: Sqe,
    pub data: &'a [u8],
}

/// The header fields of H2CData and C2HData. `ttag` is 0 in C2HData (reserved there);
/// `success` is always false in H2CData.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DataHeader {
    pub cccid: u16,
    pub ttag: u16,
    pub datao: u32,
    pub datal: u32,
    pub last: bool,
    pub success: bool,
}

/// Ready to Transfer: the controller asks for `r2tl` bytes at `r2to` of a command's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2T {
    pub cccid: u16,
    pub ttag: u16,
    pub r2to: u32,
    pub r2tl: u32,
}

/// A decoded PDU, borrowing its data from the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdu<'a> {
    ICReq(ICReq),
    ICResp(ICResp),
    H2CTermReq(TermReq<'a>),
    C2HTermReq(TermReq<'a>),
    CapsuleCmd(CapsuleCmd<'a>),
    CapsuleResp(Cqe),
    H2CData(DataHeader, &'a [u8]),
    C2HData(DataHeader, &'a [u8]),
    R2T(R2T),
}

impl Pdu<'_> {
    pub const fn pdu_type(&self) -> PduType {
        match self {
            Pdu::ICReq(_) => PduType::ICReq,
            Pdu::ICResp(_) => PduType::ICResp,
            Pdu::H2CTermReq(_) => PduType::H2CTermReq,
            Pdu::C2HTermReq(_) => PduType::C2HTermReq,
            Pdu::CapsuleCmd(_) => PduType::CapsuleCmd,
            Pdu::CapsuleResp(_) => PduType::CapsuleResp,
            Pdu::H2CData(..) => PduType::H2CData,
            Pdu::C2HData(..) => PduType::C2HData,
            Pdu::R2T(_) => PduType::R2T,
        }
    }
}

/// What [`decode`] found at the start of the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// The input holds less than one PDU; at least `needed_bytes` (counted from the start of the
    /// input) are needed before decoding can go on. Never more than the framing's `pdu_size_max`.
    Incomplete { needed_bytes: usize },
    /// A whole, valid PDU occupying the first `consumed_bytes` of the input.
    Pdu { pdu: Pdu<'a>, consumed_bytes: usize },
    /// A whole PDU whose header is valid but whose data does not match its data digest. The
    /// data in `pdu` must not be used; the receiver fails the command it belongs to (the
    /// controller with Transient Transport Error) and the connection goes on.
    DataDigestMismatch { pdu: Pdu<'a>, consumed_bytes: usize, received: u32, computed: u32 },
}

/// Decodes the PDU at the start of `input`, as the end described by `framing` receives it.
pub fn decode<'a>(input: &'a [u8], framing: &Framing) -> Result<Decoded<'a>, PduError> {
    if input.len() < COMMON_HEADER_BYTES {
        return Ok(Decoded::Incomplete { needed_bytes: COMMON_HEADER_BYTES });
    }
    let pdu_type = PduType::from_u8(input[0]).ok_or(invalid(offset::TYPE, "unknown PDU type"))?;
    if pdu_type.sender() == framing.role {
        return Err(invalid(offset::TYPE, "PDU type is not sent in this direction"));
    }
    let pdu_flags = input[1];
    let hlen = usize::from(input[2]);
    let pdo = usize::from(input[3]);
    let plen = le_u32(&input[4..8]) as usize;
    if hlen != pdu_type.header_bytes() {
        return Err(invalid(offset::HLEN, "HLEN does not match the PDU type"));
    }

    let header_digest = if pdu_type.has_digests() {
        let flagged = pdu_flags & flags::HEADER_DIGEST != 0;
        if flagged != framing.header_digest {
            return Err(invalid(
                offset::FLAGS,
                "HDGSTF does not match the negotiated header digest",
            ));
        }
        flagged
    } else {
        false
    };
    let header_end = hlen + if header_digest { DIGEST_BYTES } else { 0 };
    if plen < header_end {
        return Err(invalid(offset::PLEN, "PLEN is shorter than the header"));
    }
    if plen > framing.pdu_size_max as usize {
        return Err(if pdu_type == PduType::H2CData {
            PduError::DataLimitExceeded { reason: "H2CData PDU larger than the maximum PDU size" }
        } else {
            invalid(offset::PLEN, "PLEN exceeds the maximum PDU size")
        });
    }

    // Where the data lies, if any, from PLEN, PDO and the flags alone.
    let mut data_range = 0..0;
    let mut data_digest = false;
    match pdu_type {
        PduType::ICReq | PduType::ICResp => {
            if plen != IC_PDU_BYTES {
                return Err(invalid(offset::PLEN, "PLEN of an ICReq/ICResp must be 128"));
            }
        }
        PduType::H2CTermReq | PduType::C2HTermReq => {
            if plen > TERM_REQ_HEADER_BYTES + TERM_REQ_DATA_BYTES_MAX {
                return Err(invalid(offset::PLEN, "termination request longer than 152 bytes"));
            }
            data_range = hlen..plen;
        }
        PduType::CapsuleResp | PduType::R2T => {
            if pdu_flags & flags::DATA_DIGEST != 0 {
                return Err(invalid(offset::FLAGS, "DDGSTF set on a PDU without data"));
            }
            if plen != header_end {
                return Err(invalid(offset::PLEN, "PLEN does not match a PDU without data"));
            }
        }
        PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData => {
            if plen == header_end {
                if pdu_type != PduType::CapsuleCmd {
                    return Err(invalid(offset::PLEN, "data PDU without data"));
                }
                if pdu_flags & flags::DATA_DIGEST != 0 {
                    return Err(invalid(offset::FLAGS, "DDGSTF set on a PDU without data"));
                }
            } else {
                data_digest = pdu_flags & flags::DATA_DIGEST != 0;
                if data_digest != framing.data_digest {
                    return Err(invalid(
                        offset::FLAGS,
                        "DDGSTF does not match the negotiated data digest",
                    ));
                }
                let data_end = plen - if data_digest { DIGEST_BYTES } else { 0 };
                if pdo < header_end {
                    return Err(invalid(offset::PDO, "PDO points into the header"));
                }
                if pdo != align_data_offset(pdo, framing.receive_pda) {
                    return Err(invalid(offset::PDO, "PDO is not aligned as negotiated"));
                }
                if pdo >= data_end {
                    return Err(invalid(
                        offset::PDO,
                        "PDO leaves no data before the end of the PDU",
                    ));
                }
                data_range = pdo..data_end;
            }
        }
    }

    if input.len() < header_end {
        return Ok(Decoded::Incomplete { needed_bytes: plen });
    }
    if header_digest {
        let received = le_u32(&input[hlen..hlen + DIGEST_BYTES]);
        let computed = crc32c::crc32c(&input[..hlen]);
        if received != computed {
            return Err(PduError::HeaderDigest { received, computed });
        }
    }
    let header = &input[..hlen];
    let data_length = data_range.len();

    // Type-specific header fields, validated before the data is awaited.
    enum Fields {
        ICReq(ICReq),
        ICResp(ICResp),
        TermReq { fes: u16, fei: u32 },
        Capsule(Sqe),
        Response(Cqe),
        Data(DataHeader),
        R2T(R2T),
    }
    let fields = match pdu_type {
        PduType::ICReq => {
            let hpda = header[10];
            if hpda > PDA_MAX {
                return Err(invalid(offset::IC_PDA, "HPDA above 31"));
            }
            Fields::ICReq(ICReq {
                pfv: le_u16(&header[8..10]),
                hpda,
                header_digest: header[11] & DGST_HEADER != 0,
                data_digest: header[11] & DGST_DATA != 0,
                maxr2t: le_u32(&header[12..16]),
            })
        }
        PduType::ICResp => {
            let cpda = header[10];
            if cpda > PDA_MAX {
                return Err(invalid(offset::IC_PDA, "CPDA above 31"));
            }
            let maxh2cdata = le_u32(&header[12..16]);
            if maxh2cdata < MAXH2CDATA_MIN || maxh2cdata % 4 != 0 {
                return Err(invalid(
                    offset::ICRESP_MAXH2CDATA,
                    "MAXH2CDATA below 4096 or unaligned",
                ));
            }
            Fields::ICResp(ICResp {
                pfv: le_u16(&header[8..10]),
                cpda,
                header_digest: header[11] & DGST_HEADER != 0,
                data_digest: header[11] & DGST_DATA != 0,
                maxh2cdata,
            })
        }
        PduType::H2CTermReq | PduType::C2HTermReq => {
            Fields::TermReq { fes: le_u16(&header[8..10]), fei: le_u32(&header[10..14]) }
        }
        PduType::CapsuleCmd => {
            let mut sqe = [0u8; SQE_BYTES];
            sqe.copy_from_slice(&header[COMMON_HEADER_BYTES..]);
            Fields::Capsule(Sqe::from_bytes(sqe))
        }
        PduType::CapsuleResp => {
            let mut cqe = [0u8; CQE_BYTES];
            cqe.copy_from_slice(&header[COMMON_HEADER_BYTES..]);
            Fields::Response(Cqe::decode(&cqe))
        }
        PduType::H2CData | PduType::C2HData => {
            let data_header = DataHeader {
                cccid: le_u16(&header[8..10]),
                ttag: if pdu_type == PduType::H2CData { le_u16(&header[10..12]) } else { 0 },
                datao: le_u32(&header[12..16]),
                datal: le_u32(&header[16..20]),
                last: pdu_flags & flags::LAST_PDU != 0,
                success: pdu_type == PduType::C2HData && pdu_flags & flags::SUCCESS != 0,
            };
            if data_header.datal as usize != data_length {
                return Err(invalid(offset::DATA_DATAL, "DATAL does not match the PDU's data"));
            }
            if data_header.datao.checked_add(data_header.datal).is_none() {
                return Err(PduError::DataOutOfRange { reason: "DATAO + DATAL overflows" });
            }
            if data_header.success && !data_header.last {
                return Err(invalid(offset::FLAGS, "SUCCESS set without LAST_PDU"));
            }
            Fields::Data(data_header)
        }
        PduType::R2T => {
            let r2t = R2T {
                cccid: le_u16(&header[8..10]),
                ttag: le_u16(&header[10..12]),
                r2to: le_u32(&header[12..16]),
                r2tl: le_u32(&header[16..20]),
            };
            if r2t.r2tl == 0 {
                return Err(invalid(offset::R2T_R2TL, "R2TL is zero"));
            }
            if r2t.r2to.checked_add(r2t.r2tl).is_none() {
                return Err(PduError::DataOutOfRange { reason: "R2TO + R2TL overflows" });
            }
            Fields::R2T(r2t)
        }
    };

    if input.len() < plen {
        return Ok(Decoded::Incomplete { needed_bytes: plen });
    }
    let data = &input[data_range.clone()];
    let pdu = match fields {
        Fields::ICReq(icreq) => Pdu::ICReq(icreq),
        Fields::ICResp(icresp) => Pdu::ICResp(icresp),
        Fields::TermReq { fes, fei } => {
            let term = TermReq { fes, fei, pdu_header: data };
            if pdu_type == PduType::H2CTermReq {
                Pdu::H2CTermReq(term)
            } else {
                Pdu::C2HTermReq(term)
            }
        }
        Fields::Capsule(sqe) => Pdu::CapsuleCmd(CapsuleCmd { sqe, data }),
        Fields::Response(cqe) => Pdu::CapsuleResp(cqe),
        Fields::Data(header) => {
            if pdu_type == PduType::H2CData {
                Pdu::H2CData(header, data)
            } else {
                Pdu::C2HData(header, data)
            }
        }
        Fields::R2T(r2t) => Pdu::R2T(r2t),
    };
    if data_digest {
        let received = le_u32(&input[data_range.end..data_range.end + DIGEST_BYTES]);
        let computed = crc32c::crc32c(data);
        if received != computed {
            return Ok(Decoded::DataDigestMismatch {
                pdu,
                consumed_bytes: plen,
                received,
                computed,
            });
        }
    }
    Ok(Decoded::Pdu { pdu, consumed_bytes: plen })
}

// ---------------------------------------------------------------------------------------------
// Encoders. Each appends one whole PDU to `out`.

fn push_common_header(
    out: &mut Vec<u8>,
    pdu_type: PduType,
    pdu_flags: u8,
    pdo: usize,
    plen: usize,
) {
    let plen = u32::try_from(plen).expect("PDU length fits in PLEN");
    let pdo = u8::try_from(pdo).expect("PDU data offset fits in PDO");
    out.extend_from_slice(&[pdu_type as u8, pdu_flags, pdu_type.header_bytes() as u8, pdo]);
    out.extend_from_slice(&plen.to_le_bytes());
}

/// Appends the header digest of the header that starts at `header_start` and ends at the end of
/// `out`.
fn push_header_digest(out: &mut Vec<u8>, header_start: usize) {
    let digest = crc32c::crc32c(&out[header_start..]);
    out.extend_from_slice(&digest.to_le_bytes());
}

fn assert_sender(framing: &Framing, pdu_type: PduType) {
    assert_eq!(framing.role, pdu_type.sender(), "{pdu_type:?} is not sent by a {:?}", framing.role);
}

pub fn encode_ic_req(out: &mut Vec<u8>, icreq: &ICReq) {
    assert!(icreq.hpda <= PDA_MAX, "HPDA {} above 31", icreq.hpda);
    let start = out.len();
    push_common_header(out, PduType::ICReq, 0, 0, IC_PDU_BYTES);
    out.extend_from_slice(&icreq.pfv.to_le_bytes());
    out.push(icreq.hpda);
    out.push(dgst_byte(icreq.header_digest, icreq.data_digest));
    out.extend_from_slice(&icreq.maxr2t.to_le_bytes());
    out.resize(start + IC_PDU_BYTES, 0);
}

pub fn encode_ic_resp(out: &mut Vec<u8>, icresp: &ICResp) {
    assert!(icresp.cpda <= PDA_MAX, "CPDA {} above 31", icresp.cpda);
    let start = out.len();
    push_common_header(out, PduType::ICResp, 0, 0, IC_PDU_BYTES);
    out.extend_from_slice(&icresp.pfv.to_le_bytes());
    out.push(icresp.cpda);
    out.push(dgst_byte(icresp.header_digest, icresp.data_digest));
    out.extend_from_slice(&icresp.maxh2cdata.to_le_bytes());
    out.resize(start + IC_PDU_BYTES, 0);
}

const fn dgst_byte(header_digest: bool, data_digest: bool) -> u8 {
    (if header_digest { DGST_HEADER } else { 0 }) | (if data_digest { DGST_DATA } else { 0 })
}

/// Appends an H2CTermReq (`role` Host) or C2HTermReq (`role` Controller) carrying as much of
/// `pdu_header`, the header of the PDU in error, as fits (128 bytes).
pub fn encode_term_req(
    out: &mut Vec<u8>,
    role: Role,
    fes: FatalErrorStatus,
    fei: u32,
    pdu_header: &[u8],
) {
    let pdu_type = match role {
        Role::Host => PduType::H2CTermReq,
        Role::Controller => PduType::C2HTermReq,
    };
    let copied = &pdu_header[..pdu_header.len().min(TERM_REQ_DATA_BYTES_MAX)];
    let start = out.len();
    push_common_header(out, pdu_type, 0, 0, TERM_REQ_HEADER_BYTES + copied.len());
    out.extend_from_slice(&(fes as u16).to_le_bytes());
    out.extend_from_slice(&fei.to_le_bytes());
    out.resize(start + TERM_REQ_HEADER_BYTES, 0);
    out.extend_from_slice(copied);
}

/// Appends a termination request for `error`.
pub fn encode_term_req_for(out: &mut Vec<u8>, role: Role, error: &PduError, pdu_header: &[u8]) {
    encode_term_req(
        out,
        role,
        error.fatal_error_status(),
        error.fatal_error_information(),
        pdu_header,
    );
}

/// The offset of data and the PLEN of a PDU with `data_length` bytes of data (0: none).
fn data_layout(framing: &Framing, pdu_type: PduType, data_length: usize) -> (usize, usize) {
    let header_end = pdu_type.header_bytes() + framing.header_digest_bytes();
    if data_length == 0 {
        return (0, header_end);
    }
    let pdo = align_data_offset(header_end, framing.send_pda);
    (pdo, pdo + data_length + framing.data_digest_bytes())
}

fn header_flags(framing: &Framing, data_length: usize) -> u8 {
    let mut pdu_flags = 0;
    if framing.header_digest {
        pdu_flags |= flags::HEADER_DIGEST;
    }
    if framing.data_digest && data_length > 0 {
        pdu_flags |= flags::DATA_DIGEST;
    }
    pdu_flags
}

/// Pads from the end of the header to PDO; `header_start` is where this PDU began in `out`.
fn push_padding(out: &mut Vec<u8>, header_start: usize, pdo: usize) {
    if pdo > 0 {
        out.resize(header_start + pdo, 0);
    }
}

/// Appends the data digest of `data` if the framing has data digests.
pub fn push_data_digest(out: &mut Vec<u8>, framing: &Framing, data: &[u8]) {
    if framing.data_digest && !data.is_empty() {
        out.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    }
}

/// Appends a CapsuleCmd with `data` as in-capsule data (empty: none).
pub fn encode_capsule_cmd(out: &mut Vec<u8>, framing: &Framing, sqe: &Sqe, data: &[u8]) {
    assert_sender(framing, PduType::CapsuleCmd);
    let (pdo, plen) = data_layout(framing, PduType::CapsuleCmd, data.len());
    let start = out.len();
    push_common_header(out, PduType::CapsuleCmd, header_flags(framing, data.len()), pdo, plen);
    out.extend_from_slice(sqe.as_bytes());
    if framing.header_digest {
        push_header_digest(out, start);
    }
    if !data.is_empty() {
        push_padding(out, start, pdo);
        out.extend_from_slice(data);
        push_data_digest(out, framing, data);
    }
    debug_assert_eq!(out.len() - start, plen);
}

/// Appends a CapsuleResp.
pub fn encode_capsule_resp(out: &mut Vec<u8>, framing: &Framing, cqe: &Cqe) {
    assert_sender(framing, PduType::CapsuleResp);
    let start = out.len();
    let (_, plen) = data_layout(framing, PduType::CapsuleResp, 0);
    push_common_header(out, PduType::CapsuleResp, header_flags(framing, 0), 0, plen);
    out.extend_from_slice(&cqe.encode());
    if framing.header_digest {
        push_header_digest(out, start);
    }
}

/// Appends the header (and padding) of an H2CData (host) or C2HData (controller) PDU for
/// `header.datal` bytes of data. The caller then appends exactly that data and calls
/// [`push_data_digest`]; this split lets a sender hand the data to the kernel without copying.
pub fn encode_data_pdu_header(out: &mut Vec<u8>, framing: &Framing, header: &DataHeader) {
    let pdu_type = match framing.role {
        Role::Host => PduType::H2CData,
        Role::Controller => PduType::C2HData,
    };
    let data_length = header.datal as usize;
    assert!(data_length > 0, "a data PDU carries data");
    let (pdo, plen) = data_layout(framing, pdu_type, data_length);
    let mut pdu_flags = header_flags(framing, data_length);
    if header.last {
        pdu_flags |= flags::LAST_PDU;
    }
    if header.success {
        assert!(pdu_type == PduType::C2HData && header.last, "SUCCESS only on the last C2HData");
        pdu_flags |= flags::SUCCESS;
    }
    let start = out.len();
    push_common_header(out, pdu_type, pdu_flags, pdo, plen);
    out.extend_from_slice(&header.cccid.to_le_bytes());
    let ttag = if pdu_type == PduType::H2CData { header.ttag } else { 0 };
    out.extend_from_slice(&ttag.to_le_bytes());
    out.extend_from_slice(&header.datao.to_le_bytes());
    out.extend_from_slice(&header.datal.to_le_bytes());
    out.resize(start + DATA_PDU_HEADER_BYTES, 0);
    if framing.header_digest {
        push_header_digest(out, start);
    }
    push_padding(out, start, pdo);
}

/// Appends a whole H2CData (host) or C2HData (controller) PDU; `header.datal` must equal
/// `data.len()`.
pub fn encode_data_pdu(out: &mut Vec<u8>, framing: &Framing, header: &DataHeader, data: &[u8]) {
    assert_eq!(header.datal as usize, data.len(), "DATAL must match the data");
    encode_data_pdu_header(out, framing, header);
    out.extend_from_slice(data);
    push_data_digest(out, framing, data);
}

/// Appends an R2T.
pub fn encode_r2t(out: &mut Vec<u8>, framing: &Framing, r2t: &R2T) {
    assert_sender(framing, PduType::R2T);
    assert!(r2t.r2tl > 0, "an R2T asks for data");
    let start = out.len();
    let (_, plen) = data_layout(framing, PduType::R2T, 0);
    push_common_header(out, PduType::R2T, header_flags(framing, 0), 0, plen);
    out.extend_from_slice(&r2t.cccid.to_le_bytes());
    out.extend_from_slice(&r2t.ttag.to_le_bytes());
    out.extend_from_slice(&r2t.r2to.to_le_bytes());
    out.extend_from_slice(&r2t.r2tl.to_le_bytes());
    out.resize(start + R2T_HEADER_BYTES, 0);
    if framing.header_digest {
        push_header_digest(out, start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{SglDescriptor, Status};
    use proptest::prelude::*;

    const SIZE_MAX: u32 = 256 * 1024;

    fn pair(header_digest: bool, data_digest: bool, hpda: u8, cpda: u8) -> (Framing, Framing) {
        let host = Framing {
            role: Role::Host,
            header_digest,
            data_digest,
            receive_pda: hpda,
            send_pda: cpda,
            pdu_size_max: SIZE_MAX,
        };
        let controller = Framing {
            role: Role::Controller,
            header_digest,
            data_digest,
            receive_pda: cpda,
            send_pda: hpda,
            pdu_size_max: SIZE_MAX,
        };
        (host, controller)
    }

    fn decode_one<'a>(bytes: &'a [u8], framing: &Framing) -> Pdu<'a> {
        match decode(bytes, framing) {
            Ok(Decoded::Pdu { pdu, consumed_bytes }) => {
                assert_eq!(consumed_bytes, bytes.len());
                pdu
            }
            other => panic!("expected a PDU, got {other:?}"),
        }
    }

    /// Every strict prefix decodes as Incomplete, never as a PDU or a panic.
    fn check_prefixes(bytes: &[u8], framing: &Framing) {
        for length in 0..bytes.len() {
            match decode(&bytes[..length], framing) {
                Ok(Decoded::Incomplete { needed_bytes }) => {
                    assert!(needed_bytes > length && needed_bytes <= bytes.len())
                }
                other => panic!("prefix of {length} bytes gave {other:?}"),
            }
        }
    }

    #[test]
    fn crc32c_is_castagnoli() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn icreq_golden_bytes() {
        let mut out = Vec::new();
        let icreq = ICReq { pfv: 0, hpda: 0, header_digest: true, data_digest: false, maxr2t: 0 };
        encode_ic_req(&mut out, &icreq);
        let mut expected = vec![0u8; 128];
        expected[..8].copy_from_slice(&[0x00, 0x00, 128, 0, 128, 0, 0, 0]);
        expected[11] = 0x01;
        assert_eq!(out, expected);
        let (_, controller) = pair(false, false, 0, 0);
        assert_eq!(decode_one(&out, &controller), Pdu::ICReq(icreq));
        check_prefixes(&out, &controller);
    }

    #[test]
    fn icresp_golden_bytes() {
        let mut out = Vec::new();
        let icresp =
            ICResp { pfv: 0, cpda: 0, header_digest: false, data_digest: true, maxh2cdata: 131072 };
        encode_ic_resp(&mut out, &icresp);
        assert_eq!(&out[..16], &[1, 0, 128, 0, 128, 0, 0, 0, 0, 0, 0, 0x02, 0, 0, 2, 0]);
        assert_eq!(out.len(), 128);
        let (host, _) = pair(false, false, 0, 0);
        assert_eq!(decode_one(&out, &host), Pdu::ICResp(icresp));
    }

    #[test]
    fn capsule_cmd_golden_bytes_with_digests() {
        let (host, controller) = pair(true, true, 0, 0);
        let sqe = Sqe::write(5, 1, 0, 1).with_sgl(SglDescriptor::in_capsule(0, 8));
        let data = [0xAAu8; 8];
        let mut out = Vec::new();
        encode_capsule_cmd(&mut out, &host, &sqe, &data);
        // type 4, flags HDGSTF|DDGSTF, hlen 72, pdo 76, plen 72 + 4 + 8 + 4 = 88.
        assert_eq!(&out[..8], &[4, 0x03, 72, 76, 88, 0, 0, 0]);
        assert_eq!(&out[8..72], sqe.as_bytes());
        assert_eq!(&out[72..76], &crc32c::crc32c(&out[..72]).to_le_bytes());
        assert_eq!(&out[76..84], &data);
        assert_eq!(&out[84..88], &crc32c::crc32c(&data).to_le_bytes());
        assert_eq!(decode_one(&out, &controller), Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &data }));
        check_prefixes(&out, &controller);
    }

    #[test]
    fn capsule_cmd_without_data_has_pdo_zero() {
        let (host, controller) = pair(false, true, 0, 0);
        let sqe = Sqe::flush(1, 1);
        let mut out = Vec::new();
        encode_capsule_cmd(&mut out, &host, &sqe, &[]);
        assert_eq!(&out[..8], &[4, 0, 72, 0, 72, 0, 0, 0]);
        assert_eq!(decode_one(&out, &controller), Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &[] }));
    }

    #[test]
    fn capsule_resp_round_trip() {
        for header_digest in [false, true] {
            let (host, controller) = pair(header_digest, false, 0, 0);
            let cqe = Cqe { result: 0x1234, sqhd: 7, sqid: 2, cid: 99, status: Status::SUCCESS };
            let mut out = Vec::new();
            encode_capsule_resp(&mut out, &controller, &cqe);
            assert_eq!(out.len(), 24 + if header_digest { 4 } else { 0 });
            assert_eq!(out[0], 5);
            assert_eq!(decode_one(&out, &host), Pdu::CapsuleResp(cqe));
            check_prefixes(&out, &host);
        }
    }

    #[test]
    fn data_pdus_round_trip_with_padding() {
        // HPDA 3 asks the controller to align C2H data to 16 bytes; CPDA 7 to 32 bytes.
        let (host, controller) = pair(true, true, 3, 7);
        let data: Vec<u8> = (0..100u8).collect();
        let c2h =
            DataHeader { cccid: 3, ttag: 0, datao: 4096, datal: 100, last: true, success: false };
        let mut out = Vec::new();
        encode_data_pdu(&mut out, &controller, &c2h, &data);
        assert_eq!(out[3], 32, "24 + 4 rounded up to 16");
        assert_eq!(out.len(), 32 + 100 + 4);
        assert_eq!(decode_one(&out, &host), Pdu::C2HData(c2h, &data));
        check_prefixes(&out, &host);

        let h2c =
            DataHeader { cccid: 3, ttag: 17, datao: 0, datal: 100, last: true, success: false };
        out.clear();
        encode_data_pdu(&mut out, &host, &h2c, &data);
        assert_eq!(out[3], 32, "24 + 4 rounded up to 32");
        assert_eq!(out[1], flags::HEADER_DIGEST | flags::DATA_DIGEST | flags::LAST_PDU);
        assert_eq!(decode_one(&out, &controller), Pdu::H2CData(h2c, &data));
    }

    #[test]
    fn r2t_golden_bytes() {
        let (host, controller) = pair(false, false, 0, 0);
        let r2t = R2T { cccid: 0x0102, ttag: 0x0304, r2to: 0x1000, r2tl: 0x20000 };
        let mut out = Vec::new();
        encode_r2t(&mut out, &controller, &r2t);
        assert_eq!(
            out,
            [9, 0, 24, 0, 24, 0, 0, 0, 2, 1, 4, 3, 0, 0x10, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0]
        );
        assert_eq!(decode_one(&out, &host), Pdu::R2T(r2t));
    }

    #[test]
    fn term_req_carries_offending_header() {
        let (host, controller) = pair(false, false, 0, 0);
        let header = [0x42u8; 200];
        let error = invalid(offset::HLEN, "test");
        let mut out = Vec::new();
        encode_term_req_for(&mut out, Role::Controller, &error, &header);
        assert_eq!(&out[..8], &[3, 0, 24, 0, 152, 0, 0, 0]);
        assert_eq!(&out[8..14], &[1, 0, 2, 0, 0, 0]);
        match decode_one(&out, &host) {
            Pdu::C2HTermReq(term) => {
                assert_eq!((term.fes, term.fei), (1, 2));
                assert_eq!(term.pdu_header, &header[..128]);
            }
            other => panic!("{other:?}"),
        }
        out.clear();
        encode_term_req(&mut out, Role::Host, FatalErrorStatus::HeaderDigestError, 0, &[]);
        assert_eq!(
            decode_one(&out, &controller),
            Pdu::H2CTermReq(TermReq { fes: 3, fei: 0, pdu_header: &[] })
        );
    }

    #[test]
    fn several_pdus_in_one_buffer_decode_in_turn() {
        let (host, controller) = pair(false, false, 0, 0);
        let mut out = Vec::new();
        encode_capsule_cmd(&mut out, &host, &Sqe::flush(1, 1), &[]);
        encode_capsule_cmd(&mut out, &host, &Sqe::keep_alive(2), &[]);
        let mut offset = 0;
        let mut cids = Vec::new();
        while offset < out.len() {
            match decode(&out[offset..], &controller).unwrap() {
                Decoded::Pdu { pdu: Pdu::CapsuleCmd(capsule), consumed_bytes } => {
                    cids.push(capsule.sqe.cid());
                    offset += consumed_bytes;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(cids, [1, 2]);
    }

    fn expect_error(bytes: &[u8], framing: &Framing, fes: FatalErrorStatus, fei: u32) {
        match decode(bytes, framing) {
            Err(error) => {
                assert_eq!(error.fatal_error_status(), fes, "{error}");
                assert_eq!(error.fatal_error_information(), fei, "{error}");
            }
            other => panic!("expected {fes:?}, got {other:?}"),
        }
    }

    #[test]
    fn malformed_headers_name_their_field() {
        let (host, controller) = pair(false, false, 0, 0);
        let mut capsule = Vec::new();
        encode_capsule_cmd(&mut capsule, &host, &Sqe::flush(1, 1), &[]);
        use FatalErrorStatus::*;

        let mut bad = capsule.clone();
        bad[0] = 0x08;
        expect_error(&bad, &controller, InvalidHeaderField, 0);
        let mut bad = capsule.clone();
        bad[0] = PduType::CapsuleResp as u8;
        expect_error(&bad, &controller, InvalidHeaderField, 0);
        let mut bad = capsule.clone();
        bad[2] = 24;
        expect_error(&bad, &controller, InvalidHeaderField, 2);
        let mut bad = capsule.clone();
        bad[1] = flags::HEADER_DIGEST;
        expect_error(&bad, &controller, InvalidHeaderField, 1);
        let mut bad = capsule.clone();
        bad[1] = flags::DATA_DIGEST;
        expect_error(&bad, &controller, InvalidHeaderField, 1);
        let mut bad = capsule.clone();
        bad[4..8].copy_from_slice(&60u32.to_le_bytes());
        expect_error(&bad, &controller, InvalidHeaderField, 4);
        let mut bad = capsule.clone();
        bad[4..8].copy_from_slice(&(SIZE_MAX + 1).to_le_bytes());
        expect_error(&bad, &controller, InvalidHeaderField, 4);

        // Data PDUs: PDO into the header, misaligned PDO, DATAL disagreeing with PLEN.
        let mut data_pdu = Vec::new();
        let header =
            DataHeader { cccid: 1, ttag: 1, datao: 0, datal: 8, last: true, success: false };
        encode_data_pdu(&mut data_pdu, &host, &header, &[1; 8]);
        let mut bad = data_pdu.clone();
        bad[3] = 20;
        expect_error(&bad, &controller, InvalidHeaderField, 3);
        let mut bad = data_pdu.clone();
        bad[3] = 26;
        expect_error(&bad, &controller, InvalidHeaderField, 3);
        let mut bad = data_pdu.clone();
        bad[3] = 32;
        expect_error(&bad, &controller, InvalidHeaderField, 3);
        let mut bad = data_pdu.clone();
        bad[16..20].copy_from_slice(&9u32.to_le_bytes());
        expect_error(&bad, &controller, InvalidHeaderField, 16);
        let mut bad = data_pdu.clone();
        bad[4..8].copy_from_slice(&(SIZE_MAX + 4).to_le_bytes());
        expect_error(&bad, &controller, DataTransferLimitExceeded, 0);
        let mut bad = data_pdu.clone();
        bad[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        expect_error(&bad, &controller, DataTransferOutOfRange, 0);

        // ICReq with HPDA above 31, ICResp with a too small MAXH2CDATA.
        let mut icreq = Vec::new();
        encode_ic_req(
            &mut icreq,
            &ICReq { pfv: 0, hpda: 0, header_digest: false, data_digest: false, maxr2t: 0 },
        );
        icreq[10] = 32;
        expect_error(&icreq, &controller, InvalidHeaderField, 10);
        let mut icresp = Vec::new();
        encode_ic_resp(
            &mut icresp,
            &ICResp { pfv: 0, cpda: 0, header_digest: false, data_digest: false, maxh2cdata: 4096 },
        );
        icresp[12..16].copy_from_slice(&512u32.to_le_bytes());
        expect_error(&icresp, &host, InvalidHeaderField, 12);
    }

    #[test]
    fn digests_are_checked() {
        let (host, controller) = pair(true, true, 0, 0);
        let sqe = Sqe::write(5, 1, 0, 1).with_sgl(SglDescriptor::in_capsule(0, 4));
        let mut good = Vec::new();
        encode_capsule_cmd(&mut good, &host, &sqe, &[1, 2, 3, 4]);

        let mut bad = good.clone();
        bad[20] ^= 1;
        expect_error(&bad, &controller, FatalErrorStatus::HeaderDigestError, 0);

        let mut bad = good.clone();
        let last = bad.len() - 5;
        bad[last] ^= 1;
        match decode(&bad, &controller) {
            Ok(Decoded::DataDigestMismatch {
                pdu: Pdu::CapsuleCmd(capsule),
                consumed_bytes,
                ..
            }) => {
                assert_eq!(capsule.sqe.cid(), 5);
                assert_eq!(consumed_bytes, bad.len());
            }
            other => panic!("{other:?}"),
        }
    }

    /// Every PDU type, each byte corrupted in several ways: never a panic, and every prefix of
    /// the intact PDU is Incomplete.
    #[test]
    fn every_corruption_of_every_pdu_type_is_handled() {
        for (header_digest, data_digest) in [(false, false), (true, true)] {
            let (host, controller) = pair(header_digest, data_digest, 1, 2);
            let mut samples: Vec<(Vec<u8>, Framing)> = Vec::new();
            let mut out = Vec::new();
            encode_ic_req(
                &mut out,
                &ICReq { pfv: 0, hpda: 1, header_digest, data_digest, maxr2t: 3 },
            );
            samples.push((std::mem::take(&mut out), controller));
            encode_ic_resp(
                &mut out,
                &ICResp { pfv: 0, cpda: 2, header_digest, data_digest, maxh2cdata: 8192 },
            );
            samples.push((std::mem::take(&mut out), host));
            encode_term_req(&mut out, Role::Host, FatalErrorStatus::PduSequenceError, 0, &[9; 30]);
            samples.push((std::mem::take(&mut out), controller));
            encode_term_req(
                &mut out,
                Role::Controller,
                FatalErrorStatus::InvalidHeaderField,
                4,
                &[9; 30],
            );
            samples.push((std::mem::take(&mut out), host));
            let sqe = Sqe::write(1, 1, 0, 1).with_sgl(SglDescriptor::in_capsule(0, 40));
            encode_capsule_cmd(&mut out, &host, &sqe, &[5; 40]);
            samples.push((std::mem::take(&mut out), controller));
            encode_capsule_resp(&mut out, &controller, &Cqe { cid: 1, ..Default::default() });
            samples.push((std::mem::take(&mut out), host));
            let header =
                DataHeader { cccid: 1, ttag: 2, datao: 0, datal: 40, last: true, success: false };
            encode_data_pdu(&mut out, &host, &header, &[6; 40]);
            samples.push((std::mem::take(&mut out), controller));
            encode_data_pdu(
                &mut out,
                &controller,
                &DataHeader { ttag: 0, success: true, ..header },
                &[6; 40],
            );
            samples.push((std::mem::take(&mut out), host));
            encode_r2t(&mut out, &controller, &R2T { cccid: 1, ttag: 2, r2to: 0, r2tl: 4096 });
            samples.push((std::mem::take(&mut out), host));
            for (bytes, framing) in &samples {
                assert!(matches!(decode(bytes, framing), Ok(Decoded::Pdu { .. })));
                check_prefixes(bytes, framing);
                for index in 0..bytes.len() {
                    for flip in [0x01u8, 0x80, 0xFF] {
                        let mut bad = bytes.clone();
                        bad[index] ^= flip;
                        if let Ok(Decoded::Pdu { consumed_bytes, .. }) = decode(&bad, framing) {
                            assert!(consumed_bytes <= bad.len());
                        }
                    }
                }
            }
        }
    }

    fn framing_strategy() -> impl Strategy<Value = Framing> {
        (any::<bool>(), any::<bool>(), any::<bool>(), 0u8..=31, 0u8..=31, 64u32..=4096).prop_map(
            |(controller, header_digest, data_digest, receive_pda, send_pda, pdu_size_max)| {
                Framing {
                    role: if controller { Role::Controller } else { Role::Host },
                    header_digest,
                    data_digest,
                    receive_pda,
                    send_pda,
                    pdu_size_max: pdu_size_max.max(IC_PDU_BYTES as u32),
                }
            },
        )
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600), framing in framing_strategy()) {
            match decode(&bytes, &framing) {
                Ok(Decoded::Incomplete { needed_bytes }) => {
                    prop_assert!(needed_bytes > bytes.len());
                    prop_assert!(needed_bytes <= framing.pdu_size_max as usize);
                }
                Ok(Decoded::Pdu { consumed_bytes, .. }) | Ok(Decoded::DataDigestMismatch { consumed_bytes, .. }) => {
                    prop_assert!(consumed_bytes >= COMMON_HEADER_BYTES && consumed_bytes <= bytes.len());
                }
                Err(_) => {}
            }
        }

        #[test]
        fn typed_headers_survive_corruption(
            seed in proptest::collection::vec(any::<u8>(), 64),
            data in proptest::collection::vec(any::<u8>(), 0..300),
            flip_at in any::<usize>(),
            flip in 1u8..=255,
            header_digest in any::<bool>(),
            data_digest in any::<bool>(),
            hpda in 0u8..=31,
            cpda in 0u8..=31,
        ) {
            let (host, controller) = pair(header_digest, data_digest, hpda, cpda);
            let mut sqe = [0u8; 64];
            sqe.copy_from_slice(&seed);
            let sqe = Sqe::from_bytes(sqe);
            let mut out = Vec::new();
            encode_capsule_cmd(&mut out, &host, &sqe, &data);
            // Round trip.
            prop_assert_eq!(decode_one(&out, &controller), Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &data }));
            // Any single corrupted byte: an error, a digest mismatch or a PDU, never a panic; with
            // both digests on, never the same PDU back unnoticed.
            // Padding between the header and PDO is covered by neither digest.
            let header_end = CAPSULE_CMD_HEADER_BYTES + if header_digest { DIGEST_BYTES } else { 0 };
            let padding = header_end..usize::from(out[3]).max(header_end);
            let index = flip_at % out.len();
            out[index] ^= flip;
            let result = decode(&out, &controller);
            if header_digest && data_digest {
                let unnoticed = matches!(result, Ok(Decoded::Pdu { .. }));
                let uncovered = index < COMMON_HEADER_BYTES || padding.contains(&index);
                prop_assert!(!unnoticed || uncovered, "flip at {} unnoticed", index);
            }
        }

        #[test]
        fn data_pdu_round_trip(
            cccid in any::<u16>(), ttag in any::<u16>(), datao in 0u32..1_000_000,
            data in proptest::collection::vec(any::<u8>(), 1..500),
            last in any::<bool>(), header_digest in any::<bool>(), data_digest in any::<bool>(),
            hpda in 0u8..=31, cpda in 0u8..=31,
        ) {
            let (host, controller) = pair(header_digest, data_digest, hpda, cpda);
            let header = DataHeader { cccid, ttag, datao, datal: data.len() as u32, last, success: false };
            let mut out = Vec::new();
            encode_data_pdu(&mut out, &host, &header, &data);
            prop_assert_eq!(decode_one(&out, &controller), Pdu::H2CData(header, &data));
            let c2h = DataHeader { ttag: 0, success: last, ..header };
            out.clear();
            encode_data_pdu(&mut out, &controller, &c2h, &data);
            prop_assert_eq!(decode_one(&out, &host), Pdu::C2HData(c2h, &data));
        }
    }
}
