//! The image-classification exercises (exercise1, exercise2, exercise3 ddp): their flags,
//! CIFAR-10 or MNIST (at `--image-size`), the CNN, ResNet34, ResNet50 or VGG19, and what their
//! results add. Everything around the training loop is [`crate::experiment`]'s.
use std::path::PathBuf;

use anyhow::Result;
use serde::Serialize;
use tch::Device;

use crate::data::{self, DatasetKind, ImageDataset, Loader, LoaderConfig, Split};
use crate::device;
use crate::dist::layout::Groups;
use crate::error::usage;
use crate::experiment::{self, Experiment, Sources};
use crate::flags::{ParallelArgs, RecipeArgs, RunArgs};
use crate::flops;
use crate::memory::estimate::RankEstimate;
use crate::models::{Arch, Blocks, ModelSpec, Trainable};
use crate::parallelize::ImagePlan;
use crate::presets::{ModelPreset, Preset};
use crate::report::{self, RunRecord};
use crate::train::{EvalSums, FitReport, Metric, Observers, TrainStep};

/// The flags every image-classification exercise shares (names are a contract).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct ImageArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub recipe: RecipeArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub parallel: ParallelArgs,
    /// Network to train [default: the preset's].
    #[arg(long, value_enum)]
    pub model: Option<Arch>,
    #[arg(long, value_enum, default_value = "cifar10")]
    pub dataset: DatasetKind,
    /// Initial weights in torchvision's names (.safetensors or .ot), e.g. ImageNet-pretrained;
    /// a head for another number of classes is left out and starts freshly initialised.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Size of the classification head [default: the data set's classes for cnn and for
    /// --freeze/--train-last, 1000 for resnet34/resnet50/vgg19 otherwise, as in the course].
    #[arg(long)]
    pub num_classes: Option<i64>,
    /// Feature extraction: `backbone` freezes everything but the head (the classifier's last
    /// layer), which alone trains on top of the --weights; frozen batch norms keep their
    /// running statistics.
    #[arg(long, value_enum, conflicts_with = "train_last")]
    pub freeze: Option<FreezeChoice>,
    /// Fine-tuning: only the last N blocks train, the ones before them frozen (ResNet34 and
    /// ResNet50: 18 blocks, the stem, 16 residual blocks and fc, so 4 is layer4 and fc; VGG19:
    /// 19, its 16 convolutions and 3 classifier layers).
    #[arg(long, value_name = "N")]
    pub train_last: Option<usize>,
    /// Random crop (padding 4) and horizontal flip on the training images.
    #[arg(long)]
    pub augment: bool,
    /// Train and evaluate on the images resized to N×N (bilinear, antialiased, as torchvision's
    /// `Resize((N, N))`; on the training device, after augmentation), e.g. 128 for CIFAR-10
    /// at ResNet50's scale [default: the data set's size, 32 for CIFAR-10, 28 for MNIST].
    #[arg(long, value_name = "N")]
    pub image_size: Option<i64>,
    /// Background threads preparing batches [default: 2 for a GPU; 0 for the CPU, whose cores
    /// LibTorch's threads already use: measured on 2 cores, loader threads beside them made
    /// ResNet34 8% slower].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Keep the whole data set on the training device and crop, flip and normalise batches
    /// there (no loader threads, no copies per step); the same batches as without.
    #[arg(long)]
    pub data_on_device: bool,
    /// Weights and inputs in the channels-last memory format (NHWC in memory), as
    /// `model.to(memory_format=torch.channels_last)`: cuDNN's tensor-core convolutions on a GPU
    /// read it directly. The same model and results (to float rounding).
    #[arg(long)]
    pub channels_last: bool,
}

/// The largest `--image-size`: over four times ImageNet's usual 224, where a batch of a few
/// images already fills a GPU's memory with ResNet50's activations; beyond it is a typo.
const MAX_IMAGE_SIZE: i64 = 1024;

/// What `--freeze` freezes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FreezeChoice {
    /// Every block but the head.
    Backbone,
}

/// An image exercise: its preset and flags.
pub struct ImageExperiment<'a> {
    pub preset: &'a Preset,
    pub args: &'a ImageArgs,
}

/// Runs the image exercise `preset` with `args` (see [`experiment::run`]).
pub fn run(preset: &Preset, args: &ImageArgs, listeners: &mut Observers) -> Result<Vec<RunRecord>> {
    experiment::run(&ImageExperiment { preset, args }, listeners)
}

impl ImageExperiment<'_> {
    pub fn arch(&self) -> Arch {
        match (self.args.model, self.preset.model) {
            (Some(arch), _) => arch,
            (None, ModelPreset::Image(arch)) => arch,
            (None, ModelPreset::Transformer { .. }) => unreachable!("an image exercise has an image preset"),
        }
    }

    /// Which blocks train: `--freeze backbone` is the head alone, `--train-last N` the last N.
    pub fn trainable(&self) -> Trainable {
        match (self.args.freeze, self.args.train_last) {
            (Some(FreezeChoice::Backbone), _) => Trainable::Last(1),
            (None, Some(n)) => Trainable::Last(n),
            (None, None) => Trainable::All,
        }
    }

    pub fn model_spec(&self) -> ModelSpec {
        let [channels, size, _] = self.args.dataset.image_shape();
        // The course keeps ImageNet's 1000-way head; transfer learning puts a head for the
        // data set's classes on the pretrained backbone.
        let default_classes = match (self.arch(), self.trainable()) {
            (Arch::Resnet34 | Arch::Resnet50 | Arch::Vgg19, Trainable::All) => 1000,
            _ => self.args.dataset.num_classes() as i64,
        };
        let image_size = self.args.image_size.unwrap_or(size as i64);
        ModelSpec { arch: self.arch(), in_channels: channels as i64, image_size, num_classes: self.args.num_classes.unwrap_or(default_classes) }
    }

    /// The side the loaders resize the images to: `--image-size`, where it differs from the
    /// data set's.
    fn resize(&self) -> Option<i64> {
        let [_, size, _] = self.args.dataset.image_shape();
        self.args.image_size.filter(|&side| side != size as i64)
    }

    fn batch_size(&self) -> usize {
        self.args.recipe.batch_size.unwrap_or(self.preset.recipe_for(&self.args.recipe).batch_size)
    }

    /// Loader threads for training on `device`: `--workers`, or 2 for a GPU and none for the CPU
    /// (where they would take cores from LibTorch's own threads, all busy with the training).
    fn workers(&self, device: Device) -> usize {
        self.args.workers.unwrap_or(if device.is_cuda() { 2 } else { 0 })
    }
}

/// The train and test splits.
pub struct ImageData {
    pub train: ImageDataset,
    pub test: ImageDataset,
}

impl Experiment for ImageExperiment<'_> {
    type Data = ImageData;
    type Model = ImagePlan;

    fn preset(&self) -> &Preset {
        self.preset
    }

    fn run_args(&self) -> &RunArgs {
        &self.args.run
    }

    fn recipe_args(&self) -> &RecipeArgs {
        &self.args.recipe
    }

    fn parallel_args(&self) -> &ParallelArgs {
        &self.args.parallel
    }

    fn flags_json(&self) -> serde_json::Value {
        serde_json::to_value(self.args).expect("flags serialise")
    }

    fn check(&self) -> Result<()> {
        let dataset = self.args.dataset;
        if self.args.num_classes.is_some_and(|n| n < dataset.num_classes() as i64) {
            return usage(format!("--num-classes must be at least {} for {}", dataset.num_classes(), dataset.name()));
        }
        if let Some(side) = self.args.image_size {
            let (arch, least) = (self.arch(), self.arch().min_image_size());
            if side < least {
                return usage(format!("--image-size {side}: {} needs images of at least {least}×{least}", arch.name()));
            }
            if side > MAX_IMAGE_SIZE {
                return usage(format!("--image-size {side}: at most {MAX_IMAGE_SIZE}"));
            }
        }
        let trainable = self.trainable();
        if trainable != Trainable::All {
            if self.args.weights.is_none() && !self.args.run.resume {
                let flag = if self.args.freeze.is_some() { "--freeze backbone" } else { "--train-last" };
                return usage(format!("{flag} keeps pretrained blocks as they are: give them with --weights FILE (or continue a run with --resume)"));
            }
            if let Err(err) = trainable.check(&Blocks::of(&self.model_spec()), self.arch().name()) {
                return usage(err.to_string());
            }
        }
        Ok(())
    }

    fn load(&self, observers: &mut Observers, announce: bool) -> Result<ImageData> {
        let args = self.args;
        let dir = args.run.data_dir_or(args.dataset.name());
        let train = data::load(args.dataset, &dir, Split::Train)?;
        let test = data::load(args.dataset, &dir, Split::Test)?;
        if announce {
            if train.generated {
                observers.warn(format!(
                    "WARNING: {} in {} is a GENERATED stand-in, not the real data set (see {}); accuracies are not comparable to the course's",
                    args.dataset.name(),
                    dir.display(),
                    data::GENERATED_MARKER
                ))?;
            }
            observers.info(format!(
                "{}: {} on {} ({} train / {} test images from {}{}), batch {}, LibTorch {}",
                self.preset.name,
                self.arch().name(),
                args.dataset.name(),
                train.len(),
                test.len(),
                dir.display(),
                self.resize().map_or(String::new(), |side| format!(", resized to {side}×{side}")),
                self.batch_size(),
                crate::torch_version()
            ))?;
        }
        Ok(ImageData { train, test })
    }

    fn model_name(&self) -> String {
        self.arch().name().into()
    }

    fn dataset_name(&self) -> String {
        self.args.dataset.name().into()
    }

    fn metric(&self) -> Metric {
        Metric::Accuracy
    }

    fn model(&self, _data: &ImageData, _groups: &Groups, _device: Device, _observers: &mut Observers) -> Result<ImagePlan> {
        // Every rank loads the weights (rank 0's win: they are broadcast at the start), so that a
        // bad file fails everywhere with the same message.
        Ok(ImagePlan { spec: self.model_spec(), weights: self.args.weights.clone(), trainable: self.trainable(), channels_last: self.args.channels_last })
    }

    fn describe(&self, _plan: &ImagePlan, step: &dyn TrainStep<'_>, groups: &Groups, device: Device, observers: &mut Observers) -> Result<()> {
        if !groups.is_root() {
            return Ok(());
        }
        let spec = self.model_spec();
        let trained: i64 = step.named_parameters().iter().map(|(_, t)| t.numel() as i64).sum();
        let frozen: i64 = step.sync().frozen().iter().map(|t| t.numel() as i64).sum();
        let replicas = groups.layout.dp;
        observers.info(format!(
            "[{}] {} with a {}-way head: {} parameters{}{}",
            device::device_name(device),
            self.arch().name(),
            spec.num_classes,
            report::group_thousands(trained + frozen),
            if frozen > 0 { format!(", {} of them trained", report::group_thousands(trained)) } else { String::new() },
            if replicas > 1 { format!(", {replicas} replicas × batch {}", self.batch_size()) } else { String::new() }
        ))
    }

    fn memory_estimate(&self, world: usize, cuda: bool, observers: &mut Observers) -> Result<Vec<RankEstimate>> {
        let layout = self.layout(world)?;
        let spec = self.model_spec();
        let recipe = experiment::RunRecipe::resolve(self.preset, &self.args.recipe, layout.dp, 1, 1);
        let (params, largest, per_image) = crate::memory::estimate::probe_image_activations(&spec, self.args.run.precision)?;
        observers.info(format!(
            "{} with a {}-way head on {}×{}×{} images: {} parameters; batch {} per replica, {}; activations measured on the CPU: {:.2} MiB per image",
            self.arch().name(),
            spec.num_classes,
            spec.in_channels,
            spec.image_size,
            spec.image_size,
            report::group_thousands(params as i64),
            recipe.batch_size,
            layout.describe(),
            per_image / crate::memory::MIB
        ))?;
        let [channels, size, _] = self.args.dataset.image_shape();
        // Bytes of one image in a batch: the data set's floats, and the resized ones.
        let resized = self.resize().map_or(0, |side| side * side) as usize;
        let image_bytes = 4 * channels * (size * size + resized);
        // The loader's batches: on the CPU every worker's prefetched ones and the one training;
        // on a GPU (the rest wait in host memory) the one training and the next one copied.
        let loader = LoaderConfig::train(recipe.batch_size, 0, Device::Cpu);
        let batches_held = if cuda { 2 } else { self.workers(Device::Cpu) * (loader.prefetch + 1) + 1 };
        let job = crate::memory::estimate::ImageJob {
            params,
            largest_parameter: largest,
            bytes_per_image: per_image,
            batch: recipe.batch_size,
            dp: layout.dp,
            zero: self.args.parallel.zero_stage(),
            optimizer_k: crate::memory::optimizer_bytes_per_parameter(recipe.optimizer, recipe.momentum),
            bucket_bytes: self.args.parallel.bucket_mb * crate::memory::MIB,
            input_batch_bytes: (recipe.batch_size * (image_bytes + 8)) as f64,
            batches_held,
        };
        Ok(vec![job.estimate()])
    }

    fn model_identity(&self, _plan: &ImagePlan) -> serde_json::Value {
        serde_json::to_value(self.model_spec()).expect("a model spec serialises")
    }

    fn flops_per_example(&self, _plan: &ImagePlan) -> f64 {
        flops::training_flops_per_image(&self.model_spec())
    }

    fn sources(&self, data: &ImageData, device: Device, shard: (usize, usize)) -> Result<Sources> {
        let args = self.args;
        let batch = self.batch_size();
        let train = Loader::new(
            data.train.clone(),
            LoaderConfig {
                augment: args.augment,
                workers: self.workers(device),
                shard,
                resident: args.data_on_device,
                resize: self.resize(),
                ..LoaderConfig::train(batch, args.run.seed, device)
            },
        );
        let eval = Loader::new(
            data.test.clone(),
            LoaderConfig { workers: self.workers(device), shard, resident: args.data_on_device, resize: self.resize(), ..LoaderConfig::eval(batch, device) },
        );
        // The course evaluates on the test set every epoch: the last evaluation is the test.
        Ok(Sources { train: Box::new(train), eval: Box::new(eval), test: None, examples_per_epoch: data.train.len() })
    }

    fn data_generated(&self, data: &ImageData) -> bool {
        data.train.generated
    }

    fn report(&self, _data: &ImageData, _plan: &ImagePlan, _fit: &FitReport, test: &EvalSums, _device: Device) -> (Vec<String>, serde_json::Value) {
        // Lightning's table after trainer.test, to hold against the course's printout.
        let table = crate::course_format::lightning_test_table(&[("test_acc", test.accuracy()), ("test_loss", test.mean_loss())]);
        let memory_format = if self.args.channels_last { "channels-last" } else { "nchw" };
        let trained_blocks = match self.trainable() {
            Trainable::All => serde_json::Value::Null,
            Trainable::Last(n) => n.into(),
        };
        let image_size = self.model_spec().image_size;
        (vec![table], serde_json::json!({ "memory_format": memory_format, "trained_blocks": trained_blocks, "image_size": image_size }))
    }
}
