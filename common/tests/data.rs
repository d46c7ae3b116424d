//! Readers, generated stand-ins and the loader, on generated files and on real MNIST digits.
mod support;

use common::data::generate::{self, GenerateConfig};
use common::data::{self, cifar10, mnist, DatasetKind, Loader, LoaderConfig, Split};
use common::train::BatchSource;
use std::collections::HashSet;
use std::path::Path;
use tch::{Device, Kind, Tensor};

fn generated(kind: DatasetKind, train: usize, test: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    generate::generate(kind, dir.path(), GenerateConfig { train, test, seed: 7 }).unwrap();
    dir
}

fn error_of<T: std::fmt::Debug>(result: anyhow::Result<T>) -> String {
    format!("{:#}", result.expect_err("expected an error"))
}

#[test]
fn generated_cifar10_reads_back_exactly_in_the_official_layout() {
    let dir = generated(DatasetKind::Cifar10, 50, 20);
    for name in cifar10::TRAIN_FILES.iter().chain([&cifar10::TEST_FILE]) {
        let len = std::fs::metadata(dir.path().join(name)).unwrap().len() as usize;
        assert_eq!(len % 3073, 0, "{name}: whole 3,073-byte records");
    }
    assert_eq!(std::fs::metadata(dir.path().join("data_batch_3.bin")).unwrap().len(), 10 * 3073);
    let train = data::load(DatasetKind::Cifar10, dir.path(), Split::Train).unwrap();
    let test = data::load(DatasetKind::Cifar10, dir.path(), Split::Test).unwrap();
    assert_eq!((train.len(), test.len()), (50, 20));
    assert!(train.generated && test.generated, "the GENERATED marker is seen");
    let (images, labels) = generate::images(DatasetKind::Cifar10, 50, 7);
    assert_eq!(&train.images[..], &images[..]);
    assert_eq!(&train.labels[..], &labels[..]);
    // The record layout: label byte, then the red plane first.
    let raw = std::fs::read(dir.path().join("data_batch_1.bin")).unwrap();
    assert_eq!(raw[3073], labels[1]);
    assert_eq!(&raw[3074..3074 + 1024], &images[3072..3072 + 1024]);
}

#[test]
fn cifar10_is_found_inside_the_archive_folder() {
    let outer = tempfile::tempdir().unwrap();
    let nested = outer.path().join(cifar10::ARCHIVE_DIR);
    generate::generate(DatasetKind::Cifar10, &nested, GenerateConfig { train: 10, test: 5, seed: 1 }).unwrap();
    let test = data::load(DatasetKind::Cifar10, outer.path(), Split::Test).unwrap();
    assert_eq!(test.len(), 5);
}

#[test]
fn generated_mnist_round_trips_through_gzip_idx() {
    let dir = generated(DatasetKind::Mnist, 30, 10);
    assert!(dir.path().join("train-images-idx3-ubyte.gz").exists());
    let train = data::load(DatasetKind::Mnist, dir.path(), Split::Train).unwrap();
    let (images, labels) = generate::images(DatasetKind::Mnist, 30, 7);
    assert_eq!((&train.images[..], &train.labels[..]), (&images[..], &labels[..]));
    assert_eq!(train.image_bytes(), 784);
}

#[test]
fn raw_idx_files_read_like_gzipped_ones() {
    let dir = tempfile::tempdir().unwrap();
    let images: Vec<u8> = (0..3 * 784).map(|i| (i % 251) as u8).collect();
    mnist::write_idx(&dir.path().join("t10k-images-idx3-ubyte"), &[3, 28, 28], &images).unwrap();
    mnist::write_idx(&dir.path().join("t10k-labels-idx1-ubyte"), &[3], &[4, 0, 9]).unwrap();
    let (read_images, read_labels) = mnist::read(dir.path(), Split::Test).unwrap();
    assert_eq!(read_images, images);
    assert_eq!(read_labels, vec![4, 0, 9]);
}

#[test]
fn real_mnist_sample_reads_with_the_documented_counts() {
    let dir = support::shared_data("mnist-5k");
    let train = data::load(DatasetKind::Mnist, &dir, Split::Train).unwrap();
    let test = data::load(DatasetKind::Mnist, &dir, Split::Test).unwrap();
    assert_eq!((train.len(), test.len()), (4000, 1000));
    assert!(!train.generated);
    // 100 test digits per class, as the sample's README says.
    for class in 0..10u8 {
        assert_eq!(test.labels.iter().filter(|&&l| l == class).count(), 100, "class {class}");
    }
    // Real digits: mostly black background, mean intensity near MNIST's 0.1307.
    let mean = train.images.iter().map(|&p| p as f64).sum::<f64>() / train.images.len() as f64 / 255.0;
    assert!((0.11..0.15).contains(&mean), "mean intensity {mean}");
}

#[test]
fn truncated_cifar10_file_is_named_in_the_error() {
    let dir = generated(DatasetKind::Cifar10, 10, 4);
    let path = dir.path().join("test_batch.bin");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let err = error_of(data::load(DatasetKind::Cifar10, dir.path(), Split::Test));
    assert!(err.contains("test_batch.bin") && err.contains("3073-byte"), "{err}");
}

#[test]
fn cifar10_with_a_bad_label_is_rejected() {
    let dir = generated(DatasetKind::Cifar10, 10, 4);
    let path = dir.path().join("data_batch_2.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[3073] = 42;
    std::fs::write(&path, bytes).unwrap();
    let err = error_of(data::load(DatasetKind::Cifar10, dir.path(), Split::Train));
    assert!(err.contains("data_batch_2.bin") && err.contains("record 1 has label 42"), "{err}");
}

#[test]
fn missing_files_and_folders_say_what_to_do() {
    let dir = generated(DatasetKind::Cifar10, 10, 4);
    std::fs::remove_file(dir.path().join("data_batch_4.bin")).unwrap();
    let err = error_of(data::load(DatasetKind::Cifar10, dir.path(), Split::Train));
    assert!(err.contains("data_batch_4.bin") && err.contains("missing") && err.contains("make data"), "{err}");

    let err = error_of(data::load(DatasetKind::Mnist, Path::new("/nonexistent/mnist"), Split::Train));
    assert!(err.contains("/nonexistent/mnist") && err.contains("does not exist"), "{err}");

    let empty = tempfile::tempdir().unwrap();
    let err = error_of(data::load(DatasetKind::Mnist, empty.path(), Split::Test));
    assert!(err.contains("t10k-images-idx3-ubyte.gz") && err.contains("missing"), "{err}");
}

#[test]
fn corrupt_mnist_files_get_specific_errors() {
    let dir = generated(DatasetKind::Mnist, 20, 10);
    let images = dir.path().join("t10k-images-idx3-ubyte.gz");
    let labels = dir.path().join("t10k-labels-idx1-ubyte.gz");
    let good = std::fs::read(&images).unwrap();

    // Cut-off gzip stream.
    std::fs::write(&images, &good[..good.len() / 2]).unwrap();
    let err = error_of(data::load(DatasetKind::Mnist, dir.path(), Split::Test));
    assert!(err.contains("t10k-images-idx3-ubyte.gz") && err.contains("corrupt gzip"), "{err}");

    // Labels file where images are expected: wrong magic number.
    std::fs::copy(&labels, &images).unwrap();
    let err = error_of(data::load(DatasetKind::Mnist, dir.path(), Split::Test));
    assert!(err.contains("magic number 0x00000801, expected 0x00000803"), "{err}");

    // Header promising more images than the file holds.
    let mut pixels = vec![0u8; 9 * 784];
    pixels[0] = 1;
    std::fs::remove_file(&images).unwrap();
    let raw = dir.path().join("t10k-images-idx3-ubyte");
    let mut bytes = vec![0, 0, 8, 3, 0, 0, 0, 10, 0, 0, 0, 28, 0, 0, 0, 28];
    bytes.extend_from_slice(&pixels);
    std::fs::write(&raw, &bytes).unwrap();
    let err = error_of(data::load(DatasetKind::Mnist, dir.path(), Split::Test));
    assert!(err.contains("t10k-images-idx3-ubyte") && err.contains("truncated"), "{err}");

    // Counts that disagree between images and labels.
    mnist::write_idx(&raw, &[9, 28, 28], &pixels).unwrap();
    let err = error_of(data::load(DatasetKind::Mnist, dir.path(), Split::Test));
    assert!(err.contains("holds 9 images") && err.contains("holds 10 labels"), "{err}");
}

fn loader(dir: &Path, config: LoaderConfig) -> Loader {
    Loader::new(data::load(DatasetKind::Cifar10, dir, Split::Train).unwrap(), config)
}

/// (labels, pixel sum) of every batch of an epoch: a fingerprint of its order and contents.
fn labels_and_sums(loader: &Loader, epoch: usize) -> Vec<(Vec<i64>, f64)> {
    loader.epoch(epoch).map(Result::unwrap).map(|b| (Vec::<i64>::try_from(&b.targets).unwrap(), b.inputs.sum(Kind::Double).double_value(&[]))).collect()
}

#[test]
fn loader_visits_every_image_once_per_epoch_in_a_seeded_order() {
    let dir = generated(DatasetKind::Cifar10, 95, 5);
    let config = LoaderConfig { workers: 0, ..LoaderConfig::train(10, 3, Device::Cpu) };
    let plain = loader(dir.path(), config.clone());
    assert_eq!(plain.batches_per_epoch(), 10);
    let batches: Vec<_> = plain.epoch(0).map(Result::unwrap).collect();
    assert_eq!(batches.last().unwrap().len(), 5, "the last, smaller batch is kept");
    assert_eq!(batches[0].inputs.size(), vec![10, 3, 32, 32]);
    assert_eq!(batches[0].inputs.kind(), Kind::Float);

    // Each image exactly once: the per-image sums of the epoch are the data set's, permuted.
    let dataset = plain.dataset();
    let all = data::loader::normalize(&Tensor::from_slice(&dataset.images[..]).view([95, 3, 32, 32]), DatasetKind::Cifar10.normalization());
    let expected: HashSet<i64> = (0..95).map(|i| (all.get(i).sum(Kind::Double).double_value(&[]) * 1e3) as i64).collect();
    let seen: HashSet<i64> = batches
        .iter()
        .flat_map(|b| (0..b.len() as i64).map(|i| (b.inputs.get(i).sum(Kind::Double).double_value(&[]) * 1e3) as i64).collect::<Vec<_>>())
        .collect();
    assert_eq!(seen, expected);

    // Same seed and epoch: same order; another epoch or seed: another order.
    assert_eq!(labels_and_sums(&plain, 1), labels_and_sums(&plain, 1));
    assert_ne!(labels_and_sums(&plain, 0), labels_and_sums(&plain, 1));
    let other_seed = loader(dir.path(), LoaderConfig { seed: 4, ..config.clone() });
    assert_ne!(labels_and_sums(&plain, 0), labels_and_sums(&other_seed, 0));

    // drop_last drops the 5-image tail.
    let dropping = loader(dir.path(), LoaderConfig { drop_last: true, ..config });
    assert_eq!(dropping.batches_per_epoch(), 9);
    assert_eq!(dropping.epoch(0).count(), 9);
}

#[test]
fn worker_threads_deliver_exactly_what_the_training_thread_would() {
    let dir = generated(DatasetKind::Cifar10, 64, 5);
    let base = LoaderConfig { augment: true, ..LoaderConfig::train(8, 11, Device::Cpu) };
    let inline = loader(dir.path(), LoaderConfig { workers: 0, ..base.clone() });
    let threaded = loader(dir.path(), LoaderConfig { workers: 3, prefetch: 2, ..base.clone() });
    for epoch in 0..2 {
        for (a, b) in inline.epoch(epoch).map(Result::unwrap).zip(threaded.epoch(epoch).map(Result::unwrap)) {
            assert!(a.inputs.equal(&b.inputs) && a.targets.equal(&b.targets), "epoch {epoch}");
        }
    }
    // An epoch abandoned early (--max-steps) does not hang or leak blocked workers.
    let mut early = threaded.epoch(0);
    early.next();
    drop(early);
    // Augmentation changes the images but keeps the labels.
    let plain = loader(dir.path(), LoaderConfig { augment: false, workers: 0, ..base });
    let (a, p) = (inline.epoch(0).next().unwrap().unwrap(), plain.epoch(0).next().unwrap().unwrap());
    assert!(a.targets.equal(&p.targets));
    assert!(!a.inputs.equal(&p.inputs));
}

/// The loader's workers normalise on the host in plain Rust: the same floats as LibTorch's
/// operations, bit for bit, for every byte value in every channel of both data sets.
#[test]
fn host_normalisation_is_libtorch_normalisation_bit_for_bit() {
    for kind in [DatasetKind::Cifar10, DatasetKind::Mnist] {
        let channels = kind.normalization().mean.len();
        let bytes: Vec<u8> = (0..channels).flat_map(|_| 0..=255u8).collect();
        let host = data::loader::normalize_bytes(&bytes, kind.normalization(), 256);
        let torch = data::loader::normalize(&Tensor::from_slice(&bytes).view([1, channels as i64, 16, 16]), kind.normalization());
        let torch = Vec::<f32>::try_from(torch.flatten(0, -1)).unwrap();
        assert_eq!(host.len(), torch.len());
        for (i, (h, t)) in host.iter().zip(&torch).enumerate() {
            assert_eq!(h.to_bits(), t.to_bits(), "{kind:?}: byte {} of channel {}: {h} vs {t}", i % 256, i / 256);
        }
        // And a whole batch of odd-sized images, which LibTorch splits over its threads.
        let shape = [7, channels as i64, 33, 31];
        let batch = Tensor::randint(256, shape, (Kind::Uint8, Device::Cpu));
        let bytes = Vec::<u8>::try_from(batch.flatten(0, -1)).unwrap();
        let host = Tensor::from_slice(&data::loader::normalize_bytes(&bytes, kind.normalization(), 33 * 31)).view(shape);
        assert!(host.equal(&data::loader::normalize(&batch, kind.normalization())), "{kind:?}: a batch");
    }
}

#[test]
fn normalisation_uses_the_dataset_statistics() {
    let bytes = Tensor::from_slice(&[0u8, 255, 0, 255, 128, 128]).view([1, 3, 1, 2]);
    let out = data::loader::normalize(&bytes, DatasetKind::Cifar10.normalization());
    let got = Vec::<f32>::try_from(out.flatten(0, -1)).unwrap();
    let expected = [
        (0.0 - 0.4914) / 0.2470,
        (1.0 - 0.4914) / 0.2470,
        (0.0 - 0.4822) / 0.2435,
        (1.0 - 0.4822) / 0.2435,
        (128.0 / 255.0 - 0.4465) / 0.2616,
        (128.0 / 255.0 - 0.4465) / 0.2616,
    ];
    for (g, e) in got.iter().zip(expected) {
        assert!((*g as f64 - e).abs() < 1e-5, "{got:?}");
    }
}

/// A CMYK JPEG (Adobe's inverted CMYK, as Pillow 13 writes it) decodes to the RGB that PIL's
/// `convert("RGB")` gives (`reference/cmyk.pil-rgb`, written by Pillow from the same file).
#[test]
fn a_cmyk_jpeg_decodes_to_pils_rgb() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference");
    let ours = data::transforms::decode(&std::fs::read(dir.join("cmyk.jpg")).unwrap()).unwrap();
    let pil = std::fs::read(dir.join("cmyk.pil-rgb")).unwrap();
    assert_eq!(ours.dimensions(), (16, 12));
    let worst = ours.as_raw().iter().zip(&pil).map(|(&a, &b)| (a as i32 - b as i32).abs()).max().unwrap();
    assert!(worst <= 2, "largest difference from PIL's RGB: {worst}");
}
