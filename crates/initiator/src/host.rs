//! This process's host identity: the host NQN and host identifier sent in every Fabrics Connect
//! unless the caller gives its own. Generated once per process, so every controller and queue a
//! process opens presents the same host, as a target that checks hosts expects.

use std::fmt::Write;
use std::sync::OnceLock;

use types::Nqn;

/// The prefix of UUID-based host NQNs (NVMe base specification, 4.5).
const UUID_NQN_PREFIX: &str = "nqn.2014-08.org.nvmexpress:uuid:";

/// A host NQN and the 16-byte host identifier that goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostIdentity {
    pub nqn: Nqn,
    pub host_id: [u8; 16],
}

impl HostIdentity {
    /// A host identity from a UUID's 16 bytes: `nqn.2014-08.org.nvmexpress:uuid:<uuid>`, with
    /// the same bytes as the host identifier, as Linux hosts do.
    pub fn from_uuid(uuid: [u8; 16]) -> HostIdentity {
        let mut text = String::with_capacity(UUID_NQN_PREFIX.len() + 36);
        text.push_str(UUID_NQN_PREFIX);
        for (index, byte) in uuid.iter().enumerate() {
            if matches!(index, 4 | 6 | 8 | 10) {
                text.push('-');
            }
            write!(text, "{byte:02x}").expect("writing to a String cannot fail");
        }
        let nqn = Nqn::new(&text).expect("a UUID NQN is a valid NQN");
        HostIdentity { nqn, host_id: uuid }
    }
}

/// This process's host identity: a random (version 4) UUID, drawn on first use.
pub fn default_host() -> &'static HostIdentity {
    static HOST: OnceLock<HostIdentity> = OnceLock::new();
    HOST.get_or_init(|| {
        let mut uuid: [u8; 16] = rand::random();
        uuid[6] = (uuid[6] & 0x0F) | 0x40;
        uuid[8] = (uuid[8] & 0x3F) | 0x80;
        HostIdentity::from_uuid(uuid)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_nqn_format() {
        let host = HostIdentity::from_uuid([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0x4d, 0xef, 0x80, 0x01, 0x02, 0x03, 0x04, 0x05,
            0x06, 0x07,
        ]);
        assert_eq!(
            host.nqn.as_str(),
            "nqn.2014-08.org.nvmexpress:uuid:12345678-9abc-4def-8001-020304050607"
        );
    }

    #[test]
    fn default_host_is_stable_and_version_4() {
        let first = default_host();
        assert_eq!(first, default_host());
        assert_eq!(first.host_id[6] >> 4, 4);
        assert_eq!(first.host_id[8] >> 6, 0b10);
        assert!(first.nqn.as_str().starts_with(UUID_NQN_PREFIX));
    }
}
