//! Transfer learning in the library: the models' blocks, ImageNet weights (a 1000-way head)
//! starting a 10-class model with a new head, freezing the first blocks, and frozen batch norms
//! keeping their statistics. The binaries' runs are in `exercises/tests/transfer.rs`.
use common::models::{self, freeze, Arch, Blocks, ModelSpec, Trainable};
use std::collections::BTreeMap;
use std::path::Path;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

fn cifar(arch: Arch, num_classes: i64) -> ModelSpec {
    ModelSpec { arch, in_channels: 3, image_size: 32, num_classes }
}

fn build(spec: &ModelSpec, seed: i64) -> (nn::VarStore, Box<dyn ModuleT>) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = models::build(&vs.root(), spec);
    (vs, model)
}

/// Every variable of `vs`, copied (not sharing storage with the model).
fn snapshot(vs: &nn::VarStore) -> BTreeMap<String, Tensor> {
    vs.variables().into_iter().map(|(name, t)| (name, t.detach().copy())).collect()
}

fn images(n: i64) -> Tensor {
    Tensor::randn([n, 3, 32, 32], (Kind::Float, Device::Cpu))
}

/// A file in torchvision's names and shapes for `arch` with ImageNet's 1000-way head: a seeded
/// model's variables, its batch-norm statistics moved away from their initial 0 and 1 by a
/// training pass, and torchvision's `num_batches_tracked` beside each batch norm.
fn imagenet_file(arch: Arch, path: &Path) -> BTreeMap<String, Tensor> {
    let (vs, model) = build(&cifar(arch, 1000), 1);
    let _ = tch::no_grad(|| model.forward_t(&images(4), true));
    let file = snapshot(&vs);
    let counters = file.keys().filter_map(|name| name.strip_suffix(".running_mean")).map(|bn| (format!("{bn}.num_batches_tracked"), Tensor::from(1i64)));
    let tensors: Vec<(String, Tensor)> = file.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).chain(counters).collect();
    Tensor::write_safetensors(&tensors, path).unwrap();
    file
}

#[test]
fn blocks_hold_every_variable_once_in_forward_order_with_the_head_last() {
    let expected = [(Arch::Cnn, 4, "fc2"), (Arch::Resnet34, 18, "fc"), (Arch::Resnet50, 18, "fc"), (Arch::Vgg19, 19, "classifier.6")];
    for (arch, count, head) in expected {
        let spec = cifar(arch, 10);
        let (vs, _) = build(&spec, 0);
        let blocks = Blocks::of(&spec);
        assert_eq!((blocks.len(), blocks.head().name.as_str()), (count, head), "{arch:?}");
        let mut held = vec![0; blocks.len()];
        for name in vs.variables().keys() {
            let holders: Vec<usize> = blocks.iter().enumerate().filter(|(_, b)| b.holds(name)).map(|(i, _)| i).collect();
            assert_eq!(holders.len(), 1, "{arch:?}: {name} is held by blocks {holders:?}");
            held[holders[0]] += 1;
        }
        assert!(held.iter().all(|&n| n > 0), "{arch:?}: a block without variables: {held:?}");
    }
    let names = |arch| Blocks::of(&cifar(arch, 10)).iter().map(|b| b.name.clone()).collect::<Vec<_>>();
    let resnet = names(Arch::Resnet34);
    assert_eq!(resnet[..5], ["stem", "layer1.0", "layer1.1", "layer1.2", "layer2.0"]);
    assert_eq!(resnet[14..], ["layer4.0", "layer4.1", "layer4.2", "fc"]);
    assert_eq!(names(Arch::Resnet50), resnet, "the same blocks, Bottlenecks instead of BasicBlocks");
    let vgg = names(Arch::Vgg19);
    assert_eq!(vgg[..4], ["features.0", "features.2", "features.5", "features.7"]);
    assert_eq!(vgg[15..], ["features.34", "classifier.0", "classifier.3", "classifier.6"]);
    // `layer1.1` must not hold `layer1.10...` nor `layer1.1` hold `layer1.1x`: whole path parts.
    let block = Blocks::of(&cifar(Arch::Resnet34, 10)).iter().find(|b| b.name == "layer1.1").unwrap().clone();
    assert!(block.holds("layer1.1.conv1.weight") && !block.holds("layer1.10.conv1.weight") && !block.holds("layer1.1"));
}

/// Loads an ImageNet-headed file of `arch` into a 10-class model: every tensor but the head's
/// is the file's, bit for bit, the head is the model's own fresh one, and the line says so.
fn imagenet_weights_start_a_ten_class_model(arch: Arch, loaded: usize, head: [&str; 2]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("{}.safetensors", arch.name()));
    let file = imagenet_file(arch, &path);
    let spec = cifar(arch, 10);
    let (vs, _) = build(&spec, 2);
    let fresh = snapshot(&vs);
    let report = models::load_weights(&vs, &path, Blocks::of(&spec).head()).unwrap();
    assert_eq!(report.loaded, loaded);
    assert_eq!(report.new_head, head);
    let line = report.describe();
    assert!(line.contains(&format!("{loaded} tensors loaded from {}", path.display())) && line.contains(&head.join(", ")), "{line}");
    for (name, now) in vs.variables() {
        let expected = if head.contains(&name.as_str()) { &fresh[&name] } else { &file[&name] };
        assert!(now.equal(expected), "{arch:?}: {name} is not what it should be");
    }
    // The same file into a 1000-class model: all of it, the head too.
    let (vs, _) = build(&cifar(arch, 1000), 3);
    let report = models::load_weights(&vs, &path, Blocks::of(&cifar(arch, 1000)).head()).unwrap();
    assert_eq!((report.loaded, report.new_head.len()), (loaded + 2, 0));
    assert!(vs.variables().iter().all(|(name, t)| t.equal(&file[name])));
}

#[test]
fn resnet34_imagenet_weights_start_a_ten_class_model_with_a_new_fc() {
    imagenet_weights_start_a_ten_class_model(Arch::Resnet34, 180, ["fc.bias", "fc.weight"]);
}

#[test]
fn resnet50_imagenet_weights_start_a_ten_class_model_with_a_new_fc() {
    // 267 variables (320 state_dict entries less 53 num_batches_tracked), the head's 2 new.
    imagenet_weights_start_a_ten_class_model(Arch::Resnet50, 265, ["fc.bias", "fc.weight"]);
}

#[test]
fn vgg19_imagenet_weights_start_a_ten_class_model_with_a_new_classifier_6() {
    imagenet_weights_start_a_ten_class_model(Arch::Vgg19, 36, ["classifier.6.bias", "classifier.6.weight"]);
}

#[test]
fn with_a_new_head_anything_else_that_does_not_fit_is_still_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resnet34.safetensors");
    let mut file = imagenet_file(Arch::Resnet34, &path);
    // A backbone tensor of another shape, one missing, one the model does not have.
    file.insert("layer1.0.conv1.weight".into(), Tensor::zeros([64, 64, 1, 1], (Kind::Float, Device::Cpu)));
    file.remove("layer4.2.bn2.running_var");
    file.insert("layer5.0.conv1.weight".into(), Tensor::zeros([1], (Kind::Float, Device::Cpu)));
    let tensors: Vec<(String, Tensor)> = file.into_iter().collect();
    Tensor::write_safetensors(&tensors, &path).unwrap();
    let spec = cifar(Arch::Resnet34, 10);
    let (vs, _) = build(&spec, 2);
    let before = snapshot(&vs);
    let message = format!("{:#}", models::load_weights(&vs, &path, Blocks::of(&spec).head()).unwrap_err());
    assert_eq!(message.lines().count(), 1, "{message}");
    for part in [
        "missing from the file (1): layer4.2.bn2.running_var",
        "shape mismatches (1): layer1.0.conv1.weight: file [64, 64, 1, 1] vs model [64, 64, 3, 3]",
        "unexpected in the file (1): layer5.0.conv1.weight",
    ] {
        assert!(message.contains(part), "{part}: {message}");
    }
    assert!(!message.contains("fc."), "the new head is no difference: {message}");
    assert!(vs.variables().iter().all(|(name, t)| t.equal(&before[name])), "a failed load copied something");
}

/// The names of the variables that still require gradients.
fn trained(vs: &nn::VarStore) -> Vec<String> {
    models::named_parameters(vs).into_iter().map(|(name, _)| name).collect()
}

#[test]
fn train_last_n_freezes_every_block_before_the_last_n() {
    let spec = cifar(Arch::Resnet34, 10);
    let blocks = Blocks::of(&spec);
    let (vs, _) = build(&spec, 0);
    let all = trained(&vs);
    assert_eq!(freeze(&vs, &blocks, Trainable::All, "resnet34").unwrap(), None);
    assert_eq!(trained(&vs), all, "Trainable::All froze something");

    let frozen = freeze(&vs, &blocks, Trainable::Last(4), "resnet34").unwrap().unwrap();
    assert_eq!(frozen.trained, ["layer4.0", "layer4.1", "layer4.2", "fc"]);
    let line = frozen.describe();
    assert!(line.contains("the last 4 of 18 blocks (layer4.0, layer4.1, layer4.2, fc); the 14 before them frozen"), "{line}");
    // The stem's, 2 in each of the 13 BasicBlocks of layer1 to layer3, their 2 projections'.
    assert_eq!(frozen.frozen_batch_norms, 1 + 2 * 13 + 2);
    let expected: Vec<String> = all.iter().filter(|n| n.starts_with("layer4.") || n.starts_with("fc.")).cloned().collect();
    assert_eq!(trained(&vs), expected);
    assert!(expected.len() < all.len() && expected.iter().any(|n| n == "layer4.0.downsample.1.weight"));
    // Frozen parameters still count in the model's size.
    assert_eq!(models::param_count(&vs), 21_289_802);

    let (vs, _) = build(&cifar(Arch::Vgg19, 10), 0);
    let frozen = freeze(&vs, &Blocks::of(&cifar(Arch::Vgg19, 10)), Trainable::Last(3), "vgg19").unwrap().unwrap();
    assert_eq!(frozen.trained, ["classifier.0", "classifier.3", "classifier.6"]);
    assert_eq!(frozen.frozen_batch_norms, 0);
    assert!(!frozen.describe().contains("batch norms"), "{}", frozen.describe());
    assert!(trained(&vs).iter().all(|n| n.starts_with("classifier.")) && trained(&vs).len() == 6);
}

#[test]
fn train_last_counts_outside_the_model_are_refused() {
    let spec = cifar(Arch::Resnet34, 10);
    let (vs, _) = build(&spec, 0);
    let blocks = Blocks::of(&spec);
    let zero = freeze(&vs, &blocks, Trainable::Last(0), "resnet34").unwrap_err().to_string();
    assert!(zero.contains("would train nothing"), "{zero}");
    let many = freeze(&vs, &blocks, Trainable::Last(19), "resnet34").unwrap_err().to_string();
    assert!(many.contains("--train-last 19: resnet34 has 18 blocks (stem, layer1.0,") && many.contains("give at most 18"), "{many}");
    assert_eq!(trained(&vs).len(), models::named_parameters(&vs).len());
    assert!(freeze(&vs, &blocks, Trainable::Last(18), "resnet34").unwrap().is_some());
    assert_eq!(trained(&vs).len(), 110, "all 18 blocks train");
}

/// The batch-norm statistics (`running_mean`, `running_var`) of `vs`, copied.
fn statistics(vs: &nn::VarStore) -> BTreeMap<String, Tensor> {
    snapshot(vs).into_iter().filter(|(name, _)| name.contains(".running_")).collect()
}

#[test]
fn frozen_batch_norms_keep_their_statistics_and_backward_stops_at_the_trained_blocks() {
    let spec = cifar(Arch::Resnet34, 10);
    let (vs, model) = build(&spec, 0);
    freeze(&vs, &Blocks::of(&spec), Trainable::Last(4), "resnet34").unwrap();
    let before = statistics(&vs);
    let xs = images(4);
    let loss = model.forward_t(&xs, true).cross_entropy_for_logits(&Tensor::from_slice(&[0i64, 1, 2, 3]));
    loss.backward();
    for (name, stat) in statistics(&vs) {
        let trained_block = name.starts_with("layer4.");
        assert_eq!(!stat.equal(&before[&name]), trained_block, "{name}: updated must mean trained");
    }
    for (name, t) in vs.variables().into_iter().filter(|(n, _)| !n.contains(".running_")) {
        let trained_block = name.starts_with("layer4.") || name.starts_with("fc.");
        assert_eq!(t.grad().defined(), trained_block, "{name}: a gradient must mean trained");
    }

    // With the whole backbone frozen, a training pass is the evaluation pass: the batch norms
    // normalise with their statistics (and ResNet has no dropout).
    let (vs, model) = build(&spec, 0);
    freeze(&vs, &Blocks::of(&spec), Trainable::Last(1), "resnet34").unwrap();
    let before = statistics(&vs);
    let (train, eval) = tch::no_grad(|| (model.forward_t(&xs, true), model.forward_t(&xs, false)));
    assert!(train.equal(&eval), "a frozen batch norm normalised with the batch's statistics");
    assert!(statistics(&vs).iter().all(|(name, t)| t.equal(&before[name])), "a frozen batch norm updated its statistics");
}
