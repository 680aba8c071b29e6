// cellkv/gpu/kernels/write_kv.cuh - the step's K and V rows into the pool, in one launch.
//
//   pool.k[cells[t]] = k[t], pool.v[cells[t]] = v[t] for t < tokens   (an index_copy of rows)
//
// k, v: [tokens, H_kv, D]. 16-byte vector copies, grid-stride over (K or V, token, vector).
// Preconditions (checked by the launcher): rows are a multiple of 16 bytes, pointers 16-byte
// aligned. cells[t] is device data and checked here: a row outside [0, pool.rows] (pool.rows is the
// scratch row) is written to the scratch row instead, and sets kFaultBadRow in *fault (when given).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/fp8.hpp"
#include "cellkv/fp8_pool_view.hpp"
#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/gpu/step_views.hpp"
#include "cellkv/pool_view.hpp"

namespace cellkv::gpu::kernels {

// The row token t writes: cells[t], or the scratch row (and a fault) when cells[t] is outside the
// pool. `report`: this thread reports the fault (one thread per token and tensor).
__device__ __forceinline__ std::int64_t checked_row(std::int64_t row, std::int64_t rows, std::uint32_t* fault,
                                                    bool report) {
  if (row >= 0 && row <= rows) return row;
  if (report && fault != nullptr) *reinterpret_cast<volatile std::uint32_t*>(fault) = kFaultBadRow;
  return rows;
}

template <class T>
__global__ void write_kv(PoolView<T> pool, const T* __restrict__ k, const T* __restrict__ v,
                         const std::int64_t* __restrict__ cells, std::int32_t tokens, std::uint32_t* fault) {
  allow_dependent_grids();
  wait_for_prior_grids();
  const std::int64_t row_vecs = pool.row_elems() * static_cast<std::int64_t>(sizeof(T)) / 16;
  const std::int64_t per_tensor = tokens * row_vecs;
  const std::int64_t total = 2 * per_tensor;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const bool is_v = i >= per_tensor;
    const std::int64_t j = is_v ? i - per_tensor : i;
    const std::int64_t t = j / row_vecs, vec = j % row_vecs;
    const std::int64_t row = checked_row(cells[t], pool.rows, fault, vec == 0);
    const uint4* src = reinterpret_cast<const uint4*>(is_v ? v : k) + j;
    uint4* dst = reinterpret_cast<uint4*>(is_v ? pool.v : pool.k) + row * row_vecs + vec;
    *dst = *src;
  }
}

// k, v: [tokens, H_kv, D] of T (bf16 / fp16). Block: any multiple of 32 threads; grid-stride over
// warps. D is 64, 128 or 256 (each lane quantizes D / 32 consecutive elements).
template <int D, class T>
__global__ void write_kv_fp8(Fp8PoolView<Fp8E4M3> pool, const T* __restrict__ k, const T* __restrict__ v,
                             const std::int64_t* __restrict__ cells, std::int32_t tokens, std::uint32_t* fault) {
  allow_dependent_grids();
  wait_for_prior_grids();
  constexpr int E = D / 32;
  const int lane = threadIdx.x % 32;
  const std::int64_t heads = static_cast<std::int64_t>(tokens) * pool.heads_kv;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t w = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32; w < 2 * heads; w += warps) {
    const bool is_v = w >= heads;
    const std::int64_t j = is_v ? w - heads : w;  // token * H_kv + head
    const std::int64_t t = j / pool.heads_kv;
    const auto h = static_cast<std::int32_t>(j % pool.heads_kv);
    const std::int64_t row = checked_row(cells[t], pool.rows, fault, lane == 0);
    const T* src = (is_v ? v : k) + j * D + lane * E;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = to_float(src[e]);
    float amax = row_head_amax(x, E);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float fixed = pool.write_scale(is_v);
    const float scale = fixed > 0.0f ? fixed : per_row_scale(amax);
    Fp8E4M3* dst = (is_v ? pool.v : pool.k) + pool.offset(row, h) + lane * E;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[e] = Fp8E4M3{quantize_e4m3(x[e], scale)};
    if (lane == 0) (is_v ? pool.v_scale : pool.k_scale)[pool.scale_offset(row, h)] = scale;
  }
}

}  // namespace cellkv::gpu::kernels
