// The tier-0 batching primitives: plan_slices and first_slice (the documented examples exactly,
// then properties over many arguments) and SessionTable driving a real host cache (packing order,
// slices planned against the room left in a step, the min_prefill waiting rule, positions from
// declare_step, logit rows, clones sharing cells, every refusal with a snapshot compare of the
// table and the cache, a long random simulation checked step by step against a model, and the
// no-starvation bound under steady decoding), and n samples of a prompt (add_samples: the samples
// wait for the leader, then share its prompt's cells; a finished leader hands them on; refusals).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cellkv/batching/batching.hpp"
#include "cellkv/kv_cache.hpp"
#include "batch_checks.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using test::Positions;
using test::Rows;

using Tokens = std::vector<std::int32_t>;
using Slices = std::vector<Slice>;
using LogitRows = std::vector<LogitRow>;
using Ids = std::vector<SessionId>;

constexpr Method kP = Method::prefill;
constexpr Method kD = Method::decode;

using Full = Windows<0>;
using Cells = CellCache<Full>;
using Slots = SequenceCache<Full>;
using CellTable = SessionTable<Cells>;
using SlotTable = SessionTable<Slots>;

// n one-token decode slices from `begin`.
Slices decodes(std::int32_t begin, std::int32_t n) {
  Slices out;
  for (std::int32_t i = 0; i < n; ++i) out.push_back({begin + i, 1, kD});
  return out;
}
Slices concat(Slices a, const Slices& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
// first, first + 1, ..., first + n - 1.
Tokens iota_tokens(std::int32_t first, std::int32_t n) {
  Tokens t(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) t[static_cast<std::size_t>(i)] = first + i;
  return t;
}
Tokens to_tokens(std::span<const std::int32_t> s) { return {s.begin(), s.end()}; }

// The contract of plan_slices, token by token: token i lies in chunk i / max; a chunk of L tokens
// (max, or the remainder) is one prefill slice when L > 1 and L >= min, else L decode slices.
bool follows_the_rule(const Slices& plan, std::int32_t total, std::int32_t max, std::int32_t min) {
  std::int32_t next = 0;
  for (const Slice& s : plan) {
    if (s.begin != next || s.length < 1) return false;
    const std::int32_t chunk_begin = s.begin / max * max;
    const std::int32_t chunk_len = std::min(max, total - chunk_begin);
    const bool prefill = chunk_len > 1 && chunk_len >= min;
    if (s.method != (prefill ? kP : kD)) return false;
    if (prefill && (s.begin != chunk_begin || s.length != chunk_len || s.length > max || s.length < min)) return false;
    if (!prefill && s.length != 1) return false;
    next += s.length;
  }
  return next == total;
}

// ---- a step through table and cache ----

struct Ran {
  StepBatch batch;
  Positions positions;
  Rows rows;
};

// next_step, check_batch and declare_step; the batch stays in flight.
template <class Cache>
Ran declare(Cache& cache, SessionTable<Cache>& table) {
  auto batch = table.next_step();
  REQUIRE(batch.ok());
  REQUIRE(test::check_batch(table, batch.value()).ok());
  REQUIRE(cache.declare_step(batch.value().seqs).ok());
  return {batch.value(), test::step_positions(cache), test::step_rows(cache)};
}

// declare, then accept `sampled`.
template <class Cache>
Ran run(Cache& cache, SessionTable<Cache>& table, const Tokens& sampled) {
  Ran r = declare(cache, table);
  REQUIRE(table.accept(sampled).ok());
  return r;
}

// Every live session's cache sequence holds what the table says it holds.
template <class Cache>
void check_positions(const Cache& cache, const SessionTable<Cache>& table) {
  for (const SessionId id : table.sessions()) {
    const std::int32_t seq = table.sequence_of(id).value();
    CHECK(cache.pos(seq).value() == table.cached_tokens(id).value());
  }
}

constexpr SessionLimits kLimits{.max_write = 8, .min_prefill_tokens = 2, .max_tokens_per_session = 32};

Cells make_cells(std::int32_t max_seqs = 0, std::int32_t max_cells = 64) {
  return Cells({.max_write = 8, .max_cells = max_cells, .max_seqs = max_seqs});
}

}  // namespace

// ================================ plan_slices ================================

TEST_CASE("plan_slices: the documented examples") {
  CHECK(plan_slices(9, 8, 2) == Slices{{0, 8, kP}, {8, 1, kD}});
  CHECK(plan_slices(10, 8, 2) == Slices{{0, 8, kP}, {8, 2, kP}});
  CHECK(plan_slices(0, 8, 2).empty());
  CHECK(plan_slices(4, 8, 5) == Slices{{0, 1, kD}, {1, 1, kD}, {2, 1, kD}, {3, 1, kD}});
  CHECK(plan_slices(11, 8, 5) == Slices{{0, 8, kP}, {8, 1, kD}, {9, 1, kD}, {10, 1, kD}});
  CHECK(first_slice(11, 8, 5) == Slice{0, 8, kP});
}

TEST_CASE("plan_slices: edges of the rule") {
  CHECK(plan_slices(3, 1, 1) == decodes(0, 3));  // max_step_tokens == 1: every token decodes
  CHECK(plan_slices(9, 4, 5) == decodes(0, 9));  // a full chunk below min_prefill decodes too
  CHECK(plan_slices(8, 8, 9) == decodes(0, 8));
  CHECK(plan_slices(8, 8, 8) == Slices{{0, 8, kP}});
  CHECK(plan_slices(16, 8, 2) == Slices{{0, 8, kP}, {8, 8, kP}});
  CHECK(plan_slices(17, 8, 8) == Slices{{0, 8, kP}, {8, 8, kP}, {16, 1, kD}});
  CHECK(plan_slices(5, 8, 2) == Slices{{0, 5, kP}});
  CHECK(plan_slices(1, 8, 1) == Slices{{0, 1, kD}});  // one token is never a prefill
  CHECK(plan_slices(2, 8, 1) == Slices{{0, 2, kP}});
  CHECK(plan_slices(20, 8, 5) == concat(Slices{{0, 8, kP}, {8, 8, kP}}, decodes(16, 4)));
  CHECK(plan_slices(21, 8, 5) == Slices{{0, 8, kP}, {8, 8, kP}, {16, 5, kP}});
}

TEST_CASE("plan_slices: properties over many arguments") {
  std::int32_t combos = 0, failures = 0;
  for (std::int32_t total = 0; total <= 70; ++total)
    for (std::int32_t max = 1; max <= 12; ++max)
      for (std::int32_t min = 1; min <= 14; ++min) {
        const Slices plan = plan_slices(total, max, min);
        const auto checked = test::plan_slices_checked(total, max, min);
        const Slice first = plan.empty() ? Slice{} : plan.front();
        const bool ok = follows_the_rule(plan, total, max, min) && checked.ok() && checked.value() == plan &&
                        first_slice(total, max, min) == first;
        if (!ok) {
          ++failures;
          INFO("total ", total, " max ", max, " min ", min);
          CHECK(ok);
        }
        ++combos;
      }
  CHECK(combos == 71 * 12 * 14);
  CHECK(failures == 0);
}

TEST_CASE("plan_slices: invalid arguments give an empty plan and bad_argument") {
  const std::int32_t bad[][3] = {{-1, 8, 2}, {4, 0, 2}, {4, -3, 2}, {4, 8, 0}, {4, 8, -1}, {-5, 0, 0}};
  for (const auto& a : bad) {
    INFO(a[0], " ", a[1], " ", a[2]);
    CHECK(plan_slices(a[0], a[1], a[2]).empty());
    CHECK(test::plan_slices_checked(a[0], a[1], a[2]).status() == Errc::bad_argument);
    CHECK(first_slice(a[0], a[1], a[2]) == Slice{});
  }
  CHECK(test::plan_slices_checked(0, 1, 1).ok());
  CHECK(test::plan_slices_checked(0, 1, 1).value().empty());
  CHECK(first_slice(0, 8, 2) == Slice{});
}

TEST_CASE("first_slice: the front of plan_slices, without the plan") {
  static_assert(first_slice(20, 5, 2) == Slice{0, 5, kP});  // a chunk that fills max_step_tokens
  static_assert(first_slice(3, 5, 2) == Slice{0, 3, kP});   // the whole rest, when it is shorter
  static_assert(first_slice(20, 1, 1) == Slice{0, 1, kD});  // room for one token: a decode
  static_assert(first_slice(20, 3, 4) == Slice{0, 1, kD});  // a chunk below min_prefill: one decode
  static_assert(first_slice(3, 8, 4) == Slice{0, 1, kD});   // a rest below min_prefill: one decode
  static_assert(first_slice(1, 8, 1) == Slice{0, 1, kD});
  static_assert(first_slice(100000, 64, 64) == Slice{0, 64, kP});
  CHECK(first_slice(100000, 64, 65) == Slice{0, 1, kD});
}

// ================================ SessionTable ================================

TEST_CASE("session table: decode tokens first, then prompt slices, oldest first") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{10, 11, 12}, 3).value();  // P3
  const SessionId b = table.add(iota_tokens(100, 5), 2).value();  // P5
  const SessionId c = table.add(Tokens{200}, 1).value();          // D1
  CHECK(Ids{a, b, c} == Ids{1, 2, 3});
  CHECK(table.sequence_of(a).value() == 0);
  CHECK(table.sequence_of(b).value() == 1);
  CHECK(table.sequence_of(c).value() == 2);
  CHECK(table.feeding_count() == 3);

  // a's P3 and b's P5 fill the step; c's D1 waits.
  Ran r = run(cache, table, {50, 60});
  CHECK(r.batch.tokens == Tokens{10, 11, 12, 100, 101, 102, 103, 104});
  CHECK(r.batch.seqs == Tokens{0, 0, 0, 1, 1, 1, 1, 1});
  CHECK(r.batch.logit_rows == LogitRows{{2, a, true}, {7, b, true}});
  CHECK(r.positions == Positions{0, 1, 2, 0, 1, 2, 3, 4});
  CHECK(r.rows == Rows{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(table.generating_count() == 2);
  CHECK(table.feeding_count() == 1);
  check_positions(cache, table);

  // Decodes of a and b (oldest first), then c's prompt.
  r = run(cache, table, {51, 61, 70});
  CHECK(r.batch.tokens == Tokens{50, 60, 200});
  CHECK(r.batch.seqs == Tokens{0, 1, 2});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}, {1, b, true}, {2, c, true}});
  CHECK(r.positions == Positions{3, 5, 0});
  CHECK(table.state(b).value() == SessionState::done);
  CHECK(table.state(c).value() == SessionState::done);

  r = run(cache, table, {52});
  CHECK(r.batch.tokens == Tokens{51});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}});
  CHECK(r.positions == Positions{4});

  CHECK(table.next_step().status() == Errc::empty_step);
  CHECK(table.done_count() == 3);
  CHECK(to_tokens(table.output(a).value()) == Tokens{50, 51, 52});
  CHECK(to_tokens(table.output(b).value()) == Tokens{60, 61});
  CHECK(to_tokens(table.output(c).value()) == Tokens{70});
  CHECK(table.cached_tokens(a).value() == 5);  // 3 prompt + 2 fed generated tokens
  CHECK(table.cached_tokens(b).value() == 6);
  CHECK(table.cached_tokens(c).value() == 1);
  check_positions(cache, table);
}

TEST_CASE("session table: a prompt slice is planned against the room left and feeding is first in, first out") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2, 3}, 3).value();
  run(cache, table, {50});
  const SessionId b = table.add(iota_tokens(100, 8), 1).value();  // P8: 7 tokens fit behind a's decode
  const SessionId c = table.add(Tokens{200, 201}, 1).value();     // no room left for c: it waits

  Ran r = run(cache, table, {51});
  CHECK(r.batch.tokens == Tokens{50, 100, 101, 102, 103, 104, 105, 106});
  CHECK(r.batch.seqs == Tokens{0, 1, 1, 1, 1, 1, 1, 1});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}, {7, b, false}});
  CHECK(r.positions == Positions{3, 0, 1, 2, 3, 4, 5, 6});
  CHECK(table.cached_tokens(b).value() == 7);
  CHECK(table.state(c).value() == SessionState::feeding);
  CHECK(table.cached_tokens(c).value() == 0);

  // b's last prompt token, then c's P2 in the room left.
  r = run(cache, table, {52, 80, 90});
  CHECK(r.batch.tokens == Tokens{51, 107, 200, 201});
  CHECK(r.batch.seqs == Tokens{0, 1, 2, 2});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}, {1, b, true}, {3, c, true}});
  CHECK(r.positions == Positions{4, 7, 0, 1});
  CHECK(table.next_step().status() == Errc::empty_step);
  CHECK(table.done_count() == 3);
  CHECK(to_tokens(table.output(a).value()) == Tokens{50, 51, 52});
  CHECK(to_tokens(table.output(b).value()) == Tokens{80});
  CHECK(to_tokens(table.output(c).value()) == Tokens{90});
  check_positions(cache, table);
}

TEST_CASE("session table: a long prompt joins decoding sessions in chunks that fill the room") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);  // max_write 8, min_prefill 2
  const SessionId a = table.add(Tokens{1}, 10).value();
  const SessionId b = table.add(Tokens{2}, 10).value();
  const SessionId c = table.add(Tokens{3}, 10).value();
  Ran r = run(cache, table, {50, 60, 70});
  CHECK(r.batch.tokens == Tokens{1, 2, 3});
  CHECK(table.generating_count() == 3);

  // Under a plan cut once at admission ({8, 4}) x would wait for a, b and c to finish; planned
  // against the room, it goes in as chunks of the 5 tokens left beside their 3 decodes.
  const SessionId x = table.add(iota_tokens(100, 12), 1).value();
  r = run(cache, table, {51, 61, 71});
  CHECK(r.batch.tokens == Tokens{50, 60, 70, 100, 101, 102, 103, 104});
  CHECK(r.batch.seqs == Tokens{0, 1, 2, 3, 3, 3, 3, 3});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}, {1, b, true}, {2, c, true}, {7, x, false}});
  CHECK(r.positions == Positions{1, 1, 1, 0, 1, 2, 3, 4});
  r = run(cache, table, {52, 62, 72});
  CHECK(r.batch.tokens == Tokens{51, 61, 71, 105, 106, 107, 108, 109});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}, {1, b, true}, {2, c, true}, {7, x, false}});
  CHECK(r.positions == Positions{2, 2, 2, 5, 6, 7, 8, 9});
  r = run(cache, table, {53, 63, 73, 80});  // the rest, 2 tokens: x samples
  CHECK(r.batch.tokens == Tokens{52, 62, 72, 110, 111});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}, {1, b, true}, {2, c, true}, {4, x, true}});
  CHECK(r.positions == Positions{3, 3, 3, 10, 11});
  CHECK(table.state(x).value() == SessionState::done);
  CHECK(to_tokens(table.output(x).value()) == Tokens{80});
  check_positions(cache, table);
}

TEST_CASE("session table: a prompt longer than max_write joins while max_write - 1 sessions decode") {
  constexpr std::int32_t kW = 64;
  constexpr std::int32_t kPrompt = 150;
  Cells cache({.max_write = kW, .max_cells = 16384, .max_seqs = kW});
  CellTable table(cache, {.max_write = kW, .min_prefill_tokens = 4, .max_tokens_per_session = 256});
  Ids decoders;
  for (std::int32_t i = 0; i < kW - 1; ++i) decoders.push_back(table.add(Tokens{i}, 200).value());
  Ran r = run(cache, table, Tokens(kW - 1, 7));  // 63 one-token prompts in one step
  REQUIRE(table.generating_count() == kW - 1);
  const Tokens prompt = iota_tokens(1000, kPrompt);
  const SessionId x = table.add(prompt, 1).value();
  const std::int32_t xs = table.sequence_of(x).value();

  // How many decoders are left in each step: all 63 (room 1) for 5 steps, then 43 (room 21) for 3
  // steps, then 3 (room 61) until x is in. Every step but the last of x fills max_write exactly.
  std::int32_t fed = 0, steps = 0;
  while (table.state(x).value() == SessionState::feeding) {
    const std::int32_t keep = steps < 5 ? kW - 1 : steps < 8 ? kW - 21 : 3;
    while (table.generating_count() > keep) REQUIRE(table.finish(table.sessions().front()).ok());
    const std::int32_t room = kW - table.generating_count();
    const std::int32_t left = kPrompt - fed;
    const std::int32_t chunk = std::min(left, room);
    INFO("step ", steps, " room ", room, " left ", left);
    r = declare(cache, table);
    CHECK(r.batch.size() == kW - room + chunk);
    if (chunk < left) CHECK(r.batch.size() == kW);
    CHECK(r.batch.logit_rows.back() == LogitRow{r.batch.size() - 1, x, chunk == left});
    const auto begin = static_cast<std::size_t>(kW - room);
    CHECK(Tokens(r.batch.tokens.begin() + static_cast<std::ptrdiff_t>(begin), r.batch.tokens.end()) ==
          Tokens(prompt.begin() + fed, prompt.begin() + fed + chunk));
    CHECK(std::all_of(r.batch.seqs.begin() + static_cast<std::ptrdiff_t>(begin), r.batch.seqs.end(),
                      [&](std::int32_t s) { return s == xs; }));
    for (std::int32_t t = 0; t < chunk; ++t) CHECK(r.positions[begin + static_cast<std::size_t>(t)] == fed + t);
    REQUIRE(table.accept(Tokens(static_cast<std::size_t>(kW - room + (chunk == left ? 1 : 0)), 9)).ok());
    fed += chunk;
    ++steps;
  }
  CHECK(fed == kPrompt);
  CHECK(steps == 5 + 3 + 2);  // 5 x 1 + 3 x 21 + 61 + the last 21
  CHECK(table.cached_tokens(x).value() == kPrompt);
  CHECK(table.generating_count() == 3);
  check_positions(cache, table);
}

TEST_CASE("session table: a short room feeds a single prompt token only when the step has none yet") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 8, .min_prefill_tokens = 4, .max_tokens_per_session = 64});
  Ids g;
  for (std::int32_t i = 0; i < 5; ++i) g.push_back(table.add(Tokens{i}, 30).value());
  // One-token prompts are below min_prefill whatever the room: no waiting helps them, they go in.
  Ran r = run(cache, table, Tokens(5, 50));
  CHECK(r.batch.tokens == Tokens{0, 1, 2, 3, 4});
  const SessionId x = table.add(iota_tokens(100, 10), 3).value();
  const SessionId y = table.add(iota_tokens(200, 7), 1).value();
  const SessionId z = table.add(Tokens{300}, 1).value();

  // Room 3 < min_prefill 4: x, the first prompt of the step, gets one token anyway (progress); y
  // would get one token only because the room is short, so it waits, and z (which would fit)
  // waits behind it: 2 tokens of the step stay empty.
  r = run(cache, table, Tokens(5, 51));
  CHECK(r.batch.tokens == Tokens{50, 50, 50, 50, 50, 100});
  CHECK(r.batch.logit_rows.back() == LogitRow{5, x, false});
  CHECK(table.cached_tokens(y).value() == 0);
  CHECK(table.cached_tokens(z).value() == 0);

  // Room 5: x takes a prefill of 5, nothing is left for y.
  REQUIRE(table.finish(g[0]).ok());
  REQUIRE(table.finish(g[1]).ok());
  r = run(cache, table, Tokens(3, 52));
  CHECK(r.batch.tokens == Tokens{51, 51, 51, 101, 102, 103, 104, 105});
  CHECK(r.batch.logit_rows.back() == LogitRow{7, x, false});

  // x's last 4 tokens (a prefill of min_prefill); room 1 is short for y again: it waits.
  r = run(cache, table, {53, 53, 53, 80});
  CHECK(r.batch.tokens == Tokens{52, 52, 52, 106, 107, 108, 109});
  CHECK(r.batch.logit_rows.back() == LogitRow{6, x, true});
  CHECK(table.cached_tokens(y).value() == 0);

  // Four decodes (x joined), room 4: y's prefill of 4 fills it.
  r = run(cache, table, {54, 54, 54, 81});
  CHECK(r.batch.tokens == Tokens{53, 53, 53, 80, 200, 201, 202, 203});
  CHECK(r.batch.logit_rows.back() == LogitRow{7, y, false});

  // y's rest, 3 < min_prefill tokens, goes in one token per step whatever the room, and z (one
  // token) rides behind it in the same step.
  REQUIRE(table.finish(g[2]).ok());
  r = run(cache, table, {55, 55, 82, 90});
  CHECK(r.batch.tokens == Tokens{54, 54, 81, 204, 300});
  CHECK(r.batch.logit_rows == LogitRows{{0, g[3], true}, {1, g[4], true}, {2, x, true}, {3, y, false}, {4, z, true}});
  CHECK(r.positions == Positions{5, 5, 11, 4, 0});
  CHECK(table.state(x).value() == SessionState::done);
  r = run(cache, table, {56, 56});
  CHECK(r.batch.tokens == Tokens{55, 55, 205});
  r = run(cache, table, {57, 57, 83});
  CHECK(r.batch.tokens == Tokens{56, 56, 206});
  CHECK(r.batch.logit_rows.back() == LogitRow{2, y, true});
  CHECK(to_tokens(table.output(y).value()) == Tokens{83});
  check_positions(cache, table);
}

TEST_CASE("session table: with min_prefill_tokens > max_write no step holds a prefill, so nobody waits") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 4, .min_prefill_tokens = 6, .max_tokens_per_session = 32});
  const SessionId a = table.add(iota_tokens(10, 8), 1).value();
  const SessionId b = table.add(iota_tokens(20, 8), 1).value();
  Ran r = run(cache, table, {});
  CHECK(r.batch.tokens == Tokens{10, 20});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, false}, {1, b, false}});
  r = run(cache, table, {});
  CHECK(r.batch.tokens == Tokens{11, 21});
  CHECK(r.positions == Positions{1, 1});
}

TEST_CASE("session table: a remainder below min_prefill_tokens goes in one token per step") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 8, .min_prefill_tokens = 5, .max_tokens_per_session = 32});
  const SessionId a = table.add(iota_tokens(0, 11), 2).value();  // P8 D D D
  Ran r = run(cache, table, {});
  CHECK(r.batch.tokens == iota_tokens(0, 8));
  CHECK(r.batch.logit_rows == LogitRows{{7, a, false}});
  for (std::int32_t t = 8; t < 10; ++t) {
    r = run(cache, table, {});
    CHECK(r.batch.tokens == Tokens{t});
    CHECK(r.batch.logit_rows == LogitRows{{0, a, false}});
    CHECK(r.positions == Positions{t});
  }
  r = run(cache, table, {70});
  CHECK(r.batch.tokens == Tokens{10});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}});
  CHECK(table.state(a).value() == SessionState::generating);
  r = run(cache, table, {71});
  CHECK(r.batch.tokens == Tokens{70});
  CHECK(r.positions == Positions{11});
  CHECK(table.state(a).value() == SessionState::done);
  CHECK(to_tokens(table.output(a).value()) == Tokens{70, 71});
}

TEST_CASE("session table: a session without new tokens only fills its sequence") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{5, 6, 7}, 0).value();
  const Ran r = run(cache, table, {});
  CHECK(r.batch.logit_rows == LogitRows{{2, a, false}});
  CHECK(table.state(a).value() == SessionState::done);
  CHECK(table.output(a).value().empty());
  CHECK(table.cached_tokens(a).value() == 3);
  CHECK(table.next_step().status() == Errc::empty_step);
  CHECK(table.reap() == Ids{a});
  CHECK_FALSE(cache.is_live(0));
}

TEST_CASE("session table: ids are never reused while sequence ids are recycled") {
  auto cache = make_cells(2);
  CellTable table(cache, kLimits);
  CHECK(table.free_sequences() == 2);
  CHECK(table.add(Tokens{1}, 1).value() == 1);
  CHECK(table.add(Tokens{2}, 1).value() == 2);
  CHECK(table.free_sequences() == 0);
  CHECK(table.add(Tokens{3}, 1).status() == SessionErrc::too_many_sessions);
  REQUIRE(table.finish(1).ok());
  CHECK(table.free_sequences() == 1);
  const SessionId c = table.add(Tokens{3}, 1).value();
  CHECK(c == 3);
  CHECK(table.sequence_of(c).value() == 0);
  REQUIRE(table.finish(c).ok());
  CHECK(table.finish(c) == SessionStatus(Errc::bad_argument, SessionErrc::unknown_session, c));
  const SessionId d = table.clone(2, 1).value();
  CHECK(d == 4);
  CHECK(table.sequence_of(d).value() == 0);
  CHECK(table.sessions() == Ids{2, 4});
  CHECK_FALSE(table.is_live(1));
  CHECK_FALSE(table.is_live(3));
  CHECK_FALSE(table.is_live(0));
  CHECK(table.sequence_of(1).status() == SessionErrc::unknown_session);
}

TEST_CASE("session table: a clone shares its source's prompt cells") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 16});
  const SessionId a = table.add(iota_tokens(1, 6), 4).value();  // P4 P2
  run(cache, table, {});                                         // a has fed 4 prompt tokens

  const SessionId c = table.clone(a, 2).value();
  const std::int32_t cs = table.sequence_of(c).value();
  CHECK(cs == 1);
  CHECK(table.cached_tokens(c).value() == 4);
  CHECK(cache.pos(cs).value() == 4);
  CHECK(cache.free_cells() == 64 - 4);  // zero copy
  for (std::int32_t cell = 0; cell < 4; ++cell) {
    CHECK(cache.cell_owners(cell).test(0));
    CHECK(cache.cell_owners(cell).test(cs));
  }
  CHECK(to_tokens(table.prompt(c).value()) == iota_tokens(1, 6));

  // Both feed prompt tokens 5, 6 at positions 4, 5 into their own cells.
  Ran r = run(cache, table, {40, 50});
  CHECK(r.batch.tokens == Tokens{5, 6, 5, 6});
  CHECK(r.batch.seqs == Tokens{0, 0, 1, 1});
  CHECK(r.batch.logit_rows == LogitRows{{1, a, true}, {3, c, true}});
  CHECK(r.positions == Positions{4, 5, 4, 5});
  CHECK(r.rows == Rows{4, 5, 6, 7});
  CHECK_FALSE(cache.cell_owners(4).test(cs));
  CHECK_FALSE(cache.cell_owners(6).test(0));
  CHECK(to_tokens(table.output(a).value()) == Tokens{40});
  CHECK(to_tokens(table.output(c).value()) == Tokens{50});

  // A clone of a session that has fed its whole prompt re-feeds the last prompt token: its logits
  // give the clone's own first token.
  const SessionId d = table.clone(a, 1).value();
  const std::int32_t ds = table.sequence_of(d).value();
  CHECK(table.cached_tokens(d).value() == 5);
  for (std::int32_t cell = 0; cell < 5; ++cell) CHECK(cache.cell_owners(cell).test(ds));
  CHECK_FALSE(cache.cell_owners(5).test(ds));
  r = run(cache, table, {41, 51, 60});
  CHECK(r.batch.tokens == Tokens{40, 50, 6});
  CHECK(r.batch.seqs == Tokens{0, 1, ds});
  CHECK(r.batch.logit_rows == LogitRows{{0, a, true}, {1, c, true}, {2, d, true}});
  CHECK(r.positions == Positions{6, 6, 5});
  CHECK(table.state(d).value() == SessionState::done);
  CHECK(table.state(c).value() == SessionState::done);
  check_positions(cache, table);

  // The source can leave first: the clones keep the shared cells.
  REQUIRE(table.finish(a).ok());
  for (std::int32_t cell = 0; cell < 4; ++cell) CHECK(cache.cell_pos(cell) == cell);
  CHECK(table.reap() == Ids{c, d});
  CHECK(cache.free_cells() == 64);
}

TEST_CASE("session table: with window storage, a clone of a source past its window feeds the whole prompt") {
  using WindowCells = CellCache<Windows<0, 8>>;
  WindowCells cache({.max_write = 4, .max_cells = 400, .max_seqs = 4, .window_cells = 4 * (8 + 64 + 4)});
  SessionTable<WindowCells> table(cache, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 300});
  const SessionId a = table.add(iota_tokens(1, 6), 200).value();
  auto sampled = [](const Ran& r) {  // token 7 for every row that samples
    return Tokens(static_cast<std::size_t>(std::count_if(r.batch.logit_rows.begin(), r.batch.logit_rows.end(),
                                                         [](const LogitRow& l) { return l.samples; })),
                  7);
  };
  auto step = [&] {
    const Ran r = declare(cache, table);
    REQUIRE(table.accept(sampled(r)).ok());
  };
  while (table.cached_tokens(a).value() < 140) step();  // the window pool let go of positions 0..127
  const std::int32_t as = table.sequence_of(a).value();
  REQUIRE(cache.seq_clone(as, 5).status() == Errc::window_evicted);  // what a shared prefix would need
  const auto free_before = cache.free_cells();

  const SessionId c = table.clone(a, 3).value();
  const std::int32_t cs = table.sequence_of(c).value();
  CHECK(table.cached_tokens(c).value() == 0);
  CHECK(cache.pos(cs).value() == 0);
  CHECK(cache.free_cells() == free_before);  // nothing shared, nothing copied
  CHECK(to_tokens(table.prompt(c).value()) == iota_tokens(1, 6));
  // c feeds its whole prompt from position 0, then generates its 3 tokens.
  const Ran first = declare(cache, table);
  std::vector<std::int32_t> fed;
  for (std::size_t t = 0; t < first.batch.seqs.size(); ++t)
    if (first.batch.seqs[t] == cs) fed.push_back(first.positions[t]);
  CHECK(fed == Positions{0, 1, 2});
  REQUIRE(table.accept(sampled(first)).ok());
  while (table.state(c).value() != SessionState::done) step();
  CHECK(table.cached_tokens(c).value() == 6 + 3 - 1);
  check_positions(cache, table);
}

namespace {
// A cell cache with window storage whose seq_clone can be made to refuse (out_of_pages).
using WindowCells = CellCache<Windows<0, 8>>;
struct RefusingClones {
  WindowCells cache{CacheConfig{.max_write = 4, .max_cells = 1000, .max_seqs = 4, .window_cells = 4 * (8 + 64 + 4)}};
  bool refuse = false;
  Result<std::int32_t> seq_new() { return cache.seq_new(); }
  Result<std::int32_t> seq_clone(std::int32_t src, std::int32_t upto = -1) {
    if (refuse) return Errc::out_of_pages;
    return cache.seq_clone(src, upto);
  }
  Status seq_rm(std::int32_t id) { return cache.seq_rm(id); }
  Status rewind(std::int32_t id, std::int32_t pos) { return cache.rewind(id, pos); }
  const WindowCells& host() const { return cache; }
};
}  // namespace

TEST_CASE("session table: with window storage, a sample whose leader went past its window feeds the prompt itself") {
  RefusingClones wrapper;
  SessionTable<RefusingClones> table(wrapper, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 300});
  wrapper.refuse = true;  // the samples' first clones are refused: they wait while the leader generates
  const std::vector<SessionId> ids = table.add_samples(iota_tokens(1, 6), 200, {}, 2).value();
  const SessionId leader = ids[0], sample = ids[1];
  auto step = [&] {
    auto batch = table.next_step();
    REQUIRE(batch.ok());
    REQUIRE(wrapper.cache.declare_step(batch.value().seqs).ok());
    const auto rows = std::count_if(batch.value().logit_rows.begin(), batch.value().logit_rows.end(),
                                    [](const LogitRow& l) { return l.samples; });
    REQUIRE(table.accept(Tokens(static_cast<std::size_t>(rows), 7)).ok());
  };
  while (table.cached_tokens(leader).value() < 140) step();  // past two pages of window 8
  CHECK(table.cached_tokens(sample).value() == 0);
  wrapper.refuse = false;  // every clone of the leader's prompt is now window_evicted
  REQUIRE(wrapper.cache.seq_clone(table.sequence_of(leader).value(), 5).status() == Errc::window_evicted);
  for (int i = 0; i < 4; ++i) step();
  CHECK(table.cached_tokens(sample).value() >= 6);  // it fed the whole prompt itself, from position 0
  for (int i = 0; i < 600 && !(table.state(leader).value() == SessionState::done &&
                                table.state(sample).value() == SessionState::done); ++i)
    step();
  CHECK(table.state(leader).value() == SessionState::done);  // no sample waits for it any more
  CHECK(table.state(sample).value() == SessionState::done);
}

TEST_CASE("session table: a clone on the sequence layout copies the shared prefix") {
  Slots cache({.max_write = 8, .max_seqs = 4, .max_len = 16});
  SlotTable table(cache, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 16});
  const SessionId a = table.add(iota_tokens(1, 6), 2).value();
  run(cache, table, {});
  cache.acknowledge_changes();
  const SessionId c = table.clone(a, 2).value();
  REQUIRE(cache.pending_changes().copies.size() == 1);
  CHECK(cache.pending_changes().copies[0] == RowCopy{0, 16, 4});
  const Ran r = run(cache, table, {40, 50});
  CHECK(r.batch.seqs == Tokens{0, 0, 1, 1});
  CHECK(r.batch.logit_rows == LogitRows{{1, a, true}, {3, c, true}});
  CHECK(r.positions == Positions{4, 5, 4, 5});
  CHECK(r.rows == Rows{4, 5, 20, 21});
  check_positions(cache, table);
}

TEST_CASE("session table: finish and reap free sequences") {
  auto cache = make_cells(4);
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2}, 1).value();
  const SessionId b = table.add(iota_tokens(10, 8), 3).value();  // 6 tokens fit behind a's P2
  const SessionId c = table.add(Tokens{3, 4}, 1).value();         // no room left: waits
  run(cache, table, {50});  // a: P2 -> done
  CHECK(table.state(a).value() == SessionState::done);
  CHECK(table.state(b).value() == SessionState::feeding);
  CHECK(table.cached_tokens(b).value() == 6);
  CHECK(table.cached_tokens(c).value() == 0);
  CHECK(table.free_sequences() == 1);

  REQUIRE(table.finish(b).ok());  // a feeding session can leave before its prompt is in
  CHECK_FALSE(cache.is_live(1));
  CHECK(table.live_count() == 2);
  run(cache, table, {60});  // c: P2 -> done
  CHECK(table.done_count() == 2);
  CHECK(table.reap() == Ids{a, c});
  CHECK(table.reap().empty());
  CHECK(table.live_count() == 0);
  CHECK(table.free_sequences() == 4);
  CHECK(cache.free_cells() == 64);
  CHECK(table.output(a).status() == SessionErrc::unknown_session);
}

TEST_CASE("session table: abandon restores the table and rewinds the cache") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2, 3}, 4).value();
  run(cache, table, {50});
  const SessionId b = table.add(Tokens{7, 8}, 2).value();
  const CellTable before = table;
  const auto free_before = cache.free_cells();

  const Ran r = declare(cache, table);  // a decodes at 3, b feeds 0, 1
  CHECK(table.in_flight());
  CHECK(cache.pos(0).value() == 4);
  const auto points = table.abandon();
  CHECK(points == std::vector<RewindPoint>{{0, 3}, {1, 0}});
  CHECK_FALSE(table.in_flight());
  CHECK(table == before);
  CHECK(cache.pos(0).value() == 3);
  CHECK(cache.pos(1).value() == 0);
  CHECK(cache.free_cells() == free_before);
  CHECK(table.abandon().empty());  // nothing in flight: nothing to do

  // The same step again, now accepted.
  const Ran again = run(cache, table, {51, 70});
  CHECK(again.batch == r.batch);
  CHECK(again.positions == r.positions);
  CHECK(to_tokens(table.output(a).value()) == Tokens{50, 51});
  CHECK(to_tokens(table.output(b).value()) == Tokens{70});
  check_positions(cache, table);
}

namespace {

// The three verbs alone, like a cache without rewind: abandon() leaves the rewind to the caller.
struct VerbsOnly {
  Cells* cache;
  Result<std::int32_t> seq_new() { return cache->seq_new(); }
  Result<std::int32_t> seq_clone(std::int32_t src, std::int32_t upto) { return cache->seq_clone(src, upto); }
  Status seq_rm(std::int32_t id) { return cache->seq_rm(id); }
};
static_assert(SessionCache<VerbsOnly> && !RewindableCache<VerbsOnly>);
static_assert(RewindableCache<Cells> && RewindableCache<Slots>);
// A device-cache-like wrapper: the verbs, and the queries through host().
struct Wrapper {
  Cells cache;
  Result<std::int32_t> seq_new() { return cache.seq_new(); }
  Result<std::int32_t> seq_clone(std::int32_t src, std::int32_t upto = -1) { return cache.seq_clone(src, upto); }
  Status seq_rm(std::int32_t id) { return cache.seq_rm(id); }
  Status rewind(std::int32_t id, std::int32_t pos) { return cache.rewind(id, pos); }
  const Cells& host() const { return cache; }
};

template <class T>
concept CountsFreeSequences = requires(const T& t) { t.free_sequences(); };
static_assert(CountsFreeSequences<CellTable> && CountsFreeSequences<SessionTable<Wrapper>> &&
              !CountsFreeSequences<SessionTable<VerbsOnly>>);

}  // namespace

TEST_CASE("session table: over a cache without rewind, abandon returns the rewind points") {
  auto cache = make_cells();
  VerbsOnly verbs{&cache};
  SessionTable table(verbs, kLimits);
  const SessionId a = table.add(Tokens{1, 2, 3}, 1).value();
  const auto batch = table.next_step();
  REQUIRE(batch.ok());
  REQUIRE(cache.declare_step(batch.value().seqs).ok());
  CHECK(table.abandon() == std::vector<RewindPoint>{{0, 0}});
  CHECK(cache.pos(0).value() == 3);  // not rewound by the table
  REQUIRE(cache.rewind(0, 0).ok());
  CHECK(table.state(a).value() == SessionState::feeding);
  CHECK(table.next_step().value() == batch.value());
}

TEST_CASE("session table: over a device-cache-like wrapper, queries go through host()") {
  Wrapper wrapper{make_cells(3)};
  SessionTable table(wrapper, kLimits);
  CHECK(table.free_sequences() == 3);
  REQUIRE(table.add(Tokens{1, 2}, 1).ok());
  CHECK(table.free_sequences() == 2);
  CHECK(SessionTable<Wrapper>::validate({.max_write = 9, .min_prefill_tokens = 1, .max_tokens_per_session = 4},
                                        wrapper) == Errc::bad_argument);
}

TEST_CASE("session table: limits are validated at construction") {
  auto cache = make_cells();
  CHECK(CellTable::validate(kLimits, cache).ok());
  CHECK(CellTable::validate({.max_write = 1, .min_prefill_tokens = 1, .max_tokens_per_session = 1}, cache).ok());
  const SessionLimits bad[] = {{0, 2, 32}, {8, 0, 32}, {8, 2, 0}, {9, 2, 32}, {-1, 2, 32}};
  for (const SessionLimits& l : bad) {
    CHECK(CellTable::validate(l, cache) == Errc::bad_argument);
    CHECK_THROWS_AS(CellTable(cache, l), std::invalid_argument);
  }
}

// ---- every refusal changes nothing, in the table or the cache ----

namespace {

// A full cache (3 sequences): a generating, b feeding (7 of its P8 went in beside a's decode), c
// done.
struct Busy {
  Cells cache = make_cells(3);
  CellTable table{cache, kLimits};
  SessionId a = 0, b = 0, c = 0;
  Busy() {
    a = table.add(Tokens{1, 2, 3}, 4).value();
    c = table.add(Tokens{9}, 1).value();
    run(cache, table, {50, 90});
    b = table.add(iota_tokens(100, 8), 4).value();
    run(cache, table, {51});
  }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;
};

// `expected`: a core code (Errc) or a batching detail (SessionErrc).
template <class Expected>
void check_refused(const Busy& busy, const CellTable& table_before, const Cells& cache_before, SessionStatus got,
                   Expected expected) {
  CHECK(got == expected);
  CHECK(busy.table == table_before);
  CHECK(busy.cache == cache_before);
}

}  // namespace

TEST_CASE("session table: refusals change nothing") {
  Busy busy;
  auto& table = busy.table;
  const CellTable table_before = table;
  const Cells cache_before = busy.cache;
  REQUIRE(table.state(busy.a).value() == SessionState::generating);
  REQUIRE(table.state(busy.b).value() == SessionState::feeding);
  REQUIRE(table.state(busy.c).value() == SessionState::done);

  SUBCASE("add") {
    check_refused(busy, table_before, cache_before, table.add(Tokens{}, 1).status(), Errc::bad_argument);
    check_refused(busy, table_before, cache_before, table.add(Tokens{1}, -1).status(), Errc::bad_argument);
    check_refused(busy, table_before, cache_before, table.add(iota_tokens(0, 33), 0).status(), SessionErrc::over_budget);
    check_refused(busy, table_before, cache_before, table.add(iota_tokens(0, 30), 3).status(), SessionErrc::over_budget);
    check_refused(busy, table_before, cache_before, table.add(iota_tokens(0, 30), 2).status(), SessionErrc::too_many_sessions);
  }
  SUBCASE("clone") {
    check_refused(busy, table_before, cache_before, table.clone(99, 1).status(), SessionErrc::unknown_session);
    check_refused(busy, table_before, cache_before, table.clone(0, 1).status(), SessionErrc::unknown_session);
    check_refused(busy, table_before, cache_before, table.clone(busy.a, -1).status(), Errc::bad_argument);
    check_refused(busy, table_before, cache_before, table.clone(busy.b, 25).status(), SessionErrc::over_budget);
    check_refused(busy, table_before, cache_before, table.clone(busy.b, 24).status(), SessionErrc::too_many_sessions);
  }
  SUBCASE("finish") {
    check_refused(busy, table_before, cache_before, table.finish(0), SessionErrc::unknown_session);
    check_refused(busy, table_before, cache_before, table.finish(4), SessionErrc::unknown_session);
  }
  SUBCASE("accept and abandon without a batch in flight") {
    check_refused(busy, table_before, cache_before, table.accept(Tokens{}), Errc::bad_argument);
    check_refused(busy, table_before, cache_before, table.accept(Tokens{1}), Errc::bad_argument);
    CHECK(table.abandon().empty());
    check_refused(busy, table_before, cache_before, Status{}, Errc::ok);
  }
  SUBCASE("next_step with no work") {
    CellTable idle(busy.cache, kLimits);
    const CellTable idle_before = idle;
    CHECK(idle.next_step().status() == Errc::empty_step);
    CHECK(idle == idle_before);
    REQUIRE(table.finish(busy.a).ok());
    REQUIRE(table.finish(busy.b).ok());  // only the done session c is left
    const CellTable done_before = table;
    const Cells done_cache = busy.cache;
    check_refused(busy, done_before, done_cache, table.next_step().status(), Errc::empty_step);
  }
}

TEST_CASE("session table: while a batch is in flight, verbs and a second step are refused") {
  Busy busy;
  auto& table = busy.table;
  REQUIRE(table.finish(busy.c).ok());  // a free sequence, so add and clone could otherwise succeed
  const Ran r = declare(busy.cache, table);
  CHECK(r.batch.tokens == Tokens{51, 107});  // a's decode, b's last prompt token
  CHECK(r.batch.logit_rows == LogitRows{{0, busy.a, true}, {1, busy.b, true}});
  const CellTable table_before = table;
  const Cells cache_before = busy.cache;

  check_refused(busy, table_before, cache_before, table.add(Tokens{1}, 1).status(), Errc::bad_argument);
  check_refused(busy, table_before, cache_before, table.clone(busy.a, 1).status(), Errc::bad_argument);
  check_refused(busy, table_before, cache_before, table.finish(busy.a), Errc::bad_argument);
  check_refused(busy, table_before, cache_before, table.finish(99), SessionErrc::unknown_session);
  check_refused(busy, table_before, cache_before, table.next_step().status(), Errc::bad_argument);
  check_refused(busy, table_before, cache_before, table.accept(Tokens{}), Errc::bad_argument);
  check_refused(busy, table_before, cache_before, table.accept(Tokens{1}), Errc::bad_argument);
  check_refused(busy, table_before, cache_before, table.accept(Tokens{1, 2, 3}), Errc::bad_argument);
  CHECK(table.reap().empty());
  check_refused(busy, table_before, cache_before, test::check_batch(table, r.batch).code, Errc::ok);

  REQUIRE(table.accept(Tokens{52, 80}).ok());
  CHECK(to_tokens(table.output(busy.a).value()) == Tokens{50, 51, 52});
  CHECK(to_tokens(table.output(busy.b).value()) == Tokens{80});
}

TEST_CASE("session table: check_batch refusals") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2}, 3).value();
  run(cache, table, {50});
  const SessionId b = table.add(Tokens{10, 11, 12}, 2).value();
  const SessionId d = table.add(Tokens{20, 21}, 0).value();
  const StepBatch good{{50, 10, 11, 12, 20, 21}, {0, 1, 1, 1, 2, 2}, {{0, a, true}, {3, b, true}, {5, d, false}}};
  const CellTable before = table;
  CHECK(test::check_batch(table, good).ok());

  auto variant = [&](auto change) {
    StepBatch v = good;
    change(v);
    return test::check_batch(table, v);
  };
  CHECK(test::check_batch(table, StepBatch{}) == Errc::empty_step);
  CHECK(variant([](StepBatch& v) {
          v.tokens.assign(9, 1);
          v.seqs.assign(9, 0);
        }) == Errc::step_too_wide);
  CHECK(variant([](StepBatch& v) { v.seqs.pop_back(); }) == Errc::bad_argument);
  CHECK(variant([](StepBatch& v) { v.logit_rows.back().row = 6; }) == Errc::bad_argument);
  CHECK(variant([](StepBatch& v) { std::swap(v.logit_rows[0], v.logit_rows[1]); }) == Errc::bad_argument);
  CHECK(variant([](StepBatch& v) { v.seqs[0] = 5; }) == test::BatchFault::unknown_session);
  CHECK(variant([](StepBatch& v) { v.logit_rows[0].session = 99; }) == test::BatchFault::unknown_session);
  CHECK(variant([&](StepBatch& v) { v.logit_rows[0].session = b; }) == Errc::bad_argument);
  // b in two runs (a's token between them)
  CHECK(variant([&](StepBatch& v) {
          v.seqs = {1, 0, 1, 1, 2, 2};
          v.logit_rows = {{0, b, false}, {1, a, true}, {3, b, true}, {5, d, false}};
        }) == test::BatchFault::overlapping_input);
  // b as two slices in one run
  CHECK(variant([&](StepBatch& v) { v.logit_rows.insert(v.logit_rows.begin() + 1, LogitRow{1, b, false}); }) ==
        test::BatchFault::overlapping_input);
  // a given two decode tokens
  CHECK(variant([&](StepBatch& v) {
          v.tokens.insert(v.tokens.begin(), 50);
          v.seqs.insert(v.seqs.begin(), 0);
          v.logit_rows = {{0, a, true}, {1, a, true}, {4, b, true}, {6, d, false}};
        }) == test::BatchFault::overlapping_input);
  CHECK(variant([&](StepBatch& v) {
          v.tokens.insert(v.tokens.begin(), 50);
          v.seqs.insert(v.seqs.begin(), 0);
          v.logit_rows = {{1, a, true}, {4, b, true}, {6, d, false}};
        }) == Errc::bad_argument);
  CHECK(variant([](StepBatch& v) { v.logit_rows.pop_back(); }) == Errc::bad_argument);  // d's run ends bare
  CHECK(variant([](StepBatch& v) {                                                      // b's slice cut short
          v.tokens.erase(v.tokens.begin() + 3);
          v.seqs.erase(v.seqs.begin() + 3);
          v.logit_rows = {{0, 1, true}, {2, 2, true}, {4, 3, false}};
        }) == Errc::bad_argument);
  CHECK(variant([](StepBatch& v) { v.logit_rows.back().samples = true; }) == Errc::bad_argument);
  CHECK(variant([](StepBatch& v) { v.logit_rows.front().samples = false; }) == Errc::bad_argument);
  CHECK(table == before);

  // The order of the runs is not checked; each feeding run is judged by the room where it begins.
  const StepBatch reordered{{20, 21, 50, 10, 11, 12}, {2, 2, 0, 1, 1, 1}, {{1, d, false}, {2, a, true}, {5, b, true}}};
  CHECK(test::check_batch(table, reordered).ok());
  CHECK(table == before);

  const auto batch = table.next_step();
  REQUIRE(batch.ok());
  CHECK(batch.value() == good);
}

TEST_CASE("session table: check_batch judges a prompt slice by the room where its run begins") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);  // max_write 8, min_prefill 2
  const SessionId a = table.add(Tokens{1}, 3).value();
  run(cache, table, {50});
  const SessionId b = table.add(iota_tokens(10, 10), 1).value();
  const StepBatch good{{50, 10, 11, 12, 13, 14, 15, 16}, {0, 1, 1, 1, 1, 1, 1, 1}, {{0, a, true}, {7, b, false}}};
  CHECK(test::check_batch(table, good).ok());
  // b first: row 0 leaves room 8, so its slice is 8 tokens, not 7.
  const StepBatch b_first{{10, 11, 12, 13, 14, 15, 16, 50}, {1, 1, 1, 1, 1, 1, 1, 0}, {{6, b, false}, {7, a, true}}};
  CHECK(test::check_batch(table, b_first) == Errc::bad_argument);
  const StepBatch b_alone{iota_tokens(10, 8), Tokens(8, 1), {{7, b, false}}};
  CHECK(test::check_batch(table, b_alone).ok());
  // A slice shorter than the room allows, or one token where a prefill fits.
  const StepBatch b_short{{50, 10, 11, 12, 13, 14}, {0, 1, 1, 1, 1, 1}, {{0, a, true}, {5, b, false}}};
  CHECK(test::check_batch(table, b_short) == Errc::bad_argument);
  const StepBatch b_one{{50, 10}, {0, 1}, {{0, a, true}, {1, b, false}}};
  CHECK(test::check_batch(table, b_one) == Errc::bad_argument);
  const auto batch = table.next_step();
  REQUIRE(batch.ok());
  CHECK(batch.value() == good);
}

// ================================ random simulation ================================

namespace {

// What a session should be, kept independently of the table.
struct Model {
  Tokens prompt;
  std::int32_t max_new = 0;
  std::int32_t shared = 0;  // prompt tokens taken from the clone source
  std::int32_t fed = 0;     // prompt tokens in the sequence, shared ones included
  std::int32_t seq = 0;
  SessionId leader = 0;     // a sample of add_samples waiting for its leader's prompt cells
  std::int32_t added_at = 0;  // accepted steps before it was added
  std::int32_t feed_bound = 0;  // it must be fed within this many accepted steps (when bounded)
  Tokens content;     // the tokens at positions [0, pos) of its sequence
  Tokens given;       // the tokens it was given in steps
  Tokens outputs;     // the tokens sampled for it
  std::int32_t left() const { return static_cast<std::int32_t>(prompt.size()) - fed; }
  bool feeding() const { return left() > 0; }
  bool generating() const { return !feeding() && static_cast<std::int32_t>(outputs.size()) < max_new; }
  bool done() const { return !feeding() && !generating(); }
  // prompt, then every sampled token but the last
  Tokens history() const {
    Tokens h = prompt;
    if (!outputs.empty()) h.insert(h.end(), outputs.begin(), outputs.end() - 1);
    return h;
  }
};

struct SimConfig {
  SessionLimits limits;
  std::int32_t max_prompt = 0;  // prompts of add() are 1..max_prompt tokens
  std::uint32_t seed = 1;
  std::int32_t steps = 3000;
};

struct SimCounts {
  std::int32_t steps = 0, added = 0, cloned = 0, finished = 0, reaped = 0, refused = 0, abandoned = 0,
               out_of_cells = 0, idle = 0;
  std::int32_t sampled = 0;  // add_samples calls that succeeded
  std::int32_t adopted = 0;  // samples that got their leader's cells
  std::int32_t handed_on = 0;  // leaders finished while samples waited
  std::int64_t decode_tokens = 0, prompt_tokens = 0;  // in accepted steps
  std::int32_t fully_fed = 0;        // sessions whose prompt went in completely (shared prefix aside)
  std::int32_t longest_feed = 0;     // most accepted steps from add/clone to fully fed
  std::int32_t largest_bound = 0;    // largest feed_bound given
  std::int32_t short_feeds = 0;      // steps feeding one token in a short room: the step had no prompt
  std::int32_t short_waits = 0;      // steps in which a session waited for a room >= min_prefill
};

template <class Cache>
class Simulation {
 public:
  Simulation(Cache& cache, SimConfig config)
      : cache_(cache), table_(cache, config.limits), limits_(config.limits), max_prompt_(config.max_prompt),
        rng_(config.seed), row_token_(static_cast<std::size_t>(cache.capacity()), -1),
        bounded_(cache.max_seqs() <= config.limits.max_write) {}

  SimCounts run(std::int32_t steps) {
    for (std::int32_t i = 0; i < steps; ++i) {
      events();
      step();
      check_all();
    }
    return counts_;
  }

 private:
  std::int32_t uniform(std::int32_t lo, std::int32_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<std::int32_t>(lo, hi)(rng_);
  }
  bool chance(std::int32_t percent) { return uniform(0, 99) < percent; }
  SessionId pick() {
    auto it = models_.begin();
    std::advance(it, uniform(0, static_cast<std::int32_t>(models_.size()) - 1));
    return it->first;
  }
  bool table_is_full() const { return table_.live_count() == cache_.max_seqs(); }

  void events() {
    if (chance(30)) add();
    if (chance(10) && !models_.empty()) clone();
    if (chance(8)) add_samples();
    if (chance(4) && !models_.empty()) finish(pick());
    if (chance(50)) reap();
  }

  void add() {
    const std::int32_t budget = limits_.max_tokens_per_session;
    Tokens prompt(static_cast<std::size_t>(uniform(1, max_prompt_)));
    for (auto& t : prompt) t = uniform(0, 999);
    const std::int32_t max_new = uniform(0, budget - static_cast<std::int32_t>(prompt.size()) + 3);
    const bool full = table_is_full();
    const auto got = table_.add(prompt, max_new);
    if (static_cast<std::int32_t>(prompt.size()) + max_new > budget) return expect_refused(got.status(), SessionErrc::over_budget);
    if (full) return expect_refused(got.status(), SessionErrc::too_many_sessions);
    REQUIRE(got.ok());
    Model m;
    m.prompt = prompt;
    m.max_new = max_new;
    start(got.value(), std::move(m));
    ++counts_.added;
  }

  void clone() {
    const SessionId src = pick();
    const Model& from = models_.at(src);
    const auto n = static_cast<std::int32_t>(from.prompt.size());
    const std::int32_t max_new = uniform(0, limits_.max_tokens_per_session - n + 3);
    const bool full = table_is_full();
    const auto got = table_.clone(src, max_new);
    if (n + max_new > limits_.max_tokens_per_session) return expect_refused(got.status(), SessionErrc::over_budget);
    if (full) return expect_refused(got.status(), SessionErrc::too_many_sessions);
    REQUIRE(got.ok());
    Model m;
    m.prompt = from.prompt;
    m.max_new = max_new;
    m.shared = std::min(from.fed, n - 1);
    m.content.assign(from.content.begin(), from.content.begin() + m.shared);
    copy_rows();
    start(got.value(), std::move(m));
    ++counts_.cloned;
  }

  // n samples of one prompt: the first leads, the others wait for it, each in a sequence of its own;
  // sample i draws with seed + i.
  void add_samples() {
    const std::int32_t budget = limits_.max_tokens_per_session;
    Tokens prompt(static_cast<std::size_t>(uniform(1, max_prompt_)));
    for (auto& t : prompt) t = uniform(0, 999);
    const auto n = static_cast<std::int32_t>(prompt.size());
    const std::int32_t max_new = uniform(0, budget - n + 3);
    const std::int32_t samples = uniform(1, 4);
    const std::int32_t free = cache_.max_seqs() - cache_.live_count();
    const auto seed = static_cast<std::uint64_t>(uniform(0, 1000));
    const auto got = table_.add_samples(prompt, max_new, {.temperature = 1.f, .seed = seed}, samples);
    if (n + max_new > budget) return expect_refused(got.status(), SessionErrc::over_budget);
    if (free < samples) return expect_refused(got.status(), SessionErrc::too_many_sessions);
    REQUIRE(got.ok());
    REQUIRE(got.value().size() == static_cast<std::size_t>(samples));
    for (std::int32_t i = 0; i < samples; ++i) {
      const SessionId id = got.value()[static_cast<std::size_t>(i)];
      REQUIRE(table_.sampling(id).value().seed == seed + static_cast<std::uint64_t>(i));
      Model m;
      m.prompt = prompt;
      m.max_new = max_new;
      m.leader = i == 0 ? 0 : got.value().front();
      start(id, std::move(m));
    }
    ++counts_.sampled;
  }

  // Whether a sample waits for session `id`'s prompt cells.
  bool has_waiters(SessionId id) const {
    return std::any_of(models_.begin(), models_.end(), [id](const auto& e) { return e.second.leader == id; });
  }

  // What next_step does before it packs prompt slices: every sample whose leader has fed
  // prompt.size() - 1 prompt tokens leaves its reserved sequence for a clone of those positions,
  // which takes the lowest free sequence id.
  void adopt() {
    std::vector<bool> live(static_cast<std::size_t>(cache_.max_seqs()));
    for (std::int32_t s = 0; s < cache_.max_seqs(); ++s) live[static_cast<std::size_t>(s)] = cache_.is_live(s);
    for (auto& [id, m] : models_) {
      if (m.leader == 0) continue;
      const Model& leader = models_.at(m.leader);
      const auto shared = static_cast<std::int32_t>(leader.prompt.size()) - 1;
      if (leader.fed < shared) continue;
      live[static_cast<std::size_t>(m.seq)] = false;
      m.seq = static_cast<std::int32_t>(std::find(live.begin(), live.end(), false) - live.begin());
      live[static_cast<std::size_t>(m.seq)] = true;
      m.shared = shared;
      m.fed = shared;
      m.content.assign(leader.content.begin(), leader.content.begin() + shared);
      m.leader = 0;
      ++counts_.adopted;
    }
  }

  // Fills in what the table decides (the sequence) and the no-starvation bound: with at most
  // max_write sequences, fewer than max_write sessions generate while one feeds, so every accepted
  // step feeds the oldest feeding session a token; the new session is fed once the prompt tokens
  // left now, its own and those of the (older) feeding sessions, are in. They never exceed
  // max_seqs * max_tokens_per_session.
  void start(SessionId id, Model m) {
    REQUIRE(id == next_id_++);
    m.fed = m.shared;
    m.seq = table_.sequence_of(id).value();
    m.added_at = counts_.steps;
    m.feed_bound = m.left();
    for (const auto& [older, o] : models_) m.feed_bound += o.left();
    if (bounded_) REQUIRE(m.feed_bound <= cache_.max_seqs() * limits_.max_tokens_per_session);
    counts_.largest_bound = std::max(counts_.largest_bound, m.feed_bound);
    REQUIRE(table_.cached_tokens(id).value() == m.shared);
    models_.emplace(id, std::move(m));
  }

  template <class Expected>  // a core code (Errc) or a batching detail (SessionErrc)
  void expect_refused(SessionStatus got, Expected expected) {
    CHECK(got == expected);
    ++counts_.refused;
  }

  void finish(SessionId id) {
    const Model& m = models_.at(id);
    const Tokens h = m.history();
    CHECK(std::equal(m.content.begin(), m.content.end(), h.begin()));  // a prefix of its history
    REQUIRE(table_.finish(id).ok());
    CHECK_FALSE(cache_.is_live(m.seq));
    models_.erase(id);
    ++counts_.finished;
    // Its waiting samples, if any: the oldest feeds the prompt itself and leads the others.
    SessionId heir = 0;
    for (auto& [other, o] : models_) {
      if (o.leader != id) continue;
      o.leader = heir;
      if (heir == 0) heir = other;
    }
    counts_.handed_on += heir != 0 ? 1 : 0;
  }

  void reap() {
    Ids expected;
    for (const auto& [id, m] : models_)
      if (m.done() && !has_waiters(id)) expected.push_back(id);
    REQUIRE(table_.reap() == expected);
    for (const SessionId id : expected) {
      const Model& m = models_.at(id);
      const Tokens h = m.history();
      CHECK(static_cast<std::int32_t>(m.outputs.size()) == m.max_new);
      CHECK(m.content == h);  // shared prefix + every token it was given
      CHECK(m.given == Tokens(h.begin() + m.shared, h.end()));
      CHECK_FALSE(cache_.is_live(m.seq));
      models_.erase(id);
    }
    counts_.reaped += static_cast<std::int32_t>(expected.size());
  }

  // The batch the contract prescribes for the models now: decodes, oldest first, while room is left;
  // then, oldest first, each feeding session's plan_slices(left, room, min_prefill).front(), except
  // that a session whose slice would be one token only because room < min_prefill <= max_write
  // (left >= min_prefill) waits, unless no prompt token is in the step yet; the first feeding
  // session that gets nothing ends the step.
  StepBatch expected_batch(bool& short_feed, bool& short_wait) const {
    short_feed = short_wait = false;
    StepBatch b;
    std::int32_t room = limits_.max_write;
    auto push = [&b](SessionId id, const Model& m, const Tokens& tokens, bool samples) {
      b.tokens.insert(b.tokens.end(), tokens.begin(), tokens.end());
      b.seqs.insert(b.seqs.end(), tokens.size(), m.seq);
      b.logit_rows.push_back({b.size() - 1, id, samples});
    };
    for (const auto& [id, m] : models_)
      if (m.generating() && room > 0) {
        push(id, m, {m.outputs.back()}, true);
        --room;
      }
    const std::int32_t min = limits_.min_prefill_tokens;
    bool prompt_in_step = false;
    for (const auto& [id, m] : models_) {
      if (!m.feeding() || m.leader != 0) continue;
      if (room == 0) break;
      const bool room_is_short = room < min && min <= limits_.max_write && m.left() >= min;
      if (room_is_short && prompt_in_step) {
        short_wait = true;
        break;
      }
      short_feed = short_feed || room_is_short;
      const Slice s = plan_slices(m.left(), room, min).front();
      REQUIRE(s.begin == 0);
      REQUIRE(s.length <= room);
      const std::int32_t fit = std::min(m.left(), room);  // the front slice, restated
      REQUIRE(s.length == (fit > 1 && fit >= min ? fit : 1));
      const auto first = m.prompt.begin() + m.fed;
      push(id, m, Tokens(first, first + s.length), s.length == m.left() && m.max_new > 0);
      room -= s.length;
      prompt_in_step = true;
    }
    return b;
  }

  void step() {
    bool short_feed = false, short_wait = false;
    adopt();
    const StepBatch expected = expected_batch(short_feed, short_wait);
    counts_.short_feeds += short_feed;
    counts_.short_waits += short_wait;
    const std::size_t copies = cache_.pending_changes().copies.size();
    auto got = table_.next_step();
    copy_rows(copies);  // the sequence layout's copies of the adopted samples' prompt rows
    if (expected.tokens.empty()) {
      CHECK(got.status() == Errc::empty_step);
      ++counts_.idle;
      return;
    }
    REQUIRE(got.ok());
    const StepBatch& batch = got.value();
    REQUIRE(batch == expected);
    REQUIRE(batch.size() <= limits_.max_write);
    REQUIRE(test::check_batch(table_, batch).ok());
    const auto plan = cache_.declare_step(batch.seqs);
    if (!plan.ok()) {
      CHECK(plan.status() == Errc::out_of_cells);
      ++counts_.out_of_cells;
      abandon(batch);
      finish(models_.begin()->first);  // make room: the oldest session leaves
      return;
    }
    check_placement(batch, plan.value());
    if (chance(3)) return abandon(batch);  // the forward failed
    accept(batch);
  }

  // Each session's tokens sit at the positions after what its sequence holds, in order.
  void check_placement(const StepBatch& batch, const StepPlan& plan) {
    std::size_t t = 0;
    for (const LogitRow& r : batch.logit_rows) {
      const Model& m = models_.at(r.session);
      for (std::int32_t p = static_cast<std::int32_t>(m.content.size()); t <= static_cast<std::size_t>(r.row); ++t, ++p) {
        REQUIRE(plan.seqs[t] == m.seq);
        REQUIRE(plan.positions[t] == p);
        row_token_[static_cast<std::size_t>(plan.rows[t])] = batch.tokens[t];
      }
    }
    REQUIRE(t == batch.tokens.size());
  }

  void abandon(const StepBatch& batch) {
    std::vector<RewindPoint> expected;
    for (const LogitRow& r : batch.logit_rows) {
      const Model& m = models_.at(r.session);
      expected.push_back({m.seq, static_cast<std::int32_t>(m.content.size())});
    }
    REQUIRE(table_.abandon() == expected);
    ++counts_.abandoned;
  }

  void accept(const StepBatch& batch) {
    Tokens sampled;
    std::int32_t begin = 0;
    for (const LogitRow& r : batch.logit_rows) {
      Model& m = models_.at(r.session);
      const Tokens tokens(batch.tokens.begin() + begin, batch.tokens.begin() + r.row + 1);
      m.content.insert(m.content.end(), tokens.begin(), tokens.end());
      m.given.insert(m.given.end(), tokens.begin(), tokens.end());
      if (m.feeding()) {
        m.fed += static_cast<std::int32_t>(tokens.size());
        counts_.prompt_tokens += static_cast<std::int64_t>(tokens.size());
        if (!m.feeding()) {
          const std::int32_t took = counts_.steps + 1 - m.added_at;  // this step counted
          if (bounded_) CHECK(took <= m.feed_bound);
          counts_.longest_feed = std::max(counts_.longest_feed, took);
          ++counts_.fully_fed;
        }
      } else {
        counts_.decode_tokens += static_cast<std::int64_t>(tokens.size());
      }
      if (r.samples) {
        sampled.push_back(uniform(1000, 1999));
        m.outputs.push_back(sampled.back());
      }
      begin = r.row + 1;
    }
    REQUIRE(table_.accept(sampled).ok());
    ++counts_.steps;
  }

  // Sequence layout forks copy rows: mirror the copies in row_token_, from copy number `first` on.
  void copy_rows(std::size_t first = 0) {
    const auto& copies = cache_.pending_changes().copies;
    for (std::size_t k = first; k < copies.size(); ++k)
      for (std::int32_t i = 0; i < copies[k].rows; ++i)
        row_token_[static_cast<std::size_t>(copies[k].dst_row + i)] =
            row_token_[static_cast<std::size_t>(copies[k].src_row + i)];
  }

  [[nodiscard]] std::int64_t row_of(std::int32_t seq, std::int32_t p) const {
    if constexpr (std::is_same_v<typename Cache::Layout, layout::cell>)
      return cache_.cell_of(seq, p);
    else
      return cache_.slot_begin(seq) + p;
  }

  // The rows of m's sequence hold its content, position by position (cells: with m as an owner).
  [[nodiscard]] bool rows_hold(const Model& m) const {
    for (std::int32_t p = 0; p < static_cast<std::int32_t>(m.content.size()); ++p) {
      const std::int64_t row = row_of(m.seq, p);
      if (row_token_[static_cast<std::size_t>(row)] != m.content[static_cast<std::size_t>(p)]) return false;
      if constexpr (std::is_same_v<typename Cache::Layout, layout::cell>) {
        const auto cell = static_cast<std::int32_t>(row);
        if (cache_.cell_pos(cell) != p || !cache_.cell_owners(cell).test(m.seq)) return false;
      }
    }
    return true;
  }

  // Table, cache and model agree on every live session, down to the token in each row it holds.
  void check_all() {
    cache_.acknowledge_changes();
    REQUIRE(table_.live_count() == static_cast<std::int32_t>(models_.size()));
    REQUIRE(table_.live_count() == cache_.live_count());
    std::int32_t feeding = 0, generating = 0, done = 0, waiting = 0;
    for (const auto& [id, m] : models_) {
      const auto held = static_cast<std::int32_t>(m.content.size());
      REQUIRE(table_.sequence_of(id).value() == m.seq);
      REQUIRE(table_.cached_tokens(id).value() == held);
      REQUIRE(cache_.pos(m.seq).value() == held);
      REQUIRE(to_tokens(table_.output(id).value()) == m.outputs);
      REQUIRE(table_.leader_of(id).value() == m.leader);
      if (bounded_ && m.feeding()) REQUIRE(counts_.steps - m.added_at < m.feed_bound);  // not starved
      const bool held_back = m.done() && has_waiters(id);  // a leader is not done while samples wait
      feeding += m.feeding();
      generating += m.generating() || held_back;
      done += m.done() && !held_back;
      waiting += m.leader != 0;
      CHECK(rows_hold(m));
    }
    REQUIRE(table_.waiting_count() == waiting);
    REQUIRE(table_.feeding_count() == feeding);
    REQUIRE(table_.generating_count() == generating);
    REQUIRE(table_.done_count() == done);
  }

  Cache& cache_;
  SessionTable<Cache> table_;
  SessionLimits limits_;
  std::int32_t max_prompt_;
  std::mt19937 rng_;
  std::map<SessionId, Model> models_;
  std::vector<std::int32_t> row_token_;  // [capacity] token last written to each row
  SessionId next_id_ = 1;
  SimCounts counts_;
  bool bounded_;  // at most max_write sequences: the no-starvation bound applies
};

const SimConfig kSimConfigs[] = {
    {{.max_write = 8, .min_prefill_tokens = 3, .max_tokens_per_session = 40}, 34, 1, 3000},
    {{.max_write = 8, .min_prefill_tokens = 1, .max_tokens_per_session = 40}, 34, 2, 3000},
    {{.max_write = 5, .min_prefill_tokens = 6, .max_tokens_per_session = 40}, 34, 3, 2000},  // all decode
    {{.max_write = 1, .min_prefill_tokens = 1, .max_tokens_per_session = 24}, 18, 4, 2000},
    {{.max_write = 8, .min_prefill_tokens = 4, .max_tokens_per_session = 40}, 34, 5, 3000},  // short rooms wait
};

// Steady decoding: short prompts next to long generations, a cache of max_write sequences.
const SimConfig kSteadyConfigs[] = {
    {{.max_write = 16, .min_prefill_tokens = 4, .max_tokens_per_session = 200}, 60, 11, 3000},
    {{.max_write = 16, .min_prefill_tokens = 1, .max_tokens_per_session = 200}, 60, 12, 3000},
    {{.max_write = 64, .min_prefill_tokens = 8, .max_tokens_per_session = 400}, 150, 13, 1500},  // prompts > max_write
};

}  // namespace

TEST_CASE("session table: long random simulation, cell layout") {
  std::int32_t out_of_cells = 0;  // a small pool: steps are refused, abandoned, and sessions leave
  std::int32_t short_feeds = 0, short_waits = 0, handed_on = 0;
  for (const SimConfig& config : kSimConfigs) {
    INFO("seed ", config.seed);
    Cells cache({.max_write = 8, .max_cells = 64, .max_seqs = 12});
    const SimCounts n = Simulation<Cells>(cache, config).run(config.steps);
    CHECK(n.steps > config.steps / 2);
    CHECK(n.added > 0);
    CHECK(n.cloned > 0);
    CHECK(n.finished > 0);
    CHECK(n.reaped > 0);
    CHECK(n.refused > 0);
    CHECK(n.abandoned > 0);
    CHECK(n.sampled > 0);
    CHECK(n.adopted > 0);
    handed_on += n.handed_on;
    out_of_cells += n.out_of_cells;
    short_feeds += n.short_feeds;
    short_waits += n.short_waits;
    MESSAGE("cell seed ", config.seed, ": steps ", n.steps, " added ", n.added, " cloned ", n.cloned, " finished ",
            n.finished, " reaped ", n.reaped, " refused ", n.refused, " abandoned ", n.abandoned, " out_of_cells ",
            n.out_of_cells, " idle ", n.idle, " short feeds ", n.short_feeds, " short waits ", n.short_waits,
            " sampled ", n.sampled, " adopted ", n.adopted, " handed on ", n.handed_on);
  }
  CHECK(handed_on > 0);  // a leader left while its samples waited
  CHECK(out_of_cells > 0);
  CHECK(short_feeds > 0);  // the waiting rule was exercised both ways
  CHECK(short_waits > 0);
}

TEST_CASE("session table: no starvation under steady decoding") {
  std::int32_t short_feeds = 0;
  for (const SimConfig& config : kSteadyConfigs) {
    INFO("seed ", config.seed);
    const std::int32_t w = config.limits.max_write;
    const std::int32_t budget = config.limits.max_tokens_per_session;
    Cells cache({.max_write = w, .max_cells = w * budget, .max_seqs = w});
    const SimCounts n = Simulation<Cells>(cache, config).run(config.steps);
    // The simulation checked every session against its bound (feed_bound, at most
    // max_seqs * max_tokens_per_session accepted steps) in every step.
    CHECK(n.steps > config.steps * 9 / 10);
    CHECK(n.fully_fed > 50);
    CHECK(n.longest_feed <= n.largest_bound);
    CHECK(n.largest_bound <= w * budget);
    CHECK(n.decode_tokens > n.prompt_tokens);            // steady decoding ...
    CHECK(n.decode_tokens > std::int64_t{n.steps} * w / 2);  // ... filling most of each step
    if (config.limits.min_prefill_tokens > 1) CHECK(n.short_waits > 0);
    short_feeds += n.short_feeds;
    MESSAGE("steady seed ", config.seed, ": steps ", n.steps, " added ", n.added, " cloned ", n.cloned,
            " short feeds ", n.short_feeds, " short waits ", n.short_waits,
            " fully fed ", n.fully_fed, " longest feed ", n.longest_feed, " largest bound ", n.largest_bound,
            " decode tokens ", n.decode_tokens, " prompt tokens ", n.prompt_tokens, " abandoned ", n.abandoned,
            " out_of_cells ", n.out_of_cells, " adopted ", n.adopted);
  }
  CHECK(short_feeds > 0);
}

TEST_CASE("session table: long random simulation, sequence layout") {
  for (const SimConfig& config : kSimConfigs) {
    INFO("seed ", config.seed);
    Slots cache({.max_write = 8, .max_seqs = 12, .max_len = 40});
    const SimCounts n = Simulation<Slots>(cache, config).run(config.steps);
    CHECK(n.steps > config.steps / 2);
    CHECK(n.cloned > 0);
    CHECK(n.adopted > 0);
    CHECK(n.reaped > 0);
    CHECK(n.out_of_cells == 0);
    MESSAGE("slot seed ", config.seed, ": steps ", n.steps, " added ", n.added, " cloned ", n.cloned, " finished ",
            n.finished, " reaped ", n.reaped, " refused ", n.refused, " abandoned ", n.abandoned, " idle ", n.idle,
            " sampled ", n.sampled, " adopted ", n.adopted);
  }
}

// ================================ sampling, stops, tokens one step behind ================================

TEST_CASE("session table: add refuses ids outside the vocabulary, bad sampling and impossible budgets") {
  Cells cache = make_cells(4, 64);
  CellTable table(cache, {.max_write = 8, .min_prefill_tokens = 2, .max_tokens_per_session = 100, .vocab = 50});
  const SessionId a = table.add(Tokens{1, 2, 49}, 3, {.temperature = 1.f, .seed = 5}).value();
  const CellTable table_before = table;
  const Cells cache_before = cache;
  auto refused = [&](SessionStatus got, Errc code, SessionErrc detail) {
    CHECK(got == code);
    CHECK(got == detail);
    CHECK(got.session() == 0);
    CHECK(table == table_before);
    CHECK(cache == cache_before);
  };
  refused(table.add(Tokens{1, 50}, 3).status(), Errc::bad_argument, SessionErrc::token_out_of_vocab);
  refused(table.add(Tokens{-1}, 3).status(), Errc::bad_argument, SessionErrc::token_out_of_vocab);
  refused(table.add(Tokens{1}, 3, {.temperature = -0.5f}).status(), Errc::bad_argument, SessionErrc::bad_temperature);
  refused(table.add(Tokens{1}, 3, {.top_k = -1}).status(), Errc::bad_argument, SessionErrc::bad_top_k);
  refused(table.add(Tokens{1}, 3, {.top_p = 0.f}).status(), Errc::bad_argument, SessionErrc::bad_top_p);
  refused(table.add(Tokens{1}, 3, {.min_p = -1.f}).status(), Errc::bad_argument, SessionErrc::bad_min_p);
  refused(table.add(Tokens{1}, 3, {.stop_tokens = {7, 50}}).status(), Errc::bad_argument, SessionErrc::bad_stop_token);
  // 64 cells: a prompt of 40 and 25 new tokens holds 64 tokens at most; 26 would need 65.
  refused(table.add(iota_tokens(0, 40), 26).status(), Errc::bad_argument, SessionErrc::exceeds_cache);
  refused(table.clone(a, 63, {}).status(), Errc::bad_argument, SessionErrc::exceeds_cache);
  refused(table.clone(a, 3, {.top_p = 3.f}).status(), Errc::bad_argument, SessionErrc::bad_top_p);
  refused(table.add(Tokens(60, 1), 41).status(), Errc::bad_argument, SessionErrc::over_budget);  // the session budget
  CHECK(table.add(iota_tokens(0, 40), 25).ok());
  CHECK(table.add(Tokens{49}, 3, {.temperature = 0.5f, .top_k = 3, .top_p = 1.f, .min_p = 1.f, .stop_tokens = {0, 49}}).ok());
  const SessionId c = table.clone(a, 2).value();  // src's sampling
  CHECK(table.sampling(c).value() == table.sampling(a).value());
  CHECK(table.max_new_tokens(c).value() == 2);
  const std::string m = SessionStatus(Errc::bad_argument, SessionErrc::bad_top_p, 7).message();
  CHECK(m.find("bad argument") != std::string::npos);
  CHECK(m.find("session 7") != std::string::npos);
  CHECK(m.find("top_p") != std::string::npos);
}

TEST_CASE("session table: the sequence layout refuses sessions longer than max_len at add") {
  Slots cache({.max_write = 8, .max_seqs = 4, .max_len = 16});
  SlotTable table(cache, {.max_write = 8, .min_prefill_tokens = 2, .max_tokens_per_session = 64});
  const Slots before = cache;
  CHECK(table.add(iota_tokens(0, 10), 8).status() == SessionErrc::exceeds_sequence);  // 17 tokens held
  CHECK(table.add(iota_tokens(0, 17), 0).status() == SessionErrc::exceeds_sequence);
  CHECK(cache == before);
  CHECK(table.live_count() == 0);
  const SessionId a = table.add(iota_tokens(0, 10), 7).value();  // 16 tokens held at most
  const SessionId b = table.add(iota_tokens(0, 16), 0).value();
  // Run a to the end: its sequence never passes max_len.
  while (table.state(a).value() != SessionState::done) {
    Ran r = declare(cache, table);
    REQUIRE(table.accept(Tokens(r.batch.logit_rows.size() - (table.state(b).value() == SessionState::feeding ? 1 : 0), 3)).ok());
  }
  CHECK(table.cached_tokens(a).value() == 16);
  CHECK(cache.pos(table.sequence_of(a).value()).value() == 16);
}

TEST_CASE("session table: a stop token accepted at once ends its session") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2}, 10, {.stop_tokens = {99, 7}}).value();
  const SessionId b = table.add(Tokens{3}, 3).value();
  run(cache, table, {5, 7});  // b samples 7: not its stop token
  run(cache, table, {7, 8});  // a samples its stop token
  CHECK(table.state(a).value() == SessionState::done);
  CHECK(to_tokens(table.output(a).value()) == Tokens{5, 7});
  CHECK(table.cached_tokens(a).value() == 3);
  const Ran r = run(cache, table, {9});
  CHECK(r.batch.tokens == Tokens{8});  // only b
  CHECK(table.state(b).value() == SessionState::done);
  CHECK(table.discarded_tokens() == 0);
  check_positions(cache, table);
}

TEST_CASE("session table: tokens one step behind: deferred ids, late stops discarded and rewound") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2, 3}, 6, {.stop_tokens = {40}}).value();
  const SessionId b = table.add(Tokens{4}, 6, {.temperature = 1.f, .seed = 11}).value();

  // Step 1: both prompts; the sampled tokens stay on the device.
  auto s1 = table.next_step();
  REQUIRE(s1.ok());
  CHECK(s1.value().deferred.empty());
  std::vector<SampleRow> rows;
  table.sample_rows(s1.value(), rows);
  REQUIRE(rows.size() == 2);
  CHECK(rows[0].counter == 0);
  CHECK(rows[1] == make_sample_row({.temperature = 1.f, .seed = 11}, 0));
  REQUIRE(cache.declare_step(s1.value().seqs).ok());
  REQUIRE(table.accept_pending().ok());
  CHECK(table.pending_steps() == 1);
  CHECK(table.pending_samples() == 2);
  CHECK(table.output(a).value().empty());
  CHECK(table.state(a).value() == SessionState::generating);
  CHECK(table.cached_tokens(a).value() == 3);

  // Step 2: both decode their tokens from step 1, which the forward reads on the device.
  auto s2 = table.next_step();
  REQUIRE(s2.ok());
  CHECK(s2.value().tokens == Tokens{kPendingToken, kPendingToken});
  CHECK(s2.value().deferred == std::vector<DeferredToken>{{0, 0}, {1, 1}});
  table.sample_rows(s2.value(), rows);
  CHECK(rows[0].counter == 1);
  CHECK(rows[1].counter == 1);
  REQUIRE(cache.declare_step(s2.value().seqs).ok());
  REQUIRE(table.accept_pending().ok());
  CHECK(table.cached_tokens(a).value() == 4);

  // Step 1 comes back: a sampled its stop token. Its step-2 token is discarded, its sequence rewound.
  CHECK(table.resolve(Tokens{40, 1}) .ok());
  CHECK(to_tokens(table.output(a).value()) == Tokens{40});
  CHECK(to_tokens(table.output(b).value()) == Tokens{1});
  CHECK(table.state(a).value() == SessionState::done);
  CHECK(table.cached_tokens(a).value() == 3);
  CHECK(cache.pos(table.sequence_of(a).value()).value() == 3);
  CHECK(table.rewind_points() == std::vector<RewindPoint>{{0, 3}});
  CHECK(table.discarded_tokens() == 1);

  // Step 3: only b, its token from step 2 deferred again.
  auto s3 = table.next_step();
  REQUIRE(s3.ok());
  CHECK(s3.value().seqs == Tokens{1});
  CHECK(s3.value().deferred == std::vector<DeferredToken>{{0, 1}});
  REQUIRE(cache.declare_step(s3.value().seqs).ok());
  REQUIRE(table.accept_pending().ok());
  CHECK(table.resolve(Tokens{30, 2}).ok());  // step 2: a's entry is skipped
  CHECK(to_tokens(table.output(a).value()) == Tokens{40});
  CHECK(to_tokens(table.output(b).value()) == Tokens{1, 2});
  CHECK(table.resolve(Tokens{3}).ok());
  CHECK(to_tokens(table.output(b).value()) == Tokens{1, 2, 3});
  CHECK(table.pending_steps() == 0);
  check_positions(cache, table);
  CHECK(table.reap() == Ids{a});
}

TEST_CASE("session table: a token on its way from an older step must be resolved before it is fed") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1}, 6).value();
  const SessionId b = table.add(Tokens{2}, 6).value();
  auto step = [&](std::int32_t width) {
    auto s = table.next_step(width);
    REQUIRE(s.ok());
    REQUIRE(cache.declare_step(s.value().seqs).ok());
    REQUIRE(table.accept_pending().ok());
    return s.value();
  };
  step(0);                                    // a and b sample
  const StepBatch only_a = step(1);           // room for a alone
  CHECK(only_a.deferred == std::vector<DeferredToken>{{0, 0}});
  const CellTable before = table;
  CHECK(table.next_step().status() == Errc::bad_argument);  // b's token is from step 1, not step 2
  CHECK(table == before);
  CHECK(table.accept(Tokens{1}) == Errc::bad_argument);  // no open batch; steps on their way
  CHECK(table.resolve(Tokens{1}) == Errc::bad_argument);  // step 1 has two samples
  CHECK(table.resolve(Tokens{1, 2, 3}) == Errc::bad_argument);
  CHECK(table == before);
  REQUIRE(table.resolve(Tokens{10, 20}).ok());
  const auto s3 = table.next_step();
  REQUIRE(s3.ok());
  CHECK(s3.value().tokens == Tokens{kPendingToken, 20});  // a's from step 2, b's known now
  CHECK(s3.value().deferred == std::vector<DeferredToken>{{0, 0}});
  table.abandon();
  CHECK(to_tokens(table.output(b).value()) == Tokens{20});
  check_positions(cache, table);
  (void)a;
}

TEST_CASE("session table: discard_pending drops lost tokens and steps the sessions back") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2}, 6).value();
  run(cache, table, {5});
  for (int i = 0; i < 2; ++i) {
    auto s = table.next_step();
    REQUIRE(s.ok());
    REQUIRE(cache.declare_step(s.value().seqs).ok());
    REQUIRE(table.accept_pending().ok());
  }
  CHECK(table.cached_tokens(a).value() == 4);  // 2 prompt + 5 + the token on its way from step 2
  table.discard_pending();                      // step 2's token is lost, and with it step 3's
  CHECK(table.pending_steps() == 1);
  CHECK(to_tokens(table.output(a).value()) == Tokens{5});
  CHECK(table.cached_tokens(a).value() == 2);
  CHECK(cache.pos(0).value() == 2);
  CHECK(table.resolve(Tokens{9}).ok());  // step 3's entry is gone: skipped
  CHECK(to_tokens(table.output(a).value()) == Tokens{5});
  const Ran r = run(cache, table, {6});  // a feeds 5 again
  CHECK(r.batch.tokens == Tokens{5});
  CHECK(r.positions == Positions{2});
  check_positions(cache, table);
}

namespace {

// next_step, declare_step and accept_pending: the step's tokens stay on their way.
void run_pending(Cells& cache, CellTable& table) {
  auto s = table.next_step();
  REQUIRE(s.ok());
  REQUIRE(cache.declare_step(s.value().seqs).ok());
  REQUIRE(table.accept_pending().ok());
}

}  // namespace

TEST_CASE("session table: a session that loses its first token feeds its last prompt token again") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1, 2, 3}, 4).value();
  run(cache, table, {7});  // a's prompt; it draws 7
  const SessionId c = table.add(Tokens{6, 7, 8, 9}, 4).value();
  run_pending(cache, table);  // step 1: a feeds 7 and samples; c's prompt samples its first token
  run_pending(cache, table);  // step 2: a and c feed step 1's tokens (deferred)
  CHECK(table.cached_tokens(c).value() == 5);
  table.discard_pending();  // step 1 lost: a keeps {7}; c loses its first token and step 2's
  CHECK(table.pending_steps() == 1);
  CHECK(to_tokens(table.output(a).value()) == Tokens{7});
  CHECK(table.output(c).value().empty());
  CHECK(table.state(c).value() == SessionState::feeding);
  CHECK(table.cached_tokens(c).value() == 3);  // the prompt but its last token
  CHECK(table.cached_tokens(a).value() == 3);
  check_positions(cache, table);
  CHECK(table.resolve(Tokens{11, 12}).ok());  // step 2's entries are forgotten: skipped
  CHECK(to_tokens(table.output(a).value()) == Tokens{7});
  CHECK(table.output(c).value().empty());
  const Ran r = run(cache, table, {13, 14});  // a feeds 7 again, c its last prompt token
  CHECK(r.batch.tokens == Tokens{7, 9});
  CHECK(r.positions == Positions{3, 3});
  CHECK(r.batch.deferred.empty());
  CHECK(to_tokens(table.output(a).value()) == Tokens{7, 13});
  CHECK(to_tokens(table.output(c).value()) == Tokens{14});
  check_positions(cache, table);
}

TEST_CASE("session table: a discarded step's later entries never land in the tokens drawn again") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 8, .min_prefill_tokens = 2, .max_tokens_per_session = 32, .vocab = 100});
  const SessionId a = table.add(Tokens{1, 2}, 10).value();
  run(cache, table, {5});
  run_pending(cache, table);  // A: feeds 5, samples output[1]
  run_pending(cache, table);  // B: feeds output[1] (deferred), samples output[2]
  table.discard_pending();    // A lost, and with it B's output[2]
  REQUIRE(to_tokens(table.output(a).value()) == Tokens{5});
  run_pending(cache, table);  // C: feeds 5 again, samples output[1]
  run_pending(cache, table);  // D: feeds output[1] (deferred), samples output[2]
  CHECK(table.pending_steps() == 3);
  REQUIRE(table.resolve(Tokens{77}).ok());  // B: its token belongs to the lost branch
  CHECK(to_tokens(table.output(a).value()) == Tokens{5});
  REQUIRE(table.resolve(Tokens{30}).ok());  // C
  REQUIRE(table.resolve(Tokens{31}).ok());  // D
  CHECK(to_tokens(table.output(a).value()) == Tokens{5, 30, 31});
  CHECK(table.cached_tokens(a).value() == 4);
  check_positions(cache, table);
}

TEST_CASE("session table: log-probs are kept for the sessions that ask") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1}, 3, {.logprobs = true}).value();
  const SessionId b = table.add(Tokens{2}, 3).value();
  const std::vector<float> lp = {-0.5f, -1.5f};
  auto s = table.next_step();
  REQUIRE(s.ok());
  REQUIRE(cache.declare_step(s.value().seqs).ok());
  REQUIRE(table.accept(Tokens{7, 8}, lp).ok());
  CHECK(std::vector<float>(table.logprobs(a).value().begin(), table.logprobs(a).value().end()) == std::vector<float>{-0.5f});
  CHECK(table.logprobs(b).value().empty());
  s = table.next_step();
  REQUIRE(s.ok());
  REQUIRE(cache.declare_step(s.value().seqs).ok());
  CHECK(table.accept(Tokens{7, 8}, std::vector<float>{1.f}) == Errc::bad_argument);  // count differs
  CHECK(table.accept(Tokens{7, -3}) == Errc::bad_argument);
  REQUIRE(table.accept(Tokens{9, 10}).ok());  // no log-probs given: 0
  CHECK(table.logprobs(a).value().size() == 2);
}

// ================================ n samples of a prompt (add_samples) ================================

namespace {

// The cells sequence `seq` holds at positions [0, n), by position.
std::vector<std::int32_t> cells_of(const Cells& cache, std::int32_t seq, std::int32_t n) {
  std::vector<std::int32_t> cells;
  for (std::int32_t p = 0; p < n; ++p) cells.push_back(cache.cell_of(seq, p));
  return cells;
}

// How many live sequences hold `cell`.
std::int32_t owner_count(const Cells& cache, std::int32_t cell) {
  std::int32_t n = 0;
  for (std::int32_t s = 0; s < cache.max_seqs(); ++s) n += cache.cell_owners(cell).test(s) ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("add_samples: the samples wait for the leader's prompt, then share its cells") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 16});
  const SamplingParams sampling{.temperature = 1.f, .top_k = 9, .seed = 40, .stop_tokens = {63}};
  const Ids ids = table.add_samples(iota_tokens(1, 6), 2, sampling, 3).value();
  REQUIRE(ids == Ids{1, 2, 3});
  // Three sequences, empty; the two followers wait for the leader; seeds 40, 41, 42.
  CHECK(cache.live_count() == 3);
  CHECK(cache.free_cells() == 64);
  CHECK(table.free_sequences() == cache.max_seqs() - 3);
  CHECK(table.leader_of(1).value() == 0);
  CHECK(table.leader_of(2).value() == 1);
  CHECK(table.leader_of(3).value() == 1);
  CHECK(table.waiting_count() == 2);
  CHECK(table.feeding_count() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    SamplingParams own = sampling;
    own.seed = 40 + i;
    CHECK(table.sampling(ids[i]).value() == own);
    CHECK(to_tokens(table.prompt(ids[i]).value()) == iota_tokens(1, 6));
    CHECK(table.max_new_tokens(ids[i]).value() == 2);
    CHECK(table.cached_tokens(ids[i]).value() == 0);
  }
  check_positions(cache, table);

  // The leader alone feeds its prompt: 4 tokens, then 2 (its logits give its first token).
  Ran r = run(cache, table, {});
  CHECK(r.batch.tokens == Tokens{1, 2, 3, 4});
  CHECK(r.batch.logit_rows == LogitRows{{3, 1, false}});
  CHECK(table.leader_of(2).value() == 1);  // fed 4 < 5: still waiting
  r = run(cache, table, {50});
  CHECK(r.batch.tokens == Tokens{5, 6});
  CHECK(r.batch.seqs == Tokens{0, 0});
  CHECK(table.waiting_count() == 2);  // they get their cells when the next step is packed
  check_positions(cache, table);

  // The next step gives them the leader's cells of positions 0..4; each feeds prompt token 6 itself.
  r = declare(cache, table);
  const std::int32_t s2 = table.sequence_of(2).value(), s3 = table.sequence_of(3).value();
  CHECK(table.waiting_count() == 0);
  CHECK(table.leader_of(2).value() == 0);
  CHECK(r.batch.tokens == Tokens{50, 6, 6});
  CHECK(r.batch.seqs == Tokens{0, s2, s3});
  CHECK(r.batch.logit_rows == LogitRows{{0, 1, true}, {1, 2, true}, {2, 3, true}});
  CHECK(r.positions == Positions{6, 5, 5});
  const std::vector<std::int32_t> prompt_cells = cells_of(cache, 0, 5);
  CHECK(cells_of(cache, s2, 5) == prompt_cells);
  CHECK(cells_of(cache, s3, 5) == prompt_cells);
  for (const std::int32_t cell : prompt_cells) CHECK(owner_count(cache, cell) == 3);
  // Position 5 (prompt token 6): a cell of each sequence's own.
  const std::int32_t own[] = {cache.cell_of(0, 5), cache.cell_of(s2, 5), cache.cell_of(s3, 5)};
  CHECK(own[0] != own[1]);
  CHECK(own[1] != own[2]);
  CHECK(own[0] != own[2]);
  for (const std::int32_t cell : own) CHECK(owner_count(cache, cell) == 1);
  // 6 prompt tokens and the leader's first token, then one token each: zero copy.
  CHECK(cache.free_cells() == 64 - (6 + 1 + 1 + 1));
  REQUIRE(table.accept(Tokens{51, 60, 70}).ok());
  CHECK(table.state(1).value() == SessionState::done);
  r = run(cache, table, {61, 71});
  CHECK(r.batch.tokens == Tokens{60, 70});
  CHECK(to_tokens(table.output(1).value()) == Tokens{50, 51});
  CHECK(to_tokens(table.output(2).value()) == Tokens{60, 61});
  CHECK(to_tokens(table.output(3).value()) == Tokens{70, 71});
  check_positions(cache, table);
  CHECK(table.reap() == ids);
  CHECK(cache.free_cells() == 64);
  CHECK(cache.live_count() == 0);
}

TEST_CASE("add_samples: a leader whose slices end at prompt.size() - 1 feeds the last token with its samples") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 16});
  const Ids ids = table.add_samples(iota_tokens(1, 5), 1, {}, 3).value();
  run(cache, table, {});  // 4 tokens: prompt.size() - 1
  const Ran r = declare(cache, table);
  const std::int32_t s2 = table.sequence_of(ids[1]).value(), s3 = table.sequence_of(ids[2]).value();
  CHECK(r.batch.tokens == Tokens{5, 5, 5});
  CHECK(r.batch.seqs == Tokens{0, s2, s3});
  CHECK(r.positions == Positions{4, 4, 4});
  CHECK(cells_of(cache, s2, 4) == cells_of(cache, 0, 4));
  CHECK(cells_of(cache, s3, 4) == cells_of(cache, 0, 4));
  CHECK(cache.free_cells() == 64 - (4 + 3));
  REQUIRE(table.accept(Tokens{7, 8, 9}).ok());
  CHECK(table.done_count() == 3);
}

TEST_CASE("add_samples: one sample is add; a one-token prompt gives the samples their sequences at once") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const Ids one = table.add_samples(Tokens{4, 5}, 3, {.temperature = 0.5f, .seed = 9}, 1).value();
  CHECK(one == Ids{1});
  auto other_cache = make_cells();
  CellTable other(other_cache, kLimits);
  REQUIRE(other.add(Tokens{4, 5}, 3, {.temperature = 0.5f, .seed = 9}).ok());
  CHECK(table == other);  // the same table as add makes
  CHECK(cache == other_cache);

  const Ids ids = table.add_samples(Tokens{7}, 2, {}, 3).value();
  CHECK(ids == Ids{2, 3, 4});
  const Ran r = declare(cache, table);  // the leader has fed 0 = prompt.size() - 1 tokens
  CHECK(table.waiting_count() == 0);
  CHECK(r.batch.tokens == Tokens{4, 5, 7, 7, 7});
  CHECK(r.positions == Positions{0, 1, 0, 0, 0});
  REQUIRE(table.accept(Tokens{1, 2, 3, 4}).ok());
  check_positions(cache, table);
}

TEST_CASE("add_samples: a leader is not done while a sample waits for its cells; reap keeps it") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const Ids ids = table.add_samples(Tokens{1, 2}, 1, {}, 2).value();
  run(cache, table, {9});  // the leader feeds its prompt and draws its only token
  CHECK(table.state(ids[0]).value() == SessionState::generating);  // its sample still waits
  CHECK(table.reap().empty());
  const Ran r = declare(cache, table);
  CHECK(table.state(ids[0]).value() == SessionState::done);
  CHECK(r.batch.tokens == Tokens{2});
  CHECK(r.positions == Positions{1});
  CHECK(cache.cell_of(table.sequence_of(ids[1]).value(), 0) == cache.cell_of(0, 0));
  REQUIRE(table.accept(Tokens{8}).ok());
  CHECK(table.reap() == ids);
}

TEST_CASE("add_samples: a waiting sample can be finished; a finished leader hands its samples on") {
  auto cache = make_cells();
  CellTable table(cache, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 16});
  const Ids ids = table.add_samples(iota_tokens(1, 6), 1, {}, 4).value();
  run(cache, table, {});                       // the leader has fed 4 tokens
  REQUIRE(table.finish(ids[3]).ok());          // a waiting sample leaves: its reserved sequence is freed
  CHECK(cache.live_count() == 3);
  REQUIRE(table.finish(ids[0]).ok());          // the leader leaves: the oldest sample leads the last one
  CHECK(cache.live_count() == 2);
  CHECK(table.leader_of(ids[1]).value() == 0);
  CHECK(table.leader_of(ids[2]).value() == ids[1]);
  CHECK(table.waiting_count() == 1);
  const std::int32_t s1 = table.sequence_of(ids[1]).value();
  Ran r = run(cache, table, {});               // the new leader feeds the prompt from its start
  CHECK(r.batch.tokens == Tokens{1, 2, 3, 4});
  CHECK(r.batch.seqs == Tokens(4, s1));
  r = run(cache, table, {30});
  CHECK(r.batch.tokens == Tokens{5, 6});
  r = declare(cache, table);                   // the last sample gets the new leader's cells
  const std::int32_t s2 = table.sequence_of(ids[2]).value();
  CHECK(r.batch.tokens == Tokens{6});
  CHECK(r.batch.seqs == Tokens{s2});
  CHECK(r.positions == Positions{5});
  CHECK(cells_of(cache, s2, 5) == cells_of(cache, s1, 5));
  REQUIRE(table.accept(Tokens{31}).ok());
  CHECK(table.reap() == Ids{ids[1], ids[2]});
  CHECK(cache.free_cells() == 64);
}

TEST_CASE("add_samples: abandon keeps the cells a step gave the samples and rewinds what they fed") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const Ids ids = table.add_samples(Tokens{1, 2, 3}, 2, {}, 2).value();
  run(cache, table, {9});
  const Ran r = declare(cache, table);         // the sample gets its cells and feeds prompt token 3
  const std::int32_t s = table.sequence_of(ids[1]).value();
  CHECK(r.batch.seqs == Tokens{0, s});
  const auto points = table.abandon();
  CHECK(points == std::vector<RewindPoint>{{0, 3}, {s, 2}});
  CHECK(table.leader_of(ids[1]).value() == 0);
  CHECK(cache.pos(s).value() == 2);
  CHECK(cells_of(cache, s, 2) == cells_of(cache, 0, 2));
  check_positions(cache, table);
  const Ran again = run(cache, table, {10, 20});
  CHECK(again.batch == r.batch);
}

TEST_CASE("add_samples: a refused next_step gives no sample its cells") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  const SessionId a = table.add(Tokens{1}, 6).value();
  const SessionId b = table.add(Tokens{2}, 6).value();
  auto step = [&](std::int32_t width) {
    auto s = table.next_step(width);
    REQUIRE(s.ok());
    REQUIRE(cache.declare_step(s.value().seqs).ok());
    REQUIRE(table.accept_pending().ok());
  };
  step(0);  // a and b sample
  step(1);  // room for a alone: b's token is still the one from step 1
  const Ids ids = table.add_samples(Tokens{5}, 2, {}, 2).value();  // could get its cells at once
  const CellTable table_before = table;
  const Cells cache_before = cache;
  CHECK(table.next_step().status() == Errc::bad_argument);
  CHECK(table == table_before);
  CHECK(cache == cache_before);
  CHECK(table.leader_of(ids[1]).value() == ids[0]);
  (void)a;
  (void)b;
}

TEST_CASE("add_samples: on the sequence layout the samples copy the prompt's rows") {
  Slots cache({.max_write = 8, .max_seqs = 4, .max_len = 16});
  SlotTable table(cache, {.max_write = 4, .min_prefill_tokens = 2, .max_tokens_per_session = 16});
  const Ids ids = table.add_samples(iota_tokens(1, 6), 2, {}, 2).value();
  run(cache, table, {});
  run(cache, table, {40});
  cache.acknowledge_changes();
  const Ran r = declare(cache, table);
  const std::int32_t s = table.sequence_of(ids[1]).value();
  REQUIRE(cache.pending_changes().copies.size() == 1);
  CHECK(cache.pending_changes().copies[0] == RowCopy{0, cache.slot_begin(s), 5});
  CHECK(r.batch.seqs == Tokens{0, s});
  CHECK(r.positions == Positions{6, 5});
  REQUIRE(table.accept(Tokens{41, 50}).ok());
  check_positions(cache, table);
}

TEST_CASE("add_samples: refusals change nothing") {
  Cells cache = make_cells(4, 64);
  CellTable table(cache, {.max_write = 8, .min_prefill_tokens = 2, .max_tokens_per_session = 32, .vocab = 50});
  REQUIRE(table.add(Tokens{1, 2}, 3).ok());  // 3 sequences left
  const CellTable table_before = table;
  const Cells cache_before = cache;
  auto refused = [&](SessionStatus got, Errc code, SessionErrc detail) {
    CHECK(got == code);
    CHECK(got == detail);
    CHECK(table == table_before);
    CHECK(cache == cache_before);
  };
  refused(table.add_samples(Tokens{1}, 2, {}, 0).status(), Errc::bad_argument, SessionErrc::bad_sample_count);
  refused(table.add_samples(Tokens{1}, 2, {}, -3).status(), Errc::bad_argument, SessionErrc::bad_sample_count);
  refused(table.add_samples(Tokens{}, 2, {}, 2).status(), Errc::bad_argument, SessionErrc::none);
  refused(table.add_samples(Tokens{1}, -1, {}, 2).status(), Errc::bad_argument, SessionErrc::none);
  refused(table.add_samples(Tokens{1, 50}, 2, {}, 2).status(), Errc::bad_argument, SessionErrc::token_out_of_vocab);
  refused(table.add_samples(Tokens{1}, 2, {.top_p = 2.f}, 2).status(), Errc::bad_argument, SessionErrc::bad_top_p);
  refused(table.add_samples(Tokens{1}, 2, {.stop_tokens = {50}}, 2).status(), Errc::bad_argument,
          SessionErrc::bad_stop_token);
  refused(table.add_samples(iota_tokens(0, 30), 3, {}, 2).status(), Errc::bad_argument, SessionErrc::over_budget);
  refused(table.add_samples(iota_tokens(0, 40), 0, {}, 2).status(), Errc::bad_argument, SessionErrc::over_budget);
  // 64 cells: a prompt of 30 and 35 new tokens would hold 64 + 1 tokens.
  CellTable wide(cache, {.max_write = 8, .min_prefill_tokens = 2, .max_tokens_per_session = 100});
  const CellTable wide_before = wide;
  CHECK(wide.add_samples(iota_tokens(0, 30), 36, {}, 2).status() == SessionErrc::exceeds_cache);
  CHECK(wide == wide_before);
  CHECK(cache == cache_before);
  // More samples than free sequences: refused before any sequence is made.
  refused(table.add_samples(Tokens{1}, 2, {}, 4).status(), Errc::no_free_sequence, SessionErrc::too_many_sessions);
  refused(table.add_samples(Tokens{1}, 2, {}, 400).status(), Errc::no_free_sequence, SessionErrc::too_many_sessions);
  CHECK(table.add_samples(Tokens{1}, 2, {}, 3).value() == Ids{2, 3, 4});
  CHECK(table.free_sequences() == 0);
}

TEST_CASE("add_samples: refused while a batch is in flight") {
  auto cache = make_cells();
  CellTable table(cache, kLimits);
  REQUIRE(table.add(Tokens{1, 2}, 3).ok());
  declare(cache, table);
  const CellTable table_before = table;
  const Cells cache_before = cache;
  CHECK(table.add_samples(Tokens{1}, 2, {}, 2).status() == Errc::bad_argument);
  CHECK(table == table_before);
  CHECK(cache == cache_before);
}
