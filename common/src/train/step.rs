//! [`TrainStep`]: one optimizer step's work, the seam between the training loop and the
//! parallelism. The loop ([`super::fit`]) is the same for every exercise; what differs is how a
//! step's forward and backward passes run (one model, a pipeline of stages in threads, one
//! stage of a pipeline across processes) and over which ranks its gradients are finished. A new
//! parallelism is a new implementation of this trait, handed to the loop by
//! [`crate::parallelize`]; what keeps a rank's part consistent with the others' is its
//! [`StepSync`], which the strategies ([`crate::parallel`]) implement.
use std::time::Instant;

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::{Batch, BatchSource};
use crate::checkpoint::region::Region;
use crate::comm::{ProcessGroup, ReduceOp};
use crate::optim::block::BlockLayout;
use crate::optim::Optimizer;
use crate::precision::{GradScaler, Precision};

/// A named phase of a step (`"forward"`, `"all-reduce"`, ...) with its start and end.
pub type Phase = (&'static str, Instant, Instant);

/// What a step needs besides its batch.
#[derive(Clone, Copy)]
pub struct StepContext<'a> {
    pub precision: Precision,
    /// float16 training's scaler: the loss is multiplied by its scale before backward.
    pub scaler: Option<&'a GradScaler>,
    /// Keys this micro-batch's dropout masks where the step draws keyed masks (a pipeline).
    pub dropout_key: u64,
    /// `--profile`: wait for the device at phase boundaries, so phases are the device's work.
    pub sync_phases: bool,
    /// Count the arg-max hits (image classification's accuracy).
    pub count_hits: bool,
}

/// What one forward and backward pass did on this rank.
#[derive(Default)]
pub struct StepOutput {
    /// The sum of the examples' losses (mean × examples), float64, on the device.
    pub loss_sum: Option<Tensor>,
    /// Arg-max hits, when counted.
    pub hits: Option<Tensor>,
    /// Examples (images, or tokens) in the batch.
    pub examples: usize,
    /// Phases with their times (`"forward"`, `"backward"`, or a pipeline's `"forward+backward"`).
    pub phases: Vec<Phase>,
    /// A pipeline's passes per device (empty otherwise).
    pub stage_traces: Vec<DeviceTrace>,
    /// A pipeline's stage-seconds computed and stage-seconds elapsed (the bubble's parts).
    pub stage_busy: Option<(f64, f64)>,
}

/// What one device of a pipeline did during a step, as a profile draws it: its row and its
/// passes (the pipeline's own traces say more; the loop needs no more than this).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceTrace {
    /// The device's place in the pipeline: its row in the profile.
    pub device: usize,
    pub passes: Vec<TracedPass>,
}

/// One pass of a device (`F3`, `B3@1`) and when it ran, in seconds since the step started.
#[derive(Debug, Clone, PartialEq)]
pub struct TracedPass {
    pub label: String,
    pub start_s: f64,
    pub end_s: f64,
}

impl StepOutput {
    /// Adds `other` (the next micro-batch of an accumulated step) to this one.
    pub fn absorb(&mut self, other: StepOutput) {
        let add = |a: Option<Tensor>, b: Option<Tensor>| match (a, b) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.loss_sum = add(self.loss_sum.take(), other.loss_sum);
        self.hits = add(self.hits.take(), other.hits);
        self.examples += other.examples;
        self.phases.extend(other.phases);
        self.stage_traces.extend(other.stage_traces);
        self.stage_busy = match (self.stage_busy, other.stage_busy) {
            (Some((a, b)), Some((c, d))) => Some((a + c, b + d)),
            (a, b) => a.or(b),
        };
    }

    /// The step's mean loss (on the device).
    pub fn mean_loss(&self) -> Tensor {
        match &self.loss_sum {
            Some(sum) => sum / self.examples.max(1) as f64,
            None => Tensor::from(f64::NAN),
        }
    }

    /// The measured idle share of a pipeline step.
    pub fn bubble(&self) -> Option<f64> {
        self.stage_busy.map(|(busy, elapsed)| if elapsed > 0.0 { (1.0 - busy / elapsed).max(0.0) } else { 0.0 })
    }
}

/// Sums over a pass of evaluation; replicas combine theirs by adding.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalSums {
    pub loss_sum: f64,
    pub hits: f64,
    pub examples: f64,
}

impl EvalSums {
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.examples.max(1.0)
    }

    pub fn accuracy(&self) -> f64 {
        self.hits / self.examples.max(1.0)
    }

    /// The sums of every replica in `group` (unchanged without one).
    pub fn over(self, group: Option<&ProcessGroup>) -> Result<EvalSums> {
        let Some(group) = group else { return Ok(self) };
        let mut all = Tensor::from_slice(&[self.loss_sum, self.hits, self.examples]);
        group.all_reduce(&mut all, ReduceOp::Sum)?;
        let all = Vec::<f64>::try_from(&all)?;
        Ok(EvalSums { loss_sum: all[0], hits: all[1], examples: all[2] })
    }
}

/// The collective that finishes a step's gradients on this rank before the optimizer step, as
/// the profile names the phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradientCollective {
    /// Nothing to average here (one replica; Horovod's optimizer and parameter servers do it
    /// in the optimizer's step).
    None,
    AllReduce,
    /// ZeRO: each replica keeps the sum of its own block.
    ReduceScatter,
}

/// How this rank's tensors are cut over tensor-parallel shards, as a checkpoint asks it: the
/// region of a whole tensor this rank's is, and the whole tensors put together or cut again.
pub trait TensorCut {
    /// This rank's shard and the number of shards.
    fn shard(&self) -> (usize, usize);

    /// The region of the whole tensor `name` (a variable, or optimizer state
    /// `<entry>.<variable>`) that this rank's tensor of `dims` dimensions is.
    fn region(&self, name: &str, dims: usize) -> Result<Region>;

    /// The whole tensors of `named` (this rank's parts), put together from every shard's; every
    /// shard calls it.
    fn unshard_named(&self, named: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>>;

    /// This rank's part of the whole tensor `name`.
    fn shard_of(&self, name: &str, whole: &Tensor) -> Result<Tensor>;
}

/// Parameters sharded over the replicas (ZeRO-3): this rank's flat block of them, as a
/// checkpoint reads and writes it.
pub trait ParameterBlock {
    /// Which spans of which parameters the block holds.
    fn layout(&self) -> BlockLayout;
    fn block(&self) -> Tensor;
    fn load_block(&self, block: &Tensor) -> Result<()>;
    /// Whether checkpoints take this rank's block: false where another rank holds the same
    /// block and writes it (HSDP's other shard groups).
    fn writes_block(&self) -> bool;
}

/// What keeps a step's part of the model consistent with the ranks that replicate it or hold
/// the rest of it: who they are, how the gradients are finished, how sharded parameters are
/// made whole to be read or written, and who owns which piece of a checkpoint. The loop,
/// checkpoints and reports ask this; the strategies ([`crate::parallel`]) answer it.
pub trait StepSync<'g> {
    /// The whole job (its rank 0 reads and writes checkpoints).
    fn world(&self) -> Option<&'g ProcessGroup>;

    /// The data-parallel replicas of this rank's variables.
    fn replicas(&self) -> Option<&'g ProcessGroup>;

    /// The ranks holding the other parts of this replica's model (pipeline stages, tensor
    /// shards): gradient norms, the scaler's verdict and checkpoints are agreed or gathered over
    /// them.
    fn model(&self) -> Option<&'g ProcessGroup>;

    /// This rank's replica (0 holds the copy a checkpoint is gathered from).
    fn replica(&self) -> usize;

    /// How this rank's tensors are cut over tensor-parallel shards, where they are.
    fn tensor_cut(&self) -> Option<&dyn TensorCut>;

    /// ZeRO-3's block of this rank's parameters, where they are sharded.
    fn parameter_block(&self) -> Option<&dyn ParameterBlock>;

    /// The parameters this rank holds without training them (transfer learning's frozen
    /// blocks): part of the model's size and memory, but not of `named_parameters`.
    fn frozen(&self) -> &[Tensor];

    /// `[i]`: whether this rank counts parameter `i` (in the step's `named_parameters` order)
    /// in the gradient norm over the model (a tensor-parallel shard does not count what shard 0
    /// holds too); empty: all.
    fn norm_counted(&self) -> &[bool];

    /// The collective that [`StepSync::finish_gradients`] runs, `clip`ping or not.
    fn gradient_collective(&self, clip: bool) -> GradientCollective;

    /// The strategy's flag where the replicas do not step together (a decision taken in the
    /// middle of an epoch, such as a checkpoint every few steps, would make them).
    fn steps_apart(&self) -> Option<&'static str>;

    /// Makes the gradients of `params` (the step's parameters) final before the optimizer
    /// step: averaged over the replicas, unscaled (float16) with one inf/NaN verdict for the
    /// whole model, clipped to `clip` by the norm over the whole model. Returns that norm when
    /// clipping.
    fn finish_gradients(&self, params: &[Tensor], optimizer: &mut dyn Optimizer, scaler: Option<&GradScaler>, clip: Option<f64>) -> Result<Option<f64>>;

    /// Makes every parameter whole in memory, to read or write it (checkpoints, the replicas'
    /// agreement).
    fn materialize(&self) -> Result<()>;

    /// Undoes [`StepSync::materialize`]; `changed`: the parameters were written (restored or
    /// broadcast).
    fn release(&self, changed: bool) -> Result<()>;

    /// Makes every replica's buffers among `variables` (batch-norm statistics, which each
    /// replica updates from its own shard) replica 0's, before evaluating and checkpointing.
    fn sync_buffers(&self, variables: Vec<(String, Tensor)>) -> Result<()>;

    /// Makes every replica start from replica 0's `variables` and `optimizer` state;
    /// `restored_state`: the optimizer state this rank of replica 0 restored (what a sharded
    /// optimizer's replicas each take their share of).
    fn start_from_replica_zero(&self, variables: Vec<(String, Tensor)>, optimizer: &mut dyn Optimizer, restored_state: Vec<(String, Tensor)>) -> Result<()>;

    /// Whether this rank is the job's rank 0.
    fn is_root(&self) -> bool {
        self.world().is_none_or(ProcessGroup::is_root)
    }

    /// The number of data-parallel replicas.
    fn replica_count(&self) -> usize {
        self.replicas().map_or(1, ProcessGroup::world_size)
    }
}

/// One optimizer step's work: forward and backward passes of a batch in the run's precision
/// and evaluation, over the variables this rank holds under their whole-model names. What keeps
/// them consistent across ranks is the [`StepSync`] the step owns.
pub trait TrainStep<'g> {
    /// Forward and backward passes of `batch` (this rank's share of it), the loss multiplied by
    /// `weight` (the batch's share of an accumulated step) before backward; gradients add up
    /// over calls until the optimizer's `zero_grad`.
    fn forward_backward(&mut self, batch: &Batch, weight: f64, ctx: &StepContext) -> Result<StepOutput>;

    /// Sums over one pass of `source` (this replica's shard), without gradients, in evaluation
    /// mode; replicas are combined by the caller.
    fn evaluate(&mut self, source: &dyn BatchSource, precision: Precision) -> Result<EvalSums>;

    /// The trainable variables this rank holds, under their whole-model names, in the same
    /// order on every replica.
    fn named_parameters(&self) -> Vec<(String, Tensor)>;

    /// Every variable this rank holds (parameters and buffers such as batch-norm statistics),
    /// under their whole-model names: what a checkpoint keeps of it.
    fn named_variables(&self) -> Vec<(String, Tensor)>;

    /// Where this rank's batches go.
    fn input_device(&self) -> Device;

    /// Who this rank works with and what keeps its part consistent with theirs.
    fn sync(&self) -> &dyn StepSync<'g>;
}

/// Makes `step`'s gradients final before the optimizer step ([`StepSync::finish_gradients`]).
pub fn finish_gradients<'g, S: TrainStep<'g> + ?Sized>(
    step: &S,
    optimizer: &mut dyn Optimizer,
    scaler: Option<&GradScaler>,
    clip: Option<f64>,
) -> Result<Option<f64>> {
    let params: Vec<Tensor> = step.named_parameters().into_iter().map(|(_, t)| t).collect();
    step.sync().finish_gradients(&params, optimizer, scaler, clip)
}

/// The parameters `step`'s rank holds, frozen ones included, counting what every
/// tensor-parallel shard holds whole on the first shard only: summed over the ranks holding a
/// model's parts, the model's count.
pub fn counted_parameters(step: &dyn TrainStep<'_>) -> i64 {
    let counted = step.sync().norm_counted();
    let trained: i64 =
        step.named_parameters().iter().enumerate().filter(|(i, _)| counted.get(*i).copied().unwrap_or(true)).map(|(_, (_, t))| t.numel() as i64).sum();
    trained + step.sync().frozen().iter().map(|t| t.numel() as i64).sum::<i64>()
}

/// Mean cross-entropy over the last dimension of `logits` (classes, or vocabulary) and, when
/// asked, the number of arg-max hits.
pub fn loss_and_hits(logits: &Tensor, targets: &Tensor, count_hits: bool) -> (Tensor, Option<Tensor>) {
    let classes = *logits.size().last().expect("logits have a class dimension");
    // A model held in 16 bits (`--precision bf16-true`) has its loss computed in float32, as
    // autocast would: a 16-bit log-softmax over many classes loses the small probabilities.
    let logits = match logits.kind() {
        Kind::Half | Kind::BFloat16 => logits.to_kind(Kind::Float),
        _ => logits.shallow_clone(),
    };
    let logits = logits.reshape([-1, classes]);
    let targets = targets.reshape([-1]);
    let loss = logits.cross_entropy_for_logits(&targets);
    let hits = count_hits.then(|| logits.argmax(-1, false).eq_tensor(&targets).sum(Kind::Int64));
    (loss, hits)
}
