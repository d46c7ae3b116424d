//! Collectives on CPU tensors over `MPI_COMM_WORLD` (OpenMPI, MPICH, Intel MPI), through the
//! `mpi` crate: the engine of Horovod's CPU path and of `torch.distributed`'s `mpi` backend.
//!
//! MPI works on host memory of its own types: tensors of kinds float32, float64, int64, int32
//! and uint8 are passed as slices of their memory (a contiguous copy is made for other layouts
//! and the result copied back, so the caller's tensor is always updated in place). Other kinds,
//! float16 among them, have no MPI type and are refused with an error naming the kind.
use ::mpi::collective::SystemOperation;
use ::mpi::environment::Universe;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use ::mpi::Threading;
use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use super::{check_reduce, check_root, Collectives, ReduceOp};

/// MPI counts elements in a C `int`: longer buffers are sent in pieces of at most this many.
const MAX_COUNT: usize = i32::MAX as usize;

/// `MPI_COMM_WORLD` of this process. There is at most one: MPI is initialised when it is
/// created and finalised when it is dropped, and cannot be initialised again afterwards.
///
/// MPI is initialised with thread level `MPI_THREAD_FUNNELED`: only the thread that created
/// this value may call its collectives (LibTorch's own worker threads never call MPI).
pub struct MpiCollectives {
    world: SimpleCommunicator,
    /// Dropped last: `MPI_Finalize`.
    _universe: Universe,
}

impl MpiCollectives {
    /// Initialises MPI (`MPI_Init_thread`). Fails if MPI was initialised before in this process.
    pub fn init() -> Result<MpiCollectives> {
        let Some((universe, provided)) = ::mpi::initialize_with_threading(Threading::Funneled)
        else {
            bail!("MPI was already initialised in this process (one ProcessGroup per process; MPI cannot be restarted once finalised)");
        };
        if provided < Threading::Funneled {
            bail!("the MPI library offers thread level {provided:?}, but LibTorch's threads need at least Funneled");
        }
        Ok(MpiCollectives {
            world: universe.world(),
            _universe: universe,
        })
    }

    pub fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    pub fn size(&self) -> usize {
        self.world.size() as usize
    }

    /// Ends every rank of the job now (`MPI_Abort`), with `code` as the launcher's exit status.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

impl Drop for MpiCollectives {
    fn drop(&mut self) {
        // Unwinding from a panic: the other ranks would wait for this one in their next
        // collective (or in MPI_Finalize) forever. Take the whole job down instead.
        if std::thread::panicking() {
            eprintln!("rank {} panicked: aborting the MPI job", self.rank());
            self.world.abort(101);
        }
    }
}

/// Runs `$body` with `$T` the Rust element type of `$kind`, or fails for kinds MPI lacks.
macro_rules! with_element_type {
    ($kind:expr, $T:ident => $body:expr) => {
        match $kind {
            Kind::Float => { type $T = f32; $body }
            Kind::Double => { type $T = f64; $body }
            Kind::Int64 => { type $T = i64; $body }
            Kind::Int => { type $T = i32; $body }
            Kind::Uint8 => { type $T = u8; $body }
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
        bail!(
            "MPI collectives take CPU tensors, not {:?} ones (the ProcessGroup copies others through the CPU)",
            tensor.device()
        );
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
                self.world.all_reduce_into(src, dst, SystemOperation::sum());
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
            let root = self.world.process_at_rank(root as i32);
            for piece in data.chunks_mut(MAX_COUNT) {
                root.broadcast_into(piece);
            }
        });
        copy_back(tensor, &buffer);
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let send = host(tensor)?;
        if send.numel() * self.size() > MAX_COUNT {
            bail!(
                "all_gather of {} elements from {} ranks exceeds MPI's count limit",
                send.numel(),
                self.size()
            );
        }
        let mut shape = vec![self.size() as i64];
        shape.extend(send.size());
        let mut gathered = Tensor::empty(shape.as_slice(), (send.kind(), Device::Cpu));
        with_element_type!(send.kind(), T => {
            // SAFETY: both are contiguous CPU tensors of kind T; `gathered` is a fresh allocation.
            let (src, dst) = unsafe { (elements::<T>(&send), elements_mut::<T>(&mut gathered)) };
            if !src.is_empty() {
                self.world.all_gather_into(src, dst);
            }
        });
        Ok(gathered.unbind(0))
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }

    fn supports_kind(&self, kind: Kind) -> bool {
        matches!(
            kind,
            Kind::Float | Kind::Double | Kind::Int64 | Kind::Int | Kind::Uint8
        )
    }
}
