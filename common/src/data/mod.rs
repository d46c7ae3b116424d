//! Data sets in their official on-disk formats, generated stand-ins in the same formats, and
//! the loader that turns them into ready batches.
//!
//! Images are held in memory as bytes in `[N, C, H, W]` order (CIFAR-10 is 150 MB that way) and
//! become float tensors only batch by batch, on the loader's worker threads.
pub mod cifar10;
pub mod generate;
pub mod image_files;
pub mod image_folder;
pub mod loader;
pub mod mnist;
pub mod sampler;
pub mod shards;
pub mod text;
pub mod transforms;
pub mod workers;

use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use loader::{resize, Batch, Loader, LoaderConfig};
pub use sampler::Sampler;

/// Name of the marker file that [`generate`] leaves beside generated data, so that every run
/// on it can say so.
pub const GENERATED_MARKER: &str = "GENERATED.txt";

/// What `--dataset` names: a binary data set read whole into memory, or image files decoded
/// batch by batch (an image folder or tar shards, ImageNet-style).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetChoice {
    Cifar10,
    Mnist,
    /// torchvision's ImageFolder layout: `train/<class>/<image>`, `val/<class>/<image>`.
    Imagefolder,
    /// WebDataset-style tar shards (`train-000000.tar`: `<key>.jpg` + `<key>.cls`), as
    /// `prepare_data pack` writes them from an image folder.
    Shards,
}

impl DatasetChoice {
    pub fn name(self) -> &'static str {
        match self {
            DatasetChoice::Cifar10 => "cifar10",
            DatasetChoice::Mnist => "mnist",
            DatasetChoice::Imagefolder => "imagefolder",
            DatasetChoice::Shards => "shards",
        }
    }

    /// The binary data set, for those read into memory; `None` for image files.
    pub fn in_memory(self) -> Option<DatasetKind> {
        match self {
            DatasetChoice::Cifar10 => Some(DatasetKind::Cifar10),
            DatasetChoice::Mnist => Some(DatasetKind::Mnist),
            DatasetChoice::Imagefolder | DatasetChoice::Shards => None,
        }
    }
}

/// The image data sets the exercises know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetKind {
    Cifar10,
    Mnist,
}

impl DatasetKind {
    pub fn name(self) -> &'static str {
        match self {
            DatasetKind::Cifar10 => "cifar10",
            DatasetKind::Mnist => "mnist",
        }
    }

    /// Channels, height and width of one image.
    pub fn image_shape(self) -> [usize; 3] {
        match self {
            DatasetKind::Cifar10 => [3, 32, 32],
            DatasetKind::Mnist => [1, 28, 28],
        }
    }

    pub fn num_classes(self) -> usize {
        10
    }

    /// Per-channel mean and standard deviation of the training set (the usual torchvision values).
    pub fn normalization(self) -> Normalization {
        match self {
            DatasetKind::Cifar10 => Normalization { mean: &[0.4914, 0.4822, 0.4465], std: &[0.2470, 0.2435, 0.2616] },
            DatasetKind::Mnist => Normalization { mean: &[0.1307], std: &[0.3081] },
        }
    }

    /// What turns this data set's bytes into inputs under `scaling`: its [`normalization`](Self::normalization),
    /// or mean 0 and deviation 1 per channel (bytes / 255 exactly).
    pub fn input_normalization(self, scaling: InputScaling) -> Normalization {
        match (scaling, self) {
            (InputScaling::Standardized, _) => self.normalization(),
            (InputScaling::ToTensor, DatasetKind::Cifar10) => Normalization { mean: &[0.0; 3], std: &[1.0; 3] },
            (InputScaling::ToTensor, DatasetKind::Mnist) => Normalization { mean: &[0.0], std: &[1.0] },
        }
    }

    /// Where `make data` puts this data set.
    pub fn default_dir(self) -> PathBuf {
        PathBuf::from("data").join(self.name())
    }
}

/// What standardises an image data set's channels: `(x / 255 − mean) / std`, per channel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalization {
    pub mean: &'static [f64],
    pub std: &'static [f64],
}

/// How an image data set's bytes become the model's inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum InputScaling {
    /// Each channel standardised by the training set's mean and deviation (torchvision's
    /// `Normalize` after `ToTensor`).
    Standardized,
    /// Bytes / 255, in [0, 1], as `transforms.ToTensor()` alone leaves them: the LRZ course's
    /// CIFAR-10 scripts.
    ToTensor,
}

/// ImageNet's, as in torchvision's recipes (and for any image folder or shard set: the usual
/// choice for photographs, and what ImageNet-pretrained weights expect).
pub const IMAGENET_NORMALIZATION: Normalization = Normalization { mean: &[0.485, 0.456, 0.406], std: &[0.229, 0.224, 0.225] };

/// Train or test part of a data set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Test,
}

/// A labelled image data set in memory.
#[derive(Debug, Clone)]
pub struct ImageDataset {
    pub kind: DatasetKind,
    /// `len × C × H × W` bytes, shared with the loader's worker threads.
    /// (A `Vec` behind the `Arc`, not a slice: turning the read bytes into an `Arc<[u8]>` would
    /// copy all of them, 150 MB for CIFAR-10, at the moment memory is shortest.)
    pub images: Arc<Vec<u8>>,
    pub labels: Arc<[u8]>,
    /// True when the files were made by [`generate`], not downloaded.
    pub generated: bool,
}

impl ImageDataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Bytes in one image.
    pub fn image_bytes(&self) -> usize {
        self.kind.image_shape().iter().product()
    }

    pub fn image(&self, index: usize) -> &[u8] {
        let n = self.image_bytes();
        &self.images[index * n..(index + 1) * n]
    }
}

/// Reads one split of a data set from `dir` (see [`cifar10::read`] and [`mnist::read`] for
/// which files are looked for). A missing directory or file gets an error that names it and
/// says how to get the data.
pub fn load(kind: DatasetKind, dir: &Path, split: Split) -> anyhow::Result<ImageDataset> {
    not_a_file(dir)?;
    if !dir.is_dir() {
        anyhow::bail!(
            "data directory {} does not exist; run `make data` (downloads {} where a network exists, \
             else generates a stand-in) or pass --data-dir",
            dir.display(),
            kind.name()
        );
    }
    let (dir, (images, labels)) = match kind {
        DatasetKind::Cifar10 => {
            let dir = cifar10::locate(dir);
            let data = cifar10::read(&dir, split)?;
            (dir, data)
        }
        DatasetKind::Mnist => (dir.to_path_buf(), mnist::read(dir, split)?),
    };
    Ok(ImageDataset { kind, images: Arc::new(images), labels: labels.into(), generated: dir.join(GENERATED_MARKER).exists() })
}

/// The most bytes an image file may have (a JPEG of the most pixels allowed is far smaller): an
/// 8 GB sparse file or a link to /dev/zero named `.jpg` is refused, not read whole.
pub const MAX_IMAGE_FILE_BYTES: u64 = 256 << 20;

/// The most pixels an image may have: PIL's limit, twice its `MAX_IMAGE_PIXELS`, past which PIL
/// refuses an image as a decompression bomb (a 5 kB JPEG can claim 60000 × 60000 pixels: 10.8 GB
/// decoded, per decoding worker).
pub const MAX_IMAGE_PIXELS: u64 = 2 * 89_478_485;

/// A data directory given as a file is said to be one (not "does not exist").
pub(crate) fn not_a_file(dir: &Path) -> anyhow::Result<()> {
    if dir.is_file() {
        anyhow::bail!("--data-dir {} is a file, not a folder: give the folder that holds the data set's files", dir.display());
    }
    Ok(())
}

/// Reads a file whole, naming it in the error (see [`read_regular_file`]), with no size limit
/// but the memory's.
pub(crate) fn read_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    read_regular_file(path, u64::MAX, DATA_REMEDY)
}

/// What to do about a data file that is not a regular file.
pub(crate) const DATA_REMEDY: &str = "remove it from the data";

/// Reads a regular file whole, of at most `limit` bytes, naming it in every error. It is opened
/// without waiting (a FIFO with the right name would block a reader forever) and refused unless
/// it is a regular file (a FIFO, a device such as /dev/zero behind a link, a socket); its bytes
/// are reserved before they are read, so that a file larger than the memory left is one line
/// saying how much it needed, not an abort. `remedy` ends the line about a file of another kind.
pub(crate) fn read_regular_file(path: &Path, limit: u64, remedy: &str) -> anyhow::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let meta = file.metadata().with_context(|| format!("cannot read {}", path.display()))?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a folder"
        };
        anyhow::bail!("{} is not a regular file ({what}): {remedy}", path.display());
    }
    let size = meta.len();
    if size > limit {
        anyhow::bail!("{} is {size} bytes, more than the {limit} a file of this kind may have: not read", path.display());
    }
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(size as usize).map_err(|_| {
        anyhow::anyhow!("{}: cannot read it, its {:.1} MiB do not fit in the memory left to this process", path.display(), size as f64 / (1 << 20) as f64)
    })?;
    // A file that grows while read is read to the limit and refused past it.
    let read = file.take(limit.saturating_add(1)).read_to_end(&mut bytes).with_context(|| format!("cannot read {}", path.display()))?;
    if read as u64 > limit {
        anyhow::bail!("{} grew past {limit} bytes while it was read: not read", path.display());
    }
    Ok(bytes)
}

/// Checks that every label is a class index, naming the file otherwise.
pub(crate) fn check_labels(labels: &[u8], num_classes: usize, path: &Path) -> anyhow::Result<()> {
    if let Some(pos) = labels.iter().position(|&l| l as usize >= num_classes) {
        anyhow::bail!("{}: record {pos} has label {}, expected 0..{}: not a valid file of this data set", path.display(), labels[pos], num_classes - 1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small.jpg");
        std::fs::write(&small, b"12345").unwrap();
        assert_eq!(read_regular_file(&small, 5, DATA_REMEDY).unwrap(), b"12345");
        let err = read_regular_file(&small, 4, DATA_REMEDY).unwrap_err().to_string();
        assert!(err.contains("small.jpg is 5 bytes, more than the 4"), "{err}");
        let sparse = dir.path().join("sparse.jpg");
        std::fs::File::create(&sparse).unwrap().set_len(8 << 30).unwrap();
        assert!(read_regular_file(&sparse, MAX_IMAGE_FILE_BYTES, DATA_REMEDY).unwrap_err().to_string().contains("more than the 268435456"));
        let zero = dir.path().join("zero.jpg");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        assert!(read_regular_file(&zero, u64::MAX, DATA_REMEDY).unwrap_err().to_string().contains("zero.jpg is not a regular file (a device)"));
        let fifo = dir.path().join("fifo.jpg");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        // Opened without waiting for a writer: refused at once.
        assert!(read_regular_file(&fifo, u64::MAX, DATA_REMEDY).unwrap_err().to_string().contains("fifo.jpg is not a regular file (a FIFO)"));
        assert!(read_regular_file(dir.path(), u64::MAX, DATA_REMEDY).unwrap_err().to_string().contains("not a regular file (a folder)"));
    }
}
