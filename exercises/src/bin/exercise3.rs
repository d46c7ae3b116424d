//! Exercise 3: the course's two ways past one GPU.
//!
//! `exercise3 ddp`: VGG19 on CIFAR-10, data-parallel as PyTorch DDP does it: a process group
//! (NCCL for GPU tensors, MPI for CPU tensors), the same seed on every rank, a distributed
//! sampler, `MASTER_ADDR`/`MASTER_PORT` rendezvous when not started by an MPI launcher.
//!
//!     exercise3 ddp --nproc-per-node 2 --device cpu --max-steps 20
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use common::dist::GradientSync;
use common::flags::DataParallelArgs;
use common::image_classification::{self, ImageArgs};
use common::Exercise;

/// Exercise 3: VGG19 data-parallel (DDP style).
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
}

fn main() -> std::process::ExitCode {
    // The course's DDP exercise trains VGG19: the shared flags' default model is the CNN.
    let matches = Cli::command()
        .mut_subcommand("ddp", |ddp| ddp.mut_arg("model", |arg| arg.default_value("vgg19")))
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Ddp { args, data_parallel } => {
            let exercise = Exercise { name: "exercise3_ddp", default_epochs: 10 };
            common::error::run_main(|| image_classification::run_data_parallel(exercise, &args, &data_parallel, GradientSync::Ddp))
        }
    }
}
