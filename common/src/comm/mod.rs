//! Distributed data-parallel training: the launch environment, a process group whose
//! collectives run on real engines (MPI for CPU tensors, NCCL for CUDA tensors; nothing
//! home-made), and the data-parallel pieces built on it.
//!
//! # How ranks are started
//!
//! Every rank runs the same binary with the same arguments; [`launch::LaunchEnv::detect`] finds
//! out which rank this process is from the launcher's environment variables:
//!
//! | launcher                                   | course equivalent            |
//! |--------------------------------------------|------------------------------|
//! | `mpirun -np 4 bin …` (OpenMPI, MPICH/Hydra) | `horovodrun -np 4 python …`  |
//! | `srun --mpi=pmix bin …` (Slurm)            | `srun python …`              |
//! | `torchrun --nproc-per-node 4 bin …`        | `torchrun …` (NCCL only)     |
//! | `bin --nproc-per-node 4 …`                 | `mp.spawn(fn, nprocs=4)`     |
//!
//! The last form re-executes the binary under `mpirun` ([`launch::relaunch_with_mpirun`]).
//!
//! # Engines
//!
//! [`ProcessGroup::init`] picks, per device type, one [`Collectives`] implementation:
//! [`mpi::MpiCollectives`] over `MPI_COMM_WORLD` (or a sub-communicator) for CPU tensors (cargo feature `mpi`, on by
//! default), `nccl::NcclCollectives` for CUDA tensors (cargo feature `nccl`), and
//! [`single::SingleProcess`] (identities) when there is only one rank. A device type without
//! an engine of its own is staged through the other's memory (CUDA tensors through MPI on the
//! CPU with `--backend mpi`, CPU tensors through NCCL on the GPU under torchrun): slow, but
//! everything works with any launcher.
//!
//! # Point-to-point and sub-groups
//!
//! For pipeline parallelism, [`ProcessGroup::send`] hands a tensor to another rank without
//! waiting for it to be received, [`ProcessGroup::recv`] waits for the next tensor from a rank
//! (into a preallocated tensor of the same shape and kind), and [`ProcessGroup::wait_sends`]
//! waits until every send has been received. Sends do not block so that, in a 1F1B schedule,
//! stage 0 can send an activation forward while stage 1 sends a gradient back, both before
//! receiving. Messages between two ranks arrive in order. MPI starts each send at once and
//! checks the size of what arrives; NCCL queues sends until the rank's next receive (issued
//! together in one NCCL group) or `wait_sends` (the `nccl` module's docs say what that implies).
//!
//! [`ProcessGroup::split`] makes sub-groups, like `MPI_Comm_split` or torch's `new_group`: the
//! ranks passing the same color form a group, ranked by key, with communicators of their own
//! (MPI split from the parent's, a new NCCL communicator where the parent has one). Its
//! collectives and messages use the sub-group's ranks. Sub-groups need an MPI launcher; drop
//! them before the world group.
//!
//! ```ignore
//! // Four ranks as two pipelines of two stages: ranks 0, 1 and ranks 2, 3 pass activations
//! // along (send/recv), and the replicas of each stage (0, 2 and 1, 3) average gradients.
//! let pipeline = group.split(group.rank() / 2, group.rank())?;
//! let replicas = group.split(group.rank() % 2, group.rank())?;
//! ```
//!
//! # Data parallelism (Horovod / DDP, by hand)
//!
//! [`data_parallel`] has the steps of the course's Horovod recipe:
//! [`data_parallel::broadcast_parameters`] and [`data_parallel::broadcast_optimizer_state`]
//! once at the start (rank 0's initial weights, or its restored checkpoint, win),
//! [`data_parallel::GradientAverager::average`] after every backward pass (gradients averaged in
//! buckets, optionally in float16), and [`data_parallel::metric_average`] for losses and
//! accuracies. The strategies built on them (DDP, Horovod's `hvd.DistributedOptimizer`, ZeRO,
//! parameter servers) are [`crate::parallel`]'s.
//!
//! # Layouts
//!
//! [`layout::Layout`] divides a job into data-parallel replicas of pipeline stages (of
//! tensor-parallel shards), checked once against the world size; [`layout::Groups`] splits the
//! world into the sub-groups each kind of parallelism talks over.
//!
//! # Errors and dying ranks
//!
//! A collective blocks until every rank has joined it, so a rank that stops early must take the
//! others down with it, not leave them waiting:
//!
//! - a rank that dies outright (a crash, a signal, `exit` without finalising MPI) is seen by
//!   `mpirun`, which by default kills the remaining ranks at once and names the failed one
//!   (`Process name: [[job,1],<rank>]`, with its exit code);
//! - a rank that panics aborts the job from [`mpi::MpiCollectives`]'s `Drop` (`MPI_Abort`);
//! - a rank whose work returns an error must not simply drop its group: `MPI_Finalize` would
//!   wait for the other ranks, which wait in their next collective for it, and the job would
//!   hang until its time limit. [`ProcessGroup::run`] prints the error with the rank and ends
//!   the whole job with `MPI_Abort` (exit code 2 for a usage error, else 1).
//!
//! # In a binary
//!
//! ```ignore
//! fn main() -> ExitCode {
//!     common::error::run_main(|| {
//!         let args = Args::parse();
//!         // `--nproc-per-node N` without a launcher: become N ranks under mpirun, and wait.
//!         if let Some(n) = args.nproc_per_node {
//!             if LaunchEnv::detect()?.source == LaunchSource::Single {
//!                 let status = launch::relaunch_with_mpirun(n, launch::StopsAt::Step)?;
//!                 anyhow::ensure!(status.success(), "the {n} ranks failed ({status})");
//!                 return Ok(());
//!             }
//!         }
//!         ProcessGroup::run(args.backend, |group| {
//!             let device = group.device(want_cuda); // this rank's GPU: local rank
//!             train(group, device, &args) // everything borrowing `group` ends here
//!         }) // the group is dropped here on success: NCCL destroyed, then MPI_Finalize
//!     })
//! }
//! ```
//!
//! Return from `main` normally (no `std::process::exit` while the group lives): a rank that
//! exits without `MPI_Finalize` counts as failed for `mpirun`.

pub mod data_parallel;
pub mod group;
pub mod hosts;
pub mod launch;
pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod orphan;
pub mod rendezvous;
pub mod shared_gpu;
pub mod single;
pub mod startup;
pub mod tensor_parallel;
pub mod transfer;
pub mod waits;
pub mod watchdog;

pub use group::{CommStats, ProcessGroup};
pub use launch::{LaunchEnv, LaunchSource};
pub use layout::{Groups, Layout};

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

/// Which engine runs the collectives on CUDA tensors (the `--backend` flag). CPU tensors use
/// MPI whenever an MPI launcher started the ranks (see [`group`] for every combination).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// NCCL for CUDA tensors when the binary has it and there is a GPU; MPI otherwise.
    #[default]
    Auto,
    /// NCCL for CUDA tensors (an error where it is not available), even with a single rank.
    Nccl,
    /// MPI for everything, CUDA tensors copied through the CPU (slow); MPI even with one rank.
    Mpi,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Auto => "auto",
            Backend::Nccl => "nccl",
            Backend::Mpi => "mpi",
        })
    }
}

/// How [`Collectives::all_reduce`] combines the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size, in the tensor's kind (floating-point kinds only).
    Average,
    /// The element-wise maximum (a vocabulary-parallel softmax's shift).
    Max,
}

/// One engine's collectives on tensors of one device type. Every rank must call the same
/// collectives in the same order with tensors of the same shape and kind; in place where
/// torch's are (the caller's tensor holds the result, whatever its layout).
pub trait Collectives {
    /// `"mpi"`, `"nccl"` or `"single"`.
    fn name(&self) -> &'static str;

    /// Combines `tensor` across the ranks; every rank ends with the result.
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()>;

    /// Overwrites `tensor` on every rank with its value on rank `root`.
    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()>;

    /// Every rank's `tensor`, in rank order (same shape and kind on all ranks).
    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>>;

    /// Combines `tensor` across the ranks and returns this rank's block of the result: the
    /// tensor read flat and cut into world-size equal blocks, rank r getting block r, 1-D
    /// (`MPI_Reduce_scatter_block`, `ncclReduceScatter`; ZeRO's gradient reduction). Its element
    /// count must divide by the world size.
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Hands `tensor` over for rank `dst` and returns without waiting for it to be received
    /// (`isend`): the engine keeps the tensor alive until the message has gone, and
    /// [`Collectives::wait_sends`] waits for that. Non-blocking so that two ranks may send to
    /// each other before either receives (a pipeline's activations going forward while its
    /// gradients come back) without deadlocking. Messages from one rank to another arrive in
    /// the order sent. The tensor's memory may be read until `wait_sends` returns: do not
    /// change it in place before then.
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()>;

    /// Waits for the next message from rank `src` and writes it into `tensor`, which must have
    /// the sent tensor's shape and kind (in place, whatever its layout, as for `broadcast`).
    fn recv(&self, tensor: &mut Tensor, src: usize) -> Result<()>;

    /// Returns once every message [`Collectives::send`] handed over has been received, so the
    /// sent tensors may be changed or freed (at the end of a pipeline step, say).
    fn wait_sends(&self) -> Result<()>;

    /// Waits until a point-to-point message from any rank is ready and returns that rank (the
    /// message stays queued for [`Collectives::recv`]). Only MPI can (`MPI_Probe` with
    /// `MPI_ANY_SOURCE`); a parameter server needs it.
    fn probe_any_source(&self) -> Result<usize> {
        bail!("the {} engine cannot wait for a message from any rank (a parameter server needs MPI)", self.name())
    }

    /// Whether the engine can reduce tensors of `kind` (MPI has no float16, for example).
    /// Checked up front where a caller chooses the kind, e.g. float16 gradient averaging.
    fn supports_kind(&self, kind: Kind) -> bool {
        let _ = kind;
        true
    }
}

/// Rejects `Average` on integer tensors: an integer mean would silently truncate.
pub(crate) fn check_reduce(kind: Kind, op: ReduceOp) -> Result<()> {
    let floating = matches!(kind, Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double);
    if op == ReduceOp::Average && !floating {
        bail!("an average all-reduce needs a floating-point tensor, not {kind:?} (use Sum)");
    }
    Ok(())
}

/// Rejects a reduce-scatter whose tensor does not cut into `world_size` equal blocks; returns
/// the block's element count.
pub(crate) fn check_scatter(tensor: &Tensor, op: ReduceOp, world_size: usize) -> Result<usize> {
    check_reduce(tensor.kind(), op)?;
    let numel = tensor.numel();
    if !numel.is_multiple_of(world_size) {
        bail!("reduce_scatter of {numel} elements over {world_size} ranks: the count must divide by the ranks (pad it)");
    }
    Ok(numel / world_size)
}

/// Rejects a broadcast root outside the world.
pub(crate) fn check_root(root: usize, world_size: usize) -> Result<()> {
    if root >= world_size {
        bail!("broadcast from rank {root}, but the world has only {world_size} rank(s)");
    }
    Ok(())
}

/// Rejects a `send`/`recv` peer outside the group or equal to this rank: a message to oneself
/// is a logic error in a schedule, and an out-of-range rank would hang or abort inside MPI.
#[cfg_attr(not(any(feature = "mpi", feature = "nccl")), allow(dead_code))] // only MPI and NCCL send messages
pub(crate) fn check_peer(what: &str, peer: usize, rank: usize, world_size: usize) -> Result<()> {
    if peer >= world_size {
        bail!("{what} rank {peer}, but the group has only {world_size} rank(s)");
    }
    if peer == rank {
        bail!("{what} rank {peer}, which is this rank itself: a rank cannot message itself");
    }
    Ok(())
}

/// How many bytes a tensor's elements take: point-to-point messages are sent as bytes, so any
/// kind travels, and the receiver can check the size of what arrives.
#[cfg_attr(not(any(feature = "mpi", feature = "nccl")), allow(dead_code))] // only MPI and NCCL send messages
pub(crate) fn byte_size(tensor: &Tensor) -> usize {
    tensor.numel() * tensor.kind().elt_size_in_bytes()
}

/// `bytes` of rank `root` on every rank (others pass anything, e.g. an empty slice): the length
/// first, then the bytes, as tensors on `device` through `engine`. Used for the NCCL unique id
/// and for the list of optimizer state tensors.
pub(crate) fn broadcast_bytes(engine: &dyn Collectives, device: Device, bytes: &[u8], root: usize) -> Result<Vec<u8>> {
    let mut len = Tensor::from(bytes.len() as i64).to_device(device);
    engine.broadcast(&mut len, root)?;
    let len = usize::try_from(len.int64_value(&[]))?;
    // The root sends its bytes; the others' buffers only need the right length.
    let mut data = if bytes.len() == len { Tensor::from_slice(bytes).to_device(device) } else { Tensor::zeros([len as i64], (Kind::Uint8, device)) };
    engine.broadcast(&mut data, root)?;
    Ok(Vec::<u8>::try_from(data.to_device(Device::Cpu))?)
}
