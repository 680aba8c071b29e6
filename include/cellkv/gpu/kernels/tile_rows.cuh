// cellkv/gpu/kernels/tile_rows.cuh - where the K/V rows of a tile of positions live: the one
// thing the attention kernels ask of a layout.
//
// A tile is n <= kPagePositions consecutive positions of one sequence starting at a multiple of n,
// so it lies inside one page of the position table. Both policies are trivially copyable:
//   TableRows  cell layout: the row of position p of seq is the table's cell (one directory read
//              per tile, then one entry per position); -1 for a hole (a page entry of -1, or a
//              page of only holes: directory entry -1), which the kernels mask
//   SlotRows   sequence layout: row = seq * max_len + p
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/position_table_view.hpp"

namespace cellkv::gpu::kernels {

struct TableRows {
  PositionTableView table;

  // The page holding a tile and the tile's first entry in it (the page id is kept as read, so a
  // caller reading ahead does not wait for it until row()).
  struct Tile {
    std::int32_t page;
    std::int32_t first;
  };
  // Precondition: base < pos(seq) of a live sequence.
  __device__ __forceinline__ Tile tile(std::int32_t seq, std::int32_t base) const {
    return {table.page_of(seq, base), base % kPagePositions};
  }
  // Row of position base + i (< pos(seq)), -1 for a hole.
  __device__ __forceinline__ std::int32_t row(const Tile& t, std::int32_t i) const {
    return t.page < 0 ? -1 : table.pages[static_cast<std::int64_t>(t.page) * kPagePositions + t.first + i];
  }
};

struct SlotRows {
  std::int32_t max_len = 0;

  struct Tile {
    std::int32_t first;
  };
  __device__ __forceinline__ Tile tile(std::int32_t seq, std::int32_t base) const { return {seq * max_len + base}; }
  __device__ __forceinline__ std::int32_t row(const Tile& t, std::int32_t i) const { return t.first + i; }
};

}  // namespace cellkv::gpu::kernels
