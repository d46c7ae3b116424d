//! `--strategy parameter-server` as a user runs it, CPU ranks through `--nproc-per-node`
//! (mpirun): synchronous servers train the model all-reduce data parallelism trains, with SGD
//! momentum (clipped) and Adam, on 1 and 2 servers; asynchronous ones record the staleness of
//! every applied gradient, within --max-staleness when given; checkpoints pass between a
//! parameter-server run and a plain one both ways; and flag mistakes are one clear line.
mod support;

use common::checkpoint;
use std::path::Path;
use std::process::{Command, Output};
use support::{read_json, stderr};

fn exercise2(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_exercise2"));
    cmd.args(args).args(["--device", "cpu", "--quiet", "--threads", "1", "--workers", "0", "--model", "cnn", "--num-classes", "10"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("exercise2 runs")
}

/// Generated CIFAR-10-format data: `train` training images, 16 test images.
fn data(dir: &Path, train: usize) {
    let status = Command::new(env!("CARGO_BIN_EXE_prepare_data"))
        .args(["generate", "--dataset", "cifar10", "--train", &train.to_string(), "--test", "16", "--out"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

/// Runs exercise2 with `flags` into `dir` (results and checkpoint); returns its results.
fn run(data: &Path, dir: &Path, flags: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut args = vec!["--data-dir", data.to_str().unwrap(), "--results-dir", dir.to_str().unwrap(), "--checkpoint-dir", dir.to_str().unwrap()];
    args.extend_from_slice(flags);
    let out = exercise2(&args, env);
    assert!(out.status.success(), "{flags:?}: {}", stderr(&out));
    read_json(&dir.join("exercise2-cnn-cpu.json"))
}

/// The checkpoint's tensors whose names start with `prefix` (`model.` or `optim.`), by name.
fn saved(dir: &Path, prefix: &str) -> Vec<(String, tch::Tensor)> {
    let ck = checkpoint::load(&checkpoint::path_for(dir, "exercise2-cnn-cpu")).unwrap();
    let mut tensors: Vec<_> = ck.tensors.into_iter().filter(|(k, _)| k.starts_with(prefix)).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

fn worst_relative_difference(a: &[(String, tch::Tensor)], b: &[(String, tch::Tensor)]) -> f64 {
    assert_eq!(a.iter().map(|t| &t.0).collect::<Vec<_>>(), b.iter().map(|t| &t.0).collect::<Vec<_>>(), "other tensors");
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| {
            let (x, y) = (x.to_kind(tch::Kind::Double), y.to_kind(tch::Kind::Double));
            (&x - &y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]).max(1e-12)
        })
        .fold(0.0, f64::max)
}

fn losses(json: &serde_json::Value) -> Vec<f64> {
    json["step_losses"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

const PS: [&str; 2] = ["--strategy", "parameter-server"];

/// 2 workers and 1 or 2 servers, --sync, against 2 all-reduce replicas: the same step losses
/// and final parameters (1e-5), with clipped SGD momentum and with Adam.
#[test]
fn synchronous_servers_train_what_all_reduce_trains() {
    let d = tempfile::tempdir().unwrap();
    data(d.path(), 64);
    let sgd = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--clip", "0.5", "--batch-size", "8", "--epochs", "1"];
    let adam = ["--optimizer", "adam", "--lr", "0.001", "--batch-size", "8", "--epochs", "1"];
    for (optimizer, recipe, servers) in [("sgd", &sgd[..], &["1", "2"][..]), ("adam", &adam[..], &["2"][..])] {
        let reference = tempfile::tempdir().unwrap();
        let mut flags = recipe.to_vec();
        flags.extend(["--nproc-per-node", "2"]);
        let all_reduce = run(d.path(), reference.path(), &flags, &[]);
        for &s in servers {
            let dir = tempfile::tempdir().unwrap();
            let ranks = (2 + s.parse::<usize>().unwrap()).to_string();
            let mut flags = recipe.to_vec();
            flags.extend(["--nproc-per-node", &ranks, "--servers", s, "--sync"]);
            flags.extend(PS);
            let json = run(d.path(), dir.path(), &flags, &[]);
            assert_eq!(json["gradient_sync"], "parameter-server");
            assert_eq!(json["parameter_server"]["mode"], "sync");
            assert_eq!(json["parameter_server"]["steps_per_worker"], serde_json::json!([4, 4]));
            assert_eq!(json["parameter_server"]["staleness_histogram"], serde_json::json!({ "0": 8 * s.parse::<u64>().unwrap() }));
            // The pushes and pulls count in the worker's traffic: every step at least the
            // gradients out (float32) and the parameters back.
            let per_step = &json["communication_per_step"];
            let params = json["params"].as_u64().unwrap();
            for kind in ["send", "recv"] {
                assert!(per_step[kind]["bytes"].as_u64().unwrap() >= 4 * params, "{kind}: {per_step}");
            }
            let (a, b) = (losses(&all_reduce), losses(&json));
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5 * x.abs(), "{optimizer}, {s} server(s): step losses {a:?} vs {b:?}");
            }
            let worst = worst_relative_difference(&saved(reference.path(), "model."), &saved(dir.path(), "model."));
            println!("{optimizer}, 2 workers + {s} server(s) vs 2 all-reduce replicas: max relative parameter difference {worst:e}");
            assert!(worst <= 1e-5, "{optimizer}, {s} server(s): parameters differ by {worst:e}");
            let state = worst_relative_difference(&saved(reference.path(), "optim."), &saved(dir.path(), "optim."));
            assert!(state <= 1e-5, "{optimizer}, {s} server(s): optimizer state differs by {state:e}");
        }
    }
}

/// Asynchronous servers: with worker 1's first gradient held back (the PS_HOLD test hook, so
/// the order does not depend on timing) until worker 0's 2 were applied, it is applied 2 versions
/// late; with --max-staleness 1 (SSP: no worker more than 1 step ahead of the other) no applied
/// gradient is more than (2 − 1)(2 · 1 + 1) = 3 versions late. The histogram is in the
/// results either way, and the workers end on the servers' parameters.
#[test]
fn asynchronous_servers_record_staleness_within_the_bound() {
    let d = tempfile::tempdir().unwrap();
    data(d.path(), 64);
    let common = ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", "8", "--epochs", "1", "--nproc-per-node", "3", "--async"];
    for bound in [None, Some("1")] {
        let dir = tempfile::tempdir().unwrap();
        let mut flags = common.to_vec();
        flags.extend(PS);
        flags.extend(["--straggler", "1:0.05"]);
        if let Some(k) = bound {
            flags.extend(["--max-staleness", k]);
        }
        let json = run(d.path(), dir.path(), &flags, &[("PS_HOLD", "1:2")]);
        let ps = &json["parameter_server"];
        let histogram = ps["staleness_histogram"].as_object().unwrap_or_else(|| panic!("{ps}"));
        let total: u64 = histogram.values().map(|c| c.as_u64().unwrap()).sum();
        assert_eq!(total, 8, "every gradient of both workers applied once: {ps}");
        let max = ps["max_staleness_seen"].as_u64().unwrap();
        match bound {
            None => {
                assert_eq!(ps["mode"], "async");
                assert!(max >= 2, "worker 1's first gradient was held behind 2 updates: {ps}");
            }
            Some(k) => {
                assert_eq!(ps["mode"], "bounded-staleness");
                // SSP's bound: at most (W − 1)(2K + 1) versions with W = 2 workers.
                let bound: u64 = 2 * k.parse::<u64>().unwrap() + 1;
                assert_eq!(ps["staleness_bound"].as_u64(), Some(bound), "{ps}");
                assert!(max <= bound && max >= 1, "--max-staleness {k}: {ps}");
            }
        }
        assert!(json["history"][0]["eval_loss"].as_f64().unwrap().is_finite());
    }
}

/// A parameter-server checkpoint is a plain one: its optimizer state is gathered from the
/// servers under the parameters' names; resumed on 1 plain rank (with the doubled batch) it lands
/// where 2 all-reduce replicas land after 2 epochs, and a plain 1-rank checkpoint resumed by 2
/// workers and 2 servers (its state scattered to them) lands where 2 replicas resuming it land.
#[test]
fn checkpoints_pass_between_parameter_server_and_plain_runs() {
    let d = tempfile::tempdir().unwrap();
    data(d.path(), 64);
    let recipe = ["--optimizer", "adam", "--lr", "0.001", "--resume"];
    let with = |extra: &[&'static str]| {
        let mut flags = recipe.to_vec();
        flags.extend_from_slice(extra);
        flags
    };
    let straight = tempfile::tempdir().unwrap();
    run(d.path(), straight.path(), &with(&["--epochs", "2", "--batch-size", "8", "--nproc-per-node", "2"]), &[]);

    let ps_first = tempfile::tempdir().unwrap();
    run(d.path(), ps_first.path(), &with(&["--epochs", "1", "--batch-size", "8", "--nproc-per-node", "3", "--strategy", "parameter-server"]), &[]);
    assert!(saved(ps_first.path(), "optim.").iter().any(|(k, _)| k.contains("exp_avg_sq.conv1.weight")), "Adam's state under the parameters' names");
    let json = run(d.path(), ps_first.path(), &with(&["--epochs", "2", "--batch-size", "16"]), &[]);
    assert_eq!((json["world_size"].as_u64(), json["resumed_epochs"].as_u64()), (Some(1), Some(1)));
    let worst = worst_relative_difference(&saved(straight.path(), "model."), &saved(ps_first.path(), "model."));
    assert!(worst <= 1e-5, "a parameter-server checkpoint resumed on 1 plain rank: {worst:e}");

    // The other way: a plain 1-rank checkpoint, resumed by 2 all-reduce replicas and by 2 workers
    // + 2 servers (its Adam state scattered to them): the same second epoch.
    let plain_first = tempfile::tempdir().unwrap();
    run(d.path(), plain_first.path(), &with(&["--epochs", "1", "--batch-size", "16"]), &[]);
    let name = "exercise2-cnn-cpu.safetensors";
    let replicas = tempfile::tempdir().unwrap();
    std::fs::copy(plain_first.path().join(name), replicas.path().join(name)).unwrap();
    run(d.path(), replicas.path(), &with(&["--epochs", "2", "--batch-size", "8", "--nproc-per-node", "2"]), &[]);
    let json = run(
        d.path(),
        plain_first.path(),
        &with(&["--epochs", "2", "--batch-size", "8", "--nproc-per-node", "4", "--strategy", "parameter-server", "--servers", "2"]),
        &[],
    );
    assert_eq!(json["resumed_epochs"].as_u64(), Some(1));
    let worst = worst_relative_difference(&saved(replicas.path(), "model."), &saved(plain_first.path(), "model."));
    assert!(worst <= 1e-5, "a plain checkpoint resumed by 2 workers + 2 servers vs by 2 replicas: {worst:e}");
    let state = worst_relative_difference(&saved(replicas.path(), "optim."), &saved(plain_first.path(), "optim."));
    assert!(state <= 1e-5, "its optimizer state after the second epoch: {state:e}");
}

#[test]
fn parameter_server_flag_mistakes_are_one_clear_line_with_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_str().unwrap();
    for (flags, expected) in [
        (&["--servers", "1"][..], "add --strategy parameter-server"),
        (&["--async"][..], "add --strategy parameter-server"),
        (&["--strategy", "parameter-server", "--sync", "--async"][..], "cannot be used with"),
        (&["--strategy", "parameter-server", "--servers", "2", "--nproc-per-node", "2"][..], "leaves no worker among 2 rank(s)"),
        (&["--strategy", "parameter-server", "--zero", "1", "--nproc-per-node", "3"][..], "--zero 1 shards the optimizer"),
        (&["--strategy", "parameter-server", "--sync", "--max-staleness", "1"][..], "--max-staleness bounds --async"),
        (&["--straggler", "1"][..], "expected RANK:SECONDS"),
        (&["--strategy", "parameter-server", "--checkpoint-dir", dir, "--checkpoint-every", "2"][..], "need workers that step together"),
    ] {
        let mut args = vec!["--data-dir", dir, "--max-steps", "1"];
        args.extend_from_slice(flags);
        let out = exercise2(&args, &[]);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expected), "{flags:?}: {}", stderr(&out));
    }
}

/// The language model over asynchronous servers: its separate test split is evaluated after the
/// servers stopped (on the parameters every worker took at the last epoch's end), and the
/// servers' figures reach the results; exercise3 ddp takes the strategy too.
#[test]
fn the_language_model_and_exercise3_train_over_parameter_servers() {
    let text = tempfile::tempdir().unwrap();
    support::wikitext_sample(text.path(), [60; 3]);
    let out_dir = tempfile::tempdir().unwrap();
    let args = ["--device", "cpu", "--emsize", "32", "--d-hid", "64", "--nhead", "4", "--nlayers", "2", "--batch-size", "8", "--threads", "1"];
    let out = Command::new(env!("CARGO_BIN_EXE_exercise1_nlp"))
        .args(["--data-dir", text.path().to_str().unwrap(), "--results-dir", out_dir.path().to_str().unwrap(), "--epochs", "2", "--quiet"])
        .args(args)
        .args(["--nproc-per-node", "3", "--strategy", "parameter-server", "--servers", "1", "--async"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let json = read_json(&out_dir.path().join("exercise1_nlp-transformer-cpu.json"));
    assert_eq!(json["gradient_sync"], "parameter-server");
    assert!(json["test_ppl"].as_f64().is_some_and(f64::is_finite), "{}", json["test_ppl"]);
    assert_eq!(json["parameter_server"]["steps_per_worker"].as_array().map(Vec::len), Some(2), "{}", json["parameter_server"]);

    let images = tempfile::tempdir().unwrap();
    data(images.path(), 32);
    let out = Command::new(env!("CARGO_BIN_EXE_exercise3"))
        .args(["ddp", "--data-dir", images.path().to_str().unwrap(), "--results-dir", out_dir.path().to_str().unwrap()])
        .args(["--device", "cpu", "--quiet", "--threads", "1", "--workers", "0", "--model", "cnn", "--epochs", "1", "--batch-size", "8"])
        .args(["--nproc-per-node", "3", "--strategy", "parameter-server", "--servers", "1", "--sync"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("parameter server (sync, 2 worker(s) + 1 server(s))"), "{}", String::from_utf8_lossy(&out.stdout));
}
