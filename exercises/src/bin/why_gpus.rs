//! The course's "why GPUs" demonstration: scalar multiplications one at a time against one
//! matrix multiplication of growing size, on the CPU and the GPU (`common::why_gpus`), as a table,
//! `<results-dir>/why_gpus.csv` and the slide's two plots, `<results-dir>/why_gpus.svg`.
use clap::Parser;
use common::device::{self, DeviceChoice};
use common::why_gpus;

/// Why GPUs: scalar vs matrix multiplication, CPU vs GPU, over growing sizes.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// Where to measure; `both` is the CPU, then the GPU when there is one.
    #[arg(long, value_enum, default_value = "both")]
    device: DeviceChoice,
    /// The most scalar multiplications timed (10, 100, … up to this).
    #[arg(long, default_value_t = 100_000)]
    max_scalars: usize,
    /// The largest matrix side (64, 128, … up to this).
    #[arg(long, default_value_t = 4096)]
    max_side: usize,
    /// Timed repetitions of each size (the best is kept), after one untimed.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long, default_value = "results")]
    results_dir: std::path::PathBuf,
}

/// The most scalar multiplications and repeats a run times.
const MAX_SCALARS: usize = 100_000_000;
const MAX_REPEATS: usize = 1000;

fn main() -> std::process::ExitCode {
    let cli = common::cli::parse::<Cli>();
    common::error::run_main(|| {
        let (scalars, sides) = why_gpus::sizes(cli.max_scalars, cli.max_side);
        if scalars.is_empty() || sides.is_empty() {
            return common::error::usage("--max-scalars must be at least 10 and --max-side at least 64");
        }
        // Each scalar is a kernel launch of its own (microseconds): beyond these the run takes hours.
        if cli.max_scalars > MAX_SCALARS || !(1..=MAX_REPEATS).contains(&cli.repeats) {
            return common::error::usage(format!("--max-scalars may be at most {MAX_SCALARS} and --repeats 1 to {MAX_REPEATS}: beyond, the run takes hours"));
        }
        // The largest matrix and its product, in float32.
        let side = *sides.last().unwrap() as f64;
        common::resources::refuse_beyond_memory(&format!("--max-side {}", cli.max_side), 2.0 * side * side * 4.0, "lower --max-side")?;
        let devices = device::devices_for(cli.device)?;
        if devices.len() == 1 && cli.device == DeviceChoice::Both {
            println!("no GPU here (LibTorch {} sees none): the CPU alone is measured", common::torch_version());
        }
        let mut timings = Vec::new();
        for d in devices {
            timings.extend(why_gpus::measure(d, &scalars, &sides, cli.repeats)?);
        }
        print!("{}", why_gpus::table(&timings));
        std::fs::create_dir_all(&cli.results_dir)?;
        let mut csv = String::from("work,size,device,seconds\n");
        for t in &timings {
            csv.push_str(&format!("{},{},{},{}\n", t.work.name(), t.size, t.device, t.seconds));
        }
        common::output::write(&cli.results_dir.join("why_gpus.csv"), csv)?;
        let chart = cli.results_dir.join("why_gpus.svg");
        why_gpus::chart(&timings, &chart)?;
        println!("wrote {} and {}", cli.results_dir.join("why_gpus.csv").display(), chart.display());
        Ok(())
    })
}
