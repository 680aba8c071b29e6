// cellkv/gpu/device_guard.hpp - makes a device current for a scope and restores the previous one.
#pragma once

#include <cuda_runtime_api.h>

#include "cellkv/gpu/error.hpp"

namespace cellkv::gpu {

// Throws cellkv::gpu::Error when the device cannot be made current. Restores the caller's device
// on scope exit (errors there are ignored: a destructor cannot report them).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    CELLKV_CUDA_THROW(cudaGetDevice(&previous_));
    CELLKV_CUDA_THROW(cudaSetDevice(device));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() { (void)cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace cellkv::gpu
