//! All stages of a pipeline in one process (the course's `Pipe`): one thread per device (each
//! running its stage, or with interleaving its stages), the threads joined by channels, the
//! stages' var stores on their devices.
use std::time::Instant;

use anyhow::{anyhow, Result};
use tch::{Device, Tensor};

use super::executor::{self, MicroBatches, PipelineStage, StageOptions, StageOutcome};
use super::link::{ChannelLink, Link, NeighbourGone};
use super::{schedule, split_batch, Partition, PipelineOptions, Placement, Schedule, Stage, Staged, StepReport};
use crate::error::usage;
use crate::models::TransformerConfig;
use crate::parallel::Peers;
use crate::precision::Precision;

/// All stages of a pipeline in one process.
pub struct Pipeline {
    /// The whole model's configuration.
    pub config: TransformerConfig,
    /// Every stage, in model order; stage `s` on device `placement.device_of(s)`.
    pub stages: Vec<Stage>,
    pub placement: Placement,
    pub options: PipelineOptions,
    /// Alone: nobody to agree with.
    peers: Peers<'static>,
}

impl Pipeline {
    /// Builds `partition`'s stages on `devices` (one device thread each, holding
    /// `options.virtual_stages` stages; see [`Stage::new`] for `seed`).
    pub fn new(cfg: &TransformerConfig, partition: &Partition, devices: &[Device], seed: u64, options: PipelineOptions) -> Result<Pipeline> {
        let placement = Placement { devices: devices.len(), virtual_stages: options.virtual_stages };
        placement.check(options.schedule, options.chunks)?;
        placement.check_layers(cfg.nlayers)?;
        if placement.stages() != partition.stages() {
            return match placement.virtual_stages {
                1 => usage(format!("{} devices for {} stages", devices.len(), partition.stages())),
                v => usage(format!("{} devices × {v} virtual stages for {} stages", devices.len(), partition.stages())),
            };
        }
        if options.chunks == 0 {
            return usage("--chunks must be at least 1");
        }
        let stages = partition
            .layers
            .iter()
            .enumerate()
            .map(|(s, layers)| Stage::new(cfg, s, partition.stages(), layers.clone(), devices[placement.device_of(s)], seed))
            .collect::<Result<_, _>>()?;
        Ok(Pipeline { config: *cfg, stages, placement, options, peers: Peers::default() })
    }

    /// Logits `[seq_len, batch, ntoken]` for token ids `src` (on the last stage's device),
    /// stage after stage, without pipelining.
    pub fn forward_t(&self, src: &Tensor, train: bool) -> Tensor {
        self.stages.iter().fold(src.shallow_clone(), |xs, stage| stage.forward_t(&xs.to_device(stage.device()), train))
    }

    /// One mini-batch through the pipeline, the devices running concurrently in threads: with
    /// `train`, forward and backward passes in the schedule's order (gradients accumulate);
    /// without, forward passes only.
    pub fn run_batch(&mut self, src: &Tensor, targets: &Tensor, options: StageOptions) -> Result<StepReport> {
        let chunks = if options.train { self.options.chunks } else { super::chunks_for(self.options.chunks, src.size()[1]) };
        let (inputs, weights) = split_batch(src, chunks)?;
        let (targets, _) = split_batch(targets, chunks)?;
        let batches = MicroBatches { inputs, targets, weights, positions: src.size()[0] };
        run_in_threads(&mut self.stages, self.placement, self.options.schedule, self.options.threads_per_stage, &batches, options)
    }
}

/// One mini-batch, already cut into `batches`, through `stages` (in model order, stage `s` on
/// device `placement.device_of(s)`), the devices running concurrently in threads joined by
/// channels: with `options.train`, forward and backward passes in `schedule`'s order (gradients
/// accumulate); without, forward passes only. `threads`: LibTorch threads per device thread.
pub fn run_in_threads<S: PipelineStage + Send>(
    stages: &mut [S],
    placement: Placement,
    schedule: Schedule,
    threads: Option<usize>,
    batches: &MicroBatches,
    options: StageOptions,
) -> Result<StepReport> {
    let train = options.train;
    let chunks = batches.inputs.len();
    let held = stages_by_device(stages, placement);
    let placed = batches_by_device(&held, batches);
    let (prevs, nexts) = channel_links(placement);
    let clock = Instant::now();
    // `--profile`: the stages' threads record into LibTorch's profiler as this one does.
    let profiler = crate::torch_ext::ProfilerThreadState::current();
    let profiler = &profiler;
    let results: Vec<Result<StageOutcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = held
            .into_iter()
            .zip(placed)
            .zip(prevs.into_iter().zip(nexts))
            .enumerate()
            .map(|(device, ((stages, batches), (mut prev, mut next)))| {
                scope.spawn(move || {
                    let _recorded = profiler.as_ref().map(|p| p.join());
                    let stages: Vec<&S> = stages.into_iter().map(|s| &*s).collect();
                    if let Some(n) = threads {
                        tch::set_num_threads(n as i32);
                    }
                    let ops = match train {
                        true => schedule::device_ops(schedule, placement, device, chunks),
                        false => schedule::forward_ops(placement, device, chunks),
                    };
                    executor::run_device(
                        device,
                        &stages,
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
        handles.into_iter().enumerate().map(|(i, handle)| handle.join().unwrap_or_else(|_| Err(anyhow!("pipeline stage {i} panicked")))).collect()
    });
    step_report(results, clock.elapsed().as_secs_f64())
}

/// Each device's stages, in model order.
fn stages_by_device<S: PipelineStage>(stages: &mut [S], placement: Placement) -> Vec<Vec<&mut S>> {
    let mut held: Vec<Vec<&mut S>> = (0..placement.devices).map(|_| Vec::new()).collect();
    for stage in stages.iter_mut() {
        held[placement.device_of(stage.index())].push(stage);
    }
    held
}

/// What each device needs of the batch: the inputs on the first stage's device, the targets
/// on the last's.
fn batches_by_device<S: PipelineStage>(held: &[Vec<&mut S>], batches: &MicroBatches) -> Vec<MicroBatches> {
    held.iter()
        .map(|stages| {
            let on = stages[0].device();
            let here = |wanted: bool, tensors: &[Tensor]| match wanted {
                true => tensors.iter().map(|t| t.to_device(on)).collect(),
                false => Vec::new(),
            };
            MicroBatches {
                inputs: here(stages.iter().any(|s| s.is_first()), &batches.inputs),
                targets: here(stages.iter().any(|s| s.is_last()), &batches.targets),
                weights: batches.weights.clone(),
                positions: batches.positions,
            }
        })
        .collect()
}

/// Each device's links to its previous and its next device, where it has them. Link d joins
/// device d to device d + 1 (d holds one end as its next, d + 1 the other as its prev); with
/// interleaving the last device's next leads back to device 0, which runs the following stages.
fn channel_links(placement: Placement) -> (Vec<Option<ChannelLink>>, Vec<Option<ChannelLink>>) {
    let count = placement.devices;
    let cyclic = placement.virtual_stages > 1;
    let (mut nexts, mut prevs): (Vec<Option<ChannelLink>>, Vec<Option<ChannelLink>>) = (Vec::new(), (0..count).map(|_| None).collect());
    for d in 0..count {
        let (earlier, later) = match d + 1 < count || cyclic {
            true => ChannelLink::pair(),
            false => {
                nexts.push(None);
                continue;
            }
        };
        nexts.push(Some(earlier));
        prevs[(d + 1) % count] = Some(later);
    }
    (prevs, nexts)
}

/// The devices' outcomes as one step's report: the last stage's loss, the hits, each device's
/// busy time and trace. A device that stopped because its neighbour did gives way to the
/// neighbour's error.
fn step_report(results: Vec<Result<StageOutcome>>, wall_s: f64) -> Result<StepReport> {
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

impl Pipeline {
    /// The forward and backward passes of one mini-batch (`[seq_len, batch]` ids and targets)
    /// in float32, gradients accumulating, dropout keyed by `dropout_key`: the bare step, for
    /// benchmarks and notebooks (the training loop goes through [`TrainStep`]).
    pub fn train_step(&mut self, src: &Tensor, targets: &Tensor, dropout_key: u64) -> Result<StepReport> {
        let options = super::stage_options(&self.options, true, Precision::Full, dropout_key, 1.0);
        self.run_batch(src, targets, options)
    }
}

impl<'g> Staged<'g> for Pipeline {
    /// All stages are in this process: nobody to agree with (`peers` is empty).
    fn parts(&self) -> (&[Stage], &PipelineOptions, &Peers<'g>) {
        (&self.stages, &self.options, &self.peers)
    }

    fn run_stages(&mut self, src: &Tensor, targets: &Tensor, options: StageOptions) -> Result<StepReport> {
        self.run_batch(src, targets, options)
    }
}
