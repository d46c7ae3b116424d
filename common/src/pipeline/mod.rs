//! Pipeline parallelism for the Transformer language model (exercise3 `pipeline`): the model
//! cut into consecutive stages on several devices, each mini-batch split into micro-batches
//! that flow through the stages so that the stages work at the same time, as the course's
//! `Pipe` (GPipe) does.
//!
//! - [`Partition`]: which encoder layers each stage runs (by count, or balanced by measured
//!   cost); the embedding is on the first stage, the output layer on the last.
//! - [`Placement`]: which device runs each stage: one stage per device, or with the interleaved
//!   schedule `virtual_stages` per device (stage `s` on device `s mod devices`).
//! - [`Stage`]: a piece of the model with its own var store on its own device, variables named
//!   as in the whole model; [`sequential`] the slides' `Pipe` example, two `Linear` layers. Both
//!   are [`executor::PipelineStage`]s, what the executor runs.
//! - [`schedule`]: GPipe's fill-drain, 1F1B or interleaved 1F1B, as a list of passes per
//!   device.
//! - [`executor::run_device`]: one device's passes, exchanging activations and gradients with
//!   its neighbours over a [`link::Link`], tagged with the pass they feed.
//! - [`Pipeline`]: all stages in one process, one thread per device, joined by channels
//!   ([`in_process::run_in_threads`], for any stages).
//! - [`process::StageProcess`]: one stage per process (`torch.distributed.pipelining`'s way),
//!   activations and gradients sent point-to-point through the process group (MPI for CPU
//!   tensors, NCCL for CUDA tensors), replicated `--dp` times for data parallelism.
//! - Both are [`crate::train::TrainStep`]s: the one training loop trains them like any model.
//!
//! Gradients are exactly those of the whole model on the whole mini-batch (up to float
//! rounding): each micro-batch's mean loss is weighted by its share of the sequences, so the
//! weighted losses sum to the mini-batch's mean, and the gradients accumulate over the
//! micro-batches before one optimizer step.
//!
//! Dropout masks are keyed, not drawn from LibTorch's shared generator: micro-batch `m` of a
//! step draws each layer's masks from a generator seeded with (step key, m, layer, site)
//! ([`crate::models::Masks::Keyed`]). A seeded run therefore trains the same model whatever the
//! number of stages, where the cuts fall (`--balance` measures time, which differs between
//! machines), the schedule, or which stage thread reaches a generator first; and a recomputed
//! forward pass (`--checkpoint-activations`) redraws the masks of the original, as
//! `torch.utils.checkpoint` does with its default `preserve_rng_state=True`. (The unpartitioned
//! exercise1_nlp model keeps torch's shared-generator masks, bit for bit the tutorial's.)
pub mod executor;
pub mod in_process;
pub mod link;
pub mod partition;
pub mod placement;
pub mod process;
pub mod schedule;
pub mod sequential;
pub mod stage;

pub use in_process::Pipeline;
pub use partition::{LayerCosts, Partition};
pub use placement::Placement;
pub use schedule::{Direction, Op, Schedule};
pub use stage::Stage;

use anyhow::Result;
use serde::Serialize;
use tch::Tensor;

use tch::Device;

use crate::error::usage;
use crate::parallel::{ParallelStep, Peers};
use crate::precision::Precision;
use crate::train::{Batch, BatchSource, EvalSums, StepContext, StepOutput, StepSync, TrainStep};
use executor::{StageOptions, StageTrace};

/// How the pipeline runs a mini-batch.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PipelineOptions {
    pub schedule: Schedule,
    /// Stages per device: 1, or more with the interleaved schedule ([`Placement`]).
    pub virtual_stages: usize,
    /// Micro-batches per mini-batch.
    pub chunks: usize,
    /// Keep only each stage's input in the forward pass and recompute in the backward.
    pub checkpoint_activations: bool,
    /// LibTorch threads per stage thread (CPU stages); `None` leaves LibTorch's setting.
    pub threads_per_stage: Option<usize>,
}

/// What one mini-batch did.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// The mini-batch's mean loss.
    pub loss: f64,
    /// Correctly predicted tokens (evaluation only; 0 in training).
    pub hits: i64,
    pub wall_s: f64,
    /// Seconds each device computed (its own waits excluded), in pipeline order.
    pub stage_busy_s: Vec<f64>,
    /// The passes of the devices this process ran, with their times.
    pub traces: Vec<StageTrace>,
}

impl StepReport {
    /// The measured idle share: 1 − (time the devices computed) / (devices × wall time).
    pub fn bubble_fraction(&self) -> f64 {
        if self.stage_busy_s.is_empty() || self.wall_s <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.stage_busy_s.iter().sum();
        (1.0 - busy / (self.stage_busy_s.len() as f64 * self.wall_s)).max(0.0)
    }

    /// The training loop's view of it: the loss summed over `tokens`, the phase, the traces,
    /// the busy and elapsed stage-seconds.
    fn into_output(self, tokens: usize, started: std::time::Instant) -> StepOutput {
        let busy: f64 = self.stage_busy_s.iter().sum();
        let elapsed = self.stage_busy_s.len() as f64 * self.wall_s;
        StepOutput {
            loss_sum: Some(Tensor::from(self.loss * tokens as f64)),
            hits: None,
            examples: tokens,
            phases: vec![("forward+backward", started, std::time::Instant::now())],
            stage_traces: self.traces.iter().map(StageTrace::for_profile).collect(),
            stage_busy: Some((busy, elapsed)),
        }
    }
}

/// What both pipeline steps are made of, whether the stages run as threads of this process
/// ([`Pipeline`]) or one per process ([`process::StageProcess`]): the stages, who they work
/// with, their options and one mini-batch through them. Both are trained through the one
/// [`TrainStep`] below.
pub trait Staged<'g> {
    /// The stages this step runs (all of the model's, or this rank's), how they run, and who
    /// they work with.
    fn parts(&self) -> (&[Stage], &PipelineOptions, &Peers<'g>);

    /// One mini-batch (`src`, `targets`) through the stages, run as `options` say.
    fn run_stages(&mut self, src: &Tensor, targets: &Tensor, options: StageOptions) -> Result<StepReport>;
}

/// How the stages run a mini-batch: `train`ing or not, in `precision`, their losses scaled by
/// `loss_scale` (an accumulated step's share, float16's scale).
fn stage_options(options: &PipelineOptions, train: bool, precision: Precision, dropout_key: u64, loss_scale: f64) -> StageOptions {
    StageOptions { dropout_key, recompute: options.checkpoint_activations, train, precision, loss_scale }
}

impl<'g, S: Staged<'g>> ParallelStep<'g> for S {
    fn peers(&self) -> &Peers<'g> {
        self.parts().2
    }
}

impl<'g, S: Staged<'g>> TrainStep<'g> for S {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.parts().0.iter().flat_map(Stage::named_parameters).collect()
    }

    fn named_variables(&self) -> Vec<(String, Tensor)> {
        self.named_parameters()
    }

    fn input_device(&self) -> Device {
        self.parts().0[0].device()
    }

    fn sync(&self) -> &dyn StepSync<'g> {
        self.parts().2
    }

    fn forward_backward(&mut self, batch: &Batch, weight: f64, ctx: &StepContext) -> Result<StepOutput> {
        let scale = ctx.scaler.map_or(1.0, |s| s.scale_value());
        let options = stage_options(self.parts().1, true, ctx.precision, ctx.dropout_key, weight * scale);
        let targets = batch.targets.reshape(batch.inputs.size());
        let started = std::time::Instant::now();
        Ok(self.run_stages(&batch.inputs, &targets, options)?.into_output(batch.len(), started))
    }

    fn evaluate(&mut self, source: &dyn BatchSource, precision: Precision) -> Result<EvalSums> {
        let options = stage_options(self.parts().1, false, precision, 0, 1.0);
        evaluate_batches(source, |src, targets| self.run_stages(src, targets, options))
    }
}

/// Sums over one pass of `source`, each batch through `run` (a pipeline's forward passes:
/// `(src, targets)`).
fn evaluate_batches(source: &dyn BatchSource, mut run: impl FnMut(&Tensor, &Tensor) -> Result<StepReport>) -> Result<EvalSums> {
    let mut sums = EvalSums::default();
    for batch in source.epoch(0) {
        let batch = batch?;
        let targets = batch.targets.reshape(batch.inputs.size());
        let report = run(&batch.inputs, &targets)?;
        let tokens = targets.numel() as f64;
        sums.loss_sum += report.loss * tokens;
        sums.hits += report.hits as f64;
        sums.examples += tokens;
    }
    Ok(sums)
}

/// Splits `batch` (`[seq_len, batch]` ids) along the batch dimension into `chunks` parts as even
/// as possible (sizes differ by at most one; `torch.chunk` would make fewer, larger chunks) and
/// returns them with their shares of the batch.
pub fn split_batch(batch: &Tensor, chunks: usize) -> Result<(Vec<Tensor>, Vec<f64>)> {
    split_along(batch, chunks, 1, "sequences")
}

/// [`split_batch`] along dimension `dim`, whose entries are `what` (for the message).
pub fn split_along(batch: &Tensor, chunks: usize, dim: i64, what: &str) -> Result<(Vec<Tensor>, Vec<f64>)> {
    let n = batch.size()[dim as usize];
    if chunks == 0 || chunks as i64 > n {
        return usage(format!("--chunks {chunks} must be between 1 and the batch's {n} {what} (each micro-batch needs one)"));
    }
    let (base, extra) = (n / chunks as i64, n % chunks as i64);
    let sizes: Vec<i64> = (0..chunks as i64).map(|i| base + i64::from(i < extra)).collect();
    let parts = batch.split_with_sizes(&sizes, dim);
    Ok((parts, sizes.iter().map(|&s| s as f64 / n as f64).collect()))
}

/// The micro-batch count for a batch of `batch` sequences: `chunks`, or fewer for a smaller
/// batch (evaluation batches, the last batch of a split).
pub fn chunks_for(chunks: usize, batch: i64) -> usize {
    chunks.min(batch.max(1) as usize)
}
