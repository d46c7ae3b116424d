//! The parameter servers' strategy (`--strategy parameter-server`): the workers do not average
//! among themselves; each pushes its gradients to the servers, whose optimizer updates, and
//! pulls the parameters back. The worker's link replaces the local optimizer and wraps the step
//! once they are built.
use anyhow::Result;

use crate::comm::group::Collective;
use crate::error::usage;
use crate::parallel::costs::{Among, Costs, Talk};
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

/// A worker's costs: its memory counted as a plain replica's (the defaults: its whole
/// parameters and gradients, and K·Ψ of optimizer state, which the servers hold instead: an
/// overestimate of a worker, kept as the estimate has always printed it). The planner lays out
/// no parameter servers.
impl Costs for ParameterServer {
    /// Its gradients pushed to the servers and the parameters pulled back, point to point.
    fn communication(&self, _replicas: usize, _state_shards: usize, gradient_bytes: f64) -> Vec<Talk> {
        vec![
            Talk { collective: Collective::Send, among: Among::Servers, bytes: gradient_bytes, times: 1.0 },
            Talk { collective: Collective::Recv, among: Among::Servers, bytes: gradient_bytes, times: 1.0 },
        ]
    }
}
