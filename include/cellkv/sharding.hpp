// cellkv/sharding.hpp - how tensor parallelism splits attention heads (and any other evenly split
// dimension, such as MLP columns) over G shards, one per GPU.
//
// Shard g of G holds KV heads [g * H_kv / G, (g + 1) * H_kv / G) and query heads
// [g * H_q / G, (g + 1) * H_q / G). Because H_q = group * H_kv, query head h of the model reads KV
// head h / group both in the model and, renumbered from 0, on its shard: every query head's KV
// head lives on the same shard as the query head. K, V and Q of a shard are the columns
// [first * D, (first + count) * D) of the model's [tokens, H * D] projections.
#pragma once

#include <cstdint>

#include "cellkv/status.hpp"

namespace cellkv {

// A contiguous run of heads (or columns): [first, first + count).
struct ShardRange {
  std::int32_t first = 0;
  std::int32_t count = 0;

  [[nodiscard]] constexpr std::int32_t end() const noexcept { return first + count; }
  [[nodiscard]] constexpr bool operator==(const ShardRange&) const noexcept = default;
};

// Shard g's part of n items split evenly over `shards`. Refuses shards < 1, n < 1 or g outside
// [0, shards) with bad_argument, and n not a multiple of shards with bad_shape.
[[nodiscard]] constexpr Result<ShardRange> even_part(std::int32_t n, std::int32_t shards, std::int32_t g) noexcept {
  if (shards < 1 || n < 1 || g < 0 || g >= shards) return Errc::bad_argument;
  if (n % shards != 0) return Errc::bad_shape;
  const std::int32_t per = n / shards;
  return ShardRange{g * per, per};
}

// The heads of one shard of a model with H_q query and H_kv KV heads.
struct HeadShard {
  ShardRange q;   // query heads of the shard
  ShardRange kv;  // KV heads of the shard

  [[nodiscard]] constexpr bool operator==(const HeadShard&) const noexcept = default;
};

// Shard g of G for H_q query and H_kv KV heads. Refuses: bad_head_ratio when H_q is not a positive
// multiple of H_kv; bad_shape when H_kv is not a multiple of G (so H_q is one too);
// bad_argument when G < 1 or g is outside [0, G).
[[nodiscard]] constexpr Result<HeadShard> head_shard(std::int32_t heads_q, std::int32_t heads_kv, std::int32_t shards,
                                                     std::int32_t g) noexcept {
  if (heads_kv < 1 || heads_q < 1 || heads_q % heads_kv != 0) return Errc::bad_head_ratio;
  const Result<ShardRange> kv = even_part(heads_kv, shards, g);
  if (!kv.ok()) return kv.status().code();
  const std::int32_t group = heads_q / heads_kv;
  return HeadShard{ShardRange{kv.value().first * group, kv.value().count * group}, kv.value()};
}

}  // namespace cellkv
