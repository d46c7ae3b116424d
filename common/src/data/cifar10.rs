//! CIFAR-10, binary version (`cifar-10-binary.tar.gz`): `data_batch_1.bin` … `data_batch_5.bin`
//! and `test_batch.bin`, each a sequence of 3,073-byte records: one label byte, then the
//! 32×32 red, green and blue planes.
use super::{check_labels, read_file, Split};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const RECORD_BYTES: usize = 1 + IMAGE_BYTES;
pub const IMAGE_BYTES: usize = 3 * 32 * 32;
pub const TRAIN_FILES: [&str; 5] = ["data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin"];
pub const TEST_FILE: &str = "test_batch.bin";
/// The folder the official archive unpacks to.
pub const ARCHIVE_DIR: &str = "cifar-10-batches-bin";

/// The folder holding the `.bin` files: `dir` itself, or the archive's folder inside it.
pub fn locate(dir: &Path) -> PathBuf {
    let nested = dir.join(ARCHIVE_DIR);
    if !dir.join(TEST_FILE).exists() && nested.is_dir() {
        nested
    } else {
        dir.to_path_buf()
    }
}

pub fn file_names(split: Split) -> &'static [&'static str] {
    match split {
        Split::Train => &TRAIN_FILES,
        Split::Test => std::slice::from_ref(&TEST_FILE),
    }
}

/// Reads one split: (images as `N × 3 × 32 × 32` bytes, labels).
pub fn read(dir: &Path, split: Split) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let mut images = Vec::new();
    let mut labels = Vec::new();
    for name in file_names(split) {
        let path = dir.join(name);
        if !path.exists() {
            anyhow::bail!(
                "CIFAR-10 file {} is missing (expected the binary release: {} and {TEST_FILE}); run `make data`",
                path.display(),
                TRAIN_FILES.join(", ")
            );
        }
    }
    // The split's images in one piece, reserved before the first file is read: short of memory,
    // one line saying how much, not an abort.
    let bytes: u64 = file_names(split).iter().map(|name| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len())).sum();
    let records = (bytes / RECORD_BYTES as u64) as usize;
    images.try_reserve_exact(records * IMAGE_BYTES).and_then(|()| labels.try_reserve_exact(records)).map_err(|_| {
        anyhow::anyhow!(
            "cannot read CIFAR-10's {} split from {}: its {:.0} MiB of images do not fit in the memory left to this process",
            if matches!(split, Split::Train) { "training" } else { "test" },
            dir.display(),
            (records * IMAGE_BYTES) as f64 / (1 << 20) as f64
        )
    })?;
    for name in file_names(split) {
        let path = dir.join(name);
        let bytes = read_file(&path)?;
        parse_records(&bytes, &path, &mut images, &mut labels)?;
    }
    Ok((images, labels))
}

/// Splits a file's bytes into records, appending to `images` and `labels`.
fn parse_records(bytes: &[u8], path: &Path, images: &mut Vec<u8>, labels: &mut Vec<u8>) -> anyhow::Result<()> {
    if bytes.is_empty() || !bytes.len().is_multiple_of(RECORD_BYTES) {
        anyhow::bail!(
            "{}: {} bytes is not a whole number of {RECORD_BYTES}-byte CIFAR-10 records (truncated or not a CIFAR-10 binary file)",
            path.display(),
            bytes.len()
        );
    }
    let start = labels.len();
    for record in bytes.chunks_exact(RECORD_BYTES) {
        labels.push(record[0]);
        images.extend_from_slice(&record[1..]);
    }
    check_labels(&labels[start..], 10, path)
}

/// Writes records in the official format (used by the generator and by tests).
pub fn write(path: &Path, images: &[u8], labels: &[u8]) -> anyhow::Result<()> {
    assert_eq!(images.len(), labels.len() * IMAGE_BYTES, "images and labels disagree in length");
    crate::output::write_with(path, |tmp| {
        let mut out = std::io::BufWriter::new(std::fs::File::create(tmp)?);
        for (label, image) in labels.iter().zip(images.chunks_exact(IMAGE_BYTES)) {
            out.write_all(&[*label])?;
            out.write_all(image)?;
        }
        Ok(out.flush()?)
    })
}
