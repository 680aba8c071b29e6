// cellkv/fp8.hpp - the fp8 KV storage format: OCP FP8 E4M3FN codes, their conversion to and from
// float, and the scaling of one row-head (docs/design.md section 5, "fp8 KV cache").
//
// E4M3FN: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; 0x7F and 0xFF are
// NaN; the largest finite magnitude is 448 (code 0x7E); subnormals are m x 2^-9 (exponent field
// 0), normals (1 + m / 8) x 2^(e - 7).
//
// A row-head is the D elements of one KV head of one pool row. It is stored as D codes and one
// fp32 scale: x ~= decode(code) x scale. With per-row scaling (the default, no calibration) the
// scale is amax / 448, amax the largest finite |x| of the row-head, computed when the row is
// written; with static per-layer scaling it is a scale the caller calibrated, the same for every
// row-head of a layer's K (or V).
//
// The conversion and row-head functions are CELLKV_HOST_DEVICE: the host reference and the device
// write and attention kernels use the same code, so a host-quantized row equals a device one.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cellkv/host_device.hpp"
#include "cellkv/status.hpp"

namespace cellkv {

// One E4M3FN code. A struct, not a bare byte, so a pool of codes cannot be mistaken for a pool of
// bytes of another meaning. Trivial (no initializer): arrays of it may live in shared memory.
struct Fp8E4M3 {
  std::uint8_t code;
  friend constexpr bool operator==(Fp8E4M3, Fp8E4M3) = default;
};
static_assert(sizeof(Fp8E4M3) == 1 && alignof(Fp8E4M3) == 1 && std::is_trivial_v<Fp8E4M3> &&
              std::is_trivially_copyable_v<Fp8E4M3>);

inline constexpr float kFp8E4M3Max = 448.0f;         // the largest finite magnitude
inline constexpr std::uint8_t kFp8E4M3MaxCode = 0x7E;  // +448; 0xFE is -448
inline constexpr std::uint8_t kFp8E4M3NaN = 0x7F;      // the NaN encode_e4m3 writes (0xFF is NaN too)

namespace detail {
CELLKV_HOST_DEVICE inline std::uint32_t float_bits(float x) noexcept {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}
CELLKV_HOST_DEVICE inline float bits_float(std::uint32_t b) noexcept {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return std::bit_cast<float>(b);
#endif
}
// Rounds q + rem / 2^shift to the nearest integer, ties to even q (shift in [1, 31]).
CELLKV_HOST_DEVICE inline std::uint32_t round_shifted(std::uint32_t q, std::uint32_t rem, std::uint32_t shift) noexcept {
  const std::uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u) != 0)) ? 1u : 0u);
}
}  // namespace detail

// The value of a code: exact in float (every E4M3 value is). 0x7F and 0xFF give a quiet NaN.
CELLKV_HOST_DEVICE inline float decode_e4m3(std::uint8_t code) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80u) << 24;
  const std::uint32_t e = (code >> 3) & 0xFu, m = code & 0x7u;
  if (e == 0xFu && m == 0x7u) return detail::bits_float(sign | 0x7FC00000u);
  if (e == 0) {  // subnormal or zero: m x 2^-9, exact in float
    const float mag = static_cast<float>(m) * 0.001953125f;
    return sign != 0 ? -mag : mag;
  }
  return detail::bits_float(sign | ((e + 120u) << 23) | (m << 20));  // float exponent e - 7 + 127
}

// The code nearest x, ties to the even mantissa (round to nearest even). Saturating: every finite
// |x| > 448 and +-inf give +-448 (never NaN from inf). NaN gives 0x7F (whatever its sign). The
// sign is kept on zeros and on values that round to zero (-0 and -1e-9 give 0x80).
CELLKV_HOST_DEVICE inline std::uint8_t encode_e4m3(float x) noexcept {
  const std::uint32_t bits = detail::float_bits(x);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  const std::uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return kFp8E4M3NaN;
  if (mag >= 0x43E00000u) return static_cast<std::uint8_t>(sign | kFp8E4M3MaxCode);  // >= 448, inf
  const std::uint32_t fexp = mag >> 23;  // biased float exponent; below 448 it is at most 135
  if (fexp == 0) return sign;            // a float subnormal is far below 2^-10: rounds to 0
  const std::uint32_t mant = mag & 0x7FFFFFu;
  std::uint32_t code;
  if (fexp >= 121) {  // |x| >= 2^-6: normal. Keep 3 of 23 mantissa bits; a carry steps the exponent.
    const std::uint32_t q = ((fexp - 120u) << 3) | (mant >> 20);
    code = detail::round_shifted(q, mant & 0xFFFFFu, 20);
  } else {  // |x| < 2^-6: subnormal code m = round(|x| x 2^9) in [0, 8]; 8 is 2^-6, code 0x08.
    const std::uint32_t shift = 141u - fexp;  // |x| x 2^9 = (2^23 + mant) / 2^shift, shift >= 21
    if (shift > 24) return sign;             // |x| < 2^-10: below half of 2^-9, rounds to 0
    const std::uint32_t full = 0x800000u | mant;
    code = detail::round_shifted(full >> shift, full & ((1u << shift) - 1u), shift);
  }
  return static_cast<std::uint8_t>(sign | (code > kFp8E4M3MaxCode ? kFp8E4M3MaxCode : code));
}

CELLKV_HOST_DEVICE inline Fp8E4M3 to_e4m3(float x) noexcept { return Fp8E4M3{encode_e4m3(x)}; }
CELLKV_HOST_DEVICE inline float to_float(Fp8E4M3 q) noexcept { return decode_e4m3(q.code); }

// ---- scaling ----------------------------------------------------------------------------------

// How a pool's row-heads get their scales.
enum class Fp8Scaling : std::uint8_t {
  per_row,           // amax / 448 of the row-head, computed at write time (no calibration)
  static_per_layer,  // the caller's calibrated scale of the layer's K and of its V
};

// A layer's calibrated scales (static_per_layer). Each must be finite and > 0.
struct Fp8LayerScales {
  float k = 1.0f;
  float v = 1.0f;
  friend constexpr bool operator==(const Fp8LayerScales&, const Fp8LayerScales&) = default;
};

// The scaling of an fp8 pool. static_scales holds one entry per layer when scaling is
// static_per_layer and is ignored (may be empty) for per_row.
struct Fp8Config {
  Fp8Scaling scaling = Fp8Scaling::per_row;
  std::vector<Fp8LayerScales> static_scales;
};

// A scale a caller may set: finite and > 0 (so neither 0, negative, inf nor NaN).
constexpr bool valid_static_scale(float s) noexcept { return s > 0.0f && s <= 3.40282347e38f; }

// Refuses (bad_argument) an unknown scaling, a static_per_layer config whose static_scales does not
// hold exactly `layers` entries, or any of its scales that is not valid_static_scale.
inline Status check_fp8_config(const Fp8Config& config, std::int32_t layers) noexcept {
  if (config.scaling == Fp8Scaling::per_row) return {};
  if (config.scaling != Fp8Scaling::static_per_layer) return Errc::bad_argument;
  if (layers < 0 || config.static_scales.size() != static_cast<std::size_t>(layers)) return Errc::bad_argument;
  for (const Fp8LayerScales& s : config.static_scales)
    if (!valid_static_scale(s.k) || !valid_static_scale(s.v)) return Errc::bad_argument;
  return {};
}

// The largest finite |x[d]| over d in [0, D); inf and NaN do not count; 0 when none is finite.
// T is anything that converts to float (float, double, and on the device __half / __nv_bfloat16).
template <class T>
CELLKV_HOST_DEVICE float row_head_amax(const T* x, std::int32_t D) noexcept {
  std::uint32_t amax = 0;  // the bits of a non-negative float order as its value
  for (std::int32_t d = 0; d < D; ++d) {
    const std::uint32_t mag = detail::float_bits(static_cast<float>(x[d])) & 0x7FFFFFFFu;
    if (mag < 0x7F800000u && mag > amax) amax = mag;
  }
  return detail::bits_float(amax);
}

// The per-row scale of a row-head of finite amax `amax`: amax / 448 (0 when amax is 0, or so small
// that amax / 448 underflows). Always finite: 448 x scale never overflows float.
CELLKV_HOST_DEVICE inline float per_row_scale(float amax) noexcept { return amax / kFp8E4M3Max; }

// The code of x under `scale`: encode(x / scale) for scale > 0. For scale == 0 (a per-row scale
// whose row-head has no finite value other than zero, or an amax that underflowed) the code is
// encode(x) itself: +-0 and the tiny finite values give +-0, +-inf gives +-448, NaN gives NaN,
// all of which decode x 0 back to +-0, except NaN.
CELLKV_HOST_DEVICE inline std::uint8_t quantize_e4m3(float x, float scale) noexcept {
  return encode_e4m3(scale > 0.0f ? x / scale : x);
}

// Quantizes the row-head x[0, D) into q[0, D) and returns the scale to store beside it.
// static_scale == 0: per-row scaling (scale = per_row_scale(row_head_amax(x))); static_scale > 0: that
// scale (the caller has checked it with valid_static_scale).
//
// Non-finite input: +-inf is stored as +-448 (it decodes to +-448 x scale, the row-head's largest
// finite magnitude under per-row scaling, or 0 if it has none); NaN is stored as the NaN code and
// decodes to NaN. Neither changes the scale (amax counts finite values only), so the row-head's
// finite values keep their accuracy, and no other row-head is touched: scales are per row-head.
template <class T>
CELLKV_HOST_DEVICE float quantize_row_head(const T* x, std::int32_t D, float static_scale, Fp8E4M3* q) noexcept {
  const float scale = static_scale > 0.0f ? static_scale : per_row_scale(row_head_amax(x, D));
  for (std::int32_t d = 0; d < D; ++d) q[d] = Fp8E4M3{quantize_e4m3(static_cast<float>(x[d]), scale)};
  return scale;
}

// out[d] = decode(q[d]) x scale for d in [0, D), computed in Acc (float on the device: one
// rounding; double on the host reference: exact).
template <class Acc>
CELLKV_HOST_DEVICE void dequantize_row_head(const Fp8E4M3* q, std::int32_t D, float scale, Acc* out) noexcept {
  for (std::int32_t d = 0; d < D; ++d) out[d] = static_cast<Acc>(decode_e4m3(q[d].code)) * static_cast<Acc>(scale);
}

}  // namespace cellkv
