//! Stochastic gradient descent with optional momentum, dampening, Nesterov momentum and L2
//! weight decay, as `torch.optim.SGD` computes it (without `maximize`).

use std::collections::HashMap;

use anyhow::Result;
use tch::Tensor;

use super::{add_scaled, add_scaled_, DeviceLr, EntryKind, Optimizer, ParamState, Slots};

/// SGD's hyper-parameters. torch has no default learning rate; [`Default`] picks 0.01 and
/// otherwise torch's defaults (no momentum, dampening or weight decay), so momentum must be
/// asked for explicitly, e.g. `SgdConfig { momentum: 0.9, ..Default::default() }`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables momentum and its state).
    pub momentum: f64,
    /// Dampening of the gradient added to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient (`grad + weight_decay * param`).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// LibTorch's multi-tensor kernel (`torch.optim.SGD(fused=True)`, `_fused_sgd_`). `None`:
    /// on CUDA parameters.
    #[serde(default)]
    pub fused: Option<bool>,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 0.01, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false, fused: None }
    }
}

/// `torch.optim.SGD` over named parameters, with saveable state.
pub struct Sgd {
    slots: Slots<SgdState>,
    config: SgdConfig,
    /// The fused kernel's learning rate (a device tensor once capturable).
    lr_device: DeviceLr,
}

/// What SGD keeps per parameter: torch's `state[p]["momentum_buffer"]` (only with momentum).
struct SgdState {
    momentum_buffer: Tensor,
}

impl ParamState for SgdState {
    const ENTRIES: &'static [(&'static str, EntryKind)] = &[("momentum_buffer", EntryKind::LikeParam)];

    fn to_tensors(&self) -> Vec<Tensor> {
        vec![self.momentum_buffer.shallow_clone()]
    }

    fn from_tensors(tensors: Vec<Tensor>) -> Self {
        let [momentum_buffer]: [Tensor; 1] = tensors.try_into().expect("one tensor per entry");
        SgdState { momentum_buffer }
    }
}

impl Sgd {
    /// An SGD optimizer over `params` (shallow clones of the model's variables, updated in
    /// place), named so that their state can be saved.
    ///
    /// # Panics
    /// On a configuration torch rejects (negative `lr`, `momentum` or `weight_decay`; Nesterov
    /// without momentum or with dampening), or on two parameters with the same name.
    pub fn new(params: Vec<(String, Tensor)>, config: SgdConfig) -> Self {
        let SgdConfig { lr, momentum, dampening, weight_decay, nesterov, .. } = config;
        assert!(lr >= 0.0, "SGD: invalid learning rate {lr}");
        assert!(momentum >= 0.0, "SGD: invalid momentum {momentum}");
        assert!(weight_decay >= 0.0, "SGD: invalid weight decay {weight_decay}");
        assert!(!nesterov || (momentum > 0.0 && dampening == 0.0), "SGD: Nesterov momentum requires a momentum and zero dampening");
        Sgd { slots: Slots::new(params), config, lr_device: DeviceLr::default() }
    }

    /// The hyper-parameters (with the current learning rate).
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }
}

/// Parameters the fused kernel takes in one call: same device, same kind, and whether their
/// momentum buffers are new.
type FusedKey = (tch::Device, tch::Kind, bool);

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let SgdConfig { lr, momentum, dampening, weight_decay, nesterov, fused } = self.config;
        // Parameters for LibTorch's fused kernel, by device, kind and whether their momentum
        // buffers are new (the kernel then starts them at the gradient, as torch does).
        let mut groups: Vec<(FusedKey, [Vec<Tensor>; 3])> = Vec::new();
        self.slots.update_each(|param, grad, state| {
            if fused.unwrap_or(param.device().is_cuda()) {
                let first = momentum != 0.0 && state.is_none();
                let buffer = match (momentum, state) {
                    (0.0, _) => param.shallow_clone(), // unused: no momentum, no buffers
                    (_, Some(SgdState { momentum_buffer })) => momentum_buffer.shallow_clone(),
                    (_, state) => state.insert(SgdState { momentum_buffer: param.empty_like() }).momentum_buffer.shallow_clone(),
                };
                let key = (param.device(), param.kind(), first);
                let index = groups.iter().position(|g| g.0 == key).unwrap_or_else(|| {
                    groups.push((key, Default::default()));
                    groups.len() - 1
                });
                for (list, t) in groups[index].1.iter_mut().zip([param.shallow_clone(), grad.shallow_clone(), buffer]) {
                    list.push(t);
                }
                return;
            }
            let mut grad = if weight_decay != 0.0 { add_scaled(grad, param, weight_decay) } else { grad.shallow_clone() };
            if momentum != 0.0 {
                let buf = match state {
                    // torch starts the buffer at the (decayed) gradient itself, undampened.
                    None => &state.insert(SgdState { momentum_buffer: grad.copy() }).momentum_buffer,
                    Some(SgdState { momentum_buffer: buf }) => {
                        let _ = buf.g_mul_scalar_(momentum);
                        add_scaled_(buf, &grad, 1.0 - dampening);
                        buf
                    }
                };
                grad = if nesterov { add_scaled(&grad, buf, momentum) } else { buf.shallow_clone() };
            }
            add_scaled_(param, &grad, -lr);
        });
        tch::no_grad(|| {
            for ((_, _, first), lists) in &groups {
                let [params, grads, buffers] = lists.each_ref().map(|l| l.iter().collect::<Vec<&Tensor>>());
                let lr = self.lr_device.for_device(params[0].device(), lr);
                crate::torch_ext::fused_sgd(&params, &grads, &buffers, weight_decay, momentum, lr, dampening, nesterov, *first)?;
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

    fn make_capturable(&mut self) -> Result<()> {
        anyhow::ensure!(
            self.config.fused != Some(false),
            "--cuda-graph needs SGD's fused kernel (its per-parameter path bakes the learning rate into each launch)"
        );
        self.lr_device.capturable = true;
        Ok(())
    }

    fn name(&self) -> &'static str {
        "sgd"
    }
}
