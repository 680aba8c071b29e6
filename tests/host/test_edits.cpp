// Sequence edits (docs/design.md section 4, "Sequence edits"): seq_pos_min/max, seq_rm of a range,
// seq_cp, seq_keep, seq_add, seq_div. Each case states the expected cells, positions, masks,
// pending copies and re-rotations by hand; every refusal compares the whole cache with a copy
// taken before the call and checks a placed step survives it. The random differential
// (test_differential.cpp) covers the same verbs against the oracle.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/placement/clustered.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using test::Rows;
using Cell = CellCache<Windows<0, 3>, placement::lowest_free, 8>;
using Seq = SequenceCache<Windows<0, 3>, 8>;

constexpr std::int32_t kEnd = -1;  // p1 < 0: no end

// A sequence of n tokens in one step each call (steps of at most max_write tokens).
template <class Cache>
std::int32_t filled(Cache& cache, std::int32_t n) {
  const std::int32_t id = cache.seq_new().value();
  while (n > 0) {
    const std::int32_t t = std::min(n, cache.max_write());
    const std::vector<std::int32_t> ids(static_cast<std::size_t>(t), id);
    REQUIRE(cache.declare_step(ids).ok());
    n -= t;
  }
  return id;
}

// The cell of every position of id below pos(id) (-1 for holes).
Rows cells_of(const Cell& cache, std::int32_t id) {
  Rows out;
  for (std::int32_t p = 0; p < cache.pos(id).value(); ++p) out.push_back(cache.cell_of(id, p));
  return out;
}

// The refusal returns `want`, changes nothing, and the placed step survives it.
template <class Cache>
void refused(Cache& cache, Status got, Errc want, const Cache& before) {
  CHECK(got == want);
  CHECK(cache == before);
}

// A placed step of one token of id; the verb run afterwards invalidates it.
template <class Cache>
void place_one(Cache& cache, std::int32_t id) {
  const std::vector<std::int32_t> ids{id};
  REQUIRE(cache.declare_step(ids).ok());
  REQUIRE(cache.step_placed());
}

std::vector<RowRotation> sorted_rotations(const Cell& cache) {
  const auto r = cache.pending_changes().rotations;
  std::vector<RowRotation> out(r.begin(), r.end());
  std::sort(out.begin(), out.end(), [](const RowRotation& a, const RowRotation& b) { return a.cell < b.cell; });
  return out;
}
std::vector<RowCopy> copies(const Cell& cache) {
  const auto c = cache.pending_changes().copies;
  return {c.begin(), c.end()};
}

}  // namespace

TEST_CASE("seq_pos_min / seq_pos_max: -1 for a sequence holding nothing, refusals for bad ids") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = cache.seq_new().value();
  CHECK(cache.seq_pos_min(a).value() == -1);
  CHECK(cache.seq_pos_max(a).value() == -1);
  const std::vector<std::int32_t> ids(6, a);
  REQUIRE(cache.declare_step(ids).ok());
  CHECK(cache.seq_pos_min(a).value() == 0);
  CHECK(cache.seq_pos_max(a).value() == 5);
  REQUIRE(cache.seq_rm(a, 0, 2).ok());
  CHECK(cache.seq_pos_min(a).value() == 2);
  CHECK(cache.seq_pos_max(a).value() == 5);
  REQUIRE(cache.seq_rm(a, kEnd, kEnd).ok());
  CHECK(cache.seq_pos_min(a).value() == -1);
  CHECK(cache.seq_pos_max(a).value() == -1);
  CHECK(cache.seq_pos_min(3).status() == Errc::sequence_not_live);
  CHECK(cache.seq_pos_max(-1).status() == Errc::bad_sequence_id);
  CHECK(cache.seq_pos_max(8).status() == Errc::bad_sequence_id);

  Seq slots({.max_write = 8, .max_len = 16});
  const auto s = filled(slots, 5);
  CHECK(slots.seq_pos_min(s).value() == 0);
  CHECK(slots.seq_pos_max(s).value() == 4);
  CHECK(slots.seq_pos_min(s + 1).status() == Errc::sequence_not_live);
}

TEST_CASE("seq_rm of a range: holes, the next position, masks and table") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 8);  // cells 0..7 at positions 0..7
  place_one(cache, a);              // position 8 at cell 8
  REQUIRE(cache.seq_rm(a, 2, 5).ok());
  CHECK_FALSE(cache.step_placed());
  CHECK(cells_of(cache, a) == Rows{0, 1, -1, -1, -1, 5, 6, 7, 8});
  CHECK(cache.pos(a).value() == 9);  // the next position stays max + 1
  CHECK(cache.free_cells() == 64 - 6);
  for (const std::int32_t c : {2, 3, 4}) {
    CHECK(cache.cell_pos(c) == -1);
    CHECK(cache.cell_owners(c).empty());
  }
  // The next token: position 9, sees every held position; through window 3, positions 7..9.
  REQUIRE(test::declare(cache, {a}).ok());
  CHECK(test::step_positions(cache) == test::Positions{9});
  CHECK(test::step_rows(cache) == Rows{2});  // lowest_free refills the hole's cell
  CHECK(test::visible_rows(cache, 0, 0) == Rows{0, 1, 2, 5, 6, 7, 8});
  CHECK(test::visible_rows(cache, 3, 0) == Rows{2, 7, 8});

  SUBCASE("a window whose positions are all holes sees only the token itself") {
    REQUIRE(cache.seq_rm(a, 7, 9).ok());
    REQUIRE(cache.pos(a).value() == 10);
    REQUIRE(test::declare(cache, {a}).ok());
    CHECK(test::step_positions(cache) == test::Positions{10});
    CHECK(test::visible_rows(cache, 3, 0) == Rows{2, 3});  // positions 9 (cell 2) and 10 (cell 3)
  }
  SUBCASE("a suffix: the sequence ends at its highest held position") {
    REQUIRE(cache.seq_rm(a, 5, kEnd).ok());
    CHECK(cache.pos(a).value() == 2);  // positions 2..4 were holes: trimmed too
    CHECK(cells_of(cache, a) == Rows{0, 1});
  }
  SUBCASE("p0 < 0 reads as 0; the whole sequence leaves it live and empty") {
    REQUIRE(cache.seq_rm(a, -7, kEnd).ok());
    CHECK(cache.is_live(a));
    CHECK(cache.pos(a).value() == 0);
    CHECK(cache.free_cells() == 64);
    CHECK(cache.used_end() == 0);
  }
  SUBCASE("empty and reversed ranges change nothing but the placed step") {
    const Cell before = cache;
    REQUIRE(cache.seq_rm(a, 4, 4).ok());
    REQUIRE(cache.seq_rm(a, 6, 3).ok());
    REQUIRE(cache.seq_rm(a, 50, kEnd).ok());
    CHECK_FALSE(cache.step_placed());
    CHECK(cells_of(cache, a) == cells_of(before, a));
    CHECK(cache.free_cells() == before.free_cells());
  }
}

TEST_CASE("seq_rm of a range in a fork: shared cells stay for the source, pages are copied on write") {
  Cell cache({.max_write = 64, .max_cells = 256});
  const auto a = filled(cache, 130);  // pages 0 and 1 full, page 2 partial
  const auto b = cache.seq_clone(a).value();
  const Rows a_cells = cells_of(cache, a);
  const std::int32_t page0 = cache.table().view().page_of(a, 0);
  REQUIRE(cache.table().holders(page0) == 2);
  REQUIRE(cache.seq_rm(b, 10, 20).ok());
  CHECK(cells_of(cache, a) == a_cells);  // the source sees nothing change
  CHECK(cache.table().view().page_of(a, 0) == page0);
  CHECK(cache.table().view().page_of(b, 0) != page0);  // b took a private copy of page 0
  CHECK(cache.table().holders(page0) == 1);
  CHECK(cache.free_cells() == 256 - 130);  // a still owns the cells
  for (std::int32_t p = 10; p < 20; ++p) {
    CHECK(cache.cell_of(b, p) == -1);
    CHECK(cache.cell_owners(static_cast<std::int32_t>(a_cells[static_cast<std::size_t>(p)])).count() == 1);
  }
  // A whole page of holes is not kept: removing positions 64..127 of b releases its page 1.
  REQUIRE(cache.seq_rm(b, 64, 128).ok());
  CHECK(cache.table().view().page_of(b, 64) == -1);
  CHECK(cache.pos(b).value() == 130);
  CHECK(cache.seq_pos_max(b).value() == 129);
}

TEST_CASE("seq_rm of a range: refusals change nothing") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 8);
  place_one(cache, a);
  const Cell before = cache;
  refused(cache, cache.seq_rm(7, 0, 1), Errc::sequence_not_live, before);
  refused(cache, cache.seq_rm(-1, 0, 1), Errc::bad_sequence_id, before);
  refused(cache, cache.seq_rm(8, 0, 1), Errc::bad_sequence_id, before);
  CHECK(cache.step_placed());

  SUBCASE("sequence layout: only a suffix") {
    Seq slots({.max_write = 8, .max_len = 16});
    const auto s = filled(slots, 8);
    place_one(slots, s);
    const Seq kept = slots;
    refused(slots, slots.seq_rm(s, 2, 5), Errc::unsupported_by_layout, kept);
    refused(slots, slots.seq_rm(s, kEnd, 3), Errc::unsupported_by_layout, kept);
    CHECK(slots.step_placed());
    REQUIRE(slots.seq_rm(s, 4, 4).ok());  // empty: served
    REQUIRE(slots.seq_rm(s, 5, kEnd).ok());
    CHECK(slots.pos(s).value() == 5);
    REQUIRE(slots.seq_rm(s, 3, 100).ok());  // p1 past the end: a suffix
    CHECK(slots.pos(s).value() == 3);
    CHECK(slots.free_cells() == slots.capacity() - 3);
  }
}

TEST_CASE("seq_cp: dst sees src's cells at their positions, zero copy") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 6);  // cells 0..5
  const auto b = cache.seq_new().value();
  place_one(cache, b);              // b: position 0 at cell 6
  REQUIRE(cache.seq_cp(a, b, 2, 5).ok());
  CHECK_FALSE(cache.step_placed());
  CHECK(cells_of(cache, b) == Rows{6, -1, 2, 3, 4});
  CHECK(cache.pos(b).value() == 5);
  CHECK(cache.free_cells() == 64 - 7);  // nothing copied
  CHECK(cache.cell_owners(3).test(a));
  CHECK(cache.cell_owners(3).test(b));
  CHECK(cache.pending_changes().copies.empty());
  REQUIRE(test::declare(cache, {b}).ok());
  CHECK(test::step_positions(cache) == test::Positions{5});
  CHECK(test::visible_rows(cache, 0, 0) == Rows{2, 3, 4, 6, 7});
  CHECK(test::visible_rows(cache, 3, 0) == Rows{3, 4, 7});

  SUBCASE("copying what dst already shares is a no-op; a different cell collides") {
    const auto c = cache.seq_clone(a, 3).value();  // shares cells 0..2
    REQUIRE(cache.seq_cp(a, c, 0, 3).ok());
    CHECK(cells_of(cache, c) == Rows{0, 1, 2});
    REQUIRE(cache.seq_cp(a, c, 0, kEnd).ok());  // adds 3..5
    CHECK(cells_of(cache, c) == Rows{0, 1, 2, 3, 4, 5});
    const Cell before = cache;
    refused(cache, cache.seq_cp(a, b, 0, 1), Errc::position_collision, before);  // b holds cell 6 at 0
    refused(cache, cache.seq_cp(b, a, 5, 6), Errc::position_collision, before);  // a holds cell 5 at 5
  }
  SUBCASE("refusals: ids; src == dst is a no-op") {
    const Cell before = cache;
    refused(cache, cache.seq_cp(a, 5, 0, kEnd), Errc::sequence_not_live, before);
    refused(cache, cache.seq_cp(5, a, 0, kEnd), Errc::sequence_not_live, before);
    refused(cache, cache.seq_cp(a, 99, 0, kEnd), Errc::bad_sequence_id, before);
    REQUIRE(cache.seq_cp(a, a, 0, kEnd).ok());
    CHECK(cells_of(cache, a) == cells_of(before, a));
  }
  SUBCASE("sequence layout refuses, whatever the range") {
    Seq slots({.max_write = 8, .max_len = 16});
    const auto s = filled(slots, 4);
    const auto t = slots.seq_new().value();
    const Seq before = slots;
    refused(slots, slots.seq_cp(s, t, 0, kEnd), Errc::unsupported_by_layout, before);
    refused(slots, slots.seq_cp(s, t, 2, 2), Errc::unsupported_by_layout, before);
    refused(slots, slots.seq_cp(s, 7, 0, 1), Errc::sequence_not_live, before);
  }
}

TEST_CASE("seq_keep removes every other sequence; shared cells stay with the kept one") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 4);
  const auto b = cache.seq_clone(a, 2).value();
  place_one(cache, b);
  const auto c = filled(cache, 3);
  REQUIRE(cache.seq_keep(b).ok());
  CHECK_FALSE(cache.step_placed());
  CHECK(cache.live_count() == 1);
  CHECK_FALSE(cache.is_live(a));
  CHECK_FALSE(cache.is_live(c));
  CHECK(cells_of(cache, b) == Rows{0, 1, 4});
  CHECK(cache.free_cells() == 64 - 3);
  CHECK(cache.cell_owners(0).count() == 1);
  const Cell before = cache;
  refused(cache, cache.seq_keep(a), Errc::sequence_not_live, before);
  refused(cache, cache.seq_keep(-3), Errc::bad_sequence_id, before);

  Seq slots({.max_write = 8, .max_len = 16});
  const auto s = filled(slots, 4);
  filled(slots, 2);
  REQUIRE(slots.seq_keep(s).ok());
  CHECK(slots.live_count() == 1);
  CHECK(slots.free_cells() == slots.capacity() - 4);
}

namespace {

// Every live sequence's held positions and the cell of each.
template <class Cache>
std::vector<std::pair<std::int32_t, std::int32_t>> holdings(const Cache& cache) {
  std::vector<std::pair<std::int32_t, std::int32_t>> out;
  for (std::int32_t id = 0; id < 8; ++id)
    if (const auto held = cache.held_positions(id); held.ok())
      for (const std::int32_t p : held.value()) out.emplace_back(id, cache.cell_of(id, p));
  return out;
}

// Edits of an empty range (or of one clipped to nothing) on a (of `length` tokens) and a fork of
// it, which shares a's cells: each succeeds, every sequence keeps its positions and cells, nothing
// is pending, and the next step still places (the placement heard of the edits).
template <class Cache>
void empty_ranges_keep_positions(Cache cache, std::int32_t length) {
  const std::int32_t a = filled(cache, length);
  const std::int32_t fork = cache.seq_clone(a).value();
  const std::int32_t other = filled(cache, 2);
  cache.acknowledge_changes();
  const auto before = holdings(cache);
  CHECK(cache.seq_rm(fork, 1, 1).ok());
  CHECK(cache.seq_rm(fork, 2, 1).ok());              // reversed
  CHECK(cache.seq_rm(fork, length + 3, kEnd).ok());  // past the end: clipped to nothing
  CHECK(cache.seq_cp(other, fork, 5, kEnd).ok());
  CHECK(cache.seq_add(fork, 3, 3, 2).ok());
  CHECK(cache.seq_add(a, length, kEnd, -1).ok());
  CHECK(cache.seq_div(fork, 0, 0, 2).ok());
  CHECK(cache.rewind(fork, cache.pos(fork).value()).ok());
  CHECK(holdings(cache) == before);
  CHECK(cache.pos(fork).value() == length);
  CHECK(cache.pending_changes().copies.empty());
  CHECK(cache.pending_changes().rotations.empty());
  CHECK(test::declare(cache, {fork, a}).ok());
}

}  // namespace

TEST_CASE("edits of an empty range keep every sequence's positions and cells") {
  SUBCASE("clustered placement") {
    empty_ranges_keep_positions(CellCache<Windows<0, 3>, placement::clustered<4>, 8>({.max_write = 8, .max_cells = 64}),
                                6);
  }
  SUBCASE("window storage") {
    empty_ranges_keep_positions(CellCache<Windows<0, 16>, placement::lowest_free, 8>(
                                    {.max_write = 64, .max_cells = 1024, .window_cells = 512}),
                                164);
  }
}

TEST_CASE("seq_add: a context shift moves cells in place and lists their re-rotation") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 12);  // cells 0..11
  cache.acknowledge_changes();
  // Keep 4, drop the next 4, slide the rest down by 4.
  REQUIRE(cache.seq_rm(a, 4, 8).ok());
  place_one(cache, a);  // position 12 at cell 4
  REQUIRE(cache.seq_add(a, 8, kEnd, -4).ok());
  CHECK_FALSE(cache.step_placed());
  CHECK(cells_of(cache, a) == Rows{0, 1, 2, 3, 8, 9, 10, 11, 4});
  CHECK(cache.pos(a).value() == 9);
  CHECK(cache.cell_pos(8) == 4);
  CHECK(cache.cell_pos(4) == 8);
  CHECK(copies(cache).empty());  // a owned every moved cell alone
  CHECK(sorted_rotations(cache) ==
        std::vector<RowRotation>{{4, 12, 8}, {8, 8, 4}, {9, 9, 5}, {10, 10, 6}, {11, 11, 7}});
  REQUIRE(test::declare(cache, {a}).ok());
  CHECK(test::step_positions(cache) == test::Positions{9});
  CHECK(test::visible_rows(cache, 3, 0) == Rows{4, 5, 11});  // positions 7, 8, 9
}

TEST_CASE("seq_add: rotations compose, cancel, and leave with freed cells") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 6);  // cells 0..5
  cache.acknowledge_changes();
  REQUIRE(cache.seq_add(a, 3, kEnd, 10).ok());  // 3..5 -> 13..15
  CHECK(cache.pos(a).value() == 16);
  CHECK(cells_of(cache, a) == Rows{0, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 3, 4, 5});
  REQUIRE(cache.seq_add(a, 13, kEnd, -5).ok());  // -> 8..10: one entry per cell, from the original
  CHECK(sorted_rotations(cache) == std::vector<RowRotation>{{3, 3, 8}, {4, 4, 9}, {5, 5, 10}});
  REQUIRE(cache.seq_add(a, 8, kEnd, -5).ok());  // back home: nothing to rotate
  CHECK(sorted_rotations(cache).empty());
  CHECK(cache.pos(a).value() == 6);
  REQUIRE(cache.seq_add(a, 0, kEnd, -2).ok());  // positions 0, 1 drop out; 2..5 -> 0..3
  CHECK(cache.cell_pos(0) == -1);
  CHECK(cache.cell_pos(1) == -1);
  CHECK(cells_of(cache, a) == Rows{2, 3, 4, 5});
  CHECK(sorted_rotations(cache) == std::vector<RowRotation>{{2, 2, 0}, {3, 3, 1}, {4, 4, 2}, {5, 5, 3}});
  REQUIRE(cache.seq_rm(a, 2, 3).ok());  // cell 4 freed: its rotation goes too
  CHECK(sorted_rotations(cache) == std::vector<RowRotation>{{2, 2, 0}, {3, 3, 1}, {5, 5, 3}});
  cache.acknowledge_changes();
  CHECK(cache.pending_changes().rotations.empty());
  CHECK(cache.pending_changes().copies.empty());
  REQUIRE(cache.seq_add(a, 0, kEnd, std::numeric_limits<std::int32_t>::min()).ok());  // every cell drops
  CHECK(cache.pos(a).value() == 0);
  CHECK(cache.free_cells() == 64);
}

TEST_CASE("seq_add on shared cells: copy on write, no other sequence changes") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 6);  // cells 0..5
  const auto b = cache.seq_clone(a).value();
  cache.acknowledge_changes();
  const Rows b_cells = cells_of(cache, b);
  REQUIRE(cache.seq_rm(a, 2, 4).ok());
  REQUIRE(cache.seq_add(a, 4, kEnd, -2).ok());  // a's positions 4, 5 (cells 4, 5, shared) -> 2, 3
  CHECK(cells_of(cache, b) == b_cells);         // b: untouched
  CHECK(cache.cell_pos(4) == 4);
  CHECK(cache.cell_pos(5) == 5);
  CHECK(cells_of(cache, a) == Rows{0, 1, 6, 7});  // fresh cells from the placement (lowest free)
  CHECK(cache.cell_pos(6) == 2);
  CHECK(cache.cell_owners(6).count() == 1);
  CHECK(cache.cell_owners(4).count() == 1);
  CHECK(cache.cell_owners(4).test(b));
  CHECK(copies(cache) == std::vector<RowCopy>{{4, 6, 1}, {5, 7, 1}});
  CHECK(sorted_rotations(cache) == std::vector<RowRotation>{{6, 4, 2}, {7, 5, 3}});
  // Masks: a's next token sees its own cells only, b's sees its own.
  const std::vector<std::int32_t> both{a, b};
  REQUIRE(cache.declare_step(both).ok());
  CHECK(test::step_positions(cache) == test::Positions{4, 6});
  CHECK(test::visible_rows(cache, 0, 0) == Rows{0, 1, 6, 7, 8});
  CHECK(test::visible_rows(cache, 0, 1) == Rows{0, 1, 2, 3, 4, 5, 9});

  SUBCASE("a copy of a cell with a pending rotation inherits the position its K encodes") {
    cache.acknowledge_changes();
    REQUIRE(cache.seq_add(b, 0, kEnd, 3).ok());  // b alone owns 2..5 and 9: in place; 0, 1 shared
    CHECK(copies(cache) == std::vector<RowCopy>{{0, 10, 1}, {1, 11, 1}});
    const auto c = cache.seq_clone(b).value();   // c shares b's cells, some with pending rotations
    REQUIRE(cache.cell_of(c, 9) == 9);           // written at position 6, now at 9
    REQUIRE(cache.seq_add(c, 9, 10, 1).ok());    // shared with b: copied, K still at 6
    const auto rot = sorted_rotations(cache);
    const std::int32_t fresh = cache.cell_of(c, 10);
    CHECK(copies(cache).back() == RowCopy{9, fresh, 1});
    CHECK(std::find(rot.begin(), rot.end(), RowRotation{fresh, 6, 10}) != rot.end());
    CHECK(std::find(rot.begin(), rot.end(), RowRotation{9, 6, 9}) != rot.end());
    CHECK(cache.cell_of(b, 9) == 9);
  }
}

TEST_CASE("seq_add: refusals change nothing") {
  Cell cache({.max_write = 16, .max_cells = 16});
  const auto a = filled(cache, 6);
  place_one(cache, a);  // 7 positions
  const Cell before = cache;
  refused(cache, cache.seq_add(a, 0, 3, 2), Errc::position_collision, before);  // 0..2 -> 2..4: 3, 4 held
  refused(cache, cache.seq_add(a, 6, kEnd, -1), Errc::position_collision, before);
  refused(cache, cache.seq_add(a, 0, kEnd, 64), Errc::sequence_full, before);  // past position_limit() = 64
  refused(cache, cache.seq_add(a, 0, kEnd, std::numeric_limits<std::int32_t>::max()), Errc::sequence_full, before);
  refused(cache, cache.seq_add(9, 0, kEnd, 1), Errc::bad_sequence_id, before);
  refused(cache, cache.seq_add(3, 0, kEnd, 1), Errc::sequence_not_live, before);
  CHECK(cache.step_placed());
  CHECK(cache.position_limit() == 64);
  REQUIRE(cache.seq_add(a, 0, kEnd, 57).ok());  // 0..6 -> 57..63: the last position the table spans
  CHECK(cache.pos(a).value() == 64);

  SUBCASE("out of cells for the copies") {
    Cell full({.max_write = 16, .max_cells = 8});
    const auto s = filled(full, 4);
    const auto f = full.seq_clone(s).value();
    place_one(full, f);
    REQUIRE(test::declare(full, {f, f, f}).ok());  // 8 cells used
    REQUIRE(full.seq_rm(s, 0, 1).ok());            // cell 0 still f's: nothing freed
    REQUIRE(full.free_cells() == 0);
    const Cell kept = full;
    refused(full, full.seq_add(s, 1, kEnd, -1), Errc::out_of_cells, kept);  // 3 shared cells to copy
    refused(full, full.seq_add(f, 0, kEnd, -1), Errc::out_of_cells, kept);  // frees 1 cell, needs 3 copies
    REQUIRE(full.seq_add(f, 0, 2, -1).ok());  // f's position 0 drops, freeing cell 0, which the copy of 1 takes
    CHECK(full.free_cells() == 0);
    CHECK(full.cell_of(f, 0) == 0);
    CHECK(copies(full) == std::vector<RowCopy>{{1, 0, 1}});
  }
  SUBCASE("sequence layout refuses") {
    Seq slots({.max_write = 8, .max_len = 16});
    const auto s = filled(slots, 4);
    const Seq kept = slots;
    refused(slots, slots.seq_add(s, 0, kEnd, 1), Errc::unsupported_by_layout, kept);
    refused(slots, slots.seq_add(s, 0, kEnd, 0), Errc::unsupported_by_layout, kept);
    refused(slots, slots.seq_div(s, 0, kEnd, 2), Errc::unsupported_by_layout, kept);
    refused(slots, slots.seq_div(s, 0, kEnd, 0), Errc::bad_argument, kept);
  }
}

TEST_CASE("seq_div: p / d for sparse positions; collisions and bad divisors refused") {
  Cell cache({.max_write = 16, .max_cells = 64});
  const auto a = filled(cache, 10);  // cells 0..9
  cache.acknowledge_changes();
  const Cell dense = cache;
  refused(cache, cache.seq_div(a, 0, kEnd, 2), Errc::position_collision, dense);  // 0 and 1 -> 0
  refused(cache, cache.seq_div(a, 0, kEnd, 0), Errc::bad_argument, dense);
  refused(cache, cache.seq_div(a, 0, kEnd, -3), Errc::bad_argument, dense);
  REQUIRE(cache.seq_div(a, 0, kEnd, 1).ok());  // d = 1: nothing moves
  CHECK(cells_of(cache, a) == cells_of(dense, a));
  CHECK(cache.pending_changes().rotations.empty());

  REQUIRE(cache.seq_rm(a, 1, 4).ok());
  REQUIRE(cache.seq_rm(a, 5, 8).ok());
  REQUIRE(cache.seq_rm(a, 9, kEnd).ok());  // held: 0, 4, 8
  REQUIRE(cache.pos(a).value() == 9);
  REQUIRE(cache.seq_div(a, 4, kEnd, 4).ok());  // 4 -> 1, 8 -> 2
  CHECK(cells_of(cache, a) == Rows{0, 4, 8});
  CHECK(cache.pos(a).value() == 3);
  CHECK(sorted_rotations(cache) == std::vector<RowRotation>{{4, 4, 1}, {8, 8, 2}});
  const Cell sparse = cache;
  refused(cache, cache.seq_div(a, 1, kEnd, 2), Errc::position_collision, sparse);  // 1 -> 0, held outside
}

TEST_CASE("out_of_pages: holes spread sequences over more table pages than the table holds") {
  // 256 cells: 4 pages per sequence, 4 + 2 * 4 = 12 pages in all.
  Cell cache({.max_write = 200, .max_cells = 256, .max_seqs = 4});
  REQUIRE(cache.table().page_capacity() == 12);
  auto sparse = [&] {  // 193 tokens, then only positions 0, 64, 128, 192 kept: 4 pages, 4 cells
    const auto s = filled(cache, 193);
    for (const std::int32_t k : {0, 1, 2}) REQUIRE(cache.seq_rm(s, 64 * k + 1, 64 * k + 64).ok());
    return s;
  };
  const auto a = sparse();
  const auto b = sparse();
  const auto c = sparse();
  CHECK(cache.table().free_pages() == 0);
  CHECK(cache.free_cells() == 256 - 12);
  Cell before = cache;
  refused(cache, cache.seq_clone(a, 65).status(), Errc::out_of_pages, before);  // its partial page is a copy
  REQUIRE(cache.seq_clone(a, 0).ok());  // an empty fork needs no page
  REQUIRE(cache.seq_rm(3).ok());
  const auto d = cache.seq_new().value();
  before = cache;
  refused(cache, test::declare(cache, {d}), Errc::out_of_pages, before);
  refused(cache, cache.seq_cp(a, d, 0, 1), Errc::out_of_pages, before);
  refused(cache, cache.seq_cp(a, c, 0, 1), Errc::position_collision, before);  // the result is checked first
  REQUIRE(cache.seq_add(a, 64, kEnd, 1).ok());  // within a's own pages: none needed
  CHECK(cache.seq_pos_max(a).value() == 193);
  REQUIRE(cache.seq_rm(b, 0, kEnd).ok());  // frees b's 4 pages
  CHECK(cache.table().free_pages() == 4);
  REQUIRE(cache.seq_cp(a, d, 0, 1).ok());
  CHECK(cache.cell_of(d, 0) == cache.cell_of(a, 0));
  REQUIRE(test::declare(cache, {d}).ok());
}

TEST_CASE("seq_cp shares src's whole table pages where dst has none, as a fork does") {
  Cell cache({.max_write = 64, .max_cells = 512});
  const auto a = filled(cache, 200);  // pages 0..2 full, page 3 partial
  const auto b = cache.seq_new().value();
  const std::int32_t pages = cache.table().pages_in_use();
  REQUIRE(cache.seq_cp(a, b, 10, 190).ok());  // page 0 starts before 10, page 2 ends past 190
  const auto view = cache.table().view();
  CHECK(view.page_of(b, 64) == view.page_of(a, 64));  // page 1: shared
  CHECK(cache.table().holders(view.page_of(a, 64)) == 2);
  CHECK(view.page_of(b, 0) != view.page_of(a, 0));  // pages 0 and 2: entries written
  CHECK(view.page_of(b, 128) != view.page_of(a, 128));
  CHECK(cache.table().pages_in_use() == pages + 2);
  CHECK(cache.pos(b).value() == 190);
  for (std::int32_t p = 0; p < 190; ++p) CHECK(cache.cell_of(b, p) == (p < 10 ? -1 : cache.cell_of(a, p)));
  // Editing the shared page copies it first: a keeps its positions.
  REQUIRE(cache.seq_rm(b, 70, 72).ok());
  CHECK(cache.cell_of(a, 70) >= 0);
  CHECK(view.page_of(b, 64) != view.page_of(a, 64));
  // The whole range of an empty dst: every full page shared, the partial one written.
  const auto c = cache.seq_new().value();
  REQUIRE(cache.seq_cp(a, c, kEnd, kEnd).ok());
  for (const std::int32_t k : {0, 1, 2}) CHECK(view.page_of(c, 64 * k) == view.page_of(a, 64 * k));
  CHECK(view.page_of(c, 192) != view.page_of(a, 192));
  CHECK(cells_of(cache, c) == cells_of(cache, a));
}
