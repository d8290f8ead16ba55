//! The few Identify data fields that `nvmf::structures` does not decode yet: the LBA format
//! selected by FLBAS (nvmf decodes format 0 only) and the active namespace ID list (CNS 02h).
//!
//! **API Boundary:** these byte layouts belong in `nvmf::structures`; they live here only until
//! `nvmf` offers them, and should move there unchanged.

use nvmf::structures::IDENTIFY_BYTES;

/// Offset of the LBA Format list in Identify Namespace; each entry is 4 bytes.
const LBA_FORMATS_OFFSET: usize = 128;
/// LBA formats an Identify Namespace structure can list (NLBAF is 0's based, at most 63).
pub const LBA_FORMAT_COUNT_MAX: usize = 64;
/// Entries in one active namespace ID list (4096 bytes of 4-byte NSIDs).
pub const ACTIVE_NAMESPACE_LIST_ENTRIES: usize = IDENTIFY_BYTES / 4;

/// One LBA format: metadata bytes per block and the block size as a power of two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbaFormat {
    pub metadata_bytes: u16,
    pub lba_data_size_log2: u8,
}

/// The index of the LBA format in use: FLBAS bits 3:0, with bits 6:5 as the high bits when the
/// namespace lists more than 16 formats (NLBAF, 0's based, above 15).
pub fn lba_format_index(flbas: u8, nlbaf: u8) -> usize {
    let low = usize::from(flbas & 0x0F);
    if nlbaf >= 16 {
        low | (usize::from((flbas >> 5) & 0x3) << 4)
    } else {
        low
    }
}

/// LBA format `index` of an Identify Namespace structure, if the data holds it.
pub fn lba_format(identify_namespace: &[u8], index: usize) -> Option<LbaFormat> {
    if index >= LBA_FORMAT_COUNT_MAX {
        return None;
    }
    let at = LBA_FORMATS_OFFSET + 4 * index;
    let entry = identify_namespace.get(at..at + 4)?;
    Some(LbaFormat {
        metadata_bytes: u16::from_le_bytes([entry[0], entry[1]]),
        lba_data_size_log2: entry[2],
    })
}

/// The NSIDs of an active namespace ID list: increasing, ended by the first zero or the end of
/// the list. `None` when they are not strictly increasing (a malformed list).
pub fn active_namespace_list(data: &[u8]) -> Option<Vec<u32>> {
    let mut nsids = Vec::new();
    for entry in data.chunks_exact(4).take(ACTIVE_NAMESPACE_LIST_ENTRIES) {
        let nsid = u32::from_le_bytes([entry[0], entry[1], entry[2], entry[3]]);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lba_format_selection() {
        assert_eq!(lba_format_index(0x02, 3), 2);
        assert_eq!(lba_format_index(0x12, 3), 2, "bit 4 (extended LBA) is not part of the index");
        assert_eq!(lba_format_index(0x61, 20), 0x31);
        let mut data = vec![0u8; IDENTIFY_BYTES];
        data[128 + 4 * 2..128 + 4 * 2 + 4].copy_from_slice(&[8, 0, 12, 0]);
        assert_eq!(
            lba_format(&data, 2),
            Some(LbaFormat { metadata_bytes: 8, lba_data_size_log2: 12 })
        );
        assert_eq!(lba_format(&data, 64), None);
        assert_eq!(lba_format(&data[..100], 0), None);
    }

    #[test]
    fn active_namespace_lists() {
        let mut data = vec![0u8; IDENTIFY_BYTES];
        data[0..4].copy_from_slice(&1u32.to_le_bytes());
        data[4..8].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(active_namespace_list(&data), Some(vec![1, 7]));
        data[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(active_namespace_list(&data), None);
        assert_eq!(active_namespace_list(&[0u8; 16]), Some(vec![]));
    }
}
