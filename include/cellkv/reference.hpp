// cellkv/reference.hpp - the host reference of write, attend and update_and_attend (docs/design.md
// section 6). Slow and plain on purpose: every kernel is checked against it.
//
// Shapes: q and out [T, H_q, D]; k and v [T, H_kv, D]; pools [rows, H_kv, D] (PoolView). Query
// head h reads KV head h / g with g = H_q / H_kv. Accumulation in double for double inputs and in
// float otherwise. A query that sees nothing gets an output of zeros.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "cellkv/pool_view.hpp"
#include "cellkv/status.hpp"

namespace cellkv::reference {

// 1 / sqrt(head_dim): the scale attention uses unless given one.
inline float default_scale(std::int32_t head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

// pool[rows[t]] = k[t] (K) and v[t] (V) for every token t.
template <class T>
void write(PoolView<T> pool, std::span<const T> k, std::span<const T> v, std::span<const std::int64_t> rows) {
  const std::int64_t n = pool.row_elems();
  for (std::size_t t = 0; t < rows.size(); ++t) {
    const auto src = static_cast<std::ptrdiff_t>(static_cast<std::int64_t>(t) * n);
    std::copy_n(k.begin() + src, n, pool.k + rows[t] * n);
    std::copy_n(v.begin() + src, n, pool.v + rows[t] * n);
  }
}

// Masked attention over rows [0, kv_len): visible(t, row) -> bool decides which rows token t sees.
template <class T, class Visible>
void attend(std::span<const T> q, PoolView<const T> pool, std::span<T> out, std::int32_t heads_q,
            std::int64_t kv_len, float scale, Visible&& visible) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::int32_t D = pool.head_dim, group = heads_q / pool.heads_kv;
  const auto T_tokens = static_cast<std::int64_t>(q.size()) / (static_cast<std::int64_t>(heads_q) * D);
  std::vector<std::int64_t> seen;
  std::vector<Acc> score, acc(static_cast<std::size_t>(D));
  for (std::int64_t t = 0; t < T_tokens; ++t) {
    seen.clear();
    for (std::int64_t c = 0; c < kv_len; ++c)
      if (visible(static_cast<std::int32_t>(t), c)) seen.push_back(c);
    for (std::int32_t h = 0; h < heads_q; ++h) {
      const T* qh = q.data() + (t * heads_q + h) * D;
      const std::int32_t hk = h / group;
      score.assign(seen.size(), Acc{0});
      Acc top = -INFINITY;
      for (std::size_t i = 0; i < seen.size(); ++i) {
        const T* kc = pool.k + pool.offset(seen[i], hk);
        Acc dot = 0;
        for (std::int32_t d = 0; d < D; ++d) dot += static_cast<Acc>(qh[d]) * static_cast<Acc>(kc[d]);
        score[i] = dot * static_cast<Acc>(scale);
        top = std::max(top, score[i]);
      }
      std::fill(acc.begin(), acc.end(), Acc{0});
      Acc sum = 0;
      for (std::size_t i = 0; i < seen.size(); ++i) {
        const Acc p = std::exp(score[i] - top);
        sum += p;
        const T* vc = pool.v + pool.offset(seen[i], hk);
        for (std::int32_t d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += p * static_cast<Acc>(vc[d]);
      }
      T* o = out.data() + (t * heads_q + h) * D;
      for (std::int32_t d = 0; d < D; ++d) o[d] = sum > 0 ? static_cast<T>(acc[static_cast<std::size_t>(d)] / sum) : T{};
    }
  }
}

// Write then attend for a layer of window `window` of the cache's placed step (either layout).
// Refuses, writing nothing: no step placed (no_step_declared); a negative window (bad_argument);
// H_q not a positive multiple of H_kv (bad_head_ratio); head_dim < 1, or shapes
// that disagree with the step and pool (bad_shape).
template <class Cache, class T>
Status update_and_attend(const Cache& cache, std::int32_t window, PoolView<T> pool, std::span<const T> q,
                         std::span<const T> k, std::span<const T> v, std::span<T> out, std::int32_t heads_q,
                         float scale) {
  if (const Status s = cache.require_step(); !s.ok()) return s;
  if (window < 0) return Errc::bad_argument;
  if (pool.heads_kv <= 0 || heads_q <= 0 || heads_q % pool.heads_kv != 0) return Errc::bad_head_ratio;
  if (pool.head_dim < 1) return Errc::bad_shape;
  const auto plan = cache.step();
  const auto T_tokens = static_cast<std::size_t>(plan.tokens);
  const auto q_elems = T_tokens * static_cast<std::size_t>(heads_q) * static_cast<std::size_t>(pool.head_dim);
  const auto kv_elems = T_tokens * static_cast<std::size_t>(pool.row_elems());
  if (q.size() != q_elems || out.size() != q_elems || k.size() != kv_elems || v.size() != kv_elems ||
      plan.read_len > pool.rows)
    return Errc::bad_shape;
  write(pool, k, v, plan.rows);
  const PoolView<const T> read{pool.k, pool.v, pool.rows, pool.heads_kv, pool.head_dim};
  attend<T>(q, read, out, heads_q, plan.read_len, scale,
            [&](std::int32_t t, std::int64_t row) { return cache.visible(t, row, window).value_or(false); });
  return {};
}

}  // namespace cellkv::reference
