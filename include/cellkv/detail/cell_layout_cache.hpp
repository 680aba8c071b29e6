// cellkv/detail/cell_layout_cache.hpp - CellCache for layout::cell (include cellkv/cell_cache.hpp).
//
// Per cell: pos (int32, -1 = free) and owners (SeqSet). Per sequence: the cell of each position
// (positions are [0, pos(s)), so a vector indexed by position). Free cells are a two-level bitmap,
// so placement and every verb cost time proportional to the tokens or rows they touch.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/cell_cache.hpp"
#include "cellkv/detail/bitmap.hpp"
#include "cellkv/detail/cache_common.hpp"

namespace cellkv {

template <WindowSet W, Placement P, std::int32_t MaxSeqs>
class CellCache<layout::cell, W, P, MaxSeqs>
    : public detail::CacheCommon<CellCache<layout::cell, W, P, MaxSeqs>, W, MaxSeqs> {
  using Base = detail::CacheCommon<CellCache, W, MaxSeqs>;
  friend Base;

 public:
  using Layout = layout::cell;
  using PlacementPolicy = P;
  using typename Base::Owners;

  // Throws std::invalid_argument when validate(config) refuses it.
  explicit CellCache(const CacheConfig& config) : Base(config) {
    const std::int32_t n = this->config().max_cells;
    cell_pos_.assign(static_cast<std::size_t>(n), -1);
    owners_.assign(static_cast<std::size_t>(n), Owners{});
    free_.assign(n, true);
    used_.assign(n, false);
    free_count_ = n;
    seq_cells_.assign(static_cast<std::size_t>(MaxSeqs), {});
    changed_flag_.assign(static_cast<std::size_t>(n), 0);
    if constexpr (kIsClustered<P>) {
      block_used_.assign(static_cast<std::size_t>(n / kBlock), 0);
      free_blocks_.assign(n / kBlock, true);
      open_block_.fill(-1);
    }
  }

  [[nodiscard]] std::int64_t capacity() const noexcept { return this->config().max_cells; }
  [[nodiscard]] std::int64_t free_cells() const noexcept { return free_count_; }

  // Cell metadata: position (-1 when free) and owners.
  [[nodiscard]] std::int32_t cell_pos(std::int32_t c) const noexcept { return cell_pos_[static_cast<std::size_t>(c)]; }
  [[nodiscard]] const Owners& cell_owners(std::int32_t c) const noexcept { return owners_[static_cast<std::size_t>(c)]; }
  // Cell holding position p of a live sequence; precondition p < pos(seq).
  [[nodiscard]] std::int32_t cell_of(std::int32_t seq, std::int32_t p) const noexcept {
    return seq_cells_[static_cast<std::size_t>(seq)][static_cast<std::size_t>(p)];
  }

  // Cells whose metadata changed since the last acknowledge_changes(), each listed once.
  [[nodiscard]] PendingChanges pending_changes() const noexcept { return {changed_, {}}; }
  void acknowledge_changes() noexcept {
    for (const std::int32_t c : changed_) changed_flag_[static_cast<std::size_t>(c)] = 0;
    changed_.clear();
  }

  friend bool operator==(const CellCache&, const CellCache&) = default;

 private:
  static constexpr std::int32_t block_size() noexcept {
    if constexpr (kIsClustered<P>) return P::kBlock; else return 1;
  }
  static constexpr std::int32_t kBlock = block_size();

  static Status validate_rows(const CacheConfig& c) { return c.max_cells >= 1 ? Status{} : Status{Errc::bad_argument}; }

  // ---- hooks for CacheCommon ----
  Status room_for_step(std::span<const std::int32_t> seqs, std::span<const std::int32_t>) const {
    return static_cast<std::int64_t>(seqs.size()) <= free_count_ ? Status{} : Status{Errc::out_of_cells};
  }

  std::int64_t claim_row(std::int32_t seq, std::int32_t pos) {
    const std::int32_t c = choose_cell(seq);
    free_.reset(c);
    used_.set(c);
    --free_count_;
    cell_pos_[static_cast<std::size_t>(c)] = pos;
    owners_[static_cast<std::size_t>(c)].set(seq);
    seq_cells_[static_cast<std::size_t>(seq)].push_back(c);
    note_block_use(c, +1);
    mark_changed(c);
    return c;
  }

  void truncate_rows(std::int32_t seq, std::int32_t keep) {
    auto& cells = seq_cells_[static_cast<std::size_t>(seq)];
    for (auto p = cells.size(); p-- > static_cast<std::size_t>(keep);) release(cells[p], seq);
    cells.resize(static_cast<std::size_t>(keep));
    if constexpr (kIsClustered<P>) open_block_[static_cast<std::size_t>(seq)] = keep == 0 ? -1 : cells.back() / kBlock;
  }

  void share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    const auto& from = seq_cells_[static_cast<std::size_t>(src)];
    auto& to = seq_cells_[static_cast<std::size_t>(dst)];
    to.assign(from.begin(), from.begin() + upto);
    for (const std::int32_t c : to) {
      owners_[static_cast<std::size_t>(c)].set(dst);
      mark_changed(c);
    }
  }

  void on_seq_created(std::int32_t seq) {
    seq_cells_[static_cast<std::size_t>(seq)].clear();
    if constexpr (kIsClustered<P>) open_block_[static_cast<std::size_t>(seq)] = -1;
  }

  void clear_rows() {
    this->live_sequences().for_each([&](std::int32_t s) { truncate_rows(s, 0); });
  }

  [[nodiscard]] std::int64_t occupied_end() const noexcept { return used_.find_last() + 1; }

  template <class F>
  void for_each_visible_row(std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& f) const {
    const auto& cells = seq_cells_[static_cast<std::size_t>(seq)];
    for (std::int32_t p = lo; p <= hi; ++p) f(static_cast<std::int64_t>(cells[static_cast<std::size_t>(p)]));
  }
  [[nodiscard]] std::int32_t row_pos(std::int64_t row) const noexcept { return cell_pos_[static_cast<std::size_t>(row)]; }
  [[nodiscard]] bool row_owned_by(std::int64_t row, std::int32_t seq) const noexcept {
    return owners_[static_cast<std::size_t>(row)].test(seq);
  }

  // ---- placement ----
  std::int32_t choose_cell(std::int32_t seq) {
    if constexpr (kIsClustered<P>) {
      auto& open = open_block_[static_cast<std::size_t>(seq)];
      if (open >= 0) {
        const std::int64_t c = free_.find_first(static_cast<std::int64_t>(open) * kBlock);
        if (c >= 0 && c < static_cast<std::int64_t>(open + 1) * kBlock) return static_cast<std::int32_t>(c);
      }
      if (const std::int64_t b = free_blocks_.find_first(0); b >= 0) {
        open = static_cast<std::int32_t>(b);
        return open * kBlock;
      }
      const std::int32_t c = lowest_free_cell();  // fallback: any free cell
      open = c / kBlock;
      return c;
    } else {
      (void)seq;
      return lowest_free_cell();
    }
  }

  // Lowest free cell; precondition: one exists. No cell below free_hint_ is free, so a run of
  // claims scans each word once.
  std::int32_t lowest_free_cell() {
    const auto c = static_cast<std::int32_t>(free_.find_first(free_hint_));
    free_hint_ = c + 1;
    return c;
  }

  // The last owner letting go frees the cell.
  void release(std::int32_t c, std::int32_t seq) {
    auto& owners = owners_[static_cast<std::size_t>(c)];
    owners.reset(seq);
    mark_changed(c);
    if (!owners.empty()) return;
    cell_pos_[static_cast<std::size_t>(c)] = -1;
    free_.set(c);
    free_hint_ = std::min(free_hint_, c);
    used_.reset(c);
    ++free_count_;
    note_block_use(c, -1);
  }

  void note_block_use(std::int32_t c, std::int32_t delta) {
    if constexpr (kIsClustered<P>) {
      const std::int32_t b = c / kBlock;
      if (b >= static_cast<std::int32_t>(block_used_.size())) return;  // the partial tail block
      auto& used = block_used_[static_cast<std::size_t>(b)];
      if (used == 0) free_blocks_.reset(b);
      used += delta;
      if (used == 0) free_blocks_.set(b);
    } else {
      (void)c, (void)delta;
    }
  }

  void mark_changed(std::int32_t c) {
    auto& flag = changed_flag_[static_cast<std::size_t>(c)];
    if (flag) return;
    flag = 1;
    changed_.push_back(c);
  }

  std::vector<std::int32_t> cell_pos_;                // [max_cells] position, -1 = free
  std::vector<Owners> owners_;                        // [max_cells]
  detail::Bitmap free_;                               // bit c = cell c is free
  detail::Bitmap used_;                               // complement of free_, for read_len
  std::int64_t free_count_ = 0;
  std::int32_t free_hint_ = 0;                        // no free cell below it
  std::vector<std::vector<std::int32_t>> seq_cells_;  // [MaxSeqs][position] -> cell
  std::vector<std::int32_t> changed_;                 // cells changed since the last acknowledge
  std::vector<std::uint8_t> changed_flag_;            // [max_cells] 1 when listed in changed_
  // clustered<B> only: used cells per full block, fully free blocks, each sequence's open block
  std::vector<std::int32_t> block_used_;
  detail::Bitmap free_blocks_;
  std::array<std::int32_t, static_cast<std::size_t>(MaxSeqs)> open_block_{};
};

}  // namespace cellkv
