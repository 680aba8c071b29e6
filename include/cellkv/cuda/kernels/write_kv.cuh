// cellkv/cuda/kernels/write_kv.cuh - the step's K and V rows into the pool, in one launch.
//
//   pool.k[cells[t]] = k[t], pool.v[cells[t]] = v[t] for t < tokens   (an index_copy of rows)
//
// k, v: [tokens, H_kv, D]. 16-byte vector copies, grid-stride over (K or V, token, vector).
// Preconditions (checked by the launcher): rows are a multiple of 16 bytes, pointers 16-byte
// aligned, cells[t] in [0, pool.rows] (pool.rows is the scratch row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/pool_view.hpp"

namespace cellkv::gpu::kernels {

template <class T>
__global__ void write_kv(PoolView<T> pool, const T* __restrict__ k, const T* __restrict__ v,
                         const std::int64_t* __restrict__ cells, std::int32_t tokens) {
  const std::int64_t row_vecs = pool.row_elems() * static_cast<std::int64_t>(sizeof(T)) / 16;
  const std::int64_t per_tensor = tokens * row_vecs;
  const std::int64_t total = 2 * per_tensor;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const bool is_v = i >= per_tensor;
    const std::int64_t j = is_v ? i - per_tensor : i;
    const std::int64_t t = j / row_vecs, vec = j % row_vecs;
    const uint4* src = reinterpret_cast<const uint4*>(is_v ? v : k) + j;
    uint4* dst = reinterpret_cast<uint4*>(is_v ? pool.v : pool.k) + cells[t] * row_vecs + vec;
    *dst = *src;
  }
}

}  // namespace cellkv::gpu::kernels
