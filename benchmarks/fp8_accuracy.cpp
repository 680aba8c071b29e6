// fp8_accuracy: the accuracy of the fp8 (E4M3) KV format on the host, with the float64 reference as
// the oracle. Not a test and not a timing: it prints a markdown table for benchmarks/RESULTS.md.
//
// Decode attention (H_q 32, H_kv 8, D 128, every query sees the whole context) over contexts of 1k
// and 4k rows, K and V drawn from N(0, 1) and from outlier-heavy data (N(0, 1) with 1% of values x
// 30), queries from N(0, 1). Each storage's output is compared with the float64 reference over the
// exact (float) K and V: relative L2 error ||o - o_exact|| / ||o_exact|| per output row (one query
// token and head, D values), max and mean over the rows. Storages: bf16 (round to nearest even),
// fp8 with per-row scales (amax / 448 per row-head, the default) and fp8 with one static scale per
// tensor (amax / 448 of all of K, and of all of V: what a caller's calibration at best gives);
// and, to show where the error comes from, fp8 per-row for K alone and for V alone.
// Quantization is cellkv's (fp8.hpp, reference::write); the attention is reference::attend in
// double for every storage, so the numbers are the format's error, not a kernel's.
//
//   build/benchmarks/cellkv-bench-fp8-accuracy
#include <cellkv/cellkv.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace {

using namespace cellkv;

constexpr std::int32_t kHeadsQ = 32, kHeadsKv = 8, kD = 128, kQueries = 16;

// x rounded to bf16 (round to nearest even; the data here is finite).
float to_bf16(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  return std::bit_cast<float>((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

std::vector<float> draw(std::size_t n, bool outliers, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& e : x) e = normal(rng) * (outliers && u(rng) < 0.01f ? 30.0f : 1.0f);
  return x;
}

// Decode attention of every query over rows [0, rows) of a double pool.
std::vector<double> attend_double(std::span<const double> q, const std::vector<double>& k, const std::vector<double>& v,
                                  std::int64_t rows) {
  std::vector<double> out(q.size());
  reference::attend<double>(q, PoolView<const double>{k.data(), v.data(), rows, kHeadsKv, kD}, out, kHeadsQ, rows,
                            reference::default_scale(kD), [](std::int32_t, std::int64_t) { return true; });
  return out;
}

std::vector<double> widen(const std::vector<float>& x, float (*round)(float)) {
  std::vector<double> out(x.size());
  std::transform(x.begin(), x.end(), out.begin(), [&](float e) { return static_cast<double>(round(e)); });
  return out;
}

// fp8 storage: K and V written into a one-layer fp8 pool (per-row scales, or `config`'s static
// ones), then the reference's fp8 attend (dequantize in double, attend in double).
std::vector<double> attend_fp8(std::span<const double> q, const std::vector<float>& k, const std::vector<float>& v,
                               std::int64_t rows, const Fp8Config& config) {
  HostFp8Pool pool(1, rows, kHeadsKv, kD);
  if (!pool.set_config(config).ok()) return {};
  std::vector<std::int64_t> at(static_cast<std::size_t>(rows));
  for (std::size_t r = 0; r < at.size(); ++r) at[r] = static_cast<std::int64_t>(r);
  if (!reference::write(pool.view(0), k, v, at).ok()) return {};
  std::vector<double> out(q.size());
  reference::attend(q, std::as_const(pool).view(0), std::span<double>(out), kHeadsQ, rows, reference::default_scale(kD),
                    [](std::int32_t, std::int64_t) { return true; });
  return out;
}

// x quantized row-head by row-head with per-row scales and read back in double (fp8.hpp): K or V
// alone in fp8, to see which of the two the error comes from.
std::vector<double> fp8_round_trip(const std::vector<float>& x) {
  std::vector<double> out(x.size());
  std::vector<Fp8E4M3> q(kD);
  for (std::size_t at = 0; at < x.size(); at += kD) {
    const float scale = quantize_row_head(x.data() + at, kD, 0.0f, q.data());
    dequantize_row_head(q.data(), kD, scale, out.data() + at);
  }
  return out;
}

struct Error {
  double max = 0, mean = 0;
};

// Relative L2 error per output row of kD values.
Error relative_l2(const std::vector<double>& got, const std::vector<double>& exact) {
  Error e;
  const std::size_t n_rows = exact.size() / kD;
  if (got.size() != exact.size()) return {NAN, NAN};
  for (std::size_t r = 0; r < n_rows; ++r) {
    double diff = 0, norm = 0;
    for (std::size_t d = r * kD; d < (r + 1) * kD; ++d) {
      diff += (got[d] - exact[d]) * (got[d] - exact[d]);
      norm += exact[d] * exact[d];
    }
    const double rel = std::sqrt(diff / norm);
    e.max = std::max(e.max, rel);
    e.mean += rel / static_cast<double>(n_rows);
  }
  return e;
}

float amax_of(const std::vector<float>& x) {
  float a = 0;
  for (const float e : x) a = std::max(a, std::fabs(e));
  return a;
}

}  // namespace

int main() {
  std::printf("Decode attention, H_q %d, H_kv %d, D %d, %d query tokens each seeing the whole context;\n", kHeadsQ,
              kHeadsKv, kD, kQueries);
  std::printf("relative L2 error per output row (%d rows per case) vs the float64 reference over exact K/V.\n\n",
              kQueries * kHeadsQ);
  std::printf("| K/V data | context | storage | max rel. L2 | mean rel. L2 |\n|---|---|---|---|---|\n");
  for (const bool outliers : {false, true}) {
    for (const std::int64_t rows : {1024, 4096}) {
      std::mt19937 rng(outliers ? 2026u : 12u);
      const std::size_t kv_n = static_cast<std::size_t>(rows) * kHeadsKv * kD;
      const std::vector<float> k = draw(kv_n, outliers, rng), v = draw(kv_n, outliers, rng);
      const std::vector<double> q = widen(draw(static_cast<std::size_t>(kQueries) * kHeadsQ * kD, false, rng),
                                         [](float x) { return x; });
      const std::vector<double> bf16 = attend_double(q, widen(k, to_bf16), widen(v, to_bf16), rows);
      const std::vector<double> fp8_row = attend_fp8(q, k, v, rows, {});
      const Fp8Config tensor_scale{Fp8Scaling::static_per_layer, {{amax_of(k) / 448.0f, amax_of(v) / 448.0f}}};
      const std::vector<double> fp8_static = attend_fp8(q, k, v, rows, tensor_scale);
      const std::vector<double> k_exact = widen(k, [](float x) { return x; }), v_exact = widen(v, [](float x) { return x; });
      const std::vector<double> exact = attend_double(q, k_exact, v_exact, rows);
      const std::vector<double> fp8_k_only = attend_double(q, fp8_round_trip(k), v_exact, rows);
      const std::vector<double> fp8_v_only = attend_double(q, k_exact, fp8_round_trip(v), rows);
      const char* data = outliers ? "N(0,1), 1% x 30" : "N(0,1)";
      const struct {
        const char* name;
        const std::vector<double>* out;
      } storages[] = {{"bf16", &bf16},
                      {"fp8 e4m3, per-row scales", &fp8_row},
                      {"fp8 e4m3, per-row scales, K only (V exact)", &fp8_k_only},
                      {"fp8 e4m3, per-row scales, V only (K exact)", &fp8_v_only},
                      {"fp8 e4m3, one static scale per tensor", &fp8_static}};
      for (const auto& s : storages) {
        const Error e = relative_l2(*s.out, exact);
        std::printf("| %s | %lld | %s | %.2e | %.2e |\n", data, static_cast<long long>(rows), s.name, e.max, e.mean);
      }
    }
  }
  std::printf("\nPool bytes per cell (footprint.hpp, pool_bytes_per_cell), K and V of every layer:\n\n");
  std::printf("| shape | bf16 | fp16 | fp32 | fp8 e4m3 (codes + fp32 scale per row-head) |\n|---|---|---|---|---|\n");
  for (const PoolShape shape : {PoolShape{1, kHeadsKv, kD, kHeadsQ}, PoolShape{32, kHeadsKv, kD, kHeadsQ}}) {
    std::printf("| %d layers, H_kv %d, D %d |", shape.layers, shape.heads_kv, shape.head_dim);
    for (const KvStorage st : {KvStorage::bf16, KvStorage::fp16, KvStorage::fp32, KvStorage::fp8_e4m3})
      std::printf(" %zu |", pool_bytes_per_cell(shape, st).value());
    std::printf("\n");
  }
  return 0;
}
