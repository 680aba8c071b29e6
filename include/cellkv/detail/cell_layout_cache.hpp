// cellkv/detail/cell_layout_cache.hpp - KVCache for layout::cell (include cellkv/kv_cache.hpp).
//
// Per cell: pos (int32, -1 = free) and owners (SeqSet). Per sequence: the cell of each position, in
// a PositionTable (pages of positions shared between forks; the device keeps a copy of it, which
// the attention kernels read). Free cells are a two-level bitmap, so placement and every verb cost
// time proportional to the tokens or rows they touch. Which free cell a token claims is the
// placement policy's choice (P::pick, placement.hpp); the cache tells the policy of every freed
// cell and every truncated sequence, and never branches on which policy it holds.
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/detail/bitmap.hpp"
#include "cellkv/detail/cache_common.hpp"
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

  // Throws std::invalid_argument when validate(config) refuses it, std::bad_alloc when host memory
  // runs out (fits_within(config, budget) checks that first).
  explicit KVCache(const CacheConfig& config) : Base(config), placement_(this->config().max_cells) {
    const std::int32_t n = this->config().max_cells;
    cell_pos_.assign(static_cast<std::size_t>(n), -1);
    owners_.assign(static_cast<std::size_t>(n), Owners{});
    free_.assign(n, true);
    used_.assign(n, false);
    free_count_ = n;
    table_ = PositionTable(this->config().max_seqs, n);
  }

  [[nodiscard]] std::int64_t capacity() const noexcept { return this->config().max_cells; }
  [[nodiscard]] std::int64_t free_cells() const noexcept { return free_count_; }

  // Cell metadata: position (-1 when free) and owners.
  [[nodiscard]] std::int32_t cell_pos(std::int32_t c) const noexcept { return cell_pos_[static_cast<std::size_t>(c)]; }
  [[nodiscard]] const Owners& cell_owners(std::int32_t c) const noexcept { return owners_[static_cast<std::size_t>(c)]; }
  // Cell holding position p of a live sequence; precondition p < pos(seq).
  [[nodiscard]] std::int32_t cell_of(std::int32_t seq, std::int32_t p) const noexcept { return table_.cell(seq, p); }
  // Every live sequence's cells by position (the table the device keeps a copy of).
  [[nodiscard]] const PositionTable& table() const noexcept { return table_; }

  // The placement policy and its state for sequence id s (meaningful while s is live).
  [[nodiscard]] const P& placement() const noexcept { return placement_; }
  [[nodiscard]] const typename P::SeqState& placement_state(std::int32_t s) const noexcept {
    return seq_state_[static_cast<std::size_t>(s)];
  }

  // Position-table entries written since the last acknowledge_changes(), each listed once.
  [[nodiscard]] PendingChanges pending_changes() const noexcept { return {{}, {table_.changed(), table_.flat()}}; }
  void acknowledge_changes() noexcept { table_.acknowledge(); }

  friend bool operator==(const KVCache&, const KVCache&) = default;

 private:
  // max_cells >= 1 (bad_argument), and the position table's flat array indexable by int32
  // (size_overflow). `c` has max_seqs filled in.
  static Status validate_rows(const CacheConfig& c) {
    if (c.max_cells < 1) return Errc::bad_argument;
    return PositionTable::flat_size(c.max_seqs, c.max_cells) <= detail::kInt32Max ? Status{} : Status{Errc::size_overflow};
  }
  // Per cell: position, owners, two bitmap bits; the position table at its fullest; the placement's
  // own state (placement_host_bytes). `c` passed validate_rows.
  static std::size_t layout_host_bytes(const CacheConfig& c) {
    const auto n = static_cast<std::size_t>(c.max_cells);
    return n * (sizeof(std::int32_t) + sizeof(Owners)) + 2 * detail::Bitmap::bytes(c.max_cells) +
           static_cast<std::size_t>(PositionTable::host_bytes(c.max_seqs, c.max_cells)) +
           placement_host_bytes<P>(c.max_cells);
  }

  // ---- hooks for CacheCommon ----
  Status room_for_step(std::span<const std::int32_t> seqs, std::span<const std::int32_t>) const {
    return static_cast<std::int64_t>(seqs.size()) <= free_count_ ? Status{} : Status{Errc::out_of_cells};
  }

  std::int64_t claim_row(std::int32_t seq, std::int32_t pos) {
    const std::int32_t c = placement_.pick(state(seq), FreeCells(free_, free_hint_, free_count_));
    assert(c >= 0 && c < this->config().max_cells && free_.test(c) && "Placement::pick must return a free cell");
    free_.reset(c);
    used_.set(c);
    --free_count_;
    cell_pos_[static_cast<std::size_t>(c)] = pos;
    owners_[static_cast<std::size_t>(c)].set(seq);
    table_.append(seq, c);
    return c;
  }

  void truncate_rows(std::int32_t seq, std::int32_t keep) {
    table_.for_each_cell(seq, keep, table_.length(seq), [&](std::int32_t c) { release(c, seq); });
    table_.truncate(seq, keep);
    placement_.truncated(state(seq), keep == 0 ? -1 : table_.cell(seq, keep - 1));
  }

  void share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    table_.share_prefix(src, dst, upto);
    table_.for_each_cell(dst, 0, upto, [&](std::int32_t c) { owners_[static_cast<std::size_t>(c)].set(dst); });
  }

  void on_seq_created(std::int32_t seq) { state(seq) = typename P::SeqState{}; }

  void clear_rows() {
    this->live_sequences().for_each([&](std::int32_t s) { truncate_rows(s, 0); });
  }

  [[nodiscard]] std::int64_t occupied_end() const noexcept { return used_.find_last() + 1; }

  template <class F>
  void for_each_visible_row(std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& f) const {
    table_.for_each_cell(seq, lo, hi + 1, [&](std::int32_t c) { f(static_cast<std::int64_t>(c)); });
  }
  [[nodiscard]] std::int32_t row_pos(std::int64_t row) const noexcept { return cell_pos_[static_cast<std::size_t>(row)]; }
  [[nodiscard]] bool row_owned_by(std::int64_t row, std::int32_t seq) const noexcept {
    return owners_[static_cast<std::size_t>(row)].test(seq);
  }

  typename P::SeqState& state(std::int32_t seq) noexcept { return seq_state_[static_cast<std::size_t>(seq)]; }

  // The last owner letting go frees the cell; the placement hears of it.
  void release(std::int32_t c, std::int32_t seq) {
    auto& owners = owners_[static_cast<std::size_t>(c)];
    owners.reset(seq);
    if (!owners.empty()) return;
    cell_pos_[static_cast<std::size_t>(c)] = -1;
    free_.set(c);
    free_hint_ = std::min(free_hint_, c);
    used_.reset(c);
    ++free_count_;
    placement_.freed(c);
  }

  std::vector<std::int32_t> cell_pos_;                // [max_cells] position, -1 = free
  std::vector<Owners> owners_;                        // [max_cells]
  detail::Bitmap free_;                               // bit c = cell c is free
  detail::Bitmap used_;                               // complement of free_, for read_len
  std::int64_t free_count_ = 0;
  std::int32_t free_hint_ = 0;                        // no free cell below it
  PositionTable table_;                               // [sequence][position] -> cell
  P placement_;                                       // the policy's own state
  std::array<typename P::SeqState, static_cast<std::size_t>(MaxSeqs)> seq_state_{};  // [MaxSeqs]
};

}  // namespace cellkv
