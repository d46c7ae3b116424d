//! ZeRO (Rajbhandari et al. 2019, DeepSpeed's stages; stage 3 is PyTorch's FSDP): data-parallel
//! replicas that each keep only their share of the model state.
//!
//! A rank's parameters are read as flat buckets ([`Buckets`]), each padded to a multiple of the
//! ranks N; rank r owns the r-th 1/N of every bucket, its *block*: a float32 leaf tensor that its
//! optimizer (Adam, SGD: element-wise, so the unsharded update computed in pieces) updates.
//!
//! - **Stage 1** (optimizer state): every rank computes whole gradients; after the backward
//!   passes each bucket is reduce-scattered (averaged) into the ranks' blocks, each rank updates
//!   its block, and the blocks are all-gathered back into every rank's parameters. One bucket:
//!   one reduce-scatter and one all-gather per step, an all-reduce's two halves.
//! - **Stage 2** (and gradients): buckets of `--bucket-mb` in the order gradients arrive
//!   (last layers first); a post-accumulate-grad hook on every parameter reduce-scatters a
//!   bucket as soon as its gradients are complete, *during* the backward pass, adds this rank's
//!   part to its block's gradient and frees the whole gradients. Between steps a rank holds the
//!   whole parameters but only its block's gradient.
//! - **Stage 3** (and parameters, FSDP): the blocks are the parameters. The model runs part by
//!   part (its layers, [`crate::models::PartedModule`]); a part's parameters are all-gathered
//!   just before its forward pass and freed right after it (their storage, as FSDP does, so the
//!   autograd graph's saved references hold nothing either), gathered again when its gradient
//!   arrives in the backward pass, and freed with their gradients once the part's bucket has
//!   been reduce-scattered. Between steps a rank holds 1/N of everything.
//!
//! Layer-wise optimizers (LARS, LAMB) need whole layers and are refused. Checkpoints do not see
//! the sharding: [`Sharded::gathered_state`] all-gathers each state entry and names it per
//! parameter, as an unsharded optimizer does, and [`Optimizer::load_state_tensors`] takes such a
//! whole state and keeps this rank's block. A run resumes on any number of ranks, with or
//! without ZeRO, at any stage.
mod costs;
mod hsdp;
mod strategy;
pub(crate) use hsdp::Hsdp;
pub(crate) use strategy::Zero;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::rc::Rc;

use anyhow::{ensure, Context, Result};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::optim::block::{BlockLayout, Span, BLOCK_NAME};
use crate::optim::{forward_to, Optimizer, Sharded};
use crate::torch_ext;

/// Each of `named`'s parameters' part of the model (stage 3's units), as `part_of` says.
fn parts(named: &[(String, Tensor)], part_of: &dyn Fn(&str) -> Result<usize>) -> Result<Vec<usize>> {
    named.iter().map(|(name, _)| part_of(name)).collect()
}

/// How much of the model state each data-parallel replica keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ZeroStage {
    /// Its share of the optimizer state.
    #[serde(rename = "1")]
    OptimizerState,
    /// ... and of the gradients.
    #[serde(rename = "2")]
    Gradients,
    /// ... and of the parameters.
    #[serde(rename = "3")]
    Parameters,
}

impl ZeroStage {
    /// The stage of `--zero N` (0: no ZeRO).
    pub fn from_flag(n: u8) -> Option<ZeroStage> {
        match n {
            1 => Some(ZeroStage::OptimizerState),
            2 => Some(ZeroStage::Gradients),
            3 => Some(ZeroStage::Parameters),
            _ => None,
        }
    }

    pub fn number(self) -> u8 {
        match self {
            ZeroStage::OptimizerState => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Parameters => 3,
        }
    }
}

/// A rank's parameters as flat buckets, each padded to a multiple of the ranks: rank r owns
/// slice r of every bucket, and its block is its slices side by side.
#[derive(Debug, Clone)]
struct Buckets {
    buckets: Vec<Bucket>,
    /// Elements of a block (every rank's block has as many).
    block_len: i64,
    ranks: i64,
    /// Each parameter's element count.
    sizes: Vec<i64>,
}

#[derive(Debug, Clone)]
struct Bucket {
    /// The parameters in the bucket, in flat order.
    params: Vec<usize>,
    /// Elements of one rank's slice of the bucket (the bucket padded, over the ranks).
    slice: i64,
    /// Where this bucket's slice sits in a block.
    offset: i64,
}

impl Buckets {
    /// Buckets of the parameters `groups` lists (each parameter in exactly one) for `ranks` ranks.
    fn new(sizes: Vec<i64>, groups: Vec<Vec<usize>>, ranks: i64) -> Buckets {
        let mut offset = 0;
        let buckets = groups
            .into_iter()
            .filter(|params| !params.is_empty())
            .map(|params| {
                let len: i64 = params.iter().map(|&p| sizes[p]).sum();
                let slice = (len + ranks - 1) / ranks;
                let bucket = Bucket { params, slice, offset };
                offset += slice;
                bucket
            })
            .collect();
        Buckets { buckets, block_len: offset, ranks, sizes }
    }

    /// Bucket `b` as one flat float32 vector of `slice · ranks` elements: `of(p)` for each of
    /// its parameters (zeros where it gives none), zeros after them.
    fn flat(&self, b: usize, device: Device, of: &dyn Fn(usize) -> Option<Tensor>) -> Tensor {
        let bucket = &self.buckets[b];
        let mut parts: Vec<Tensor> = bucket
            .params
            .iter()
            .map(|&p| of(p).map_or_else(|| Tensor::zeros([self.sizes[p]], (Kind::Float, device)), |t| t.reshape([-1]).to_kind(Kind::Float)))
            .collect();
        let used: i64 = bucket.params.iter().map(|&p| self.sizes[p]).sum();
        let padded = bucket.slice * self.ranks;
        if padded > used {
            parts.push(Tensor::zeros([padded - used], (Kind::Float, device)));
        }
        Tensor::cat(&parts, 0)
    }

    /// Rank `rank`'s block of the per-parameter tensors `of(p)`.
    fn block(&self, rank: i64, device: Device, of: &dyn Fn(usize) -> Option<Tensor>) -> Tensor {
        let slices: Vec<Tensor> =
            (0..self.buckets.len()).map(|b| self.flat(b, device, of).narrow(0, rank * self.buckets[b].slice, self.buckets[b].slice)).collect();
        Tensor::cat(&slices, 0)
    }

    /// Bucket `b`'s parameters, flat, from every rank's slice of it (in rank order).
    fn unslice(&self, b: usize, slices: &[Tensor]) -> Vec<(usize, Tensor)> {
        let flat = Tensor::cat(slices, 0);
        let mut offset = 0;
        self.buckets[b]
            .params
            .iter()
            .map(|&p| {
                let piece = flat.narrow(0, offset, self.sizes[p]);
                offset += self.sizes[p];
                (p, piece)
            })
            .collect()
    }

    /// Where rank `rank`'s block holds each parameter's elements (the parameters its slices of
    /// the buckets overlap), in block order.
    fn spans(&self, rank: i64) -> Vec<Span> {
        let mut spans = Vec::new();
        for bucket in &self.buckets {
            let (slice_start, slice_end) = (rank * bucket.slice, (rank + 1) * bucket.slice);
            let mut at = 0;
            for &param in &bucket.params {
                let (first, end) = (at, at + self.sizes[param]);
                let (lo, hi) = (first.max(slice_start), end.min(slice_end));
                if lo < hi {
                    spans.push(Span { param, start: lo - first, len: hi - lo, offset: bucket.offset + lo - slice_start });
                }
                at = end;
            }
        }
        spans
    }

    /// Every parameter, flat, from all ranks' blocks (in rank order).
    fn unblock(&self, blocks: &[Tensor]) -> Vec<Tensor> {
        let mut whole: Vec<Option<Tensor>> = (0..self.sizes.len()).map(|_| None).collect();
        for (b, bucket) in self.buckets.iter().enumerate() {
            let slices: Vec<Tensor> = blocks.iter().map(|block| block.narrow(0, bucket.offset, bucket.slice)).collect();
            for (p, piece) in self.unslice(b, &slices) {
                whole[p] = Some(piece);
            }
        }
        whole.into_iter().map(|t| t.expect("every parameter is in a bucket")).collect()
    }
}

/// What the gradient hooks of one step have done so far (stages 2 and 3).
#[derive(Default)]
struct Reduction {
    /// Per parameter: its gradient arrived in this backward pass and waits for its bucket.
    ready: Vec<bool>,
    /// This rank's block of the averaged gradient, summed over the step's backward passes.
    grad: Option<Tensor>,
    /// Stage 3: which parts' parameters are gathered now.
    gathered: Vec<bool>,
}

/// A data-parallel replica's share of its model (see the module docs): the buckets, the block
/// and, from stage 2, the hooks that reduce gradients during the backward pass. Shared (`Rc`)
/// by the optimizer that updates the block and, at stage 3, by the step that gathers the
/// parameters part by part.
pub struct Shards<'g> {
    stage: ZeroStage,
    /// The ranks the state is sharded over.
    group: &'g ProcessGroup,
    /// HSDP: the ranks holding the same block in the other shard groups (their block gradients
    /// are averaged with this rank's).
    replicate: Option<&'g ProcessGroup>,
    names: Vec<String>,
    params: Vec<Tensor>,
    buckets: Buckets,
    /// Each parameter's bucket (stage 3: its part).
    bucket_of: Vec<usize>,
    /// This rank's block of the parameters, float32, a leaf whose `.grad` the optimizer reads.
    block: Tensor,
    reduction: RefCell<Reduction>,
    /// Resets the whole parameters' gradients to none (LibTorch's `zero_grad(set_to_none)`).
    grad_reset: RefCell<tch::COptimizer>,
}

impl<'g> Shards<'g> {
    /// Shards `named` (the same parameters in the same order on every replica) over `group` at
    /// `stage`. `parts`: the model's parts by parameter (stage 3's units, and its buckets; none:
    /// one part); `bucket_bytes`: stage 2's bucket size. From stage 2 every parameter gets a
    /// gradient hook; at stage 3 the parameters' memory is freed at once (the block holds them).
    pub fn new(
        stage: ZeroStage,
        group: &'g ProcessGroup,
        named: Vec<(String, Tensor)>,
        parts: Option<Vec<usize>>,
        bucket_bytes: usize,
    ) -> Result<Rc<Shards<'g>>> {
        Self::build(stage, group, None, named, parts, bucket_bytes)
    }

    /// HSDP: stage 3 over `shard` (a shard group of replicas), each block's gradient averaged
    /// with the same block's in the other shard groups (`replicate`) before the update.
    pub fn hybrid(
        shard: &'g ProcessGroup,
        replicate: &'g ProcessGroup,
        named: Vec<(String, Tensor)>,
        parts: Vec<usize>,
        bucket_bytes: usize,
    ) -> Result<Rc<Shards<'g>>> {
        Self::build(ZeroStage::Parameters, shard, Some(replicate), named, Some(parts), bucket_bytes)
    }

    fn build(
        stage: ZeroStage,
        group: &'g ProcessGroup,
        replicate: Option<&'g ProcessGroup>,
        named: Vec<(String, Tensor)>,
        parts: Option<Vec<usize>>,
        bucket_bytes: usize,
    ) -> Result<Rc<Shards<'g>>> {
        ensure!(!named.is_empty(), "ZeRO: no parameters to shard");
        let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
        let device = params[0].device();
        ensure!(params.iter().all(|p| p.device() == device && p.kind() == Kind::Float), "ZeRO shards float32 parameters on one device");
        let sizes: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
        let groups = match stage {
            ZeroStage::OptimizerState => vec![(0..params.len()).collect()],
            // The order gradients arrive in: the last layers' first.
            ZeroStage::Gradients => {
                let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
                let mut bytes = 0;
                for p in (0..params.len()).rev() {
                    if bytes >= bucket_bytes {
                        groups.push(Vec::new());
                        bytes = 0;
                    }
                    groups.last_mut().expect("a bucket").push(p);
                    bytes += sizes[p] as usize * 4;
                }
                groups
            }
            ZeroStage::Parameters => {
                let parts = parts.unwrap_or_else(|| vec![0; params.len()]);
                let count = parts.iter().max().map_or(0, |m| m + 1);
                (0..count).map(|part| (0..params.len()).filter(|&p| parts[p] == part).collect()).collect()
            }
        };
        let buckets = Buckets::new(sizes, groups, group.world_size() as i64);
        let mut bucket_of = vec![0; params.len()];
        for (b, bucket) in buckets.buckets.iter().enumerate() {
            for &p in &bucket.params {
                bucket_of[p] = b;
            }
        }
        let block = buckets.block(group.rank() as i64, device, &|p| Some(params[p].detach())).set_requires_grad(true);
        let mut grad_reset = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)?;
        for p in &params {
            grad_reset.add_parameters(p, 0)?;
        }
        let reduction = Reduction { ready: vec![false; params.len()], grad: None, gathered: vec![true; buckets.buckets.len()] };
        let shards = Rc::new(Shards {
            stage,
            group,
            replicate,
            names,
            params,
            buckets,
            bucket_of,
            block,
            reduction: RefCell::new(reduction),
            grad_reset: RefCell::new(grad_reset),
        });
        if stage != ZeroStage::OptimizerState {
            for (i, p) in shards.params.iter().enumerate() {
                // SAFETY: the context is the shards' address, alive as long as any `Rc` of it;
                // `Drop` removes the hooks before the memory goes.
                unsafe { torch_ext::set_grad_ready_hook(p, grad_ready, Rc::as_ptr(&shards) as *mut c_void, i as i64)? };
            }
        }
        if stage == ZeroStage::Parameters {
            shards.free_all()?;
        }
        Ok(shards)
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The hooks' work: parameter `p`'s gradient is complete for this backward pass; once its
    /// whole bucket is, the bucket is reduced. (A parameter whose gradient arrives twice before
    /// its bucket completed, a bucket some of whose parameters got none, is reduced as it is.)
    fn grad_ready(&self, p: usize) -> Result<()> {
        let b = self.bucket_of[p];
        if self.reduction.borrow().ready[p] {
            self.reduce_bucket(b)?;
        }
        let complete = {
            let mut reduction = self.reduction.borrow_mut();
            reduction.ready[p] = true;
            self.buckets.buckets[b].params.iter().all(|&q| reduction.ready[q])
        };
        if complete {
            self.reduce_bucket(b)?;
        }
        Ok(())
    }

    /// Reduce-scatters bucket `b`'s gradients (averaged over the replicas; zeros where a
    /// parameter has none) and adds this rank's slice to its block's gradient. From stage 2 the
    /// whole gradients are freed; at stage 3 the part's parameters too (its backward is done).
    fn reduce_bucket(&self, b: usize) -> Result<()> {
        let device = self.block.device();
        let flat = self.buckets.flat(b, device, &|p| {
            let g = self.params[p].grad();
            g.defined().then(|| g.detach())
        });
        let mine = self.group.reduce_scatter(&flat, ReduceOp::Average)?;
        let bucket = &self.buckets.buckets[b];
        {
            let mut reduction = self.reduction.borrow_mut();
            let grad = reduction.grad.get_or_insert_with(|| Tensor::zeros([self.buckets.block_len], (Kind::Float, device)));
            let _ = tch::no_grad(|| grad.narrow(0, bucket.offset, bucket.slice).g_add_(&mine));
            for &p in &bucket.params {
                reduction.ready[p] = false;
            }
        }
        if self.stage != ZeroStage::OptimizerState {
            for &p in &bucket.params {
                torch_ext::clear_grad(&self.params[p])?;
            }
        }
        if self.stage == ZeroStage::Parameters {
            self.free(b)?;
        }
        Ok(())
    }

    /// Makes this rank's block gradient final for the step: stage 1 reduces every bucket now,
    /// stages 2 and 3 the buckets whose gradients arrived only in part.
    fn synchronize(&self) -> Result<()> {
        for b in 0..self.buckets.buckets.len() {
            let pending = match self.stage {
                ZeroStage::OptimizerState => true,
                _ => self.buckets.buckets[b].params.iter().any(|&p| self.reduction.borrow().ready[p]),
            };
            if pending {
                self.reduce_bucket(b)?;
            }
        }
        let mut grad = self.reduction.borrow_mut().grad.take().unwrap_or_else(|| self.block.zeros_like());
        if let Some(replicate) = self.replicate {
            // HSDP: the shard group's average, averaged over the groups: the whole average.
            replicate.all_reduce(&mut grad, ReduceOp::Average)?;
        }
        torch_ext::set_grad(&self.block, &grad)
    }

    /// Forgets the step's gradients (the whole ones, and the block's sum).
    fn zero_grad(&self) {
        self.grad_reset.borrow_mut().zero_grad().expect("LibTorch resets the gradients");
        let mut reduction = self.reduction.borrow_mut();
        reduction.grad = None;
        reduction.ready.iter_mut().for_each(|r| *r = false);
    }

    /// Stages 1 and 2, after the optimizer updated the block: every rank's parameters from all
    /// blocks (one all-gather). Stage 3 gathers part by part when a part runs.
    fn publish(&self) -> Result<()> {
        if self.stage == ZeroStage::Parameters {
            return Ok(());
        }
        let blocks = self.group.all_gather(&self.block.detach())?;
        tch::no_grad(|| {
            for (p, whole) in self.buckets.unblock(&blocks).into_iter().enumerate() {
                self.params[p].shallow_clone().copy_(&whole.view_as(&self.params[p]));
            }
        });
        Ok(())
    }

    /// Stage 3: part `b`'s parameters from every rank's block (an all-gather), unless they are
    /// there already.
    pub fn gather(&self, b: usize) -> Result<()> {
        if self.reduction.borrow().gathered[b] {
            return Ok(());
        }
        let bucket = &self.buckets.buckets[b];
        let slices = self.group.all_gather(&self.block.detach().narrow(0, bucket.offset, bucket.slice).contiguous())?;
        for (p, whole) in self.buckets.unslice(b, &slices) {
            torch_ext::fill_storage(&self.params[p], &whole.view_as(&self.params[p]))?;
        }
        self.reduction.borrow_mut().gathered[b] = true;
        Ok(())
    }

    /// Stage 3: frees part `b`'s parameters (their storage; shapes stay).
    pub fn free(&self, b: usize) -> Result<()> {
        if self.stage != ZeroStage::Parameters || !self.reduction.borrow().gathered[b] {
            return Ok(());
        }
        for &p in &self.buckets.buckets[b].params {
            torch_ext::free_storage(&self.params[p])?;
        }
        self.reduction.borrow_mut().gathered[b] = false;
        Ok(())
    }

    /// Stage 3: every part's parameters (to read or write them whole: checkpoints, checks).
    pub fn gather_all(&self) -> Result<()> {
        (0..self.buckets.buckets.len()).try_for_each(|b| self.gather(b))
    }

    /// Stage 3: frees every part's parameters.
    pub fn free_all(&self) -> Result<()> {
        (0..self.buckets.buckets.len()).try_for_each(|b| self.free(b))
    }

    /// Runs part `part` of the model (`run`) with its parameters gathered, frees them after, and
    /// has them gathered again when the part's gradient arrives in the backward pass.
    pub fn around(self: &Rc<Self>, part: usize, run: &dyn Fn() -> Tensor) -> Result<Tensor> {
        self.gather(part)?;
        let output = run();
        self.free(part)?;
        if !output.requires_grad() {
            return Ok(output);
        }
        // SAFETY: the context is the shards' address, alive while the step holds its `Rc`,
        // which it does for as long as it runs backward passes.
        unsafe { torch_ext::notify_in_backward(&output, gather_for_backward, Rc::as_ptr(self) as *mut c_void, part as i64) }
    }

    /// Which parameters' elements this rank's block holds.
    pub fn layout(&self) -> BlockLayout {
        let params = self.names.iter().zip(&self.params).map(|(n, p)| (n.clone(), p.size())).collect();
        BlockLayout { params, spans: self.buckets.spans(self.group.rank() as i64), len: self.buckets.block_len }
    }

    /// Whether checkpoints take this rank's block: every rank's but where other shard groups
    /// hold copies of it (HSDP), the first group's.
    pub fn writes_block(&self) -> bool {
        self.replicate.is_none_or(|group| group.rank() == 0)
    }

    /// This rank's block of the parameters (stage 3: the parameters themselves).
    pub fn block(&self) -> Tensor {
        self.block.detach()
    }

    /// Stage 3: this rank's share of the parameters from `block` (read from a checkpoint); the
    /// parts are gathered from the blocks when next run.
    pub fn load_block(&self, block: &Tensor) -> Result<()> {
        ensure!(block.size() == self.block.size(), "ZeRO: a block of {:?} elements for one of {:?}", block.size(), self.block.size());
        self.free_all()?;
        tch::no_grad(|| self.block.shallow_clone().copy_(block));
        Ok(())
    }

    /// Copies this rank's share of the (whole, restored or broadcast) parameters into its block.
    pub fn refresh_block(&self) {
        let fresh = self.buckets.block(self.group.rank() as i64, self.block.device(), &|p| Some(self.params[p].detach()));
        tch::no_grad(|| self.block.shallow_clone().copy_(&fresh));
    }

    /// Bytes of this rank's share: the block and, from stage 2, its gradient.
    fn held_bytes(&self) -> (usize, usize) {
        let block = self.block.numel() * 4;
        let grad = self.block.grad();
        (block, if self.stage != ZeroStage::OptimizerState && grad.defined() { grad.numel() * 4 } else { 0 })
    }
}

impl Drop for Shards<'_> {
    fn drop(&mut self) {
        if self.stage != ZeroStage::OptimizerState {
            for p in &self.params {
                let _ = torch_ext::clear_grad_ready_hook(p);
            }
        }
    }
}

/// The hooks' callback: `context` is a [`Shards`], `index` the parameter whose gradient is ready.
unsafe extern "C" fn grad_ready(context: *mut c_void, index: i64, message: *mut u8, size: usize) -> i32 {
    callback(context, message, size, |shards| shards.grad_ready(index as usize).context("ZeRO's gradient reduction"))
}

/// The backward notification's callback: gather part `index` for its backward pass.
unsafe extern "C" fn gather_for_backward(context: *mut c_void, index: i64, message: *mut u8, size: usize) -> i32 {
    callback(context, message, size, |shards| shards.gather(index as usize).context("ZeRO-3's gathering of a part for its backward pass"))
}

/// Runs `work` on the [`Shards`] at `context`, turning an error or a panic into the shim's
/// message.
unsafe fn callback(context: *mut c_void, message: *mut u8, size: usize, work: impl FnOnce(&Shards) -> Result<()>) -> i32 {
    // SAFETY: the shim passes back the context it was given: a live `Shards` (see `Shards::new`).
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&*(context as *const Shards))));
    let error = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(err)) => format!("{err:#}"),
        Err(_) => "ZeRO: a callback panicked".to_string(),
    };
    torch_ext::report_callback_error(&error, message, size)
}

/// [`BLOCK_NAME`] as the end of a state entry's name.
const BLOCK_SUFFIX: &str = ".zero_block";

/// An optimizer over this rank's block of a model's parameters (see the module docs).
pub struct ZeroOptimizer<'g> {
    shards: Rc<Shards<'g>>,
    inner: Box<dyn Optimizer + 'g>,
}

impl<'g> ZeroOptimizer<'g> {
    /// Stage 1 over `named` (in the same order on every rank, with the same values: after the
    /// replicas' initial broadcast); `build` makes the optimizer of one block.
    pub fn new(group: &'g ProcessGroup, named: Vec<(String, Tensor)>, build: impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer + 'g>) -> Result<Self> {
        Ok(Self::over(Shards::new(ZeroStage::OptimizerState, group, named, None, 0)?, build))
    }

    /// The optimizer of `shards`' block.
    pub fn over(shards: Rc<Shards<'g>>, build: impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer + 'g>) -> Self {
        let inner = build(vec![(BLOCK_NAME.to_string(), shards.block.shallow_clone())]);
        ZeroOptimizer { shards, inner }
    }
}

impl Optimizer for ZeroOptimizer<'_> {
    /// This rank's block of the averaged gradient becomes its block's gradient.
    fn synchronize(&mut self) -> Result<()> {
        self.shards.synchronize()
    }

    /// Updates this rank's block, then (stages 1 and 2) all-gathers the blocks into every
    /// rank's parameters.
    fn step(&mut self) -> Result<()> {
        self.inner.step()?;
        self.shards.publish()
    }

    /// The norm of the averaged gradient from the blocks (disjoint pieces of it: the squares
    /// add up over the replicas, then over the ranks holding the model's other parts), and this
    /// rank's block scaled as the whole would be. Elements of parameters this rank does not count
    /// (a tensor-parallel shard's copy of what shard 0 holds) are left out of its squares.
    fn clip_grad_norm(&mut self, _params: &[Tensor], max_norm: f64, scope: crate::optim::NormScope<'_>) -> Result<f64> {
        let shards = &self.shards;
        let grad = shards.block.grad();
        let squares = match scope.counted.iter().any(|counted| !counted) {
            false => grad.square().sum(Kind::Double),
            true => {
                let counted = |p: usize| scope.counted.get(p).copied().unwrap_or(true);
                let mask = shards.buckets.block(shards.group.rank() as i64, grad.device(), &|p| {
                    Some(Tensor::full([shards.buckets.sizes[p]], f64::from(u8::from(counted(p))), (Kind::Float, grad.device())))
                });
                (grad.square() * mask).sum(Kind::Double)
            }
        };
        let mut total = squares.to_device(Device::Cpu).reshape([1]);
        shards.group.all_reduce(&mut total, ReduceOp::Sum)?;
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
        self.shards.zero_grad();
        self.inner.zero_grad();
    }

    /// The block's optimizer state and the block itself (ZeRO's float32 copy of its share).
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes() + self.shards.held_bytes().0
    }

    fn sharded(&self) -> Option<&dyn Sharded> {
        Some(self)
    }

    /// Takes the whole state (by the parameters' names, as [`Sharded::gathered_state`] and
    /// an unsharded optimizer write it) and keeps this rank's block of each entry; refreshes the
    /// block of parameters from the (restored, whole) parameters first.
    ///
    /// Also takes this rank's blocks themselves (`<entry>.zero_block`, as a sharded checkpoint
    /// reads them): the parameters' block is then refreshed only where the parameters are whole
    /// (stages 1 and 2; at stage 3 the block was read already).
    fn load_state_tensors(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let shards = &self.shards;
        if !state.is_empty() && state.keys().all(|k| k.ends_with(BLOCK_SUFFIX)) {
            if shards.stage != ZeroStage::Parameters {
                shards.refresh_block();
            }
            return self.inner.load_state_tensors(state);
        }
        shards.refresh_block();
        let mut entries: Vec<&str> = state.keys().filter_map(|k| k.split_once('.').map(|(e, _)| e)).collect();
        entries.sort_unstable();
        entries.dedup();
        let mut blocks = HashMap::new();
        let mut used = 0;
        for entry in entries {
            let present: Vec<&Tensor> = shards.names.iter().filter_map(|p| state.get(&format!("{entry}.{p}"))).collect();
            if present.is_empty() {
                continue;
            }
            ensure!(present.len() == shards.names.len(), "ZeRO: the state's `{entry}` covers {} of the {} parameters", present.len(), shards.names.len());
            used += present.len();
            let block = if present[0].dim() == 0 {
                present[0].copy()
            } else {
                for (p, (t, param)) in shards.names.iter().zip(present.iter().zip(&shards.params)) {
                    ensure!(t.size() == param.size(), "ZeRO: `{entry}.{p}` is {:?}, the parameter {:?}", t.size(), param.size());
                }
                shards.buckets.block(shards.group.rank() as i64, shards.block.device(), &|p| Some(present[p].to_device(shards.block.device())))
            };
            blocks.insert(format!("{entry}.{BLOCK_NAME}"), block);
        }
        ensure!(used == state.len(), "ZeRO: {} state tensors belong to no parameter of this model", state.len() - used);
        self.inner.load_state_tensors(&blocks)
    }

    // `state_tensors`: this rank's block's state, as `<entry>.zero_block`
    // ([`Sharded::gathered_state`] gives the whole state under the parameters' names).
    forward_to!(inner: lr, set_lr, state_tensors, name);
}

impl Sharded for ZeroOptimizer<'_> {
    /// All-gathers each entry's blocks and cuts the result into the parameters' shapes, named
    /// `<entry>.<parameter>` as an unsharded optimizer names them; a count (Adam's `step`) is
    /// the same on every rank and given to every parameter.
    fn gathered_state(&self) -> Result<Vec<(String, Tensor)>> {
        let shards = &self.shards;
        let mut whole = Vec::new();
        for (name, block) in self.inner.state_tensors() {
            let entry = name.strip_suffix(BLOCK_SUFFIX).unwrap_or(&name).to_string();
            if block.dim() == 0 {
                whole.extend(shards.names.iter().map(|p| (format!("{entry}.{p}"), block.copy())));
                continue;
            }
            let blocks = shards.group.all_gather(&block.detach())?;
            for ((p, param), flat) in shards.names.iter().zip(&shards.params).zip(shards.buckets.unblock(&blocks)) {
                whole.push((format!("{entry}.{p}"), flat.view(param.size().as_slice()).copy()));
            }
        }
        Ok(whole)
    }

    fn block_layout(&self) -> Option<BlockLayout> {
        Some(self.shards.layout())
    }

    fn writes_block(&self) -> bool {
        self.shards.writes_block()
    }

    fn shard_count(&self) -> usize {
        self.shards.group.world_size()
    }

    /// From stage 2, the block's gradient (the whole gradients are freed).
    fn sharded_gradient_bytes(&self) -> usize {
        self.shards.held_bytes().1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_owns_its_slice_of_every_bucket_and_the_blocks_give_the_whole_back() {
        // Sizes 3, 5, 2 in buckets {2, 0} and {1}, over 2 ranks: the first bucket holds 5
        // elements padded to 6 (slices of 3), the second 5 padded to 6.
        let buckets = Buckets::new(vec![3, 5, 2], vec![vec![2, 0], vec![1]], 2);
        assert_eq!(buckets.block_len, 6);
        let params: Vec<Tensor> = [3i64, 5, 2].iter().enumerate().map(|(i, &n)| Tensor::arange(n, (Kind::Float, Device::Cpu)) + 10.0 * i as f64).collect();
        let blocks: Vec<Tensor> = (0..2).map(|r| buckets.block(r, Device::Cpu, &|p| Some(params[p].shallow_clone()))).collect();
        // Rank 0: param 2 (20, 21) and param 0's first element; then param 1's first three.
        assert_eq!(Vec::<f32>::try_from(&blocks[0]).unwrap(), vec![20.0, 21.0, 0.0, 10.0, 11.0, 12.0]);
        assert_eq!(Vec::<f32>::try_from(&blocks[1]).unwrap(), vec![1.0, 2.0, 0.0, 13.0, 14.0, 0.0]);
        for (whole, param) in buckets.unblock(&blocks).iter().zip(&params) {
            assert!(whole.equal(param));
        }
        // The spans say where each rank's block holds which elements: every element of every
        // parameter once, over the ranks.
        let mut held = vec![0; 3];
        for (rank, block) in blocks.iter().enumerate() {
            for span in buckets.spans(rank as i64) {
                let elements = params[span.param].narrow(0, span.start, span.len);
                assert!(block.narrow(0, span.offset, span.len).equal(&elements), "rank {rank}: {span:?}");
                held[span.param] += span.len;
            }
        }
        assert_eq!(held, vec![3, 5, 2]);
        assert_eq!(buckets.spans(1)[0], Span { param: 0, start: 1, len: 2, offset: 0 });
        assert_eq!(ZeroStage::from_flag(2).map(ZeroStage::number), Some(2));
        assert_eq!(ZeroStage::from_flag(0), None);
    }
}
