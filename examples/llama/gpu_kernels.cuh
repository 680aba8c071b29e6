// llama/gpu_kernels.cuh - the example decoder's small kernels: embedding, RMSNorm, RoPE, SwiGLU and
// the sum that stands in for an all-reduce when every shard sits on one GPU.
#pragma once

#include <cellkv/cuda/numeric.cuh>

#include <cstdint>

namespace llama {

namespace kernels {
template <class T>
__global__ void embed(const std::int32_t* tokens, const T* table, T* x, std::int32_t dim) {
  const T* row = table + static_cast<std::int64_t>(tokens[blockIdx.x]) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) x[static_cast<std::int64_t>(blockIdx.x) * dim + i] = row[i];
}

// y[row] = x[row] / rms(x[row]) * gain; one block of 256 threads per row.
template <class T>
__global__ void rmsnorm(const T* x, const T* gain, T* y, std::int32_t dim, float eps) {
  __shared__ float partial[256];
  const T* xr = x + static_cast<std::int64_t>(blockIdx.x) * dim;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += cellkv::gpu::to_float(xr[i]) * cellkv::gpu::to_float(xr[i]);
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float inv = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x)
    y[static_cast<std::int64_t>(blockIdx.x) * dim + i] =
        cellkv::gpu::from_float<T>(cellkv::gpu::to_float(xr[i]) * inv * cellkv::gpu::to_float(gain[i]));
}

// Rotates pairs (2i, 2i + 1) of every head of row blockIdx.x by position * theta^(-2i / D).
template <class T>
__global__ void rope(T* x, const std::int32_t* positions, std::int32_t heads, std::int32_t head_dim, float theta) {
  const float pos = static_cast<float>(positions[blockIdx.x]);
  for (int j = threadIdx.x; j < heads * head_dim / 2; j += blockDim.x) {
    const int h = j / (head_dim / 2), i = j % (head_dim / 2);
    T* p = x + (static_cast<std::int64_t>(blockIdx.x) * heads + h) * head_dim + 2 * i;
    const float a = pos * powf(theta, -2.f * static_cast<float>(i) / static_cast<float>(head_dim));
    float sn = 0.f, cs = 0.f;
    sincosf(a, &sn, &cs);
    const float x0 = cellkv::gpu::to_float(p[0]), x1 = cellkv::gpu::to_float(p[1]);
    p[0] = cellkv::gpu::from_float<T>(x0 * cs - x1 * sn);
    p[1] = cellkv::gpu::from_float<T>(x0 * sn + x1 * cs);
  }
}

// a = silu(a) * b, elementwise over n.
template <class T>
__global__ void swiglu(T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = cellkv::gpu::to_float(a[i]);
    a[i] = cellkv::gpu::from_float<T>(v / (1.f + __expf(-v)) * cellkv::gpu::to_float(b[i]));
  }
}
// parts[0..n_parts)[i] = sum over p of parts[p][i], for i < n: the in-place all-reduce of buffers
// that share one device. Sums in rank order, accumulating in float.
template <class T, int MaxParts>
struct Parts {
  T* p[MaxParts];
};
template <class T, int MaxParts>
__global__ void sum_parts(Parts<T, MaxParts> parts, std::int32_t n_parts, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (std::int32_t r = 0; r < n_parts; ++r) s += cellkv::gpu::to_float(parts.p[r][i]);
    for (std::int32_t r = 0; r < n_parts; ++r) parts.p[r][i] = cellkv::gpu::from_float<T>(s);
  }
}
}  // namespace kernels

}  // namespace llama
