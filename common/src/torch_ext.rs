//! Safe Rust over `csrc/torch_ext.cpp`: the LibTorch C++ calls tch does not bind, compiled
//! against the headers of the LibTorch we link (`build.rs`).
//!
//! - [`pin_memory`]: page-locked host memory without the deprecated device argument tch passes
//!   (which made every CUDA run print LibTorch's deprecation warning).
//! - [`Generator`]: a random generator of one's own (tch has only the global default one), and
//!   [`dropout`] drawing its mask from it: masks keyed to what they belong to (a layer, a
//!   micro-batch) instead of to the order in which threads reach the shared generator.
//! - [`fused_adam`], [`fused_sgd`], the `foreach_*` functions: `torch.optim`'s multi-tensor
//!   kernels (a few launches per step for all parameters instead of several per parameter).
//! - [`set_float32_matmul_precision`]: TF32 for float32 matrix products, as torch's.
//! - [`profiler_start`], [`profiler_stop`], [`RecordRange`]: LibTorch's own profiler (Kineto),
//!   as `torch.profiler.profile` and `record_function`.
//! - [`cpu_memory`], [`cuda_memory`]: bytes held by tensors now and at their peak, from the CUDA
//!   caching allocator's statistics and from a counting wrapper around the CPU allocator.
//! - [`filled_by`]: a new CPU tensor whose elements plain Rust writes in place (tch's
//!   `from_slice` zero-fills a tensor and then copies into it).
use anyhow::{bail, Result};
use std::ffi::c_void;
use tch::{Device, Kind, Tensor};
use torch_sys::C_tensor;

mod ffi {
    use super::*;
    extern "C" {
        pub fn torch_ext_last_error(buffer: *mut u8, size: usize) -> usize;
        pub fn torch_ext_pin_memory(tensor: *const C_tensor) -> *mut C_tensor;
        pub fn torch_ext_is_pinned(tensor: *const C_tensor) -> i32;
        pub fn torch_ext_generator_new(device_type: i32, device_index: i32) -> *mut c_void;
        pub fn torch_ext_generator_free(generator: *mut c_void);
        pub fn torch_ext_generator_set_seed(generator: *mut c_void, seed: u64);
        pub fn torch_ext_dropout(input: *const C_tensor, p: f64, generator: *mut c_void) -> *mut C_tensor;
        pub fn torch_ext_fused_adam(
            params: *const *const C_tensor,
            grads: *const *const C_tensor,
            exp_avgs: *const *const C_tensor,
            exp_avg_sqs: *const *const C_tensor,
            steps: *const *const C_tensor,
            n: usize,
            lr: f64,
            lr_tensor: *const C_tensor,
            beta1: f64,
            beta2: f64,
            weight_decay: f64,
            eps: f64,
        ) -> i32;
        pub fn torch_ext_fused_sgd(
            params: *const *const C_tensor,
            grads: *const *const C_tensor,
            momentum_buffers: *const *const C_tensor,
            n: usize,
            weight_decay: f64,
            momentum: f64,
            lr: f64,
            lr_tensor: *const C_tensor,
            dampening: f64,
            nesterov: bool,
            first_step: bool,
        ) -> i32;
        pub fn torch_ext_foreach_add_scalar_(tensors: *const *const C_tensor, n: usize, value: f64) -> i32;
        pub fn torch_ext_foreach_mul_tensor_(tensors: *const *const C_tensor, n: usize, scalar: *const C_tensor) -> i32;
        pub fn torch_ext_foreach_total_norm(tensors: *const *const C_tensor, n: usize) -> *mut C_tensor;
        pub fn torch_ext_set_float32_matmul_precision(precision: *const std::ffi::c_char) -> i32;
        pub fn torch_ext_float32_matmul_precision(buffer: *mut u8, size: usize);
        pub fn torch_ext_use_deterministic_algorithms(on: bool) -> i32;
        pub fn torch_ext_channels_last(tensor: *const C_tensor) -> *mut C_tensor;
        pub fn torch_ext_make_channels_last_(tensor: *mut C_tensor) -> i32;
        pub fn torch_ext_is_channels_last(tensor: *const C_tensor) -> i32;
        pub fn torch_ext_set_grad(param: *mut C_tensor, grad: *const C_tensor) -> i32;
        pub fn torch_ext_collective_in_backward(input: *const C_tensor, collective: Collective, context: *mut c_void) -> *mut C_tensor;
        pub fn torch_ext_collective_in_forward(input: *const C_tensor, collective: Collective, context: *mut c_void) -> *mut C_tensor;
        pub fn torch_ext_transform_pair(input: *const C_tensor, forward: Transform, backward: Transform, context: *mut c_void) -> *mut C_tensor;
        pub fn torch_ext_gathered_linear(
            input: *const C_tensor,
            weight: *const C_tensor,
            bias: *const C_tensor,
            gather: Transform,
            scatter: Transform,
            context: *mut c_void,
        ) -> *mut C_tensor;
        pub fn torch_ext_chunked_linear_cross_entropy(
            hidden: *const C_tensor,
            weight: *const C_tensor,
            bias: *const C_tensor,
            targets: *const C_tensor,
            chunk_rows: i64,
            compute: i32,
            count_hits: i32,
            loss: *mut *mut C_tensor,
            hits: *mut *mut C_tensor,
        ) -> i32;
        pub fn torch_ext_set_grad_ready_hook(param: *const C_tensor, notify: Notify, context: *mut c_void, index: i64) -> i32;
        pub fn torch_ext_clear_grad_ready_hook(param: *const C_tensor) -> i32;
        pub fn torch_ext_clear_grad(param: *mut C_tensor) -> i32;
        pub fn torch_ext_notify_in_backward(input: *const C_tensor, notify: Notify, context: *mut c_void, index: i64) -> *mut C_tensor;
        pub fn torch_ext_storage_nbytes(tensor: *const C_tensor) -> i64;
        pub fn torch_ext_storage_id(tensor: *const C_tensor) -> i64;
        pub fn torch_ext_free_storage(tensor: *mut C_tensor) -> i32;
        pub fn torch_ext_fill_storage(tensor: *mut C_tensor, values: *const C_tensor) -> i32;
        pub fn torch_ext_profiler_start(cuda: i32, record_shapes: i32) -> i32;
        pub fn torch_ext_profiler_stop(path: *const std::ffi::c_char) -> i32;
        pub fn torch_ext_profiler_thread_state() -> *mut c_void;
        pub fn torch_ext_profiler_thread_join(state: *const c_void) -> *mut c_void;
        pub fn torch_ext_profiler_thread_leave(own: *mut c_void);
        pub fn torch_ext_profiler_thread_state_free(state: *mut c_void);
        pub fn torch_ext_record_function_enter(name: *const std::ffi::c_char) -> *mut c_void;
        pub fn torch_ext_record_function_exit(range: *mut c_void);
        pub fn torch_ext_cpu_memory_stats(out: *mut i64) -> i32;
        pub fn torch_ext_cpu_memory_reset_peak() -> i32;
        pub fn torch_ext_cpu_memory_phase(phase: i32);
        pub fn torch_ext_cpu_memory_dump(path: *const std::ffi::c_char) -> i32;
        pub fn torch_ext_cpu_memory_sequence() -> i64;
        pub fn torch_ext_cuda_memory_stats(device: i32, out: *mut i64) -> i32;
        pub fn torch_ext_cuda_memory_reset_peak(device: i32) -> i32;
    }

    /// A callback for item `index` of what `context` names: 0, or non-zero with a message
    /// written into `message` (at most `size` bytes, NUL-terminated).
    pub type Notify = unsafe extern "C" fn(context: *mut c_void, index: i64, message: *mut u8, size: usize) -> i32;

    /// A collective run in place on `tensor` for [`super::collective_in_backward`]: 0, or
    /// non-zero with a message written into `message` (at most `size` bytes, NUL-terminated).
    pub type Collective = unsafe extern "C" fn(context: *mut c_void, tensor: *mut C_tensor, message: *mut u8, size: usize) -> i32;

    /// A collective from `input` into a new tensor, `*output` (which the shim takes and frees),
    /// for [`super::transform_pair`] and [`super::gathered_linear`]: 0, or non-zero with a
    /// message written into `message` (at most `size` bytes, NUL-terminated).
    pub type Transform = unsafe extern "C" fn(context: *mut c_void, input: *const C_tensor, output: *mut *mut C_tensor, message: *mut u8, size: usize) -> i32;
}

/// The pointers of `tensors`, for a list argument of the shim.
fn pointers(tensors: &[&Tensor]) -> Vec<*const C_tensor> {
    tensors.iter().map(|t| t.as_ptr()).collect()
}

/// Ok, or the shim's error for `what`.
fn status(code: i32, what: &str) -> Result<()> {
    if code != 0 {
        bail!("{what}: {}", last_error());
    }
    Ok(())
}

/// The message the shim left on this thread for its last failure.
fn last_error() -> String {
    let mut buffer = vec![0u8; 4096];
    // SAFETY: the buffer is valid for its length; the shim writes at most that many bytes.
    let length = unsafe { ffi::torch_ext_last_error(buffer.as_mut_ptr(), buffer.len()) };
    buffer.truncate(length.min(buffer.len() - 1));
    String::from_utf8_lossy(&buffer).into_owned()
}

/// A tensor the shim returned, or its error.
fn tensor(ptr: *mut C_tensor, what: &str) -> Result<Tensor> {
    if ptr.is_null() {
        bail!("{what}: {}", last_error());
    }
    // SAFETY: a non-null result is a heap-allocated at::Tensor the caller now owns, as tch's own.
    Ok(unsafe { Tensor::from_ptr(ptr) })
}

/// `tensor` copied into page-locked (pinned) host memory, from which copies to a GPU can run
/// asynchronously (`non_blocking`). Needs a CUDA runtime.
pub fn pin_memory(tensor_: &Tensor) -> Result<Tensor> {
    // SAFETY: a valid tensor pointer for the duration of the call.
    tensor(unsafe { ffi::torch_ext_pin_memory(tensor_.as_ptr()) }, "pin_memory")
}

/// A new contiguous CPU tensor of `shape` whose elements `fill` writes, in place: one pass over
/// the memory where `Tensor::from_slice` of a prepared buffer makes three (the buffer, LibTorch's
/// zero fill, the copy), and no LibTorch kernel, so no OpenMP team, in the calling thread (the
/// data loader's workers). `fill` must write every element: what it leaves is undefined.
pub fn filled_by<T: tch::kind::Element>(shape: &[i64], fill: impl FnOnce(&mut [T])) -> Tensor {
    let tensor = Tensor::empty(shape, (T::KIND, Device::Cpu));
    let elements = tensor.numel();
    // SAFETY: a new contiguous tensor of `elements` elements of type T on the CPU, whose storage
    // nothing else refers to yet; the slice lives only during `fill`.
    let slice = unsafe { std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut T, elements) };
    fill(slice);
    tensor
}

/// Whether `tensor` lives in pinned host memory.
pub fn is_pinned(tensor: &Tensor) -> Result<bool> {
    // SAFETY: as above.
    match unsafe { ffi::torch_ext_is_pinned(tensor.as_ptr()) } {
        -1 => bail!("is_pinned: {}", last_error()),
        pinned => Ok(pinned == 1),
    }
}

/// A random generator of its own for one device, of LibTorch's engine for it (mt19937 on the
/// CPU, Philox on CUDA), independent of the default generator that `tch::manual_seed` seeds.
/// Not shared between threads (`Send`, not `Sync`).
pub struct Generator {
    ptr: *mut c_void,
    device: Device,
}

// SAFETY: the at::Generator it owns may be used from any thread, one at a time (`&mut self`).
unsafe impl Send for Generator {}

impl Generator {
    pub fn new(device: Device) -> Result<Generator> {
        let (device_type, index) = match device {
            Device::Cuda(i) => (1, i as i32),
            _ => (0, 0),
        };
        // SAFETY: plain call; null means failure.
        let ptr = unsafe { ffi::torch_ext_generator_new(device_type, index) };
        if ptr.is_null() {
            bail!("cannot create a random generator on {device:?}: {}", last_error());
        }
        Ok(Generator { ptr, device })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Restarts the generator's stream at `seed`.
    pub fn set_seed(&mut self, seed: u64) {
        // SAFETY: `ptr` is a live generator owned by self.
        unsafe { ffi::torch_ext_generator_set_seed(self.ptr, seed) }
    }
}

impl Drop for Generator {
    fn drop(&mut self) {
        // SAFETY: allocated by torch_ext_generator_new, freed once.
        unsafe { ffi::torch_ext_generator_free(self.ptr) }
    }
}

/// Dropout in training mode with the mask drawn from `generator` (on the input's device):
/// `torch.nn.functional.dropout(input, p)`'s arithmetic, differentiable; the fused kernel on
/// CUDA.
pub fn dropout(input: &Tensor, p: f64, generator: &mut Generator) -> Result<Tensor> {
    if generator.device != input.device() {
        bail!("dropout of a tensor on {:?} with a generator on {:?}", input.device(), generator.device);
    }
    // SAFETY: valid tensor and generator for the duration of the call.
    tensor(unsafe { ffi::torch_ext_dropout(input.as_ptr(), p, generator.ptr) }, "dropout")
}

/// A fused optimizer kernel's learning rate: a number, or a 0-dim float32 tensor on the
/// parameters' device that the kernel reads when it runs (a CUDA graph replays the kernel, and
/// the rate changes between replays: torch's `capturable` optimizers).
#[derive(Clone, Copy)]
pub enum Lr<'a> {
    Value(f64),
    Tensor(&'a Tensor),
}

impl Lr<'_> {
    fn parts(self) -> (f64, *const C_tensor) {
        match self {
            Lr::Value(lr) => (lr, std::ptr::null()),
            Lr::Tensor(t) => (f64::NAN, t.as_ptr()),
        }
    }
}

/// `torch.optim.Adam(fused=True)`'s kernel (`_fused_adam_`) over parameters of one device and
/// kind: `steps` are float32 tensors on that device holding each parameter's step count after
/// this update (increment them first, as torch does).
#[allow(clippy::too_many_arguments)]
pub fn fused_adam(
    params: &[&Tensor],
    grads: &[&Tensor],
    exp_avgs: &[&Tensor],
    exp_avg_sqs: &[&Tensor],
    steps: &[&Tensor],
    lr: Lr,
    (beta1, beta2): (f64, f64),
    weight_decay: f64,
    eps: f64,
) -> Result<()> {
    let n = params.len();
    anyhow::ensure!([grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()].iter().all(|&l| l == n), "fused Adam: lists of different lengths");
    let (p, g, m, v, s) = (pointers(params), pointers(grads), pointers(exp_avgs), pointers(exp_avg_sqs), pointers(steps));
    // SAFETY: `n` valid tensor pointers in each list for the duration of the call.
    let (lr, lr_tensor) = lr.parts();
    let code =
        unsafe { ffi::torch_ext_fused_adam(p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr(), s.as_ptr(), n, lr, lr_tensor, beta1, beta2, weight_decay, eps) };
    status(code, "fused Adam")
}

/// `torch.optim.SGD(fused=True)`'s kernel (`_fused_sgd_`): `first_step` when the momentum
/// buffers are new (the kernel starts them at the gradient); no buffers without momentum.
#[allow(clippy::too_many_arguments)]
pub fn fused_sgd(
    params: &[&Tensor],
    grads: &[&Tensor],
    momentum_buffers: &[&Tensor],
    weight_decay: f64,
    momentum: f64,
    lr: Lr,
    dampening: f64,
    nesterov: bool,
    first_step: bool,
) -> Result<()> {
    let n = params.len();
    anyhow::ensure!(grads.len() == n && (momentum == 0.0 || momentum_buffers.len() == n), "fused SGD: lists of different lengths");
    let (p, g, b) = (pointers(params), pointers(grads), pointers(momentum_buffers));
    // SAFETY: as above (the buffers' list is not read without momentum).
    let (lr, lr_tensor) = lr.parts();
    let code =
        unsafe { ffi::torch_ext_fused_sgd(p.as_ptr(), g.as_ptr(), b.as_ptr(), n, weight_decay, momentum, lr, lr_tensor, dampening, nesterov, first_step) };
    status(code, "fused SGD")
}

/// `tensor += value` for every tensor, in one multi-tensor launch (`_foreach_add_`).
pub fn foreach_add_scalar_(tensors: &[&Tensor], value: f64) -> Result<()> {
    let t = pointers(tensors);
    // SAFETY: valid tensor pointers for the duration of the call.
    status(unsafe { ffi::torch_ext_foreach_add_scalar_(t.as_ptr(), t.len(), value) }, "_foreach_add_")
}

/// `tensor *= scalar` (a 0-dim tensor on their device) for every tensor, in one multi-tensor
/// launch (`_foreach_mul_`).
pub fn foreach_mul_tensor_(tensors: &[&Tensor], scalar: &Tensor) -> Result<()> {
    let t = pointers(tensors);
    // SAFETY: as above.
    status(unsafe { ffi::torch_ext_foreach_mul_tensor_(t.as_ptr(), t.len(), scalar.as_ptr()) }, "_foreach_mul_")
}

/// The 2-norm of all `tensors` together, as `clip_grad_norm_` computes it: `_foreach_norm`, then
/// the norm of the norms (a 0-dim tensor on their device).
pub fn foreach_total_norm(tensors: &[&Tensor]) -> Result<Tensor> {
    let t = pointers(tensors);
    // SAFETY: as above.
    tensor(unsafe { ffi::torch_ext_foreach_total_norm(t.as_ptr(), t.len()) }, "_foreach_norm")
}

/// `torch.set_float32_matmul_precision(name)`: `highest`, `high` (TF32 tensor cores for float32
/// matrix products) or `medium` (bfloat16 ones allowed).
pub fn set_float32_matmul_precision(name: &str) -> Result<()> {
    // LibTorch only warns about another name (and keeps its setting): refuse it here.
    if !["highest", "high", "medium"].contains(&name) {
        bail!("set_float32_matmul_precision: `{name}` is not highest, high or medium");
    }
    let name = std::ffi::CString::new(name)?;
    // SAFETY: a NUL-terminated string for the duration of the call.
    status(unsafe { ffi::torch_ext_set_float32_matmul_precision(name.as_ptr()) }, "set_float32_matmul_precision")
}

/// `torch.use_deterministic_algorithms(on)` with cuDNN's deterministic kernels and its
/// benchmark off: two runs with the same seed launch the same kernels, so they agree bit for
/// bit (an operation without a deterministic kernel then fails, naming itself). cuBLAS needs
/// `CUBLAS_WORKSPACE_CONFIG` set before its first use for the same (see
/// [`crate::device::deterministic`]).
pub fn use_deterministic_algorithms(on: bool) -> Result<()> {
    // SAFETY: plain settings of LibTorch's global context.
    status(unsafe { ffi::torch_ext_use_deterministic_algorithms(on) }, "use_deterministic_algorithms")
}

/// The current float32 matrix-product precision, as [`set_float32_matmul_precision`] names it.
pub fn float32_matmul_precision() -> String {
    let mut buffer = [0u8; 16];
    // SAFETY: the buffer is valid for its length.
    unsafe { ffi::torch_ext_float32_matmul_precision(buffer.as_mut_ptr(), buffer.len()) };
    String::from_utf8_lossy(buffer.split(|&b| b == 0).next().unwrap_or_default()).into_owned()
}

/// A 4-D `tensor` in the channels-last memory format (NHWC in memory, the same NCHW shape, as
/// `tensor.contiguous(memory_format=torch.channels_last)`); any other tensor as it is.
pub fn channels_last(tensor_: &Tensor) -> Result<Tensor> {
    // SAFETY: a valid tensor pointer for the duration of the call.
    tensor(unsafe { ffi::torch_ext_channels_last(tensor_.as_ptr()) }, "channels_last")
}

/// Moves a 4-D variable's data to the channels-last format in place (`param.data = …`, as
/// `nn.Module.to(memory_format=torch.channels_last)`): its gradients and the optimizer state
/// made from it follow. Other tensors are left alone.
pub fn make_channels_last_(variable: &Tensor) -> Result<()> {
    // SAFETY: a valid tensor pointer; the shim swaps the variable's data, not the handle.
    status(unsafe { ffi::torch_ext_make_channels_last_(variable.as_ptr() as *mut C_tensor) }, "channels_last")
}

/// Whether `tensor` is a 4-D tensor laid out channels-last.
pub fn is_channels_last(tensor: &Tensor) -> bool {
    // SAFETY: as above.
    unsafe { ffi::torch_ext_is_channels_last(tensor.as_ptr()) == 1 }
}

/// `param.grad = grad`: the gradient an optimizer reads next, without a backward pass (what
/// torch code does by assigning `p.grad`). `grad` must match the parameter's shape and kind.
pub fn set_grad(param: &Tensor, grad: &Tensor) -> Result<()> {
    // SAFETY: valid tensor pointers; the shim stores a reference-counted handle to `grad`.
    status(unsafe { ffi::torch_ext_set_grad(param.as_ptr() as *mut C_tensor, grad.as_ptr()) }, "set_grad")
}

/// `input` unchanged, with a backward pass that runs `collective` on its gradient (Megatron's
/// f, a custom autograd function of the shim: tch cannot define one).
///
/// # Safety
/// `context` is handed to `collective` when the backward pass reaches this node: it must stay
/// valid until then (or until the graph is dropped without a backward pass).
pub unsafe fn collective_in_backward(input: &Tensor, collective: ffi::Collective, context: *mut c_void) -> Result<Tensor> {
    tensor(ffi::torch_ext_collective_in_backward(input.as_ptr(), collective, context), "f (identity forward, collective backward)")
}

/// `collective` run on a copy of `input`, with a backward pass that passes the gradient through
/// unchanged (Megatron's g).
///
/// # Safety
/// `context` must be valid for `collective` during the call.
pub unsafe fn collective_in_forward(input: &Tensor, collective: ffi::Collective, context: *mut c_void) -> Result<Tensor> {
    tensor(ffi::torch_ext_collective_in_forward(input.as_ptr(), collective, context), "g (collective forward, identity backward)")
}

/// `forward` run on `input` now, `backward` on its gradient in the backward pass (Megatron's
/// sequence-parallel regions: a reduce-scatter and an all-gather along the sequence).
///
/// # Safety
/// `context` must be valid for `forward` during the call and for `backward` until the backward
/// pass ran (or the graph was dropped without one).
pub unsafe fn transform_pair(input: &Tensor, forward: ffi::Transform, backward: ffi::Transform, context: *mut c_void) -> Result<Tensor> {
    tensor(ffi::torch_ext_transform_pair(input.as_ptr(), forward, backward, context), "a sequence-parallel region")
}

/// `input` gathered by `gather`, times `weight`ᵀ, plus `bias`, keeping only `input` for the
/// backward pass, which gathers it again and hands the input's gradient to `scatter`
/// (Megatron's column-parallel layer under sequence parallelism).
///
/// # Safety
/// As [`transform_pair`], for `gather` and `scatter`.
pub unsafe fn gathered_linear(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    gather: ffi::Transform,
    scatter: ffi::Transform,
    context: *mut c_void,
) -> Result<Tensor> {
    let bias = bias.map_or(std::ptr::null(), Tensor::as_ptr);
    tensor(ffi::torch_ext_gathered_linear(input.as_ptr(), weight.as_ptr(), bias, gather, scatter, context), "a sequence-parallel linear layer")
}

/// The mean cross-entropy of the logits `hidden · weightᵀ + bias` (`hidden` `[n, d]`, `weight`
/// `[V, d]`, `bias` `[V]`) against `targets` (`[n]`, int64), computed `chunk_rows` rows at a
/// time so that no `[n, V]` tensor is ever made, forward or backward: the products in `compute`
/// (the kind the output layer computes in: autocast's, or the weights'), the log-softmax and
/// the loss in float32. Its backward pass makes each chunk's logits again from the saved inputs
/// and each row's log-sum-exp. Also the number of rows whose arg-max is their target, when
/// `count_hits` (an int64 0-dim tensor; zero otherwise).
pub fn chunked_linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    targets: &Tensor,
    chunk_rows: i64,
    compute: Kind,
    count_hits: bool,
) -> Result<(Tensor, Tensor)> {
    if chunk_rows < 1 {
        bail!("a chunked cross-entropy of {chunk_rows} rows per chunk");
    }
    /// `c10::ScalarType` of the floating-point kinds a product runs in.
    fn scalar_type(kind: Kind) -> Result<i32> {
        Ok(match kind {
            Kind::Half => 5,
            Kind::Float => 6,
            Kind::Double => 7,
            Kind::BFloat16 => 15,
            other => bail!("a chunked cross-entropy computing in {other:?}"),
        })
    }
    let (mut loss, mut hits) = (std::ptr::null_mut(), std::ptr::null_mut());
    let bias = bias.map_or(std::ptr::null(), Tensor::as_ptr);
    // SAFETY: valid tensors for the duration of the call; on success the shim hands over two
    // heap-allocated tensors the caller then owns, as tch's own.
    let code = unsafe {
        ffi::torch_ext_chunked_linear_cross_entropy(
            hidden.as_ptr(),
            weight.as_ptr(),
            bias,
            targets.as_ptr(),
            chunk_rows,
            scalar_type(compute)?,
            count_hits as i32,
            &mut loss,
            &mut hits,
        )
    };
    status(code, "the chunked output layer and loss")?;
    // SAFETY: as above, both set on success.
    Ok(unsafe { (Tensor::from_ptr(loss), Tensor::from_ptr(hits)) })
}

pub use ffi::{Collective, Notify, Transform};

/// Writes `error` into a callback's message buffer of `size` bytes (NUL-terminated, cut short
/// where it does not fit) and returns the failure code the shim expects.
///
/// # Safety
/// `message` must be valid for `size` bytes.
pub unsafe fn report_callback_error(error: &str, message: *mut u8, size: usize) -> i32 {
    if size > 0 {
        let n = error.len().min(size - 1);
        std::ptr::copy_nonoverlapping(error.as_ptr(), message, n);
        *message.add(n) = 0;
    }
    1
}

/// Registers `notify(context, index)` to run after each backward pass has accumulated into
/// `param`'s gradient (PyTorch's `register_post_accumulate_grad_hook`; one hook per parameter,
/// replacing an earlier one).
///
/// # Safety
/// `context` must stay valid until [`clear_grad_ready_hook`] removed the hook.
pub unsafe fn set_grad_ready_hook(param: &Tensor, notify: Notify, context: *mut c_void, index: i64) -> Result<()> {
    status(ffi::torch_ext_set_grad_ready_hook(param.as_ptr(), notify, context, index), "post-accumulate-grad hook")
}

/// Removes `param`'s post-accumulate-grad hook.
pub fn clear_grad_ready_hook(param: &Tensor) -> Result<()> {
    // SAFETY: a valid tensor for the duration of the call.
    status(unsafe { ffi::torch_ext_clear_grad_ready_hook(param.as_ptr()) }, "post-accumulate-grad hook")
}

/// `param.grad = None` for one parameter (its memory goes back).
pub fn clear_grad(param: &Tensor) -> Result<()> {
    let mut param = param.shallow_clone();
    // SAFETY: a valid tensor for the duration of the call.
    status(unsafe { ffi::torch_ext_clear_grad(param.as_mut_ptr()) }, "clearing a gradient")
}

/// `input` unchanged, with `notify(context, index)` run when its gradient arrives in the
/// backward pass (before the passes of what computed `input`).
///
/// # Safety
/// `context` must stay valid until the graph's backward pass ran or the graph was dropped.
pub unsafe fn notify_in_backward(input: &Tensor, notify: Notify, context: *mut c_void, index: i64) -> Result<Tensor> {
    tensor(ffi::torch_ext_notify_in_backward(input.as_ptr(), notify, context, index), "a backward-pass notification")
}

/// Bytes `tensor`'s storage holds now (0 after [`free_storage`]).
pub fn storage_nbytes(tensor: &Tensor) -> usize {
    // SAFETY: a valid tensor for the duration of the call.
    unsafe { ffi::torch_ext_storage_nbytes(tensor.as_ptr()) }.max(0) as usize
}

/// Bytes held by the storages of `tensors`, each storage counted once (views of one storage,
/// such as gradients that are slices of one summed buffer, share it).
pub fn distinct_storage_nbytes<'t>(tensors: impl IntoIterator<Item = &'t Tensor>) -> usize {
    let mut seen = std::collections::HashSet::new();
    tensors
        .into_iter()
        // SAFETY: a valid tensor for the duration of the call.
        .filter(|t| seen.insert(unsafe { ffi::torch_ext_storage_id(t.as_ptr()) }))
        .map(storage_nbytes)
        .sum()
}

/// Frees `tensor`'s memory, keeping its shape (FSDP's storage resize to 0): all views of its
/// storage see no elements until [`fill_storage`].
pub fn free_storage(tensor: &Tensor) -> Result<()> {
    let mut t = tensor.shallow_clone();
    // SAFETY: a valid tensor for the duration of the call.
    status(unsafe { ffi::torch_ext_free_storage(t.as_mut_ptr()) }, "freeing a storage")
}

/// Gives `tensor`'s storage memory again and copies `values` (its shape) in, without an
/// in-place version change (the autograd graph may hold `tensor` for its backward pass).
pub fn fill_storage(tensor: &Tensor, values: &Tensor) -> Result<()> {
    let mut t = tensor.shallow_clone();
    // SAFETY: valid tensors for the duration of the call.
    status(unsafe { ffi::torch_ext_fill_storage(t.as_mut_ptr(), values.as_ptr()) }, "refilling a storage")
}

/// Starts LibTorch's profiler on this thread (and the autograd threads its work starts): CPU
/// operators, and with `cuda` the kernels, copies and runtime calls they launch.
pub fn profiler_start(cuda: bool, record_shapes: bool) -> Result<()> {
    // SAFETY: no pointers cross.
    status(unsafe { ffi::torch_ext_profiler_start(cuda as i32, record_shapes as i32) }, "starting LibTorch's profiler")
}

/// Stops the profiler and writes its Chrome trace (Kineto's JSON) to `path`.
pub fn profiler_stop(path: &std::path::Path) -> Result<()> {
    let c_path = std::ffi::CString::new(path.to_string_lossy().as_bytes())?;
    // SAFETY: a NUL-terminated string valid for the call.
    status(unsafe { ffi::torch_ext_profiler_stop(c_path.as_ptr()) }, &format!("writing LibTorch's profiler trace {}", path.display()))
}

/// The running profiler as a thread sees it, taken where it was started, for threads that thread
/// starts (a pipeline's stages): [`ProfilerThreadState::join`] makes them record into it too.
pub struct ProfilerThreadState {
    state: *mut c_void,
}

// SAFETY: plain data (a shared pointer and a list of callbacks), read-only once taken.
unsafe impl Send for ProfilerThreadState {}
unsafe impl Sync for ProfilerThreadState {}

impl ProfilerThreadState {
    /// This thread's profiler, if [`profiler_start`] started one.
    pub fn current() -> Option<ProfilerThreadState> {
        // SAFETY: no pointers cross in.
        let state = unsafe { ffi::torch_ext_profiler_thread_state() };
        (!state.is_null()).then_some(ProfilerThreadState { state })
    }

    /// Records this thread's work into the profiler until the guard drops.
    pub fn join(&self) -> ProfiledThread {
        // SAFETY: a state the shim made, alive while `self` is.
        ProfiledThread { own: unsafe { ffi::torch_ext_profiler_thread_join(self.state) } }
    }
}

impl Drop for ProfilerThreadState {
    fn drop(&mut self) {
        // SAFETY: the shim's own allocation, freed once.
        unsafe { ffi::torch_ext_profiler_thread_state_free(self.state) }
    }
}

/// A thread recording into the profiler ([`ProfilerThreadState::join`]); dropped, it records no more.
pub struct ProfiledThread {
    own: *mut c_void,
}

impl Drop for ProfiledThread {
    fn drop(&mut self) {
        // SAFETY: the state torch_ext_profiler_thread_join returned, restored and freed once.
        unsafe { ffi::torch_ext_profiler_thread_leave(self.own) }
    }
}

/// A named range in the profiler's trace while it lives (`torch.profiler.record_function`);
/// nothing when the profiler is off. Ends on the thread that began it (not `Send`).
pub struct RecordRange {
    range: *mut c_void,
}

impl RecordRange {
    pub fn enter(name: &str) -> RecordRange {
        let name = std::ffi::CString::new(name.replace('\0', " ")).expect("no NUL left");
        // SAFETY: a NUL-terminated string valid for the call; the shim copies it.
        RecordRange { range: unsafe { ffi::torch_ext_record_function_enter(name.as_ptr()) } }
    }
}

impl Drop for RecordRange {
    fn drop(&mut self) {
        // SAFETY: the handle torch_ext_record_function_enter returned (or null), ended once.
        unsafe { ffi::torch_ext_record_function_exit(self.range) }
    }
}

/// Bytes held by tensors on a device: now, and at the peak since the last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldBytes {
    pub current: i64,
    pub peak: i64,
}

/// The bytes of CPU tensors held now and at their peak. The first call installs a counting
/// wrapper around LibTorch's CPU allocator: tensors allocated before it are not counted.
pub fn cpu_memory() -> Result<HeldBytes> {
    let mut out = [0i64; 2];
    // SAFETY: `out` holds the two values the shim writes.
    status(unsafe { ffi::torch_ext_cpu_memory_stats(out.as_mut_ptr()) }, "reading CPU memory statistics")?;
    Ok(HeldBytes { current: out[0], peak: out[1] })
}

/// The CPU peak becomes what is held now.
pub fn reset_cpu_memory_peak() -> Result<()> {
    // SAFETY: no pointers cross.
    status(unsafe { ffi::torch_ext_cpu_memory_reset_peak() }, "resetting CPU memory statistics")
}

/// Debugging the CPU peak (`TORCH_EXT_PEAK_TRACE=<path>` set; otherwise these do nothing):
/// the phase of a training step later allocations are tagged with (0 outside the steps, 1 the
/// forward and backward passes, 2 finishing the gradients, 3 the optimizer's update).
pub fn trace_cpu_memory_phase(phase: i32) {
    // SAFETY: no pointers cross.
    unsafe { ffi::torch_ext_cpu_memory_phase(phase) }
}

/// Debugging the CPU peak: writes the CPU tensors held at the peak since the last reset to
/// `<TORCH_EXT_PEAK_TRACE>.<pid>` (`sequence bytes phase` a line, the first line the peak and
/// the sequence number `since` of the first allocation after the baseline), when it is a new peak.
pub fn trace_cpu_memory_dump(since: i64) {
    let Some(base) = std::env::var_os("TORCH_EXT_PEAK_TRACE") else { return };
    let path = format!("{}.{}", base.to_string_lossy(), std::process::id());
    let Ok(c_path) = std::ffi::CString::new(path.clone()) else { return };
    // SAFETY: a NUL-terminated path that outlives the call.
    if unsafe { ffi::torch_ext_cpu_memory_dump(c_path.as_ptr()) } == 1 {
        if let Ok(text) = std::fs::read_to_string(&path) {
            let _ = crate::output::write(std::path::Path::new(&path), format!("# baseline sequence {since}\n{text}"));
        }
    }
}

/// Debugging the CPU peak: the sequence number of the next CPU allocation.
pub fn trace_cpu_memory_sequence() -> i64 {
    // SAFETY: no pointers cross.
    unsafe { ffi::torch_ext_cpu_memory_sequence() }
}

/// The CUDA caching allocator's bytes on GPU `device` (`torch.cuda.memory_stats`): allocated to
/// tensors, and reserved from the driver (allocated plus the allocator's cache).
pub fn cuda_memory(device: usize) -> Result<(HeldBytes, HeldBytes)> {
    let mut out = [0i64; 4];
    // SAFETY: `out` holds the four values the shim writes.
    status(unsafe { ffi::torch_ext_cuda_memory_stats(device as i32, out.as_mut_ptr()) }, "reading CUDA memory statistics")?;
    Ok((HeldBytes { current: out[0], peak: out[1] }, HeldBytes { current: out[2], peak: out[3] }))
}

/// `torch.cuda.reset_peak_memory_stats(device)`.
pub fn reset_cuda_memory_peak(device: usize) -> Result<()> {
    // SAFETY: no pointers cross.
    status(unsafe { ffi::torch_ext_cuda_memory_reset_peak(device as i32) }, "resetting CUDA memory statistics")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seeded_generator_repeats_its_masks_and_leaves_the_default_one_alone() {
        let x = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        let mut generator = Generator::new(Device::Cpu).unwrap();
        tch::manual_seed(7);
        let before = Tensor::rand([4], (Kind::Float, Device::Cpu));
        generator.set_seed(11);
        let a = dropout(&x, 0.25, &mut generator).unwrap();
        let b = dropout(&x, 0.25, &mut generator).unwrap();
        generator.set_seed(11);
        let a_again = dropout(&x, 0.25, &mut generator).unwrap();
        assert!(a.equal(&a_again), "the same seed gives the same mask");
        assert!(!a.equal(&b), "the stream moves on between draws");
        // Kept elements are scaled by 1/(1 − p), the rest are zero; about p of them dropped.
        let kept = a.ne(0.0).sum(Kind::Int64).int64_value(&[]);
        assert!((650..850).contains(&kept), "kept {kept} of 1000 at p = 0.25");
        let scale = a.max().double_value(&[]);
        assert!((scale - 1.0 / 0.75).abs() < 1e-6, "scale {scale}");
        // The default generator did not move: the same draws as without the keyed dropouts.
        tch::manual_seed(7);
        let unchanged = Tensor::rand([4], (Kind::Float, Device::Cpu));
        assert!(before.equal(&unchanged));
    }

    #[test]
    fn keyed_dropout_is_differentiable_with_the_mask_it_drew() {
        let x = Tensor::ones([64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut generator = Generator::new(Device::Cpu).unwrap();
        generator.set_seed(3);
        let y = dropout(&x, 0.5, &mut generator).unwrap();
        y.sum(Kind::Float).backward();
        assert!(x.grad().equal(&y.detach()), "d(sum y)/dx is the scaled mask itself (x = 1)");
        assert!(dropout(&x, 0.0, &mut generator).unwrap().equal(&x));
    }

    #[test]
    fn the_float32_matmul_precision_is_libtorchs_own_setting() {
        assert_eq!(float32_matmul_precision(), "highest", "PyTorch's default");
        set_float32_matmul_precision("high").unwrap();
        assert_eq!(float32_matmul_precision(), "high");
        let err = set_float32_matmul_precision("fastest").unwrap_err();
        assert!(format!("{err}").contains("set_float32_matmul_precision"), "{err}");
        set_float32_matmul_precision("highest").unwrap();
        assert_eq!(float32_matmul_precision(), "highest");
    }

    #[test]
    fn pinning_without_cuda_is_an_error_not_a_crash() {
        let x = Tensor::ones([4], (Kind::Float, Device::Cpu));
        if tch::Cuda::is_available() {
            assert!(is_pinned(&pin_memory(&x).unwrap()).unwrap());
        } else {
            assert!(!is_pinned(&x).unwrap());
            assert!(pin_memory(&x).is_err());
        }
    }

    #[test]
    fn the_cpu_allocator_counts_what_tensors_hold() {
        let before = cpu_memory().unwrap();
        reset_cpu_memory_peak().unwrap();
        let a = Tensor::zeros([1000, 1000], (Kind::Float, Device::Cpu));
        let held = cpu_memory().unwrap();
        assert!(held.current - before.current >= 4_000_000, "{before:?} -> {held:?}");
        let b = Tensor::zeros([500, 1000], (Kind::Double, Device::Cpu));
        drop(a);
        drop(b);
        let after = cpu_memory().unwrap();
        assert!(after.current - before.current < 100_000, "freed: {before:?} -> {after:?}");
        assert!(after.peak - before.current >= 8_000_000, "both held at once: {after:?}");
        reset_cpu_memory_peak().unwrap();
        assert_eq!(cpu_memory().unwrap().peak, cpu_memory().unwrap().current);
    }

    #[test]
    fn the_profiler_writes_a_trace_with_operators_and_named_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.json");
        profiler_start(false, false).unwrap();
        {
            let _step = RecordRange::enter("ProfilerStep#1");
            let x = Tensor::ones([64, 64], (Kind::Float, Device::Cpu));
            let _ = x.matmul(&x).relu();
        }
        let state = ProfilerThreadState::current().expect("a profiler runs");
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let _joined = state.join();
                let _ = Tensor::ones([8], (Kind::Float, Device::Cpu)).sigmoid();
            });
            scope.spawn(|| {
                let _ = Tensor::ones([8], (Kind::Float, Device::Cpu)).tanh();
            });
        });
        drop(state);
        assert!(profiler_start(false, false).is_err(), "a second profiler while one runs");
        profiler_stop(&path).unwrap();
        let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let names: Vec<&str> = trace["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
        for expected in ["aten::matmul", "aten::relu", "ProfilerStep#1", "aten::sigmoid"] {
            assert!(names.contains(&expected), "{expected} missing from {names:?}");
        }
        assert!(!names.contains(&"aten::tanh"), "a thread that did not join is not recorded");
        assert!(ProfilerThreadState::current().is_none(), "no profiler after the stop");
        assert!(profiler_stop(&path).is_err(), "stopping a profiler that is not running");
    }

    #[test]
    fn cuda_memory_statistics_need_a_gpu() {
        if tch::Cuda::is_available() {
            let before = cuda_memory(0).unwrap().0;
            let x = Tensor::zeros([1 << 20], (Kind::Float, Device::Cuda(0)));
            assert!(cuda_memory(0).unwrap().0.current >= before.current + (4 << 20));
            drop(x);
            reset_cuda_memory_peak(0).unwrap();
        } else {
            assert!(cuda_memory(0).is_err());
        }
    }
}
