//! One training run on one device, in the order it happens: the step and optimizer built from
//! the exercise's model and the job's plan ([`build`]), the loop's configuration and observers,
//! the loop, then what is measured after it (the replicas' agreement, memory, the test pass).
//! What rank 0 prints and writes of it is [`super::results`]'.
use std::cell::RefCell;
use std::rc::Rc;

use anyhow::Result;
use tch::Device;

use super::built::{Built, Place};
use super::files::checkpoint_config;
use super::results::{self, Measured, StepCommunication};
use super::{Experiment, Forward, RunRecipe, Sources};
use crate::comm::layout::Groups;
use crate::comm::CommStats;
use crate::device::{self, DeviceChoice};
use crate::error::usage;
use crate::flags::RunArgs;
use crate::memory::{self, MemoryMeter, ModelState};
use crate::optim::OptimizerSpec;
use crate::parallel::zero::ZeroStage;
use crate::parallel::{optimizer_for, DataParallelPlan, GradientSync};
use crate::parallelize::{parallelize, StepContext};
use crate::precision::Precision;
use crate::profile::libtorch::TorchProfiler;
use crate::report::{self, RunRecord};
use crate::train::sinks::{CheckpointEveryEpoch, ProfileSink, ProgressBars, StepLosses, TensorBoardLog};
use crate::train::{self, CheckpointConfig, EvalSums, Event, Metric, Observer, Observers, TrainConfig, TrainStep};

/// One training run at `place`: built, trained, measured; rank 0's record.
pub(super) fn train_on<'g, E: Experiment>(exp: &E, data: &E::Data, place: Place<'g>, session: &mut Observers) -> Result<Option<RunRecord>> {
    let Place { groups, run_part, device } = place;
    if device.is_cuda() && !exp.run_args().deterministic {
        // cuDNN times its algorithms once per shape and keeps the fastest (not with --deterministic).
        tch::Cuda::cudnn_set_benchmark(true);
    }
    if groups.is_root() {
        announce_matmul_precision(exp.run_args(), device, session)?;
    }
    // Peak memory from the data in place: the model's state, activations and temporaries.
    let (mut built, meter) = build(exp, data, place, session)?;
    // Checked writable before the data were read, created only now: a run refused before
    // this point leaves no folder behind.
    make_folders(exp.run_args())?;
    let config = train_config(exp, &built, place)?;
    if config.cuda_graph {
        built.optimizer.make_capturable()?;
    }
    let step_losses = StepLosses::new();
    let losses = step_losses.values();
    let per_step = Rc::new(RefCell::new(None));
    let mut observers = observers_for(exp, &built.name, groups, device, session)?;
    observers.add(StepTraffic { groups, first: None, done: false, per_step: per_step.clone() });
    observers.add(MemoryMeter::observer(&meter));
    observers.add(step_losses);
    let before = groups.comm_stats();
    let Built { step, optimizer, sources, .. } = &mut built;
    let fit = train::fit(step.as_mut(), optimizer.as_mut(), sources.train.as_ref(), sources.eval.as_ref(), &config, &mut observers);
    if let (Err(stopped), Some(part)) = (&fit, run_part) {
        // Ranks stopped by a signal (with their checkpoint) are done too: the ranks the style
        // set apart (which serve until every rank that trains says so) must hear it, or the
        // job never ends.
        if stopped.is::<crate::error::Stopped>() {
            part.finish()?;
        }
    }
    let mut fit = match fit {
        Err(stopped) if stopped.is::<crate::error::Stopped>() && groups.is_root() => return Err(requeue_after(stopped, exp.run_args(), &mut observers)),
        fit => fit?,
    };
    let communication = groups.comm_stats().since(before);
    // Every rank says it is done (to the ranks set apart); rank 0 gets the style's figures.
    let style_report = run_part.map(|part| part.finish()).transpose()?.flatten();
    drop(observers);
    if fit.steps == 0 && !exp.run_args().eval_only {
        // A finished run resumed (a requeued or resubmitted job): its results stay as they are,
        // not replaced by those of a run of no steps. Every rank resumed the same checkpoint.
        if groups.is_root() {
            session.info(nothing_to_train(&built.name, &fit, &config, &exp.run_args().results_dir))?;
        }
        return Ok(None);
    }
    let test = measure_after_training(exp, &mut built, &meter, groups, &mut fit)?;
    let allreduce_by_rank = crate::comm::waits::gather(groups.world, fit.timings.allreduce_s)?;
    let measured = Measured {
        fit,
        test: test.sums,
        communication,
        per_step: per_step.borrow_mut().take(),
        memory: test.memory,
        peaks: test.peaks,
        params: test.params,
        step_losses: losses.borrow().clone(),
        style_report,
        allreduce_by_rank,
    };
    if !groups.is_root() {
        return Ok(None);
    }
    if exp.run_args().eval_only {
        return results::report_evaluation(exp, data, &built, &measured, device, session).map(|()| None);
    }
    results::write_results(exp, data, &built, &measured, groups, device, session).map(Some)
}

/// The line of a resumed run that had nothing left to train.
fn nothing_to_train(name: &str, fit: &train::FitReport, config: &TrainConfig, results_dir: &std::path::Path) -> String {
    let at = match config.max_steps.filter(|_| fit.resumed_epochs < config.epochs) {
        Some(max_steps) => format!("already at --max-steps {max_steps} (after epoch {} of {})", fit.resumed_epochs, config.epochs),
        None => format!("already at epoch {} of {}", fit.resumed_epochs, config.epochs),
    };
    format!("[{name}] {at}, nothing to train; results left as they are ({})", report::results_path(results_dir, name).display())
}

/// `--matmul-precision` with float32 training: what it allows, said once.
fn announce_matmul_precision(run: &RunArgs, device: Device, session: &mut Observers) -> Result<()> {
    if run.precision != Precision::Full || run.matmul_precision == Default::default() {
        return Ok(());
    }
    let what = match run.matmul_precision {
        crate::precision::MatmulPrecision::Medium => "bfloat16 inner products allowed",
        _ => "TF32 tensor cores where the GPU has them",
    };
    session.info(format!(
        "[{}] --matmul-precision {}: float32 matrix products with {what} (LibTorch's setting: {})",
        device::device_name(device),
        run.matmul_precision.name(),
        crate::torch_ext::float32_matmul_precision()
    ))
}

/// The exercise's model laid out by the job's plan ([`parallelize`]), its data, and the
/// optimizer over what this rank trains.
fn build<'g, E: Experiment>(exp: &E, data: &E::Data, place: Place<'g>, session: &mut Observers) -> Result<(Built<'g, E::Model>, RefCell<MemoryMeter>)> {
    let Place { groups, run_part, device } = place;
    let (run, preset) = (exp.run_args(), exp.preset());
    let plan = exp.model(data, groups, device, session)?;
    let zero = exp.parallel_args().zero_stage();
    if let Some(stage) = zero {
        check_zero(exp, stage, groups)?;
    }
    let sync = run_part.map_or_else(|| GradientSync::of_run(preset.sync, zero, groups.shard_groups().is_some()), |part| part.sync());
    let dp = DataParallelPlan { averager: exp.parallel_args().averager(), sync };
    let replicas = groups.layout.dp;
    let sources = exp.sources(data, device, (groups.coords.replica, replicas))?;
    check_batches(exp, &sources, replicas)?;
    let meter = RefCell::new(MemoryMeter::start(&exp.devices(&plan, device))?);
    let parallel_step = parallelize(&plan, &StepContext { groups, dp, device, seed: run.seed, precision: run.precision }, session)?;
    exp.describe(&plan, parallel_step.as_ref(), groups, device, session)?;
    // --epochs, else the recipe's course's (JSC's 10, Namal/BSC's 5), else the exercise's.
    let epochs = run.epochs.unwrap_or_else(|| preset.epochs_for(exp.recipe_args()));
    let recipe = RunRecipe::resolve(preset, exp.recipe_args(), replicas, sources.train.batches_per_epoch(), epochs);
    let kernel = exp.recipe_args().optimizer_kernel;
    let spec = OptimizerSpec { kind: recipe.optimizer, lr: recipe.lr, momentum: recipe.momentum, weight_decay: recipe.weight_decay, kernel };
    let build = |named| spec.build(named);
    let mut optimizer = optimizer_for(parallel_step.as_ref(), &build)?;
    let mut step: Box<dyn TrainStep<'g> + 'g> = parallel_step;
    if let Some(part) = run_part {
        // The style's own step and optimizer (where its optimizer runs on the ranks it set
        // apart, and the step evaluates their parameters).
        part.check(run.precision, run.cuda_graph)?;
        step = part.clone().step(step);
        optimizer = part.clone().optimizer(step.named_parameters(), spec);
    }
    // --straggler: this rank sleeps in every step (any strategy).
    let optimizer = crate::parallel::Straggled::wrap(optimizer, exp.parallel_args().straggler, groups.world.rank());
    let name = super::files::run_name(exp, device);
    Ok((Built { plan, step, optimizer, recipe, sources, sync, name, data_identity: exp.data_identity(data) }, meter))
}

/// The loop's configuration for `built` (with `--cuda-graph`, the optimizer made capturable).
fn train_config<E: Experiment>(exp: &E, built: &Built<'_, E::Model>, place: Place<'_>) -> Result<TrainConfig> {
    let Place { groups, run_part, device } = place;
    let run = exp.run_args();
    let recipe = &built.recipe;
    // --cuda-graph records GPU steps; the CPU leg of a CPU-vs-GPU comparison trains as usual.
    let cuda_graph = run.cuda_graph && (device.is_cuda() || run.device == DeviceChoice::Cpu);
    if cuda_graph {
        check_cuda_graph(exp, groups, device, recipe)?;
    }
    let flags = super::recorded_flags(exp)?;
    Ok(TrainConfig {
        run: built.name.clone(),
        epochs: recipe.epochs,
        max_steps: run.max_steps,
        seed: run.seed,
        lr_schedule: recipe.schedule,
        accumulate: recipe.accumulate,
        clip_grad_norm: (recipe.clip > 0.0).then_some(recipe.clip),
        checkpoint: checkpoint_config(run).map(|(dir, resume, from)| CheckpointConfig {
            dir,
            resume,
            model: exp.model_identity(&built.plan),
            data: built.data_identity.clone(),
            config: flags,
            from,
            keep: run.keep_checkpoints,
            every_steps: run.checkpoint_every.map(|n| n as usize),
            every_minutes: run.checkpoint_minutes,
            format: run.checkpoint_format,
            examples_per_step: recipe.batch_size * groups.layout.dp * recipe.accumulate,
        }),
        metric: exp.metric(),
        precision: run.precision,
        profile: run.profiling().is_some(),
        steady_after: run.steady_after,
        cuda_graph,
        eval_only: run.eval_only,
        lockstep: run_part.is_none_or(|part| part.lockstep()),
        faults: train::Faults::from_env(),
    })
}

/// The loop's observers: the session's, the epoch checkpoints, and the sinks the flags ask for
/// (progress bars, TensorBoard, the profiler) on the ranks that write them.
fn observers_for<'s, E: Experiment>(exp: &E, name: &str, groups: &Groups, device: Device, session: &'s mut Observers) -> Result<Observers<'s>> {
    let (run, root) = (exp.run_args(), groups.is_root());
    let mut observers = Observers::new().with(Forward(session)).with(CheckpointEveryEpoch);
    if root && !run.quiet {
        observers.add(ProgressBars::new());
    }
    if let (Some(dir), true) = (&run.tensorboard, root) {
        observers.add(TensorBoardLog::new(&dir.join(name), exp.metric())?);
    }
    if let Some(window) = run.profiling() {
        // A model spread over ranks: traces per rank; otherwise rank 0's.
        let spread = groups.layout.pp * groups.layout.tp > 1;
        if spread || root {
            let rank = spread.then_some(groups.world.rank());
            let torch = TorchProfiler::new(window, device.is_cuda(), run.trace_path(name, "torch-trace", rank));
            observers.add(ProfileSink::new(run.trace_path(name, "trace", rank), torch, groups.world.rank(), root, run.steady_after));
        }
    }
    Ok(observers)
}

/// What every rank measures after the loop (collectives: every rank takes part).
struct AfterTraining {
    sums: EvalSums,
    memory: ModelState,
    peaks: Vec<memory::PeakMemory>,
    params: i64,
}

/// The replicas' agreement, the model state's memory, the peaks, the parameter count and the
/// test pass (its time added to `fit`'s evaluation time).
fn measure_after_training<E: Experiment>(
    exp: &E,
    built: &mut Built<'_, E::Model>,
    meter: &RefCell<MemoryMeter>,
    groups: &Groups,
    fit: &mut train::FitReport,
) -> Result<AfterTraining> {
    let Built { step, optimizer, sources, sync, .. } = built;
    let replica_group = step.sync().replicas();
    if let Some(group) = replica_group {
        step.sync().materialize()?;
        train::check_replicas_agree(&step.named_variables(), group)?;
        step.sync().release(false)?;
    }
    let memory = ModelState::measure(&step.named_parameters(), step.sync().frozen(), optimizer.as_ref(), groups.layout.dp, *sync);
    let peaks = memory::gather(&meter.borrow().peaks(groups.world.rank())?, groups.world)?;
    let params = results::step_parameter_count(groups, step.as_ref())?;
    let sums = match &sources.test {
        Some(test) => {
            let started = std::time::Instant::now();
            let sums = step.evaluate(test.as_ref(), exp.run_args().precision)?.over(replica_group)?;
            fit.timings.eval_s += started.elapsed().as_secs_f64();
            sums
        }
        None => EvalSums { loss_sum: fit.eval_loss, hits: fit.eval_acc, examples: 1.0 },
    };
    Ok(AfterTraining { sums, memory, peaks, params })
}

/// What each of a rank's mesh groups moved ([`Groups::comm_stats_by_group`]).
type GroupCounts = Vec<(&'static str, CommStats)>;

/// Measures what one training step moves: the collectives of all of this rank's groups between
/// the first and the last step's end of the first epoch (no evaluation or checkpoint between),
/// in all and by group.
struct StepTraffic<'g> {
    groups: &'g Groups<'g>,
    /// The first step's number and the counts at its end, in all and by group.
    first: Option<(usize, CommStats, GroupCounts)>,
    /// The first epoch has ended.
    done: bool,
    per_step: Rc<RefCell<Option<StepCommunication>>>,
}

impl Observer for StepTraffic<'_> {
    fn on_event(&mut self, event: &Event) -> Result<train::Control> {
        match (event, &self.first) {
            (Event::Step(_), _) if self.done => {}
            (Event::Step(step), None) => self.first = Some((step.step, self.groups.comm_stats(), self.groups.comm_stats_by_group())),
            (Event::Step(step), Some((first, at_first, by_group_at_first))) if step.step > *first => {
                let steps = (step.step - first) as u64;
                let by_group =
                    self.groups.comm_stats_by_group().into_iter().zip(by_group_at_first).map(|((name, now), (_, then))| (name, now.since(*then).per(steps)));
                *self.per_step.borrow_mut() = Some(StepCommunication {
                    all: self.groups.comm_stats().since(*at_first).per(steps),
                    by_group: by_group.filter(|(_, stats)| *stats != CommStats::default()).collect(),
                });
            }
            (Event::EpochEnded { .. }, Some(_)) => self.done = true,
            _ => {}
        }
        Ok(train::Control::Continue)
    }
}

/// What `--cuda-graph` cannot record, refused before anything trains: a step that communicates
/// (ranks), waits for the host (float16's scaler, `--profile`) or runs several batches.
fn check_cuda_graph<E: Experiment>(exp: &E, groups: &Groups, device: Device, recipe: &RunRecipe) -> Result<()> {
    let run = exp.run_args();
    if !device.is_cuda() {
        return usage(format!("--cuda-graph records GPU work, but this run trains on {}: drop it, or train on a GPU", device::device_name(device)));
    }
    if groups.world.world_size() > 1 {
        return usage("--cuda-graph records one process's step; with several ranks (their collectives) it is not supported yet");
    }
    if recipe.accumulate > 1 {
        return usage("--cuda-graph records a step of one batch: drop --accumulate (or use a larger --batch-size)");
    }
    if run.precision == Precision::Half {
        return usage("--cuda-graph with --precision 16-mixed (its scaler decides on the host) is not supported: use bf16-mixed or 32");
    }
    if run.profiling().is_some() {
        return usage("--cuda-graph replays the whole step at once: --profile cannot time its phases");
    }
    Ok(())
}

/// What ZeRO does not cover (yet), refused before anything trains.
fn check_zero<E: Experiment>(exp: &E, stage: ZeroStage, groups: &Groups) -> Result<()> {
    use crate::optim::OptimizerKind;
    let (run, recipe) = (exp.run_args(), exp.recipe_args());
    let n = stage.number();
    let optimizer = recipe.optimizer.unwrap_or(exp.preset().recipe_for(recipe).optimizer);
    if matches!(optimizer, OptimizerKind::Lars | OptimizerKind::Lamb) {
        return usage(format!("--zero {n} shards element-wise optimizers (adam, sgd); {} needs whole layers", optimizer.name()));
    }
    if run.precision == Precision::Half {
        return usage(format!("--zero {n} with --precision 16-mixed (a gradient scaler over the shards) is not built yet: use bf16-mixed or 32"));
    }
    if run.precision.weights_kind().is_some() {
        return usage(format!("--zero {n} with --precision {} (shards of 16-bit weights) is not built yet: use bf16-mixed", run.precision.name()));
    }
    if stage != ZeroStage::OptimizerState && groups.layout.pp * groups.layout.tp > 1 {
        return usage(format!("--zero {n} is for whole models on each replica; with pipeline stages or tensor-parallel shards use --zero 1"));
    }
    Ok(())
}

/// A run a signal stopped: its Slurm job queued again where `--requeue` says so (it resumes from
/// the checkpoint just written), then the stop itself, for its exit code.
fn requeue_after(stopped: anyhow::Error, run: &RunArgs, session: &mut Observers) -> anyhow::Error {
    let saved = stopped.downcast_ref::<crate::error::Stopped>().is_some_and(|s| s.checkpoint.is_some());
    if !saved || !run.resume {
        // Requeued without a checkpoint to resume from, it would start over: not asked for.
        return stopped;
    }
    let said = match crate::slurm::requeue(run.requeue) {
        Ok(Some(job)) => session.info(format!("requeued Slurm job {job}: it resumes from the checkpoint")),
        Ok(None) => Ok(()),
        // The checkpoint is safe and the stop still exits 75: a job script can resubmit.
        Err(err) => session.warn(format!("{err:#}")),
    };
    match said {
        Ok(()) => stopped,
        Err(err) => err,
    }
}

/// A split too small for one full batch per replica trains nothing (and would report success,
/// a perplexity of 1) or trains a smaller batch than asked for: a usage error naming its size
/// and the batch instead.
fn check_batches<E: Experiment>(exp: &E, sources: &Sources, replicas: usize) -> Result<()> {
    let unit = match exp.metric() {
        Metric::Accuracy => "images",
        Metric::Perplexity => "tokens",
    };
    let batch = RunRecipe::resolve(exp.preset(), exp.recipe_args(), replicas, 1, 1).batch_size;
    if sources.train.batches_per_epoch() == 0 || sources.examples_per_epoch < batch * replicas {
        return usage(format!(
            "the training split ({} {unit}) holds no full batch of --batch-size {batch} for each of {replicas} replica(s): lower --batch-size, or use a larger data set",
            sources.examples_per_epoch
        ));
    }
    let (accumulate, batches) = (exp.recipe_args().accumulate, sources.train.batches_per_epoch());
    if accumulate > batches {
        return usage(format!(
            "--accumulate {accumulate}: an epoch holds {batches} batches per replica, so no step would gather that many: at most --accumulate {batches}, or a larger data set"
        ));
    }
    let evaluated = [Some(&sources.eval), sources.test.as_ref()];
    if evaluated.into_iter().flatten().any(|source| source.batches_per_epoch() == 0) {
        return usage(format!(
            "an evaluation split holds no batch for each of {replicas} replica(s): lower the batch size (--eval-batch-size for a language model)"
        ));
    }
    Ok(())
}

/// The folders the run writes into (`--results-dir`, `--checkpoint-dir`), created with their
/// parents where missing. (A link at their names is followed: it is the user's own choice of
/// where results go; the files the run names itself are checked by [`super::files::check`].)
fn make_folders(run: &RunArgs) -> Result<()> {
    for dir in std::iter::once(&run.results_dir).chain(run.checkpoint_dir.as_ref()) {
        std::fs::create_dir_all(dir).map_err(|err| anyhow::anyhow!("cannot create {}: {err}", dir.display()))?;
    }
    Ok(())
}
