// libFuzzer harness for the saved-state loader (cellkv/sequence_state.hpp): arbitrary bytes are
// parsed and restored into caches of both layouts, over a float pool and an fp8 pool. Every input
// must either be refused with the cache and the pool unchanged, or restore a sequence whose held
// positions and rows (and, fp8, scales) are exactly the state's. The seed corpus need not be
// given: a float state and an fp8 state are also built from the first bytes and then mutated by
// the rest (truncated, bits flipped), so valid and nearly valid inputs of both storages are reached.
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude tests/fuzz/fuzz_state.cpp
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/sequence_state.hpp"
#include "pool_contents.hpp"

namespace {

using namespace cellkv;
using Model = Windows<0, 3>;
constexpr std::int32_t kLayers = 2, kHeads = 1, kDim = 2;
constexpr std::uint32_t kTag = 1;

void fail(const char* what) {
  std::fprintf(stderr, "cellkv fuzz_state: %s\n", what);
  std::fflush(stderr);
  __builtin_trap();
}

template <class Cache>
void restore_into(Cache cache, std::span<const std::byte> bytes) {
  HostPool<float> pool(kLayers, cache.capacity(), kHeads, kDim);
  if (cache.seq_new().ok()) {  // something live beside the restored sequence
    const std::vector<std::int32_t> ids{0, 0};
    (void)cache.declare_step(ids);
  }
  const Cache before = cache;
  const std::vector<float> pool_before = test::pool_contents(pool);
  const Result<std::int32_t> id = restore_sequence(cache, pool, bytes, kTag);
  if (!id.ok()) {
    if (!(cache == before) || test::pool_contents(pool) != pool_before) fail("a refusal changed the cache or the pool");
    return;
  }
  const Result<SavedState> s =
      parse_state(bytes, state_shape<Cache>(pool, kTag), cache.capacity(), cache.position_limit());
  if (!s.ok()) fail("restored a state parse_state refuses");
  if (cache.held_positions(id.value()).value() != s.value().positions) fail("restored positions differ");
  for (std::size_t i = 0; i < s.value().positions.size(); ++i) {
    const std::int64_t row = cache.row_of(id.value(), s.value().positions[i]);
    for (std::int32_t l = 0; l < kLayers; ++l)
      if (std::memcmp(pool.view(l).k + row * pool.row_elems(), s.value().row(l, 0, i).data(), s.value().shape.row_bytes()) != 0 ||
          std::memcmp(pool.view(l).v + row * pool.row_elems(), s.value().row(l, 1, i).data(), s.value().shape.row_bytes()) != 0)
        fail("restored rows differ");
  }
}

// Every code and scale of an fp8 pool, as bytes.
std::vector<std::byte> fp8_contents(HostFp8Pool& pool) {
  std::vector<std::byte> out;
  auto add = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  };
  for (std::int32_t l = 0; l < pool.layers(); ++l) {
    const Fp8PoolView<Fp8E4M3> v = pool.view(l);
    const auto codes = static_cast<std::size_t>(pool.rows() * pool.row_elems());
    const auto scales = sizeof(float) * static_cast<std::size_t>(pool.rows() * pool.heads_kv());
    add(v.k, codes), add(v.v, codes), add(v.k_scale, scales), add(v.v_scale, scales);
  }
  return out;
}

template <class Cache>
void restore_into_fp8(Cache cache, std::span<const std::byte> bytes) {
  HostFp8Pool pool(kLayers, cache.capacity(), kHeads, kDim);
  if (cache.seq_new().ok()) {
    const std::vector<std::int32_t> ids{0, 0};
    (void)cache.declare_step(ids);
  }
  const Cache before = cache;
  const std::vector<std::byte> pool_before = fp8_contents(pool);
  const Result<std::int32_t> id = restore_sequence(cache, pool, bytes, kTag);
  if (!id.ok()) {
    if (!(cache == before) || fp8_contents(pool) != pool_before) fail("a refusal changed the cache or the fp8 pool");
    return;
  }
  const Result<SavedState> s =
      parse_state(bytes, state_shape<Cache>(pool, kTag), cache.capacity(), cache.position_limit());
  if (!s.ok()) fail("restored an fp8 state parse_state refuses");
  if (cache.held_positions(id.value()).value() != s.value().positions) fail("restored positions differ (fp8)");
  for (std::size_t i = 0; i < s.value().positions.size(); ++i) {
    const std::int64_t row = cache.row_of(id.value(), s.value().positions[i]);
    for (std::int32_t l = 0; l < kLayers; ++l) {
      const Fp8PoolView<Fp8E4M3> v = pool.view(l);
      for (std::int32_t kv = 0; kv < 2; ++kv)
        if (std::memcmp((kv == 0 ? v.k : v.v) + v.offset(row, 0), s.value().row(l, kv, i).data(), s.value().shape.row_bytes()) != 0 ||
            std::memcmp((kv == 0 ? v.k_scale : v.v_scale) + v.scale_offset(row, 0), s.value().scale_row(l, kv, i).data(),
                        s.value().shape.scale_row_bytes()) != 0)
          fail("restored codes or scales differ");
    }
  }
}

void run(std::span<const std::byte> bytes) {
  restore_into(CellCache<Model, placement::lowest_free, 4>({.max_write = 4, .max_cells = 96}), bytes);
  restore_into(CellCache<Model, placement::clustered<4>, 4>({.max_write = 4, .max_cells = 20}), bytes);
  restore_into(SequenceCache<Model, 4>({.max_write = 4, .max_len = 12}), bytes);
  restore_into_fp8(CellCache<Model, placement::lowest_free, 4>({.max_write = 4, .max_cells = 96}), bytes);
  restore_into_fp8(SequenceCache<Model, 4>({.max_write = 4, .max_len = 12}), bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* raw = reinterpret_cast<const std::byte*>(data);
  run(std::span<const std::byte>(raw, size));  // the bytes as a state
  if (size < 2) return 0;
  // A valid state of up to 15 positions (gaps from the input), then cut and flipped by the rest.
  const std::size_t n = data[0] % 16;
  std::vector<std::int32_t> positions;
  std::int32_t p = 0;
  for (std::size_t i = 0; i < n && 1 + i < size; ++i) positions.push_back(p += data[1 + i] % 9 + (i == 0 ? 0 : 1));
  const std::vector<float> row(kHeads * kDim, 0.5F);
  auto any_row = [&](std::int32_t, std::int32_t, std::size_t) { return reinterpret_cast<const std::byte*>(row.data()); };
  const StateShape shape{kLayers, kHeads, kDim, sizeof(float), kTag, window_digest<Model>()};
  const StateShape fp8{kLayers, kHeads, kDim, 1, kTag, window_digest<Model>(), StateStorage::fp8_e4m3};
  const std::size_t rest = 1 + n;
  for (std::vector<std::byte> state : {encode_state(shape, positions, any_row), encode_state(fp8, positions, any_row, any_row)}) {
    for (std::size_t i = rest; i + 1 < size; i += 2) {
      const std::size_t at = data[i] % (state.size() + 1);
      if (data[i + 1] == 0) state.resize(at);                                    // truncate
      else if (at < state.size()) state[at] ^= static_cast<std::byte>(data[i + 1]);  // flip bits
    }
    run(state);
  }
  return 0;
}
