//! Horovod: the optimizer averages the gradients inside its step
//! ([`DistributedOptimizer`]), the same collectives as DDP's at another place.
use std::rc::Rc;

use anyhow::Result;
use tch::Tensor;

use super::{BuildOptimizer, GradientSync, Replication, Strategy};
use crate::dist::data_parallel::DistributedOptimizer;
use crate::dist::zero::Shards;
use crate::error::usage;
use crate::optim::Optimizer;
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
