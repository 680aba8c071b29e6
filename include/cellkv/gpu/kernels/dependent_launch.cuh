// cellkv/gpu/kernels/dependent_launch.cuh - programmatic dependent launch (sm_90 and later).
//
// A kernel launched with launch_dependent() may be scheduled while the kernel before it on the
// stream still runs, once every block of that kernel has called allow_dependent_grids() (or
// exited). Before it reads anything the earlier kernels write, or writes anything they read, it
// must call wait_for_prior_grids(), which returns once the kernel before it has completed and its
// memory is visible; every block must call it before it exits, so that the kernels after it can
// rely on the whole chain having completed. Before the wait it may only read memory that no kernel
// still running writes: what no earlier kernel of the stream changes (weights, for example), or
// what was written before the chain of dependent launches it belongs to began (the decode
// kernel's settled rows, docs/design.md section 6); and it writes nothing others read.
//
// cellkv's kernels of a layer (write_kv, and the table attention's shared-prefix, decode and
// prefill kernels) are dependent launches on sm_90 and later and follow these rules; they and the
// reference kernel call allow_dependent_grids() as they start, so a model kernel launched with
// launch_dependent() after them can be resident and fetch its weights while cellkv's attention
// runs. Both device calls are no-ops below sm_90 and for kernels launched the ordinary way. So
// cellkv's kernels must be compiled for compute_90 or later to run on an sm_90 device (the
// project's builds are: gpu_arch 90a gives sm_90a code): PTX of an older architecture JIT-compiled
// there would be launched as a dependent without its wait.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace cellkv::gpu {

namespace kernels {

// Lets the kernels launched after this one with launch_dependent() be scheduled.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Returns once the kernel before this one on the stream has completed and its writes are visible.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace kernels

// Whether the current device runs programmatic dependent launches (compute capability 9.0 or later).
inline bool dependent_launch_supported() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a dependent launch when `dependent`
// (the kernel must then call kernels::wait_for_prior_grids() as described above). Capturable: a
// captured dependent launch becomes a programmatic edge of the graph.
template <class... Params, class... Args>
cudaError_t launch_dependent(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) (void)cudaGetLastError();  // reported here, not again by a later launch's check
  return e;
}

}  // namespace cellkv::gpu
