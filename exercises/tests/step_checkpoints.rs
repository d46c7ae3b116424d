//! Step checkpoints and exact resumption in the middle of an epoch, as a user meets them: a run
//! checkpointing every N steps is ended abruptly after step k (a test hook that exits as a kill
//! would, so nothing depends on timing), resumed with the same command, and its losses are the
//! uninterrupted run's, bit for bit: for an image exercise, the language model (with dropout),
//! a pipeline, and two data-parallel ranks. Also: `--max-steps` saves its last step, a torn
//! newest checkpoint falls back to the previous one with a warning, and SIGTERM/SIGUSR1 stop a
//! run with a checkpoint from which a resume equals the uninterrupted run.
mod support;

use std::path::Path;
use std::process::{Command, Output};

use common::train::TEST_EXIT_AFTER_STEP;
use support::{read_json, shared_data, stderr, wikitext_sample};

fn run(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the exercise runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn losses(json: &serde_json::Value) -> Vec<f64> {
    json["step_losses"].as_array().expect("step_losses").iter().map(|v| v.as_f64().unwrap()).collect()
}

/// A command of `bin` with `args`, writing checkpoints and results to a folder of its own, run
/// straight through and, in another folder, ended after step `exit_after` and resumed: the
/// resumed run's step losses are the straight run's last ones, bit for bit, and its test loss
/// the same. `every`: its --checkpoint-every. `results`: the results JSON's file name. Returns
/// the resumed run's output.
fn interrupted_equals_straight(bin: &str, args: &[&str], every: &str, exit_after: usize, results: &str) -> String {
    let with_dir = |dir: &Path| {
        let dir = dir.to_str().unwrap().to_string();
        let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        all.extend(["--checkpoint-dir", &dir, "--resume", "--checkpoint-every", every, "--results-dir", &dir, "--quiet"].map(String::from));
        all
    };
    let (straight_dir, interrupted_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight_args = with_dir(straight_dir.path());
    let straight = run(bin, &straight_args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(straight.status.success(), "{}", stderr(&straight));
    let straight = read_json(&straight_dir.path().join(results));

    let interrupted_args = with_dir(interrupted_dir.path());
    let interrupted_args: Vec<&str> = interrupted_args.iter().map(String::as_str).collect();
    let killed = run(bin, &interrupted_args, &[(TEST_EXIT_AFTER_STEP, &exit_after.to_string())]);
    assert!(!killed.status.success(), "the hook ends the run after step {exit_after}: {}", stderr(&killed));
    assert!(!interrupted_dir.path().join(results).exists(), "a killed run writes no results");
    let resumed = run(bin, &interrupted_args, &[]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let out = stdout(&resumed);
    let resumed = read_json(&interrupted_dir.path().join(results));

    let (all, tail) = (losses(&straight), losses(&resumed));
    let every: usize = every.parse().unwrap();
    let restored = exit_after / every * every;
    assert!(out.contains(&format!("(step {restored})")), "resumed from the checkpoint of step {restored}: {out}");
    assert_eq!(tail.len(), all.len() - restored, "the resumed run took the steps after {restored}");
    assert_eq!(tail, all[restored..], "the resumed run's losses are the uninterrupted run's");
    assert_eq!(resumed["test_loss"], straight["test_loss"]);
    out
}

fn generated_cifar(dir: &Path, train: usize) {
    let out = run(
        env!("CARGO_BIN_EXE_prepare_data"),
        &["generate", "--dataset", "cifar10", "--train", &train.to_string(), "--test", "40", "--out", dir.to_str().unwrap()],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn an_image_run_killed_mid_epoch_resumes_exactly() {
    let data = shared_data("mnist-5k");
    // 4,000 digits in batches of 200: 20 steps an epoch, checkpoints at 6, 12, 18; killed after
    // step 16 of epoch 1 (steps 21..40 are epoch 2): killed after 28, resumed from 24.
    let args = ["--dataset", "mnist", "--data-dir", data.to_str().unwrap(), "--device", "cpu", "--threads", "1", "--epochs", "2", "--batch-size", "200"];
    let out = interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise1"), &args, "6", 28, "exercise1-cnn-cpu.json");
    assert!(out.contains("after epoch 1 and 4 steps into epoch 2 (step 24)"), "{out}");
}

#[test]
fn a_language_model_with_dropout_killed_mid_epoch_resumes_exactly() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [200, 40, 40]);
    let args = [
        "--data-dir",
        data.path().to_str().unwrap(),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--emsize",
        "16",
        "--d-hid",
        "32",
        "--nhead",
        "2",
        "--nlayers",
        "2",
        "--tokenizer",
        "whitespace",
        "--epochs",
        "2",
        "--dropout",
        "0.2",
    ];
    interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise1_nlp"), &args, "4", 7, "exercise1_nlp-transformer-cpu.json");
}

#[test]
fn a_pipeline_killed_mid_epoch_resumes_exactly() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [120, 30, 30]);
    let args = [
        "pipeline",
        "--data-dir",
        data.path().to_str().unwrap(),
        "--chunks",
        "2",
        "--devices",
        "cpu,cpu",
        "--epochs",
        "2",
        "--emsize",
        "16",
        "--d-hid",
        "32",
        "--nhead",
        "2",
        "--nlayers",
        "2",
        "--threads",
        "1",
    ];
    interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise3"), &args, "3", 5, "exercise3_pipeline-transformer-cpu.json");
}

#[test]
fn two_data_parallel_ranks_killed_mid_epoch_resume_exactly() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 160);
    // 160 images over 2 ranks in batches of 16: 5 steps an epoch.
    let args = [
        "--model",
        "cnn",
        "--num-classes",
        "10",
        "--data-dir",
        data.path().to_str().unwrap(),
        "--device",
        "cpu",
        "--threads",
        "1",
        "--workers",
        "0",
        "--batch-size",
        "16",
        "--epochs",
        "3",
        "--nproc-per-node",
        "2",
    ];
    interrupted_equals_straight(env!("CARGO_BIN_EXE_exercise2"), &args, "3", 8, "exercise2-cnn-cpu.json");
}
