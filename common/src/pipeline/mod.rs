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
//!
//! Gradients are exactly those of the whole model on the whole mini-batch (up to float
//! rounding): each micro-batch's mean loss is weighted by its share of the sequences, so the
//! weighted losses sum to the mini-batch's mean, and the gradients accumulate over the
//! micro-batches before one optimizer step. With dropout, the micro-batches draw their masks
//! from LibTorch's shared generator in whatever order the stage threads reach it, so a run is
//! not repeatable bit for bit (the unpartitioned model draws other masks anyway); with
//! `--checkpoint-activations`, the recomputed forward draws new masks, as
//! `torch.utils.checkpoint(preserve_rng_state=False)` does.
pub mod executor;
pub mod link;
pub mod partition;
pub mod schedule;
pub mod stage;

pub use partition::{LayerCosts, Partition};
pub use schedule::{Op, Schedule};
pub use stage::Stage;

use std::time::Instant;

use anyhow::{anyhow, Result};
use serde::Serialize;
use tch::{Device, Tensor};

use crate::error::usage;
use crate::models::TransformerConfig;
use executor::{MicroBatches, StageOptions, StageTrace};
use link::{ChannelLink, Link, NeighbourGone};

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
}

/// What one training mini-batch did.
#[derive(Debug, Clone, Serialize)]
pub struct StepReport {
    /// The mini-batch's mean loss.
    pub loss: f64,
    pub wall_s: f64,
    pub traces: Vec<StageTrace>,
}

impl StepReport {
    /// The measured idle share: 1 − (time the stages computed) / (stages × wall time).
    pub fn bubble_fraction(&self) -> f64 {
        bubble_fraction(&self.traces, self.wall_s)
    }
}

/// 1 − Σ busy / (stages × span): the share of the stages' time spent waiting.
pub fn bubble_fraction(traces: &[StageTrace], wall_s: f64) -> f64 {
    if traces.is_empty() || wall_s <= 0.0 {
        return 0.0;
    }
    let busy: f64 = traces.iter().map(StageTrace::busy_s).sum();
    (1.0 - busy / (traces.len() as f64 * wall_s)).max(0.0)
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

/// All stages of a pipeline in one process.
pub struct Pipeline {
    /// The whole model's configuration.
    pub config: TransformerConfig,
    pub stages: Vec<Stage>,
    pub options: PipelineOptions,
}

impl Pipeline {
    /// Builds one stage per device with `partition`'s layers (see [`Stage::new`] for `seed`).
    pub fn new(cfg: &TransformerConfig, partition: &Partition, devices: &[Device], seed: u64, options: PipelineOptions) -> Result<Pipeline> {
        if devices.len() != partition.stages() {
            return usage(format!("{} devices for {} stages", devices.len(), partition.stages()));
        }
        if options.chunks == 0 {
            return usage("--chunks must be at least 1");
        }
        let stages = devices
            .iter()
            .zip(&partition.layers)
            .enumerate()
            .map(|(i, (&device, layers))| Stage::new(cfg, i, devices.len(), layers.clone(), device, seed))
            .collect();
        Ok(Pipeline { config: *cfg, stages, options })
    }

    /// Every stage's trainable variables, with their whole-model names.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.stages.iter().flat_map(Stage::named_parameters).collect()
    }

    /// Logits `[seq_len, batch, ntoken]` for token ids `src` (on the last stage's device),
    /// stage after stage, without pipelining: for evaluation.
    pub fn forward_t(&self, src: &Tensor, train: bool) -> Tensor {
        self.stages.iter().fold(src.shallow_clone(), |xs, stage| stage.forward_t(&xs.to_device(stage.device()), train))
    }

    /// One training mini-batch: the forward and backward passes of its micro-batches, the
    /// stages running concurrently in threads; the parameters' gradients accumulate (call the
    /// optimizer's `zero_grad` before and `step` after).
    pub fn train_step(&mut self, src: &Tensor, targets: &Tensor) -> Result<StepReport> {
        let (inputs, weights) = split_batch(src, self.options.chunks)?;
        let (targets, _) = split_batch(targets, self.options.chunks)?;
        let count = self.stages.len();
        // What each stage needs of the batch: the inputs on the first stage's device, the
        // targets on the last's.
        let batches: Vec<MicroBatches> = self
            .stages
            .iter()
            .map(|stage| MicroBatches {
                inputs: match stage.is_first() {
                    true => inputs.iter().map(|t| t.to_device(stage.device())).collect(),
                    false => Vec::new(),
                },
                targets: match stage.is_last() {
                    true => targets.iter().map(|t| t.to_device(stage.device())).collect(),
                    false => Vec::new(),
                },
                weights: weights.clone(),
            })
            .collect();

        // Links between stage s and s + 1: s holds `.0` as its next, s + 1 holds `.1` as its prev.
        let (mut nexts, mut prevs): (Vec<Option<ChannelLink>>, Vec<Option<ChannelLink>>) = (vec![], vec![None]);
        for _ in 1..count {
            let (earlier, later) = ChannelLink::pair();
            nexts.push(Some(earlier));
            prevs.push(Some(later));
        }
        nexts.push(None);

        let options = StageOptions { recompute: self.options.checkpoint_activations, train: true };
        let schedule = self.options.schedule;
        let chunks = self.options.chunks;
        let threads = self.options.threads_per_stage;
        let clock = Instant::now();
        let results: Vec<Result<(StageTrace, Option<Tensor>)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .stages
                .iter_mut()
                .zip(batches)
                .zip(prevs.into_iter().zip(nexts))
                .map(|((stage, batches), (mut prev, mut next))| {
                    scope.spawn(move || {
                        let stage: &Stage = stage;
                        if let Some(n) = threads {
                            tch::set_num_threads(n as i32);
                        }
                        let ops = schedule::stage_ops(schedule, stage.index, count, chunks);
                        executor::run_stage(
                            stage,
                            &ops,
                            &batches,
                            prev.as_mut().map(|l| l as &mut dyn Link),
                            next.as_mut().map(|l| l as &mut dyn Link),
                            options,
                            clock,
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(i, handle)| handle.join().unwrap_or_else(|_| Err(anyhow!("pipeline stage {i} panicked"))))
                .collect()
        });
        let wall_s = clock.elapsed().as_secs_f64();
        let mut traces = Vec::with_capacity(count);
        let mut loss = None;
        let mut consequences = Vec::new();
        for (i, result) in results.into_iter().enumerate() {
            match result {
                Ok((trace, stage_loss)) => {
                    traces.push(trace);
                    loss = loss.or(stage_loss);
                }
                // A stage that stopped because its neighbour did: report the neighbour's error.
                Err(err) if err.is::<NeighbourGone>() => consequences.push(i),
                Err(err) => return Err(err.context(format!("pipeline stage {i}"))),
            }
        }
        if let Some(i) = consequences.first() {
            return Err(anyhow!(NeighbourGone).context(format!("pipeline stage {i}")));
        }
        let loss = loss.expect("the last stage computes the loss").double_value(&[]);
        Ok(StepReport { loss, wall_s, traces })
    }
}
