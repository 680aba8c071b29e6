// cellkv/gpu/kernels/step_kernels.cuh - per-step device work of the cell layout:
//   apply_table_writes  the uploaded position-table writes into the table's device copy
//   build_masks         each window's dense mask rows (the mask contract, docs/design.md section 5), from the table
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/gpu/step_views.hpp"
#include "cellkv/position_table_view.hpp"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

// flat[writes[i].index] = writes[i].value for i < count (each index appears once). Grid-stride.
// Write: TableWrite (a template so the header defines no non-inline symbol).
template <class Write>
__global__ void apply_table_writes(const Write* __restrict__ writes, std::int32_t count, std::int32_t* flat) {
  for (std::int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    flat[writes[i].index] = writes[i].value;
}

// Mask row of token t for window buffer blockIdx.y over columns [0, read_len): zeros, then a 1 at
// the cell of every position the token sees (visibility.hpp) through its sequence's table. Grid:
// (width, window buffers); block: any size. Padding tokens (sequence -1) see nothing. Vector: rows
// are 16-byte aligned (max_cells % 16 == 0), so zeros go 16 bytes at a time.
template <bool Vector>
__global__ void build_masks(StepBindings b, WindowList windows, std::int64_t read_len) {
  const std::int32_t t = blockIdx.x;
  bool* row = b.mask(static_cast<std::int32_t>(blockIdx.y)) + t * b.max_cells;
  const std::int64_t vectors = Vector ? read_len / 16 : 0;
  for (std::int64_t i = threadIdx.x; i < vectors; i += blockDim.x) reinterpret_cast<uint4*>(row)[i] = make_uint4(0, 0, 0, 0);
  for (std::int64_t c = vectors * 16 + threadIdx.x; c < read_len; c += blockDim.x) row[c] = false;
  __syncthreads();
  const std::int32_t seq = b.token_seq[t];
  if (seq < 0) return;
  const PositionRange seen = visible_positions(windows.w[blockIdx.y], b.token_pos[t]);
  for (std::int32_t p = seen.begin + static_cast<std::int32_t>(threadIdx.x); p <= seen.end; p += blockDim.x)
    if (const std::int32_t cell = b.table.cell(seq, p); cell >= 0) row[cell] = true;  // -1: a hole
}

}  // namespace cellkv::gpu::kernels
