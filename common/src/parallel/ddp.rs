//! DDP (PyTorch's `DistributedDataParallel`): every replica averages its gradients in the
//! loop, right after backward, and steps a local optimizer.
use anyhow::Result;
use tch::Tensor;

use super::{GradientSync, Replication, Strategy};
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
