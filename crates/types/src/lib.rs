//! Domain types shared by every Ferrite crate: block sizes, volume names, NQNs and byte sizes;
//! the aligned buffer, and the output queue protocol connections splice read buffers into.
//!
//! These are validated at construction, so code that holds one can trust it. Nothing here knows
//! about a wire format, a disk format or a runtime; crates at the edges (`nvmf`, `api`, `node`)
//! convert from and to their own representations.

mod buffer;
pub mod output;
pub use buffer::{AlignedBuf, BUFFER_ALIGNMENT_BYTES};
pub use output::SpliceOutput;

use std::fmt;
use std::str::FromStr;

/// The unit of mapping and of checksums: every volume is an array of these.
pub const BLOCK_SIZE_BYTES: u32 = 4096;
/// The logical block size exposed to hosts over NVMe/TCP (LBA data size).
pub const LOGICAL_BLOCK_SIZE_BYTES: u32 = 4096;
/// The smallest volume that can be created.
pub const VOLUME_SIZE_BYTES_MIN: u64 = 1 << 20;
/// The largest volume that can be created (1 PiB), far above anything a node holds, but a bound.
pub const VOLUME_SIZE_BYTES_MAX: u64 = 1 << 50;
/// Volume names are short identifiers used in NQNs, URLs and file names.
pub const VOLUME_NAME_LENGTH_MAX: usize = 63;
/// NVMe limits NQNs to 223 bytes (NVMe base specification, 4.5).
pub const NQN_LENGTH_MAX: usize = 223;
/// The NQN prefix of every Ferrite subsystem; the volume name follows it.
pub const SUBSYSTEM_NQN_PREFIX: &str = "nqn.2024-01.io.ferrite:vol:";
/// The NQN prefix of a snapshot's read-only subsystem: `VOLUME:SNAPSHOT` follows it.
pub const SNAPSHOT_NQN_PREFIX: &str = "nqn.2024-01.io.ferrite:snap:";
/// The well-known discovery subsystem NQN (NVMe base specification).
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

const _: () = assert!(BLOCK_SIZE_BYTES.is_power_of_two());
const _: () = assert!(BLOCK_SIZE_BYTES % LOGICAL_BLOCK_SIZE_BYTES == 0);
const _: () = assert!(VOLUME_SIZE_BYTES_MIN % BLOCK_SIZE_BYTES as u64 == 0);
const _: () = assert!(SUBSYSTEM_NQN_PREFIX.len() + VOLUME_NAME_LENGTH_MAX <= NQN_LENGTH_MAX);

/// Why a name, NQN or size was refused. The message is shown to users as is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidInput {
    #[error(
        "invalid volume name {0:?}: use 1 to 63 characters from a-z, 0-9, '-' and '_', \
         starting with a letter or digit"
    )]
    VolumeName(String),
    #[error("invalid NQN {0:?}: an NQN starts with \"nqn.\" and is at most 223 bytes of printable ASCII")]
    Nqn(String),
    #[error(
        "invalid size {0:?}: give a number with an optional unit (B, K, M, G, T, KiB, MiB, GiB, TiB), \
         for example 10G"
    )]
    SizeSyntax(String),
    #[error(
        "invalid volume size {bytes} bytes: it must be a multiple of 4096 between 1 MiB and 1 PiB"
    )]
    VolumeSize { bytes: u64 },
}

/// A volume's name: `[a-z0-9][a-z0-9_-]{0,62}`. Safe in NQNs, URLs and file names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeName(String);

impl VolumeName {
    pub fn new(name: &str) -> Result<Self, InvalidInput> {
        let bytes = name.as_bytes();
        let valid = !bytes.is_empty()
            && bytes.len() <= VOLUME_NAME_LENGTH_MAX
            && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-' || *b == b'_');
        if valid {
            Ok(Self(name.to_owned()))
        } else {
            Err(InvalidInput::VolumeName(name.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The NQN of the NVMe subsystem that exposes this volume.
    pub fn subsystem_nqn(&self) -> Nqn {
        Nqn(format!("{SUBSYSTEM_NQN_PREFIX}{}", self.0))
    }

    /// The NQN of the read-only subsystem that exposes this volume's snapshot `snapshot`.
    pub fn snapshot_nqn(&self, snapshot: &VolumeName) -> Nqn {
        Nqn(format!("{SNAPSHOT_NQN_PREFIX}{}:{}", self.0, snapshot.0))
    }
}

impl fmt::Display for VolumeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for VolumeName {
    type Err = InvalidInput;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// An NVMe Qualified Name, validated: starts with `nqn.`, printable ASCII, at most 223 bytes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nqn(String);

impl Nqn {
    pub fn new(nqn: &str) -> Result<Self, InvalidInput> {
        let valid = nqn.starts_with("nqn.")
            && nqn.len() <= NQN_LENGTH_MAX
            && nqn.bytes().all(|b| b.is_ascii_graphic());
        if valid {
            Ok(Self(nqn.to_owned()))
        } else {
            Err(InvalidInput::Nqn(nqn.to_owned()))
        }
    }

    pub fn discovery() -> Self {
        Self(DISCOVERY_NQN.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The volume this NQN names, if it is a Ferrite subsystem NQN.
    pub fn volume_name(&self) -> Option<VolumeName> {
        self.0.strip_prefix(SUBSYSTEM_NQN_PREFIX).and_then(|name| VolumeName::new(name).ok())
    }

    /// The volume and snapshot this NQN names, if it is a Ferrite snapshot subsystem NQN.
    pub fn snapshot_names(&self) -> Option<(VolumeName, VolumeName)> {
        let rest = self.0.strip_prefix(SNAPSHOT_NQN_PREFIX)?;
        let (volume, snapshot) = rest.split_once(':')?;
        Some((VolumeName::new(volume).ok()?, VolumeName::new(snapshot).ok()?))
    }
}

impl fmt::Display for Nqn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Nqn {
    type Err = InvalidInput;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// A size parsed from user input such as `10G`, `512MiB` or `4096`. Units are binary
/// (K = KiB = 1024), as in `qemu-img` and `truncate`, and for the same reason: block devices are
/// sized in powers of two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = InvalidInput;
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let error = || InvalidInput::SizeSyntax(input.to_owned());
        let trimmed = input.trim();
        let split = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let number: u64 = number.parse().map_err(|_| error())?;
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kb" | "kib" => 10,
            "m" | "mb" | "mib" => 20,
            "g" | "gb" | "gib" => 30,
            "t" | "tb" | "tib" => 40,
            "p" | "pb" | "pib" => 50,
            _ => return Err(error()),
        };
        number.checked_mul(1u64 << shift).map(ByteSize).ok_or_else(error)
    }
}

impl fmt::Display for ByteSize {
    /// Prints the largest binary unit that divides the size exactly (`10GiB`, `1536MiB`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u32); 5] =
            [("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
        for (unit, shift) in UNITS {
            let scale = 1u64 << shift;
            if self.0 >= scale && self.0 % scale == 0 {
                return write!(f, "{}{unit}", self.0 / scale);
            }
        }
        write!(f, "{}B", self.0)
    }
}

/// Checks that a volume size is allowed: a whole number of blocks within the bounds.
pub fn validate_volume_size(bytes: u64) -> Result<u64, InvalidInput> {
    let valid = (VOLUME_SIZE_BYTES_MIN..=VOLUME_SIZE_BYTES_MAX).contains(&bytes)
        && bytes % u64::from(BLOCK_SIZE_BYTES) == 0;
    if valid {
        Ok(bytes)
    } else {
        Err(InvalidInput::VolumeSize { bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_names() {
        for good in ["a", "db-1", "0x", "vol_2", &"a".repeat(63)] {
            assert!(VolumeName::new(good).is_ok(), "{good}");
        }
        for bad in ["", "-a", "_a", "A", "a b", "a/b", "a.b", &"a".repeat(64), "é"] {
            assert!(VolumeName::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn nqn_round_trip_through_volume_name() {
        let name = VolumeName::new("db-1").unwrap();
        let nqn = name.subsystem_nqn();
        assert_eq!(nqn.as_str(), "nqn.2024-01.io.ferrite:vol:db-1");
        let volume = VolumeName::new("db-1").unwrap();
        let snapshot = VolumeName::new("nightly").unwrap();
        let snap_nqn = volume.snapshot_nqn(&snapshot);
        assert_eq!(snap_nqn.as_str(), "nqn.2024-01.io.ferrite:snap:db-1:nightly");
        assert_eq!(snap_nqn.snapshot_names(), Some((volume.clone(), snapshot)));
        assert_eq!(snap_nqn.volume_name(), None);
        assert_eq!(volume.subsystem_nqn().snapshot_names(), None);
        assert_eq!(Nqn::new("nqn.2024-01.io.ferrite:snap:db-1").unwrap().snapshot_names(), None);
        assert_eq!(nqn.volume_name(), Some(name));
        assert_eq!(Nqn::discovery().volume_name(), None);
        assert!(Nqn::new("nqn.x y").is_err());
        assert!(Nqn::new("iqn.x").is_err());
        assert!(Nqn::new(&format!("nqn.{}", "a".repeat(220))).is_err());
    }

    #[test]
    fn sizes() {
        let check = |input: &str, expect: Option<u64>| {
            assert_eq!(input.parse::<ByteSize>().ok().map(ByteSize::bytes), expect, "{input}");
        };
        check("4096", Some(4096));
        check("10G", Some(10 << 30));
        check("10GiB", Some(10 << 30));
        check("512m", Some(512 << 20));
        check(" 1 T ", Some(1 << 40));
        check("1.5G", None);
        check("G", None);
        check("-1", None);
        check("10X", None);
        check("99999999999999999999", None);
        check("20000000P", None);
        assert_eq!(ByteSize(10 << 30).to_string(), "10GiB");
        assert_eq!(ByteSize(1536 << 20).to_string(), "1536MiB");
        assert_eq!(ByteSize(4097).to_string(), "4097B");
    }

    #[test]
    fn volume_size_bounds() {
        assert!(validate_volume_size(1 << 20).is_ok());
        assert!(validate_volume_size(4096).is_err());
        assert!(validate_volume_size((1 << 30) + 512).is_err());
        assert!(validate_volume_size(1 << 51).is_err());
    }
}
