// Saved sequence state (sequence_state.hpp): save a sequence with its K and V rows, restore it into
// another cache (another placement, other sizes, another layout), and refuse every malformed or
// mismatched input naming the reason, with the cache and the pool unchanged.
#include <doctest/doctest.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/fp8.hpp"
#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/sequence_state.hpp"
#include "pool_contents.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using Model = Windows<0, 3>;
using Lowest = CellCache<Model, placement::lowest_free, 8>;
using Clustered = CellCache<Model, placement::clustered<4>, 8>;
using Slots = SequenceCache<Model, 8>;
constexpr std::uint32_t kF32 = 7;  // the tests' dtype tag for float
constexpr std::int32_t kLayers = 2, kHeads = 2, kDim = 3;

// Pool rows filled with values naming (layer, K/V, row, element).
HostPool<float> filled_pool(std::int64_t rows) {
  HostPool<float> pool(kLayers, rows, kHeads, kDim);
  for (std::int32_t l = 0; l < kLayers; ++l) {
    const PoolView<float> v = pool.view(l);
    for (std::int64_t i = 0; i < rows * pool.row_elems(); ++i) {
      v.k[i] = static_cast<float>(l * 100000 + i);
      v.v[i] = -static_cast<float>(l * 100000 + i);
    }
  }
  return pool;
}

// K and V of position p of seq, every layer.
template <class Cache>
std::vector<float> rows_at(const Cache& cache, HostPool<float>& pool, std::int32_t seq, std::int32_t p) {
  std::vector<float> out;
  const std::int64_t row = cache.row_of(seq, p);
  for (std::int32_t l = 0; l < kLayers; ++l) {
    const PoolView<float> v = pool.view(l);
    out.insert(out.end(), v.k + row * pool.row_elems(), v.k + (row + 1) * pool.row_elems());
    out.insert(out.end(), v.v + row * pool.row_elems(), v.v + (row + 1) * pool.row_elems());
  }
  return out;
}

// A cell cache whose sequence 1 holds positions 0..2, 5..9 (a hole at 3..4), among others.
struct Source {
  Lowest cache{{.max_write = 16, .max_cells = 40}};
  HostPool<float> pool = filled_pool(40);
  std::int32_t seq = -1;
  Source() {
    const auto a = cache.seq_new().value();
    seq = cache.seq_new().value();
    const std::vector<std::int32_t> ids{a, seq, seq, a, seq, seq, seq, seq, seq, seq, seq, seq};
    REQUIRE(cache.declare_step(ids).ok());
    REQUIRE(cache.seq_rm(seq, 3, 5).ok());
  }
};

template <class Cache>
void check_refused(Cache& cache, HostPool<float>& pool, std::span<const std::byte> bytes, Errc want,
                   std::uint32_t dtype = kF32) {
  const Cache before = cache;
  const std::vector<float> pool_before = test::pool_contents(pool);
  const Result<std::int32_t> got = restore_sequence(cache, pool, bytes, dtype);
  CHECK(got.status() == want);
  CHECK(cache == before);
  CHECK(test::pool_contents(pool) == pool_before);
}

}  // namespace

TEST_CASE("state: a sequence with holes restores into a cache of another placement and size") {
  Source src;
  const auto bytes = save_sequence(src.cache, src.pool, src.seq, kF32).value();
  CHECK(bytes.size() == kStateHeaderBytes + 4 * 8 + 2 * kLayers * 8 * kHeads * kDim * sizeof(float));

  Clustered dst({.max_write = 8, .max_cells = 64});
  HostPool<float> pool(kLayers, 64, kHeads, kDim);
  const auto other = dst.seq_new().value();
  REQUIRE(test::declare(dst, {other, other, other}).ok());
  const auto id = restore_sequence(dst, pool, bytes, kF32).value();
  CHECK(id == 1);
  CHECK(dst.pos(id).value() == 10);
  CHECK(dst.held_positions(id).value() == std::vector<std::int32_t>{0, 1, 2, 5, 6, 7, 8, 9});
  for (const std::int32_t p : {0, 1, 2, 5, 6, 7, 8, 9})
    CHECK(rows_at(dst, pool, id, p) == rows_at(src.cache, src.pool, src.seq, p));
  CHECK(dst.cell_of(id, 3) == -1);
  // The next token of the restored sequence sees the same positions as the source's would.
  REQUIRE(test::declare(dst, {id}).ok());
  REQUIRE(test::declare(src.cache, {src.seq}).ok());
  for (const std::int32_t w : {0, 3}) {
    std::vector<std::int32_t> seen_dst, seen_src;
    for (const auto r : test::visible_rows(dst, w, 0)) seen_dst.push_back(dst.cell_pos(static_cast<std::int32_t>(r)));
    for (const auto r : test::visible_rows(src.cache, w, 0))
      seen_src.push_back(src.cache.cell_pos(static_cast<std::int32_t>(r)));
    std::sort(seen_dst.begin(), seen_dst.end());
    std::sort(seen_src.begin(), seen_src.end());
    CHECK(seen_dst == seen_src);
  }
}

TEST_CASE("state: between layouts; an empty sequence; the sequence layout refuses holes") {
  Source src;
  Slots slots({.max_write = 8, .max_len = 16});
  HostPool<float> spool(kLayers, slots.capacity(), kHeads, kDim);
  check_refused(slots, spool, save_sequence(src.cache, src.pool, src.seq, kF32).value(), Errc::unsupported_by_layout);

  REQUIRE(src.cache.seq_rm(src.seq, 3, -1).ok());  // 0..2: dense
  const auto dense = save_sequence(src.cache, src.pool, src.seq, kF32).value();
  const auto id = restore_sequence(slots, spool, dense, kF32).value();
  CHECK(slots.pos(id).value() == 3);
  for (const std::int32_t p : {0, 1, 2}) CHECK(rows_at(slots, spool, id, p) == rows_at(src.cache, src.pool, src.seq, p));
  // And back from the sequence layout into the cell layout.
  const auto again = save_sequence(slots, spool, id, kF32).value();
  CHECK(again == dense);

  const auto empty = src.cache.seq_new().value();
  const auto none = save_sequence(src.cache, src.pool, empty, kF32).value();
  CHECK(none.size() == kStateHeaderBytes);
  const auto e = restore_sequence(slots, spool, none, kF32).value();
  CHECK(slots.pos(e).value() == 0);
  CHECK(save_sequence(src.cache, src.pool, 6, kF32).status() == Errc::sequence_not_live);
}

TEST_CASE("state: malformed input is refused naming the reason, changing nothing") {
  Source src;
  const auto bytes = save_sequence(src.cache, src.pool, src.seq, kF32).value();
  Lowest dst({.max_write = 8, .max_cells = 40});
  HostPool<float> pool = filled_pool(40);
  REQUIRE(dst.seq_new().ok());

  SUBCASE("truncated at every length") {
    for (std::size_t n = 0; n < bytes.size(); ++n)
      check_refused(dst, pool, std::span<const std::byte>(bytes.data(), n), Errc::state_truncated);
  }
  SUBCASE("every byte flipped") {
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      auto bad = bytes;
      bad[i] ^= std::byte{0x10};
      const Lowest before = dst;
      CHECK_FALSE(restore_sequence(dst, pool, bad, kF32).ok());
      CHECK(dst == before);
    }
  }
  SUBCASE("magic, version, header size, trailing bytes, checksum") {
    auto bad = bytes;
    bad[0] = std::byte{'X'};
    check_refused(dst, pool, bad, Errc::state_bad_magic);
    bad = bytes;
    bad[8] = std::byte{3};
    check_refused(dst, pool, bad, Errc::state_bad_version);
    bad[8] = std::byte{0};
    check_refused(dst, pool, bad, Errc::state_bad_version);
    bad = bytes;
    bad[12] = std::byte{65};
    check_refused(dst, pool, bad, Errc::state_corrupt);
    bad = bytes;
    bad.push_back(std::byte{0});
    check_refused(dst, pool, bad, Errc::state_corrupt);
    bad = bytes;
    bad.back() ^= std::byte{1};
    check_refused(dst, pool, bad, Errc::state_corrupt);
    bad = bytes;
    bad[48] = std::byte{0xFF};  // a payload size the header's own fields do not give
    check_refused(dst, pool, bad, Errc::state_corrupt);
  }
  SUBCASE("positions not strictly ascending, or a length that disagrees, with a valid checksum") {
    const StateShape shape = state_shape<Lowest>(pool, kF32);
    const std::vector<float> row(kHeads * kDim, 1.0F);
    auto any_row = [&](std::int32_t, std::int32_t, std::size_t) { return reinterpret_cast<const std::byte*>(row.data()); };
    const std::vector<std::int32_t> unsorted{0, 2, 1};
    check_refused(dst, pool, encode_state(shape, unsorted, any_row), Errc::state_corrupt);
    const std::vector<std::int32_t> negative{-1, 2};
    check_refused(dst, pool, encode_state(shape, negative, any_row), Errc::state_corrupt);
    const std::vector<std::int32_t> ok{0, 4};
    CHECK(restore_sequence(dst, pool, encode_state(shape, ok, any_row), kF32).ok());
  }
  SUBCASE("another shape, element type tag or window set") {
    HostPool<float> wide(kLayers, 40, kHeads, kDim + 1);
    check_refused(dst, wide, bytes, Errc::state_mismatch);
    HostPool<float> deeper(kLayers + 1, 40, kHeads, kDim);
    check_refused(dst, deeper, bytes, Errc::state_mismatch);
    check_refused(dst, pool, bytes, Errc::state_mismatch, kF32 + 1);
    CellCache<Windows<0, 4>, placement::lowest_free, 8> windows({.max_write = 8, .max_cells = 40});
    const auto before = windows;
    CHECK(restore_sequence(windows, pool, bytes, kF32).status() == Errc::state_mismatch);
    CHECK(windows == before);
  }
  SUBCASE("more than the target can hold, then the cache's own refusals") {
    Lowest small({.max_write = 8, .max_cells = 6});  // 6 cells: 8 positions never fit
    HostPool<float> spool = filled_pool(6);
    check_refused(small, spool, bytes, Errc::state_too_large);
    Slots slots({.max_write = 8, .max_len = 9});  // length 10 > max_len
    HostPool<float> slot_pool = filled_pool(slots.capacity());
    check_refused(slots, slot_pool, bytes, Errc::state_too_large);
    Lowest busy({.max_write = 16, .max_cells = 12});
    HostPool<float> bpool = filled_pool(12);
    const auto a = busy.seq_new().value();
    REQUIRE(test::declare(busy, {a, a, a, a, a}).ok());  // 7 free cells < 8
    check_refused(busy, bpool, bytes, Errc::out_of_cells);
    Lowest ids({.max_write = 8, .max_cells = 40, .max_seqs = 1});
    HostPool<float> ipool = filled_pool(40);
    REQUIRE(ids.seq_new().ok());
    check_refused(ids, ipool, bytes, Errc::no_free_sequence);
  }
}

namespace {

// A cache whose sequence a holds positions 0..3 in a synced pool, and b = a clone of a moved one
// position on by seq_add: b's cells are copies on write whose copies and K re-rotations wait for
// the pool's sync. (The sequence layout: b a fork of a, its rows a pending copy.)
template <class Cache>
constexpr bool kCells = std::is_same_v<typename Cache::Layout, layout::cell>;

template <class Cache>
struct PendingRows {
  Cache cache{kCells<Cache> ? CacheConfig{.max_write = 8, .max_cells = 40}
                            : CacheConfig{.max_write = 8, .max_seqs = 4, .max_len = 10}};
  HostPool<float> pool = filled_pool(40);
  std::int32_t a = -1, b = -1;
  PendingRows() {
    a = cache.seq_new().value();
    REQUIRE(test::declare(cache, {a, a, a, a}).ok());
    REQUIRE(pool.sync_keys_without_position(cache).ok());
    b = cache.seq_clone(a).value();
    if constexpr (kCells<Cache>) REQUIRE(cache.seq_add(b, 0, -1, 1).ok());
    REQUIRE(!cache.pending_changes().copies.empty());
  }
};

template <class Cache>
void waits_for_pending_rows() {
  PendingRows<Cache> src;
  const auto state_of_a = save_sequence(src.cache, src.pool, src.a, kF32);  // a's rows are no copy's target
  REQUIRE(state_of_a.ok());
  const Cache before = src.cache;
  CHECK(save_sequence(src.cache, src.pool, src.b, kF32).status() == Errc::rows_pending);
  CHECK(src.cache == before);
  // A fresh row of a restore could be a pending copy's source.
  check_refused(src.cache, src.pool, state_of_a.value(), Errc::rows_pending);
  REQUIRE(src.pool.sync_keys_without_position(src.cache).ok());
  const auto state_of_b = save_sequence(src.cache, src.pool, src.b, kF32);
  REQUIRE(state_of_b.ok());
  const std::int32_t shift = kCells<Cache> ? 1 : 0;
  for (std::int32_t p = 0; p < 4; ++p)  // b's rows are a's, once the copies ran
    CHECK(rows_at(src.cache, src.pool, src.b, p + shift) == rows_at(src.cache, src.pool, src.a, p));
  const std::int32_t restored = restore_sequence(src.cache, src.pool, state_of_b.value(), kF32).value();
  for (std::int32_t p = shift; p < 4 + shift; ++p)
    CHECK(rows_at(src.cache, src.pool, restored, p) == rows_at(src.cache, src.pool, src.b, p));
}

}  // namespace

TEST_CASE("state: save and restore wait for pending row copies and K re-rotations (rows_pending), changing nothing") {
  SUBCASE("cell layout: a clone's copies on write") { waits_for_pending_rows<Lowest>(); }
  SUBCASE("sequence layout: a fork's copy") { waits_for_pending_rows<Slots>(); }
}

TEST_CASE("state: a position of INT32_MAX is refused as corrupt, with no overflow") {
  const StateShape shape = state_shape<Lowest>(filled_pool(1), kF32);
  const std::vector<float> row(kHeads * kDim, 1.0F);
  auto any_row = [&](std::int32_t, std::int32_t, std::size_t) { return reinterpret_cast<const std::byte*>(row.data()); };
  const std::vector<std::int32_t> last{0, INT32_MAX};
  const auto bytes = encode_state(shape, last, any_row);
  CHECK(parse_state(bytes, shape, 1 << 20, INT32_MAX).status() == Errc::state_corrupt);
  Lowest dst({.max_write = 8, .max_cells = 40});
  HostPool<float> pool = filled_pool(40);
  check_refused(dst, pool, bytes, Errc::state_corrupt);
}

TEST_CASE("state: files") {
  Source src;
  const auto bytes = save_sequence(src.cache, src.pool, src.seq, kF32).value();
  const std::string path = "cellkv_test_state.bin";
  REQUIRE(write_state_file(path, bytes).ok());
  CHECK(read_state_file(path, bytes.size()).value() == bytes);
  CHECK(read_state_file(path, bytes.size() - 1).status() == Errc::state_too_large);
  std::remove(path.c_str());
  CHECK(read_state_file(path, 1 << 20).status() == Errc::io_error);
  CHECK(write_state_file("/nonexistent-dir/x/state.bin", bytes) == Errc::io_error);
}

// ---- format version 1 (elements only) is still read ----

namespace {
// FNV-1a 64, written out here: the checksum of a hand-made version-1 state.
std::uint64_t fnv1a64(std::uint64_t h, const std::byte* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<std::uint64_t>(p[i])) * 0x100000001B3ULL;
  return h;
}
// The version-1 bytes of a version-2 state of element storage: the 64-byte header (version 1,
// header size 64) and the same payload; the checksum over [0, 56) and the payload.
std::vector<std::byte> as_version1(const std::vector<std::byte>& v2) {
  REQUIRE(v2.size() >= 72);
  std::vector<std::byte> v1(v2.size() - 8);
  std::memcpy(v1.data(), v2.data(), 64);
  std::memcpy(v1.data() + 64, v2.data() + 72, v2.size() - 72);
  const std::uint32_t version = 1, header = 64;
  std::memcpy(v1.data() + 8, &version, 4);
  std::memcpy(v1.data() + 12, &header, 4);
  std::uint64_t sum = fnv1a64(0xCBF29CE484222325ULL, v1.data(), 56);
  sum = fnv1a64(sum, v1.data() + 64, v1.size() - 64);
  std::memcpy(v1.data() + 56, &sum, 8);
  return v1;
}
}  // namespace

TEST_CASE("state: the format is version 2 (72-byte header, storage 0 for elements); version-1 states still restore") {
  Source src;
  const auto bytes = save_sequence(src.cache, src.pool, src.seq, kF32).value();
  std::uint32_t version = 0, header = 0, storage = 99, reserved = 99;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&header, bytes.data() + 12, 4);
  std::memcpy(&storage, bytes.data() + 64, 4);
  std::memcpy(&reserved, bytes.data() + 68, 4);
  CHECK(version == 2);
  CHECK(header == 72);
  CHECK(storage == 0);
  CHECK(reserved == 0);
  CHECK(kStateHeaderBytes == 72);

  const auto v1 = as_version1(bytes);
  Clustered dst({.max_write = 8, .max_cells = 64});
  HostPool<float> pool(kLayers, 64, kHeads, kDim);
  const auto id = restore_sequence(dst, pool, v1, kF32).value();
  for (const std::int32_t p : {0, 1, 2, 5, 6, 7, 8, 9}) CHECK(rows_at(dst, pool, id, p) == rows_at(src.cache, src.pool, src.seq, p));
  CHECK(save_sequence(dst, pool, id, kF32).value() == bytes);  // saved again as version 2
  // A version-1 state is checked as one: its own header size, checksum, truncation.
  auto bad = v1;
  bad[12] = std::byte{72};
  check_refused(dst, pool, bad, Errc::state_corrupt);
  bad = v1;
  bad.back() ^= std::byte{1};
  check_refused(dst, pool, bad, Errc::state_corrupt);
  check_refused(dst, pool, std::span<const std::byte>(v1.data(), 63), Errc::state_truncated);
  check_refused(dst, pool, std::span<const std::byte>(v1.data(), v1.size() - 1), Errc::state_truncated);
  // A version-2 state claiming version 1 is corrupt (its header size is 72).
  bad = bytes;
  bad[8] = std::byte{1};
  check_refused(dst, pool, bad, Errc::state_corrupt);
}

// ---- fp8 pools (host_fp8_pool.hpp): codes and scales ----

namespace {
// An fp8 pool whose codes and scales name (layer, K/V, row, head, element): no two alike.
HostFp8Pool filled_fp8(std::int64_t rows) {
  HostFp8Pool pool(kLayers, rows, kHeads, kDim);
  for (std::int32_t l = 0; l < kLayers; ++l) {
    const Fp8PoolView<Fp8E4M3> v = pool.view(l);
    for (std::int64_t i = 0; i < rows * pool.row_elems(); ++i) {
      v.k[i] = Fp8E4M3{static_cast<std::uint8_t>((i * 7 + l * 3) & 0xFF)};
      v.v[i] = Fp8E4M3{static_cast<std::uint8_t>((i * 5 + l * 11 + 1) & 0xFF)};
    }
    for (std::int64_t i = 0; i < rows * kHeads; ++i) {
      v.k_scale[i] = 0.001f * static_cast<float>(l * 1000 + i + 1);
      v.v_scale[i] = -0.002f * static_cast<float>(l * 1000 + i + 1);
    }
  }
  return pool;
}

// Every code and every scale's bits of an fp8 pool, layer by layer.
std::vector<std::uint32_t> fp8_contents(HostFp8Pool& pool) {
  std::vector<std::uint32_t> out;
  for (std::int32_t l = 0; l < pool.layers(); ++l) {
    const Fp8PoolView<Fp8E4M3> v = pool.view(l);
    for (std::int64_t i = 0; i < pool.rows() * pool.row_elems(); ++i) out.push_back(v.k[i].code), out.push_back(v.v[i].code);
    for (std::int64_t i = 0; i < pool.rows() * pool.heads_kv(); ++i)
      out.push_back(std::bit_cast<std::uint32_t>(v.k_scale[i])), out.push_back(std::bit_cast<std::uint32_t>(v.v_scale[i]));
  }
  return out;
}

// K and V codes, then K and V scales' bits, of position p of seq, every layer.
template <class Cache>
std::vector<std::uint32_t> fp8_rows_at(const Cache& cache, HostFp8Pool& pool, std::int32_t seq, std::int32_t p) {
  std::vector<std::uint32_t> out;
  const std::int64_t row = cache.row_of(seq, p);
  for (std::int32_t l = 0; l < kLayers; ++l) {
    const Fp8PoolView<Fp8E4M3> v = pool.view(l);
    for (const Fp8E4M3* codes : {v.k, v.v})
      for (std::int64_t e = 0; e < pool.row_elems(); ++e) out.push_back(codes[row * pool.row_elems() + e].code);
    for (const float* scales : {v.k_scale, v.v_scale})
      for (std::int32_t h = 0; h < kHeads; ++h) out.push_back(std::bit_cast<std::uint32_t>(scales[row * kHeads + h]));
  }
  return out;
}

template <class Cache>
void check_fp8_refused(Cache& cache, HostFp8Pool& pool, std::span<const std::byte> bytes, Errc want) {
  const Cache before = cache;
  const auto pool_before = fp8_contents(pool);
  CHECK(restore_sequence(cache, pool, bytes, kF32).status() == want);
  CHECK(cache == before);
  CHECK(fp8_contents(pool) == pool_before);
}

// Source's sequence (0..2, 5..9) over an fp8 pool.
struct Fp8Source {
  Source src;
  HostFp8Pool pool = filled_fp8(40);
};
}  // namespace

TEST_CASE("state fp8: codes and scales of a sequence with holes restore bit for bit into another placement; the layout is the documented one") {
  Fp8Source f;
  const auto bytes = save_sequence(f.src.cache, f.pool, f.src.seq, kF32).value();
  const std::size_t held = 8, codes = kHeads * kDim, scales = 4 * kHeads;
  CHECK(bytes.size() == kStateHeaderBytes + 4 * held + 2 * kLayers * held * (codes + scales));
  std::uint32_t storage = 0;
  std::int32_t elem = 0;
  std::memcpy(&storage, bytes.data() + 64, 4);
  std::memcpy(&elem, bytes.data() + 28, 4);
  CHECK(storage == 1);
  CHECK(elem == 1);
  // The payload by hand: positions, then per layer K codes and V codes, then per layer K scales and V scales.
  const std::vector<std::int32_t> positions{0, 1, 2, 5, 6, 7, 8, 9};
  const std::byte* rows = bytes.data() + kStateHeaderBytes + 4 * held;
  const std::byte* scale_rows = rows + 2 * kLayers * held * codes;
  for (std::int32_t l = 0; l < kLayers; ++l)
    for (std::size_t i = 0; i < held; ++i) {
      const std::int64_t row = f.src.cache.row_of(f.src.seq, positions[i]);
      const Fp8PoolView<Fp8E4M3> v = f.pool.view(l);
      for (std::int32_t kv = 0; kv < 2; ++kv) {
        CAPTURE(l);
        CAPTURE(kv);
        CAPTURE(i);
        const std::size_t at = (static_cast<std::size_t>(l) * 2 + static_cast<std::size_t>(kv)) * held + i;
        CHECK(std::memcmp(rows + at * codes, (kv == 0 ? v.k : v.v) + row * codes, codes) == 0);
        CHECK(std::memcmp(scale_rows + at * scales, (kv == 0 ? v.k_scale : v.v_scale) + row * kHeads, scales) == 0);
      }
    }

  Clustered dst({.max_write = 8, .max_cells = 64});
  HostFp8Pool pool(kLayers, 64, kHeads, kDim);
  const auto other = dst.seq_new().value();
  REQUIRE(test::declare(dst, {other, other, other}).ok());
  const auto id = restore_sequence(dst, pool, bytes, kF32).value();
  CHECK(dst.held_positions(id).value() == positions);
  for (const std::int32_t p : positions) CHECK(fp8_rows_at(dst, pool, id, p) == fp8_rows_at(f.src.cache, f.pool, f.src.seq, p));
  CHECK(save_sequence(dst, pool, id, kF32).value() == bytes);

  // A static-scale pool restores the saved scales as they are (a reader never needs the mode).
  HostFp8Pool fixed(kLayers, 64, kHeads, kDim);
  REQUIRE(fixed.set_config({.scaling = Fp8Scaling::static_per_layer, .static_scales = {{2.f, 3.f}, {4.f, 5.f}}}).ok());
  Lowest lowest({.max_write = 8, .max_cells = 64});
  const auto again = restore_sequence(lowest, fixed, bytes, kF32).value();
  for (const std::int32_t p : positions) CHECK(fp8_rows_at(lowest, fixed, again, p) == fp8_rows_at(f.src.cache, f.pool, f.src.seq, p));

  // Dense: into the sequence layout and back, the same bytes; an empty sequence is a bare header.
  REQUIRE(f.src.cache.seq_rm(f.src.seq, 3, -1).ok());
  const auto dense = save_sequence(f.src.cache, f.pool, f.src.seq, kF32).value();
  Slots slots({.max_write = 8, .max_len = 16});
  HostFp8Pool spool(kLayers, slots.capacity(), kHeads, kDim);
  const auto s = restore_sequence(slots, spool, dense, kF32).value();
  CHECK(save_sequence(slots, spool, s, kF32).value() == dense);
  const auto empty = f.src.cache.seq_new().value();
  CHECK(save_sequence(f.src.cache, f.pool, empty, kF32).value().size() == kStateHeaderBytes);
  CHECK(save_sequence(f.src.cache, f.pool, 6, kF32).status() == Errc::sequence_not_live);
}

TEST_CASE("state fp8: a state of the other storage is refused (state_mismatch), changing nothing") {
  Fp8Source f;
  const auto fp8_bytes = save_sequence(f.src.cache, f.pool, f.src.seq, kF32).value();
  const auto float_bytes = save_sequence(f.src.cache, f.src.pool, f.src.seq, kF32).value();
  Lowest dst({.max_write = 8, .max_cells = 40});
  REQUIRE(dst.seq_new().ok());
  // fp8 -> a pool of 1-byte elements: shape, element size and tag agree; only the storage differs.
  HostPool<std::uint8_t> bytes_pool(kLayers, 40, kHeads, kDim);
  for (std::int32_t l = 0; l < kLayers; ++l) bytes_pool.view(l).k[0] = 42;
  {
    const Lowest before = dst;
    const auto pool_before = test::pool_contents(bytes_pool);
    CHECK(restore_sequence(dst, bytes_pool, fp8_bytes, kF32).status() == Errc::state_mismatch);
    CHECK(dst == before);
    CHECK(test::pool_contents(bytes_pool) == pool_before);
  }
  // A state of 1-byte elements, and one of floats, into an fp8 pool.
  const auto u8_bytes = save_sequence(f.src.cache, bytes_pool, f.src.seq, kF32).value();
  HostFp8Pool pool = filled_fp8(40);
  check_fp8_refused(dst, pool, u8_bytes, Errc::state_mismatch);
  check_fp8_refused(dst, pool, float_bytes, Errc::state_mismatch);
  check_fp8_refused(dst, pool, as_version1(float_bytes), Errc::state_mismatch);
  // Another tag, shape or window set.
  const Lowest before = dst;
  const auto pool_before = fp8_contents(pool);
  CHECK(restore_sequence(dst, pool, fp8_bytes, kF32 + 1).status() == Errc::state_mismatch);
  CHECK(dst == before);
  CHECK(fp8_contents(pool) == pool_before);
  HostFp8Pool wide(kLayers, 40, kHeads + 1, kDim);
  check_fp8_refused(dst, wide, fp8_bytes, Errc::state_mismatch);
  CellCache<Windows<0, 4>, placement::lowest_free, 8> windows({.max_write = 8, .max_cells = 40});
  const auto wbefore = windows;
  CHECK(restore_sequence(windows, pool, fp8_bytes, kF32).status() == Errc::state_mismatch);
  CHECK(windows == wbefore);
  CHECK(fp8_contents(pool) == pool_before);
  // And it restores once the storage agrees.
  CHECK(restore_sequence(dst, pool, fp8_bytes, kF32).ok());
}

TEST_CASE("state fp8: malformed input is refused naming the reason, changing nothing") {
  Fp8Source f;
  const auto bytes = save_sequence(f.src.cache, f.pool, f.src.seq, kF32).value();
  Lowest dst({.max_write = 8, .max_cells = 40});
  HostFp8Pool pool = filled_fp8(40);
  REQUIRE(dst.seq_new().ok());
  SUBCASE("truncated at every length") {
    for (std::size_t n = 0; n < bytes.size(); ++n)
      check_fp8_refused(dst, pool, std::span<const std::byte>(bytes.data(), n), Errc::state_truncated);
  }
  SUBCASE("every byte flipped (the scales included)") {
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      auto bad = bytes;
      bad[i] ^= std::byte{0x10};
      const Lowest before = dst;
      const auto pool_before = fp8_contents(pool);
      CHECK_FALSE(restore_sequence(dst, pool, bad, kF32).ok());
      CHECK(dst == before);
      CHECK(fp8_contents(pool) == pool_before);
    }
  }
  SUBCASE("an unknown storage, a reserved field not 0, fp8 codes of another size: corrupt even with a valid checksum") {
    auto resealed = [&](std::size_t at, std::uint32_t value) {
      auto bad = bytes;
      std::memcpy(bad.data() + at, &value, 4);
      seal_state(bad);
      return bad;
    };
    check_fp8_refused(dst, pool, resealed(64, 2), Errc::state_corrupt);
    check_fp8_refused(dst, pool, resealed(64, 0xFFFFFFFFU), Errc::state_corrupt);
    check_fp8_refused(dst, pool, resealed(68, 1), Errc::state_corrupt);
    check_fp8_refused(dst, pool, resealed(28, 2), Errc::state_corrupt);
    // Storage 0 with the fp8 payload: the payload size disagrees with the header's fields.
    check_fp8_refused(dst, pool, resealed(64, 0), Errc::state_corrupt);
  }
  SUBCASE("more than the target can hold, then the cache's own refusals") {
    Lowest small({.max_write = 8, .max_cells = 6});
    HostFp8Pool spool = filled_fp8(6);
    check_fp8_refused(small, spool, bytes, Errc::state_too_large);
    Slots slots({.max_write = 8, .max_len = 16});
    HostFp8Pool slot_pool = filled_fp8(slots.capacity());
    check_fp8_refused(slots, slot_pool, bytes, Errc::unsupported_by_layout);  // holes
  }
}
