//! The Transformer language model: parameter count and names, the causal mask, dropout, the
//! piecewise (pipeline) API, and numerical parity with PyTorch.
//!
//! The parity tests run `tests/reference/transformer_parity.py` with the Python in
//! `$TORCH_PYTHON` (set by `scripts/with-torch`), which builds the tutorial's model with
//! `torch.nn` and writes its weights (by `state_dict` name), inputs and outputs to an `.npz`; the
//! weights are loaded here by name and the outputs compared. Comparisons are relative to the
//! reference's scale: `max |ours − torch| / max |torch| ≤ 1e-5`.

mod support;

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};
use support::Reference;

use common::models::{named_parameters, param_count, param_count_formula, EncoderLayer, TransformerConfig, TransformerLm};
use common::optim::{clip_grad_norm, Optimizer, Sgd, SgdConfig};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};

const TOLERANCE: f64 = 1e-5;

/// Serialises the tests' use of LibTorch's global random generator. Tests run in parallel
/// threads, and a test that reseeds the generator and expects a given sequence of draws (the
/// dropout tests) would otherwise see another test's model initialisation take draws in between;
/// so every test that draws random numbers holds this lock while it does.
fn exclusive_rng() -> MutexGuard<'static, ()> {
    static RNG: Mutex<()> = Mutex::new(());
    // A test that failed while holding the lock leaves nothing inconsistent behind.
    RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The reference script's models: V 50, d 32, 4 heads, d_hid 64, 2 layers.
fn small(dropout: f64) -> TransformerConfig {
    TransformerConfig { ntoken: 50, d_model: 32, nhead: 4, d_hid: 64, nlayers: 2, dropout }
}

fn build(cfg: &TransformerConfig) -> (nn::VarStore, TransformerLm) {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = TransformerLm::new(&vs.root(), cfg).unwrap();
    (vs, model)
}

fn tokens(cfg: &TransformerConfig, seq_len: i64, batch: i64) -> Tensor {
    Tensor::randint(cfg.ntoken, [seq_len, batch], (Kind::Int64, Device::Cpu))
}

fn eval(model: &impl ModuleT, xs: &Tensor) -> Tensor {
    tch::no_grad(|| model.forward_t(xs, false))
}

/// `max |a − b| / max |b|`: the largest difference relative to the reference's scale (an
/// element-wise ratio would blow up on outputs that happen to be near zero).
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let scale = b.abs().max().double_value(&[]).max(1e-30);
    (a - b).abs().max().double_value(&[]) / scale
}

// --- parameters -------------------------------------------------------------------------------

#[test]
fn param_count_formula_gives_the_course_figures() {
    // The course's model: 2049·V + 18,905,088 (d_model = d_hid = 1024, 3 layers).
    for v in [1, 50, 10_000, 28_782, 33_278] {
        assert_eq!(param_count_formula(&TransformerConfig::course(v)), 2049 * v + 18_905_088, "V = {v}");
    }
    assert_eq!(param_count_formula(&TransformerConfig::course(28_782)), 77_879_406);
    // The large variant of the exercise, by formula only (1.4 B parameters would need 5.8 GB).
    let large = TransformerConfig { d_model: 4096, d_hid: 4096, nhead: 16, nlayers: 12, ..TransformerConfig::course(28_782) };
    assert_eq!(param_count_formula(&large), 1_444_261_998);
}

#[test]
fn built_models_have_the_formulas_parameters_and_no_buffers() {
    let _rng = exclusive_rng();
    let configs = [
        small(0.1),
        TransformerConfig { ntoken: 7, d_model: 12, nhead: 3, d_hid: 5, nlayers: 1, dropout: 0.0 },
        TransformerConfig { ntoken: 1000, d_model: 64, nhead: 8, d_hid: 256, nlayers: 4, dropout: 0.5 },
        // The course's model itself (78 M parameters, 0.3 GB).
        TransformerConfig::course(28_782),
    ];
    for cfg in configs {
        let (vs, _model) = build(&cfg);
        assert_eq!(param_count(&vs), param_count_formula(&cfg), "{cfg:?}");
        // The positional encoding is not a variable: the store holds the parameters only.
        assert_eq!(vs.variables().len() as i64, 3 + 12 * cfg.nlayers, "{cfg:?}");
        assert_eq!(vs.trainable_variables().len(), vs.variables().len());
    }
}

#[test]
fn variables_have_torchs_names_and_shapes() {
    let _rng = exclusive_rng();
    let cfg = small(0.1);
    let (vs, _model) = build(&cfg);
    let (d, h, v) = (cfg.d_model, cfg.d_hid, cfg.ntoken);
    let mut expected: Vec<(String, Vec<i64>)> =
        vec![("embedding.weight".into(), vec![v, d]), ("linear.weight".into(), vec![v, d]), ("linear.bias".into(), vec![v])];
    for i in 0..cfg.nlayers {
        let layer = [
            ("self_attn.in_proj_weight", vec![3 * d, d]),
            ("self_attn.in_proj_bias", vec![3 * d]),
            ("self_attn.out_proj.weight", vec![d, d]),
            ("self_attn.out_proj.bias", vec![d]),
            ("linear1.weight", vec![h, d]),
            ("linear1.bias", vec![h]),
            ("linear2.weight", vec![d, h]),
            ("linear2.bias", vec![d]),
            ("norm1.weight", vec![d]),
            ("norm1.bias", vec![d]),
            ("norm2.weight", vec![d]),
            ("norm2.bias", vec![d]),
        ];
        expected.extend(layer.into_iter().map(|(n, s)| (format!("transformer_encoder.layers.{i}.{n}"), s)));
    }
    expected.sort();
    let mut actual: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
    actual.sort();
    assert_eq!(actual, expected);
}

#[test]
fn initialisation_follows_torch() {
    let _rng = exclusive_rng();
    let cfg = TransformerConfig { nlayers: 3, ..small(0.1) };
    let (vs, _model) = build(&cfg);
    let vars = vs.variables();
    let var = |name: &str| &vars[name];
    let bound = |t: &Tensor| t.abs().max().double_value(&[]);
    // The tutorial's init_weights.
    assert!(bound(var("embedding.weight")) <= 0.1);
    assert!(bound(var("linear.weight")) <= 0.1);
    assert_eq!(bound(var("linear.bias")), 0.0);
    // MultiheadAttention: Xavier-uniform packed projection (bound √(6 / 4d)), zero biases;
    // layer norms weight 1, bias 0.
    let xavier = (6.0 / (4 * cfg.d_model) as f64).sqrt();
    let in_proj = var("transformer_encoder.layers.0.self_attn.in_proj_weight");
    assert!(bound(in_proj) <= xavier && bound(in_proj) > 0.9 * xavier);
    for name in ["self_attn.in_proj_bias", "self_attn.out_proj.bias", "norm1.bias"] {
        assert_eq!(bound(var(&format!("transformer_encoder.layers.0.{name}"))), 0.0);
    }
    let norm_weight = var("transformer_encoder.layers.1.norm2.weight");
    assert!(norm_weight.eq(1.0).all().int64_value(&[]) == 1);
    // nn.TransformerEncoder deep-copies one layer: all layers start equal.
    for (name, t) in &vars {
        if let Some(rest) = name.strip_prefix("transformer_encoder.layers.0.") {
            for i in 1..cfg.nlayers {
                let other = var(&format!("transformer_encoder.layers.{i}.{rest}"));
                assert!(t.equal(other), "layer {i}'s {rest} differs from layer 0's");
            }
        }
    }
}

// --- behaviour --------------------------------------------------------------------------------

#[test]
fn causal_mask_hides_later_tokens() {
    let _rng = exclusive_rng();
    tch::manual_seed(1);
    let cfg = TransformerConfig { ntoken: 30, ..small(0.1) };
    let (_vs, model) = build(&cfg);
    let (seq_len, batch) = (9, 2);
    let src = tokens(&cfg, seq_len, batch);
    let out = eval(&model, &src);
    assert_eq!(out.size(), [seq_len, batch, cfg.ntoken]);
    for t in [0, 4, seq_len - 1] {
        // Change the token at position t of sequence 0.
        let changed = src.copy();
        let old = changed.int64_value(&[t, 0]);
        let _ = changed.get(t).get(0).fill_((old + 1) % cfg.ntoken);
        let out2 = eval(&model, &changed);
        let seq0 = |o: &Tensor| o.select(1, 0);
        assert!(seq0(&out).narrow(0, 0, t).equal(&seq0(&out2).narrow(0, 0, t)), "changing token {t} changed an output before it");
        assert!(!seq0(&out).get(t).allclose(&seq0(&out2).get(t), 1e-4, 1e-6, false), "changing token {t} did not change the output at {t}");
        // The other sequence of the batch is untouched.
        assert!(out.select(1, 1).equal(&out2.select(1, 1)));
    }
}

#[test]
fn dropout_acts_in_training_mode_only() {
    let _rng = exclusive_rng();
    tch::manual_seed(2);
    let cfg = small(0.3);
    let (_vs, model) = build(&cfg);
    let src = tokens(&cfg, 6, 3);
    let train = |seed| {
        tch::manual_seed(seed);
        tch::no_grad(|| model.forward_t(&src, true))
    };
    let (a, b) = (train(10), train(11));
    assert!(!a.allclose(&b, 1e-4, 1e-6, false), "two dropout masks gave the same output");
    // The same seed draws the same masks.
    assert!(train(10).equal(&a));
    let (e1, e2) = (eval(&model, &src), eval(&model, &src));
    assert!(e1.equal(&e2), "evaluation is not deterministic");
    assert!(!e1.allclose(&a, 1e-4, 1e-6, false));
    // Without dropout, training mode computes what evaluation does.
    let (_vs, no_dropout) = build(&small(0.0));
    let train_mode = tch::no_grad(|| no_dropout.forward_t(&src, true));
    assert!(rel_diff(&train_mode, &eval(&no_dropout, &src)) <= TOLERANCE);
}

#[test]
fn stage_by_stage_forward_equals_forward() {
    let _rng = exclusive_rng();
    tch::manual_seed(3);
    let cfg = TransformerConfig { nlayers: 3, ..small(0.1) };
    let (_vs, model) = build(&cfg);
    let src = tokens(&cfg, 7, 2);
    let staged = tch::no_grad(|| {
        let mut h = model.embed(&src, false);
        assert_eq!(h.size(), [7, 2, cfg.d_model]);
        assert_eq!(model.layers().len() as i64, cfg.nlayers);
        for layer in model.layers() {
            h = layer.forward_t(&h, false);
        }
        model.decode(&h)
    });
    assert!(staged.equal(&eval(&model, &src)));
}

#[test]
fn rejects_heads_that_do_not_divide_d_model() {
    // A usage error from the constructor (the configuration checks itself), not a panic.
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = TransformerConfig { nhead: 5, ..small(0.0) };
    let err = TransformerLm::new(&vs.root(), &cfg).unwrap_err();
    assert!(err.to_string().contains("--emsize 32 must be divisible by --nhead 5"), "{err}");
    assert!(cfg.validate().is_err() && small(0.0).validate().is_ok());
    let odd = TransformerConfig { d_model: 33, nhead: 3, ..small(0.0) };
    assert!(odd.validate().unwrap_err().to_string().contains("must be even"));
    let dropout = TransformerConfig { dropout: 1.0, ..small(0.0) };
    assert!(dropout.validate().unwrap_err().to_string().contains("--dropout must be in [0, 1)"));
}

// --- parity with PyTorch ----------------------------------------------------------------------

/// Copies the reference's `param.<name>` tensors into the variables of `vs`, after checking
/// that both have exactly the same names (torch's `named_parameters`) and shapes.
fn load_params(reference: &Reference, vs: &nn::VarStore) {
    let params = reference.with_prefix("param.");
    let vars = vs.variables();
    assert_eq!(vars.keys().collect::<BTreeSet<_>>(), params.keys().collect::<BTreeSet<_>>(), "variable names differ from torch's");
    tch::no_grad(|| {
        for (name, var) in &vars {
            let src = params[name];
            assert_eq!(src.kind(), Kind::Float, "{name}");
            assert_eq!(var.size(), src.size(), "{name}");
            var.shallow_clone().copy_(src);
        }
    });
}

#[test]
fn encoder_layer_matches_torch() {
    let reference = Reference::compute("transformer_parity.py", &["layer"]);
    let _rng = exclusive_rng();
    let cfg = TransformerConfig { dropout: 0.1, ..small(0.1) };
    let vs = nn::VarStore::new(Device::Cpu);
    let layer = EncoderLayer::new(&vs.root(), &cfg).unwrap();
    load_params(&reference, &vs);
    let x = reference.get("x");
    let ours = eval(&layer, x);
    // The layer as nn.TransformerEncoder calls it (is_causal), with the explicit -inf mask,
    // and eval mode's fused kernel with and without the fast path enabled.
    for path in ["causal_hint", "float_mask", "fastpath", "no_fastpath"] {
        let theirs = reference.get(&format!("out.{path}"));
        let diff = rel_diff(&ours, theirs);
        eprintln!("encoder layer vs torch ({path}): max relative difference {diff:e}");
        assert!(diff <= TOLERANCE, "{path}: relative difference {diff:e}");
    }
}

#[test]
fn model_logits_match_torch() {
    let reference = Reference::compute("transformer_parity.py", &["model"]);
    let _rng = exclusive_rng();
    let (vs, model) = build(&small(0.2));
    load_params(&reference, &vs);
    let logits = eval(&model, reference.get("src"));
    let diff = rel_diff(&logits, reference.get("logits"));
    eprintln!("model logits vs torch: max relative difference {diff:e}");
    assert!(diff <= TOLERANCE, "logits differ by {diff:e} (relative)");

    // The positional encoding equals torch's buffer: with a zero embedding, `embed` returns it.
    let pe = reference.get("buffer.pos_encoder.pe");
    tch::no_grad(|| {
        let _ = vs.variables()["embedding.weight"].shallow_clone().zero_();
    });
    let max_len = pe.size()[0];
    let positions = tch::no_grad(|| model.embed(&Tensor::zeros([max_len, 1], (Kind::Int64, Device::Cpu)), false));
    let pe_diff = rel_diff(&positions, pe);
    eprintln!("positional encoding vs torch's buffer: max relative difference {pe_diff:e}");
    assert!(pe_diff <= TOLERANCE);
}

/// Trains the reference's initial weights for its 10 steps as the course does (SGD lr 5.0,
/// gradients clipped to norm 0.5, cross-entropy on the next tokens) and compares each step's
/// loss and gradient norm, and the final weights, with torch's run `run` (`plain` or `dropout`).
fn check_training(reference: &Reference, run: &str, dropout: f64) {
    const STEPS: i64 = 10;
    const BPTT: i64 = 8;
    const MAX_NORM: f64 = 0.5;
    /// The seed the script gives `torch.manual_seed` just before training.
    const TRAIN_SEED: i64 = 1;
    let _rng = exclusive_rng();
    let cfg = small(dropout);
    let (vs, model) = build(&cfg);
    load_params(reference, &vs);
    let params = named_parameters(&vs);
    // Clip in torch's `model.parameters()` order, so that the total norm sums the same way.
    let order = reference.with_prefix("order.");
    let mut ordered: Vec<&(String, Tensor)> = params.iter().collect();
    ordered.sort_by_key(|(name, _)| order[name].int64_value(&[]));
    let tensors: Vec<Tensor> = ordered.iter().map(|(_, t)| t.shallow_clone()).collect();
    let mut opt = Sgd::new(params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), SgdConfig { lr: 5.0, ..Default::default() });

    // tch and the script share LibTorch's CPU generator: the same seed draws the same dropout
    // masks if the model applies dropout at the same places in the same order.
    tch::manual_seed(TRAIN_SEED);
    let data = reference.get("data");
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let i = step * BPTT;
        let inputs = data.narrow(0, i, BPTT);
        let targets = data.narrow(0, i + 1, BPTT).reshape([-1]);
        opt.zero_grad();
        let logits = model.forward_t(&inputs, true);
        let loss = logits.view([-1, cfg.ntoken]).cross_entropy_loss::<Tensor>(&targets, None, Reduction::Mean, -100, 0.0);
        loss.backward();
        norms.push(clip_grad_norm(&tensors, MAX_NORM));
        opt.step().unwrap();
        losses.push(loss.double_value(&[]));
    }

    let torch_losses = reference.get(&format!("loss.{run}"));
    for (step, &ours) in losses.iter().enumerate() {
        let theirs = torch_losses.double_value(&[step as i64]);
        assert!((ours - theirs).abs() <= TOLERANCE * theirs.abs(), "{run}: step {step}: loss {ours} here, {theirs} with torch");
    }
    let loss_diff = rel_diff(&Tensor::from_slice(&losses), torch_losses);
    let norm_diff = rel_diff(&Tensor::from_slice(&norms), reference.get(&format!("grad_norm.{run}")));
    assert!(norm_diff <= TOLERANCE, "{run}: gradient norms differ by {norm_diff:e}");
    let finals = reference.with_prefix(&format!("final.{run}."));
    let mut weight_diff = 0.0f64;
    for (name, ours) in &params {
        let diff = rel_diff(ours, finals[name]);
        assert!(diff <= TOLERANCE, "{run}: final `{name}` differs by {diff:e}");
        weight_diff = weight_diff.max(diff);
    }
    eprintln!(
        "training vs torch ({run}, dropout {dropout}), {STEPS} SGD steps: losses {:.4} → {:.4}; \
         max relative difference: losses {loss_diff:e}, gradient norms {norm_diff:e}, \
         final weights {weight_diff:e}",
        losses[0],
        losses[losses.len() - 1]
    );
}

#[test]
fn training_matches_torch() {
    let reference = Reference::compute("transformer_parity.py", &["train"]);
    // Deterministic, as the task demands.
    check_training(&reference, "plain", 0.0);
    // With the course's kind of dropout: also equal, which checks where dropout is applied.
    check_training(&reference, "dropout", 0.2);
}

/// `--init scaled` draws the whole output layer from the seed and keeps a tensor-parallel
/// shard's part of it, cut as the output layer reports (vocabulary-parallel: rows): the two
/// halves of the vocabulary, drawn on two shards, are the whole layer's rows.
#[test]
fn a_scaled_output_layer_is_cut_into_the_shards_rows() {
    use common::comm::tensor_parallel::{Shard, TensorShards};
    use common::models::{OutputInit, PartSpan, TransformerPart};
    let _rng = exclusive_rng();
    let cfg = small(0.0);
    let world = common::comm::ProcessGroup::single();
    let drawn = |_rows: i64, shard: Shard| {
        let vs = nn::VarStore::new(Device::Cpu);
        let head = PartSpan { embedding: false, layers: 0..0, head: true };
        let part = TransformerPart::new(&vs.root(), &cfg, head, shard, &mut |_| {}).unwrap();
        let shards = TensorShards { group: &world, shard, splits: std::sync::Arc::new(part.splits()) };
        OutputInit::Scaled.apply(&named_parameters(&vs), &cfg, 7, (!shard.is_whole()).then_some(&shards)).unwrap();
        vs.variables()["linear.weight"].copy()
    };
    let whole = drawn(cfg.ntoken, Shard::WHOLE);
    let half = cfg.ntoken / 2;
    for index in 0..2 {
        let mine = drawn(half, Shard { index, count: 2 });
        assert!(mine.equal(&whole.narrow(0, index as i64 * half, half)), "shard {index} holds other rows than the whole layer's");
    }
    let bound = 1.0 / (cfg.d_model as f64).sqrt();
    assert!(whole.abs().max().double_value(&[]) <= bound && whole.abs().max().double_value(&[]) > 0.5 * bound);
}

// --- the chunked output layer and loss (--loss-chunks) ---------------------------------------

/// Hidden states `[n, d]` (a leaf that wants its gradient), the output layer `[V, d]`, `[V]`
/// (leaves too), and targets, drawn from `seed`.
fn output_layer_inputs(n: i64, d: i64, v: i64, seed: i64) -> (Tensor, Tensor, Tensor, Tensor) {
    tch::manual_seed(seed);
    let opts = (Kind::Float, Device::Cpu);
    let hidden = Tensor::randn([n, d], opts).set_requires_grad(true);
    let weight = (Tensor::rand([v, d], opts) * 0.6 - 0.3).set_requires_grad(true);
    let bias = (Tensor::randn([v], opts) * 0.1).set_requires_grad(true);
    let targets = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
    (hidden, weight, bias, targets)
}

/// `f`'s loss and hits, and the gradients of `weight_of_loss × loss` wrt the hidden states, the
/// weight and the bias.
fn loss_and_gradients(leaves: [&Tensor; 3], weight_of_loss: f64, f: impl FnOnce() -> (Tensor, Option<Tensor>)) -> (f64, i64, Vec<Tensor>) {
    for leaf in leaves {
        leaf.shallow_clone().zero_grad();
    }
    let (loss, hits) = f();
    (&loss * weight_of_loss).backward();
    (loss.double_value(&[]), hits.map_or(-1, |h| h.int64_value(&[])), leaves.iter().map(|t| t.grad().copy()).collect())
}

/// Today's path: the whole batch's logits, then the step's loss (float32 under autocast).
fn full_loss(hidden: &Tensor, weight: &Tensor, bias: &Tensor, targets: &Tensor) -> (Tensor, Option<Tensor>) {
    let logits = hidden.linear(weight, Some(bias));
    common::train::loss_and_hits(&logits, targets, true)
}

fn chunked_loss(hidden: &Tensor, weight: &Tensor, bias: &Tensor, targets: &Tensor, chunk_rows: i64) -> (Tensor, Option<Tensor>) {
    let compute = common::precision::active_autocast_kind(Device::Cpu).unwrap_or(weight.kind());
    let (loss, hits) = common::torch_ext::chunked_linear_cross_entropy(hidden, weight, Some(bias), targets, chunk_rows, compute, true).unwrap();
    (loss, Some(hits))
}

/// In float32 the chunked loss is the full one: its value, its arg-max hits and its gradients
/// wrt the hidden states, the output weight and the bias, to float32's rounding (1e-6
/// relative), for chunks that divide the 36 tokens and chunks that do not (and more rows than
/// tokens), and with the loss weighted before the backward pass (an accumulated batch's share,
/// a gradient scaler's scale: the chunked backward multiplies by the incoming gradient).
#[test]
fn the_chunked_loss_is_the_full_loss_and_gradients_in_float32() {
    let _rng = exclusive_rng();
    let (hidden, weight, bias, targets) = output_layer_inputs(36, 16, 50, 11);
    let leaves = [&hidden, &weight, &bias];
    for weight_of_loss in [1.0, 0.37] {
        let (loss, hits, grads) = loss_and_gradients(leaves, weight_of_loss, || full_loss(&hidden, &weight, &bias, &targets));
        for chunk_rows in [1, 4, 9, 36, 5, 7, 35, 100] {
            let (ours, our_hits, our_grads) = loss_and_gradients(leaves, weight_of_loss, || chunked_loss(&hidden, &weight, &bias, &targets, chunk_rows));
            assert!((ours - loss).abs() <= 1e-6 * loss.abs(), "{chunk_rows} rows a chunk: loss {ours} against {loss}");
            assert_eq!(our_hits, hits, "{chunk_rows} rows a chunk: hits");
            for (name, (a, b)) in ["hidden states", "weight", "bias"].iter().zip(our_grads.iter().zip(&grads)) {
                let diff = rel_diff(a, b);
                assert!(diff <= 1e-6, "{chunk_rows} rows a chunk, loss × {weight_of_loss}: the gradient wrt the {name} differs by {diff:e}");
            }
        }
    }
}

/// The whole model's `--loss-chunks N` (what `exercise1_nlp` trains) against its logits and
/// the step's loss, in float32: the same loss, hits and gradients of every parameter (the
/// hidden states' gradient carried through every layer), for 3 and 7 chunks of 5 × 4 tokens.
#[test]
fn the_models_chunked_loss_gives_every_parameter_the_full_losss_gradient() {
    let _rng = exclusive_rng();
    let cfg = small(0.0);
    tch::manual_seed(5);
    let (vs, model) = build(&cfg);
    let (src, targets) = (tokens(&cfg, 5, 4), tokens(&cfg, 5, 4));
    let params = named_parameters(&vs);
    let run = |f: &dyn Fn() -> (Tensor, Option<Tensor>)| {
        for (_, p) in &params {
            p.shallow_clone().zero_grad();
        }
        let (loss, hits) = f();
        loss.backward();
        (loss.double_value(&[]), hits.unwrap().int64_value(&[]), params.iter().map(|(_, p)| p.grad().copy()).collect::<Vec<_>>())
    };
    let (loss, hits, grads) = run(&|| common::train::loss_and_hits(&model.forward_t(&src, true), &targets, true));
    for chunks in [3, 7] {
        let (ours, our_hits, our_grads) = run(&|| model.chunked_loss_and_hits(&src, &targets, true, chunks, true).unwrap());
        assert!((ours - loss).abs() <= 1e-6 * loss, "{chunks} chunks: loss {ours} against {loss}");
        assert_eq!(our_hits, hits);
        for ((name, _), (a, b)) in params.iter().zip(our_grads.iter().zip(&grads)) {
            let diff = rel_diff(a, b);
            assert!(diff <= 1e-5, "{chunks} chunks: the gradient of {name} differs by {diff:e}");
        }
    }
}

/// bfloat16's unit in the last place, relative: 8 significant bits, so two roundings of the
/// same value (or of values float32's rounding apart) land at most 2^-7 of it apart.
const BF16_ULP: f64 = 1.0 / 128.0;

/// Under bfloat16 autocast (`--precision bf16-mixed`, as the step runs it on the CPU) the
/// chunked loss equals today's within bfloat16's rounding, bounds derived from how each is
/// made (the products in bfloat16 in both, float32 sums):
/// - each logit is a bfloat16 rounding of the same float32 dot product, so two ways of making
///   it differ by at most one ulp, 2^-7 |z|; a token's loss `lse(z) − z_t` moves by at most
///   twice the largest logit's change, so the mean by `2 · 2^-7 · max |z|`;
/// - the gradient of the logits `G = (softmax − one-hot)/n` is made in float32 by both and
///   rounded to bfloat16 (one ulp apart at most); the hidden states' gradient `G·W` is one
///   bfloat16 product per row in both (one more ulp); the weight's `Gᵀ·H` today one bfloat16
///   product over all tokens, here one per chunk summed in float32 (an ulp of each chunk's
///   part): elementwise at most `3 · 2^-7 · (|G|·|W|)`, `3 · 2^-7 · (|G|ᵀ·|H|)`; the bias's,
///   a bfloat16 sum today and a float32 one here, `2 · 2^-7 · Σ|G|`;
///
/// Both plus float32's rounding of the sums (1e-5 of the scale).
#[test]
fn the_chunked_loss_under_bf16_autocast_is_todays_within_bf16_rounding() {
    use common::precision::{autocast, Precision};
    let _rng = exclusive_rng();
    let (n, d, v) = (70, 32, 300);
    let (hidden, weight, bias, targets) = output_layer_inputs(n, d, v, 12);
    let leaves = [&hidden, &weight, &bias];
    let (loss, _, grads) = loss_and_gradients(leaves, 1.0, || autocast(Precision::BHalf, Device::Cpu, || full_loss(&hidden, &weight, &bias, &targets)));
    // The scales of the bounds, from today's bfloat16 logits.
    let (max_logit, g) = tch::no_grad(|| {
        let logits = autocast(Precision::BHalf, Device::Cpu, || hidden.linear(&weight, Some(&bias))).to_kind(Kind::Float);
        assert_eq!(autocast(Precision::BHalf, Device::Cpu, || hidden.linear(&weight, Some(&bias))).kind(), Kind::BFloat16);
        let g = (logits.softmax(-1, Kind::Float) - targets.one_hot(v).to_kind(Kind::Float)) / n as f64;
        (logits.abs().max().double_value(&[]), g.abs())
    });
    let bounds = [g.matmul(&weight.abs().detach()), g.tr().matmul(&hidden.abs().detach()), g.sum_dim_intlist([0i64].as_slice(), false, Kind::Float)];
    let factors = [3.0, 3.0, 2.0];
    for chunk_rows in [7, 16, 70] {
        let (ours, _, our_grads) =
            loss_and_gradients(leaves, 1.0, || autocast(Precision::BHalf, Device::Cpu, || chunked_loss(&hidden, &weight, &bias, &targets, chunk_rows)));
        let loss_bound = 2.0 * BF16_ULP * max_logit + 1e-5 * loss.abs();
        assert!((ours - loss).abs() <= loss_bound, "{chunk_rows} rows a chunk: loss {ours} against {loss} (bound {loss_bound:e})");
        for (i, name) in ["hidden states", "weight", "bias"].iter().enumerate() {
            let diff = (&our_grads[i] - &grads[i]).abs();
            let bound = &bounds[i] * (factors[i] * BF16_ULP) + 1e-5 * grads[i].abs().max().double_value(&[]);
            let worst = (&diff - &bound).max().double_value(&[]);
            assert!(worst <= 0.0, "{chunk_rows} rows a chunk: the gradient wrt the {name} exceeds its bound by {worst:e}");
            eprintln!(
                "bf16, {chunk_rows} rows a chunk: loss {ours:.6} against {loss:.6} (bound {loss_bound:.2e}); gradient wrt the {name}: largest difference {:.2e}, {:.1}% of its bound at most",
                diff.max().double_value(&[]),
                100.0 * (diff / (bound + 1e-30)).max().double_value(&[])
            );
        }
    }
}

/// Five SGD steps of the small language model under bfloat16 autocast (SGD at lr 0.5,
/// gradients clipped to norm 0.5 as the course clips them), today's loss against the chunked one,
/// from the same weights: each step's loss within the bound of a single loss (`2 · 2^-7 ·
/// max |z|`, above) plus what the earlier steps' updates can have moved it, to first order:
/// each update differs by at most 3 ulps of its length (`lr · min(‖g‖, 0.5)`, the gradients'
/// bound above), which moves the loss by at most `‖∇L‖` times that. In float32 the two runs'
/// losses are equal to 1e-5.
#[test]
fn training_steps_with_the_chunked_loss_give_todays_losses() {
    use common::precision::{autocast, Precision};
    const STEPS: usize = 5;
    const LR: f64 = 0.5;
    const MAX_NORM: f64 = 0.5;
    let _rng = exclusive_rng();
    let cfg = TransformerConfig { ntoken: 200, ..small(0.0) };
    let train = |precision: Precision, chunks: Option<i64>| {
        tch::manual_seed(3);
        let (vs, model) = build(&cfg);
        let data = tokens(&cfg, 6 * STEPS as i64 + 1, 4);
        let params = named_parameters(&vs);
        let tensors: Vec<Tensor> = params.iter().map(|(_, t)| t.shallow_clone()).collect();
        let mut opt = Sgd::new(params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(), SgdConfig { lr: LR, ..Default::default() });
        let mut out = Vec::new();
        for step in 0..STEPS as i64 {
            let (inputs, targets) = (data.narrow(0, 6 * step, 6), data.narrow(0, 6 * step + 1, 6));
            opt.zero_grad();
            let (max_logit, loss) = autocast(precision, Device::Cpu, || {
                let max_logit = tch::no_grad(|| model.forward_t(&inputs, true).abs().max().to_kind(Kind::Float).double_value(&[]));
                let loss = match chunks {
                    None => common::train::loss_and_hits(&model.forward_t(&inputs, true), &targets, false).0,
                    Some(chunks) => model.chunked_loss_and_hits(&inputs, &targets, true, chunks, false).unwrap().0,
                };
                (max_logit, loss)
            });
            loss.backward();
            let norm = clip_grad_norm(&tensors, MAX_NORM);
            opt.step().unwrap();
            out.push((loss.double_value(&[]), max_logit, norm));
        }
        out
    };
    let (full, chunked) = (train(Precision::Full, None), train(Precision::Full, Some(5)));
    for (step, (a, b)) in full.iter().zip(&chunked).enumerate() {
        assert!((a.0 - b.0).abs() <= 1e-5 * a.0, "float32, step {step}: loss {} chunked, {} today", b.0, a.0);
    }
    let (today, ours) = (train(Precision::BHalf, None), train(Precision::BHalf, Some(5)));
    let mut moved = 0.0;
    for (step, (&(loss, max_logit, norm), &(our_loss, ..))) in today.iter().zip(&ours).enumerate() {
        let bound = 2.0 * BF16_ULP * max_logit + norm * moved + 1e-5 * loss;
        eprintln!("bf16 step {step}: loss {loss:.6} today, {our_loss:.6} chunked, difference {:.2e}, bound {bound:.2e}", (loss - our_loss).abs());
        assert!((loss - our_loss).abs() <= bound, "bf16, step {step}: loss {our_loss} chunked, {loss} today (bound {bound:e})");
        moved += 3.0 * BF16_ULP * LR * norm.min(MAX_NORM);
    }
}
