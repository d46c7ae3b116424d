//! `make gpu-check` (bench/gpu_check.py) where there is no GPU: one line and exit 2; its table
//! from a recorded result; its budget, resume and a run killed part-way; and the GPU bundle
//! (`make gpu-bundle`) run from a folder of its own, its CPU self-test running the harness's
//! checks that need no CUDA, so that what it claims on a GPU is computed by tested code.
//!
//! The script runs under `$TORCH_PYTHON`, which `scripts/with-torch` sets.
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use support::{read_json, stderr};

fn gpu_check(args: &[&str]) -> Output {
    let python = std::env::var_os("TORCH_PYTHON").expect("TORCH_PYTHON is not set: run the tests through scripts/with-torch");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_exercise1")).parent().unwrap().to_path_buf();
    Command::new(python).arg(root().join("bench/gpu_check.py")).arg("--bin").arg(bin).args(args).output().expect("gpu_check.py runs")
}

#[test]
fn without_a_gpu_it_says_so_in_one_line_and_exits_2() {
    if tch::Cuda::is_available() {
        println!("this machine has a GPU: the refusal is not what gpu-check does here");
        return;
    }
    let results = tempfile::tempdir().unwrap();
    let out = gpu_check(&["--results", results.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("gpu-check: no CUDA GPU on this machine") && err.contains("run it on a GPU node"), "{err}");
    assert_eq!(std::fs::read_dir(results.path()).unwrap().count(), 0, "nothing written");
}

/// The harness's own tests (bench/gpucheck/test_gpucheck.py): every comparison a GPU row rests
/// on fails when its two sides differ, merged and resumed tables keep each row's provenance,
/// every tier fits its 6 minutes by the committed table's times, NCCL's refusal falls back to MPI.
#[test]
fn the_harness_unit_tests_pass() {
    let python = std::env::var_os("TORCH_PYTHON").expect("TORCH_PYTHON is not set: run the tests through scripts/with-torch");
    let out = Command::new(python).args(["-m", "unittest", "-v", "gpucheck.test_gpucheck"]).current_dir(root().join("bench")).output().unwrap();
    let said = stderr(&out);
    assert!(out.status.success(), "{}\n{said}", String::from_utf8_lossy(&out.stdout));
    let ran: usize = said.lines().find_map(|l| l.strip_prefix("Ran ")?.split_whitespace().next()?.parse().ok()).unwrap();
    assert!(ran >= 20, "{said}");
}

/// The GPU figures README and docs/ quote are the committed table's (`bench/gpu_check.py --docs`
/// writes them), and no page says what ran on a GPU outside those blocks.
#[test]
fn the_docs_gpu_figures_are_the_committed_tables() {
    let out = gpu_check(&["--docs", "--check"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn the_table_of_a_recorded_check_names_every_path_and_fails_with_it() {
    let recorded = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference/gpu-check-recorded.json");
    let out = gpu_check(&["--table", recorded.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "a failed check fails the command: {}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    let expected = [
        "gpu-check on Test GPU (a recorded result for the table writer's test, not a measurement) (1 GPU(s)), tier 1, 2026-11-18 11:06 UTC, commit abc1234, 412 s (budget 420 s)",
        "Rows from Test GPU abc1234 2026-11-18; Other GPU fedcba9 2026-11-17 (each row's own run is in its last column).",
        "| tier | path | verdict | figure | ratio to the fastest peer | s | run |",
        "| 1 | exercise1 cnn 32 | pass | loss 2.303 -> 1.981 in 40 steps, 41,000 images/s |  | 11 | Test GPU abc1234 2026-11-18 |",
        "| 2 | exercise1 cnn --cuda-graph = eager | fail | losses differ by 3.10e-02 (relative) over 40 steps, more than 2e-03 |  | 14 | Test GPU abc1234 2026-11-18 |",
        "| 4 | timing exercise1 resnet34 32 | below goal | ours 6,100 vs fastest peer fused 6,640 images/s (goal 1.1x the fastest peer) | 0.92x | 95 | Other GPU fedcba9 2026-11-17 |",
        "| 10 | 1.4B Transformer bf16-mixed, 16 x 512 tokens: MFU | not run (budget) | needs about 90 s, 8 s of the budget left |  |  |  |",
        "1 below goal, 1 fail, 1 not run (budget), 1 pass",
    ];
    for line in expected {
        assert!(table.lines().any(|l| l == line), "no line {line:?} in\n{table}");
    }
    let broken = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(broken.path(), "{not json").unwrap();
    let out = gpu_check(&["--table", broken.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cannot read the recorded check"), "{}", stderr(&out));
}

/// The rows of a recorded check, as (path, verdict).
fn rows(recorded: &serde_json::Value) -> Vec<(String, String)> {
    recorded["checks"].as_array().unwrap().iter().map(|c| (c["path"].as_str().unwrap().to_string(), c["verdict"].as_str().unwrap().to_string())).collect()
}

fn verdict_of(recorded: &serde_json::Value, path: &str) -> String {
    rows(recorded).into_iter().find(|(p, _)| p == path).unwrap_or_else(|| panic!("no row {path:?} in {recorded}")).1
}

#[test]
fn a_budget_stops_starting_checks_in_time_and_a_resume_runs_only_what_is_left() {
    const PIPELINE: &str = "exercise3 pipeline gpipe, both stages on cpu";
    let dir = tempfile::tempdir().unwrap();
    // A table measured earlier says that the pipeline check took 500 s here: a 60 s budget
    // cannot fit it, whatever this machine's speed, and the cheaper checks after it still run.
    // (--only matches any part of a row's name: these three match one row each.)
    let measured = dir.path().join("measured.json");
    let earlier = serde_json::json!({"commit": "test", "checks": [{"path": PIPELINE, "verdict": "pass", "seconds": 500.0}]});
    std::fs::write(&measured, earlier.to_string()).unwrap();
    let (first, second) = (dir.path().join("first"), dir.path().join("second"));
    let only = ["--only", "exercise1 cnn bf16-mixed", "--only", "exercise3 pipeline gpipe, both", "--only", "cnn --data-on-device"];
    let base = ["--device", "cpu", "--no-timings"];
    let out = gpu_check(&[&base[..], &only, &["--budget", "60", "--plan-from", measured.to_str().unwrap(), "--results", first.to_str().unwrap()]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    let recorded = read_json(&first.join("gpu-check-cpu.json"));
    assert_eq!(verdict_of(&recorded, PIPELINE), "not run (budget)", "{stdout}");
    let figure = recorded["checks"].as_array().unwrap().iter().find(|c| c["path"] == PIPELINE).unwrap()["figure"].as_str().unwrap().to_string();
    assert!(figure.starts_with("needs about 500 s"), "{figure}");
    for path in ["exercise1 cnn bf16-mixed", "exercise1 cnn --data-on-device"] {
        // On any machine: done within the budget, or left for the resume because it did not fit.
        assert!(["pass", "not run (budget)"].contains(&verdict_of(&recorded, path).as_str()), "{stdout}");
    }
    assert!(recorded["seconds"].as_f64().unwrap() <= 61.0, "the run took {} s of a 60 s budget", recorded["seconds"]);
    assert!(std::fs::read_to_string(first.join("gpu-check-cpu.md")).unwrap().contains(&format!("| {PIPELINE} | not run (budget) |")));
    assert!(stdout.contains("--resume-from"), "the run says how to finish: {stdout}");

    // The resume runs what was not run and keeps what passed.
    let table = first.join("gpu-check-cpu.json");
    let out = gpu_check(&[&base[..], &only, &["--budget", "300", "--resume-from", table.to_str().unwrap(), "--results", second.to_str().unwrap()]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    let resumed = read_json(&second.join("gpu-check-cpu.json"));
    assert_eq!(rows(&resumed).iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(), ["exercise1 cnn bf16-mixed", PIPELINE, "exercise1 cnn --data-on-device"]);
    assert!(rows(&resumed).iter().all(|(_, v)| v == "pass"), "{stdout}");
    assert_eq!(resumed["complete"], true);
    // What passed before is carried over as it was measured (its own time of finishing), and
    // only that: the rest ran again, later.
    let first_run: std::collections::HashMap<&str, &serde_json::Value> =
        recorded["checks"].as_array().unwrap().iter().map(|c| (c["path"].as_str().unwrap(), c)).collect();
    for row in resumed["checks"].as_array().unwrap() {
        let before = first_run[row["path"].as_str().unwrap()];
        let carried = row["finished_at"] == before["finished_at"];
        assert_eq!(before["verdict"] == "pass", carried, "{}: what passed before is carried over with its provenance, nothing else: {stdout}", row["path"]);
        assert_eq!(row["commit"].as_str(), recorded["commit"].as_str(), "every row names its commit: {row}");
    }
    assert!(resumed["resumed_from"]["path"].as_str().unwrap().ends_with("gpu-check-cpu.json"));

    // A budget that is no number of seconds is one line.
    let out = gpu_check(&["--device", "cpu", "--budget", "0", "--results", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--budget must be a positive number of seconds"), "{}", stderr(&out));
    let out = gpu_check(&["--device", "cpu", "--resume-from", measured.with_extension("missing").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("cannot read the recorded check"), "{}", stderr(&out));
}

#[test]
fn a_run_killed_part_way_leaves_a_readable_table_that_a_resume_finishes() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("results");
    let python = std::env::var_os("TORCH_PYTHON").expect("TORCH_PYTHON is not set: run the tests through scripts/with-torch");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_exercise1")).parent().unwrap().to_path_buf();
    let only = ["--only", "exercise1 cnn bf16-mixed", "--only", "cnn --data-on-device", "--only", "cnn --matmul-precision high"];
    let mut run = Command::new(&python)
        .arg(root().join("bench/gpu_check.py"))
        .arg("--bin")
        .arg(&bin)
        .args(["--device", "cpu", "--no-timings", "--results", results.to_str().unwrap()])
        .args(only)
        // Its runs' folder inside ours: the killed run cannot remove it itself.
        .env("TMPDIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    // Kill the whole run (the harness and the binary it is running) once the first check is in
    // the table, as an allocation's end kills it: no signal handler gets to write anything.
    let table = results.join("gpu-check-cpu.json");
    let started = std::time::Instant::now();
    loop {
        let done = std::fs::read_to_string(&table)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|r| r["checks"].as_array().unwrap().iter().any(|c| c["verdict"] == "pass"));
        if done {
            break;
        }
        assert!(run.try_wait().unwrap().is_none(), "the run ended before it was killed");
        assert!(started.elapsed().as_secs() < 600, "no check finished in 10 minutes");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(unsafe { libc::kill(-(run.id() as libc::pid_t), libc::SIGKILL) }, 0);
    run.wait().unwrap();
    let killed = read_json(&table);
    let verdicts: Vec<String> = rows(&killed).into_iter().map(|(_, v)| v).collect();
    assert_eq!(verdicts.len(), 3, "{killed}");
    assert_eq!(verdicts[0], "pass", "{killed}");
    assert!(verdicts[1..].iter().all(|v| v == "pass" || v == "not run (not reached)"), "{killed}");
    assert!(verdicts.iter().any(|v| v == "not run (not reached)"), "killed after the first check: {killed}");
    let md = std::fs::read_to_string(results.join("gpu-check-cpu.md")).unwrap();
    assert!(md.contains("| exercise1 cnn bf16-mixed | pass |") && md.contains("not run (not reached)"), "{md}");

    let finished = dir.path().join("finished");
    let out = gpu_check(
        &[&["--device", "cpu", "--no-timings", "--resume-from", table.to_str().unwrap(), "--results", finished.to_str().unwrap()][..], &only].concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let resumed = read_json(&finished.join("gpu-check-cpu.json"));
    assert!(rows(&resumed).iter().all(|(_, v)| v == "pass"), "{resumed}");
    assert_eq!(resumed["complete"], true);
}

// ---- The GPU bundle (`make gpu-bundle`) -------------------------------------------------------
// `make gpu-bundle`: the folder that checks this commit on a bare GPU node. Built here, copied
// to a folder of its own, and run from there as on a node: no checkout, no Rust on `PATH`, the
// virtualenv's Python standing in for the node's, and, where this machine lets a test make a
// mount namespace (root), this machine's Open MPI hidden, so that the ranks can only have used
// the bundle's. Its CPU self-test runs the harness's checks that need no GPU.

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&source, &target);
        } else {
            std::fs::copy(&source, &target).unwrap();
        }
    }
}

fn folder_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).unwrap().flatten().map(|e| if e.file_type().unwrap().is_dir() { folder_bytes(&e.path()) } else { e.metadata().unwrap().len() }).sum()
}

/// Hides this machine's Open MPI and PMIx (their folders and libraries, mpirun) in a private
/// mount namespace, then runs the command: what `unshare` is handed.
const HIDE_MPI: &str = r#"set -e
L=/usr/lib/x86_64-linux-gnu
for d in $L/openmpi $L/pmix2 /usr/share/openmpi /usr/share/pmix /etc/openmpi; do [ -d "$d" ] && mount -t tmpfs none "$d"; done
for f in $L/libmpi.so.40* $L/libopen-rte.so.40* $L/libopen-pal.so.40* $L/libpmix.so.2* $L/libhwloc.so.15* $L/libevent_core-2.1.so.7* $L/libevent_pthreads-2.1.so.7* $L/libmunge.so.2* /usr/bin/orterun /usr/bin/orted; do
  [ -e "$f" ] && mount --bind /dev/null "$(readlink -f "$f")"
done
exec "$@""#;

/// `run.sh args` from `work`, with nothing of this machine's build environment: `PATH` without
/// Rust, the virtualenv's Python as the node's, and this machine's MPI hidden where possible.
fn on_a_bare_node(bundle: &Path, work: &Path, args: &[&str], hide_mpi: bool) -> Output {
    let python = std::env::var_os("TORCH_PYTHON").expect("TORCH_PYTHON is not set: run the tests through scripts/with-torch");
    let mut command = if hide_mpi {
        let mut c = Command::new("unshare");
        c.args(["--mount", "--propagation", "private", "sh", "-c", HIDE_MPI, "hide-mpi"]);
        c
    } else {
        Command::new("env")
    };
    command
        .arg(bundle.join("run.sh"))
        .args(args)
        .current_dir(work)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", work)
        .env("TORCH_PYTHON", python)
        .output()
        .unwrap()
}

/// The bundle of this build, made once for every test that runs it (under a lock: nextest runs
/// the tests as processes side by side) in a folder named by what went into it, and a copy of
/// it on a "node" of the caller's own: (the copy, a folder to run in, whether this machine's
/// MPI can be hidden).
fn bundle_on_a_node(node: &Path) -> (PathBuf, PathBuf, bool) {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_exercise1")).parent().unwrap().to_path_buf();
    let stamp = ["exercise1", "exercise1_nlp", "exercise2", "exercise3", "prepare_data", "why_gpus"]
        .iter()
        .map(|b| std::fs::metadata(bin.join(b)).unwrap())
        .map(|m| format!("{}-{:?}", m.len(), m.modified().unwrap()))
        .collect::<Vec<_>>()
        .join("|");
    let sources: Vec<u8> = ["scripts/gpu-bundle", "bench/bundle-run.sh", "results/gpu-check.json"]
        .iter()
        .map(|f| root().join(f))
        .chain(["bench", "bench/gpucheck"].iter().flat_map(|d| std::fs::read_dir(root().join(d)).unwrap().flatten().map(|e| e.path())))
        .filter(|p| p.is_file())
        .flat_map(|p| std::fs::read(p).unwrap())
        .collect();
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (stamp, sources).hash(&mut hasher);
    let built = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu-bundle-{:016x}", hasher.finish()));
    let lock = std::fs::File::create(built.with_extension("lock")).unwrap();
    lock.lock().unwrap();
    if !built.join("run.sh").exists() {
        let out = Command::new(root().join("scripts/gpu-bundle")).arg("--bin").arg(&bin).arg("--out").arg(&built).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{said}\n{}", stderr(&out));
        print!("{said}");
        let bytes = folder_bytes(&built);
        assert!(bytes < 64 << 20, "the bundle is {bytes} bytes, over 64 MiB");
        // The script counts what the folder takes on disk (du), whole blocks: a MiB more at most.
        assert!([bytes >> 20, (bytes >> 20) + 1].iter().any(|mib| said.contains(&format!(": {mib} MiB ("))), "the size ({bytes} bytes) is printed: {said}");
    }
    lock.unlock().unwrap();
    for file in [
        "run.sh",
        "payload.tar.gz",
        "COMMIT",
        "PAYLOAD_ID",
        "MANIFEST.txt",
        "committed-gpu-check.json",
        "bench/gpu_check.py",
        "bench/gpucheck/harness.py",
        "bench/bench.sh",
        "bench/exercise1_lightning.py",
    ] {
        assert!(built.join(file).is_file(), "no {file} in the bundle");
    }
    // On the "node": a copy of the bundle alone, run from another folder.
    let (bundle, work) = (node.join("bundle"), node.join("work"));
    copy_tree(&built, &bundle);
    std::fs::create_dir_all(&work).unwrap();
    let rust = Command::new("env").args(["-i", "PATH=/usr/bin:/bin", "sh", "-c", "command -v cargo || command -v rustc"]).output().unwrap();
    assert!(!rust.status.success(), "Rust is on the bare PATH: {}", String::from_utf8_lossy(&rust.stdout));
    let probe = Command::new("unshare").args(["--mount", "--propagation", "private", "sh", "-c", HIDE_MPI, "probe", "true"]).output();
    let hide_mpi = probe.as_ref().is_ok_and(|o| o.status.success());
    if !hide_mpi {
        println!("note: cannot hide this machine's Open MPI here (unshare --mount needs root): the ranks were shown the bundle's first, but this machine's was there too");
    }
    (bundle, work, hide_mpi)
}

/// The CPU self-test of `tiers` from a copy of the bundle on a bare "node": every row of those
/// tiers is there, and every one that could run here ran and holds (a timing may be below its
/// goal on this machine, and so may the plan's predictions for a tiny model: they work, which
/// is what is checked); the rest say what they need. Returns the recorded table and the node's
/// folder (its results under `work/results`).
fn self_test(tiers: &[&str]) -> (serde_json::Value, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (bundle, work, hide_mpi) = bundle_on_a_node(dir.path());
    let tier_args: Vec<String> = tiers.iter().flat_map(|t| ["--tier".to_string(), t.to_string()]).collect();
    let numbers: Vec<u64> = tiers.iter().map(|t| if *t == "course" { 11 } else { t.parse().unwrap() }).collect();
    let mut args = vec!["--device", "cpu", "--budget", "1800", "--out", "results"];
    args.extend(tier_args.iter().map(String::as_str));
    let out = on_a_bare_node(&bundle, &work, &args, hide_mpi);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    for tier in &numbers {
        assert!(stdout.contains(&format!("tier {tier}: ")) && stdout.contains("expected about"), "each tier's expected time is said first: {stdout}");
    }
    let recorded = read_json(&work.join("results/gpu-check-cpu.json"));
    assert_eq!(recorded["commit"].as_str(), std::fs::read_to_string(bundle.join("COMMIT")).ok().as_deref().map(str::trim), "the bundle's commit");
    let checks = recorded["checks"].as_array().unwrap();
    assert!(!checks.is_empty());
    for c in checks {
        let (path, verdict) = (c["path"].as_str().unwrap(), c["verdict"].as_str().unwrap());
        assert!(numbers.contains(&c["tier"].as_u64().unwrap()), "{path}: a row of another tier");
        if verdict.starts_with("not run (needs ") {
            continue;
        }
        let ok = verdict == "pass" || (verdict == "below goal" && (path.starts_with("timing") || path.starts_with("the plan against")));
        assert!(ok, "{path}: {verdict} {} {}\n{stdout}", c["figure"], c["detail"]);
        assert!(c["seconds"].as_f64().is_some(), "every row that ran records its wall time: {c}");
        assert_eq!((c["gpu"].as_str(), c["commit"].as_str()), (Some("cpu"), recorded["commit"].as_str()), "every row carries its own provenance: {c}");
        assert!(c["finished_at"].as_i64().is_some(), "{c}");
    }
    (recorded, dir)
}

fn row<'a>(recorded: &'a serde_json::Value, pattern: &str) -> &'a serde_json::Value {
    recorded["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["path"].as_str().unwrap().contains(pattern))
        .unwrap_or_else(|| panic!("no row {pattern:?}: {recorded}"))
}

#[test]
fn the_bundle_finds_its_libraries_on_a_bare_node_and_refuses_another_pytorch() {
    let dir = tempfile::tempdir().unwrap();
    let (bundle, work, hide_mpi) = bundle_on_a_node(dir.path());
    // Where each binary's MPI comes from: the bundle.
    let out = on_a_bare_node(&bundle, &work, &["--libraries"], hide_mpi);
    let libraries = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{libraries}\n{}", stderr(&out));
    let mpi: Vec<&str> = libraries.lines().filter(|l| l.contains("libmpi.so") || l.contains("libopen-pal.so")).collect();
    assert!(!mpi.is_empty() && mpi.iter().all(|l| l.contains(bundle.to_str().unwrap())), "MPI from outside the bundle:\n{libraries}");
    // The tiers and their expected times, from the committed table the bundle carries.
    let out = on_a_bare_node(&bundle, &work, &["--tiers"], hide_mpi);
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{listing}\n{}", stderr(&out));
    assert!(listing.lines().filter(|l| l.starts_with("tier ")).count() >= 8 && listing.contains("about"), "{listing}");
    // A node whose Python has another PyTorch is told so in one line.
    let fake = dir.path().join("python");
    std::fs::write(&fake, "#!/bin/sh\nexec /usr/bin/env python3 -c 'print(\"2.5.1\"); print(\"/nowhere\")'\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = Command::new(bundle.join("run.sh")).current_dir(&work).env("TORCH_PYTHON", &fake).arg("--device").arg("cpu").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("has PyTorch 2.5.1; these binaries need 2.11.0"), "{}", stderr(&out));
}

/// Tier 1 on the CPU: the multi-rank rows over MPI through the bundle's binaries and MPI, each
/// an equality against one rank, and the exercises learning.
#[test]
fn the_bundle_runs_tier_1_on_the_cpu_the_multi_rank_rows_over_mpi() {
    let (recorded, _node) = self_test(&["1"]);
    for pattern in [
        "exercise2 (Horovod style): 2 ranks x 20",
        "exercise3 ddp",
        "parameter-server --sync",
        "exercise1_nlp --zero 3",
        "HSDP",
        "--tp 2: 2 shards",
        "--sequence-parallel",
        "pipeline interleaved across 2 processes",
        "--tp 2 --pp 2",
        "sharded checkpoint",
        "collective watchdog: a healthy",
    ] {
        let c = row(&recorded, pattern);
        assert_eq!(c["verdict"], "pass", "{c}");
        assert!(c["figure"].as_str().unwrap().contains("over MPI (CPU ranks)"), "{c}");
    }
    let fired = row(&recorded, "never completes");
    assert!(fired["figure"].as_str().unwrap().contains("exit 3"), "{fired}");
    // What needs a GPU says so.
    assert!(row(&recorded, "torchrun-style")["verdict"].as_str().unwrap().starts_with("not run (needs CUDA"));
    assert!(row(&recorded, "--fp16-allreduce")["verdict"].as_str().unwrap().starts_with("not run (needs NCCL"));
}

/// Tier 2 on the CPU: the speed features against the plain path, and the CNN's timing against
/// the PyTorch peers through bench.sh.
#[test]
fn the_bundle_runs_tier_2_on_the_cpu() {
    let (recorded, _node) = self_test(&["2"]);
    for pattern in ["fused kernel", "checkpoint + --resume", "pipeline 1f1b = gpipe"] {
        assert_eq!(row(&recorded, pattern)["verdict"], "pass");
    }
    let timing = row(&recorded, "timing exercise1 cnn 32");
    assert!(timing["ratio"].as_f64().is_some_and(|r| r > 0.0) && timing["figure"].as_str().unwrap().contains("fastest peer"), "{timing}");
    assert!(timing["extra"]["rust_data_ms"].is_string(), "the bench row is kept whole, phases included: {timing}");
}

/// Tiers 3 to 8 on the CPU: the timings that run here (exercise1_nlp, the CNN in bf16-mixed,
/// the Lightning Trainer); ResNet34's, VGG19's and the CUDA graphs' say they need a GPU.
#[test]
fn the_bundle_runs_the_timing_tiers_on_the_cpu() {
    let (recorded, _node) = self_test(&["3", "4", "5", "6", "7", "8"]);
    for pattern in ["timing exercise1_nlp 32", "timing exercise1 cnn bf16-mixed", "pytorch-lightning"] {
        let c = row(&recorded, pattern);
        assert!(c["ratio"].as_f64().is_some_and(|r| r > 0.0), "{c}");
    }
    for pattern in ["resnet34 32", "vgg19 bf16-mixed", "exercise1_nlp 32 --cuda-graph"] {
        assert!(row(&recorded, pattern)["verdict"].as_str().unwrap().starts_with("not run (needs CUDA"), "{pattern}");
    }
}

/// Tiers 9 and 10 on the CPU: memory against --estimate-memory, the profiler, the JPEG files, the
/// planner's profile (kept beside the table) and its plan against runs.
#[test]
fn the_bundle_runs_tiers_9_and_10_on_the_cpu() {
    let (recorded, node) = self_test(&["9", "10"]);
    for pattern in ["profiler", "estimate-memory: exercise1 cnn", "the loader keeps up", "the planner's profile", "the plan against runs"] {
        row(&recorded, pattern);
    }
    let results = node.path().join("work/results");
    // The planner's profile is kept beside the table, a profile the planner reads.
    let profile = common::plan::profile::Profile::read(&results.join("plan-profile-cpu.json"), None).unwrap();
    assert_eq!((profile.compute.len(), profile.links.len()), (2, 1), "{profile:?}");
    // Every layout the plan ranked was run: its predicted and measured step time and memory,
    // one row each, in bench-plan.csv's columns.
    let rows = std::fs::read_to_string(results.join("plan-check.csv")).unwrap();
    let mut lines = rows.lines();
    assert!(lines.next().unwrap().starts_with("bench_started_at,cluster,predicted_rank,layout,predicted_step_s,measured_step_s,"), "{rows}");
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert!(rows.len() >= 2 && rows.iter().any(|r| r[1].contains("global batch 2")) && rows.iter().any(|r| r[1].contains("global batch 4")), "{rows:?}");
    for row in &rows {
        let figure = |i: usize| row[i].parse::<f64>().unwrap();
        assert!(row[3].starts_with("\"exercise1_nlp --batch-size "), "{row:?}");
        assert!((4..8).all(|i| figure(i) > 0.0), "predicted and measured, time and memory: {row:?}");
    }
}

/// The course tier on the CPU: the course's runs as the course runs them (at sizes a CPU does in
/// seconds), their printouts with the slides' rows beside ours, results and charts kept in
/// results/course-gpu/ and in the one archive a node sends back.
#[test]
fn the_bundle_runs_the_course_tier_on_the_cpu() {
    let (recorded, node) = self_test(&["course"]);
    let rows = recorded["checks"].as_array().unwrap();
    assert_eq!(rows.len(), 8, "{recorded}");
    assert!(rows.iter().all(|r| r["verdict"] == "pass"), "{recorded}");
    let kept = node.path().join("work/results/course-gpu");
    let pipe = std::fs::read_to_string(kept.join("exercise3-pipe/stdout.txt")).unwrap();
    assert!(pipe.contains("Pipe(Sequential(Linear(16, 8) on cpu, Linear(8, 4) on cpu), chunks=8)"), "the slides' Pipe example: {pipe}");
    let printout = std::fs::read_to_string(kept.join("exercise1-cnn/stdout.txt")).unwrap();
    assert!(printout.contains("| course: cpu |") && printout.contains("test_acc_epoch"), "the slide's rows beside ours: {printout}");
    assert!(kept.join("why_gpus/why_gpus.svg").is_file() && kept.join("exercise2/stdout.txt").is_file());
    assert!(std::fs::read_to_string(kept.join("RUN.txt")).unwrap().contains("commit"), "where and when it ran");
    let archive = Command::new("tar").arg("tzf").arg(node.path().join("work/results/course-gpu.tar.gz")).output().unwrap();
    let listed = String::from_utf8_lossy(&archive.stdout);
    assert!(listed.contains("course-gpu/exercise3-ddp/stdout.txt") && listed.contains("course-gpu/RUN.txt"), "{listed}");
}
