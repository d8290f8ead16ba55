//! The target on tokio, either one current_thread runtime (thread-per-core style) or a
//! multi_thread runtime with one worker (what a default tokio application would use).
//!
//! Hot path. Each connection reads into one reusable buffer, turns every whole PDU in it into
//! responses in one reusable output buffer (`TargetConnection::process`), and writes that buffer
//! with one call per batch. Nothing is allocated per I/O.

use std::net::TcpListener as StdTcpListener;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::protocol::{
    Store, TargetConnection, SERVER_INPUT_BUFFER_BYTES, SERVER_OUTPUT_BUFFER_BYTES,
};

#[derive(Debug, Clone, Copy)]
pub enum Flavor {
    CurrentThread,
    MultiThreadOneWorker,
}

pub fn run(flavor: Flavor, listener: StdTcpListener, store: &'static Store) -> anyhow::Result<()> {
    let runtime = match flavor {
        Flavor::CurrentThread => tokio::runtime::Builder::new_current_thread().enable_io().build(),
        Flavor::MultiThreadOneWorker => {
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_io().build()
        }
    }
    .context("build tokio runtime")?;
    runtime.block_on(async move {
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        loop {
            let (stream, _) = listener.accept().await.context("accept")?;
            stream.set_nodelay(true)?;
            tokio::spawn(async move {
                if let Err(error) = serve(stream, store).await {
                    eprintln!("server-tokio: connection ended: {error:#}");
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
        // `process` always consumes whole PDUs until fewer than one is left, and a PDU is far
        // smaller than the buffer, so there is always room to read into.
        assert!(input.len() < input.capacity());
        let read_bytes = match stream.read_buf(&mut input).await {
            Ok(0) => return Ok(()),
            Ok(read_bytes) => read_bytes,
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
            Err(error) => return Err(error.into()),
        };
        assert!(read_bytes > 0 && input.capacity() == SERVER_INPUT_BUFFER_BYTES);
        loop {
            let consumed = target.process(&input, store, &mut output)?;
            if consumed == 0 {
                break;
            }
            input.copy_within(consumed.., 0);
            input.truncate(input.len() - consumed);
            stream.write_all(&output).await?;
            output.clear();
        }
    }
}
