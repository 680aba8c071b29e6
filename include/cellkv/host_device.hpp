// cellkv/host_device.hpp - CELLKV_HOST_DEVICE marks the few tier-0 functions that kernels call too.
// Plain C++ compilers see nothing; nvcc sees __host__ __device__.
#pragma once

#if defined(__CUDACC__)
#define CELLKV_HOST_DEVICE __host__ __device__
#else
#define CELLKV_HOST_DEVICE
#endif
