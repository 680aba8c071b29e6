// cellkv/gpu/kernels/move_rows.cuh - K and V rows of one layer between the pool and a packed
// block, in one launch (the saved state's gather and scatter, gpu/sequence_state.cuh):
//
//   Gather:  packed[kv][i] = pool_kv[rows[i]]     kv 0: K, 1: V; i < count
//   scatter: pool_kv[rows[i]] = packed[kv][i]
//
// k, v: the layer's pools, rows of row_units units U each; packed: [2][count][row_units] of U.
// U is the copy unit (16, 8, 4, 2 or 1 bytes; the launcher picks the widest that divides the row
// and aligns every pointer). Grid-stride over (K or V, row, unit). rows[i] must lie in the pool
// (the caller's host cache gave them); rows of a scatter are distinct.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cellkv::gpu::kernels {

template <class U, bool Gather>
__global__ void move_rows(U* k, U* v, const std::int64_t* __restrict__ rows, std::int64_t count, std::int64_t row_units,
                          U* packed) {
  const std::int64_t per_tensor = count * row_units;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < 2 * per_tensor;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const bool is_v = i >= per_tensor;
    const std::int64_t j = is_v ? i - per_tensor : i;
    U* pool = (is_v ? v : k) + rows[j / row_units] * row_units + j % row_units;
    if constexpr (Gather) packed[i] = *pool;
    else *pool = packed[i];
  }
}

}  // namespace cellkv::gpu::kernels
