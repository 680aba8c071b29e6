// cellkv/cuda/error.hpp - CUDA status checks: the library's two check macros.
//
//   CELLKV_CUDA_THROW(expr)   owners (constructors, explicit setup): throw cellkv::gpu::Error
//   CELLKV_CUDA_STATUS(expr)  the hot path: return Errc::device_error from a Status function,
//                             after printing the CUDA error name and the call site to stderr
#pragma once

#include <cuda_runtime_api.h>

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

namespace detail {
inline Status report(cudaError_t code, const char* expr, const char* file, int line) {
  std::fprintf(stderr, "cellkv: %s failed at %s:%d: %s (%s)\n", expr, file, line, cudaGetErrorName(code),
               cudaGetErrorString(code));
  return Errc::device_error;
}
}  // namespace detail

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
