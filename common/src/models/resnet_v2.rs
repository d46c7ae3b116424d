//! ResNet50V2, the pre-activation ResNet (He et al. 2016, "Identity Mappings in Deep Residual
//! Networks") exactly as Keras builds it (`keras.applications.ResNet50V2`): the model the
//! Namal/BSC course trains on CIFAR-10 resized to 128×128 (`weights=None`, `classes=10`).
//!
//! Its differences from torchvision's ResNet50 ([`super::resnet`]) are Keras's, kept so that the
//! parameter count and the computation are the reference's (`common/tests/models.rs` checks both
//! against Keras itself):
//! - every block starts with batch norm → ReLU (the "pre-activation") and ends on its last
//!   convolution's sum with the shortcut, unnormalised; one batch norm → ReLU closes the network
//!   (`post_bn`);
//! - a stack halves the map in its *last* block (torchvision: its first), whose shortcut is then a
//!   1×1 max-pool of stride 2 (every other pixel); the first block of each stack projects its
//!   pre-activated input with a 1×1 convolution (`0_conv`), the last stack keeps the map's size;
//! - the stem's convolution, the projections and each block's last 1×1 convolution have a bias;
//!   the stem has no batch norm, and its max-pool pads with zeros (Keras's `ZeroPadding2D`);
//! - batch norms with Keras's ε = 1.001e-5 and momentum 0.99 (PyTorch's 0.01); Glorot-uniform
//!   weights and zero biases.
//!
//! Variables are named after Keras's layers, `.` where Keras writes `_` between a block and its
//! layer (`conv2_block1.preact_bn.weight` is Keras's `conv2_block1_preact_bn/gamma`).
use tch::nn::{self, Init, ModuleT};
use tch::Tensor;

use super::blocks::Block;
use super::freeze::BatchNorm;
use super::resnet::{BlockShape, ConvShape, STEM_CHANNELS};
use super::{imagenet_input, imagenet_stem_channels, ModelSpec};

/// Blocks per stack (`conv2` .. `conv5`) and their widths (a block's output is 4× its width).
const STACK_BLOCKS: [usize; 4] = [3, 4, 6, 3];
const STACK_WIDTHS: [i64; 4] = [64, 128, 256, 512];
const EXPANSION: i64 = 4;

/// Channels into the classifier.
pub(crate) const FEATURES: i64 = STACK_WIDTHS[3] * EXPANSION;

/// Keras's `BatchNormalization(epsilon=1.001e-5)` of the ResNet applications.
const BN_EPS: f64 = 1.001e-5;
/// Keras's momentum 0.99 keeps 99% of the running average: PyTorch's momentum is the other 1%.
const BN_MOMENTUM: f64 = 0.01;

/// Every residual block in forward order (Keras's `stack2`): the first block of a stack
/// projects its input (`downsample` is the `0_conv` projection, stride 1), the last one of every
/// stack but `conv5` has stride 2 on its 3×3 convolution.
pub(crate) fn block_shapes() -> Vec<BlockShape> {
    let mut in_dim = STEM_CHANNELS;
    let mut out = Vec::new();
    for (stage, (&count, &width)) in STACK_BLOCKS.iter().zip(&STACK_WIDTHS).enumerate() {
        for index in 0..count {
            let stride = if index + 1 == count && stage + 1 < STACK_BLOCKS.len() { 2 } else { 1 };
            let conv = |in_dim, out_dim, kernel, stride| ConvShape { in_dim, out_dim, kernel, stride };
            let out_dim = width * EXPANSION;
            let convs = vec![conv(in_dim, width, 1, 1), conv(width, width, 3, stride), conv(width, out_dim, 1, 1)];
            let downsample = (index == 0).then(|| conv(in_dim, out_dim, 1, 1));
            out.push(BlockShape { stage, index, convs, downsample });
            in_dim = out_dim;
        }
    }
    out
}

/// Keras's name of a block: `conv2_block1` is the first block of the first stack.
fn block_name(shape: &BlockShape) -> String {
    format!("conv{}_block{}", shape.stage + 2, shape.index + 1)
}

/// The blocks `--train-last` counts (see [`super::blocks`]): the stem, the 16 residual blocks
/// (the last one with `post_bn`, the closing normalisation of its output), `predictions`.
pub(super) fn blocks() -> Vec<Block> {
    let shapes = block_shapes();
    let last = shapes.len() - 1;
    let residual = shapes.iter().enumerate().map(|(i, shape)| {
        let name = block_name(shape);
        if i == last {
            Block::new(name.clone(), &[&name, "post_bn"])
        } else {
            Block::module(name)
        }
    });
    std::iter::once(Block::module("conv1_conv")).chain(residual).chain([Block::module("predictions")]).collect()
}

/// Keras's default `glorot_uniform`: U(±√(6 / (fan_in + fan_out))), the fans counting the
/// kernel's area.
fn glorot_uniform(fan_in: i64, fan_out: i64) -> Init {
    let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
    Init::Uniform { lo: -bound, up: bound }
}

/// A Keras `Conv2D` (zero-padded by `kernel / 2` where Keras puts a `ZeroPadding2D` before it,
/// which is the same computation).
fn conv(vs: nn::Path, shape: ConvShape, bias: bool) -> nn::Conv2D {
    let ConvShape { in_dim, out_dim, kernel, stride } = shape;
    let area = kernel * kernel;
    let config = nn::ConvConfig {
        stride,
        padding: kernel / 2,
        bias,
        ws_init: glorot_uniform(in_dim * area, out_dim * area),
        bs_init: Init::Const(0.0),
        ..Default::default()
    };
    nn::conv2d(vs, in_dim, out_dim, kernel, config)
}

fn batch_norm(vs: nn::Path, channels: i64) -> BatchNorm {
    let config = nn::BatchNormConfig { eps: BN_EPS, momentum: BN_MOMENTUM, ws_init: Init::Const(1.), bs_init: Init::Const(0.), ..Default::default() };
    BatchNorm(nn::batch_norm2d(vs, channels, config))
}

/// One pre-activation bottleneck (Keras's `block2`).
#[derive(Debug)]
struct PreActBottleneck {
    preact_bn: BatchNorm,
    /// `0_conv`: the first block of a stack projects its pre-activated input.
    projection: Option<nn::Conv2D>,
    /// The 3×3 convolution's stride: a stride-2 block without projection subsamples its input.
    stride: i64,
    conv1: nn::Conv2D,
    bn1: BatchNorm,
    conv2: nn::Conv2D,
    bn2: BatchNorm,
    conv3: nn::Conv2D,
}

impl PreActBottleneck {
    fn new(vs: nn::Path, shape: &BlockShape) -> PreActBottleneck {
        let [c1, c2, c3] = [shape.convs[0], shape.convs[1], shape.convs[2]];
        PreActBottleneck {
            preact_bn: batch_norm(&vs / "preact_bn", c1.in_dim),
            projection: shape.downsample.map(|p| conv(&vs / "0_conv", p, true)),
            stride: c2.stride,
            conv1: conv(&vs / "1_conv", c1, false),
            bn1: batch_norm(&vs / "1_bn", c1.out_dim),
            conv2: conv(&vs / "2_conv", c2, false),
            bn2: batch_norm(&vs / "2_bn", c2.out_dim),
            conv3: conv(&vs / "3_conv", c3, true),
        }
    }
}

impl ModuleT for PreActBottleneck {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        // A fresh tensor from batch norm, so the in-place ReLU overwrites nothing else's.
        let preact = xs.apply_t(&self.preact_bn, train).relu_();
        let shortcut = match (&self.projection, self.stride) {
            (Some(projection), _) => preact.apply(projection),
            // Keras's MaxPooling2D(1, strides=2): every other pixel of the block's input.
            (None, stride) if stride > 1 => xs.slice(2, 0, None, stride).slice(3, 0, None, stride),
            (None, _) => xs.shallow_clone(),
        };
        let hidden = preact.apply(&self.conv1).apply_t(&self.bn1, train).relu_().apply(&self.conv2).apply_t(&self.bn2, train).relu_();
        hidden.apply(&self.conv3) + shortcut
    }
}

#[derive(Debug)]
pub(super) struct ResNetV2 {
    conv1: nn::Conv2D,
    blocks: Vec<PreActBottleneck>,
    post_bn: BatchNorm,
    predictions: nn::Linear,
}

impl ResNetV2 {
    pub(super) fn new(vs: &nn::Path, spec: &ModelSpec) -> ResNetV2 {
        let stem = ConvShape { in_dim: imagenet_stem_channels(spec.in_channels), out_dim: STEM_CHANNELS, kernel: 7, stride: 2 };
        let linear = nn::LinearConfig { ws_init: glorot_uniform(FEATURES, spec.num_classes), bs_init: Some(Init::Const(0.0)), bias: true };
        ResNetV2 {
            conv1: conv(vs / "conv1_conv", stem, true),
            blocks: block_shapes().iter().map(|shape| PreActBottleneck::new(vs / block_name(shape), shape)).collect(),
            post_bn: batch_norm(vs / "post_bn", FEATURES),
            predictions: nn::linear(vs / "predictions", FEATURES, spec.num_classes, linear),
        }
    }
}

impl ModuleT for ResNetV2 {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        // Keras pads with zeros before its max-pool (ZeroPadding2D, then MaxPooling2D(3, 2)):
        // the stem's output is not activated, so a zero border can win where PyTorch's
        // padding (−∞) never does.
        let stem = imagenet_input(xs).apply(&self.conv1).constant_pad_nd([1, 1, 1, 1]).max_pool2d([3, 3], [2, 2], [0, 0], [1, 1], false);
        let features = self.blocks.iter().fold(stem, |xs, block| xs.apply_t(block, train));
        super::resnet::global_average(&features.apply_t(&self.post_bn, train).relu_()).apply(&self.predictions)
    }
}
