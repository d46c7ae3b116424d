//! The image-classification experiment behind exercise1 (and the data-parallel exercises):
//! flags, data, model, optimizer, the training loop, and the results, per device.
use crate::data::{self, DatasetKind, Loader, LoaderConfig, Split};
use crate::device::{self, DeviceChoice};
use crate::dist::data_parallel::GradientAverager;
use crate::dist::launch;
use crate::dist::{DataParallel, GradientSync, ProcessGroup};
use crate::flags::DataParallelArgs;
use crate::flags::RunArgs;
use crate::error::usage;
use crate::models::{self, Arch, ModelSpec};
use crate::optim::{Adam, AdamConfig, Optimizer, OptimizerKind, Sgd, SgdConfig};
use crate::flops;
use crate::report::{self, RunInfo, RunRecord};
use crate::Exercise;
use crate::train::{self, CheckpointConfig, FitReport, LrSchedule, Metric, Replicas, SingleReplica, TrainConfig};
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
    /// Keep the whole data set on the training device and crop, flip and normalise batches
    /// there (no loader threads, no copies per step); the same batches as without.
    #[arg(long)]
    pub data_on_device: bool,
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

/// How a run is replicated: one process, or one replica of a data-parallel job.
pub struct Replication<'a> {
    pub replicas: &'a dyn Replicas,
    /// The learning rate the optimizer starts from (scaled by the world size with --scale-lr).
    pub lr: f64,
    pub lr_schedule: LrSchedule,
}

impl Replication<'_> {
    fn single(lr: f64) -> Replication<'static> {
        Replication { replicas: &SingleReplica, lr, lr_schedule: LrSchedule::Constant }
    }
}

/// Runs the exercise on every requested device, writes the results, prints the table.
pub fn run(exercise: Exercise, args: &ImageArgs) -> anyhow::Result<Vec<RunRecord>> {
    args.run.check()?;
    args.check()?;
    device::set_threads(args.run.threads)?;
    // A missing GPU, or a precision a device cannot train in, is reported before any data is read.
    for device in device::devices_for(args.run.device)? {
        args.run.precision.check(device)?;
    }
    let (train_set, test_set) = load_data(exercise, args, true)?;
    report::run_per_device(args.run.device, &args.run.results_dir, |device| {
        let (record, fit) = run_on(exercise, args, device, &train_set, &test_set, &Replication::single(args.lr))?;
        let extra = serde_json::json!({ "history": fit.history, "resumed_epochs": fit.resumed_epochs });
        Ok((record, extra))
    })
}

/// Runs one rank of a data-parallel exercise: the ranks come from the launcher that started
/// this process (mpirun, srun, torchrun-style variables), or `--nproc-per-node N` starts N
/// local ranks through mpirun first.
///
/// `sync` is the exercise's style: Horovod's (exercise2: a distributed optimizer averages the
/// gradients in its step) or DDP's (exercise3: the loop averages them after backward).
pub fn run_data_parallel(
    exercise: Exercise,
    args: &ImageArgs,
    dp: &DataParallelArgs,
    sync: GradientSync,
) -> anyhow::Result<()> {
    args.run.check()?;
    args.check()?;
    dp.check()?;
    if launch::start_ranks_if_asked(dp.nproc_per_node)? {
        return Ok(());
    }
    // Errors on one rank abort every rank (MPI_Abort) instead of leaving the others waiting
    // in a collective.
    ProcessGroup::run(dp.backend, |group| {
        let device = match args.run.device {
            DeviceChoice::Cpu => Device::Cpu,
            DeviceChoice::Cuda if !device::cuda_available() => return usage(device::no_cuda_message()),
            // `both` (the default) means the GPUs where there are some: one job runs on one kind.
            DeviceChoice::Cuda | DeviceChoice::Both => group.device(device::cuda_available()),
        };
        args.run.precision.check(device)?;
        let world = group.world_size();
        let lr = if dp.scale_lr { args.lr * world as f64 } else { args.lr };
        let lr_schedule = match dp.warmup_epochs {
            0 => LrSchedule::Constant,
            epochs => LrSchedule::Warmup { epochs, start: 1.0 / world as f64 },
        };
        let averager = GradientAverager::new((dp.bucket_mb * 1024.0 * 1024.0) as usize, dp.fp16_allreduce);
        averager.check(group, device)?;
        if args.run.threads == 0 && group.local_world_size() > 1 {
            // Ranks sharing a node share its cores (torchrun sets OMP_NUM_THREADS=1 for the same reason).
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            device::set_threads((cores / group.local_world_size()).max(1))?;
        }
        let replicas = DataParallel::new(group, averager, sync);
        let extra = serde_json::json!({
            "backend": group.describe(),
            "gradient_sync": sync,
            "bucket_mb": dp.bucket_mb,
            "fp16_allreduce": dp.fp16_allreduce,
            "scale_lr": dp.scale_lr,
            "warmup_epochs": dp.warmup_epochs,
        });
        let replication = Replication { replicas: &replicas, lr, lr_schedule };
        if let Some(record) = run_replica(exercise, args, device, &replication, extra)? {
            let csv = args.run.results_dir.join(format!("{}.csv", exercise.name));
            if let (Some(eff), true) = (report::scaling_efficiency(&csv, &record), world > 1) {
                println!("scaling efficiency against the last 1-rank run: {:.1}%", 100.0 * eff);
            }
        }
        Ok(())
    })
}

/// One replica of a data-parallel run on `device`: rank 0 prints, writes the results and the
/// checkpoints. Returns rank 0's record (other ranks: None).
pub fn run_replica(
    exercise: Exercise,
    args: &ImageArgs,
    device: Device,
    replication: &Replication,
    extra: serde_json::Value,
) -> anyhow::Result<Option<RunRecord>> {
    args.run.check()?;
    args.check()?;
    device::set_threads(args.run.threads)?;
    let root = replication.replicas.is_root();
    let (train_set, test_set) = load_data(exercise, args, root)?;
    let (record, fit) = run_on(exercise, args, device, &train_set, &test_set, replication)?;
    if !root {
        return Ok(None);
    }
    println!(
        "parameters bit-identical on all {} ranks after training",
        replication.replicas.world_size()
    );
    let csv = args.run.results_dir.join(format!("{}.csv", exercise.name));
    let mut json = serde_json::json!({
        "scaling_efficiency": report::scaling_efficiency(&csv, &record),
        "history": fit.history,
        "resumed_epochs": fit.resumed_epochs,
        "world_size": replication.replicas.world_size(),
        "per_rank_batch": args.batch_size,
        "global_batch": args.batch_size * replication.replicas.world_size(),
        "allreduce_time_s": fit.timings.allreduce_s,
    });
    if let (Some(object), serde_json::Value::Object(extra)) = (json.as_object_mut(), extra) {
        object.extend(extra);
    }
    let path = report::save(&args.run.results_dir, &record, json)?;
    println!("{}", report::time_split(&record));
    println!("wrote {}", path.display());
    println!("{}", report::comparison_table(std::slice::from_ref(&record), None));
    Ok(Some(record))
}

/// The train and test splits, announced (when `announce`) with a warning for generated data.
fn load_data(exercise: Exercise, args: &ImageArgs, announce: bool) -> anyhow::Result<(data::ImageDataset, data::ImageDataset)> {
    let dir = args.run.data_dir_or(args.dataset.name());
    let train_set = data::load(args.dataset, &dir, Split::Train)?;
    let test_set = data::load(args.dataset, &dir, Split::Test)?;
    if !announce {
        return Ok((train_set, test_set));
    }
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
    Ok((train_set, test_set))
}

fn run_on(
    exercise: Exercise,
    args: &ImageArgs,
    device: Device,
    train_set: &data::ImageDataset,
    test_set: &data::ImageDataset,
    replication: &Replication,
) -> anyhow::Result<(RunRecord, FitReport)> {
    let replicas = replication.replicas;
    let root = replicas.is_root();
    let shard = (replicas.rank(), replicas.world_size());
    if device.is_cuda() {
        tch::Cuda::cudnn_set_benchmark(true);
    }
    tch::manual_seed(args.run.seed as i64);
    let vs = nn::VarStore::new(device);
    let spec = args.model_spec();
    let model = models::build(&vs.root(), &spec);
    let params = models::param_count(&vs);
    if root {
        println!(
            "[{}] {} with a {}-way head: {} parameters{}",
            device::device_name(device),
            arch_name(args.model),
            spec.num_classes,
            report::group_thousands(params),
            if shard.1 > 1 { format!(", {} replicas × batch {}", shard.1, args.batch_size) } else { String::new() }
        );
    }
    // Rank 0's weights win anyway (they are broadcast at the start); every rank loads them so
    // that a bad file fails everywhere with the same message.
    if let Some(path) = &args.weights {
        models::load_weights(&vs, path)?;
        if root {
            println!("loaded weights from {}", path.display());
        }
    }
    let named = models::named_parameters(&vs);
    let lr = replication.lr;
    let optimizer: Box<dyn Optimizer> = match args.optimizer {
        OptimizerKind::Adam => Box::new(Adam::new(named, AdamConfig { lr, ..AdamConfig::default() })),
        OptimizerKind::Sgd => Box::new(Sgd::new(named, SgdConfig { lr, momentum: args.momentum, ..SgdConfig::default() })),
    };
    let mut optimizer = replicas.distribute_optimizer(optimizer, vs.trainable_variables());
    let train_loader = Loader::new(
        train_set.clone(),
        LoaderConfig {
            augment: args.augment,
            workers: args.workers,
            shard,
            resident: args.data_on_device,
            ..LoaderConfig::train(args.batch_size, args.run.seed, device)
        },
    );
    let test_loader = Loader::new(
        test_set.clone(),
        LoaderConfig { workers: args.workers, shard, resident: args.data_on_device, ..LoaderConfig::eval(args.batch_size, device) },
    );

    let epochs = args.run.epochs.unwrap_or(exercise.default_epochs);
    let run = format!("{}-{}-{}", exercise.name, arch_name(args.model), device::device_name(device));
    let config = TrainConfig {
        run: run.clone(),
        epochs,
        max_steps: args.run.max_steps,
        seed: args.run.seed,
        lr_schedule: replication.lr_schedule,
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
        precision: args.run.precision,
        profile: args.run.profile.then(|| args.run.results_dir.join(format!("{run}.trace.json"))),
        tensorboard: args.run.tensorboard.as_ref().map(|dir| dir.join(&run)),
    };
    let fit = train::fit(model.as_ref(), &vs, optimizer.as_mut(), &train_loader, &test_loader, &config, replicas)?;
    if shard.1 > 1 {
        train::check_replicas_agree(&vs, replicas)?;
    }
    let info = RunInfo {
        exercise: exercise.name.into(),
        model: arch_name(args.model),
        params,
        device,
        dataset: args.dataset.name().into(),
        data_generated: train_set.generated,
        epochs,
        batch_size: args.batch_size,
        lr,
        optimizer: optimizer.name().into(),
        seed: args.run.seed,
        world_size: replicas.world_size(),
        precision: args.run.precision,
        flops_per_example: flops::training_flops_per_image(&spec),
        peak_tflops: peak_tflops(device, args.run.precision, args.run.peak_tflops, root),
    };
    let record = RunRecord::new(info, &fit, (fit.eval_loss, fit.eval_acc));
    if root {
        println!("{}", report::compute_summary(&record, train_set.len()));
    }
    Ok((record, fit))
}

/// One device's peak TFLOP/s for the MFU (see [`flops::peak_tflops`]), announced once (`say`).
pub(crate) fn peak_tflops(device: Device, precision: crate::precision::Precision, given: Option<f64>, say: bool) -> Option<f64> {
    let (peak, source) = flops::peak_tflops(device, precision, given)?;
    if say {
        println!("[{}] peak {peak:.1} TFLOP/s per device ({source})", device::device_name(device));
    }
    Some(peak)
}

/// The flag spelling of an architecture (`cnn`, `resnet34`, `vgg19`).
fn arch_name(arch: Arch) -> String {
    use clap::ValueEnum;
    arch.to_possible_value().expect("every architecture has a flag name").get_name().to_string()
}
