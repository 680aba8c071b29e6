// device_footprint (footprint.hpp) against the sizes written out here from the documented layout
// of a shard's device memory (docs/design.md section 5): K and V of every layer with one scratch
// row (and, for fp8, a scale per row-head), the step block part by part (its offsets as step_block.hpp lists them, with the element
// sizes written as numbers, with and without the shared-prefix part), the position table's
// directory and pages, and the dense masks. Also one configuration worked out by hand, and one
// test per refusal.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "cellkv/kv_cache.hpp"
#include "cellkv/footprint.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;

constexpr std::uint64_t align16(std::uint64_t n) { return (n + 15) / 16 * 16; }

struct Expected {
  std::uint64_t kv, block, table, masks;
  [[nodiscard]] std::uint64_t total() const { return kv + block + table + masks; }
};

// The footprint from first principles. cell: the cell layout (else the sequence layout); windows:
// distinct windows; seqs: max_seqs after defaulting.
Expected expected(bool cell, std::int32_t windows, std::int32_t seqs, const CacheConfig& c, const PoolShape& s,
                  const DeviceParts& parts) {
  const std::uint64_t element_bytes = parts.element_bytes;
  const std::uint64_t w = static_cast<std::uint64_t>(c.max_write);
  const std::uint64_t rows = cell ? static_cast<std::uint64_t>(c.max_cells)
                                  : static_cast<std::uint64_t>(seqs) * static_cast<std::uint64_t>(c.max_len);
  // K and V: each row-head holds head_dim elements and, for fp8, its scale.
  const std::uint64_t kv = 2 * static_cast<std::uint64_t>(s.layers) * (rows + 1) * static_cast<std::uint64_t>(s.heads_kv) *
                           (static_cast<std::uint64_t>(s.head_dim) * element_bytes + parts.scale_bytes);
  // Step block: cells int64[w], read_len int64, tokens int32, num_segments int32, token_seq and
  // token_pos int32[w]; segments (4 int32 each) from a 16-byte boundary; per window, 16-byte
  // aligned: counts int32[4], decode_seg int32[w], decode_prefix int32[w + 1], then from a 16-byte
  // boundary the prefill items (2 int32 each); row ranges (2 int32) per window and token for the
  // sequence layout; from a 16-byte boundary, table writes (2 int32) for the cell layout.
  const std::uint64_t group = s.heads_q > 0 ? std::max<std::uint64_t>(1, static_cast<std::uint64_t>(s.heads_q / s.heads_kv)) : 1;
  // Prefill items: the plan makes ceil(len x group / rows) per segment, rows 128 (the wgmma
  // kernel) or 64 (the mma.sync kernel); the block holds enough for 64: sum(len x group / 64 + 1).
  const std::uint64_t prefill = w * group / 64 + w;
  const std::uint64_t segments_end = align16(8 * w + 8 + 4 + 4 + 4 * w + 4 * w) + 16 * w;
  const std::uint64_t work_each = align16(align16(4 * (4 + w + w + 1)) + 8 * prefill);
  const std::uint64_t ranges_end = align16(segments_end) + work_each * static_cast<std::uint64_t>(windows) +
                                   (cell ? 0 : 8 * w * static_cast<std::uint64_t>(windows));
  // Shared prefixes (cell layout, when built), from a 16-byte boundary: 4 int32 counts, own_begin
  // int32[w], 16-byte aligned token_slots (2 int32)[w], 16-byte aligned finished (4 int32)[w],
  // 16-byte aligned runs (7 int32)[w], 16-byte
  // aligned run_tokens, run_slot int32[slots], 16-byte aligned items (5 int32)[slots];
  // slots = 2 w within [256, 2048].
  const std::uint64_t slots = std::clamp<std::uint64_t>(2 * w, 256, 2048);
  const std::uint64_t shared_end =
      align16(align16(align16(align16(align16(align16(ranges_end) + 16 + 4 * w) + 8 * w) + 16 * w) + 28 * w) + 8 * slots) +
      20 * slots;
  const std::uint64_t writes_at = cell && parts.shared_prefixes ? align16(shared_end) : align16(ranges_end);
  const std::uint64_t table_writes = cell ? std::max<std::uint64_t>(4 * w, 4096) : 0;
  const std::uint64_t block = writes_at + 8 * table_writes;
  // Position table: a directory of ceil(max_cells / 64) page ids per sequence, then
  // ceil(max_cells / 64) + 2 max_seqs pages of 64 cell ids, all int32.
  const std::uint64_t pages = (static_cast<std::uint64_t>(c.max_cells) + 63) / 64;
  const std::uint64_t table = cell ? 4 * (static_cast<std::uint64_t>(seqs) * pages + (pages + 2 * static_cast<std::uint64_t>(seqs)) * 64) : 0;
  const std::uint64_t mask_bytes =
      cell && parts.masks ? static_cast<std::uint64_t>(windows) * w * static_cast<std::uint64_t>(c.max_cells) : 0;
  return {kv, block, table, mask_bytes};
}

template <class Host>
void check_against_formula(const CacheConfig& c, const PoolShape& s, const DeviceParts& parts) {
  constexpr bool kCell = std::is_same_v<typename Host::Layout, layout::cell>;
  const std::int32_t seqs = c.max_seqs == 0 ? Host::kMaxSeqs : c.max_seqs;
  const Expected want = expected(kCell, Host::Windows::kDistinct, seqs, c, s, parts);
  const Result<Footprint> got = device_footprint<Host>(c, s, parts);
  REQUIRE(got.ok());
  CHECK(got.value().kv_pools == want.kv);
  CHECK(got.value().step_block == want.block);
  CHECK(got.value().position_table == want.table);
  CHECK(got.value().masks == want.masks);
  CHECK(got.value().total == want.total());
}

using CellHost = CellCache<Windows<0, 4, 0>, placement::lowest_free, 8>;
using SeqHost = SequenceCache<Windows<0, 16, 0, 16, 5>, 8>;

constexpr PoolShape kShape{.layers = 3, .heads_kv = 2, .head_dim = 64, .heads_q = 8};

}  // namespace

TEST_CASE("footprint: one cell-layout configuration worked out by hand") {
  // max_write 7, 2 distinct windows, group 4: prefill items 7 * 4 / 64 + 7 = 7.
  // Step block: 16 * 7 + 16 = 128 bytes of token data, segments to 240, each window's work
  // 76 bytes of counts and decode lists padded to 80, then 56 of prefill items, padded to 144, to
  // 528, then 4096 table writes of 8 bytes: 33296.
  // KV: 2 x 3 layers x 101 rows x 2 heads x 64 x 2 bytes = 155136. Table: 8 x 2 directory
  // entries + (2 + 16) pages x 64 = 1168 ints = 4672 bytes. Masks: 2 x 7 x 100 = 1400.
  const CacheConfig c{.max_write = 7, .max_cells = 100};
  const Result<Footprint> f = device_footprint<CellHost>(c, kShape, {.element_bytes = 2, .masks = true});
  REQUIRE(f.ok());
  CHECK(f.value() == Footprint{155136, 33296, 4672, 1400, 155136 + 33296 + 4672 + 1400});
  CHECK(device_footprint<CellHost>(c, kShape, {.element_bytes = 2}).value().total == 155136 + 33296 + 4672);
  // Shared prefixes: 256 slots; from 528: counts 16 and own_begin 28 bytes to 572, token_slots
  // from 576 (56 bytes), finished from 640 (7 x 16 = 112 bytes), runs from 752 (7 x 28 = 196
  // bytes), run_tokens and run_slot from 960 (2 x 1024 bytes), items from 3008 (256 x 20 bytes)
  // to 8128; table writes from 8128.
  CHECK(device_footprint<CellHost>(c, kShape, {.element_bytes = 2, .shared_prefixes = true}).value().step_block ==
        8128 + 32768);
}

TEST_CASE("footprint: both layouts, masks, defaulted max_seqs, GQA groups, element and scale sizes against the formula") {
  for (const bool masks : {false, true}) {
    for (const bool shared : {false, true}) {
      for (const auto& [bytes, scale] : {std::pair<std::size_t, std::size_t>{2, 0}, {4, 0}, {1, 4}}) {
        const DeviceParts parts{bytes, masks, shared, scale};
        check_against_formula<CellHost>({.max_write = 7, .max_cells = 100}, kShape, parts);
        check_against_formula<CellHost>({.max_write = 1, .max_cells = 1, .max_seqs = 3}, kShape, parts);
        check_against_formula<CellHost>({.max_write = 3000, .max_cells = 65537, .max_seqs = 0},
                                        {.layers = 2, .heads_kv = 1, .head_dim = 256, .heads_q = 64}, parts);
        check_against_formula<CellHost>({.max_write = 17, .max_cells = 640},
                                        {.layers = 1, .heads_kv = 4, .head_dim = 128}, parts);  // heads_q unknown: group 1
        check_against_formula<SeqHost>({.max_write = 5, .max_seqs = 3, .max_len = 33}, kShape, parts);
        check_against_formula<SeqHost>({.max_write = 129, .max_len = 1000},
                                       {.layers = 5, .heads_kv = 8, .head_dim = 128, .heads_q = 32}, parts);
      }
    }
  }
}

TEST_CASE("footprint refuses a configuration the host cache refuses") {
  CHECK(device_footprint<CellHost>({.max_write = 0, .max_cells = 100}, kShape, {.element_bytes = 2}).status() == Errc::bad_argument);
  CHECK(device_footprint<CellHost>({.max_write = 4, .max_cells = 100, .max_seqs = 9}, kShape, {.element_bytes = 2}).status() ==
        Errc::bad_argument);  // more than MaxSeqs = 8
  CHECK(device_footprint<SeqHost>({.max_write = 4, .max_len = 0}, kShape, {.element_bytes = 2}).status() == Errc::bad_argument);
}

TEST_CASE("footprint refuses a non-positive layer, head or head-dim count") {
  const CacheConfig c{.max_write = 4, .max_cells = 64};
  for (const PoolShape bad : {PoolShape{0, 2, 64, 8}, PoolShape{3, 0, 64, 8}, PoolShape{3, 2, 0, 8}, PoolShape{3, 2, 64, -1},
                              PoolShape{-3, 2, 64, 8}, PoolShape{3, std::numeric_limits<std::int32_t>::min(), 64, 8}}) {
    CAPTURE(bad.layers);
    CAPTURE(bad.heads_kv);
    CAPTURE(bad.head_dim);
    CAPTURE(bad.heads_q);
    CHECK(device_footprint<CellHost>(c, bad, {.element_bytes = 2}).status() == Errc::bad_shape);
  }
}

TEST_CASE("footprint refuses an element size of 0") {
  CHECK(device_footprint<CellHost>({.max_write = 4, .max_cells = 64}, kShape, {.element_bytes = 0}).status() ==
        Errc::bad_argument);
}

TEST_CASE("footprint refuses pools whose byte size overflows size_t") {
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  // 2 x 4 layers x 4097 rows x (2^31 - 1)^2 x 2 bytes > 2^64.
  const PoolShape huge{.layers = 4, .heads_kv = kMax, .head_dim = kMax, .heads_q = kMax};
  CHECK(device_footprint<CellHost>({.max_write = 4, .max_cells = 4096}, huge, {.element_bytes = 2}).status() ==
        Errc::size_overflow);
  CHECK(device_footprint<SeqHost>({.max_write = 4, .max_len = 4096}, huge, {.element_bytes = 2}).status() ==
        Errc::size_overflow);
  // The same pools with an element size near 2^64.
  CHECK(device_footprint<CellHost>({.max_write = 4, .max_cells = 4096}, kShape,
                                   {.element_bytes = std::numeric_limits<std::size_t>::max() / 2})
            .status() == Errc::size_overflow);
}

TEST_CASE("footprint refuses a step block whose prefill items pass int32") {
  // max_write 2^20 tokens of group 2^18: 2^38 / 64 + 2^20 prefill items per window > 2^31 - 1.
  const PoolShape wide_group{.layers = 3, .heads_kv = 1, .head_dim = 64, .heads_q = 1 << 18};
  CHECK(device_footprint<CellHost>({.max_write = 1 << 20, .max_cells = 1 << 20}, wide_group, {.element_bytes = 2})
            .status() == Errc::size_overflow);
  CHECK(step_block_shape<CellHost>({.max_write = 1 << 20, .max_cells = 1 << 20}, wide_group, true).status() ==
        Errc::size_overflow);
}

TEST_CASE("footprint: the step block holds the prefill items of 64-row items, up to int32") {
  // max_write 2^20 tokens: 2^14 group + 2^20 items of 64 rows. Group 131007: 2^31 - 16384 items,
  // the most that fit an int32 count; group 131008: 2^31, refused (with items of 128 rows both
  // would need about 2^30).
  constexpr std::int32_t kW = 1 << 20;
  const CacheConfig c{.max_write = kW, .max_cells = 1 << 20};
  const PoolShape fits{.layers = 1, .heads_kv = 1, .head_dim = 64, .heads_q = 131007};
  const PoolShape past{.layers = 1, .heads_kv = 1, .head_dim = 64, .heads_q = 131008};
  const Result<StepBlockShape> most = step_block_shape<CellHost>(c, fits, false);
  REQUIRE(most.ok());
  CHECK(most.value().max_prefill == std::int64_t{kW} * 131007 / 64 + kW);
  CHECK(most.value().max_prefill == std::numeric_limits<std::int32_t>::max() - 16383);
  CHECK(step_block_shape<CellHost>(c, past, false).status() == Errc::size_overflow);
  CHECK(device_footprint<CellHost>(c, past, {.element_bytes = 2}).status() == Errc::size_overflow);
  REQUIRE(device_footprint<CellHost>(c, fits, {.element_bytes = 2}).ok());
  // The capacity covers the items plan_window makes of 64 rows, ceil(len x group / 64) per segment:
  // one segment of every token, or a segment per token (the most items: each one's rows rounded up;
  // group 65 needs 2 items a token, more than w x 65 / 128 + w would hold).
  for (std::int32_t group = 1; group <= 200; ++group) {
    for (const std::int32_t w : {1, 2, 17, 64, 65, 1000}) {
      CAPTURE(group);
      CAPTURE(w);
      CHECK(max_prefill_items(w, group) >= (std::int64_t{w} * group + 63) / 64);
      CHECK(max_prefill_items(w, group) >= std::int64_t{w} * ((group + 63) / 64));
    }
  }
}

TEST_CASE("footprint: pool bytes per cell of every storage, fp8 with its scales") {
  // 2 (K, V) x 3 layers x 2 heads x (64 elements + scale).
  CHECK(pool_bytes_per_cell(kShape, KvStorage::bf16).value() == 2 * 3 * 2 * 64 * 2);
  CHECK(pool_bytes_per_cell(kShape, KvStorage::fp16).value() == 2 * 3 * 2 * 64 * 2);
  CHECK(pool_bytes_per_cell(kShape, KvStorage::fp32).value() == 2 * 3 * 2 * 64 * 4);
  CHECK(pool_bytes_per_cell(kShape, KvStorage::fp8_e4m3).value() == 2 * 3 * 2 * (64 + 4));
  // A Llama-3-8B-like shape: 32 layers, 8 KV heads, D 128: 128 KiB per cell in bf16, 66 KiB in fp8.
  const PoolShape llama{.layers = 32, .heads_kv = 8, .head_dim = 128, .heads_q = 32};
  CHECK(pool_bytes_per_cell(llama, KvStorage::bf16).value() == 131072);
  CHECK(pool_bytes_per_cell(llama, KvStorage::fp8_e4m3).value() == 67584);
  // What device_footprint's kv_pools grows by per cell of capacity, for the same storage.
  for (const KvStorage st : {KvStorage::bf16, KvStorage::fp16, KvStorage::fp32, KvStorage::fp8_e4m3}) {
    const StorageBytes b = storage_bytes(st);
    const DeviceParts parts{.element_bytes = b.element, .scale_bytes = b.scale};
    const auto kv = [&](std::int32_t cells) {
      return device_footprint<CellHost>({.max_write = 4, .max_cells = cells}, kShape, parts).value().kv_pools;
    };
    CHECK(kv(101) - kv(100) == pool_bytes_per_cell(kShape, st).value());
  }
}

TEST_CASE("footprint: pool bytes per cell refuses a non-positive shape and sizes that overflow") {
  for (const PoolShape bad : {PoolShape{0, 2, 64, 8}, PoolShape{3, 0, 64, 8}, PoolShape{3, 2, 0, 8}, PoolShape{3, 2, -64, 8}})
    CHECK(pool_bytes_per_cell(bad, KvStorage::fp8_e4m3).status() == Errc::bad_shape);
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  const PoolShape huge{.layers = kMax, .heads_kv = kMax, .head_dim = kMax, .heads_q = kMax};
  CHECK(pool_bytes_per_cell(huge, KvStorage::fp8_e4m3).status() == Errc::size_overflow);
  // A scale size near 2^64 overflows the row-head's bytes in device_footprint.
  CHECK(device_footprint<CellHost>({.max_write = 4, .max_cells = 64}, kShape,
                                   {.element_bytes = 1, .scale_bytes = std::numeric_limits<std::size_t>::max() - 10})
            .status() == Errc::size_overflow);
}

TEST_CASE("footprint: window storage keeps window_cells rows for windowed layers, and their tables") {
  // CellHost's layers have windows {0, 4, 0}: two layers of 101 rows (100 + scratch), one of 21
  // (window_cells 20 + scratch), 2 heads x 64 x 2 bytes x K and V = 512 bytes a row:
  // (2 x 101 + 21) x 512 = 114176. Tables: the main one (4672 bytes, above) and the window pool's:
  // 8 sequences x 2 directory entries (positions reach the main pool's 128) + (2 + 3 x 8) pages
  // (the main table's 2 + 2 x 8, and one more a sequence) x 64 = 1680 ints = 6720 bytes.
  const CacheConfig c{.max_write = 7, .max_cells = 100, .window_cells = 20};
  const Result<Footprint> f = device_footprint<CellHost>(c, kShape, {.element_bytes = 2});
  REQUIRE(f.ok());
  CHECK(f.value().kv_pools == 114176);
  CHECK(f.value().position_table == 4672 + 6720);
  CHECK(f.value().total == f.value().kv_pools + f.value().step_block + f.value().position_table);
  // A shard of another layer count cannot be split by window.
  CHECK(device_footprint<CellHost>(c, {.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 8}, {.element_bytes = 2})
            .status() == Errc::bad_shape);
  CHECK(device_footprint<CellHost>({.max_write = 7, .max_cells = 100, .window_cells = 6}, kShape, {.element_bytes = 2})
            .status() == Errc::bad_argument);  // fewer cells than max_write
}

TEST_CASE("footprint refuses window storage whose tables together pass int32 entries on the device") {
  // Each table fits int32 on its own (the host cache accepts the config), but the device keeps the
  // main table and the window pool's in one array that table writes index by int32.
  const CacheConfig c{.max_write = 64, .max_cells = 1'200'000'000, .max_seqs = 1, .window_cells = 1'200'000'000};
  REQUIRE(CellHost::validate(c).ok());
  CHECK(device_footprint<CellHost>(c, kShape, {.element_bytes = 2}).status() == Errc::size_overflow);
  // A window table spans the main pool's positions whatever window_cells is: 10^9 cells each fit.
  const CacheConfig smaller{.max_write = 64, .max_cells = 1'000'000'000, .max_seqs = 1, .window_cells = 1'000'000'000};
  CHECK(device_footprint<CellHost>(smaller, kShape, {.element_bytes = 2}).ok());
}

TEST_CASE("footprint: a 5:1 model of window 1024 at 32k context keeps about a fifth of full storage") {
  // Gemma-style: five layers of window 1024 to one global layer; 8 sequences of 32768 positions,
  // steps of up to 256 tokens; a window pool of 8 x (1024 + 64 + 256) cells.
  using Gemma = CellCache<Windows<1024, 1024, 1024, 1024, 1024, 0>, placement::lowest_free, 8>;
  const PoolShape shape{.layers = 6, .heads_kv = 8, .head_dim = 128, .heads_q = 32};
  const CacheConfig full{.max_write = 256, .max_cells = 8 * 32768, .max_seqs = 8};
  CacheConfig windowed = full;
  windowed.window_cells = 8 * (1024 + 64 + 256);
  const std::uint64_t row = 2ULL * 8 * 128 * 2;  // K and V, 8 heads of 128 bf16
  const std::uint64_t want_full = 6ULL * (8 * 32768 + 1) * row;
  const std::uint64_t want_windowed = (1ULL * (8 * 32768 + 1) + 5ULL * (8 * (1024 + 64 + 256) + 1)) * row;
  const std::size_t got_full = device_footprint<Gemma>(full, shape, {.element_bytes = 2}).value().kv_pools;
  const std::size_t got_windowed = device_footprint<Gemma>(windowed, shape, {.element_bytes = 2}).value().kv_pools;
  CHECK(got_full == want_full);
  CHECK(got_windowed == want_windowed);
  MESSAGE("KV bytes with window storage / full storage: " << static_cast<double>(got_windowed) / static_cast<double>(got_full));
}
