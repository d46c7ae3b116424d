//! `make bench` compares exercise1 with `bench/exercise1_reference.py`; that comparison only
//! means something if both train the same network. This checks, for each model, that the
//! reference (its `--describe`, which needs no data, and takes torchvision's models where
//! torchvision is installed and its own copies of them otherwise) has the parameter
//! count exercise1 reports in its results JSON, with exercise1's default head, and the same
//! `state_dict` names and shapes as our var store (torchvision's layout).
//!
//! The reference runs under `$TORCH_PYTHON`, which `scripts/with-torch` sets.
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::{read_json, stderr};
use tch::nn;

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

/// `make bench`'s harness itself, on the CPU with the CNN: an untimed warm-up run per side, then
/// A B rounds timed in the steady state (after --steady-after steps, on both sides), the
/// channels-last peer, and a CSV row that says how it measured.
#[test]
fn the_bench_harness_times_the_steady_state_of_both_sides_and_their_peers() {
    let data = tempfile::tempdir().unwrap();
    generated_cifar_of(data.path(), 500); // 5 batches of 100: the 5 steps in one epoch
    let out_dir = tempfile::tempdir().unwrap();
    let csv = out_dir.path().join("bench.csv");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_exercise1")).parent().unwrap().to_path_buf();
    let out = Command::new("bash")
        .arg(root.join("bench/bench.sh"))
        .envs([("BENCH", "cnn"), ("ROUNDS", "1"), ("CNN_STEPS", "5"), ("THREADS", "1"), ("MIN_SECONDS", "0"), ("STEADY_AFTER", "2")])
        .env("TORCH_PYTHON", python())
        .env("CIFAR_DIR", data.path())
        .env("BENCH_CSV", &csv)
        .env("BIN", &bin)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench.sh failed:\n{stdout}\n{}", stderr(&out));
    assert!(stdout.contains("exercise1 cnn warm-up (5 steps)") && stdout.contains("round 1/1 (5 steps)"), "{stdout}");
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut rows = text.lines().map(|l| l.split(',').map(str::to_string).collect::<Vec<_>>());
    let header = rows.next().unwrap();
    let row: BTreeMap<String, String> = header.into_iter().zip(rows.next().expect("one row")).collect();
    assert_eq!(row["throughput_measure"], "steady state after 2 steps", "{row:?}");
    assert_eq!((row["rounds"].as_str(), row["steps"].as_str(), row["precision"].as_str()), ("1", "5", "32"), "{row:?}");
    for column in ["rust_throughput", "pytorch_throughput", "pytorch_channels_last_throughput", "ratio", "ratio_channels_last"] {
        let value: f64 = row[column].parse().unwrap_or_else(|_| panic!("{column}: {:?}", row[column]));
        assert!(value > 0.0, "{column} = {value}");
    }
    assert!(row["pytorch_compile_throughput"].is_empty(), "torch.compile only with COMPILE=1");
}
