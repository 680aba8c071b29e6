// cellkv/detail/cell_layout_cache.hpp - KVCache for layout::cell (include cellkv/kv_cache.hpp).
//
// The cache keeps its cells in pools (detail/cell_pool.hpp: per cell its position and owners, per
// sequence a PositionTable of its cells by position, the free cells and the placement's state).
// The main pool serves every layer, or, with window storage (CacheConfig::window_cells > 0), the
// full-attention layers; then each distinct nonzero window W of the set has a pool of its own,
// which keeps only the positions its queries can still see:
//
//   - every step places each token once per pool (StepPlan::rows, StepPlan::window_rows);
//   - before placing, a sequence of the step lets go of its window-pool pages (64 positions) that
//     lie wholly below keep_from(W, pos(s)) = max(0, min(pos(s) - W + 1, pos(s) - 1)): the first
//     position its next token sees (and its last position, which a pool always keeps);
//   - after a fork or an edit, the new or edited sequence lets go of such pages as well (a copy
//     or fork can hand it cells below what it sees), so a sequence holds at most about
//     W + 64 + (its tokens in a step) cells of pool W;
//   - a verb or edit whose result would need a position some window pool let go of is refused
//     with window_evicted (a rewind below the window, a fork at an old position, a shift that
//     brings evicted positions back into view); a step a window pool has no room for is refused
//     with out_of_window_cells.
//
// Invariant: a window pool holds a subset of the main pool's positions of each sequence, among them
// every position in [keep_from(W, pos(s)), pos(s)) the main pool holds, so both tables have the
// same lengths. Edits are planned on every pool first and committed only when all accept; the
// refusal reported is the main pool's, else the first window pool's (in kWindowed order), each
// pool's resources before its window_evicted check.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/detail/cache_common.hpp"
#include "cellkv/detail/cell_pool.hpp"
#include "cellkv/position_table.hpp"

namespace cellkv {

template <WindowSet W, Placement P, std::int32_t MaxSeqs>
class KVCache<layout::cell, W, P, MaxSeqs>
    : public detail::CacheCommon<KVCache<layout::cell, W, P, MaxSeqs>, W, MaxSeqs> {
  using Base = detail::CacheCommon<KVCache, W, MaxSeqs>;
  friend Base;

 public:
  using Layout = layout::cell;
  using PlacementPolicy = P;
  using typename Base::Owners;
  using Pool = detail::CellPool<P, MaxSeqs>;

  // Throws std::invalid_argument when validate(config) refuses it, std::bad_alloc when host memory
  // runs out (fits_within(config, budget) checks that first).
  explicit KVCache(const CacheConfig& config)
      : Base(config), main_(this->config().max_cells, this->config().max_seqs, this->config().max_cells) {
    const CacheConfig& c = this->config();
    if (c.window_cells > 0) {
      windows_.reserve(W::kWindowed.size());  // no reallocation: layout_host_bytes counts each pool once
      for ([[maybe_unused]] const std::int32_t w : W::kWindowed)
        windows_.emplace_back(c.window_cells, c.max_seqs, c.max_cells);
    }
    step_window_rows_.assign(windows_.size() * static_cast<std::size_t>(c.max_write), 0);
    window_read_len_.assign(windows_.size(), 0);
  }

  // ---- the main pool (every layer's, or the full-attention layers' with window storage) ----
  [[nodiscard]] std::int64_t capacity() const noexcept { return main_.capacity(); }
  [[nodiscard]] std::int64_t free_cells() const noexcept { return main_.free_cells(); }

  // Cell metadata: position (-1 when free) and owners.
  [[nodiscard]] std::int32_t cell_pos(std::int32_t c) const noexcept { return main_.cell_pos(c); }
  [[nodiscard]] const Owners& cell_owners(std::int32_t c) const noexcept { return main_.cell_owners(c); }
  // Cell holding position p of a live sequence, -1 for a hole; precondition p < pos(seq).
  [[nodiscard]] std::int32_t cell_of(std::int32_t seq, std::int32_t p) const noexcept { return main_.cell_of(seq, p); }
  // Every live sequence's cells by position (the table the device keeps a copy of).
  [[nodiscard]] const PositionTable& table() const noexcept { return main_.table(); }

  // The placement policy and its state for sequence id s (meaningful while s is live).
  [[nodiscard]] const P& placement() const noexcept { return main_.placement(); }
  [[nodiscard]] const typename P::SeqState& placement_state(std::int32_t s) const noexcept {
    return main_.placement_state(s);
  }

  // Positions a sequence can reach: [0, position_limit()), 64 * ceil(max_cells / 64) (a sequence's
  // span in the position table). Only holes let a sequence's length pass its cell count.
  [[nodiscard]] std::int32_t position_limit() const noexcept { return main_.position_limit(); }

  // Since the last acknowledge_changes(): position-table entries written (each listed once), the
  // copy-on-write copies of seq_add / seq_div (in order) and the K rows to re-rotate after them.
  // The main pool's; a window pool's are pool(w).pending_changes().
  [[nodiscard]] PendingChanges pending_changes() const noexcept { return main_.pending_changes(); }
  void acknowledge_changes() noexcept {
    main_.acknowledge_changes();
    for (Pool& w : windows_) w.acknowledge_changes();
  }
  // Changes whenever any pool's pending copies or rotations change (and at every
  // acknowledge_changes), so a device that applied them can tell whether it holds the current ones.
  [[nodiscard]] std::uint64_t changes_epoch() const noexcept {
    std::uint64_t e = main_.changes_epoch();
    for (const Pool& w : windows_) e += w.changes_epoch();
    return e;
  }

  // ---- window storage ----
  // While on, window pools keep the pages of cells whose K re-rotation is pending instead of
  // letting them go below the window (CellPool::keep_pending_pages): a drop then changes no pending
  // change. A device cache turns it on for declare_step and seq_cp while a device holds part of
  // the pending changes (a failed upload it resumes); off by default.
  void keep_pending_pages(bool on) noexcept {
    for (Pool& w : windows_) w.keep_pending_pages(on);
  }
  // Whether windowed layers keep their own pools (CacheConfig::window_cells > 0).
  [[nodiscard]] bool window_storage() const noexcept { return !windows_.empty(); }
  // The pool the layers of window `window` read and write: its own with window storage and
  // window > 0, else the main pool. Precondition: window is 0 or a window of the set.
  [[nodiscard]] const Pool& pool(std::int32_t window) const noexcept {
    const std::int32_t i = W::windowed_index(window);
    return i >= 0 && window_storage() ? windows_[static_cast<std::size_t>(i)] : main_;
  }

  friend bool operator==(const KVCache&, const KVCache&) = default;

 private:
  // max_cells >= 1 and window_cells either 0 or in [max_write, max_cells] on a set with a nonzero
  // window (bad_argument); the position tables' flat arrays indexable by int32 (size_overflow). `c` has
  // max_seqs filled in.
  static Status validate_rows(const CacheConfig& c) {
    if (c.max_cells < 1 || c.window_cells < 0) return Errc::bad_argument;
    if (c.window_cells > 0 && (W::kWindowedCount == 0 || c.window_cells < c.max_write || c.window_cells > c.max_cells))
      return Errc::bad_argument;
    if (PositionTable::flat_size(c.max_seqs, c.max_cells) > detail::kInt32Max) return Errc::size_overflow;
    const bool windows_fit =
        c.window_cells == 0 || PositionTable::flat_size(c.max_seqs, c.window_cells, c.max_cells) <= detail::kInt32Max;
    return windows_fit ? Status{} : Status{Errc::size_overflow};
  }
  // The main pool's allocations (CellPool::host_bytes; the object is in the cache's) and each window
  // pool's, its object too (held in windows_), and the window pools' step rows. `c` passed
  // validate_rows.
  static std::size_t layout_host_bytes(const CacheConfig& c) {
    std::size_t bytes = Pool::host_bytes(c.max_cells, c.max_seqs, c.max_cells);
    if (c.window_cells > 0)
      bytes += static_cast<std::size_t>(W::kWindowedCount) *
               (sizeof(Pool) + Pool::host_bytes(c.window_cells, c.max_seqs, c.max_cells) +
                static_cast<std::size_t>(c.max_write) * 8 + 8);
    return bytes;
  }

  // First position a query at position `len` (the next token) sees through window w, or the
  // sequence's last position if earlier: a window pool keeps every held position from there on.
  static std::int32_t keep_from(std::int32_t w, std::int32_t len) noexcept {
    return std::max(0, std::min(len - w + 1, len - 1));
  }
  [[nodiscard]] static std::int32_t window_of(std::size_t i) noexcept { return W::kWindowed[i]; }

  // Whether, for a sequence of length len, window pool i keeps what the main pool holds:
  // main_cell(p) >= 0 implies window_cell(p) >= 0 for p in [keep_from(w_i, len), len).
  template <class MainCell, class WindowCell>
  static bool keeps_window(std::size_t i, std::int32_t len, MainCell&& main_cell, WindowCell&& window_cell) {
    for (std::int32_t p = keep_from(window_of(i), len); p < len; ++p)
      if (main_cell(p) >= 0 && window_cell(p) < 0) return false;
    return true;
  }

  // ---- hooks for CacheCommon ----
  // Every pool: cells for every token (a window pool counting the cells this step's drops free),
  // every sequence's positions within position_limit(), pages for the positions that start a page.
  Status room_for_step(std::span<const std::int32_t> seqs, std::span<const std::int32_t> count) const {
    if (const Status s = main_.room_for_step(seqs, count, 0); !s.ok()) return s;
    for (std::size_t i = 0; i < windows_.size(); ++i) {
      const Pool& w = windows_[i];
      const std::int64_t credit = w.freed_by_drops(seqs, [&](std::int32_t s) { return drop_end(i, s); });
      const Status s = w.room_for_step(seqs, count, credit);
      if (!s.ok()) return s.code() == Errc::out_of_cells ? Status{Errc::out_of_window_cells} : s;
    }
    return {};
  }
  // Window pool i drops sequence s's pages below this one before s's next token.
  [[nodiscard]] std::int32_t drop_end(std::size_t i, std::int32_t s) const noexcept {
    return keep_from(window_of(i), this->length(s)) / kPagePositions;
  }

  // Before the step's tokens are placed (admission passed): each window pool drops the pages of
  // the step's sequences that their tokens cannot see.
  void before_placement(std::span<const std::int32_t> seqs) {
    placing_tokens_ = static_cast<std::int32_t>(seqs.size());
    for (std::size_t i = 0; i < windows_.size(); ++i)
      for (const std::int32_t s : seqs) windows_[i].drop_below(s, drop_end(i, s));
  }

  // Token t of the step: a cell in every pool (window pool i's goes to window_rows[i T + t]).
  std::int64_t claim_row(std::int32_t t, std::int32_t seq, std::int32_t pos) {
    const auto T = static_cast<std::size_t>(placing_tokens_);
    for (std::size_t i = 0; i < windows_.size(); ++i)
      step_window_rows_[i * T + static_cast<std::size_t>(t)] = windows_[i].append(seq, pos);
    return main_.append(seq, pos);
  }

  void after_placement() {
    for (std::size_t i = 0; i < windows_.size(); ++i) window_read_len_[i] = windows_[i].occupied_end();
  }
  [[nodiscard]] std::span<const std::int64_t> window_rows(std::int32_t tokens) const noexcept {
    return {step_window_rows_.data(), windows_.size() * static_cast<std::size_t>(tokens)};
  }
  [[nodiscard]] std::span<const std::int64_t> window_read_lens() const noexcept { return window_read_len_; }

  // Used with keep == 0 only (seq_rm(id), clear).
  void truncate_rows(std::int32_t seq, std::int32_t) {
    main_.remove_all(seq);
    for (Pool& w : windows_) w.remove_all(seq);
  }

  // A fork needs its pages in every pool, and every window pool must still hold what the fork's
  // next token sees.
  Status room_for_clone(std::int32_t src, std::int32_t upto) const {
    if (const Status s = main_.room_for_clone(src, upto); !s.ok()) return s;
    const std::int32_t len = main_.fork_length(src, upto);
    for (std::size_t i = 0; i < windows_.size(); ++i) {
      const auto main_cell = [&](std::int32_t p) { return main_.held_cell(src, p); };
      const auto window_cell = [&](std::int32_t p) { return windows_[i].held_cell(src, p); };
      if (const Status s = windows_[i].room_for_clone(src, upto); !s.ok()) return s;
      if (!keeps_window(i, len, main_cell, window_cell)) return Errc::window_evicted;
    }
    return {};
  }
  std::int32_t share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    for (Pool& w : windows_) w.share_prefix(src, dst, upto);
    const std::int32_t len = main_.share_prefix(src, dst, upto);
    drop_unseen(dst, len);
    return len;
  }
  // After a fork or an edit, seq (now of length len) lets go of the window-pool pages its next token
  // cannot see, as a step would: a sequence never holds a page wholly below keep_from.
  void drop_unseen(std::int32_t seq, std::int32_t len) {
    for (std::size_t i = 0; i < windows_.size(); ++i)
      windows_[i].drop_below(seq, keep_from(window_of(i), len) / kPagePositions);
  }

  // ---- sequence edits ----
  static constexpr bool kHoles = true;
  using Edit = typename Pool::Edit;

  // The positions of a restored sequence that window pool i keeps: from the page of keep_from on.
  [[nodiscard]] static std::span<const std::int32_t> window_tail(std::size_t i, std::span<const std::int32_t> positions) {
    const std::int32_t len = positions.empty() ? 0 : positions.back() + 1;
    const std::int32_t from = keep_from(window_of(i), len) / kPagePositions * kPagePositions;
    const auto first = std::lower_bound(positions.begin(), positions.end(), from);
    return positions.subspan(static_cast<std::size_t>(first - positions.begin()));
  }
  Status room_for_restore(std::span<const std::int32_t> positions) const {
    if (const Status s = main_.room_for_restore(positions); !s.ok()) return s;
    for (std::size_t i = 0; i < windows_.size(); ++i) {
      const Status s = windows_[i].room_for_restore(window_tail(i, positions));
      if (!s.ok()) return s.code() == Errc::out_of_cells ? Status{Errc::out_of_window_cells} : s;
    }
    return {};
  }
  void restore_rows(std::int32_t seq, std::span<const std::int32_t> positions) {
    const std::int32_t len = positions.empty() ? 0 : positions.back() + 1;
    main_.restore(seq, positions, len);
    for (std::size_t i = 0; i < windows_.size(); ++i) windows_[i].restore(seq, window_tail(i, positions), len);
  }
  [[nodiscard]] std::int64_t row_at(std::int32_t seq, std::int32_t pos) const { return main_.cell_of(seq, pos); }
  template <class F>
  void for_each_held(std::int32_t seq, F&& f) const {
    main_.table().for_each_position(seq, 0, main_.table().length(seq),
                                    [&](std::int32_t p, std::int32_t c) { f(p, std::int64_t{c}); });
  }
  [[nodiscard]] std::int32_t first_position(std::int32_t seq) const { return main_.table().first_held(seq); }

  // Plans `plan(pool)` on every pool, refuses (changing nothing) when one refuses or a window pool
  // would miss a position the edited sequence's next token sees, else commits all; returns the
  // edited sequence's new length.
  template <class Plan>
  Result<std::int32_t> edit_all(Plan&& plan) {
    Result<Edit> m = plan(main_);
    if (!m.ok()) return m.status().code();
    std::vector<Edit> edits;
    for (std::size_t i = 0; i < windows_.size(); ++i) {
      Result<Edit> e = plan(windows_[i]);
      if (!e.ok()) return e.status().code() == Errc::out_of_cells ? Errc::out_of_window_cells : e.status().code();
      const std::int32_t from = keep_from(window_of(i), m.value().new_len);
      const std::vector<std::int32_t> main_cells = main_.cells_after(m.value(), from);
      const std::vector<std::int32_t> window_cells = windows_[i].cells_after(e.value(), from);
      const auto at = [from](const std::vector<std::int32_t>& v, std::int32_t p) {
        const auto k = static_cast<std::size_t>(p - from);
        return k < v.size() ? v[k] : -1;
      };
      const auto main_cell = [&](std::int32_t p) { return at(main_cells, p); };
      const auto window_cell = [&](std::int32_t p) { return at(window_cells, p); };
      if (!keeps_window(i, m.value().new_len, main_cell, window_cell)) return Errc::window_evicted;
      edits.push_back(std::move(e.value()));
    }
    main_.commit(m.value());
    for (std::size_t i = 0; i < windows_.size(); ++i) windows_[i].commit(edits[i]);
    drop_unseen(m.value().seq, m.value().new_len);
    return m.value().new_len;
  }

  Result<std::int32_t> remove_positions(std::int32_t seq, std::int32_t lo, std::int32_t hi) {
    return edit_all([&](const Pool& p) { return p.plan_remove(seq, lo, hi); });
  }
  Result<std::int32_t> copy_positions(std::int32_t src, std::int32_t dst, std::int32_t lo, std::int32_t hi) {
    return edit_all([&](const Pool& p) { return p.plan_copy(src, dst, lo, hi); });
  }
  // Moves the held positions p in [lo, hi) to to(p); below 0 leaves the sequence.
  template <class F>
  Result<std::int32_t> move_positions(std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& to) {
    return edit_all([&](const Pool& p) { return p.plan_move(seq, lo, hi, to); });
  }

  void on_seq_created(std::int32_t seq) {
    main_.on_seq_created(seq);
    for (Pool& w : windows_) w.on_seq_created(seq);
  }

  void clear_rows() {
    main_.clear(this->live_sequences());
    for (Pool& w : windows_) w.clear(this->live_sequences());
  }

  [[nodiscard]] std::int64_t occupied_end() const noexcept { return main_.occupied_end(); }

  // Visibility through a layer of window `window`: the rows of that window's pool.
  template <class F>
  void for_each_visible_row(std::int32_t window, std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& f) const {
    pool(window).for_each_visible_row(seq, lo, hi, f);
  }
  [[nodiscard]] std::int32_t row_pos(std::int32_t window, std::int64_t row) const noexcept {
    return pool(window).row_pos(row);
  }
  [[nodiscard]] bool row_owned_by(std::int32_t window, std::int64_t row, std::int32_t seq) const noexcept {
    return pool(window).row_owned_by(row, seq);
  }
  [[nodiscard]] std::int64_t rows_of_window(std::int32_t window) const noexcept { return pool(window).capacity(); }
  [[nodiscard]] std::int64_t read_len_of_window(std::int32_t window) const noexcept {
    const std::int32_t i = W::windowed_index(window);
    return i >= 0 && window_storage() ? window_read_len_[static_cast<std::size_t>(i)] : this->step().read_len;
  }
  [[nodiscard]] std::span<const std::int64_t> step_rows_of_window(std::int32_t window) const noexcept {
    const std::int32_t i = W::windowed_index(window);
    const StepPlan plan = this->step();
    if (i < 0 || !window_storage()) return plan.rows;
    return plan.window_rows.subspan(static_cast<std::size_t>(i) * static_cast<std::size_t>(plan.tokens),
                                    static_cast<std::size_t>(plan.tokens));
  }

  Pool main_;
  std::vector<Pool> windows_;                      // [W::kWindowedCount] with window storage, else empty
  std::vector<std::int64_t> step_window_rows_;     // [window pools][T] the placed step's rows (max_write x pools)
  std::vector<std::int64_t> window_read_len_;      // [window pools] the placed step's read_len per pool
  std::int32_t placing_tokens_ = 0;                // T of the step being placed
};

}  // namespace cellkv
