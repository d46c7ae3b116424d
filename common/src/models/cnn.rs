//! The course's simple CNN, as written in the PyTorch exercises:
//! conv(C→50, k5) → maxpool2 → ReLU → conv(50→75, k5) → maxpool2 → ReLU → flatten →
//! fc(→50) → ReLU → fc(→num_classes).
use super::blocks::Block;
use super::{torch_linear, ModelSpec, TORCH_DEFAULT_WEIGHT};
use tch::nn::{self, Module};
use tch::{Device, Tensor};

const KERNEL: i64 = 5;
const CONV1_CHANNELS: i64 = 50;
const CONV2_CHANNELS: i64 = 75;
const HIDDEN: i64 = 50;

/// The CNN's blocks (see [`super::blocks`]): its four layers.
pub(super) fn blocks() -> Vec<Block> {
    ["conv1", "conv2", "fc1", "fc2"].into_iter().map(Block::module).collect()
}

#[derive(Debug)]
pub(super) struct Cnn {
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

/// `nn.Conv2d` (no padding) with PyTorch's default init: weight and bias U(±1/√fan_in).
fn torch_conv(vs: nn::Path, in_dim: i64, out_dim: i64) -> nn::Conv2D {
    let bound = 1. / ((in_dim * KERNEL * KERNEL) as f64).sqrt();
    let config = nn::ConvConfig { ws_init: TORCH_DEFAULT_WEIGHT, bs_init: nn::Init::Uniform { lo: -bound, up: bound }, ..Default::default() };
    nn::conv2d(vs, in_dim, out_dim, KERNEL, config)
}

/// The smallest image side that leaves a 1×1 map after both convolutions and max-pools.
pub(super) const MIN_SIDE: i64 = 16;

/// Side of the feature map after one unpadded k5 convolution and a 2×2 max-pool (floor).
fn conv_pool_side(side: i64) -> i64 {
    (side - (KERNEL - 1)) / 2
}

impl Cnn {
    pub(super) fn new(vs: &nn::Path, spec: &ModelSpec) -> Cnn {
        // CIFAR-10: 32 → 14 → 5, MNIST: 28 → 12 → 4.
        let side = conv_pool_side(conv_pool_side(spec.image_size));
        assert!(side > 0, "the CNN needs images of at least {MIN_SIDE}×{MIN_SIDE}, got {}", spec.image_size);
        Cnn {
            conv1: torch_conv(vs / "conv1", spec.in_channels, CONV1_CHANNELS),
            conv2: torch_conv(vs / "conv2", CONV1_CHANNELS, CONV2_CHANNELS),
            fc1: torch_linear(vs / "fc1", CONV2_CHANNELS * side * side, HIDDEN),
            fc2: torch_linear(vs / "fc2", HIDDEN, spec.num_classes),
        }
    }
}

/// The same `[N, C, H, W]` tensor with its channels innermost in memory (PyTorch's
/// `channels_last` memory format), which LibTorch's convolutions keep for their outputs.
fn channels_last(xs: &Tensor) -> Tensor {
    xs.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2])
}

impl Module for Cnn {
    fn forward(&self, xs: &Tensor) -> Tensor {
        // On the CPU, oneDNN's convolutions (forward and backward) run about a quarter faster
        // on channels-last activations, with the same results up to rounding (the same sums in
        // another order: relative differences of 1e-6 in the gradients, as between one and two
        // threads). Both max-pools come before their ReLU, so no ties among zeros are broken
        // differently. (Not for ResNet34 or VGG19: there, channels-last batch norm and max-pool
        // after ReLU change gradients by 1e-3.) The ReLUs run in place: max-pool's and linear's
        // backward need their inputs, not their outputs.
        let xs = if xs.device() == Device::Cpu { channels_last(xs) } else { xs.shallow_clone() };
        xs.apply(&self.conv1)
            .max_pool2d_default(2)
            .relu_()
            .apply(&self.conv2)
            .max_pool2d_default(2)
            .relu_()
            .flatten(1, -1)
            .apply(&self.fc1)
            .relu_()
            .apply(&self.fc2)
    }
}
