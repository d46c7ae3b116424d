//! Checkpoints: round trip, refusal of foreign or corrupt files, and atomic writes under SIGKILL.
use common::checkpoint::{self, CheckpointMeta, FORMAT_VERSION};
use common::models::{self, Arch, ModelSpec};
use common::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use std::path::Path;
use std::time::{Duration, Instant};
use tch::{nn, Device, Kind, Tensor};

const CNN: ModelSpec = ModelSpec { arch: Arch::Cnn, in_channels: 3, image_size: 32, num_classes: 10 };

fn meta(model: &ModelSpec, epoch: usize) -> CheckpointMeta {
    CheckpointMeta {
        format: FORMAT_VERSION,
        run: "test".into(),
        model: serde_json::to_value(model).unwrap(),
        optimizer: "adam".into(),
        epoch,
        step: epoch * 10,
        epoch_step: 0,
        seed: 5,
        config: serde_json::json!({"lr": 1e-3}),
        torch_version: common::torch_version().into(),
        grad_scaler: None,
        data: serde_json::Value::Null,
        examples_per_step: 0,
    }
}

/// A model and an Adam optimizer that has taken one step (so it has state).
fn trained(spec: &ModelSpec, seed: i64) -> (nn::VarStore, Box<dyn nn::ModuleT>, Adam) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = models::build(&vs.root(), spec);
    let mut adam = Adam::new(models::named_parameters(&vs), AdamConfig::default());
    let x = Tensor::randn([4, spec.in_channels, spec.image_size, spec.image_size], (Kind::Float, Device::Cpu));
    let loss = model.forward_t(&x, true).mean(Kind::Float);
    adam.zero_grad();
    loss.backward();
    adam.step().unwrap();
    (vs, model, adam)
}

fn assert_same_variables(a: &nn::VarStore, b: &nn::VarStore) {
    let b_vars = b.variables();
    for (name, t) in a.variables() {
        assert!(t.equal(&b_vars[&name]), "{name} differs");
    }
}

#[test]
fn round_trip_restores_model_and_optimizer_state() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::path_for(dir.path(), "test");
    let (vs, _, adam) = trained(&CNN, 1);
    checkpoint::save(&path, &vs, &adam, &meta(&CNN, 3)).unwrap();

    let loaded = checkpoint::load(&path).unwrap();
    assert_eq!(loaded.meta, meta(&CNN, 3));
    let (vs2, _, _) = trained(&CNN, 2);
    let mut fresh = Adam::new(models::named_parameters(&vs2), AdamConfig::default());
    loaded.restore(&path, &vs2, &mut fresh, &serde_json::to_value(&CNN).unwrap()).unwrap();
    assert_same_variables(&vs, &vs2);
    let saved_state: std::collections::HashMap<_, _> = adam.state_tensors().into_iter().collect();
    let restored = fresh.state_tensors();
    assert_eq!(restored.len(), saved_state.len());
    assert!(!restored.is_empty());
    for (name, t) in restored {
        assert!(t.equal(&saved_state[&name]), "optimizer state {name} differs");
    }
    // No temporary file is left behind.
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files, vec![std::ffi::OsString::from("test.safetensors")]);
}

#[test]
fn batch_norm_statistics_are_saved_with_the_model() {
    let spec = ModelSpec { arch: Arch::Resnet34, in_channels: 3, image_size: 32, num_classes: 10 };
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::path_for(dir.path(), "resnet");
    let (vs, _, adam) = trained(&spec, 1);
    checkpoint::save(&path, &vs, &adam, &meta(&spec, 1)).unwrap();
    let loaded = checkpoint::load(&path).unwrap();
    let mean = &loaded.tensors["model.layer1.0.bn1.running_mean"];
    assert!(mean.abs().sum(Kind::Float).double_value(&[]) > 0.0, "running statistics moved in training and were saved");
    assert!(mean.equal(&vs.variables()["layer1.0.bn1.running_mean"]));
}

#[test]
fn a_checkpoint_of_another_model_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::path_for(dir.path(), "test");
    let (vs, _, adam) = trained(&CNN, 1);
    checkpoint::save(&path, &vs, &adam, &meta(&CNN, 1)).unwrap();
    let loaded = checkpoint::load(&path).unwrap();

    let other = ModelSpec { num_classes: 100, ..CNN };
    let (vs2, _, _) = trained(&other, 1);
    let mut adam2 = Adam::new(models::named_parameters(&vs2), AdamConfig::default());
    let err = format!("{:#}", loaded.restore(&path, &vs2, &mut adam2, &serde_json::to_value(&other).unwrap()).unwrap_err());
    assert!(err.contains("was written for model") && err.contains("\"num_classes\":10"), "{err}");

    // Same declared identity, different shapes (a hand-edited or buggy file): shapes are checked too.
    let err = format!("{:#}", loaded.restore(&path, &vs2, &mut adam2, &serde_json::to_value(&CNN).unwrap()).unwrap_err());
    assert!(err.contains("fc2.weight: checkpoint [10, 50] vs model [100, 50]"), "{err}");

    // An SGD state where Adam's is expected.
    let mut sgd = Sgd::new(models::named_parameters(&vs), SgdConfig { momentum: 0.9, ..SgdConfig::default() });
    let err = format!("{:#}", loaded.restore(&path, &vs, &mut sgd, &serde_json::to_value(&CNN).unwrap()).unwrap_err());
    assert!(err.contains("optimizer state does not fit"), "{err}");
}

#[test]
fn corrupt_and_truncated_files_are_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"this is not a checkpoint at all").unwrap();
    let err = format!("{:#}", checkpoint::load(&garbage).err().unwrap());
    assert!(err.contains("garbage.safetensors") && err.contains("corrupt"), "{err}");

    let path = checkpoint::path_for(dir.path(), "test");
    let (vs, _, adam) = trained(&CNN, 1);
    checkpoint::save(&path, &vs, &adam, &meta(&CNN, 1)).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let err = format!("{:#}", checkpoint::load(&path).err().unwrap());
    assert!(err.contains("test.safetensors") && err.contains("corrupt"), "{err}");

    let err = format!("{:#}", checkpoint::load(&dir.path().join("absent.safetensors")).err().unwrap());
    assert!(err.contains("absent.safetensors"), "{err}");
}

const CHILD_ENV: &str = "CHECKPOINT_WRITER_CHILD_DIR";
const BIG: i64 = 16 << 20; // 64 MB of f32: a write takes long enough to be interrupted

/// The child: writes checkpoints of generation 1, 2, 3, … forever, every tensor filled with
/// its generation number, until it is killed.
fn write_forever(dir: &Path) -> ! {
    let vs = nn::VarStore::new(Device::Cpu);
    let mut big = vs.root().zeros("big", &[BIG]);
    let mut small = vs.root().zeros("small", &[7, 3]);
    let sgd = Sgd::new(vec![], SgdConfig::default());
    let path = checkpoint::path_for(dir, "killed");
    for generation in 1.. {
        tch::no_grad(|| {
            let _ = big.fill_(generation as f64);
            let _ = small.fill_(generation as f64);
        });
        checkpoint::save(&path, &vs, &sgd, &meta(&CNN, generation)).unwrap();
    }
    unreachable!()
}

#[test]
fn a_writer_killed_at_any_moment_leaves_a_complete_checkpoint() {
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        write_forever(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint::path_for(dir.path(), "killed");
    let mut last_generation = 0;
    for round in 0..6u64 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "a_writer_killed_at_any_moment_leaves_a_complete_checkpoint", "--nocapture"])
            .env(CHILD_ENV, dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait for the child to produce a checkpoint newer than the last round's, then kill it
        // at a different moment of its write cycle each round.
        let start = Instant::now();
        loop {
            let generation = checkpoint::load(&path).map(|c| c.meta.epoch).unwrap_or(0);
            if generation > last_generation || start.elapsed() > Duration::from_secs(60) {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(20 + 37 * round));
        child.kill().unwrap(); // SIGKILL: no destructor, no flush
        child.wait().unwrap();

        let loaded = checkpoint::load(&path).unwrap_or_else(|e| panic!("round {round}: torn checkpoint: {e:#}"));
        let generation = loaded.meta.epoch;
        assert!(generation > last_generation, "round {round}: the child made progress");
        for name in ["model.big", "model.small"] {
            let t = &loaded.tensors[name];
            assert_eq!(t.min().double_value(&[]), generation as f64, "{name} of generation {generation}");
            assert_eq!(t.max().double_value(&[]), generation as f64, "{name} of generation {generation}");
        }
        assert_eq!(loaded.tensors["model.big"].numel() as i64, BIG);
        last_generation = generation;
    }
}
