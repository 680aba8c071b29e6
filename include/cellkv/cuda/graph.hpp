// cellkv/cuda/graph.hpp - capture a stream's work once into a CUDA graph, replay it many times.
//
//   cellkv::gpu::GraphExec graph = cellkv::gpu::capture(stream, [&] { forward(stream); });
//   graph.replay(stream);   // same kernels, same fixed-address buffers, new contents
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <utility>

#include "cellkv/cuda/error.hpp"

namespace cellkv::gpu {

// An instantiated, replayable graph; move-only.
class GraphExec {
 public:
  GraphExec() = default;
  explicit GraphExec(cudaGraph_t graph) {
    CELLKV_CUDA_THROW(cudaGraphInstantiate(&exec_, graph, 0));
  }
  GraphExec(GraphExec&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}
  GraphExec& operator=(GraphExec&& other) noexcept {
    if (this != &other) {
      reset();
      exec_ = std::exchange(other.exec_, nullptr);
    }
    return *this;
  }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() { reset(); }

  [[nodiscard]] bool empty() const noexcept { return exec_ == nullptr; }
  [[nodiscard]] Status replay(::cuda::stream_ref stream) const {
    if (exec_ == nullptr) return Errc::bad_argument;
    CELLKV_CUDA_STATUS(cudaGraphLaunch(exec_, stream.get()));
    return {};
  }

 private:
  void reset() noexcept {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
  }
  cudaGraphExec_t exec_ = nullptr;
};

// Captures what `record()` enqueues on `stream` (which must not be the legacy default stream) and
// instantiates it. Throws cellkv::gpu::Error when capture fails.
template <class Record>
GraphExec capture(::cuda::stream_ref stream, Record&& record) {
  CELLKV_CUDA_THROW(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  record();
  cudaGraph_t graph = nullptr;
  CELLKV_CUDA_THROW(cudaStreamEndCapture(stream.get(), &graph));
  struct Destroy {
    cudaGraph_t g;
    ~Destroy() { (void)cudaGraphDestroy(g); }
  } destroy{graph};
  return GraphExec(graph);
}

}  // namespace cellkv::gpu
