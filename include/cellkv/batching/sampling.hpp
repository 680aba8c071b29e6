// cellkv/batching/sampling.hpp - how a session's next token is drawn from one row of logits: greedy,
// temperature, top-k, top-p, min-p, a per-session seed; the same function on the host (sample_row
// here) and on the device (device_sampling.cuh), built from the CELLKV_HOST_DEVICE pieces below.
//
//   SamplingParams p{.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .seed = 7};
//   const SampleRow row = make_sample_row(p, /*counter=*/n);   // n: the token's index in the output
//   const Sampled s = sample_row(logits_of_one_row, row);
//
// The rule (V logits l[0..V), one SampleRow):
//  - Greedy (inv_temperature == 0, i.e. temperature 0 or top_k 1, or a row whose largest logit is
//    not finite): the index of the largest logit, the lowest index on a tie (argmax). Order is by
//    order_key: -0 equals +0, NaN is below -inf.
//  - Otherwise the candidates are ranked by the composite key ck(i) = order_key(l[i]) * 2^32 +
//    (2^32 - 1 - i): larger logit first, lower index first among equal logits. Each candidate has
//    an integer mass m(i) = floor(exp_det((l[i] - lmax) * inv_temperature) * 2^31) (0 below
//    exp(-kMassCutoff)); integer masses make every sum below exact and order-free.
//    Kept: the candidates with ck >= c*, c* = max(c_k, c_p, c_m), where
//      c_k = ck of the top_k-th candidate (0 when top_k is 0 or >= V);
//      c_p = ck of the first candidate, in rank order within top-k, at which the running mass
//            reaches ceil(top_p * W_k), W_k = the mass of the top-k candidates (0 when top_p >= 1);
//      c_m = order_key(lmax + min_p_offset) * 2^32 (0 when min_p_offset is -inf): the logits
//            >= lmax + temperature * ln(min_p), i.e. probability >= min_p * the largest.
//    The draw: r = philox_draw(seed, counter), target = floor(W * r / 2^32) with W the kept mass;
//    the token is the first kept index, in ascending index order, at which the running kept mass
//    passes target.
//  - log-prob (when asked): log softmax of the raw logits (temperature 1) at the token, in fp32.
//
// What is guaranteed equal: for bitwise identical logits and the same SampleRow, the host and
// the device pick the same token (integer sums, explicitly rounded float operations, an exp of
// fused multiply-adds only). Log-probs agree to fp32 rounding. A session's draws depend on its
// seed and the index of the token only, never on the rows batched with it. The logits of a
// forward differ between host and GPU (and between batch shapes) by rounding, so whole sessions
// agree token for token only while no draw lands on a boundary that rounding moves.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "cellkv/batching/philox.hpp"
#include "cellkv/host_device.hpp"

namespace cellkv::batching {

// A session's sampling, as given to SessionTable::add (checked there against the vocabulary).
struct SamplingParams {
  float temperature = 0.f;  // >= 0 and finite; 0: greedy
  std::int32_t top_k = 0;   // >= 0; 0: off (so is top_k >= vocab); 1: greedy
  float top_p = 1.f;        // in (0, 1]; 1: off
  float min_p = 0.f;        // in [0, 1]; 0: off
  std::uint64_t seed = 0;   // the session's stream; draw n is philox_draw(seed, n)
  std::vector<std::int32_t> stop_tokens{};  // ids in [0, vocab): a session ends after sampling one
  bool logprobs = false;    // also return each generated token's log-probability
  friend bool operator==(const SamplingParams&, const SamplingParams&) = default;
};

inline constexpr std::uint32_t kWantLogprob = 1u;

// One logit row's sampling, ready for a kernel (trivially copyable, 32 bytes).
struct SampleRow {
  std::uint64_t seed = 0;
  std::uint32_t counter = 0;   // the index, in its session's output, of the token drawn
  std::int32_t top_k = 0;      // 0: off
  float inv_temperature = 0.f; // 0: greedy
  float top_p = 1.f;           // >= 1: off
  float min_p_offset = -std::numeric_limits<float>::infinity();  // temperature * ln(min_p); -inf: off
  std::uint32_t flags = 0;     // kWantLogprob
  friend bool operator==(const SampleRow&, const SampleRow&) = default;
};
static_assert(sizeof(SampleRow) == 32);

// The token drawn for one row and, when asked, its log-probability.
struct Sampled {
  std::int32_t token = 0;
  float logprob = 0.f;
  friend bool operator==(const Sampled&, const Sampled&) = default;
};

// The SampleRow of a session's token number `counter`. Greedy when temperature is 0, top_k is 1,
// or 1 / temperature is not finite.
inline SampleRow make_sample_row(const SamplingParams& p, std::uint32_t counter) {
  SampleRow r;
  r.seed = p.seed;
  r.counter = counter;
  r.top_k = p.top_k;
  const float inv = p.temperature > 0.f ? 1.f / p.temperature : 0.f;
  r.inv_temperature = p.top_k == 1 || !std::isfinite(inv) ? 0.f : inv;
  r.top_p = p.top_p;
  if (p.min_p > 0.f) r.min_p_offset = p.temperature * std::log(p.min_p);
  r.flags = p.logprobs ? kWantLogprob : 0u;
  return r;
}

// ---- the pieces host and device share ----
namespace sampling {

// Masses are zero below exp(-kMassCutoff) (< 2^-31 of the largest).
inline constexpr float kMassCutoff = 23.f;
inline constexpr float kMassScale = 2147483648.f;  // 2^31: the mass of the largest logit

// Explicitly rounded float operations: no contraction, no fast-math, on either side.
CELLKV_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
CELLKV_HOST_DEVICE inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
CELLKV_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
CELLKV_HOST_DEVICE inline float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
CELLKV_HOST_DEVICE inline float rint_rn(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // round half to even, as rintf on the device
#endif
}
CELLKV_HOST_DEVICE inline std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(__float_as_uint(x));
#else
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}
CELLKV_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x = 0.f;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// A key whose unsigned order is the order of the floats: -0 maps to +0's key, NaN to 0 (below -inf).
CELLKV_HOST_DEVICE inline std::uint32_t order_key(float x) {
  std::uint32_t u = float_bits(x);
  if (u == 0x80000000u) u = 0u;
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN
  return (u & 0x80000000u) != 0u ? ~u : u | 0x80000000u;
}

// (order_key, 2^32 - 1 - index): unique per candidate, larger = ranked first.
CELLKV_HOST_DEVICE inline std::uint64_t rank_key(std::uint32_t key, std::int32_t index) {
  return (static_cast<std::uint64_t>(key) << 32) | (0xffffffffu - static_cast<std::uint32_t>(index));
}

// exp(x) for x in [-kMassCutoff, 0], from fused multiply-adds and exact scalings only, so that it
// is the same function on every IEEE machine (relative error about 1e-7; exactly 1 at 0).
CELLKV_HOST_DEVICE inline float exp_det(float x) {
  const float k = rint_rn(mul_rn(x, 1.44269504f));
  float r = fma_rn(k, -0.693145751953125f, x);  // Cody-Waite: ln 2 split in a high part exact in k * hi
  r = fma_rn(k, -1.42860677e-6f, r);
  float p = 1.f / 5040.f;
  p = fma_rn(p, r, 1.f / 720.f);
  p = fma_rn(p, r, 1.f / 120.f);
  p = fma_rn(p, r, 1.f / 24.f);
  p = fma_rn(p, r, 1.f / 6.f);
  p = fma_rn(p, r, 0.5f);
  p = fma_rn(p, r, 1.f);
  p = fma_rn(p, r, 1.f);
  const std::uint32_t scale = static_cast<std::uint32_t>(static_cast<std::int32_t>(k) + 127) << 23;  // 2^k, k >= -34
  return mul_rn(p, bits_float(scale));
}

// The integer mass of a logit l against the row's largest lmax (see the file comment).
CELLKV_HOST_DEVICE inline std::uint32_t mass_of(float l, float lmax, float inv_temperature) {
  const float x = mul_rn(sub_rn(l, lmax), inv_temperature);
  if (!(x >= -kMassCutoff)) return 0u;  // NaN too
  const float m = mul_rn(exp_det(x > 0.f ? 0.f : x), kMassScale);
  return m >= kMassScale ? 0x80000000u : static_cast<std::uint32_t>(m);
}

// floor(total * r / 2^32) for total < 2^48: the draw's target in [0, total).
CELLKV_HOST_DEVICE inline std::uint64_t scale_draw(std::uint64_t total, std::uint32_t r) {
  return (total >> 32) * r + (((total & 0xffffffffull) * r) >> 32);
}

// ceil(top_p * w_k): the mass a top-p prefix must reach (one rounded double product).
CELLKV_HOST_DEVICE inline std::uint64_t top_p_target(float top_p, std::uint64_t w_k) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(ceil(__dmul_rn(static_cast<double>(top_p), static_cast<double>(w_k))));
#else
  return static_cast<std::uint64_t>(std::ceil(static_cast<double>(top_p) * static_cast<double>(w_k)));
#endif
}

// The min-p threshold's rank key: every candidate whose logit is >= lmax + offset.
CELLKV_HOST_DEVICE inline std::uint64_t min_p_bound(float lmax, float offset) {
  return static_cast<std::uint64_t>(order_key(add_rn(lmax, offset))) << 32;
}

CELLKV_HOST_DEVICE inline bool greedy(const SampleRow& row, float lmax) {
  return row.inv_temperature == 0.f || !(lmax < std::numeric_limits<float>::infinity()) ||
         !(lmax > -std::numeric_limits<float>::infinity());
}

}  // namespace sampling

// The greedy choice: the index of the largest logit, the lowest index on a tie (equal to
// std::max_element for logits without NaN; -0 and +0 tie).
inline std::int32_t argmax(std::span<const float> logits) {
  std::int32_t best = 0;
  std::uint32_t best_key = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const std::uint32_t k = sampling::order_key(logits[i]);
    if (i == 0 || k > best_key) {
      best_key = k;
      best = static_cast<std::int32_t>(i);
    }
  }
  return best;
}

// log softmax of the raw logits at `token`, in fp32 (the log-prob the samplers return).
inline float log_softmax_at(std::span<const float> logits, std::int32_t token, float lmax) {
  float sum = 0.f;
  for (const float l : logits) sum += std::exp(l - lmax);
  return logits[static_cast<std::size_t>(token)] - lmax - std::log(sum);
}

// The rule of the file comment, on the host: the token drawn for one row of logits (a non-empty
// span) and, when row.flags asks, its log-probability.
inline Sampled sample_row(std::span<const float> logits, const SampleRow& row) {
  using namespace sampling;
  const auto n = static_cast<std::int32_t>(logits.size());
  Sampled out;
  out.token = argmax(logits);
  const float lmax = logits[static_cast<std::size_t>(out.token)];
  if (!greedy(row, lmax)) {
    std::vector<std::uint64_t> ck(logits.size());
    std::vector<std::uint32_t> mass(logits.size());
    for (std::int32_t i = 0; i < n; ++i) {
      const float l = logits[static_cast<std::size_t>(i)];
      ck[static_cast<std::size_t>(i)] = rank_key(order_key(l), i);
      mass[static_cast<std::size_t>(i)] = mass_of(l, lmax, row.inv_temperature);
    }
    std::vector<std::int32_t> ranked(logits.size());
    for (std::int32_t i = 0; i < n; ++i) ranked[static_cast<std::size_t>(i)] = i;
    std::sort(ranked.begin(), ranked.end(), [&](std::int32_t a, std::int32_t b) {
      return ck[static_cast<std::size_t>(a)] > ck[static_cast<std::size_t>(b)];
    });
    const std::int32_t k = row.top_k > 0 && row.top_k < n ? row.top_k : n;
    std::uint64_t bound = k < n ? ck[static_cast<std::size_t>(ranked[static_cast<std::size_t>(k - 1)])] : 0u;
    if (row.top_p < 1.f) {
      std::uint64_t w_k = 0;
      for (std::int32_t j = 0; j < k; ++j) w_k += mass[static_cast<std::size_t>(ranked[static_cast<std::size_t>(j)])];
      const std::uint64_t target = top_p_target(row.top_p, w_k);
      std::uint64_t run = 0;
      for (std::int32_t j = 0; j < k; ++j) {
        const auto i = static_cast<std::size_t>(ranked[static_cast<std::size_t>(j)]);
        run += mass[i];
        if (run >= target) {
          bound = std::max(bound, ck[i]);
          break;
        }
      }
    }
    if (row.min_p_offset > -std::numeric_limits<float>::infinity())
      bound = std::max(bound, min_p_bound(lmax, row.min_p_offset));
    std::uint64_t kept = 0;
    for (std::int32_t i = 0; i < n; ++i)
      if (ck[static_cast<std::size_t>(i)] >= bound) kept += mass[static_cast<std::size_t>(i)];
    const std::uint64_t target = scale_draw(kept, philox_draw(row.seed, row.counter));
    std::uint64_t run = 0;
    for (std::int32_t i = 0; i < n; ++i) {
      if (ck[static_cast<std::size_t>(i)] < bound) continue;
      run += mass[static_cast<std::size_t>(i)];
      if (run > target) {
        out.token = i;
        break;
      }
    }
  }
  if ((row.flags & kWantLogprob) != 0u) out.logprob = log_softmax_at(logits, out.token, lmax);
  return out;
}

}  // namespace cellkv::batching
