// cellkv/position_table_view.hpp - a read-only view of a position table (position_table.hpp):
// what kernels take (trivially copyable), without the host owner.
//
//   directory  int32 [max_seqs][dir_stride]      page id of positions [64 k, 64 k + 64) of s
//   pages      int32 [page_capacity][64]         cell of each position of the page
//
// Holes (positions a sequence does not hold, below its length, after seq_rm of a range or a
// shift): a page entry of -1, or a directory entry of -1 for a page of only holes. A reader of
// the table skips both.
#pragma once

#include <cstdint>

#include "cellkv/host_device.hpp"

namespace cellkv {

inline constexpr std::int32_t kPagePositions = 64;

// A read-only view of a position table (host or device memory); trivially copyable, so kernels
// take it by value. Precondition of cell(): 0 <= pos < pos(seq) of a live sequence; it returns -1
// for a hole.
struct PositionTableView {
  const std::int32_t* directory = nullptr;  // [max_seqs][dir_stride]
  const std::int32_t* pages = nullptr;      // [page_capacity][kPagePositions]
  std::int32_t dir_stride = 0;

  CELLKV_HOST_DEVICE std::int32_t page_of(std::int32_t seq, std::int32_t pos) const noexcept {
    return directory[static_cast<std::int64_t>(seq) * dir_stride + pos / kPagePositions];
  }
  CELLKV_HOST_DEVICE std::int32_t cell(std::int32_t seq, std::int32_t pos) const noexcept {
    const std::int32_t page = page_of(seq, pos);
    return page < 0 ? -1 : pages[static_cast<std::int64_t>(page) * kPagePositions + pos % kPagePositions];
  }
};

}  // namespace cellkv
