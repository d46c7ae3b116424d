// What the project needs of LibTorch's C++ API that tch does not bind, compiled against the
// headers of the same LibTorch (common/build.rs, as torch-sys builds its own C++). Exactly
// what is missing, nothing more; the Rust side is common/src/torch_ext.rs.
//
// Conventions, as torch-sys's: a tensor crosses the boundary as a pointer to a heap-allocated
// at::Tensor (tch's C_tensor); a function that fails returns null (or -1) and leaves the
// exception's message for torch_ext_last_error() on this thread. No exception crosses into Rust.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

thread_local std::string last_error;

template <typename F>
at::Tensor* protect(F&& f) {
  try {
    return new at::Tensor(f());
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return nullptr;
}

at::Device device_of(int device_type, int device_index) {
  return device_type == 1 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)) : at::Device(at::kCPU);
}

}  // namespace

extern "C" {

// The message of the last failure on this thread (empty if none), copied into `buffer`
// (NUL-terminated, truncated to `size`); returns the message's full length and clears it.
size_t torch_ext_last_error(char* buffer, size_t size) {
  size_t length = last_error.size();
  if (size > 0) {
    size_t n = length < size - 1 ? length : size - 1;
    std::memcpy(buffer, last_error.data(), n);
    buffer[n] = '\0';
  }
  last_error.clear();
  return length;
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

}  // extern "C"
