// cellkv/gpu/graph.hpp - capture a stream's work once into a CUDA graph, replay it many times.
//
//   cellkv::gpu::GraphExec graph = cellkv::gpu::capture(stream, [&] { forward(stream); });
//   graph.replay(stream);   // same kernels, same fixed-address buffers, new contents
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/handle.hpp"

namespace cellkv::gpu {

// An instantiated, replayable graph; move-only.
class GraphExec {
 public:
  GraphExec() = default;
  explicit GraphExec(cudaGraph_t graph) {
    cudaGraphExec_t exec = nullptr;
    CELLKV_CUDA_THROW(cudaGraphInstantiate(&exec, graph, 0));
    exec_ = Handle(exec);
  }

  [[nodiscard]] bool empty() const noexcept { return exec_.get() == nullptr; }
  [[nodiscard]] Status replay(::cuda::stream_ref stream) const {
    if (empty()) return Errc::bad_argument;
    CELLKV_CUDA_STATUS(cudaGraphLaunch(exec_.get(), stream.get()));
    return {};
  }

 private:
  using Handle = detail::UniqueHandle<cudaGraphExec_t, &cudaGraphExecDestroy>;
  Handle exec_;
};

// Captures what `record()` enqueues on `stream` (which must not be the legacy default stream) and
// instantiates it. Throws cellkv::gpu::Error when capture fails.
template <class Record>
GraphExec capture(::cuda::stream_ref stream, Record&& record) {
  CELLKV_CUDA_THROW(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    record();
  } catch (...) {  // leave the stream out of capture mode
    if (cudaStreamEndCapture(stream.get(), &graph) == cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
    throw;
  }
  CELLKV_CUDA_THROW(cudaStreamEndCapture(stream.get(), &graph));
  struct Destroy {
    cudaGraph_t g;
    ~Destroy() { (void)cudaGraphDestroy(g); }
  } destroy{graph};
  return GraphExec(graph);
}

}  // namespace cellkv::gpu
