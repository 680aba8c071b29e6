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

}  // namespace cellkv::gpu::kernels
