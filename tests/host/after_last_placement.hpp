// test::after_last - a third placement policy, defined here in the tests alone, to show that a
// placement is added without touching include/ (docs/design.md, "How to add a layout, a placement,
// a kernel"). The host differential, the placement script and the GPU table-attention tests run it.
//
// Each token takes the first free cell after the last cell its sequence was given (or kept at a
// rewind), wrapping to the lowest free cell when none is free past it. A fresh sequence (new or
// forked) starts from no cell, so its first token takes the lowest free cell.
#pragma once

#include <cstdint>

#include "cellkv/placement.hpp"

namespace cellkv::test {

struct after_last {
  struct SeqState {
    std::int32_t last = -1;  // the sequence's last cell, -1 when none
    friend bool operator==(const SeqState&, const SeqState&) = default;
  };

  after_last() = default;
  explicit after_last(std::int32_t /*max_cells*/) noexcept {}

  std::int32_t pick(SeqState& s, FreeCells free) noexcept {
    std::int32_t c = free.first_from(s.last + 1);
    if (c < 0) c = free.lowest();
    s.last = c;
    return c;
  }
  void freed(std::int32_t /*cell*/) noexcept {}
  void truncated(SeqState& s, std::int32_t last_cell) noexcept { s.last = last_cell; }

  friend bool operator==(const after_last&, const after_last&) = default;
};

static_assert(Placement<after_last>);

}  // namespace cellkv::test
