//! Adam (Kingma & Ba), as `torch.optim.Adam` computes it without `amsgrad`, `maximize`,
//! `capturable` or decoupled weight decay.

use std::collections::HashMap;

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::{add_scaled, EntryKind, Optimizer, ParamState, Slots};

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
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// `torch.optim.Adam` over named parameters, with saveable state.
pub struct Adam {
    slots: Slots<AdamState>,
    config: AdamConfig,
    /// CPU buffers of [`CPU_CHUNK`] elements for the update's intermediates, one pair per
    /// floating-point kind met.
    scratch: Vec<Scratch>,
}

/// What Adam keeps per parameter; torch's `state[p]` with `step`, `exp_avg`, `exp_avg_sq`.
struct AdamState {
    /// Updates of this parameter so far: the bias corrections depend on it.
    step: i64,
    /// First moment estimate.
    exp_avg: Tensor,
    /// Second (uncentred) moment estimate.
    exp_avg_sq: Tensor,
}

impl ParamState for AdamState {
    const ENTRIES: &'static [(&'static str, EntryKind)] = &[
        ("step", EntryKind::Count),
        ("exp_avg", EntryKind::LikeParam),
        ("exp_avg_sq", EntryKind::LikeParam),
    ];

    fn to_tensors(&self) -> Vec<Tensor> {
        vec![
            Tensor::from(self.step),
            self.exp_avg.shallow_clone(),
            self.exp_avg_sq.shallow_clone(),
        ]
    }

    fn from_tensors(tensors: Vec<Tensor>) -> Self {
        let [step, exp_avg, exp_avg_sq]: [Tensor; 3] =
            tensors.try_into().expect("one tensor per entry");
        AdamState {
            step: step.int64_value(&[]),
            exp_avg,
            exp_avg_sq,
        }
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
        let AdamConfig {
            lr,
            betas: (beta1, beta2),
            eps,
            weight_decay,
        } = config;
        assert!(lr >= 0.0, "Adam: invalid learning rate {lr}");
        assert!(eps >= 0.0, "Adam: invalid epsilon {eps}");
        assert!((0.0..1.0).contains(&beta1), "Adam: invalid beta1 {beta1}");
        assert!((0.0..1.0).contains(&beta2), "Adam: invalid beta2 {beta2}");
        assert!(
            weight_decay >= 0.0,
            "Adam: invalid weight decay {weight_decay}"
        );
        Adam {
            slots: Slots::new(params),
            config,
            scratch: Vec::new(),
        }
    }

    /// The hyper-parameters (with the current learning rate).
    pub fn config(&self) -> &AdamConfig {
        &self.config
    }
}

/// Elements of a parameter updated together on the CPU: every operation of the update runs
/// over one chunk before the next chunk, so the chunk's slices of the parameter, gradient and
/// moments stay in cache across the nine operations instead of streaming the whole tensors
/// through memory nine times, and the two intermediates live in small scratch buffers reused
/// by every chunk of every parameter instead of fresh parameter-sized allocations (which on
/// the CPU cost a page fault per 4 KiB, as much as the arithmetic). Adam is element-wise, so
/// the result is the same, element for element, as over whole tensors. A multiple of 1024
/// (whole SIMD vectors), and large enough that each operation still uses every intra-op thread
/// (ATen splits an operation over threads from 32,768 elements per thread).
pub(crate) const CPU_CHUNK: i64 = 1 << 18;

/// Buffers for the intermediates of an update on the CPU: `scaled` holds `(1 − β₂)·grad`, then
/// `−step_size·exp_avg`; `denom` the denominator.
struct Scratch {
    kind: Kind,
    scaled: Tensor,
    denom: Tensor,
}

/// One Adam update of `param` (all tensors alike in shape, device and kind), with `scaled` and
/// `denom` as the buffers for the intermediates: torch's single-tensor `_single_tensor_adam`,
/// operation for operation, except that intermediates are written into the buffers.
#[allow(clippy::too_many_arguments)]
fn update(
    param: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    scaled: &Tensor,
    denom: &mut Tensor,
    weight_decay: f64,
    [one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size]: [f64; 6],
) {
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
    let _ = grad.mul_scalar_out(scaled, one_minus_beta2);
    let _ = exp_avg_sq.g_mul_scalar_(beta2).addcmul_(scaled, grad);
    // torch: `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`.
    let _ = exp_avg_sq.sqrt_out(denom);
    let _ = denom.g_div_scalar_(bias_correction2_sqrt);
    let _ = denom.g_add_scalar_(eps);
    // torch: `param.addcdiv_(exp_avg, denom, value=-step_size)`, i.e.
    // `param + (value * exp_avg) / denom`; again the value moves into the first factor.
    let _ = exp_avg.mul_scalar_out(scaled, neg_step_size);
    let _ = param.addcdiv_(scaled, denom);
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        let AdamConfig {
            lr,
            betas: (beta1, beta2),
            eps,
            weight_decay,
        } = self.config;
        let scratch = &mut self.scratch;
        self.slots.update_each(|param, grad, state| {
            let state = state.get_or_insert_with(|| AdamState {
                step: 0,
                exp_avg: param.zeros_like(),
                exp_avg_sq: param.zeros_like(),
            });
            state.step += 1;
            // The bias corrections are Python floats in torch (`beta ** step` with a float
            // step); `powf` is the same C `pow`, and `** 0.5` is `pow` too, not `sqrt`.
            let step = state.step as f64;
            let bias_correction1 = 1.0 - beta1.powf(step);
            let bias_correction2 = 1.0 - beta2.powf(step);
            let step_size = lr / bias_correction1;
            let scalars = [1.0 - beta1, beta2, 1.0 - beta2, bias_correction2.powf(0.5), eps, -step_size];

            let tensors = [&*param, grad, &state.exp_avg, &state.exp_avg_sq];
            let chunked = param.device() == Device::Cpu && tensors.iter().all(|t| t.is_contiguous());
            if !chunked {
                // A GPU (whose caching allocator makes temporaries cheap, and where each
                // chunk would be a kernel launch more) or unusual strides: whole tensors.
                let scaled = grad.empty_like();
                let mut denom = state.exp_avg_sq.empty_like();
                update(param, grad, &mut state.exp_avg, &mut state.exp_avg_sq, &scaled, &mut denom, weight_decay, scalars);
                return;
            }
            let kind = param.kind();
            let buffers = match scratch.iter_mut().position(|s| s.kind == kind) {
                Some(i) => &mut scratch[i],
                None => {
                    let options = (kind, Device::Cpu);
                    scratch.push(Scratch {
                        kind,
                        scaled: Tensor::empty([CPU_CHUNK], options),
                        denom: Tensor::empty([CPU_CHUNK], options),
                    });
                    scratch.last_mut().expect("just pushed")
                }
            };
            let numel = param.numel() as i64;
            // Flat views sharing storage with the parameter and its state, updated chunk by chunk.
            let [p, g, m, v] = tensors.map(|t| t.view([-1]));
            for start in (0..numel).step_by(CPU_CHUNK as usize) {
                let len = CPU_CHUNK.min(numel - start);
                let slice = |t: &Tensor| t.narrow(0, start, len);
                update(
                    &mut slice(&p),
                    &slice(&g),
                    &mut slice(&m),
                    &mut slice(&v),
                    &buffers.scaled.narrow(0, 0, len),
                    &mut buffers.denom.narrow(0, 0, len),
                    weight_decay,
                    scalars,
                );
            }
        });
        Ok(())
    }

    fn zero_grad(&mut self) {
        self.slots.zero_grad();
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
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
}
