//! Where a run starts and what it leaves behind: the checkpoint it resumes from and the ones it
//! writes, for a model on one rank or spread over several (pipeline stages), replicated or not.
//!
//! Every variable and optimizer state is saved under its whole-model name, so a run resumes on
//! another number of stages, shards, processes or replicas than the one that wrote it. One file
//! is written by the job's rank 0 (with the other ranks' parts gathered to it, [`gather`]);
//! where the state is spread over ranks, each writes its own part (`owned_state`). Resuming, a
//! layout that spreads its state, or a sharded checkpoint, is read by every rank for itself
//! (`owned_state`); otherwise rank 0 reads the file and sends each rank of replica 0 its part,
//! and the replicas then start from replica 0's state, as Horovod broadcasts rank 0's.
use std::path::Path;

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::events::Observers;
use super::owned_state;
use super::step::TrainStep;
use crate::checkpoint::{self, Checkpoint, CheckpointMeta, Found, HostCheckpoint};
use crate::comm::transfer::{recv_named, recv_tensor, send_named, send_tensor};
use crate::comm::ProcessGroup;
use crate::optim::Optimizer;
use crate::precision::{GradScaler, GradScalerState};

/// Epochs and optimizer steps already done when the loop starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Progress {
    pub epoch: usize,
    pub step: usize,
    /// Steps already taken in epoch `epoch` (a checkpoint written in the middle of it).
    pub epoch_step: usize,
    /// Bytes of the checkpoint this rank read into memory to resume (rank 0 reading a single
    /// file for everyone: all of it; every rank reading its own part: that part).
    pub read_bytes: u64,
}

/// Restores the newest checkpoint of the run whose single-file checkpoint is `path` (one file or
/// sharded) when `resume` asks for it and one exists, checking it was written for `model`; then
/// makes every replica start from replica 0's variables and optimizer state. Rank 0 finds the
/// checkpoint. A single file read into a layout that does not spread its state over ranks is
/// read by rank 0, which hands each rank of replica 0 its part; otherwise (a sharded checkpoint,
/// or a layout that is) every rank reads its own part. Every rank calls it. Returns where the
/// run continues.
pub(crate) fn start(
    step: &mut dyn TrainStep<'_>,
    optimizer: &mut dyn Optimizer,
    scaler: Option<&mut GradScaler>,
    resume_from: Option<Expected<'_>>,
    observers: &mut Observers,
) -> Result<Progress> {
    let (root, world) = (step.sync().is_root(), step.sync().world());
    let spread = owned_state::spread(step, optimizer);

    // Rank 0 finds the checkpoint; [resumed, epoch, step, scale, growth tracker, epoch step,
    // every rank reads] then go to everyone.
    let mut found: Option<Found> = None;
    let mut header = [0.0, 0.0, 0.0, f64::NAN, 0.0, 0.0, 0.0];
    let doing = if resume_from.as_ref().is_some_and(|e| e.eval_only) { "evaluating" } else { "resuming" };
    if let (Some(expected), true) = (resume_from, root) {
        found = find(&expected, observers)?;
        if let Some(found) = &found {
            let meta = &found.meta;
            let scale = meta.grad_scaler.map_or([f64::NAN, 0.0], |s| [s.scale, s.growth_tracker as f64]);
            let each_reads = (found.sharded || spread) as u8 as f64;
            header = [1.0, meta.epoch as f64, meta.step as f64, scale[0], scale[1], meta.epoch_step as f64, each_reads];
        }
    }
    if let Some(world) = world {
        let mut shared = Tensor::from_slice(&header);
        world.broadcast(&mut shared, 0)?;
        header.copy_from_slice(&Vec::<f64>::try_from(&shared)?);
    }
    let (resumed, each_reads) = (header[0] == 1.0, header[6] == 1.0);
    let read_bytes;
    if resumed && each_reads {
        let mut location = found.as_ref().map_or(Vec::new(), |f| f.path.as_os_str().as_encoded_bytes().to_vec());
        if let Some(world) = world {
            location = world.broadcast_bytes(&location, 0)?;
        }
        let location = std::path::PathBuf::from(String::from_utf8(location).context("the checkpoint's path is not UTF-8")?);
        let mut source = checkpoint::sharded::Source::open(&location)?;
        source.refuse_non_finite_model(doing);
        owned_state::restore_owned(step, optimizer, &source)?;
        read_bytes = source.read_bytes();
    } else {
        let loaded = match &found {
            Some(found) => {
                let loaded = checkpoint::load(&found.path)?;
                loaded.check_finite_model(&found.path, doing)?;
                Some((found.path.as_path(), loaded))
            }
            None => None,
        };
        read_bytes = loaded.as_ref().map_or(0, |(_, ck)| ck.tensors.values().map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum());
        restore_from_root(step, optimizer, loaded.as_ref().map(|(path, ck)| (*path, ck)), resumed)?;
    }
    if let (Some(scaler), false) = (scaler, header[3].is_nan()) {
        scaler.load_state(GradScalerState { scale: header[3], growth_tracker: header[4] as i64 });
    }
    Ok(Progress { epoch: header[1] as usize, step: header[2] as usize, epoch_step: header[5] as usize, read_bytes })
}

/// What a run resumes from (`path`) and what the checkpoint there must have been written for.
pub(crate) struct Expected<'a> {
    pub path: &'a Path,
    pub model: &'a serde_json::Value,
    pub data: &'a serde_json::Value,
    pub seed: u64,
    /// Examples in one optimizer step of this job.
    pub examples_per_step: usize,
    /// `--eval-only` (said when the checkpoint is refused).
    pub eval_only: bool,
}

/// Rank 0: the newest complete checkpoint at `path` (see [`checkpoint::find_newest`]), checked
/// to be `identity`'s, after removing what killed writers left; says what it resumes.
fn find(expected: &Expected<'_>, observers: &mut Observers) -> Result<Option<Found>> {
    let path = expected.path;
    let mut removed = checkpoint::remove_stale_temporaries(path)?;
    removed.extend(checkpoint::sharded::remove_interrupted(&checkpoint::sharded::run_folder_of(path))?);
    for removed in removed {
        observers.warn(format!("removed {}, what the writer of an interrupted checkpoint left", removed.display()))?;
    }
    let Some(found) = checkpoint::find_newest(path)? else {
        observers.info(format!("--resume: no checkpoint at {} yet, starting from scratch", path.display()))?;
        return Ok(None);
    };
    for warning in &found.warnings {
        observers.warn(warning.clone())?;
    }
    found.meta.check_model(&found.path, expected.model)?;
    found.meta.check_data(&found.path, expected.data)?;
    let meta = &found.meta;
    if meta.seed != expected.seed {
        observers.warn(format!(
            "warning: {} was written by a run with --seed {}, this one has --seed {}: its data order, augmentation and dropout from here on \
             differ from the run's",
            found.path.display(),
            meta.seed,
            expected.seed
        ))?;
    }
    if meta.examples_per_step != 0 && meta.examples_per_step != expected.examples_per_step && !expected.eval_only {
        observers.warn(format!(
            "warning: {} was written by a job of {} examples per step, this one takes {} (--batch-size, --accumulate or the number of \
             replicas differ): the samples it trains on from here on differ from the run's",
            found.path.display(),
            meta.examples_per_step,
            expected.examples_per_step
        ))?;
    }
    let within = match meta.epoch_step {
        0 => String::new(),
        n => format!(" and {n} steps into epoch {}", meta.epoch + 1),
    };
    observers.info(format!("resumed {} from {} after epoch {}{within} (step {})", meta.run, found.path.display(), meta.epoch, meta.step))?;
    Ok(Some(found))
}

/// Rank 0 holds the checkpoint it read (`loaded`, when `resumed`): every rank of replica 0
/// gets its part from it; then every replica takes replica 0's variables and optimizer state.
fn restore_from_root(step: &mut dyn TrainStep<'_>, optimizer: &mut dyn Optimizer, loaded: Option<(&Path, &Checkpoint)>, resumed: bool) -> Result<()> {
    let (replica, model) = (step.sync().replica(), step.sync().model());
    // ZeRO-3's parameters whole while they are restored and made the replicas' common ones.
    step.sync().materialize()?;
    let mut restored_state = Vec::new();
    if resumed && replica == 0 {
        let what = loaded.map_or(String::new(), |(path, _)| path.display().to_string());
        restored_state = restore_replica_zero(step, optimizer, loaded.map(|(_, ck)| ck), &what, model)?;
    }
    step.sync().start_from_replica_zero(step.named_variables(), optimizer, restored_state)?;
    step.sync().release(true)
}

/// Gives every rank of replica 0 its part of `loaded` (which rank 0 holds): rank 0's directly,
/// the other stages' and shards' through `model` (whole tensors, which a tensor-parallel shard
/// cuts to its part). Rank 0 then checks that the parts covered the file. Returns the optimizer
/// state this rank restored (for the replicas of a sharded optimizer).
fn restore_replica_zero(
    step: &mut dyn TrainStep<'_>,
    optimizer: &mut dyn Optimizer,
    loaded: Option<&Checkpoint>,
    what: &str,
    model: Option<&ProcessGroup>,
) -> Result<Vec<(String, Tensor)>> {
    let variables = step.named_variables();
    let names: Vec<String> = variables.iter().map(|(n, _)| n.clone()).collect();
    let part = match model.filter(|g| !g.is_root()) {
        None => {
            // Rank 0 of replica 0 (the file is here): its own part, then every other rank's.
            let loaded = loaded.context("rank 0 restores from the checkpoint it read")?;
            let path = Path::new(what);
            let mut covered: std::collections::HashSet<String> = names.iter().cloned().collect();
            if let Some(model) = model {
                for rank in 1..model.world_size() {
                    let theirs: Vec<String> = serde_json::from_slice(&Vec::<u8>::try_from(&recv_tensor(model, rank, Device::Cpu)?)?)?;
                    send_named(model, &loaded.part(path, &theirs)?, rank)?;
                    covered.extend(theirs);
                }
            }
            if covered.len() != loaded.model_variables() {
                anyhow::bail!(
                    "checkpoint {what} holds {} model variables, but this run's ranks hold {}: it was written for another model",
                    loaded.model_variables(),
                    covered.len()
                );
            }
            loaded.part(path, &names)?
        }
        Some(model) => {
            send_tensor(model, &Tensor::from_slice(&serde_json::to_vec(&names)?).to_kind(Kind::Uint8), 0)?;
            model.wait_sends()?;
            recv_named(model, 0)?
        }
    };
    let part = match step.sync().tensor_cut() {
        Some(cut) => checkpoint::map_part(part, |name, whole| cut.shard_of(name, &whole))?,
        None => part,
    };
    let state = checkpoint::part_state(&part);
    checkpoint::restore_part(what, part, variables, optimizer)?;
    Ok(state)
}

/// Gathers the checkpoint `meta` describes: replica 0's ranks send their variables and optimizer
/// state to rank 0, which copies them to host memory and returns them, to be written (by a
/// background thread, atomically); `None` on every other rank. Every rank calls it.
pub(crate) fn gather(step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer, meta: CheckpointMeta) -> Result<Option<HostCheckpoint>> {
    // ZeRO-3's parameters whole while they are read.
    step.sync().materialize()?;
    let gathered = gather_whole(step, optimizer, meta);
    step.sync().release(false)?;
    gathered
}

fn gather_whole(step: &dyn TrainStep<'_>, optimizer: &dyn Optimizer, meta: CheckpointMeta) -> Result<Option<HostCheckpoint>> {
    let sync = step.sync();
    // Every replica takes part where the optimizer state is sharded over them.
    let mut state = crate::optim::gathered_state(optimizer)?;
    if sync.replica() != 0 {
        return Ok(None); // replicas hold what replica 0 holds
    }
    let mut variables = step.named_variables();
    // Tensor-parallel shards put their parts together (every shard takes part); the first
    // shard then stands for them all.
    let shards = sync.tensor_cut().map_or(1, |cut| cut.shard().1);
    if let Some(cut) = sync.tensor_cut() {
        variables = cut.unshard_named(variables)?;
        state = cut.unshard_named(state)?;
        if cut.shard().0 != 0 {
            return Ok(None);
        }
    }
    if let Some(model) = sync.model() {
        if !model.is_root() {
            send_named(model, &variables, 0)?;
            send_named(model, &state, 0)?;
            return Ok(None);
        }
        // The model's ranks are numbered stage × shards + shard: the first shards send.
        for rank in (1..model.world_size()).filter(|rank| rank % shards == 0) {
            variables.extend(recv_named(model, rank)?);
            state.extend(recv_named(model, rank)?);
        }
    }
    let (epoch, step) = (meta.epoch, meta.step);
    Ok(Some(HostCheckpoint::new(variables, state, meta).with_context(|| format!("the checkpoint after epoch {epoch} (step {step})"))?))
}
