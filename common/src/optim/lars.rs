//! LARS (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks"), in
//! NVIDIA Apex's `LARC` form around SGD with momentum: each parameter's gradient (with its L2
//! weight decay) is scaled by its own trust ratio
//! `η · ‖w‖ / (‖g‖ + λ‖w‖ + ε)`, in "clip" mode capped so that the parameter's rate never exceeds
//! the global one (`min(ratio / lr, 1)`), before the momentum step. Layers whose gradients are
//! large against their weights move less: the course's answer to large batches' unstable start.
//!
//! As in large-batch practice (Goyal et al., MLPerf's LARS), one-dimensional parameters (biases,
//! batch-norm scales and shifts) can be left out of the trust ratio and the weight decay.
//! The arithmetic runs on the device (no host synchronisation per parameter).
use std::collections::HashMap;

use anyhow::Result;
use tch::Tensor;

use super::{add_scaled, add_scaled_, EntryKind, Optimizer, ParamState, Slots};

/// LARS's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LarsConfig {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
    /// η, the trust coefficient (Apex LARC's default 0.02).
    pub trust_coefficient: f64,
    pub eps: f64,
    /// LARC's clip mode: a parameter's rate is at most the global learning rate.
    pub clip: bool,
    /// Leave one-dimensional parameters (biases, norms) out of the trust ratio and the decay.
    pub skip_1d: bool,
}

impl Default for LarsConfig {
    fn default() -> Self {
        LarsConfig { lr: 0.1, momentum: 0.9, weight_decay: 0.0, trust_coefficient: 0.02, eps: 1e-8, clip: true, skip_1d: true }
    }
}

/// LARS over named parameters, with saveable state (SGD's momentum buffers).
pub struct Lars {
    slots: Slots<MomentumState>,
    config: LarsConfig,
}

/// A momentum buffer per parameter, as `torch.optim.SGD` keeps it.
struct MomentumState {
    momentum_buffer: Tensor,
}

impl ParamState for MomentumState {
    const ENTRIES: &'static [(&'static str, EntryKind)] = &[("momentum_buffer", EntryKind::LikeParam)];

    fn to_tensors(&self) -> Vec<Tensor> {
        vec![self.momentum_buffer.shallow_clone()]
    }

    fn from_tensors(tensors: Vec<Tensor>) -> Self {
        let [momentum_buffer]: [Tensor; 1] = tensors.try_into().expect("one tensor per entry");
        MomentumState { momentum_buffer }
    }
}

impl Lars {
    pub fn new(params: Vec<(String, Tensor)>, config: LarsConfig) -> Self {
        Lars { slots: Slots::new(params), config }
    }

    /// The trust-ratio-scaled gradient of `param` (weight decay included), as LARC computes it
    /// before the inner SGD step; public for tests and for the curious.
    pub fn adapted_gradient(config: &LarsConfig, param: &Tensor, grad: &Tensor) -> Tensor {
        tch::no_grad(|| {
            if config.skip_1d && param.dim() <= 1 {
                return grad.shallow_clone();
            }
            let (w_norm, g_norm) = (param.norm(), grad.norm());
            let mut ratio = (&w_norm * config.trust_coefficient) / (&g_norm + &w_norm * config.weight_decay + config.eps);
            if config.clip {
                ratio = (ratio / config.lr).clamp_max(1.0);
            }
            let adapted = add_scaled(grad, param, config.weight_decay) * ratio.to_kind(grad.kind());
            // Apex leaves a parameter whose weight or gradient norm is 0 alone (no decay either).
            let usable = w_norm.gt(0.0).logical_and(&g_norm.gt(0.0));
            adapted.where_self(&usable, grad)
        })
    }
}

impl Optimizer for Lars {
    fn step(&mut self) -> Result<()> {
        let config = self.config;
        self.slots.update_each(|param, grad, state| {
            let grad = Lars::adapted_gradient(&config, param, grad);
            let update = if config.momentum == 0.0 {
                grad
            } else {
                match state {
                    None => state.insert(MomentumState { momentum_buffer: grad.copy() }).momentum_buffer.shallow_clone(),
                    Some(MomentumState { momentum_buffer: buf }) => {
                        let _ = buf.g_mul_scalar_(config.momentum);
                        add_scaled_(buf, &grad, 1.0);
                        buf.shallow_clone()
                    }
                }
            };
            add_scaled_(param, &update, -config.lr);
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
        "lars"
    }
}
