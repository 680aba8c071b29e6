// plan_digest: caches that replay the same verbs agree at every step, whatever their layout and
// with window storage; the digest equals an independent one (the plan's fields written out as
// little-endian bytes by hand, then FNV-1a over the bytes); any difference in the step or in a
// pool's pending changes changes it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/plan_digest.hpp"

namespace {

using namespace cellkv;
using Model = Windows<0, 16, 0, 40>;

// The oracle: the plan written out field by field as bytes, then FNV-1a 64 over them.
struct ByteLog {
  std::vector<std::uint8_t> bytes;
  template <class I>
  void put(I v) {
    const auto u = static_cast<std::uint64_t>(v);
    for (std::size_t i = 0; i < sizeof(I); ++i) bytes.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
  }
  template <class I>
  void put_all(std::span<const I> values) {
    put(static_cast<std::uint64_t>(values.size()));
    for (const I v : values) put(v);
  }
  [[nodiscard]] std::uint64_t fnv1a() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (const std::uint8_t b : bytes) h = (h ^ b) * 0x100000001b3ull;
    return h;
  }
};

void log_changes(ByteLog& log, const PendingChanges& c) {
  log.put(static_cast<std::uint64_t>(c.copies.size()));
  for (const RowCopy& r : c.copies) log.put(r.src_row), log.put(r.dst_row), log.put(r.rows);
  log.put(static_cast<std::uint64_t>(c.table.indices.size()));
  for (const std::int32_t i : c.table.indices) log.put(i), log.put(c.table.values[static_cast<std::size_t>(i)]);
  log.put(static_cast<std::uint64_t>(c.rotations.size()));
  for (const RowRotation& r : c.rotations) log.put(r.cell), log.put(r.old_pos), log.put(r.new_pos);
}

template <class Cache>
std::uint64_t oracle_digest(const Cache& cache) {
  ByteLog log;
  log.put(static_cast<std::uint8_t>(cache.step_placed()));
  if (cache.step_placed()) {
    const StepPlan p = cache.step();
    log.put(p.tokens);
    log.put_all(p.rows);
    log.put_all(p.seqs);
    log.put_all(p.positions);
    log.put(static_cast<std::uint64_t>(p.segments.size()));
    for (const Segment& s : p.segments) log.put(s.seq), log.put(s.tok0), log.put(s.len), log.put(s.pos0);
    log.put(p.read_len);
    log.put_all(p.window_rows);
    log.put_all(p.window_read_len);
  }
  log_changes(log, cache.pending_changes());
  if constexpr (requires { cache.pool(0); }) {
    if (cache.window_storage())
      for (const std::int32_t w : Model::kWindowed) log_changes(log, cache.pool(w).pending_changes());
  }
  return log.fnv1a();
}

// Random verbs applied to every cache of `caches` alike (forks, steps, shifts, removals,
// acknowledgements); after each, `check(caches)`.
template <class Cache, class Check>
void replay(std::uint64_t seed, std::vector<Cache>& caches, int ops, Check&& check) {
  std::mt19937_64 rng(seed);
  auto below = [&](int n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  std::vector<std::int32_t> live;
  for (int op = 0; op < ops; ++op) {
    const int kind = below(10);
    if (kind == 0 || live.empty()) {
      std::int32_t got = -1;
      for (Cache& c : caches) got = c.seq_new().value_or(-1);
      if (got >= 0) live.push_back(got);
    } else if (kind == 1 && live.size() < 6) {
      const std::int32_t src = live[static_cast<std::size_t>(below(static_cast<int>(live.size())))];
      std::int32_t got = -1;
      for (Cache& c : caches) got = c.seq_clone(src).value_or(-1);
      if (got >= 0) live.push_back(got);
    } else if (kind == 2 && live.size() > 1) {
      const std::size_t at = static_cast<std::size_t>(below(static_cast<int>(live.size())));
      for (Cache& c : caches) (void)c.seq_rm(live[at]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(at));
    } else if (kind == 3) {
      const std::int32_t id = live[static_cast<std::size_t>(below(static_cast<int>(live.size())))];
      const std::int32_t delta = -1 - below(3);
      for (Cache& c : caches) (void)c.seq_add(id, 0, -1, delta);
    } else if (kind == 4) {
      for (Cache& c : caches) c.acknowledge_changes();
    } else {
      std::vector<std::int32_t> ids;
      const int n = 1 + below(6);
      for (int t = 0; t < n; ++t) ids.push_back(live[static_cast<std::size_t>(below(static_cast<int>(live.size())))]);
      std::sort(ids.begin(), ids.end());  // a sequence's tokens adjacent
      for (Cache& c : caches) (void)c.declare_step(ids);
    }
    check(caches);
  }
}

template <class Cache>
void agree_and_match_oracle(const CacheConfig& config, std::uint64_t seed) {
  std::vector<Cache> caches(2, Cache(config));
  int checks = 0, placed = 0, changed = 0;  // how much of the plan the run exercised
  replay(seed, caches, 400, [&](const std::vector<Cache>& c) {
    REQUIRE(c[0] == c[1]);  // the replay keeps them equal (the test's own precondition)
    CHECK(plan_digest(c[0]) == plan_digest(c[1]));
    CHECK(plan_digest(c[0]) == oracle_digest(c[0]));
    const PendingChanges pending = c[0].pending_changes();
    placed += c[0].step_placed() ? 1 : 0;
    changed += pending.copies.empty() && pending.rotations.empty() ? 0 : 1;
    ++checks;
  });
  CHECK(checks == 400);
  CHECK(placed > 50);
  CHECK(changed > 10);  // fork copies (sequence layout), copies on write and rotations (cell layout)
}

}  // namespace

TEST_CASE("plan digest: caches replaying the same verbs agree at every step, and equal the byte-wise FNV-1a oracle") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    agree_and_match_oracle<CellCache<Model>>({.max_write = 8, .max_cells = 600, .max_seqs = 8}, seed);
    agree_and_match_oracle<CellCache<Model, placement::clustered<16>>>({.max_write = 8, .max_cells = 600, .max_seqs = 8}, seed);
    agree_and_match_oracle<CellCache<Model>>({.max_write = 8, .max_cells = 600, .max_seqs = 8, .window_cells = 200}, seed);
    agree_and_match_oracle<SequenceCache<Model>>({.max_write = 8, .max_seqs = 8, .max_len = 120}, seed);
  }
}

TEST_CASE("plan digest: a different step, a different pending change, or an acknowledgement changes it") {
  using Cache = CellCache<Model>;
  Cache a({.max_write = 8, .max_cells = 256, .max_seqs = 4});
  const std::int32_t s = a.seq_new().value();
  const std::uint64_t empty = plan_digest(a);
  const std::int32_t three[] = {s, s, s};
  REQUIRE(a.declare_step(three).ok());
  const std::uint64_t placed = plan_digest(a);
  CHECK(placed != empty);
  a.acknowledge_changes();
  const std::uint64_t acknowledged = plan_digest(a);
  CHECK(acknowledged != placed);  // the table writes of the step's page are gone from it

  Cache b = a, c = a;
  const std::int32_t one[] = {s};
  const std::int32_t two[] = {s, s};
  REQUIRE(b.declare_step(one).ok());
  REQUIRE(c.declare_step(two).ok());
  CHECK(plan_digest(b) != plan_digest(c));  // steps of 1 and 2 tokens

  Cache d = a, e = a;
  REQUIRE(d.seq_add(s, 0, -1, -1).ok());
  REQUIRE(e.seq_add(s, 0, -1, -2).ok());
  CHECK(plan_digest(d) != plan_digest(e));  // the same cells, other positions: other rotations and table values
  CHECK(plan_digest(d) == oracle_digest(d));
}
