//! The `engine:DIR` target end to end through the public API, as `ferrite bench` drives it:
//! `BenchArgs` parsed by clap give the setup, [`EngineBench`] runs the log-structured engine in
//! this process on small drive files in a temporary directory, and [`run_command`] runs verified
//! workloads on it. Also what the target refuses (a volume larger than the drives, engine options
//! on a remote target, options that need the drives after the run) and what it leaves behind (a
//! laid-out drive is fully allocated; nothing is left once the bench is dropped).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use bench::local::{EngineBench, LocalError};
use bench::{run_command, BenchArgs, BenchError};
use clap::Parser;

const MIB: u64 = 1 << 20;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

fn args(line: &str) -> BenchArgs {
    Cli::try_parse_from(line.split_whitespace()).unwrap().args
}

/// Runs `body` inside a LocalSet on a current_thread runtime, as `ferrite bench` does.
fn on_local_set<F: std::future::Future>(body: F) -> F::Output {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    tokio::task::LocalSet::new().block_on(&runtime, body)
}

/// The setup of an engine target's command line; panics if the options are refused.
fn setup_of(line: &str) -> bench::local::EngineSetup {
    args(line).engine_setup().unwrap().expect("an engine:DIR target has a setup")
}

/// The entries of a directory (the drive directories an engine bench made in it).
fn entries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).unwrap().map(|entry| entry.unwrap().path()).collect()
}

/// A started bench, or a panic with the error (`EngineBench` has no `Debug` for `unwrap`).
async fn start(setup: &bench::local::EngineSetup) -> EngineBench {
    match EngineBench::start(setup).await {
        Ok(engine) => engine,
        Err(error) => panic!("the engine did not start: {error}"),
    }
}

#[test]
fn a_verified_run_on_two_threads_passes_and_the_directory_goes_with_the_bench() {
    let parent = tempfile::tempdir().unwrap();
    let line = format!(
        "bench --target engine:{} --drives 4 --drive-size 256M --sparse-drives --threads 2 \
         --size 64M --workloads 4k_randwrite,4k_randread,16k_randrw_70_30 --verify --queues 4 \
         --iodepth 8 \
         --runtime 1 --ramp 0 --quiet",
        parent.path().display()
    );
    let args = args(&line);
    let setup = args.engine_setup().unwrap().unwrap();
    assert_eq!((setup.drive_count, setup.drive_size_bytes, setup.threads), (4, 256 * MIB, 2));
    assert_eq!(setup.volume_size_bytes, 64 * MIB);
    assert!(!setup.lay_out);

    let drive_dir = on_local_set(async {
        let engine = start(&setup).await;
        let drive_dir = engine.dir().to_path_buf();
        assert_eq!(drive_dir.parent(), Some(parent.path()));
        assert!(drive_dir.is_dir());
        let result = run_command(&args, &mut engine.connector()).await;
        let reports = match result {
            Ok(reports) => reports,
            Err(error) => panic!("the verified run failed: {error}\n{}", engine.summary()),
        };
        assert_eq!(reports.len(), 3);
        assert_eq!(reports[0].workload.name, "4k_randwrite");
        assert_eq!(reports[1].workload.name, "4k_randread");
        assert_eq!(reports[2].workload.name, "16k_randrw_70_30");
        for report in &reports {
            let name = report.workload.name;
            assert!(report.verify, "{name}");
            assert_eq!(report.verify_mismatches, 0, "{name}: {:?}", report.mismatch_examples);
            assert_eq!(report.errors, 0, "{name}");
            assert!(report.iops() > 0.0, "{name}");
        }
        assert!(reports[0].write_ops > 0 && reports[0].read_ops == 0);
        assert!(reports[1].read_ops > 0 && reports[1].write_ops == 0);
        let stats = engine.engine().stats();
        assert!(stats.host_bytes_written >= reports[0].write_bytes, "{}", engine.summary());
        assert!(engine.summary().starts_with("engine: host wrote"), "{}", engine.summary());
        // The 16K reads found ranges the 4K writes scattered, and every byte they read back
        // afterwards (verified) was right: read-triggered defragmentation ran, on both threads'
        // handles, beside verified host writes.
        assert!(stats.defrag_relocated_blocks > 0, "{}", engine.summary());
        drive_dir
    });
    // The bench was dropped at the end of the block: its directory and drive files are gone.
    assert!(!drive_dir.exists(), "{} is left", drive_dir.display());
    assert!(entries(parent.path()).is_empty(), "{:?}", entries(parent.path()));
}

#[test]
fn a_volume_larger_than_the_drives_is_refused_and_leaves_nothing() {
    let parent = tempfile::tempdir().unwrap();
    let setup = setup_of(&format!(
        "bench --target engine:{} --drives 2 --drive-size 64M --sparse-drives --size 1G",
        parent.path().display()
    ));
    let error = on_local_set(async {
        match EngineBench::start(&setup).await {
            Ok(_) => panic!("a 1 GiB volume on 2 x 64 MiB drives was accepted"),
            Err(error) => error,
        }
    });
    let LocalError::TooLarge { size_bytes, capacity_bytes } = error else {
        panic!("not TooLarge: {error}");
    };
    assert_eq!(size_bytes, 1 << 30);
    assert!(capacity_bytes > 0 && capacity_bytes < 128 * MIB, "{capacity_bytes}");
    let message = error.to_string();
    assert!(message.contains(&capacity_bytes.to_string()), "{message}");
    assert!(message.contains("does not fit"), "{message}");
    assert!(entries(parent.path()).is_empty(), "{:?}", entries(parent.path()));
}

#[test]
fn engine_options_need_an_engine_target_and_the_engine_target_keeps_no_map() {
    let remote = "bench --target nvme+tcp://127.0.0.1:4420/db-1";
    for option in [
        "--drives 2",
        "--drive-size 1G",
        "--erasure-coding 2+1",
        "--threads 2",
        "--sparse-drives",
        "--no-read-defrag",
    ] {
        let error = args(&format!("{remote} {option}")).engine_setup().unwrap_err();
        assert!(matches!(error, BenchError::InvalidConfig(_)), "{option}: {error}");
        let message = error.to_string();
        assert!(message.contains("engine:DIR targets only"), "{option}: {message}");
        assert!(message.contains(option.split(' ').next().unwrap()), "{option}: {message}");
    }
    assert!(args(remote).engine_setup().unwrap().is_none());

    let parent = tempfile::tempdir().unwrap();
    let engine = format!("bench --target engine:{}", parent.path().display());
    let map = parent.path().join("run.vmap");
    for option in
        [format!("--verify --verify-map {}", map.display()), format!("--check {}", map.display())]
    {
        let error = args(&format!("{engine} {option}")).engine_setup().unwrap_err();
        assert!(matches!(error, BenchError::InvalidConfig(_)), "{option}: {error}");
        assert!(error.to_string().contains("--verify-map and --check"), "{option}: {error}");
    }

    // run_command refuses them too, before it does any I/O.
    let setup =
        setup_of(&format!("{engine} --drives 1 --drive-size 64M --sparse-drives --size 4M"));
    on_local_set(async {
        let engine = start(&setup).await;
        let refused = args(&format!("{remote} --drives 2 --runtime 1 --ramp 0 --quiet"));
        let error = run_command(&refused, &mut engine.connector()).await.unwrap_err();
        assert!(matches!(error, BenchError::InvalidConfig(_)), "{error}");
        assert_eq!(engine.engine().stats().host_bytes_written, 0);
    });
    assert!(!map.exists());
}

/// The bytes a file has allocated on its filesystem.
fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn laid_out_drives_are_fully_allocated_and_sparse_ones_are_not() {
    let parent = tempfile::tempdir().unwrap();
    let base = format!(
        "bench --target engine:{} --drives 2 --drive-size 64M --size 16M --threads 1",
        parent.path().display()
    );
    let laid_out = setup_of(&base);
    assert!(laid_out.lay_out, "laying out is the default");
    let sparse = setup_of(&format!("{base} --sparse-drives"));
    assert!(!sparse.lay_out);

    for (setup, expect_full) in [(laid_out, true), (sparse, false)] {
        on_local_set(async {
            let engine = start(&setup).await;
            let files: Vec<PathBuf> =
                entries(engine.dir()).into_iter().filter(|path| path.is_file()).collect();
            assert_eq!(files.len(), 2, "{files:?}");
            for file in &files {
                let size_bytes = std::fs::metadata(file).unwrap().len();
                assert_eq!(size_bytes, 64 * MIB, "{}", file.display());
                // Laying out starts after the header region (1 MiB), where only the superblock
                // is written; the log area is every byte after it.
                let allocated = allocated_bytes(file);
                let full = allocated >= size_bytes - engine::format::HEADER_REGION_BYTES;
                assert_eq!(
                    full,
                    expect_full,
                    "{}: {allocated} of {size_bytes} bytes allocated, lay_out {}",
                    file.display(),
                    setup.lay_out
                );
            }
        });
    }
    assert!(entries(parent.path()).is_empty(), "{:?}", entries(parent.path()));
}
