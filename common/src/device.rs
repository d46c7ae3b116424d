//! Which devices a run uses, and what the machine offers.
use crate::error::{usage, UsageError};
use tch::Device;

/// The `--device` flag: one device, or both for the course's CPU-vs-GPU comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    Cpu,
    Cuda,
    /// CPU first, then the GPU when there is one.
    Both,
}

/// Whether LibTorch sees a usable CUDA device.
///
/// LibTorch's CUDA backend registers itself from `libtorch_cuda.so`'s static initialisers. Our
/// binaries link that library with `--no-as-needed` (build-support/link_libtorch.rs), but code
/// built by another crate (an evcxr notebook, a user's own binary) usually drops it, and CUDA
/// then looks absent. So when LibTorch sees no GPU, the library is loaded once by hand and
/// LibTorch asked again.
pub fn cuda_available() -> bool {
    tch::Cuda::is_available() || {
        load_cuda_backend();
        tch::Cuda::is_available()
    }
}

/// Loads `libtorch_cuda.so` into the process (once; it stays loaded), found the way the
/// dynamic linker finds LibTorch's other libraries (rpath, LD_LIBRARY_PATH). A CPU-only
/// LibTorch has no such library, and nothing happens.
fn load_cuda_backend() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: dlopen with a constant, NUL-terminated name; the handle is deliberately never
        // closed, so the backend it registers stays valid for the life of the process.
        unsafe {
            libc::dlopen(c"libtorch_cuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        }
    });
}

/// The devices to run on, in order. `cuda` without a GPU is a usage error; `both` without a
/// GPU gives only the CPU and the caller reports the missing GPU column.
pub fn devices_for(choice: DeviceChoice) -> anyhow::Result<Vec<Device>> {
    let cuda = cuda_available();
    match choice {
        DeviceChoice::Cpu => Ok(vec![Device::Cpu]),
        DeviceChoice::Cuda if cuda => Ok(vec![Device::Cuda(0)]),
        DeviceChoice::Cuda => usage(no_cuda_message()),
        DeviceChoice::Both if cuda => Ok(vec![Device::Cpu, Device::Cuda(0)]),
        DeviceChoice::Both => Ok(vec![Device::Cpu]),
    }
}

/// Why CUDA is not there, in words a user can act on.
pub fn no_cuda_message() -> String {
    format!(
        "--device cuda was asked for, but no CUDA device is available (LibTorch {} sees {} GPUs; \
         check nvidia-smi, CUDA_VISIBLE_DEVICES, and that the job was given a GPU)",
        crate::torch_version(),
        tch::Cuda::device_count()
    )
}

/// Short name used in file names and tables: `cpu` or `cuda`.
/// The GPU's name as `nvidia-smi` gives it (`NVIDIA H100 80GB HBM3`); None for the CPU or
/// where it cannot be asked.
pub fn gpu_name(device: Device) -> Option<String> {
    let Device::Cuda(index) = device else { return None };
    let output = std::process::Command::new("nvidia-smi").args(["--query-gpu=name", "--format=csv,noheader", "-i", &index.to_string()]).output().ok()?;
    let name = String::from_utf8_lossy(&output.stdout).trim().to_string();
    (!name.is_empty()).then_some(name)
}

pub fn device_name(device: Device) -> &'static str {
    match device {
        Device::Cpu => "cpu",
        _ => "cuda",
    }
}

/// Blocks until queued GPU work is done, so that host timers measure it (no-op on CPU).
pub fn synchronize(device: Device) {
    // Recording a CUDA graph runs nothing on the device: there is nothing to wait for, and
    // waiting would end the recording with an error.
    if crate::cuda_graph::capturing() {
        return;
    }
    if let Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

/// Sets LibTorch's intra-op thread count; 0 leaves LibTorch's default (one per core).
/// Returns a warning when more threads were asked for than this process has cores: they are
/// capped at the cores (threads beyond them only wait for each other, and LibTorch would start
/// every one of them: `--threads 100000` never got to its first step).
pub fn set_threads(threads: usize) -> Result<Option<String>, UsageError> {
    let cores = usable_cores();
    let (n, warning) = match threads {
        0 => return Ok(None),
        n if n > cores => (cores, Some(format!("warning: --threads {n} is more than the {cores} cores this process may use: using {cores}"))),
        n => (n, None),
    };
    tch::set_num_threads(i32::try_from(n).map_err(|_| UsageError(format!("--threads {threads} is too large")))?);
    Ok(warning)
}

/// The cores this process may run on (its CPU affinity: what Slurm's --cpus-per-task or
/// taskset gave it), at least 1.
pub fn usable_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Keeps the host memory training frees for the next step instead of handing it back to the
/// kernel. glibc's malloc serves large blocks with `mmap` and unmaps them when freed, so a CPU
/// training step that allocates its activations, 70 MB of logits and a 100 MB embedding
/// gradient maps fresh pages and faults each of them in, every step: measured, 1.6 million page
/// faults in 8 steps of exercise1_nlp's course model; with the thresholds raised 0.5 million,
/// and 9% more tokens/s (the peak resident set grew by 16%). jemalloc and tcmalloc, which Intel
/// recommends for PyTorch on CPUs, keep such blocks the same way. The user's own setting wins:
/// `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`, or another allocator preloaded.
pub fn keep_freed_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        let user_set = ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD"].iter().any(|v| std::env::var_os(v).is_some());
        if !user_set {
            // SAFETY: mallopt only changes two of malloc's thresholds; called before the
            // training threads allocate.
            ONCE.call_once(|| unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, i32::MAX);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            });
        }
    }
}

/// Two pipeline stages' devices where none are named: two GPUs where the machine has them, its
/// one GPU twice, or the CPU twice.
pub fn two_stage_devices() -> Vec<Device> {
    match if cuda_available() { tch::Cuda::device_count() } else { 0 } {
        0 => vec![Device::Cpu; 2],
        1 => vec![Device::Cuda(0); 2],
        _ => vec![Device::Cuda(0), Device::Cuda(1)],
    }
}

/// A device named on the command line: `cpu`, `cuda` (the first GPU) or `cuda:N`. Fails with a
/// usage error for other names and for GPUs this machine does not have.
pub fn parse_device(name: &str) -> Result<Device, UsageError> {
    let device = match name.trim() {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        other => match other.strip_prefix("cuda:").and_then(|i| i.parse::<usize>().ok()) {
            Some(index) => Device::Cuda(index),
            None => return Err(UsageError(format!("unknown device `{name}`: use cpu, cuda or cuda:N"))),
        },
    };
    if let Device::Cuda(index) = device {
        if !cuda_available() {
            return Err(UsageError(format!("device `{name}`: {}", no_cuda_message())));
        }
        let count = tch::Cuda::device_count() as usize;
        if index >= count {
            return Err(UsageError(format!("device `{name}`: this machine has {count} GPU(s), cuda:0 to cuda:{}", count - 1)));
        }
    }
    Ok(device)
}

/// `cpu` or `cuda:N`, as [`parse_device`] reads it.
pub fn device_label(device: Device) -> String {
    match device {
        Device::Cuda(index) => format!("cuda:{index}"),
        _ => "cpu".into(),
    }
}

/// `--deterministic`: LibTorch's deterministic algorithms and cuDNN's deterministic kernels,
/// its benchmark off, and cuBLAS's workspace fixed as its documentation asks
/// (`CUBLAS_WORKSPACE_CONFIG=:4096:8`, unless set already). Called before the first CUDA
/// operation: cuBLAS reads the variable when it starts.
pub fn deterministic() -> anyhow::Result<()> {
    const CUBLAS: &str = "CUBLAS_WORKSPACE_CONFIG";
    if std::env::var_os(CUBLAS).is_none() {
        // Set at start-up, before any thread of ours or LibTorch's reads the environment.
        std::env::set_var(CUBLAS, ":4096:8");
    }
    crate::torch_ext::use_deterministic_algorithms(true)
}

#[cfg(test)]
mod tests {
    #[test]
    fn deterministic_mode_is_libtorchs_and_fills_fresh_memory() {
        // Each test runs in a process of its own (nextest): the global settings stay here.
        std::env::remove_var("CUBLAS_WORKSPACE_CONFIG");
        super::deterministic().unwrap();
        assert_eq!(std::env::var("CUBLAS_WORKSPACE_CONFIG").as_deref(), Ok(":4096:8"));
        // LibTorch's deterministic mode fills uninitialised memory with NaN, so that a read of
        // it cannot pass unseen: that it does shows the mode is on.
        let fresh = tch::Tensor::empty([64], (tch::Kind::Float, tch::Device::Cpu));
        assert_eq!(fresh.isnan().all().int64_value(&[]), 1);
    }
}
