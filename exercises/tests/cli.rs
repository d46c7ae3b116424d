//! exercise1 as a user runs it: learning on real MNIST digits, results files, exact resume
//! through the flags, and one clear line with the right exit code for each mistake.
mod support;

use std::path::Path;
use std::process::{Command, Output};
use support::{read_json, shared_data, stderr};

fn exercise1(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_exercise1")).args(args).output().expect("exercise1 runs")
}

fn generated_cifar(dir: &Path, train: usize) {
    support::generated_cifar10(dir, train, 50);
}

#[test]
fn the_course_cnn_learns_real_mnist_digits() {
    let results = tempfile::tempdir().unwrap();
    let out = exercise1(&[
        "--dataset",
        "mnist",
        "--data-dir",
        shared_data("mnist-5k").to_str().unwrap(),
        "--device",
        "cpu",
        "--epochs",
        "5",
        "--quiet",
        "--results-dir",
        results.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("155,685 parameters"), "{stdout}");
    let json = read_json(&results.path().join("exercise1-cnn-cpu.json"));
    let acc = json["test_acc"].as_f64().unwrap();
    println!("simple CNN, 4,000 real MNIST digits, 5 epochs on CPU: test accuracy {acc:.4} (PyTorch reaches 0.95-0.96)");
    assert!(acc >= 0.94, "test accuracy {acc} < 0.94");
    assert_eq!(json["data_generated"], false);
    assert_eq!(json["steps"], 200);
    assert_eq!(json["history"].as_array().unwrap().len(), 5);
    for field in ["exercise", "model", "params", "device", "dataset", "epochs", "batch_size", "train_time_s", "throughput", "test_loss", "torch_version"] {
        assert!(!json[field].is_null(), "results JSON lacks {field}");
    }
    assert!(json["torch_version"].as_str().unwrap().starts_with("2.11.0"), "{}", json["torch_version"]);
    let csv = std::fs::read_to_string(results.path().join("exercise1.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "header and one row");
}

#[test]
fn device_both_without_a_gpu_runs_the_cpu_and_says_the_gpu_is_missing() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 100);
    let results = tempfile::tempdir().unwrap();
    let out = exercise1(&[
        "--data-dir",
        data.path().to_str().unwrap(),
        "--device",
        "both",
        "--max-steps",
        "3",
        "--results-dir",
        results.path().to_str().unwrap(),
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("191,935 parameters"), "{stdout}");
    assert!(stdout.contains("GPU column missing"), "{stdout}");
    assert!(stderr(&out).contains("GENERATED"), "generated data is announced");
    let json = read_json(&results.path().join("exercise1-cnn-cpu.json"));
    assert_eq!(json["steps"], 3);
    assert_eq!(json["data_generated"], true);
    // The charts beside the results: SVG images of the chart sizes, with the run's names.
    for (file, size, text) in [
        ("exercise1-cnn-cpu.svg", (common::plots::WIDTH, common::plots::HEIGHT), "evaluation accuracy"),
        ("exercise1-cnn-devices.svg", (common::plots::WIDTH / 2, common::plots::HEIGHT), "images/s"),
    ] {
        let svg = std::fs::read_to_string(results.path().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(svg.contains(&format!("width=\"{}\" height=\"{}\"", size.0, size.1)), "{file}: not {size:?}");
        assert!(svg.contains(text) && svg.trim_end().ends_with("</svg>"), "{file}");
    }
    // The curves are drawn per step: a line through the 3 steps, not one point for the one epoch.
    let curves = std::fs::read_to_string(results.path().join("exercise1-cnn-cpu.svg")).unwrap();
    let longest =
        curves.split("<polyline").skip(1).map(|line| line.split("points=\"").nth(1).unwrap().split('"').next().unwrap().split_whitespace().count()).max();
    assert!(longest.is_some_and(|points| points >= 3), "no line through the steps: {longest:?}");
    // The GPU did not run: its place in the bar chart says so.
    let devices = std::fs::read_to_string(results.path().join("exercise1-cnn-devices.svg")).unwrap();
    assert!(devices.contains("not run"), "{devices}");
}

#[test]
fn resume_through_the_flags_matches_a_straight_run() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 200);
    let run = |epochs: &str, ck: &Path, results: &Path| {
        let out = exercise1(&[
            "--data-dir",
            data.path().to_str().unwrap(),
            "--device",
            "cpu",
            "--epochs",
            epochs,
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--resume",
            "--quiet",
            "--results-dir",
            results.to_str().unwrap(),
            "--batch-size",
            "50",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        (read_json(&results.join("exercise1-cnn-cpu.json")), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (straight, _) = run("2", a.path(), a.path());
    run("1", b.path(), b.path());
    let (resumed, stdout) = run("2", b.path(), b.path());
    assert!(stdout.contains("resumed exercise1-cnn-cpu") && stdout.contains("after epoch 1"), "{stdout}");
    assert_eq!(resumed["resumed_epochs"], 1);
    assert_eq!(resumed["steps"], 4, "only the second epoch ran");
    let (x, y) = (straight["test_loss"].as_f64().unwrap(), resumed["test_loss"].as_f64().unwrap());
    assert!((x - y).abs() <= 1e-6 * x.abs(), "test loss straight {x} vs resumed {y}");
}

#[test]
fn profile_prints_the_phases_and_the_operators_and_writes_both_traces() {
    let d = tempfile::tempdir().unwrap();
    generated_cifar(d.path(), 40);
    let results = tempfile::tempdir().unwrap();
    let out = exercise1(&[
        "--device",
        "cpu",
        "--data-dir",
        d.path().to_str().unwrap(),
        "--batch-size",
        "10",
        "--max-steps",
        "3",
        "--quiet",
        "--profile-steps",
        "2..3",
        "--clip",
        "1",
        "--peak-tflops",
        "1",
        "--results-dir",
        results.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).lines().all(|l| l.starts_with("WARNING: cifar10")), "nothing on stderr but our own lines: {}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // One process clips the gradients between backward and optimizer: the phase says so.
    for phase in ["| data wait |", "| forward |", "| backward |", "| clip |", "| optimizer |", "| evaluation |"] {
        assert!(stdout.contains(phase), "no {phase} row: {stdout}");
    }
    assert!(!stdout.contains("all-reduce |"), "no replicas, no all-reduce: {stdout}");
    // Besides the mean per step, the median of the steps LibTorch's profiler left alone.
    assert!(stdout.contains("| per step (ms) | median, typical steps (ms) |") && stdout.contains("outside LibTorch's profiler's steps 2..3"), "{stdout}");
    // LibTorch's profiler over steps 2 and 3: the course CNN's convolutions by self CPU time.
    assert!(stdout.contains("LibTorch's profiler, steps 2..3 (2 recorded), operators and kernels by self CPU time"), "{stdout}");
    assert!(stdout.contains("| aten::mkldnn_convolution | 4 |") || stdout.contains("| aten::convolution | 4 |"), "two convolutions a step: {stdout}");
    let torch_trace: serde_json::Value = serde_json::from_slice(&std::fs::read(results.path().join("exercise1-cnn-cpu.torch-trace.json")).unwrap()).unwrap();
    let torch_events = torch_trace["traceEvents"].as_array().unwrap();
    let named = |name: &str| torch_events.iter().filter(|e| e["name"] == name && e["ph"] == "X").count();
    assert_eq!((named("aten::convolution"), named("ProfilerStep#2"), named("ProfilerStep#3"), named("ProfilerStep#1")), (4, 1, 1, 0));
    let tables = std::fs::read_to_string(results.path().join("exercise1-cnn-cpu.profile.md")).unwrap();
    assert!(tables.contains("| clip |") && tables.contains("aten::convolution"), "{tables}");
    assert!(stdout.contains("compute: ") && stdout.contains("MFU "), "{stdout}");
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(results.path().join("exercise1-cnn-cpu.trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let count = |name: &str| events.iter().filter(|e| e["name"] == name).count();
    assert_eq!((count("forward"), count("backward"), count("optimizer"), count("evaluation")), (3, 3, 3, 1));
    // Each step's phases follow one another in time.
    let step0: Vec<&serde_json::Value> = events.iter().filter(|e| e["args"]["step"] == 0).collect();
    for pair in step0.windows(2) {
        let end = pair[0]["ts"].as_f64().unwrap() + pair[0]["dur"].as_f64().unwrap();
        assert!(pair[1]["ts"].as_f64().unwrap() >= end - 1.0, "{pair:?}");
    }
    let json = read_json(&results.path().join("exercise1-cnn-cpu.json"));
    let (flops, tflops, mfu) = (json["flops_per_example"].as_f64().unwrap(), json["tflops"].as_f64().unwrap(), json["mfu"].as_f64().unwrap());
    assert_eq!(flops, 6.0 * 12_409_250.0, "the course CNN's training FLOPs per image");
    assert!((mfu - tflops / 1.0).abs() < 1e-12 && tflops > 0.0);
}

#[test]
fn an_unknown_model_is_a_usage_error() {
    let out = exercise1(&["--model", "alexnet"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("invalid value 'alexnet'") && err.contains("cnn, resnet34, resnet50, vgg19"), "{err}");
}

#[test]
fn a_missing_data_directory_is_one_clear_line() {
    let out = exercise1(&["--data-dir", "/nonexistent/cifar", "--device", "cpu"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: data directory /nonexistent/cifar does not exist") && err.contains("make data"), "{err}");
}

#[test]
fn cuda_without_a_gpu_exits_2_with_one_line() {
    let out = exercise1(&["--device", "cuda", "--data-dir", "/nonexistent"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no CUDA device is available"), "{err}");
}

#[test]
fn flag_mistakes_are_usage_errors() {
    let out = exercise1(&["--resume"]);
    assert_eq!(out.status.code(), Some(2), "--resume needs --checkpoint-dir");
    assert!(stderr(&out).contains("--checkpoint-dir"), "{}", stderr(&out));
    let out = exercise1(&["--batch-size", "0", "--device", "cpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--batch-size must be at least 1"), "{}", stderr(&out));
    // float16 needs a GPU: said before any data is read (this data directory does not exist).
    let out = exercise1(&["--precision", "16-mixed", "--device", "cpu", "--data-dir", "/nonexistent"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--precision 16-mixed needs a GPU"), "{}", stderr(&out));
    let out = exercise1(&["--precision", "fp8"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("32, 16-mixed, bf16-mixed"), "{}", stderr(&out));
    // CUDA graphs record GPU work: on the CPU, one line before any data is read.
    let out = exercise1(&["--cuda-graph", "--device", "cpu", "--data-dir", "/nonexistent"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--cuda-graph records GPU work"), "{}", stderr(&out));
}

/// `--device both --cuda-graph` on a machine without a GPU: the CPU run trains as usual (the
/// graph is for the GPU's), the GPU column says it is missing.
#[test]
fn a_cuda_graph_leaves_the_cpu_half_of_the_comparison_alone() {
    if tch::Cuda::is_available() {
        println!("a GPU is here: this test is about machines without one");
        return;
    }
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 20);
    let results = tempfile::tempdir().unwrap();
    let out = exercise1(&[
        "--cuda-graph",
        "--model",
        "cnn",
        "--epochs",
        "1",
        "--max-steps",
        "2",
        "--batch-size",
        "10",
        "--data-dir",
        data.path().to_str().unwrap(),
        "--results-dir",
        results.path().to_str().unwrap(),
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("GPU column missing"));
}

#[test]
fn a_corrupt_checkpoint_stops_the_resume_with_its_name() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 20);
    let ck = tempfile::tempdir().unwrap();
    std::fs::write(ck.path().join("exercise1-cnn-cpu.safetensors"), b"garbage").unwrap();
    let out = exercise1(&[
        "--data-dir",
        data.path().to_str().unwrap(),
        "--device",
        "cpu",
        "--epochs",
        "1",
        "--batch-size",
        "10",
        "--checkpoint-dir",
        ck.path().to_str().unwrap(),
        "--resume",
        "--quiet",
        "--results-dir",
        ck.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("exercise1-cnn-cpu.safetensors") && err.contains("corrupt"), "{err}");
}

#[test]
fn weights_that_do_not_fit_are_listed() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path(), 20);
    let weights = data.path().join("wrong.safetensors");
    let tensors = [("conv1.weight", tch::Tensor::zeros([3, 3], (tch::Kind::Float, tch::Device::Cpu)))];
    tch::Tensor::write_safetensors(&tensors, &weights).unwrap();
    let out = exercise1(&[
        "--data-dir",
        data.path().to_str().unwrap(),
        "--device",
        "cpu",
        "--max-steps",
        "1",
        "--batch-size",
        "10",
        "--weights",
        weights.to_str().unwrap(),
        "--quiet",
        "--results-dir",
        data.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("wrong.safetensors") && err.contains("conv1.weight") && err.contains("fc2.weight"), "{err}");
}

#[test]
fn channels_last_runs_and_its_checkpoint_resumes_in_the_usual_layout() {
    let d = tempfile::tempdir().unwrap();
    generated_cifar(d.path(), 20);
    let (results, checkpoints) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--device",
            "cpu",
            "--data-dir",
            d.path().to_str().unwrap(),
            "--batch-size",
            "10",
            "--quiet",
            "--results-dir",
            results.path().to_str().unwrap(),
            "--checkpoint-dir",
            checkpoints.path().to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = exercise1(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        read_json(&results.path().join("exercise1-cnn-cpu.json"))
    };
    let first = run(&["--channels-last", "--epochs", "1"]);
    assert_eq!(first["memory_format"], "channels-last");
    assert!(first["steady_throughput"].as_f64().is_none(), "2 steps are all warm-up: {}", first["steady_throughput"]);
    // The checkpoint holds the weights in the usual order: the next epoch resumes without the flag.
    let second = run(&["--resume", "--epochs", "2", "--steady-after", "0"]);
    assert_eq!((second["memory_format"].as_str(), second["resumed_epochs"].as_u64()), (Some("nchw"), Some(1)));
    assert!(second["steady_throughput"].as_f64().is_some_and(|t| t > 0.0), "{}", second["steady_throughput"]);
}

#[test]
fn matmul_precision_reaches_libtorch_and_the_results() {
    let d = tempfile::tempdir().unwrap();
    generated_cifar(d.path(), 20);
    let results = tempfile::tempdir().unwrap();
    let out = exercise1(&[
        "--device",
        "cpu",
        "--data-dir",
        d.path().to_str().unwrap(),
        "--batch-size",
        "10",
        "--max-steps",
        "1",
        "--quiet",
        "--matmul-precision",
        "high",
        "--results-dir",
        results.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("--matmul-precision high") && stdout.contains("LibTorch's setting: high"), "{stdout}");
    let json = read_json(&results.path().join("exercise1-cnn-cpu.json"));
    assert_eq!(json["matmul_precision"], "high");
    let out = exercise1(&["--matmul-precision", "fastest"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("highest, high, medium"), "{}", stderr(&out));
}

/// Each binary's help starts with its own purpose (not the crate's description) and groups its
/// flags under headings a participant scans for.
#[test]
fn help_names_each_binarys_purpose_and_groups_the_flags() {
    let purposes = [
        (env!("CARGO_BIN_EXE_exercise1"), "Exercise 1: CPU vs GPU training of an image classifier"),
        (env!("CARGO_BIN_EXE_exercise1_nlp"), "Exercise 1 (NLP): CPU vs GPU training of a Transformer language model"),
        (env!("CARGO_BIN_EXE_exercise2"), "Exercise 2: data-parallel ResNet34"),
    ];
    for (binary, purpose) in purposes {
        let out = std::process::Command::new(binary).arg("--help").output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(help.starts_with(purpose), "{binary}: {}", help.lines().next().unwrap_or_default());
        assert!(!help.contains("thin binaries over"), "{binary}");
        for heading in ["Data:", "Model:", "Training:", "Precision and speed:", "Parallelism:", "Checkpoints:", "Output:"] {
            assert!(help.lines().any(|l| l == heading), "{binary}: no {heading} heading");
        }
        // --resume sits under Checkpoints, --lr under Training.
        let section = |flag: &str| {
            help.lines().take_while(|l| !l.trim_start().starts_with(flag)).filter(|l| l.ends_with(':') && !l.starts_with(' ')).last().map(str::to_string)
        };
        assert_eq!(section("--resume").as_deref(), Some("Checkpoints:"), "{binary}");
        assert_eq!(section("--lr ").as_deref(), Some("Training:"), "{binary}");
    }
}

/// `--config FILE` as a participant uses it: the file's flags, the command line over them,
/// `--print-config` giving back a file that repeats the run, and a wrong key one line, exit 2.
#[test]
fn a_config_file_gives_the_flags_and_the_command_line_overrides_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("run.toml");
    std::fs::write(&config, "model = \"cnn\"\nepochs = 3\nbatch_size = 16\nlr = 0.01\naugment = true\n").unwrap();
    let printed = exercise1(&["--config", config.to_str().unwrap(), "--lr", "0.002", "--print-config"]);
    assert!(printed.status.success(), "{}", stderr(&printed));
    let text = String::from_utf8_lossy(&printed.stdout);
    for line in ["model = \"cnn\"", "epochs = 3", "batch-size = 16", "lr = 0.002", "augment = true"] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    assert_eq!(text.lines().count(), 5, "only what was given: {text}");
    // The printed file repeats the run: read back, it resolves to itself.
    let again = dir.path().join("again.toml");
    std::fs::write(&again, text.as_bytes()).unwrap();
    let twice = exercise1(&["--config", again.to_str().unwrap(), "--print-config"]);
    assert_eq!(String::from_utf8_lossy(&twice.stdout), text);

    std::fs::write(&config, "learning_rate = 0.1\n").unwrap();
    let out = exercise1(&["--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("unknown key `learning_rate`"), "{err}");
    std::fs::write(&config, "epochs = \"three\"\n").unwrap();
    let out = exercise1(&["--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("key `epochs`") && stderr(&out).lines().count() == 1, "{}", stderr(&out));
}

/// Every run keeps the flags it was given beside its results (`<run>.config.toml`): the config
/// file's and the command line's together, defaults left out. Given back as `--config`, it
/// repeats the run: the same losses, seeded as it was.
#[test]
fn a_run_keeps_its_flags_and_they_repeat_it() {
    let (data, results, again) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    generated_cifar(data.path(), 64);
    let config = data.path().join("run.toml");
    std::fs::write(&config, "batch_size = 16\nlr = 0.01\n").unwrap();
    let data_dir = data.path().to_str().unwrap();
    let flags = ["--config", config.to_str().unwrap(), "--lr", "0.002", "--device", "cpu", "--max-steps", "3", "--data-dir", data_dir];
    let first = exercise1(&[&flags[..], &["--results-dir", results.path().to_str().unwrap()]].concat());
    assert!(first.status.success(), "{}", stderr(&first));
    let kept = results.path().join("exercise1-cnn-cpu.config.toml");
    assert!(String::from_utf8_lossy(&first.stdout).contains(&format!("wrote {}", kept.display())), "{}", String::from_utf8_lossy(&first.stdout));
    let text = std::fs::read_to_string(&kept).unwrap();
    assert!(text.starts_with("# The flags of this run: `exercise1 --config FILE` repeats it"), "{text}");
    for line in ["batch-size = 16", "lr = 0.002", "max-steps = 3", "device = \"cpu\""] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    // Repeated from the kept file alone, into another folder.
    let repeat = exercise1(&["--config", kept.to_str().unwrap(), "--results-dir", again.path().to_str().unwrap()]);
    assert!(repeat.status.success(), "{}", stderr(&repeat));
    let losses = |dir: &Path| {
        let json = read_json(&dir.join("exercise1-cnn-cpu.json"));
        (json["steps"].as_u64(), json["batch_size"].as_u64(), json["lr"].as_f64(), json["test_loss"].as_f64())
    };
    let straight = losses(results.path());
    assert_eq!((straight.0, straight.1, straight.2), (Some(3), Some(16), Some(0.002)));
    assert_eq!(losses(again.path()), straight, "the kept flags repeat the run");
}
