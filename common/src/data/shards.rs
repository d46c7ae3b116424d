//! WebDataset-style tar shards: an image folder split packed into a few large files that each
//! data-parallel rank streams on its own.
//!
//! Why: on a parallel file system (Lustre, GPFS) every file opened is a round trip to a metadata
//! server, and ImageNet is 1.28 million small JPEGs: listing and opening them costs more than
//! reading them, and thousands of ranks doing so at once slow the file system for everyone.
//! Packed into tar files of about a thousand samples, the same bytes are read in large
//! sequential reads from a few files, and a rank only ever opens its own shards.
//!
//! The format is WebDataset's, so that shards written by its `ShardWriter` (or by `tar`) are
//! read here and ours are read by it:
//! - one split is `DIR/<split>-NNNNNN.tar` (split `train` or `val`, six digits);
//! - a sample is consecutive tar members sharing a key: `<key>.<ext>`, the image file's bytes
//!   unchanged (ext one of the image extensions torchvision's `ImageFolder` takes, lowercased),
//!   and `<key>.cls`, the label as ASCII decimal. The key is the member name up to the first
//!   `.` of its last path component, the extension the rest. Other members (`.json`, ...) are
//!   ignored; a sample with an image and no label, or a label and no image, is an error.
//!   [`pack`] writes keys that are the sample's position in the folder listing, nine digits;
//! - `DIR/shards.json` (written by [`write_index`], optional) holds the class names and each
//!   split's shards with their sample counts, so that opening a set lists no folder and reads
//!   no tar. Without it the shards are read for their counts and labels (see [`ShardSet::open`]).
//!
//! Order and distribution are pure functions of (seed, epoch), the same on every rank with no
//! communication (as in [`super::sampler`]): each epoch permutes the shards and rank `r` of `w`
//! reads positions `r, r + w, ...` ([`ShardSet::rank_shards`]); within a rank, a
//! [`shuffle_buffer`] mixes consecutive samples. That buffer only mixes what is near in the
//! stream, so [`pack`] writes the samples in a random order: a class-sorted folder packed as it
//! is listed would give shards of one class. Every rank takes the same number of samples per
//! epoch, and every epoch the same ([`ShardSet::samples_per_rank`]), so that collectives and
//! the steps per epoch stay in step.
use super::image_folder::{split_folder, ImageFolder, IMAGE_EXTENSIONS};
use super::{Sampler, Split};
use crate::output;
use anyhow::{anyhow, bail, ensure, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, SyncSender};

/// The index of a shard set, in its folder.
pub const INDEX_FILE: &str = "shards.json";

/// Extension of the member that holds a sample's label (WebDataset's "class" convention).
const LABEL_EXTENSION: &str = "cls";

/// Samples the reader thread of [`ShardSet::stream`] reads ahead of its consumer: enough to ride
/// out a file-system stall while the decoders work, a few MB of memory for ImageNet's JPEGs.
const READ_AHEAD: usize = 64;

/// Read buffer when streaming: large sequential reads are what parallel file systems serve
/// best (1 MiB is Lustre's usual stripe size).
const STREAM_BUFFER: usize = 1 << 20;

/// Read buffer when only the headers and labels are read: every image is skipped by a seek,
/// which drops the buffer, so a large one would read what is skipped.
const SCAN_BUFFER: usize = 8 << 10;

/// One shard file and how many samples it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// The file's name, relative to the set's folder.
    pub file: String,
    pub samples: usize,
}

/// One sample as stored: the image file's bytes, undecoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedSample {
    pub key: String,
    /// The image's extension, lowercase (`jpg`, `jpeg`, `png`, ...): which decoder to use.
    pub extension: String,
    pub bytes: Vec<u8>,
    pub label: usize,
    /// The shard's file name, for errors.
    pub shard: String,
}

/// One split of a shard set (see the module docs).
#[derive(Debug, Clone)]
pub struct ShardSet {
    dir: PathBuf,
    shards: Vec<ShardInfo>,
    classes: Vec<String>,
    /// Whether the shards and classes come from [`INDEX_FILE`] (else from reading the shards).
    indexed: bool,
    /// Shards of the split in the folder that its index does not list (not read: said).
    unlisted: Vec<String>,
}

/// What `shards.json` holds.
#[derive(Debug, Serialize, Deserialize)]
struct Index {
    /// Class names; a label indexes this list.
    classes: Vec<String>,
    /// Each split's shards (by split folder name, `train` or `val`), in order.
    splits: BTreeMap<String, Vec<ShardInfo>>,
}

impl ShardSet {
    /// Opens split `split` (`train` for [`Split::Train`], `val` for [`Split::Test`]) of the shard
    /// set in `dir`, from its index `dir/shards.json`. Without an index (shards written by other
    /// tools, such as webdataset's `ShardWriter`), takes the files `dir/<split>-*.tar` sorted by
    /// name, reads their headers and labels for the sample counts (seeking over the images), and
    /// names the classes `0`, `1`, ... up to the largest label; [`ShardSet::has_index`] tells
    /// the caller, which may warn.
    ///
    /// The shards' contents are checked as they are streamed, not here: with an index, opening
    /// reads nothing but it, however large the set.
    pub fn open(dir: &Path, split: Split) -> Result<ShardSet> {
        crate::input::folder(dir, "shard folder", &format!("`prepare_data pack --data-dir DATA --out {}` writes one from an image folder", dir.display()))?;
        let name = split_folder(split);
        let index_path = dir.join(INDEX_FILE);
        let set = match read_index(&index_path)? {
            Some(index) => {
                let shards = index.splits.get(name).cloned().unwrap_or_default();
                ensure!(!shards.is_empty(), "{}: lists no {name} shard", index_path.display());
                ensure!(!index.classes.is_empty(), "{}: lists no class", index_path.display());
                // Names, not paths: an index from someone else must not reach outside its folder
                // (`../x.tar`, `/data/y.tar`) or count a shard twice.
                let mut seen = std::collections::HashSet::new();
                for shard in &shards {
                    ensure!(is_plain_name(&shard.file), "{}: names {:?}, not a file name in its folder (no '/', no '..')", index_path.display(), shard.file);
                    ensure!(seen.insert(shard.file.as_str()), "{}: lists {} twice", index_path.display(), shard.file);
                }
                if let Some(missing) = shards.iter().find(|shard| !dir.join(&shard.file).is_file()) {
                    bail!("{}: names {}, which does not exist in {}", index_path.display(), missing.file, dir.display());
                }
                let unlisted = list_shard_files(dir, name)?.into_iter().filter(|file| !seen.contains(file.as_str())).collect();
                ShardSet { dir: dir.to_path_buf(), shards, classes: index.classes, indexed: true, unlisted }
            }
            None => {
                let (shards, largest_label) = scan(dir, name)?;
                let classes = (0..largest_label.map_or(0, |label| label + 1)).map(|label| label.to_string()).collect();
                ShardSet { dir: dir.to_path_buf(), shards, classes, indexed: false, unlisted: Vec::new() }
            }
        };
        ensure!(!set.is_empty(), "{}: the {name} shards hold no sample", dir.display());
        Ok(set)
    }

    /// The folder the shards are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the set was opened from its index (else from reading the shards, with classes
    /// named by number).
    pub fn has_index(&self) -> bool {
        self.indexed
    }

    /// The warning for shards of the split that sit in the folder but are not in its index
    /// (not read: a shard copied in after `pack`, or one an index written by hand forgot).
    pub fn unlisted_note(&self) -> Option<String> {
        (!self.unlisted.is_empty()).then(|| {
            format!(
                "WARNING: {}: {} lists {} shard(s) of this split, and the folder holds {} more it does not list, which are not read: {}",
                self.dir.display(),
                INDEX_FILE,
                self.shards.len(),
                self.unlisted.len(),
                self.unlisted.join(", ")
            )
        })
    }

    /// Class names; a sample's label indexes this list.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Samples in all shards.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|shard| shard.samples).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shards (indices into [`ShardSet::shards`]) that replica `rank` of `world` reads in
    /// `epoch`: with `shuffle`, a permutation of all shards that is a pure function of (seed,
    /// epoch), else all in order; then its positions `rank, rank + world, ...`. Disjoint across
    /// ranks and covering all shards; a rank gets none when there are fewer shards than ranks.
    pub fn rank_shards(&self, epoch: usize, seed: u64, shuffle: bool, rank: usize, world: usize) -> Vec<usize> {
        assert!(world > 0 && rank < world, "rank {rank} of {world}");
        self.order(epoch, seed, shuffle).into_iter().skip(rank).step_by(world).collect()
    }

    /// The samples every replica takes in a training epoch, so that all ranks step alike and
    /// every epoch has the same steps: the fewest any rank can be dealt in any epoch, the sum of
    /// the `⌊shards / world⌋` smallest shards (computed alike on every rank; 0 when a rank can
    /// get no shard). A rank dealt more leaves the rest of its stream unread that epoch: with
    /// equal shards and many per rank a small share (ImageNet in 1,282 shards of 1,000 on 32
    /// ranks: 1,167 of 1,281,167 an epoch), other samples every epoch.
    pub fn samples_per_rank(&self, world: usize) -> usize {
        assert!(world > 0, "world size 0");
        let mut sizes: Vec<usize> = self.shards.iter().map(|shard| shard.samples).collect();
        sizes.sort_unstable();
        sizes.iter().take(sizes.len() / world).sum()
    }

    /// All shards in the order an epoch deals them out: the sampler's permutation, so that shard
    /// order and sample order follow the same rule.
    fn order(&self, epoch: usize, seed: u64, shuffle: bool) -> Vec<usize> {
        Sampler::new(self.shards.len(), shuffle, seed).indices(epoch)
    }

    /// Streams the samples of `shards` (indices into [`ShardSet::shards`]), shard after shard,
    /// in the order they are stored. Each shard is read front to back through a buffered reader,
    /// never whole into memory, on a reader thread of its own that stays [`READ_AHEAD`] samples
    /// ahead (the tar crate's entries borrow their archive, so an iterator that owns both cannot
    /// be written without one; it also overlaps file-system waits with decoding). The thread
    /// ends with the stream, or when the iterator is dropped.
    ///
    /// A shard that cannot be read, a malformed sample (see the module docs), a label beyond
    /// the classes, or a shard that holds another number of samples than listed, ends the
    /// stream with an error naming the shard (and the sample).
    pub fn stream(&self, shards: Vec<usize>) -> impl Iterator<Item = Result<EncodedSample>> + Send + 'static {
        let jobs: Vec<(PathBuf, ShardInfo)> = shards.into_iter().map(|i| (self.dir.join(&self.shards[i].file), self.shards[i].clone())).collect();
        let num_classes = self.classes.len();
        let (sender, receiver) = mpsc::sync_channel(READ_AHEAD);
        let on_spawn_failure = sender.clone();
        let read = move || {
            for (path, shard) in &jobs {
                if send_shard(path, shard, num_classes, &sender).is_break() {
                    return;
                }
            }
        };
        if let Err(err) = std::thread::Builder::new().name("shard-reader".into()).spawn(read) {
            let _ = on_spawn_failure.send(Err(anyhow!(err).context("cannot start a thread to read the shards")));
        }
        receiver.into_iter()
    }
}

/// Sends the samples of one shard to the stream, then an error if there were not as many as
/// listed. Breaks when the stream is to end: after an error, or when nobody receives any more.
fn send_shard(path: &Path, shard: &ShardInfo, num_classes: usize, sender: &SyncSender<Result<EncodedSample>>) -> ControlFlow<()> {
    let mut receiver_gone = false;
    let walked = walk(path, &shard.file, Reading::Everything, Some(num_classes), |sample| {
        receiver_gone = sender.send(Ok(sample)).is_err();
        if receiver_gone {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    let error = match walked {
        _ if receiver_gone => return ControlFlow::Break(()),
        Ok(samples) if samples == shard.samples => return ControlFlow::Continue(()),
        Ok(samples) => anyhow!("{}: holds {samples} samples where {} were listed (rewritten or cut short since?)", path.display(), shard.samples),
        Err(err) => err,
    };
    let _ = sender.send(Err(error));
    ControlFlow::Break(())
}

/// The shards of `split` in `dir` when there is no index: the files `<split>-*.tar`, sorted,
/// with their sample counts; and the largest label in them.
fn scan(dir: &Path, split: &str) -> Result<(Vec<ShardInfo>, Option<usize>)> {
    let files = list_shard_files(dir, split)?;
    ensure!(
        !files.is_empty(),
        "{}: no {INDEX_FILE} and no {split}-*.tar shard in it (`prepare_data pack --data-dir IMAGE_FOLDER --out {}` writes them)",
        dir.display(),
        dir.display()
    );
    // In parallel: on a parallel file system each shard's reads wait on its servers.
    let scanned: Vec<(ShardInfo, Option<usize>)> = files
        .into_par_iter()
        .map(|file| {
            let mut largest_label = None;
            let samples = walk(&dir.join(&file), &file, Reading::LabelsOnly, None, |sample| {
                largest_label = largest_label.max(Some(sample.label));
                ControlFlow::Continue(())
            })?;
            Ok((ShardInfo { file, samples }, largest_label))
        })
        .collect::<Result<_>>()?;
    let largest_label = scanned.iter().filter_map(|(_, label)| *label).max();
    Ok((scanned.into_iter().map(|(shard, _)| shard).collect(), largest_label))
}

/// The files `<split>-*.tar` in `dir`, sorted by name (the shard numbers' order when they are
/// zero-padded, as WebDataset's and ours are).
fn list_shard_files(dir: &Path, split: &str) -> Result<Vec<String>> {
    let prefix = format!("{split}-");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let entry = entry.with_context(|| format!("cannot list {}", dir.display()))?;
        if let Some(name) = entry.file_name().to_str().filter(|name| name.starts_with(&prefix) && name.ends_with(".tar")) {
            files.push(name.to_string());
        }
    }
    files.sort();
    Ok(files)
}

/// How much of each sample [`walk`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// Images and labels, reading the file front to back.
    Everything,
    /// Labels only: the images are seeked over and come out empty.
    LabelsOnly,
}

/// Reads the shard at `path` (named `file` in the samples) member by member, groups consecutive
/// members by key into samples, and hands each complete sample to `emit` until it breaks.
/// Returns the number of samples handed over. Labels must be below `num_classes` when given.
fn walk(path: &Path, file: &str, reading: Reading, num_classes: Option<usize>, mut emit: impl FnMut(EncodedSample) -> ControlFlow<()>) -> Result<usize> {
    let unreadable = || format!("{}: not a readable tar file (cut short or corrupt?)", path.display());
    let opened = crate::input::open(path, super::DATA_REMEDY)?;
    let capacity = match reading {
        Reading::Everything => STREAM_BUFFER,
        Reading::LabelsOnly => SCAN_BUFFER,
    };
    let mut archive = tar::Archive::new(EofTracking { inner: BufReader::with_capacity(capacity, opened), reached_eof: false });
    let entries = match reading {
        Reading::Everything => archive.entries(),
        Reading::LabelsOnly => archive.entries_with_seek(),
    }
    .with_context(unreadable)?;

    let mut samples = 0;
    let mut deliver = |members: Members| -> Result<ControlFlow<()>> {
        Ok(match members.into_sample(path, file, num_classes)? {
            Some(sample) => {
                samples += 1;
                emit(sample)
            }
            None => ControlFlow::Continue(()),
        })
    };
    let mut pending: Option<Members> = None;
    for entry in entries {
        let mut entry = entry.with_context(unreadable)?;
        if !entry.header().entry_type().is_file() {
            continue; // folders, links, pax global headers
        }
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        // A name without a `.` in its last component has no extension: WebDataset skips it too.
        let Some((key, extension)) = split_key(&name) else { continue };
        if let Some(done) = pending.take_if(|members| members.key != key) {
            if deliver(done)?.is_break() {
                return Ok(samples);
            }
        }
        let members = pending.get_or_insert_with(|| Members { key: key.to_string(), image: None, label: None });
        if extension == LABEL_EXTENSION {
            ensure!(members.label.is_none(), "{}: sample {key} has two .{LABEL_EXTENSION} members", path.display());
            let text = read_member(&mut entry, path, &name)?;
            let text = String::from_utf8_lossy(&text);
            let label = text
                .trim()
                .parse()
                .map_err(|_| anyhow!("{}: sample {key} has label {:?} in its .{LABEL_EXTENSION}, not a decimal number", path.display(), text.trim()))?;
            members.label = Some(label);
        } else if is_image_extension(&extension) {
            if let Some((first, _)) = &members.image {
                bail!("{}: sample {key} has two images (.{first} and .{extension})", path.display());
            }
            let bytes = match reading {
                Reading::Everything => read_member(&mut entry, path, &name)?,
                Reading::LabelsOnly => Vec::new(),
            };
            members.image = Some((extension, bytes));
        }
    }
    // Checked before the last sample: a shard cut between an image and its label is cut short,
    // not a sample without a label.
    if archive.into_inner().reached_eof {
        bail!("{}: ends before tar's end-of-archive marker: the file was cut short (copy or pack it again)", path.display());
    }
    if let Some(last) = pending {
        // Whether `emit` asks to stop no longer matters: this was the last sample.
        let _ = deliver(last)?;
    }
    Ok(samples)
}

/// The members of one sample read so far: its image (extension, bytes) and its label.
struct Members {
    key: String,
    image: Option<(String, Vec<u8>)>,
    label: Option<usize>,
}

impl Members {
    /// The sample; none for members that are neither an image nor a label (metadata).
    fn into_sample(self, path: &Path, file: &str, num_classes: Option<usize>) -> Result<Option<EncodedSample>> {
        let key = self.key;
        match (self.image, self.label) {
            (None, None) => Ok(None),
            (Some(_), None) => bail!("{}: sample {key} has no .{LABEL_EXTENSION}", path.display()),
            (None, Some(_)) => bail!("{}: sample {key} has no image (.{})", path.display(), image_extensions().collect::<Vec<_>>().join(", .")),
            (Some((extension, bytes)), Some(label)) => {
                if let Some(n) = num_classes {
                    ensure!(label < n, "{}: sample {key} has label {label}, but the set has {n} classes", path.display());
                }
                Ok(Some(EncodedSample { key, extension, bytes, label, shard: file.to_string() }))
            }
        }
    }
}

/// WebDataset's split of a member name: the key is the name up to the first `.` of its last
/// path component, the extension (lowercased) what follows.
fn split_key(name: &str) -> Option<(&str, String)> {
    let component = name.rfind('/').map_or(0, |slash| slash + 1);
    let dot = component + name[component..].find('.')?;
    Some((&name[..dot], name[dot + 1..].to_lowercase()))
}

/// torchvision's image extensions, without their dots.
fn image_extensions() -> impl Iterator<Item = &'static str> {
    IMAGE_EXTENSIONS.iter().map(|extension| &extension[1..])
}

fn is_image_extension(extension: &str) -> bool {
    image_extensions().any(|known| known == extension)
}

/// A member's bytes, all of them: the tar crate hands out what is left of a file cut short
/// without complaint.
fn read_member<R: Read>(entry: &mut tar::Entry<'_, R>, path: &Path, name: &str) -> Result<Vec<u8>> {
    let size = entry.size();
    // A member's header may claim anything: no more than an image file may have is read.
    ensure!(
        size <= super::MAX_IMAGE_FILE_BYTES,
        "{}: {name} claims {size} bytes, more than the {} an image may have",
        path.display(),
        super::MAX_IMAGE_FILE_BYTES
    );
    let mut bytes = Vec::new();
    entry.read_to_end(&mut bytes).with_context(|| format!("{}: cannot read {name}", path.display()))?;
    ensure!(bytes.len() as u64 == size, "{}: cut short in {name} ({} of its {size} bytes)", path.display(), bytes.len());
    Ok(bytes)
}

/// A reader that remembers whether it reached end-of-file. The tar crate stops at the zero
/// blocks that end an archive and never reads past them, and takes end-of-file where a header
/// should be for the end too: so a reader that reached end-of-file read a file cut short.
struct EofTracking<R> {
    inner: R,
    reached_eof: bool,
}

impl<R: Read> Read for EofTracking<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.reached_eof |= n == 0 && !buf.is_empty();
        Ok(n)
    }
}

impl<R: Seek> Seek for EofTracking<R> {
    fn seek(&mut self, position: SeekFrom) -> io::Result<u64> {
        self.inner.seek(position)
    }
}

/// WebDataset's shuffle buffer: holds up to `size` items, hands out one drawn uniformly from it
/// and refills, and at the end drains in random order. An item comes out at most `size - 1`
/// places earlier than it went in (and arbitrarily later). Seeded: the same items and seed give
/// the same order. Size 0 or 1 passes the items through unchanged.
pub fn shuffle_buffer<T>(items: impl Iterator<Item = T>, size: usize, seed: u64) -> impl Iterator<Item = T> {
    let size = size.max(1);
    let mut items = items.fuse();
    let mut buffer = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    std::iter::from_fn(move || {
        buffer.extend(items.by_ref().take(size - buffer.len()));
        // The order within the buffer does not matter, the draw being uniform: swap_remove is O(1).
        (!buffer.is_empty()).then(|| buffer.swap_remove(rng.random_range(0..buffer.len())))
    })
}

/// `<split>-NNNNNN.tar`, shard `number` of a split.
fn shard_file_name(split: &str, number: usize) -> String {
    format!("{split}-{number:06}.tar")
}

/// Packs split `split` of an image folder into `out` as shards of `per_shard` samples (the last
/// may hold fewer), the samples in a random order drawn from `seed` (a class-sorted folder would
/// otherwise give one-class shards that no shuffle buffer can mix). Each image file's bytes are
/// copied unchanged, with the key of its position in the folder listing. The shards are written
/// in parallel, each under a temporary name renamed when complete; the same folder and seed give
/// the same bytes. Shards of the split that an earlier, larger packing left beyond the new ones
/// are removed. Returns the shards written; [`write_index`] lists them.
pub fn pack(folder: &ImageFolder, out: &Path, split: Split, per_shard: usize, seed: u64) -> Result<Vec<ShardInfo>> {
    ensure!(per_shard > 0, "shards of 0 samples: ask for at least 1 per shard");
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let split = split_folder(split);
    let order = Sampler::new(folder.len(), true, seed).indices(0);
    let shards: Vec<ShardInfo> = order
        .par_chunks(per_shard)
        .enumerate()
        .map(|(number, samples)| {
            let file = shard_file_name(split, number);
            output::write_with(&out.join(&file), |tmp| write_shard(tmp, folder, samples))?;
            Ok(ShardInfo { file, samples: samples.len() })
        })
        .collect::<Result<_>>()?;
    remove_stale_shards(out, split, &shards)?;
    Ok(shards)
}

/// Writes the tar file of the folder's samples `samples` (positions in its listing) to `path`
/// (the atomic writer's temporary file: its errors name the shard).
fn write_shard(path: &Path, folder: &ImageFolder, samples: &[usize]) -> Result<()> {
    let mut tar = tar::Builder::new(BufWriter::with_capacity(STREAM_BUFFER, File::create(path)?));
    for &position in samples {
        let sample = &folder.samples[position];
        let bytes = crate::input::read(&sample.path, super::MAX_IMAGE_FILE_BYTES, super::DATA_REMEDY)?;
        let extension = sample.path.extension().unwrap_or_default().to_string_lossy().to_lowercase();
        let key = format!("{position:09}");
        append(&mut tar, &format!("{key}.{extension}"), &bytes)?;
        append(&mut tar, &format!("{key}.{LABEL_EXTENSION}"), sample.label.to_string().as_bytes())?;
    }
    // A BufWriter dropped unflushed would hide a failed write (a full disk): flush it here.
    let buffered = tar.into_inner()?;
    buffered.into_inner().map_err(|err| err.into_error())?;
    Ok(())
}

/// Appends a regular file member, with fixed mode, owner and time so that the same input gives
/// the same bytes.
fn append<W: Write>(tar: &mut tar::Builder<W>, name: &str, bytes: &[u8]) -> io::Result<()> {
    let mut header = tar::Header::new_ustar();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(bytes.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    tar.append_data(&mut header, name, bytes)
}

/// Removes the shards `<split>-NNNNNN.tar` in `out` that are not among `written`: packing again
/// with larger shards writes fewer files, and the old ones beyond them would otherwise stay (a
/// set read without its index would take them in, and they are most of a data set's size).
fn remove_stale_shards(out: &Path, split: &str, written: &[ShardInfo]) -> Result<()> {
    let numbered = |name: &str| {
        name.strip_prefix(split)
            .and_then(|rest| rest.strip_prefix('-'))
            .and_then(|rest| rest.strip_suffix(".tar"))
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
    };
    for file in list_shard_files(out, split)? {
        if numbered(&file) && !written.iter().any(|shard| shard.file == file) {
            let path = out.join(&file);
            std::fs::remove_file(&path).with_context(|| format!("cannot remove the stale shard {}", path.display()))?;
        }
    }
    Ok(())
}

/// Writes the index `out/shards.json` with `classes` and split `split`'s `shards`, keeping the
/// other split of an existing index when it has the same classes (else it is dropped: its labels
/// would name other classes). Written atomically (a temporary file renamed).
pub fn write_index(out: &Path, split: Split, classes: &[String], shards: &[ShardInfo]) -> Result<()> {
    let path = out.join(INDEX_FILE);
    let mut index = match read_index(&path)? {
        Some(index) if index.classes == classes => index,
        _ => Index { classes: classes.to_vec(), splits: BTreeMap::new() },
    };
    index.splits.insert(split_folder(split).to_string(), shards.to_vec());
    let mut json = serde_json::to_string_pretty(&index)?;
    json.push('\n');
    output::write(&path, json)
}

/// Whether `name` names a file in its folder: not empty, no path separator, not `.` or `..`.
pub(crate) fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/') && !name.contains('\0')
}

/// The index at `path`, none when there is no such file.
fn read_index(path: &Path) -> Result<Option<Index>> {
    if crate::output::Kind::of(path).with_context(|| format!("cannot look at {}", path.display()))? == crate::output::Kind::Missing {
        return Ok(None);
    }
    let bytes = crate::input::read(path, 64 << 20, "the shard index is the JSON file `prepare_data pack` wrote")?;
    let index = crate::input::json(&bytes).with_context(|| format!("{}: not a shard index (its classes, and each split's shards)", path.display()))?;
    Ok(Some(index))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// An image folder `root/train/<class>/<n>.<ext>` with `per_class[c]` files in class `c`,
    /// each of distinct bytes (no valid image: nothing here decodes) and of varied sizes (some
    /// over a tar block, one of exactly 512 bytes).
    fn image_folder(root: &Path, per_class: &[usize]) -> ImageFolder {
        for (class, &count) in per_class.iter().enumerate() {
            for n in 0..count {
                // Upper-case and `jpeg` extensions: shards keep them, lowercased.
                let extension = ["jpg", "JPEG", "png"][n % 3];
                let path = root.join(format!("train/class{class}/{n}.{extension}"));
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                let mut bytes = format!("image {n} of class {class};").into_bytes();
                bytes.resize(if n == 1 { 512 } else { 100 + 700 * n }, b'a' + n as u8);
                std::fs::write(path, bytes).unwrap();
            }
        }
        ImageFolder::scan_split(root, Split::Train, None).unwrap()
    }

    fn pack_train(folder: &ImageFolder, out: &Path, per_shard: usize) -> Vec<ShardInfo> {
        let shards = pack(folder, out, Split::Train, per_shard, 7).unwrap();
        write_index(out, Split::Train, &folder.classes, &shards).unwrap();
        shards
    }

    fn stream_all(set: &ShardSet) -> Result<Vec<EncodedSample>> {
        set.stream((0..set.shards().len()).collect()).collect()
    }

    /// Tar members: (name, bytes).
    type TarMembers<'a> = [(&'a str, &'a [u8])];

    /// A tar file of these members, as [`pack`] writes them.
    fn write_tar(path: &Path, members: &TarMembers) {
        let mut tar = tar::Builder::new(File::create(path).unwrap());
        for (name, bytes) in members {
            append(&mut tar, name, bytes).unwrap();
        }
        tar.finish().unwrap();
    }

    fn error(result: Result<impl std::fmt::Debug>) -> String {
        format!("{:#}", result.unwrap_err())
    }

    #[test]
    fn packed_samples_come_back_once_with_their_bytes_and_labels() {
        let dir = tempfile::tempdir().unwrap();
        let folder = image_folder(dir.path(), &[5, 4, 4]);
        let out = dir.path().join("shards");
        let shards = pack_train(&folder, &out, 4);

        let set = ShardSet::open(&out, Split::Train).unwrap();
        assert!(set.has_index());
        assert_eq!(set.classes(), ["class0", "class1", "class2"]);
        assert_eq!(set.shards(), shards);
        let sizes: Vec<(&str, usize)> = set.shards().iter().map(|s| (s.file.as_str(), s.samples)).collect();
        assert_eq!(sizes, [("train-000000.tar", 4), ("train-000001.tar", 4), ("train-000002.tar", 4), ("train-000003.tar", 1)]);
        assert_eq!(set.len(), 13);

        // The index is what is on disk: the files it names, holding the counts it says, and
        // nothing else (no temporary file left).
        let mut on_disk: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        on_disk.sort();
        let mut expected: Vec<String> = shards.iter().map(|s| s.file.clone()).collect();
        expected.insert(0, INDEX_FILE.into());
        assert_eq!(on_disk, expected);
        for shard in &shards {
            let counted = walk(&out.join(&shard.file), &shard.file, Reading::Everything, None, |_| ControlFlow::Continue(())).unwrap();
            assert_eq!(counted, shard.samples, "{}", shard.file);
        }

        let samples = stream_all(&set).unwrap();
        assert_eq!(samples.len(), folder.len());
        let mut seen = HashSet::new();
        for sample in &samples {
            // The key is the position in the folder listing: that file's bytes, label, extension.
            let position: usize = sample.key.parse().unwrap();
            assert_eq!(sample.key.len(), 9);
            let source = &folder.samples[position];
            assert_eq!(sample.bytes, std::fs::read(&source.path).unwrap(), "{}", sample.key);
            assert_eq!(sample.label, source.label, "{}", sample.key);
            assert_eq!(sample.extension, source.path.extension().unwrap().to_string_lossy().to_lowercase());
            assert!(seen.insert(position), "{} twice", sample.key);
        }
        // Shards mix the classes: the samples are not in the folder's (class-sorted) order.
        let order: Vec<usize> = samples.iter().map(|s| s.key.parse().unwrap()).collect();
        assert_ne!(order, (0..folder.len()).collect::<Vec<_>>());
        assert_eq!(samples.iter().filter(|s| s.shard == "train-000003.tar").count(), 1);

        assert_eq!(set.unlisted_note(), None);
        // A shard in the folder that the index does not list is not read, and said.
        std::fs::copy(out.join("train-000003.tar"), out.join("train-000004.tar")).unwrap();
        let more = ShardSet::open(&out, Split::Train).unwrap();
        assert_eq!(more.len(), 13);
        let note = more.unlisted_note().unwrap();
        assert!(note.contains("lists 4 shard(s) of this split, and the folder holds 1 more it does not list, which are not read: train-000004.tar"), "{note}");
        std::fs::remove_file(out.join("train-000004.tar")).unwrap();

        // Without the index, the same shards, counts and samples come back from the tar headers;
        // the classes are the labels' numbers.
        std::fs::remove_file(out.join(INDEX_FILE)).unwrap();
        let scanned = ShardSet::open(&out, Split::Train).unwrap();
        assert!(!scanned.has_index());
        assert_eq!(scanned.shards(), shards);
        assert_eq!(scanned.classes(), ["0", "1", "2"]);
        assert_eq!(stream_all(&scanned).unwrap(), samples);
    }

    #[test]
    fn packing_is_reproducible_and_replaces_an_earlier_packing() {
        let dir = tempfile::tempdir().unwrap();
        let folder = image_folder(dir.path(), &[3, 4]);
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        pack_train(&folder, &a, 2);
        pack_train(&folder, &b, 2);
        for n in 0..4 {
            let file = shard_file_name("train", n);
            assert_eq!(std::fs::read(a.join(&file)).unwrap(), std::fs::read(b.join(&file)).unwrap(), "{file}");
        }
        let other_seed = pack(&folder, &dir.path().join("c"), Split::Train, 2, 8).unwrap();
        assert_ne!(std::fs::read(a.join(&other_seed[0].file)).unwrap(), std::fs::read(dir.path().join("c").join(&other_seed[0].file)).unwrap());

        // Packed again with larger shards: the four old files become two, nothing else is left,
        // and the set read without its index is the new one.
        std::fs::write(a.join("train-extra.tar"), b"not ours").unwrap();
        pack_train(&folder, &a, 4);
        std::fs::remove_file(a.join(INDEX_FILE)).unwrap();
        std::fs::remove_file(a.join("train-extra.tar")).unwrap();
        let set = ShardSet::open(&a, Split::Train).unwrap();
        let sizes: Vec<(&str, usize)> = set.shards().iter().map(|s| (s.file.as_str(), s.samples)).collect();
        assert_eq!(sizes, [("train-000000.tar", 4), ("train-000001.tar", 3)]);
    }

    #[test]
    fn the_index_keeps_the_other_split_with_the_same_classes() {
        let dir = tempfile::tempdir().unwrap();
        let classes = ["cat".to_string(), "dog".to_string()];
        let train = [ShardInfo { file: "train-000000.tar".into(), samples: 2 }];
        let val = [ShardInfo { file: "val-000000.tar".into(), samples: 1 }];
        write_tar(&dir.path().join("train-000000.tar"), &[("000000000.jpg", b"a"), ("000000000.cls", b"0"), ("000000001.jpg", b"b"), ("000000001.cls", b"1")]);
        write_tar(&dir.path().join("val-000000.tar"), &[("000000000.png", b"c"), ("000000000.cls", b"1")]);
        write_index(dir.path(), Split::Train, &classes, &train).unwrap();
        write_index(dir.path(), Split::Test, &classes, &val).unwrap();
        assert_eq!(ShardSet::open(dir.path(), Split::Train).unwrap().shards(), train);
        let test = ShardSet::open(dir.path(), Split::Test).unwrap();
        assert_eq!((test.shards(), test.classes()), (&val[..], &classes[..]));

        // Other classes: the old val shards' labels would mean something else, so they go.
        write_index(dir.path(), Split::Train, &["emu".to_string(), "gnu".to_string()], &train).unwrap();
        let err = error(ShardSet::open(dir.path(), Split::Test));
        assert!(err.contains("shards.json: lists no val shard"), "{err}");
    }

    /// A set of shards with these sample counts (no files: only the arithmetic is used).
    fn set_of(counts: &[usize]) -> ShardSet {
        let shards = counts.iter().enumerate().map(|(n, &samples)| ShardInfo { file: shard_file_name("train", n), samples }).collect();
        ShardSet { dir: PathBuf::from("nowhere"), shards, classes: vec!["0".into()], indexed: true, unlisted: Vec::new() }
    }

    #[test]
    fn rank_shards_are_disjoint_cover_all_and_reshuffle_per_epoch() {
        for (shards, world) in [(1, 1), (5, 1), (5, 2), (7, 3), (4, 4), (3, 5), (10, 4)] {
            let set = set_of(&vec![1; shards]);
            for shuffle in [false, true] {
                for epoch in 0..3 {
                    let ranks: Vec<Vec<usize>> = (0..world).map(|rank| set.rank_shards(epoch, 11, shuffle, rank, world)).collect();
                    let mut all: Vec<usize> = ranks.concat();
                    all.sort();
                    assert_eq!(all, (0..shards).collect::<Vec<_>>(), "{shards} shards, world {world}, shuffle {shuffle}");
                    assert_eq!(ranks, (0..world).map(|rank| set.rank_shards(epoch, 11, shuffle, rank, world)).collect::<Vec<_>>(), "same on every call");
                    if !shuffle {
                        assert_eq!(ranks[world - 1], (world - 1..shards).step_by(world).collect::<Vec<_>>());
                    }
                }
            }
        }
        let set = set_of(&[1; 10]);
        let epochs: HashSet<Vec<usize>> = (0..4).map(|epoch| set.rank_shards(epoch, 11, true, 1, 2)).collect();
        assert_eq!(epochs.len(), 4, "a new order every epoch");
        assert_ne!(set.rank_shards(0, 11, true, 0, 1), set.rank_shards(0, 12, true, 0, 1), "and per seed");
    }

    #[test]
    fn samples_per_rank_is_what_every_rank_has_in_every_epoch() {
        let set = set_of(&[10, 20, 30, 40, 5]);
        // Two ranks: each gets at least 2 shards, at worst the two smallest (5 + 10).
        assert_eq!(set.samples_per_rank(2), 15);
        assert_eq!(set.samples_per_rank(1), 105);
        assert_eq!(set.samples_per_rank(5), 5);
        assert_eq!(set.samples_per_rank(6), 0, "a rank without a shard");
        for world in 1..=5 {
            let mut least = usize::MAX;
            for epoch in 0..200 {
                for rank in 0..world {
                    let total: usize = set.rank_shards(epoch, 3, true, rank, world).iter().map(|&s| set.shards()[s].samples).sum();
                    assert!(total >= set.samples_per_rank(world), "world {world}, epoch {epoch}, rank {rank}: {total}");
                    least = least.min(total);
                }
            }
            // The bound is reached (some epoch deals a rank the smallest shards): no tighter one holds.
            assert_eq!(least, set.samples_per_rank(world), "world {world}");
        }
    }

    #[test]
    fn the_shuffle_buffer_mixes_within_its_size_deterministically() {
        let items: Vec<usize> = (0..1000).collect();
        let shuffled = |size, seed| shuffle_buffer(items.iter().copied(), size, seed).collect::<Vec<_>>();
        let out = shuffled(10, 1);
        let mut sorted = out.clone();
        sorted.sort();
        assert_eq!(sorted, items, "a permutation");
        assert_eq!(out, shuffled(10, 1));
        assert_ne!(out, shuffled(10, 2));
        assert_eq!(shuffled(1, 1), items);
        assert_eq!(shuffled(0, 1), items);
        // An item comes out at most size − 1 places early, and some do come out that early.
        let earliest = out.iter().enumerate().map(|(position, &item)| item as isize - position as isize).max().unwrap();
        assert_eq!(earliest, 9);
        // A buffer larger than the input is a full shuffle of it.
        let small: Vec<usize> = shuffle_buffer(0..5, 100, 3).collect();
        assert_ne!(small, [0, 1, 2, 3, 4]);
        assert_eq!(small.iter().copied().collect::<HashSet<_>>(), (0..5).collect());
    }

    #[test]
    fn a_truncated_shard_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let folder = image_folder(dir.path(), &[4, 4]);
        let out = dir.path().join("shards");
        pack_train(&folder, &out, 4);
        let set = ShardSet::open(&out, Split::Train).unwrap();
        let path = out.join("train-000001.tar");
        let whole = std::fs::read(&path).unwrap();
        // The members end where the two zero blocks of the end-of-archive marker begin.
        let end_marker = whole.iter().rev().take_while(|&&b| b == 0).count() / 512 * 512;
        assert_eq!(end_marker, 1024);
        let members_end = whole.len() - end_marker;
        // Cut anywhere before: in a header, in an image, in its padding, between members.
        for cut in (0..members_end).step_by(100).chain([whole.len() / 2, members_end, members_end + 100]) {
            std::fs::write(&path, &whole[..cut]).unwrap();
            // Streamed (opening with the index reads no shard): the samples before the cut come
            // back whole, then an error.
            let mut items: Vec<Result<EncodedSample>> = set.stream(vec![0, 1]).collect();
            let err = format!("{:#}", items.pop().unwrap().unwrap_err());
            assert!(err.contains("train-000001.tar") && err.contains("cut short"), "cut at {cut}: {err}");
            assert!(items.len() >= 4 && items.len() < 8, "cut at {cut}: {} samples", items.len());
            for sample in items.into_iter().map(Result::unwrap) {
                assert_eq!(sample.bytes, std::fs::read(&folder.samples[sample.key.parse::<usize>().unwrap()].path).unwrap());
            }
            // Read for the headers only (no index), seeking over the images.
            let err = error(walk(&path, "train-000001.tar", Reading::LabelsOnly, None, |_| ControlFlow::Continue(())));
            assert!(err.contains("train-000001.tar") && err.contains("cut short"), "cut at {cut}: {err}");
        }
        std::fs::remove_file(out.join(INDEX_FILE)).unwrap();
        let err = error(ShardSet::open(&out, Split::Train));
        assert!(err.contains("train-000001.tar") && err.contains("cut short"), "{err}");

        // Cut at a member's end, the archive only misses its end marker.
        std::fs::write(&path, &whole[..members_end]).unwrap();
        let err = error(stream_all(&set));
        assert!(err.contains("train-000001.tar: ends before tar's end-of-archive marker"), "{err}");
        // One zero block of the two left is an end all the same (as for GNU tar): nothing is lost.
        std::fs::write(&path, &whole[..members_end + 512]).unwrap();
        assert_eq!(stream_all(&set).unwrap().len(), 8);
    }

    #[test]
    fn malformed_samples_are_errors_naming_the_shard_and_the_key() {
        let cases: [(&TarMembers, &str); 5] = [
            (
                &[("000000016.jpg", b"a"), ("000000016.cls", b"0"), ("000000017.jpg", b"b"), ("000000018.jpg", b"c"), ("000000018.cls", b"1")],
                "sample 000000017 has no .cls",
            ),
            (&[("000000016.cls", b"0")], "sample 000000016 has no image (.jpg, .jpeg, .png"),
            (&[("000000016.jpg", b"a"), ("000000016.cls", b"one")], "sample 000000016 has label \"one\" in its .cls, not a decimal number"),
            (&[("000000016.jpg", b"a"), ("000000016.png", b"a"), ("000000016.cls", b"0")], "sample 000000016 has two images (.jpg and .png)"),
            (&[("000000016.jpg", b"a"), ("000000016.cls", b"0"), ("000000016.cls", b"1")], "sample 000000016 has two .cls members"),
        ];
        for (members, expected) in cases {
            let dir = tempfile::tempdir().unwrap();
            write_tar(&dir.path().join("train-000003.tar"), members);
            // Found by the header scan without an index, and by streaming with one.
            let err = error(ShardSet::open(dir.path(), Split::Train));
            assert!(err.contains(&format!("train-000003.tar: {expected}")), "{err}");
            let shards = [ShardInfo { file: "train-000003.tar".into(), samples: 3 }];
            write_index(dir.path(), Split::Train, &["a".into(), "b".into()], &shards).unwrap();
            let err = error(stream_all(&ShardSet::open(dir.path(), Split::Train).unwrap()));
            assert!(err.contains(&format!("train-000003.tar: {expected}")), "{err}");
        }
    }

    #[test]
    fn other_members_are_ignored_and_keys_follow_webdataset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train-000000.tar");
        let mut tar = tar::Builder::new(File::create(&path).unwrap());
        append(&mut tar, "README.txt", b"metadata only: no sample").unwrap();
        // Python's tarfile (webdataset's ShardWriter) writes a pax header before each member.
        let mut pax = tar::Header::new_ustar();
        let record = b"30 mtime=1700000000.123456789\n";
        pax.set_entry_type(tar::EntryType::XHeader);
        pax.set_size(record.len() as u64);
        tar.append_data(&mut pax, "PaxHeader/x", &record[..]).unwrap();
        // The key ends at the first dot of the last component (a dot in a folder name does
        // not count); the extension is the rest, so `seg.png` is no image.
        append(&mut tar, "a.b/n01440764/cat1.JPEG", b"jpeg").unwrap();
        append(&mut tar, "a.b/n01440764/cat1.cls", b" 3\n").unwrap();
        append(&mut tar, "a.b/n01440764/cat1.seg.png", b"mask").unwrap();
        append(&mut tar, "a.b/n01440764/cat1.json", b"{}").unwrap();
        append(&mut tar, "nodot", b"ignored").unwrap();
        // A long name: a GNU long-name member before it.
        let long = format!("{}/k.webp", "d".repeat(150));
        append(&mut tar, &long, b"webp").unwrap();
        append(&mut tar, &format!("{}/k.cls", "d".repeat(150)), b"0").unwrap();
        tar.finish().unwrap();
        drop(tar);

        let set = ShardSet::open(dir.path(), Split::Train).unwrap();
        assert_eq!((set.len(), set.classes().len()), (2, 4));
        let samples = stream_all(&set).unwrap();
        let got: Vec<(&str, &str, &[u8], usize)> = samples.iter().map(|s| (s.key.as_str(), s.extension.as_str(), &s.bytes[..], s.label)).collect();
        let long_key = format!("{}/k", "d".repeat(150));
        assert_eq!(got, [("a.b/n01440764/cat1", "jpeg", &b"jpeg"[..], 3), (long_key.as_str(), "webp", &b"webp"[..], 0)]);
    }

    #[test]
    fn opening_names_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let err = error(ShardSet::open(&dir.path().join("nowhere"), Split::Train));
        assert!(err.contains("nowhere does not exist"), "{err}");
        let err = error(ShardSet::open(dir.path(), Split::Test));
        assert!(err.contains("no shards.json and no val-*.tar shard"), "{err}");

        let shard = dir.path().join("train-000000.tar");
        write_tar(&shard, &[("000000000.jpg", b"a"), ("000000000.cls", b"1")]);
        let classes = ["a".to_string(), "b".to_string()];
        write_index(dir.path(), Split::Train, &classes, &[ShardInfo { file: "train-000009.tar".into(), samples: 1 }]).unwrap();
        let err = error(ShardSet::open(dir.path(), Split::Train));
        assert!(err.contains("shards.json: names train-000009.tar, which does not exist"), "{err}");

        // Listed with another count, or a label beyond the classes: found when streamed.
        write_index(dir.path(), Split::Train, &classes, &[ShardInfo { file: "train-000000.tar".into(), samples: 2 }]).unwrap();
        let err = error(stream_all(&ShardSet::open(dir.path(), Split::Train).unwrap()));
        assert!(err.contains("train-000000.tar: holds 1 samples where 2 were listed"), "{err}");
        write_index(dir.path(), Split::Train, &classes, &[ShardInfo { file: "train-000000.tar".into(), samples: 1 }]).unwrap();
        assert_eq!(stream_all(&ShardSet::open(dir.path(), Split::Train).unwrap()).unwrap().len(), 1);
        write_tar(&shard, &[("000000000.jpg", b"a"), ("000000000.cls", b"5")]);
        let err = error(stream_all(&ShardSet::open(dir.path(), Split::Train).unwrap()));
        assert!(err.contains("train-000000.tar: sample 000000000 has label 5, but the set has 2 classes"), "{err}");

        std::fs::write(dir.path().join(INDEX_FILE), "{\"classes\": [").unwrap();
        let err = error(ShardSet::open(dir.path(), Split::Train));
        assert!(err.contains("shards.json: not a shard index"), "{err}");
    }
}
