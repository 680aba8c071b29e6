// cellkv/visibility.hpp - the visibility rule, written once for the host and the device.
//
// A token of sequence s at position p sees a row (cell) c through a layer of window W iff
//   1. c is occupied, 2. s owns c, 3. pos(c) <= p, 4. W == 0 or p - pos(c) < W.
// Rules 1 and 2 are what a sequence's position table lists (position -> its cell); rules 3 and 4
// make what p sees a range of positions: [visible_begin(W, p), p]. The host reference, the host
// mask rows, the device mask builder, the work planner and the attention kernels all derive what a
// token sees from the two functions below.
#pragma once

#include <cstdint>

#include "cellkv/host_device.hpp"

namespace cellkv {

// Positions [begin, end] (inclusive) a query at `query_pos` sees through window `window`
// (0: all of [0, query_pos]). Empty (begin > end) only for query_pos < 0.
struct PositionRange {
  std::int32_t begin = 0;
  std::int32_t end = -1;

  CELLKV_HOST_DEVICE constexpr bool empty() const noexcept { return begin > end; }
  CELLKV_HOST_DEVICE constexpr bool contains(std::int32_t p) const noexcept { return p >= begin && p <= end; }
  friend constexpr bool operator==(const PositionRange&, const PositionRange&) = default;
};

// Lowest position a query at `query_pos` sees through `window` (rule 4; 0 for window <= 0).
// Computed in 64 bits, so any int32 window and position are safe.
CELLKV_HOST_DEVICE constexpr std::int32_t visible_begin(std::int32_t window, std::int32_t query_pos) noexcept {
  if (window <= 0) return 0;
  const std::int64_t lo = static_cast<std::int64_t>(query_pos) - window + 1;
  return lo > 0 ? static_cast<std::int32_t>(lo) : 0;
}

// Every position a query at `query_pos` sees through `window` (rules 3 and 4).
CELLKV_HOST_DEVICE constexpr PositionRange visible_positions(std::int32_t window, std::int32_t query_pos) noexcept {
  return {visible_begin(window, query_pos), query_pos};
}

// Rules 3 and 4 for one cell: does a query at `query_pos` see a cell at `cell_pos` (of its own
// sequence) through `window`?
CELLKV_HOST_DEVICE constexpr bool sees(std::int32_t window, std::int32_t query_pos, std::int32_t cell_pos) noexcept {
  return cell_pos >= 0 && visible_positions(window, query_pos).contains(cell_pos);
}

}  // namespace cellkv
