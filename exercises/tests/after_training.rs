//! What participants do after training: keep a checkpoint per epoch (`--keep-checkpoints`, as
//! Lightning's `ModelCheckpoint(save_top_k)`) and test a trained model without training
//! (`--eval-only`, as Lightning's `trainer.test(ckpt_path=...)`).
mod support;

use std::process::{Command, Output};
use support::{read_json, stderr, wikitext_sample};

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin).args(args).env_remove("RUST_BACKTRACE").output().unwrap()
}

#[test]
fn per_epoch_checkpoints_are_kept_and_any_of_them_tested_without_training() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck, results) = (dir.path().join("data"), dir.path().join("ck"), dir.path().join("results"));
    let out = run(env!("CARGO_BIN_EXE_prepare_data"), &["generate", "--dataset", "cifar10", "--train", "60", "--test", "20", "--out", data.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let exercise1 = env!("CARGO_BIN_EXE_exercise1");
    let common = ["--device", "cpu", "--data-dir", data.to_str().unwrap(), "--batch-size", "20", "--quiet"];
    let train =
        [&common[..], &["--epochs", "3", "--checkpoint-dir", ck.to_str().unwrap(), "--keep-checkpoints", "2", "--results-dir", results.to_str().unwrap()]]
            .concat();
    let out = run(exercise1, &train);
    assert!(out.status.success(), "{}", stderr(&out));

    // The latest, the one it replaced (the fallback should it be unreadable), and the last two
    // epochs' (epoch 1's removed when epoch 3's was kept); and the run's lock (one writer).
    let mut files: Vec<String> = std::fs::read_dir(&ck).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    let kept = [
        "exercise1-cnn-cpu-epoch2.safetensors",
        "exercise1-cnn-cpu-epoch3.safetensors",
        "exercise1-cnn-cpu.lock",
        "exercise1-cnn-cpu.previous.safetensors",
        "exercise1-cnn-cpu.safetensors",
    ];
    assert_eq!(files, kept);
    let read = |name: &str| std::fs::read(ck.join(name)).unwrap();
    assert_eq!(read("exercise1-cnn-cpu-epoch3.safetensors"), read("exercise1-cnn-cpu.safetensors"));
    assert_ne!(read("exercise1-cnn-cpu-epoch2.safetensors"), read("exercise1-cnn-cpu.safetensors"));
    assert_eq!(read("exercise1-cnn-cpu-epoch2.safetensors"), read("exercise1-cnn-cpu.previous.safetensors"));

    // Testing the latest gives the trained run's test figures, and trains nothing.
    let trained = read_json(&results.join("exercise1-cnn-cpu.json"));
    let latest = ck.join("exercise1-cnn-cpu.safetensors");
    let eval = [&common[..], &["--eval-only", "--checkpoint", latest.to_str().unwrap(), "--results-dir", results.to_str().unwrap()]].concat();
    let out = run(exercise1, &eval);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("--eval-only: exercise1-cnn-cpu from") && stdout.contains("(nothing trained): test accuracy"), "{stdout}");
    let tested = read_json(&results.join("exercise1-cnn-cpu.eval-only.json"));
    assert!((tested["test_loss"].as_f64().unwrap() - trained["test_loss"].as_f64().unwrap()).abs() < 1e-6, "{tested} vs {trained}");
    assert_eq!(tested["test_acc"], trained["test_acc"]);
    assert_eq!(read_json(&results.join("exercise1-cnn-cpu.json")), trained, "the training run's results stay as they were");
    assert_eq!(read("exercise1-cnn-cpu.safetensors"), read("exercise1-cnn-cpu-epoch3.safetensors"), "nothing was checkpointed");

    // An older epoch's file is another model: other figures.
    let older = ck.join("exercise1-cnn-cpu-epoch2.safetensors");
    let out = run(exercise1, &[&common[..], &["--eval-only", "--checkpoint", older.to_str().unwrap(), "--results-dir", results.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let epoch2 = read_json(&results.join("exercise1-cnn-cpu.eval-only.json"));
    assert_ne!(epoch2["test_loss"], tested["test_loss"]);
}

#[test]
fn a_finished_run_resubmitted_with_resume_leaves_its_results_as_they_are() {
    // What a Slurm requeue or a resubmitted job script does: the same command line again.
    let dir = tempfile::tempdir().unwrap();
    let (data, ck, results) = (dir.path().join("data"), dir.path().join("ck"), dir.path().join("results"));
    let out = run(env!("CARGO_BIN_EXE_prepare_data"), &["generate", "--dataset", "cifar10", "--train", "40", "--test", "20", "--out", data.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let exercise1 = env!("CARGO_BIN_EXE_exercise1");
    let job = |epochs: &str| {
        let args = ["--model", "cnn", "--device", "cpu", "--data-dir", data.to_str().unwrap(), "--batch-size", "20", "--quiet", "--epochs", epochs, "--resume"];
        run(exercise1, &[&args[..], &["--checkpoint-dir", ck.to_str().unwrap(), "--results-dir", results.to_str().unwrap()]].concat())
    };
    let out = job("2");
    assert!(out.status.success(), "{}", stderr(&out));
    let files = ["exercise1-cnn-cpu.json", "exercise1.csv", "exercise1-cnn-cpu.svg"];
    let read = |name: &str| std::fs::read(results.join(name)).unwrap();
    let before: Vec<Vec<u8>> = files.iter().map(|f| read(f)).collect();
    assert_eq!(read_json(&results.join(files[0]))["steps"], 4);

    let again = job("2");
    assert!(again.status.success(), "{}", stderr(&again));
    let stdout = String::from_utf8_lossy(&again.stdout);
    let line = format!("already at epoch 2 of 2, nothing to train; results left as they are ({})", results.join(files[0]).display());
    assert_eq!(stdout.matches(&line).count(), 1, "{stdout}");
    assert!(!stdout.contains("wrote"), "nothing is written: {stdout}");
    for (name, bytes) in files.iter().zip(&before) {
        assert!(read(name) == *bytes, "{name} was rewritten by the resubmitted run");
    }

    // A longer run resumed trains on and writes its results, as before.
    let longer = job("3");
    assert!(longer.status.success(), "{}", stderr(&longer));
    let json = read_json(&results.join(files[0]));
    assert_eq!((json["steps"].as_u64(), json["resumed_epochs"].as_u64(), json["history"].as_array().map(Vec::len)), (Some(2), Some(2), Some(1)));
}

#[test]
fn report_names_a_results_file_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let (data, results) = (dir.path().join("data"), dir.path().join("results"));
    let out = run(env!("CARGO_BIN_EXE_prepare_data"), &["generate", "--dataset", "cifar10", "--train", "40", "--test", "20", "--out", data.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run(
        env!("CARGO_BIN_EXE_exercise1"),
        &[
            "--device",
            "cpu",
            "--data-dir",
            data.to_str().unwrap(),
            "--batch-size",
            "20",
            "--epochs",
            "1",
            "--quiet",
            "--results-dir",
            results.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // Another run's file, torn as a write cut short leaves it (the first half of a real one).
    let whole = std::fs::read(results.join("exercise1-cnn-cpu.json")).unwrap();
    let torn = results.join("exercise1-resnet34-cpu.json");
    std::fs::write(&torn, &whole[..whole.len() / 2]).unwrap();

    let out = run(env!("CARGO_BIN_EXE_report"), &["--results-dir", results.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let warnings: Vec<&str> = std::str::from_utf8(&out.stderr).unwrap().lines().filter(|l| l.starts_with("warning:")).collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains(&format!("could not read {}: not valid JSON", torn.display())), "{}", warnings[0]);
    let page = std::fs::read_to_string(results.join("README.md")).unwrap();
    assert!(page.contains("### exercise1 · cnn") && !page.contains("resnet34"), "{page}");
}

#[test]
fn eval_only_needs_a_checkpoint_that_exists() {
    let exercise1 = env!("CARGO_BIN_EXE_exercise1");
    let out = run(exercise1, &["--device", "cpu", "--eval-only"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--eval-only tests a trained model: give its --checkpoint FILE"), "{}", stderr(&out));
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = run(env!("CARGO_BIN_EXE_prepare_data"), &["generate", "--dataset", "cifar10", "--train", "40", "--test", "20", "--out", data.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let missing = dir.path().join("none.safetensors");
    let out = run(
        exercise1,
        &[
            "--device",
            "cpu",
            "--data-dir",
            data.to_str().unwrap(),
            "--batch-size",
            "20",
            "--eval-only",
            "--checkpoint",
            missing.to_str().unwrap(),
            "--results-dir",
            dir.path().to_str().unwrap(),
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!("--eval-only: no checkpoint at {}", missing.display())), "{}", stderr(&out));
}

#[test]
fn a_language_model_is_tested_from_its_checkpoint_folder() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ck, results) = (dir.path().join("data"), dir.path().join("ck"), dir.path().join("results"));
    std::fs::create_dir_all(&data).unwrap();
    wikitext_sample(&data, [200, 40, 40]);
    let nlp = env!("CARGO_BIN_EXE_exercise1_nlp");
    let common = [
        "--device",
        "cpu",
        "--data-dir",
        data.to_str().unwrap(),
        "--emsize",
        "32",
        "--d-hid",
        "32",
        "--nhead",
        "2",
        "--nlayers",
        "1",
        "--epochs",
        "1",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--results-dir",
        results.to_str().unwrap(),
        "--quiet",
    ];
    let out = run(nlp, &common);
    assert!(out.status.success(), "{}", stderr(&out));
    let trained = read_json(&results.join("exercise1_nlp-transformer-cpu.json"));
    let out = run(nlp, &[&common[..], &["--eval-only", "--resume"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let tested = read_json(&results.join("exercise1_nlp-transformer-cpu.eval-only.json"));
    assert!((tested["test_loss"].as_f64().unwrap() - trained["test_loss"].as_f64().unwrap()).abs() < 1e-6, "{tested} vs {trained}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("test perplexity"));
}
