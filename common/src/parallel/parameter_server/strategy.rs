//! The parameter servers' strategy (`--strategy parameter-server`): the workers do not average among themselves; each pushes its gradients to the servers, whose
//! optimizer updates, and pulls the parameters back. The worker's link replaces the local
//! optimizer and wraps the step once they are built.
use std::rc::Rc;

use anyhow::Result;
use tch::Tensor;

use crate::error::usage;
use crate::optim::Optimizer;
use crate::parallel::zero::Shards;
use crate::parallel::{BuildOptimizer, GradientSync, Replication, Strategy};
use crate::train::GradientCollective;

pub struct ParameterServer;

impl Strategy for ParameterServer {
    fn sync(&self) -> GradientSync {
        GradientSync::ParameterServer
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

    fn gradient_collective(&self, _clip: bool) -> GradientCollective {
        // The gradients go to the servers in the optimizer's step.
        GradientCollective::None
    }

    fn check_stages(&self) -> Result<()> {
        usage("--strategy parameter-server serves whole models: pipeline stages and tensor-parallel shards are not supported with it")
    }

    fn steps_apart(&self) -> Option<&'static str> {
        Some("--strategy parameter-server")
    }
}
