//! `make gpu-check` (bench/gpu_check.py) where there is no GPU: one line and exit 2; its table
//! from a recorded result; and the harness itself, its checks run on the CPU at tiny sizes
//! (`--device cpu`), so that what it claims on a GPU is computed by tested code.
//!
//! The script runs under `$TORCH_PYTHON`, which `scripts/with-torch` sets.
mod support;

use std::path::PathBuf;
use std::process::{Command, Output};
use support::stderr;

fn gpu_check(args: &[&str]) -> Output {
    let python = std::env::var_os("TORCH_PYTHON").expect("TORCH_PYTHON is not set: run the tests through scripts/with-torch");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_exercise1")).parent().unwrap().to_path_buf();
    Command::new(python).arg(root.join("bench/gpu_check.py")).arg("--bin").arg(bin).args(args).output().expect("gpu_check.py runs")
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

#[test]
fn the_table_of_a_recorded_check_names_every_path_and_fails_with_it() {
    let recorded = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference/gpu-check-recorded.json");
    let out = gpu_check(&["--table", recorded.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "a failed check fails the command: {}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    let expected = [
        "gpu-check on Test GPU (a recorded result for the table writer's test, not a measurement) (1 GPU(s)), 2026-11-18 11:06 UTC, commit abc1234, 612 s",
        "| path | verdict | figure | ratio to PyTorch |",
        "| exercise1 cnn 32 | pass | loss 2.303 -> 1.981 in 40 steps, 41,000 images/s |  |",
        "| exercise1 cnn --cuda-graph = eager | fail | losses differ by 3.10e-02 (relative) over 40 steps, more than 2e-03 |  |",
        "| timing exercise1 resnet34 32 | below goal | 6,100 vs 6,640 images/s (goal 1.1x) | 0.92x |",
        "| timing exercise1 cnn 32 --cuda-graph | pass | 70,000 vs 39,586 images/s (goal 1.5x) | 1.77x |",
        "1 below goal, 1 fail, 2 pass",
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

#[test]
fn the_harness_checks_what_it_claims_on_the_cpu() {
    let results = tempfile::tempdir().unwrap();
    let out = gpu_check(&[
        "--device",
        "cpu",
        "--no-timings",
        "--results",
        results.path().to_str().unwrap(),
        "--only",
        "exercise1 cnn 32",
        "--only",
        "fused kernel",
        "--only",
        "checkpoint",
        "--only",
        "pipeline",
        "--only",
        "profiler",
        "--only",
        "from JPEG files",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    for row in [
        "| exercise1 cnn 32 | pass | loss ",
        "| exercise1 cnn Adam: fused kernel = per-parameter | pass | equal over 5 steps",
        "| exercise1 checkpoint + --resume | pass | epoch 2 after --resume = straight",
        "| exercise3 pipeline 1f1b, both stages on cpu | pass | ",
        "| --profile: LibTorch's profiler, operators and kernels | pass | ",
        "| exercise1 resnet50 from JPEG files, batch 4: the loader keeps up | pass | ",
    ] {
        assert!(stdout.contains(row), "no row {row:?}: {stdout}");
    }
    assert!(stdout.contains("with gpipe"), "schedules compared: {stdout}");
    let recorded: serde_json::Value = serde_json::from_slice(&std::fs::read(results.path().join("gpu-check-cpu.json")).unwrap()).unwrap();
    let checks = recorded["checks"].as_array().unwrap();
    assert!(checks.len() >= 7 && checks.iter().all(|c| c["verdict"] == "pass"), "{recorded}");
    assert!(results.path().join("gpu-check-cpu.md").exists());
}
