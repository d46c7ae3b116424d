//! A job's start, before the mesh is made: how a style divides the job's ranks, which engine it
//! needs, and what it keeps for the run beyond its stateless [`super::Strategy`]. Only the
//! parameter server does any of it so far (its servers are ranks apart, talked to over MPI,
//! through a link every worker keeps); the experiment asks [`JobSpec`], [`Job`] and [`RunPart`]
//! and names no style.
use std::rc::Rc;

use anyhow::Result;
use serde::Serialize;
use tch::Tensor;

use super::parameter_server::{self, WorkerLink};
use super::GradientSync;
use crate::comm::group::Traffic;
use crate::comm::launch::StopsAt;
use crate::comm::{Backend, ProcessGroup};
use crate::optim::{Optimizer, OptimizerSpec};
use crate::precision::Precision;
use crate::train::TrainStep;

/// What the flags ask of a job before its ranks start, beyond the mesh: the ranks a style sets
/// apart (`--strategy parameter-server`'s servers), and what that changes for the launch.
#[derive(Debug, Clone, Copy)]
pub struct JobSpec {
    servers: Option<parameter_server::Config>,
}

impl JobSpec {
    pub fn new(servers: Option<parameter_server::Config>) -> JobSpec {
        JobSpec { servers }
    }

    /// Refuses, before any rank starts, what the style cannot do with the run's flags
    /// (checkpoints within epochs, `--checkpoint-every` and `--checkpoint-minutes`).
    pub fn check(&self, checkpoints_within_epochs: bool) -> Result<()> {
        self.servers.map_or(Ok(()), |servers| servers.check(checkpoints_within_epochs))
    }

    /// The ranks the style sets apart from training.
    pub fn ranks_apart(&self) -> usize {
        self.servers.map_or(0, |servers| servers.servers)
    }

    /// Where a stop signal stops the ranks that train: after a step they agree on, unless the
    /// style's ranks never step together.
    pub fn stops_at(&self) -> StopsAt {
        self.servers.map_or(StopsAt::Step, |servers| servers.stops_at())
    }
}

/// This rank's part of a job: every rank trains, unless the style sets some apart.
pub struct Job<'w> {
    world: &'w ProcessGroup,
    servers: Option<parameter_server::Job<'w>>,
}

impl<'w> Job<'w> {
    /// The engine the job's world needs: `chosen`, except that a parameter-server job left to
    /// choose gets MPI (its servers keep their tensors on the CPU and are talked to over MPI;
    /// NCCL would want a GPU for each of them too, and refuse two ranks on one).
    pub fn backend(chosen: Backend, spec: JobSpec) -> Backend {
        match chosen {
            Backend::Auto if spec.servers.is_some() => Backend::Mpi,
            chosen => chosen,
        }
    }

    /// Divides `world` (every rank calls it, at the same point): the last ranks serve where
    /// `spec` asks for parameter servers.
    pub fn start(world: &'w ProcessGroup, spec: JobSpec) -> Result<Job<'w>> {
        Ok(Job { world, servers: parameter_server::Job::start(world, spec.servers)? })
    }

    /// On a rank set apart (a server): does its work until the job is done, then true. False on
    /// a rank that trains.
    pub fn serve(&self) -> Result<bool> {
        match self.servers.as_ref().filter(|job| job.is_server()) {
            Some(job) => job.serve().map(|()| true),
            None => Ok(false),
        }
    }

    /// The ranks that train, as the world of their mesh.
    pub fn ranks(&self) -> &ProcessGroup {
        self.servers.as_ref().map_or(self.world, |job| job.workers())
    }

    /// What the style keeps for this rank's run (the parameter server's link); None for the
    /// styles that keep nothing.
    pub fn run_part(&self) -> Option<Rc<dyn RunPart + 'w>> {
        self.servers.as_ref().map(|job| job.link() as Rc<dyn RunPart + 'w>)
    }
}

/// What a style keeps for one run, beyond its stateless [`super::Strategy`]: asked by the
/// experiment around the loop, in this order.
pub trait RunPart {
    /// The run's style (the part decides it, whatever the preset says).
    fn sync(&self) -> GradientSync;

    /// Traffic the mesh counts beside its groups' collectives.
    fn traffic<'a>(self: Rc<Self>) -> Rc<dyn Traffic + 'a>
    where
        Self: 'a;

    /// Refuses, as a usage error, what the style cannot train.
    fn check(&self, precision: Precision, cuda_graph: bool) -> Result<()>;

    /// The step the loop trains: `step`, or the style's around it.
    fn step<'g>(self: Rc<Self>, step: Box<dyn TrainStep<'g> + 'g>) -> Box<dyn TrainStep<'g> + 'g>
    where
        Self: 'g;

    /// The optimizer the loop steps over `params`, where the style runs its own: `spec`'s.
    fn optimizer<'g>(self: Rc<Self>, params: Vec<(String, Tensor)>, spec: OptimizerSpec) -> Box<dyn Optimizer + 'g>
    where
        Self: 'g;

    /// Whether the replicas step together, so that a stop can be agreed at any step.
    fn lockstep(&self) -> bool;

    /// After the loop (finished, or stopped by a signal): what must hear of it does; the
    /// style's figures for the results, on the rank that writes them.
    fn finish(&self) -> Result<Option<StyleReport>>;
}

/// A style's own figures for a run's results: one console line, and one entry of the results
/// document under the style's name (the parameter server's: `parameter_server`, the servers'
/// staleness).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StyleReport {
    ParameterServer(parameter_server::Report),
}

impl StyleReport {
    /// The console line.
    pub fn describe(&self) -> String {
        match self {
            StyleReport::ParameterServer(report) => report.describe(),
        }
    }
}

impl RunPart for WorkerLink<'_> {
    fn sync(&self) -> GradientSync {
        GradientSync::ParameterServer
    }

    fn traffic<'a>(self: Rc<Self>) -> Rc<dyn Traffic + 'a>
    where
        Self: 'a,
    {
        self
    }

    fn check(&self, precision: Precision, cuda_graph: bool) -> Result<()> {
        WorkerLink::check(self, precision, cuda_graph)
    }

    fn step<'g>(self: Rc<Self>, step: Box<dyn TrainStep<'g> + 'g>) -> Box<dyn TrainStep<'g> + 'g>
    where
        Self: 'g,
    {
        WorkerLink::step(&self, step)
    }

    fn optimizer<'g>(self: Rc<Self>, params: Vec<(String, Tensor)>, spec: OptimizerSpec) -> Box<dyn Optimizer + 'g>
    where
        Self: 'g,
    {
        WorkerLink::optimizer(&self, params, spec)
    }

    fn lockstep(&self) -> bool {
        WorkerLink::lockstep(self)
    }

    fn finish(&self) -> Result<Option<StyleReport>> {
        Ok(WorkerLink::finish(self)?.map(StyleReport::ParameterServer))
    }
}
