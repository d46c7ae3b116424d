//! Turns an [`ImageDataset`] into batches on the training device.
//!
//! Batches are assembled on background worker threads (indexing, augmentation, conversion)
//! while the model trains, `prefetch` batches ahead per worker. For a CUDA device a worker
//! leaves the images as bytes in pinned memory: the copy to the GPU is then asynchronous and
//! four times smaller, and the conversion to normalised floats runs on the GPU.
//!
//! With `resident` (`--data-on-device`), the whole split is copied to the device once (CIFAR-10's
//! training set is 150 MB as bytes) and every batch is gathered, cropped, flipped and normalised
//! there: no worker threads, no copies per step. The order and the augmentation draws are the
//! same as the host path's (the same sampler and random streams), so the two give identical
//! batches (tested).
//!
//! With `resize` (`--image-size`), every batch is resized on the device, as the last step.
use super::workers::ordered_map;
use super::{ImageDataset, InputScaling, Normalization, Sampler};
use crate::train::{BatchSource, Batches};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// How a loader batches, orders and augments.
#[derive(Debug, Clone)]
pub struct LoaderConfig {
    pub batch_size: usize,
    /// A new order every epoch (training) or the data set's order (evaluation).
    pub shuffle: bool,
    /// Random crop with 4 pixels of zero padding, and a random horizontal flip.
    pub augment: bool,
    /// Drop a last, smaller batch.
    pub drop_last: bool,
    /// Background threads preparing batches; 0 prepares them in the training thread.
    pub workers: usize,
    /// Ready batches each worker may hold ahead of the training thread.
    pub prefetch: usize,
    /// Seeds the order and the augmentation (each a function of seed, epoch and batch).
    pub seed: u64,
    pub device: Device,
    /// (rank, world size): this replica's shard of every epoch (see [`Sampler`]); (0, 1) for all.
    pub shard: (usize, usize),
    /// Keep the whole split on the device and assemble batches there (see the module docs).
    pub resident: bool,
    /// Resize every image to this side × side on the training device, after augmentation and
    /// normalisation ([`resize`]); `None` keeps the data set's size.
    pub resize: Option<i64>,
    /// Standardised by the data set's statistics, or only scaled to [0, 1].
    pub scaling: InputScaling,
}

impl LoaderConfig {
    /// The course's training loader: shuffled, 2 workers, 4 batches ahead each.
    pub fn train(batch_size: usize, seed: u64, device: Device) -> Self {
        LoaderConfig {
            batch_size,
            shuffle: true,
            augment: false,
            drop_last: false,
            workers: 2,
            prefetch: 4,
            seed,
            device,
            shard: (0, 1),
            resident: false,
            resize: None,
            scaling: InputScaling::Standardized,
        }
    }

    /// An evaluation loader: data set order, no augmentation, nothing dropped.
    pub fn eval(batch_size: usize, device: Device) -> Self {
        LoaderConfig { shuffle: false, ..Self::train(batch_size, 0, device) }
    }

    /// Batches an epoch of `samples` makes: the last, smaller one kept unless `drop_last`.
    pub fn batches(&self, samples: usize) -> usize {
        match self.drop_last {
            true => samples / self.batch_size,
            false => samples.div_ceil(self.batch_size),
        }
    }
}

pub use crate::train::Batch;

pub struct Loader {
    dataset: ImageDataset,
    sampler: Sampler,
    config: LoaderConfig,
    /// The split's images `[N, C, H, W]` (bytes) and labels on the device, with `resident`.
    on_device: Option<(Tensor, Tensor)>,
}

impl Loader {
    pub fn new(dataset: ImageDataset, config: LoaderConfig) -> Self {
        assert!(config.batch_size > 0, "batch size must be positive");
        let (rank, world_size) = config.shard;
        let sampler = Sampler::new(dataset.len(), config.shuffle, config.seed).sharded(rank, world_size);
        let on_device = config.resident.then(|| {
            let [c, h, w] = dataset.kind.image_shape();
            let images = Tensor::from_slice(&dataset.images).view([dataset.len() as i64, c as i64, h as i64, w as i64]);
            let labels = Tensor::from_slice(&dataset.labels).to_kind(Kind::Int64);
            (images.to_device(config.device), labels.to_device(config.device))
        });
        Loader { dataset, sampler, config, on_device }
    }

    pub fn dataset(&self) -> &ImageDataset {
        &self.dataset
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }
}

impl BatchSource for Loader {
    fn batches_per_epoch(&self) -> usize {
        self.config.batches(self.sampler.len())
    }

    fn epoch(&self, epoch: usize) -> Batches<'_> {
        self.epoch_from(epoch, 0)
    }

    /// Neither the skipped batches' images nor their augmentation draws are touched: each
    /// batch's draws are a function of (seed, epoch, batch), not of the batches before it.
    fn epoch_from(&self, epoch: usize, first: usize) -> Batches<'_> {
        match &self.on_device {
            Some(resident) => Box::new(self.resident_batches(resident, epoch, first).map(Ok)),
            None => self.epoch_batches_from(epoch, first),
        }
    }
}

impl Loader {
    /// The batches of one epoch from the device-resident split: gathered, augmented and
    /// normalised on the device.
    fn resident_batches<'a>(&'a self, (images, labels): &'a (Tensor, Tensor), epoch: usize, first: usize) -> impl Iterator<Item = Batch> + 'a {
        let indices = self.sampler.indices(epoch);
        let size = self.config.batch_size;
        let device = self.config.device;
        (first.min(self.batches_per_epoch())..self.batches_per_epoch()).map(move |batch| {
            let chunk = &indices[batch * size..((batch + 1) * size).min(indices.len())];
            let index = Tensor::from_slice(&chunk.iter().map(|&i| i as i64).collect::<Vec<_>>()).to_device(device);
            let mut batch_images = images.index_select(0, &index);
            if self.config.augment {
                let draws = augmentation_draws(&self.config, epoch, batch, chunk.len());
                batch_images = crop_flip_on_device(&batch_images, &draws, AUGMENT_PADDING);
            }
            Batch {
                inputs: resize(&normalize(&batch_images, self.dataset.kind.input_normalization(self.config.scaling)), self.config.resize),
                targets: labels.index_select(0, &index),
            }
        })
    }

    /// The batches of one epoch, in a deterministic order.
    pub fn epoch_batches(&self, epoch: usize) -> Batches<'static> {
        self.epoch_batches_from(epoch, 0)
    }

    /// The batches of one epoch from batch `first` on: made on the worker threads, staged on
    /// the host, then copied to the device on the training thread.
    fn epoch_batches_from(&self, epoch: usize, first: usize) -> Batches<'static> {
        let job = Arc::new(EpochJob { dataset: self.dataset.clone(), indices: self.sampler.indices(epoch), epoch, config: self.config.clone() });
        let batches = first.min(self.batches_per_epoch())..self.batches_per_epoch();
        let maker = Arc::clone(&job);
        let staged = ordered_map(batches, self.config.workers, self.config.prefetch, move |batch| Ok(maker.host_batch(batch)));
        let (device, normalization, side) = (self.config.device, self.dataset.kind.input_normalization(self.config.scaling), self.config.resize);
        Box::new(staged.map(move |host| host.map(|host| host.into_device(device, normalization, side))))
    }
}

/// A batch as a worker leaves it: on the host, ready to be copied to the device (see [`stage`]).
pub(crate) struct HostBatch {
    images: Tensor,
    labels: Tensor,
}

/// Images `[B, C, H, W]` as bytes and their labels, as a worker hands them to the training
/// thread for `device`: on the CPU already as normalised floats; for a GPU left as bytes, in
/// pinned memory, for [`HostBatch::into_device`] to copy asynchronously (four times fewer bytes)
/// and normalise there.
pub(crate) fn stage(bytes: Vec<u8>, labels: Vec<i64>, shape: [i64; 4], normalization: Normalization, device: Device) -> HostBatch {
    use crate::torch_ext::filled_by;
    let labels = Tensor::from_slice(&labels);
    let plane = (shape[2] * shape[3]) as usize;
    match device {
        // Plain Rust, not LibTorch operations: a worker thread running LibTorch's parallel
        // kernels would start an OpenMP team of its own and compete with the training
        // thread's for the cores.
        Device::Cpu => HostBatch { images: filled_by(&shape, |floats| normalize_bytes_into(&bytes, normalization, plane, floats)), labels },
        // Pinned, so that the copy to the GPU runs asynchronously; should pinning ever fail
        // (it needs the CUDA runtime that the GPU run has), the copy just waits.
        Device::Cuda(_) => {
            let pin = |t: Tensor| crate::torch_ext::pin_memory(&t).unwrap_or(t);
            HostBatch { images: pin(filled_by(&shape, |out: &mut [u8]| out.copy_from_slice(&bytes))), labels: pin(labels) }
        }
        Device::Mps | Device::Vulkan => HostBatch { images: filled_by(&shape, |out: &mut [u8]| out.copy_from_slice(&bytes)), labels },
    }
}

impl HostBatch {
    /// On the training thread: the copy to the device, and there the conversion to floats and
    /// the resize to `side` (LibTorch operations, which the workers leave alone).
    pub(crate) fn into_device(self, device: Device, normalization: Normalization, side: Option<i64>) -> Batch {
        let batch = match device {
            Device::Cpu => Batch { inputs: self.images, targets: self.labels },
            device => {
                let images = self.images.to_device_(device, Kind::Uint8, true, false);
                let labels = self.labels.to_device_(device, Kind::Int64, true, false);
                Batch { inputs: normalize(&images, normalization), targets: labels }
            }
        };
        Batch { inputs: resize(&batch.inputs, side), ..batch }
    }
}

/// What the workers of one epoch share.
struct EpochJob {
    dataset: ImageDataset,
    indices: Vec<usize>,
    epoch: usize,
    config: LoaderConfig,
}

impl EpochJob {
    fn host_batch(&self, batch: usize) -> HostBatch {
        let size = self.config.batch_size;
        let indices = &self.indices[batch * size..((batch + 1) * size).min(self.indices.len())];
        let [c, h, w] = self.dataset.kind.image_shape();
        let per_image = c * h * w;
        let mut bytes = vec![0u8; indices.len() * per_image];
        let draws = match self.config.augment {
            true => augmentation_draws(&self.config, self.epoch, batch, indices.len()),
            false => Vec::new(),
        };
        for (i, (out, &index)) in bytes.chunks_exact_mut(per_image).zip(indices).enumerate() {
            let image = self.dataset.image(index);
            match draws.get(i) {
                Some(&draw) => crop_flip(image, out, [c, h, w], draw),
                None => out.copy_from_slice(image),
            }
        }
        let labels: Vec<i64> = indices.iter().map(|&i| self.dataset.labels[i] as i64).collect();
        let shape = [indices.len() as i64, c as i64, h as i64, w as i64];
        stage(bytes, labels, shape, self.dataset.kind.input_normalization(self.config.scaling), self.config.device)
    }
}

/// Bytes `[B, C, H, W]` → floats scaled to [0, 1] and standardised per channel, on the tensor's device.
pub fn normalize(images: &Tensor, Normalization { mean, std }: Normalization) -> Tensor {
    let options = (Kind::Float, images.device());
    let shape = [1, mean.len() as i64, 1, 1];
    let mean = Tensor::from_slice(mean).to_kind(Kind::Float).to_device(options.1).view(shape);
    let std = Tensor::from_slice(std).to_kind(Kind::Float).to_device(options.1).view(shape);
    (images.to_kind(Kind::Float) / 255.0 - mean) / std
}

/// Normalised images `[B, C, H, W]` resized to `side`×`side` on their device, as torchvision's
/// `Resize((side, side))` resizes each image: bilinear, half-pixel centres
/// (`align_corners=False`), antialiased when shrinking (PIL's filter, and torchvision's
/// `antialias=True` on tensors; when enlarging it is plain bilinear). The images themselves
/// unchanged when they already have that size or `side` is `None`.
///
/// After normalisation rather than before it, on floats rather than bytes: normalising is a
/// per-channel `a·x + b` and bilinear weights sum to 1, so the order changes nothing but
/// torchvision's rounding of the resized image to bytes.
pub fn resize(images: &Tensor, side: Option<i64>) -> Tensor {
    match side {
        Some(side) if images.size()[2..] != [side, side] => images.internal_upsample_bilinear2d_aa([side, side], false, None, None),
        _ => images.shallow_clone(),
    }
}

/// [`normalize`] on the host, without LibTorch: bytes of `[B, C, H, W]` images (`plane` = H·W
/// bytes per channel) → floats, the same float operations in the same order, so the same
/// floats bit for bit (tested for every byte value and channel).
pub fn normalize_bytes(bytes: &[u8], normalization: Normalization, plane: usize) -> Vec<f32> {
    let mut out = vec![0.0; bytes.len()];
    normalize_bytes_into(bytes, normalization, plane, &mut out);
    out
}

/// [`normalize_bytes`] into `out` (as long as `bytes`): each channel through a table of its 256
/// values, computed by the same float operations (so the same floats).
pub fn normalize_bytes_into(bytes: &[u8], Normalization { mean, std }: Normalization, plane: usize, out: &mut [f32]) {
    assert_eq!(bytes.len(), out.len(), "one float per byte");
    let tables: Vec<[f32; 256]> = mean
        .iter()
        .zip(std)
        .map(|(&m, &s)| {
            let (m, s) = (m as f32, s as f32);
            std::array::from_fn(|b| (b as f32 / 255.0 - m) / s)
        })
        .collect();
    for (i, (channel, out)) in bytes.chunks_exact(plane).zip(out.chunks_exact_mut(plane)).enumerate() {
        let table = &tables[i % tables.len()];
        for (out, &b) in out.iter_mut().zip(channel) {
            *out = table[b as usize];
        }
    }
}

/// Zero padding of the random crop (torchvision's `RandomCrop(32, padding=4)`).
const AUGMENT_PADDING: usize = 4;

/// One image's augmentation: the crop's shift (dy, dx) in −pad..=pad and whether to flip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Draw {
    dy: isize,
    dx: isize,
    flip: bool,
}

/// Draws the augmentation of the `n` images of `batch` in `epoch`: a random stream per (seed,
/// epoch, batch), so a batch gets the same draws whichever thread (or device) makes it.
fn augmentation_draws(config: &LoaderConfig, epoch: usize, batch: usize, n: usize) -> Vec<Draw> {
    let mut rng = batch_rng(config, epoch, batch);
    (0..n).map(|_| draw(&mut rng, AUGMENT_PADDING)).collect()
}

/// The random stream of the augmentation of `batch` in `epoch` on this replica.
pub(crate) fn batch_rng(config: &LoaderConfig, epoch: usize, batch: usize) -> ChaCha8Rng {
    // Each rank's batch b holds other images: give it other draws too (rank 0 keeps the
    // single-process stream).
    let seed = config.seed ^ (config.shard.0 as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    ChaCha8Rng::seed_from_u64(mix(seed, epoch as u64, batch as u64))
}

fn draw(rng: &mut ChaCha8Rng, pad: usize) -> Draw {
    let dy = rng.random_range(0..=2 * pad) as isize - pad as isize;
    let dx = rng.random_range(0..=2 * pad) as isize - pad as isize;
    Draw { dy, dx, flip: rng.random_bool(0.5) }
}

/// [`crop_flip`] for a whole batch `[B, C, H, W]` on its device: zero-pad by `pad`, then gather
/// each image's shifted (and mirrored) rows and columns.
fn crop_flip_on_device(images: &Tensor, draws: &[Draw], pad: usize) -> Tensor {
    let (b, _, h, w) = images.size4().expect("images are [B, C, H, W]");
    let device = images.device();
    let pad = pad as i64;
    let padded = images.constant_pad_nd([pad, pad, pad, pad]).permute([0, 2, 3, 1]); // [B, H+2p, W+2p, C]
    let offsets = |f: fn(&Draw) -> isize| Tensor::from_slice(&draws.iter().map(|d| f(d) as i64 + pad).collect::<Vec<_>>()).to_device(device);
    let rows = offsets(|d| d.dy).view([b, 1]) + Tensor::arange(h, (Kind::Int64, device)).view([1, h]);
    let flips = Tensor::from_slice(&draws.iter().map(|d| d.flip).collect::<Vec<_>>()).to_device(device).view([b, 1]);
    let x = Tensor::arange(w, (Kind::Int64, device)).view([1, w]);
    let columns = offsets(|d| d.dx).view([b, 1]) + x.where_self(&flips.logical_not(), &(x.g_mul_scalar(-1) + (w - 1)));
    let batch = Tensor::arange(b, (Kind::Int64, device)).view([b, 1, 1]);
    padded.index(&[Some(batch), Some(rows.view([b, h, 1])), Some(columns.view([b, 1, w]))]).permute([0, 3, 1, 2]).contiguous()
}

/// torchvision's `RandomCrop(size, padding)` followed by `RandomHorizontalFlip()`, on bytes,
/// with the shift and flip of `draw`.
fn crop_flip(src: &[u8], out: &mut [u8], [channels, height, width]: [usize; 3], Draw { dy, dx, flip }: Draw) {
    for c in 0..channels {
        for y in 0..height {
            let sy = y as isize + dy;
            for x in 0..width {
                let xc = if flip { width - 1 - x } else { x };
                let sx = xc as isize + dx;
                let inside = (0..height as isize).contains(&sy) && (0..width as isize).contains(&sx);
                out[(c * height + y) * width + x] = if inside { src[(c * height + sy as usize) * width + sx as usize] } else { 0 };
            }
        }
    }
}

/// A seed for (seed, epoch, batch), so each batch's augmentation is fixed whatever thread makes it.
pub(crate) fn mix(seed: u64, epoch: u64, batch: u64) -> u64 {
    let mut z = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ batch.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DatasetKind;

    /// `n` CIFAR-10-shaped images of distinct bytes (`(i · step) mod modulus`), labels 0..9 in turn.
    fn cifar_like(n: usize, step: usize, modulus: usize) -> ImageDataset {
        let images: Vec<u8> = (0..n * 3 * 32 * 32).map(|i| (i * step % modulus) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        ImageDataset { kind: DatasetKind::Cifar10, images: std::sync::Arc::new(images), labels: labels.into(), generated: true }
    }

    /// `ToTensor` inputs are the bytes / 255 exactly, on every path (workers or not); standardized
    /// ones are those, less the channel's mean, over its deviation.
    #[test]
    fn to_tensor_scales_bytes_into_0_1_and_standardized_uses_the_datasets_statistics() {
        use crate::train::BatchSource;
        let data = cifar_like(4, 7, 256);
        let expected = Tensor::from_slice(&data.images[..]).to_kind(Kind::Float).view([4, 3, 32, 32]) / 255.0;
        for workers in [0, 1] {
            let config = |scaling| LoaderConfig { workers, scaling, ..LoaderConfig::eval(4, Device::Cpu) };
            let batch = |scaling| Loader::new(data.clone(), config(scaling)).epoch(0).next().unwrap().unwrap().inputs;
            assert!(batch(InputScaling::ToTensor).equal(&expected), "workers {workers}");
            let (mean, std) =
                (Tensor::from_slice(&[0.4914f32, 0.4822, 0.4465]).view([1, 3, 1, 1]), Tensor::from_slice(&[0.2470f32, 0.2435, 0.2616]).view([1, 3, 1, 1]));
            let difference = (batch(InputScaling::Standardized) - (&expected - mean) / std).abs().max().double_value(&[]);
            assert!(difference < 1e-5, "workers {workers}: {difference}");
        }
    }

    #[test]
    fn crop_without_shift_or_flip_is_identity_and_flip_mirrors() {
        let [c, h, w] = [1, 2, 3];
        let src: Vec<u8> = (1..=6).collect();
        // Find seeds that draw (0, 0, no flip) and (0, 0, flip) by trying; the draw is deterministic.
        let mut seen = (false, false);
        for seed in 0..10_000 {
            let mut probe = ChaCha8Rng::seed_from_u64(seed);
            let dy = probe.random_range(0..=2usize);
            let dx = probe.random_range(0..=2usize);
            let flip = probe.random_bool(0.5);
            if dy != 1 || dx != 1 {
                continue;
            }
            let mut out = vec![0; 6];
            crop_flip(&src, &mut out, [c, h, w], draw(&mut ChaCha8Rng::seed_from_u64(seed), 1));
            if flip {
                assert_eq!(out, vec![3, 2, 1, 6, 5, 4]);
                seen.1 = true;
            } else {
                assert_eq!(out, src);
                seen.0 = true;
            }
            if seen == (true, true) {
                return;
            }
        }
        panic!("no seed drew both cases");
    }

    #[test]
    fn shifted_crop_pads_with_zeros() {
        let src: Vec<u8> = vec![9; 16];
        let mut zeros_seen = false;
        for seed in 0..50 {
            let mut out = vec![0; 16];
            crop_flip(&src, &mut out, [1, 4, 4], draw(&mut ChaCha8Rng::seed_from_u64(seed), 2));
            assert!(out.iter().all(|&v| v == 0 || v == 9));
            zeros_seen |= out.contains(&0);
        }
        assert!(zeros_seen, "a shifted crop must bring in zero padding");
    }

    #[test]
    fn device_resident_batches_equal_the_host_loaders() {
        // A small generated CIFAR-10-like set; on the CPU the resident path runs the same code
        // as on a GPU (gather, pad, index, normalise as tensors).
        let dataset = cifar_like(37, 7, 251);
        for (augment, shard) in [(false, (0, 1)), (true, (0, 1)), (true, (1, 2))] {
            let config = LoaderConfig { augment, shard, workers: 0, ..LoaderConfig::train(8, 5, Device::Cpu) };
            let host = Loader::new(dataset.clone(), config.clone());
            let resident = Loader::new(dataset.clone(), LoaderConfig { resident: true, ..config });
            for epoch in 0..2 {
                let (a, b): (Vec<Batch>, Vec<Batch>) = (host.epoch(epoch).map(Result::unwrap).collect(), resident.epoch(epoch).map(Result::unwrap).collect());
                assert_eq!(a.len(), b.len());
                for (x, y) in a.iter().zip(&b) {
                    assert!(x.inputs.equal(&y.inputs), "augment {augment}, shard {shard:?}, epoch {epoch}: images differ");
                    assert!(x.targets.equal(&y.targets));
                }
            }
        }
    }

    /// Values from PyTorch 2.11: `F.interpolate(x, size, mode="bilinear", align_corners=False,
    /// antialias=True)`, what torchvision's `Resize` runs on tensors.
    #[test]
    fn resize_is_torchvisions_antialiased_bilinear() {
        let values = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap();
        let close = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 * y.abs().max(1.0));
        // Enlarging: plain bilinear with half-pixel centres.
        let small = Tensor::from_slice(&[1f32, 2., 3., 4.]).view([1, 1, 2, 2]);
        let enlarged = resize(&small, Some(4));
        assert_eq!(enlarged.size(), [1, 1, 4, 4]);
        let expected = [1.0, 1.25, 1.75, 2.0, 1.5, 1.75, 2.25, 2.5, 2.5, 2.75, 3.25, 3.5, 3.0, 3.25, 3.75, 4.0];
        assert!(close(&values(&enlarged), &expected), "{:?}", values(&enlarged));
        // Shrinking: antialiased (plain bilinear would give 10.5, 24.5, 114.5, 160.5).
        let large = Tensor::arange(16, (Kind::Float, Device::Cpu)).square().view([1, 1, 4, 4]);
        let shrunk = values(&resize(&large, Some(2)));
        assert!(close(&shrunk, &[21.081633, 34.775513, 105.48979, 138.93877]), "{shrunk:?}");
        let six = Tensor::arange(36, (Kind::Float, Device::Cpu)).square().view([1, 1, 6, 6]);
        let four = values(&resize(&six, Some(4)));
        assert!(close(&four[..4], &[15.5625, 25.05556, 38.77778, 55.9375]) && close(&four[12..], &[799.6875, 880.7223, 968.1111, 1056.8125]), "{four:?}");
        // Batches and channels resize image by image; nothing to do keeps the tensor.
        let batch = Tensor::randn([3, 2, 5, 5], (Kind::Float, Device::Cpu));
        let resized = resize(&batch, Some(9));
        assert_eq!(resized.size(), [3, 2, 9, 9]);
        assert!(resized.get(2).get(1).equal(&resize(&batch.narrow(0, 2, 1).narrow(1, 1, 1), Some(9)).view([9, 9])));
        assert!(resize(&batch, Some(5)).equal(&batch) && resize(&batch, None).equal(&batch));
    }

    #[test]
    fn resized_batches_are_the_same_from_the_host_and_the_device_resident_split() {
        let dataset = cifar_like(21, 11, 253);
        let config = LoaderConfig { augment: true, workers: 2, resize: Some(48), ..LoaderConfig::train(8, 5, Device::Cpu) };
        let host: Vec<Batch> = Loader::new(dataset.clone(), config.clone()).epoch(0).map(Result::unwrap).collect();
        let resident: Vec<Batch> =
            Loader::new(dataset.clone(), LoaderConfig { resident: true, workers: 0, ..config.clone() }).epoch(0).map(Result::unwrap).collect();
        let plain: Vec<Batch> = Loader::new(dataset, LoaderConfig { resize: None, ..config }).epoch(0).map(Result::unwrap).collect();
        assert_eq!(host.len(), 3);
        for ((h, r), p) in host.iter().zip(&resident).zip(&plain) {
            assert_eq!(h.inputs.size()[1..], [3, 48, 48]);
            assert!(h.inputs.allclose(&r.inputs, 1e-5, 1e-5, false) && h.targets.equal(&r.targets));
            // The same images as without the resize, resized.
            assert!(h.inputs.equal(&resize(&p.inputs, Some(48))));
        }
    }

    #[test]
    fn an_epoch_resumed_after_k_batches_is_the_rest_of_that_epoch() {
        let dataset = cifar_like(45, 13, 251);
        for (workers, resident) in [(0, false), (3, false), (0, true)] {
            let config = LoaderConfig { augment: true, workers, resident, ..LoaderConfig::train(4, 9, Device::Cpu) };
            let loader = Loader::new(dataset.clone(), config);
            let whole: Vec<Batch> = loader.epoch(1).map(Result::unwrap).collect();
            for first in [0, 1, 5, whole.len() - 1, whole.len(), whole.len() + 3] {
                let rest: Vec<Batch> = loader.epoch_from(1, first).map(Result::unwrap).collect();
                assert_eq!(rest.len(), whole.len().saturating_sub(first), "workers {workers}, resident {resident}, from {first}");
                for (x, y) in whole[first.min(whole.len())..].iter().zip(&rest) {
                    assert!(x.inputs.equal(&y.inputs) && x.targets.equal(&y.targets), "workers {workers}, resident {resident}, from {first}");
                }
            }
        }
    }
}
