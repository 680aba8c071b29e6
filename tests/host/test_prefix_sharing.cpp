// The sharing planner (sharing_planner.hpp) against brute force on random fork trees: for every
// token of a step, its shared runs and its own range partition the positions it sees, exactly,
// under every window; a run's cells are the same in every member's table; the partial slots of
// (token, run, split) are distinct and inside the token's range; the items cover every (run,
// split, row) once; and a run is found wherever two segments of the step hold the same page
// (unless the capacities forced a drop, which must still leave a complete plan). Where the shape
// offers finishing (finish_own), exactly the decode segments of runs with few own positions are
// finished (all of them unless the slots ran out), each of their tokens with one more slot, and
// plan_window leaves them out of the decode work.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/sharing_planner.hpp"
#include "cellkv/visibility.hpp"

namespace {

using namespace cellkv;
using Cache = CellCache<Windows<0>, placement::lowest_free, 64>;
constexpr std::int32_t kWindows[] = {0, 1, 40, 64, 150, 700};

// The plan's arrays, owned.
struct Plan {
  std::vector<std::int32_t> counts = std::vector<std::int32_t>(4), run_tokens, run_slot, own_begin;
  std::vector<SharedRun> runs;
  std::vector<SharedItem> items;
  std::vector<SlotRange> token_slots;
  std::vector<FinishedToken> finished;
  SharedWork view;
  Plan(std::int32_t max_write, const SharingShape& shape)
      : run_tokens(static_cast<std::size_t>(shape.slots)), run_slot(run_tokens.size()),
        own_begin(static_cast<std::size_t>(max_write)), runs(static_cast<std::size_t>(shape.max_runs)),
        items(run_tokens.size()), token_slots(static_cast<std::size_t>(max_write)),
        finished(static_cast<std::size_t>(max_write)) {
    view = SharedWork{counts.data(),   runs.data(),  run_tokens.data(),  run_slot.data(),
                      items.data(), own_begin.data(), token_slots.data(), finished.data()};
  }
};

// The finished tokens against brute force: which segments qualify (a decode segment of a run with
// at most finish_own own positions; all of them when `complete`), each token listed once with its
// sequence, position and own_begin, one more slot per finished token (the last of its range, used
// by nothing else), and plan_window's decode work without them. Returns per token: 1 if finished.
std::vector<int> check_finished(const StepPlan& step, const SharingShape& shape, const SharedWork& w,
                                std::span<const std::uint8_t> finished_segments, bool complete) {
  std::vector<int> finished(static_cast<std::size_t>(step.tokens), 0);
  for (std::int32_t i = 0; i < w.finished_count(); ++i) {
    const FinishedToken f = w.finished[i];
    REQUIRE(f.token >= 0);
    REQUIRE(f.token < step.tokens);
    CHECK(finished[static_cast<std::size_t>(f.token)]++ == 0);
    CHECK(f.seq == step.seqs[static_cast<std::size_t>(f.token)]);
    CHECK(f.pos == step.positions[static_cast<std::size_t>(f.token)]);
  }
  REQUIRE(finished_segments.size() == step.segments.size());
  const std::int32_t limit = std::min(shape.finish_own, kMaxFinishOwn);
  auto eligible = [&](std::size_t si) {
    const Segment& seg = step.segments[si];
    return limit > 0 && is_decode(seg, shape.group, shape.decode_rows) && w.own_begin[si] > 0 && seg.pos0 + seg.len - w.own_begin[si] <= limit;
  };
  std::int64_t eligible_rows = 0;  // over finish_rows: nothing is finished
  for (std::size_t si = 0; si < step.segments.size(); ++si)
    eligible_rows += eligible(si) ? std::int64_t{step.segments[si].len} * shape.group * shape.heads_kv : 0;
  const bool too_many = eligible_rows > shape.finish_rows;
  for (std::size_t si = 0; si < step.segments.size(); ++si) {
    const Segment& seg = step.segments[si];
    const bool is_finished = finished[static_cast<std::size_t>(seg.tok0)] != 0;
    CAPTURE(si);
    CHECK(is_finished == (finished_segments[si] != 0));
    if (is_finished) CHECK((eligible(si) && !too_many));
    if (complete && eligible(si) && !too_many) CHECK(is_finished);
    for (std::int32_t t = seg.tok0; t < seg.tok0 + seg.len; ++t) CHECK(finished[static_cast<std::size_t>(t)] == (is_finished ? 1 : 0));
    for (std::int32_t i = 0; i < w.finished_count(); ++i)
      if (w.finished[i].token >= seg.tok0 && w.finished[i].token < seg.tok0 + seg.len) CHECK(w.finished[i].own_begin == w.own_begin[si]);
  }
  // The decode work of any window: the decode segments that are not finished, in order.
  std::vector<std::int32_t> counts(4), decode_seg(step.segments.size() + 1), prefix(step.segments.size() + 2);
  std::vector<PrefillItem> prefill(static_cast<std::size_t>(max_prefill_items(static_cast<std::int32_t>(step.segments.size()) * 16, shape.group)));
  plan_window(step.segments, w.own_begin, 0, AttentionShape{shape.group, 16, kMinPrefillRows, shape.decode_rows}, WindowWork{counts.data(), decode_seg.data(), prefix.data(), prefill.data()},
              finished_segments);
  std::vector<std::int32_t> want;
  for (std::size_t si = 0; si < step.segments.size(); ++si)
    if (is_decode(step.segments[si], shape.group, shape.decode_rows) && finished_segments[si] == 0) want.push_back(static_cast<std::int32_t>(si));
  CHECK(std::vector<std::int32_t>(decode_seg.begin(), decode_seg.begin() + counts[0]) == want);
  return finished;
}

// Checks one planned step against brute force; returns the number of runs.
std::int32_t check_plan(const Cache& cache, const SharingShape& shape, const Plan& plan, bool complete,
                        std::span<const std::uint8_t> finished_segments) {
  const StepPlan step = cache.step();
  const PositionTable& table = cache.table();
  const SharedWork& w = plan.view;
  const std::int32_t runs = w.run_count();
  REQUIRE(runs <= shape.max_runs);
  // token -> its runs (run index), from the run lists.
  std::vector<std::vector<std::int32_t>> runs_of(static_cast<std::size_t>(step.tokens));
  std::vector<std::int32_t> slots_of(static_cast<std::size_t>(step.tokens), 0);  // every split of every run
  std::set<std::int32_t> slots_used;
  for (std::int32_t r = 0; r < runs; ++r) {
    const SharedRun& run = w.runs[r];
    REQUIRE(run.begin % kPagePositions == 0);
    REQUIRE(run.end % kPagePositions == 0);
    REQUIRE(run.begin < run.end);
    REQUIRE(run.splits >= 1);
    REQUIRE(run.splits <= (run.end - run.begin) / kSharedTile);
    std::set<std::int32_t> seqs;
    for (std::int32_t i = 0; i < run.tokens; ++i) {
      const std::int32_t t = w.run_tokens[run.token0 + i];
      REQUIRE(t >= 0);
      REQUIRE(t < step.tokens);
      runs_of[static_cast<std::size_t>(t)].push_back(r);
      const std::int32_t seq = step.seqs[static_cast<std::size_t>(t)];
      seqs.insert(seq);
      // Every position of the run lies below the token and holds the same cell as in run.seq.
      CHECK(step.positions[static_cast<std::size_t>(t)] >= run.end);
      std::int32_t differ = 0;
      for (std::int32_t p = run.begin; p < run.end; ++p) differ += table.cell(seq, p) != table.cell(run.seq, p);
      REQUIRE(differ == 0);
      // Its slots (split k: run_slot + k): distinct from every other (token, run, split), all
      // inside the token's range, which the decode and prefill kernels fold whole.
      const SlotRange range = w.token_slots[t];
      const std::int32_t slot0 = w.run_slot[run.token0 + i];
      for (std::int32_t k = 0; k < run.splits; ++k) {
        const std::int32_t slot = slot0 + k;
        CHECK(slot >= range.first);
        CHECK(slot < range.first + range.count);
        CHECK(slot >= 0);
        CHECK(slot < shape.slots);
        CHECK(slots_used.insert(slot).second);
      }
      slots_of[static_cast<std::size_t>(t)] += run.splits;
    }
    CHECK((seqs.size() >= 2 || run.tokens >= 2));  // a run is shared by two segments at least
    // Its splits partition its tiles, inner boundaries on the kernel's tile (split_unit tiles).
    CHECK(run.unit == shape.split_unit);
    std::int32_t next = run.begin / kSharedTile;
    for (std::int32_t k = 0; k < run.splits; ++k) {
      const TileSpan s = split_tiles(run, k);
      CHECK(s.first == next);
      CHECK(s.count >= 1);
      if (k > 0) CHECK(s.first % shape.split_unit == 0);
      next = s.first + s.count;
    }
    CHECK(next == run.end / kSharedTile);
  }
  // Token slot ranges hold exactly the slots of the token's runs, every split, and a finished
  // token's own slot last: nothing else is folded.
  const std::vector<int> finished = check_finished(step, shape, w, finished_segments, complete);
  for (std::int32_t t = 0; t < step.tokens; ++t) {
    const SlotRange range = w.token_slots[t];
    CHECK(range.count == slots_of[static_cast<std::size_t>(t)] + finished[static_cast<std::size_t>(t)]);
    if (finished[static_cast<std::size_t>(t)] != 0) {
      const std::int32_t own = range.first + range.count - 1;
      CHECK(own >= 0);
      CHECK(own < shape.slots);
      CHECK(slots_used.insert(own).second);
    }
  }
  CHECK(static_cast<std::int32_t>(slots_used.size()) <= shape.slots);
  // Items: every (run, split, row block) once; the splits of a (run, row block) consecutive.
  std::set<std::tuple<std::int32_t, std::int32_t, std::int32_t>> items;
  for (std::int32_t i = 0; i < w.item_count(); ++i) {
    const SharedItem it = w.items[i];
    if (it.split > 0) {
      REQUIRE(i > 0);
      CHECK(w.items[i - 1].run == it.run);
      CHECK(w.items[i - 1].row0 == it.row0);
      CHECK(w.items[i - 1].split == it.split - 1);
    }
    REQUIRE(it.run >= 0);
    REQUIRE(it.run < runs);
    CHECK(it.split < w.runs[it.run].splits);
    CHECK(it.row0 % shape.rows == 0);
    CHECK(it.row0 < w.runs[it.run].tokens * shape.group);
    CHECK(items.insert({it.run, it.split, it.row0}).second);
    // Its [lo, hi]: the lowest and highest position of the tokens of its rows, brute force.
    const SharedRun& run = w.runs[it.run];
    std::int32_t lo = INT32_MAX, hi = -1;
    for (std::int32_t r = it.row0; r < std::min(run.tokens * shape.group, it.row0 + shape.rows); ++r) {
      const std::int32_t pos = step.positions[static_cast<std::size_t>(w.run_tokens[run.token0 + r / shape.group])];
      lo = std::min(lo, pos);
      hi = std::max(hi, pos);
    }
    CHECK(it.lo == lo);
    CHECK(it.hi == hi);
  }
  std::size_t want_items = 0;
  for (std::int32_t r = 0; r < runs; ++r)
    want_items += static_cast<std::size_t>(w.runs[r].splits) *
                  static_cast<std::size_t>((w.runs[r].tokens * shape.group + shape.rows - 1) / shape.rows);
  CHECK(items.size() == want_items);
  CHECK(w.item_count() <= shape.slots);
  std::int32_t run_tokens = 0;
  for (std::int32_t r = 0; r < runs; ++r) {
    CHECK(w.runs[r].token0 == run_tokens);  // runs list their tokens in order
    run_tokens += w.runs[r].tokens;
  }
  CHECK(w.run_token_count() == run_tokens);
  // Per token and window: runs + own range partition what the token sees (the visibility rule).
  for (std::size_t si = 0; si < step.segments.size(); ++si) {
    const Segment& seg = step.segments[si];
    CHECK(w.own_begin[si] % kPagePositions == 0);
    CHECK(w.own_begin[si] <= seg.pos0);
    for (std::int32_t t = seg.tok0; t < seg.tok0 + seg.len; ++t) {
      const std::int32_t pos = step.positions[static_cast<std::size_t>(t)];
      for (const std::int32_t window : kWindows) {
        std::vector<int> covered(static_cast<std::size_t>(pos + 1), 0);
        const PositionRange own = own_positions(window, seg.pos0, seg.pos0 + seg.len - 1, w.own_begin[si]);
        for (std::int32_t p = own.begin; p <= pos; ++p)
          if (sees(window, pos, p)) ++covered[static_cast<std::size_t>(p)];
        for (const std::int32_t r : runs_of[static_cast<std::size_t>(t)])
          for (std::int32_t p = w.runs[r].begin; p < w.runs[r].end; ++p)
            if (sees(window, pos, p)) ++covered[static_cast<std::size_t>(p)];
        std::int32_t wrong = 0;  // positions covered twice, or seen but not covered, or covered but unseen
        for (std::int32_t p = 0; p <= pos; ++p) wrong += covered[static_cast<std::size_t>(p)] != (sees(window, pos, p) ? 1 : 0);
        CAPTURE(t);
        CAPTURE(window);
        REQUIRE(wrong == 0);
      }
    }
  }
  // Maximality: segments of two sequences holding the same page below both their queries share a
  // run there.
  if (complete) {
    for (std::size_t a = 0; a < step.segments.size(); ++a)
      for (std::size_t b = a + 1; b < step.segments.size(); ++b) {
        const Segment& sa = step.segments[a];
        const Segment& sb = step.segments[b];
        if (sa.seq == sb.seq) continue;  // one sequence split into segments: nothing is shared between forks
        const std::int32_t pages = std::min(sa.pos0, sb.pos0) / kPagePositions;
        const PositionTableView v = table.view();
        for (std::int32_t k = 0; k < pages; ++k) {
          if (v.page_of(sa.seq, k * kPagePositions) != v.page_of(sb.seq, k * kPagePositions)) break;
          bool together = false;
          for (const std::int32_t r : runs_of[static_cast<std::size_t>(sa.tok0)]) {
            const SharedRun& run = w.runs[r];
            const auto& list = runs_of[static_cast<std::size_t>(sb.tok0)];
            together = together || (std::find(list.begin(), list.end(), r) != list.end() &&
                                     run.begin <= k * kPagePositions && k * kPagePositions < run.end);
          }
          CAPTURE(k);
          CHECK(together);
        }
      }
  }
  return runs;
}

// Fills seq with n tokens in steps of at most max_write.
void fill(Cache& cache, std::int32_t seq, std::int32_t n, std::int32_t max_write) {
  while (n > 0) {
    const std::int32_t chunk = std::min(n, max_write);
    REQUIRE(cache.declare_step(std::vector<std::int32_t>(static_cast<std::size_t>(chunk), seq)).ok());
    n -= chunk;
  }
}

// Random fork trees (depth up to 4, forks at any offset, rewinds below the fork point, sources
// removed while forks live), then a step of decode tokens and prompt chunks of many of them.
void random_trees(std::uint64_t seed, SharingShape shape, bool complete) {
  constexpr std::int32_t kMaxWrite = 128;
  Cache cache({.max_write = kMaxWrite, .max_cells = 60000, .max_seqs = 64});
  std::mt19937_64 rng(seed);
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  SharingPlanner planner;
  Plan plan(kMaxWrite, shape);
  std::map<std::int32_t, std::int32_t> depth;  // live sequence -> fork depth
  std::int32_t total_runs = 0, total_finished = 0;
  for (int round = 0; round < 40; ++round) {
    CAPTURE(seed);
    CAPTURE(round);
    if (depth.empty() || pick(6) == 0) {
      const std::int32_t root = cache.seq_new().value();
      fill(cache, root, 1 + pick(900), kMaxWrite);
      depth[root] = 0;
    }
    for (int verbs = pick(6); verbs-- > 0;) {
      auto it = depth.begin();
      std::advance(it, pick(static_cast<std::int32_t>(depth.size())));
      const std::int32_t s = it->first, pos = cache.pos(s).value();
      const std::int32_t action = pick(10);
      if (action < 6 && it->second < 4 && depth.size() < 60) {
        const std::int32_t at_choices[] = {pos, pos / 64 * 64, pick(pos + 1), std::max(0, pos - pick(100))};
        const std::int32_t at = at_choices[pick(4)];
        const std::int32_t fork = cache.seq_clone(s, at).value();
        depth[fork] = it->second + 1;
        fill(cache, fork, pick(150), kMaxWrite);
      } else if (action < 8) {
        REQUIRE(cache.rewind(s, pick(pos + 1)).ok());
      } else if (depth.size() > 2) {
        REQUIRE(cache.seq_rm(s).ok());  // often the source of live forks
        depth.erase(it);
      }
    }
    // A step: 1 token for most live sequences, a chunk for some, within max_write.
    std::vector<std::int32_t> ids;
    for (const auto& [s, d] : depth) {
      const std::int32_t n = pick(4) == 0 ? 2 + pick(20) : 1;
      if (static_cast<std::int32_t>(ids.size()) + n > kMaxWrite) break;
      ids.insert(ids.end(), static_cast<std::size_t>(n), s);
    }
    if (pick(3) == 0) std::shuffle(ids.begin(), ids.end(), rng);  // interleaved: several segments per sequence
    if (!cache.declare_step(ids).ok()) continue;
    planner.plan(cache.step().segments, cache.table(), shape, plan.view);
    total_runs += check_plan(cache, shape, plan, complete, planner.finished_segments());
    total_finished += plan.view.finished_count();
  }
  CHECK(total_runs > 0);
  if (shape.finish_own > 0) CHECK(total_finished > 0);
}

}  // namespace

TEST_CASE("prefix sharing plan: random fork trees, runs and own ranges partition what every token sees") {
  const SharingShape roomy{.group = 4, .heads_kv = 8, .workers = 264, .max_runs = 128, .slots = 4096};
  for (std::uint64_t seed = 1; seed <= 6; ++seed) random_trees(seed, roomy, true);
}

TEST_CASE("prefix sharing plan: items of 128 rows and splits on 128-position tiles (the wgmma kernel's shape)") {
  const SharingShape wide{.group = 4, .heads_kv = 8, .workers = 132, .max_runs = 128, .slots = 4096, .rows = 128, .split_unit = 2};
  for (std::uint64_t seed = 21; seed <= 26; ++seed) random_trees(seed, wide, true);
}

TEST_CASE("prefix sharing plan: split_tiles partitions any run into non-empty splits on unit boundaries") {
  // Brute force: every tile of the run in exactly one split, splits in order, each non-empty, every
  // inner boundary a multiple of the unit, and no split over ceil(blocks / splits) units.
  for (std::int32_t unit : {1, 2, 4})
    for (std::int32_t first = 0; first < 9; ++first)
      for (std::int32_t tiles = 1; tiles <= 40; ++tiles) {
        const std::int32_t blocks = ((first + tiles) - first / unit * unit + unit - 1) / unit;
        for (std::int32_t splits = 1; splits <= std::min(blocks, kMaxSplits); ++splits) {
          CAPTURE(unit);
          CAPTURE(first);
          CAPTURE(tiles);
          CAPTURE(splits);
          const SharedRun run{0, first * kSharedTile, (first + tiles) * kSharedTile, 0, 1, splits, unit};
          std::vector<int> owner(static_cast<std::size_t>(tiles), -1);
          std::int32_t next = first;
          for (std::int32_t k = 0; k < splits; ++k) {
            const TileSpan s = split_tiles(run, k);
            REQUIRE(s.first == next);
            REQUIRE(s.count >= 1);
            if (k > 0) CHECK(s.first % unit == 0);
            CHECK(s.count <= (blocks + splits - 1) / splits * unit);
            for (std::int32_t t = s.first; t < s.first + s.count; ++t) owner[static_cast<std::size_t>(t - first)] = k;
            next = s.first + s.count;
          }
          CHECK(next == first + tiles);
          CHECK(std::count(owner.begin(), owner.end(), -1) == 0);
        }
      }
}

TEST_CASE("prefix sharing plan: tight capacities drop deep runs and stay complete") {
  const SharingShape tight{.group = 8, .heads_kv = 2, .workers = 1000, .max_runs = 3, .slots = 40};
  for (std::uint64_t seed = 11; seed <= 14; ++seed) random_trees(seed, tight, false);
}

TEST_CASE("prefix sharing plan: 64 forks of one prompt share it in one run, split to fill the grid") {
  Cache cache({.max_write = 128, .max_cells = 20000, .max_seqs = 64});
  const std::int32_t root = cache.seq_new().value();
  fill(cache, root, 4096, 128);
  std::vector<std::int32_t> ids{root};
  for (int i = 1; i < 64; ++i) ids.push_back(cache.seq_clone(root, 4096).value());
  REQUIRE(cache.declare_step(ids).ok());
  const SharingShape shape{.group = 4, .heads_kv = 8, .workers = 264, .max_runs = 128, .slots = 2048};
  SharingPlanner planner;
  Plan plan(128, shape);
  planner.plan(cache.step().segments, cache.table(), shape, plan.view);
  REQUIRE(check_plan(cache, shape, plan, true, planner.finished_segments()) == 1);
  const SharedRun run = plan.view.runs[0];
  CHECK(run.begin == 0);
  CHECK(run.end == 4096);
  CHECK(run.tokens == 64);
  // 256 rows = 4 blocks x 8 KV heads = 32 items per split; 264 workers take 8 splits in one wave.
  CHECK(run.splits == 8);
  for (std::int32_t s = 0; s < 64; ++s) CHECK(plan.view.own_begin[s] == 4096);
  // The wgmma kernel's shape: 256 rows = 2 items of 128 x 8 KV heads = 16 per split; one block per
  // SM of 132 takes 8 splits, each 4 wide tiles.
  const SharingShape wide{.group = 4, .heads_kv = 8, .workers = 132, .max_runs = 128, .slots = 2048, .rows = 128, .split_unit = 2};
  Plan wide_plan(128, wide);
  planner.plan(cache.step().segments, cache.table(), wide, wide_plan.view);
  REQUIRE(check_plan(cache, wide, wide_plan, true, planner.finished_segments()) == 1);
  CHECK(wide_plan.view.runs[0].splits == 8);
  CHECK(wide_plan.view.item_count() == 16);
  for (std::int32_t k = 0; k < 8; ++k) CHECK(split_tiles(wide_plan.view.runs[0], k).count == 8);
  CHECK(wide_plan.view.finished_count() == 0);  // this shape does not finish
  // With finishing (the wgmma kernel's offer): every fork's one token is finished, with the 8
  // splits' slots and its own.
  SharingShape finishing = wide;
  finishing.finish_own = kMaxFinishOwn;
  finishing.finish_rows = 132 * 16;
  Plan finish_plan(128, finishing);
  planner.plan(cache.step().segments, cache.table(), finishing, finish_plan.view);
  REQUIRE(check_plan(cache, finishing, finish_plan, true, planner.finished_segments()) == 1);
  CHECK(finish_plan.view.finished_count() == 64);
  for (std::int32_t t = 0; t < 64; ++t) CHECK(finish_plan.view.token_slots[t].count == 9);
  // One row fewer than the 64 forks' 2,048: none is finished.
  finishing.finish_rows = 64 * 32 - 1;
  planner.plan(cache.step().segments, cache.table(), finishing, finish_plan.view);
  REQUIRE(check_plan(cache, finishing, finish_plan, true, planner.finished_segments()) == 1);
  CHECK(finish_plan.view.finished_count() == 0);
  // Slots for the 8 splits but not for the own slots too: fewer splits make room (7 x 64 + 64).
  finishing.finish_rows = 132 * 16;
  finishing.slots = 8 * 64 + 63;
  Plan small_plan(128, finishing);
  planner.plan(cache.step().segments, cache.table(), finishing, small_plan.view);
  REQUIRE(check_plan(cache, finishing, small_plan, true, planner.finished_segments()) == 1);
  CHECK(small_plan.view.runs[0].splits == 7);
  CHECK(small_plan.view.finished_count() == 64);
}

TEST_CASE("prefix sharing plan: finished tokens on random fork trees, roomy and tight") {
  SharingShape finishing{.group = 4, .heads_kv = 8, .workers = 132, .max_runs = 128, .slots = 4096, .rows = 128, .split_unit = 2};
  finishing.finish_own = kMaxFinishOwn;
  finishing.finish_rows = 132 * 16;
  for (std::uint64_t seed = 31; seed <= 36; ++seed) random_trees(seed, finishing, true);
  finishing.finish_own = 5;  // a bound below the limit
  for (std::uint64_t seed = 37; seed <= 39; ++seed) random_trees(seed, finishing, true);
  finishing.decode_rows = kDecodeColumnRows;  // decode items of 8 rows: 3- and 4-token forks are prefilled
  for (std::uint64_t seed = 45; seed <= 47; ++seed) random_trees(seed, finishing, true);
  SharingShape tight{.group = 8, .heads_kv = 2, .workers = 1000, .max_runs = 3, .slots = 40};
  tight.finish_own = kMaxFinishOwn;
  tight.finish_rows = 1000 * 16;
  for (std::uint64_t seed = 41; seed <= 44; ++seed) random_trees(seed, tight, false);
}

TEST_CASE("prefix sharing plan: a step without forks plans nothing") {
  Cache cache({.max_write = 16, .max_cells = 4000, .max_seqs = 8});
  std::vector<std::int32_t> ids;
  for (int i = 0; i < 8; ++i) {
    ids.push_back(cache.seq_new().value());
    fill(cache, ids.back(), 200 + 37 * i, 16);
  }
  REQUIRE(cache.declare_step(ids).ok());
  const SharingShape shape{.group = 4, .heads_kv = 8, .workers = 264, .max_runs = 16, .slots = 256};
  SharingPlanner planner;
  Plan plan(16, shape);
  planner.plan(cache.step().segments, cache.table(), shape, plan.view);
  CHECK(check_plan(cache, shape, plan, true, planner.finished_segments()) == 0);
  CHECK(plan.view.item_count() == 0);
  for (std::int32_t t = 0; t < 8; ++t) CHECK(plan.view.token_slots[t].count == 0);
}
