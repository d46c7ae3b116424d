//! [`LocalStep`]: a whole model on this rank, trained alone or as one data-parallel replica
//! (its parameters sharded over the replicas with ZeRO-3).
use std::time::Instant;

use anyhow::Result;
use tch::{nn, Device, Kind, Tensor};

use super::{Parallel, ParallelStep, Peers};
use crate::device::synchronize;
use crate::models::PartedModule;
use crate::precision::{self, Precision};
use crate::train::{loss_and_hits, Batch, BatchSource, EvalSums, StepContext, StepOutput, StepSync, TrainStep};

/// The kind of `vs`'s floating-point variables, where it is not float32.
fn weights_kind(vs: &nn::VarStore) -> Option<Kind> {
    let variables = vs.variables();
    let kind = variables.values().map(Tensor::kind).find(|kind| matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double))?;
    (kind != Kind::Float).then_some(kind)
}

/// The parameters `vs` holds without training them (frozen for transfer learning): the var
/// store lists every parameter it created trainable, frozen since or not.
fn frozen_parameters(vs: &nn::VarStore) -> Vec<Tensor> {
    vs.trainable_variables().into_iter().filter(|t| !t.requires_grad()).collect()
}

/// A whole model on this rank, trained alone or as one data-parallel replica (its parameters
/// sharded over the replicas with ZeRO-3).
pub struct LocalStep<'g> {
    pub vs: nn::VarStore,
    pub model: Box<dyn PartedModule>,
    /// Who it works with; with ZeRO-3 the shards the parameters live in, gathered part by part
    /// as the model runs.
    peers: Peers<'g>,
    /// The floating-point kind of the model's weights where not float32 (`--precision
    /// bf16-true`): floating-point inputs are cast to it, as a `model.half()` script casts them.
    inputs_kind: Option<Kind>,
}

impl<'g> LocalStep<'g> {
    /// A model run as one piece.
    pub fn new(vs: nn::VarStore, model: Box<dyn nn::ModuleT>, parallel: Parallel<'g>) -> Self {
        Self::parted(vs, Box::new(crate::models::OnePart(model)), parallel)
    }

    /// A model that knows its parts (only ZeRO-3 runs them one by one).
    pub fn parted(vs: nn::VarStore, model: Box<dyn PartedModule>, parallel: Parallel<'g>) -> Self {
        let inputs_kind = weights_kind(&vs);
        let peers = Peers::new(parallel).with_frozen(frozen_parameters(&vs));
        LocalStep { vs, model, peers, inputs_kind }
    }

    /// One of `parallel`'s replicas (or the model alone), its parameters sharded where their
    /// strategy shards them ([`super::Strategy::shard_parameters`]: ZeRO-3, FSDP, HSDP): each
    /// part of the model ([`PartedModule`]) is then a unit, gathered before it runs and freed
    /// after.
    pub fn replica(vs: nn::VarStore, model: Box<dyn PartedModule>, parallel: Parallel<'g>) -> Result<Self> {
        let shards = match &parallel.replicas {
            Some(replicas) => replicas.strategy.shard_parameters(replicas, crate::models::named_parameters(&vs), &|name| model.part_of(name))?,
            None => None,
        };
        let step = Self::parted(vs, model, parallel);
        Ok(match shards {
            Some(shards) => LocalStep { peers: step.peers.with_zero3(shards), ..step },
            None => step,
        })
    }

    /// The model's output for `xs`: at once, or part by part through ZeRO-3's shards.
    fn run(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let cast;
        let xs = match self.inputs_kind {
            Some(kind) if xs.is_floating_point() && xs.kind() != kind => {
                cast = xs.to_kind(kind);
                &cast
            }
            _ => xs,
        };
        match &self.peers.zero_shards() {
            None => Ok(self.model.forward_t(xs, train)),
            Some(shards) => self.model.forward_parts(xs, train, &mut |part, run| shards.around(part, run)),
        }
    }

    /// The mean loss of the model's output for `batch` and, when asked, its hits: the model's
    /// own where it computes them itself ([`PartedModule::own_loss`]; not with ZeRO-3's
    /// shards, which the plan refuses), else the loss of its output.
    fn loss_and_hits(&self, batch: &Batch, train: bool, count_hits: bool) -> Result<(Tensor, Option<Tensor>)> {
        if self.peers.zero_shards().is_none() {
            if let Some(own) = self.model.own_loss(&batch.inputs, &batch.targets, train, count_hits) {
                return own;
            }
        }
        let logits = self.run(&batch.inputs, train)?;
        Ok(loss_and_hits(&logits, &batch.targets, count_hits))
    }
}

impl<'g> TrainStep<'g> for LocalStep<'g> {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        crate::models::named_parameters(&self.vs)
    }

    fn named_variables(&self) -> Vec<(String, Tensor)> {
        let mut vars: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }

    fn input_device(&self) -> Device {
        self.vs.device()
    }

    fn sync(&self) -> &dyn StepSync<'g> {
        &self.peers
    }

    fn forward_backward(&mut self, batch: &Batch, weight: f64, ctx: &StepContext) -> Result<StepOutput> {
        let device = self.vs.device();
        let t0 = Instant::now();
        let (loss, hits) = precision::autocast(ctx.precision, device, || self.loss_and_hits(batch, true, ctx.count_hits))?;
        if ctx.sync_phases {
            synchronize(device);
        }
        let t1 = Instant::now();
        // An accumulated step weights each batch by its share (no multiplication otherwise: the
        // plain step stays bitwise torch's).
        let weighted = if weight == 1.0 { loss.shallow_clone() } else { &loss * weight };
        // (ZeRO's hooks communicate inside LibTorch's backward and can fail: f_backward.)
        match ctx.scaler {
            Some(scaler) => scaler.scale(&weighted).f_backward()?,
            None => weighted.f_backward()?,
        }
        synchronize(device);
        let examples = batch.len();
        Ok(StepOutput {
            loss_sum: Some(loss.detach().to_kind(Kind::Double) * examples as f64),
            hits,
            examples,
            phases: vec![("forward", t0, t1), ("backward", t1, Instant::now())],
            ..StepOutput::default()
        })
    }

    fn evaluate(&mut self, source: &dyn BatchSource, precision: Precision) -> Result<EvalSums> {
        tch::no_grad(|| {
            let mut sums = EvalSums::default();
            for batch in source.epoch(0) {
                let batch = batch?;
                let device = batch.inputs.device();
                let (loss, hits) = precision::autocast(precision, device, || self.loss_and_hits(&batch, false, true))?;
                sums.loss_sum += loss.double_value(&[]) * batch.len() as f64;
                sums.hits += hits.map_or(0, |h| h.int64_value(&[])) as f64;
                sums.examples += batch.len() as f64;
            }
            Ok(sums)
        })
    }
}

impl<'g> ParallelStep<'g> for LocalStep<'g> {
    fn peers(&self) -> &Peers<'g> {
        &self.peers
    }
}
