//! The input pipeline alone, for `make bench-data` (bench/data.sh): images per second from image
//! files to normalised float batches on the CPU (read, decode, the ImageNet transform, batch),
//! the loader the exercises use, nothing trained. bench/data_loader.py measures torchvision's
//! `DataLoader(ImageFolder)` the same way.
use clap::Parser;
use common::data::image_files::{ImageFileLoader, ImageFiles};
use common::data::image_folder::ImageFolder;
use common::data::shards::ShardSet;
use common::data::transforms::Transform;
use common::data::{LoaderConfig, Split};
use common::train::BatchSource;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tch::Device;

#[derive(Parser)]
#[command(about = "Images per second of the image-file loader alone (decode + transform + batch), as JSON")]
struct Cli {
    /// An image folder (train/<class>/...), or a shard set with --shards.
    #[arg(long)]
    data_dir: PathBuf,
    #[arg(long)]
    shards: bool,
    /// Loader threads (0: decode on the main thread).
    #[arg(long, default_value_t = 1, value_parser = common::cli::between(0, common::data::workers::MAX_WORKERS))]
    workers: usize,
    #[arg(long, default_value_t = 64, value_parser = common::cli::count)]
    batch_size: usize,
    /// Batches timed, after --warmup batches that are not.
    #[arg(long, default_value_t = 20, value_parser = common::cli::between(1, common::cli::MAX_REPEATS))]
    batches: usize,
    #[arg(long, default_value_t = 2, value_parser = common::cli::between(0, common::cli::MAX_REPEATS))]
    warmup: usize,
    /// `train`: RandomResizedCrop(224) + flip; `eval`: Resize(256) + CenterCrop(224).
    #[arg(long, default_value = "train")]
    transform: String,
    /// Also write the first batch of the eval transform, in the folder's order, as raw
    /// little-endian float32 `[B, 3, 224, 224]` to this file (for bench/data_loader.py --compare).
    #[arg(long)]
    dump: Option<PathBuf>,
}

/// CPU time this process has used, all its threads (user + system, from /proc/self/stat): what
/// "per core" compares, whatever the threads and processes each loader runs.
fn cpu_seconds() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The fields after the command name (which is in parentheses and may hold spaces).
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks: f64 =
        fields.get(11..13).ok_or_else(|| anyhow::anyhow!("/proc/self/stat: no utime and stime"))?.iter().map(|f| f.parse::<f64>().unwrap_or(0.0)).sum();
    Ok(ticks / 100.0)
}

fn main() -> std::process::ExitCode {
    let cli = common::cli::parse::<Cli>();
    common::error::run_main(|| {
        // As the exercises run (experiment::run): freed batches stay with the process.
        common::device::keep_freed_host_memory();
        let train = match cli.transform.as_str() {
            "train" => true,
            "eval" => false,
            other => return common::error::usage(format!("--transform {other}: train or eval")),
        };
        let files = match cli.shards {
            true => ImageFiles::Shards(Arc::new(ShardSet::open(&cli.data_dir, Split::Train)?)),
            false => ImageFiles::Folder(Arc::new(ImageFolder::scan_split(&cli.data_dir, Split::Train, None)?)),
        };
        let config = LoaderConfig { workers: cli.workers, prefetch: 2, ..LoaderConfig::train(cli.batch_size, 0, Device::Cpu) };
        if let Some(path) = &cli.dump {
            let ordered = ImageFileLoader::new(files.clone(), Transform::imagenet(224, false), LoaderConfig { shuffle: false, ..config.clone() });
            let batch = ordered.epoch(0).next().ok_or_else(|| anyhow::anyhow!("no image"))??;
            let values = Vec::<f32>::try_from(batch.inputs.flatten(0, -1))?;
            common::output::write(path, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        }
        let loader = ImageFileLoader::new(files, Transform::imagenet(224, train), config).with_shuffle_buffer(1000);
        let needed = cli.warmup + cli.batches;
        if loader.batches_per_epoch() < needed {
            return common::error::usage(format!(
                "{} images make {} batches of {}: fewer than --warmup + --batches",
                loader.samples_per_epoch(),
                loader.batches_per_epoch(),
                cli.batch_size
            ));
        }
        let mut batches = loader.epoch(0);
        for batch in batches.by_ref().take(cli.warmup) {
            batch?;
        }
        let (started, cpu_started) = (Instant::now(), cpu_seconds()?);
        let mut images = 0;
        for batch in batches.by_ref().take(cli.batches) {
            images += batch?.len();
        }
        let (seconds, cpu) = (started.elapsed().as_secs_f64(), cpu_seconds()? - cpu_started);
        let rate = images as f64 / seconds;
        println!(
            r#"{{"loader": "rust", "workers": {}, "images": {images}, "seconds": {seconds:.4}, "images_per_s": {rate:.2}, "cpu_seconds": {cpu:.3}}}"#,
            cli.workers
        );
        Ok(())
    })
}
