// cellkv/placement.hpp - which free cell a token of the cell layout claims.
//
// Placement never changes visibility (only positions and owners decide it, docs/design.md section 3);
// it decides which KV tiles a sequence touches, and so how much a tile-skipping kernel can skip.
//
// A placement policy is a class P (docs/design.md, "How to add a layout, a placement, a kernel"):
//
//   P::SeqState                     per-sequence state; SeqState{} for a fresh sequence (new or forked)
//   P(std::int32_t max_cells)       the policy's own state for a pool of max_cells free cells
//   int32_t pick(SeqState&, FreeCells)   a free cell for the sequence's next token; the cache
//                                   claims it on return. Called once per token in step order,
//                                   only when a cell is free.
//   void freed(int32_t cell)        the cell's last owner let go: it is free again
//   void truncated(SeqState&, int32_t last_cell)  the sequence was rewound (or removed): it now
//                                   ends at last_cell, -1 when it holds nothing; called after the
//                                   freed() calls of the cells it let go
//   operator==                      P and SeqState (the cache is a value compared with ==)
//   static size_t host_bytes(int32_t max_cells)   optional: the host memory P(max_cells) allocates
//                                   (counted by cellkv::host_bytes; 0 when absent)
//
// Policies: placement::lowest_free, placement::clustered<Block> (one header each under
// cellkv/placement/); placement::none is the argument of layouts that place nothing.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>

#include "cellkv/placement/clustered.hpp"
#include "cellkv/placement/free_cells.hpp"
#include "cellkv/placement/lowest_free.hpp"
#include "cellkv/placement/none.hpp"

namespace cellkv {

template <class P>
concept Placement =
    std::copyable<P> && std::equality_comparable<P> && std::constructible_from<P, std::int32_t> &&
    std::default_initializable<typename P::SeqState> && std::copyable<typename P::SeqState> &&
    std::equality_comparable<typename P::SeqState> &&
    requires(P& p, typename P::SeqState& s, FreeCells free, std::int32_t cell) {
      { p.pick(s, free) } -> std::same_as<std::int32_t>;
      p.freed(cell);
      p.truncated(s, cell);
    };

// The host memory a P(max_cells) allocates: P::host_bytes(max_cells) when P says, else 0.
template <class P>
[[nodiscard]] constexpr std::size_t placement_host_bytes(std::int32_t max_cells) noexcept {
  if constexpr (requires { { P::host_bytes(max_cells) } -> std::convertible_to<std::size_t>; })
    return P::host_bytes(max_cells);
  else
    return 0;
}

static_assert(Placement<placement::lowest_free>);
static_assert(Placement<placement::clustered<64>>);
static_assert(!Placement<placement::none>);

}  // namespace cellkv
