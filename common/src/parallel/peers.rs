//! What keeps a step's part of the model consistent with the ranks it works with ([`Peers`],
//! the loop's [`StepSync`]), for every strategy alike.
use std::rc::Rc;

use anyhow::Result;
use tch::Tensor;

use super::Parallel;
use crate::checkpoint::region::Region;
use crate::comm::data_parallel::{broadcast_named, broadcast_optimizer_state, broadcast_sharded_state};
use crate::comm::tensor_parallel::TensorShards;
use crate::comm::ProcessGroup;
use crate::optim::block::BlockLayout;
use crate::optim::{NormScope, Optimizer};
use crate::parallel::zero::Shards;
use crate::precision::GradScaler;
use crate::train::{GradientCollective, ParameterBlock, StepSync, TensorCut};

/// What keeps a step's part of the model consistent with the ranks that replicate it or hold
/// the rest of it, owned by the step: who they are ([`Parallel`]), ZeRO-3's sharded parameters
/// (gathered to be read or written, freed after), which parameters count in the norm over the
/// model, and which it holds without training them.
#[derive(Default)]
pub struct Peers<'g> {
    pub parallel: Parallel<'g>,
    zero3: Option<Rc<Shards<'g>>>,
    norm_counted: Vec<bool>,
    frozen: Vec<Tensor>,
}

impl<'g> Peers<'g> {
    pub fn new(parallel: Parallel<'g>) -> Self {
        Peers { parallel, ..Peers::default() }
    }

    /// With the parameters living in ZeRO-3's `shards`.
    pub fn with_zero3(self, shards: Rc<Shards<'g>>) -> Self {
        Peers { zero3: Some(shards), ..self }
    }

    /// With `counted` ([`StepSync::norm_counted`]).
    pub fn with_norm_counted(self, counted: Vec<bool>) -> Self {
        Peers { norm_counted: counted, ..self }
    }

    /// With the parameters this rank holds without training them ([`StepSync::frozen`]).
    pub fn with_frozen(self, frozen: Vec<Tensor>) -> Self {
        Peers { frozen, ..self }
    }

    /// ZeRO-3's sharded parameters, where the step was built with them.
    pub fn zero_shards(&self) -> Option<Rc<Shards<'g>>> {
        self.zero3.clone()
    }
}

impl<'g> StepSync<'g> for Peers<'g> {
    fn world(&self) -> Option<&'g ProcessGroup> {
        self.parallel.world
    }

    fn replicas(&self) -> Option<&'g ProcessGroup> {
        self.parallel.replica_group()
    }

    fn model(&self) -> Option<&'g ProcessGroup> {
        self.parallel.model
    }

    fn replica(&self) -> usize {
        self.parallel.replica
    }

    fn tensor_cut(&self) -> Option<&dyn TensorCut> {
        self.parallel.tp.as_ref().map(|tp| tp as &dyn TensorCut)
    }

    fn parameter_block(&self) -> Option<&dyn ParameterBlock> {
        self.zero3.as_deref().map(|shards| shards as &dyn ParameterBlock)
    }

    fn frozen(&self) -> &[Tensor] {
        &self.frozen
    }

    fn norm_counted(&self) -> &[bool] {
        &self.norm_counted
    }

    fn gradient_collective(&self, clip: bool) -> GradientCollective {
        self.parallel.replicas.map_or(GradientCollective::None, |r| r.strategy.gradient_collective(clip))
    }

    fn steps_apart(&self) -> Option<&'static str> {
        self.parallel.replicas.and_then(|r| r.strategy.steps_apart())
    }

    fn finish_gradients(&self, params: &[Tensor], optimizer: &mut dyn Optimizer, scaler: Option<&GradScaler>, clip: Option<f64>) -> Result<Option<f64>> {
        // The same for every kind of step, however the model is spread over ranks.
        let parallel = &self.parallel;
        if let Some(replicas) = &parallel.replicas {
            replicas.strategy.after_backward(replicas, params)?;
        }
        // A Horovod-style optimizer averages here, ZeRO's reduce-scatters; a local one does
        // nothing.
        optimizer.synchronize()?;
        if let Some(scaler) = scaler {
            scaler.unscale(params);
            // One verdict for the model: a stage that saw an inf makes every stage skip the step
            // (the replicas agree already: the inf went into their averages).
            if let Some(model) = parallel.model {
                scaler.agree(model)?;
            }
        }
        match clip {
            // The norm before clipping, as `torch.nn.utils.clip_grad_norm_` returns it.
            Some(max_norm) => Ok(Some(optimizer.clip_grad_norm(params, max_norm, NormScope { model: parallel.model, counted: &self.norm_counted })?)),
            None => Ok(None),
        }
    }

    fn materialize(&self) -> Result<()> {
        // ZeRO-3 gathers its parameters; nothing to do otherwise.
        self.zero3.as_ref().map_or(Ok(()), |shards| shards.gather_all())
    }

    fn release(&self, changed: bool) -> Result<()> {
        let Some(shards) = &self.zero3 else { return Ok(()) };
        if changed {
            // ZeRO-3 takes its block from the written parameters again.
            shards.refresh_block();
        }
        shards.free_all()
    }

    fn sync_buffers(&self, variables: Vec<(String, Tensor)>) -> Result<()> {
        let Some(group) = self.parallel.replica_group() else { return Ok(()) };
        let buffers: Vec<(String, Tensor)> = variables.into_iter().filter(|(_, t)| !t.requires_grad()).collect();
        broadcast_named(group, buffers, 0)
    }

    fn start_from_replica_zero(&self, variables: Vec<(String, Tensor)>, optimizer: &mut dyn Optimizer, restored_state: Vec<(String, Tensor)>) -> Result<()> {
        let Some(group) = self.parallel.replica_group() else { return Ok(()) };
        broadcast_named(group, variables, 0)?;
        if optimizer.sharded().is_some_and(|s| s.over_replicas()) {
            // Each replica keeps its own share: the whole state replica 0's rank restored
            // (nothing on a fresh start) goes to all of them.
            broadcast_sharded_state(group, optimizer, 0, restored_state)
        } else {
            broadcast_optimizer_state(group, optimizer, 0)
        }
    }
}

impl TensorCut for TensorShards<'_> {
    fn shard(&self) -> (usize, usize) {
        (self.shard.index, self.shard.count)
    }

    fn region(&self, name: &str, dims: usize) -> Result<Region> {
        Ok(match dims {
            0 => Region::WHOLE,
            _ => Region::cut(self.split(name, dims)?, self.shard),
        })
    }

    fn unshard_named(&self, named: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        TensorShards::unshard_named(self, named)
    }

    fn shard_of(&self, name: &str, whole: &Tensor) -> Result<Tensor> {
        TensorShards::shard_of(self, name, whole)
    }
}

impl ParameterBlock for Shards<'_> {
    fn layout(&self) -> BlockLayout {
        Shards::layout(self)
    }

    fn block(&self) -> Tensor {
        Shards::block(self)
    }

    fn load_block(&self, block: &Tensor) -> Result<()> {
        Shards::load_block(self, block)
    }

    fn writes_block(&self) -> bool {
        Shards::writes_block(self)
    }
}
