//! Adam (Kingma & Ba), as `torch.optim.Adam` computes it without `amsgrad`, `maximize`,
//! `capturable` or decoupled weight decay.

use std::collections::HashMap;

use anyhow::Result;
use tch::Tensor;

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
        }
    }

    /// The hyper-parameters (with the current learning rate).
    pub fn config(&self) -> &AdamConfig {
        &self.config
    }
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        let AdamConfig {
            lr,
            betas: (beta1, beta2),
            eps,
            weight_decay,
        } = self.config;
        self.slots.update_each(|param, grad, state| {
            let state = state.get_or_insert_with(|| AdamState {
                step: 0,
                exp_avg: param.zeros_like(),
                exp_avg_sq: param.zeros_like(),
            });
            state.step += 1;
            let decayed;
            let grad = if weight_decay != 0.0 {
                decayed = add_scaled(grad, param, weight_decay);
                &decayed
            } else {
                grad
            };
            let _ = state.exp_avg.lerp_(grad, 1.0 - beta1);
            // torch: `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`. tch's
            // `addcmul_` has no `value`; the kernel computes `self + (value * t1) * t2`, so
            // passing `t1 = grad * value` (and value 1) gives the same roundings.
            let _ = state
                .exp_avg_sq
                .g_mul_scalar_(beta2)
                .addcmul_(&(grad * (1.0 - beta2)), grad);

            // The bias corrections are Python floats in torch (`beta ** step` with a float
            // step); `powf` is the same C `pow`, and `** 0.5` is `pow` too, not `sqrt`.
            let step = state.step as f64;
            let bias_correction1 = 1.0 - beta1.powf(step);
            let bias_correction2 = 1.0 - beta2.powf(step);
            let step_size = lr / bias_correction1;
            let mut denom = state.exp_avg_sq.sqrt() / bias_correction2.powf(0.5);
            let _ = denom.g_add_scalar_(eps);
            // torch: `param.addcdiv_(exp_avg, denom, value=-step_size)`, i.e.
            // `param + (value * exp_avg) / denom`; again the value moves into the first factor.
            let _ = param.addcdiv_(&(&state.exp_avg * -step_size), &denom);
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
