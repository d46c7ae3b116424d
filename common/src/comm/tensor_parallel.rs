//! Megatron-LM's tensor parallelism (Shoeybi et al. 2019, `megatron/core/tensor_parallel`): every
//! layer of the Transformer cut over the `k` ranks of a tensor-parallel group, each rank
//! holding `1/k` of its weights and doing `1/k` of its arithmetic.
//!
//! - The conjugate operators: [`copy_to_shards`] is Megatron's **f** (identity forward,
//!   all-reduce of the gradient backward), [`reduce_from_shards`] its **g** (all-reduce
//!   forward, identity backward). tch cannot define autograd functions, so both are custom
//!   autograd functions of the C++ shim (`torch::autograd::Function`, as Megatron's
//!   `torch.autograd.Function`s) whose collective calls back into [`ProcessGroup::all_reduce`]:
//!   the gradients are the exact ones, computed by LibTorch's own backward pass.
//! - A column-parallel linear layer (Q/K/V split by heads, the first feed-forward layer) takes
//!   f of its input and gives each rank its slice of the outputs; the row-parallel layer after
//!   it (attention output, second feed-forward layer) multiplies its slice of the inputs and
//!   sums the partial products with g, adding its bias after the sum. So a layer costs two
//!   all-reduces forward (the two g) and two backward (the two f), Megatron's figure.
//! - The vocabulary is split too: the embedding's rows ([`Shard::range`] of the words; g sums
//!   the one rank's row with the others' zeros) and the output layer's, with a
//!   [`vocab_parallel_cross_entropy`] that never assembles the logits of the whole vocabulary.
//! - [`Split`] says how each of the model's variables is cut, each layer reporting its own
//!   ([`SplitTable`]), so checkpoints hold whole tensors under whole-model names ([`unshard`], [`shard_tensor`]) and resume on any `k`.
//!
//! Which ranks form a group is the job's [`super::layout::Layout`] (shards of one layer are
//! neighbouring ranks, inside a node). A group of one rank is no group: the layers then run
//! the unpartitioned code, bit for bit.
use std::ffi::c_void;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};
use torch_sys::C_tensor;

use super::{ProcessGroup, ReduceOp};
use crate::error::UsageError;
use crate::torch_ext;

/// This rank's share of every tensor-parallel layer: shard `index` of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// The whole layer (no tensor parallelism).
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    pub fn is_whole(self) -> bool {
        self.count == 1
    }

    /// Where this shard's part of `n` items starts, and its length (`n` divides by `count`).
    pub fn range(self, n: i64) -> (i64, i64) {
        let len = n / self.count as i64;
        (self.index as i64 * len, len)
    }

    /// Whether `count` shards can cut a model with these dimensions (every width a layer splits
    /// must divide by it), as a usage error naming the flag.
    pub fn check_divides(count: usize, dims: &[(&str, i64)]) -> Result<(), UsageError> {
        let k = count as i64;
        for (what, value) in dims {
            if value % k != 0 {
                return Err(UsageError(format!(
                    "tensor parallelism over {count} ranks cuts {what} into {count} equal parts, but it is {value}: choose a --tp that divides it{}",
                    if what.starts_with("the vocabulary") { " (or round it up: --pad-vocab 128)" } else { "" }
                )));
            }
        }
        Ok(())
    }
}

/// How one of the Transformer's variables is cut over the shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// The same on every shard (layer norms, the biases added after a row-parallel sum).
    Replicated,
    /// Rows (dimension 0): column-parallel weights and biases, the vocabulary's rows.
    Rows,
    /// Columns (dimension 1): row-parallel weights.
    Columns,
    /// `parts` blocks stacked along dimension 0, each cut by rows: the packed Q/K/V projection
    /// (`[q; k; v]`), so that a shard holds the same heads of all three.
    PackedRows(i64),
}

impl Split {
    /// The shape of `shard`'s part of a tensor of the `whole` shape cut this way: what
    /// [`shard_tensor`] returns, known before the tensor is made (the layers' constructors make
    /// their variables in it).
    pub fn shard_shape(self, whole: &[i64], shard: Shard) -> Vec<i64> {
        let mut shape = whole.to_vec();
        match self {
            Split::Replicated => {}
            Split::Rows => shape[0] = shard.range(whole[0]).1,
            Split::Columns => shape[1] = shard.range(whole[1]).1,
            Split::PackedRows(parts) => shape[0] = parts * shard.range(whole[0] / parts).1,
        }
        shape
    }
}

/// `shard`'s part of the whole tensor `full` cut as `split` says (a copy).
pub fn shard_tensor(full: &Tensor, split: Split, shard: Shard) -> Tensor {
    let cut = |t: &Tensor, dim: i64| {
        let (start, len) = shard.range(t.size()[dim as usize]);
        t.narrow(dim, start, len)
    };
    match split {
        _ if shard.is_whole() => full.copy(),
        Split::Replicated => full.copy(),
        Split::Rows => cut(full, 0).copy(),
        Split::Columns => cut(full, 1).copy(),
        Split::PackedRows(parts) => Tensor::cat(&full.chunk(parts, 0).iter().map(|block| cut(block, 0)).collect::<Vec<_>>(), 0),
    }
}

/// The whole tensor from every shard's part, in shard order (the inverse of [`shard_tensor`]).
pub fn unshard(parts: &[Tensor], split: Split) -> Tensor {
    match split {
        _ if parts.len() == 1 => parts[0].shallow_clone(),
        Split::Replicated => parts[0].shallow_clone(),
        Split::Rows => Tensor::cat(parts, 0),
        Split::Columns => Tensor::cat(parts, 1),
        Split::PackedRows(n) => {
            let blocks: Vec<Vec<Tensor>> = parts.iter().map(|p| p.chunk(n, 0)).collect();
            let stacked: Vec<Tensor> = (0..n as usize).map(|b| Tensor::cat(&blocks.iter().map(|bs| bs[b].shallow_clone()).collect::<Vec<_>>(), 0)).collect();
            Tensor::cat(&stacked, 0)
        }
    }
}

/// How a model's variables are cut over tensor-parallel shards, by their names in the var
/// store: what the model's tensor-parallel layers report of themselves
/// (`models::TransformerPart::splits`), so that a cut is said once, by the layer that makes the
/// variable. An optimizer-state entry `<entry>.<variable>` is cut as its variable; a tensor of
/// 0 dimensions (a step count) is whole everywhere; any other name is an error naming it, never
/// a silent "replicated". An empty table is a model that is never cut (the image models).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SplitTable(std::collections::BTreeMap<String, Split>);

impl SplitTable {
    /// The table of a model never cut into shards: every tensor of one dimension or more is
    /// refused by name.
    pub fn uncut() -> SplitTable {
        SplitTable::default()
    }

    /// Adds what a layer reports: variable `name` is cut as `split`.
    ///
    /// # Panics
    /// Where two layers report the same name: the model names two variables alike.
    pub fn insert(&mut self, name: String, split: Split) {
        let previous = self.0.insert(name.clone(), split);
        assert!(previous.is_none(), "two layers report the variable `{name}`");
    }

    /// The variables and their cuts, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Split)> {
        self.0.iter().map(|(name, split)| (name.as_str(), *split))
    }

    /// How the variable (or optimizer-state entry) `name` of `dims` dimensions is cut.
    pub fn split(&self, name: &str, dims: usize) -> Result<Split> {
        if dims == 0 {
            return Ok(Split::Replicated);
        }
        // `exp_avg.linear.weight`: the state of `linear.weight`.
        let known = |name: &str| self.0.get(name).copied();
        match known(name).or_else(|| name.split_once('.').and_then(|(_, variable)| known(variable))) {
            Some(split) => Ok(split),
            None if self.0.is_empty() => anyhow::bail!("`{name}`: this model is not cut into tensor-parallel shards"),
            None => anyhow::bail!("`{name}` is not a variable of this model's tensor-parallel layers"),
        }
    }
}

/// A rank's tensor-parallel shards: their group, which one this rank is, and how the model's
/// variables are cut (the model's table): what checkpoints put the whole tensors together from
/// and cut again on resume, knowing no model.
#[derive(Clone)]
pub struct TensorShards<'g> {
    pub group: &'g ProcessGroup,
    pub shard: Shard,
    pub splits: std::sync::Arc<SplitTable>,
}

impl TensorShards<'_> {
    /// How the variable (or optimizer state) `name` of `dims` dimensions is cut.
    pub fn split(&self, name: &str, dims: usize) -> anyhow::Result<Split> {
        self.splits.split(name, dims)
    }

    /// The whole tensors of `named` (this shard's variables or optimizer state, by whole-model
    /// names): all-gathered over the shards and put together. Every shard calls it with the
    /// same names in the same order.
    pub fn unshard_named(&self, named: Vec<(String, Tensor)>) -> anyhow::Result<Vec<(String, Tensor)>> {
        named
            .into_iter()
            .map(|(name, t)| {
                let split = self.split(&name, t.dim())?;
                if split == Split::Replicated {
                    return Ok((name, t));
                }
                let parts = self.group.all_gather(&t.detach().contiguous())?;
                Ok((name, unshard(&parts, split)))
            })
            .collect()
    }

    /// This rank's part of the whole tensor `whole` named `name` (as [`Self::unshard_named`]
    /// names them).
    pub fn shard_of(&self, name: &str, whole: &Tensor) -> anyhow::Result<Tensor> {
        Ok(shard_tensor(whole, self.split(name, whole.dim())?, self.shard))
    }
}

/// The shim's callback: an in-place all-reduce (sum) of `tensor` over the group `context`
/// points to. Errors and panics become a message for the C++ side, which throws it into
/// LibTorch's autograd (and so out of `backward`).
unsafe extern "C" fn all_reduce_sum(context: *mut c_void, tensor: *mut C_tensor, message: *mut u8, size: usize) -> i32 {
    let outcome = std::panic::catch_unwind(|| {
        // SAFETY: `context` is the `&ProcessGroup` given to f or g, alive until the pass that
        // uses it (see `copy_to_shards`); `tensor` is a live at::Tensor for this call, and a
        // shallow clone shares its storage, which the all-reduce overwrites in place.
        let group = unsafe { &*(context as *const ProcessGroup) };
        let mut t = unsafe { Tensor::clone_from_ptr(tensor) };
        group.all_reduce(&mut t, ReduceOp::Sum)
    });
    let error = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(err)) => format!("tensor-parallel all-reduce: {err:#}"),
        Err(_) => "tensor-parallel all-reduce panicked".to_string(),
    };
    // SAFETY: the C++ side passes a buffer of `size` bytes.
    unsafe { torch_ext::report_callback_error(&error, message, size) }
}

/// Megatron's f on `x` over `group`: the same values; in the backward pass the gradient of
/// every shard's use of `x` is summed over the shards (each column-parallel slice contributes
/// its part of the input's gradient). A group of one rank: `x` itself.
///
/// The autograd graph keeps a pointer to `group` until its backward pass: the group must
/// outlive the graphs made with it (groups live for the whole run; a step's graphs end with
/// the step).
pub fn copy_to_shards(x: &Tensor, group: &ProcessGroup) -> Result<Tensor> {
    if group.world_size() == 1 {
        return Ok(x.shallow_clone());
    }
    // SAFETY: see above; `all_reduce_sum` reads `group` only while it is alive.
    unsafe { torch_ext::collective_in_backward(x, all_reduce_sum, group as *const ProcessGroup as *mut c_void) }
}

/// Megatron's g on `x` over `group`: the sum of every shard's `x` (partial products of a
/// row-parallel layer); the gradient passes back unchanged to each shard.
pub fn reduce_from_shards(x: &Tensor, group: &ProcessGroup) -> Result<Tensor> {
    if group.world_size() == 1 {
        return Ok(x.shallow_clone());
    }
    // SAFETY: the group is alive during the call, the only time the forward collective runs.
    unsafe { torch_ext::collective_in_forward(x, all_reduce_sum, group as *const ProcessGroup as *mut c_void) }
}

/// Sequence parallelism (Korthikanti et al. 2022, Megatron-LM's `--sequence-parallel`): between
/// the tensor-parallel layers each shard holds its rows of the sequence (dimension 0), so the
/// layer norms, dropouts and residual additions work on 1/k of it; f and g become an all-gather
/// before a column-parallel layer and a reduce-scatter after a row-parallel one, the same bytes
/// as their all-reduce in two halves.
///
/// The shim's callback for a sequence-parallel region: `collective` over the group `context`
/// points to, from `input` into a new tensor handed to the shim.
unsafe fn sequence_collective(
    context: *mut c_void,
    input: *const C_tensor,
    output: *mut *mut C_tensor,
    message: *mut u8,
    size: usize,
    what: &str,
    collective: fn(&ProcessGroup, &Tensor) -> Result<Tensor>,
) -> i32 {
    let outcome = std::panic::catch_unwind(|| {
        // SAFETY: `context` is the `&ProcessGroup` given to the region, alive until the pass
        // that uses it (see `gather_sequence`); `input` is a live at::Tensor for this call.
        let group = unsafe { &*(context as *const ProcessGroup) };
        collective(group, &unsafe { Tensor::clone_from_ptr(input as *mut C_tensor) })
    });
    let error = match outcome {
        Ok(Ok(mut result)) => {
            // SAFETY: the shim takes the at::Tensor (and frees it): not dropped here.
            unsafe { *output = result.as_mut_ptr() };
            std::mem::forget(result);
            return 0;
        }
        Ok(Err(err)) => format!("{what}: {err:#}"),
        Err(_) => format!("{what} panicked"),
    };
    // SAFETY: the C++ side passes a buffer of `size` bytes.
    unsafe { torch_ext::report_callback_error(&error, message, size) }
}

/// Every shard's rows of `rows` (cut along dimension 0), in shard order.
fn gather_rows(group: &ProcessGroup, rows: &Tensor) -> Result<Tensor> {
    Ok(Tensor::cat(&group.all_gather(&rows.contiguous())?, 0))
}

/// This shard's rows of the sum of every shard's `whole` (a reduce-scatter along dimension 0,
/// which the shards divide).
fn scatter_rows(group: &ProcessGroup, whole: &Tensor) -> Result<Tensor> {
    let mut shape = whole.size();
    let k = group.world_size() as i64;
    anyhow::ensure!(shape[0] % k == 0, "a sequence of {} cannot be cut into {k} equal parts", shape[0]);
    shape[0] /= k;
    Ok(group.reduce_scatter(&whole.contiguous().view([-1]), ReduceOp::Sum)?.view(shape.as_slice()))
}

unsafe extern "C" fn gather_rows_callback(context: *mut c_void, input: *const C_tensor, output: *mut *mut C_tensor, message: *mut u8, size: usize) -> i32 {
    sequence_collective(context, input, output, message, size, "sequence-parallel all-gather", gather_rows)
}

unsafe extern "C" fn scatter_rows_callback(context: *mut c_void, input: *const C_tensor, output: *mut *mut C_tensor, message: *mut u8, size: usize) -> i32 {
    sequence_collective(context, input, output, message, size, "sequence-parallel reduce-scatter", scatter_rows)
}

/// The whole sequence from every shard's rows of `x` (an all-gather); in the backward pass each
/// shard's rows of the summed gradient (a reduce-scatter). Megatron's
/// `gather_from_sequence_parallel_region`. The group must outlive the graph (as for
/// [`copy_to_shards`]).
pub fn gather_sequence(x: &Tensor, group: &ProcessGroup) -> Result<Tensor> {
    if group.world_size() == 1 {
        return Ok(x.shallow_clone());
    }
    // SAFETY: see above.
    unsafe { torch_ext::transform_pair(x, gather_rows_callback, scatter_rows_callback, group as *const ProcessGroup as *mut c_void) }
}

/// This shard's rows of the sum of every shard's `x` (partial products of a row-parallel layer:
/// a reduce-scatter); in the backward pass the whole gradient from every shard's rows (an
/// all-gather). Megatron's `reduce_scatter_to_sequence_parallel_region`.
pub fn scatter_sequence(x: &Tensor, group: &ProcessGroup) -> Result<Tensor> {
    if group.world_size() == 1 {
        return Ok(x.shallow_clone());
    }
    // SAFETY: as for `gather_sequence`.
    unsafe { torch_ext::transform_pair(x, scatter_rows_callback, gather_rows_callback, group as *const ProcessGroup as *mut c_void) }
}

/// A column-parallel layer's output for this shard's rows `x` of the sequence: `x` gathered,
/// times `weight`ᵀ, plus `bias`, with only `x` kept for the backward pass (gathered again there;
/// the input's gradient reduce-scattered). Saving the gathered input instead would keep the
/// whole sequence per layer and lose sequence parallelism's memory.
pub fn gathered_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, group: &ProcessGroup) -> Result<Tensor> {
    if group.world_size() == 1 {
        return Ok(x.linear(weight, bias));
    }
    // SAFETY: as for `gather_sequence`.
    unsafe { torch_ext::gathered_linear(x, weight, bias, gather_rows_callback, scatter_rows_callback, group as *const ProcessGroup as *mut c_void) }
}

/// The mean cross-entropy of logits whose vocabulary is cut over `group` (`logits`: this
/// shard's `[.., V/k]`, words `shard.range(V)`) against `targets` (whole-vocabulary ids), and
/// the number of targets that are the arg-max, without any rank holding the whole logits
/// (Megatron's `vocab_parallel_cross_entropy`): the maximum over the shards (an all-reduce max,
/// outside the graph: a constant shift), then one all-reduce (g) of each token's sum of
/// exponentials and its target's shifted logit (held by one shard, zero elsewhere). The
/// gradient on each shard is its slice of softmax − one-hot, exactly the unpartitioned one.
/// (A tie for the maximum counts as a hit.)
pub fn vocab_parallel_cross_entropy(logits: &Tensor, targets: &Tensor, shard: Shard, group: &ProcessGroup) -> Result<(Tensor, Tensor)> {
    let local_vocab = *logits.size().last().expect("logits have a vocabulary dimension");
    let logits = logits.reshape([-1, local_vocab]).to_kind(Kind::Float);
    let targets = targets.reshape([-1]).to_kind(Kind::Int64);
    let mut max = logits.detach().amax(-1, false);
    group.all_reduce(&mut max, ReduceOp::Max)?;
    let shifted = &logits - max.unsqueeze(-1);
    let sum_exp = shifted.exp().sum_dim_intlist(-1, false, Kind::Float);
    let start = shard.index as i64 * local_vocab;
    let local = &targets - start;
    let outside = local.lt(0).logical_or(&local.ge(local_vocab));
    let picked = shifted.gather(-1, &local.masked_fill(&outside, 0).unsqueeze(-1), false).squeeze_dim(-1).masked_fill(&outside, 0.0);
    let both = reduce_from_shards(&Tensor::stack(&[sum_exp, picked], 0), group)?;
    let (sum_exp, picked) = (both.get(0), both.get(1));
    let loss = (sum_exp.log() - &picked).mean(Kind::Float);
    let hits = picked.detach().ge(0.0).sum(Kind::Int64);
    Ok((loss, hits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shards_shape_is_known_before_its_tensor() {
        let whole = Tensor::arange(12 * 8, (tch::Kind::Float, tch::Device::Cpu)).view([12, 8]);
        for split in [Split::Replicated, Split::Rows, Split::Columns, Split::PackedRows(3)] {
            for count in [1, 2, 4] {
                for index in 0..count {
                    let shard = Shard { index, count };
                    assert_eq!(split.shard_shape(&whole.size(), shard), shard_tensor(&whole, split, shard).size(), "{split:?} {shard:?}");
                }
            }
        }
        assert_eq!(Split::Rows.shard_shape(&[12], Shard { index: 1, count: 4 }), vec![3]);
    }
    use tch::Device;

    #[test]
    fn every_split_cuts_and_is_put_back_whole() {
        // [q; k; v] of 4 heads of width 1 over 2 shards: shard 1 holds heads 2 and 3 of each.
        let packed = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([12, 1]);
        let part = shard_tensor(&packed, Split::PackedRows(3), Shard { index: 1, count: 2 });
        assert_eq!(Vec::<f32>::try_from(part.view([-1])).unwrap(), vec![2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
        for split in [Split::Rows, Split::Columns, Split::PackedRows(3), Split::Replicated] {
            let whole = Tensor::randn([36, 6], (Kind::Float, Device::Cpu));
            for count in [1, 2, 3] {
                let parts: Vec<Tensor> = (0..count).map(|index| shard_tensor(&whole, split, Shard { index, count })).collect();
                assert!(unshard(&parts, split).equal(&whole), "{split:?} over {count}");
            }
        }
    }

    #[test]
    fn the_vocabulary_parallel_loss_of_one_shard_is_the_cross_entropy() {
        let group = ProcessGroup::single();
        let logits = Tensor::randn([5, 3, 11], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let targets = Tensor::randint(11, [5, 3], (Kind::Int64, Device::Cpu));
        let (loss, hits) = vocab_parallel_cross_entropy(&logits, &targets, Shard::WHOLE, &group).unwrap();
        let flat = logits.reshape([-1, 11]);
        let expected = flat.cross_entropy_for_logits(&targets.reshape([-1]));
        assert!((loss.double_value(&[]) - expected.double_value(&[])).abs() < 1e-6);
        let expected_hits = flat.argmax(-1, false).eq_tensor(&targets.reshape([-1])).sum(Kind::Int64);
        assert_eq!(hits.int64_value(&[]), expected_hits.int64_value(&[]));
        loss.backward();
        let grad = logits.grad();
        let reference = logits.detach().set_requires_grad(true);
        reference.reshape([-1, 11]).cross_entropy_for_logits(&targets.reshape([-1])).backward();
        assert!(grad.allclose(&reference.grad(), 1e-6, 1e-7, false));
    }

    #[test]
    fn dimensions_that_do_not_divide_are_usage_errors() {
        let err = Shard::check_divides(4, &[("--nhead", 16), ("the vocabulary", 28_782)]).unwrap_err();
        assert!(err.0.contains("the vocabulary into 4 equal parts, but it is 28782") && err.0.contains("--pad-vocab"), "{}", err.0);
        assert!(Shard::check_divides(2, &[("--emsize", 4096), ("the vocabulary", 28_782)]).is_ok());
    }
}
