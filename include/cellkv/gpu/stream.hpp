// cellkv/gpu/stream.hpp - move-only owners of a CUDA stream and a CUDA event.
//
// Launchers take the stream as a non-owning cuda::stream_ref (libcu++), always the last parameter.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/handle.hpp"

namespace cellkv::gpu {

// A non-blocking stream (does not synchronise with the legacy default stream).
class Stream {
 public:
  Stream() {
    cudaStream_t s = nullptr;
    CELLKV_CUDA_THROW(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = Handle(s);
  }

  [[nodiscard]] cudaStream_t get() const noexcept { return stream_.get(); }
  [[nodiscard]] ::cuda::stream_ref ref() const noexcept { return ::cuda::stream_ref(get()); }
  operator ::cuda::stream_ref() const noexcept { return ref(); }  // NOLINT: implicit by design
  // Blocks the host until the stream's work is done (tests and setup only).
  void synchronize() const { CELLKV_CUDA_THROW(cudaStreamSynchronize(get())); }

 private:
  using Handle = detail::UniqueHandle<cudaStream_t, &cudaStreamDestroy>;
  Handle stream_;
};

// An event without timing (cheap to record); `timing = true` for benchmarks.
class Event {
 public:
  explicit Event(bool timing = false) {
    cudaEvent_t e = nullptr;
    CELLKV_CUDA_THROW(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    event_ = Handle(e);
  }

  [[nodiscard]] cudaEvent_t get() const noexcept { return event_.get(); }
  [[nodiscard]] Status record(::cuda::stream_ref stream) const {
    CELLKV_CUDA_STATUS(cudaEventRecord(get(), stream.get()));
    return {};
  }
  // Makes `stream` wait for the work recorded before this event (no host block).
  [[nodiscard]] Status wait_on(::cuda::stream_ref stream) const {
    CELLKV_CUDA_STATUS(cudaStreamWaitEvent(stream.get(), get(), 0));
    return {};
  }
  // Blocks the host until the recorded work is done. Never touches the stream it was recorded on.
  [[nodiscard]] Status synchronize() const {
    CELLKV_CUDA_STATUS(cudaEventSynchronize(get()));
    return {};
  }

 private:
  using Handle = detail::UniqueHandle<cudaEvent_t, &cudaEventDestroy>;
  Handle event_;
};

}  // namespace cellkv::gpu
