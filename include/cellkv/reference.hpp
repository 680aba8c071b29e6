// cellkv/reference.hpp - the host reference of write, attend and update_and_attend (docs/design.md
// section 6). Slow and plain on purpose: every kernel is checked against it.
//
// Shapes: q and out [T, H_q, D]; k and v [T, H_kv, D]; pools [rows, H_kv, D] (PoolView). Query
// head h reads KV head h / g with g = H_q / H_kv. Accumulation in double for double inputs and in
// float otherwise. A query that sees nothing gets an output of zeros.
//
// fp8 pools (Fp8PoolView, fp8_pool_view.hpp): write quantizes each row-head with the function the
// device write uses (quantize_row_head, fp8.hpp); attend dequantizes on read, in double
// (decode(code) x scale, exact), and attends as the double path does, so it is the oracle of fp8
// kernels. q and out are double there; K and V inputs are float (what a device write converts to).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "cellkv/fp8.hpp"
#include "cellkv/fp8_pool_view.hpp"
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
      // Zeros only when nothing is seen: a NaN score (a NaN in q or K) makes sum NaN, and the
      // output NaN, rather than zeros that would hide it.
      T* o = out.data() + (t * heads_q + h) * D;
      for (std::int32_t d = 0; d < D; ++d)
        o[d] = seen.empty() ? T{} : static_cast<T>(acc[static_cast<std::size_t>(d)] / sum);
    }
  }
}

// fp8: quantizes k[t] and v[t] into pool row rows[t], every row-head with its scale
// (quantize_row_head with pool.write_scale). Refuses (bad_argument), writing nothing, a
// static_per_layer view whose scales are not valid_static_scale.
inline Status write(Fp8PoolView<Fp8E4M3> pool, std::span<const float> k, std::span<const float> v,
                    std::span<const std::int64_t> rows) {
  if (pool.scaling == Fp8Scaling::static_per_layer &&
      (!valid_static_scale(pool.static_scales.k) || !valid_static_scale(pool.static_scales.v)))
    return Errc::bad_argument;
  const std::int64_t n = pool.row_elems();
  for (std::size_t t = 0; t < rows.size(); ++t)
    for (std::int32_t h = 0; h < pool.heads_kv; ++h) {
      const auto src = static_cast<std::size_t>(static_cast<std::int64_t>(t) * n + static_cast<std::int64_t>(h) * pool.head_dim);
      const std::int64_t at = pool.offset(rows[t], h), s = pool.scale_offset(rows[t], h);
      pool.k_scale[s] = quantize_row_head(k.data() + src, pool.head_dim, pool.write_scale(false), pool.k + at);
      pool.v_scale[s] = quantize_row_head(v.data() + src, pool.head_dim, pool.write_scale(true), pool.v + at);
    }
  return {};
}

// fp8: rows [0, kv_len) of K and V dequantized into double (decode(code) x scale), then the double
// path's attend over them. A row-head that holds NaN codes gives NaN to the queries that see it.
template <class Visible>
void attend(std::span<const double> q, Fp8PoolView<const Fp8E4M3> pool, std::span<double> out,
            std::int32_t heads_q, std::int64_t kv_len, float scale, Visible&& visible) {
  const auto n = static_cast<std::size_t>(kv_len * pool.row_elems());
  std::vector<double> k(n), v(n);
  for (std::int64_t r = 0; r < kv_len; ++r)
    for (std::int32_t h = 0; h < pool.heads_kv; ++h) {
      const std::int64_t at = pool.offset(r, h), s = pool.scale_offset(r, h);
      dequantize_row_head(pool.k + at, pool.head_dim, pool.k_scale[s], k.data() + at);
      dequantize_row_head(pool.v + at, pool.head_dim, pool.v_scale[s], v.data() + at);
    }
  const PoolView<const double> read{k.data(), v.data(), kv_len, pool.heads_kv, pool.head_dim};
  attend<double>(q, read, out, heads_q, kv_len, scale, std::forward<Visible>(visible));
}

namespace detail {
// The refusals update_and_attend shares between element pools and fp8 pools (see below).
template <class Cache>
Status check_update(const Cache& cache, std::int32_t window, std::int64_t rows, std::int32_t heads_kv,
                    std::int32_t head_dim, std::int32_t heads_q, std::size_t q_size, std::size_t k_size,
                    std::size_t v_size, std::size_t out_size) {
  if (const Status s = cache.require_step(); !s.ok()) return s;
  if (window < 0) return Errc::bad_argument;
  if (heads_kv <= 0 || heads_q <= 0 || heads_q % heads_kv != 0) return Errc::bad_head_ratio;
  if (head_dim < 1) return Errc::bad_shape;
  const auto plan = cache.step();
  const auto T_tokens = static_cast<std::size_t>(plan.tokens);
  const auto q_elems = T_tokens * static_cast<std::size_t>(heads_q) * static_cast<std::size_t>(head_dim);
  const auto kv_elems = T_tokens * static_cast<std::size_t>(heads_kv) * static_cast<std::size_t>(head_dim);
  if (q_size != q_elems || out_size != q_elems || k_size != kv_elems || v_size != kv_elems ||
      cache.read_len(window) > rows)
    return Errc::bad_shape;
  return {};
}
}  // namespace detail

// Write then attend for a layer of window `window` of the cache's placed step (either layout):
// `pool` is the pool that window's layers use (with window storage, a window pool of
// cache.pool_rows(window) rows; the step's rows there are cache.step_rows(window)). Refuses,
// writing nothing: no step placed (no_step_declared); a negative window (bad_argument); H_q not a
// positive multiple of H_kv (bad_head_ratio); head_dim < 1, or shapes that disagree with the step
// and pool (bad_shape).
template <class Cache, class T>
Status update_and_attend(const Cache& cache, std::int32_t window, PoolView<T> pool, std::span<const T> q,
                         std::span<const T> k, std::span<const T> v, std::span<T> out, std::int32_t heads_q,
                         float scale) {
  if (const Status s = detail::check_update(cache, window, pool.rows, pool.heads_kv, pool.head_dim, heads_q, q.size(),
                                            k.size(), v.size(), out.size());
      !s.ok())
    return s;
  write(pool, k, v, cache.step_rows(window));
  const PoolView<const T> read{pool.k, pool.v, pool.rows, pool.heads_kv, pool.head_dim};
  attend<T>(q, read, out, heads_q, cache.read_len(window), scale,
            [&](std::int32_t t, std::int64_t row) { return cache.visible(t, row, window).value_or(false); });
  return {};
}

// fp8: update_and_attend on an fp8 pool: the write quantizes (write above), the attend dequantizes
// in double. Refuses as the element-pool overload does, and a static_per_layer view whose scales are
// not valid_static_scale (bad_argument), writing nothing.
template <class Cache>
Status update_and_attend(const Cache& cache, std::int32_t window, Fp8PoolView<Fp8E4M3> pool, std::span<const double> q,
                         std::span<const float> k, std::span<const float> v, std::span<double> out,
                         std::int32_t heads_q, float scale) {
  if (const Status s = detail::check_update(cache, window, pool.rows, pool.heads_kv, pool.head_dim, heads_q, q.size(),
                                            k.size(), v.size(), out.size());
      !s.ok())
    return s;
  if (const Status s = write(pool, k, v, cache.step_rows(window)); !s.ok()) return s;
  attend(q, pool.read_only(), out, heads_q, cache.read_len(window), scale,
         [&](std::int32_t t, std::int64_t row) { return cache.visible(t, row, window).value_or(false); });
  return {};
}

}  // namespace cellkv::reference
