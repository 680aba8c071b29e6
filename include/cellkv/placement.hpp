// cellkv/placement.hpp - which free cell a token of the cell layout claims.
//
// Placement never changes visibility (only positions and owners decide it, docs/design.md section 3);
// it decides which KV tiles a sequence touches, and so how much a tile-skipping kernel can skip.
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>

namespace cellkv {
namespace placement {

// The classic policy: each token takes the lowest free cell, so a step's cells are ascending.
struct lowest_free {};

// A sequence appends into its own aligned block of `Block` cells (cells [b*Block, (b+1)*Block)).
// When its block is full it opens the lowest fully free block; when no block is fully free it
// falls back to the lowest free cell anywhere, so capacity is never lost.
template <std::int32_t Block>
struct clustered {
  static_assert(Block > 0 && (Block & (Block - 1)) == 0,
                "cellkv::placement::clustered<Block>: Block must be a power of two (match the KV tile, "
                "e.g. 64 or 128)");
  static constexpr std::int32_t kBlock = Block;
};

}  // namespace placement

namespace detail {
template <class P>
struct is_clustered : std::false_type {};
template <std::int32_t B>
struct is_clustered<placement::clustered<B>> : std::true_type {};
}  // namespace detail

template <class P>
concept Placement = std::same_as<P, placement::lowest_free> || detail::is_clustered<P>::value;

template <class P>
inline constexpr bool kIsClustered = detail::is_clustered<P>::value;

}  // namespace cellkv
