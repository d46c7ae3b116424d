//! NCCL collectives for CUDA tensors (cargo feature `nccl`), through NVIDIA's own library.
//!
//! # Library
//!
//! NCCL's C API is bound at run time with `dlopen` (no CUDA toolkit or NCCL headers are
//! needed to build, and a binary built with this feature still starts on a machine without
//! CUDA; only creating an [`NcclCollectives`] then fails, with a message). Looked up, first
//! match wins:
//!
//! 1. `libnccl.so.2` / `libnccl.so` already loaded into the process: a binary that links
//!    LibTorch's CUDA part (`libtorch_cuda.so`; the exercise binaries do, see
//!    `exercises/build.rs`) already has PyTorch's own NCCL loaded, and that copy is used, so
//!    LibTorch and this module share one NCCL (without `libtorch_cuda.so` LibTorch sees no
//!    GPU at all, and `NcclCollectives::new` says so);
//! 2. `libnccl.so.2` / `libnccl.so` on the dynamic linker's path (`LD_LIBRARY_PATH`, ldconfig);
//! 3. for each folder `D` on `LD_LIBRARY_PATH`: `D/../../nvidia/nccl/lib/libnccl.so.2`, where
//!    the `nvidia-nccl-cu13` (or `-cu12`) pip package puts it next to `torch/lib`
//!    (`scripts/with-torch` puts `torch/lib` on `LD_LIBRARY_PATH`).
//!
//! The CUDA runtime (`libcudart.so.13`/`.12`, for `cudaSetDevice` and
//! `cudaDeviceSynchronize`) is found the same way (pip folders `nvidia/cu13/lib` and
//! `nvidia/cuda_runtime/lib`). NCCL ≥ 2.10 is required (for `ncclAvg` and bf16).
//!
//! # Ordering with LibTorch's CUDA work
//!
//! tch exposes no CUDA stream, so LibTorch's current stream is unknown here. Every collective
//! therefore (1) makes the communicator's device current (`cudaSetDevice`; it stays current
//! afterwards, like `torch.cuda.set_device(local_rank)` in a PyTorch script),
//! (2) synchronises the device (`cudaDeviceSynchronize`: every LibTorch kernel producing the
//! input has finished), (3) launches the NCCL call on the legacy default (null) stream, and
//! (4) synchronises the device again (the result is in memory before any later LibTorch
//! kernel reads it, and NCCL errors surface here). This is correct whatever stream LibTorch
//! uses, but serialises: no overlap of communication with computation. A stream-aware version
//! would enqueue on LibTorch's current stream (`at::cuda::getCurrentCUDAStream()`), which
//! needs a C++ shim that tch does not provide.
//!
//! The synchronisations use the CUDA runtime directly rather than `tch::Cuda::synchronize`
//! (same effect: that is `cudaDeviceSynchronize` under a device guard) so that a CUDA error is
//! returned as an error instead of a panic.
//!
//! # Tensors
//!
//! Tensors must live on the communicator's device (`cuda:<device_index>`); dtypes f32, f64,
//! f16, bf16, i64, i32, u8, i8 (and bool for broadcast/all_gather). `ReduceOp::Average` is
//! NCCL's `ncclAvg`, on floating-point tensors only (`super::check_reduce`). Collectives work in place
//! on the tensor's memory (`data_ptr`); a non-contiguous tensor goes through a contiguous copy
//! that is copied back. All ranks must call the same collectives in the same order with
//! tensors of the same numel and dtype, as with any NCCL program; a rank that never arrives
//! makes the others wait (NCCL has no timeout in blocking mode).
//!
//! # Point-to-point messages
//!
//! `ncclSend` and `ncclRecv` (NCCL ≥ 2.7) carry a tensor's bytes (`ncclUint8`), so any kind
//! travels. A send is a kernel that runs in stream order until the peer's receive has taken the
//! data: issued at once, two ranks that send to each other before receiving would each wait in
//! their send for a receive queued behind it. [`Collectives::send`] therefore only queues the
//! tensor (the caller's memory when contiguous, else a contiguous copy); the queued sends are
//! issued in one `ncclGroupStart`/`ncclGroupEnd` group with this rank's next receive, where
//! NCCL progresses them together (as torch's `batch_isend_irecv` does), or by
//! [`Collectives::wait_sends`]; either returns once the whole group has completed, so a
//! receive also waits until the sends issued with it have been received. Collectives leave the queue alone, so a send reaches its peer
//! only once this rank receives or waits for its sends: a schedule must do one of them before
//! it waits for the peer in a collective. Message order is kept (a group's sends are issued in
//! the order queued, and NCCL matches the sends and receives of a pair in order). NCCL cannot
//! check sizes: the receiving tensor must have exactly the sent byte count, or the ranks hang
//! or get garbage; an empty tensor sends nothing.
use super::{byte_size, check_peer, watchdog, Collectives, ReduceOp};
use anyhow::{anyhow, bail, Context};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

#[cfg(not(target_os = "linux"))]
compile_error!("the `nccl` feature needs Linux (NCCL is Linux-only)");

/// Size of `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES` in nccl.h).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// Oldest NCCL accepted: 2.10 (first with `ncclAvg` and `ncclBfloat16`).
const MIN_NCCL_VERSION: c_int = 21000;

// ---------------------------------------------------------------------------------------------
// The C API (values from nccl.h, NCCL 2.28; stable since 2.10)

type NcclResult = c_int; // ncclResult_t
type NcclComm = *mut c_void; // ncclComm_t
type CudaStream = *mut c_void; // cudaStream_t
type CudaError = c_int; // cudaError_t

const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress` (NCCL ≥ 2.14): an operation of a non-blocking communicator still going.
const NCCL_IN_PROGRESS: NcclResult = 7;
/// `cudaErrorNotReady`: `cudaStreamQuery`'s "work still queued".
const CUDA_ERROR_NOT_READY: CudaError = 600;

/// `ncclDataType_t`.
mod dtype {
    use std::ffi::c_int;
    pub const INT8: c_int = 0;
    pub const UINT8: c_int = 1;
    pub const INT32: c_int = 2;
    pub const INT64: c_int = 4;
    pub const FLOAT16: c_int = 6;
    pub const FLOAT32: c_int = 7;
    pub const FLOAT64: c_int = 8;
    pub const BFLOAT16: c_int = 9;
}

/// `ncclRedOp_t`.
const NCCL_SUM: c_int = 0;
const NCCL_AVG: c_int = 4;
const NCCL_MAX: c_int = 2;

/// `ncclUniqueId`: passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
struct NcclUniqueId {
    internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

struct NcclApi {
    _lib: libloading::Library,
    origin: String,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut NcclComm, c_int, NcclUniqueId, c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(NcclComm) -> NcclResult,
    comm_abort: unsafe extern "C" fn(NcclComm) -> NcclResult,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, CudaStream) -> NcclResult,
    // ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult,
    /// `ncclSend(sendbuff, count, datatype, peer, comm, stream)`, NCCL ≥ 2.7.
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult,
    /// `ncclRecv(recvbuff, count, datatype, peer, comm, stream)`, NCCL ≥ 2.7.
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    /// NCCL ≥ 2.13.
    get_last_error: Option<unsafe extern "C" fn(NcclComm) -> *const c_char>,
    /// `ncclCommGetAsyncError(comm, &state)`: an error the communicator met in the background
    /// (a peer's connection lost), while its kernels wait.
    comm_get_async_error: unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult,
}

struct CudartApi {
    _lib: libloading::Library,
    set_device: unsafe extern "C" fn(c_int) -> CudaError,
    device_synchronize: unsafe extern "C" fn() -> CudaError,
    /// `cudaStreamQuery(stream)`: 0 when its work is done, `cudaErrorNotReady` while not.
    stream_query: unsafe extern "C" fn(CudaStream) -> CudaError,
    get_error_string: unsafe extern "C" fn(CudaError) -> *const c_char,
}

/// Copies a symbol out of `lib` (the library stays loaded for the life of the process).
unsafe fn symbol<T: Copy>(lib: &libloading::Library, name: &str, origin: &str) -> anyhow::Result<T> {
    let sym: libloading::Symbol<T> = lib.get(name.as_bytes()).map_err(|e| anyhow!("{origin} has no symbol {name} ({e}); is it too old?"))?;
    Ok(*sym)
}

/// Opens the first library that exists: already loaded, then the linker's path, then the pip
/// wheel layouts relative to the folders on `LD_LIBRARY_PATH`.
fn open_library(names: &[&str], pip_relative: &[&str]) -> Result<(libloading::Library, String), String> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    for name in names {
        // SAFETY: RTLD_NOLOAD only returns a library that is already initialised.
        if let Ok(lib) = unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL | libc::RTLD_NOLOAD) } {
            return Ok((lib.into(), format!("{name} (already loaded)")));
        }
    }
    let mut tried = Vec::new();
    let mut last_err = String::new();
    for name in names {
        // SAFETY: loading NVIDIA's library runs its initialisers, which have no preconditions.
        match unsafe { Library::open(Some(name), RTLD_NOW | RTLD_LOCAL) } {
            Ok(lib) => return Ok((lib.into(), name.to_string())),
            Err(e) => {
                tried.push(name.to_string());
                last_err = e.to_string();
            }
        }
    }
    let dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH").map(|v| std::env::split_paths(&v).collect()).unwrap_or_default();
    for dir in dirs.iter().filter(|d| !d.as_os_str().is_empty()) {
        for rel in pip_relative {
            let path = dir.join(rel);
            if !path.exists() {
                continue;
            }
            // SAFETY: as above.
            match unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_LOCAL) } {
                Ok(lib) => return Ok((lib.into(), path.display().to_string())),
                Err(e) => {
                    tried.push(path.display().to_string());
                    last_err = e.to_string();
                }
            }
        }
    }
    Err(format!("tried {}; last error: {last_err}", tried.join(", ")))
}

fn load_nccl() -> anyhow::Result<NcclApi> {
    let (lib, origin) = open_library(&["libnccl.so.2", "libnccl.so"], &["../../nvidia/nccl/lib/libnccl.so.2"]).map_err(|e| {
        anyhow!(
            "cannot load the NCCL library ({e}); PyTorch's CUDA wheels ship it as nvidia/nccl/lib/libnccl.so.2 (pip package nvidia-nccl-cu13): put that folder, or torch/lib next to it, on LD_LIBRARY_PATH"
        )
    })?;
    let o = origin.as_str();
    // SAFETY: the signatures are those of nccl.h (2.10 to 2.28).
    unsafe {
        Ok(NcclApi {
            get_version: symbol(&lib, "ncclGetVersion", o)?,
            get_unique_id: symbol(&lib, "ncclGetUniqueId", o)?,
            comm_init_rank: symbol(&lib, "ncclCommInitRank", o)?,
            comm_destroy: symbol(&lib, "ncclCommDestroy", o)?,
            comm_abort: symbol(&lib, "ncclCommAbort", o)?,
            all_reduce: symbol(&lib, "ncclAllReduce", o)?,
            broadcast: symbol(&lib, "ncclBroadcast", o)?,
            all_gather: symbol(&lib, "ncclAllGather", o)?,
            reduce_scatter: symbol(&lib, "ncclReduceScatter", o)?,
            send: symbol(&lib, "ncclSend", o)?,
            recv: symbol(&lib, "ncclRecv", o)?,
            group_start: symbol(&lib, "ncclGroupStart", o)?,
            group_end: symbol(&lib, "ncclGroupEnd", o)?,
            get_error_string: symbol(&lib, "ncclGetErrorString", o)?,
            get_last_error: symbol(&lib, "ncclGetLastError", o).ok(),
            comm_get_async_error: symbol(&lib, "ncclCommGetAsyncError", o)?,
            origin,
            _lib: lib,
        })
    }
}

fn load_cudart() -> anyhow::Result<CudartApi> {
    let (lib, origin) = open_library(
        &["libcudart.so.13", "libcudart.so.12", "libcudart.so"],
        &["../../nvidia/cu13/lib/libcudart.so.13", "../../nvidia/cuda_runtime/lib/libcudart.so.12"],
    )
    .map_err(|e| anyhow!("cannot load the CUDA runtime library ({e}); put torch/lib (or CUDA's lib64) on LD_LIBRARY_PATH"))?;
    let o = origin.as_str();
    // SAFETY: the signatures are those of cuda_runtime_api.h.
    unsafe {
        Ok(CudartApi {
            set_device: symbol(&lib, "cudaSetDevice", o)?,
            device_synchronize: symbol(&lib, "cudaDeviceSynchronize", o)?,
            stream_query: symbol(&lib, "cudaStreamQuery", o)?,
            get_error_string: symbol(&lib, "cudaGetErrorString", o)?,
            _lib: lib,
        })
    }
}

/// The NCCL library, loaded once per process; the error is kept and repeated.
fn nccl() -> anyhow::Result<&'static NcclApi> {
    static API: OnceLock<Result<NcclApi, String>> = OnceLock::new();
    API.get_or_init(|| load_nccl().map_err(|e| format!("{e:#}"))).as_ref().map_err(|e| anyhow!("{e}"))
}

fn cudart() -> anyhow::Result<&'static CudartApi> {
    static API: OnceLock<Result<CudartApi, String>> = OnceLock::new();
    API.get_or_init(|| load_cudart().map_err(|e| format!("{e:#}"))).as_ref().map_err(|e| anyhow!("{e}"))
}

unsafe fn c_string(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// NCCL's text for a result code, with its last error message when it has one.
fn nccl_error_text(api: &NcclApi, result: NcclResult, comm: NcclComm) -> String {
    // SAFETY: both functions accept any code / a null or live communicator.
    let text = unsafe { c_string((api.get_error_string)(result)) };
    let last = api.get_last_error.map(|f| unsafe { c_string(f(comm)) }).unwrap_or_default();
    if last.is_empty() {
        format!("{text} (ncclResult {result})")
    } else {
        format!("{text} (ncclResult {result}): {last}")
    }
}

fn cuda_error_text(api: &CudartApi, err: CudaError) -> String {
    // SAFETY: cudaGetErrorString accepts any code.
    let text = unsafe { c_string((api.get_error_string)(err)) };
    format!("{text} (cudaError {err})")
}

fn version_string(code: c_int) -> String {
    // From 2.9 on the code is major*10000 + minor*100 + patch, before major*1000 + minor*100 + patch.
    if code >= 20900 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

fn raw_version(api: &NcclApi) -> anyhow::Result<c_int> {
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    let r = unsafe { (api.get_version)(&mut code) };
    if r != NCCL_SUCCESS {
        bail!("ncclGetVersion failed: {}", nccl_error_text(api, r, std::ptr::null_mut()));
    }
    Ok(code)
}

/// The loaded NCCL's version ("2.28.9") and where it was loaded from.
pub fn nccl_version() -> anyhow::Result<(String, String)> {
    let api = nccl()?;
    Ok((version_string(raw_version(api)?), api.origin.clone()))
}

/// A fresh NCCL unique id (`ncclGetUniqueId`, 128 bytes), made on rank 0 and handed to every
/// rank (see [`super::rendezvous::exchange_root_bytes`]) before [`NcclCollectives::new`].
///
/// Besides the library this needs no GPU: the id names a socket on which this process's NCCL
/// now listens for the other ranks' bootstrap, so call it on rank 0 only, once per communicator.
pub fn nccl_unique_id() -> anyhow::Result<Vec<u8>> {
    let api = nccl()?;
    let mut id = NcclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
    // SAFETY: writes NCCL_UNIQUE_ID_BYTES bytes into `id`.
    let r = unsafe { (api.get_unique_id)(&mut id) };
    if r != NCCL_SUCCESS {
        bail!(
            "ncclGetUniqueId failed: {} (NCCL from {}; set NCCL_DEBUG=WARN for details, NCCL_SOCKET_IFNAME to choose the network interface)",
            nccl_error_text(api, r, std::ptr::null_mut()),
            api.origin
        );
    }
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// The NCCL data type for a tensor kind; bool only where no arithmetic happens.
pub(crate) fn nccl_data_type(kind: Kind, reducing: bool) -> anyhow::Result<c_int> {
    Ok(match kind {
        Kind::Float => dtype::FLOAT32,
        Kind::Double => dtype::FLOAT64,
        Kind::Half => dtype::FLOAT16,
        Kind::BFloat16 => dtype::BFLOAT16,
        Kind::Int64 => dtype::INT64,
        Kind::Int => dtype::INT32,
        Kind::Uint8 => dtype::UINT8,
        Kind::Int8 => dtype::INT8,
        Kind::Bool if !reducing => dtype::UINT8,
        Kind::Bool => bail!("NCCL all_reduce of a bool tensor is not supported; convert it to uint8 or int first"),
        other => {
            bail!("NCCL has no data type for {other:?} tensors (supported: f32, f64, f16, bf16, i64, i32, u8, i8)")
        }
    })
}

/// One rank's NCCL communicator, bound to one CUDA device.
pub struct NcclCollectives {
    comm: NcclComm,
    rank: usize,
    world_size: usize,
    device_index: usize,
    /// NCCL calls on one communicator must not run concurrently.
    lock: Mutex<()>,
    /// Set once an NCCL call failed: the communicator is then aborted, not destroyed, on drop.
    failed: AtomicBool,
    /// Operations launched so far (the watchdog's sequence numbers).
    ops: AtomicU64,
    /// Sends not yet issued: they go out with the next receive or `wait_sends` (module docs).
    queued: Mutex<Vec<QueuedSend>>,
}

/// A tensor handed to `send` and the rank it goes to.
struct QueuedSend {
    data: Tensor,
    peer: usize,
}

// SAFETY: an NCCL communicator may be used from any thread (each call makes the device
// current first); `lock` keeps calls from different threads from overlapping.
unsafe impl Send for NcclCollectives {}
unsafe impl Sync for NcclCollectives {}

impl std::fmt::Debug for NcclCollectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollectives").field("rank", &self.rank).field("world_size", &self.world_size).field("device_index", &self.device_index).finish()
    }
}

impl NcclCollectives {
    /// Joins the communicator named by `unique_id` (from [`nccl_unique_id`] on rank 0) as
    /// `rank` of `world_size`, on CUDA device `device_index` (usually the local rank), which
    /// becomes this thread's current device. Blocks until all `world_size` ranks have joined.
    pub fn new(rank: usize, world_size: usize, device_index: usize, unique_id: &[u8]) -> anyhow::Result<Self> {
        if world_size == 0 || world_size > c_int::MAX as usize {
            bail!("NCCL: invalid world_size {world_size}");
        }
        if rank >= world_size {
            bail!("NCCL: rank {rank} is outside the world of size {world_size}");
        }
        if unique_id.len() != NCCL_UNIQUE_ID_BYTES {
            bail!("NCCL rank {rank}: the unique id has {} bytes, NCCL's has {NCCL_UNIQUE_ID_BYTES}", unique_id.len());
        }
        let devices = tch::Cuda::device_count();
        if device_index as i64 >= devices {
            bail!(
                "NCCL rank {rank}: needs CUDA device cuda:{device_index}, but LibTorch sees {devices} CUDA device(s){}",
                if devices == 0 {
                    " (no GPU, no CUDA driver, a CPU-only LibTorch, or a binary that does not link libtorch_cuda.so: see exercises/build.rs)"
                } else {
                    ""
                }
            );
        }
        let api = nccl().with_context(|| format!("NCCL rank {rank}"))?;
        let version = raw_version(api)?;
        if version < MIN_NCCL_VERSION {
            bail!("NCCL rank {rank}: NCCL {} (from {}) is too old; 2.10 or newer is needed", version_string(version), api.origin);
        }
        let cuda = cudart().with_context(|| format!("NCCL rank {rank}"))?;
        // SAFETY: plain CUDA runtime call.
        let err = unsafe { (cuda.set_device)(device_index as c_int) };
        if err != 0 {
            bail!("NCCL rank {rank}: cudaSetDevice({device_index}) failed: {}", cuda_error_text(cuda, err));
        }
        let mut id = NcclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
        for (dst, &src) in id.internal.iter_mut().zip(unique_id) {
            *dst = src as c_char;
        }
        let mut comm: NcclComm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; the id is passed by value as in nccl.h.
        let r = unsafe { (api.comm_init_rank)(&mut comm, world_size as c_int, id, rank as c_int) };
        if r != NCCL_SUCCESS {
            bail!(
                "NCCL rank {rank} of {world_size} on cuda:{device_index}: ncclCommInitRank failed: {} (NCCL {} from {}; set NCCL_DEBUG=WARN for details)",
                nccl_error_text(api, r, std::ptr::null_mut()),
                version_string(version),
                api.origin
            );
        }
        if comm.is_null() {
            bail!("NCCL rank {rank}: ncclCommInitRank returned success but no communicator");
        }
        Ok(NcclCollectives {
            comm,
            rank,
            world_size,
            device_index,
            lock: Mutex::new(()),
            failed: AtomicBool::new(false),
            ops: AtomicU64::new(0),
            queued: Mutex::default(),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn device_index(&self) -> usize {
        self.device_index
    }

    fn device(&self) -> Device {
        Device::Cuda(self.device_index)
    }

    fn fail(&self, msg: String) -> anyhow::Error {
        self.failed.store(true, Ordering::SeqCst);
        anyhow!(msg)
    }

    /// Fails unless the tensor is on this communicator's device.
    fn check_device(&self, tensor: &Tensor, what: &str) -> anyhow::Result<()> {
        let device = tensor.device();
        if device != self.device() {
            bail!("NCCL {what} on rank {}: the tensor is on {device:?}, but this communicator works on {:?}", self.rank, self.device());
        }
        Ok(())
    }

    /// Checks the tensor's device and returns its NCCL data type.
    fn data_type(&self, tensor: &Tensor, what: &str, reducing: bool) -> anyhow::Result<c_int> {
        self.check_device(tensor, what)?;
        nccl_data_type(tensor.kind(), reducing).with_context(|| format!("NCCL {what} on rank {}", self.rank))
    }

    /// Runs one NCCL call between two device synchronisations (see the module docs).
    fn launch(&self, what: &str, call: impl FnOnce(&NcclApi, NcclComm) -> NcclResult) -> anyhow::Result<()> {
        let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let api = nccl()?;
        let cuda = cudart()?;
        let (rank, dev) = (self.rank, self.device_index);
        let cuda_check = |step: &str, err: CudaError| -> anyhow::Result<()> {
            if err == 0 {
                Ok(())
            } else {
                Err(self.fail(format!("NCCL {what} on rank {rank} (cuda:{dev}): {step} failed: {}", cuda_error_text(cuda, err))))
            }
        };
        // SAFETY: plain CUDA runtime calls.
        cuda_check("cudaSetDevice", unsafe { (cuda.set_device)(dev as c_int) })?;
        cuda_check("cudaDeviceSynchronize before the collective", unsafe { (cuda.device_synchronize)() })?;
        let r = call(api, self.comm);
        if r != NCCL_SUCCESS {
            return Err(self.fail(format!(
                "NCCL {what} failed on rank {rank} of {} (cuda:{dev}): {} (set NCCL_DEBUG=WARN for details)",
                self.world_size,
                nccl_error_text(api, r, self.comm)
            )));
        }
        self.wait_done(api, cuda, what)?;
        cuda_check("cudaDeviceSynchronize after the collective", unsafe { (cuda.device_synchronize)() })
    }

    /// Waits for the operation just launched (on the legacy default stream) against the
    /// watchdog's deadline, as PyTorch's NCCL watchdog does: polls the stream and the
    /// communicator's background error; past the deadline (a peer stopped, hung or lost), says
    /// so in one line, aborts the communicator (which frees its kernels) and ends the process
    /// with [`watchdog::HUNG_EXIT_CODE`], the other ranks doing the same at their deadline.
    fn wait_done(&self, api: &NcclApi, cuda: &CudartApi, what: &str) -> anyhow::Result<()> {
        let seq = self.ops.fetch_add(1, Ordering::Relaxed) + 1;
        let (started, deadline) = (Instant::now(), watchdog::deadline(seq));
        let stalled = watchdog::stalled(self.rank, seq);
        loop {
            // SAFETY: a query of the legacy default stream (null), where the call was launched.
            match unsafe { (cuda.stream_query)(std::ptr::null_mut()) } {
                0 if !stalled => return Ok(()),
                0 | CUDA_ERROR_NOT_READY => {}
                err => return Err(self.fail(format!("NCCL {what} on rank {} (cuda:{}): {}", self.rank, self.device_index, cuda_error_text(cuda, err)))),
            }
            let mut state: NcclResult = NCCL_SUCCESS;
            // SAFETY: a live communicator; `state` receives its background error.
            unsafe { (api.comm_get_async_error)(self.comm, &mut state) };
            if state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
                return Err(self.fail(format!(
                    "NCCL {what} on rank {} of {}: {} (a peer's connection lost; set NCCL_DEBUG=WARN for details)",
                    self.rank,
                    self.world_size,
                    nccl_error_text(api, state, self.comm)
                )));
            }
            let waited = started.elapsed();
            if waited > deadline {
                crate::error::say(&format!(
                    "error on rank {}: NCCL {what} (operation {seq} of this communicator of {} ranks) did not complete in {:.0} s (--collective-timeout): a rank did not take part (stopped, hung, or its node lost); ending the job",
                    self.rank,
                    self.world_size,
                    waited.as_secs_f64()
                ));
                // SAFETY: aborting a live communicator ends its kernels; the process ends next.
                unsafe { (api.comm_abort)(self.comm) };
                std::process::exit(watchdog::HUNG_EXIT_CODE);
            }
            // Spin briefly (a collective usually ends within microseconds of its last peer),
            // then let the core go.
            if waited < Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// The queued sends, in order, leaving the queue empty.
    fn take_queued_sends(&self) -> Vec<QueuedSend> {
        std::mem::take(&mut *self.queued.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Issues `sends` and, if given, the receive of `(buffer, bytes, src)` as one NCCL group,
    /// so that they progress together (see the module docs). Stops at the first failing call
    /// but always closes the group, and returns the first failure.
    ///
    /// # Safety
    /// The sends' tensors and `buffer` (`bytes` writable bytes) must be memory on the
    /// communicator's device that stays alive, and that nothing else writes, until the group
    /// has completed on the device.
    unsafe fn p2p_group(api: &NcclApi, comm: NcclComm, sends: &[QueuedSend], recv: Option<(*mut c_void, usize, usize)>) -> NcclResult {
        let stream: CudaStream = std::ptr::null_mut();
        let started = (api.group_start)();
        if started != NCCL_SUCCESS {
            return started;
        }
        let mut result = NCCL_SUCCESS;
        for send in sends {
            let bytes = byte_size(&send.data);
            if bytes > 0 {
                result = (api.send)(send.data.data_ptr(), bytes, dtype::UINT8, send.peer as c_int, comm, stream);
                if result != NCCL_SUCCESS {
                    break;
                }
            }
        }
        if let (NCCL_SUCCESS, Some((buffer, bytes, src))) = (result, recv) {
            if bytes > 0 {
                result = (api.recv)(buffer, bytes, dtype::UINT8, src as c_int, comm, stream);
            }
        }
        let ended = (api.group_end)();
        if result != NCCL_SUCCESS {
            result
        } else {
            ended
        }
    }

    /// Runs an in-place collective `call` on the device memory of `tensor`: directly when it is
    /// contiguous, else on a contiguous copy that is then copied back into `tensor`.
    fn in_place(tensor: &mut Tensor, call: impl FnOnce(*mut c_void) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let contiguous = tensor.is_contiguous();
        let work = if contiguous { tensor.shallow_clone() } else { tensor.f_contiguous()? };
        call(work.data_ptr())?;
        if !contiguous {
            tch::no_grad(|| tensor.f_copy_(&work))?;
        }
        Ok(())
    }
}

impl Collectives for NcclCollectives {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> anyhow::Result<()> {
        let data_type = self.data_type(tensor, "all_reduce", true)?;
        super::check_reduce(tensor.kind(), op).with_context(|| format!("NCCL all_reduce on rank {}", self.rank))?;
        let count = tensor.numel();
        if count == 0 {
            return Ok(());
        }
        let nccl_op = match op {
            ReduceOp::Sum => NCCL_SUM,
            ReduceOp::Average => NCCL_AVG,
            ReduceOp::Max => NCCL_MAX,
        };
        Self::in_place(tensor, |ptr| {
            // SAFETY: `ptr` is `count` elements of `data_type` on this communicator's device,
            // alive until after the call has completed (launch synchronises the device).
            self.launch("all_reduce", |api, comm| unsafe { (api.all_reduce)(ptr, ptr, count, data_type, nccl_op, comm, std::ptr::null_mut()) })
        })
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> anyhow::Result<()> {
        super::check_root(root, self.world_size).with_context(|| format!("NCCL broadcast on rank {}", self.rank))?;
        let data_type = self.data_type(tensor, "broadcast", false)?;
        let count = tensor.numel();
        if count == 0 {
            return Ok(());
        }
        Self::in_place(tensor, |ptr| {
            // SAFETY: as in all_reduce; in place (sendbuff == recvbuff).
            self.launch("broadcast", |api, comm| unsafe { (api.broadcast)(ptr, ptr, count, data_type, root as c_int, comm, std::ptr::null_mut()) })
        })
    }

    fn all_gather(&self, tensor: &Tensor) -> anyhow::Result<Vec<Tensor>> {
        let data_type = self.data_type(tensor, "all_gather", false)?;
        let count = tensor.numel();
        let send = if tensor.is_contiguous() { tensor.shallow_clone() } else { tensor.f_contiguous()? };
        let mut shape = vec![self.world_size as i64];
        shape.extend(tensor.size());
        let gathered = Tensor::f_empty(shape.as_slice(), (tensor.kind(), self.device()))?;
        if count > 0 {
            let send_ptr = send.data_ptr();
            let recv_ptr = gathered.data_ptr();
            // SAFETY: `send_ptr` holds `count` elements, `recv_ptr` world_size * count, both on
            // this device and alive until the call has completed.
            self.launch("all_gather", |api, comm| unsafe { (api.all_gather)(send_ptr, recv_ptr, count, data_type, comm, std::ptr::null_mut()) })?;
        }
        // Rank r's tensor is row r (a view of the one receive buffer).
        Ok(gathered.f_unbind(0)?)
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor> {
        let data_type = self.data_type(tensor, "reduce_scatter", true)?;
        let block = super::check_scatter(tensor, op, self.world_size).with_context(|| format!("NCCL reduce_scatter on rank {}", self.rank))?;
        let send = if tensor.is_contiguous() { tensor.shallow_clone() } else { tensor.f_contiguous()? };
        let mine = Tensor::f_empty([block as i64], (tensor.kind(), self.device()))?;
        let nccl_op = match op {
            ReduceOp::Sum => NCCL_SUM,
            ReduceOp::Average => NCCL_AVG,
            ReduceOp::Max => NCCL_MAX,
        };
        if block > 0 {
            let (send_ptr, recv_ptr) = (send.data_ptr(), mine.data_ptr());
            // SAFETY: `send_ptr` holds world_size * block elements, `recv_ptr` block, both on
            // this device and alive until the call has completed.
            self.launch("reduce_scatter", |api, comm| unsafe {
                (api.reduce_scatter)(send_ptr, recv_ptr, block, data_type, nccl_op, comm, std::ptr::null_mut())
            })?;
        }
        Ok(mine)
    }

    fn supports_kind(&self, kind: Kind) -> bool {
        nccl_data_type(kind, true).is_ok()
    }

    /// Queues the tensor; it goes out with this rank's next receive or `wait_sends`.
    fn send(&self, tensor: &Tensor, dst: usize) -> anyhow::Result<()> {
        check_peer("send to", dst, self.rank, self.world_size).with_context(|| format!("NCCL on rank {}", self.rank))?;
        self.check_device(tensor, "send")?;
        // Detached: the queue holds the values only, not the autograd graph behind them.
        let data = tensor.detach();
        let data = if data.is_contiguous() { data } else { data.f_contiguous()? };
        self.queued.lock().unwrap_or_else(PoisonError::into_inner).push(QueuedSend { data, peer: dst });
        Ok(())
    }

    /// Receives in one group with the queued sends, so that ranks sending to each other first
    /// do not deadlock.
    fn recv(&self, tensor: &mut Tensor, src: usize) -> anyhow::Result<()> {
        check_peer("receive from", src, self.rank, self.world_size).with_context(|| format!("NCCL on rank {}", self.rank))?;
        self.check_device(tensor, "recv")?;
        let bytes = byte_size(tensor);
        Self::in_place(tensor, |buffer| {
            // Taken only now, so that a failure before the launch leaves them queued.
            let sends = self.take_queued_sends();
            // SAFETY: `sends` holds its tensors and `buffer` is `bytes` bytes of this device's
            // memory, both alive until after the group has completed (launch synchronises).
            self.launch("recv", |api, comm| unsafe { Self::p2p_group(api, comm, &sends, Some((buffer, bytes, src))) })
        })
    }

    fn wait_sends(&self) -> anyhow::Result<()> {
        let sends = self.take_queued_sends();
        if sends.is_empty() {
            return Ok(());
        }
        // SAFETY: `sends` holds its tensors until after the group has completed.
        self.launch("send", |api, comm| unsafe { Self::p2p_group(api, comm, &sends, None) })
    }

    fn barrier(&self) -> anyhow::Result<()> {
        let mut token = Tensor::f_zeros([1i64].as_slice(), (Kind::Float, self.device()))?;
        self.all_reduce(&mut token, ReduceOp::Sum).context("NCCL barrier")
    }
}

impl Drop for NcclCollectives {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        // Queued sends are owed to peers that may be waiting for them (not while unwinding from
        // a panic: MPI then aborts the job, and a peer may never receive).
        if !std::thread::panicking() && !self.failed.load(Ordering::SeqCst) {
            if let Err(err) = self.wait_sends() {
                eprintln!("warning: NCCL rank {}: issuing the queued sends failed: {err:#}", self.rank);
            }
        }
        let (Ok(api), Ok(cuda)) = (nccl(), cudart()) else {
            return;
        };
        // SAFETY: the communicator is live and used by nobody else (we own it mutably).
        unsafe {
            let _ = (cuda.set_device)(self.device_index as c_int);
            let r = if self.failed.load(Ordering::SeqCst) { (api.comm_abort)(self.comm) } else { (api.comm_destroy)(self.comm) };
            if r != NCCL_SUCCESS {
                eprintln!("warning: NCCL rank {}: releasing the communicator failed: {}", self.rank, nccl_error_text(api, r, std::ptr::null_mut()));
            }
        }
        self.comm = std::ptr::null_mut();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_types_match_nccl_h() {
        // ncclDataType_t values from nccl.h (NCCL 2.28).
        let table =
            [(Kind::Int8, 0), (Kind::Uint8, 1), (Kind::Int, 2), (Kind::Int64, 4), (Kind::Half, 6), (Kind::Float, 7), (Kind::Double, 8), (Kind::BFloat16, 9)];
        for (kind, code) in table {
            assert_eq!(nccl_data_type(kind, true).unwrap(), code, "{kind:?}");
            assert_eq!(nccl_data_type(kind, false).unwrap(), code, "{kind:?}");
        }
        assert_eq!(nccl_data_type(Kind::Bool, false).unwrap(), 1);
        let err = nccl_data_type(Kind::Bool, true).unwrap_err().to_string();
        assert!(err.contains("bool"), "{err}");
        let err = nccl_data_type(Kind::Int16, false).unwrap_err().to_string();
        assert!(err.contains("Int16") && err.contains("supported"), "{err}");
        let err = nccl_data_type(Kind::ComplexFloat, true).unwrap_err().to_string();
        assert!(err.contains("ComplexFloat"), "{err}");
    }

    #[test]
    fn ffi_layout() {
        assert_eq!(std::mem::size_of::<NcclUniqueId>(), 128);
        assert_eq!(NCCL_SUM, 0);
        assert_eq!(NCCL_AVG, 4);
        assert_eq!(version_string(22809), "2.28.9");
        assert_eq!(version_string(21003), "2.10.3");
        assert_eq!(version_string(2804), "2.8.4");
    }

    /// What really happens where this runs: with libnccl loadable, ncclGetUniqueId works even
    /// without a GPU (the id is a bootstrap socket address); without it, a clean error.
    #[test]
    fn unique_id_or_clean_error() {
        match nccl_version() {
            Ok((version, origin)) => {
                eprintln!("NCCL {version} loaded from {origin}");
                let id = nccl_unique_id().expect("libnccl loads, so ncclGetUniqueId must work");
                assert_eq!(id.len(), NCCL_UNIQUE_ID_BYTES);
                assert!(id.iter().any(|&b| b != 0), "an all-zero unique id");
                let again = nccl_unique_id().unwrap();
                assert_ne!(id, again, "two unique ids should differ");
            }
            Err(e) => {
                let msg = format!("{e:#}");
                eprintln!("NCCL not loadable here: {msg}");
                assert!(msg.contains("libnccl.so.2") && msg.contains("LD_LIBRARY_PATH"), "{msg}");
                let err = format!("{:#}", nccl_unique_id().unwrap_err());
                assert_eq!(err, msg, "the load error is kept and repeated");
            }
        }
    }

    /// Without a GPU, joining a communicator fails with a message (no panic); with one, a
    /// world of one rank must work end to end.
    #[test]
    fn world_of_one() {
        let bad = NcclCollectives::new(0, 1, 0, &[0u8; 5]).unwrap_err().to_string();
        assert!(bad.contains("5 bytes"), "{bad}");
        let bad = NcclCollectives::new(2, 2, 0, &[0u8; 128]).unwrap_err().to_string();
        assert!(bad.contains("rank 2") && bad.contains("size 2"), "{bad}");

        if !crate::device::cuda_available() {
            let id = [0u8; NCCL_UNIQUE_ID_BYTES];
            let err = format!("{:#}", NcclCollectives::new(0, 1, 0, &id).unwrap_err());
            eprintln!("no GPU here: {err}");
            assert!(err.contains("rank 0") && err.contains("cuda:0"), "{err}");
            return;
        }
        eprintln!("GPU present: testing a one-rank NCCL communicator");
        let id = nccl_unique_id().unwrap();
        let nccl = NcclCollectives::new(0, 1, 0, &id).unwrap();
        assert_eq!(nccl.name(), "nccl");
        let dev = Device::Cuda(0);
        for kind in [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16, Kind::Int64, Kind::Int, Kind::Uint8, Kind::Int8] {
            let original = Tensor::arange(12, (Kind::Int64, dev)).to_kind(kind).view([3, 4]);
            let mut t = original.copy();
            nccl.all_reduce(&mut t, ReduceOp::Sum).unwrap();
            assert!(t.equal(&original), "{kind:?} sum");
            if matches!(kind, Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16) {
                nccl.all_reduce(&mut t, ReduceOp::Average).unwrap();
                assert!(t.equal(&original), "{kind:?} average");
            } else {
                assert!(nccl.all_reduce(&mut t, ReduceOp::Average).is_err(), "{kind:?} average");
            }
            nccl.broadcast(&mut t, 0).unwrap();
            assert!(t.equal(&original), "{kind:?} broadcast");
            let parts = nccl.all_gather(&t).unwrap();
            assert_eq!(parts.len(), 1);
            assert!(parts[0].equal(&original), "{kind:?} all_gather");
        }
        // Non-contiguous: a transposed view is reduced through a copy and written back.
        let base = Tensor::arange(12, (Kind::Float, dev)).view([3, 4]);
        let mut t = base.tr();
        assert!(!t.is_contiguous());
        nccl.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert!(t.equal(&base.tr()));
        let parts = nccl.all_gather(&base.tr()).unwrap();
        assert!(parts[0].equal(&base.tr()));
        // Wrong device and unsupported dtype are errors.
        let mut cpu = Tensor::ones([2], (Kind::Float, Device::Cpu));
        assert!(nccl.all_reduce(&mut cpu, ReduceOp::Sum).is_err());
        let mut flags = Tensor::ones([2], (Kind::Bool, dev));
        assert!(nccl.all_reduce(&mut flags, ReduceOp::Sum).is_err());
        nccl.broadcast(&mut flags, 0).unwrap();
        assert!(nccl.broadcast(&mut t, 1).is_err());
        nccl.barrier().unwrap();
        // Point-to-point needs a peer: a world of one refuses both ends and has nothing to wait for.
        let err = format!("{:#}", nccl.send(&t, 0).unwrap_err());
        assert!(err.contains("itself"), "{err}");
        let err = format!("{:#}", nccl.recv(&mut t, 1).unwrap_err());
        assert!(err.contains("only 1 rank"), "{err}");
        nccl.wait_sends().unwrap();
    }
}
