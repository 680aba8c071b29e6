// Saved sequence state (sequence_state.hpp): save a sequence with its K and V rows, restore it into
// another cache (another placement, other sizes, another layout), and refuse every malformed or
// mismatched input naming the reason, with the cache and the pool unchanged.
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "cellkv/kv_cache.hpp"
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
    bad[8] = std::byte{2};
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
