//! ZeRO's strategy (DeepSpeed's stages 1–3; stage 3 is PyTorch's FSDP): each replica keeps and
//! updates its block of the optimizer state, of the gradients from stage 2, of the parameters
//! at stage 3 (the parent module does the sharding and its collectives).
use std::rc::Rc;

use anyhow::{Context, Result};
use tch::Tensor;

use super::{Shards, ZeroOptimizer, ZeroStage};
use crate::optim::Optimizer;
use crate::parallel::{BuildOptimizer, GradientSync, Replication, Strategy};
use crate::train::GradientCollective;

pub struct Zero(pub ZeroStage);

impl Strategy for Zero {
    fn sync(&self) -> GradientSync {
        GradientSync::Zero(self.0)
    }

    fn shard_parameters<'g>(
        &self,
        replication: &Replication<'g>,
        named: Vec<(String, Tensor)>,
        part_of: &dyn Fn(&str) -> Result<usize>,
    ) -> Result<Option<Rc<Shards<'g>>>> {
        if self.0 != ZeroStage::Parameters {
            return Ok(None);
        }
        // FSDP: the parameters sharded over the replicas from the start.
        let parts = super::parts(&named, part_of)?;
        Ok(Some(Shards::new(ZeroStage::Parameters, replication.group, named, Some(parts), replication.averager.bucket_bytes)?))
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
