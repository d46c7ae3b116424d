//! One pipeline stage: a consecutive piece of the Transformer language model with its own
//! variables on its own device.
use std::ops::Range;

use anyhow::{Context, Result};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

use super::executor::PipelineStage;
use super::LayerCosts;
use crate::comm::tensor_parallel::{self as tp, Shard, SplitTable};
use crate::comm::ProcessGroup;
use crate::error::UsageError;
use crate::models::transformer_names::TransformerVariable;
use crate::models::{self, Masks, PartSpan, TransformerConfig, TransformerPart};

/// Stage `index` of a pipeline: the piece of the Transformer language model
/// ([`TransformerPart`]: the token embedding on the first stage, encoder layers `layer_range`,
/// the output layer on the last) with its own variables on its own device. Its variables carry
/// the names they have in the whole model ([`crate::models::TransformerLm`]), so the stages'
/// variables together are exactly the unpartitioned model's state dict. With tensor
/// parallelism the stage is one shard of those layers (Megatron's: vocabulary-parallel
/// embedding and output layer, column- and row-parallel layers), the variables under the same
/// names with the shard's shapes.
pub struct Stage {
    pub index: usize,
    pub vs: nn::VarStore,
    part: TransformerPart,
    ntoken: i64,
}

impl Stage {
    /// Builds stage `index` of `stages` on `device`. The initialisation draws from LibTorch's
    /// generator seeded with `seed` per part (embedding, layers, output layer), so that the
    /// layers of all stages start from the same weights, as `nn.TransformerEncoder`'s do.
    pub fn new(cfg: &TransformerConfig, index: usize, stages: usize, layer_range: Range<i64>, device: Device, seed: u64) -> Result<Stage, UsageError> {
        Self::build(cfg, index, stages, layer_range, device, seed, Shard::WHOLE)
    }

    /// Tensor-parallel `shard` of stage `index`: the whole stage's starting values (those of
    /// [`Stage::new`], drawn on the CPU from the same seeds), cut as Megatron cuts them, so that
    /// every number of shards starts from the same model. Only one whole layer is drawn: all
    /// layers start equal.
    pub fn new_sharded(
        cfg: &TransformerConfig,
        index: usize,
        stages: usize,
        layer_range: Range<i64>,
        device: Device,
        seed: u64,
        shard: Shard,
    ) -> Result<Stage, UsageError> {
        cfg.validate_shards(shard.count)?;
        if shard.is_whole() {
            return Self::new(cfg, index, stages, layer_range, device, seed);
        }
        let first = layer_range.start..(layer_range.start + 1).min(layer_range.end);
        let whole = Self::build(cfg, index, stages, first.clone(), Device::Cpu, seed, Shard::WHOLE)?.vs.variables();
        let stage = Self::build(cfg, index, stages, layer_range, device, seed, shard)?;
        let splits = stage.splits();
        tch::no_grad(|| {
            for (name, mut var) in stage.vs.variables() {
                // The stage's own names (a test proves the model's all parse), cut as their
                // layers report. A layer's starting value is the first layer's: all layers
                // start equal.
                let source = TransformerVariable::parse(&name).unwrap_or_else(|err| panic!("{err}")).in_layer(first.start);
                let full = whole.get(&source).unwrap_or_else(|| panic!("the whole stage has `{source}`"));
                let split = splits.split(&name, var.dim()).unwrap_or_else(|err| panic!("{err:#}"));
                var.copy_(&tp::shard_tensor(full, split, shard));
            }
        });
        Ok(stage)
    }

    fn build(
        cfg: &TransformerConfig,
        index: usize,
        stages: usize,
        layer_range: Range<i64>,
        device: Device,
        seed: u64,
        shard: Shard,
    ) -> Result<Stage, UsageError> {
        let vs = nn::VarStore::new(device);
        let span = PartSpan { embedding: index == 0, layers: layer_range, head: index + 1 == stages };
        let part = TransformerPart::new(&vs.root(), cfg, span, shard, &mut |piece| {
            tch::manual_seed(seed.wrapping_add(piece) as i64);
        })?;
        Ok(Stage { index, vs, part, ntoken: cfg.ntoken })
    }

    /// This stage with sequence parallelism ([`TransformerPart::sequence_parallel`]).
    pub fn sequence_parallel(self) -> Result<Stage, UsageError> {
        Ok(Stage { part: self.part.sequence_parallel()?, ..self })
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// How tensor parallelism cuts each of the stage's variables, as its layers report.
    pub fn splits(&self) -> SplitTable {
        self.part.splits()
    }

    /// The stage's piece of the model.
    pub fn part(&self) -> &TransformerPart {
        &self.part
    }

    /// This rank's tensor-parallel shard of every layer ([`Shard::WHOLE`] without).
    pub fn shard(&self) -> Shard {
        self.part.shard()
    }

    pub fn is_first(&self) -> bool {
        self.part.has_embedding()
    }

    pub fn is_last(&self) -> bool {
        self.part.has_head()
    }

    /// Stage 0: token ids `[seq_len, batch]` → hidden states; other stages: hidden states →
    /// hidden states, or logits `[seq_len, batch, ntoken]` on the last stage.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.forward_masked(xs, train, Masks::Shared, None).unwrap_or_else(|err| panic!("{err:#}"))
    }

    /// [`Stage::forward_t`] with the dropout masks drawn as `masks` says
    /// ([`TransformerPart::forward_masked`]); a tensor-parallel shard talks to the other shards
    /// over `tp` (its logits are then its words' slice).
    pub fn forward_masked(&self, xs: &Tensor, train: bool, masks: Masks, tp: Option<&ProcessGroup>) -> anyhow::Result<Tensor> {
        self.part.forward_masked(xs, train, masks, tp)
    }

    /// The last stage's mean cross-entropy of its `logits` against `targets`, and, when asked,
    /// its arg-max hits ([`TransformerPart::loss_and_hits`]).
    pub fn loss_and_hits(&self, logits: &Tensor, targets: &Tensor, tp: Option<&ProcessGroup>, count_hits: bool) -> anyhow::Result<(Tensor, Option<Tensor>)> {
        self.part.loss_and_hits(logits, targets, tp, count_hits)
    }

    /// The vocabulary size of the whole model.
    pub fn ntoken(&self) -> i64 {
        self.ntoken
    }

    /// The stage's trainable variables with their whole-model names, sorted by name.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        models::named_parameters(&self.vs)
    }

    /// Bytes of the stage's parameters (what a device must hold before any activation).
    pub fn parameter_bytes(&self) -> usize {
        self.vs.trainable_variables().iter().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
    }

    /// Overwrites the stage's variables with the same-named ones of `whole` (an unpartitioned
    /// model's var store, e.g. to start a pipeline from exercise1_nlp weights); a
    /// tensor-parallel shard takes its part of each.
    pub fn copy_from(&self, whole: &nn::VarStore) -> Result<()> {
        let (source, splits) = (whole.variables(), self.splits());
        tch::no_grad(|| {
            for (name, mut var) in self.vs.variables() {
                let value = source.get(&name).with_context(|| format!("the whole model has no variable `{name}`"))?;
                let value = tp::shard_tensor(value, splits.split(&name, var.dim())?, self.shard());
                anyhow::ensure!(value.size() == var.size(), "`{name}`: shape {:?} in the whole model, {:?} in stage {}", value.size(), var.size(), self.index);
                var.copy_(&value);
            }
            Ok(())
        })
    }

    /// Mean cross-entropy of `logits` `[seq_len, batch, ntoken]` against `targets`
    /// `[seq_len, batch]` ([`models::language_model_loss`]).
    pub fn loss(logits: &Tensor, targets: &Tensor) -> Tensor {
        models::language_model_loss(logits, targets)
    }

    /// Measures the forward + backward time of the model's pieces on `device` for one
    /// micro-batch of `micro_batch` sequences of `seq_len` tokens (median of 3 after a warm-up),
    /// on a probe with one layer: what `--balance` partitions by. The encoder layers are all
    /// alike, so one is timed for all.
    pub fn measure_costs(cfg: &TransformerConfig, device: Device, seq_len: i64, micro_batch: i64) -> LayerCosts {
        let probe = Stage::new(&TransformerConfig { nlayers: 1, ..*cfg }, 0, 1, 0..1, device, 0).expect("a valid configuration has a valid one-layer probe");
        let tokens = Tensor::randint(cfg.ntoken, [seq_len, micro_batch], (Kind::Int64, device));
        let hidden = Tensor::randn([seq_len, micro_batch, cfg.d_model], (Kind::Float, device));
        let part = &probe.part;
        let run = |result: anyhow::Result<Tensor>| result.unwrap_or_else(|err| panic!("{err:#}"));
        let embedding = median_time(device, || run(part.embed(&tokens, true, Masks::Shared, None)).sum(Kind::Float).backward());
        let (_, layer) = part.layers().next().expect("the probe has a layer");
        let layer = median_time(device, || {
            let input = hidden.detach().set_requires_grad(true);
            layer.forward_t(&input, true).sum(Kind::Float).backward()
        });
        let head = median_time(device, || Stage::loss(&run(part.decode(&hidden, None)), &tokens).backward());
        LayerCosts { embedding, layers: vec![layer; cfg.nlayers as usize], head }
    }
}

impl PipelineStage for Stage {
    fn index(&self) -> usize {
        self.index
    }

    fn device(&self) -> Device {
        Stage::device(self)
    }

    fn is_first(&self) -> bool {
        Stage::is_first(self)
    }

    fn is_last(&self) -> bool {
        Stage::is_last(self)
    }

    fn forward_masked(&self, input: &Tensor, train: bool, masks: Masks, tp: Option<&ProcessGroup>) -> Result<Tensor> {
        Stage::forward_masked(self, input, train, masks, tp)
    }

    fn loss_and_hits(&self, output: &Tensor, targets: &Tensor, tp: Option<&ProcessGroup>, count_hits: bool) -> Result<(Tensor, Option<Tensor>)> {
        Stage::loss_and_hits(self, output, targets, tp, count_hits)
    }
}

/// Median seconds of 3 runs of `work` after one warm-up run, waiting for the device.
fn median_time(device: Device, mut work: impl FnMut()) -> f64 {
    let mut run = || {
        let start = std::time::Instant::now();
        work();
        crate::device::synchronize(device);
        start.elapsed().as_secs_f64()
    };
    run();
    let mut times = [run(), run(), run()];
    times.sort_by(f64::total_cmp);
    times[1]
}
