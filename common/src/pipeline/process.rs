//! One pipeline stage per process, as `torch.distributed.pipelining` runs them: the way past
//! the GPUs of one node. Activations and gradients travel point-to-point through the process
//! group ([`ProcessGroup::send`]/[`ProcessGroup::recv`]: MPI for CPU tensors, NCCL for CUDA
//! tensors), and the pipeline is replicated `dp` times for data parallelism.
//!
//! Where each rank sits is the job's [`crate::comm::layout::Layout`]: rank `r` of `stages × dp`
//! ranks runs stage `r % stages` of replica `r / stages`, so the stages of one replica are
//! consecutive ranks (on one node where they fit) and the activations cross the fastest links;
//! the gradients of a stage are averaged over the `dp` ranks that hold it, with the run's
//! buckets (`--bucket-mb`, `--fp16-allreduce`). With the interleaved schedule a rank holds
//! `virtual_stages` stages ([`Placement`]), and the last rank sends activations on to the first.
use std::time::Instant;

use anyhow::Result;
use tch::{Device, Tensor};

use super::executor::{self, MicroBatches, StageOptions};
use super::link::{ChannelLink, Link};
use super::{chunks_for, schedule, split_batch, Op, PipelineOptions, Placement, Schedule, Stage, Staged, StepReport};
use crate::comm::layout::Groups;
use crate::comm::tensor_parallel::{Split, SplitTable};
use crate::comm::transfer::{recv_labelled, send_labelled};
use crate::comm::ProcessGroup;
use crate::error::usage;
use crate::models::parallel_layers::ReportSplits;
use crate::parallel::{DataParallelPlan, Parallel, Peers};

/// A neighbouring device in another process: tensors travel point-to-point through the
/// process group with their kind, shape ([`crate::comm::transfer`]: the last batch of a split
/// is shorter) and tag. Sends do not wait for the receiver, so two neighbours may send to each
/// other at once (1F1B does).
pub struct PeerLink<'g> {
    group: &'g ProcessGroup,
    peer: usize,
}

impl Link for PeerLink<'_> {
    fn send(&mut self, tag: Op, tensor: &Tensor) -> Result<()> {
        let direction = if tag.is_forward() { 0 } else { 1 };
        send_labelled(self.group, tensor, [direction, tag.stage as i64, tag.micro_batch as i64], self.peer)
    }

    fn recv(&mut self, device: Device) -> Result<(Op, Tensor)> {
        let ([direction, stage, micro_batch], tensor) = recv_labelled(self.group, self.peer, device)?;
        let tag = match direction {
            0 => Op::forward(stage as usize, micro_batch as usize),
            _ => Op::backward(stage as usize, micro_batch as usize),
        };
        Ok((tag, tensor))
    }
}

/// This process's stage of a pipeline whose other stages run in other processes (or this
/// process's tensor-parallel shard of it, the other shards in other processes); with
/// interleaving, its stages.
pub struct StageProcess<'g> {
    /// The stages this rank holds, in model order.
    pub stages: Vec<Stage>,
    /// This rank's place in its replica's pipeline.
    pub device: usize,
    pub placement: Placement,
    pub options: PipelineOptions,
    /// This replica's stages, in order (activations and gradients pass along it); none with
    /// one stage per replica.
    pipe: Option<&'g ProcessGroup>,
    /// The other shards of this stage's layers (none: whole layers).
    tp: Option<&'g ProcessGroup>,
    /// Who it works with, and which parameters it counts in the gradients' norm (a shard other
    /// than the first skips those every shard holds whole).
    peers: Peers<'g>,
}

impl<'g> StageProcess<'g> {
    /// This rank's stages (built by the caller for its place in `groups`' layout, shards of them
    /// with tensor parallelism: those [`Placement::stages_of`] names), its replicas' gradients
    /// averaged as `dp` says (`--bucket-mb`, `--fp16-allreduce`, or ZeRO-1's reduce-scatter).
    pub fn new(groups: &'g Groups<'g>, stages: Vec<Stage>, options: PipelineOptions, dp: DataParallelPlan) -> Result<Self> {
        let pipe = groups.pp();
        let tp = groups.tp();
        let (device, placement) = (groups.coords.stage, Placement { devices: groups.layout.pp, virtual_stages: options.virtual_stages });
        let expected: Vec<usize> = placement.stages_of(device).collect();
        let indices: Vec<usize> = stages.iter().map(|s| s.index).collect();
        anyhow::ensure!(indices == expected, "rank {} holds stages {indices:?}, but its place in the pipeline is stages {expected:?}", groups.world.rank());
        for stage in &stages {
            anyhow::ensure!(
                stage.shard() == groups.shard(),
                "stage {} is shard {:?}, but this rank's place is shard {:?}",
                stage.index,
                stage.shard(),
                groups.shard()
            );
        }
        placement.check(options.schedule, options.chunks)?;
        let on = stages[0].device();
        if let (Schedule::Interleaved, Some(pipe)) = (options.schedule, pipe) {
            // NCCL's sends complete only once received and go out with the sender's next
            // receive: the interleaved order then deadlocks (see the schedule's tests).
            if pipe.backend_for(on)?.name() == "nccl" {
                return usage(
                    "--schedule interleaved across processes needs point-to-point sends that do not wait for the receiver, \
                     and NCCL's do: use --backend mpi (MPI's isend), or run the stages as threads of one process (--devices)",
                );
            }
        }
        dp.sync.strategy().check_stages()?;
        // How this rank's variables are cut, as the layers of its stages report.
        let mut splits = SplitTable::default();
        stages.iter().for_each(|stage| stage.part().report_splits(&mut splits));
        // A replicated variable's share of the gradient norm is counted on the first shard only.
        let first_shard = groups.shard().index == 0;
        let norm_counted = stages
            .iter()
            .flat_map(Stage::named_parameters)
            .map(|(name, t)| Ok(first_shard || splits.split(&name, t.dim())? != Split::Replicated))
            .collect::<Result<_>>()?;
        let parallel = Parallel::of(groups, dp, splits);
        if let Some(replicas) = &parallel.replicas {
            dp.averager.check(replicas.group, on)?;
        }
        let peers = Peers::new(parallel).with_norm_counted(norm_counted);
        Ok(StageProcess { stages, device, placement, options, pipe, tp, peers })
    }

    /// This rank's passes of one mini-batch, exchanging with the neighbouring ranks.
    fn run_batch(&mut self, src: &Tensor, targets: &Tensor, options: StageOptions) -> Result<StepReport> {
        let train = options.train;
        let chunks = if train { self.options.chunks } else { chunks_for(self.options.chunks, src.size()[1]) };
        let (inputs, weights) = split_batch(src, chunks)?;
        let (targets, _) = split_batch(targets, chunks)?;
        let stages: Vec<&Stage> = self.stages.iter().collect();
        let on = stages[0].device();
        let batches = MicroBatches {
            inputs: if stages.iter().any(|s| s.is_first()) { inputs.iter().map(|t| t.to_device(on)).collect() } else { Vec::new() },
            targets: if stages.iter().any(|s| s.is_last()) { targets.iter().map(|t| t.to_device(on)).collect() } else { Vec::new() },
            weights,
            positions: src.size()[0],
        };
        let (d, placement) = (self.device, self.placement);
        let ops = match train {
            true => schedule::device_ops(self.options.schedule, placement, d, chunks),
            false => schedule::forward_ops(placement, d, chunks),
        };
        // The neighbouring ranks; with interleaving the last rank's stages feed the first's.
        let (p, cyclic) = (placement.devices, placement.virtual_stages > 1);
        let mut prev = self.pipe.filter(|_| d > 0 || cyclic).map(|group| PeerLink { group, peer: (d + p - 1) % p });
        let mut next = self.pipe.filter(|_| d + 1 < p || cyclic).map(|group| PeerLink { group, peer: (d + 1) % p });
        // Interleaved on one rank per pipeline: its stages follow each other through a channel.
        let mut looped = (cyclic && self.pipe.is_none()).then(ChannelLink::pair);
        let (prev, next): (Option<&mut dyn Link>, Option<&mut dyn Link>) = match &mut looped {
            Some((earlier, later)) => (Some(later), Some(earlier)),
            None => (prev.as_mut().map(|l| l as &mut dyn Link), next.as_mut().map(|l| l as &mut dyn Link)),
        };
        let clock = Instant::now();
        let outcome = executor::run_device(d, &stages, &ops, &batches, prev, next, options, self.tp, clock)?;
        let wall_s = clock.elapsed().as_secs_f64();
        // Every rank learns every rank's busy time, and the last stage's loss and hits.
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
        Ok(StepReport { loss: last[1], hits: last[2] as i64, wall_s, stage_busy_s: all.iter().map(|v| v[0]).collect(), traces: vec![outcome.trace] })
    }
}

impl<'g> Staged<'g> for StageProcess<'g> {
    fn parts(&self) -> (&[Stage], &PipelineOptions, &Peers<'g>) {
        (&self.stages, &self.options, &self.peers)
    }

    fn run_stages(&mut self, src: &Tensor, targets: &Tensor, options: StageOptions) -> Result<StepReport> {
        self.run_batch(src, targets, options)
    }
}
