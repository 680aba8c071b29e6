// cellkv/cuda/kernels/step_prep.cuh - per-step device work of the cell layout: apply the changed
// cells to the metadata mirror, then build each window's mask rows from the mirror.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/cuda/step_buffers.hpp"

namespace cellkv::gpu::kernels {

// mirror[e.cell] = (e.pos, e.owners) for each of the `count` entries.
template <std::int32_t Words>
__global__ void scatter_mirror(const MirrorEntry<Words>* __restrict__ entries, std::int32_t count,
                               std::int32_t* __restrict__ cell_pos, std::uint64_t* __restrict__ owner_words,
                               std::int64_t max_cells) {
  const std::int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const MirrorEntry<Words> e = entries[i];
  cell_pos[e.cell] = e.pos;
#pragma unroll
  for (std::int32_t w = 0; w < Words; ++w) owner_words[w * max_cells + e.cell] = e.owners[w];
}

// The visibility rule (DESIGN.md section 3) for token (seq, pos) and cell c of the mirror.
__device__ __forceinline__ bool cell_visible(const std::int32_t* cell_pos, const std::uint64_t* owner_word_of_seq,
                                             std::int32_t bit, std::int32_t window, std::int32_t pos,
                                             std::int64_t c) {
  const std::int32_t cp = cell_pos[c];
  if (cp < 0 || cp > pos || ((owner_word_of_seq[c] >> bit) & 1u) == 0) return false;
  return window == 0 || pos - cp < window;
}

// Mask rows [0, tokens) x [0, read_len) of every window buffer. Grid: x = column chunks,
// y = token, z = window buffer. Each thread writes 16 consecutive columns, as one 16-byte store
// when Vector (rows 16-byte aligned: max_cells % 16 == 0). Tokens with seq < 0 (padding) see nothing.
template <bool Vector>
__global__ void build_masks(StepBindings b, WindowList windows, std::int64_t read_len) {
  const std::int32_t t = blockIdx.y;
  const std::int32_t window = windows.w[blockIdx.z];
  const std::int32_t seq = b.token_seq[t], pos = b.token_pos[t];
  const std::uint64_t* word = seq >= 0 ? b.owner_words + (seq >> 6) * b.max_cells : nullptr;
  const std::int32_t bit = seq & 63;
  bool* row = b.mask(static_cast<std::int32_t>(blockIdx.z)) + t * b.max_cells;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * 16;
  for (std::int64_t c0 = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 16; c0 < read_len;
       c0 += stride) {
    alignas(16) unsigned char bytes[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const std::int64_t c = c0 + j;
      bytes[j] = c < read_len && word != nullptr && cell_visible(b.cell_pos, word, bit, window, pos, c);
    }
    if (Vector && c0 + 16 <= read_len) {
      *reinterpret_cast<uint4*>(row + c0) = *reinterpret_cast<const uint4*>(bytes);
    } else {
      for (int j = 0; j < 16 && c0 + j < read_len; ++j) row[c0 + j] = bytes[j] != 0;
    }
  }
}

}  // namespace cellkv::gpu::kernels
