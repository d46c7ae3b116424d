//! LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
//! minutes", Algorithm 2): Adam's bias-corrected moments, then a layer-wise trust ratio. Each
//! parameter's update `r = m̂ / (√v̂ + ε) + λ·w` (decoupled weight decay) is scaled by
//! `‖w‖ / ‖r‖` (1 where either norm is 0) before `w ← w − lr · ratio · r`: every layer moves by
//! the same share of its own size, whatever the scale of its gradients.
//!
//! One-dimensional parameters (biases, norms) can be left out of the trust ratio and the decay,
//! as BERT's recipe does. The arithmetic runs on the device.
use std::collections::HashMap;

use anyhow::Result;
use tch::Tensor;

use super::{add_scaled, add_scaled_, EntryKind, Optimizer, ParamState, Slots};

/// LAMB's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LambConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    /// The paper's ε (1e-6, as NVIDIA's LAMB).
    pub eps: f64,
    /// λ, decoupled: added to the update, not the gradient.
    pub weight_decay: f64,
    /// Leave one-dimensional parameters (biases, norms) out of the trust ratio and the decay.
    pub skip_1d: bool,
}

impl Default for LambConfig {
    fn default() -> Self {
        LambConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-6, weight_decay: 0.0, skip_1d: true }
    }
}

/// LAMB over named parameters, with saveable state (Adam's).
pub struct Lamb {
    slots: Slots<LambState>,
    config: LambConfig,
}

/// Adam's moments and step count per parameter.
struct LambState {
    step: i64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl ParamState for LambState {
    const ENTRIES: &'static [(&'static str, EntryKind)] =
        &[("step", EntryKind::Count), ("exp_avg", EntryKind::LikeParam), ("exp_avg_sq", EntryKind::LikeParam)];

    fn to_tensors(&self) -> Vec<Tensor> {
        vec![Tensor::from(self.step), self.exp_avg.shallow_clone(), self.exp_avg_sq.shallow_clone()]
    }

    fn from_tensors(tensors: Vec<Tensor>) -> Self {
        let [step, exp_avg, exp_avg_sq]: [Tensor; 3] = tensors.try_into().expect("one tensor per entry");
        LambState { step: step.int64_value(&[]), exp_avg, exp_avg_sq }
    }
}

impl Lamb {
    pub fn new(params: Vec<(String, Tensor)>, config: LambConfig) -> Self {
        Lamb { slots: Slots::new(params), config }
    }
}

impl Optimizer for Lamb {
    fn step(&mut self) -> Result<()> {
        let LambConfig { lr, betas: (beta1, beta2), eps, weight_decay, skip_1d } = self.config;
        self.slots.update_each(|param, grad, state| {
            let state = state.get_or_insert_with(|| LambState { step: 0, exp_avg: param.zeros_like(), exp_avg_sq: param.zeros_like() });
            state.step += 1;
            let _ = state.exp_avg.g_mul_scalar_(beta1);
            add_scaled_(&mut state.exp_avg, grad, 1.0 - beta1);
            let _ = state.exp_avg_sq.g_mul_scalar_(beta2);
            let _ = state.exp_avg_sq.addcmul_(grad, &(grad * (1.0 - beta2)));
            let m_hat = &state.exp_avg / (1.0 - beta1.powi(state.step as i32));
            let v_hat = &state.exp_avg_sq / (1.0 - beta2.powi(state.step as i32));
            let adam = m_hat / (v_hat.sqrt() + eps);
            let adapt = !(skip_1d && param.dim() <= 1);
            let update = if adapt && weight_decay != 0.0 { add_scaled(&adam, param, weight_decay) } else { adam };
            let update = if adapt {
                let (w_norm, r_norm) = (param.norm(), update.norm());
                let usable = w_norm.gt(0.0).logical_and(&r_norm.gt(0.0));
                let ratio = (&w_norm / &r_norm).where_self(&usable, &w_norm.ones_like());
                update * ratio.to_kind(param.kind())
            } else {
                update
            };
            add_scaled_(param, &update, -lr);
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
        "lamb"
    }
}
