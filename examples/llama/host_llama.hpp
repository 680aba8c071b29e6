// llama/host_llama.hpp - the example decoder on the host reference path: plain loops in float,
// attention through cellkv::reference::update_and_attend over host pools, sampling by
// cellkv::batching::sample_row (the rule the device sampler follows). Satisfies
// cellkv::batching::Model; each forward runs at once, and retire() hands its tokens back in order.
//
// Per layer: h = rmsnorm(x); q, k, v = h Wq, h Wk, h Wv; RoPE(q, k); x += attend(q, k, v) Wo;
// h = rmsnorm(x); x += (silu(h W1) * h W3) W2. Logits: rmsnorm(x) W_lm for the rows asked for.
// Before each forward the host pools apply the cache's pending changes, re-rotating the K rows a
// seq_add / seq_div (the executor's context shift) moved by the model's RoPE (rope_spec).
#pragma once

#include <cellkv/batching/model.hpp>
#include <cellkv/batching/sampling.hpp>
#include <cellkv/host_pool.hpp>
#include <cellkv/reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "config.hpp"
#include "sampled_steps.hpp"

namespace llama {

// y [rows, out] (+)= x [rows, in] W [in, out].
inline void matmul(std::span<const float> x, std::span<const float> w, std::span<float> y, std::int32_t in,
                   std::int32_t out, bool accumulate) {
  const auto rows = x.size() / static_cast<std::size_t>(in);
  for (std::size_t r = 0; r < rows; ++r) {
    float* yr = y.data() + r * static_cast<std::size_t>(out);
    if (!accumulate) std::fill(yr, yr + out, 0.f);
    for (std::int32_t i = 0; i < in; ++i) {
      const float xi = x[r * static_cast<std::size_t>(in) + static_cast<std::size_t>(i)];
      const float* wi = w.data() + static_cast<std::size_t>(i) * static_cast<std::size_t>(out);
      for (std::int32_t o = 0; o < out; ++o) yr[o] += xi * wi[o];
    }
  }
}

// Each row of x [rows, n], scaled to unit root-mean-square, times gain.
inline void rmsnorm(std::span<const float> x, std::span<const float> gain, std::span<float> y, float eps) {
  const std::size_t n = gain.size();
  for (std::size_t r = 0; r < x.size() / n; ++r) {
    double ss = 0;
    for (std::size_t i = 0; i < n; ++i) ss += static_cast<double>(x[r * n + i]) * x[r * n + i];
    const auto inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (std::size_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * inv * gain[i];
  }
}

// Rotates pairs (2i, 2i + 1) of every head of row t by rope_angle(positions[t], i).
inline void rope(const Config& c, std::span<float> x, std::int32_t heads, std::span<const std::int32_t> positions) {
  for (std::size_t t = 0; t < positions.size(); ++t)
    for (std::int32_t h = 0; h < heads; ++h)
      for (std::int32_t i = 0; i < c.head_dim / 2; ++i) {
        float* p = x.data() + (t * static_cast<std::size_t>(heads) + static_cast<std::size_t>(h)) * c.head_dim + 2 * i;
        const float a = rope_angle(c, positions[t], i), cs = std::cos(a), sn = std::sin(a);
        const float x0 = p[0], x1 = p[1];
        p[0] = x0 * cs - x1 * sn;
        p[1] = x0 * sn + x1 * cs;
      }
}

template <class Cache>
class HostLlama {
 public:
  using Windows = typename Cache::Windows;

  // The cache must have one layer per entry of its window set. One host pool per pool of the cache:
  // the main pool's (cache.capacity() rows) holds every layer, or with window storage the
  // full-attention layers, and each window pool's the layers of its window.
  HostLlama(const Config& config, const Weights& weights, Cache& cache) : c_(config), w_(weights), cache_(cache) {
    std::vector<std::int32_t> layers(1 + Windows::kWindowed.size(), 0);
    for (std::int32_t l = 0; l < c_.layers; ++l) {
      const std::int32_t p = pool_of_layer(l);
      slots_.push_back({p, layers[static_cast<std::size_t>(p)]++});
    }
    pools_.emplace_back(layers[0], layers[0] > 0 ? cache.capacity() : 0, c_.heads_kv, c_.head_dim);
    std::size_t p = 1;
    for (const std::int32_t w : Windows::kWindowed) {
      const std::int32_t n = layers[p++];
      pools_.emplace_back(n, n > 0 ? rows_of_window(w) : 0, c_.heads_kv, c_.head_dim);
    }
  }

  [[nodiscard]] std::int32_t vocab() const { return c_.vocab; }
  [[nodiscard]] std::int32_t min_prefill_tokens() const { return 2; }

  // Runs the step and samples its logit rows. Refuses (bad_argument, nothing changed) a token id
  // outside [0, vocab) or a deferred token with no previous forward to read it from.
  cellkv::Status forward(const cellkv::batching::ForwardStep& step) {
    if (const cellkv::Status s = sampled_.resolve(step, tokens_); !s.ok()) return s;
    for (const std::int32_t t : tokens_)
      if (t < 0 || t >= c_.vocab) return cellkv::Errc::bad_argument;
    if (step.sampling.size() != step.logit_rows.size()) return cellkv::Errc::bad_argument;
    logits_.resize(step.logit_rows.size() * static_cast<std::size_t>(c_.vocab));
    if (const cellkv::Status s = run(step, logits_); !s.ok()) return s;
    SampledSteps::Step r;
    for (std::size_t i = 0; i < step.logit_rows.size(); ++i) {
      const auto row = std::span<const float>(logits_).subspan(i * static_cast<std::size_t>(c_.vocab),
                                                               static_cast<std::size_t>(c_.vocab));
      const cellkv::batching::Sampled got = cellkv::batching::sample_row(row, step.sampling[i]);
      r.tokens.push_back(got.token);
      r.logprobs.push_back(got.logprob);
    }
    sampled_.push(std::move(r));
    return {};
  }

  cellkv::Status retire(std::span<std::int32_t> tokens, std::span<float> logprobs) {
    return sampled_.retire(tokens, logprobs);
  }

  // The logits of the sampled rows of the last forward, row by row (tests).
  [[nodiscard]] std::span<const float> last_logits() const { return logits_; }
  // The main pool's K and V (tests: the rows as the last forward left them); its layer l is the
  // model's layer l without window storage (with it, the full-attention layers in order).
  [[nodiscard]] cellkv::HostPool<float>& pool() { return pools_[0]; }

 private:
  struct LayerSlot {
    std::int32_t pool = 0;   // index into pools_
    std::int32_t layer = 0;  // the layer's index in that pool
  };
  // 0 for the main pool, 1 + i for the pool of window Windows::kWindowed[i] (window storage).
  [[nodiscard]] std::int32_t pool_of_layer(std::int32_t l) const {
    const std::int32_t i = Windows::windowed_index(Windows::window_of_layer(l));
    return i >= 0 && cellkv::has_window_storage(cache_) ? 1 + i : 0;
  }
  [[nodiscard]] std::int64_t rows_of_window(std::int32_t w) const {
    if constexpr (requires { cache_.pool(w); }) return cache_.pool(w).capacity();
    else return cache_.capacity();
  }

  // Every pool applies its pending changes (fork and copy-on-write copies, then the K rows a shift
  // moved, re-rotated), then the cache acknowledges them.
  cellkv::Status sync_pools() {
    if (!cellkv::has_window_storage(cache_)) return pools_[0].sync(cache_, rope_spec(c_));
    if constexpr (requires { cache_.pool(0); }) {
      pools_[0].apply(cache_.pending_changes(), rope_spec(c_));
      std::size_t i = 1;
      for (const std::int32_t w : Windows::kWindowed)
        pools_[i++].apply(cache_.pool(w).pending_changes(), rope_spec(c_));
      cache_.acknowledge_changes();
    }
    return {};
  }

  // The forward over tokens_ (ids checked) at step.positions; logits of step.logit_rows.
  cellkv::Status run(const cellkv::batching::ForwardStep& step, std::span<float> logits) {
    if (const cellkv::Status s = sync_pools(); !s.ok()) return s;
    const auto T = tokens_.size();
    const auto dim = static_cast<std::size_t>(c_.dim);
    std::vector<float> x(T * dim), h(T * dim), q(T * static_cast<std::size_t>(c_.q_width())),
        k(T * static_cast<std::size_t>(c_.kv_width())), v(k.size()), attn(q.size()),
        a(T * static_cast<std::size_t>(c_.ffn)), b(a.size());
    for (std::size_t t = 0; t < T; ++t)
      std::copy_n(w_.embed.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(tokens_[t]) * dim), dim,
                  x.begin() + static_cast<std::ptrdiff_t>(t * dim));
    for (std::int32_t l = 0; l < c_.layers; ++l) {
      const LayerWeights& lw = w_.layers[static_cast<std::size_t>(l)];
      rmsnorm(x, lw.attn_norm, h, c_.norm_eps);
      matmul(h, lw.wq, q, c_.dim, c_.q_width(), false);
      matmul(h, lw.wk, k, c_.dim, c_.kv_width(), false);
      matmul(h, lw.wv, v, c_.dim, c_.kv_width(), false);
      rope(c_, q, c_.heads_q, step.positions);
      rope(c_, k, c_.heads_kv, step.positions);
      const LayerSlot slot = slots_[static_cast<std::size_t>(l)];
      if (const cellkv::Status s = cellkv::reference::update_and_attend(
              cache_, Windows::window_of_layer(l), pools_[static_cast<std::size_t>(slot.pool)].view(slot.layer),
              std::span<const float>(q), std::span<const float>(k),
              std::span<const float>(v), std::span<float>(attn), c_.heads_q, cellkv::reference::default_scale(c_.head_dim));
          !s.ok())
        return s;
      matmul(attn, lw.wo, x, c_.q_width(), c_.dim, true);
      rmsnorm(x, lw.ffn_norm, h, c_.norm_eps);
      matmul(h, lw.w1, a, c_.dim, c_.ffn, false);
      matmul(h, lw.w3, b, c_.dim, c_.ffn, false);
      for (std::size_t i = 0; i < a.size(); ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
      matmul(a, lw.w2, x, c_.ffn, c_.dim, true);
    }
    std::vector<float> row(dim);
    for (std::size_t i = 0; i < step.logit_rows.size(); ++i) {
      const auto r = static_cast<std::size_t>(step.logit_rows[i]);
      rmsnorm(std::span<const float>(x).subspan(r * dim, dim), w_.final_norm, row, c_.norm_eps);
      matmul(row, w_.lm_head, logits.subspan(i * static_cast<std::size_t>(c_.vocab), static_cast<std::size_t>(c_.vocab)),
             c_.dim, c_.vocab, false);
    }
    return {};
  }

  Config c_;
  const Weights& w_;
  Cache& cache_;
  std::vector<cellkv::HostPool<float>> pools_;  // [0] the main pool, [1 + i] window pool i
  std::vector<LayerSlot> slots_;                // [layers]
  std::vector<std::int32_t> tokens_;
  std::vector<float> logits_;
  SampledSteps sampled_;
};

}  // namespace llama
