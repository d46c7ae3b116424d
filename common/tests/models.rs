//! The course models: parameter counts and variable names against torchvision's, forward
//! shapes on CIFAR-10- and MNIST-sized batches, and loading weights by name.
mod support;

use common::models::{self, named_parameters, param_count, Arch, Blocks, LoadedWeights, ModelSpec};
use std::collections::BTreeSet;
use std::path::Path;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

fn cifar(arch: Arch, num_classes: i64) -> ModelSpec {
    ModelSpec { arch, in_channels: 3, image_size: 32, num_classes }
}

fn mnist(arch: Arch, num_classes: i64) -> ModelSpec {
    ModelSpec { arch, in_channels: 1, image_size: 28, num_classes }
}

fn build(spec: &ModelSpec) -> (nn::VarStore, Box<dyn ModuleT>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = models::build(&vs.root(), spec);
    (vs, model)
}

fn batch(spec: &ModelSpec) -> Tensor {
    Tensor::randn([2, spec.in_channels, spec.image_size, spec.image_size], (Kind::Float, Device::Cpu))
}

/// Builds the model, checks its trainable parameter count, and runs a batch of 2 through it in
/// both modes (train mode also exercises batch norm on the smallest maps).
fn check_model(spec: &ModelSpec, expected_params: i64) -> (nn::VarStore, Box<dyn ModuleT>) {
    let (vs, model) = build(spec);
    assert_eq!(param_count(&vs), expected_params, "{spec:?}");
    let xs = batch(spec);
    for train in [false, true] {
        let logits = tch::no_grad(|| model.forward_t(&xs, train));
        assert_eq!(logits.size(), [2, spec.num_classes], "{spec:?}, train {train}");
        assert!(bool::try_from(logits.isfinite().all()).unwrap(), "{spec:?}: non-finite logits");
    }
    (vs, model)
}

/// Loads `path` into `vs`, a model `spec` built, its head left new where the file's differs.
fn load_weights(vs: &nn::VarStore, spec: &ModelSpec, path: &Path) -> anyhow::Result<LoadedWeights> {
    models::load_weights(vs, path, Blocks::of(spec).head())
}

fn names(vs: &nn::VarStore) -> BTreeSet<String> {
    vs.variables().into_keys().collect()
}

fn shape(vs: &nn::VarStore, name: &str) -> Vec<i64> {
    vs.variables().get(name).unwrap_or_else(|| panic!("no variable {name}")).size()
}

const RESNET34_PARAMS: i64 = 21_797_672;
/// torchvision's ResNet50 (its documentation's figure).
const RESNET50_PARAMS: i64 = 25_557_032;
const VGG19_PARAMS: i64 = 143_667_240;

/// The same network with a `classes`-way instead of a 1000-way head of `head_in` inputs.
fn with_head(params_1000: i64, head_in: i64, classes: i64) -> i64 {
    params_1000 - (head_in + 1) * 1000 + (head_in + 1) * classes
}

#[test]
fn cnn_parameter_counts_and_shapes() {
    check_model(&cifar(Arch::Cnn, 10), 191_935);
    check_model(&mnist(Arch::Cnn, 10), 155_685);
}

#[test]
fn cnn_variable_names_follow_pytorch() {
    let (vs, _) = build(&cifar(Arch::Cnn, 10));
    let expected = ["conv1", "conv2", "fc1", "fc2"].iter().flat_map(|layer| [format!("{layer}.bias"), format!("{layer}.weight")]).collect::<Vec<_>>();
    let params: Vec<String> = named_parameters(&vs).into_iter().map(|(name, _)| name).collect();
    assert_eq!(params, expected, "sorted by name");
    assert_eq!(shape(&vs, "conv1.weight"), [50, 3, 5, 5]);
    assert_eq!(shape(&vs, "fc1.weight"), [50, 75 * 5 * 5]);
    assert_eq!(shape(&vs, "fc2.weight"), [10, 50]);
}

/// The CNN runs its convolutions on channels-last activations on the CPU: its logits and
/// gradients are the plain NCHW computation's (`torch.nn.functional` op for op) up to rounding.
#[test]
fn cnn_channels_last_forward_and_backward_match_the_plain_computation() {
    for spec in [cifar(Arch::Cnn, 10), mnist(Arch::Cnn, 10)] {
        tch::manual_seed(3);
        let (vs, model) = build(&spec);
        let vars = vs.variables();
        let xs = Tensor::randn([16, spec.in_channels, spec.image_size, spec.image_size], (Kind::Float, Device::Cpu));
        let weights = Tensor::randn([16, 10], (Kind::Float, Device::Cpu));
        let plain = |p: &std::collections::HashMap<String, Tensor>| {
            let conv = |x: &Tensor, n: &str| x.conv2d(&p[&format!("{n}.weight")], Some(&p[&format!("{n}.bias")]), [1, 1], [0, 0], [1, 1], 1);
            let h = conv(&xs, "conv1").max_pool2d_default(2).relu();
            let h = conv(&h, "conv2").max_pool2d_default(2).relu().flatten(1, -1);
            let h = h.linear(&p["fc1.weight"], Some(&p["fc1.bias"])).relu();
            h.linear(&p["fc2.weight"], Some(&p["fc2.bias"]))
        };
        let grads = |logits: &Tensor| {
            for v in vars.values() {
                let mut g = v.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            (logits * &weights).sum(Kind::Float).backward();
            let mut out: Vec<(String, Tensor)> = vars.iter().map(|(n, v)| (n.clone(), v.grad().copy())).collect();
            out.sort_by(|a, b| a.0.cmp(&b.0));
            out
        };
        let ours = model.forward_t(&xs, true);
        let our_grads = grads(&ours);
        let theirs = plain(&vars);
        let their_grads = grads(&theirs);
        let rel = |a: &Tensor, b: &Tensor| ((a - b).abs().max() / b.abs().max()).double_value(&[]);
        assert!(rel(&ours, &theirs) <= 1e-5, "{spec:?}: logits differ by {:e}", rel(&ours, &theirs));
        for ((name, a), (_, b)) in our_grads.iter().zip(&their_grads) {
            assert!(rel(a, b) <= 1e-5, "{spec:?}: gradient of {name} differs by {:e}", rel(a, b));
        }
    }
}

#[test]
fn resnet34_parameter_counts_and_shapes() {
    check_model(&cifar(Arch::Resnet34, 1000), RESNET34_PARAMS);
    let ten = with_head(RESNET34_PARAMS, 512, 10);
    check_model(&cifar(Arch::Resnet34, 10), ten);
    // Grey images are repeated to 3 channels inside the model: same parameters as for CIFAR.
    check_model(&mnist(Arch::Resnet34, 10), ten);
}

#[test]
fn resnet50_parameter_counts_and_shapes() {
    check_model(&cifar(Arch::Resnet50, 1000), RESNET50_PARAMS);
    let ten = with_head(RESNET50_PARAMS, 2048, 10);
    check_model(&cifar(Arch::Resnet50, 10), ten);
    check_model(&mnist(Arch::Resnet50, 10), ten);
    // At other image sizes (--image-size): the same parameters, logits of the same shape.
    for image_size in [50, 64] {
        check_model(&ModelSpec { image_size, ..cifar(Arch::Resnet50, 10) }, ten);
    }
}

#[test]
fn vgg19_parameter_counts_and_shapes() {
    check_model(&cifar(Arch::Vgg19, 1000), VGG19_PARAMS);
    let ten = with_head(VGG19_PARAMS, 4096, 10);
    check_model(&cifar(Arch::Vgg19, 10), ten);
    check_model(&mnist(Arch::Vgg19, 10), ten);
}

#[test]
fn resnet34_variables_are_torchvision_state_dict_keys() {
    let (vs, _) = build(&cifar(Arch::Resnet34, 1000));
    // torchvision's resnet34 state_dict has 218 entries; 36 of them are the batch norms'
    // num_batches_tracked (stem 1 + 16 blocks × 2 + 3 downsamples), which tch does not keep.
    assert_eq!(vs.len(), 218 - 36);
    let expected: &[(&str, &[i64])] = &[
        ("conv1.weight", &[64, 3, 7, 7]),
        ("bn1.weight", &[64]),
        ("bn1.running_mean", &[64]),
        ("layer1.0.conv1.weight", &[64, 64, 3, 3]),
        ("layer1.2.bn2.bias", &[64]),
        ("layer2.0.conv1.weight", &[128, 64, 3, 3]),
        ("layer2.0.downsample.0.weight", &[128, 64, 1, 1]),
        ("layer2.0.downsample.1.running_var", &[128]),
        ("layer2.3.conv2.weight", &[128, 128, 3, 3]),
        ("layer3.0.downsample.1.weight", &[256]),
        ("layer3.5.bn2.running_var", &[256]),
        ("layer4.0.downsample.0.weight", &[512, 256, 1, 1]),
        ("layer4.2.conv2.weight", &[512, 512, 3, 3]),
        ("fc.weight", &[1000, 512]),
        ("fc.bias", &[1000]),
    ];
    for &(name, size) in expected {
        assert_eq!(shape(&vs, name), size, "{name}");
    }
    let names = names(&vs);
    // layer1 keeps stride and channels; only the first block of a stage projects; stage sizes.
    for absent in ["layer1.0.downsample.0.weight", "layer2.1.downsample.0.weight", "layer1.3.conv1.weight", "layer3.6.conv1.weight", "conv1.bias"] {
        assert!(!names.contains(absent), "unexpected {absent}");
    }
    // The 36 batch norms' running statistics are buffers, not parameters.
    let params = named_parameters(&vs);
    assert_eq!(params.len(), 182 - 2 * 36);
    assert!(params.iter().all(|(name, _)| !name.contains("running")));
    assert!(params.windows(2).all(|w| w[0].0 < w[1].0), "sorted by name");
}

#[test]
fn resnet50_variables_are_torchvision_state_dict_keys() {
    let (vs, _) = build(&cifar(Arch::Resnet50, 1000));
    // torchvision's resnet50 state_dict has 320 entries; 53 of them are the batch norms'
    // num_batches_tracked (stem 1 + 16 Bottlenecks × 3 + 4 downsamples), which tch does not keep.
    // (Every name and shape against PyTorch: exercises/tests/bench_reference.rs.)
    assert_eq!(vs.len(), 320 - 53);
    let expected: &[(&str, &[i64])] = &[
        ("conv1.weight", &[64, 3, 7, 7]),
        ("bn1.running_var", &[64]),
        // Bottleneck: 1×1 to the width, 3×3, 1×1 to 4× the width.
        ("layer1.0.conv1.weight", &[64, 64, 1, 1]),
        ("layer1.0.conv2.weight", &[64, 64, 3, 3]),
        ("layer1.0.conv3.weight", &[256, 64, 1, 1]),
        ("layer1.0.bn3.weight", &[256]),
        // layer1 keeps the stride but widens 64 → 256: its first block projects too.
        ("layer1.0.downsample.0.weight", &[256, 64, 1, 1]),
        ("layer1.0.downsample.1.running_mean", &[256]),
        ("layer1.1.conv1.weight", &[64, 256, 1, 1]),
        ("layer2.0.conv1.weight", &[128, 256, 1, 1]),
        ("layer2.0.conv2.weight", &[128, 128, 3, 3]),
        ("layer2.0.downsample.0.weight", &[512, 256, 1, 1]),
        ("layer2.3.conv3.weight", &[512, 128, 1, 1]),
        ("layer3.0.downsample.0.weight", &[1024, 512, 1, 1]),
        ("layer3.5.bn3.running_var", &[1024]),
        ("layer4.0.conv1.weight", &[512, 1024, 1, 1]),
        ("layer4.0.downsample.1.bias", &[2048]),
        ("layer4.2.conv3.weight", &[2048, 512, 1, 1]),
        ("fc.weight", &[1000, 2048]),
        ("fc.bias", &[1000]),
    ];
    for &(name, size) in expected {
        assert_eq!(shape(&vs, name), size, "{name}");
    }
    let names = names(&vs);
    for absent in [
        "layer1.1.downsample.0.weight",
        "layer2.1.downsample.0.weight",
        "layer4.3.conv1.weight",
        "layer3.6.conv1.weight",
        "conv1.bias",
        "layer1.0.conv4.weight",
    ] {
        assert!(!names.contains(absent), "unexpected {absent}");
    }
    // Every block's variables: 3 convolutions, 3 batch norms (4 entries each), and the
    // projection in the first block of each stage.
    for (stage, blocks) in [3, 4, 6, 3].into_iter().enumerate() {
        for block in 0..blocks {
            let prefix = format!("layer{}.{block}.", stage + 1);
            let count = names.iter().filter(|n| n.starts_with(&prefix)).count();
            assert_eq!(count, if block == 0 { 3 + 3 * 4 + 1 + 4 } else { 3 + 3 * 4 }, "{prefix}");
        }
    }
    let params = named_parameters(&vs);
    assert_eq!(params.len(), 53 + 2 * 53 + 2);
    assert!(params.iter().all(|(name, _)| !name.contains("running")));
}

#[test]
fn vgg19_variables_are_torchvision_state_dict_keys() {
    let (vs, _) = build(&cifar(Arch::Vgg19, 1000));
    let convs = [0, 2, 5, 7, 10, 12, 14, 16, 19, 21, 23, 25, 28, 30, 32, 34];
    let expected: BTreeSet<String> = convs
        .iter()
        .map(|i| format!("features.{i}"))
        .chain([0, 3, 6].iter().map(|i| format!("classifier.{i}")))
        .flat_map(|layer| [format!("{layer}.weight"), format!("{layer}.bias")])
        .collect();
    assert_eq!(names(&vs), expected);
    assert_eq!(shape(&vs, "features.0.weight"), [64, 3, 3, 3]);
    assert_eq!(shape(&vs, "features.5.weight"), [128, 64, 3, 3]);
    assert_eq!(shape(&vs, "features.34.weight"), [512, 512, 3, 3]);
    assert_eq!(shape(&vs, "classifier.0.weight"), [4096, 512 * 7 * 7]);
    assert_eq!(shape(&vs, "classifier.6.bias"), [1000]);
}

#[test]
fn grey_images_are_repeated_and_padded_for_imagenet_models() {
    let spec = mnist(Arch::Resnet34, 10);
    let (_vs, model) = build(&spec);
    let grey = batch(&spec);
    let adapted = grey.repeat([1, 3, 1, 1]).constant_pad_nd([2, 2, 2, 2]);
    let (a, b) = tch::no_grad(|| (model.forward_t(&grey, false), model.forward_t(&adapted, false)));
    assert!(a.allclose(&b, 1e-5, 1e-6, false), "MNIST input is not adapted as 3×32×32");
}

#[test]
fn named_parameters_skips_frozen_variables_and_shares_storage() {
    let (mut vs, _) = build(&cifar(Arch::Cnn, 10));
    let (name, mut param) = named_parameters(&vs).swap_remove(0);
    let _ = tch::no_grad(|| param.fill_(3.0));
    let stored = vs.variables()[&name].shallow_clone();
    assert!(bool::try_from(stored.eq(3.0).all()).unwrap(), "not a shallow clone");
    vs.freeze();
    assert!(named_parameters(&vs).is_empty());
}

#[test]
fn vgg19_dropout_only_in_train_mode() {
    let spec = cifar(Arch::Vgg19, 10);
    let (_vs, model) = build(&spec);
    let xs = batch(&spec);
    let forward = |train| tch::no_grad(|| model.forward_t(&xs, train));
    assert!(forward(false).equal(&forward(false)), "eval mode must be deterministic");
    assert!(!forward(true).equal(&forward(true)), "train mode must drop out");
}

// ---- Loading weights ----

/// All variables of `vs`, by name, as a file would hold them.
fn all_variables(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut vars: Vec<_> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

fn seeded(spec: &ModelSpec, seed: i64) -> (nn::VarStore, Box<dyn ModuleT>) {
    tch::manual_seed(seed);
    build(spec)
}

fn eval(model: &dyn ModuleT, xs: &Tensor) -> Tensor {
    tch::no_grad(|| model.forward_t(xs, false))
}

/// Saves a seeded CNN with `save`, loads it into a differently seeded one, compares outputs.
fn cnn_round_trip(file_name: &str, save: impl Fn(&[(String, Tensor)], &Path)) {
    let spec = cifar(Arch::Cnn, 10);
    let (vs_a, a) = seeded(&spec, 1);
    let (vs_b, b) = seeded(&spec, 2);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file_name);
    save(&all_variables(&vs_a), &path);

    let xs = batch(&spec);
    assert!(!eval(&*a, &xs).equal(&eval(&*b, &xs)), "differently seeded models must differ");
    let loaded = load_weights(&vs_b, &spec, &path).unwrap();
    assert_eq!((loaded.loaded, loaded.new_head.len()), (8, 0));
    assert!(eval(&*a, &xs).equal(&eval(&*b, &xs)));
    // Loaded variables stay trainable parameters.
    assert_eq!(named_parameters(&vs_b).len(), 8);
}

#[test]
fn weights_round_trip_safetensors() {
    cnn_round_trip("cnn.safetensors", |vars, path| Tensor::write_safetensors(vars, path).unwrap());
}

#[test]
fn weights_round_trip_ot_with_kind_conversion() {
    // Stored as f64, loaded into the f32 model (exactly, since the values came from f32).
    cnn_round_trip("cnn.ot", |vars, path| {
        let doubles: Vec<_> = vars.iter().map(|(n, t)| (n.clone(), t.to_kind(Kind::Double))).collect();
        Tensor::save_multi(&doubles, path).unwrap()
    });
}

#[test]
fn weights_round_trip_resnet34_with_batch_norm_buffers() {
    let spec = cifar(Arch::Resnet34, 10);
    let (vs_a, a) = seeded(&spec, 1);
    // A train-mode pass moves the running statistics away from their initial 0 / 1.
    let _ = tch::no_grad(|| a.forward_t(&batch(&spec), true));
    let mut vars = all_variables(&vs_a);
    // torchvision files also hold num_batches_tracked, which has no counterpart here.
    vars.push(("bn1.num_batches_tracked".into(), Tensor::from(1i64)));
    vars.push(("layer1.0.bn1.num_batches_tracked".into(), Tensor::from(1i64)));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resnet34.safetensors");
    Tensor::write_safetensors(&vars, &path).unwrap();

    let (vs_b, b) = seeded(&spec, 2);
    load_weights(&vs_b, &spec, &path).unwrap();
    let running_var = |vs: &nn::VarStore| vs.variables()["layer3.5.bn2.running_var"].shallow_clone();
    assert!(running_var(&vs_a).equal(&running_var(&vs_b)));
    let xs = batch(&spec);
    assert!(eval(&*a, &xs).allclose(&eval(&*b, &xs), 1e-6, 1e-6, false));
}

/// Writes `vars` to a temporary `.safetensors` file and returns the error loading it into `vs`,
/// a 10-class CNN.
fn load_error(vs: &nn::VarStore, vars: &[(String, Tensor)]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    Tensor::write_safetensors(vars, &path).unwrap();
    let message = format!("{:#}", load_weights(vs, &cifar(Arch::Cnn, 10), &path).unwrap_err());
    assert!(message.contains(&path.display().to_string()), "names the file: {message}");
    assert_eq!(message.lines().count(), 1, "one line: {message}");
    message
}

#[test]
fn weights_shape_mismatch_names_both_shapes_and_copies_nothing() {
    let (vs, _) = build(&cifar(Arch::Cnn, 10));
    let before = all_variables(&vs).into_iter().map(|(n, t)| (n, t.copy())).collect::<Vec<_>>();
    let mut vars: Vec<_> = before.iter().map(|(n, t)| (n.clone(), t.ones_like())).collect();
    // A backbone tensor of another shape (the head's may differ: see tests/transfer.rs).
    let conv1 = vars.iter_mut().find(|(name, _)| name == "conv1.weight").unwrap();
    conv1.1 = Tensor::zeros([50, 1, 5, 5], (Kind::Float, Device::Cpu));

    let message = load_error(&vs, &vars);
    assert!(message.contains("conv1.weight: file [50, 1, 5, 5] vs model [50, 3, 5, 5]"), "{message}");
    assert!(!message.contains("missing") && !message.contains("unexpected"), "{message}");
    for (name, old) in &before {
        assert!(vs.variables()[name].equal(old), "{name} changed although loading failed");
    }
}

#[test]
fn weights_missing_and_unexpected_tensors_are_listed() {
    let (vs, _) = build(&cifar(Arch::Cnn, 10));
    let mut vars: Vec<_> = all_variables(&vs).into_iter().filter(|(name, _)| name != "conv1.bias" && name != "fc1.weight").collect();
    let extra = Tensor::zeros([1], (Kind::Float, Device::Cpu));
    vars.extend((0..15).map(|i| (format!("extra.{i:02}"), extra.copy())));

    let message = load_error(&vs, &vars);
    assert!(message.contains("missing from the file (2): conv1.bias, fc1.weight"), "{message}");
    // Long lists are capped at 10 names.
    assert!(message.contains("unexpected in the file (15): extra.00,"), "{message}");
    assert!(message.contains("extra.09, ... and 5 more"), "{message}");
    assert!(!message.contains("extra.10"), "{message}");
}

#[test]
fn weights_unknown_extension_and_missing_file() {
    let (vs, _) = build(&cifar(Arch::Cnn, 10));
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("weights.bin");
    std::fs::write(&bin, b"not a checkpoint").unwrap();
    let spec = cifar(Arch::Cnn, 10);
    let message = load_weights(&vs, &spec, &bin).unwrap_err().to_string();
    assert!(message.contains("weights.bin") && message.contains("expected a .safetensors, .pth, .pt"), "{message}");
    // A .pth that torch.save did not write, a torn one: one line each, nothing loaded.
    let pt = dir.path().join("weights.pt");
    std::fs::write(&pt, b"not a checkpoint").unwrap();
    let message = load_weights(&vs, &spec, &pt).unwrap_err().to_string();
    assert!(message.contains("weights.pt is not a file torch.save wrote"), "{message}");

    let absent = dir.path().join("absent.safetensors");
    let message = load_weights(&vs, &spec, &absent).unwrap_err().to_string();
    assert!(message.contains(&absent.display().to_string()) && message.contains("does not exist"), "{message}");
}

/// torchvision's own models saved with `torch.save(model.state_dict())`, as its published ImageNet
/// files are: resnet34 in the zip layout (read by LibTorch's `torch::pickle_load`), vgg19 in the
/// legacy layout of 2017 that `vgg19-dcbb9e9d.pth` has (read by `models::torch_save`). Both load by
/// name with every tensor as torchvision's, and the models give torchvision's logits on the same
/// input. Torn and truncated copies of both are refused in one line.
#[test]
fn torchvision_pth_files_load_and_give_torchvisions_logits() {
    for (arch, layout) in [(Arch::Resnet34, "zip"), (Arch::Vgg19, "legacy")] {
        let dir = tempfile::tempdir().unwrap();
        let reference = support::Reference::compute("torchvision_pth.py", &[arch.name(), layout, dir.path().to_str().unwrap()]);
        let file = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|e| e == "pth")).unwrap();
        let spec = ModelSpec { arch, in_channels: 3, image_size: 64, num_classes: 1000 };
        let (vs, model) = build(&spec);
        let loaded = load_weights(&vs, &spec, &file).unwrap();
        assert!(loaded.new_head.is_empty(), "{arch:?}");
        let ours: std::collections::HashMap<String, Tensor> = vs.variables().into_iter().collect();
        for (name, theirs) in reference.with_prefix("sd.") {
            assert_eq!(ours[&name].to_kind(theirs.kind()), *theirs, "{arch:?} {name}");
        }
        let logits = tch::no_grad(|| model.forward_t(reference.get("x"), false));
        let diff = f64::try_from((logits - reference.get("logits")).abs().max()).unwrap();
        assert!(diff < 1e-4, "{arch:?} ({layout}): logits differ from torchvision's by {diff}");

        let bytes = std::fs::read(&file).unwrap();
        let torn = dir.path().join("torn.pth");
        std::fs::write(&torn, &bytes[..bytes.len() * 2 / 3]).unwrap();
        let message = format!("{:#}", load_weights(&vs, &spec, &torn).unwrap_err());
        assert!(message.contains("torn.pth is not a state_dict torch.save wrote") && !message.contains('\n'), "{arch:?}: {message}");
    }
}

/// Keras's own ResNet50V2 (`keras.applications.ResNet50V2`, the Namal/BSC course's model) is the
/// reference of ours: the same parameter counts (Keras's total counts the batch norms' moving
/// statistics, our buffers), its weights load by name with nothing left over, and ours gives its
/// logits on the same input, in inference and in training mode (batch statistics), and moves
/// the running mean as its momentum 0.99 does.
#[test]
fn resnet50v2_is_keras_resnet50v2() {
    let dir = tempfile::tempdir().unwrap();
    let reference = support::Reference::compute("keras_resnet50v2.py", &[dir.path().to_str().unwrap()]);
    let keras_count = |key: &str| i64::try_from(reference.get(key)).unwrap();
    let statistics = |vs: &nn::VarStore| -> i64 {
        vs.variables().iter().filter(|(n, _)| n.ends_with(".running_mean") || n.ends_with(".running_var")).map(|(_, t)| t.numel() as i64).sum()
    };
    let spec = ModelSpec { arch: Arch::Resnet50v2, in_channels: 3, image_size: 64, num_classes: 10 };
    let (vs, model) = build(&spec);
    assert_eq!(param_count(&vs), keras_count("trainable"));
    assert_eq!(param_count(&vs) + statistics(&vs), keras_count("total"));
    let (imagenet, _) = build(&ModelSpec { num_classes: 1000, image_size: 224, ..spec.clone() });
    assert_eq!(param_count(&imagenet) + statistics(&imagenet), keras_count("total_1000"), "Keras's 25.6M");

    let loaded = load_weights(&vs, &spec, &dir.path().join("resnet50v2.pth")).unwrap();
    assert!(loaded.new_head.is_empty());
    let x = reference.get("x");
    for (train, key) in [(false, "logits_eval"), (true, "logits_train")] {
        let logits = tch::no_grad(|| model.forward_t(x, train));
        let theirs = reference.get(key);
        let scale = f64::try_from(theirs.abs().max()).unwrap();
        let diff = f64::try_from((logits - theirs).abs().max()).unwrap();
        assert!(diff < 1e-4 * scale, "{key}: ours differ from Keras's by {diff} (logits up to {scale})");
    }
    let running_mean = &vs.variables()["post_bn.running_mean"];
    let diff = f64::try_from((running_mean - reference.get("post_mean")).abs().max()).unwrap();
    assert!(diff < 1e-5, "post_bn's running mean after one training batch differs from Keras's by {diff}");
}

#[test]
fn resnet50v2_blocks_and_shapes_on_the_courses_input() {
    // The course's 128×128 CIFAR-10: every stack but the last halves the map in its last block.
    let spec = ModelSpec { arch: Arch::Resnet50v2, in_channels: 3, image_size: 128, num_classes: 10 };
    let (vs, _) = check_model(&spec, 23_539_850);
    assert_eq!(shape(&vs, "conv1_conv.weight"), [64, 3, 7, 7]);
    assert_eq!(shape(&vs, "conv2_block1.0_conv.weight"), [256, 64, 1, 1], "the first block projects");
    assert!(!names(&vs).contains("conv2_block3.0_conv.weight"), "the last (stride-2) block subsamples instead");
    assert_eq!(shape(&vs, "conv5_block3.3_conv.bias"), [2048]);
    assert_eq!(shape(&vs, "predictions.weight"), [10, 2048]);
    let blocks = Blocks::of(&spec);
    let names: Vec<&str> = blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!((names.len(), names[0], names[1], names[16], names[17]), (18, "conv1_conv", "conv2_block1", "conv5_block3", "predictions"));
    assert_eq!(blocks.position("post_bn.running_var"), Some(16), "the closing batch norm belongs to the last block");
    // MNIST too: grey images are repeated to 3 channels and padded to 32×32.
    check_model(&ModelSpec { arch: Arch::Resnet50v2, ..mnist(Arch::Resnet50v2, 10) }, 23_539_850);
}
