//! What a checkpoint holds, and its model as one file.
//!
//!     checkpoint show CHECKPOINT
//!     checkpoint export CHECKPOINT OUT.safetensors
//!
//! CHECKPOINT is a run's single-file checkpoint (`<run>.safetensors`), the folder of its sharded
//! checkpoints (`<run>.shards`) or one of them (`<run>.shards/step-…`): the newest complete one
//! is read, whatever layout wrote it. `export` writes the model's whole tensors under their torch
//! names (no optimizer state), one tensor in memory at a time: what `--weights` reads, and what
//! PyTorch reads with `safetensors.torch.load_file`.
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use common::checkpoint::{self, sharded::Source};

#[derive(Parser)]
#[command(version, about = "What a checkpoint holds, and its model as one file")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The run, progress, format and tensors of the newest complete checkpoint at CHECKPOINT.
    Show { checkpoint: PathBuf },
    /// The model of the newest complete checkpoint at CHECKPOINT as one safetensors file of
    /// whole tensors under torch's names.
    Export { checkpoint: PathBuf, out: PathBuf },
}

fn open(path: &Path) -> anyhow::Result<Source> {
    if !path.exists() {
        return common::error::usage(format!("no checkpoint at {}", path.display()));
    }
    let found = checkpoint::find_newest(path)?.ok_or_else(|| anyhow::anyhow!("no complete checkpoint at {}", path.display()))?;
    for warning in &found.warnings {
        eprintln!("warning: {warning}");
    }
    Source::open(&found.path)
}

fn main() -> std::process::ExitCode {
    let cli = common::cli::parse::<Cli>();
    common::error::run_main(|| {
        match cli.command {
            Command::Show { checkpoint } => {
                let source = open(&checkpoint)?;
                let meta = &source.meta;
                println!("{}: run {}, epoch {}, step {} ({})", source.path.display(), meta.run, meta.epoch, meta.step, source.describe());
                for key in source.keys() {
                    println!("  {key} {:?}", source.shape(key).unwrap_or_default());
                }
            }
            Command::Export { checkpoint, out } => {
                let source = open(&checkpoint)?;
                let tensors = checkpoint::sharded::export_model(&source, &out)?;
                println!("wrote {} ({tensors} tensors of {} at step {})", out.display(), source.meta.run, source.meta.step);
            }
        }
        Ok(())
    })
}
