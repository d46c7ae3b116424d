//! The course's Transformer language model: the model of PyTorch's tutorial "Language modeling
//! with `nn.Transformer`" (`TransformerModel`), with its parameter names, initialisation and
//! arithmetic.
//!
//! token ids `[seq_len, batch]` → embedding · √d_model → + sinusoidal positions → dropout →
//! `nlayers` × post-norm encoder layer (causal multi-head self-attention, ReLU feed-forward) →
//! linear → logits `[seq_len, batch, ntoken]`.
//!
//! Variables are named as in the tutorial model's `state_dict` (`embedding.weight`,
//! `transformer_encoder.layers.{i}.self_attn.in_proj_weight`, ..., `linear.bias`), so weights
//! move between the two by name. Each layer spells out the ATen operations of
//! `torch.nn.TransformerEncoderLayer` with `batch_first=False` (the path torch takes for the
//! tutorial model in training and evaluation alike, since its fast paths need `batch_first`), in
//! the same order and on tensors of the same strides, so that LibTorch picks the same kernels:
//! `tests/transformer.rs` checks the logits against torch's, and ten SGD steps of training with
//! and without dropout (tch and torch share LibTorch's generator, so the masks are the same).
//!
//! The model is also available piece by piece ([`TransformerLm::embed`],
//! [`TransformerLm::layers`], [`TransformerLm::decode`]) so that a pipeline can run the encoder
//! layers on different devices.
use super::parallel_layers::{ColumnParallelLinear, ReplicatedLayerNorm, ReportSplits, RowParallelLinear, Talk, VocabParallelEmbedding};
use super::transformer_names::{self as names, Place, TransformerVariable};
use super::TORCH_DEFAULT_WEIGHT;
use crate::comm::tensor_parallel::{self as tp, Shard, SplitTable, TensorShards};
use crate::comm::ProcessGroup;
use crate::error::UsageError;
use crate::seed_keys::mix_key;
use crate::torch_ext::{self, Generator};
use std::cell::RefCell;
use tch::nn::{self, Init, ModuleT};
use tch::{Device, Kind, Tensor};

/// Where the dropout masks of a forward pass come from.
#[derive(Clone, Copy)]
pub enum Masks<'a> {
    /// LibTorch's default generator (what `tch::manual_seed` seeds), drawn in the order torch
    /// draws them: the tutorial model's masks, bit for bit. Only repeatable when one thread
    /// draws in a fixed order.
    Shared,
    /// A generator of its own, re-seeded for every dropout site from `key` (one micro-batch of
    /// one step) and the site (a layer and a place in it): a mask is a function of what it
    /// belongs to, not of the thread, the pipeline stage, the schedule or the timing that
    /// reached the generator first. Recomputing a forward pass redraws the same masks.
    ///
    /// `positions`: the sequence's length before sequence parallelism padded it (a mask is
    /// drawn for those positions, as without padding, whatever the padding).
    Keyed { generator: &'a RefCell<Generator>, key: u64, positions: i64 },
}

/// A dropout site of the model, for [`Masks::Keyed`]: the embedding's (layer `None`) or one of
/// a layer's four.
#[derive(Debug, Clone, Copy)]
enum Site {
    Embedding,
    AttentionWeights(i64),
    AfterAttention(i64),
    FeedForwardInner(i64),
    FeedForwardOut(i64),
}

impl Site {
    /// The dimensions of the site's tensor that run over the sequence's positions (the
    /// attention weights': queries and keys).
    fn sequence_dims(self) -> &'static [usize] {
        match self {
            Site::AttentionWeights(_) => &[2, 3],
            _ => &[0],
        }
    }

    fn id(self) -> [u64; 2] {
        match self {
            Site::Embedding => [0, 0],
            Site::AttentionWeights(l) => [l as u64 + 1, 1],
            Site::AfterAttention(l) => [l as u64 + 1, 2],
            Site::FeedForwardInner(l) => [l as u64 + 1, 3],
            Site::FeedForwardOut(l) => [l as u64 + 1, 4],
        }
    }
}

/// A tensor that is one tensor-parallel shard's part of a larger one: along `dim`, whose whole
/// length is `whole`, the part `shard` holds.
#[derive(Debug, Clone, Copy)]
struct Part {
    dim: i64,
    whole: i64,
    shard: Shard,
}

impl Masks<'_> {
    /// `xs` with dropout `p` applied in training mode (unchanged otherwise). Where `xs` is
    /// `part` of a larger tensor (a tensor-parallel shard's heads, hidden units or rows of the
    /// sequence), keyed masks are drawn for the whole tensor and cut to the part; where the
    /// sequence was padded, for its real positions: every layout drops the same units as the
    /// unpartitioned model.
    fn dropout_part(&self, xs: &Tensor, p: f64, train: bool, site: Site, part: Option<Part>) -> Tensor {
        match self {
            _ if !train || p == 0.0 => xs.shallow_clone(),
            Masks::Shared => xs.dropout(p, train),
            Masks::Keyed { generator, key, positions } => {
                let mut generator = generator.borrow_mut();
                let [layer, place] = site.id();
                generator.set_seed(mix_key(&[*key, layer, place]));
                let part = part.filter(|part| !part.shard.is_whole());
                let mut shape = xs.size();
                if let Some(Part { dim, whole, .. }) = part {
                    shape[dim as usize] = whole;
                }
                let padded: Vec<usize> = site.sequence_dims().iter().copied().filter(|&dim| shape[dim] > *positions).collect();
                let dropped = match part {
                    None if padded.is_empty() => torch_ext::dropout(xs, p, &mut generator),
                    _ => {
                        // The mask of the unpadded positions, padded with ones (the padding is
                        // never seen), then this shard's part of it.
                        let mut drawn = shape.clone();
                        padded.iter().for_each(|&dim| drawn[dim] = *positions);
                        let options = (xs.kind(), xs.device());
                        torch_ext::dropout(&Tensor::ones(drawn.as_slice(), options), p, &mut generator).map(|mut mask| {
                            for &dim in &padded {
                                let mut rest = mask.size();
                                rest[dim] = shape[dim] - *positions;
                                mask = Tensor::cat(&[mask, Tensor::ones(rest.as_slice(), options)], dim as i64);
                            }
                            match part {
                                // (A copy of the part: the product saves the mask for its
                                // backward pass, and a view, even a contiguous one, would keep
                                // the whole one.)
                                Some(Part { dim, whole, shard }) => {
                                    let (start, len) = shard.range(whole);
                                    xs * mask.narrow(dim, start, len).copy()
                                }
                                None => xs * mask,
                            }
                        })
                    }
                };
                dropped.unwrap_or_else(|err| panic!("{err:#}"))
            }
        }
    }
}

/// Which part of the whole sequence's activations `xs` is, for a dropout mask: this shard's
/// rows under sequence parallelism (none otherwise: `xs` is whole).
fn sequence_rows(talk: Talk, xs: &Tensor, shard: Shard) -> Option<Part> {
    match talk {
        Talk::Sequence(_) => Some(Part { dim: 0, whole: xs.size()[0] * shard.count as i64, shard }),
        _ => None,
    }
}

/// Longest sequence the positional encoding covers (the tutorial's `max_len`).
pub const MAX_LEN: i64 = 5000;

/// The layer norms' epsilon (`nn.LayerNorm`'s and `TransformerEncoderLayer`'s default).
const LAYER_NORM_EPS: f64 = 1e-5;

/// The tutorial's `init_weights`: embedding and output weights U(−0.1, 0.1).
const INIT_RANGE: f64 = 0.1;

/// How the output layer's weights start. (The layer normalisation before it gives each hidden
/// component a variance of about 1, so a logit's standard deviation is √(d_model/3)·bound.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OutputInit {
    /// The tutorial's U(−0.1, 0.1) at any width: logits of standard deviation 0.058·√d_model,
    /// 1.8 at d 1024 but 3.7 at d 4096, where the first loss is 16.6 against 9.8 for uniform
    /// guessing over 18k words, and the tutorial's SGD at lr 5 makes it worse.
    #[default]
    Tutorial,
    /// U(−1/√d_model, 1/√d_model), `nn.Linear`'s own bound: logits of standard deviation 0.58
    /// at any width.
    Scaled,
}

impl OutputInit {
    /// Redraws the output layer's weight (`linear.weight`, on whichever stage holds it) when
    /// scaled: from a generator seeded by `seed` alone, on the CPU, whole (a tensor-parallel
    /// shard keeps its part, cut as its layer reports), so that every layout and device starts
    /// from the same weights.
    pub fn apply(self, named_parameters: &[(String, Tensor)], cfg: &TransformerConfig, seed: u64, tp: Option<&TensorShards>) -> anyhow::Result<()> {
        if self == OutputInit::Tutorial {
            return Ok(());
        }
        let bound = 1.0 / (cfg.d_model as f64).sqrt();
        for (name, weight) in named_parameters.iter().filter(|(name, _)| name == names::OUTPUT_WEIGHT) {
            tch::manual_seed(mix_key(&[seed, 0x6f75_7470_7574]) as i64);
            let drawn = Tensor::empty([cfg.ntoken, cfg.d_model], (weight.kind(), tch::Device::Cpu)).uniform_(-bound, bound);
            let mine = match tp {
                Some(shards) => shards.shard_of(name, &drawn)?,
                None => drawn,
            };
            tch::no_grad(|| weight.shallow_clone().copy_(&mine));
        }
        Ok(())
    }
}

/// The model's hyper-parameters, named as the tutorial's `TransformerModel` arguments.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransformerConfig {
    /// Vocabulary size: the embedding's rows and the output layer's width.
    pub ntoken: i64,
    /// Width of the embeddings and of every layer's input and output.
    pub d_model: i64,
    /// Attention heads per layer; must divide `d_model`.
    pub nhead: i64,
    /// Hidden width of each layer's feed-forward block.
    pub d_hid: i64,
    /// Number of encoder layers.
    pub nlayers: i64,
    /// Dropout probability, used (in training mode only) after the positional encoding, on the
    /// attention weights, after the attention block, inside and after the feed-forward block.
    pub dropout: f64,
}

impl TransformerConfig {
    /// The course's model for a vocabulary of `ntoken` words: d_model 1024, d_hid 1024,
    /// 4 heads, 3 layers, dropout 0.2. (There is no `Default`: the vocabulary comes from the
    /// data.)
    pub const fn course(ntoken: i64) -> Self {
        TransformerConfig { ntoken, d_model: 1024, nhead: 4, d_hid: 1024, nlayers: 3, dropout: 0.2 }
    }

    /// Checks the configuration once, where it is made: a usage error naming the flag (the
    /// fields are the flags `--emsize`, `--d-hid`, `--nhead`, `--nlayers`, `--dropout`) for a
    /// shape torch would reject or the tutorial's positional encoding cannot have. The model's
    /// constructors call it; an experiment calls it on its flags before reading any data.
    pub fn validate(&self) -> Result<(), UsageError> {
        const MAX_LAYERS: i64 = 10_000;
        const MAX_WIDTH: i64 = 1 << 20;
        let TransformerConfig { ntoken, d_model, nhead, d_hid, nlayers, dropout } = *self;
        for (flag, value) in [("--emsize", d_model), ("--d-hid", d_hid), ("--nhead", nhead), ("--nlayers", nlayers)] {
            if value < 1 {
                return Err(UsageError(format!("{flag} must be at least 1, got {value}")));
            }
        }
        if ntoken < 1 {
            return Err(UsageError(format!("the vocabulary must hold at least one word, got {ntoken}")));
        }
        // Beyond any model anyone trains, and beyond what the estimate's list of every parameter
        // (--estimate-memory aborted in an allocation at --nlayers 10000000) and the parameter
        // count's arithmetic hold: refused up front, before anything is built.
        if nlayers > MAX_LAYERS {
            return Err(UsageError(format!("--nlayers {nlayers}: at most {MAX_LAYERS} (the deepest published Transformers have a few hundred layers)")));
        }
        for (flag, value) in [("--emsize", d_model), ("--d-hid", d_hid)] {
            if value > MAX_WIDTH {
                return Err(UsageError(format!(
                    "{flag} {value}: at most {MAX_WIDTH} (one {value} × {value} matrix alone would be {:.0} GiB in float32)",
                    (value as f64).powi(2) * 4.0 / (1u64 << 30) as f64
                )));
            }
        }
        if d_model % nhead != 0 {
            return Err(UsageError(format!("--emsize {d_model} must be divisible by --nhead {nhead} (each head gets an equal share of the width)")));
        }
        if d_model % 2 != 0 {
            return Err(UsageError(format!("--emsize {d_model} must be even (sinusoidal positions come in sine/cosine pairs)")));
        }
        if !(0.0..1.0).contains(&dropout) {
            return Err(UsageError(format!("--dropout must be in [0, 1), got {dropout}")));
        }
        Ok(())
    }

    /// [`TransformerConfig::validate`], and that `shards` tensor-parallel ranks can cut every
    /// layer: the heads, the widths and the vocabulary divide by it.
    pub fn validate_shards(&self, shards: usize) -> Result<(), UsageError> {
        self.validate()?;
        Shard::check_divides(shards, &[("--emsize", self.d_model), ("--nhead", self.nhead), ("--d-hid", self.d_hid), ("the vocabulary", self.ntoken)])
    }
}

/// The number of trainable parameters of the model `cfg` describes, by formula:
/// embedding `V·d` + output layer `d·V + V` + per layer: attention `4d² + 4d` (packed q/k/v
/// projection and output projection, with biases), feed-forward `2·d·d_hid + d_hid + d`, two
/// layer norms `4d`. The course's model at V = 28,782 has 77,879,406.
pub fn param_count_formula(cfg: &TransformerConfig) -> i64 {
    let TransformerConfig { ntoken: v, d_model: d, d_hid: h, nlayers, .. } = *cfg;
    let attention = 4 * d * d + 4 * d;
    let feed_forward = 2 * d * h + h + d;
    let norms = 4 * d;
    v * d + (d * v + v) + nlayers * (attention + feed_forward + norms)
}

/// Multi-head self-attention with a causal mask: `torch.nn.MultiheadAttention(d, nhead,
/// dropout)` called on `(x, x, x)` with the causal mask and `is_causal=True`, which is how
/// `TransformerEncoder` calls it for the tutorial's mask (it recognises the mask as causal).
#[derive(Debug)]
struct SelfAttention {
    /// q, k and v projections stacked: `[3·d, d]` (column parallel, cut by heads).
    in_proj: ColumnParallelLinear,
    out_proj: RowParallelLinear,
    /// All heads of the layer.
    nhead: i64,
    dropout: f64,
    /// This rank's heads: `shard`'s share of them (all without tensor parallelism).
    shard: Shard,
}

impl SelfAttention {
    /// `MultiheadAttention._reset_parameters`: Xavier-uniform packed projection over its whole
    /// `[3d, d]` shape, zero biases; the output projection keeps `nn.Linear`'s default weight.
    /// A tensor-parallel `shard` holds its heads' rows of the q, k and v projections (column
    /// parallel) and their columns of the output projection (row parallel), whose bias it holds
    /// whole; its starting values are the whole layer's, copied in by the caller.
    fn new(vs: &nn::Path, cfg: &TransformerConfig, shard: Shard) -> Self {
        let d = cfg.d_model;
        let xavier = (6.0 / (d + 3 * d) as f64).sqrt();
        // Drawn in torch's order: the output projection, then the packed projection.
        let out_proj = RowParallelLinear::new(&(vs / "out_proj"), [d, d], shard, TORCH_DEFAULT_WEIGHT, Some(Init::Const(0.)));
        let in_proj = ColumnParallelLinear::packed(vs, "in_proj", 3, [d, d], shard, [Init::Uniform { lo: -xavier, up: xavier }, Init::Const(0.)]);
        SelfAttention { in_proj, out_proj, nhead: cfg.nhead, dropout: cfg.dropout, shard }
    }

    /// `[seq, batch, d]` → `[seq, batch, d]`: position `t` attends to positions `≤ t`; layer
    /// `layer`'s attention weights dropped in training as `masks` says. A shard computes its
    /// heads and sums its part of the output projection with the others' over `group`.
    fn forward_t(&self, xs: &Tensor, train: bool, masks: Masks, layer: i64, talk: Talk, out_bias: &Tensor) -> anyhow::Result<Tensor> {
        let (_, batch, d) = xs.size3().expect("attention input must be [seq, batch, d]");
        let head_dim = d / self.nhead;
        let (nhead, local) = (self.nhead / self.shard.count as i64, d / self.shard.count as i64);
        // `_in_projection_packed`: one projection, split into q, k and v by a contiguous copy
        // (of the whole sequence, also where `xs` is this shard's rows of it).
        let projected = self.in_proj.forward(xs, talk)?;
        let seq = projected.size()[0];
        let qkv = projected.unflatten(-1, [3, local]).unsqueeze(0).transpose(0, -2).squeeze_dim(-2).contiguous();
        // [seq, batch, d] → [batch, nhead, seq, head_dim] through the same (strided) views as
        // `multi_head_attention_forward`; the strides decide which attention kernel runs.
        let heads = |t: Tensor| t.view([seq, batch * nhead, head_dim]).transpose(0, 1).view([batch, nhead, seq, head_dim]);
        let (q, k, v) = (heads(qkv.get(0)), heads(qkv.get(1)), heads(qkv.get(2)));
        // The fused kernel with `is_causal` builds the causal mask itself (no mask tensor to
        // make or cache) and drops attention weights with probability `dropout_p`, as torch's
        // `MultiheadAttention` does in training mode.
        let dropout_p = if train { self.dropout } else { 0.0 };
        let attended = match masks {
            Masks::Keyed { .. } if dropout_p > 0.0 => {
                // The fused kernels draw from the default generator only: spell the attention
                // out (LibTorch's math kernel) with a keyed mask on its weights.
                let (seq_q, seq_k) = (q.size()[2], k.size()[2]);
                let scores = q.matmul(&k.transpose(-2, -1)) / (head_dim as f64).sqrt();
                let causal = Tensor::ones([seq_q, seq_k], (Kind::Bool, scores.device())).tril(0);
                let weights = scores.masked_fill(&causal.logical_not(), f64::NEG_INFINITY).softmax(-1, scores.kind());
                let heads = Part { dim: 1, whole: self.nhead, shard: self.shard };
                masks.dropout_part(&weights, dropout_p, train, Site::AttentionWeights(layer), Some(heads)).matmul(&v)
            }
            _ => Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, dropout_p, true, None, false),
        };
        let attended = attended.permute([2, 0, 1, 3]).contiguous().view([seq * batch, local]);
        // (Rows of `[seq · batch, d]` are sequence-major: a shard's rows of it are its rows of
        // the sequence.)
        Ok(self.out_proj.forward(&attended, talk, out_bias)?.view([-1, batch, d]))
    }

    fn parameters(&self) -> [&Tensor; 4] {
        [&self.in_proj.weight, &self.in_proj.bias, self.out_proj.weight(), self.out_proj.bias()]
    }
}

impl ReportSplits for SelfAttention {
    fn report_splits(&self, table: &mut SplitTable) {
        self.in_proj.report_splits(table);
        self.out_proj.report_splits(table);
    }
}

/// One post-norm encoder layer, `torch.nn.TransformerEncoderLayer(d_model, nhead, d_hid,
/// dropout)` (ReLU, `norm_first=False`, `batch_first=False`) with causal self-attention:
/// `x = norm1(x + dropout(attention(x)))`, then
/// `x = norm2(x + dropout(linear2(dropout(relu(linear1(x))))))`.
///
/// Input and output `[seq_len, batch, d_model]`; `train` turns dropout on.
#[derive(Debug)]
pub struct EncoderLayer {
    self_attn: SelfAttention,
    linear1: ColumnParallelLinear,
    linear2: RowParallelLinear,
    norm1: ReplicatedLayerNorm,
    norm2: ReplicatedLayerNorm,
    dropout: f64,
    d_hid: i64,
    shard: Shard,
    /// Between the layers each shard holds its rows of the sequence ([`Talk::Sequence`]).
    sequence_parallel: bool,
}

impl EncoderLayer {
    /// A layer with torch's initialisation, its variables under `vs` with torch's names
    /// (`self_attn.in_proj_weight`, `linear1.weight`, `norm2.bias`, ...).
    pub fn new(vs: &nn::Path, cfg: &TransformerConfig) -> Result<Self, UsageError> {
        Self::new_sharded(vs, cfg, Shard::WHOLE)
    }

    /// Tensor-parallel `shard` of a layer (Megatron's): its heads of the attention, its rows of
    /// `linear1` (column parallel) and columns of `linear2` (row parallel, bias whole), the
    /// layer norms whole. The variables have the whole layer's names and the shard's shapes,
    /// each made by its parallel layer ([`super::parallel_layers`]); the caller copies the
    /// whole layer's starting values in.
    pub fn new_sharded(vs: &nn::Path, cfg: &TransformerConfig, shard: Shard) -> Result<Self, UsageError> {
        cfg.validate_shards(shard.count)?;
        let (d, d_hid) = (cfg.d_model, cfg.d_hid);
        // `nn.Linear`'s initialisation, and `nn.LayerNorm`'s (weight 1, bias 0).
        Ok(EncoderLayer {
            self_attn: SelfAttention::new(&(vs / "self_attn"), cfg, shard),
            linear1: ColumnParallelLinear::new(&(vs / "linear1"), [d_hid, d], shard, TORCH_DEFAULT_WEIGHT, None),
            linear2: RowParallelLinear::new(&(vs / "linear2"), [d, d_hid], shard, TORCH_DEFAULT_WEIGHT, None),
            norm1: ReplicatedLayerNorm::new(&(vs / "norm1"), d, LAYER_NORM_EPS),
            norm2: ReplicatedLayerNorm::new(&(vs / "norm2"), d, LAYER_NORM_EPS),
            dropout: cfg.dropout,
            d_hid: cfg.d_hid,
            shard,
            sequence_parallel: false,
        })
    }

    /// This layer with its input and output cut along the sequence over the shards (sequence
    /// parallelism: its layer norms and dropouts on 1/k of the sequence).
    pub fn sequence_parallel(self) -> Self {
        EncoderLayer { sequence_parallel: true, ..self }
    }

    /// The layer's parameters, in a fixed order (for copying one layer into another).
    fn parameters(&self) -> Vec<&Tensor> {
        let mut params = self.self_attn.parameters().to_vec();
        params.extend([&self.linear1.weight, &self.linear1.bias, self.linear2.weight(), self.linear2.bias()]);
        params.extend([&self.norm1.weight, &self.norm1.bias, &self.norm2.weight, &self.norm2.bias]);
        params
    }
}

impl ReportSplits for EncoderLayer {
    fn report_splits(&self, table: &mut SplitTable) {
        self.self_attn.report_splits(table);
        self.linear1.report_splits(table);
        self.linear2.report_splits(table);
        self.norm1.report_splits(table);
        self.norm2.report_splits(table);
    }
}

impl EncoderLayer {
    /// The layer as layer `layer` of the model (which names its dropout sites for keyed
    /// masks), its masks drawn as `masks` says.
    pub fn forward_masked(&self, xs: &Tensor, train: bool, masks: Masks, layer: i64) -> Tensor {
        self.forward_sharded(xs, train, masks, layer, None).unwrap_or_else(|err| panic!("{err:#}"))
    }

    /// [`EncoderLayer::forward_masked`] of a tensor-parallel shard, whose partial results are
    /// summed over `group` (two all-reduces forward, two backward; with sequence parallelism two
    /// all-gathers and two reduce-scatters each way, `xs` and the output this shard's rows of
    /// the sequence); a whole layer needs none.
    pub fn forward_sharded(&self, xs: &Tensor, train: bool, masks: Masks, layer: i64, group: Option<&ProcessGroup>) -> anyhow::Result<Tensor> {
        let talk = Talk::of(self.shard, self.sequence_parallel, group)?;
        let p = self.dropout;
        let rows = sequence_rows(talk, xs, self.shard);
        let [w1, b1, w2, b2, out_bias, bias2] =
            talk.whole([&self.norm1.weight, &self.norm1.bias, &self.norm2.weight, &self.norm2.bias, self.self_attn.out_proj.bias(), self.linear2.bias()])?;
        let attended = self.self_attn.forward_t(xs, train, masks, layer, talk, &out_bias)?;
        let xs = self.norm1.forward(&(xs + masks.dropout_part(&attended, p, train, Site::AfterAttention(layer), rows)), &w1, &b1);
        let hidden = Part { dim: 2, whole: self.d_hid, shard: self.shard };
        let expanded = self.linear1.forward(&xs, talk)?.relu();
        let inner = masks.dropout_part(&expanded, p, train, Site::FeedForwardInner(layer), Some(hidden));
        let feed_forward = masks.dropout_part(&self.linear2.forward(&inner, talk, &bias2)?, p, train, Site::FeedForwardOut(layer), rows);
        Ok(self.norm2.forward(&(xs + feed_forward), &w2, &b2))
    }
}

impl ModuleT for EncoderLayer {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.forward_masked(xs, train, Masks::Shared, 0)
    }
}

/// The tutorial's sinusoidal encoding `pe[pos, 0, 2i] = sin(pos·10000^(−2i/d))`,
/// `pe[pos, 0, 2i+1] = cos(...)`, shaped `[MAX_LEN, 1, d_model]`, computed with torch's ops
/// and dtypes (int64 positions, float32 frequencies) so that it equals the buffer bit for bit.
fn positional_encoding(d_model: i64, device: Device) -> Tensor {
    let position = Tensor::arange(MAX_LEN, (Kind::Int64, device)).unsqueeze(1);
    let div_term = (Tensor::arange_start_step(0, d_model, 2, (Kind::Int64, device)) * (-(10000f64.ln()) / d_model as f64)).exp();
    // [MAX_LEN, d_model / 2], float32 (int64 × float32 promotes as in torch).
    let angles = position * div_term;
    // Interleave: even features the sines, odd features the cosines.
    Tensor::stack(&[angles.sin(), angles.cos()], 2).view([MAX_LEN, 1, d_model])
}

/// The model's input end: token ids `[seq_len, batch]` → `embedding · √d_model + positions`,
/// then dropout: `[seq_len, batch, d_model]`, the input of the first encoder layer. Variables:
/// `embedding.weight` under the given path.
#[derive(Debug)]
pub struct TokenEmbedding {
    embedding: VocabParallelEmbedding,
    /// The positional encoding: a constant of the configuration, kept out of the var store
    /// (torch's `pos_encoder.pe` buffer). Stored, it would add `MAX_LEN · d_model` floats
    /// (20 MB for the course's model) to every checkpoint and weights file while carrying no
    /// information; outside, the var store holds exactly the trainable parameters, like the
    /// tutorial's `named_parameters()`.
    pos_encoding: Tensor,
    d_model: i64,
    dropout: f64,
    /// The words whose rows this rank holds: `shard`'s share of the vocabulary.
    shard: Shard,
    /// Its output cut along the sequence over the shards (sequence parallelism).
    sequence_parallel: bool,
}

impl TokenEmbedding {
    /// The tutorial's embedding (U(−0.1, 0.1)) as `root / "embedding"`; the positional encoding
    /// is made on `root`'s device (and follows the input to another device if need be).
    pub fn new(root: &nn::Path, cfg: &TransformerConfig) -> Result<Self, UsageError> {
        Self::new_sharded(root, cfg, Shard::WHOLE)
    }

    /// The rows of `shard`'s words (vocabulary parallel); the caller copies the whole
    /// embedding's starting values in.
    pub fn new_sharded(root: &nn::Path, cfg: &TransformerConfig, shard: Shard) -> Result<Self, UsageError> {
        cfg.validate_shards(shard.count)?;
        let init = Init::Uniform { lo: -INIT_RANGE, up: INIT_RANGE };
        let embedding = VocabParallelEmbedding::new(&(root / names::EMBEDDING), [cfg.ntoken, cfg.d_model], shard, init);
        Ok(TokenEmbedding {
            embedding,
            pos_encoding: positional_encoding(cfg.d_model, root.device()),
            d_model: cfg.d_model,
            dropout: cfg.dropout,
            shard,
            sequence_parallel: false,
        })
    }

    /// This embedding with its output cut along the sequence over the shards: each shard its
    /// rows, the sequence padded at its end to a multiple of the shards (a causal model's
    /// earlier positions do not see the padding; [`Self::sequence_length`] gives it back).
    pub fn sequence_parallel(self) -> Self {
        TokenEmbedding { sequence_parallel: true, ..self }
    }

    /// The length of the sequence the shards' rows make up for `tokens` of length `seq_len`:
    /// `seq_len` padded to a multiple of the shards under sequence parallelism.
    pub fn sequence_length(&self, seq_len: i64) -> i64 {
        let k = self.shard.count as i64;
        if self.sequence_parallel {
            (seq_len + k - 1) / k * k
        } else {
            seq_len
        }
    }
}

impl ModuleT for TokenEmbedding {
    fn forward_t(&self, src: &Tensor, train: bool) -> Tensor {
        self.forward_masked(src, train, Masks::Shared)
    }
}

impl TokenEmbedding {
    /// [`ModuleT::forward_t`] with the positional dropout's mask drawn as `masks` says.
    pub fn forward_masked(&self, src: &Tensor, train: bool, masks: Masks) -> Tensor {
        self.forward_sharded(src, train, masks, None).unwrap_or_else(|err| panic!("{err:#}"))
    }

    /// [`TokenEmbedding::forward_masked`] of a vocabulary-parallel shard: its words' rows, zeros
    /// for the others' words, summed over `group` (Megatron's g; one all-reduce).
    /// With sequence parallelism each shard gets its rows of that sum (a reduce-scatter).
    pub fn forward_sharded(&self, src: &Tensor, train: bool, masks: Masks, group: Option<&ProcessGroup>) -> anyhow::Result<Tensor> {
        let seq_len = src.size().first().copied().unwrap_or(0);
        let padded = self.sequence_length(seq_len);
        assert!(src.dim() == 2 && padded <= MAX_LEN, "input must be token ids [seq_len ≤ {MAX_LEN}, batch], got shape {:?}", src.size());
        let talk = Talk::of(self.shard, self.sequence_parallel, group)?;
        let src = match padded - seq_len {
            0 => src.shallow_clone(),
            // Padding's ids are 0, a word; the positions after the real ones are never read.
            pad => Tensor::cat(&[src.shallow_clone(), src.zeros_like().narrow(0, 0, 1).expand([pad, -1], false)], 0),
        };
        let embedded = self.embedding.forward(&src, talk)?;
        // Under sequence parallelism this shard's rows start at its share of the sequence.
        let first = if let Talk::Sequence(_) = talk { self.shard.index as i64 * padded / self.shard.count as i64 } else { 0 };
        let xs = embedded * (self.d_model as f64).sqrt();
        let positions = self.pos_encoding.narrow(0, first, xs.size()[0]).to_device(xs.device()).to_kind(xs.kind());
        let rows = sequence_rows(talk, &xs, self.shard);
        Ok(masks.dropout_part(&(xs + positions), self.dropout, train, Site::Embedding, rows))
    }
}

/// The model's output end, `root / "linear"`: hidden states `[seq_len, batch, d_model]` →
/// logits `[seq_len, batch, ntoken]`, weights U(−0.1, 0.1) and zero bias as the tutorial's
/// `init_weights`. A tensor-parallel `shard` holds its words' rows (vocabulary parallel, a
/// column-parallel layer over the words: its slice of the logits).
pub fn output_layer(root: &nn::Path, cfg: &TransformerConfig, shard: Shard) -> ColumnParallelLinear {
    let init = Init::Uniform { lo: -INIT_RANGE, up: INIT_RANGE };
    ColumnParallelLinear::new(&(root / names::OUTPUT), [cfg.ntoken, cfg.d_model], shard, init, Some(Init::Const(0.)))
}

/// `nlayers` encoder layers `root / "transformer_encoder" / "layers" / i` for `i` in `range`,
/// all starting from the same weights, as in torch: `nn.TransformerEncoder` deep-copies one
/// initialised layer. (A pipeline stage builds its own range of layers; every stage seeds
/// LibTorch's generator alike first, so all layers of all stages start equal too.)
pub fn encoder_layers(root: &nn::Path, cfg: &TransformerConfig, range: std::ops::Range<i64>) -> Result<Vec<EncoderLayer>, UsageError> {
    encoder_layers_sharded(root, cfg, range, Shard::WHOLE)
}

/// [`encoder_layers`], each layer tensor-parallel `shard` of it.
pub fn encoder_layers_sharded(root: &nn::Path, cfg: &TransformerConfig, range: std::ops::Range<i64>, shard: Shard) -> Result<Vec<EncoderLayer>, UsageError> {
    let layers_path = root / names::LAYERS[0] / names::LAYERS[1];
    let layers: Vec<EncoderLayer> = range.map(|i| EncoderLayer::new_sharded(&(&layers_path / i), cfg, shard)).collect::<Result<_, _>>()?;
    if let Some((first, rest)) = layers.split_first() {
        tch::no_grad(|| {
            let first = first.parameters();
            for layer in rest {
                for (dst, src) in layer.parameters().into_iter().zip(&first) {
                    dst.shallow_clone().copy_(src);
                }
            }
        });
    }
    Ok(layers)
}

/// A consecutive piece of the Transformer language model: the token embedding (if it starts
/// the model), encoder layers `layer_range`, the output layer (if it ends the model); as a
/// tensor-parallel shard of those layers, with sequence parallelism or not. The one assembly of
/// the model's layers: [`TransformerLm`] is the piece that is the whole model, a pipeline
/// stage ([`crate::pipeline::Stage`]) a piece on a device of its own. Its variables carry the
/// names they have in the whole model, so pieces together are exactly the whole model's
/// state dict.
#[derive(Debug)]
pub struct TransformerPart {
    embedding: Option<TokenEmbedding>,
    layers: Vec<EncoderLayer>,
    layer_range: std::ops::Range<i64>,
    head: Option<ColumnParallelLinear>,
    /// This rank's tensor-parallel shard of every layer ([`Shard::WHOLE`] without).
    shard: Shard,
    /// Between its layers each shard holds its rows of the sequence (sequence parallelism).
    sequence_parallel: bool,
}

/// Which of the model's pieces a [`TransformerPart`] holds.
#[derive(Debug, Clone)]
pub struct PartSpan {
    pub embedding: bool,
    pub layers: std::ops::Range<i64>,
    pub head: bool,
}

impl PartSpan {
    /// The whole model of `nlayers` layers.
    pub fn whole(nlayers: i64) -> PartSpan {
        PartSpan { embedding: true, layers: 0..nlayers, head: true }
    }
}

impl TransformerPart {
    /// The pieces `span` says, tensor-parallel `shard` of them, their variables under `root`
    /// with the whole model's names. `before_piece(i)` runs before the embedding (0), the
    /// layers (1) and the output layer (2) draw their starting values: a pipeline stage seeds
    /// LibTorch's generator there, so that every partition starts alike.
    pub fn new(root: &nn::Path, cfg: &TransformerConfig, span: PartSpan, shard: Shard, before_piece: &mut dyn FnMut(u64)) -> Result<Self, UsageError> {
        cfg.validate_shards(shard.count)?;
        before_piece(0);
        let embedding = span.embedding.then(|| TokenEmbedding::new_sharded(root, cfg, shard)).transpose()?;
        before_piece(1);
        let layers = encoder_layers_sharded(root, cfg, span.layers.clone(), shard)?;
        before_piece(2);
        let head = span.head.then(|| output_layer(root, cfg, shard));
        Ok(TransformerPart { embedding, layers, layer_range: span.layers, head, shard, sequence_parallel: false })
    }

    /// This piece with sequence parallelism (Korthikanti et al. 2022): between its
    /// tensor-parallel layers each shard holds its rows of the sequence (padded to a multiple of
    /// the shards), what passes to the next piece included; the output layer gathers the
    /// sequence. A property of the layers, not of the loop.
    pub fn sequence_parallel(self) -> Result<Self, UsageError> {
        if self.shard.is_whole() {
            return Err(UsageError("--sequence-parallel cuts the sequence over the tensor-parallel shards of a layer: it needs --tp 2 or more".into()));
        }
        let TransformerPart { embedding, layers, .. } = self;
        Ok(TransformerPart {
            embedding: embedding.map(TokenEmbedding::sequence_parallel),
            layers: layers.into_iter().map(EncoderLayer::sequence_parallel).collect(),
            sequence_parallel: true,
            ..self
        })
    }

    pub fn shard(&self) -> Shard {
        self.shard
    }

    pub fn has_embedding(&self) -> bool {
        self.embedding.is_some()
    }

    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    /// The embedding: token ids `[seq_len, batch]` → `[seq_len, batch, d_model]`.
    ///
    /// # Panics
    /// On a piece without the embedding.
    pub fn embed(&self, src: &Tensor, train: bool, masks: Masks, tp: Option<&ProcessGroup>) -> anyhow::Result<Tensor> {
        self.embedding.as_ref().expect("this piece starts the model").forward_sharded(src, train, masks, tp)
    }

    /// The encoder layers, in order, with their indices in the whole model.
    pub fn layers(&self) -> impl Iterator<Item = (i64, &EncoderLayer)> {
        self.layer_range.clone().zip(&self.layers)
    }

    /// The output layer: hidden states `[seq_len, batch, d_model]` → logits `[seq_len, batch,
    /// ntoken]` (a tensor-parallel shard's words' slice of them, over `tp`).
    ///
    /// # Panics
    /// On a piece without the output layer.
    pub fn decode(&self, hidden: &Tensor, tp: Option<&ProcessGroup>) -> anyhow::Result<Tensor> {
        let head = self.head.as_ref().expect("this piece ends the model");
        // Sequence parallel: the whole (padded) sequence's logits from this shard's rows.
        head.forward(hidden, Talk::of(self.shard, self.sequence_parallel, tp)?)
    }

    /// How tensor parallelism cuts each of this piece's variables, as its layers report it
    /// (the one statement of every cut: checkpoints, ZeRO and the starting values ask this).
    pub fn splits(&self) -> SplitTable {
        let mut table = SplitTable::default();
        self.report_splits(&mut table);
        table
    }
}

impl ReportSplits for TransformerPart {
    fn report_splits(&self, table: &mut SplitTable) {
        let embedding = self.embedding.as_ref().map(|e| &e.embedding as &dyn ReportSplits);
        let layers = self.layers.iter().map(|l| l as &dyn ReportSplits);
        let head = self.head.as_ref().map(|h| h as &dyn ReportSplits);
        embedding.into_iter().chain(layers).chain(head).for_each(|layer| layer.report_splits(table));
    }
}

impl TransformerPart {
    /// Through every piece it holds: token ids or hidden states in, hidden states or logits
    /// out; dropout masks drawn as `masks` says (keyed masks are named by the layers'
    /// whole-model indices, so they do not depend on the partition); a tensor-parallel shard
    /// talks to the other shards over `tp`.
    pub fn forward_masked(&self, xs: &Tensor, train: bool, masks: Masks, tp: Option<&ProcessGroup>) -> anyhow::Result<Tensor> {
        let xs = self.hidden_states(xs, train, masks, tp)?;
        match &self.head {
            Some(_) => self.decode(&xs, tp),
            None => Ok(xs),
        }
    }

    /// [`TransformerPart::forward_masked`] short of the output layer: the hidden states its
    /// last encoder layer gives.
    pub fn hidden_states(&self, xs: &Tensor, train: bool, masks: Masks, tp: Option<&ProcessGroup>) -> anyhow::Result<Tensor> {
        let mut xs = match &self.embedding {
            Some(_) => self.embed(xs, train, masks, tp)?,
            None => xs.shallow_clone(),
        };
        for (index, layer) in self.layers() {
            xs = layer.forward_sharded(&xs, train, masks, index, tp)?;
        }
        Ok(xs)
    }

    /// The output layer and the mean cross-entropy of its logits against `targets`, `chunks`
    /// chunks of the tokens at a time (`--loss-chunks`, [`torch_ext::chunked_linear_cross_entropy`]):
    /// no logits tensor of the whole batch exists, forward or backward, only one chunk's; the
    /// products in the kind the output layer computes in (autocast's, or the weights'), the
    /// log-softmax and the loss in float32. And, when asked, the arg-max hits. The whole output
    /// layer only (a tensor-parallel shard's loss is the vocabulary-parallel one).
    ///
    /// # Panics
    /// On a piece without the output layer.
    pub fn chunked_loss_and_hits(&self, hidden: &Tensor, targets: &Tensor, chunks: i64, count_hits: bool) -> anyhow::Result<(Tensor, Option<Tensor>)> {
        let head = self.head.as_ref().expect("this piece ends the model");
        if !self.shard.is_whole() {
            anyhow::bail!("the chunked output layer and loss is the whole output layer's, not a tensor-parallel shard's");
        }
        let width = *hidden.size().last().expect("hidden states have a width");
        let hidden = hidden.reshape([-1, width]);
        let rows = hidden.size()[0];
        let chunk_rows = (rows + chunks.max(1) - 1) / chunks.max(1);
        let compute = crate::precision::active_autocast_kind(hidden.device()).unwrap_or(head.weight.kind());
        let targets = targets.reshape([-1]).to_kind(Kind::Int64);
        let (loss, hits) = torch_ext::chunked_linear_cross_entropy(&hidden, &head.weight, Some(&head.bias), &targets, chunk_rows.max(1), compute, count_hits)?;
        Ok((loss, count_hits.then_some(hits)))
    }

    /// `tp` when this piece is a shard of more than one.
    fn tp_group<'a>(&self, tp: Option<&'a ProcessGroup>) -> Option<&'a ProcessGroup> {
        tp.filter(|_| !self.shard.is_whole())
    }

    /// The mean cross-entropy of the output layer's `logits` against `targets`, and, when
    /// asked, its arg-max hits; a shard's vocabulary-parallel loss over `tp`. Positions that
    /// sequence parallelism padded the sequence with are left out.
    pub fn loss_and_hits(&self, logits: &Tensor, targets: &Tensor, tp: Option<&ProcessGroup>, count_hits: bool) -> anyhow::Result<(Tensor, Option<Tensor>)> {
        let (positions, batch) = (logits.size()[0], logits.size()[1]);
        let real = targets.numel() as i64 / batch;
        let logits = if self.sequence_parallel && real < positions { logits.narrow(0, 0, real) } else { logits.shallow_clone() };
        match self.tp_group(tp) {
            None => Ok((language_model_loss(&logits, targets), count_hits.then(|| logits.argmax(-1, false).eq_tensor(targets).sum(Kind::Int64)))),
            Some(group) => {
                let (loss, hits) = tp::vocab_parallel_cross_entropy(&logits, targets, self.shard, group)?;
                Ok((loss, count_hits.then_some(hits)))
            }
        }
    }
}

/// Mean cross-entropy of `logits` `[seq_len, batch, ntoken]` against `targets` `[seq_len, batch]`.
pub fn language_model_loss(logits: &Tensor, targets: &Tensor) -> Tensor {
    let classes = *logits.size().last().expect("logits have a vocabulary dimension");
    logits.reshape([-1, classes]).cross_entropy_for_logits(&targets.reshape([-1]).to_kind(Kind::Int64))
}

/// The tutorial's `TransformerModel`: a causal Transformer language model, the
/// [`TransformerPart`] that holds every piece, on one rank.
///
/// `forward_t` maps int64 token ids `[seq_len, batch]` (seq_len ≤ [`MAX_LEN`]) to logits
/// `[seq_len, batch, ntoken]`; the logits at position `t` depend on the tokens at `0..=t` only.
/// `train` turns dropout on.
#[derive(Debug)]
pub struct TransformerLm {
    part: TransformerPart,
    /// `--loss-chunks`: the output layer and the loss computed this many chunks of the tokens
    /// at a time ([`TransformerPart::chunked_loss_and_hits`]) where the step asks the model for
    /// its loss ([`super::PartedModule::own_loss`]).
    loss_chunks: Option<i64>,
}

impl TransformerLm {
    /// The model with the tutorial's initialisation, its variables under `root` with the
    /// tutorial model's `state_dict` names.
    ///
    /// A usage error (from [`TransformerConfig::validate`]) for an impossible configuration.
    pub fn new(root: &nn::Path, cfg: &TransformerConfig) -> Result<Self, UsageError> {
        Ok(TransformerLm { part: TransformerPart::new(root, cfg, PartSpan::whole(cfg.nlayers), Shard::WHOLE, &mut |_| {})?, loss_chunks: None })
    }

    /// This model computing its output layer and loss `chunks` chunks of the tokens at a time
    /// (None: the logits of the whole batch, then the loss).
    pub fn with_loss_chunks(self, chunks: Option<i64>) -> Self {
        TransformerLm { loss_chunks: chunks, ..self }
    }

    /// The mean cross-entropy of the next-token predictions for `src` against `targets` and,
    /// when asked, the arg-max hits, through the output layer `chunks` chunks of the tokens at
    /// a time ([`TransformerPart::chunked_loss_and_hits`]).
    pub fn chunked_loss_and_hits(
        &self,
        src: &Tensor,
        targets: &Tensor,
        train: bool,
        chunks: i64,
        count_hits: bool,
    ) -> anyhow::Result<(Tensor, Option<Tensor>)> {
        let hidden = self.part.hidden_states(src, train, Masks::Shared, None)?;
        self.part.chunked_loss_and_hits(&hidden, targets, chunks, count_hits)
    }

    /// The first stage: token ids `[seq_len, batch]` → `[seq_len, batch, d_model]`.
    pub fn embed(&self, src: &Tensor, train: bool) -> Tensor {
        self.part.embed(src, train, Masks::Shared, None).unwrap_or_else(|err| panic!("{err:#}"))
    }

    /// The encoder layers, in order; each maps `[seq_len, batch, d_model]` to the same shape.
    pub fn layers(&self) -> &[EncoderLayer] {
        &self.part.layers
    }

    /// The last stage: the output of the last layer `[seq_len, batch, d_model]` → logits
    /// `[seq_len, batch, ntoken]`.
    pub fn decode(&self, hidden: &Tensor) -> Tensor {
        self.part.decode(hidden, None).unwrap_or_else(|err| panic!("{err:#}"))
    }
}

/// ZeRO-3's units: the embedding (part 0), each encoder layer (parts 1 to `nlayers`), the output
/// layer (the last part).
impl super::PartedModule for TransformerLm {
    fn part_of(&self, name: &str) -> anyhow::Result<usize> {
        Ok(match TransformerVariable::parse(name)?.place {
            Place::Embedding => 0,
            Place::Layer(layer) => layer as usize + 1,
            Place::Output => self.layers().len() + 1,
        })
    }

    fn forward_parts(&self, src: &Tensor, train: bool, around: &mut super::AroundPart) -> anyhow::Result<Tensor> {
        let mut hidden = around(0, &|| self.embed(src, train))?;
        for (i, layer) in self.layers().iter().enumerate() {
            let input = hidden;
            hidden = around(i + 1, &|| layer.forward_t(&input, train))?;
        }
        around(self.layers().len() + 1, &|| self.decode(&hidden))
    }

    fn own_loss(&self, src: &Tensor, targets: &Tensor, train: bool, count_hits: bool) -> Option<anyhow::Result<(Tensor, Option<Tensor>)>> {
        Some(self.chunked_loss_and_hits(src, targets, train, self.loss_chunks?, count_hits))
    }
}

impl ModuleT for TransformerLm {
    fn forward_t(&self, src: &Tensor, train: bool) -> Tensor {
        self.part.forward_masked(src, train, Masks::Shared, None).unwrap_or_else(|err| panic!("{err:#}"))
    }
}
