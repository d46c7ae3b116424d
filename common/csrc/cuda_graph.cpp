// CUDA graphs for `--cuda-graph` (what torch.cuda.CUDAGraph and torch.compile's
// "reduce-overhead" mode use): a whole training step recorded once and replayed per batch, one
// launch instead of hundreds. Built as a shared library of its own (common/build.rs, only where
// LibTorch has its CUDA headers and the CUDA runtime's headers are found) and loaded at run time
// when a run asks for CUDA graphs, so that the binaries still work with a CPU-only LibTorch.
//
// Errors as csrc/errors.h says: a function that fails returns -1 (or null) and leaves the
// exception's message for cuda_graph_last_error() on this thread.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

#include "errors.h"

namespace {

using shim::protect_status;

// A graph and the side stream it is captured on (capture needs a stream other than the
// default one); while capturing, the side stream is the current stream of the device.
struct Captured {
  at::cuda::CUDAGraph graph;
  c10::DeviceIndex device;
  c10::cuda::CUDAStream stream;
  std::optional<c10::cuda::CUDAStreamGuard> guard;

  explicit Captured(c10::DeviceIndex d) : device(d), stream(c10::cuda::getStreamFromPool(false, d)) {}
};

}  // namespace

extern "C" {

// The message of the last failure on this thread, copied into `buffer` (NUL-terminated);
// returns its full length and clears it.
size_t cuda_graph_last_error(char* buffer, size_t size) {
  return shim::take_last_error(buffer, size);
}

// A new, empty graph for CUDA device `device`.
void* cuda_graph_new(int device) {
  Captured* captured = nullptr;
  int status = protect_status([&] { captured = new Captured(static_cast<c10::DeviceIndex>(device)); });
  return status == 0 ? captured : nullptr;
}

void cuda_graph_free(void* graph) {
  delete static_cast<Captured*>(graph);
}

// Starts recording: the side stream waits for the work queued so far, becomes the current stream,
// and everything launched on it until cuda_graph_end is recorded instead of run. The default CUDA
// generator is registered with the graph (dropout stays random from replay to replay).
int cuda_graph_begin(void* graph) {
  return protect_status([&] {
    auto* captured = static_cast<Captured*>(graph);
    c10::cuda::CUDAGuard device_guard(captured->device);
    c10::cuda::getCurrentCUDAStream(captured->device).synchronize();
    captured->guard.emplace(captured->stream);
    captured->graph.capture_begin();
  });
}

// Ends recording (also after a failure inside it, so that the device's current stream is the
// default one again) and makes the graph ready to replay.
int cuda_graph_end(void* graph) {
  auto* captured = static_cast<Captured*>(graph);
  int status = protect_status([&] { captured->graph.capture_end(); });
  captured->guard.reset();
  int synced = protect_status([&] { captured->stream.synchronize(); });
  return status != 0 ? status : synced;
}

// Launches the recorded work once, on the current stream's device.
int cuda_graph_replay(void* graph) {
  return protect_status([&] {
    auto* captured = static_cast<Captured*>(graph);
    c10::cuda::CUDAGuard device_guard(captured->device);
    captured->graph.replay();
  });
}

}  // extern "C"
