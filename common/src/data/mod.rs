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
    pub images: Arc<[u8]>,
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
    Ok(ImageDataset { kind, images: images.into(), labels: labels.into(), generated: dir.join(GENERATED_MARKER).exists() })
}

/// Reads a file whole, naming it in the error.
pub(crate) fn read_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Checks that every label is a class index, naming the file otherwise.
pub(crate) fn check_labels(labels: &[u8], num_classes: usize, path: &Path) -> anyhow::Result<()> {
    if let Some(pos) = labels.iter().position(|&l| l as usize >= num_classes) {
        anyhow::bail!("{}: record {pos} has label {}, expected 0..{}: not a valid file of this data set", path.display(), labels[pos], num_classes - 1);
    }
    Ok(())
}
