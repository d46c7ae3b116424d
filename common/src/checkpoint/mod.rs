//! Checkpoints: model variables, optimizer state, progress and configuration in one
//! `.safetensors` file, the JSON metadata in its header; or, where the state is spread over
//! ranks, one file per rank and an index ([`sharded`]).
//!
//! A checkpoint is written through [`crate::output`] (a temporary file beside the target,
//! flushed to disk, then renamed over it), so a run killed at any moment leaves either the
//! previous checkpoint or the new one, never a torn file. The one it replaces stays beside it as
//! `<run>.previous.safetensors`: should the newest ever be unreadable (a disk that lost blocks,
//! a file copied in half), [`find_newest`] passes over it to the previous one, and says so.
//!
//! Writing is split in two so that training need not wait for the disk: [`HostCheckpoint::new`]
//! copies the tensors to host memory (the training thread's part), [`HostCheckpoint::write`]
//! serialises and commits them (a background thread's, see `train::checkpointing`).
pub mod region;
pub mod sharded;

use crate::optim::Optimizer;
use anyhow::Context;
use safetensors::tensor::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{nn, Device, Kind, Tensor};

/// Bumped when the layout changes, so an old file is refused instead of misread.
pub const FORMAT_VERSION: u32 = 1;
const METADATA_KEY: &str = "checkpoint";
const MODEL_PREFIX: &str = "model.";
const OPTIM_PREFIX: &str = "optim.";

/// Everything about a checkpoint except its tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub format: u32,
    /// Which run wrote it, e.g. `exercise1-cnn-cpu`.
    pub run: String,
    /// Identity of the model (architecture and shapes); a resume must build the same.
    pub model: serde_json::Value,
    /// Optimizer name (`adam`, `sgd`).
    pub optimizer: String,
    /// Epochs completed.
    pub epoch: usize,
    /// Optimizer steps completed.
    pub step: usize,
    /// Optimizer steps already taken in the epoch after `epoch` when the checkpoint was written
    /// in the middle of it (`--checkpoint-every`, a preemption); 0 at an epoch's end. A resume
    /// skips that epoch's first `epoch_step` steps' batches and goes on with the next.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch_step: usize,
    pub seed: u64,
    /// The run's configuration, for the record.
    pub config: serde_json::Value,
    pub torch_version: String,
    /// The float16 gradient scaler's state (`--precision 16-mixed`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_scaler: Option<crate::precision::GradScalerState>,
    /// What the model was trained on, where its meaning depends on it (a language model's
    /// vocabulary: word ids are embedding rows); absent in older checkpoints and for data whose
    /// layout the model's shapes already pin down.
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
    /// Examples in one optimizer step of the job that wrote it (0: not recorded, older files).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub examples_per_step: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A loaded checkpoint, tensors on the CPU.
pub struct Checkpoint {
    pub meta: CheckpointMeta,
    pub tensors: HashMap<String, Tensor>,
}

/// Whether tensors of these names are one of our checkpoints (the model's and the optimizer's
/// state under their prefixes), not a plain weights file.
pub fn holds_checkpoint<'a>(mut names: impl Iterator<Item = &'a str>) -> bool {
    let mut optimizer = false;
    let ours = names.all(|n| {
        optimizer |= n.starts_with(OPTIM_PREFIX);
        n.starts_with(MODEL_PREFIX) || n.starts_with(OPTIM_PREFIX)
    });
    ours && optimizer
}

/// Keeps a copy of the checkpoint just written at `latest` as `<run>-epoch<epoch>.safetensors`
/// beside it (a hard link: no second copy of the bytes, and the latest is replaced by a rename,
/// which leaves the link's file alone), and removes all but the `keep` newest such copies.
pub fn keep_epoch_copy(latest: &Path, epoch: usize, keep: usize) -> anyhow::Result<()> {
    let (dir, stem) = (latest.parent().unwrap_or(Path::new(".")), latest.file_stem().and_then(|s| s.to_str()).unwrap_or("run"));
    let copy = dir.join(format!("{stem}-epoch{epoch}.safetensors"));
    crate::output::second_name(latest, &copy).with_context(|| format!("cannot keep the checkpoint of epoch {epoch}"))?;
    let prefix = format!("{stem}-epoch");
    let mut kept: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let name = path.file_name()?.to_str()?;
            let epoch = name.strip_prefix(&prefix)?.strip_suffix(".safetensors")?.parse().ok()?;
            Some((epoch, path))
        })
        .collect();
    kept.sort();
    for (_, old) in kept.iter().rev().skip(keep) {
        std::fs::remove_file(old).with_context(|| format!("cannot remove the old checkpoint {}", old.display()))?;
    }
    Ok(())
}

/// Where the checkpoint of `run` lives in `dir`.
pub fn path_for(dir: &Path, run: &str) -> PathBuf {
    dir.join(format!("{run}.safetensors"))
}

/// One writer per run in a checkpoint folder: two jobs given the same `--checkpoint-dir` and run
/// would overwrite each other's checkpoints (the last writer wins), and with sharded checkpoints
/// one's pruning would delete the other's step folder in the middle of its commit. The writer
/// holds an advisory lock (`flock`) on `<dir>/<run>.lock`, which says who holds it; the kernel
/// releases it when the process ends, however it ends, so a killed run leaves no stale lock
/// (the file stays, unlocked).
pub struct RunLock {
    _file: std::fs::File,
}

impl RunLock {
    pub fn acquire(dir: &Path, run: &str) -> anyhow::Result<RunLock> {
        use std::io::{Read, Seek, Write};
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(format!("{run}.lock"));
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create checkpoint directory {}", dir.display()))?;
        crate::output::check_file(&path)?;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .with_context(|| format!("cannot open the run's lock {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {
                let host = crate::comm::hosts::this_host();
                file.set_len(0)
                    .and_then(|()| file.rewind())
                    .and_then(|()| writeln!(file, "{} {host}", std::process::id()))
                    .with_context(|| format!("cannot write the run's lock {}", path.display()))?;
                Ok(RunLock { _file: file })
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let mut words = holder.split_whitespace();
                let who = match (words.next(), words.next()) {
                    (Some(pid), Some(host)) => format!("process {pid} on {host}"),
                    (Some(pid), None) => format!("process {pid}"),
                    _ => "another process".to_string(),
                };
                crate::error::usage(format!(
                    "--checkpoint-dir {}: run {run} is being written there by {who} (it holds {}); two runs writing one run's checkpoints \
                     would overwrite each other: wait for it to end, or choose another --checkpoint-dir",
                    dir.display(),
                    path.display()
                ))
            }
            Err(std::fs::TryLockError::Error(err)) => Err(err).with_context(|| format!("cannot lock {}", path.display())),
        }
    }
}

/// Saves the model's variables (parameters and buffers) and the optimizer's state atomically.
pub fn save(path: &Path, vs: &nn::VarStore, optimizer: &dyn Optimizer, meta: &CheckpointMeta) -> anyhow::Result<()> {
    save_variables(path, vs.variables().into_iter().collect(), optimizer, meta)
}

/// [`save`] for a model whose variables are spread over several var stores (the stages of a
/// pipeline): `variables` by their whole-model names.
pub fn save_variables(path: &Path, variables: Vec<(String, Tensor)>, optimizer: &dyn Optimizer, meta: &CheckpointMeta) -> anyhow::Result<()> {
    save_tensors(path, variables, optimizer.state_tensors(), meta)
}

/// [`save`] of a model's `variables` and an optimizer's `state` gathered from wherever they
/// live (the ranks of a job), by their whole-model names.
pub fn save_tensors(path: &Path, variables: Vec<(String, Tensor)>, state: Vec<(String, Tensor)>, meta: &CheckpointMeta) -> anyhow::Result<()> {
    HostCheckpoint::new(variables, state, meta.clone())?.write(path)
}

/// A checkpoint's tensors copied to host memory, training free to change the originals: what a
/// background thread writes ([`HostCheckpoint::write`]).
pub struct HostCheckpoint {
    tensors: Vec<(String, CpuView)>,
    meta: CheckpointMeta,
}

impl HostCheckpoint {
    /// Copies `variables` and `state` (whole-model names) to host memory.
    pub fn new(variables: Vec<(String, Tensor)>, state: Vec<(String, Tensor)>, meta: CheckpointMeta) -> anyhow::Result<HostCheckpoint> {
        let named = variables
            .into_iter()
            .map(|(name, t)| (format!("{MODEL_PREFIX}{name}"), t))
            .chain(state.into_iter().map(|(name, t)| (format!("{OPTIM_PREFIX}{name}"), t)));
        let tensors = named
            .map(|(name, t)| Ok((name.clone(), CpuView::owned(&t).with_context(|| format!("cannot save tensor {name}"))?)))
            .collect::<anyhow::Result<_>>()?;
        Ok(HostCheckpoint { tensors, meta })
    }

    /// Bytes of tensor data.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|(_, view)| view.data_len()).sum()
    }

    /// Writes the checkpoint to `path` atomically (a temporary file, flushed, renamed over the
    /// old one, which is kept as its [`previous_path`]).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        let views = self.tensors.iter().map(|(name, view)| (name.as_str(), view));
        let metadata = HashMap::from([(METADATA_KEY.to_string(), serde_json::to_string(&self.meta)?)]);
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create checkpoint directory {}", dir.display()))?;
        crate::output::write_with(path, |tmp| {
            safetensors::serialize_to_file(views, Some(metadata), tmp)?;
            keep_previous(path).with_context(|| format!("cannot keep the previous checkpoint as {}", previous_path(path).display()))
        })
    }
}

/// Where the checkpoint that `path`'s newest replaced is kept.
pub fn previous_path(path: &Path) -> PathBuf {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("run");
    path.with_file_name(format!("{stem}.previous.safetensors"))
}

/// The checkpoint at `path`, about to be replaced, becomes its [`previous_path`] (a hard link:
/// no copy of the bytes; the rename that follows leaves the link's file alone).
fn keep_previous(path: &Path) -> anyhow::Result<()> {
    if !path.is_file() {
        return Ok(());
    }
    crate::output::second_name(path, &previous_path(path))
}

/// Removes the temporary files a killed writer of `path`'s checkpoint left beside it (as large
/// as the checkpoint; see [`crate::output::remove_stale_temporaries`]), so that a resumed run can
/// say what it removed. Returns what it removed.
pub fn remove_stale_temporaries(path: &Path) -> anyhow::Result<Vec<PathBuf>> {
    crate::output::remove_stale_temporaries(path)
}

/// A complete checkpoint found to resume from: one file, or a sharded checkpoint's folder.
pub struct Found {
    pub path: PathBuf,
    pub sharded: bool,
    pub meta: CheckpointMeta,
    /// Newer checkpoints that could not be read, passed over (to be said, never silently).
    pub warnings: Vec<String>,
}

/// The newest complete checkpoint of the run whose single-file checkpoint is `path`: that file
/// (or, torn or corrupt, the one it replaced) or the newest committed folder of its sharded
/// checkpoints (or, unreadable or a piece of it damaged, the one before: every piece's checksum
/// is checked, the checkpoint read once), whichever has taken more steps; none when the run has
/// none. `path` may also name a sharded checkpoint's folder, or a run's folder of them.
/// An error, naming the newest's problem, when none of its checkpoints can be read.
pub fn find_newest(path: &Path) -> anyhow::Result<Option<Found>> {
    let mut warnings = Vec::new();
    let (file, folder) = match path.is_dir() {
        true => (None, path.to_path_buf()),
        false => (Some(path), sharded::run_folder_of(path)),
    };
    let mut candidates: Vec<(PathBuf, bool)> = Vec::new();
    if let Some(file) = file.filter(|f| f.exists()) {
        candidates.extend([(file.to_path_buf(), false), (previous_path(file), false)]);
    }
    let mut newest: Option<Found> = None;
    let mut unreadable = Vec::new();
    for group in [candidates, sharded_candidates(&folder)] {
        let mut problem: Option<anyhow::Error> = None;
        for (candidate, is_sharded) in group.into_iter().filter(|(p, _)| p.exists()) {
            // A sharded checkpoint's checksums are all checked here: a damaged piece is passed
            // over to the checkpoint before, as a torn file is.
            let opened = match is_sharded {
                true => sharded::Source::open_sharded(&candidate).and_then(|source| source.verify_all().map(|()| source)),
                false => sharded::Source::open_whole(&candidate),
            };
            match opened {
                Ok(source) => {
                    if let Some(err) = problem.take() {
                        warnings.push(format!("{err:#}; resuming from the previous complete checkpoint {} instead", candidate.display()));
                    }
                    let found = Found { path: candidate, sharded: is_sharded, meta: source.meta, warnings: Vec::new() };
                    if newest.as_ref().is_none_or(|n| later(&found, n)) {
                        newest = Some(found);
                    }
                    break;
                }
                Err(err) => {
                    problem.get_or_insert(err);
                }
            }
        }
        unreadable.extend(problem);
    }
    let Some(newest) = newest else {
        return unreadable.into_iter().next().map_or(Ok(None), Err);
    };
    warnings.extend(unreadable.iter().map(|err| format!("{err:#}; resuming from {} instead", newest.path.display())));
    Ok(Some(Found { warnings, ..newest }))
}

/// A sharded run folder's committed checkpoints, newest first (or the folder itself, one).
fn sharded_candidates(folder: &Path) -> Vec<(PathBuf, bool)> {
    let folders = match folder.join(sharded::INDEX).exists() {
        true => vec![folder.to_path_buf()],
        false => sharded::committed(folder),
    };
    folders.into_iter().map(|f| (f, true)).collect()
}

/// Whether `a` was taken after `b`: more steps, or as many and written later.
fn later(a: &Found, b: &Found) -> bool {
    let written = |f: &Found| {
        let at = if f.sharded { f.path.join(sharded::INDEX) } else { f.path.clone() };
        std::fs::metadata(at).and_then(|m| m.modified()).ok()
    };
    (a.meta.step, a.meta.epoch, written(a)) > (b.meta.step, b.meta.epoch, written(b))
}

/// The newest complete checkpoint of run `run` in `dir`, one file or sharded (see
/// [`find_newest`]), with every tensor whole: to look at or compare checkpoints whatever layout
/// wrote them. A sharded one is put together in memory: for small models.
pub fn load_run(dir: &Path, run: &str) -> anyhow::Result<Checkpoint> {
    let path = path_for(dir, run);
    let found = find_newest(&path)?.with_context(|| format!("no checkpoint of {run} in {}", dir.display()))?;
    if !found.sharded {
        return load(&found.path);
    }
    let source = sharded::Source::open(&found.path)?;
    let tensors = source.keys().map(|key| Ok((key.to_string(), source.read_whole(key)?))).collect::<anyhow::Result<_>>()?;
    Ok(Checkpoint { meta: source.meta, tensors })
}

/// The end of the line about a checkpoint that is not a regular file.
pub(crate) const NOT_A_CHECKPOINT: &str = "a checkpoint is the file or folder a run's --checkpoint-dir holds";

/// Reads a checkpoint, checking its format.
pub fn load(path: &Path) -> anyhow::Result<Checkpoint> {
    let bytes = crate::input::read(path, u64::MAX, NOT_A_CHECKPOINT).context("cannot read the checkpoint")?;
    let corrupt = |what: &str| format!("checkpoint {} is corrupt or not a checkpoint: {what}", path.display());
    let (_, header) = crate::input::safetensors_metadata(&bytes).with_context(|| corrupt("bad safetensors header"))?;
    let meta_json = header.metadata().as_ref().and_then(|m| m.get(METADATA_KEY)).with_context(|| corrupt("no checkpoint metadata"))?;
    let meta: CheckpointMeta = crate::input::json(meta_json.as_bytes()).with_context(|| corrupt("unreadable metadata"))?;
    if meta.format != FORMAT_VERSION {
        anyhow::bail!("checkpoint {} has format {}, this build reads format {FORMAT_VERSION}", path.display(), meta.format);
    }
    let file = SafeTensors::deserialize(&bytes).with_context(|| corrupt("bad tensor data"))?;
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let tensor = Tensor::f_from_data_size(view.data(), &shape, kind_of(view.dtype())?).with_context(|| corrupt(&format!("tensor {name}")))?;
            Ok((name, tensor))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Checkpoint { meta, tensors })
}

/// A checkpoint whose weights hold NaN or infinity came from a run that diverged: evaluating it
/// would report a NaN loss as a result, resuming it would train NaN (`doing`: "evaluating" or
/// "resuming"). The error names the first such tensor.
pub fn non_finite(path: &Path, key: &str, tensor: &Tensor, doing: &str) -> anyhow::Result<()> {
    if tensor.is_floating_point() && tensor.numel() > 0 && tch::no_grad(|| tensor.isfinite().all().int64_value(&[])) == 0 {
        let name = key.strip_prefix(MODEL_PREFIX).unwrap_or(key);
        anyhow::bail!("checkpoint {} holds NaN or infinite values in {name}: the run that wrote it diverged; not {doing} it", path.display());
    }
    Ok(())
}

impl Checkpoint {
    /// [`non_finite`] over the model's tensors.
    pub fn check_finite_model(&self, path: &Path, doing: &str) -> anyhow::Result<()> {
        let mut keys: Vec<&String> = self.tensors.keys().filter(|k| k.starts_with(MODEL_PREFIX)).collect();
        keys.sort();
        keys.into_iter().try_for_each(|key| non_finite(path, key, &self.tensors[key], doing))
    }

    /// Copies the checkpoint into a freshly built model and optimizer. Fails, naming the
    /// file's model and this one, when the checkpoint was written for another model or shape.
    pub fn restore(&self, path: &Path, vs: &nn::VarStore, optimizer: &mut dyn Optimizer, model: &serde_json::Value) -> anyhow::Result<()> {
        self.restore_variables(path, vs.variables().into_iter().collect(), optimizer, model)
    }

    /// [`Checkpoint::restore`] into `variables` (whole-model names) spread over several var
    /// stores, e.g. the stages of a pipeline.
    pub fn restore_variables(
        &self,
        path: &Path,
        mut variables: Vec<(String, Tensor)>,
        optimizer: &mut dyn Optimizer,
        model: &serde_json::Value,
    ) -> anyhow::Result<()> {
        self.meta.check_model(path, model)?;
        let mut problems = Vec::new();
        variables.sort_by(|a, b| a.0.cmp(&b.0));
        tch::no_grad(|| {
            for (name, mut var) in variables {
                match self.tensors.get(&format!("{MODEL_PREFIX}{name}")) {
                    None => problems.push(format!("{name} missing")),
                    Some(saved) if saved.size() != var.size() => problems.push(format!("{name}: checkpoint {:?} vs model {:?}", saved.size(), var.size())),
                    Some(saved) => var.copy_(saved),
                }
            }
        });
        if !problems.is_empty() {
            anyhow::bail!("checkpoint {} does not fit this model: {}", path.display(), problems.join("; "));
        }
        let state: HashMap<String, Tensor> =
            self.tensors.iter().filter_map(|(name, t)| Some((name.strip_prefix(OPTIM_PREFIX)?.to_string(), t.shallow_clone()))).collect();
        optimizer.load_state_tensors(&state).with_context(|| format!("checkpoint {}: optimizer state does not fit", path.display()))
    }
}

impl CheckpointMeta {
    /// Fails, naming the checkpoint, when it was written for another model than `model`.
    /// Fails, naming the file, when the checkpoint was trained on other data than `data` says
    /// this run has, where both say (see [`CheckpointMeta::data`]): the same shapes would take
    /// it without complaint and go on with every word id meaning another word.
    pub fn check_data(&self, path: &Path, data: &serde_json::Value) -> anyhow::Result<()> {
        if !self.data.is_null() && !data.is_null() && &self.data != data {
            return crate::error::usage(format!(
                "checkpoint {} was trained on other data ({}) than this run reads ({}): its word ids would mean other words; \
                 use the same --data-dir and --tokenizer, or another --checkpoint-dir",
                path.display(),
                self.data,
                data
            ));
        }
        Ok(())
    }

    pub fn check_model(&self, path: &Path, model: &serde_json::Value) -> anyhow::Result<()> {
        if &self.model != model {
            anyhow::bail!(
                "checkpoint {} was written for model {}, but this run builds {}; use another --checkpoint-dir or the same flags",
                path.display(),
                self.model,
                model
            );
        }
        Ok(())
    }
}

impl Checkpoint {
    /// Fails, naming the file, when the checkpoint was written for another model than `model`.
    pub fn check_model(&self, path: &Path, model: &serde_json::Value) -> anyhow::Result<()> {
        self.meta.check_model(path, model)
    }

    /// The model variables named `names` and the optimizer state of the parameters among them:
    /// one rank's part of the checkpoint (a pipeline stage's), by whole-model names, as
    /// [`restore_part`] takes it. Fails, naming the file, on a variable it does not hold.
    pub fn part(&self, path: &Path, names: &[String]) -> anyhow::Result<Vec<(String, Tensor)>> {
        let wanted: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
        let mut part = Vec::new();
        let mut missing = Vec::new();
        for name in names {
            match self.tensors.get(&format!("{MODEL_PREFIX}{name}")) {
                Some(t) => part.push((format!("{MODEL_PREFIX}{name}"), t.shallow_clone())),
                None => missing.push(name.as_str()),
            }
        }
        if !missing.is_empty() {
            anyhow::bail!("checkpoint {} does not fit this model: {} missing", path.display(), missing.join(", "));
        }
        for (key, t) in &self.tensors {
            // Optimizer entries are `<entry>.<parameter name>`.
            let param = key.strip_prefix(OPTIM_PREFIX).and_then(|k| k.split_once('.')).map(|(_, p)| p);
            if param.is_some_and(|p| wanted.contains(p)) {
                part.push((key.clone(), t.shallow_clone()));
            }
        }
        Ok(part)
    }

    /// How many model variables the file holds (to check that the ranks' parts cover it).
    pub fn model_variables(&self) -> usize {
        self.tensors.keys().filter(|k| k.starts_with(MODEL_PREFIX)).count()
    }
}

/// Copies one rank's part of a checkpoint (from [`Checkpoint::part`]) into its `variables` and
/// optimizer; `what` names the file in errors.
/// `part` (as [`Checkpoint::part`] gives it: variables and optimizer state by their keys in the
/// file) with each tensor replaced by `map(name, tensor)`, `name` the variable's or the state
/// entry's own name (a tensor-parallel shard's cut of the whole tensors).
pub fn map_part(part: Vec<(String, Tensor)>, map: impl Fn(&str, Tensor) -> anyhow::Result<Tensor>) -> anyhow::Result<Vec<(String, Tensor)>> {
    part.into_iter()
        .map(|(key, t)| {
            let name = key.strip_prefix(MODEL_PREFIX).or_else(|| key.strip_prefix(OPTIM_PREFIX)).unwrap_or(&key);
            let mapped = map(name, t)?;
            Ok((key, mapped))
        })
        .collect()
}

/// The optimizer state of `part` (as [`Checkpoint::part`] gives it), by its entries' names.
pub fn part_state(part: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    part.iter().filter_map(|(k, t)| k.strip_prefix(OPTIM_PREFIX).map(|name| (name.to_string(), t.shallow_clone()))).collect()
}

pub fn restore_part(what: &str, part: Vec<(String, Tensor)>, variables: Vec<(String, Tensor)>, optimizer: &mut dyn Optimizer) -> anyhow::Result<()> {
    let mut model = HashMap::new();
    let mut state = HashMap::new();
    for (key, t) in part {
        if let Some(name) = key.strip_prefix(MODEL_PREFIX) {
            model.insert(name.to_string(), t);
        } else if let Some(name) = key.strip_prefix(OPTIM_PREFIX) {
            state.insert(name.to_string(), t);
        }
    }
    let mut problems = Vec::new();
    tch::no_grad(|| {
        for (name, mut var) in variables {
            match model.get(&name) {
                None => problems.push(format!("{name} missing")),
                Some(saved) if saved.size() != var.size() => problems.push(format!("{name}: checkpoint {:?} vs model {:?}", saved.size(), var.size())),
                Some(saved) => var.copy_(saved),
            }
        }
    });
    if !problems.is_empty() {
        anyhow::bail!("checkpoint {what} does not fit this model: {}", problems.join("; "));
    }
    optimizer.load_state_tensors(&state).with_context(|| format!("checkpoint {what}: optimizer state does not fit"))
}

fn kind_of(dtype: Dtype) -> anyhow::Result<Kind> {
    Ok(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        other => anyhow::bail!("unsupported tensor type {other:?}"),
    })
}

fn dtype_of(kind: Kind) -> anyhow::Result<Dtype> {
    Ok(match kind {
        Kind::Bool => Dtype::BOOL,
        Kind::Uint8 => Dtype::U8,
        Kind::Int => Dtype::I32,
        Kind::Int64 => Dtype::I64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        other => anyhow::bail!("unsupported tensor type {other:?}"),
    })
}

/// A tensor copied to contiguous CPU memory, as safetensors wants to see it.
struct CpuView {
    tensor: Tensor,
    shape: Vec<usize>,
    dtype: Dtype,
}

impl CpuView {
    /// A copy of `tensor` of its own on the host (a CPU tensor is copied too: training goes on
    /// changing it while the copy is written).
    fn owned(tensor: &Tensor) -> anyhow::Result<Self> {
        let tensor = match tensor.device() {
            Device::Cpu => tensor.detach().copy().contiguous(),
            _ => tensor.detach().to_device(Device::Cpu).contiguous(),
        };
        let shape = tensor.size().iter().map(|&d| d as usize).collect();
        Ok(CpuView { dtype: dtype_of(tensor.kind())?, tensor, shape })
    }
}

impl CpuView {
    /// CRC-32C of the bytes the view writes (kept in sharded checkpoints, checked when read).
    pub(crate) fn crc32c(&self) -> u32 {
        let len = self.data_len();
        if len == 0 {
            return crc32c::crc32c(&[]);
        }
        // SAFETY: `tensor` is a contiguous CPU tensor of its own, `len` bytes long, alive and
        // unchanged while the slice is read.
        let bytes = unsafe { std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, len) };
        crc32c::crc32c(bytes)
    }
}

impl View for &CpuView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let mut bytes = vec![0u8; self.data_len()];
        self.tensor.copy_data_u8(&mut bytes, self.tensor.numel());
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()
    }
}
