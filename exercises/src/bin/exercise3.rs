//! Exercise 3: the course's two ways past one GPU.
//!
//! `exercise3 ddp`: VGG19 on CIFAR-10, data-parallel as PyTorch DDP does it: a process group
//! (NCCL for GPU tensors, MPI for CPU tensors), the same seed on every rank, a distributed
//! sampler, `MASTER_ADDR`/`MASTER_PORT` rendezvous when not started by an MPI launcher.
//!
//!     exercise3 ddp --nproc-per-node 2 --device cpu --max-steps 20
//!
//! `exercise3 pipeline`: the course's 1.4B-parameter Transformer language model (12 layers,
//! d_model 4096) cut into stages over several devices and trained with GPipe micro-batches
//! (`--chunks 8`), or the 1F1B schedule.
//!
//!     exercise3 pipeline --devices cuda:0,cuda:1
//!     exercise3 pipeline --devices cpu,cpu --emsize 256 --d-hid 256 --nlayers 4 --max-steps 20
//!
//! `exercise3 pipe`: the slides' `Pipe` example, `Linear(16, 8)` on one device and
//! `Linear(8, 4)` on the next with `chunks = 8`, against naive model parallelism (the whole batch
//! through one device, then the next).
//!
//!     exercise3 pipe --devices cuda:0,cuda:1
//!     exercise3 pipe --sizes 4096,4096,4096 --batch 512 --chunks 8
//!
//! `exercise3 tp`: the same model with every layer cut over the ranks (Megatron-LM's tensor
//! parallelism); `--pp` and `--dp` add pipeline stages and replicas (3D parallelism).
//!
//!     exercise3 tp --nproc-per-node 2 --device cpu --emsize 256 --d-hid 256 --nlayers 2 --max-steps 20
//!
//! `exercise3 profile`: what the layout planner needs to know of this machine: the model's
//! pieces forward and backward at a few micro-batch sizes, the optimizer's step, and the
//! collectives among the ranks (within a host, and between hosts where the job spans several).
//!
//!     exercise3 profile --out h100.json --device cuda --precision bf16-mixed --bptt 512
//!     exercise3 profile --out cpu.json --nproc-per-node 4 --emsize 256 --d-hid 256 --nhead 4
//!
//! `exercise3 plan`: every layout of a job (dp × pp × tp, ZeRO, HSDP, micro-batches, schedule,
//! recomputation, sequence parallelism) ranked by its predicted step time, those that do not
//! fit the memory left out.
//!
//!     exercise3 plan --profile h100.json --nodes 1 --gpus-per-node 8 --memory 80GB --global-batch 64
use clap::{CommandFactory, Parser, Subcommand};
use common::image_classification::{self, ImageArgs};
use common::language_model::{self, PipelineArgs};
use common::presets::{EXERCISE3_DDP, EXERCISE3_PIPELINE, EXERCISE3_TP};
use common::train::sinks::ConsoleLog;
use common::train::{Metric, Observers};

/// Exercise 3: VGG19 data-parallel (DDP style), or the Transformer pipeline- or tensor-parallel.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// VGG19 on CIFAR-10, data-parallel (PyTorch DDP style).
    Ddp {
        #[command(flatten)]
        args: ImageArgs,
    },
    /// The 1.4B-parameter Transformer LM on WikiText-2, pipeline-parallel over several devices.
    Pipeline {
        #[command(flatten)]
        args: PipelineArgs,
    },
    /// The slides' Pipe example (Linear(16, 8), then Linear(8, 4) on the next device, chunks 8) against naive model parallelism.
    Pipe {
        #[command(flatten)]
        args: common::pipeline::sequential::PipeArgs,
    },
    /// The 1.4B-parameter Transformer LM on WikiText-2, tensor-parallel over the ranks (Megatron-LM).
    Tp {
        #[command(flatten)]
        args: PipelineArgs,
    },
    /// Measures this machine for the layout planner: the Transformer's pieces, the optimizer, the collectives.
    Profile {
        #[command(flatten)]
        args: common::plan::ProfileArgs,
    },
    /// Ranks every layout of a job by predicted step time, from a profile; those that do not fit left out.
    Plan {
        #[command(flatten)]
        args: common::plan::PlanArgs,
    },
}

fn main() -> std::process::ExitCode {
    let matches = common::config_file::get_matches(
        Cli::command()
            .mut_subcommand("ddp", |ddp| ddp.after_help(EXERCISE3_DDP.describe()))
            .mut_subcommand("pipeline", |pipeline| pipeline.after_help(EXERCISE3_PIPELINE.describe()))
            .mut_subcommand("tp", |tp| tp.after_help(EXERCISE3_TP.describe())),
    );
    let cli = common::cli::from_matches::<Cli>(&matches);
    let mut listeners = Default::default();
    common::error::run_main(|| match &cli.command {
        Command::Ddp { args } => image_classification::run(&EXERCISE3_DDP, args, &mut listeners).map(drop),
        Command::Pipeline { args } => language_model::run_pipeline(&EXERCISE3_PIPELINE, args, &mut listeners).map(drop),
        Command::Pipe { args } => common::pipeline::sequential::compare(args).map(|comparison| println!("{}", comparison.describe())),
        Command::Tp { args } => language_model::run_pipeline(&EXERCISE3_TP, args, &mut listeners).map(drop),
        Command::Profile { args } => profile(args),
        Command::Plan { args } => plan(args),
    })
}

fn profile(args: &common::plan::ProfileArgs) -> anyhow::Result<()> {
    if let Some(warning) = common::comm::launch::check_launch(args.nproc_per_node, args.device)? {
        eprintln!("{warning}");
    }
    if common::comm::launch::start_ranks_if_asked(args.nproc_per_node, common::comm::launch::StopsAt::Step)? {
        return Ok(());
    }
    // The warnings on the way (`--threads` beyond the cores) on every rank's stderr.
    let mut console = Observers::new().with(ConsoleLog::new(Metric::Perplexity, EXERCISE3_PIPELINE.script));
    common::comm::ProcessGroup::run(args.backend, |world| {
        if let Some(profile) = common::plan::measure(args, world, &mut console)? {
            println!("{}\nwritten to {}", profile.describe(), args.out.display());
        }
        Ok(())
    })
}

fn plan(args: &common::plan::PlanArgs) -> anyhow::Result<()> {
    let plan = common::plan::plan(args)?;
    if args.json {
        println!("{}", plan.to_json()?);
    } else {
        println!("{}", plan.describe(args.top));
    }
    Ok(())
}
