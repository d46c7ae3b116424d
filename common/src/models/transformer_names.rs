//! The Transformer language model's variables by name (torch's `state_dict` keys): the one
//! module that reads a name. Everything that must know where a variable lives (the embedding,
//! encoder layer i, the output layer: pipeline stages, ZeRO-3's parts), how tensor parallelism
//! cuts it, or which layer's copy stands for it, asks [`TransformerVariable::parse`]; the
//! layers' constructors make a shard's variables in the shape [`shard_shape`] gives, so that
//! how each variable is cut is written here only. A name it
//! does not know is an error naming it, never a silent "replicated": renaming a variable in the
//! model without renaming it here fails every sharded run and checkpoint at once (and the test
//! below), instead of cutting one tensor wrongly.
use std::fmt;

use anyhow::Result;

use crate::comm::tensor_parallel::Split;

/// The embedding's path under the model's root (`embedding.weight`).
pub const EMBEDDING: &str = "embedding";
/// The output layer's path (`linear.weight`, `linear.bias`).
pub const OUTPUT: &str = "linear";
/// The encoder layers' path: `transformer_encoder.layers.<i>.<tensor>`.
pub const LAYERS: [&str; 2] = ["transformer_encoder", "layers"];

/// The output layer's weight, which `OutputInit::Scaled` redraws.
pub const OUTPUT_WEIGHT: &str = "linear.weight";

/// Where a variable lives, in the order a forward pass reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Embedding,
    /// Encoder layer `i` (0-based, over the whole model).
    Layer(i64),
    Output,
}

/// Every tensor of an encoder layer, by its name inside the layer, with its tensor-parallel
/// cut (Megatron's: Q/K/V and linear1 column-parallel, out_proj and linear2 row-parallel, so
/// one all-reduce per block; the biases added after that sum and the norms replicated).
const LAYER_TENSORS: [(&str, Split); 12] = [
    ("self_attn.in_proj_weight", Split::PackedRows(3)),
    ("self_attn.in_proj_bias", Split::PackedRows(3)),
    ("self_attn.out_proj.weight", Split::Columns),
    ("self_attn.out_proj.bias", Split::Replicated),
    ("linear1.weight", Split::Rows),
    ("linear1.bias", Split::Rows),
    ("linear2.weight", Split::Columns),
    ("linear2.bias", Split::Replicated),
    ("norm1.weight", Split::Replicated),
    ("norm1.bias", Split::Replicated),
    ("norm2.weight", Split::Replicated),
    ("norm2.bias", Split::Replicated),
];

/// The embedding's and the output layer's tensors: all cut by rows (the vocabulary's words).
const END_TENSORS: [(Place, &str); 3] = [(Place::Embedding, "embedding.weight"), (Place::Output, "linear.weight"), (Place::Output, "linear.bias")];

/// One variable of the model, parsed from its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransformerVariable<'a> {
    pub place: Place,
    /// The name inside the layer for a layer's tensor (`linear1.weight`), else the whole name.
    tensor: &'a str,
    split: Split,
}

impl<'a> TransformerVariable<'a> {
    pub fn parse(name: &'a str) -> Result<TransformerVariable<'a>, UnknownVariable> {
        let unknown = || UnknownVariable(name.to_string());
        if let Some(&(place, tensor)) = END_TENSORS.iter().find(|(_, tensor)| *tensor == name) {
            return Ok(TransformerVariable { place, tensor, split: Split::Rows });
        }
        let prefix = format!("{}.{}.", LAYERS[0], LAYERS[1]);
        let (index, tensor) = name.strip_prefix(&prefix).and_then(|rest| rest.split_once('.')).ok_or_else(unknown)?;
        let layer: i64 = index.parse().ok().filter(|i| *i >= 0).ok_or_else(unknown)?;
        let &(_, split) = LAYER_TENSORS.iter().find(|(known, _)| *known == tensor).ok_or_else(unknown)?;
        Ok(TransformerVariable { place: Place::Layer(layer), tensor, split })
    }

    /// How tensor parallelism cuts it.
    pub fn split(&self) -> Split {
        self.split
    }

    /// The same tensor's name in encoder layer `layer` (all layers start from the same
    /// weights, so one layer's starting value stands for every layer's); the embedding's and
    /// output layer's names stay as they are.
    pub fn in_layer(&self, layer: i64) -> String {
        match self.place {
            Place::Layer(_) => format!("{}.{}.{layer}.{}", LAYERS[0], LAYERS[1], self.tensor),
            Place::Embedding | Place::Output => self.tensor.to_string(),
        }
    }
}

/// The shape of `shard`'s part of `tensor`, a tensor of the `whole` shape: `tensor` is an
/// encoder layer's tensor by its name in the layer (`linear1.weight`) or an end's
/// (`embedding.weight`, `linear.bias`). The layers' constructors make their variables in it, so
/// that how a variable is cut is said here alone.
///
/// # Panics
/// On a name the table does not know: a constructor and this table disagree.
pub fn shard_shape(tensor: &str, whole: &[i64], shard: crate::comm::tensor_parallel::Shard) -> Vec<i64> {
    let split = END_TENSORS
        .iter()
        .find(|(_, name)| *name == tensor)
        .map(|_| Split::Rows)
        .or_else(|| LAYER_TENSORS.iter().find(|(name, _)| *name == tensor).map(|&(_, split)| split))
        .unwrap_or_else(|| panic!("`{tensor}` is in neither the layers' nor the ends' table of transformer_names"));
    split.shard_shape(whole, shard)
}

/// How tensor parallelism cuts the tensor `name`: a variable, or an optimizer-state entry
/// `<entry>.<variable>` (cut as its variable). A scalar (a step count) is whole everywhere.
pub fn split_of_named(name: &str, dims: usize) -> Result<Split, UnknownVariable> {
    if dims == 0 {
        return Ok(Split::Replicated);
    }
    match TransformerVariable::parse(name) {
        Ok(variable) => Ok(variable.split()),
        // `exp_avg.linear.weight`: the state of `linear.weight`.
        Err(err) => name.split_once('.').map_or(Err(err.clone()), |(_, variable)| TransformerVariable::parse(variable).map(|v| v.split()).map_err(|_| err)),
    }
}

/// [`split_of_named`] as the Transformer's [`crate::comm::tensor_parallel::SplitOf`]: the
/// table its tensor-parallel steps hand to the checkpoints.
pub fn split_of(name: &str, dims: usize) -> Result<Split> {
    Ok(split_of_named(name, dims)?)
}

/// A name that is not one of the Transformer's variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownVariable(pub String);

impl fmt::Display for UnknownVariable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` is not a variable of the Transformer language model (embedding.weight, transformer_encoder.layers.<i>.<tensor>, linear.weight, linear.bias)",
            self.0
        )
    }
}

impl std::error::Error for UnknownVariable {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{TransformerConfig, TransformerLm};

    #[test]
    fn every_variable_the_model_builds_parses_and_each_end_sits_where_it_runs() {
        let cfg = TransformerConfig { ntoken: 12, d_model: 8, nhead: 2, d_hid: 16, nlayers: 3, dropout: 0.0 };
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        TransformerLm::new(&vs.root(), &cfg).unwrap();
        let variables = vs.variables();
        assert_eq!(variables.len(), 3 + 12 * 3, "{:?}", variables.keys());
        for name in variables.keys() {
            let variable = TransformerVariable::parse(name).unwrap_or_else(|err| panic!("{err}"));
            assert_eq!(&variable.in_layer(0), &name.replace(".1.", ".0.").replace(".2.", ".0."));
        }
        let place = |name: &str| TransformerVariable::parse(name).unwrap().place;
        assert_eq!(place("embedding.weight"), Place::Embedding);
        assert_eq!(place("transformer_encoder.layers.2.norm1.bias"), Place::Layer(2));
        assert_eq!((place("linear.weight"), place(OUTPUT_WEIGHT)), (Place::Output, Place::Output));
    }

    #[test]
    fn megatrons_cuts() {
        let split = |name: &str| TransformerVariable::parse(name).unwrap().split();
        assert_eq!(split("transformer_encoder.layers.3.self_attn.in_proj_weight"), Split::PackedRows(3));
        assert_eq!(split("transformer_encoder.layers.0.self_attn.out_proj.weight"), Split::Columns);
        assert_eq!(split("transformer_encoder.layers.0.self_attn.out_proj.bias"), Split::Replicated);
        assert_eq!(split("transformer_encoder.layers.0.linear1.bias"), Split::Rows);
        assert_eq!(split("transformer_encoder.layers.0.linear2.bias"), Split::Replicated);
        assert_eq!(split("transformer_encoder.layers.0.norm2.weight"), Split::Replicated);
        assert_eq!((split("embedding.weight"), split("linear.weight"), split("linear.bias")), (Split::Rows, Split::Rows, Split::Rows));
    }

    #[test]
    fn optimizer_state_is_cut_as_its_variable_and_counts_stay_whole() {
        assert_eq!(split_of_named("exp_avg.transformer_encoder.layers.0.linear1.bias", 1), Ok(Split::Rows));
        assert_eq!(split_of_named("momentum_buffer.linear.weight", 2), Ok(Split::Rows));
        assert_eq!(split_of_named("step.linear.weight", 0), Ok(Split::Replicated));
    }

    #[test]
    fn a_shard_of_named_state_is_its_variables_rows_and_a_count_stays_whole() {
        let world = crate::comm::ProcessGroup::single();
        let shards = crate::comm::tensor_parallel::TensorShards { group: &world, shard: crate::comm::tensor_parallel::Shard { index: 1, count: 2 }, split_of };
        let (step, exp_avg) = (tch::Tensor::from(3i64), tch::Tensor::arange(4, (tch::Kind::Float, tch::Device::Cpu)));
        assert_eq!(shards.shard_of("step.linear.bias", &step).unwrap().int64_value(&[]), 3);
        assert_eq!(Vec::<f32>::try_from(shards.shard_of("exp_avg.linear.bias", &exp_avg).unwrap()).unwrap(), vec![2.0, 3.0]);
        assert!(shards.shard_of("exp_avg.decoder.bias", &exp_avg).is_err());
    }

    #[test]
    fn an_unknown_name_is_an_error_that_names_it_not_a_replicated_tensor() {
        for name in [
            "linear1.weight",
            "transformer_encoder.layers.x.linear1.weight",
            "transformer_encoder.layers.0.linear3.weight",
            "decoder.weight",
            "exp_avg.decoder.weight",
        ] {
            let err = split_of_named(name, 2).unwrap_err();
            assert_eq!(err.0, name);
            assert!(err.to_string().contains(&format!("`{name}` is not a variable of the Transformer")), "{err}");
        }
    }
}
