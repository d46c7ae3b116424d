//! Planning a layout before launch (issue: `exercise3 plan`): a machine's [`profile`] of what
//! the Transformer's pieces, its optimizer and its collectives cost, from which the planner
//! predicts every layout's memory and step time.
pub mod auto;
pub mod check;
pub mod layouts;
pub mod predict;
pub mod profile;
pub mod stats;
pub mod timeline;
pub mod variability;

use std::path::PathBuf;

use anyhow::Result;
use rayon::prelude::*;
use tch::Device;

use crate::comm::{hosts, Backend, ProcessGroup};
use crate::device::{self, DeviceChoice};
use crate::error::usage;
use crate::models::TransformerConfig;
use crate::optim::OptimizerKind;
use crate::precision::Precision;
use crate::train::Observers;
use profile::{LinkScope, Profile, Recorded, ShardPieces};

/// `exercise3 profile`: what to measure, and where to write it.
#[derive(Debug, Clone, clap::Args)]
pub struct ProfileArgs {
    /// Where to write the profile (JSON).
    #[arg(long)]
    pub out: PathBuf,
    /// Model width, d_model [the course's 1.4B model: 4096].
    #[arg(long, default_value_t = 4096)]
    pub emsize: i64,
    /// Feed-forward width of each layer.
    #[arg(long, default_value_t = 4096)]
    pub d_hid: i64,
    #[arg(long, default_value_t = 16)]
    pub nhead: i64,
    /// Vocabulary size [WikiText-2's under the tutorial's tokenizer: 28782].
    #[arg(long, default_value_t = 28_782)]
    pub vocab: i64,
    /// Round the vocabulary up to a multiple of N, as the run will (--pad-vocab).
    #[arg(long)]
    pub pad_vocab: Option<i64>,
    #[arg(long, default_value_t = 0.2)]
    pub dropout: f64,
    /// Encoder layers of the job: the pieces time one whatever it is (the plan stacks
    /// `exercise3 plan --nlayers`); the optimizer's step is timed over the model's embedding,
    /// output layer and this many layers (fewer where they pass 16 Mi parameters on a CPU,
    /// 256 Mi on a GPU: enough to time), since its cost per parameter follows the model's
    /// proportions.
    #[arg(long, default_value_t = 12)]
    pub nlayers: i64,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 35)]
    pub bptt: i64,
    /// Micro-batch sizes (sequences) to time the pieces at; the planner interpolates between them.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub micro_batches: Vec<i64>,
    #[arg(long, value_enum, default_value = "32")]
    pub precision: Precision,
    /// The optimizer whose step is timed.
    #[arg(long, value_enum, default_value = "adam")]
    pub optimizer: OptimizerKind,
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceChoice,
    /// Start N local ranks through mpirun, to time the collectives among them.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// The largest message the collectives are timed at, MiB.
    #[arg(long, default_value_t = 64)]
    pub max_message_mb: usize,
    /// LibTorch's threads per rank, as the job will run (0: as the exercises choose, the
    /// host's cores shared among its ranks).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Tensor-parallel degrees whose shard (1/tp of the heads, the feed-forward width and the
    /// vocabulary) is timed too, its arithmetic alone: those the model cuts into. The plan
    /// gives other degrees 1/tp of the whole's time.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    pub shards: Vec<usize>,
    /// Time the pieces and the optimizer on every rank at once (the profile keeps their mean)
    /// instead of on rank 0 alone, the others waiting. Alone is what the planner models CPU
    /// ranks that share a host's cores from (the profile records the cores); together, the
    /// times hold only for as many ranks per host as timed them.
    #[arg(long)]
    pub compute_together: bool,
}

impl ProfileArgs {
    /// The model the profile is for (its layer count is the plan's: one layer is timed).
    pub fn model(&self) -> TransformerConfig {
        let multiple = self.pad_vocab.unwrap_or(1).max(1);
        let ntoken = (self.vocab + multiple - 1) / multiple * multiple;
        TransformerConfig { ntoken, d_model: self.emsize, nhead: self.nhead, d_hid: self.d_hid, nlayers: 1, dropout: self.dropout }
    }

    /// The degrees of `--shards` whose shards the model has (beyond 1), in increasing order.
    fn shard_degrees(&self) -> Vec<usize> {
        let model = self.model();
        let mut degrees: Vec<usize> = self.shards.iter().copied().filter(|&tp| tp > 1 && model.validate_shards(tp).is_ok()).collect();
        degrees.sort_unstable();
        degrees.dedup();
        degrees
    }

    /// Checks what can be checked before anything is measured.
    fn check(&self) -> Result<()> {
        self.model().validate()?;
        if self.micro_batches.is_empty() || self.micro_batches.iter().any(|&b| b < 1) {
            return usage("--micro-batches takes sizes of 1 or more, comma-separated");
        }
        if self.nlayers < 1 {
            return usage(format!("--nlayers must be at least 1, got {}", self.nlayers));
        }
        if self.shards.contains(&0) {
            return usage("--shards takes tensor-parallel degrees of 1 or more, comma-separated");
        }
        if self.bptt < 1 {
            return usage(format!("--bptt must be at least 1, got {}", self.bptt));
        }
        if self.device == DeviceChoice::Both {
            return usage("--device both: a profile is of one device; record one for each");
        }
        if let Some(parent) = self.out.parent().filter(|p| !p.as_os_str().is_empty()) {
            crate::output::probe_folder(parent).map_err(|err| crate::error::UsageError(format!("--out {}: {err}", self.out.display())))?;
        }
        Ok(())
    }
}

/// Message sizes from 4 KiB to `max` bytes, ×8 apart (and `max` itself).
fn message_sizes(max: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = std::iter::successors(Some(4usize << 10), |s| Some(s * 8)).take_while(|&s| s < max).collect();
    sizes.push(max);
    sizes
}

/// Measures this machine's profile (rank 0's pieces and optimizer; the collectives among every
/// rank of `world`, within a host and, where the job spans several, between hosts) and writes
/// it to `--out`: rank 0 returns it, the other ranks None. What the user should know on the
/// way (`--threads` beyond the cores) goes to `observers` as warnings, on every rank.
pub fn measure(args: &ProfileArgs, world: &ProcessGroup, observers: &mut Observers) -> Result<Option<Profile>> {
    args.check()?;
    let device = match args.device {
        DeviceChoice::Cuda if !device::cuda_available() => return usage(device::no_cuda_message()),
        DeviceChoice::Cuda => world.device(true),
        _ => Device::Cpu,
    };
    let model = args.model();
    args.precision.check(device)?;
    // As a run of the exercises sets itself up: its threads, its allocator's settings.
    crate::device::keep_freed_host_memory();
    let threads = match args.threads {
        0 if device == Device::Cpu => (device::usable_cores() / world.local_world_size().max(1)).max(1),
        n => n,
    };
    if let Some(warning) = device::set_threads(threads)? {
        observers.warn(warning)?;
    }
    // The pieces and the optimizer on rank 0 alone: the planner shares a host's cores among
    // the ranks that compute at each moment of a step (a pipeline's idle stages leave theirs to
    // the busy ones), from the cores recorded here.
    let timing = args.compute_together || world.is_root();
    let mut local = if timing { Some(time_pieces(args, &model, device)?) } else { None };
    world.barrier()?;
    let per_host = world.local_world_size().max(1);
    let (shared, per_machine) = measure_shared_cores(args, world, &model, device, threads, per_host)?;
    if args.compute_together {
        local = local.map(|timings| profile::mean_over_ranks(world, timings)).transpose()?;
    }
    let links = measure_links(world, device, &message_sizes(args.max_message_mb << 20))?;
    let gradient_sync = measure_first_host_gradient_sync(args, world, &links, &model, device, per_host)?;
    world.barrier()?;
    let Some(profile::Timings { compute, shards, optimizer, spread }) = local.filter(|_| world.is_root()) else { return Ok(None) };
    let recorded = Recorded {
        device: crate::device::gpu_name(device).unwrap_or_else(|| crate::device::device_name(device).into()),
        threads: tch::get_num_threads() as usize,
        host: crate::comm::hosts::this_host(),
        unix_time: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        compute_ranks_per_host: if args.compute_together { world.local_world_size().max(1) } else { 1 },
        cores: if device == Device::Cpu { device::usable_cores() } else { 0 },
        shared,
        hosts_per_machine: (per_machine / per_host).max(1),
    };
    let profile = Profile {
        version: profile::VERSION,
        recorded,
        model,
        precision: args.precision,
        seq_len: args.bptt,
        compute,
        optimizer,
        links,
        gradient_sync,
        shards,
        spread,
    };
    profile.write(&args.out)?;
    Ok(Some(profile))
}

/// This rank's timings: the whole model's pieces and every shard's, in the same rounds (the
/// plan weighs one against the other), the optimizer's step, and the passes' spread.
fn time_pieces(args: &ProfileArgs, model: &TransformerConfig, device: Device) -> Result<profile::Timings> {
    let degrees: Vec<usize> = std::iter::once(1).chain(args.shard_degrees()).collect();
    let mut measured = profile::measure_compute(model, args.precision, device, args.bptt, &args.micro_batches, &degrees)?.into_iter();
    let compute = measured.next().expect("the whole is the first degree timed");
    let shards = degrees[1..].iter().zip(measured).map(|(&tp, compute)| ShardPieces { tp, compute }).collect();
    let enough = if device.is_cuda() { 256 << 20 } else { 16 << 20 };
    let optimizer = profile::measure_optimizer(args.optimizer, model, device, args.nlayers, enough)?;
    let mut sizes = args.micro_batches.clone();
    sizes.sort_unstable();
    let spread = profile::measure_spread(model, args.precision, device, args.bptt, sizes[sizes.len() / 2])?;
    Ok(profile::Timings { compute, shards, optimizer, spread })
}

/// What sharing a machine's cores costs, where its ranks outnumber them (None elsewhere): every
/// machine measures at once (rank 0's is recorded), at the middle micro-batch size. A machine
/// may hold several of the job's hosts (network namespaces, containers): their ranks share it.
/// Also how many ranks rank 0's machine holds. Every rank takes part.
fn measure_shared_cores(
    args: &ProfileArgs,
    world: &ProcessGroup,
    model: &TransformerConfig,
    device: Device,
    threads: usize,
    per_host: usize,
) -> Result<(Option<profile::SharedCores>, usize)> {
    let machines = machine_numbers(world, per_host)?;
    let ranks_on = |machine: usize| machines.iter().filter(|&&m| m == machine).count();
    let per_machine = ranks_on(machines[0]);
    let crowded = device == Device::Cpu && ranks_on(machines[world.rank()]) * threads > device::usable_cores();
    if !world.any_of(&[crowded])?[0] {
        return Ok((None, per_machine));
    }
    let machine = world.split(machines[world.rank()], world.rank())?;
    let mut sizes = args.micro_batches.clone();
    sizes.sort_unstable();
    let mut shared = profile::measure_sharing(model, device, args.bptt, sizes[sizes.len() / 2], &machine)?;
    // Shards wait for their partners' turns on the cores: every degree that divides the
    // machine's ranks, at every size.
    sizes.dedup();
    for tp in args.shard_degrees().into_iter().filter(|&tp| machine.world_size() % tp == 0) {
        shared.shard_waits.extend(profile::measure_shard_waits(model, device, args.bptt, &sizes, tp, &machine)?);
    }
    Ok((Some(shared), per_machine))
}

/// The gradient average as runs do it, among the first host's ranks (every rank there takes
/// part), beside its link's all-reduce fit; None on the other hosts' ranks and where the host
/// has no link. Every rank takes part in making the hosts' groups.
fn measure_first_host_gradient_sync(
    args: &ProfileArgs,
    world: &ProcessGroup,
    links: &[profile::LinkProfile],
    model: &TransformerConfig,
    device: Device,
    per_host: usize,
) -> Result<Option<profile::GradientSync>> {
    let within = world.split(world.rank() / per_host, world.rank())?;
    match links.iter().find(|l| l.scope == LinkScope::WithinHost) {
        Some(link) if world.rank() < per_host => {
            let enough = if device.is_cuda() { 256 << 20 } else { 16 << 20 };
            Ok(Some(profile::measure_gradient_sync(&within, link, model, device, args.nlayers, enough, DEFAULT_BUCKET_BYTES)?))
        }
        _ => Ok(None),
    }
}

/// The collectives' costs within a host (the first host's ranks) and between hosts (each
/// host's first rank), where there are ranks to talk: every rank takes part in making the
/// groups, only the measured group's ranks time.
fn measure_links(world: &ProcessGroup, device: Device, sizes: &[usize]) -> Result<Vec<profile::LinkProfile>> {
    if world.world_size() == 1 {
        return Ok(Vec::new());
    }
    let per_host = world.local_world_size().max(1);
    let (host, local_rank) = (world.rank() / per_host, world.rank() % per_host);
    let hosts = world.world_size().div_ceil(per_host);
    let within = world.split(host, world.rank())?;
    let between = world.split(local_rank, world.rank())?;
    let mut links = Vec::new();
    for (scope, group, measured) in
        [(LinkScope::WithinHost, &within, host == 0 && per_host > 1), (LinkScope::BetweenHosts, &between, local_rank == 0 && hosts > 1)]
    {
        let link = if measured { Some(profile::measure_link(group, device, scope, sizes)?) } else { None };
        world.barrier()?;
        links.extend(link);
    }
    Ok(links)
}

/// The exercises' default gradient bucket (`--bucket-mb 25`).
const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Step times closer than this (relative) tie: well inside the time model's error.
const TIE: f64 = 0.005;

/// `exercise3 plan`: the job to plan for.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// The machine's profile (exercise3 profile --out FILE).
    #[arg(long)]
    pub profile: PathBuf,
    /// Hosts of the job.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// GPUs (ranks) per host.
    #[arg(long)]
    pub gpus_per_node: usize,
    /// Memory of one GPU (rank): bytes, or with a unit (80GB, 80GiB, 512MiB).
    #[arg(long, value_parser = parse_bytes)]
    pub memory: f64,
    /// Sequences per optimizer step over all replicas.
    #[arg(long)]
    pub global_batch: usize,
    /// Encoder layers (the profile times one; the plan stacks them).
    #[arg(long, default_value_t = 12)]
    pub nlayers: i64,
    /// The model width the job trains (must be the profile's).
    #[arg(long)]
    pub emsize: Option<i64>,
    /// The precision the job trains in (must be the profile's).
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// Bandwidth to assume within a host, GB/s, where the profile measured none (one rank).
    #[arg(long)]
    pub within_host_gbps: Option<f64>,
    /// Bandwidth to assume between hosts, GB/s, where the profile measured none (one host).
    #[arg(long)]
    pub between_hosts_gbps: Option<f64>,
    /// Latency of an assumed link's collective, microseconds.
    #[arg(long, default_value_t = 10.0)]
    pub link_latency_us: f64,
    /// The cores each host gives its CPU ranks, where they are not the profile's host's (hosts
    /// that share one machine, or CPU nodes of another size).
    #[arg(long)]
    pub cores_per_node: Option<usize>,
    /// The hosts are network namespaces or containers of one machine (as `make test-cluster`'s):
    /// their CPU ranks share that machine's cores (the profile's host's, or --cores-per-node)
    /// as one pool, while what crosses hosts takes the link between them. Without it, as many
    /// hosts share a machine as did where the profile was taken (it tells from their kernel).
    #[arg(long)]
    pub hosts_share_cores: bool,
    /// How many of the best layouts to print.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Tokens of the whole training (3e11, say): the what-if figures for the fastest layout,
    /// machine time (hours, GPU-hours) at its predicted speed and the compute in PF-days.
    #[arg(long)]
    pub train_tokens: Option<f64>,
    /// Peak TFLOP/s of one GPU (rank), for the model FLOPs utilization (MFU) of each layout
    /// [the data sheet's for the profile's GPU, where the project knows it].
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Print the ranked layouts as JSON (for tools) instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Bytes from `80GB`, `80GiB`, `512MiB` or a plain number.
fn parse_bytes(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let split = text.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.trim().parse().map_err(|_| format!("`{text}` is not a size (80GB, 80GiB, 512MiB or bytes)"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024f64.powi(4),
        other => return Err(format!("`{other}` is not a unit of size (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")),
    };
    match value * scale {
        bytes if bytes > 0.0 && bytes.is_finite() => Ok(bytes),
        _ => Err(format!("`{text}`: a size must be positive")),
    }
}

/// The plan: every legal layout predicted, those that fit ranked by step time.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    pub nodes: usize,
    pub gpus_per_node: usize,
    pub memory_bytes: f64,
    pub global_batch: usize,
    pub model: TransformerConfig,
    pub seq_len: i64,
    pub precision: Precision,
    pub profile_device: String,
    /// How many legal layouts were predicted.
    pub layouts: usize,
    /// Those that fit, fastest first.
    pub ranked: Vec<predict::Prediction>,
    /// The peak TFLOP/s of one rank the MFU is reckoned against, and where it comes from.
    pub peak_tflops: Option<(f64, String)>,
    /// Training FLOPs per token of the model (6 per weight of its matrix products, and its
    /// attention's), recomputation not counted: model FLOPs, as MFU counts them.
    pub flops_per_token: f64,
    /// The fastest layout's figures for a whole training (`--train-tokens`).
    pub what_if: Option<WhatIf>,
    /// What the table rests on that the reader should know (a CPU profile timed with another
    /// number of ranks per host, an assumed link).
    pub notes: Vec<String>,
}

/// What a whole training costs at the fastest layout's predicted speed.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct WhatIf {
    pub train_tokens: f64,
    /// Wall-clock hours.
    pub hours: f64,
    /// Hours times the job's GPUs (ranks).
    pub gpu_hours: f64,
    /// The training's model FLOPs in petaFLOP/s-days (10^15 × 86,400 FLOPs each).
    pub pf_days: f64,
}

impl WhatIf {
    fn of(train_tokens: f64, tokens_per_s: f64, ranks: usize, flops_per_token: f64) -> WhatIf {
        let hours = train_tokens / tokens_per_s / 3600.0;
        WhatIf { train_tokens, hours, gpu_hours: hours * ranks as f64, pf_days: train_tokens * flops_per_token / (1e15 * 86_400.0) }
    }
}

/// Each rank's machine ([`hosts::machine_numbers`]), from every rank's kernel, gathered; a
/// rank that cannot tell counts as its host's (`per_host` ranks each, in rank order).
fn machine_numbers(world: &ProcessGroup, per_host: usize) -> Result<Vec<usize>> {
    let id = hosts::this_machine();
    let [high, low] = id.map_or([0, 0], |id| [(id >> 64) as u64 as i64, id as u64 as i64]);
    let mine = tch::Tensor::from_slice(&[high, low, i64::from(id.is_some())]);
    let ids: Vec<Option<u128>> = world
        .all_gather(&mine)?
        .iter()
        .map(|t| {
            let [high, low, known] = [0, 1, 2].map(|i| t.int64_value(&[i]));
            (known != 0).then_some(((high as u64 as u128) << 64) | low as u64 as u128)
        })
        .collect();
    Ok(hosts::machine_numbers(&ids, |rank| rank / per_host))
}

/// The most ranks (2^20, beyond the largest clusters) and sequences per step (2^24) a plan takes.
pub const MAX_RANKS: usize = 1 << 20;
pub const MAX_GLOBAL_BATCH: usize = 1 << 24;

/// Plans `args`' job from its profile: a usage error (exit 2) for a profile that cannot be
/// read or is another model's or precision's, for a link the job needs and the profile lacks,
/// and for a job no layout fits (saying by how much the smallest misses).
pub fn plan(args: &PlanArgs) -> Result<Plan> {
    check_plan_args(args)?;
    let (profile, model) = read_profile(args)?;
    let assumed = |gbps: Option<f64>| gbps.map(|g| predict::AssumedLink { latency_s: args.link_latency_us * 1e-6, bytes_per_second: g * 1e9 });
    let links = predict::Links::of(&profile, assumed(args.within_host_gbps), assumed(args.between_hosts_gbps));
    let space = layouts::Space {
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        global_batch: args.global_batch,
        model,
        precision: profile.precision,
        hosts_per_machine: if args.hosts_share_cores { args.nodes } else { profile.recorded.hosts_per_machine.clamp(1, args.nodes) },
    };
    let candidates = layouts::enumerate(&space);
    if candidates.is_empty() {
        return usage(format!(
            "no layout of {} ranks trains a global batch of {} sequences (the replicas must divide it)",
            args.nodes * args.gpus_per_node,
            args.global_batch
        ));
    }
    // On every core: each layout's timeline is drawn many times ([`variability`]), and a plan
    // for 64 GPUs has thousands of layouts. (Collected in the candidates' order: the ranking's
    // ties stay where they were.)
    let predictions = candidates.par_iter().map(|c| predict::predict(&profile, &links, &space, c)).collect::<Result<Vec<_>, _>>()?;
    let mut ranked = rank_those_that_fit(&predictions, args.memory)?;
    let peak_tflops = match args.peak_tflops {
        Some(peak) => Some((peak, "--peak-tflops".to_string())),
        None => crate::flops::gpu_peak_tflops(&profile.recorded.device, profile.precision, crate::precision::MatmulPrecision::Highest),
    };
    let flops_per_token = crate::flops::training_flops_per_token(&model, profile.seq_len);
    let ranks = args.nodes * args.gpus_per_node;
    if let Some((peak, _)) = &peak_tflops {
        for p in &mut ranked {
            p.mfu = Some(flops_per_token * p.tokens_per_s / (ranks as f64 * peak * 1e12));
        }
    }
    let what_if = args.train_tokens.map(|tokens| WhatIf::of(tokens, ranked[0].tokens_per_s, ranks, flops_per_token));
    let notes = plan_notes(args, &profile.recorded, &space);
    Ok(Plan {
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        memory_bytes: args.memory,
        global_batch: args.global_batch,
        model,
        seq_len: profile.seq_len,
        precision: profile.precision,
        profile_device: profile.recorded.device.clone(),
        layouts: predictions.len(),
        ranked,
        peak_tflops,
        flops_per_token,
        what_if,
        notes,
    })
}

/// Refuses sizes and figures no plan can take (a usage error), before any file is read.
fn check_plan_args(args: &PlanArgs) -> Result<()> {
    if args.nodes == 0 || args.gpus_per_node == 0 || args.global_batch == 0 || args.nlayers < 1 {
        return usage("--nodes, --gpus-per-node, --global-batch and --nlayers must be at least 1");
    }
    // The layouts are the divisors of these sizes, found by trial: bounded, they take
    // milliseconds; a typo of 10^12 would search for hours.
    if args.nodes.checked_mul(args.gpus_per_node).is_none_or(|ranks| ranks > MAX_RANKS) {
        return usage(format!("--nodes {} × --gpus-per-node {}: more than the {MAX_RANKS} ranks a plan may have", args.nodes, args.gpus_per_node));
    }
    if args.global_batch > MAX_GLOBAL_BATCH {
        return usage(format!("--global-batch {}: more than the {MAX_GLOBAL_BATCH} sequences a plan may have", args.global_batch));
    }
    let positive = [
        ("--train-tokens", args.train_tokens),
        ("--peak-tflops", args.peak_tflops),
        ("--within-host-gbps", args.within_host_gbps),
        ("--between-hosts-gbps", args.between_hosts_gbps),
    ];
    for (flag, value) in positive {
        if value.is_some_and(|v| !(v > 0.0 && v.is_finite())) {
            return usage(format!("{flag} must be a positive number, not {}", value.unwrap_or_default()));
        }
    }
    if !(args.link_latency_us >= 0.0 && args.link_latency_us.is_finite()) {
        return usage(format!("--link-latency-us must be a number of microseconds, 0 or more, not {}", args.link_latency_us));
    }
    Ok(())
}

/// The profile `args` name, with `--cores-per-node` in place of its host's cores, checked to be
/// of the job's model and precision; and the model the job stacks (`--nlayers` of its layers).
fn read_profile(args: &PlanArgs) -> Result<(Profile, TransformerConfig)> {
    let mut profile = Profile::read(&args.profile, None)?;
    match args.cores_per_node {
        Some(0) => return usage("--cores-per-node must be at least 1"),
        Some(cores) => profile.recorded.cores = cores,
        None => {}
    }
    let model = TransformerConfig { nlayers: args.nlayers, ..profile.model };
    let key = profile::ProfileKey {
        model: TransformerConfig { d_model: args.emsize.unwrap_or(model.d_model), ..model },
        precision: args.precision.unwrap_or(profile.precision),
    };
    profile.check(&args.profile, key)?;
    Ok((profile, model))
}

/// The layouts that fit in `memory` per rank, fastest first (the smaller of equally fast
/// first); a usage error saying by how much the smallest misses where none fits.
fn rank_those_that_fit(predictions: &[predict::Prediction], memory: f64) -> Result<Vec<predict::Prediction>> {
    let mut ranked: Vec<predict::Prediction> = predictions.iter().filter(|p| p.memory_bytes <= memory).cloned().collect();
    if ranked.is_empty() {
        let smallest = predictions.iter().min_by(|a, b| a.memory_bytes.total_cmp(&b.memory_bytes)).expect("a layout");
        return usage(format!(
            "no layout fits in {:.1} GiB per rank: the smallest needs {:.1} GiB ({}), {:.1} GiB more; add ranks or memory",
            gib(memory),
            gib(smallest.memory_bytes),
            smallest.candidate.flags(),
            gib(smallest.memory_bytes - memory)
        ));
    }
    ranked.sort_by(|a, b| a.step_s.total_cmp(&b.step_s).then(a.memory_bytes.total_cmp(&b.memory_bytes)));
    Ok(ranked)
}

/// What the reader of a plan should know about its figures: CPU ranks that share cores (or a
/// profile that cannot say how they do), and links assumed rather than measured.
fn plan_notes(args: &PlanArgs, recorded: &Recorded, space: &layouts::Space) -> Vec<String> {
    let mut notes = Vec::new();
    let timed_with = recorded.compute_ranks_per_host;
    if recorded.device == "cpu" && recorded.cores == 0 && timed_with != args.gpus_per_node {
        notes.push(format!(
            "note: the profile timed the pieces with {timed_with} rank(s) of a host at once and this plan puts {} on each: CPU ranks share their host's cores, so its compute times hold for {timed_with}",
            args.gpus_per_node
        ));
    } else if space.hosts_per_machine > 1 && recorded.slowdown((space.hosts_per_machine * args.gpus_per_node) as f64) > 1.0 {
        let why = if args.hosts_share_cores { "--hosts-share-cores" } else { "as where the profile was taken" };
        notes.push(format!(
            "note: {} hosts' {} CPU ranks of {} thread(s) share one machine's {} cores ({why}): a rank computes at the speed the machine's busy ranks leave it",
            space.hosts_per_machine,
            space.hosts_per_machine * args.gpus_per_node,
            recorded.threads,
            recorded.cores
        ));
    } else if space.hosts_per_machine == 1 && recorded.slowdown(args.gpus_per_node as f64) > 1.0 {
        notes.push(format!(
            "note: {} CPU ranks of {} thread(s) share each host's {} cores (the profile's host): a rank computes at the speed its host's busy ranks leave it",
            args.gpus_per_node, recorded.threads, recorded.cores
        ));
    }
    for (flag, gbps) in [("--within-host-gbps", args.within_host_gbps), ("--between-hosts-gbps", args.between_hosts_gbps)] {
        if let Some(gbps) = gbps {
            notes.push(format!("note: {flag} {gbps}: the link's costs are assumed, not measured ({} us latency)", args.link_latency_us));
        }
    }
    notes
}

fn gib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0 * 1024.0)
}

impl Plan {
    /// The plan as JSON, every fitting layout ranked (for tools).
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// The best `top` layouts as a table, and why the first wins.
    pub fn describe(&self, top: usize) -> String {
        let mut lines = vec![format!(
            "{} node(s) × {} GPU(s) of {:.1} GiB, global batch {} × {} tokens, {} layers of d_model {}, --precision {}, from a profile of {}: {} of {} layouts fit",
            self.nodes,
            self.gpus_per_node,
            gib(self.memory_bytes),
            self.global_batch,
            self.seq_len,
            self.model.nlayers,
            self.model.d_model,
            self.precision.name(),
            self.profile_device,
            self.ranked.len(),
            self.layouts
        )];
        lines.push("| # | layout | memory (GiB) | step (s) | tokens/s | compute | of it TP talk | bubble | waits | DP comm | optimizer |".into());
        lines.push("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|".into());
        for (i, p) in self.ranked.iter().take(top).enumerate() {
            lines.push(format!(
                "| {} | {} | {:.2} | {:.4} | {:.0} | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} |",
                i + 1,
                p.candidate.flags(),
                gib(p.memory_bytes),
                p.step_s,
                p.tokens_per_s,
                p.compute_s,
                p.tp_comm_s,
                p.bubble_s,
                p.waits_s,
                p.exposed_comm_s,
                p.optimizer_s
            ));
        }
        lines.push(self.why());
        lines.extend(self.what_if_line());
        lines.extend(self.notes.iter().cloned());
        lines.join("\n")
    }

    /// The fastest layout's machine time, compute and MFU for `--train-tokens`.
    fn what_if_line(&self) -> Option<String> {
        let w = self.what_if?;
        let best = &self.ranked[0];
        let ranks = self.nodes * self.gpus_per_node;
        let mfu = match (best.mfu, &self.peak_tflops) {
            (Some(mfu), Some((peak, source))) => format!("; MFU {:.1}% of {peak} TFLOP/s per GPU ({source})", 100.0 * mfu),
            _ => "; MFU unknown: no peak for this device (give --peak-tflops)".to_string(),
        };
        Some(format!(
            "what if: {:.3e} tokens at #1's {:.0} tokens/s take {:.1} hours ({:.1} days) on {ranks} GPU(s), {:.0} GPU-hours; {:.3e} model FLOPs = {:.2} PF-days{mfu}",
            w.train_tokens,
            best.tokens_per_s,
            w.hours,
            w.hours / 24.0,
            w.gpu_hours,
            w.train_tokens * self.flops_per_token,
            w.pf_days
        ))
    }

    /// Why the first layout wins: against the first layout predicted clearly slower, the part of
    /// the step that differs most. Layouts closer than [`TIE`] are said to tie: the model cannot
    /// tell them apart (ZeRO 1 and 2 move the same bytes, say).
    pub fn why(&self) -> String {
        let Some(best) = self.ranked.first() else { return String::new() };
        if self.ranked.len() == 1 {
            return format!("{} is the only layout that fits", best.candidate.flags());
        }
        let ties = self.ranked[1..].iter().take_while(|p| p.step_s <= best.step_s * (1.0 + TIE)).count();
        let tied = match ties {
            0 => String::new(),
            1 => format!("#2 ({}) ties with it (within {:.1}%, closer than the model can tell apart); ", self.ranked[1].candidate.flags(), 100.0 * TIE),
            n => format!("#2 to #{} tie with it (within {:.1}%, closer than the model can tell apart); ", n + 1, 100.0 * TIE),
        };
        let Some(next) = self.ranked.get(ties + 1) else { return format!("why #1 wins: it does not; {tied}no layout that fits is clearly slower") };
        let parts = [
            ("compute", best.compute_s - best.tp_comm_s, next.compute_s - next.tp_comm_s),
            ("tensor-parallel talk", best.tp_comm_s, next.tp_comm_s),
            ("pipeline bubble", best.bubble_s, next.bubble_s),
            ("waits for slower ranks", best.waits_s, next.waits_s),
            ("data-parallel communication", best.exposed_comm_s, next.exposed_comm_s),
            ("optimizer step", best.optimizer_s, next.optimizer_s),
        ];
        let (what, mine, theirs) = parts.iter().copied().max_by(|a, b| (a.2 - a.1).total_cmp(&(b.2 - b.1))).expect("parts");
        format!(
            "why #1 wins: {tied}{:.1}% faster than #{} ({}), most of it in {what} ({:.4} s against {:.4} s)",
            100.0 * (next.step_s / best.step_s - 1.0),
            ties + 2,
            next.candidate.flags(),
            mine,
            theirs
        )
    }
}

#[cfg(test)]
mod tests {
    use super::profile::{Collective, CostFit, LinkProfile, OptimizerTime, PassTimes, PieceTimes};
    use super::*;

    /// A profile of a small model on 2 ranks, a layer 1 ms per sequence forward and 2 ms
    /// backward, links of 1 GB/s.
    fn write_profile(dir: &std::path::Path) -> PathBuf {
        let pass = |k: f64| PassTimes { forward_s: 1e-3 * k, backward_s: 2e-3 * k };
        let compute =
            [1, 4].iter().map(|&b| PieceTimes { micro_batch: b, embedding: pass(0.1 * b as f64), layer: pass(b as f64), head: pass(0.5 * b as f64) }).collect();
        let fit = |c| (c, CostFit { latency_s: 1e-5, seconds_per_bus_byte: 1e-9, samples: vec![] });
        let profile = Profile {
            version: profile::VERSION,
            recorded: Recorded::one_cpu_rank("t"),
            model: TransformerConfig { ntoken: 64, d_model: 32, nhead: 4, d_hid: 64, nlayers: 1, dropout: 0.0 },
            precision: Precision::Full,
            seq_len: 16,
            compute,
            optimizer: OptimizerTime { kind: OptimizerKind::Adam, seconds_per_parameter: 1e-9, clip_seconds_per_parameter: 0.0, parameters_timed: 1 },
            gradient_sync: None,
            shards: Vec::new(),
            spread: 0.0,
            links: vec![LinkProfile {
                scope: LinkScope::WithinHost,
                ranks: 2,
                backend: "mpi".into(),
                collectives: Collective::ALL.into_iter().map(fit).collect(),
            }],
        };
        let path = dir.join("profile.json");
        profile.write(&path).unwrap();
        path
    }

    fn args(profile: PathBuf) -> PlanArgs {
        PlanArgs {
            profile,
            nodes: 1,
            gpus_per_node: 4,
            memory: 1e9,
            global_batch: 8,
            nlayers: 4,
            emsize: None,
            precision: None,
            within_host_gbps: None,
            between_hosts_gbps: None,
            link_latency_us: 10.0,
            cores_per_node: None,
            hosts_share_cores: false,
            top: 10,
            train_tokens: None,
            peak_tflops: None,
            json: false,
        }
    }

    fn refusal(args: &PlanArgs) -> String {
        let err = plan(args).unwrap_err();
        assert!(err.downcast_ref::<crate::error::UsageError>().is_some(), "{err:#}");
        err.to_string()
    }

    #[test]
    fn the_layouts_that_fit_are_ranked_fastest_first_and_the_winner_explained() {
        let dir = tempfile::tempdir().unwrap();
        let all = plan(&args(write_profile(dir.path()))).unwrap();
        assert!(all.ranked.len() == all.layouts && all.layouts > 20, "{}", all.describe(50));
        assert!(all.ranked.windows(2).all(|w| w[0].step_s <= w[1].step_s));
        // A memory between the smallest and the largest need: only what fits is ranked.
        let needs: Vec<f64> = all.ranked.iter().map(|p| p.memory_bytes).collect();
        let limit = (needs.iter().copied().fold(f64::MAX, f64::min) + needs.iter().copied().fold(0.0, f64::max)) / 2.0;
        let fitting = plan(&PlanArgs { memory: limit, ..args(write_profile(dir.path())) }).unwrap();
        assert!(fitting.ranked.len() < all.ranked.len() && fitting.ranked.iter().all(|p| p.memory_bytes <= limit));
        let text = fitting.describe(3);
        assert_eq!(text.lines().filter(|l| l.starts_with("| ")).count(), 1 + 3, "{text}");
        let slower = fitting.ranked.iter().position(|p| p.step_s > fitting.ranked[0].step_s * (1.0 + TIE)).expect("a slower layout");
        assert!(text.contains("why #1 wins: ") && text.contains(&format!("than #{} ({})", slower + 1, fitting.ranked[slower].candidate.flags())), "{text}");
        // Layouts predicted as fast tie, and the reason is given against the first one slower.
        let mut tied = fitting.clone();
        let first = tied.ranked[0].clone();
        tied.ranked[1] = predict::Prediction { step_s: first.step_s * 1.001, ..tied.ranked[1].clone() };
        let slower = predict::Prediction { step_s: first.step_s * 1.2, optimizer_s: first.optimizer_s + 0.2 * first.step_s, ..first.clone() };
        tied.ranked[2] = predict::Prediction { candidate: tied.ranked[2].candidate, ..slower };
        let why = tied.why();
        assert!(why.starts_with(&format!("why #1 wins: #2 ({}) ties with it (within 0.5%", tied.ranked[1].candidate.flags())), "{why}");
        assert!(why.contains(&format!("20.0% faster than #3 ({}), most of it in optimizer step", tied.ranked[2].candidate.flags())), "{why}");
        tied.ranked.truncate(2);
        assert!(tied.why().ends_with("no layout that fits is clearly slower"), "{}", tied.why());
        let json: serde_json::Value = serde_json::from_str(&fitting.to_json().unwrap()).unwrap();
        assert_eq!(json["ranked"].as_array().unwrap().len(), fitting.ranked.len());
    }

    /// `--cores-per-node` stands for the profile's host's cores: 4 CPU ranks of a thread on 2
    /// cores compute at half speed, and 8 on two hosts that share those 2 cores at half that
    /// (told by the flag, or by a profile taken on such hosts); 0 cores is a usage error.
    #[test]
    fn the_cores_a_host_gives_its_ranks_can_be_given_for_the_plan() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_profile(dir.path());
        let replicas = |plan: &Plan| {
            plan.ranked.iter().find(|p| p.candidate.dp == 4 && p.candidate.sync == crate::parallel::GradientSync::Ddp).expect("4 replicas").clone()
        };
        let own = plan(&args(path.clone())).unwrap();
        let two = plan(&PlanArgs { cores_per_node: Some(2), ..args(path.clone()) }).unwrap();
        assert!((replicas(&two).compute_s / replicas(&own).compute_s - 2.0).abs() < 1e-9, "{:?} {:?}", replicas(&two), replicas(&own));
        assert!(two.notes.iter().any(|n| n.contains("4 CPU ranks of 1 thread(s) share each host's 2 cores")), "{:?}", two.notes);
        // Two hosts of one machine (--hosts-share-cores): its 2 cores for all 8 ranks, said so.
        let machine = PlanArgs { nodes: 2, cores_per_node: Some(2), hosts_share_cores: true, between_hosts_gbps: Some(1.0), ..args(path.clone()) };
        let pooled = plan(&machine).unwrap();
        let eight = |plan: &Plan| {
            plan.ranked.iter().find(|p| p.candidate.dp == 8 && p.candidate.sync == crate::parallel::GradientSync::Ddp).expect("8 replicas").clone()
        };
        let split = plan(&PlanArgs { hosts_share_cores: false, ..machine.clone() }).unwrap();
        assert!((eight(&pooled).compute_s / eight(&split).compute_s - 2.0).abs() < 1e-9, "{:?} {:?}", eight(&pooled), eight(&split));
        assert!(
            pooled.notes.iter().any(|n| n.contains("2 hosts' 8 CPU ranks of 1 thread(s) share one machine's 2 cores (--hosts-share-cores)")),
            "{:?}",
            pooled.notes
        );
        // A profile taken on 2 hosts of one machine says so: the plan pools them without the
        // flag, as where the profile was taken.
        let mut taken = Profile::read(&path, None).unwrap();
        taken.recorded.hosts_per_machine = 2;
        let namespaces = dir.path().join("namespaces.json");
        taken.write(&namespaces).unwrap();
        let told = plan(&PlanArgs { profile: namespaces, hosts_share_cores: false, ..machine.clone() }).unwrap();
        assert!((eight(&told).compute_s / eight(&pooled).compute_s - 1.0).abs() < 1e-9, "{:?} {:?}", eight(&told), eight(&pooled));
        assert!(told.notes.iter().any(|n| n.contains("share one machine's 2 cores (as where the profile was taken)")), "{:?}", told.notes);
        assert!(refusal(&PlanArgs { cores_per_node: Some(0), ..args(path) }).contains("--cores-per-node must be at least 1"));
    }

    #[test]
    fn a_job_that_fits_nowhere_or_a_profile_that_does_not_match_is_one_usage_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_profile(dir.path());
        let tiny = refusal(&PlanArgs { memory: 1000.0, ..args(path.clone()) });
        assert!(tiny.contains("no layout fits in 0.0 GiB per rank: the smallest needs") && tiny.contains("more; add ranks or memory"), "{tiny}");
        assert!(refusal(&PlanArgs { emsize: Some(64), ..args(path.clone()) }).contains("was measured for another model"));
        assert!(refusal(&PlanArgs { precision: Some(Precision::BHalf), ..args(path.clone()) }).contains("was measured in --precision 32"));
        let two_hosts = refusal(&PlanArgs { nodes: 2, ..args(path.clone()) });
        assert!(two_hosts.contains("the profile has no link between hosts") && two_hosts.contains("--between-hosts-gbps"), "{two_hosts}");
        assert!(plan(&PlanArgs { nodes: 2, between_hosts_gbps: Some(10.0), ..args(path.clone()) }).is_ok());
        assert!(refusal(&PlanArgs { global_batch: 0, ..args(path.clone()) }).contains("must be at least 1"));
        assert!(refusal(&args(dir.path().join("absent.json"))).contains("cannot read the profile"));
    }

    #[test]
    fn the_what_if_figures_follow_from_the_fastest_layouts_speed_and_the_models_flops() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_profile(dir.path());
        // A CPU profile: no data sheet peak, no MFU, unless one is given.
        let plain = plan(&PlanArgs { train_tokens: Some(1e9), ..args(path.clone()) }).unwrap();
        assert!(plain.ranked.iter().all(|p| p.mfu.is_none()));
        assert!(plain.describe(3).contains("MFU unknown: no peak for this device (give --peak-tflops)"), "{}", plain.describe(3));
        // The profile timed one rank alone; the plan puts 4 on a host.
        assert!(plain.describe(3).contains("the profile timed the pieces with 1 rank(s) of a host at once and this plan puts 4 on each"));
        let assumed = plan(&PlanArgs { nodes: 2, between_hosts_gbps: Some(10.0), gpus_per_node: 1, ..args(path.clone()) }).unwrap();
        let text = assumed.describe(3);
        assert!(text.contains("note: --between-hosts-gbps 10: the link's costs are assumed") && !text.contains("rank(s) of a host at once"), "{text}");
        let p = plan(&PlanArgs { train_tokens: Some(1e9), peak_tflops: Some(2.0), ..args(path.clone()) }).unwrap();
        let (best, w) = (&p.ranked[0], p.what_if.unwrap());
        // 4 layers × (4·32² + 2·32·64) + 32·64 weights, 6 FLOPs each, and the attention's
        // 12 · 4 layers · 32 · 16 tokens.
        let flops = 6.0 * (4.0 * (4096.0 + 4096.0) + 2048.0) + 12.0 * 4.0 * 32.0 * 16.0;
        assert_eq!(p.flops_per_token, flops);
        assert!((w.hours * 3600.0 * best.tokens_per_s - 1e9).abs() < 1e-3, "{w:?}");
        assert!((w.gpu_hours - 4.0 * w.hours).abs() < 1e-9 && (w.pf_days - 1e9 * flops / 8.64e19).abs() < 1e-15, "{w:?}");
        for row in &p.ranked {
            assert!((row.mfu.unwrap() - flops * row.tokens_per_s / (4.0 * 2e12)).abs() < 1e-15);
        }
        let text = p.describe(3);
        assert!(
            text.contains("what if: 1.000e9 tokens at #1's")
                && text.contains("GPU-hours")
                && text.contains("PF-days; MFU ")
                && text.contains("(--peak-tflops)"),
            "{text}"
        );
        // An H100's profile is reckoned against its data sheet's bfloat16 peak.
        assert_eq!(crate::flops::gpu_peak_tflops("NVIDIA H100 80GB HBM3", Precision::BHalf, crate::precision::MatmulPrecision::Highest).unwrap().0, 989.4);
        assert!(refusal(&PlanArgs { train_tokens: Some(-1.0), ..args(path) }).contains("--train-tokens must be a positive number"));
    }

    /// Every bandwidth and latency a plan assumes is a positive finite number (0 GB/s made the
    /// timeline panic, negative and infinite ones were ranked); a profile with a negative time
    /// or a FIFO in its place is refused before planning.
    #[test]
    fn assumed_links_and_profiles_with_impossible_numbers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_profile(dir.path());
        for gbps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let within = refusal(&PlanArgs { within_host_gbps: Some(gbps), ..args(path.clone()) });
            assert!(within.contains("--within-host-gbps must be a positive number"), "{gbps}: {within}");
            let between = refusal(&PlanArgs { nodes: 2, between_hosts_gbps: Some(gbps), ..args(path.clone()) });
            assert!(between.contains("--between-hosts-gbps must be a positive number"), "{gbps}: {between}");
        }
        assert!(refusal(&PlanArgs { link_latency_us: -5.0, ..args(path.clone()) }).contains("--link-latency-us must be"));
        assert!(plan(&PlanArgs { link_latency_us: 0.0, within_host_gbps: Some(100.0), ..args(path.clone()) }).is_ok());

        let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let first = json["compute"][0].as_object_mut().unwrap();
        let (key, _) = first.iter().find(|(_, v)| v.as_f64().is_some_and(|x| x > 0.0)).map(|(k, v)| (k.clone(), v.clone())).unwrap();
        first.insert(key.clone(), (-0.5).into());
        let negative = dir.path().join("negative.json");
        std::fs::write(&negative, json.to_string()).unwrap();
        let err = refusal(&args(negative));
        assert!(err.contains(&format!("`compute[0].{key}` is -0.5: a profile's times, sizes and counts are never negative")), "{err}");
        let fifo = dir.path().join("fifo.json");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        assert!(refusal(&args(fifo)).contains("is not a regular file (a FIFO)"), "without waiting for a writer");
    }

    #[test]
    fn sizes_read_with_their_units() {
        assert_eq!(parse_bytes("80GB"), Ok(80e9));
        assert_eq!(parse_bytes("80GiB"), Ok(80.0 * 1024.0 * 1024.0 * 1024.0));
        assert_eq!(parse_bytes(" 512 MiB"), Ok(512.0 * 1024.0 * 1024.0));
        assert_eq!(parse_bytes("1000"), Ok(1000.0));
        assert!(parse_bytes("80XB").unwrap_err().contains("not a unit of size"));
        assert!(parse_bytes("-1GB").unwrap_err().contains("must be positive"));
        assert!(parse_bytes("GB").unwrap_err().contains("is not a size"));
    }
}
