// cellkv/prefix_sharing.hpp - finds the prefixes that several sequences of a step share, so the
// attention reads each shared K/V tile once for all of them (cell layout).
//
// Forks share full pages of the position table (position_table.hpp): when the segments of a step
// hold the same page id at page k they hold the same cells at those 64 positions, and every query
// of theirs sees them (a shared page lies below each member's first query; a window may still cut
// into it, per query row). Members that agree on pages [0, k) form a class; walking k upwards a
// class only splits, so each segment's shared positions are a prefix [0, own_begin) cut into
// nested runs, one per class it belongs to, and it reads [own_begin, last query] itself.
//
// A run is one unit of work whose query rows are all its members' step tokens x their GQA heads
// (packed as MMA rows, SharingShape::rows per item: what one block of the shared-prefix kernel that
// runs takes), over the run's positions cut into `splits` KV ranges. Every (run, split) writes a
// partial result per member token and head into its own slot.
// A token's slots, every split of every run it belongs to, are consecutive (token_slots; a run's
// splits consecutive within them); the kernel that reads a segment's own positions folds them all
// into its output by log-sum-exp (the split-KV merge), so no kernel merges the splits before.
// Nothing here depends on where cells are or on windows.
//
// Finished tokens: where the shared-prefix kernel that runs offers it (SharingShape::finish_own),
// a decode segment whose own positions are at most that many is finished by the shared-prefix
// kernel itself, not by the decode kernel: its tokens are listed in `finished`, each gets one more
// slot, the last of its range, for the part it reads itself, and the kernel, once every item of
// the step is done, folds every slot of those tokens into their outputs (fused_finish.cuh). A
// fork decoding one token then costs one kernel, not two.
//
// This header holds the plan's data (fixed-capacity arrays in device or staging memory);
// sharing_planner.hpp makes it.
#pragma once

#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/host_device.hpp"

namespace cellkv {

inline constexpr std::int32_t kSharedRows = 64;      // query rows of a shared item of the mma.sync kernel
inline constexpr std::int32_t kSharedTile = 64;      // positions per KV tile of a shared item (one page)
inline constexpr std::int32_t kMinSplitTiles = 4;    // a run has at most tiles / kMinSplitTiles splits
inline constexpr std::int32_t kMaxSplits = 16;       // partial slots per token and run, at most

// Positions [begin, end) (multiples of kPagePositions) that the step tokens
// run_tokens[token0, token0 + tokens) all see through the same cells; `seq` is a member whose
// table is read. Its tiles (kSharedTile positions) are cut into `splits` consecutive ranges whose
// inner boundaries are multiples of `unit` tiles (split_tiles).
struct SharedRun {
  std::int32_t seq = 0;
  std::int32_t begin = 0;
  std::int32_t end = 0;
  std::int32_t token0 = 0;
  std::int32_t tokens = 0;
  std::int32_t splits = 1;
  std::int32_t unit = 1;
};

// Query rows [row0, row0 + SharingShape::rows) of a run over its split `split`; row r is member token
// r / group, query head r % group of the KV head's group. The items of one (run, row0) are
// consecutive, by split. [lo, hi]: the lowest and highest query position of the item's rows (the
// planner's, so the kernels need not read every row's token and position first).
struct SharedItem {
  std::int32_t run = 0;
  std::int32_t split = 0;
  std::int32_t row0 = 0;
  std::int32_t lo = 0;
  std::int32_t hi = 0;
};

// A step token the shared-prefix kernel finishes: its position and sequence, and the first position
// it reads itself (its segment's own_begin). Its own part goes to slot first + count - 1 of its
// token_slots.
struct FinishedToken {
  std::int32_t token = 0;
  std::int32_t seq = 0;
  std::int32_t pos = 0;
  std::int32_t own_begin = 0;
};

// A token's partial slots: [first, first + count).
struct SlotRange {
  std::int32_t first = 0;
  std::int32_t count = 0;
};

// The sharing of one step, in fixed-capacity arrays.
struct SharedWork {
  std::int32_t* counts = nullptr;      // [4]: runs, items, run tokens, finished tokens
  SharedRun* runs = nullptr;           // [max_runs]
  std::int32_t* run_tokens = nullptr;  // [slots] the member tokens of every run, run by run
  std::int32_t* run_slot = nullptr;    // [slots] slot of split 0 of that token in that run (split k: + k)
  SharedItem* items = nullptr;         // [slots]
  std::int32_t* own_begin = nullptr;   // [max_write] per segment: first position it reads itself
  SlotRange* token_slots = nullptr;    // [max_write] per step token: its slots, every split of every run
                                       // (and last, a finished token's own part)
  FinishedToken* finished = nullptr;   // [max_write] the tokens the shared-prefix kernel finishes

  CELLKV_HOST_DEVICE std::int32_t run_count() const noexcept { return counts[0]; }
  CELLKV_HOST_DEVICE std::int32_t item_count() const noexcept { return counts[1]; }
  CELLKV_HOST_DEVICE std::int32_t run_token_count() const noexcept { return counts[2]; }
  CELLKV_HOST_DEVICE std::int32_t finished_count() const noexcept { return counts[3]; }
};

// Capacities and the kernel geometry the plan depends on.
struct SharingShape {
  std::int32_t group = 1;      // H_q / H_kv
  std::int32_t heads_kv = 1;
  std::int32_t workers = 1;    // items x H_kv the shared kernel runs at once (splits aim to fill it)
  std::int32_t max_runs = 0;   // capacity of runs
  std::int32_t slots = 0;      // capacity of partial slots, run tokens and items
  std::int32_t rows = kSharedRows;  // query rows of an item (one block of the kernel that runs)
  std::int32_t split_unit = 1;      // tiles a split boundary aligns to (2: the wgmma kernel's 128 positions)
  // Own positions of a decode segment the shared-prefix kernel finishes, at most (0: it finishes
  // none; at most kMaxFinishOwn).
  std::int32_t finish_own = 0;
  // Finished rows (tokens x H_q) a step may hold, at most: when its qualifying segments have more,
  // none is finished (the decode kernel then serves them all, faster than a finish spread too thin).
  std::int32_t finish_rows = 0;
  std::int32_t decode_rows = kDecodeRows;  // query rows of a decode item (AttentionShape::decode_rows)
};

// The most own positions a finished token may read (one per lane of the warp that reads them).
inline constexpr std::int32_t kMaxFinishOwn = 32;

// The KV tiles (kSharedTile positions) [first, first + count) of split `k` of a run: the run's tiles
// in `unit`-tile blocks aligned to tile 0 (the first and last block cut to the run), split k taking
// blocks [blocks k / splits, blocks (k + 1) / splits). Unit 1: tiles [tiles k / splits, tiles (k + 1)
// / splits). Every split is non-empty when splits <= blocks.
CELLKV_HOST_DEVICE constexpr TileSpan split_tiles(const SharedRun& r, std::int32_t k) noexcept {
  const std::int32_t first = r.begin / kSharedTile, end = r.end / kSharedTile;
  const std::int32_t aligned = first / r.unit * r.unit, blocks = (end - aligned + r.unit - 1) / r.unit;
  auto bound = [&](std::int32_t i) {
    const std::int32_t at = aligned + r.unit * static_cast<std::int32_t>(static_cast<std::int64_t>(blocks) * i / r.splits);
    return at < first ? first : at > end ? end : at;
  };
  const std::int32_t lo = bound(k), hi = bound(k + 1);
  return {lo, hi - lo};
}

}  // namespace cellkv
