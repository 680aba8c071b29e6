// cellkv/cuda/kernels/step_prep.cuh - per-step device work of the cell layout: apply the changed
// cells to the metadata mirror and the per-tile stats, then (when asked) build each window's
// dense mask rows from the mirror.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/cuda/step_buffers.hpp"

namespace cellkv::gpu::kernels {

// Recomputes one tile's stats from the mirror, as one warp (each lane two cells).
template <int Words>
__device__ void tile_stats_of(const TileStatsView& v, std::int32_t tile) {
  const int lane = threadIdx.x % 32;
  int pmin = INT32_MAX, pmax = -1, count = 0;
  std::uint64_t any[Words], all[Words];
#pragma unroll
  for (int w = 0; w < Words; ++w) any[w] = 0, all[w] = ~std::uint64_t{0};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t c = static_cast<std::int64_t>(tile) * kTileRows + half * 32 + lane;
    const int p = c < v.max_cells ? v.cell_pos[c] : -1;
    if (p < 0) continue;
    pmin = min(pmin, p), pmax = max(pmax, p), ++count;
#pragma unroll
    for (int w = 0; w < Words; ++w) {
      const std::uint64_t o = v.owner_words[w * v.max_cells + c];
      any[w] |= o, all[w] &= o;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    pmin = min(pmin, __shfl_xor_sync(0xffffffffu, pmin, off));
    pmax = max(pmax, __shfl_xor_sync(0xffffffffu, pmax, off));
    count += __shfl_xor_sync(0xffffffffu, count, off);
#pragma unroll
    for (int w = 0; w < Words; ++w) {
      any[w] |= __shfl_xor_sync(0xffffffffu, any[w], off);
      all[w] &= __shfl_xor_sync(0xffffffffu, all[w], off);
    }
  }
  if (lane != 0) return;
  v.stats[tile] = TileStats{pmin, pmax, count, 0};
#pragma unroll
  for (int w = 0; w < Words; ++w) {
    v.tile_or[static_cast<std::int64_t>(w) * v.max_tiles + tile] = any[w];
    v.tile_and[static_cast<std::int64_t>(w) * v.max_tiles + tile] = count > 0 ? all[w] : 0;
  }
}

// The cell layout's per-step metadata update: the changed cells, grouped by tile (host-sorted),
// go into the mirror and each touched tile's stats are recomputed. One warp per group; groups
// start right after the `entries` entries. Grid: ceil(groups / 8) blocks of 256 threads.
template <int Words>
__global__ void scatter_tiles(const MirrorEntry<Words>* __restrict__ entries, std::int32_t entry_count,
                              std::int32_t group_count, TileStatsView v) {
  const TileGroup* groups = reinterpret_cast<const TileGroup*>(entries + entry_count);
  const int g = blockIdx.x * 8 + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (g >= group_count) return;
  const TileGroup group = groups[g];
  for (int i = lane; i < group.count; i += 32) {
    const MirrorEntry<Words> e = entries[group.first + i];
    v.cell_pos[e.cell] = e.pos;
#pragma unroll
    for (int w = 0; w < Words; ++w) v.owner_words[w * v.max_cells + e.cell] = e.owners[w];
  }
  __syncwarp();
  tile_stats_of<Words>(v, group.tile);
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
