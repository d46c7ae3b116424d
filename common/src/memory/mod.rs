//! Memory, which is why pipelines, tensor parallelism and ZeRO exist: what a rank holds while
//! it trains, measured ([`MemoryMeter`], [`PeakMemory`]) and predicted before launch
//! (`--estimate-memory`, [`estimate`]), and the model-state part by the run's style's formula
//! ([`ModelState`]; each style writes its own: [`crate::parallel::Costs::model_state`]).
//!
//! Measured: on a GPU, the CUDA caching allocator's peak of bytes allocated to tensors and of
//! bytes reserved from the driver (`torch.cuda.max_memory_allocated` and `_reserved`); on the
//! CPU, the peak of bytes held by tensors (LibTorch keeps no such count for the CPU: the C++
//! shim wraps its CPU allocator to keep one) and the process's peak resident set. The peaks are
//! reset when training starts, after the data are loaded; the bytes held then are the baseline.
pub mod estimate;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::Device;

use crate::comm::ProcessGroup;
use crate::device;
use crate::parallel::GradientSync;
use crate::torch_ext;
use crate::train::{Control, Event, Observer};

/// 1 MiB.
pub const MIB: f64 = 1024.0 * 1024.0;

/// One rank's memory on one device while it trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeakMemory {
    pub rank: usize,
    /// `cpu`, `cuda:0`, ...
    pub device: String,
    /// Bytes held by tensors when training started (the data set, say).
    pub baseline_bytes: i64,
    /// The peak of bytes held by tensors in the training steps, the baseline included.
    pub training_peak_bytes: i64,
    /// The same over the evaluations between epochs (none when none ran).
    pub evaluation_peak_bytes: Option<i64>,
    /// CUDA: the peak of bytes the caching allocator reserved (allocated plus its cache) in the
    /// training steps, read over the same steps as `training_peak_bytes`.
    pub peak_reserved_bytes: Option<i64>,
    /// CPU: the process's peak resident set (all of its memory: libraries, data, allocator
    /// slack) since training started where the system can reset it (Linux), else since its start.
    pub peak_rss_bytes: Option<i64>,
}

impl PeakMemory {
    /// The peak of bytes held by tensors, training or evaluating: what the device must hold.
    pub fn peak_bytes(&self) -> i64 {
        self.training_peak_bytes.max(self.evaluation_peak_bytes.unwrap_or(0))
    }

    /// What the training steps added at their peak: the model's state, activations and
    /// temporaries (what `--estimate-memory` predicts).
    pub fn training_bytes(&self) -> i64 {
        self.training_peak_bytes - self.baseline_bytes
    }

    /// `rank 0 cpu: 812.4 MiB by tensors in training (120.0 MiB of them before), 950.1 MiB
    /// evaluating, 1,302.0 MiB resident`.
    pub fn describe(&self) -> String {
        let mib = |b: i64| format!("{:.1} MiB", b as f64 / MIB);
        let mut line = format!("rank {} {}: {} by tensors in training", self.rank, self.device, mib(self.training_peak_bytes));
        if self.baseline_bytes > 0 {
            line += &format!(" ({} of them held before)", mib(self.baseline_bytes));
        }
        if let Some(evaluating) = self.evaluation_peak_bytes {
            line += &format!(", {} evaluating", mib(evaluating));
        }
        if let Some(reserved) = self.peak_reserved_bytes {
            line += &format!(", {} reserved", mib(reserved));
        }
        if let Some(rss) = self.peak_rss_bytes {
            line += &format!(", {} resident", mib(rss));
        }
        line
    }
}

/// Counts the bytes of CPU tensors from now on (LibTorch's CPU allocator, wrapped by the shim):
/// call before loading data, so that the data set counts in the baseline.
pub fn count_cpu_tensors() -> Result<()> {
    torch_ext::cpu_memory().map(drop)
}

/// One device's peaks so far.
#[derive(Debug, Clone, Copy, Default)]
struct Peaks {
    training: i64,
    /// CUDA: reserved bytes over the same steps as `training` (the evaluations' left out).
    training_reserved: Option<i64>,
    evaluation: Option<i64>,
}

/// Measures the peak memory of a process's devices over its training, the training steps and
/// the evaluations apart: as an [`Observer`] of the run (see [`MemoryMeter::observer`]), it
/// reads the peak after every step and after every evaluation, and starts the peak again after
/// each evaluation.
pub struct MemoryMeter {
    /// The devices, what each held when the meter started, and their peaks.
    devices: Vec<(Device, i64, Peaks)>,
    /// The peak resident set could be reset (CPU).
    rss_reset: bool,
    /// Debugging (`TORCH_EXT_PEAK_TRACE`): the first CPU allocation after the baseline.
    trace_since: i64,
}

impl MemoryMeter {
    /// Resets the peaks of `devices` (every device this process trains on) and notes what they
    /// hold now.
    pub fn start(devices: &[Device]) -> Result<MemoryMeter> {
        let mut meter = MemoryMeter { devices: Vec::new(), rss_reset: false, trace_since: torch_ext::trace_cpu_memory_sequence() };
        for &device in devices {
            if meter.devices.iter().any(|(d, _, _)| *d == device) {
                continue;
            }
            reset_peak(device)?;
            let held = held(device)?.current;
            let training_reserved = reserved(device)?.map(|r| r.current);
            meter.devices.push((device, held, Peaks { training: held, training_reserved, evaluation: None }));
            if device == Device::Cpu {
                meter.rss_reset = reset_peak_rss();
            }
        }
        Ok(meter)
    }

    /// Training steps ran since the last reading.
    fn after_training(&mut self) -> Result<()> {
        for (device, _, peaks) in &mut self.devices {
            peaks.training = peaks.training.max(held(*device)?.peak);
            if let Some(now) = reserved(*device)? {
                peaks.training_reserved = Some(peaks.training_reserved.unwrap_or(0).max(now.peak));
            }
            if *device == Device::Cpu {
                torch_ext::trace_cpu_memory_dump(self.trace_since);
            }
        }
        Ok(())
    }

    /// An evaluation ran since the last step: its peak, then the peak starts again.
    fn after_evaluation(&mut self) -> Result<()> {
        for (device, _, peaks) in &mut self.devices {
            peaks.evaluation = Some(peaks.evaluation.unwrap_or(0).max(held(*device)?.peak));
            reset_peak(*device)?;
        }
        Ok(())
    }

    /// An observer of the run that keeps the meter's readings.
    pub fn observer(meter: &std::cell::RefCell<MemoryMeter>) -> impl Observer + '_ {
        Reading(meter)
    }

    /// Each device's peaks since [`MemoryMeter::start`], as rank `rank`.
    pub fn peaks(&self, rank: usize) -> Result<Vec<PeakMemory>> {
        self.devices
            .iter()
            .map(|&(device, baseline, peaks)| {
                Ok(PeakMemory {
                    rank,
                    device: device::device_label(device),
                    baseline_bytes: baseline,
                    training_peak_bytes: peaks.training,
                    evaluation_peak_bytes: peaks.evaluation,
                    peak_reserved_bytes: peaks.training_reserved,
                    peak_rss_bytes: match device {
                        Device::Cpu => peak_rss().filter(|_| self.rss_reset || cfg!(not(target_os = "linux"))),
                        _ => None,
                    },
                })
            })
            .collect()
    }
}

struct Reading<'m>(&'m std::cell::RefCell<MemoryMeter>);

impl Observer for Reading<'_> {
    fn on_event(&mut self, event: &Event) -> Result<Control> {
        match event {
            Event::Step(_) => self.0.borrow_mut().after_training()?,
            Event::EpochEnded { .. } => self.0.borrow_mut().after_evaluation()?,
            _ => {}
        }
        Ok(Control::Continue)
    }
}

/// CUDA: what the caching allocator reserves now and at the peak (its peak is reset with the
/// allocated one, so after an evaluation it starts again from what stays reserved).
fn reserved(device: Device) -> Result<Option<torch_ext::HeldBytes>> {
    match device {
        Device::Cuda(i) => Ok(Some(torch_ext::cuda_memory(i)?.1)),
        _ => Ok(None),
    }
}

/// What tensors on `device` hold now and at the peak.
fn held(device: Device) -> Result<torch_ext::HeldBytes> {
    match device {
        Device::Cuda(i) => Ok(torch_ext::cuda_memory(i)?.0),
        _ => torch_ext::cpu_memory(),
    }
}

fn reset_peak(device: Device) -> Result<()> {
    match device {
        Device::Cuda(i) => torch_ext::reset_cuda_memory_peak(i),
        _ => torch_ext::reset_cpu_memory_peak(),
    }
}

/// Every rank's peaks, gathered over `world` (each rank of a job trains on one device).
pub fn gather(mine: &[PeakMemory], world: &ProcessGroup) -> Result<Vec<PeakMemory>> {
    if world.world_size() == 1 {
        return Ok(mine.to_vec());
    }
    let json = serde_json::to_vec(mine)?;
    let mut all = Vec::new();
    for rank in 0..world.world_size() {
        let bytes = world.broadcast_bytes(if rank == world.rank() { &json } else { &[] }, rank)?;
        all.extend(serde_json::from_slice::<Vec<PeakMemory>>(&bytes)?);
    }
    Ok(all)
}

/// Linux: `VmHWM` (the peak resident set) starts again from the current resident set.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The process's peak resident set in bytes (`VmHWM`; `ru_maxrss` elsewhere).
fn peak_rss() -> Option<i64> {
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim().parse::<i64>().ok()?;
        return Some(kib * 1024);
    }
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    (unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0).then(|| {
        // SAFETY: initialised by the successful call.
        let usage = unsafe { usage.assume_init() };
        usage.ru_maxrss * if cfg!(target_os = "macos") { 1 } else { 1024 }
    })
}

/// The bytes of optimizer state per parameter of an unsharded optimizer, ZeRO's K for float32
/// state: Adam and LAMB keep two moments (8), SGD and LARS with momentum one buffer (4).
pub fn optimizer_bytes_per_parameter(kind: crate::optim::OptimizerKind, momentum: f64) -> f64 {
    use crate::optim::OptimizerKind;
    match kind {
        OptimizerKind::Adam | OptimizerKind::Lamb => 8.0,
        OptimizerKind::Sgd | OptimizerKind::Lars if momentum > 0.0 => 4.0,
        OptimizerKind::Sgd | OptimizerKind::Lars => 0.0,
    }
}

/// The bytes per element of the largest parameter that an unsharded optimizer's update
/// allocates beside it: Adam none (one pass over memory on the CPU, LibTorch's fused kernel on
/// CUDA), SGD none (in place; weight decay aside), LARS and LAMB their update's temporaries
/// (two parameter-sized tensors).
pub fn update_bytes_per_parameter(kind: crate::optim::OptimizerKind) -> f64 {
    use crate::optim::OptimizerKind;
    match kind {
        OptimizerKind::Adam | OptimizerKind::Sgd => 0.0,
        OptimizerKind::Lars | OptimizerKind::Lamb => 8.0,
    }
}

/// The model state of one rank holding `psi` parameters of a replica, `k` bytes of optimizer
/// state per parameter, over `n` replicas, as the run's style `sync` divides it
/// ([`crate::parallel::Costs::model_state`]: ZeRO's formulas are ZeRO's), and the formula's
/// name: plain replicas (8 + K)Ψ, ZeRO-1 8Ψ + (4 + K)Ψ/N, ZeRO-2 4Ψ + (8 + K)Ψ/N, ZeRO-3
/// (8 + K)Ψ/N.
fn model_state_formula(psi: f64, k: f64, n: f64, sync: GradientSync) -> (f64, &'static str) {
    let costs = sync.strategy();
    (costs.model_state(psi, k, n).total(), costs.formula())
}

/// What one rank holds for the model after training, measured (the bytes its tensors' storages
/// hold), beside its style's formula ([`model_state_formula`]).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ModelState {
    pub params_bytes: usize,
    pub grads_bytes: usize,
    pub optimizer_bytes: usize,
    /// Parameters held but not trained (frozen blocks): no gradients, no optimizer state, and
    /// outside `total_bytes` and the formula, which count what training keeps per parameter.
    pub frozen_bytes: usize,
    pub total_bytes: usize,
    pub formula_bytes: f64,
    pub formula: &'static str,
}

impl ModelState {
    /// The state of the trained parameters `named` and of `optimizer`, beside the `frozen`
    /// parameters.
    pub fn measure(
        named: &[(String, tch::Tensor)],
        frozen: &[tch::Tensor],
        optimizer: &dyn crate::optim::Optimizer,
        replicas: usize,
        sync: GradientSync,
    ) -> Self {
        let held = torch_ext::storage_nbytes;
        let frozen_bytes = frozen.iter().map(held).sum();
        let params_bytes: usize = named.iter().map(|(_, t)| held(t)).sum();
        // (Each storage once: sequence parallelism's whole parameters get their gradients as
        // slices of one summed buffer.)
        let grads: Vec<tch::Tensor> = named.iter().map(|(_, t)| t.grad()).filter(tch::Tensor::defined).collect();
        let grads_bytes = torch_ext::distinct_storage_nbytes(&grads) + optimizer.sharded().map_or(0, |s| s.sharded_gradient_bytes());
        let optimizer_bytes = optimizer.state_bytes();
        let psi = named.iter().map(|(_, t)| t.numel()).sum::<usize>() as f64;
        // K from what the optimizer keeps for an unsharded parameter (Adam 8, SGD momentum 4).
        let k = match optimizer.name() {
            "adam" | "lamb" => 8.0,
            "sgd" | "lars" if optimizer_bytes > 0 => 4.0,
            _ => 0.0,
        };
        // N: the ranks the state is divided over (HSDP's shard group), where it is divided.
        let shards = optimizer.sharded().map_or(0, |s| s.shard_count());
        let n = if shards > 0 { shards } else { replicas };
        let (formula_bytes, formula) = model_state_formula(psi, k, n as f64, sync);
        ModelState {
            params_bytes,
            grads_bytes,
            optimizer_bytes,
            frozen_bytes,
            total_bytes: params_bytes + grads_bytes + optimizer_bytes,
            formula_bytes,
            formula,
        }
    }

    pub fn describe(&self, device: Device) -> String {
        let mib = |b: f64| b / MIB;
        let frozen = match self.frozen_bytes {
            0 => String::new(),
            bytes => format!(", beside {:.2} MiB of frozen parameters", mib(bytes as f64)),
        };
        format!(
            "[{}] model state per rank: {:.2} MiB (parameters {:.2} + gradients {:.2} + optimizer {:.2}){frozen}; formula {} = {:.2} MiB",
            device::device_name(device),
            mib(self.total_bytes as f64),
            mib(self.params_bytes as f64),
            mib(self.grads_bytes as f64),
            mib(self.optimizer_bytes as f64),
            self.formula,
            mib(self.formula_bytes)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn the_meter_keeps_training_and_evaluation_apart() {
        count_cpu_tensors().unwrap();
        let keep = Tensor::zeros([256, 1024], (Kind::Float, Device::Cpu)); // 1 MiB held before
        let meter = std::cell::RefCell::new(MemoryMeter::start(&[Device::Cpu]).unwrap());
        {
            let a = Tensor::ones([1024, 1024], (Kind::Float, Device::Cpu)); // 4 MiB
            let _b = &a * 2.0; // 4 MiB more at once
        }
        meter.borrow_mut().after_training().unwrap();
        {
            let _eval = Tensor::ones([3 * 1024, 1024], (Kind::Float, Device::Cpu));
            // 12 MiB
        }
        meter.borrow_mut().after_evaluation().unwrap();
        {
            let _c = Tensor::ones([512, 1024], (Kind::Float, Device::Cpu)); // 2 MiB: not a new peak
        }
        meter.borrow_mut().after_training().unwrap();
        let peaks = meter.borrow().peaks(3).unwrap();
        assert_eq!(peaks.len(), 1);
        let peak = &peaks[0];
        assert_eq!((peak.rank, peak.device.as_str()), (3, "cpu"));
        assert!(peak.baseline_bytes >= 1 << 20, "{peak:?}");
        let mib = |b: i64| b as f64 / MIB;
        assert!((8.0..8.5).contains(&mib(peak.training_bytes())), "two 4 MiB tensors at once, not the evaluation's 12: {peak:?}");
        let evaluation = peak.evaluation_peak_bytes.unwrap() - peak.baseline_bytes;
        assert!((12.0..12.5).contains(&mib(evaluation)), "{peak:?}");
        assert_eq!(peak.peak_bytes(), peak.evaluation_peak_bytes.unwrap());
        assert!(peak.peak_rss_bytes.unwrap() > peak.peak_bytes() / 2, "{peak:?}");
        assert!(peak.describe().starts_with("rank 3 cpu: "), "{}", peak.describe());
        drop(keep);
    }

    #[test]
    fn zero_formulas_shrink_stage_by_stage() {
        let psi = 1000.0;
        let (plain, _) = model_state_formula(psi, 8.0, 4.0, GradientSync::Ddp);
        let stages: Vec<f64> = [1, 2, 3].iter().map(|&z| model_state_formula(psi, 8.0, 4.0, GradientSync::zero(z)).0).collect();
        assert_eq!((plain, stages[0], stages[1], stages[2]), (16_000.0, 11_000.0, 8_000.0, 4_000.0));
        assert_eq!(optimizer_bytes_per_parameter(crate::optim::OptimizerKind::Sgd, 0.0), 0.0);
        assert_eq!(optimizer_bytes_per_parameter(crate::optim::OptimizerKind::Lars, 0.9), 4.0);
    }
}
