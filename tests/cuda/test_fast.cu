// The fast path (tile lists, tensor-core decode and prefill kernels, split-KV merge) against the
// reference kernel and the float64 host reference on random scenarios: both layouts, both
// placements, forks, holes, windows, T from 1 to max_write, bf16 and fp16, head dims 64/128/256,
// GQA ratios 1, 4 and 8. Fully masked rows (padding, empty windows) are zeros.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cellkv/cuda/device_cache.cuh"
#include "cellkv/cuda/graph.hpp"
#include "cellkv/cuda/stream.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using Model = Windows<0, 40, 0>;

struct Shape {
  std::int32_t heads_q, heads_kv, head_dim, max_write, max_cells;
};

// Random steps on a fast-path cache; every step's outputs checked against the host reference.
// Every few steps the same step is also run with the reference kernel on a twin cache that saw
// the same operations, and the two device outputs are compared.
template <class Cache>
void fast_run(Shape sh, std::uint64_t seed, int steps) {
  const CacheConfig config{.max_write = sh.max_write, .max_cells = sh.max_cells, .max_seqs = 6,
                           .max_len = (sh.max_cells / 6 + 63) / 64 * 64};
  const gpu::PoolShape pool{.layers = Model::kLayers, .heads_kv = sh.heads_kv, .head_dim = sh.head_dim, .heads_q = sh.heads_q};
  Cache cache(config, pool);
  REQUIRE(cache.fast());
  ForwardHarness<Cache> harness(cache, sh.heads_q, sh.max_write);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  for (int step = 0; step < steps; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    const std::int32_t T = random_step<typename Cache::Host>(cache, sh.max_write, rng);
    const std::int32_t width = std::min(sh.max_write, T + static_cast<std::int32_t>(rng() % 3));
    const auto copies = cache.host().pending_changes().copies;
    harness.mirror_copies({copies.begin(), copies.end()});
    harness.new_inputs(width, rng);
    REQUIRE(cache.upload(stream, width).ok());
    harness.device_forward(width, stream);
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    CHECK(harness.check_against_reference() <= tolerance<typename Cache::Element>());
    CHECK(harness.padding_rows_are_zero(width));
  }
  require_device_ok();
}

template <class T, class Placement>
using Cells = gpu::DeviceCache<layout::cell, T, Model, Placement, 16>;
template <class T>
using Slots = gpu::DeviceCache<layout::sequence, T, Model, placement::lowest_free, 16>;

}  // namespace

TEST_CASE("fast path, cell layout, clustered<64>: bf16, D 128, GQA 4, decode and prefill") {
  fast_run<Cells<__nv_bfloat16, placement::clustered<64>>>({32, 8, 128, 48, 1200}, 101, 30);
}

TEST_CASE("fast path, cell layout, lowest_free (mixed tiles): fp16, D 64, GQA 8") {
  fast_run<Cells<__half, placement::lowest_free>>({16, 2, 64, 40, 700}, 102, 30);
}

TEST_CASE("fast path, cell layout, clustered<16>: bf16, D 256, H_q = H_kv") {
  fast_run<Cells<__nv_bfloat16, placement::clustered<16>>>({2, 2, 256, 33, 500}, 103, 20);
}

TEST_CASE("fast path, sequence layout: bf16 D 128 GQA 4 and fp16 D 64 GQA 1") {
  fast_run<Slots<__nv_bfloat16>>({8, 2, 128, 40, 900}, 104, 25);
  fast_run<Slots<__half>>({4, 4, 64, 17, 600}, 105, 20);
}

TEST_CASE("fast path: one long sequence splits its tile list, and the merge matches the reference") {
  using Cache = Cells<__nv_bfloat16, placement::clustered<64>>;
  Cache cache({.max_write = 64, .max_cells = 8192, .max_seqs = 4},
              {.layers = Model::kLayers, .heads_kv = 2, .head_dim = 128, .heads_q = 8});
  ForwardHarness<Cache> harness(cache, 8, 64);
  gpu::Stream stream;
  std::mt19937_64 rng(7);
  const auto a = cache.seq_new().value();
  const std::vector<std::int32_t> chunk(64, a);
  for (int i = 0; i < 100; ++i) REQUIRE(cache.declare_step(chunk).ok());  // 6400 positions, no forward
  const std::vector<std::int32_t> one{a};
  REQUIRE(cache.declare_step(one).ok());
  harness.new_inputs(1, rng);
  REQUIRE(cache.upload(stream).ok());
  harness.device_forward(1, stream);
  REQUIRE(cache.commit(stream).ok());
  stream.synchronize();
  std::int32_t counts[2] = {};
  REQUIRE(cache.fast_path()->item_counts(0, counts).ok());
  CHECK(counts[0] > 1);  // split-KV: several decode items for one segment
  CHECK(counts[1] == 0);
  CHECK(harness.check_against_reference() <= tolerance<__nv_bfloat16>());
}

TEST_CASE("fast path: graph replay across random mixes needs no recapture") {
  using Cache = Cells<__nv_bfloat16, placement::clustered<64>>;
  constexpr std::int32_t kWidth = 24;
  Cache cache({.max_write = kWidth, .max_cells = 1500, .max_seqs = 6},
              {.layers = Model::kLayers, .heads_kv = 2, .head_dim = 128, .heads_q = 8});
  ForwardHarness<Cache> harness(cache, 8, kWidth);
  gpu::Stream stream;
  std::mt19937_64 rng(9);
  (void)random_step<Cache::Host>(cache, kWidth, rng);
  REQUIRE(cache.upload(stream, kWidth).ok());
  harness.new_inputs(kWidth, rng);
  const gpu::GraphExec graph = gpu::capture(stream, [&] { harness.device_forward(kWidth, stream); });
  REQUIRE(cache.commit(stream).ok());
  for (int step = 0; step < 100; ++step) {
    CAPTURE(step);
    (void)random_step<Cache::Host>(cache, kWidth, rng);
    harness.new_inputs(kWidth, rng);
    REQUIRE(cache.upload(stream, kWidth).ok());
    REQUIRE(graph.replay(stream).ok());
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    CHECK(harness.check_against_reference() <= tolerance<__nv_bfloat16>());
    CHECK(harness.padding_rows_are_zero(kWidth));
  }
}

TEST_CASE("fast path and reference kernel agree; masks on request equal the host's") {
  using Cache = Cells<__nv_bfloat16, placement::clustered<64>>;
  const CacheConfig config{.max_write = 20, .max_cells = 900, .max_seqs = 5};
  const gpu::PoolShape shape{.layers = Model::kLayers, .heads_kv = 2, .head_dim = 64, .heads_q = 8};
  Cache fast(config, shape), ref(config, shape);
  ref.use_kernels(gpu::KernelChoice::reference);
  CHECK(fast.fast());
  CHECK_FALSE(ref.fast());
  ForwardHarness<Cache> hf(fast, 8, 20), hr(ref, 8, 20);
  gpu::Stream stream;
  std::mt19937_64 rng_f(5), rng_r(5), data_f(6), data_r(6);
  for (int step = 0; step < 25; ++step) {
    CAPTURE(step);
    const std::int32_t T = random_step<Cache::Host>(fast, 20, rng_f);
    REQUIRE(random_step<Cache::Host>(ref, 20, rng_r) == T);
    hf.new_inputs(T, data_f);
    hr.new_inputs(T, data_r);
    REQUIRE(fast.upload(stream, T, gpu::Masks::always).ok());
    REQUIRE(ref.upload(stream).ok());
    hf.device_forward(T, stream);
    hr.device_forward(T, stream);
    REQUIRE(fast.commit(stream).ok());
    REQUIRE(ref.commit(stream).ok());
    stream.synchronize();
    const double ef = hf.check_against_reference(), er = hr.check_against_reference();
    CHECK(ef <= tolerance<__nv_bfloat16>());
    CHECK(er <= tolerance<__nv_bfloat16>());
    // The masks the fast cache built on request equal the host's rows.
    const auto plan = fast.host().step();
    std::vector<std::uint8_t> want(static_cast<std::size_t>(plan.read_len)), got(want.size());
    for (std::int32_t t = 0; t < T; ++t) {
      fast.host().mask_row(40, t, want);
      REQUIRE(cudaMemcpy(got.data(), fast.mask(Model::buffer_of_window(40)) + t * fast.bindings().max_cells, got.size(),
                         cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(got == want);
    }
  }
}
