//! From a model and a job's layout to the step the training loop trains (torchtitan's
//! `parallelize`): the model, this rank's part of it, and who it averages and agrees with.
//!
//! | model | layout | step |
//! |---|---|---|
//! | an image classifier, the Transformer | dp replicas (dp ≥ 1) | [`LocalStep`]: the whole model, gradients averaged over the replicas |
//! | the Transformer, stages on this process's devices | one process | [`Pipeline`]: a thread per stage |
//! | the Transformer, a stage per rank (or several, interleaved) | dp × pp ranks | [`StageProcess`]: this rank's stages, activations to its neighbours, gradients averaged over its replicas |
//!
//! A new parallelism (tensor parallelism, sharded data parallelism) is a new row: a
//! [`TrainStep`] and the [`Groups`] it talks over; the loop does not change.
use std::path::PathBuf;

use anyhow::Result;
use tch::{nn, Device};

use crate::comm::layout::Groups;
use crate::comm::ProcessGroup;
use crate::error::usage;
use crate::models::{self, Blocks, ModelSpec, OnePart, OutputInit, PartedModule, Trainable, TransformerConfig, TransformerLm};
use crate::parallel::{DataParallelPlan, LocalStep, Parallel, ParallelStep};
use crate::pipeline::process::StageProcess;
use crate::pipeline::{Partition, Pipeline, PipelineOptions, Placement, Schedule, Stage};
use crate::precision::Precision;
use crate::train::Observers;

/// Where and how a step is built, whatever the model: the job's groups (its layout and this
/// rank's place in it), the data-parallel style, this rank's device, the seed (the same on
/// every rank) and the precision.
#[derive(Clone, Copy)]
pub struct StepContext<'g> {
    pub groups: &'g Groups<'g>,
    pub dp: DataParallelPlan,
    pub device: Device,
    pub seed: u64,
    pub precision: Precision,
}

/// A plan of what to train that knows how to lay itself out over a job (torchtitan's
/// per-model `parallelize_fn`): each exercise's model is one, and the layout, the
/// data-parallel style and the pipeline it is given are model-agnostic.
pub trait Parallelize {
    /// This rank's step for `cx`'s layout (see [`parallelize`]).
    fn build_step<'g>(&self, cx: &StepContext<'g>, observers: &mut Observers) -> Result<Box<dyn ParallelStep<'g> + 'g>>;
}

/// An image classifier, from `weights` (torchvision names) when given, its blocks before the
/// `trainable` ones frozen, in the channels-last memory format when asked.
#[derive(Debug, Clone)]
pub struct ImagePlan {
    pub spec: ModelSpec,
    pub weights: Option<PathBuf>,
    pub trainable: Trainable,
    pub channels_last: bool,
}

/// The Transformer language model, whole, cut into pipeline stages, or into tensor-parallel
/// shards of one stage, its output layer initialised as `init` says; its tensor-parallel layers
/// with sequence parallelism where `sequence_parallel` says.
#[derive(Debug, Clone)]
pub struct TransformerPlan {
    pub config: TransformerConfig,
    pub pipeline: Option<PipelinePlan>,
    pub init: OutputInit,
    pub sequence_parallel: bool,
    /// `--loss-chunks`: the whole model's output layer and loss computed this many chunks of
    /// the tokens at a time (only the whole model held on each rank: not with stages, shards
    /// or ZeRO-3).
    pub loss_chunks: Option<i64>,
}

/// How the Transformer is cut into stages.
#[derive(Debug, Clone)]
pub struct PipelinePlan {
    pub partition: Partition,
    pub options: PipelineOptions,
    /// One device per stage thread (each holding `options.virtual_stages` stages) when they are
    /// threads of this process; empty when each rank of the layout's `pp` runs its stages.
    pub devices: Vec<Device>,
}

impl PipelinePlan {
    /// One stage of all `layers`, on the ranks of the layout: tensor parallelism without a
    /// pipeline (`exercise1_nlp --tp`), the layers cut over the shards of the one stage.
    pub fn single_stage(layers: i64) -> Result<PipelinePlan> {
        let options = PipelineOptions { schedule: Schedule::GPipe, virtual_stages: 1, chunks: 1, checkpoint_activations: false, threads_per_stage: None };
        Ok(PipelinePlan { partition: Partition::even(layers, 1)?, options, devices: Vec::new() })
    }
}

/// Builds this rank's step: the model (seeded with `cx.seed`, the same on every rank) on
/// `cx.device`, or this rank's part of it, its weights in the 16-bit type where `cx.precision`
/// is a true one (`16-true`, `bf16-true`: `model.half()`), and its replicas from `cx.groups`.
/// Rank 0 tells `observers` what it loaded and froze.
pub fn parallelize<'g, M: Parallelize + ?Sized>(model: &M, cx: &StepContext<'g>, observers: &mut Observers) -> Result<Box<dyn ParallelStep<'g> + 'g>> {
    model.build_step(cx, observers)
}

/// The step of a model held whole on every rank (alone or as a data-parallel replica, its
/// parameters sharded over the replicas with ZeRO-3): `build` makes it in a var store seeded
/// with `cx.seed`, whose floating-point variables then take the 16-bit kind of a true precision.
fn whole_model<'g>(cx: &StepContext<'g>, build: impl FnOnce(&nn::VarStore) -> Result<Box<dyn PartedModule>>) -> Result<Box<dyn ParallelStep<'g> + 'g>> {
    let StepContext { groups, dp, device, seed, precision } = *cx;
    if groups.layout.pp * groups.layout.tp != 1 {
        return usage(format!("this model is not split into parts, but the job's layout is {}", groups.layout.describe()));
    }
    let parallel = Parallel::of(groups, dp, crate::comm::tensor_parallel::SplitTable::uncut());
    if let Some(replicas) = &parallel.replicas {
        replicas.averager.check(replicas.group, device)?;
        check_reduces(replicas.group, device, precision)?;
    }
    tch::manual_seed(seed as i64);
    let mut vs = nn::VarStore::new(device);
    let module = build(&vs)?;
    if let Some(kind) = precision.weights_kind() {
        // `model.half()`: every floating-point variable, parameters and batch-norm
        // statistics alike, after the weights were loaded in float32.
        vs.set_kind(kind);
    }
    Ok(Box::new(LocalStep::replica(vs, module, parallel)?))
}

impl Parallelize for ImagePlan {
    fn build_step<'g>(&self, cx: &StepContext<'g>, observers: &mut Observers) -> Result<Box<dyn ParallelStep<'g> + 'g>> {
        whole_model(cx, |vs| {
            let module = models::build(&vs.root(), &self.spec);
            let blocks = Blocks::of(&self.spec);
            // Before the step is built: its ZeRO-3 shards and the optimizer take the
            // parameters that still train.
            let loaded = self.weights.as_ref().map(|path| models::load_weights(vs, path, blocks.head())).transpose()?;
            let frozen = models::freeze(vs, &blocks, self.trainable, self.spec.arch.name())?;
            if cx.groups.is_root() {
                for line in loaded.map(|l| l.describe()).into_iter().chain(frozen.map(|f| f.describe())) {
                    observers.info(line)?;
                }
            }
            Ok(Box::new(OnePart(match self.channels_last {
                true => Box::new(models::ChannelsLast::new(vs, module)?),
                false => module,
            })))
        })
    }
}

impl Parallelize for TransformerPlan {
    fn build_step<'g>(&self, cx: &StepContext<'g>, _observers: &mut Observers) -> Result<Box<dyn ParallelStep<'g> + 'g>> {
        let StepContext { groups, dp, device, seed, precision } = *cx;
        let config = &self.config;
        if self.pipeline.is_some() {
            dp.sync.strategy().check_stages()?;
        }
        if self.loss_chunks.is_some() && (self.pipeline.is_some() || dp.sync.strategy().parameters_sharded()) {
            return usage(
                "--loss-chunks computes the whole output layer on one rank: not with pipeline stages, tensor-parallel shards or ZeRO-3's sharded parameters",
            );
        }
        let step: Box<dyn ParallelStep<'g> + 'g> = match &self.pipeline {
            // (Token ids stay integers: only the weights change kind.)
            None => whole_model(cx, |vs| Ok(Box::new(TransformerLm::new(&vs.root(), config)?.with_loss_chunks(self.loss_chunks)) as Box<dyn PartedModule>))?,
            Some(_) if precision.weights_kind().is_some() => {
                return usage(format!(
                    "--precision {} with pipeline stages or tensor-parallel shards is not built yet (their activations pass in float32): use bf16-mixed",
                    precision.name()
                ))
            }
            Some(plan) if !plan.devices.is_empty() => {
                if groups.world.world_size() > 1 {
                    return usage("--devices puts every stage in this process; a job of several ranks runs one stage per rank: drop --devices or the launcher");
                }
                Box::new(Pipeline::new(config, &plan.partition, &plan.devices, seed, plan.options)?)
            }
            Some(plan) => {
                let placement = Placement { devices: groups.layout.pp, virtual_stages: plan.options.virtual_stages };
                let stages = placement.stages();
                if plan.partition.stages() != stages {
                    return usage(format!("a partition into {} stages for a layout of {stages}", plan.partition.stages()));
                }
                placement.check_layers(config.nlayers)?;
                let mine = placement
                    .stages_of(groups.coords.stage)
                    .map(|s| {
                        let stage = Stage::new_sharded(config, s, stages, plan.partition.layers[s].clone(), device, seed, groups.shard())?;
                        if self.sequence_parallel {
                            stage.sequence_parallel()
                        } else {
                            Ok(stage)
                        }
                    })
                    .collect::<Result<_, _>>()?;
                Box::new(StageProcess::new(groups, mine, plan.options, dp)?)
            }
        };
        self.init.apply(&step.named_parameters(), config, seed, step.peers().parallel.tp.as_ref())?;
        Ok(step)
    }
}

/// Fails, with a usage error, where the replicas' engine cannot average the gradients of a
/// model held in `precision` (MPI has no 16-bit floating-point types; NCCL has both).
fn check_reduces(group: &ProcessGroup, device: Device, precision: Precision) -> Result<()> {
    let Some(kind) = precision.weights_kind() else { return Ok(()) };
    let engine = group.backend_for(device)?;
    if group.world_size() > 1 && !engine.supports_kind(kind) {
        return usage(cannot_average(precision, group.world_size(), engine.name(), device));
    }
    Ok(())
}

/// Why `replicas` replicas on `device` cannot average a `precision` model's gradients over the
/// engine `engine`; also said by the launcher, before it starts CPU ranks (MPI's).
pub fn cannot_average(precision: Precision, replicas: usize, engine: &str, device: Device) -> String {
    let kind = precision.weights_kind().unwrap_or(tch::Kind::Float);
    format!(
        "--precision {} over {replicas} replicas: the {engine} engine that averages {} gradients has no {kind:?}; \
         use bf16-mixed (float32 gradients), or GPUs (NCCL)",
        precision.name(),
        crate::device::device_name(device)
    )
}
