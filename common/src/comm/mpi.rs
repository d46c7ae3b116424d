//! Collectives and point-to-point messages on CPU tensors over `MPI_COMM_WORLD` or a
//! communicator split from it (OpenMPI, MPICH, Intel MPI), through the `mpi` crate: the engine
//! of Horovod's CPU path and of `torch.distributed`'s `mpi` backend.
//!
//! MPI works on host memory of its own types: tensors of kinds float32, float64, int64, int32
//! and uint8 are passed as slices of their memory (a contiguous copy is made for other layouts
//! and the result copied back, so the caller's tensor is always updated in place). Other kinds,
//! float16 among them, have no MPI type and are refused with an error naming the kind.
//!
//! Point-to-point messages carry a tensor's bytes, so they take every kind. `send` is
//! `MPI_Isend` (the request and the tensor are kept until `wait_sends`, or until a later call
//! finds the request complete); `recv` probes the next message first (`MPI_Mprobe`) and refuses
//! one whose size differs from the receiving tensor's, which MPI itself would treat as a fatal
//! error or silently accept. Only the byte count can be checked: a tensor of another shape or
//! kind with the same number of bytes is received as its bytes.
//!
//! Nothing waits forever: every operation is started non-blocking (`MPI_Iallreduce`,
//! `MPI_Improbe`, ...) and polled against [`watchdog`]'s deadline; a rank that never comes is
//! named and the job ended (see [`MpiCollectives::declare_hung`]). A wait also ends, with
//! [`crate::error::Orphaned`], once the rank's launcher is gone ([`super::orphan`]).
use std::cell::{Cell, RefCell};
use std::ffi::c_int;
use std::mem::MaybeUninit;
use std::rc::Rc;
use std::time::{Duration, Instant};

use ::mpi::collective::SystemOperation;
use ::mpi::environment::Universe;
use ::mpi::ffi;
use ::mpi::raw::AsRaw;
use ::mpi::topology::{Color, SimpleCommunicator};
use ::mpi::traits::*;
use ::mpi::Threading;
use anyhow::{anyhow, bail, Result};
use tch::{Device, Kind, Tensor};

use super::watchdog::{self, Hang};
use super::{byte_size, check_peer, check_reduce, check_root, check_scatter, Collectives, ReduceOp};

/// MPI counts elements in a C `int`: longer buffers are sent in pieces of at most this many.
const MAX_COUNT: usize = i32::MAX as usize;

/// The tag of every point-to-point message: one stream per pair of ranks, in order.
const P2P_TAG: c_int = 0;
/// The tag of the watchdog's roll call (on a communicator of its own).
const WATCH_TAG: c_int = 7;

/// Marks a roll-call answer from a rank that is waiting but has not timed out itself
/// ([`MpiCollectives::answer_roll_call`]); the rest of the word is its operation's number.
const WAITING: u64 = 1 << 63;

thread_local! {
    /// Every live communicator's watch (the roll call's communicator) and its operation counter,
    /// so that a rank waiting in any of them answers a roll call on any of them. MPI is used from
    /// one thread ([`Threading::Funneled`]): this thread's.
    static WATCHES: RefCell<Vec<(ffi::MPI_Comm, Rc<Cell<u64>>)>> = const { RefCell::new(Vec::new()) };
}

/// One communicator of this process's MPI: `MPI_COMM_WORLD`, or a sub-communicator made by
/// [`MpiCollectives::split`].
///
/// MPI is initialised when the world's value is created ([`MpiCollectives::init`]) and finalised
/// when the last value sharing it is dropped: the world's, as long as sub-groups are dropped
/// before it (a sub-group that outlives the world keeps MPI up until it goes). MPI cannot be
/// initialised again afterwards.
///
/// MPI is initialised with thread level `MPI_THREAD_FUNNELED`: only the thread that created
/// this value may call its collectives (LibTorch's own worker threads never call MPI).
pub struct MpiCollectives {
    comm: SimpleCommunicator,
    /// A duplicate of `comm` for the watchdog's roll call, so that it never meets a message of
    /// the program's.
    watch: SimpleCommunicator,
    /// The job (world) rank of each rank of `comm`, to name them.
    world_ranks: Vec<usize>,
    /// Operations started on `comm` so far (shared with [`WATCHES`], which answers roll calls).
    seq: Rc<Cell<u64>>,
    /// Sends handed to MPI that may not have completed yet.
    pending: RefCell<Vec<PendingSend>>,
    /// Dropped after `comm` (freed first when it is a sub-communicator); the last clone's drop
    /// is `MPI_Finalize`.
    _universe: Rc<Universe>,
}

/// An `MPI_Isend` in flight and the tensor whose memory it reads, kept alive until it completes.
struct PendingSend {
    request: ffi::MPI_Request,
    _data: Tensor,
}

impl MpiCollectives {
    /// Initialises MPI (`MPI_Init_thread`) and returns `MPI_COMM_WORLD`. Fails if MPI was
    /// initialised before in this process.
    pub fn init() -> Result<MpiCollectives> {
        let Some((universe, provided)) = ::mpi::initialize_with_threading(Threading::Funneled) else {
            bail!("MPI was already initialised in this process (one ProcessGroup per process; MPI cannot be restarted once finalised)");
        };
        if provided < Threading::Funneled {
            bail!("the MPI library offers thread level {provided:?}, but LibTorch's threads need at least Funneled");
        }
        let world = MpiCollectives::on(universe.world(), Rc::new(universe));
        super::hosts::record(world.gather_hosts());
        Ok(world)
    }

    /// Every rank's host name, in rank order: one blocking `MPI_Allgather` of fixed-size names
    /// at start-up, outside the watchdog's numbering (MPI_Init itself blocks the same way), so
    /// that a hang's line and the results can say where each rank ran.
    fn gather_hosts(&self) -> Vec<String> {
        let mine = super::hosts::to_bytes(&super::hosts::this_host());
        let mut all = vec![0u8; mine.len() * self.size()];
        self.comm.all_gather_into(&mine[..], &mut all[..]);
        all.chunks(mine.len()).map(super::hosts::from_bytes).collect()
    }

    fn on(comm: SimpleCommunicator, universe: Rc<Universe>) -> MpiCollectives {
        let watch = comm.duplicate();
        let world_ranks = world_ranks(&comm);
        let seq = Rc::new(Cell::new(0));
        WATCHES.with(|w| w.borrow_mut().push((watch.as_raw(), seq.clone())));
        MpiCollectives { comm, watch, world_ranks, seq, pending: RefCell::default(), _universe: universe }
    }

    /// The ranks of this communicator that pass the same `color`, ordered by `key` (ties by
    /// their rank here): `MPI_Comm_split`. Every rank of this communicator must call it.
    pub fn split(&self, color: usize, key: usize) -> Result<MpiCollectives> {
        let as_int = |what: &str, value: usize| c_int::try_from(value).map_err(|_| anyhow!("a sub-group {what} must be at most {}, not {value}", c_int::MAX));
        let (color, key) = (as_int("color", color)?, as_int("key", key)?);
        let Some(comm) = self.comm.split_by_color_with_key(Color::with_value(color), key) else {
            bail!("MPI_Comm_split returned no communicator for color {color}");
        };
        Ok(MpiCollectives::on(comm, self._universe.clone()))
    }

    /// This process's rank in the communicator.
    pub fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    /// The number of ranks in the communicator.
    pub fn size(&self) -> usize {
        self.comm.size() as usize
    }

    /// Ends every rank of the job now (`MPI_Abort` on the world, whichever communicator this
    /// is), with `code` as the launcher's exit status.
    pub fn abort(&self, code: i32) -> ! {
        SimpleCommunicator::world().abort(code)
    }

    /// Forgets the sends that have completed, so that the list stays as long as the messages
    /// still in flight (a schedule may never call `wait_sends` between many sends).
    fn forget_completed_sends(&self) -> Result<()> {
        let mut pending = self.pending.borrow_mut();
        let mut i = 0;
        while i < pending.len() {
            let mut done: c_int = 0;
            // SAFETY: the request is live (not yet completed: completed ones are removed).
            let code = unsafe { ffi::MPI_Test(&mut pending[i].request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            check_code(code, "MPI_Test on a send")?;
            if done != 0 {
                pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Receives the next message from `src` into the `len` bytes at `dst` if it has exactly
    /// that many bytes, and returns its size. A message of another size is taken out of the
    /// queue into a scratch buffer and dropped (the stream stays in step, and the caller
    /// reports the mismatch) instead of overrunning `dst`.
    ///
    /// # Safety
    /// `dst` must point to `len` writable bytes that nothing else uses during the call.
    unsafe fn receive_piece(&self, dst: *mut u8, len: usize, src: usize) -> Result<usize> {
        let mut message = ffi::RSMPI_MESSAGE_NULL;
        let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
        let comm = self.comm.as_raw();
        self.wait_until(&format!("receive from rank {}", self.world_ranks[src]), || {
            let mut found: c_int = 0;
            check_code(ffi::MPI_Improbe(src as c_int, P2P_TAG, comm, &mut found, &mut message, status.as_mut_ptr()), "MPI_Improbe")?;
            Ok(found != 0)
        })?;
        let mut count: c_int = 0;
        let code = ffi::MPI_Get_count(status.as_ptr(), ffi::RSMPI_UINT8_T, &mut count);
        check_code(code, "MPI_Get_count")?;
        let size = usize::try_from(count)?;
        let mut scratch = Vec::new();
        let into = if size == len {
            dst
        } else {
            scratch.resize(size, 0u8);
            scratch.as_mut_ptr()
        };
        let mut request = null_request();
        check_code(ffi::MPI_Imrecv(into.cast(), count, ffi::RSMPI_UINT8_T, &mut message, &mut request), "MPI_Imrecv")?;
        self.complete(&mut request, &format!("receive from rank {}", self.world_ranks[src]))?;
        Ok(size)
    }
}

/// Waiting against the deadline.
impl MpiCollectives {
    /// Polls `ready` until it says the operation `op` (just started) is done; past the deadline
    /// the job ends ([`MpiCollectives::declare_hung`]). Polls spin briefly, then yield (ranks
    /// may share cores), then sleep a little (a long wait need not burn a core).
    fn wait_until(&self, op: &str, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
        let seq = self.seq.get() + 1;
        self.seq.set(seq);
        let started = Instant::now();
        let deadline = watchdog::deadline(seq);
        let stalled = watchdog::stalled(self.world_ranks[self.rank()], seq);
        for polls in 0u64.. {
            if ready()? && !stalled {
                return Ok(());
            }
            if polls % 1024 == 1023 {
                if started.elapsed() >= deadline {
                    self.declare_hung(op, seq, started.elapsed());
                }
                // The launcher is gone: the ranks stop, and the others may have stopped already.
                if let Some(gone) = super::orphan::gone() {
                    return Err(crate::error::Orphaned { gone: gone.to_string(), at: format!("in {op}") }.into());
                }
                self.answer_roll_call(None);
            }
            match polls {
                0..64 => std::hint::spin_loop(),
                64..4096 => std::thread::yield_now(),
                _ => std::thread::sleep(Duration::from_micros(100)),
            }
        }
        unreachable!("the polls never run out")
    }

    /// Waits for the non-blocking operation `request` (just started) against the deadline.
    fn complete(&self, request: &mut ffi::MPI_Request, op: &str) -> Result<()> {
        self.wait_until(op, || {
            let mut done: c_int = 0;
            // SAFETY: a live request of this process; MPI marks it completed when done.
            check_code(unsafe { ffi::MPI_Test(request, &mut done, ffi::RSMPI_STATUS_IGNORE) }, op)?;
            Ok(done != 0)
        })
    }

    /// A rank of some communicator this process belongs to waited past its deadline and calls
    /// the roll ([`MpiCollectives::declare_hung`]): this rank, waiting in an operation of any of
    /// its communicators (a sub-group's, say, while the roll is called on the world's) but not
    /// past its own deadline, answers at once, so that the roll call blames only the ranks that
    /// are really absent. The answer carries [`WAITING`]: it is not one of the ranks that timed
    /// out, and so not the one to report. Then it goes on waiting; the caller ends the job.
    /// Returns whether it answered one. (`except`: a communicator whose roll call this rank is
    /// calling itself, its answers already awaited by receives of their own.)
    fn answer_roll_call(&self, except: Option<ffi::MPI_Comm>) -> bool {
        let watches: Vec<(ffi::MPI_Comm, Rc<Cell<u64>>)> = WATCHES.with(|w| w.borrow().clone());
        let mut answered = false;
        for (comm, seq) in watches.into_iter().filter(|(comm, _)| Some(*comm) != except) {
            let (mut found, mut status) = (0 as c_int, MaybeUninit::<ffi::MPI_Status>::uninit());
            // SAFETY: a live communicator of this process; MPI fills `status` in when it finds a message.
            unsafe { ffi::MPI_Iprobe(ffi::RSMPI_ANY_SOURCE, WATCH_TAG, comm, &mut found, status.as_mut_ptr()) };
            if found == 0 {
                continue;
            }
            // SAFETY: found, so filled in.
            let source = unsafe { status.assume_init() }.MPI_SOURCE;
            let (mut theirs, mine) = ([0u64], [seq.get() | WAITING]);
            // SAFETY: one u64 each way; a send of one word completes eagerly on every MPI.
            unsafe {
                ffi::MPI_Recv(theirs.as_mut_ptr().cast(), 1, ffi::RSMPI_UINT64_T, source, WATCH_TAG, comm, ffi::RSMPI_STATUS_IGNORE);
                ffi::MPI_Send(mine.as_ptr().cast(), 1, ffi::RSMPI_UINT64_T, source, WATCH_TAG, comm);
            }
            answered = true;
        }
        answered
    }

    /// `op`, operation `seq` of this communicator, waited past its deadline: the ranks that are
    /// waiting too (they time out at about the same moment) call the roll on the watchdog's
    /// communicator, each sending the others its operation number; after [`watchdog::grace`],
    /// the lowest rank that answered says which did not ([`Hang`]) and every one of them ends
    /// the job (the others a moment later, so that the line is out first).
    fn declare_hung(&self, op: &str, seq: u64, waited: Duration) -> ! {
        let (me, size) = (self.rank(), self.size());
        let mine = [seq];
        let mut answers = vec![[0u64]; size];
        let mut requests = Vec::with_capacity(2 * size);
        let comm = self.watch.as_raw();
        for (rank, answer) in answers.iter_mut().enumerate().filter(|(rank, _)| *rank != me) {
            let mut request = null_request();
            // SAFETY: `answer` and `mine` outlive the requests (the process ends below).
            unsafe {
                ffi::MPI_Irecv(answer.as_mut_ptr().cast(), 1, ffi::RSMPI_UINT64_T, rank as c_int, WATCH_TAG, comm, &mut request);
                requests.push((rank, request));
                let mut send = null_request();
                ffi::MPI_Isend(mine.as_ptr().cast(), 1, ffi::RSMPI_UINT64_T, rank as c_int, WATCH_TAG, comm, &mut send);
            }
        }
        let until = Instant::now() + watchdog::grace();
        let mut answered = vec![false; size];
        answered[me] = true;
        // A roll call on another of this process's communicators (the world's, while this one is
        // a sub-group's) is answered too; its caller, who sees the whole job, then reports.
        let mut another_reports = false;
        while Instant::now() < until && (answered.iter().any(|a| !a) || !another_reports) {
            another_reports |= self.answer_roll_call(Some(comm));
            for (rank, request) in requests.iter_mut() {
                if answered[*rank] {
                    continue;
                }
                let mut done: c_int = 0;
                // SAFETY: a live receive request of this process.
                unsafe { ffi::MPI_Test(request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
                answered[*rank] = done != 0;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        answers[me] = mine;
        let hang = Hang {
            op: op.to_string(),
            seq,
            group_size: size,
            waited,
            answered: (0..size).filter(|&r| answered[r]).map(|r| (self.world_ranks[r], answers[r][0] & !WAITING)).collect(),
            silent: (0..size).filter(|&r| !answered[r]).map(|r| self.world_ranks[r]).collect(),
        };
        // The lowest of the ranks that timed out reports (one that only answered, waiting short
        // of its deadline, goes on waiting and is ended with the job).
        let timed_out = |r: usize| answered[r] && answers[r][0] & WAITING == 0;
        if (0..size).find(|&r| timed_out(r)) == Some(me) && !another_reports {
            let stake = watchdog::at_stake().map(|s| format!(" ({s})")).unwrap_or_default();
            crate::error::say(&format!("error on rank {}: {hang}{stake}", self.world_ranks[me]));
        } else {
            std::thread::sleep(Duration::from_secs(2));
        }
        self.abort(watchdog::HUNG_EXIT_CODE)
    }
}

impl MpiCollectives {
    /// Waits for the next point-to-point message from any rank of the communicator and returns
    /// the sender's rank, leaving the message queued for [`Collectives::recv`] (`MPI_Probe`
    /// with `MPI_ANY_SOURCE`): a parameter server serves whichever worker sends first.
    pub fn probe_any(&self) -> Result<usize> {
        self.forget_completed_sends()?;
        let mut status = MaybeUninit::<ffi::MPI_Status>::uninit();
        let comm = self.comm.as_raw();
        self.wait_until("probe for a message from any rank", || {
            let mut found: c_int = 0;
            // SAFETY: a valid communicator and a status MPI writes when it finds a message.
            check_code(unsafe { ffi::MPI_Iprobe(ffi::RSMPI_ANY_SOURCE, P2P_TAG, comm, &mut found, status.as_mut_ptr()) }, "MPI_Iprobe")?;
            Ok(found != 0)
        })?;
        // SAFETY: MPI_Iprobe found a message, so it filled the status in.
        let status = unsafe { status.assume_init() };
        Ok(usize::try_from(status.MPI_SOURCE)?)
    }
}

impl Drop for MpiCollectives {
    fn drop(&mut self) {
        let watch = self.watch.as_raw();
        WATCHES.with(|w| w.borrow_mut().retain(|(comm, _)| *comm != watch));
        // Unwinding from a panic: the other ranks would wait for this one in their next
        // collective (or in MPI_Finalize) forever. Take the whole job down instead.
        if std::thread::panicking() {
            let rank = SimpleCommunicator::world().rank();
            eprintln!("rank {rank} panicked: aborting the MPI job");
            self.abort(101);
        }
        // Sends in flight read tensors owned here, and must complete before the communicator
        // is freed and MPI finalised: wait for their receivers.
        if let Err(err) = self.wait_sends() {
            eprintln!("warning: MPI rank {}: completing the outstanding sends failed: {err:#}", self.rank());
        }
    }
}

/// A request handle before MPI fills it in.
fn null_request() -> ffi::MPI_Request {
    // SAFETY: a constant MPI defines, read only.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// The job (world) rank of each rank of `comm`.
fn world_ranks(comm: &SimpleCommunicator) -> Vec<usize> {
    let size = comm.size();
    let ranks: Vec<c_int> = (0..size).collect();
    let mut world = vec![0 as c_int; size as usize];
    let (mut group, mut world_group) = (MaybeUninit::uninit(), MaybeUninit::uninit());
    // SAFETY: valid communicators; MPI writes the groups and `world` (size entries) before
    // returning; the groups are freed after.
    unsafe {
        ffi::MPI_Comm_group(comm.as_raw(), group.as_mut_ptr());
        ffi::MPI_Comm_group(ffi::RSMPI_COMM_WORLD, world_group.as_mut_ptr());
        let (mut group, mut world_group) = (group.assume_init(), world_group.assume_init());
        ffi::MPI_Group_translate_ranks(group, size, ranks.as_ptr(), world_group, world.as_mut_ptr());
        ffi::MPI_Group_free(&mut group);
        ffi::MPI_Group_free(&mut world_group);
    }
    world.into_iter().map(|r| r.max(0) as usize).collect()
}

/// An error for an MPI return code other than `MPI_SUCCESS` (MPI's default error handler ends
/// the job before returning one, but a program may install another).
fn check_code(code: c_int, call: &str) -> Result<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        bail!("{call} failed with MPI error code {code}")
    }
}

/// The (offset, length) pieces in which a message of `bytes` bytes travels: MPI counts in a C
/// `int`. An empty tensor is one empty piece, so that every send is a message to match.
fn pieces(bytes: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = bytes.div_ceil(MAX_COUNT).max(1);
    (0..n).map(move |i| {
        let start = i * MAX_COUNT;
        (start, (bytes - start).min(MAX_COUNT))
    })
}

/// Runs `$body` with `$T` the Rust element type of `$kind`, or fails for kinds MPI lacks.
macro_rules! with_element_type {
    ($kind:expr, $T:ident => $body:expr) => {
        match $kind {
            Kind::Float => {
                type $T = f32;
                $body
            }
            Kind::Double => {
                type $T = f64;
                $body
            }
            Kind::Int64 => {
                type $T = i64;
                $body
            }
            Kind::Int => {
                type $T = i32;
                $body
            }
            Kind::Uint8 => {
                type $T = u8;
                $body
            }
            other => bail!(
                "MPI collectives take float32, float64, int64, int32 or uint8 tensors, not {other:?}{}",
                if other == Kind::Half { " (float16 needs NCCL)" } else { "" }
            ),
        }
    };
}

/// `tensor`'s values as a contiguous CPU tensor without autograd: `tensor`'s own memory when
/// it is laid out that way already, else a copy.
fn host(tensor: &Tensor) -> Result<Tensor> {
    if tensor.device() != Device::Cpu {
        bail!("MPI collectives take CPU tensors, not {:?} ones (the ProcessGroup copies others through the CPU)", tensor.device());
    }
    Ok(tensor.detach().contiguous())
}

/// Writes `result` into `tensor` unless it already is `tensor`'s memory.
fn copy_back(tensor: &mut Tensor, result: &Tensor) {
    if result.data_ptr() != tensor.data_ptr() {
        tch::no_grad(|| tensor.copy_(result));
    }
}

/// The elements of a contiguous CPU tensor.
///
/// # Safety
/// `tensor` must be contiguous, on the CPU, with elements of type `T`, and its memory must not
/// be written through another path while the slice lives.
unsafe fn elements<T>(tensor: &Tensor) -> &[T] {
    match tensor.numel() {
        0 => &[],
        n => std::slice::from_raw_parts(tensor.data_ptr() as *const T, n),
    }
}

/// [`elements`], writable.
///
/// # Safety
/// As for [`elements`], and no other reference to the memory may be used while the slice lives.
unsafe fn elements_mut<T>(tensor: &mut Tensor) -> &mut [T] {
    match tensor.numel() {
        0 => &mut [],
        n => std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut T, n),
    }
}

/// MPI's operation for `op` (an average is a sum, divided afterwards).
fn mpi_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Average => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
    }
}

impl Collectives for MpiCollectives {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        check_reduce(tensor.kind(), op)?;
        let send = host(tensor)?;
        let mut sum = send.empty_like();
        with_element_type!(send.kind(), T => {
            // SAFETY: both are fresh contiguous CPU tensors of kind T; `sum` is a separate allocation.
            let (src, dst) = unsafe { (elements::<T>(&send), elements_mut::<T>(&mut sum)) };
            for (src, dst) in src.chunks(MAX_COUNT).zip(dst.chunks_mut(MAX_COUNT)) {
                let mut request = null_request();
                // SAFETY: both slices outlive the request, which completes before they are used.
                check_code(unsafe { ffi::MPI_Iallreduce(src.as_ptr().cast(), dst.as_mut_ptr().cast(), src.len() as c_int, T::equivalent_datatype().as_raw(), mpi_op(op).as_raw(), self.comm.as_raw(), &mut request) }, "MPI_Iallreduce")?;
                self.complete(&mut request, "all_reduce")?;
            }
        });
        if op == ReduceOp::Average {
            // In the tensor's own kind, as torch.distributed's ReduceOp.AVG does.
            let _ = sum.g_div_scalar_(self.size() as f64);
        }
        tch::no_grad(|| tensor.copy_(&sum));
        Ok(())
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        check_root(root, self.size())?;
        let mut buffer = host(tensor)?;
        with_element_type!(buffer.kind(), T => {
            // SAFETY: `buffer` is contiguous, on the CPU, of kind T, and only MPI writes it here.
            let data = unsafe { elements_mut::<T>(&mut buffer) };
            for piece in data.chunks_mut(MAX_COUNT) {
                let mut request = null_request();
                // SAFETY: the piece outlives the request, which completes before it is used.
                check_code(unsafe { ffi::MPI_Ibcast(piece.as_mut_ptr().cast(), piece.len() as c_int, T::equivalent_datatype().as_raw(), root as c_int, self.comm.as_raw(), &mut request) }, "MPI_Ibcast")?;
                self.complete(&mut request, &format!("broadcast from rank {}", self.world_ranks[root]))?;
            }
        });
        copy_back(tensor, &buffer);
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let send = host(tensor)?;
        if send.numel() * self.size() > MAX_COUNT {
            bail!("all_gather of {} elements from {} ranks exceeds MPI's count limit", send.numel(), self.size());
        }
        let mut shape = vec![self.size() as i64];
        shape.extend(send.size());
        let mut gathered = Tensor::empty(shape.as_slice(), (send.kind(), Device::Cpu));
        with_element_type!(send.kind(), T => {
            // SAFETY: both are contiguous CPU tensors of kind T; `gathered` is a fresh allocation.
            let (src, dst) = unsafe { (elements::<T>(&send), elements_mut::<T>(&mut gathered)) };
            if !src.is_empty() {
                let (count, datatype) = (src.len() as c_int, T::equivalent_datatype().as_raw());
                let mut request = null_request();
                // SAFETY: both slices outlive the request, which completes before they are used.
                check_code(unsafe { ffi::MPI_Iallgather(src.as_ptr().cast(), count, datatype, dst.as_mut_ptr().cast(), count, datatype, self.comm.as_raw(), &mut request) }, "MPI_Iallgather")?;
                self.complete(&mut request, "all_gather")?;
            }
        });
        Ok(gathered.unbind(0))
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let block = check_scatter(tensor, op, self.size())?;
        if block > MAX_COUNT {
            bail!("reduce_scatter blocks of {block} elements exceed MPI's count limit");
        }
        let send = host(tensor)?;
        let mut mine = Tensor::empty([block as i64], (send.kind(), Device::Cpu));
        with_element_type!(send.kind(), T => {
            // SAFETY: both are contiguous CPU tensors of kind T; `mine` is a fresh allocation.
            let (src, dst) = unsafe { (elements::<T>(&send), elements_mut::<T>(&mut mine)) };
            if !dst.is_empty() {
                let mut request = null_request();
                // SAFETY: both slices outlive the request, which completes before they are used.
                check_code(unsafe { ffi::MPI_Ireduce_scatter_block(src.as_ptr().cast(), dst.as_mut_ptr().cast(), dst.len() as c_int, T::equivalent_datatype().as_raw(), mpi_op(op).as_raw(), self.comm.as_raw(), &mut request) }, "MPI_Ireduce_scatter_block")?;
                self.complete(&mut request, "reduce_scatter")?;
            }
        });
        if op == ReduceOp::Average {
            let _ = mine.g_div_scalar_(self.size() as f64);
        }
        Ok(mine)
    }

    fn barrier(&self) -> Result<()> {
        let mut request = null_request();
        // SAFETY: a valid communicator; the request completes before returning.
        check_code(unsafe { ffi::MPI_Ibarrier(self.comm.as_raw(), &mut request) }, "MPI_Ibarrier")?;
        self.complete(&mut request, "barrier")
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<()> {
        check_peer("send to", dst, self.rank(), self.size())?;
        self.forget_completed_sends()?;
        // The caller's memory when it is contiguous already (no copy), else a contiguous copy.
        let data = host(tensor)?;
        let base = data.data_ptr() as *const u8;
        let mut pending = self.pending.borrow_mut();
        for (start, len) in pieces(byte_size(&data)) {
            // SAFETY: MPI writes the handle into this before returning.
            let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: the `len` bytes at `start` lie in `data`'s memory, which `pending` keeps
            // alive until MPI reports the request complete.
            let code = unsafe {
                ffi::MPI_Isend(base.wrapping_add(start).cast(), len as c_int, ffi::RSMPI_UINT8_T, dst as c_int, P2P_TAG, self.comm.as_raw(), &mut request)
            };
            check_code(code, "MPI_Isend")?;
            pending.push(PendingSend { request, _data: data.shallow_clone() });
        }
        Ok(())
    }

    fn recv(&self, tensor: &mut Tensor, src: usize) -> Result<()> {
        check_peer("receive from", src, self.rank(), self.size())?;
        self.forget_completed_sends()?;
        let buffer = host(tensor)?;
        let bytes = byte_size(&buffer);
        let base = buffer.data_ptr() as *mut u8;
        for (start, len) in pieces(bytes) {
            // SAFETY: the `len` bytes at `start` lie in `buffer`, a contiguous CPU tensor that
            // only MPI writes during the call.
            let got = unsafe { self.receive_piece(base.wrapping_add(start), len, src)? };
            if got != len {
                bail!(
                    "receive from rank {src}: a message of {got} bytes arrived, but the receiving \
                     {:?} tensor of shape {:?} takes {len} (the ranks disagree on its shape or kind)",
                    buffer.kind(),
                    buffer.size()
                );
            }
        }
        copy_back(tensor, &buffer);
        Ok(())
    }

    fn wait_sends(&self) -> Result<()> {
        let sends = std::mem::take(&mut *self.pending.borrow_mut());
        if sends.is_empty() {
            return Ok(());
        }
        let mut requests: Vec<ffi::MPI_Request> = sends.iter().map(|s| s.request).collect();
        let waited = self.wait_until("the outstanding sends' delivery", || {
            let mut done: c_int = 0;
            // SAFETY: live requests of this process; MPI marks each one completed.
            let code = unsafe { ffi::MPI_Testall(requests.len() as c_int, requests.as_mut_ptr(), &mut done, ffi::RSMPI_STATUSES_IGNORE) };
            check_code(code, "MPI_Testall on the outstanding sends")?;
            Ok(done != 0)
        });
        if waited.is_err() {
            // MPI may still read the tensors: leak them rather than free memory in use.
            std::mem::forget(sends);
        }
        waited
    }

    fn probe_any_source(&self) -> Result<usize> {
        self.probe_any()
    }

    fn supports_kind(&self, kind: Kind) -> bool {
        matches!(kind, Kind::Float | Kind::Double | Kind::Int64 | Kind::Int | Kind::Uint8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages over 2 GiB (too large for the two-rank tests) go in pieces MPI can count.
    #[test]
    fn messages_travel_in_pieces_of_at_most_max_count_bytes() {
        let of = |bytes| pieces(bytes).collect::<Vec<_>>();
        assert_eq!(of(0), [(0, 0)], "an empty tensor is still one message");
        assert_eq!(of(5), [(0, 5)]);
        assert_eq!(of(MAX_COUNT), [(0, MAX_COUNT)]);
        assert_eq!(of(2 * MAX_COUNT + 3), [(0, MAX_COUNT), (MAX_COUNT, MAX_COUNT), (2 * MAX_COUNT, 3)]);
    }
}
