//! `common::optim` against `torch.optim`, and its state save/restore, load errors and gradient
//! clipping.
//!
//! The parity test runs `tests/reference/optim_parity.py` with the Python in `$TORCH_PYTHON`
//! (set by `scripts/with-torch`), which trains a small network with `torch.optim` and writes the
//! initial weights, batches, per-step losses and final weights to an `.npz`; the same network,
//! spelled with the same ATen ops, is then trained here from the same weights on the same
//! batches. The other tests need no Python.

mod support;

use std::collections::HashMap;
use support::Reference;

use common::optim::{clip_grad_norm, Adam, AdamConfig, Optimizer, OptimizerKind, Sgd, SgdConfig};
use tch::{Device, Kind, Reduction, Tensor};

const STEPS: usize = 20;
const PARAMS: [&str; 6] = ["conv.weight", "conv.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

/// An optimizer and its hyper-parameters.
#[derive(Clone, Copy)]
enum Spec {
    Adam(AdamConfig),
    Sgd(SgdConfig),
}

impl Spec {
    fn build(self, params: Vec<(String, Tensor)>) -> Box<dyn Optimizer> {
        match self {
            Spec::Adam(config) => Box::new(Adam::new(params, config)),
            Spec::Sgd(config) => Box::new(Sgd::new(params, config)),
        }
    }
}

/// The configurations of the reference script's `CONFIGS`: name, optimizer, and the `max_norm`
/// of gradient clipping before each step, if any.
fn configs() -> Vec<(&'static str, Spec, Option<f64>)> {
    let adam = AdamConfig::default();
    let sgd = SgdConfig::default();
    vec![
        ("adam", Spec::Adam(adam), None),
        ("adam_wd", Spec::Adam(AdamConfig { weight_decay: 0.01, ..adam }), None),
        ("adam_clip", Spec::Adam(AdamConfig { lr: 0.01, ..adam }), Some(0.5)),
        ("sgd_momentum", Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, ..sgd }), None),
        ("sgd_nesterov_wd", Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, dampening: 0.0, weight_decay: 5e-4, nesterov: true, ..sgd }), None),
        ("sgd_dampening_wd", Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.8, dampening: 0.1, weight_decay: 1e-3, nesterov: false, ..sgd }), None),
        // LibTorch's fused kernels (what runs on a GPU), against torch's fused and foreach paths.
        ("adam_fused", Spec::Adam(AdamConfig { fused: Some(true), ..adam }), None),
        ("adam_foreach_wd", Spec::Adam(AdamConfig { weight_decay: 0.01, fused: Some(true), ..adam }), None),
        ("adam_fused_clip", Spec::Adam(AdamConfig { lr: 0.01, fused: Some(true), ..adam }), Some(0.5)),
        ("sgd_fused_momentum", Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, fused: Some(true), ..sgd }), None),
        ("sgd_fused_nesterov_wd", Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, nesterov: true, weight_decay: 5e-4, fused: Some(true), ..sgd }), None),
        ("sgd_foreach_dampening_wd", Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.8, dampening: 0.1, weight_decay: 1e-3, fused: Some(true), ..sgd }), None),
        ("sgd_fused_plain", Spec::Sgd(SgdConfig { lr: 0.05, fused: Some(true), ..sgd }), None),
    ]
}

/// The reference script's network: conv 1→4 (3×3, padding 1), ReLU, 2×2 max-pool, linear
/// 64→32, ReLU, linear 32→10. Each call is the ATen op the matching `torch.nn.functional` call
/// dispatches to, so forward and backward agree bitwise with the Python side.
fn forward(p: &HashMap<&str, &Tensor>, x: &Tensor) -> Tensor {
    let h = x.conv2d(p["conv.weight"], Some(p["conv.bias"]), [1, 1], [1, 1], [1, 1], 1);
    let h = h.relu().max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false);
    let h = h.flatten(1, -1).linear(p["fc1.weight"], Some(p["fc1.bias"])).relu();
    h.linear(p["fc2.weight"], Some(p["fc2.bias"]))
}

fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    logits.cross_entropy_loss::<Tensor>(targets, None, Reduction::Mean, -100, 0.0)
}

/// Largest `|a - b| / |b|` over the elements.
fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    ((&a - &b).abs() / b.abs().clamp_min(1e-30)).max().double_value(&[])
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

#[test]
fn optimizers_match_torch_optim() {
    let reference = Reference::compute("optim_parity.py", &[]);
    let get = |key: &str| reference.get(key);
    // numpy keeps torch's dtypes: float32 data, int64 targets. A silent float64 would make the
    // comparison meaningless, so check.
    assert_eq!(get("init.fc1.weight").kind(), Kind::Float);
    assert_eq!(get("x.0").kind(), Kind::Float);
    assert_eq!(get("y.0").kind(), Kind::Int64);
    let configs = configs();
    let loss_keys = reference.with_prefix("loss.").len();
    assert_eq!(loss_keys, configs.len(), "the script's CONFIGS and configs() differ");

    let mut worst_loss = 0.0f64;
    let mut worst_param = 0.0f64;
    for (config, spec, max_norm) in configs {
        let params: Vec<(String, Tensor)> = PARAMS.iter().map(|&n| (n.to_string(), get(&format!("init.{n}")).copy().set_requires_grad(true))).collect();
        let by_name: HashMap<&str, &Tensor> = params.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let tensors: Vec<Tensor> = params.iter().map(|(_, t)| t.shallow_clone()).collect();
        let mut opt = spec.build(params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());

        let mut losses = Vec::with_capacity(STEPS);
        let mut norms = Vec::with_capacity(STEPS);
        for step in 0..STEPS {
            opt.zero_grad();
            let loss = cross_entropy(&forward(&by_name, get(&format!("x.{step}"))), get(&format!("y.{step}")));
            loss.backward();
            if let Some(max_norm) = max_norm {
                norms.push(clip_grad_norm(&tensors, max_norm));
            }
            opt.step().unwrap();
            losses.push(loss.double_value(&[]));
        }

        let torch_losses = get(&format!("loss.{config}"));
        let loss_diff = max_rel_diff(&Tensor::from_slice(&losses), torch_losses);
        for (step, &ours) in losses.iter().enumerate() {
            let theirs = torch_losses.double_value(&[step as i64]);
            assert!((ours - theirs).abs() <= 1e-5 * theirs.abs(), "{config}: step {step}: loss {ours} here, {theirs} with torch.optim");
        }
        if max_norm.is_some() {
            let diff = max_rel_diff(&Tensor::from_slice(&norms), get(&format!("grad_norm.{config}")));
            assert!(diff <= 1e-5, "{config}: gradient norms differ from torch's by {diff:e} (relative)");
        }
        let mut param_diff = 0.0f64;
        for (name, ours) in &params {
            let theirs = get(&format!("final.{config}.{name}"));
            assert_eq!(ours.kind(), Kind::Float);
            assert!(ours.allclose(theirs, 1e-5, 1e-6, false), "{config}: final `{name}` differs from torch.optim's by up to {:e}", max_abs_diff(ours, theirs));
            param_diff = param_diff.max(max_abs_diff(ours, theirs));
        }
        if config.contains("fused") || config.contains("foreach") {
            // The multi-tensor paths: within 1e-6 of torch's after 20 steps.
            assert!(param_diff <= 1e-6, "{config}: weights differ from torch's multi-tensor path by {param_diff:e}");
        }
        eprintln!("{config:>18}: max relative loss difference {loss_diff:e}, max absolute weight difference {param_diff:e}");
        worst_loss = worst_loss.max(loss_diff);
        worst_param = worst_param.max(param_diff);
    }
    eprintln!("all configurations: max relative loss difference {worst_loss:e}, max absolute weight difference {worst_param:e}");
}

/// Adam updates float32 CPU parameters in one pass, their elements shared out among threads
/// (`fused` in adam.rs; 600,011 + 301,301 + 7 elements here, so the split falls inside a
/// parameter): still `torch.optim.Adam`'s result to the last bit or two, and also for a
/// parameter with non-contiguous strides (updated with LibTorch operations).
#[test]
fn adam_matches_torch_optim_on_large_parameters_split_between_threads() {
    const SCALES: [f64; 3] = [1.0, -0.5, 2.0]; // the script's SCALES
    let reference = Reference::compute("adam_large_parity.py", &[]);
    let get = |key: &str| reference.get(key);
    let names = ["big", "matrix", "small"];
    let configs =
        [("adam", AdamConfig { lr: 1e-3, ..AdamConfig::default() }), ("adam_wd", AdamConfig { lr: 1e-2, weight_decay: 0.01, ..AdamConfig::default() })];
    assert_eq!(reference.with_prefix("final.").len(), configs.len() * names.len());
    for (config, adam) in configs {
        for transposed in [false, true] {
            let params: Vec<(String, Tensor)> = names
                .iter()
                .map(|&n| {
                    let init = get(&format!("init.{n}"));
                    // The matrix as a transposed view: same values, column-major strides.
                    let init = if transposed && n == "matrix" { init.tr().contiguous().tr() } else { init.copy() };
                    (n.to_string(), init.detach().set_requires_grad(true))
                })
                .collect();
            if transposed {
                assert!(!params[1].1.is_contiguous());
            }
            let mut opt = Adam::new(params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), adam);
            for scale in SCALES {
                opt.zero_grad();
                // d/dp Σ p·h = h exactly: step k's gradient is grad · scale, as in the script.
                let loss = params
                    .iter()
                    .map(|(n, p)| (p * (get(&format!("grad.{n}")) * scale)).sum(Kind::Float))
                    .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b);
                loss.backward();
                opt.step().unwrap();
            }
            for (name, ours) in &params {
                let theirs = get(&format!("final.{config}.{name}"));
                let diff = max_abs_diff(ours, theirs);
                assert!(
                    ours.allclose(theirs, 1e-5, 1e-6, false),
                    "{config}: `{name}` ({} elements{}) differs from torch.optim.Adam's by up to {diff:e}",
                    ours.numel(),
                    if transposed && *name == "matrix" { ", transposed" } else { "" }
                );
                eprintln!("{config:>8} {name:>6}{}: max absolute difference {diff:e}", if transposed { " (transposed run)" } else { "" });
            }
        }
    }
}

// --- state save and restore -------------------------------------------------------------------

/// A tiny regression model whose parameters all get gradients every step.
struct Toy {
    params: Vec<(String, Tensor)>,
}

impl Toy {
    fn new(seed: i64) -> Self {
        tch::manual_seed(seed);
        let params = [("layer.weight", vec![3, 5]), ("layer.bias", vec![3]), ("scale", vec![1])]
            .into_iter()
            .map(|(n, shape)| (n.to_string(), Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true)))
            .collect();
        Toy { params }
    }

    /// Deep copies of the current weights, as fresh leaf tensors.
    fn snapshot(&self) -> Toy {
        let params = self.params.iter().map(|(n, t)| (n.clone(), t.detach().copy().set_requires_grad(true))).collect();
        Toy { params }
    }

    fn named(&self) -> Vec<(String, Tensor)> {
        self.params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
    }

    /// One training step on batch `i` (deterministic in `i`).
    fn train_step(&self, opt: &mut dyn Optimizer, i: i64) {
        let x = (Tensor::arange(4 * 5, (Kind::Float, Device::Cpu)).view([4, 5]) + i as f64).sin();
        let target = Tensor::arange(4 * 3, (Kind::Float, Device::Cpu)).view([4, 3]).cos();
        let [(_, w), (_, b), (_, s)] = &self.params[..] else { unreachable!() };
        let prediction = x.linear(w, Some(b)) * s;
        let loss = (prediction - target).square().mean(Kind::Float);
        opt.zero_grad();
        loss.backward();
        opt.step().unwrap();
    }
}

/// What a checkpoint does: copies of the state tensors, detached from the live ones.
fn save(opt: &dyn Optimizer) -> HashMap<String, Tensor> {
    opt.state_tensors().into_iter().map(|(n, t)| (n, t.to_device(Device::Cpu).copy())).collect()
}

fn restore_configs() -> Vec<(&'static str, Spec)> {
    let sgd = SgdConfig { lr: 0.05, ..Default::default() };
    vec![
        ("adam", Spec::Adam(AdamConfig { lr: 0.05, weight_decay: 0.01, ..Default::default() })),
        ("sgd_plain", Spec::Sgd(sgd)),
        ("sgd_nesterov", Spec::Sgd(SgdConfig { momentum: 0.9, weight_decay: 1e-3, nesterov: true, ..sgd })),
        ("sgd_dampening", Spec::Sgd(SgdConfig { momentum: 0.9, dampening: 0.5, ..sgd })),
    ]
}

#[test]
fn the_fused_kernels_state_is_the_per_parameter_paths_and_back() {
    // A checkpoint does not say which path wrote it: 10 steps with LibTorch's fused kernel,
    // then 10 more with the per-parameter path from the saved state (and the other way round),
    // land where 20 steps of either land.
    for (config, fused_then_not, not_then_fused) in [
        (
            "adam",
            (
                Spec::Adam(AdamConfig { lr: 0.05, weight_decay: 0.01, fused: Some(true), ..Default::default() }),
                Spec::Adam(AdamConfig { lr: 0.05, weight_decay: 0.01, fused: Some(false), ..Default::default() }),
            ),
            (
                Spec::Adam(AdamConfig { lr: 0.05, weight_decay: 0.01, fused: Some(false), ..Default::default() }),
                Spec::Adam(AdamConfig { lr: 0.05, weight_decay: 0.01, fused: Some(true), ..Default::default() }),
            ),
        ),
        (
            "sgd_momentum",
            (
                Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, fused: Some(true), ..Default::default() }),
                Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, fused: Some(false), ..Default::default() }),
            ),
            (
                Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, fused: Some(false), ..Default::default() }),
                Spec::Sgd(SgdConfig { lr: 0.05, momentum: 0.9, fused: Some(true), ..Default::default() }),
            ),
        ),
    ] {
        let reference = Toy::new(7);
        let mut opt = fused_then_not.0.build(reference.named());
        for i in 0..20 {
            reference.train_step(opt.as_mut(), i);
        }
        for (first, second) in [fused_then_not, not_then_fused] {
            let toy = Toy::new(7);
            let mut opt = first.build(toy.named());
            for i in 0..10 {
                toy.train_step(opt.as_mut(), i);
            }
            let state = save(opt.as_ref());
            let mut switched = second.build(toy.named());
            switched.load_state_tensors(&state).unwrap_or_else(|e| panic!("{config}: {e:#}"));
            for i in 10..20 {
                toy.train_step(switched.as_mut(), i);
            }
            // The two paths round differently (each is bitwise or 3e-8 close to its torch
            // counterpart, not to the other): 1e-6 apart after 20 steps on one CPU, 1.03e-6 on
            // another. A lost or misread state is 1e-3 off (checked below).
            for ((name, a), (_, b)) in reference.params.iter().zip(&toy.params) {
                let diff = max_abs_diff(a, b);
                assert!(diff <= 1e-5, "{config}: `{name}` differs by {diff:e} after switching paths");
            }
        }
        // The control: the second half from a fresh state (no moments, no momentum) lands elsewhere.
        let toy = Toy::new(7);
        let mut opt = not_then_fused.0.build(toy.named());
        for i in 0..10 {
            toy.train_step(opt.as_mut(), i);
        }
        let mut fresh = not_then_fused.1.build(toy.named());
        for i in 10..20 {
            toy.train_step(fresh.as_mut(), i);
        }
        let lost = reference.params.iter().zip(&toy.params).map(|((_, a), (_, b))| max_abs_diff(a, b)).fold(0.0, f64::max);
        assert!(lost > 1e-3, "{config}: without the state the run lands only {lost:e} away: the check is vacuous");
    }
}

#[test]
fn restored_state_continues_the_same_trajectory() {
    for (config, spec) in restore_configs() {
        // Uninterrupted: 20 steps, with a snapshot of weights and state after 10.
        let straight = Toy::new(7);
        let mut opt = spec.build(straight.named());
        assert!(opt.state_tensors().is_empty(), "{config}: state before the first step");
        opt.load_state_tensors(&HashMap::new()).expect("an empty state loads before the first step");
        for i in 0..10 {
            straight.train_step(opt.as_mut(), i);
        }
        let weights = straight.snapshot();
        let state = save(opt.as_ref());
        for i in 10..20 {
            straight.train_step(opt.as_mut(), i);
        }

        // Resumed: a fresh optimizer on the snapshot, loaded with the saved state.
        let mut resumed_opt = spec.build(weights.named());
        resumed_opt.load_state_tensors(&state).unwrap_or_else(|e| panic!("{config}: {e:#}"));
        for i in 10..20 {
            weights.train_step(resumed_opt.as_mut(), i);
        }

        for ((name, a), (_, b)) in straight.params.iter().zip(&weights.params) {
            assert!(a.isfinite().all().int64_value(&[]) == 1, "{config}: `{name}` diverged; the test needs a tamer setup");
            let diff = max_abs_diff(a, b);
            assert!(diff <= 1e-7, "{config}: `{name}` differs by {diff:e} after resuming");
        }
        let (a, b) = (save(opt.as_ref()), save(resumed_opt.as_ref()));
        assert_eq!(a.len(), b.len());
        for (name, t) in &a {
            assert!(max_abs_diff(t, &b[name]) <= 1e-7, "{config}: state `{name}` differs after resuming");
        }
    }
}

#[test]
fn state_is_named_per_parameter() {
    let toy = Toy::new(1);
    let mut adam = Adam::new(toy.named(), AdamConfig::default());
    toy.train_step(&mut adam, 0);
    toy.train_step(&mut adam, 1);
    let state = save(&adam);
    let mut names: Vec<&str> = state.keys().map(String::as_str).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "exp_avg.layer.bias",
            "exp_avg.layer.weight",
            "exp_avg.scale",
            "exp_avg_sq.layer.bias",
            "exp_avg_sq.layer.weight",
            "exp_avg_sq.scale",
            "step.layer.bias",
            "step.layer.weight",
            "step.scale",
        ]
    );
    assert_eq!(state["step.scale"].size(), Vec::<i64>::new());
    assert_eq!(state["step.scale"].int64_value(&[]), 2);
    assert_eq!(state["exp_avg.layer.weight"].size(), [3, 5]);

    let mut sgd = Sgd::new(toy.named(), SgdConfig { momentum: 0.9, ..Default::default() });
    toy.train_step(&mut sgd, 0);
    let mut names: Vec<String> = sgd.state_tensors().into_iter().map(|(n, _)| n).collect();
    names.sort();
    assert_eq!(names, ["momentum_buffer.layer.bias", "momentum_buffer.layer.weight", "momentum_buffer.scale"]);
    // Without momentum torch's SGD keeps no state at all.
    let mut plain = Sgd::new(toy.named(), SgdConfig::default());
    toy.train_step(&mut plain, 0);
    assert!(plain.state_tensors().is_empty());

    assert_eq!(adam.name(), OptimizerKind::Adam.name());
    assert_eq!(sgd.name(), OptimizerKind::Sgd.name());
}

#[test]
fn loading_a_mismatched_state_fails_naming_the_tensor() {
    let toy = Toy::new(3);
    let mut adam = Adam::new(toy.named(), AdamConfig::default());
    toy.train_step(&mut adam, 0);
    let good = save(&adam);
    let load = |state: HashMap<String, Tensor>| {
        let mut fresh = Adam::new(toy.named(), AdamConfig::default());
        let err = fresh.load_state_tensors(&state).expect_err("the load should fail");
        assert!(fresh.state_tensors().is_empty(), "a failed load must leave the optimizer unchanged");
        format!("{err:#}")
    };

    // Wrong shape: the state of a model with a differently sized layer.
    let mut state = save(&adam);
    state.insert("exp_avg.layer.weight".into(), Tensor::zeros([3, 4], (Kind::Float, Device::Cpu)));
    let err = load(state);
    assert!(err.contains("`exp_avg.layer.weight`") && err.contains("shape"), "{err}");

    // A missing entry of a parameter that has the others.
    let mut state = save(&adam);
    state.remove("exp_avg_sq.scale");
    let err = load(state);
    assert!(err.contains("missing") && err.contains("`exp_avg_sq.scale`"), "{err}");

    // A tensor that belongs to no parameter: the state of another model.
    let mut state = save(&adam);
    state.insert("exp_avg.other.weight".into(), Tensor::zeros([2], (Kind::Float, Device::Cpu)));
    let err = load(state);
    assert!(err.contains("unexpected") && err.contains("`exp_avg.other.weight`"), "{err}");

    // A step count that is not one.
    let mut state = save(&adam);
    state.insert("step.scale".into(), Tensor::from(1.5f64));
    let err = load(state);
    assert!(err.contains("`step.scale`"), "{err}");

    // Adam's state is not SGD's.
    let mut sgd = Sgd::new(toy.named(), SgdConfig { momentum: 0.9, ..Default::default() });
    let err = format!("{:#}", sgd.load_state_tensors(&good).expect_err("Adam state into SGD"));
    assert!(err.contains("unexpected") && err.contains("`exp_avg."), "{err}");

    // torch's own float32 step counts load too, and loaded tensors take the parameter's kind.
    let mut state = save(&adam);
    state.insert("step.scale".into(), Tensor::from(1.0f32));
    state.insert("exp_avg.scale".into(), state["exp_avg.scale"].to_kind(Kind::Double));
    let mut fresh = Adam::new(toy.named(), AdamConfig::default());
    fresh.load_state_tensors(&state).expect("a float32 step and a float64 moment load");
    let reloaded: HashMap<String, Tensor> = fresh.state_tensors().into_iter().collect();
    assert_eq!(reloaded["exp_avg.scale"].kind(), Kind::Float);
    assert_eq!(reloaded["step.scale"].kind(), Kind::Int64);
}

// --- gradient clipping ------------------------------------------------------------------------

/// Leaf tensors whose gradients are exactly `grads` (from `sum(p * g)`).
fn with_grads(grads: &[&[f32]]) -> Vec<Tensor> {
    let params: Vec<Tensor> = grads.iter().map(|g| Tensor::zeros([g.len() as i64], (Kind::Float, Device::Cpu)).set_requires_grad(true)).collect();
    let loss: Tensor = params.iter().zip(grads).map(|(p, g)| (p * Tensor::from_slice(g)).sum(Kind::Float)).sum();
    loss.backward();
    params
}

fn grad_values(p: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(p.grad()).unwrap()
}

#[test]
fn clip_grad_norm_scales_to_the_max_norm() {
    // Gradients [3, 4] and [12]: total norm sqrt(9 + 16 + 144) = 13.
    let params = with_grads(&[&[3.0, 4.0], &[12.0]]);
    let total = clip_grad_norm(&params, 6.5);
    assert!((total - 13.0).abs() < 1e-6, "total norm {total}");
    let coef = 6.5 / (13.0 + 1e-6);
    for (p, want) in params.iter().zip([vec![3.0, 4.0], vec![12.0]]) {
        for (got, want) in grad_values(p).into_iter().zip(want) {
            assert!((got as f64 - want * coef).abs() < 1e-6, "clipped gradient {got}, expected {}", want * coef);
        }
    }
    // The clipped gradients now have norm 6.5 (up to the 1e-6 guard).
    let again = clip_grad_norm(&params, 100.0);
    assert!((again - 6.5).abs() < 1e-5, "norm after clipping {again}");
}

#[test]
fn clip_grad_norm_leaves_small_gradients_and_skips_missing_ones() {
    let mut params = with_grads(&[&[0.3, 0.4]]);
    // A parameter that took no part in the loss has no gradient and is ignored.
    params.push(Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true));
    let total = clip_grad_norm(&params, 1.0);
    assert!((total - 0.5).abs() < 1e-7, "total norm {total}");
    assert_eq!(grad_values(&params[0]), [0.3, 0.4]);
    assert!(!params[1].grad().defined());
    assert_eq!(clip_grad_norm(&params[1..], 1.0), 0.0);
    assert_eq!(clip_grad_norm(&[], 1.0), 0.0);
}

#[test]
fn zero_grad_drops_gradients_and_gradless_parameters_stay_put() {
    let used = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
    let unused = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
    let named = || vec![("unused".to_string(), unused.shallow_clone()), ("used".to_string(), used.shallow_clone())];
    for mut opt in [
        Box::new(Adam::new(named(), AdamConfig::default())) as Box<dyn Optimizer>,
        Box::new(Sgd::new(named(), SgdConfig { lr: 0.1, momentum: 0.9, ..SgdConfig::default() })),
    ] {
        // Both parameters get a gradient once, then only `used` does.
        (&used * 2.0 + &unused).sum(Kind::Float).backward();
        opt.step().unwrap();
        opt.zero_grad();
        assert!(!used.grad().defined() && !unused.grad().defined(), "{}: gradients dropped, as torch's set_to_none", opt.name());
        let before = unused.copy();
        (&used * 2.0).sum(Kind::Float).backward();
        assert!(!unused.grad().defined());
        opt.step().unwrap();
        assert!(unused.equal(&before), "{}: a parameter without a gradient is not updated (torch skips it)", opt.name());
        opt.zero_grad();
    }
}
