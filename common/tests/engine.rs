//! The training engine's large-batch pieces and its events: accumulating K batches into one
//! step equals one step on the K-times larger batch; a notebook's EventLog receives every step;
//! one-cycle equals torch's OneCycleLR; LARS and LAMB equal their papers' formulas, computed
//! here independently, and keep their state through a save and load; the steady-state speed
//! leaves out the warm-up and the epoch ends; channels-last is the same model in another memory
//! order.
mod support;

use std::sync::Mutex;

use common::data::generate::{self, GenerateConfig};
use common::data::{self, DatasetKind, Loader, LoaderConfig, Split};
use common::models::{self, Arch, ModelSpec};
use common::optim::{Lamb, LambConfig, Lars, LarsConfig, Optimizer, Sgd, SgdConfig};
use common::parallel::{LocalStep, Parallel};
use common::precision::Precision;
use common::train::{self, EventLog, LrSchedule, Metric, Observers, Record, ScheduleKind, TrainConfig};
use support::Reference;
use tch::{nn, Device, Kind, Tensor};

/// LibTorch's generator is global: tests that seed and train run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn config(epochs: usize, accumulate: usize) -> TrainConfig {
    TrainConfig {
        run: "engine".into(),
        epochs,
        max_steps: None,
        seed: 5,
        lr_schedule: LrSchedule::constant(),
        accumulate,
        clip_grad_norm: None,
        checkpoint: None,
        metric: Metric::Accuracy,
        precision: Precision::Full,
        profile: false,
        steady_after: 2,
        cuda_graph: false,
        eval_only: false,
        lockstep: true,
        faults: common::train::Faults::NONE,
    }
}

/// Trains the course CNN (no batch norm) for one epoch on `images` generated images in batches of
/// `batch`, accumulating `accumulate` of them per step; returns the variables and the report.
fn train_cnn(dir: &std::path::Path, batch: usize, accumulate: usize, observers: &mut Observers) -> (Vec<(String, Tensor)>, train::FitReport) {
    train_model(dir, &Training { batch, accumulate, ..Training::default() }, observers)
}

/// A training run of [`train_model`]: `arch` (in the channels-last format when asked) for
/// `epochs` with SGD and momentum at `lr`.
struct Training {
    arch: Arch,
    channels_last: bool,
    batch: usize,
    accumulate: usize,
    epochs: usize,
    lr: f64,
}

impl Default for Training {
    fn default() -> Self {
        Training { arch: Arch::Cnn, channels_last: false, batch: 4, accumulate: 1, epochs: 1, lr: 0.05 }
    }
}

fn train_model(dir: &std::path::Path, run: &Training, observers: &mut Observers) -> (Vec<(String, Tensor)>, train::FitReport) {
    let &Training { arch, channels_last, batch, accumulate, epochs, lr } = run;
    tch::manual_seed(11);
    let vs = nn::VarStore::new(Device::Cpu);
    let spec = ModelSpec { arch, in_channels: 3, image_size: 32, num_classes: 10 };
    let mut model = models::build(&vs.root(), &spec);
    if channels_last {
        model = Box::new(models::ChannelsLast::new(&vs, model).unwrap());
    }
    let mut optimizer = Sgd::new(models::named_parameters(&vs), SgdConfig { lr, momentum: 0.9, ..SgdConfig::default() });
    let train_set = data::load(DatasetKind::Cifar10, dir, Split::Train).unwrap();
    let test_set = data::load(DatasetKind::Cifar10, dir, Split::Test).unwrap();
    // No augmentation: its draws are per batch, and the batches differ in size here.
    let train_loader = Loader::new(train_set, LoaderConfig::train(batch, 3, Device::Cpu));
    let test_loader = Loader::new(test_set, LoaderConfig::eval(16, Device::Cpu));
    let mut step = LocalStep::new(vs, model, Parallel::default());
    let report = train::fit(&mut step, &mut optimizer, &train_loader, &test_loader, &config(epochs, accumulate), observers).unwrap();
    let mut vars: Vec<(String, Tensor)> = step.vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (vars, report)
}

fn max_relative_difference(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    a.iter()
        .zip(b)
        .map(|((name, x), (other, y))| {
            assert_eq!(name, other);
            (x - y).abs().max().double_value(&[]) / y.abs().max().double_value(&[]).max(1e-12)
        })
        .fold(0.0, f64::max)
}

#[test]
fn accumulating_k_batches_is_one_step_on_the_k_times_larger_batch() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // 40 images: batches of 8 accumulated 3 at a time make steps of 24 and 16 images (the last
    // step has 2 batches, each weighted by its share), exactly the batches of 24.
    generate::generate(DatasetKind::Cifar10, dir.path(), GenerateConfig { train: 40, test: 16, seed: 1 }).unwrap();
    let (large, large_report) = train_cnn(dir.path(), 24, 1, &mut Observers::new());
    let (accumulated, accumulated_report) = train_cnn(dir.path(), 8, 3, &mut Observers::new());
    assert_eq!((large_report.steps, accumulated_report.steps), (2, 2), "optimizer steps, not batches");
    let diff = max_relative_difference(&accumulated, &large);
    println!("3 accumulated batches of 8 vs batches of 24, 2 SGD-momentum steps: parameters differ by {diff:.1e}");
    assert!(diff <= 1e-5, "accumulated steps differ from the large batch's by {diff:e}");
    assert_eq!(accumulated_report.examples, large_report.examples);
    // Without accumulation the batches of 8 take 5 steps and end elsewhere.
    let (small, small_report) = train_cnn(dir.path(), 8, 1, &mut Observers::new());
    assert_eq!(small_report.steps, 5);
    assert!(max_relative_difference(&small, &large) > 1e-3, "the comparison is not vacuous");
}

#[test]
fn an_event_log_receives_the_runs_events_as_data() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    generate::generate(DatasetKind::Cifar10, dir.path(), GenerateConfig { train: 32, test: 16, seed: 2 }).unwrap();
    let log = EventLog::new();
    let mut observers = Observers::new().with(log.clone());
    let (_, report) = train_cnn(dir.path(), 8, 1, &mut observers);
    let records = log.records();
    assert!(matches!(&records[0], Record::Started { run, epochs: 1, steps_per_epoch: 4, start_epoch: 0 } if run == "engine"), "{:?}", records[0]);
    let steps: Vec<(usize, f64)> = records.iter().filter_map(|r| if let Record::Step { step, loss, .. } = r { Some((*step, *loss)) } else { None }).collect();
    assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<_>>(), [1, 2, 3, 4], "every step, numbered");
    assert!(steps.iter().all(|s| s.1.is_finite()) && log.losses().len() == 4);
    let Some(Record::EpochEnded(stats)) = records.iter().find(|r| matches!(r, Record::EpochEnded(_))) else { panic!("no epoch end: {records:?}") };
    assert_eq!((stats.steps, stats.examples), (4, 32));
    // The epoch's training loss is the mean of the steps' (equal batches).
    let mean = steps.iter().map(|s| s.1).sum::<f64>() / 4.0;
    assert!((stats.train_loss - mean).abs() < 1e-6 * mean, "{} vs {mean}", stats.train_loss);
    assert!(matches!(records.last(), Some(Record::Finished { steps: 4, .. })));
    assert_eq!(report.history.len(), 1);
    // Steady state: steps 3 and 4 (the first 2 are warm-up), 8 images each.
    let steady = report.steady.expect("a steady-state window");
    assert_eq!((steady.steps, steady.examples), (2, 16), "{steady:?}");
    assert!(steady.seconds > 0.0 && steady.throughput() > 0.0);
}

#[test]
fn the_steady_state_leaves_out_the_warm_up_and_every_epoch_end() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    generate::generate(DatasetKind::Cifar10, dir.path(), GenerateConfig { train: 32, test: 16, seed: 2 }).unwrap();
    let (_, report) = train_model(dir.path(), &Training { batch: 8, epochs: 3, ..Training::default() }, &mut Observers::new());
    // 3 epochs of 4 steps: epoch 1 times steps 3-4 (after the warm-up of 2); epochs 2 and 3 time
    // their steps 2-4 (the interval across the evaluation is left out): 2 + 3 + 3.
    let steady = report.steady.expect("a steady-state window");
    assert_eq!((report.steps, steady.steps, steady.examples), (12, 8, 64), "{steady:?}");
    // Evaluation is not in the window: the window is shorter than the training time.
    assert!(steady.seconds < report.train_time_s, "{steady:?} vs {} s", report.train_time_s);
}

#[test]
fn channels_last_is_the_same_model_in_another_memory_order() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    generate::generate(DatasetKind::Cifar10, dir.path(), GenerateConfig { train: 12, test: 4, seed: 3 }).unwrap();
    // Training: the course CNN (convolutions, pooling, ReLU, the flattening into the linear
    // layers) for 3 SGD steps lands on the same weights, which stay channels-last.
    let (nchw, nchw_report) = train_model(dir.path(), &Training::default(), &mut Observers::new());
    let (nhwc, nhwc_report) = train_model(dir.path(), &Training { channels_last: true, ..Training::default() }, &mut Observers::new());
    let diff = max_relative_difference(&nhwc, &nchw);
    let (a, b) = (nhwc_report.history[0].train_loss, nchw_report.history[0].train_loss);
    println!("CNN, 3 SGD steps: channels-last vs NCHW parameters differ by {diff:.1e}, losses {a} vs {b}");
    assert!(diff <= 1e-5 && (a - b).abs() <= 1e-6 * b, "channels-last trains another model: {diff:e}, {a} vs {b}");
    let conv = |vars: &[(String, Tensor)]| vars.iter().find(|(n, _)| n == "conv1.weight").unwrap().1.shallow_clone();
    assert!(common::torch_ext::is_channels_last(&conv(&nhwc)), "the weights stay channels-last through the updates");
    assert!(!common::torch_ext::is_channels_last(&conv(&nchw)));
    let (untrained, _) = train_model(dir.path(), &Training { epochs: 0, ..Training::default() }, &mut Observers::new());
    assert!(max_relative_difference(&untrained, &nchw) > 1e-3, "the weights moved: not two untrained models");

    // ResNet34 and ResNet50 (batch norm, residual adds, adaptive pooling), evaluated: the same
    // logits. (Their training at a batch of 4 is not compared: batch norm over 4 values per
    // channel in the last stages amplifies the layouts' different summation orders to 1e-3 in
    // the gradients, in PyTorch as here.)
    let images = Tensor::randn([4, 3, 32, 32], (Kind::Float, Device::Cpu));
    for arch in [Arch::Resnet34, Arch::Resnet50] {
        let spec = ModelSpec { arch, in_channels: 3, image_size: 32, num_classes: 10 };
        let logits: Vec<Tensor> = [false, true]
            .into_iter()
            .map(|channels_last| {
                tch::manual_seed(11);
                let vs = nn::VarStore::new(Device::Cpu);
                let mut model = models::build(&vs.root(), &spec);
                if channels_last {
                    model = Box::new(models::ChannelsLast::new(&vs, model).unwrap());
                }
                model.forward_t(&images, false)
            })
            .collect();
        let diff = (&logits[0] - &logits[1]).abs().max().double_value(&[]) / logits[0].abs().max().double_value(&[]);
        assert!(diff <= 1e-5, "{arch:?}'s logits differ by {diff:e} in channels-last");
    }
}

#[test]
fn one_cycle_is_torchs_one_cycle_lr() {
    let reference = Reference::compute("one_cycle.py", &[]);
    for (key, max_lr, steps, pct_start) in [("lr.default", 0.1, 100, 0.3), ("lr.short", 2.0, 37, 0.25)] {
        let schedule = LrSchedule { pct_start, ..LrSchedule::new(ScheduleKind::OneCycle, steps) };
        let theirs = Vec::<f64>::try_from(reference.get(key)).unwrap();
        assert_eq!(theirs.len(), steps);
        for (step, &expected) in theirs.iter().enumerate() {
            let ours = schedule.lr(max_lr, step, 0);
            assert!((ours - expected).abs() <= 1e-12 * expected.max(1e-6), "{key} step {step}: {ours} vs torch's {expected}");
        }
    }
}

/// Each parameter's values (or gradient) as plain numbers.
type Values = [Vec<f64>; 2];

/// Two parameters (a matrix and a bias-like vector) and the gradients of three steps.
fn problem() -> (Vec<(String, Tensor)>, Vec<Values>) {
    let w = Tensor::from_slice(&[0.5f64, -1.0, 0.25, 2.0, -0.75, 1.5]).view([2, 3]).to_kind(Kind::Float);
    let b = Tensor::from_slice(&[0.1f64, -0.2, 0.3]).to_kind(Kind::Float);
    let params = vec![("w".to_string(), w.set_requires_grad(true)), ("b".to_string(), b.set_requires_grad(true))];
    let grads = vec![
        [vec![0.3, -0.1, 0.8, -0.4, 0.2, 0.05], vec![1.0, -2.0, 0.5]],
        [vec![-0.2, 0.6, 0.1, 0.9, -0.3, 0.4], vec![0.2, 0.1, -0.3]],
        [vec![0.05, 0.05, -0.7, 0.3, 0.3, -0.1], vec![-0.5, 0.4, 0.9]],
    ];
    (params, grads)
}

/// Sets the parameters' gradients to `grads` (through a backward pass, as training does).
fn set_grads(params: &[(String, Tensor)], grads: &Values) {
    let loss =
        params.iter().zip(grads).map(|((_, p), g)| (p * Tensor::from_slice(g).to_kind(Kind::Float).view_as(p)).sum(Kind::Float)).reduce(|a, b| a + b).unwrap();
    loss.backward();
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.detach().to_kind(Kind::Double).view([-1])).unwrap()
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Runs `optimizer` over `problem()`'s three steps, checking the parameters against `expected`
/// (an independent f64 computation of the same formula) after each, and that its state, saved
/// after step 2 and loaded into a fresh optimizer, gives the same step 3.
fn check_against_formula(name: &str, make: &dyn Fn(Vec<(String, Tensor)>) -> Box<dyn Optimizer>, expected: &mut dyn FnMut(&mut Values, &Values)) {
    let (params, grads) = problem();
    let mut ours = make(params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
    let mut reference = [values(&params[0].1), values(&params[1].1)];
    let mut saved = None;
    for (step, g) in grads.iter().enumerate() {
        ours.zero_grad();
        set_grads(&params, g);
        if step == 2 {
            saved = Some((
                ours.state_tensors().into_iter().map(|(k, t)| (k, t.copy())).collect::<std::collections::HashMap<_, _>>(),
                params.iter().map(|(n, t)| (n.clone(), t.detach().copy())).collect::<Vec<_>>(),
            ));
        }
        ours.step().unwrap();
        expected(&mut reference, g);
        for ((pname, p), want) in params.iter().zip(&reference) {
            let got = values(p);
            for (x, y) in got.iter().zip(want) {
                assert!((x - y).abs() <= 1e-5 * y.abs().max(1e-3), "{name} step {step}, {pname}: {got:?} vs {want:?}");
            }
        }
    }
    // A restored optimizer takes step 3 exactly as the original did.
    let (state, before) = saved.unwrap();
    let restored_params: Vec<(String, Tensor)> = before.iter().map(|(n, t)| (n.clone(), t.copy().set_requires_grad(true))).collect();
    let mut restored = make(restored_params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
    restored.load_state_tensors(&state).unwrap();
    restored.zero_grad();
    set_grads(&restored_params, &grads[2]);
    restored.step().unwrap();
    for ((_, a), (_, b)) in restored_params.iter().zip(&params) {
        assert!(a.equal(b), "{name}: a restored state takes the same step");
    }
}

#[test]
fn lars_is_larc_around_sgd_with_momentum() {
    let config = LarsConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.01, trust_coefficient: 0.02, eps: 1e-8, clip: true, skip_1d: true };
    let mut buffers: [Option<Vec<f64>>; 2] = [None, None];
    check_against_formula("LARS", &|p| Box::new(Lars::new(p, config)), &mut |params, grads| {
        for (i, (w, g)) in params.iter_mut().zip(grads).enumerate() {
            let adapted: Vec<f64> = if i == 0 {
                // The matrix: trust ratio η‖w‖/(‖g‖ + λ‖w‖ + ε), clipped to the global rate.
                let (wn, gn) = (norm(w), norm(g));
                let ratio = (config.trust_coefficient * wn / (gn + config.weight_decay * wn + config.eps) / config.lr).min(1.0);
                assert!(ratio < 1.0, "the trust ratio must matter in this test");
                w.iter().zip(g).map(|(w, g)| (g + config.weight_decay * w) * ratio).collect()
            } else {
                g.clone() // a bias: plain momentum SGD, no decay
            };
            let buffer = match buffers[i].take() {
                None => adapted,
                Some(b) => b.iter().zip(&adapted).map(|(b, a)| config.momentum * b + a).collect(),
            };
            for (w, b) in w.iter_mut().zip(&buffer) {
                *w -= config.lr * b;
            }
            buffers[i] = Some(buffer);
        }
    });
}

#[test]
fn lamb_is_adam_with_a_layerwise_trust_ratio() {
    let config = LambConfig { lr: 0.01, betas: (0.9, 0.999), eps: 1e-6, weight_decay: 0.1, skip_1d: true };
    let mut moments: [(Vec<f64>, Vec<f64>); 2] = [(vec![0.0; 6], vec![0.0; 6]), (vec![0.0; 3], vec![0.0; 3])];
    let mut step = 0;
    check_against_formula("LAMB", &|p| Box::new(Lamb::new(p, config)), &mut |params, grads| {
        step += 1;
        let (b1, b2) = config.betas;
        for (i, (w, g)) in params.iter_mut().zip(grads).enumerate() {
            let (m, v) = &mut moments[i];
            for k in 0..g.len() {
                m[k] = b1 * m[k] + (1.0 - b1) * g[k];
                v[k] = b2 * v[k] + (1.0 - b2) * g[k] * g[k];
            }
            let mut r: Vec<f64> = (0..g.len()).map(|k| (m[k] / (1.0 - b1.powi(step))) / ((v[k] / (1.0 - b2.powi(step))).sqrt() + config.eps)).collect();
            if i == 0 {
                // The matrix: decoupled decay, then the trust ratio ‖w‖/‖r‖.
                for (r, w) in r.iter_mut().zip(w.iter()) {
                    *r += config.weight_decay * w;
                }
                let trust = norm(w) / norm(&r);
                r.iter_mut().for_each(|r| *r *= trust);
            }
            for (w, r) in w.iter_mut().zip(&r) {
                *w -= config.lr * r;
            }
        }
    });
}
