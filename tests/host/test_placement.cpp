// Placement independence: one script of steps and verbs under lowest_free, clustered<B> and the
// tests' own after_last (after_last_placement.hpp) gives the same visibility as a function of
// (token, position, owners); only the cell numbers differ.
// Also: clustered<B> keeps each decoding sequence inside aligned blocks of its own; after_last
// places as its header says.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <set>
#include <type_traits>
#include <utility>
#include <vector>

#include "after_last_placement.hpp"
#include "cellkv/kv_cache.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using W = Windows<0, 3>;
using Seen = std::set<std::pair<std::int32_t, std::vector<std::int32_t>>>;  // (position, owners)

// What a token sees, independent of cell numbers: sequence, position, and for each window the
// (position, owner list) of every visible cell.
struct TokenView {
  std::int32_t seq = 0;
  std::int32_t pos = 0;
  std::vector<Seen> seen;  // per distinct window
  bool operator==(const TokenView&) const = default;
};

template <class Cache>
std::vector<TokenView> describe_step(const Cache& cache) {
  std::vector<TokenView> out;
  const auto plan = cache.step();
  for (std::int32_t t = 0; t < plan.tokens; ++t) {
    TokenView view{plan.seqs[static_cast<std::size_t>(t)], plan.positions[static_cast<std::size_t>(t)], {}};
    for (const std::int32_t w : W::kDistinctWindows) {
      Seen seen;
      for (const std::int64_t row : test::visible_rows(cache, w, t)) {
        std::vector<std::int32_t> owners;
        cache.cell_owners(static_cast<std::int32_t>(row)).for_each([&](std::int32_t s) { owners.push_back(s); });
        seen.insert({cache.cell_pos(static_cast<std::int32_t>(row)), owners});
      }
      view.seen.push_back(seen);
    }
    out.push_back(view);
  }
  return out;
}

}  // namespace

// Probes with external linkage (clang warns about unused members of internal ones).
namespace cellkv_concept_probes {
using namespace cellkv;
// What the concepts take and refuse, at compile time: a policy missing a hook is not a Placement,
// a tag missing a trait is not a Layout; each layout names the placements it takes and its default.
struct missing_freed {
  struct SeqState {
    friend bool operator==(const SeqState&, const SeqState&) = default;
  };
  explicit missing_freed(std::int32_t) {}
  std::int32_t pick(SeqState&, FreeCells free) { return free.lowest(); }
  void truncated(SeqState&, std::int32_t) {}
  friend bool operator==(const missing_freed&, const missing_freed&) = default;
};
struct missing_rows {
  using default_placement = placement::none;
  template <class P>
  static constexpr bool kAccepts = true;
  static constexpr bool kPositionTable = false;
};
}  // namespace cellkv_concept_probes

namespace {
using cellkv_concept_probes::missing_freed;
using cellkv_concept_probes::missing_rows;

static_assert(Placement<placement::lowest_free> && Placement<placement::clustered<8>> && Placement<test::after_last>);
static_assert(!Placement<missing_freed> && !Placement<placement::none> && !Placement<int>);
static_assert(Layout<layout::cell> && Layout<layout::sequence> && !Layout<missing_rows>);
static_assert(PlacementFor<test::after_last, layout::cell> && !PlacementFor<placement::none, layout::cell>);
static_assert(PlacementFor<placement::none, layout::sequence> && !PlacementFor<missing_freed, layout::sequence>);
static_assert(std::is_same_v<CellCache<W>::PlacementPolicy, placement::lowest_free>);
static_assert(std::is_same_v<SequenceCache<W>::PlacementPolicy, placement::none>);
static_assert(std::is_same_v<KVCache<layout::sequence, W, placement::lowest_free>::PlacementPolicy, placement::none>);

using Lowest = CellCache<W, placement::lowest_free, 16>;
using Clustered4 = CellCache<W, placement::clustered<4>, 16>;
using Clustered8 = CellCache<W, placement::clustered<8>, 16>;
using AfterLast = CellCache<W, test::after_last, 16>;

struct Policies {
  Lowest lowest;
  Clustered4 c4;
  Clustered8 c8;
  AfterLast after;
  // Applies f to each cache and checks the results are equal; returns the first.
  template <class F>
  auto all(F&& f) {  // NOLINT
    auto a = f(lowest);
    auto b = f(c4);
    auto c = f(c8);
    auto d = f(after);
    CHECK(a == b);
    CHECK(a == c);
    CHECK(a == d);
    return a;
  }
};

void run_script(std::uint64_t seed) {
  const CacheConfig config{.max_write = 6, .max_cells = 64, .max_seqs = 6};
  Policies trio{Lowest(config), Clustered4(config), Clustered8(config), AfterLast(config)};
  std::mt19937_64 rng(seed);
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  for (int op = 0; op < 600; ++op) {
    CAPTURE(seed);
    CAPTURE(op);
    const std::int32_t kind = pick(12);
    const std::int32_t id = pick(6);
    if (kind < 7) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(1 + pick(6)));
      for (auto& s : ids) s = pick(6);
      const Status s = trio.all([&](auto& c) { return c.declare_step(ids).status(); });
      if (s.ok()) (void)trio.all([](auto& c) { return describe_step(c); });
    } else if (kind == 7) {
      (void)trio.all([](auto& c) { return c.seq_new().status(); });
    } else if (kind == 8) {
      const std::int32_t upto = pick(8) - 1;
      (void)trio.all([&](auto& c) { return c.seq_clone(id, upto).status(); });
    } else if (kind == 9) {
      (void)trio.all([&](auto& c) { return c.seq_rm(id); });
    } else if (kind == 10) {
      const std::int32_t p = pick(10);
      (void)trio.all([&](auto& c) { return c.rewind(id, p); });
    } else {
      (void)trio.all([&](auto& c) { return std::make_pair(c.free_cells(), c.live_count()); });
    }
  }
}

}  // namespace

TEST_CASE("the same script under lowest_free, clustered<B> and after_last gives the same visibility") {
  for (std::uint64_t seed = 1; seed <= 20; ++seed) run_script(seed);
}

TEST_CASE("clustered<B>: interleaved decoding sequences fill aligned blocks of their own") {
  CellCache<W, placement::clustered<4>> cache({.max_write = 8, .max_cells = 64});
  std::vector<std::int32_t> ids;
  for (int s = 0; s < 3; ++s) ids.push_back(cache.seq_new().value());
  for (int step = 0; step < 8; ++step) REQUIRE(cache.declare_step(ids).ok());  // a b c a b c ...
  for (const std::int32_t s : ids) {
    // 8 tokens of s fill exactly two aligned blocks of 4 cells, owned by s alone.
    std::set<std::int32_t> blocks;
    for (std::int32_t p = 0; p < 8; ++p) blocks.insert(cache.cell_of(s, p) / 4);
    CHECK(blocks.size() == 2);
    for (const std::int32_t b : blocks)
      for (std::int32_t c = b * 4; c < b * 4 + 4; ++c) {
        CHECK(cache.cell_owners(c).count() == 1);
        CHECK(cache.cell_owners(c).test(s));
      }
  }
  // lowest_free interleaves the same steps: every block of 4 mixes the three sequences.
  CellCache<W> seed_policy({.max_write = 8, .max_cells = 64});
  for (int s = 0; s < 3; ++s) REQUIRE(seed_policy.seq_new().ok());
  for (int step = 0; step < 8; ++step) REQUIRE(seed_policy.declare_step(ids).ok());
  CHECK(seed_policy.cell_owners(0).first() != seed_policy.cell_owners(1).first());
}

TEST_CASE("clustered<B>: a new block is the lowest fully free one; no free block falls back to any cell") {
  CellCache<W, placement::clustered<4>> cache({.max_write = 8, .max_cells = 12});
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  const auto c = cache.seq_new().value();
  const std::vector<std::int32_t> one_each{a, b, c};
  REQUIRE(cache.declare_step(one_each).ok());
  CHECK(test::step_rows(cache) == test::Rows{0, 4, 8});
  const std::vector<std::int32_t> a_more{a, a, a, a};  // fills block 0, then no block is free
  REQUIRE(cache.declare_step(a_more).ok());
  CHECK(test::step_rows(cache) == test::Rows{1, 2, 3, 5});
  REQUIRE(cache.seq_rm(b).ok());  // block 1 still holds a's cell 5: not fully free
  const std::vector<std::int32_t> c_more{c, c, c, c};
  REQUIRE(cache.declare_step(c_more).ok());
  CHECK(test::step_rows(cache) == test::Rows{9, 10, 11, 4});
  CHECK(cache.free_cells() == 2);
  const std::vector<std::int32_t> three{a, a, a};
  CHECK(cache.declare_step(three).status() == Errc::out_of_cells);
  const std::vector<std::int32_t> two{a, c};
  REQUIRE(cache.declare_step(two).ok());  // capacity is never lost
  CHECK(cache.free_cells() == 0);
}

TEST_CASE("test::after_last: each token follows its sequence's last cell, wrapping to the lowest free") {
  CellCache<W, test::after_last> cache({.max_write = 8, .max_cells = 8});
  const auto a = cache.seq_new().value();
  const auto b = cache.seq_new().value();
  const std::vector<std::int32_t> ab{a, b};
  REQUIRE(cache.declare_step(ab).ok());
  CHECK(test::step_rows(cache) == test::Rows{0, 1});  // no last cell yet: the lowest free
  REQUIRE(cache.declare_step(ab).ok());
  CHECK(test::step_rows(cache) == test::Rows{2, 3});  // a after 0, b after 1
  REQUIRE(cache.rewind(a, 1).ok());                    // frees 2; a's last cell is 0 again
  const std::vector<std::int32_t> a_two{a, a};
  REQUIRE(cache.declare_step(a_two).ok());
  CHECK(test::step_rows(cache) == test::Rows{2, 4});
  const std::vector<std::int32_t> b_three{b, b, b};
  REQUIRE(cache.declare_step(b_three).ok());
  CHECK(test::step_rows(cache) == test::Rows{5, 6, 7});  // after 3, skipping the taken 4
  CHECK(cache.free_cells() == 0);
  REQUIRE(cache.seq_rm(a).ok());                       // frees 0, 2, 4
  const auto c = cache.seq_clone(b, 1).value();        // a fork has no last cell of its own
  const std::vector<std::int32_t> bc{b, c};
  REQUIRE(cache.declare_step(bc).ok());
  CHECK(test::step_rows(cache) == test::Rows{0, 2});  // b wraps past 7 to 0; c takes the lowest, 2
}
