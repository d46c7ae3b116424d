//! A worker's side: its optimizer ([`WorkerLink::optimizer`], like Horovod's
//! `DistributedOptimizer` a wrapper the training loop steps as any other) pushes the gradients
//! to the servers and pulls the new parameters into the model's tensors in place; its step
//! ([`WorkerLink::step`]) pulls the servers' parameters at every epoch's end, so that the
//! workers evaluate, agree on and checkpoint the servers' model (asynchronous workers hold
//! different versions between).
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::server::InitSpec;
use super::{op, placement, Config, Mode, Report, ServerStats, Straggler};
use crate::comm::transfer::{recv_labelled, recv_named, recv_tensor, send_labelled, send_named};
use crate::comm::ProcessGroup;
use crate::error::usage;
use crate::optim::{NormScope, Optimizer, OptimizerKernel, OptimizerKind, OptimizerSpec, Sharded};
use crate::precision::Precision;
use crate::train::{Batch, BatchSource, EvalSums, StepContext, StepOutput, StepSync, TrainStep};

/// What a worker's step and optimizer share: the world, where each tensor lives, and the
/// version of the parameters it holds from each server.
pub struct WorkerLink<'w> {
    world: &'w ProcessGroup,
    workers: usize,
    config: Config,
    state: RefCell<LinkState>,
}

#[derive(Default)]
struct LinkState {
    /// The model's trainable tensors (whole-model names, name order) and their server.
    params: Vec<(String, Tensor)>,
    owner: Vec<usize>,
    spec: Option<(OptimizerKind, f64, f64, OptimizerKernel)>,
    /// The servers were told their tensors.
    initialized: bool,
    /// The servers were told training is over (they have stopped serving).
    finished: bool,
    bases: Vec<i64>,
}

impl<'w> WorkerLink<'w> {
    pub fn new(world: &'w ProcessGroup, workers: usize, config: Config) -> WorkerLink<'w> {
        let state = LinkState { bases: vec![0; config.servers], ..LinkState::default() };
        WorkerLink { world, workers, config, state: RefCell::new(state) }
    }

    /// What this worker's messages to and from the servers moved so far.
    pub fn comm_stats(&self) -> crate::comm::CommStats {
        self.world.comm_stats()
    }
}

impl crate::comm::group::Traffic for WorkerLink<'_> {
    fn comm_stats(&self) -> crate::comm::CommStats {
        WorkerLink::comm_stats(self)
    }
}

impl<'w> WorkerLink<'w> {
    fn server_rank(&self, s: usize) -> usize {
        self.workers + s
    }

    fn is_first_worker(&self) -> bool {
        self.world.rank() == 0
    }

    /// Whether the workers take their steps together (synchronous servers), so that a stop can be
    /// agreed at any step ([`crate::train::TrainConfig::lockstep`]).
    pub fn lockstep(&self) -> bool {
        matches!(self.config.mode, super::Mode::Sync)
    }

    /// What the parameter server cannot train (yet), refused before anything trains (a model
    /// in parts: by the plan that would cut it, [`crate::parallelize`]).
    pub fn check(&self, precision: Precision, cuda_graph: bool) -> Result<()> {
        if precision.needs_scaler() || precision.weights_kind().is_some() {
            return usage(format!("--strategy parameter-server with --precision {} is not built yet: use 32 or bf16-mixed", precision.name()));
        }
        if cuda_graph {
            return usage("--cuda-graph records one process's step; a parameter-server step talks to the servers");
        }
        Ok(())
    }

    /// `step`, pulling the servers' parameters at every epoch's end.
    pub fn step<'g>(self: &Rc<Self>, step: Box<dyn TrainStep<'g> + 'g>) -> Box<dyn TrainStep<'g> + 'g>
    where
        'w: 'g,
    {
        Box::new(WorkerStep { inner: step, link: self.clone() })
    }

    /// The optimizer the loop steps on a worker: the servers run `spec`'s over `params`, this
    /// worker's model's trainable tensors.
    pub fn optimizer<'g>(self: &Rc<Self>, params: Vec<(String, Tensor)>, spec: OptimizerSpec) -> Box<dyn Optimizer + 'g>
    where
        'w: 'g,
    {
        let OptimizerSpec { kind, lr, momentum, weight_decay, kernel } = spec;
        let sizes: Vec<i64> = params.iter().map(|(_, t)| t.numel() as i64).collect();
        let mut state = self.state.borrow_mut();
        state.owner = placement(&sizes, self.config.servers);
        state.params = params;
        state.spec = Some((kind, momentum, weight_decay, kernel));
        drop(state);
        Box::new(PsOptimizer { link: self.clone(), lr, clip: 0.0, name: kind.name() })
    }

    /// The indices of server `s`'s tensors.
    fn tensors_of(state: &LinkState, s: usize) -> Vec<usize> {
        (0..state.params.len()).filter(|&i| state.owner[i] == s).collect()
    }

    /// Worker 0 tells each server its tensors and their values (and the optimizer to run).
    fn init_servers(&self) -> Result<()> {
        let mut state = self.state.borrow_mut();
        let (optimizer, momentum, weight_decay, kernel) = state.spec.context("the parameter-server optimizer was not built")?;
        for s in 0..self.config.servers {
            let mine = Self::tensors_of(&state, s);
            let spec = InitSpec {
                optimizer,
                momentum,
                weight_decay,
                kernel,
                names: mine.iter().map(|&i| state.params[i].0.clone()).collect(),
                shapes: mine.iter().map(|&i| state.params[i].1.size()).collect(),
            };
            send_labelled(self.world, &Tensor::from_slice(&serde_json::to_vec(&spec)?), [op::INIT, 0, 0], self.server_rank(s))?;
            send_labelled(self.world, &flat(mine.iter().map(|&i| state.params[i].1.detach())), [0; 3], self.server_rank(s))?;
        }
        self.world.wait_sends()?;
        state.initialized = true;
        Ok(())
    }

    /// Receives server `s`'s parameters into the model's tensors.
    fn receive_parameters(&self, state: &mut LinkState, s: usize) -> Result<()> {
        let (label, values) = recv_labelled(self.world, self.server_rank(s), Device::Cpu)?;
        let mine = Self::tensors_of(state, s);
        let sizes: Vec<i64> = mine.iter().map(|&i| state.params[i].1.numel() as i64).collect();
        tch::no_grad(|| {
            for (&i, value) in mine.iter().zip(values.split_with_sizes(&sizes, 0)) {
                let param = &mut state.params[i].1;
                param.copy_(&value.view_as(param));
            }
        });
        state.bases[s] = label[0];
        // A stop signal the server caught: the job stops for it (the workers agree on where).
        crate::train::preemption::relay(label[1] as i32);
        Ok(())
    }

    /// Pushes this worker's gradients (`clip`: the servers clip the average to it; 0: not) and
    /// pulls the parameters the servers reply with.
    fn push(&self, lr: f64, clip: f64) -> Result<()> {
        let mut state = self.state.borrow_mut();
        for s in 0..self.config.servers {
            let mine = Self::tensors_of(&state, s);
            let grads: Vec<Tensor> = mine.iter().map(|&i| state.params[i].1.grad()).collect();
            let mut meta = vec![lr, clip];
            meta.extend(grads.iter().map(|g| g.defined() as i64 as f64));
            let values = mine.iter().zip(&grads).map(|(&i, g)| if g.defined() { g.detach() } else { state.params[i].1.zeros_like() });
            send_labelled(self.world, &Tensor::from_slice(&meta), [op::PUSH, state.bases[s], 0], self.server_rank(s))?;
            send_labelled(self.world, &flat(values), [0; 3], self.server_rank(s))?;
        }
        for s in 0..self.config.servers {
            self.receive_parameters(&mut state, s)?;
        }
        self.world.wait_sends()
    }

    /// Pulls the servers' current parameters (every worker, at an epoch's end: the same ones).
    fn pull(&self) -> Result<()> {
        let mut state = self.state.borrow_mut();
        if !state.initialized {
            return Ok(()); // nothing trained yet: every worker holds worker 0's
        }
        if state.finished {
            // The test pass after training: the servers have stopped, and every worker took
            // their last parameters when it evaluated the last epoch (after every push).
            return Ok(());
        }
        for s in 0..self.config.servers {
            send_labelled(self.world, &Tensor::zeros([0], (Kind::Double, Device::Cpu)), [op::PULL, 0, 0], self.server_rank(s))?;
        }
        for s in 0..self.config.servers {
            self.receive_parameters(&mut state, s)?;
        }
        self.world.wait_sends()
    }

    /// Worker 0: the servers' optimizer state, under the whole-model names, and their current
    /// parameters into the model (so the checkpoint's model and state are of one version).
    fn gather_state(&self) -> Result<Vec<(String, Tensor)>> {
        if !self.is_first_worker() || !self.state.borrow().initialized {
            return Ok(Vec::new());
        }
        let mut state = self.state.borrow_mut();
        let mut gathered = Vec::new();
        for s in 0..self.config.servers {
            send_labelled(self.world, &Tensor::zeros([0], (Kind::Double, Device::Cpu)), [op::GET_STATE, 0, 0], self.server_rank(s))?;
            gathered.extend(recv_named(self.world, self.server_rank(s))?);
            self.receive_parameters(&mut state, s)?;
        }
        self.world.wait_sends()?;
        Ok(gathered)
    }

    /// Worker 0, resuming: the servers get the restored parameters and their part of `state`.
    fn scatter_state(&self, state: &HashMap<String, Tensor>) -> Result<()> {
        if state.is_empty() {
            return Ok(()); // the other workers (replica 0's state reaches them as none)
        }
        self.init_servers()?;
        let link = self.state.borrow();
        let names: Vec<&str> = link.params.iter().map(|(n, _)| n.as_str()).collect();
        let mut parts: Vec<Vec<(String, Tensor)>> = (0..self.config.servers).map(|_| Vec::new()).collect();
        for (key, tensor) in state {
            // `<entry>.<parameter name>`: the entry names have no dots.
            let param = key.split_once('.').map(|(_, p)| p).with_context(|| format!("optimizer state `{key}` names no parameter"))?;
            let index = names.iter().position(|&n| n == param).with_context(|| format!("optimizer state `{key}` is for no parameter of this model"))?;
            parts[link.owner[index]].push((key.clone(), tensor.shallow_clone()));
        }
        for (s, part) in parts.iter_mut().enumerate() {
            part.sort_by(|a, b| a.0.cmp(&b.0));
            send_labelled(self.world, &Tensor::zeros([0], (Kind::Double, Device::Cpu)), [op::SET_STATE, 0, 0], self.server_rank(s))?;
            send_named(self.world, part, self.server_rank(s))?;
        }
        self.world.wait_sends()
    }

    /// After training, every worker: tells the servers it is done; worker 0 gets their figures.
    pub fn finish(&self) -> Result<Option<Report>> {
        self.state.borrow_mut().finished = true;
        for s in 0..self.config.servers {
            send_labelled(self.world, &Tensor::zeros([0], (Kind::Double, Device::Cpu)), [op::DONE, 0, 0], self.server_rank(s))?;
        }
        self.world.wait_sends()?;
        if !self.is_first_worker() {
            return Ok(None);
        }
        let per_server = (0..self.config.servers)
            .map(|s| -> Result<ServerStats> {
                let bytes = Vec::<u8>::try_from(&recv_tensor(self.world, self.server_rank(s), Device::Cpu)?)?;
                Ok(serde_json::from_slice(&bytes)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Report::new(self.config, self.workers, per_server)))
    }
}

/// The tensors as one flat CPU float32 buffer.
fn flat(tensors: impl Iterator<Item = Tensor>) -> Tensor {
    let parts: Vec<Tensor> = tensors.map(|t| t.to_device(Device::Cpu).to_kind(Kind::Float).reshape([-1])).collect();
    if parts.is_empty() {
        return Tensor::zeros([0], (Kind::Float, Device::Cpu));
    }
    Tensor::cat(&parts, 0)
}

/// A worker's optimizer: the update runs on the servers.
struct PsOptimizer<'w> {
    link: Rc<WorkerLink<'w>>,
    lr: f64,
    /// `--sync`'s clipping threshold, applied by the servers to the average (0: none).
    clip: f64,
    name: &'static str,
}

impl Optimizer for PsOptimizer<'_> {
    fn step(&mut self) -> Result<()> {
        if self.link.is_first_worker() && !self.link.state.borrow().initialized {
            self.link.init_servers()?;
        }
        self.link.state.borrow_mut().initialized = true;
        let clip = std::mem::take(&mut self.clip);
        self.link.push(self.lr, clip)
    }

    fn clip_grad_norm(&mut self, params: &[Tensor], max_norm: f64, scope: NormScope<'_>) -> Result<f64> {
        match self.link.config.mode {
            // The servers clip the average (their norm is over all of them).
            Mode::Sync => {
                self.clip = max_norm;
                Ok(f64::NAN)
            }
            // Each worker's own gradient is an update of its own.
            Mode::Async { .. } => crate::optim::clip_grad_norm_over(params, max_norm, scope),
        }
    }

    /// The state lives on the servers ([`Sharded::gathered_state`] fetches it).
    fn sharded(&self) -> Option<&dyn Sharded> {
        Some(self)
    }

    fn zero_grad(&mut self) {
        for (_, param) in &self.link.state.borrow().params {
            if let Err(err) = crate::torch_ext::clear_grad(param) {
                panic!("{err:#}");
            }
        }
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// None here: the state lives on the servers ([`Sharded::gathered_state`] fetches it).
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    fn load_state_tensors(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        self.link.scatter_state(state)
    }

    fn name(&self) -> &'static str {
        self.name
    }
}

impl Sharded for PsOptimizer<'_> {
    /// Worker 0: the servers' state (and their parameters into the model, one version).
    fn gathered_state(&self) -> Result<Vec<(String, Tensor)>> {
        self.link.gather_state()
    }

    fn sharded_gradient_bytes(&self) -> usize {
        0
    }

    /// Worker 0 hands the whole state to the servers; the other workers hold none.
    fn over_replicas(&self) -> bool {
        false
    }
}

/// A worker's step: the model's, pulling the servers' parameters at each epoch's end.
struct WorkerStep<'g, 'w> {
    inner: Box<dyn TrainStep<'g> + 'g>,
    link: Rc<WorkerLink<'w>>,
}

impl<'g, 'w: 'g> TrainStep<'g> for WorkerStep<'g, 'w> {
    fn forward_backward(&mut self, batch: &Batch, weight: f64, ctx: &StepContext) -> Result<StepOutput> {
        self.inner.forward_backward(batch, weight, ctx)
    }
    /// Evaluation (at every epoch's end, after the workers' sums were combined, so every
    /// gradient of the epoch is applied; and the test pass) is of the servers' parameters:
    /// asynchronous workers take them first (synchronous ones hold them already).
    fn evaluate(&mut self, source: &dyn BatchSource, precision: Precision) -> Result<EvalSums> {
        if self.link.config.mode != Mode::Sync {
            self.link.pull()?;
        }
        self.inner.evaluate(source, precision)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.named_parameters()
    }
    fn named_variables(&self) -> Vec<(String, Tensor)> {
        self.inner.named_variables()
    }
    fn input_device(&self) -> Device {
        self.inner.input_device()
    }
    fn sync(&self) -> &dyn StepSync<'g> {
        self.inner.sync()
    }
}

/// `--straggler`'s optimizer: sleeps before every step on the slow rank (any strategy).
pub struct Straggled<'o> {
    inner: Box<dyn Optimizer + 'o>,
    seconds: f64,
}

impl<'o> Straggled<'o> {
    /// `optimizer`, slowed where this `rank` is `straggler`'s.
    pub fn wrap(optimizer: Box<dyn Optimizer + 'o>, straggler: Option<Straggler>, rank: usize) -> Box<dyn Optimizer + 'o> {
        match straggler {
            Some(s) if s.rank == rank && s.seconds > 0.0 => Box::new(Straggled { inner: optimizer, seconds: s.seconds }),
            _ => optimizer,
        }
    }
}

impl Optimizer for Straggled<'_> {
    fn step(&mut self) -> Result<()> {
        std::thread::sleep(std::time::Duration::from_secs_f64(self.seconds));
        self.inner.step()
    }
    crate::optim::forward_to!(inner: synchronize, clip_grad_norm, sharded, state_bytes, zero_grad, lr, set_lr, state_tensors, load_state_tensors, name, make_capturable);
}
