//! Runtime spike: decides Ferrite's data-path runtime by measurement. One binary with three
//! subcommands: `server` (tokio current_thread, tokio multi_thread with one worker, or monoio on
//! io_uring), `client` (the load generator, the same for every server) and `table` (turns the
//! results file written by run.sh into a markdown table of medians).

mod client;
mod protocol;
mod server_monoio;
mod server_tokio;
mod system;
mod table;

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpListener;
use std::time::Duration;

use anyhow::{bail, Context};

const USAGE: &str = "usage:
  runtime-spike server --runtime tokio-ct|tokio-mt|monoio [--address 127.0.0.1:0] [--cpu N]
  runtime-spike client --address HOST:PORT --connections N --queue-depth N
                       [--warmup-s 3] [--measure-s 10] [--server-pid PID] [--cpu N]
  runtime-spike table RESULTS_TSV";

/// `--name value` pairs after the subcommand.
fn options(arguments: &[String]) -> anyhow::Result<HashMap<String, String>> {
    if !arguments.len().is_multiple_of(2) {
        bail!("options come in `--name value` pairs\n{USAGE}");
    }
    let mut options = HashMap::new();
    for pair in arguments.chunks_exact(2) {
        let Some(name) = pair[0].strip_prefix("--") else {
            bail!("unexpected {}\n{USAGE}", pair[0])
        };
        options.insert(name.to_string(), pair[1].clone());
    }
    Ok(options)
}

fn option<T: std::str::FromStr>(
    options: &HashMap<String, String>,
    name: &str,
    default: Option<T>,
) -> anyhow::Result<T>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    match (options.get(name), default) {
        (Some(value), _) => value.parse().with_context(|| format!("--{name} {value}")),
        (None, Some(default)) => Ok(default),
        (None, None) => bail!("--{name} is required\n{USAGE}"),
    }
}

fn main() -> anyhow::Result<()> {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    let Some(command) = arguments.first() else { bail!("{USAGE}") };
    if command == "table" {
        let Some(path) = arguments.get(1) else { bail!("{USAGE}") };
        let results = std::fs::read_to_string(path).with_context(|| format!("read {path}"))?;
        print!("{}", table::markdown(&results)?);
        return Ok(());
    }
    let options = options(&arguments[1..])?;
    if let Some(cpu) = options.get("cpu") {
        system::pin_to_cpu(cpu.parse().context("--cpu")?)?;
    }
    match command.as_str() {
        "server" => {
            let runtime: String = option(&options, "runtime", None)?;
            let address: String = option(&options, "address", Some("127.0.0.1:0".to_string()))?;
            let listener =
                TcpListener::bind(&address).with_context(|| format!("bind {address}"))?;
            // Leaked on purpose: the store lives as long as the server process.
            let store: &'static protocol::Store = Box::leak(Box::new(protocol::Store::new()));
            println!("listening on {}", listener.local_addr()?);
            std::io::stdout().flush()?;
            match runtime.as_str() {
                "tokio-ct" => {
                    server_tokio::run(server_tokio::Flavor::CurrentThread, listener, store)
                }
                "tokio-mt" => {
                    server_tokio::run(server_tokio::Flavor::MultiThreadOneWorker, listener, store)
                }
                "monoio" => server_monoio::run(listener, store),
                other => bail!("unknown runtime {other}\n{USAGE}"),
            }
        }
        "client" => {
            let config = client::Config {
                address: option(&options, "address", None)?,
                connections: option(&options, "connections", None)?,
                queue_depth: option(&options, "queue-depth", None)?,
                warmup: Duration::from_secs(option(&options, "warmup-s", Some(3))?),
                measure: Duration::from_secs(option(&options, "measure-s", Some(10))?),
                server_pid: options.get("server-pid").map(|pid| pid.parse()).transpose()?,
            };
            if !(1..=client::CONNECTIONS_MAX).contains(&config.connections)
                || !(1..=client::QUEUE_DEPTH_MAX).contains(&config.queue_depth)
            {
                bail!(
                    "--connections must be 1..={} and --queue-depth 1..={}",
                    client::CONNECTIONS_MAX,
                    client::QUEUE_DEPTH_MAX
                );
            }
            let summary = client::run(config)?;
            eprintln!("{} I/Os measured: {summary:?}", summary.ios);
            // One tab-separated line for run.sh: IOPS, p50, p99, p99.9, server CPU %, client
            // CPU %, steal %.
            println!(
                "{:.0}\t{:.1}\t{:.1}\t{:.1}\t{:.1}\t{:.1}\t{:.1}",
                summary.iops,
                summary.p50_us,
                summary.p99_us,
                summary.p999_us,
                summary.server_cpu_percent.unwrap_or(f64::NAN),
                summary.client_cpu_percent,
                summary.steal_percent
            );
            Ok(())
        }
        other => bail!("unknown command {other}\n{USAGE}"),
    }
}
