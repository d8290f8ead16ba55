//! `ferrite bench`'s command line: the clap arguments, their help, and [`run_command`], which does
//! everything the subcommand does once the caller has a connector for the target, so the `cli`
//! crate only parses and dispatches.

use std::path::PathBuf;
use std::time::Duration;

use engine::erasure::ErasureScheme;
use types::ByteSize;

use crate::local::EngineSetup;
use crate::output::{render_table, write_json_lines};
use crate::run::{
    run_keeping_map, BenchConfig, CheckOptions, WorkloadReport, QUEUE_COUNT_MAX, QUEUE_DEPTH_MAX,
};
use crate::target::Connector;
use crate::url::{NvmeTcpTarget, TargetUrl};
use crate::verify::VerifyMap;
use crate::{BenchError, Workload, STANDARD_WORKLOADS};

const AFTER_HELP: &str = "\
Examples:
  ferrite bench --target nvme+tcp://127.0.0.1:4420/nqn.2024-01.io.ferrite:vol:db-1
  ferrite bench --target nvme+tcp://127.0.0.1:4420/db-1 --fill --json results.jsonl
  ferrite bench --target nvme+tcp://127.0.0.1/db-1 --workloads 4k_randread,4k_randwrite --runtime 30
  ferrite bench --target nvme+tcp://127.0.0.1/db-1 --size 1G --verify --runtime 60
  ferrite bench --target engine:/var/tmp --size 2G --fill --workloads 4k_randwrite,4k_randread

Workloads (random offsets aligned to the I/O size, over the region given by --size):
  4k_randread        4 KiB reads
  4k_randwrite       4 KiB writes
  8k_randrw_80_20    8 KiB, 80% reads and 20% writes
  16k_randrw_70_30   16 KiB, 70% reads and 30% writes
  32k_randrw_50_50   32 KiB, 50% reads and 50% writes
These are the five workloads of the Lightbits-vs-Ceph study, named as in the Ceph anchor's
bench.sh, so results compare row by row. Each runs for --ramp seconds (not counted), then
--runtime seconds measured, with --queues queues of --iodepth requests each in flight.
Latencies are per I/O from submission to completion, all queues merged, in an HDR histogram.
Unwritten blocks of a thin volume read as zeros without touching a drive: use --fill for
read numbers that mean something on a fresh volume.

Verification (--verify):
  Every 4 KiB block written carries a header (a magic, its own LBA and a generation: this run's
  random seed and the block's write counter) and a payload derived from them. The bench remembers
  the generation of the last acknowledged write of each block and checks every block it reads:
  a wrong LBA, a stale or lost write, a block torn between two writes or garbage is a mismatch.
  Blocks not yet written in this run may hold zeros or an earlier run's blocks. Two I/Os never
  overlap in flight, so no read races a write. The first mismatches are printed with details and
  the command fails if there is any. --verify needs 4 bytes of RAM per 4 KiB of region.
  --verify-map FILE saves the acknowledged generations at the end, even when the run fails (a
  killed server); --check FILE later reads back every block written and checks it.

The engine alone (engine:DIR):
  Runs the log-structured engine inside the bench's own process, with no network: drive files
  (--drives x --drive-size) in a fresh directory under DIR, laid out first (written with zeros,
  as fio lays out its file, about a second per GiB; --sparse-drives skips it), the log
  formatted on them with --erasure-coding, one thin volume of --size (2G by default), --threads
  threads each with its own engine handle and io_uring ring as a node's data-path threads
  (queue i runs on thread i % threads), and the node's background GC and checkpoints on the
  first. Every write is durable when it completes, as on a node. This sets the engine beside
  fio on the same kind of raw files; the whole path through NVMe/TCP is measured against a
  running node. The directory is removed at the end, so --verify-map and --check do not apply.

Exit status: non-zero on a connection failure, a failed I/O command or a verify mismatch.";

/// The arguments of `ferrite bench`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    about = "Measure a volume with the five standard workloads (IOPS, MB/s, latency percentiles)",
    after_long_help = AFTER_HELP
)]
pub struct BenchArgs {
    /// The target: nvme+tcp://HOST:PORT/NQN
    ///
    /// The port defaults to 4420. A Ferrite volume name may stand for its NQN, as in
    /// nvme+tcp://127.0.0.1:4420/db-1. nbd://HOST:PORT/EXPORT comes with the NBD frontend.
    #[arg(long, value_name = "URL", value_parser = parse_target)]
    pub target: TargetUrl,

    /// Requests in flight per queue.
    #[arg(long, value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u16).range(1..=i64::from(QUEUE_DEPTH_MAX)))]
    pub iodepth: u16,

    /// Number of I/O queues
    ///
    /// Each is one TCP connection; the requests in flight are --queues x --iodepth.
    #[arg(long, value_name = "N", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=i64::from(QUEUE_COUNT_MAX)))]
    pub queues: u16,

    /// Seconds each workload runs before its measured window (not counted).
    #[arg(long, value_name = "SECONDS", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub ramp: u64,

    /// Seconds of each workload's measured window.
    #[arg(long, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub runtime: u64,

    /// Comma-separated workloads to run, in order [default: all five]
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = Workload::from_name)]
    pub workloads: Vec<Workload>,

    /// Bytes of the volume to use, from its start (for example 10G) [default: the whole namespace]
    #[arg(long, value_name = "SIZE")]
    pub size: Option<ByteSize>,

    /// First write the whole region sequentially (128 KiB writes), so reads hit written data.
    #[arg(long)]
    pub fill: bool,

    /// Write self-checking blocks and check every byte read (details in --help).
    #[arg(long)]
    pub verify: bool,

    /// Also write the results as JSON lines, one object per workload, to FILE (replaced).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Seed of the random offsets and read/write choices, to repeat a run's I/O pattern.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,

    /// With --verify: save the generations of acknowledged writes to FILE at the end.
    #[arg(long, value_name = "FILE", requires = "verify")]
    pub verify_map: Option<PathBuf>,

    /// Run no workload: read back every block recorded in FILE (from --verify-map) and check it.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["verify", "fill", "workloads", "verify_map"])]
    pub check: Option<PathBuf>,

    /// No progress line on stderr (the table and errors still print).
    #[arg(long)]
    pub quiet: bool,

    /// engine:DIR only: how many drive files [default: 4]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub drives: Option<u16>,

    /// engine:DIR only: the size of each drive file [default: 16G]
    #[arg(long, value_name = "SIZE")]
    pub drive_size: Option<ByteSize>,

    /// engine:DIR only: parity across the drives, K+M or none [default: none]
    #[arg(long, value_name = "K+M|none", value_parser = parse_erasure)]
    pub erasure_coding: Option<ErasureScheme>,

    /// engine:DIR only: threads serving the engine, as a node's --data-threads [default: one
    /// per CPU]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub threads: Option<u16>,

    /// engine:DIR only: leave the drive files sparse instead of laying them out first
    #[arg(long)]
    pub sparse_drives: bool,

    /// engine:DIR only: no read-triggered defragmentation (as `ferrite up --read-defrag off`)
    #[arg(long)]
    pub no_read_defrag: bool,
}

/// The drive files of an `engine:DIR` run when not given.
const ENGINE_DRIVES_DEFAULT: u16 = 4;
const ENGINE_DRIVE_SIZE_DEFAULT: u64 = 16 << 30;
const ENGINE_VOLUME_SIZE_DEFAULT: u64 = 2 << 30;

fn parse_erasure(text: &str) -> Result<ErasureScheme, String> {
    text.parse::<ErasureScheme>().map_err(|error| error.to_string())
}

fn parse_target(text: &str) -> Result<TargetUrl, String> {
    text.parse::<TargetUrl>().map_err(|error| error.reason)
}

impl BenchArgs {
    /// The NVMe/TCP target to connect to, or why there is none to connect to yet.
    pub fn nvme_tcp_target(&self) -> Result<&NvmeTcpTarget, BenchError> {
        match &self.target {
            TargetUrl::NvmeTcp(target) => Ok(target),
            TargetUrl::Nbd(_) => Err(BenchError::NbdNotSupported),
            TargetUrl::Engine { .. } => Err(BenchError::InvalidConfig(
                "engine:DIR runs the engine in process, not over NVMe/TCP".to_owned(),
            )),
        }
    }

    /// For `engine:DIR`, the private node to set up; `None` for a remote target. Refuses the
    /// engine's options on a remote target and the options an engine run cannot honour.
    pub fn engine_setup(&self) -> Result<Option<EngineSetup>, BenchError> {
        let invalid = |message: &str| Err(BenchError::InvalidConfig(message.to_owned()));
        let TargetUrl::Engine { parent_dir } = &self.target else {
            let engine_only = self.drives.is_some()
                || self.drive_size.is_some()
                || self.erasure_coding.is_some()
                || self.threads.is_some()
                || self.sparse_drives
                || self.no_read_defrag;
            if engine_only {
                return invalid(
                    "--drives, --drive-size, --erasure-coding, --threads, --sparse-drives and \
                     --no-read-defrag apply to engine:DIR targets only",
                );
            }
            return Ok(None);
        };
        if self.check.is_some() || self.verify_map.is_some() {
            return invalid(
                "an engine:DIR run removes its drive files at the end; --verify-map and --check \
                 need a target that outlives the run",
            );
        }
        Ok(Some(EngineSetup {
            parent_dir: parent_dir.clone(),
            drive_count: self.drives.unwrap_or(ENGINE_DRIVES_DEFAULT),
            drive_size_bytes: self.drive_size.map_or(ENGINE_DRIVE_SIZE_DEFAULT, ByteSize::bytes),
            erasure: self.erasure_coding.unwrap_or(ErasureScheme::NONE),
            volume_size_bytes: self.size.map_or(ENGINE_VOLUME_SIZE_DEFAULT, ByteSize::bytes),
            threads: self.threads.unwrap_or_else(|| {
                let cpus = std::thread::available_parallelism().map_or(1, usize::from);
                u16::try_from(cpus).unwrap_or(u16::MAX).clamp(1, 64)
            }),
            lay_out: !self.sparse_drives,
            read_defrag: !self.no_read_defrag,
        }))
    }

    pub fn to_config(&self) -> BenchConfig {
        BenchConfig {
            workloads: if self.workloads.is_empty() {
                STANDARD_WORKLOADS.to_vec()
            } else {
                self.workloads.clone()
            },
            queue_count: self.queues,
            queue_depth: self.iodepth,
            ramp: Duration::from_secs(self.ramp),
            runtime: Duration::from_secs(self.runtime),
            region_size_bytes: self.size.map(ByteSize::bytes),
            fill: self.fill,
            verify: self.verify,
            seed: self.seed,
            progress: !self.quiet,
        }
    }
}

/// Everything `ferrite bench` does, given a connector for `args.target`: runs the workloads (or
/// the `--check`), prints the table on stdout, writes `--json` and `--verify-map`, prints the
/// first mismatches on stderr, and returns an error - for a non-zero exit - on any I/O error or
/// mismatch, after all output is written. Run it on a current-thread tokio runtime with time
/// enabled.
pub async fn run_command<C: Connector>(
    args: &BenchArgs,
    connector: &mut C,
) -> Result<Vec<WorkloadReport>, BenchError> {
    if let TargetUrl::Nbd(_) = args.target {
        return Err(BenchError::NbdNotSupported);
    }
    args.engine_setup()?;
    if let Some(path) = &args.check {
        return check_command(args, connector, path).await.map(|()| Vec::new());
    }
    let config = args.to_config();
    config.validate()?;
    let mut map = None;
    let result = run_keeping_map(&config, connector, &mut map).await;
    if let (Some(path), Some(map)) = (&args.verify_map, &map) {
        match map.save(path) {
            Ok(()) => eprintln!(
                "verify map: {} blocks written, saved to {} (read back with --check)",
                map.written_block_count(),
                path.display()
            ),
            Err(error) if result.is_ok() => return Err(error),
            Err(error) => eprintln!("{error}"),
        }
    }
    let reports = result?;
    print!("{}", render_table(&reports));
    if let Some(path) = &args.json {
        let output_error = |source| BenchError::Output { path: path.clone(), source };
        let mut file = std::fs::File::create(path).map_err(output_error)?;
        write_json_lines(&mut file, &args.target.to_string(), &reports).map_err(output_error)?;
    }
    for report in &reports {
        for mismatch in &report.mismatch_examples {
            eprintln!("verify mismatch in {}: {mismatch}", report.workload);
        }
    }
    let mismatches: u64 = reports.iter().map(|r| r.verify_mismatches).sum();
    if mismatches > 0 {
        return Err(BenchError::VerifyFailed { mismatches });
    }
    let errors: u64 = reports.iter().map(|r| r.errors).sum();
    if errors > 0 {
        let first_status = reports.iter().find_map(|r| r.first_error_status).unwrap_or(0);
        return Err(BenchError::IoErrors { errors, first_status });
    }
    Ok(reports)
}

async fn check_command<C: Connector>(
    args: &BenchArgs,
    connector: &mut C,
    path: &std::path::Path,
) -> Result<(), BenchError> {
    let map = VerifyMap::load(path)?;
    let options =
        CheckOptions { queue_count: args.queues, queue_depth: args.iodepth, progress: !args.quiet };
    let report = map.check_all(connector, &options).await?;
    println!(
        "check: {} blocks read back, {} mismatches, {} read errors",
        report.blocks_checked, report.mismatches, report.errors
    );
    for mismatch in &report.mismatch_examples {
        eprintln!("verify mismatch: {mismatch}");
    }
    if report.mismatches > 0 {
        return Err(BenchError::VerifyFailed { mismatches: report.mismatches });
    }
    if report.errors > 0 {
        let first_status = report.first_error_status.unwrap_or(0);
        return Err(BenchError::IoErrors { errors: report.errors, first_status });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    #[command(name = "bench")]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(line: &str) -> Result<BenchArgs, clap::Error> {
        Cli::try_parse_from(line.split_whitespace()).map(|cli| cli.args)
    }

    #[test]
    fn defaults_match_the_issue() {
        let args = parse("bench --target nvme+tcp://127.0.0.1:4420/db-1").unwrap();
        let config = args.to_config();
        assert_eq!(config.queue_depth, 32);
        assert_eq!(config.queue_count, 4);
        assert_eq!(config.ramp, Duration::from_secs(2));
        assert_eq!(config.runtime, Duration::from_secs(10));
        assert_eq!(config.workloads, STANDARD_WORKLOADS.to_vec());
        assert_eq!(config.region_size_bytes, None);
        assert!(!config.fill && !config.verify && config.progress);
        assert_eq!(args.nvme_tcp_target().unwrap().nqn.as_str(), "nqn.2024-01.io.ferrite:vol:db-1");
    }

    #[test]
    fn flags_parse() {
        let args = parse(
            "bench --target nvme+tcp://10.0.0.1:4420/db-1 --iodepth 8 --queues 2 --ramp 0 \
             --runtime 30 --workloads 32k_randrw_50_50,4k_randread --size 1G --fill --verify \
             --json out.jsonl --seed 7 --verify-map run.vmap --quiet",
        )
        .unwrap();
        let config = args.to_config();
        assert_eq!((config.queue_depth, config.queue_count), (8, 2));
        assert_eq!(config.workloads, vec![STANDARD_WORKLOADS[4], STANDARD_WORKLOADS[0]]);
        assert_eq!(config.region_size_bytes, Some(1 << 30));
        assert_eq!(config.ramp, Duration::ZERO);
        assert!(config.fill && config.verify && !config.progress);
        assert_eq!(config.seed, Some(7));
        assert_eq!(args.json, Some(PathBuf::from("out.jsonl")));
        assert_eq!(args.verify_map, Some(PathBuf::from("run.vmap")));
    }

    #[test]
    fn bad_flags_are_refused_with_reasons() {
        let error = |line: &str| parse(line).unwrap_err().to_string();
        let target = "--target nvme+tcp://127.0.0.1/db-1";
        assert!(
            error(&format!("bench {target} --workloads 4k_seqread")).contains("the workloads are")
        );
        assert!(error(&format!("bench {target} --iodepth 0")).contains("--iodepth"));
        assert!(error(&format!("bench {target} --queues 65")).contains("--queues"));
        assert!(error(&format!("bench {target} --runtime 0")).contains("--runtime"));
        assert!(error(&format!("bench {target} --size 10X")).contains("invalid size"));
        assert!(error(&format!("bench {target} --verify-map m")).contains("--verify"));
        assert!(error(&format!("bench {target} --check m --fill")).contains("cannot be used with"));
        assert!(error("bench --target http://x/db").contains("unsupported scheme"));
        assert!(error("bench").contains("--target"));

        let nbd = parse("bench --target nbd://127.0.0.1:10809/db-1").unwrap();
        let refusal = nbd.nvme_tcp_target().unwrap_err().to_string();
        assert_eq!(refusal, "NBD targets arrive with the NBD frontend; use nvme+tcp:// for now");
    }

    #[test]
    fn help_explains_workloads_verify_and_examples() {
        let mut command = <Cli as clap::CommandFactory>::command();
        let help = command.render_long_help().to_string();
        for needle in [
            "Examples:",
            "ferrite bench --target nvme+tcp://127.0.0.1:4420/nqn.2024-01.io.ferrite:vol:db-1",
            "16k_randrw_70_30   16 KiB, 70% reads and 30% writes",
            "Verification (--verify):",
            "torn between two writes",
            "--iodepth <N>",
            "[default: 32]",
            "[default: all five]",
        ] {
            assert!(help.contains(needle), "help lacks {needle:?}:\n{help}");
        }
    }
}
