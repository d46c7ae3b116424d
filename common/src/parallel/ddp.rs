//! DDP (PyTorch's `DistributedDataParallel`): every replica averages its gradients in the
//! loop, right after backward, and steps a local optimizer.
use std::rc::Rc;

use anyhow::Result;
use tch::Tensor;

use super::{BuildOptimizer, GradientSync, Replication, Strategy};
use crate::optim::Optimizer;
use crate::parallel::zero::Shards;
use crate::train::GradientCollective;

pub struct Ddp;

impl Strategy for Ddp {
    fn sync(&self) -> GradientSync {
        GradientSync::Ddp
    }

    fn optimizer<'g: 'o, 'o>(
        &self,
        _: &Replication<'g>,
        params: Vec<(String, Tensor)>,
        _: Option<Rc<Shards<'g>>>,
        build: BuildOptimizer<'_, 'o>,
    ) -> Result<Box<dyn Optimizer + 'o>> {
        Ok(build(params))
    }

    fn after_backward(&self, replication: &Replication<'_>, params: &[Tensor]) -> Result<()> {
        replication.averager.average(replication.group, params)
    }

    fn gradient_collective(&self, _clip: bool) -> GradientCollective {
        GradientCollective::AllReduce
    }
}
