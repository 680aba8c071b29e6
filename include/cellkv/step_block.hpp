// cellkv/step_block.hpp - the step block: what one upload copies to a device in one host-to-device
// copy, at offsets fixed for the cache's life (the same in host staging and in device memory).
//
//   cells         int64 [max_write]             row written by token t (the scratch row for padding)
//   read_len      int64 [1]
//   tokens        int32 [1], num_segments int32 [1]
//   token_seq     int32 [max_write], token_pos int32 [max_write]
//   window_cells  int64 [window pools][max_write] row token t writes in window pool i (window storage)
//   window_read_len int64 [window pools]          each window pool's read_len   (window storage)
//   segments      Segment [max_write]                                   (16-byte aligned)
//   work          per window buffer: counts int32 [3], decode_seg int32 [max_write],
//                 decode_prefix int32 [max_write + 1], prefill PrefillItem [max_prefill]
//   ranges        RowRange [windows][max_write]   sequence layout only (reference kernel)
//   shared        the step's shared prefixes (SharedWork, prefix_sharing.hpp), from a 16-byte
//                 boundary: counts int32 [4], own_begin int32 [max_write], token_slots SlotRange
//                 [max_write], finished FinishedToken [max_write], runs SharedRun [max_runs], run_tokens, run_slot int32
//                 [shared_slots], items SharedItem [shared_slots]    cell layout with the table kernels
//   table writes  TableWrite [max_table_writes]   cell layout only; only the used ones are copied
//
// cuda/step_views.hpp names the device address of every part; docs/design.md section 5.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cellkv/attention_plan.hpp"
#include "cellkv/layout.hpp"
#include "cellkv/pool_view.hpp"
#include "cellkv/prefix_sharing.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv {

// One write of the position table's device copy: flat[index] = value.
struct TableWrite {
  std::int32_t index = 0;
  std::int32_t value = 0;
};

// Sizes of a step block, fixed at construction.
struct StepBlockShape {
  std::int32_t max_write = 0;
  std::int32_t windows = 0;
  std::int32_t max_prefill = 0;       // prefill items per window
  bool ranges = false;                // sequence layout: per-window row ranges
  std::int32_t max_table_writes = 0;  // position-table writes one upload carries (cell layout)
  std::int32_t max_runs = 0;          // shared-prefix runs per step (cell layout; 0: no sharing)
  std::int32_t shared_slots = 0;      // shared-prefix partial slots (and run tokens, items) per step
  std::int32_t window_pools = 0;      // window storage: pools of the windowed layers (0: none)
};

// Shared-prefix partial slots a cache of max_write tokens per step provides: 2 max_write,
// within [256, 2048] (a 64-fork decode step of a 4k prefix needs 64 x 8).
constexpr std::int32_t shared_slot_capacity(std::int32_t max_write) noexcept {
  return std::clamp(2 * std::clamp(max_write, 0, 1024), 256, 2048);
}

// Byte offsets of the step block's parts (identical on host staging and device).
struct StepBlockLayout {
  std::size_t cells = 0, read_len = 0, tokens = 0, num_segments = 0, token_seq = 0, token_pos = 0, window_cells = 0,
              window_read_len = 0, segments = 0, work = 0, work_bytes = 0, ranges = 0, shared = 0, table_writes = 0, bytes = 0;
  // Inside the shared part: counts, own_begin, token_slots, finished, runs, run_tokens, run_slot,
  // items (the list at the top of this file).
  std::size_t own_begin = 0, token_slots = 0, finished = 0, runs = 0, run_tokens = 0, run_slot = 0, items = 0;

  explicit StepBlockLayout(const StepBlockShape& s) {
    const auto w = static_cast<std::size_t>(s.max_write);
    read_len = cells + 8 * w;
    tokens = read_len + 8;
    num_segments = tokens + 4;
    token_seq = num_segments + 4;
    token_pos = token_seq + 4 * w;
    window_cells = align16(token_pos + 4 * w);
    window_read_len = window_cells + 8 * w * static_cast<std::size_t>(s.window_pools);
    segments = align16(window_read_len + 8 * static_cast<std::size_t>(s.window_pools));
    work = align16(segments + sizeof(Segment) * w);
    // per window: counts [kWindowCounts], decode_seg [w], decode_prefix [w + 1], then from a
    // 16-byte boundary (work_at) the prefill items
    work_bytes = align16(window_ints_bytes(w) + sizeof(PrefillItem) * static_cast<std::size_t>(s.max_prefill));
    ranges = work + work_bytes * static_cast<std::size_t>(s.windows);
    shared = align16(ranges + (s.ranges ? sizeof(RowRange) * w * static_cast<std::size_t>(s.windows) : 0));
    const auto slots = static_cast<std::size_t>(s.shared_slots);
    own_begin = shared + 16;
    token_slots = align16(own_begin + 4 * w);
    finished = align16(token_slots + sizeof(SlotRange) * w);
    runs = align16(finished + sizeof(FinishedToken) * w);
    run_tokens = align16(runs + sizeof(SharedRun) * static_cast<std::size_t>(s.max_runs));
    run_slot = run_tokens + 4 * slots;
    items = align16(run_slot + 4 * slots);
    const std::size_t shared_end = items + sizeof(SharedItem) * slots;
    table_writes = align16(s.shared_slots > 0 ? shared_end : shared);
    bytes = table_writes + sizeof(TableWrite) * static_cast<std::size_t>(s.max_table_writes);
  }

  // The shared-prefix arrays inside a block at `base` (all null without sharing).
  [[nodiscard]] SharedWork shared_at(std::byte* base, const StepBlockShape& s) const {
    if (s.shared_slots == 0) return {};
    auto ints = [&](std::size_t at) { return reinterpret_cast<std::int32_t*>(base + at); };
    return SharedWork{ints(shared),          reinterpret_cast<SharedRun*>(base + runs),
                      ints(run_tokens),       ints(run_slot),
                      reinterpret_cast<SharedItem*>(base + items), ints(own_begin),
                      reinterpret_cast<SlotRange*>(base + token_slots), reinterpret_cast<FinishedToken*>(base + finished)};
  }

  // Window buffer b's work arrays inside a block at `base`.
  [[nodiscard]] WindowWork work_at(std::byte* base, std::int32_t b, std::int32_t max_write) const {
    std::byte* at = base + work + work_bytes * static_cast<std::size_t>(b);
    auto* ints = reinterpret_cast<std::int32_t*>(at);
    const auto w = static_cast<std::size_t>(max_write);
    return WindowWork{ints, ints + kWindowCounts, ints + kWindowCounts + w,
                      reinterpret_cast<PrefillItem*>(at + window_ints_bytes(w))};
  }

 private:
  // A window's counts, decode_seg and decode_prefix, to a 16-byte boundary.
  static constexpr std::size_t window_ints_bytes(std::size_t w) { return align16(4 * (kWindowCounts + w + w + 1)); }
  static constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }
};

// The step block of a device cache planned by a `Host` (a KVCache) for a shard of `shape`:
// max_write tokens, one work area per distinct window, the prefill items of the shard's GQA group,
// row ranges (sequence layout) or room for max(4 max_write, 4096) table writes per position table
// (cell layout: one, or 1 + window pools with window storage), and with `shared_prefixes` (cell
// layout, the table kernels' element types) max_write shared-prefix runs and
// shared_slot_capacity(max_write) slots. Refuses max_write < 1 (bad_argument) and counts past int32
// (size_overflow).
template <class Host>
Result<StepBlockShape> step_block_shape(const CacheConfig& config, const PoolShape& shape, bool shared_prefixes) {
  constexpr bool kTable = Host::Layout::kPositionTable;  // else row ranges (layout.hpp)
  constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
  if (config.max_write < 1) return Errc::bad_argument;
  const std::int32_t group = shape.heads_q > 0 && shape.heads_kv > 0 ? std::max(1, shape.heads_q / shape.heads_kv) : 1;
  const std::int64_t prefill = max_prefill_items(config.max_write, group);
  const std::int32_t window_pools = kTable && config.window_cells > 0 ? Host::Windows::kWindowedCount : 0;
  const std::int64_t table_writes =
      kTable ? std::max<std::int64_t>(4 * std::int64_t{config.max_write}, 4096) * (1 + window_pools) : 0;
  if (prefill > kInt32Max || table_writes > kInt32Max) return Errc::size_overflow;
  const bool sharing = kTable && shared_prefixes;
  return StepBlockShape{config.max_write,
                        Host::Windows::kDistinct,
                        static_cast<std::int32_t>(prefill),
                        !kTable,
                        static_cast<std::int32_t>(table_writes),
                        sharing ? config.max_write : 0,
                        sharing ? shared_slot_capacity(config.max_write) : 0,
                        window_pools};
}

}  // namespace cellkv
