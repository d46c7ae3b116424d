//! `--tensorboard`: the event files our runs write are read back by TensorBoard's own reader
//! (`EventAccumulator`, from the `tensorboard` package that `make test` installs into the
//! virtualenv), and hold the run's figures.
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use support::{read_json, shared_data, stderr};

/// The scalars of a TensorBoard run directory, as TensorBoard reads them: tag → (step, value).
fn read_with_tensorboard(run: &Path) -> serde_json::Map<String, serde_json::Value> {
    let python = std::env::var_os("TORCH_PYTHON").expect(
        "this test reads the event files with TensorBoard's Python reader: run it through scripts/with-torch \
         (make test does), which sets TORCH_PYTHON",
    );
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference/read_tensorboard.py");
    let out = Command::new(python).arg(script).arg(run).output().expect("python runs");
    assert!(
        out.status.success(),
        "TensorBoard's reader failed (is `tensorboard` installed? `make test` installs it with scripts/python-tools):\n{}",
        stderr(&out)
    );
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap().as_object().unwrap().clone()
}

fn values(scalars: &serde_json::Map<String, serde_json::Value>, tag: &str) -> Vec<(u64, f64)> {
    scalars[tag].as_array().unwrap_or_else(|| panic!("no {tag}")).iter().map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap())).collect()
}

#[test]
fn tensorboard_reads_the_language_models_scalars() {
    let data = tempfile::tempdir().unwrap();
    let real = shared_data("wikitext-2");
    let take = |name: &str, n: usize| std::fs::read_to_string(real.join(name)).unwrap().lines().take(n).collect::<Vec<_>>().join("\n") + "\n";
    std::fs::write(data.path().join("train.txt"), take("valid.txt", 200)).unwrap();
    std::fs::write(data.path().join("valid.txt"), take("valid.txt", 40)).unwrap();
    std::fs::write(data.path().join("test.txt"), take("test.txt", 40)).unwrap();
    let (results, board) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = Command::new(env!("CARGO_BIN_EXE_exercise1_nlp"))
        .args(["--device", "cpu", "--quiet", "--emsize", "16", "--d-hid", "32", "--nhead", "2", "--nlayers", "1", "--epochs", "2"])
        .args(["--tokenizer", "whitespace", "--batch-size", "4"])
        .arg("--data-dir")
        .arg(data.path())
        .arg("--results-dir")
        .arg(results.path())
        .arg("--tensorboard")
        .arg(board.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json = read_json(&results.path().join("exercise1_nlp-transformer-cpu.json"));
    let scalars = read_with_tensorboard(&board.path().join("exercise1_nlp-transformer-cpu"));

    let steps = json["steps"].as_u64().unwrap();
    let history = json["history"].as_array().unwrap();
    let eval_loss = values(&scalars, "epoch/eval_loss");
    assert_eq!(eval_loss.len(), 2);
    for (logged, epoch) in eval_loss.iter().zip(history) {
        let expected = epoch["eval_loss"].as_f64().unwrap();
        assert!((logged.1 - expected).abs() <= 1e-6 * expected, "eval loss {} vs {expected}", logged.1);
    }
    assert_eq!(eval_loss[1].0, steps, "epoch figures are logged at the epoch's last step");
    let ppl = values(&scalars, "epoch/eval_perplexity");
    assert!((ppl[1].1 - eval_loss[1].1.exp()).abs() <= 1e-4 * ppl[1].1);
    // StepLR: the second epoch's learning rate is lr·γ.
    let lr = values(&scalars, "epoch/lr");
    assert!((lr[0].1 - 5.0).abs() < 1e-6 && (lr[1].1 - 5.0 * 0.95).abs() < 1e-5, "{lr:?}");
    // Every 10 steps: the training loss (finite), the learning rate, the throughput (positive).
    let loss = values(&scalars, "train/loss");
    assert_eq!(loss.len() as u64, steps / 10, "train/loss every 10 of {steps} steps");
    assert!(loss.iter().all(|(step, v)| step % 10 == 0 && v.is_finite()));
    assert!(values(&scalars, "train/throughput").iter().all(|(_, v)| *v > 0.0));
}
