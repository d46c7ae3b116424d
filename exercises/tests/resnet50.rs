//! ResNet50 and `--image-size` as a user runs them: a few steps of exercise1 and of exercise2
//! (2 CPU ranks) with `--model resnet50`, images resized on the way to the model (the CNN's
//! parameter count and the FLOP count follow the new size), and one usage line for sizes no
//! model can take; the courses' own ResNet50 recipes (`--recipe course`: JSC's ResNet50,
//! Namal/BSC's ResNet50V2) on 2 ranks.
mod support;

use std::path::Path;
use std::process::{Command, Output};

use common::flops;
use common::models::{Arch, ModelSpec};
use support::{read_json, stderr};

fn run(binary: &str, args: &[&str]) -> Output {
    let path = match binary {
        "exercise1" => env!("CARGO_BIN_EXE_exercise1"),
        "exercise2" => env!("CARGO_BIN_EXE_exercise2"),
        other => panic!("no binary {other}"),
    };
    Command::new(path).args(args).args(["--device", "cpu", "--quiet"]).output().unwrap()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Generated data of `dataset` (`cifar10`, `mnist`): `train` training and 4 test images.
fn generated(dataset: &str, dir: &Path, train: usize) {
    let status = Command::new(env!("CARGO_BIN_EXE_prepare_data"))
        .args(["generate", "--dataset", dataset, "--train", &train.to_string(), "--test", "4", "--out"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

fn spec(arch: Arch, in_channels: i64, image_size: i64, num_classes: i64) -> ModelSpec {
    ModelSpec { arch, in_channels, image_size, num_classes }
}

#[test]
fn exercise1_trains_resnet50_with_torchvisions_parameter_count() {
    let (data, results) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    generated("cifar10", data.path(), 8);
    let out = run(
        "exercise1",
        &["--model", "resnet50", "--image-size", "32", "--batch-size", "2", "--max-steps", "3", "--threads", "2", "--data-dir"]
            .iter()
            .copied()
            .chain([data.path().to_str().unwrap(), "--results-dir", results.path().to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("resnet50 with a 1000-way head: 25,557,032 parameters"), "{}", stdout(&out));
    let json = read_json(&results.path().join("exercise1-resnet50-cpu.json"));
    assert_eq!((json["params"].as_i64(), json["steps"].as_u64(), json["image_size"].as_i64()), (Some(25_557_032), Some(3), Some(32)), "{json}");
    assert!(json["test_loss"].as_f64().is_some_and(f64::is_finite), "{json}");
    assert_eq!(json["flops_per_example"].as_f64(), Some(flops::training_flops_per_image(&spec(Arch::Resnet50, 3, 32, 1000), common::models::Trainable::All)));
}

#[test]
fn exercise2_trains_resnet50_on_two_ranks_that_agree() {
    let (data, results) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    generated("cifar10", data.path(), 8);
    let mut args = vec!["--model", "resnet50", "--image-size", "32", "--num-classes", "10", "--batch-size", "2", "--max-steps", "2"];
    args.extend(["--nproc-per-node", "2", "--threads", "1", "--workers", "0", "--data-dir", data.path().to_str().unwrap()]);
    args.extend(["--results-dir", results.path().to_str().unwrap()]);
    let out = run("exercise2", &args);
    assert!(out.status.success(), "{}", stderr(&out));
    let said = stdout(&out);
    assert!(said.contains("resnet50 with a 10-way head: 23,528,522 parameters, 2 replicas"), "{said}");
    // Batch-norm statistics included (rank 0's are broadcast at the end, as DDP's buffers).
    assert!(said.contains("parameters bit-identical on all 2 ranks"), "{said}");
    assert_eq!(read_json(&results.path().join("exercise2-resnet50-cpu.json"))["steps"].as_u64(), Some(2));
}

/// `--recipe course` with the courses' ResNet50s on 2 ranks: JSC's 128 images on each (its DDP
/// script's DataLoader in every process) at Adam's 0.02, for its 10 epochs; Namal/BSC's
/// ResNet50V2 at 128×128 with SGD at 0.01 × 2, for its 5 epochs.
#[test]
fn the_courses_resnet50_recipes_on_two_ranks() {
    let data = tempfile::tempdir().unwrap();
    generated("cifar10", data.path(), 256);
    let common =
        ["--recipe", "course", "--nproc-per-node", "2", "--threads", "1", "--workers", "0", "--max-steps", "1", "--data-dir", data.path().to_str().unwrap()];
    let train = |extra: &[&str]| {
        let results = tempfile::tempdir().unwrap();
        let out = run("exercise2", &[&common[..], extra, &["--results-dir", results.path().to_str().unwrap()]].concat());
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        let model = extra[1];
        (stdout(&out), read_json(&results.path().join(format!("exercise2-{model}-cpu.json"))))
    };
    // JSC's, without its resize to 256 (a step of 128 such images takes minutes on 2 cores; the
    // recipe's sizes are checked in `image_classification`'s unit test).
    let (said, json) = train(&["--model", "resnet50", "--image-size", "32", "--num-classes", "10"]);
    assert!(said.contains(", batch 128, ") && said.contains("2 replicas × batch 128"), "{said}");
    assert_eq!((json["batch_size"].as_u64(), json["lr"].as_f64(), json["optimizer"].as_str()), (Some(128), Some(0.02), Some("adam")), "{json}");
    assert_eq!((json["epochs"].as_u64(), json["world_size"].as_u64()), (Some(10), Some(2)), "JSC's max_epochs=10 (--max-steps cuts it short): {json}");
    let (said, json) = train(&["--model", "resnet50v2", "--batch-size", "2"]);
    assert!(said.contains("resnet50v2 with a 10-way head: 23,539,850 parameters, 2 replicas × batch 2"), "{said}");
    assert_eq!((json["image_size"].as_i64(), json["lr"].as_f64(), json["optimizer"].as_str()), (Some(128), Some(0.02), Some("sgd")), "{json}");
    assert_eq!(json["scale_lr"].as_bool(), Some(true), "{json}");
    assert_eq!(json["epochs"].as_u64(), Some(5), "Namal/BSC's --epochs 5: {json}");
}

/// `--image-size 64` on MNIST's 28×28 digits: the CNN is built for 64×64 inputs (its fc1 takes
/// 75·13·13 features instead of 75·4·4) and trains on them, from the loader threads and from
/// the device-resident split alike; the FLOP count is the 64×64 model's.
#[test]
fn image_size_resizes_the_images_before_the_model() {
    let data = tempfile::tempdir().unwrap();
    generated("mnist", data.path(), 8);
    for extra in [&["--workers", "2"][..], &["--data-on-device"][..]] {
        let results = tempfile::tempdir().unwrap();
        let mut args = vec!["--dataset", "mnist", "--image-size", "64", "--batch-size", "4", "--max-steps", "2", "--data-dir", data.path().to_str().unwrap()];
        args.extend(extra);
        args.extend(["--results-dir", results.path().to_str().unwrap()]);
        let out = run("exercise1", &args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        let said = format!("{}{}", stdout(&out), stderr(&out));
        // conv1 1·50·25 + 50, conv2 50·75·25 + 75, fc1 75·13·13·50 + 50, fc2 50·10 + 10.
        let params = 1300 + 93_825 + 633_800 + 510;
        assert!(
            said.contains("resized to 64×64") && said.contains(&format!("cnn with a 10-way head: {} parameters", common::report::group_thousands(params))),
            "{said}"
        );
        let json = read_json(&results.path().join("exercise1-cnn-cpu.json"));
        assert_eq!((json["params"].as_i64(), json["image_size"].as_i64()), (Some(params), Some(64)), "{json}");
        assert_eq!(json["flops_per_example"].as_f64(), Some(flops::training_flops_per_image(&spec(Arch::Cnn, 1, 64, 10), common::models::Trainable::All)));
    }
}

#[test]
fn image_sizes_no_model_can_take_are_one_usage_line() {
    let cases = [
        (&["--image-size", "0"][..], "--image-size 0: cnn needs images of at least 16×16"),
        (&["--image-size", "12"][..], "--image-size 12: cnn needs images of at least 16×16"),
        (&["--model", "resnet50", "--image-size", "16"][..], "--image-size 16: resnet50 needs images of at least 32×32"),
        (&["--model", "vgg19", "--image-size", "31"][..], "--image-size 31: vgg19 needs images of at least 32×32"),
        (&["--image-size", "100000"][..], "--image-size 100000: at most 1024"),
    ];
    for (args, message) in cases {
        // Said before any data is read (this data directory does not exist).
        let out = run("exercise1", &[args, &["--data-dir", "/nonexistent"]].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
    // Not a number at all: clap's own usage error.
    let out = run("exercise1", &["--image-size", "big"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// `--estimate-memory` probes the model on the images it will see: ResNet50's activations per
/// image at 64×64 are about 4 times those at 32×32 (the maps' areas).
#[test]
fn the_memory_estimate_probes_the_resized_images() {
    let per_image = |size: &str| {
        let results = tempfile::tempdir().unwrap();
        let out = run(
            "exercise1",
            &["--model", "resnet50", "--image-size", size, "--batch-size", "4", "--estimate-memory", "--results-dir", results.path().to_str().unwrap()],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let said = stdout(&out);
        assert!(said.contains(&format!("resnet50 with a 1000-way head on 3×{size}×{size} images: 25,557,032 parameters")), "{said}");
        let mib = said.split(" MiB per image").next().and_then(|s| s.rsplit(' ').next()).and_then(|n| n.parse::<f64>().ok());
        mib.unwrap_or_else(|| panic!("no activations per image in {said}"))
    };
    let (small, large) = (per_image("32"), per_image("64"));
    assert!((3.0..5.0).contains(&(large / small)), "{small} MiB at 32×32, {large} MiB at 64×64");
}
