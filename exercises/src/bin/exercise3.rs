//! Exercise 3: the course's two ways past one GPU.
//!
//! `exercise3 ddp`: VGG19 on CIFAR-10, data-parallel as PyTorch DDP does it: a process group
//! (NCCL for GPU tensors, MPI for CPU tensors), the same seed on every rank, a distributed
//! sampler, `MASTER_ADDR`/`MASTER_PORT` rendezvous when not started by an MPI launcher.
//!
//!     exercise3 ddp --nproc-per-node 2 --device cpu --max-steps 20
//!
//! `exercise3 pipeline`: the course's 1.4B-parameter Transformer language model (12 layers,
//! d_model 4096) cut into stages over several devices and trained with GPipe micro-batches
//! (`--chunks 8`), or the 1F1B schedule.
//!
//!     exercise3 pipeline --devices cuda:0,cuda:1
//!     exercise3 pipeline --devices cpu,cpu --emsize 256 --d-hid 256 --nlayers 4 --max-steps 20
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use common::dist::GradientSync;
use common::flags::DataParallelArgs;
use common::image_classification::{self, ImageArgs};
use common::pipeline_lm::{self, PipelineArgs};
use common::Exercise;

/// Exercise 3: VGG19 data-parallel (DDP style), or the Transformer pipeline-parallel.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// VGG19 on CIFAR-10, data-parallel (PyTorch DDP style).
    Ddp {
        #[command(flatten)]
        args: ImageArgs,
        #[command(flatten)]
        data_parallel: DataParallelArgs,
    },
    /// The 1.4B-parameter Transformer LM on WikiText-2, pipeline-parallel over several devices.
    Pipeline {
        #[command(flatten)]
        args: PipelineArgs,
    },
}

fn main() -> std::process::ExitCode {
    // The course's DDP exercise trains VGG19: the shared flags' default model is the CNN.
    let matches = Cli::command()
        .mut_subcommand("ddp", |ddp| ddp.mut_arg("model", |arg| arg.default_value("vgg19")))
        // The pipeline exercise's model is exercise1_nlp's, 16 times larger.
        .mut_subcommand("pipeline", |pipeline| {
            pipeline_lm::COURSE_DEFAULTS
                .iter()
                .fold(pipeline, |cmd, (flag, value)| cmd.mut_arg(*flag, |arg| arg.default_value(*value)))
        })
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Ddp { args, data_parallel } => {
            let exercise = Exercise { name: "exercise3_ddp", default_epochs: 10 };
            common::error::run_main(|| image_classification::run_data_parallel(exercise, &args, &data_parallel, GradientSync::Ddp))
        }
        Command::Pipeline { args } => {
            let exercise = Exercise { name: "exercise3_pipeline", default_epochs: 3 };
            common::error::run_main(|| pipeline_lm::run(exercise, &args))
        }
    }
}
