//! A small blocking client of the REST API, for the CLI and tests.
//!
//! Blocking on purpose: the CLI makes one request and exits, so an async runtime would only add
//! weight. Every failure becomes a [`ClientError`] whose `Display` text is the message a user
//! sees, so callers print it as is.

use crate::wire::{
    AnaState, CreateSnapshot, CreateVolume, DriveInfo, ErrorBody, ErrorCode, FreezePoint,
    FreezeVolume, HeldSnapshots, HostAccess, LocalClone, LocalSnapshot, NodeInfo, ReplaceDrive,
    ReplicatedRollback, ResizeVolume, ResyncList, ResyncProgress, RollbackVolume, SetCompression,
    SetPathState, SnapshotInfo, SnapshotList, ThawVolume, VolumeInfo, VolumeList, VolumePaths,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::Read;
use std::time::Duration;

/// How long to wait for a TCP connection to the API.
pub const CONNECT_TIMEOUT_MS: u64 = 2_000;
/// How long one request may take, end to end.
pub const REQUEST_TIMEOUT_MS: u64 = 30_000;
/// The largest response body the client reads; larger responses are refused, not truncated.
pub const RESPONSE_SIZE_BYTES_MAX: u64 = 16 << 20;
/// The largest error body the client reads for its message.
const ERROR_BODY_SIZE_BYTES_MAX: u64 = 64 << 10;

/// Why an API call failed. The `Display` text is the user-facing message.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid API URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// No HTTP exchange happened: nothing listens there, or the network failed.
    #[error("cannot reach the Ferrite API at {url}: {reason}; is `ferrite up` running?")]
    Unreachable { url: String, reason: String },
    /// The node answered with an error; `message` says what happened and what to do.
    #[error("{message}")]
    Api { status: u16, code: String, message: String },
    /// The server answered with something that is not the Ferrite API.
    #[error("the server at {url} did not answer as the Ferrite API does: {reason}")]
    InvalidResponse { url: String, reason: String },
}

impl ClientError {
    /// The API error code, if the node answered with a known one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Api { code, .. } => ErrorCode::parse(code),
            _ => None,
        }
    }
}

/// A client of one node's REST API.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base_url: String,
}

impl Client {
    /// A client of the API at `base_url`, such as `http://127.0.0.1:8080`. No request is made.
    pub fn new(base_url: &str) -> Result<Self, ClientError> {
        Self::build(base_url, CONNECT_TIMEOUT_MS, REQUEST_TIMEOUT_MS)
    }

    /// Like [`Client::new`], with every request given up after `timeout_ms` (connecting
    /// included): for a node asking another one something it can do without.
    pub fn with_timeout_ms(base_url: &str, timeout_ms: u64) -> Result<Self, ClientError> {
        Self::build(base_url, timeout_ms.min(CONNECT_TIMEOUT_MS), timeout_ms)
    }

    fn build(base_url: &str, connect_ms: u64, timeout_ms: u64) -> Result<Self, ClientError> {
        let invalid = |reason: &str| ClientError::InvalidUrl {
            url: base_url.to_owned(),
            reason: reason.to_owned(),
        };
        let trimmed = base_url.trim().trim_end_matches('/');
        let Some(rest) = trimmed.strip_prefix("http://") else {
            return Err(invalid("it must start with http://, for example http://127.0.0.1:8080"));
        };
        if rest.is_empty() || rest.contains(['/', '?', '#']) {
            return Err(invalid(
                "give only the scheme, host and port, for example http://127.0.0.1:8080",
            ));
        }
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_millis(connect_ms))
            .timeout(Duration::from_millis(timeout_ms))
            .redirects(0)
            .user_agent(concat!("ferrite/", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(Self { agent, base_url: trimmed.to_owned() })
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// Succeeds when the node is up and serving its API.
    pub fn health(&self) -> Result<(), ClientError> {
        self.send("GET", crate::paths::HEALTHZ, None).map(drop)
    }

    pub fn node(&self) -> Result<NodeInfo, ClientError> {
        self.call("GET", crate::paths::NODE, None)
    }

    /// The cluster's nodes; fails with `not_supported` on a single node.
    pub fn cluster(&self) -> Result<crate::ClusterInfo, ClientError> {
        self.call("GET", crate::paths::CLUSTER, None)
    }

    /// Every volume, sorted by name.
    pub fn list_volumes(&self) -> Result<Vec<VolumeInfo>, ClientError> {
        let list: VolumeList = self.call("GET", crate::paths::VOLUMES, None)?;
        Ok(list.volumes)
    }

    pub fn volume(&self, name: &str) -> Result<VolumeInfo, ClientError> {
        self.call("GET", &volume_path(name, ""), None)
    }

    /// Creates an empty volume ([`CreateVolume::empty`]) or a clone of a snapshot
    /// ([`CreateVolume::clone_of_snapshot`]).
    pub fn create_volume(&self, request: &CreateVolume) -> Result<VolumeInfo, ClientError> {
        self.call("POST", crate::paths::VOLUMES, Some(json(request)))
    }

    /// Grows a volume to `size_bytes`. The node refuses to shrink.
    pub fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo, ClientError> {
        let body = json(&ResizeVolume { size_bytes });
        self.call("POST", &volume_path(name, "/resize"), Some(body))
    }

    /// Deletes a volume and returns what it was.
    pub fn delete_volume(&self, name: &str) -> Result<VolumeInfo, ClientError> {
        self.call("DELETE", &volume_path(name, ""), None)
    }

    /// Takes a snapshot of `volume` named `name`.
    pub fn create_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotInfo, ClientError> {
        let body = json(&CreateSnapshot { name: name.to_owned() });
        self.call("POST", &volume_path(volume, "/snapshots"), Some(body))
    }

    /// The snapshots of `volume`, oldest first.
    pub fn list_snapshots(&self, volume: &str) -> Result<Vec<SnapshotInfo>, ClientError> {
        let list: SnapshotList = self.call("GET", &volume_path(volume, "/snapshots"), None)?;
        Ok(list.snapshots)
    }

    pub fn snapshot(&self, volume: &str, name: &str) -> Result<SnapshotInfo, ClientError> {
        self.call("GET", &snapshot_path(volume, name), None)
    }

    /// Deletes a snapshot and returns what it was. Its blocks no other snapshot or volume
    /// holds are freed by GC later.
    pub fn delete_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotInfo, ClientError> {
        self.call("DELETE", &snapshot_path(volume, name), None)
    }

    /// Rolls `volume` back to its snapshot `snapshot` and returns the volume.
    pub fn rollback_volume(&self, volume: &str, snapshot: &str) -> Result<VolumeInfo, ClientError> {
        let body = json(&RollbackVolume { snapshot: snapshot.to_owned() });
        self.call("POST", &volume_path(volume, "/rollback"), Some(body))
    }

    /// Sets how the volume's new writes are stored (one of [`crate::COMPRESSIONS`]) and
    /// returns the volume. Blocks already written keep their form.
    pub fn set_compression(
        &self,
        volume: &str,
        compression: &str,
    ) -> Result<VolumeInfo, ClientError> {
        let body = json(&SetCompression { compression: compression.to_owned() });
        self.call("PUT", &volume_path(volume, "/compression"), Some(body))
    }

    /// Who may connect to the volume.
    pub fn host_access(&self, volume: &str) -> Result<HostAccess, ClientError> {
        self.call("GET", &volume_path(volume, "/hosts"), None)
    }

    /// Allows `host` (a host NQN, or [`crate::ANY_HOST`] to open the volume to every host) to
    /// connect to the volume, and returns who may now.
    pub fn allow_host(&self, volume: &str, host: &str) -> Result<HostAccess, ClientError> {
        self.call("PUT", &host_path(volume, host), None)
    }

    /// Denies `host` (a host NQN, or [`crate::ANY_HOST`] to admit no host at all) access to the
    /// volume, disconnecting it, and returns who may still connect.
    pub fn deny_host(&self, volume: &str, host: &str) -> Result<HostAccess, ClientError> {
        self.call("DELETE", &host_path(volume, host), None)
    }

    /// The volume's NVMe/TCP paths and its ANA state on each.
    /// The copies the node makes as the volume's primary ([`crate::paths::VOLUME_RESYNC`]).
    pub fn volume_resync(&self, volume: &str) -> Result<Vec<ResyncProgress>, ClientError> {
        let list: ResyncList = self.call("GET", &volume_path(volume, "/resync"), None)?;
        Ok(list.resync)
    }

    pub fn volume_paths(&self, volume: &str) -> Result<VolumePaths, ClientError> {
        self.call("GET", &volume_path(volume, "/paths"), None)
    }

    /// Sets the volume's ANA state through NVMe port `port_id`; returns every path's state.
    pub fn set_path_state(
        &self,
        volume: &str,
        port_id: u16,
        ana_state: AnaState,
    ) -> Result<VolumePaths, ClientError> {
        let body = json(&SetPathState { ana_state });
        self.call("PUT", &volume_path(volume, &format!("/paths/{port_id}")), Some(body))
    }

    /// Puts a new drive in place of drive `index` and starts its rebuild; `path` names the new
    /// block device or file on a node with external drives (none for drive files). Returns the
    /// new drive.
    pub fn replace_drive(&self, index: u16, path: Option<&str>) -> Result<DriveInfo, ClientError> {
        let body = json(&ReplaceDrive { path: path.map(str::to_owned) });
        self.call("POST", &format!("/v1/drives/{index}/replace"), Some(body))
    }

    /// Holds the replicated volume's host writes on its serving primary (this node) for a
    /// snapshot of every copy, for at most `hold_ms` ([`crate::paths::CLUSTER_VOLUME_FREEZE`]).
    pub fn freeze_volume(&self, volume: &str, hold_ms: u64) -> Result<FreezePoint, ClientError> {
        let body = json(&FreezeVolume { hold_ms });
        self.call("POST", &cluster_volume_path(volume, "/freeze"), Some(body))
    }

    /// Ends the hold `token` names; an error if it did not last until now.
    pub fn thaw_volume(&self, volume: &str, token: u64) -> Result<(), ClientError> {
        let body = json(&ThawVolume { token });
        self.send("POST", &cluster_volume_path(volume, "/thaw"), Some(body)).map(drop)
    }

    /// Asks the volume's primary to roll it back to snapshot `snapshot_id`
    /// ([`crate::paths::CLUSTER_VOLUME_ROLLBACK`]); answers once every block is rewritten.
    pub fn rollback_replicated(&self, volume: &str, snapshot_id: u64) -> Result<(), ClientError> {
        let body = json(&ReplicatedRollback { snapshot_id });
        self.send("POST", &cluster_volume_path(volume, "/rollback"), Some(body)).map(drop)
    }

    /// Takes snapshot `id` of this node's copy of a replicated volume
    /// ([`crate::paths::CLUSTER_SNAPSHOT`]).
    pub fn take_local_snapshot(
        &self,
        id: u64,
        snapshot: &LocalSnapshot,
    ) -> Result<(), ClientError> {
        let path = format!("/v1/cluster/snapshots/{id}");
        self.send("PUT", &path, Some(json(snapshot))).map(drop)
    }

    /// The ids of the snapshots this node holds a copy of
    /// ([`crate::paths::CLUSTER_SNAPSHOTS`]).
    pub fn held_snapshots(&self) -> Result<Vec<u64>, ClientError> {
        let held: HeldSnapshots = self.call("GET", crate::paths::CLUSTER_SNAPSHOTS, None)?;
        Ok(held.ids)
    }

    /// Makes volume `id` on this node a clone of its copy of snapshot `snapshot_id`
    /// ([`crate::paths::CLUSTER_CLONE`]).
    pub fn make_local_clone(&self, id: u64, snapshot_id: u64) -> Result<(), ClientError> {
        let body = json(&LocalClone { snapshot_id });
        self.send("PUT", &format!("/v1/cluster/clones/{id}"), Some(body)).map(drop)
    }

    /// Drops this node's copy of snapshot `id`, if it has one.
    pub fn drop_local_snapshot(&self, id: u64) -> Result<(), ClientError> {
        self.send("DELETE", &format!("/v1/cluster/snapshots/{id}"), None).map(drop)
    }

    /// The Prometheus text exposition of the node's metrics.
    pub fn metrics(&self) -> Result<String, ClientError> {
        let response = self.send("GET", crate::paths::METRICS, None)?;
        let bytes = self.read_body(response)?;
        String::from_utf8(bytes).map_err(|_| self.invalid_response("metrics are not UTF-8"))
    }

    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ClientError> {
        let response = self.send(method, path, body)?;
        let bytes = self.read_body(response)?;
        serde_json::from_slice(&bytes).map_err(|error| self.invalid_response(error))
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<ureq::Response, ClientError> {
        let request = self.agent.request(method, &format!("{}{path}", self.base_url));
        let result = match body {
            Some(body) => request.set("Content-Type", "application/json").send_bytes(&body),
            None => request.call(),
        };
        match result {
            Ok(response) => Ok(response),
            Err(ureq::Error::Status(status, response)) => Err(self.api_error(status, response)),
            Err(ureq::Error::Transport(transport)) => Err(self.transport_error(&transport)),
        }
    }

    fn read_body(&self, response: ureq::Response) -> Result<Vec<u8>, ClientError> {
        let mut bytes = Vec::new();
        response
            .into_reader()
            .take(RESPONSE_SIZE_BYTES_MAX + 1)
            .read_to_end(&mut bytes)
            .map_err(|error| self.unreachable(io_reason(&error)))?;
        if bytes.len() as u64 > RESPONSE_SIZE_BYTES_MAX {
            return Err(self.invalid_response(format!(
                "the response is larger than {RESPONSE_SIZE_BYTES_MAX} bytes"
            )));
        }
        Ok(bytes)
    }

    fn api_error(&self, status: u16, response: ureq::Response) -> ClientError {
        let status_text = response.status_text().to_owned();
        let mut bytes = Vec::new();
        let read = response.into_reader().take(ERROR_BODY_SIZE_BYTES_MAX).read_to_end(&mut bytes);
        match (read, serde_json::from_slice::<ErrorBody>(&bytes)) {
            (Ok(_), Ok(body)) => ClientError::Api { status, code: body.code, message: body.error },
            _ => ClientError::Api {
                status,
                code: String::new(),
                message: format!(
                    "the server at {} answered HTTP {status} {status_text} without a Ferrite \
                     error body; is --api pointing at a Ferrite node?",
                    self.base_url
                ),
            },
        }
    }

    fn transport_error(&self, transport: &ureq::Transport) -> ClientError {
        match transport.kind() {
            ureq::ErrorKind::InvalidUrl | ureq::ErrorKind::UnknownScheme => {
                ClientError::InvalidUrl {
                    url: self.base_url.clone(),
                    reason: transport.to_string(),
                }
            }
            ureq::ErrorKind::Dns => self.unreachable("cannot resolve the host name".to_owned()),
            ureq::ErrorKind::BadStatus | ureq::ErrorKind::BadHeader => {
                self.invalid_response("the answer is not HTTP/1.1")
            }
            _ => {
                let reason = io_source(transport)
                    .map(io_reason)
                    .or_else(|| transport.message().map(str::to_owned))
                    .unwrap_or_else(|| transport.to_string());
                self.unreachable(reason)
            }
        }
    }

    fn unreachable(&self, reason: String) -> ClientError {
        ClientError::Unreachable { url: self.base_url.clone(), reason }
    }

    fn invalid_response(&self, reason: impl std::fmt::Display) -> ClientError {
        ClientError::InvalidResponse { url: self.base_url.clone(), reason: reason.to_string() }
    }
}

fn json(body: &impl Serialize) -> Vec<u8> {
    // The API's request types hold only strings and integers, which always serialise.
    serde_json::to_vec(body).expect("API request bodies always serialise")
}

/// The path of one volume's endpoint, with the name percent-encoded as one path segment so that
/// no name, however odd, can address another endpoint.
fn volume_path(name: &str, suffix: &str) -> String {
    let mut path = String::from(crate::paths::VOLUMES);
    path.push('/');
    push_segment(&mut path, name);
    path.push_str(suffix);
    path
}

/// The path of one host of a volume's allowed hosts, each part one percent-encoded segment.
fn host_path(volume: &str, host: &str) -> String {
    let mut path = volume_path(volume, "/hosts/");
    push_segment(&mut path, host);
    path
}

/// The path of one snapshot of a volume, each name one percent-encoded segment.
fn cluster_volume_path(name: &str, suffix: &str) -> String {
    let mut path = String::from("/v1/cluster/volumes/");
    push_segment(&mut path, name);
    path.push_str(suffix);
    path
}

fn snapshot_path(volume: &str, snapshot: &str) -> String {
    let mut path = volume_path(volume, "/snapshots/");
    push_segment(&mut path, snapshot);
    path
}

/// Appends `segment` percent-encoded: only unreserved characters stay as they are.
fn push_segment(path: &mut String, segment: &str) {
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            path.push(char::from(byte));
        } else {
            path.push_str(&format!("%{byte:02X}"));
        }
    }
}

/// The I/O error under a ureq transport error, if there is one.
fn io_source(transport: &ureq::Transport) -> Option<&std::io::Error> {
    let mut source = std::error::Error::source(transport);
    // Error chains are short; the bound only guards against a cyclic chain.
    for _ in 0..8 {
        let error = source?;
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        source = error.source();
    }
    None
}

fn io_reason(error: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match error.kind() {
        ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        ErrorKind::TimedOut | ErrorKind::WouldBlock => "the connection timed out".to_owned(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => {
            "the connection was reset".to_owned()
        }
        ErrorKind::UnexpectedEof => "the connection closed before the answer ended".to_owned(),
        _ => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    /// A base URL on which nothing listens: a port the OS just gave out and took back.
    fn closed_url() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        format!("http://127.0.0.1:{port}")
    }

    /// Serves one canned HTTP response on a fresh port, in a thread.
    fn serve_once(status_line: &str, body: &str) -> String {
        let response = format!(
            "HTTP/1.1 {status_line}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request).unwrap();
            stream.write_all(response.as_bytes()).unwrap();
        });
        url
    }

    #[test]
    fn unreachable_message_tells_what_to_do() {
        let url = closed_url();
        let error = Client::new(&url).unwrap().list_volumes().unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "cannot reach the Ferrite API at {url}: connection refused; is `ferrite up` running?"
            )
        );
    }

    #[test]
    fn invalid_urls() {
        for url in ["127.0.0.1:8080", "https://x", "http://", "http://h/v1", "ftp://h"] {
            assert!(matches!(Client::new(url), Err(ClientError::InvalidUrl { .. })), "{url}");
        }
        assert_eq!(Client::new("http://h:1/").unwrap().base_url(), "http://h:1");
    }

    #[test]
    fn api_errors_carry_code_and_message() {
        let url = serve_once(
            "409 Conflict",
            r#"{"error":"volume db already exists","code":"volume_exists"}"#,
        );
        let error = Client::new(&url).unwrap().volume("db").unwrap_err();
        assert_eq!(error.to_string(), "volume db already exists");
        assert_eq!(error.code(), Some(ErrorCode::VolumeExists));
        assert!(matches!(error, ClientError::Api { status: 409, .. }));
    }

    #[test]
    fn foreign_servers_are_named() {
        let url = serve_once("502 Bad Gateway", "oops");
        let error = Client::new(&url).unwrap().volume("db").unwrap_err();
        assert!(error.to_string().contains("answered HTTP 502 Bad Gateway"), "{error}");
        assert_eq!(error.code(), None);

        let url = serve_once("200 OK", "nope");
        let error = Client::new(&url).unwrap().node().unwrap_err();
        assert!(matches!(error, ClientError::InvalidResponse { .. }), "{error}");
    }

    /// Serves one canned HTTP response on a fresh port, in a thread, and hands back the
    /// request it received: its request line and its body.
    fn serve_capture(
        status_line: &str,
        body: &str,
    ) -> (String, std::sync::mpsc::Receiver<(String, String)>) {
        let response = format!(
            "HTTP/1.1 {status_line}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (sender, receiver) = std::sync::mpsc::sync_channel(1);
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut buffer = [0u8; 4096];
            // Reads until the headers and the announced body are in; requests here are small.
            let (head, body) = loop {
                let read = stream.read(&mut buffer).unwrap();
                assert!(read > 0, "the client closed before its request ended");
                request.extend_from_slice(&buffer[..read]);
                let text = String::from_utf8_lossy(&request).into_owned();
                let Some((head, body)) = text.split_once("\r\n\r\n") else { continue };
                let length = head
                    .lines()
                    .find_map(|line| {
                        let (name, value) = line.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse())
                    })
                    .map_or(0, |length| length.unwrap());
                if body.len() >= length {
                    break (head.to_owned(), body.to_owned());
                }
            };
            stream.write_all(response.as_bytes()).unwrap();
            let request_line = head.lines().next().unwrap().to_owned();
            sender.send((request_line, body)).unwrap();
        });
        (url, receiver)
    }

    const SNAPSHOT_JSON: &str = r#"{"name":"s 1","volume":"db","id":4,"size_bytes":1048576,"created_unix_ms":7,"exclusive_bytes":0}"#;

    #[test]
    fn snapshot_calls_send_the_documented_requests() {
        let (url, request) = serve_capture("201 Created", SNAPSHOT_JSON);
        let info = Client::new(&url).unwrap().create_snapshot("db", "s 1").unwrap();
        assert_eq!((info.name.as_str(), info.id), ("s 1", 4));
        let (line, body) = request.recv().unwrap();
        assert_eq!(line, "POST /v1/volumes/db/snapshots HTTP/1.1");
        assert_eq!(body, r#"{"name":"s 1"}"#);

        let (url, request) =
            serve_capture("200 OK", &format!(r#"{{"snapshots":[{SNAPSHOT_JSON}]}}"#));
        let list = Client::new(&url).unwrap().list_snapshots("db").unwrap();
        assert_eq!(list, vec![info.clone()]);
        assert_eq!(request.recv().unwrap().0, "GET /v1/volumes/db/snapshots HTTP/1.1");

        let (url, request) = serve_capture("200 OK", SNAPSHOT_JSON);
        assert_eq!(Client::new(&url).unwrap().snapshot("db", "s 1").unwrap(), info);
        assert_eq!(request.recv().unwrap().0, "GET /v1/volumes/db/snapshots/s%201 HTTP/1.1");

        let (url, request) = serve_capture("200 OK", SNAPSHOT_JSON);
        assert_eq!(Client::new(&url).unwrap().delete_snapshot("db", "s 1").unwrap(), info);
        assert_eq!(request.recv().unwrap().0, "DELETE /v1/volumes/db/snapshots/s%201 HTTP/1.1");

        let volume = r#"{"name":"db","id":1,"size_bytes":1048576,"nqn":"n","uuid":"u","created_unix_ms":1,"nvme_host":"h","nvme_port":4420,"snapshot_count":1}"#;
        let (url, request) = serve_capture("200 OK", volume);
        let rolled = Client::new(&url).unwrap().rollback_volume("db", "s1").unwrap();
        assert_eq!(rolled.snapshot_count, 1);
        let (line, body) = request.recv().unwrap();
        assert_eq!(line, "POST /v1/volumes/db/rollback HTTP/1.1");
        assert_eq!(body, r#"{"snapshot":"s1"}"#);

        let (url, request) = serve_capture("201 Created", volume);
        let clone = CreateVolume::clone_of_snapshot("copy", "db", "s1");
        Client::new(&url).unwrap().create_volume(&clone).unwrap();
        let (line, body) = request.recv().unwrap();
        assert_eq!(line, "POST /v1/volumes HTTP/1.1");
        assert_eq!(body, r#"{"name":"copy","from_snapshot":"db@s1"}"#);
    }

    #[test]
    fn snapshot_errors_carry_their_code() {
        let url = serve_once(
            "404 Not Found",
            r#"{"error":"volume db has no snapshot s1","code":"snapshot_not_found"}"#,
        );
        let error = Client::new(&url).unwrap().snapshot("db", "s1").unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::SnapshotNotFound));
        assert_eq!(error.to_string(), "volume db has no snapshot s1");
    }

    #[test]
    fn volume_paths_are_one_segment() {
        assert_eq!(volume_path("db-1", ""), "/v1/volumes/db-1");
        assert_eq!(volume_path("a/../b c", "/resize"), "/v1/volumes/a%2F..%2Fb%20c/resize");
        assert_eq!(
            host_path("db", "nqn.2014-08.org.nvmexpress:uuid:1/x"),
            "/v1/volumes/db/hosts/nqn.2014-08.org.nvmexpress%3Auuid%3A1%2Fx"
        );
        assert_eq!(host_path("db", crate::ANY_HOST), "/v1/volumes/db/hosts/any");
        assert_eq!(snapshot_path("db", "s/1"), "/v1/volumes/db/snapshots/s%2F1");
    }

    /// The client builds exactly the paths the server routes (`crate::paths`).
    #[test]
    fn client_paths_match_the_routes() {
        let fill = |route: &str| route.replace("{name}", "db").replace("{snapshot}", "s1");
        assert_eq!(volume_path("db", "/snapshots"), fill(crate::paths::VOLUME_SNAPSHOTS));
        assert_eq!(snapshot_path("db", "s1"), fill(crate::paths::VOLUME_SNAPSHOT));
        assert_eq!(volume_path("db", "/rollback"), fill(crate::paths::VOLUME_ROLLBACK));
        assert_eq!(volume_path("db", "/resync"), fill(crate::paths::VOLUME_RESYNC));
        assert_eq!(volume_path("db", "/resize"), fill(crate::paths::VOLUME_RESIZE));
        assert_eq!(volume_path("db", ""), fill(crate::paths::VOLUME));
    }
}
