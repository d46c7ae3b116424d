//! Exercise 2: ResNet34 on CIFAR-10, data-parallel over several processes, as the course's
//! Horovod script (`horovodrun -np 2 python exercise2.py`): one rank per GPU (or CPU process),
//! parameters and optimizer state broadcast from rank 0, gradients averaged in every step by a
//! distributed optimizer wrapper (`hvd.DistributedOptimizer`), metrics averaged over the
//! workers, checkpoints and results from rank 0.
//!
//!     exercise2 --nproc-per-node 2 --device cpu --max-steps 20
//!     mpirun -np 2 exercise2 ...        srun exercise2 ...        (one task per GPU)
use clap::{CommandFactory, FromArgMatches, Parser};
use common::dist::GradientSync;
use common::flags::DataParallelArgs;
use common::image_classification::{self, ImageArgs};
use common::Exercise;

/// Exercise 2: data-parallel ResNet34 on CIFAR-10 (Horovod style).
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    args: ImageArgs,
    #[command(flatten)]
    data_parallel: DataParallelArgs,
}

fn main() -> std::process::ExitCode {
    // The course's exercise2 trains ResNet34: the shared flags' default model is the CNN.
    let matches = Cli::command().mut_arg("model", |arg| arg.default_value("resnet34")).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let exercise = Exercise { name: "exercise2", default_epochs: 10 };
    common::error::run_main(|| image_classification::run_data_parallel(exercise, &cli.args, &cli.data_parallel, GradientSync::Horovod))
}
