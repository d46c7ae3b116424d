//! Image files as a user trains on them: generated JPEG folders (with a grey-scale JPEG and an
//! RGBA PNG in every class) and the tar shards `prepare_data pack` makes of them, through
//! exercise1 (ResNet50, a few steps on the CPU) and exercise2 (2 CPU ranks, each streaming its
//! own shards); and the mistakes a user makes with them, each one line and an exit code.
mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::{read_json, stderr};

fn run(binary: &str, args: &[&str]) -> Output {
    let path = match binary {
        "exercise1" => env!("CARGO_BIN_EXE_exercise1"),
        "exercise2" => env!("CARGO_BIN_EXE_exercise2"),
        "prepare_data" => env!("CARGO_BIN_EXE_prepare_data"),
        other => panic!("no binary {other}"),
    };
    let mut command = Command::new(path);
    command.args(args);
    if binary != "prepare_data" {
        command.args(["--device", "cpu", "--quiet"]);
    }
    command.output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A generated folder of `classes` classes × `train` small images (4 validation ones each).
fn folder(dir: &Path, classes: usize, train: usize) {
    let out = run(
        "prepare_data",
        &["generate-images", "--sizes", "small", "--mixed-formats", "--classes", &classes.to_string(), "--train", &train.to_string(), "--val", "4", "--out"]
            .iter()
            .copied()
            .chain([dir.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

fn pack(from: &Path, to: &Path, shard_size: usize) -> String {
    let out = run("prepare_data", &["pack", "--data-dir", from.to_str().unwrap(), "--out", to.to_str().unwrap(), "--shard-size", &shard_size.to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    stdout(&out)
}

fn args<'a>(data: &'a Path, results: &'a Path, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--data-dir", data.to_str().unwrap(), "--results-dir", results.to_str().unwrap(), "--threads", "1"];
    args.extend(more);
    args
}

#[test]
fn exercise1_trains_resnet50_on_a_jpeg_folder_and_on_its_shards() {
    let (data, results) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (photos, shards) = (data.path().join("photos"), data.path().join("shards"));
    folder(&photos, 3, 6);
    let packed = pack(&photos, &shards, 5);
    assert!(packed.contains("train: 18 samples of 3 classes in 4 shards"), "{packed}");
    for (dataset, dir) in [("imagefolder", &photos), ("shards", &shards)] {
        let flags = ["--dataset", dataset, "--model", "resnet50", "--image-size", "64", "--batch-size", "4", "--max-steps", "3", "--workers", "2"];
        let out = run("exercise1", &args(dir, results.path(), &flags));
        assert!(out.status.success(), "{dataset}: {}", stderr(&out));
        let said = stdout(&out);
        assert!(said.contains(&format!("resnet50 on {dataset} (18 train / 12 test images")), "{said}");
        assert!(said.contains("3 classes; training RandomResizedCrop(64) + flip; evaluation Resize(73) + CenterCrop(64)"), "{said}");
        assert!(said.contains("GENERATED"), "the generated data say so: {said}");
        let json = read_json(&results.path().join("exercise1-resnet50-cpu.json"));
        assert_eq!((json["steps"].as_u64(), json["image_size"].as_i64(), json["params"].as_i64()), (Some(3), Some(64), Some(25_557_032)), "{json}");
        assert!(json["test_loss"].as_f64().is_some_and(f64::is_finite), "{json}");
        assert!(said.contains("data wait"), "the data wait is reported: {said}");
    }
}

#[test]
fn exercise2_replicas_stream_their_own_shards_and_stay_identical() {
    let (data, results) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (photos, shards) = (data.path().join("photos"), data.path().join("shards"));
    folder(&photos, 3, 8);
    pack(&photos, &shards, 4);
    // 24 samples in 6 shards of 4: each of 2 replicas streams 3 shards, 12 samples, 3 batches of 4.
    let flags = ["--dataset", "shards", "--model", "cnn", "--image-size", "32", "--batch-size", "4", "--epochs", "1", "--nproc-per-node", "2"];
    let out = run("exercise2", &args(&shards, results.path(), &flags));
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(said.contains("parameters bit-identical on all 2 ranks"), "{said}");
    assert!(said.contains("with a 3-way head"), "the head has the shards' classes: {said}");
    assert_eq!(read_json(&results.path().join("exercise2-cnn-cpu.json"))["steps"].as_u64(), Some(3));
}

#[test]
fn mistakes_with_image_files_get_one_line_and_an_exit_code() {
    let (data, results) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (photos, shards) = (data.path().join("photos"), data.path().join("shards"));
    folder(&photos, 2, 3);
    pack(&photos, &shards, 6);
    let inner = photos.join("train");
    let cases: Vec<(&Path, Vec<&str>, i32, &str)> = vec![
        (&photos, vec!["--dataset", "imagefolder", "--augment"], 2, "--augment is CIFAR's padded random crop"),
        (&photos, vec!["--dataset", "imagefolder", "--data-on-device"], 2, "--data-on-device keeps a binary data set"),
        (&photos, vec!["--dataset", "imagefolder", "--shuffle-buffer", "10"], 2, "--shuffle-buffer mixes the samples streamed from tar shards"),
        (&photos, vec!["--dataset", "cifar10", "--transform", "resize"], 2, "--transform and --shuffle-buffer apply to image files"),
        (&photos, vec!["--dataset", "imagefolder", "--model", "cnn", "--num-classes", "1"], 2, "--num-classes must be at least 2"),
        (&inner, vec!["--dataset", "imagefolder"], 1, "train/train does not exist"),
        // 6 training samples in one shard cannot feed 2 replicas.
        (&shards, vec!["--dataset", "shards", "--nproc-per-node", "2", "--model", "cnn"], 2, "holds 1 training shards for 2 replicas"),
    ];
    for (dir, flags, code, message) in cases {
        let mut flags = flags;
        flags.extend(["--image-size", "32", "--max-steps", "1", "--batch-size", "2"]);
        let binary = if flags.contains(&"--nproc-per-node") { "exercise2" } else { "exercise1" };
        let out = run(binary, &args(dir, results.path(), &flags));
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(code), "{flags:?}: {err}");
        assert!(err.contains(message), "{flags:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{flags:?}: {err}");
    }
    // An image that no longer decodes, met in the middle of training: the run stops with its name.
    let victim = photos.join("train/c001/c001_000002.JPEG");
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    let out = run("exercise1", &args(&photos, results.path(), &["--dataset", "imagefolder", "--model", "cnn", "--image-size", "32", "--batch-size", "2"]));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("c001_000002.JPEG") && err.contains("cut short"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// torchvision itself (installed by `make test`'s scripts/python-tools): its `ImageFolder` lists
/// the same files with the same labels (nested folders, upper-case extensions, files that are no
/// images), and its evaluation transform through PIL gives our batch to within 3 grey levels
/// (99.9% of values within 1: the two resizers round differently), the grey-scale JPEGs and RGBA
/// PNGs included, these small images enlarged (bench/data_loader.py --compare).
#[test]
fn the_listing_and_the_evaluation_transform_are_torchvisions() {
    let python = std::env::var_os("TORCH_PYTHON").expect("run through scripts/with-torch (make test does), which sets TORCH_PYTHON");
    let data = tempfile::tempdir().unwrap();
    let photos = data.path().join("photos");
    folder(&photos, 3, 5);
    let train = photos.join("train");
    let some_jpeg = train.join("c000/c000_000002.JPEG");
    for extra in ["c001/deeper/er/z.jpeg", "c001/A.Jpg", "c002/sub/b.JPEG"] {
        std::fs::create_dir_all(train.join(extra).parent().unwrap()).unwrap();
        std::fs::copy(&some_jpeg, train.join(extra)).unwrap();
    }
    std::fs::write(train.join("c002/notes.txt"), "not an image").unwrap();

    let ours: Vec<(String, usize)> = common::data::image_folder::ImageFolder::scan(&train)
        .unwrap()
        .samples
        .iter()
        .map(|s| (s.path.strip_prefix(&train).unwrap().to_string_lossy().into_owned(), s.label))
        .collect();
    let listing = Command::new(&python)
        .args(["-c", "import json, os, sys\nfrom torchvision.datasets import ImageFolder\nroot = sys.argv[1]\nprint(json.dumps([[os.path.relpath(p, root), c] for p, c in ImageFolder(root).samples]))"])
        .arg(&train)
        .output()
        .unwrap();
    assert!(listing.status.success(), "torchvision's ImageFolder (is torchvision installed? scripts/python-tools installs it): {}", stderr(&listing));
    let theirs: Vec<(String, usize)> = serde_json::from_slice(&listing.stdout).unwrap();
    assert_eq!(ours, theirs);
    assert_eq!(ours.len(), 18);

    let dump = data.path().join("ours.f32");
    let flags = ["--data-dir", photos.to_str().unwrap(), "--batch-size", "18", "--batches", "1", "--warmup", "0", "--workers", "2"];
    let out = Command::new(env!("CARGO_BIN_EXE_bench_data")).args(flags).arg("--dump").arg(&dump).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/data_loader.py");
    let out = Command::new(&python).arg(script).args(flags).arg("--compare").arg(&dump).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let compared: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(compared["images"], 18, "{compared}");
    assert!(compared["max_byte_diff"].as_f64().unwrap() <= 3.0 && compared["share_within_1"].as_f64().unwrap() >= 0.999, "{compared}");
}
