//! `exercise3 profile` and `exercise3 plan` as a user runs them on CPU ranks: a profile with
//! every piece timed at every micro-batch size asked, the optimizer, and every collective among
//! the ranks, and the plan made from it; mistakes are one clear line and exit 2, before
//! anything is measured.
mod support;

use std::process::{Command, Output};

use common::plan::profile::{Collective, LinkScope, Profile, ProfileKey};
use common::precision::Precision;

fn profile(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_exercise3")).arg("profile").args(args).env("OMP_NUM_THREADS", "1").output().expect("exercise3 runs")
}

const SMALL: [&str; 14] =
    ["--emsize", "32", "--d-hid", "64", "--nhead", "4", "--vocab", "100", "--bptt", "8", "--max-message-mb", "1", "--micro-batches", "1,3"];

#[test]
fn two_ranks_profile_the_pieces_the_optimizer_and_every_collective_between_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cpu.json");
    // As many threads per rank as the machine has cores: the two ranks outnumber them, and
    // the profile measures what sharing them costs.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.to_string();
    let mut args = SMALL.to_vec();
    args.extend(["--nproc-per-node", "2", "--threads", &threads, "--out", out.to_str().unwrap()]);
    let output = profile(&args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("within a host, all-reduce over 2 ranks (mpi)"), "{stdout}");
    let model = common::models::TransformerConfig { ntoken: 100, d_model: 32, nhead: 4, d_hid: 64, nlayers: 6, dropout: 0.2 };
    let read = Profile::read(&out, Some(ProfileKey { model, precision: Precision::Full })).unwrap();
    assert_eq!(read.compute.iter().map(|p| p.micro_batch).collect::<Vec<_>>(), vec![1, 3]);
    assert!(read.compute.iter().all(|p| [p.embedding, p.layer, p.head].iter().all(|t| t.forward_s > 0.0)));
    assert!(read.optimizer.seconds_per_parameter > 0.0 && read.optimizer.clip_seconds_per_parameter > 0.0, "{:?}", read.optimizer);
    // Shards of the degrees the model cuts into (4 heads: 2 and 4 of the default 2,4,8), timed
    // at every size, and their share of the whole printed.
    assert_eq!(read.shards.iter().map(|s| s.tp).collect::<Vec<_>>(), vec![2, 4]);
    for shard in &read.shards {
        assert_eq!(shard.compute.iter().map(|p| p.micro_batch).collect::<Vec<_>>(), vec![1, 3]);
        assert!(shard.compute.iter().all(|p| [p.embedding, p.layer, p.head].iter().all(|t| t.forward_s > 0.0)), "{shard:?}");
    }
    assert!(stdout.contains("a shard of 2: one layer takes ") && stdout.contains("a shard of 4: "), "{stdout}");
    // Timed on rank 0 alone; the host's cores and the measured cost of sharing them recorded.
    assert_eq!((read.recorded.compute_ranks_per_host, read.recorded.cores, read.recorded.threads), (1, cores, cores));
    let shared = read.recorded.shared.as_ref().expect("2 ranks of all the cores' threads share them");
    assert!(shared.ranks == 2 && shared.slowdown.is_finite() && shared.slowdown > 0.0, "{shared:?}");
    assert!(stdout.contains("2 ranks computing at once on those cores"), "{stdout}");
    // And what a pair of shards loses waiting for each other on them (the degrees that divide
    // the 2 ranks: 2), without and with sequence parallelism, at every size.
    let waits: Vec<(usize, bool, i64)> = shared.shard_waits.iter().map(|w| (w.tp, w.sequence_parallel, w.micro_batch)).collect();
    assert_eq!(waits, vec![(2, false, 1), (2, false, 3), (2, true, 1), (2, true, 3)]);
    assert!(shared.shard_waits.iter().all(|w| w.layer_s.is_finite() && w.layer_s >= 0.0), "{shared:?}");
    assert!(stdout.contains("shards of 2 among them wait for each other ") && stdout.contains("shards of 2 with sequence parallelism among them"), "{stdout}");
    // How unevenly equal passes run here, for the plan's waits.
    assert!(read.spread.is_finite() && read.spread > 0.0, "{}", read.spread);
    assert!(stdout.contains("equal passes vary by "), "{stdout}");
    // One host: its link, no network.
    assert_eq!(read.links.len(), 1);
    let link = read.link(LinkScope::WithinHost).unwrap();
    assert_eq!((link.ranks, link.backend.as_str()), (2, "mpi"));
    for collective in Collective::ALL {
        let fit = &link.collectives[&collective];
        // 4 KiB, 32 KiB, 256 KiB and the largest, 1 MiB.
        assert_eq!(fit.samples.iter().map(|s| s.0 as usize).collect::<Vec<_>>(), vec![4 << 10, 32 << 10, 256 << 10, 1 << 20], "{collective:?}");
        assert!(fit.samples.iter().all(|s| s.1 > 0.0) && fit.latency_s >= 0.0 && fit.seconds_per_bus_byte >= 0.0, "{collective:?}: {fit:?}");
    }
    // The gradients' average as runs do it, over the model's 12 layers (the default
    // --nlayers, well under 16 Mi parameters), beside the link's all-reduce fit for those bytes.
    let sync = read.gradient_sync.expect("2 ranks of a host: their gradient average timed");
    let twelve = common::models::param_count_formula(&common::models::TransformerConfig { nlayers: 12, ..model });
    assert!(sync.ranks == 2 && sync.parameters == twelve && sync.seconds > 0.0, "{sync:?}");
    let fit = &link.collectives[&Collective::AllReduce];
    // (To a few ulps: serde_json's default float parsing may miss the last bit.)
    assert!((sync.all_reduce_s / fit.seconds(Collective::AllReduce, twelve as f64 * 4.0, 2) - 1.0).abs() < 1e-12, "{sync:?} {fit:?}");
    assert_eq!(read.optimizer.parameters_timed, twelve, "the optimizer timed over the same model");
    assert!(stdout.contains("the gradients' average as runs do it, over 2 ranks"), "{stdout}");

    // The plan for this machine's 2 ranks, from that profile.
    let plan = |extra: &[&str]| {
        let mut args = vec!["plan", "--profile", out.to_str().unwrap(), "--gpus-per-node", "2", "--global-batch", "4", "--nlayers", "2"];
        args.extend(extra);
        Command::new(env!("CARGO_BIN_EXE_exercise3")).args(args).output().expect("exercise3 runs")
    };
    let table = plan(&["--memory", "1GiB", "--top", "3"]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(table.status.success(), "{text}{}", String::from_utf8_lossy(&table.stderr));
    assert!(text.contains("1 node(s) × 2 GPU(s) of 1.0 GiB, global batch 4 × 8 tokens, 2 layers of d_model 32") && text.contains("why #1 wins"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("| ")).count(), 4, "{text}");
    let json = plan(&["--memory", "1GiB", "--json"]);
    let parsed: serde_json::Value = serde_json::from_slice(&json.stdout).expect("--json prints JSON");
    assert!(parsed["ranked"].as_array().is_some_and(|r| r.len() > 3), "{parsed}");
    // Piped into a reader that has gone (`| head`): the plan ends quietly, as a C tool would.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut args =
        vec!["plan", "--profile", out.to_str().unwrap(), "--gpus-per-node", "2", "--global-batch", "4", "--nlayers", "2", "--memory", "1GiB", "--json"];
    args.push("--top");
    args.push("1");
    let closed = Command::new(env!("CARGO_BIN_EXE_exercise3")).args(&args).stdout(writer).output().expect("exercise3 runs");
    assert!(closed.status.success() && closed.stderr.is_empty(), "{:?}: {}", closed.status, String::from_utf8_lossy(&closed.stderr));
    let refused = plan(&["--memory", "1KB"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no layout fits in 0.0 GiB per rank") && stderr.trim().lines().count() == 1, "{stderr}");
}

/// `--threads` beyond the cores is capped at them, and the library's warning reaches stderr
/// through the binary's console.
#[test]
fn threads_beyond_the_cores_are_capped_with_a_warning_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cpu.json");
    let mut args = SMALL.to_vec();
    args.extend(["--threads", "100000", "--out", out.to_str().unwrap()]);
    let output = profile(&args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let warning = format!("warning: --threads 100000 is more than the {cores} cores this process may use: using {cores}");
    assert!(stderr.lines().any(|line| line == warning), "{stderr}");
    assert!(!String::from_utf8_lossy(&output.stdout).contains("--threads"));
}

#[test]
fn profile_mistakes_are_one_line_and_exit_2_before_measuring() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.json");
    let out = out.to_str().unwrap();
    // A folder where a file is: nothing can be written there.
    std::fs::write(dir.path().join("a-file"), "x").unwrap();
    let unwritable = dir.path().join("a-file/p.json");
    for (extra, says) in [
        (vec!["--micro-batches", "0", "--out", out], "--micro-batches takes sizes of 1 or more"),
        (vec!["--device", "both", "--out", out], "--device both: a profile is of one device"),
        (vec!["--nhead", "5", "--out", out], "--emsize 32 must be divisible by --nhead 5"),
        (vec!["--shards", "2,0", "--out", out], "--shards takes tensor-parallel degrees of 1 or more"),
        (vec!["--out", unwritable.to_str().unwrap()], "--out"),
    ] {
        // (The extra flags replace SMALL's of the same name, with their values.)
        let mut args: Vec<&str> = SMALL.chunks(2).filter(|pair| !extra.contains(&pair[0])).flatten().copied().collect();
        args.extend(&extra);
        let output = profile(&args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(says) && stderr.trim().lines().count() == 1, "{extra:?}: {stderr}");
    }
    assert!(!std::path::Path::new(out).exists(), "nothing written");
}

/// `exercise3 tp --layout auto` on 2 ranks trains with the layout `exercise3 plan` ranks first
/// among those exercise3 tp runs, and says so; the flags it chooses itself are refused beside it.
#[test]
fn layout_auto_trains_with_the_layout_the_plan_ranks_first() {
    let dir = tempfile::tempdir().unwrap();
    support::wikitext_sample(dir.path(), [60; 3]);
    let profile_path = dir.path().join("p.json");
    let p = profile_path.to_str().unwrap();
    let recorded = profile(&[
        "--emsize",
        "32",
        "--d-hid",
        "64",
        "--nhead",
        "4",
        "--vocab",
        "128",
        "--bptt",
        "8",
        "--max-message-mb",
        "1",
        "--micro-batches",
        "1,2,4",
        "--nproc-per-node",
        "2",
        "--out",
        p,
    ]);
    assert!(recorded.status.success(), "{}", String::from_utf8_lossy(&recorded.stderr));
    let exercise3 = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_exercise3")).args(args).env("OMP_NUM_THREADS", "1").output().expect("exercise3 runs");
    let planned = exercise3(&["plan", "--profile", p, "--gpus-per-node", "2", "--memory", "1GB", "--global-batch", "4", "--nlayers", "2", "--json"]);
    let plan: serde_json::Value = serde_json::from_slice(&planned.stdout).expect("the plan as JSON");
    // exercise3 tp runs every layout but ZeRO-3's (exercise1_nlp's whole-model step).
    let expected = plan["ranked"].as_array().unwrap().iter().find(|p| p["candidate"]["zero"] != "3").expect("a layout exercise3 tp runs").clone();
    let results = dir.path().join("results");
    let mut args = vec!["tp", "--layout", "auto", "--plan-profile", p, "--memory", "1GB", "--global-batch", "4", "--nproc-per-node", "2"];
    let model = [
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
        "--bptt",
        "8",
        "--pad-vocab",
        "8",
        "--max-steps",
        "2",
        "--epochs",
        "1",
    ];
    args.extend(model);
    args.extend(["--data-dir", dir.path().to_str().unwrap(), "--results-dir", results.to_str().unwrap()]);
    let run = exercise3(&args);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    // (The command names exercise3 tp, or exercise1_nlp for a whole model: the flags follow.)
    let command = expected["command"].as_str().unwrap();
    let flags = command.trim_start_matches("exercise3 tp ").trim_start_matches("exercise1_nlp ");
    assert!(stdout.contains(&format!("--layout auto: {flags} (predicted")), "expected {flags} in\n{stdout}");
    let json = std::fs::read_dir(&results).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with("-cpu.json")).expect("results JSON");
    let layout = &support::read_json(&json)["layout"];
    for dim in ["dp", "pp", "tp"] {
        assert_eq!(layout[dim], expected["candidate"][dim], "{dim}: {layout} against {}", expected["candidate"]);
    }

    // What --layout auto chooses cannot be given beside it, and it needs its three flags.
    for (extra, says) in [
        (vec!["--memory", "1GB", "--global-batch", "4", "--tp", "2"], "--layout auto chooses --tp itself"),
        (vec!["--memory", "1GB", "--global-batch", "4", "--batch-size", "2"], "--layout auto chooses --batch-size itself"),
        (vec![], "give --plan-profile FILE, --memory BYTES and --global-batch N"),
    ] {
        let mut refused = vec!["tp", "--layout", "auto", "--plan-profile", p];
        refused.extend(&extra);
        refused.extend(model);
        let out = exercise3(&refused);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
    }
}

/// Every kind of row a plan for 4 ranks gives is the layout its command runs (exercise3 tp
/// fills the ranks the flags leave with shards, so a row must state its layout whole), and the
/// memory the plan predicts for it is the estimate that command makes of itself
/// (`--estimate-memory`): one accounting, the same job.
#[test]
fn every_kind_of_row_is_the_layout_its_command_runs_with_the_memory_it_estimates_itself() {
    use common::plan::profile::{CostFit, LinkProfile, OptimizerTime, PassTimes, PieceTimes, Recorded, VERSION};
    let dir = tempfile::tempdir().unwrap();
    support::wikitext_sample(dir.path(), [60; 3]);
    let data = dir.path().to_str().unwrap();
    // Adam, as the profile says.
    let model = [
        "--device",
        "cpu",
        "--emsize",
        "32",
        "--d-hid",
        "64",
        "--nhead",
        "4",
        "--nlayers",
        "4",
        "--bptt",
        "8",
        "--dropout",
        "0.1",
        "--pad-vocab",
        "8",
        "--optimizer",
        "adam",
    ];
    let estimate = |command: &str, results: &std::path::Path| {
        let mut words = command.split_whitespace();
        let binary = match words.next() {
            Some("exercise1_nlp") => env!("CARGO_BIN_EXE_exercise1_nlp"),
            _ => env!("CARGO_BIN_EXE_exercise3"),
        };
        let out = Command::new(binary)
            .args(words)
            .args(model)
            .args(["--nproc-per-node", "4", "--estimate-memory", "--data-dir", data, "--results-dir", results.to_str().unwrap()])
            .output()
            .expect("the exercise runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{command}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    // The run's vocabulary, as the tokenizer makes it of this text, padded.
    let first = estimate("exercise1_nlp --batch-size 2", &dir.path().join("vocab"));
    let model_line = first.lines().find(|l| l.starts_with("Transformer LM: ")).expect("the model's line");
    let vocab: i64 = model_line.split("vocabulary ").nth(1).and_then(|rest| rest.split(';').next()).and_then(|n| n.parse().ok()).expect("the vocabulary");

    // A profile of that model (its times do not matter here: the layouts and their memory do).
    let pass = PassTimes { forward_s: 1e-3, backward_s: 2e-3 };
    let fit = CostFit { latency_s: 1e-5, seconds_per_bus_byte: 1e-9, samples: vec![] };
    let profile = Profile {
        version: VERSION,
        recorded: Recorded {
            device: "cpu".into(),
            threads: 1,
            host: "t".into(),
            unix_time: 0,
            compute_ranks_per_host: 4,
            cores: 0,
            shared: None,
            hosts_per_machine: 1,
        },
        model: common::models::TransformerConfig { ntoken: vocab, d_model: 32, nhead: 4, d_hid: 64, nlayers: 1, dropout: 0.1 },
        precision: Precision::Full,
        seq_len: 8,
        compute: [1, 8].iter().map(|&b| PieceTimes { micro_batch: b, embedding: pass, layer: pass, head: pass }).collect(),
        optimizer: OptimizerTime {
            kind: common::optim::OptimizerKind::Adam,
            seconds_per_parameter: 1e-9,
            clip_seconds_per_parameter: 0.0,
            parameters_timed: 1,
        },
        gradient_sync: None,
        shards: Vec::new(),
        spread: 0.0,
        links: vec![LinkProfile {
            scope: LinkScope::WithinHost,
            ranks: 4,
            backend: "mpi".into(),
            collectives: Collective::ALL.into_iter().map(|c| (c, fit.clone())).collect(),
        }],
    };
    let path = dir.path().join("p.json");
    profile.write(&path).unwrap();
    let planned = Command::new(env!("CARGO_BIN_EXE_exercise3"))
        .args(["plan", "--profile", path.to_str().unwrap(), "--gpus-per-node", "4", "--memory", "1GB", "--global-batch", "8", "--nlayers", "4", "--json"])
        .output()
        .unwrap();
    let plan: serde_json::Value = serde_json::from_slice(&planned.stdout).expect("the plan as JSON");

    // One row of each kind: replicas, stages, shards, ZeRO stage, shard group, schedule.
    let mut seen = std::collections::BTreeSet::new();
    let rows: Vec<&serde_json::Value> = plan["ranked"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|row| {
            let c = &row["candidate"];
            seen.insert([&c["dp"], &c["pp"], &c["tp"], &c["zero"], &c["shard_group"], &c["schedule"]].map(|v| v.to_string()))
        })
        .collect();
    assert!(rows.len() >= 12, "{} kinds of row", rows.len());
    eprintln!("{} kinds of row", rows.len());
    for (i, row) in rows.iter().enumerate() {
        let (command, c) = (row["command"].as_str().unwrap(), &row["candidate"]);
        let results = dir.path().join(format!("r{i}"));
        let stdout = estimate(command, &results);
        let (dp, pp, tp) = (c["dp"].as_u64().unwrap(), c["pp"].as_u64().unwrap(), c["tp"].as_u64().unwrap());
        let mut layout = format!("{dp} replica(s)");
        if let Some(group) = c["shard_group"].as_u64() {
            layout = format!("{dp} replica(s) in {} shard group(s) of {group}", dp / group);
        }
        if pp > 1 {
            layout += &format!(" × {pp} stages");
        }
        if tp > 1 {
            layout += &format!(" × {tp} tensor-parallel shards");
        }
        assert!(stdout.contains(&format!("; {layout} (4 ranks);")), "{command} should run as {layout}:\n{stdout}");
        let json = std::fs::read_dir(&results).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().ends_with(".memory-estimate.json")).unwrap();
        let total = support::read_json(&json)["ranks"].as_array().unwrap().iter().map(|r| r["total"].as_f64().unwrap()).fold(0.0, f64::max);
        let predicted = row["memory_bytes"].as_f64().unwrap();
        assert!((predicted / total - 1.0).abs() < 1e-9, "{command}: the plan predicts {predicted} bytes, the run estimates {total}");
    }
}
