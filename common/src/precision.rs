//! Precision, as Lightning's `precision=` flag names it: `32` (float32 everywhere),
//! `16-mixed` (float16 autocast with a dynamic gradient scaler), `bf16-mixed` (bfloat16
//! autocast, no scaler: bfloat16 has float32's exponent range), and the "true" half precisions
//! `16-true` and `bf16-true`: the course slide's `model.half()`, weights, gradients, optimizer
//! state and activations all in the 16-bit type, no autocast and no scaler (half the memory of
//! the model's state; no float32 master weights, so small updates can round away). One
//! exception: Adam keeps its moments of float16 parameters in float32 (float16 cannot hold ε
//! nor the squares of small gradients, and 16-true diverged without; `optim::moment_kind`).
//!
//! # Autocast
//!
//! tch's `autocast` turns on LibTorch's CUDA autocast only, in float16. LibTorch itself has
//! autocast per device type with a chosen lower-precision type (`at::autocast::
//! set_autocast_enabled(DeviceType, bool)`, `set_autocast_dtype(DeviceType, ScalarType)`, what
//! `torch.autocast(device_type, dtype)` calls), exported by `libtorch_cpu.so`; [`autocast`] calls
//! those directly, so bfloat16 autocast works on the GPU and on the CPU, and float16 on the GPU.
//! Autocast state is per thread in LibTorch (as torch's), so a thread that runs the model (a
//! pipeline stage) enters it itself. Parameters, gradients and optimizer state stay float32 (the
//! "master weights"); autocast runs matrix products and convolutions in the lower precision and
//! keeps reductions, softmax and losses in float32.
//!
//! # Gradient scaling (float16)
//!
//! [`GradScaler`] is `torch.amp.GradScaler` with its defaults: the loss is multiplied by the
//! scale (initially 2^16) before backward, so small gradients do not flush to zero in float16;
//! before the optimizer step the gradients are divided by it, and a step whose gradients hold an
//! inf or NaN is skipped and the scale halved; after 2,000 steps in a row without, the scale
//! doubles. The scale and its counter go into checkpoints.
use std::cell::Cell;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::usage;

/// The `--precision` flag.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum Precision {
    /// float32 everywhere.
    #[default]
    #[value(name = "32", alias = "32-true")]
    #[serde(rename = "32")]
    Full,
    /// float16 autocast and a dynamic gradient scaler (GPU only).
    #[value(name = "16-mixed", alias = "16")]
    #[serde(rename = "16-mixed")]
    Half,
    /// bfloat16 autocast (GPU or CPU).
    #[value(name = "bf16-mixed", alias = "bf16")]
    #[serde(rename = "bf16-mixed")]
    BHalf,
    /// The model in float16 (`model.half()`): weights, gradients, optimizer state and
    /// activations (GPU only).
    #[value(name = "16-true")]
    #[serde(rename = "16-true")]
    HalfTrue,
    /// The model in bfloat16 (`model.bfloat16()`), GPU or CPU.
    #[value(name = "bf16-true")]
    #[serde(rename = "bf16-true")]
    BHalfTrue,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Full => "32",
            Precision::Half => "16-mixed",
            Precision::BHalf => "bf16-mixed",
            Precision::HalfTrue => "16-true",
            Precision::BHalfTrue => "bf16-true",
        }
    }

    /// The kind autocast computes in, if any.
    pub fn autocast_kind(self) -> Option<Kind> {
        match self {
            Precision::Half => Some(Kind::Half),
            Precision::BHalf => Some(Kind::BFloat16),
            Precision::Full | Precision::HalfTrue | Precision::BHalfTrue => None,
        }
    }

    /// The kind the model's floating-point state and inputs are held in, where not float32
    /// (the true half precisions).
    pub fn weights_kind(self) -> Option<Kind> {
        match self {
            Precision::HalfTrue => Some(Kind::Half),
            Precision::BHalfTrue => Some(Kind::BFloat16),
            Precision::Full | Precision::Half | Precision::BHalf => None,
        }
    }

    /// Fails, with a usage error, where `device` cannot train in this precision.
    pub fn check(self, device: Device) -> Result<()> {
        if matches!(self, Precision::Half | Precision::HalfTrue) && !device.is_cuda() {
            return usage(format!(
                "--precision {} needs a GPU: LibTorch's float16 kernels are for CUDA \
                 (on the CPU use --precision bf16-mixed or bf16-true)",
                self.name()
            ));
        }
        Ok(())
    }

    /// What to tell a user who wrote Lightning's older name `16` or `bf16` (read as the mixed
    /// precision, as Lightning 2 reads it), given the command line's arguments.
    pub fn legacy_name_note(args: impl IntoIterator<Item = String>) -> Option<String> {
        let args: Vec<String> = args.into_iter().collect();
        let given = args.iter().enumerate().find_map(|(i, arg)| match arg.strip_prefix("--precision") {
            Some("") => args.get(i + 1).cloned(),
            Some(rest) => rest.strip_prefix('=').map(str::to_string),
            None => None,
        })?;
        let meant = match given.as_str() {
            "16" => "16-mixed",
            "bf16" => "bf16-mixed",
            _ => return None,
        };
        Some(format!(
            "note: --precision {given} is read as {meant} (autocast, float32 weights), as Lightning 2 reads it; \
             for the whole model in 16 bits (model.half()) use --precision {given}-true"
        ))
    }

    /// Whether training in this precision needs a [`GradScaler`].
    pub fn needs_scaler(self) -> bool {
        self == Precision::Half
    }
}

/// The `--matmul-precision` flag: PyTorch's `torch.set_float32_matmul_precision`, for float32
/// matrix products and convolutions outside autocast.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulPrecision {
    /// float32 arithmetic throughout (PyTorch's default).
    #[default]
    Highest,
    /// TF32 tensor cores for float32 matrix products (10-bit mantissa inputs, float32 sums).
    High,
    /// bfloat16 inner products allowed too.
    Medium,
}

impl MatmulPrecision {
    pub fn name(self) -> &'static str {
        match self {
            MatmulPrecision::Highest => "highest",
            MatmulPrecision::High => "high",
            MatmulPrecision::Medium => "medium",
        }
    }

    /// Sets it for the process (LibTorch's global context, as torch does).
    pub fn apply(self) -> Result<()> {
        crate::torch_ext::set_float32_matmul_precision(self.name())
    }
}

/// LibTorch's autocast state, by the C++ names `libtorch_cpu.so` exports (see the module docs).
/// `c10::DeviceType` and `c10::ScalarType` are `int8_t` enums, passed as such.
mod ffi {
    #[link(name = "torch_cpu")]
    extern "C" {
        #[link_name = "_ZN2at8autocast20set_autocast_enabledEN3c1010DeviceTypeEb"]
        pub fn set_autocast_enabled(device_type: i8, enabled: bool);
        #[link_name = "_ZN2at8autocast19is_autocast_enabledEN3c1010DeviceTypeE"]
        pub fn is_autocast_enabled(device_type: i8) -> bool;
        #[link_name = "_ZN2at8autocast18set_autocast_dtypeEN3c1010DeviceTypeENS1_10ScalarTypeE"]
        pub fn set_autocast_dtype(device_type: i8, dtype: i8);
        #[link_name = "_ZN2at8autocast18get_autocast_dtypeEN3c1010DeviceTypeE"]
        pub fn get_autocast_dtype(device_type: i8) -> i8;
        #[link_name = "_ZN2at8autocast17increment_nestingEv"]
        pub fn increment_nesting() -> i32;
        #[link_name = "_ZN2at8autocast17decrement_nestingEv"]
        pub fn decrement_nesting() -> i32;
        #[link_name = "_ZN2at8autocast11clear_cacheEv"]
        pub fn clear_cache();
    }
}

/// `c10::DeviceType` of `device`.
fn device_type(device: Device) -> i8 {
    match device {
        Device::Cuda(_) => 1,
        _ => 0,
    }
}

/// `c10::ScalarType` of the kinds autocast computes in.
fn scalar_type(kind: Kind) -> i8 {
    match kind {
        Kind::Half => 5,
        Kind::BFloat16 => 15,
        other => unreachable!("autocast computes in float16 or bfloat16, not {other:?}"),
    }
}

/// Runs `f` with LibTorch's autocast on for `device`'s type in `precision` (on this thread), as
/// `with torch.autocast(device_type, dtype):` does; just runs `f` for [`Precision::Full`]. The
/// previous state is restored afterwards, also when `f` panics.
pub fn autocast<T>(precision: Precision, device: Device, f: impl FnOnce() -> T) -> T {
    let Some(kind) = precision.autocast_kind() else { return f() };
    let device_type = device_type(device);
    // SAFETY: plain setters and getters of LibTorch's thread-local autocast state, called with
    // valid enum values.
    let previous = unsafe {
        let previous = (ffi::is_autocast_enabled(device_type), ffi::get_autocast_dtype(device_type));
        ffi::set_autocast_enabled(device_type, true);
        ffi::set_autocast_dtype(device_type, scalar_type(kind));
        ffi::increment_nesting();
        previous
    };
    /// Restores the state when dropped (the end of `f`, or a panic in it).
    struct Restore(i8, (bool, i8));
    impl Drop for Restore {
        fn drop(&mut self) {
            let Restore(device_type, (enabled, dtype)) = *self;
            // SAFETY: as above; the cache holds casts made inside this region only.
            unsafe {
                if ffi::decrement_nesting() == 0 {
                    ffi::clear_cache();
                }
                ffi::set_autocast_enabled(device_type, enabled);
                ffi::set_autocast_dtype(device_type, dtype);
            }
        }
    }
    let _restore = Restore(device_type, previous);
    f()
}

/// The kind autocast computes matrix products in on this thread for `device`'s type, where it
/// is on (what a `linear` inside [`autocast`] returns).
pub fn active_autocast_kind(device: Device) -> Option<Kind> {
    let device_type = device_type(device);
    // SAFETY: plain getters of LibTorch's thread-local autocast state.
    let (enabled, dtype) = unsafe { (ffi::is_autocast_enabled(device_type), ffi::get_autocast_dtype(device_type)) };
    match (enabled, dtype) {
        (false, _) => None,
        (true, 5) => Some(Kind::Half),
        (true, 15) => Some(Kind::BFloat16),
        (true, _) => Some(Kind::Float),
    }
}

/// `torch.amp.GradScaler`: dynamic loss scaling for float16 training (see the module docs).
pub struct GradScaler {
    /// The current scale, a float32 tensor of one element on the training device.
    scale: Tensor,
    /// Steps in a row without inf/NaN gradients (int32, as torch's `_growth_tracker`).
    growth_tracker: Tensor,
    /// Whether the last unscale found an inf or NaN (float32 0/1, as torch's `found_inf`).
    found_inf: Tensor,
    /// The gradients of this step have been divided by the scale already.
    unscaled: Cell<bool>,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: i64,
}

/// The part of a [`GradScaler`] that a checkpoint keeps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScalerState {
    pub scale: f64,
    pub growth_tracker: i64,
}

impl GradScaler {
    /// torch's defaults: scale 2^16, ×2 after 2,000 clean steps, ×0.5 after an inf or NaN.
    pub fn new(device: Device) -> GradScaler {
        GradScaler {
            scale: Tensor::full([1], 65536.0, (Kind::Float, device)),
            growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
            found_inf: Tensor::zeros([1], (Kind::Float, device)),
            unscaled: Cell::new(false),
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }

    pub fn scale_value(&self) -> f64 {
        self.scale.double_value(&[0])
    }

    /// `loss × scale`, to call backward on.
    pub fn scale(&self, loss: &Tensor) -> Tensor {
        loss * self.scale.to_kind(loss.kind()).reshape([])
    }

    /// Divides the gradients of `params` by the scale (once per step; later calls do nothing)
    /// and records whether any holds an inf or NaN. Call it before anything reads the gradients
    /// (clipping).
    pub fn unscale(&self, params: &[Tensor]) {
        if self.unscaled.replace(true) {
            return;
        }
        tch::no_grad(|| {
            // torch computes the reciprocal in float32 (double precision on the host, then cast).
            let inv_scale = self.scale.reciprocal();
            let mut non_finite = Vec::new();
            for param in params {
                let grad = param.grad();
                if !grad.defined() {
                    continue;
                }
                non_finite.push(grad.isfinite().logical_not().any().to_device(self.found_inf.device()));
                let _ = grad.shallow_clone().g_mul_(&inv_scale.to_device(grad.device()).to_kind(grad.kind()));
            }
            let found = match non_finite.is_empty() {
                true => Tensor::zeros([1], (Kind::Float, self.found_inf.device())),
                false => Tensor::stack(&non_finite, 0).any().to_kind(Kind::Float).reshape([1]),
            };
            self.found_inf.shallow_clone().copy_(&found);
        });
    }

    /// Makes the inf/NaN verdict of the last unscale the same on every rank of `group`: an inf
    /// on any rank (a pipeline stage) means every rank skips the step. Call it after
    /// [`GradScaler::unscale`] on every rank of the group.
    pub fn agree(&self, group: &crate::comm::ProcessGroup) -> Result<()> {
        let mut found = self.found_inf.shallow_clone();
        group.all_reduce(&mut found, crate::comm::ReduceOp::Sum)?;
        let _ = found.clamp_max_(1.0);
        Ok(())
    }

    /// Unscales (if not done yet) and runs `step` unless a gradient holds an inf or NaN;
    /// returns whether it ran. Then call [`GradScaler::update`].
    pub fn step(&self, params: &[Tensor], step: impl FnOnce() -> Result<()>) -> Result<bool> {
        self.unscale(params);
        let skip = self.found_inf.double_value(&[0]) != 0.0;
        if !skip {
            step()?;
        }
        Ok(!skip)
    }

    /// Backs the scale off after an inf/NaN step, or grows it after `growth_interval` clean
    /// steps (LibTorch's `_amp_update_scale_`, torch's kernel), and gets ready for the next step.
    pub fn update(&mut self) {
        let mut scale = self.scale.shallow_clone();
        let _ = scale.internal_amp_update_scale_(&self.growth_tracker, &self.found_inf, self.growth_factor, self.backoff_factor, self.growth_interval);
        self.unscaled.set(false);
    }

    pub fn state(&self) -> GradScalerState {
        GradScalerState { scale: self.scale.double_value(&[0]), growth_tracker: self.growth_tracker.int64_value(&[0]) }
    }

    pub fn load_state(&mut self, state: GradScalerState) {
        let _ = self.scale.fill_(state.scale);
        let _ = self.growth_tracker.fill_(state.growth_tracker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_with_grad(values: &[f32]) -> Tensor {
        let p = Tensor::zeros([values.len() as i64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        (&p * Tensor::from_slice(values)).sum(Kind::Float).backward();
        p
    }

    #[test]
    fn lightnings_precision_names_parse() {
        use clap::ValueEnum;
        for (name, precision) in [
            ("32", Precision::Full),
            ("32-true", Precision::Full),
            ("16-mixed", Precision::Half),
            ("16", Precision::Half),
            ("bf16", Precision::BHalf),
            ("bf16-mixed", Precision::BHalf),
            ("16-true", Precision::HalfTrue),
            ("bf16-true", Precision::BHalfTrue),
        ] {
            assert_eq!(Precision::from_str(name, false), Ok(precision), "{name}");
        }
        assert!(Precision::from_str("8", false).is_err());
    }

    #[test]
    fn lightnings_older_names_get_a_note_and_the_new_ones_none() {
        let note = |args: &[&str]| Precision::legacy_name_note(args.iter().map(|a| a.to_string()));
        assert!(note(&["exercise1", "--precision", "16"]).unwrap().contains("--precision 16 is read as 16-mixed"));
        assert!(note(&["exercise1", "--precision=bf16"]).unwrap().contains("bf16 is read as bf16-mixed"));
        assert!(note(&["exercise1", "--precision", "bf16"]).unwrap().contains("--precision bf16-true"));
        for args in [&["exercise1", "--precision", "16-mixed"][..], &["exercise1", "--precision=bf16-true"], &["exercise1", "--lr", "16"]] {
            assert_eq!(note(args), None, "{args:?}");
        }
    }

    #[test]
    fn true_precisions_hold_the_model_in_16_bits_without_autocast_or_scaler() {
        for (precision, kind) in [(Precision::HalfTrue, Kind::Half), (Precision::BHalfTrue, Kind::BFloat16)] {
            assert_eq!((precision.weights_kind(), precision.autocast_kind(), precision.needs_scaler()), (Some(kind), None, false));
        }
        for mixed in [Precision::Full, Precision::Half, Precision::BHalf] {
            assert_eq!(mixed.weights_kind(), None);
        }
        assert!(Precision::BHalfTrue.check(Device::Cpu).is_ok());
        let err = Precision::HalfTrue.check(Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("--precision 16-true needs a GPU"), "{err}");
    }

    #[test]
    fn the_scaler_skips_inf_steps_backs_off_and_grows_as_torch() {
        let mut scaler = GradScaler::new(Device::Cpu);
        scaler.growth_interval = 3;
        assert_eq!(scaler.scale_value(), 65536.0);
        let mut steps_taken = 0;
        // (gradient holds an inf?, scale after the update)
        let script = [
            (false, 65536.0),
            (true, 32768.0), // inf: skip, halve, reset the counter
            (false, 32768.0),
            (false, 32768.0),
            (false, 65536.0), // 3 clean steps in a row: double
            (true, 32768.0),
            (true, 16384.0),
        ];
        for (i, &(inf, expected)) in script.iter().enumerate() {
            let value = if inf { f32::INFINITY } else { 2.0 };
            let p = param_with_grad(&[value * scaler.scale_value() as f32, 3.0 * scaler.scale_value() as f32]);
            let ran = scaler.step(std::slice::from_ref(&p), || {
                steps_taken += 1;
                Ok(())
            });
            assert_eq!(ran.unwrap(), !inf, "step {i}");
            if !inf {
                // The gradient is back in its own units.
                assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), [2.0, 3.0], "step {i}");
            }
            scaler.update();
            assert_eq!(scaler.scale_value(), expected, "step {i}");
        }
        assert_eq!(steps_taken, 4);
        let state = scaler.state();
        assert_eq!(state, GradScalerState { scale: 16384.0, growth_tracker: 0 });
        let mut restored = GradScaler::new(Device::Cpu);
        restored.load_state(GradScalerState { scale: 512.0, growth_tracker: 2 });
        assert_eq!(restored.state(), GradScalerState { scale: 512.0, growth_tracker: 2 });
    }

    #[test]
    fn nan_gradients_also_skip_and_unscale_happens_once_per_step() {
        let mut scaler = GradScaler::new(Device::Cpu);
        let p = param_with_grad(&[f32::NAN, 1.0]);
        assert!(!scaler.step(std::slice::from_ref(&p), || Ok(())).unwrap());
        scaler.update();
        assert_eq!(scaler.scale_value(), 32768.0);
        let p = param_with_grad(&[32768.0, 65536.0]);
        scaler.unscale(std::slice::from_ref(&p)); // before clipping, say
        assert!(scaler.step(std::slice::from_ref(&p), || Ok(())).unwrap());
        assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), [1.0, 2.0], "divided once, not twice");
    }

    #[test]
    fn bf16_autocast_runs_matrix_products_in_bfloat16_on_the_cpu_and_restores_the_state() {
        let a = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
        let inside = autocast(Precision::BHalf, Device::Cpu, || a.matmul(&a));
        assert_eq!(inside.kind(), Kind::BFloat16);
        assert_eq!(a.matmul(&a).kind(), Kind::Float, "autocast is off again afterwards");
        assert_eq!(autocast(Precision::Full, Device::Cpu, || a.matmul(&a)).kind(), Kind::Float);
        // Nested regions restore the outer one.
        autocast(Precision::BHalf, Device::Cpu, || {
            autocast(Precision::BHalf, Device::Cpu, || ());
            assert_eq!(a.matmul(&a).kind(), Kind::BFloat16, "still inside the outer region");
        });
    }

    #[test]
    fn float16_on_the_cpu_is_a_usage_error() {
        let err = Precision::Half.check(Device::Cpu).unwrap_err();
        assert!(format!("{err}").contains("--precision 16-mixed needs a GPU"), "{err}");
        assert_eq!(crate::error::exit_code(&err), 2);
        assert!(Precision::BHalf.check(Device::Cpu).is_ok());
        assert!(Precision::Half.check(Device::Cuda(0)).is_ok());
    }
}
