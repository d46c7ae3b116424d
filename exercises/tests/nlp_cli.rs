//! exercise1_nlp as a user runs it: learning on real WikiText-2 text, the results file, exact
//! resume through the flags, and clear errors.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{read_json, stderr, wikitext_sample, PRECISION_TEST_EPOCHS, PRECISION_TEST_LR};

fn exercise1_nlp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_exercise1_nlp")).args(args).output().expect("exercise1_nlp runs")
}

#[test]
fn a_small_transformer_learns_real_wikitext() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [usize::MAX, 400, usize::MAX]);
    let results = tempfile::tempdir().unwrap();
    let out = exercise1_nlp(&[
        "--data-dir",
        data.path().to_str().unwrap(),
        "--device",
        "cpu",
        "--quiet",
        "--emsize",
        "64",
        "--d-hid",
        "128",
        "--nhead",
        "2",
        "--nlayers",
        "1",
        "--dropout",
        "0.1",
        "--epochs",
        "2",
        "--results-dir",
        results.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json = read_json(&results.path().join("exercise1_nlp-transformer-cpu.json"));
    let (ppl, unigram) = (json["test_ppl"].as_f64().unwrap(), json["unigram_test_ppl"].as_f64().unwrap());
    println!(
        "Transformer (d 64, 1 layer), 2 epochs on the real WikiText-2 valid split: test perplexity {ppl:.1} \
         vs {unigram:.1} for the add-one unigram model of the same split"
    );
    assert!(ppl < 0.75 * unigram, "test perplexity {ppl} is not well below the unigram perplexity {unigram}");
    assert_eq!(json["throughput_unit"], "tokens/s");
    assert_eq!(json["tokenizer"], "basic_english");
    assert_eq!(json["vocab"], 12_000, "basic_english vocabulary of the valid split");
    let v = 12_000i64;
    let expected_params = 2 * 64 * v + v + (4 * 64 * 64 + 4 * 64) + 2 * 64 * 128 + 128 + 64 + 4 * 64;
    assert_eq!(json["params"], expected_params);
    assert!(json["throughput"].as_f64().unwrap() > 0.0);
}

#[test]
fn resume_through_the_flags_matches_a_straight_run() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [300, 60, 60]);
    let run = |epochs: &str, ck: &Path| {
        let out = exercise1_nlp(&[
            "--data-dir",
            data.path().to_str().unwrap(),
            "--device",
            "cpu",
            "--quiet",
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
            epochs,
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--resume",
            "--results-dir",
            ck.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        read_json(&ck.join("exercise1_nlp-transformer-cpu.json"))
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = run("2", a.path());
    let first = run("1", b.path());
    let resumed = run("2", b.path());
    assert_eq!(resumed["resumed_epochs"], 1);
    assert_eq!(resumed["steps"], first["steps"], "the resumed run trained one epoch");
    // StepLR: the second epoch ran at lr·γ in both runs.
    assert_eq!(resumed["history"][0]["lr"], straight["history"][1]["lr"]);
    let (x, y) = (straight["test_loss"].as_f64().unwrap(), resumed["test_loss"].as_f64().unwrap());
    assert!((x - y).abs() <= 1e-6 * x.abs(), "test loss straight {x} vs resumed {y}");
    assert_ne!(first["test_loss"], straight["test_loss"], "the second epoch changed the model");
}

#[test]
fn bf16_mixed_precision_trains_on_the_cpu_close_to_float32() {
    // The same small model and data in float32 and in bfloat16 autocast. The first step's loss
    // (same weights, same batch) differs only by bfloat16's rounding of the logits (one part in
    // 2^8); the trained models end within 1% of each other (measured: 0.02% at most), and well
    // below the uniform model's ln V.
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [200, 40, 40]);
    let run = |precision: &str| {
        let results = tempfile::tempdir().unwrap();
        let out = exercise1_nlp(&[
            "--data-dir",
            data.path().to_str().unwrap(),
            "--device",
            "cpu",
            "--quiet",
            "--precision",
            precision,
            "--emsize",
            "32",
            "--d-hid",
            "64",
            "--nhead",
            "2",
            "--nlayers",
            "1",
            "--dropout",
            "0",
            "--tokenizer",
            "whitespace",
            "--lr",
            PRECISION_TEST_LR,
            "--epochs",
            PRECISION_TEST_EPOCHS,
            "--results-dir",
            results.path().to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{precision}: {}", stderr(&out));
        read_json(&results.path().join("exercise1_nlp-transformer-cpu.json"))
    };
    let (full, bf16) = (run("32"), run("bf16-mixed"));
    assert_eq!((full["precision"].as_str(), bf16["precision"].as_str()), (Some("32"), Some("bf16-mixed")));
    let first = |run: &serde_json::Value| run["step_losses"][0].as_f64().unwrap();
    let (a, b) = (full["test_loss"].as_f64().unwrap(), bf16["test_loss"].as_f64().unwrap());
    let uniform = (bf16["vocab"].as_f64().unwrap()).ln();
    println!(
        "{PRECISION_TEST_EPOCHS} epochs at lr {PRECISION_TEST_LR}, d 32: first step's loss float32 {:.6}, bf16-mixed {:.6}; \
         test loss float32 {a:.4}, bf16-mixed {b:.4}; ln V {uniform:.4}",
        first(&full),
        first(&bf16)
    );
    assert!(a != b, "bf16-mixed changed nothing: was autocast on?");
    assert!((first(&full) - first(&bf16)).abs() <= first(&full) / 256.0, "first step: float32 {} vs bf16-mixed {}", first(&full), first(&bf16));
    assert!((a - b).abs() <= 0.01 * a, "float32 {a} vs bf16-mixed {b}");
    assert!(b < 0.85 * uniform, "bf16-mixed did not learn: test loss {b} vs ln V = {uniform}");
}

#[test]
fn impossible_model_shapes_are_usage_errors() {
    for (flags, expected) in [
        (vec!["--emsize", "30", "--nhead", "4"], "--emsize 30 must be divisible by --nhead 4"),
        (vec!["--emsize", "9", "--nhead", "3"], "must be even"),
        (vec!["--bptt", "0"], "--bptt must be at least 1"),
        (vec!["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    ] {
        let mut args = vec!["--device", "cpu"];
        args.extend(flags);
        let out = exercise1_nlp(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expected), "{args:?}: {}", stderr(&out));
    }
    let out = exercise1_nlp(&["--tokenizer", "spacy"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("whitespace, basic_english"), "{}", stderr(&out));
}

#[test]
fn cuda_without_a_gpu_and_missing_data_are_one_clear_line() {
    let out = exercise1_nlp(&["--device", "cuda"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("no CUDA device is available"), "{}", stderr(&out));
    let out = exercise1_nlp(&["--device", "cpu", "--data-dir", "/nonexistent/wikitext"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent/wikitext does not exist") && err.contains("make data"), "{err}");
}
