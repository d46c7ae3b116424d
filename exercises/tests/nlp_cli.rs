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

/// `--loss-chunks N` trains the same model as the whole batch's logits: in float32 each step's
/// loss and the test loss equal to float32's rounding (1e-5 relative), for a chunk count that
/// does not divide the batch's 20 × 35 tokens; the run's peak memory is lower.
#[test]
fn loss_chunks_train_the_same_model_as_the_whole_batchs_logits() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [300, 40, 40]);
    let run = |extra: &[&str]| {
        let results = tempfile::tempdir().unwrap();
        let mut args = vec!["--data-dir", data.path().to_str().unwrap(), "--device", "cpu", "--quiet", "--threads", "1"];
        args.extend(["--emsize", "32", "--d-hid", "64", "--nhead", "2", "--nlayers", "1", "--dropout", "0", "--max-steps", "6", "--epochs", "1"]);
        args.extend(["--results-dir", results.path().to_str().unwrap()]);
        args.extend(extra);
        let out = exercise1_nlp(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        read_json(&results.path().join("exercise1_nlp-transformer-cpu.json"))
    };
    let (full, chunked) = (run(&[]), run(&["--loss-chunks", "3"]));
    let losses = |run: &serde_json::Value| run["step_losses"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect::<Vec<_>>();
    let (a, b) = (losses(&full), losses(&chunked));
    assert_eq!(a.len(), 6, "{a:?}");
    for (step, (a, b)) in a.iter().zip(&b).enumerate() {
        assert!((a - b).abs() <= 1e-5 * a, "step {step}: loss {b} with --loss-chunks 3, {a} without");
    }
    let (ta, tb) = (full["test_loss"].as_f64().unwrap(), chunked["test_loss"].as_f64().unwrap());
    assert!((ta - tb).abs() <= 1e-5 * ta, "test loss {tb} with --loss-chunks 3, {ta} without");
    let peak = |run: &serde_json::Value| run["peak_memory_bytes"].as_f64().unwrap();
    println!("--loss-chunks 3: losses {b:?} against {a:?}; peak {:.1} MiB against {:.1} MiB", peak(&chunked) / 1048576.0, peak(&full) / 1048576.0);
    assert!(peak(&chunked) < peak(&full), "--loss-chunks did not lower the peak");
}

/// `--loss-chunks` is the whole output layer's on one rank: with tensor-parallel shards,
/// pipeline stages or ZeRO-3 it is one line and exit 2 before anything trains (`--estimate-memory`
/// refuses it alike); 0 chunks is clap's range error.
#[test]
fn loss_chunks_with_shards_stages_or_zero3_are_refused_in_one_line() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [50, 20, 20]);
    let results = tempfile::tempdir().unwrap();
    let common = ["--data-dir", data.path().to_str().unwrap(), "--device", "cpu", "--emsize", "32", "--d-hid", "32", "--nhead", "2", "--nlayers", "2"];
    let results_dir = ["--results-dir", results.path().to_str().unwrap(), "--loss-chunks", "4"];
    let pipeline = Command::new(env!("CARGO_BIN_EXE_exercise3")).arg("pipeline").args(common).args(results_dir).output().unwrap();
    let runs = [
        ("exercise3 pipeline", pipeline, "not built for tensor-parallel shards (--tp, exercise3 tp) or pipeline stages"),
        ("--tp 1", exercise1_nlp(&[&common[..], &results_dir, &["--tp", "1"]].concat()), "not built for tensor-parallel shards"),
        (
            "--zero 3",
            exercise1_nlp(&[&common[..], &results_dir, &["--zero", "3", "--estimate-memory"]].concat()),
            "not built for parameters sharded over the replicas",
        ),
        ("--loss-chunks 0", exercise1_nlp(&["--loss-chunks", "0"]), "0 is not in 1..="),
    ];
    for (what, out, expected) in runs {
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "{what}: {err}");
        assert!(err.contains(expected), "{what}: {err}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("epoch 1"), "{what}: nothing trains");
    }
}
