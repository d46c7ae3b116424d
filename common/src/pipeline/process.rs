//! One pipeline stage per process, as `torch.distributed.pipelining` runs them: the way past
//! the GPUs of one node. Activations and gradients travel point-to-point through the process
//! group ([`ProcessGroup::send`]/[`ProcessGroup::recv`]: MPI for CPU tensors, NCCL for CUDA
//! tensors), and the pipeline is replicated `dp` times for data parallelism.
//!
//! Rank `r` of `stages × dp` ranks runs stage `r % stages` of replica `r / stages`: the stages
//! of one replica are consecutive ranks (on one node where they fit), so the activations cross
//! the fastest links, and the gradient all-reduce of a stage runs over the `dp` ranks that hold
//! it.
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::executor::{self, MicroBatches, StageOptions};
use super::link::Link;
use super::{chunks_for, schedule, split_batch, EvalSums, Op, PipelineOptions, PipelineTrainer, Stage, StepReport};
use crate::data::text::TokenBatches;
use crate::dist::data_parallel::GradientAverager;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::error::usage;

/// Where this process sits in a job of `stages × replicas` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub stage: usize,
    pub replica: usize,
    pub stages: usize,
    pub replicas: usize,
}

impl Placement {
    /// Rank `rank` of `world` ranks with `stages` stages per replica; `dp`, when given, must be
    /// the number of replicas this makes.
    pub fn of(rank: usize, world: usize, stages: usize, dp: Option<usize>) -> Result<Placement> {
        if stages == 0 || !world.is_multiple_of(stages) {
            return usage(format!(
                "{world} ranks cannot run pipelines of {stages} stages: the number of ranks must be stages × --dp"
            ));
        }
        let replicas = world / stages;
        if let Some(dp) = dp.filter(|&dp| dp != replicas) {
            return usage(format!(
                "--dp {dp} with {stages} stages needs {} ranks, but the job has {world}",
                dp * stages
            ));
        }
        Ok(Placement { stage: rank % stages, replica: rank / stages, stages, replicas })
    }
}

/// Up to this many dimensions travel in a message's header.
const MAX_DIMS: usize = 6;
/// Kinds an activation or gradient may have, by their index in the header.
const KINDS: [Kind; 4] = [Kind::Float, Kind::Half, Kind::BFloat16, Kind::Double];

/// A neighbouring stage in another process: each tensor travels as a small header (kind and
/// shape, so the receiver can allocate it: the last batch of a split is shorter) followed by the
/// data. Sends do not wait for the receiver, so two neighbours may send to each other at once
/// (1F1B does).
pub struct PeerLink<'g> {
    group: &'g ProcessGroup,
    peer: usize,
}

impl Link for PeerLink<'_> {
    fn send(&mut self, tensor: &Tensor) -> Result<()> {
        let dims = tensor.size();
        let kind = KINDS.iter().position(|&k| k == tensor.kind());
        let (Some(kind), true) = (kind, dims.len() <= MAX_DIMS) else {
            bail!("cannot send a {:?} tensor of shape {dims:?} to the next stage", tensor.kind());
        };
        let mut header = vec![kind as i64, dims.len() as i64];
        header.extend(&dims);
        header.resize(2 + MAX_DIMS, 0);
        let header = Tensor::from_slice(&header).to_device(tensor.device());
        self.group.send(&header, self.peer)?;
        self.group.send(&tensor.detach().contiguous(), self.peer)
    }

    fn recv(&mut self, device: Device) -> Result<Tensor> {
        let mut header = Tensor::zeros([2 + MAX_DIMS as i64], (Kind::Int64, device));
        self.group.recv(&mut header, self.peer)?;
        let header = Vec::<i64>::try_from(header.to_device(Device::Cpu))?;
        let kind = *KINDS.get(header[0] as usize).context("a message header names an unknown kind")?;
        let dims = &header[2..2 + (header[1] as usize).min(MAX_DIMS)];
        let mut tensor = Tensor::empty(dims, (kind, device));
        self.group.recv(&mut tensor, self.peer)?;
        Ok(tensor)
    }
}

/// This process's stage of a pipeline whose other stages run in other processes.
pub struct StageProcess<'g> {
    pub stage: Stage,
    pub placement: Placement,
    pub options: PipelineOptions,
    world: &'g ProcessGroup,
    /// The ranks of this replica's pipeline, in stage order (`None`: the world, with dp = 1).
    pipe: Option<ProcessGroup>,
    /// The ranks holding this stage in every replica (`None` with dp = 1).
    replicas: Option<ProcessGroup>,
    averager: GradientAverager,
}

impl<'g> StageProcess<'g> {
    /// This rank's stage (built by the caller for `placement`), with the sub-groups of its
    /// pipeline and of its replicas split from `world` (sub-groups need an MPI launcher).
    pub fn new(world: &'g ProcessGroup, stage: Stage, placement: Placement, options: PipelineOptions) -> Result<Self> {
        let (pipe, replicas) = match placement.replicas {
            1 => (None, None),
            _ => (
                Some(world.split(placement.replica, placement.stage)?),
                Some(world.split(placement.stage, placement.replica)?),
            ),
        };
        let averager = GradientAverager::new(25 << 20, false);
        Ok(StageProcess { stage, placement, options, world, pipe, replicas, averager })
    }

    fn pipe(&self) -> &ProcessGroup {
        self.pipe.as_ref().unwrap_or(self.world)
    }

    /// This stage's passes of one mini-batch, exchanging with the neighbouring stages' processes.
    fn run_batch(&mut self, src: &Tensor, targets: &Tensor, train: bool, dropout_key: u64) -> Result<StepReport> {
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
        let ops = match train {
            true => schedule::stage_ops(self.options.schedule, self.placement.stage, self.placement.stages, chunks),
            false => (0..chunks).map(Op::Forward).collect(),
        };
        let pipe = self.pipe();
        let s = self.placement.stage;
        let mut prev = (s > 0).then(|| PeerLink { group: pipe, peer: s - 1 });
        let mut next = (s + 1 < self.placement.stages).then(|| PeerLink { group: pipe, peer: s + 1 });
        let clock = Instant::now();
        let outcome = executor::run_stage(
            stage,
            &ops,
            &batches,
            prev.as_mut().map(|l| l as &mut dyn Link),
            next.as_mut().map(|l| l as &mut dyn Link),
            StageOptions { dropout_key, recompute: self.options.checkpoint_activations, train, precision: self.options.precision },
            clock,
        )?;
        pipe.wait_sends()?;
        let wall_s = clock.elapsed().as_secs_f64();
        // Every stage learns every stage's busy time, and the last stage's loss and hits.
        let mine = [outcome.trace.busy_s(), outcome.loss.unwrap_or(0.0), outcome.hits.unwrap_or(0) as f64];
        let all = pipe.all_gather(&Tensor::from_slice(&mine))?;
        let all: Vec<Vec<f64>> = all.iter().map(Vec::<f64>::try_from).collect::<Result<_, _>>()?;
        let last = all.last().expect("at least one stage");
        Ok(StepReport {
            loss: last[1],
            hits: last[2] as i64,
            wall_s,
            stage_busy_s: all.iter().map(|v| v[0]).collect(),
            traces: vec![outcome.trace],
        })
    }
}

impl PipelineTrainer for StageProcess<'_> {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.stage.named_parameters()
    }

    fn train_step(&mut self, src: &Tensor, targets: &Tensor, dropout_key: u64) -> Result<StepReport> {
        let mut report = self.run_batch(src, targets, true, dropout_key)?;
        if let Some(replicas) = &self.replicas {
            // The loss each replica saw, averaged: what the progress line shows.
            let mut loss = Tensor::from(report.loss);
            replicas.all_reduce(&mut loss, ReduceOp::Average)?;
            report.loss = loss.double_value(&[]);
        }
        Ok(report)
    }

    fn finish_gradients(&mut self, params: &[Tensor], max_norm: Option<f64>) -> Result<()> {
        if let Some(replicas) = &self.replicas {
            self.averager.average(replicas, params)?;
        }
        let Some(max_norm) = max_norm else { return Ok(()) };
        // clip_grad_norm_ over the whole model: the norm of all stages' gradient norms.
        let grads: Vec<Tensor> = params.iter().map(Tensor::grad).filter(Tensor::defined).collect();
        let local: f64 = tch::no_grad(|| grads.iter().map(|g| g.norm().double_value(&[]).powi(2)).sum());
        let mut total = Tensor::from(local);
        self.pipe().all_reduce(&mut total, ReduceOp::Sum)?;
        let total = total.double_value(&[]).sqrt();
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        tch::no_grad(|| {
            for g in &grads {
                let _ = g.shallow_clone().g_mul_scalar_(coef);
            }
        });
        Ok(())
    }

    fn evaluate(&mut self, source: &TokenBatches) -> Result<EvalSums> {
        let mut sums = super::evaluate_batches(source, |src, targets| self.run_batch(src, targets, false, 0))?;
        if let Some(replicas) = &self.replicas {
            // Each replica evaluated its own shard.
            let mut all = Tensor::from_slice(&[sums.loss_sum, sums.hits, sums.tokens]);
            replicas.all_reduce(&mut all, ReduceOp::Sum)?;
            let all = Vec::<f64>::try_from(&all)?;
            sums = EvalSums { loss_sum: all[0], hits: all[1], tokens: all[2] };
        }
        Ok(sums)
    }
}
