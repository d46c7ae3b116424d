//! Adam (Kingma & Ba), as `torch.optim.Adam` computes it without `amsgrad`, `maximize`,
//! `capturable` or decoupled weight decay.

use std::collections::HashMap;

use anyhow::Result;
use tch::Tensor;

use super::{add_scaled, moment_zeros, DeviceLr, EntryKind, Optimizer, ParamState, Slots};

/// Adam's hyper-parameters; [`Default`] gives torch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// L2 penalty added to the gradient (`grad + weight_decay * param`, not AdamW's decay).
    pub weight_decay: f64,
    /// LibTorch's multi-tensor kernel (`torch.optim.Adam(fused=True)`, `_fused_adam_`): one
    /// launch for all parameters of a device instead of several per parameter. `None`: on CUDA
    /// parameters (where launches cost), not on the CPU, where the one-pass update below is
    /// faster.
    #[serde(default)]
    pub fused: Option<bool>,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, fused: None }
    }
}

/// `torch.optim.Adam` over named parameters, with saveable state.
pub struct Adam {
    slots: Slots<AdamState>,
    config: AdamConfig,
    /// The fused kernels' learning rate (a device tensor once capturable).
    lr_device: DeviceLr,
}

/// What Adam keeps per parameter; torch's `state[p]` with `step`, `exp_avg`, `exp_avg_sq`.
struct AdamState {
    /// Updates of this parameter so far: the bias corrections depend on it.
    step: i64,
    /// First moment estimate.
    exp_avg: Tensor,
    /// Second (uncentred) moment estimate.
    exp_avg_sq: Tensor,
    /// `step` as a float32 tensor on the parameter's device, for the fused kernel (made when
    /// first needed; checkpoints keep the integer).
    step_tensor: Option<Tensor>,
}

impl ParamState for AdamState {
    const ENTRIES: &'static [(&'static str, EntryKind)] = &[("step", EntryKind::Count), ("exp_avg", EntryKind::Moment), ("exp_avg_sq", EntryKind::Moment)];

    fn to_tensors(&self) -> Vec<Tensor> {
        // The fused kernel's count is the true one: a CUDA graph replays its increments without
        // the host's `step` seeing them.
        let step = self.step_tensor.as_ref().map_or(self.step, |t| t.double_value(&[]) as i64);
        vec![Tensor::from(step), self.exp_avg.shallow_clone(), self.exp_avg_sq.shallow_clone()]
    }

    fn from_tensors(tensors: Vec<Tensor>) -> Self {
        let [step, exp_avg, exp_avg_sq]: [Tensor; 3] = tensors.try_into().expect("one tensor per entry");
        AdamState { step: step.int64_value(&[]), exp_avg, exp_avg_sq, step_tensor: None }
    }
}

impl Adam {
    /// An Adam optimizer over `params` (shallow clones of the model's variables, updated in
    /// place), named so that their state can be saved.
    ///
    /// # Panics
    /// On a hyper-parameter torch rejects (negative `lr`, `eps` or `weight_decay`, a beta outside
    /// `[0, 1)`), or on two parameters with the same name.
    pub fn new(params: Vec<(String, Tensor)>, config: AdamConfig) -> Self {
        let AdamConfig { lr, betas: (beta1, beta2), eps, weight_decay, .. } = config;
        assert!(lr >= 0.0, "Adam: invalid learning rate {lr}");
        assert!(eps >= 0.0, "Adam: invalid epsilon {eps}");
        assert!((0.0..1.0).contains(&beta1), "Adam: invalid beta1 {beta1}");
        assert!((0.0..1.0).contains(&beta2), "Adam: invalid beta2 {beta2}");
        assert!(weight_decay >= 0.0, "Adam: invalid weight decay {weight_decay}");
        Adam { slots: Slots::new(params), config, lr_device: DeviceLr::default() }
    }

    /// The hyper-parameters (with the current learning rate).
    pub fn config(&self) -> &AdamConfig {
        &self.config
    }
}

/// Parameters of one device and kind for LibTorch's fused kernel: parameters, gradients, first
/// and second moments, step tensors.
struct FusedGroup {
    key: (tch::Device, tch::Kind),
    tensors: [Vec<Tensor>; 5],
}

/// The scalars of one parameter's update: `[1 − β₁, β₂, 1 − β₂, √(bias correction 2), ε,
/// −step size]` (torch's Python floats).
type UpdateScalars = [f64; 6];

/// One Adam update of `param` (all tensors alike in shape, device and kind) with LibTorch
/// operations: torch's single-tensor `_single_tensor_adam`, operation for operation. Used on
/// the GPU and for what [`fused`] does not take.
fn update(
    param: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    weight_decay: f64,
    [one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size]: UpdateScalars,
) {
    let scaled = grad.empty_like();
    let mut denom = exp_avg_sq.empty_like();
    let decayed;
    let grad = if weight_decay != 0.0 {
        decayed = add_scaled(grad, param, weight_decay);
        &decayed
    } else {
        grad
    };
    let _ = exp_avg.lerp_(grad, one_minus_beta1);
    // torch: `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`. tch's `addcmul_`
    // has no `value`; the kernel computes `self + (value * t1) * t2`, so passing
    // `t1 = grad * value` (and value 1) gives the same roundings.
    let _ = grad.mul_scalar_out(&scaled, one_minus_beta2);
    let _ = exp_avg_sq.g_mul_scalar_(beta2).addcmul_(&scaled, grad);
    // torch: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`.
    let _ = exp_avg_sq.sqrt_out(&denom);
    let _ = denom.g_div_scalar_(bias_correction2_sqrt);
    let _ = denom.g_add_scalar_(eps);
    // torch: `param.addcdiv_(exp_avg, denom, value=-step_size)`, i.e.
    // `param + (value * exp_avg) / denom`; again the value moves into the first factor.
    let _ = exp_avg.mul_scalar_out(&scaled, neg_step_size);
    let _ = param.addcdiv_(&scaled, &denom);
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        let AdamConfig { lr, betas: (beta1, beta2), eps, weight_decay, fused } = self.config;
        let mut jobs = Vec::new();
        // Parameters for LibTorch's fused kernel, by device and kind (one call per group).
        let mut groups: Vec<FusedGroup> = Vec::new();
        self.slots.update_each(|param, grad, state| {
            let state = state.get_or_insert_with(|| AdamState { step: 0, exp_avg: moment_zeros(param), exp_avg_sq: moment_zeros(param), step_tensor: None });
            let widened = param.kind() == tch::Kind::Half;
            if fused.unwrap_or(param.device().is_cuda()) && !widened {
                let step = state.step;
                let step_tensor = state.step_tensor.get_or_insert_with(|| Tensor::full([], step as f64, (tch::Kind::Float, param.device())));
                state.step += 1;
                let key = (param.device(), param.kind());
                let index = match groups.iter().position(|g| g.key == key) {
                    Some(i) => i,
                    None => {
                        groups.push(FusedGroup { key, tensors: Default::default() });
                        groups.len() - 1
                    }
                };
                let tensors = [&*param, grad, &state.exp_avg, &state.exp_avg_sq, &*step_tensor].map(|t| t.shallow_clone());
                for (list, t) in groups[index].tensors.iter_mut().zip(tensors) {
                    list.push(t);
                }
                return;
            }
            state.step += 1;
            // The bias corrections are Python floats in torch (`beta ** step` with a float
            // step); `powf` is the same C `pow`, and `** 0.5` is `pow` too, not `sqrt`.
            let step = state.step as f64;
            let bias_correction1 = 1.0 - beta1.powf(step);
            let bias_correction2 = 1.0 - beta2.powf(step);
            let step_size = lr / bias_correction1;
            let scalars = [1.0 - beta1, beta2, 1.0 - beta2, bias_correction2.powf(0.5), eps, -step_size];
            match fused::Job::new(param, grad, &state.exp_avg, &state.exp_avg_sq, weight_decay, scalars) {
                Some(job) => jobs.push(job),
                None if widened => update_widened(param, grad, &mut state.exp_avg, &mut state.exp_avg_sq, weight_decay, scalars),
                None => update(param, grad, &mut state.exp_avg, &mut state.exp_avg_sq, weight_decay, scalars),
            }
        });
        fused::run(&jobs, tch::get_num_threads().max(1) as usize);
        tch::no_grad(|| {
            for group in &groups {
                let [params, grads, exp_avgs, exp_avg_sqs, steps] = group.tensors.each_ref().map(|l| l.iter().collect::<Vec<&Tensor>>());
                // torch increments the step tensors (one launch), then the kernel reads them.
                crate::torch_ext::foreach_add_scalar_(&steps, 1.0)?;
                let lr = self.lr_device.for_device(group.key.0, lr);
                crate::torch_ext::fused_adam(&params, &grads, &exp_avgs, &exp_avg_sqs, &steps, lr, (beta1, beta2), weight_decay, eps)?;
            }
            Ok(())
        })
    }

    fn zero_grad(&mut self) {
        self.slots.zero_grad();
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
        self.lr_device.set(lr);
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.slots.state_tensors()
    }

    fn load_state_tensors(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        self.slots.load_state_tensors(state)
    }

    fn name(&self) -> &'static str {
        "adam"
    }

    fn make_capturable(&mut self) -> Result<()> {
        anyhow::ensure!(
            self.config.fused != Some(false),
            "--cuda-graph needs Adam's fused kernel (its per-parameter path bakes the learning rate into each launch)"
        );
        anyhow::ensure!(
            !self.slots.any_of_kind(tch::Kind::Half),
            "--cuda-graph with float16 parameters (--precision 16-true): Adam updates them in float32 one parameter at a time, \
             which a graph cannot replay with a changing learning rate; use --precision bf16-true or 16-mixed"
        );
        self.lr_device.capturable = true;
        Ok(())
    }
}

/// [`update`] of a float16 parameter whose moments are float32 ([`super::moment_kind`]): the
/// arithmetic in float32, as torch's fused kernels do it in their wider "opmath" type, the
/// result rounded once into the parameter.
fn update_widened(param: &mut Tensor, grad: &Tensor, exp_avg: &mut Tensor, exp_avg_sq: &mut Tensor, weight_decay: f64, scalars: UpdateScalars) {
    let mut wide = param.to_kind(tch::Kind::Float);
    update(&mut wide, &grad.to_kind(tch::Kind::Float), exp_avg, exp_avg_sq, weight_decay, scalars);
    tch::no_grad(|| param.copy_(&wide));
}

/// Adam on float32 CPU parameters in one pass over memory.
///
/// torch's single-tensor Adam makes nine passes over each parameter (one per operation: lerp,
/// mul, addcmul, sqrt, div, add, mul, addcdiv, with the temporaries they allocate), and each
/// operation is a fork and join of the intra-op threads. On the CPU those passes, not the
/// arithmetic, are the cost: the update is memory-bound, and a model's hundred small tensors
/// make a thousand operations. Here every element's update is done in registers, reading the
/// parameter, gradient and both moments once and writing three of them once, and all the
/// parameters' elements are shared out among LibTorch's intra-op thread count in one fork and
/// join per step.
///
/// The arithmetic is torch's, in float32 and in its order (scalars rounded to float32 as
/// LibTorch's kernels do); torch's vectorised lerp uses a fused multiply-add, so results can
/// differ from `torch.optim.Adam`'s in the last bit (tests/optim_parity.rs compares them).
mod fused {
    use super::UpdateScalars;
    use tch::{Device, Kind, Tensor};

    /// One parameter's update: raw views of its four tensors. The tensors are kept alive by
    /// the handles, and are distinct (a parameter, its gradient, its two moments).
    pub(super) struct Job {
        _tensors: [Tensor; 4],
        param: *mut f32,
        grad: *const f32,
        exp_avg: *mut f32,
        exp_avg_sq: *mut f32,
        len: usize,
        weight_decay: f32,
        scalars: [f32; 6],
    }

    // SAFETY: a job's pointers are only dereferenced inside `run`, where the threads work on
    // disjoint ranges of each tensor, and the tensors outlive `run` (the job owns handles).
    unsafe impl Send for Job {}
    unsafe impl Sync for Job {}

    impl Job {
        /// The job for a float32, contiguous CPU parameter (whose gradient and moments are
        /// too); None for anything else.
        pub(super) fn new(param: &Tensor, grad: &Tensor, exp_avg: &Tensor, exp_avg_sq: &Tensor, weight_decay: f64, scalars: UpdateScalars) -> Option<Job> {
            let tensors = [param, grad, exp_avg, exp_avg_sq];
            let eligible = tensors.iter().all(|t| t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous())
                && tensors.iter().all(|t| t.size() == param.size());
            if !eligible {
                return None;
            }
            Some(Job {
                param: param.data_ptr() as *mut f32,
                grad: grad.data_ptr() as *const f32,
                exp_avg: exp_avg.data_ptr() as *mut f32,
                exp_avg_sq: exp_avg_sq.data_ptr() as *mut f32,
                len: param.numel(),
                weight_decay: weight_decay as f32,
                scalars: scalars.map(|x| x as f32),
                _tensors: tensors.map(Tensor::shallow_clone),
            })
        }

        /// Updates elements `range` of the parameter.
        ///
        /// # Safety
        /// No other thread may touch these elements meanwhile.
        unsafe fn update(&self, range: std::ops::Range<usize>) {
            let (start, len) = (range.start, range.len());
            let p = std::slice::from_raw_parts_mut(self.param.add(start), len);
            let g = std::slice::from_raw_parts(self.grad.add(start), len);
            let m = std::slice::from_raw_parts_mut(self.exp_avg.add(start), len);
            let v = std::slice::from_raw_parts_mut(self.exp_avg_sq.add(start), len);
            let [one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size] = self.scalars;
            let wd = self.weight_decay;
            for i in 0..len {
                // torch: grad.add(param, alpha=weight_decay) when decaying.
                let grad = if wd != 0.0 { g[i] + wd * p[i] } else { g[i] };
                // exp_avg.lerp_(grad, 1 - beta1), in LibTorch's form for a weight below ½ (β₁ above ½,
                // as always in practice; its other form is the same sum in exact arithmetic).
                let exp_avg = m[i] + one_minus_beta1 * (grad - m[i]);
                // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2).
                let exp_avg_sq = v[i] * beta2 + (one_minus_beta2 * grad) * grad;
                // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps).
                let denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps;
                // param.addcdiv_(exp_avg, denom, value=-step_size).
                p[i] += (neg_step_size * exp_avg) / denom;
                m[i] = exp_avg;
                v[i] = exp_avg_sq;
            }
        }
    }

    /// Elements below which one thread does the whole step (a thread start costs more).
    const PARALLEL_FROM: usize = 1 << 16;

    /// Runs every job, the elements of all of them split evenly over `threads` threads.
    pub(super) fn run(jobs: &[Job], threads: usize) {
        let total: usize = jobs.iter().map(|j| j.len).sum();
        let threads = if total < PARALLEL_FROM { 1 } else { threads.min(total) };
        let share = total.div_ceil(threads.max(1));
        // Thread t takes elements [t·share, (t+1)·share) of the jobs laid end to end.
        let work = |t: usize| {
            let (from, to) = (t * share, ((t + 1) * share).min(total));
            let mut offset = 0;
            for job in jobs {
                let (lo, hi) = (from.max(offset), to.min(offset + job.len));
                if lo < hi {
                    // SAFETY: threads' element ranges are disjoint, so are their parts of each job.
                    unsafe { job.update(lo - offset..hi - offset) };
                }
                offset += job.len;
                if offset >= to {
                    break;
                }
            }
        };
        if threads <= 1 {
            return work(0);
        }
        std::thread::scope(|scope| {
            for t in 1..threads {
                scope.spawn(move || work(t));
            }
            work(0);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameters, gradients and moments of the given sizes, with varied values (from sines,
    /// not the random generator, which other tests running at the same time also draw from).
    fn tensors(sizes: &[i64], seed: i64) -> Vec<[Tensor; 4]> {
        let wave = |n: i64, f: f64| (Tensor::arange(n, (tch::Kind::Float, tch::Device::Cpu)) * f + seed as f64).sin();
        sizes.iter().map(|&n| [wave(n, 0.37), wave(n, 1.91), wave(n, 0.73) * 0.1, wave(n, 2.3).square() * 0.01]).collect()
    }

    const SCALARS: UpdateScalars = [0.1, 0.999, 0.001, 0.0447213595499958, 1e-8, -0.0031622776601683794];

    fn fused_step(sizes: &[i64], threads: usize, weight_decay: f64) -> Vec<[Tensor; 4]> {
        let set = tensors(sizes, 5);
        let jobs: Vec<fused::Job> =
            set.iter().map(|[p, g, m, v]| fused::Job::new(p, g, m, v, weight_decay, SCALARS).expect("float32 contiguous CPU")).collect();
        fused::run(&jobs, threads);
        set
    }

    #[test]
    fn the_one_pass_update_is_the_same_however_it_is_split_and_agrees_with_libtorch_ops() {
        // Sizes that put thread boundaries inside parameters and one parameter of one element.
        let sizes = [70_001, 1, 65_537, 333];
        for weight_decay in [0.0, 0.01] {
            let one = fused_step(&sizes, 1, weight_decay);
            for threads in [2, 3, 7] {
                for (a, b) in one.iter().zip(&fused_step(&sizes, threads, weight_decay)) {
                    for (x, y) in a.iter().zip(b) {
                        assert!(x.equal(y), "{threads} threads changed the result");
                    }
                }
            }
            let mut reference = tensors(&sizes, 5);
            for [p, g, m, v] in &mut reference {
                update(p, g, m, v, weight_decay, SCALARS);
            }
            for (ours, theirs) in one.iter().zip(&reference) {
                for (x, y) in ours.iter().zip(theirs) {
                    let diff = (x - y).abs().max().double_value(&[]);
                    assert!(diff <= 1e-6 * (1.0 + y.abs().max().double_value(&[])), "one pass vs LibTorch ops: {diff:e}");
                }
                // Skipped elements would show in the moments, which move by a tenth of (grad − exp_avg).
                let before = &tensors(&sizes, 5)[one.iter().position(|t| std::ptr::eq(t, ours)).unwrap()];
                let moved = ours[2].ne_tensor(&before[2]).to_kind(tch::Kind::Float).mean(tch::Kind::Float).double_value(&[]);
                assert!(moved > 0.99, "only {moved} of the first moments changed");
            }
        }
    }

    #[test]
    fn other_kinds_and_strides_take_libtorch_ops() {
        let p = Tensor::ones([4, 3], (tch::Kind::Float, tch::Device::Cpu));
        let g = p.ones_like();
        let (m, v) = (p.zeros_like(), p.zeros_like());
        assert!(fused::Job::new(&p, &g, &m, &v, 0.0, SCALARS).is_some());
        let t = p.tr();
        assert!(fused::Job::new(&t, &g.tr(), &m.tr(), &v.tr(), 0.0, SCALARS).is_none(), "non-contiguous");
        let d = p.to_kind(tch::Kind::Double);
        assert!(fused::Job::new(&d, &d.ones_like(), &d.zeros_like(), &d.zeros_like(), 0.0, SCALARS).is_none(), "float64");
    }

    /// Three Adam steps on `param` with the same gradient each time; the parameter and state after.
    fn three_steps(param: &Tensor, grad: &Tensor) -> (Tensor, Vec<(String, Tensor)>) {
        let p = param.copy().set_requires_grad(true);
        let mut adam = Adam::new(vec![("w".into(), p.shallow_clone())], AdamConfig::default());
        for _ in 0..3 {
            let mut g = p.grad();
            if !g.defined() {
                (p.shallow_clone() * 0.0).sum(p.kind()).backward();
                g = p.grad();
            }
            tch::no_grad(|| g.copy_(grad));
            adam.step().unwrap();
        }
        (p.detach(), adam.state_tensors())
    }

    #[test]
    fn float16_parameters_keep_float32_moments_and_step_like_float32() {
        // Zero, tiny and ordinary gradients: in float16 the first's update is 0/0 and the
        // second's square (1e-8) rounds to zero, so float16 moments give NaN and a jump.
        let values = [0.5, -0.25, 0.125, 1.0, 0.75];
        let grads = [0.0, 1e-4, -3e-5, 0.5, -2e-3];
        let half = |v: &[f64]| Tensor::from_slice(v).to_kind(tch::Kind::Half);
        let (param, state) = three_steps(&half(&values), &half(&grads));
        assert_eq!(param.kind(), tch::Kind::Half);
        let moments: Vec<&Tensor> = state.iter().filter(|(name, _)| name.starts_with("exp_avg")).map(|(_, t)| t).collect();
        assert_eq!(moments.len(), 2);
        assert!(moments.iter().all(|m| m.kind() == tch::Kind::Float), "{:?}", moments.iter().map(|m| m.kind()).collect::<Vec<_>>());
        // The float32 reference, from the same (float16-rounded) values and gradients.
        let wide = |t: Tensor| t.to_kind(tch::Kind::Float);
        let (reference, _) = three_steps(&wide(half(&values)), &wide(half(&grads)));
        let ours = wide(param);
        assert!(ours.isfinite().all().int64_value(&[]) == 1, "{ours:?}");
        // One float16 rounding per step apart: half an ulp, at most 2^-11 of the value, each.
        let diff = (&ours - &reference).abs() - reference.abs() * (3.0 * 2f64.powi(-11));
        assert!(diff.max().double_value(&[]) <= 1e-7, "{ours:?} vs {reference:?}");
        // A zero gradient does not move its element; the others moved by about lr each step.
        assert_eq!(ours.double_value(&[0]), 0.5);
        assert!((ours.double_value(&[1]) - (-0.25 - 3e-3)).abs() < 2e-4, "{ours:?}");
    }

    #[test]
    fn float16_moments_load_as_float32_from_a_checkpoint() {
        let p = Tensor::from_slice(&[0.5f32, -0.25]).to_kind(tch::Kind::Half);
        let (_, state) = three_steps(&p, &Tensor::from_slice(&[1e-4f32, 0.5]).to_kind(tch::Kind::Half));
        let saved: HashMap<String, Tensor> = state.into_iter().collect();
        let mut fresh = Adam::new(vec![("w".into(), p.copy())], AdamConfig::default());
        fresh.load_state_tensors(&saved).unwrap();
        for (name, t) in fresh.state_tensors() {
            if name.starts_with("exp_avg") {
                assert_eq!(t.kind(), tch::Kind::Float, "{name}");
                assert!(t.equal(&saved[&name]), "{name} changed on loading");
            }
        }
    }

    #[test]
    fn a_graph_cannot_replay_the_float16_update_and_says_so_before_the_first_step() {
        let half = Tensor::ones([3], (tch::Kind::Half, tch::Device::Cpu));
        let err = Adam::new(vec![("w".into(), half)], AdamConfig::default()).make_capturable().unwrap_err();
        assert!(err.to_string().contains("--cuda-graph with float16 parameters"), "{err}");
        let float = Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu));
        assert!(Adam::new(vec![("w".into(), float)], AdamConfig::default()).make_capturable().is_ok());
    }
}
