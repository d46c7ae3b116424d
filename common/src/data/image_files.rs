//! Batches from image files (ImageNet-style data): an image folder or tar shards, decoded and
//! transformed on the loader's worker threads.
//!
//! Each batch is made by one worker ([`super::workers`]): it reads its images' bytes (a folder's
//! files, read by the worker itself; a shard's samples, read in order by the feeder thread),
//! decodes them, applies the [`Transform`] and stages the batch for the device as the in-memory
//! loader does (normalised floats for the CPU; bytes in pinned memory for a GPU, normalised
//! there). The random crops and flips of batch `b` come from a stream seeded by (seed, rank,
//! epoch, b) and each image's own sub-stream: a seeded epoch is the same batches with any number
//! of workers, on any machine.
//!
//! Which images an epoch visits, and on which replica:
//! - a folder: [`Sampler`] as for data in memory (torch's `DistributedSampler`: a seeded
//!   permutation per epoch, padded to divide evenly, replica `r` of `w` taking every `w`-th);
//! - shards: each epoch a seeded permutation of the shards, replica `r` of `w` streaming every
//!   `w`-th (disjoint, as WebDataset's `split_by_node`), its samples mixed by a seeded shuffle
//!   buffer. So that every replica takes the same number of steps, a training epoch takes on
//!   each replica as many samples as the fewest any replica can be dealt: the sum of the
//!   `⌊shards / w⌋` smallest shards. The few left over are other ones every epoch. Evaluation
//!   (in order) takes every sample of the replica's shards.
//!
//! Streamed shards are read by the feeder thread alone, in order (sequential reads, what a
//! parallel file system serves best); the workers decode. A seeded epoch is therefore the same
//! samples in the same batches whatever the number of workers.
use super::image_folder::ImageFolder;
use super::loader::{batch_rng, stage, HostBatch, LoaderConfig};
use super::shards::{shuffle_buffer, EncodedSample, ShardSet};
use super::transforms::{Scratch, Transform};
use super::workers::ordered_map;
use super::{Normalization, Sampler, IMAGENET_NORMALIZATION};
use crate::train::{BatchSource, Batches};
use anyhow::{Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

/// Where a split's images are.
#[derive(Debug, Clone)]
pub enum ImageFiles {
    Folder(Arc<ImageFolder>),
    Shards(Arc<ShardSet>),
}

impl ImageFiles {
    /// Images in the split.
    pub fn len(&self) -> usize {
        match self {
            ImageFiles::Folder(folder) => folder.len(),
            ImageFiles::Shards(shards) => shards.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn classes(&self) -> &[String] {
        match self {
            ImageFiles::Folder(folder) => &folder.classes,
            ImageFiles::Shards(shards) => shards.classes(),
        }
    }
}

/// An image file's bytes, its label, and a name for errors (the file, or the shard and key).
struct Encoded {
    bytes: Vec<u8>,
    label: usize,
    name: String,
}

impl From<EncodedSample> for Encoded {
    fn from(sample: EncodedSample) -> Self {
        Encoded { bytes: sample.bytes, label: sample.label, name: format!("{}: sample {}", sample.shard, sample.key) }
    }
}

/// A [`BatchSource`] over image files.
pub struct ImageFileLoader {
    files: ImageFiles,
    transform: Transform,
    config: LoaderConfig,
    sampler: Sampler,
    /// Shards: the samples the shuffle buffer holds (0 or 1: none).
    shuffle_buffer: usize,
}

/// Every image file is standardised with ImageNet's statistics.
const NORMALIZATION: Normalization = IMAGENET_NORMALIZATION;

impl ImageFileLoader {
    /// `config`'s batch size, order, workers, prefetch, seed, device and shard apply; its
    /// in-memory options (augment, resident, resize) do not: `transform` says what is done.
    pub fn new(files: ImageFiles, transform: Transform, config: LoaderConfig) -> Self {
        assert!(config.batch_size > 0, "batch size must be positive");
        let (rank, world) = config.shard;
        let sampler = Sampler::new(files.len(), config.shuffle, config.seed).sharded(rank, world);
        ImageFileLoader { files, transform, config, sampler, shuffle_buffer: 0 }
    }

    /// Shards: mix the streamed samples in a buffer of `size` (when shuffling).
    pub fn with_shuffle_buffer(self, size: usize) -> Self {
        ImageFileLoader { shuffle_buffer: size, ..self }
    }

    /// Images this replica takes per epoch (see the module docs).
    pub fn samples_per_epoch(&self) -> usize {
        let (rank, world) = self.config.shard;
        match &self.files {
            ImageFiles::Folder(_) => self.sampler.len(),
            ImageFiles::Shards(set) if self.config.shuffle => set.samples_per_rank(world),
            ImageFiles::Shards(set) => set.rank_shards(0, self.config.seed, false, rank, world).iter().map(|&i| set.shards()[i].samples).sum(),
        }
    }
}

impl BatchSource for ImageFileLoader {
    fn batches_per_epoch(&self) -> usize {
        self.config.batches(self.samples_per_epoch())
    }

    fn epoch(&self, epoch: usize) -> Batches<'_> {
        self.epoch_from(epoch, 0)
    }

    /// The skipped batches are not decoded (a folder's files not even read; a shard stream is
    /// read past them).
    fn epoch_from(&self, epoch: usize, first: usize) -> Batches<'_> {
        let size = self.config.batch_size;
        let batches = first.min(self.batches_per_epoch())..self.batches_per_epoch();
        let maker = BatchMaker { transform: self.transform, config: self.config.clone(), epoch };
        let staged = match &self.files {
            ImageFiles::Folder(folder) => {
                let (folder, indices) = (Arc::clone(folder), self.sampler.indices(epoch));
                let jobs = batches.map(move |batch| {
                    let chunk = &indices[batch * size..((batch + 1) * size).min(indices.len())];
                    (batch, chunk.iter().map(|&i| folder.samples[i].clone()).collect::<Vec<_>>())
                });
                ordered_map(jobs, self.config.workers, self.config.prefetch, move |(batch, samples)| {
                    let encoded = samples.into_iter().map(|sample| {
                        let name = sample.path.display().to_string();
                        let bytes = crate::input::read(&sample.path, super::MAX_IMAGE_FILE_BYTES, super::DATA_REMEDY)?;
                        Ok(Encoded { bytes, label: sample.label, name })
                    });
                    maker.make(batch, encoded)
                })
            }
            ImageFiles::Shards(set) => {
                let (config, (rank, world)) = (&self.config, self.config.shard);
                let stream = set.stream(set.rank_shards(epoch, config.seed, config.shuffle, rank, world));
                let stream: Box<dyn Iterator<Item = Result<EncodedSample>> + Send> = match config.shuffle {
                    true => Box::new(shuffle_buffer(stream, self.shuffle_buffer, batch_rng(config, epoch, usize::MAX).random())),
                    false => Box::new(stream),
                };
                let mut samples = stream.take(self.samples_per_epoch()).skip(batches.start * size);
                let jobs = batches.map(move |batch| (batch, samples.by_ref().take(size).collect::<Vec<_>>()));
                ordered_map(jobs, self.config.workers, self.config.prefetch, move |(batch, samples)| {
                    maker.make(batch, samples.into_iter().map(|sample| sample.map(Encoded::from)))
                })
            }
        };
        let device = self.config.device;
        Box::new(staged.map(move |host| host.map(|host| host.into_device(device, NORMALIZATION, None))))
    }
}

/// What a worker needs to make any batch of one epoch.
struct BatchMaker {
    transform: Transform,
    config: LoaderConfig,
    epoch: usize,
}

impl BatchMaker {
    /// Decodes and transforms the images of batch `batch` into one staged batch.
    fn make(&self, batch: usize, images: impl ExactSizeIterator<Item = Result<Encoded>>) -> Result<HostBatch> {
        let side = self.transform.size() as usize;
        let per_image = 3 * side * side;
        let mut bytes = vec![0u8; images.len() * per_image];
        let mut labels = Vec::with_capacity(images.len());
        let seed = batch_rng(&self.config, self.epoch, batch).get_seed();
        let mut scratch = Scratch::default();
        for (i, (image, out)) in images.zip(bytes.chunks_exact_mut(per_image)).enumerate() {
            let image = image?;
            let mut rng = ChaCha8Rng::from_seed(seed);
            rng.set_stream(i as u64);
            self.transform.apply(&image.bytes, out, &mut rng, &mut scratch).with_context(|| image.name.clone())?;
            labels.push(image.label as i64);
        }
        let shape = [labels.len() as i64, 3, side as i64, side as i64];
        Ok(stage(bytes, labels, shape, NORMALIZATION, self.config.device))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::generate::{self, FolderConfig, PhotoSizes};
    use crate::data::shards::{self, ShardSet};
    use crate::data::Split;
    use tch::{Device, Kind, Tensor};

    /// A generated folder (3 classes × 8 training images of 40–90 pixels, a grey JPEG and an
    /// RGBA PNG among each class's) and its packing into shards of 5.
    fn folder_and_shards() -> (tempfile::TempDir, ImageFiles, ImageFiles) {
        let dir = tempfile::tempdir().unwrap();
        let config = FolderConfig { classes: 3, train_per_class: 8, val_per_class: 1, sizes: PhotoSizes::Small, mixed_formats: true, seed: 4 };
        generate::image_folder(&dir.path().join("folder"), config).unwrap();
        let folder = ImageFolder::scan_split(&dir.path().join("folder"), Split::Train, None).unwrap();
        let packed = dir.path().join("shards");
        let written = shards::pack(&folder, &packed, Split::Train, 5, 0).unwrap();
        shards::write_index(&packed, Split::Train, &folder.classes, &written).unwrap();
        let set = ShardSet::open(&packed, Split::Train).unwrap();
        (dir, ImageFiles::Folder(Arc::new(folder)), ImageFiles::Shards(Arc::new(set)))
    }

    fn config(workers: usize, shard: (usize, usize)) -> LoaderConfig {
        LoaderConfig { workers, prefetch: 2, shard, ..LoaderConfig::train(4, 7, Device::Cpu) }
    }

    fn epoch(loader: &ImageFileLoader, epoch: usize) -> Vec<(Tensor, Tensor)> {
        loader.epoch(epoch).map(|batch| batch.map(|b| (b.inputs, b.targets))).collect::<Result<_>>().unwrap()
    }

    fn same(a: &[(Tensor, Tensor)], b: &[(Tensor, Tensor)]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|((x, y), (u, v))| x.equal(u) && y.equal(v))
    }

    #[test]
    fn a_seeded_epoch_is_the_same_batches_with_any_number_of_workers() {
        let (_dir, folder, shards) = folder_and_shards();
        for files in [folder, shards] {
            let transform = Transform::RandomResizedCrop { size: 32 };
            let inline = ImageFileLoader::new(files.clone(), transform, config(0, (0, 1))).with_shuffle_buffer(6);
            let reference = epoch(&inline, 1);
            assert_eq!(reference.len(), inline.batches_per_epoch());
            assert_eq!(reference[0].0.size(), [4, 3, 32, 32], "grey and RGBA images come out as RGB like the rest");
            assert_eq!(reference[0].0.kind(), Kind::Float);
            for workers in [1, 3] {
                let threaded = ImageFileLoader::new(files.clone(), transform, config(workers, (0, 1))).with_shuffle_buffer(6);
                assert!(same(&epoch(&threaded, 1), &reference), "{workers} workers, {files:?}");
            }
            // Another epoch is another order and other crops; the same epoch again is the same.
            assert!(!same(&epoch(&inline, 2), &reference));
            assert!(same(&epoch(&inline, 1), &reference));
            // A resumed epoch is the rest of it.
            let rest: Vec<(Tensor, Tensor)> = inline.epoch_from(1, 2).map(|b| b.map(|b| (b.inputs, b.targets))).collect::<Result<_>>().unwrap();
            assert!(same(&rest, &reference[2..]));
        }
    }

    /// Every image once: its fingerprint (the sum of its deterministic transform's bytes) and label.
    fn fingerprints(loader: &ImageFileLoader) -> Vec<(i64, i64)> {
        epoch(loader, 3)
            .iter()
            .flat_map(|(images, labels)| {
                let sums = Vec::<f64>::try_from(images.sum_dim_intlist(&[1i64, 2, 3][..], false, Kind::Double)).unwrap();
                sums.into_iter().map(|s| (s * 1e3).round() as i64).zip(Vec::<i64>::try_from(labels).unwrap()).collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn replicas_read_disjoint_parts_and_take_the_same_steps() {
        let (_dir, folder, shards) = folder_and_shards();
        let transform = Transform::Resize { size: 16 };
        let whole: std::collections::HashSet<(i64, i64)> =
            fingerprints(&ImageFileLoader::new(folder.clone(), transform, config(0, (0, 1)))).into_iter().collect();
        assert_eq!(whole.len(), 24, "24 different images");
        for files in [folder, shards.clone()] {
            let ranks: Vec<ImageFileLoader> =
                (0..2).map(|rank| ImageFileLoader::new(files.clone(), transform, config(2, (rank, 2))).with_shuffle_buffer(4)).collect();
            assert_eq!(ranks[0].batches_per_epoch(), ranks[1].batches_per_epoch(), "{files:?}");
            let (a, b) = (fingerprints(&ranks[0]), fingerprints(&ranks[1]));
            assert!(a.iter().chain(&b).all(|image| whole.contains(image)), "{files:?}: labels as the folder's");
            let (a, b): (std::collections::HashSet<_>, std::collections::HashSet<_>) = (a.into_iter().collect(), b.into_iter().collect());
            match files {
                // The sampler's padding repeats images only to make the ranks' shares equal.
                ImageFiles::Folder(_) => assert_eq!(a.len() + b.len(), 24),
                // 24 samples in shards of 5, 5, 5, 5, 4: each rank takes 9 (the two smallest).
                ImageFiles::Shards(_) => assert_eq!((a.len(), b.len()), (9, 9)),
            }
            assert!(a.is_disjoint(&b), "{files:?}: the replicas read different images");
        }
        let ImageFiles::Shards(set) = &shards else { unreachable!() };
        assert_eq!(set.samples_per_rank(2), 9);
    }

    #[test]
    fn an_image_that_does_not_decode_stops_the_epoch_with_its_name() {
        let (dir, _, _) = folder_and_shards();
        let broken = dir.path().join("folder/train/c001/c001_000005.JPEG");
        let bytes = std::fs::read(&broken).unwrap();
        std::fs::write(&broken, &bytes[..bytes.len() / 2]).unwrap();
        let folder = ImageFolder::scan_split(&dir.path().join("folder"), Split::Train, None).unwrap();
        let loader = ImageFileLoader::new(ImageFiles::Folder(Arc::new(folder)), Transform::Resize { size: 16 }, config(2, (0, 1)));
        let error = loader.epoch(0).find_map(|batch| batch.err()).expect("a batch fails");
        let message = format!("{error:#}");
        assert!(message.contains("c001_000005.JPEG") && message.contains("cannot decode"), "{message}");
    }
}
