// cellkv/gpu/memory.hpp - move-only owners of device memory and pinned host memory, and the
// check that a device has the memory a cache is about to allocate.
//
// Allocated once (construction may throw cellkv::gpu::Error); freed in the destructor without
// touching any stream. Hand out raw pointers and spans; never reallocate.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <span>
#include <utility>

#include "cellkv/gpu/error.hpp"

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
struct MappedAlloc {  // pinned, mapped into every device's address space
  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    CELLKV_CUDA_THROW(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
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

// Page-locked host memory mapped into the device address space: device code writes it through
// device_data(), the host reads it through data() without a copy. Zero-initialised.
template <class T>
class MappedBuffer {
 public:
  explicit MappedBuffer(std::size_t count) : host_(count) {
    if (count == 0) return;
    std::memset(static_cast<void*>(host_.data()), 0, host_.bytes());
    void* device = nullptr;
    CELLKV_CUDA_THROW(cudaHostGetDevicePointer(&device, host_.data(), 0));
    device_ = static_cast<T*>(device);
  }
  MappedBuffer(MappedBuffer&& other) noexcept
      : host_(std::move(other.host_)), device_(std::exchange(other.device_, nullptr)) {}
  MappedBuffer& operator=(MappedBuffer&& other) noexcept {
    host_ = std::move(other.host_);
    device_ = std::exchange(other.device_, nullptr);
    return *this;
  }

  [[nodiscard]] T* data() const noexcept { return host_.data(); }
  [[nodiscard]] T* device_data() const noexcept { return device_; }
  [[nodiscard]] std::size_t size() const noexcept { return host_.size(); }

 private:
  detail::Buffer<T, detail::MappedAlloc> host_;
  T* device_ = nullptr;
};

// Throws OutOfDeviceMemory, naming `who`, when the current device has fewer than `bytes` bytes
// free (cudaMemGetInfo); cellkv::gpu::Error when the query fails. Allocates nothing.
inline void require_free_memory(std::size_t bytes, const char* who) {
  std::size_t free = 0, total = 0;
  CELLKV_CUDA_THROW(cudaMemGetInfo(&free, &total));
  if (bytes > free) {
    int device = 0;
    CELLKV_CUDA_THROW(cudaGetDevice(&device));
    throw OutOfDeviceMemory(who, device, bytes, free);
  }
}

}  // namespace cellkv::gpu
