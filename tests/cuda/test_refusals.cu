// Every launcher and device-cache refusal returns the status naming the problem, launches
// nothing and writes nothing (outputs and pools keep their poison). Also: a bad row in device data
// lands in the scratch row and is reported once by the next upload or commit; a cache whose
// footprint passes the free device memory is refused before it allocates; a CUDA failure on the
// hot path is returned and recorded, never printed.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/launch/ops.cuh"
#include "cellkv/gpu/sharded_cache.cuh"
#include "cellkv/gpu/stream.hpp"
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

TEST_CASE("masked_sdpa refuses more query-head blocks than a grid holds, in int64") {
  Fixture f;
  auto a = f.args();
  a.pool.heads_kv = 1;
  a.heads_q = 65536 * 8;  // 65536 chunks of 8 query heads: one past the grid's y limit
  CHECK(f.sdpa(a) == Errc::bad_shape);
  a.heads_q = std::numeric_limits<std::int32_t>::max();  // group + 7 would overflow int32
  CHECK(f.sdpa(a) == Errc::bad_shape);
  f.require_untouched();
}

TEST_CASE("write_kv's grid is computed in int64: 2^30 + 1 tokens still get the full grid") {
  CHECK(gpu::detail::write_kv_blocks(1, 128) == 1u);
  CHECK(gpu::detail::write_kv_blocks(64, 128) == 4u);  // 2 tensors x 64 tokens x 8 vectors / 256
  CHECK(gpu::detail::write_kv_blocks((1 << 30) + 1, 128) == 4096u);
  CHECK(gpu::detail::write_kv_blocks(std::numeric_limits<std::int32_t>::max(), 1024) == 4096u);
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

namespace {

// A pool of `rows` rows (plus the scratch row) inside storage with `margin` poisoned rows before and
// after, so a write outside [0, rows] would show in the margins.
struct GuardedPool {
  static constexpr std::int32_t D = 64, Hkv = 2, rows = 32, margin = 8;
  static constexpr std::size_t row_elems = static_cast<std::size_t>(Hkv * D);
  DeviceArray<T> k{(margin + rows + 1 + margin) * row_elems}, v{k.buf.size()};
  GuardedPool() {
    k.fill(poison<T>());
    v.fill(poison<T>());
  }
  PoolView<T> view() const { return {k.data() + margin * row_elems, v.data() + margin * row_elems, rows, Hkv, D}; }
  // Storage row of pool row r (r may be outside the pool).
  static std::size_t at(std::int64_t r) { return static_cast<std::size_t>(margin + r) * row_elems; }
};

bool row_equals(const std::vector<T>& storage, std::size_t at, const std::vector<T>& src, std::size_t src_at) {
  return std::memcmp(&storage[at], &src[src_at], GuardedPool::row_elems * sizeof(T)) == 0;
}
// Every element of the row equals the same element of source row a or of source row b.
bool row_from_either(const std::vector<T>& storage, std::size_t at, const std::vector<T>& src, std::size_t a,
                     std::size_t b) {
  for (std::size_t i = 0; i < GuardedPool::row_elems; ++i) {
    const T x = storage[at + i];
    if (std::memcmp(&x, &src[a + i], sizeof(T)) != 0 && std::memcmp(&x, &src[b + i], sizeof(T)) != 0) return false;
  }
  return true;
}
bool row_is_poison(const std::vector<T>& storage, std::size_t at) {
  for (std::size_t i = 0; i < GuardedPool::row_elems; ++i)
    if (!is_poison(storage[at + i])) return false;
  return true;
}

}  // namespace

TEST_CASE("write_kv sends a row outside the pool to the scratch row and sets the fault word") {
  GuardedPool pool;
  std::mt19937_64 rng(3);
  const auto k = random_values<T>(3 * GuardedPool::row_elems, rng), v = random_values<T>(k.size(), rng);
  DeviceArray<T> dk(k), dv(v);
  DeviceArray<std::int64_t> cells(std::vector<std::int64_t>{5, -1, GuardedPool::rows + 3});
  DeviceArray<std::uint32_t> fault(std::vector<std::uint32_t>{0});
  gpu::Stream stream;
  REQUIRE(gpu::write_kv<T>(pool.view(), dk.data(), dv.data(), cells.data(), 3, fault.data(), stream).ok());
  stream.synchronize();
  CHECK(fault.download()[0] == gpu::kFaultBadRow);
  const auto hk = pool.k.download(), hv = pool.v.download();
  for (std::int64_t r = -GuardedPool::margin; r < GuardedPool::rows + 1 + GuardedPool::margin; ++r) {
    CAPTURE(r);
    if (r == 5) {
      CHECK(row_equals(hk, GuardedPool::at(r), k, 0));
      CHECK(row_equals(hv, GuardedPool::at(r), v, 0));
    } else if (r == GuardedPool::rows) {  // the scratch row: written by both bad tokens, in any order
      CHECK(row_from_either(hk, GuardedPool::at(r), k, GuardedPool::row_elems, 2 * GuardedPool::row_elems));
      CHECK(row_from_either(hv, GuardedPool::at(r), v, GuardedPool::row_elems, 2 * GuardedPool::row_elems));
    } else {
      CHECK(row_is_poison(hk, GuardedPool::at(r)));
      CHECK(row_is_poison(hv, GuardedPool::at(r)));
    }
  }
  // Without a fault word the bad rows still go to the scratch row only.
  GuardedPool quiet;
  REQUIRE(gpu::write_kv<T>(quiet.view(), dk.data(), dv.data(), cells.data(), 3, stream).ok());
  stream.synchronize();
  const auto qk = quiet.k.download();
  for (std::int64_t r = -GuardedPool::margin; r < GuardedPool::rows + 1 + GuardedPool::margin; ++r)
    if (r != 5 && r != GuardedPool::rows) CHECK(row_is_poison(qk, GuardedPool::at(r)));
}

namespace {

using FaultModel = Windows<0, 4>;
using FaultCache = gpu::DeviceCache<layout::cell, T, FaultModel, placement::lowest_free, 8>;
constexpr std::int32_t kFaultCells = 32;

// A cache with a poisoned pool and one placed, uploaded step of 3 tokens; the device block's
// cells[1] is then overwritten with `bad` (a test standing in for corrupted device memory).
struct PlantedStep {
  FaultCache cache{{.max_write = 4, .max_cells = kFaultCells}, {.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 4}};
  gpu::Stream stream;
  std::vector<T> k, v;
  DeviceArray<T> dk{3 * GuardedPool::row_elems}, dv{3 * GuardedPool::row_elems};
  std::vector<std::int64_t> rows;  // the rows the host planned

  explicit PlantedStep(std::int64_t bad) {
    std::mt19937_64 rng(11);
    k = random_values<T>(3 * GuardedPool::row_elems, rng);
    v = random_values<T>(k.size(), rng);
    dk.upload(k);
    dv.upload(v);
    const auto storage = cache.pool().storage();
    REQUIRE(cudaMemset(storage.data(), 0xff, storage.size() * sizeof(T)) == cudaSuccess);
    const std::int32_t a = cache.seq_new().value();
    const std::vector<std::int32_t> ids(3, a);
    const StepPlan plan = cache.declare_step(ids).value();
    rows.assign(plan.rows.begin(), plan.rows.end());
    REQUIRE(cache.upload(stream).ok());
    stream.synchronize();  // the step block is on the device; now corrupt it
    REQUIRE(cudaMemcpy(cache.bindings().cells + 1, &bad, sizeof bad, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  // Every row of every layer's K and V is poison but the good tokens' rows in layer 0, and the
  // scratch row of layer 0 holds token 1's K and V.
  void check_pool() const {
    const auto storage = cache.pool().storage();
    std::vector<T> all(storage.size());
    REQUIRE(cudaMemcpy(all.data(), storage.data(), all.size() * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    const std::size_t re = GuardedPool::row_elems, per_tensor = (kFaultCells + 1) * re;
    for (std::size_t tensor = 0; tensor < 4; ++tensor) {  // layer 0 K, V; layer 1 K, V
      const bool layer0 = tensor < 2;
      const std::vector<T>& src = tensor % 2 == 0 ? k : v;
      for (std::int64_t r = 0; r <= kFaultCells; ++r) {
        CAPTURE(tensor);
        CAPTURE(r);
        const std::size_t at = tensor * per_tensor + static_cast<std::size_t>(r) * re;
        if (layer0 && r == rows[0]) CHECK(row_equals(all, at, src, 0));
        else if (layer0 && r == rows[2]) CHECK(row_equals(all, at, src, 2 * re));
        else if (layer0 && r == kFaultCells) CHECK(row_equals(all, at, src, re));
        else CHECK(row_is_poison(all, at));
      }
    }
  }
};

}  // namespace

TEST_CASE("a bad row in the device cache's step block lands in the scratch row; the next commit reports it once") {
  PlantedStep s(kFaultCells + 7);  // past the scratch row: layer 0's V storage without the check
  REQUIRE(s.cache.write(0, s.dk.data(), s.dv.data(), 3, s.stream).ok());
  s.stream.synchronize();
  CHECK(s.cache.commit(s.stream) == Errc::bad_device_row);
  CHECK(s.cache.width() == 3);          // the refused commit left the step open
  CHECK(s.cache.commit(s.stream).ok());  // reported once
  s.check_pool();
}

TEST_CASE("a bad row in the device cache's step block is reported once by the next upload, which uploads nothing") {
  PlantedStep s(-1);
  REQUIRE(s.cache.write(0, s.dk.data(), s.dv.data(), 3, s.stream).ok());
  s.stream.synchronize();
  const std::vector<std::int32_t> ids{0};
  REQUIRE(s.cache.declare_step(ids).ok());
  CHECK(s.cache.upload(s.stream) == Errc::bad_device_row);
  CHECK(s.cache.width() == 0);  // not uploaded
  REQUIRE(s.cache.upload(s.stream).ok());
  CHECK(s.cache.width() == 1);
  REQUIRE(s.cache.commit(s.stream).ok());
  s.stream.synchronize();
  s.check_pool();
}

namespace {

using BigModel = Windows<0>;
using BigCache = gpu::DeviceCache<layout::cell, T, BigModel, placement::lowest_free, 8>;
using BigSharded = gpu::ShardedCache<layout::cell, T, BigModel, placement::lowest_free, 8>;
// 4095 cells + the scratch row of D = 256: 4 MiB of K and V per KV head and layer.
constexpr CacheConfig kBigConfig{.max_write = 4, .max_cells = 4095};
constexpr std::size_t kHeadBytes = std::size_t{2} * 4096 * 256 * sizeof(T);

std::size_t free_device_memory() {
  std::size_t free = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
  return free;
}

}  // namespace

TEST_CASE("a device cache whose footprint passes the free device memory is refused before it allocates") {
  const std::size_t free_before = free_device_memory();
  const auto heads = static_cast<std::int32_t>(free_before / kHeadBytes + 16);  // more than fits
  const gpu::PoolShape shape{.layers = 1, .heads_kv = heads, .head_dim = 256, .heads_q = heads};
  const std::size_t need = BigCache::footprint(kBigConfig, shape).value().total;
  REQUIRE(need > free_before);
  bool refused = false;
  try {
    BigCache cache(kBigConfig, shape);
  } catch (const gpu::OutOfDeviceMemory& e) {
    refused = true;
    CHECK(e.required() == need);
    CHECK(e.available() < need);
    const std::string what = e.what();
    CHECK(what.find(std::to_string(need)) != std::string::npos);
    CHECK(what.find(std::to_string(e.available())) != std::string::npos);
  }
  CHECK(refused);
  CHECK(free_device_memory() >= free_before);  // nothing allocated, nothing leaked
  require_device_ok();
}

TEST_CASE("a sharded cache checks every device's shards together before allocating any") {
  const std::size_t free_before = free_device_memory();
  // Each shard fits on its own (about 60% of the free memory); two on one device do not.
  const auto shard_heads = static_cast<std::int32_t>(free_before * 6 / 10 / kHeadBytes);
  const gpu::PoolShape model{.layers = 1, .heads_kv = 2 * shard_heads, .head_dim = 256, .heads_q = 2 * shard_heads};
  const std::size_t shard = BigSharded::shard_footprint(kBigConfig, model, 2).value().total;
  REQUIRE(shard < free_before);
  REQUIRE(2 * shard > free_before);
  bool refused = false;
  try {
    BigSharded cache(kBigConfig, model, std::vector<int>{0, 0});
  } catch (const gpu::OutOfDeviceMemory& e) {
    refused = true;
    CHECK(e.device() == 0);
    CHECK(e.required() == 2 * shard);  // both shards of device 0, checked before the first allocation
  }
  CHECK(refused);
  CHECK(free_device_memory() >= free_before);
  require_device_ok();
}

TEST_CASE("a device cache whose sizes overflow is refused with std::invalid_argument") {
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  const gpu::PoolShape shape{.layers = 1, .heads_kv = kMax, .head_dim = kMax, .heads_q = kMax};
  CHECK(BigCache::footprint(kBigConfig, shape).status() == Errc::size_overflow);
  CHECK_THROWS_AS(BigCache(kBigConfig, shape), std::invalid_argument);
}

TEST_CASE("a device cache allocates at least its footprint; its pools are exactly the footprint's") {
  const gpu::PoolShape shape{.layers = 1, .heads_kv = 2, .head_dim = 64, .heads_q = 8};
  const Footprint f = BigCache::footprint(kBigConfig, shape).value();
  const std::size_t free_before = free_device_memory();
  BigCache cache(kBigConfig, shape);
  CHECK(cache.pool().storage().size_bytes() == f.kv_pools);
  CHECK(free_before - free_device_memory() >= f.total);
  CHECK(f.masks == 0);  // the table kernels read no masks
  CHECK(BigCache::footprint(kBigConfig, shape, gpu::Masks::always).value().masks == std::size_t{4} * 4095);
}

namespace {
Status failing_cuda_call() {
  CELLKV_CUDA_STATUS(cudaSetDevice(1 << 20));
  return {};
}
}  // namespace

TEST_CASE("a CUDA failure on the hot path is returned and recorded, never printed (without CELLKV_DEBUG)") {
  std::fflush(stderr);
  const int saved = dup(2);
  std::FILE* captured = std::tmpfile();
  REQUIRE(captured != nullptr);
  REQUIRE(dup2(fileno(captured), 2) >= 0);
  const Status s = failing_cuda_call();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::fseek(captured, 0, SEEK_END);
  const long printed = std::ftell(captured);
  std::fclose(captured);
  (void)cudaGetLastError();  // the failed call's error, cleared
  CHECK(s == Errc::device_error);
  CHECK(printed == 0);
  const gpu::CudaFailure f = gpu::last_cuda_failure();
  CHECK(f.code == cudaErrorInvalidDevice);
  CHECK(std::string(f.expr) == "cudaSetDevice(1 << 20)");
}
