// fp8 table kernels on extreme data: an fp8 device cache (table kernels) against the float64 host
// reference on a HostFp8Pool driven by the same host cache (the device cache's own plan). The
// device quantizes each row-head from bf16 inputs with the host's functions, so both pools hold the
// same codes and scales; the reference dequantizes in double. What is checked:
//   - magnitudes far outside fp16 (K and V row-heads from 1e-30 to 1e30, queries from 1e-30 to 1e29):
//     the decode kernel's per-row query shift and V-scale reference keep every output within
//     tolerance of the reference (no overflow, no flush of a row to zero);
//   - a NaN in one K row-head gives NaN to exactly the query heads of its KV head in its sequence:
//     every other output stays finite and correct; a NaN in one V row-head leaves every other
//     sequence finite and correct;
//   - one sequence long enough that every decode worker streams several tiles of a pair (the
//     V-scale reference carried from tile to tile, split parts merged);
//   - all-zero row-heads (scale 0) read as zeros.
// Prompts run the prefill kernel, the following steps the decode kernel.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cellkv/cellkv.hpp"
#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/reference.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using bf16 = __nv_bfloat16;

constexpr std::int32_t kHq = 8, kHkv = 2;

struct Magnitudes {
  double k_lo, k_hi, v_lo, v_hi, q_lo, q_hi;  // log10 ranges of a row-head's (a query row's) scale
};

// Values of one step: each row-head (K, V: H_kv x D per token; Q: H_q x D) is N(0, 1) times
// 10^u, u uniform in the range; rounded to bf16.
std::vector<bf16> scaled_rows(std::int32_t tokens, std::int32_t heads, std::int32_t D, double lo, double hi,
                              std::mt19937_64& rng) {
  std::normal_distribution<double> n01;
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<bf16> out(static_cast<std::size_t>(tokens) * heads * D);
  for (std::size_t r = 0; r < out.size() / static_cast<std::size_t>(D); ++r) {
    const double scale = std::pow(10.0, u(rng));
    for (std::int32_t d = 0; d < D; ++d) out[r * D + d] = from_double<bf16>(n01(rng) * scale);
  }
  return out;
}

std::vector<float> as_float(const std::vector<bf16>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// The worst |device - reference| / (max |reference| of the row) over the rows that expect finite
// values; a NaN where a finite value is expected counts as infinite error. `poisoned(t, h)`: the
// rows expected NaN (they must be NaN).
template <class Poisoned>
double worst_error(const std::vector<bf16>& got, const std::vector<double>& want, std::int32_t D, Poisoned&& poisoned) {
  double worst = 0;
  const std::size_t rows = want.size() / static_cast<std::size_t>(D);
  for (std::size_t r = 0; r < rows; ++r) {
    const auto t = static_cast<std::int32_t>(r / kHq), h = static_cast<std::int32_t>(r % kHq);
    if (poisoned(t, h)) {
      for (std::int32_t d = 0; d < D; ++d) CHECK(std::isnan(to_double(got[r * D + d])));
      continue;
    }
    double top = 0;
    for (std::int32_t d = 0; d < D; ++d) top = std::max(top, std::abs(want[r * D + d]));
    for (std::int32_t d = 0; d < D; ++d) {
      const double g = to_double(got[r * D + d]), w = want[r * D + d];
      const double e = std::isfinite(g) ? std::abs(g - w) / (top > 0 ? top : 1.0) : INFINITY;
      worst = std::max(worst, e);
    }
  }
  return worst;
}

// Three sequences: prompts of `prompt` tokens (one step each), then `decodes` steps of one token
// each. nan_seq >= 0: the first prompt token of that sequence gets a NaN in K head 1, element 3
// (nan_in_v: in V instead, and that sequence's outputs are not checked).
template <int D>
void run(const Magnitudes& m, std::int32_t prompt, std::int32_t decodes, std::int32_t nan_seq, std::uint64_t seed,
         bool nan_in_v = false) {
  using Cache = gpu::DeviceCache<layout::cell, gpu::Fp8<bf16>, Windows<0>, placement::clustered<64>>;
  Cache cache({.max_write = std::max(512, prompt), .max_cells = std::max(4096, 3 * (prompt + decodes) + 64), .max_seqs = 8},
              {.layers = 1, .heads_kv = kHkv, .head_dim = D, .heads_q = kHq});
  REQUIRE(cache.runs_table_kernels());
  HostFp8Pool host(1, cache.pool().rows(), kHkv, D);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> seqs;
  for (int s = 0; s < 3; ++s) seqs.push_back(cache.seq_new().value());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  double worst_prefill = 0, worst_decode = 0;  // the prefill kernel (prompts), the decode kernel
  auto step = [&](const std::vector<std::int32_t>& ids, bool poison_first) {
    REQUIRE(cache.declare_step(ids).ok());
    const auto T = static_cast<std::int32_t>(ids.size());
    auto k = scaled_rows(T, kHkv, D, m.k_lo, m.k_hi, rng);
    auto v = scaled_rows(T, kHkv, D, m.v_lo, m.v_hi, rng);
    const auto q = scaled_rows(T, kHq, D, m.q_lo, m.q_hi, rng);
    if (poison_first) (nan_in_v ? v : k)[static_cast<std::size_t>(1 * D + 3)] = __float2bfloat16(NAN);
    for (std::int32_t d = 0; d < D; ++d) k[static_cast<std::size_t>(T - 1) * kHkv * D + d] = from_double<bf16>(0.0);
    DeviceArray<bf16> dk(k), dv(v), dq(q), dout(q.size());
    REQUIRE(cache.upload(stream).ok());
    REQUIRE(cache.update_and_attend(0, dq.data(), dk.data(), dv.data(), dout.data(), T, kHq, scale, stream).ok());
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    std::vector<double> want(q.size());
    REQUIRE(reference::update_and_attend(cache.host(), 0, host.view(0), std::span<const double>(as_double(q)), as_float(k),
                                         as_float(v), std::span<double>(want), kHq, scale)
                .ok());
    const std::int32_t bad = nan_seq >= 0 ? seqs[static_cast<std::size_t>(nan_seq)] : -1;
    double& worst = T == 1 || ids[0] != ids[1] ? worst_decode : worst_prefill;
    auto got = dout.download();
    if (nan_in_v)  // the NaN sequence's rows are not checked: blank them on both sides
      for (std::size_t i = 0; i < got.size(); ++i)
        if (ids[i / static_cast<std::size_t>(kHq * D)] == bad) got[i] = from_double<bf16>(0.0), want[i] = 0.0;
    worst = std::max(worst, worst_error(got, want, D, [&](std::int32_t t, std::int32_t h) {
                       return !nan_in_v && ids[static_cast<std::size_t>(t)] == bad && h / (kHq / kHkv) == 1;
                     }));
  };
  for (std::size_t s = 0; s < seqs.size(); ++s)
    step(std::vector<std::int32_t>(static_cast<std::size_t>(prompt), seqs[s]), static_cast<std::int32_t>(s) == nan_seq);
  for (std::int32_t i = 0; i < decodes; ++i) step(seqs, false);
  // fp8 codes carry 3 mantissa bits (relative rounding <= 2^-4) in both pools alike; what differs is
  // the device's fp16 probabilities (2^-11), fp32 sums and the bf16 output (2^-9): 2% of the row's
  // largest output is far above those and far below an overflow or a flushed row.
  CAPTURE(D);
  CAPTURE(seed);
  CHECK(worst_prefill < 2e-2);
  CHECK(worst_decode < 2e-2);
}

}  // namespace

// Scores stay within a few units (|q . k| x scale of order 1) in every case: the prefill kernel
// rounds dequantized K to bf16 (relative 2^-9), as a bf16 cache stores it, so a score of s moves by
// about s x 2^-9; with scores of 1e3 or more any bf16 kernel picks other winners of the softmax,
// which is not what these cases test (the decode kernel keeps the codes exact).
TEST_CASE("fp8 table kernels: magnitudes far outside fp16 stay within tolerance of the float64 reference") {
  const Magnitudes wide{-30, 0, -30, 30, -2, -0.5};  // K rows from 1e-30 to 1, V rows 1e-30 to 1e30
  run<64>(wide, 37, 3, -1, 1);
  run<128>(wide, 100, 3, -1, 2);
  run<256>(wide, 70, 2, -1, 3);
  const Magnitudes tiny{-30, -29.5, -30, -25, 28.5, 29};  // tiny K and V, queries far above fp16's range
  run<128>(tiny, 65, 2, -1, 4);
  const Magnitudes huge{29, 29.5, 25, 30, -30, -29.5};  // huge K and V (outputs near 1e30), tiny queries
  run<128>(huge, 65, 2, -1, 5);
}

// Three sequences of 1,500 prompt tokens at D 128: 6 (sequence, KV head) pairs of 47 tiles, each
// run as a team of all 12 warps of a block (4 tiles a warp, merged in shared memory), where the even
// split would stream one tile a worker and merge a pair's 47 parts in global memory
// (decode_assignment).
TEST_CASE("fp8 table kernels: few long pairs decode as teams of 12 warps") {
  const Magnitudes normal{0, 0, 0, 0, 0, 0};
  run<128>(normal, 1500, 3, -1, 11);
}

TEST_CASE("fp8 table kernels: a NaN in one K row-head poisons only the query heads that see it") {
  const Magnitudes normal{0, 0, 0, 0, 0, 0};
  run<128>(normal, 40, 3, 1, 6);
  run<64>(normal, 90, 2, 0, 7);
}

TEST_CASE("fp8 table kernels: a NaN in one V row-head leaves the other sequences finite and correct") {
  const Magnitudes normal{0, 0, 0, 0, 0, 0};
  run<128>(normal, 40, 3, 1, 8, true);
  run<256>(normal, 70, 2, 2, 9, true);
}

// One sequence of `len` positions (prompt chunks of 512, written on both sides, attended on the
// device only), then decode steps checked against the float64 reference: at D 128 and H_kv 2 a
// step of 40,960 positions is 2,560 tiles, several per decode worker, each pair split into parts.
TEST_CASE("fp8 table kernels: a long sequence (several tiles per decode worker) against the float64 reference") {
  constexpr int D = 128;
  constexpr std::int32_t len = 40960, chunk = 512;
  using Cache = gpu::DeviceCache<layout::cell, gpu::Fp8<bf16>, Windows<0>, placement::clustered<64>>;
  Cache cache({.max_write = chunk, .max_cells = len + 64, .max_seqs = 2}, {.layers = 1, .heads_kv = kHkv, .head_dim = D, .heads_q = kHq});
  REQUIRE(cache.runs_table_kernels());
  HostFp8Pool host(1, cache.pool().rows(), kHkv, D);
  gpu::Stream stream;
  std::mt19937_64 rng(10);
  const std::int32_t seq = cache.seq_new().value();
  const Magnitudes m{-1, 0.5, -8, 8, -1, 0};  // V scales over 16 orders: the reference is raised tile after tile
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  double worst = 0;
  for (std::int32_t pos = 0; pos < len + 2; pos += pos < len ? chunk : 1) {
    const bool decode = pos >= len;
    const std::vector<std::int32_t> ids(static_cast<std::size_t>(decode ? 1 : chunk), seq);
    REQUIRE(cache.declare_step(ids).ok());
    const auto T = static_cast<std::int32_t>(ids.size());
    const auto k = scaled_rows(T, kHkv, D, m.k_lo, m.k_hi, rng), v = scaled_rows(T, kHkv, D, m.v_lo, m.v_hi, rng);
    const auto q = scaled_rows(T, kHq, D, m.q_lo, m.q_hi, rng);
    DeviceArray<bf16> dk(k), dv(v), dq(q), dout(q.size());
    REQUIRE(cache.upload(stream).ok());
    REQUIRE(cache.update_and_attend(0, dq.data(), dk.data(), dv.data(), dout.data(), T, kHq, scale, stream).ok());
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    if (!decode) {
      REQUIRE(reference::write(host.view(0), as_float(k), as_float(v), cache.host().step().rows).ok());
      continue;
    }
    std::vector<double> want(q.size());
    REQUIRE(reference::update_and_attend(cache.host(), 0, host.view(0), std::span<const double>(as_double(q)), as_float(k),
                                         as_float(v), std::span<double>(want), kHq, scale)
                .ok());
    worst = std::max(worst, worst_error(dout.download(), want, D, [](std::int32_t, std::int32_t) { return false; }));
  }
  CHECK(worst < 2e-2);
}
