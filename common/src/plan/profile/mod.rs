//! A machine's profile for the layout planner: what one piece of the Transformer costs to run
//! forward and backward at a few micro-batch sizes in the run's precision, what the optimizer's
//! step costs per parameter, and what each collective costs on each kind of link (latency and
//! bandwidth, fitted to timings through the real engines: MPI for CPU tensors, NCCL for CUDA
//! ones). Written once where the hardware is (`exercise3 profile`), read anywhere: a profile
//! taken on a GPU node plans a GPU job from a laptop. JSON, versioned, readable by a person.
//!
//! This file is the format: the profile's types, reading and writing them, and what the
//! planner looks up in them. How each figure is measured is [`measure`].
mod measure;

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::error::UsageError;
use crate::models::TransformerConfig;
use crate::optim::OptimizerKind;
use crate::precision::Precision;

use super::stats;

pub use measure::{
    mean_over_ranks, measure_compute, measure_gradient_sync, measure_link, measure_optimizer, measure_shard_waits, measure_sharing, measure_spread,
    sharing_slowdown, Sampling, Timings,
};

/// The profile format's version: a reader refuses any other.
pub const VERSION: u32 = 1;

/// One machine's costs for one model shape and precision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub version: u32,
    /// Where and when it was measured.
    pub recorded: Recorded,
    /// The model the pieces were timed for (its layers are all alike: one is timed).
    pub model: TransformerConfig,
    pub precision: Precision,
    /// Tokens per sequence of a micro-batch.
    pub seq_len: i64,
    /// The pieces' times, one entry per micro-batch size, in increasing size.
    pub compute: Vec<PieceTimes>,
    pub optimizer: OptimizerTime,
    /// Collective costs on each kind of link the job had (none for a profile of one rank).
    pub links: Vec<LinkProfile>,
    /// The data-parallel gradient average as a run does it, within the first host (none for a
    /// profile of one rank per host).
    #[serde(default)]
    pub gradient_sync: Option<GradientSync>,
    /// Tensor-parallel shards' pieces, timed as the whole model's are (none in profiles that
    /// timed no shard: the plan then gives a shard 1/tp of the whole's time).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardPieces>,
    /// How unevenly equal work runs here: the relative standard deviation of one forward and
    /// backward pass's time, pass after pass ([`measure_spread`]). Ranks that meet wait for the
    /// slowest; the plan draws passes with this spread ([`super::variability`]). 0 in profiles
    /// that did not measure it: passes of their mean length.
    #[serde(default)]
    pub spread: f64,
}

/// The pieces of shard 0 of `tp` (1/tp of the heads, of the feed-forward width and of the
/// vocabulary) at each micro-batch size, its collectives left out (the plan adds the link's).
/// Its own time, because a shard's smaller products use the device less well: at small sizes a
/// shard takes more than 1/tp of the whole.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardPieces {
    pub tp: usize,
    pub compute: Vec<PieceTimes>,
}

/// The gradients' average as the exercises run it (`GradientAverager`: packed into 25 MiB
/// buckets, all-reduced, divided and copied back), timed over the model's gradients among the
/// first host's ranks, beside what the link's all-reduce fit predicts for the same bytes. The
/// difference is the copies' (and the buckets' latencies'): a cost per parameter of the rank
/// that every data-parallel exchange pays besides its collectives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradientSync {
    pub ranks: usize,
    pub parameters: i64,
    /// Median wall time of one average, every rank started together.
    pub seconds: f64,
    /// The within-host all-reduce fit's seconds for the same bytes among as many ranks.
    pub all_reduce_s: f64,
}

impl GradientSync {
    /// What the average costs beyond its all-reduce, per parameter (never below 0).
    pub fn overhead_seconds_per_parameter(&self) -> f64 {
        ((self.seconds - self.all_reduce_s) / self.parameters.max(1) as f64).max(0.0)
    }
}

/// Where a profile was measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recorded {
    /// `cpu`, or the GPU's name.
    pub device: String,
    /// LibTorch's intra-op threads (a CPU's figures depend on them).
    pub threads: usize,
    pub host: String,
    /// Seconds since the Unix epoch.
    pub unix_time: u64,
    /// How many ranks of a host timed the pieces at once (1: rank 0 alone). On CPU ranks that
    /// share a host's cores the pieces' times hold for a job with as many ranks per host.
    #[serde(default = "one")]
    pub compute_ranks_per_host: usize,
    /// The host's usable cores (0: not recorded). With `threads` and the ranks per host, what
    /// CPU ranks that share the cores each get ([`Recorded::slowdown`]).
    #[serde(default)]
    pub cores: usize,
    /// Where the machine's ranks outnumber its cores: what sharing them was measured to cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedCores>,
    /// How many of the job's hosts were one machine: network namespaces or containers of one
    /// kernel ([`crate::comm::hosts::this_machine`]), sharing its cores, as `make bench-plan
    /// HOSTS=2`'s. The sharing was measured over all their ranks, and a plan from the profile
    /// pools as many hosts' ranks on one machine's cores.
    #[serde(default = "one")]
    pub hosts_per_machine: usize,
}

/// How much slower ranks computed while `ranks` ranks of its host did than one alone, each
/// round of equal passes as long as its slowest rank's (measured by [`measure_sharing`]): more
/// than the cores' division alone, as the ranks also take turns on the cores, evict each
/// other's caches and share the memory bandwidth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedCores {
    pub ranks: usize,
    pub slowdown: f64,
    /// What tensor-parallel shards lost waiting for each other while those ranks computed, in
    /// groups of shards (measured by [`measure_shard_waits`]; none in profiles that did not).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shard_waits: Vec<ShardWait>,
}

/// What a layer's tensor-parallel shards lose waiting for each other while every rank of the
/// machine computes, in groups of `tp` shards, at one micro-batch size: more than the link's
/// fits say, which were timed among ranks that did nothing else. A shard that reaches a
/// collective while a partner is off its core waits for the partner's turn on it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ShardWait {
    pub tp: usize,
    pub micro_batch: i64,
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Seconds one layer's forward and backward pass took beyond the same pass with silent
    /// collectives, every rank computing.
    pub layer_s: f64,
}

impl SharedCores {
    /// [`ShardWait::layer_s`] of shards of `tp` at `micro_batch`, with or without sequence
    /// parallelism: the nearest measured degree's (the smaller on a tie), between its measured
    /// sizes on a line and beyond them as at the nearest (a wait for a turn on a core does not
    /// grow with the message). None where no degree was measured in that mode.
    pub fn shard_wait(&self, tp: usize, micro_batch: i64, sequence_parallel: bool) -> Option<f64> {
        let measured = || self.shard_waits.iter().filter(|w| w.sequence_parallel == sequence_parallel);
        let distance = |w: &ShardWait| ((w.tp as f64).ln() - (tp as f64).ln()).abs();
        let nearest = measured().min_by(|a, b| distance(a).total_cmp(&distance(b)).then(a.tp.cmp(&b.tp)))?.tp;
        let mut points: Vec<(f64, f64)> = measured().filter(|w| w.tp == nearest).map(|w| (w.micro_batch as f64, w.layer_s)).collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let b = micro_batch as f64;
        Some(match points.iter().position(|p| p.0 >= b) {
            None => points[points.len() - 1].1,
            Some(0) => points[0].1,
            Some(i) => {
                let ((x0, y0), (x1, y1)) = (points[i - 1], points[i]);
                y0 + (b - x0) / (x1 - x0) * (y1 - y0)
            }
        })
    }
}

impl Recorded {
    /// How much slower a CPU rank runs than alone while `busy` ranks of its host compute at
    /// once, each on `threads` threads: 1 while they have a core per thread; beyond, the
    /// measured cost of sharing ([`SharedCores`]) on a line from there, or where none was
    /// measured the cores divided evenly. 1 on a GPU (one rank each), or where the cores were
    /// not recorded.
    pub fn slowdown(&self, busy: f64) -> f64 {
        if self.device != "cpu" || self.cores == 0 {
            return 1.0;
        }
        let unshared = self.cores as f64 / self.threads.max(1) as f64;
        match self.shared {
            _ if busy <= unshared => 1.0,
            Some(SharedCores { ranks, slowdown, .. }) if ranks as f64 > unshared => 1.0 + (busy - unshared) * (slowdown - 1.0) / (ranks as f64 - unshared),
            _ => busy / unshared,
        }
    }

    /// What share of the shards' waits measured while `shared.ranks` ranks computed
    /// ([`SharedCores::shard_waits`]) a collective pays while `busy` ranks of its host compute,
    /// each on `threads` threads: none while they have a core per thread, all of it at the
    /// measured crowd, on a line between (and beyond). 0 where nothing was measured.
    pub fn crowding(&self, busy: f64) -> f64 {
        let unshared = self.cores as f64 / self.threads.max(1) as f64;
        match &self.shared {
            Some(shared) if self.device == "cpu" && shared.ranks as f64 > unshared && !shared.shard_waits.is_empty() => {
                ((busy - unshared) / (shared.ranks as f64 - unshared)).max(0.0)
            }
            _ => 0.0,
        }
    }
}

/// The most a profile may hold: a measured one is a few hundred kilobytes.
const MAX_PROFILE_BYTES: u64 = 64 << 20;

/// The first negative number in `value` (a profile's JSON) and where it is, as `a.b[2].c`.
fn first_negative(value: &serde_json::Value, at: String) -> Option<(String, f64)> {
    match value {
        serde_json::Value::Number(n) => n.as_f64().filter(|&x| x < 0.0).map(|x| (at, x)),
        serde_json::Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| first_negative(v, format!("{at}[{i}]"))),
        serde_json::Value::Object(fields) => fields.iter().find_map(|(k, v)| first_negative(v, if at.is_empty() { k.clone() } else { format!("{at}.{k}") })),
        _ => None,
    }
}

#[cfg(test)]
impl Recorded {
    /// One CPU rank of one thread, its cores not recorded: where the planner's tests start.
    pub(crate) fn one_cpu_rank(host: &str) -> Recorded {
        Recorded { device: "cpu".into(), threads: 1, host: host.into(), unix_time: 0, compute_ranks_per_host: 1, cores: 0, shared: None, hosts_per_machine: 1 }
    }
}

fn one() -> usize {
    1
}

/// Forward and backward seconds of one piece for one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PassTimes {
    pub forward_s: f64,
    pub backward_s: f64,
}

impl PassTimes {
    pub fn total(self) -> f64 {
        self.forward_s + self.backward_s
    }
}

/// The pieces' times at one micro-batch size: the embedding, one encoder layer, the output
/// layer with the loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PieceTimes {
    pub micro_batch: i64,
    pub embedding: PassTimes,
    pub layer: PassTimes,
    pub head: PassTimes,
}

/// The optimizer's step, per parameter (its update is elementwise: linear in the parameters),
/// and the gradients' clipping before it (the exercises' language-model recipe clips).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimizerTime {
    pub kind: OptimizerKind,
    pub seconds_per_parameter: f64,
    /// Clipping the gradients to a norm, per parameter (0 in profiles that did not time it).
    #[serde(default)]
    pub clip_seconds_per_parameter: f64,
    /// How many parameters the step was timed on.
    pub parameters_timed: i64,
}

/// Which link a group's collectives cross.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkScope {
    /// Ranks of one host (NVLink, shared memory).
    WithinHost,
    /// One rank on each of several hosts (the network).
    BetweenHosts,
}

/// The collectives the layouts use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collective {
    /// Data parallelism's gradients, tensor parallelism's f and g.
    AllReduce,
    /// ZeRO's gradients, sequence parallelism.
    ReduceScatter,
    /// ZeRO-3's parameters, sequence parallelism.
    AllGather,
    /// A pipeline's activations and their gradients, from one rank to the next.
    SendRecv,
}

impl LinkScope {
    pub fn name(self) -> &'static str {
        match self {
            LinkScope::WithinHost => "within a host",
            LinkScope::BetweenHosts => "between hosts",
        }
    }
}

impl Collective {
    /// The profiled collective that times a style's `collective` (a point-to-point message
    /// either way is a send-receive); None for one the profile does not time.
    pub fn of(collective: crate::comm::group::Collective) -> Option<Collective> {
        use crate::comm::group::Collective as Talk;
        match collective {
            Talk::AllReduce => Some(Collective::AllReduce),
            Talk::ReduceScatter => Some(Collective::ReduceScatter),
            Talk::AllGather => Some(Collective::AllGather),
            Talk::Send | Talk::Recv => Some(Collective::SendRecv),
            Talk::Broadcast => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::AllGather => "all-gather",
            Collective::SendRecv => "send/receive",
        }
    }

    pub const ALL: [Collective; 4] = [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather, Collective::SendRecv];

    /// The bytes each rank moves over its link for a message of `bytes` among `ranks`, as a
    /// multiple of `bytes` (nccl-tests' bus bandwidth factors: a ring all-reduce sends
    /// 2(n−1)/n of the message, a reduce-scatter or all-gather (n−1)/n of the whole, a send all
    /// of it).
    pub fn bus_factor(self, ranks: usize) -> f64 {
        let n = ranks as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::ReduceScatter | Collective::AllGather => (n - 1.0) / n,
            Collective::SendRecv => 1.0,
        }
    }
}

/// A collective's cost on one link: `latency_s + bus bytes × seconds_per_bus_byte` (the
/// alpha–beta model, fitted to the samples by least squares), and the samples it was fitted to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostFit {
    pub latency_s: f64,
    pub seconds_per_bus_byte: f64,
    /// (message bytes, seconds) as measured among the link's `ranks`.
    pub samples: Vec<(f64, f64)>,
}

impl CostFit {
    /// Fits `samples` of `collective` among `ranks`: a least-squares line through (bus bytes,
    /// seconds), its intercept kept at zero or above (a latency is never negative).
    pub fn fit(collective: Collective, ranks: usize, samples: Vec<(f64, f64)>) -> CostFit {
        let factor = collective.bus_factor(ranks);
        let points: Vec<(f64, f64)> = samples.iter().map(|&(bytes, s)| (bytes * factor, s)).collect();
        let (latency, slope) = stats::least_squares_line(&points);
        CostFit { latency_s: latency, seconds_per_bus_byte: slope.max(0.0), samples }
    }

    /// Predicted seconds of `collective` on a message of `bytes` among `ranks` (one rank:
    /// nothing to do).
    pub fn seconds(&self, collective: Collective, bytes: f64, ranks: usize) -> f64 {
        if ranks < 2 {
            return 0.0;
        }
        self.latency_s + bytes * collective.bus_factor(ranks) * self.seconds_per_bus_byte
    }
}

/// The collectives' costs on one kind of link, measured among `ranks` ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkProfile {
    pub scope: LinkScope,
    pub ranks: usize,
    /// `mpi` or `nccl`.
    pub backend: String,
    pub collectives: BTreeMap<Collective, CostFit>,
}

/// What a profile is for: a planner refuses a profile of another model or precision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProfileKey {
    pub model: TransformerConfig,
    pub precision: Precision,
}

impl Profile {
    /// Reads the profile at `path` for `key`: a usage error (one line, exit 2) where it cannot
    /// be read, is not a profile of this version, or was measured for another model shape or
    /// precision (its times would be another model's).
    pub fn read(path: &Path, key: Option<ProfileKey>) -> Result<Profile> {
        let shown = path.display();
        let bytes = crate::input::read(path, MAX_PROFILE_BYTES, "give --profile the file exercise3 profile wrote")
            .map_err(|err| UsageError(format!("cannot read the profile: {err:#}")))?;
        let text = String::from_utf8(bytes).map_err(|_| UsageError(format!("{shown} is not a profile (not UTF-8 text)")))?;
        let value = crate::input::json_value(&text).map_err(|err| UsageError(format!("{shown} is not a profile (not JSON: {err})")))?;
        if let Some((at, number)) = first_negative(&value, String::new()) {
            return Err(UsageError(format!("{shown}: `{at}` is {number}: a profile's times, sizes and counts are never negative (record it again)")).into());
        }
        let version = value.get("version").and_then(serde_json::Value::as_u64);
        if version != Some(VERSION as u64) {
            let found = version.map_or("none".to_string(), |v| v.to_string());
            return Err(UsageError(format!(
                "{shown} is a profile of version {found}; this planner reads version {VERSION}: record it again (exercise3 profile)"
            ))
            .into());
        }
        let profile: Profile = crate::input::json(text.as_bytes()).map_err(|err| UsageError(format!("{shown} is not a complete profile: {err}")))?;
        if profile.compute.is_empty() {
            return Err(UsageError(format!("{shown} times no micro-batch size")).into());
        }
        if let Some(key) = key {
            profile.check(path, key)?;
        }
        Ok(profile)
    }

    /// Refuses, with a usage error, a profile measured for another model shape or precision
    /// than `key`'s (`path`: where it was read from, for the message).
    pub fn check(&self, path: &Path, key: ProfileKey) -> Result<()> {
        let (shown, profile) = (path.display(), self);
        {
            let (m, w) = (&profile.model, &key.model);
            let shape = |c: &TransformerConfig| (c.ntoken, c.d_model, c.nhead, c.d_hid);
            if shape(m) != shape(w) {
                return Err(UsageError(format!(
                    "{shown} was measured for another model (vocabulary {}, --emsize {}, --nhead {}, --d-hid {}; this one: {}, {}, {}, {}): record one for this model",
                    m.ntoken, m.d_model, m.nhead, m.d_hid, w.ntoken, w.d_model, w.nhead, w.d_hid
                ))
                .into());
            }
            if profile.precision != key.precision {
                return Err(UsageError(format!(
                    "{shown} was measured in --precision {}, not {}: record one in this precision",
                    profile.precision.name(),
                    key.precision.name()
                ))
                .into());
            }
        }
        Ok(())
    }

    /// Writes the profile to `path` (atomically: a crash leaves the old file or the new one).
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        crate::output::write(path, text + "\n").with_context(|| format!("writing the profile {}", path.display()))
    }

    /// The pieces' times for a micro-batch of `micro_batch` sequences ([`interpolate`]d).
    pub fn pieces_at(&self, micro_batch: i64) -> PieceTimes {
        interpolate(&self.compute, micro_batch)
    }

    /// [`Profile::pieces_at`] of a shard of `tp`, where the profile timed that degree.
    pub fn shard_pieces_at(&self, tp: usize, micro_batch: i64) -> Option<PieceTimes> {
        self.shards.iter().find(|s| s.tp == tp).map(|s| interpolate(&s.compute, micro_batch))
    }

    /// The fit of `collective` on the link of `scope`, if the profile measured one.
    pub fn link(&self, scope: LinkScope) -> Option<&LinkProfile> {
        self.links.iter().find(|l| l.scope == scope)
    }

    /// A few lines for a person: the pieces at each size, the optimizer, the links.
    pub fn describe(&self) -> String {
        let mut lines = vec![format!(
            "profile of d_model {}, {} heads, d_hid {}, vocabulary {}, {} tokens per sequence, --precision {} on {} ({} threads, {}, {} cores; the pieces timed on {} rank(s) at once)",
            self.model.d_model,
            self.model.nhead,
            self.model.d_hid,
            self.model.ntoken,
            self.seq_len,
            self.precision.name(),
            self.recorded.device,
            self.recorded.threads,
            self.recorded.host,
            self.recorded.cores,
            self.recorded.compute_ranks_per_host
        )];
        if self.recorded.hosts_per_machine > 1 {
            lines.push(format!("{} hosts of one machine (one kernel): their ranks share its cores", self.recorded.hosts_per_machine));
        }
        if let Some(SharedCores { ranks, slowdown, shard_waits }) = &self.recorded.shared {
            lines.push(format!(
                "{ranks} ranks computing at once on those cores: {slowdown:.2}× as long as one alone (each round of equal passes as long as its slowest)"
            ));
            for (tp, sequence_parallel) in shard_waits.iter().map(|w| (w.tp, w.sequence_parallel)).collect::<std::collections::BTreeSet<_>>() {
                let waits: Vec<String> = shard_waits
                    .iter()
                    .filter(|w| (w.tp, w.sequence_parallel) == (tp, sequence_parallel))
                    .map(|w| format!("{:.2} ms at {}", 1e3 * w.layer_s, w.micro_batch))
                    .collect();
                let mode = if sequence_parallel { " with sequence parallelism" } else { "" };
                lines.push(format!("  shards of {tp}{mode} among them wait for each other {} per layer's pass (micro-batch)", waits.join(", ")));
            }
        }
        if self.spread > 0.0 {
            lines.push(format!(
                "equal passes vary by {:.1}% (relative standard deviation, pass after pass): ranks that meet wait for the slowest",
                100.0 * self.spread
            ));
        }
        lines.push("| micro-batch | embedding fwd+bwd (ms) | one layer fwd+bwd (ms) | output layer + loss fwd+bwd (ms) |".into());
        lines.push("|---:|---:|---:|---:|".into());
        for p in &self.compute {
            lines.push(format!("| {} | {:.3} | {:.3} | {:.3} |", p.micro_batch, 1e3 * p.embedding.total(), 1e3 * p.layer.total(), 1e3 * p.head.total()));
        }
        for shard in &self.shards {
            // A shard's layer against 1/tp of the whole's, at each size.
            let against: Vec<String> = shard
                .compute
                .iter()
                .map(|p| format!("{:.2}", p.layer.total() * shard.tp as f64 / self.pieces_at(p.micro_batch).layer.total().max(f64::MIN_POSITIVE)))
                .collect();
            let sizes: Vec<String> = shard.compute.iter().map(|p| p.micro_batch.to_string()).collect();
            lines.push(format!(
                "a shard of {}: one layer takes {} × 1/{} of the whole's at micro-batches {}",
                shard.tp,
                against.join(", "),
                shard.tp,
                sizes.join(", ")
            ));
        }
        lines.push(format!(
            "optimizer {}: {:.3} ns per parameter; clipping the gradients {:.3} ns per parameter",
            self.optimizer.kind.name(),
            1e9 * self.optimizer.seconds_per_parameter,
            1e9 * self.optimizer.clip_seconds_per_parameter
        ));
        for link in &self.links {
            for (collective, fit) in &link.collectives {
                let bandwidth = if fit.seconds_per_bus_byte > 0.0 { 1.0 / fit.seconds_per_bus_byte / 1e9 } else { f64::INFINITY };
                lines.push(format!(
                    "{}, {} over {} ranks ({}): latency {:.1} us, bus bandwidth {:.2} GB/s",
                    link.scope.name(),
                    collective.name(),
                    link.ranks,
                    link.backend,
                    1e6 * fit.latency_s,
                    bandwidth
                ));
            }
        }
        if let Some(sync) = self.gradient_sync {
            lines.push(format!(
                "the gradients' average as runs do it, over {} ranks: {:.2} ms for {} parameters, {:.2} ms of it beyond the all-reduce fit ({:.3} ns per parameter)",
                sync.ranks,
                1e3 * sync.seconds,
                sync.parameters,
                1e3 * (sync.seconds - sync.all_reduce_s).max(0.0),
                1e9 * sync.overhead_seconds_per_parameter()
            ));
        }
        lines.join("\n")
    }
}

/// The pieces' times at `micro_batch` from those measured at each size (`compute`, in
/// increasing size): measured at that size, or interpolated linearly between the two measured
/// sizes around it (extrapolated from the nearest two outside them), never below zero.
fn interpolate(compute: &[PieceTimes], micro_batch: i64) -> PieceTimes {
    if let Some(exact) = compute.iter().find(|p| p.micro_batch == micro_batch) {
        return *exact;
    }
    if compute.len() == 1 {
        // One size measured: proportional to the micro-batch.
        let only = compute[0];
        let k = micro_batch as f64 / only.micro_batch as f64;
        let scale = |t: PassTimes| PassTimes { forward_s: t.forward_s * k, backward_s: t.backward_s * k };
        return PieceTimes { micro_batch, embedding: scale(only.embedding), layer: scale(only.layer), head: scale(only.head) };
    }
    let upper = compute.iter().position(|p| p.micro_batch > micro_batch).unwrap_or(compute.len() - 1).max(1);
    let (a, b) = (compute[upper - 1], compute[upper]);
    let k = (micro_batch - a.micro_batch) as f64 / (b.micro_batch - a.micro_batch) as f64;
    let line = |x: f64, y: f64| (x + k * (y - x)).max(0.0);
    let pass = |x: PassTimes, y: PassTimes| PassTimes { forward_s: line(x.forward_s, y.forward_s), backward_s: line(x.backward_s, y.backward_s) };
    PieceTimes { micro_batch, embedding: pass(a.embedding, b.embedding), layer: pass(a.layer, b.layer), head: pass(a.head, b.head) }
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    fn tiny() -> TransformerConfig {
        TransformerConfig { ntoken: 64, d_model: 16, nhead: 2, d_hid: 32, nlayers: 4, dropout: 0.1 }
    }

    fn profile(compute: Vec<PieceTimes>) -> Profile {
        Profile {
            version: VERSION,
            recorded: Recorded::one_cpu_rank("test"),
            model: tiny(),
            precision: Precision::Full,
            seq_len: 8,
            compute,
            optimizer: OptimizerTime { kind: OptimizerKind::Adam, seconds_per_parameter: 1e-9, clip_seconds_per_parameter: 0.0, parameters_timed: 1 },
            gradient_sync: None,
            shards: Vec::new(),
            spread: 0.0,
            links: Vec::new(),
        }
    }

    fn pieces(micro_batch: i64, seconds: f64) -> PieceTimes {
        let pass = PassTimes { forward_s: seconds, backward_s: 2.0 * seconds };
        PieceTimes { micro_batch, embedding: pass, layer: pass, head: pass }
    }

    /// A CPU rank runs as alone while its host has a core per thread; beyond, the measured cost
    /// of sharing on a line from there, or the cores divided evenly where none was measured;
    /// a GPU's ranks never share.
    #[test]
    fn ranks_beyond_the_cores_run_as_much_slower_as_sharing_was_measured_to_cost() {
        let even = Recorded { cores: 2, threads: 1, ..profile(Vec::new()).recorded };
        assert_eq!([1.0, 2.0, 3.0, 4.0].map(|b| even.slowdown(b)), [1.0, 1.0, 1.5, 2.0]);
        let measured = Recorded { shared: Some(SharedCores { ranks: 4, slowdown: 2.5, shard_waits: Vec::new() }), ..even.clone() };
        assert_eq!([2.0, 3.0, 4.0, 6.0].map(|b| measured.slowdown(b)), [1.0, 1.75, 2.5, 4.0]);
        let two_threads = Recorded { threads: 2, ..even.clone() };
        assert_eq!(two_threads.slowdown(2.0), 2.0);
        for other in [Recorded { cores: 0, ..even.clone() }, Recorded { device: "NVIDIA H100 80GB HBM3".into(), ..even }] {
            assert_eq!(other.slowdown(8.0), 1.0, "{other:?}");
        }
    }

    /// Shards' waits are looked up at the nearest measured degree and mode, on a line between
    /// measured sizes and flat beyond them; they count only where the ranks outnumber the
    /// cores, in full at the measured crowd.
    #[test]
    fn shards_wait_as_measured_at_the_nearest_degree_and_only_on_crowded_cores() {
        let wait = |tp, micro_batch, sequence_parallel, layer_s| ShardWait { tp, micro_batch, sequence_parallel, layer_s };
        let shared = SharedCores {
            ranks: 4,
            slowdown: 2.0,
            shard_waits: vec![wait(2, 1, false, 1.0), wait(2, 4, false, 4.0), wait(4, 1, false, 10.0), wait(2, 1, true, 0.5)],
        };
        assert_eq!(shared.shard_wait(2, 2, false), Some(2.0));
        assert_eq!((shared.shard_wait(2, 8, false), shared.shard_wait(2, 1, false)), (Some(4.0), Some(1.0)));
        assert_eq!(shared.shard_wait(8, 3, false), Some(10.0), "8 is nearest 4");
        assert_eq!(shared.shard_wait(3, 1, false), Some(10.0), "3 is nearer 4 than 2 (by ratio)");
        assert_eq!(shared.shard_wait(4, 16, true), Some(0.5), "the only degree measured with sequence parallelism");
        assert_eq!(SharedCores { shard_waits: Vec::new(), ..shared.clone() }.shard_wait(2, 1, false), None);
        let crowd = Recorded { cores: 2, threads: 1, shared: Some(shared.clone()), ..profile(Vec::new()).recorded };
        assert_eq!([1.0, 2.0, 3.0, 4.0, 6.0].map(|b| crowd.crowding(b)), [0.0, 0.0, 0.5, 1.0, 2.0]);
        let none_measured = Recorded { shared: Some(SharedCores { shard_waits: Vec::new(), ..shared }), ..crowd.clone() };
        assert_eq!(none_measured.crowding(4.0), 0.0);
        assert_eq!(Recorded { device: "NVIDIA H100 80GB HBM3".into(), ..crowd }.crowding(4.0), 0.0);
    }

    #[test]
    fn a_fit_recovers_the_line_it_was_drawn_from() {
        // 4 ranks: a ring all-reduce moves 1.5 × the message per rank.
        let (alpha, beta) = (20e-6, 1.0 / 10e9);
        let samples: Vec<(f64, f64)> = [4e3, 64e3, 1e6, 16e6].iter().map(|&b| (b, alpha + 1.5 * b * beta)).collect();
        let fit = CostFit::fit(Collective::AllReduce, 4, samples);
        assert!((fit.latency_s - alpha).abs() < 1e-9 && (fit.seconds_per_bus_byte / beta - 1.0).abs() < 1e-9, "{fit:?}");
        // The same link among 8 ranks: 1.75 × the message.
        assert!((fit.seconds(Collective::AllReduce, 1e6, 8) - (alpha + 1.75e6 * beta)).abs() < 1e-12);
        assert_eq!(fit.seconds(Collective::AllReduce, 1e6, 1), 0.0);
        // A line that would cross zero below: through the origin, never a negative latency.
        let fit = CostFit::fit(Collective::SendRecv, 2, vec![(1e3, 0.0), (1e6, 1e-3), (2e6, 2.1e-3)]);
        assert!(fit.latency_s >= 0.0 && fit.seconds_per_bus_byte > 0.0, "{fit:?}");
    }

    #[test]
    fn pieces_between_measured_sizes_are_interpolated_and_outside_extrapolated() {
        let p = profile(vec![pieces(1, 1.0), pieces(4, 4.0), pieces(8, 6.0)]);
        assert_eq!(p.pieces_at(4), pieces(4, 4.0));
        assert!((p.pieces_at(2).layer.forward_s - 2.0).abs() < 1e-12);
        assert!((p.pieces_at(6).head.backward_s - 10.0).abs() < 1e-12);
        assert!((p.pieces_at(16).layer.forward_s - 10.0).abs() < 1e-12);
        let one = profile(vec![pieces(2, 1.0)]);
        assert!((one.pieces_at(6).embedding.total() - 9.0).abs() < 1e-12);
    }

    #[test]
    fn a_shard_is_timed_alone_at_every_size_and_only_its_degree_is_read_from_it() {
        let degrees = measure_compute(&tiny(), Precision::Full, Device::Cpu, 8, &[1, 2], &[1, 2]).unwrap();
        assert_eq!(degrees.len(), 2, "the whole and the shard of 2");
        for rows in &degrees {
            assert_eq!(rows.iter().map(|r| r.micro_batch).collect::<Vec<_>>(), vec![1, 2]);
            assert!(rows.iter().all(|r| [r.embedding, r.layer, r.head].iter().all(|t| t.forward_s > 0.0 && t.total().is_finite())), "{rows:?}");
        }
        let p = Profile { shards: vec![ShardPieces { tp: 2, compute: vec![pieces(1, 0.5), pieces(4, 2.5)] }], ..profile(vec![pieces(1, 1.0), pieces(4, 4.0)]) };
        assert!((p.shard_pieces_at(2, 2).unwrap().layer.forward_s - (0.5 + 2.0 / 3.0)).abs() < 1e-12);
        assert_eq!(p.shard_pieces_at(2, 4), Some(pieces(4, 2.5)));
        assert_eq!(p.shard_pieces_at(4, 4), None, "a degree not timed");
        assert!(p.describe().contains("a shard of 2: one layer takes 1.00, 1.25 × 1/2 of the whole's at micro-batches 1, 4"), "{}", p.describe());
        let dir = tempfile::tempdir().unwrap();
        p.write(&dir.path().join("p.json")).unwrap();
        assert_eq!(Profile::read(&dir.path().join("p.json"), None).unwrap(), p);
    }

    #[test]
    fn a_profile_reads_back_and_a_mismatched_or_broken_one_is_one_usage_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profile.json");
        let p = profile(vec![pieces(1, 1.0)]);
        p.write(&path).unwrap();
        let key = ProfileKey { model: tiny(), precision: Precision::Full };
        assert_eq!(Profile::read(&path, Some(key)).unwrap(), p);
        let refused = |path: &Path, key: ProfileKey| {
            let err = Profile::read(path, Some(key)).unwrap_err();
            assert!(err.downcast_ref::<UsageError>().is_some(), "{err:#}");
            err.to_string()
        };
        let wider = ProfileKey { model: TransformerConfig { d_model: 32, ..tiny() }, ..key };
        assert!(refused(&path, wider).contains("was measured for another model (vocabulary 64, --emsize 16"));
        // The number of layers is the plan's to choose: a profile times one.
        assert!(Profile::read(&path, Some(ProfileKey { model: TransformerConfig { nlayers: 12, ..tiny() }, ..key })).is_ok());
        assert!(refused(&path, ProfileKey { precision: Precision::BHalf, ..key }).contains("was measured in --precision 32, not bf16-mixed"));
        std::fs::write(&path, "{\"version\": 0}").unwrap();
        assert!(refused(&path, key).contains("a profile of version 0; this planner reads version 1"));
        std::fs::write(&path, "not json").unwrap();
        assert!(refused(&path, key).contains("is not a profile (not JSON"));
        std::fs::write(&path, "{\"version\": 1, \"model\": 3}").unwrap();
        assert!(refused(&path, key).contains("is not a complete profile"));
        assert!(refused(&dir.path().join("absent.json"), key).contains("cannot read the profile"));
    }
}
