//! The DDP "hello world" every participant types first (PyTorch's DDP tutorial, the course's
//! exercise 3 warm-up): a `Linear(10, 10)` on each of two processes, wrapped as DDP wraps it
//! (rank 0's weights broadcast to all), MSE against random targets, SGD at lr 0.01 (the slide's `lr=0.01`), one step.
//! Each rank draws its own data, so the losses differ; the averaged gradients make the
//! parameters after the step the same on every rank, which each rank prints.
//!
//! The tutorial starts its processes with `mp.spawn` and they meet at `MASTER_ADDR`/`MASTER_PORT`;
//! here `--nproc-per-node 2` starts them (through mpirun on the CPU, whose ranks meet through
//! MPI), or a launcher does (`srun`, `mpirun`, or torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR` on
//! GPUs, where NCCL meets at `MASTER_ADDR:MASTER_PORT`).
use clap::Parser;
use common::comm::data_parallel::{broadcast_parameters, GradientAverager};
use common::comm::{launch, Backend, ProcessGroup};
use common::device::{self, DeviceChoice};
use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};

/// DDP's hello world: Linear(10, 10), MSE, SGD, one step on each of N processes.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// Processes (ranks) to start; the tutorial's world_size is 2.
    #[arg(long, default_value_t = 2)]
    nproc_per_node: usize,
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceChoice,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
}

fn main() -> std::process::ExitCode {
    let cli = common::cli::parse::<Cli>();
    common::error::run_main(|| {
        if cli.nproc_per_node == 0 {
            return common::error::usage("--nproc-per-node must be at least 1");
        }
        // The exercises' cap on local ranks, before mpirun starts any (said by the launching
        // process, not by every rank again).
        if let Some(warning) = launch::check_launch(Some(cli.nproc_per_node), cli.device)? {
            eprintln!("{warning}");
        }
        if launch::start_ranks_if_asked(Some(cli.nproc_per_node).filter(|&n| n > 1), launch::StopsAt::Step)? {
            return Ok(());
        }
        ProcessGroup::run(cli.backend, |group| hello(&cli, group))
    })
}

fn hello(cli: &Cli, group: &ProcessGroup) -> anyhow::Result<()> {
    let device = match cli.device {
        DeviceChoice::Cpu => Device::Cpu,
        _ if !device::cuda_available() => return common::error::usage(device::no_cuda_message()),
        _ => group.device(true),
    };
    // model = nn.Linear(10, 10); ddp_model = DDP(model): rank 0's weights on every rank.
    tch::manual_seed(0);
    let vs = nn::VarStore::new(device);
    let model = nn::linear(vs.root() / "net", 10, 10, Default::default());
    broadcast_parameters(group, &vs, 0)?;
    // optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    let mut optimizer = nn::Sgd::default().build(&vs, 1e-2)?;
    // Each rank its own batch: outputs = ddp_model(torch.randn(20, 10)); labels = torch.randn(20, 10).
    tch::manual_seed(1 + group.rank() as i64);
    let inputs = Tensor::randn([20, 10], (Kind::Float, device));
    let labels = Tensor::randn([20, 10], (Kind::Float, device));
    optimizer.zero_grad();
    let loss = model.forward(&inputs).mse_loss(&labels, Reduction::Mean);
    loss.backward();
    // DDP's all-reduce of the gradients during backward, here after it: their average.
    GradientAverager::new(25 << 20, false).average(group, &vs.trainable_variables())?;
    optimizer.step();
    let sum: f64 = tch::no_grad(|| vs.trainable_variables().iter().map(|p| p.sum(Kind::Double).double_value(&[])).sum());
    println!("rank {} of {}: loss {:.6}, the parameters' sum after the step {sum:.9}", group.rank(), group.world_size(), loss.double_value(&[]));
    Ok(())
}
