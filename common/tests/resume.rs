//! Resuming is exact: 2 epochs straight equal 1 epoch, a checkpoint, a fresh process state, and
//! 1 more epoch — for a model with dropout (LibTorch randomness), one with batch norm
//! (buffers), augmentation (loader randomness) and both optimizers.
use common::data::generate::{self, GenerateConfig};
use common::data::{self, DatasetKind, Loader, LoaderConfig, Split};
use common::models::{self, Arch, ModelSpec};
use common::optim::{Adam, AdamConfig, Optimizer, OptimizerKind, Sgd, SgdConfig};
use common::parallel::{LocalStep, Parallel};
use common::train::{self, CheckpointConfig, LrSchedule, Observers, ScheduleKind, TrainConfig};
use std::path::Path;
use std::sync::Mutex;
use tch::{nn, Device};

/// LibTorch's random generator is global to the process: runs in parallel test threads would
/// draw from each other's stream.
static SERIAL: Mutex<()> = Mutex::new(());

/// A small network with dropout, so that resuming must also restore the dropout stream.
fn dropout_mlp(root: &nn::Path) -> Box<dyn nn::ModuleT> {
    Box::new(
        nn::seq_t()
            .add_fn(|x| x.flatten(1, -1))
            .add(nn::linear(root / "fc1", 3 * 32 * 32, 32, Default::default()))
            .add_fn(|x| x.relu())
            .add_fn_t(|x, train| x.dropout(0.5, train))
            .add(nn::linear(root / "fc2", 32, 10, Default::default())),
    )
}

struct Setup<'a> {
    data: &'a Path,
    arch: Option<Arch>,
    optimizer: OptimizerKind,
    checkpoint_dir: &'a Path,
}

/// Trains up to `epochs` epochs in a fresh model (initialised from `init_seed`), resuming from
/// the checkpoint when there is one, and returns the final variables.
fn train(setup: &Setup, epochs: usize, init_seed: i64) -> Vec<(String, tch::Tensor)> {
    let spec = ModelSpec { arch: setup.arch.unwrap_or(Arch::Cnn), in_channels: 3, image_size: 32, num_classes: 10 };
    tch::manual_seed(init_seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = match setup.arch {
        Some(_) => models::build(&vs.root(), &spec),
        None => dropout_mlp(&vs.root()),
    };
    let params = models::named_parameters(&vs);
    let mut optimizer: Box<dyn Optimizer> = match setup.optimizer {
        OptimizerKind::Adam => Box::new(Adam::new(params, AdamConfig { weight_decay: 1e-4, ..AdamConfig::default() })),
        OptimizerKind::Sgd => Box::new(Sgd::new(params, SgdConfig { lr: 0.05, momentum: 0.9, ..SgdConfig::default() })),
        other => unreachable!("{other:?} is not used here"),
    };
    let train_set = data::load(DatasetKind::Cifar10, setup.data, Split::Train).unwrap();
    let test_set = data::load(DatasetKind::Cifar10, setup.data, Split::Test).unwrap();
    let train_loader = Loader::new(train_set, LoaderConfig { augment: true, ..LoaderConfig::train(16, 9, Device::Cpu) });
    let test_loader = Loader::new(test_set, LoaderConfig::eval(32, Device::Cpu));
    let config = TrainConfig {
        run: "resume".into(),
        epochs,
        max_steps: None,
        seed: 9,
        lr_schedule: LrSchedule { gamma: 0.5, ..LrSchedule::new(ScheduleKind::Step, 0) },
        accumulate: 1,
        clip_grad_norm: Some(1.0),
        checkpoint: Some(CheckpointConfig {
            dir: setup.checkpoint_dir.to_path_buf(),
            resume: true,
            model: serde_json::json!({ "arch": format!("{:?}", setup.arch) }),
            data: serde_json::Value::Null,
            config: serde_json::json!({}),
            from: None,
            keep: 0,
            every_steps: None,
            every_minutes: None,
            format: Default::default(),
            examples_per_step: 8,
        }),
        metric: common::train::Metric::Accuracy,
        precision: common::precision::Precision::Full,
        profile: false,
        steady_after: 2,
        cuda_graph: false,
        eval_only: false,
        lockstep: true,
        faults: common::train::Faults::NONE,
    };
    let mut step = LocalStep::new(vs, model, Parallel::default());
    let mut observers = Observers::new().with(train::sinks::CheckpointEveryEpoch);
    let report = train::fit(&mut step, optimizer.as_mut(), &train_loader, &test_loader, &config, &mut observers).unwrap();
    assert!(report.eval_loss.is_finite());
    let mut vars: Vec<_> = step.vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

fn check_resume_is_exact(arch: Option<Arch>, optimizer: OptimizerKind) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let data = tempfile::tempdir().unwrap();
    generate::generate(DatasetKind::Cifar10, data.path(), GenerateConfig { train: 80, test: 16, seed: 3 }).unwrap();
    let (straight_dir, split_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = Setup { data: data.path(), arch, optimizer, checkpoint_dir: straight_dir.path() };
    let split = Setup { checkpoint_dir: split_dir.path(), ..straight };

    let two_epochs = train(&straight, 2, 1);
    let one_epoch = train(&split, 1, 1);
    // A different initialisation proves the resumed run takes everything from the checkpoint.
    let resumed = train(&split, 2, 12345);

    let mut max_diff = 0.0f64;
    for ((name, a), (name_b, b)) in two_epochs.iter().zip(&resumed) {
        assert_eq!(name, name_b);
        max_diff = max_diff.max((a - b).abs().max().double_value(&[]));
    }
    assert!(max_diff <= 1e-6, "{arch:?}/{optimizer:?}: resumed parameters differ by {max_diff}");
    // And the second epoch did change the parameters (the comparison is not vacuous).
    let moved = two_epochs.iter().zip(&one_epoch).any(|((_, a), (_, b))| !a.equal(b));
    assert!(moved, "the second epoch must change the model");
}

#[test]
fn resume_is_exact_with_dropout_and_adam() {
    check_resume_is_exact(None, OptimizerKind::Adam);
}

#[test]
fn resume_is_exact_with_dropout_and_sgd_momentum() {
    check_resume_is_exact(None, OptimizerKind::Sgd);
}

#[test]
fn resume_is_exact_for_the_course_cnn() {
    check_resume_is_exact(Some(Arch::Cnn), OptimizerKind::Adam);
}

#[test]
fn resume_is_exact_with_batch_norm_buffers() {
    check_resume_is_exact(Some(Arch::Resnet34), OptimizerKind::Sgd);
}

#[test]
fn a_finished_run_resumed_trains_no_further() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let data = tempfile::tempdir().unwrap();
    generate::generate(DatasetKind::Cifar10, data.path(), GenerateConfig { train: 40, test: 8, seed: 3 }).unwrap();
    let ck = tempfile::tempdir().unwrap();
    let setup = Setup { data: data.path(), arch: None, optimizer: OptimizerKind::Adam, checkpoint_dir: ck.path() };
    let first = train(&setup, 1, 1);
    let again = train(&setup, 1, 777);
    for ((name, a), (_, b)) in first.iter().zip(&again) {
        assert!(a.equal(b), "{name} changed although the run was complete");
    }
}
