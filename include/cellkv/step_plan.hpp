// cellkv/step_plan.hpp - what the host hands the device for a placed step, as plain data.
//
// The device side (include/cellkv/gpu/) consumes exactly this and queries nothing else: per token
// its row, sequence and position; the step's segments; read_len; and what changed since the last
// upload (the position-table entries written, for the cell layout; the row copies of forks, for
// the sequence layout).
#pragma once

#include <cstdint>
#include <span>

namespace cellkv {

// Sizes of a cache, fixed at construction. Fields a layout does not use are ignored.
struct CacheConfig {
  std::int32_t max_write = 0;  // widest step, in tokens (both layouts)
  std::int32_t max_cells = 0;  // cell layout: rows of every layer's pool
  std::int32_t max_seqs = 0;   // live sequences at once, <= MaxSeqs; 0 means MaxSeqs
  std::int32_t max_len = 0;    // sequence layout: rows per sequence slot (pool rows = max_seqs * max_len)
  // Cell layout, window storage: cells of the pool of each distinct nonzero window of the set
  // (its layers' K and V), which keeps only the positions its queries can still see; 0 = none
  // (every layer stores every position in the main pool). Each live sequence needs about
  // window + 64 + the tokens of its step cells there (docs/design.md section 2, "Window storage").
  std::int32_t window_cells = 0;
  friend bool operator==(const CacheConfig&, const CacheConfig&) = default;
};

// A device-to-device copy of `rows` consecutive pool rows in every layer, from src_row to dst_row.
// The sequence layout's fork (seq_clone) reports one; the cell layout reports one per cell that
// seq_add / seq_div copied on write (rows = 1). Copies run in order, before the next step's write
// and before the rotations.
struct RowCopy {
  std::int64_t src_row = 0;
  std::int64_t dst_row = 0;
  std::int32_t rows = 0;
  friend bool operator==(const RowCopy&, const RowCopy&) = default;
};

// A cell whose K must be re-rotated (RoPE) from the position it was computed at to its new one,
// after seq_add / seq_div moved it (cell layout). `old_pos` is the position the cell's K encodes
// once the pending copies have run; `new_pos` is the cell's position now (old_pos != new_pos). The
// list holds each cell at most once, no free cell, and runs after the copies (order within the
// list is free: entries are independent).
struct RowRotation {
  std::int32_t cell = 0;
  std::int32_t old_pos = 0;
  std::int32_t new_pos = 0;
  friend bool operator==(const RowRotation&, const RowRotation&) = default;
};

// Rows [begin, end) a token sees (the sequence layout's form of visibility); empty when begin >= end.
struct RowRange {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  friend bool operator==(const RowRange&, const RowRange&) = default;
};

// A query segment: a maximal run of consecutive step tokens of one sequence, tokens
// [tok0, tok0 + len) at positions [pos0, pos0 + len) (positions of a sequence's tokens in a step
// are consecutive in token order). Kernels take one segment's queries as one tile of rows.
struct Segment {
  std::int32_t seq = 0;
  std::int32_t tok0 = 0;
  std::int32_t len = 0;
  std::int32_t pos0 = 0;
  friend bool operator==(const Segment&, const Segment&) = default;
};

// A placed step of T tokens. The spans point into the cache and stay valid until the next
// declaration or verb.
struct StepPlan {
  std::int32_t tokens = 0;                  // T
  std::span<const std::int64_t> rows;       // [T] row (cell) written by token t
  std::span<const std::int32_t> seqs;       // [T] sequence of token t
  std::span<const std::int32_t> positions;  // [T] position of token t in its sequence
  std::span<const Segment> segments;        // the step's segments, in token order
  std::int64_t read_len = 0;                // 1 + highest occupied row after placement (0 if none)
  std::uint64_t serial = 0;                 // counts declared steps; a new placement gets a new serial
  // Window storage only (empty without): token t's cell in window pool i is window_rows[i T + t],
  // and window_read_len[i] is that pool's read_len. `rows` and `read_len` are the main pool's.
  std::span<const std::int64_t> window_rows;      // [window pools][T]
  std::span<const std::int64_t> window_read_len;  // [window pools]
};

// Splits the tokens of a step (seqs[t], positions[t]) into segments, in token order; returns how
// many were written to out (out.size() >= seqs.size() suffices).
inline std::int32_t split_segments(std::span<const std::int32_t> seqs, std::span<const std::int32_t> positions,
                                   std::span<Segment> out) {
  std::int32_t n = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const bool extends = n > 0 && out[static_cast<std::size_t>(n - 1)].seq == seqs[i];
    if (extends) ++out[static_cast<std::size_t>(n - 1)].len;
    else out[static_cast<std::size_t>(n++)] = Segment{seqs[i], static_cast<std::int32_t>(i), 1, positions[i]};
  }
  return n;
}

// Position-table entries written since the last acknowledge (cell layout): the device copy of the
// table becomes equal to the host's by writing table[indices[i]] = values[indices[i]].
struct TableChanges {
  std::span<const std::int32_t> indices;  // into the flat table, each listed once
  std::span<const std::int32_t> values;   // the whole flat table (directory, then pages)
};

// What changed since the last `acknowledge_changes()`, for an incremental device upload.
// Apply in this order: copies, then rotations (the table writes are independent of both).
struct PendingChanges {
  std::span<const RowCopy> copies;  // fork copies (sequence layout), copy-on-write cells of
                                    // seq_add / seq_div (cell layout), in the order to run them
  TableChanges table;               // cell layout: position-table entries to write
  std::span<const RowRotation> rotations;  // cell layout: K rows to re-rotate after the copies
};

// Whether `cache` (any KVCache) keeps its windowed layers in pools of their own
// (CacheConfig::window_cells > 0): then one pool's consumer (a host pool, a device upload) must
// take that pool's changes, not only pending_changes() (the main pool's).
template <class Cache>
[[nodiscard]] bool has_window_storage(const Cache& cache) noexcept {
  if constexpr (requires { cache.window_storage(); }) return cache.window_storage();
  else return false;
}

}  // namespace cellkv
