//! [`TrainStep`]: one optimizer step's work, the seam between the training loop and the
//! parallelism. The loop ([`super::fit`]) is the same for every exercise; what differs is how a
//! step's forward and backward passes run (one model, a pipeline of stages in threads, one
//! stage of a pipeline across processes) and over which ranks its gradients are finished. A new
//! parallelism is a new implementation of this trait, handed to the loop by
//! [`crate::parallelize`].
use std::time::Instant;

use anyhow::Result;
use tch::{nn, Device, Kind, Tensor};

use super::{Batch, BatchSource};
use crate::device::synchronize;
use std::rc::Rc;

use anyhow::Context;

use crate::dist::data_parallel::{DataParallelPlan, DistributedOptimizer, GradientAverager};
use crate::dist::layout::Groups;
use crate::dist::tensor_parallel::{SplitOf, TensorShards};
use crate::dist::zero::{Shards, ZeroOptimizer, ZeroStage};
use crate::dist::{GradientSync, ProcessGroup, ReduceOp};
use crate::models::PartedModule;
use crate::optim::{NormScope, Optimizer};
use crate::precision::{self, GradScaler, Precision};

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

/// How the replicas of a data-parallel job keep their gradients equal: the group of ranks
/// holding the same variables, the bucketed averager (`--bucket-mb`, `--fp16-allreduce`) and
/// where the averaging runs (DDP: after backward; Horovod: inside the optimizer's step).
#[derive(Clone, Copy)]
pub struct Replication<'g> {
    pub group: &'g ProcessGroup,
    pub averager: GradientAverager,
    pub sync: GradientSync,
}

impl<'g> Replication<'g> {
    /// The optimizer the loop steps for `step`'s parameters, `build` making the optimizer of
    /// some named parameters: over all of them (DDP), wrapped by Horovod's optimizer whose step
    /// averages their gradients first, or over this rank's block of them (ZeRO; at stage 3 the
    /// block the step's sharded parameters already are).
    pub fn distribute<'o>(
        &self,
        step: &dyn TrainStep<'g>,
        build: impl FnOnce(Vec<(String, Tensor)>) -> Box<dyn Optimizer + 'o>,
    ) -> Result<Box<dyn Optimizer + 'o>>
    where
        'g: 'o,
    {
        let params = step.named_parameters();
        Ok(match self.sync {
            GradientSync::Ddp => build(params),
            GradientSync::Horovod => {
                let averaged = params.iter().map(|(_, t)| t.shallow_clone()).collect();
                Box::new(DistributedOptimizer::new(build(params), averaged, self.group, self.averager))
            }
            GradientSync::Zero(ZeroStage::Parameters) => {
                let shards = step.sync().zero_shards().context("ZeRO-3 shards the parameters when the step is built, and this step was built without")?;
                Box::new(ZeroOptimizer::over(shards, build))
            }
            GradientSync::Zero(stage) => Box::new(ZeroOptimizer::over(Shards::new(stage, self.group, params, None, self.averager.bucket_bytes)?, build)),
            // Parameter-server hook: a local optimizer, which the worker's (dist::parameter_server) replaces.
            GradientSync::ParameterServer => build(params),
        })
    }
}

/// Who a step's rank works with: its place in the job's mesh ([`Groups`]) seen from one step.
#[derive(Clone, Copy, Default)]
pub struct Parallel<'g> {
    /// The data-parallel replicas of this rank's variables.
    pub replicas: Option<Replication<'g>>,
    /// The ranks holding the other parts of this replica's model (pipeline stages): gradient
    /// norms, the scaler's verdict and checkpoints are agreed or gathered over them.
    pub model: Option<&'g ProcessGroup>,
    /// The whole job (its rank 0 reads and writes checkpoints).
    pub world: Option<&'g ProcessGroup>,
    /// This rank's replica (0 holds the copy a checkpoint is gathered from).
    pub replica: usize,
    /// The tensor-parallel shards of this rank's layers, which one it is and how the model's
    /// variables are cut: checkpoints hold the whole tensors, put together from the shards and
    /// cut again on resume.
    pub tp: Option<TensorShards<'g>>,
}

impl<'g> Parallel<'g> {
    /// This rank's place in `groups`' layout, its replicas keeping their gradients equal as
    /// `dp` says, its model's variables cut over tensor-parallel shards as `split_of` says:
    /// the one place a step learns who it works with.
    pub fn of(groups: &'g Groups<'g>, dp: DataParallelPlan, split_of: SplitOf) -> Parallel<'g> {
        Parallel {
            replicas: groups.dp().map(|group| Replication { group, averager: dp.averager, sync: dp.sync }),
            model: groups.model(),
            world: Some(groups.world),
            replica: groups.coords.replica,
            tp: groups.tp().map(|group| TensorShards { group, shard: groups.shard(), split_of }),
        }
    }

    pub fn replica_group(self) -> Option<&'g ProcessGroup> {
        self.replicas.map(|r| r.group)
    }

    /// Whether this rank is the job's rank 0.
    pub fn is_root(self) -> bool {
        self.world.is_none_or(ProcessGroup::is_root)
    }

    /// The number of data-parallel replicas.
    pub fn replica_count(self) -> usize {
        self.replica_group().map_or(1, ProcessGroup::world_size)
    }
}

/// What keeps a step's part of the model consistent with the ranks that replicate it or hold
/// the rest of it, owned by the step: who they are ([`Parallel`]), ZeRO-3's sharded parameters
/// (gathered to be read or written, freed after), which parameters count in the norm over the
/// model, and which it holds without training them. The training loop, checkpoints and reports
/// ask this, so [`TrainStep`] stays about computing.
#[derive(Default)]
pub struct StepSync<'g> {
    pub parallel: Parallel<'g>,
    zero3: Option<Rc<Shards<'g>>>,
    norm_counted: Vec<bool>,
    frozen: Vec<Tensor>,
}

impl<'g> StepSync<'g> {
    pub fn new(parallel: Parallel<'g>) -> Self {
        StepSync { parallel, ..StepSync::default() }
    }

    /// With the parameters living in ZeRO-3's `shards`.
    pub fn with_zero3(self, shards: Rc<Shards<'g>>) -> Self {
        StepSync { zero3: Some(shards), ..self }
    }

    /// With `counted[i]`: whether this rank counts parameter `i` (in the step's
    /// `named_parameters` order) in the gradient norm over the model (a tensor-parallel shard
    /// does not count what shard 0 holds too); empty: all.
    pub fn with_norm_counted(self, counted: Vec<bool>) -> Self {
        StepSync { norm_counted: counted, ..self }
    }

    /// With the parameters this rank holds without training them (transfer learning's frozen
    /// blocks): part of the model's size and memory, but not of `named_parameters`.
    pub fn with_frozen(self, frozen: Vec<Tensor>) -> Self {
        StepSync { frozen, ..self }
    }

    /// ZeRO-3's sharded parameters, where the step was built with them.
    pub fn zero_shards(&self) -> Option<Rc<Shards<'g>>> {
        self.zero3.clone()
    }

    pub fn norm_counted(&self) -> &[bool] {
        &self.norm_counted
    }

    pub fn frozen(&self) -> &[Tensor] {
        &self.frozen
    }

    /// Makes the gradients of `params` (the step's parameters) final before the optimizer
    /// step: averaged over the replicas (DDP style; Horovod's optimizer averages in its
    /// `synchronize`), unscaled (float16) with one inf/NaN verdict for the whole model, clipped
    /// to `clip` by the norm over the whole model. Returns that norm when clipping.
    pub fn finish_gradients(&self, params: &[Tensor], optimizer: &mut dyn Optimizer, scaler: Option<&GradScaler>, clip: Option<f64>) -> Result<Option<f64>> {
        // The same for every kind of step, however the model is spread over ranks.
        let parallel = self.parallel;
        if let Some(replicas) = &parallel.replicas {
            if replicas.sync == GradientSync::Ddp {
                replicas.averager.average(replicas.group, params)?;
            }
        }
        // A Horovod-style optimizer averages here; a local one does nothing.
        optimizer.synchronize()?;
        if let Some(scaler) = scaler {
            scaler.unscale(params);
            // One verdict for the model: a stage that saw an inf makes every stage skip the step
            // (the replicas agree already: the inf went into their averages).
            if let Some(model) = parallel.model {
                scaler.agree(model)?;
            }
        }
        match clip {
            // The norm before clipping, as `torch.nn.utils.clip_grad_norm_` returns it.
            Some(max_norm) => Ok(Some(optimizer.clip_grad_norm(params, max_norm, NormScope { model: parallel.model, counted: &self.norm_counted })?)),
            None => Ok(None),
        }
    }

    /// Makes every parameter whole in memory, to read or write it (checkpoints, the replicas'
    /// agreement): ZeRO-3 gathers them; nothing to do otherwise.
    pub fn materialize(&self) -> Result<()> {
        self.zero3.as_ref().map_or(Ok(()), |shards| shards.gather_all())
    }

    /// Undoes [`StepSync::materialize`]; `changed`: the parameters were written (restored or
    /// broadcast), so ZeRO-3 takes its block from them again.
    pub fn release(&self, changed: bool) -> Result<()> {
        let Some(shards) = &self.zero3 else { return Ok(()) };
        if changed {
            shards.refresh_block();
        }
        shards.free_all()
    }

    /// Makes every replica's buffers among `variables` (batch-norm statistics, which each
    /// replica updates from its own shard) replica 0's, before evaluating and checkpointing.
    pub fn sync_buffers(&self, variables: Vec<(String, Tensor)>) -> Result<()> {
        let Some(group) = self.parallel.replica_group() else { return Ok(()) };
        let buffers: Vec<(String, Tensor)> = variables.into_iter().filter(|(_, t)| !t.requires_grad()).collect();
        crate::dist::data_parallel::broadcast_named(group, buffers, 0)
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
    fn sync(&self) -> &StepSync<'g>;
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

/// The kind of `vs`'s floating-point variables, where it is not float32.
fn weights_kind(vs: &nn::VarStore) -> Option<Kind> {
    let variables = vs.variables();
    let kind = variables.values().map(Tensor::kind).find(|kind| matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double))?;
    (kind != Kind::Float).then_some(kind)
}

/// The parameters `vs` holds without training them (frozen for transfer learning): the var
/// store lists every parameter it created trainable, frozen since or not.
fn frozen_parameters(vs: &nn::VarStore) -> Vec<Tensor> {
    vs.trainable_variables().into_iter().filter(|t| !t.requires_grad()).collect()
}

/// A whole model on this rank, trained alone or as one data-parallel replica (its parameters
/// sharded over the replicas with ZeRO-3).
pub struct LocalStep<'g> {
    pub vs: nn::VarStore,
    pub model: Box<dyn PartedModule>,
    /// Who it works with; with ZeRO-3 the shards the parameters live in, gathered part by part
    /// as the model runs.
    sync: StepSync<'g>,
    /// The floating-point kind of the model's weights where not float32 (`--precision
    /// bf16-true`): floating-point inputs are cast to it, as a `model.half()` script casts them.
    inputs_kind: Option<Kind>,
}

impl<'g> LocalStep<'g> {
    /// A model run as one piece.
    pub fn new(vs: nn::VarStore, model: Box<dyn nn::ModuleT>, parallel: Parallel<'g>) -> Self {
        Self::parted(vs, Box::new(crate::models::OnePart(model)), parallel)
    }

    /// A model that knows its parts (only ZeRO-3 runs them one by one).
    pub fn parted(vs: nn::VarStore, model: Box<dyn PartedModule>, parallel: Parallel<'g>) -> Self {
        let inputs_kind = weights_kind(&vs);
        let sync = StepSync::new(parallel).with_frozen(frozen_parameters(&vs));
        LocalStep { vs, model, sync, inputs_kind }
    }

    /// The step with its parameters sharded over its replicas (ZeRO-3, FSDP): each part of the
    /// model ([`PartedModule`]) is a unit, gathered before it runs and freed after.
    pub fn sharded(vs: nn::VarStore, model: Box<dyn PartedModule>, parallel: Parallel<'g>) -> Result<Self> {
        let replicas = parallel.replicas.context("ZeRO-3 shards the parameters over data-parallel replicas")?;
        let named = crate::models::named_parameters(&vs);
        let parts = named.iter().map(|(name, _)| model.part_of(name)).collect::<Result<_>>()?;
        let shards = Shards::new(ZeroStage::Parameters, replicas.group, named, Some(parts), replicas.averager.bucket_bytes)?;
        let inputs_kind = weights_kind(&vs);
        let sync = StepSync::new(parallel).with_frozen(frozen_parameters(&vs)).with_zero3(shards);
        Ok(LocalStep { vs, model, sync, inputs_kind })
    }

    /// The model's output for `xs`: at once, or part by part through ZeRO-3's shards.
    fn run(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let cast;
        let xs = match self.inputs_kind {
            Some(kind) if xs.is_floating_point() && xs.kind() != kind => {
                cast = xs.to_kind(kind);
                &cast
            }
            _ => xs,
        };
        match &self.sync.zero3 {
            None => Ok(self.model.forward_t(xs, train)),
            Some(shards) => self.model.forward_parts(xs, train, &mut |part, run| shards.around(part, run)),
        }
    }
}

impl<'g> TrainStep<'g> for LocalStep<'g> {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        crate::models::named_parameters(&self.vs)
    }

    fn named_variables(&self) -> Vec<(String, Tensor)> {
        let mut vars: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }

    fn input_device(&self) -> Device {
        self.vs.device()
    }

    fn sync(&self) -> &StepSync<'g> {
        &self.sync
    }

    fn forward_backward(&mut self, batch: &Batch, weight: f64, ctx: &StepContext) -> Result<StepOutput> {
        let device = self.vs.device();
        let t0 = Instant::now();
        let (loss, hits) = precision::autocast(ctx.precision, device, || -> Result<_> {
            let logits = self.run(&batch.inputs, true)?;
            Ok(loss_and_hits(&logits, &batch.targets, ctx.count_hits))
        })?;
        if ctx.sync_phases {
            synchronize(device);
        }
        let t1 = Instant::now();
        // An accumulated step weights each batch by its share (no multiplication otherwise: the
        // plain step stays bitwise torch's).
        let weighted = if weight == 1.0 { loss.shallow_clone() } else { &loss * weight };
        // (ZeRO's hooks communicate inside LibTorch's backward and can fail: f_backward.)
        match ctx.scaler {
            Some(scaler) => scaler.scale(&weighted).f_backward()?,
            None => weighted.f_backward()?,
        }
        synchronize(device);
        let examples = batch.len();
        Ok(StepOutput {
            loss_sum: Some(loss.detach().to_kind(Kind::Double) * examples as f64),
            hits,
            examples,
            phases: vec![("forward", t0, t1), ("backward", t1, Instant::now())],
            ..StepOutput::default()
        })
    }

    fn evaluate(&mut self, source: &dyn BatchSource, precision: Precision) -> Result<EvalSums> {
        tch::no_grad(|| {
            let mut sums = EvalSums::default();
            for batch in source.epoch(0) {
                let batch = batch?;
                let device = batch.inputs.device();
                let (loss, hits) = precision::autocast(precision, device, || -> Result<_> {
                    let logits = self.run(&batch.inputs, false)?;
                    Ok(loss_and_hits(&logits, &batch.targets, true))
                })?;
                sums.loss_sum += loss.double_value(&[]) * batch.len() as f64;
                sums.hits += hits.map_or(0, |h| h.int64_value(&[])) as f64;
                sums.examples += batch.len() as f64;
            }
            Ok(sums)
        })
    }
}
