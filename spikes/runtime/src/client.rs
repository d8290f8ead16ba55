//! Load generator: N connections, each keeping `queue_depth` 4 KiB random reads in flight,
//! pipelined, on one tokio current_thread runtime. The same client drives every server.
//!
//! Hot path. Each connection reads responses in large chunks, handles every whole PDU in the
//! chunk, re-issues a read for each completion into one output buffer and writes that buffer
//! once. Latency is taken per I/O from the issue to the read that delivered its completion.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::protocol::{
    check_ic_resp, parse_response, push_ic_req, push_read_command, ProtocolError, Response,
    CAPSULE_CMD_BYTES, IC_PDU_BYTES, PDU_BYTES_MAX, STORE_BLOCKS,
};
use crate::system::{process_cpu_seconds, steal_seconds};

pub const CONNECTIONS_MAX: usize = 64;
pub const QUEUE_DEPTH_MAX: usize = 128;
/// Reads from the server land here; room for a whole queue's worth of responses.
pub const CLIENT_INPUT_BUFFER_BYTES: usize = 256 << 10;
/// LBAs are drawn from this space; the server folds them onto its store.
pub const LBA_SPACE: u64 = 1 << 32;
/// Latencies are recorded in nanoseconds up to this bound (larger ones saturate).
pub const LATENCY_NS_MAX: u64 = 10_000_000_000;

const _: () = assert!(CLIENT_INPUT_BUFFER_BYTES >= 2 * PDU_BYTES_MAX);

#[derive(Debug, Clone)]
pub struct Config {
    pub address: SocketAddr,
    pub connections: usize,
    pub queue_depth: usize,
    pub warmup: Duration,
    pub measure: Duration,
    /// The server process whose CPU time is sampled over the measurement window.
    pub server_pid: Option<u32>,
}

#[derive(Debug)]
pub struct Summary {
    pub iops: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub server_cpu_percent: Option<f64>,
    pub client_cpu_percent: f64,
    /// Hypervisor steal over the window, in percent of the whole machine's CPU time.
    pub steal_percent: f64,
    pub ios: u64,
}

/// Time boundaries shared (by copy) by all connections.
#[derive(Debug, Clone, Copy)]
struct Window {
    start: Instant,
    end: Instant,
}

struct ConnectionOutcome {
    latencies_ns: Histogram<u64>,
    ios: u64,
}

pub fn run(config: Config) -> anyhow::Result<Summary> {
    assert!((1..=CONNECTIONS_MAX).contains(&config.connections));
    assert!((1..=QUEUE_DEPTH_MAX).contains(&config.queue_depth));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let begin = Instant::now();
        let window =
            Window { start: begin + config.warmup, end: begin + config.warmup + config.measure };
        let mut tasks = Vec::with_capacity(config.connections);
        for connection in 0..config.connections {
            let seed = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(connection as u64 + 1);
            tasks.push(tokio::spawn(drive_connection(config.clone(), window, seed)));
        }
        let server_pid = config.server_pid;
        let sampler = tokio::spawn(async move {
            tokio::time::sleep_until(window.start.into()).await;
            let before = sample_cpu(server_pid)?;
            tokio::time::sleep_until(window.end.into()).await;
            let after = sample_cpu(server_pid)?;
            anyhow::Ok((before, after))
        });
        let mut latencies_ns = Histogram::<u64>::new_with_bounds(1, LATENCY_NS_MAX, 3)?;
        let mut ios = 0;
        for task in tasks {
            let outcome = task.await??;
            latencies_ns.add(&outcome.latencies_ns)?;
            ios += outcome.ios;
        }
        let (before, after) = sampler.await??;
        let seconds = config.measure.as_secs_f64();
        let percentile_us = |q: f64| latencies_ns.value_at_quantile(q) as f64 / 1000.0;
        Ok(Summary {
            iops: ios as f64 / seconds,
            p50_us: percentile_us(0.5),
            p99_us: percentile_us(0.99),
            p999_us: percentile_us(0.999),
            server_cpu_percent: before
                .server
                .zip(after.server)
                .map(|(before, after)| 100.0 * (after - before) / seconds),
            client_cpu_percent: 100.0 * (after.client - before.client) / seconds,
            steal_percent: 100.0 * (after.steal - before.steal)
                / (seconds * crate::system::cpus_online() as f64),
            ios,
        })
    })
}

/// CPU seconds so far: of the server (if known), of this process and stolen by the hypervisor.
struct CpuSample {
    server: Option<f64>,
    client: f64,
    steal: f64,
}

fn sample_cpu(server_pid: Option<u32>) -> anyhow::Result<CpuSample> {
    Ok(CpuSample {
        server: server_pid.map(process_cpu_seconds).transpose()?,
        client: process_cpu_seconds(std::process::id())?,
        steal: steal_seconds()?,
    })
}

/// xorshift64*: a few instructions per LBA, deterministic per connection.
struct Lbas {
    state: u64,
}

impl Lbas {
    fn next(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) % LBA_SPACE
    }
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    lba: u64,
    issued_at: Instant,
    in_flight: bool,
    data_received: bool,
}

async fn drive_connection(
    config: Config,
    window: Window,
    seed: u64,
) -> anyhow::Result<ConnectionOutcome> {
    let mut stream = TcpStream::connect(config.address)
        .await
        .with_context(|| format!("connect to {}", config.address))?;
    stream.set_nodelay(true)?;
    let mut output = Vec::with_capacity(IC_PDU_BYTES.max(config.queue_depth * CAPSULE_CMD_BYTES));
    push_ic_req(&mut output);
    stream.write_all(&output).await?;
    output.clear();
    let mut ic_resp = [0u8; IC_PDU_BYTES];
    stream.read_exact(&mut ic_resp).await.context("read ICResp")?;
    check_ic_resp(&ic_resp)?;

    let mut lbas = Lbas { state: seed | 1 };
    let now = Instant::now();
    let mut slots = Vec::with_capacity(config.queue_depth);
    for command_id in 0..config.queue_depth {
        let lba = lbas.next();
        push_read_command(&mut output, command_id as u16, lba);
        slots.push(Slot { lba, issued_at: now, in_flight: true, data_received: false });
    }
    stream.write_all(&output).await?;
    output.clear();
    let mut in_flight = config.queue_depth;

    let mut latencies_ns = Histogram::<u64>::new_with_bounds(1, LATENCY_NS_MAX, 3)?;
    let mut ios = 0u64;
    let mut input: Vec<u8> = Vec::with_capacity(CLIENT_INPUT_BUFFER_BYTES);
    while in_flight > 0 {
        assert!(input.len() < input.capacity());
        if stream.read_buf(&mut input).await? == 0 {
            bail!("server closed the connection with {in_flight} reads in flight");
        }
        let now = Instant::now();
        let stopping = now >= window.end;
        let mut offset = 0;
        while let Some((response, length)) = parse_response(&input[offset..])? {
            offset += length;
            match response {
                Response::Data { command_id, first_word } => {
                    let slot = slot_in_flight(&mut slots, command_id)?;
                    if slot.data_received {
                        return Err(ProtocolError::CommandIdUnexpected { command_id }.into());
                    }
                    if first_word != slot.lba % STORE_BLOCKS {
                        return Err(
                            ProtocolError::DataMismatch { command_id, lba: slot.lba }.into()
                        );
                    }
                    slot.data_received = true;
                }
                Response::Completion { command_id, status } => {
                    let slot = slot_in_flight(&mut slots, command_id)?;
                    if !slot.data_received {
                        return Err(ProtocolError::CommandIdUnexpected { command_id }.into());
                    }
                    if status != 0 {
                        return Err(
                            ProtocolError::CompletionStatusError { command_id, status }.into()
                        );
                    }
                    if slot.issued_at >= window.start && now < window.end {
                        let latency_ns = (now - slot.issued_at).as_nanos() as u64;
                        latencies_ns.saturating_record(latency_ns);
                        ios += 1;
                    }
                    if stopping {
                        slot.in_flight = false;
                        in_flight -= 1;
                    } else {
                        let lba = lbas.next();
                        push_read_command(&mut output, command_id, lba);
                        *slot = Slot { lba, issued_at: now, in_flight: true, data_received: false };
                    }
                }
            }
        }
        input.copy_within(offset.., 0);
        input.truncate(input.len() - offset);
        if !output.is_empty() {
            stream.write_all(&output).await?;
            output.clear();
        }
    }
    Ok(ConnectionOutcome { latencies_ns, ios })
}

fn slot_in_flight(slots: &mut [Slot], command_id: u16) -> Result<&mut Slot, ProtocolError> {
    match slots.get_mut(usize::from(command_id)) {
        Some(slot) if slot.in_flight => Ok(slot),
        _ => Err(ProtocolError::CommandIdUnexpected { command_id }),
    }
}
