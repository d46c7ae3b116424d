//! Memory as a user sees it: every run reports its peak per rank, and `--estimate-memory`
//! predicts it before launch, within 5% of what training then measures: the Transformer on the
//! CPU whole in one process, under ZeRO 1 to 3 and HSDP, cut over tensor-parallel shards (with
//! and without sequence parallelism) and as pipeline stages (GPipe, 1F1B, interleaved).
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{read_json, stderr, wikitext_sample};

fn run(binary: &str, args: &[&str]) -> Output {
    let path = match binary {
        "exercise1_nlp" => env!("CARGO_BIN_EXE_exercise1_nlp"),
        "exercise3" => env!("CARGO_BIN_EXE_exercise3"),
        _ => env!("CARGO_BIN_EXE_exercise1"),
    };
    Command::new(path).args(args).output().expect("the binary runs")
}

/// The only JSON file in `dir` whose name ends with `suffix`.
fn json_ending(dir: &Path, suffix: &str) -> serde_json::Value {
    let found: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.to_string_lossy().ends_with(suffix)).collect();
    assert_eq!(found.len(), 1, "one {suffix} in {}: {found:?}", dir.display());
    read_json(&found[0])
}

/// Estimates the job `args` describes, then trains it for 3 steps: per rank, the estimate's
/// total and what training held at its peak over what it held before (MiB).
fn estimated_and_measured(binary: &str, args: &[&str]) -> Vec<(f64, f64)> {
    let (estimate_dir, train_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut estimate_args = args.to_vec();
    estimate_args.extend(["--estimate-memory", "--results-dir", estimate_dir.path().to_str().unwrap()]);
    let out = run(binary, &estimate_args);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("--estimate-memory:") && stdout.contains("| parameters | gradients | optimizer | activations |"), "{stdout}");
    assert!(!stdout.contains("epoch 1"), "nothing trains: {stdout}");
    let estimate = json_ending(estimate_dir.path(), ".memory-estimate.json");
    let totals: Vec<f64> = estimate["ranks"].as_array().unwrap().iter().map(|r| r["total"].as_f64().unwrap() / 1048576.0).collect();

    let mut train_args = args.to_vec();
    train_args.extend(["--max-steps", "3", "--quiet", "--results-dir", train_dir.path().to_str().unwrap()]);
    let out = run(binary, &train_args);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("peak memory in training: rank 0 cpu: ") && stdout.contains("peak memory (MiB)"), "{stdout}");
    let results = json_ending(train_dir.path(), "-cpu.json");
    let peaks = results["peak_memory"].as_array().unwrap();
    assert_eq!(peaks.len(), results["world_size"].as_u64().unwrap() as usize, "one entry per rank");
    let measured: Vec<f64> = peaks
        .iter()
        .map(|p| {
            assert!(p["evaluation_peak_bytes"].as_i64().is_some() && p["peak_rss_bytes"].as_i64().unwrap() > 0, "{p}");
            (p["training_peak_bytes"].as_i64().unwrap() - p["baseline_bytes"].as_i64().unwrap()) as f64 / 1048576.0
        })
        .collect();
    let largest = peaks.iter().map(|p| p["training_peak_bytes"].as_i64().unwrap().max(p["evaluation_peak_bytes"].as_i64().unwrap())).max();
    assert_eq!(results["peak_memory_bytes"].as_i64(), largest, "the CSV's figure is the largest rank's peak");
    // One estimate row per stage (its tensor-parallel shards are consecutive ranks); one for all
    // ranks when they hold alike.
    assert_eq!(measured.len() % totals.len(), 0, "{totals:?} against {measured:?}");
    (0..measured.len()).map(|rank| (totals[rank * totals.len() / measured.len()], measured[rank])).collect()
}

/// Asserts each rank's estimate within `bound` (a fraction, both directions) of its measured
/// peak, printing every figure.
fn assert_within(what: &str, pairs: &[(f64, f64)], bound: f64) {
    for (rank, &(estimated, measured)) in pairs.iter().enumerate() {
        println!("{what}, rank {rank}: estimated {estimated:.2} MiB, measured {measured:.2} MiB ({:+.1}%)", 100.0 * (estimated / measured - 1.0));
    }
    for (rank, &(estimated, measured)) in pairs.iter().enumerate() {
        assert!(
            (estimated / measured - 1.0).abs() <= bound,
            "{what}, rank {rank}: estimated {estimated:.2} MiB, measured {measured:.2} MiB ({:+.1}%, bound {}%)",
            100.0 * (estimated / measured - 1.0),
            100.0 * bound
        );
    }
}

/// The estimate's bound, both ways, for every layout the tests below measure.
const WITHIN: f64 = 0.05;

/// A small Transformer (d 128, d_hid 256, 2 heads, 4 layers, dropout on), Adam, on a 2,000-line
/// sample of WikiText-2, then `extra`: the estimate and the training peak of each rank.
fn small_transformer(binary: &str, extra: &[&str]) -> Vec<(f64, f64)> {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [2000, 20, 20]);
    let mut args: Vec<&str> = Vec::new();
    // (exercise3's command comes first.)
    let (command, extra) = match extra.first() {
        Some(&c) if c == "tp" || c == "pipeline" => (Some(c), &extra[1..]),
        _ => (None, extra),
    };
    args.extend(command);
    args.extend(["--data-dir", data.path().to_str().unwrap(), "--device", "cpu", "--threads", "1"]);
    args.extend(["--emsize", "128", "--d-hid", "256", "--nhead", "2", "--nlayers", "4", "--optimizer", "adam", "--lr", "1e-3"]);
    args.extend(extra);
    estimated_and_measured(binary, &args)
}

#[test]
fn the_estimate_of_the_whole_transformer_is_within_5_percent_of_its_peak() {
    let pairs = small_transformer("exercise1_nlp", &[]);
    assert_within("exercise1_nlp, 1 rank", &pairs, WITHIN);
}

#[test]
fn the_estimate_under_each_zero_stage_is_within_5_percent_of_its_peak() {
    for zero in ["1", "2", "3"] {
        let pairs = small_transformer("exercise1_nlp", &["--nproc-per-node", "2", "--zero", zero]);
        assert_eq!(pairs.len(), 2);
        assert_within(&format!("exercise1_nlp, ZeRO-{zero} over 2 ranks"), &pairs, WITHIN);
    }
}

/// One sequence per rank: the peak is the update's (averaging the gradients, ZeRO's flattened
/// buckets, slices and block gradient, publishing the blocks), not the passes'.
#[test]
fn the_estimate_of_the_update_under_data_parallelism_and_each_zero_stage_is_within_5_percent_of_its_peak() {
    for zero in ["0", "1", "2", "3"] {
        let pairs = small_transformer("exercise1_nlp", &["--nproc-per-node", "2", "--zero", zero, "--batch-size", "1"]);
        assert_eq!(pairs.len(), 2);
        assert_within(&format!("exercise1_nlp, 1 sequence per rank, ZeRO-{zero} over 2 ranks"), &pairs, WITHIN);
    }
}

#[test]
fn the_estimate_under_hsdp_is_within_5_percent_of_its_peak() {
    let pairs = small_transformer("exercise1_nlp", &["--nproc-per-node", "4", "--zero", "3", "--shard-group", "2", "--batch-size", "8"]);
    assert_eq!(pairs.len(), 4);
    assert_within("exercise1_nlp, HSDP: ZeRO-3 in 2 groups of 2 ranks", &pairs, WITHIN);
}

#[test]
fn the_estimate_of_each_tensor_parallel_shard_is_within_5_percent_of_its_peak() {
    for sequence in [false, true] {
        let mut extra = vec!["tp", "--tp", "2", "--nproc-per-node", "2", "--batch-size", "16"];
        if sequence {
            extra.push("--sequence-parallel");
        }
        let pairs = small_transformer("exercise3", &extra);
        assert_eq!(pairs.len(), 2);
        assert_within(&format!("exercise3 tp over 2 ranks{}", if sequence { ", sequence parallel" } else { "" }), &pairs, WITHIN);
    }
}

#[test]
fn the_estimate_of_each_pipeline_stage_is_within_5_percent_of_its_peak() {
    for schedule in ["gpipe", "1f1b"] {
        let pairs = small_transformer("exercise3", &["pipeline", "--batch-size", "16", "--chunks", "4", "--schedule", schedule, "--nproc-per-node", "2"]);
        assert_eq!(pairs.len(), 2);
        assert!(pairs[1].1 > pairs[0].1, "the last stage holds the logits: {pairs:?}");
        assert_within(&format!("exercise3 pipeline, 2 ranks, {schedule} over 4 micro-batches"), &pairs, WITHIN);
    }
    let interleaved = ["pipeline", "--batch-size", "16", "--chunks", "4", "--schedule", "interleaved", "--virtual-stages", "2", "--nproc-per-node", "2"];
    let pairs = small_transformer("exercise3", &interleaved);
    assert_eq!(pairs.len(), 2);
    assert_within("exercise3 pipeline, 2 ranks of 2 virtual stages each, interleaved over 4 micro-batches", &pairs, WITHIN);
}

/// GPipe holds every micro-batch's activations when the last stage's backward passes start: from
/// the second on, the output layer's fresh gradient is made beside them and the gradients summed
/// so far; under tensor parallelism the vocabulary-parallel loss keeps two logits-sized tensors
/// per micro-batch. (Missing both, the estimate of the last stage was 22% too low.)
#[test]
fn the_estimate_of_tensor_parallel_stages_holding_many_micro_batches_is_within_5_percent_of_its_peak() {
    let pairs = small_transformer(
        "exercise3",
        &["tp", "--tp", "2", "--pp", "2", "--batch-size", "16", "--chunks", "8", "--schedule", "gpipe", "--nproc-per-node", "4"],
    );
    assert_eq!(pairs.len(), 4);
    assert_within("exercise3 tp, 2 stages of 2 shards, gpipe over 8 micro-batches", &pairs, WITHIN);
}

#[test]
fn an_image_model_is_estimated_from_a_probe_on_the_cpu() {
    let results = tempfile::tempdir().unwrap();
    let out = run("exercise1", &["--model", "resnet34", "--device", "cpu", "--estimate-memory", "--results-dir", results.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("21,797,672 parameters") && stdout.contains("activations measured on the CPU"), "{stdout}");
    let estimate = json_ending(results.path(), ".memory-estimate.json");
    let row = &estimate["ranks"][0];
    let mib = |field: &str| row[field].as_f64().unwrap() / 1048576.0;
    // Adam: parameters and gradients 4 bytes each, two moments 8 (21,797,672 parameters).
    assert!((mib("parameters") - 83.15).abs() < 0.1 && (mib("optimizer") - 166.3).abs() < 0.1, "{row}");
    assert!(mib("activations") > 10.0 && mib("total") > mib("parameters") + mib("gradients") + mib("optimizer"), "{row}");
}

/// Frozen blocks (`--freeze backbone`) are held but not trained: the estimate gives them no
/// gradients and no optimizer state, and the FLOPs behind the MFU count them forward only.
#[test]
fn frozen_blocks_are_estimated_and_counted_as_forward_only() {
    let data = tempfile::tempdir().unwrap();
    support::generated_cifar10(data.path(), 32, 8);
    let estimate = |extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec![
            "--model",
            "resnet34",
            "--num-classes",
            "10",
            "--device",
            "cpu",
            "--batch-size",
            "8",
            "--data-dir",
            data.path().to_str().unwrap(),
            "--estimate-memory",
            "--results-dir",
        ];
        args.push(dir.path().to_str().unwrap());
        args.extend(extra);
        let out = run("exercise1", &args);
        assert!(out.status.success(), "{}", stderr(&out));
        json_ending(dir.path(), ".memory-estimate.json")["ranks"][0].clone()
    };
    let weights = tempfile::tempdir().unwrap();
    let file = weights.path().join("w.safetensors");
    {
        // A 10-way resnet34's own variables: a file the frozen run can start from.
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _ = common::models::build(
            &vs.root(),
            &common::models::ModelSpec { arch: common::models::Arch::Resnet34, in_channels: 3, image_size: 32, num_classes: 10 },
        );
        vs.save(&file).unwrap();
    }
    let frozen_args = ["--freeze", "backbone", "--weights", file.to_str().unwrap()];
    let (whole, frozen) = (estimate(&[]), estimate(&frozen_args));
    let mib = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap() / 1048576.0;
    assert!(mib(&whole, "gradients") > 80.0 && mib(&frozen, "gradients") < 0.1, "{whole} vs {frozen}");
    assert!(mib(&frozen, "optimizer") < 0.1 && (mib(&frozen, "parameters") - mib(&whole, "parameters")).abs() < 1.0, "{frozen}");

    let flops = |extra: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["--model", "resnet34", "--num-classes", "10", "--device", "cpu", "--batch-size", "8", "--max-steps", "1", "--quiet"];
        args.extend(["--data-dir", data.path().to_str().unwrap(), "--results-dir", dir.path().to_str().unwrap()]);
        args.extend(extra);
        let out = run("exercise1", &args);
        assert!(out.status.success(), "{}", stderr(&out));
        json_ending(dir.path(), "-cpu.json")["flops_per_example"].as_f64().unwrap()
    };
    let (all, head_only) = (flops(&[]), flops(&frozen_args));
    let forward = all / 6.0;
    // The head (512 × 10 multiply-adds) trains: 6 per multiply-add; the rest runs forward: 2.
    assert!((head_only - (2.0 * (forward - 5120.0) + 6.0 * 5120.0)).abs() < 1.0, "{head_only} vs {all}");
}

/// `--loss-chunks 8`: the estimate counts one chunk's logits and each token's log-sum-exp
/// instead of the batch's float32 log-probabilities and their gradients; training then
/// measures its peak within 5% of it (float32 and bf16-mixed), and in float32 the peak drops
/// from the whole batch's logits by what the estimate says it drops, within 5% of that drop.
#[test]
fn the_chunked_loss_lowers_the_estimate_and_the_peak_alike() {
    let whole = small_transformer("exercise1_nlp", &[]);
    let chunked = small_transformer("exercise1_nlp", &["--loss-chunks", "8"]);
    assert_within("exercise1_nlp, 1 rank", &whole, WITHIN);
    assert_within("exercise1_nlp, 1 rank, --loss-chunks 8", &chunked, WITHIN);
    let (estimated, measured) = (whole[0].0 - chunked[0].0, whole[0].1 - chunked[0].1);
    println!("--loss-chunks 8 saves {measured:.2} MiB measured, {estimated:.2} MiB estimated");
    assert!(estimated > 0.25 * whole[0].0, "the estimate saves {estimated:.2} MiB of {:.2}", whole[0].0);
    assert!((estimated / measured - 1.0).abs() <= WITHIN, "--loss-chunks 8 saves {measured:.2} MiB measured, {estimated:.2} MiB estimated");
    // Under bf16-mixed: the products in bfloat16, the weight's copy kept, its gradient summed
    // into float32 a block of the vocabulary at a time.
    let mixed = small_transformer("exercise1_nlp", &["--loss-chunks", "8", "--precision", "bf16-mixed"]);
    assert_within("exercise1_nlp, 1 rank, --loss-chunks 8, bf16-mixed", &mixed, WITHIN);
}
