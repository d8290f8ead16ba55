//! The target on monoio: one thread, one io_uring ring, thread-per-core.
//!
//! Hot path. The same structure as `server_tokio`, so the two differ only in the runtime: one
//! reusable input buffer (reads append to its free tail), one reusable output buffer written
//! once per batch. monoio takes buffers by value for the duration of an io_uring operation and
//! hands them back, so the same two allocations circulate for the life of the connection.

use std::net::TcpListener as StdTcpListener;

use anyhow::Context;
use monoio::buf::IoBufMut;
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};

use crate::protocol::{
    Store, TargetConnection, SERVER_INPUT_BUFFER_BYTES, SERVER_OUTPUT_BUFFER_BYTES,
};

/// Submission queue entries of the ring; completions are sized by the kernel from this.
pub const RING_ENTRIES: u32 = 1024;

pub fn run(listener: StdTcpListener, store: &'static Store) -> anyhow::Result<()> {
    let mut runtime = monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
        .with_entries(RING_ENTRIES)
        .build()
        .context("build monoio io_uring runtime")?;
    runtime.block_on(async move {
        let listener = TcpListener::from_std(listener)?;
        loop {
            let (stream, _) = listener.accept().await.context("accept")?;
            stream.set_nodelay(true)?;
            monoio::spawn(async move {
                if let Err(error) = serve(stream, store).await {
                    eprintln!("server-monoio: connection ended: {error:#}");
                }
            });
        }
    })
}

async fn serve(mut stream: TcpStream, store: &Store) -> anyhow::Result<()> {
    let mut input: Vec<u8> = Vec::with_capacity(SERVER_INPUT_BUFFER_BYTES);
    let mut output: Vec<u8> = Vec::with_capacity(SERVER_OUTPUT_BUFFER_BYTES);
    let mut target = TargetConnection::new();
    loop {
        let filled = input.len();
        assert!(filled < input.capacity());
        // The read lands in the free tail [filled, capacity) and extends `input`'s length.
        let (result, tail) = stream.read(input.slice_mut(filled..)).await;
        input = tail.into_inner();
        match result {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
            Err(error) => return Err(error.into()),
        }
        assert!(input.len() > filled && input.capacity() == SERVER_INPUT_BUFFER_BYTES);
        loop {
            let consumed = target.process(&input, store, &mut output)?;
            if consumed == 0 {
                break;
            }
            input.copy_within(consumed.., 0);
            input.truncate(input.len() - consumed);
            let (result, written) = stream.write_all(output).await;
            output = written;
            result?;
            output.clear();
        }
    }
}
