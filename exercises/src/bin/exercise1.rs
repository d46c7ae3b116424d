//! Exercise 1: train a CNN, ResNet34 or VGG19 on CIFAR-10 (or MNIST) on the CPU and on the
//! GPU, and compare the two, as in the course's `exercise1.py`.
use clap::{CommandFactory, Parser};
use common::image_classification::{self, ImageArgs};
use common::presets::EXERCISE1;

/// Exercise 1: CPU vs GPU training of an image classifier.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    args: ImageArgs,
}

fn main() -> std::process::ExitCode {
    let matches = common::config_file::get_matches(Cli::command().after_help(EXERCISE1.describe()));
    let cli = common::cli::from_matches::<Cli>(&matches);
    common::error::run_main(|| image_classification::run(&EXERCISE1, &cli.args, &mut Default::default()).map(drop))
}
