// cellkv/cuda/kernels/tile_meta.cuh - what the fast kernels know about rows: visibility from
// metadata (never from a dense mask), and a three-way classification of 64-row KV tiles.
//
// A query segment (cellkv::Segment, step_plan.hpp) is a run of step tokens of one sequence.
// For rows [first, last] of positions and a window W, a tile is
//   skip:    no cell of it is visible to any of those positions;
//   full:    every cell is visible to every one of them (no per-element test needed);
//   partial: anything else (per-element visibility).
// Two metadata policies give the same interface: CellMeta (cell layout: mirror + per-tile stats)
// and SlotMeta (sequence layout: row = slot * max_len + position).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/cuda/step_buffers.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

namespace kernels {

enum TileClass : int { kSkip = 0, kPartial = 1, kFull = 2 };

// What a sequence holds in one tile: the position range of its cells there (pmin > pmax: none),
// and whether it owns every one of the tile's 64 cells. Trivial (it lives in __shared__ arrays).
struct TileView {
  int pmin;
  int pmax;
  bool all_owned;
  static constexpr __device__ TileView none() { return {0, -1, false}; }
};

// Positions [first, last] see positions [first - W + 1, last] (all of [0, last] when W == 0).
__device__ __forceinline__ int classify_view(const TileView& v, int first, int last, int window) {
  if (v.pmin > v.pmax || v.pmin > last || (window > 0 && v.pmax < first - window + 1)) return kSkip;
  const bool in_window = window == 0 || v.pmin >= last - window + 1;
  return v.all_owned && v.pmax <= first && in_window ? kFull : kPartial;
}

// Cell layout: per-cell mirror (position, owner words [Words][max_cells]) and per-tile stats with
// the OR and AND of owner words over occupied cells ([Words][max_tiles]).
struct CellMeta {
  const std::int32_t* cell_pos = nullptr;
  const std::uint64_t* owner_words = nullptr;
  const TileStats* stats = nullptr;
  const std::uint64_t* tile_or = nullptr;
  const std::uint64_t* tile_and = nullptr;
  std::int64_t max_cells = 0;
  std::int32_t max_tiles = 0;

  static CellMeta of(const TileStatsView& v) {
    return {v.cell_pos, v.owner_words, v.stats, v.tile_or, v.tile_and, v.max_cells, v.max_tiles};
  }

  __device__ bool owned(std::int64_t c, std::int32_t seq) const {
    return (owner_words[(seq >> 6) * max_cells + c] >> (seq & 63)) & 1u;
  }
  // Position of cell c if seq owns it, else -1.
  __device__ std::int32_t pos_for(std::int64_t c, std::int32_t seq) const {
    return c < max_cells && owned(c, seq) ? cell_pos[c] : -1;
  }
  // The tile's position range over all its cells (a superset of seq's) when seq owns any of them.
  __device__ TileView view(std::int32_t tile, std::int32_t seq) const {
    const std::int64_t w = static_cast<std::int64_t>(seq >> 6) * max_tiles + tile;
    if (((tile_or[w] >> (seq & 63)) & 1u) == 0) return TileView::none();
    const TileStats s = stats[tile];
    return {s.pmin, s.pmax, s.count == kTileRows && ((tile_and[w] >> (seq & 63)) & 1u)};
  }
  __device__ int classify(std::int32_t tile, std::int32_t seq, int first, int last, int window) const {
    return classify_view(view(tile, seq), first, last, window);
  }
};

// Sequence layout: sequence s owns rows [s * max_len, (s + 1) * max_len); position = row - base.
struct SlotMeta {
  std::int32_t max_len = 0;

  __device__ std::int32_t pos_for(std::int64_t c, std::int32_t seq) const {
    const std::int64_t p = c - static_cast<std::int64_t>(seq) * max_len;
    return p >= 0 && p < max_len ? static_cast<std::int32_t>(p) : -1;
  }
  __device__ TileView view(std::int32_t tile, std::int32_t seq) const {
    const std::int64_t base = static_cast<std::int64_t>(seq) * max_len;
    const std::int64_t lo = static_cast<std::int64_t>(tile) * kTileRows, hi = lo + kTileRows - 1;
    if (hi < base || lo >= base + max_len) return TileView::none();
    const auto pmin = static_cast<int>((lo > base ? lo : base) - base);
    const auto pmax = static_cast<int>((hi < base + max_len - 1 ? hi : base + max_len - 1) - base);
    return {pmin, pmax, lo >= base && hi < base + max_len};
  }
  __device__ int classify(std::int32_t tile, std::int32_t seq, int first, int last, int window) const {
    return classify_view(view(tile, seq), first, last, window);
  }
};

// Visibility of a cell at position cp (-1: not owned) to a query at qpos (DESIGN.md section 3).
__device__ __forceinline__ bool visible_at(int cp, int qpos, int window) {
  return cp >= 0 && cp <= qpos && (window == 0 || qpos - cp < window);
}

}  // namespace kernels
}  // namespace cellkv::gpu
