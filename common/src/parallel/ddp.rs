//! DDP (PyTorch's `DistributedDataParallel`): every replica averages its gradients in the
//! loop, right after backward, and steps a local optimizer.
use anyhow::Result;
use tch::Tensor;

use super::costs::{Costs, Talk};
use super::{GradientSync, Replication, Strategy};
use crate::comm::group::Collective;
use crate::train::GradientCollective;

pub struct Ddp;

impl Strategy for Ddp {
    fn sync(&self) -> GradientSync {
        GradientSync::Ddp
    }

    fn after_backward(&self, replication: &Replication<'_>, params: &[Tensor]) -> Result<()> {
        replication.averager.average(replication.group, params)
    }

    fn gradient_collective(&self, _clip: bool) -> GradientCollective {
        GradientCollective::AllReduce
    }
}

/// Plain replicas' costs (the defaults): the whole model state on every replica.
impl Costs for Ddp {
    /// One all-reduce of the gradients.
    fn communication(&self, replicas: usize, _state_shards: usize, gradient_bytes: f64) -> Vec<Talk> {
        vec![Talk::replicas(Collective::AllReduce, replicas, gradient_bytes, 1.0)]
    }

    /// Always (one replica too): the layouts the planner's exercises train with.
    fn shard_groups(&self, _replicas: usize, _whole_model: bool) -> Vec<Option<usize>> {
        vec![None]
    }
}
