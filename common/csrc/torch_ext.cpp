// What the project needs of LibTorch's C++ API that tch does not bind, compiled against the
// headers of the same LibTorch (common/build.rs, as torch-sys builds its own C++). Exactly
// what is missing, nothing more; the Rust side is common/src/torch_ext.rs.
//
// Conventions, as torch-sys's: a tensor crosses the boundary as a pointer to a heap-allocated
// at::Tensor (tch's C_tensor); a function that fails returns null (or -1) and leaves the
// exception's message for torch_ext_last_error() on this thread. No exception crosses into Rust.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/DeviceGuard.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "errors.h"

namespace {

using shim::last_error;
using shim::protect_status;

// Runs `f`: a heap-allocated copy of the tensor it returns, or null with the message kept.
template <typename F>
at::Tensor* protect(F&& f) {
  at::Tensor* result = nullptr;
  protect_status([&] { result = new at::Tensor(f()); });
  return result;
}

at::Device device_of(int device_type, int device_index) {
  return device_type == 1 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)) : at::Device(at::kCPU);
}

// A list of tensors from `n` pointers (reference-counted copies: the same storage).
std::vector<at::Tensor> tensors_of(at::Tensor** tensors, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; i++) {
    out.push_back(*tensors[i]);
  }
  return out;
}

// A collective the Rust side runs in place on a tensor (an all-reduce over the tensor-parallel
// group that `context` names): 0, or non-zero with a message in `message` (NUL-terminated, at
// most `size` bytes).
typedef int (*torch_ext_collective)(void* context, at::Tensor* tensor, char* message, size_t size);

void run_collective(int64_t collective, int64_t context, at::Tensor& tensor) {
  char message[2048] = {0};
  auto run = reinterpret_cast<torch_ext_collective>(collective);
  if (run(reinterpret_cast<void*>(context), &tensor, message, sizeof message) != 0) {
    throw std::runtime_error(message[0] ? message : "tensor-parallel collective failed");
  }
}

// Megatron-LM's f (`copy_to_tensor_model_parallel_region`): the identity in the forward pass,
// the collective (an all-reduce sum over the shards) on the gradient in the backward pass.
struct CollectiveInBackward : public torch::autograd::Function<CollectiveInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, int64_t collective,
                            int64_t context) {
    ctx->saved_data["collective"] = collective;
    ctx->saved_data["context"] = context;
    return input;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // Our own copy: the incoming gradient may be shared with another branch of the graph.
    at::Tensor grad = grads[0].contiguous().clone();
    run_collective(ctx->saved_data["collective"].toInt(), ctx->saved_data["context"].toInt(), grad);
    return {grad, at::Tensor(), at::Tensor()};
  }
};

// Megatron-LM's g (`reduce_from_tensor_model_parallel_region`): the collective in the forward
// pass, the identity on the gradient in the backward pass.
struct CollectiveInForward : public torch::autograd::Function<CollectiveInForward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, int64_t collective,
                            int64_t context) {
    at::Tensor output = input.contiguous().clone();
    run_collective(collective, context, output);
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// A callback the Rust side runs for item `index` of what `context` names (a parameter whose
// gradient is ready, a layer whose backward pass starts): 0, or non-zero with a message.
typedef int (*torch_ext_notify)(void* context, int64_t index, char* message, size_t size);

void run_notify(torch_ext_notify notify, void* context, int64_t index) {
  char message[2048] = {0};
  if (notify(context, index, message, sizeof message) != 0) {
    throw std::runtime_error(message[0] ? message : "callback failed");
  }
}

// Runs the callback once the gradient of a parameter has been accumulated into its `.grad`
// (PyTorch's `register_post_accumulate_grad_hook`): where ZeRO-2 reduce-scatters a bucket of
// gradients as soon as it is complete, during the backward pass.
struct NotifyAfterAccumulate : public torch::autograd::PostAccumulateGradHook {
  torch_ext_notify notify;
  void* context;
  int64_t index;
  NotifyAfterAccumulate(torch_ext_notify n, void* c, int64_t i) : notify(n), context(c), index(i) {}
  void operator()(const torch::autograd::Variable& /*param*/) override { run_notify(notify, context, index); }
};

// The identity both ways, running the callback when the gradient arrives in the backward pass,
// before the operations that made the input run theirs: where ZeRO-3 gathers a layer's
// parameters again for its backward pass.
struct NotifyInBackward : public torch::autograd::Function<NotifyInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, int64_t notify,
                            int64_t context, int64_t index) {
    ctx->saved_data["notify"] = notify;
    ctx->saved_data["context"] = context;
    ctx->saved_data["index"] = index;
    return input;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    run_notify(reinterpret_cast<torch_ext_notify>(ctx->saved_data["notify"].toInt()),
               reinterpret_cast<void*>(ctx->saved_data["context"].toInt()), ctx->saved_data["index"].toInt());
    return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// Registers (replacing any earlier one) the post-accumulate-grad hook of `param` (a leaf):
// `notify(context, index)` after each backward pass accumulated into its gradient. `context`
// must stay valid until the hook is cleared. 0, or -1 on error.
int torch_ext_set_grad_ready_hook(const at::Tensor* param, torch_ext_notify notify, void* context, int64_t index) {
  return protect_status([&] {
    TORCH_CHECK(param->is_leaf() && param->requires_grad(), "a post-accumulate-grad hook needs a leaf that requires grad");
    torch::autograd::impl::set_post_acc_grad_hooks(*param, std::make_unique<NotifyAfterAccumulate>(notify, context, index));
  });
}

// Removes the post-accumulate-grad hook of `param`. 0, or -1 on error.
int torch_ext_clear_grad_ready_hook(const at::Tensor* param) {
  return protect_status([&] { torch::autograd::impl::set_post_acc_grad_hooks(*param, nullptr); });
}

// `param.grad = None`: the gradient's memory goes back. 0, or -1 on error.
int torch_ext_clear_grad(at::Tensor* param) {
  return protect_status([&] { param->mutable_grad().reset(); });
}

// `input` unchanged; `notify(context, index)` runs when its gradient arrives in the backward pass.
at::Tensor* torch_ext_notify_in_backward(const at::Tensor* input, torch_ext_notify notify, void* context, int64_t index) {
  return protect([&] {
    return NotifyInBackward::apply(*input, reinterpret_cast<int64_t>(notify), reinterpret_cast<int64_t>(context), index);
  });
}

// Bytes the tensor's storage holds now (0 once freed by torch_ext_free_storage).
int64_t torch_ext_storage_nbytes(const at::Tensor* tensor) {
  return tensor->has_storage() ? static_cast<int64_t>(tensor->storage().nbytes()) : 0;
}

// Frees the memory of the tensor's storage and keeps its shape (FSDP's `_free_storage`): every
// view of the storage, the autograd graph's saved references included, sees an empty storage
// until torch_ext_fill_storage gives it memory again. 0, or -1 on error.
int torch_ext_free_storage(at::Tensor* tensor) {
  return protect_status([&] {
    auto* storage = tensor->storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, tensor->device()));
    storage->set_nbytes(0);
  });
}

// Gives the tensor's storage memory for its elements again and copies `values` (the same
// shape) into it, without counting an in-place change (the autograd graph saved the tensor
// and will read these values). 0, or -1 on error.
int torch_ext_fill_storage(at::Tensor* tensor, const at::Tensor* values) {
  return protect_status([&] {
    auto* storage = tensor->storage().unsafeGetStorageImpl();
    size_t needed = (tensor->storage_offset() + tensor->numel()) * tensor->element_size();
    if (storage->nbytes() < needed) {
      c10::DeviceGuard guard(tensor->device());
      TORCH_CHECK(storage->allocator() != nullptr, "a storage without an allocator cannot be refilled");
      storage->set_data_ptr_noswap(storage->allocator()->allocate(needed));
      storage->set_nbytes(needed);
    }
    tensor->variable_data().copy_(*values);
  });
}

// `input` through Megatron's f: the same values, and a backward pass that runs `collective` on
// the gradient (in place, on a copy). `context` must stay valid until that backward pass ran.
at::Tensor* torch_ext_collective_in_backward(const at::Tensor* input, torch_ext_collective collective, void* context) {
  return protect([&] {
    return CollectiveInBackward::apply(*input, reinterpret_cast<int64_t>(collective), reinterpret_cast<int64_t>(context));
  });
}

// `input` through Megatron's g: `collective` run on a copy of it now; the gradient passes back
// unchanged.
at::Tensor* torch_ext_collective_in_forward(const at::Tensor* input, torch_ext_collective collective, void* context) {
  return protect([&] {
    return CollectiveInForward::apply(*input, reinterpret_cast<int64_t>(collective), reinterpret_cast<int64_t>(context));
  });
}

// The message of the last failure on this thread (empty if none), copied into `buffer`
// (NUL-terminated, truncated to `size`); returns the message's full length and clears it.
size_t torch_ext_last_error(char* buffer, size_t size) {
  return shim::take_last_error(buffer, size);
}

// `tensor.pin_memory()` without the device argument that tch always passes (deprecated since
// PyTorch 2.5: every call printed a warning from Memory.cpp).
at::Tensor* torch_ext_pin_memory(const at::Tensor* tensor) {
  return protect([&] { return tensor->pin_memory(); });
}

// 1 if `tensor` lives in page-locked host memory, 0 if not, -1 on error.
int torch_ext_is_pinned(const at::Tensor* tensor) {
  try {
    return tensor->is_pinned() ? 1 : 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
}

// A random generator of its own for `device` (a copy of the device's default generator, so of
// the same engine: mt19937 on the CPU, Philox on CUDA), independent of the default one.
at::Generator* torch_ext_generator_new(int device_type, int device_index) {
  try {
    auto device = device_of(device_type, device_index);
    return new at::Generator(at::globalContext().defaultGenerator(device).clone());
  } catch (const std::exception& e) {
    last_error = e.what();
    return nullptr;
  }
}

void torch_ext_generator_free(at::Generator* generator) {
  delete generator;
}

// Seeds the generator: the same seed gives the same stream (on CUDA the Philox offset restarts
// at 0, as torch.cuda.manual_seed does).
void torch_ext_generator_set_seed(at::Generator* generator, uint64_t seed) {
  std::lock_guard<std::mutex> lock(generator->mutex());
  generator->set_current_seed(seed);
}

// Dropout of `input` with probability `p` (training), drawing the mask from `generator`:
// `torch.nn.functional.dropout`'s arithmetic (keep with probability 1 − p, scale by 1/(1 − p)),
// differentiable. CUDA: the fused kernel (one launch, mask kept for backward); CPU: as ATen's
// own CPU dropout, a Bernoulli mask multiplied in.
at::Tensor* torch_ext_dropout(const at::Tensor* input, double p, at::Generator* generator) {
  return protect([&] {
    if (p <= 0.0) {
      return *input;
    }
    if (p >= 1.0) {
      return *input * 0;
    }
    if (input->is_cuda()) {
      return std::get<0>(at::_fused_dropout(*input, 1.0 - p, *generator));
    }
    auto noise = at::empty_like(*input, at::MemoryFormat::Contiguous).bernoulli_(1.0 - p, *generator);
    noise.div_(1.0 - p);
    return *input * noise;
  });
}

// torch.optim.Adam(fused=True)'s kernel over `n` parameters (same device and kind): one launch
// (per chunk of tensors) instead of several per parameter. `steps` are float32 tensors on the
// parameters' device holding each parameter's step count after this update (torch increments
// them before the call). 0, or -1 on error.
// `lr_tensor`, when not null, is the learning rate as a tensor on the parameters' device (read
// by the kernel when it runs: what a CUDA graph replays with a changing rate), else `lr`.
int torch_ext_fused_adam(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs, at::Tensor** exp_avg_sqs,
                         at::Tensor** steps, size_t n, double lr, const at::Tensor* lr_tensor, double beta1, double beta2,
                         double weight_decay, double eps) {
  return protect_status([&] {
    auto ps = tensors_of(params, n);
    if (lr_tensor != nullptr) {
      at::_fused_adam_(ps, tensors_of(grads, n), tensors_of(exp_avgs, n), tensors_of(exp_avg_sqs, n), {},
                       tensors_of(steps, n), *lr_tensor, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                       /*maximize=*/false);
    } else {
      at::_fused_adam_(ps, tensors_of(grads, n), tensors_of(exp_avgs, n), tensors_of(exp_avg_sqs, n), {},
                       tensors_of(steps, n), lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                       /*maximize=*/false);
    }
  });
}

// torch.optim.SGD(fused=True)'s kernel: `first_step` when the momentum buffers are new (the
// kernel then starts them at the gradient, as torch does); no buffers without momentum.
// `lr_tensor` as in torch_ext_fused_adam.
int torch_ext_fused_sgd(at::Tensor** params, at::Tensor** grads, at::Tensor** momentum_buffers, size_t n,
                        double weight_decay, double momentum, double lr, const at::Tensor* lr_tensor, double dampening,
                        bool nesterov, bool first_step) {
  return protect_status([&] {
    std::vector<at::Tensor> buffers = momentum == 0.0 ? std::vector<at::Tensor>{} : tensors_of(momentum_buffers, n);
    if (lr_tensor != nullptr) {
      at::_fused_sgd_(tensors_of(params, n), tensors_of(grads, n), buffers, weight_decay, momentum, *lr_tensor,
                      dampening, nesterov, /*maximize=*/false, first_step);
    } else {
      at::_fused_sgd_(tensors_of(params, n), tensors_of(grads, n), buffers, weight_decay, momentum, lr, dampening,
                      nesterov, /*maximize=*/false, first_step);
    }
  });
}

// `tensor += value` for every tensor of the list, in one multi-tensor launch.
int torch_ext_foreach_add_scalar_(at::Tensor** tensors, size_t n, double value) {
  return protect_status([&] { at::_foreach_add_(tensors_of(tensors, n), value); });
}

// `tensor *= scalar` (a 0-dim tensor) for every tensor of the list, in one multi-tensor launch.
int torch_ext_foreach_mul_tensor_(at::Tensor** tensors, size_t n, const at::Tensor* scalar) {
  return protect_status([&] { at::_foreach_mul_(tensors_of(tensors, n), *scalar); });
}

// The 2-norm of all `n` tensors together, as torch.nn.utils.clip_grad_norm_ computes it:
// `_foreach_norm` per tensor (one multi-tensor launch), then the norm of those norms.
at::Tensor* torch_ext_foreach_total_norm(at::Tensor** tensors, size_t n) {
  return protect([&] {
    auto norms = at::_foreach_norm(tensors_of(tensors, n), 2);
    return at::linalg_vector_norm(at::stack(norms), 2);
  });
}

// torch.set_float32_matmul_precision: "highest" (float32 everywhere), "high" (TF32 tensor cores
// for float32 matrix products), "medium" (bfloat16 inner products allowed). 0, or -1 on error.
int torch_ext_set_float32_matmul_precision(const char* precision) {
  return protect_status([&] { at::globalContext().setFloat32MatmulPrecision(std::string(precision)); });
}

// The current setting, as one of the three names (copied into `buffer`).
void torch_ext_float32_matmul_precision(char* buffer, size_t size) {
  std::string name;
  switch (at::globalContext().float32MatmulPrecision()) {
    case at::Float32MatmulPrecision::HIGHEST: name = "highest"; break;
    case at::Float32MatmulPrecision::HIGH: name = "high"; break;
    case at::Float32MatmulPrecision::MEDIUM: name = "medium"; break;
  }
  if (size > 0) {
    size_t n = name.size() < size - 1 ? name.size() : size - 1;
    std::memcpy(buffer, name.data(), n);
    buffer[n] = '\0';
  }
}

// `tensor` in the channels-last memory format (NHWC order in memory, the same NCHW shape) for a
// 4-D tensor; other tensors unchanged. What `tensor.contiguous(memory_format=torch.channels_last)` does.
at::Tensor* torch_ext_channels_last(const at::Tensor* tensor) {
  return protect([&] { return tensor->dim() == 4 ? tensor->contiguous(at::MemoryFormat::ChannelsLast) : *tensor; });
}

// A 4-D parameter's data moved to the channels-last format in place (`param.data = ...`, as
// `nn.Module.to(memory_format=...)` does): the variable, its gradient and the optimizer state
// made from it follow; other tensors are left alone. 0, or -1 on error.
int torch_ext_make_channels_last_(at::Tensor* tensor) {
  return protect_status([&] {
    if (tensor->dim() == 4) {
      c10::NoGradGuard no_grad;
      tensor->set_data(tensor->detach().contiguous(at::MemoryFormat::ChannelsLast));
    }
  });
}

// 1 when `tensor` is laid out channels-last, 0 when not.
int torch_ext_is_channels_last(const at::Tensor* tensor) {
  return tensor->dim() == 4 && tensor->is_contiguous(at::MemoryFormat::ChannelsLast) ? 1 : 0;
}

// `param.grad = grad` (the same storage, as torch's `p.grad = g`). 0, or -1 on error.
int torch_ext_set_grad(at::Tensor* param, const at::Tensor* grad) {
  return protect_status([&] { param->mutable_grad() = *grad; });
}

}  // extern "C"
