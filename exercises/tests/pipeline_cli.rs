//! exercise3 pipeline as a user runs it: a pipelined Transformer learns real WikiText-2 text,
//! the results file carries the pipeline's figures (the interleaved schedule's too),
//! checkpoints resume on other layouts, and configuration mistakes are one clear line with exit
//! code 2.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{read_json, shared_data, stderr, wikitext_sample};

fn exercise3_pipeline(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_exercise3")).arg("pipeline").args(args).output().expect("exercise3 runs")
}

/// The 1.4B model's width, d 4096 (one layer, so that it runs in a test): the default recipe
/// learns where the course's (`--recipe course`, the tutorial's SGD at lr 5 with its output
/// layer U(±0.1)) moves away from even uniform guessing. Measured here: 6.27 vs 18.53 after 20
/// steps against 8.77 for uniform guessing (ln V); after 12 steps the test below asserts
/// margins of more than a nat on either side.
#[test]
fn at_d_4096_the_default_recipe_learns_where_the_courses_does_not() {
    let data = tempfile::tempdir().unwrap();
    let real = shared_data("wikitext-2");
    let read = |name: &str| std::fs::read_to_string(real.join(name)).unwrap();
    let lines = |text: &str, from: usize, n: usize| text.lines().skip(from).take(n).collect::<Vec<_>>().join("\n") + "\n";
    let (valid, test) = (read("valid.txt"), read("test.txt"));
    std::fs::write(data.path().join("train.txt"), lines(&valid, 0, 1200)).unwrap();
    std::fs::write(data.path().join("valid.txt"), lines(&test, 0, 30)).unwrap();
    std::fs::write(data.path().join("test.txt"), lines(&test, 30, 60)).unwrap();
    let run = |recipe: &[&str]| {
        let results = tempfile::tempdir().unwrap();
        let mut args = vec![
            "--devices",
            "cpu",
            "--data-dir",
            data.path().to_str().unwrap(),
            "--emsize",
            "4096",
            "--d-hid",
            "4096",
            "--nhead",
            "16",
            "--nlayers",
            "1",
            "--batch-size",
            "4",
            "--chunks",
            "1",
            "--max-steps",
            "12",
            "--epochs",
            "1",
            "--seed",
            "42",
            "--quiet",
            "--results-dir",
            results.path().to_str().unwrap(),
        ];
        args.extend_from_slice(recipe);
        let out = exercise3_pipeline(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let json = read_json(&results.path().join("exercise3_pipeline-transformer-cpu.json"));
        (json["test_loss"].as_f64().unwrap(), json["optimizer"].as_str().unwrap().to_string(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    // The default's 100 warm-up steps would cover the whole test: a short ramp instead.
    let (ours, optimizer, stdout) = run(&["--warmup-steps", "4", "--warmup-start", "0.1"]);
    let (course, course_optimizer, _) = run(&["--recipe", "course"]);
    let vocabulary: f64 = stdout.split("vocabulary ").nth(1).and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next()).unwrap().parse().unwrap();
    let uniform = vocabulary.ln();
    println!("d 4096, 1 layer, 12 steps: test loss {ours:.2} (default, {optimizer}) vs {course:.2} (--recipe course, {course_optimizer}); uniform guessing {uniform:.2}");
    assert_eq!((optimizer.as_str(), course_optimizer.as_str()), ("adam", "sgd"));
    assert!(ours < uniform - 1.0, "the default recipe did not learn: test loss {ours} vs uniform {uniform}");
    assert!(course > uniform + 3.0, "the course's recipe learned at d 4096 ({course} vs uniform {uniform}): docs/pipeline.md's claim is stale");
}

#[test]
fn a_two_stage_pipeline_learns_real_wikitext_and_reports_its_bubble() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [1200; 3]);
    let results = tempfile::tempdir().unwrap();
    let out = exercise3_pipeline(&[
        "--data-dir",
        data.path().to_str().unwrap(),
        "--devices",
        "cpu,cpu",
        "--chunks",
        "4",
        "--schedule",
        "1f1b",
        "--balance",
        "--emsize",
        "64",
        "--d-hid",
        "128",
        "--nhead",
        "2",
        "--nlayers",
        "2",
        "--dropout",
        "0",
        "--epochs",
        "4",
        // The course's recipe (the tutorial's SGD; exercise3's default is for d 4096) at lr 2.0
        // rather than 5.0: at 5.0 this small model barely reached the unigram model in 2 epochs
        // (314.8 vs 301.2), and where it lands then depends on each machine's float rounding; at
        // 2.0 over 4 epochs it measured 207.8, a margin that holds anywhere.
        "--recipe",
        "course",
        "--lr",
        "2.0",
        "--seed",
        "42",
        "--threads",
        "2",
        "--quiet",
        "--results-dir",
        results.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stage 0 on cpu: embedding + layers 0..1") && stdout.contains("layers 1..2 + output layer"), "{stdout}");
    assert!(stdout.contains("--balance: forward + backward of one micro-batch"), "{stdout}");
    let json = read_json(&results.path().join("exercise3_pipeline-transformer-cpu.json"));
    assert_eq!((json["stages"].as_u64(), json["chunks"].as_u64()), (Some(2), Some(4)));
    assert_eq!(json["schedule"], "1f1b");
    assert_eq!(json["partition"], serde_json::json!([[0, 1], [1, 2]]));
    let bubble = json["bubble_fraction"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&bubble), "bubble {bubble}");
    assert!((json["bubble_fraction_theory"].as_f64().unwrap() - 0.2).abs() < 1e-12, "(2−1)/(4+2−1)");
    let v = json["vocab"].as_i64().unwrap();
    let expected_params = 2 * 64 * v + v + 2 * ((4 * 64 * 64 + 4 * 64) + 2 * 64 * 128 + 128 + 64 + 4 * 64);
    assert_eq!(json["params"], expected_params);
    let bytes: Vec<i64> = json["stage_parameter_bytes"].as_array().unwrap().iter().map(|b| b.as_i64().unwrap()).collect();
    assert_eq!(bytes.iter().sum::<i64>(), 4 * expected_params, "float32 parameters split over the stages");
    let (ppl, unigram) = (json["test_ppl"].as_f64().unwrap(), json["unigram_test_ppl"].as_f64().unwrap());
    println!("2-stage 1F1B pipeline (d 64, 2 layers), 4 epochs on 1,200 lines of real WikiText-2: test perplexity {ppl:.1} vs unigram {unigram:.1}, bubble {bubble:.3}");
    let history = json["history"].as_array().unwrap();
    let valid: Vec<f64> = history.iter().map(|e| e["eval_loss"].as_f64().unwrap()).collect();
    assert!(valid.windows(2).all(|w| w[1] < w[0]), "validation loss did not fall every epoch: {valid:?}");
    assert!(ppl < 0.85 * unigram, "the pipelined model did not learn: test perplexity {ppl} vs unigram {unigram}");
}

/// The model tensors of the newest checkpoint in `dir` (one file, or sharded by stages in
/// processes), sorted by name.
fn model_tensors(dir: &Path) -> Vec<(String, tch::Tensor)> {
    let run = "exercise3_pipeline-transformer-cpu";
    let mut tensors: Vec<_> = common::checkpoint::load_run(dir, run).unwrap().tensors.into_iter().filter(|(k, _)| k.starts_with("model.")).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

/// The checkpoints `exercise3 pipeline` wrote in `straight` and in `resumed` hold the same
/// model variables, each within `tolerance` of its largest value; `what` says how the runs went.
fn assert_same_model(straight: &Path, resumed: &Path, tolerance: f64, what: &str) {
    let (a, b) = (model_tensors(straight), model_tensors(resumed));
    assert_eq!(a.len(), b.len(), "the gathered checkpoint holds every variable");
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        let rel = (x - y).abs().max().double_value(&[]) / x.abs().max().double_value(&[]).max(1e-12);
        assert!(rel <= tolerance, "{name}: {what} differ by {rel:e}");
    }
}

/// The small model of the checkpoint tests, of `nlayers` layers, without dropout, one thread.
fn small(nlayers: &'static str) -> [&'static str; 12] {
    ["--emsize", "16", "--d-hid", "32", "--nhead", "2", "--nlayers", nlayers, "--dropout", "0", "--threads", "1"]
}

/// `exercise3 pipeline` for `epochs` on `data`, 2 micro-batches, with `flags`, checkpointing to
/// and resuming from `ck` (its results there too); returns what it printed.
fn run_resumable(data: &Path, ck: &Path, epochs: &str, flags: &[&str]) -> String {
    let ck = ck.to_str().unwrap();
    let mut args =
        vec!["--data-dir", data.to_str().unwrap(), "--chunks", "2", "--epochs", epochs, "--quiet", "--checkpoint-dir", ck, "--resume", "--results-dir", ck];
    args.extend(flags);
    let out = exercise3_pipeline(&args);
    assert!(out.status.success(), "{flags:?}: {}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_checkpoint_resumes_on_another_number_of_stages() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [80; 3]);
    let run = |devices: &str, epochs: &str, ck: &Path| run_resumable(data.path(), ck, epochs, &[&small("3")[..], &["--devices", devices]].concat());
    let (straight, resumed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run("cpu,cpu", "2", straight.path());
    run("cpu,cpu,cpu", "1", resumed.path()); // epoch 1 on 3 stages
    let out = run("cpu,cpu", "2", resumed.path()); // epoch 2 on 2 stages
    assert!(out.contains("resumed exercise3_pipeline-transformer-cpu") && out.contains("after epoch 1"), "{out}");
    assert_same_model(straight.path(), resumed.path(), 1e-6, "2 epochs straight vs 1 epoch on 3 stages + 1 resumed on 2");
}

#[test]
fn stages_in_separate_processes_and_replicas_of_them() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [60; 3]);
    let results = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--data-dir",
            data.path().to_str().unwrap(),
            "--device",
            "cpu",
            "--chunks",
            "2",
            "--schedule",
            "1f1b",
            "--emsize",
            "16",
            "--d-hid",
            "32",
            "--nhead",
            "2",
            "--nlayers",
            "2",
            "--max-steps",
            "3",
            "--epochs",
            "1",
            "--quiet",
            "--results-dir",
            results.path().to_str().unwrap(),
        ];
        args.extend(extra);
        let out = exercise3_pipeline(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (stdout, read_json(&results.path().join("exercise3_pipeline-transformer-cpu.json")))
    };
    let (stdout, json) = run(&["--nproc-per-node", "2", "--profile"]);
    assert!(stdout.contains("2 ranks: 1 replica(s) of a 2-stage pipeline"), "{stdout}");
    assert_eq!((json["stages"].as_u64(), json["dp"].as_u64(), json["world_size"].as_u64()), (Some(2), Some(1), Some(2)));
    assert!(json["test_loss"].as_f64().unwrap().is_finite());
    // --profile: each rank's trace holds its stage's passes of the 1F1B schedule, 2 micro-batches
    // × 3 steps, forward and backward.
    for rank in 0..2u64 {
        let path = results.path().join(format!("exercise3_pipeline-transformer-cpu-rank{rank}.trace.json"));
        let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 3 * 2 * 2, "{path:?}");
        assert!(events.iter().all(|e| e["tid"].as_u64() == Some(rank) && e["pid"].as_u64() == Some(rank)));
        let names: Vec<&str> = events[..4].iter().map(|e| e["name"].as_str().unwrap()).collect();
        let expected = if rank == 0 { ["F0", "F1", "B0", "B1"] } else { ["F0", "B0", "F1", "B1"] };
        assert_eq!(names, expected, "rank {rank}: the 1F1B order of stage {rank}");
    }
    let (stdout, json) = run(&["--nproc-per-node", "4", "--dp", "2"]);
    assert!(stdout.contains("4 ranks: 2 replica(s) of a 2-stage pipeline"), "{stdout}");
    assert_eq!((json["stages"].as_u64(), json["dp"].as_u64(), json["world_size"].as_u64()), (Some(2), Some(2), Some(4)));
    // A job that is not stages × dp ranks: one clear line from rank 0, exit 2.
    let out = exercise3_pipeline(&[
        "--data-dir",
        data.path().to_str().unwrap(),
        "--device",
        "cpu",
        "--emsize",
        "16",
        "--d-hid",
        "32",
        "--nhead",
        "2",
        "--nlayers",
        "2",
        "--max-steps",
        "1",
        "--quiet",
        "--nproc-per-node",
        "3",
        "--devices",
        "cpu,cpu",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("3 ranks cannot run pipelines of 2 stages"), "{}", stderr(&out));
}

#[test]
fn an_interleaved_pipeline_reports_its_virtual_stages_and_bubble() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [60; 3]);
    let results = tempfile::tempdir().unwrap();
    let run = |placement: &[&str]| {
        let mut args = vec![
            "--data-dir",
            data.path().to_str().unwrap(),
            "--schedule",
            "interleaved",
            "--virtual-stages",
            "2",
            "--max-steps",
            "3",
            "--epochs",
            "1",
            "--quiet",
            "--results-dir",
            results.path().to_str().unwrap(),
        ];
        args.extend(small("4"));
        args.extend(placement);
        let out = exercise3_pipeline(&args);
        assert!(out.status.success(), "{placement:?}: {}", stderr(&out));
        (String::from_utf8_lossy(&out.stdout).into_owned(), read_json(&results.path().join("exercise3_pipeline-transformer-cpu.json")))
    };
    // Threads in one process: device d holds stages d and d + 2.
    let (stdout, json) = run(&["--devices", "cpu,cpu", "--chunks", "4"]);
    assert!(stdout.contains("2 devices × 2 virtual stages, 4 micro-batches"), "{stdout}");
    assert!(stdout.contains("device 0 on cpu: stage 0 (embedding + layers 0..1), stage 2 (layers 2..3);"), "{stdout}");
    assert!(stdout.contains("device 1 on cpu: stage 1 (layers 1..2), stage 3 (layers 3..4 + output layer);"), "{stdout}");
    assert!(stdout.contains("pipeline bubble: measured") && stdout.contains("(p−1)/(V·m) = 0.125 of the compute) for p = 2, m = 4, V = 2"), "{stdout}");
    assert_eq!(json["schedule"], "interleaved");
    assert_eq!((json["stages"].as_u64(), json["virtual_stages"].as_u64(), json["chunks"].as_u64()), (Some(2), Some(2), Some(4)));
    assert_eq!(json["partition"], serde_json::json!([[0, 1], [1, 2], [2, 3], [3, 4]]));
    let bubble = json["bubble_fraction"].as_f64().unwrap();
    assert!((0.0..1.0).contains(&bubble), "bubble {bubble}");
    assert!((json["bubble_ratio"].as_f64().unwrap() - bubble / (1.0 - bubble)).abs() < 1e-9);
    assert!((json["bubble_fraction_theory"].as_f64().unwrap() - 1.0 / 9.0).abs() < 1e-12, "(2−1)/(2·4+2−1)");
    assert!((json["bubble_ratio_theory"].as_f64().unwrap() - 1.0 / 8.0).abs() < 1e-12, "(2−1)/(2·4)");
    assert_eq!(json["devices"].as_array().unwrap().len(), 2, "one entry per device");
    assert!(json["test_loss"].as_f64().unwrap().is_finite());
    println!("2 devices × 2 virtual stages, 4 micro-batches, 3 steps: bubble {bubble:.3} measured, {:.3} in theory", 1.0 / 9.0);

    // One rank per device: each rank's trace holds its stages' passes in the interleaved
    // order (2 micro-batches: device 0 runs every forward first, 2·1 + 2 ≥ 4).
    let (stdout, json) = run(&["--device", "cpu", "--nproc-per-node", "2", "--chunks", "2", "--profile"]);
    assert!(stdout.contains("2 ranks: 1 replica(s) of a 2-stage pipeline, rank r runs stages r mod 2, r mod 2 + 2, … (2 of them)"), "{stdout}");
    assert_eq!((json["stages"].as_u64(), json["virtual_stages"].as_u64(), json["world_size"].as_u64()), (Some(2), Some(2), Some(2)));
    for (rank, expected) in [(0u64, ["F0@0", "F1@0", "F0@2", "F1@2", "B0@2", "B1@2"]), (1, ["F0@1", "F1@1", "F0@3", "B0@3", "F1@3", "B1@3"])] {
        let path = results.path().join(format!("exercise3_pipeline-transformer-cpu-rank{rank}.trace.json"));
        let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 3 * 2 * 2 * 2, "{path:?}: 3 steps × 2 micro-batches × 2 stages × forward and backward");
        let names: Vec<&str> = events[..6].iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(names, expected, "rank {rank}: the interleaved order of device {rank}");
    }
}

#[test]
fn a_checkpoint_of_an_interleaved_pipeline_resumes_on_other_layouts() {
    // 3 epochs straight (GPipe on 2 devices) against epoch 1 interleaved on 2 ranks (2 stages
    // each), epoch 2 interleaved on one device (4 stages, one thread), epoch 3 1F1B on 2 devices.
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [80; 3]);
    let run = |ck: &Path, epochs: &str, layout: &[&str]| run_resumable(data.path(), ck, epochs, &[&small("4")[..], &["--device", "cpu"], layout].concat());
    let (straight, resumed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(straight.path(), "3", &["--devices", "cpu,cpu"]);
    run(resumed.path(), "1", &["--nproc-per-node", "2", "--schedule", "interleaved"]);
    let out = run(resumed.path(), "2", &["--devices", "cpu", "--schedule", "interleaved", "--virtual-stages", "4"]);
    assert!(out.contains("after epoch 1") && out.contains("device 0 on cpu: stage 0 (embedding + layers 0..1), stage 1 (layers 1..2)"), "{out}");
    let out = run(resumed.path(), "3", &["--devices", "cpu,cpu", "--schedule", "1f1b"]);
    assert!(out.contains("resumed exercise3_pipeline-transformer-cpu") && out.contains("after epoch 2"), "{out}");
    assert_same_model(straight.path(), resumed.path(), 1e-5, "3 epochs straight vs interleaved on 2 ranks, on 1 device, then 1F1B");
}

#[test]
fn configuration_mistakes_are_one_clear_line_with_exit_2() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [50; 3]);
    let small = ["--emsize", "16", "--d-hid", "16", "--nhead", "2", "--nlayers", "2", "--max-steps", "1", "--quiet"];
    let dir = data.path().to_str().unwrap();
    for (flags, message) in [
        (vec!["--devices", "gpu0,cpu"], "unknown device `gpu0`: use cpu, cuda or cuda:N"),
        (vec!["--devices", "cpu,cpu,cpu"], "3 pipeline stages but only 2 encoder layers"),
        (vec!["--devices", "cpu,cpu", "--chunks", "21"], "--chunks 21 is more than --batch-size 20"),
        (vec!["--devices", "cpu,cpu", "--schedule", "interleaved", "--virtual-stages", "0"], "--virtual-stages must be at least 1"),
        (
            vec!["--devices", "cpu,cpu", "--schedule", "interleaved", "--virtual-stages", "2"],
            "2 devices × 2 virtual stages need 4 stages of at least one encoder layer each, but the model has 2",
        ),
        (
            vec!["--devices", "cpu,cpu", "--schedule", "interleaved", "--virtual-stages", "1", "--chunks", "3"],
            "--schedule interleaved needs --chunks to be a multiple of the 2 pipeline devices, got 3",
        ),
        (vec!["--devices", "cpu,cpu", "--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    ] {
        let mut args = vec!["--data-dir", dir];
        args.extend(small);
        args.extend(&flags);
        let out = exercise3_pipeline(&args);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(message), "{flags:?}: {}", stderr(&out));
        assert_eq!(stderr(&out).trim().lines().count(), 1, "{flags:?}: one line: {}", stderr(&out));
    }
    if !tch::Cuda::is_available() {
        let out = exercise3_pipeline(&["--data-dir", dir, "--devices", "cuda:0,cuda:0"]);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains("device `cuda:0`"), "{}", stderr(&out));
    }
}

#[test]
fn a_checkpoint_from_stages_in_processes_resumes_in_one_process() {
    let data = tempfile::tempdir().unwrap();
    wikitext_sample(data.path(), [80; 3]);
    let run =
        |ck: &Path, epochs: &str, placement: &[&str]| run_resumable(data.path(), ck, epochs, &[&small("3")[..], &["--device", "cpu"], placement].concat());
    let (straight, resumed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(straight.path(), "2", &["--devices", "cpu,cpu"]);
    // Epoch 1 with one stage per process (2 ranks): the ranks' parts gathered into one file...
    run(resumed.path(), "1", &["--nproc-per-node", "2"]);
    // ...and epoch 2 in one process, on one stage.
    let out = run(resumed.path(), "2", &["--devices", "cpu"]);
    assert!(out.contains("resumed exercise3_pipeline-transformer-cpu") && out.contains("after epoch 1"), "{out}");
    assert_same_model(straight.path(), resumed.path(), 1e-5, "2 epochs straight vs 1 epoch in 2 processes + 1 resumed in one");
}

/// `exercise3 pipe`, the slides' `Pipe` example: its two layers on two devices, the pipelined
/// step's gradients those of the whole batch, both ways timed side by side, the theory's bubble
/// for each; a wrong flag is one line and exit 2.
#[test]
fn the_slides_pipe_example_runs_beside_naive_model_parallelism() {
    let pipe = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_exercise3")).arg("pipe").args(args).output().expect("exercise3 runs");
    let out = pipe(&["--devices", "cpu,cpu", "--steps", "3"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("Pipe(Sequential(Linear(16, 8) on cpu, Linear(8, 4) on cpu), chunks=8)\n"), "{stdout}");
    assert!(stdout.contains("model(input [16, 16]): [16, 4] on cpu;"), "{stdout}");
    let difference: f64 =
        stdout.split("largest difference ").nth(1).and_then(|rest| rest.lines().next()).and_then(|d| d.parse().ok()).expect("the gradients' difference");
    assert!(difference < 1e-6, "{stdout}");
    // GPipe's bubble (D−1)/(N+D−1) for D = 2 devices: 50% with one micro-batch, 11.1% with 8.
    let row = |name: &str| stdout.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no `{name}` row in {stdout}")).to_string();
    assert!(row("naive model parallelism").trim_end().ends_with("50.0%"), "{stdout}");
    assert!(row("pipeline (GPipe)").trim_end().ends_with("11.1%"), "{stdout}");
    assert!(stdout.contains("medians of 3 steps each"), "{stdout}");

    let out = pipe(&["--devices", "cpu", "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(stderr(&out).trim(), "error: --devices names 1 devices for the 2 layers of --sizes [16, 8, 4]: one device a layer");
}
