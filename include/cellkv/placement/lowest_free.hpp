// cellkv/placement/lowest_free.hpp - the classic policy: each token takes the lowest free cell,
// so a step's cells are ascending. A Placement (cellkv/placement.hpp); no state of its own.
#pragma once

#include <cstdint>

#include "cellkv/placement/free_cells.hpp"

namespace cellkv::placement {

struct lowest_free {
  struct SeqState {
    friend bool operator==(const SeqState&, const SeqState&) = default;
  };

  lowest_free() = default;
  explicit lowest_free(std::int32_t /*max_cells*/) noexcept {}

  std::int32_t pick(SeqState&, FreeCells free) noexcept { return free.lowest(); }
  void freed(std::int32_t /*cell*/) noexcept {}
  void truncated(SeqState&, std::int32_t /*last_cell*/) noexcept {}

  friend bool operator==(const lowest_free&, const lowest_free&) = default;
};

}  // namespace cellkv::placement
