//! A job's start, before the mesh is made: how a style divides the job's ranks, which engine it
//! needs, and what it keeps for the run beyond its stateless [`super::Strategy`]. Only the
//! parameter server does any of it so far (its servers are ranks apart, talked to over MPI,
//! through a link every worker keeps); the experiment asks [`Job`] and [`RunPart`] and names no
//! style.
use std::rc::Rc;

use anyhow::Result;
use tch::Tensor;

use super::parameter_server::{self, WorkerLink};
use super::GradientSync;
use crate::comm::group::Traffic;
use crate::comm::{Backend, ProcessGroup};
use crate::optim::{Optimizer, OptimizerSpec};
use crate::precision::Precision;
use crate::train::TrainStep;

/// This rank's part of a job: every rank trains, unless the style sets some apart.
pub struct Job<'w> {
    world: &'w ProcessGroup,
    servers: Option<parameter_server::Job<'w>>,
}

impl<'w> Job<'w> {
    /// The engine the job's world needs: `chosen`, except that a parameter-server job left to
    /// choose gets MPI (its servers keep their tensors on the CPU and are talked to over MPI;
    /// NCCL would want a GPU for each of them too, and refuse two ranks on one).
    pub fn backend(chosen: Backend, servers: Option<&parameter_server::Config>) -> Backend {
        match chosen {
            Backend::Auto if servers.is_some() => Backend::Mpi,
            chosen => chosen,
        }
    }

    /// Divides `world` (every rank calls it, at the same point): the last ranks serve where
    /// `servers` asks for parameter servers.
    pub fn start(world: &'w ProcessGroup, servers: Option<parameter_server::Config>) -> Result<Job<'w>> {
        Ok(Job { world, servers: parameter_server::Job::start(world, servers)? })
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
    fn finish(&self) -> Result<Option<parameter_server::Report>>;
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

    fn finish(&self) -> Result<Option<parameter_server::Report>> {
        WorkerLink::finish(self)
    }
}
