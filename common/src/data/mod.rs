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
    crate::input::folder(
        dir,
        "data directory",
        &format!("run `make data` (downloads {} where a network exists, else generates a stand-in) or pass --data-dir", kind.name()),
    )?;
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

/// Reads a data file whole, naming it in the error (see [`crate::input::read`]), with no size
/// limit but the memory's.
pub(crate) fn read_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    crate::input::read(path, u64::MAX, DATA_REMEDY)
}

/// What to do about a data file that is not a regular file.
pub(crate) const DATA_REMEDY: &str = "remove it from the data";

/// Checks that every label is a class index, naming the file otherwise.
pub(crate) fn check_labels(labels: &[u8], num_classes: usize, path: &Path) -> anyhow::Result<()> {
    if let Some(pos) = labels.iter().position(|&l| l as usize >= num_classes) {
        anyhow::bail!("{}: record {pos} has label {}, expected 0..{}: not a valid file of this data set", path.display(), labels[pos], num_classes - 1);
    }
    Ok(())
}
