// The device side of the cache: the position table's device copy and the masks built on the
// device from it equal the host's table and mask rows bit for bit; random multi-layer steps (forks,
// removals, refilled holes, two windows) match the host reference for both layouts, every dtype
// and head dim.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using TwoWindows = Windows<0, 5, 0>;

template <class Cache>
void check_masks_and_table(const Cache& cache, std::int32_t width) {
  const auto& host = cache.host();
  const auto plan = host.step();
  const auto& b = cache.bindings();
  REQUIRE(b.masks != nullptr);
  std::vector<std::uint8_t> got(static_cast<std::size_t>(b.max_cells));
  std::vector<std::uint8_t> want(static_cast<std::size_t>(plan.read_len));
  for (std::int32_t buf = 0; buf < TwoWindows::kDistinct; ++buf) {
    const std::int32_t w = TwoWindows::kDistinctWindows[static_cast<std::size_t>(buf)];
    for (std::int32_t t = 0; t < width; ++t) {
      REQUIRE(cudaMemcpy(got.data(), b.mask(buf) + t * b.max_cells, got.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      if (t < plan.tokens) REQUIRE(host.mask_row(w, t, want).ok());
      else std::fill(want.begin(), want.end(), std::uint8_t{0});  // padding sees nothing
      CAPTURE(t);
      CAPTURE(w);
      CHECK(std::equal(want.begin(), want.end(), got.begin()));
    }
  }
  // The device table maps every live position to the host's cell.
  std::vector<std::int32_t> flat(host.table().flat().size());
  REQUIRE(cudaMemcpy(flat.data(), b.table_flat, flat.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  const PositionTableView view{flat.data(), flat.data() + host.table().directory_entries(), host.table().dir_stride()};
  host.live_sequences().for_each([&](std::int32_t s) {
    for (std::int32_t p = 0; p < host.pos(s).value(); ++p) CHECK(view.cell(s, p) == host.cell_of(s, p));
  });
}

template <class Cache>
void random_mask_run(std::uint64_t seed) {
  Cache cache({.max_write = 12, .max_cells = 200, .max_seqs = 6}, {.layers = TwoWindows::kLayers, .heads_kv = 1, .head_dim = 64});
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  for (int step = 0; step < 40; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    const std::int32_t T = random_step<typename Cache::Host>(cache, 12, rng);
    const std::int32_t width = T + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(13 - T));
    REQUIRE(cache.upload(stream, width).ok());
    stream.synchronize();
    check_masks_and_table(cache, width);
  }
}

template <class Cache>
void random_forward_run(std::int32_t heads_q, gpu::PoolShape shape, std::int32_t max_width, std::uint64_t seed,
                        std::int32_t steps) {
  Cache cache({.max_write = max_width, .max_cells = 301, .max_seqs = 7, .max_len = 45}, shape);
  ForwardHarness<Cache> harness(cache, heads_q, max_width);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  for (int step = 0; step < steps; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    const std::int32_t T = random_step<typename Cache::Host>(cache, max_width, rng);
    const auto copies = cache.host().pending_changes().copies;
    harness.mirror_copies({copies.begin(), copies.end()});
    CHECK(harness.checked_step(T, rng, stream) <= tolerance<typename Cache::Element>());
  }
}

}  // namespace

TEST_CASE("device position table and masks equal the host's, bit for bit (lowest_free)") {
  for (std::uint64_t seed = 1; seed <= 3; ++seed)
    random_mask_run<gpu::DeviceCache<layout::cell, float, TwoWindows, placement::lowest_free, 8>>(seed);
}

TEST_CASE("device position table and masks equal the host's, bit for bit (clustered, 128 sequences)") {
  for (std::uint64_t seed = 4; seed <= 5; ++seed)
    random_mask_run<gpu::DeviceCache<layout::cell, float, TwoWindows, placement::clustered<16>, 128>>(seed);
}

TEST_CASE_TEMPLATE("cell layout: random steps over three layers match the host reference", T, __nv_bfloat16, __half,
                   float) {
  using Cache = gpu::DeviceCache<layout::cell, T, TwoWindows, placement::lowest_free, 16>;
  random_forward_run<Cache>(8, {.layers = 3, .heads_kv = 2, .head_dim = 128}, 17, 11, 25);
  random_forward_run<Cache>(4, {.layers = 3, .heads_kv = 4, .head_dim = 64}, 7, 12, 15);   // H_q = H_kv
  random_forward_run<Cache>(6, {.layers = 3, .heads_kv = 1, .head_dim = 256}, 3, 13, 15);  // MQA
}

TEST_CASE_TEMPLATE("sequence layout: random steps with fork copies match the host reference", T, __nv_bfloat16,
                   float) {
  using Cache = gpu::DeviceCache<layout::sequence, T, TwoWindows, placement::lowest_free, 16>;
  random_forward_run<Cache>(8, {.layers = 3, .heads_kv = 2, .head_dim = 128}, 17, 21, 25);
  random_forward_run<Cache>(2, {.layers = 3, .heads_kv = 1, .head_dim = 64}, 5, 22, 15);
}

TEST_CASE("sequence layout: a fork copies the shared prefix rows on the device") {
  using Cache = gpu::DeviceCache<layout::sequence, float, Windows<0>, placement::lowest_free, 8>;
  Cache cache({.max_write = 8, .max_seqs = 4, .max_len = 10}, {.layers = 1, .heads_kv = 1, .head_dim = 64});
  gpu::Stream stream;
  std::mt19937_64 rng(3);
  const auto storage = cache.pool().storage();
  DeviceArray<float> noise(random_values<float>(storage.size(), rng));
  REQUIRE(cudaMemcpy(storage.data(), noise.data(), storage.size() * 4, cudaMemcpyDeviceToDevice) == cudaSuccess);
  const auto a = cache.seq_new().value();
  const std::vector<std::int32_t> prefill(6, a);
  REQUIRE(cache.declare_step(prefill).ok());
  const auto b = cache.seq_clone(a, 4).value();
  const std::vector<std::int32_t> step{b};
  REQUIRE(cache.declare_step(step).ok());
  REQUIRE(cache.upload(stream).ok());
  stream.synchronize();
  const auto pool = cache.pool().view(0);
  std::vector<float> k(static_cast<std::size_t>(20 * 64)), v(k.size());
  REQUIRE(cudaMemcpy(k.data(), pool.k, k.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(v.data(), pool.v, v.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::equal(k.begin(), k.begin() + 4 * 64, k.begin() + 10 * 64));  // rows 0..3 -> 10..13
  CHECK(std::equal(v.begin(), v.begin() + 4 * 64, v.begin() + 10 * 64));
  CHECK_FALSE(std::equal(k.begin() + 4 * 64, k.begin() + 5 * 64, k.begin() + 14 * 64));  // row 4 not copied
}
