//! exercise3 tp as a user runs it on CPU ranks: the model cut over 2 ranks trains the model one
//! rank trains (dropout on), its checkpoint holds whole tensors and resumes on one rank, the
//! results carry the layout and the traffic of a step, and mistakes are one clear line. Clipped
//! steps on 2 shards are one rank's, each of lr × clip.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{read_json, stderr, wikitext_sample};
use tch::Kind;

fn exercise3(command: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_exercise3")).arg(command).args(args).output().expect("exercise3 runs")
}

/// The model tensors of exercise3 tp's checkpoint in `dir`, sorted by name.
fn model_tensors(dir: &Path) -> Vec<(String, tch::Tensor)> {
    checkpoint_tensors(dir, "exercise3_tp")
}

/// The model tensors of `exercise`'s checkpoint in `dir`, sorted by name.
fn checkpoint_tensors(dir: &Path, exercise: &str) -> Vec<(String, tch::Tensor)> {
    let run = format!("{exercise}-transformer-cpu");
    let mut tensors: Vec<_> = common::checkpoint::load_run(dir, &run).unwrap().tensors.into_iter().filter(|(k, _)| k.starts_with("model.")).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

/// Small enough for a test; 4 heads and widths that 2 shards divide; dropout on (the masks are
/// keyed, so the shards drop what one rank drops). SGD: Adam divides each gradient by its own
/// running size, so the attention's key bias, whose gradient is rounding noise (softmax ignores
/// a shift of all keys), moves by amounts that differ with the order of any sum.
const SMALL: [&str; 20] = [
    "--device",
    "cpu",
    "--emsize",
    "32",
    "--d-hid",
    "64",
    "--nhead",
    "4",
    "--nlayers",
    "2",
    "--batch-size",
    "8",
    "--threads",
    "1",
    "--pad-vocab",
    "8",
    "--optimizer",
    "sgd",
    "--lr",
    "0.5",
];

#[test]
fn two_shards_train_the_model_of_one_rank_and_their_checkpoint_resumes_on_one() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [60; 3]);
    let run = |ck: &Path, epochs: &str, placement: &[&str]| {
        let mut args = vec!["--data-dir", data.path().to_str().unwrap(), "--epochs", epochs, "--quiet", "--resume"];
        // (A constant rate: a cosine over --epochs would differ between 1 and 2 epochs.)
        args.extend(["--checkpoint-dir", ck.to_str().unwrap(), "--results-dir", ck.to_str().unwrap(), "--lr-schedule", "constant"]);
        args.extend(SMALL);
        args.extend(placement);
        let out = exercise3("tp", &args);
        assert!(out.status.success(), "{placement:?}: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (one, two, resumed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(one.path(), "2", &[]);
    let stdout = run(two.path(), "2", &["--nproc-per-node", "2"]);
    assert!(stdout.contains("every layer cut over 2 tensor-parallel shards") && stdout.contains("per shard on each of 2 ranks"), "{stdout}");
    assert!(stdout.contains("rank 0's communication per training step: all-reduce"), "{stdout}");
    // Epoch 1 on 2 shards, epoch 2 on one rank from the checkpoint the shards wrote together.
    run(resumed.path(), "1", &["--nproc-per-node", "2"]);
    let out = run(resumed.path(), "2", &[]);
    assert!(out.contains("resumed exercise3_tp-transformer-cpu") && out.contains("after epoch 1"), "{out}");

    let whole = model_tensors(one.path());
    for (what, dir) in [("2 epochs on 2 shards", two.path()), ("1 epoch on 2 shards + 1 resumed on one rank", resumed.path())] {
        let other = model_tensors(dir);
        assert_eq!(
            whole.iter().map(|t| (&t.0, t.1.size())).collect::<Vec<_>>(),
            other.iter().map(|t| (&t.0, t.1.size())).collect::<Vec<_>>(),
            "{what}: whole tensors under whole-model names"
        );
        for ((name, x), (_, y)) in whole.iter().zip(&other) {
            let rel = (x - y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]).max(1e-12);
            assert!(rel <= 1e-5, "{name}: 2 epochs on one rank vs {what} differ by {rel:e}");
        }
    }

    let json = read_json(&two.path().join("exercise3_tp-transformer-cpu.json"));
    assert_eq!(json["layout"], serde_json::json!({ "dp": 1, "pp": 1, "tp": 2, "dp_shard": 1 }));
    assert_eq!(json["world_size"], 2);
    // Per step, rank 0 all-reduces 2 per layer forward and 2 backward, plus the embedding's sum
    // and the loss's maximum and sum forward, the output layer's gradient backward, and the
    // gradient norm (clipping): 4 · 2 layers + 5.
    assert_eq!(json["communication_per_step"]["all_reduce"]["calls"], 4 * 2 + 5, "{}", json["communication_per_step"]);
    let (whole_json, params) = (read_json(&one.path().join("exercise3_tp-transformer-cpu.json")), json["params"].as_i64().unwrap());
    assert_eq!(whole_json["params"].as_i64(), Some(params), "the shards hold the whole model's parameters between them");
    let memory = json["model_state_memory"]["params_bytes"].as_i64().unwrap();
    assert!(memory < 4 * params * 6 / 10, "a shard holds about half the parameters ({memory} bytes of {params} parameters)");
}

/// `--sequence-parallel` on 2 shards (dropout on; the 35-token windows padded to 36): the model
/// `--tp 2` alone trains, to 1e-5; all-gathers and reduce-scatters in place of the layers'
/// all-reduces; less activation memory per rank, by what `--estimate-memory` predicts for it.
/// Without tensor parallelism it is a usage error.
#[test]
fn sequence_parallelism_trains_the_tensor_parallel_model_in_less_memory() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [60; 3]);
    let run = |dir: &Path, flags: &[&str]| {
        let mut args = vec!["--data-dir", data.path().to_str().unwrap(), "--epochs", "1", "--quiet", "--nproc-per-node", "2"];
        args.extend(["--checkpoint-dir", dir.to_str().unwrap(), "--results-dir", dir.to_str().unwrap()]);
        args.extend(SMALL);
        args.extend(flags);
        let out = exercise3("tp", &args);
        assert!(out.status.success(), "{flags:?}: {}", stderr(&out));
        let estimate = exercise3("tp", &[&args[..], &["--estimate-memory"]].concat());
        assert!(estimate.status.success(), "{flags:?} --estimate-memory: {}", stderr(&estimate));
        let estimated = read_json(&dir.join("exercise3_tp-transformer-cpu.memory-estimate.json"))["ranks"][0]["activations"].as_f64().unwrap();
        (read_json(&dir.join("exercise3_tp-transformer-cpu.json")), model_tensors(dir), estimated)
    };
    let (tensor, sequence) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (tp_json, tp_model, tp_estimate) = run(tensor.path(), &[]);
    let (sp_json, sp_model, sp_estimate) = run(sequence.path(), &["--sequence-parallel"]);
    for ((name, x), (_, y)) in tp_model.iter().zip(&sp_model) {
        let rel = (x - y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]).max(1e-12);
        assert!(rel <= 1e-5, "{name}: --tp 2 vs --tp 2 --sequence-parallel differ by {rel:e}");
    }
    let calls = |json: &serde_json::Value, kind: &str| json["communication_per_step"][kind]["calls"].as_u64().unwrap();
    assert_eq!((calls(&tp_json, "all_gather"), calls(&tp_json, "reduce_scatter")), (0, 0), "{}", tp_json["communication_per_step"]);
    // Forward 2 per layer and the output layer's gather, backward 4 per layer and 2 (gathers);
    // forward 2 per layer and the embedding's, backward 2 per layer and the output layer's
    // (reduce-scatters).
    assert_eq!((calls(&sp_json, "all_gather"), calls(&sp_json, "reduce_scatter")), (6 * 2 + 3, 4 * 2 + 2), "{}", sp_json["communication_per_step"]);
    assert!(calls(&sp_json, "all_reduce") < calls(&tp_json, "all_reduce"), "{} vs {}", sp_json["communication_per_step"], tp_json["communication_per_step"]);
    // The model state is tensor parallelism's (the whole parameters' gradients, slices of one
    // summed buffer, counted once).
    let state = |json: &serde_json::Value| json["model_state_memory"]["total_bytes"].as_u64().unwrap();
    assert_eq!(state(&sp_json), state(&tp_json));
    // Activation memory: the training peak over what was held before, on the rank that held
    // most, against the estimate's activations.
    let held = |json: &serde_json::Value| {
        json["peak_memory"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["training_peak_bytes"].as_f64().unwrap() - p["baseline_bytes"].as_f64().unwrap())
            .fold(0.0, f64::max)
    };
    let (measured, predicted) = (held(&tp_json) - held(&sp_json), tp_estimate - sp_estimate);
    println!("sequence parallelism saves {measured:.0} bytes of the training peak per rank; the estimate's activations {predicted:.0}");
    assert!(predicted > 0.0 && measured > 0.0, "saved {measured}, predicted {predicted}");
    assert!((measured - predicted).abs() <= 0.1 * predicted, "saved {measured} bytes, the estimate {predicted}");

    let out = exercise3("tp", &["--data-dir", data.path().to_str().unwrap(), "--max-steps", "1", "--tp", "1", "--sequence-parallel", "--device", "cpu"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--sequence-parallel cuts the sequence over the tensor-parallel shards of a layer: it needs --tp 2 or more"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn tensor_parallel_mistakes_are_one_clear_line_with_exit_2() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [40; 3]);
    let dir = data.path().to_str().unwrap();
    let small = ["--device", "cpu", "--d-hid", "64", "--nlayers", "2", "--max-steps", "1", "--quiet"];
    let heads = ["--emsize", "32", "--nhead", "4"];
    for (command, flags, message) in [
        ("pipeline", [&heads[..], &["--tp", "2"]].concat(), "--tp 2 runs each shard of a layer in a process of its own"),
        ("tp", vec!["--nproc-per-node", "2", "--nhead", "3", "--emsize", "24"], "cuts --nhead into 2 equal parts, but it is 3"),
        // 40 lines of WikiText-2's valid split: 461 words.
        (
            "tp",
            [&heads[..], &["--nproc-per-node", "2"]].concat(),
            "cuts the vocabulary into 2 equal parts, but it is 461: choose a --tp that divides it (or round it up: --pad-vocab 128)",
        ),
        (
            "tp",
            [&heads[..], &["--nproc-per-node", "2", "--pad-vocab", "8", "--optimizer", "lamb"]].concat(),
            "--optimizer lamb scales each weight by its whole norm",
        ),
        ("tp", [&heads[..], &["--nproc-per-node", "3", "--tp", "2"]].concat(), "3 ranks cannot hold replicas of 1 stage(s) × 2 tensor-parallel shards"),
    ] {
        let mut args = vec!["--data-dir", dir];
        args.extend(small);
        args.extend(&flags);
        let out = exercise3(command, &args);
        assert_eq!(out.status.code(), Some(2), "{command} {flags:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(message), "{command} {flags:?}: {}", stderr(&out));
    }
}

/// exercise1_nlp --tp: the tutorial's language model built from tensor-parallel layers, so 2
/// shards train what one rank trains (dropout on: the masks are keyed), without pipeline flags.
#[test]
fn exercise1_nlp_on_two_shards_trains_the_model_of_one_rank() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [60; 3]);
    let run = |dir: &Path, placement: &[&str]| {
        let mut args = vec!["--data-dir", data.path().to_str().unwrap(), "--epochs", "2", "--quiet", "--lr-schedule", "constant"];
        args.extend(["--checkpoint-dir", dir.to_str().unwrap(), "--results-dir", dir.to_str().unwrap()]);
        args.extend(SMALL);
        args.extend(placement);
        let out = Command::new(env!("CARGO_BIN_EXE_exercise1_nlp")).args(&args).output().expect("exercise1_nlp runs");
        assert!(out.status.success(), "{placement:?}: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(one.path(), &["--tp", "1"]);
    let stdout = run(two.path(), &["--nproc-per-node", "2", "--tp", "2"]);
    assert!(stdout.contains("every layer cut over 2 tensor-parallel shards"), "{stdout}");
    let (whole, shards) = (checkpoint_tensors(one.path(), "exercise1_nlp"), checkpoint_tensors(two.path(), "exercise1_nlp"));
    assert_eq!(whole.iter().map(|t| (&t.0, t.1.size())).collect::<Vec<_>>(), shards.iter().map(|t| (&t.0, t.1.size())).collect::<Vec<_>>());
    for ((name, x), (_, y)) in whole.iter().zip(&shards) {
        let rel = (x - y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]).max(1e-12);
        assert!(rel <= 1e-5, "{name}: one rank vs 2 shards differ by {rel:e}");
    }
    let json = read_json(&two.path().join("exercise1_nlp-transformer-cpu.json"));
    assert_eq!(json["layout"], serde_json::json!({ "dp": 1, "pp": 1, "tp": 2, "dp_shard": 1 }));
    // Started alone, the shards have no processes to run in: one line, exit 2.
    let out = Command::new(env!("CARGO_BIN_EXE_exercise1_nlp"))
        .args(["--data-dir", data.path().to_str().unwrap(), "--max-steps", "1", "--tp", "2"])
        .args(SMALL)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--tp 2 runs each shard of a layer in a process of its own"), "{}", stderr(&out));
}

/// Gradient clipping on 2 shards clips as one rank does (exercise1_nlp, SGD without momentum,
/// no dropout): at a clip below every step's gradient norm, each step moves the weights by
/// lr × clip on both layouts (less torch's 1e-6 guard: 1 − 1e-6/‖g‖; an unclipped step moves by
/// lr × ‖g‖, less), and the two train the same model to 1e-5. One step per epoch (`--bptt 512`
/// covers each of the 8 columns of the 796 training tokens), every epoch's checkpoint kept: the
/// weights after each step; the first step at rate 0 (`--warmup-steps 1 --warmup-start 0`), so
/// the first checkpoint holds the initial weights. `--pad-vocab 16384` gives the output layer
/// and the embedding the size of a real vocabulary (285 words here): gradients with a long tail
/// of tiny rows, whose norm torch's CPU 2-norm made short, by an amount that depends on the
/// tensor's length. Clipping by it, here, the steps overshot lr × clip by 5.5e-5 to 6.4e-5 on one
/// rank and by half as much on 2 shards, and the layouts ended 3.1e-5 apart.
#[test]
fn clipped_steps_on_two_shards_move_as_one_rank_by_lr_times_clip() {
    const EPOCHS: usize = 4;
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [20, 10, 10]);
    // SMALL's SGD at --lr 0.5, its vocabulary padded further.
    let (lr, clip) = (0.5, 0.5);
    assert_eq!(SMALL[SMALL.iter().position(|a| *a == "--lr").unwrap() + 1], lr.to_string());
    let mut small = SMALL;
    small[small.iter().position(|a| *a == "--pad-vocab").unwrap() + 1] = "16384";
    let run = |dir: &Path, placement: &[&str]| -> Vec<Vec<(String, tch::Tensor)>> {
        let (dir_s, epochs, clip) = (dir.to_str().unwrap(), EPOCHS.to_string(), clip.to_string());
        let mut args = vec!["--data-dir", data.path().to_str().unwrap(), "--checkpoint-dir", dir_s, "--results-dir", dir_s, "--quiet"];
        args.extend(["--epochs", &epochs, "--keep-checkpoints", &epochs, "--checkpoint-format", "whole", "--bptt", "512"]);
        args.extend(["--lr-schedule", "constant", "--warmup-steps", "1", "--warmup-start", "0", "--clip", &clip, "--dropout", "0"]);
        args.extend(small);
        args.extend(placement);
        let out = Command::new(env!("CARGO_BIN_EXE_exercise1_nlp")).args(&args).output().expect("exercise1_nlp runs");
        assert!(out.status.success(), "{placement:?}: {}", stderr(&out));
        (1..=EPOCHS)
            .map(|epoch| {
                let path = dir.join(format!("exercise1_nlp-transformer-cpu-epoch{epoch}.safetensors"));
                let mut tensors: Vec<_> = common::checkpoint::load(&path).unwrap().tensors.into_iter().filter(|(k, _)| k.starts_with("model.")).collect();
                tensors.sort_by(|a, b| a.0.cmp(&b.0));
                tensors
            })
            .collect()
    };
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let whole = run(one.path(), &["--tp", "1"]);
    let shards = run(two.path(), &["--nproc-per-node", "2", "--tp", "2"]);
    // Each step's move: the norm of the difference of consecutive checkpoints, over lr × clip.
    let moves = |epochs: &[Vec<(String, tch::Tensor)>]| -> Vec<f64> {
        let squares = |after: &tch::Tensor, before: &tch::Tensor| {
            (after.to_kind(Kind::Double) - before.to_kind(Kind::Double)).square().sum(Kind::Double).double_value(&[])
        };
        let moved = |step: usize| epochs[step].iter().zip(&epochs[step - 1]).map(|((_, a), (_, b))| squares(a, b)).sum::<f64>().sqrt();
        (1..EPOCHS).map(|step| moved(step) / (lr * clip)).collect()
    };
    let (whole_moves, shard_moves) = (moves(&whole), moves(&shards));
    let apart: Vec<(&String, f64)> = whole[EPOCHS - 1]
        .iter()
        .zip(&shards[EPOCHS - 1])
        .map(|((name, x), (_, y))| (name, (x - y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]).max(1e-12)))
        .collect();
    let worst = apart.iter().map(|a| a.1).fold(0.0, f64::max);
    println!("steps 2..{EPOCHS} moved by × lr × clip: one rank {whole_moves:?}, 2 shards {shard_moves:?}; the layouts {worst:e} apart");
    for (what, moves) in [("one rank", &whole_moves), ("2 shards", &shard_moves)] {
        for (step, ratio) in moves.iter().enumerate() {
            assert!((ratio - 1.0).abs() <= 1e-5, "{what}: step {} moved the weights by {ratio} × lr × clip, not 1 (clipped)", step + 2);
        }
    }
    for (name, rel) in apart {
        assert!(rel <= 1e-5, "{name}: one rank vs 2 shards differ by {rel:e} after {} clipped steps", EPOCHS - 1);
    }
}
