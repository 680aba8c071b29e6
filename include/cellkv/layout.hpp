// cellkv/layout.hpp - where a token's K/V row lives, chosen at compile time (docs/design.md section 2).
#pragma once

#include <concepts>

namespace cellkv {
namespace layout {

// One index space of max_cells rows shared by all layers; cell c is row c of every layer's pool.
// A sequence's rows need not be contiguous; forks share rows by owner bits (zero copy).
struct cell {};

// Each live sequence owns a slot of max_len consecutive rows: position p of the sequence in slot s
// lives at row s * max_len + p. What a token sees is a contiguous row range; forks copy rows.
struct sequence {};

}  // namespace layout

template <class L>
concept Layout = std::same_as<L, layout::cell> || std::same_as<L, layout::sequence>;

}  // namespace cellkv
