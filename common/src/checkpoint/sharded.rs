//! Sharded checkpoints: every rank writes only what it owns, and any layout reads them.
//!
//! A checkpoint is a folder `<dir>/<run>.shards/step-<S>/`: one safetensors file per rank
//! (`rank-<r>.safetensors`: the pieces it owns, each piece's whole shape and [`Region`] in its
//! header), written by the ranks in parallel, and `checkpoint.json`, written last by rank 0 once
//! every rank's file is complete: the commit point (as PyTorch's distributed checkpoint writes
//! its `.metadata` last). The index lists, for every tensor under its whole-model key
//! (`model.<variable>`, `optim.<entry>.<variable>`), its whole shape and where its pieces are.
//! A folder without an index is a checkpoint whose writing was interrupted: never read, removed
//! at the next start. The newest committed folder and the one before it are kept.
//!
//! Reading ([`Source`]) maps the files and copies, for the region a rank asks for, the elements
//! of the pieces that overlap it: a rank of any layout reads only the slices it needs, and no
//! rank holds more than its own part. A single-file checkpoint is read the same way (one file
//! whose pieces are whole), so either format resumes on any layout.
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use safetensors::tensor::{Metadata, View};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::region::Region;
use super::{kind_of, CheckpointMeta, CpuView, FORMAT_VERSION, METADATA_KEY, MODEL_PREFIX};

/// The index file, written last: a folder holding it is a complete checkpoint.
pub const INDEX: &str = "checkpoint.json";
/// The key, in a rank file's header, of its pieces' shapes and regions.
const PIECES_KEY: &str = "pieces";

/// Part of a whole-model tensor that a rank owns, to be written: `tensor` holds the elements of
/// `region` of a whole tensor of `shape`, in the region's order.
pub struct Piece {
    /// `model.<variable>` or `optim.<entry>.<variable>`.
    pub key: String,
    pub shape: Vec<i64>,
    pub region: Region,
    pub tensor: Tensor,
}

impl Piece {
    pub fn model(name: &str, shape: Vec<i64>, region: Region, tensor: Tensor) -> Piece {
        Piece { key: format!("{MODEL_PREFIX}{name}"), shape, region, tensor }
    }

    /// Optimizer state `name` (`<entry>.<variable>`).
    pub fn state(name: &str, shape: Vec<i64>, region: Region, tensor: Tensor) -> Piece {
        Piece { key: format!("{}{name}", super::OPTIM_PREFIX), shape, region, tensor }
    }
}

/// What a rank file's header says of one piece.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PieceInfo {
    shape: Vec<i64>,
    region: Region,
    /// CRC-32C of the piece's stored bytes (absent in checkpoints written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32c: Option<u32>,
}

/// The commit file's content.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Index {
    meta: CheckpointMeta,
    /// Rank files, `rank-<r>.safetensors` for r below this.
    ranks: usize,
    tensors: BTreeMap<String, TensorEntry>,
}

/// One whole-model tensor: its shape and where its pieces are.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TensorEntry {
    shape: Vec<i64>,
    pieces: Vec<PieceRef>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct PieceRef {
    file: String,
    region: Region,
    /// The piece's [`PieceInfo::crc32c`], checked when the piece is read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    crc32c: Option<u32>,
}

/// Where run `run`'s sharded checkpoints live in `dir`.
pub fn run_folder(dir: &Path, run: &str) -> PathBuf {
    dir.join(format!("{run}.shards"))
}

/// The folder of the sharded checkpoints of the run whose single-file checkpoint is `path`
/// (`<run>.safetensors` → `<run>.shards`).
pub fn run_folder_of(path: &Path) -> PathBuf {
    path.with_extension("shards")
}

/// The folder of the checkpoint after optimizer step `step`.
pub fn step_folder(run_folder: &Path, step: usize) -> PathBuf {
    run_folder.join(format!("step-{step:09}"))
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// One rank's pieces copied to host memory (training free to change the originals), to be
/// written by a background thread.
pub struct HostShard {
    pieces: Vec<(String, PieceInfo, CpuView)>,
}

impl HostShard {
    pub fn new(pieces: Vec<Piece>) -> Result<HostShard> {
        let pieces = pieces
            .into_iter()
            .map(|p| {
                let view = CpuView::owned(&p.tensor).with_context(|| format!("cannot save tensor {}", p.key))?;
                ensure!(
                    view.tensor.numel() as i64 == p.region.numel(&p.shape),
                    "{}: {} elements for a region of {}",
                    p.key,
                    view.tensor.numel(),
                    p.region.numel(&p.shape)
                );
                let crc32c = Some(view.crc32c());
                Ok((p.key, PieceInfo { shape: p.shape, region: p.region, crc32c }, view))
            })
            .collect::<Result<_>>()?;
        Ok(HostShard { pieces })
    }

    /// Bytes of tensor data.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|(_, _, view)| (&view).data_len()).sum()
    }

    /// Writes this rank's file into `folder` atomically.
    pub fn write(&self, folder: &Path, rank: usize) -> Result<()> {
        // The run's folder of checkpoints and its step folder are named by the run: never links.
        if let Some(run_folder) = folder.parent() {
            crate::output::folder(run_folder).context("cannot create the checkpoint's folder")?;
        }
        crate::output::folder(folder).context("cannot create the checkpoint's folder")?;
        let infos: BTreeMap<&str, &PieceInfo> = self.pieces.iter().map(|(key, info, _)| (key.as_str(), info)).collect();
        let metadata = HashMap::from([(PIECES_KEY.to_string(), serde_json::to_string(&infos)?)]);
        let views = self.pieces.iter().map(|(key, _, view)| (key.as_str(), view));
        let path = folder.join(rank_file(rank));
        crate::output::write_with(&path, |tmp| Ok(safetensors::serialize_to_file(views, Some(metadata), tmp)?))
    }
}

/// Commits the checkpoint in `folder` that `ranks` ranks wrote (rank 0, once every rank's file is
/// complete): reads their headers, checks that the pieces cover every tensor exactly, and writes
/// the index. Then removes the run's older checkpoints but the newest one before this.
pub fn commit(folder: &Path, ranks: usize, meta: &CheckpointMeta) -> Result<()> {
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for rank in 0..ranks {
        let file = rank_file(rank);
        let (_, header) = MappedFile::open(&folder.join(&file))?.header()?;
        let infos: BTreeMap<String, PieceInfo> = match header.metadata().as_ref().and_then(|m| m.get(PIECES_KEY)) {
            Some(json) => crate::input::json(json.as_bytes()).with_context(|| format!("{}: unreadable piece list", folder.join(&file).display()))?,
            None => anyhow::bail!("{} is not a checkpoint shard (no piece list)", folder.join(&file).display()),
        };
        for (key, info) in infos {
            let entry = tensors.entry(key.clone()).or_insert_with(|| TensorEntry { shape: info.shape.clone(), pieces: Vec::new() });
            ensure!(entry.shape == info.shape, "{key}: rank {rank} holds a piece of a {:?} tensor, another of a {:?} one", info.shape, entry.shape);
            entry.pieces.push(PieceRef { file: file.clone(), region: info.region, crc32c: info.crc32c });
        }
    }
    for (key, entry) in &tensors {
        check_tiling(key, entry).map_err(|why| anyhow::anyhow!("the ranks' pieces of {key} {why}: the layout wrote overlapping or missing parts"))?;
    }
    let index = Index { meta: meta.clone(), ranks, tensors };
    crate::output::write(&folder.join(INDEX), serde_json::to_string(&index)?.as_bytes())?;
    if let Some(run_folder) = folder.parent() {
        prune(run_folder, folder)?;
    }
    Ok(())
}

/// Whether `entry`'s pieces hold every element of its tensor exactly once, each within the
/// tensor: why not, if they do not.
fn check_tiling(key: &str, entry: &TensorEntry) -> std::result::Result<(), String> {
    if let Some(why) = entry.pieces.iter().find_map(|p| p.region.misfit(&entry.shape)) {
        return Err(format!("have a piece that does not fit ({why}) in {key}"));
    }
    let mut runs: Vec<(i64, i64)> = entry.pieces.iter().flat_map(|p| p.region.runs(&entry.shape)).collect();
    runs.sort_unstable();
    // Every element exactly once: the runs, in order, each start where the last ended.
    let mut end = 0;
    for (first, len) in runs {
        if first != end {
            return Err(format!("leave out or repeat the elements from {}", first.min(end)));
        }
        end = first + len;
    }
    let whole: i64 = entry.shape.iter().product();
    if end != whole {
        return Err(format!("end at element {end} of {whole}"));
    }
    Ok(())
}

/// Keeps the committed checkpoint in `folder` as the copy of epoch `epoch`,
/// `<run>.shards/epoch-<E>/` beside the step folders (hard links: no second copy of the bytes),
/// and removes all but the `keep` newest such copies (`--keep-checkpoints`).
pub fn keep_epoch_copy(folder: &Path, epoch: usize, keep: usize) -> Result<()> {
    let run_folder = folder.parent().unwrap_or(Path::new("."));
    let copy = run_folder.join(format!("epoch-{epoch:06}"));
    // (remove_dir_all removes a link at the name, never what it points to.)
    if std::fs::symlink_metadata(&copy).is_ok() {
        std::fs::remove_dir_all(&copy).with_context(|| format!("cannot replace {}", copy.display()))?;
    }
    crate::output::folder(&copy).with_context(|| format!("cannot keep the checkpoint of epoch {epoch}"))?;
    for entry in std::fs::read_dir(folder).with_context(|| format!("cannot list {}", folder.display()))?.flatten() {
        crate::output::second_name(&entry.path(), &copy.join(entry.file_name())).with_context(|| format!("cannot keep the checkpoint of epoch {epoch}"))?;
    }
    let mut kept: Vec<PathBuf> = std::fs::read_dir(run_folder)
        .with_context(|| format!("cannot list {}", run_folder.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("epoch-")))
        .collect();
    kept.sort();
    for old in kept.iter().rev().skip(keep) {
        std::fs::remove_dir_all(old).with_context(|| format!("cannot remove the old checkpoint {}", old.display()))?;
    }
    Ok(())
}

/// The committed checkpoints in `run_folder`, newest (highest step) first.
pub fn committed(run_folder: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = step_folders(run_folder).into_iter().filter(|f| f.join(INDEX).exists()).collect();
    found.sort();
    found.reverse();
    found
}

fn step_folders(run_folder: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(run_folder) else { return Vec::new() };
    entries.flatten().map(|e| e.path()).filter(|p| p.is_dir() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("step-"))).collect()
}

/// Keeps `newest` and the committed checkpoint before it; removes the rest (older committed
/// ones, and interrupted ones, which no one reads).
fn prune(run_folder: &Path, newest: &Path) -> Result<()> {
    let previous = committed(run_folder).into_iter().find(|f| f.as_path() != newest);
    for folder in step_folders(run_folder) {
        if folder.as_path() != newest && Some(&folder) != previous.as_ref() {
            std::fs::remove_dir_all(&folder).with_context(|| format!("cannot remove the old checkpoint {}", folder.display()))?;
        }
    }
    Ok(())
}

/// Removes the checkpoint folders of `run_folder` whose writing was interrupted (no index):
/// what a killed job left. Returns them.
pub fn remove_interrupted(run_folder: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for folder in step_folders(run_folder) {
        if !folder.join(INDEX).exists() {
            std::fs::remove_dir_all(&folder).with_context(|| format!("cannot remove the interrupted checkpoint {}", folder.display()))?;
            removed.push(folder);
        }
    }
    Ok(removed)
}

/// A checkpoint file mapped into memory: its pages are read when a slice of them is.
struct MappedFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

impl MappedFile {
    fn open(path: &Path) -> Result<MappedFile> {
        let file = crate::input::open(path, super::NOT_A_CHECKPOINT).context("cannot read the checkpoint")?;
        // SAFETY: checkpoint files are written to a temporary name and renamed, never changed in
        // place, so the mapped bytes stay as they are while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map checkpoint {}", path.display()))?;
        Ok(MappedFile { path: path.to_path_buf(), map })
    }

    /// The header's length and content; an error naming the file when it is torn or not a
    /// safetensors file.
    fn header(&self) -> Result<(usize, Metadata)> {
        crate::input::safetensors_metadata(&self.map).map_err(|e| anyhow::anyhow!("checkpoint {} is corrupt or not a checkpoint: {e}", self.path.display()))
    }
}

/// A file of a [`Source`], mapped, its header parsed.
struct OpenFile {
    file: MappedFile,
    data_start: usize,
    header: Metadata,
}

/// A checkpoint to read from, single-file or sharded: its progress, and every tensor's parts.
pub struct Source {
    pub meta: CheckpointMeta,
    /// What the checkpoint is, for messages (the file or the folder).
    pub path: PathBuf,
    root: PathBuf,
    tensors: BTreeMap<String, TensorEntry>,
    files: RefCell<HashMap<String, std::rc::Rc<OpenFile>>>,
    /// Bytes of tensor data read so far: what this rank took of the checkpoint.
    read_bytes: std::cell::Cell<u64>,
    /// The (file, key) pieces whose checksums were checked.
    verified: RefCell<std::collections::HashSet<(String, String)>>,
    /// Set by [`Source::refuse_non_finite_model`]: what the reader does with the checkpoint.
    finite_model_for: Option<&'static str>,
}

impl Source {
    /// What `path` is to this checkpoint's run, where writing it would destroy part of the run's
    /// checkpoints: the checkpoint itself, a file in its folder, or a file of the run beside it
    /// (`<run>.safetensors`, `<run>.previous.safetensors`, `<run>-epoch3.safetensors`,
    /// `<run>.shards/...`). Links and `..` resolved; None for any other path.
    pub fn owns(&self, path: &Path) -> Option<String> {
        let resolve = |p: &Path| -> Option<PathBuf> {
            p.canonicalize().ok().or_else(|| {
                let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
                Some(parent.canonicalize().ok()?.join(p.file_name()?))
            })
        };
        let (target, checkpoint) = (resolve(path)?, resolve(&self.path)?);
        if target == checkpoint {
            return Some(format!("the checkpoint being exported ({})", self.path.display()));
        }
        if target.starts_with(&checkpoint) {
            return Some(format!("inside the checkpoint being exported ({})", self.path.display()));
        }
        // The run's folder: a single file's, or the one holding `<run>.shards/`.
        let run_folder = match checkpoint.parent() {
            Some(parent) if parent.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".shards")) => parent.parent()?.to_path_buf(),
            Some(parent) => parent.to_path_buf(),
            None => return None,
        };
        let relative = target.strip_prefix(&run_folder).ok()?;
        let first = relative.components().next()?.as_os_str().to_string_lossy().into_owned();
        let run = &self.meta.run;
        let of_run = first.strip_prefix(run.as_str()).is_some_and(|rest| rest.starts_with('.') || rest.starts_with('-'));
        of_run.then(|| format!("a checkpoint file of run {run} in {}", run_folder.display()))
    }

    /// The checkpoint at `path`: a sharded checkpoint's folder, or a single file.
    pub fn open(path: &Path) -> Result<Source> {
        match path.is_dir() {
            true => Source::open_sharded(path),
            false => Source::open_whole(path),
        }
    }

    /// The sharded checkpoint in `folder` (a step folder with its index). Every rank file's
    /// header is read: a file missing or torn is an error here, not in the middle of reading.
    pub fn open_sharded(folder: &Path) -> Result<Source> {
        let index_path = folder.join(INDEX);
        let json = crate::input::read(&index_path, 256 << 20, super::NOT_A_CHECKPOINT).context("cannot read the checkpoint index")?;
        let index: Index = crate::input::json(&json).with_context(|| format!("checkpoint index {} is corrupt", index_path.display()))?;
        check_format(&index.meta, folder)?;
        // An index is a file anyone with access to the folder may have changed: its pieces must
        // name this checkpoint's own rank files and tile each tensor exactly.
        let files: std::collections::HashSet<String> = (0..index.ranks).map(rank_file).collect();
        for (key, entry) in &index.tensors {
            if let Some(piece) = entry.pieces.iter().find(|p| !files.contains(&p.file)) {
                anyhow::bail!("checkpoint index {} is corrupt: {key} names {:?}, not one of its {} rank files", index_path.display(), piece.file, index.ranks);
            }
            check_tiling(key, entry).map_err(|why| anyhow::anyhow!("checkpoint index {} is corrupt: the pieces of {key} {why}", index_path.display()))?;
        }
        let source = Source {
            meta: index.meta,
            path: folder.to_path_buf(),
            root: folder.to_path_buf(),
            tensors: index.tensors,
            files: RefCell::default(),
            read_bytes: Default::default(),
            verified: RefCell::default(),
            finite_model_for: None,
        };
        for rank in 0..index.ranks {
            source.file(&rank_file(rank))?;
        }
        Ok(source)
    }

    /// A single-file checkpoint, read as one whose every piece is whole.
    pub fn open_whole(path: &Path) -> Result<Source> {
        let file = MappedFile::open(path)?;
        let (_, header) = file.header()?;
        let meta_json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(METADATA_KEY))
            .with_context(|| format!("checkpoint {} is corrupt or not a checkpoint: no checkpoint metadata", path.display()))?;
        let meta: CheckpointMeta = crate::input::json(meta_json.as_bytes())
            .with_context(|| format!("checkpoint {} is corrupt or not a checkpoint: unreadable metadata", path.display()))?;
        check_format(&meta, path)?;
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        let tensors = header
            .tensors()
            .into_iter()
            .map(|(key, info)| {
                let shape = info.shape.iter().map(|&d| d as i64).collect();
                (key, TensorEntry { shape, pieces: vec![PieceRef { file: name.clone(), region: Region::WHOLE, crc32c: None }] })
            })
            .collect();
        let root = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        Ok(Source {
            meta,
            path: path.to_path_buf(),
            root,
            tensors,
            files: RefCell::default(),
            read_bytes: Default::default(),
            verified: RefCell::default(),
            finite_model_for: None,
        })
    }

    /// "one file", or "sharded: N rank files"; and its tensors' bytes.
    pub fn describe(&self) -> String {
        let files: std::collections::BTreeSet<&str> = self.tensors.values().flat_map(|e| e.pieces.iter().map(|p| p.file.as_str())).collect();
        let bytes: u64 =
            self.tensors.keys().filter_map(|k| Some(self.shape(k)?.iter().product::<i64>() as u64 * self.dtype(k).ok()?.bitsize() as u64 / 8)).sum();
        let layout = if self.path.is_dir() { format!("sharded: {} rank files", files.len()) } else { "one file".to_string() };
        format!("{layout}, {} tensors, {:.1} MiB", self.tensors.len(), bytes as f64 / (1 << 20) as f64)
    }

    /// Every tensor's key (`model.<variable>`, `optim.<entry>.<variable>`).
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The whole shape of the tensor `key`; none when the checkpoint has no such tensor.
    pub fn shape(&self, key: &str) -> Option<&[i64]> {
        self.tensors.get(key).map(|e| e.shape.as_slice())
    }

    /// The elements `region` names of the whole tensor `key`, in the region's shape (the cut's,
    /// or a flat range's length), gathered from the pieces that hold them.
    pub fn read(&self, key: &str, region: Region) -> Result<Tensor> {
        let entry = self.tensors.get(key).with_context(|| format!("checkpoint {} has no {key}", self.path.display()))?;
        let want = Wanted { region, shape: &entry.shape, range: region.contiguous(&entry.shape), positions: RefCell::default() };
        let wanted = region.numel(&entry.shape);
        let mut out: Option<Tensor> = None;
        let mut covered = 0;
        for piece in &entry.pieces {
            let file = self.file(&piece.file)?;
            let (bytes, dtype) = self.piece_bytes(&file, key, piece)?;
            let kind = kind_of(dtype)?;
            let expected = piece.region.numel(&entry.shape) as usize * kind.elt_size_in_bytes();
            ensure!(
                bytes.len() == expected,
                "checkpoint {}: {} holds {} bytes of {key}, its region needs {expected}",
                self.path.display(),
                piece.file,
                bytes.len()
            );
            self.verify(piece, key, bytes)?;
            let stored = Stored { bytes, kind, region: piece.region, read: &self.read_bytes };
            let out = out.get_or_insert_with(|| Tensor::zeros([wanted], (stored.kind, Device::Cpu)));
            covered += stored.copy_into(out, &want)?;
        }
        ensure!(
            covered == wanted,
            "checkpoint {}: its pieces of {key} hold {covered} of the {wanted} elements asked for ({region:?} of {:?})",
            self.path.display(),
            entry.shape
        );
        let out = out.unwrap_or_else(|| Tensor::zeros([0], (Kind::Float, Device::Cpu)));
        if let (Some(doing), true) = (self.finite_model_for, key.starts_with(MODEL_PREFIX)) {
            super::non_finite(&self.path, key, &out, doing)?;
        }
        Ok(out.view(region.local_shape(&entry.shape).as_slice()))
    }

    /// Bytes of tensor data read from the checkpoint so far.
    pub fn read_bytes(&self) -> u64 {
        self.read_bytes.get()
    }

    /// The type of the tensor `key`'s elements (its first piece's).
    pub fn dtype(&self, key: &str) -> Result<safetensors::Dtype> {
        let entry = self.tensors.get(key).with_context(|| format!("checkpoint {} has no {key}", self.path.display()))?;
        let piece = entry.pieces.first().with_context(|| format!("checkpoint {}: no piece of {key}", self.path.display()))?;
        let file = self.file(&piece.file)?;
        Ok(file.header.info(key).with_context(|| format!("checkpoint {}: {} has no {key}", self.path.display(), piece.file))?.dtype)
    }

    /// The whole tensor `key`.
    pub fn read_whole(&self, key: &str) -> Result<Tensor> {
        self.read(key, Region::WHOLE)
    }

    /// From now on, a model tensor read with a NaN or infinity in it is an error
    /// ([`super::non_finite`]; `doing`: "evaluating" or "resuming").
    pub fn refuse_non_finite_model(&mut self, doing: &'static str) {
        self.finite_model_for = Some(doing);
    }

    /// The stored bytes of `key`'s piece `piece` in `file`, and their type.
    fn piece_bytes<'f>(&self, file: &'f OpenFile, key: &str, piece: &PieceRef) -> Result<(&'f [u8], safetensors::Dtype)> {
        let info = file.header.info(key).with_context(|| format!("checkpoint {}: {} has no {key}", self.path.display(), piece.file))?;
        let (begin, end) = (file.data_start + info.data_offsets.0, file.data_start + info.data_offsets.1);
        let bytes = file.file.map.get(begin..end).with_context(|| format!("checkpoint {}: {key} lies past the end of {}", self.path.display(), piece.file))?;
        Ok((bytes, info.dtype))
    }

    /// Checks every piece that has a checksum (a sharded checkpoint's) against it, reading the
    /// whole checkpoint once: a flipped byte anywhere is an error here, where the reader can
    /// still take the checkpoint before ([`super::find_newest`]), not half-way through restoring
    /// a model that every rank reads its own part of.
    pub fn verify_all(&self) -> Result<()> {
        for (key, entry) in &self.tensors {
            for piece in entry.pieces.iter().filter(|p| p.crc32c.is_some()) {
                let file = self.file(&piece.file)?;
                let (bytes, _) = self.piece_bytes(&file, key, piece)?;
                self.verify(piece, key, bytes)?;
            }
        }
        Ok(())
    }

    /// Checks a piece's bytes against the checksum its writer kept, the first time it is read:
    /// a flipped bit on a disk or in a copy is an error naming the piece, not a model trained on.
    fn verify(&self, piece: &PieceRef, key: &str, bytes: &[u8]) -> Result<()> {
        let Some(expected) = piece.crc32c else { return Ok(()) };
        if self.verified.borrow().contains(&(piece.file.clone(), key.to_string())) {
            return Ok(());
        }
        let found = crc32c::crc32c(bytes);
        ensure!(found == expected, "checkpoint {}: {key} in {} is damaged (checksum {found:08x}, written as {expected:08x})", self.path.display(), piece.file);
        self.verified.borrow_mut().insert((piece.file.clone(), key.to_string()));
        Ok(())
    }

    fn file(&self, name: &str) -> Result<std::rc::Rc<OpenFile>> {
        if let Some(open) = self.files.borrow().get(name) {
            return Ok(open.clone());
        }
        let file = MappedFile::open(&self.root.join(name))?;
        let (header_len, header) = file.header()?;
        let open = std::rc::Rc::new(OpenFile { file, data_start: 8 + header_len, header });
        self.files.borrow_mut().insert(name.to_string(), open.clone());
        Ok(open)
    }
}

/// What a rank asks of one tensor: a region of a whole tensor of `shape`, its elements'
/// positions listed only when a piece needs them.
struct Wanted<'s> {
    region: Region,
    shape: &'s [i64],
    /// `[first, end)` where the region's elements are consecutive.
    range: Option<(i64, i64)>,
    positions: RefCell<Option<Tensor>>,
}

impl Wanted<'_> {
    fn positions(&self) -> Tensor {
        self.positions.borrow_mut().get_or_insert_with(|| self.region.positions(self.shape)).shallow_clone()
    }
}

/// One piece of a tensor in a mapped file: its elements' bytes, of `kind`, in `region`'s order.
struct Stored<'f> {
    bytes: &'f [u8],
    kind: Kind,
    region: Region,
    /// The source's count of bytes read.
    read: &'f std::cell::Cell<u64>,
}

impl Stored<'_> {
    /// The piece's elements as a tensor over the mapped bytes (no copy), where they are aligned
    /// for their type; none where the piece sits at an odd offset (after a byte-sized tensor).
    ///
    /// SAFETY (of the callers' use): the mapping outlives the view (the source holds it) and is
    /// never written; every caller only copies out of the view and drops it before returning.
    fn view(&self) -> Result<Option<Tensor>> {
        let size = self.kind.elt_size_in_bytes();
        if !(self.bytes.as_ptr() as usize).is_multiple_of(size) {
            return Ok(None);
        }
        // SAFETY: see above; `bytes` holds `len / size` elements of `kind`.
        Ok(Some(unsafe { Tensor::f_from_blob(self.bytes.as_ptr(), &[(self.bytes.len() / size) as i64], &[1], self.kind, Device::Cpu)? }))
    }

    /// `count` elements of `bytes` from `first`, copied from the file (a copy of their own).
    fn copied(&self, first: i64, count: i64) -> Result<Tensor> {
        let size = self.kind.elt_size_in_bytes();
        Ok(Tensor::f_from_data_size(&self.bytes[first as usize * size..(first + count) as usize * size], &[count], self.kind)?)
    }

    /// Copies the piece's elements `[first, first + count)` into `out` (as many); only their
    /// bytes are read.
    fn copy_range(&self, out: &Tensor, first: i64, count: i64) -> Result<()> {
        self.read.set(self.read.get() + (count as usize * self.kind.elt_size_in_bytes()) as u64);
        let source = match self.view()? {
            Some(view) => view.narrow(0, first, count),
            None => self.copied(first, count)?,
        };
        Ok(out.shallow_clone().f_copy_(&source)?)
    }

    /// The piece's elements at `index` (increasing positions in the piece), copied out: only
    /// they are copied and only their pages read, never the span between them.
    fn gather(&self, index: &Tensor) -> Result<Tensor> {
        let count = index.numel() as i64;
        self.read.set(self.read.get() + (count as usize * self.kind.elt_size_in_bytes()) as u64);
        if let Some(view) = self.view()? {
            return Ok(view.f_index_select(0, index)?);
        }
        let (first, last) = (index.int64_value(&[0]), index.int64_value(&[count - 1]));
        Ok(self.copied(first, last - first + 1)?.f_index_select(0, &(index - first))?)
    }

    /// Copies the elements of `want` this piece holds into `out` (flat, in `want`'s order);
    /// returns how many.
    fn copy_into(&self, out: &Tensor, want: &Wanted) -> Result<i64> {
        match (self.region.contiguous(want.shape), want.range) {
            // Both consecutive: one overlapping range.
            (Some((at, len)), Some((want_at, want_len))) => {
                let (lo, hi) = (at.max(want_at), (at + len).min(want_at + want_len));
                if lo >= hi {
                    return Ok(0);
                }
                self.copy_range(&out.narrow(0, lo - want_at, hi - lo), lo - at, hi - lo)?;
                Ok(hi - lo)
            }
            // The piece consecutive: the wanted positions inside its range.
            (Some((at, len)), None) => {
                let positions = want.positions();
                let bounds = Tensor::from_slice(&[at, at + len]);
                let ends = Vec::<i64>::try_from(bounds.searchsorted(&positions, false, false, "left", None::<Tensor>))?;
                let (lo, count) = (ends[0], ends[1] - ends[0]);
                if count == 0 {
                    return Ok(0);
                }
                out.narrow(0, lo, count).copy_(&self.gather(&(positions.narrow(0, lo, count) - at))?);
                Ok(count)
            }
            // A cut that is not consecutive (another layout's tensor-parallel shard): its
            // elements matched to the wanted ones by position.
            (None, _) => {
                let (held, positions) = (self.region.positions(want.shape), want.positions());
                // (tch's `a.searchsorted(sorted)`: where each of `a` sits in `sorted`.)
                let at = positions.searchsorted(&held, false, false, "left", None::<Tensor>).clamp_max(held.numel() as i64 - 1);
                let found = held.index_select(0, &at).eq_tensor(&positions).nonzero().squeeze_dim(1);
                if found.numel() == 0 {
                    return Ok(0);
                }
                let _ = out.shallow_clone().index_copy_(0, &found, &self.gather(&at.index_select(0, &found))?);
                Ok(found.numel() as i64)
            }
        }
    }
}

fn check_format(meta: &CheckpointMeta, path: &Path) -> Result<()> {
    ensure!(meta.format == FORMAT_VERSION, "checkpoint {} has format {}, this build reads format {FORMAT_VERSION}", path.display(), meta.format);
    Ok(())
}

/// Writes the model of the checkpoint `source` as one safetensors file of whole tensors under
/// their torch names (`conv1.weight`, no prefix, no optimizer state): what `--weights` and
/// PyTorch's `safetensors.torch.load_file` read. One tensor is in memory at a time. Returns the
/// number of tensors written.
pub fn export_model(source: &Source, out: &Path) -> Result<usize> {
    if let Some(what) = source.owns(out) {
        return crate::error::usage(format!("{} is {what}: exporting there would replace what the export reads; choose another file", out.display()));
    }
    /// A tensor read when the writer asks for its bytes; a read that fails is kept and fails the
    /// export (`View` cannot return an error), the output then never committed.
    struct Lazy<'s> {
        source: &'s Source,
        key: String,
        shape: Vec<usize>,
        dtype: safetensors::Dtype,
        failed: &'s RefCell<Option<anyhow::Error>>,
    }
    impl safetensors::View for &Lazy<'_> {
        fn dtype(&self) -> safetensors::Dtype {
            self.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.shape
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            let mut bytes = vec![0u8; self.data_len()];
            match self.source.read_whole(&self.key) {
                Ok(whole) => whole.contiguous().copy_data_u8(&mut bytes, whole.numel()),
                Err(err) => {
                    self.failed.borrow_mut().get_or_insert(err);
                }
            }
            std::borrow::Cow::Owned(bytes)
        }
        fn data_len(&self) -> usize {
            self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
        }
    }
    let failed = RefCell::new(None);
    let mut lazies = Vec::new();
    for key in source.keys().filter(|k| k.starts_with(MODEL_PREFIX)) {
        let shape = source.shape(key).unwrap_or_default().iter().map(|&d| d as usize).collect();
        let dtype = source.dtype(key)?;
        lazies.push((key[MODEL_PREFIX.len()..].to_string(), Lazy { source, key: key.to_string(), shape, dtype, failed: &failed }));
    }
    let count = lazies.len();
    let views = lazies.iter().map(|(name, lazy)| (name.as_str(), lazy));
    crate::output::write_with(out, |tmp| {
        safetensors::serialize_to_file(views, None, tmp)?;
        failed.take().map_or(Ok(()), Err)
    })?;
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::tensor_parallel::{shard_tensor, Shard, Split};

    fn meta() -> CheckpointMeta {
        CheckpointMeta {
            format: FORMAT_VERSION,
            run: "run".into(),
            model: serde_json::json!({}),
            optimizer: "sgd".into(),
            epoch: 0,
            step: 1,
            epoch_step: 0,
            seed: 0,
            config: serde_json::json!({}),
            torch_version: String::new(),
            grad_scaler: None,
            data: serde_json::Value::Null,
            examples_per_step: 0,
        }
    }

    /// Writes `whole` cut as `split` over 2 ranks (rank r's file holds shard r), with a byte
    /// tensor beside it, and commits; returns the folder.
    fn written(dir: &Path, whole: &Tensor, split: Split) -> PathBuf {
        let folder = step_folder(&dir.join(format!("{split:?}.shards")), 1);
        for index in 0..2 {
            let shard = Shard { index, count: 2 };
            let region = Region::cut(split, shard);
            let flag = Tensor::from_slice(&[1u8, 2, 3]);
            let pieces = vec![
                Piece::model("w", whole.size(), region, shard_tensor(whole, split, shard)),
                Piece::model(&format!("flag{index}"), vec![3], Region::WHOLE, flag),
            ];
            HostShard::new(pieces).unwrap().write(&folder, index).unwrap();
        }
        commit(&folder, 2, &meta()).unwrap();
        folder
    }

    #[test]
    fn any_region_reads_from_pieces_cut_any_other_way() {
        let dir = tempfile::tempdir().unwrap();
        let whole = Tensor::arange(48, (Kind::Float, Device::Cpu)).view([8, 6]);
        let wanted = [
            Region::WHOLE,
            Region::WHOLE.flat(5, 30),
            Region::cut(Split::Rows, Shard { index: 1, count: 2 }),
            Region::cut(Split::Columns, Shard { index: 0, count: 2 }),
            Region::cut(Split::PackedRows(2), Shard { index: 1, count: 2 }).flat(3, 11),
        ];
        for split in [Split::Rows, Split::Columns, Split::PackedRows(2)] {
            let source = Source::open(&written(dir.path(), &whole, split)).unwrap();
            assert_eq!(Vec::<u8>::try_from(source.read_whole("model.flag1").unwrap()).unwrap(), vec![1, 2, 3]);
            for region in wanted {
                let expected = match region.cut {
                    Some((split, shard)) => shard_tensor(&whole, split, shard),
                    None => whole.copy(),
                };
                let expected = match region.flat {
                    Some((start, len)) => expected.reshape([-1]).narrow(0, start, len),
                    None => expected,
                };
                let before = source.read_bytes();
                let read = source.read("model.w", region).unwrap();
                assert!(read.equal(&expected), "{region:?} from pieces cut as {split:?}: {read} vs {expected}");
                assert_eq!(source.read_bytes() - before, 4 * expected.numel() as u64, "{region:?} from {split:?}: only its own elements read");
            }
        }
    }

    #[test]
    fn a_flipped_byte_in_the_newest_passes_the_resume_over_to_the_checkpoint_before() {
        let dir = tempfile::tempdir().unwrap();
        let run = run_folder(dir.path(), "run");
        let whole = Tensor::arange(64, (Kind::Float, Device::Cpu));
        for step in [1, 2] {
            let folder = step_folder(&run, step);
            for rank in 0..2 {
                let start = 32 * rank as i64;
                let piece = Piece::model("w", vec![64], Region::WHOLE.flat(start, 32), whole.narrow(0, start, 32));
                HostShard::new(vec![piece]).unwrap().write(&folder, rank).unwrap();
            }
            commit(&folder, 2, &CheckpointMeta { step, ..meta() }).unwrap();
        }
        // One bit of rank 1's data in the newest: its header still reads, its checksum does not.
        let damaged = step_folder(&run, 2).join(rank_file(1));
        let mut bytes = std::fs::read(&damaged).unwrap();
        *bytes.last_mut().unwrap() ^= 0x40;
        std::fs::write(&damaged, bytes).unwrap();
        assert!(Source::open_sharded(&step_folder(&run, 2)).is_ok(), "the damage is in the data, not in a header");
        let found = crate::checkpoint::find_newest(&dir.path().join("run.safetensors")).unwrap().unwrap();
        assert_eq!((&found.path, found.meta.step), (&step_folder(&run, 1), 1));
        let [warning] = found.warnings.as_slice() else { panic!("one warning: {:?}", found.warnings) };
        assert!(
            warning.contains("model.w in rank-00001.safetensors is damaged") && warning.contains("resuming from the previous complete checkpoint"),
            "{warning}"
        );
        assert!(!warning.contains('\n'), "one line: {warning}");
    }

    #[test]
    fn pieces_that_overlap_or_leave_a_gap_are_refused_at_commit() {
        let dir = tempfile::tempdir().unwrap();
        let folder = step_folder(dir.path(), 1);
        let whole = Tensor::arange(8, (Kind::Float, Device::Cpu));
        // Both ranks write the first half: half the tensor twice, the other half never.
        for rank in 0..2 {
            let region = Region::WHOLE.flat(0, 4);
            HostShard::new(vec![Piece::model("w", vec![8], region, whole.narrow(0, 0, 4))]).unwrap().write(&folder, rank).unwrap();
        }
        let err = commit(&folder, 2, &meta()).unwrap_err().to_string();
        assert!(err.contains("model.w") && err.contains("overlapping or missing"), "{err}");
        assert!(!folder.join(INDEX).exists(), "nothing committed");
    }
}
