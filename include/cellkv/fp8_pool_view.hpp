// cellkv/fp8_pool_view.hpp - a non-owning, trivially copyable view of one layer's fp8 K and V
// pool: the codes, their scales beside them, and how the layer's writes scale (fp8.hpp).
//
// Codes: K and V each [rows, heads_kv, head_dim] E4M3 codes, row-major, as PoolView's elements
// (a row is heads_kv x head_dim bytes, so rows stay 16-byte aligned for head_dim % 16 == 0).
// Scales: K and V each [rows, heads_kv] fp32, one per row-head, in arrays of their own (not
// interleaved with the rows). Element (row, head, d) reads decode(k[offset(row, head) + d]) x
// k_scale[scale_offset(row, head)]. Every write stores a scale, whatever the scaling: per_row
// writes the row-head's amax / 448, static_per_layer writes the layer's calibrated scale, so a
// reader never needs to know which.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cellkv/fp8.hpp"
#include "cellkv/host_device.hpp"

namespace cellkv {

// Code is Fp8E4M3 (a view that writes) or const Fp8E4M3 (one that only reads).
template <class Code>
struct Fp8PoolView {
  static_assert(std::is_same_v<std::remove_const_t<Code>, Fp8E4M3>, "Fp8PoolView holds E4M3 codes");
  using Scale = std::conditional_t<std::is_const_v<Code>, const float, float>;

  Code* k = nullptr;
  Code* v = nullptr;
  Scale* k_scale = nullptr;
  Scale* v_scale = nullptr;
  std::int64_t rows = 0;
  std::int32_t heads_kv = 0;
  std::int32_t head_dim = 0;
  Fp8Scaling scaling = Fp8Scaling::per_row;
  Fp8LayerScales static_scales{};  // the layer's scales when scaling is static_per_layer

  // Codes per row: heads_kv * head_dim.
  CELLKV_HOST_DEVICE constexpr std::int64_t row_elems() const noexcept {
    return static_cast<std::int64_t>(heads_kv) * head_dim;
  }
  // Offset of (row, head, 0) in k or v.
  CELLKV_HOST_DEVICE constexpr std::int64_t offset(std::int64_t row, std::int32_t head) const noexcept {
    return row * row_elems() + static_cast<std::int64_t>(head) * head_dim;
  }
  // Offset of (row, head) in k_scale or v_scale.
  CELLKV_HOST_DEVICE constexpr std::int64_t scale_offset(std::int64_t row, std::int32_t head) const noexcept {
    return row * heads_kv + head;
  }
  // The scale a write passes to quantize_row_head for K (v: false) or V (v: true): the layer's
  // static scale, or 0 for per-row scaling.
  CELLKV_HOST_DEVICE constexpr float write_scale(bool of_v) const noexcept {
    if (scaling != Fp8Scaling::static_per_layer) return 0.0f;
    return of_v ? static_scales.v : static_scales.k;
  }
  // The same view, read-only.
  CELLKV_HOST_DEVICE constexpr Fp8PoolView<const Fp8E4M3> read_only() const noexcept {
    return {k, v, k_scale, v_scale, rows, heads_kv, head_dim, scaling, static_scales};
  }
};

}  // namespace cellkv
