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
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

// A collective the Rust side runs on `input` into a new tensor of another shape (an all-gather
// or a reduce-scatter along the sequence, over the tensor-parallel group that `context` names):
// 0 with `*output` set (a tensor the caller takes and frees), or non-zero with a message.
typedef int (*torch_ext_transform)(void* context, const at::Tensor* input, at::Tensor** output, char* message, size_t size);

at::Tensor run_transform(int64_t transform, int64_t context, const at::Tensor& input) {
  char message[2048] = {0};
  at::Tensor* output = nullptr;
  auto run = reinterpret_cast<torch_ext_transform>(transform);
  int failed = run(reinterpret_cast<void*>(context), &input, &output, message, sizeof message);
  if (failed != 0 || output == nullptr) {
    delete output;
    throw std::runtime_error(message[0] ? message : "sequence-parallel collective failed");
  }
  at::Tensor result = std::move(*output);
  delete output;
  return result;
}

// Megatron-LM's sequence-parallel regions: `forward` on the input (the reduce-scatter that ends a
// row-parallel layer, the all-gather before the output layer), `backward` on the gradient (the
// other one of the two).
struct TransformPair : public torch::autograd::Function<TransformPair> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, int64_t forward_transform,
                            int64_t backward_transform, int64_t context) {
    ctx->saved_data["backward"] = backward_transform;
    ctx->saved_data["context"] = context;
    return run_transform(forward_transform, context, input.contiguous());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor grad = run_transform(ctx->saved_data["backward"].toInt(), ctx->saved_data["context"].toInt(), grads[0].contiguous());
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A column-parallel linear layer whose input is cut along the sequence (Megatron-LM's
// `LinearWithGradAccumulationAndAsyncCommunication` with sequence parallelism): the input
// all-gathered (`gather`) and multiplied; only this rank's rows are kept for the backward pass,
// which gathers them again for the weight's gradient and reduce-scatters (`scatter`) the input's.
struct GatheredLinear : public torch::autograd::Function<GatheredLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t gather, int64_t scatter, int64_t context) {
    at::Tensor local = input.contiguous();
    ctx->save_for_backward({local, weight});
    ctx->saved_data["gather"] = gather;
    ctx->saved_data["scatter"] = scatter;
    ctx->saved_data["context"] = context;
    ctx->saved_data["bias"] = bias.defined();
    return at::linear(run_transform(gather, context, local), weight, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& local = saved[0];
    const at::Tensor& weight = saved[1];
    int64_t context = ctx->saved_data["context"].toInt();
    at::Tensor grad = grads[0].contiguous();
    at::Tensor whole = run_transform(ctx->saved_data["gather"].toInt(), context, local);
    at::Tensor grad_input = run_transform(ctx->saved_data["scatter"].toInt(), context, grad.matmul(weight).contiguous());
    at::Tensor grad_2d = grad.reshape({-1, grad.size(-1)});
    at::Tensor grad_weight = grad_2d.t().mm(whole.reshape({-1, whole.size(-1)}));
    at::Tensor grad_bias = ctx->saved_data["bias"].toBool() ? grad_2d.sum(0) : at::Tensor();
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The output layer `hidden · weightᵀ + bias` and the mean cross-entropy of its logits against
// `targets`, `chunk_rows` rows (tokens) at a time, so that only one chunk's logits exist at once
// (a fused linear + cross-entropy, as Apple's Cut Cross-Entropy and Liger's recompute them).
// The matrix products run in `compute` (the kind autocast or the weights give the output
// layer), the log-softmax and the loss in float32. Saved for the backward pass: the inputs in
// `compute` (what `linear` saves under autocast), the targets and each row's log-sum-exp; the
// backward pass makes each chunk's logits again and from them the chunk's gradients of the
// hidden states, the weight and the bias (the weight's and bias's summed in float32).
// A second output counts the rows whose arg-max is their target (not differentiable).
struct ChunkedLinearCrossEntropy : public torch::autograd::Function<ChunkedLinearCrossEntropy> {
  // Blocks of the vocabulary the weight's gradient is summed in when the products are not
  // float32 (the memory estimate counts a block: memory/estimate.rs).
  static constexpr int64_t kWeightBlocks = 8;

  static at::Tensor chunk_logits(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& bias) {
    return bias.defined() ? at::addmm(bias, rows, weight.t()) : rows.mm(weight.t());
  }

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                                                const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                                                int64_t chunk_rows, int64_t compute, bool count_hits) {
    auto kind = static_cast<at::ScalarType>(compute);
    at::Tensor h = hidden.to(kind);
    at::Tensor w = weight.to(kind);
    at::Tensor b = bias.defined() ? bias.to(kind) : at::Tensor();
    int64_t n = h.size(0);
    auto float_options = hidden.options().dtype(at::kFloat);
    at::Tensor lse = at::empty({n}, float_options);
    at::Tensor total = at::zeros({}, float_options);
    at::Tensor hits = at::zeros({}, targets.options().dtype(at::kLong));
    for (int64_t start = 0; start < n; start += chunk_rows) {
      int64_t rows = std::min(chunk_rows, n - start);
      at::Tensor logits = chunk_logits(h.narrow(0, start, rows), w, b).to(at::kFloat);
      at::Tensor t = targets.narrow(0, start, rows).unsqueeze(1);
      at::Tensor chunk_lse = at::logsumexp(logits, {1});
      total.add_((chunk_lse - logits.gather(1, t).squeeze(1)).sum());
      lse.narrow(0, start, rows).copy_(chunk_lse);
      if (count_hits) {
        hits.add_(logits.argmax(1).eq(t.squeeze(1)).sum());
      }
    }
    ctx->save_for_backward({h, w, b, targets, lse});
    ctx->saved_data["chunk_rows"] = chunk_rows;
    ctx->saved_data["hidden_kind"] = static_cast<int64_t>(hidden.scalar_type());
    ctx->saved_data["weight_kind"] = static_cast<int64_t>(weight.scalar_type());
    ctx->mark_non_differentiable({hits});
    return {total.div_(static_cast<double>(n)), hits};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& h = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& b = saved[2];
    const at::Tensor& targets = saved[3];
    const at::Tensor& lse = saved[4];
    int64_t chunk_rows = ctx->saved_data["chunk_rows"].toInt();
    auto hidden_kind = static_cast<at::ScalarType>(ctx->saved_data["hidden_kind"].toInt());
    auto weight_kind = static_cast<at::ScalarType>(ctx->saved_data["weight_kind"].toInt());
    int64_t n = h.size(0);
    // d(mean)/d(logit) = (softmax − one-hot) / n, times the incoming gradient (a 0-dim tensor:
    // an accumulated batch's weight, a gradient scaler's scale).
    at::Tensor scale = grads[0].to(at::kFloat) / static_cast<double>(n);
    auto float_options = h.options().dtype(at::kFloat);
    at::Tensor grad_h = at::empty(h.sizes(), h.options().dtype(hidden_kind));
    at::Tensor grad_w = at::zeros(w.sizes(), float_options);
    at::Tensor grad_b = b.defined() ? at::zeros(b.sizes(), float_options) : at::Tensor();
    bool same_kind = w.scalar_type() == at::kFloat;
    for (int64_t start = 0; start < n; start += chunk_rows) {
      int64_t rows = std::min(chunk_rows, n - start);
      at::Tensor h_rows = h.narrow(0, start, rows);
      at::Tensor g = chunk_logits(h_rows, w, b).to(at::kFloat);
      if (!g.is_contiguous()) {
        g = g.contiguous();
      }
      g.sub_(lse.narrow(0, start, rows).unsqueeze(1)).exp_();
      at::Tensor t = targets.narrow(0, start, rows).unsqueeze(1);
      g.scatter_add_(1, t, at::full({rows, 1}, -1.0, float_options));
      g.mul_(scale);
      if (b.defined()) {
        grad_b.add_(g.sum(0));
      }
      at::Tensor gk = g.to(w.scalar_type());
      g = at::Tensor();
      grad_h.narrow(0, start, rows).copy_(gk.mm(w));
      if (same_kind) {
        grad_w.addmm_(gk.t(), h_rows);
      } else {
        // Summed into float32 a block of the vocabulary at a time: the product in `compute` and
        // the float32 copy the CPU's add of mixed kinds makes of it are a block's size, not the
        // weight's.
        int64_t v = w.size(0);
        int64_t block = (v + kWeightBlocks - 1) / kWeightBlocks;
        for (int64_t first = 0; first < v; first += block) {
          int64_t words = std::min(block, v - first);
          grad_w.narrow(0, first, words).add_(gk.narrow(1, first, words).t().mm(h_rows));
        }
      }
    }
    return {grad_h,
            grad_w.to(weight_kind),
            b.defined() ? grad_b.to(weight_kind) : at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
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

// The CPU allocator every CPU tensor comes from, wrapped to count the bytes it hands out (the
// CPU's counterpart of the CUDA caching allocator's "allocated" statistics; LibTorch keeps
// none for the CPU). Each block carries a 64-byte header (the default alignment, so the data
// stay aligned) with its size and the inner allocator's deleter: the data pointer is its own
// context, as raw_allocate requires.
// Whether torch_ext_profiler_start started the profiler (one at a time per process).
std::atomic<bool> profiler_running{false};

// What makes a thread record into the profiler: the profiler's state (thread-local debug info)
// and its RecordFunction callbacks, as at::ThreadLocalStateGuard carries them to autograd's
// threads.
struct ProfilerThreadState {
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
  at::RecordFunctionTLS record_functions;

  static ProfilerThreadState current() {
    return {c10::ThreadLocalDebugInfo::current(), at::get_record_function_tls_()};
  }

  void apply() const {
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(debug_info);
    at::set_record_function_tls_(record_functions);
  }
};

class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr block = inner_->allocate(n + kHeader);
    auto* base = static_cast<char*>(block.get());
    auto* header = reinterpret_cast<Header*>(base);
    header->bytes = n;
    header->deleter = block.get_deleter();
    header->context = block.release_context();
    void* data = base + kHeader;
    add(static_cast<int64_t>(n), data);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  static void release(void* data) {
    if (data == nullptr) {
      return;
    }
    auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
    auto* self = instance();
    if (self->trace_) {
      std::lock_guard<std::mutex> lock(self->trace_mutex_);
      self->live_.erase(data);
      self->current_.fetch_sub(static_cast<int64_t>(header->bytes), std::memory_order_relaxed);
    } else {
      self->current_.fetch_sub(static_cast<int64_t>(header->bytes), std::memory_order_relaxed);
    }
    c10::DeleterFnPtr deleter = header->deleter;
    void* context = header->context;
    if (deleter != nullptr) {
      deleter(context);
    }
  }

  int64_t current() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() {
    if (trace_) {
      std::lock_guard<std::mutex> lock(trace_mutex_);
      peak_.store(current(), std::memory_order_relaxed);
      snapshot_.assign(live_.begin(), live_.end());
      snapshot_phase_ = phase_.load();
      dumped_peak_ = 0;
      return;
    }
    peak_.store(current(), std::memory_order_relaxed);
  }

  // Debugging (TORCH_EXT_PEAK_TRACE set): the phase later allocations are tagged with.
  void set_phase(int phase) { phase_.store(phase); }

  // Writes the tensors held at the peak (since the last reset) to `path`, one per line:
  // `sequence bytes phase`, unless that peak was written already. 1 written, 0 not.
  int dump(const char* path) {
    if (!trace_) {
      return 0;
    }
    std::vector<std::pair<void*, Live>> snapshot;
    int64_t peak;
    int phase;
    {
      std::lock_guard<std::mutex> lock(trace_mutex_);
      peak = peak_.load();
      if (peak <= dumped_peak_) {
        return 0;
      }
      dumped_peak_ = peak;
      snapshot = snapshot_;
      phase = snapshot_phase_;
    }
    std::sort(snapshot.begin(), snapshot.end(), [](const auto& a, const auto& b) { return a.second.seq < b.second.seq; });
    FILE* f = std::fopen(path, "w");
    if (f == nullptr) {
      return 0;
    }
    std::fprintf(f, "# peak %lld at phase %d, %zu tensors\n", static_cast<long long>(peak), phase, snapshot.size());
    for (const auto& [ptr, live] : snapshot) {
      std::fprintf(f, "%lld %lld %d\n", static_cast<long long>(live.seq), static_cast<long long>(live.bytes), live.phase);
    }
    std::fclose(f);
    return 1;
  }

  int64_t sequence() const { return seq_.load(); }

  // The one instance, installed as LibTorch's CPU allocator on first use.
  static CountingCpuAllocator* instance() {
    static CountingCpuAllocator* counting = [] {
      auto* allocator = new CountingCpuAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(allocator, /*priority=*/1);
      return allocator;
    }();
    return counting;
  }

 private:
  struct Header {
    size_t bytes;
    c10::DeleterFnPtr deleter;
    void* context;
  };
  static constexpr size_t kHeader = 64;
  static_assert(sizeof(Header) <= kHeader, "the header fits in front of the data");

  struct Live {
    int64_t seq;
    int64_t bytes;
    int phase;
  };

  void add(int64_t n, void* data) {
    if (trace_) {
      std::lock_guard<std::mutex> lock(trace_mutex_);
      live_[data] = Live{seq_.fetch_add(1), n, phase_.load()};
      int64_t now = current_.fetch_add(n, std::memory_order_relaxed) + n;
      if (now > peak_.load(std::memory_order_relaxed)) {
        peak_.store(now, std::memory_order_relaxed);
        snapshot_.assign(live_.begin(), live_.end());
        snapshot_phase_ = phase_.load();
      }
      return;
    }
    int64_t now = current_.fetch_add(n, std::memory_order_relaxed) + n;
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }

  c10::Allocator* inner_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  // Debugging only (TORCH_EXT_PEAK_TRACE): every live allocation, and those live at the peak.
  bool trace_ = std::getenv("TORCH_EXT_PEAK_TRACE") != nullptr;
  std::mutex trace_mutex_;
  std::unordered_map<void*, Live> live_;
  std::vector<std::pair<void*, Live>> snapshot_;
  int snapshot_phase_ = 0;
  int64_t dumped_peak_ = 0;
  std::atomic<int64_t> seq_{0};
  std::atomic<int> phase_{0};
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

// An identity of the tensor's storage (0 if it has none): views of one storage share it.
int64_t torch_ext_storage_id(const at::Tensor* tensor) {
  return tensor->has_storage() ? reinterpret_cast<int64_t>(tensor->storage().unsafeGetStorageImpl()) : 0;
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

// `input` through a sequence-parallel region: `forward` on it now, `backward` on its gradient.
// `context` must stay valid until that backward pass ran.
at::Tensor* torch_ext_transform_pair(const at::Tensor* input, torch_ext_transform forward, torch_ext_transform backward,
                                     void* context) {
  return protect([&] {
    return TransformPair::apply(*input, reinterpret_cast<int64_t>(forward), reinterpret_cast<int64_t>(backward),
                                reinterpret_cast<int64_t>(context));
  });
}

// The mean cross-entropy of `hidden · weightᵀ + bias` (`hidden` [n, d], `weight` [V, d], `bias`
// [V] or null) against `targets` [n], `chunk_rows` rows at a time (see
// ChunkedLinearCrossEntropy), the products in `compute` (a c10::ScalarType): 0 with `*loss`
// and `*hits` set (tensors the caller takes and frees), or -1 with the message kept.
int torch_ext_chunked_linear_cross_entropy(const at::Tensor* hidden, const at::Tensor* weight, const at::Tensor* bias,
                                           const at::Tensor* targets, int64_t chunk_rows, int compute, int count_hits,
                                           at::Tensor** loss, at::Tensor** hits) {
  return protect_status([&] {
    auto outputs = ChunkedLinearCrossEntropy::apply(*hidden, *weight, bias ? *bias : at::Tensor(), *targets, chunk_rows,
                                                    static_cast<int64_t>(compute), count_hits != 0);
    *loss = new at::Tensor(outputs[0]);
    *hits = new at::Tensor(outputs[1]);
  });
}

// `input · weightᵀ + bias` with `input` gathered along the sequence (`gather`), keeping only this
// rank's rows for the backward pass (see GatheredLinear). `bias` may be null.
at::Tensor* torch_ext_gathered_linear(const at::Tensor* input, const at::Tensor* weight, const at::Tensor* bias,
                                      torch_ext_transform gather, torch_ext_transform scatter, void* context) {
  return protect([&] {
    return GatheredLinear::apply(*input, *weight, bias ? *bias : at::Tensor(), reinterpret_cast<int64_t>(gather),
                                 reinterpret_cast<int64_t>(scatter), reinterpret_cast<int64_t>(context));
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

// torch.use_deterministic_algorithms(True) with torch.backends.cudnn.deterministic = True and
// torch.backends.cudnn.benchmark = False: the same kernels, in the same order, on every run. An
// operation without a deterministic implementation then raises. 0, or -1 on error.
int torch_ext_use_deterministic_algorithms(bool on) {
  return protect_status([&] {
    at::globalContext().setDeterministicAlgorithms(on, /*warn_only=*/false);
    at::globalContext().setDeterministicCuDNN(on);
    at::globalContext().setBenchmarkCuDNN(!on);
  });
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

// LibTorch's profiler (Kineto, as torch.profiler.profile), on this thread and the autograd
// threads its work starts: CPU operators, and with `cuda` the CUDA kernels, copies and runtime
// calls they launch; `record_shapes`: each operator's input shapes. 0, or -1 on error (one
// already running, say).
int torch_ext_profiler_start(int cuda, int record_shapes) {
  return protect_status([&] {
    // LibTorch does not refuse a second thread-local profiler; replacing the first one's
    // callbacks corrupts both.
    TORCH_CHECK(!profiler_running.load(), "LibTorch's profiler is already running in this process");
    using torch::profiler::impl::ActivityType;
    using torch::profiler::impl::ProfilerConfig;
    using torch::profiler::impl::ProfilerState;
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda != 0) {
      activities.insert(ActivityType::CUDA);
    } else {
      // Kineto asks a CUDA build's driver for GPUs even when only CPU operators are recorded,
      // and logs an ERROR line on a machine without one (as torch.profiler does there). Its
      // own errors are read back from the trace instead (torch_ext_profiler_stop). The
      // user's setting wins.
      setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
    }
    ProfilerConfig config(ProfilerState::KINETO, record_shapes != 0);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    profiler_running.store(true);
  });
}

// Stops the profiler and writes its Chrome trace (Kineto's JSON, as torch.profiler's
// export_chrome_trace) to `path`. 0, or -1 on error.
int torch_ext_profiler_stop(const char* path) {
  return protect_status([&] {
    TORCH_CHECK(profiler_running.load(), "LibTorch's profiler is not running");
    auto result = torch::autograd::profiler::disableProfiler();
    profiler_running.store(false);
    TORCH_CHECK(result != nullptr, "LibTorch's profiler returned no result");
    // Kineto reports a failed write in its log only: look for the file.
    std::remove(path);
    result->save(std::string(path));
    FILE* written = std::fopen(path, "r");
    TORCH_CHECK(written != nullptr, "the trace could not be written to ", path);
    std::fclose(written);
  });
}

// A named range in the profiler's trace (torch.profiler.record_function), from here until
// torch_ext_record_function_exit on the same thread. Null on error.
void* torch_ext_record_function_enter(const char* name) {
  at::RecordFunction* range = nullptr;
  protect_status([&] {
    auto record = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (record->isActive()) {
      record->before(std::string_view(name));
    }
    range = record.release();
  });
  return range;
}

void torch_ext_record_function_exit(void* range) {
  auto* record = static_cast<at::RecordFunction*>(range);
  if (record != nullptr) {
    record->end();
    delete record;
  }
}

// This thread's profiler state, for threads it starts (null when the profiler is not running).
void* torch_ext_profiler_thread_state() {
  ProfilerThreadState* state = nullptr;
  if (profiler_running.load()) {
    protect_status([&] { state = new ProfilerThreadState(ProfilerThreadState::current()); });
  }
  return state;
}

// Makes this thread record into the profiler whose `state` another thread took; returns this
// thread's own state, for torch_ext_profiler_thread_leave.
void* torch_ext_profiler_thread_join(const void* state) {
  ProfilerThreadState* own = nullptr;
  protect_status([&] {
    own = new ProfilerThreadState(ProfilerThreadState::current());
    static_cast<const ProfilerThreadState*>(state)->apply();
  });
  return own;
}

// Restores the state torch_ext_profiler_thread_join returned, and frees it.
void torch_ext_profiler_thread_leave(void* own) {
  auto* state = static_cast<ProfilerThreadState*>(own);
  if (state != nullptr) {
    protect_status([&] { state->apply(); });
    delete state;
  }
}

void torch_ext_profiler_thread_state_free(void* state) {
  delete static_cast<ProfilerThreadState*>(state);
}

// Counts the bytes of every CPU tensor allocated from now on (installs the counting allocator;
// idempotent). `out` gets {bytes held now, peak since the last reset}.
int torch_ext_cpu_memory_stats(int64_t* out) {
  return protect_status([&] {
    auto* counting = CountingCpuAllocator::instance();
    out[0] = counting->current();
    out[1] = counting->peak();
  });
}

// The peak becomes what is held now.
int torch_ext_cpu_memory_reset_peak() {
  return protect_status([&] { CountingCpuAllocator::instance()->reset_peak(); });
}

// Debugging (TORCH_EXT_PEAK_TRACE set): tags later CPU allocations with `phase`.
void torch_ext_cpu_memory_phase(int phase) { CountingCpuAllocator::instance()->set_phase(phase); }

// Debugging (TORCH_EXT_PEAK_TRACE set): writes the CPU tensors held at the peak to `path`.
int torch_ext_cpu_memory_dump(const char* path) { return CountingCpuAllocator::instance()->dump(path); }

// Debugging: the sequence number the next CPU allocation gets (TORCH_EXT_PEAK_TRACE set).
int64_t torch_ext_cpu_memory_sequence() { return CountingCpuAllocator::instance()->sequence(); }

// The CUDA caching allocator's statistics for `device` (torch.cuda.memory_stats): `out` gets
// {allocated now, allocated peak, reserved now, reserved peak} in bytes. 0, or -1 on error
// (no CUDA in this LibTorch, say).
int torch_ext_cuda_memory_stats(int device, int64_t* out) {
  return protect_status([&] {
    using c10::CachingAllocator::StatType;
    // The caching allocator exists once CUDA is initialised (LibTorch does it lazily, at the
    // first CUDA tensor): before that it knows no device.
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    auto stats = c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    auto aggregate = static_cast<size_t>(StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[aggregate].current;
    out[1] = stats.allocated_bytes[aggregate].peak;
    out[2] = stats.reserved_bytes[aggregate].current;
    out[3] = stats.reserved_bytes[aggregate].peak;
  });
}

// torch.cuda.reset_peak_memory_stats(device). 0, or -1 on error.
int torch_ext_cuda_memory_reset_peak(int device) {
  return protect_status([&] {
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(static_cast<c10::DeviceIndex>(device));
  });
}

}  // extern "C"
