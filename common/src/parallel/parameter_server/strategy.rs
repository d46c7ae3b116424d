//! The parameter servers' strategy (`--strategy parameter-server`): the workers do not average
//! among themselves; each pushes its gradients to the servers, whose optimizer updates, and
//! pulls the parameters back. The worker's link replaces the local optimizer and wraps the step
//! once they are built.
use anyhow::Result;

use crate::error::usage;
use crate::parallel::{GradientSync, Strategy};
use crate::train::GradientCollective;

pub struct ParameterServer;

impl Strategy for ParameterServer {
    fn sync(&self) -> GradientSync {
        GradientSync::ParameterServer
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
