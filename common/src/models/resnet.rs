//! ResNet34 in torchvision's exact layout (`torchvision.models.resnet34`), so that its
//! `state_dict` keys and shapes are this var store's names and shapes.
use super::blocks::Block;
use super::{batch_norm, imagenet_input, imagenet_stem_channels, torch_linear, BatchNorm, ModelSpec, KAIMING_NORMAL_FAN_OUT};
use tch::nn::{self, ModuleT};
use tch::Tensor;

/// Blocks per stage of ResNet34.
const RESNET34_BLOCKS: [usize; 4] = [3, 4, 6, 3];
/// Output channels of the stem and of the four stages.
const STEM_CHANNELS: i64 = 64;
const STAGE_CHANNELS: [i64; 4] = [64, 128, 256, 512];

/// torchvision's convolutions in ResNet: no bias (the following batch norm has one).
fn conv(vs: nn::Path, in_dim: i64, out_dim: i64, kernel: i64, stride: i64) -> nn::Conv2D {
    let config = nn::ConvConfig { stride, padding: kernel / 2, bias: false, ws_init: KAIMING_NORMAL_FAN_OUT, ..Default::default() };
    nn::conv2d(vs, in_dim, out_dim, kernel, config)
}

/// conv3×3 → bn → ReLU → conv3×3 → bn, plus the (projected) input, → ReLU.
#[derive(Debug)]
struct BasicBlock {
    conv1: nn::Conv2D,
    bn1: BatchNorm,
    conv2: nn::Conv2D,
    bn2: BatchNorm,
    /// 1×1 convolution + batch norm projecting the input where the block changes the
    /// stride or the channel count (`downsample.0`, `downsample.1`).
    downsample: Option<(nn::Conv2D, BatchNorm)>,
}

impl BasicBlock {
    fn new(vs: nn::Path, in_dim: i64, out_dim: i64, stride: i64) -> BasicBlock {
        let downsample = (stride != 1 || in_dim != out_dim).then(|| {
            let ds = &vs / "downsample";
            (conv(&ds / "0", in_dim, out_dim, 1, stride), batch_norm(&ds / "1", out_dim))
        });
        BasicBlock {
            conv1: conv(&vs / "conv1", in_dim, out_dim, 3, stride),
            bn1: batch_norm(&vs / "bn1", out_dim),
            conv2: conv(&vs / "conv2", out_dim, out_dim, 3, 1),
            bn2: batch_norm(&vs / "bn2", out_dim),
            downsample,
        }
    }
}

impl ModuleT for BasicBlock {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        // In place where torchvision is (`ReLU(inplace=True)`, `out += identity`): batch norm's
        // backward needs its input, not its output, so its output may be overwritten, which
        // saves an allocation and a pass over the activation each time.
        let mut out = xs.apply(&self.conv1).apply_t(&self.bn1, train).relu_().apply(&self.conv2).apply_t(&self.bn2, train);
        match &self.downsample {
            Some((conv, bn)) => out += xs.apply(conv).apply_t(bn, train),
            None => out += xs,
        }
        out.relu_()
    }
}

/// `layer1` .. `layer4`: torchvision's name of stage `stage` (from 0).
fn stage_name(stage: usize) -> String {
    format!("layer{}", stage + 1)
}

/// ResNet34's blocks (see [`super::blocks`]): the stem, the 16 BasicBlocks, `fc`.
pub(super) fn blocks() -> Vec<Block> {
    let basic_blocks =
        RESNET34_BLOCKS.iter().enumerate().flat_map(|(stage, &count)| (0..count).map(move |i| Block::module(format!("{}.{i}", stage_name(stage)))));
    std::iter::once(Block::new("stem", &["conv1", "bn1"])).chain(basic_blocks).chain([Block::module("fc")]).collect()
}

#[derive(Debug)]
pub(super) struct ResNet {
    conv1: nn::Conv2D,
    bn1: BatchNorm,
    /// `layer1` .. `layer4`, all blocks in order (the stage boundaries only matter when building).
    blocks: Vec<BasicBlock>,
    fc: nn::Linear,
}

impl ResNet {
    pub(super) fn resnet34(vs: &nn::Path, spec: &ModelSpec) -> ResNet {
        let conv1 = conv(vs / "conv1", imagenet_stem_channels(spec.in_channels), STEM_CHANNELS, 7, 2);
        let bn1 = batch_norm(vs / "bn1", STEM_CHANNELS);
        let mut blocks = Vec::new();
        let mut in_dim = STEM_CHANNELS;
        for (stage, (&count, &out_dim)) in RESNET34_BLOCKS.iter().zip(&STAGE_CHANNELS).enumerate() {
            let layer = vs / stage_name(stage);
            // Every stage but the first halves the map in its first block.
            let first_stride = if stage == 0 { 1 } else { 2 };
            for i in 0..count {
                let stride = if i == 0 { first_stride } else { 1 };
                blocks.push(BasicBlock::new(&layer / i, in_dim, out_dim, stride));
                in_dim = out_dim;
            }
        }
        ResNet {
            conv1,
            bn1,
            blocks,
            // torchvision leaves `fc` at nn.Linear's default init.
            fc: torch_linear(vs / "fc", in_dim, spec.num_classes),
        }
    }
}

impl ModuleT for ResNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let stem = imagenet_input(xs).apply(&self.conv1).apply_t(&self.bn1, train).relu_().max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false);
        self.blocks.iter().fold(stem, |xs, block| xs.apply_t(block, train)).adaptive_avg_pool2d([1, 1]).flatten(1, -1).apply(&self.fc)
    }
}
