//! Megatron-LM's tensor-parallel layers (`megatron/core/tensor_parallel/layers.py`), each
//! making its own variables in its shard's shape and reporting how it is cut
//! ([`ReportSplits::report_splits`]): a column-parallel linear layer (rows of the weight and
//! the bias, or of each packed block of them), a row-parallel one (columns of the weight, the
//! bias whole), the vocabulary-parallel embedding (rows: words) and the layer norms every shard
//! holds whole. A model built from them knows each variable's cut from the layer that made it,
//! which checkpoints, ZeRO and the starting values ask through a [`SplitTable`]; no table of
//! names restates it.
//!
//! How a shard talks to the others around a layer is [`Talk`]: nothing for a whole layer,
//! Megatron's f and g with tensor parallelism, an all-gather and a reduce-scatter with sequence
//! parallelism. A layer of a whole model ([`Shard::WHOLE`]) runs the unpartitioned arithmetic,
//! bit for bit torch's.
use anyhow::Result;
use tch::nn::{self, Init};
use tch::Tensor;

use crate::comm::tensor_parallel::{self as tp, Shard, Split, SplitTable};
use crate::comm::ProcessGroup;

/// A layer (or a model made of layers) that knows how tensor parallelism cuts its variables.
pub trait ReportSplits {
    /// Adds each of its variables, by its name in the var store, with its cut.
    fn report_splits(&self, table: &mut SplitTable);
}

/// How a layer's shard talks to the other shards of its layer (Megatron's f and g), the
/// activations between the tensor-parallel layers whole on every shard, or with sequence
/// parallelism each shard's rows of the sequence (dimension 0).
#[derive(Clone, Copy)]
pub enum Talk<'a> {
    /// A whole layer.
    Alone,
    /// Tensor parallelism: f before a column-parallel layer (identity; gradients all-reduced),
    /// g after a row-parallel one (all-reduce).
    Tensor(&'a ProcessGroup),
    /// Sequence parallelism: an all-gather of the rows before a column-parallel layer, a
    /// reduce-scatter into rows after a row-parallel one ([`tp::gathered_linear`],
    /// [`tp::scatter_sequence`]).
    Sequence(&'a ProcessGroup),
}

impl<'a> Talk<'a> {
    /// How a layer of `shard` talks over `group` (which must then be the shards'), cutting the
    /// sequence where `sequence_parallel` says.
    pub fn of(shard: Shard, sequence_parallel: bool, group: Option<&'a ProcessGroup>) -> Result<Talk<'a>> {
        let group = match (shard.is_whole(), group) {
            (true, _) => return Ok(Talk::Alone),
            (false, Some(group)) if group.world_size() == shard.count && group.rank() == shard.index => group,
            (false, _) => anyhow::bail!("shard {} of {} of a layer run without its tensor-parallel group of {} ranks", shard.index, shard.count, shard.count),
        };
        Ok(if sequence_parallel { Talk::Sequence(group) } else { Talk::Tensor(group) })
    }

    /// The parameters every shard holds whole, as this shard uses them: under sequence
    /// parallelism on its rows only, so their gradients are summed over the shards (Megatron's
    /// all-reduce of the sequence-parallel parameters' gradients: one f over all of them).
    pub fn whole<const N: usize>(self, parameters: [&Tensor; N]) -> Result<[Tensor; N]> {
        let Talk::Sequence(group) = self else { return Ok(parameters.map(Tensor::shallow_clone)) };
        let flat: Vec<Tensor> = parameters.iter().map(|p| p.reshape([-1])).collect();
        let summed = tp::copy_to_shards(&Tensor::cat(&flat, 0), group)?;
        let sizes: Vec<i64> = parameters.iter().map(|p| p.numel() as i64).collect();
        let parts = summed.split_with_sizes(sizes.as_slice(), 0);
        Ok(std::array::from_fn(|i| parts[i].view(parameters[i].size().as_slice())))
    }
}

/// The variable `name` under `vs`, of `shard`'s part of the `whole` shape cut as `split`.
fn variable(vs: &nn::Path, name: &str, whole: &[i64], split: Split, shard: Shard, init: Init) -> (Tensor, String) {
    (vs.var(name, &split.shard_shape(whole, shard), init), vs.path(name))
}

/// `nn.Linear`'s bias initialisation, U(±1/√fan_in), as `nn::linear` draws it.
fn default_bias(fan_in: i64) -> Init {
    let bound = 1.0 / (fan_in as f64).sqrt();
    Init::Uniform { lo: -bound, up: bound }
}

/// A linear layer's two variables, drawn in `nn::linear`'s order (bias, then weight), as one
/// split cuts them: the weight `[out, in]` as `splits[0]`, the bias `[out]` as `splits[1]`.
struct LinearVariables {
    weight: Tensor,
    bias: Tensor,
    names: [String; 2],
    splits: [Split; 2],
}

impl LinearVariables {
    /// `vs / "weight"` and `vs / "bias"` (`nn::linear`'s names and order); `bias_init` None is
    /// torch's default over the shard's inputs (a shard's starting values are then copied in
    /// from the whole layer's).
    fn linear(vs: &nn::Path, [out, input]: [i64; 2], splits: [Split; 2], shard: Shard, weight_init: Init, bias_init: Option<Init>) -> LinearVariables {
        let fan_in = splits[0].shard_shape(&[out, input], shard)[1];
        let (bias, bias_name) = variable(vs, "bias", &[out], splits[1], shard, bias_init.unwrap_or_else(|| default_bias(fan_in)));
        let (weight, weight_name) = variable(vs, "weight", &[out, input], splits[0], shard, weight_init);
        LinearVariables { weight, bias, names: [weight_name, bias_name], splits }
    }

    fn report(&self, table: &mut SplitTable) {
        for (name, split) in self.names.iter().zip(self.splits) {
            table.insert(name.clone(), split);
        }
    }
}

/// Megatron's `ColumnParallelLinear`: each shard holds its rows of the weight `[out, in]` and
/// of the bias, and computes its slice of the outputs from the whole input (f before it, or
/// an all-gather of the sequence). `packed` blocks stacked along the outputs (the packed Q/K/V
/// projection `[q; k; v]`) are each cut by rows, so a shard holds the same heads of all three.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    pub weight: Tensor,
    pub bias: Tensor,
    names: [String; 2],
    split: Split,
}

impl ColumnParallelLinear {
    /// `vs / "weight"` and `vs / "bias"` of `shard` of an `[out, in]` layer, as `nn::linear`
    /// draws them (bias None: torch's default).
    pub fn new(vs: &nn::Path, whole: [i64; 2], shard: Shard, weight_init: Init, bias_init: Option<Init>) -> ColumnParallelLinear {
        let LinearVariables { weight, bias, names, .. } = LinearVariables::linear(vs, whole, [Split::Rows; 2], shard, weight_init, bias_init);
        ColumnParallelLinear { weight, bias, names, split: Split::Rows }
    }

    /// The packed projection `vs / "<prefix>_weight"`, `vs / "<prefix>_bias"` (torch's
    /// `in_proj_weight` and `in_proj_bias`, drawn weight first) of `parts` blocks of `[out, in]`
    /// each.
    pub fn packed(vs: &nn::Path, prefix: &str, parts: i64, [out, input]: [i64; 2], shard: Shard, init: [Init; 2]) -> ColumnParallelLinear {
        let split = Split::PackedRows(parts);
        let (weight, weight_name) = variable(vs, &format!("{prefix}_weight"), &[parts * out, input], split, shard, init[0]);
        let (bias, bias_name) = variable(vs, &format!("{prefix}_bias"), &[parts * out], split, shard, init[1]);
        ColumnParallelLinear { weight, bias, names: [weight_name, bias_name], split }
    }

    /// `xs · weightᵀ + bias` of this shard's rows of the weight, for the whole sequence.
    /// Unsharded: the one fused `linear`, as torch.
    pub fn forward(&self, xs: &Tensor, talk: Talk) -> Result<Tensor> {
        match talk {
            Talk::Alone => Ok(xs.linear(&self.weight, Some(&self.bias))),
            Talk::Tensor(group) => Ok(tp::copy_to_shards(xs, group)?.linear(&self.weight, Some(&self.bias))),
            Talk::Sequence(group) => tp::gathered_linear(xs, &self.weight, Some(&self.bias), group),
        }
    }
}

impl ReportSplits for ColumnParallelLinear {
    fn report_splits(&self, table: &mut SplitTable) {
        for name in &self.names {
            table.insert(name.clone(), self.split);
        }
    }
}

/// Megatron's `RowParallelLinear`: each shard holds its columns of the weight `[out, in]`,
/// multiplies its slice of the inputs and sums the partial products with the others' (g, or a
/// reduce-scatter into rows of the sequence); the bias, added after the sum, every shard holds
/// whole.
#[derive(Debug)]
pub struct RowParallelLinear {
    variables: LinearVariables,
}

impl std::fmt::Debug for LinearVariables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinearVariables").field("names", &self.names).field("splits", &self.splits).finish()
    }
}

impl RowParallelLinear {
    /// `vs / "weight"` and `vs / "bias"` of `shard` of an `[out, in]` layer, as `nn::linear`
    /// draws them (bias None: torch's default).
    pub fn new(vs: &nn::Path, whole: [i64; 2], shard: Shard, weight_init: Init, bias_init: Option<Init>) -> RowParallelLinear {
        RowParallelLinear { variables: LinearVariables::linear(vs, whole, [Split::Columns, Split::Replicated], shard, weight_init, bias_init) }
    }

    pub fn weight(&self) -> &Tensor {
        &self.variables.weight
    }

    /// The bias every shard holds whole (for [`Talk::whole`]).
    pub fn bias(&self) -> &Tensor {
        &self.variables.bias
    }

    /// `xs · weightᵀ` summed over the shards, or this shard's rows of that sum, then `bias`:
    /// this layer's bias as [`Talk::whole`] gave it.
    pub fn forward(&self, xs: &Tensor, talk: Talk, bias: &Tensor) -> Result<Tensor> {
        let weight = &self.variables.weight;
        match talk {
            Talk::Alone => Ok(xs.linear(weight, Some(bias))),
            Talk::Tensor(group) => Ok(tp::reduce_from_shards(&xs.linear(weight, None::<&Tensor>), group)? + bias),
            Talk::Sequence(group) => Ok(tp::scatter_sequence(&xs.linear(weight, None::<&Tensor>), group)? + bias),
        }
    }
}

impl ReportSplits for RowParallelLinear {
    fn report_splits(&self, table: &mut SplitTable) {
        self.variables.report(table);
    }
}

/// Megatron's `VocabParallelEmbedding`: `vs / "weight"`, each shard holding the rows of its
/// words (`shard.range` of the vocabulary). A word another shard holds looks up zeros here, and
/// g sums the shards' rows (or a reduce-scatter gives each shard its rows of the sequence).
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    pub weight: Tensor,
    name: String,
    shard: Shard,
    ntoken: i64,
}

impl VocabParallelEmbedding {
    pub fn new(vs: &nn::Path, [ntoken, width]: [i64; 2], shard: Shard, init: Init) -> VocabParallelEmbedding {
        let (weight, name) = variable(vs, "weight", &[ntoken, width], Split::Rows, shard, init);
        VocabParallelEmbedding { weight, name, shard, ntoken }
    }

    /// The rows of token ids `src`, whole (summed over the shards) or, with sequence
    /// parallelism, this shard's rows of the sequence.
    pub fn forward(&self, src: &Tensor, talk: Talk) -> Result<Tensor> {
        let lookup = |ids: &Tensor| Tensor::embedding(&self.weight, ids, -1, false, false);
        let group = match talk {
            Talk::Alone => return Ok(lookup(src)),
            Talk::Tensor(group) | Talk::Sequence(group) => group,
        };
        let (start, len) = self.shard.range(self.ntoken);
        let local = src - start;
        let outside = local.lt(0).logical_or(&local.ge(len));
        let rows = lookup(&local.masked_fill(&outside, 0)).masked_fill(&outside.unsqueeze(-1), 0.0);
        match talk {
            Talk::Sequence(_) => tp::scatter_sequence(&rows, group),
            _ => tp::reduce_from_shards(&rows, group),
        }
    }
}

impl ReportSplits for VocabParallelEmbedding {
    fn report_splits(&self, table: &mut SplitTable) {
        table.insert(self.name.clone(), Split::Rows);
    }
}

/// A layer norm over the last dimension (`nn.LayerNorm(width, eps)`, weight 1 and bias 0),
/// every shard holding it whole.
#[derive(Debug)]
pub struct ReplicatedLayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    names: [String; 2],
    eps: f64,
}

impl ReplicatedLayerNorm {
    pub fn new(vs: &nn::Path, width: i64, eps: f64) -> ReplicatedLayerNorm {
        let whole = |name: &str, init| variable(vs, name, &[width], Split::Replicated, Shard::WHOLE, init);
        let (weight, weight_name) = whole("weight", Init::Const(1.));
        let (bias, bias_name) = whole("bias", Init::Const(0.));
        ReplicatedLayerNorm { weight, bias, names: [weight_name, bias_name], eps }
    }

    /// The norm of `xs` with `weight` and `bias`: this layer's as [`Talk::whole`] gave them.
    pub fn forward(&self, xs: &Tensor, weight: &Tensor, bias: &Tensor) -> Tensor {
        xs.layer_norm([*xs.size().last().expect("a width")], Some(weight), Some(bias), self.eps, true)
    }
}

impl ReportSplits for ReplicatedLayerNorm {
    fn report_splits(&self, table: &mut SplitTable) {
        for name in &self.names {
            table.insert(name.clone(), Split::Replicated);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Every layer's variables are made in the shape its reported cut gives a shard of the
    /// whole, under the names the var store holds them by.
    #[test]
    fn each_layer_reports_the_cut_its_variables_were_made_in() {
        for count in [1, 2, 4] {
            for index in 0..count {
                let shard = Shard { index, count };
                let vs = nn::VarStore::new(Device::Cpu);
                let root = vs.root();
                let init = Init::Const(0.);
                let layers: Vec<Box<dyn ReportSplits>> = vec![
                    Box::new(ColumnParallelLinear::new(&(&root / "up"), [8, 4], shard, init, None)),
                    Box::new(ColumnParallelLinear::packed(&(&root / "attn"), "in_proj", 3, [4, 4], shard, [init, init])),
                    Box::new(RowParallelLinear::new(&(&root / "down"), [4, 8], shard, init, None)),
                    Box::new(VocabParallelEmbedding::new(&(&root / "embedding"), [12, 4], shard, init)),
                    Box::new(ReplicatedLayerNorm::new(&(&root / "norm"), 4, 1e-5)),
                ];
                let mut table = SplitTable::default();
                layers.iter().for_each(|layer| layer.report_splits(&mut table));
                let whole: [(&str, &[i64], Split); 9] = [
                    ("up.weight", &[8, 4], Split::Rows),
                    ("up.bias", &[8], Split::Rows),
                    ("attn.in_proj_weight", &[12, 4], Split::PackedRows(3)),
                    ("attn.in_proj_bias", &[12], Split::PackedRows(3)),
                    ("down.weight", &[4, 8], Split::Columns),
                    ("down.bias", &[4], Split::Replicated),
                    ("embedding.weight", &[12, 4], Split::Rows),
                    ("norm.weight", &[4], Split::Replicated),
                    ("norm.bias", &[4], Split::Replicated),
                ];
                let variables = vs.variables();
                assert_eq!(table.iter().count(), whole.len());
                assert_eq!(variables.len(), whole.len());
                for (name, shape, split) in whole {
                    assert_eq!(table.split(name, shape.len()).unwrap(), split, "{name}");
                    let full = Tensor::zeros(shape, (Kind::Float, Device::Cpu));
                    assert_eq!(variables[name].size(), tp::shard_tensor(&full, split, shard).size(), "{name} of {shard:?}");
                }
            }
        }
    }

    #[test]
    fn optimizer_state_is_cut_as_its_variable_counts_stay_whole_and_unknown_names_are_errors() {
        let mut table = SplitTable::default();
        table.insert("linear1.bias".into(), Split::Rows);
        table.insert("linear.weight".into(), Split::Rows);
        assert_eq!(table.split("exp_avg.linear1.bias", 1).unwrap(), Split::Rows);
        assert_eq!(table.split("momentum_buffer.linear.weight", 2).unwrap(), Split::Rows);
        assert_eq!(table.split("step.linear.weight", 0).unwrap(), Split::Replicated);
        for name in ["decoder.weight", "exp_avg.decoder.weight", "linear1.weight"] {
            let err = table.split(name, 2).unwrap_err().to_string();
            assert!(err.contains(&format!("`{name}` is not a variable of this model's tensor-parallel layers")), "{err}");
        }
        let err = SplitTable::uncut().split("fc1.weight", 2).unwrap_err().to_string();
        assert!(err.contains("`fc1.weight`: this model is not cut into tensor-parallel shards"), "{err}");
        assert_eq!(SplitTable::uncut().split("step", 0).unwrap(), Split::Replicated);
    }

    #[test]
    #[should_panic(expected = "two layers report the variable `up.weight`")]
    fn a_name_reported_twice_is_a_model_bug() {
        let mut table = SplitTable::default();
        table.insert("up.weight".into(), Split::Rows);
        table.insert("up.weight".into(), Split::Columns);
    }

    /// A whole layer is torch's: the fused `linear`, `embedding` and `layer_norm`.
    #[test]
    fn whole_layers_compute_what_torch_does() {
        let vs = nn::VarStore::new(Device::Cpu);
        let uniform = Init::Uniform { lo: -1.0, up: 1.0 };
        let column = ColumnParallelLinear::new(&(vs.root() / "a"), [6, 4], Shard::WHOLE, uniform, Some(uniform));
        let row = RowParallelLinear::new(&(vs.root() / "b"), [4, 6], Shard::WHOLE, uniform, Some(uniform));
        let embedding = VocabParallelEmbedding::new(&(vs.root() / "e"), [10, 4], Shard::WHOLE, uniform);
        let norm = ReplicatedLayerNorm::new(&(vs.root() / "n"), 4, 1e-5);
        let xs = Tensor::randn([3, 2, 4], (Kind::Float, Device::Cpu));
        let hidden = column.forward(&xs, Talk::Alone).unwrap();
        assert!(hidden.equal(&xs.linear(&column.weight, Some(&column.bias))));
        assert!(row.forward(&hidden, Talk::Alone, row.bias()).unwrap().equal(&hidden.linear(row.weight(), Some(row.bias()))));
        let ids = Tensor::from_slice(&[3i64, 9, 0]).view([3, 1]);
        assert!(embedding.forward(&ids, Talk::Alone).unwrap().equal(&embedding.weight.index_select(0, &ids.view([-1])).view([3, 1, 4])));
        let normed = norm.forward(&xs, &norm.weight, &norm.bias);
        assert!(normed.equal(&xs.layer_norm([4], Some(&norm.weight), Some(&norm.bias), 1e-5, true)));
    }
}
