//! Exercise 1 (NLP): the course's Transformer language model on WikiText-2, on the CPU and on
//! the GPU, as in the course's PyTorch tutorial script.
use clap::Parser;
use common::language_model::{self, LmArgs};
use common::Exercise;

/// Exercise 1 (NLP): CPU vs GPU training of a Transformer language model on WikiText-2.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(flatten)]
    args: LmArgs,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let exercise = Exercise { name: "exercise1_nlp", default_epochs: 3 };
    common::error::run_main(|| language_model::run(exercise, &cli.args).map(drop))
}
