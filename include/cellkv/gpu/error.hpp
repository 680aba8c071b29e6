// cellkv/gpu/error.hpp - CUDA status checks: the library's two check macros, and its exceptions.
//
//   CELLKV_CUDA_THROW(expr)   owners (constructors, explicit setup): throw cellkv::gpu::Error
//   CELLKV_CUDA_STATUS(expr)  the hot path: return Errc::device_error from a Status function and
//                             record the failure for last_cuda_failure() (this thread's last one)
//
// The library writes nothing to stderr unless built with CELLKV_DEBUG defined: then
// CELLKV_CUDA_STATUS also prints the CUDA error and the call site (docs/design.md section 6).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "cellkv/status.hpp"

namespace cellkv::gpu {

// A failed CUDA call, with the error, the expression and where it was made.
class Error : public std::runtime_error {
 public:
  Error(cudaError_t code, const char* expr, const char* file, int line)
      : std::runtime_error(std::string("cellkv: ") + expr + " failed at " + file + ":" + std::to_string(line) +
                           ": " + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")"),
        code_(code) {}
  [[nodiscard]] cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

// A device cache refused at construction, before allocating anything: its footprint
// (footprint.hpp) is more than the device's free memory. The message names both numbers.
class OutOfDeviceMemory : public std::runtime_error {
 public:
  OutOfDeviceMemory(const char* who, int device, std::size_t required, std::size_t available)
      : std::runtime_error(std::string(who) + ": needs " + std::to_string(required) + " bytes of device memory on device " +
                           std::to_string(device) + ", which has " + std::to_string(available) + " bytes free"),
        device_(device),
        required_(required),
        available_(available) {}
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] std::size_t required() const noexcept { return required_; }
  [[nodiscard]] std::size_t available() const noexcept { return available_; }

 private:
  int device_;
  std::size_t required_, available_;
};

// A CUDA call that CELLKV_CUDA_STATUS turned into Errc::device_error.
struct CudaFailure {
  cudaError_t code = cudaSuccess;
  const char* expr = "";  // the call, as written
  const char* file = "";
  int line = 0;
};

namespace detail {
inline thread_local CudaFailure last_failure{};

inline Status report(cudaError_t code, const char* expr, const char* file, int line) {
  last_failure = CudaFailure{code, expr, file, line};
#ifdef CELLKV_DEBUG
  std::fprintf(stderr, "cellkv: %s failed at %s:%d: %s (%s)\n", expr, file, line, cudaGetErrorName(code),
               cudaGetErrorString(code));
#endif
  return Errc::device_error;
}
}  // namespace detail

// The last CUDA failure this thread's Status-returning calls reported as Errc::device_error
// (code cudaSuccess when there was none).
[[nodiscard]] inline CudaFailure last_cuda_failure() noexcept { return detail::last_failure; }

}  // namespace cellkv::gpu

#define CELLKV_CUDA_THROW(expr)                                                              \
  do {                                                                                       \
    const cudaError_t cellkv_status_ = (expr);                                               \
    if (cellkv_status_ != cudaSuccess) throw ::cellkv::gpu::Error(cellkv_status_, #expr, __FILE__, __LINE__); \
  } while (0)

#define CELLKV_CUDA_STATUS(expr)                                                                     \
  do {                                                                                               \
    const cudaError_t cellkv_status_ = (expr);                                                       \
    if (cellkv_status_ != cudaSuccess) return ::cellkv::gpu::detail::report(cellkv_status_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace cellkv::gpu::detail {
// The status of the last kernel launch on this thread (launch configuration errors).
inline Status last_launch() {
  CELLKV_CUDA_STATUS(cudaGetLastError());
  return {};
}
}  // namespace cellkv::gpu::detail
