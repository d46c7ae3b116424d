//! What a user's mistake or a machine's limit gets: one line saying what went wrong and what to
//! change, the right exit code (2 for usage, 1 otherwise), found before the first step where it
//! can be, and nothing lost. Each test here was a defect of a sweep of bad inputs: a panic with
//! 43 C++ frames, a run that trained 0 steps and reported success, a run that never started.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{stderr, wikitext_sample};

fn bin(name: &str) -> Command {
    let path = match name {
        "exercise1" => env!("CARGO_BIN_EXE_exercise1"),
        "exercise1_nlp" => env!("CARGO_BIN_EXE_exercise1_nlp"),
        "exercise3" => env!("CARGO_BIN_EXE_exercise3"),
        "prepare_data" => env!("CARGO_BIN_EXE_prepare_data"),
        "why_gpus" => env!("CARGO_BIN_EXE_why_gpus"),
        other => panic!("no binary {other}"),
    };
    let mut cmd = Command::new(path);
    // As a user's shell has it: the full panic report is for developers who ask for it.
    cmd.env_remove("RUST_BACKTRACE");
    cmd
}

fn run(name: &str, args: &[&str]) -> Output {
    bin(name).args(args).output().unwrap()
}

/// The error lines of a run: exactly one, starting `error:`, naming every part of `says`.
fn one_error_line(out: &Output, says: &[&str]) -> String {
    let err = stderr(out);
    let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "one error line, got:\n{err}");
    for part in says {
        assert!(errors[0].contains(part), "'{part}' not in: {}", errors[0]);
    }
    assert!(!err.contains("panicked") && !err.contains("frame #") && !err.contains("stack backtrace"), "{err}");
    errors[0].to_string()
}

fn generated_cifar(dir: &Path, train: usize) {
    let out = run("prepare_data", &["generate", "--dataset", "cifar10", "--train", &train.to_string(), "--test", "20", "--out", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn running_out_of_memory_is_one_line_naming_what_to_lower() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [200, 50, 50]);
    let results = tempfile::tempdir().unwrap();
    // 4.5 GB of address space, and a model whose layers alone would need 16 GB.
    let line = format!(
        "ulimit -v 4500000 && exec {} --device cpu --data-dir {} --emsize 32768 --max-steps 1 --quiet --results-dir {}",
        env!("CARGO_BIN_EXE_exercise1_nlp"),
        data.path().display(),
        results.path().display()
    );
    let out = Command::new("sh").args(["-c", &line]).env_remove("RUST_BACKTRACE").output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    one_error_line(&out, &["error: out of memory:", "allocate", "lower --batch-size"]);
}

#[test]
fn a_training_split_smaller_than_one_batch_is_refused_before_training() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [0, 50, 50]);
    std::fs::write(data.path().join("train.txt"), " the cat \n").unwrap();
    let out = run(
        "exercise1_nlp",
        &["--device", "cpu", "--data-dir", data.path().to_str().unwrap(), "--max-steps", "2", "--quiet", "--results-dir", data.path().to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    one_error_line(&out, &["training split (2 tokens)", "--batch-size 20", "lower --batch-size"]);

    let images = tempfile::tempdir().unwrap();
    generated_cifar(images.path(), 30);
    let results = tempfile::tempdir().unwrap();
    let out = run(
        "exercise1",
        &["--device", "cpu", "--data-dir", images.path().to_str().unwrap(), "--batch-size", "64", "--quiet", "--results-dir", results.path().to_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    one_error_line(&out, &["training split (30 images)", "--batch-size 64"]);
    assert_eq!(std::fs::read_dir(results.path()).unwrap().count(), 0, "no results for a run that trained nothing");
}

#[test]
fn more_threads_than_cores_are_capped_with_a_warning() {
    let images = tempfile::tempdir().unwrap();
    generated_cifar(images.path(), 40);
    let results = tempfile::tempdir().unwrap();
    let out = run(
        "exercise1",
        &[
            "--device",
            "cpu",
            "--data-dir",
            images.path().to_str().unwrap(),
            "--batch-size",
            "20",
            "--max-steps",
            "1",
            "--threads",
            "100000",
            "--quiet",
            "--results-dir",
            results.path().to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("warning: --threads 100000 is more than the"), "{}", stderr(&out));
}

#[test]
fn a_rank_count_no_node_can_hold_is_refused_before_any_rank_starts() {
    let results = tempfile::tempdir().unwrap();
    let out = run("exercise3", &["ddp", "--device", "cpu", "--nproc-per-node", "1000", "--max-steps", "1", "--results-dir", results.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    one_error_line(&out, &["--nproc-per-node 1000", "CPU ranks per core", "--max-ranks-per-core"]);
}

#[test]
fn a_layout_the_ranks_cannot_form_is_said_once_without_mpis_notice() {
    // Its own results folder, not the checkout's exercises/results/ (should a refusal ever
    // write: a_refused_run_writes_nothing_where_it_runs checks that none does).
    let results = tempfile::tempdir().unwrap();
    let results = results.path().to_str().unwrap();
    let out = run("exercise3", &["tp", "--device", "cpu", "--nproc-per-node", "2", "--tp", "3", "--max-steps", "1", "--results-dir", results]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let line = one_error_line(&out, &["2 ranks cannot hold", "3 tensor-parallel shards"]);
    assert!(!line.contains("rank 0") && !stderr(&out).contains("MPI_ABORT"), "{}", stderr(&out));
}

#[test]
fn a_usage_error_inside_the_ranks_comes_without_mpis_abort_notice() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 40);
    // Found by the ranks themselves (ZeRO is set up after the model is built).
    let out = run(
        "exercise3",
        &[
            "ddp",
            "--device",
            "cpu",
            "--nproc-per-node",
            "2",
            "--zero",
            "1",
            "--optimizer",
            "lars",
            "--max-steps",
            "1",
            "--data-dir",
            data.path().to_str().unwrap(),
            "--results-dir",
            data.path().to_str().unwrap(),
            "--quiet",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    // Rank 0 says it and ends the job; how many other ranks get to say it too depends on
    // timing, so only rank 0's line is required.
    assert!(err.contains("error on rank 0: --zero 1 shards element-wise optimizers"), "{err}");
    assert!(!err.contains("MPI_ABORT") && !err.contains("orte_base_help_aggregate"), "{err}");
}

#[test]
fn unusable_results_and_checkpoint_folders_are_refused_before_training() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 40);
    let file = tempfile::NamedTempFile::new().unwrap();
    let under_a_file = file.path().join("results");
    let good = tempfile::tempdir().unwrap();
    let (bad, good) = (under_a_file.to_str().unwrap(), good.path().to_str().unwrap());
    for (flag, dirs) in [("--results-dir", ["--results-dir", bad]), ("--checkpoint-dir", ["--checkpoint-dir", bad])] {
        let common = ["--device", "cpu", "--data-dir", data.path().to_str().unwrap(), "--batch-size", "20", "--epochs", "1", "--quiet"];
        let results = if flag == "--results-dir" { Vec::new() } else { vec!["--results-dir", good] };
        let out = run("exercise1", &[&common[..], &dirs, &results].concat());
        assert_eq!(out.status.code(), Some(2), "{flag}: {}", stderr(&out));
        one_error_line(&out, &[flag, "cannot write there"]);
        assert!(!String::from_utf8_lossy(&out.stdout).contains("parameters"), "{flag}: refused before the model was built");
    }
}

#[test]
fn a_negative_peak_is_refused() {
    let out = run("exercise1", &["--device", "cpu", "--max-steps", "1", "--peak-tflops=-1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    one_error_line(&out, &["--peak-tflops must be a positive number"]);
}

#[test]
fn a_loss_that_turns_nan_stops_the_run_with_exit_1_and_no_results() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 200);
    let results = tempfile::tempdir().unwrap();
    let out = run(
        "exercise1",
        &[
            "--device",
            "cpu",
            "--data-dir",
            data.path().to_str().unwrap(),
            "--batch-size",
            "20",
            "--lr",
            "1e30",
            "--clip",
            "0",
            "--quiet",
            "--results-dir",
            results.path().to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    one_error_line(&out, &["training loss is NaN at step", "lower --lr"]);
    assert!(!results.path().join("exercise1-cnn-cpu.json").exists());
}

#[test]
fn prepare_data_takes_data_dir_as_the_exercises_do() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [100, 20, 20]);
    let out = run("prepare_data", &["check-text", "--data-dir", data.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("train"), "{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn a_checkpoint_given_as_weights_points_to_resume() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 40);
    let dir = tempfile::tempdir().unwrap();
    let (data, dir) = (data.path().to_str().unwrap(), dir.path().to_str().unwrap());
    let common = ["--device", "cpu", "--data-dir", data, "--batch-size", "20", "--epochs", "1", "--quiet", "--results-dir", dir];
    let out = run("exercise1", &[&common[..], &["--checkpoint-dir", dir]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let checkpoint = format!("{dir}/exercise1-cnn-cpu.safetensors");
    let out = run("exercise1", &[&common[..], &["--weights", &checkpoint]].concat());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    one_error_line(&out, &["is a checkpoint of a run", &format!("--checkpoint-dir {dir} --resume")]);
}

/// A path that is not UTF-8 is a valid argument on Linux: it gets the same line as any missing
/// folder, never "internal error" (std::env::args panicked on it).
#[test]
fn a_path_that_is_not_utf8_is_read_as_a_path() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join(std::ffi::OsStr::from_bytes(b"caf\xe9"));
    for (name, sub) in [("exercise1", None), ("exercise1_nlp", None), ("exercise3", Some("ddp"))] {
        let mut cmd = bin(name);
        cmd.args(sub).args(["--device", "cpu", "--quiet", "--data-dir"]).arg(&missing);
        let out = cmd.output().unwrap();
        assert!(matches!(out.status.code(), Some(1 | 2)), "{name}: {}", stderr(&out));
        let line = one_error_line(&out, &["caf"]);
        assert!(!line.contains("internal error"), "{name}: {line}");
    }
}

/// Sizes beyond what the machine has are refused up front in one sentence with their estimate,
/// worked out in closed form, before anything is allocated or written: a generated data set of
/// 10^11 images (307 TB; it aborted in an allocation), an image folder of 10^8 classes (it ran
/// silently for minutes), why_gpus' matrices of side 10^7 and 10^12 scalar multiplications, a
/// Transformer of 10^7 layers whose --estimate-memory aborted, or 10^9 wide.
#[test]
fn sizes_beyond_the_machine_are_refused_before_anything_is_allocated_or_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("generated");
    let (out_arg, results) = (out.to_str().unwrap(), dir.path().join("results"));
    let cases: [(&str, Vec<&str>, &[&str]); 6] = [
        (
            "exercise1_nlp",
            vec!["--device", "cpu", "--nlayers", "10000000", "--estimate-memory", "--results-dir", results.to_str().unwrap()],
            &["--nlayers 10000000: at most 10000"],
        ),
        (
            "exercise1_nlp",
            vec!["--device", "cpu", "--emsize", "1000000000", "--nhead", "1", "--results-dir", results.to_str().unwrap()],
            &["--emsize 1000000000: at most 1048576"],
        ),
        (
            "prepare_data",
            vec!["generate", "--dataset", "cifar10", "--train", "100000000000", "--out", out_arg],
            &["100000000000 train + 10000 test images of cifar10 would need", "GiB of memory", "lower --train or --test"],
        ),
        (
            "prepare_data",
            vec!["generate-images", "--classes", "100000000", "--out", out_arg],
            &["100000000 classes × 100 train + 20 val images would", "lower --classes"],
        ),
        (
            "why_gpus",
            vec!["--device", "cpu", "--max-side", "10000000", "--results-dir", results.to_str().unwrap()],
            &["--max-side 10000000 would need", "lower --max-side"],
        ),
        (
            "why_gpus",
            vec!["--device", "cpu", "--max-scalars", "1000000000000", "--results-dir", results.to_str().unwrap()],
            &["--max-scalars may be at most 100000000"],
        ),
    ];
    for (name, args, says) in cases {
        let started = std::time::Instant::now();
        let run = run(name, &args);
        assert_eq!(run.status.code(), Some(2), "{name} {args:?}: {}", stderr(&run));
        one_error_line(&run, says);
        assert!(started.elapsed() < std::time::Duration::from_secs(60), "{name} {args:?}: refused up front, not after {:?}", started.elapsed());
        assert!(!out.exists() && !results.exists(), "{name} {args:?}: nothing written");
    }
    // Within the machine, the same commands run.
    let small = run("prepare_data", &["generate", "--dataset", "cifar10", "--train", "10", "--test", "5", "--out", out_arg]);
    assert!(small.status.success(), "{}", stderr(&small));
}

/// --accumulate beyond the batches of an epoch was accepted without a word (1,000,000,000): it is
/// refused, naming the most an epoch allows, which is accepted.
#[test]
fn accumulating_more_batches_than_an_epoch_holds_is_refused() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 40);
    let results = tempfile::tempdir().unwrap();
    let common = [
        "--device",
        "cpu",
        "--model",
        "cnn",
        "--batch-size",
        "8",
        "--max-steps",
        "1",
        "--quiet",
        "--data-dir",
        data.path().to_str().unwrap(),
        "--results-dir",
        results.path().to_str().unwrap(),
    ];
    for (accumulate, code) in [("1000000000", 2), ("6", 2), ("5", 0)] {
        let out = run("exercise1", &[&common[..], &["--accumulate", accumulate]].concat());
        assert_eq!(out.status.code(), Some(code), "--accumulate {accumulate}: {}", stderr(&out));
        if code == 2 {
            one_error_line(&out, &[&format!("--accumulate {accumulate}: an epoch holds 5 batches per replica"), "at most --accumulate 5"]);
        }
    }
}

#[test]
fn a_refused_run_writes_nothing_where_it_runs() {
    let cwd = tempfile::tempdir().unwrap();
    let refused = [
        ("exercise1", vec!["--device", "cpu", "--precision", "16-true"]),
        ("exercise1", vec!["--device", "cpu", "--precision", "16-true", "--results-dir", "deep/er/results", "--checkpoint-dir", "ckpt/a"]),
        ("exercise3", vec!["tp", "--nproc-per-node", "2", "--tp", "3"]),
    ];
    for (name, args) in &refused {
        let out = bin(name).args(args).current_dir(cwd.path()).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{name} {args:?}: {}", stderr(&out));
        let left: Vec<_> = std::fs::read_dir(cwd.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "{name} {args:?} was refused but left {left:?}");
    }
    // The check itself still creates what an accepted run writes into.
    let out = bin("exercise1").args(["--device", "cpu", "--estimate-memory", "--results-dir", "deep/er/results"]).current_dir(cwd.path()).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(cwd.path().join("deep/er/results/exercise1-cnn-cpu.memory-estimate.json").is_file());
}
