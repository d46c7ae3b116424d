//! The profile's measurements: timing the model's pieces, whole and as shards, the cost of
//! ranks sharing a host's cores, the passes' spread, the optimizer's step, the gradients'
//! average and each link's collectives, on the machine being profiled. How many samples each
//! takes is [`Sampling`]; the statistics they reduce to are [`crate::plan::stats`].
use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::{Collective, CostFit, GradientSync, LinkProfile, LinkScope, OptimizerTime, PassTimes, PieceTimes, ShardPieces, ShardWait, SharedCores};
use crate::comm::tensor_parallel::Shard;
use crate::comm::{ProcessGroup, ReduceOp};
use crate::models::{Masks, PartSpan, TransformerConfig, TransformerPart};
use crate::optim::{OptimizerKernel, OptimizerKind};
use crate::plan::stats;
use crate::precision::{self, Precision};

/// How many times the profile takes each of its measurements: every sample count and repeat
/// of the measuring functions below, in one place ([`Sampling::DEFAULT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampling {
    /// Samples kept of each timed compute cell (a piece's pass at one size and degree), after
    /// one untimed round over them all: their trimmed mean is its time
    /// ([`trimmed_means_in_rounds`]).
    pub compute_samples: usize,
    /// Rounds alone and together that the cost of sharing the cores is the medians of
    /// ([`sharing_slowdown`]). 27, not 9: five measurements of 4 ranks on 2 cores came out
    /// 1.63–2.59× with 9 passes each, 1.86–2.11× with 27 (about a second more).
    pub sharing_rounds: usize,
    /// Passes of a shard back to back in each timing of its waits ([`measure_shard_waits`]).
    pub shard_wait_passes: usize,
    /// Rounds of those timings, the median round's difference kept.
    pub shard_wait_rounds: usize,
    /// Passes of the probe whose spread is measured ([`measure_spread`]).
    pub spread_passes: usize,
    /// Runs, after one warm-up, whose median times the optimizer's step, the clipping, the
    /// gradient average and each collective at each size ([`median_seconds`]).
    pub median_runs: usize,
}

impl Sampling {
    /// The profile's sampling.
    pub const DEFAULT: Sampling =
        Sampling { compute_samples: 7, sharing_rounds: 27, shard_wait_passes: 8, shard_wait_rounds: 3, spread_passes: 15, median_runs: 5 };
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling::DEFAULT
    }
}

/// `cfg`'s model with `nlayers` layers in `vs`, whole or `shard`: what the profile times.
fn probe_model(vs: &tch::nn::VarStore, cfg: &TransformerConfig, nlayers: i64, shard: Shard) -> Result<TransformerPart> {
    let config = TransformerConfig { nlayers, ..*cfg };
    Ok(TransformerPart::new(&vs.root(), &config, PartSpan::whole(nlayers), shard, &mut |_| {})?)
}

/// Median seconds of `repeats` runs of `work` after one warm-up run, waiting for the device.
fn median_seconds(device: Device, repeats: usize, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut run = || -> Result<f64> {
        let start = Instant::now();
        work()?;
        crate::device::synchronize(device);
        Ok(start.elapsed().as_secs_f64())
    };
    run()?;
    let mut times = (0..repeats.max(1)).map(|_| run()).collect::<Result<Vec<f64>>>()?;
    Ok(stats::upper_median(&mut times))
}

/// Times the model's pieces at each of `micro_batches` sequences of `seq_len` tokens on
/// `device` in `precision` (autocast for the mixed precisions, 16-bit weights for the true
/// ones), training mode (dropout as configured): a probe of one layer, the encoder layers
/// being all alike, at each of `degrees`: whole (1) or shard 0 of that many with silent
/// collectives (its arithmetic alone). Forward alone, then forward and backward; the backward
/// time is the difference. Each the mean of the middle of [`Sampling::compute_samples`] samples taken in rounds
/// over every degree, size and piece ([`trimmed_means_in_rounds`]): the plan compares a
/// shard's times with the whole's, so a slow spell must not fall on one degree's samples alone. Returns each degree's
/// rows, in the order of `degrees`.
pub fn measure_compute(
    cfg: &TransformerConfig,
    precision: Precision,
    device: Device,
    seq_len: i64,
    micro_batches: &[i64],
    degrees: &[usize],
) -> Result<Vec<Vec<PieceTimes>>> {
    let hidden_kind = precision.weights_kind().unwrap_or(Kind::Float);
    let mut sizes = micro_batches.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    anyhow::ensure!(!sizes.is_empty(), "no micro-batch size to time");
    // Each degree's probe: its weights (kept alive with it) and its silent group.
    let probes = degrees
        .iter()
        .map(|&tp| {
            let mut vs = tch::nn::VarStore::new(device);
            let probe = probe_model(&vs, cfg, 1, Shard { index: 0, count: tp.max(1) })?;
            if let Some(kind) = precision.weights_kind() {
                vs.set_kind(kind);
            }
            Ok((vs, probe, (tp > 1).then(|| ProcessGroup::silent(tp))))
        })
        .collect::<Result<Vec<_>>>()?;
    let inputs: Vec<(Tensor, Tensor)> = sizes
        .iter()
        .map(|&b| (Tensor::randint(cfg.ntoken, [seq_len, b], (Kind::Int64, device)), Tensor::randn([seq_len, b, cfg.d_model], (hidden_kind, device))))
        .collect();
    // One piece's pass on one micro-batch: 0 the embedding, 1 the layer, 2 the output layer
    // and its loss.
    let pass = |degree: usize, piece: usize, tokens: &Tensor, hidden: &Tensor| -> Result<Tensor> {
        let (_, probe, silent) = &probes[degree];
        let group = silent.as_ref();
        precision::autocast(precision, device, || match piece {
            0 => probe.embed(tokens, true, Masks::Shared, group),
            1 => {
                let (_, layer) = probe.layers().next().expect("the probe has one layer");
                layer.forward_sharded(&hidden.detach().set_requires_grad(true), true, Masks::Shared, 0, group)
            }
            _ => {
                let logits = probe.decode(&hidden.detach().set_requires_grad(true), group)?;
                Ok(probe.loss_and_hits(&logits, tokens, group, false)?.0)
            }
        })
    };
    // The cells, degree by degree, then size, then piece, then forward alone and forward and
    // backward: the times come back in this order, which the rows below read in chunks.
    let cells: Vec<(usize, usize, usize, bool)> = (0..degrees.len())
        .flat_map(|degree| (0..inputs.len()).flat_map(move |size| (0..3).flat_map(move |piece| [false, true].map(|backward| (degree, size, piece, backward)))))
        .collect();
    let means = trimmed_means_in_rounds(cells.len(), |cell| {
        let (degree, size, piece, backward) = cells[cell];
        let (tokens, hidden) = &inputs[size];
        let start = Instant::now();
        if backward {
            pass(degree, piece, tokens, hidden)?.to_kind(Kind::Float).sum(Kind::Float).backward();
        } else {
            drop(tch::no_grad(|| pass(degree, piece, tokens, hidden))?);
        }
        crate::device::synchronize(device);
        Ok(start.elapsed().as_secs_f64())
    })?;
    let times = |forward_and_backward: &[f64]| {
        let forward_s = forward_and_backward[0];
        PassTimes { forward_s, backward_s: (forward_and_backward[1] - forward_s).max(0.0) }
    };
    Ok(means
        .chunks(inputs.len() * 3 * 2)
        .map(|degree| {
            degree
                .chunks(3 * 2)
                .zip(&sizes)
                .map(|(size, &micro_batch)| PieceTimes { micro_batch, embedding: times(&size[0..2]), layer: times(&size[2..4]), head: times(&size[4..6]) })
                .collect()
        })
        .collect())
}

/// The mean of [`Sampling::compute_samples`] samples of each of `cells` cells that `time` measures, less each
/// cell's fastest and slowest, after one untimed pass over all of them (the first pages in the
/// weights and grows the allocator's pools, which no later step pays). The samples are taken in
/// rounds over every cell, so that a slow spell of the machine as long as a round falls on at
/// most one sample of each cell rather than on every sample of some: the slowest, dropped.
/// A mean and not the median, because what the plan predicts is a mean (a run's step time is
/// its steps' mean, and its passes' sum): on a machine whose speed wanders (4,158 passes of one
/// layer on the 2-core VM, 2026-11-29: median 9.0 ms, mean 9.6 ms, the tenth slowest 12.4 ms)
/// a sum of medians comes out short.
fn trimmed_means_in_rounds(cells: usize, mut time: impl FnMut(usize) -> Result<f64>) -> Result<Vec<f64>> {
    let kept = Sampling::DEFAULT.compute_samples;
    let mut samples = vec![Vec::with_capacity(kept); cells];
    for round in 0..=kept {
        for (cell, times) in samples.iter_mut().enumerate() {
            let seconds = time(cell)?;
            if round > 0 {
                times.push(seconds);
            }
        }
    }
    Ok(samples.into_iter().map(|mut times| stats::trimmed_mean(&mut times)).collect())
}

/// How much slower the ranks of `host` (the ranks of one host) run the probe's forward and
/// backward pass (embedding, a layer, the output layer and the loss: the mix of a training
/// step) at `micro_batch` while every rank of the host runs it too than rank 0 alone
/// ([`sharing_slowdown`]).
pub fn measure_sharing(cfg: &TransformerConfig, device: Device, seq_len: i64, micro_batch: i64, host: &ProcessGroup) -> Result<SharedCores> {
    let pass = timed_probe_pass(cfg, Precision::Full, device, seq_len, micro_batch)?;
    Ok(SharedCores { ranks: host.world_size(), slowdown: sharing_slowdown(host, pass)?, shard_waits: Vec::new() })
}

/// How much longer `pass` (one pass, returning its seconds; every rank's is the same work)
/// takes while every rank of `host` runs it at once than while rank 0 runs it alone: medians
/// of [`Sampling::sharing_rounds`] rounds each, every round started together, after one untimed pass. A round
/// together lasts as long as its slowest rank's pass, since what a step does together ends in
/// collectives that wait for the last rank. (Rank 0's own pass is not the figure: the
/// scheduler lets some ranks finish before others, and 4 ranks on 2 cores measured 1.77–1.88×
/// that way, below the 2× the cores' division sets, while the runs behaved as 2.2–2.5×.) The
/// rounds alone and together alternate, so that the machine's drift over the seconds this
/// takes falls on both alike: six profiles minutes apart gave 2.08–2.31× so, 1.59–2.30× with
/// every round alone first (2026-11-29).
pub fn sharing_slowdown(host: &ProcessGroup, mut pass: impl FnMut() -> Result<f64>) -> Result<f64> {
    let rounds = Sampling::DEFAULT.sharing_rounds;
    pass()?;
    let (mut alone, mut together) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..rounds {
        for everyone in [false, true] {
            host.barrier()?;
            let seconds = if everyone || host.rank() == 0 { pass()? } else { 0.0 };
            host.barrier()?;
            if everyone { &mut together } else { &mut alone }.push(seconds);
        }
    }
    let median_of_slowest = |times: Vec<f64>| -> Result<f64> {
        let mut slowest = Tensor::from_slice(&times);
        host.all_reduce(&mut slowest, ReduceOp::Max)?;
        Ok(stats::median(Vec::<f64>::try_from(slowest)?))
    };
    let (alone, together) = (median_of_slowest(alone)?, median_of_slowest(together)?);
    Ok(if alone > 0.0 { together / alone } else { 1.0 })
}

/// Times one encoder layer's shard of `tp` forward and backward at each of `micro_batches`,
/// without and with sequence parallelism, on every rank of `machine` at once, the ranks in
/// groups of `tp` consecutive ones (as shards are placed): [`Sampling::shard_wait_passes`] passes back to back with
/// the group's real collectives, then as many with silent ones, in [`Sampling::shard_wait_rounds`] rounds. Back to
/// back, as a step's passes run, so that every rank computes throughout; the difference per
/// pass is each [`ShardWait`] (the median round's, averaged over the ranks).
pub fn measure_shard_waits(
    cfg: &TransformerConfig,
    device: Device,
    seq_len: i64,
    micro_batches: &[i64],
    tp: usize,
    machine: &ProcessGroup,
) -> Result<Vec<ShardWait>> {
    let Sampling { shard_wait_passes: passes, shard_wait_rounds: rounds, .. } = Sampling::DEFAULT;
    let group = machine.split(machine.rank() / tp, machine.rank())?;
    let silent = ProcessGroup::silent(group.world_size());
    let mut waits = Vec::new();
    for sequence_parallel in [false, true] {
        for &micro_batch in micro_batches {
            // Under sequence parallelism a shard holds its rows of the (padded) sequence.
            let rows = if sequence_parallel { (seq_len + tp as i64 - 1) / tp as i64 } else { seq_len };
            let hidden = Tensor::randn([rows, micro_batch, cfg.d_model], (Kind::Float, device));
            let mut talking = timed_shard_pass(cfg, device, &hidden, sequence_parallel, group.rank(), &group)?;
            let mut quiet = timed_shard_pass(cfg, device, &hidden, sequence_parallel, 0, &silent)?;
            let back_to_back = |pass: &mut dyn FnMut() -> Result<f64>| -> Result<f64> {
                machine.barrier()?;
                let start = Instant::now();
                for _ in 0..passes {
                    pass()?;
                }
                Ok(start.elapsed().as_secs_f64())
            };
            talking()?;
            quiet()?;
            let mut differences = (0..rounds).map(|_| Ok(back_to_back(&mut talking)? - back_to_back(&mut quiet)?)).collect::<Result<Vec<f64>>>()?;
            waits.push((sequence_parallel, micro_batch, stats::upper_median(&mut differences) / passes as f64));
        }
    }
    let mut mean = Tensor::from_slice(&waits.iter().map(|w| w.2).collect::<Vec<f64>>());
    machine.all_reduce(&mut mean, ReduceOp::Sum)?;
    let mean = Vec::<f64>::try_from(mean / machine.world_size() as f64)?;
    Ok(waits
        .iter()
        .zip(mean)
        .map(|(&(sequence_parallel, micro_batch, _), layer_s)| ShardWait { tp, micro_batch, sequence_parallel, layer_s: layer_s.max(0.0) })
        .collect())
}

/// A timer of one encoder layer's shard `index` of `group`'s size, forward and backward on
/// `hidden` (this shard's rows of it under `sequence_parallel`), its collectives over `group`:
/// each call runs one pass and returns its seconds.
fn timed_shard_pass<'a>(
    cfg: &TransformerConfig,
    device: Device,
    hidden: &Tensor,
    sequence_parallel: bool,
    index: usize,
    group: &'a ProcessGroup,
) -> Result<impl FnMut() -> Result<f64> + 'a> {
    let vs = tch::nn::VarStore::new(device);
    let probe = probe_model(&vs, cfg, 1, Shard { index, count: group.world_size() })?;
    let probe = if sequence_parallel { probe.sequence_parallel()? } else { probe };
    let hidden = hidden.shallow_clone();
    Ok(move || -> Result<f64> {
        // The variables live in `vs`: keep it for as long as the timer.
        let _weights = &vs;
        let (_, layer) = probe.layers().next().expect("the probe has one layer");
        let start = Instant::now();
        let out = layer.forward_sharded(&hidden.detach().set_requires_grad(true), true, Masks::Shared, 0, Some(group))?;
        out.sum(Kind::Float).backward();
        crate::device::synchronize(device);
        Ok(start.elapsed().as_secs_f64())
    })
}

/// A timer of the probe's whole forward and backward pass (the embedding, a layer, the output
/// layer and its loss) at `micro_batch` in `precision` on `device`: each call runs one pass and
/// returns its seconds, the device waited for. What the sharing and the spread both repeat.
fn timed_probe_pass(cfg: &TransformerConfig, precision: Precision, device: Device, seq_len: i64, micro_batch: i64) -> Result<impl FnMut() -> Result<f64>> {
    let mut vs = tch::nn::VarStore::new(device);
    let probe = probe_model(&vs, cfg, 1, Shard::WHOLE)?;
    if let Some(kind) = precision.weights_kind() {
        vs.set_kind(kind);
    }
    let tokens = Tensor::randint(cfg.ntoken, [seq_len, micro_batch], (Kind::Int64, device));
    Ok(move || -> Result<f64> {
        // The variables live in `vs`: keep it for as long as the timer.
        let _weights = &vs;
        let (_, layer) = probe.layers().next().expect("the probe has one layer");
        let start = Instant::now();
        let loss = precision::autocast(precision, device, || -> Result<Tensor> {
            let hidden = probe.embed(&tokens, true, Masks::Shared, None)?;
            let logits = probe.decode(&layer.forward_masked(&hidden, true, Masks::Shared, 0), None)?;
            Ok(probe.loss_and_hits(&logits, &tokens, None, false)?.0)
        })?;
        loss.to_kind(Kind::Float).backward();
        crate::device::synchronize(device);
        Ok(start.elapsed().as_secs_f64())
    })
}

/// How unevenly the probe's forward and backward pass (the embedding, a layer, the output
/// layer and its loss) at `micro_batch` runs on `device`, pass after pass: the relative
/// standard deviation of [`Sampling::spread_passes`] passes' times, from their median absolute deviation (a
/// normal's σ is 1.4826 of it), so that one pass stalled by something rare does not set it.
pub fn measure_spread(cfg: &TransformerConfig, precision: Precision, device: Device, seq_len: i64, micro_batch: i64) -> Result<f64> {
    let mut pass = timed_probe_pass(cfg, precision, device, seq_len, micro_batch)?;
    pass()?;
    let times = (0..Sampling::DEFAULT.spread_passes).map(|_| pass()).collect::<Result<Vec<f64>>>()?;
    Ok(stats::relative_spread(&times))
}

/// The ranks' mean of each piece's times (the whole model's and each shard's), of the
/// optimizer's and of the passes' spread, on every rank (each rank timed its own, all at once).
pub fn mean_over_ranks(group: &ProcessGroup, local: Timings) -> Result<Timings> {
    let Timings { compute, shards, optimizer, spread } = local;
    let passes = |p: &PieceTimes| [p.embedding, p.layer, p.head];
    let all_pieces = || compute.iter().chain(shards.iter().flat_map(|s| &s.compute));
    let mut flat: Vec<f64> = all_pieces().flat_map(|p| passes(p).into_iter().flat_map(|t| [t.forward_s, t.backward_s])).collect();
    flat.extend([optimizer.seconds_per_parameter, optimizer.clip_seconds_per_parameter, spread]);
    let device = group.device(true);
    let mut sums = Tensor::from_slice(&flat).to_device(device);
    group.all_reduce(&mut sums, ReduceOp::Sum)?;
    let mean = Vec::<f64>::try_from(sums.to_device(Device::Cpu) / group.world_size() as f64)?;
    let (pieces, optimizer_mean) = mean.split_at(mean.len() - 3);
    let mut at = pieces.chunks_exact(2).map(|t| PassTimes { forward_s: t[0], backward_s: t[1] });
    let mut next = || at.next().expect("six times per micro-batch size");
    let mut mean_of = |sizes: &[PieceTimes]| -> Vec<PieceTimes> {
        sizes.iter().map(|p| PieceTimes { micro_batch: p.micro_batch, embedding: next(), layer: next(), head: next() }).collect()
    };
    let mean_compute = mean_of(&compute);
    let mean_shards = shards.iter().map(|s| ShardPieces { tp: s.tp, compute: mean_of(&s.compute) }).collect();
    Ok(Timings {
        compute: mean_compute,
        shards: mean_shards,
        optimizer: OptimizerTime { seconds_per_parameter: optimizer_mean[0], clip_seconds_per_parameter: optimizer_mean[1], ..optimizer },
        spread: optimizer_mean[2],
    })
}

/// What a rank times of its own: the pieces, whole and as shards, the optimizer's step and
/// the passes' spread.
#[derive(Debug, Clone, PartialEq)]
pub struct Timings {
    pub compute: Vec<PieceTimes>,
    pub shards: Vec<ShardPieces>,
    pub optimizer: OptimizerTime,
    pub spread: f64,
}

/// Times `kind`'s step, and clipping the gradients to a norm, over float32 parameters shaped
/// as `cfg`'s model of `nlayers` layers (its embedding and output layer and its layers, fewer
/// layers where they would pass `enough` parameters) on `device`: seconds per parameter of
/// each. The proportions matter: each tensor costs the step a few operations' overhead besides
/// its elements, and a narrow model's layers are many small tensors beside its embedding.
pub fn measure_optimizer(kind: OptimizerKind, cfg: &TransformerConfig, device: Device, nlayers: i64, enough: i64) -> Result<OptimizerTime> {
    let count = |nlayers| crate::models::param_count_formula(&TransformerConfig { nlayers, ..*cfg });
    let nlayers = nlayers.clamp(1, layers_reaching(cfg, enough));
    let vs = tch::nn::VarStore::new(device);
    probe_model(&vs, cfg, nlayers, Shard::WHOLE)?;
    let params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    for (_, p) in &params {
        // A gradient to step with: d(p·g)/dp = g.
        (p * Tensor::randn_like(p)).sum(Kind::Float).backward();
    }
    let timed = count(nlayers);
    let tensors: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
    // A norm no gradient reaches: every clip scales, as a clipped run's early steps do.
    let clip_s = median_seconds(device, Sampling::DEFAULT.median_runs, || {
        crate::optim::clip_grad_norm(&tensors, 1e-6);
        Ok(())
    })?;
    let mut optimizer = kind.build(params, 1e-4, 0.9, 0.0, OptimizerKernel::Auto);
    let step_s = median_seconds(device, Sampling::DEFAULT.median_runs, || optimizer.step())?;
    Ok(OptimizerTime { kind, seconds_per_parameter: step_s / timed as f64, clip_seconds_per_parameter: clip_s / timed as f64, parameters_timed: timed })
}

/// Times the exercises' gradient average (`GradientAverager`, buckets of `bucket_bytes`) over
/// `group` on the float32 gradients of `cfg`'s model of `nlayers` layers (fewer where they pass
/// `enough` parameters, as the optimizer is timed), every rank of `group` started together;
/// `link` is the group's measured link, whose all-reduce fit is set beside it.
pub fn measure_gradient_sync(
    group: &ProcessGroup,
    link: &LinkProfile,
    cfg: &TransformerConfig,
    device: Device,
    nlayers: i64,
    enough: i64,
    bucket_bytes: usize,
) -> Result<GradientSync> {
    let nlayers = nlayers.clamp(1, layers_reaching(cfg, enough));
    let vs = tch::nn::VarStore::new(device);
    probe_model(&vs, cfg, nlayers, Shard::WHOLE)?;
    let params: Vec<Tensor> = vs.trainable_variables();
    for p in &params {
        (p * Tensor::randn_like(p)).sum(Kind::Float).backward();
    }
    let parameters = crate::models::param_count_formula(&TransformerConfig { nlayers, ..*cfg });
    let averager = crate::comm::data_parallel::GradientAverager::new(bucket_bytes, false);
    let seconds = median_seconds(device, Sampling::DEFAULT.median_runs, || {
        group.barrier()?;
        averager.average(group, &params)
    })?;
    // Every rank's figure is rank 0's (each timed its own wait).
    let seconds = agree_samples(group, &[(parameters as f64, seconds)])?[0].1;
    let all_reduce_s = link.collectives[&Collective::AllReduce].seconds(Collective::AllReduce, parameters as f64 * 4.0, group.world_size());
    Ok(GradientSync { ranks: group.world_size(), parameters, seconds, all_reduce_s })
}

/// Layers of `cfg` that bring its parameters (embedding and output layer included) to at least
/// `enough`.
fn layers_reaching(cfg: &TransformerConfig, enough: i64) -> i64 {
    let count = |nlayers| crate::models::param_count_formula(&TransformerConfig { nlayers, ..*cfg });
    let layer = count(2) - count(1);
    ((enough - (count(1) - layer)) as f64 / layer as f64).ceil().max(1.0) as i64
}

/// Times every collective over `group` on `device` at message sizes `sizes` (bytes of float32)
/// and fits each; every rank of `group` takes part. Send-receive runs between the group's
/// first two ranks, the others waiting.
pub fn measure_link(group: &ProcessGroup, device: Device, scope: LinkScope, sizes: &[usize]) -> Result<LinkProfile> {
    let ranks = group.world_size();
    let mut collectives = BTreeMap::new();
    for collective in Collective::ALL {
        let mut samples = Vec::new();
        for &bytes in sizes {
            let elements = (bytes / 4).max(ranks) as i64 / ranks as i64 * ranks as i64;
            let mut tensor = Tensor::ones([elements], (Kind::Float, device));
            group.barrier()?;
            let seconds = median_seconds(device, Sampling::DEFAULT.median_runs, || {
                match collective {
                    Collective::AllReduce => group.all_reduce(&mut tensor, ReduceOp::Sum)?,
                    Collective::ReduceScatter => drop(group.reduce_scatter(&tensor, ReduceOp::Sum)?),
                    Collective::AllGather => drop(group.all_gather(&tensor.narrow(0, 0, elements / ranks as i64))?),
                    // A ping-pong: half of it is one send.
                    Collective::SendRecv => match group.rank() {
                        0 => {
                            group.send(&tensor, 1)?;
                            group.wait_sends()?;
                            group.recv(&mut tensor, 1)?;
                        }
                        1 => {
                            group.recv(&mut tensor, 0)?;
                            group.send(&tensor, 0)?;
                            group.wait_sends()?;
                        }
                        _ => {}
                    },
                }
                Ok(())
            })?;
            let seconds = if collective == Collective::SendRecv { seconds / 2.0 } else { seconds };
            samples.push(((elements * 4) as f64, seconds));
            // Keep the sums small: an all-reduce of ones doubles them each time.
            let _ = tensor.fill_(1.0);
        }
        // Every rank's fit is rank 0's (the ranks time slightly different waits).
        let agreed = agree_samples(group, &samples)?;
        collectives.insert(collective, CostFit::fit(collective, ranks, agreed));
    }
    let backend = group.backend_for(device)?.name().to_string();
    Ok(LinkProfile { scope, ranks, backend, collectives })
}

/// Rank 0's samples, on every rank of `group`.
fn agree_samples(group: &ProcessGroup, samples: &[(f64, f64)]) -> Result<Vec<(f64, f64)>> {
    let bytes = serde_json::to_vec(samples)?;
    let agreed = group.broadcast_bytes(&bytes, 0)?;
    Ok(serde_json::from_slice(&agreed)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> TransformerConfig {
        TransformerConfig { ntoken: 64, d_model: 16, nhead: 2, d_hid: 32, nlayers: 4, dropout: 0.1 }
    }

    #[test]
    fn a_slow_spell_as_long_as_a_round_moves_no_cells_time_and_ordinary_slowness_counts() {
        // 30 cells (5 degrees and sizes × 3 pieces × 2 passes, say) take 1 s each, except
        // while the machine is slowed 3× for as long as one round takes, starting anywhere:
        // every cell's time stays 1 s. (Had each cell's samples been taken together, the
        // spell would have slowed 5 cells' every sample.)
        let cells = 30;
        let timed = (Sampling::DEFAULT.compute_samples + 1) * cells;
        for spell_start in 0..timed - cells {
            let mut clock = 0;
            let means = trimmed_means_in_rounds(cells, |_| {
                clock += 1;
                Ok(if (spell_start..spell_start + cells).contains(&(clock - 1)) { 3.0 } else { 1.0 })
            })
            .unwrap();
            assert_eq!(means, vec![1.0; cells], "a spell from sample {spell_start}");
        }
        // The first pass over the cells is not kept: each cell's time is of its later samples,
        // the mean of all but the fastest and the slowest.
        let mut calls = vec![0; 4];
        let means = trimmed_means_in_rounds(4, |cell| {
            calls[cell] += 1;
            Ok(if calls[cell] == 1 { 100.0 } else { cell as f64 + calls[cell] as f64 })
        })
        .unwrap();
        assert_eq!(calls, vec![Sampling::DEFAULT.compute_samples + 1; 4]);
        assert_eq!(means, (0..4).map(|cell| cell as f64 + 2.0 + (Sampling::DEFAULT.compute_samples / 2) as f64).collect::<Vec<_>>());
        // Slower passes that are not a lone spell count: a median would say 1 s.
        let samples = [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 9.0];
        assert_eq!(samples.len(), Sampling::DEFAULT.compute_samples);
        let mut sample = 0;
        let means = trimmed_means_in_rounds(1, |_| {
            sample += 1;
            Ok(if sample == 1 { 100.0 } else { samples[sample - 2] })
        })
        .unwrap();
        assert_eq!(means, vec![1.4]);
    }

    #[test]
    fn the_pieces_are_timed_at_every_size_asked_forward_and_backward() {
        let rows = measure_compute(&tiny(), Precision::Full, Device::Cpu, 8, &[4, 1, 4], &[1]).unwrap().remove(0);
        assert_eq!(rows.iter().map(|r| r.micro_batch).collect::<Vec<_>>(), vec![1, 4]);
        for row in rows {
            for pass in [row.embedding, row.layer, row.head] {
                assert!(pass.forward_s > 0.0 && pass.backward_s >= 0.0 && pass.total().is_finite(), "{row:?}");
            }
        }
        // The model's own tensors: its layers, or as many as reach the count that is enough.
        let cfg = tiny();
        let count = |nlayers| crate::models::param_count_formula(&TransformerConfig { nlayers, ..cfg });
        let enough = count(3) - 1;
        assert_eq!(measure_optimizer(OptimizerKind::Adam, &cfg, Device::Cpu, 2, enough).unwrap().parameters_timed, count(2));
        let optimizer = measure_optimizer(OptimizerKind::Adam, &cfg, Device::Cpu, 12, enough).unwrap();
        assert_eq!(optimizer.parameters_timed, count(3));
        assert!(optimizer.seconds_per_parameter > 0.0 && optimizer.clip_seconds_per_parameter > 0.0, "{optimizer:?}");
    }
}
