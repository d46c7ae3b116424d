//! A server rank: its tensors of the model (on the CPU, as TF's parameter servers keep them),
//! the run's optimizer over them, and the loop that serves the workers' messages until every
//! worker is done.
//!
//! Messages (label word 0, see [`super::op`]), all from a worker to this server, point-to-point
//! over the world group:
//!
//! | message | then | reply |
//! |---|---|---|
//! | INIT: JSON (optimizer, names, shapes) | this server's parameters, flat | none |
//! | PUSH [base version]: f64 [lr, clip, has-gradient per tensor] | the gradients, flat | when applied: [version, signal], the parameters, flat |
//! | PULL | | [version, signal], the parameters |
//! | GET_STATE | | the optimizer state (named), then [version, signal], the parameters |
//! | SET_STATE | the optimizer state (named) | none |
//! | DONE | | after the last worker's: this server's [`ServerStats`] to worker 0 |
//!
//! `signal`: the stop signal this server caught (SIGUSR1, SIGTERM, SIGINT; 0: none), which the
//! workers stop the job for.
use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::{op, Config, Mode, ServerStats};
use crate::comm::transfer::{recv_labelled, recv_named, recv_tensor, send_labelled, send_named, send_tensor};
use crate::comm::ProcessGroup;
use crate::optim::{clip_grad_norm_over, NormScope, Optimizer, OptimizerKernel, OptimizerKind};

/// What INIT carries besides the parameters.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct InitSpec {
    pub optimizer: OptimizerKind,
    pub momentum: f64,
    pub weight_decay: f64,
    pub kernel: OptimizerKernel,
    pub names: Vec<String>,
    pub shapes: Vec<Vec<i64>>,
}

/// A gradient waiting to be applied.
struct Pending {
    worker: usize,
    base: i64,
    lr: f64,
    clip: f64,
    has_grad: Vec<bool>,
    flat: Tensor,
}

/// `PS_HOLD=RANK:N`, a test hook that makes staleness deterministic: the servers keep worker
/// RANK's gradients back until N updates were applied without it (or nothing else can move).
fn hold_from_env() -> Option<(usize, u64)> {
    let value = std::env::var("PS_HOLD").ok()?;
    let (rank, n) = value.split_once(':')?;
    Some((rank.parse().ok()?, n.parse().ok()?))
}

pub struct Server<'w> {
    world: &'w ProcessGroup,
    /// The servers' own group (the norm of a clipped synchronous gradient is summed over it).
    servers: &'w ProcessGroup,
    workers: usize,
    config: Config,
    params: Vec<(String, Tensor)>,
    optimizer: Option<Box<dyn Optimizer>>,
    version: i64,
    /// The version of the parameters each worker holds.
    bases: Vec<i64>,
    active: Vec<bool>,
    queue: Vec<Pending>,
    /// Workers whose gradient was applied and who wait for their answer (`--max-staleness`).
    unanswered: Vec<usize>,
    hold: Option<(usize, u64)>,
    applied_without_held: u64,
    stats: ServerStats,
}

impl<'w> Server<'w> {
    pub fn new(world: &'w ProcessGroup, servers: &'w ProcessGroup, workers: usize, config: Config) -> Server<'w> {
        let stats = ServerStats { server: servers.rank(), pushes: vec![0; workers], ..ServerStats::default() };
        Server {
            world,
            servers,
            workers,
            config,
            params: Vec::new(),
            optimizer: None,
            version: 0,
            bases: vec![0; workers],
            active: vec![true; workers],
            queue: Vec::new(),
            unanswered: Vec::new(),
            hold: hold_from_env(),
            applied_without_held: 0,
            stats,
        }
    }

    /// Serves until every worker has sent DONE, then sends worker 0 this server's figures.
    pub fn run(mut self) -> Result<()> {
        while self.active.iter().any(|&a| a) {
            // Until worker 0 has said what this server holds, only worker 0 is listened to.
            let src = if self.optimizer.is_none() && self.active[0] { 0 } else { self.world.probe_any()? };
            anyhow::ensure!(src < self.workers, "a parameter server got a message from rank {src}, which is not a worker");
            let (label, meta) = recv_labelled(self.world, src, Device::Cpu)?;
            match label[0] {
                op::INIT => self.init(&meta, recv_tensor(self.world, src, Device::Cpu)?)?,
                op::PUSH => {
                    let flat = recv_tensor(self.world, src, Device::Cpu)?;
                    let meta = Vec::<f64>::try_from(&meta)?;
                    anyhow::ensure!(
                        meta.len() == 2 + self.params.len(),
                        "a gradient for {} tensors, but this server holds {}",
                        meta.len().saturating_sub(2),
                        self.params.len()
                    );
                    let has_grad = meta[2..].iter().map(|&m| m != 0.0).collect();
                    self.stats.pushes[src] += 1;
                    self.queue.push(Pending { worker: src, base: label[1], lr: meta[0], clip: meta[1], has_grad, flat });
                    self.apply_what_may()?;
                }
                op::PULL => {
                    self.reply(src)?;
                }
                op::GET_STATE => {
                    let state: Vec<(String, Tensor)> = self.optimizer()?.state_tensors().into_iter().map(|(n, t)| (n, t.to_device(Device::Cpu))).collect();
                    send_named(self.world, &state, src)?;
                    self.reply(src)?;
                }
                op::SET_STATE => {
                    let state: HashMap<String, Tensor> = recv_named(self.world, src)?.into_iter().collect();
                    self.optimizer()?.load_state_tensors(&state).context("the optimizer state sent to a parameter server")?;
                }
                op::DONE => {
                    self.active[src] = false;
                    self.apply_what_may()?;
                }
                other => bail!("a parameter server got a message of unknown kind {other} from worker {src}"),
            }
        }
        anyhow::ensure!(self.queue.is_empty() && self.unanswered.is_empty(), "workers finished with {} gradient(s) not applied", self.queue.len());
        self.stats.tensors = self.params.len();
        self.stats.elements = self.params.iter().map(|(_, t)| t.numel() as i64).sum();
        send_tensor(self.world, &Tensor::from_slice(&serde_json::to_vec(&self.stats)?), 0)?;
        self.world.wait_sends()
    }

    fn optimizer(&mut self) -> Result<&mut Box<dyn Optimizer>> {
        self.optimizer.as_mut().context("a parameter server was asked for its state before worker 0 gave it its tensors")
    }

    /// INIT: this server's tensors (again, after a resume: the values change, the state stays).
    fn init(&mut self, meta: &Tensor, flat: Tensor) -> Result<()> {
        let spec: InitSpec = serde_json::from_slice(&Vec::<u8>::try_from(meta)?).context("a parameter server's INIT message")?;
        let sizes: Vec<i64> = spec.shapes.iter().map(|s| s.iter().product()).collect();
        let values = flat.split_with_sizes(&sizes, 0);
        if self.optimizer.is_some() {
            anyhow::ensure!(self.params.iter().map(|(n, _)| n).eq(spec.names.iter()), "INIT names other tensors than this server holds");
            tch::no_grad(|| {
                for ((_, p), v) in self.params.iter_mut().zip(&values) {
                    p.copy_(&v.view_as(p));
                }
            });
            return Ok(());
        }
        self.params = spec
            .names
            .iter()
            .zip(values.iter().zip(&spec.shapes))
            .map(|(name, (v, shape))| (name.clone(), v.reshape(shape.as_slice()).copy().set_requires_grad(true)))
            .collect();
        // The learning rate arrives with every gradient.
        self.optimizer = Some(spec.optimizer.build(
            self.params.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect(),
            0.0,
            spec.momentum,
            spec.weight_decay,
            spec.kernel,
        ));
        Ok(())
    }

    /// The parameters and their version to worker `w`, who now holds that version, and the stop
    /// signal this server caught, if any: the workers stop the job for it (they agree on the step
    /// and checkpoint through the servers), as if they had caught it themselves.
    fn reply(&mut self, w: usize) -> Result<()> {
        let flat = if self.params.is_empty() {
            Tensor::zeros([0], (Kind::Float, Device::Cpu))
        } else {
            Tensor::cat(&self.params.iter().map(|(_, p)| p.detach().reshape([-1])).collect::<Vec<_>>(), 0)
        };
        let signal = crate::train::preemption::requested_signal() as i64;
        send_labelled(self.world, &flat, [self.version, signal, 0], w)?;
        self.bases[w] = self.version;
        Ok(())
    }

    /// Whether worker `w`'s gradient is held back by the `PS_HOLD` test hook.
    fn held(&self, w: usize) -> bool {
        self.hold.is_some_and(|(rank, _)| rank == w)
    }

    /// Applies the waiting gradients the mode allows and answers the workers it may, as many
    /// rounds as that takes.
    ///
    /// - `--sync`: once every active worker's gradient is here, one update with their average.
    /// - `--async`: each gradient at once, its worker answered at once.
    /// - `--async --max-staleness K` (SSP, Ho et al. 2013): each gradient at once, but a worker
    ///   more than K steps (pushes) ahead of the slowest active worker gets its answer, and so
    ///   computes on, only once the slowest has caught up. The slowest is never held back, so a
    ///   worker waiting at an epoch's end never blocks the others. An applied gradient's
    ///   staleness (in versions) is then at most (W − 1)(2K + 1).
    fn apply_what_may(&mut self) -> Result<()> {
        loop {
            let eligible: Vec<usize> = (0..self.queue.len()).filter(|&i| !self.held(self.queue[i].worker)).collect();
            let mut moved = false;
            match self.config.mode {
                Mode::Sync => {
                    let queued: Vec<usize> = self.queue.iter().map(|p| p.worker).collect();
                    let everyone = (0..self.workers).all(|w| !self.active[w] || queued.contains(&w));
                    if everyone && !eligible.is_empty() && eligible.len() == self.queue.len() {
                        let batch = std::mem::take(&mut self.queue);
                        self.update(batch)?;
                        moved = true;
                    }
                }
                Mode::Async { .. } => {
                    if let Some(&first) = eligible.first() {
                        let pending = self.queue.remove(first);
                        self.update(vec![pending])?;
                        moved = true;
                    }
                }
            }
            moved |= self.answer_who_may()?;
            if moved {
                continue;
            }
            // Nothing moves: where every active worker waits on this server and the PS_HOLD hook
            // keeps a gradient back, the hook lets go.
            let outstanding = (0..self.workers).any(|w| self.active[w] && !self.queue.iter().any(|p| p.worker == w) && !self.unanswered.contains(&w));
            if self.hold.is_some() && !outstanding && !self.queue.is_empty() {
                self.hold = None;
                continue;
            }
            return Ok(());
        }
    }

    /// Under `--max-staleness K`, answers the workers whose gradients were applied and who are
    /// no more than K steps ahead of the slowest active worker; returns whether it answered any.
    fn answer_who_may(&mut self) -> Result<bool> {
        let Mode::Async { max_staleness: Some(bound) } = self.config.mode else { return Ok(false) };
        let mut answered = false;
        for w in std::mem::take(&mut self.unanswered) {
            let slowest = (0..self.workers).filter(|&v| v != w && self.active[v]).map(|v| self.stats.pushes[v]).min();
            if slowest.is_none_or(|slowest| self.stats.pushes[w] <= slowest + bound as u64) {
                self.reply(w)?;
                answered = true;
            } else {
                self.unanswered.push(w);
            }
        }
        Ok(answered)
    }

    /// One optimizer step with the sum of `batch`'s gradients (in worker order) divided by the
    /// number of workers, then the new parameters to each of its workers.
    fn update(&mut self, mut batch: Vec<Pending>) -> Result<()> {
        batch.sort_by_key(|p| p.worker);
        for p in &batch {
            *self.stats.staleness.entry((self.version - p.base).max(0) as u64).or_default() += 1;
        }
        let sizes: Vec<i64> = self.params.iter().map(|(_, t)| t.numel() as i64).collect();
        let lr = batch.last().map_or(0.0, |p| p.lr);
        let clip = batch.last().map_or(0.0, |p| p.clip);
        let workers = self.workers as f64;
        tch::no_grad(|| -> Result<()> {
            let mut sum: Option<Tensor> = None;
            for p in &batch {
                sum = Some(match sum {
                    None => p.flat.copy(),
                    Some(s) => s + &p.flat,
                });
            }
            let mean = sum.map(|s| s / workers).context("an update without gradients")?;
            let parts = mean.split_with_sizes(&sizes, 0);
            for (i, ((_, param), grad)) in self.params.iter().zip(parts).enumerate() {
                if batch.iter().any(|p| p.has_grad[i]) {
                    crate::torch_ext::set_grad(param, &grad.view_as(param).copy())?;
                } else {
                    crate::torch_ext::clear_grad(param)?;
                }
            }
            Ok(())
        })?;
        if self.config.mode == Mode::Sync && clip > 0.0 {
            // As data parallelism clips the averaged gradient: by its norm over every server.
            let group = (self.servers.world_size() > 1).then_some(self.servers);
            let params: Vec<Tensor> = self.params.iter().map(|(_, t)| t.shallow_clone()).collect();
            clip_grad_norm_over(&params, clip, NormScope { model: group, counted: &[] })?;
        }
        let optimizer = self.optimizer()?;
        optimizer.set_lr(lr);
        optimizer.step()?;
        optimizer.zero_grad();
        self.version += 1;
        self.stats.updates += 1;
        self.stats.gradients += batch.len() as u64;
        if let Some((rank, n)) = self.hold {
            if !batch.iter().any(|p| p.worker == rank) {
                self.applied_without_held += 1;
                if self.applied_without_held >= n {
                    self.hold = None;
                }
            }
        }
        for p in &batch {
            match self.config.mode {
                Mode::Async { max_staleness: Some(_) } => self.unanswered.push(p.worker),
                _ => self.reply(p.worker)?,
            }
        }
        Ok(())
    }
}
