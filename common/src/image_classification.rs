//! The image-classification experiment behind exercise1 (and the data-parallel exercises):
//! flags, data, model, optimizer, the training loop, and the results, per device.
use crate::data::{self, DatasetKind, Loader, LoaderConfig, Split};
use crate::device;
use crate::flags::RunArgs;
use crate::error::usage;
use crate::models::{self, Arch, ModelSpec};
use crate::optim::{Adam, AdamConfig, Optimizer, OptimizerKind, Sgd, SgdConfig};
use crate::report::{self, RunInfo, RunRecord};
use crate::Exercise;
use crate::train::{self, CheckpointConfig, FitReport, LrSchedule, Metric, TrainConfig};
use serde::Serialize;
use std::path::PathBuf;
use tch::{nn, Device};

/// The flags every image-classification exercise shares (names are a contract).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct ImageArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub run: RunArgs,
    /// Network to train.
    #[arg(long, value_enum, default_value = "cnn")]
    pub model: Arch,
    #[arg(long, value_enum, default_value = "cifar10")]
    pub dataset: DatasetKind,
    /// Images per batch.
    #[arg(long, default_value_t = 100)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, value_enum, default_value = "adam")]
    pub optimizer: OptimizerKind,
    /// Momentum, for --optimizer sgd.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Initial weights in torchvision's names (.safetensors or .ot), e.g. ImageNet-pretrained.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Size of the classification head [default: 10 for cnn, 1000 for resnet34/vgg19 as in the course].
    #[arg(long)]
    pub num_classes: Option<i64>,
    /// Random crop (padding 4) and horizontal flip on the training images.
    #[arg(long)]
    pub augment: bool,
    /// Background threads preparing batches.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
}

impl ImageArgs {
    fn check(&self) -> anyhow::Result<()> {
        if self.batch_size == 0 {
            return usage("--batch-size must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return usage(format!("--lr must be a positive number, got {}", self.lr));
        }
        if self.num_classes.is_some_and(|n| n < self.dataset.num_classes() as i64) {
            return usage(format!("--num-classes must be at least {} for {}", self.dataset.num_classes(), self.dataset.name()));
        }
        Ok(())
    }

    pub fn model_spec(&self) -> ModelSpec {
        let [channels, size, _] = self.dataset.image_shape();
        let default_classes = match self.model {
            Arch::Cnn => self.dataset.num_classes() as i64,
            Arch::Resnet34 | Arch::Vgg19 => 1000,
        };
        ModelSpec {
            arch: self.model,
            in_channels: channels as i64,
            image_size: size as i64,
            num_classes: self.num_classes.unwrap_or(default_classes),
        }
    }
}

/// Runs the exercise on every requested device, writes the results, prints the table.
pub fn run(exercise: Exercise, args: &ImageArgs) -> anyhow::Result<Vec<RunRecord>> {
    args.run.check()?;
    args.check()?;
    device::set_threads(args.run.threads)?;
    device::devices_for(args.run.device)?; // a missing GPU is reported before any data is read
    let dir = args.run.data_dir_or(args.dataset.name());
    let train_set = data::load(args.dataset, &dir, Split::Train)?;
    let test_set = data::load(args.dataset, &dir, Split::Test)?;
    if train_set.generated {
        eprintln!(
            "WARNING: {} in {} is a GENERATED stand-in, not the real data set (see {}); accuracies are not comparable to the course's",
            args.dataset.name(),
            dir.display(),
            data::GENERATED_MARKER
        );
    }
    println!(
        "{}: {} on {} ({} train / {} test images from {}), batch {}, LibTorch {}",
        exercise.name,
        arch_name(args.model),
        args.dataset.name(),
        train_set.len(),
        test_set.len(),
        dir.display(),
        args.batch_size,
        crate::torch_version()
    );

    report::run_per_device(args.run.device, &args.run.results_dir, |device| {
        let (record, fit) = run_on(exercise, args, device, &train_set, &test_set)?;
        let extra = serde_json::json!({ "history": fit.history, "resumed_epochs": fit.resumed_epochs });
        Ok((record, extra))
    })
}

fn run_on(
    exercise: Exercise,
    args: &ImageArgs,
    device: Device,
    train_set: &data::ImageDataset,
    test_set: &data::ImageDataset,
) -> anyhow::Result<(RunRecord, FitReport)> {
    if device.is_cuda() {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    tch::manual_seed(args.run.seed as i64);
    let vs = nn::VarStore::new(device);
    let spec = args.model_spec();
    let model = models::build(&vs.root(), &spec);
    let params = models::param_count(&vs);
    println!(
        "[{}] {} with a {}-way head: {} parameters",
        device::device_name(device),
        arch_name(args.model),
        spec.num_classes,
        report::group_thousands(params)
    );
    if let Some(path) = &args.weights {
        models::load_weights(&vs, path)?;
        println!("loaded weights from {}", path.display());
    }
    let named = models::named_parameters(&vs);
    let mut optimizer: Box<dyn Optimizer> = match args.optimizer {
        OptimizerKind::Adam => Box::new(Adam::new(named, AdamConfig { lr: args.lr, ..AdamConfig::default() })),
        OptimizerKind::Sgd => {
            Box::new(Sgd::new(named, SgdConfig { lr: args.lr, momentum: args.momentum, ..SgdConfig::default() }))
        }
    };
    let train_loader = Loader::new(
        train_set.clone(),
        LoaderConfig { augment: args.augment, workers: args.workers, ..LoaderConfig::train(args.batch_size, args.run.seed, device) },
    );
    let test_loader = Loader::new(test_set.clone(), LoaderConfig { workers: args.workers, ..LoaderConfig::eval(args.batch_size, device) });

    let epochs = args.run.epochs.unwrap_or(exercise.default_epochs);
    let run = format!("{}-{}-{}", exercise.name, arch_name(args.model), device::device_name(device));
    let config = TrainConfig {
        run: run.clone(),
        epochs,
        max_steps: args.run.max_steps,
        seed: args.run.seed,
        lr_schedule: LrSchedule::Constant,
        clip_grad_norm: None,
        checkpoint: args.run.checkpoint_dir.as_ref().map(|dir| CheckpointConfig {
            dir: dir.clone(),
            resume: args.run.resume,
            model: serde_json::to_value(&spec).expect("a model spec serialises"),
            config: serde_json::to_value(args).expect("flags serialise"),
        }),
        progress: !args.run.quiet,
        verbose: true,
        metric: Metric::Accuracy,
    };
    let fit = train::fit(model.as_ref(), &vs, optimizer.as_mut(), &train_loader, &test_loader, &config)?;
    let info = RunInfo {
        exercise: exercise.name.into(),
        model: arch_name(args.model),
        params,
        device,
        dataset: args.dataset.name().into(),
        data_generated: train_set.generated,
        epochs,
        batch_size: args.batch_size,
        lr: args.lr,
        optimizer: optimizer.name().into(),
        seed: args.run.seed,
    };
    let record = RunRecord::new(info, &fit, (fit.eval_loss, fit.eval_acc));
    Ok((record, fit))
}

/// The flag spelling of an architecture (`cnn`, `resnet34`, `vgg19`).
fn arch_name(arch: Arch) -> String {
    use clap::ValueEnum;
    arch.to_possible_value().expect("every architecture has a flag name").get_name().to_string()
}
