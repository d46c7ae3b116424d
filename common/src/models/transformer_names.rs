//! The Transformer language model's variables by name (torch's `state_dict` keys): the one
//! module that reads a name, a mapping from torch's names to where each variable lives (the
//! embedding, encoder layer i, the output layer: pipeline stages, ZeRO-3's parts) and which
//! layer's copy stands for it. How tensor parallelism cuts a variable is not here: the layer
//! that makes it reports it (`models::parallel_layers`). A name it does not know is an error
//! naming it: renaming a variable in the model without renaming it here fails every
//! partitioned run and checkpoint at once (and the test below), instead of placing one tensor
//! wrongly.
use std::fmt;

use anyhow::Result;

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

/// Every tensor of an encoder layer, by its name inside the layer (torch's
/// `TransformerEncoderLayer`).
const LAYER_TENSORS: [&str; 12] = [
    "self_attn.in_proj_weight",
    "self_attn.in_proj_bias",
    "self_attn.out_proj.weight",
    "self_attn.out_proj.bias",
    "linear1.weight",
    "linear1.bias",
    "linear2.weight",
    "linear2.bias",
    "norm1.weight",
    "norm1.bias",
    "norm2.weight",
    "norm2.bias",
];

/// The embedding's and the output layer's tensors.
const END_TENSORS: [(Place, &str); 3] = [(Place::Embedding, "embedding.weight"), (Place::Output, "linear.weight"), (Place::Output, "linear.bias")];

/// One variable of the model, parsed from its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransformerVariable<'a> {
    pub place: Place,
    /// The name inside the layer for a layer's tensor (`linear1.weight`), else the whole name.
    tensor: &'a str,
}

impl<'a> TransformerVariable<'a> {
    pub fn parse(name: &'a str) -> Result<TransformerVariable<'a>, UnknownVariable> {
        let unknown = || UnknownVariable(name.to_string());
        if let Some(&(place, tensor)) = END_TENSORS.iter().find(|(_, tensor)| *tensor == name) {
            return Ok(TransformerVariable { place, tensor });
        }
        let prefix = format!("{}.{}.", LAYERS[0], LAYERS[1]);
        let (index, tensor) = name.strip_prefix(&prefix).and_then(|rest| rest.split_once('.')).ok_or_else(unknown)?;
        let layer: i64 = index.parse().ok().filter(|i| *i >= 0).ok_or_else(unknown)?;
        let tensor = LAYER_TENSORS.iter().find(|known| **known == tensor).ok_or_else(unknown)?;
        Ok(TransformerVariable { place: Place::Layer(layer), tensor })
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

    /// The cuts live in the layers; this checks that what the model's layers report is
    /// Megatron's, for every variable the var store holds and no other.
    #[test]
    fn the_models_layers_report_megatrons_cut_for_every_variable() {
        use crate::comm::tensor_parallel::{Shard, Split, TensorShards};
        use crate::models::{PartSpan, TransformerPart};
        let cfg = TransformerConfig { ntoken: 12, d_model: 8, nhead: 2, d_hid: 16, nlayers: 2, dropout: 0.0 };
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let shard = Shard { index: 1, count: 2 };
        let part = TransformerPart::new(&vs.root(), &cfg, PartSpan::whole(cfg.nlayers), shard, &mut |_| {}).unwrap();
        let splits = part.splits();
        let reported: Vec<&str> = splits.iter().map(|(name, _)| name).collect();
        let mut held: Vec<String> = vs.variables().into_keys().collect();
        held.sort();
        assert_eq!(reported, held);
        let split = |name: &str| splits.split(name, 2).unwrap();
        assert_eq!(split("transformer_encoder.layers.1.self_attn.in_proj_weight"), Split::PackedRows(3));
        assert_eq!(split("transformer_encoder.layers.0.self_attn.in_proj_bias"), Split::PackedRows(3));
        assert_eq!(split("transformer_encoder.layers.0.self_attn.out_proj.weight"), Split::Columns);
        assert_eq!(split("transformer_encoder.layers.0.self_attn.out_proj.bias"), Split::Replicated);
        assert_eq!(split("transformer_encoder.layers.0.linear1.weight"), Split::Rows);
        assert_eq!(split("transformer_encoder.layers.0.linear1.bias"), Split::Rows);
        assert_eq!(split("transformer_encoder.layers.0.linear2.weight"), Split::Columns);
        assert_eq!(split("transformer_encoder.layers.0.linear2.bias"), Split::Replicated);
        assert_eq!(
            (split("transformer_encoder.layers.1.norm1.weight"), split("transformer_encoder.layers.1.norm2.bias")),
            (Split::Replicated, Split::Replicated)
        );
        assert_eq!((split("embedding.weight"), split("linear.weight"), split("linear.bias")), (Split::Rows, Split::Rows, Split::Rows));
        // Optimizer state is cut as its variable through the same report; a count stays whole.
        let world = crate::comm::ProcessGroup::single();
        let shards = TensorShards { group: &world, shard, splits: std::sync::Arc::new(splits) };
        let (step, exp_avg) = (tch::Tensor::from(3i64), tch::Tensor::arange(12, (tch::Kind::Float, tch::Device::Cpu)));
        assert_eq!(shards.shard_of("step.linear.bias", &step).unwrap().int64_value(&[]), 3);
        assert_eq!(Vec::<f32>::try_from(shards.shard_of("exp_avg.linear.bias", &exp_avg).unwrap()).unwrap(), (6..12).map(|i| i as f32).collect::<Vec<_>>());
        assert!(shards.shard_of("exp_avg.decoder.bias", &exp_avg).is_err());
    }

    #[test]
    fn an_unknown_name_is_an_error_that_names_it() {
        for name in [
            "linear1.weight",
            "transformer_encoder.layers.x.linear1.weight",
            "transformer_encoder.layers.0.linear3.weight",
            "decoder.weight",
            "exp_avg.decoder.weight",
        ] {
            let err = TransformerVariable::parse(name).unwrap_err();
            assert_eq!(err.0, name);
            assert!(err.to_string().contains(&format!("`{name}` is not a variable of the Transformer")), "{err}");
        }
    }
}
