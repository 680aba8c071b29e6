// The scenarios a cell cache must get right, with exact cells, read_len and mask rows.
// Expected values are worked out by hand from docs/design.md sections 2-4 (lowest_free placement:
// each token takes the lowest free cell, in token order).
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <span>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using test::declare;
using test::Positions;
using test::Rows;
using test::step_positions;
using test::step_rows;
using test::visible_rows;

using Full = Windows<0>;
using Cells = CellCache<Full>;
using Slots = SequenceCache<Full>;

Cells make_cells(std::int32_t max_cells = 16) { return Cells({.max_write = 8, .max_cells = max_cells}); }
Slots make_slots() { return Slots({.max_write = 8, .max_seqs = 4, .max_len = 10}); }

}  // namespace

TEST_CASE("cell layout: one sequence's prefill then decode") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a, a}).ok());
  CHECK(step_rows(cache) == Rows{0, 1, 2, 3});
  CHECK(step_positions(cache) == Positions{0, 1, 2, 3});
  CHECK(cache.step().read_len == 4);
  CHECK(visible_rows(cache, 0, 0) == Rows{0});
  CHECK(visible_rows(cache, 0, 1) == Rows{0, 1});
  CHECK(visible_rows(cache, 0, 3) == Rows{0, 1, 2, 3});

  REQUIRE(declare(cache, {a}).ok());
  CHECK(step_rows(cache) == Rows{4});
  CHECK(step_positions(cache) == Positions{4});
  CHECK(cache.step().read_len == 5);
  CHECK(visible_rows(cache, 0, 0) == Rows{0, 1, 2, 3, 4});
  CHECK(cache.pos(a).value() == 5);
  CHECK(cache.free_cells() == 11);
  CHECK(cache.used_end() == 5);
}

TEST_CASE("cell layout: a second sequence gets its own cells") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a}).ok());
  const auto b = cache.seq_new().value();
  CHECK(b == 1);
  REQUIRE(declare(cache, {b, b}).ok());
  CHECK(step_rows(cache) == Rows{3, 4});
  CHECK(step_positions(cache) == Positions{0, 1});
  CHECK(cache.step().read_len == 5);
  CHECK(visible_rows(cache, 0, 0) == Rows{3});
  CHECK(visible_rows(cache, 0, 1) == Rows{3, 4});
}

TEST_CASE("cell layout: batched prefill of two sequences is block-diagonal causal") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a, b, b}).ok());
  CHECK(step_rows(cache) == Rows{0, 1, 2, 3, 4});
  CHECK(step_positions(cache) == Positions{0, 1, 2, 0, 1});
  CHECK(visible_rows(cache, 0, 0) == Rows{0});
  CHECK(visible_rows(cache, 0, 1) == Rows{0, 1});
  CHECK(visible_rows(cache, 0, 2) == Rows{0, 1, 2});
  CHECK(visible_rows(cache, 0, 3) == Rows{3});
  CHECK(visible_rows(cache, 0, 4) == Rows{3, 4});
}

TEST_CASE("cell layout: interleaved tokens of two sequences in one step") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, b, a, b}).ok());
  CHECK(step_rows(cache) == Rows{0, 1, 2, 3});
  CHECK(step_positions(cache) == Positions{0, 0, 1, 1});
  CHECK(visible_rows(cache, 0, 2) == Rows{0, 2});
  CHECK(visible_rows(cache, 0, 3) == Rows{1, 3});
}

TEST_CASE("cell layout: decode of one sequence and prefill of another in one step") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a}).ok());
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, b, b, b}).ok());
  CHECK(step_rows(cache) == Rows{3, 4, 5, 6});
  CHECK(step_positions(cache) == Positions{3, 0, 1, 2});
  CHECK(cache.step().read_len == 7);
  CHECK(visible_rows(cache, 0, 0) == Rows{0, 1, 2, 3});
  CHECK(visible_rows(cache, 0, 1) == Rows{4});
  CHECK(visible_rows(cache, 0, 2) == Rows{4, 5});
  CHECK(visible_rows(cache, 0, 3) == Rows{4, 5, 6});
}

TEST_CASE("cell layout: windows narrow by position, one buffer per window") {
  using W = Windows<0, 2, 0, 2>;
  CellCache<W> cache({.max_write = 8, .max_cells = 16});
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a, a}).ok());
  static_assert(W::kDistinct == 2);
  CHECK(visible_rows(cache, 0, 3) == Rows{0, 1, 2, 3});
  CHECK(visible_rows(cache, 2, 0) == Rows{0});
  CHECK(visible_rows(cache, 2, 1) == Rows{0, 1});
  CHECK(visible_rows(cache, 2, 3) == Rows{2, 3});
  REQUIRE(declare(cache, {a}).ok());  // position 4 at cell 4
  CHECK(visible_rows(cache, 2, 0) == Rows{3, 4});
  CHECK(visible_rows(cache, 0, 0) == Rows{0, 1, 2, 3, 4});
}

TEST_CASE("cell layout: a fork shares cells until its last owner leaves") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a}).ok());
  const auto c = cache.seq_clone(a).value();
  CHECK(c == 1);
  CHECK(cache.pos(c).value() == 3);
  CHECK(cache.free_cells() == 13);  // zero copy: no new cell
  for (std::int32_t cell = 0; cell < 3; ++cell) {
    CHECK(cache.cell_owners(cell).test(a));
    CHECK(cache.cell_owners(cell).test(c));
    CHECK(cache.cell_owners(cell).count() == 2);
  }
  REQUIRE(declare(cache, {c, a}).ok());
  CHECK(step_rows(cache) == Rows{3, 4});
  CHECK(step_positions(cache) == Positions{3, 3});
  CHECK(visible_rows(cache, 0, 0) == Rows{0, 1, 2, 3});
  CHECK(visible_rows(cache, 0, 1) == Rows{0, 1, 2, 4});

  REQUIRE(cache.seq_rm(a).ok());
  CHECK(cache.free_cells() == 12);  // cell 4 freed; 0..2 still held by the fork
  CHECK(cache.cell_pos(4) == -1);
  CHECK(cache.cell_pos(0) == 0);
  CHECK(cache.cell_owners(0).count() == 1);
  CHECK(cache.used_end() == 4);
  REQUIRE(cache.seq_rm(c).ok());
  CHECK(cache.free_cells() == 16);
  CHECK(cache.used_end() == 0);
}

TEST_CASE("cell layout: a prefix-only fork") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a, a}).ok());
  const auto c = cache.seq_clone(a, 2).value();
  CHECK(cache.pos(c).value() == 2);
  CHECK(cache.cell_owners(1).test(c));
  CHECK_FALSE(cache.cell_owners(2).test(c));
  REQUIRE(declare(cache, {c, c}).ok());
  CHECK(step_rows(cache) == Rows{4, 5});
  CHECK(step_positions(cache) == Positions{2, 3});
  CHECK(visible_rows(cache, 0, 1) == Rows{0, 1, 4, 5});
  CHECK(cache.seq_clone(a, 0).ok());  // an empty fork is a new sequence
}

TEST_CASE("cell layout: rewind then refill of holes keeps masks keyed on positions") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a, a, b, b}).ok());  // a: 0..3, b: 4, 5
  REQUIRE(cache.rewind(a, 2).ok());                   // frees cells 2, 3
  CHECK(cache.pos(a).value() == 2);
  CHECK(cache.free_cells() == 12);
  REQUIRE(declare(cache, {a, a, a}).ok());
  CHECK(step_rows(cache) == Rows{2, 3, 6});
  CHECK(step_positions(cache) == Positions{2, 3, 4});
  CHECK(visible_rows(cache, 0, 2) == Rows{0, 1, 2, 3, 6});
  REQUIRE(cache.rewind(a, 1).ok());  // frees 1, 2, 3, 6
  REQUIRE(declare(cache, {b, a}).ok());
  CHECK(step_rows(cache) == Rows{1, 2});
  CHECK(step_positions(cache) == Positions{2, 1});
  CHECK(cache.step().read_len == 6);
  CHECK(visible_rows(cache, 0, 0) == Rows{1, 4, 5});  // b at position 2 sees its hole-filling cell 1
  CHECK(visible_rows(cache, 0, 1) == Rows{0, 2});
}

TEST_CASE("seq_new hands out the lowest free id and reissues released ones") {
  auto cache = make_cells();
  CHECK(cache.seq_new().value() == 0);
  CHECK(cache.seq_new().value() == 1);
  CHECK(cache.seq_new().value() == 2);
  REQUIRE(cache.seq_rm(1).ok());
  CHECK(cache.seq_new().value() == 1);
  REQUIRE(cache.seq_rm(0).ok());
  CHECK(cache.seq_clone(2).value() == 0);
  CHECK(cache.seq_new().value() == 3);
  CHECK(cache.live_count() == 4);
}

TEST_CASE("clear returns everything") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, b, b, b}).ok());
  cache.acknowledge_changes();
  REQUIRE(cache.seq_clone(b).ok());
  cache.clear();
  CHECK(cache.free_cells() == cache.capacity());
  CHECK(cache.used_end() == 0);
  CHECK(cache.live_count() == 0);
  CHECK_FALSE(cache.step_placed());
  CHECK(cache.table().pages_in_use() == 0);  // every page of the position table is free
  for (std::int32_t c = 0; c < 16; ++c) {
    CHECK(cache.cell_pos(c) == -1);
    CHECK(cache.cell_owners(c).empty());
  }
  CHECK(cache.seq_new().value() == 0);
  REQUIRE(declare(cache, {0}).ok());
  CHECK(step_rows(cache) == Rows{0});
}

TEST_CASE("cell layout: pending table changes bring a copy of the position table up to date") {
  auto cache = make_cells();
  // A device-side copy that only ever receives the pending writes.
  std::vector<std::int32_t> copy(cache.table().flat().size(), -7);
  auto sync = [&] {
    const TableChanges t = cache.pending_changes().table;
    std::set<std::int32_t> seen(t.indices.begin(), t.indices.end());
    CHECK(seen.size() == t.indices.size());  // each entry listed once
    for (const std::int32_t i : t.indices) copy[static_cast<std::size_t>(i)] = t.values[static_cast<std::size_t>(i)];
    cache.acknowledge_changes();
    CHECK(cache.pending_changes().table.indices.empty());
  };
  auto copy_agrees = [&](std::int32_t seq) {
    const PositionTableView view{copy.data(), copy.data() + cache.table().directory_entries(), cache.table().dir_stride()};
    for (std::int32_t p = 0; p < cache.pos(seq).value(); ++p)
      if (view.cell(seq, p) != cache.cell_of(seq, p)) return false;
    return true;
  };
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a}).ok());
  CHECK(cache.pending_changes().table.indices.size() == 4);  // a directory entry and three cells
  sync();
  CHECK(copy_agrees(a));
  const auto b = cache.seq_clone(a, 2).value();  // a partial page: b gets its own copy of 2 entries
  REQUIRE(cache.rewind(a, 1).ok());              // a's page is private: truncated in place, no write
  CHECK(cache.pending_changes().table.indices.size() == 3);
  sync();
  CHECK(copy_agrees(a));
  CHECK(copy_agrees(b));
  REQUIRE(declare(cache, {b, a, b}).ok());
  sync();
  CHECK(copy_agrees(a));
  CHECK(copy_agrees(b));
}

TEST_CASE("a verb or a new declaration invalidates a placed step") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  CHECK(cache.require_step() == Errc::no_step_declared);
  REQUIRE(declare(cache, {a}).ok());
  CHECK(cache.require_step().ok());
  const auto serial = cache.step_serial();
  REQUIRE(declare(cache, {a}).ok());
  CHECK(cache.step_serial() == serial + 1);
  REQUIRE(cache.seq_new().ok());
  CHECK(cache.require_step() == Errc::no_step_declared);
  REQUIRE(declare(cache, {a}).ok());
  REQUIRE(cache.rewind(a, 1).ok());
  CHECK_FALSE(cache.step_placed());
}

// ---- the sequence layout: position p of slot s lives at row s * max_len + p ----

TEST_CASE("sequence layout: prefill, decode and a second sequence") {
  auto cache = make_slots();
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a}).ok());
  CHECK(step_rows(cache) == Rows{0, 1, 2});
  CHECK(cache.step().read_len == 3);
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, b, b}).ok());
  CHECK(step_rows(cache) == Rows{3, 10, 11});
  CHECK(step_positions(cache) == Positions{3, 0, 1});
  CHECK(cache.step().read_len == 12);
  CHECK(visible_rows(cache, 0, 0) == Rows{0, 1, 2, 3});
  CHECK(visible_rows(cache, 0, 2) == Rows{10, 11});
  CHECK(cache.visible_range(0, 0).value() == RowRange{0, 4});
  CHECK(cache.visible_range(0, 2).value() == RowRange{2, 4});
  CHECK(cache.free_cells() == 40 - 6);
}

TEST_CASE("sequence layout: a fork reports the prefix rows to copy") {
  auto cache = make_slots();
  const auto a = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, a, a}).ok());
  const auto c = cache.seq_clone(a, 3).value();
  REQUIRE(cache.pending_changes().copies.size() == 1);
  CHECK(cache.pending_changes().copies[0] == RowCopy{0, 10, 3});
  CHECK(cache.pos(c).value() == 3);
  REQUIRE(declare(cache, {c}).ok());
  CHECK(step_rows(cache) == Rows{13});
  CHECK(visible_rows(cache, 0, 0) == Rows{10, 11, 12, 13});
  cache.acknowledge_changes();
  CHECK(cache.pending_changes().copies.empty());
}

TEST_CASE("sequence layout: rewind and removal release rows; read_len follows the highest slot") {
  auto cache = make_slots();
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a, b, b, b}).ok());
  CHECK(cache.used_end() == 13);
  REQUIRE(cache.rewind(b, 1).ok());
  CHECK(cache.used_end() == 11);
  REQUIRE(cache.seq_rm(b).ok());
  CHECK(cache.used_end() == 2);
  REQUIRE(declare(cache, {a}).ok());
  CHECK(step_rows(cache) == Rows{2});
  CHECK(cache.free_cells() == 37);
}

TEST_CASE("a placed step splits into segments: runs of consecutive tokens of one sequence") {
  auto cache = make_cells();
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  REQUIRE(declare(cache, {a, a}).ok());
  REQUIRE(declare(cache, {a, a, a, b, b, a}).ok());
  const std::span<const Segment> segments = cache.step().segments;
  REQUIRE(segments.size() == 3);
  CHECK(segments[0] == Segment{a, 0, 3, 2});  // a's tokens 0..2 at positions 2..4
  CHECK(segments[1] == Segment{b, 3, 2, 0});
  CHECK(segments[2] == Segment{a, 5, 1, 5});  // a again: a new segment, next position
  std::vector<Segment> again(8);
  REQUIRE(split_segments(cache.step().seqs, cache.step().positions, again) == 3);
  CHECK(std::equal(segments.begin(), segments.end(), again.begin()));
}
