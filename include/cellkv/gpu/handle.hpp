// cellkv/gpu/handle.hpp - a move-only owner of one CUDA runtime handle (stream, event, graph
// executable), released with its destroy function and never copied.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

namespace cellkv::gpu::detail {

// Owns `H` (a CUDA handle type; nullptr: none) and calls Destroy(handle) when it lets go.
template <class H, cudaError_t (*Destroy)(H)>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  explicit UniqueHandle(H handle) noexcept : handle_(handle) {}
  UniqueHandle(UniqueHandle&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  ~UniqueHandle() { reset(); }

  [[nodiscard]] H get() const noexcept { return handle_; }
  void reset() noexcept {
    if (handle_ != nullptr) (void)Destroy(handle_);
    handle_ = nullptr;
  }

 private:
  H handle_ = nullptr;
};

}  // namespace cellkv::gpu::detail
