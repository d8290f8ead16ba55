//! Data structures that commands carry as data: Identify Controller and Namespace, namespace
//! identification descriptors, the discovery log page and the other log pages the target serves.
//!
//! Each structure encodes into a caller's buffer (the target) and decodes the fields a host needs
//! (the initiator and the tests), so the byte layout lives in one place. Offsets follow the NVMe
//! base specification 2.0, the NVM command set specification 1.0 and the Fabrics discovery log
//! page definition. Strings in Identify are ASCII padded with spaces; NQNs are NUL-padded.

use crate::command::{le_u16, le_u32, le_u64};

/// Size of every Identify data structure.
pub const IDENTIFY_BYTES: usize = 4096;
/// Size of the discovery log page header and of each of its entries.
pub const DISCOVERY_LOG_RECORD_BYTES: usize = 1024;
/// Size of one Error Information log entry.
pub const ERROR_LOG_ENTRY_BYTES: usize = 64;
/// Size of the SMART / Health Information log page.
pub const SMART_LOG_BYTES: usize = 512;
/// Size of the Firmware Slot Information log page.
pub const FIRMWARE_SLOT_LOG_BYTES: usize = 512;
/// Size of the Changed Namespace List log page (1024 NSIDs).
pub const CHANGED_NAMESPACE_LOG_BYTES: usize = 4096;
/// Width of NQN fields in Identify Controller and the discovery log.
pub const NQN_FIELD_BYTES: usize = 256;

/// Controller types (Identify Controller CNTRLTYPE).
pub mod controller_type {
    pub const IO: u8 = 1;
    pub const DISCOVERY: u8 = 2;
    pub const ADMINISTRATIVE: u8 = 3;
}

/// Controller Multi-Path I/O and Namespace Sharing Capabilities (Identify Controller CMIC).
pub mod cmic {
    /// The subsystem may have two or more ports.
    pub const MULTI_PORT: u8 = 1 << 0;
    /// The subsystem may have two or more controllers.
    pub const MULTI_CONTROLLER: u8 = 1 << 1;
    /// The controller supports Asymmetric Namespace Access reporting.
    pub const ANA_REPORTING: u8 = 1 << 3;
}

/// Asymmetric Namespace Access states (ANA log page group descriptor STATE).
pub mod ana_state {
    pub const OPTIMIZED: u8 = 0x01;
    pub const NON_OPTIMIZED: u8 = 0x02;
    pub const INACCESSIBLE: u8 = 0x03;
    pub const PERSISTENT_LOSS: u8 = 0x04;
    pub const CHANGE: u8 = 0x0F;
}

/// Namespace Identifier Types of the namespace identification descriptor list.
pub mod nidt {
    pub const EUI64: u8 = 1;
    pub const NGUID: u8 = 2;
    pub const UUID: u8 = 3;
    pub const CSI: u8 = 4;
}

fn put_u16(buffer: &mut [u8], offset: usize, value: u16) {
    buffer[offset..offset + 2].copy_from_slice(&value.to_le_bytes());
}

fn put_u32(buffer: &mut [u8], offset: usize, value: u32) {
    buffer[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
}

fn put_u64(buffer: &mut [u8], offset: usize, value: u64) {
    buffer[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
}

/// Writes `text` into `field`, truncated to fit, and fills the rest with `pad`.
fn put_string(field: &mut [u8], text: &str, pad: u8) {
    let bytes = text.as_bytes();
    let length = bytes.len().min(field.len());
    field[..length].copy_from_slice(&bytes[..length]);
    field[length..].fill(pad);
}

/// Reads an ASCII field, stopping at the first NUL and dropping trailing spaces.
fn get_string(field: &[u8]) -> String {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).trim_end_matches(' ').to_owned()
}

/// The Identify Controller fields the target fills in and a host reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdentifyController {
    pub vid: u16,
    pub ssvid: u16,
    pub serial_number: String,
    pub model_number: String,
    pub firmware_revision: String,
    pub cmic: u8,
    /// Maximum data transfer size, a power of two in units of the minimum page size (0: none).
    pub mdts: u8,
    pub cntlid: u16,
    pub version: u32,
    pub oaes: u32,
    pub ctratt: u32,
    pub cntrltype: u8,
    pub oacs: u16,
    pub acl: u8,
    /// Asynchronous event request limit, 0's based.
    pub aerl: u8,
    pub frmw: u8,
    pub lpa: u8,
    /// Error log page entries, 0's based.
    pub elpe: u8,
    /// Keep alive granularity in units of 100 ms.
    pub kas: u16,
    /// ANA transition time in seconds.
    pub anatt: u8,
    /// ANA capabilities: the states reported (bits 0..4), ANAGRPID fixed while attached (bit 6).
    pub anacap: u8,
    /// Largest ANA group ID.
    pub anagrpmax: u32,
    /// Number of ANA group IDs the controller supports.
    pub nanagrpid: u32,
    pub sqes: u8,
    pub cqes: u8,
    pub maxcmd: u16,
    pub nn: u32,
    pub oncs: u16,
    pub fuses: u16,
    pub vwc: u8,
    pub awun: u16,
    pub awupf: u16,
    /// Maximum number of allowed namespaces (required non-zero with ANA reporting).
    pub mnan: u32,
    pub sgls: u32,
    pub subnqn: String,
    /// I/O queue command capsule supported size, in 16-byte units (SQE included).
    pub ioccsz: u32,
    /// I/O queue response capsule supported size, in 16-byte units.
    pub iorcsz: u32,
    pub icdoff: u16,
    pub fcatt: u8,
    pub msdbd: u8,
    pub ofcs: u16,
}

impl IdentifyController {
    /// Fills `out` (4096 bytes) with this structure, zeroing every other field.
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), IDENTIFY_BYTES, "Identify data is 4096 bytes");
        out.fill(0);
        put_u16(out, 0, self.vid);
        put_u16(out, 2, self.ssvid);
        put_string(&mut out[4..24], &self.serial_number, b' ');
        put_string(&mut out[24..64], &self.model_number, b' ');
        put_string(&mut out[64..72], &self.firmware_revision, b' ');
        out[76] = self.cmic;
        out[77] = self.mdts;
        put_u16(out, 78, self.cntlid);
        put_u32(out, 80, self.version);
        put_u32(out, 92, self.oaes);
        put_u32(out, 96, self.ctratt);
        out[111] = self.cntrltype;
        put_u16(out, 256, self.oacs);
        out[258] = self.acl;
        out[259] = self.aerl;
        out[260] = self.frmw;
        out[261] = self.lpa;
        out[262] = self.elpe;
        put_u16(out, 320, self.kas);
        out[343] = self.anatt;
        out[344] = self.anacap;
        put_u32(out, 348, self.anagrpmax);
        put_u32(out, 352, self.nanagrpid);
        out[512] = self.sqes;
        out[513] = self.cqes;
        put_u16(out, 514, self.maxcmd);
        put_u32(out, 516, self.nn);
        put_u16(out, 520, self.oncs);
        put_u16(out, 522, self.fuses);
        out[525] = self.vwc;
        put_u16(out, 526, self.awun);
        put_u16(out, 528, self.awupf);
        put_u32(out, 536, self.sgls);
        put_u32(out, 540, self.mnan);
        put_string(&mut out[768..768 + NQN_FIELD_BYTES], &self.subnqn, 0);
        put_u32(out, 1792, self.ioccsz);
        put_u32(out, 1796, self.iorcsz);
        put_u16(out, 1800, self.icdoff);
        out[1802] = self.fcatt;
        out[1803] = self.msdbd;
        put_u16(out, 1804, self.ofcs);
    }

    /// Reads the fields back; `data` must be at least 4096 bytes.
    pub fn decode(data: &[u8]) -> Option<Self> {
        if data.len() < IDENTIFY_BYTES {
            return None;
        }
        Some(Self {
            vid: le_u16(&data[0..]),
            ssvid: le_u16(&data[2..]),
            serial_number: get_string(&data[4..24]),
            model_number: get_string(&data[24..64]),
            firmware_revision: get_string(&data[64..72]),
            cmic: data[76],
            mdts: data[77],
            cntlid: le_u16(&data[78..]),
            version: le_u32(&data[80..]),
            oaes: le_u32(&data[92..]),
            ctratt: le_u32(&data[96..]),
            cntrltype: data[111],
            oacs: le_u16(&data[256..]),
            acl: data[258],
            aerl: data[259],
            frmw: data[260],
            lpa: data[261],
            elpe: data[262],
            kas: le_u16(&data[320..]),
            anatt: data[343],
            anacap: data[344],
            anagrpmax: le_u32(&data[348..]),
            nanagrpid: le_u32(&data[352..]),
            sqes: data[512],
            cqes: data[513],
            maxcmd: le_u16(&data[514..]),
            nn: le_u32(&data[516..]),
            oncs: le_u16(&data[520..]),
            fuses: le_u16(&data[522..]),
            vwc: data[525],
            awun: le_u16(&data[526..]),
            awupf: le_u16(&data[528..]),
            mnan: le_u32(&data[540..]),
            sgls: le_u32(&data[536..]),
            subnqn: get_string(&data[768..768 + NQN_FIELD_BYTES]),
            ioccsz: le_u32(&data[1792..]),
            iorcsz: le_u32(&data[1796..]),
            icdoff: le_u16(&data[1800..]),
            fcatt: data[1802],
            msdbd: data[1803],
            ofcs: le_u16(&data[1804..]),
        })
    }
}

/// The Identify Namespace (CNS 00h) fields the target fills in, with one LBA format.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdentifyNamespace {
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    pub nsfeat: u8,
    /// Number of LBA formats, 0's based.
    pub nlbaf: u8,
    pub flbas: u8,
    pub nmic: u8,
    /// Namespace attributes: bit 0 write protected.
    pub nsattr: u8,
    pub dlfeat: u8,
    /// NVM capacity in bytes.
    pub nvmcap: u128,
    /// The ANA group the namespace belongs to (0: none).
    pub anagrpid: u32,
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
    /// LBA format 0: log2 of the logical block size.
    pub lbaf0_lbads: u8,
}

impl IdentifyNamespace {
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), IDENTIFY_BYTES, "Identify data is 4096 bytes");
        out.fill(0);
        put_u64(out, 0, self.nsze);
        put_u64(out, 8, self.ncap);
        put_u64(out, 16, self.nuse);
        out[24] = self.nsfeat;
        out[25] = self.nlbaf;
        out[26] = self.flbas;
        out[30] = self.nmic;
        out[99] = self.nsattr;
        out[33] = self.dlfeat;
        out[48..64].copy_from_slice(&self.nvmcap.to_le_bytes());
        put_u32(out, 92, self.anagrpid);
        out[104..120].copy_from_slice(&self.nguid);
        out[120..128].copy_from_slice(&self.eui64);
        // LBA format 0 at 128: MS (u16) = 0, LBADS, RP = 0 (best performance).
        out[130] = self.lbaf0_lbads;
    }

    pub fn decode(data: &[u8]) -> Option<Self> {
        if data.len() < IDENTIFY_BYTES {
            return None;
        }
        let mut nvmcap = [0u8; 16];
        nvmcap.copy_from_slice(&data[48..64]);
        let mut nguid = [0u8; 16];
        nguid.copy_from_slice(&data[104..120]);
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(&data[120..128]);
        Some(Self {
            nsze: le_u64(&data[0..]),
            ncap: le_u64(&data[8..]),
            nuse: le_u64(&data[16..]),
            nsfeat: data[24],
            nlbaf: data[25],
            flbas: data[26],
            nmic: data[30],
            nsattr: data[99],
            dlfeat: data[33],
            nvmcap: u128::from_le_bytes(nvmcap),
            anagrpid: le_u32(&data[92..]),
            nguid,
            eui64,
            lbaf0_lbads: data[130],
        })
    }
}

/// Offset of the LBA format list in Identify Namespace; each entry is 4 bytes.
pub const LBA_FORMATS_OFFSET: usize = 128;
/// LBA formats an Identify Namespace structure can list (NLBAF is 0's based, at most 63).
pub const LBA_FORMAT_COUNT_MAX: usize = 64;
/// NSIDs in one active namespace ID list (CNS 02h): 4096 bytes of 4-byte NSIDs.
pub const ACTIVE_NAMESPACE_LIST_ENTRIES: usize = IDENTIFY_BYTES / 4;

/// One LBA format of Identify Namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbaFormat {
    /// MS: metadata bytes per logical block.
    pub metadata_bytes: u16,
    /// LBADS: the logical block size as a power of two.
    pub lba_data_size_log2: u8,
    /// RP: relative performance, 0 (best) to 3.
    pub relative_performance: u8,
}

/// The index of the LBA format in use: FLBAS bits 3:0, extended by bits 6:5 as the high bits
/// when the namespace lists more than 16 formats (NLBAF, 0's based, above 15).
pub fn lba_format_index(flbas: u8, nlbaf: u8) -> usize {
    let low = usize::from(flbas & 0x0F);
    if nlbaf >= 16 {
        low | (usize::from((flbas >> 5) & 0x3) << 4)
    } else {
        low
    }
}

/// LBA format `index` of an Identify Namespace structure, if `data` holds it.
pub fn lba_format(data: &[u8], index: usize) -> Option<LbaFormat> {
    if index >= LBA_FORMAT_COUNT_MAX {
        return None;
    }
    let at = LBA_FORMATS_OFFSET + 4 * index;
    let entry = data.get(at..at + 4)?;
    Some(LbaFormat {
        metadata_bytes: le_u16(entry),
        lba_data_size_log2: entry[2],
        relative_performance: entry[3] & 0x3,
    })
}

/// Fills an active namespace ID list (CNS 02h) with `nsids`, which must increase; the rest is 0.
pub fn encode_active_namespace_list(out: &mut [u8], nsids: &[u32]) {
    assert_eq!(out.len(), IDENTIFY_BYTES, "Identify data is 4096 bytes");
    assert!(nsids.len() <= ACTIVE_NAMESPACE_LIST_ENTRIES, "too many NSIDs");
    assert!(nsids.windows(2).all(|pair| pair[0] < pair[1]), "NSIDs must increase");
    out.fill(0);
    for (index, nsid) in nsids.iter().enumerate() {
        put_u32(out, 4 * index, *nsid);
    }
}

/// The NSIDs of an active namespace ID list, up to the first zero; None when they do not
/// strictly increase (a malformed list).
pub fn decode_active_namespace_list(data: &[u8]) -> Option<Vec<u32>> {
    let mut nsids = Vec::new();
    for entry in data.chunks_exact(4).take(ACTIVE_NAMESPACE_LIST_ENTRIES) {
        let nsid = le_u32(entry);
        if nsid == 0 {
            break;
        }
        if nsids.last().is_some_and(|last| *last >= nsid) {
            return None;
        }
        nsids.push(nsid);
    }
    Some(nsids)
}

/// The I/O Command Set Independent Identify Namespace structure (CNS 08h): NMIC, ANAGRPID and
/// NSTAT.
pub fn encode_identify_namespace_independent(out: &mut [u8], nmic: u8, anagrpid: u32, ready: bool) {
    assert_eq!(out.len(), IDENTIFY_BYTES, "Identify data is 4096 bytes");
    out.fill(0);
    out[1] = nmic;
    put_u32(out, 4, anagrpid);
    // NSTAT bit 0: namespace ready.
    out[14] = u8::from(ready);
}

/// The NVM command set Identify Controller structure (CNS 06h, CSI 00h): size limits for Verify,
/// Write Zeroes, Write Uncorrectable and Dataset Management. 0 means no limit is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IdentifyControllerNvm {
    pub vsl: u8,
    pub wzsl: u8,
    pub wusl: u8,
    pub dmrl: u8,
    pub dmrsl: u32,
    pub dmsl: u64,
}

impl IdentifyControllerNvm {
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), IDENTIFY_BYTES, "Identify data is 4096 bytes");
        out.fill(0);
        out[0] = self.vsl;
        out[1] = self.wzsl;
        out[2] = self.wusl;
        out[3] = self.dmrl;
        put_u32(out, 4, self.dmrsl);
        put_u64(out, 8, self.dmsl);
    }
}

/// The namespace identification descriptor list (CNS 03h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NamespaceIdentifiers {
    pub eui64: [u8; 8],
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
    pub csi: u8,
}

impl NamespaceIdentifiers {
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), IDENTIFY_BYTES, "Identify data is 4096 bytes");
        out.fill(0);
        let mut at = 0;
        let mut put = |nidt: u8, nid: &[u8]| {
            out[at] = nidt;
            out[at + 1] = nid.len() as u8;
            out[at + 4..at + 4 + nid.len()].copy_from_slice(nid);
            at += 4 + nid.len();
        };
        put(nidt::EUI64, &self.eui64);
        put(nidt::NGUID, &self.nguid);
        put(nidt::UUID, &self.uuid);
        put(nidt::CSI, &[self.csi]);
    }

    /// Reads a descriptor list; descriptors of unknown type are skipped, a malformed list
    /// (a length running past the end) is refused.
    pub fn decode(data: &[u8]) -> Option<Self> {
        let mut identifiers = Self::default();
        let mut at = 0;
        // Each descriptor takes at least 4 bytes, so this loop ends within data.len() / 4 steps.
        while at + 4 <= data.len() {
            let (nidt, nidl) = (data[at], usize::from(data[at + 1]));
            if nidt == 0 {
                break;
            }
            let nid = data.get(at + 4..at + 4 + nidl)?;
            match (nidt, nidl) {
                (nidt::EUI64, 8) => identifiers.eui64.copy_from_slice(nid),
                (nidt::NGUID, 16) => identifiers.nguid.copy_from_slice(nid),
                (nidt::UUID, 16) => identifiers.uuid.copy_from_slice(nid),
                (nidt::CSI, 1) => identifiers.csi = nid[0],
                (nidt::EUI64 | nidt::NGUID | nidt::UUID | nidt::CSI, _) => return None,
                _ => {}
            }
            at += 4 + nidl;
        }
        Some(identifiers)
    }
}

/// Transport types (TRTYPE) of discovery log entries.
pub mod trtype {
    pub const RDMA: u8 = 1;
    pub const FIBRE_CHANNEL: u8 = 2;
    pub const TCP: u8 = 3;
}

/// Address families (ADRFAM).
pub mod adrfam {
    pub const IPV4: u8 = 1;
    pub const IPV6: u8 = 2;
}

/// Subsystem types (SUBTYPE) of discovery log entries.
pub mod subtype {
    /// A referral to another discovery subsystem.
    pub const DISCOVERY_REFERRAL: u8 = 1;
    pub const NVM: u8 = 2;
    /// The discovery subsystem that returned this log page.
    pub const CURRENT_DISCOVERY: u8 = 3;
}

/// Transport requirements (TREQ) bits 1:0: secure channel.
pub mod treq {
    pub const NOT_SPECIFIED: u8 = 0;
    pub const REQUIRED: u8 = 1;
    pub const NOT_REQUIRED: u8 = 2;
}

/// The 1024-byte header of the discovery log page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DiscoveryLogHeader {
    pub generation: u64,
    pub record_count: u64,
    pub record_format: u16,
}

impl DiscoveryLogHeader {
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), DISCOVERY_LOG_RECORD_BYTES, "the header is 1024 bytes");
        out.fill(0);
        put_u64(out, 0, self.generation);
        put_u64(out, 8, self.record_count);
        put_u16(out, 16, self.record_format);
    }

    pub fn decode(data: &[u8]) -> Option<Self> {
        if data.len() < DISCOVERY_LOG_RECORD_BYTES {
            return None;
        }
        Some(Self {
            generation: le_u64(&data[0..]),
            record_count: le_u64(&data[8..]),
            record_format: le_u16(&data[16..]),
        })
    }
}

/// One 1024-byte discovery log page entry.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DiscoveryLogEntry {
    pub trtype: u8,
    pub adrfam: u8,
    pub subtype: u8,
    pub treq: u8,
    pub port_id: u16,
    pub cntlid: u16,
    /// Admin max submission queue size.
    pub asqsz: u16,
    pub eflags: u16,
    pub trsvcid: String,
    pub subnqn: String,
    pub traddr: String,
    /// TCP transport specific address subtype: security type (0: none).
    pub sectype: u8,
}

impl DiscoveryLogEntry {
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(out.len(), DISCOVERY_LOG_RECORD_BYTES, "an entry is 1024 bytes");
        out.fill(0);
        out[0] = self.trtype;
        out[1] = self.adrfam;
        out[2] = self.subtype;
        out[3] = self.treq;
        put_u16(out, 4, self.port_id);
        put_u16(out, 6, self.cntlid);
        put_u16(out, 8, self.asqsz);
        put_u16(out, 10, self.eflags);
        put_string(&mut out[32..64], &self.trsvcid, 0);
        put_string(&mut out[256..512], &self.subnqn, 0);
        put_string(&mut out[512..768], &self.traddr, 0);
        out[768] = self.sectype;
    }

    pub fn decode(data: &[u8]) -> Option<Self> {
        if data.len() < DISCOVERY_LOG_RECORD_BYTES {
            return None;
        }
        Some(Self {
            trtype: data[0],
            adrfam: data[1],
            subtype: data[2],
            treq: data[3],
            port_id: le_u16(&data[4..]),
            cntlid: le_u16(&data[6..]),
            asqsz: le_u16(&data[8..]),
            eflags: le_u16(&data[10..]),
            trsvcid: get_string(&data[32..64]),
            subnqn: get_string(&data[256..512]),
            traddr: get_string(&data[512..768]),
            sectype: data[768],
        })
    }
}

/// Size of the ANA log page header.
pub const ANA_LOG_HEADER_BYTES: usize = 16;
/// Size of an ANA group descriptor without its NSID list.
pub const ANA_GROUP_DESCRIPTOR_BYTES: usize = 32;
/// Groups and NSIDs an ANA log decode accepts: far more than any controller reports, small
/// enough to bound the work on a malformed page.
pub const ANA_LOG_GROUPS_MAX: usize = 1024;
pub const ANA_LOG_NSIDS_MAX: usize = 1024;

/// One ANA group descriptor of the Asymmetric Namespace Access log page (LID 0Ch).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AnaGroup {
    pub grpid: u32,
    /// The change count of this group's last state change.
    pub change_count: u64,
    /// One of [`ana_state`].
    pub state: u8,
    /// The namespaces of the group, in increasing order (empty when read with RGO).
    pub nsids: Vec<u32>,
}

/// The ANA log page: a change count and the groups reachable through this controller.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AnaLog {
    pub change_count: u64,
    pub groups: Vec<AnaGroup>,
}

impl AnaLog {
    /// Bytes of the encoding.
    pub fn encoded_bytes(&self) -> usize {
        ANA_LOG_HEADER_BYTES
            + self
                .groups
                .iter()
                .map(|group| ANA_GROUP_DESCRIPTOR_BYTES + 4 * group.nsids.len())
                .sum::<usize>()
    }

    /// Appends the encoding to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        assert!(self.groups.len() <= usize::from(u16::MAX), "NGRPS is 16 bits");
        let start = out.len();
        out.resize(start + self.encoded_bytes(), 0);
        let page = &mut out[start..];
        put_u64(page, 0, self.change_count);
        put_u16(page, 8, self.groups.len() as u16);
        let mut at = ANA_LOG_HEADER_BYTES;
        for group in &self.groups {
            put_u32(page, at, group.grpid);
            put_u32(page, at + 4, group.nsids.len() as u32);
            put_u64(page, at + 8, group.change_count);
            page[at + 16] = group.state & 0x0F;
            at += ANA_GROUP_DESCRIPTOR_BYTES;
            for nsid in &group.nsids {
                put_u32(page, at, *nsid);
                at += 4;
            }
        }
    }

    /// Reads an ANA log page; None when it is truncated or claims more groups or NSIDs than
    /// [`ANA_LOG_GROUPS_MAX`] / [`ANA_LOG_NSIDS_MAX`].
    pub fn decode(data: &[u8]) -> Option<Self> {
        let header = data.get(..ANA_LOG_HEADER_BYTES)?;
        let group_count = usize::from(le_u16(&header[8..]));
        if group_count > ANA_LOG_GROUPS_MAX {
            return None;
        }
        let mut log = AnaLog { change_count: le_u64(header), groups: Vec::new() };
        let mut at = ANA_LOG_HEADER_BYTES;
        for _ in 0..group_count {
            let descriptor = data.get(at..at + ANA_GROUP_DESCRIPTOR_BYTES)?;
            let nsid_count = le_u32(&descriptor[4..]) as usize;
            if nsid_count > ANA_LOG_NSIDS_MAX {
                return None;
            }
            at += ANA_GROUP_DESCRIPTOR_BYTES;
            let list = data.get(at..at + 4 * nsid_count)?;
            log.groups.push(AnaGroup {
                grpid: le_u32(descriptor),
                change_count: le_u64(&descriptor[8..]),
                state: descriptor[16] & 0x0F,
                nsids: list.chunks_exact(4).map(le_u32).collect(),
            });
            at += 4 * nsid_count;
        }
        Some(log)
    }
}

/// Fills the SMART / Health Information log (512 bytes): no warnings, full spare.
pub fn encode_smart_log(out: &mut [u8]) {
    assert_eq!(out.len(), SMART_LOG_BYTES, "the SMART log is 512 bytes");
    out.fill(0);
    // Available spare 100%, threshold 10%, percentage used 0.
    out[3] = 100;
    out[4] = 10;
}

/// Fills the Firmware Slot Information log (512 bytes): slot 1 active, holding `revision`.
pub fn encode_firmware_slot_log(out: &mut [u8], revision: &str) {
    assert_eq!(out.len(), FIRMWARE_SLOT_LOG_BYTES, "the firmware slot log is 512 bytes");
    out.fill(0);
    out[0] = 1;
    put_string(&mut out[8..16], revision, b' ');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identify_controller_round_trip_and_offsets() {
        let identify = IdentifyController {
            serial_number: "abc".into(),
            model_number: "Ferrite".into(),
            firmware_revision: "0.1".into(),
            cmic: 2,
            mdts: 8,
            cntlid: 0x1234,
            version: 0x10400,
            cntrltype: controller_type::IO,
            maxcmd: 128,
            nn: 1,
            sgls: 1 | (1 << 20),
            subnqn: "nqn.2024-01.io.ferrite:vol:a".into(),
            ioccsz: 516,
            iorcsz: 1,
            ..Default::default()
        };
        let mut out = vec![0u8; IDENTIFY_BYTES];
        identify.encode(&mut out);
        assert_eq!(&out[4..24], b"abc                 ");
        assert_eq!(out[77], 8);
        assert_eq!(&out[78..80], &[0x34, 0x12]);
        assert_eq!(&out[1792..1796], &516u32.to_le_bytes());
        assert_eq!(&out[768..772], b"nqn.");
        assert_eq!(IdentifyController::decode(&out), Some(identify));
        assert_eq!(IdentifyController::decode(&out[..100]), None);
    }

    #[test]
    fn identify_namespace_round_trip() {
        let identify = IdentifyNamespace {
            nsze: 100,
            ncap: 100,
            nuse: 100,
            nmic: 1,
            dlfeat: 1,
            nvmcap: 409600,
            nguid: [1; 16],
            eui64: [2; 8],
            lbaf0_lbads: 12,
            ..Default::default()
        };
        let mut out = vec![0u8; IDENTIFY_BYTES];
        identify.encode(&mut out);
        assert_eq!(out[130], 12);
        assert_eq!(IdentifyNamespace::decode(&out), Some(identify));
    }

    #[test]
    fn lba_formats_and_namespace_lists() {
        assert_eq!(lba_format_index(0x02, 3), 2);
        assert_eq!(lba_format_index(0x12, 3), 2, "bit 4 (extended LBA) is not part of the index");
        assert_eq!(lba_format_index(0x61, 20), 0x31);
        let mut data = vec![0u8; IDENTIFY_BYTES];
        IdentifyNamespace { lbaf0_lbads: 12, ..Default::default() }.encode(&mut data);
        assert_eq!(
            lba_format(&data, 0),
            Some(LbaFormat { metadata_bytes: 0, lba_data_size_log2: 12, relative_performance: 0 })
        );
        data[136..140].copy_from_slice(&[8, 0, 9, 2]);
        assert_eq!(
            lba_format(&data, 2),
            Some(LbaFormat { metadata_bytes: 8, lba_data_size_log2: 9, relative_performance: 2 })
        );
        assert_eq!(lba_format(&data, 64), None);
        assert_eq!(lba_format(&data[..100], 0), None);

        encode_active_namespace_list(&mut data, &[1, 5]);
        assert_eq!(decode_active_namespace_list(&data), Some(vec![1, 5]));
        data[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(decode_active_namespace_list(&data), None);
        assert_eq!(decode_active_namespace_list(&[]), Some(vec![]));
    }

    #[test]
    fn namespace_descriptors_round_trip() {
        let identifiers =
            NamespaceIdentifiers { eui64: [1; 8], nguid: [2; 16], uuid: [3; 16], csi: 0 };
        let mut out = vec![0u8; IDENTIFY_BYTES];
        identifiers.encode(&mut out);
        assert_eq!(&out[0..4], &[1, 8, 0, 0]);
        assert_eq!(&out[12..16], &[2, 16, 0, 0]);
        assert_eq!(NamespaceIdentifiers::decode(&out), Some(identifiers));
        let mut bad = out.clone();
        bad[1] = 7;
        assert_eq!(NamespaceIdentifiers::decode(&bad), None);
        let mut running_off = vec![0u8; 8];
        running_off[0] = 2;
        running_off[1] = 16;
        assert_eq!(NamespaceIdentifiers::decode(&running_off), None);
    }

    #[test]
    fn ana_log_round_trip_and_layout() {
        let log = AnaLog {
            change_count: 7,
            groups: vec![
                AnaGroup {
                    grpid: 1,
                    change_count: 7,
                    state: ana_state::INACCESSIBLE,
                    nsids: vec![1],
                },
                AnaGroup { grpid: 2, change_count: 3, state: ana_state::OPTIMIZED, nsids: vec![] },
            ],
        };
        let mut out = Vec::new();
        log.encode(&mut out);
        assert_eq!(out.len(), 16 + 32 + 4 + 32);
        assert_eq!(&out[0..10], &[7, 0, 0, 0, 0, 0, 0, 0, 2, 0]);
        assert_eq!(&out[16..24], &[1, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(out[32], 3);
        assert_eq!(&out[48..52], &[1, 0, 0, 0]);
        assert_eq!(AnaLog::decode(&out), Some(log));
        assert_eq!(AnaLog::decode(&out[..60]), None);
        let mut huge = out.clone();
        huge[8..10].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(AnaLog::decode(&huge), None);
    }

    #[test]
    fn discovery_records_round_trip() {
        let header = DiscoveryLogHeader { generation: 5, record_count: 2, record_format: 0 };
        let mut out = vec![0u8; DISCOVERY_LOG_RECORD_BYTES];
        header.encode(&mut out);
        assert_eq!(DiscoveryLogHeader::decode(&out), Some(header));
        let entry = DiscoveryLogEntry {
            trtype: trtype::TCP,
            adrfam: adrfam::IPV4,
            subtype: subtype::NVM,
            treq: treq::NOT_REQUIRED,
            port_id: 1,
            cntlid: 0xFFFF,
            asqsz: 128,
            eflags: 0,
            trsvcid: "4420".into(),
            subnqn: "nqn.2024-01.io.ferrite:vol:a".into(),
            traddr: "127.0.0.1".into(),
            sectype: 0,
        };
        entry.encode(&mut out);
        assert_eq!(&out[32..37], b"4420\0");
        assert_eq!(DiscoveryLogEntry::decode(&out), Some(entry));
    }
}
