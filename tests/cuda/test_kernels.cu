// Kernels against the host reference (float64) on fresh random data: write_kv bit for bit, and
// masked / range attention for every dtype and head dim, awkward token counts (1, 3, 7, 17, 64),
// kv_len not a multiple of any tile, H_kv = 1, H_q = H_kv and GQA. Outputs are poisoned before each
// run (every element must be written); mask columns and pool rows past kv_len are poisoned too
// (true bits, NaN values), so reading them would show. Ranges outside the pool are clamped to it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cellkv/gpu/launch/ops.cuh"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/reference.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;

struct Heads {
  std::int32_t q, kv;
};
constexpr Heads kHeads[] = {{4, 1}, {8, 8}, {32, 8}, {12, 4}};
constexpr std::int32_t kTokens[] = {1, 3, 7, 17, 64};

// One masked_sdpa run against the reference; returns the worst relative error.
template <class T>
double run_masked(std::int32_t D, Heads heads, std::int32_t tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::int64_t rows = 333, kv_len = 301, stride = 347;
  const auto row_elems = static_cast<std::size_t>(heads.kv * D);
  auto k = random_values<T>(static_cast<std::size_t>(rows) * row_elems, rng);
  auto v = random_values<T>(static_cast<std::size_t>(rows) * row_elems, rng);
  for (std::size_t i = static_cast<std::size_t>(kv_len) * row_elems; i < k.size(); ++i) k[i] = v[i] = poison<T>();
  const auto q = random_values<T>(static_cast<std::size_t>(tokens * heads.q * D), rng);
  std::vector<std::uint8_t> mask_bytes(static_cast<std::size_t>(tokens * stride), 1);  // poison: true
  std::bernoulli_distribution dense(0.3);
  for (std::int32_t t = 0; t < tokens; ++t)
    for (std::int64_t c = 0; c < kv_len; ++c)
      mask_bytes[static_cast<std::size_t>(t * stride + c)] = (t % 5 != 4) && dense(rng);  // every 5th row sees nothing

  DeviceArray<T> dk(k), dv(v), dq(q), dout(q.size());
  dout.fill(poison<T>());
  DeviceArray<std::uint8_t> dmask(mask_bytes);
  DeviceArray<std::int64_t> dlen(std::vector<std::int64_t>{kv_len});
  gpu::Stream stream;
  const gpu::AttentionArgs<T> args{dq.data(), {dk.data(), dv.data(), rows, heads.kv, D}, dout.data(), tokens, heads.q, 0.f};
  REQUIRE(gpu::masked_sdpa<T>(args, reinterpret_cast<const bool*>(dmask.data()), stride, dlen.data(), stream).ok());
  stream.synchronize();

  const auto kd = as_double(k), vd = as_double(v), qd = as_double(q);
  std::vector<double> want(q.size());
  reference::attend<double>(qd, PoolView<const double>{kd.data(), vd.data(), rows, heads.kv, D}, want, heads.q, kv_len,
                            reference::default_scale(D), [&](std::int32_t t, std::int64_t c) {
                              return mask_bytes[static_cast<std::size_t>(t * stride + c)] != 0;
                            });
  return compare_outputs(dout.download(), want, D);
}

}  // namespace

TEST_CASE_TEMPLATE("masked_sdpa matches the float64 reference", T, __nv_bfloat16, __half, float) {
  std::uint64_t seed = 1000;
  for (const std::int32_t D : {64, 128, 256}) {
    for (std::size_t i = 0; i < std::size(kTokens); ++i) {
      const Heads heads = kHeads[(i + static_cast<std::size_t>(D)) % std::size(kHeads)];
      CAPTURE(D);
      CAPTURE(heads.q);
      CAPTURE(heads.kv);
      CAPTURE(kTokens[i]);
      CAPTURE(seed);
      CHECK(run_masked<T>(D, heads, kTokens[i], seed++) <= tolerance<T>());
    }
  }
}

TEST_CASE_TEMPLATE("range_sdpa matches the float64 reference", T, __nv_bfloat16, float) {
  std::mt19937_64 rng(77);
  const std::int32_t D = 128, tokens = 9;
  const Heads heads{8, 2};
  const std::int64_t rows = 200, kv_len = 150;
  const auto row_elems = static_cast<std::size_t>(heads.kv * D);
  auto k = random_values<T>(static_cast<std::size_t>(rows) * row_elems, rng);
  auto v = random_values<T>(static_cast<std::size_t>(rows) * row_elems, rng);
  for (std::size_t i = static_cast<std::size_t>(kv_len) * row_elems; i < k.size(); ++i) k[i] = v[i] = poison<T>();
  const auto q = random_values<T>(static_cast<std::size_t>(tokens * heads.q * D), rng);
  std::vector<RowRange> ranges(static_cast<std::size_t>(tokens));
  for (std::int32_t t = 0; t < tokens; ++t) {
    const auto b = static_cast<std::int32_t>(rng() % 140);
    ranges[static_cast<std::size_t>(t)] = {b, b + 1 + static_cast<std::int32_t>(rng() % 40)};  // may pass kv_len
  }
  ranges[3] = {10, 10};  // empty: zeros
  DeviceArray<T> dk(k), dv(v), dq(q), dout(q.size());
  dout.fill(poison<T>());
  DeviceArray<RowRange> dranges(ranges);
  DeviceArray<std::int64_t> dlen(std::vector<std::int64_t>{kv_len});
  gpu::Stream stream;
  const gpu::AttentionArgs<T> args{dq.data(), {dk.data(), dv.data(), rows, heads.kv, D}, dout.data(), tokens, heads.q, 0.f};
  REQUIRE(gpu::range_sdpa<T>(args, dranges.data(), dlen.data(), stream).ok());
  stream.synchronize();
  const auto kd = as_double(k), vd = as_double(v), qd = as_double(q);
  std::vector<double> want(q.size());
  reference::attend<double>(qd, PoolView<const double>{kd.data(), vd.data(), rows, heads.kv, D}, want, heads.q, kv_len,
                            reference::default_scale(D), [&](std::int32_t t, std::int64_t c) {
                              const RowRange r = ranges[static_cast<std::size_t>(t)];
                              return c >= r.begin && c < r.end;
                            });
  CHECK(compare_outputs(dout.download(), want, D) <= tolerance<T>());
}

TEST_CASE_TEMPLATE("write_kv copies K and V rows to their cells in one launch", T, __nv_bfloat16, __half, float) {
  std::mt19937_64 rng(5);
  for (const std::int32_t D : {64, 256}) {
    const std::int32_t heads_kv = 3, tokens = 17;
    const std::int64_t rows = 50;
    const auto row_elems = static_cast<std::size_t>(heads_kv * D);
    std::vector<std::int64_t> cells(static_cast<std::size_t>(rows));
    for (std::int64_t i = 0; i < rows; ++i) cells[static_cast<std::size_t>(i)] = i;
    std::shuffle(cells.begin(), cells.end(), rng);
    cells.resize(static_cast<std::size_t>(tokens));
    cells.back() = rows;  // the scratch row (storage has rows + 1 rows)
    const auto k = random_values<T>(static_cast<std::size_t>(tokens) * row_elems, rng);
    const auto v = random_values<T>(static_cast<std::size_t>(tokens) * row_elems, rng);
    DeviceArray<T> pk((static_cast<std::size_t>(rows) + 1) * row_elems), pv(pk.buf.size()), dk(k), dv(v);
    pk.fill(poison<T>());
    pv.fill(poison<T>());
    DeviceArray<std::int64_t> dcells(cells);
    gpu::Stream stream;
    REQUIRE(gpu::write_kv<T>({pk.data(), pv.data(), rows, heads_kv, D}, dk.data(), dv.data(), dcells.data(), tokens, stream)
                .ok());
    stream.synchronize();
    const auto hk = pk.download(), hv = pv.download();
    std::vector<bool> written(static_cast<std::size_t>(rows) + 1, false);
    for (std::int32_t t = 0; t < tokens; ++t) {
      const auto row = static_cast<std::size_t>(cells[static_cast<std::size_t>(t)]);
      written[row] = true;
      CHECK(std::memcmp(&hk[row * row_elems], &k[static_cast<std::size_t>(t) * row_elems], row_elems * sizeof(T)) == 0);
      CHECK(std::memcmp(&hv[row * row_elems], &v[static_cast<std::size_t>(t) * row_elems], row_elems * sizeof(T)) == 0);
    }
    for (std::size_t row = 0; row < written.size(); ++row)
      if (!written[row]) CHECK((is_poison(hk[row * row_elems]) && is_poison(hv[row * row_elems + row_elems - 1])));
  }
}

TEST_CASE_TEMPLATE("range_sdpa clamps every range to the pool, whatever the device data says", T, __nv_bfloat16, float) {
  // The pool's rows sit between margins of NaN rows: a sweep that left [0, rows) would read them.
  std::mt19937_64 rng(78);
  const std::int32_t D = 64, tokens = 6, margin = 16;
  const Heads heads{4, 2};
  const std::int64_t rows = 40;
  const auto row_elems = static_cast<std::size_t>(heads.kv * D);
  const auto k = random_values<T>(static_cast<std::size_t>(rows) * row_elems, rng);
  const auto v = random_values<T>(k.size(), rng);
  std::vector<T> gk((static_cast<std::size_t>(rows) + 2 * margin) * row_elems, poison<T>()), gv(gk.size(), poison<T>());
  std::copy(k.begin(), k.end(), gk.begin() + margin * static_cast<std::ptrdiff_t>(row_elems));
  std::copy(v.begin(), v.end(), gv.begin() + margin * static_cast<std::ptrdiff_t>(row_elems));
  const auto q = random_values<T>(static_cast<std::size_t>(tokens * heads.q * D), rng);
  constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min(), kMax = std::numeric_limits<std::int32_t>::max();
  const std::vector<RowRange> ranges{{-5, 10}, {-100, 140}, {30, 43}, {42, 49}, {kMin, kMax}, {kMin, -1}};
  DeviceArray<T> dk(gk), dv(gv), dq(q), dout(q.size());
  dout.fill(poison<T>());
  DeviceArray<RowRange> dranges(ranges);
  DeviceArray<std::int64_t> dlen(std::vector<std::int64_t>{rows + 50});  // past the pool too
  gpu::Stream stream;
  const std::size_t at = static_cast<std::size_t>(margin) * row_elems;
  const gpu::AttentionArgs<T> args{dq.data(), {dk.data() + at, dv.data() + at, rows, heads.kv, D}, dout.data(), tokens,
                                   heads.q, 0.f};
  REQUIRE(gpu::range_sdpa<T>(args, dranges.data(), dlen.data(), stream).ok());
  stream.synchronize();
  const auto kd = as_double(k), vd = as_double(v), qd = as_double(q);
  std::vector<double> want(q.size());
  reference::attend<double>(qd, PoolView<const double>{kd.data(), vd.data(), rows, heads.kv, D}, want, heads.q, rows,
                            reference::default_scale(D), [&](std::int32_t t, std::int64_t c) {
                              const RowRange r = ranges[static_cast<std::size_t>(t)];
                              return c >= std::max<std::int64_t>(r.begin, 0) && c < std::min<std::int64_t>(r.end, rows);
                            });
  CHECK(compare_outputs(dout.download(), want, D) <= tolerance<T>());
}
