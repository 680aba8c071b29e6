// cellkv/rope.hpp - re-rotating K after seq_add / seq_div moved cells: the RoPE a model applied to
// its keys, described so cellkv can move a key from the position it was computed at to a new one.
//
// RoPE rotates pairs of a head's first `rotary_dims` elements: pair i, of elements (a, b), by the
// angle p * f_i at position p, (x_a, x_b) -> (x_a cos - x_b sin, x_a sin + x_b cos). Rotations
// compose, so a key computed at old_pos is moved to new_pos by the angle (new_pos - old_pos) * f_i:
// no model weights, no recomputation. Pairs:
//   half_split   (i, i + r/2)   Llama/NeoX as most checkpoints store them
//   interleaved  (2i, 2i + 1)   GPT-J, the original RoPE
// Frequencies, r = rotary_dims: f_i = theta^(-2i / r), and with scaling
//   linear  positions divided by `factor`        f_i / factor
//   ntk     base stretched by factor^(r/(r-2))  (theta factor^(r/(r-2)))^(-2i / r)
// The angle and its sine and cosine are computed in double, each element rounded once.
// Other schemes (YaRN, per-layer variants) take a caller kernel (gpu::KeyRotation::custom).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>

#include "cellkv/host_device.hpp"
#include "cellkv/pool_view.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv {

enum class RopePairs : std::uint8_t { half_split, interleaved };
enum class RopeScaling : std::uint8_t { none, linear, ntk };

struct RopeSpec {
  double theta = 10000.0;
  std::int32_t rotary_dims = 0;  // leading elements of each head that rotate (even); 0: the whole head
  RopePairs pairs = RopePairs::half_split;
  RopeScaling scaling = RopeScaling::none;
  double factor = 1.0;  // linear / ntk scaling factor (ignored without scaling)

  // Rotary dims of a head of head_dim elements.
  [[nodiscard]] CELLKV_HOST_DEVICE constexpr std::int32_t dims(std::int32_t head_dim) const noexcept {
    return rotary_dims == 0 ? head_dim : rotary_dims;
  }
};

// bad_argument unless theta > 1 and finite, dims(head_dim) even in [2, head_dim], and with scaling
// a finite factor >= 1 (an ntk scaling also needs dims >= 4).
[[nodiscard]] inline Status check_rope(const RopeSpec& s, std::int32_t head_dim) noexcept {
  const std::int32_t r = s.dims(head_dim);
  if (!(s.theta > 1.0) || !std::isfinite(s.theta)) return Errc::bad_argument;
  if (head_dim < 2 || r < 2 || r > head_dim || r % 2 != 0) return Errc::bad_argument;
  if (s.scaling != RopeScaling::none && (!(s.factor >= 1.0) || !std::isfinite(s.factor))) return Errc::bad_argument;
  if (s.scaling == RopeScaling::ntk && r < 4) return Errc::bad_argument;
  return {};
}

// Radians per position of pair i (0 <= i < r / 2); s passed check_rope.
[[nodiscard]] CELLKV_HOST_DEVICE inline double rope_frequency(const RopeSpec& s, std::int32_t head_dim, std::int32_t i) {
  const double r = s.dims(head_dim);
  const double base = s.scaling == RopeScaling::ntk ? s.theta * pow(s.factor, r / (r - 2.0)) : s.theta;
  const double f = pow(base, -2.0 * i / r);
  return s.scaling == RopeScaling::linear ? f / s.factor : f;
}

// The elements (a, b) of pair i.
CELLKV_HOST_DEVICE inline void rope_elements(const RopeSpec& s, std::int32_t head_dim, std::int32_t i, std::int32_t& a,
                                             std::int32_t& b) {
  if (s.pairs == RopePairs::interleaved) {
    a = 2 * i, b = 2 * i + 1;
  } else {
    a = i, b = i + s.dims(head_dim) / 2;
  }
}

// (x_a, x_b) rotated by `angle` radians.
CELLKV_HOST_DEVICE inline void rotate_pair(double& xa, double& xb, double angle) {
  const double c = cos(angle), sn = sin(angle);
  const double a = xa * c - xb * sn, b = xa * sn + xb * c;
  xa = a, xb = b;
}

// Host: re-rotates the K rows of one layer's pool named by `rotations` (RowRotation{cell, old_pos,
// new_pos}), every KV head. T converts to and from double (float, double). The device does the same
// per layer in gpu::KeyRotation.
template <class T>
void rerotate_keys(const PoolView<T>& pool, std::span<const RowRotation> rotations, const RopeSpec& s) {
  const std::int32_t pairs = s.dims(pool.head_dim) / 2;
  for (const RowRotation& r : rotations)
    for (std::int32_t h = 0; h < pool.heads_kv; ++h) {
      T* head = pool.k + pool.offset(r.cell, h);
      for (std::int32_t i = 0; i < pairs; ++i) {
        std::int32_t a = 0, b = 0;
        rope_elements(s, pool.head_dim, i, a, b);
        double xa = static_cast<double>(head[a]), xb = static_cast<double>(head[b]);
        rotate_pair(xa, xb, static_cast<double>(r.new_pos - r.old_pos) * rope_frequency(s, pool.head_dim, i));
        head[a] = static_cast<T>(xa), head[b] = static_cast<T>(xb);
      }
    }
}

}  // namespace cellkv
