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
    pub device: DeviceChoice,
    /// Folder with the data set's files [default: data/<data set>].
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Epochs [default: the exercise's].
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Stop after this many optimizer steps (smoke runs, benchmarks).
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Seeds the initial weights, the data order, augmentation and dropout.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// LibTorch threads for CPU work; 0 = one per core.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Save a checkpoint here after every epoch.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue from the checkpoint in --checkpoint-dir when there is one.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Where results (JSON, CSV) are written.
    #[arg(long, default_value = "results")]
    pub results_dir: PathBuf,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// 32: float32; 16-mixed: float16 autocast with gradient scaling (GPU); bf16-mixed:
    /// bfloat16 autocast (GPU or CPU).
    #[arg(long, value_enum, default_value = "32")]
    pub precision: crate::precision::Precision,
    /// Peak TFLOP/s of one device in this precision, for the model-FLOPs utilisation (MFU)
    /// [default: from the data sheet of a known GPU; none on a CPU].
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Print where the step time goes (data wait, forward, backward, all-reduce, optimizer,
    /// evaluation) and write a Chrome trace `<run>.trace.json` to --results-dir. Waits for the
    /// device between phases: costs some speed.
    #[arg(long)]
    pub profile: bool,
    /// Write TensorBoard event files (loss, learning rate, throughput every 10 steps; each
    /// epoch's losses, accuracy or perplexity) to DIR/<run>.
    #[arg(long)]
    pub tensorboard: Option<PathBuf>,
}

impl RunArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        if self.epochs == Some(0) || self.max_steps == Some(0) {
            return usage("--epochs and --max-steps must be at least 1");
        }
        Ok(())
    }

    /// `--data-dir`, or `data/<default>`.
    pub fn data_dir_or(&self, default: &str) -> PathBuf {
        self.data_dir.clone().unwrap_or_else(|| PathBuf::from("data").join(default))
    }
}

/// The data-parallel exercises' own flags (exercise2, exercise3 ddp).
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct DataParallelArgs {
    /// Start N local ranks (through mpirun), as the course's mp.spawn and `horovodrun -np N` do.
    /// Without it, the ranks come from the launcher that started this process (mpirun, srun,
    /// torchrun-style variables), or there is one.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Collective engine: NCCL for CUDA tensors and MPI for CPU tensors (auto), or one of them.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: crate::dist::Backend,
    /// Gradients are averaged in buckets of this many MiB (fewer, larger messages).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// Send gradients as fp16 (NCCL only).
    #[arg(long)]
    pub fp16_allreduce: bool,
    /// Multiply the learning rate by the world size (linear scaling, Goyal et al. 2017).
    #[arg(long)]
    pub scale_lr: bool,
    /// Ramp the scaled learning rate up from the single-process one over this many epochs.
    #[arg(long, default_value_t = 0)]
    pub warmup_epochs: usize,
}

impl DataParallelArgs {
    pub fn check(&self) -> anyhow::Result<()> {
        if self.nproc_per_node == Some(0) {
            return usage("--nproc-per-node must be at least 1");
        }
        if !(self.bucket_mb > 0.0 && self.bucket_mb.is_finite()) {
            return usage(format!("--bucket-mb must be positive, got {}", self.bucket_mb));
        }
        if self.warmup_epochs > 0 && !self.scale_lr {
            return usage("--warmup-epochs ramps up a scaled learning rate: use it with --scale-lr");
        }
        Ok(())
    }
}

/// An exercise's flags from a command line, as its binary would parse them:
/// `parse::<ImageArgs>("exercise1", "--device cpu --max-steps 20")`. For notebooks and other
/// library callers, which then run the very configuration a job script would. Words are split
/// at whitespace (no quoting); a bad flag is clap's usage error, as a `UsageError`.
pub fn parse<T: clap::Args + clap::FromArgMatches>(program: &str, command_line: &str) -> anyhow::Result<T> {
    let command = T::augment_args(clap::Command::new(program.to_string()).no_binary_name(true));
    let matches = command.try_get_matches_from(command_line.split_whitespace()).map_err(|e| {
        crate::error::UsageError(e.render().to_string().trim_end().to_string())
    })?;
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
        assert_eq!(args.model, Arch::Vgg19);
        assert_eq!(args.run.max_steps, Some(7));
        assert_eq!(args.run.results_dir, PathBuf::from("/tmp/r"));
        // Defaults are the binary's.
        assert_eq!(args.batch_size, 100);
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
