//! The training step as a CUDA graph (`--cuda-graph`), as `torch.cuda.graph` and
//! `torch.compile(mode="reduce-overhead")` run one: a few ordinary steps first (they choose the
//! kernels, create the optimizer's state and the gradients' memory), then the step's forward and
//! backward passes, gradient clipping and optimizer update recorded once into a graph that reads
//! its batch from fixed input tensors, then every step copies its batch into those tensors and
//! replays the graph: one launch for the hundreds of kernels a small model's step makes.
//!
//! What makes a recorded step correct on replay: the inputs are always the same tensors; the
//! gradients are not reset between replays (the recorded backward pass writes them afresh);
//! the optimizer reads its learning rate and step counts from device tensors
//! ([`crate::optim::Optimizer::make_capturable`]); nothing inside waits for the device or reads
//! a value from it ([`crate::cuda_graph::capturing`]); dropout draws from LibTorch's default
//! generator, which the graph registers, so each replay draws new masks. A batch of another
//! shape (an epoch's shorter last batch) is trained without the graph: it uses the same
//! parameters and optimizer state in place.
use std::time::Instant;

use anyhow::Result;
use tch::Tensor;

use super::step::{StepContext, StepOutput, TrainStep};
use super::{Batch, Metric, Phase, TrainConfig};
use crate::cuda_graph::CudaGraph;
use crate::device::synchronize;
use crate::optim::Optimizer;
use crate::seed_keys::mix_key;

/// Ordinary steps before the capture (torch's examples warm up 3 iterations).
pub const WARMUP_STEPS: usize = 3;

/// A run's recorded step and what it reads and writes.
pub struct GraphedStep {
    warmup_left: usize,
    recorded: Option<Recorded>,
}

struct Recorded {
    graph: CudaGraph,
    /// The tensors the graph reads its batch from.
    inputs: Tensor,
    targets: Tensor,
    /// What the recorded step leaves behind on each replay (the loss sum, the hits).
    output: StepOutput,
}

impl Default for GraphedStep {
    fn default() -> Self {
        GraphedStep { warmup_left: WARMUP_STEPS, recorded: None }
    }
}

impl GraphedStep {
    /// Whether this step of `micro` batches goes through the graph: one batch (no accumulation)
    /// of the recorded shape, or any batch while there is no recording yet.
    pub fn takes(&self, micro: &[Batch]) -> bool {
        match (&self.recorded, micro) {
            (_, [_, _, ..]) | (_, []) => false,
            (None, [_]) => true,
            (Some(recorded), [batch]) => batch.inputs.size() == recorded.inputs.size() && batch.targets.size() == recorded.targets.size(),
        }
    }

    /// One optimizer step on `batch`: ordinary during the warm-up, recorded (and then run by one
    /// replay) at the end of it, replayed afterwards.
    pub fn step(
        &mut self,
        step: &mut dyn TrainStep<'_>,
        optimizer: &mut dyn Optimizer,
        batch: &Batch,
        config: &TrainConfig,
        global_step: usize,
    ) -> Result<(StepOutput, Vec<Phase>)> {
        if self.warmup_left > 0 {
            self.warmup_left -= 1;
            return super::optimizer_step(step, optimizer, None, std::slice::from_ref(batch), config, global_step);
        }
        let started = Instant::now();
        if self.recorded.is_none() {
            self.recorded = Some(Self::record(step, optimizer, batch, config, global_step)?);
        }
        let recorded = self.recorded.as_ref().expect("recorded above");
        tch::no_grad(|| {
            recorded.inputs.shallow_clone().copy_(&batch.inputs);
            recorded.targets.shallow_clone().copy_(&batch.targets);
        });
        recorded.graph.replay()?;
        // The recorded outputs are overwritten by the next replay: the loop keeps copies.
        let copy = |t: &Option<Tensor>| t.as_ref().map(Tensor::copy);
        let out = StepOutput {
            loss_sum: copy(&recorded.output.loss_sum),
            hits: copy(&recorded.output.hits),
            examples: recorded.output.examples,
            ..StepOutput::default()
        };
        synchronize(step.input_device());
        Ok((out, vec![("graph replay", started, Instant::now())]))
    }

    /// Records one step reading `batch`'s shapes from fixed tensors. The recording runs nothing:
    /// the caller replays it for this step's batch.
    fn record(step: &mut dyn TrainStep<'_>, optimizer: &mut dyn Optimizer, batch: &Batch, config: &TrainConfig, global_step: usize) -> Result<Recorded> {
        let inputs = batch.inputs.copy();
        let targets = batch.targets.copy();
        let fixed = Batch { inputs: inputs.shallow_clone(), targets: targets.shallow_clone() };
        let ctx = StepContext {
            precision: config.precision,
            scaler: None,
            dropout_key: mix_key(&[config.seed, global_step as u64, 0]),
            sync_phases: false,
            count_hits: config.metric == Metric::Accuracy,
        };
        // The recorded backward pass then makes the gradients (in the graph's own memory) rather
        // than adding to earlier ones.
        optimizer.zero_grad();
        let mut graph = CudaGraph::new(step.input_device())?;
        let output = graph.capture(|| {
            let output = step.forward_backward(&fixed, 1.0, &ctx)?;
            super::finish_gradients(&*step, optimizer, None, config.clip_grad_norm)?;
            optimizer.step()?;
            Ok(output)
        })?;
        Ok(Recorded { graph, inputs, targets, output })
    }
}
