// cellkv/layout.hpp - where a token's K/V row lives, chosen at compile time (docs/design.md section 2).
//
// A layout is a tag type L with traits (checked by the Layout concept below) and a KVCache
// specialization that implements it (cellkv/detail/*_layout_cache.hpp); the device side adds
// gpu::DeviceLayout<L> (cellkv/gpu/device_layout.cuh). docs/design.md, "How to add a layout, a
// placement, a kernel", lists what a new one provides:
//
//   L::default_placement            the placement a cache of L gets when none is named
//   L::kAccepts<P>                  whether a cache of L takes placement P
//   L::kPositionTable               true: rows are found through a PositionTable the host cache
//                                   exposes (table()) and the device keeps a copy of; the
//                                   reference kernel reads dense masks. false: a token's visible
//                                   rows are one contiguous range (visible_range), which the
//                                   reference kernel reads instead
//   L::rows(config) -> int64_t      rows of every layer's pool for a config with max_seqs != 0
#pragma once

#include <concepts>
#include <cstdint>

#include "cellkv/placement.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv {
namespace layout {

// One index space of max_cells rows shared by all layers; cell c is row c of every layer's pool.
// A sequence's rows need not be contiguous; forks share rows by owner bits (zero copy).
struct cell {
  using default_placement = placement::lowest_free;
  template <class P>
  static constexpr bool kAccepts = Placement<P>;
  static constexpr bool kPositionTable = true;
  static constexpr std::int64_t rows(const CacheConfig& c) noexcept { return c.max_cells; }
};

// Each live sequence owns a slot of max_len consecutive rows: position p of the sequence in slot s
// lives at row s * max_len + p. What a token sees is a contiguous row range; forks copy rows.
// It places nothing: its placement is placement::none (a cell placement named instead is
// accepted and ignored).
struct sequence {
  using default_placement = placement::none;
  template <class P>
  static constexpr bool kAccepts = std::same_as<P, placement::none> || Placement<P>;
  static constexpr bool kPositionTable = false;
  static constexpr std::int64_t rows(const CacheConfig& c) noexcept {
    return static_cast<std::int64_t>(c.max_seqs) * c.max_len;
  }
};

}  // namespace layout

template <class L>
concept Layout = requires(const CacheConfig& c) {
  typename L::default_placement;
  { L::rows(c) } -> std::same_as<std::int64_t>;
  { L::kPositionTable } -> std::convertible_to<bool>;
  requires L::template kAccepts<typename L::default_placement>;
};

}  // namespace cellkv
