// cellkv/placement/none.hpp - the placement of layouts that choose no cells.
//
// A layout whose rows follow from (sequence, position) alone, like layout::sequence, has no
// placement decision to make; `none` is its default placement argument. It is not a Placement
// (cellkv/placement.hpp): it picks nothing.
#pragma once

namespace cellkv::placement {

struct none {
  friend bool operator==(const none&, const none&) = default;
};

}  // namespace cellkv::placement
