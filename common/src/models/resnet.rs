//! ResNet34 and ResNet50 in torchvision's exact layout (`torchvision.models.resnet34`,
//! `resnet50`), so that their `state_dict` keys and shapes are this var store's names and shapes.
//!
//! One network, two kinds of residual block: ResNet34 stacks BasicBlocks (3×3, 3×3), ResNet50
//! Bottlenecks (1×1, 3×3, 1×1 to 4× the width) with the stride on the 3×3 convolution, as
//! torchvision does ("ResNet v1.5"). [`ResNetLayout::blocks`] describes every block's
//! convolutions once; the model, its transfer-learning blocks and the FLOP count
//! (`crate::flops`) all read it.
use super::blocks::Block;
use super::{batch_norm, imagenet_input, imagenet_stem_channels, torch_linear, Arch, BatchNorm, ModelSpec, KAIMING_NORMAL_FAN_OUT};
use tch::nn::{self, ModuleT};
use tch::Tensor;

/// Output channels of the stem, and the width of the four stages' blocks (their output is
/// `width × expansion`).
pub(crate) const STEM_CHANNELS: i64 = 64;
const STAGE_WIDTHS: [i64; 4] = [64, 128, 256, 512];

/// The residual block a ResNet is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockKind {
    /// conv3×3 → bn → ReLU → conv3×3 → bn (ResNet18/34).
    Basic,
    /// conv1×1 → bn → ReLU → conv3×3 (the stride) → bn → ReLU → conv1×1 (4× the width) → bn
    /// (ResNet50/101/152).
    Bottleneck,
}

impl BlockKind {
    /// Output channels per unit of width (torchvision's `expansion`).
    fn expansion(self) -> i64 {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// One convolution of a block (no bias: each is followed by a batch norm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConvShape {
    pub in_dim: i64,
    pub out_dim: i64,
    pub kernel: i64,
    pub stride: i64,
}

/// One residual block: `layer{stage+1}.{index}`, its convolutions `conv1`, `conv2`, ... (each
/// with its batch norm `bn1`, `bn2`, ...), and the 1×1 projection of its input
/// (`downsample.0`, `downsample.1`) where it changes the stride or the channel count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BlockShape {
    /// The stage (0 for `layer1`) and the block's position in it.
    pub stage: usize,
    pub index: usize,
    pub convs: Vec<ConvShape>,
    pub downsample: Option<ConvShape>,
}

/// A ResNet's depth: its kind of block and how many per stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResNetLayout {
    pub kind: BlockKind,
    pub blocks: [usize; 4],
}

impl ResNetLayout {
    pub(crate) const RESNET34: ResNetLayout = ResNetLayout { kind: BlockKind::Basic, blocks: [3, 4, 6, 3] };
    pub(crate) const RESNET50: ResNetLayout = ResNetLayout { kind: BlockKind::Bottleneck, blocks: [3, 4, 6, 3] };

    /// The layout of `arch`, if it is a ResNet.
    pub(crate) fn of(arch: Arch) -> Option<ResNetLayout> {
        match arch {
            Arch::Resnet34 => Some(Self::RESNET34),
            Arch::Resnet50 => Some(Self::RESNET50),
            Arch::Cnn | Arch::Vgg19 | Arch::Resnet50v2 => None,
        }
    }

    /// Inputs of `fc`: the last stage's output channels.
    pub(crate) fn features(self) -> i64 {
        STAGE_WIDTHS[3] * self.kind.expansion()
    }

    /// Every residual block in forward order (torchvision's `_make_layer`): every stage but the
    /// first halves the map in its first block, which also projects its input when the
    /// channels change.
    pub(crate) fn blocks(self) -> Vec<BlockShape> {
        let expansion = self.kind.expansion();
        let mut in_dim = STEM_CHANNELS;
        let mut out = Vec::new();
        for (stage, (&count, &width)) in self.blocks.iter().zip(&STAGE_WIDTHS).enumerate() {
            for index in 0..count {
                let stride = if stage > 0 && index == 0 { 2 } else { 1 };
                let out_dim = width * expansion;
                let conv = |in_dim, out_dim, kernel, stride| ConvShape { in_dim, out_dim, kernel, stride };
                let convs = match self.kind {
                    BlockKind::Basic => vec![conv(in_dim, width, 3, stride), conv(width, width, 3, 1)],
                    BlockKind::Bottleneck => vec![conv(in_dim, width, 1, 1), conv(width, width, 3, stride), conv(width, out_dim, 1, 1)],
                };
                let downsample = (stride != 1 || in_dim != out_dim).then(|| conv(in_dim, out_dim, 1, stride));
                out.push(BlockShape { stage, index, convs, downsample });
                in_dim = out_dim;
            }
        }
        out
    }
}

impl BlockShape {
    /// `layer1` .. `layer4`: torchvision's name of the block's stage.
    fn stage_name(&self) -> String {
        format!("layer{}", self.stage + 1)
    }

    /// `layer2.0`: the block's module path.
    pub(crate) fn name(&self) -> String {
        format!("{}.{}", self.stage_name(), self.index)
    }
}

/// torchvision's convolutions in ResNet: no bias (the following batch norm has one).
fn conv(vs: nn::Path, shape: ConvShape) -> nn::Conv2D {
    let ConvShape { in_dim, out_dim, kernel, stride } = shape;
    let config = nn::ConvConfig { stride, padding: kernel / 2, bias: false, ws_init: KAIMING_NORMAL_FAN_OUT, ..Default::default() };
    nn::conv2d(vs, in_dim, out_dim, kernel, config)
}

/// A residual block of either kind: each convolution → bn → ReLU, the last one's without the
/// ReLU, plus the (projected) input, → ReLU.
#[derive(Debug)]
struct Residual {
    /// `conv1`/`bn1`, `conv2`/`bn2`(, `conv3`/`bn3`).
    layers: Vec<(nn::Conv2D, BatchNorm)>,
    /// 1×1 convolution + batch norm projecting the input where the block changes the stride or
    /// the channel count (`downsample.0`, `downsample.1`).
    downsample: Option<(nn::Conv2D, BatchNorm)>,
}

impl Residual {
    fn new(vs: nn::Path, shape: &BlockShape) -> Residual {
        let layers = shape
            .convs
            .iter()
            .enumerate()
            .map(|(i, &c)| (conv(&vs / format!("conv{}", i + 1), c), batch_norm(&vs / format!("bn{}", i + 1), c.out_dim)))
            .collect();
        let downsample = shape.downsample.map(|c| {
            let ds = &vs / "downsample";
            (conv(&ds / "0", c), batch_norm(&ds / "1", c.out_dim))
        });
        Residual { layers, downsample }
    }
}

impl ModuleT for Residual {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        // In place where torchvision is (`ReLU(inplace=True)`, `out += identity`): batch norm's
        // backward needs its input, not its output, so its output may be overwritten, which
        // saves an allocation and a pass over the activation each time.
        let (last, first) = self.layers.split_last().expect("a block has convolutions");
        let hidden = first.iter().fold(xs.shallow_clone(), |h, (conv, bn)| h.apply(conv).apply_t(bn, train).relu_());
        let mut out = hidden.apply(&last.0).apply_t(&last.1, train);
        match &self.downsample {
            Some((conv, bn)) => out += xs.apply(conv).apply_t(bn, train),
            None => out += xs,
        }
        out.relu_()
    }
}

/// A ResNet's blocks (see [`super::blocks`]): the stem, the residual blocks, `fc`.
pub(super) fn blocks(layout: ResNetLayout) -> Vec<Block> {
    let residual = layout.blocks().into_iter().map(|b| Block::module(b.name()));
    std::iter::once(Block::new("stem", &["conv1", "bn1"])).chain(residual).chain([Block::module("fc")]).collect()
}

#[derive(Debug)]
pub(super) struct ResNet {
    conv1: nn::Conv2D,
    bn1: BatchNorm,
    /// `layer1` .. `layer4`, all blocks in order (the stage boundaries only matter when building).
    blocks: Vec<Residual>,
    fc: nn::Linear,
}

impl ResNet {
    pub(super) fn new(vs: &nn::Path, spec: &ModelSpec, layout: ResNetLayout) -> ResNet {
        let stem = ConvShape { in_dim: imagenet_stem_channels(spec.in_channels), out_dim: STEM_CHANNELS, kernel: 7, stride: 2 };
        ResNet {
            conv1: conv(vs / "conv1", stem),
            bn1: batch_norm(vs / "bn1", STEM_CHANNELS),
            blocks: layout.blocks().iter().map(|shape| Residual::new(&(vs / shape.stage_name()) / shape.index, shape)).collect(),
            // torchvision leaves `fc` at nn.Linear's default init.
            fc: torch_linear(vs / "fc", layout.features(), spec.num_classes),
        }
    }
}

/// torchvision's `AdaptiveAvgPool2d((1, 1))` then `flatten(1)`: each channel's mean over the
/// plane, `[N, C, H, W]` to `[N, C]`. A mean rather than the pooling operator: the same numbers,
/// and a backward that has a deterministic CUDA kernel (the pooling's has none, so
/// `--deterministic` would refuse ResNets).
pub(crate) fn global_average(features: &Tensor) -> Tensor {
    features.mean_dim([-2i64, -1].as_slice(), false, None::<tch::Kind>)
}

impl ModuleT for ResNet {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let stem = imagenet_input(xs).apply(&self.conv1).apply_t(&self.bn1, train).relu_().max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false);
        global_average(&self.blocks.iter().fold(stem, |xs, block| xs.apply_t(block, train))).apply(&self.fc)
    }
}
