// Randomized differential runs: the cache against the brute-force oracle (oracle.hpp), driven by
// op_driver.hpp, for both layouts, lowest_free and clustered placements and the tests' own
// after_last (after_last_placement.hpp, nothing of it in include/), several window sets and
// small capacities so that every refusal (out_of_cells, sequence_full, no_free_sequence, ...)
// happens often. Every run's seed derives from a fixed base and the optional environment variable
// CELLKV_SEED (any integer), so CI can vary it; a failure prints the seed and the base.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "after_last_placement.hpp"
#include "cellkv/kv_cache.hpp"
#include "op_driver.hpp"

namespace {

using namespace cellkv;
using test::DriverStats;
using test::GeneratorEntropy;
using test::OpDriver;

constexpr std::uint64_t kBaseSeed = 0xC311'CA5E'D1FF'0001ULL;

std::uint64_t splitmix(std::uint64_t x) {
  x += 0x9E37'79B9'7F4A'7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58'476D'1CE4'E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D0'49BB'1331'11EBULL;
  return x ^ (x >> 31);
}

// kBaseSeed, varied by CELLKV_SEED when set.
std::uint64_t base_seed() {
  static const std::uint64_t base = [] {
    const char* env = std::getenv("CELLKV_SEED");
    return env != nullptr && *env != '\0' ? splitmix(kBaseSeed ^ std::strtoull(env, nullptr, 0)) : kBaseSeed;
  }();
  return base;
}

// Ranges the random configuration of a run is drawn from (inclusive).
struct Sizes {
  std::int32_t write_lo = 1, write_hi = 9;    // max_write
  std::int32_t cells_lo = 24, cells_hi = 64;  // max_cells (cell layout)
  std::int32_t seqs_lo = 3, seqs_hi = 8;      // max_seqs; 0..0 means "leave 0" (= MaxSeqs)
  std::int32_t len_lo = 4, len_hi = 24;       // max_len (sequence layout)
};

// The default sizes are small, so the pool fills and ids run out; a run sometimes leaves max_seqs
// at 0 (= MaxSeqs) when MaxSeqs is small.
template <class Cache>
CacheConfig random_config(GeneratorEntropy& e, const Sizes& z) {
  CacheConfig c;
  c.max_write = e.range(z.write_lo, z.write_hi);
  c.max_seqs = e.range(z.seqs_lo, z.seqs_hi);
  if (Cache::kMaxSeqs <= 8 && e.below(4) == 0) c.max_seqs = 0;
  if constexpr (OpDriver<Cache>::kCellLayout) c.max_cells = e.range(z.cells_lo, z.cells_hi);
  else c.max_len = e.range(z.len_lo, z.len_hi);
  return c;
}

// `runs` fresh caches of `ops` random operations each; returns the summed counters.
template <class Cache>
DriverStats differential(std::uint64_t case_id, int runs, std::int64_t ops, const Sizes& sizes = {},
                         const test::OpMix& mix = {}) {
  DriverStats total;
  for (int run = 0; run < runs; ++run) {
    const std::uint64_t seed = splitmix(base_seed() ^ splitmix(case_id * 1000 + static_cast<std::uint64_t>(run)));
    GeneratorEntropy e(seed);
    const CacheConfig config = random_config<Cache>(e, sizes);
    const char* env = std::getenv("CELLKV_SEED");
    const std::string env_seed = env != nullptr ? env : "unset";
    // Logged with any failure in this scope, a crash included.
    INFO("case ", case_id, " run ", run, " seed ", seed, " (base ", base_seed(), ", CELLKV_SEED=", env_seed, ")");
    OpDriver<Cache> driver(config, mix);
    const std::string mismatch = driver.run(e, ops);
    CHECK_MESSAGE(mismatch.empty(), mismatch);
    total.add(driver.stats());
    if (!mismatch.empty()) break;
  }
  return total;
}

// The counters prove the runs reached the states that matter, not just the easy paths.
void check_common_coverage(const DriverStats& s) {
  CHECK(s.count(Errc::empty_step) > 0);
  CHECK(s.count(Errc::step_too_wide) > 0);
  CHECK(s.count(Errc::bad_sequence_id) > 0);
  CHECK(s.count(Errc::sequence_not_live) > 0);
  CHECK(s.count(Errc::no_free_sequence) > 0);
  CHECK(s.count(Errc::bad_position) > 0);
  CHECK(s.tokens_placed > 0);
  CHECK(s.mask_rows_checked > 0);
  CHECK(s.ops[static_cast<std::size_t>(test::OpKind::clear)] > 0);
}

// The sequence edits ran, succeeded and were refused for every reason their layout has.
void check_edit_coverage(const DriverStats& s, bool cell_layout) {
  using test::OpKind;
  for (const OpKind k : {OpKind::seq_rm_range, OpKind::seq_cp, OpKind::seq_keep, OpKind::seq_add, OpKind::seq_div,
                         OpKind::pos_range, OpKind::restore})
    CHECK(s.op(k) > 0);
  CHECK(s.edits_ok > 0);
  CHECK(s.count(Errc::bad_argument) > 0);  // seq_div by d < 1
  if (cell_layout) {
    CHECK(s.count(Errc::position_collision) > 0);
    CHECK(s.holes > 0);       // states with holes were checked, the device table included
    CHECK(s.cow_copies > 0);  // shifts of shared cells copied them
    CHECK(s.rotations > 0);   // and listed re-rotations
  } else {
    CHECK(s.count(Errc::unsupported_by_layout) > 0);
  }
}

constexpr int kRuns = 12;
constexpr std::int64_t kOps = 3000;  // per run: 12 x 3000 = 36k per layout configuration

}  // namespace

TEST_CASE("differential: cell layout, lowest_free placement") {
  DriverStats s;
  s.add(differential<CellCache<Windows<0>, placement::lowest_free, 8>>(1, kRuns, kOps));
  s.add(differential<CellCache<Windows<0, 3>, placement::lowest_free, 64>>(2, kRuns, kOps));
  s.add(differential<CellCache<Windows<5, 0, 2>, placement::lowest_free, 256>>(3, kRuns, kOps));
  MESSAGE("cell/lowest_free: ", s.total_ops(), " operations, ", s.tokens_placed, " tokens, ", s.mask_rows_checked,
          " mask rows");
  check_common_coverage(s);
  check_edit_coverage(s, true);
  CHECK(s.count(Errc::out_of_cells) > 0);
  CHECK(s.max_owners >= 2);  // forks shared cells
}

TEST_CASE("differential: cell layout, clustered<4> placement") {
  DriverStats s;
  s.add(differential<CellCache<Windows<0, 3>, placement::clustered<4>, 8>>(11, kRuns, kOps));
  s.add(differential<CellCache<Windows<5, 0, 2>, placement::clustered<4>, 64>>(12, kRuns, kOps));
  MESSAGE("cell/clustered<4>: ", s.total_ops(), " operations, ", s.tokens_placed, " tokens");
  check_common_coverage(s);
  check_edit_coverage(s, true);
  CHECK(s.count(Errc::out_of_cells) > 0);
  CHECK(s.max_owners >= 2);
}

TEST_CASE("differential: cell layout, clustered<8> placement") {
  DriverStats s;
  s.add(differential<CellCache<Windows<0>, placement::clustered<8>, 256>>(21, kRuns, kOps));
  s.add(differential<CellCache<Windows<5, 0, 2>, placement::clustered<8>, 8>>(22, kRuns, kOps));
  MESSAGE("cell/clustered<8>: ", s.total_ops(), " operations, ", s.tokens_placed, " tokens");
  check_common_coverage(s);
  check_edit_coverage(s, true);
  CHECK(s.count(Errc::out_of_cells) > 0);
  CHECK(s.max_owners >= 2);
}

// A placement defined in the tests alone: the cache takes it with no change to include/, and the
// oracle predicts its rows exactly.
TEST_CASE("differential: cell layout, test::after_last placement") {
  DriverStats s;
  s.add(differential<CellCache<Windows<0>, test::after_last, 8>>(71, kRuns, kOps));
  s.add(differential<CellCache<Windows<0, 3>, test::after_last, 64>>(72, kRuns, kOps));
  s.add(differential<CellCache<Windows<5, 0, 2>, test::after_last, 256>>(73, kRuns, kOps));
  MESSAGE("cell/after_last: ", s.total_ops(), " operations, ", s.tokens_placed, " tokens");
  check_common_coverage(s);
  check_edit_coverage(s, true);
  CHECK(s.count(Errc::out_of_cells) > 0);
  CHECK(s.max_owners >= 2);
}

TEST_CASE("differential: sequence layout") {
  DriverStats s;
  s.add(differential<SequenceCache<Windows<0, 3>, 8>>(31, kRuns, kOps));
  s.add(differential<SequenceCache<Windows<5, 0, 2>, 64>>(32, kRuns, kOps));
  s.add(differential<SequenceCache<Windows<0>, 256>>(33, kRuns, kOps));
  MESSAGE("sequence: ", s.total_ops(), " operations, ", s.tokens_placed, " tokens");
  check_common_coverage(s);
  check_edit_coverage(s, false);
  CHECK(s.count(Errc::sequence_full) > 0);
}

// Beyond one 64-bit word: free/used bitmaps of hundreds of cells, the two-level bitmap's summary
// past 4096 cells, block bitmaps past 64 blocks, and id sets of several words (MaxSeqs 70 leaves
// a partial last word; max_seqs 0 means all of them).
TEST_CASE("differential: wide pools and many sequences") {
  // More sequences made than removed, so every id gets used.
  constexpr test::OpMix kMany{.declare_step = 300, .seq_new = 200, .seq_clone = 150, .seq_rm = 60, .rewind = 80,
                              .query = 60, .acknowledge = 100, .copy = 5, .clear = 1};
  DriverStats cells;
  cells.add(differential<CellCache<Windows<0, 3>, placement::lowest_free, 70>>(
      41, 3, 2500, {.write_lo = 1, .write_hi = 40, .cells_lo = 65, .cells_hi = 300, .seqs_lo = 0, .seqs_hi = 0}, kMany));
  cells.add(differential<CellCache<Windows<0, 3>, placement::clustered<4>, 256>>(
      42, 3, 2500, {.write_lo = 1, .write_hi = 40, .cells_lo = 65, .cells_hi = 300, .seqs_lo = 60, .seqs_hi = 130},
      kMany));
  MESSAGE("wide cell pools: ", cells.total_ops(), " operations, read_len up to ", cells.max_read_len, ", up to ",
          cells.max_live, " live sequences");
  CHECK(cells.max_read_len > 128);
  CHECK(cells.count(Errc::no_free_sequence) > 0);

  // Mostly steps, so the pool fills past 4096 cells before anything shrinks it much.
  constexpr test::OpMix kGrow{.declare_step = 800, .seq_new = 40, .seq_clone = 40, .seq_rm = 8, .rewind = 8,
                              .query = 20, .acknowledge = 60, .copy = 5, .clear = 0};
  constexpr Sizes kHuge{.write_lo = 96, .write_hi = 160, .cells_lo = 4200, .cells_hi = 4400, .seqs_lo = 4, .seqs_hi = 12};
  DriverStats huge;
  huge.add(differential<CellCache<Windows<0>, placement::lowest_free, 256>>(43, 2, 300, kHuge, kGrow));
  huge.add(differential<CellCache<Windows<0>, placement::clustered<8>, 256>>(44, 2, 300, kHuge, kGrow));
  MESSAGE("pools past 4096 cells: ", huge.total_ops(), " operations, read_len up to ", huge.max_read_len);
  CHECK(huge.max_read_len > 4096);
  CHECK(huge.count(Errc::out_of_cells) > 0);

  constexpr Sizes kSlots{.write_lo = 1, .write_hi = 40, .seqs_lo = 0, .seqs_hi = 0, .len_lo = 4, .len_hi = 16};
  DriverStats slots;
  slots.add(differential<SequenceCache<Windows<5, 0, 2>, 256>>(45, 3, 2500, kSlots, kMany));
  slots.add(differential<SequenceCache<Windows<0>, 70>>(46, 3, 2500, kSlots, kMany));
  MESSAGE("many slots: ", slots.total_ops(), " operations, up to ", slots.max_live, " live sequences");
  CHECK(slots.max_live > 64);
  CHECK(slots.count(Errc::no_free_sequence) > 0);
}

// Sequences several position-table pages long (64 positions each): forks share full pages and
// copy a partial one, rewinds inside a shared page copy it first, removals free pages that
// refilled holes then reuse. The device copy of the table is checked after every operation.
TEST_CASE("differential: position tables over several pages, with forks and rewinds") {
  constexpr test::OpMix kForks{.declare_step = 500, .seq_new = 40, .seq_clone = 120, .seq_rm = 60, .rewind = 120,
                               .query = 20, .acknowledge = 100, .copy = 5, .clear = 2};
  constexpr Sizes kLong{.write_lo = 24, .write_hi = 64, .cells_lo = 300, .cells_hi = 700, .seqs_lo = 2, .seqs_hi = 6};
  DriverStats s;
  s.add(differential<CellCache<Windows<0, 70>, placement::lowest_free, 8>>(61, 4, 2000, kLong, kForks));
  s.add(differential<CellCache<Windows<0>, placement::clustered<64>, 8>>(62, 4, 2000, kLong, kForks));
  s.add(differential<CellCache<Windows<0, 70>, test::after_last, 8>>(63, 4, 2000, kLong, kForks));
  MESSAGE("multi-page tables: ", s.total_ops(), " operations, up to ", s.max_pages, " pages, longest sequence ",
          s.max_seq_len);
  CHECK(s.max_seq_len > 3 * kPagePositions);
  CHECK(s.max_owners >= 3);
  CHECK(s.count(Errc::out_of_cells) > 0);
}

// Pools smaller than a block or a step: max_cells 1..12 (clustered<8> then has at most one full
// block and a partial tail), max_len 1..3.
TEST_CASE("differential: tiny pools") {
  DriverStats s;
  s.add(differential<CellCache<Windows<0, 3>, placement::lowest_free, 8>>(
      51, 6, 1500, {.write_lo = 1, .write_hi = 4, .cells_lo = 1, .cells_hi = 12}));
  s.add(differential<CellCache<Windows<0, 3>, placement::clustered<8>, 8>>(
      52, 6, 1500, {.write_lo = 1, .write_hi = 4, .cells_lo = 1, .cells_hi = 12}));
  s.add(differential<CellCache<Windows<0, 3>, test::after_last, 8>>(
      54, 6, 1500, {.write_lo = 1, .write_hi = 4, .cells_lo = 1, .cells_hi = 12}));
  s.add(differential<SequenceCache<Windows<0, 3>, 8>>(
      53, 6, 1500, {.write_lo = 1, .write_hi = 4, .len_lo = 1, .len_hi = 3}));
  MESSAGE("tiny pools: ", s.total_ops(), " operations");
  CHECK(s.count(Errc::out_of_cells) > 0);
  CHECK(s.count(Errc::sequence_full) > 0);
}

// Edits over several table pages, in tables kept small (few cells per sequence slot of the
// directory): holes spread sequences over more pages than the no-hole bound counts, so steps,
// forks and edits meet out_of_pages, and shifts past the table's span meet sequence_full.
TEST_CASE("differential: sequence edits over several pages, pages running out") {
  constexpr test::OpMix kEdits{.declare_step = 400, .seq_new = 30, .seq_clone = 80, .seq_rm = 20, .rewind = 40,
                               .query = 10, .acknowledge = 80, .copy = 3, .clear = 2, .seq_rm_range = 120,
                               .seq_cp = 80, .seq_keep = 2, .seq_add = 150, .seq_div = 40, .pos_range = 10};
  constexpr Sizes kPages{.write_lo = 8, .write_hi = 64, .cells_lo = 400, .cells_hi = 900, .seqs_lo = 2, .seqs_hi = 3};
  DriverStats s;
  s.add(differential<CellCache<Windows<0, 70>, placement::lowest_free, 8>>(81, 6, 3000, kPages, kEdits));
  s.add(differential<CellCache<Windows<0>, placement::clustered<64>, 8>>(82, 6, 3000, kPages, kEdits));
  s.add(differential<CellCache<Windows<0, 70>, test::after_last, 8>>(83, 6, 3000, kPages, kEdits));
  MESSAGE("edits over pages: ", s.total_ops(), " operations, ", s.edits_ok, " edits applied, ", s.cow_copies,
          " copies and ", s.rotations, " rotations seen pending, up to ", s.max_pages, " pages, ",
          s.count(Errc::out_of_pages), " out_of_pages");
  check_edit_coverage(s, true);
  CHECK(s.max_seq_len > 2 * kPagePositions);
  CHECK(s.count(Errc::out_of_pages) > 0);
  CHECK(s.count(Errc::sequence_full) > 0);
}
