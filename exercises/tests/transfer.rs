//! Transfer learning as a user runs it: ResNet34, ResNet50 and VGG19 from torchvision-named files with
//! ImageNet's 1000-way head (written here from the models' own names and shapes; nothing is
//! downloaded), a new 10-way head for CIFAR-10, feature extraction (`--freeze backbone`) and
//! fine-tuning (`--train-last N`), alone and on 2 data-parallel ranks, judged from the
//! checkpoint the run leaves: frozen tensors and their batch-norm statistics bit for bit the
//! file's, trained ones moved, optimizer state for the trained ones only.
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Output};

use common::checkpoint;
use common::models::{self, Arch, Blocks, ModelSpec};
use support::{read_json, stderr};
use tch::nn;
use tch::{Device, Kind, Tensor};

const SEED: &str = "42";

fn cifar(arch: Arch, num_classes: i64) -> ModelSpec {
    ModelSpec { arch, in_channels: 3, image_size: 32, num_classes }
}

/// Writes the variables of `arch` in torchvision's names and shapes with a 1000-way head, its
/// batch-norm statistics moved away from their initial 0 and 1 (so that "unchanged" says
/// something) and torchvision's `num_batches_tracked` beside them; returns what it wrote.
fn imagenet_file(arch: Arch, path: &Path) -> BTreeMap<String, Tensor> {
    tch::manual_seed(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = models::build(&vs.root(), &cifar(arch, 1000));
    let _ = tch::no_grad(|| model.forward_t(&Tensor::randn([4, 3, 32, 32], (Kind::Float, Device::Cpu)), true));
    let file: BTreeMap<String, Tensor> = vs.variables().into_iter().map(|(n, t)| (n, t.detach().copy())).collect();
    let counters = file.keys().filter_map(|n| n.strip_suffix(".running_mean")).map(|bn| (format!("{bn}.num_batches_tracked"), Tensor::from(1i64)));
    let tensors: Vec<(String, Tensor)> = file.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).chain(counters).collect();
    Tensor::write_safetensors(&tensors, path).unwrap();
    file
}

/// The 10-way head's weight the runs of `arch` start with (the model's own, drawn from the
/// seed), by name.
fn fresh_head(arch: Arch) -> (String, Tensor) {
    tch::manual_seed(SEED.parse().unwrap());
    let vs = nn::VarStore::new(Device::Cpu);
    let spec = cifar(arch, 10);
    let _model = models::build(&vs.root(), &spec);
    let name = format!("{}.weight", Blocks::of(&spec).head().name);
    let weight = vs.variables()[&name].detach().copy();
    (name, weight)
}

/// Generated CIFAR-10-format data and an ImageNet file of `arch`. 40 training images make an
/// epoch of 2 steps (batch 20, or 2 ranks × 10), which ends with the checkpoint the tests read
/// (`--max-steps 2` would stop the run before the epoch's end, without one).
struct Setup {
    arch: Arch,
    data: tempfile::TempDir,
    weights: tempfile::TempDir,
    file: BTreeMap<String, Tensor>,
}

impl Setup {
    fn new(arch: Arch) -> Setup {
        let data = tempfile::tempdir().unwrap();
        support::generated_cifar10(data.path(), 40, 20);
        let weights = tempfile::tempdir().unwrap();
        let file = imagenet_file(arch, &weights.path().join("imagenet.safetensors"));
        Setup { arch, data, weights, file }
    }

    /// Runs `binary` (`exercise1`, ...) on the model from the ImageNet file with `args`, the
    /// checkpoint and results in `out`.
    fn run(&self, binary: &str, args: &[&str], out: &Path) -> Output {
        let weights = self.weights.path().join("imagenet.safetensors");
        self.run_without_weights(binary, &[args, &["--weights", weights.to_str().unwrap()]].concat(), out)
    }

    /// Runs `binary` on the model with `args` alone (no weights), as [`Setup::run`].
    fn run_without_weights(&self, binary: &str, args: &[&str], out: &Path) -> Output {
        let path = match binary {
            "exercise1" => env!("CARGO_BIN_EXE_exercise1"),
            "exercise2" => env!("CARGO_BIN_EXE_exercise2"),
            "exercise3" => env!("CARGO_BIN_EXE_exercise3"),
            other => panic!("no binary {other}"),
        };
        Command::new(path)
            .args(args)
            .args(["--model", self.arch.name(), "--device", "cpu", "--quiet", "--seed", SEED])
            .args(if args.contains(&"--epochs") { &[][..] } else { &["--epochs", "1"][..] })
            .arg("--data-dir")
            .arg(self.data.path())
            .arg("--checkpoint-dir")
            .arg(out)
            .arg("--results-dir")
            .arg(out)
            .output()
            .unwrap()
    }
}

/// What a run left: its checkpoint's model variables and the parameters its optimizer holds
/// state for.
struct Trained {
    model: BTreeMap<String, Tensor>,
    optimizer_state_of: BTreeSet<String>,
}

/// What the run of `preset` (`exercise1`, `exercise3_ddp`, ...) left in `dir`.
fn trained(setup: &Setup, dir: &Path, preset: &str) -> Trained {
    let run = format!("{preset}-{}-cpu", setup.arch.name());
    let ck = checkpoint::load_run(dir, &run).unwrap();
    let model = ck.tensors.iter().filter_map(|(k, t)| k.strip_prefix("model.").map(|n| (n.to_string(), t.shallow_clone()))).collect();
    // Optimizer entries are `optim.<entry>.<parameter>`.
    let optimizer_state_of = ck.tensors.keys().filter_map(|k| k.strip_prefix("optim.")?.split_once('.').map(|(_, p)| p.to_string())).collect();
    Trained { model, optimizer_state_of }
}

fn output(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(out))
}

/// Checks a run that trained the last `n` blocks: everything else the file's bit for bit
/// (batch-norm statistics included), every trained variable moved (the head from its fresh
/// start, batch-norm statistics updated), and optimizer state for exactly the trained
/// parameters.
fn check_trained(setup: &Setup, run: &Trained, n: usize) {
    let blocks = Blocks::of(&cifar(setup.arch, 10));
    let in_trained_block = |name: &str| blocks.position(name).unwrap() >= blocks.len() - n;
    assert_eq!(run.model.len(), setup.file.len());
    let mut expected_state = BTreeSet::new();
    for (name, now) in &run.model {
        if blocks.head().holds(name) {
            assert_eq!(now.size()[0], 10, "{name}: a 10-way head");
        } else if in_trained_block(name) {
            assert!(!now.equal(&setup.file[name]), "{name} was to train but is the file's");
        } else {
            assert!(now.equal(&setup.file[name]), "{name} was frozen but changed");
        }
        if in_trained_block(name) && !name.contains(".running_") {
            expected_state.insert(name.clone());
        }
    }
    let (head, fresh) = fresh_head(setup.arch);
    assert!(!run.model[&head].equal(&fresh), "the head did not train");
    assert_eq!(run.optimizer_state_of, expected_state, "optimizer state for other tensors than the trained ones");
}

#[test]
fn feature_extraction_trains_a_new_head_on_the_frozen_imagenet_backbone() {
    let setup = Setup::new(Arch::Resnet34);
    let out_dir = tempfile::tempdir().unwrap();
    let out = setup.run("exercise1", &["--freeze", "backbone", "--batch-size", "20"], out_dir.path());
    let said = output(&out);
    assert!(out.status.success(), "{said}");
    for line in [
        "weights: 180 tensors loaded from",
        "a new head, freshly initialised (the file's is for another number of classes): fc.bias, fc.weight",
        "training the last 1 of 18 blocks (fc); the 17 before them frozen (no gradients, no optimizer state; their 36 batch norms on their running statistics)",
        "resnet34 with a 10-way head: 21,289,802 parameters, 5,130 of them trained",
    ] {
        assert!(said.contains(line), "'{line}' not in:\n{said}");
    }
    check_trained(&setup, &trained(&setup, out_dir.path(), "exercise1"), 1);
    let results = read_json(&out_dir.path().join("exercise1-resnet34-cpu.json"));
    assert_eq!((results["trained_blocks"].as_u64(), results["params"].as_i64()), (Some(1), Some(21_289_802)), "{results}");
}

#[test]
fn fine_tuning_trains_the_last_blocks_and_keeps_the_rest() {
    let setup = Setup::new(Arch::Resnet34);
    let out_dir = tempfile::tempdir().unwrap();
    // layer4's three BasicBlocks and fc.
    let out = setup.run("exercise1", &["--train-last", "4", "--batch-size", "20"], out_dir.path());
    let said = output(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("training the last 4 of 18 blocks (layer4.0, layer4.1, layer4.2, fc)"), "{said}");
    check_trained(&setup, &trained(&setup, out_dir.path(), "exercise1"), 4);

    // As docs/exercise1.md shows it: the head first, then fine-tuning continues that run from its
    // checkpoint (the blocks that start training have no optimizer state yet).
    let out_dir = tempfile::tempdir().unwrap();
    let out = setup.run("exercise1", &["--freeze", "backbone", "--batch-size", "20"], out_dir.path());
    assert!(out.status.success(), "{}", output(&out));
    let out = setup.run_without_weights("exercise1", &["--train-last", "4", "--lr", "1e-4", "--epochs", "2", "--resume", "--batch-size", "20"], out_dir.path());
    let said = output(&out);
    assert!(out.status.success() && said.contains("after epoch 1 (step 2)"), "{said}");
    check_trained(&setup, &trained(&setup, out_dir.path(), "exercise1"), 4);
}

/// ResNet50 from a torchvision-named ImageNet file: its 265 backbone tensors loaded, layer4's
/// three Bottlenecks and a new 10-way fc trained, the rest kept.
#[test]
fn resnet50_fine_tuning_trains_layer4_and_a_new_fc() {
    let setup = Setup::new(Arch::Resnet50);
    let out_dir = tempfile::tempdir().unwrap();
    let out = setup.run("exercise1", &["--train-last", "4", "--batch-size", "20"], out_dir.path());
    let said = output(&out);
    assert!(out.status.success(), "{said}");
    for line in [
        "weights: 265 tensors loaded from",
        "a new head, freshly initialised (the file's is for another number of classes): fc.bias, fc.weight",
        "training the last 4 of 18 blocks (layer4.0, layer4.1, layer4.2, fc)",
        // layer4: 6,039,552 (with its projection) + 2 × 4,462,592; fc 2048·10 + 10.
        "resnet50 with a 10-way head: 23,528,522 parameters, 14,985,226 of them trained",
    ] {
        assert!(said.contains(line), "'{line}' not in:\n{said}");
    }
    check_trained(&setup, &trained(&setup, out_dir.path(), "exercise1"), 4);
}

#[test]
fn vgg19_feature_extraction_trains_a_new_classifier_6_alone() {
    let setup = Setup::new(Arch::Vgg19);
    let out_dir = tempfile::tempdir().unwrap();
    let out = setup.run("exercise1", &["--freeze", "backbone", "--batch-size", "20"], out_dir.path());
    let said = output(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("training the last 1 of 19 blocks (classifier.6); the 18 before them frozen (no gradients, no optimizer state)"), "{said}");
    check_trained(&setup, &trained(&setup, out_dir.path(), "exercise1"), 1);
}

#[test]
fn two_data_parallel_ranks_train_only_the_head_with_and_without_zero() {
    let setup = Setup::new(Arch::Resnet34);
    // Horovod's optimizer (exercise2), DDP's averaging with ZeRO-2's hooks and ZeRO-3's
    // sharded parameters (exercise3 ddp): over the trained tensors only.
    for (binary, extra) in [("exercise2", &[][..]), ("exercise3", &["ddp", "--zero", "2"][..]), ("exercise3", &["ddp", "--zero", "3"][..])] {
        let out_dir = tempfile::tempdir().unwrap();
        let args = [extra, &["--freeze", "backbone", "--nproc-per-node", "2", "--batch-size", "10", "--threads", "1", "--workers", "0"]].concat();
        let out = setup.run(binary, &args, out_dir.path());
        let said = output(&out);
        assert!(out.status.success(), "{binary} {extra:?}: {said}");
        assert!(said.contains("parameters bit-identical on all 2 ranks after training"), "{said}");
        let preset = if binary == "exercise2" { "exercise2" } else { "exercise3_ddp" };
        check_trained(&setup, &trained(&setup, out_dir.path(), preset), 1);
    }
}

#[test]
fn freezing_without_pretrained_blocks_or_beyond_the_model_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_exercise1");
    let run = |args: &[&str]| Command::new(bin).args(["--model", "resnet34", "--device", "cpu", "--results-dir"]).arg(dir.path()).args(args).output().unwrap();
    let out = run(&["--freeze", "backbone"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--freeze backbone keeps pretrained blocks as they are: give them with --weights imagenet or --weights FILE"),
        "{}",
        stderr(&out)
    );
    let out = run(&["--train-last", "19", "--weights", "resnet34.safetensors"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--train-last 19: resnet34 has 18 blocks (stem, layer1.0"), "{}", stderr(&out));
    let out = run(&["--train-last", "2", "--freeze", "backbone"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("cannot be used with"), "{}", stderr(&out));
}
