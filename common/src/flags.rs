//! The flags every exercise shares, with the same names, defaults and meanings in every binary
//! (scripts, sbatch files and notebooks rely on them). Each experiment flattens [`RunArgs`]
//! into its own flags.
use crate::device::DeviceChoice;
use crate::error::usage;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct RunArgs {
    /// Where to train; `both` runs the CPU, then the GPU, and compares them.
    #[arg(long, value_enum, default_value = "both")]
    #[arg(help_heading = "Training")]
    pub device: DeviceChoice,
    /// Folder with the data set's files [default: data/<data set>].
    #[arg(long)]
    #[arg(help_heading = "Data")]
    pub data_dir: Option<PathBuf>,
    /// Epochs [default: the exercise's, or the course's with --recipe course where its script sets them].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub epochs: Option<usize>,
    /// Stop after this many optimizer steps (smoke runs, benchmarks).
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub max_steps: Option<usize>,
    /// Seeds the initial weights, the data order, augmentation and dropout.
    #[arg(long, default_value_t = 42)]
    #[arg(help_heading = "Training")]
    pub seed: u64,
    /// LibTorch threads for CPU work; 0 = one per core.
    #[arg(long, default_value_t = 0)]
    #[arg(help_heading = "Training")]
    pub threads: usize,
    /// Save a checkpoint here after every epoch.
    #[arg(long)]
    #[arg(help_heading = "Checkpoints")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue from the checkpoint in --checkpoint-dir when there is one.
    #[arg(long, requires = "checkpoint_dir")]
    #[arg(help_heading = "Checkpoints")]
    pub resume: bool,
    /// Besides the latest checkpoint, keep the last K epochs' as <run>-epoch<E>.safetensors
    /// (Lightning's ModelCheckpoint(save_top_k=K)); the oldest is removed.
    #[arg(long, default_value_t = 0, requires = "checkpoint_dir")]
    #[arg(help_heading = "Checkpoints")]
    pub keep_checkpoints: usize,
    /// Also checkpoint every N optimizer steps, in the middle of an epoch too (a resume then
    /// goes on with the next batch, exactly as the run would have).
    #[arg(long, value_name = "N", requires = "checkpoint_dir", value_parser = clap::value_parser!(u64).range(1..))]
    #[arg(help_heading = "Checkpoints")]
    pub checkpoint_every: Option<u64>,
    /// Also checkpoint whenever M minutes have passed since the last checkpoint (a job's time
    /// limit in mind); fractions allowed.
    #[arg(long, value_name = "M", requires = "checkpoint_dir", value_parser = crate::cli::minutes)]
    #[arg(help_heading = "Checkpoints")]
    pub checkpoint_minutes: Option<f64>,
    /// auto: sharded where ZeRO, tensor or pipeline parallelism spread the model state over
    /// ranks (every rank writes its part into <run>.shards/, in parallel), one file
    /// <run>.safetensors otherwise; whole: always one file, gathered to rank 0; sharded: always
    /// the folder. Either format resumes on any layout.
    #[arg(long, value_enum, default_value = "auto")]
    #[arg(help_heading = "Checkpoints")]
    pub checkpoint_format: crate::train::CheckpointFormat,
    /// After a signal stopped the run (Slurm's warning before a time limit or a preemption,
    /// SIGTERM), put the Slurm job back in the queue (`scontrol requeue`), where it resumes from
    /// the checkpoint with the same flags: auto = when the job may be requeued (#SBATCH --requeue).
    #[arg(long, value_enum, default_value = "auto")]
    #[arg(help_heading = "Checkpoints")]
    pub requeue: crate::slurm::Requeue,
    /// Test a trained model without training: the checkpoint of --checkpoint FILE, or of
    /// --checkpoint-dir with --resume, evaluated on the evaluation and test splits
    /// (Lightning's trainer.test(ckpt_path=...)).
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub eval_only: bool,
    /// The checkpoint file --eval-only tests (any run's, of the same model).
    #[arg(long, value_name = "FILE", requires = "eval_only")]
    #[arg(help_heading = "Checkpoints")]
    pub checkpoint: Option<PathBuf>,
    /// Where results (JSON, CSV) are written.
    #[arg(long, default_value = "results")]
    #[arg(help_heading = "Output")]
    pub results_dir: PathBuf,
    /// No progress bar.
    #[arg(long)]
    #[arg(help_heading = "Output")]
    pub quiet: bool,
    /// Every rank prints its loss every N steps in the shape of the course's Horovod printout
    /// (`[1,RANK]<stdout>:Epoch [2/10], Step [24960/25000], Loss: 0.1234`, the step counted in
    /// this rank's examples of its shard), and rank 0 `Test set: Accuracy: 81.08%` and the
    /// elapsed time at the end: to hold a run against the slide.
    #[arg(long, value_name = "N")]
    #[arg(help_heading = "Output")]
    pub course_log: Option<usize>,
    /// 32: float32; 16-mixed: float16 autocast with gradient scaling (GPU); bf16-mixed:
    /// bfloat16 autocast (GPU or CPU); 16-true (GPU) and bf16-true: the whole model in 16 bits
    /// (`model.half()`: weights, gradients, optimizer state, but Adam's moments of float16
    /// weights in float32; no autocast, no scaler; one process
    /// or data-parallel replicas over NCCL). Lightning's older names work too: 32-true, and 16
    /// and bf16, which Lightning 2 reads as 16-mixed and bf16-mixed.
    #[arg(long, value_enum, default_value = "32")]
    #[arg(help_heading = "Precision and speed")]
    pub precision: crate::precision::Precision,
    /// float32 matrix products: highest (float32), high (TF32 tensor cores), medium (bfloat16
    /// allowed), as torch.set_float32_matmul_precision; mixed precision is unaffected.
    #[arg(long, value_enum, default_value = "highest")]
    #[arg(help_heading = "Precision and speed")]
    pub matmul_precision: crate::precision::MatmulPrecision,
    /// The same kernels on every run, as torch.use_deterministic_algorithms(True) with cuDNN's
    /// deterministic kernels and its benchmark off (and CUBLAS_WORKSPACE_CONFIG=:4096:8): two
    /// runs with one seed agree bit for bit on the GPU too, at some speed; an operation that has
    /// no deterministic kernel then fails, naming itself.
    #[arg(long)]
    #[arg(help_heading = "Precision and speed")]
    pub deterministic: bool,
    /// Peak TFLOP/s of one device in this precision, for the model-FLOPs utilisation (MFU)
    /// [default: from the data sheet of a known GPU; none on a CPU].
    #[arg(long)]
    #[arg(help_heading = "Precision and speed")]
    pub peak_tflops: Option<f64>,
    /// Print where the step time goes: the phases of every step (data wait, forward, backward,
    /// the gradients' all-reduce and clipping, optimizer, evaluation), as a table and a Chrome
    /// trace `<run>.trace.json`; and LibTorch's profiler over --profile-steps: the operators and
    /// CUDA kernels by self time (torch.profiler's table) and their trace
    /// `<run>.torch-trace.json`, in --results-dir. Waits for the device between phases: costs
    /// some speed.
    #[arg(long)]
    #[arg(help_heading = "Output")]
    pub profile: bool,
    /// The training steps LibTorch's profiler records, A..B (steps A to B, counted from 1);
    /// implies --profile [default: the five steps after --steady-after].
    #[arg(long, value_name = "A..B")]
    #[arg(help_heading = "Output")]
    pub profile_steps: Option<crate::profile::libtorch::StepWindow>,
    /// Print what each rank will hold (parameters, gradients, optimizer state, activations, the
    /// peak) for these flags and layout, and write it to --results-dir, without training
    /// (--nproc-per-node or the launcher gives the ranks).
    #[arg(long)]
    #[arg(help_heading = "Output")]
    pub estimate_memory: bool,
    /// Record the training step once in a CUDA graph and replay it for every batch (one launch
    /// instead of hundreds: for small, launch-bound steps). GPU, one process, adam or sgd,
    /// no --accumulate, no 16-mixed.
    #[arg(long)]
    #[arg(help_heading = "Precision and speed")]
    pub cuda_graph: bool,
    /// Optimizer steps left out of the steady-state throughput (results: steady_throughput):
    /// the warm-up, where kernels are chosen and caches filled.
    #[arg(long, default_value_t = 2)]
    #[arg(help_heading = "Precision and speed")]
    pub steady_after: usize,
    /// Write TensorBoard event files (loss, learning rate, throughput every 10 steps; each
    /// epoch's losses, accuracy or perplexity) to DIR/<run>.
    #[arg(long)]
    #[arg(help_heading = "Output")]
    pub tensorboard: Option<PathBuf>,
}

impl RunArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        if self.epochs == Some(0) || self.max_steps == Some(0) {
            return usage("--epochs and --max-steps must be at least 1");
        }
        if self.eval_only && self.checkpoint.is_none() && !self.resume {
            return usage("--eval-only tests a trained model: give its --checkpoint FILE, or --checkpoint-dir DIR --resume");
        }
        if self.peak_tflops.is_some_and(|p| !(p > 0.0 && p.is_finite())) {
            return usage(format!("--peak-tflops must be a positive number, got {}", self.peak_tflops.unwrap_or_default()));
        }
        if self.cuda_graph && self.device == DeviceChoice::Cpu {
            return usage("--cuda-graph records GPU work, but --device cpu trains on the CPU: drop one of them");
        }
        // Said before training, not after the signal that would need it.
        if self.requeue == crate::slurm::Requeue::On && crate::slurm::job_id().is_none() {
            return usage("--requeue on: not running in a Slurm job (no SLURM_JOB_ID), so there is nothing to requeue; use --requeue auto or off");
        }
        if let Some(dir) = self.tensorboard.as_ref().filter(|d| d.exists() && !d.is_dir()) {
            return usage(format!("--tensorboard {}: a file, not a folder; choose a folder for the event files", dir.display()));
        }
        Ok(())
    }

    /// `--profile` or `--profile-steps`: the window of steps LibTorch's profiler records.
    pub fn profiling(&self) -> Option<crate::profile::libtorch::StepWindow> {
        match self.profile_steps {
            Some(window) => Some(window),
            None => self.profile.then(|| crate::profile::libtorch::StepWindow::after_warmup(self.steady_after)),
        }
    }

    /// The results file of the run named `run` is `<results dir>/<run>.json`; with `--profile`,
    /// beside it the phases' Chrome trace `<run>.trace.json` and LibTorch's
    /// `<run>.torch-trace.json` (`kind` "trace" or "torch-trace"), or `<run>-rank<r>.…` for the
    /// ranks of a model spread over several.
    pub fn trace_path(&self, run: &str, kind: &str, rank: Option<usize>) -> PathBuf {
        match rank {
            Some(rank) => self.results_dir.join(format!("{run}-rank{rank}.{kind}.json")),
            None => self.results_dir.join(format!("{run}.{kind}.json")),
        }
    }

    /// `--data-dir`, or `data/<default>`.
    pub fn data_dir_or(&self, default: &str) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(|| PathBuf::from("data").join(default))
    }
}

/// Which of an exercise's recipes `--recipe` picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RecipeSource {
    /// The project's recipe: the course's where that learns, a measured one where it does not.
    #[default]
    Default,
    /// The course's settings as its slides give them.
    Course,
}

/// How the model is optimized: every exercise takes these; what is not given comes from the
/// exercise's preset ([`crate::presets`]), which `--help` lists.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct RecipeArgs {
    /// default: the project's recipe for the exercise, which learns; course: the course's own
    /// settings, to reproduce its slides (they differ for exercise3, and for --model resnet50
    /// and resnet50v2 are JSC's and Namal/BSC's recipes: see --help's preset).
    #[arg(long, value_enum, default_value = "default")]
    #[arg(help_heading = "Training")]
    pub recipe: RecipeSource,
    /// Examples (images, or token streams) per batch on each rank [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub batch_size: Option<usize>,
    /// adam, sgd (with --momentum), lars (SGD with layer-wise trust ratios, You et al. 2017) or
    /// lamb (Adam with them, You et al. 2019) [default: the preset's].
    #[arg(long, value_enum)]
    #[arg(help_heading = "Training")]
    pub optimizer: Option<crate::optim::OptimizerKind>,
    /// Learning rate [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub lr: Option<f64>,
    /// How adam and sgd update the parameters: fused (LibTorch's multi-tensor kernel, as
    /// torch.optim's fused=True), per-parameter, or auto (fused on a GPU).
    #[arg(long, value_enum, default_value = "auto")]
    #[arg(help_heading = "Training")]
    pub optimizer_kernel: crate::optim::OptimizerKernel,
    /// Momentum of sgd and lars [default: 0.9].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub momentum: Option<f64>,
    /// L2 weight decay (decoupled for lamb) [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub weight_decay: Option<f64>,
    /// Gradient-norm clipping threshold; 0 turns it off [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub clip: Option<f64>,
    /// The learning rate of every step [default: the preset's].
    #[arg(long, value_enum)]
    #[arg(help_heading = "Training")]
    pub lr_schedule: Option<crate::train::ScheduleKind>,
    /// StepLR's factor applied after every epoch [default: the preset's].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub gamma: Option<f64>,
    /// Accumulate the gradients of K batches into one optimizer step: an effective batch of
    /// K × batch × ranks (replicas average once, after the last of them).
    #[arg(long, default_value_t = 1)]
    #[arg(help_heading = "Training")]
    pub accumulate: usize,
    /// Multiply the learning rate by the effective batch's growth, --accumulate × ranks (linear
    /// scaling, Goyal et al. 2017).
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub scale_lr: bool,
    /// Ramp the learning rate up linearly, step by step, over this many epochs... (0: no
    /// warm-up, the preset's neither) [default: the preset's]
    #[arg(long, conflicts_with = "warmup_steps")]
    #[arg(help_heading = "Training")]
    pub warmup_epochs: Option<usize>,
    /// ...or over this many optimizer steps (0: none).
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub warmup_steps: Option<usize>,
    /// Where the warm-up starts, as a share of the learning rate [default: 1/(--accumulate ×
    /// ranks) with --scale-lr: from the small batch's rate, as Goyal et al.].
    #[arg(long)]
    #[arg(help_heading = "Training")]
    pub warmup_start: Option<f64>,
}

impl Default for RecipeArgs {
    /// No flags given: the preset's recipe, one batch per step.
    fn default() -> Self {
        RecipeArgs {
            recipe: RecipeSource::Default,
            batch_size: None,
            optimizer: None,
            optimizer_kernel: crate::optim::OptimizerKernel::Auto,
            lr: None,
            momentum: None,
            weight_decay: None,
            clip: None,
            lr_schedule: None,
            gamma: None,
            accumulate: 1,
            scale_lr: false,
            warmup_epochs: None,
            warmup_steps: None,
            warmup_start: None,
        }
    }
}

impl RecipeArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        if self.batch_size == Some(0) {
            return usage("--batch-size must be at least 1");
        }
        if self.accumulate == 0 {
            return usage("--accumulate must be at least 1");
        }
        let positive = |x: Option<f64>| x.is_none_or(|x| x > 0.0 && x.is_finite());
        let non_negative = |x: Option<f64>| x.is_none_or(|x| x >= 0.0 && x.is_finite());
        if !positive(self.lr) {
            return usage(format!("--lr must be a positive number, got {}", self.lr.unwrap_or_default()));
        }
        if !positive(self.gamma) || !non_negative(self.clip) || !non_negative(self.momentum) || !non_negative(self.weight_decay) {
            return usage("--gamma must be positive; --clip, --momentum and --weight-decay non-negative");
        }
        let warming = self.warmup_epochs.is_some_and(|n| n > 0) || self.warmup_steps.is_some_and(|n| n > 0);
        if warming && !self.scale_lr && self.warmup_start.is_none() {
            return usage(
                "--warmup-epochs/--warmup-steps ramp up a scaled learning rate: use it with --scale-lr (Goyal et al.: from \
                 the small batch's rate), or say where the ramp starts with --warmup-start",
            );
        }
        if self.warmup_start.is_some_and(|s| !(0.0..=1.0).contains(&s)) {
            return usage("--warmup-start is a share of the learning rate, between 0 and 1");
        }
        if self.optimizer_kernel != crate::optim::OptimizerKernel::Auto
            && matches!(self.optimizer, Some(crate::optim::OptimizerKind::Lars | crate::optim::OptimizerKind::Lamb))
        {
            return usage("--optimizer-kernel chooses how adam and sgd update; lars and lamb have one way");
        }
        if warming && self.lr_schedule == Some(crate::train::ScheduleKind::OneCycle) {
            return usage("--lr-schedule one-cycle warms up by itself: drop --warmup-epochs/--warmup-steps");
        }
        Ok(())
    }
}

/// How the ranks of a job are started and talk (every exercise takes these).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct ParallelArgs {
    /// Start N local ranks (through mpirun), as the course's mp.spawn and `horovodrun -np N` do.
    /// Without it, the ranks come from the launcher that started this process (mpirun, srun,
    /// torchrun-style variables), or there is one.
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub nproc_per_node: Option<usize>,
    /// Collective engine: NCCL for CUDA tensors and MPI for CPU tensors (auto), or one of them.
    #[arg(long, value_enum, default_value = "auto")]
    #[arg(help_heading = "Parallelism")]
    pub backend: crate::comm::Backend,
    /// Gradients are averaged in buckets of this many MiB (fewer, larger messages).
    #[arg(long, default_value_t = 25.0, value_parser = crate::cli::positive)]
    #[arg(help_heading = "Parallelism")]
    pub bucket_mb: f64,
    /// A check, not a way to train faster: allow more ranks than GPUs, several on one GPU, each
    /// given an NCCL host id of its own (NCCL_HOSTID) so that NCCL, which refuses two ranks on
    /// one GPU of one host, connects them over its socket transport (on loopback within a node).
    /// Their kernels take turns on the GPU.
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub share_gpu: bool,
    /// Send gradients as fp16 (NCCL only).
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub fp16_allreduce: bool,
    /// --nproc-per-node refuses more CPU ranks than this many per core (each rank is a LibTorch
    /// process with its own memory).
    #[arg(long, default_value_t = crate::comm::launch::MAX_RANKS_PER_CORE)]
    #[arg(help_heading = "Parallelism")]
    pub max_ranks_per_core: usize,
    /// Seconds a collective or message may wait for the other ranks before the job is declared
    /// hung and ended, naming the ranks that did not answer (a group's first operation waits at
    /// least 300 s: start-up and data loading). As PyTorch's NCCL watchdog; MPI engine.
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0, value_parser = crate::cli::seconds)]
    #[arg(help_heading = "Parallelism")]
    pub collective_timeout: f64,
    /// Seconds the ranks wait for each other at the job's start (MPI's start-up; the TCP
    /// rendezvous of ranks that torchrun starts) before the job is ended, naming the ranks that
    /// never arrived (where --nproc-per-node started them).
    #[arg(long, value_name = "SECONDS", default_value_t = 300.0, value_parser = crate::cli::seconds)]
    #[arg(help_heading = "Parallelism")]
    pub startup_timeout: f64,
    /// ZeRO stage: 0 keeps everything on every replica; 1 shards the optimizer state over the
    /// data-parallel replicas (reduce-scatter the gradients, update one's block, all-gather the
    /// parameters); 2 also the gradients (reduce-scattered in buckets during the backward
    /// pass); 3 also the parameters (FSDP: gathered layer by layer when needed).
    #[arg(long, default_value_t = 0)]
    #[arg(help_heading = "Parallelism")]
    pub zero: u8,
    /// With --zero 3: shard the model state within groups of G consecutive replicas (a node's
    /// ranks) and keep the groups' copies equal by one all-reduce of each rank's 1/G of the
    /// gradients across them (HSDP, FSDP's HYBRID_SHARD): parameters gathered over the fast
    /// links only. G must divide the replicas.
    #[arg(long, value_name = "G")]
    #[arg(help_heading = "Parallelism")]
    pub shard_group: Option<usize>,
    // ---- Parameter-server hook (parallel::parameter_server): the strategy and its flags. ----
    /// data-parallel: every rank a replica, gradients averaged (all-reduce, or ZeRO);
    /// parameter-server: --servers ranks hold the parameters and run the optimizer, the others
    /// push gradients and pull parameters (--sync, --async, --max-staleness).
    #[arg(long, value_enum, default_value = "data-parallel")]
    #[arg(help_heading = "Parallelism")]
    pub strategy: crate::parallel::parameter_server::StrategyFlag,
    /// Parameter-server ranks (the job's last ones) [default: 1].
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub servers: Option<usize>,
    /// The servers wait for every worker's gradient and apply their average (the default):
    /// the same model as all-reduce data parallelism.
    #[arg(long)]
    #[arg(help_heading = "Parallelism")]
    pub sync: bool,
    /// The servers apply each gradient on arrival (Downpour SGD): workers never wait for each other.
    #[arg(long = "async", conflicts_with = "sync")]
    #[arg(help_heading = "Parallelism")]
    pub asynchronous: bool,
    /// With --async: no worker runs more than K steps ahead of the slowest (stale synchronous
    /// parallel, SSP): the fast wait; an applied gradient is then at most (workers − 1)(2K + 1)
    /// versions stale.
    #[arg(long, value_name = "K")]
    #[arg(help_heading = "Parallelism")]
    pub max_staleness: Option<usize>,
    /// RANK:SECONDS: rank RANK (a worker) sleeps that long in every optimizer step (a straggler,
    /// any strategy).
    #[arg(long, value_name = "RANK:SECONDS")]
    #[arg(help_heading = "Parallelism")]
    pub straggler: Option<crate::parallel::parameter_server::Straggler>,
}

impl ParallelArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        if self.nproc_per_node == Some(0) {
            return usage("--nproc-per-node must be at least 1");
        }
        // Parameter-server hook: its flags, checked before any rank starts.
        crate::parallel::parameter_server::check_flags(
            self.strategy,
            self.servers,
            self.sync,
            self.asynchronous,
            self.max_staleness,
            self.zero,
            self.nproc_per_node,
        )?;
        if self.zero > 3 {
            return usage(format!("--zero {}: ZeRO has stages 0 to 3", self.zero));
        }
        match (self.shard_group, self.zero) {
            (Some(g), zero) if zero != 3 => {
                usage(format!("--shard-group {g} shards the parameters within groups of replicas (HSDP): it needs --zero 3, not --zero {zero}"))
            }
            _ => Ok(()),
        }
    }

    /// The parameter server these flags ask for (none: data parallelism). Parameter-server hook.
    pub fn parameter_server(&self) -> Option<crate::parallel::parameter_server::Config> {
        use crate::parallel::parameter_server::{Config, Mode, StrategyFlag};
        let mode = if self.asynchronous { Mode::Async { max_staleness: self.max_staleness } } else { Mode::Sync };
        (self.strategy == StrategyFlag::ParameterServer).then_some(Config { servers: self.servers.unwrap_or(1), mode })
    }

    /// What these flags ask of the job before its ranks start (the ranks a style sets apart).
    pub fn job(&self) -> crate::parallel::JobSpec {
        crate::parallel::JobSpec::new(self.parameter_server())
    }

    /// The data-parallel style these flags ask for over `layout`'s replicas, where the preset
    /// says `preset`: what `--estimate-memory` counts (a training run's job says the same:
    /// [`crate::parallel::RunPart::sync`], else [`crate::parallel::GradientSync::of_run`]).
    pub fn sync(&self, preset: crate::parallel::GradientSync, layout: crate::comm::Layout) -> crate::parallel::GradientSync {
        if self.parameter_server().is_some() {
            // Parameter-server hook.
            return crate::parallel::GradientSync::ParameterServer;
        }
        // HSDP where the shard groups are fewer replicas than all of them (`Groups::shard_groups`).
        crate::parallel::GradientSync::of_run(preset, self.zero_stage(), layout.state_shards() < layout.dp)
    }

    /// The ZeRO stage `--zero` asks for (none for 0).
    pub fn zero_stage(&self) -> Option<crate::parallel::zero::ZeroStage> {
        crate::parallel::zero::ZeroStage::from_flag(self.zero)
    }

    /// The bucketed gradient averager these flags describe.
    pub fn averager(&self) -> crate::comm::data_parallel::GradientAverager {
        crate::comm::data_parallel::GradientAverager::new((self.bucket_mb * 1024.0 * 1024.0) as usize, self.fp16_allreduce)
    }
}

/// An exercise's flags from a command line, as its binary would parse them:
/// `parse::<ImageArgs>("exercise1", "--device cpu --max-steps 20")`. For notebooks and other
/// library callers, which then run the very configuration a job script would. Words are split
/// at whitespace (no quoting); a bad flag is clap's usage error, as a `UsageError`.
pub fn parse<T: clap::Args + clap::FromArgMatches>(program: &str, command_line: &str) -> anyhow::Result<T> {
    let command = T::augment_args(clap::Command::new(program.to_string()).no_binary_name(true));
    let matches =
        command.try_get_matches_from(command_line.split_whitespace()).map_err(|e| crate::error::UsageError(e.render().to_string().trim_end().to_string()))?;
    Ok(T::from_arg_matches(&matches).map_err(|e| crate::error::UsageError(e.to_string()))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::UsageError;
    use crate::image_classification::ImageArgs;
    use crate::models::Arch;

    #[test]
    fn a_command_line_parses_as_the_binary_would() {
        let args: ImageArgs = parse("exercise1", "--device cpu  --model vgg19 --max-steps 7\n--results-dir /tmp/r").unwrap();
        assert_eq!(args.run.device, DeviceChoice::Cpu);
        assert_eq!(args.model, Some(Arch::Vgg19));
        assert_eq!(args.run.max_steps, Some(7));
        assert_eq!(args.run.results_dir, PathBuf::from("/tmp/r"));
        // Defaults are the binary's: its preset's, resolved where the run starts.
        let exercise1 = crate::image_classification::ImageExperiment::new(&crate::presets::EXERCISE1, &args);
        let recipe = crate::experiment::RunRecipe::resolve(&exercise1.preset, &args.recipe, 1, 10, 5);
        assert_eq!((recipe.batch_size, recipe.lr, exercise1.arch()), (100, 1e-3, Arch::Vgg19));
        assert_eq!(args.run.seed, 42);
        let empty: ImageArgs = parse("exercise1", "").unwrap();
        assert_eq!(empty.run.device, DeviceChoice::Both);
    }

    #[test]
    fn a_bad_flag_is_a_usage_error_naming_it() {
        for (line, names) in [("--devise cpu", "--devise"), ("--device tpu", "tpu"), ("--max-steps many", "many")] {
            let err = parse::<ImageArgs>("exercise1", line).unwrap_err();
            let usage = err.downcast_ref::<UsageError>().unwrap_or_else(|| panic!("{line}: not a usage error: {err:#}"));
            assert!(usage.0.contains(names), "{line}: {}", usage.0);
        }
        let unknown = parse::<ImageArgs>("exercise1", "--devise cpu").unwrap_err().to_string();
        assert!(unknown.contains("Usage: exercise1"), "{unknown}");
    }
}
