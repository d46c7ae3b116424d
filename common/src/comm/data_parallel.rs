//! Data parallelism by hand, as Horovod and `DistributedDataParallel` do it: every rank holds
//! a full replica, starts from rank 0's state ([`broadcast_parameters`],
//! [`broadcast_optimizer_state`]), trains on its own shard of each batch, and averages the
//! gradients after every backward pass ([`GradientAverager`]) so the replicas take identical
//! steps. Metrics are averaged the same way ([`metric_average`]). The averaging runs either in
//! the training loop after backward (DDP's way) or inside the optimizer's step (Horovod's way,
//! [`crate::parallel::DistributedOptimizer`]): the same collectives, in the same order.
use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use tch::{nn, Device, Kind, Tensor};

use super::{ProcessGroup, ReduceOp};
use crate::optim::Optimizer;

/// Overwrites every variable of `vs` (trainable or not, so buffers such as batch-norm
/// statistics too) with its value on rank `root`, in name order (the same order on every rank,
/// whatever order the variables were created in).
pub fn broadcast_parameters(group: &ProcessGroup, vs: &nn::VarStore, root: usize) -> Result<()> {
    broadcast_variables(group, vs, root, |_| true)
}

/// Makes every rank's buffers (variables without gradient, e.g. batch-norm running
/// statistics, which each rank updates from its own shard) rank `root`'s, as DDP's
/// `broadcast_buffers` does.
pub fn broadcast_buffers(group: &ProcessGroup, vs: &nn::VarStore, root: usize) -> Result<()> {
    broadcast_variables(group, vs, root, |var| !var.requires_grad())
}

/// Broadcasts the variables `keep` selects, in name order (the same on every rank).
fn broadcast_variables(group: &ProcessGroup, vs: &nn::VarStore, root: usize, keep: impl Fn(&Tensor) -> bool) -> Result<()> {
    broadcast_named(group, vs.variables().into_iter().filter(|(_, var)| keep(var)).collect(), root)
}

/// Overwrites every variable in `vars` with its value on rank `root`, in name order (the same
/// on every rank, whatever order they come in): for variables that live outside one var store
/// (a pipeline stage's, say).
pub fn broadcast_named(group: &ProcessGroup, mut vars: Vec<(String, Tensor)>, root: usize) -> Result<()> {
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    tch::no_grad(|| vars.iter_mut().try_for_each(|(name, var)| group.broadcast(var, root).with_context(|| format!("broadcasting variable `{name}`"))))
}

/// One optimizer state tensor as rank `root` describes it to the others.
#[derive(serde::Serialize, serde::Deserialize)]
struct StateEntry {
    name: String,
    shape: Vec<i64>,
    /// `Kind`'s debug name (tch has no stable serialisation of its kinds).
    kind: String,
    cuda: bool,
}

/// Makes every rank's optimizer state (Adam's moments and step counts, SGD's momentum) rank
/// `root`'s: the list of state tensors (names, shapes, kinds) is broadcast first, so the other
/// ranks can allocate them whatever state they had (typically none yet), then each tensor, then
/// the other ranks load them ([`Optimizer::load_state_tensors`]: they must describe the same
/// parameters). Together with [`broadcast_parameters`], a run restored from a checkpoint on
/// rank 0 continues identically on every rank.
pub fn broadcast_optimizer_state(group: &ProcessGroup, opt: &mut dyn Optimizer, root: usize) -> Result<()> {
    let mine = if group.rank() == root { opt.state_tensors() } else { Vec::new() };
    broadcast_state(group, opt, root, mine, false)
}

/// Gives every rank of a sharded optimizer (ZeRO) the whole state `root_state` that rank `root`
/// holds (read from a checkpoint; nothing on a fresh start): each rank, root included, loads it
/// and keeps its share.
pub fn broadcast_sharded_state(group: &ProcessGroup, opt: &mut dyn Optimizer, root: usize, root_state: Vec<(String, Tensor)>) -> Result<()> {
    broadcast_state(group, opt, root, root_state, true)
}

/// Broadcasts `mine` (rank `root`'s list; ignored elsewhere) and loads it on the other ranks,
/// and on the root too when `load_on_root`.
fn broadcast_state(group: &ProcessGroup, opt: &mut dyn Optimizer, root: usize, mine: Vec<(String, Tensor)>, load_on_root: bool) -> Result<()> {
    let is_root = group.rank() == root;
    let manifest: Vec<StateEntry> =
        mine.iter().map(|(name, t)| StateEntry { name: name.clone(), shape: t.size(), kind: format!("{:?}", t.kind()), cuda: t.device().is_cuda() }).collect();
    let manifest: Vec<StateEntry> =
        serde_json::from_slice(&group.broadcast_bytes(&serde_json::to_vec(&manifest)?, root)?).context("decoding the optimizer state list from rank 0")?;
    let mut received = HashMap::with_capacity(manifest.len());
    for (i, entry) in manifest.into_iter().enumerate() {
        let mut tensor = if is_root {
            mine[i].1.shallow_clone()
        } else {
            // The kind and size of rank `root`'s tensor, on this rank's own device of its type.
            Tensor::empty(entry.shape.as_slice(), (kind_named(&entry.kind)?, group.device(entry.cuda)))
        };
        group.broadcast(&mut tensor, root).with_context(|| format!("broadcasting optimizer state `{}`", entry.name))?;
        received.insert(entry.name, tensor);
    }
    if !is_root || load_on_root {
        opt.load_state_tensors(&received).context("loading rank 0's optimizer state")?;
    }
    Ok(())
}

/// The kind whose debug name is `name`.
fn kind_named(name: &str) -> Result<Kind> {
    const KINDS: [Kind; 10] = [Kind::Uint8, Kind::Int8, Kind::Int16, Kind::Int, Kind::Int64, Kind::Half, Kind::Float, Kind::Double, Kind::Bool, Kind::BFloat16];
    match KINDS.into_iter().find(|k| format!("{k:?}") == name) {
        Some(kind) => Ok(kind),
        None => bail!("optimizer state of kind {name} cannot be broadcast"),
    }
}

/// Averages gradients over the ranks after each backward pass, in buckets: the gradients are
/// packed into flat buffers of at most `bucket_bytes` (a larger gradient gets a bucket of its
/// own), one all-reduce per bucket, so a model with hundreds of small tensors costs a few
/// large messages instead of hundreds of small latency-bound ones (DDP's `bucket_cap_mb`).
/// With `fp16`, buckets travel as float16 (half the bytes, Horovod's `Compression.fp16`) and
/// are converted back; only NCCL reduces float16 (MPI has no such type).
#[derive(Debug, Clone, Copy)]
pub struct GradientAverager {
    pub bucket_bytes: usize,
    pub fp16: bool,
}

impl GradientAverager {
    pub fn new(bucket_bytes: usize, fp16: bool) -> GradientAverager {
        GradientAverager { bucket_bytes, fp16 }
    }

    /// Fails if `fp16` is asked for but the engine for `device` cannot reduce float16. Called
    /// by [`GradientAverager::average`]; call it at start-up to report the mistake before
    /// training.
    pub fn check(&self, group: &ProcessGroup, device: Device) -> Result<()> {
        let engine = group.backend_for(device)?;
        if self.fp16 && group.world_size() > 1 && !engine.supports_kind(Kind::Half) {
            return crate::error::usage(format!(
                "--fp16-allreduce needs NCCL: the {} engine that reduces {} tensors has no float16",
                engine.name(),
                crate::device::device_name(device)
            ));
        }
        Ok(())
    }

    /// Replaces the gradient of every parameter in `params` that has one by its average over
    /// the ranks. Every rank must pass the same parameters in the same order, with gradients
    /// for the same ones (as DDP without `find_unused_parameters`).
    pub fn average(&self, group: &ProcessGroup, params: &[Tensor]) -> Result<()> {
        let grads: Vec<Tensor> = params.iter().map(Tensor::grad).filter(Tensor::defined).collect();
        for grad in &grads {
            self.check(group, grad.device())?;
        }
        if group.world_size() == 1 {
            return Ok(()); // the average of one
        }
        tch::no_grad(|| self.buckets(&grads).try_for_each(|bucket| self.average_bucket(group, bucket)))
    }

    /// Consecutive runs of gradients sharing device and kind, of at most `bucket_bytes` each
    /// (a single larger gradient makes a bucket on its own).
    fn buckets<'a>(&self, grads: &'a [Tensor]) -> impl Iterator<Item = &'a [Tensor]> + 'a {
        let limit = self.bucket_bytes;
        let mut rest = grads;
        std::iter::from_fn(move || {
            let first = rest.first()?;
            let mut bytes = 0;
            let len = rest
                .iter()
                .take_while(|g| {
                    bytes += g.numel() * g.kind().elt_size_in_bytes();
                    g.device() == first.device() && g.kind() == first.kind() && bytes <= limit
                })
                .count()
                .max(1);
            let (bucket, tail) = rest.split_at(len);
            rest = tail;
            Some(bucket)
        })
    }

    fn average_bucket(&self, group: &ProcessGroup, bucket: &[Tensor]) -> Result<()> {
        let kind = bucket[0].kind();
        let flat: Vec<Tensor> = bucket.iter().map(|g| g.reshape([-1])).collect();
        let mut buffer = Tensor::cat(&flat, 0);
        if self.fp16 {
            buffer = buffer.to_kind(Kind::Half);
        }
        group.all_reduce(&mut buffer, ReduceOp::Average)?;
        let buffer = buffer.to_kind(kind);
        let sizes: Vec<i64> = bucket.iter().map(|g| g.numel() as i64).collect();
        for (grad, averaged) in bucket.iter().zip(buffer.split_with_sizes(&sizes, 0)) {
            // `grad` shares its memory with the parameter's gradient: this updates it in place.
            let mut grad = grad.shallow_clone();
            grad.copy_(&averaged.view_as(&grad));
        }
        Ok(())
    }
}

/// `value` averaged over the ranks (Horovod's `metric_average`), e.g. a loss or an accuracy
/// that each rank computed on its own shard.
pub fn metric_average(group: &ProcessGroup, value: f64) -> Result<f64> {
    let mut t = Tensor::from(value);
    group.all_reduce(&mut t, ReduceOp::Average)?;
    Ok(t.double_value(&[]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bucket lengths `bucket_bytes` makes of gradients with these element counts and kinds.
    fn bucket_lengths(bucket_bytes: usize, grads: &[(i64, Kind)]) -> Vec<usize> {
        let grads: Vec<Tensor> = grads.iter().map(|&(n, kind)| Tensor::zeros([n], (kind, Device::Cpu))).collect();
        GradientAverager::new(bucket_bytes, false).buckets(&grads).map(<[Tensor]>::len).collect()
    }

    #[test]
    fn buckets_hold_at_most_bucket_bytes_of_one_kind() {
        let f = Kind::Float;
        // 4-byte floats: 10 + 6 elements = 64 bytes fit one 64-byte bucket, the next starts anew.
        assert_eq!(bucket_lengths(64, &[(10, f), (6, f), (1, f)]), [2, 1]);
        // A gradient larger than a bucket travels alone; nothing is ever dropped.
        assert_eq!(bucket_lengths(64, &[(100, f), (1, f), (100, f)]), [1, 1, 1]);
        assert_eq!(bucket_lengths(0, &[(1, f), (1, f)]), [1, 1]);
        // A change of kind closes the bucket, whatever room is left.
        assert_eq!(bucket_lengths(1 << 20, &[(1, f), (1, f), (1, Kind::Double), (1, f)]), [2, 1, 1]);
        assert_eq!(bucket_lengths(1 << 20, &[]), Vec::<usize>::new());
    }
}
