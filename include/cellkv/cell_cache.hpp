// cellkv/cell_cache.hpp - the host cache: step planning and verbs for both layouts.
//
//   CellCache<layout::cell, W, P, MaxSeqs>      rows are cells with (pos, owners) metadata;
//                                               placement P picks free cells (docs/design.md section 2)
//   CellCache<layout::sequence, W, placement::none, MaxSeqs>
//                                               sequence s owns rows [s*max_len, (s+1)*max_len)
//
// The placement argument defaults to the layout's (L::default_placement, layout.hpp). A new layout
// is a tag with the Layout traits plus a partial specialization of CellCache for it.
//
// Both serve the same step protocol and verbs (detail/cache_common.hpp) and the same visibility
// rule; only where rows live differs. The cache is a plain copyable value: compare two with ==.
//
//   using Model = cellkv::Windows<0, 128, 0, 128>;
//   cellkv::CellCache<cellkv::layout::cell, Model> cache({.max_write = 64, .max_cells = 4096});
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
class CellCache;

}  // namespace cellkv

#include "cellkv/detail/cell_layout_cache.hpp"
#include "cellkv/detail/sequence_layout_cache.hpp"
