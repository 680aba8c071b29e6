// llama/shard_weights.hpp - the example decoder split for tensor parallelism over G shards:
// attention by heads (cellkv::head_shard), the MLP by hidden columns. Shard g holds
//   wq, wk, wv: the columns of its query / KV heads ([dim, H D] -> [dim, H_g D])
//   wo:         the rows of its query heads ([H_q D, dim] -> [H_q,g D, dim])
//   w1, w3:     hidden columns [g ffn / G, (g + 1) ffn / G); w2: the same rows
// and a copy of everything else (embedding, norms, LM head). The model's x W for a split W is
// then the sum over shards of x_g W_g: one all-reduce after the attention output projection and
// one after the MLP.
#pragma once

#include <cellkv/sharding.hpp>
#include <cellkv/status.hpp>

#include <cstdint>
#include <vector>

#include "config.hpp"

namespace llama {

// Columns [first, first + count) of a row-major [rows, cols] matrix.
inline std::vector<float> columns_of(const std::vector<float>& m, std::int32_t cols, std::int32_t first,
                                     std::int32_t count) {
  const auto rows = static_cast<std::int64_t>(m.size()) / cols;
  std::vector<float> out(static_cast<std::size_t>(rows * count));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int32_t c = 0; c < count; ++c)
      out[static_cast<std::size_t>(r * count + c)] = m[static_cast<std::size_t>(r * cols + first + c)];
  return out;
}

// Rows [first, first + count) of a row-major [rows, cols] matrix.
inline std::vector<float> rows_of(const std::vector<float>& m, std::int32_t cols, std::int32_t first,
                                  std::int32_t count) {
  const auto begin = m.begin() + static_cast<std::ptrdiff_t>(first) * cols;
  return {begin, begin + static_cast<std::ptrdiff_t>(count) * cols};
}

// What shard g of G holds: its heads and its MLP hidden columns.
struct ShardPlan {
  std::int32_t shards = 1, index = 0;
  cellkv::HeadShard heads;
  cellkv::ShardRange ffn;
};

// Refuses what cellkv::head_shard refuses, and ffn not a multiple of G (bad_shape).
inline cellkv::Result<ShardPlan> shard_plan(const Config& c, std::int32_t shards, std::int32_t g) {
  const auto heads = cellkv::head_shard(c.heads_q, c.heads_kv, shards, g);
  if (!heads.ok()) return heads.status().code();
  const auto ffn = cellkv::even_part(c.ffn, shards, g);
  if (!ffn.ok()) return ffn.status().code();
  return ShardPlan{shards, g, heads.value(), ffn.value()};
}

// The sizes one shard computes with: its heads and hidden columns, the model's dim and vocab.
inline Config shard_config(const Config& c, const ShardPlan& p) {
  Config s = c;
  s.heads_q = p.heads.q.count;
  s.heads_kv = p.heads.kv.count;
  s.ffn = p.ffn.count;
  return s;
}

inline Weights shard_weights(const Config& c, const Weights& w, const ShardPlan& p) {
  const std::int32_t D = c.head_dim;
  Weights s{w.embed, {}, w.final_norm, w.lm_head};
  for (const LayerWeights& l : w.layers)
    s.layers.push_back({l.attn_norm, columns_of(l.wq, c.q_width(), p.heads.q.first * D, p.heads.q.count * D),
                        columns_of(l.wk, c.kv_width(), p.heads.kv.first * D, p.heads.kv.count * D),
                        columns_of(l.wv, c.kv_width(), p.heads.kv.first * D, p.heads.kv.count * D),
                        rows_of(l.wo, c.dim, p.heads.q.first * D, p.heads.q.count * D), l.ffn_norm,
                        columns_of(l.w1, c.ffn, p.ffn.first, p.ffn.count),
                        columns_of(l.w3, c.ffn, p.ffn.first, p.ffn.count),
                        rows_of(l.w2, c.dim, p.ffn.first, p.ffn.count)});
  return s;
}

}  // namespace llama
