//! Horovod: the optimizer averages the gradients inside its step
//! ([`DistributedOptimizer`]), the same collectives as DDP's at another place.
use std::rc::Rc;

use anyhow::Result;
use tch::Tensor;

use super::costs::{Costs, Talk};
use super::{BuildOptimizer, GradientSync, Replication, Strategy};
use crate::comm::data_parallel::GradientAverager;
use crate::comm::group::Collective;
use crate::comm::ProcessGroup;
use crate::error::usage;
use crate::optim::{forward_to, Optimizer};
use crate::parallel::zero::Shards;
use crate::train::GradientCollective;

pub struct Horovod;

impl Strategy for Horovod {
    fn sync(&self) -> GradientSync {
        GradientSync::Horovod
    }

    fn optimizer<'g: 'o, 'o>(
        &self,
        replication: &Replication<'g>,
        params: Vec<(String, Tensor)>,
        _: Option<Rc<Shards<'g>>>,
        build: BuildOptimizer<'_, 'o>,
    ) -> Result<Box<dyn Optimizer + 'o>> {
        let averaged = params.iter().map(|(_, t)| t.shallow_clone()).collect();
        Ok(Box::new(DistributedOptimizer::new(build(params), averaged, replication.group, replication.averager)))
    }

    fn gradient_collective(&self, clip: bool) -> GradientCollective {
        // Clipping needs the averaged gradients before the optimizer's step: its
        // `synchronize` averages then, in the loop's gradient phase.
        if clip {
            GradientCollective::AllReduce
        } else {
            GradientCollective::None
        }
    }

    fn check_stages(&self) -> Result<()> {
        // Horovod's optimizer averages inside its step, after the whole model's backward; the
        // stages finish their gradients in the loop (DDP's place), where ZeRO-1's too.
        usage("Horovod-style averaging (inside the optimizer) is not built for pipeline stages: their replicas average DDP-style")
    }
}

/// Plain replicas' costs (the defaults); the planner lays out DDP, whose costs these are too.
impl Costs for Horovod {
    /// One all-reduce of the gradients, in the optimizer's step.
    fn communication(&self, replicas: usize, _state_shards: usize, gradient_bytes: f64) -> Vec<Talk> {
        vec![Talk::replicas(Collective::AllReduce, replicas, gradient_bytes, 1.0)]
    }
}

/// Horovod's `hvd.DistributedOptimizer`: wraps a local optimizer so that its step first
/// averages the gradients of `params` over the ranks (through a [`GradientAverager`], in
/// buckets), then updates. Where something must read the averaged gradients before the step
/// (gradient clipping), call [`Optimizer::synchronize`] first, as with Horovod's
/// `optimizer.synchronize()`: the step that follows does not average again.
///
/// Everything else (learning rate, state, name) is the wrapped optimizer's, so checkpoints and
/// [`crate::comm::data_parallel::broadcast_optimizer_state`] see the same state as without the wrapper.
pub struct DistributedOptimizer<'g> {
    inner: Box<dyn Optimizer + 'g>,
    params: Vec<Tensor>,
    group: &'g ProcessGroup,
    averager: GradientAverager,
    /// The gradients were averaged by `synchronize` since the last step.
    synchronized: bool,
}

impl<'g> DistributedOptimizer<'g> {
    /// `params` in the same order on every rank (e.g. `VarStore::trainable_variables`).
    pub fn new(inner: Box<dyn Optimizer + 'g>, params: Vec<Tensor>, group: &'g ProcessGroup, averager: GradientAverager) -> Self {
        DistributedOptimizer { inner, params, group, averager, synchronized: false }
    }
}

impl Optimizer for DistributedOptimizer<'_> {
    fn step(&mut self) -> Result<()> {
        self.synchronize()?;
        self.synchronized = false;
        self.inner.step()
    }

    fn synchronize(&mut self) -> Result<()> {
        if !self.synchronized {
            self.averager.average(self.group, &self.params)?;
            self.synchronized = true;
        }
        Ok(())
    }

    fn zero_grad(&mut self) {
        // New gradients are coming: they will need averaging, whatever happened before.
        self.synchronized = false;
        self.inner.zero_grad();
    }

    forward_to!(inner: lr, set_lr, state_tensors, load_state_tensors, name);
}
