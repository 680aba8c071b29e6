// Every launcher and device-cache refusal returns the status naming the problem, launches
// nothing and writes nothing (outputs and pools keep their poison).
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "cellkv/cuda/device_cache.cuh"
#include "cellkv/cuda/launch/ops.cuh"
#include "cellkv/cuda/stream.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using T = __nv_bfloat16;

struct Fixture {
  static constexpr std::int32_t D = 64, Hq = 4, Hkv = 2, tokens = 3, rows = 32;
  DeviceArray<T> q{static_cast<std::size_t>(tokens * Hq * D) + 8}, out{q.buf.size()};
  DeviceArray<T> k{static_cast<std::size_t>(tokens * Hkv * D) + 8}, v{k.buf.size()};
  DeviceArray<T> pk{static_cast<std::size_t>((rows + 1) * Hkv * D)}, pv{pk.buf.size()};
  DeviceArray<std::uint8_t> mask{static_cast<std::size_t>(tokens * rows)};
  DeviceArray<std::int64_t> kv_len{std::vector<std::int64_t>{rows}};
  DeviceArray<std::int64_t> cells{std::vector<std::int64_t>{0, 1, 2}};
  gpu::Stream stream;

  Fixture() {
    out.fill(poison<T>());
    pk.fill(poison<T>());
    pv.fill(poison<T>());
    mask.fill(1);
  }
  PoolView<T> pool() const { return {pk.data(), pv.data(), rows, Hkv, D}; }
  PoolView<const T> cpool() const { return {pk.data(), pv.data(), rows, Hkv, D}; }
  gpu::AttentionArgs<T> args() const { return {q.data(), cpool(), out.data(), tokens, Hq, 0.f}; }
  Status sdpa(const gpu::AttentionArgs<T>& a, std::int64_t stride = rows) {
    return gpu::masked_sdpa<T>(a, reinterpret_cast<const bool*>(mask.data()), stride, kv_len.data(), stream);
  }
  void require_untouched() {
    stream.synchronize();
    for (const T x : out.download()) REQUIRE(is_poison(x));
    for (const T x : pk.download()) REQUIRE(is_poison(x));
    for (const T x : pv.download()) REQUIRE(is_poison(x));
  }
};

}  // namespace

TEST_CASE("masked_sdpa refuses bad arguments and launches nothing") {
  Fixture f;
  auto a = f.args();
  a.tokens = 0;
  CHECK(f.sdpa(a) == Errc::bad_shape);
  a = f.args();
  a.heads_q = 3;  // not a multiple of H_kv = 2
  CHECK(f.sdpa(a) == Errc::bad_head_ratio);
  a = f.args();
  a.pool.head_dim = 96;
  CHECK(f.sdpa(a) == Errc::unsupported_head_dim);
  a = f.args();
  a.q = f.q.data() + 1;  // 2 bytes off
  CHECK(f.sdpa(a) == Errc::misaligned_pointer);
  a = f.args();
  a.out = f.out.data() + 4;  // 8 bytes off
  CHECK(f.sdpa(a) == Errc::misaligned_pointer);
  a = f.args();
  a.q = nullptr;
  CHECK(f.sdpa(a) == Errc::bad_argument);
  a = f.args();
  a.scale = NAN;
  CHECK(f.sdpa(a) == Errc::bad_argument);
  CHECK(f.sdpa(f.args(), 0) == Errc::bad_shape);
  CHECK(gpu::masked_sdpa<T>(f.args(), nullptr, Fixture::rows, f.kv_len.data(), f.stream) == Errc::bad_argument);
  CHECK(gpu::masked_sdpa(gpu::DType::fp16, f.q.data(), {f.pk.data(), f.pv.data(), Fixture::rows, 2, 80}, f.out.data(), 3,
                          4, 0.f, reinterpret_cast<const bool*>(f.mask.data()), Fixture::rows, f.kv_len.data(), f.stream) ==
        Errc::unsupported_head_dim);
  CHECK(gpu::masked_sdpa(static_cast<gpu::DType>(7), f.q.data(), {f.pk.data(), f.pv.data(), Fixture::rows, 2, 64},
                          f.out.data(), 3, 4, 0.f, reinterpret_cast<const bool*>(f.mask.data()), Fixture::rows,
                          f.kv_len.data(), f.stream) == Errc::unsupported_dtype);
  f.require_untouched();
}

TEST_CASE("write_kv refuses bad arguments and writes nothing") {
  Fixture f;
  CHECK(gpu::write_kv<T>(f.pool(), f.k.data(), f.v.data(), f.cells.data(), 0, f.stream) == Errc::bad_shape);
  CHECK(gpu::write_kv<T>(f.pool(), f.k.data() + 2, f.v.data(), f.cells.data(), 3, f.stream) == Errc::misaligned_pointer);
  CHECK(gpu::write_kv<T>(f.pool(), f.k.data(), f.v.data(), nullptr, 3, f.stream) == Errc::bad_argument);
  auto bad = f.pool();
  bad.head_dim = 48;
  CHECK(gpu::write_kv<T>(bad, f.k.data(), f.v.data(), f.cells.data(), 3, f.stream) == Errc::unsupported_head_dim);
  bad = f.pool();
  bad.heads_kv = 0;
  CHECK(gpu::write_kv<T>(bad, f.k.data(), f.v.data(), f.cells.data(), 3, f.stream) == Errc::bad_shape);
  f.require_untouched();
}

TEST_CASE("the device cache refuses a forward without an uploaded step, and wrong widths, layers or windows") {
  using Model = Windows<0, 4>;
  using Cache = gpu::DeviceCache<layout::cell, T, Model, placement::lowest_free, 8>;
  Cache cache({.max_write = 4, .max_cells = 32}, {.layers = 2, .heads_kv = 2, .head_dim = 64});
  Fixture f;
  const auto storage = cache.pool().storage();
  REQUIRE(cudaMemset(storage.data(), 0xff, storage.size() * sizeof(T)) == cudaSuccess);
  auto forward = [&](std::int32_t layer, std::int32_t tokens) {
    return cache.update_and_attend(layer, f.q.data(), f.k.data(), f.v.data(), f.out.data(), tokens, 4, 0.f, f.stream);
  };
  CHECK(forward(0, 3) == Errc::no_step_declared);  // nothing declared
  CHECK(cache.upload(f.stream) == Errc::no_step_declared);
  const auto a = cache.seq_new().value();
  const std::vector<std::int32_t> ids(3, a);
  REQUIRE(cache.declare_step(ids).ok());
  CHECK(forward(0, 3) == Errc::no_step_declared);  // declared, not uploaded
  CHECK(cache.upload(f.stream, 2) == Errc::bad_shape);  // narrower than T
  CHECK(cache.upload(f.stream, 5) == Errc::bad_shape);  // wider than max_write
  REQUIRE(cache.upload(f.stream).ok());
  CHECK(forward(0, 4) == Errc::bad_shape);     // not the uploaded width
  CHECK(forward(2, 3) == Errc::bad_argument);  // no such layer
  CHECK(forward(-1, 3) == Errc::bad_argument);
  CHECK(cache.update_and_attend(0, f.q.data(), f.k.data(), f.v.data(), f.out.data(), 3, 3, 0.f, f.stream) ==
        Errc::bad_head_ratio);
  CHECK(cache.update_and_attend<4>(0, f.q.data(), f.k.data(), f.v.data(), f.out.data(), 3, 4, 0.f, f.stream) ==
        Errc::bad_argument);  // layer 0 has window 0
  REQUIRE(cache.seq_new().ok());  // a verb invalidates the uploaded step
  CHECK(forward(0, 3) == Errc::no_step_declared);
  REQUIRE(cache.declare_step(ids).ok());
  REQUIRE(cache.upload(f.stream, 3, gpu::Masks::skip).ok());
  CHECK(forward(0, 3) == Errc::no_step_declared);  // the reference path needs the masks
  REQUIRE(cache.upload(f.stream).ok());
  REQUIRE(cache.commit(f.stream).ok());
  CHECK(forward(0, 3) == Errc::no_step_declared);  // committed: over
  CHECK(cache.commit(f.stream) == Errc::no_step_declared);
  f.stream.synchronize();
  for (const T x : f.out.download()) CHECK(is_poison(x));
  std::vector<T> pool(storage.size());
  REQUIRE(cudaMemcpy(pool.data(), storage.data(), pool.size() * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  for (const T x : pool) REQUIRE(is_poison(x));
  CHECK_THROWS_AS(Cache({.max_write = 4, .max_cells = 32}, {.layers = 3, .heads_kv = 2, .head_dim = 64}),
                  std::invalid_argument);
}
