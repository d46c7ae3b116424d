//! [`ProcessGroup`]: the ranks of a job and the engine that runs collectives for each device
//! type, chosen once at start-up from the launcher and the `--backend` flag.
//!
//! | ranks | launcher            | CPU tensors        | CUDA tensors (GPU present)                  |
//! |-------|---------------------|--------------------|---------------------------------------------|
//! | 1     | none                | identities         | identities (`--backend nccl`: NCCL)         |
//! | > 1   | mpirun, srun+PMIx   | MPI                | NCCL, id sent through MPI (`--backend mpi`, or no `nccl` feature: MPI via the CPU) |
//! | > 1   | torchrun, srun      | NCCL via the GPU   | NCCL, id sent over TCP to `MASTER_ADDR:MASTER_PORT` |
//!
//! `--backend mpi` also uses MPI with a single rank (then MPI starts as a "singleton").
//!
//! [`ProcessGroup::split`] makes sub-groups (pipeline stages, the replicas of one stage) with
//! the same routing, on communicators of their own.
use std::rc::Rc;

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use super::launch::{LaunchEnv, LaunchSource};
use super::single::{SilentShards, SingleProcess};
use super::{Backend, Collectives, ReduceOp};
use crate::error::{usage, UsageError};

#[cfg(feature = "mpi")]
use super::mpi::MpiCollectives;

/// The ranks of this job (or of a sub-group of it, see [`ProcessGroup::split`]) and their
/// collectives and point-to-point messages.
///
/// Not `Send`: MPI is initialised with thread level `Funneled`, so every collective must come
/// from the thread that created the group. Dropping it completes the sends still in flight and
/// shuts the engines down (NCCL first, then `MPI_Finalize`); every rank must drop it, and
/// before the process exits, or `mpirun` reports the rank as failed. Drop sub-groups before
/// the world group (MPI stays up until the last group sharing it is dropped).
pub struct ProcessGroup {
    /// How this process was started; its rank and size are the job's.
    env: LaunchEnv,
    /// This group's rank and size: the job's, or the sub-group's.
    rank: usize,
    size: usize,
    /// Whether CUDA tensors go through an NCCL communicator of this group's own, so that its
    /// sub-groups get one too.
    nccl: bool,
    /// What this group's collectives and messages moved so far.
    stats: std::cell::RefCell<CommStats>,
    // Fields drop in declaration order: the CUDA engine (NCCL's communicator) goes before the
    // CPU one, and MPI, which the others may have used to start, is finalised last.
    cuda: Rc<dyn Collectives>,
    cpu: Rc<dyn Collectives>,
    #[cfg(feature = "mpi")]
    mpi: Option<Rc<MpiCollectives>>,
}

impl ProcessGroup {
    /// Detects the launch environment and starts the engines the table in the module docs
    /// lists. A single process needs neither MPI nor NCCL (unless `backend` names one).
    pub fn init(backend: Backend) -> Result<ProcessGroup> {
        Self::init_with(backend, LaunchEnv::detect()?)
    }

    /// [`ProcessGroup::init`] for a given launch environment.
    ///
    /// Mistakes every rank makes alike (an engine the binary or machine lacks) are returned
    /// before any engine starts. A failure after MPI has started (NCCL's set-up, say) may hit
    /// some ranks only, while the others wait for them: on a multi-rank job it ends the whole
    /// job, as [`ProcessGroup::run`] does.
    pub fn init_with(backend: Backend, env: LaunchEnv) -> Result<ProcessGroup> {
        let distributed = env.is_distributed();
        match backend {
            Backend::Nccl if !cfg!(feature = "nccl") => return usage(built_without("NCCL", "nccl", "--backend nccl")),
            Backend::Nccl if !crate::device::cuda_available() => {
                return usage(format!(
                    "--backend nccl runs collectives on GPUs, but no CUDA device is available (LibTorch {} sees none)",
                    crate::torch_version()
                ))
            }
            Backend::Mpi if !cfg!(feature = "mpi") => return usage(built_without("MPI", "mpi", "--backend mpi")),
            Backend::Mpi if distributed && !env.mpi => {
                return usage(format!(
                    "--backend mpi needs ranks started by an MPI launcher (mpirun, srun --mpi=pmix), \
                     but {} started these {} ranks",
                    env.source, env.world_size
                ))
            }
            _ => {}
        }

        // MPI whenever an MPI launcher started the ranks (CPU tensors need it, and it carries
        // NCCL's id), or when asked for.
        #[cfg(feature = "mpi")]
        {
            let mpi = match backend == Backend::Mpi || (distributed && env.mpi) {
                true => Some(Rc::new(start_mpi(&env)?)),
                false => None,
            };
            let rank = env.rank;
            let group = Self::with_engines(backend, env, mpi.clone().map(|m| m as _));
            match (group, mpi) {
                (Ok(mut group), mpi) => {
                    group.mpi = mpi;
                    Ok(group)
                }
                (Err(err), Some(mpi)) if distributed => abort_job(&mpi, rank, &err),
                (Err(err), _) => Err(err),
            }
        }
        #[cfg(not(feature = "mpi"))]
        Self::with_engines(backend, env, None)
    }

    /// The group over the MPI engine `mpi` (if any), with NCCL started where wanted and every
    /// device type routed to an engine.
    fn with_engines(backend: Backend, env: LaunchEnv, mpi: Option<Rc<dyn Collectives>>) -> Result<ProcessGroup> {
        let distributed = env.is_distributed();
        let want_nccl = match backend {
            Backend::Nccl => true,
            Backend::Auto => distributed && crate::device::cuda_available() && cfg!(feature = "nccl"),
            Backend::Mpi => false,
        };
        let (rank, size) = (env.rank, env.world_size);
        let nccl = if want_nccl { Some(start_nccl(&env, rank, size, mpi.as_deref())?) } else { None };
        let (cpu, cuda) = route(&env, size, mpi, nccl)?;
        Ok(ProcessGroup {
            env,
            rank,
            size,
            nccl: want_nccl,
            stats: Default::default(),
            cuda,
            cpu,
            #[cfg(feature = "mpi")]
            mpi: None,
        })
    }

    /// A world of one rank, without any engine.
    pub fn single() -> ProcessGroup {
        ProcessGroup {
            env: LaunchEnv::single(),
            rank: 0,
            size: 1,
            nccl: false,
            stats: Default::default(),
            cuda: Rc::new(SingleProcess),
            cpu: Rc::new(SingleProcess),
            #[cfg(feature = "mpi")]
            mpi: None,
        }
    }

    /// Rank 0 of `size` ranks that exchange nothing ([`SilentShards`]): a tensor-parallel shard
    /// run with it does its own arithmetic alone, to be timed.
    pub fn silent(size: usize) -> ProcessGroup {
        ProcessGroup {
            env: LaunchEnv::single(),
            rank: 0,
            size,
            nccl: false,
            stats: Default::default(),
            cuda: Rc::new(SilentShards { size }),
            cpu: Rc::new(SilentShards { size }),
            #[cfg(feature = "mpi")]
            mpi: None,
        }
    }

    /// Runs one rank's work with a group started by [`ProcessGroup::init`], making a failure
    /// end the whole job at once. Without this, a rank returning an error would leave the
    /// others blocked in their next collective, and its own `MPI_Finalize` could wait for them
    /// too: the job would hang until the scheduler's time limit. Here, an error on a rank of a
    /// multi-rank MPI job is printed (prefixed with the rank) and ends every rank through
    /// `MPI_Abort` with the error's exit code (2 for a usage error, else 1); `mpirun` exits
    /// with it. With one rank, or without MPI (torchrun tears the job down itself when a rank
    /// exits), the error is returned as usual.
    pub fn run<T>(backend: Backend, body: impl FnOnce(&ProcessGroup) -> Result<T>) -> Result<T> {
        let group = ProcessGroup::init(backend)?;
        // A LibTorch failure (out of memory, say) panics in tch: an error like any other here.
        let result = crate::error::catch_panic(|| body(&group));
        // A signal's stop is every rank's, agreed at one step: they end together, no abort.
        if let Err(err) = &result {
            if err.chain().any(|cause| cause.is::<crate::error::Orphaned>()) {
                group.end_orphaned(err);
            }
            if !err.is::<crate::error::Stopped>() {
                group.abort_on_error(err);
            }
        }
        result
    }

    /// This rank's launcher is gone (`err` says which, [`super::orphan`]): under MPI the rank ends
    /// here, the job's rank 0 saying why, without `MPI_Finalize` or `MPI_Abort`, which both go
    /// through mpirun, itself ending (or stuck: nothing is to wait for it). Without MPI the
    /// error is returned as any other.
    fn end_orphaned(&self, err: &anyhow::Error) {
        #[cfg(feature = "mpi")]
        if self.mpi.is_some() && self.env.is_distributed() {
            if self.env.rank == 0 {
                crate::error::say(&crate::error::first_line(err));
            }
            // SAFETY: _exit ends the process at once, which is the point (no finalisation).
            unsafe { libc::_exit(crate::error::STOPPED_EXIT_CODE.into()) };
        }
        #[cfg(not(feature = "mpi"))]
        let _ = err;
    }

    /// The sub-group of the ranks that pass the same `color`, ordered by `key` (ties by their
    /// rank here), like `MPI_Comm_split` or torch's `new_group`: the stages of a pipeline, or
    /// the data-parallel replicas of one stage. Every rank of this group must call it, at the
    /// same point among its collectives.
    ///
    /// Collectives and messages in the sub-group use its own ranks, which
    /// [`rank`](Self::rank) and [`world_size`](Self::world_size) return; the launch
    /// environment, the local rank and so the device stay this process's. The engines are
    /// routed as here, on communicators of the sub-group's own: an MPI communicator split from
    /// this group's, and, where this group has NCCL, an NCCL communicator whose id the
    /// sub-group's rank 0 makes and sends through that MPI communicator.
    ///
    /// Sub-groups need MPI: ranks that torchrun started cannot form them (a usage error), and
    /// splitting a world of one without MPI gives the same world of one. Drop a sub-group
    /// before the group it came from (its communicators are released then; MPI itself is
    /// finalised with the last group).
    pub fn split(&self, color: usize, key: usize) -> Result<ProcessGroup> {
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            return self.split_mpi(mpi, color, key);
        }
        #[cfg(not(feature = "mpi"))]
        let _ = (color, key); // a world of one has a single sub-group, whatever is asked
        if self.size == 1 {
            return Ok(self.world_of_one());
        }
        let why = if cfg!(feature = "mpi") {
            format!("{} started these {} ranks without MPI", self.env.source, self.size)
        } else {
            built_without("MPI", "mpi", "this")
        };
        usage(format!("sub-groups (ProcessGroup::split) need ranks started by an MPI launcher (mpirun, srun --mpi=pmix), but {why}"))
    }

    /// [`ProcessGroup::split`] through `mpi`, this group's MPI communicator.
    #[cfg(feature = "mpi")]
    fn split_mpi(&self, mpi: &MpiCollectives, color: usize, key: usize) -> Result<ProcessGroup> {
        let sub = Rc::new(mpi.split(color, key)?);
        let (rank, size) = (sub.rank(), sub.size());
        let nccl = if self.nccl { Some(start_nccl(&self.env, rank, size, Some(&*sub))?) } else { None };
        let (cpu, cuda) = route(&self.env, size, Some(sub.clone() as _), nccl)?;
        Ok(ProcessGroup { env: self.env.clone(), rank, size, nccl: self.nccl, stats: Default::default(), cuda, cpu, mpi: Some(sub) })
    }

    /// A group of just this process, sharing this group's engines: the only sub-group a world
    /// of one has.
    fn world_of_one(&self) -> ProcessGroup {
        ProcessGroup {
            env: self.env.clone(),
            rank: 0,
            size: 1,
            nccl: self.nccl,
            stats: Default::default(),
            cuda: self.cuda.clone(),
            cpu: self.cpu.clone(),
            #[cfg(feature = "mpi")]
            mpi: None,
        }
    }

    /// Ends every rank when `err` happened on a rank of a multi-rank MPI job (see
    /// [`ProcessGroup::run`]); returns otherwise. In a sub-group too, the whole job ends.
    pub fn abort_on_error(&self, err: &anyhow::Error) {
        #[cfg(feature = "mpi")]
        if let (Some(mpi), true) = (&self.mpi, self.env.is_distributed()) {
            abort_job(mpi, self.env.rank, err);
        }
        // Without MPI there is nothing to abort: the ranks come from a launcher (torchrun) that
        // ends the job itself when one exits with an error.
        #[cfg(not(feature = "mpi"))]
        let _ = err;
    }

    /// This process's rank in this group (in a sub-group, its rank there).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in this group.
    pub fn world_size(&self) -> usize {
        self.size
    }

    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }

    pub fn local_world_size(&self) -> usize {
        self.env.local_world_size
    }

    /// Rank 0 of this group: in the world group, the one that prints, writes results and
    /// checkpoints.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// Where the ranks came from (with the job's rank and size, also in a sub-group).
    pub fn env(&self) -> &LaunchEnv {
        &self.env
    }

    /// The device this rank computes on: its own GPU (local rank modulo the GPUs it sees, so
    /// both one GPU per rank via `CUDA_VISIBLE_DEVICES` and all GPUs visible to all ranks
    /// work), or the CPU when `want_cuda` is false or there is no GPU.
    pub fn device(&self, want_cuda: bool) -> Device {
        if want_cuda && crate::device::cuda_available() {
            Device::Cuda(cuda_index(self.env.local_rank))
        } else {
            Device::Cpu
        }
    }

    /// One line for logs, e.g. `rank 0 of 2 (mpirun), CPU: mpi, CUDA: nccl`; a sub-group adds
    /// the job's rank.
    pub fn describe(&self) -> String {
        let job = if (self.rank, self.size) == (self.env.rank, self.env.world_size) {
            String::new()
        } else {
            format!(" in a sub-group; job rank {} of {}", self.env.rank, self.env.world_size)
        };
        format!("rank {} of {}{job} ({}), CPU collectives: {}, CUDA collectives: {}", self.rank, self.size, self.env.source, self.cpu.name(), self.cuda.name())
    }

    /// The engine for tensors on `device`.
    pub fn backend_for(&self, device: Device) -> Result<&dyn Collectives> {
        match device {
            Device::Cpu => Ok(&*self.cpu),
            Device::Cuda(_) => Ok(&*self.cuda),
            other => bail!("no collectives for tensors on {other:?}: use the CPU or CUDA"),
        }
    }

    pub fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.count(Collective::AllReduce, t);
        self.backend_for(t.device())?.all_reduce(t, op)
    }

    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<()> {
        self.count(Collective::Broadcast, t);
        self.backend_for(t.device())?.broadcast(t, root)
    }

    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        self.count(Collective::AllGather, t);
        self.backend_for(t.device())?.all_gather(t)
    }

    /// This rank's block of the reduction of `t` over the ranks (see [`Collectives::reduce_scatter`]).
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.count(Collective::ReduceScatter, t);
        self.backend_for(t.device())?.reduce_scatter(t, op)
    }

    /// Counts a call of `kind` on `t` (this rank's tensor) in [`ProcessGroup::comm_stats`].
    fn count(&self, kind: Collective, t: &Tensor) {
        if self.size > 1 {
            self.stats.borrow_mut().add(kind, super::byte_size(t));
        }
    }

    /// What this group's collectives and messages moved so far, from this rank's side (calls,
    /// and the bytes of this rank's tensors).
    pub fn comm_stats(&self) -> CommStats {
        *self.stats.borrow()
    }

    pub fn barrier(&self) -> Result<()> {
        self.cpu.barrier()
    }

    /// For each of `flags`, whether any rank of the group raised it: the training loop's control
    /// decisions (a stop a signal asked for, a checkpoint the clock says is due), which every rank
    /// must take at the same step. One small CPU all-reduce; not counted in
    /// [`ProcessGroup::comm_stats`], which are the model's traffic.
    pub fn any_of(&self, flags: &[bool]) -> Result<Vec<bool>> {
        let raised = self.max_of(&flags.iter().map(|&f| f as u8 as f64).collect::<Vec<f64>>())?;
        Ok(raised.into_iter().map(|v| v > 0.0).collect())
    }

    /// For each of `values`, the largest any rank of the group has: as [`ProcessGroup::any_of`],
    /// for decisions that carry a number (which signal stops the job). Exact for integers up to
    /// 2^53.
    pub fn max_of(&self, values: &[f64]) -> Result<Vec<f64>> {
        if self.size == 1 {
            return Ok(values.to_vec());
        }
        let mut raised = Tensor::from_slice(values);
        self.cpu.all_reduce(&mut raised, ReduceOp::Max)?;
        Ok(Vec::<f64>::try_from(&raised)?)
    }

    /// Hands `t` over for rank `dst` of this group without waiting (see [`Collectives::send`]).
    pub fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.count(Collective::Send, t);
        self.backend_for(t.device())?.send(t, dst)
    }

    /// Receives the next message from rank `src` of this group into `t` (see
    /// [`Collectives::recv`]); the sender's tensor must have been on the same device type.
    pub fn recv(&self, t: &mut Tensor, src: usize) -> Result<()> {
        self.count(Collective::Recv, t);
        self.backend_for(t.device())?.recv(t, src)
    }

    /// The rank of the next point-to-point message to this rank from any rank of the group, once
    /// one is there (it stays queued for [`ProcessGroup::recv`]); CPU messages, MPI only.
    pub fn probe_any(&self) -> Result<usize> {
        self.cpu.probe_any_source()
    }

    /// Waits until every tensor this rank sent in this group, on either device type, has been
    /// received.
    pub fn wait_sends(&self) -> Result<()> {
        self.cuda.wait_sends()?;
        self.cpu.wait_sends()
    }

    /// Rank `root`'s `bytes` on every rank (what other ranks pass is ignored).
    pub fn broadcast_bytes(&self, bytes: &[u8], root: usize) -> Result<Vec<u8>> {
        super::broadcast_bytes(&*self.cpu, Device::Cpu, bytes, root)
    }
}

/// The kinds of communication a group counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    AllReduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    Send,
    Recv,
}

/// Traffic a rank counts beyond its groups' own (a parameter-server worker's pushes and pulls to
/// its servers): what [`super::layout::Groups::comm_stats`] adds to its groups'. The mesh knows
/// no strategy; a strategy with links of its own hands them over as this.
pub trait Traffic {
    fn comm_stats(&self) -> CommStats;
}

/// Calls and bytes per kind of communication (this rank's side).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CommStats {
    pub all_reduce: Counted,
    pub broadcast: Counted,
    pub all_gather: Counted,
    pub reduce_scatter: Counted,
    pub send: Counted,
    pub recv: Counted,
}

/// How often, and how many bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counted {
    pub calls: u64,
    pub bytes: u64,
}

impl CommStats {
    fn add(&mut self, kind: Collective, bytes: usize) {
        let counted = match kind {
            Collective::AllReduce => &mut self.all_reduce,
            Collective::Broadcast => &mut self.broadcast,
            Collective::AllGather => &mut self.all_gather,
            Collective::ReduceScatter => &mut self.reduce_scatter,
            Collective::Send => &mut self.send,
            Collective::Recv => &mut self.recv,
        };
        counted.calls += 1;
        counted.bytes += bytes as u64;
    }

    /// Both counts together.
    pub fn plus(self, other: CommStats) -> CommStats {
        let sum = |a: Counted, b: Counted| Counted { calls: a.calls + b.calls, bytes: a.bytes + b.bytes };
        CommStats {
            all_reduce: sum(self.all_reduce, other.all_reduce),
            broadcast: sum(self.broadcast, other.broadcast),
            all_gather: sum(self.all_gather, other.all_gather),
            reduce_scatter: sum(self.reduce_scatter, other.reduce_scatter),
            send: sum(self.send, other.send),
            recv: sum(self.recv, other.recv),
        }
    }

    /// One line for logs: each kind used, with its calls and MiB.
    pub fn describe(&self) -> String {
        let kinds = [
            ("all-reduce", self.all_reduce),
            ("broadcast", self.broadcast),
            ("all-gather", self.all_gather),
            ("reduce-scatter", self.reduce_scatter),
            ("send", self.send),
            ("recv", self.recv),
        ];
        let used: Vec<String> = kinds
            .iter()
            .filter(|(_, c)| c.calls > 0)
            .map(|(name, c)| format!("{name} {} calls / {:.2} MiB", c.calls, c.bytes as f64 / (1024.0 * 1024.0)))
            .collect();
        if used.is_empty() {
            "none".into()
        } else {
            used.join(", ")
        }
    }

    /// An `n`-th of every count (what one of `n` alike steps moved).
    pub fn per(self, n: u64) -> CommStats {
        let part = |c: Counted| Counted { calls: c.calls / n.max(1), bytes: c.bytes / n.max(1) };
        CommStats {
            all_reduce: part(self.all_reduce),
            broadcast: part(self.broadcast),
            all_gather: part(self.all_gather),
            reduce_scatter: part(self.reduce_scatter),
            send: part(self.send),
            recv: part(self.recv),
        }
    }

    /// What happened between `earlier` and now.
    pub fn since(self, earlier: CommStats) -> CommStats {
        let less = |a: Counted, b: Counted| Counted { calls: a.calls - b.calls, bytes: a.bytes - b.bytes };
        CommStats {
            all_reduce: less(self.all_reduce, earlier.all_reduce),
            broadcast: less(self.broadcast, earlier.broadcast),
            all_gather: less(self.all_gather, earlier.all_gather),
            reduce_scatter: less(self.reduce_scatter, earlier.reduce_scatter),
            send: less(self.send, earlier.send),
            recv: less(self.recv, earlier.recv),
        }
    }
}

/// The GPU of the rank with `local_rank` on its node.
fn cuda_index(local_rank: usize) -> usize {
    local_rank % tch::Cuda::device_count().max(1) as usize
}

/// Prints `err` as this rank's and ends every rank of the job with its exit code.
#[cfg(feature = "mpi")]
fn abort_job(mpi: &MpiCollectives, rank: usize, err: &anyhow::Error) -> ! {
    let code = crate::error::exit_code(err);
    // One line reaches the user, not one per rank: the job ends (MPI_Abort) as soon as the rank
    // that reports has written it. A usage error is most often every rank's (the same flags):
    // rank 0 says it, the others wait 20 s first (long enough for a loaded rank 0 to get there; a
    // mistake only they see is still said, later). Any other error may be seen by several ranks
    // at once (one failed, the others then lost it): the lowest of them says it, each higher rank
    // waiting a moment longer (0.2 s a rank, at most 2 s), so that the rank that failed first,
    // or the lowest that saw it, is the one heard.
    let wait = match code {
        2 if rank != 0 => std::time::Duration::from_secs(20),
        2 => std::time::Duration::ZERO,
        _ => std::time::Duration::from_millis(200 * rank.min(10) as u64),
    };
    std::thread::sleep(wait);
    crate::error::say(&format!("error on rank {rank}: {}", crate::error::first_line(err)));
    mpi.abort(code.into())
}

#[cfg(feature = "mpi")]
fn start_mpi(env: &LaunchEnv) -> Result<MpiCollectives> {
    // MPI_Init waits for every rank, for ever: a rank that never comes is named past the deadline.
    let deadline = super::startup::Deadline::arm(env);
    let mpi = MpiCollectives::init()?;
    drop(deadline);
    let (size, rank) = (mpi.size(), mpi.rank());
    if size == 1 && env.world_size > 1 {
        return usage(format!("the launcher started {} ranks but MPI sees 1: start them with mpirun/srun --mpi=pmix, or use --backend nccl", env.world_size));
    }
    if (size, rank) != (env.world_size, env.rank) {
        bail!("MPI says rank {rank} of {size}, but the {} environment says rank {} of {}", env.source, env.rank, env.world_size);
    }
    Ok(mpi)
}

/// The engine for each device type, `(cpu, cuda)`, of a group of `size` ranks with the
/// engines `mpi` and `nccl` (as the table in the module docs): an engine of the device's own,
/// else the other device's engine through a copy, else the identities of a world of one.
fn route(
    env: &LaunchEnv,
    size: usize,
    mpi: Option<Rc<dyn Collectives>>,
    nccl: Option<Rc<dyn Collectives>>,
) -> Result<(Rc<dyn Collectives>, Rc<dyn Collectives>)> {
    let single = || Rc::new(SingleProcess) as Rc<dyn Collectives>;
    let staged = |engine: &Rc<dyn Collectives>, via| Rc::new(Staged { engine: engine.clone(), via }) as Rc<dyn Collectives>;
    let cpu = match (&mpi, &nccl) {
        (Some(mpi), _) => mpi.clone(),
        (None, _) if size == 1 => single(),
        (None, Some(nccl)) => staged(nccl, Device::Cuda(cuda_index(env.local_rank))),
        (None, None) => return Err(no_engine(env).into()),
    };
    let cuda = match (&nccl, &mpi) {
        (Some(nccl), _) => nccl.clone(),
        (None, Some(mpi)) => staged(mpi, Device::Cpu),
        (None, None) => single(), // one rank: multi-rank groups have an engine (checked above)
    };
    Ok((cpu, cuda))
}

/// NCCL for this rank's GPU, as `rank` of a group of `size` (the job, or a sub-group); its
/// unique id is made on the group's rank 0 and sent to the others through the group's MPI
/// communicator when there is one, else over TCP to `MASTER_ADDR:MASTER_PORT` (as torch's
/// `env://`; the whole job only).
#[cfg(feature = "nccl")]
fn start_nccl(env: &LaunchEnv, rank: usize, size: usize, mpi: Option<&dyn Collectives>) -> Result<Rc<dyn Collectives>> {
    use super::nccl::{nccl_unique_id, NcclCollectives};
    let id = if rank == 0 { nccl_unique_id()? } else { Vec::new() };
    let id = match (size > 1, mpi, &env.master) {
        (false, _, _) => id,
        (true, Some(mpi), _) => super::broadcast_bytes(mpi, Device::Cpu, &id, 0)?,
        (true, None, Some((addr, port))) => super::rendezvous::exchange_root_bytes(
            rank,
            size,
            addr,
            // torchrun's agent already serves its own store on MASTER_PORT: meet next to it.
            if env.source == LaunchSource::Torchrun { port + 1 } else { *port },
            (rank == 0).then_some(id),
            // Ranks of a batch job may start minutes apart on a busy cluster: --startup-timeout.
            super::startup::timeout(),
        )?,
        (true, None, None) => {
            return usage(format!("NCCL's ranks meet at MASTER_ADDR:MASTER_PORT when {} starts them without MPI: set both (torchrun does)", env.source))
        }
    };
    let gpus = tch::Cuda::device_count().max(1) as usize;
    match NcclCollectives::new(rank, size, cuda_index(env.local_rank), &id) {
        Ok(nccl) => Ok(Rc::new(nccl)),
        // NCCL's own word for this is "invalid usage": say what it was and what allows it.
        Err(err) if env.local_world_size > gpus && std::env::var_os(super::shared_gpu::HOST_ID_VAR).is_none() => Err(err.context(format!(
            "{} ranks on this node's {gpus} GPU(s): NCCL refuses two ranks on one GPU of one host (--share-gpu allows it, as a check)",
            env.local_world_size
        ))),
        Err(err) => Err(err),
    }
}

#[cfg(not(feature = "nccl"))]
fn start_nccl(_env: &LaunchEnv, _rank: usize, _size: usize, _mpi: Option<&dyn Collectives>) -> Result<Rc<dyn Collectives>> {
    unreachable!("NCCL is only wanted where the binary has it (checked in init_with)")
}

/// Why a binary cannot do what was asked without an optional part.
fn built_without(what: &str, feature: &str, needed_by: &str) -> String {
    format!("{needed_by} needs {what}, but this binary was built without {what} (cargo feature `{feature}`)")
}

/// The error for a multi-rank job that has no engine for CPU tensors.
fn no_engine(env: &LaunchEnv) -> UsageError {
    let n = env.world_size;
    UsageError(if cfg!(feature = "mpi") {
        let launcher = match env.source {
            LaunchSource::Slurm => "srun (without --mpi=pmix)",
            _ => "torchrun",
        };
        format!(
            "{n} ranks need collectives for CPU tensors, but {launcher} started them without MPI: \
             start the ranks with mpirun or srun --mpi=pmix, or train on GPUs with NCCL"
        )
    } else {
        format!(
            "{n} ranks need collectives for CPU tensors, but this binary was built without MPI \
             (cargo feature `mpi`): rebuild it with its default features, or train on GPUs with NCCL"
        )
    })
}

/// An engine reached through another device's memory: each tensor is copied there, the
/// collective runs, and the result is copied back into the caller's tensor. The slow path
/// that lets every device type work with every launcher.
struct Staged {
    engine: Rc<dyn Collectives>,
    via: Device,
}

impl Staged {
    fn stage(&self, tensor: &Tensor) -> Tensor {
        tensor.detach().to_device(self.via)
    }
}

impl Collectives for Staged {
    fn name(&self) -> &'static str {
        self.engine.name()
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        let mut staged = self.stage(tensor);
        self.engine.all_reduce(&mut staged, op)?;
        tch::no_grad(|| tensor.copy_(&staged));
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        let mut staged = self.stage(tensor);
        self.engine.broadcast(&mut staged, root)?;
        tch::no_grad(|| tensor.copy_(&staged));
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let gathered = self.engine.all_gather(&self.stage(tensor))?;
        Ok(gathered.iter().map(|t| t.to_device(tensor.device())).collect())
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        Ok(self.engine.reduce_scatter(&self.stage(tensor), op)?.to_device(tensor.device()))
    }

    fn barrier(&self) -> Result<()> {
        self.engine.barrier()
    }

    /// The staged copy is the engine's to keep until the send completes: the caller's tensor
    /// may change at once.
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        self.engine.send(&self.stage(tensor), dst)
    }

    fn recv(&self, tensor: &mut Tensor, src: usize) -> Result<()> {
        let mut staged = Tensor::empty(tensor.size(), (tensor.kind(), self.via));
        self.engine.recv(&mut staged, src)?;
        tch::no_grad(|| tensor.copy_(&staged));
        Ok(())
    }

    fn wait_sends(&self) -> Result<()> {
        self.engine.wait_sends()
    }

    fn supports_kind(&self, kind: Kind) -> bool {
        self.engine.supports_kind(kind)
    }
}
