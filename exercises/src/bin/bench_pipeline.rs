//! Time per training mini-batch of the unpartitioned Transformer against a pipeline of its
//! stages, over numbers of micro-batches, with the measured bubble beside the theory
//! (p−1)/(V·m+p−1) (GPipe's (p−1)/(m+p−1) at one stage per device). On a CPU, each stage gets its share of the cores (`--threads` / stages) and
//! the unpartitioned model all of them, so the comparison is at equal hardware; the
//! unpartitioned model is also timed on one stage's share, which shows what the stages'
//! concurrency buys (ideally × stages × (1 − bubble)).
//!
//!     bench_pipeline --devices cpu,cpu --threads 2 --chunks 1,2,4,8,16
//!     bench_pipeline --devices cpu,cpu --threads 2 --chunks 2,4,8,16 --schedule interleaved --virtual-stages 2
use std::io::Write;
use std::time::Instant;

use clap::Parser;
use common::device;
use common::models::{self, TransformerConfig, TransformerLm};
use common::pipeline::{Partition, Pipeline, PipelineOptions, Placement, Schedule, Stage};
use common::train::TrainStep;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

/// Sequential vs pipelined training steps of a Transformer LM.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// One device per stage.
    #[arg(long, value_delimiter = ',', default_value = "cpu,cpu")]
    devices: Vec<String>,
    /// Micro-batch counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    chunks: Vec<usize>,
    #[arg(long, value_enum, default_value = "gpipe")]
    schedule: Schedule,
    /// Stages per device with --schedule interleaved [default: 2 with interleaved, else 1].
    #[arg(long)]
    virtual_stages: Option<usize>,
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(i64).range(1..))]
    emsize: i64,
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(i64).range(1..))]
    d_hid: i64,
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(i64).range(1..))]
    nhead: i64,
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..))]
    nlayers: i64,
    /// Vocabulary (kept small so that the output layer does not dwarf the layers).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(i64).range(1..))]
    ntoken: i64,
    #[arg(long, default_value_t = 35, value_parser = clap::value_parser!(i64).range(1..))]
    bptt: i64,
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(i64).range(1..))]
    batch_size: i64,
    /// LibTorch threads in all (the stages share them on a CPU); 0 = one per core.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Timed mini-batches per measurement, after one untimed.
    #[arg(long, default_value_t = 4, value_parser = common::cli::between(1, common::cli::MAX_REPEATS))]
    steps: usize,
    /// Measurements alternate sequential / pipelined this many times; medians are reported.
    #[arg(long, default_value_t = 3, value_parser = common::cli::between(1, common::cli::MAX_REPEATS))]
    rounds: usize,
    /// CSV to append the results to.
    #[arg(long, default_value = "results/bench-pipeline.csv")]
    csv: std::path::PathBuf,
}

fn main() -> std::process::ExitCode {
    common::error::run_main(|| bench(&common::cli::parse::<Cli>()))
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn bench(cli: &Cli) -> anyhow::Result<()> {
    let devices: Vec<Device> = cli.devices.iter().map(|d| device::parse_device(d)).collect::<Result<_, _>>()?;
    if let Some(warning) = device::set_threads(cli.threads)? {
        eprintln!("{warning}");
    }
    let threads = tch::get_num_threads() as usize;
    let cfg = TransformerConfig { ntoken: cli.ntoken, d_model: cli.emsize, nhead: cli.nhead, d_hid: cli.d_hid, nlayers: cli.nlayers, dropout: 0.0 };
    let virtual_stages = Placement::virtual_stages(cli.schedule, cli.virtual_stages)?;
    let placement = Placement { devices: devices.len(), virtual_stages };
    placement.check_layers(cfg.nlayers)?;
    let partition = Partition::even(cfg.nlayers, placement.stages())?;
    tch::manual_seed(0);
    let ids = Tensor::randint(cfg.ntoken, [cli.bptt + 1, cli.batch_size], (Kind::Int64, Device::Cpu));
    let (src, targets) = (ids.narrow(0, 0, cli.bptt), ids.narrow(0, 1, cli.bptt));

    let reference_device = devices[0];
    let vs = nn::VarStore::new(reference_device);
    let reference = TransformerLm::new(&vs.root(), &cfg)?;
    let reference_params: Vec<Tensor> = vs.trainable_variables();
    let sequential_step = |threads: usize| {
        // Stage threads set their own share, on their own threads.
        tch::set_num_threads(threads as i32);
        reference_params.iter().for_each(|p| drop(p.grad().f_zero_()));
        let logits = reference.forward_t(&src.to_device(reference_device), true);
        Stage::loss(&logits, &targets.to_device(reference_device)).backward();
        device::synchronize(reference_device);
    };
    // Every micro-batch count checked before the first step is timed.
    for &chunks in &cli.chunks {
        common::pipeline::split_batch(&src, chunks)?;
    }
    let time_steps = |step: &mut dyn FnMut() -> anyhow::Result<f64>| -> anyhow::Result<f64> {
        step()?;
        Ok((0..cli.steps).map(|_| step()).sum::<anyhow::Result<f64>>()? / cli.steps as f64)
    };

    let stage_threads = match devices.iter().all(|d| *d == Device::Cpu) {
        true => Some((threads / devices.len()).max(1)),
        false => None,
    };
    println!(
        "Transformer {} layers, d_model {}, vocabulary {}, {} parameters; batch {} × {} tokens; {} stages on {:?} ({virtual_stages} per device), {} schedule; {} LibTorch threads ({} per device)",
        cfg.nlayers,
        cfg.d_model,
        cfg.ntoken,
        models::param_count(&vs),
        cli.batch_size,
        cli.bptt,
        devices.len(),
        cli.devices,
        cli.schedule.name(),
        threads,
        stage_threads.map_or("all".into(), |n| n.to_string())
    );
    let share = stage_threads.unwrap_or(threads);
    println!(
        "| chunks | sequential ms ({threads} threads) | sequential ms ({share} threads) | pipeline ms | speed-up vs {threads} threads | vs {share} | bubble measured | bubble theory |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let mut rows = Vec::new();
    for &chunks in &cli.chunks {
        let options = PipelineOptions { schedule: cli.schedule, virtual_stages, chunks, checkpoint_activations: false, threads_per_stage: stage_threads };
        let mut pipeline = Pipeline::new(&cfg, &partition, &devices, 0, options)?;
        let params: Vec<Tensor> = pipeline.named_parameters().into_iter().map(|(_, t)| t).collect();
        let (mut sequential, mut one_share, mut piped, mut bubbles) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..cli.rounds {
            for (times, threads) in [(&mut sequential, threads), (&mut one_share, share)] {
                times.push(time_steps(&mut || {
                    let start = Instant::now();
                    sequential_step(threads);
                    Ok(start.elapsed().as_secs_f64())
                })?);
            }
            let mut round_bubbles = Vec::new();
            piped.push(time_steps(&mut || {
                params.iter().for_each(|p| drop(p.grad().f_zero_()));
                let start = Instant::now();
                let report = pipeline.train_step(&src, &targets, 0)?;
                round_bubbles.push(report.bubble_fraction());
                Ok(start.elapsed().as_secs_f64())
            })?);
            bubbles.push(median(round_bubbles));
        }
        let (sequential, one_share, piped, bubble) = (median(sequential), median(one_share), median(piped), median(bubbles));
        let theory = common::pipeline::schedule::theoretical_bubble(devices.len(), chunks, virtual_stages);
        println!(
            "| {chunks} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {:.3} | {:.3} |",
            1e3 * sequential,
            1e3 * one_share,
            1e3 * piped,
            sequential / piped,
            one_share / piped,
            bubble,
            theory
        );
        rows.push(Row { chunks, sequential, one_share, share, piped, bubble, theory });
    }
    write_csv(cli, &devices, threads, &rows)
}

/// One line of the table.
#[derive(Clone, Copy)]
struct Row {
    chunks: usize,
    /// Seconds per mini-batch of the unpartitioned model on all the threads.
    sequential: f64,
    /// The same on one stage's share of the threads.
    one_share: f64,
    share: usize,
    piped: f64,
    bubble: f64,
    theory: f64,
}

fn write_csv(cli: &Cli, devices: &[Device], threads: usize, rows: &[Row]) -> anyhow::Result<()> {
    if let Some(dir) = cli.csv.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let new = !cli.csv.exists();
    let mut file = common::output::append(&cli.csv)?;
    if new {
        writeln!(
            file,
            "devices,schedule,threads,d_model,nlayers,ntoken,batch,bptt,chunks,sequential_s,stage_threads,sequential_stage_threads_s,pipeline_s,speedup,speedup_vs_stage_threads,bubble_measured,bubble_theory,finished_at"
        )?;
    }
    let labels: Vec<String> = devices.iter().map(|&d| device::device_label(d)).collect();
    for row in rows {
        let Row { chunks, sequential, one_share, share, piped, bubble, theory } = *row;
        writeln!(
            file,
            "{},{},{threads},{},{},{},{},{},{chunks},{sequential:.6},{share},{one_share:.6},{piped:.6},{:.3},{:.3},{bubble:.4},{theory:.4},{}",
            labels.join("+"),
            cli.schedule.name(),
            cli.emsize,
            cli.nlayers,
            cli.ntoken,
            cli.batch_size,
            cli.bptt,
            sequential / piped,
            one_share / piped,
            common::report::unix_time()
        )?;
    }
    println!("appended to {}", cli.csv.display());
    Ok(())
}
