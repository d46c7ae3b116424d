//! Transfer learning in the library: the models' blocks.
use common::models::{self, Arch, Blocks, ModelSpec};
use tch::nn::{self, ModuleT};
use tch::Device;

fn cifar(arch: Arch, num_classes: i64) -> ModelSpec {
    ModelSpec { arch, in_channels: 3, image_size: 32, num_classes }
}

fn build(spec: &ModelSpec, seed: i64) -> (nn::VarStore, Box<dyn ModuleT>) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = models::build(&vs.root(), spec);
    (vs, model)
}

#[test]
fn blocks_hold_every_variable_once_in_forward_order_with_the_head_last() {
    let expected = [(Arch::Cnn, 4, "fc2"), (Arch::Resnet34, 18, "fc"), (Arch::Vgg19, 19, "classifier.6")];
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
    let vgg = names(Arch::Vgg19);
    assert_eq!(vgg[..4], ["features.0", "features.2", "features.5", "features.7"]);
    assert_eq!(vgg[15..], ["features.34", "classifier.0", "classifier.3", "classifier.6"]);
    // `layer1.1` must not hold `layer1.10...` nor `layer1.1` hold `layer1.1x`: whole path parts.
    let block = Blocks::of(&cifar(Arch::Resnet34, 10)).iter().find(|b| b.name == "layer1.1").unwrap().clone();
    assert!(block.holds("layer1.1.conv1.weight") && !block.holds("layer1.10.conv1.weight") && !block.holds("layer1.1"));
}
