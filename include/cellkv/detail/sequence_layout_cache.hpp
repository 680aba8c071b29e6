// cellkv/detail/sequence_layout_cache.hpp - KVCache for layout::sequence (include cellkv/kv_cache.hpp).
//
// Sequence s owns slot s: rows [s * max_len, (s + 1) * max_len); position p lives at row
// s * max_len + p. No per-row metadata is needed: a row is occupied iff its position is below its
// sequence's length. A fork reports the prefix rows to copy (pending_changes().copies).
//
// Edits (docs/design.md section 4, "Sequence edits"): a row's position is its offset in the slot,
// so a sequence cannot hold holes, share rows or move rows without copying them in place. seq_rm
// of a range is served when the range reaches the last position (a rewind) or is empty; seq_cp,
// seq_add and seq_div are refused (Errc::unsupported_by_layout) whatever their range.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/detail/cache_common.hpp"

namespace cellkv {

// P is placement::none (the default); a cell placement named here is ignored (layout.hpp).
template <WindowSet W, PlacementFor<layout::sequence> P, std::int32_t MaxSeqs>
class KVCache<layout::sequence, W, P, MaxSeqs>
    : public detail::CacheCommon<KVCache<layout::sequence, W, P, MaxSeqs>, W, MaxSeqs> {
  using Base = detail::CacheCommon<KVCache, W, MaxSeqs>;
  friend Base;

 public:
  using Layout = layout::sequence;
  using PlacementPolicy = placement::none;  // a sequence's rows are its slot

  // Throws std::invalid_argument when validate(config) refuses it, std::bad_alloc when host memory
  // runs out (fits_within(config, budget) checks that first).
  explicit KVCache(const CacheConfig& config) : Base(config) {}

  [[nodiscard]] std::int32_t max_len() const noexcept { return this->config().max_len; }
  // Positions a sequence can reach: [0, max_len).
  [[nodiscard]] std::int32_t position_limit() const noexcept { return max_len(); }
  [[nodiscard]] std::int64_t capacity() const noexcept {
    return static_cast<std::int64_t>(this->config().max_seqs) * max_len();
  }
  [[nodiscard]] std::int64_t free_cells() const noexcept { return capacity() - used_rows_; }
  // First row of sequence s's slot.
  [[nodiscard]] std::int64_t slot_begin(std::int32_t seq) const noexcept {
    return static_cast<std::int64_t>(seq) * max_len();
  }

  // Visible rows [begin, end) of token t of the placed step through window `window`. Refuses what
  // visible() refuses (no_step_declared, bad_argument).
  [[nodiscard]] Result<RowRange> visible_range(std::int32_t t, std::int32_t window) const {
    if (const Status s = this->check_query(t, window); !s.ok()) return s.code();
    const StepPlan plan = this->step();
    const std::int32_t p = plan.positions[static_cast<std::size_t>(t)];
    const auto base = static_cast<std::int32_t>(slot_begin(plan.seqs[static_cast<std::size_t>(t)]));
    return RowRange{base + visible_begin(window, p), base + p + 1};  // < max_seqs x max_len <= INT32_MAX
  }

  // Fork copies since the last acknowledge_changes(), in the order to run them.
  [[nodiscard]] PendingChanges pending_changes() const noexcept { return {copies_, {}, {}}; }
  void acknowledge_changes() noexcept {
    copies_.clear();
    ++changes_epoch_;
  }
  // Changes whenever the pending copies change (and at every acknowledge_changes).
  [[nodiscard]] std::uint64_t changes_epoch() const noexcept { return changes_epoch_; }

  friend bool operator==(const KVCache&, const KVCache&) = default;

 private:
  // max_len >= 1 (bad_argument); max_seqs x max_len rows + max_write within int32 (size_overflow):
  // every row, the scratch row after them, and a position plus a step's tokens stay indexable.
  // `c` has max_seqs filled in.
  static Status validate_rows(const CacheConfig& c) {
    if (c.max_len < 1) return Errc::bad_argument;
    if (c.window_cells != 0) return Errc::unsupported_by_layout;  // window storage is the cell layout's
    const std::int64_t rows = static_cast<std::int64_t>(c.max_seqs) * c.max_len;
    return rows + c.max_write <= detail::kInt32Max ? Status{} : Status{Errc::size_overflow};
  }
  // No per-row state: the pending fork copies only, one per seq_clone until acknowledge_changes
  // (not counted: they grow with the forks, not with the sizes).
  static std::size_t layout_host_bytes(const CacheConfig&) { return 0; }

  // ---- hooks for CacheCommon ----
  // In 64 bits: pos(s) + the step's tokens of s may pass INT32_MAX when max_len is near it.
  Status room_for_step(std::span<const std::int32_t> seqs, std::span<const std::int32_t> count) const {
    for (const std::int32_t s : seqs)
      if (static_cast<std::int64_t>(this->length(s)) + count[static_cast<std::size_t>(s)] > max_len())
        return Errc::sequence_full;
    return {};
  }

  void before_placement(std::span<const std::int32_t>) {}
  void after_placement() {}
  [[nodiscard]] std::span<const std::int64_t> window_rows(std::int32_t) const noexcept { return {}; }
  [[nodiscard]] std::span<const std::int64_t> window_read_lens() const noexcept { return {}; }

  std::int64_t claim_row(std::int32_t, std::int32_t seq, std::int32_t pos) {
    ++used_rows_;
    nonempty_.set(seq);
    return slot_begin(seq) + pos;
  }

  void truncate_rows(std::int32_t seq, std::int32_t keep) {
    used_rows_ -= this->length(seq) - keep;
    if (keep == 0) nonempty_.reset(seq);
  }

  Status room_for_clone(std::int32_t, std::int32_t) const { return {}; }

  std::int32_t share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    if (upto == 0) return 0;
    copies_.push_back(RowCopy{slot_begin(src), slot_begin(dst), upto});
    ++changes_epoch_;
    used_rows_ += upto;
    nonempty_.set(dst);
    return upto;
  }

  // ---- saved state ----
  static constexpr bool kHoles = false;
  Status room_for_restore(std::span<const std::int32_t>) const { return {}; }
  void restore_rows(std::int32_t seq, std::span<const std::int32_t> positions) {
    used_rows_ += static_cast<std::int64_t>(positions.size());
    if (!positions.empty()) nonempty_.set(seq);
  }
  [[nodiscard]] std::int64_t row_at(std::int32_t seq, std::int32_t pos) const { return slot_begin(seq) + pos; }
  template <class F>
  void for_each_held(std::int32_t seq, F&& f) const {
    for (std::int32_t p = 0; p < this->length(seq); ++p) f(p, slot_begin(seq) + p);
  }

  // ---- sequence edits ----
  [[nodiscard]] std::int32_t first_position(std::int32_t seq) const { return this->length(seq) > 0 ? 0 : -1; }

  // Only a suffix (or nothing): rows stay at their positions, so a hole could not be skipped.
  Result<std::int32_t> remove_positions(std::int32_t seq, std::int32_t lo, std::int32_t hi) {
    const std::int32_t len = this->length(seq);
    if (lo >= hi) return len;
    if (hi < len) return Errc::unsupported_by_layout;
    truncate_rows(seq, lo);
    return lo;
  }
  Result<std::int32_t> copy_positions(std::int32_t, std::int32_t, std::int32_t, std::int32_t) {
    return Errc::unsupported_by_layout;  // rows cannot be shared, and dst's slot has no holes
  }
  template <class F>
  Result<std::int32_t> move_positions(std::int32_t, std::int32_t, std::int32_t, F&&) {
    return Errc::unsupported_by_layout;  // a moved position would need its row moved in the slot
  }

  void on_seq_created(std::int32_t) {}

  void clear_rows() {
    used_rows_ = 0;
    nonempty_.clear();
    if (!copies_.empty()) ++changes_epoch_;
    copies_.clear();  // every destination slot is gone
  }

  [[nodiscard]] std::int64_t occupied_end() const noexcept {
    const std::int32_t s = nonempty_.last();
    return s < 0 ? 0 : slot_begin(s) + this->length(s);
  }

  // Every layer reads the one pool (the window argument only names the layer's window).
  template <class F>
  void for_each_visible_row(std::int32_t, std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& f) const {
    for (std::int32_t p = lo; p <= hi; ++p) f(slot_begin(seq) + p);
  }
  [[nodiscard]] std::int64_t rows_of_window(std::int32_t) const noexcept { return capacity(); }
  [[nodiscard]] std::int64_t read_len_of_window(std::int32_t) const noexcept { return this->step().read_len; }
  [[nodiscard]] std::span<const std::int64_t> step_rows_of_window(std::int32_t) const noexcept { return this->step().rows; }
  [[nodiscard]] std::int32_t row_pos(std::int32_t, std::int64_t row) const noexcept {
    const auto s = static_cast<std::int32_t>(row / max_len());
    const auto p = static_cast<std::int32_t>(row % max_len());
    return this->is_live(s) && p < this->length(s) ? p : -1;
  }
  [[nodiscard]] bool row_owned_by(std::int32_t, std::int64_t row, std::int32_t seq) const noexcept {
    return row / max_len() == seq;
  }

  std::int64_t used_rows_ = 0;
  typename Base::Owners nonempty_{};  // sequences holding at least one row
  std::vector<RowCopy> copies_;       // fork copies not yet acknowledged
  std::uint64_t changes_epoch_ = 0;   // see changes_epoch()
};

}  // namespace cellkv
