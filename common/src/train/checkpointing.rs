//! When a run checkpoints, and how writing stays off the training thread's path.
//!
//! Besides every completed epoch, a run checkpoints every `--checkpoint-every N` optimizer
//! steps, every `--checkpoint-minutes M`, at the last step of a `--max-steps` run, and where a
//! signal stops it ([`super::preemption`]). A checkpoint in the middle of an epoch records how
//! many of its steps were taken, and a resume goes on with the next batch: the losses are then
//! those of a run that was never interrupted.
//!
//! A checkpoint is one file or, where ZeRO, tensor or pipeline parallelism spread the model
//! state over ranks, sharded ([`crate::checkpoint::sharded`], `--checkpoint-format`). One file:
//! the state is gathered to rank 0 and copied to host memory there (the time training is
//! blocked, measured), and a background thread writes and commits it. Sharded: every rank
//! copies only what it owns and its own background thread writes its file; once every rank's
//! is complete (the ranks learn it in the per-step agreement, without waiting for it), rank 0
//! commits the checkpoint by writing its index. At most one write is in flight: the next
//! checkpoint, and the run's end, first wait for it, and a write that failed (a full disk) fails
//! the run there, on every rank, its previous checkpoint intact.
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use super::step::TrainStep;
use super::{owned_state, state, CheckpointConfig};
use crate::checkpoint::sharded::{self, HostShard};
use crate::checkpoint::{self, CheckpointMeta};
use crate::comm::ProcessGroup;
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
    /// Bytes of tensor data in the last one that this rank copied and wrote: the whole
    /// checkpoint where it is one file, this rank's own part where it is sharded.
    pub bytes: usize,
    /// Whether the checkpoints were sharded (every rank writing its part).
    pub sharded: bool,
    /// Bytes of the checkpoint this rank read into memory to resume (0: not resumed).
    pub resumed_bytes: u64,
}

/// A background write: the seconds it took and the bytes it wrote.
type Write = JoinHandle<Result<(f64, usize)>>;

/// How a checkpoint is written: `--checkpoint-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointFormat {
    /// Sharded where ZeRO, tensor or pipeline parallelism spread the model state over ranks,
    /// one file otherwise.
    #[default]
    Auto,
    /// One file, the state gathered to rank 0.
    Whole,
    /// A folder, every rank writing the part it owns.
    Sharded,
}

/// Decides when to checkpoint besides the epochs' ends, and saves.
pub(crate) struct Checkpointer<'c, 'g> {
    config: &'c CheckpointConfig,
    /// The single-file checkpoint's path (sharded: the folder of the run's checkpoints).
    path: PathBuf,
    last: Instant,
    writing: Option<Write>,
    /// A failed write, kept until every rank has heard of it.
    failed: Option<anyhow::Error>,
    /// Sharded checkpoints: the job's ranks, and the checkpoint written but not yet committed.
    sharded: Option<Sharding<'g>>,
    pub stats: CheckpointStats,
}

struct Sharding<'g> {
    world: Option<&'g ProcessGroup>,
    /// Its folder and what the index will say.
    pending: Option<(PathBuf, CheckpointMeta)>,
}

/// The epoch whose copy `--keep-checkpoints` keeps of the checkpoint `meta` describes, and how
/// many such copies: at an epoch's end only.
fn epoch_copy(config: &CheckpointConfig, meta: &CheckpointMeta) -> Option<(usize, usize)> {
    (meta.epoch_step == 0 && config.keep > 0).then_some((meta.epoch, config.keep))
}

impl<'c, 'g> Checkpointer<'c, 'g> {
    /// `sharded`: the ranks of `world` each write their part (else rank 0 the whole).
    pub fn new(config: &'c CheckpointConfig, run: &str, sharded: bool, world: Option<&'g ProcessGroup>) -> Checkpointer<'c, 'g> {
        let path = checkpoint::path_for(&config.dir, run);
        let (path, sharded) = match sharded {
            true => (sharded::run_folder_of(&path), Some(Sharding { world, pending: None })),
            false => (path, None),
        };
        let stats = CheckpointStats { sharded: sharded.is_some(), ..CheckpointStats::default() };
        Checkpointer { config, path, last: Instant::now(), writing: None, failed: None, sharded, stats }
    }

    /// Whether the checkpoint of `step` and `optimizer` is sharded, as `format` asks.
    pub fn shards(format: CheckpointFormat, step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer) -> bool {
        match format {
            CheckpointFormat::Auto => owned_state::spread(step, optimizer),
            CheckpointFormat::Whole => false,
            CheckpointFormat::Sharded => true,
        }
    }

    pub fn config(&self) -> &CheckpointConfig {
        self.config
    }

    /// The checkpoint file, or the folder of a sharded run's checkpoints.
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
    /// gathered (one file) or this rank's part (sharded) is copied to host memory, then writes it
    /// in the background. After an epoch with `--keep-checkpoints`, the epoch's copy is kept too
    /// (by the background thread, or by rank 0 when it commits a sharded one).
    pub fn save(&mut self, step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer, meta: CheckpointMeta) -> Result<()> {
        let started = Instant::now();
        if self.sharded.is_some() {
            self.save_part(step, optimizer, meta)?;
        } else {
            self.save_whole(step, optimizer, meta)?;
        }
        let blocked = started.elapsed().as_secs_f64();
        self.stats.saved += 1;
        self.stats.blocked_s += blocked;
        self.stats.max_blocked_s = self.stats.max_blocked_s.max(blocked);
        self.last = Instant::now();
        Ok(())
    }

    fn save_whole(&mut self, step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer, meta: CheckpointMeta) -> Result<()> {
        // At most one write in flight (and one copy of the state in host memory besides it).
        self.finish()?;
        let keep = epoch_copy(self.config, &meta);
        let at_step = meta.step;
        let gathered = state::gather(step, optimizer, meta)?;
        if gathered.is_none() {
            crate::comm::watchdog::note_committed_elsewhere();
        }
        if let Some(host) = gathered {
            let path = self.path.clone();
            self.spawn(move || {
                let writing = Instant::now();
                host.write(&path)?;
                // Renamed into place: a resume starts here from now on (said the moment it is
                // true, for a hang's line: a node may die before the next step's poll).
                crate::comm::watchdog::note_committed(at_step);
                if let Some((epoch, keep)) = keep {
                    checkpoint::keep_epoch_copy(&path, epoch, keep)?;
                }
                Ok((writing.elapsed().as_secs_f64(), host.bytes()))
            })?;
        }
        Ok(())
    }

    /// Sharded: this rank copies its own part and writes it into the step's folder.
    fn save_part(&mut self, step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer, meta: CheckpointMeta) -> Result<()> {
        let folder = sharded::step_folder(&self.path, meta.step);
        let world = self.sharded.as_ref().and_then(|s| s.world);
        let rank = world.map_or(0, ProcessGroup::rank);
        // The same step saved again (an epoch's end after its last step's checkpoint): rank 0
        // clears the older one before the ranks agree to go on (in `finish`) and write.
        if rank == 0 && folder.exists() {
            std::fs::remove_dir_all(&folder).with_context(|| format!("cannot replace the checkpoint {}", folder.display()))?;
        }
        self.finish()?;
        let host = HostShard::new(owned_state::owned_pieces(step, optimizer)?)
            .with_context(|| format!("the checkpoint after epoch {} (step {})", meta.epoch, meta.step))?;
        let into = folder.clone();
        self.spawn(move || {
            let writing = Instant::now();
            host.write(&into, rank)?;
            Ok((writing.elapsed().as_secs_f64(), host.bytes()))
        })?;
        if let Some(sharding) = self.sharded.as_mut() {
            sharding.pending = Some((folder, meta));
        }
        Ok(())
    }

    fn spawn(&mut self, write: impl FnOnce() -> Result<(f64, usize)> + Send + 'static) -> Result<()> {
        self.writing = Some(std::thread::Builder::new().name("checkpoint-writer".into()).spawn(write).context("cannot start the checkpoint writer thread")?);
        Ok(())
    }

    /// Collects this rank's write if it has ended (without waiting); returns whether it is
    /// still going and whether a write failed: this rank's part of the per-step agreement.
    pub fn poll(&mut self) -> (bool, bool) {
        if self.writing.as_ref().is_some_and(JoinHandle::is_finished) {
            self.join();
        }
        (self.writing.is_some(), self.failed.is_some())
    }

    /// Acts on what the ranks agreed after a step ([`Checkpointer::poll`] on each): a write
    /// that failed anywhere fails the run on every rank; once no rank is still writing, rank 0
    /// commits the sharded checkpoint.
    pub fn settle(&mut self, writing: bool, failed: bool) -> Result<()> {
        if failed {
            return Err(self.failed.take().unwrap_or_else(|| {
                anyhow::anyhow!("another rank could not write its part of the checkpoint in {}; the previous one is intact", self.path.display())
            }));
        }
        let Some(sharding) = self.sharded.as_mut().filter(|_| !writing) else { return Ok(()) };
        let Some((folder, meta)) = sharding.pending.take() else { return Ok(()) };
        let ranks = sharding.world.map_or(1, ProcessGroup::world_size);
        let keep = epoch_copy(self.config, &meta);
        let committed = match sharding.world.is_none_or(ProcessGroup::is_root) {
            true => sharded::commit(&folder, ranks, &meta).and_then(|()| {
                // The index is written: a resume starts here (rank 0 says so at once; the others
                // after the agreement below, which a dead node may never let end).
                crate::comm::watchdog::note_committed(meta.step);
                keep.map_or(Ok(()), |(epoch, keep)| sharded::keep_epoch_copy(&folder, epoch, keep))
            }),
            false => Ok(()),
        };
        // Rank 0's commit can fail too (a full disk): every rank hears of it.
        let failed = match sharding.world {
            Some(world) => world.any_of(&[committed.is_err()])?[0],
            None => committed.is_err(),
        };
        match (committed, failed) {
            (Err(err), _) => Err(err),
            (Ok(()), true) => anyhow::bail!("rank 0 could not commit the checkpoint in {}; the previous one is intact", folder.display()),
            (Ok(()), false) => {
                crate::comm::watchdog::note_committed(meta.step);
                Ok(())
            }
        }
    }

    /// Waits for the write in flight, if any, and (sharded; every rank calls it) for every
    /// rank's, then commits it; an error where any failed.
    pub fn finish(&mut self) -> Result<()> {
        if self.writing.is_some() {
            self.join();
        }
        let failed = self.failed.is_some();
        let failed = match self.sharded.as_ref().and_then(|s| s.world) {
            Some(world) => world.any_of(&[failed])?[0],
            None => failed,
        };
        self.settle(false, failed)
    }

    /// Joins the writer thread, recording what it wrote or how it failed.
    fn join(&mut self) {
        let Some(writing) = self.writing.take() else { return };
        match writing.join().map_err(|_| anyhow::anyhow!("the checkpoint writer thread panicked")).and_then(|r| r) {
            Ok((seconds, bytes)) => {
                self.stats.write_s += seconds;
                self.stats.bytes = bytes;
            }
            Err(err) => self.failed = Some(err),
        }
    }
}

impl Drop for Checkpointer<'_, '_> {
    /// A run that fails still leaves the checkpoint it handed over complete (or not at all):
    /// this rank's write ends (no commit: that takes every rank).
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::region::Region;
    use crate::checkpoint::sharded::Piece;
    use tch::{Device, Kind, Tensor};

    fn meta(step: usize) -> CheckpointMeta {
        CheckpointMeta {
            format: checkpoint::FORMAT_VERSION,
            run: "run".into(),
            model: serde_json::json!({}),
            optimizer: "sgd".into(),
            epoch: 1,
            step,
            epoch_step: 0,
            seed: 0,
            config: serde_json::json!({}),
            torch_version: String::new(),
            grad_scaler: None,
            data: serde_json::Value::Null,
            examples_per_step: 0,
        }
    }

    /// A sharded checkpoint written while a rank was still writing is committed at the first
    /// step where none is, never dropped (a step's agreement saying "still writing" once must
    /// not lose it).
    #[test]
    fn a_sharded_checkpoint_waits_for_every_rank_then_is_committed() {
        let dir = tempfile::tempdir().unwrap();
        let config = CheckpointConfig {
            dir: dir.path().to_path_buf(),
            resume: false,
            model: serde_json::json!({}),
            data: serde_json::Value::Null,
            config: serde_json::json!({}),
            from: None,
            keep: 0,
            every_steps: None,
            every_minutes: None,
            format: CheckpointFormat::Sharded,
            examples_per_step: 0,
        };
        let mut checkpointer = Checkpointer::new(&config, "run", true, None);
        let folder = sharded::step_folder(checkpointer.path(), 3);
        let weight = Tensor::arange(6, (Kind::Float, Device::Cpu));
        HostShard::new(vec![Piece::model("w", vec![6], Region::WHOLE, weight)]).unwrap().write(&folder, 0).unwrap();
        checkpointer.sharded.as_mut().unwrap().pending = Some((folder.clone(), meta(3)));

        checkpointer.settle(true, false).unwrap();
        assert!(!folder.join(sharded::INDEX).exists(), "not committed while a rank writes");
        checkpointer.settle(false, false).unwrap();
        assert!(folder.join(sharded::INDEX).exists(), "committed once no rank writes");
        let source = sharded::Source::open(&folder).unwrap();
        assert_eq!(source.meta.step, 3);
        assert_eq!(Vec::<f32>::try_from(source.read_whole("model.w").unwrap()).unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);

        // A failure on any rank fails every rank, naming the folder where it is not its own.
        let err = checkpointer.settle(false, true).unwrap_err().to_string();
        assert!(err.contains("another rank could not write its part") && err.contains("run.shards"), "{err}");
    }
}
