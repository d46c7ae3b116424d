//! Exercise 2: ResNet34 on CIFAR-10, data-parallel over several processes, as the course's
//! Horovod script (`horovodrun -np 2 python exercise2.py`): one rank per GPU (or CPU process),
//! parameters and optimizer state broadcast from rank 0, gradients averaged in every step by a
//! distributed optimizer wrapper (`hvd.DistributedOptimizer`), metrics averaged over the
//! workers, checkpoints and results from rank 0.
//!
//!     exercise2 --nproc-per-node 2 --device cpu --max-steps 20
//!     mpirun -np 2 exercise2 ...        srun exercise2 ...        (one task per GPU)
use clap::{CommandFactory, Parser};
use common::image_classification::{self, ImageArgs};
use common::presets::EXERCISE2;

/// Exercise 2: data-parallel ResNet34 on CIFAR-10 (Horovod style).
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    args: ImageArgs,
}

fn main() -> std::process::ExitCode {
    let matches = common::config_file::get_matches(Cli::command().after_help(EXERCISE2.describe()));
    let cli = common::cli::from_matches::<Cli>(&matches);
    common::error::run_main(|| image_classification::run(&EXERCISE2, &cli.args, &mut Default::default()).map(drop))
}
