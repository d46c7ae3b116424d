//! Planning a layout before launch (issue: `exercise3 plan`): a machine's [`profile`] of what
//! the Transformer's pieces, its optimizer and its collectives cost, from which the planner
//! predicts every layout's memory and step time.
pub mod profile;
pub mod layouts;
pub mod predict;
pub mod timeline;

use std::path::PathBuf;

use anyhow::Result;
use tch::Device;

use crate::comm::{Backend, ProcessGroup};
use crate::device::{self, DeviceChoice};
use crate::error::usage;
use crate::models::TransformerConfig;
use crate::optim::OptimizerKind;
use crate::precision::Precision;
use profile::{LinkScope, Profile, Recorded};

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
}

impl ProfileArgs {
    /// The model the profile is for (its layer count is the plan's: one layer is timed).
    pub fn model(&self) -> TransformerConfig {
        let multiple = self.pad_vocab.unwrap_or(1).max(1);
        let ntoken = (self.vocab + multiple - 1) / multiple * multiple;
        TransformerConfig { ntoken, d_model: self.emsize, nhead: self.nhead, d_hid: self.d_hid, nlayers: 1, dropout: self.dropout }
    }

    /// Checks what can be checked before anything is measured.
    fn check(&self) -> Result<()> {
        self.model().validate()?;
        if self.micro_batches.is_empty() || self.micro_batches.iter().any(|&b| b < 1) {
            return usage("--micro-batches takes sizes of 1 or more, comma-separated");
        }
        if self.bptt < 1 {
            return usage(format!("--bptt must be at least 1, got {}", self.bptt));
        }
        if self.device == DeviceChoice::Both {
            return usage("--device both: a profile is of one device; record one for each");
        }
        if let Some(parent) = self.out.parent().filter(|p| !p.as_os_str().is_empty()) {
            crate::atomic_file::probe_folder(parent).map_err(|err| crate::error::UsageError(format!("--out {}: {err}", self.out.display())))?;
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
/// it to `--out`: rank 0 returns it, the other ranks None.
pub fn measure(args: &ProfileArgs, world: &ProcessGroup) -> Result<Option<Profile>> {
    args.check()?;
    let device = match args.device {
        DeviceChoice::Cuda if !device::cuda_available() => return usage(device::no_cuda_message()),
        DeviceChoice::Cuda => world.device(true),
        _ => Device::Cpu,
    };
    let model = args.model();
    args.precision.check(device)?;
    // The pieces and the optimizer on rank 0 alone (the other ranks' work would share its
    // cores or its host's memory bandwidth).
    let local = if world.is_root() {
        let compute = profile::measure_compute(&model, args.precision, device, args.bptt, &args.micro_batches)?;
        let optimizer = profile::measure_optimizer(args.optimizer, device, if device.is_cuda() { 256 << 20 } else { 16 << 20 })?;
        Some((compute, optimizer))
    } else {
        None
    };
    world.barrier()?;
    let links = measure_links(world, device, &message_sizes(args.max_message_mb << 20))?;
    let Some((compute, optimizer)) = local else { return Ok(None) };
    let recorded = Recorded {
        device: crate::device::gpu_name(device).unwrap_or_else(|| crate::device::device_name(device).into()),
        threads: tch::get_num_threads() as usize,
        host: crate::comm::hosts::this_host(),
        unix_time: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    };
    let profile = Profile { version: profile::VERSION, recorded, model, precision: args.precision, seq_len: args.bptt, compute, optimizer, links };
    profile.write(&args.out)?;
    Ok(Some(profile))
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
