//! The NBD server connection (`nbd::server::Connection`) over arbitrary client bytes: the
//! handshake and the transmission phase (reached quickly by prefixing a valid handshake when the
//! first input byte says so), delivered in pieces, with every request completed. Nothing may
//! panic, and the output and the requests in flight stay bounded.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use nbd::server::{Catalog, Connection, ExportInfo, RequestKind, INFLIGHT_REQUESTS_MAX};

/// One export of 1 MiB.
struct OneExport;

impl Catalog for OneExport {
    fn list(&self) -> Vec<ExportInfo> {
        vec![export()]
    }
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        (name == "disk").then(export)
    }
}

fn export() -> ExportInfo {
    ExportInfo {
        name: "disk".into(),
        size_bytes: 1 << 20,
        read_only: false,
        description: String::new(),
    }
}

/// Client flags (fixed newstyle, no zeroes), then optionally STRUCTURED_REPLY, then GO "disk".
fn handshake(structured: bool) -> Vec<u8> {
    const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
    let mut bytes = 3u32.to_be_bytes().to_vec();
    if structured {
        bytes.extend_from_slice(&IHAVEOPT.to_be_bytes());
        bytes.extend_from_slice(&8u32.to_be_bytes());
        bytes.extend_from_slice(&0u32.to_be_bytes());
    }
    let name = b"disk";
    bytes.extend_from_slice(&IHAVEOPT.to_be_bytes());
    bytes.extend_from_slice(&7u32.to_be_bytes());
    bytes.extend_from_slice(&(4 + name.len() as u32 + 2).to_be_bytes());
    bytes.extend_from_slice(&(name.len() as u32).to_be_bytes());
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(&0u16.to_be_bytes());
    bytes
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, input)) = input.split_first() else { return };
    let Some((&piece, stream)) = input.split_first() else { return };
    let mut bytes = if mode & 1 == 1 { handshake(mode & 2 == 2) } else { Vec::new() };
    bytes.extend_from_slice(stream);
    let piece = usize::from(piece).max(1);
    let mut connection = Connection::new(Arc::new(OneExport), 0);
    let mut at = 0;
    // Each round must take bytes or complete requests; a round that does neither ends the run
    // (the connection waits for something this harness does not send), so the loop is bounded
    // by the input length plus the requests it carries.
    loop {
        let end = (at + piece).min(bytes.len());
        let taken = match connection.receive(&bytes[at..end]) {
            Ok(taken) => taken,
            Err(_) => return,
        };
        at += taken;
        let mut completed = 0;
        while let Some(request) = connection.next_request() {
            assert!(connection.inflight_requests() <= INFLIGHT_REQUESTS_MAX);
            let buf = match request.kind {
                RequestKind::Read { buf, .. } => Some(buf),
                RequestKind::Write { data, .. } => Some(data),
                _ => None,
            };
            connection.complete(request.id, Ok(()), buf);
            completed += 1;
        }
        // Sent in pieces of an odd size, so sends end inside reply headers and read data.
        let chunks: usize = connection.output_chunks().map(<[u8]>::len).sum();
        assert_eq!(chunks, connection.output_len(), "the chunks are the pending output");
        while connection.output_len() > 0 {
            connection.consume_output((piece * 1021).min(connection.output_len()));
        }
        if connection.wants_close() || (taken == 0 && completed == 0) {
            return;
        }
    }
});
