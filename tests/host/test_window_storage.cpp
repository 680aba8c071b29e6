// Window storage (CacheConfig::window_cells): windowed layers keep only their window, in pools of
// their own. Randomized runs against a twin storing everything in full (window_driver.hpp), and
// the contract's edges one by one: what is dropped and when, what is refused and that a refusal
// changes nothing, configurations refused at construction.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/sequence_state.hpp"
#include "support.hpp"
#include "window_driver.hpp"

namespace {

using namespace cellkv;
using test::GeneratorEntropy;
using test::WindowDriver;

// Windows short next to a page (64 positions), a long one, and W = 1 (a query sees only itself).
using Mixed = Windows<0, 16, 0, 100>;
using AllWindowed = Windows<24, 24>;
using Single = Windows<1, 0>;

template <class Cache>
void random_runs(std::uint64_t seed, std::int32_t runs, std::int32_t ops) {
  std::int64_t steps = 0, refusals = 0;
  for (std::int32_t r = 0; r < runs; ++r) {
    GeneratorEntropy e(seed + static_cast<std::uint64_t>(r));
    // Main pools of a few pages to many (the window tables reach as far).
    const std::int32_t cells = r % 4 == 3 ? e.range(1000, 4000) : e.range(200, 700);
    CacheConfig full{.max_write = e.range(1, 12), .max_cells = cells, .max_seqs = e.range(2, 8)};
    CacheConfig windowed = full;
    // From tight (refusals, cells reused at once) to roomy.
    windowed.window_cells = std::min(full.max_cells, e.range(full.max_write, full.max_seqs * 200));
    WindowDriver<Cache> driver(windowed, full);
    for (std::int32_t i = 0; i < ops; ++i) {
      const std::string m = driver.step(e);
      if (!m.empty()) FAIL_CHECK("seed " << seed + static_cast<std::uint64_t>(r) << ", " << m);
      if (!m.empty()) break;
    }
    steps += driver.steps();
    refusals += driver.window_refusals();
  }
  MESSAGE("steps " << steps << ", window refusals " << refusals);
  CHECK(steps > runs * ops / 4);
  CHECK(refusals > 0);
}

// CELLKV_SEED varies the runs (as test_differential.cpp).
std::uint64_t seed_base(std::uint64_t base) {
  const char* env = std::getenv("CELLKV_SEED");
  return env != nullptr && *env != '\0' ? base ^ (std::strtoull(env, nullptr, 0) * 0x9E3779B97F4A7C15ULL) : base;
}

TEST_CASE("window storage: random runs see what a cache storing every layer in full sees") {
  SUBCASE("lowest_free, two window pools") { random_runs<CellCache<Mixed, placement::lowest_free, 8>>(seed_base(0xA1), 24, 400); }
  SUBCASE("clustered<64>, two window pools") {
    random_runs<CellCache<Mixed, placement::clustered<64>, 8>>(seed_base(0xB2), 24, 400);
  }
  SUBCASE("every layer windowed") { random_runs<CellCache<AllWindowed, placement::lowest_free, 8>>(seed_base(0xC3), 16, 400); }
  SUBCASE("window 1") { random_runs<CellCache<Single, placement::lowest_free, 8>>(seed_base(0xD4), 16, 400); }
}

using Cache = CellCache<Windows<0, 10>, placement::lowest_free, 4>;

std::vector<std::int32_t> tokens(std::int32_t s, std::int32_t n) { return std::vector<std::int32_t>(static_cast<std::size_t>(n), s); }

// Positions the window pool holds for s.
std::vector<std::int32_t> window_held(const Cache& c, std::int32_t s) {
  std::vector<std::int32_t> out;
  for (std::int32_t p = 0; p < c.pos(s).value(); ++p)
    if (c.pool(10).cell_of(s, p) >= 0) out.push_back(p);
  return out;
}

TEST_CASE("window storage: a sequence lets go of whole pages that its next token cannot see") {
  Cache c({.max_write = 64, .max_cells = 1024, .max_seqs = 4, .window_cells = 256});
  REQUIRE(c.window_storage());
  const std::int32_t s = c.seq_new().value();
  REQUIRE(c.declare_step(tokens(s, 64)).ok());
  REQUIRE(c.declare_step(tokens(s, 64)).ok());   // first token at 64 sees from 55: page 0 kept
  CHECK(window_held(c, s).size() == 128);
  REQUIRE(c.declare_step(tokens(s, 10)).ok());   // first token at 128 sees from 119: page 0 dropped
  CHECK(window_held(c, s).front() == 64);
  CHECK(c.pool(10).free_cells() == 256 - 74);
  CHECK(c.free_cells() == 1024 - 138);          // the main pool keeps everything
  // The plan names the token's cell in each pool.
  const StepPlan plan = c.step();
  REQUIRE(plan.window_rows.size() == 10);
  for (std::int32_t t = 0; t < 10; ++t) {
    CHECK(c.pool(10).cell_pos(static_cast<std::int32_t>(plan.window_rows[static_cast<std::size_t>(t)])) == 128 + t);
    CHECK(c.cell_pos(static_cast<std::int32_t>(plan.rows[static_cast<std::size_t>(t)])) == 128 + t);
  }
  CHECK(plan.window_read_len.size() == 1);
  CHECK(c.read_len(10) == plan.window_read_len[0]);
  CHECK(c.read_len(0) == plan.read_len);
}

TEST_CASE("window storage: with keep_pending_pages, a page holding a cell whose K re-rotation is pending stays") {
  // A device cache turns keep_pending_pages on while a device holds part of the pending changes (a
  // failed upload it resumes at the next one): declare_step may run then, and its drops must leave
  // the pending re-rotations as they were.
  Cache c({.max_write = 64, .max_cells = 1024, .max_seqs = 4, .window_cells = 256});
  const std::int32_t s = c.seq_new().value();
  for (std::int32_t n : {64, 64, 12}) {
    REQUIRE(c.declare_step(tokens(s, n)).ok());
    c.acknowledge_changes();
  }
  CHECK(window_held(c, s).front() == 64);  // 140 positions: page 0 dropped, 64..139 held
  // Positions 128, 129 move down to 98, 99 (opened first): their window-pool cells re-rotate. The
  // removal lets go of 64..89 (no re-rotation pending yet); the page the move fills again stays.
  REQUIRE(c.seq_rm(s, 90, 100).ok());
  SUBCASE("off (the default): the edit lets go of the moved cells below the window at once") {
    REQUIRE(c.seq_add(s, 128, 130, -30).ok());
    CHECK(window_held(c, s).front() == 130);
    CHECK(c.pool(10).pending_changes().rotations.empty());
  }
  SUBCASE("on: the page stays, and a declared step changes no pending re-rotation") {
    c.keep_pending_pages(true);
    REQUIRE(c.seq_add(s, 128, 130, -30).ok());
    CHECK(window_held(c, s).front() == 98);
    const std::vector<RowRotation> pending(c.pool(10).pending_changes().rotations.begin(),
                                           c.pool(10).pending_changes().rotations.end());
    REQUIRE(pending.size() == 2);
    const std::uint64_t epoch = c.changes_epoch();
    REQUIRE(c.declare_step(tokens(s, 1)).ok());  // at 140 it sees from 131: page 1 lies below
    CHECK(c.changes_epoch() == epoch);
    const auto now = c.pool(10).pending_changes().rotations;
    REQUIRE(now.size() == pending.size());
    for (std::size_t i = 0; i < now.size(); ++i) {
      CHECK(now[i].cell == pending[i].cell);
      CHECK(now[i].old_pos == pending[i].old_pos);
      CHECK(now[i].new_pos == pending[i].new_pos);
    }
    CHECK(window_held(c, s).front() == 98);
    // Once the changes are acknowledged and the guard is off, the next drop lets the page go.
    c.acknowledge_changes();
    c.keep_pending_pages(false);
    REQUIRE(c.declare_step(tokens(s, 1)).ok());
    CHECK(window_held(c, s).front() == 130);
  }
}

TEST_CASE("window storage: forks keep a shared page while any owner still sees it") {
  Cache c({.max_write = 64, .max_cells = 1024, .max_seqs = 4, .window_cells = 512});
  const std::int32_t a = c.seq_new().value();
  REQUIRE(c.declare_step(tokens(a, 64)).ok());
  REQUIRE(c.declare_step(tokens(a, 60)).ok());
  const std::int32_t b = c.seq_clone(a, 60).value();  // b's next token (at 60) sees from 51
  REQUIRE(c.declare_step(tokens(a, 20)).ok());  // a's first token at 124 sees from 115: a lets go of page 0
  CHECK(window_held(c, a).front() == 64);
  CHECK(window_held(c, b).front() == 0);        // b still holds it
  const std::int32_t page0 = c.pool(10).cell_of(b, 0);
  REQUIRE(page0 >= 0);
  CHECK(c.pool(10).cell_owners(page0).count() == 1);
  REQUIRE(c.declare_step(tokens(b, 14)).ok());  // b at 60..73: its tokens still see page 0
  CHECK(window_held(c, b).front() == 0);
  const std::int64_t free_before = c.pool(10).free_cells();
  REQUIRE(c.declare_step(tokens(b, 1)).ok());  // b's token at 74 sees from 65: b lets go, the cells are free
  CHECK(window_held(c, b).front() == 64);
  CHECK(c.pool(10).free_cells() == free_before + 64 - 1);
  // A fork lets go at once of what its next token cannot see (a keeps page 1 until its next step).
  const std::int32_t d = c.seq_clone(a).value();  // at 144: sees from 135
  CHECK(window_held(c, a).front() == 64);
  CHECK(window_held(c, d).front() == 128);
  const std::int32_t e = c.seq_clone(b).value();
  CHECK(window_held(c, e).front() == 64);
}

TEST_CASE("window storage: what would need released positions is refused with window_evicted and changes nothing") {
  Cache c({.max_write = 64, .max_cells = 1024, .max_seqs = 4, .window_cells = 256});
  const std::int32_t s = c.seq_new().value();
  for (int i = 0; i < 3; ++i) REQUIRE(c.declare_step(tokens(s, 64)).ok());
  REQUIRE(c.declare_step(tokens(s, 1)).ok());  // token at 192 sees from 183: pages 0, 1 dropped
  REQUIRE(window_held(c, s).front() == 128);
  const Cache before = c;
  CHECK(c.rewind(s, 130) == Errc::window_evicted);  // the token at 130 would see 121..129
  CHECK(c.seq_rm(s, 100, -1) == Errc::window_evicted);
  CHECK(c.seq_clone(s, 120).status() == Errc::window_evicted);
  CHECK(c == before);
  // A rewind whose next token sees only kept positions is allowed (the token at 140 sees 131..).
  REQUIRE(c.rewind(s, 140).ok());
  // A shift that brings dropped positions into view: 100..127 to 140..167, seen by the token at 168.
  const Cache shifted = c;
  CHECK(c.seq_add(s, 100, 128, 40) == Errc::window_evicted);
  CHECK(c == shifted);
  // The same shift of positions the pool keeps is allowed; so are a fork at the end, removals in the
  // middle and removing everything.
  CHECK(c.seq_add(s, 130, -1, 20).ok());
  CHECK(c.pos(s).value() == 160);
  CHECK(c.seq_clone(s).ok());
  CHECK(c.seq_rm(s, 152, 155).ok());
  CHECK(c.rewind(s, 0).ok());
  CHECK(c.pos(s).value() == 0);
  CHECK(window_held(c, s).empty());
}

TEST_CASE("window storage: a step the window pool has no room for is refused; a step that fits after its drops is placed") {
  Cache c({.max_write = 64, .max_cells = 1024, .max_seqs = 4, .window_cells = 130});
  const std::int32_t s = c.seq_new().value();
  REQUIRE(c.declare_step(tokens(s, 64)).ok());
  REQUIRE(c.declare_step(tokens(s, 64)).ok());
  CHECK(c.pool(10).free_cells() == 2);
  // Placing 60 tokens needs 58 cells more than are free; the step's own drops (page 0: 64 cells) make
  // room, since the first token (at 128) sees from 119.
  REQUIRE(c.declare_step(tokens(s, 60)).ok());
  CHECK(c.pool(10).free_cells() == 2 + 64 - 60);
  const std::int32_t t = c.seq_new().value();
  const Cache before = c;
  CHECK(c.declare_step(tokens(t, 7)).status() == Errc::out_of_window_cells);
  CHECK(c == before);
  CHECK(c.declare_step(tokens(t, 6)).ok());
}

TEST_CASE("window storage: a restored sequence gets only the window's tail in the window pool") {
  Cache c({.max_write = 8, .max_cells = 1024, .max_seqs = 4, .window_cells = 200});
  std::vector<std::int32_t> positions;
  for (std::int32_t p = 0; p < 300; p += 2) positions.push_back(p);
  const std::int32_t s = c.restore_positions(positions).value();
  // Length 299: the next token (at 299) sees from 290; the pool keeps the page of 290 on.
  const std::vector<std::int32_t> held = window_held(c, s);
  REQUIRE(!held.empty());
  CHECK(held.front() == 256);
  CHECK(held.back() == 298);
  CHECK(c.held_positions(s).value() == positions);
  // A tail that does not fit is refused with the window pool's status.
  Cache small({.max_write = 8, .max_cells = 1024, .max_seqs = 4, .window_cells = 8});
  const Cache before = small;
  CHECK(small.restore_positions(positions).status() == Errc::out_of_window_cells);
  CHECK(small == before);
}

TEST_CASE("window storage: configurations it cannot serve are refused at construction") {
  using Full = CellCache<Windows<0, 0>, placement::lowest_free, 4>;
  CHECK(Cache::validate({.max_write = 8, .max_cells = 64, .window_cells = -1}) == Errc::bad_argument);
  CHECK(Cache::validate({.max_write = 8, .max_cells = 64, .window_cells = 7}) == Errc::bad_argument);  // < max_write
  CHECK(Cache::validate({.max_write = 8, .max_cells = 64, .window_cells = 8}).ok());
  CHECK(Cache::validate({.max_write = 8, .max_cells = 64, .window_cells = 64}).ok());
  CHECK(Cache::validate({.max_write = 8, .max_cells = 64, .window_cells = 65}) == Errc::bad_argument);  // > max_cells
  CHECK(Full::validate({.max_write = 8, .max_cells = 64, .window_cells = 8}) == Errc::bad_argument);  // no window
  CHECK(SequenceCache<Windows<0, 10>, 4>::validate({.max_write = 8, .max_len = 64, .window_cells = 8}) ==
        Errc::unsupported_by_layout);
  CHECK_THROWS_AS(Cache({.max_write = 8, .max_cells = 64, .window_cells = 7}), std::invalid_argument);
  // Host bytes count the window pools.
  CHECK(Cache::host_bytes({.max_write = 8, .max_cells = 64, .window_cells = 64}).value() >
        Cache::host_bytes({.max_write = 8, .max_cells = 64}).value());
  // Without window storage every window's layers use the main pool.
  Cache plain({.max_write = 8, .max_cells = 64});
  CHECK(!plain.window_storage());
  CHECK(&plain.pool(10) == &plain.pool(0));
  const std::int32_t s = plain.seq_new().value();
  REQUIRE(plain.declare_step(tokens(s, 3)).ok());
  CHECK(plain.step().window_rows.empty());
  CHECK(plain.step_rows(10).data() == plain.step().rows.data());
}

TEST_CASE("window storage: a host pool syncs one pool only, and sequence state refuses such a cache") {
  Cache c({.max_write = 8, .max_cells = 64, .max_seqs = 4, .window_cells = 32});
  HostPool<float> pool(2, 64, 1, 8);
  const std::int32_t s = c.seq_new().value();
  REQUIRE(c.declare_step(tokens(s, 4)).ok());
  REQUIRE(c.seq_add(s, 2, -1, 1).ok());  // a move: rotations pending in both pools
  const std::uint64_t epoch = c.changes_epoch();
  CHECK(pool.sync(c) == Errc::bad_argument);
  CHECK(pool.sync_keys_without_position(c) == Errc::bad_argument);
  CHECK(pool.sync(c, RopeSpec{}) == Errc::bad_argument);
  CHECK(c.changes_epoch() == epoch);  // nothing acknowledged
  CHECK(c.pool(10).pending_changes().rotations.size() == 2);
  CHECK(save_sequence(c, pool, s, 0).status() == Errc::bad_argument);
  // A state saved from a cache storing everything in full does not restore into it either.
  CellCache<Windows<0, 10>, placement::lowest_free, 4> full({.max_write = 8, .max_cells = 64, .max_seqs = 4});
  const std::int32_t f = full.seq_new().value();
  REQUIRE(full.declare_step(tokens(f, 4)).ok());
  const std::vector<std::byte> bytes = save_sequence(full, pool, f, 0).value();
  const Cache before = c;
  CHECK(restore_sequence(c, pool, bytes, 0).status() == Errc::bad_argument);
  CHECK(c == before);
  // The same for an fp8 host pool.
  HostFp8Pool fp8(2, 64, 1, 8);
  CHECK(fp8.sync(c) == Errc::bad_argument);
  CHECK(c.changes_epoch() == epoch);
  CHECK(save_sequence(c, fp8, s, 0).status() == Errc::bad_argument);
  const std::vector<std::byte> fp8_bytes = save_sequence(full, fp8, f, 0).value();
  CHECK(restore_sequence(c, fp8, fp8_bytes, 0).status() == Errc::bad_argument);
  CHECK(c == before);
}

TEST_CASE("window storage: a window pool's position table holds its directory and every page it hands out") {
  // Positions reach the main pool's 8192, cells only 64: the directory is sized by the positions,
  // the pages by the main pool (plus one a sequence), and the flat array holds both.
  for (const std::array<std::int32_t, 3> size : {std::array{2, 64, 8192}, std::array{5, 300, 301}, std::array{3, 100, 100}}) {
    const std::int32_t seqs = size[0], cells = size[1], positions = size[2];
    CAPTURE(positions);
    const PositionTable t(seqs, cells, positions);
    CHECK(t.position_limit() == PositionTable::pages_for(positions) * kPagePositions);
    CHECK(static_cast<std::int64_t>(t.flat().size()) == t.directory_entries() + std::int64_t{t.page_capacity()} * kPagePositions);
    CHECK(static_cast<std::int64_t>(t.flat().size()) == PositionTable::flat_size(seqs, cells, positions));
    CHECK(t.page_capacity() >= PositionTable::pages_for(positions) + 2 * seqs);
  }
  // A long sequence in a small window pool: every page the table hands out lies inside it.
  Cache c({.max_write = 64, .max_cells = 8192, .max_seqs = 2, .window_cells = 2 * (10 + 64 + 40)});
  const std::int32_t a = c.seq_new().value(), b = c.seq_new().value();
  for (int i = 0; i < 100; ++i) {
    REQUIRE(c.declare_step(tokens(a, 40)).ok());
    REQUIRE(c.declare_step(tokens(b, 1)).ok());
  }
  CHECK(window_held(c, a).size() <= 10 + 64 + 40);
}

}  // namespace
