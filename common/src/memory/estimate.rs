//! `--estimate-memory`: what each rank will hold, before anything is launched. For the given
//! model, layout (dp × pp × tp), ZeRO stage, precision, batch and micro-batches, per rank:
//! the parameters, gradients and optimizer state (exact: the style's formulas,
//! [`crate::parallel::Costs::model_state`]),
//! the activations the forward passes keep for the backward passes, and what a pass holds on
//! top of them at its peak.
//!
//! The Transformer's activations are counted tensor by tensor: what autograd saves in each of
//! its operations (the kernels LibTorch picks on the CPU and on CUDA differ: a fused attention
//! keeps no `seq × seq` scores; CUDA's dropout keeps a byte per element for its mask where the
//! CPU's keeps a float), and what the pipeline's schedule keeps alive: a stage holds as many
//! micro-batches' activations as its schedule has forward passes ahead of their backward
//! passes ([`crate::pipeline::schedule::peak_live`], read off the schedule itself).
//!
//! The peak is found by walking each device's passes in the schedule's order
//! ([`crate::pipeline::schedule::device_ops`]) and adding at each what that pass itself holds
//! at its most: the loss's gradients on the last stage, the output layer's and the embedding's
//! fresh gradients beside those earlier backward passes summed, the gradient received from the
//! next stage, ZeRO-3's gathered and reduced parts; then the update after the passes, as the
//! run's data-parallel style counts it ([`crate::parallel::Costs::update_bytes`]: the gradient
//! averager's largest bucket, ZeRO's flattened buckets, slices and block gradient and the
//! buffers of publishing the blocks, the optimizer's temporaries). Each term is a tensor the
//! code makes (the comments name it), found with the counting allocator's trace of what is
//! held at the peak (`TORCH_EXT_PEAK_TRACE=<path>`, [`crate::torch_ext::trace_cpu_memory_dump`]).
//! The CPU
//! figures were checked tensor by tensor against `torch.autograd.graph.saved_tensors_hooks`
//! and against the measured peak (tests/memory.rs: within 5% for the whole model, ZeRO 1 to 3,
//! HSDP, tensor parallelism with and without sequence parallelism, GPipe, 1F1B and interleaved
//! pipelines); the CUDA figures follow the same accounting with CUDA's kernels and were not
//! measured here (the caching allocator's rounding and LibTorch's workspaces are not counted).
//! An image model's activations are measured instead: one forward pass of a few images on the
//! CPU, scaled to the batch.
use serde::Serialize;

use crate::models::TransformerConfig;
use crate::parallel::costs::{RankModel, Sharding};
use crate::parallel::GradientSync;
use crate::pipeline::{schedule, Partition, Placement, Schedule};
use crate::precision::Precision;

use super::MIB;

/// What one rank (or all the ranks that hold alike: the row says which) will hold, in bytes.
#[derive(Debug, Clone, Serialize)]
pub struct RankEstimate {
    /// The ranks this row stands for: `every rank`, `stage 1`, `device cuda:0`, ...
    pub ranks: String,
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer: f64,
    /// Buffers the model holds beside its parameters (the positional encoding).
    pub buffers: f64,
    /// Activations kept for the backward passes at their most.
    pub activations: f64,
    /// The same with `--checkpoint-activations` (pipelines: each stage keeps its inputs and
    /// recomputes the rest), where it applies.
    pub activations_recomputed: Option<f64>,
    /// What the passes hold on top of the saved activations at their peak (the output layer's
    /// logits and their gradients; the gradients an earlier backward pass made; ZeRO-3's
    /// gathered part; the embedding's fresh gradient).
    pub transient: f64,
    /// The most this rank holds at once: the parameters, optimizer state and buffers held
    /// throughout, and the larger of the passes' peak (activations, transient) and the
    /// update's (gradients, their averaging's buffers, the optimizer's temporaries).
    pub total: f64,
    /// One encoder layer's saved activations for one micro-batch (the Transformer).
    pub per_layer: Option<f64>,
    /// Encoder layers on this rank, and micro-batches of them held at once.
    pub layers: usize,
    pub micro_batches_held: usize,
}

/// Which attention kernel the forward pass runs, by what it saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attention {
    /// LibTorch's fused kernels (flash, memory-efficient): q, k, v, the output and the
    /// log-sum-exp; no scores.
    Fused,
    /// `scaled_dot_product_attention`'s math fallback, what LibTorch runs on the CPU with
    /// dropout: scaled copies of q and k (float32 ones of q, k and v under autocast), the
    /// softmax, the dropout mask and the dropped weights, `batch × heads × seq²` each.
    SdpaMath,
    /// Our own spelled-out attention with keyed dropout masks (pipelines and tensor-parallel
    /// stages with dropout): the scores' softmax, the mask and the dropped weights.
    Keyed,
}

/// Bytes one encoder layer saves for one micro-batch, per unit of each size: `T·d` (tokens ×
/// width; the part per tensor-parallel shard and the part every shard holds whole), `T·h`
/// (the feed-forward hidden units, per shard), `T·H` (heads, per shard), `b·H·s²` (attention
/// scores, per shard) and `T`; and under autocast the half-precision copies of the weights.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LayerCoefficients {
    td_sharded: f64,
    td_whole: f64,
    th: f64,
    t_heads: f64,
    scores: f64,
    t: f64,
    weight_copy_bytes: f64,
}

impl LayerCoefficients {
    /// The accounting of `EncoderLayer::forward_sharded`, operation by operation. `a`: bytes of
    /// a linear layer's output (4, or 2 under autocast); `c`: bytes of a linear layer's saved
    /// input (the float32 tensor itself, or its half-precision copy); `m`: a dropout mask's
    /// bytes per element (CUDA a byte; the CPU a float of the input's type). The layer's input
    /// counts here (as its projection saves it), its output in the next consumer.
    fn of(cuda: bool, mixed: bool, dropout: bool, attention: Attention) -> LayerCoefficients {
        let (a, c) = if mixed { (2.0, 2.0) } else { (4.0, 4.0) };
        let m = if !dropout {
            0.0
        } else if cuda {
            1.0
        } else {
            a
        };
        // Attention: the q/k/v projection's output, what the kernel saves, the output copy.
        let (qkv, scores, t_heads) = match attention {
            Attention::Fused => (3.0 * a, 0.0, 4.0),
            // Float32 scaled copies of q and k beside the projection (under autocast, float32
            // copies of all three instead); softmax, its mask and the dropped weights in float32.
            Attention::SdpaMath if mixed => (12.0, 8.0 + if cuda { 1.0 } else { 4.0 }, 0.0),
            Attention::SdpaMath => (3.0 * a + 8.0, 8.0 + if cuda { 1.0 } else { 4.0 }, 0.0),
            // q and k are views of the projection; the softmax (float32), the mask, and the
            // dropped weights as the product with v saves them (a half copy under autocast).
            Attention::Keyed => (3.0 * a, 4.0 + if cuda { 1.0 } else { 4.0 } + a, 0.0),
        };
        LayerCoefficients {
            td_sharded: qkv + a,
            // input, mask, norm1's input (float32), norm1's output as linear1 saves it, mask,
            // norm2's input (float32).
            td_whole: c + m + 4.0 + c + m + 4.0,
            // ReLU's output, the mask and the dropped units linear2 saves.
            th: a + if dropout { m + a } else { 0.0 },
            t_heads,
            scores,
            // Each layer norm's mean and reciprocal standard deviation.
            t: 16.0,
            weight_copy_bytes: if mixed { 2.0 } else { 0.0 },
        }
    }
}

/// What the estimate of a Transformer job needs.
#[derive(Debug, Clone)]
pub struct TransformerJob {
    pub config: TransformerConfig,
    pub bptt: i64,
    /// Sequences per batch on one replica.
    pub batch: i64,
    /// Micro-batches per batch (pipelines).
    pub chunks: usize,
    /// Batches accumulated per optimizer step.
    pub accumulate: usize,
    /// Sequence parallelism (`--sequence-parallel`): what every tensor-parallel shard holds
    /// whole between the layers (layer norms' inputs, dropout masks, the column-parallel
    /// layers' saved inputs, the activations between stages) is cut over the shards.
    pub sequence_parallel: bool,
    /// The replicas that average the gradients and divide ZeRO's state (ZeRO's N): all of them,
    /// or HSDP's shard group ([`crate::comm::layout::Layout::state_shards`]).
    pub state_shards: usize,
    /// The data-parallel replicas, all of them (HSDP: more than `state_shards`).
    pub replicas: usize,
    pub tp: usize,
    /// The stages and how they sit on devices (one device: the whole model, no pipeline).
    pub partition: Partition,
    pub placement: Placement,
    pub schedule: Schedule,
    pub checkpoint_activations: bool,
    /// Several stages as threads of one process on the same device (a pipeline started
    /// alone): one row for all of them.
    pub stages_share_a_device: bool,
    /// Keyed dropout masks (pipelines and tensor-parallel stages) rather than LibTorch's own.
    pub keyed_masks: bool,
    /// The data-parallel style: how it divides the model state, and what averaging holds.
    pub sync: GradientSync,
    /// Bytes of optimizer state per parameter (ZeRO's K).
    pub optimizer_k: f64,
    /// Bytes per element of the largest parameter that the optimizer's update allocates beside
    /// it ([`crate::memory::update_bytes_per_parameter`]).
    pub update_bytes_per_parameter: f64,
    /// `--bucket-mb` in bytes: how the replicas average the gradients.
    pub bucket_bytes: f64,
    pub precision: Precision,
    pub cuda: bool,
    /// `--loss-chunks`: the output layer and the loss computed this many chunks of the tokens
    /// at a time (the whole model on one rank): one chunk's logits at a time instead of the
    /// batch's float32 log-probabilities and their gradients.
    pub loss_chunks: Option<i64>,
}

impl TransformerJob {
    fn coefficients(&self) -> LayerCoefficients {
        let dropout = self.config.dropout > 0.0;
        let attention = match (dropout, self.keyed_masks, self.cuda) {
            (false, _, _) => Attention::Fused,
            (true, true, _) => Attention::Keyed,
            (true, false, false) => Attention::SdpaMath,
            (true, false, true) => Attention::Fused,
        };
        LayerCoefficients::of(self.cuda, self.precision != Precision::Full, dropout, attention)
    }

    /// One micro-batch's tokens (with sequence parallelism, each sequence padded to a multiple
    /// of the shards).
    fn micro_tokens(&self) -> f64 {
        (self.positions() * self.micro_sequences()) as f64
    }

    /// Positions per sequence: `bptt`, padded to a multiple of the shards with sequence
    /// parallelism.
    fn positions(&self) -> i64 {
        let tp = self.tp as i64;
        if self.sequence_parallel {
            (self.bptt + tp - 1) / tp * tp
        } else {
            self.bptt
        }
    }

    /// The share of what every shard would otherwise hold whole that one shard holds: 1/tp with
    /// sequence parallelism, 1 without (Korthikanti et al. 2022: the `10·sbh` of a layer's
    /// activations become `10·sbh/t`).
    fn whole_share(&self) -> f64 {
        if self.sequence_parallel {
            1.0 / self.tp as f64
        } else {
            1.0
        }
    }

    fn micro_sequences(&self) -> i64 {
        (self.batch as usize).div_ceil(self.chunks.max(1)) as i64
    }

    /// One layer's saved activations for one micro-batch on one tensor-parallel shard.
    pub fn per_layer_bytes(&self) -> f64 {
        let cfg = &self.config;
        let k = self.coefficients();
        let (t, d, h, heads, s, b, tp) = (
            self.micro_tokens(),
            cfg.d_model as f64,
            cfg.d_hid as f64,
            cfg.nhead as f64,
            self.positions() as f64,
            self.micro_sequences() as f64,
            self.tp as f64,
        );
        let layer_weights = (4.0 * d * d + 2.0 * d * h) / tp;
        (k.td_whole * t * d + k.t * t) * self.whole_share()
            + (k.td_sharded * t * d + k.th * t * h + k.t_heads * t * heads + k.scores * b * heads * s * s) / tp
            + k.weight_copy_bytes * layer_weights
    }

    /// Stage `stage`'s parameters on one tensor-parallel shard, as the model lists them (by
    /// name, [`crate::models::named_parameters`]'s order): each one's name and elements.
    /// Sharded: q/k/v rows and out_proj columns, linear1 rows, linear2 columns (with their
    /// biases where they are cut); whole on every shard: out_proj's and linear2's biases, the
    /// layer norms.
    pub fn stage_parameter_list(&self, stage: usize) -> Vec<(String, f64)> {
        let cfg = &self.config;
        let (v, d, h, tp) = (cfg.ntoken as f64, cfg.d_model as f64, cfg.d_hid as f64, self.tp as f64);
        let mut list = Vec::new();
        // The first stage holds the embedding, the last the output layer.
        let (first, last) = (0, self.partition.stages() - 1);
        if stage == first {
            list.push(("embedding.weight".to_string(), v * d / tp));
        }
        if stage == last {
            list.push(("linear.weight".to_string(), v * d / tp));
            list.push(("linear.bias".to_string(), v / tp));
        }
        let layer = [
            ("self_attn.in_proj_weight", 3.0 * d * d / tp),
            ("self_attn.in_proj_bias", 3.0 * d / tp),
            ("self_attn.out_proj.weight", d * d / tp),
            ("self_attn.out_proj.bias", d),
            ("linear1.weight", h * d / tp),
            ("linear1.bias", h / tp),
            ("linear2.weight", d * h / tp),
            ("linear2.bias", d),
            ("norm1.weight", d),
            ("norm1.bias", d),
            ("norm2.weight", d),
            ("norm2.bias", d),
        ];
        for i in self.partition.layers[stage].clone() {
            list.extend(layer.iter().map(|(name, n)| (format!("transformer_encoder.layers.{i}.{name}"), *n)));
        }
        list.sort_by(|a, b| a.0.cmp(&b.0));
        list
    }

    /// Parameters of stage `stage` on one tensor-parallel shard.
    pub fn stage_parameters(&self, stage: usize) -> f64 {
        self.stage_parameter_list(stage).iter().map(|(_, n)| n).sum()
    }

    /// The estimate for every device of the pipeline (one row per device, or one for all).
    pub fn estimate(&self) -> Vec<RankEstimate> {
        let devices = self.placement.devices;
        let rows: Vec<RankEstimate> = (0..devices).map(|device| self.device_estimate(device)).collect();
        if self.stages_share_a_device && rows.len() > 1 {
            return vec![sum_rows(&rows, "every stage, one process")];
        }
        rows
    }

    /// What the chunked output layer and loss hold beside what it saved (`--loss-chunks`, the
    /// whole model on one rank), as `torch_ext::chunked_linear_cross_entropy` makes its
    /// tensors; None without it.
    fn chunked_loss(&self) -> Option<ChunkedLoss> {
        let chunks = self.loss_chunks.filter(|_| self.tp == 1 && self.placement.stages() == 1)?;
        let (t, d, v) = (self.micro_tokens(), self.config.d_model as f64, self.config.ntoken as f64);
        let rows = (t / chunks.max(1) as f64).ceil();
        let chunk = rows * v;
        // `a`: bytes of the kind the products run in (autocast's or the weights').
        let (mixed, true_half) = (self.precision != Precision::Full, self.precision.weights_kind().is_some());
        let a = if mixed { 2.0 } else { 4.0 };
        Some(ChunkedLoss {
            forward: 8.0 * chunk,
            // Mixed: the products' logits beside their float32 copy, then the float32 gradient
            // beside its copy in `a`, then that copy beside the weight's product in `a` (summed
            // into float32); float32: one chunk, its gradient made in place, the weight's summed
            // in place.
            // The weight's product is summed into float32 in 8 blocks of the vocabulary (the
            // CPU's add of mixed kinds makes a float32 copy of each block's product).
            backward: if mixed { ((4.0 + a) * chunk).max(a * chunk + (a + 4.0) * v * d / WEIGHT_BLOCKS) } else { 4.0 * chunk },
            // Under autocast the products' copy of the weight, kept for the backward pass.
            saved_weight: if mixed && !true_half { a * v * d } else { 0.0 },
            hidden_grad: if true_half { 2.0 } else { 4.0 } * t * d,
        })
    }

    fn device_estimate(&self, device: usize) -> RankEstimate {
        let stages: Vec<usize> = self.placement.stages_of(device).collect();
        // The device's parameters in the order its ranks list them (the buckets' order).
        let params: Vec<(String, f64)> = stages.iter().flat_map(|&s| self.stage_parameter_list(s)).collect();
        let rank = RankModel {
            params: &params,
            state_shards: self.state_shards,
            replicas: self.replicas,
            bucket_bytes: self.bucket_bytes,
            update_bytes_per_parameter: self.update_bytes_per_parameter,
        };
        let psi = rank.psi();
        let style = self.sync.strategy();
        let state = style.model_state(psi, self.optimizer_k, self.state_shards as f64);
        let (parameters, gradients, optimizer) = (state.parameters, state.gradients, state.optimizer);
        // The token embedding's positional encoding (`[MAX_LEN, 1, d]`, float32, whole on every
        // shard), a buffer the stage holding the embedding keeps.
        let buffers = if stages.contains(&0) { 4.0 * crate::models::transformer::MAX_LEN as f64 * self.config.d_model as f64 } else { 0.0 };

        let bytes = self.micro_batch_bytes();
        let ops = if self.placement.stages() == 1 {
            vec![schedule::Op::forward(0, 0), schedule::Op::backward(0, 0)]
        } else {
            schedule::device_ops(self.schedule, self.placement, device, self.chunks)
        };
        let held = schedule::peak_live(&ops);
        let per_stage: f64 = stages.iter().map(|&s| bytes.stage(s)).sum::<f64>() / stages.len() as f64;
        let activations = held as f64 * per_stage;
        let activations_recomputed = (self.placement.stages() > 1).then(|| {
            let inputs: f64 = stages.iter().map(|&s| bytes.input(s)).sum::<f64>() / stages.len() as f64;
            held as f64 * inputs + per_stage
        });

        // How the style divides this rank's state (ZeRO's buckets), where it does; and where
        // it keeps the parameters sharded (ZeRO-3, HSDP), the output layer gathered for its
        // passes and reduced after its backward pass, counted here as the passes hold them
        // (the other parts' are counted in the update: `Costs::update_bytes`).
        let sharding = style.sharding(&rank);
        let gathered = sharding.filter(|_| style.parameters_sharded());
        let passes = self.passes_peak(&ops, &bytes, gathered, gradients);
        let transient = passes - activations.min(passes);

        // After the passes (the activations gone): averaging the gradients over the replicas
        // and the update, beside the gradients, as the style does them.
        let update = style.update_bytes(&rank, gradients);
        // Replicas that divide the state start from replica 0's model, before the first step
        // made any optimizer state.
        let startup = match sharding.filter(|_| self.replicas > 1) {
            Some(sharding) => sharding.startup(psi, buffers),
            None => 0.0,
        };
        let total = (buffers + parameters + optimizer + passes.max(update)).max(startup);
        RankEstimate {
            ranks: match (self.placement.devices, self.placement.virtual_stages) {
                (1, _) => "every rank".to_string(),
                (_, 1) => format!("stage {device}"),
                (_, _) => format!("device {device} (stages {})", stages.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ")),
            },
            parameters,
            gradients,
            optimizer,
            buffers,
            activations,
            activations_recomputed,
            transient,
            total,
            per_layer: Some(bytes.per_layer),
            layers: stages.iter().map(|&s| self.partition.layers[s].clone().count()).sum(),
            micro_batches_held: held,
        }
    }

    /// What one micro-batch leaves held through each stage: its layers, the embedding on
    /// stage 0, the output layer's saved log-probabilities on the last; what passes between
    /// stages held by the executor (a stage's output until its backward pass, and under
    /// autocast its float32 input beside the half copy the first layer keeps).
    fn micro_batch_bytes(&self) -> MicroBatchBytes<'_> {
        let cfg = &self.config;
        let (t, d, v, tp) = (self.micro_tokens(), cfg.d_model as f64, cfg.ntoken as f64, self.tp as f64);
        let mask = if cfg.dropout > 0.0 {
            if self.cuda {
                1.0
            } else {
                4.0
            }
        } else {
            0.0
        };
        // (Sequence parallel: the embedding's mask, the output layer's saved input and what
        // passes between stages are this shard's rows.)
        let rows = self.whole_share();
        // The loss's saved logits-sized tensors: the whole model's cross-entropy keeps its
        // log-probabilities; the vocabulary-parallel one (`tp::vocab_parallel_cross_entropy`)
        // keeps the exponentials and the shifted logits (`gather` saves its whole input).
        let logits_bytes = 4.0 * t * v / tp;
        let chunked = self.chunked_loss();
        MicroBatchBytes {
            partition: &self.partition,
            last: self.partition.stages() - 1,
            mixed: self.precision != Precision::Full,
            t,
            d,
            v,
            tp,
            rows,
            per_layer: self.per_layer_bytes(),
            embedding_saved: mask * t * d * rows + 8.0 * t,
            logits_bytes,
            loss_saved: match chunked {
                // The chunked loss keeps each token's log-sum-exp (float32), and under autocast
                // the weight's half-precision copy.
                Some(chunk) => 4.0 * t + chunk.saved_weight,
                None if self.tp > 1 => 2.0 * logits_bytes,
                None => logits_bytes,
            },
            chunked,
            // Its backward pass at its most, beside what it saved: the whole model's the
            // gradients of the log-probabilities and of the logits; the vocabulary-parallel
            // one's the exponentials' gradient, made after they are let go, and the gather's.
            loss_backward: if self.tp > 1 { logits_bytes } else { 2.0 * logits_bytes },
            // The output layer's fresh gradient (weight and bias): made beside the gradients
            // that earlier backward passes summed, while the other micro-batches' activations
            // are held.
            output_fresh_grad: 4.0 * (v * d + v) / tp,
            recompute: self.checkpoint_activations && self.placement.stages() > 1,
        }
    }

    /// The forward and backward passes' peak, op by op as the schedule runs them on this
    /// device: the activations of the micro-batches it holds, and at each op what the op itself
    /// holds on top of them at its most. Gradients are there once a backward pass of the step
    /// ran (or from the step's earlier batches when it accumulates). (From ZeRO-2 on,
    /// `whole_grads` is the block's gradient: the whole gradients go as their buckets are
    /// reduced.) `gathered`: the sharding of parameters gathered for the output layer's passes.
    fn passes_peak(&self, ops: &[schedule::Op], bytes: &MicroBatchBytes, gathered: Option<Sharding>, whole_grads: f64) -> f64 {
        let MicroBatchBytes { t, d, v, tp, rows, last, embedding_saved, logits_bytes, loss_saved, chunked, loss_backward, output_fresh_grad, .. } = *bytes;
        let embedding_grad = 4.0 * v * d / tp;
        let (mut live, mut backward_ran, mut passes) = (0.0, self.accumulate > 1, 0.0f64);
        for op in ops {
            let s = op.stage;
            let grads = if backward_ran { whole_grads } else { 0.0 };
            match op.direction {
                schedule::Direction::Forward => {
                    live += bytes.kept(s);
                    let mut at = live + grads;
                    if let Some(chunk) = chunked.filter(|_| s == last) {
                        // A chunk's float32 logits and the exponentials of its log-sum-exp.
                        at += chunk.forward;
                    }
                    if let Some(sharding) = gathered.filter(|_| s == last) {
                        // The output layer gathered for its forward pass (its logits not yet made).
                        at = at - loss_saved + sharding.gather((v * d + v) / tp);
                    }
                    passes = passes.max(at);
                }
                schedule::Direction::Backward => {
                    // Recomputation makes the stage's activations whole again for its backward pass.
                    let held_now = live - bytes.kept(s) + bytes.stage(s);
                    // The output layer's backward: the loss's saved tensors gone, the logits'
                    // gradient in their place.
                    let at_output_layer = held_now - loss_saved + logits_bytes;
                    let mut at = if let Some(chunk) = chunked.filter(|_| s == last) {
                        // The chunked loss's backward, all of it before the layers': the
                        // output layer's fresh gradients (float32 sums), the hidden states'
                        // gradient, and a chunk's logits made again with their gradient.
                        held_now + grads + output_fresh_grad + chunk.hidden_grad + chunk.backward
                    } else if s == last {
                        (held_now + grads + loss_backward).max(at_output_layer + grads + output_fresh_grad)
                    } else {
                        // The gradient received from the next stage and the product the
                        // backward pass starts from (`(output · grad).sum()`).
                        held_now + grads + 8.0 * t * d * rows
                    };
                    if let Some(sharding) = gathered.filter(|_| s == last) {
                        // The output layer gathered again for its backward pass, the gradient
                        // of the logits in place of the log-probabilities; then its part
                        // reduced, the logits' gradient gone: the part's parameters and whole
                        // gradients, the part flattened, this rank's slice, the block's gradient.
                        let part = (v * d + v) / tp;
                        at = at.max(at_output_layer + grads + sharding.gather(part));
                        at = at.max(at_output_layer - logits_bytes + sharding.reduce(part) + 8.0 * part);
                    }
                    if s == 0 {
                        // The embedding's backward, the other layers' activations of this
                        // micro-batch gone: a fresh gradient of the embedding's weight beside
                        // those summed by earlier backward passes (or, in the first, the
                        // gradients of this stage's layers made just before).
                        let rest = live - bytes.kept(s) + embedding_saved;
                        let fresh = if backward_ran { whole_grads + embedding_grad } else { whole_grads };
                        at = at.max(rest + fresh);
                    }
                    passes = passes.max(at);
                    live -= bytes.kept(s);
                    backward_ran = true;
                }
            }
        }
        passes
    }
}

/// What the chunked output layer and loss holds at its most beside what it saved, in bytes
/// ([`TransformerJob::chunked_loss`]).
#[derive(Debug, Clone, Copy)]
struct ChunkedLoss {
    /// The forward pass: a chunk's float32 logits and their exponentials.
    forward: f64,
    /// The backward pass: a chunk's logits made again and their gradient (beyond the output
    /// layer's gradients and the hidden states').
    backward: f64,
    /// The hidden states' gradient (the kind of the hidden states).
    hidden_grad: f64,
    /// The weight's copy in the products' kind that the backward pass reads (under autocast).
    saved_weight: f64,
}

/// Blocks of the vocabulary the chunked loss sums the weight's gradient in (`kWeightBlocks` in
/// `csrc/torch_ext.cpp`).
const WEIGHT_BLOCKS: f64 = 8.0;

/// One micro-batch's bytes on a device ([`TransformerJob::micro_batch_bytes`]): what each stage
/// holds of it, and what the loss and the output layer make beside it.
#[derive(Clone, Copy)]
struct MicroBatchBytes<'a> {
    partition: &'a Partition,
    last: usize,
    mixed: bool,
    /// Tokens, the model's width, the vocabulary, the shards, and the share of the rows a
    /// shard holds between its layers (sequence parallelism).
    t: f64,
    d: f64,
    v: f64,
    tp: f64,
    rows: f64,
    per_layer: f64,
    embedding_saved: f64,
    logits_bytes: f64,
    loss_saved: f64,
    /// `--loss-chunks`: what the chunked output layer and loss hold beside what they saved.
    chunked: Option<ChunkedLoss>,
    loss_backward: f64,
    output_fresh_grad: f64,
    /// Activations recomputed: a held micro-batch keeps its stage input only.
    recompute: bool,
}

impl MicroBatchBytes<'_> {
    /// What stage `s` holds of the micro-batch until its backward pass.
    fn stage(&self, s: usize) -> f64 {
        let (t, d, rows) = (self.t, self.d, self.rows);
        let layers = self.partition.layers[s].clone().count() as f64;
        let mut bytes = layers * self.per_layer;
        if s == 0 {
            bytes += self.embedding_saved;
        } else if self.mixed {
            bytes += 4.0 * t * d * rows;
        }
        if s == self.last {
            bytes += (if self.mixed { 2.0 } else { 4.0 }) * t * d * rows + self.loss_saved + 8.0 * t;
        } else {
            bytes += 4.0 * t * d * rows;
        }
        bytes
    }

    /// The stage's input alone (the tokens on stage 0), what recomputation keeps.
    fn input(&self, s: usize) -> f64 {
        if s == 0 {
            8.0 * self.t
        } else {
            4.0 * self.t * self.d * self.rows
        }
    }

    /// What a micro-batch waiting for its backward pass keeps of stage `s`.
    fn kept(&self, s: usize) -> f64 {
        if self.recompute {
            self.input(s)
        } else {
            self.stage(s)
        }
    }
}

/// Several rows as one (stages sharing a device), their largest phases added.
fn sum_rows(rows: &[RankEstimate], name: &str) -> RankEstimate {
    let sum = |f: fn(&RankEstimate) -> f64| rows.iter().map(f).sum::<f64>();
    RankEstimate {
        ranks: name.to_string(),
        parameters: sum(|r| r.parameters),
        gradients: sum(|r| r.gradients),
        optimizer: sum(|r| r.optimizer),
        buffers: sum(|r| r.buffers),
        activations: sum(|r| r.activations),
        activations_recomputed: rows.iter().map(|r| r.activations_recomputed).sum(),
        transient: rows.iter().map(|r| r.transient).fold(0.0, f64::max),
        total: sum(|r| r.total),
        per_layer: rows[0].per_layer,
        layers: rows.iter().map(|r| r.layers).sum(),
        micro_batches_held: rows.iter().map(|r| r.micro_batches_held).max().unwrap_or(0),
    }
}

/// What an image classifier's estimate needs: the model (parameters, its largest parameter's
/// elements, the bytes per image at its passes' peak, [`probe_image_activations`]), how it
/// trains, and the input batches its loader holds on the device at once.
#[derive(Debug, Clone)]
pub struct ImageJob {
    /// Trained parameters (elements).
    pub params: f64,
    /// Frozen parameters (`--freeze`, `--train-last`): held, without gradients or optimizer state.
    pub frozen_params: f64,
    pub largest_parameter: f64,
    pub bytes_per_image: f64,
    pub batch: usize,
    /// As [`TransformerJob::state_shards`].
    pub state_shards: usize,
    /// As [`TransformerJob::sync`].
    pub sync: GradientSync,
    pub optimizer_k: f64,
    /// `--bucket-mb` in bytes.
    pub bucket_bytes: f64,
    /// Bytes of one batch's inputs and targets as the model reads them.
    pub input_batch_bytes: f64,
    pub batches_held: usize,
}

impl ImageJob {
    pub fn estimate(&self) -> RankEstimate {
        let style = self.sync.strategy();
        let state = style.model_state(self.params, self.optimizer_k, self.state_shards as f64);
        let (gradients, optimizer) = (state.gradients, state.optimizer);
        let parameters = state.parameters + 4.0 * self.frozen_params;
        let activations = self.batch as f64 * self.bytes_per_image;
        let mut transient = self.batches_held as f64 * self.input_batch_bytes;
        if style.parameters_sharded() {
            // The parts gathered for the passes (ZeRO-3, HSDP).
            transient += 2.0 * 4.0 * self.params;
        }
        // The backward pass meets the last layers first, where a convolutional network keeps
        // most of its weights and fewest activations: their gradients appear while the first
        // layers' activations are still held, so count both.
        // Averaging the gradients over several replicas: what the style's holds beside them.
        let averaging = if self.state_shards > 1 { style.averaging_bytes(self.params, self.bucket_bytes) } else { 0.0 };
        let update = averaging.max(2.0 * 4.0 * self.largest_parameter);
        let total = parameters + optimizer + gradients + (activations + transient).max(update);
        RankEstimate {
            ranks: "every rank".into(),
            parameters,
            gradients,
            optimizer,
            buffers: 0.0,
            activations,
            activations_recomputed: None,
            transient,
            total,
            per_layer: None,
            layers: 0,
            micro_batches_held: 1,
        }
    }
}

/// An image model's size and the memory its training passes take per image, measured on the
/// CPU: the model built, then forward and backward passes of 8 and of 16 images, each from no
/// gradients (as every step starts); the difference of their peaks (over the bytes held before)
/// is what 8 more images take at the passes' peak: their saved activations and the gradients
/// flowing back. (Where the gradients of the weights make the peak at both sizes, the
/// activations the forward pass keeps are the floor.) Blocks `trainable` leaves frozen are
/// frozen in the probe too: they save nothing for a backward pass that does not reach them.
pub fn probe_image_activations(spec: &crate::models::ModelSpec, trainable: crate::models::Trainable, precision: Precision) -> anyhow::Result<ImageProbe> {
    use tch::{Device, Kind, Tensor};
    crate::memory::count_cpu_tensors()?;
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let model = crate::models::build(&vs.root(), spec);
    crate::models::freeze(&vs, &crate::models::Blocks::of(spec), trainable, spec.arch.name())?;
    // Those still requiring gradients (tch's trainable_variables lists the frozen ones too).
    let params: Vec<Tensor> = crate::models::named_parameters(&vs).into_iter().map(|(_, p)| p).collect();
    let all_params = crate::models::param_count(&vs) as f64;
    // Mixed precision probes with bfloat16, which the CPU's autocast runs.
    let probe = if precision == Precision::Full { Precision::Full } else { Precision::BHalf };
    // (bytes held after the forward pass, peak of forward and backward), over those before.
    let passes = |images: i64| -> anyhow::Result<(f64, f64)> {
        for p in &params {
            crate::torch_ext::clear_grad(p)?;
        }
        let inputs = Tensor::zeros([images, spec.in_channels, spec.image_size, spec.image_size], (Kind::Float, Device::Cpu));
        let targets = Tensor::zeros([images], (Kind::Int64, Device::Cpu));
        let before = crate::torch_ext::cpu_memory()?.current;
        crate::torch_ext::reset_cpu_memory_peak()?;
        let loss =
            crate::precision::autocast(probe, Device::Cpu, || tch::nn::ModuleT::forward_t(model.as_ref(), &inputs, true).cross_entropy_for_logits(&targets));
        let after_forward = crate::torch_ext::cpu_memory()?.current;
        loss.f_backward()?;
        let peak = crate::torch_ext::cpu_memory()?.peak;
        Ok(((after_forward - before) as f64, (peak - before) as f64))
    };
    let (small, large) = (passes(50)?, passes(100)?);
    let per_image = ((large.1 - small.1) / 50.0).max((large.0 - small.0) / 50.0).max(0.0);
    for p in &params {
        crate::torch_ext::clear_grad(p)?;
    }
    let trained: f64 = params.iter().map(|p| p.numel() as f64).sum();
    let largest = params.iter().map(|p| p.numel() as f64).fold(0.0, f64::max);
    Ok(ImageProbe { trained, frozen: all_params - trained, largest_parameter: largest, bytes_per_image: per_image })
}

/// What [`probe_image_activations`] measured: parameters trained and frozen (elements), the
/// largest trained parameter's elements, and the bytes per image at the passes' peak.
#[derive(Debug, Clone, Copy)]
pub struct ImageProbe {
    pub trained: f64,
    pub frozen: f64,
    pub largest_parameter: f64,
    pub bytes_per_image: f64,
}

/// The estimate as a Markdown table (MiB), one row per kind of rank.
pub fn table(rows: &[RankEstimate]) -> String {
    let mib = |b: f64| format!("{:.1}", b / MIB);
    let recompute = rows.iter().any(|r| r.activations_recomputed.is_some());
    let mut out = String::from("| ranks | parameters | gradients | optimizer | activations |");
    if recompute {
        out += " activations recomputed |";
    }
    out += " transient | buffers | total (MiB) |\n|---|---:|---:|---:|---:|";
    if recompute {
        out += "---:|";
    }
    out += "---:|---:|---:|\n";
    for r in rows {
        out += &format!("| {} | {} | {} | {} | {} |", r.ranks, mib(r.parameters), mib(r.gradients), mib(r.optimizer), mib(r.activations));
        if recompute {
            out += &format!(" {} |", r.activations_recomputed.map_or("-".into(), mib));
        }
        out += &format!(" {} | {} | {} |\n", mib(r.transient), mib(r.buffers), mib(r.total));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(dropout: f64) -> TransformerJob {
        TransformerJob {
            config: TransformerConfig { ntoken: 1000, d_model: 128, nhead: 2, d_hid: 256, nlayers: 4, dropout },
            bptt: 35,
            batch: 20,
            chunks: 1,
            accumulate: 1,
            sequence_parallel: false,
            state_shards: 1,
            replicas: 1,
            tp: 1,
            partition: Partition::even(4, 1).unwrap(),
            placement: Placement::one_stage_each(1),
            schedule: Schedule::GPipe,
            checkpoint_activations: false,
            stages_share_a_device: false,
            keyed_masks: false,
            sync: GradientSync::Ddp,
            optimizer_k: 8.0,
            update_bytes_per_parameter: 0.0,
            bucket_bytes: 25.0 * MIB,
            precision: Precision::Full,
            cuda: false,
            loss_chunks: None,
        }
    }

    #[test]
    fn a_layer_saves_what_torch_saves() {
        // torch.autograd.graph.saved_tensors_hooks over nn.TransformerEncoderLayer(128, 2, 256)
        // at 35 × 20 tokens on the CPU (PyTorch 2.11), the layer's input included, its weights
        // not: 7,050,400 bytes with dropout 0.2 (the math attention), 3,600,800 without (the
        // fused one). Training measured the same per layer, to 0.1% (the peak with 1 and 2 layers).
        assert_eq!(job(0.2).per_layer_bytes(), 7_050_400.0);
        assert_eq!(job(0.0).per_layer_bytes(), 3_600_800.0);
        // Under CPU autocast (bfloat16): 4,362,400 bytes of activations and 262,144 of weight
        // copies with dropout; 2,167,200 and 262,144 without (weights: 4d² + 2dh halves).
        let mixed = |p| TransformerJob { precision: Precision::BHalf, ..job(p) };
        assert_eq!(mixed(0.2).per_layer_bytes(), 4_362_400.0 + 262_144.0);
        assert_eq!(mixed(0.0).per_layer_bytes(), 2_167_200.0 + 262_144.0);
        // Our keyed attention (a pipeline with dropout) keeps q and k as views: 2·4·T·d less.
        let keyed = TransformerJob { keyed_masks: true, ..job(0.2) };
        assert_eq!(keyed.per_layer_bytes(), 7_050_400.0 - 2.0 * 4.0 * 700.0 * 128.0);
        // Tensor parallelism cuts the heads' and hidden units' part, not the layer norms'.
        let halves = TransformerJob { tp: 2, ..job(0.0) };
        assert!(halves.per_layer_bytes() > job(0.0).per_layer_bytes() / 2.0 && halves.per_layer_bytes() < job(0.0).per_layer_bytes());
        // Sequence parallelism cuts the rest (Korthikanti et al.: sbh(10 + 24/t) → 34·sbh/t):
        // with dropout (keyed masks) at 36 tokens (35 padded for 2 shards) per sequence, the
        // whole part — input 4, mask 4, norm1 input 4, linear1 input 4, mask 4, norm2 input 4
        // bytes per T·d, and the norms' statistics 16 per T — is halved.
        let tensor = TransformerJob { tp: 2, keyed_masks: true, bptt: 36, ..job(0.2) };
        let sequence = TransformerJob { sequence_parallel: true, bptt: 35, ..tensor.clone() };
        let (t, d) = (36.0 * 20.0, 128.0);
        assert_eq!(tensor.per_layer_bytes() - sequence.per_layer_bytes(), (24.0 * t * d + 16.0 * t) / 2.0);
    }

    #[test]
    fn schedules_hold_what_they_run_ahead() {
        let pipeline = |schedule, chunks| TransformerJob {
            chunks,
            schedule,
            batch: 32,
            partition: Partition::even(4, 4).unwrap(),
            placement: Placement::one_stage_each(4),
            keyed_masks: true,
            ..job(0.2)
        };
        let gpipe = pipeline(Schedule::GPipe, 8).estimate();
        let one_f_one_b = pipeline(Schedule::OneFOneB, 8).estimate();
        assert_eq!(gpipe.iter().map(|r| r.micro_batches_held).collect::<Vec<_>>(), [8, 8, 8, 8]);
        assert_eq!(one_f_one_b.iter().map(|r| r.micro_batches_held).collect::<Vec<_>>(), [4, 3, 2, 1]);
        assert!(one_f_one_b[0].activations < gpipe[0].activations);
        // Recomputing keeps inputs only: far less than the layers' activations.
        let recomputed = gpipe[1].activations_recomputed.unwrap();
        assert!(recomputed < gpipe[1].activations / 3.0, "{recomputed} vs {}", gpipe[1].activations);
        let table = table(&gpipe);
        assert!(table.contains("| stage 3 |") && table.contains("activations recomputed"), "{table}");
    }

    #[test]
    fn zero_and_tensor_parallelism_shrink_the_model_state() {
        let plain = job(0.0).estimate()[0].clone();
        let zero3 = TransformerJob { state_shards: 4, sync: GradientSync::zero(3), ..job(0.0) }.estimate()[0].clone();
        assert!((zero3.parameters + zero3.gradients + zero3.optimizer - (plain.parameters + plain.gradients + plain.optimizer) / 4.0).abs() < 1.0);
        let tp2 = TransformerJob { tp: 2, ..job(0.0) }.estimate()[0].clone();
        assert!(tp2.parameters < 0.6 * plain.parameters && tp2.parameters > 0.45 * plain.parameters);
    }
}
