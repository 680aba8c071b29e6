// The fp8 (E4M3FN) KV format (fp8.hpp) against independent oracles: decode of every code against
// the format's formula in double; encode against a brute-force search over every finite code
// (nearest by value, ties to the even mantissa) on a dense sweep of floats; row-head scaling against
// amax / 448 and the same oracle; the special values (+-0, subnormals, saturation, inf, NaN); the
// static-scale refusals; the host fp8 pool's copies; and the reference's fp8 write and attend
// against the double reference over values the oracle quantized, with forks, in both layouts.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "cellkv/fp8.hpp"
#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/reference.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The value of code c from the format's definition: sign, exponent field e (bias 7), mantissa m;
// e == 0: m / 8 x 2^-6; else (1 + m / 8) x 2^(e - 7); e == 15 and m == 7: NaN.
double formula(std::uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (c & 0x80) != 0 ? -mag : mag;
}

// Brute force: the finite code nearest x by value (ties: the even mantissa, i.e. the even code),
// the sign of x on it; +-inf: +-448 (saturation); NaN: 0x7F.
std::uint8_t oracle_encode(float x) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int c = 0; c <= 0x7E; ++c) v.push_back(formula(static_cast<std::uint8_t>(c)));
    return v;
  }();
  if (std::isnan(x)) return 0x7F;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isinf(x)) return sign | 0x7E;
  const double a = std::fabs(static_cast<double>(x));
  int best = -1;
  double best_d = kInf;
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(values[static_cast<std::size_t>(c)] - a);
    if (d < best_d || (d == best_d && c % 2 == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

// The floats the encode sweep checks: every code's value and its float neighbours, every midpoint
// of adjacent codes and its neighbours, values past 448, every 1999th float bit pattern over the
// whole finite range, the negatives of all of these, and the specials.
std::vector<float> sweep() {
  std::vector<float> xs;
  const auto around = [&](float x) {
    xs.push_back(x);
    xs.push_back(std::nextafter(x, 0.0f));
    xs.push_back(std::nextafter(x, FLT_MAX));
  };
  for (int c = 0; c <= 0x7E; ++c) {
    around(static_cast<float>(formula(static_cast<std::uint8_t>(c))));
    around(static_cast<float>((formula(static_cast<std::uint8_t>(c)) + formula(static_cast<std::uint8_t>(c + 1))) / 2));
  }
  for (const float x : {464.0f, 480.0f, 500.0f, 1e4f, 1e20f, FLT_MAX, 0x1p-10f, 0x1p-11f,
                        0x1p-12f, 0x1p-126f, 0x1p-149f, FLT_MIN})
    around(x);
  for (std::uint32_t b = 0; b < 0x7F800000u; b += 1999) xs.push_back(std::bit_cast<float>(b));
  const std::size_t n = xs.size();
  for (std::size_t i = 0; i < n; ++i) xs.push_back(-xs[i]);
  for (const float x : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), kNaN, -kNaN,
                        std::bit_cast<float>(0x7F800001u), std::bit_cast<float>(0xFFFFFFFFu)})
    xs.push_back(x);
  return xs;
}

bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b)); }

}  // namespace

TEST_CASE("fp8 decode: every one of the 256 codes against the format's formula") {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    CAPTURE(c);
    const float got = decode_e4m3(static_cast<std::uint8_t>(c));
    CHECK(same_value(got, formula(static_cast<std::uint8_t>(c))));
    nans += std::isnan(got) ? 1 : 0;
  }
  CHECK(nans == 2);  // 0x7F and 0xFF only
  CHECK(decode_e4m3(0x7E) == 448.0f);
  CHECK(decode_e4m3(0xFE) == -448.0f);
  CHECK(decode_e4m3(0x01) == 0x1p-9f);  // the smallest subnormal
  CHECK(decode_e4m3(0x08) == 0x1p-6f);  // the smallest normal
  CHECK(std::signbit(decode_e4m3(0x80)));
  CHECK(to_float(Fp8E4M3{0x38}) == 1.0f);
}

TEST_CASE("fp8 encode: round to nearest even and saturation against a brute-force search of every code") {
  const std::vector<float> xs = sweep();
  REQUIRE(xs.size() > 2'000'000);
  std::size_t failures = 0;
  for (const float x : xs) {
    const std::uint8_t got = encode_e4m3(x), want = oracle_encode(x);
    if (got != want && failures++ < 10) {
      CAPTURE(x);
      CHECK(int{got} == int{want});
    }
  }
  CHECK(failures == 0);
}

TEST_CASE("fp8 encode: the special values and the boundaries") {
  CHECK(encode_e4m3(0.0f) == 0x00);
  CHECK(encode_e4m3(-0.0f) == 0x80);
  CHECK(encode_e4m3(-1e-9f) == 0x80);  // rounds to zero, keeps the sign
  CHECK(encode_e4m3(0x1p-10f) == 0x00);                        // half the smallest subnormal: ties to 0
  CHECK(encode_e4m3(std::nextafter(0x1p-10f, 1.0f)) == 0x01);  // just above: the smallest subnormal
  CHECK(encode_e4m3(3 * 0x1p-10f) == 0x02);                    // between subnormals 1 and 2: ties to even 2
  CHECK(encode_e4m3(15 * 0x1p-10f) == 0x08);                   // between 7 x 2^-9 and 2^-6: ties to 0x08
  CHECK(encode_e4m3(1.0625f) == 0x38);                         // between 1 and 1.125: ties to even 1
  CHECK(encode_e4m3(1.1875f) == 0x3A);                         // between 1.125 and 1.25: ties to even 1.25
  CHECK(encode_e4m3(15.5f) == 0x58);                           // between 15 and 16: carries into the exponent
  CHECK(encode_e4m3(448.0f) == 0x7E);
  CHECK(encode_e4m3(464.0f) == 0x7E);  // saturates (no code above 448)
  CHECK(encode_e4m3(1e30f) == 0x7E);
  CHECK(encode_e4m3(-FLT_MAX) == 0xFE);
  CHECK(encode_e4m3(std::numeric_limits<float>::infinity()) == 0x7E);   // never NaN from inf
  CHECK(encode_e4m3(-std::numeric_limits<float>::infinity()) == 0xFE);
  CHECK(encode_e4m3(kNaN) == 0x7F);
  CHECK(encode_e4m3(-kNaN) == 0x7F);
  CHECK(to_e4m3(2.0f) == Fp8E4M3{0x40});
  // Every finite code survives a round trip.
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7F) != 0x7F) CHECK(int{encode_e4m3(decode_e4m3(static_cast<std::uint8_t>(c)))} == c);
}

TEST_CASE("fp8 row-head: per-row scale amax / 448, codes of x / scale, dequantized x decode x scale") {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const float magnitude : {1e-30f, 1e-3f, 1.0f, 30.0f, 1e30f}) {
    CAPTURE(magnitude);
    std::vector<float> x(128);
    for (float& e : x) e = normal(rng) * magnitude;
    x[17] = 0.0f;
    x[18] = -0.0f;
    float amax = 0;
    for (const float e : x) amax = std::max(amax, std::fabs(e));
    std::vector<Fp8E4M3> q(x.size());
    const float scale = quantize_row_head(x.data(), 128, 0.0f, q.data());
    CHECK(scale == amax / 448.0f);
    std::vector<double> back(x.size());
    dequantize_row_head(q.data(), 128, scale, back.data());
    for (std::size_t d = 0; d < x.size(); ++d) {
      CAPTURE(d);
      CHECK(int{q[d].code} == int{oracle_encode(x[d] / scale)});
      CHECK(back[d] == formula(oracle_encode(x[d] / scale)) * static_cast<double>(scale));
      if (std::fabs(x[d]) == amax) CHECK((q[d].code & 0x7F) == 0x7E);  // amax maps to +-448
      // Relative error at most 2^-4 for normals; absolute at most 2^-10 x scale below 2^-6 x scale.
      CHECK(std::fabs(back[d] - x[d]) <= std::max(std::fabs(static_cast<double>(x[d])) / 16, 0x1p-10 * scale) * 1.000001);
    }
    // The float dequantization (the device's) is within one float rounding of the exact one.
    std::vector<float> back_f(x.size());
    dequantize_row_head(q.data(), 128, scale, back_f.data());
    for (std::size_t d = 0; d < x.size(); ++d)
      CHECK(back_f[d] == static_cast<float>(back[d]));
  }
}

TEST_CASE("fp8 row-head: zeros, inf and NaN give the documented codes and touch nothing else") {
  std::vector<Fp8E4M3> q(4, Fp8E4M3{0x55});
  SUBCASE("all zeros: scale 0, every code +-0, decoded zeros") {
    const std::vector<float> x{0.0f, -0.0f, 0.0f, 0.0f};
    CHECK(quantize_row_head(x.data(), 4, 0.0f, q.data()) == 0.0f);
    CHECK(q == std::vector<Fp8E4M3>{{0x00}, {0x80}, {0x00}, {0x00}});
    std::vector<float> back(4, 1.0f);
    dequantize_row_head(q.data(), 4, 0.0f, back.data());
    CHECK(back == std::vector<float>(4, 0.0f));
  }
  SUBCASE("inf and NaN do not count towards amax: inf saturates to +-amax, NaN stays NaN") {
    const std::vector<float> x{2.0f, std::numeric_limits<float>::infinity(), kNaN, -std::numeric_limits<float>::infinity()};
    const float scale = quantize_row_head(x.data(), 4, 0.0f, q.data());
    CHECK(scale == 2.0f / 448.0f);
    CHECK(q == std::vector<Fp8E4M3>{{0x7E}, {0x7E}, {0x7F}, {0xFE}});
    std::vector<double> back(4);
    dequantize_row_head(q.data(), 4, scale, back.data());
    CHECK(back[0] == doctest::Approx(2.0).epsilon(1e-6));
    CHECK(back[1] == back[0]);
    CHECK(std::isnan(back[2]));
    CHECK(back[3] == -back[0]);
  }
  SUBCASE("no finite value but zero: scale 0; inf decodes to 0, NaN to NaN") {
    const std::vector<float> x{std::numeric_limits<float>::infinity(), kNaN, 0.0f, -std::numeric_limits<float>::infinity()};
    CHECK(quantize_row_head(x.data(), 4, 0.0f, q.data()) == 0.0f);
    CHECK(q == std::vector<Fp8E4M3>{{0x7E}, {0x7F}, {0x00}, {0xFE}});
    std::vector<float> back(4);
    dequantize_row_head(q.data(), 4, 0.0f, back.data());
    CHECK(back[0] == 0.0f);
    CHECK(std::isnan(back[1]));
    CHECK(back[2] == 0.0f);
    CHECK(back[3] == 0.0f);
  }
  SUBCASE("an amax so small that amax / 448 underflows: scale 0, codes +-0") {
    const std::vector<float> x{0x1p-149f, -0x1p-148f, 0.0f, 0x1p-149f};
    CHECK(quantize_row_head(x.data(), 4, 0.0f, q.data()) == 0.0f);
    CHECK(q == std::vector<Fp8E4M3>{{0x00}, {0x80}, {0x00}, {0x00}});
  }
  SUBCASE("a static scale: x / scale, saturating past 448 x scale; inf saturates, NaN stays NaN") {
    const std::vector<float> x{1.0f, 1000.0f, -std::numeric_limits<float>::infinity(), kNaN};
    CHECK(quantize_row_head(x.data(), 4, 0.5f, q.data()) == 0.5f);
    CHECK(q == std::vector<Fp8E4M3>{{encode_e4m3(2.0f)}, {0x7E}, {0xFE}, {0x7F}});
  }
  SUBCASE("a largest finite amax: the scale and 448 x scale stay finite") {
    const std::vector<float> x{FLT_MAX, -FLT_MAX, 1.0f, 0.0f};
    const float scale = quantize_row_head(x.data(), 4, 0.0f, q.data());
    std::vector<float> back(4);
    dequantize_row_head(q.data(), 4, scale, back.data());
    CHECK(std::isfinite(back[0]));
    CHECK(back[0] == doctest::Approx(FLT_MAX).epsilon(1e-6));
    CHECK(back[1] == -back[0]);
  }
}

TEST_CASE("fp8 config: a static scale <= 0 or not finite, or not one per layer, is refused") {
  CHECK(check_fp8_config({}, 3).ok());  // per-row: nothing to check
  CHECK(check_fp8_config({Fp8Scaling::static_per_layer, {{1, 2}, {0x1p-149f, FLT_MAX}}}, 2).ok());
  CHECK(check_fp8_config({Fp8Scaling::static_per_layer, {{1, 2}}}, 2) == Errc::bad_argument);            // too few
  CHECK(check_fp8_config({Fp8Scaling::static_per_layer, {{1, 2}, {1, 2}, {1, 2}}}, 2) == Errc::bad_argument);  // too many
  CHECK(check_fp8_config({static_cast<Fp8Scaling>(7), {}}, 2) == Errc::bad_argument);
  for (const float bad : {0.0f, -0.0f, -1.0f, -FLT_MAX, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), kNaN}) {
    CAPTURE(bad);
    CHECK_FALSE(valid_static_scale(bad));
    CHECK(check_fp8_config({Fp8Scaling::static_per_layer, {{1, 1}, {bad, 1}}}, 2) == Errc::bad_argument);
    CHECK(check_fp8_config({Fp8Scaling::static_per_layer, {{1, bad}, {1, 1}}}, 2) == Errc::bad_argument);
    // A refused config changes nothing in the pool.
    HostFp8Pool pool(2, 4, 1, 16);
    REQUIRE(pool.set_config({Fp8Scaling::static_per_layer, {{1, 2}, {3, 4}}}).ok());
    CHECK(pool.set_config({Fp8Scaling::static_per_layer, {{1, 2}, {bad, 4}}}) == Errc::bad_argument);
    CHECK(pool.config().scaling == Fp8Scaling::static_per_layer);
    CHECK(pool.config().static_scales == std::vector<Fp8LayerScales>{{1, 2}, {3, 4}});
    CHECK(pool.view(1).static_scales == Fp8LayerScales{3, 4});
    // A hand-made view with a bad static scale: the reference write refuses and writes nothing.
    Fp8PoolView<Fp8E4M3> view = pool.view(0);
    view.static_scales.v = bad;
    const std::vector<float> kv(16, 1.0f);
    const std::vector<std::int64_t> rows{2};
    CHECK(reference::write(view, kv, kv, rows) == Errc::bad_argument);
    for (std::int64_t i = 0; i < 16; ++i) CHECK(pool.view(0).k[32 + i] == Fp8E4M3{0});
    CHECK(pool.view(0).k_scale[2] == 0.0f);
  }
}

TEST_CASE("fp8 host pool: writes store every row-head's scale beside the codes; copies carry both") {
  HostFp8Pool pool(2, 6, 2, 4);
  CHECK(pool.view(0).scaling == Fp8Scaling::per_row);
  const std::vector<float> k{1, 2, 3, 4, -8, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5, 5};  // rows 1 and 4
  const std::vector<float> v{4, 3, 2, 1, 0, 0, 0, 0, 9, 9, 9, 9, 1, 1, 1, 100};
  const std::vector<std::int64_t> rows{1, 4};
  REQUIRE(reference::write(pool.view(1), k, v, rows).ok());
  const auto view = pool.view(1);
  CHECK(view.k_scale[view.scale_offset(1, 0)] == 4.0f / 448);
  CHECK(view.k_scale[view.scale_offset(1, 1)] == 8.0f / 448);
  CHECK(view.k_scale[view.scale_offset(4, 0)] == 0.0f);
  CHECK(view.k_scale[view.scale_offset(4, 1)] == 5.0f / 448);
  CHECK(view.v_scale[view.scale_offset(4, 1)] == 100.0f / 448);
  CHECK(view.k[view.offset(1, 1)] == Fp8E4M3{0xFE});  // -8 is -amax: -448
  CHECK(pool.view(0).k_scale[view.scale_offset(1, 0)] == 0.0f);  // another layer: untouched
  // Static scales: every row-head stores the layer's scale.
  REQUIRE(pool.set_config({Fp8Scaling::static_per_layer, {{0.25f, 0.5f}, {2.0f, 4.0f}}}).ok());
  REQUIRE(reference::write(pool.view(0), k, v, rows).ok());
  for (const std::int64_t r : rows)
    for (std::int32_t h = 0; h < 2; ++h) {
      CHECK(pool.view(0).k_scale[view.scale_offset(r, h)] == 0.25f);
      CHECK(pool.view(0).v_scale[view.scale_offset(r, h)] == 0.5f);
    }
  CHECK(pool.view(0).k[view.offset(4, 1)] == Fp8E4M3{encode_e4m3(20.0f)});
  CHECK(pool.view(0).v[view.offset(4, 1) + 3] == Fp8E4M3{encode_e4m3(200.0f)});  // 100 / 0.5
  // copy_rows: rows 4..5 -> 0..1, codes and scales of K and V in both layers.
  const HostFp8Pool before = pool;
  pool.copy_rows({.src_row = 4, .dst_row = 0, .rows = 2});
  for (std::int32_t l = 0; l < 2; ++l)
    for (const auto& [dst, src] : {std::pair<std::int64_t, std::int64_t>{0, 4}, {1, 5}})
      for (std::int32_t h = 0; h < 2; ++h) {
        const auto a = pool.view(l);
        const auto b = before.view(l);
        CHECK(a.k_scale[a.scale_offset(dst, h)] == b.k_scale[b.scale_offset(src, h)]);
        CHECK(a.v_scale[a.scale_offset(dst, h)] == b.v_scale[b.scale_offset(src, h)]);
        for (std::int32_t d = 0; d < 4; ++d) {
          CHECK(a.k[a.offset(dst, h) + d] == b.k[b.offset(src, h) + d]);
          CHECK(a.v[a.offset(dst, h) + d] == b.v[b.offset(src, h) + d]);
        }
      }
  for (std::int32_t h = 0; h < 2; ++h)  // rows outside the copy: unchanged
    CHECK(pool.view(1).k_scale[view.scale_offset(4, h)] == before.view(1).k_scale[view.scale_offset(4, h)]);
}

namespace {

// The oracle of a pool written with per-row scaling: every row-head quantized with amax / 448 by
// oracle_encode, decoded by formula, in a double pool the double reference reads.
void oracle_write(HostPool<double>& pool, std::int32_t layer, std::span<const float> x, std::span<const std::int64_t> rows,
                  bool of_v, std::int32_t heads_kv, std::int32_t D) {
  const PoolView<double> view = pool.view(layer);
  double* dst = of_v ? view.v : view.k;
  for (std::size_t t = 0; t < rows.size(); ++t)
    for (std::int32_t h = 0; h < heads_kv; ++h) {
      const float* src = x.data() + (t * static_cast<std::size_t>(heads_kv) + static_cast<std::size_t>(h)) * static_cast<std::size_t>(D);
      float amax = 0;
      for (std::int32_t d = 0; d < D; ++d)
        if (std::isfinite(src[d])) amax = std::max(amax, std::fabs(src[d]));
      const float scale = amax / 448.0f;
      for (std::int32_t d = 0; d < D; ++d)
        dst[view.offset(rows[t], h) + d] = formula(oracle_encode(scale > 0 ? src[d] / scale : src[d])) * scale;
    }
}

}  // namespace

TEST_CASE_TEMPLATE("fp8 reference: update_and_attend over an fp8 pool equals the double reference over oracle-quantized "
                   "rows, with forks",
                   L, layout::cell, layout::sequence) {
  using Cache = KVCache<L, Windows<0, 3>>;
  constexpr std::int32_t kHeadsQ = 4, kHeadsKv = 2, kD = 8;
  Cache cache(CacheConfig{6, 128, 4, 40});
  HostFp8Pool fp8(2, cache.capacity(), kHeadsKv, kD);
  HostPool<double> exact(2, cache.capacity(), kHeadsKv, kD);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::int32_t> live{cache.seq_new().value(), cache.seq_new().value()};
  for (int step = 0; step < 14; ++step) {
    CAPTURE(step);
    if (step % 5 == 4) live.push_back(cache.seq_clone(live[0]).value());  // a row copy in the sequence layout
    std::vector<std::int32_t> ids;
    for (const std::int32_t id : live)
      for (std::uint32_t n = rng() % 3; n > 0 && ids.size() < 6; --n) ids.push_back(id);
    if (ids.empty()) ids.push_back(live[0]);
    if (!cache.declare_step(ids).ok()) break;
    for (const RowCopy& copy : cache.pending_changes().copies) {
      fp8.copy_rows(copy);
      exact.copy_rows(copy);
    }
    cache.acknowledge_changes();
    const auto T = ids.size();
    for (std::int32_t layer = 0; layer < 2; ++layer) {
      std::vector<double> q(T * kHeadsQ * kD);
      std::vector<float> k(T * kHeadsKv * kD), v(k.size());
      for (double& e : q) e = normal(rng);
      for (float& e : k) e = normal(rng) * (rng() % 100 == 0 ? 30.0f : 1.0f);
      for (float& e : v) e = normal(rng) * (rng() % 100 == 0 ? 30.0f : 1.0f);
      if (step == 6 && layer == 0) k[3] = std::numeric_limits<float>::infinity();  // saturates to the row-head's amax
      const auto rows = test::step_rows(cache);
      oracle_write(exact, layer, k, rows, false, kHeadsKv, kD);
      oracle_write(exact, layer, v, rows, true, kHeadsKv, kD);
      std::vector<double> out(q.size()), want(q.size());
      const std::int32_t window = Cache::Windows::window_of_layer(layer);
      REQUIRE(reference::update_and_attend(cache, window, fp8.view(layer), std::span<const double>(q),
                                           std::span<const float>(k), std::span<const float>(v), std::span<double>(out),
                                           kHeadsQ, 0.5f)
                  .ok());
      // The double path over the oracle's rows: reference::attend directly (its write would overwrite them).
      const PoolView<double> ev = exact.view(layer);
      reference::attend<double>(q, PoolView<const double>{ev.k, ev.v, ev.rows, kHeadsKv, kD}, want, kHeadsQ,
                                cache.step().read_len, 0.5f,
                                [&](std::int32_t t, std::int64_t row) { return cache.visible(t, row, window).value_or(false); });
      CHECK(out == want);
    }
  }
}

TEST_CASE("fp8 reference: a NaN in one row's K reaches only the queries that see that row") {
  using Cache = KVCache<layout::cell, Windows<0>>;
  Cache cache(CacheConfig{4, 16, 4, 16});
  const std::int32_t a = cache.seq_new().value(), b = cache.seq_new().value();
  HostFp8Pool pool(1, cache.capacity(), 1, 4);
  HostPool<double> exact(1, cache.capacity(), 1, 4);
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{a, a, b, b}).ok());
  std::vector<float> k(16, 1.0f), v(16, 2.0f);
  k[1] = kNaN;  // token 0 (sequence a): its row-head stores a NaN code
  const std::vector<double> q(16, 1.0);
  std::vector<double> out(16), want(16);
  REQUIRE(reference::update_and_attend(cache, 0, pool.view(0), std::span<const double>(q), std::span<const float>(k),
                                       std::span<const float>(v), std::span<double>(out), 1, 0.5f)
              .ok());
  const auto rows = test::step_rows(cache);
  CHECK(pool.view(0).k[pool.view(0).offset(rows[0], 0) + 1] == Fp8E4M3{0x7F});
  CHECK(pool.view(0).k_scale[rows[0]] == 1.0f / 448);  // the NaN did not change the scale
  for (std::int64_t r = 1; r < 4; ++r) CHECK(pool.view(0).k_scale[rows[static_cast<std::size_t>(r)]] == 1.0f / 448);
  // Sequence a's tokens see the NaN: they get what the double reference gives for a NaN key.
  oracle_write(exact, 0, k, rows, false, 1, 4);
  oracle_write(exact, 0, v, rows, true, 1, 4);
  const PoolView<double> ev = exact.view(0);
  reference::attend<double>(q, PoolView<const double>{ev.k, ev.v, ev.rows, 1, 4}, want, 1, cache.step().read_len, 0.5f,
                            [&](std::int32_t t, std::int64_t row) { return cache.visible(t, row, 0).value_or(false); });
  for (std::size_t i = 0; i < 8; ++i) CHECK(same_value(out[i], want[i]));
  for (std::size_t i = 8; i < 16; ++i) CHECK(out[i] == doctest::Approx(2.0).epsilon(1e-6));  // b's do not see it
}

TEST_CASE("fp8 reference: attend over NaN codes against a brute-force float64 softmax of formula(code) x scale") {
  // Rows 0..3, H_kv 2, D 4, H_q 4 (group 2). Row 1 head 0 holds a NaN K code, row 2 head 1 a NaN V
  // code. reference.hpp: a row-head that holds NaN codes gives NaN to the queries that see it; a
  // query that sees nothing gets zeros. The oracle is plain IEEE float64 softmax (no guard but the
  // empty one), computed from the codes by the format's formula.
  constexpr std::int32_t kHkv = 2, kD = 4, kHq = 4, kRows = 4, kTokens = 5;
  HostFp8Pool pool(1, kRows, kHkv, kD);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k(kRows * kHkv * kD), v(k.size());
  for (float& e : k) e = normal(rng);
  for (float& e : v) e = normal(rng);
  k[(1 * kHkv + 0) * kD + 2] = kNaN;
  v[(2 * kHkv + 1) * kD + 1] = kNaN;
  const std::vector<std::int64_t> rows{0, 1, 2, 3};
  REQUIRE(reference::write(pool.view(0), k, v, rows).ok());
  std::vector<double> q(kTokens * kHq * kD);
  for (double& e : q) e = normal(rng);
  // Token t sees rows [t - 1, t] within [0, 4) (token 0: row 0 only; token 4: row 3 only) but
  // token 2 sees nothing.
  const auto visible = [](std::int32_t t, std::int64_t row) { return t != 2 && (row == t || row == t - 1); };
  std::vector<double> out(q.size(), -7.0);
  const float scale = 0.5f;
  reference::attend(std::span<const double>(q), pool.view(0).read_only(), std::span<double>(out), kHq, kRows, scale,
                    visible);
  const auto view = std::as_const(pool).view(0);
  const auto value = [&](bool of_v, std::int64_t r, std::int32_t h, std::int32_t d) {
    const Fp8E4M3* codes = of_v ? view.v : view.k;
    const float s = (of_v ? view.v_scale : view.k_scale)[view.scale_offset(r, h)];
    return formula(codes[view.offset(r, h) + d].code) * static_cast<double>(s);
  };
  std::size_t nan_rows = 0;
  for (std::int32_t t = 0; t < kTokens; ++t)
    for (std::int32_t h = 0; h < kHq; ++h) {
      CAPTURE(t);
      CAPTURE(h);
      const std::int32_t hk = h / (kHq / kHkv);
      std::vector<std::int64_t> seen;
      for (std::int64_t r = 0; r < kRows; ++r)
        if (visible(t, r)) seen.push_back(r);
      std::vector<double> want(kD, 0.0);
      if (!seen.empty()) {
        std::vector<double> s;
        for (const std::int64_t r : seen) {
          double dot = 0;
          for (std::int32_t d = 0; d < kD; ++d)
            dot += q[static_cast<std::size_t>((t * kHq + h) * kD + d)] * value(false, r, hk, d);
          s.push_back(dot * scale);
        }
        double m = -kInf;  // the largest score, NaN if any is NaN
        for (const double e : s) m = std::isnan(e) || std::isnan(m) ? std::nan("") : std::max(m, e);
        double sum = 0;
        for (std::size_t i = 0; i < seen.size(); ++i) {
          const double p = std::exp(s[i] - m);
          sum += p;
          for (std::int32_t d = 0; d < kD; ++d) want[static_cast<std::size_t>(d)] += p * value(true, seen[i], hk, d);
        }
        for (double& w : want) w /= sum;
      }
      bool any_nan = false;
      for (std::int32_t d = 0; d < kD; ++d) {
        CAPTURE(d);
        const double got = out[static_cast<std::size_t>((t * kHq + h) * kD + d)], w = want[static_cast<std::size_t>(d)];
        any_nan = any_nan || std::isnan(w);
        if (std::isnan(w))
          CHECK(std::isnan(got));
        else
          CHECK(got == doctest::Approx(w).epsilon(1e-12));
      }
      nan_rows += any_nan ? 1 : 0;
    }
  // The oracle's NaNs: token 1 sees row 1 (NaN K of KV head 0: every element of query heads 0, 1);
  // token 3 sees row 2 (NaN V of KV head 1: element 1 of query heads 2, 3).
  CHECK(nan_rows == 4);
}

TEST_CASE("fp8 reference: update_and_attend refuses as the element path does, writing nothing") {
  using Cache = KVCache<layout::cell, Windows<0>>;
  Cache cache(CacheConfig{4, 16, 4, 16});
  HostFp8Pool pool(1, cache.capacity(), 2, 4);
  const std::vector<float> k(8, 1.0f);
  const std::vector<double> q(16, 1.0);
  std::vector<double> out(16, -1.0);
  const auto call = [&](Fp8PoolView<Fp8E4M3> view, std::int32_t window, std::int32_t heads_q, std::size_t k_len) {
    return reference::update_and_attend(cache, window, view, std::span<const double>(q),
                                        std::span<const float>(k.data(), k_len), std::span<const float>(k.data(), k_len),
                                        std::span<double>(out), heads_q, 0.5f);
  };
  CHECK(call(pool.view(0), 0, 4, 8) == Errc::no_step_declared);
  const std::int32_t a = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{a}).ok());
  CHECK(call(pool.view(0), -1, 4, 8) == Errc::bad_argument);
  CHECK(call(pool.view(0), 0, 3, 8) == Errc::bad_head_ratio);
  CHECK(call(pool.view(0), 0, 4, 7) == Errc::bad_shape);
  Fp8PoolView<Fp8E4M3> bad = pool.view(0);
  bad.scaling = Fp8Scaling::static_per_layer;
  bad.static_scales = {1.0f, 0.0f};
  CHECK(call(bad, 0, 4, 8) == Errc::bad_argument);
  CHECK(out == std::vector<double>(16, -1.0));
  for (std::int64_t i = 0; i < pool.rows() * pool.row_elems(); ++i) CHECK(pool.view(0).k[i] == Fp8E4M3{0});
  CHECK(call(pool.view(0), 0, 4, 8).ok());
}
