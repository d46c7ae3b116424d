//! All stages of a pipeline in one process (the course's `Pipe`): one thread per stage, the
//! threads joined by channels, the stages' var stores on their own devices.
use std::time::Instant;

use anyhow::{anyhow, Result};
use tch::{Device, Tensor};

use super::executor::{self, MicroBatches, StageOptions, StageOutcome};
use super::link::{ChannelLink, Link, NeighbourGone};
use super::{schedule, split_batch, Op, Partition, PipelineOptions, Stage, StepReport};
use crate::error::usage;
use crate::models::TransformerConfig;
use crate::precision::Precision;
use crate::train::{Batch, BatchSource, EvalSums, Parallel, StepContext, StepOutput, TrainStep};

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
            .collect::<Result<_, _>>()?;
        Ok(Pipeline { config: *cfg, stages, options })
    }

    /// Logits `[seq_len, batch, ntoken]` for token ids `src` (on the last stage's device),
    /// stage after stage, without pipelining.
    pub fn forward_t(&self, src: &Tensor, train: bool) -> Tensor {
        self.stages.iter().fold(src.shallow_clone(), |xs, stage| stage.forward_t(&xs.to_device(stage.device()), train))
    }

    /// One mini-batch through the pipeline, the stages running concurrently in threads: with
    /// `train`, forward and backward passes in the schedule's order (gradients accumulate);
    /// without, forward passes only.
    pub fn run_batch(&mut self, src: &Tensor, targets: &Tensor, options: StageOptions) -> Result<StepReport> {
        let train = options.train;
        let chunks = if train { self.options.chunks } else { super::chunks_for(self.options.chunks, src.size()[1]) };
        let (inputs, weights) = split_batch(src, chunks)?;
        let (targets, _) = split_batch(targets, chunks)?;
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

        let schedule = self.options.schedule;
        let threads = self.options.threads_per_stage;
        let clock = Instant::now();
        let results: Vec<Result<StageOutcome>> = std::thread::scope(|scope| {
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
                        let ops = match train {
                            true => schedule::stage_ops(schedule, stage.index, count, chunks),
                            false => (0..chunks).map(Op::Forward).collect(),
                        };
                        executor::run_stage(
                            stage,
                            &ops,
                            &batches,
                            prev.as_mut().map(|l| l as &mut dyn Link),
                            next.as_mut().map(|l| l as &mut dyn Link),
                            options,
                            None,
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
        let mut report = StepReport { loss: f64::NAN, hits: 0, wall_s, stage_busy_s: Vec::new(), traces: Vec::new() };
        let mut consequence = None;
        for (i, result) in results.into_iter().enumerate() {
            match result {
                Ok(outcome) => {
                    report.stage_busy_s.push(outcome.trace.busy_s());
                    report.traces.push(outcome.trace);
                    if let Some(loss) = outcome.loss {
                        report.loss = loss;
                    }
                    report.hits += outcome.hits.unwrap_or(0);
                }
                // A stage that stopped because its neighbour did: report the neighbour's error.
                Err(err) if err.is::<NeighbourGone>() => consequence = consequence.or(Some(err.context(format!("pipeline stage {i}")))),
                Err(err) => return Err(err.context(format!("pipeline stage {i}"))),
            }
        }
        match consequence {
            Some(err) => Err(err),
            None => Ok(report),
        }
    }
}

impl Pipeline {
    /// The forward and backward passes of one mini-batch (`[seq_len, batch]` ids and targets)
    /// in float32, gradients accumulating, dropout keyed by `dropout_key`: the bare step, for
    /// benchmarks and notebooks (the training loop goes through [`TrainStep`]).
    pub fn train_step(&mut self, src: &Tensor, targets: &Tensor, dropout_key: u64) -> Result<StepReport> {
        let options = self.stage_options(true, Precision::Full, dropout_key, 1.0);
        self.run_batch(src, targets, options)
    }

    /// How its stages run a mini-batch: `train`ing or not, in `precision`.
    pub fn stage_options(&self, train: bool, precision: Precision, dropout_key: u64, loss_scale: f64) -> StageOptions {
        StageOptions { dropout_key, recompute: self.options.checkpoint_activations, train, precision, loss_scale }
    }
}

impl<'g> TrainStep<'g> for Pipeline {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.stages.iter().flat_map(Stage::named_parameters).collect()
    }

    fn named_variables(&self) -> Vec<(String, Tensor)> {
        self.named_parameters()
    }

    fn input_device(&self) -> Device {
        self.stages[0].device()
    }

    /// All stages are in this process: nobody to agree with.
    fn parallel(&self) -> Parallel<'g> {
        Parallel::default()
    }

    fn forward_backward(&mut self, batch: &Batch, weight: f64, ctx: &StepContext) -> Result<StepOutput> {
        let scale = ctx.scaler.map_or(1.0, |s| s.scale_value());
        let options = self.stage_options(true, ctx.precision, ctx.dropout_key, weight * scale);
        let targets = batch.targets.reshape(batch.inputs.size());
        let started = std::time::Instant::now();
        Ok(self.run_batch(&batch.inputs, &targets, options)?.into_output(batch.len(), started))
    }

    fn evaluate(&mut self, source: &dyn BatchSource, precision: Precision) -> Result<EvalSums> {
        let options = self.stage_options(false, precision, 0, 1.0);
        super::evaluate_batches(source, |src, targets| self.run_batch(src, targets, options))
    }
}
