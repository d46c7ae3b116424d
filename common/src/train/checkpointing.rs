//! When a run checkpoints, and how writing stays off the training thread's path.
//!
//! Besides every completed epoch, a run checkpoints every `--checkpoint-every N` optimizer
//! steps, every `--checkpoint-minutes M`, at the last step of a `--max-steps` run, and where a
//! signal stops it ([`super::preemption`]). A checkpoint in the middle of an epoch records how
//! many of its steps were taken, and a resume goes on with the next batch: the losses are then
//! those of a run that was never interrupted.
//!
//! Saving gathers the state to rank 0 and copies it to host memory (the time training is
//! blocked, measured); a background thread writes and commits the file. At most one write is
//! in flight: the next checkpoint, and the run's end, first wait for it, and a write that
//! failed (a full disk) fails the run there, its previous checkpoint intact.
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use super::step::TrainStep;
use super::{state, CheckpointConfig};
use crate::checkpoint::{self, CheckpointMeta};
use crate::optim::Optimizer;

/// What checkpointing cost a run, on the rank that writes (rank 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct CheckpointStats {
    /// Checkpoints taken (epoch ends and steps).
    pub saved: usize,
    /// Training time blocked by them in all: gathering the state and copying it to host memory,
    /// and waiting for a previous write still in flight.
    pub blocked_s: f64,
    /// The longest any one blocked training.
    pub max_blocked_s: f64,
    /// Time the background thread spent writing them, while training went on.
    pub write_s: f64,
    /// Bytes of tensor data in the last one.
    pub bytes: usize,
}

/// A background write: the seconds it took and the bytes it wrote.
type Write = JoinHandle<Result<(f64, usize)>>;

/// Decides when to checkpoint besides the epochs' ends, and saves.
pub(crate) struct Checkpointer<'c> {
    config: &'c CheckpointConfig,
    path: PathBuf,
    last: Instant,
    writing: Option<Write>,
    pub stats: CheckpointStats,
}

impl<'c> Checkpointer<'c> {
    pub fn new(config: &'c CheckpointConfig, run: &str) -> Checkpointer<'c> {
        Checkpointer { config, path: checkpoint::path_for(&config.dir, run), last: Instant::now(), writing: None, stats: CheckpointStats::default() }
    }

    pub fn config(&self) -> &CheckpointConfig {
        self.config
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `--checkpoint-every` asks for a checkpoint after optimizer step `step`.
    pub fn due_by_steps(&self, step: usize) -> bool {
        self.config.every_steps.is_some_and(|n| n > 0 && step.is_multiple_of(n))
    }

    /// Whether `--checkpoint-minutes` have passed since the last checkpoint (or the start) by
    /// this rank's clock: ranks read their clocks at different moments, so the caller agrees on
    /// it with the others before acting.
    pub fn due_by_time(&self) -> bool {
        self.config.every_minutes.is_some_and(|minutes| self.last.elapsed() >= Duration::from_secs_f64(minutes * 60.0))
    }

    /// Saves the checkpoint `meta` describes (every rank calls it): blocks while the state is
    /// gathered and copied to host memory, then rank 0 writes it in the background. After an
    /// epoch with `--keep-checkpoints`, the background thread also keeps the epoch's copy.
    pub fn save(&mut self, step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer, meta: CheckpointMeta) -> Result<()> {
        let started = Instant::now();
        // At most one write in flight (and one copy of the state in host memory besides it).
        self.wait()?;
        let keep = (meta.epoch_step == 0 && self.config.keep > 0).then_some((meta.epoch, self.config.keep));
        if let Some(host) = state::gather(step, optimizer, meta)? {
            let path = self.path.clone();
            let write = move || -> Result<(f64, usize)> {
                let writing = Instant::now();
                host.write(&path)?;
                if let Some((epoch, keep)) = keep {
                    checkpoint::keep_epoch_copy(&path, epoch, keep)?;
                }
                Ok((writing.elapsed().as_secs_f64(), host.bytes()))
            };
            self.writing =
                Some(std::thread::Builder::new().name("checkpoint-writer".into()).spawn(write).context("cannot start the checkpoint writer thread")?);
        }
        let blocked = started.elapsed().as_secs_f64();
        self.stats.saved += 1;
        self.stats.blocked_s += blocked;
        self.stats.max_blocked_s = self.stats.max_blocked_s.max(blocked);
        self.last = Instant::now();
        Ok(())
    }

    /// Waits for the write in flight, if any; its error, if it failed.
    pub fn wait(&mut self) -> Result<()> {
        let Some(writing) = self.writing.take() else { return Ok(()) };
        let (seconds, bytes) = writing.join().map_err(|_| anyhow::anyhow!("the checkpoint writer thread panicked"))??;
        self.stats.write_s += seconds;
        self.stats.bytes = bytes;
        Ok(())
    }
}

impl Drop for Checkpointer<'_> {
    /// A run that fails still leaves the checkpoint it handed over complete (or not at all).
    fn drop(&mut self) {
        let _ = self.wait();
    }
}
