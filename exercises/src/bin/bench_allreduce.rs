//! All-reduce time and bandwidth over message sizes, on the engine the exercises use (MPI for
//! CPU tensors, NCCL for CUDA tensors), reported as nccl-tests does:
//! algbw = size / time, busbw = algbw × 2(n−1)/n.
//!
//!     bench_allreduce --nproc-per-node 2 --device cpu
use clap::Parser;
use common::comm::launch;
use common::comm::{Backend, ProcessGroup, ReduceOp};
use common::device::{self, DeviceChoice};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// All-reduce bandwidth over message sizes (4 KB … 256 MB by default).
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// Start N local ranks through mpirun.
    #[arg(long)]
    nproc_per_node: Option<usize>,
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceChoice,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// Smallest message, bytes.
    #[arg(long, default_value_t = 4 << 10)]
    min_bytes: usize,
    /// Largest message, bytes.
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Timed repetitions per size (after 2 untimed ones).
    #[arg(long, default_value_t = 10, value_parser = common::cli::between(1, common::cli::MAX_REPEATS))]
    iters: usize,
    /// CSV to append the results to.
    #[arg(long, default_value = "results/bench-allreduce.csv")]
    csv: std::path::PathBuf,
}

fn main() -> std::process::ExitCode {
    let cli = common::cli::parse::<Cli>();
    common::error::run_main(|| {
        if let Some(warning) = launch::check_launch(cli.nproc_per_node, cli.device)? {
            eprintln!("{warning}");
        }
        if launch::start_ranks_if_asked(cli.nproc_per_node, launch::StopsAt::Step)? {
            return Ok(());
        }
        ProcessGroup::run(cli.backend, |group| bench(&cli, group))
    })
}

fn bench(cli: &Cli, group: &ProcessGroup) -> anyhow::Result<()> {
    let device = match cli.device {
        DeviceChoice::Cpu => Device::Cpu,
        _ if !device::cuda_available() => return common::error::usage(device::no_cuda_message()),
        _ => group.device(true),
    };
    let n = group.world_size() as f64;
    let mut rows = Vec::new();
    let mut bytes = cli.min_bytes.max(4);
    if group.is_root() {
        println!("all-reduce (sum, f32), {} ranks, {}: {}", group.world_size(), device::device_name(device), group.describe());
        println!("| size | time (us) | algbw (GB/s) | busbw (GB/s) |\n|---:|---:|---:|---:|");
    }
    while bytes <= cli.max_bytes {
        let mut tensor = Tensor::ones([(bytes / 4) as i64], (Kind::Float, device));
        for _ in 0..2 {
            group.all_reduce(&mut tensor, ReduceOp::Sum)?;
        }
        // Every rank holds the sum of all ranks' ones, summed again: world². The timed repeats
        // then sum zeros, which stay zero however many there are (ones would overflow float32
        // after about 128 of them on two ranks).
        let summed = tensor.double_value(&[0]);
        anyhow::ensure!((summed - n * n).abs() <= 1e-3 * n * n, "all-reduce gave a wrong result: {summed} where {} was due", n * n);
        let _ = tensor.zero_();
        group.barrier()?;
        let start = Instant::now();
        for _ in 0..cli.iters {
            group.all_reduce(&mut tensor, ReduceOp::Sum)?;
        }
        device::synchronize(device);
        let seconds = start.elapsed().as_secs_f64() / cli.iters as f64;
        let summed = tensor.abs().max().double_value(&[]);
        anyhow::ensure!(summed == 0.0, "all-reduce gave a wrong result: {summed} where zeros summed");
        let algbw = bytes as f64 / seconds / 1e9;
        let busbw = algbw * 2.0 * (n - 1.0) / n;
        if group.is_root() {
            println!("| {} | {:.1} | {:.3} | {:.3} |", human(bytes), seconds * 1e6, algbw, busbw);
        }
        rows.push((bytes, seconds, algbw, busbw));
        bytes *= 4;
    }
    if group.is_root() {
        write_csv(cli, group.world_size(), device, &rows)?;
    }
    Ok(())
}

fn write_csv(cli: &Cli, world: usize, device: Device, rows: &[(usize, f64, f64, f64)]) -> anyhow::Result<()> {
    if let Some(dir) = cli.csv.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let new = !cli.csv.exists();
    let mut out = csv::Writer::from_writer(common::output::append(&cli.csv)?);
    if new {
        out.write_record(["finished_at", "device", "ranks", "bytes", "time_s", "algbw_gb_s", "busbw_gb_s"])?;
    }
    let now = common::report::unix_time().to_string();
    for (bytes, seconds, algbw, busbw) in rows {
        out.write_record([
            now.clone(),
            device::device_name(device).to_string(),
            world.to_string(),
            bytes.to_string(),
            format!("{seconds:.9}"),
            format!("{algbw:.4}"),
            format!("{busbw:.4}"),
        ])?;
    }
    out.flush()?;
    println!("appended to {}", cli.csv.display());
    Ok(())
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MB", b >> 20),
        b if b >= 1 << 10 => format!("{} KB", b >> 10),
        b => format!("{b} B"),
    }
}
