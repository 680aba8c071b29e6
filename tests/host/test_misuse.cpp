// A careless or hostile caller: queries of a step that a verb invalidated, arguments at the
// extremes of int32, sizes that overflow int32 or would exhaust host memory, value() of a refused
// result, degenerate shapes for the reference. Each is refused with its status and changes nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cellkv/batching/session_table.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/reference.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using W = Windows<0, 3>;
using Cells = CellCache<W, placement::lowest_free, 8>;
using Clustered = CellCache<W, placement::clustered<4>, 8>;
using Slots = SequenceCache<W, 8>;

constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min();
constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();

// Sequences 0 (5 tokens) and 1 (a fork of 0's first 3 positions), then a placed step of both.
template <class Cache>
Cache placed(const CacheConfig& config) {
  Cache cache(config);
  const std::int32_t a = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{a, a, a, a, a}).ok());
  const std::int32_t b = cache.seq_clone(a, 3).value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{a, b, b}).ok());
  REQUIRE(cache.step_placed());
  return cache;
}

// Every step query refuses with no_step_declared, writes nothing, and step() is empty.
template <class Cache>
void check_stale(const Cache& cache) {
  CHECK_FALSE(cache.step_placed());
  CHECK(cache.require_step() == Errc::no_step_declared);
  const StepPlan plan = cache.step();
  CHECK(plan.tokens == 0);
  CHECK(plan.rows.empty());
  CHECK(plan.seqs.empty());
  CHECK(plan.positions.empty());
  CHECK(plan.segments.empty());
  CHECK(plan.read_len == 0);
  std::vector<std::uint8_t> row(64, std::uint8_t{7});
  for (const std::int32_t window : {0, 3})
    for (std::int32_t t = 0; t < 3; ++t) {
      CHECK(cache.mask_row(window, t, row) == Errc::no_step_declared);
      for (std::int64_t r = 0; r < 8; ++r) CHECK(cache.visible(t, r, window).status() == Errc::no_step_declared);
      if constexpr (requires { cache.visible_range(t, window); })
        CHECK(cache.visible_range(t, window).status() == Errc::no_step_declared);
    }
  CHECK(row == std::vector<std::uint8_t>(64, std::uint8_t{7}));
}

template <class Cache>
void check_every_verb_invalidates(const CacheConfig& config) {
  const std::vector<std::pair<const char*, std::function<void(Cache&)>>> verbs{
      {"rewind", [](Cache& c) { REQUIRE(c.rewind(0, 1).ok()); }},
      {"rewind to the end", [](Cache& c) { REQUIRE(c.rewind(0, c.pos(0).value()).ok()); }},
      {"seq_rm", [](Cache& c) { REQUIRE(c.seq_rm(1).ok()); }},
      {"seq_new", [](Cache& c) { REQUIRE(c.seq_new().ok()); }},
      {"seq_clone", [](Cache& c) { REQUIRE(c.seq_clone(0, 2).ok()); }},
      {"clear", [](Cache& c) { c.clear(); }},
  };
  for (const auto& entry : verbs) {  // not a structured binding: clang 14 cannot capture one
    const std::string name = entry.first;
    CAPTURE(name);
    Cache cache = placed<Cache>(config);
    entry.second(cache);
    check_stale(cache);
  }
}

template <class Cache>
void check_query_arguments(const CacheConfig& config) {
  const Cache cache = placed<Cache>(config);
  const Cache before = cache;
  const std::int64_t read_len = cache.step().read_len;
  std::vector<std::uint8_t> row(static_cast<std::size_t>(read_len), std::uint8_t{7});
  for (const std::int32_t t : {-1, 3, kMin, kMax}) {
    CAPTURE(t);
    CHECK(cache.mask_row(0, t, row) == Errc::bad_argument);
    CHECK(cache.visible(t, 0, 0).status() == Errc::bad_argument);
  }
  for (const std::int32_t window : {-1, kMin}) {
    CAPTURE(window);
    CHECK(cache.mask_row(window, 0, row) == Errc::bad_argument);
    CHECK(cache.visible(0, 0, window).status() == Errc::bad_argument);
    if constexpr (requires { cache.visible_range(0, window); })
      CHECK(cache.visible_range(0, window).status() == Errc::bad_argument);
  }
  for (const std::int64_t r : {std::int64_t{-1}, cache.capacity(), std::numeric_limits<std::int64_t>::min(),
                               std::numeric_limits<std::int64_t>::max()}) {
    CAPTURE(r);
    CHECK(cache.visible(0, r, 0).status() == Errc::bad_argument);
  }
  std::vector<std::uint8_t> short_row(static_cast<std::size_t>(read_len - 1), std::uint8_t{7});
  CHECK(cache.mask_row(0, 0, short_row) == Errc::bad_shape);
  CHECK(row == std::vector<std::uint8_t>(row.size(), std::uint8_t{7}));  // refusals wrote nothing
  CHECK(short_row == std::vector<std::uint8_t>(short_row.size(), std::uint8_t{7}));
  CHECK(cache == before);

  // The widest window sees the whole history, like window 0 (no overflow at INT32_MAX).
  std::vector<std::uint8_t> full(row.size()), widest(row.size());
  for (std::int32_t t = 0; t < 3; ++t) {
    REQUIRE(cache.mask_row(0, t, full).ok());
    REQUIRE(cache.mask_row(kMax, t, widest).ok());
    CHECK(full == widest);
    for (std::int64_t r = 0; r < read_len; ++r)
      CHECK(cache.visible(t, r, kMax).value() == (full[static_cast<std::size_t>(r)] != 0));
  }
}

}  // namespace

TEST_CASE("a step invalidated by a verb is never answered for") {
  check_every_verb_invalidates<Cells>({.max_write = 8, .max_cells = 16});
  check_every_verb_invalidates<Clustered>({.max_write = 8, .max_cells = 16});
  check_every_verb_invalidates<Slots>({.max_write = 8, .max_len = 8});
}

TEST_CASE("a fresh cache has no step to answer for") {
  check_stale(Cells({.max_write = 8, .max_cells = 16}));
  check_stale(Slots({.max_write = 8, .max_len = 8}));
}

TEST_CASE("after rewind, freed cells are never reported visible; after clear, no row is written") {
  Cells cache({.max_write = 8, .max_cells = 16});
  const std::int32_t a = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{a, a, a, a}).ok());
  REQUIRE(cache.rewind(a, 1).ok());  // cells 1..3 are free again
  for (std::int64_t r = 1; r < 4; ++r) CHECK_FALSE(cache.visible(3, r, 0).ok());
  cache.clear();
  std::vector<std::uint8_t> row(static_cast<std::size_t>(cache.step().read_len));  // 0 columns
  CHECK(cache.mask_row(0, 0, row) == Errc::no_step_declared);
}

TEST_CASE("step queries refuse tokens, rows and windows outside their ranges") {
  check_query_arguments<Cells>({.max_write = 8, .max_cells = 16});
  check_query_arguments<Clustered>({.max_write = 8, .max_cells = 16});
  check_query_arguments<Slots>({.max_write = 8, .max_len = 8});
}

TEST_CASE("sizes past int32 are refused before anything is allocated") {
  // The position table of max_cells = INT32_MAX alone has 2^31 entries and more.
  for (const std::int32_t seqs : {0, 1, 8}) {
    CAPTURE(seqs);
    CHECK(Cells::validate({.max_write = 8, .max_cells = kMax, .max_seqs = seqs}) == Errc::size_overflow);
    CHECK(Cells::host_bytes({.max_write = 8, .max_cells = kMax, .max_seqs = seqs}).status() == Errc::size_overflow);
    CHECK_THROWS_AS(Cells({.max_write = 8, .max_cells = kMax, .max_seqs = seqs}), std::invalid_argument);
  }
  // Sequence layout: every row, the scratch row and a position plus a step's tokens within int32.
  CHECK(Slots::validate({.max_write = 8, .max_seqs = 1, .max_len = kMax}) == Errc::size_overflow);
  CHECK(Slots::validate({.max_write = 8, .max_seqs = 1, .max_len = kMax - 7}) == Errc::size_overflow);
  CHECK(Slots::validate({.max_write = 8, .max_seqs = 1, .max_len = kMax - 8}).ok());
  CHECK(Slots::validate({.max_write = 8, .max_seqs = 2, .max_len = kMax / 2}) == Errc::size_overflow);
  CHECK(Slots::validate({.max_write = 8, .max_len = kMax / 8}) == Errc::size_overflow);  // 8 ids
  // A step's table writes (4 per token) within int32.
  CHECK(Cells::validate({.max_write = kMax, .max_cells = 16}) == Errc::size_overflow);
  CHECK(Cells::validate({.max_write = kMax / 4 + 1, .max_cells = 16}) == Errc::size_overflow);
  // The other refusals keep their code.
  CHECK(Cells::validate({.max_write = 8, .max_cells = kMin}) == Errc::bad_argument);
  CHECK(Slots::validate({.max_write = 8, .max_len = kMin}) == Errc::bad_argument);
  CHECK(Cells::validate({.max_write = kMin, .max_cells = 16}) == Errc::bad_argument);
  CHECK(Cells::validate({.max_write = 8, .max_cells = 16, .max_seqs = kMin}) == Errc::bad_argument);
  CHECK(Cells::validate({.max_write = 8, .max_cells = 16, .max_seqs = kMax}) == Errc::bad_argument);
}

TEST_CASE("a sequence slot next to INT32_MAX: positions and rows stay in range") {
  Slots cache({.max_write = 8, .max_seqs = 1, .max_len = kMax - 8});
  const std::int32_t a = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>(8, a)).ok());
  const StepPlan plan = cache.step();
  for (std::int32_t t = 0; t < 8; ++t) {
    CHECK(plan.positions[static_cast<std::size_t>(t)] == t);
    CHECK(plan.rows[static_cast<std::size_t>(t)] == t);
    CHECK(cache.visible_range(t, 0).value() == RowRange{0, t + 1});
    CHECK(cache.visible_range(t, kMax).value() == RowRange{0, t + 1});
    CHECK(cache.visible_range(t, 2).value() == RowRange{std::max(0, t - 1), t + 1});
  }
  CHECK(cache.capacity() == std::int64_t{kMax} - 8);
  CHECK(cache.free_cells() == std::int64_t{kMax} - 16);
}

TEST_CASE("host_bytes reports what a configuration holds; fits_within refuses what exceeds a budget") {
  const CacheConfig small{.max_write = 8, .max_cells = 1024};
  const Result<std::size_t> bytes = Cells::host_bytes(small);
  REQUIRE(bytes.ok());
  // At least: a position and an owner set per cell, and the position table's int32 entries.
  const std::size_t floor = 1024 * (4 + sizeof(SeqSet<8>)) + 4 * static_cast<std::size_t>(PositionTable::flat_size(8, 1024));
  CHECK(bytes.value() >= floor);
  CHECK(bytes.value() < 4 * floor);
  CHECK(Cells::fits_within(small, bytes.value()).ok());
  CHECK(Cells::fits_within(small, bytes.value() - 1) == Errc::out_of_memory);
  CHECK(Cells::fits_within({.max_write = 0, .max_cells = 16}, 1u << 30) == Errc::bad_argument);
  // It grows with the cells and the step width, not with nothing.
  CHECK(Cells::host_bytes({.max_write = 8, .max_cells = 2048}).value() > bytes.value());
  CHECK(Cells::host_bytes({.max_write = 16, .max_cells = 1024}).value() > bytes.value());
  CHECK(Clustered::host_bytes(small).value() > bytes.value());  // block counts on top

  // The largest cell cache validate accepts for one sequence holds gigabytes: refused against a
  // budget before anything is allocated, never a bad_alloc.
  const CacheConfig huge{.max_write = 8, .max_cells = 2000 * 1000 * 1000, .max_seqs = 1};
  REQUIRE(Cells::validate(huge).ok());
  CHECK(Cells::host_bytes(huge).value() > (std::size_t{16} << 30));
  CHECK(Cells::fits_within(huge, std::size_t{1} << 30) == Errc::out_of_memory);

  // The sequence layout holds no per-row state: its bytes do not grow with max_len.
  CHECK(Slots::host_bytes({.max_write = 8, .max_len = 16}).value() ==
        Slots::host_bytes({.max_write = 8, .max_len = 1 << 20}).value());
  CHECK(Slots::host_bytes({.max_write = 8, .max_len = 0}).status() == Errc::bad_argument);
  // The budget check runs before a build: what fits is built, and the cache holds what it said.
  Cells cache(small);
  CHECK(cache.capacity() == 1024);
}

TEST_CASE("value() of a refused session result throws, naming the reason and the session") {
  using Cache = CellCache<Windows<0>, placement::lowest_free, 4>;
  Cache cache({.max_write = 4, .max_cells = 32, .max_seqs = 1});
  batching::SessionTable table(cache, {.max_write = 4, .max_tokens_per_session = 16, .vocab = 10});
  const std::vector<std::int32_t> prompt{1, 2, 3};
  REQUIRE(table.add(prompt, 2).ok());
  const auto refused = table.add(prompt, 2);  // the only cache sequence is taken
  REQUIRE(refused.status() == Errc::no_free_sequence);
  REQUIRE(refused.status() == batching::SessionErrc::too_many_sessions);
  CHECK_THROWS_AS((void)refused.value(), BadResultAccess);
  try {
    (void)refused.value();
    FAIL("value() returned");
  } catch (const batching::BadSessionResultAccess& e) {
    CHECK(e.code() == Errc::no_free_sequence);
    CHECK(e.status() == refused.status());
    CHECK(std::string(e.what()).find("SessionResult::value()") != std::string::npos);
  }
  try {
    (void)cache.pos(3).value();  // max_seqs 1: id 3 is out of range
    FAIL("value() returned");
  } catch (const BadResultAccess& e) {
    CHECK(e.code() == Errc::bad_sequence_id);
    CHECK(std::string(e.what()).find("Result::value()") != std::string::npos);
  }
  const std::vector<std::int32_t> bad{1, 10};
  const auto out_of_vocab = table.add(bad, 2);
  try {
    (void)out_of_vocab.value();
    FAIL("value() returned");
  } catch (const batching::BadSessionResultAccess& e) {
    CHECK(e.status().detail() == batching::SessionErrc::token_out_of_vocab);
  }
  CHECK(out_of_vocab.value_or(99) == 99);
  CHECK(table.add(prompt, 2).value_or(0) == 0);
}

TEST_CASE("the reference refuses a head dim below 1 and a negative window, writing nothing") {
  Cells cache({.max_write = 4, .max_cells = 8});
  const std::int32_t a = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{a, a}).ok());
  std::vector<float> k_pool(8 * 2, 5.f), v_pool(8 * 2, 5.f);
  const std::vector<float> q(4, 1.f), k(4, 1.f), v(4, 1.f);
  std::vector<float> out(4, -3.f);
  for (const std::int32_t head_dim : {0, -1, kMin}) {
    CAPTURE(head_dim);
    const PoolView<float> pool{k_pool.data(), v_pool.data(), 8, 1, head_dim};
    const std::vector<float> none;
    std::vector<float> no_out;
    CHECK(reference::update_and_attend<Cells, float>(cache, 0, pool, none, none, none, no_out, 1, 1.f) == Errc::bad_shape);
    CHECK(reference::update_and_attend<Cells, float>(cache, 0, pool, q, k, v, out, 1, 1.f) == Errc::bad_shape);
  }
  const PoolView<float> pool{k_pool.data(), v_pool.data(), 8, 1, 2};
  for (const std::int32_t window : {-1, kMin})
    CHECK(reference::update_and_attend<Cells, float>(cache, window, pool, q, k, v, out, 1, 1.f) == Errc::bad_argument);
  CHECK(k_pool == std::vector<float>(16, 5.f));
  CHECK(out == std::vector<float>(4, -3.f));
  CHECK(reference::update_and_attend<Cells, float>(cache, kMax, pool, q, k, v, out, 1, 1.f).ok());
  CHECK(out[0] == doctest::Approx(1.f));
}

TEST_CASE("every status code and session detail has its own description") {
  std::vector<std::string> seen;
  for (int e = 0; e <= static_cast<int>(Errc::window_evicted); ++e) {
    const std::string text(describe(static_cast<Errc>(e)));
    CAPTURE(e);
    CHECK(!text.empty());
    CHECK(text != "unknown status");
    CHECK(std::find(seen.begin(), seen.end(), text) == seen.end());
    CHECK(Status(static_cast<Errc>(e)).message() == text);
    seen.push_back(text);
  }
  CHECK(describe(static_cast<Errc>(static_cast<int>(Errc::window_evicted) + 1)) == "unknown status");

  using batching::SessionErrc;
  seen.clear();
  CHECK(describe(SessionErrc::none).empty());
  for (int d = 1; d <= static_cast<int>(SessionErrc::no_room); ++d) {
    const std::string text(describe(static_cast<SessionErrc>(d)));
    CAPTURE(d);
    CHECK(!text.empty());
    CHECK(text != "unknown detail");
    CHECK(std::find(seen.begin(), seen.end(), text) == seen.end());
    seen.push_back(text);
  }
  CHECK(describe(static_cast<SessionErrc>(static_cast<int>(SessionErrc::no_room) + 1)) == "unknown detail");
  const batching::SessionStatus s(Errc::out_of_cells, SessionErrc::no_room, 7);
  CHECK(s.message() == std::string(describe(Errc::out_of_cells)) + ": session 7: " + std::string(describe(SessionErrc::no_room)));
  CHECK(batching::SessionStatus(Errc::bad_argument).message() == describe(Errc::bad_argument));
}
