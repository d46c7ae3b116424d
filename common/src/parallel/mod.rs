//! The strategies: how the ranks that replicate a model keep it equal, each one an object.
//!
//! A run's plan names its data-parallel style ([`GradientSync`], from the preset and the flags);
//! [`crate::parallelize`] turns it into its [`Strategy`] and a step. The strategy decides what
//! differs between the styles and nothing else:
//! - how a whole model's step is built ([`Strategy::shard_parameters`]: ZeRO-3 shards them over
//!   the replicas from the start, HSDP over a shard group of them);
//! - how the optimizer is wrapped ([`Strategy::optimizer`]: Horovod's averages inside its step,
//!   ZeRO's updates this rank's block);
//! - what finishing the gradients does after backward ([`Strategy::after_backward`]: DDP's
//!   all-reduce) and which collective that is ([`Strategy::gradient_collective`]);
//! - what it cannot do (pipeline stages, checkpoints between epochs);
//! - what it costs ([`Costs`]: the model state a rank holds, a step's communication, the
//!   layouts the planner may give it), which the estimator and the planner ask.
//!
//! What every style shares lives beside them: [`Parallel`] (who a step's rank works with),
//! [`Peers`] (the loop's [`crate::train::StepSync`]: finishing gradients, making sharded
//! parameters whole for checkpoints, replica 0's state for every replica) and [`LocalStep`]
//! (a whole model on this rank). The loop knows none of them: it sees the traits train/ defines.
//!
//! A new style is one [`GradientSync`] variant, one module with its `impl Strategy` and `impl
//! Costs`, and its flags.
use std::rc::Rc;

use anyhow::Result;
use tch::Tensor;

use crate::comm::data_parallel::GradientAverager;
use crate::optim::Optimizer;
use crate::train::{GradientCollective, TrainStep};
use zero::{Shards, ZeroStage};

pub mod costs;
mod ddp;
mod horovod;
mod job;
mod local;
pub mod parameter_server;
mod peers;
mod ranks;
pub mod zero;

pub use costs::Costs;
pub use horovod::DistributedOptimizer;
pub use job::{Job, JobSpec, RunPart, StyleReport};
pub use local::LocalStep;
/// `--straggler`: a rank made slow in every step, under any style.
pub use parameter_server::Straggled;
pub use peers::Peers;
pub use ranks::{Parallel, Replication};

/// A run's data-parallel style, as its plan and results name it: the course's two ways of
/// averaging (the same collectives either way), ZeRO's stages, parameter servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GradientSync {
    /// In the training loop, right after backward (PyTorch DDP's reducer).
    Ddp,
    /// Inside the optimizer's step, through a [`DistributedOptimizer`] (Horovod).
    Horovod,
    /// ZeRO: gradients reduce-scattered (in the optimizer's `synchronize`, or from stage 2
    /// during the backward pass), each rank updating its block of the parameters
    /// ([`crate::parallel::zero::ZeroOptimizer`]).
    Zero(ZeroStage),
    /// Hybrid sharded data parallelism: ZeRO-3 within each shard group of replicas, the groups'
    /// blocks averaged by an all-reduce across them (`--zero 3 --shard-group G`,
    /// [`crate::parallel::zero::Hsdp`]).
    Hsdp,
    /// No averaging among the replicas: they push their gradients to parameter servers, whose
    /// optimizer updates (`--strategy parameter-server`, [`crate::parallel::parameter_server`]).
    #[serde(rename = "parameter-server")]
    ParameterServer,
}

impl GradientSync {
    /// Every style, in the order the planner lays them out: plain replicas, then ZeRO's
    /// stages, then HSDP (those it does not lay out say so: [`Costs::shard_groups`]).
    pub const ALL: [GradientSync; 7] = [
        GradientSync::Ddp,
        GradientSync::Horovod,
        GradientSync::Zero(ZeroStage::OptimizerState),
        GradientSync::Zero(ZeroStage::Gradients),
        GradientSync::Zero(ZeroStage::Parameters),
        GradientSync::Hsdp,
        GradientSync::ParameterServer,
    ];

    /// The style `--zero N` gives a run of plain replicas (0: DDP).
    pub fn zero(stage: u8) -> GradientSync {
        GradientSync::of_run(GradientSync::Ddp, ZeroStage::from_flag(stage), false)
    }

    /// The ZeRO stage the style runs (`--zero N`; HSDP's is 3), if any.
    pub fn zero_stage(self) -> Option<ZeroStage> {
        match self {
            GradientSync::Zero(stage) => Some(stage),
            GradientSync::Hsdp => Some(ZeroStage::Parameters),
            GradientSync::Ddp | GradientSync::Horovod | GradientSync::ParameterServer => None,
        }
    }

    /// The style of a run whose job keeps no [`RunPart`] (a parameter-server job's part says
    /// its own): HSDP where ZeRO-3's replicas are in shard groups (`grouped`), the ZeRO stage
    /// `--zero` asks for, or else the preset's.
    pub fn of_run(preset: GradientSync, zero: Option<ZeroStage>, grouped: bool) -> GradientSync {
        match zero {
            Some(ZeroStage::Parameters) if grouped => GradientSync::Hsdp,
            Some(stage) => GradientSync::Zero(stage),
            None => preset,
        }
    }

    /// The strategy that carries this style out: the one place a style is matched.
    pub fn strategy(self) -> &'static dyn Strategy {
        match self {
            GradientSync::Ddp => &ddp::Ddp,
            GradientSync::Horovod => &horovod::Horovod,
            GradientSync::Zero(ZeroStage::OptimizerState) => &zero::Zero(ZeroStage::OptimizerState),
            GradientSync::Zero(ZeroStage::Gradients) => &zero::Zero(ZeroStage::Gradients),
            GradientSync::Zero(ZeroStage::Parameters) => &zero::Zero(ZeroStage::Parameters),
            GradientSync::Hsdp => &zero::Hsdp,
            GradientSync::ParameterServer => &parameter_server::ParameterServer,
        }
    }
}

/// How data-parallel replicas keep their gradients equal: the style and the buckets it
/// averages in (`--bucket-mb`, `--fp16-allreduce`).
#[derive(Debug, Clone, Copy)]
pub struct DataParallelPlan {
    pub averager: GradientAverager,
    pub sync: GradientSync,
}

/// What makes an optimizer over some named parameters (the run's recipe).
pub type BuildOptimizer<'b, 'o> = &'b dyn Fn(Vec<(String, Tensor)>) -> Box<dyn Optimizer + 'o>;

/// One data-parallel style (see the module docs): what it changes in how a step is built, how
/// its optimizer is wrapped and how its gradients are finished. Stateless: what it works over
/// comes in a [`Replication`]. What it costs, the estimator's and the planner's questions, is
/// its [`Costs`].
pub trait Strategy: Costs + Sync {
    /// The style, as the plan and the results name it.
    fn sync(&self) -> GradientSync;

    /// The shards a whole model's parameters `named` live in from the start (ZeRO-3 over the
    /// replicas, HSDP over a shard group of them), each part of the model gathered before it
    /// runs ([`LocalStep::replica`]); `part_of` gives a parameter's part. None: the parameters
    /// stay whole on every replica.
    fn shard_parameters<'g>(
        &self,
        _replication: &Replication<'g>,
        _named: Vec<(String, Tensor)>,
        _part_of: &dyn Fn(&str) -> Result<usize>,
    ) -> Result<Option<Rc<Shards<'g>>>> {
        Ok(None)
    }

    /// The optimizer the loop steps for `params` (a step's), `build` making the optimizer of
    /// some named parameters; `zero3`: the shards the step's parameters live in, where the
    /// step was built with them. A local optimizer over all of them unless the style wraps it.
    fn optimizer<'g: 'o, 'o>(
        &self,
        _replication: &Replication<'g>,
        params: Vec<(String, Tensor)>,
        _zero3: Option<Rc<Shards<'g>>>,
        build: BuildOptimizer<'_, 'o>,
    ) -> Result<Box<dyn Optimizer + 'o>> {
        Ok(build(params))
    }

    /// What finishing the gradients does in the loop, right after backward, before the
    /// optimizer's `synchronize` (which runs for every style).
    fn after_backward(&self, _replication: &Replication<'_>, _params: &[Tensor]) -> Result<()> {
        Ok(())
    }

    /// The collective that finishes the gradients before the optimizer steps, `clip`ping or
    /// not (clipping needs them averaged first).
    fn gradient_collective(&self, clip: bool) -> GradientCollective;

    /// Fails, with a usage error, where the style cannot average pipeline stages' or
    /// tensor-parallel shards' gradients.
    fn check_stages(&self) -> Result<()> {
        Ok(())
    }

    /// The style's flag where its replicas do not step together.
    fn steps_apart(&self) -> Option<&'static str> {
        None
    }
}

/// A step that knows its [`Peers`]: what [`crate::parallelize`] builds, and the loop trains as
/// a [`TrainStep`].
pub trait ParallelStep<'g>: TrainStep<'g> {
    fn peers(&self) -> &Peers<'g>;
}

/// The optimizer the loop steps for `step`'s parameters: its strategy's where it has replicas,
/// `build`'s own otherwise.
pub fn optimizer_for<'g: 'o, 'o>(step: &dyn ParallelStep<'g>, build: BuildOptimizer<'_, 'o>) -> Result<Box<dyn Optimizer + 'o>> {
    let params = step.named_parameters();
    let peers = step.peers();
    match &peers.parallel.replicas {
        Some(replication) => replication.strategy.optimizer(replication, params, peers.zero_shards(), build),
        None => Ok(build(params)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GradientCollective::{AllReduce, ReduceScatter};

    const STYLES: [GradientSync; 7] = GradientSync::ALL;

    #[test]
    fn a_run_takes_zero_then_the_presets_style() {
        let (zero2, zero3) = (Some(ZeroStage::Gradients), Some(ZeroStage::Parameters));
        assert_eq!(GradientSync::of_run(GradientSync::Horovod, zero2, false), GradientSync::Zero(ZeroStage::Gradients));
        assert_eq!(GradientSync::of_run(GradientSync::Horovod, None, false), GradientSync::Horovod);
        // ZeRO-3 over shard groups of the replicas is HSDP.
        assert_eq!(GradientSync::of_run(GradientSync::Ddp, zero3, true), GradientSync::Hsdp);
        assert_eq!(GradientSync::of_run(GradientSync::Ddp, zero3, false), GradientSync::Zero(ZeroStage::Parameters));
    }

    #[test]
    fn every_style_is_carried_out_by_its_own_strategy() {
        for style in STYLES {
            assert_eq!(style.strategy().sync(), style);
        }
    }

    #[test]
    fn each_strategy_says_what_finishes_its_gradients_and_what_it_refuses() {
        // (style, collective without clipping, with clipping, shards parameters, builds stages)
        let expected = [
            (AllReduce, AllReduce, Some(false), true),
            // Horovod averages in the optimizer's step, unless clipping needs the average first.
            (GradientCollective::None, AllReduce, Some(false), false),
            (ReduceScatter, ReduceScatter, Some(false), true),
            (ReduceScatter, ReduceScatter, Some(false), true),
            (ReduceScatter, ReduceScatter, Some(true), true),
            // HSDP needs shard groups, which a job of one rank has not (an error, not a fallback).
            (ReduceScatter, ReduceScatter, None, false),
            (GradientCollective::None, GradientCollective::None, Some(false), false),
        ];
        let world = crate::comm::ProcessGroup::single();
        for (style, (plain, clipped, shards, stages)) in STYLES.into_iter().zip(expected) {
            let strategy = style.strategy();
            assert_eq!((strategy.gradient_collective(false), strategy.gradient_collective(true)), (plain, clipped), "{style:?}");
            let replication = Replication { group: &world, averager: GradientAverager::new(1 << 20, false), strategy, shard_groups: None };
            let named = vec![("w".to_string(), Tensor::ones([3], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true))];
            let sharded = strategy.shard_parameters(&replication, named, &|_| Ok(0));
            assert_eq!(sharded.as_ref().ok().map(Option::is_some), shards, "{style:?}");
            assert_eq!(strategy.check_stages().is_ok(), stages, "{style:?}");
            let apart = (style == GradientSync::ParameterServer).then_some("--strategy parameter-server");
            assert_eq!(strategy.steps_apart(), apart, "{style:?}");
        }
    }
}
