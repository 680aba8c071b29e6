// cellkv/kv_cache.hpp - the host cache: step planning and verbs for both layouts.
//
//   KVCache<L, W, P, MaxSeqs>        any layout L (layout.hpp), window set W, placement P
//   CellCache<W, P, MaxSeqs>         = KVCache<layout::cell, ...>: rows are cells with (pos, owners)
//                                    metadata; placement P picks free cells (docs/design.md section 2)
//   SequenceCache<W, MaxSeqs>        = KVCache<layout::sequence, ...>: sequence s owns rows
//                                    [s*max_len, (s+1)*max_len)
//
// Both layouts serve the same step protocol and verbs (detail/cache_common.hpp) and the same
// visibility rule; only where rows live differs. The cache is a plain copyable value: compare two
// with ==.
//
//   using Model = cellkv::Windows<0, 128, 0, 128>;
//   cellkv::CellCache<Model> cache({.max_write = 64, .max_cells = 4096});
//   auto a = cache.seq_new().value();
//   std::int32_t ids[] = {a, a, a};
//   auto plan = cache.declare_step(ids);   // rows, positions 0..2, read_len
#pragma once

#include <cstdint>

#include "cellkv/layout.hpp"
#include "cellkv/placement.hpp"
#include "cellkv/windows.hpp"

namespace cellkv {

// P is a placement argument a cache of layout L takes (L::kAccepts<P>, layout.hpp).
template <class P, class L>
concept PlacementFor = Layout<L> && L::template kAccepts<P>;

template <Layout L, WindowSet W, PlacementFor<L> P = typename L::default_placement, std::int32_t MaxSeqs = 256>
class KVCache;

}  // namespace cellkv

#include "cellkv/detail/cell_layout_cache.hpp"
#include "cellkv/detail/sequence_layout_cache.hpp"

namespace cellkv {

// The cache of the cell layout: any sequence's token in any free cell, forks share cells.
template <WindowSet W, PlacementFor<layout::cell> P = placement::lowest_free, std::int32_t MaxSeqs = 256>
using CellCache = KVCache<layout::cell, W, P, MaxSeqs>;

// The cache of the sequence layout: each sequence owns max_len consecutive rows.
template <WindowSet W, std::int32_t MaxSeqs = 256>
using SequenceCache = KVCache<layout::sequence, W, placement::none, MaxSeqs>;

}  // namespace cellkv
