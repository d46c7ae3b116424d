//! VGG19 in torchvision's exact layout (`torchvision.models.vgg19`, no batch norm): the
//! `features.N` indices count the ReLU and max-pool layers too, exactly as PyTorch's
//! `nn.Sequential` numbers them.
use super::blocks::Block;
use super::{imagenet_input, imagenet_stem_channels, ModelSpec, KAIMING_NORMAL_FAN_OUT};
use tch::nn::{self, Init, ModuleT};
use tch::Tensor;

/// One entry of torchvision's VGG configuration: a 3×3 convolution (+ ReLU) with this many
/// output channels, or a 2×2 max-pool.
#[derive(Debug, Clone, Copy)]
enum Layer {
    Conv(i64),
    MaxPool,
}
use Layer::{Conv, MaxPool};

/// torchvision's configuration "E" (VGG19).
#[rustfmt::skip]
const VGG19: [Layer; 21] = [
    Conv(64), Conv(64), MaxPool,
    Conv(128), Conv(128), MaxPool,
    Conv(256), Conv(256), Conv(256), Conv(256), MaxPool,
    Conv(512), Conv(512), Conv(512), Conv(512), MaxPool,
    Conv(512), Conv(512), Conv(512), Conv(512), MaxPool,
];

/// The layers of `config` with their indices in torchvision's `features` Sequential, where a
/// convolution is followed by its ReLU (`features.0`, `features.2`, max-pool `features.4`, ...).
fn numbered(config: &[Layer]) -> impl Iterator<Item = (usize, Layer)> + '_ {
    config.iter().scan(0, |index, &layer| {
        let at = *index;
        *index += match layer {
            Conv(_) => 2,
            MaxPool => 1,
        };
        Some((at, layer))
    })
}

/// `classifier.0`, `classifier.3`, `classifier.6`: the linear layers of torchvision's
/// classifier Sequential (1, 2, 4, 5 are ReLU and dropout).
const CLASSIFIER_LINEAR: [usize; 3] = [0, 3, 6];

/// VGG19's blocks (see [`super::blocks`]): its 16 convolutions and 3 linear layers.
pub(super) fn blocks() -> Vec<Block> {
    let convs = numbered(&VGG19).filter(|(_, layer)| matches!(layer, Conv(_))).map(|(index, _)| Block::module(format!("features.{index}")));
    convs.chain(CLASSIFIER_LINEAR.iter().map(|i| Block::module(format!("classifier.{i}")))).collect()
}

/// The classifier sees the features average-pooled to this side (torchvision's
/// `AdaptiveAvgPool2d((7, 7))`: on a 32×32 input the final 1×1 map is replicated 49 times).
const POOLED_SIDE: i64 = 7;
const HIDDEN: i64 = 4096;
const DROPOUT: f64 = 0.5;

/// A built feature layer; a max-pool has no variables.
#[derive(Debug)]
enum Feature {
    Conv(nn::Conv2D),
    MaxPool,
}

#[derive(Debug)]
pub(super) struct Vgg {
    features: Vec<Feature>,
    /// `classifier.0`, `classifier.3`, `classifier.6` (1, 2, 4, 5 are ReLU and dropout).
    fc: [nn::Linear; 3],
}

/// torchvision's `nn.Linear` init in VGG: N(0, 0.01) weights, zero bias.
fn linear(vs: nn::Path, in_dim: i64, out_dim: i64) -> nn::Linear {
    let config = nn::LinearConfig { ws_init: Init::Randn { mean: 0., stdev: 0.01 }, bs_init: Some(Init::Const(0.)), bias: true };
    nn::linear(vs, in_dim, out_dim, config)
}

impl Vgg {
    pub(super) fn vgg19(vs: &nn::Path, spec: &ModelSpec) -> Vgg {
        Self::new(vs, &VGG19, spec)
    }

    fn new(vs: &nn::Path, config: &[Layer], spec: &ModelSpec) -> Vgg {
        let conv_config = nn::ConvConfig { padding: 1, ws_init: KAIMING_NORMAL_FAN_OUT, ..Default::default() };
        let features_vs = vs / "features";
        let mut features = Vec::with_capacity(config.len());
        let mut in_dim = imagenet_stem_channels(spec.in_channels);
        for (index, layer) in numbered(config) {
            match layer {
                Conv(out_dim) => {
                    let conv = nn::conv2d(&features_vs / index, in_dim, out_dim, 3, conv_config);
                    features.push(Feature::Conv(conv));
                    in_dim = out_dim;
                }
                MaxPool => features.push(Feature::MaxPool),
            }
        }
        let classifier = vs / "classifier";
        let [fc0, fc3, fc6] = CLASSIFIER_LINEAR;
        let fc = [
            linear(&classifier / fc0, in_dim * POOLED_SIDE * POOLED_SIDE, HIDDEN),
            linear(&classifier / fc3, HIDDEN, HIDDEN),
            linear(&classifier / fc6, HIDDEN, spec.num_classes),
        ];
        Vgg { features, fc }
    }
}

impl ModuleT for Vgg {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let features = self.features.iter().fold(imagenet_input(xs), |xs, layer| match layer {
            // In place, as torchvision's `ReLU(inplace=True)`: a convolution's backward
            // needs its input, not its output.
            Feature::Conv(conv) => xs.apply(conv).relu_(),
            Feature::MaxPool => xs.max_pool2d_default(2),
        });
        let [fc0, fc3, fc6] = &self.fc;
        features
            .adaptive_avg_pool2d([POOLED_SIDE, POOLED_SIDE])
            .flatten(1, -1)
            .apply(fc0)
            .relu_()
            .dropout(DROPOUT, train)
            .apply(fc3)
            .relu_()
            .dropout(DROPOUT, train)
            .apply(fc6)
    }
}
