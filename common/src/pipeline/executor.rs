//! Runs one device's share of a mini-batch: the forward and backward passes through its stages
//! (one, or several with interleaving) in the order of its schedule, activations in from the
//! previous device and out to the next, gradients the other way. The same function runs a
//! device thread in one process and a stage process across processes; only the [`Link`]s
//! differ.
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use super::link::{Link, Stash};
use super::schedule::{Direction, Op};
use crate::comm::ProcessGroup;
use crate::models::Masks;
use crate::seed_keys::mix_key;
use crate::torch_ext::Generator;

/// What the executor needs of a stage: a consecutive piece of some model, on one device. The
/// Transformer's [`super::Stage`] is one; [`super::sequential::LinearStage`] (the slides'
/// `Pipe` example) is another.
pub trait PipelineStage {
    /// The stage's place in the model, from 0.
    fn index(&self) -> usize;
    fn device(&self) -> Device;
    /// Takes the model's inputs (which need no gradient).
    fn is_first(&self) -> bool;
    /// Ends in the loss.
    fn is_last(&self) -> bool;
    /// One micro-batch through the stage, its dropout masks drawn as `masks` says; a
    /// tensor-parallel shard talks to the other shards over `tp`.
    fn forward_masked(&self, input: &Tensor, train: bool, masks: Masks, tp: Option<&ProcessGroup>) -> Result<Tensor>;
    /// The last stage's mean loss of its `output` against `targets`, and, when asked, the
    /// number of correct predictions.
    fn loss_and_hits(&self, output: &Tensor, targets: &Tensor, tp: Option<&ProcessGroup>, count_hits: bool) -> Result<(Tensor, Option<Tensor>)>;
}

/// The micro-batches as the first and last stage see them.
pub struct MicroBatches {
    /// The model's input per micro-batch (token ids for the language model), on the first
    /// stage's device (empty on other devices).
    pub inputs: Vec<Tensor>,
    /// Targets per micro-batch, on the last stage's device (empty on other devices).
    pub targets: Vec<Tensor>,
    /// Each micro-batch's share of the mini-batch (its sequences / all sequences): the
    /// weighted micro-batch losses sum to the mini-batch's mean loss.
    pub weights: Vec<f64>,
    /// The length of the mini-batch's sequences (on every device: keyed dropout masks are
    /// drawn for that many positions, whatever padding sequence parallelism adds).
    pub positions: i64,
}

/// When a device ran which pass, in seconds since the mini-batch started.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OpInterval {
    pub op: Op,
    pub start_s: f64,
    pub end_s: f64,
}

/// What one device (a pipeline stage, or with interleaving several) did during a mini-batch.
#[derive(Debug, Clone, Serialize)]
pub struct StageTrace {
    /// The device's place in the pipeline (its stage's index without interleaving).
    pub device: usize,
    /// The stages it holds, in model order.
    pub stages: Vec<usize>,
    pub intervals: Vec<OpInterval>,
    /// The most (stage, micro-batch) activations the device held at once.
    pub peak_live: usize,
}

impl StageTrace {
    /// Seconds the device spent computing (its intervals' total length).
    pub fn busy_s(&self) -> f64 {
        self.intervals.iter().map(|i| i.end_s - i.start_s).sum()
    }

    /// `interval`'s name in a trace (the stage named where the device holds several).
    pub fn label(&self, interval: &OpInterval) -> String {
        interval.op.label(self.stages.len() > 1)
    }

    /// What the training loop's profile draws of it: the device's row and its labelled passes.
    pub fn for_profile(&self) -> crate::train::DeviceTrace {
        let passes = self.intervals.iter().map(|i| crate::train::TracedPass { label: self.label(i), start_s: i.start_s, end_s: i.end_s }).collect();
        crate::train::DeviceTrace { device: self.device, passes }
    }
}

/// What a forward pass leaves for its backward pass.
struct Saved {
    /// The stage's input: token ids on the first stage, else a leaf requiring grad whose
    /// gradient goes back to the previous stage's device.
    input: Tensor,
    /// The output with its autograd graph (the weighted loss on the last stage); `None` with
    /// activation recomputation, where only the input is kept.
    output: Option<Tensor>,
}

/// Options of [`run_device`].
#[derive(Debug, Clone, Copy)]
pub struct StageOptions {
    /// The mini-batch's dropout key: micro-batch `m`'s masks are keyed by (key, m) and by the
    /// layer (see [`Masks::Keyed`]), so a seeded run trains the same model whatever the
    /// partition, the number of stages, the schedule or the threads' timing.
    pub dropout_key: u64,
    /// Forward passes keep only the stage's input; the backward pass recomputes the rest.
    pub recompute: bool,
    /// Dropout on.
    pub train: bool,
    /// The last stage's backward starts from its loss × this (an accumulated step's share of
    /// the batch, times float16's loss scale); the reported loss is not scaled.
    pub loss_scale: f64,
    /// Autocast in the stage's forward passes (bfloat16 or float16), or float32.
    pub precision: crate::precision::Precision,
}

/// What [`run_device`] returns: the trace, and on the last stage's device the mini-batch's mean
/// loss and, without training, its number of correctly predicted tokens.
pub struct StageOutcome {
    pub trace: StageTrace,
    pub loss: Option<f64>,
    pub hits: Option<i64>,
}

/// Runs `ops` on device `device`, which holds `stages`. Training (`options.train`), gradients
/// accumulate into the stages' parameters; otherwise `ops` must be forward passes only, run
/// without gradients, and the last stage counts the arg-max hits as well. `prev` leads to the
/// device of the stages before this device's (after the first stage), `next` to that of the
/// stages after them (before the last). A tensor-parallel shard of a stage runs its passes with
/// the other shards of its group `tp` (which see the same micro-batches).
#[allow(clippy::too_many_arguments)]
pub fn run_device<S: PipelineStage>(
    device: usize,
    stages: &[&S],
    ops: &[Op],
    batches: &MicroBatches,
    mut prev: Option<&mut dyn Link>,
    mut next: Option<&mut dyn Link>,
    options: StageOptions,
    tp: Option<&ProcessGroup>,
    clock: Instant,
) -> Result<StageOutcome> {
    let on = stages.first().context("a pipeline device holds at least one stage")?.device();
    let stage_of = |index: usize| {
        stages.iter().copied().find(|s| s.index() == index).with_context(|| format!("device {device} runs a pass of stage {index}, which it does not hold"))
    };
    let passes = Passes { device, on, batches, options, tp, generator: RefCell::new(Generator::new(on)?) };
    let mut state = DeviceState { saved: HashMap::new(), stash: Stash::default(), loss_sum: None, hits: Tensor::zeros([], (Kind::Int64, on)) };
    let stage_indices = stages.iter().map(|s| s.index()).collect();
    let mut trace = StageTrace { device, stages: stage_indices, intervals: Vec::with_capacity(ops.len()), peak_live: 0 };
    for &op in ops {
        let stage = stage_of(op.stage)?;
        // The interval starts once the neighbour's tensor is here: waiting is idle time.
        let start_s = match op.direction {
            Direction::Forward => passes.forward_op(&mut state, stage, op, prev.as_deref_mut(), next.as_deref_mut(), clock)?,
            Direction::Backward => passes.backward_op(&mut state, stage, op, prev.as_deref_mut(), next.as_deref_mut(), clock)?,
        };
        trace.peak_live = trace.peak_live.max(state.saved.len());
        // Kernels run asynchronously: wait for them so the interval is the stage's real work.
        crate::device::synchronize(on);
        trace.intervals.push(OpInterval { op, start_s, end_s: clock.elapsed().as_secs_f64() });
    }
    state.stash.check_empty()?;
    let last = stages.iter().any(|s| s.is_last());
    Ok(StageOutcome { trace, loss: state.loss_sum.map(|l| l.double_value(&[])), hits: (last && !options.train).then(|| state.hits.int64_value(&[])) })
}

/// What stays the same through one device's passes of a mini-batch.
struct Passes<'a> {
    device: usize,
    on: Device,
    batches: &'a MicroBatches,
    options: StageOptions,
    tp: Option<&'a ProcessGroup>,
    /// Draws the dropout masks (keyed: see [`Passes::forward`]).
    generator: RefCell<Generator>,
}

/// What one device's passes of a mini-batch accumulate.
struct DeviceState {
    /// Per (stage, micro-batch), what its forward pass left for its backward pass.
    saved: HashMap<(usize, usize), Saved>,
    /// Tensors a neighbour sent ahead of the pass that takes them.
    stash: Stash,
    /// The last stage's weighted losses, summed.
    loss_sum: Option<Tensor>,
    /// Evaluating: the last stage's correct predictions.
    hits: Tensor,
}

impl Passes<'_> {
    /// A stage's forward pass of micro-batch m, in the run's precision (autocast is per thread:
    /// this one's), its dropout masks keyed to the micro-batch (a recomputation redraws the same
    /// ones; the layers' whole-model indices key them further, whatever stage holds them).
    fn forward<S: PipelineStage>(&self, stage: &S, m: usize, input: &Tensor, train: bool) -> Result<Tensor> {
        let masks = Masks::Keyed { generator: &self.generator, key: mix_key(&[self.options.dropout_key, m as u64]), positions: self.batches.positions };
        crate::precision::autocast(self.options.precision, self.on, || stage.forward_masked(input, train, masks, self.tp))
    }

    /// A stage's output for micro-batch m: the last stage's is its weighted loss (and,
    /// evaluating, its hits added to the count).
    fn finish<S: PipelineStage>(&self, stage: &S, m: usize, output: Tensor, hits: Option<&mut Tensor>) -> Result<Tensor> {
        if !stage.is_last() {
            return Ok(output);
        }
        let (loss, counted) = stage.loss_and_hits(&output, &self.batches.targets[m], self.tp, hits.is_some())?;
        if let (Some(hits), Some(counted)) = (hits, counted) {
            *hits += counted;
        }
        Ok(loss * self.batches.weights[m])
    }

    fn missing(&self, side: &str, op: Op) -> anyhow::Error {
        anyhow::anyhow!("device {}: {op:?} needs a link to the {side} device, and has none", self.device)
    }

    /// `op`'s forward pass: its input from the batch or the previous device, its output to the
    /// next device or into the loss, and (training) what its backward pass needs saved. Returns
    /// when it started, its input here.
    fn forward_op<S: PipelineStage>(
        &self,
        state: &mut DeviceState,
        stage: &S,
        op: Op,
        prev: Option<&mut (dyn Link + '_)>,
        next: Option<&mut (dyn Link + '_)>,
        clock: Instant,
    ) -> Result<f64> {
        let (m, options) = (op.micro_batch, self.options);
        let input = match stage.is_first() {
            true => self.batches.inputs[m].shallow_clone(),
            false => {
                let link = prev.ok_or_else(|| self.missing("previous", op))?;
                state.stash.take(link, op, self.on)?.detach().set_requires_grad(options.train)
            }
        };
        let start_s = clock.elapsed().as_secs_f64();
        let output = if !options.train {
            tch::no_grad(|| self.finish(stage, m, self.forward(stage, m, &input, false)?, Some(&mut state.hits)))?
        } else if options.recompute {
            tch::no_grad(|| self.finish(stage, m, self.forward(stage, m, &input, true)?, None))?
        } else {
            self.finish(stage, m, self.forward(stage, m, &input, true)?, None)?
        };
        if stage.is_last() {
            let loss = output.detach();
            state.loss_sum = Some(match state.loss_sum.take() {
                Some(sum) => sum + loss,
                None => loss,
            });
        } else {
            let link = next.ok_or_else(|| self.missing("next", op))?;
            link.send(Op::forward(op.stage + 1, m), &output)?;
        }
        if options.train {
            let output = (!options.recompute).then_some(output);
            state.saved.insert((op.stage, m), Saved { input, output });
        }
        Ok(start_s)
    }

    /// `op`'s backward pass: from the loss (scaled) on the last stage, else from the gradient
    /// the next device sent, its forward recomputed where only its input was kept; the input's
    /// gradient to the previous device. Returns when it started, the gradient here.
    fn backward_op<S: PipelineStage>(
        &self,
        state: &mut DeviceState,
        stage: &S,
        op: Op,
        prev: Option<&mut (dyn Link + '_)>,
        next: Option<&mut (dyn Link + '_)>,
        clock: Instant,
    ) -> Result<f64> {
        let m = op.micro_batch;
        let grad = match stage.is_last() {
            true => None,
            false => Some(state.stash.take(next.ok_or_else(|| self.missing("next", op))?, op, self.on)?),
        };
        let start_s = clock.elapsed().as_secs_f64();
        let Saved { input, output } =
            state.saved.remove(&(op.stage, m)).with_context(|| format!("stage {}: backward of micro-batch {m} before its forward", op.stage))?;
        let output = match output {
            Some(output) => output,
            None => self.finish(stage, m, self.forward(stage, m, &input, self.options.train)?, None)?,
        };
        // (A tensor-parallel collective can fail inside LibTorch's backward: f_backward.)
        match grad {
            None if self.options.loss_scale == 1.0 => output.f_backward()?,
            None => (&output * self.options.loss_scale).f_backward()?,
            // Backward from a non-scalar output with upstream gradient `grad`: the
            // gradient of sum(output · grad) with respect to output is exactly `grad`
            // (tch's backward takes no gradient argument).
            Some(grad) => (&output * &grad).sum(output.kind()).f_backward()?,
        }
        if !stage.is_first() {
            let link = prev.ok_or_else(|| self.missing("previous", op))?;
            link.send(Op::backward(op.stage - 1, m), &input.grad())?;
        }
        Ok(start_s)
    }
}
