//! The collectives of a world of one rank: every operation is an identity, so a single
//! process runs the same data-parallel code path as many, with no engine and no cost.
use anyhow::{bail, Result};
use tch::Tensor;

use super::{check_reduce, check_root, check_scatter, Collectives, ReduceOp};

/// Collectives for world size 1, on any device.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleProcess;

impl Collectives for SingleProcess {
    fn name(&self) -> &'static str {
        "single"
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        // Same argument checks as the real engines, so a mistake shows up without a second rank.
        check_reduce(tensor.kind(), op)
    }

    fn broadcast(&self, _tensor: &mut Tensor, root: usize) -> Result<()> {
        check_root(root, 1)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        // A copy, as the real engines return: later in-place changes to `tensor` must not show.
        Ok(vec![tensor.detach().copy()])
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        check_scatter(tensor, op, 1)?;
        Ok(tensor.detach().reshape([-1]).copy())
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn send(&self, _tensor: &Tensor, dst: usize) -> Result<()> {
        bail!("send to rank {dst}: a world of one rank has no peer")
    }

    fn recv(&self, _tensor: &mut Tensor, src: usize) -> Result<()> {
        bail!("receive from rank {src}: a world of one rank has no peer")
    }

    /// Nothing can have been sent.
    fn wait_sends(&self) -> Result<()> {
        Ok(())
    }
}
