// cellkv/cuda/memory.hpp - move-only owners of device memory and pinned host memory.
//
// Allocated once (construction may throw cellkv::gpu::Error); freed in the destructor without
// touching any stream. Hand out raw pointers and spans; never reallocate.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <utility>

#include "cellkv/cuda/error.hpp"

namespace cellkv::gpu {

namespace detail {
struct DeviceAlloc {
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    CELLKV_CUDA_THROW(cudaMalloc(&p, bytes));
    return p;
  }
  static void release(void* p) noexcept { (void)cudaFree(p); }
};
struct PinnedAlloc {
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    CELLKV_CUDA_THROW(cudaMallocHost(&p, bytes));
    return p;
  }
  static void release(void* p) noexcept { (void)cudaFreeHost(p); }
};

// `count` elements of T from Alloc; move-only.
template <class T, class Alloc>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t count)
      : data_(count == 0 ? nullptr : static_cast<T*>(Alloc::allocate(count * sizeof(T)))), size_(count) {}
  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] std::span<T> span() const noexcept { return {data_, size_}; }

 private:
  void reset() noexcept {
    if (data_ != nullptr) Alloc::release(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};
}  // namespace detail

// Device memory (cudaMalloc): `count` elements of T, uninitialised.
template <class T>
using DeviceBuffer = detail::Buffer<T, detail::DeviceAlloc>;

// Page-locked host memory (cudaMallocHost), the source of asynchronous uploads.
template <class T>
using PinnedBuffer = detail::Buffer<T, detail::PinnedAlloc>;

}  // namespace cellkv::gpu
