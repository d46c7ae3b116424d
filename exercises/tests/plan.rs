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
    let mut args = SMALL.to_vec();
    args.extend(["--nproc-per-node", "2", "--out", out.to_str().unwrap()]);
    let output = profile(&args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("within a host, all-reduce over 2 ranks (mpi)"), "{stdout}");
    let model = common::models::TransformerConfig { ntoken: 100, d_model: 32, nhead: 4, d_hid: 64, nlayers: 6, dropout: 0.2 };
    let read = Profile::read(&out, Some(ProfileKey { model, precision: Precision::Full })).unwrap();
    assert_eq!(read.compute.iter().map(|p| p.micro_batch).collect::<Vec<_>>(), vec![1, 3]);
    assert!(read.compute.iter().all(|p| [p.embedding, p.layer, p.head].iter().all(|t| t.forward_s > 0.0)));
    assert!(read.optimizer.seconds_per_parameter > 0.0);
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
    let refused = plan(&["--memory", "1KB"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no layout fits in 0.0 GiB per rank") && stderr.trim().lines().count() == 1, "{stderr}");
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
