//! Durability under SIGKILL, end to end with the real binaries: `ferrite bench --verify` writes
//! self-checking blocks to a volume while the test kills `ferrite up` with SIGKILL at a random
//! moment; after a restart on the same data dir, `ferrite bench --check` reads back every block
//! of the saved verify map. Every acknowledged write must be there intact; a write cut off by the
//! kill may hold its old or its new content but nothing else (no torn block). Blocks the bench
//! never writes - the rest of the volume and a second volume, filled with patterns before the
//! first kill - must not change at all. The kill/restart cycle repeats with a new map each round.
//!
//! `FERRITE_KILL9_ROUNDS` sets the number of rounds (default 5, about 25 s);
//! `FERRITE_KILL9_SEED` replays the kill delays of an earlier run (the seed is printed).

mod common;

use common::{
    assert_no_error_lines, ferrite_ok, free_port, pattern, pattern_mismatch, runtime, volume_nqn,
    ChildGuard, Node, BLOCK_BYTES, FERRITE,
};
use initiator::{AlignedBuf, ConnectOptions, Controller};
use rand::{Rng as _, SeedableRng as _};
use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROUNDS_DEFAULT: u32 = 5;
/// The kill comes this long after the bench starts (uniformly drawn).
const KILL_DELAY_MS_MIN: u64 = 1000;
const KILL_DELAY_MS_MAX: u64 = 3000;
/// The bench must notice the dead node and save its map within this time; the check of a map
/// must finish within it too.
const BENCH_EXIT_TIMEOUT: Duration = Duration::from_secs(60);
/// The volume the bench writes: its first half is the bench's region, its second half a
/// sentinel region the bench never touches.
const VOLUME: &str = "crash";
const VOLUME_SIZE: &str = "128M";
const VOLUME_BYTES: u64 = 128 << 20;
const BENCH_REGION: &str = "64M";
const BENCH_REGION_BYTES: u64 = 64 << 20;
/// A second volume, filled with a pattern once and never written again.
const OTHER_VOLUME: &str = "bystander";
const OTHER_VOLUME_SIZE: &str = "64M";
const OTHER_VOLUME_BYTES: u64 = 64 << 20;
/// Sentinel patterns are written and read in pieces of this size.
const SENTINEL_IO_BYTES: usize = 1 << 20;
const SENTINEL_TAG: u64 = 0x5E47_1E10;

/// The sentinel ranges: (volume, first byte, end byte).
const SENTINELS: [(&str, u64, u64); 2] =
    [(VOLUME, BENCH_REGION_BYTES, VOLUME_BYTES), (OTHER_VOLUME, 0, OTHER_VOLUME_BYTES)];

#[test]
fn acknowledged_writes_survive_sigkill_of_the_node() {
    let rounds: u32 = std::env::var("FERRITE_KILL9_ROUNDS")
        .ok()
        .map(|text| text.parse().expect("FERRITE_KILL9_ROUNDS is a number"))
        .unwrap_or(ROUNDS_DEFAULT);
    assert!(rounds >= 1, "FERRITE_KILL9_ROUNDS must be at least 1");
    let seed: u64 = std::env::var("FERRITE_KILL9_SEED")
        .ok()
        .map(|text| text.parse().expect("FERRITE_KILL9_SEED is a number"))
        .unwrap_or_else(rand::random);
    eprintln!("kill9: {rounds} rounds, FERRITE_KILL9_SEED={seed}");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);

    let dir = tempfile::tempdir().expect("temp dir");
    let data_dir = dir.path().join("data");
    let nvme_port = free_port();
    let target = format!("nvme+tcp://127.0.0.1:{nvme_port}/{}", volume_nqn(VOLUME));
    let rt = runtime();

    let mut node = Node::start(&data_dir, nvme_port);
    ferrite_ok(&node.api_url, &["volume", "create", VOLUME, "--size", VOLUME_SIZE]);
    ferrite_ok(&node.api_url, &["volume", "create", OTHER_VOLUME, "--size", OTHER_VOLUME_SIZE]);
    rt.block_on(write_sentinels(&node.nvme_address()));
    let volumes_before = common::volume_list(&node.api_url);

    let started = Instant::now();
    for round in 0..rounds {
        let map = dir.path().join(format!("round-{round}.vmap"));
        // Even rounds: the kill lands in 4k_randwrite. Odd rounds: each workload runs 2 s, so
        // it lands in 4k_randwrite or in 8k_randrw_80_20.
        let runtime_s = if round % 2 == 0 { "30" } else { "2" };
        let delay = Duration::from_millis(rng.random_range(KILL_DELAY_MS_MIN..=KILL_DELAY_MS_MAX));
        let bench_out = dir.path().join(format!("round-{round}.bench.out"));
        let bench_err = dir.path().join(format!("round-{round}.bench.err"));
        let mut bench = spawn_ferrite(
            &[
                "bench",
                "--target",
                &target,
                "--workloads",
                "4k_randwrite,8k_randrw_80_20",
                "--verify",
                "--verify-map",
                path_str(&map),
                "--runtime",
                runtime_s,
                "--ramp",
                "0",
                "--size",
                BENCH_REGION,
                "--quiet",
            ],
            &bench_out,
            &bench_err,
        );
        std::thread::sleep(delay);
        let bench_early_exit = bench.0.try_wait().expect("try_wait on the bench");
        let killed = node.signal_and_wait(libc::SIGKILL);
        assert_eq!(
            killed.status.signal(),
            Some(libc::SIGKILL),
            "round {round}: the node did not die of SIGKILL: {}",
            killed.status
        );
        assert_no_error_lines(&killed.stderr, &[], &format!("round {round}, killed node"));

        let status = bench
            .wait_timeout(BENCH_EXIT_TIMEOUT)
            .unwrap_or_else(|| panic!("round {round}: the bench hung after the node was killed"));
        let bench_stderr = std::fs::read_to_string(&bench_err).unwrap_or_default();
        assert!(
            bench_early_exit.is_none(),
            "round {round}: the bench ended before the kill ({status}): {bench_stderr}"
        );
        assert!(
            !status.success(),
            "round {round}: the bench succeeded although its node was killed mid-run"
        );
        let written = saved_block_count(&bench_stderr).unwrap_or_else(|| {
            panic!("round {round}: the failed bench did not save its verify map: {bench_stderr}")
        });
        assert!(map.exists(), "round {round}: {} is missing", map.display());
        assert!(written > 0, "round {round}: the kill came before any write: {bench_stderr}");

        node = Node::start(&data_dir, nvme_port);
        let check = check_map(&target, &map, dir.path(), round);
        eprintln!(
            "kill9 round {round}: killed after {delay:?} (runtime {runtime_s} s), {written} \
             blocks in the map; {}",
            check.trim()
        );
        rt.block_on(check_sentinels(&node.nvme_address(), round));
        assert_eq!(
            common::volume_list(&node.api_url),
            volumes_before,
            "round {round}: the volumes changed across the kill"
        );
    }
    let stderr = node.stop_cleanly();
    assert_no_error_lines(&stderr, &[], "last restart");
    eprintln!("kill9: {rounds} rounds in {:?}", started.elapsed());
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

/// Starts `ferrite ARGS` with its stdout and stderr in files (no pipe to fill up).
fn spawn_ferrite(args: &[&str], stdout: &Path, stderr: &Path) -> ChildGuard {
    let child = Command::new(FERRITE)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(stdout).expect("create stdout file"))
        .stderr(std::fs::File::create(stderr).expect("create stderr file"))
        .spawn()
        .expect("spawn ferrite");
    ChildGuard(child)
}

/// The block count of "verify map: N blocks written, saved to ..." on the bench's stderr.
fn saved_block_count(stderr: &str) -> Option<u64> {
    let line =
        stderr.lines().find(|line| line.starts_with("verify map:") && line.contains("saved to"))?;
    line.strip_prefix("verify map: ")?.split_whitespace().next()?.parse().ok()
}

/// Runs `ferrite bench --check MAP`, which must succeed; returns its stdout.
fn check_map(target: &str, map: &Path, dir: &Path, round: u32) -> String {
    let out = dir.join(format!("round-{round}.check.out"));
    let err = dir.join(format!("round-{round}.check.err"));
    let mut check = spawn_ferrite(
        &["bench", "--target", target, "--check", path_str(map), "--quiet"],
        &out,
        &err,
    );
    let status = check
        .wait_timeout(BENCH_EXIT_TIMEOUT)
        .unwrap_or_else(|| panic!("round {round}: `ferrite bench --check` hung"));
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(
        status.success(),
        "round {round}: acknowledged writes did not survive SIGKILL ({status}):\n{stdout}{stderr}"
    );
    assert!(stdout.contains(" 0 mismatches, 0 read errors"), "round {round}: {stdout}{stderr}");
    stdout
}

async fn connect(address: &str, volume: &str) -> Controller {
    Controller::connect(address, &volume_nqn(volume), ConnectOptions::default())
        .await
        .unwrap_or_else(|error| panic!("connect to volume {volume}: {error}"))
}

async fn write_sentinels(address: &str) {
    for (volume, start, end) in SENTINELS {
        let controller = connect(address, volume).await;
        let mut queue = controller.open_io_queue(4).await.expect("open an I/O queue");
        for offset in (start..end).step_by(SENTINEL_IO_BYTES) {
            let lba = offset / BLOCK_BYTES as u64;
            let buffer = pattern(lba, SENTINEL_IO_BYTES / BLOCK_BYTES, SENTINEL_TAG);
            queue.write(lba, buffer).await.unwrap_or_else(|error| {
                panic!("write the sentinel of {volume} at LBA {lba}: {error}")
            });
        }
        drop(queue);
        controller.shutdown().await.expect("shut the controller down");
    }
}

/// Reads every sentinel block back: a write the bench had in flight at the kill must not have
/// landed anywhere outside its own block.
async fn check_sentinels(address: &str, round: u32) {
    for (volume, start, end) in SENTINELS {
        let controller = connect(address, volume).await;
        let mut queue = controller.open_io_queue(4).await.expect("open an I/O queue");
        for offset in (start..end).step_by(SENTINEL_IO_BYTES) {
            let lba = offset / BLOCK_BYTES as u64;
            let buffer = queue
                .read(lba, AlignedBuf::new(SENTINEL_IO_BYTES))
                .await
                .unwrap_or_else(|error| panic!("read {volume} at LBA {lba}: {error}"));
            if let Some(mismatch) = pattern_mismatch(&buffer, lba, SENTINEL_TAG) {
                panic!(
                    "round {round}: a block the bench never wrote changed in {volume}: {mismatch}"
                );
            }
        }
        drop(queue);
        controller.shutdown().await.expect("shut the controller down");
    }
}
