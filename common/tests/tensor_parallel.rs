//! Megatron tensor parallelism on CPU ranks (MPI): the Transformer's layers cut over 2 and 4
//! ranks compute the unpartitioned model's logits, loss, gradients (each shard's is its slice
//! of the whole gradient) and, after five clipped SGD steps, parameters; with dropout, the same
//! masks as one rank; exactly two all-reduces per layer forward and two backward; composed
//! with pipeline stages and data-parallel replicas on 8 ranks (2 × 2 × 2); bad widths refused.
//! The same with sequence parallelism (each shard its rows of the sequence between the layers;
//! on 4 shards the 6-token sequences padded to 8): two all-gathers and two reduce-scatters per
//! layer forward instead of the all-reduces.
//!
//! The multi-rank cases run this test binary's `rank_entry` under mpirun (see
//! `support::ranks`).
mod support;

use std::time::Duration;

use common::comm::data_parallel::GradientAverager;
use common::comm::layout::{Groups, Layout};
use common::comm::tensor_parallel::Shard;
use common::comm::{Backend, CommStats, ProcessGroup};
use common::models::{Masks, TransformerConfig};
use common::parallel::{optimizer_for, DataParallelPlan, GradientSync};
use common::pipeline::process::StageProcess;
use common::pipeline::{Partition, Pipeline, Schedule, Stage};
use common::train::TrainStep;
use support::lm::*;
use support::ranks::{launch, SCENARIO};
use tch::{Device, Tensor};

/// A model every tested shard count divides: 4 heads, widths 16 and 32, 64 words.
fn tp_config(nlayers: i64, dropout: f64) -> TransformerConfig {
    TransformerConfig { ntoken: 64, d_model: 16, nhead: 4, d_hid: 32, nlayers, dropout }
}

fn ddp() -> DataParallelPlan {
    DataParallelPlan { averager: GradientAverager::new(25 << 20, false), sync: GradientSync::Ddp }
}

#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    tch::set_num_threads(1); // the ranks share the machine's cores
    let rank = match scenario.as_str() {
        "tp2" | "tp4" => shards_train_the_unpartitioned_model(false),
        "sp2" | "sp4" => shards_train_the_unpartitioned_model(true),
        "tp2_counts" => two_all_reduces_per_layer_each_way(),
        "sp2_counts" => sequence_parallel_layers_gather_and_scatter(),
        "tp2_dropout" => dropout_masks_do_not_depend_on_the_shards(false),
        "sp2_dropout" => dropout_masks_do_not_depend_on_the_shards(true),
        "sp2_memory" => sequence_parallelism_saves_what_the_estimate_counts(),
        "three_d" => three_d_layout_trains_the_unpartitioned_model(),
        other => panic!("unknown scenario {other}"),
    };
    println!("scenario {scenario} passed on rank {rank}");
}

/// Shard `shard` of stages `index` of `stages` (layers `layers`), with sequence parallelism
/// where `sequence_parallel` says.
fn stage(cfg: &TransformerConfig, index: usize, stages: usize, layers: std::ops::Range<i64>, shard: Shard, sequence_parallel: bool) -> Stage {
    let stage = Stage::new_sharded(cfg, index, stages, layers, Device::Cpu, 1, shard).unwrap();
    if sequence_parallel {
        stage.sequence_parallel().unwrap()
    } else {
        stage
    }
}

/// Every rank one shard of a 2-layer model (k = the world size), with or without sequence
/// parallelism: logits, then five steps of training with clipping, against the unpartitioned
/// model.
fn shards_train_the_unpartitioned_model(sequence_parallel: bool) -> usize {
    let world = ProcessGroup::init(Backend::Auto).unwrap();
    let k = world.world_size();
    let groups = Groups::new(&world, Layout::new(k, 1, k, None).unwrap()).unwrap();
    assert_eq!(groups.shard(), Shard { index: world.rank(), count: k });
    let cfg = tp_config(2, 0.0);
    for chunks in [1, 2] {
        let (reference_vs, reference) = reference_model(&cfg);
        let stage = stage(&cfg, 0, 1, 0..2, groups.shard(), sequence_parallel);
        stage.copy_from(&reference_vs).unwrap();
        // The shard's logits are its words' slice of the whole model's (those of the sequence's
        // 6 positions: sequence parallelism over 4 shards pads it to 8).
        let (src, _) = batch(99, 6, 4);
        let expected = tch::no_grad(|| tch::nn::ModuleT::forward_t(&reference, &src, false));
        let logits = tch::no_grad(|| stage.forward_masked(&src, false, Masks::Shared, groups.tp()).unwrap());
        assert_eq!(logits.size()[0], if sequence_parallel { (6 + k as i64 - 1) / k as i64 * k as i64 } else { 6 });
        let logits = logits.narrow(0, 0, 6);
        let (start, len) = groups.shard().range(cfg.ntoken);
        let diff = relative_difference(&logits, &expected.narrow(2, start, len));
        assert!(diff <= 1e-5, "rank {}: logits differ by {diff:e}", world.rank());
        let mut process = StageProcess::new(&groups, vec![stage], options(Schedule::GPipe, chunks, false), ddp()).unwrap();
        let what = format!("shard {} of {k}, {chunks} micro-batches, sequence parallel {sequence_parallel}", world.rank());
        assert_trains_like_unpartitioned(&mut process, &reference, &reference_vs, (0, 1), &what);
    }
    world.rank()
}

/// What the tensor-parallel group moved during `work`.
fn counted(group: &ProcessGroup, work: impl FnOnce()) -> CommStats {
    let before = group.comm_stats();
    work();
    group.comm_stats().since(before)
}

/// Megatron's figure: every layer adds two all-reduces to the forward pass (the two g) and two
/// to the backward pass (the two f). Besides the layers: the embedding's g and the loss's max
/// and sum forward, the output layer's f backward.
fn two_all_reduces_per_layer_each_way() -> usize {
    let world = ProcessGroup::init(Backend::Auto).unwrap();
    let groups = Groups::new(&world, Layout::new(2, 1, 2, None).unwrap()).unwrap();
    let tp = groups.tp().unwrap();
    let (src, targets) = batch(5, 6, 4);
    let mut per_layers = Vec::new();
    for layers in [1, 2, 3] {
        let cfg = tp_config(layers, 0.0);
        let stage = Stage::new_sharded(&cfg, 0, 1, 0..layers, Device::Cpu, 1, groups.shard()).unwrap();
        let mut loss = Tensor::new();
        let forward = counted(tp, || {
            let logits = stage.forward_masked(&src, true, Masks::Shared, Some(tp)).unwrap();
            loss = stage.loss_and_hits(&logits, &targets, Some(tp), false).unwrap().0;
        });
        let backward = counted(tp, || loss.backward());
        assert_eq!((forward.all_reduce.calls, backward.all_reduce.calls), (2 * layers as u64 + 3, 2 * layers as u64 + 1), "{layers} layers");
        assert_eq!(forward.all_gather.calls + forward.broadcast.calls + backward.all_gather.calls, 0);
        per_layers.push((forward.all_reduce.calls, backward.all_reduce.calls));
    }
    for pair in per_layers.windows(2) {
        assert_eq!((pair[1].0 - pair[0].0, pair[1].1 - pair[0].1), (2, 2), "one more layer: two more all-reduces each way");
    }
    world.rank()
}

/// With sequence parallelism every layer adds two all-gathers and two reduce-scatters to the
/// forward pass (instead of two all-reduces), and to the backward pass four all-gathers (the
/// column-parallel layers gather their rows of the input again, the reduce-scatters' gradients)
/// and two reduce-scatters, and one all-reduce: the gradients of the parameters every shard
/// holds whole and applies to its rows (layer norms, row-parallel biases), summed in one.
/// Besides the layers: the embedding's reduce-scatter, the output layer's all-gather and the
/// loss's two all-reduces forward; the embedding's all-gather and the output layer's all-gather
/// and reduce-scatter backward.
fn sequence_parallel_layers_gather_and_scatter() -> usize {
    let world = ProcessGroup::init(Backend::Auto).unwrap();
    let groups = Groups::new(&world, Layout::new(2, 1, 2, None).unwrap()).unwrap();
    let tp = groups.tp().unwrap();
    let (src, targets) = batch(5, 6, 4);
    let mut per_layers = Vec::new();
    for layers in [1, 2, 3] {
        let stage = stage(&tp_config(layers, 0.0), 0, 1, 0..layers, groups.shard(), true);
        let mut loss = Tensor::new();
        let forward = counted(tp, || {
            let logits = stage.forward_masked(&src, true, Masks::Shared, Some(tp)).unwrap();
            loss = stage.loss_and_hits(&logits, &targets, Some(tp), false).unwrap().0;
        });
        let backward = counted(tp, || loss.backward());
        let l = layers as u64;
        assert_eq!((forward.all_gather.calls, forward.reduce_scatter.calls, forward.all_reduce.calls), (2 * l + 1, 2 * l + 1, 2), "{layers} layers forward");
        assert_eq!(
            (backward.all_gather.calls, backward.reduce_scatter.calls, backward.all_reduce.calls),
            (4 * l + 2, 2 * l + 1, l),
            "{layers} layers backward"
        );
        // A sequence's rows move, not whole activations: the embedding's reduce-scatter hands
        // over [6 × 4 × 16] floats and gets back a half of them.
        per_layers.push(forward.reduce_scatter.bytes);
    }
    assert!(per_layers.windows(2).all(|w| w[1] > w[0]));
    world.rank()
}

/// What a training forward pass keeps for its backward pass (the CPU bytes held after it, its
/// logits included) with 1 and 2 layers, without and with sequence parallelism (dropout on, keyed
/// masks): what a layer adds shrinks by what the memory estimate counts for it, the part every
/// shard held whole (Korthikanti et al.'s `10·sbh` of `sbh(10 + 24/t + 5as/ht)`) now cut over
/// the shards.
fn sequence_parallelism_saves_what_the_estimate_counts() -> usize {
    use common::memory::estimate::TransformerJob;
    use std::cell::RefCell;
    let world = ProcessGroup::init(Backend::Auto).unwrap();
    let groups = Groups::new(&world, Layout::new(2, 1, 2, None).unwrap()).unwrap();
    let (src, _) = batch(5, 36, 8);
    common::torch_ext::cpu_memory().unwrap();
    let generator = RefCell::new(common::torch_ext::Generator::new(Device::Cpu).unwrap());
    let per_layer = |sequence_parallel: bool| {
        let held: Vec<i64> = [1, 2]
            .map(|layers| {
                let stage = stage(&tp_config(layers, 0.2), 0, 1, 0..layers, groups.shard(), sequence_parallel);
                let before = common::torch_ext::cpu_memory().unwrap().current;
                let logits = stage.forward_masked(&src, true, Masks::Keyed { generator: &generator, key: 1, positions: 36 }, groups.tp()).unwrap();
                let held = common::torch_ext::cpu_memory().unwrap().current - before;
                drop(logits);
                held
            })
            .to_vec();
        (held[1] - held[0]) as f64
    };
    let (tensor, sequence) = (per_layer(false), per_layer(true));
    let job = |sequence_parallel| TransformerJob {
        config: tp_config(2, 0.2),
        bptt: 36,
        batch: 8,
        chunks: 1,
        accumulate: 1,
        sequence_parallel,
        state_shards: 1,
        replicas: 1,
        tp: 2,
        partition: Partition::even(2, 1).unwrap(),
        placement: common::pipeline::Placement::one_stage_each(1),
        schedule: Schedule::GPipe,
        checkpoint_activations: false,
        stages_share_a_device: false,
        keyed_masks: true,
        sync: common::parallel::GradientSync::Ddp,
        optimizer_k: 0.0,
        update_bytes_per_parameter: 0.0,
        bucket_bytes: 0.0,
        precision: Default::default(),
        cuda: false,
        loss_chunks: None,
    };
    let (expected_tensor, expected_sequence) = (job(false).per_layer_bytes(), job(true).per_layer_bytes());
    println!("rank {}: a layer keeps {tensor} bytes (estimate {expected_tensor}) with tensor parallelism, {sequence} ({expected_sequence}) with sequence parallelism", world.rank());
    let (saved, expected) = (tensor - sequence, expected_tensor - expected_sequence);
    assert!((saved - expected).abs() <= 0.05 * expected, "rank {}: sequence parallelism saves {saved} bytes per layer, the estimate {expected}", world.rank());
    world.rank()
}

/// With dropout 0.2 at every site, two shards draw the masks one rank draws for the whole
/// model (each keyed mask is drawn whole and cut to the shard's heads, hidden units or, with
/// sequence parallelism, rows of the sequence): five steps' losses equal one process's.
fn dropout_masks_do_not_depend_on_the_shards(sequence_parallel: bool) -> usize {
    let world = ProcessGroup::init(Backend::Auto).unwrap();
    let groups = Groups::new(&world, Layout::new(2, 1, 2, None).unwrap()).unwrap();
    let cfg = tp_config(2, 0.2);
    let (weights, _) = reference_model(&cfg);
    let one = Pipeline::new(&cfg, &Partition::even(2, 1).unwrap(), &[Device::Cpu], 1, options(Schedule::GPipe, 2, false)).unwrap();
    let mut one: Box<dyn TrainStep<'_>> = Box::new(one);
    let stage = stage(&cfg, 0, 1, 0..2, groups.shard(), sequence_parallel);
    let mut sharded: Box<dyn TrainStep<'_>> = Box::new(StageProcess::new(&groups, vec![stage], options(Schedule::GPipe, 2, false), ddp()).unwrap());
    let mut losses = Vec::new();
    for trainer in [&mut one, &mut sharded] {
        let params = trainer.named_parameters();
        tch::no_grad(|| {
            let whole = weights.variables();
            for (name, p) in &params {
                p.shallow_clone().copy_(&part_of(trainer.as_ref(), name, &whole[name]));
            }
        });
        let mut optimizer = sgd(params);
        let mine: Vec<f64> = (0..5)
            .map(|step| {
                let (src, targets) = private_batch(300 + step, 6, 8);
                common::optim::Optimizer::zero_grad(&mut optimizer);
                let loss = train_step(trainer.as_mut(), &src, &targets, common::seed_keys::mix_key(&[42, step]));
                common::train::finish_gradients(&**trainer, &mut optimizer, None, Some(CLIP)).unwrap();
                common::optim::Optimizer::step(&mut optimizer).unwrap();
                loss
            })
            .collect();
        losses.push(mine);
    }
    for (step, (got, want)) in losses[1].iter().zip(&losses[0]).enumerate() {
        assert!((got - want).abs() <= 1e-5 * want.abs(), "rank {}: step {step}: loss {got} with 2 shards vs {want} on one rank", world.rank());
    }
    assert!(losses[0].windows(2).any(|w| w[0] != w[1]), "the model trained");
    world.rank()
}

/// 8 ranks as 2 replicas × 2 stages × 2 shards, each rank checking its part against the
/// unpartitioned model trained on whole batches: both schedules with the replicas' gradients
/// all-reduced, and 1F1B with ZeRO-1 over the replicas (each updates half of its part).
fn three_d_layout_trains_the_unpartitioned_model() -> usize {
    let world = ProcessGroup::init(Backend::Auto).unwrap();
    let layout = Layout::new(8, 2, 2, Some(2)).unwrap();
    let groups = Groups::new(&world, layout).unwrap();
    let coords = groups.coords;
    let cfg = tp_config(4, 0.0);
    let partition = Partition::even(cfg.nlayers, 2).unwrap();
    let zero = DataParallelPlan { sync: GradientSync::Zero(common::parallel::zero::ZeroStage::OptimizerState), ..ddp() };
    for (schedule, plan) in [(Schedule::GPipe, ddp()), (Schedule::OneFOneB, ddp()), (Schedule::OneFOneB, zero)] {
        let (reference_vs, reference) = reference_model(&cfg);
        let stage = Stage::new_sharded(&cfg, coords.stage, 2, partition.layers[coords.stage].clone(), Device::Cpu, 1, groups.shard()).unwrap();
        stage.copy_from(&reference_vs).unwrap();
        let mut process = StageProcess::new(&groups, vec![stage], options(schedule, 2, false), plan).unwrap();
        assert_eq!(process.sync().replica_count(), 2);
        let mut optimizer = optimizer_for(&process, &|named| Box::new(sgd(named))).unwrap();
        let what =
            format!("rank {} (replica {}, stage {}, shard {}), {}, {:?}", world.rank(), coords.replica, coords.stage, coords.shard, schedule.name(), plan.sync);
        assert_trains_like_unpartitioned_with(&mut process, optimizer.as_mut(), &reference, &reference_vs, (coords.replica, 2), &what);
    }
    world.rank()
}

#[test]
fn two_shards_train_the_unpartitioned_model() {
    launch(Some(2), "tp2", &[], Duration::from_secs(120)).assert_passed("tp2", 2);
}

#[test]
fn four_shards_train_the_unpartitioned_model() {
    launch(Some(4), "tp4", &[], Duration::from_secs(180)).assert_passed("tp4", 4);
}

#[test]
fn sequence_parallel_shards_train_the_unpartitioned_model() {
    launch(Some(2), "sp2", &[], Duration::from_secs(120)).assert_passed("sp2", 2);
    launch(Some(4), "sp4", &[], Duration::from_secs(180)).assert_passed("sp4", 4);
}

#[test]
fn sequence_parallelism_saves_the_activations_the_estimate_counts() {
    launch(Some(2), "sp2_memory", &[], Duration::from_secs(120)).assert_passed("sp2_memory", 2);
}

#[test]
fn a_sequence_parallel_layer_gathers_and_scatters_instead_of_all_reducing() {
    launch(Some(2), "sp2_counts", &[], Duration::from_secs(120)).assert_passed("sp2_counts", 2);
}

#[test]
fn sequence_parallel_shards_draw_the_dropout_masks_of_one_rank() {
    launch(Some(2), "sp2_dropout", &[], Duration::from_secs(120)).assert_passed("sp2_dropout", 2);
}

#[test]
fn a_layer_costs_two_all_reduces_forward_and_two_backward() {
    launch(Some(2), "tp2_counts", &[], Duration::from_secs(120)).assert_passed("tp2_counts", 2);
}

#[test]
fn shards_draw_the_dropout_masks_of_one_rank() {
    launch(Some(2), "tp2_dropout", &[], Duration::from_secs(120)).assert_passed("tp2_dropout", 2);
}

#[test]
fn replicas_of_stages_of_shards_train_the_unpartitioned_model() {
    launch(Some(8), "three_d", &[], Duration::from_secs(300)).assert_passed("three_d", 8);
}

/// The vocabulary, the widths and the heads must divide by the shards: a usage error naming
/// the flag, before anything is built.
#[test]
fn widths_that_do_not_divide_by_the_shards_are_refused() {
    for (cfg, expected) in [
        (TransformerConfig { nhead: 2, ..tp_config(1, 0.0) }, "--nhead"),
        (TransformerConfig { d_hid: 30, ..tp_config(1, 0.0) }, "--d-hid"),
        (TransformerConfig { ntoken: 66, ..tp_config(1, 0.0) }, "the vocabulary"),
        (TransformerConfig { d_model: 18, nhead: 6, ..tp_config(1, 0.0) }, "--emsize"),
    ] {
        let err = Stage::new_sharded(&cfg, 0, 1, 0..1, Device::Cpu, 1, Shard { index: 0, count: 4 }).err().unwrap_or_else(|| panic!("{cfg:?} over 4 shards"));
        assert!(err.0.contains(expected) && err.0.contains("4 equal parts"), "{}", err.0);
    }
    // A shard's variables: its part of every cut tensor, whole where Megatron keeps them whole.
    let stage = Stage::new_sharded(&tp_config(1, 0.0), 0, 1, 0..1, Device::Cpu, 1, Shard { index: 1, count: 4 }).unwrap();
    let shapes: std::collections::HashMap<String, Vec<i64>> = stage.named_parameters().into_iter().map(|(n, t)| (n, t.size())).collect();
    let layer = "transformer_encoder.layers.0";
    assert_eq!(shapes[&format!("{layer}.self_attn.in_proj_weight")], vec![12, 16]);
    assert_eq!(shapes[&format!("{layer}.self_attn.out_proj.weight")], vec![16, 4]);
    assert_eq!(shapes[&format!("{layer}.self_attn.out_proj.bias")], vec![16]);
    assert_eq!(shapes[&format!("{layer}.linear1.weight")], vec![8, 16]);
    assert_eq!(shapes[&format!("{layer}.linear2.weight")], vec![16, 8]);
    assert_eq!(shapes[&format!("{layer}.norm1.weight")], vec![16]);
    assert_eq!((shapes["embedding.weight"].clone(), shapes["linear.weight"].clone()), (vec![16, 16], vec![16, 16]));
    // Without its group a shard cannot run.
    let (src, _) = batch(1, 4, 2);
    assert!(stage.forward_masked(&src, false, Masks::Shared, None).is_err());
}
