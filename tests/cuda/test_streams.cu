// Stream rules: a step runs on the caller's stream; a step on another stream waits for the last
// one; destroying the cache never touches a stream the caller already destroyed.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {
using namespace cellkv;
using namespace cellkv::test;
using Cache = gpu::DeviceCache<layout::cell, __nv_bfloat16, Windows<0, 4>, placement::lowest_free, 8>;
}  // namespace

TEST_CASE("the cache outlives the stream it last stepped on") {
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  auto cache = std::make_unique<Cache>(CacheConfig{.max_write = 8, .max_cells = 64},
                                       gpu::PoolShape{.layers = 2, .heads_kv = 2, .head_dim = 64});
  {
    ForwardHarness<Cache> harness(*cache, 4, 8);
    gpu::Stream stream;
    std::mt19937_64 rng(1);
    const auto a = cache->seq_new().value();
    const std::vector<std::int32_t> ids(5, a);
    REQUIRE(cache->declare_step(ids).ok());
    harness.new_inputs(5, rng);
    REQUIRE(cache->upload(stream).ok());
    harness.device_forward(5, stream);
    REQUIRE(cache->commit(stream).ok());
  }  // the stream is destroyed here, possibly with work in flight
  cache.reset();
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
}

TEST_CASE("consecutive steps on two streams are ordered and both match the reference") {
  Cache cache({.max_write = 8, .max_cells = 64}, {.layers = 2, .heads_kv = 2, .head_dim = 64});
  ForwardHarness<Cache> harness(cache, 4, 8);
  gpu::Stream s1, s2;
  std::mt19937_64 rng(2);
  const auto a = cache.seq_new().value();
  for (int step = 0; step < 6; ++step) {
    const gpu::Stream& stream = step % 2 == 0 ? s1 : s2;
    const std::vector<std::int32_t> ids(static_cast<std::size_t>(1 + step % 3), a);
    REQUIRE(cache.declare_step(ids).ok());
    harness.new_inputs(static_cast<std::int32_t>(ids.size()), rng);
    REQUIRE(cache.upload(stream).ok());
    harness.device_forward(static_cast<std::int32_t>(ids.size()), stream);
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    CHECK(harness.check_against_reference() <= tolerance<__nv_bfloat16>());
  }
}
