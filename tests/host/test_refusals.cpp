// Every refusal of docs/design.md section 4 returns its status and leaves the cache identical: each
// case compares a full copy of the cache taken before the call (CellCache has operator==).
#include <doctest/doctest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using W = Windows<0, 3>;

// A cache with live sequences 0 (4 tokens) and 1 (a fork of 0's first 2 positions, then 1 more),
// a placed step, and pending changes, so a refusal has plenty of state to disturb.
template <class Cache>
Cache busy_cache(const CacheConfig& config) {
  Cache cache(config);
  const auto a = cache.seq_new().value();
  const std::vector<std::int32_t> prefill{a, a, a, a};
  REQUIRE(cache.declare_step(prefill).ok());
  const auto b = cache.seq_clone(a, 2).value();
  const std::vector<std::int32_t> step{b};
  REQUIRE(cache.declare_step(step).ok());
  return cache;
}

template <class Cache>
void check_unchanged_refusal(const Cache& before, Cache& cache, Status got, Errc expected) {
  CHECK(got == expected);
  CHECK(got.message() == describe(expected));
  CHECK(cache == before);
}

template <class Cache>
void check_common_refusals(const CacheConfig& config) {
  auto cache = busy_cache<Cache>(config);
  const Cache before = cache;
  const std::int32_t max_seqs = cache.max_seqs();

  SUBCASE("declare_step: empty step") {
    check_unchanged_refusal(before, cache, cache.declare_step({}).status(), Errc::empty_step);
  }
  SUBCASE("declare_step: wider than max_write") {
    const std::vector<std::int32_t> wide(static_cast<std::size_t>(config.max_write) + 1, 0);
    check_unchanged_refusal(before, cache, cache.declare_step(wide).status(), Errc::step_too_wide);
  }
  SUBCASE("declare_step: id out of range") {
    for (const std::int32_t bad : {-1, max_seqs, max_seqs + 5}) {
      const std::vector<std::int32_t> ids{0, bad};
      check_unchanged_refusal(before, cache, cache.declare_step(ids).status(), Errc::bad_sequence_id);
    }
  }
  SUBCASE("declare_step: sequence not live") {
    const std::vector<std::int32_t> ids{0, 2};
    check_unchanged_refusal(before, cache, cache.declare_step(ids).status(), Errc::sequence_not_live);
  }
  SUBCASE("seq_clone: bad source, bad upto") {
    check_unchanged_refusal(before, cache, cache.seq_clone(-1).status(), Errc::bad_sequence_id);
    check_unchanged_refusal(before, cache, cache.seq_clone(3).status(), Errc::sequence_not_live);
    check_unchanged_refusal(before, cache, cache.seq_clone(0, 5).status(), Errc::bad_position);
    check_unchanged_refusal(before, cache, cache.seq_clone(0, -2).status(), Errc::bad_position);
  }
  SUBCASE("seq_rm: bad or dead id") {
    check_unchanged_refusal(before, cache, cache.seq_rm(max_seqs), Errc::bad_sequence_id);
    check_unchanged_refusal(before, cache, cache.seq_rm(2), Errc::sequence_not_live);
  }
  SUBCASE("rewind: bad id, dead id, position out of range") {
    check_unchanged_refusal(before, cache, cache.rewind(-3, 0), Errc::bad_sequence_id);
    check_unchanged_refusal(before, cache, cache.rewind(2, 0), Errc::sequence_not_live);
    check_unchanged_refusal(before, cache, cache.rewind(0, -1), Errc::bad_position);
    check_unchanged_refusal(before, cache, cache.rewind(0, 5), Errc::bad_position);
  }
  SUBCASE("pos: bad or dead id") {
    check_unchanged_refusal(before, cache, cache.pos(-1).status(), Errc::bad_sequence_id);
    check_unchanged_refusal(before, cache, cache.pos(2).status(), Errc::sequence_not_live);
  }
  SUBCASE("seq_new and seq_clone: every id live") {
    while (cache.seq_new().ok()) {
    }
    const Cache full = cache;
    check_unchanged_refusal(full, cache, cache.seq_new().status(), Errc::no_free_sequence);
    check_unchanged_refusal(full, cache, cache.seq_clone(0).status(), Errc::no_free_sequence);
  }
}

}  // namespace

TEST_CASE("refusals leave the cell-layout cache identical") {
  using Cache = CellCache<W, placement::lowest_free, 8>;
  check_common_refusals<Cache>({.max_write = 6, .max_cells = 12, .max_seqs = 4});
}

TEST_CASE("refusals leave the clustered cell-layout cache identical") {
  using Cache = CellCache<W, placement::clustered<4>, 8>;
  check_common_refusals<Cache>({.max_write = 6, .max_cells = 12, .max_seqs = 4});
}

TEST_CASE("refusals leave the sequence-layout cache identical") {
  using Cache = SequenceCache<W, 8>;
  check_common_refusals<Cache>({.max_write = 6, .max_seqs = 4, .max_len = 6});
}

TEST_CASE("cell layout: a step needs as many free cells as tokens") {
  using Cache = CellCache<W, placement::lowest_free, 8>;
  auto cache = busy_cache<Cache>({.max_write = 8, .max_cells = 12});  // 7 cells free
  const Cache before = cache;
  const std::vector<std::int32_t> eight(8, 0);
  check_unchanged_refusal(before, cache, cache.declare_step(eight).status(), Errc::out_of_cells);
  const std::vector<std::int32_t> seven(7, 1);
  CHECK(cache.declare_step(seven).ok());  // exactly enough
  CHECK(cache.free_cells() == 0);
}

TEST_CASE("sequence layout: a step may not push a sequence past max_len") {
  using Cache = SequenceCache<W, 8>;
  auto cache = busy_cache<Cache>({.max_write = 8, .max_seqs = 4, .max_len = 6});  // seq 0 at 4, seq 1 at 3
  const Cache before = cache;
  const std::vector<std::int32_t> ids{1, 0, 0, 0};
  check_unchanged_refusal(before, cache, cache.declare_step(ids).status(), Errc::sequence_full);
  const std::vector<std::int32_t> fits{1, 0, 0, 1, 1};
  CHECK(cache.declare_step(fits).ok());
}

TEST_CASE("a refused declaration keeps the placed step") {
  using Cache = CellCache<W, placement::lowest_free, 8>;
  auto cache = busy_cache<Cache>({.max_write = 6, .max_cells = 12});
  const auto serial = cache.step_serial();
  CHECK(cache.declare_step({}).status() == Errc::empty_step);
  CHECK(cache.step_placed());
  CHECK(cache.step_serial() == serial);
}

TEST_CASE("invalid sizes are refused at construction") {
  using Cells = CellCache<W, placement::lowest_free, 8>;
  using Slots = SequenceCache<W, 8>;
  CHECK(Cells::validate({.max_write = 0, .max_cells = 4}) == Errc::bad_argument);
  CHECK(Cells::validate({.max_write = 2, .max_cells = 0}) == Errc::bad_argument);
  CHECK(Cells::validate({.max_write = 2, .max_cells = 4, .max_seqs = 9}) == Errc::bad_argument);
  CHECK(Slots::validate({.max_write = 2, .max_seqs = 4, .max_len = 0}) == Errc::bad_argument);
  CHECK(Cells::validate({.max_write = 2, .max_cells = 4}).ok());
  CHECK_THROWS_AS(Cells({.max_write = 0, .max_cells = 4}), std::invalid_argument);
  CHECK_THROWS_AS(Slots({.max_write = 2, .max_seqs = 4, .max_len = -1}), std::invalid_argument);
}

TEST_CASE("value() of a refused result throws; it never passes for a value") {
  CellCache<Windows<0>> cache({.max_write = 2, .max_cells = 4, .max_seqs = 1});
  REQUIRE(cache.seq_new().value() == 0);
  const Result<std::int32_t> none = cache.seq_new();  // every id is live
  REQUIRE(none.status() == Errc::no_free_sequence);
  CHECK_THROWS_AS((void)none.value(), BadResultAccess);
  try {
    (void)none.value();
  } catch (const BadResultAccess& e) {
    CHECK(e.code() == Errc::no_free_sequence);
  }
  CHECK(none.value_or(-1) == -1);
  CHECK_THROWS_AS((void)cache.pos(5).value(), BadResultAccess);
  CHECK(cache.live_count() == 1);  // nothing changed
}
