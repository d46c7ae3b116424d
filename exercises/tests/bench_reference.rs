//! `make bench` compares exercise1 with `bench/exercise1_reference.py`; that comparison only
//! means something if both train the same network. This checks, for each model, that the
//! reference (its `--describe`, which needs no data, and takes torchvision's models where
//! torchvision is installed and its own copies of them otherwise) has the parameter
//! count exercise1 reports in its results JSON, with exercise1's default head, and the same
//! `state_dict` names and shapes as our var store (torchvision's layout).
//!
//! Then the peers (bench/peers.py): each one that exists on the CPU trains there at a tiny size,
//! reports its JSON and a finite loss; the CUDA-graph peers refuse the CPU in one line (exit 2);
//! the fused optimizer's losses track the default one's; the Lightning peer does not probe for
//! MPI; and `make bench`'s harness runs them all side by side, picks the fastest peer by its
//! median and pairs its rounds (bench_report.py on made-up runs). Nothing here depends on
//! how fast the machine is.
//!
//! The scripts run under `$TORCH_PYTHON`, which `scripts/with-torch` sets.
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::{read_json, stderr};
use tch::nn;

fn bench_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench").join(name)
}

fn python() -> PathBuf {
    std::env::var_os("TORCH_PYTHON").map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "TORCH_PYTHON is not set, so bench/exercise1_reference.py cannot run; run the tests through \
             scripts/with-torch (e.g. `scripts/with-torch cargo test --release -p exercises --test bench_reference`)"
        )
    })
}

/// The reference's `--describe` JSON for `model` (its default head).
fn describe(model: &str) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/exercise1_reference.py");
    let out = Command::new(python()).arg(&script).args(["--model", model, "--describe"]).output().expect("the reference runs");
    assert!(out.status.success(), "{} --describe failed: {}", script.display(), stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().expect("one JSON line")).unwrap()
}

fn generated_cifar(dir: &Path) {
    generated_cifar_of(dir, 10);
}

fn generated_cifar_of(dir: &Path, train: usize) {
    let status = Command::new(env!("CARGO_BIN_EXE_prepare_data"))
        .args(["generate", "--dataset", "cifar10", "--train", &train.to_string(), "--test", "2", "--out"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

/// exercise1's parameter count for `model` with its default head (one tiny step).
fn exercise1_params(model: &str, data: &Path) -> i64 {
    let results = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_exercise1"))
        .args(["--model", model, "--device", "cpu", "--max-steps", "1", "--batch-size", "2", "--quiet", "--data-dir"])
        .arg(data)
        .arg("--results-dir")
        .arg(results.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    read_json(&results.path().join(format!("exercise1-{model}-cpu.json")))["params"].as_i64().unwrap()
}

fn arch(model: &str) -> common::models::Arch {
    use common::models::Arch;
    [Arch::Cnn, Arch::Resnet34, Arch::Resnet50, Arch::Vgg19].into_iter().find(|arch| arch.name() == model).unwrap_or_else(|| panic!("no model {model}"))
}

/// Our var store's names and shapes for `model` with exercise1's default head, and its
/// trainable parameter count.
fn var_store_layout(model: &str) -> (BTreeMap<String, Vec<i64>>, i64) {
    use common::models::{build, param_count, ModelSpec};
    let arch = arch(model);
    let spec = ModelSpec { arch, in_channels: 3, image_size: 32, num_classes: if model == "cnn" { 10 } else { 1000 } };
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _model = build(&vs.root(), &spec);
    (vs.variables().into_iter().map(|(k, v)| (k, v.size())).collect(), param_count(&vs))
}

#[test]
fn the_exercise1_reference_trains_the_same_models() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar(data.path());
    // The four models side by side: the check is then as long as VGG19's.
    std::thread::scope(|scope| {
        let checks: Vec<_> = ["cnn", "resnet34", "resnet50", "vgg19"]
            .into_iter()
            .map(|model| {
                let data = data.path();
                scope.spawn(move || {
                    let reference = describe(model);
                    let ours = exercise1_params(model, data);
                    assert_eq!(reference["params"].as_i64(), Some(ours), "{model}: reference vs exercise1 parameter count");
                    // Names and shapes: our var store against the reference's state_dict, which
                    // also holds batch norm's step counter (`num_batches_tracked`, kept inside
                    // the module by LibTorch).
                    let (layout, params) = var_store_layout(model);
                    assert_eq!(params, ours, "{model}: the spec here is exercise1's");
                    let theirs: BTreeMap<String, Vec<i64>> = reference["state_dict"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .filter(|(k, _)| !k.ends_with("num_batches_tracked"))
                        .map(|(k, v)| (k.clone(), v.as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect()))
                        .collect();
                    assert_eq!(layout, theirs, "{model}: var store vs the reference's state_dict (names and shapes)");
                })
            })
            .collect();
        for check in checks {
            if let Err(panic) = check.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

/// The ResNets compute what torchvision's code computes: our model's variables (batch-norm
/// statistics moved by a training pass) and a 64×64 batch, written under torchvision's names,
/// load into the reference's module without a missing or an unexpected key besides batch
/// norm's step counters, and its eval-mode logits are ours. This is what the names alone
/// cannot show: where each block strides (ResNet50's Bottleneck on its 3×3 convolution, "v1.5"),
/// the ReLUs, the residual sums and the pooling.
#[test]
fn the_reference_computes_the_same_resnet_logits_from_our_weights() {
    use common::models::{build, ModelSpec};
    use tch::{Device, Kind, Tensor};
    for model in ["resnet34", "resnet50"] {
        tch::manual_seed(5);
        let spec = ModelSpec { arch: arch(model), in_channels: 3, image_size: 64, num_classes: 1000 };
        let vs = nn::VarStore::new(Device::Cpu);
        let net = build(&vs.root(), &spec);
        let _ = tch::no_grad(|| net.forward_t(&Tensor::randn([4, 3, 64, 64], (Kind::Float, Device::Cpu)), true));
        let input = Tensor::randn([2, 3, 64, 64], (Kind::Float, Device::Cpu));
        let ours = tch::no_grad(|| net.forward_t(&input, false));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weights.safetensors");
        let mut tensors: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        tensors.push(("input".into(), input));
        Tensor::write_safetensors(&tensors, &path).unwrap();

        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../bench/exercise1_reference.py");
        let out = Command::new(python()).arg(&script).args(["--model", model, "--forward"]).arg(&path).output().unwrap();
        assert!(out.status.success(), "{model}: {}", stderr(&out));
        let reply: serde_json::Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
        let missing: Vec<&str> = reply["missing"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
        assert!(missing.iter().all(|k| k.ends_with("num_batches_tracked")), "{model}: missing from our weights: {missing:?}");
        assert_eq!(reply["unexpected"].as_array().unwrap().len(), 0, "{model}: not in the reference: {}", reply["unexpected"]);
        let theirs: Vec<f32> =
            reply["logits"].as_array().unwrap().iter().flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32)).collect();
        let theirs = Tensor::from_slice(&theirs).view([2, 1000]);
        let diff = ((&ours - &theirs).abs().max() / theirs.abs().max()).double_value(&[]);
        assert!(diff < 1e-4, "{model}: logits differ from the reference's by {diff:e} (relative to the largest)");
    }
}

/// Runs the bench script `name` with `args` under `$TORCH_PYTHON`.
fn run_script(name: &str, args: &[&str], envs: &[(&str, &str)]) -> std::process::Output {
    Command::new(python()).arg(bench_script(name)).args(args).envs(envs.iter().copied()).output().unwrap()
}

/// A peer's JSON (the last line of its standard output), after checking that it succeeded.
fn peer_json(what: &str, out: &std::process::Output) -> serde_json::Value {
    assert!(out.status.success(), "{what} failed: {}", stderr(out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_else(|| panic!("{what}: no output"))).unwrap()
}

fn losses(json: &serde_json::Value) -> Vec<f64> {
    json["step_losses"].as_array().expect("step_losses").iter().map(|x| x.as_f64().unwrap()).collect()
}

/// What every peer's JSON must say after `steps` steps of `examples` each: every step ran and
/// its loss is finite, the steady state was timed, and the per-phase split covers the steps.
fn assert_trained(what: &str, json: &serde_json::Value, steps: usize, examples: f64) {
    assert_eq!(json["steps"].as_u64(), Some(steps as u64), "{what}: {json}");
    assert_eq!(json["examples_per_step"].as_f64(), Some(examples), "{what}: {json}");
    let losses = losses(json);
    assert_eq!(losses.len(), steps, "{what}: {json}");
    assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0), "{what}: losses {losses:?}");
    assert_eq!(json["last_loss"].as_f64(), losses.last().copied(), "{what}");
    assert!(json["steady_throughput"].as_f64().is_some_and(|t| t > 0.0), "{what}: {json}");
    if json["impl"] == "pytorch" {
        assert_eq!(json["phase_clock"], "host", "{what}: the CPU's phases come from host clocks");
        for phase in ["data_wait_s", "forward_backward_s", "optimizer_s"] {
            assert!(json[phase].as_f64().is_some_and(|s| s > 0.0), "{what}: {phase} in {json}");
        }
        assert_eq!(json["graph_replay_s"].as_f64(), Some(0.0), "{what}: nothing is replayed on the CPU");
    }
}

/// The image peers that exist on the CPU (bench.sh's default there, and channels-last with the
/// fused optimizer) and the Lightning peer, each on the CNN for 4 steps of 8 images.
#[test]
fn every_image_peer_trains_on_the_cpu_and_reports_its_json() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar_of(data.path(), 64);
    let dir = data.path().to_str().unwrap();
    let common = ["--model", "cnn", "--data-dir", dir, "--max-steps", "4", "--batch-size", "8", "--steady-after", "1", "--threads", "1"];
    for flags in [&[][..], &["--fused"], &["--channels-last"], &["--channels-last", "--fused"], &["--precision", "bf16-mixed", "--fused"]] {
        let what = format!("exercise1_reference.py {flags:?}");
        let json = peer_json(&what, &run_script("exercise1_reference.py", &[&common[..], flags].concat(), &[]));
        assert_trained(&what, &json, 4, 8.0);
        let fused = flags.contains(&"--fused");
        assert_eq!(json["optimizer_impl"], if fused { "fused" } else { "default" }, "{what}");
        assert_eq!(json["channels_last"].as_bool(), Some(flags.contains(&"--channels-last")), "{what}");
        assert_eq!(json["precision"], if flags.contains(&"bf16-mixed") { "bf16-mixed" } else { "32" }, "{what}");
    }
    let json = peer_json("exercise1_lightning.py", &run_script("exercise1_lightning.py", &common, &[]));
    assert_trained("exercise1_lightning.py", &json, 4, 8.0);
    assert_eq!((json["impl"].as_str(), json["params"].as_i64()), (Some("lightning"), Some(191_935)), "{json}");
}

/// A WikiText-2 folder from the real sample, and the tiny Transformer's flags.
fn tiny_transformer(dir: &Path) -> Vec<String> {
    support::wikitext_sample(dir, [60, 10, 10]);
    ["--data-dir", dir.to_str().unwrap(), "--emsize", "16", "--d-hid", "16", "--nhead", "2", "--nlayers", "1", "--bptt", "8", "--batch-size", "4"]
        .into_iter()
        .map(String::from)
        .collect()
}

#[test]
fn every_transformer_peer_trains_on_the_cpu_and_reports_its_json() {
    let data = tempfile::tempdir().unwrap();
    let model = tiny_transformer(data.path());
    for flags in [&[][..], &["--fused"], &["--precision", "bf16-mixed"]] {
        let what = format!("exercise1_nlp_reference.py {flags:?}");
        let mut args: Vec<&str> = model.iter().map(String::as_str).collect();
        args.extend(["--max-steps", "4", "--steady-after", "1", "--threads", "1"]);
        args.extend(flags);
        let json = peer_json(&what, &run_script("exercise1_nlp_reference.py", &args, &[]));
        assert_trained(&what, &json, 4, 32.0);
        assert_eq!(json["optimizer_impl"], if flags.contains(&"--fused") { "fused" } else { "default" }, "{what}");
        assert_eq!((json["optimizer"].as_str(), json["clip"].as_f64()), (Some("sgd"), Some(0.5)), "{what}: exercise1_nlp's recipe");
    }
}

/// torch.compile's default mode on the CPU, both references (inductor compiles C++ here: the
/// slowest of these tests, a minute or two).
#[test]
fn the_compile_peers_train_on_the_cpu() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar_of(data.path(), 32);
    let dir = data.path().to_str().unwrap();
    let args = ["--model", "cnn", "--data-dir", dir, "--max-steps", "3", "--batch-size", "8", "--steady-after", "1", "--threads", "1", "--compile", "--fused"];
    let json = peer_json("exercise1_reference.py --compile", &run_script("exercise1_reference.py", &args, &[]));
    assert_trained("exercise1_reference.py --compile", &json, 3, 8.0);
    assert_eq!(json["compile"], "default");

    let text = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = tiny_transformer(text.path());
    args.extend(["--max-steps", "3", "--steady-after", "1", "--threads", "1", "--compile"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let json = peer_json("exercise1_nlp_reference.py --compile", &run_script("exercise1_nlp_reference.py", &args, &[]));
    assert_trained("exercise1_nlp_reference.py --compile", &json, 3, 32.0);
    assert_eq!(json["compile"], "default");
}

/// The one line a refused command printed, after checking that it exited with status 2.
fn refusal(what: &str, out: &std::process::Output) -> String {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{what}: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() == 1 && lines[0].starts_with("error: "), "{what}: one line of error expected, got:\n{err}");
    lines[0].to_string()
}

/// A CUDA-graph peer does not exist on the CPU: refused before any data is read, rather than run
/// as another peer under its name; and so in bench.sh, before anything runs.
#[test]
fn the_graph_peers_refuse_the_cpu_in_one_line_with_exit_2() {
    for script in ["exercise1_reference.py", "exercise1_nlp_reference.py"] {
        let line = refusal(script, &run_script(script, &["--device", "cpu", "--cuda-graph", "--data-dir", "/nonexistent"], &[]));
        assert!(line.contains("--cuda-graph") && line.contains("--device cuda"), "{line}");
        let line = refusal(script, &run_script(script, &["--device", "cpu", "--compile", "reduce-overhead", "--data-dir", "/nonexistent"], &[]));
        assert!(line.contains("reduce-overhead"), "{line}");
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    for (settings, expect) in
        [(&[("PEERS", "eager cuda-graph")][..], "cuda-graph"), (&[("CUDA_GRAPH", "1")], "CUDA_GRAPH=1"), (&[("PEERS", "tensorrt")], "tensorrt")]
    {
        let out = Command::new("bash")
            .arg(root.join("bench/bench.sh"))
            .envs([("DEVICE", "cpu"), ("BENCH", "cnn"), ("CIFAR_DIR", "/nonexistent")])
            .envs(settings.iter().copied())
            .env("TORCH_PYTHON", python())
            .output()
            .unwrap();
        let line = refusal(&format!("bench.sh {settings:?}"), &out);
        assert!(line.contains(expect), "{line}");
    }
}

/// `--fused` is the same Adam (and SGD) as the default implementation: the same losses step by
/// step, up to rounding, on the same data and weights. Another learning rate, by contrast,
/// moves the losses visibly within the same steps: the comparison sees the updates.
#[test]
fn the_fused_peer_tracks_the_default_peer_on_the_cpu() {
    fn close(a: &[f64], b: &[f64], tolerance: f64) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tolerance * x.abs())
    }
    let data = tempfile::tempdir().unwrap();
    generated_cifar_of(data.path(), 64);
    let dir = data.path().to_str().unwrap();
    let common = ["--model", "cnn", "--data-dir", dir, "--max-steps", "6", "--batch-size", "8", "--threads", "1"];
    let run = |extra: &[&str]| losses(&peer_json("exercise1_reference.py", &run_script("exercise1_reference.py", &[&common[..], extra].concat(), &[])));
    let (default, fused, other_lr) = (run(&[]), run(&["--fused"]), run(&["--lr", "0.01"]));
    assert_eq!(default[0], fused[0], "the first step's loss comes before any update");
    assert!(close(&default, &fused, 1e-4), "Adam: default {default:?} vs fused {fused:?}");
    assert!(!close(&default, &other_lr, 1e-3), "lr 1e-3 {default:?} vs 1e-2 {other_lr:?}: the losses should see the update");

    let text = tempfile::tempdir().unwrap();
    let model = tiny_transformer(text.path());
    let run = |extra: &[&str]| {
        let mut args: Vec<&str> = model.iter().map(String::as_str).collect();
        args.extend(["--max-steps", "6", "--threads", "1"]);
        args.extend(extra);
        losses(&peer_json("exercise1_nlp_reference.py", &run_script("exercise1_nlp_reference.py", &args, &[])))
    };
    let (default, fused, other_lr) = (run(&[]), run(&["--fused"]), run(&["--lr", "0.5"]));
    assert!(close(&default, &fused, 1e-4), "SGD: default {default:?} vs fused {fused:?}");
    assert!(!close(&default, &other_lr, 1e-3), "lr 5 {default:?} vs 0.5 {other_lr:?}: the losses should see the update");
}

/// On the GPU node the Trainer's cluster-environment probe imported mpi4py, and MPI aborted the
/// process outside a launcher. Here an mpi4py that aborts the same way when imported (and is
/// seen as installed) is on the path: the Lightning peer must train without importing it.
#[test]
fn the_lightning_peer_does_not_probe_for_mpi() {
    let fake = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(fake.path().join("mpi4py")).unwrap();
    std::fs::write(
        fake.path().join("mpi4py/__init__.py"),
        "import os, sys\nsys.stderr.write('fake mpi4py imported: Local abort before MPI_INIT completed\\n')\nos._exit(134)\n",
    )
    .unwrap();
    std::fs::create_dir_all(fake.path().join("mpi4py-4.0.0.dist-info")).unwrap();
    std::fs::write(fake.path().join("mpi4py-4.0.0.dist-info/METADATA"), "Metadata-Version: 2.1\nName: mpi4py\nVersion: 4.0.0\n").unwrap();
    let path = fake.path().to_str().unwrap();
    // The fake is what Lightning's probe would find: its MPI detection dies on it.
    let probe = Command::new(python())
        .args(["-c", "from pytorch_lightning.plugins.environments import MPIEnvironment; MPIEnvironment.detect()"])
        .env("PYTHONPATH", path)
        .output()
        .unwrap();
    assert!(!probe.status.success() && stderr(&probe).contains("fake mpi4py imported"), "the fake mpi4py is not seen: {}", stderr(&probe));

    let data = tempfile::tempdir().unwrap();
    generated_cifar_of(data.path(), 32);
    let args = ["--data-dir", data.path().to_str().unwrap(), "--max-steps", "3", "--batch-size", "8", "--steady-after", "1", "--threads", "1"];
    let json = peer_json("exercise1_lightning.py with mpi4py installed", &run_script("exercise1_lightning.py", &args, &[("PYTHONPATH", path)]));
    assert_trained("exercise1_lightning.py", &json, 3, 8.0);
}

/// The CSV rows (header and rows) of a bench CSV, as maps.
fn csv_rows(path: &Path) -> Vec<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines().map(|l| l.split(',').map(str::to_string).collect::<Vec<_>>());
    let header = lines.next().unwrap();
    lines.map(|row| header.iter().cloned().zip(row).collect()).collect()
}

/// bench_report.py on made-up runs: the fastest peer is the one with the highest median (not
/// the highest single round), among the peers of the row's kind that ran every round (a peer
/// that failed once is out, however fast), the ratio against it is the median of the rounds'
/// ratios (not the ratio of the medians), the warm-up round counts for nothing, and the phase
/// columns of the fastest peer are its own.
#[test]
fn the_report_picks_the_fastest_peer_by_its_median_and_pairs_its_rounds() {
    use serde_json::json;
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs.jsonl");
    let mut lines = Vec::new();
    let mut side = |name: &str, figures: &[f64], split: [f64; 3], replay: Option<f64>| {
        for (round, throughput) in figures.iter().enumerate() {
            lines.push(json!({"entry": "cnn", "impl": name, "round": round, "others": 0.0, "throughput": throughput, "steady": true,
                              "examples_per_step": 100.0, "steps": 10, "params": 191935, "data_wait_s": split[0],
                              "forward_backward_s": split[1], "optimizer_s": split[2], "graph_replay_s": replay,
                              "phase_clock": "host", "loader": "memory"}));
        }
    };
    // Round 0 (the warm-up) first in each list, out of all proportion: it must not count.
    side("rust", &[9000.0, 150.0, 160.0, 300.0], [0.01, 0.2, 0.03], None);
    side("eager", &[9000.0, 100.0, 100.0, 100.0], [0.02, 0.4, 0.06], None);
    side("fused", &[1.0, 100.0, 200.0, 150.0], [0.03, 0.5, 0.07], None);
    side("channels-last", &[1.0, 400.0, 90.0, 90.0], [0.04, 0.6, 0.08], None);
    side("compile", &[1.0, 1000.0], [0.05, 0.7, 0.09], None);
    side("cuda-graph", &[1.0, 500.0, 500.0, 500.0], [0.06, 0.0, 0.0], Some(0.3));
    side("rust-graph", &[1.0, 600.0, 450.0, 550.0], [0.07, 0.0, 0.0], None);
    lines.push(json!({"entry": "cnn", "impl": "compile", "round": 2, "others": 0.0, "failed": true, "error": "inductor: no compiler"}));
    std::fs::write(&runs, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();

    let csv = dir.path().join("bench.csv");
    let out = Command::new(python())
        .arg(bench_script("bench_report.py"))
        .args(["table", "--runs", runs.to_str().unwrap(), "--csv", csv.to_str().unwrap(), "--steady-after", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let rows = csv_rows(&csv);
    assert_eq!(rows.iter().map(|r| r["rust_mode"].as_str()).collect::<Vec<_>>(), ["eager", "cuda-graph"]);
    let (eager, graph) = (&rows[0], &rows[1]);
    let cells = |row: &BTreeMap<String, String>, keys: &[&str]| keys.iter().map(|k| row[*k].clone()).collect::<Vec<_>>();
    // fused: median 150 (channels-last peaks at 400 but has median 90; compile failed; cuda-graph is the other kind).
    assert_eq!(cells(eager, &["fastest_peer", "fastest_peer_throughput", "fastest_peer_min", "fastest_peer_max"]), ["fused", "150.00", "100.00", "200.00"]);
    // Rounds 150/100, 160/200, 300/150: median 1.5 (the medians' ratio would be 160/150).
    assert_eq!(eager["ratio_fastest"], "1.5000");
    assert_eq!(cells(eager, &["rust_throughput", "rust_min", "rust_max"]), ["160.00", "150.00", "300.00"]);
    assert_eq!(cells(eager, &["pytorch_throughput", "ratio", "ratio_rounds_median"]), ["100.00", "1.6000", "1.6000"]);
    assert_eq!(cells(eager, &["pytorch_channels_last_throughput", "pytorch_channels_last_max", "ratio_channels_last"]), ["90.00", "400.00", "1.7778"]);
    assert_eq!((eager["peers"].as_str(), eager["peers_failed"].as_str()), ("eager fused channels-last cuda-graph", "compile"));
    assert!(eager["pytorch_compile_throughput"].is_empty(), "a failed peer leaves its columns empty");
    // Per step (10 steps): the fastest peer's own split, ours, the eager peer's.
    assert_eq!(cells(eager, &["fastest_peer_data_ms", "fastest_peer_fwd_bwd_ms", "fastest_peer_optim_ms"]), ["3.00", "50.00", "7.00"]);
    assert_eq!(cells(eager, &["rust_data_ms", "rust_fwd_bwd_ms", "rust_optim_ms"]), ["1.00", "20.00", "3.00"]);
    assert_eq!(cells(eager, &["pytorch_data_ms", "pytorch_fwd_bwd_ms", "pytorch_optim_ms"]), ["2.00", "40.00", "6.00"]);
    // Graph against graph: 600/500, 450/500, 550/500, median 1.1; the replay in its own column.
    assert_eq!(cells(graph, &["fastest_peer", "ratio_fastest", "rust_throughput", "fastest_peer_replay_ms"]), ["cuda-graph", "1.1000", "550.00", "30.00"]);
    assert_eq!(graph["ratio_rounds_median"], "5.5000", "ours --cuda-graph against the eager default peer, as the column always was");
}

/// `make bench`'s harness itself, on the CPU with the CNN: an untimed warm-up run per side, then
/// two rounds with the order rotated, timed in the steady state (after --steady-after steps, on
/// every side), the CPU's default peers, and a CSV row that says how it measured and against
/// which peer.
#[test]
fn the_bench_harness_times_every_side_in_rotated_rounds_and_reports_the_fastest_peer() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar_of(data.path(), 500); // 5 batches of 100: the 5 steps in one epoch
    let out_dir = tempfile::tempdir().unwrap();
    let csv = out_dir.path().join("bench.csv");
    let out = bench(&[("BENCH", "cnn"), ("ROUNDS", "2"), ("CNN_STEPS", "5")], data.path(), &csv);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench.sh failed:\n{stdout}\n{}", stderr(&out));
    assert_eq!(order(&stdout, "exercise1 cnn warm-up (5 steps"), ["rust", "eager", "fused", "channels-last"], "{stdout}");
    assert_eq!(order(&stdout, "exercise1 cnn round 1/2 (5 steps"), ["rust", "eager", "fused", "channels-last"], "{stdout}");
    assert_eq!(order(&stdout, "exercise1 cnn round 2/2 (5 steps"), ["eager", "fused", "channels-last", "rust"], "rotated by one: {stdout}");
    let rows = csv_rows(&csv);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let row = &rows[0];
    assert_eq!(row["throughput_measure"], "steady state after 2 steps", "{row:?}");
    assert_eq!((row["rounds"].as_str(), row["steps"].as_str(), row["precision"].as_str(), row["rust_mode"].as_str()), ("2", "5", "32", "eager"), "{row:?}");
    assert_eq!(row["peers"], "eager fused channels-last", "the CPU's default peers");
    assert!(["eager", "fused", "channels-last"].contains(&row["fastest_peer"].as_str()), "{row:?}");
    let stem = match row["fastest_peer"].as_str() {
        "eager" => "pytorch".to_string(),
        peer => format!("pytorch_{}", peer.replace('-', "_")),
    };
    assert_eq!(row["fastest_peer_throughput"], row[&format!("{stem}_throughput")], "{row:?}");
    for column in [
        "rust_throughput",
        "pytorch_throughput",
        "pytorch_fused_throughput",
        "pytorch_channels_last_throughput",
        "ratio",
        "ratio_fastest",
        "rust_fwd_bwd_ms",
        "fastest_peer_fwd_bwd_ms",
    ] {
        let value: f64 = row[column].parse().unwrap_or_else(|_| panic!("{column}: {:?}", row[column]));
        assert!(value > 0.0, "{column} = {value}");
    }
    for column in ["pytorch_compile_throughput", "pytorch_cuda_graph_throughput", "peers_failed"] {
        assert!(row[column].is_empty(), "{column} = {:?}: not run on the CPU by default", row[column]);
    }
}

/// A peer that fails is left out of its entry with the end of its stderr shown, the other sides
/// go on and the row is written, and the bench's exit status says a peer failed. torch.compile is
/// made to fail here by a C++ compiler that fails (and a fresh inductor cache, so that it must compile).
#[test]
fn a_failed_peer_is_shown_left_out_and_the_rest_reported() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar_of(data.path(), 500);
    let cache = tempfile::tempdir().unwrap();
    let csv = cache.path().join("bench.csv");
    let out = bench(
        &[
            ("BENCH", "cnn"),
            ("ROUNDS", "1"),
            ("CNN_STEPS", "4"),
            ("PEERS", "compile"),
            ("CXX", "/bin/false"),
            ("TORCHINDUCTOR_FX_GRAPH_CACHE", "0"),
            ("TORCHINDUCTOR_CACHE_DIR", cache.path().to_str().unwrap()),
        ],
        data.path(),
        &csv,
    );
    let (stdout, err) = (String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{err}");
    assert!(err.contains("compile (cnn, warm-up) failed with exit status 1; the last 20 lines of its stderr:"), "{err}");
    assert!(err.lines().last().unwrap().contains("peers failed") && err.contains("cnn:compile"), "{err}");
    assert!(stdout.contains("compile FAILED"), "{stdout}");
    assert_eq!(order(&stdout, "exercise1 cnn round 1/1 (4 steps"), ["rust", "eager"], "failed in the warm-up, then left out: {stdout}");
    let rows = csv_rows(&csv);
    assert_eq!((rows[0]["peers"].as_str(), rows[0]["peers_failed"].as_str()), ("eager", "compile"), "{rows:?}");
    assert_eq!(rows[0]["fastest_peer"], "eager");
}

/// The sides of bench.sh's progress line that starts with `label`, in the order they ran.
fn order(stdout: &str, label: &str) -> Vec<String> {
    let line = stdout.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no '{label}' line in:\n{stdout}"));
    let (_, sides) = line.split_once("): ").unwrap();
    sides.split(", ").map(|side| side.split(' ').next().unwrap().to_string()).collect()
}

/// bench.sh on the CPU, one thread, with the CIFAR-10 stand-in in `data`, the rows going to `csv`.
fn bench(settings: &[(&str, &str)], data: &Path, csv: &Path) -> std::process::Output {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_exercise1")).parent().unwrap().to_path_buf();
    Command::new("bash")
        .arg(root.join("bench/bench.sh"))
        .envs([("THREADS", "1"), ("MIN_SECONDS", "0"), ("STEADY_AFTER", "2"), ("DEVICE", "cpu")])
        .envs(settings.iter().copied())
        .env("TORCH_PYTHON", python())
        .env("CIFAR_DIR", data)
        .env("BENCH_CSV", csv)
        .env("BIN", &bin)
        .output()
        .unwrap()
}
