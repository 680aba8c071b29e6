// cellkv/attention_plan.hpp - the attention work of a placed step, planned on the host from its
// segments and read by the table-driven kernels (include/cellkv/gpu/kernels/).
//
// What a segment's query rows see is a range of positions of its own sequence (visibility.hpp), so
// the work of a segment is a range of KV tiles: tile i holds positions [i * tile, (i + 1) * tile),
// and the position table turns each position into its cell. Nothing here depends on where cells
// are: placement only changes which rows the kernels gather.
//
// Per window buffer, the plan holds:
//   decode   the segments whose rows (len x group) fit one decode item (<= AttentionShape::
//            decode_rows: kDecodeRows, or kDecodeColumnRows for the fp8 kernel that puts positions
//            on the MMA's M side; longer segments are prefilled), in step order, with the prefix
//            sums of their tile counts. The decode kernel splits each KV head's sequence of
//            (segment, tile) evenly over that head's share of its workers (even_split_part),
//            every head the same way, so any mix of lengths keeps every worker equally busy and
//            all heads read the same cells at once; a (segment, head) cut by a chunk boundary is
//            finished by merging the parts' partial softmax (part_slot, parts_of).
//            Steps of no more pairs than workers run as teams instead where that costs no more
//            (decode_assignment): the warps of a block share out its pairs, each pair's tiles
//            split among a team merged in shared memory (a team of one: the pair whole).
//   prefill  one item per AttentionShape::prefill_rows query rows of every other segment: the rows
//            one block of the prefill kernel that runs takes at once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "cellkv/host_device.hpp"
#include "cellkv/step_plan.hpp"
#include "cellkv/visibility.hpp"

namespace cellkv {

inline constexpr std::int32_t kDecodeRows = 16;   // query rows (token x head) of a decode item, at most
// Query rows of a decode item of the fp8 decode kernel at D = 128 whose MMAs take a pair's query rows
// as their N = 8 columns (kernels/fp8_columns.cuh): the kernel that runs for fp8 pools at D = 128 when
// H_q / H_kv <= 8.
inline constexpr std::int32_t kDecodeColumnRows = 8;
// Query rows of a prefill item (AttentionShape::prefill_rows), the rows one block of the prefill
// kernel that runs takes at once: kPrefillRows for the Hopper kernel (two warpgroups of 64 rows
// share each K/V tile), kMinPrefillRows for the mma.sync kernel (one pass of its block). The step
// block's capacity (max_prefill_items) covers items of kMinPrefillRows.
inline constexpr std::int32_t kPrefillRows = 128;
inline constexpr std::int32_t kMinPrefillRows = 64;
// Positions per tile of the position table's pages as the prefill kernels read them: the KV tile of
// the mma.sync prefill and shared-prefix kernels; the Hopper kernel reads two at a time.
inline constexpr std::int32_t kPrefillTile = 64;
inline constexpr std::int32_t kMinDecodeChunk = 1;  // a decode worker takes at least this many tiles

// Positions per KV tile of the decode kernel for a head dim and the bytes of a stored element:
// CELLKV_DECODE_TILE_BYTES (4 KB) of K (and of V) per tile for bf16 / fp16 (32, 16 and 16
// positions for D = 64, 128 and 256), CELLKV_DECODE_FP8_TILE_BYTES for fp8 codes (1 byte); at
// least 16 and at most 64 positions, so each divides kPagePositions.
#ifndef CELLKV_DECODE_TILE_BYTES
#define CELLKV_DECODE_TILE_BYTES 4096
#endif
#ifndef CELLKV_DECODE_FP8_TILE_BYTES
#define CELLKV_DECODE_FP8_TILE_BYTES 4096
#endif
constexpr std::int32_t decode_tile_positions(std::int32_t head_dim, std::int32_t element_bytes = 2) noexcept {
  const std::int32_t bytes = element_bytes == 1 ? CELLKV_DECODE_FP8_TILE_BYTES : CELLKV_DECODE_TILE_BYTES;
  const std::int32_t n = bytes / (element_bytes * head_dim);
  return n < 16 ? 16 : n > 64 ? 64 : n;
}

struct TileSpan {
  std::int32_t first = 0;
  std::int32_t count = 0;
};

// Positions a segment's queries at [first_q, last_q] read themselves through `window`: what they
// see, less the shared prefix [0, own_begin) that shared items read for them (prefix_sharing.hpp).
CELLKV_HOST_DEVICE constexpr PositionRange own_positions(std::int32_t window, std::int32_t first_q, std::int32_t last_q,
                                                         std::int32_t own_begin = 0) noexcept {
  const std::int32_t lo = visible_begin(window, first_q);
  return {lo > own_begin ? lo : own_begin, last_q};
}

// KV tiles [first, first + count) of `tile` positions that queries at positions [first_q, last_q]
// read through `window`, from position own_begin on (a multiple of kPagePositions, so no tile is
// cut by it).
CELLKV_HOST_DEVICE constexpr TileSpan tiles_seen(std::int32_t window, std::int32_t first_q, std::int32_t last_q,
                                                 std::int32_t tile, std::int32_t own_begin = 0) noexcept {
  const std::int32_t lo = own_positions(window, first_q, last_q, own_begin).begin / tile;
  return {lo, last_q / tile - lo + 1};
}

// The kernels' geometry the plan depends on.
struct AttentionShape {
  std::int32_t group = 1;        // H_q / H_kv
  std::int32_t decode_tile = 0;  // positions per KV tile of the decode kernel (divides kPagePositions)
  // Query rows of a prefill item (>= kMinPrefillRows); by default the smaller item, which every
  // prefill kernel takes whole (the Hopper kernel would write rows of overlapping items twice).
  std::int32_t prefill_rows = kMinPrefillRows;
  std::int32_t decode_rows = kDecodeRows;  // query rows of a decode item (kDecodeRows or kDecodeColumnRows)
  // The prefill kernel's blocks claim items one at a time from a device counter (prefill_wgmma)
  // rather than being dealt them in rounds: plan_window then groups the items by segment.
  bool prefill_claimed = false;
};

// Query rows [row0, row0 + rows) of one segment; row r is token r / group, head r % group.
struct PrefillItem {
  std::int32_t seg = 0;
  std::int32_t row0 = 0;
};

// One window's work, in fixed-capacity arrays (device or staging memory).
inline constexpr std::int32_t kWindowCounts = 4;  // WindowWork::counts
struct WindowWork {
  // [kWindowCounts]: decode segments, prefill items, tiles of the longest decode segment, tiles of
  // all decode segments (a KV head's: decode_prefix[decode segments], here too so the kernel need
  // not wait for it)
  std::int32_t* counts = nullptr;
  std::int32_t* decode_seg = nullptr;     // [max_write] segment index of each decode segment
  std::int32_t* decode_prefix = nullptr;  // [max_write + 1] tiles of the decode segments before each
  PrefillItem* prefill = nullptr;         // [max_prefill_items]

  CELLKV_HOST_DEVICE std::int32_t decode_count() const noexcept { return counts[0]; }
  CELLKV_HOST_DEVICE std::int32_t prefill_count() const noexcept { return counts[1]; }
  CELLKV_HOST_DEVICE std::int32_t longest_decode_pair() const noexcept { return counts[2]; }
  CELLKV_HOST_DEVICE std::int32_t decode_head_tiles() const noexcept { return counts[3]; }
};

// Whether a segment is decoded (its rows fit one decode item of decode_rows rows) rather than
// prefilled.
CELLKV_HOST_DEVICE constexpr bool is_decode(const Segment& s, std::int32_t group,
                                            std::int32_t decode_rows = kDecodeRows) noexcept {
  return static_cast<std::int64_t>(s.len) * group <= decode_rows;
}

// Positions [0, settled_end(s)) of segment s's sequence hold rows that were written before the
// step: a step writes one fresh row per token, and the tokens of s's sequence that come before s in
// the step (s.tok0 of them at most) sit at the consecutive positions just below s.pos0. So the
// decode kernel may copy those rows before its wait for the kernels before it (docs/design.md
// section 6), while the step's write_kv may still be writing the others.
CELLKV_HOST_DEVICE constexpr std::int32_t settled_end(const Segment& s) noexcept { return s.pos0 - s.tok0; }

// Prefill items a step of max_write tokens can need with items of kMinPrefillRows rows or more:
// ceil(len x group / prefill_rows) <= len x group / kMinPrefillRows + 1 per segment, at most
// max_write segments. In int64: a step block refuses a count past int32 (step_block.hpp).
constexpr std::int64_t max_prefill_items(std::int32_t max_write, std::int32_t group) noexcept {
  return (static_cast<std::int64_t>(max_write) * group) / kMinPrefillRows + max_write;
}

// Tiles of kPrefillTile positions prefill item `it` of segment `s` reads (its cost): what its rows
// see through `window` from own_begin on, rows_per_item rows of kv group `group` at most.
CELLKV_HOST_DEVICE constexpr std::int32_t prefill_item_tiles(const Segment& s, const PrefillItem& it, std::int32_t rows_per_item,
                                                             std::int32_t group, std::int32_t window,
                                                             std::int32_t own_begin) noexcept {
  const std::int32_t rows = s.len * group, end = it.row0 + rows_per_item < rows ? it.row0 + rows_per_item : rows;
  return tiles_seen(window, s.pos0 + it.row0 / group, s.pos0 + (end - 1) / group, kPrefillTile, own_begin).count;
}

// Plans one window's work from the step's segments: prefill items of shape.prefill_rows rows (a
// smaller value than kMinPrefillRows plans items of kMinPrefillRows, so they fit max_prefill_items),
// ordered for the prefill kernel that runs:
//   dealt    (kernels that deal items in rounds, dealt_item) heaviest first (prefill_item_tiles;
//            ties in step order, a segment's last rows first), so every block gets about the same
//            work whatever the mix of lengths;
//   claimed  (shape.prefill_claimed: blocks claim items from a counter, so the blocks end within
//            about one item of each other in any order) by segment, the segments heaviest first
//            (by their last item: the rows that see the most), each segment's items heaviest first
//            (ties in step order): the blocks running at any moment read the K/V of few segments,
//            which then stay in L2 for all of their items, and the last items are the lightest of
//            the lightest segment.
// own_begin: per segment, the first position it reads itself (nullptr: 0 for every segment).
// finished: per segment, nonzero when the shared-prefix kernel finishes it (prefix_sharing.hpp;
// empty: none): such a segment is no decode work here.
inline void plan_window(std::span<const Segment> segments, const std::int32_t* own_begin, std::int32_t window,
                        const AttentionShape& shape, const WindowWork& out,
                        std::span<const std::uint8_t> finished = {}) {
  std::int32_t decode = 0, prefill = 0, tiles = 0, longest = 0;
  const std::int32_t per_item = std::max(shape.prefill_rows, kMinPrefillRows);
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (i < finished.size() && finished[i] != 0) continue;
    if (is_decode(s, shape.group, shape.decode_rows)) {
      out.decode_seg[decode] = static_cast<std::int32_t>(i);
      out.decode_prefix[decode++] = tiles;
      const std::int32_t n = tiles_seen(window, s.pos0, s.pos0 + s.len - 1, shape.decode_tile, own_begin ? own_begin[i] : 0).count;
      tiles += n;
      longest = n > longest ? n : longest;
    } else {
      const std::int32_t rows = s.len * shape.group;
      const std::int32_t items = (rows + per_item - 1) / per_item;
      for (std::int32_t m = items; m-- > 0;) out.prefill[prefill++] = PrefillItem{static_cast<std::int32_t>(i), m * per_item};
    }
  }
  auto cost = [&](const PrefillItem& it) {
    return prefill_item_tiles(segments[static_cast<std::size_t>(it.seg)], it, per_item, shape.group, window,
                              own_begin ? own_begin[it.seg] : 0);
  };
  // Items of a segment were pushed last rows first: the segment's first item is its last rows.
  auto segment_cost = [&](std::int32_t seg) {
    const std::int32_t rows = segments[static_cast<std::size_t>(seg)].len * shape.group;
    return cost(PrefillItem{seg, (rows - 1) / per_item * per_item});
  };
  std::sort(out.prefill, out.prefill + prefill, [&](const PrefillItem& x, const PrefillItem& y) {
    if (shape.prefill_claimed && x.seg != y.seg) {
      const std::int32_t sx = segment_cost(x.seg), sy = segment_cost(y.seg);
      return sx != sy ? sx > sy : x.seg < y.seg;
    }
    const std::int32_t cx = cost(x), cy = cost(y);
    return cx != cy ? cx > cy : x.seg != y.seg ? x.seg < y.seg : x.row0 > y.row0;
  });
  out.decode_prefix[decode] = tiles;
  out.counts[0] = decode;
  out.counts[1] = prefill;
  out.counts[2] = longest;
  out.counts[3] = tiles;
}

// The item block `block` of `blocks` takes in its round n of `items` (-1: none left): items are
// dealt in rounds of `blocks`, forward in even rounds and backward in odd ones. Prefill items come
// heaviest first (plan_window), so the blocks' shares of the work come out about even. A block's
// items grow with n, so the first past `items` ends its loop.
CELLKV_HOST_DEVICE constexpr std::int32_t dealt_item(std::int32_t n, std::int32_t items, std::int32_t blocks,
                                                     std::int32_t block) noexcept {
  const std::int64_t item = static_cast<std::int64_t>(n) * blocks + ((n & 1) ? blocks - 1 - block : block);
  return item < items ? static_cast<std::int32_t>(item) : -1;
}

// ---- the decode split (host and device agree on it; tests check it on the host) ----
//
// The decode work of a window is, for each KV head, the same sequence of tiles: those of every
// decode segment d in step order, tiles(d) from tile prefix[d] on (L = prefix[n] a head). Tile x of
// head h sits at flat index h * stride + x; pair (d, h) covers [h stride + prefix[d],
// h stride + prefix[d + 1]). The even split gives each head head_workers = workers / H_kv workers
// (decode_head_workers) and cuts its L tiles into equal chunks (stride = head_workers x chunk, so
// no chunk crosses a head): part w = h head_workers + c takes flat tiles [w chunk, (w + 1) chunk),
// head h's tiles [c chunk, (c + 1) chunk). Worker (warp) i takes head i % H_kv and chunk i / H_kv,
// so at any moment every head's workers read the same cells: each cell's row (all heads of K and
// of V) and its scales are read from DRAM together, not head by head at other times.

// Tiles per worker for `total` tiles over `workers` workers.
CELLKV_HOST_DEVICE constexpr std::int64_t decode_chunk(std::int64_t total, std::int32_t workers) noexcept {
  const std::int64_t even = (total + workers - 1) / workers;
  return even > kMinDecodeChunk ? even : kMinDecodeChunk;
}
// Workers of the even split a KV head gets (at least one: the kernels' grids have at least H_kv
// warps, decode_min_blocks).
CELLKV_HOST_DEVICE constexpr std::int32_t decode_head_workers(std::int64_t workers, std::int32_t heads_kv) noexcept {
  const std::int64_t per_head = workers / heads_kv;
  return per_head > 1 ? static_cast<std::int32_t>(per_head) : 1;
}
// The even split's chunk for `head_tiles` tiles a head of `heads_kv` over `workers` workers.
CELLKV_HOST_DEVICE constexpr std::int64_t even_chunk(std::int64_t head_tiles, std::int64_t workers,
                                                     std::int32_t heads_kv) noexcept {
  return decode_chunk(head_tiles, decode_head_workers(workers, heads_kv));
}
// Blocks of `warps` warps a decode grid needs at least: one worker a KV head.
constexpr std::int32_t decode_min_blocks(std::int32_t heads_kv, std::int32_t warps) noexcept {
  return (heads_kv + warps - 1) / warps;
}

// Worker `worker`'s part of the even split of `workers` workers: flat tiles [begin, end) (empty for
// the workers past head_workers x H_kv, and for chunks past a head's tiles), the part's index
// begin / chunk (its merge slots: part_slot), and the flat tiles between heads.
struct EvenPart {
  std::int64_t begin = 0, end = 0;
  std::int64_t chunk = 1, stride = 1;
};
CELLKV_HOST_DEVICE constexpr EvenPart even_split_part(std::int64_t worker, std::int64_t workers,
                                                      std::int32_t heads_kv, std::int32_t head_tiles) noexcept {
  const std::int32_t per_head = decode_head_workers(workers, heads_kv);
  EvenPart p;
  p.chunk = even_chunk(head_tiles, workers, heads_kv);
  p.stride = per_head * p.chunk;
  const std::int64_t h = worker % heads_kv, c = worker / heads_kv;
  if (c >= per_head) return p;
  const std::int64_t head_end = h * p.stride + head_tiles;
  p.begin = h * p.stride + c * p.chunk;
  p.end = p.begin + p.chunk < head_end ? p.begin + p.chunk : head_end;
  if (p.end < p.begin) p.end = p.begin;
  return p;
}

// How the decode kernel's `blocks` x `warps` workers share a step's `pairs` (segment, KV head)
// pairs, `head_tiles` tiles a KV head of `heads_kv`, the longest pair `longest` tiles:
//   even  each head's tiles cut into equal chunks over its share of the workers
//         (even_split_part); a pair cut by a chunk boundary is merged through global memory,
//         kDecodeMergeFanIn parts a level (partial written, counted, read back: a chain of
//         dependent round trips; on the H200 a level took about 5 us at the end of a step, while a
//         tile streams in about 3 us: kMergeLevelTiles).
//   team  block b takes pairs [b per_block, (b + 1) per_block), teams of warps / per_block
//         consecutive warps per pair, each warp an equal share of its pair's tiles; a team's parts
//         merge in the block's shared memory after one block barrier. A team of one streams its
//         pair whole.
// Teams of two or more when each warp then streams at most as many tiles as the even split's
// chunk plus the cost of merging the longest pair's parts in global memory (or kTeamTiles, for
// steps of few, short pairs where the even split would cut every pair into one-tile parts); a
// team of one when the longest pair is at most twice the even chunk (many pairs, at most one per
// worker, where the even split would cut most pairs at a chunk boundary); else even.
inline constexpr std::int32_t kTeamTiles = 2;
inline constexpr std::int32_t kDecodeMergeFanIn = 8;  // parts one global merge combines
inline constexpr std::int32_t kMergeLevelTiles = 2;   // a level of global merges, in tiles streamed
struct DecodeAssignment {
  bool even = true;
  std::int32_t team = 1;       // warps per pair (team assignment)
  std::int32_t per_block = 0;  // pairs per block (team assignment)
};
// Levels of kDecodeMergeFanIn-way merges that combine `parts` parts into one (0 for one part).
CELLKV_HOST_DEVICE constexpr std::int32_t merge_levels(std::int64_t parts) noexcept {
  std::int32_t levels = 0;
  for (std::int64_t merged = 1; merged < parts; merged *= kDecodeMergeFanIn) ++levels;
  return levels;
}
// What the even split costs its busiest worker, in tiles streamed: its chunk, then the merge
// levels of the longest pair's parts.
CELLKV_HOST_DEVICE constexpr std::int64_t even_split_cost(std::int64_t chunk, std::int32_t longest) noexcept {
  return chunk + static_cast<std::int64_t>(kMergeLevelTiles) * merge_levels((longest + chunk - 1) / chunk);
}
CELLKV_HOST_DEVICE constexpr DecodeAssignment decode_assignment(std::int64_t pairs, std::int32_t blocks, std::int32_t warps,
                                                               std::int32_t longest, std::int64_t head_tiles,
                                                               std::int32_t heads_kv) noexcept {
  const std::int64_t workers = static_cast<std::int64_t>(blocks) * warps;
  if (pairs <= 0 || pairs > workers) return {};
  const auto per_block = static_cast<std::int32_t>((pairs + blocks - 1) / blocks);
  const std::int32_t team = warps / per_block;
  const std::int64_t chunk = even_chunk(head_tiles, workers, heads_kv);
  const std::int64_t even_cost = even_split_cost(chunk, longest);
  if (team >= 2 && (longest + team - 1) / team <= (even_cost > kTeamTiles ? even_cost : kTeamTiles))
    return {false, team, per_block};
  if (longest <= 2 * chunk) return {false, 1, per_block};
  return {};
}

// Member m of a team of `team` warps streams tiles [m share, min(tiles, (m + 1) share)) of its pair
// of `tiles` tiles; the first team_members of them hold tiles (the parts to merge).
CELLKV_HOST_DEVICE constexpr std::int32_t team_share(std::int32_t tiles, std::int32_t team) noexcept {
  return (tiles + team - 1) / team;
}
CELLKV_HOST_DEVICE constexpr std::int32_t team_members(std::int32_t tiles, std::int32_t team) noexcept {
  const std::int32_t share = team_share(tiles, team);
  return (tiles + share - 1) / share;
}

// Workers [first, last] that hold a part of the pair covering tiles [begin, end) (end > begin).
struct PartRange {
  std::int32_t first = 0;
  std::int32_t last = 0;
  CELLKV_HOST_DEVICE constexpr std::int32_t count() const noexcept { return last - first + 1; }
};
CELLKV_HOST_DEVICE constexpr PartRange parts_of(std::int64_t begin, std::int64_t end, std::int64_t chunk) noexcept {
  return {static_cast<std::int32_t>(begin / chunk), static_cast<std::int32_t>((end - 1) / chunk)};
}

// Partial-result slot of worker w's part of a pair that starts at tile `begin`: each worker has
// two, one for the pair it starts inside of (its first pair, when that began at or before the
// worker's first tile), one for the last pair it starts, which may run on past its chunk.
CELLKV_HOST_DEVICE constexpr std::int32_t part_slot(std::int32_t worker, std::int64_t begin, std::int64_t chunk) noexcept {
  return 2 * worker + (begin > static_cast<std::int64_t>(worker) * chunk ? 1 : 0);
}

}  // namespace cellkv
