// The decode work of a window buffer (attention_plan.hpp), against a brute-force count of the tiles
// each decode segment's rows see; which steps the decode kernel runs as whole pairs; and the
// prefill items (64 or 128 rows) against the rows of each segment.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "cellkv/attention_plan.hpp"
#include "cellkv/position_table_view.hpp"
#include "cellkv/visibility.hpp"

using namespace cellkv;

namespace {

// Tiles of `tile` positions holding a position that some row of s sees through `window`, from
// own_begin on: every (query, position) pair tried.
std::int32_t tiles_by_brute_force(const Segment& s, std::int32_t window, std::int32_t tile, std::int32_t own_begin) {
  std::set<std::int32_t> tiles;
  for (std::int32_t q = s.pos0; q < s.pos0 + s.len; ++q)
    for (std::int32_t p = own_begin; p <= q; ++p)
      if (sees(window, q, p)) tiles.insert(p / tile);
  // The kernel streams a contiguous range of tiles: from the first seen to the last.
  return tiles.empty() ? 0 : *tiles.rbegin() - *tiles.begin() + 1;
}

}  // namespace

TEST_CASE("decode work: segments, tile prefix sums and the longest segment, against brute force") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    CAPTURE(trial);
    // Decode items of 16 rows, or of 8 (the fp8 kernel with positions on the MMA's M side).
    const std::int32_t decode_rows = trial % 2 == 0 ? kDecodeRows : kDecodeColumnRows;
    CAPTURE(decode_rows);
    const std::int32_t group = std::vector<std::int32_t>{1, 2, 4, 8}[rng() % 4];
    const std::int32_t tile = std::vector<std::int32_t>{16, 32, 64}[rng() % 3];
    const std::int32_t window = std::vector<std::int32_t>{0, 7, 100, 1000}[rng() % 4];
    std::vector<Segment> segments;
    std::vector<std::int32_t> own_begin;
    const int count = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < count; ++i) {
      const bool long_segment = rng() % 3 == 0;  // drawn first: the order of the two draws is fixed
      const std::int32_t len = 1 + static_cast<std::int32_t>(rng() % (long_segment ? 40 : 4));
      const std::int32_t pos0 = static_cast<std::int32_t>(rng() % 900);
      segments.push_back({i, 0, len, pos0});
      own_begin.push_back(rng() % 4 == 0 ? pos0 / kPagePositions * kPagePositions : 0);
    }
    const auto w = segments.size();
    std::vector<std::int32_t> counts(4, -1), decode_seg(w, -1), decode_prefix(w + 1, -1);
    std::vector<PrefillItem> prefill(static_cast<std::size_t>(max_prefill_items(static_cast<std::int32_t>(40 * w), group)));
    plan_window(segments, own_begin.data(), window, {group, tile, kMinPrefillRows, decode_rows},
                WindowWork{counts.data(), decode_seg.data(), decode_prefix.data(), prefill.data()});
    std::int32_t decode = 0, tiles = 0, longest = 0;
    for (std::size_t i = 0; i < w; ++i) {
      if (segments[i].len * group > decode_rows) continue;
      CHECK(decode_seg[static_cast<std::size_t>(decode)] == static_cast<std::int32_t>(i));
      CHECK(decode_prefix[static_cast<std::size_t>(decode)] == tiles);
      const std::int32_t n = tiles_by_brute_force(segments[i], window, tile, own_begin[i]);
      tiles += n;
      longest = std::max(longest, n);
      ++decode;
    }
    CHECK(counts[0] == decode);
    CHECK(decode_prefix[static_cast<std::size_t>(decode)] == tiles);
    CHECK(counts[2] == longest);
    CHECK(counts[3] == tiles);
  }
}

TEST_CASE("prefill work: items of 64 or 128 rows cover each prefill segment's rows once, heaviest first or by segment") {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 400; ++trial) {
    CAPTURE(trial);
    const std::int32_t rows_per_item = trial % 2 == 0 ? 64 : 128;
    const bool claimed = trial % 5 < 2;  // the order of the kernel whose blocks claim items
    CAPTURE(claimed);
    const std::int32_t decode_rows = trial % 3 == 0 ? kDecodeColumnRows : kDecodeRows;  // segments past it are prefilled
    CAPTURE(decode_rows);
    const std::int32_t group = std::vector<std::int32_t>{1, 2, 4, 7, 8, 64}[rng() % 6];
    const std::int32_t window = std::vector<std::int32_t>{0, 0, 50, 300}[rng() % 4];
    std::vector<Segment> segments;
    std::vector<std::int32_t> own_begin;
    const int count = 1 + static_cast<int>(rng() % 10);
    std::int32_t tokens = 0;
    for (int i = 0; i < count; ++i) {
      const bool long_segment = rng() % 3 == 0;  // drawn first: the order of the draws is fixed
      const std::int32_t len = 1 + static_cast<std::int32_t>(rng() % (long_segment ? 700 : 40));
      const std::int32_t pos0 = static_cast<std::int32_t>(rng() % 900);
      segments.push_back({i, tokens, len, pos0});
      own_begin.push_back(rng() % 3 == 0 ? pos0 / kPagePositions * kPagePositions : 0);
      tokens += len;
    }
    const auto w = segments.size();
    // Exactly the capacity the step block has for `tokens` tokens: the plan must fit it.
    const std::int64_t capacity = max_prefill_items(tokens, group);
    std::vector<std::int32_t> counts(4, -1), decode_seg(w, -1), decode_prefix(w + 1, -1);
    std::vector<PrefillItem> prefill(static_cast<std::size_t>(capacity), PrefillItem{-1, -1});
    AttentionShape shape{group, 16};
    shape.prefill_rows = rows_per_item;
    shape.decode_rows = decode_rows;
    shape.prefill_claimed = claimed;
    plan_window(segments, own_begin.data(), window, shape,
                WindowWork{counts.data(), decode_seg.data(), decode_prefix.data(), prefill.data()});
    // The oracle: per segment of more than decode_rows rows, row0 = (n - 1) x rows, ..., rows, 0
    // for its n = ceil(len x group / rows) items; all of them ordered by the tiles of kPrefillTile
    // positions their rows see (brute force), most first, ties in that order. Claimed: the
    // segments ordered by the tiles of their first item (their last rows), most first, ties in
    // step order; within a segment its items so ordered.
    struct Want {
      PrefillItem item;
      std::int32_t tiles;
      std::int32_t segment_tiles = 0;  // claimed: the tiles of the segment's first item
    };
    std::vector<Want> want;
    for (std::size_t i = 0; i < w; ++i) {
      const std::int32_t rows = segments[i].len * group;
      if (rows <= decode_rows) continue;
      std::int32_t n = 0;
      while (n * rows_per_item < rows) ++n;
      for (std::int32_t m = n - 1; m >= 0; --m) {
        const std::int32_t first = m * rows_per_item / group, last = (std::min(rows, (m + 1) * rows_per_item) - 1) / group;
        const Segment part{segments[i].seq, 0, last - first + 1, segments[i].pos0 + first};
        want.push_back({{static_cast<std::int32_t>(i), m * rows_per_item},
                        tiles_by_brute_force(part, window, kPrefillTile, own_begin[i])});
      }
    }
    for (Want& x : want)
      for (const Want& y : want)
        if (y.item.seg == x.item.seg) {
          x.segment_tiles = y.tiles;  // the first of the segment's items pushed: its last rows
          break;
        }
    std::stable_sort(want.begin(), want.end(), [&](const Want& x, const Want& y) {
      if (claimed && x.item.seg != y.item.seg)
        return x.segment_tiles != y.segment_tiles ? x.segment_tiles > y.segment_tiles : x.item.seg < y.item.seg;
      return x.tiles > y.tiles;
    });
    REQUIRE(counts[1] == static_cast<std::int32_t>(want.size()));
    CHECK(counts[1] <= capacity);
    for (std::size_t k = 0; k < want.size(); ++k) {
      CAPTURE(k);
      CHECK(prefill[k].seg == want[k].item.seg);
      CHECK(prefill[k].row0 == want[k].item.row0);
    }
    // Every row of every prefill segment lies in exactly one item of at most rows_per_item rows.
    for (std::size_t i = 0; i < w; ++i) {
      const std::int32_t rows = segments[i].len * group;
      if (rows <= decode_rows) continue;
      std::vector<int> covered(static_cast<std::size_t>(rows), 0);
      for (std::int32_t k = 0; k < counts[1]; ++k) {
        const PrefillItem& it = prefill[static_cast<std::size_t>(k)];
        if (it.seg != static_cast<std::int32_t>(i)) continue;
        for (std::int32_t r = it.row0; r < std::min(rows, it.row0 + rows_per_item); ++r) ++covered[static_cast<std::size_t>(r)];
      }
      CHECK(std::all_of(covered.begin(), covered.end(), [](int c) { return c == 1; }));
    }
  }
  // By hand: 3 tokens of group 64 (192 rows): 64-row items at 128, 64, 0; 128-row items at 128, 0.
  const std::vector<Segment> one{{0, 0, 3, 10}};
  std::int32_t counts[4] = {}, decode_seg[1] = {}, decode_prefix[2] = {};
  PrefillItem items[6] = {};
  plan_window(one, nullptr, 0, AttentionShape{64, 16, 128}, WindowWork{counts, decode_seg, decode_prefix, items});
  CHECK(counts[1] == 2);
  CHECK((items[0].row0 == 128 && items[1].row0 == 0));
  // The default is the smaller item, which every prefill kernel takes whole.
  plan_window(one, nullptr, 0, AttentionShape{64, 16}, WindowWork{counts, decode_seg, decode_prefix, items});
  CHECK(counts[1] == 3);
  CHECK((items[0].row0 == 128 && items[1].row0 == 64 && items[2].row0 == 0));
  // Fewer rows than kMinPrefillRows would pass the step block's capacity: planned as 64.
  plan_window(one, nullptr, 0, AttentionShape{64, 16, 0}, WindowWork{counts, decode_seg, decode_prefix, items});
  CHECK(counts[1] == 3);
  CHECK((items[0].row0 == 128 && items[1].row0 == 64 && items[2].row0 == 0));
}

TEST_CASE("prefill work: dealt to blocks in rounds, each item to exactly one block, shares about even") {
  std::mt19937 rng(29);
  for (int trial = 0; trial < 300; ++trial) {
    CAPTURE(trial);
    const std::int32_t blocks = 1 + static_cast<std::int32_t>(rng() % 140), items = static_cast<std::int32_t>(rng() % 2000);
    std::vector<int> taken(static_cast<std::size_t>(items), 0);
    for (std::int32_t b = 0; b < blocks; ++b) {
      std::int32_t last = -1;
      for (std::int32_t n = 0;; ++n) {
        const std::int32_t item = dealt_item(n, items, blocks, b);
        if (item < 0) {
          // Once past the items, every later round is too: the kernel's loop may stop.
          for (std::int32_t m = n; m < n + 3; ++m) CHECK(dealt_item(m, items, blocks, b) == -1);
          break;
        }
        REQUIRE(item < items);
        CHECK(item > last);  // a block's items grow round by round
        last = item;
        ++taken[static_cast<std::size_t>(item)];
      }
    }
    CHECK(std::all_of(taken.begin(), taken.end(), [](int t) { return t == 1; }));
  }
  // 8 prompts of 1,024 tokens, group 4, 128-row items, 132 blocks x 8 KV heads (item i: prefill item
  // i / 8): with the plan's order the busiest block reads at most 5% more tiles than the mean
  // (the step order, a segment's last rows first, dealt round robin, gave 26% more).
  std::vector<Segment> segments;
  for (std::int32_t i = 0; i < 8; ++i) segments.push_back({i, 1024 * i, 1024, 0});
  std::int32_t counts[4] = {}, decode_seg[8] = {}, decode_prefix[9] = {};
  std::vector<PrefillItem> plan(static_cast<std::size_t>(max_prefill_items(8192, 4)));
  plan_window(segments, nullptr, 0, AttentionShape{4, 16, 128}, WindowWork{counts, decode_seg, decode_prefix, plan.data()});
  REQUIRE(counts[1] == 256);
  const std::int32_t blocks = 132, heads_kv = 8, items = counts[1] * heads_kv;
  std::int64_t total = 0, busiest = 0;
  for (std::int32_t b = 0; b < blocks; ++b) {
    std::int64_t tiles = 0;
    for (std::int32_t n = 0, item; (item = dealt_item(n, items, blocks, b)) >= 0; ++n) {
      const PrefillItem& it = plan[static_cast<std::size_t>(item / heads_kv)];
      const Segment part{0, 0, 32, it.row0 / 4};  // its 32 tokens (128 rows of 4 heads)
      tiles += tiles_by_brute_force(part, 0, kPrefillTile, 0);
    }
    total += tiles;
    busiest = std::max(busiest, tiles);
  }
  CHECK(static_cast<double>(busiest) <= 1.05 * static_cast<double>(total) / blocks);
}

// Blocks that claim items in the plan's order, each taking the next when it is done (item_claims.cuh),
// with an item's time its tiles: the tiles of the busiest block, the mean, and the heaviest item (no
// order ends sooner than it).
struct ClaimedLoad {
  std::int64_t busiest = 0;
  double mean = 0;
  std::int64_t heaviest = 0;
};
ClaimedLoad claimed_load(const std::vector<Segment>& segments, std::int32_t group, std::int32_t heads_kv, std::int32_t blocks) {
  std::int32_t tokens = 0;
  for (const Segment& s : segments) tokens += s.len;
  std::vector<std::int32_t> counts(4), decode_seg(segments.size()), decode_prefix(segments.size() + 1);
  std::vector<PrefillItem> plan(static_cast<std::size_t>(max_prefill_items(tokens, group)));
  AttentionShape shape{group, 16, 128};
  shape.prefill_claimed = true;
  plan_window(segments, nullptr, 0, shape, WindowWork{counts.data(), decode_seg.data(), decode_prefix.data(), plan.data()});
  // The blocks' busy-until times; the block free first claims the next item.
  std::priority_queue<std::int64_t, std::vector<std::int64_t>, std::greater<>> free_at;
  for (std::int32_t b = 0; b < blocks; ++b) free_at.push(0);
  std::int64_t total = 0, end = 0, heaviest = 0;
  for (std::int32_t i = 0; i < counts[1] * heads_kv; ++i) {
    const PrefillItem& it = plan[static_cast<std::size_t>(i / heads_kv)];
    const std::int64_t tiles = prefill_item_tiles(segments[static_cast<std::size_t>(it.seg)], it, 128, group, 0, 0);
    const std::int64_t done = free_at.top() + tiles;
    free_at.pop();
    free_at.push(done);
    total += tiles;
    end = std::max(end, done);
    heaviest = std::max(heaviest, tiles);
  }
  return {end, static_cast<double>(total) / blocks, heaviest};
}

TEST_CASE("prefill work: claimed by segment, the blocks end about together") {
  // Prompts (length, first position): 8 of 1,024 tokens, 4 of 4,096, one of 8,192, ragged mixes
  // with the longest last in step order, and chunks that continue long sequences (their few items
  // see the most positions: the plan must not leave them for last). Group 4, 8 KV heads, 132 blocks.
  using Prompts = std::vector<std::pair<std::int32_t, std::int32_t>>;
  const auto segments_of = [](const Prompts& prompts) {
    std::vector<Segment> segments;
    std::int32_t tokens = 0;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      segments.push_back({static_cast<std::int32_t>(i), tokens, prompts[i].first, prompts[i].second});
      tokens += prompts[i].first;
    }
    return segments;
  };
  for (const Prompts& prompts : {Prompts(8, {1024, 0}), Prompts(4, {4096, 0}), Prompts{{8192, 0}},
                                 Prompts{{100, 0}, {300, 0}, {60, 0}, {2000, 0}, {8192, 0}},
                                 Prompts{{1024, 0}, {1024, 0}, {1024, 0}, {128, 16000}, {64, 30000}}}) {
    CAPTURE(prompts.size());
    CAPTURE(prompts.back().first);
    const ClaimedLoad load = claimed_load(segments_of(prompts), 4, 8, 132);
    CHECK(static_cast<double>(load.busiest) <= std::max(1.05 * load.mean + 2, static_cast<double>(load.heaviest)));
  }
}

TEST_CASE("decode work: teams for few short pairs, whole pairs for about one per worker, else the even split") {
  // 132 blocks x 8 warps.
  // 16 sequences x 4 KV heads of 6 tiles: one pair per block, 8 warps each (one tile apiece).
  const DecodeAssignment few = decode_assignment(64, 132, 8, 6, 16 * 6, 4);
  CHECK((!few.even && few.team == 8 && few.per_block == 1));
  // 64 x 4 pairs of up to 7 tiles: two pairs per block, teams of 4 (two tiles apiece).
  const DecodeAssignment more = decode_assignment(256, 132, 8, 7, 64 * 6, 4);
  CHECK((!more.even && more.team == 4 && more.per_block == 2));
  // 400 pairs: four per block, teams of 2, up to kTeamTiles tiles a warp.
  CHECK(decode_assignment(400, 132, 8, 4, 100 * 4, 4).team == 2);
  // Longest 5: teams of 2 stream 3 tiles a warp; the even split 2 (chunk), then one level of merges
  // in global memory for the 3 parts of a pair (kMergeLevelTiles): the teams.
  const DecodeAssignment five = decode_assignment(400, 132, 8, 5, 100 * 4, 4);
  CHECK((!five.even && five.team == 2 && five.per_block == 4));
  // 400 pairs, longest 9: teams of 2 would stream 5 tiles a warp, the even split 2, then one level
  // of merges (the 5 parts of the longest pair): 4.
  CHECK(decode_assignment(400, 132, 8, 9, 100 * 4, 4).even);
  // 256 x 4 pairs of 6 tiles: eight pairs per block, one warp each, whole (chunk 6).
  const DecodeAssignment many = decode_assignment(1024, 132, 8, 7, 256 * 6, 4);
  CHECK((!many.even && many.team == 1 && many.per_block == 8));
  CHECK(decode_assignment(1024, 132, 8, 13, 256 * 6, 4).even);  // longest past twice the chunk
  // Long pairs (one 32k-position sequence, 8 KV heads): the even split.
  CHECK(decode_assignment(8, 132, 8, 2048, 2048, 8).even);
  // 12 warps a block (the fp8 decode kernel at D 128): teams need not be powers of two.
  // 16 sequences x 8 KV heads of 129 tiles (4,096 positions of 32): one pair per block, a team of
  // all 12 warps streams 11 tiles a warp, as many as the even split's chunk (11, whose 12 parts a
  // pair then merge in two levels).
  const DecodeAssignment long_pairs = decode_assignment(128, 132, 12, 129, 16 * 129, 8);
  CHECK((!long_pairs.even && long_pairs.team == 12 && long_pairs.per_block == 1));
  // 64 x 8 pairs of 65 tiles: four pairs per block, teams of 3 (22 tiles a warp; even: 22 + merges).
  const DecodeAssignment four = decode_assignment(512, 132, 12, 65, 64 * 65, 8);
  CHECK((!four.even && four.team == 3 && four.per_block == 4));
  // One sequence of 8 KV heads of 65 tiles: teams of 12 stream 6 tiles a warp; the even split
  // streams one, then merges the 65 parts of a pair in three levels (1 + 3 x 2 tiles).
  CHECK(!decode_assignment(8, 132, 12, 65, 65, 8).even);
  // ... of 257 tiles: 22 a warp in teams against 2 + 3 x 2: the even split.
  CHECK(decode_assignment(8, 132, 12, 257, 257, 8).even);
  // More pairs than workers, or none.
  CHECK(decode_assignment(1057, 132, 8, 1, 1057, 1).even);
  CHECK(decode_assignment(0, 132, 8, 0, 0, 8).even);
}

TEST_CASE("decode work: every pair has a team in its block, and the teams fit it") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 2000; ++trial) {
    CAPTURE(trial);
    const std::int32_t blocks = 1 + static_cast<std::int32_t>(rng() % 140), warps = 1 + static_cast<std::int32_t>(rng() % 16);
    const std::int32_t heads_kv = 1 + static_cast<std::int32_t>(rng() % 8);
    const std::uint64_t most = (static_cast<std::uint64_t>(blocks) * warps + 8) / heads_kv + 1;
    const std::int64_t segments = 1 + static_cast<std::int64_t>(rng() % most);
    const std::int64_t pairs = segments * heads_kv;
    const std::int32_t longest = 1 + static_cast<std::int32_t>(rng() % 40);
    const auto head_tiles = static_cast<std::int32_t>(segments * (1 + longest) / 2);
    const DecodeAssignment as = decode_assignment(pairs, blocks, warps, longest, head_tiles, heads_kv);
    if (as.even) continue;
    CHECK(as.team * as.per_block <= warps);                               // the teams fit a block
    CHECK((as.team + 1) * as.per_block > warps);                          // as large as fit
    CHECK(static_cast<std::int64_t>(as.per_block) * blocks >= pairs);     // every pair has a block
    // A team's warp streams no more than a worker of the even split would, merges included (in
    // tiles: chunk + 2 a merge level of 8 parts, brute-forced here), or kTeamTiles.
    const std::int64_t per_head = std::max<std::int64_t>(1, static_cast<std::int64_t>(blocks) * warps / heads_kv);
    const std::int64_t chunk = std::max<std::int64_t>(1, (head_tiles + per_head - 1) / per_head);
    std::int64_t parts = (longest + chunk - 1) / chunk, levels = 0;
    while (parts > 1) parts = (parts + 7) / 8, ++levels;
    if (as.team > 1) CHECK((longest + as.team - 1) / as.team <= std::max<std::int64_t>(kTeamTiles, chunk + 2 * levels));
  }
}

TEST_CASE("decode work: the even split covers every (segment, head, tile) once, all heads in step, one slot a part") {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 400; ++trial) {
    CAPTURE(trial);
    const std::int32_t heads_kv = 1 + static_cast<std::int32_t>(rng() % 16);
    const std::int64_t workers = 1 + static_cast<std::int64_t>(rng() % 200);
    if (workers < heads_kv) continue;  // grids have a worker a head at least (decode_min_blocks)
    const std::int32_t segments = 1 + static_cast<std::int32_t>(rng() % 20);
    std::vector<std::int32_t> prefix{0};  // tiles of the segments before each
    for (std::int32_t d = 0; d < segments; ++d)
      prefix.push_back(prefix.back() + 1 + static_cast<std::int32_t>(rng() % 50));
    const std::int32_t head_tiles = prefix.back();
    // covered[h][x]: how many workers take tile x of head h (flat h * stride + x).
    std::vector<std::vector<int>> covered(static_cast<std::size_t>(heads_kv),
                                          std::vector<int>(static_cast<std::size_t>(head_tiles)));
    std::vector<std::int64_t> first_tile(static_cast<std::size_t>(workers), -1);  // head tile a worker starts at
    std::set<std::int32_t> slots;
    for (std::int64_t w = 0; w < workers; ++w) {
      const EvenPart part = even_split_part(w, workers, heads_kv, head_tiles);
      if (part.begin >= part.end) continue;
      const std::int64_t h = part.begin / part.stride;
      CHECK(h == w % heads_kv);                        // worker i: head i % H_kv
      CHECK((part.end - 1) / part.stride == h);        // no chunk crosses a head
      CHECK(part.begin % part.chunk == 0);             // a part starts on its chunk
      first_tile[static_cast<std::size_t>(w)] = part.begin - h * part.stride;
      for (std::int64_t g = part.begin; g < part.end; ++g) {
        const std::int64_t x = g - h * part.stride;
        REQUIRE(x < head_tiles);
        ++covered[static_cast<std::size_t>(h)][static_cast<std::size_t>(x)];
      }
      // Each pair this part touches: the part is among parts_of(pair), and its slot is its own.
      const auto part_index = static_cast<std::int32_t>(part.begin / part.chunk);
      for (std::int32_t d = 0; d < segments; ++d) {
        const std::int64_t lo = h * part.stride + prefix[static_cast<std::size_t>(d)];
        const std::int64_t hi = h * part.stride + prefix[static_cast<std::size_t>(d) + 1];
        if (hi <= part.begin || lo >= part.end) continue;
        const PartRange parts = parts_of(lo, hi, part.chunk);
        CHECK(part_index >= parts.first);
        CHECK(part_index <= parts.last);
        if (parts.count() > 1) CHECK(slots.insert(part_slot(part_index, lo, part.chunk)).second);
      }
      CHECK(2 * part_index + 1 < 2 * workers);  // the slots there are
    }
    for (const auto& head : covered) CHECK(std::all_of(head.begin(), head.end(), [](int c) { return c == 1; }));
    // In step: the workers of one chunk index start at the same tile of their heads.
    for (std::int64_t w = heads_kv; w < workers; ++w)
      if (first_tile[static_cast<std::size_t>(w)] >= 0 && first_tile[static_cast<std::size_t>(w % heads_kv)] >= 0 &&
          first_tile[static_cast<std::size_t>(w - w % heads_kv)] >= 0)
        CHECK(first_tile[static_cast<std::size_t>(w)] == first_tile[static_cast<std::size_t>(w - w % heads_kv)]);
  }
}

TEST_CASE("decode work: a team's shares cover its pair once, and team_members counts the warps with tiles") {
  for (std::int32_t team = 1; team <= 16; ++team)
    for (std::int32_t tiles = 1; tiles <= 160; ++tiles) {
      CAPTURE(team);
      CAPTURE(tiles);
      std::vector<int> covered(static_cast<std::size_t>(tiles), 0);
      std::int32_t with_tiles = 0;
      for (std::int32_t m = 0; m < team; ++m) {
        const std::int32_t share = team_share(tiles, team);
        const std::int32_t lo = std::min(tiles, m * share), hi = std::min(tiles, (m + 1) * share);
        for (std::int32_t t = lo; t < hi; ++t) ++covered[static_cast<std::size_t>(t)];
        if (hi > lo) {
          CHECK(m == with_tiles);  // the warps with tiles come first
          ++with_tiles;
        }
      }
      CHECK(std::all_of(covered.begin(), covered.end(), [](int c) { return c == 1; }));
      CHECK(team_members(tiles, team) == with_tiles);
    }
}
