//! The scaling study (`make scaling`, `report scaling`): runs at several ranks become the table
//! `scaling.csv` with the speed-up and efficiency arithmetic right, and the chart `scaling.svg`
//! with its curves. No timing is asserted: the figures are checked against the runs' own JSON.
mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use support::{read_json, stderr};

/// `scaling.csv`'s rows, each as column → value.
fn csv_rows(path: &Path) -> Vec<HashMap<String, String>> {
    let mut reader = csv::Reader::from_path(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let header: Vec<String> = reader.headers().unwrap().iter().map(String::from).collect();
    reader.records().map(|r| header.iter().cloned().zip(r.unwrap().iter().map(String::from)).collect()).collect()
}

fn num(row: &HashMap<String, String>, column: &str) -> f64 {
    row[column].parse().unwrap_or_else(|e| panic!("{column} = {:?}: {e}", row[column]))
}

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "{what}: {a} != {b}");
}

fn row<'a>(rows: &'a [HashMap<String, String>], mode: &str, ranks: usize) -> &'a HashMap<String, String> {
    rows.iter().find(|r| r["mode"] == mode && r["ranks"] == ranks.to_string()).unwrap_or_else(|| panic!("no {mode} row at {ranks} ranks: {rows:?}"))
}

/// `make scaling`'s script at 1 and 2 CPU ranks, both modes, on 64 generated images: each
/// row of the table is its run's JSON put through the study's arithmetic.
#[test]
fn make_scaling_runs_both_modes_and_tabulates_the_runs_it_wrote() {
    let results = tempfile::tempdir().unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_exercise2")).parent().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/scaling.sh");
    let out = Command::new(&script)
        .envs([("BIN", bin.to_str().unwrap()), ("RESULTS", results.path().to_str().unwrap()), ("RANKS", "1 2"), ("GLOBAL", "16"), ("PER_RANK", "8")])
        .envs([("EPOCHS", "1"), ("TRAIN", "64"), ("ARGS", "--workers 0")])
        .output()
        .expect("bench/scaling.sh runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    assert!(stdout.contains("| mode | precision | ranks | nodes | global batch |"), "the table is printed: {stdout}");

    let rows = csv_rows(&results.path().join("scaling.csv"));
    assert_eq!(rows.len(), 4, "strong and weak at 1 and 2 ranks: {rows:?}");
    for (mode, batches) in [("strong", [(16, 16), (16, 8)]), ("weak", [(8, 8), (16, 8)])] {
        let json = |ranks: usize| read_json(&results.path().join(format!("scaling/{mode}/ranks-{ranks}/exercise2-cnn-cpu.json")));
        let (one, two) = (json(1), json(2));
        // What the study compares: the steady state's speed, measured in these runs.
        let speed = |j: &serde_json::Value| j["steady_throughput"].as_f64().expect("4 steps: 2 of warm-up, 2 steady");
        for (ranks, j, (global, per_rank)) in [(1, &one, batches[0]), (2, &two, batches[1])] {
            let r = row(&rows, mode, ranks);
            assert_eq!((num(r, "global_batch") as u64, num(r, "per_rank_batch") as u64), (global, per_rank), "{mode} at {ranks} ranks");
            assert_eq!(j["world_size"].as_u64(), Some(ranks as u64));
            close(num(r, "throughput"), speed(j), "throughput");
            close(num(r, "speedup"), speed(j) / speed(&one), "speed-up over 1 rank");
            close(num(r, "ideal_speedup"), ranks as f64, "ideal");
            close(num(r, "efficiency"), speed(j) / speed(&one) / ranks as f64, "efficiency");
            close(num(r, "step_time_s"), global as f64 / speed(j), "time per step");
            close(num(r, "epoch_time_s"), 64.0 / speed(j), "time per epoch: 64 images at that speed");
            close(num(r, "allreduce_share"), j["allreduce_time_s"].as_f64().unwrap() / j["train_time_s"].as_f64().unwrap(), "all-reduce share");
            assert_eq!(num(r, "nodes"), 1.0, "{mode} at {ranks} ranks: all on this host");
        }
        assert!(num(row(&rows, mode, 2), "allreduce_share") > 0.0, "2 ranks average their gradients");
    }
    let svg = std::fs::read_to_string(results.path().join("scaling.svg")).unwrap();
    for text in ["strong: global batch 16", "weak: 8 per rank", "speed-up", "efficiency", "all-reduce share", common::course_figures::JSC_RESNET50_LABEL] {
        assert!(svg.contains(text), "no `{text}` in the chart");
    }
    // JSC's published curve reaches its 128 GPUs (32 nodes) on the speed-up and efficiency axes.
    assert!(svg.lines().any(|line| line.trim() == "128"), "no tick for JSC's 128 GPUs in the chart");
}

/// A results JSON as a run writes it, with the figures the study reads set by the test.
fn run_json(ranks: usize, per_rank: usize, steady: f64) -> serde_json::Value {
    serde_json::json!({
        "exercise": "exercise2", "model": "cnn", "params": 191935, "device": "cpu", "dataset": "cifar10",
        "data_generated": true, "epochs": 1, "steps": 40, "batch_size": per_rank, "lr": 0.001, "optimizer": "adam",
        "train_time_s": 10.0, "throughput": 0.9 * steady, "steady_throughput": steady, "world_size": ranks, "precision": "32",
        "flops_per_example": 7.4e7, "tflops": 0.0, "peak_tflops": null, "mfu": null, "test_acc": 0.1, "test_loss": 2.3,
        "data_wait_s": 0.0, "forward_backward_s": 9.0, "optimizer_s": 0.1, "eval_s": 0.2, "peak_memory_bytes": 1,
        "threads": 1, "seed": 42, "torch_version": "2.11.0", "finished_at": 1,
        "dp": ranks, "per_rank_batch": per_rank, "accumulate": 1, "global_batch": ranks * per_rank,
        "examples_per_epoch": 6000, "allreduce_time_s": 0.5 * (ranks - 1) as f64, "history": [],
        // Two ranks per node, as on a cluster of 2-GPU nodes.
        "hosts": (0..ranks).map(|r| format!("node{}", r / 2 + 1)).collect::<Vec<_>>(),
    })
}

fn write(dir: &Path, folder: &str, json: &serde_json::Value) {
    let dir = dir.join(folder);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("exercise2-cnn-cpu.json"), serde_json::to_string_pretty(json).unwrap()).unwrap();
}

/// Known throughputs in, known speed-ups and efficiencies out; the chart has every curve; runs
/// that do not hold what their mode holds are refused with their file named.
#[test]
fn speedup_and_efficiency_follow_from_the_throughputs() {
    let runs = tempfile::tempdir().unwrap();
    // Strong: global batch 64 at 100, 180, 300 images/s. Weak: 16 per rank at 50, 100, 160.
    for (ranks, steady) in [(1, 100.0), (2, 180.0), (4, 300.0)] {
        write(runs.path(), &format!("strong/ranks-{ranks}"), &run_json(ranks, 64 / ranks, steady));
    }
    for (ranks, steady) in [(1, 50.0), (2, 100.0), (4, 160.0)] {
        write(runs.path(), &format!("weak/ranks-{ranks}"), &run_json(ranks, 16, steady));
    }
    // Not runs: a trace and a memory estimate beside them are passed over.
    std::fs::write(runs.path().join("weak/ranks-4/exercise2-cnn-cpu.trace.json"), "{\"traceEvents\": []}").unwrap();
    std::fs::write(runs.path().join("weak/ranks-4/exercise2-cnn-cpu.memory-estimate.json"), "{\"ranks\": []}").unwrap();
    let results = tempfile::tempdir().unwrap();
    let out = common::scaling::collect(runs.path(), results.path()).unwrap();

    let rows = csv_rows(&out.csv);
    let expect = [
        ("strong", 1, 100.0, 1.0, 1.0, 0.64, 60.0),
        ("strong", 2, 180.0, 1.8, 0.9, 64.0 / 180.0, 6000.0 / 180.0),
        ("strong", 4, 300.0, 3.0, 0.75, 64.0 / 300.0, 20.0),
        ("weak", 1, 50.0, 1.0, 1.0, 16.0 / 50.0, 120.0),
        ("weak", 2, 100.0, 2.0, 1.0, 32.0 / 100.0, 60.0),
        ("weak", 4, 160.0, 3.2, 0.8, 64.0 / 160.0, 6000.0 / 160.0),
    ];
    assert_eq!(rows.len(), expect.len());
    for (mode, ranks, throughput, speedup, efficiency, step, epoch) in expect {
        let r = row(&rows, mode, ranks);
        close(num(r, "throughput"), throughput, "the steady throughput, not the whole run's");
        close(num(r, "speedup"), speedup, &format!("{mode} speed-up at {ranks}"));
        close(num(r, "efficiency"), efficiency, &format!("{mode} efficiency at {ranks}"));
        close(num(r, "step_time_s"), step, "time per step");
        close(num(r, "epoch_time_s"), epoch, "time per epoch");
        close(num(r, "allreduce_share"), 0.05 * (ranks - 1) as f64, "all-reduce share: 0.5 s per extra rank of 10 s");
    }
    let table = common::scaling::markdown(&out.rows);
    assert!(table.contains("| strong | 32 | 4 | 2 | 64 | 16 | 20.00 | 213.3 | 300.0 | 3.00× | 4× | 75% | 15.0% |"), "{table}");
    for (ranks, nodes) in [(1, 1.0), (2, 1.0), (4, 2.0)] {
        assert_eq!(num(row(&rows, "weak", ranks), "nodes"), nodes, "the nodes of {ranks} ranks, from their hosts");
    }

    // Two series, four panels: a solid line each in every panel, dashed ideals in three.
    let svg = std::fs::read_to_string(&out.svg).unwrap();
    for text in [
        "strong: global batch 64",
        "weak: 16 per rank",
        "time per epoch",
        "speed-up",
        "efficiency",
        "all-reduce share",
        "ideal (dashed)",
        "4 (2 nodes)",
        "ranks (nodes)",
    ] {
        assert!(svg.contains(text), "no `{text}` in the chart");
    }
    assert!(svg.matches("<polyline").count() >= 2 * 4 + 2 * 3, "{} lines", svg.matches("<polyline").count());
    assert!(svg.matches("<circle").count() >= 6 * 4, "a marker per run in every panel");

    // A strong point with another global batch is not part of this study.
    write(runs.path(), "strong/ranks-8", &run_json(8, 16, 400.0));
    let err = common::scaling::collect(runs.path(), results.path()).unwrap_err().to_string();
    assert!(err.contains("strong scaling holds the global batch") && err.contains("ranks-8"), "{err}");
    std::fs::remove_dir_all(runs.path().join("strong/ranks-8")).unwrap();
    // Nor is a folder that names no mode.
    write(runs.path(), "medium/ranks-2", &run_json(2, 16, 100.0));
    let err = common::scaling::collect(runs.path(), results.path()).unwrap_err().to_string();
    assert!(err.contains("`strong/` and `weak/` only, not `medium/`"), "{err}");
    // And no folder at all is the user's to fix.
    let err = common::scaling::collect(&runs.path().join("none"), results.path()).unwrap_err();
    assert_eq!(common::error::exit_code(&err), 2, "{err}");
    assert!(err.to_string().contains("run `make scaling` first"), "{err}");
}
