//! The five standard workloads, from the Lightbits-vs-Ceph study, named exactly as the Ceph
//! anchor's `bench.sh` names them so results of both line up row by row.

use std::fmt;

/// A random-offset workload: one I/O size, one read/write mix, offsets aligned to the I/O size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    pub name: &'static str,
    /// The size of every I/O, also the alignment of its offset (as fio's default `blockalign`).
    pub block_size_bytes: u32,
    /// The share of I/Os that are reads, 0 to 100; the rest are writes.
    pub read_percent: u8,
}

/// The five standard workloads, in the order they run by default.
pub const STANDARD_WORKLOADS: [Workload; 5] = [
    Workload { name: "4k_randread", block_size_bytes: 4096, read_percent: 100 },
    Workload { name: "4k_randwrite", block_size_bytes: 4096, read_percent: 0 },
    Workload { name: "8k_randrw_80_20", block_size_bytes: 8192, read_percent: 80 },
    Workload { name: "16k_randrw_70_30", block_size_bytes: 16384, read_percent: 70 },
    Workload { name: "32k_randrw_50_50", block_size_bytes: 32768, read_percent: 50 },
];

const _: () = {
    let mut index = 0;
    while index < STANDARD_WORKLOADS.len() {
        let workload = STANDARD_WORKLOADS[index];
        assert!(workload.block_size_bytes % crate::target::IO_ALIGNMENT_BYTES == 0);
        assert!(workload.block_size_bytes <= crate::target::IO_SIZE_BYTES_MAX);
        assert!(workload.block_size_bytes.is_power_of_two());
        assert!(workload.read_percent <= 100);
        index += 1;
    }
};

impl Workload {
    /// Looks a standard workload up by name; the error lists the names (shown by clap as is).
    pub fn from_name(name: &str) -> Result<Workload, String> {
        STANDARD_WORKLOADS.iter().copied().find(|workload| workload.name == name.trim()).ok_or_else(
            || {
                let names: Vec<&str> = STANDARD_WORKLOADS.iter().map(|w| w.name).collect();
                format!("unknown workload {name:?}; the workloads are {}", names.join(", "))
            },
        )
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_and_unknown_names_list_the_choices() {
        for workload in STANDARD_WORKLOADS {
            assert_eq!(Workload::from_name(workload.name), Ok(workload));
        }
        let mix = Workload::from_name("16k_randrw_70_30").unwrap();
        assert_eq!((mix.block_size_bytes, mix.read_percent), (16384, 70));
        let error = Workload::from_name("4k_seqread").unwrap_err();
        assert!(error.contains("4k_randread, 4k_randwrite, 8k_randrw_80_20"), "{error}");
    }
}
