// cellkv/plan_digest.hpp - a 64-bit digest of what a host cache hands its devices now: the declared
// step (tokens, rows, sequences, positions, segments, read_len; with window storage each window
// pool's rows and read_len) and every pool's pending changes (row copies, position-table writes
// with the values written, K rotations).
//
// Processes that replay the same planning verbs on caches of their own (tensor-parallel ranks, one
// per GPU) must hand their devices the same plan at every step; comparing plan_digest(cache) across
// ranks (after declare_step, before the upload) checks that they do. The digest is computed from
// values, integer by integer (FNV-1a 64 over each integer's little-endian bytes), so it does not
// depend on addresses, struct padding, the process or the host's byte order. A cache with no step
// declared digests its pending changes alone (and differs from any placed step's digest).
//
//   if (const std::uint64_t mine = cellkv::plan_digest(cache); mine != rank0_digest) ...  // diverged
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "cellkv/step_plan.hpp"

namespace cellkv {

// FNV-1a 64 over integers, each as its little-endian bytes (a value fold: fold(x) of an int32 and
// of an int64 of the same value differ, since their widths do).
class PlanHasher {
 public:
  static constexpr std::uint64_t kOffsetBasis = 14695981039346656037ull;
  static constexpr std::uint64_t kPrime = 1099511628211ull;

  template <class I>
  constexpr void fold(I value) noexcept {
    static_assert(sizeof(I) <= 8, "integers of up to 64 bits");
    auto bits = static_cast<std::uint64_t>(value);
    for (std::size_t i = 0; i < sizeof(I); ++i, bits >>= 8) h_ = (h_ ^ (bits & 0xFFu)) * kPrime;
  }
  // A span's length, then its elements.
  template <class I>
  constexpr void fold_all(std::span<const I> values) noexcept {
    fold(static_cast<std::uint64_t>(values.size()));
    for (const I v : values) fold(v);
  }
  [[nodiscard]] constexpr std::uint64_t value() const noexcept { return h_; }

 private:
  std::uint64_t h_ = kOffsetBasis;
};

// The step plan's fields in a fixed order (serial excluded: a count of declarations, not content).
constexpr void fold_step(PlanHasher& h, const StepPlan& plan) noexcept {
  h.fold(plan.tokens);
  h.fold_all(plan.rows);
  h.fold_all(plan.seqs);
  h.fold_all(plan.positions);
  h.fold(static_cast<std::uint64_t>(plan.segments.size()));
  for (const Segment& s : plan.segments) h.fold(s.seq), h.fold(s.tok0), h.fold(s.len), h.fold(s.pos0);
  h.fold(plan.read_len);
  h.fold_all(plan.window_rows);
  h.fold_all(plan.window_read_len);
}

// One pool's pending changes: the copies, the table writes (each index with the value it writes),
// the rotations.
constexpr void fold_changes(PlanHasher& h, const PendingChanges& c) noexcept {
  h.fold(static_cast<std::uint64_t>(c.copies.size()));
  for (const RowCopy& r : c.copies) h.fold(r.src_row), h.fold(r.dst_row), h.fold(r.rows);
  h.fold(static_cast<std::uint64_t>(c.table.indices.size()));
  for (const std::int32_t i : c.table.indices) h.fold(i), h.fold(c.table.values[static_cast<std::size_t>(i)]);
  h.fold(static_cast<std::uint64_t>(c.rotations.size()));
  for (const RowRotation& r : c.rotations) h.fold(r.cell), h.fold(r.old_pos), h.fold(r.new_pos);
}

// The digest of `cache` (any KVCache) as described above: a marker of whether a step is placed,
// the step, the main pool's pending changes, then each window pool's (window storage, in
// Windows::kWindowed order).
template <class Cache>
[[nodiscard]] std::uint64_t plan_digest(const Cache& cache) noexcept {
  PlanHasher h;
  h.fold(static_cast<std::uint8_t>(cache.step_placed() ? 1 : 0));
  if (cache.step_placed()) fold_step(h, cache.step());
  fold_changes(h, cache.pending_changes());
  if (has_window_storage(cache)) {
    if constexpr (requires { cache.pool(0).pending_changes(); }) {
      for (const std::int32_t w : Cache::Windows::kWindowed) fold_changes(h, cache.pool(w).pending_changes());
    }
  }
  return h.value();
}

}  // namespace cellkv
