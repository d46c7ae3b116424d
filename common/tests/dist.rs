//! `common::comm`: the launch environment (pure parsing), the single-process group, and,
//! on two real MPI ranks, the collectives, point-to-point messages, the data-parallel helpers,
//! `--nproc-per-node` relaunching and what happens when a rank fails; on four, sub-groups;
//! and the layout planner's one measurement that needs ranks to agree (the cores' sharing).
//!
//! The two-rank tests start this very test binary under `mpirun -np 2 <this binary> --exact
//! rank_entry`, with `TEST_SCENARIO` naming what the ranks do; `rank_entry` does nothing when
//! the variable is absent (a plain `cargo test`). Every scenario ends with a line
//! `scenario <name> passed on rank <r>`, which the launching test looks for on both ranks, so a
//! rank that silently did nothing cannot pass.
mod support;

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;

use std::time::{Duration, Instant};

use support::ranks::{launch, Run, SCENARIO, SHARED_DIR};

use common::comm::data_parallel::{broadcast_optimizer_state, broadcast_parameters, metric_average, GradientAverager};
use common::comm::launch::{args_without_nproc, relaunch_with_mpirun};
use common::comm::{Backend, LaunchEnv, LaunchSource, ProcessGroup, ReduceOp};
use common::error::{exit_code, UsageError};
use common::optim::{Adam, AdamConfig, Optimizer, Sgd, SgdConfig};
use common::parallel::DistributedOptimizer;
use tch::nn::Module;
use tch::{nn, Device, Kind, Tensor};

// ---------------------------------------------------------------------------------------------
// Launch environment: pure parsing of the variables.

fn env_of(vars: &[(&str, &str)]) -> anyhow::Result<LaunchEnv> {
    let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    LaunchEnv::from_vars(|name| vars.get(name).cloned())
}

/// The error of `vars`, checked to be a usage error (exit code 2) mentioning every word.
fn usage_error(vars: &[(&str, &str)], words: &[&str]) {
    let err = env_of(vars).expect_err("inconsistent variables must be refused");
    let message = format!("{err:#}");
    assert_eq!(exit_code(&err), 2, "a launch mistake is a usage error: {message}");
    for word in words {
        assert!(message.contains(word), "`{message}` should mention {word}");
    }
}

#[test]
fn no_launcher_is_one_process() {
    let env = env_of(&[("PATH", "/bin")]).unwrap();
    assert_eq!(env, LaunchEnv::single());
    assert!(!env.is_distributed());
}

#[test]
fn openmpi_variables() {
    let env = env_of(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "8"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")])
        .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.nnodes), (3, 8, 1, 2, 4));
    assert_eq!(env.source, LaunchSource::Mpi);
    assert!(env.mpi);
}

#[test]
fn hydra_variables() {
    let env = env_of(&[("PMI_RANK", "1"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "4")]).unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.nnodes), (1, 4, 1, 4, 1));
    assert_eq!(env.source, LaunchSource::Mpi);
}

#[test]
fn srun_pmi2_takes_local_numbers_from_slurm() {
    let env = env_of(&[
        ("PMI_RANK", "5"),
        ("PMI_SIZE", "6"),
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "6"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NNODES", "2"),
        ("SLURM_TASKS_PER_NODE", "3(x2)"),
        ("SLURM_NODEID", "1"),
    ])
    .unwrap();
    assert_eq!((env.rank, env.local_rank, env.local_world_size), (5, 2, 3));
    assert_eq!(env.source, LaunchSource::Mpi);
}

#[test]
fn slurm_variables() {
    let env = env_of(&[
        ("SLURM_PROCID", "4"),
        ("SLURM_NTASKS", "6"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NNODES", "2"),
        ("SLURM_TASKS_PER_NODE", "3(x2)"),
        ("SLURM_NODEID", "1"),
    ])
    .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.nnodes), (4, 6, 1, 3, 2));
    assert_eq!(env.source, LaunchSource::Slurm);
    assert!(!env.mpi, "a plain srun does not start an MPI world");

    let with_pmix = env_of(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_NTASKS_PER_NODE", "2"), ("PMIX_RANK", "0")]).unwrap();
    assert_eq!(with_pmix.local_world_size, 2);
    assert!(with_pmix.mpi, "srun --mpi=pmix does");

    // A job script's own variables (an allocation, no srun task) are one process.
    assert_eq!(env_of(&[("SLURM_NTASKS", "4"), ("SLURM_NNODES", "1")]).unwrap(), LaunchEnv::single());
}

#[test]
fn torchrun_variables() {
    let env =
        env_of(&[("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4"), ("MASTER_ADDR", "node01"), ("MASTER_PORT", "29500")])
            .unwrap();
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size, env.nnodes), (5, 8, 1, 4, 2));
    assert_eq!(env.source, LaunchSource::Torchrun);
    assert_eq!(env.master, Some(("node01".to_string(), 29500)));
    assert!(!env.mpi);
}

#[test]
fn mpi_launcher_wins_over_slurm_and_torchrun() {
    let env = env_of(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
    ])
    .unwrap();
    assert_eq!((env.rank, env.world_size, env.source), (1, 2, LaunchSource::Mpi));
    let env = env_of(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap();
    assert_eq!(env.source, LaunchSource::Slurm);
}

#[test]
fn inconsistent_variables_are_usage_errors_naming_them() {
    usage_error(&[("RANK", "2"), ("WORLD_SIZE", "2")], &["RANK=2", "WORLD_SIZE=2"]);
    usage_error(&[("WORLD_SIZE", "2")], &["WORLD_SIZE", "RANK"]);
    usage_error(&[("RANK", "0")], &["RANK", "WORLD_SIZE"]);
    usage_error(&[("RANK", "0"), ("WORLD_SIZE", "0")], &["WORLD_SIZE=0"]);
    usage_error(&[("RANK", "x"), ("WORLD_SIZE", "2")], &["RANK=x"]);
    usage_error(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")], &["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]);
    usage_error(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "2")], &["OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2"]);
    usage_error(
        &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_LOCAL_RANK", "3"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "2")],
        &["OMPI_COMM_WORLD_LOCAL_RANK=3", "OMPI_COMM_WORLD_LOCAL_SIZE=2"],
    );
    usage_error(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")], &["PMI_RANK=4", "PMI_SIZE=4"]);
    usage_error(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"), ("WORLD_SIZE", "4")], &["WORLD_SIZE=4", "2"]);
    usage_error(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "2")], &["SLURM_PROCID=3", "SLURM_NTASKS=2"]);
    usage_error(
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "2"), ("SLURM_NTASKS_PER_NODE", "2")],
        &["SLURM_LOCALID=2", "SLURM_NTASKS_PER_NODE=2"],
    );
    usage_error(&[("MASTER_ADDR", "node01"), ("MASTER_PORT", "http")], &["MASTER_PORT=http"]);
}

#[test]
fn nproc_per_node_is_taken_out_of_the_relaunched_arguments() {
    let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
    assert_eq!(args_without_nproc(&args(&["--epochs", "2", "--nproc-per-node", "2", "--device", "cpu"])), args(&["--epochs", "2", "--device", "cpu"]));
    assert_eq!(args_without_nproc(&args(&["--nproc-per-node=4", "--quiet"])), args(&["--quiet"]));
    assert_eq!(args_without_nproc(&args(&["--quiet", "--nproc-per-node"])), args(&["--quiet"]));
    // After `--`, everything is the program's positional input.
    assert_eq!(args_without_nproc(&args(&["-x", "--", "--nproc-per-node", "2"])), args(&["-x", "--", "--nproc-per-node", "2"]));
}

// ---------------------------------------------------------------------------------------------
// The group, without MPI.

#[test]
fn a_single_process_group_has_identity_collectives() {
    let group = ProcessGroup::single();
    assert_eq!((group.rank(), group.world_size(), group.is_root()), (0, 1, true));
    let mut t = Tensor::from_slice(&[1.5f32, -2.0]);
    group.all_reduce(&mut t, ReduceOp::Average).unwrap();
    group.broadcast(&mut t, 0).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.5, -2.0]);
    let gathered = group.all_gather(&t).unwrap();
    let _ = t.fill_(0.0);
    assert_eq!(Vec::<f32>::try_from(&gathered[0]).unwrap(), [1.5, -2.0], "all_gather returns a copy");
    // The argument checks of the real engines, so mistakes show without a second rank.
    assert!(group.all_reduce(&mut Tensor::from_slice(&[1i64]), ReduceOp::Average).is_err());
    assert!(group.broadcast(&mut t, 1).is_err());
    group.barrier().unwrap();
    assert_eq!(metric_average(&group, 0.25).unwrap(), 0.25);
    assert_eq!(group.device(false), Device::Cpu);
}

#[test]
fn a_single_process_group_has_no_peer_and_splits_into_itself() {
    let group = ProcessGroup::single();
    let mut t = Tensor::from_slice(&[1.5f32, -2.0]);
    let err = group.send(&t, 0).unwrap_err();
    assert!(format!("{err}").contains("no peer"), "{err}");
    let err = group.recv(&mut t, 0).unwrap_err();
    assert!(format!("{err}").contains("no peer"), "{err}");
    group.wait_sends().unwrap();

    let sub = group.split(7, 3).unwrap();
    assert_eq!((sub.rank(), sub.world_size(), sub.is_root()), (0, 1, true));
    sub.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.5, -2.0]);
    assert!(sub.send(&t, 0).is_err());
    drop(sub);
    group.barrier().unwrap();
}

#[test]
fn a_multi_rank_job_without_an_engine_is_refused_before_any_collective() {
    if tch::Cuda::is_available() {
        return; // with a GPU, torchrun ranks would meet through NCCL instead
    }
    let torchrun = env_of(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")]).unwrap();
    let err = ProcessGroup::init_with(Backend::Auto, torchrun.clone()).err().expect("no engine for CPU tensors");
    assert_eq!(exit_code(&err), 2);
    assert!(format!("{err}").contains("need collectives for CPU tensors"), "{err}");
    let err = ProcessGroup::init_with(Backend::Mpi, torchrun).err().expect("MPI cannot join torchrun's ranks");
    assert!(format!("{err}").contains("--backend mpi needs"), "{err}");
    let err = ProcessGroup::init_with(Backend::Nccl, LaunchEnv::single()).err().expect("NCCL needs a GPU");
    assert!(err.is::<UsageError>() && format!("{err}").contains("--backend nccl"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Two ranks under mpirun.

/// The ranks' entry point (see the module docs).
#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    tch::set_num_threads(1); // two ranks share the machine's cores
    let rank = match scenario.as_str() {
        "collectives" => collectives(),
        "data_parallel" => data_parallel(),
        "rank_dies" => rank_dies(),
        "rank_errors" => rank_errors(),
        "relaunch" => relaunch(),
        "no_launcher" => no_launcher(),
        "mpi_singleton" => mpi_singleton(),
        "p2p" => p2p(),
        "split" => split(),
        "shards" => shards(),
        "sharing" => sharing(),
        other => panic!("unknown scenario {other}"),
    };
    println!("scenario {scenario} passed on rank {rank}");
}

fn two_ranks(scenario: &str) -> Run {
    launch(Some(2), scenario, &[], Duration::from_secs(60))
}

/// Rank-dependent values everywhere, each result checked on every rank.
fn collectives() -> usize {
    let group = ProcessGroup::init(Backend::Auto).unwrap();
    assert_eq!(group.world_size(), 2);
    assert_eq!(group.env().source, LaunchSource::Mpi);
    assert_eq!(group.backend_for(Device::Cpu).unwrap().name(), "mpi");
    let rank = group.rank();
    let r = rank as f64;

    // all_reduce: sum and average, several kinds.
    let mut t = Tensor::from_slice(&[1.0 + r, 10.0 * (r + 1.0)]).to_kind(Kind::Float);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [3.0, 30.0]);
    let mut t = Tensor::from_slice(&[1.0 + 2.0 * r, -r]);
    group.all_reduce(&mut t, ReduceOp::Average).unwrap();
    assert_eq!(t.kind(), Kind::Double);
    assert_eq!(Vec::<f64>::try_from(&t).unwrap(), [2.0, -0.5]);
    let mut t = Tensor::from_slice(&[1i64 << (40 + rank), 7]);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<i64>::try_from(&t).unwrap(), [3 << 40, 14]);
    let mut t = Tensor::from_slice(&[rank as i32 + 1]);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<i32>::try_from(&t).unwrap(), [3]);
    let mut t = Tensor::from_slice(&[100u8 + rank as u8]);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<u8>::try_from(&t).unwrap(), [201]);
    // A float32 average stays float32, divided in float32.
    let mut t = Tensor::from_slice(&[0.1f32 * (r as f32 + 1.0)]);
    group.all_reduce(&mut t, ReduceOp::Average).unwrap();
    assert_eq!(t.kind(), Kind::Float);
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [(0.1f32 + 0.2f32) / 2.0]);

    // Refused before any message is sent (so every rank refuses alike and nothing hangs).
    let err = group.all_reduce(&mut Tensor::from_slice(&[1i64]), ReduceOp::Average).unwrap_err();
    assert!(format!("{err}").contains("floating-point"), "{err}");
    let err = group.all_reduce(&mut Tensor::ones([2], (Kind::Half, Device::Cpu)), ReduceOp::Sum).unwrap_err();
    assert!(format!("{err}").contains("Half"), "{err}");
    let err = group.broadcast(&mut Tensor::from(1.0), 2).unwrap_err();
    assert!(format!("{err}").contains("rank 2"), "{err}");

    // The caller's tensor is updated in place even when it is a non-contiguous view.
    let base = Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]) * (r + 1.0);
    let mut view = base.tr();
    assert!(!view.is_contiguous());
    group.all_reduce(&mut view, ReduceOp::Sum).unwrap();
    let expected = Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]) * 3.0;
    assert!(base.equal(&expected), "the view's storage holds the sum: {base}");
    let mut view = base.select(1, 1); // stride 3
    let _ = view.fill_(r);
    group.broadcast(&mut view, 1).unwrap();
    assert_eq!(Vec::<f32>::try_from(&base.select(1, 1)).unwrap(), [1.0, 1.0]);

    // A parameter (a leaf that requires grad) can be written by a collective.
    let mut param = Tensor::from_slice(&[r as f32]).set_requires_grad(true);
    group.broadcast(&mut param, 1).unwrap();
    assert_eq!(param.double_value(&[0]), 1.0);
    assert!(param.requires_grad());

    // broadcast from rank 1, several shapes and kinds.
    let mut t = Tensor::full([2, 2], 10 * rank as i64, (Kind::Int64, Device::Cpu));
    group.broadcast(&mut t, 1).unwrap();
    assert!(t.equal(&Tensor::full([2, 2], 10, (Kind::Int64, Device::Cpu))));
    let bytes = group.broadcast_bytes(if rank == 1 { b"from one" } else { b"" }, 1).unwrap();
    assert_eq!(bytes, b"from one");

    // all_gather in rank order, as copies.
    let mine = Tensor::from_slice(&[10.0 * r, 10.0 * r + 1.0]).reshape([1, 2]);
    let gathered = group.all_gather(&mine).unwrap();
    assert_eq!(gathered.len(), 2);
    for (i, t) in gathered.iter().enumerate() {
        assert_eq!(t.size(), [1, 2]);
        assert_eq!(Vec::<f64>::try_from(&t.reshape([-1])).unwrap(), [10.0 * i as f64, 10.0 * i as f64 + 1.0]);
    }

    // barrier: rank 1 writes a file late; rank 0 must see it once the barrier returns.
    let marker = PathBuf::from(std::env::var(SHARED_DIR).unwrap()).join("late-marker");
    if rank == 1 {
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&marker, "here").unwrap();
    }
    group.barrier().unwrap();
    assert!(marker.exists(), "rank {rank} left the barrier before rank 1 entered it");

    assert_eq!(metric_average(&group, r).unwrap(), 0.5);
    rank
}

/// Each rank's gradient of each parameter: distinct per rank, parameter and element.
fn make_grads(params: &[Tensor], rank: usize) {
    for (i, p) in params.iter().enumerate() {
        if i == 2 {
            continue; // a parameter that gets no gradient
        }
        let weights = Tensor::randn(p.size(), (p.kind(), Device::Cpu)) * (rank as f64 + 1.0) + i as f64;
        (p * weights).sum(p.kind()).backward();
    }
}

/// Every tensor on every rank, bitwise equal to rank 0's (all_gather, then compare).
fn assert_same_on_all_ranks(group: &ProcessGroup, tensors: &[(String, Tensor)]) {
    for (name, t) in tensors {
        let gathered = group.all_gather(&t.detach()).unwrap();
        assert!(gathered[1].equal(&gathered[0]), "`{name}` differs between the ranks");
    }
}

fn data_parallel() -> usize {
    let group = ProcessGroup::init(Backend::Auto).unwrap();
    let rank = group.rank();
    tch::manual_seed(1000 + rank as i64); // different data and initial weights on each rank

    // --- GradientAverager: tiny buckets and one large bucket give the mean of the ranks' grads.
    let shapes: [&[i64]; 5] = [&[3, 4], &[4], &[2, 2], &[5, 1, 2], &[7]];
    let mut averaged = Vec::new();
    for bucket_bytes in [64, 1 << 30] {
        tch::manual_seed(1 + rank as i64);
        let params: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            // One float64 parameter: it must travel in a bucket of its own kind.
            .map(|(i, s)| Tensor::randn(*s, (if i == 3 { Kind::Double } else { Kind::Float }, Device::Cpu)).set_requires_grad(true))
            .collect();
        make_grads(&params, rank);
        let before: Vec<Tensor> = params.iter().map(|p| p.grad()).map(|g| if g.defined() { g.copy() } else { g }).collect();
        GradientAverager::new(bucket_bytes, false).average(&group, &params).unwrap();
        for (i, (p, mine)) in params.iter().zip(&before).enumerate() {
            if i == 2 {
                assert!(!p.grad().defined(), "a parameter without gradient keeps none");
                continue;
            }
            let all = group.all_gather(mine).unwrap();
            let mean = (&all[0] + &all[1]) / 2.0;
            assert!(p.grad().allclose(&mean, 1e-6, 1e-6, false), "bucket {bucket_bytes}: grad {i} is not the mean");
            assert_eq!(p.grad().kind(), mine.kind());
        }
        averaged.push(params.iter().map(|p| p.grad()).collect::<Vec<_>>());
    }
    for (small, large) in averaged[0].iter().zip(&averaged[1]) {
        assert_eq!(small.defined(), large.defined());
        if small.defined() {
            assert!(small.equal(large), "bucket sizes must not change the averaged gradients");
        }
    }
    let params = [Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true)];
    make_grads(&params, rank);
    let err = GradientAverager::new(1 << 20, true).average(&group, &params).unwrap_err();
    assert!(format!("{err}").contains("--fp16-allreduce needs NCCL"), "{err}");
    assert_eq!(exit_code(&err), 2);

    // --- broadcast_parameters: every variable, buffers included, becomes rank 0's.
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq().add(nn::linear(&root / "fc1", 4, 8, Default::default())).add(nn::linear(&root / "fc2", 8, 2, Default::default()));
    let _running_mean = root.zeros_no_train("running_mean", &[8]).fill_(rank as f64);
    let vars = || {
        let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let fc1_before = group.all_gather(&vs.variables()["fc1.weight"].detach()).unwrap();
    assert!(!fc1_before[0].equal(&fc1_before[1]), "the ranks start from different weights");
    broadcast_parameters(&group, &vs, 0).unwrap();
    assert_same_on_all_ranks(&group, &vars());
    assert_eq!(vs.variables()["running_mean"].double_value(&[0]), 0.0);

    // --- broadcast_optimizer_state: rank 0 has trained (Adam state), rank 1 has not.
    let mut opt = Adam::new(vs.trainable_variables().into_iter().enumerate().map(|(i, t)| (format!("p{i}"), t)).collect(), AdamConfig::default());
    let step = |opt: &mut Adam, seed: i64| {
        tch::manual_seed(seed);
        let x = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        opt.zero_grad();
        net.forward(&x).square().mean(Kind::Float).backward();
        opt.step().unwrap();
    };
    if rank == 0 {
        step(&mut opt, 7);
        step(&mut opt, 8);
    }
    broadcast_parameters(&group, &vs, 0).unwrap();
    broadcast_optimizer_state(&group, &mut opt, 0).unwrap();
    let state = opt.state_tensors();
    assert_eq!(state.len(), 3 * vs.trainable_variables().len(), "rank {rank} has Adam's full state");
    assert_same_on_all_ranks(&group, &state);
    // The same step from the same state and data: the replicas stay bit-identical.
    step(&mut opt, 9);
    assert_same_on_all_ranks(&group, &vars());
    assert_same_on_all_ranks(&group, &opt.state_tensors());

    // --- DistributedOptimizer (Horovod): a step on each rank's own data is a local SGD step on
    // the ranks' mean gradient, identical everywhere.
    let params = vs.trainable_variables();
    let named = params.iter().enumerate().map(|(i, t)| (format!("p{i}"), t.shallow_clone())).collect();
    let lr = 0.1;
    let sgd = Sgd::new(named, SgdConfig { lr, momentum: 0.0, ..SgdConfig::default() });
    let mut dist = DistributedOptimizer::new(Box::new(sgd), vs.trainable_variables(), &group, GradientAverager::new(1 << 20, false));
    assert_eq!((dist.name(), dist.lr()), ("sgd", lr), "the wrapper reports the wrapped optimizer");
    let backward_on_own_data = |dist: &mut DistributedOptimizer, seed: i64| {
        dist.zero_grad();
        tch::manual_seed(seed + rank as i64);
        let x = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        net.forward(&x).square().mean(Kind::Float).backward();
    };
    backward_on_own_data(&mut dist, 20);
    let expected: Vec<Tensor> = params
        .iter()
        .map(|p| {
            let all = group.all_gather(&p.grad()).unwrap();
            p.detach().copy() - (&all[0] + &all[1]) / 2.0 * lr
        })
        .collect();
    assert!(
        !group.all_gather(&params[0].grad()).unwrap()[0].equal(&group.all_gather(&params[0].grad()).unwrap()[1]),
        "the ranks' own gradients differ before the step"
    );
    dist.step().unwrap();
    for (p, e) in params.iter().zip(&expected) {
        assert!(p.allclose(e, 1e-6, 1e-7, false), "rank {rank}: the step did not use the mean gradient");
    }
    assert_same_on_all_ranks(&group, &vars());

    // synchronize() averages now (for clipping); the step after it does not average again:
    // rank 1 zeroes its averaged gradients in between, so only rank 0 moves.
    backward_on_own_data(&mut dist, 30);
    dist.synchronize().unwrap();
    let grads = group.all_gather(&params[0].grad()).unwrap();
    assert!(grads[0].equal(&grads[1]), "synchronize() averaged the gradients");
    if rank == 1 {
        tch::no_grad(|| params.iter().for_each(|p| drop(p.grad().zero_())));
    }
    let before: Vec<Tensor> = params.iter().map(|p| p.detach().copy()).collect();
    dist.step().unwrap();
    let moved = params.iter().zip(&before).any(|(p, b)| !p.equal(b));
    assert_eq!(moved, rank == 0, "rank {rank}: the step after synchronize() averaged again");
    // After zero_grad the next step averages again, and the replicas agree once more.
    broadcast_parameters(&group, &vs, 0).unwrap();
    backward_on_own_data(&mut dist, 40);
    dist.step().unwrap();
    assert_same_on_all_ranks(&group, &vars());
    rank
}

/// Rank 1 dies before an all-reduce that rank 0 is already waiting in.
fn rank_dies() -> usize {
    let group = ProcessGroup::init(Backend::Auto).unwrap();
    if group.rank() == 1 {
        std::thread::sleep(Duration::from_millis(200));
        std::process::exit(3);
    }
    let mut t = Tensor::from(1.0);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    unreachable!("rank 0 cannot finish an all-reduce without rank 1");
}

/// Rank 1's work fails with an error (not a crash) while rank 0 waits in an all-reduce.
fn rank_errors() -> usize {
    let result = ProcessGroup::run(Backend::Auto, |group| {
        if group.rank() == 1 {
            anyhow::bail!("rank 1 found something wrong");
        }
        let mut t = Tensor::from(1.0);
        group.all_reduce(&mut t, ReduceOp::Sum)?;
        Ok(group.rank())
    });
    unreachable!("the job ends inside ProcessGroup::run ({result:?})");
}

/// Started without a launcher: hands itself to mpirun as two ranks, which check their world.
fn relaunch() -> usize {
    let env = LaunchEnv::detect().unwrap();
    if env.source == LaunchSource::Single {
        let status = relaunch_with_mpirun(2, common::comm::launch::StopsAt::Step).unwrap();
        assert!(status.success(), "the ranks failed: {status}");
        // Both ranks printed their lines; nothing is left to do here.
        std::process::exit(0);
    }
    let group = ProcessGroup::init(Backend::Auto).unwrap();
    let mut t = Tensor::from(1.0);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(t.double_value(&[]), 2.0);
    group.rank()
}

/// `MPIRUN` names no program: a usage error saying what to install.
fn no_launcher() -> usize {
    let err = relaunch_with_mpirun(2, common::comm::launch::StopsAt::Step).unwrap_err();
    assert!(err.is::<UsageError>());
    assert!(format!("{err}").contains("--nproc-per-node needs an MPI launcher (mpirun) on PATH"), "{err}");
    0
}

/// `--backend mpi` with a single process: MPI starts as a singleton world.
fn mpi_singleton() -> usize {
    let group = ProcessGroup::init(Backend::Mpi).unwrap();
    assert_eq!(group.world_size(), 1);
    assert_eq!(group.backend_for(Device::Cpu).unwrap().name(), "mpi");
    let mut t = Tensor::from_slice(&[2.5f32]);
    group.all_reduce(&mut t, ReduceOp::Average).unwrap();
    assert_eq!(t.double_value(&[0]), 2.5);
    // A sub-group of a singleton is one through MPI too; there is nobody to message.
    let sub = group.split(5, 0).unwrap();
    assert_eq!((sub.rank(), sub.world_size()), (0, 1));
    assert_eq!(sub.backend_for(Device::Cpu).unwrap().name(), "mpi");
    let err = sub.send(&t, 0).unwrap_err();
    assert!(format!("{err}").contains("itself"), "{err}");
    sub.wait_sends().unwrap();
    0
}

/// Both ranks send first and receive afterwards (the 1F1B case), in several kinds and in a row;
/// what cannot be delivered is refused with a clear error.
fn p2p() -> usize {
    let group = ProcessGroup::init(Backend::Auto).unwrap();
    assert_eq!(group.world_size(), 2);
    let (rank, peer) = (group.rank(), 1 - group.rank());
    let cpu = Device::Cpu;

    // 8M floats (32 MB) each way, far above any eager-send limit: a send that waited for its
    // receiver would deadlock here (and the run would be killed at its time limit). The sent
    // tensor is a temporary that the caller drops at once: the engine must keep it alive.
    const N: i64 = 8 << 20;
    let values = |r: usize| Tensor::arange(N, (Kind::Float, cpu)) + 1000.0 * r as f64;
    group.send(&values(rank), peer).unwrap();
    let mut got = Tensor::zeros([N], (Kind::Float, cpu));
    group.recv(&mut got, peer).unwrap();
    assert!(got.equal(&values(peer)), "rank {rank} received something else");
    group.wait_sends().unwrap();

    // Several messages in a row, float64 and int64 (and float16, which MPI cannot reduce but
    // can carry), arrive in the order sent; an empty tensor is a message too.
    for i in 0..5 {
        let x = (10 * rank + i) as f64;
        group.send(&Tensor::full([3, 4], x, (Kind::Double, cpu)), peer).unwrap();
        group.send(&Tensor::from_slice(&[i as i64, rank as i64, 1 << 40]), peer).unwrap();
        group.send(&Tensor::empty([0], (Kind::Float, cpu)), peer).unwrap();
    }
    group.send(&Tensor::from_slice(&[0.5f32 + rank as f32]).to_kind(Kind::Half), peer).unwrap();
    for i in 0..5 {
        let mut d = Tensor::zeros([3, 4], (Kind::Double, cpu));
        group.recv(&mut d, peer).unwrap();
        let x = (10 * peer + i) as f64;
        assert!(d.equal(&Tensor::full([3, 4], x, (Kind::Double, cpu))), "message {i}: {d}");
        let mut l = Tensor::zeros([3], (Kind::Int64, cpu));
        group.recv(&mut l, peer).unwrap();
        assert_eq!(Vec::<i64>::try_from(&l).unwrap(), [i as i64, peer as i64, 1 << 40]);
        group.recv(&mut Tensor::empty([0], (Kind::Float, cpu)), peer).unwrap();
    }
    let mut h = Tensor::zeros([1], (Kind::Half, cpu));
    group.recv(&mut h, peer).unwrap();
    assert_eq!(h.double_value(&[0]), 0.5 + peer as f64);

    // Non-contiguous at both ends: a transposed view is sent as its values, and a view is
    // received into in place.
    let sent = Tensor::arange(6, (Kind::Float, cpu)).reshape([2, 3]) * (rank as f64 + 1.0);
    group.send(&sent.tr(), peer).unwrap();
    let base = Tensor::zeros([2, 3], (Kind::Float, cpu));
    let mut view = base.tr(); // [3, 2], as sent
    assert!(!view.is_contiguous());
    group.recv(&mut view, peer).unwrap();
    let expected = Tensor::arange(6, (Kind::Float, cpu)).reshape([2, 3]) * (peer as f64 + 1.0);
    assert!(base.equal(&expected), "the view's storage holds the peer's tensor: {base}");
    group.wait_sends().unwrap();

    // wait_sends waits until the receiver has the data. Rank 1 posts its receive only after a
    // go-ahead that rank 0 sends when its clock starts, plus a sleep, so the receive happens at
    // least `delay` after that start whatever the machine's speed or load (a sleep lasts at
    // least as long as asked): wait_sends returning earlier would have returned before it.
    let delay = Duration::from_millis(300);
    let mut go = Tensor::zeros([1], (Kind::Float, cpu));
    if rank == 0 {
        let start = Instant::now();
        group.send(&Tensor::ones([1], (Kind::Float, cpu)), 1).unwrap();
        group.send(&values(0), 1).unwrap();
        group.wait_sends().unwrap();
        let received = start.elapsed();
        assert!(received >= delay, "wait_sends returned after {received:?}, before rank 1 received");
    } else {
        group.recv(&mut go, 0).unwrap();
        std::thread::sleep(delay);
        group.recv(&mut got, 0).unwrap();
        assert!(got.equal(&values(0)));
    }

    // Mistakes are refused before anything is sent or received.
    let t = Tensor::ones([2], (Kind::Float, cpu));
    let err = group.send(&t, rank).unwrap_err();
    assert!(format!("{err}").contains(&format!("rank {rank}, which is this rank itself")), "{err}");
    let err = group.recv(&mut t.copy(), 2).unwrap_err();
    assert!(format!("{err}").contains("rank 2, but the group has only 2 rank(s)"), "{err}");

    // A message of another byte size than the receiving tensor is refused, naming both sizes
    // (MPI alone would abort the job for a longer message and half-fill the tensor with a
    // shorter one), and taken out of the way: the next message arrives intact.
    group.send(&Tensor::ones([4], (Kind::Float, cpu)), peer).unwrap();
    group.send(&Tensor::ones([6], (Kind::Float, cpu)), peer).unwrap();
    group.send(&Tensor::from_slice(&[7.0f32 + rank as f32]), peer).unwrap();
    let err = group.recv(&mut Tensor::zeros([5], (Kind::Float, cpu)), peer).unwrap_err();
    let message = format!("{err}");
    assert!(message.contains("16 bytes") && message.contains("takes 20") && message.contains("[5]"), "{message}");
    let err = group.recv(&mut Tensor::zeros([3], (Kind::Float, cpu)), peer).unwrap_err();
    let message = format!("{err}");
    assert!(message.contains("24 bytes") && message.contains("takes 12"), "{message}");
    let mut next = Tensor::zeros([1], (Kind::Float, cpu));
    group.recv(&mut next, peer).unwrap();
    assert_eq!(next.double_value(&[0]), 7.0 + peer as f64);
    // Only the byte count can be checked: the same bytes under another shape arrive as bytes.
    group.send(&Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6]).reshape([2, 3]), peer).unwrap();
    let mut other_shape = Tensor::zeros([3, 2], (Kind::Int, cpu));
    group.recv(&mut other_shape, peer).unwrap();
    assert_eq!(Vec::<i32>::try_from(&other_shape.reshape([-1])).unwrap(), [1, 2, 3, 4, 5, 6]);
    group.wait_sends().unwrap();
    rank
}

/// Four ranks split by rank % 2 into {0, 2} and {1, 3}, keyed in reverse, so that sub-ranks
/// differ from both world ranks and world order.
fn split() -> usize {
    let world = ProcessGroup::init(Backend::Auto).unwrap();
    assert_eq!(world.world_size(), 4);
    let rank = world.rank();
    let cpu = Device::Cpu;
    let partner = rank ^ 2; // the other member of this rank's sub-group
    {
        let sub = world.split(rank % 2, 10 - rank).unwrap();
        // Key 10 - rank puts the higher world rank first: world 2 and 3 are sub-rank 0.
        assert_eq!((sub.rank(), sub.world_size()), (1 - rank / 2, 2));
        assert_eq!(sub.is_root(), rank >= 2);
        assert_eq!((sub.env().rank, sub.env().world_size), (rank, 4), "the job's numbers stay");
        assert_eq!(sub.local_rank(), world.local_rank());
        assert!(sub.describe().contains("job rank"), "{}", sub.describe());

        // Collectives reach only the members: {0, 2} sums 1 + 3, {1, 3} sums 2 + 4.
        let mut t = Tensor::from_slice(&[rank as f32 + 1.0]);
        sub.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(t.double_value(&[0]), [4.0, 6.0][rank % 2]);
        let gathered = sub.all_gather(&Tensor::from_slice(&[rank as i64])).unwrap();
        let order: Vec<i64> = gathered.iter().map(|t| t.int64_value(&[0])).collect();
        let (hi, lo) = (rank.max(partner) as i64, rank.min(partner) as i64);
        assert_eq!(order, [hi, lo], "all_gather in sub-rank order");
        let mut b = Tensor::from_slice(&[rank as i64]);
        sub.broadcast(&mut b, 0).unwrap();
        assert_eq!(b.int64_value(&[0]), hi, "sub-rank 0 is world rank {hi}");
        sub.barrier().unwrap();

        // Messages use sub-ranks, and the sub-group's stream is its own: each rank sends in the
        // world (to rank ^ 1) and in the sub-group (to its partner) and receives in the other
        // order.
        world.send(&Tensor::from_slice(&[100 + rank as i64]), rank ^ 1).unwrap();
        sub.send(&Tensor::from_slice(&[200 + rank as i64]), 1 - sub.rank()).unwrap();
        let mut got = Tensor::zeros([1], (Kind::Int64, cpu));
        sub.recv(&mut got, 1 - sub.rank()).unwrap();
        assert_eq!(got.int64_value(&[0]), 200 + partner as i64);
        world.recv(&mut got, rank ^ 1).unwrap();
        assert_eq!(got.int64_value(&[0]), 100 + (rank ^ 1) as i64);
        let err = sub.send(&got, 2).unwrap_err();
        assert!(format!("{err}").contains("only 2 rank(s)"), "{err}");
        sub.wait_sends().unwrap();
        world.wait_sends().unwrap();

        // A sub-group of a sub-group: each rank alone.
        let alone = sub.split(sub.rank(), 0).unwrap();
        assert_eq!((alone.rank(), alone.world_size()), (0, 1));
        let mut t = Tensor::from_slice(&[rank as f32]);
        alone.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(t.double_value(&[0]), rank as f64);
    } // the sub-groups are dropped here, before the world

    // The world group works as before: a sum over all four, and a ring of messages.
    let mut t = Tensor::from_slice(&[rank as f64]);
    world.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(t.double_value(&[0]), 6.0);
    world.send(&Tensor::from_slice(&[rank as i64]), (rank + 1) % 4).unwrap();
    let mut got = Tensor::zeros([1], (Kind::Int64, cpu));
    world.recv(&mut got, (rank + 3) % 4).unwrap();
    assert_eq!(got.int64_value(&[0]), ((rank + 3) % 4) as i64);
    world.wait_sends().unwrap();
    rank
}

/// ZeRO's collectives on any number of ranks, checked against the reduction computed here from
/// every rank's tensor: reduce-scatter (sum and average, float and integer, a 2-D tensor read
/// flat) hands rank r block r; all-gathering the blocks gives back the whole reduction; an
/// all-reduce max is the element-wise maximum (tensor parallelism's loss takes it).
fn shards() -> usize {
    let group = ProcessGroup::init(Backend::Auto).unwrap();
    let (rank, n) = (group.rank(), group.world_size());
    let of_rank = |r: usize| Tensor::arange((6 * n) as i64, (Kind::Double, Device::Cpu)).view([2, 3 * n as i64]) * (r as f64 + 1.5) + r as f64;
    let total = (1..n).fold(of_rank(0), |sum, r| sum + of_rank(r)).reshape([-1]);
    let before = group.comm_stats();
    for (op, expected) in [(ReduceOp::Sum, total.shallow_clone()), (ReduceOp::Average, &total / n as f64)] {
        for kind in [Kind::Double, Kind::Float] {
            let block = group.reduce_scatter(&of_rank(rank).to_kind(kind), op).unwrap();
            assert_eq!((block.size(), block.kind()), (vec![6], kind), "rank {rank}: a 1-D block of 6 in the tensor's kind");
            let want = expected.narrow(0, 6 * rank as i64, 6).to_kind(kind);
            assert!(block.allclose(&want, 1e-6, 1e-6, false), "rank {rank} {op:?} {kind:?}: {block:?} vs {want:?}");
            let whole = Tensor::cat(&group.all_gather(&block).unwrap(), 0);
            assert!(whole.allclose(&expected.to_kind(kind), 1e-6, 1e-6, false), "the gathered blocks are the whole reduction");
        }
    }
    // The maximum (the vocabulary-parallel loss's shift): element-wise over every rank's tensor.
    let mut mine = of_rank(rank) * if rank % 2 == 0 { 1.0 } else { -1.0 };
    let expected = (0..n).map(|r| of_rank(r) * if r % 2 == 0 { 1.0 } else { -1.0 }).reduce(|a, b| a.maximum(&b)).unwrap();
    group.all_reduce(&mut mine, ReduceOp::Max).unwrap();
    assert!(mine.equal(&expected), "rank {rank}: all-reduce max {mine:?} vs {expected:?}");
    let ints = group.reduce_scatter(&Tensor::ones([2 * n as i64], (Kind::Int64, Device::Cpu)), ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<i64>::try_from(&ints).unwrap(), vec![n as i64; 2]);
    let counted = group.comm_stats().since(before);
    assert_eq!((counted.reduce_scatter.calls, counted.reduce_scatter.bytes), (5, 2 * (6 * n as u64) * 8 + 2 * (6 * n as u64) * 4 + 2 * n as u64 * 8));
    if n > 1 {
        let err = group.reduce_scatter(&Tensor::ones([2 * n as i64 + 1], (Kind::Float, Device::Cpu)), ReduceOp::Sum).unwrap_err();
        assert!(format!("{err}").contains("must divide by the ranks"), "{err}");
    }
    let err = group.reduce_scatter(&Tensor::ones([2 * n as i64], (Kind::Int64, Device::Cpu)), ReduceOp::Average).unwrap_err();
    assert!(format!("{err}").contains("floating-point"), "{err}");
    rank
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn reduce_scatter_and_all_gather_on_two_and_four_ranks() {
    for ranks in [2, 4] {
        launch(Some(ranks), "shards", &[], Duration::from_secs(60)).assert_passed("shards", ranks);
    }
}

/// The layout planner's figure for ranks sharing a host's cores: each round of equal passes
/// together lasts as long as its slowest rank's. Rank 0's passes take 1 s, rank 1's 2.5 s:
/// sharing costs 2.5× (rank 0's own passes would say 1×). Rank 0 passes once alone and once
/// together per round, rank 1 only together, each after one untimed pass.
fn sharing() -> usize {
    let group = ProcessGroup::init(Backend::Auto).unwrap();
    let rank = group.rank();
    let mut passes = 0;
    let slowdown = common::plan::profile::sharing_slowdown(&group, || {
        passes += 1;
        Ok(if rank == 0 { 1.0 } else { 2.5 })
    })
    .unwrap();
    assert_eq!(slowdown, 2.5, "rank {rank}");
    let mut counts = Tensor::from_slice(&[if rank == 0 { passes } else { 0 }, if rank == 1 { passes } else { 0 }]);
    group.all_reduce(&mut counts, ReduceOp::Sum).unwrap();
    let [zero, one] = <[i64; 2]>::try_from(Vec::<i64>::try_from(&counts).unwrap()).unwrap();
    assert_eq!(zero - 1, 2 * (one - 1), "rank {rank}: rank 0 passed {zero} times, rank 1 {one}");
    rank
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn sharing_the_cores_costs_what_the_slowest_rank_of_each_round_took() {
    two_ranks("sharing").assert_passed("sharing", 2);
}

#[test]
fn a_single_process_reduce_scatter_is_the_flat_tensor() {
    let group = ProcessGroup::single();
    let t = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
    let block = group.reduce_scatter(&t, ReduceOp::Average).unwrap();
    assert!(block.equal(&t.reshape([-1])));
    assert!(group.reduce_scatter(&t.to_kind(Kind::Int64), ReduceOp::Average).is_err(), "an integer average is refused");
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn collectives_on_two_ranks() {
    two_ranks("collectives").assert_passed("collectives", 2);
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn send_and_recv_on_two_ranks() {
    two_ranks("p2p").assert_passed("p2p", 2);
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn sub_groups_on_four_ranks() {
    launch(Some(4), "split", &[], Duration::from_secs(60)).assert_passed("split", 4);
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn data_parallel_helpers_on_two_ranks() {
    two_ranks("data_parallel").assert_passed("data_parallel", 2);
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn a_dying_rank_ends_the_job_and_is_named() {
    // mpirun's default: a rank that exits without finalising MPI makes it kill the others.
    let run = two_ranks("rank_dies");
    assert!(!run.status.success(), "{}", run.output);
    assert!(run.elapsed < Duration::from_secs(60));
    assert_eq!(failed_rank(&run.output), Some(1), "mpirun names the failed rank:\n{}", run.output);
    assert!(run.output.contains("Exit code:") && run.output.contains('3'), "{}", run.output);
}

/// The rank in mpirun's `Process name:` line: OpenMPI 4 writes `[[job,app],rank]`, OpenMPI 5
/// `[prterun-host-pid@app,rank]`.
fn failed_rank(output: &str) -> Option<usize> {
    let line = output.lines().find_map(|l| l.trim().strip_prefix("Process name:"))?;
    line.trim().trim_end_matches(']').rsplit(',').next()?.parse().ok()
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn an_error_on_one_rank_aborts_every_rank() {
    let run = two_ranks("rank_errors");
    assert_eq!(run.status.code(), Some(1), "{}", run.output);
    assert!(run.elapsed < Duration::from_secs(60));
    assert!(run.output.contains("error on rank 1: rank 1 found something wrong"), "{}", run.output);
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn nproc_per_node_relaunches_under_mpirun() {
    launch(None, "relaunch", &[], Duration::from_secs(60)).assert_passed("relaunch", 2);
}

#[test]
fn nproc_per_node_without_mpirun_is_a_usage_error() {
    launch(None, "no_launcher", &[("MPIRUN", "/nonexistent/mpirun")], Duration::from_secs(30)).assert_passed("no_launcher", 1);
}

#[test]
#[cfg_attr(not(feature = "mpi"), ignore = "needs the `mpi` feature")]
fn backend_mpi_works_with_one_process() {
    launch(None, "mpi_singleton", &[], Duration::from_secs(30)).assert_passed("mpi_singleton", 1);
}

/// ZeRO-1's optimizer in a world of one rank: its block is the whole model, so it trains as the
/// optimizer it wraps, and its gathered state has the wrapped optimizer's names and values; a
/// fresh one loads that state and gives it back.
#[test]
fn a_zero_optimizer_alone_is_the_optimizer_it_wraps_with_the_same_named_state() {
    use common::parallel::zero::ZeroOptimizer;
    let group = ProcessGroup::single();
    let config = AdamConfig { lr: 0.1, ..AdamConfig::default() };
    let make = || -> Vec<(String, Tensor)> {
        tch::manual_seed(3);
        vec![
            ("a".into(), Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
            ("b".into(), Tensor::randn([5], (Kind::Float, Device::Cpu)).set_requires_grad(true)),
        ]
    };
    let shallow = |named: &[(String, Tensor)]| named.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect::<Vec<_>>();
    let (plain_params, zero_params) = (make(), make());
    let mut plain: Box<dyn Optimizer + '_> = Box::new(Adam::new(shallow(&plain_params), config));
    let mut zero: Box<dyn Optimizer + '_> = Box::new(ZeroOptimizer::new(&group, shallow(&zero_params), |named| Box::new(Adam::new(named, config))).unwrap());
    for step in 0..3 {
        for (params, opt) in [(&plain_params, &mut plain), (&zero_params, &mut zero)] {
            opt.zero_grad();
            let loss = params.iter().map(|(_, p)| (p * p).sum(Kind::Float) * (step + 1) as f64).reduce(|a, b| a + b).unwrap();
            loss.backward();
            opt.synchronize().unwrap();
            opt.step().unwrap();
        }
    }
    for ((name, a), (_, b)) in plain_params.iter().zip(&zero_params) {
        assert!(a.allclose(b, 1e-6, 1e-7, false), "{name} differs");
    }
    assert!(zero.sharded().is_some() && plain.sharded().is_none());
    let sorted = |mut v: Vec<(String, Tensor)>| {
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (plain_state, zero_state) = (sorted(plain.state_tensors()), sorted(zero.sharded().unwrap().gathered_state().unwrap()));
    assert_eq!(plain_state.iter().map(|t| &t.0).collect::<Vec<_>>(), zero_state.iter().map(|t| &t.0).collect::<Vec<_>>());
    for ((name, a), (_, b)) in plain_state.iter().zip(&zero_state) {
        assert!(a.to_kind(Kind::Double).allclose(&b.to_kind(Kind::Double), 1e-6, 1e-9, false), "{name}: {a:?} vs {b:?}");
    }
    let fresh_params = make();
    let mut fresh = ZeroOptimizer::new(&group, shallow(&fresh_params), |named| Box::new(Adam::new(named, config))).unwrap();
    fresh.load_state_tensors(&plain_state.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()).unwrap();
    let reloaded = sorted(fresh.sharded().unwrap().gathered_state().unwrap());
    assert!(reloaded.iter().zip(&plain_state).all(|((n, a), (m, b))| n == m && a.to_kind(Kind::Double).allclose(&b.to_kind(Kind::Double), 1e-6, 1e-9, false)));
    let mut stray = HashMap::new();
    stray.insert("exp_avg.nope".to_string(), Tensor::zeros([2], (Kind::Float, Device::Cpu)));
    assert!(fresh.load_state_tensors(&stray).is_err(), "state of another model is refused");
}
