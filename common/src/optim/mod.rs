//! Optimizers whose state can be saved and restored, matching `torch.optim` numerically.
//!
//! `tch::nn::Optimizer` wraps the C++ optimizers, whose moment estimates and momentum buffers
//! cannot be read or written from Rust, so a checkpointed run could not resume where it stopped.
//! These optimizers keep their state as plain tensors instead ([`Optimizer::state_tensors`],
//! [`Optimizer::load_state_tensors`]) and compute each update with the same ATen operations, in
//! the same order, as the single-tensor (non-foreach, non-fused) code paths of `torch.optim` in
//! PyTorch 2.11. `tests/optim_parity.rs` trains a small network with both and compares: on CPU
//! the losses and weights agree bitwise with `torch.optim.Adam` and `torch.optim.SGD` (the test
//! allows 1e-5 relative, as other CPUs or a GPU may round differently).
//!
//! Like torch, state is created lazily on a parameter's first update and kept per parameter
//! (including Adam's step count), so a restored state continues the exact trajectory.

mod adam;
pub mod block;
mod lamb;
mod lars;
mod sgd;

pub use adam::{Adam, AdamConfig};
pub use lamb::{Lamb, LambConfig};
pub use lars::{Lars, LarsConfig};
pub use sgd::{Sgd, SgdConfig};

use std::collections::{HashMap, HashSet};

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// An optimizer over a fixed list of named parameters. (Not `Send` as a trait: a data-parallel
/// wrapper holds its process group, which must stay on the thread that initialised MPI; ask for
/// `dyn Optimizer + Send` where one has to move between threads.)
pub trait Optimizer {
    /// One update from the parameters' current `.grad()`; parameters without a gradient are
    /// skipped (as torch does). Runs without gradient tracking. Fails only where the step
    /// communicates (a distributed optimizer whose collective fails).
    fn step(&mut self) -> Result<()>;

    /// Makes the gradients final before anything reads them (gradient clipping): a distributed
    /// optimizer averages them over the ranks here, as Horovod's `optimizer.synchronize()`
    /// does, and its next [`Optimizer::step`] does not average again. Nothing to do for a local
    /// optimizer.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    /// Clips the gradients this optimizer will apply to a total 2-norm of at most `max_norm`
    /// (the norm over the model however `scope` says it is spread over ranks) and returns the
    /// norm before clipping. By default the parameters' own gradients; a sharded optimizer
    /// clips the block it updates.
    fn clip_grad_norm(&mut self, params: &[Tensor], max_norm: f64, scope: NormScope<'_>) -> Result<f64> {
        clip_grad_norm_over(params, max_norm, scope)
    }

    /// What only an optimizer whose state is spread over ranks answers (ZeRO); `None` for one
    /// that holds the whole state.
    fn sharded(&self) -> Option<&dyn Sharded> {
        None
    }

    /// Bytes of optimizer state this rank holds (a sharded optimizer: its block's, and the block).
    fn state_bytes(&self) -> usize {
        self.state_tensors().iter().map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }

    /// Drops the gradients (resets them to "none"), as torch's default
    /// `zero_grad(set_to_none=True)` does: the next backward writes fresh gradients instead of
    /// adding to zeroed ones, and a parameter that gets no gradient is skipped by the next step.
    fn zero_grad(&mut self);

    /// The learning rate used by the next [`Optimizer::step`].
    fn lr(&self) -> f64;

    /// Changes the learning rate (what a scheduler does); the state is unaffected.
    fn set_lr(&mut self, lr: f64);

    /// The optimizer's per-parameter state, named `<entry>.<parameter name>`: Adam has
    /// `step.<p>` (a 0-dim int64 tensor), `exp_avg.<p>` and `exp_avg_sq.<p>`; SGD with momentum
    /// has `momentum_buffer.<p>`. Empty before the first step. The tensors are shallow clones of
    /// the live state (copy them, e.g. to the CPU, before the next step if they are kept).
    fn state_tensors(&self) -> Vec<(String, Tensor)>;

    /// Restores what [`Optimizer::state_tensors`] produced, copying each tensor to its
    /// parameter's device and kind. A parameter none of whose entries is present gets no state
    /// (as if it had never been updated). Fails, naming the tensor, on a missing entry of a
    /// parameter that has some, on a tensor that belongs to no parameter or entry, and on a
    /// shape mismatch, so loading the state of another model or optimizer fails clearly. On error
    /// the optimizer is left unchanged.
    fn load_state_tensors(&mut self, state: &HashMap<String, Tensor>) -> Result<()>;

    /// `"adam"` or `"sgd"`, as [`OptimizerKind`] spells it.
    fn name(&self) -> &'static str;

    /// Makes the steps replayable from a CUDA graph (torch's `capturable`): the fused kernels
    /// read the learning rate from a device tensor that [`Optimizer::set_lr`] updates, so a
    /// recorded step follows the schedule. Optimizers that cannot are refused, naming themselves.
    fn make_capturable(&mut self) -> Result<()> {
        bail!("--cuda-graph: the {} optimizer cannot run inside a CUDA graph (use adam or sgd)", self.name())
    }
}

/// An optimizer whose ranks each hold only a share of the state (ZeRO), as
/// [`Optimizer::sharded`] gives it: what checkpoints and memory accounts ask besides stepping.
/// Its [`Optimizer::load_state_tensors`] takes the whole state and keeps its share.
pub trait Sharded {
    /// The state under every parameter's name, as an unsharded optimizer's
    /// [`Optimizer::state_tensors`] names it, gathered from the ranks that share it: a
    /// collective (every rank sharing it calls it). What checkpoints hold, whatever the sharding.
    fn gathered_state(&self) -> Result<Vec<(String, Tensor)>>;

    /// Bytes of gradient this rank holds when the whole gradients are freed (ZeRO-2 and -3: its
    /// block's gradient); 0 otherwise.
    fn sharded_gradient_bytes(&self) -> usize;

    /// ZeRO: which parameters' elements this rank's share of the state holds (its
    /// [`Optimizer::state_tensors`] are then blocks, `<entry>.zero_block`, laid out so); none
    /// where the shares are not blocks (parameter servers).
    fn block_layout(&self) -> Option<block::BlockLayout> {
        None
    }

    /// Whether checkpoints take this rank's block of the state: false where another rank holds
    /// the same block and writes it (HSDP's other shard groups).
    fn writes_block(&self) -> bool {
        true
    }

    /// The ranks the state is divided over (ZeRO's N: the replicas, or HSDP's shard group); 0
    /// where the shares are not blocks of the replicas'.
    fn shard_count(&self) -> usize {
        0
    }

    /// Whether the shares are the data-parallel replicas' own (ZeRO: each replica restores its
    /// share of the whole state); false where the state lives on other ranks (parameter
    /// servers: worker 0 hands it over).
    fn over_replicas(&self) -> bool {
        true
    }
}

/// The whole state of `optimizer` under the parameters' names: gathered over the ranks for a
/// [`Sharded`] one (a collective), its own [`Optimizer::state_tensors`] otherwise.
pub fn gathered_state(optimizer: &dyn Optimizer) -> Result<Vec<(String, Tensor)>> {
    match optimizer.sharded() {
        Some(sharded) => sharded.gathered_state(),
        None => Ok(optimizer.state_tensors()),
    }
}

/// Writes, inside an `impl Optimizer for Wrapper`, the methods named after `$field:` as calls of
/// the same method on `self.$field` (an optimizer the wrapper holds), so that a wrapper states
/// only what it changes. Methods neither written nor listed keep the trait's defaults.
///
/// ```ignore
/// impl Optimizer for Averaging {
///     fn step(&mut self) -> Result<()> { self.average()?; self.inner.step() }
///     forward_to!(inner: zero_grad, lr, set_lr, state_tensors, load_state_tensors, name);
/// }
/// ```
macro_rules! forward_to {
    ($field:ident: $($method:ident),* $(,)?) => { $( $crate::optim::forward_to!(@one $field $method); )* };
    (@one $f:ident step) => { fn step(&mut self) -> anyhow::Result<()> { self.$f.step() } };
    (@one $f:ident synchronize) => { fn synchronize(&mut self) -> anyhow::Result<()> { self.$f.synchronize() } };
    (@one $f:ident clip_grad_norm) => {
        fn clip_grad_norm(&mut self, params: &[tch::Tensor], max_norm: f64, scope: $crate::optim::NormScope<'_>) -> anyhow::Result<f64> {
            self.$f.clip_grad_norm(params, max_norm, scope)
        }
    };
    (@one $f:ident sharded) => { fn sharded(&self) -> Option<&dyn $crate::optim::Sharded> { self.$f.sharded() } };
    (@one $f:ident state_bytes) => { fn state_bytes(&self) -> usize { self.$f.state_bytes() } };
    (@one $f:ident zero_grad) => { fn zero_grad(&mut self) { self.$f.zero_grad() } };
    (@one $f:ident lr) => { fn lr(&self) -> f64 { self.$f.lr() } };
    (@one $f:ident set_lr) => { fn set_lr(&mut self, lr: f64) { self.$f.set_lr(lr) } };
    (@one $f:ident state_tensors) => { fn state_tensors(&self) -> Vec<(String, tch::Tensor)> { self.$f.state_tensors() } };
    (@one $f:ident load_state_tensors) => {
        fn load_state_tensors(&mut self, state: &std::collections::HashMap<String, tch::Tensor>) -> anyhow::Result<()> {
            self.$f.load_state_tensors(state)
        }
    };
    (@one $f:ident name) => { fn name(&self) -> &'static str { self.$f.name() } };
    (@one $f:ident make_capturable) => { fn make_capturable(&mut self) -> anyhow::Result<()> { self.$f.make_capturable() } };
}
pub(crate) use forward_to;

/// The learning rate as the fused kernels read it: a number, or (capturable) 0-dim tensors, one
/// per device, that [`DeviceLr::set`] overwrites in place. float32 on a GPU (what the CUDA
/// kernels read, and what they round a number to); float64 on the CPU, whose kernels read the
/// tensor as a double.
#[derive(Default)]
struct DeviceLr {
    capturable: bool,
    tensors: Vec<Tensor>,
}

impl DeviceLr {
    /// The rate for a kernel on `device`.
    fn for_device(&mut self, device: tch::Device, lr: f64) -> crate::torch_ext::Lr<'_> {
        if !self.capturable {
            return crate::torch_ext::Lr::Value(lr);
        }
        let index = match self.tensors.iter().position(|t| t.device() == device) {
            Some(i) => i,
            None => {
                let kind = if device.is_cuda() { Kind::Float } else { Kind::Double };
                self.tensors.push(Tensor::full([], lr, (kind, device)));
                self.tensors.len() - 1
            }
        };
        crate::torch_ext::Lr::Tensor(&self.tensors[index])
    }

    fn set(&mut self, lr: f64) {
        for t in &mut self.tensors {
            let _ = tch::no_grad(|| t.fill_(lr));
        }
    }
}

/// Which optimizer to train with (a command-line choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// `torch.optim.Adam`
    Adam,
    /// `torch.optim.SGD`
    Sgd,
    /// LARS: SGD with momentum and layer-wise trust ratios (You et al. 2017, Apex `LARC`)
    Lars,
    /// LAMB: Adam with layer-wise trust ratios (You et al. 2019)
    Lamb,
}

impl OptimizerKind {
    /// The name [`Optimizer::name`] returns for this kind.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::Adam => "adam",
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Lars => "lars",
            OptimizerKind::Lamb => "lamb",
        }
    }

    /// This optimizer over `params` with learning rate `lr`, `momentum` (SGD, LARS) and L2
    /// weight decay (decoupled for LAMB), Adam's and SGD's updates by `kernel`, otherwise
    /// torch's (or the paper's) defaults.
    pub fn build(self, params: Vec<(String, Tensor)>, lr: f64, momentum: f64, weight_decay: f64, kernel: OptimizerKernel) -> Box<dyn Optimizer> {
        let fused = kernel.fused();
        match self {
            OptimizerKind::Adam => Box::new(Adam::new(params, AdamConfig { lr, weight_decay, fused, ..AdamConfig::default() })),
            OptimizerKind::Sgd => Box::new(Sgd::new(params, SgdConfig { lr, momentum, weight_decay, fused, ..SgdConfig::default() })),
            OptimizerKind::Lars => Box::new(Lars::new(params, LarsConfig { lr, momentum, weight_decay, ..LarsConfig::default() })),
            OptimizerKind::Lamb => Box::new(Lamb::new(params, LambConfig { lr, weight_decay, ..LambConfig::default() })),
        }
    }
}

/// An optimizer as the recipe and flags choose it, before it has parameters: what
/// [`OptimizerKind::build`] makes here, or what a parameter server makes on its side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerSpec {
    pub kind: OptimizerKind,
    pub lr: f64,
    /// SGD's and LARS's.
    pub momentum: f64,
    pub weight_decay: f64,
    pub kernel: OptimizerKernel,
}

impl OptimizerSpec {
    /// This optimizer over `params` ([`OptimizerKind::build`]).
    pub fn build(self, params: Vec<(String, Tensor)>) -> Box<dyn Optimizer> {
        self.kind.build(params, self.lr, self.momentum, self.weight_decay, self.kernel)
    }
}

/// `--optimizer-kernel`: how Adam and SGD update the parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKernel {
    /// LibTorch's fused multi-tensor kernel on a GPU, one update per parameter on the CPU.
    #[default]
    Auto,
    /// LibTorch's fused multi-tensor kernel (`torch.optim.Adam(fused=True)`) wherever it runs.
    Fused,
    /// One update per parameter (`torch.optim.Adam(fused=False, foreach=False)`).
    PerParameter,
}

impl OptimizerKernel {
    /// The optimizers' `fused` setting (`None`: by device).
    pub fn fused(self) -> Option<bool> {
        match self {
            OptimizerKernel::Auto => None,
            OptimizerKernel::Fused => Some(true),
            OptimizerKernel::PerParameter => Some(false),
        }
    }
}

impl std::fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Scales the gradients of `params` in place so that their total 2-norm is at most `max_norm`,
/// and returns the total norm before clipping, as `torch.nn.utils.clip_grad_norm_` does (with
/// `norm_type=2`): the norm of the per-gradient norms, a clip coefficient
/// `max_norm / (total + 1e-6)` clamped to 1, every gradient multiplied by it. Parameters without
/// a gradient are ignored; with none at all the result is 0. A non-finite norm is returned, not
/// an error (torch's default `error_if_nonfinite=False`).
///
/// On one CUDA device it is torch's computation, bitwise. Elsewhere (the CPU, a model spread over
/// devices) the norm is the squares' sum accumulated in float64 ([`sum_of_squares`]), not
/// torch's: its CPU 2-norm comes out short by up to a few 1e-4 on large gradients, which would
/// clip by a coefficient that much too large, and by another one where the same gradients are
/// cut into tensor-parallel shards.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> f64 {
    tch::no_grad(|| {
        let grads: Vec<Tensor> = params.iter().map(Tensor::grad).filter(Tensor::defined).collect();
        let Some(first) = grads.first() else {
            return 0.0;
        };
        let device = first.device();
        let refs: Vec<&Tensor> = grads.iter().collect();
        let one_gpu = device.is_cuda() && grads.iter().all(|g| g.device() == device);
        let total = match one_gpu {
            // torch's way on one device: `_foreach_norm` (one multi-tensor launch), then the
            // norm of the norms.
            true => crate::torch_ext::foreach_total_norm(&refs).unwrap_or_else(|err| panic!("{err:#}")),
            // The CPU, or a model spread over devices (pipeline stages in one process): the
            // squares summed in float64, on the first device.
            false => sum_of_squares(&refs).sqrt(),
        };
        // torch evaluates `max_norm / (total + 1e-6)` as `reciprocal(total + 1e-6) * max_norm`
        // in the norm's precision; doing the same keeps the clipped gradients bitwise equal on
        // one GPU (elsewhere it is float64, rounded to each gradient's precision).
        let coef = ((&total + 1e-6).reciprocal() * max_norm).clamp_max(1.0);
        // torch multiplies even when the coefficient is 1 (exact), so no branch is needed.
        if one_gpu {
            crate::torch_ext::foreach_mul_tensor_(&refs, &coef).unwrap_or_else(|err| panic!("{err:#}"));
        } else {
            for g in &refs {
                let _ = g.shallow_clone().g_mul_(&coef.to_device(g.device()).to_kind(g.kind()));
            }
        }
        // Recording a CUDA graph, the norm is not computed yet: nothing to read.
        if crate::cuda_graph::capturing() {
            return f64::NAN;
        }
        total.double_value(&[])
    })
}

/// `Σ ‖g‖²` over `grads` (at least one), as a 0-dim float64 tensor on the first one's device,
/// accumulated in float64.
///
/// Not torch's 2-norm on the CPU: LibTorch's CPU `linalg_vector_norm` (which `_foreach_norm`
/// falls back to there) accumulates a float32 tensor's squares in float32 and loses the small
/// ones once the sum has grown (its `sum` of the same squares does not). It comes out short on
/// large gradients with a long tail of small entries, a language model's output layer and
/// embedding (25120 × 32 here: the batch's words large, every other row tiny), by an amount that
/// depends on the tensor's length: in exercise1_nlp's first step the model's norm came out
/// 2.2e-4 short on one rank and 1.1e-4 short on two tensor-parallel shards (each holding half of
/// those tensors), so the two layouts clipped by coefficients 1.1e-4 apart, and both to a norm
/// above `max_norm`. Squared in the gradient's precision (float32 for 16-bit gradients, whose
/// squares could overflow) and summed in float64, the result is within about 1e-9 of the exact
/// one (each square rounded once), and the same to float64 rounding however the gradients are
/// cut. On one CUDA device, torch's `_foreach_norm` (one launch, which sums in blocks of partial
/// sums) is used, squared in float64.
fn sum_of_squares(grads: &[&Tensor]) -> Tensor {
    let device = grads[0].device();
    if device.is_cuda() && grads.iter().all(|g| g.device() == device) {
        let total = crate::torch_ext::foreach_total_norm(grads).unwrap_or_else(|err| panic!("{err:#}"));
        return total.to_kind(Kind::Double).square();
    }
    // In slices of at most SLICE elements: squaring and widening a whole gradient would make
    // three gradient-sized temporaries (the squares, and their float64 copy that `sum` makes),
    // and the largest, the embedding's, became the first pipeline stage's peak (+9% over its
    // estimate). A slice's temporaries are 384 KiB (4 + 8 bytes an element), within the
    // estimate's margin; each element's square is still summed in float64, so the sum does not
    // depend on where the slices fall.
    const SLICE: i64 = 1 << 15;
    let mut squares: Vec<Tensor> = Vec::new();
    for g in grads {
        let flat = g.reshape([-1]);
        let numel = flat.size()[0];
        for start in (0..numel).step_by(SLICE as usize) {
            let slice = flat.narrow(0, start, SLICE.min(numel - start));
            let slice = match slice.kind() {
                Kind::Half | Kind::BFloat16 => slice.to_kind(Kind::Float),
                _ => slice,
            };
            squares.push(slice.square().sum(Kind::Double).to_device(device));
        }
    }
    if squares.is_empty() {
        return Tensor::zeros([], (Kind::Double, device));
    }
    Tensor::stack(&squares, 0).sum(Kind::Double)
}

/// Where a model's parameters live, for the norm of its gradient: the ranks holding its other
/// parts, and which of this rank's parameters count in the norm.
#[derive(Clone, Copy, Default)]
pub struct NormScope<'a> {
    /// The ranks holding the other parts of the model (pipeline stages, tensor-parallel
    /// shards), whose squares add up with this rank's; none: this rank holds it all.
    pub model: Option<&'a crate::comm::ProcessGroup>,
    /// Per parameter (in the order given), whether this rank counts it: a parameter that every
    /// tensor-parallel shard holds whole (a layer norm) is counted by shard 0 only. Empty: all.
    pub counted: &'a [bool],
}

impl NormScope<'_> {
    fn counts(&self, i: usize) -> bool {
        self.counted.get(i).copied().unwrap_or(true)
    }
}

/// [`clip_grad_norm`] for a model whose parameters are spread over the ranks of `scope.model`
/// (the stages of a pipeline, the shards of its layers): every rank passes its own parameters,
/// and the total norm is that of the whole model, `sqrt(Σ_ranks Σ_counted params ‖g‖²)` (each
/// rank's squares by [`sum_of_squares`], as one rank holding the whole model sums them), so
/// every rank scales by the same coefficient as the unpartitioned model would. Without a group
/// it is [`clip_grad_norm`] itself. Every rank of the group must call it.
pub(crate) fn clip_grad_norm_over(params: &[Tensor], max_norm: f64, scope: NormScope<'_>) -> Result<f64> {
    let Some(group) = scope.model else { return Ok(clip_grad_norm(params, max_norm)) };
    tch::no_grad(|| {
        let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
        let counted: Vec<&Tensor> = grads.iter().enumerate().filter(|(i, g)| g.defined() && scope.counts(*i)).map(|(_, g)| g).collect();
        let local = if counted.is_empty() { 0.0 } else { sum_of_squares(&counted).double_value(&[]) };
        let mut total = Tensor::from(local);
        group.all_reduce(&mut total, crate::comm::ReduceOp::Sum)?;
        let total = total.double_value(&[]).sqrt();
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        for g in grads.iter().filter(|g| g.defined()) {
            let _ = g.shallow_clone().g_mul_scalar_(coef);
        }
        Ok(total)
    })
}

// ---------------------------------------------------------------------------------------------
// Shared per-parameter state bookkeeping: Adam and SGD only define what their state holds and
// how one parameter is updated; naming, lazy creation, saving and validated loading live here.

/// How one entry of a parameter's state is stored, and so checked when it is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryKind {
    /// A tensor shaped like the parameter, kept on its device in its kind.
    LikeParam,
    /// A moment estimate: shaped like the parameter, on its device, in its kind, but float32 for
    /// a float16 parameter ([`moment_kind`]).
    Moment,
    /// A count of updates, saved as a 0-dim int64 tensor (any kind holding a whole number
    /// loads, e.g. torch's float32 `step`).
    Count,
}

/// The state an optimizer keeps for one parameter, created on the parameter's first update.
trait ParamState: Sized + Send {
    /// The entries' names and kinds, in the order of [`ParamState::to_tensors`] and
    /// [`ParamState::from_tensors`]; a checkpoint names an entry `<entry>.<parameter name>`.
    const ENTRIES: &'static [(&'static str, EntryKind)];

    /// The entries as tensors (shallow clones; counts as 0-dim int64 tensors).
    fn to_tensors(&self) -> Vec<Tensor>;

    /// Rebuilds the state from validated entries: `LikeParam` ones are fresh tensors on the
    /// parameter's device and kind, `Count` ones 0-dim int64 CPU tensors.
    fn from_tensors(tensors: Vec<Tensor>) -> Self;
}

/// A named parameter and its optimizer state (`None` until its first update).
struct Slot<S> {
    name: String,
    param: Tensor,
    state: Option<S>,
}

/// The parameters an optimizer updates, with their state.
struct Slots<S> {
    slots: Vec<Slot<S>>,
    /// A LibTorch optimizer over the same parameters, never stepped: tch has no way to reset
    /// a gradient to "none", but LibTorch's `Optimizer::zero_grad()` does exactly that (its
    /// `set_to_none` defaults to true, as `torch.optim`'s does). Zero-filled gradients instead
    /// would cost a pass over every gradient to fill them, and another in the next backward to
    /// accumulate into them.
    grad_reset: tch::COptimizer,
}

impl<S: ParamState> Slots<S> {
    /// # Panics
    /// On two parameters with the same name: their state would be saved under the same names.
    fn new(params: Vec<(String, Tensor)>) -> Self {
        let mut seen = HashSet::new();
        for (name, _) in &params {
            assert!(seen.insert(name.as_str()), "optimizer: duplicate parameter name `{name}`");
        }
        let mut grad_reset = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false).expect("LibTorch can create an SGD optimizer");
        for (_, param) in &params {
            grad_reset.add_parameters(param, 0).expect("LibTorch accepts a parameter");
        }
        let slots = params.into_iter().map(|(name, param)| Slot { name, param, state: None }).collect();
        Slots { slots, grad_reset }
    }

    /// Calls `update(param, grad, state)` without gradient tracking for every parameter that
    /// has a gradient, in the order the parameters were given.
    fn update_each(&mut self, mut update: impl FnMut(&mut Tensor, &Tensor, &mut Option<S>)) {
        tch::no_grad(|| {
            for slot in &mut self.slots {
                let grad = slot.param.grad();
                if grad.defined() {
                    update(&mut slot.param, &grad, &mut slot.state);
                }
            }
        })
    }

    fn zero_grad(&mut self) {
        self.grad_reset.zero_grad().expect("LibTorch resets the gradients");
    }

    /// Whether any parameter is of `kind`.
    fn any_of_kind(&self, kind: Kind) -> bool {
        self.slots.iter().any(|slot| slot.param.kind() == kind)
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for slot in &self.slots {
            if let Some(state) = &slot.state {
                for ((entry, _), tensor) in S::ENTRIES.iter().zip(state.to_tensors()) {
                    out.push((state_key(entry, &slot.name), tensor));
                }
            }
        }
        out
    }

    fn load_state_tensors(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        // Validate and convert everything before touching the live state, so a failed load
        // leaves the optimizer as it was.
        let mut used = 0;
        let mut loaded = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let keys: Vec<String> = S::ENTRIES.iter().map(|(entry, _)| state_key(entry, &slot.name)).collect();
            let present = keys.iter().filter(|k| state.contains_key(k.as_str())).count();
            if present == 0 {
                loaded.push(None);
                continue;
            }
            let mut tensors = Vec::with_capacity(keys.len());
            for (key, &(_, kind)) in keys.iter().zip(S::ENTRIES) {
                let Some(tensor) = state.get(key) else {
                    let found = keys.iter().find(|k| state.contains_key(k.as_str())).unwrap();
                    bail!("optimizer state is missing tensor `{key}` (it has `{found}` of the same parameter)");
                };
                tensors.push(load_entry(key, tensor, kind, &slot.param)?);
            }
            used += present;
            loaded.push(Some(S::from_tensors(tensors)));
        }
        if used < state.len() {
            let expected: HashSet<String> = self.slots.iter().flat_map(|s| S::ENTRIES.iter().map(|(entry, _)| state_key(entry, &s.name))).collect();
            let mut unexpected: Vec<&String> = state.keys().filter(|k| !expected.contains(k.as_str())).collect();
            unexpected.sort();
            bail!("optimizer state has {} unexpected tensor(s), e.g. `{}`: it belongs to another model or optimizer", unexpected.len(), unexpected[0]);
        }
        for (slot, state) in self.slots.iter_mut().zip(loaded) {
            slot.state = state;
        }
        Ok(())
    }
}

/// The kind a moment estimate of a `param_kind` parameter is kept in: float32 for float16.
/// Float16 cannot hold Adam's second moment (squares of gradients below 2.4·10⁻⁴ round to zero)
/// nor its ε (10⁻⁸ rounds to zero), and an update divided by a zero becomes infinite, or NaN
/// where the gradient was zero too (an embedding row its batch did not use): `--precision
/// 16-true` diverged within 40 steps on every model so. bfloat16 has float32's range.
fn moment_kind(param_kind: Kind) -> Kind {
    match param_kind {
        Kind::Half => Kind::Float,
        kind => kind,
    }
}

/// A fresh moment estimate for `param`, zero, in [`moment_kind`].
fn moment_zeros(param: &Tensor) -> Tensor {
    match param.kind() {
        Kind::Half => param.zeros_like().to_kind(Kind::Float),
        _ => param.zeros_like(),
    }
}

fn state_key(entry: &str, param: &str) -> String {
    format!("{entry}.{param}")
}

/// Checks one saved entry against its parameter and converts it to how the state keeps it: a
/// fresh tensor (never aliasing the caller's), so later in-place updates leave `tensor` alone.
fn load_entry(key: &str, tensor: &Tensor, kind: EntryKind, param: &Tensor) -> Result<Tensor> {
    match kind {
        EntryKind::LikeParam | EntryKind::Moment => {
            let (got, want) = (tensor.size(), param.size());
            if got != want {
                bail!("optimizer state tensor `{key}` has shape {got:?}, but the parameter has shape {want:?}");
            }
            if !tensor.is_floating_point() {
                bail!("optimizer state tensor `{key}` has kind {:?}, expected a floating-point tensor", tensor.kind());
            }
            // `empty_like` keeps the parameter's device, kind and memory layout, as torch's
            // `zeros_like(p, memory_format=torch.preserve_format)` does for fresh state.
            let mut out = param.empty_like();
            if kind == EntryKind::Moment && moment_kind(param.kind()) != param.kind() {
                out = out.to_kind(moment_kind(param.kind()));
            }
            tch::no_grad(|| out.copy_(tensor));
            Ok(out)
        }
        EntryKind::Count => {
            let value = match tensor.size().as_slice() {
                [] | [1] => tensor.to_kind(Kind::Double).double_value(&[]),
                shape => bail!("optimizer state tensor `{key}` has shape {shape:?}, expected a single number"),
            };
            if !(value >= 0.0 && value.fract() == 0.0 && value <= i64::MAX as f64) {
                bail!("optimizer state tensor `{key}` holds {value}, expected a whole number of steps");
            }
            Ok(Tensor::from(value as i64))
        }
    }
}

/// `a + alpha * b` as torch's `a.add(b, alpha=alpha)` computes it. tch has no `alpha` argument,
/// and the composed `a + b * alpha` rounds twice where torch's CPU kernel uses one fused
/// multiply-add. `addcmul` with `alpha` as a 0-dim tensor (`a + 1 * b * alpha`) is compiled to
/// that same fused multiply-add in PyTorch's CPU build, keeping the result bitwise equal to
/// torch's (the parity test would show a difference of a rounding otherwise).
fn add_scaled(a: &Tensor, b: &Tensor, alpha: f64) -> Tensor {
    a.addcmul(b, &scalar_like(a, alpha))
}

/// In-place [`add_scaled`]: torch's `a.add_(b, alpha=alpha)`.
fn add_scaled_(a: &mut Tensor, b: &Tensor, alpha: f64) {
    let alpha = scalar_like(a, alpha);
    let _ = a.addcmul_(b, &alpha);
}

/// `value` as a 0-dim tensor on `t`'s device, in `t`'s kind except for the 16-bit floats, for
/// which torch too keeps scalars in float32 precision.
fn scalar_like(t: &Tensor, value: f64) -> Tensor {
    let kind = match t.kind() {
        Kind::Half | Kind::BFloat16 => Kind::Float,
        kind => kind,
    };
    Tensor::scalar_tensor(value, (kind, t.device()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// `--cuda-graph`'s optimizers: with the learning rate read from a device tensor (LibTorch's
    /// tensor-rate fused kernels, run here on the CPU), the fused Adam and SGD take the same
    /// steps as with the rate passed as a number, through a changing schedule, and count their
    /// steps alike; what cannot be captured says so.
    #[test]
    fn a_capturable_optimizer_reads_its_rate_from_a_tensor_and_steps_as_before() {
        let make = || -> Vec<(String, Tensor)> {
            let g = |seed: i64| {
                tch::manual_seed(seed);
                Tensor::randn([7, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true)
            };
            vec![("w".to_string(), g(1)), ("b".to_string(), g(2))]
        };
        type Build = fn(Vec<(String, Tensor)>) -> Box<dyn Optimizer>;
        let builds: [Build; 2] = [
            |p| Box::new(Adam::new(p, AdamConfig { fused: Some(true), weight_decay: 0.01, ..AdamConfig::default() })),
            |p| Box::new(Sgd::new(p, SgdConfig { lr: 0.1, momentum: 0.9, fused: Some(true), ..SgdConfig::default() })),
        ];
        for build in builds {
            let (plain_params, graph_params) = (make(), make());
            let mut plain = build(plain_params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
            let mut capturable = build(graph_params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
            capturable.make_capturable().unwrap();
            for step in 0..20 {
                for (params, opt) in [(&plain_params, &mut plain), (&graph_params, &mut capturable)] {
                    opt.set_lr(0.01 * (1 + step % 3) as f64);
                    opt.zero_grad();
                    let loss = params.iter().map(|(_, p)| (p * p).sum(Kind::Float) * (step + 1) as f64).reduce(|a, b| a + b).unwrap();
                    loss.backward();
                    opt.step().unwrap();
                }
            }
            for ((name, a), (_, b)) in plain_params.iter().zip(&graph_params) {
                assert!(a.equal(b), "{}: {name} differs with the rate as a tensor", plain.name());
            }
            let (a, b) = (plain.state_tensors(), capturable.state_tensors());
            assert!(a.iter().zip(&b).all(|((n, x), (m, y))| n == m && x.equal(y)), "{}: state differs", plain.name());
        }
        let mut lars = Lars::new(make(), LarsConfig::default());
        assert!(format!("{}", lars.make_capturable().unwrap_err()).contains("lars optimizer cannot run inside a CUDA graph"));
        let mut unfused = Adam::new(make(), AdamConfig { fused: Some(false), ..AdamConfig::default() });
        assert!(unfused.make_capturable().is_err());
    }

    /// A language model's output-layer gradient (25120 × 32: the rows of the batch's 50 words
    /// large, every other row tiny), clipped whole and cut into the halves two tensor-parallel
    /// shards hold: the norm is the exact one both ways (torch's CPU 2-norm of it is 2.4e-4 short,
    /// and of the halves by another amount, which this failed by), so both scale by the same
    /// coefficient, to `max_norm`.
    #[test]
    fn the_norm_of_a_large_gradient_is_exact_whole_or_cut_into_shards() {
        tch::manual_seed(0);
        let grad = Tensor::randn([25120, 32], (Kind::Float, Device::Cpu)) * 1e-5;
        grad.narrow(0, 0, 50).copy_(&(Tensor::randn([50, 32], (Kind::Float, Device::Cpu)) * 1e-2));
        let norm = |t: &Tensor| t.to_kind(Kind::Double).square().sum(Kind::Double).sqrt().double_value(&[]);
        let exact = norm(&grad);
        let with_grad = |g: &Tensor| {
            let p = g.zeros_like().set_requires_grad(true);
            (&p * g).sum(Kind::Float).backward();
            p
        };
        // Clipping: the norm is twice the clip.
        let max_norm = exact / 2.0;
        let whole = [with_grad(&grad)];
        let total = clip_grad_norm(&whole, max_norm);
        assert!((total / exact - 1.0).abs() < 1e-9, "whole: norm {total}, exactly {exact}");
        let group = crate::comm::ProcessGroup::single();
        let halves: Vec<Tensor> = grad.chunk(2, 0).iter().map(with_grad).collect();
        let sharded = clip_grad_norm_over(&halves, max_norm, NormScope { model: Some(&group), counted: &[] }).unwrap();
        assert!((sharded / total - 1.0).abs() < 1e-12, "cut in two: norm {sharded}, whole {total}");
        let clipped = whole[0].grad();
        let rejoined = Tensor::cat(&[halves[0].grad(), halves[1].grad()], 0);
        let apart = ((&rejoined - &clipped).abs().max() / clipped.abs().max()).double_value(&[]);
        assert!(apart <= 1.2e-7, "the halves' clipped gradients differ from the whole one's by {apart:e}");
        let after = norm(&clipped) / (max_norm * exact / (exact + 1e-6));
        assert!((after - 1.0).abs() < 1e-6, "clipped to {} of max_norm (with torch's 1e-6)", after);
    }
}
