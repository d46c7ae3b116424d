//! CUDA graphs (`--cuda-graph`): a training step recorded once and replayed for every batch, as
//! `torch.cuda.CUDAGraph` does (and `torch.compile`'s "reduce-overhead" mode): the hundreds of
//! kernel launches of a small model's step become one, so the GPU no longer waits for the
//! host. tch has no CUDA graph API; `csrc/cuda_graph.cpp` wraps LibTorch's `at::cuda::CUDAGraph`
//! in a shared library that `build.rs` compiles where LibTorch is a CUDA build and the CUDA
//! runtime's headers are at hand, that the binaries carry inside them, and that is loaded the
//! first time a graph is made (a CPU-only LibTorch never loads it).
//!
//! What a captured step needs (see [`crate::train`]): inputs copied into the same tensors
//! before each replay, no host synchronisation inside the step ([`capturing`] tells the code
//! that would wait for the device not to), the optimizer's learning rate and step counts as
//! device tensors, and gradients left where the capture put them.
use std::cell::Cell;
use std::ffi::{c_char, c_void};

use anyhow::{bail, Context, Result};
use tch::Device;

thread_local! {
    static CAPTURING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is recording a CUDA graph (code that would wait for the device, or read
/// a value from it, must not: the work is not running, only being recorded).
pub fn capturing() -> bool {
    CAPTURING.with(Cell::get)
}

/// The library's functions.
struct Api {
    _lib: libloading::Library,
    new: unsafe extern "C" fn(i32) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void),
    begin: unsafe extern "C" fn(*mut c_void) -> i32,
    end: unsafe extern "C" fn(*mut c_void) -> i32,
    replay: unsafe extern "C" fn(*mut c_void) -> i32,
    last_error: unsafe extern "C" fn(*mut c_char, usize) -> usize,
}

// SAFETY: the functions may be called from any thread; the library stays loaded.
unsafe impl Sync for Api {}
unsafe impl Send for Api {}

#[cfg(torch_ext_cuda_graph)]
static LIBRARY: &[u8] = include_bytes!(env!("TORCH_EXT_CUDA_GRAPH_LIB"));

/// The library, put in a memory file once per process and loaded from there.
fn api() -> Result<&'static Api> {
    static API: std::sync::OnceLock<std::result::Result<Api, String>> = std::sync::OnceLock::new();
    API.get_or_init(|| load().map_err(|err| format!("{err:#}"))).as_ref().map_err(|err| anyhow::anyhow!("{err}"))
}

#[cfg(torch_ext_cuda_graph)]
fn load() -> Result<Api> {
    use std::io::Write;
    use std::os::fd::{FromRawFd, IntoRawFd};
    // In an anonymous memory file, loaded through its descriptor: a library written under a
    // name in the shared /tmp could be replaced by another user between the write and the load
    // (and run as this user), and the name's leftovers would pile up there.
    // SAFETY: a NUL-terminated name; the descriptor returned is this process's to own.
    let fd = unsafe { libc::memfd_create(c"torch-ext-cuda-graph".as_ptr(), libc::MFD_CLOEXEC) };
    anyhow::ensure!(fd >= 0, "cannot create a memory file for the CUDA graph library: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nothing else.
    let mut memory = unsafe { std::fs::File::from_raw_fd(fd) };
    memory.write_all(LIBRARY).context("writing the CUDA graph library to a memory file")?;
    // The descriptor stays open for as long as the library is loaded: for the process's life.
    let path = std::path::PathBuf::from(format!("/proc/self/fd/{}", memory.into_raw_fd()));
    // SAFETY: our own library, whose initialisers only register nothing; its symbols are
    // looked up with the signatures csrc/cuda_graph.cpp defines.
    unsafe {
        let lib = libloading::Library::new(&path).with_context(|| format!("loading the CUDA graph library {}", path.display()))?;
        let symbol = |name: &str| -> Result<*const c_void> {
            Ok(*lib.get::<*const c_void>(name.as_bytes()).with_context(|| format!("the CUDA graph library has no `{name}`"))?)
        };
        Ok(Api {
            new: std::mem::transmute::<*const c_void, unsafe extern "C" fn(i32) -> *mut c_void>(symbol("cuda_graph_new")?),
            free: std::mem::transmute::<*const c_void, unsafe extern "C" fn(*mut c_void)>(symbol("cuda_graph_free")?),
            begin: std::mem::transmute::<*const c_void, unsafe extern "C" fn(*mut c_void) -> i32>(symbol("cuda_graph_begin")?),
            end: std::mem::transmute::<*const c_void, unsafe extern "C" fn(*mut c_void) -> i32>(symbol("cuda_graph_end")?),
            replay: std::mem::transmute::<*const c_void, unsafe extern "C" fn(*mut c_void) -> i32>(symbol("cuda_graph_replay")?),
            last_error: std::mem::transmute::<*const c_void, unsafe extern "C" fn(*mut c_char, usize) -> usize>(symbol("cuda_graph_last_error")?),
            _lib: lib,
        })
    }
}

#[cfg(not(torch_ext_cuda_graph))]
fn load() -> Result<Api> {
    bail!(
        "this build cannot capture CUDA graphs: LibTorch {} is not a CUDA build, or the CUDA runtime's headers \
         (cuda_runtime_api.h and crt/host_defines.h: pip's nvidia-cuda-runtime and nvidia-cuda-crt, or CUDA_HOME) were \
         missing when it was built",
        crate::torch_version()
    )
}

/// Whether this build carries the CUDA graph library.
pub fn built_in() -> bool {
    cfg!(torch_ext_cuda_graph)
}

/// A recorded piece of GPU work (see the module docs).
pub struct CudaGraph {
    api: &'static Api,
    ptr: *mut c_void,
    captured: bool,
}

impl CudaGraph {
    /// An empty graph for `device` (a CUDA device).
    pub fn new(device: Device) -> Result<CudaGraph> {
        let Device::Cuda(index) = device else { bail!("CUDA graphs record GPU work: {device:?} is not a CUDA device") };
        let api = api()?;
        // SAFETY: plain call; null means failure.
        let ptr = unsafe { (api.new)(index as i32) };
        if ptr.is_null() {
            bail!("cannot make a CUDA graph: {}", last_error(api));
        }
        Ok(CudaGraph { api, ptr, captured: false })
    }

    /// Records what `work` launches (it runs nothing on the GPU: the kernels are recorded). The
    /// recording ends even when `work` fails.
    pub fn capture<T>(&mut self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        anyhow::ensure!(!self.captured, "this CUDA graph was captured already");
        // SAFETY: a live graph.
        if unsafe { (self.api.begin)(self.ptr) } != 0 {
            bail!("cannot start capturing a CUDA graph: {}", last_error(self.api));
        }
        CAPTURING.with(|c| c.set(true));
        let outcome = work();
        CAPTURING.with(|c| c.set(false));
        // SAFETY: a live graph whose capture began.
        let ended = unsafe { (self.api.end)(self.ptr) };
        let value = outcome.context("while capturing the training step in a CUDA graph")?;
        if ended != 0 {
            bail!("the training step could not be captured in a CUDA graph ({}); run without --cuda-graph", last_error(self.api));
        }
        self.captured = true;
        Ok(value)
    }

    /// Runs the recorded work once more (on the device's current stream).
    pub fn replay(&self) -> Result<()> {
        anyhow::ensure!(self.captured, "a CUDA graph replayed before it was captured");
        // SAFETY: a live, captured graph.
        if unsafe { (self.api.replay)(self.ptr) } != 0 {
            bail!("replaying the CUDA graph failed: {}", last_error(self.api));
        }
        Ok(())
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: made by `new`, freed once.
        unsafe { (self.api.free)(self.ptr) }
    }
}

fn last_error(api: &Api) -> String {
    let mut buffer = vec![0u8; 4096];
    // SAFETY: the buffer is valid for its length.
    let length = unsafe { (api.last_error)(buffer.as_mut_ptr() as *mut c_char, buffer.len()) };
    buffer.truncate(length.min(buffer.len() - 1));
    String::from_utf8_lossy(&buffer).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU: the library (where this build has it) loads into the process, and a graph
    /// for the CPU, or for a GPU that is not there, is a clear error rather than a crash.
    #[test]
    fn a_graph_needs_a_cuda_device_and_says_so() {
        let err = CudaGraph::new(Device::Cpu).err().expect("no CUDA graph on the CPU");
        assert!(format!("{err}").contains("not a CUDA device"), "{err}");
        if built_in() {
            assert!(api().is_ok(), "{:?}", api().err());
            if !tch::Cuda::is_available() {
                let err = CudaGraph::new(Device::Cuda(0)).err().expect("no GPU here");
                assert!(format!("{err}").contains("cannot make a CUDA graph"), "{err}");
            }
        } else {
            assert!(format!("{:#}", api().err().expect("not built in")).contains("cannot capture CUDA graphs"));
        }
        assert!(!capturing());
    }
}
