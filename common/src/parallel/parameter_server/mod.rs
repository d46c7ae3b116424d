//! The parameter-server strategy (Li et al. 2014; Dean et al. 2012's Downpour SGD; TF's
//! `ParameterServerStrategy`), beside the replicas' all-reduce of [`crate::comm::data_parallel`]:
//! `--strategy parameter-server --servers S` makes the last S ranks of the job servers that hold
//! the parameters, sharded by tensor ([`placement`]), and run the run's optimizer over their
//! tensors (so Adam's moments and SGD's momentum live there); the other W ranks are workers that
//! compute gradients on their shard of the data (worker i reads shard i of W, as data-parallel
//! replica i), push them and pull the new parameters, point-to-point over MPI.
//!
//! | `--sync` (default) | `--async` | `--async --max-staleness K` |
//! |---|---|---|
//! | each server waits for every worker's gradient, sums them in worker order, divides by W and steps once: the same model as all-reduce data parallelism (to rounding) | each gradient is applied on arrival, scaled by 1/W (Downpour): workers never wait for each other | stale synchronous parallel (SSP, Ho et al. 2013): as `--async`, but a worker more than K steps ahead of the slowest waits for its answer until the slowest catches up; an applied gradient's staleness is then at most (W − 1)(2K + 1) versions |
//!
//! **Staleness** of an applied gradient: the server's version (optimizer steps it has taken)
//! when it is applied minus the version of the parameters the worker computed it on. Every
//! applied gradient's staleness is counted per server; the histogram goes into the results
//! (`parameter_server.staleness_histogram`) and one console line.
//!
//! **Learning rate.** An asynchronous gradient is scaled by 1/W, so W unstale asynchronous updates
//! move an SGD model as far as one synchronous step over the same W batches: the same `--lr`
//! means the same thing in both modes. (Adam normalises its update: there each asynchronous
//! gradient is a whole Adam step, W per global batch.)
//!
//! **Clipping** (`--clip`): with `--sync` the servers clip the averaged gradient by its norm
//! over all servers (as data parallelism clips the averaged gradient); asynchronous workers
//! clip their own gradient before pushing it.
//!
//! **Checkpoints** hold the whole model and the optimizer state under the whole-model names, as a
//! plain run writes them: worker 0 gathers the state from the servers
//! ([`crate::optim::Optimizer::gathered_state`]) and scatters a restored one back
//! ([`crate::optim::Optimizer::load_state_tensors`]), so a parameter-server checkpoint resumes
//! as a plain run and the other way round.
//!
//! Servers never read training data; they serve until every worker says it is done. An error on
//! any rank ends the whole job ([`crate::comm::ProcessGroup::run`]), so a server never waits forever.
mod strategy;
pub(crate) use strategy::ParameterServer;

use std::collections::BTreeMap;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::comm::ProcessGroup;
use crate::error::usage;

pub mod server;
pub mod worker;

pub use worker::{Straggled, WorkerLink};

/// `--strategy`: how a job's ranks train one model together.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StrategyFlag {
    /// Every rank a replica; gradients averaged among them (all-reduce, or ZeRO's collectives).
    #[default]
    DataParallel,
    /// `--servers` ranks hold the parameters and the optimizer; the others push gradients to
    /// them and pull parameters back.
    ParameterServer,
}

/// When a server applies the gradients it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Every worker's gradient of a step, averaged, one update.
    Sync,
    /// Each gradient on arrival; with a bound, none staler than it.
    Async { max_staleness: Option<usize> },
}

impl Mode {
    /// `--max-staleness`: how many steps a worker may run ahead of the slowest (`--sync`: 0).
    pub fn bound(self) -> Option<usize> {
        match self {
            Mode::Sync => Some(0),
            Mode::Async { max_staleness } => max_staleness,
        }
    }

    /// The most versions an applied gradient can be stale with `workers` workers (None: no bound).
    pub fn staleness_bound(self, workers: usize) -> Option<usize> {
        match self {
            Mode::Sync => Some(0),
            Mode::Async { max_staleness } => max_staleness.map(|k| (workers - 1) * (2 * k + 1)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Async { max_staleness: None } => "async",
            Mode::Async { max_staleness: Some(_) } => "bounded-staleness",
        }
    }
}

/// What `--strategy parameter-server` and its flags ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Config {
    pub servers: usize,
    pub mode: Mode,
}

impl Config {
    /// Refuses checkpoints within epochs (`checkpoints_within_epochs`): the workers never step
    /// together (train::fit refuses it too); said before the ranks start.
    pub fn check(&self, checkpoints_within_epochs: bool) -> Result<()> {
        if checkpoints_within_epochs {
            return usage("--checkpoint-every and --checkpoint-minutes need workers that step together: not with --strategy parameter-server (it checkpoints at epochs' ends)");
        }
        Ok(())
    }

    /// Where a stop signal stops the workers: asynchronous ones never wait for each other, so
    /// they can only meet at the end of the epoch.
    pub fn stops_at(&self) -> crate::comm::launch::StopsAt {
        match self.mode {
            Mode::Sync => crate::comm::launch::StopsAt::Step,
            Mode::Async { .. } => crate::comm::launch::StopsAt::EpochEnd,
        }
    }
}

/// `--straggler RANK:SECONDS`: worker (or replica) RANK sleeps that long in every optimizer
/// step, a slow machine on demand (any strategy).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Straggler {
    pub rank: usize,
    pub seconds: f64,
}

impl std::str::FromStr for Straggler {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parsed = s.split_once(':').and_then(|(rank, secs)| Some((rank.trim().parse::<usize>().ok()?, secs.trim().parse::<f64>().ok()?)));
        match parsed {
            Some((rank, seconds)) if seconds >= 0.0 && seconds.is_finite() => Ok(Straggler { rank, seconds }),
            _ => Err(format!("'{s}': expected RANK:SECONDS, e.g. 1:0.5 (worker 1 sleeps half a second every step)")),
        }
    }
}

/// Checks the parameter-server flags against each other (before any rank starts); `ranks`: the
/// job's size where it is known (`--nproc-per-node`).
pub fn check_flags(
    strategy: StrategyFlag,
    servers: Option<usize>,
    sync: bool,
    asynchronous: bool,
    max_staleness: Option<usize>,
    zero: u8,
    ranks: Option<usize>,
) -> Result<()> {
    if strategy != StrategyFlag::ParameterServer {
        if servers.is_some() || sync || asynchronous || max_staleness.is_some() {
            return usage("--servers, --sync, --async and --max-staleness configure a parameter server: add --strategy parameter-server");
        }
        return Ok(());
    }
    let servers = servers.unwrap_or(1);
    if servers == 0 {
        return usage("--servers must be at least 1");
    }
    if sync && asynchronous {
        return usage("--sync and --async exclude each other: choose one");
    }
    if sync && max_staleness.is_some() {
        return usage("--max-staleness bounds --async updates (--sync is --max-staleness 0): drop --sync, or --max-staleness");
    }
    if let (Some(k), false) = (max_staleness, asynchronous) {
        return usage(format!("--max-staleness {k} bounds --async updates, and the servers run synchronously without --async: add --async"));
    }
    if zero != 0 {
        return usage(format!(
            "--zero {zero} shards the optimizer over data-parallel replicas; with --strategy parameter-server the servers hold it: drop one of them"
        ));
    }
    if let Some(ranks) = ranks.filter(|&n| servers >= n) {
        return usage(format!("--servers {servers} leaves no worker among {ranks} rank(s): a parameter-server job needs more ranks than servers"));
    }
    Ok(())
}

/// Which ranks serve: the last `servers` ones.
pub fn is_server_rank(rank: usize, world: usize, servers: usize) -> bool {
    rank >= world - servers
}

/// A parameter-server job on this rank: its role, and the workers' own group.
pub struct Job<'w> {
    world: &'w ProcessGroup,
    config: Config,
    workers: usize,
    /// The workers' group on a worker, the servers' on a server (split once, every rank).
    group: ProcessGroup,
    server: bool,
}

impl<'w> Job<'w> {
    /// Splits `world` into workers and servers where `config` asks for a parameter server (every
    /// rank calls it, at the same point); None otherwise.
    pub fn start(world: &'w ProcessGroup, config: Option<Config>) -> Result<Option<Job<'w>>> {
        let Some(config) = config else { return Ok(None) };
        let size = world.world_size();
        if config.servers >= size {
            return usage(format!("--servers {} leaves no worker among {size} rank(s): a parameter-server job needs more ranks than servers", config.servers));
        }
        let server = is_server_rank(world.rank(), size, config.servers);
        let group = world.split(server as usize, world.rank())?;
        Ok(Some(Job { world, config, workers: size - config.servers, group, server }))
    }

    pub fn is_server(&self) -> bool {
        self.server
    }

    /// The workers' group (a worker trains over it as over a data-parallel world).
    pub fn workers(&self) -> &ProcessGroup {
        &self.group
    }

    /// Serves until every worker is done (a server rank).
    pub fn serve(&self) -> Result<()> {
        // A stop signal reaches the servers too (the launcher forwards Ctrl-C to every rank;
        // Slurm signals every task), or a server alone: it goes on serving, passing the signal
        // on to the workers in its replies, until they, who checkpoint through it, say they are
        // done.
        crate::train::preemption::install()?;
        let threads = (crate::device::usable_cores() / self.world.local_world_size().max(1)).max(1);
        crate::device::set_threads(threads)?;
        server::Server::new(self.world, &self.group, self.workers, self.config).run()
    }

    /// What a worker's step and optimizer talk to the servers through.
    pub fn link(&self) -> std::rc::Rc<WorkerLink<'w>> {
        std::rc::Rc::new(WorkerLink::new(self.world, self.workers, self.config))
    }
}

/// The server each of the tensors of `sizes` (element counts, in the model's name order) lives
/// on: size-balanced, deterministic (largest first, each to the least-loaded server, ties to the
/// lower server and the earlier tensor), as TF's `MinSizePartitioner`-style placement.
pub fn placement(sizes: &[i64], servers: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0i64; servers];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let s = (0..servers).min_by_key(|&s| (load[s], s)).unwrap_or(0);
        owner[i] = s;
        load[s] += sizes[i];
    }
    owner
}

/// What one server counted while serving.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ServerStats {
    pub server: usize,
    pub tensors: usize,
    pub elements: i64,
    /// Optimizer steps taken (a synchronous step, or a batch of waiting gradients, is one).
    pub updates: u64,
    /// Gradients applied.
    pub gradients: u64,
    /// Applied gradients by staleness.
    pub staleness: BTreeMap<u64, u64>,
    /// Gradients pushed by each worker.
    pub pushes: Vec<u64>,
}

/// The servers' figures, gathered on worker 0 after training: the results' `parameter_server`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub strategy: &'static str,
    pub mode: &'static str,
    pub workers: usize,
    pub servers: usize,
    /// `--max-staleness` (steps ahead of the slowest worker; `--sync`: 0).
    pub max_staleness: Option<usize>,
    /// What that bounds an applied gradient's staleness to, in versions.
    pub staleness_bound: Option<usize>,
    /// Applied gradients by staleness, summed over the servers (each gradient is applied once
    /// per server: S times).
    pub staleness_histogram: BTreeMap<String, u64>,
    pub mean_staleness: f64,
    pub max_staleness_seen: u64,
    /// Optimizer steps each worker took (gradients it pushed).
    pub steps_per_worker: Vec<u64>,
    pub per_server: Vec<ServerStats>,
}

impl Report {
    pub fn new(config: Config, workers: usize, per_server: Vec<ServerStats>) -> Report {
        let mut histogram: BTreeMap<u64, u64> = BTreeMap::new();
        for stats in &per_server {
            for (&staleness, &count) in &stats.staleness {
                *histogram.entry(staleness).or_default() += count;
            }
        }
        let total: u64 = histogram.values().sum();
        let weighted: u64 = histogram.iter().map(|(s, c)| s * c).sum();
        Report {
            strategy: "parameter-server",
            mode: config.mode.name(),
            workers,
            servers: config.servers,
            max_staleness: config.mode.bound(),
            staleness_bound: config.mode.staleness_bound(workers),
            mean_staleness: if total > 0 { weighted as f64 / total as f64 } else { 0.0 },
            max_staleness_seen: histogram.keys().copied().max().unwrap_or(0),
            staleness_histogram: histogram.into_iter().map(|(s, c)| (s.to_string(), c)).collect(),
            steps_per_worker: per_server.first().map(|s| s.pushes.clone()).unwrap_or_default(),
            per_server,
        }
    }

    /// One console line.
    pub fn describe(&self) -> String {
        let histogram: Vec<String> = self.staleness_histogram.iter().map(|(s, c)| format!("{s}: {c}")).collect();
        let updates: Vec<u64> = self.per_server.iter().map(|s| s.updates).collect();
        format!(
            "parameter server ({}, {} worker(s) + {} server(s)): staleness of the applied gradients {{{}}} (mean {:.2}, max {}); steps per worker {:?}; updates per server {:?}",
            self.mode,
            self.workers,
            self.servers,
            histogram.join(", "),
            self.mean_staleness,
            self.max_staleness_seen,
            self.steps_per_worker,
            updates
        )
    }
}

/// Message kinds (the first word of a message's label).
pub(crate) mod op {
    pub const INIT: i64 = 1;
    pub const PUSH: i64 = 2;
    pub const PULL: i64 = 3;
    pub const GET_STATE: i64 = 4;
    pub const SET_STATE: i64 = 5;
    pub const DONE: i64 = 6;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_placed_by_size_deterministically() {
        // The largest first, each to the least-loaded server.
        assert_eq!(placement(&[10, 100, 50, 40, 5], 2), vec![1, 0, 1, 1, 0]);
        assert_eq!(placement(&[3, 3, 3], 1), vec![0, 0, 0]);
        assert_eq!(placement(&[1, 1, 1, 1], 4), vec![0, 1, 2, 3]);
    }

    #[test]
    fn flags_that_do_not_fit_are_usage_errors() {
        let ps = StrategyFlag::ParameterServer;
        let refused = |r: Result<()>| r.unwrap_err().to_string();
        assert!(refused(check_flags(StrategyFlag::DataParallel, Some(1), false, false, None, 0, None)).contains("add --strategy parameter-server"));
        assert!(refused(check_flags(ps, Some(1), true, true, None, 0, None)).contains("exclude each other"));
        assert!(refused(check_flags(ps, Some(2), false, false, None, 0, Some(2))).contains("leaves no worker"));
        assert!(refused(check_flags(ps, None, false, false, None, 1, None)).contains("--zero 1"));
        assert!(check_flags(ps, Some(1), false, true, Some(2), 0, Some(3)).is_ok());
        // A bound on --async's staleness, without --async: refused, not silently synchronous.
        assert!(refused(check_flags(ps, Some(1), false, false, Some(2), 0, Some(3))).contains("--max-staleness 2 bounds --async updates"));
        assert_eq!("1:0.25".parse::<Straggler>(), Ok(Straggler { rank: 1, seconds: 0.25 }));
        assert!("1".parse::<Straggler>().is_err() && "x:1".parse::<Straggler>().is_err());
    }
}
