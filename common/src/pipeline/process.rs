//! One pipeline stage per process, as `torch.distributed.pipelining` runs them: the way past
//! the GPUs of one node. Activations and gradients travel point-to-point through the process
//! group ([`ProcessGroup::send`]/[`ProcessGroup::recv`]: MPI for CPU tensors, NCCL for CUDA
//! tensors), and the pipeline is replicated `dp` times for data parallelism.
//!
//! Where each rank sits is the job's [`crate::dist::layout::Layout`]: rank `r` of `stages × dp`
//! ranks runs stage `r % stages` of replica `r / stages`, so the stages of one replica are
//! consecutive ranks (on one node where they fit) and the activations cross the fastest links;
//! the gradients of a stage are averaged over the `dp` ranks that hold it, with the run's
//! buckets (`--bucket-mb`, `--fp16-allreduce`).
use std::time::Instant;

use anyhow::Result;
use tch::{Device, Tensor};

use super::executor::{self, MicroBatches, StageOptions};
use super::link::Link;
use super::{chunks_for, schedule, split_batch, Op, PipelineOptions, Stage, StepReport};
use crate::dist::layout::Groups;
use crate::dist::tensor_parallel::{split_of, Split};
use crate::parallelize::DataParallelPlan;
use crate::dist::transfer::{recv_tensor, send_tensor};
use crate::dist::{GradientSync, ProcessGroup};
use crate::precision::Precision;
use crate::train::{Batch, BatchSource, EvalSums, Parallel, Replication, StepContext, StepOutput, TrainStep};

/// A neighbouring stage in another process: tensors travel point-to-point through the
/// process group with their kind and shape ([`crate::dist::transfer`]: the last batch of a
/// split is shorter). Sends do not wait for the receiver, so two neighbours may send to each
/// other at once (1F1B does).
pub struct PeerLink<'g> {
    group: &'g ProcessGroup,
    peer: usize,
}

impl Link for PeerLink<'_> {
    fn send(&mut self, tensor: &Tensor) -> Result<()> {
        send_tensor(self.group, tensor, self.peer)
    }

    fn recv(&mut self, device: Device) -> Result<Tensor> {
        recv_tensor(self.group, self.peer, device)
    }
}

/// This process's stage of a pipeline whose other stages run in other processes (or this
/// process's tensor-parallel shard of it, the other shards in other processes).
pub struct StageProcess<'g> {
    pub stage: Stage,
    pub options: PipelineOptions,
    /// This replica's stages, in order (activations and gradients pass along it); none with
    /// one stage per replica.
    pipe: Option<&'g ProcessGroup>,
    /// The other shards of this stage's layers (none: whole layers).
    tp: Option<&'g ProcessGroup>,
    parallel: Parallel<'g>,
}

impl<'g> StageProcess<'g> {
    /// This rank's stage (built by the caller for its place in `groups`' layout, a shard of it
    /// with tensor parallelism), its replicas' gradients averaged as `dp` says (`--bucket-mb`,
    /// `--fp16-allreduce`, or ZeRO-1's reduce-scatter).
    pub fn new(groups: &'g Groups<'g>, stage: Stage, options: PipelineOptions, dp: DataParallelPlan) -> Result<Self> {
        let pipe = groups.pp();
        let tp = groups.tp();
        anyhow::ensure!(stage.shard == groups.shard(), "stage {} is shard {:?}, but this rank's place is shard {:?}", stage.index, stage.shard, groups.shard());
        let sync = if matches!(dp.sync, GradientSync::Zero(_)) { dp.sync } else { GradientSync::Ddp };
        let parallel = Parallel {
            replicas: groups.dp().map(|group| Replication { group, averager: dp.averager, sync }),
            model: groups.model(),
            world: Some(groups.world),
            replica: groups.coords.replica,
            tp: tp.map(|group| (group, stage.shard)),
        };
        if let Some(replicas) = &parallel.replicas {
            dp.averager.check(replicas.group, stage.device())?;
        }
        Ok(StageProcess { stage, options, pipe, tp, parallel })
    }

    /// This stage's passes of one mini-batch, exchanging with the neighbouring stages' processes.
    fn run_batch(&mut self, src: &Tensor, targets: &Tensor, options: StageOptions) -> Result<StepReport> {
        let train = options.train;
        let chunks = if train { self.options.chunks } else { chunks_for(self.options.chunks, src.size()[1]) };
        let (inputs, weights) = split_batch(src, chunks)?;
        let (targets, _) = split_batch(targets, chunks)?;
        let stage = &self.stage;
        let device = stage.device();
        let batches = MicroBatches {
            inputs: if stage.is_first() { inputs.iter().map(|t| t.to_device(device)).collect() } else { Vec::new() },
            targets: if stage.is_last() { targets.iter().map(|t| t.to_device(device)).collect() } else { Vec::new() },
            weights,
        };
        let (s, stages) = (stage.index, self.pipe.map_or(1, ProcessGroup::world_size));
        let ops = match train {
            true => schedule::stage_ops(self.options.schedule, s, stages, chunks),
            false => (0..chunks).map(Op::Forward).collect(),
        };
        let mut prev = self.pipe.filter(|_| s > 0).map(|group| PeerLink { group, peer: s - 1 });
        let mut next = self.pipe.filter(|_| s + 1 < stages).map(|group| PeerLink { group, peer: s + 1 });
        let clock = Instant::now();
        let outcome = executor::run_stage(
            stage,
            &ops,
            &batches,
            prev.as_mut().map(|l| l as &mut dyn Link),
            next.as_mut().map(|l| l as &mut dyn Link),
            options,
            self.tp,
            clock,
        )?;
        let wall_s = clock.elapsed().as_secs_f64();
        // Every stage learns every stage's busy time, and the last stage's loss and hits.
        let mine = [outcome.trace.busy_s(), outcome.loss.unwrap_or(0.0), outcome.hits.unwrap_or(0) as f64];
        let all: Vec<Vec<f64>> = match self.pipe {
            Some(pipe) => {
                pipe.wait_sends()?;
                let all = pipe.all_gather(&Tensor::from_slice(&mine))?;
                all.iter().map(Vec::<f64>::try_from).collect::<Result<_, _>>()?
            }
            None => vec![mine.to_vec()],
        };
        let last = all.last().expect("at least one stage");
        Ok(StepReport {
            loss: last[1],
            hits: last[2] as i64,
            wall_s,
            stage_busy_s: all.iter().map(|v| v[0]).collect(),
            traces: vec![outcome.trace],
        })
    }

    fn stage_options(&self, train: bool, precision: Precision, dropout_key: u64, loss_scale: f64) -> StageOptions {
        StageOptions { dropout_key, recompute: self.options.checkpoint_activations, train, precision, loss_scale }
    }
}

impl<'g> TrainStep<'g> for StageProcess<'g> {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.stage.named_parameters()
    }

    fn named_variables(&self) -> Vec<(String, Tensor)> {
        self.stage.named_parameters()
    }

    fn input_device(&self) -> Device {
        self.stage.device()
    }

    fn parallel(&self) -> Parallel<'g> {
        self.parallel
    }

    /// A tensor-parallel shard other than the first does not count the variables every shard
    /// holds whole (their gradients are the same on every shard).
    fn norm_counted(&self) -> Vec<bool> {
        let first = self.stage.shard.index == 0;
        self.named_parameters().iter().map(|(name, _)| first || split_of(name) != Split::Replicated).collect()
    }

    fn forward_backward(&mut self, batch: &Batch, weight: f64, ctx: &StepContext) -> Result<StepOutput> {
        let scale = ctx.scaler.map_or(1.0, |s| s.scale_value());
        let options = self.stage_options(true, ctx.precision, ctx.dropout_key, weight * scale);
        let targets = batch.targets.reshape(batch.inputs.size());
        let started = Instant::now();
        Ok(self.run_batch(&batch.inputs, &targets, options)?.into_output(batch.len(), started))
    }

    fn evaluate(&mut self, source: &dyn BatchSource, precision: Precision) -> Result<EvalSums> {
        let options = self.stage_options(false, precision, 0, 1.0);
        super::evaluate_batches(source, |src, targets| self.run_batch(src, targets, options))
    }
}
