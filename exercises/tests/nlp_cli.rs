//! exercise1_nlp as a user runs it: learning on real WikiText-2 text, the results file, exact
//! resume through the flags, and clear errors.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{read_json, stderr, wikitext_sample};

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
    // The same small model and data in float32 and in bfloat16 autocast: both learn (well
    // below the uniform model's ln V), and the bfloat16 run's test loss stays within 10% of the
    // float32 one (SGD at lr 5 on a small corpus amplifies rounding differences).
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
            "--epochs",
            "2",
            "--results-dir",
            results.path().to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{precision}: {}", stderr(&out));
        read_json(&results.path().join("exercise1_nlp-transformer-cpu.json"))
    };
    let (full, bf16) = (run("32"), run("bf16-mixed"));
    assert_eq!((full["precision"].as_str(), bf16["precision"].as_str()), (Some("32"), Some("bf16-mixed")));
    let (a, b) = (full["test_loss"].as_f64().unwrap(), bf16["test_loss"].as_f64().unwrap());
    println!("2 epochs, d 32: test loss float32 {a:.4}, bf16-mixed {b:.4}");
    assert!(a != b, "bf16-mixed changed nothing: was autocast on?");
    assert!((a - b).abs() <= 0.1 * a, "float32 {a} vs bf16-mixed {b}");
    let uniform = (bf16["vocab"].as_f64().unwrap()).ln();
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
