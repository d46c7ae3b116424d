//! Sharded checkpoints as users meet them: a ZeRO, tensor- or pipeline-parallel run writes one
//! file per rank and an index last; any layout resumes from it (and from a single file) with
//! no conversion, landing where an uninterrupted run lands; `checkpoint export` turns it into
//! one whole-model file; an interrupted or damaged one is passed over, and said so.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{stderr, wikitext_sample};

/// A model small enough for 8 ranks on 2 cores, that tp 2 and pp 2 can cut (2 heads, 2
/// layers, a vocabulary padded to a multiple of 8), without dropout; SGD with momentum, so
/// that optimizer state is resharded too; a constant rate (1 epoch and 2 epochs runs agree);
/// the same recipe in both binaries.
const SMALL: [&str; 30] = [
    "--device",
    "cpu",
    "--quiet",
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
    "--dropout",
    "0",
    "--pad-vocab",
    "8",
    "--lr",
    "0.3",
    "--momentum",
    "0.9",
    "--lr-schedule",
    "constant",
    "--optimizer",
    "sgd",
    "--clip",
    "0.5",
    "--bptt",
    "35",
    "--resume",
];

/// The global batch of every layout: its replicas' batches add up to it.
const GLOBAL_BATCH: usize = 16;

/// A layout and the exercise that trains in it: `exercise1_nlp` (one process, data-parallel,
/// ZeRO) or `exercise3 tp` (tensor and pipeline parallel in processes, and replicas of them).
struct Layout {
    exercise3: bool,
    ranks: usize,
    flags: &'static [&'static str],
    replicas: usize,
}

impl Layout {
    /// The run's name: its checkpoints' in the checkpoint folder.
    fn run(&self) -> &'static str {
        if self.exercise3 {
            "exercise3_tp-transformer-cpu"
        } else {
            "exercise1_nlp-transformer-cpu"
        }
    }
}

const ONE_PROCESS: Layout = Layout { exercise3: false, ranks: 1, flags: &[], replicas: 1 };
const ZERO3_ON_4: Layout = Layout { exercise3: false, ranks: 4, flags: &["--zero", "3"], replicas: 4 };
const HSDP_2X2: Layout = Layout { exercise3: false, ranks: 4, flags: &["--zero", "3", "--shard-group", "2"], replicas: 4 };
const ZERO3_ON_2: Layout = Layout { exercise3: false, ranks: 2, flags: &["--zero", "3"], replicas: 2 };
const TP2_PP2: Layout = Layout { exercise3: true, ranks: 4, flags: &["--tp", "2", "--pp", "2", "--dp", "1"], replicas: 1 };
const TP2_PP2_SP: Layout = Layout { exercise3: true, ranks: 4, flags: &["--tp", "2", "--pp", "2", "--dp", "1", "--sequence-parallel"], replicas: 1 };
const TP2_PP2_DP2: Layout = Layout { exercise3: true, ranks: 8, flags: &["--tp", "2", "--pp", "2", "--dp", "2"], replicas: 2 };
const EXERCISE3_ONE_PROCESS: Layout = Layout { exercise3: true, ranks: 1, flags: &["--tp", "1"], replicas: 1 };

fn exercise1_nlp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_exercise1_nlp")).args(args).output().expect("exercise1_nlp runs")
}

/// Trains `epochs` (in all) in `layout` on `data`, checkpointing to and resuming from `ck`.
fn run(data: &Path, ck: &Path, epochs: &str, layout: &Layout) -> String {
    let batch = (GLOBAL_BATCH / layout.replicas).to_string();
    let (data, ck) = (data.to_str().unwrap(), ck.to_str().unwrap());
    // exercise3's course recipe: the step of exercise1_nlp's (its own adds a warm-up).
    let mut args = if layout.exercise3 { vec!["tp", "--recipe", "course"] } else { Vec::new() };
    args.extend(["--data-dir", data, "--checkpoint-dir", ck, "--results-dir", ck, "--epochs", epochs, "--batch-size", &batch]);
    args.extend(SMALL);
    args.extend(layout.flags);
    let ranks = layout.ranks.to_string();
    if layout.ranks > 1 {
        args.extend(["--nproc-per-node", &ranks]);
    }
    let binary = if layout.exercise3 { env!("CARGO_BIN_EXE_exercise3") } else { env!("CARGO_BIN_EXE_exercise1_nlp") };
    let out = Command::new(binary).args(&args).output().unwrap();
    assert!(out.status.success(), "{:?}: {}", layout.flags, stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The model and optimizer state of `run`'s newest checkpoint in `dir`, whole tensors by name.
fn state(dir: &Path, run: &str) -> Vec<(String, tch::Tensor)> {
    let mut tensors: Vec<_> = common::checkpoint::load_run(dir, run).unwrap().tensors.into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

/// Every tensor of `b` within 1e-5 of `a`'s largest value (relative), the same names.
fn assert_close(what: &str, a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) {
    assert_eq!(a.iter().map(|t| &t.0).collect::<Vec<_>>(), b.iter().map(|t| &t.0).collect::<Vec<_>>(), "{what}: other tensors");
    for ((name, x), (_, y)) in a.iter().zip(b) {
        let rel = (x - y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]).max(1e-12);
        assert!(rel <= 1e-5, "{what}: {name} differs by {rel:e}");
    }
}

/// The files of `run`'s newest sharded checkpoint in `dir`.
fn rank_files(dir: &Path, run: &str) -> Vec<String> {
    let folder = common::checkpoint::sharded::committed(&dir.join(format!("{run}.shards"))).into_iter().next().expect("a committed sharded checkpoint");
    let mut files: Vec<String> = std::fs::read_dir(folder).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    files
}

#[test]
fn any_layout_resumes_any_other_layouts_checkpoint_where_an_uninterrupted_run_lands() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [80, 40, 40]);
    // Uninterrupted: 2 epochs in one process, of each exercise (their initial weights differ:
    // exercise3 draws its tensor-parallel layers' own way, the same on any number of shards).
    let reference = |layout: &Layout| {
        let straight = tempfile::tempdir().unwrap();
        let one = if layout.exercise3 { &EXERCISE3_ONE_PROCESS } else { &ONE_PROCESS };
        run(data.path(), straight.path(), "2", one);
        state(straight.path(), one.run())
    };
    let (nlp_reference, exercise3_reference) = (reference(&ONE_PROCESS), reference(&EXERCISE3_ONE_PROCESS));
    assert!(nlp_reference.iter().any(|(k, _)| k.starts_with("optim.momentum_buffer.")), "SGD's momentum is in the checkpoint");

    // (HSDP: 2 shard groups of 2 hold the same blocks; the first group's go into the checkpoint.
    // Sequence parallelism across 2 stages: the stages pass each other their rows of the
    // sequence, 35-token windows padded to 36.)
    let pairs = [
        (&ZERO3_ON_4, &TP2_PP2),
        (&TP2_PP2_DP2, &EXERCISE3_ONE_PROCESS),
        (&ONE_PROCESS, &ZERO3_ON_2),
        (&HSDP_2X2, &TP2_PP2),
        (&TP2_PP2, &HSDP_2X2),
        (&TP2_PP2_SP, &EXERCISE3_ONE_PROCESS),
    ];
    for (first, then) in pairs {
        let reference = if first.exercise3 { &exercise3_reference } else { &nlp_reference };
        let what = format!("epoch 1 with {:?} on {} ranks, epoch 2 with {:?} on {}", first.flags, first.ranks, then.flags, then.ranks);
        let ck = tempfile::tempdir().unwrap();
        run(data.path(), ck.path(), "1", first);
        if first.ranks > 1 {
            // Every rank wrote its own part, the index last; no single file.
            let expected: Vec<String> =
                std::iter::once("checkpoint.json".to_string()).chain((0..first.ranks).map(|r| format!("rank-{r:05}.safetensors"))).collect();
            assert_eq!(rank_files(ck.path(), first.run()), expected, "{what}");
            assert!(!ck.path().join(format!("{}.safetensors", first.run())).exists(), "{what}: no single file");
        }
        if first.run() != then.run() {
            // Another exercise goes on with the checkpoint: under its run's name.
            let shards = |layout: &Layout| ck.path().join(format!("{}.shards", layout.run()));
            std::fs::rename(shards(first), shards(then)).unwrap();
        }
        let out = run(data.path(), ck.path(), "2", then);
        assert!(out.contains("after epoch 1"), "{what}: {out}");
        assert_close(&what, reference, &state(ck.path(), then.run()));
    }
}

#[test]
fn a_sharded_checkpoint_exports_to_the_model_of_a_single_file_checkpoint() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [60, 30, 30]);
    let (sharded, whole) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(data.path(), sharded.path(), "1", &TP2_PP2);
    run(data.path(), whole.path(), "1", &Layout { flags: &["--tp", "2", "--pp", "2", "--dp", "1", "--checkpoint-format", "whole"], ..TP2_PP2 });
    let export = |from: &Path, out: &Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_checkpoint")).arg("export").arg(from).arg(out).output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (a, b) = (sharded.path().join("a.safetensors"), whole.path().join("b.safetensors"));
    let run_name = TP2_PP2.run();
    let said = export(&sharded.path().join(format!("{run_name}.shards")), &a);
    assert!(said.contains("tensors of exercise3_tp-transformer-cpu"), "{said}");
    export(&whole.path().join(format!("{run_name}.safetensors")), &b);
    // The same training, so the same bytes: whole tensors under torch's names, no optimizer.
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let tensors = tch::Tensor::read_safetensors(&a).unwrap();
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"embedding.weight") && names.contains(&"transformer_encoder.layers.1.self_attn.in_proj_weight"), "{names:?}");
    assert!(names.iter().all(|n| !n.starts_with("model.") && !n.starts_with("optim.")), "{names:?}");
    let embedding = tensors.iter().find(|(n, _)| n == "embedding.weight").unwrap();
    let saved = state(sharded.path(), run_name).into_iter().find(|(n, _)| n == "model.embedding.weight").unwrap();
    assert!(embedding.1.equal(&saved.1));

    // Nothing there, or not a checkpoint: one line, no panic.
    let out = Command::new(env!("CARGO_BIN_EXE_checkpoint")).args(["export", "/nonexistent/x.shards", "out.safetensors"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("no checkpoint at /nonexistent/x.shards"), "{}", stderr(&out));
}

#[test]
fn an_interrupted_or_damaged_sharded_checkpoint_is_passed_over_and_said() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [60, 30, 30]);
    let ck = tempfile::tempdir().unwrap();
    let run_name = ZERO3_ON_2.run();
    let folders = || common::checkpoint::sharded::committed(&ck.path().join(format!("{run_name}.shards")));
    run(data.path(), ck.path(), "2", &Layout { flags: &["--zero", "3", "--keep-checkpoints", "1"], ..ZERO3_ON_2 });
    let kept = folders();
    assert_eq!(kept.len(), 2, "the newest and the one before: {kept:?}");
    // --keep-checkpoints 1: the last epoch's copy beside them (hard links of the newest's files).
    let run_folder = ck.path().join(format!("{run_name}.shards"));
    let mut copies: Vec<String> = std::fs::read_dir(&run_folder).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    copies.retain(|n| n.starts_with("epoch-"));
    assert_eq!(copies, ["epoch-000002"]);
    for file in ["checkpoint.json", "rank-00000.safetensors", "rank-00001.safetensors"] {
        assert_eq!(std::fs::read(run_folder.join("epoch-000002").join(file)).unwrap(), std::fs::read(kept[0].join(file)).unwrap(), "{file}");
    }
    // A writer killed mid-checkpoint: a folder without its index, never read, removed.
    let interrupted = ck.path().join(format!("{run_name}.shards/step-999999999"));
    std::fs::create_dir_all(&interrupted).unwrap();
    std::fs::write(interrupted.join("rank-00000.safetensors"), b"half").unwrap();
    // The newest's rank file torn: the run goes on from the one before, and says so.
    let torn = kept[0].join("rank-00001.safetensors");
    let bytes = std::fs::read(&torn).unwrap();
    std::fs::write(&torn, &bytes[..bytes.len() / 2]).unwrap();
    let out = exercise1_nlp(
        &[
            &["--data-dir", data.path().to_str().unwrap(), "--checkpoint-dir", ck.path().to_str().unwrap()],
            &["--results-dir", ck.path().to_str().unwrap(), "--epochs", "2", "--batch-size", "8", "--nproc-per-node", "2", "--zero", "3"][..],
            &SMALL[..],
        ]
        .concat(),
    );
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), support::stderr(&out));
    assert!(out.status.success(), "{stderr}");
    assert!(!interrupted.exists(), "the interrupted checkpoint is removed");
    assert!(stderr.contains("removed") && stderr.contains("step-999999999"), "{stderr}");
    assert!(stderr.contains("rank-00001.safetensors") && stderr.contains("corrupt") && stderr.contains("instead"), "{stderr}");
    assert!(stdout.contains("after epoch 1"), "resumed from the epoch before: {stdout}");
}
