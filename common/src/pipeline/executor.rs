//! Runs one stage's share of a mini-batch: its forward and backward passes in the order of its
//! schedule, activations in from the previous stage and out to the next, gradients the other
//! way. The same function runs a stage thread in one process and a stage process across
//! processes; only the [`Link`]s differ.
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;
use tch::{Kind, Tensor};

use super::link::Link;
use crate::dist::ProcessGroup;
use crate::models::{mix_key, Masks};
use crate::torch_ext::Generator;
use super::schedule::Op;
use super::stage::Stage;

/// The micro-batches as the first and last stage see them.
pub struct MicroBatches {
    /// Token ids per micro-batch, on the first stage's device (empty on other stages).
    pub inputs: Vec<Tensor>,
    /// Target ids per micro-batch, on the last stage's device (empty on other stages).
    pub targets: Vec<Tensor>,
    /// Each micro-batch's share of the mini-batch (its sequences / all sequences): the
    /// weighted micro-batch losses sum to the mini-batch's mean loss.
    pub weights: Vec<f64>,
}

/// When a stage ran which pass, in seconds since the mini-batch started.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OpInterval {
    pub op: Op,
    pub start_s: f64,
    pub end_s: f64,
}

/// What one stage did during a mini-batch.
#[derive(Debug, Clone, Serialize)]
pub struct StageTrace {
    pub stage: usize,
    pub intervals: Vec<OpInterval>,
    /// The most micro-batches whose activations the stage held at once.
    pub peak_live: usize,
}

impl StageTrace {
    /// Seconds the stage spent computing (its intervals' total length).
    pub fn busy_s(&self) -> f64 {
        self.intervals.iter().map(|i| i.end_s - i.start_s).sum()
    }
}

/// What a forward pass leaves for its backward pass.
struct Saved {
    /// The stage's input: token ids on the first stage, else a leaf requiring grad whose
    /// gradient goes back to the previous stage.
    input: Tensor,
    /// The output with its autograd graph (the weighted loss on the last stage); `None` with
    /// activation recomputation, where only the input is kept.
    output: Option<Tensor>,
}

/// Options of [`run_stage`].
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

/// What [`run_stage`] returns: the trace, and on the last stage the mini-batch's mean loss and,
/// without training, its number of correctly predicted tokens.
pub struct StageOutcome {
    pub trace: StageTrace,
    pub loss: Option<f64>,
    pub hits: Option<i64>,
}

/// Runs `ops` on `stage`. Training (`options.train`), gradients accumulate into the stage's
/// parameters; otherwise `ops` must be forward passes only, run without gradients, and the last
/// stage counts the arg-max hits as well. A tensor-parallel shard of a stage runs its passes
/// with the other shards of its group `tp` (which see the same micro-batches).
#[allow(clippy::too_many_arguments)]
pub fn run_stage(
    stage: &Stage,
    ops: &[Op],
    batches: &MicroBatches,
    mut prev: Option<&mut dyn Link>,
    mut next: Option<&mut dyn Link>,
    options: StageOptions,
    tp: Option<&ProcessGroup>,
    clock: Instant,
) -> Result<StageOutcome> {
    let device = stage.device();
    let mut saved: HashMap<usize, Saved> = HashMap::new();
    let mut loss_sum: Option<Tensor> = None;
    let mut hits = Tensor::zeros([], (Kind::Int64, device));
    let mut trace = StageTrace { stage: stage.index, intervals: Vec::with_capacity(ops.len()), peak_live: 0 };
    // The stage's forward pass of micro-batch m, in the run's precision (autocast is per
    // thread: this one's), its dropout masks keyed to the micro-batch (a recomputation redraws
    // the same ones).
    let generator = RefCell::new(Generator::new(device)?);
    let forward = |m: usize, input: &Tensor, train: bool| -> Result<Tensor> {
        let masks = Masks::Keyed { generator: &generator, key: mix_key(&[options.dropout_key, m as u64]) };
        crate::precision::autocast(options.precision, device, || stage.forward_masked(input, train, masks, tp))
    };
    // The last stage's output for micro-batch m: its weighted loss (and, evaluating, its hits
    // added to the count).
    let finish = |m: usize, output: Tensor, hits: Option<&mut Tensor>| -> Result<Tensor> {
        if !stage.is_last() {
            return Ok(output);
        }
        let (loss, counted) = stage.loss_and_hits(&output, &batches.targets[m], tp, hits.is_some())?;
        if let (Some(hits), Some(counted)) = (hits, counted) {
            *hits += counted;
        }
        Ok(loss * batches.weights[m])
    };
    for &op in ops {
        // The interval starts once the neighbour's tensor is here: waiting is idle time.
        let start_s;
        match op {
            Op::Forward(m) => {
                let input = match prev.as_deref_mut() {
                    None => batches.inputs[m].shallow_clone(),
                    Some(link) => link.recv(device)?.detach().set_requires_grad(options.train),
                };
                start_s = clock.elapsed().as_secs_f64();
                let output = if !options.train {
                    tch::no_grad(|| finish(m, forward(m, &input, false)?, Some(&mut hits)))?
                } else if options.recompute {
                    tch::no_grad(|| finish(m, forward(m, &input, true)?, None))?
                } else {
                    finish(m, forward(m, &input, true)?, None)?
                };
                if let Some(link) = next.as_deref_mut() {
                    link.send(&output)?;
                } else {
                    let loss = output.detach();
                    loss_sum = Some(match loss_sum {
                        Some(sum) => sum + loss,
                        None => loss,
                    });
                }
                if options.train {
                    let output = (!options.recompute).then_some(output);
                    saved.insert(m, Saved { input, output });
                    trace.peak_live = trace.peak_live.max(saved.len());
                }
            }
            Op::Backward(m) => {
                let grad = match next.as_deref_mut() {
                    None => None,
                    Some(link) => Some(link.recv(device)?),
                };
                start_s = clock.elapsed().as_secs_f64();
                let Saved { input, output } = saved
                    .remove(&m)
                    .with_context(|| format!("stage {}: backward of micro-batch {m} before its forward", stage.index))?;
                let output = match output {
                    Some(output) => output,
                    None => finish(m, forward(m, &input, options.train)?, None)?,
                };
                // (A tensor-parallel collective can fail inside LibTorch's backward: f_backward.)
                match grad {
                    None if options.loss_scale == 1.0 => output.f_backward()?,
                    None => (&output * options.loss_scale).f_backward()?,
                    // Backward from a non-scalar output with upstream gradient `grad`: the
                    // gradient of sum(output · grad) with respect to output is exactly `grad`
                    // (tch's backward takes no gradient argument).
                    Some(grad) => (&output * &grad).sum(output.kind()).f_backward()?,
                }
                if let Some(link) = prev.as_deref_mut() {
                    link.send(&input.grad())?;
                }
            }
        }
        // Kernels run asynchronously: wait for them so the interval is the stage's real work.
        crate::device::synchronize(device);
        trace.intervals.push(OpInterval { op, start_s, end_s: clock.elapsed().as_secs_f64() });
    }
    let last = stage.is_last();
    Ok(StageOutcome {
        trace,
        loss: loss_sum.map(|l| l.double_value(&[])),
        hits: (last && !options.train).then(|| hits.int64_value(&[])),
    })
}
