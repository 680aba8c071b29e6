// cellkv/cuda/stream.hpp - move-only owners of a CUDA stream and a CUDA event.
//
// Launchers take the stream as a non-owning cuda::stream_ref (libcu++), always the last parameter.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <utility>

#include "cellkv/cuda/error.hpp"

namespace cellkv::gpu {

// A non-blocking stream (does not synchronise with the legacy default stream).
class Stream {
 public:
  Stream() { CELLKV_CUDA_THROW(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept {
    if (this != &other) {
      reset();
      stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { reset(); }

  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  [[nodiscard]] ::cuda::stream_ref ref() const noexcept { return ::cuda::stream_ref(stream_); }
  operator ::cuda::stream_ref() const noexcept { return ref(); }  // NOLINT: implicit by design
  // Blocks the host until the stream's work is done (tests and setup only).
  void synchronize() const { CELLKV_CUDA_THROW(cudaStreamSynchronize(stream_)); }

 private:
  void reset() noexcept {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

// An event without timing (cheap to record); `timing = true` for benchmarks.
class Event {
 public:
  explicit Event(bool timing = false) {
    CELLKV_CUDA_THROW(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { reset(); }

  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  [[nodiscard]] Status record(::cuda::stream_ref stream) const {
    CELLKV_CUDA_STATUS(cudaEventRecord(event_, stream.get()));
    return {};
  }
  // Makes `stream` wait for the work recorded before this event (no host block).
  [[nodiscard]] Status wait_on(::cuda::stream_ref stream) const {
    CELLKV_CUDA_STATUS(cudaStreamWaitEvent(stream.get(), event_, 0));
    return {};
  }
  // Blocks the host until the recorded work is done. Never touches the stream it was recorded on.
  [[nodiscard]] Status synchronize() const {
    CELLKV_CUDA_STATUS(cudaEventSynchronize(event_));
    return {};
  }

 private:
  void reset() noexcept {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
};

}  // namespace cellkv::gpu
