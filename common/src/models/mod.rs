//! Models of the course, in torchvision's parameter layout. (Owned by the models helper.)
use tch::nn;

/// Which network to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// The course's simple CNN: conv(C→50,k5) → maxpool2 → ReLU → conv(50→75,k5) → maxpool2 → ReLU → fc(→50) → ReLU → fc
    Cnn,
    /// torchvision ResNet34
    Resnet34,
    /// torchvision VGG19 (with adaptive average pooling to 7×7)
    Vgg19,
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
    let _ = (root, spec);
    todo!("models helper")
}

/// Number of trainable parameters (buffers such as batch-norm running statistics excluded).
pub fn param_count(vs: &nn::VarStore) -> i64 {
    vs.trainable_variables().iter().map(|t| t.numel() as i64).sum()
}
