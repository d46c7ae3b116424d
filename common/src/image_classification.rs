//! The image-classification exercises (exercise1, exercise2, exercise3 ddp): their flags,
//! CIFAR-10 or MNIST (at `--image-size`) or image files (an image folder or tar shards, with
//! torchvision's ImageNet transforms), the CNN, ResNet34, ResNet50 or VGG19, and what their
//! results add. Everything around the training loop is [`crate::experiment`]'s.
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use anyhow::Result;
use serde::Serialize;
use tch::Device;

use crate::comm::layout::{Groups, Layout};
use crate::data::image_files::{ImageFileLoader, ImageFiles};
use crate::data::image_folder::{self, ImageFolder};
use crate::data::transforms::Transform;
use crate::data::{self, DatasetChoice, ImageDataset, Loader, LoaderConfig, Split};
use crate::device;
use crate::error::usage;
use crate::experiment::{self, Experiment, Sources};
use crate::flags::{ParallelArgs, RecipeArgs, RunArgs};
use crate::flops;
use crate::memory::estimate::RankEstimate;
use crate::models::{self, Arch, Blocks, ModelSpec, Trainable};
use crate::parallelize::ImagePlan;
use crate::presets::Preset;
use crate::report::{self, RunRecord};
use crate::train::{BatchSource, EvalSums, FitReport, Metric, Observers, TrainStep};

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
    #[arg(help_heading = "Model")]
    pub model: Option<Arch>,
    /// Data set: CIFAR-10 or MNIST (their binary files, read into memory), or image files
    /// decoded batch by batch: `imagefolder` (DIR/train/<class>/*.jpg and DIR/val/<class>/*,
    /// torchvision's ImageFolder layout) or `shards` (tar shards from `prepare_data pack`).
    #[arg(long, value_enum, default_value = "cifar10")]
    #[arg(help_heading = "Data")]
    pub dataset: DatasetChoice,
    /// How image files become the model's input: `imagenet` (training: RandomResizedCrop and a
    /// random horizontal flip; evaluation: Resize(N / 0.875) and CenterCrop(N); N is
    /// --image-size, 224 by default) or `resize` (the JSC course's Resize((N, N)) for both, N
    /// 256 by default) [default: resize where the recipe resizes (--recipe course with
    /// resnet50 or resnet50v2), else imagenet].
    #[arg(long, value_enum)]
    #[arg(help_heading = "Data")]
    pub transform: Option<TransformChoice>,
    /// Shards: samples held in the shuffle buffer that mixes the shards' streams (WebDataset's
    /// `shuffle(N)`); 0 reads them in their order [default: 1000].
    #[arg(long, value_name = "N")]
    #[arg(help_heading = "Data")]
    pub shuffle_buffer: Option<usize>,
    /// Initial weights: `imagenet` (torchvision's published ImageNet weights of resnet34,
    /// resnet50 or vgg19, fetched once into torchvision's cache and checked against their hash;
    /// `prepare_data weights MODEL` fetches them ahead), or a file in torchvision's names
    /// (.safetensors, .pth/.pt as torch.save wrote a state_dict, or .ot). A head for another
    /// number of classes is left out and starts freshly initialised.
    #[arg(long, value_name = "imagenet|FILE", value_parser = parse_weights, value_hint = clap::ValueHint::FilePath)]
    #[arg(help_heading = "Model")]
    pub weights: Option<WeightsArg>,
    /// Size of the classification head [default: the data set's classes for cnn and for
    /// --freeze/--train-last, 1000 for resnet34/resnet50/vgg19 otherwise, as in the course].
    #[arg(long)]
    #[arg(help_heading = "Model")]
    pub num_classes: Option<i64>,
    /// Feature extraction: `backbone` freezes everything but the head (the classifier's last
    /// layer), which alone trains on top of the --weights; frozen batch norms keep their
    /// running statistics.
    #[arg(long, value_enum, conflicts_with = "train_last")]
    #[arg(help_heading = "Model")]
    pub freeze: Option<FreezeChoice>,
    /// Fine-tuning: only the last N blocks train, the ones before them frozen (ResNet34 and
    /// ResNet50: 18 blocks, the stem, 16 residual blocks and fc, so 4 is layer4 and fc;
    /// ResNet50V2: 18 likewise, predictions its head; VGG19: 19, its 16 convolutions and 3
    /// classifier layers).
    #[arg(long, value_name = "N")]
    #[arg(help_heading = "Model")]
    pub train_last: Option<usize>,
    /// Random crop (padding 4) and horizontal flip on the training images.
    #[arg(long)]
    #[arg(help_heading = "Data")]
    pub augment: bool,
    /// Train and evaluate on the images resized to N×N (bilinear, antialiased, as torchvision's
    /// `Resize((N, N))`; on the training device, after augmentation), e.g. 128 for CIFAR-10
    /// at ResNet50's scale [default: the recipe's where it resizes (--recipe course: 256 for
    /// resnet50, 128 for resnet50v2), else the data set's size, 32 for CIFAR-10, 28 for MNIST].
    #[arg(long, value_name = "N")]
    #[arg(help_heading = "Data")]
    pub image_size: Option<i64>,
    /// How CIFAR-10's and MNIST's bytes become inputs: standardized (each channel by the
    /// training set's mean and deviation) or to-tensor (bytes / 255, as `transforms.ToTensor()`
    /// alone: the LRZ course's scripts) [default: the recipe's: standardized; --recipe course:
    /// to-tensor for exercise1, exercise2 and exercise3 ddp]. Image files and shards are
    /// standardized by ImageNet's statistics.
    #[arg(long, value_enum)]
    #[arg(help_heading = "Data")]
    pub inputs: Option<crate::data::InputScaling>,
    /// Background threads preparing batches [default: for image files, decoding, every core
    /// this process may use for a GPU (SLURM_CPUS_PER_TASK under Slurm) and 1 for the CPU; for
    /// data in memory, 2 for a GPU and 0 for the CPU, whose cores LibTorch's threads already use:
    /// measured on 2 cores, loader threads beside them made ResNet34 8% slower].
    #[arg(long)]
    #[arg(help_heading = "Data")]
    pub workers: Option<usize>,
    /// Batches each loader thread prepares ahead of the training [default: 4].
    #[arg(long, value_name = "N")]
    #[arg(help_heading = "Data")]
    pub prefetch: Option<usize>,
    /// Keep the whole data set on the training device and crop, flip and normalise batches
    /// there (no loader threads, no copies per step); the same batches as without.
    #[arg(long)]
    #[arg(help_heading = "Precision and speed")]
    pub data_on_device: bool,
    /// Weights and inputs in the channels-last memory format (NHWC in memory), as
    /// `model.to(memory_format=torch.channels_last)`: cuDNN's tensor-core convolutions on a GPU
    /// read it directly. The same model and results (to float rounding).
    #[arg(long)]
    #[arg(help_heading = "Precision and speed")]
    pub channels_last: bool,
}

/// The largest `--image-size`: over four times ImageNet's usual 224, where a batch of a few
/// images already fills a GPU's memory with ResNet50's activations; beyond it is a typo.
const MAX_IMAGE_SIZE: i64 = 1024;

/// What `--transform` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TransformChoice {
    /// torchvision's ImageNet recipe.
    Imagenet,
    /// JSC's `Resize((N, N))`.
    Resize,
}

/// What `--freeze` freezes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FreezeChoice {
    /// Every block but the head.
    Backbone,
}

/// An image exercise: its preset (for the model `--model` picks) and flags.
pub struct ImageExperiment<'a> {
    pub preset: Preset<Arch>,
    pub args: &'a ImageArgs,
    /// The image files' classes, counted once when the head's size depends on them.
    file_classes: OnceLock<usize>,
}

/// Runs the image exercise `preset` with `args` (see [`experiment::run`]).
pub fn run(preset: &Preset<Arch>, args: &ImageArgs, listeners: &mut Observers) -> Result<Vec<RunRecord>> {
    experiment::run(&ImageExperiment::new(preset, args), listeners)
}

impl<'a> ImageExperiment<'a> {
    pub fn new(preset: &Preset<Arch>, args: &'a ImageArgs) -> Self {
        let arch = args.model.unwrap_or(preset.model);
        ImageExperiment { preset: preset.with_image_model(arch), args, file_classes: OnceLock::new() }
    }

    pub fn arch(&self) -> Arch {
        self.preset.model
    }

    /// The side images are trained at when not their own: `--image-size`, else the recipe's
    /// (the course's `Resize((N, N))`).
    /// How the data set's bytes become inputs: `--inputs`, else the recipe's.
    fn inputs(&self) -> crate::data::InputScaling {
        self.args.inputs.unwrap_or(self.preset.recipe_for(&self.args.recipe).inputs)
    }

    fn image_size(&self) -> Option<i64> {
        self.args.image_size.or(self.preset.recipe_for(&self.args.recipe).image_size)
    }

    /// Which blocks train: `--freeze backbone` is the head alone, `--train-last N` the last N.
    pub fn trainable(&self) -> Trainable {
        match (self.args.freeze, self.args.train_last) {
            (Some(FreezeChoice::Backbone), _) => Trainable::Last(1),
            (None, Some(n)) => Trainable::Last(n),
            (None, None) => Trainable::All,
        }
    }

    /// The model, its input and its head. The head's size may depend on the classes of image
    /// files, which are then listed (once): an error if they cannot be.
    pub fn model_spec(&self) -> Result<ModelSpec> {
        // The course keeps ImageNet's 1000-way head; transfer learning puts a head for the
        // data set's classes on the pretrained backbone.
        let num_classes = match (self.args.num_classes, self.arch(), self.trainable()) {
            (Some(n), _, _) => n,
            (None, Arch::Resnet34 | Arch::Resnet50 | Arch::Vgg19, Trainable::All) => 1000,
            (None, _, _) => self.data_classes()? as i64,
        };
        let (channels, size) = self.input_shape();
        Ok(ModelSpec { arch: self.arch(), in_channels: channels as i64, image_size: self.image_size().unwrap_or(size), num_classes })
    }

    /// [`Self::model_spec`] once [`Experiment::check`] has made it (and listed what it needs).
    fn spec(&self) -> ModelSpec {
        self.model_spec().expect("the model spec is made in Experiment::check before anything else")
    }

    /// Channels of the images, and their side unless --image-size says otherwise.
    fn input_shape(&self) -> (usize, i64) {
        match (self.args.dataset.in_memory(), self.args.transform) {
            (Some(kind), _) => {
                let [channels, size, _] = kind.image_shape();
                (channels, size as i64)
            }
            (None, Some(TransformChoice::Resize)) => (3, 256),
            (None, _) => (3, 224),
        }
    }

    /// The classes of the data set (binary sets: 10; image files: their class folders, or the
    /// shards' index).
    fn data_classes(&self) -> Result<usize> {
        if let Some(kind) = self.args.dataset.in_memory() {
            return Ok(kind.num_classes());
        }
        if let Some(&n) = self.file_classes.get() {
            return Ok(n);
        }
        let dir = self.data_dir();
        let n = match self.args.dataset {
            DatasetChoice::Shards => crate::data::shards::ShardSet::open(&dir, Split::Train)?.classes().len(),
            _ => image_folder::find_classes(&image_folder::split_root(&dir, Split::Train)?)?.len(),
        };
        Ok(*self.file_classes.get_or_init(|| n))
    }

    fn data_dir(&self) -> PathBuf {
        self.args.run.data_dir_or(self.args.dataset.name())
    }

    /// The side the loaders resize the images to: `--image-size`, where it differs from the
    /// data set's (image files are cropped and resized to it by their transform instead).
    fn resize(&self) -> Option<i64> {
        let kind = self.args.dataset.in_memory()?;
        let [_, size, _] = kind.image_shape();
        self.image_size().filter(|&side| side != size as i64)
    }

    /// What the image files' loaders do to every image, for training or evaluation: `--transform`,
    /// else the recipe's resizing where it has one, else torchvision's ImageNet transforms.
    fn transform(&self, train: bool) -> Transform {
        let side = self.spec().image_size as u32;
        let recipe_resizes = self.preset.recipe_for(&self.args.recipe).image_size.is_some();
        match self.args.transform.unwrap_or(if recipe_resizes { TransformChoice::Resize } else { TransformChoice::Imagenet }) {
            TransformChoice::Imagenet => Transform::imagenet(side, train),
            TransformChoice::Resize => Transform::Resize { size: side },
        }
    }

    /// Images per batch on each data-parallel replica.
    fn batch_size(&self) -> usize {
        experiment::RunRecipe::batch_size(&self.preset, &self.args.recipe)
    }

    /// Loader threads for training on `device`: `--workers`, else for data in memory 2 for a
    /// GPU and none for the CPU (where they would take cores from LibTorch's own threads, all
    /// busy with the training); for image files, whose decoding is the work, every usable core
    /// for a GPU and one for the CPU (decoding the next batch while this one trains).
    /// More than the usable cores decode no faster and each holds a decoder's memory: `--workers`
    /// is capped there, as `--threads` is ([`ImageExperiment::workers_warning`] says so).
    fn workers(&self, device: Device) -> usize {
        let files = self.args.dataset.in_memory().is_none();
        let cores = device::usable_cores();
        self.args
            .workers
            .unwrap_or(match (files, device.is_cuda()) {
                (false, true) => 2,
                (false, false) => 0,
                (true, true) => cores,
                (true, false) => 1,
            })
            .min(cores)
    }

    /// The warning for a `--workers` above the usable cores.
    fn workers_warning(&self) -> Option<String> {
        let cores = device::usable_cores();
        self.args.workers.filter(|&n| n > cores).map(|n| format!("warning: --workers {n} is more than the {cores} cores this process may use: using {cores}"))
    }
}

/// The train and test splits: in memory, or image files.
pub enum ImageData {
    Memory { train: ImageDataset, test: ImageDataset },
    Files { train: ImageFiles, test: ImageFiles, generated: bool },
}

impl ImageData {
    fn train_len(&self) -> usize {
        match self {
            ImageData::Memory { train, .. } => train.len(),
            ImageData::Files { train, .. } => train.len(),
        }
    }

    fn test_len(&self) -> usize {
        match self {
            ImageData::Memory { test, .. } => test.len(),
            ImageData::Files { test, .. } => test.len(),
        }
    }

    fn generated(&self) -> bool {
        match self {
            ImageData::Memory { train, .. } => train.generated,
            ImageData::Files { generated, .. } => *generated,
        }
    }
}

impl Experiment for ImageExperiment<'_> {
    type Data = ImageData;
    type Model = ImagePlan;
    type ModelPreset = Arch;

    fn preset(&self) -> &Preset<Arch> {
        &self.preset
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

    fn flags_json(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::to_value(self.args)
    }

    fn check(&self) -> Result<()> {
        let (args, dataset) = (self.args, self.args.dataset);
        match dataset.in_memory() {
            Some(_) => {
                if args.transform.is_some() || args.shuffle_buffer.is_some() {
                    return usage(format!(
                        "--transform and --shuffle-buffer apply to image files (--dataset imagefolder or shards), not to {}",
                        dataset.name()
                    ));
                }
            }
            None => {
                if args.inputs.is_some() {
                    return usage(format!("--inputs applies to CIFAR-10 and MNIST; {} is standardized by ImageNet's statistics", dataset.name()));
                }
                if args.augment {
                    return usage("--augment is CIFAR's padded random crop; image files have --transform imagenet (random resized crops and flips) instead");
                }
                if args.data_on_device {
                    return usage(format!("--data-on-device keeps a binary data set on the device; {} is decoded from files batch by batch", dataset.name()));
                }
                if args.shuffle_buffer.is_some() && dataset != DatasetChoice::Shards {
                    return usage("--shuffle-buffer mixes the samples streamed from tar shards: it needs --dataset shards");
                }
            }
        }
        let classes = match (args.num_classes, dataset.in_memory()) {
            (Some(_), None) => Some(self.data_classes()?),
            (Some(_), Some(kind)) => Some(kind.num_classes()),
            (None, _) => None,
        };
        if let (Some(n), Some(classes)) = (args.num_classes, classes) {
            if n < classes as i64 {
                return usage(format!("--num-classes must be at least {classes} for {} (its classes)", dataset.name()));
            }
        }
        self.model_spec()?;
        if let Some(side) = self.args.image_size {
            let (arch, least) = (self.arch(), self.arch().min_image_size());
            if side < least {
                return usage(format!("--image-size {side}: {} needs images of at least {least}×{least}", arch.name()));
            }
            if side > MAX_IMAGE_SIZE {
                return usage(format!("--image-size {side}: at most {MAX_IMAGE_SIZE}"));
            }
        }
        if self.args.weights == Some(WeightsArg::Imagenet) && models::pretrained::published_file(self.arch()).is_none() {
            return usage(format!(
                "--weights imagenet: torchvision publishes no ImageNet weights for {} (only resnet34, resnet50 and vgg19)",
                self.arch().name()
            ));
        }
        let trainable = self.trainable();
        if trainable != Trainable::All {
            if self.args.weights.is_none() && !self.args.run.resume {
                let flag = if self.args.freeze.is_some() { "--freeze backbone" } else { "--train-last" };
                return usage(format!(
                    "{flag} keeps pretrained blocks as they are: give them with --weights imagenet or --weights FILE (or continue a run with --resume)"
                ));
            }
            if let Err(err) = trainable.check(&Blocks::of(&self.spec()), self.arch().name()) {
                return usage(err.to_string());
            }
        }
        Ok(())
    }

    fn load(&self, observers: &mut Observers, announce: bool) -> Result<ImageData> {
        let args = self.args;
        let dir = self.data_dir();
        let data = match args.dataset.in_memory() {
            Some(kind) => ImageData::Memory { train: data::load(kind, &dir, Split::Train)?, test: data::load(kind, &dir, Split::Test)? },
            None => self.load_files(&dir)?,
        };
        if announce {
            if let Some(warning) = self.workers_warning() {
                observers.warn(warning)?;
            }
            if data.generated() {
                observers.warn(format!(
                    "WARNING: {} in {} is a GENERATED stand-in, not the real data set (see {}); accuracies are not comparable to the course's",
                    args.dataset.name(),
                    dir.display(),
                    data::GENERATED_MARKER
                ))?;
            }
            if let ImageData::Files { train, test, .. } = &data {
                for folder in [train, test] {
                    if let Some(note) = match folder {
                        ImageFiles::Folder(folder) => folder.skipped_note(),
                        ImageFiles::Shards(set) => set.unlisted_note(),
                    } {
                        observers.warn(note)?;
                    }
                }
            }
            if let ImageData::Files { train: ImageFiles::Shards(set), .. } = &data {
                if !set.has_index() {
                    observers.warn(format!(
                        "{}: no {}, so the shards' headers were read for their counts, and the classes are numbered, not named",
                        dir.display(),
                        crate::data::shards::INDEX_FILE
                    ))?;
                }
            }
            let how = match &data {
                ImageData::Memory { .. } => self.resize().map_or(String::new(), |side| format!(", resized to {side}×{side}")),
                ImageData::Files { train, .. } => {
                    format!(", {} classes; {}; {}", train.classes().len(), describe_transform(self.transform(true)), describe_transform(self.transform(false)))
                }
            };
            observers.info(format!(
                "{}: {} on {} ({} train / {} test images from {}{how}), batch {}, LibTorch {}",
                self.preset.name,
                self.arch().name(),
                args.dataset.name(),
                data.train_len(),
                data.test_len(),
                dir.display(),
                self.batch_size(),
                crate::torch_version()
            ))?;
        }
        Ok(data)
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

    fn model(&self, _data: &ImageData, groups: &Groups, _device: Device, _observers: &mut Observers) -> Result<ImagePlan> {
        // Every rank loads the weights (rank 0's win: they are broadcast at the start), so that a
        // bad file fails everywhere with the same message.
        let weights = match &self.args.weights {
            None => None,
            Some(WeightsArg::File(path)) => Some(path.clone()),
            // One rank alone may fetch them; several would each download the same file.
            Some(WeightsArg::Imagenet) => Some(models::pretrained::imagenet_weights(self.arch(), groups.world.world_size() == 1)?),
        };
        Ok(ImagePlan { spec: self.model_spec()?, weights, trainable: self.trainable(), channels_last: self.args.channels_last })
    }

    fn describe(&self, _plan: &ImagePlan, step: &dyn TrainStep<'_>, groups: &Groups, device: Device, observers: &mut Observers) -> Result<()> {
        if !groups.is_root() {
            return Ok(());
        }
        let spec = self.spec();
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

    fn memory_estimate(&self, layout: Layout, cuda: bool, observers: &mut Observers) -> Result<Vec<RankEstimate>> {
        let spec = self.model_spec()?;
        let recipe = experiment::RunRecipe::resolve(&self.preset, &self.args.recipe, layout.dp, 1, 1);
        let probe = crate::memory::estimate::probe_image_activations(&spec, self.trainable(), self.args.run.precision)?;
        observers.info(format!(
            "{} with a {}-way head on {}×{}×{} images: {} parameters{}; batch {} per replica, {}; activations measured on the CPU: {:.2} MiB per image",
            self.arch().name(),
            spec.num_classes,
            spec.in_channels,
            spec.image_size,
            spec.image_size,
            report::group_thousands((probe.trained + probe.frozen) as i64),
            if probe.frozen > 0.0 {
                format!(" ({} of them frozen: no gradients, no optimizer state)", report::group_thousands(probe.frozen as i64))
            } else {
                String::new()
            },
            recipe.batch_size,
            layout.describe(),
            probe.bytes_per_image / crate::memory::MIB
        ))?;
        let (channels, size) = self.input_shape();
        let size = self.image_size().filter(|_| self.args.dataset.in_memory().is_none()).unwrap_or(size) as usize;
        // Bytes of one image in a batch: the data set's floats, and the resized ones.
        let resized = self.resize().map_or(0, |side| side * side) as usize;
        let image_bytes = 4 * channels * (size * size + resized);
        // The loader's batches: on the CPU every worker's prefetched ones and the one training;
        // on a GPU (the rest wait in host memory) the one training and the next one copied.
        let loader = LoaderConfig::train(recipe.batch_size, 0, Device::Cpu);
        let batches_held = if cuda { 2 } else { self.workers(Device::Cpu) * (loader.prefetch + 1) + 1 };
        let job = crate::memory::estimate::ImageJob {
            params: probe.trained,
            frozen_params: probe.frozen,
            largest_parameter: probe.largest_parameter,
            bytes_per_image: probe.bytes_per_image,
            batch: recipe.batch_size,
            state_shards: layout.state_shards(),
            sync: self.args.parallel.sync(self.preset.sync, layout),
            optimizer_k: crate::memory::optimizer_bytes_per_parameter(recipe.optimizer, recipe.momentum),
            bucket_bytes: self.args.parallel.bucket_mb * crate::memory::MIB,
            input_batch_bytes: (recipe.batch_size * (image_bytes + 8)) as f64,
            batches_held,
        };
        Ok(vec![job.estimate()])
    }

    fn model_identity(&self, _plan: &ImagePlan) -> serde_json::Value {
        serde_json::to_value(self.spec()).expect("a model spec serialises")
    }

    fn flops_per_example(&self, _plan: &ImagePlan) -> f64 {
        flops::training_flops_per_image(&self.spec(), self.trainable())
    }

    fn sources(&self, data: &ImageData, device: Device, shard: (usize, usize)) -> Result<Sources> {
        let args = self.args;
        let batch = self.batch_size();
        let workers = self.workers(device);
        let prefetch = args.prefetch.unwrap_or(LoaderConfig::train(batch, 0, device).prefetch);
        let train = LoaderConfig { workers, prefetch, shard, ..LoaderConfig::train(batch, args.run.seed, device) };
        let eval = LoaderConfig { workers, prefetch, shard, ..LoaderConfig::eval(batch, device) };
        let (train, eval): (Box<dyn BatchSource>, Box<dyn BatchSource>) = match data {
            ImageData::Memory { train: train_set, test } => {
                let (resident, resize, scaling) = (args.data_on_device, self.resize(), self.inputs());
                (
                    Box::new(Loader::new(train_set.clone(), LoaderConfig { augment: args.augment, resident, resize, scaling, ..train })),
                    Box::new(Loader::new(test.clone(), LoaderConfig { resident, resize, scaling, ..eval })),
                )
            }
            ImageData::Files { train: train_files, test, .. } => {
                let shuffle_buffer = args.shuffle_buffer.unwrap_or(DEFAULT_SHUFFLE_BUFFER);
                let train = ImageFileLoader::new(train_files.clone(), self.transform(true), train).with_shuffle_buffer(shuffle_buffer);
                if let (ImageFiles::Shards(set), 0) = (train_files, train.samples_per_epoch()) {
                    return usage(format!(
                        "{} holds {} training shards for {} replicas: every replica streams shards of its own; pack with a smaller --shard-size",
                        set.dir().display(),
                        set.shards().len(),
                        shard.1
                    ));
                }
                (Box::new(train), Box::new(ImageFileLoader::new(test.clone(), self.transform(false), eval)))
            }
        };
        // The course evaluates on the test set every epoch: the last evaluation is the test.
        Ok(Sources { train, eval, test: None, examples_per_epoch: data.train_len() })
    }

    fn data_generated(&self, data: &ImageData) -> bool {
        data.generated()
    }

    fn report(&self, _data: &ImageData, _plan: &ImagePlan, fit: &FitReport, test: &EvalSums, device: Device) -> (Vec<String>, serde_json::Value) {
        // The course script's time line and Lightning's table after trainer.test, to hold
        // against the slide's printout: exercise1.py (the CNN) logs `test_acc_epoch` and
        // `test_loss_epoch` and names no model; exercise1_CNN.py (ResNet34, VGG19) logs
        // `Test Acc` and `Test loss` and names it (`resnet`, `vgg19`). trainer.fit's time
        // holds the epochs' validation too.
        let (model, names) = match self.arch() {
            Arch::Cnn => (None, ["test_acc_epoch", "test_loss_epoch"]),
            Arch::Resnet34 => (Some("resnet"), ["Test Acc", "Test loss"]),
            arch => (Some(arch.name()), ["Test Acc", "Test loss"]),
        };
        let fit_s: f64 = fit.history.iter().map(|e| e.train_time_s + e.eval_seconds()).sum();
        let time = crate::course_format::time_for_training(model, if device.is_cuda() { "gpu" } else { "cpu" }, fit_s);
        let table = crate::course_format::lightning_test_table(&[(names[0], test.accuracy()), (names[1], test.mean_loss())]);
        let memory_format = if self.args.channels_last { "channels-last" } else { "nchw" };
        let trained_blocks = match self.trainable() {
            Trainable::All => serde_json::Value::Null,
            Trainable::Last(n) => n.into(),
        };
        let image_size = self.spec().image_size;
        let inputs = match self.args.dataset.in_memory() {
            Some(_) => serde_json::to_value(self.inputs()).expect("a scaling serialises"),
            None => "standardized-imagenet".into(),
        };
        let start = match &self.args.weights {
            None => "scratch",
            Some(WeightsArg::Imagenet) => "imagenet",
            Some(WeightsArg::File(_)) => "file",
        };
        let mut lines = vec![time, table];
        // exercise1_CNN.py starts ResNet34 and VGG19 from `weights='IMAGENET1K_V1'`: a run from
        // scratch is not the slide's experiment, whatever its figures.
        if matches!(self.arch(), Arch::Resnet34 | Arch::Vgg19) && self.args.weights.is_none() {
            lines.push(format!(
                "note: the course's {} rows start from ImageNet-pretrained weights (IMAGENET1K_V1); this run trained from scratch (--weights imagenet starts where the course does)",
                self.arch().name()
            ));
        }
        let extra = serde_json::json!({ "memory_format": memory_format, "trained_blocks": trained_blocks, "image_size": image_size, "inputs": inputs, "weights": start });
        (lines, extra)
    }
}

/// Samples WebDataset-style shuffle buffers hold unless `--shuffle-buffer` says otherwise (the
/// size of its examples): a few hundred MB of JPEG bytes per rank at ImageNet's sizes.
const DEFAULT_SHUFFLE_BUFFER: usize = 1000;

impl ImageExperiment<'_> {
    /// The image files of both splits: a folder listed as torchvision lists it, or a shard set.
    fn load_files(&self, dir: &std::path::Path) -> Result<ImageData> {
        let generated = dir.join(data::GENERATED_MARKER).exists();
        let (train, test) = match self.args.dataset {
            DatasetChoice::Shards => {
                let train = crate::data::shards::ShardSet::open(dir, Split::Train)?;
                let test = crate::data::shards::ShardSet::open(dir, Split::Test)?;
                (ImageFiles::Shards(Arc::new(train)), ImageFiles::Shards(Arc::new(test)))
            }
            _ => {
                let train = ImageFolder::scan_split(dir, Split::Train, None)?;
                let test = ImageFolder::scan_split(dir, Split::Test, Some(&train.classes))?;
                (ImageFiles::Folder(Arc::new(train)), ImageFiles::Folder(Arc::new(test)))
            }
        };
        let classes = train.classes().len();
        if let Some(head) = self.args.num_classes.filter(|&n| n < classes as i64) {
            return usage(format!("--num-classes {head}: {} has {classes} classes", dir.display()));
        }
        Ok(ImageData::Files { train, test, generated })
    }
}

/// A transform as torchvision would write it.
fn describe_transform(transform: Transform) -> String {
    match transform {
        Transform::RandomResizedCrop { size } => format!("training RandomResizedCrop({size}) + flip"),
        Transform::ResizeCenterCrop { resize, size } => format!("evaluation Resize({resize}) + CenterCrop({size})"),
        Transform::Resize { size } => format!("Resize(({size}, {size}))"),
    }
}

/// `--weights`: torchvision's ImageNet weights for the model, or a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightsArg {
    Imagenet,
    File(PathBuf),
}

/// As it was given: `imagenet` or the file's path.
impl Serialize for WeightsArg {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            WeightsArg::Imagenet => serializer.serialize_str("imagenet"),
            WeightsArg::File(path) => path.serialize(serializer),
        }
    }
}

fn parse_weights(value: &str) -> std::result::Result<WeightsArg, String> {
    match value {
        "" => Err("give `imagenet` or a weights file".into()),
        "imagenet" => Ok(WeightsArg::Imagenet),
        file => Ok(WeightsArg::File(PathBuf::from(file))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::parse;
    use crate::presets::{EXERCISE1, EXERCISE2};

    fn experiment_spec(preset: &Preset<Arch>, flags: &str) -> (ModelSpec, Option<Transform>) {
        let args: ImageArgs = parse("exercise", flags).unwrap();
        let exp = ImageExperiment::new(preset, &args);
        let spec = exp.model_spec().unwrap();
        let transform = exp.args.dataset.in_memory().is_none().then(|| exp.transform(false));
        (spec, transform)
    }

    /// The LRZ course's CIFAR-10 scripts feed `transforms.ToTensor()` alone: `--recipe course`
    /// does for exercise1, exercise2 and exercise3 ddp; the default recipe standardizes; the
    /// flag wins.
    #[test]
    fn the_lrz_course_recipe_feeds_pixels_as_to_tensor_leaves_them() {
        use crate::data::InputScaling::{Standardized, ToTensor};
        use crate::presets::EXERCISE3_DDP;
        let inputs = |preset: &Preset<Arch>, flags: &str| ImageExperiment::new(preset, &parse("exercise", flags).unwrap()).inputs();
        for preset in [&EXERCISE1, &EXERCISE2, &EXERCISE3_DDP] {
            assert_eq!((inputs(preset, "--recipe course"), inputs(preset, "")), (ToTensor, Standardized), "{}", preset.name);
        }
        assert_eq!(inputs(&EXERCISE1, "--recipe course --inputs standardized"), Standardized);
        assert_eq!(inputs(&EXERCISE1, "--inputs to-tensor"), ToTensor);
        // JSC's and Namal/BSC's recipes keep their own (standardized).
        assert_eq!(inputs(&EXERCISE1, "--model resnet50v2 --recipe course"), Standardized);
    }

    #[test]
    fn the_courses_recipes_resize_the_images_as_the_course_does() {
        // JSC: Resize((256, 256)) of the image files, and of CIFAR-10's images alike.
        let (spec, transform) = experiment_spec(&EXERCISE2, "--model resnet50 --recipe course --dataset imagefolder --num-classes 1000");
        assert_eq!((spec.image_size, transform), (256, Some(Transform::Resize { size: 256 })));
        assert_eq!(experiment_spec(&EXERCISE1, "--model resnet50 --recipe course").0.image_size, 256);
        // Namal/BSC: CIFAR-10 at 128×128, a head for its 10 classes (Keras's classes=10).
        let (spec, _) = experiment_spec(&EXERCISE1, "--model resnet50v2 --recipe course");
        assert_eq!((spec.image_size, spec.num_classes), (128, 10));
        // Flags win; the default recipe keeps the data's size and torchvision's transforms.
        assert_eq!(experiment_spec(&EXERCISE1, "--model resnet50v2 --recipe course --image-size 64").0.image_size, 64);
        assert_eq!(experiment_spec(&EXERCISE1, "--model resnet50").0.image_size, 32);
        let (spec, transform) = experiment_spec(&EXERCISE2, "--model resnet50 --dataset imagefolder --num-classes 1000");
        assert_eq!((spec.image_size, transform), (224, Some(Transform::imagenet(224, false))));
        let (_, transform) = experiment_spec(&EXERCISE2, "--model resnet50 --recipe course --dataset imagefolder --num-classes 1000 --transform imagenet");
        assert_eq!(transform, Some(Transform::imagenet(256, false)), "--transform wins, at the recipe's size");
    }
}
