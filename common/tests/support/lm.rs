//! The Transformer's model-parallel tests' shared pieces: a small model, batches, one training
//! step as the loop runs it, and the check that a partitioned trainer (pipeline stages,
//! tensor-parallel shards, replicas) trains the unpartitioned model.
use std::collections::HashMap;

use common::models::{self, TransformerConfig, TransformerLm};
use common::optim::{Optimizer, Sgd, SgdConfig};
use common::pipeline::{PipelineOptions, Schedule, Stage};
use common::precision::Precision;
use common::train::{Batch, StepContext, TrainStep};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

pub fn config(nlayers: i64, d_model: i64) -> TransformerConfig {
    TransformerConfig { ntoken: 50, d_model, nhead: 2, d_hid: 2 * d_model, nlayers, dropout: 0.0 }
}

/// Token ids `[seq_len, batch]` and their next-token targets.
pub fn batch(seed: i64, seq_len: i64, batch: i64) -> (Tensor, Tensor) {
    tch::manual_seed(seed);
    let ids = Tensor::randint(50, [seq_len + 1, batch], (Kind::Int64, Device::Cpu));
    (ids.narrow(0, 0, seq_len), ids.narrow(0, 1, seq_len))
}

/// One stage per device (GPipe, 1F1B), or 2 per device with the interleaved schedule.
pub fn options(schedule: Schedule, chunks: usize, checkpoint_activations: bool) -> PipelineOptions {
    let virtual_stages = if schedule == Schedule::Interleaved { 2 } else { 1 };
    PipelineOptions { schedule, virtual_stages, chunks, checkpoint_activations, threads_per_stage: Some(1) }
}

/// The interleaved schedule with `virtual_stages` stages per device.
pub fn interleaved(virtual_stages: usize, chunks: usize, checkpoint_activations: bool) -> PipelineOptions {
    PipelineOptions { virtual_stages, ..options(Schedule::Interleaved, chunks, checkpoint_activations) }
}

/// One mini-batch's forward and backward passes through `trainer` as the training loop runs
/// them (float32, dropout keyed by `dropout_key`); returns the mean loss.
pub fn train_step(trainer: &mut dyn TrainStep<'_>, src: &Tensor, targets: &Tensor, dropout_key: u64) -> f64 {
    let ctx = StepContext { precision: Precision::Full, scaler: None, dropout_key, sync_phases: false, count_hits: false };
    let batch = Batch { inputs: src.shallow_clone(), targets: targets.shallow_clone() };
    let out = trainer.forward_backward(&batch, 1.0, &ctx).unwrap();
    out.mean_loss().double_value(&[])
}

pub fn sgd(params: Vec<(String, Tensor)>) -> Sgd {
    Sgd::new(params, SgdConfig { lr: 0.5, momentum: 0.9, ..SgdConfig::default() })
}

/// max |a − b| / max |b| (b the reference).
pub fn relative_difference(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b.abs().max().double_value(&[]).max(1e-12);
    (a - b).abs().max().double_value(&[]) / scale
}

pub fn by_name(params: Vec<(String, Tensor)>) -> HashMap<String, Tensor> {
    params.into_iter().collect()
}

/// The gradient-norm bound of the tests (the tutorial's): small enough to clip these gradients.
pub const CLIP: f64 = 0.5;

/// This rank's part of the unpartitioned model's tensor `whole` named `name`: the tensor itself,
/// or a tensor-parallel shard's cut of it.
pub fn part_of(trainer: &dyn TrainStep<'_>, name: &str, whole: &Tensor) -> Tensor {
    // Cut as the step's layers report (its tensor cut's table).
    trainer.sync().tensor_cut().map_or_else(|| whole.shallow_clone(), |cut| cut.shard_of(name, whole).unwrap())
}

/// Checks that `trainer` (replica `replica.0` of `replica.1`, each training on its share of
/// every batch; a stage, a tensor-parallel shard, or all of the model) matches the unpartitioned
/// `reference` trained on whole batches: the loss, every clipped gradient of the first step,
/// and the parameters after five SGD-momentum steps (a shard's: its part of each).
pub fn assert_trains_like_unpartitioned(
    trainer: &mut dyn TrainStep<'_>,
    reference: &TransformerLm,
    reference_vs: &nn::VarStore,
    replica: (usize, usize),
    what: &str,
) {
    let mut optimizer = sgd(trainer.named_parameters());
    assert_trains_like_unpartitioned_with(trainer, &mut optimizer, reference, reference_vs, replica, what)
}

/// [`assert_trains_like_unpartitioned`] with `trainer_opt` (the tests' SGD over the trainer's
/// parameters, or a wrapper of it such as ZeRO's) stepping the trainer.
pub fn assert_trains_like_unpartitioned_with(
    trainer: &mut dyn TrainStep<'_>,
    trainer_opt: &mut dyn Optimizer,
    reference: &TransformerLm,
    reference_vs: &nn::VarStore,
    replica: (usize, usize),
    what: &str,
) {
    let mut reference_opt = sgd(models::named_parameters(reference_vs));
    let per_replica = 8;
    for step in 0..5 {
        let (src, targets) = batch(100 + step, 6, per_replica * replica.1 as i64);
        reference_opt.zero_grad();
        let loss = Stage::loss(&reference.forward_t(&src, true), &targets);
        loss.backward();
        common::optim::clip_grad_norm(&reference_vs.trainable_variables(), CLIP);
        let mine = |t: &Tensor| t.narrow(1, per_replica * replica.0 as i64, per_replica);
        trainer_opt.zero_grad();
        let mut got = train_step(trainer, &mine(&src), &mine(&targets), step as u64);
        if let Some(replicas) = trainer.sync().replicas() {
            // Each replica saw its half of the batch: their losses average to the whole batch's.
            let mut mean = Tensor::from(got);
            replicas.all_reduce(&mut mean, common::comm::ReduceOp::Average).unwrap();
            got = mean.double_value(&[]);
        }
        common::train::finish_gradients(&*trainer, trainer_opt, None, Some(CLIP)).unwrap();

        let expected = loss.double_value(&[]);
        assert!((got - expected).abs() <= 1e-5 * expected.abs(), "{what}: loss {got} vs {expected}");
        // (A sharded optimizer holds the averaged gradient in its blocks, not in the parameters.)
        if step == 0 && trainer_opt.sharded().is_none() {
            let grads = by_name(models::named_parameters(reference_vs));
            for (name, p) in trainer.named_parameters() {
                let diff = relative_difference(&p.grad(), &part_of(trainer, &name, &grads[&name].grad()));
                assert!(diff <= 1e-5, "{what}: gradient of {name} differs by {diff:e}");
            }
        }
        reference_opt.step().unwrap();
        trainer_opt.step().unwrap();
    }
    let reference_params = by_name(models::named_parameters(reference_vs));
    for (name, p) in trainer.named_parameters() {
        let diff = relative_difference(&p, &part_of(trainer, &name, &reference_params[&name]));
        assert!(diff <= 1e-5, "{what}: after 5 steps, {name} differs by {diff:e}");
    }
}

/// The unpartitioned model every comparison starts from.
pub fn reference_model(cfg: &TransformerConfig) -> (nn::VarStore, TransformerLm) {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = TransformerLm::new(&vs.root(), cfg).unwrap();
    (vs, model)
}

/// Token ids `[seq_len, batch]` and their targets drawn without LibTorch's shared generator
/// (other tests of this binary seed and draw from it on other threads at the same time).
pub fn private_batch(seed: u64, seq_len: i64, batch: i64) -> (Tensor, Tensor) {
    let mut state = common::seed_keys::mix_key(&[seed]);
    let ids: Vec<i64> = (0..(seq_len + 1) * batch)
        .map(|_| {
            state = common::seed_keys::mix_key(&[state]);
            (state % 50) as i64
        })
        .collect();
    let ids = Tensor::from_slice(&ids).view([seq_len + 1, batch]);
    (ids.narrow(0, 0, seq_len), ids.narrow(0, 1, seq_len))
}
