//! The one training loop every exercise and every parallelism runs ([`fit`]), and the pieces it
//! is made of:
//!
//! - [`step::TrainStep`]: one optimizer step's work, the seam where the parallelism plugs in
//!   (a local model, data-parallel or not; a pipeline in threads; one stage per process);
//! - [`StepSync`]: what keeps a step's part consistent with the other ranks' (finishing its
//!   gradients: averaging, unscaling and clipping), which the strategies ([`crate::parallel`])
//!   implement and the loop only asks;
//! - [`schedule`]: the learning rate of every step (StepLR, cosine, one-cycle, warm-up);
//! - [`state`]: resuming from and writing checkpoints, however the model is spread over ranks;
//! - [`events`] and [`sinks`]: what the loop reports, and what turns that into console lines,
//!   progress bars, TensorBoard scalars, profiles and checkpoints. The loop prints nothing.
//!
//! Resuming is exact: everything random in an epoch (order, augmentation, dropout) is a
//! function of (seed, epoch, step), and a checkpoint holds the whole model and optimizer state.
pub mod checkpointing;
pub mod events;
pub mod faults;
pub mod graph;
mod owned_state;
pub mod preemption;
pub mod schedule;
pub mod sinks;
pub mod state;
pub mod step;

pub use checkpointing::CheckpointStats;
pub use events::{Control, Event, EventLog, Observer, Observers, Record, StepEvent};
pub use faults::{Faults, TEST_EXIT_AFTER_STEP, TEST_SIGNAL_AFTER_STEP, TEST_SLOW_RANK};
pub use schedule::{LrSchedule, ScheduleKind, Warmup};
pub use sinks::TENSORBOARD_EVERY;
pub use step::{
    counted_parameters, finish_gradients, loss_and_hits, DeviceTrace, EvalSums, GradientCollective, ParameterBlock, Phase, StepContext, StepOutput, StepSync,
    TensorCut, TracedPass, TrainStep,
};

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use serde::Serialize;
use tch::{Kind, Tensor};

use crate::checkpoint::{self, CheckpointMeta};
use crate::comm::ProcessGroup;
use crate::device::synchronize;
use crate::optim::Optimizer;
use crate::precision::{GradScaler, Precision};
use crate::seed_keys::mix_key;
pub use checkpointing::CheckpointFormat;
use checkpointing::Checkpointer;

/// One batch on the training device: model inputs and integer class (or next-token) targets.
#[derive(Debug)]
pub struct Batch {
    pub inputs: Tensor,
    pub targets: Tensor,
}

impl Batch {
    /// Examples (images, or tokens for a language model) in the batch.
    pub fn len(&self) -> usize {
        self.targets.numel()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One epoch's batches, each of which may fail to be made (an image file that does not decode,
/// a shard cut short): the run then stops with that error, naming the file.
pub type Batches<'a> = Box<dyn Iterator<Item = Result<Batch>> + 'a>;

/// Anything that yields an epoch of batches.
pub trait BatchSource {
    fn batches_per_epoch(&self) -> usize;
    /// The batches of epoch `epoch` (0-based), in a deterministic order.
    fn epoch(&self, epoch: usize) -> Batches<'_>;

    /// The batches of epoch `epoch` after its first `first` ones (a run resumed in the middle of
    /// the epoch): exactly what [`BatchSource::epoch`] yields from there. A source that can
    /// start there without preparing the skipped batches says so by overriding this.
    fn epoch_from(&self, epoch: usize, first: usize) -> Batches<'_> {
        Box::new(self.epoch(epoch).skip(first))
    }
}

/// Where and whether a run checkpoints.
#[derive(Debug, Clone)]
pub struct CheckpointConfig {
    pub dir: PathBuf,
    /// Continue from the run's checkpoint in `dir` when there is one.
    pub resume: bool,
    /// Identity of the model (a resume must build the same one).
    pub model: serde_json::Value,
    /// What the data mean to the model (a resume must read the same; [`CheckpointMeta::data`]).
    pub data: serde_json::Value,
    /// The run's configuration, stored for the record.
    pub config: serde_json::Value,
    /// A checkpoint file to start from (`--checkpoint`) instead of the run's own in `dir`; it
    /// must exist.
    pub from: Option<PathBuf>,
    /// Per-epoch copies `<run>-epoch<E>.safetensors` kept besides the latest, the oldest
    /// removed (`--keep-checkpoints`, Lightning's `save_top_k` by age); 0: the latest only.
    pub keep: usize,
    /// Also checkpoint every this many optimizer steps (`--checkpoint-every`).
    pub every_steps: Option<usize>,
    /// Also checkpoint when this many minutes have passed since the last (`--checkpoint-minutes`).
    pub every_minutes: Option<f64>,
    /// One file, or every rank writing its part (`--checkpoint-format`).
    pub format: CheckpointFormat,
    /// Examples in one optimizer step of the whole job (batch × replicas × `--accumulate`): a
    /// resume with another takes other samples from the epoch's order from there on.
    pub examples_per_step: usize,
}

/// How to train.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Name of the run, e.g. `exercise1-cnn-cpu` (checkpoint file name).
    pub run: String,
    pub epochs: usize,
    /// Stop after this many optimizer steps in total (smoke runs, benchmarks).
    pub max_steps: Option<usize>,
    pub seed: u64,
    /// The learning rate of every step, relative to the optimizer's initial one.
    pub lr_schedule: LrSchedule,
    /// Batches whose gradients are accumulated into one optimizer step (`--accumulate`).
    pub accumulate: usize,
    pub clip_grad_norm: Option<f64>,
    pub checkpoint: Option<CheckpointConfig>,
    /// What the epoch figures report besides the loss.
    pub metric: Metric,
    /// float32, or mixed precision (autocast, and a gradient scaler for float16).
    pub precision: Precision,
    /// `--profile`: wait for the device at every phase boundary (the sink records them).
    pub profile: bool,
    /// Steps of the run left out of the steady-state speed ([`FitReport::steady`]): warm-up.
    pub steady_after: usize,
    /// `--cuda-graph`: record the training step once in a CUDA graph and replay it ([`graph`]).
    pub cuda_graph: bool,
    /// `--eval-only`: restore the checkpoint and evaluate, training nothing.
    pub eval_only: bool,
    /// Whether the replicas take their optimizer steps together (every strategy but
    /// asynchronous parameter servers), so that a stop or a checkpoint can be agreed at any
    /// step; otherwise a signal stops the run at the end of the epoch it arrives in.
    pub lockstep: bool,
    /// What a test planted ([`Faults::from_env`]); [`Faults::NONE`] in a user's run.
    pub faults: Faults,
}

impl TrainConfig {
    fn out_of_steps(&self, step: usize) -> bool {
        self.max_steps.is_some_and(|max| step >= max)
    }
}

/// The figure of merit printed beside the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Metric {
    /// Share of arg-max hits (image classification).
    Accuracy,
    /// exp(loss) (language modelling).
    Perplexity,
}

impl Metric {
    pub fn describe(self, loss: f64, acc: f64) -> String {
        match self {
            Metric::Accuracy => format!("loss {loss:.4} acc {acc:.4}"),
            Metric::Perplexity => format!("loss {loss:.4} ppl {:.2}", loss.exp()),
        }
    }
}

/// Wall-clock time split of the training steps, and evaluation.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Timings {
    /// Waiting for the loader's next batch.
    pub data_wait_s: f64,
    pub forward_backward_s: f64,
    /// Finishing the gradients: averaging them over data-parallel replicas, unscaling and
    /// clipping them ([`GRADIENT_PHASES`]).
    pub allreduce_s: f64,
    /// The optimizer step.
    pub optimizer_s: f64,
    pub eval_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochStats {
    /// 1-based, as printed.
    pub epoch: usize,
    /// The learning rate of the epoch's first step.
    pub lr: f64,
    pub steps: usize,
    pub train_loss: f64,
    pub train_acc: f64,
    pub eval_loss: f64,
    pub eval_acc: f64,
    pub train_time_s: f64,
    /// Examples trained on, by all replicas.
    pub examples: usize,
    /// Optimizer steps done in the run at the epoch's end.
    pub end_step: usize,
    /// Steps of the epoch taken before this process resumed it in the middle: `train_loss` and
    /// `train_acc` are then the means of the `steps` after them only (0, absent: all of them).
    #[serde(skip_serializing_if = "is_zero_usize")]
    pub resumed_after_steps: usize,
    #[serde(skip)]
    pub eval_interval: Option<(Instant, Instant)>,
}

impl EpochStats {
    /// Seconds the epoch's evaluation took (0 where there was none).
    pub fn eval_seconds(&self) -> f64 {
        self.eval_interval.map_or(0.0, |(start, end)| (end - start).as_secs_f64())
    }
}

fn is_zero_usize(n: &usize) -> bool {
    *n == 0
}

/// What a call of [`fit`] did.
#[derive(Debug, Clone, Serialize)]
pub struct FitReport {
    pub history: Vec<EpochStats>,
    /// Epochs completed before this process started (resumed runs).
    pub resumed_epochs: usize,
    /// Optimizer steps taken in this process.
    pub steps: usize,
    /// Examples trained on in this process, by all replicas together.
    pub examples: usize,
    /// Time in training steps (loader wait, forward, backward, optimizer), evaluation excluded.
    pub train_time_s: f64,
    pub timings: Timings,
    pub eval_loss: f64,
    pub eval_acc: f64,
    /// A pipeline's measured idle share, its first (warm-up) step left out when there are others.
    pub bubble_fraction: Option<f64>,
    /// What checkpointing cost (rank 0's view).
    pub checkpoints: CheckpointStats,
    /// The speed of the steps after the warm-up ([`TrainConfig::steady_after`]), epoch ends and
    /// evaluation left out; none when fewer than two steps followed the warm-up in an epoch.
    pub steady: Option<Steady>,
}

/// A window of steady-state training: consecutive steps' ends within an epoch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Steady {
    /// Steps timed (each from the previous step's end to its own).
    pub steps: usize,
    pub seconds: f64,
    /// Examples trained on in those steps, by all replicas together.
    pub examples: usize,
}

impl Steady {
    pub fn throughput(&self) -> f64 {
        self.examples as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }
}

impl FitReport {
    /// Nothing trained yet, `resumed_epochs` done before this process started.
    pub fn new(resumed_epochs: usize) -> FitReport {
        FitReport {
            history: Vec::new(),
            resumed_epochs,
            steps: 0,
            examples: 0,
            train_time_s: 0.0,
            timings: Timings::default(),
            eval_loss: f64::NAN,
            eval_acc: f64::NAN,
            bubble_fraction: None,
            checkpoints: CheckpointStats::default(),
            steady: None,
        }
    }

    /// Examples per second of training.
    pub fn throughput(&self) -> f64 {
        if self.train_time_s > 0.0 {
            self.examples as f64 / self.train_time_s
        } else {
            0.0
        }
    }
}

/// The sums of an epoch so far, kept on the device (no host synchronisation per step).
struct EpochSums {
    loss: Tensor,
    hits: Tensor,
    examples: usize,
    steps: usize,
    data_wait_s: f64,
    start: Instant,
    /// Data-parallel replicas (each trains as many examples as this one).
    replicas: usize,
}

impl EpochSums {
    fn new(device: tch::Device, replicas: usize) -> EpochSums {
        EpochSums {
            loss: Tensor::zeros([], (Kind::Double, device)),
            hits: Tensor::zeros([], (Kind::Int64, device)),
            examples: 0,
            steps: 0,
            data_wait_s: 0.0,
            start: Instant::now(),
            replicas,
        }
    }

    /// Adds one step to the epoch's sums and the report's times.
    fn add(&mut self, report: &mut FitReport, out: &StepOutput, phases: &[Phase]) {
        let seconds = |name: &str| events::phase_seconds(phases, name);
        report.timings.data_wait_s += seconds("data wait");
        report.timings.forward_backward_s += seconds("forward") + seconds("backward") + seconds("forward+backward");
        report.timings.allreduce_s += GRADIENT_PHASES.iter().map(|name| seconds(name)).sum::<f64>();
        report.timings.optimizer_s += seconds("optimizer");
        report.steps += 1;
        self.data_wait_s += seconds("data wait");
        if let Some(loss) = &out.loss_sum {
            self.loss += loss;
        }
        if let Some(hits) = &out.hits {
            self.hits += hits;
        }
        self.examples += out.examples;
        self.steps += 1;
    }

    /// The event of the step just added.
    fn event<'a>(&self, epoch: usize, step: usize, lr: f64, out: &'a StepOutput, phases: &'a [Phase]) -> StepEvent<'a> {
        StepEvent {
            epoch,
            step,
            epoch_step: self.steps,
            loss: out.mean_loss(),
            lr,
            epoch_examples: self.examples * self.replicas,
            epoch_start: self.start,
            phases,
            stage_traces: &out.stage_traces,
            bubble: out.bubble(),
        }
    }
}

/// A pipeline's busy and elapsed stage-seconds, the first step apart (its warm-up).
#[derive(Default)]
struct BubbleMeter {
    first: Option<(f64, f64)>,
    warm: (f64, f64),
}

impl BubbleMeter {
    fn add(&mut self, sample: Option<(f64, f64)>) {
        let Some(sample) = sample else { return };
        match self.first {
            None => self.first = Some(sample),
            Some(_) => self.warm = (self.warm.0 + sample.0, self.warm.1 + sample.1),
        }
    }

    fn fraction(&self) -> Option<f64> {
        let (busy, elapsed) = if self.warm.1 > 0.0 { self.warm } else { self.first? };
        Some(if elapsed > 0.0 { (1.0 - busy / elapsed).max(0.0) } else { 0.0 })
    }
}

/// Measures [`Steady`]: the time from one step's end to the next one's, within an epoch, after
/// the run's first `skip` steps. Every step's end has waited for the device (see
/// [`optimizer_step`]), so the interval is the device's time too, loader and observers included,
/// as a user's epoch sees them; kernel selection, caches and evaluation are left out.
struct SteadyMeter {
    skip: usize,
    seen: usize,
    last: Option<Instant>,
    window: Steady,
}

impl SteadyMeter {
    fn new(skip: usize) -> Self {
        SteadyMeter { skip, seen: 0, last: None, window: Steady::default() }
    }

    /// A step of `examples` (all replicas) ended now.
    fn step_ended(&mut self, examples: usize) {
        let now = Instant::now();
        self.seen += 1;
        if let (true, Some(last)) = (self.seen > self.skip, self.last) {
            self.window.steps += 1;
            self.window.seconds += events::seconds(last, now);
            self.window.examples += examples;
        }
        self.last = Some(now);
    }

    /// An epoch ends: its evaluation and the next epoch's start do not count.
    fn pause(&mut self) {
        self.last = None;
    }

    fn steady(&self) -> Option<Steady> {
        (self.window.steps > 0).then_some(self.window)
    }
}

/// Trains `step` with `optimizer` on `train`, evaluating on `eval` after every epoch (the test
/// set in the image exercises, the validation split for the language models), from a
/// checkpoint when asked to resume and one exists; tells `observers` everything that happens.
/// Every rank of the job runs it with the same configuration.
pub fn fit(
    step: &mut dyn TrainStep<'_>,
    optimizer: &mut dyn Optimizer,
    train: &dyn BatchSource,
    eval: &dyn BatchSource,
    config: &TrainConfig,
    observers: &mut Observers,
) -> Result<FitReport> {
    let mut run = Run::start(step, optimizer, train, config, observers)?;
    let last_epoch = if config.eval_only { run.start.epoch } else { config.epochs };
    for epoch in run.start.epoch..last_epoch {
        if config.out_of_steps(run.global_step) || run.stopped_by.is_some() {
            break;
        }
        let lr = config.lr_schedule.lr(run.base_lr, run.global_step, epoch);
        observers.emit(&Event::EpochStarted { epoch, lr })?;
        let (sums, completed) = run.train_epoch(step, optimizer, train, epoch, observers)?;
        // Checkpointed in the epoch, its evaluation waits for the resumed run; or the launcher
        // is gone, and with it whoever would read the evaluation.
        if (run.stopped_by.is_some() && !completed) || run.stopped_by == Some(Stop::Orphaned) {
            break;
        }
        run.end_epoch(step, optimizer, eval, (epoch, lr), sums, completed, observers)?;
    }
    run.finish(step, eval, observers)
}

/// One [`fit`] under way: what the loop carries from step to step and from epoch to epoch.
struct Run<'c, 'g> {
    config: &'c TrainConfig,
    /// Where it started (a checkpoint's progress, or nothing).
    start: state::Progress,
    scaler: Option<GradScaler>,
    /// The optimizer's own rate, which the schedule scales.
    base_lr: f64,
    steps_per_epoch: usize,
    global_step: usize,
    report: FitReport,
    bubble: BubbleMeter,
    steady: SteadyMeter,
    graphed: Option<graph::GraphedStep>,
    checkpoints: Option<Checkpointer<'c, 'g>>,
    control: StepControl<'g>,
    /// Why the run stops before its steps run out, agreed by the ranks.
    stopped_by: Option<Stop>,
    /// The run's checkpoints are this job's alone while it writes them.
    _lock: Option<checkpoint::RunLock>,
}

impl<'c, 'g> Run<'c, 'g> {
    /// Checks what can be checked before the first step, takes the run's lock, resumes from
    /// its checkpoint where asked, and tells `observers` the run started.
    fn start(
        step: &mut dyn TrainStep<'g>,
        optimizer: &mut dyn Optimizer,
        train: &dyn BatchSource,
        config: &'c TrainConfig,
        observers: &mut Observers,
    ) -> Result<Self> {
        let device = step.input_device();
        config.precision.check(device)?;
        let mut scaler = config.precision.needs_scaler().then(|| GradScaler::new(device));
        let resume =
            config.checkpoint.as_ref().filter(|ck| ck.resume).map(|ck| (ck.from.clone().unwrap_or_else(|| checkpoint::path_for(&ck.dir, &config.run)), ck));
        if let (Some((path, _)), true) = (&resume, config.eval_only) {
            // Evaluating a freshly initialised model and calling it the checkpoint's is the one
            // thing --eval-only must not do: a path with no complete checkpoint at it (a missing
            // file, an empty folder, a folder of something else) is refused here.
            let exists = path.exists() || checkpoint::sharded::run_folder_of(path).is_dir();
            if !exists || checkpoint::find_newest(path).is_ok_and(|found| found.is_none()) {
                return crate::error::usage(format!("--eval-only: no checkpoint at {} to evaluate", path.display()));
            }
        }
        // Taken before the checkpoint to resume from is read (rank 0 holds it for the job).
        let writes_checkpoints = !config.eval_only && step.sync().is_root();
        let lock = config.checkpoint.as_ref().filter(|_| writes_checkpoints).map(|ck| checkpoint::RunLock::acquire(&ck.dir, &config.run)).transpose()?;
        let expected = resume.as_ref().map(|(path, ck)| state::Expected {
            path,
            model: &ck.model,
            data: &ck.data,
            seed: config.seed,
            examples_per_step: ck.examples_per_step,
            eval_only: config.eval_only,
        });
        let start = state::start(step, optimizer, scaler.as_mut(), expected, observers)?;
        let world = step.sync().world();
        let mut checkpoints = config.checkpoint.as_ref().map(|ck| Checkpointer::new(ck, &config.run, Checkpointer::shards(ck.format, step, optimizer), world));
        if let Some(checkpoints) = checkpoints.as_mut() {
            checkpoints.stats.resumed_bytes = start.read_bytes;
        }
        let control = StepControl::new(step.sync(), config)?;
        let steps_per_epoch = train.batches_per_epoch().div_ceil(config.accumulate);
        let (run, epochs, start_epoch, start_step) = (config.run.as_str(), config.epochs, start.epoch, start.step);
        observers.emit(&Event::Started { run, epochs, steps_per_epoch, start_epoch, start_step })?;
        Ok(Run {
            config,
            start,
            scaler,
            base_lr: optimizer.lr(),
            steps_per_epoch,
            global_step: start.step,
            report: FitReport::new(start.epoch),
            bubble: BubbleMeter::default(),
            steady: SteadyMeter::new(config.steady_after),
            graphed: config.cuda_graph.then(graph::GraphedStep::default),
            checkpoints,
            control,
            stopped_by: None,
            _lock: lock,
        })
    }

    /// Trains the steps of `epoch` (from where a checkpoint taken in it left off) until its
    /// batches or the run's steps run out or a stop signal is agreed; checkpoints where the
    /// ranks decide to. Returns the epoch's sums and whether it completed.
    fn train_epoch(
        &mut self,
        step: &mut dyn TrainStep<'g>,
        optimizer: &mut dyn Optimizer,
        train: &dyn BatchSource,
        epoch: usize,
        observers: &mut Observers,
    ) -> Result<(EpochSums, bool)> {
        let config = self.config;
        let mut sums = EpochSums::new(step.input_device(), step.sync().replica_count());
        // A checkpoint taken in the middle of this epoch: its steps' batches are skipped.
        let mut epoch_step = if epoch == self.start.epoch { self.start.epoch_step } else { 0 };
        let mut batches = train.epoch_from(epoch, epoch_step * config.accumulate);
        let completed = loop {
            if epoch_step >= self.steps_per_epoch {
                break true;
            }
            if config.out_of_steps(self.global_step) {
                break false;
            }
            let waiting = Instant::now();
            let micro: Vec<Batch> = batches.by_ref().take(config.accumulate).collect::<Result<_>>()?;
            if micro.is_empty() {
                break true;
            }
            let fetched = Instant::now();
            observers.emit(&Event::StepStarting { step: self.global_step + 1 })?;
            let (out, mut phases, lr) = self.one_step(step, optimizer, &micro, epoch)?;
            phases.insert(0, ("data wait", waiting, fetched));
            epoch_step += 1;
            // On the CPU the loss is at hand: a diverged run stops at its first bad step.
            if let Some(loss) = out.loss_sum.as_ref().filter(|l| l.device() == tch::Device::Cpu && !config.precision.needs_scaler()) {
                finite_or_stop("training loss", loss.double_value(&[]), self.global_step, epoch)?;
            }
            self.bubble.add(out.stage_busy);
            sums.add(&mut self.report, &out, &phases);
            observers.emit(&Event::Step(&sums.event(epoch, self.global_step, lr, &out, &phases)))?;
            self.steady.step_ended(out.examples * sums.replicas);
            // The epoch's end checkpoints anyway: a step checkpoint is for the steps before it.
            let ends_epoch = epoch_step >= self.steps_per_epoch;
            let decision = self.control.after_step(self.checkpoints.as_mut(), self.global_step)?;
            if decision.checkpoint && !ends_epoch {
                self.checkpoint(step, optimizer, (epoch, epoch_step), observers)?;
            }
            self.control.test_exit_after(self.global_step, self.checkpoints.as_mut());
            if let Some(stop) = decision.stop {
                self.stopped_by = Some(stop);
                break ends_epoch;
            }
        };
        self.steady.pause();
        Ok((sums, completed))
    }

    /// One optimizer step over the micro-batches `micro` at the schedule's rate: its output,
    /// its phases and the rate.
    fn one_step(
        &mut self,
        step: &mut dyn TrainStep<'g>,
        optimizer: &mut dyn Optimizer,
        micro: &[Batch],
        epoch: usize,
    ) -> Result<(StepOutput, Vec<Phase>, f64)> {
        let (config, global_step) = (self.config, self.global_step);
        // Dropout and any other LibTorch randomness: a function of (seed, step), so that a
        // run resumed at any step draws what the uninterrupted run drew.
        tch::manual_seed(mix_key(&[config.seed, global_step as u64]) as i64);
        let lr = config.lr_schedule.lr(self.base_lr, global_step, epoch);
        optimizer.set_lr(lr);
        if let Some(slow_by) = self.control.slow_by {
            std::thread::sleep(slow_by);
        }
        let (out, phases) = match self.graphed.as_mut() {
            Some(graphed) if graphed.takes(micro) => graphed.step(step, optimizer, &micro[0], config, global_step)?,
            _ => optimizer_step(step, optimizer, self.scaler.as_mut(), micro, config, global_step)?,
        };
        self.global_step += 1;
        crate::comm::watchdog::note_step(self.global_step);
        Ok((out, phases, lr))
    }

    /// Writes a checkpoint at `(epoch, epoch_step)` where the run keeps them.
    fn checkpoint(&mut self, step: &dyn TrainStep<'g>, optimizer: &dyn Optimizer, at: (usize, usize), observers: &mut Observers) -> Result<()> {
        let Some(checkpoints) = self.checkpoints.as_mut() else { return Ok(()) };
        let meta = checkpoint_meta(self.config, checkpoints.config(), optimizer.name(), at, self.global_step, self.scaler.as_ref());
        checkpoints.save(step, optimizer, meta)?;
        observers.emit(&Event::Checkpointed { path: checkpoints.path(), epoch: at.0, step: self.global_step })?;
        self.steady.pause();
        Ok(())
    }

    /// The end of `epoch` (trained at `lr`): its evaluation and figures, its checkpoint where
    /// it `completed` and the observers ask for one, and the stop signals agreed at epochs' ends.
    #[allow(clippy::too_many_arguments)]
    fn end_epoch(
        &mut self,
        step: &mut dyn TrainStep<'g>,
        optimizer: &dyn Optimizer,
        eval: &dyn BatchSource,
        (epoch, lr): (usize, f64),
        sums: EpochSums,
        completed: bool,
        observers: &mut Observers,
    ) -> Result<()> {
        let config = self.config;
        let data_wait_s = sums.data_wait_s;
        let mut stats = end_epoch(step, eval, config, &mut self.report, sums, epoch, lr, self.global_step)?;
        if epoch == self.start.epoch {
            stats.resumed_after_steps = self.start.epoch_step;
        }
        // float16's scaler skips the steps whose loss overflowed: its epoch mean may be inf
        // while the model is fine; the evaluation says whether it is.
        if !config.precision.needs_scaler() {
            finite_or_stop("mean training loss", stats.train_loss, self.global_step, epoch)?;
        }
        finite_or_stop("evaluation loss", stats.eval_loss, self.global_step, epoch)?;
        let control = observers.emit(&Event::EpochEnded { stats: &stats, completed, data_wait_s })?;
        self.report.history.push(stats);
        // Agreed before the epoch's checkpoint: a signal's stop takes one here, as after a step;
        // a launcher gone during the evaluation, none.
        let stop = self.control.stop_at_epoch_end()?;
        let wanted = control == Control::Checkpoint || matches!(stop, Some(Stop::Signal(_)));
        if wanted && completed && stop != Some(Stop::Orphaned) {
            self.checkpoint(step, optimizer, (epoch + 1, 0), observers)?;
        }
        if let (None, Some(stop)) = (self.stopped_by, stop) {
            self.stopped_by = Some(stop);
        }
        Ok(())
    }

    /// Waits for the checkpoints in flight and reports the run, or the signal that stopped it.
    fn finish(mut self, step: &mut dyn TrainStep<'g>, eval: &dyn BatchSource, observers: &mut Observers) -> Result<FitReport> {
        if self.stopped_by == Some(Stop::Orphaned) {
            // No commit of a sharded checkpoint in flight either: the launcher is gone. (A
            // single file being written completes as it would have; the writer renames it.)
            let gone = crate::comm::orphan::gone().unwrap_or("the launcher").to_string();
            return Err(crate::error::Orphaned { gone, at: format!("after step {}", self.global_step) }.into());
        }
        if let Some(checkpoints) = self.checkpoints.as_mut() {
            checkpoints.finish()?;
            self.report.checkpoints = checkpoints.stats;
        }
        if let Some(Stop::Signal(signal)) = self.stopped_by {
            let checkpoint = self.checkpoints.as_ref().map(|c| c.path().to_path_buf());
            let says = step.sync().is_root();
            return Err(crate::error::Stopped { signal, step: self.global_step, checkpoint, says }.into());
        }
        if self.report.history.is_empty() {
            // Nothing left to train (a finished run resumed): still report where the model stands.
            evaluate_into(step, eval, self.config, &mut self.report)?;
        }
        self.report.bubble_fraction = self.bubble.fraction();
        self.report.steady = self.steady.steady();
        observers.emit(&Event::Finished(&self.report))?;
        Ok(self.report)
    }
}

/// What the loop does after a step besides training: checkpoint (every N steps, every M minutes,
/// the last step of a `--max-steps` run) and stop (a signal), decided alike on every rank.
struct StepControl<'g> {
    /// The ranks that must decide alike (none: this process alone).
    ranks: Option<&'g ProcessGroup>,
    max_steps: Option<usize>,
    /// Planted ([`Faults`]): end the process abruptly after this step, as a kill would.
    exit_after: Option<usize>,
    /// Planted: the root rank sends itself this signal after this step.
    signal_after: Option<(usize, i32)>,
    /// Planted: this rank's every step takes this much longer.
    slow_by: Option<std::time::Duration>,
    /// [`TrainConfig::lockstep`]: a signal stops the run at a step the ranks agree on;
    /// otherwise at the end of the epoch, agreed among `at_epoch_ends`.
    lockstep: bool,
    /// The ranks that agree at every epoch's end, before its checkpoint, whether to stop.
    at_epoch_ends: Option<&'g ProcessGroup>,
}

/// What [`StepControl::after_step`] decided.
struct Decision {
    checkpoint: bool,
    /// The run stops here, and why.
    stop: Option<Stop>,
}

/// Why a run stops before its steps run out: what its ranks agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// A stop signal (its name) caught by any process of the job: the same on every rank, and
    /// checkpointed.
    Signal(&'static str),
    /// A process a rank depended on has ended ([`crate::comm::orphan`]): no further checkpoint.
    Orphaned,
}

/// This process's part of the ranks' agreement on stopping: the stop signal it caught or was
/// told of (its number, 0 for none; the ranks take the largest), and whether what it depends
/// on has ended.
fn stop_votes() -> [f64; 2] {
    [preemption::requested_signal() as f64, crate::comm::orphan::gone().is_some() as u8 as f64]
}

/// What the ranks agreed from their [`stop_votes`].
fn agreed_stop(votes: &[f64]) -> Option<Stop> {
    if votes[1] > 0.0 {
        return Some(Stop::Orphaned);
    }
    preemption::name(votes[0] as i32).map(Stop::Signal)
}

impl<'g> StepControl<'g> {
    fn new(sync: &dyn StepSync<'g>, config: &TrainConfig) -> Result<StepControl<'g>> {
        let faults = config.faults;
        let (exit_after, signal_after) = (faults.exit_after, faults.signal_after.filter(|_| sync.is_root()));
        let slow_by = faults.slow_by(sync.world().map_or(0, |w| w.env().rank));
        let max_steps = config.max_steps;
        let ranks = sync.world().filter(|w| w.world_size() > 1);
        if let Some(flag) = sync.steps_apart() {
            if config.checkpoint.as_ref().is_some_and(|ck| ck.every_steps.is_some() || ck.every_minutes.is_some()) {
                return crate::error::usage(format!("--checkpoint-every and --checkpoint-minutes need workers that step together: not with {flag}"));
            }
        }
        // Every run catches the stop signals (Slurm's warning, SIGTERM, the launcher's
        // forwarded Ctrl-C): their default action would end the ranks with nothing saved.
        preemption::install()?;
        if !config.lockstep {
            // Asynchronous parameter-server workers never wait for each other: a per-step decision
            // among them would make them. Such a run checkpoints at epochs' ends only (not at a
            // --max-steps end, which each worker reaches at its own time), and stops there.
            return Ok(StepControl { ranks: None, max_steps: None, exit_after, signal_after, slow_by, at_epoch_ends: ranks, lockstep: false });
        }
        Ok(StepControl { ranks, max_steps, exit_after, signal_after, slow_by, at_epoch_ends: ranks, lockstep: true })
    }

    /// What the ranks agree at an epoch's end, before its checkpoint: a stop signal caught since
    /// the last step (replicas that do not step together, [`TrainConfig::lockstep`], stop only
    /// here: they meet here, in the evaluation), or a launcher gone.
    fn stop_at_epoch_end(&self) -> Result<Option<Stop>> {
        let local = stop_votes();
        let agreed = match self.at_epoch_ends {
            Some(ranks) => ranks.max_of(&local)?,
            None => local.to_vec(),
        };
        Ok(agreed_stop(&agreed))
    }

    fn after_step(&self, mut checkpoints: Option<&mut Checkpointer>, step: usize) -> Result<Decision> {
        if let Some((_, signal)) = self.signal_after.filter(|(at, _)| *at == step) {
            // SAFETY: raise only delivers a signal to this thread; the handler sets flags.
            unsafe { libc::raise(signal) };
        }
        let by_rule = checkpoints.as_ref().is_some_and(|c| c.due_by_steps(step)) || self.max_steps == Some(step);
        // The clock, the signals and the background writes differ between ranks: any rank's
        // counts for all.
        let (writing, failed) = checkpoints.as_mut().map_or((false, false), |c| c.poll());
        let flag = |b: bool| b as u8 as f64;
        let [signal, orphaned] = stop_votes();
        let local = [flag(checkpoints.as_ref().is_some_and(|c| c.due_by_time())), flag(writing), flag(failed), signal, orphaned];
        let agreed = match self.ranks {
            Some(ranks) => ranks.max_of(&local)?,
            None => local.to_vec(),
        };
        let stop = agreed_stop(&agreed[3..]);
        if stop == Some(Stop::Orphaned) {
            // Nothing more is committed, not even a sharded checkpoint whose parts are written.
            return Ok(Decision { checkpoint: false, stop });
        }
        if let Some(checkpoints) = checkpoints {
            checkpoints.settle(agreed[1] > 0.0, agreed[2] > 0.0)?;
        }
        // The signal every rank stops for, whichever caught it. (Replicas not in lockstep stop
        // at the epoch's end instead: stop_at_epoch_end.)
        let stop = stop.filter(|_| self.lockstep);
        Ok(Decision { checkpoint: by_rule || agreed[0] > 0.0 || stop.is_some(), stop })
    }

    /// The planted exit ([`faults::TEST_EXIT_AFTER_STEP`]).
    fn test_exit_after(&self, step: usize, checkpoints: Option<&mut Checkpointer>) {
        if self.exit_after == Some(step) {
            if let Some(checkpoints) = checkpoints {
                let _ = checkpoints.finish();
            }
            // SAFETY: _exit ends the process at once, which is the point (no unwinding, no
            // destructors: as a kill would).
            unsafe { libc::_exit(137) };
        }
    }
}

/// A loss that is no longer a number ends the run (exit 1) before its checkpoint is
/// overwritten: the model has diverged, and every further step would be wasted.
fn finite_or_stop(what: &str, value: f64, step: usize, epoch: usize) -> Result<()> {
    if value.is_finite() {
        return Ok(());
    }
    anyhow::bail!(
        "the {what} is {value} at step {step} (epoch {}): the model diverged, and the run stops here; lower --lr or clip the gradients (--clip)",
        epoch + 1
    )
}

/// Evaluates on `eval` (over all replicas) into the report's figures and times.
fn evaluate_into(step: &mut dyn TrainStep<'_>, eval: &dyn BatchSource, config: &TrainConfig, report: &mut FitReport) -> Result<(Instant, Instant)> {
    let started = Instant::now();
    let sums = step.evaluate(eval, config.precision)?.over(step.sync().replicas())?;
    synchronize(step.input_device());
    let ended = Instant::now();
    (report.eval_loss, report.eval_acc) = (sums.mean_loss(), sums.accuracy());
    report.timings.eval_s += (ended - started).as_secs_f64();
    Ok((started, ended))
}

/// One optimizer step: forward and backward passes of `micro` (one batch, or `--accumulate`
/// of them, each weighted by its share of the examples), the gradients finished, the update
/// (skipped by the float16 scaler on inf/NaN). Returns what the passes measured and the phases.
fn optimizer_step(
    step: &mut dyn TrainStep<'_>,
    optimizer: &mut dyn Optimizer,
    mut scaler: Option<&mut GradScaler>,
    micro: &[Batch],
    config: &TrainConfig,
    global_step: usize,
) -> Result<(StepOutput, Vec<Phase>)> {
    let device = step.input_device();
    let examples: usize = micro.iter().map(Batch::len).sum();
    optimizer.zero_grad();
    let mut out = StepOutput::default();
    crate::torch_ext::trace_cpu_memory_phase(1);
    for (i, batch) in micro.iter().enumerate() {
        let ctx = StepContext {
            precision: config.precision,
            scaler: scaler.as_deref(),
            dropout_key: mix_key(&[config.seed, global_step as u64, i as u64]),
            sync_phases: config.profile,
            count_hits: config.metric == Metric::Accuracy,
        };
        let weight = if micro.len() == 1 { 1.0 } else { batch.len() as f64 / examples as f64 };
        out.absorb(step.forward_backward(batch, weight, &ctx)?);
    }
    let finishing = Instant::now();
    let finish_name = gradient_phase(step.sync().gradient_collective(config.clip_grad_norm.is_some()), scaler.is_some(), config.clip_grad_norm.is_some());
    crate::torch_ext::trace_cpu_memory_phase(2);
    finish_gradients(&*step, optimizer, scaler.as_deref(), config.clip_grad_norm)?;
    crate::torch_ext::trace_cpu_memory_phase(3);
    let stepping = Instant::now();
    match scaler.as_mut() {
        Some(scaler) => {
            let params: Vec<Tensor> = step.named_parameters().into_iter().map(|(_, t)| t).collect();
            scaler.step(&params, || optimizer.step())?;
            scaler.update();
        }
        None => optimizer.step()?,
    }
    synchronize(device);
    crate::torch_ext::trace_cpu_memory_phase(0);
    let mut phases = std::mem::take(&mut out.phases);
    phases.push((finish_name, finishing, stepping));
    phases.push(("optimizer", stepping, Instant::now()));
    Ok((out, phases))
}

/// The names of the phase between the backward pass and the optimizer's update, by what it does
/// ([`gradient_phase`]).
pub const GRADIENT_PHASES: [&str; 12] = [
    "gradients",
    "clip",
    "unscale",
    "unscale + clip",
    "all-reduce",
    "all-reduce + clip",
    "all-reduce + unscale",
    "all-reduce + unscale + clip",
    "reduce-scatter",
    "reduce-scatter + clip",
    "reduce-scatter + unscale",
    "reduce-scatter + unscale + clip",
];

/// What finishing the gradients does on this rank: average them over the replicas (an
/// all-reduce; a reduce-scatter under ZeRO; under Horovod inside the optimizer's step unless
/// clipping needs them first), unscale them (float16's scaler), clip their norm; "gradients"
/// when there is nothing to do.
fn gradient_phase(collective: GradientCollective, unscale: bool, clip: bool) -> &'static str {
    let collective = match collective {
        GradientCollective::None => 0,
        GradientCollective::AllReduce => 1,
        GradientCollective::ReduceScatter => 2,
    };
    GRADIENT_PHASES[4 * collective + 2 * unscale as usize + clip as usize]
}

/// What a checkpoint after `epoch` completed epochs and `epoch_step` steps of the next, `step`
/// steps in all, records besides its tensors.
fn checkpoint_meta(
    config: &TrainConfig,
    ck: &CheckpointConfig,
    optimizer: &str,
    (epoch, epoch_step): (usize, usize),
    step: usize,
    scaler: Option<&GradScaler>,
) -> CheckpointMeta {
    CheckpointMeta {
        format: checkpoint::FORMAT_VERSION,
        run: config.run.clone(),
        model: ck.model.clone(),
        optimizer: optimizer.to_string(),
        epoch,
        epoch_step,
        step,
        seed: config.seed,
        config: ck.config.clone(),
        torch_version: crate::torch_version().to_string(),
        grad_scaler: scaler.map(GradScaler::state),
        data: ck.data.clone(),
        examples_per_step: ck.examples_per_step,
    }
}

/// The epoch's figures: its training sums combined over the replicas, and an evaluation.
#[allow(clippy::too_many_arguments)]
fn end_epoch(
    step: &mut dyn TrainStep<'_>,
    eval: &dyn BatchSource,
    config: &TrainConfig,
    report: &mut FitReport,
    sums: EpochSums,
    epoch: usize,
    lr: f64,
    global_step: usize,
) -> Result<EpochStats> {
    let train_time_s = sums.start.elapsed().as_secs_f64();
    let replicas = step.sync().replicas();
    let local_hits = if config.metric == Metric::Accuracy { sums.hits.int64_value(&[]) as f64 } else { f64::NAN };
    let train = EvalSums { loss_sum: sums.loss.double_value(&[]), hits: local_hits, examples: sums.examples as f64 }.over(replicas)?;
    step.sync().sync_buffers(step.named_variables())?;
    let eval_interval = evaluate_into(step, eval, config, report)?;
    report.train_time_s += train_time_s;
    report.examples += train.examples as usize;
    Ok(EpochStats {
        epoch: epoch + 1,
        lr,
        steps: sums.steps,
        train_loss: train.mean_loss(),
        // Not counted in language-model training (NaN: null in the JSON).
        train_acc: train.hits / train.examples.max(1.0),
        eval_loss: report.eval_loss,
        eval_acc: report.eval_acc,
        train_time_s,
        examples: train.examples as usize,
        end_step: global_step,
        resumed_after_steps: 0,
        eval_interval: Some(eval_interval),
    })
}

/// A bitwise fingerprint of variables (FNV-1a over their bytes, in name order), as two exactly
/// representable halves so that it travels through f64 collectives unchanged.
pub fn fingerprint(variables: &[(String, Tensor)]) -> [f64; 2] {
    let mut vars: Vec<&(String, Tensor)> = variables.iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, var) in vars {
        let var = var.detach().to_device(tch::Device::Cpu).contiguous();
        let mut bytes = vec![0u8; var.numel() * var.kind().elt_size_in_bytes()];
        var.copy_data_u8(&mut bytes, var.numel());
        for byte in bytes {
            hash = (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    [(hash >> 32) as f64, (hash & 0xffff_ffff) as f64]
}

/// Checks that every replica in `group` holds bit-identical `variables` (data parallelism's
/// invariant); an error names the replicas that diverged from replica 0.
pub fn check_replicas_agree(variables: &[(String, Tensor)], group: &ProcessGroup) -> Result<()> {
    let mine = Tensor::from_slice(&fingerprint(variables));
    let all: Vec<Vec<f64>> = group.all_gather(&mine)?.iter().map(Vec::<f64>::try_from).collect::<Result<_, _>>()?;
    let diverged: Vec<usize> = (1..all.len()).filter(|&r| all[r] != all[0]).collect();
    anyhow::ensure!(diverged.is_empty(), "data-parallel replicas diverged: ranks {diverged:?} hold other parameters than rank 0");
    Ok(())
}
