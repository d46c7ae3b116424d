//! Data chores for `make data`: generate a stand-in data set in the official format, check
//! that a folder holds a readable data set, or pack an image folder into tar shards.
use anyhow::Context;
use clap::{Parser, Subcommand};
use common::data::image_folder::{split_folder, ImageFolder};
use common::data::shards;
use common::data::text::{self, Tokenizer, WikitextSizes};
use common::data::{self, generate, DatasetKind, Split};
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(version, about = "Generate, check or pack the exercises' data sets (CIFAR-10, MNIST, WikiText-2, image folders), or fetch ImageNet weights")]
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
        /// Replace what --out holds even where this tool did not generate it (real data).
        #[arg(long)]
        force: bool,
    },
    /// Write a generated image folder (train/<class>/*.JPEG, val/<class>/*.JPEG, torchvision's
    /// ImageFolder layout), marked as generated: for `--dataset imagefolder`, `pack` and `make bench-data`.
    GenerateImages {
        #[arg(long, default_value = "data/imagefolder")]
        out: PathBuf,
        #[arg(long, default_value_t = 10)]
        classes: usize,
        /// Training images per class.
        #[arg(long, default_value_t = 100)]
        train: usize,
        /// Validation images per class.
        #[arg(long, default_value_t = 20)]
        val: usize,
        #[arg(long, value_enum, default_value = "imagenet")]
        sizes: generate::PhotoSizes,
        /// Also a grey-scale JPEG and an RGBA PNG in every class.
        #[arg(long)]
        mixed_formats: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Replace what --out holds even where this tool did not generate it (real data).
        #[arg(long)]
        force: bool,
    },
    /// Write a generated WikiText-2 stand-in (wiki.{train,valid,test}.tokens), marked as generated.
    GenerateText {
        #[arg(long, default_value = "data/wikitext-2")]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Replace what --out holds even where this tool did not generate it (real data).
        #[arg(long)]
        force: bool,
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
    /// Fetch torchvision's published ImageNet weights of MODEL (resnet34, resnet50 or vgg19, as
    /// `--weights imagenet` uses them) into torchvision's cache ($TORCH_HOME/hub/checkpoints,
    /// ~/.cache/torch/hub/checkpoints by default), checked against the hash in their name; a
    /// file already there is checked and kept. COURSE_WEIGHTS_URL names a mirror's folder.
    Weights {
        #[arg(value_enum)]
        model: common::models::Arch,
    },
    /// Pack an image folder (DIR/train/<class>/<image>, and DIR/val likewise if present) into tar
    /// shards in WebDataset's format, OUT/train-NNNNNN.tar and OUT/val-NNNNNN.tar, indexed by
    /// OUT/shards.json: a few large files that each rank streams, instead of millions of small ones.
    Pack {
        /// The image folder.
        #[arg(long)]
        data_dir: PathBuf,
        /// The folder the shards go to.
        #[arg(long)]
        out: PathBuf,
        /// Samples per shard (the last shard of a split may hold fewer).
        #[arg(long, default_value_t = 1000)]
        shard_size: usize,
        /// Seed of the order the samples are packed in (random, so that every shard mixes classes).
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn main() -> std::process::ExitCode {
    let cli = common::cli::parse::<Cli>();
    common::error::run_main(|| match cli.command {
        Command::Generate { dataset, out, train, test, seed, force } => generate_dataset(dataset, out, train, test, seed, force),
        Command::GenerateImages { out, classes, train, val, sizes, mixed_formats, seed, force } => {
            generate_images(out, generate::FolderConfig { classes, train_per_class: train, val_per_class: val, sizes, mixed_formats, seed }, force)
        }
        Command::Weights { model } => fetch_weights(model),
        Command::GenerateText { out, seed, force } => generate_text(&out, seed, force),
        Command::CheckText { dir } => check_text(&dir),
        Command::Check { dataset, dir } => check_dataset(dataset, dir),
        Command::Pack { data_dir, out, shard_size, seed } => pack_folder(&data_dir, &out, shard_size, seed),
    })
}

/// `generate`: a stand-in of `dataset`'s binary files, its full size unless told.
fn generate_dataset(dataset: DatasetKind, out: Option<PathBuf>, train: Option<usize>, test: Option<usize>, seed: u64, force: bool) -> anyhow::Result<()> {
    let full = generate::GenerateConfig::full(dataset);
    let config = generate::GenerateConfig { train: train.unwrap_or(full.train), test: test.unwrap_or(full.test), seed };
    let out = out.unwrap_or_else(|| dataset.default_dir());
    generate::check_may_replace(&out, force)?;
    generate::generate(dataset, &out, config)?;
    println!("wrote a GENERATED {} stand-in ({} train + {} test images) to {}", dataset.name(), config.train, config.test, out.display());
    Ok(())
}

/// `generate-images`: an image folder of generated photographs.
fn generate_images(out: PathBuf, config: generate::FolderConfig, force: bool) -> anyhow::Result<()> {
    let generate::FolderConfig { classes, train_per_class: train, val_per_class: val, mixed_formats, .. } = config;
    if classes == 0 || train == 0 {
        return common::error::usage("--classes and --train must be at least 1");
    }
    if mixed_formats && train < 2 {
        return common::error::usage("--mixed-formats needs --train 2 or more (a PNG and a grey JPEG per class)");
    }
    generate::check_may_replace(&out, force)?;
    generate::image_folder(&out, config)?;
    println!("wrote a GENERATED image folder ({classes} classes × {train} train + {val} val images) to {}", out.display());
    Ok(())
}

/// `weights`: torchvision's ImageNet weights of `model` into its cache, checked.
fn fetch_weights(model: common::models::Arch) -> anyhow::Result<()> {
    if common::models::pretrained::published_file(model).is_none() {
        return common::error::usage(format!("torchvision publishes no ImageNet weights for {} (only resnet34, resnet50 and vgg19)", model.name()));
    }
    let path = common::models::pretrained::imagenet_weights(model, true)?;
    println!("ImageNet weights of {}: {} (checked)", model.name(), path.display());
    Ok(())
}

/// `generate-text`: a WikiText-2 stand-in of the real one's size.
fn generate_text(out: &Path, seed: u64, force: bool) -> anyhow::Result<()> {
    let sizes = WikitextSizes::default();
    generate::check_may_replace(out, force)?;
    text::generate_wikitext(out, seed, sizes)?;
    println!("wrote a GENERATED WikiText-2 stand-in (about {} train + {} valid + {} test tokens) to {}", sizes.train, sizes.valid, sizes.test, out.display());
    Ok(())
}

/// `check-text`: WikiText-2's splits read as the exercises read them, their sizes printed.
fn check_text(dir: &Path) -> anyhow::Result<()> {
    let corpus = text::load_corpus(dir, Tokenizer::Whitespace)?;
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

/// `check`: both splits of an image data set read, their sizes printed.
fn check_dataset(dataset: DatasetKind, dir: Option<PathBuf>) -> anyhow::Result<()> {
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

/// `pack`: an image folder's splits into tar shards beside their index.
fn pack_folder(data_dir: &Path, out: &Path, shard_size: usize, seed: u64) -> anyhow::Result<()> {
    if shard_size == 0 {
        return common::error::usage("--shard-size 0: a shard holds at least one sample");
    }
    if within(out, data_dir) {
        // Its shards would sit in a class folder (or beside train/) of what they pack.
        return common::error::usage(format!(
            "--out {} is inside --data-dir {}: the shards would be written into the image folder they pack; choose a folder outside it",
            out.display(),
            data_dir.display()
        ));
    }
    // Both splits listed (and checked) first: a bad val/ fails before hours of packing train/.
    let train = ImageFolder::scan_split(data_dir, Split::Train, None)?;
    let has_val = data_dir.join(split_folder(Split::Test)).is_dir();
    let val = has_val.then(|| ImageFolder::scan_split(data_dir, Split::Test, Some(&train.classes))).transpose()?;
    for note in std::iter::once(&train).chain(&val).filter_map(ImageFolder::skipped_note) {
        eprintln!("{note}");
    }
    pack_split(&train, out, Split::Train, shard_size, seed)?;
    if let Some(val) = &val {
        pack_split(val, out, Split::Test, shard_size, seed)?;
    }
    // Generated photographs stay marked as such in their shards (runs on them say so).
    let marker = data_dir.join(data::GENERATED_MARKER);
    if marker.exists() {
        common::output::write(&out.join(data::GENERATED_MARKER), common::input::read(&marker, 1 << 20, "remove it from the image folder")?)?;
    }
    Ok(())
}

/// Whether `path` (which need not exist yet) is `folder` or inside it, links resolved: its
/// nearest existing ancestor decides.
fn within(path: &Path, folder: &Path) -> bool {
    let Ok(folder) = folder.canonicalize() else { return false };
    let mut existing = path;
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |p: PathBuf, part| p.join(part)).starts_with(&folder);
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
            }
            _ => return false,
        }
    }
}

/// Packs one split, adds it to the index, and says what was written.
fn pack_split(folder: &ImageFolder, out: &Path, split: Split, shard_size: usize, seed: u64) -> anyhow::Result<()> {
    let written = shards::pack(folder, out, split, shard_size, seed)?;
    shards::write_index(out, split, &folder.classes, &written)?;
    let mut bytes = 0;
    for shard in &written {
        let path = out.join(&shard.file);
        bytes += std::fs::metadata(&path).with_context(|| format!("cannot read {}", path.display()))?.len();
    }
    println!(
        "{}: {} samples of {} classes in {} shards, {:.1} MB, in {}",
        split_folder(split),
        folder.len(),
        folder.classes.len(),
        written.len(),
        bytes as f64 / 1e6,
        out.display()
    );
    Ok(())
}
