//! Exercise 1: train a CNN, ResNet34 or VGG19 on CIFAR-10 (or MNIST) on the CPU and on the
//! GPU, and compare the two, as in the course's `exercise1.py`.
use clap::Parser;
use common::image_classification::{self, ImageArgs};
use common::Exercise;

/// Exercise 1: CPU vs GPU training of an image classifier.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    args: ImageArgs,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let exercise = Exercise { name: "exercise1", default_epochs: 5 };
    common::error::run_main(|| image_classification::run(exercise, &cli.args).map(drop))
}
