//! Floating-point operations per training step, counted from the models' shapes, and how close
//! a run came to the hardware's peak (model-FLOPs utilisation, MFU).
//!
//! Counted are the multiply-adds of the convolutions and matrix products (what dominates; as
//! fvcore and torchvision's model tables count them), each 2 FLOPs, and a training step costs 3
//! forward passes (forward, and a backward that computes gradients for both the inputs and the
//! weights): training FLOPs = 6 × multiply-adds per example (the course's "2 × multiply-adds × 3").
//! For the Transformer, per token: 6·N for the N weights of the matrix products (the
//! embedding lookup is none), plus the attention's 12·layers·d_model·seq_len (PaLM's formula).
use tch::Device;

use crate::models::resnet::{BlockShape, ConvShape, ResNetLayout, STEM_CHANNELS};
use crate::models::{Arch, ModelSpec, Trainable, TransformerConfig};
use crate::precision::{MatmulPrecision, Precision};

/// Multiply-adds of one forward pass of one image through `spec`'s model.
pub fn forward_macs(spec: &ModelSpec) -> f64 {
    forward_macs_by_block(spec).iter().sum()
}

/// Multiply-adds of one image's forward pass through each block of `spec`'s model, in the order
/// of [`crate::models::Blocks::of`] (what `--train-last` and `--freeze` count in).
pub fn forward_macs_by_block(spec: &ModelSpec) -> Vec<f64> {
    match spec.arch {
        Arch::Cnn => cnn_macs(spec),
        Arch::Resnet34 | Arch::Resnet50 => {
            let layout = ResNetLayout::of(spec.arch).expect("a ResNet");
            resnet_macs(spec, &layout.blocks(), layout.features())
        }
        Arch::Resnet50v2 => resnet_macs(spec, &crate::models::resnet_v2::block_shapes(), crate::models::resnet_v2::FEATURES),
        Arch::Vgg19 => vgg19_macs(spec),
    }
}

/// Training FLOPs per image (forward and backward) of a model whose blocks train as
/// `trainable` says. A trained block costs 3 forward passes (6 FLOPs per multiply-add); a
/// frozen one, always before the trained ones, only its forward pass (2): nothing flows back
/// through it, since no gradient is wanted there.
pub fn training_flops_per_image(spec: &ModelSpec, trainable: Trainable) -> f64 {
    let blocks = forward_macs_by_block(spec);
    let first_trained = match trainable {
        Trainable::All => 0,
        Trainable::Last(n) => blocks.len().saturating_sub(n),
    };
    blocks.iter().enumerate().map(|(i, macs)| if i < first_trained { 2.0 } else { 6.0 } * macs).sum()
}

/// Training FLOPs per token of the Transformer language model with `seq_len`-token windows.
pub fn training_flops_per_token(cfg: &TransformerConfig, seq_len: i64) -> f64 {
    let TransformerConfig { ntoken, d_model: d, d_hid: h, nlayers: l, .. } = *cfg;
    // Per layer: q, k, v and output projections (4·d²) and the feed-forward block (2·d·h);
    // then the output layer (d·V).
    let matmul_weights = l * (4 * d * d + 2 * d * h) + d * ntoken;
    6.0 * matmul_weights as f64 + 12.0 * (l * d * seq_len) as f64
}

/// `c_in → c_out` convolution with a `k`×`k` kernel producing an `out`×`out` map.
fn conv_macs(c_in: i64, c_out: i64, k: i64, out: i64) -> f64 {
    (c_in * c_out * k * k * out * out) as f64
}

/// The side of a convolution's or pooling's output.
fn out_side(side: i64, kernel: i64, stride: i64, padding: i64) -> i64 {
    (side + 2 * padding - kernel) / stride + 1
}

/// The course CNN: conv(C→50, k5) → pool 2 → conv(50→75, k5) → pool 2 → fc(→50) → fc.
fn cnn_macs(spec: &ModelSpec) -> Vec<f64> {
    let s1 = out_side(spec.image_size, 5, 1, 0);
    let s2 = out_side(s1 / 2, 5, 1, 0);
    let flat = 75 * (s2 / 2) * (s2 / 2);
    vec![conv_macs(spec.in_channels, 50, 5, s1), conv_macs(50, 75, 5, s2), (flat * 50) as f64, (50 * spec.num_classes) as f64]
}

/// Side of the ImageNet models' input: small images are padded to 32 (see `models`).
fn imagenet_side(spec: &ModelSpec) -> i64 {
    spec.image_size.max(32)
}

/// The stem, every convolution of the residual `blocks` (their projections included: on the
/// block's input, at the block's stride for torchvision's, at stride 1 for ResNetV2's) as
/// [`ResNetLayout::blocks`] or `resnet_v2::block_shapes` lay them out, and the classifier on
/// `features` channels. Both stems (7×7 of stride 2, a 3×3 max-pool of stride 2) give the same
/// sides.
fn resnet_macs(spec: &ModelSpec, shapes: &[BlockShape], features: i64) -> Vec<f64> {
    let mut side = out_side(imagenet_side(spec), 7, 2, 3);
    let mut blocks = vec![conv_macs(3, STEM_CHANNELS, 7, side)];
    side = out_side(side, 3, 2, 1); // max pool

    // A convolution on a `side`×`side` map: its multiply-adds and the side of its output.
    let conv = |side: i64, c: &ConvShape| {
        let out = out_side(side, c.kernel, c.stride, c.kernel / 2);
        (conv_macs(c.in_dim, c.out_dim, c.kernel, out), out)
    };
    for block in shapes {
        let mut macs = block.downsample.as_ref().map_or(0.0, |projection| conv(side, projection).0);
        for c in &block.convs {
            let (m, out) = conv(side, c);
            (macs, side) = (macs + m, out);
        }
        blocks.push(macs);
    }
    blocks.push((features * spec.num_classes) as f64);
    blocks
}

fn vgg19_macs(spec: &ModelSpec) -> Vec<f64> {
    let mut side = imagenet_side(spec);
    let (mut blocks, mut channels) = (Vec::new(), 3);
    for width in [[64, 64, 0, 0], [128, 128, 0, 0], [256; 4], [512; 4], [512; 4]] {
        for width in width.into_iter().filter(|&w| w > 0) {
            blocks.push(conv_macs(channels, width, 3, side));
            channels = width;
        }
        side /= 2; // max pool
    }
    // Adaptive average pooling to 7×7, then the classifier's three layers.
    blocks.extend([(512 * 49 * 4096) as f64, (4096 * 4096) as f64, (4096 * spec.num_classes) as f64]);
    blocks
}

/// Dense peak TFLOP/s of the GPUs the project knows: (name fragment, float32 on the CUDA cores,
/// TF32 tensor cores, bfloat16/float16 tensor cores). From NVIDIA's data sheets; the V100 has no
/// TF32 (its float32 matrix products stay on the CUDA cores).
const GPU_PEAKS: [(&str, f64, f64, f64); 5] =
    [("H100 PCIe", 51.0, 378.0, 756.0), ("H100", 67.0, 494.7, 989.4), ("H200", 67.0, 494.7, 989.4), ("A100", 19.5, 156.0, 312.0), ("V100", 15.7, 15.7, 125.0)];

/// The peak TFLOP/s of `device` in `precision` with float32 matrix products at `matmul`:
/// `--peak-tflops` when given, else from the GPU's name (`nvidia-smi`) when it is one the
/// project knows (float32 at `high` counts TF32's peak, at `medium` bfloat16's); None on a
/// CPU without the flag.
pub fn peak_tflops(device: Device, precision: Precision, matmul: MatmulPrecision, given: Option<f64>) -> Option<(f64, String)> {
    if let Some(peak) = given {
        return Some((peak, "--peak-tflops".into()));
    }
    gpu_peak_tflops(&crate::device::gpu_name(device)?, precision, matmul)
}

/// The data sheet's peak TFLOP/s of the GPU named `name` (as `nvidia-smi` names it) in
/// `precision`, and where it comes from; None for a GPU the project does not know.
pub fn gpu_peak_tflops(name: &str, precision: Precision, matmul: MatmulPrecision) -> Option<(f64, String)> {
    let &(_, fp32, tf32, half) = GPU_PEAKS.iter().find(|(fragment, ..)| name.contains(fragment))?;
    let (peak, kind) = match (precision, matmul) {
        (Precision::Full, MatmulPrecision::Highest) => (fp32, "float32"),
        (Precision::Full, MatmulPrecision::High) => (tf32, "TF32"),
        _ => (half, "16-bit tensor-core"),
    };
    Some((peak, format!("{name}, {kind} data sheet")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(arch: Arch, in_channels: i64, image_size: i64, num_classes: i64) -> ModelSpec {
        ModelSpec { arch, in_channels, image_size, num_classes }
    }

    #[test]
    fn the_course_cnn_on_cifar10_by_hand() {
        // conv1 3·50·25·28² + conv2 50·75·25·10² + fc1 1875·50 + fc2 50·10.
        let expected = 2_940_000.0 + 9_375_000.0 + 93_750.0 + 500.0;
        assert_eq!(forward_macs(&spec(Arch::Cnn, 3, 32, 10)), expected);
        assert_eq!(training_flops_per_image(&spec(Arch::Cnn, 3, 32, 10), Trainable::All), 6.0 * expected);
        // Only fc2 trained: the rest runs forward only.
        assert_eq!(training_flops_per_image(&spec(Arch::Cnn, 3, 32, 10), Trainable::Last(1)), 2.0 * (expected - 500.0) + 6.0 * 500.0);
    }

    #[test]
    fn blocks_are_the_models_blocks_and_frozen_ones_cost_their_forward_pass_alone() {
        for arch in [Arch::Cnn, Arch::Resnet34, Arch::Resnet50, Arch::Vgg19, Arch::Resnet50v2] {
            let s = spec(arch, 3, 64, 1000);
            let blocks = forward_macs_by_block(&s);
            assert_eq!(blocks.len(), crate::models::Blocks::of(&s).len(), "{arch:?}");
            let all = training_flops_per_image(&s, Trainable::All);
            let head = *blocks.last().unwrap();
            let backbone = training_flops_per_image(&s, Trainable::Last(1));
            assert_eq!(backbone, 2.0 * (forward_macs(&s) - head) + 6.0 * head, "{arch:?}");
            assert!(backbone < all / 2.0, "{arch:?}: {backbone:e} vs {all:e}");
        }
    }

    #[test]
    fn imagenet_models_match_torchvisions_published_multiply_adds() {
        // torchvision's model tables (224×224, 1000 classes): ResNet34 3.66 G, ResNet50 4.09 G,
        // VGG19 19.63 G (they count the convolutions and linear layers, as here).
        let resnet = forward_macs(&spec(Arch::Resnet34, 3, 224, 1000));
        assert!((resnet / 1e9 - 3.66).abs() < 0.01, "ResNet34: {resnet:e}");
        let resnet50 = forward_macs(&spec(Arch::Resnet50, 3, 224, 1000));
        assert!((resnet50 / 1e9 - 4.09).abs() < 0.01, "ResNet50: {resnet50:e}");
        let vgg = forward_macs(&spec(Arch::Vgg19, 3, 224, 1000));
        assert!((vgg / 1e9 - 19.63).abs() < 0.01, "VGG19: {vgg:e}");
        // On CIFAR-10's 32×32 images they are far cheaper; MNIST is padded to 32×32.
        let small = forward_macs(&spec(Arch::Resnet34, 3, 32, 1000));
        assert!(small < resnet / 40.0);
        assert_eq!(forward_macs(&spec(Arch::Vgg19, 1, 28, 1000)), forward_macs(&spec(Arch::Vgg19, 3, 32, 1000)));
    }

    #[test]
    fn transformer_flops_are_six_per_weight_plus_attention() {
        let cfg = TransformerConfig { ntoken: 100, d_model: 8, nhead: 2, d_hid: 16, nlayers: 2, dropout: 0.0 };
        let weights = 2 * (4 * 64 + 2 * 8 * 16) + 8 * 100;
        assert_eq!(training_flops_per_token(&cfg, 10), 6.0 * weights as f64 + 12.0 * (2 * 8 * 10) as f64);
    }

    #[test]
    fn peak_from_the_flag_or_unknown_on_a_cpu() {
        assert_eq!(peak_tflops(Device::Cpu, Precision::Full, MatmulPrecision::Highest, Some(1.5)).map(|p| p.0), Some(1.5));
        assert_eq!(peak_tflops(Device::Cpu, Precision::Full, MatmulPrecision::High, None), None);
    }
}
