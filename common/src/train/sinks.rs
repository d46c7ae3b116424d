//! The observers a run usually has: the console's lines ([`ConsoleLog`]), a progress bar per
//! epoch ([`ProgressBars`]), TensorBoard scalars ([`TensorBoardLog`]), `--profile`'s table and
//! Chrome trace ([`ProfileSink`]) and the checkpoint policy ([`CheckpointEveryEpoch`]).
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};

use super::events::{phase_seconds, Control, Event, Observer};
use super::Metric;
use crate::course_format::CourseScript;
use crate::profile::libtorch::{Recorded, TorchProfiler};
use crate::profile::Profiler;
use crate::tensorboard::SummaryWriter;

/// `--tensorboard` logs the training loss, learning rate and throughput every this many steps
/// (and every epoch's figures at its end).
pub const TENSORBOARD_EVERY: usize = 10;

/// What the sinks need to know about the run, from [`Event::Started`].
#[derive(Default, Clone)]
struct RunHeader {
    run: String,
    epochs: usize,
    steps_per_epoch: usize,
}

impl RunHeader {
    fn update(&mut self, event: &Event) {
        if let Event::Started { run, epochs, steps_per_epoch, .. } = event {
            *self = RunHeader { run: run.to_string(), epochs: *epochs, steps_per_epoch: *steps_per_epoch };
        }
    }
}

/// Prints the narrative (stdout), warnings (stderr) and one line per epoch (for a language
/// model also the course script's end-of-epoch line or block).
pub struct ConsoleLog {
    metric: Metric,
    script: CourseScript,
    header: RunHeader,
}

impl ConsoleLog {
    pub fn new(metric: Metric, script: CourseScript) -> ConsoleLog {
        ConsoleLog { metric, script, header: RunHeader::default() }
    }
}

impl Observer for ConsoleLog {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        self.header.update(event);
        match event {
            Event::Info(line) => println!("{line}"),
            Event::Warning(line) => eprintln!("{line}"),
            Event::EpochEnded { stats, completed, data_wait_s } => {
                let rate = stats.examples as f64 / stats.train_time_s.max(f64::EPSILON);
                println!(
                    "[{}] epoch {}/{}{}: {} steps in {:.1} s ({rate:.0}/s, data wait {:.1}%), lr {:.4}  train {}  eval {}",
                    self.header.run,
                    stats.epoch,
                    self.header.epochs,
                    match (*completed, stats.resumed_after_steps) {
                        (false, _) => String::from(" (stopped by --max-steps)"),
                        (true, 0) => String::new(),
                        (true, n) => format!(" (resumed after its step {n}: train figures over the steps since)"),
                    },
                    stats.steps,
                    stats.train_time_s,
                    100.0 * data_wait_s / stats.train_time_s.max(f64::EPSILON),
                    stats.lr,
                    self.metric.describe(stats.train_loss, stats.train_acc),
                    self.metric.describe(stats.eval_loss, stats.eval_acc),
                );
                // The course script's own line or block, to hold against its printout.
                if let Some(line) = self.script.epoch_end(stats.epoch, stats.train_time_s + stats.eval_seconds(), stats.eval_loss) {
                    println!("{line}");
                }
            }
            _ => {}
        }
        Ok(Control::Continue)
    }
}

/// `--course-log N`: this rank's loss every N steps in the shape of the course's Horovod or DDP
/// printout, and on rank 0 the test accuracy and the elapsed time at the end, as its script
/// prints them. Reading the loss waits for the device: every N steps only.
pub struct CourseLog {
    header: RunHeader,
    script: CourseScript,
    rank: usize,
    world: usize,
    every: usize,
    started: Instant,
    accuracy: bool,
}

impl CourseLog {
    pub fn new(rank: usize, world: usize, every: usize, metric: Metric, script: CourseScript) -> CourseLog {
        CourseLog {
            header: RunHeader::default(),
            script,
            rank,
            world: world.max(1),
            every: every.max(1),
            started: Instant::now(),
            accuracy: metric == Metric::Accuracy,
        }
    }
}

impl Observer for CourseLog {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        self.header.update(event);
        match event {
            Event::Started { .. } => self.started = Instant::now(),
            Event::Step(step) if step.epoch_step % self.every == 0 || step.epoch_step == self.header.steps_per_epoch => {
                // This rank's examples so far and its shard, from the replicas' batch.
                let per_step = step.epoch_examples / step.epoch_step.max(1) / self.world;
                let (seen, shard) = (step.epoch_step * per_step, self.header.steps_per_epoch * per_step);
                println!("{}", self.script.step_line(self.rank, step.epoch + 1, self.header.epochs, seen, shard, step.loss.double_value(&[])));
            }
            Event::Finished(report) if self.rank == 0 => {
                let accuracy = (self.accuracy && report.eval_acc.is_finite()).then_some(report.eval_acc);
                for line in self.script.final_lines(accuracy, self.started.elapsed().as_secs_f64()) {
                    println!("{line}");
                }
            }
            _ => {}
        }
        Ok(Control::Continue)
    }
}

/// A live progress bar per epoch on stderr (hidden where stderr is not a terminal).
#[derive(Default)]
pub struct ProgressBars {
    header: RunHeader,
    bar: Option<ProgressBar>,
}

impl ProgressBars {
    pub fn new() -> ProgressBars {
        ProgressBars::default()
    }
}

impl Observer for ProgressBars {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        self.header.update(event);
        match event {
            Event::EpochStarted { epoch, .. } => {
                let bar = ProgressBar::new(self.header.steps_per_epoch as u64);
                let style =
                    ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}").expect("valid template").progress_chars("=> ");
                bar.set_style(style);
                bar.set_prefix(format!("{} epoch {}/{}", self.header.run, epoch + 1, self.header.epochs));
                bar.enable_steady_tick(Duration::from_millis(500));
                self.bar = Some(bar);
            }
            Event::Step(step) => {
                if let Some(bar) = self.bar.as_ref().filter(|b| !b.is_hidden()) {
                    if step.epoch_step % 10 == 0 || step.epoch_step == 1 {
                        // Reading the loss waits for the device: every few steps only.
                        let rate = step.epoch_examples as f64 / step.epoch_start.elapsed().as_secs_f64();
                        bar.set_message(format!("loss {:.4}  {rate:.0}/s", step.loss.double_value(&[])));
                    }
                    bar.inc(1);
                }
            }
            Event::EpochEnded { .. } | Event::Finished(_) => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
            }
            _ => {}
        }
        Ok(Control::Continue)
    }
}

/// TensorBoard event files in one log directory: every [`TENSORBOARD_EVERY`] steps the loss,
/// learning rate, throughput (and a pipeline's bubble); every epoch's losses, accuracy or
/// perplexity, learning rate and throughput.
pub struct TensorBoardLog {
    writer: SummaryWriter,
    metric: Metric,
    /// When and at how many examples of the epoch the last step was logged.
    last: (Instant, usize),
}

impl TensorBoardLog {
    pub fn new(dir: &std::path::Path, metric: Metric) -> Result<TensorBoardLog> {
        Ok(TensorBoardLog { writer: SummaryWriter::new(dir)?, metric, last: (Instant::now(), 0) })
    }
}

impl Observer for TensorBoardLog {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        match event {
            Event::EpochStarted { .. } => self.last = (Instant::now(), 0),
            Event::Step(step) if step.step % TENSORBOARD_EVERY == 0 => {
                let rate = step.epoch_examples.saturating_sub(self.last.1) as f64 / self.last.0.elapsed().as_secs_f64();
                self.writer.add_scalar("train/loss", step.loss.double_value(&[]), step.step)?;
                self.writer.add_scalar("train/lr", step.lr, step.step)?;
                self.writer.add_scalar("train/throughput", rate, step.step)?;
                if let Some(bubble) = step.bubble {
                    self.writer.add_scalar("train/bubble_fraction", bubble, step.step)?;
                }
                self.last = (Instant::now(), step.epoch_examples);
            }
            Event::EpochEnded { stats, .. } => {
                let at = stats.end_step;
                self.writer.add_scalar("epoch/train_loss", stats.train_loss, at)?;
                self.writer.add_scalar("epoch/eval_loss", stats.eval_loss, at)?;
                match self.metric {
                    Metric::Accuracy => self.writer.add_scalar("epoch/eval_accuracy", stats.eval_acc, at)?,
                    Metric::Perplexity => self.writer.add_scalar("epoch/eval_perplexity", stats.eval_loss.exp(), at)?,
                }
                self.writer.add_scalar("epoch/lr", stats.lr, at)?;
                self.writer.add_scalar("epoch/throughput", stats.examples as f64 / stats.train_time_s.max(f64::EPSILON), at)?;
                self.writer.flush()?;
            }
            _ => {}
        }
        Ok(Control::Continue)
    }
}

/// `--profile`: each step's phases and each evaluation into a [`Profiler`]; a pipeline's
/// passes per stage into the trace, one row per stage; LibTorch's profiler over its window of
/// steps. At the end, rank 0 prints the phase table and the operator table, and every rank
/// writes its traces and `<run>.profile.md` (both tables) beside them.
pub struct ProfileSink {
    profiler: Profiler,
    trace: PathBuf,
    torch: TorchProfiler,
    /// What LibTorch's profiler recorded, once its window closed.
    recorded: Option<Recorded>,
    print: bool,
    header: RunHeader,
    /// The steps are a pipeline's: the trace holds the stages' passes only.
    pipelined: bool,
    /// The run's warm-up steps (`--steady-after`), which the table's medians leave out.
    warmup: usize,
}

/// Operators and kernels the profile shows (torch's `row_limit`).
const OPERATOR_ROWS: usize = 20;

impl ProfileSink {
    /// `trace`: the phases' Chrome trace; `torch`: LibTorch's profiler and its window; `rank`
    /// names the trace's process row; `print`: whether this rank prints the tables; `warmup`:
    /// the run's warm-up steps.
    pub fn new(trace: PathBuf, torch: TorchProfiler, rank: usize, print: bool, warmup: usize) -> ProfileSink {
        ProfileSink { profiler: Profiler::new(true, rank), trace, torch, recorded: None, print, header: RunHeader::default(), pipelined: false, warmup }
    }

    /// The tables and the files written, at the run's end.
    fn finish(&mut self, steps: usize) -> Result<()> {
        // Typical steps (counted from 1): after the warm-up, outside LibTorch's window.
        let (warmup, window) = (self.warmup, self.torch.window());
        let typical = |step: usize| step > warmup && !(window.first..=window.last).contains(&step);
        let counted = (1..=steps).filter(|&s| typical(s)).count();
        let table = self.profiler.table(steps, &|index| typical(index + 1));
        let phases = format!(
            "{table}(per step: the mean over all {steps} steps; median: over the {counted} typical ones, after --steady-after {warmup} and outside LibTorch's profiler's steps {}..{})\n",
            window.first, window.last
        );
        self.profiler.write_chrome_trace(&self.trace)?;
        if let Some(recorded) = self.torch.finish()? {
            self.recorded = Some(recorded);
        }
        let window = self.torch.window();
        let operators = match &self.recorded {
            Some(recorded) => format!(
                "LibTorch's profiler, steps {}..{} ({} recorded), operators and kernels by self {} time:\n\n{}",
                window.first,
                window.last.min(window.first + recorded.steps.max(1) - 1),
                recorded.steps,
                if recorded.table.device { "CUDA" } else { "CPU" },
                recorded.table.markdown(OPERATOR_ROWS)
            ),
            None => format!(
                "LibTorch's profiler recorded nothing: the run ended before step {} (--profile-steps {}..{})\n",
                window.first, window.first, window.last
            ),
        };
        let markdown = crate::profile::table_path(&self.trace);
        crate::output::write(&markdown, format!("# {}\n\nPhases (the device waited for at every phase boundary):\n\n{phases}\n{operators}", self.header.run))?;
        if self.print {
            println!("--profile: {} (device waited for at every phase boundary)\n{phases}", self.header.run);
            println!("{operators}");
            println!("wrote the Chrome trace {} (open in chrome://tracing or ui.perfetto.dev)", self.trace.display());
            if let Some(recorded) = &self.recorded {
                println!("wrote LibTorch's trace {} and the tables {}", recorded.trace.display(), markdown.display());
            }
        }
        Ok(())
    }
}

impl Observer for ProfileSink {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        self.header.update(event);
        match event {
            Event::StepStarting { step } => self.torch.step_starts(*step)?,
            Event::Step(step) => {
                if let Some(recorded) = self.torch.step_ended(step.step)? {
                    self.recorded = Some(recorded);
                }
                let index = step.step - 1;
                if step.stage_traces.is_empty() {
                    for &(phase, start, end) in step.phases {
                        self.profiler.record(phase, start, end, index);
                    }
                } else {
                    // A pipeline: its trace shows each device's passes (F<m>, B<m>, with the
                    // stage where a device holds several) on the device's row; the loop's phases
                    // count in the table.
                    self.pipelined = true;
                    for &(phase, start, end) in step.phases {
                        self.profiler.add_to_table(phase, index, phase_seconds(&[(phase, start, end)], phase));
                    }
                    let origin = step.phases.iter().map(|p| p.1).min().unwrap_or_else(Instant::now);
                    for trace in step.stage_traces {
                        for pass in &trace.passes {
                            let at = |s: f64| origin + Duration::from_secs_f64(s.max(0.0));
                            self.profiler.record_on(pass.label.clone(), trace.device, at(pass.start_s), at(pass.end_s), index);
                        }
                    }
                }
            }
            Event::EpochEnded { stats, .. } => match (stats.eval_interval, self.pipelined) {
                (Some((start, end)), false) => self.profiler.record("evaluation", start, end, stats.end_step),
                (Some((start, end)), true) => self.profiler.add_to_table("evaluation", stats.end_step, (end - start).as_secs_f64()),
                (None, _) => {}
            },
            Event::Finished(report) => self.finish(report.steps)?,
            _ => {}
        }
        Ok(Control::Continue)
    }
}

/// Every training step's mean loss on this replica, in order: read from the device a few hundred
/// steps at a time (one wait for the device per read, not per step), shared with whoever holds a
/// clone of [`StepLosses::values`].
#[derive(Default)]
pub struct StepLosses {
    pending: Vec<tch::Tensor>,
    values: std::rc::Rc<std::cell::RefCell<Vec<f64>>>,
}

/// Steps whose losses [`StepLosses`] reads at once.
const LOSSES_PER_READ: usize = 256;

impl StepLosses {
    pub fn new() -> StepLosses {
        StepLosses::default()
    }

    /// The losses read so far (all of them once the run finished).
    pub fn values(&self) -> std::rc::Rc<std::cell::RefCell<Vec<f64>>> {
        self.values.clone()
    }

    fn read(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let losses = tch::Tensor::stack(&self.pending, 0).to_kind(tch::Kind::Double).to_device(tch::Device::Cpu);
        self.values.borrow_mut().extend(Vec::<f64>::try_from(&losses)?);
        self.pending.clear();
        Ok(())
    }
}

impl Observer for StepLosses {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        match event {
            // A copy: a replayed CUDA graph writes its outputs into the same tensors every step.
            Event::Step(step) => {
                self.pending.push(step.loss.detach().to_kind(tch::Kind::Float).copy().reshape([]));
                if self.pending.len() >= LOSSES_PER_READ {
                    self.read()?;
                }
            }
            Event::EpochEnded { .. } | Event::Finished(_) => self.read()?,
            _ => {}
        }
        Ok(Control::Continue)
    }
}

/// Checkpoints after every completed epoch (a resume then starts at an epoch boundary, where
/// the data order, augmentation and dropout streams are known). On every rank: the ranks that
/// hold parts of the model send them to rank 0 for the one file.
pub struct CheckpointEveryEpoch;

impl Observer for CheckpointEveryEpoch {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        Ok(match event {
            Event::EpochEnded { completed: true, .. } => Control::Checkpoint,
            _ => Control::Continue,
        })
    }
}
