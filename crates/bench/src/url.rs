//! Parses the `--target` URL of `ferrite bench` into a validated target, with errors that say
//! what is wrong and show the expected form.
//!
//! Accepted: `nvme+tcp://HOST[:PORT]/NQN` (port 4420 when left out; a bare volume name in place
//! of the NQN stands for that volume's Ferrite subsystem NQN) and `nbd://HOST[:PORT]/EXPORT`
//! (port 10809), which parses but is refused later until the NBD frontend exists. HOST is a DNS
//! name, an IPv4 address or a bracketed IPv6 address; it is not resolved here. `engine:DIR` is
//! the log-structured engine in the bench's own process, on drive files in a fresh directory
//! under DIR (see `crate::local`).

use std::fmt;
use std::net::Ipv6Addr;
use std::path::PathBuf;
use std::str::FromStr;

use types::{Nqn, VolumeName};

/// The IANA port of NVMe/TCP I/O controllers.
pub const NVME_TCP_PORT_DEFAULT: u16 = 4420;
/// The IANA port of NBD.
pub const NBD_PORT_DEFAULT: u16 = 10809;
/// DNS names are at most 253 bytes; a longer host cannot be valid.
const HOST_LENGTH_MAX: usize = 253;
/// NBD export names are short strings in practice; the protocol allows 4 KiB.
const NBD_EXPORT_LENGTH_MAX: usize = 4096;

const FORMS: &str = "use nvme+tcp://HOST:PORT/NQN, for example \
     nvme+tcp://127.0.0.1:4420/nqn.2024-01.io.ferrite:vol:db-1";

/// Why a target URL was refused. The message is shown to users as is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid target URL {url:?}: {reason}")]
pub struct TargetUrlError {
    pub url: String,
    pub reason: String,
}

/// A parsed `--target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetUrl {
    NvmeTcp(NvmeTcpTarget),
    Nbd(NbdTarget),
    /// The engine in this process; drive files go in a fresh directory under this one.
    Engine {
        parent_dir: PathBuf,
    },
}

/// An NVMe/TCP subsystem: where to connect and which subsystem NQN to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeTcpTarget {
    /// A DNS name, an IPv4 address or an IPv6 address (without brackets).
    pub host: String,
    pub port: u16,
    pub nqn: Nqn,
}

/// An NBD export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdTarget {
    pub host: String,
    pub port: u16,
    pub export: String,
}

impl NvmeTcpTarget {
    /// `host:port`, with IPv6 hosts in brackets: ready for `tokio::net::TcpStream::connect`.
    pub fn address(&self) -> String {
        join_host_port(&self.host, self.port)
    }
}

impl NbdTarget {
    pub fn address(&self) -> String {
        join_host_port(&self.host, self.port)
    }
}

fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl fmt::Display for TargetUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetUrl::NvmeTcp(target) => {
                write!(f, "nvme+tcp://{}/{}", target.address(), target.nqn)
            }
            TargetUrl::Nbd(target) => write!(f, "nbd://{}/{}", target.address(), target.export),
            TargetUrl::Engine { parent_dir } => write!(f, "engine:{}", parent_dir.display()),
        }
    }
}

impl FromStr for TargetUrl {
    type Err = TargetUrlError;
    fn from_str(url: &str) -> Result<Self, Self::Err> {
        parse(url).map_err(|reason| TargetUrlError { url: url.to_owned(), reason })
    }
}

fn parse(url: &str) -> Result<TargetUrl, String> {
    if let Some(bad) = url.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("it contains {bad:?}; {FORMS}"));
    }
    if let Some(dir) = url.strip_prefix("engine:") {
        if !dir.starts_with('/') {
            return Err(format!(
                "{dir:?} is not an absolute directory; use engine:DIR, for example engine:/var/tmp"
            ));
        }
        return Ok(TargetUrl::Engine { parent_dir: PathBuf::from(dir) });
    }
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!("no scheme; {FORMS}"));
    };
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "nvme+tcp" => NVME_TCP_PORT_DEFAULT,
        "nbd" => NBD_PORT_DEFAULT,
        "nvme" | "tcp" | "nvme-tcp" | "nvmf" => {
            return Err(format!("the scheme is spelled \"nvme+tcp\"; {FORMS}"))
        }
        _ => {
            return Err(format!(
                "unsupported scheme {scheme:?}; {FORMS} (or nbd://HOST:PORT/EXPORT, or engine:DIR)"
            ))
        }
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (host, port) = parse_authority(authority, default_port)?;
    if scheme == "nbd" {
        if path.is_empty() {
            return Err("no export name after the address; use nbd://HOST:PORT/EXPORT".to_owned());
        }
        if path.len() > NBD_EXPORT_LENGTH_MAX {
            return Err(format!("the export name is over {NBD_EXPORT_LENGTH_MAX} bytes"));
        }
        return Ok(TargetUrl::Nbd(NbdTarget { host, port, export: path.to_owned() }));
    }
    if path.is_empty() {
        return Err(format!("no subsystem NQN after the address; {FORMS}"));
    }
    let nqn = if path.starts_with("nqn.") {
        Nqn::new(path).map_err(|error| error.to_string())?
    } else if let Ok(volume) = VolumeName::new(path) {
        volume.subsystem_nqn()
    } else {
        return Err(format!(
            "{path:?} is neither an NQN (starting with \"nqn.\") nor a volume name; {FORMS}"
        ));
    };
    Ok(TargetUrl::NvmeTcp(NvmeTcpTarget { host, port, nqn }))
}

fn parse_authority(authority: &str, default_port: u16) -> Result<(String, u16), String> {
    if authority.is_empty() {
        return Err(format!("no host; {FORMS}"));
    }
    if authority.contains('@') {
        return Err("user names and passwords are not supported in the URL".to_owned());
    }
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let Some((address, after)) = bracketed.split_once(']') else {
            return Err("an IPv6 address opened with '[' is not closed with ']'".to_owned());
        };
        if address.parse::<Ipv6Addr>().is_err() {
            return Err(format!("{address:?} is not an IPv6 address"));
        }
        let port = match after {
            "" => None,
            _ => match after.strip_prefix(':') {
                Some(port) => Some(port),
                None => return Err(format!("unexpected {after:?} after the IPv6 address")),
            },
        };
        (address.to_owned(), port)
    } else {
        let mut parts = authority.split(':');
        let host = parts.next().unwrap_or_default();
        let port = parts.next();
        if parts.next().is_some() {
            return Err("put an IPv6 address in brackets, as in [::1]:4420".to_owned());
        }
        let valid_host = !host.is_empty()
            && host.len() <= HOST_LENGTH_MAX
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_');
        if !valid_host {
            return Err(format!("{host:?} is not a host name or an IP address"));
        }
        (host.to_owned(), port)
    };
    let port = match port {
        None => default_port,
        Some(text) => match text.parse::<u16>() {
            Ok(port) if port != 0 => port,
            _ => return Err(format!("{text:?} is not a port number (1 to 65535)")),
        },
    };
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks one URL: `Ok(display form)` when it should parse, `Err(part of the message)` when
    /// it should not.
    fn check(url: &str, expect: Result<&str, &str>) {
        match (url.parse::<TargetUrl>(), expect) {
            (Ok(target), Ok(shown)) => assert_eq!(target.to_string(), shown, "{url}"),
            (Err(error), Err(part)) => {
                let message = error.to_string();
                assert!(message.contains(part), "{url}: {message:?} lacks {part:?}");
                assert!(message.contains(url), "{url}: the message names the URL: {message}");
            }
            (got, _) => panic!("{url}: expected {expect:?}, got {got:?}"),
        }
    }

    #[test]
    fn accepts_nvme_tcp_urls() {
        let nqn = "nqn.2024-01.io.ferrite:vol:db-1";
        check(
            &format!("nvme+tcp://127.0.0.1:4420/{nqn}"),
            Ok(&format!("nvme+tcp://127.0.0.1:4420/{nqn}")),
        );
        check(
            &format!("nvme+tcp://127.0.0.1/{nqn}"),
            Ok(&format!("nvme+tcp://127.0.0.1:4420/{nqn}")),
        );
        check(
            &format!("NVME+TCP://node-1.example:9000/{nqn}"),
            Ok(&format!("nvme+tcp://node-1.example:9000/{nqn}")),
        );
        check(&format!("nvme+tcp://[::1]:4421/{nqn}"), Ok(&format!("nvme+tcp://[::1]:4421/{nqn}")));
        check(
            &format!("nvme+tcp://[fe80::1]/{nqn}"),
            Ok(&format!("nvme+tcp://[fe80::1]:4420/{nqn}")),
        );
        // A volume name stands for its subsystem NQN.
        check("nvme+tcp://127.0.0.1:4420/db-1", Ok(&format!("nvme+tcp://127.0.0.1:4420/{nqn}")));
        // Any valid NQN, not only Ferrite's.
        check(
            "nvme+tcp://10.0.0.5:4420/nqn.2014-08.org.nvmexpress:uuid:1234",
            Ok("nvme+tcp://10.0.0.5:4420/nqn.2014-08.org.nvmexpress:uuid:1234"),
        );

        let Ok(TargetUrl::NvmeTcp(target)) = "nvme+tcp://[::1]:4421/db-1".parse() else {
            panic!("parses")
        };
        assert_eq!((target.host.as_str(), target.port), ("::1", 4421));
        assert_eq!(target.address(), "[::1]:4421");
        assert_eq!(target.nqn.as_str(), nqn);
    }

    #[test]
    fn parses_nbd_urls() {
        check("nbd://127.0.0.1:10809/db-1", Ok("nbd://127.0.0.1:10809/db-1"));
        check("nbd://localhost/export", Ok("nbd://localhost:10809/export"));
        check("nbd://localhost:10809/", Err("no export name"));
    }

    #[test]
    fn rejects_malformed_urls() {
        check("127.0.0.1:4420/db-1", Err("no scheme"));
        check("http://127.0.0.1:4420/db-1", Err("unsupported scheme \"http\""));
        check("nvme://127.0.0.1:4420/db-1", Err("spelled \"nvme+tcp\""));
        check("nvme+tcp://127.0.0.1:4420", Err("no subsystem NQN"));
        check("nvme+tcp://127.0.0.1:4420/", Err("no subsystem NQN"));
        check("nvme+tcp:///db-1", Err("no host"));
        check("nvme+tcp://:4420/db-1", Err("not a host name"));
        check("nvme+tcp://127.0.0.1:0/db-1", Err("not a port number"));
        check("nvme+tcp://127.0.0.1:65536/db-1", Err("not a port number"));
        check("nvme+tcp://127.0.0.1:port/db-1", Err("not a port number"));
        check("nvme+tcp://::1:4420/db-1", Err("in brackets"));
        check("nvme+tcp://[::1/db-1", Err("not closed"));
        check("nvme+tcp://[nothost]:4420/db-1", Err("not an IPv6 address"));
        check("nvme+tcp://[::1]x/db-1", Err("unexpected"));
        check("nvme+tcp://user@host:4420/db-1", Err("user names"));
        check("nvme+tcp://ho st:4420/db-1", Err("contains ' '"));
        check("nvme+tcp://h%st:4420/db-1", Err("not a host name"));
        check("nvme+tcp://127.0.0.1:4420/Not_A_Volume", Err("neither an NQN"));
        check(
            &format!("nvme+tcp://127.0.0.1:4420/nqn.{}", "a".repeat(230)),
            Err("at most 223 bytes"),
        );
    }
}
