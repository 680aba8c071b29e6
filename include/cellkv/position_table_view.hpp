// cellkv/position_table_view.hpp - a read-only view of a position table (position_table.hpp):
// what kernels take (trivially copyable), without the host owner.
//
//   directory  int32 [max_seqs][dir_stride]      page id of positions [64 k, 64 k + 64) of s
//   pages      int32 [page_capacity][64]         cell of each position of the page
#pragma once

#include <cstdint>

#include "cellkv/host_device.hpp"

namespace cellkv {

inline constexpr std::int32_t kPagePositions = 64;

// A read-only view of a position table (host or device memory); trivially copyable, so kernels
// take it by value. Precondition of cell(): 0 <= pos < pos(seq) of a live sequence.
struct PositionTableView {
  const std::int32_t* directory = nullptr;  // [max_seqs][dir_stride]
  const std::int32_t* pages = nullptr;      // [page_capacity][kPagePositions]
  std::int32_t dir_stride = 0;

  CELLKV_HOST_DEVICE std::int32_t page_of(std::int32_t seq, std::int32_t pos) const noexcept {
    return directory[static_cast<std::int64_t>(seq) * dir_stride + pos / kPagePositions];
  }
  CELLKV_HOST_DEVICE std::int32_t cell(std::int32_t seq, std::int32_t pos) const noexcept {
    return pages[static_cast<std::int64_t>(page_of(seq, pos)) * kPagePositions + pos % kPagePositions];
  }
};

}  // namespace cellkv
