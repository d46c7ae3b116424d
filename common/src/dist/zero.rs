//! ZeRO stage 1 (Rajbhandari et al. 2019): data-parallel replicas that keep only their share of
//! the optimizer state. Every rank holds the whole model and computes whole gradients; then
//!
//! 1. the gradients, read as one flat vector (padded to a multiple of the ranks), are
//!    reduce-scattered (averaged): rank r gets block r of the averaged gradient;
//! 2. rank r updates block r of the parameters (a flat float32 copy it owns) with its optimizer,
//!    whose state therefore covers 1/N of the model;
//! 3. the updated blocks are all-gathered back into every rank's parameters.
//!
//! The same bytes cross the network as with an all-reduce (a reduce-scatter and an all-gather
//! are its two halves); the optimizer state per rank drops from 8Ψ bytes (Adam, float32) to
//! 8Ψ/N. The update is element-wise (Adam, SGD), so it is the unsharded update computed in
//! pieces; layer-wise optimizers (LARS, LAMB) need whole layers and are refused.
//!
//! Checkpoints do not see the sharding: [`Optimizer::gathered_state`] all-gathers each state
//! entry and names it per parameter, as an unsharded optimizer does, and
//! [`Optimizer::load_state_tensors`] takes such a whole state and keeps its block. A run
//! resumes on any number of ranks, with or without ZeRO.
use std::collections::HashMap;

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{ProcessGroup, ReduceOp};
use crate::optim::Optimizer;

/// An optimizer over this rank's block of the flattened parameters (see the module docs).
pub struct ZeroOptimizer<'g> {
    group: &'g ProcessGroup,
    /// The parameters' names (the whole state is saved under them).
    names: Vec<String>,
    params: Vec<Tensor>,
    /// This rank's block of the parameters, float32, a leaf whose `.grad` the inner optimizer reads.
    block: Tensor,
    /// Elements per block: the parameters' total, padded to a multiple of the ranks, over the ranks.
    block_len: i64,
    inner: Box<dyn Optimizer + 'g>,
    /// Resets the whole parameters' gradients to none (LibTorch's `zero_grad(set_to_none)`).
    grad_reset: tch::COptimizer,
}

impl<'g> ZeroOptimizer<'g> {
    /// Shards `params` (in the same order on every rank, with the same values: after the
    /// replicas' initial broadcast) over `group`; `build` makes the optimizer of one block.
    pub fn new(group: &'g ProcessGroup, named: Vec<(String, Tensor)>, build: impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer + 'g>) -> Result<Self> {
        ensure!(!named.is_empty(), "ZeRO: no parameters to shard");
        let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
        let device = params[0].device();
        ensure!(params.iter().all(|p| p.device() == device && p.kind() == Kind::Float), "ZeRO shards float32 parameters on one device");
        let total: i64 = params.iter().map(|p| p.numel() as i64).sum();
        let ranks = group.world_size() as i64;
        let block_len = (total + ranks - 1) / ranks;
        let flat = flatten(&params, block_len * ranks, |p| p.detach());
        let block = flat.narrow(0, block_len * group.rank() as i64, block_len).copy().set_requires_grad(true);
        let inner = build(vec![("zero_block".to_string(), block.shallow_clone())]);
        let mut grad_reset = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)?;
        for p in &params {
            grad_reset.add_parameters(p, 0)?;
        }
        Ok(ZeroOptimizer { group, names, params, block, block_len, inner, grad_reset })
    }


    /// Where this rank's block starts in the flat vector.
    fn block_start(&self) -> i64 {
        self.block_len * self.group.rank() as i64
    }

    /// The flat vector's length: the parameters' total, padded to a multiple of the ranks.
    fn padded_len(&self) -> i64 {
        self.block_len * self.group.world_size() as i64
    }

    /// Copies this rank's share of the parameters into its block (after they were restored or
    /// broadcast: the block must start from the replicas' common parameters).
    fn refresh_block(&self) {
        let flat = flatten(&self.params, self.padded_len(), |p| p.detach());
        tch::no_grad(|| self.block.shallow_clone().copy_(&flat.narrow(0, self.block_start(), self.block_len)));
    }
}

/// The tensors `of(param)` side by side in one flat float32 vector of `len` elements (zeros
/// after them).
fn flatten(params: &[Tensor], len: i64, of: impl Fn(&Tensor) -> Tensor) -> Tensor {
    let device: Device = params[0].device();
    let mut parts: Vec<Tensor> = params.iter().map(|p| of(p).reshape([-1])).collect();
    let used: i64 = parts.iter().map(|t| t.numel() as i64).sum();
    if len > used {
        parts.push(Tensor::zeros([len - used], (Kind::Float, device)));
    }
    Tensor::cat(&parts, 0)
}

impl Optimizer for ZeroOptimizer<'_> {
    /// Reduce-scatters the gradients (averaging them): this rank's block of the average becomes
    /// its block's gradient. A parameter without a gradient counts as zeros.
    fn synchronize(&mut self) -> Result<()> {
        let grads = flatten(&self.params, self.block_len * self.group.world_size() as i64, |p| {
            let g = p.grad();
            if g.defined() { g.detach() } else { p.zeros_like() }
        });
        let mine = self.group.reduce_scatter(&grads, ReduceOp::Average)?;
        crate::torch_ext::set_grad(&self.block, &mine)
    }

    /// Updates this rank's block, then all-gathers the blocks into every rank's parameters.
    fn step(&mut self) -> Result<()> {
        self.inner.step()?;
        let blocks = self.group.all_gather(&self.block.detach())?;
        let flat = Tensor::cat(&blocks, 0);
        tch::no_grad(|| {
            let mut offset = 0;
            for p in &self.params {
                let n = p.numel() as i64;
                p.shallow_clone().copy_(&flat.narrow(0, offset, n).view_as(p));
                offset += n;
            }
        });
        Ok(())
    }

    /// The norm of the averaged gradient from the blocks (disjoint pieces of it: the squares
    /// add up over the replicas, then over the ranks holding the model's other parts), and this
    /// rank's block scaled as the whole would be. Elements of parameters this rank does not count
    /// (a tensor-parallel shard's copy of what shard 0 holds) are left out of its squares.
    fn clip_grad_norm(&mut self, _params: &[Tensor], max_norm: f64, scope: crate::optim::NormScope<'_>) -> Result<f64> {
        let grad = self.block.grad();
        let squares = match scope.counted.iter().any(|counted| !counted) {
            false => grad.square().sum(Kind::Double),
            true => {
                let weights: Vec<Tensor> = self
                    .params
                    .iter()
                    .enumerate()
                    .map(|(i, p)| Tensor::full([p.numel() as i64], f64::from(u8::from(scope.counted.get(i).copied().unwrap_or(true))), (Kind::Float, p.device())))
                    .collect();
                let mask = flatten(&weights, self.padded_len(), |w| w.shallow_clone());
                (grad.square() * mask.narrow(0, self.block_start(), self.block_len)).sum(Kind::Double)
            }
        };
        let mut total = squares.to_device(Device::Cpu).reshape([1]);
        self.group.all_reduce(&mut total, ReduceOp::Sum)?;
        if let Some(model) = scope.model {
            model.all_reduce(&mut total, ReduceOp::Sum)?;
        }
        let total = total.double_value(&[0]).sqrt();
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        tch::no_grad(|| {
            let _ = grad.shallow_clone().g_mul_scalar_(coef);
        });
        Ok(total)
    }

    fn zero_grad(&mut self) {
        self.grad_reset.zero_grad().expect("LibTorch resets the gradients");
        self.inner.zero_grad();
    }

    /// The block's optimizer state and the block itself (ZeRO's float32 copy of its share).
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes() + self.block.numel() * 4
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr)
    }

    /// This rank's block's state, as `<entry>.zero_block` ([`Optimizer::gathered_state`] gives
    /// the whole state under the parameters' names).
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.inner.state_tensors()
    }

    /// All-gathers each entry's blocks and cuts the result into the parameters' shapes, named
    /// `<entry>.<parameter>` as an unsharded optimizer names them; a count (Adam's `step`) is
    /// the same on every rank and given to every parameter.
    fn gathered_state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut whole = Vec::new();
        for (name, block) in self.inner.state_tensors() {
            let entry = name.strip_suffix(".zero_block").unwrap_or(&name).to_string();
            if block.dim() == 0 {
                whole.extend(self.names.iter().map(|p| (format!("{entry}.{p}"), block.copy())));
                continue;
            }
            let flat = Tensor::cat(&self.group.all_gather(&block.detach())?, 0);
            let mut offset = 0;
            for (p, param) in self.names.iter().zip(&self.params) {
                let n = param.numel() as i64;
                whole.push((format!("{entry}.{p}"), flat.narrow(0, offset, n).view_as(param).copy()));
                offset += n;
            }
        }
        Ok(whole)
    }

    fn is_sharded(&self) -> bool {
        true
    }

    /// Takes the whole state (by the parameters' names, as [`Optimizer::gathered_state`] and
    /// an unsharded optimizer write it) and keeps this rank's block of each entry; refreshes the
    /// block of parameters from the (restored) parameters first.
    fn load_state_tensors(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        self.refresh_block();
        let mut entries: Vec<&str> = state.keys().filter_map(|k| k.split_once('.').map(|(e, _)| e)).collect();
        entries.sort_unstable();
        entries.dedup();
        let mut blocks = HashMap::new();
        let mut used = 0;
        for entry in entries {
            let per_param: Vec<Option<&Tensor>> = self.names.iter().map(|p| state.get(&format!("{entry}.{p}"))).collect();
            let present: Vec<&Tensor> = per_param.iter().flatten().copied().collect();
            if present.is_empty() {
                continue;
            }
            ensure!(present.len() == self.names.len(), "ZeRO: the state's `{entry}` covers {} of the {} parameters", present.len(), self.names.len());
            used += present.len();
            let block = if present[0].dim() == 0 {
                present[0].copy()
            } else {
                for (p, (t, param)) in self.names.iter().zip(present.iter().zip(&self.params)) {
                    ensure!(t.size() == param.size(), "ZeRO: `{entry}.{p}` is {:?}, the parameter {:?}", t.size(), param.size());
                }
                let device = self.block.device();
                let moved: Vec<Tensor> = present.iter().map(|t| t.to_device(device).to_kind(Kind::Float)).collect();
                flatten(&moved, self.padded_len(), |t| t.shallow_clone()).narrow(0, self.block_start(), self.block_len).copy()
            };
            blocks.insert(format!("{entry}.zero_block"), block);
        }
        ensure!(used == state.len(), "ZeRO: {} state tensors belong to no parameter of this model", state.len() - used);
        self.inner.load_state_tensors(&blocks)
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}
