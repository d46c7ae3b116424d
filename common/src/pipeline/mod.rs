//! Pipeline parallelism for the Transformer language model (exercise3 `pipeline`): the model
//! cut into consecutive stages on several devices, each mini-batch split into micro-batches
//! that flow through the stages so that the stages work at the same time, as the course's
//! `Pipe` (GPipe) does.
//!
//! - [`Partition`]: which encoder layers each stage runs (by count, or balanced by measured
//!   cost); the embedding is on the first stage, the output layer on the last.
//! - [`Stage`]: a piece of the model with its own var store on its own device, variables named
//!   as in the whole model.
//! - [`schedule`]: GPipe's fill-drain or 1F1B, as a list of passes per stage.
//! - [`executor::run_stage`]: one stage's passes, exchanging activations and gradients with its
//!   neighbours over a [`link::Link`].
//! - [`Pipeline`]: all stages in one process, one thread per stage, joined by channels.
//! - [`process::StageProcess`]: one stage per process (`torch.distributed.pipelining`'s way),
//!   activations and gradients sent point-to-point through the process group (MPI for CPU
//!   tensors, NCCL for CUDA tensors), replicated `--dp` times for data parallelism.
//! - [`PipelineTrainer`]: what the training loop needs of either.
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
pub mod process;
pub mod schedule;
pub mod stage;

pub use in_process::Pipeline;
pub use partition::{LayerCosts, Partition};
pub use schedule::{Op, Schedule};
pub use stage::Stage;

use anyhow::Result;
use serde::Serialize;
use tch::Tensor;

use crate::data::text::TokenBatches;
use crate::error::usage;
use executor::StageTrace;

/// How the pipeline runs a mini-batch.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PipelineOptions {
    pub schedule: Schedule,
    /// Micro-batches per mini-batch.
    pub chunks: usize,
    /// Keep only each stage's input in the forward pass and recompute in the backward.
    pub checkpoint_activations: bool,
    /// LibTorch threads per stage thread (CPU stages); `None` leaves LibTorch's setting.
    pub threads_per_stage: Option<usize>,
    /// float32 or bfloat16 autocast (float16 would need loss scaling across the stages).
    pub precision: crate::precision::Precision,
}

/// What one mini-batch did.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// The mini-batch's mean loss.
    pub loss: f64,
    /// Correctly predicted tokens (evaluation only; 0 in training).
    pub hits: i64,
    pub wall_s: f64,
    /// Seconds each stage computed (its own waits excluded), in stage order.
    pub stage_busy_s: Vec<f64>,
    /// The passes of the stages this process ran, with their times.
    pub traces: Vec<StageTrace>,
}

impl StepReport {
    /// The measured idle share: 1 − (time the stages computed) / (stages × wall time).
    pub fn bubble_fraction(&self) -> f64 {
        if self.stage_busy_s.is_empty() || self.wall_s <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.stage_busy_s.iter().sum();
        (1.0 - busy / (self.stage_busy_s.len() as f64 * self.wall_s)).max(0.0)
    }
}

/// Sums over a pass of evaluation: combine them over data-parallel replicas by adding.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalSums {
    pub loss_sum: f64,
    pub hits: f64,
    pub tokens: f64,
}

impl EvalSums {
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.tokens.max(1.0)
    }

    pub fn accuracy(&self) -> f64 {
        self.hits / self.tokens.max(1.0)
    }
}

/// What a training loop needs of a pipeline, whether its stages are threads of this process
/// ([`Pipeline`]) or processes of a job ([`process::StageProcess`]).
pub trait PipelineTrainer {
    /// The variables this process trains, with their whole-model names.
    fn named_parameters(&self) -> Vec<(String, Tensor)>;

    /// The forward and backward passes of one mini-batch (`[seq_len, batch]` ids and targets);
    /// the gradients accumulate (zero them before, step after). The loss is known on every
    /// process. `dropout_key` keys the mini-batch's dropout masks (one per step of a seeded
    /// run: [`crate::models::mix_key`] of the seed and the step).
    fn train_step(&mut self, src: &Tensor, targets: &Tensor, dropout_key: u64) -> Result<StepReport>;

    /// Makes the gradients final before the optimizer step: averaged over data-parallel
    /// replicas, then scaled so that their total norm over the whole model is at most
    /// `max_norm` (`clip_grad_norm_`).
    fn finish_gradients(&mut self, params: &[Tensor], max_norm: Option<f64>) -> Result<()>;

    /// Loss and hits over one pass of `source` (forward passes only, dropout off), known on
    /// every process.
    fn evaluate(&mut self, source: &TokenBatches) -> Result<EvalSums>;
}

/// Sums over one pass of `source`, each batch through `run` (a pipeline's forward passes:
/// `(src, targets, train = false)`).
fn evaluate_batches(source: &TokenBatches, mut run: impl FnMut(&Tensor, &Tensor) -> Result<StepReport>) -> Result<EvalSums> {
    let mut sums = EvalSums::default();
    for batch in crate::train::BatchSource::epoch(source, 0) {
        let targets = batch.targets.reshape(batch.inputs.size());
        let report = run(&batch.inputs, &targets)?;
        let tokens = targets.numel() as f64;
        sums.loss_sum += report.loss * tokens;
        sums.hits += report.hits as f64;
        sums.tokens += tokens;
    }
    Ok(sums)
}

/// Splits `batch` (`[seq_len, batch]` ids) along the batch dimension into `chunks` parts as even
/// as possible (sizes differ by at most one; `torch.chunk` would make fewer, larger chunks) and
/// returns them with their shares of the batch.
pub fn split_batch(batch: &Tensor, chunks: usize) -> Result<(Vec<Tensor>, Vec<f64>)> {
    let n = batch.size()[1];
    if chunks == 0 || chunks as i64 > n {
        return usage(format!(
            "--chunks {chunks} must be between 1 and the batch's {n} sequences (each micro-batch needs one)"
        ));
    }
    let (base, extra) = (n / chunks as i64, n % chunks as i64);
    let sizes: Vec<i64> = (0..chunks as i64).map(|i| base + i64::from(i < extra)).collect();
    let parts = batch.split_with_sizes(&sizes, 1);
    Ok((parts, sizes.iter().map(|&s| s as f64 / n as f64).collect()))
}

/// The micro-batch count for a batch of `batch` sequences: `chunks`, or fewer for a smaller
/// batch (evaluation batches, the last batch of a split).
pub fn chunks_for(chunks: usize, batch: i64) -> usize {
    chunks.min(batch.max(1) as usize)
}
