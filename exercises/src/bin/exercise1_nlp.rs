//! Exercise 1 (NLP): the course's Transformer language model on WikiText-2, on the CPU and on
//! the GPU, as in the course's PyTorch tutorial script; data-parallel with `--nproc-per-node`.
use clap::{CommandFactory, Parser};
use common::language_model::{self, LmArgs};
use common::presets::EXERCISE1_NLP;

/// Exercise 1 (NLP): CPU vs GPU training of a Transformer language model on WikiText-2.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    args: LmArgs,
}

fn main() -> std::process::ExitCode {
    let matches = common::config_file::get_matches(Cli::command().after_help(EXERCISE1_NLP.describe()));
    let cli = common::cli::from_matches::<Cli>(&matches);
    common::error::run_main(|| language_model::run(&EXERCISE1_NLP, &cli.args, &mut Default::default()).map(drop))
}
