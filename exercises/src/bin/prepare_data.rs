//! Data chores for `make data`: generate a stand-in data set in the official format, or check
//! that a folder holds a readable data set.
use clap::{Parser, Subcommand};
use common::data::text::{self, Tokenizer, WikitextSizes};
use common::data::{self, generate, DatasetKind, Split};
use std::path::PathBuf;

#[derive(Parser)]
#[command(version, about = "Generate or check the exercises' data sets (CIFAR-10, MNIST, WikiText-2)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a generated stand-in, in the real data set's binary format, marked as generated.
    Generate {
        #[arg(long, value_enum)]
        dataset: DatasetKind,
        /// Output folder [default: data/<dataset>].
        #[arg(long)]
        out: Option<PathBuf>,
        /// Training images [default: the real data set's count].
        #[arg(long)]
        train: Option<usize>,
        /// Test images [default: 10000].
        #[arg(long)]
        test: Option<usize>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Write a generated WikiText-2 stand-in (wiki.{train,valid,test}.tokens), marked as generated.
    GenerateText {
        #[arg(long, default_value = "data/wikitext-2")]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Read WikiText-2's three splits and print their sizes (fails with the reader's error otherwise).
    CheckText {
        /// The folder (--data-dir, as the exercises call it, works too).
        #[arg(long, visible_alias = "data-dir", default_value = "data/wikitext-2")]
        dir: PathBuf,
    },
    /// Read both splits and print their sizes (fails with the reader's error otherwise).
    Check {
        #[arg(long, value_enum)]
        dataset: DatasetKind,
        /// The folder (--data-dir, as the exercises call it, works too) [default: data/<data set>].
        #[arg(long, visible_alias = "data-dir")]
        dir: Option<PathBuf>,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    common::error::run_main(|| match cli.command {
        Command::Generate { dataset, out, train, test, seed } => {
            let full = generate::GenerateConfig::full(dataset);
            let config = generate::GenerateConfig { train: train.unwrap_or(full.train), test: test.unwrap_or(full.test), seed };
            let out = out.unwrap_or_else(|| dataset.default_dir());
            generate::generate(dataset, &out, config)?;
            println!("wrote a GENERATED {} stand-in ({} train + {} test images) to {}", dataset.name(), config.train, config.test, out.display());
            Ok(())
        }
        Command::GenerateText { out, seed } => {
            let sizes = WikitextSizes::default();
            text::generate_wikitext(&out, seed, sizes)?;
            println!(
                "wrote a GENERATED WikiText-2 stand-in (about {} train + {} valid + {} test tokens) to {}",
                sizes.train,
                sizes.valid,
                sizes.test,
                out.display()
            );
            Ok(())
        }
        Command::CheckText { dir } => {
            let corpus = text::load_corpus(&dir, Tokenizer::Whitespace)?;
            println!(
                "wikitext-2 in {}: {} train + {} valid + {} test tokens, {} words{}",
                dir.display(),
                corpus.train.numel(),
                corpus.valid.numel(),
                corpus.test.numel(),
                corpus.vocab.len(),
                if corpus.generated { " (GENERATED stand-in)" } else { "" }
            );
            Ok(())
        }
        Command::Check { dataset, dir } => {
            let dir = dir.unwrap_or_else(|| dataset.default_dir());
            let train = data::load(dataset, &dir, Split::Train)?;
            let test = data::load(dataset, &dir, Split::Test)?;
            println!(
                "{} in {}: {} train + {} test images{}",
                dataset.name(),
                dir.display(),
                train.len(),
                test.len(),
                if train.generated { " (GENERATED stand-in)" } else { "" }
            );
            Ok(())
        }
    })
}
