// The decode work of a window buffer (attention_plan.hpp), against a brute-force count of the tiles
// each decode segment's rows see; and which steps the decode kernel runs as whole pairs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
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
    const std::int32_t group = std::vector<std::int32_t>{1, 2, 4, 8}[rng() % 4];
    const std::int32_t tile = std::vector<std::int32_t>{16, 32, 64}[rng() % 3];
    const std::int32_t window = std::vector<std::int32_t>{0, 7, 100, 1000}[rng() % 4];
    std::vector<Segment> segments;
    std::vector<std::int32_t> own_begin;
    const int count = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < count; ++i) {
      const std::int32_t len = 1 + static_cast<std::int32_t>(rng() % (rng() % 3 == 0 ? 40 : 4));
      const std::int32_t pos0 = static_cast<std::int32_t>(rng() % 900);
      segments.push_back({i, 0, len, pos0});
      own_begin.push_back(rng() % 4 == 0 ? pos0 / kPagePositions * kPagePositions : 0);
    }
    const auto w = segments.size();
    std::vector<std::int32_t> counts(3, -1), decode_seg(w, -1), decode_prefix(w + 1, -1);
    std::vector<PrefillItem> prefill(static_cast<std::size_t>(max_prefill_items(static_cast<std::int32_t>(40 * w), group)));
    plan_window(segments, own_begin.data(), window, {group, tile},
                WindowWork{counts.data(), decode_seg.data(), decode_prefix.data(), prefill.data()});
    std::int32_t decode = 0, tiles = 0, longest = 0;
    for (std::size_t i = 0; i < w; ++i) {
      if (segments[i].len * group > kDecodeRows) continue;
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
  }
}

TEST_CASE("decode work: whole pairs when every pair has a worker and none is much longer than the even chunk") {
  // 256 sequences x 4 KV heads of 6 tiles over 1,056 workers: chunk 6, every pair whole.
  CHECK(decode_whole_pairs(1024, 1056, 6, 1024 * 6));
  CHECK(decode_whole_pairs(1024, 1056, 12, 1024 * 6));      // twice the chunk
  CHECK_FALSE(decode_whole_pairs(1024, 1056, 13, 1024 * 6));
  CHECK_FALSE(decode_whole_pairs(64, 1056, 6, 64 * 6));       // 16 sequences: chunk 1, keep splitting
  CHECK_FALSE(decode_whole_pairs(1057, 1056, 1, 1057));       // more pairs than workers
  CHECK_FALSE(decode_whole_pairs(8, 1056, 2048, 8 * 2048));   // long pairs: split them
}
