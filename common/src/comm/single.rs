//! The collectives of a world of one rank: every operation is an identity, so a single
//! process runs the same data-parallel code path as many, with no engine and no cost; and
//! [`SilentShards`], one rank answering for several, to time a shard's arithmetic alone.
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

/// The collectives of `size` ranks answered by this one alone, with results of the right
/// shape and no communication: an all-reduce leaves the tensor as it is, an all-gather returns
/// `size` copies of it, a reduce-scatter the first block. What a tensor-parallel shard's
/// arithmetic costs without its talk is timed with it (`exercise3 profile`); its values are no
/// real job's.
#[derive(Debug, Clone, Copy)]
pub struct SilentShards {
    pub size: usize,
}

impl Collectives for SilentShards {
    fn name(&self) -> &'static str {
        "silent"
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        check_reduce(tensor.kind(), op)
    }

    fn broadcast(&self, _tensor: &mut Tensor, root: usize) -> Result<()> {
        check_root(root, self.size)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        Ok((0..self.size).map(|_| tensor.detach().copy()).collect())
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let block = check_scatter(tensor, op, self.size)?;
        Ok(tensor.detach().reshape([-1]).narrow(0, 0, block as i64).copy())
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn send(&self, _tensor: &Tensor, dst: usize) -> Result<()> {
        bail!("send to rank {dst}: silent shards exchange nothing")
    }

    fn recv(&self, _tensor: &mut Tensor, src: usize) -> Result<()> {
        bail!("receive from rank {src}: silent shards exchange nothing")
    }

    fn wait_sends(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn silent_shards_answer_in_the_shapes_of_their_size() {
        let silent = SilentShards { size: 4 };
        let t = Tensor::arange(8, (Kind::Float, Device::Cpu));
        let mut reduced = t.copy();
        silent.all_reduce(&mut reduced, ReduceOp::Sum).unwrap();
        assert!(reduced.equal(&t));
        let gathered = silent.all_gather(&t).unwrap();
        assert_eq!(gathered.len(), 4);
        assert!(gathered.iter().all(|g| g.equal(&t)));
        assert_eq!(Vec::<f32>::try_from(silent.reduce_scatter(&t, ReduceOp::Sum).unwrap()).unwrap(), [0.0, 1.0]);
        assert!(silent.reduce_scatter(&Tensor::zeros([6], (Kind::Float, Device::Cpu)), ReduceOp::Sum).is_err(), "6 elements do not cut in 4");
        assert!(silent.send(&t, 1).is_err());
    }
}
