//! A layout's predicted peak memory per rank and step time, from a machine's [`Profile`].
//!
//! - **Memory**: the estimator's per-operation accounting (`--estimate-memory`,
//!   [`TransformerJob`]), the busiest rank's total.
//! - **Compute**: the profile's pieces at the layout's micro-batch size; a tensor-parallel
//!   shard's as the profile timed a shard of that degree (else 1/tp of the whole's), and with
//!   recomputation a stage's backward pass runs its forward again.
//! - **Tensor-parallel talk**, inside each pass: Megatron's two all-reduces of a layer's
//!   activations forward and two backward (sequence parallelism: a reduce-scatter and an
//!   all-gather each, the same bytes), one for the embedding, one for the output layer's input.
//!   CPU ranks beyond their host's cores also wait at each for a partner's turn on a core, as
//!   the profile measured ([`super::profile::ShardWait`]), while the timeline has them crowded.
//! - **The pipeline**: the schedule's own timeline ([`super::timeline::simulate`]) over the
//!   stages' costs, the activations sent between devices on the link they cross.
//! - **Data parallelism**, after the last backward pass, not overlapped: the gradients
//!   all-reduced (DDP, Horovod), or reduce-scattered and the parameters all-gathered (ZeRO 1
//!   and 2: the same bytes), ZeRO-3 also all-gathering the parameters for the forward and the
//!   backward pass; HSDP that within a shard group and each rank's block all-reduced across
//!   the groups.
//! - **The optimizer**: the profile's seconds per parameter times the parameters this rank
//!   updates (ZeRO: its block).
//!
//! A group crosses hosts when its ranks do: ranks count shards fastest, then stages, then
//! replicas ([`crate::comm::layout`]), so shards stay inside a host, stages cross hosts where a
//! replica's model is larger than a host, and replicas where the job spans several hosts.
//! Groups of one kind talk at once, and those that cross hosts share each host's link: the
//! profile timed one group alone on it ([`Span`]).
use serde::Serialize;

use super::layouts::{Candidate, Space};
use super::profile::{Collective, CostFit, LinkScope, Profile, Recorded};
use super::timeline::{self, StageCosts};
use super::variability;
use crate::error::UsageError;
use crate::memory::estimate::TransformerJob;
use crate::parallel::costs::{Among, Talk};
use crate::pipeline::Partition;
use crate::precision::Precision;

/// A link's cost where the profile did not measure it, given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AssumedLink {
    pub latency_s: f64,
    pub bytes_per_second: f64,
}

/// What the costs of collectives come from: the profile's fits, or what is assumed for a link
/// it lacks.
#[derive(Debug, Clone)]
pub struct Links {
    within: Option<CostFitSet>,
    between: Option<CostFitSet>,
}

#[derive(Debug, Clone)]
enum CostFitSet {
    Measured(std::collections::BTreeMap<Collective, CostFit>),
    Assumed(AssumedLink),
}

impl CostFitSet {
    fn seconds(&self, collective: Collective, bytes: f64, ranks: usize) -> f64 {
        match self {
            _ if ranks < 2 => 0.0,
            CostFitSet::Measured(fits) => fits[&collective].seconds(collective, bytes, ranks),
            CostFitSet::Assumed(link) => link.latency_s + bytes * collective.bus_factor(ranks) / link.bytes_per_second,
        }
    }
}

impl Links {
    /// The profile's links, a link it lacks taken from `within` or `between` where given.
    pub fn of(profile: &Profile, within: Option<AssumedLink>, between: Option<AssumedLink>) -> Links {
        let pick = |scope: LinkScope, assumed: Option<AssumedLink>| match (profile.link(scope), assumed) {
            (_, Some(link)) => Some(CostFitSet::Assumed(link)),
            (Some(measured), None) => Some(CostFitSet::Measured(measured.collectives.clone())),
            (None, None) => None,
        };
        Links { within: pick(LinkScope::WithinHost, within), between: pick(LinkScope::BetweenHosts, between) }
    }

    fn link(&self, scope: LinkScope) -> Result<&CostFitSet, UsageError> {
        let (link, flag) = match scope {
            LinkScope::WithinHost => (&self.within, "--within-host-gbps"),
            LinkScope::BetweenHosts => (&self.between, "--between-hosts-gbps"),
        };
        link.as_ref().ok_or_else(|| {
            UsageError(format!(
                "the profile has no link {}: record it where the job will run (exercise3 profile over its ranks), or assume one with {flag}",
                scope.name()
            ))
        })
    }

    /// Seconds of `collective` on `bytes` among `ranks` over the link of `span`, its bytes
    /// sharing the link's bandwidth with the span's other groups (their latencies overlap).
    fn seconds(&self, span: Span, collective: Collective, bytes: f64, ranks: usize) -> Result<f64, UsageError> {
        if ranks < 2 {
            return Ok(0.0);
        }
        Ok(self.link(span.scope)?.seconds(collective, bytes * span.groups_sharing as f64, ranks))
    }
}

/// Where a kind of group talks, and how many groups of that kind share the link at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    pub scope: LinkScope,
    /// Groups of the kind that each host's link carries at once: 1 within a host (each
    /// measured with the host's ranks taking part), and between hosts one per rank offset
    /// below the groups' stride that the host holds, whose bytes all pass its one link.
    pub groups_sharing: usize,
}

impl Span {
    /// The span of groups of `members` ranks `stride` apart (shards 1, stages tp, replicas
    /// tp × pp) on hosts of `gpus` ranks: within a host while a group fits in one.
    pub fn of(members: usize, stride: usize, gpus: usize) -> Span {
        if members * stride > gpus {
            Span { scope: LinkScope::BetweenHosts, groups_sharing: stride.min(gpus).max(1) }
        } else {
            Span { scope: LinkScope::WithinHost, groups_sharing: 1 }
        }
    }
}

/// How often a stage's tensor-parallel shards meet per micro-batch, forward and backward: the
/// collectives that every shard of the group must reach before any goes on, in one encoder
/// layer, the embedding, and the output layer with its loss (as the model runs them: a test
/// counts them there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Meetings {
    pub layer: [f64; 2],
    pub embedding: [f64; 2],
    pub head: [f64; 2],
}

impl Meetings {
    pub fn of(sequence_parallel: bool) -> Meetings {
        if sequence_parallel {
            Meetings { layer: [4.0, 7.0], embedding: [1.0, 1.0], head: [3.0, 2.0] }
        } else {
            Meetings { layer: [2.0, 2.0], embedding: [1.0, 0.0], head: [2.0, 1.0] }
        }
    }
}

/// One layout's prediction.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub candidate: Candidate,
    /// The command that trains with it ([`Candidate::flags`]).
    pub command: String,
    /// The busiest rank's peak, bytes (the estimator's total: held throughout plus the larger
    /// of the passes and the update).
    pub memory_bytes: f64,
    pub step_s: f64,
    /// The busiest device's forward and backward passes, tensor-parallel talk included (CPU
    /// ranks: as slow as their host's busy ranks make them).
    pub compute_s: f64,
    /// What the pipeline's timeline leaves that device idle.
    pub bubble_s: f64,
    /// What the machine's variability adds (`Profile::spread`): ranks that wait for the
    /// slowest, a stage's shards at every pass, the stages for late hand-overs, the replicas at
    /// the gradients' average ([`super::variability`]).
    pub waits_s: f64,
    /// Data-parallel communication after the passes.
    pub exposed_comm_s: f64,
    /// Clipping the gradients and the optimizer's step.
    pub optimizer_s: f64,
    /// Of `compute_s`, the tensor-parallel collectives, and where CPU ranks outnumber the
    /// cores the shards' waits for their partners' turns on them.
    pub tp_comm_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs utilization against the plan's peak per rank, where it knows one.
    pub mfu: Option<f64>,
}

/// Predicts `candidate`'s memory and step time: the busiest rank's memory, then the step as
/// its pieces add up (the pipeline's timeline over the stages' compute and tensor-parallel
/// talk, the variability's waits, the data-parallel communication, the optimizer).
pub fn predict(profile: &Profile, links: &Links, space: &Space, candidate: &Candidate) -> Result<Prediction, UsageError> {
    let c = *candidate;
    let partition = Partition::even(space.model.nlayers, c.placement().stages()).map_err(|err| UsageError(format!("{err:#}")))?;
    let job = transformer_job(profile, space, &c, &partition);
    let memory_bytes = job.estimate().iter().map(|row| row.total).fold(0.0, f64::max);

    let cores = Cores::of(&profile.recorded, space, &c);
    let compute = stage_compute(profile, &c, &partition, &cores);
    let talk = TensorParallelTalk::of(profile, links, space, &c, &cores)?;
    let passes = StagePasses::of(&compute, &talk, &c, &partition);
    let busiest_tp_comm = passes.busiest_tp_comm(&c);
    let pipeline = pipeline(profile, links, space, &c, &cores, passes)?;
    // This rank's parameters: the busiest device's stages.
    let parameters = (0..c.pp).map(|device| c.placement().stages_of(device).map(|s| job.stage_parameters(s)).sum::<f64>()).fold(0.0, f64::max);
    let exposed = data_parallel_seconds(profile, links, space, &c, parameters)?;
    let optimizer_s = optimizer_seconds(profile, &c, parameters, cores.all_busy);

    let step_s = pipeline.line.seconds + pipeline.waits_s + exposed + optimizer_s;
    let global_tokens = profile.seq_len as f64 * (c.micro_batch as usize * c.chunks * c.dp) as f64;
    Ok(Prediction {
        candidate: c,
        command: c.flags(),
        memory_bytes,
        step_s,
        compute_s: pipeline.line.busiest,
        bubble_s: pipeline.line.idle,
        waits_s: pipeline.waits_s,
        exposed_comm_s: exposed,
        optimizer_s,
        tp_comm_s: busiest_tp_comm + pipeline.line.partner_waits,
        tokens_per_s: global_tokens / step_s,
        mfu: None,
    })
}

/// The job the memory estimator accounts for (`--estimate-memory`'s): the candidate's layout
/// of the space's model, trained as the profile's optimizer and precision train it.
fn transformer_job(profile: &Profile, space: &Space, c: &Candidate, partition: &Partition) -> TransformerJob {
    TransformerJob {
        config: space.model,
        bptt: profile.seq_len,
        batch: c.micro_batch * c.chunks as i64,
        chunks: c.chunks,
        accumulate: 1,
        sequence_parallel: c.sequence_parallel,
        state_shards: c.shard_group.unwrap_or(c.dp),
        replicas: c.dp,
        tp: c.tp,
        partition: partition.clone(),
        placement: c.placement(),
        schedule: c.schedule,
        checkpoint_activations: c.recompute,
        stages_share_a_device: false,
        keyed_masks: c.pp * c.tp > 1,
        sync: c.sync,
        optimizer_k: crate::memory::optimizer_bytes_per_parameter(profile.optimizer.kind, 0.9),
        update_bytes_per_parameter: crate::memory::update_bytes_per_parameter(profile.optimizer.kind),
        bucket_bytes: 25.0 * crate::memory::MIB,
        precision: space.precision,
        cuda: profile.recorded.device != "cpu",
        loss_chunks: None,
    }
}

/// How the job's CPU ranks share their hosts' cores. The profile's times are alone (or, timed
/// on several ranks of a host at once, as slow as that many busy ranks make them), and a
/// collective's were timed with every rank of the host taking part. 1 throughout on a GPU.
struct Cores<'a> {
    recorded: &'a Recorded,
    /// The slowdown the profile's pieces were timed under.
    timed_busy: f64,
    /// The slowdown while every rank of a pool computes.
    all_busy: f64,
    /// Groups of hosts whose ranks share one machine's cores.
    pools: usize,
    hosts_per_pool: usize,
}

impl<'a> Cores<'a> {
    fn of(recorded: &'a Recorded, space: &Space, c: &Candidate) -> Cores<'a> {
        // Hosts that are one machine's namespaces share its cores as one pool.
        let hosts_per_pool = space.hosts_per_machine.clamp(1, space.nodes.max(1));
        let pools = space.nodes.max(1).div_ceil(hosts_per_pool);
        Cores {
            recorded,
            timed_busy: recorded.slowdown(recorded.compute_ranks_per_host as f64),
            all_busy: recorded.slowdown(c.world().div_ceil(pools) as f64),
            pools,
            hosts_per_pool,
        }
    }

    /// A time the profile measured, as the rank would take alone.
    fn alone(&self, t: f64) -> f64 {
        t / self.timed_busy
    }
}

/// Compute: one micro-batch's forward and backward seconds through each stage, alone and
/// without its tensor-parallel talk: a shard's own time where the profile timed shards of this
/// degree, else 1/tp of the whole's. With recomputation the executor keeps a stage's input
/// alone and runs the stage's whole forward again before its backward: the embedding and the
/// output layer with its loss too.
fn stage_compute(profile: &Profile, c: &Candidate, partition: &Partition, cores: &Cores) -> Vec<[f64; 2]> {
    let (pieces, share) = match profile.shard_pieces_at(c.tp, c.micro_batch) {
        Some(shard) if c.tp > 1 => (shard, 1.0),
        _ => (profile.pieces_at(c.micro_batch), c.tp as f64),
    };
    let stages = c.placement().stages();
    (0..stages)
        .map(|s| {
            let layers = partition.layers[s].clone().count() as f64;
            let mut f = layers * cores.alone(pieces.layer.forward_s) / share;
            let mut b = layers * cores.alone(pieces.layer.backward_s) / share;
            if s == 0 {
                f += cores.alone(pieces.embedding.forward_s) / share;
                b += cores.alone(pieces.embedding.backward_s) / share;
            }
            if s + 1 == stages {
                f += cores.alone(pieces.head.forward_s) / share;
                b += cores.alone(pieces.head.backward_s) / share;
            }
            if c.recompute {
                b += f;
            }
            [f, b]
        })
        .collect()
}

/// Tensor-parallel talk: what each of a stage's collectives over its shards' link costs, and
/// what its shards wait at each meeting for their partners' turns on crowded cores.
struct TensorParallelTalk {
    /// One collective over the link (Megatron's f or g), at the slowdown of all ranks busy.
    per_talk: f64,
    /// Where the machine's ranks outnumber its cores, the shards also wait at each meeting for
    /// their partners' turns on the cores, as measured for shards all computing at once (beyond
    /// the link's own time); the timeline charges the share its crowding at each moment says.
    per_meeting: f64,
    meetings: Meetings,
}

impl TensorParallelTalk {
    fn of(profile: &Profile, links: &Links, space: &Space, c: &Candidate, cores: &Cores) -> Result<TensorParallelTalk, UsageError> {
        let tokens = profile.seq_len as f64 * c.micro_batch as f64;
        let mixed = space.precision != Precision::Full;
        let activation_bytes = tokens * space.model.d_model as f64 * if mixed { 2.0 } else { 4.0 };
        let within = |collective, bytes| links.seconds(Span::of(c.tp, 1, space.gpus_per_node), collective, bytes, c.tp);
        // Megatron's f and g: two all-reduces forward, two backward per layer (sequence
        // parallel: a reduce-scatter and an all-gather each, the same bus bytes).
        let linked_talk = if c.sequence_parallel {
            within(Collective::ReduceScatter, activation_bytes)? + within(Collective::AllGather, activation_bytes)?
        } else {
            within(Collective::AllReduce, activation_bytes)?
        };
        let meetings = Meetings::of(c.sequence_parallel);
        let per_meeting = match &profile.recorded.shared {
            Some(shared) if c.tp > 1 => shared.shard_wait(c.tp, c.micro_batch, c.sequence_parallel).map_or(0.0, |layer_s| {
                let talks_per_meeting = if c.sequence_parallel { 2.0 } else { 1.0 };
                (layer_s / (meetings.layer[0] + meetings.layer[1]) - linked_talk / talks_per_meeting).max(0.0)
            }),
            _ => 0.0,
        };
        Ok(TensorParallelTalk { per_talk: linked_talk / cores.all_busy, per_meeting, meetings })
    }

    /// Stage `s`'s talks over the link in each pass, forward and backward: two per layer each
    /// way, the embedding's forward, the output layer's input backward (recomputation: the
    /// forward's again in the backward pass); and the meetings its shards wait at.
    fn of_stage(&self, c: &Candidate, partition: &Partition, s: usize) -> StageTalk {
        let stages = c.placement().stages();
        let layers = partition.layers[s].clone().count() as f64;
        let meetings = &self.meetings;
        let (mut forward, mut backward) = (2.0 * layers, 2.0 * layers);
        let mut met = [layers * meetings.layer[0], layers * meetings.layer[1]];
        if s == 0 {
            forward += 1.0;
            met = [met[0] + meetings.embedding[0], met[1] + meetings.embedding[1]];
        }
        if s + 1 == stages {
            backward += 1.0;
            met = [met[0] + meetings.head[0], met[1] + meetings.head[1]];
        }
        if c.recompute {
            backward += forward;
            met[1] += met[0];
        }
        StageTalk { forward, backward, met }
    }
}

/// How often one stage talks over its shards' link per micro-batch, and meets its partners.
struct StageTalk {
    forward: f64,
    backward: f64,
    met: [f64; 2],
}

/// Each stage's passes per micro-batch as the timeline runs them: its compute and its
/// tensor-parallel talk together, and its shards' waits for each other.
struct StagePasses {
    forward: Vec<f64>,
    backward: Vec<f64>,
    /// Forward and backward.
    waits: Vec<[f64; 2]>,
    /// Of the passes, the talk over the link.
    tp_comm: Vec<f64>,
}

impl StagePasses {
    fn of(compute: &[[f64; 2]], talk: &TensorParallelTalk, c: &Candidate, partition: &Partition) -> StagePasses {
        let stages = compute.len();
        let mut passes = StagePasses { forward: vec![0.0; stages], backward: vec![0.0; stages], waits: vec![[0.0; 2]; stages], tp_comm: vec![0.0; stages] };
        for (s, &[f, b]) in compute.iter().enumerate() {
            let talks = talk.of_stage(c, partition, s);
            passes.forward[s] = f + talks.forward * talk.per_talk;
            passes.backward[s] = b + talks.backward * talk.per_talk;
            passes.tp_comm[s] = (talks.forward + talks.backward) * talk.per_talk;
            passes.waits[s] = talks.met.map(|m| m * talk.per_meeting);
        }
        passes
    }

    /// The tensor-parallel talk of the busiest device's stages over all micro-batches.
    fn busiest_tp_comm(&self, c: &Candidate) -> f64 {
        (0..c.pp).map(|device| c.placement().stages_of(device).map(|s| self.tp_comm[s]).sum::<f64>() * c.chunks as f64).fold(0.0, f64::max)
    }
}

/// The pipeline's outcome: the schedule's timeline and what variability adds to it.
struct PipelineTime {
    line: timeline::Timeline,
    waits_s: f64,
}

/// The pipeline: the schedule's timeline over the stages' passes, the activations sent between
/// devices on the link they cross, and the waits the machine's variability adds.
fn pipeline(profile: &Profile, links: &Links, space: &Space, c: &Candidate, cores: &Cores, passes: StagePasses) -> Result<PipelineTime, UsageError> {
    // Activations between stages, float32 (a shard's rows of them with sequence parallelism);
    // a boundary crosses hosts where a replica's ranks outgrow one.
    let tokens = profile.seq_len as f64 * c.micro_batch as f64;
    let sent = tokens * space.model.d_model as f64 * 4.0 / if c.sequence_parallel { c.tp as f64 } else { 1.0 };
    let transfer = if c.pp > 1 { links.seconds(Span::of(c.pp, c.tp, space.gpus_per_node), Collective::SendRecv, sent, 2)? } else { 0.0 };
    let StagePasses { forward, backward, waits, .. } = passes;
    let costs =
        StageCosts { forward, backward, transfer, forward_waits: waits.iter().map(|w| w[0]).collect(), backward_waits: waits.iter().map(|w| w[1]).collect() };
    // Ranks count shards fastest, then pipeline devices, then replicas.
    let mut ranks = vec![vec![0.0; c.pp]; cores.pools];
    for rank in 0..c.world() {
        let pool = (rank / space.gpus_per_node / cores.hosts_per_pool).min(cores.pools - 1);
        ranks[pool][(rank / c.tp) % c.pp] += 1.0;
    }
    let slowdown = |busy: f64| cores.recorded.slowdown(busy);
    let crowding = |busy: f64| cores.recorded.crowding(busy);
    let sharing = timeline::Sharing { ranks, slowdown: &slowdown, crowding: &crowding };
    let line = timeline::simulate(c.schedule, c.placement(), c.chunks, &costs, &sharing);
    // Passes of uneven length: a replica's timeline drawn around its mean passes, and the
    // replicas waiting for the slowest of them at the gradients' average.
    let waits_s = if profile.spread > 0.0 {
        let varied = variability::replica_timeline(c.schedule, c.placement(), c.chunks, &costs, &sharing, profile.spread, c.tp);
        (varied.mean_s - line.seconds).max(0.0) + if c.dp > 1 { varied.sd_s * variability::expected_slowest(c.dp) } else { 0.0 }
    } else {
        0.0
    };
    Ok(PipelineTime { line, waits_s })
}

/// Data-parallel communication after the last backward pass, not overlapped: the style's
/// collectives (`Costs::communication`) on this rank's `parameters`' gradients, each timed over
/// its replicas' span of the machine, and the packing of the gradients into buckets and back.
fn data_parallel_seconds(profile: &Profile, links: &Links, space: &Space, c: &Candidate, parameters: f64) -> Result<f64, UsageError> {
    if c.dp == 1 {
        return Ok(0.0);
    }
    let gradient_bytes = parameters * 4.0;
    let replica = c.pp * c.tp;
    let state_shards = c.shard_group.unwrap_or(c.dp);
    let talk_seconds = |sum: f64, talk: Talk| -> Result<f64, UsageError> {
        let Among::Replicas { count, stride } = talk.among else {
            return Err(UsageError(format!("{:?} talks with ranks the planner does not lay out", c.sync)));
        };
        let collective = Collective::of(talk.collective).ok_or_else(|| UsageError(format!("the profile times no {:?}", talk.collective)))?;
        Ok(sum + talk.times * links.seconds(Span::of(count, stride * replica, space.gpus_per_node), collective, talk.bytes, count)?)
    };
    Ok(c.sync.strategy().communication(c.dp, state_shards, gradient_bytes).into_iter().try_fold(0.0, talk_seconds)?
        // Packing the gradients into buckets and back, beyond the collectives (as measured
        // for the exercises' average; ZeRO's buckets copy as much).
        + parameters * profile.gradient_sync.map_or(0.0, |sync| sync.overhead_seconds_per_parameter()))
}

/// The optimizer: clipping the gradients and the step, the profile's seconds per parameter
/// times the parameters this rank handles, every rank at once (so at all ranks' slowdown).
fn optimizer_seconds(profile: &Profile, c: &Candidate, parameters: f64, all_busy: f64) -> f64 {
    // A rank that updates its block of the parameters (ZeRO, HSDP) steps over that block alone.
    let sharded = c.sync.strategy().state_sharded();
    let state_shards = c.shard_group.unwrap_or(c.dp);
    let updated = if sharded { parameters / state_shards as f64 } else { parameters };
    // Without ZeRO each rank clips every gradient it holds.
    let clipped = if sharded { updated } else { parameters };
    (updated * profile.optimizer.seconds_per_parameter + clipped * profile.optimizer.clip_seconds_per_parameter) * all_busy
}

#[cfg(test)]
mod tests {
    use super::super::profile::{GradientSync, LinkProfile, OptimizerTime, PassTimes, PieceTimes, Recorded, ShardPieces, VERSION};
    use super::*;
    use crate::models::TransformerConfig;
    use crate::optim::OptimizerKind;
    use crate::parallel::GradientSync as Style;
    use crate::pipeline::Schedule;

    fn model() -> TransformerConfig {
        TransformerConfig { ntoken: 64, d_model: 32, nhead: 4, d_hid: 64, nlayers: 4, dropout: 0.0 }
    }

    /// A profile whose answer is known: a layer 1 s forward and 2 s backward per sequence of a
    /// micro-batch, the embedding, the output layer and the optimizer free, links of latency 0
    /// and `seconds_per_bus_byte`.
    fn profile(seconds_per_bus_byte: f64) -> Profile {
        let pass = |k: f64| PassTimes { forward_s: k, backward_s: 2.0 * k };
        let compute = [1, 2].iter().map(|&b| PieceTimes { micro_batch: b, embedding: pass(0.0), layer: pass(b as f64), head: pass(0.0) }).collect();
        let fit = |c| (c, CostFit { latency_s: 0.0, seconds_per_bus_byte, samples: vec![] });
        let link = LinkProfile { scope: LinkScope::WithinHost, ranks: 2, backend: "mpi".into(), collectives: Collective::ALL.into_iter().map(fit).collect() };
        Profile {
            version: VERSION,
            recorded: Recorded::one_cpu_rank("t"),
            model: model(),
            precision: Precision::Full,
            seq_len: 8,
            compute,
            optimizer: OptimizerTime { kind: OptimizerKind::Sgd, seconds_per_parameter: 0.0, clip_seconds_per_parameter: 0.0, parameters_timed: 1 },
            gradient_sync: None,
            shards: Vec::new(),
            spread: 0.0,
            links: vec![link],
        }
    }

    fn scaled(t: PassTimes, k: f64) -> PassTimes {
        PassTimes { forward_s: k * t.forward_s, backward_s: k * t.backward_s }
    }

    fn space(gpus: usize, batch: usize) -> Space {
        Space { nodes: 1, gpus_per_node: gpus, global_batch: batch, model: model(), precision: Precision::Full, hosts_per_machine: 1 }
    }

    fn candidate(dp: usize, pp: usize, tp: usize, chunks: usize, micro_batch: i64) -> Candidate {
        Candidate {
            dp,
            pp,
            tp,
            shard_group: None,
            sync: Style::Ddp,
            schedule: Schedule::GPipe,
            virtual_stages: 1,
            chunks,
            micro_batch,
            recompute: false,
            sequence_parallel: false,
        }
    }

    /// A machine whose passes vary (spread 0.1): a lone rank's passes back to back take their
    /// mean; two replicas wait for the slower at the average, 1/√π of a replica's standard
    /// deviation on average; two stages wait for each other's late passes; two shards for the
    /// slower shard at every pass. None of it where the profile measured no spread.
    #[test]
    fn ranks_of_a_varying_machine_wait_for_the_slowest() {
        let steady = profile(0.0);
        let varying = Profile { spread: 0.1, ..steady.clone() };
        let links = Links::of(&steady, None, None);
        let both = |space: Space, c: Candidate| (predict(&steady, &links, &space, &c).unwrap(), predict(&varying, &links, &space, &c).unwrap());

        let (plain, varied) = both(space(1, 2), candidate(1, 1, 1, 1, 2));
        assert_eq!(plain.waits_s, 0.0);
        // Two passes of 8 and 16 s, drawn: a few percent of error in the mean of 32 draws.
        assert!(varied.waits_s < 0.05 * plain.step_s && (varied.step_s - plain.step_s - varied.waits_s).abs() < 1e-9, "{varied:?}");

        let (plain, varied) = both(space(2, 2), candidate(2, 1, 1, 1, 1));
        // Each replica's passes: 4 and 8 s, sd 0.1 · √(4² + 8²) ≈ 0.89 s; the slower of two
        // ends 0.5642 of that past the mean, about 0.5 s.
        let expected = 0.1 * (16.0f64 + 64.0).sqrt() * 0.5642;
        assert!(plain.waits_s == 0.0 && (varied.waits_s / expected - 1.0).abs() < 0.4, "{varied:?} against {expected}");

        let (plain, varied) = both(space(2, 2), candidate(1, 2, 1, 2, 1));
        assert!(plain.waits_s == 0.0 && varied.waits_s > 0.01 * plain.step_s, "stages wait for late hand-overs: {varied:?}");
        let (plain, varied) = both(space(2, 2), candidate(1, 1, 2, 1, 2));
        // Every pass the later of two shards': 0.5642 · 0.1 of it on average.
        let expected = 0.1 * 0.5642 * plain.step_s;
        assert!(plain.waits_s == 0.0 && (varied.waits_s / expected - 1.0).abs() < 0.4, "{varied:?} against {expected}");
    }

    #[test]
    fn free_links_give_the_compute_the_layout_divides() {
        let p = profile(0.0);
        let links = Links::of(&p, None, None);
        // One rank, a micro-batch of 2: 4 layers × (2 + 4) s.
        let one = predict(&p, &links, &space(1, 2), &candidate(1, 1, 1, 1, 2)).unwrap();
        assert!((one.step_s - 24.0).abs() < 1e-9 && one.bubble_s == 0.0, "{one:?}");
        assert!((one.tokens_per_s - 16.0 / 24.0).abs() < 1e-12);
        // Two replicas of 1 sequence each: 4 × 3 s.
        let dp = predict(&p, &links, &space(2, 2), &candidate(2, 1, 1, 1, 1)).unwrap();
        assert!((dp.step_s - 12.0).abs() < 1e-9, "{dp:?}");
        // Two shards: half of each layer.
        let tp = predict(&p, &links, &space(2, 2), &candidate(1, 1, 2, 1, 2)).unwrap();
        assert!((tp.step_s - 12.0).abs() < 1e-9, "{tp:?}");
        // Unless the profile timed a shard of 2: then its own time (here 0.7 of the whole's
        // at every piece and size), 4 × 0.7 × 6 s; a shard of 4 it did not time stays 1/4.
        let shard_of = |tp: usize, k: f64| ShardPieces {
            tp,
            compute: p
                .compute
                .iter()
                .map(|w| PieceTimes { micro_batch: w.micro_batch, embedding: scaled(w.embedding, k), layer: scaled(w.layer, k), head: scaled(w.head, k) })
                .collect(),
        };
        let timed = Profile { shards: vec![shard_of(2, 0.7)], ..p.clone() };
        let slow_shards = predict(&timed, &links, &space(2, 2), &candidate(1, 1, 2, 1, 2)).unwrap();
        assert!((slow_shards.step_s - 16.8).abs() < 1e-9, "{slow_shards:?}");
        let four = predict(&timed, &links, &space(4, 4), &candidate(1, 1, 4, 1, 4)).unwrap();
        let four_untimed = predict(&p, &links, &space(4, 4), &candidate(1, 1, 4, 1, 4)).unwrap();
        assert_eq!(four.step_s, four_untimed.step_s);
        // Two stages of 2 layers, 2 micro-batches of 1: GPipe's (m + p − 1)(F + B) = 3 × 6 s,
        // of which each device idles 6.
        let pp = predict(&p, &links, &space(2, 2), &candidate(1, 2, 1, 2, 1)).unwrap();
        assert!((pp.step_s - 18.0).abs() < 1e-9 && (pp.bubble_s - 6.0).abs() < 1e-9, "{pp:?}");
        // Recomputation runs the forward pass again in the backward pass: 3 × (1 + 2 + 1) s.
        let recompute = predict(&p, &links, &space(2, 2), &Candidate { recompute: true, ..candidate(1, 2, 1, 2, 1) }).unwrap();
        assert!((recompute.step_s - 3.0 * 8.0).abs() < 1e-9, "{recompute:?}");
        // ... all of it, as the executor does: the output layer's forward and its loss too. An
        // output layer of 1 s forward and 1 s backward per sequence makes the last stage's
        // passes 3 and 5 s (backward 8 with recomputation, not 7), the first's 2 and 4 (6):
        // GPipe over 2 micro-batches is the first stage's forward, the last's 2 forwards and
        // 2 backwards, and the first's second backward: 2 + 2·3 + 2·5 + 4 = 22, and
        // 2 + 2·3 + 2·8 + 6 = 30 with recomputation.
        let mut heavy = profile(0.0);
        for piece in &mut heavy.compute {
            piece.head = PassTimes { forward_s: piece.micro_batch as f64, backward_s: piece.micro_batch as f64 };
        }
        let links = Links::of(&heavy, None, None);
        let plain = predict(&heavy, &links, &space(2, 2), &candidate(1, 2, 1, 2, 1)).unwrap();
        let again = predict(&heavy, &links, &space(2, 2), &Candidate { recompute: true, ..candidate(1, 2, 1, 2, 1) }).unwrap();
        assert!((plain.step_s - 22.0).abs() < 1e-9 && (again.step_s - 30.0).abs() < 1e-9, "{plain:?} {again:?}");
    }

    /// CPU ranks on a host of 2 cores, a thread each: 4 replicas compute at half speed, and
    /// clip and step at half speed; a pipeline's stages hand each other the bubble.
    #[test]
    fn ranks_that_share_a_hosts_cores_compute_at_their_share() {
        let optimizer = OptimizerTime { kind: OptimizerKind::Sgd, seconds_per_parameter: 1e-9, clip_seconds_per_parameter: 2e-9, parameters_timed: 1 };
        let shared = Profile { recorded: Recorded { cores: 2, ..profile(0.0).recorded }, optimizer, ..profile(0.0) };
        let links = Links::of(&shared, None, None);
        let params = crate::models::param_count_formula(&model()) as f64;
        // Alone, one sequence: 4 layers × 3 s; four replicas on 2 cores: twice that.
        let dp = predict(&shared, &links, &space(4, 4), &candidate(4, 1, 1, 1, 1)).unwrap();
        assert!((dp.compute_s - 24.0).abs() < 1e-9, "{dp:?}");
        assert!((dp.optimizer_s - 2.0 * 3e-9 * params).abs() < 1e-12 * params, "{dp:?}");
        // Two ranks on 2 cores: as alone.
        let two = predict(&shared, &links, &space(2, 2), &candidate(2, 1, 1, 1, 1)).unwrap();
        assert!((two.compute_s - 12.0).abs() < 1e-9, "{two:?}");
        // Two stages × 2 replicas on 2 cores, GPipe over 2 micro-batches: alone 3 × 6 s with
        // a third of each device idle. Shared, the 4 ranks' 48 s of work on 2 cores: never
        // 2 × 18 s, as the idle stage leaves its core to the busy one, and here never a core
        // idle, so 24 s.
        let pipeline = predict(&shared, &links, &space(4, 4), &candidate(2, 2, 1, 2, 1)).unwrap();
        let alone = predict(&profile(0.0), &links, &space(4, 4), &candidate(2, 2, 1, 2, 1)).unwrap();
        assert!((alone.step_s - alone.optimizer_s - 18.0).abs() < 1e-9, "{alone:?}");
        let line = pipeline.step_s - pipeline.optimizer_s;
        assert!((line - 24.0).abs() < 1e-9, "{pipeline:?}");
    }

    /// Shards on crowded cores wait for their partners at every meeting, as the profile
    /// measured per layer: 2 replicas of 2 shards (4 ranks) on 2 cores pay it at all 20 of a
    /// micro-batch's meetings (4 layers of 4, the embedding's 1, the output layer's 3), a
    /// fifth of a layer's wait each; with sequence parallelism 51 (4 of 11, 2, 5), an eleventh
    /// each. 2 shards alone on the 2 cores pay nothing.
    #[test]
    fn shards_on_crowded_cores_wait_for_their_partners_at_every_meeting() {
        use super::super::profile::{ShardWait, SharedCores};
        let wait = |sequence_parallel, layer_s| ShardWait { tp: 2, micro_batch: 1, sequence_parallel, layer_s };
        let shared = SharedCores { ranks: 4, slowdown: 2.0, shard_waits: vec![wait(false, 0.4), wait(true, 1.1)] };
        let quiet = Profile { recorded: Recorded { cores: 2, ..profile(0.0).recorded }, ..profile(0.0) };
        let crowded = Profile { recorded: Recorded { shared: Some(shared), ..quiet.recorded.clone() }, ..quiet.clone() };
        let links = Links::of(&quiet, None, None);
        let extra = |space: Space, c: Candidate| {
            let (a, b) = (predict(&crowded, &links, &space, &c).unwrap(), predict(&quiet, &links, &space, &c).unwrap());
            assert!((a.tp_comm_s - b.tp_comm_s - (a.compute_s - b.compute_s)).abs() < 1e-9, "the waits are tensor-parallel talk: {a:?} {b:?}");
            a.compute_s - b.compute_s
        };
        let replicas = candidate(2, 1, 2, 1, 1);
        assert!((extra(space(4, 2), replicas) - 20.0 * 0.1).abs() < 1e-9);
        assert!((extra(space(4, 2), Candidate { sequence_parallel: true, ..replicas }) - 51.0 * 0.1).abs() < 1e-9);
        assert_eq!(extra(space(2, 1), candidate(1, 1, 2, 1, 1)), 0.0);
    }

    /// Two hosts that are namespaces of one machine of 2 cores: split evenly (1 core each),
    /// a stage's 2 shards always share a core; as one pool, a stage computing while the other
    /// idles (GPipe over one micro-batch) has both cores. Replicas all computing at once share
    /// the cores either way. Four hosts, two to a machine, make two pools.
    #[test]
    fn hosts_of_one_machine_share_its_cores_as_one_pool() {
        let machine = |cores| Profile { recorded: Recorded { cores, ..profile(0.0).recorded }, ..profile(0.0) };
        let free = AssumedLink { latency_s: 0.0, bytes_per_second: f64::INFINITY };
        let hosts = |pooled, batch| Space { nodes: 2, gpus_per_node: 2, hosts_per_machine: if pooled { 2 } else { 1 }, ..space(2, batch) };
        let step = |cores, pooled, batch, c: Candidate| {
            let p = machine(cores);
            predict(&p, &Links::of(&p, None, Some(free)), &hosts(pooled, batch), &c).unwrap()
        };
        // A micro-batch of 2 through 2 stages of 2 layers, each half a shard's: forward 2 s and
        // backward 4 s a stage, one after the other: 12 s alone.
        let pipeline = candidate(1, 2, 2, 1, 2);
        let split = step(1, false, 2, pipeline);
        let pooled = step(2, true, 2, pipeline);
        assert!((pooled.step_s - 12.0).abs() < 1e-9 && (split.step_s - 24.0).abs() < 1e-9, "{pooled:?} {split:?}");
        // 4 replicas of 4 layers × 3 s: 4 ranks on 2 cores, half speed.
        let replicas = candidate(4, 1, 1, 1, 1);
        let (split, pooled) = (step(1, false, 4, replicas), step(2, true, 4, replicas));
        assert!((pooled.compute_s - 24.0).abs() < 1e-9 && (split.compute_s - 24.0).abs() < 1e-9, "{pooled:?} {split:?}");
        // 4 hosts of one rank, machines of one core: 4 replicas at full speed on 4 machines,
        // half on 2 (2 hosts each), a quarter on one.
        let p = machine(1);
        let on = |hosts_per_machine| {
            let space = Space { nodes: 4, gpus_per_node: 1, hosts_per_machine, ..space(1, 4) };
            predict(&p, &Links::of(&p, None, Some(free)), &space, &replicas).unwrap().compute_s
        };
        assert_eq!([1, 2, 4].map(|h| (on(h) / 12.0 * 1e9).round() / 1e9), [1.0, 2.0, 4.0]);
    }

    #[test]
    fn collectives_cost_what_the_links_bandwidth_says_on_the_bytes_each_layout_moves() {
        let beta = 1e-6;
        let p = profile(beta);
        let links = Links::of(&p, None, None);
        let s = space(2, 2);
        // Two replicas: one all-reduce of every parameter's float32 gradient, 2(n−1)/n = 1 bus
        // byte per byte.
        let params = crate::models::param_count_formula(&model()) as f64;
        let dp = predict(&p, &links, &s, &candidate(2, 1, 1, 1, 1)).unwrap();
        assert!((dp.exposed_comm_s - 4.0 * params * beta).abs() < 1e-9 * params, "{dp:?}");
        // ZeRO-3: reduce-scatter and two all-gathers, (n−1)/n = ½ each: 1.5 of the above.
        let zero3 = predict(&p, &links, &s, &Candidate { sync: Style::zero(3), ..candidate(2, 1, 1, 1, 1) }).unwrap();
        assert!((zero3.exposed_comm_s / dp.exposed_comm_s - 1.5).abs() < 1e-9, "{zero3:?}");
        // Tensor parallelism: per layer 4 all-reduces of the activations (8 tokens × 32 × 4
        // bytes), plus the embedding's and the output layer's.
        let tp = predict(&p, &links, &s, &candidate(1, 1, 2, 1, 1)).unwrap();
        let activation = 8.0 * 32.0 * 4.0 * beta;
        assert!((tp.tp_comm_s - (4.0 * 4.0 + 2.0) * activation).abs() < 1e-12, "{tp:?}");
        // Sequence parallelism moves the same bytes in two halves.
        let sp = predict(&p, &links, &s, &Candidate { sequence_parallel: true, ..candidate(1, 1, 2, 1, 1) }).unwrap();
        assert!((sp.tp_comm_s - tp.tp_comm_s).abs() < 1e-12, "{sp:?}");
        // The gradient average as runs do it cost 3 ms more than its all-reduce over 1000
        // parameters: every data-parallel exchange pays 3 µs per parameter besides its
        // collectives; a layout without replicas pays nothing.
        let sync = GradientSync { ranks: 2, parameters: 1000, seconds: 0.005, all_reduce_s: 0.002 };
        let measured = Profile { gradient_sync: Some(sync), ..p.clone() };
        let copies = |c: Candidate| predict(&measured, &links, &s, &c).unwrap().exposed_comm_s - predict(&p, &links, &s, &c).unwrap().exposed_comm_s;
        assert!((copies(candidate(2, 1, 1, 1, 1)) - 3e-6 * params).abs() < 1e-12 * params);
        assert!((copies(Candidate { sync: Style::zero(3), ..candidate(2, 1, 1, 1, 1) }) - 3e-6 * params).abs() < 1e-12 * params);
        assert_eq!(copies(candidate(1, 1, 2, 1, 1)), 0.0);
        // Faster than its fit (noise): no negative cost.
        let faster = Profile { gradient_sync: Some(GradientSync { seconds: 0.001, ..sync }), ..p.clone() };
        assert_eq!(predict(&faster, &links, &s, &candidate(2, 1, 1, 1, 1)).unwrap().exposed_comm_s, dp.exposed_comm_s);
    }

    /// Groups of a kind talk at once, and between hosts their bytes share each host's one link
    /// (the profile timed one group alone on it). On 2 hosts of 2 ranks: 4 replicas are one
    /// group whose ring crosses the link once each way, as fast as alone; 2 stages × 2
    /// replicas are two pairs crossing at once, each at half the link, twice as long as on
    /// hosts of one rank each.
    #[test]
    fn groups_that_cross_hosts_at_once_share_the_link() {
        let within = Span { scope: LinkScope::WithinHost, groups_sharing: 1 };
        let between = |groups_sharing| Span { scope: LinkScope::BetweenHosts, groups_sharing };
        assert_eq!(Span::of(2, 1, 2), within, "a pair of shards inside a host");
        assert_eq!(Span::of(4, 1, 2), between(1), "4 replicas of one rank each");
        assert_eq!(Span::of(2, 2, 2), between(2), "2 replicas of 2 stages or 2 shards");
        assert_eq!(Span::of(2, 8, 4), between(4), "a host of 4 ranks holds 4 of the 8 groups");
        assert_eq!(Span::of(2, 2, 4), within, "2 replicas of 2 inside a host of 4");

        let p = profile(0.0);
        let links = Links::of(&p, None, Some(AssumedLink { latency_s: 0.0, bytes_per_second: 1e6 }));
        let hosts = |nodes, gpus| Space { nodes, gpus_per_node: gpus, ..space(1, 4) };
        let params = crate::models::param_count_formula(&model()) as f64;
        // One all-reduce among 4: 2(n−1)/n = 1.5 bus bytes per gradient byte.
        let dp = predict(&p, &links, &hosts(2, 2), &candidate(4, 1, 1, 1, 1)).unwrap();
        assert!((dp.exposed_comm_s - 1.5 * 4.0 * params / 1e6).abs() < 1e-9 * params, "{dp:?}");
        let shared = predict(&p, &links, &hosts(2, 2), &candidate(2, 2, 1, 2, 1)).unwrap();
        let alone = predict(&p, &links, &hosts(4, 1), &candidate(2, 2, 1, 2, 1)).unwrap();
        assert!(alone.exposed_comm_s > 0.0 && (shared.exposed_comm_s / alone.exposed_comm_s - 2.0).abs() < 1e-9, "{shared:?} against {alone:?}");
    }

    /// The planner's count of the shards' meetings is the model's: a shard of 2 run with a
    /// silent group of 2 counts its collectives, forward and backward.
    #[test]
    fn the_shards_meet_as_often_as_the_model_calls_collectives() {
        use crate::comm::tensor_parallel::Shard;
        use crate::comm::ProcessGroup;
        use crate::models::{Masks, PartSpan, TransformerPart};
        use tch::{Kind, Tensor};
        let cfg = TransformerConfig { ntoken: 64, d_model: 16, nhead: 2, d_hid: 32, nlayers: 1, dropout: 0.0 };
        let (seq, batch) = (7, 2);
        for sequence_parallel in [false, true] {
            let vs = tch::nn::VarStore::new(tch::Device::Cpu);
            let part = TransformerPart::new(&vs.root(), &cfg, PartSpan::whole(1), Shard { index: 0, count: 2 }, &mut |_| {}).unwrap();
            let part = if sequence_parallel { part.sequence_parallel().unwrap() } else { part };
            let group = ProcessGroup::silent(2);
            let calls = || {
                let s = group.comm_stats();
                (s.all_reduce.calls + s.all_gather.calls + s.reduce_scatter.calls + s.broadcast.calls) as f64
            };
            let rows = if sequence_parallel { (seq + 1) / 2 } else { seq };
            let tokens = Tensor::randint(cfg.ntoken, [seq, batch], (Kind::Int64, tch::Device::Cpu));
            let hidden = || Tensor::randn([rows, batch, cfg.d_model], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
            // [forward, backward] of one piece's pass.
            let count = |pass: &mut dyn FnMut() -> Tensor| {
                let before = calls();
                let out = pass();
                let forward = calls() - before;
                out.sum(Kind::Float).backward();
                [forward, calls() - before - forward]
            };
            let (_, layer) = part.layers().next().unwrap();
            let counted = Meetings {
                layer: count(&mut || layer.forward_sharded(&hidden(), true, Masks::Shared, 0, Some(&group)).unwrap()),
                embedding: count(&mut || part.embed(&tokens, true, Masks::Shared, Some(&group)).unwrap()),
                head: count(&mut || {
                    let logits = part.decode(&hidden(), Some(&group)).unwrap();
                    part.loss_and_hits(&logits, &tokens, Some(&group), false).unwrap().0
                }),
            };
            assert_eq!(counted, Meetings::of(sequence_parallel), "sequence parallel: {sequence_parallel}");
        }
    }

    /// The memory is the estimator's (`--estimate-memory`), tested against measured peaks in
    /// its own module; here, that each layout reaches it with its own settings.
    #[test]
    fn each_layout_is_estimated_with_its_own_settings() {
        let adam = OptimizerTime { kind: OptimizerKind::Adam, seconds_per_parameter: 0.0, clip_seconds_per_parameter: 0.0, parameters_timed: 1 };
        let p = Profile { seq_len: 256, optimizer: adam, ..profile(0.0) };
        // Wide enough for the optimizer state to outweigh ZeRO's buffers.
        let s = Space { model: TransformerConfig { d_model: 256, d_hid: 1024, ..model() }, ..space(2, 8) };
        let links = Links::of(&p, None, None);
        let memory = |c: Candidate| predict(&p, &links, &s, &c).unwrap().memory_bytes;
        let pipeline = candidate(1, 2, 1, 4, 2);
        assert!(memory(Candidate { recompute: true, ..pipeline }) < memory(pipeline));
        let shards = candidate(1, 1, 2, 1, 8);
        assert!(memory(Candidate { sequence_parallel: true, ..shards }) < memory(shards));
        let replicas = candidate(2, 1, 1, 1, 4);
        assert!(memory(Candidate { sync: Style::zero(3), ..replicas }) < memory(Candidate { sync: Style::zero(1), ..replicas }));
        assert!(memory(Candidate { sync: Style::zero(1), ..replicas }) < memory(replicas));
    }

    #[test]
    fn a_link_the_profile_lacks_is_a_usage_error_unless_assumed() {
        let p = profile(1e-6);
        let two_hosts = Space { nodes: 2, gpus_per_node: 1, ..space(1, 2) };
        let err = predict(&p, &Links::of(&p, None, None), &two_hosts, &candidate(2, 1, 1, 1, 1)).unwrap_err();
        assert!(err.0.contains("the profile has no link between hosts") && err.0.contains("--between-hosts-gbps"), "{}", err.0);
        let assumed = AssumedLink { latency_s: 0.0, bytes_per_second: 1e6 };
        let ok = predict(&p, &Links::of(&p, None, Some(assumed)), &two_hosts, &candidate(2, 1, 1, 1, 1)).unwrap();
        let params = crate::models::param_count_formula(&model()) as f64;
        assert!((ok.exposed_comm_s - 4.0 * params / 1e6).abs() < 1e-9 * params, "{ok:?}");
    }
}
