//! Models of the course, in torchvision's parameter layout.
//!
//! Variable names follow PyTorch's `state_dict` keys exactly (`layer2.0.downsample.0.weight`,
//! `features.34.bias`, ...), so that torchvision's ImageNet weights
//! ([`pretrained`], `--weights imagenet`) load with [`load_weights`], and checkpoints line up
//! name for name with the PyTorch reference code. ResNet50V2, whose reference is Keras's, has
//! Keras's layer names instead ([`resnet_v2`]).
use tch::nn::{self, Init};
use tch::Tensor;

mod blocks;
mod cnn;
mod freeze;
pub mod parallel_layers;
pub mod pretrained;
pub(crate) mod resnet;
pub(crate) mod resnet_v2;
pub mod torch_save;
pub mod transformer;
pub mod transformer_names;
mod vgg;
mod weights;

pub use blocks::{Block, Blocks};
use freeze::BatchNorm;
pub use freeze::{freeze, Frozen, Trainable};
pub use transformer::{
    encoder_layers, encoder_layers_sharded, language_model_loss, output_layer, param_count_formula, EncoderLayer, Masks, OutputInit, PartSpan, TokenEmbedding,
    TransformerConfig, TransformerLm, TransformerPart,
};
pub use weights::{load_weights, LoadedWeights};

/// Which network to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// The course's simple CNN: conv(C→50,k5) → maxpool2 → ReLU → conv(50→75,k5) → maxpool2 → ReLU → fc(→50) → ReLU → fc
    Cnn,
    /// torchvision ResNet34
    Resnet34,
    /// torchvision ResNet50 (Bottleneck blocks, stride on the 3×3 convolution: v1.5)
    Resnet50,
    /// torchvision VGG19 (with adaptive average pooling to 7×7)
    Vgg19,
    /// Keras's ResNet50V2 (pre-activation blocks), the Namal/BSC course's model
    Resnet50v2,
}

impl Arch {
    /// The flag spelling: `cnn`, `resnet34`, `resnet50`, `vgg19`, `resnet50v2`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Cnn => "cnn",
            Arch::Resnet34 => "resnet34",
            Arch::Resnet50 => "resnet50",
            Arch::Vgg19 => "vgg19",
            Arch::Resnet50v2 => "resnet50v2",
        }
    }

    /// The smallest image side the model takes as it is (`--image-size`): the CNN's two k5
    /// convolutions and 2×2 max-pools leave nothing of less than 16×16; the ImageNet models
    /// pad smaller images to 32×32 ([`imagenet_input`]), which an image resized to less would
    /// only undo.
    pub fn min_image_size(self) -> i64 {
        match self {
            Arch::Cnn => cnn::MIN_SIDE,
            Arch::Resnet34 | Arch::Resnet50 | Arch::Vgg19 | Arch::Resnet50v2 => MIN_IMAGENET_SIDE,
        }
    }
}

/// Everything needed to build a model for a data set.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelSpec {
    pub arch: Arch,
    /// Channels of the input images (3 for CIFAR-10, 1 for MNIST).
    pub in_channels: i64,
    /// Height = width of the input images (32 for CIFAR-10, 28 for MNIST).
    pub image_size: i64,
    /// Size of the classification head.
    pub num_classes: i64,
}

/// Builds the model's variables under `root` and returns its forward function.
/// Input: float tensor `[N, in_channels, image_size, image_size]`; output: logits `[N, num_classes]`.
pub fn build(root: &nn::Path, spec: &ModelSpec) -> Box<dyn nn::ModuleT> {
    match spec.arch {
        Arch::Cnn => Box::new(cnn::Cnn::new(root, spec)),
        Arch::Resnet34 => Box::new(resnet::ResNet::new(root, spec, resnet::ResNetLayout::RESNET34)),
        Arch::Resnet50 => Box::new(resnet::ResNet::new(root, spec, resnet::ResNetLayout::RESNET50)),
        Arch::Vgg19 => Box::new(vgg::Vgg::vgg19(root, spec)),
        Arch::Resnet50v2 => Box::new(resnet_v2::ResNetV2::new(root, spec)),
    }
}

impl Blocks {
    /// The blocks of the model `spec` builds.
    pub fn of(spec: &ModelSpec) -> Blocks {
        Blocks::new(match spec.arch {
            Arch::Cnn => cnn::blocks(),
            Arch::Resnet34 => resnet::blocks(resnet::ResNetLayout::RESNET34),
            Arch::Resnet50 => resnet::blocks(resnet::ResNetLayout::RESNET50),
            Arch::Vgg19 => vgg::blocks(),
            Arch::Resnet50v2 => resnet_v2::blocks(),
        })
    }
}

/// A convolutional network run in the channels-last memory format (NHWC in memory, the same
/// NCHW shapes), as `model.to(memory_format=torch.channels_last)` with channels-last inputs:
/// cuDNN's tensor-core convolutions read that layout without transposing. [`ChannelsLast::new`]
/// moves the 4-D weights in `vs`; `forward_t` lays each input out so. Results are the same
/// computation in another memory order (equal to float rounding).
#[derive(Debug)]
pub struct ChannelsLast {
    inner: Box<dyn nn::ModuleT>,
}

impl ChannelsLast {
    pub fn new(vs: &nn::VarStore, inner: Box<dyn nn::ModuleT>) -> anyhow::Result<Self> {
        for variable in vs.variables().values() {
            crate::torch_ext::make_channels_last_(variable)?;
        }
        Ok(ChannelsLast { inner })
    }
}

impl nn::ModuleT for ChannelsLast {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let xs = crate::torch_ext::channels_last(xs).unwrap_or_else(|err| panic!("{err:#}"));
        self.inner.forward_t(&xs, train)
    }
}

/// What [`PartedModule::forward_parts`] hands each part to: `around(part, run)` runs the part's
/// computation `run` (with its parameters in place) and returns its output.
pub type AroundPart<'a> = dyn FnMut(usize, &dyn Fn() -> Tensor) -> anyhow::Result<Tensor> + 'a;

/// A model that can run part by part (FSDP's units): ZeRO-3 gathers a part's parameters just
/// before the part runs and frees them after. A model that does not say otherwise is one part.
pub trait PartedModule: nn::ModuleT {
    /// The part the variable `name` belongs to (0, 1, ...: in the order the parts run); an
    /// error for a name the model does not have.
    fn part_of(&self, _name: &str) -> anyhow::Result<usize> {
        Ok(0)
    }

    /// [`nn::ModuleT::forward_t`], each part's computation handed to `around`.
    fn forward_parts(&self, xs: &Tensor, train: bool, around: &mut AroundPart) -> anyhow::Result<Tensor> {
        around(0, &|| self.forward_t(xs, train))
    }

    /// The mean loss of the model's output for `xs` against `targets` and, when asked, its
    /// arg-max hits, where the model computes them itself rather than the step from its output
    /// (the Transformer's `--loss-chunks`: no logits of the whole batch); None where it does not.
    /// (The whole model on this rank only: a model whose parameters are sharded runs
    /// [`PartedModule::forward_parts`].)
    fn own_loss(&self, _xs: &Tensor, _targets: &Tensor, _train: bool, _count_hits: bool) -> Option<anyhow::Result<(Tensor, Option<Tensor>)>> {
        None
    }
}

/// Any model as one part.
#[derive(Debug)]
pub struct OnePart(pub Box<dyn nn::ModuleT>);

impl nn::ModuleT for OnePart {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.0.forward_t(xs, train)
    }
}

impl PartedModule for OnePart {}

/// Number of parameters, frozen ones included (buffers such as batch-norm running statistics
/// excluded): tch lists every variable created trainable, whatever its `requires_grad` now.
pub fn param_count(vs: &nn::VarStore) -> i64 {
    vs.trainable_variables().iter().map(|t| t.numel() as i64).sum()
}

/// The trainable variables of `vs` with their names, sorted by name (shallow clones: they share
/// storage with the var store). Sorting gives optimizers and checkpoints one stable order,
/// independent of the var store's hash map. Buffers (batch-norm running statistics) and frozen
/// variables are left out: "trainable" means `requires_grad()`.
pub fn named_parameters(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    params.sort_by(|(a, _), (b, _)| a.cmp(b));
    params
}

// ---- Initialisations shared by the models, chosen to match PyTorch/torchvision. ----

/// torchvision's convolution init for ResNet and VGG: `kaiming_normal_(mode="fan_out",
/// nonlinearity="relu")`.
const KAIMING_NORMAL_FAN_OUT: Init =
    Init::Kaiming { dist: nn::init::NormalOrUniform::Normal, fan: nn::init::FanInOut::FanOut, non_linearity: nn::init::NonLinearity::ReLU };

/// PyTorch's default weight init for `nn.Linear` and `nn.Conv2d`: `kaiming_uniform_(a=√5)`,
/// i.e. U(−1/√fan_in, 1/√fan_in). tch's own default (`DEFAULT_KAIMING_UNIFORM`) uses the ReLU
/// gain √2 instead, giving √6 times wider weights; the gain √(1/3) restores PyTorch's bound.
const TORCH_DEFAULT_WEIGHT: Init = Init::Kaiming {
    dist: nn::init::NormalOrUniform::Uniform,
    fan: nn::init::FanInOut::FanIn,
    non_linearity: nn::init::NonLinearity::ExplicitGain(0.577_350_269_189_625_8), // √(1/3)
};

/// `nn.Linear` with PyTorch's default init. (tch's default bias init, U(±1/√in), already matches.)
fn torch_linear(vs: nn::Path, in_dim: i64, out_dim: i64) -> nn::Linear {
    let config = nn::LinearConfig { ws_init: TORCH_DEFAULT_WEIGHT, ..Default::default() };
    nn::linear(vs, in_dim, out_dim, config)
}

/// Batch norm as torchvision initialises it (weight 1, bias 0; tch defaults to a U(0, 1) weight).
/// tch's default eps 1e-5 and momentum 0.1 have PyTorch's meaning (the weight of the new
/// batch statistic in the running average), so they stay. In a frozen block it keeps its
/// running statistics ([`freeze::BatchNorm`]).
fn batch_norm(vs: nn::Path, channels: i64) -> BatchNorm {
    let config = nn::BatchNormConfig { ws_init: Init::Const(1.), bs_init: Init::Const(0.), ..Default::default() };
    BatchNorm(nn::batch_norm2d(vs, channels, config))
}

/// Input channels of the first convolution of the ImageNet models: a grey image (MNIST) is
/// repeated to 3 channels by [`imagenet_input`], so that the stem keeps ImageNet's shape and
/// pretrained weights still load.
fn imagenet_stem_channels(in_channels: i64) -> i64 {
    if in_channels == 1 {
        3
    } else {
        in_channels
    }
}

/// Smallest image side the ImageNet models accept: VGG halves the map five times and needs at
/// least 1×1 left at the end (ResNet would cope with less, but both get the same treatment).
const MIN_IMAGENET_SIDE: i64 = 32;

/// Adapts small data-set images to the ImageNet models, inside the model so that data loading
/// stays the same for every architecture:
/// - a 1-channel image (MNIST) is repeated to 3 channels, matching the 3-channel stem of the
///   ImageNet weights;
/// - an image smaller than 32×32 (MNIST's 28×28) is zero-padded (centred) to 32×32, since
///   VGG19's five 2×2 max-pools would otherwise shrink 28 → 0. On mean/std-normalised input
///   zero is the mean pixel, a neutral border.
///
/// CIFAR-10's 3×32×32 images pass through unchanged.
fn imagenet_input(xs: &Tensor) -> Tensor {
    let (_, channels, height, width) = xs.size4().expect("model input must be [N, C, H, W]");
    let xs = if channels == 1 { xs.repeat([1, 3, 1, 1]) } else { xs.shallow_clone() };
    let pad = |side: i64| {
        let total = (MIN_IMAGENET_SIDE - side).max(0);
        [total / 2, total - total / 2]
    };
    let ([left, right], [top, bottom]) = (pad(width), pad(height));
    if left + right + top + bottom == 0 {
        xs
    } else {
        xs.constant_pad_nd([left, right, top, bottom])
    }
}
