//! MNIST in the IDX format (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
//! `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`), gzip-compressed (`.gz`) or raw.
//!
//! IDX: a big-endian magic number (`0x00000803` for unsigned-byte images with 3 dimensions,
//! `0x00000801` for labels), one big-endian u32 per dimension, then the bytes.
use super::{check_labels, read_file, Split};
use anyhow::Context;
use flate2::read::GzDecoder;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;

/// Base names (without `.gz`) of the image and label files of a split.
pub fn file_names(split: Split) -> (&'static str, &'static str) {
    match split {
        Split::Train => ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        Split::Test => ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    }
}

/// Reads one split: (images as `N × 1 × 28 × 28` bytes, labels).
pub fn read(dir: &Path, split: Split) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let (images_name, labels_name) = file_names(split);
    let images_path = find(dir, images_name)?;
    let labels_path = find(dir, labels_name)?;
    let (image_dims, images) = read_idx(&images_path, IMAGES_MAGIC)?;
    let (label_dims, labels) = read_idx(&labels_path, LABELS_MAGIC)?;
    if image_dims[1..] != [28, 28] {
        anyhow::bail!("{}: images are {:?}, expected N × 28 × 28", images_path.display(), image_dims);
    }
    if image_dims[0] != label_dims[0] {
        anyhow::bail!("{} holds {} images but {} holds {} labels", images_path.display(), image_dims[0], labels_path.display(), label_dims[0]);
    }
    check_labels(&labels, 10, &labels_path)?;
    Ok((images, labels))
}

/// The file `name.gz` or `name` in `dir`.
fn find(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let gz = dir.join(format!("{name}.gz"));
    let raw = dir.join(name);
    match (gz.exists(), raw.exists()) {
        (true, _) => Ok(gz),
        (false, true) => Ok(raw),
        (false, false) => anyhow::bail!("MNIST file {} (or {}) is missing; run `make data` or pass --data-dir", gz.display(), raw.display()),
    }
}

/// Reads an IDX file (gzip detected by its magic bytes): its dimensions and data.
pub fn read_idx(path: &Path, magic: u32) -> anyhow::Result<(Vec<usize>, Vec<u8>)> {
    let mut bytes = read_file(path)?;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut raw = Vec::new();
        GzDecoder::new(&bytes[..]).read_to_end(&mut raw).with_context(|| format!("{}: corrupt gzip data", path.display()))?;
        bytes = raw;
    }
    let bad = |what: String| anyhow::anyhow!("{}: {what}; not a valid MNIST IDX file", path.display());
    let word = |i: usize| -> Option<u32> { Some(u32::from_be_bytes(bytes.get(4 * i..4 * i + 4)?.try_into().ok()?)) };
    let found = word(0).ok_or_else(|| bad(format!("only {} bytes", bytes.len())))?;
    if found != magic {
        return Err(bad(format!("magic number {found:#010x}, expected {magic:#010x}")));
    }
    let ndims = (magic & 0xff) as usize;
    let dims = (1..=ndims).map(|i| word(i).map(|d| d as usize)).collect::<Option<Vec<_>>>().ok_or_else(|| bad("header cut short".into()))?;
    let header = 4 * (1 + ndims);
    let expected: usize = dims.iter().product();
    let data = &bytes[header..];
    if data.len() != expected {
        return Err(bad(format!("header promises {dims:?} = {expected} bytes of data, the file holds {} (truncated?)", data.len())));
    }
    Ok((dims, data.to_vec()))
}

/// Writes an IDX file, gzip-compressed when `path` ends in `.gz`.
pub fn write_idx(path: &Path, dims: &[usize], data: &[u8]) -> anyhow::Result<()> {
    assert_eq!(dims.iter().product::<usize>(), data.len(), "dimensions and data disagree");
    let magic = 0x0800 | dims.len() as u32;
    let mut bytes = magic.to_be_bytes().to_vec();
    for &d in dims {
        bytes.extend_from_slice(&(d as u32).to_be_bytes());
    }
    bytes.extend_from_slice(data);
    let gzip = path.extension().is_some_and(|e| e == "gz");
    crate::output::write_with(path, |tmp| {
        let mut file = std::fs::File::create(tmp)?;
        if gzip {
            let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
            gz.write_all(&bytes)?;
            gz.finish()?;
        } else {
            file.write_all(&bytes)?;
        }
        Ok(())
    })
}

/// Writes a whole split as `.gz` IDX files in `dir`.
pub fn write_split(dir: &Path, split: Split, images: &[u8], labels: &[u8]) -> anyhow::Result<()> {
    let (images_name, labels_name) = file_names(split);
    write_idx(&dir.join(format!("{images_name}.gz")), &[labels.len(), 28, 28], images)?;
    write_idx(&dir.join(format!("{labels_name}.gz")), &[labels.len()], labels)
}
