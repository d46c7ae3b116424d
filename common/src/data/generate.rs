//! Stand-in data sets for machines that cannot download the real ones, written in the
//! official binary formats so that they go through exactly the same readers.
//!
//! Each class is a plane wave of its own orientation, frequency and colour, with a random
//! phase per image under heavy Gaussian noise: a network has to learn oriented filters to
//! tell the classes apart (a linear model on raw pixels cannot, because of the random phase),
//! so accuracy on it measures learning, not chance. A [`GENERATED_MARKER`] file beside the
//! data makes every run on it say that it used generated data.
use super::{cifar10, mnist, DatasetKind, Split, GENERATED_MARKER};
use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::path::Path;

/// Sizes of the generated splits.
#[derive(Debug, Clone, Copy)]
pub struct GenerateConfig {
    pub train: usize,
    pub test: usize,
    pub seed: u64,
}

impl GenerateConfig {
    /// The real data set's sizes: CIFAR-10 50,000 + 10,000; MNIST 60,000 + 10,000.
    pub fn full(kind: DatasetKind) -> Self {
        let train = match kind {
            DatasetKind::Cifar10 => 50_000,
            DatasetKind::Mnist => 60_000,
        };
        GenerateConfig { train, test: 10_000, seed: 0 }
    }
}

/// Writes a generated data set of `kind` into `dir` (created if needed) in the official format.
pub fn generate(kind: DatasetKind, dir: &Path, config: GenerateConfig) -> anyhow::Result<()> {
    let files = cifar10::TRAIN_FILES.len();
    if kind == DatasetKind::Cifar10 {
        anyhow::ensure!(config.train >= files, "need at least {files} training images for {files} CIFAR-10 files");
    }
    // Each split is drawn whole in memory, then written: checked before either.
    let [channels, height, width] = kind.image_shape();
    let per_image = (channels * height * width + 1) as f64;
    let what = format!("{} train + {} test images of {}", config.train, config.test, kind.name());
    crate::resources::refuse_beyond_memory(&what, config.train.max(config.test) as f64 * per_image, "lower --train or --test")?;
    crate::resources::refuse_beyond_disk(
        dir,
        &what,
        (config.train as f64 + config.test as f64) * per_image,
        "lower --train or --test, or write elsewhere (--out)",
    )?;
    let note = format!(
        "GENERATED stand-in for {} (not the real data set): {} train + {} test images, seed {}.\n\
         Each class is a noisy plane wave of its own orientation and colour.\n\
         Delete this folder and run `make data` on a machine with network access for the real data.\n",
        kind.name(),
        config.train,
        config.test,
        config.seed
    );
    // The marker first: a generation cut short leaves a folder a rerun may replace.
    mark_generated(dir, &note)?;
    let (train_images, train_labels) = images(kind, config.train, config.seed);
    let (test_images, test_labels) = images(kind, config.test, config.seed.wrapping_add(1 << 32));
    match kind {
        DatasetKind::Cifar10 => {
            // The official release splits the training set over five equal files.
            for (i, name) in cifar10::TRAIN_FILES.iter().enumerate() {
                let range = (i * config.train / files)..((i + 1) * config.train / files);
                let bytes = cifar10::IMAGE_BYTES;
                cifar10::write(&dir.join(name), &train_images[range.start * bytes..range.end * bytes], &train_labels[range.clone()])?;
            }
            cifar10::write(&dir.join(cifar10::TEST_FILE), &test_images, &test_labels)?;
        }
        DatasetKind::Mnist => {
            mnist::write_split(dir, Split::Train, &train_images, &train_labels)?;
            mnist::write_split(dir, Split::Test, &test_images, &test_labels)?;
        }
    }
    Ok(())
}

/// Refuses to write a generated stand-in into `dir` where it holds anything and no
/// [`GENERATED_MARKER`]: data a generator did not write (the real MNIST `make data` fetched,
/// say, which a 10-image stand-in would replace) are replaced only when told (`force`).
pub fn check_may_replace(dir: &Path, force: bool) -> anyhow::Result<()> {
    if force || dir.join(GENERATED_MARKER).exists() {
        return Ok(());
    }
    let holds = match std::fs::read_dir(dir) {
        Ok(mut entries) => entries.next().is_some(),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => false,
        Err(err) => return Err(anyhow::Error::from(err).context(format!("cannot list {}", dir.display()))),
    };
    if holds {
        return crate::error::usage(format!(
            "{} holds data this tool did not generate (no {GENERATED_MARKER}): not replacing them with a stand-in; \
             choose another --out, or pass --force to replace them",
            dir.display()
        ));
    }
    Ok(())
}

/// Creates `dir` if need be and writes its [`GENERATED_MARKER`] saying what `note` says: first,
/// so that a generation cut short leaves a folder a rerun may replace ([`check_may_replace`]).
pub(crate) fn mark_generated(dir: &Path, note: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    crate::output::write(&dir.join(GENERATED_MARKER), note)
}

/// `count` images (bytes, `N × C × H × W`) and their labels, classes in rotation.
pub fn images(kind: DatasetKind, count: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let [channels, height, width] = kind.image_shape();
    let per_image = channels * height * width;
    let labels: Vec<u8> = (0..count).map(|i| (i % kind.num_classes()) as u8).collect();
    let mut data = vec![0u8; count * per_image];
    data.par_chunks_mut(per_image).zip(labels.par_iter()).enumerate().for_each(|(i, (image, &label))| {
        // One generator per image: the result does not depend on how rayon splits the work.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        draw_image(&mut rng, label as usize, [channels, height, width], image);
    });
    (data, labels)
}

fn draw_image(rng: &mut ChaCha8Rng, class: usize, [channels, height, width]: [usize; 3], out: &mut [u8]) {
    use std::f64::consts::TAU;
    // Orientation and frequency of the class's wave; colour weights per channel.
    let angle = class as f64 * std::f64::consts::PI / 10.0;
    let cycles = 2.0 + (class % 3) as f64;
    let (fx, fy) = (cycles * angle.cos() / width as f64, cycles * angle.sin() / height as f64);
    let phase = rng.random::<f64>() * TAU;
    for c in 0..channels {
        let colour = 0.6 + 0.4 * ((class + c * 3) as f64 * 1.3).sin();
        for y in 0..height {
            for x in 0..width {
                let wave = (TAU * (fx * x as f64 + fy * y as f64) + phase).cos();
                let value = 128.0 + 30.0 * colour * wave + 60.0 * gaussian(rng);
                out[(c * height + y) * width + x] = value.round().clamp(0.0, 255.0) as u8;
            }
        }
    }
}

/// A standard normal sample (Box–Muller).
fn gaussian(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// How big the images of a generated image folder are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PhotoSizes {
    /// About ImageNet's: 500×375 give or take a fifth, a fifth of them portrait, some square;
    /// JPEG quality 90 (what `make bench-data` decodes).
    Imagenet,
    /// 40 to 90 pixels a side, for tests and CI-sized runs.
    Small,
}

/// What [`image_folder`] writes.
#[derive(Debug, Clone, Copy)]
pub struct FolderConfig {
    pub classes: usize,
    /// Images per class in `train/` and in `val/`.
    pub train_per_class: usize,
    pub val_per_class: usize,
    pub sizes: PhotoSizes,
    /// Besides RGB JPEGs, a grey-scale JPEG and an RGBA PNG in every class (the cases a
    /// decoder must turn into RGB, as PIL's `convert("RGB")` does).
    pub mixed_formats: bool,
    pub seed: u64,
}

/// JPEG quality of the generated photographs (torchvision's and ImageNet's usual range).
pub const JPEG_QUALITY: u8 = 90;

/// Writes a generated image folder into `dir`: `train/<class>/*` and `val/<class>/*` in
/// torchvision's `ImageFolder` layout, classes `c000`, `c001`, … with ImageNet's `.JPEG`
/// extension. Each image is its class's plane wave (as in the binary stand-ins) at a random
/// phase, over smooth random shading and pixel noise, so that JPEG files come out about as
/// large and slow to decode as photographs of the same size.
pub fn image_folder(dir: &Path, config: FolderConfig) -> anyhow::Result<()> {
    let note = format!(
        "GENERATED stand-in image folder (not a real data set): {} classes, {} train + {} val images per class, seed {}.\n\
         Each class is a noisy plane wave of its own orientation and colour, written as JPEG (quality {JPEG_QUALITY}).\n",
        config.classes, config.train_per_class, config.val_per_class, config.seed
    );
    // Its list of images is held in memory, and each photograph takes at least this much on disk
    // (a JPEG of quality 90 of the smallest size drawn): checked before the first is written.
    let images = config.classes as f64 * (config.train_per_class as f64 + config.val_per_class as f64);
    let what = format!("{} classes × {} train + {} val images", config.classes, config.train_per_class, config.val_per_class);
    let least_bytes = match config.sizes {
        PhotoSizes::Imagenet => 10_000.0,
        PhotoSizes::Small => 500.0,
    };
    crate::resources::refuse_beyond_memory(&what, images * 64.0, "lower --classes, --train or --val")?;
    crate::resources::refuse_beyond_disk(dir, &what, images * least_bytes, "lower --classes, --train or --val, or write elsewhere (--out)")?;
    mark_generated(dir, &note)?;
    for (split, per_class, salt) in [("train", config.train_per_class, 0u64), ("val", config.val_per_class, 1 << 40)] {
        let jobs: Vec<(usize, usize)> = (0..config.classes).flat_map(|class| (0..per_class).map(move |i| (class, i))).collect();
        jobs.par_iter().try_for_each(|&(class, i)| -> anyhow::Result<()> {
            let folder = dir.join(split).join(format!("c{class:03}"));
            std::fs::create_dir_all(&folder).with_context(|| format!("cannot create {}", folder.display()))?;
            let mut rng = ChaCha8Rng::seed_from_u64(config.seed ^ salt ^ ((class * per_class + i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let (width, height) = photo_size(&mut rng, config.sizes);
            let photo = draw_photo(&mut rng, class, width, height);
            let (name, bytes) = match (config.mixed_formats, i) {
                (true, 0) => ("png", encode(&image::DynamicImage::ImageRgba8(image::DynamicImage::ImageRgb8(photo).into_rgba8()), image::ImageFormat::Png)?),
                (true, 1) => ("jpg", encode(&image::DynamicImage::ImageLuma8(image::DynamicImage::ImageRgb8(photo).into_luma8()), image::ImageFormat::Jpeg)?),
                _ => ("JPEG", encode(&image::DynamicImage::ImageRgb8(photo), image::ImageFormat::Jpeg)?),
            };
            let path = folder.join(format!("c{class:03}_{i:06}.{name}"));
            crate::output::write(&path, bytes)
        })?;
    }
    Ok(())
}

fn photo_size(rng: &mut ChaCha8Rng, sizes: PhotoSizes) -> (u32, u32) {
    match sizes {
        PhotoSizes::Imagenet => {
            let scale = rng.random_range(0.8..1.2);
            let (long, short) = ((500.0 * scale) as u32, (375.0 * scale) as u32);
            match rng.random_range(0..10) {
                0..=6 => (long, short),
                7..=8 => (short, long),
                _ => (short, short),
            }
        }
        PhotoSizes::Small => (rng.random_range(40..=90), rng.random_range(40..=90)),
    }
}

fn draw_photo(rng: &mut ChaCha8Rng, class: usize, width: u32, height: u32) -> image::RgbImage {
    use std::f64::consts::TAU;
    let angle = class as f64 * std::f64::consts::PI / 10.0;
    let cycles = 3.0 + (class % 4) as f64;
    let (fx, fy) = (cycles * angle.cos() / width as f64, cycles * angle.sin() / height as f64);
    let phase = rng.random::<f64>() * TAU;
    // Smooth shading: a slow wave of random direction, the same for every class.
    let (sx, sy, shade_phase) = (rng.random_range(-1.5..1.5) / width as f64, rng.random_range(-1.5..1.5) / height as f64, rng.random::<f64>() * TAU);
    let colours: Vec<f64> = (0..3).map(|c| 0.6 + 0.4 * ((class + c * 3) as f64 * 1.3).sin()).collect();
    image::RgbImage::from_fn(width, height, |x, y| {
        let (x, y) = (x as f64, y as f64);
        let wave = (TAU * (fx * x + fy * y) + phase).cos();
        let shade = 40.0 * (TAU * (sx * x + sy * y) + shade_phase).sin();
        image::Rgb(std::array::from_fn(|c| (128.0 + shade + 50.0 * colours[c] * wave + 10.0 * gaussian(rng)).round().clamp(0.0, 255.0) as u8))
    })
}

fn encode(image: &image::DynamicImage, format: image::ImageFormat) -> anyhow::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    match format {
        image::ImageFormat::Jpeg => image.write_with_encoder(image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, JPEG_QUALITY))?,
        format => image.write_to(&mut std::io::Cursor::new(&mut bytes), format)?,
    }
    Ok(bytes)
}
