//! What a run tells the world, as data: the training loop and the experiments emit [`Event`]s;
//! [`Observer`]s turn them into a progress bar, console lines, TensorBoard scalars, a profile,
//! checkpoints (see [`super::sinks`]), or, in a notebook, a list to look at ([`EventLog`]).
//! The library itself prints nothing.
//!
//! Every rank emits the same events; which observers listen differs: the experiments attach the
//! ones that print or write files to rank 0 only, and the checkpoint policy to every rank (a
//! checkpoint of a model spread over ranks is gathered from all of them).
use std::time::Instant;

use anyhow::Result;
use tch::Tensor;

use super::{EpochStats, FitReport};

/// One thing that happened.
pub enum Event<'a> {
    /// A line of the run's narrative (the data, the model, the result): consoles print it.
    Info(String),
    /// Something the user should know (generated data, an unusual set-up): printed to stderr.
    Warning(String),
    /// The loop starts: `run` names it, `epochs` in all, `steps_per_epoch` optimizer steps each,
    /// starting after `start_epoch` epochs and `start_step` steps (a resumed run).
    Started { run: &'a str, epochs: usize, steps_per_epoch: usize, start_epoch: usize, start_step: usize },
    /// Epoch `epoch` (0-based) starts at learning rate `lr`.
    EpochStarted { epoch: usize, lr: f64 },
    /// Optimizer step `step` (counted from 1 over the run) starts: its batches are at hand.
    StepStarting { step: usize },
    /// An optimizer step finished.
    Step(&'a StepEvent<'a>),
    /// Epoch `stats.epoch` ended (`completed`: all its batches ran; false when `--max-steps`
    /// stopped it) and was evaluated.
    EpochEnded { stats: &'a EpochStats, completed: bool, data_wait_s: f64 },
    /// A checkpoint after `step` optimizer steps (`epoch` epochs completed) was handed to the
    /// writer (rank 0's, in the background: it is complete once the next checkpoint or the run's
    /// end has waited for it).
    Checkpointed { path: &'a std::path::Path, epoch: usize, step: usize },
    /// The loop is done.
    Finished(&'a FitReport),
}

/// One optimizer step, as observers see it.
pub struct StepEvent<'a> {
    pub epoch: usize,
    /// Optimizer steps completed in the whole run, this one included.
    pub step: usize,
    /// Steps completed in this epoch, this one included.
    pub epoch_step: usize,
    /// The step's mean loss on this replica, on the device (reading it waits for the device:
    /// observers read it every few steps only).
    pub loss: Tensor,
    pub lr: f64,
    /// Examples trained on in this epoch so far, by all replicas together.
    pub epoch_examples: usize,
    /// When the epoch started.
    pub epoch_start: Instant,
    /// The step's phases (`"data wait"`, `"forward"`, ...) with their times.
    pub phases: &'a [super::Phase],
    /// A pipeline's passes per device this process ran (empty otherwise).
    pub stage_traces: &'a [super::step::DeviceTrace],
    /// A pipeline's measured idle share this step (the bubble).
    pub bubble: Option<f64>,
}

/// What the loop should do after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// Save a checkpoint now (after an epoch end; every rank's policy asks alike).
    Checkpoint,
}

/// Something that reacts to events.
pub trait Observer {
    fn on_event(&mut self, event: &Event) -> Result<Control>;
}

/// The observers of a run, each told every event in the order they were added.
#[derive(Default)]
pub struct Observers<'o> {
    observers: Vec<Box<dyn Observer + 'o>>,
}

impl<'o> Observers<'o> {
    pub fn new() -> Self {
        Observers { observers: Vec::new() }
    }

    pub fn add(&mut self, observer: impl Observer + 'o) -> &mut Self {
        self.observers.push(Box::new(observer));
        self
    }

    pub fn with(mut self, observer: impl Observer + 'o) -> Self {
        self.add(observer);
        self
    }

    /// Tells every observer; [`Control::Checkpoint`] if any asked for one.
    pub fn emit(&mut self, event: &Event) -> Result<Control> {
        let mut control = Control::Continue;
        for observer in &mut self.observers {
            if observer.on_event(event)? == Control::Checkpoint {
                control = Control::Checkpoint;
            }
        }
        Ok(control)
    }

    /// [`Observers::emit`] of a line of narrative.
    pub fn info(&mut self, line: impl Into<String>) -> Result<()> {
        self.emit(&Event::Info(line.into())).map(drop)
    }

    pub fn warn(&mut self, line: impl Into<String>) -> Result<()> {
        self.emit(&Event::Warning(line.into())).map(drop)
    }
}

/// An event as plain data, kept by [`EventLog`].
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Info(String),
    Warning(String),
    Started { run: String, epochs: usize, steps_per_epoch: usize, start_epoch: usize },
    EpochStarted { epoch: usize, lr: f64 },
    Step { epoch: usize, step: usize, loss: f64, lr: f64, bubble: Option<f64> },
    EpochEnded(EpochStats),
    Checkpointed { epoch: usize, step: usize },
    Finished { steps: usize, eval_loss: f64 },
}

/// Keeps every event as a [`Record`] (reading each step's loss, which waits for the device):
/// for notebooks and tests that want a run's events as data.
#[derive(Debug, Default, Clone)]
pub struct EventLog {
    pub records: std::rc::Rc<std::cell::RefCell<Vec<Record>>>,
}

impl EventLog {
    pub fn new() -> Self {
        EventLog::default()
    }

    /// The records so far (the log shares them with its clones: keep one, give one to the run).
    pub fn records(&self) -> Vec<Record> {
        self.records.borrow().clone()
    }

    /// The steps' losses, in order.
    pub fn losses(&self) -> Vec<f64> {
        self.records.borrow().iter().filter_map(|r| if let Record::Step { loss, .. } = r { Some(*loss) } else { None }).collect()
    }
}

impl Observer for EventLog {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        let record = match event {
            Event::Info(line) => Record::Info(line.clone()),
            Event::Warning(line) => Record::Warning(line.clone()),
            Event::Started { run, epochs, steps_per_epoch, start_epoch, .. } => {
                Record::Started { run: run.to_string(), epochs: *epochs, steps_per_epoch: *steps_per_epoch, start_epoch: *start_epoch }
            }
            Event::EpochStarted { epoch, lr } => Record::EpochStarted { epoch: *epoch, lr: *lr },
            Event::StepStarting { .. } => return Ok(Control::Continue),
            Event::Step(step) => Record::Step { epoch: step.epoch, step: step.step, loss: step.loss.double_value(&[]), lr: step.lr, bubble: step.bubble },
            Event::EpochEnded { stats, .. } => Record::EpochEnded((*stats).clone()),
            Event::Checkpointed { epoch, step, .. } => Record::Checkpointed { epoch: *epoch, step: *step },
            Event::Finished(report) => Record::Finished { steps: report.steps, eval_loss: report.eval_loss },
        };
        self.records.borrow_mut().push(record);
        Ok(Control::Continue)
    }
}

/// Seconds from `start` to `end`.
pub fn seconds(start: Instant, end: Instant) -> f64 {
    end.saturating_duration_since(start).as_secs_f64()
}

/// How long the phase named `name` took in `phases` (0 if absent).
pub fn phase_seconds(phases: &[super::Phase], name: &str) -> f64 {
    phases.iter().filter(|(n, _, _)| *n == name).map(|&(_, a, b)| seconds(a, b)).sum()
}
