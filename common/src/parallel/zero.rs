//! ZeRO (DeepSpeed's stages 1–3; stage 3 is PyTorch's FSDP): each replica keeps and updates its
//! block of the optimizer state, of the gradients from stage 2, of the parameters at stage 3
//! ([`crate::dist::zero`] does the sharding and its collectives).
use std::rc::Rc;

use anyhow::{Context, Result};
use tch::{nn, Tensor};

use super::{BuildOptimizer, GradientSync, LocalStep, Parallel, Replication, Strategy};
use crate::dist::zero::{Shards, ZeroOptimizer, ZeroStage};
use crate::models::PartedModule;
use crate::optim::Optimizer;
use crate::train::GradientCollective;

pub struct Zero(pub ZeroStage);

impl Strategy for Zero {
    fn sync(&self) -> GradientSync {
        GradientSync::Zero(self.0)
    }

    fn whole_step<'g>(&self, vs: nn::VarStore, module: Box<dyn PartedModule>, parallel: Parallel<'g>) -> Result<LocalStep<'g>> {
        match self.0 {
            // FSDP: the parameters sharded over the replicas from the start.
            ZeroStage::Parameters => LocalStep::sharded(vs, module, parallel),
            _ => Ok(LocalStep::parted(vs, module, parallel)),
        }
    }

    fn optimizer<'g: 'o, 'o>(
        &self,
        replication: &Replication<'g>,
        params: Vec<(String, Tensor)>,
        zero3: Option<Rc<Shards<'g>>>,
        build: BuildOptimizer<'_, 'o>,
    ) -> Result<Box<dyn Optimizer + 'o>> {
        let shards = match self.0 {
            // The block the step's sharded parameters already are.
            ZeroStage::Parameters => zero3.context("ZeRO-3 shards the parameters when the step is built, and this step was built without")?,
            stage => Shards::new(stage, replication.group, params, None, replication.averager.bucket_bytes)?,
        };
        Ok(Box::new(ZeroOptimizer::over(shards, build)))
    }

    fn gradient_collective(&self, _clip: bool) -> GradientCollective {
        GradientCollective::ReduceScatter
    }
}
