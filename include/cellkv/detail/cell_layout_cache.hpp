// cellkv/detail/cell_layout_cache.hpp - KVCache for layout::cell (include cellkv/kv_cache.hpp).
//
// Per cell: pos (int32, -1 = free) and owners (SeqSet). Per sequence: the cell of each position, in
// a PositionTable (pages of positions shared between forks; the device keeps a copy of it, which
// the attention kernels read). Free cells are a two-level bitmap, so placement and every verb cost
// time proportional to the tokens or rows they touch. Which free cell a token claims is the
// placement policy's choice (P::pick, placement.hpp); the cache tells the policy of every freed
// cell and where a sequence ends after every rewind or edit, and never branches on which policy
// it holds.
//
// Edits (docs/design.md section 4, "Sequence edits"): seq_rm of a range leaves holes (table
// entries -1); seq_cp adds owners (zero copy); seq_add / seq_div move cells, copying a shared one
// for the moved sequence (a fresh cell picked by the placement, a RowCopy of one row) and listing
// every moved cell's K re-rotation (RowRotation: the position its K encodes -> its position now).
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
    rotation_at_.assign(static_cast<std::size_t>(n), -1);
  }

  [[nodiscard]] std::int64_t capacity() const noexcept { return this->config().max_cells; }
  [[nodiscard]] std::int64_t free_cells() const noexcept { return free_count_; }

  // Cell metadata: position (-1 when free) and owners.
  [[nodiscard]] std::int32_t cell_pos(std::int32_t c) const noexcept { return cell_pos_[static_cast<std::size_t>(c)]; }
  [[nodiscard]] const Owners& cell_owners(std::int32_t c) const noexcept { return owners_[static_cast<std::size_t>(c)]; }
  // Cell holding position p of a live sequence, -1 for a hole; precondition p < pos(seq).
  [[nodiscard]] std::int32_t cell_of(std::int32_t seq, std::int32_t p) const noexcept { return table_.cell(seq, p); }
  // Every live sequence's cells by position (the table the device keeps a copy of).
  [[nodiscard]] const PositionTable& table() const noexcept { return table_; }

  // The placement policy and its state for sequence id s (meaningful while s is live).
  [[nodiscard]] const P& placement() const noexcept { return placement_; }
  [[nodiscard]] const typename P::SeqState& placement_state(std::int32_t s) const noexcept {
    return seq_state_[static_cast<std::size_t>(s)];
  }

  // Positions a sequence can reach: [0, position_limit()), 64 * ceil(max_cells / 64) (a sequence's
  // span in the position table). Only holes let a sequence's length pass its cell count.
  [[nodiscard]] std::int32_t position_limit() const noexcept { return table_.position_limit(); }

  // Since the last acknowledge_changes(): position-table entries written (each listed once), the
  // copy-on-write copies of seq_add / seq_div (in order) and the K rows to re-rotate after them.
  [[nodiscard]] PendingChanges pending_changes() const noexcept {
    return {copies_, {table_.changed(), table_.flat()}, rotations_};
  }
  void acknowledge_changes() noexcept {
    table_.acknowledge();
    copies_.clear();
    for (const RowRotation& r : rotations_) rotation_at_[static_cast<std::size_t>(r.cell)] = -1;
    rotations_.clear();
    ++changes_epoch_;
  }
  // Changes whenever the pending copies or rotations change (and at every acknowledge_changes), so
  // a device that applied them can tell whether it holds the current ones.
  [[nodiscard]] std::uint64_t changes_epoch() const noexcept { return changes_epoch_; }

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
    // Per cell also its rotation index and at most one pending rotation; the pending copy-on-write
    // copies are not counted (they grow with the edits until acknowledged, as fork copies do).
    return n * (2 * sizeof(std::int32_t) + sizeof(Owners) + sizeof(RowRotation)) + 2 * detail::Bitmap::bytes(c.max_cells) +
           static_cast<std::size_t>(PositionTable::host_bytes(c.max_seqs, c.max_cells)) +
           placement_host_bytes<P>(c.max_cells);
  }

  // ---- hooks for CacheCommon ----
  // Cells for every token; then every sequence's positions within position_limit(); then pages
  // for the positions that start a page.
  Status room_for_step(std::span<const std::int32_t> seqs, std::span<const std::int32_t> count) const {
    if (static_cast<std::int64_t>(seqs.size()) > free_count_) return Errc::out_of_cells;
    std::int64_t pages = 0;
    Owners seen{};
    for (const std::int32_t s : seqs) {
      if (seen.test(s)) continue;
      seen.set(s);
      const std::int32_t len = this->length(s), n = count[static_cast<std::size_t>(s)];
      if (static_cast<std::int64_t>(len) + n > position_limit()) return Errc::sequence_full;
      pages += PositionTable::pages_for(len + n) - PositionTable::pages_for(len);
    }
    return pages <= table_.free_pages() ? Status{} : Status{Errc::out_of_pages};
  }

  std::int64_t claim_row(std::int32_t seq, std::int32_t pos) {
    const std::int32_t c = claim(seq, pos);
    table_.append(seq, c);
    return c;
  }

  // A free cell, picked by the placement, now at position pos of seq alone.
  std::int32_t claim(std::int32_t seq, std::int32_t pos) {
    const std::int32_t c = placement_.pick(state(seq), FreeCells(free_, free_hint_, free_count_));
    assert(c >= 0 && c < this->config().max_cells && free_.test(c) && "Placement::pick must return a free cell");
    free_.reset(c);
    used_.set(c);
    --free_count_;
    cell_pos_[static_cast<std::size_t>(c)] = pos;
    owners_[static_cast<std::size_t>(c)].set(seq);
    return c;
  }

  // Used with keep == 0 only (seq_rm(id), clear): needs no page.
  void truncate_rows(std::int32_t seq, std::int32_t keep) {
    table_.for_each_cell(seq, keep, table_.length(seq), [&](std::int32_t c) { release(c, seq); });
    table_.truncate(seq, keep);
    ends_at(seq);
  }

  // The fork's length: one past src's highest held position below upto. Its partial last page is
  // a copy, so it needs a free page.
  [[nodiscard]] std::int32_t fork_length(std::int32_t src, std::int32_t upto) const {
    return table_.last_below(src, upto) + 1;
  }
  Status room_for_clone(std::int32_t src, std::int32_t upto) const {
    const bool copies_page = fork_length(src, upto) % kPagePositions != 0;
    return copies_page && table_.free_pages() == 0 ? Status{Errc::out_of_pages} : Status{};
  }
  std::int32_t share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    const std::int32_t len = fork_length(src, upto);
    table_.share_prefix(src, dst, len);
    table_.for_each_cell(dst, 0, len, [&](std::int32_t c) { owners_[static_cast<std::size_t>(c)].set(dst); });
    return len;
  }

  // ---- sequence edits ----
  using Write = PositionTable::Write;
  static constexpr bool kHoles = true;

  Status room_for_restore(std::span<const std::int32_t> positions) const {
    if (static_cast<std::int64_t>(positions.size()) > free_count_) return Errc::out_of_cells;
    std::int32_t pages = 0;  // one per distinct page, all fresh
    for (std::size_t i = 0; i < positions.size(); ++i)
      if (i == 0 || positions[i] / kPagePositions != positions[i - 1] / kPagePositions) ++pages;
    return pages <= table_.free_pages() ? Status{} : Status{Errc::out_of_pages};
  }
  void restore_rows(std::int32_t seq, std::span<const std::int32_t> positions) {
    std::vector<Write> writes;
    for (const std::int32_t p : positions) writes.push_back({p, claim(seq, p)});
    table_.apply(seq, writes, positions.empty() ? 0 : positions.back() + 1);
    ends_at(seq);
  }
  [[nodiscard]] std::int64_t row_at(std::int32_t seq, std::int32_t pos) const { return table_.cell(seq, pos); }
  template <class F>
  void for_each_held(std::int32_t seq, F&& f) const {
    table_.for_each_position(seq, 0, table_.length(seq), [&](std::int32_t p, std::int32_t c) { f(p, std::int64_t{c}); });
  }

  [[nodiscard]] std::int32_t first_position(std::int32_t seq) const { return table_.first_held(seq); }

  Result<std::int32_t> remove_positions(std::int32_t seq, std::int32_t lo, std::int32_t hi) {
    const std::int32_t len = table_.length(seq);
    std::vector<Write> writes;
    std::vector<std::int32_t> cells;
    table_.for_each_position(seq, lo, hi, [&](std::int32_t p, std::int32_t c) {
      writes.push_back({p, -1});
      cells.push_back(c);
    });
    const std::int32_t new_len = hi < len ? len : table_.last_below(seq, lo) + 1;
    if (table_.pages_needed(seq, writes, new_len) > table_.free_pages()) return Errc::out_of_pages;
    for (const std::int32_t c : cells) release(c, seq);
    table_.apply(seq, writes, new_len);
    ends_at(seq);
    return new_len;
  }

  Result<std::int32_t> copy_positions(std::int32_t src, std::int32_t dst, std::int32_t lo, std::int32_t hi) {
    const std::int32_t dst_len = table_.length(dst);
    if (src == dst) {
      ends_at(dst);
      return dst_len;
    }
    std::vector<Write> writes;
    bool collision = false;
    table_.for_each_position(src, lo, hi, [&](std::int32_t p, std::int32_t c) {
      const std::int32_t have = p < dst_len ? table_.cell(dst, p) : -1;
      if (have == c) return;  // already shared
      if (have >= 0) collision = true;
      writes.push_back({p, c});
    });
    if (collision) return Errc::position_collision;
    const std::int32_t new_len = writes.empty() ? dst_len : std::max(dst_len, writes.back().pos + 1);
    // A whole page of src inside the range, ending in a held position, where dst has no page: dst
    // shares it (as a fork does) instead of writing its entries.
    std::vector<PositionTable::Share> shares;
    std::vector<Write> rest;
    for (std::size_t i = 0; i < writes.size();) {
      const std::int32_t k = writes[i].pos / kPagePositions, first = k * kPagePositions;
      std::size_t j = i;
      while (j < writes.size() && writes[j].pos / kPagePositions == k) ++j;
      const bool whole = first >= lo && first + kPagePositions <= hi && table_.cell(src, first + kPagePositions - 1) >= 0;
      const bool absent = k >= PositionTable::pages_for(dst_len) || table_.view().page_of(dst, first) < 0;
      if (whole && absent) shares.push_back({k, table_.view().page_of(src, first)});
      else rest.insert(rest.end(), writes.begin() + static_cast<std::ptrdiff_t>(i), writes.begin() + static_cast<std::ptrdiff_t>(j));
      i = j;
    }
    if (table_.pages_needed(dst, rest, new_len) > table_.free_pages()) return Errc::out_of_pages;
    for (const Write& w : writes) owners_[static_cast<std::size_t>(w.cell)].set(dst);
    table_.apply(dst, rest, new_len, shares);
    ends_at(dst);
    return new_len;
  }

  // Moves the held positions p in [lo, hi) to to(p); below 0 leaves the sequence. Cells are
  // handled in ascending p: dropped, moved in place (sole owner), or copied to a fresh cell.
  template <class F>
  Result<std::int32_t> move_positions(std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& to) {
    struct Move {
      std::int32_t from, cell;
      std::int64_t to;
    };
    const std::int32_t len = table_.length(seq);
    std::vector<Move> moves;
    table_.for_each_position(seq, lo, hi, [&](std::int32_t p, std::int32_t c) { moves.push_back({p, c, to(p)}); });
    std::vector<std::int64_t> targets;
    std::int64_t fresh = 0, available = free_count_;
    for (const Move& m : moves) {
      if (m.to >= position_limit()) return Errc::sequence_full;
      const bool shared = owners_[static_cast<std::size_t>(m.cell)].count() > 1;
      if (m.to < 0) {
        if (!shared) ++available;  // freed before any copy is picked (they come first)
        continue;
      }
      targets.push_back(m.to);
      if (shared) ++fresh;
    }
    std::sort(targets.begin(), targets.end());
    for (std::size_t i = 0; i < targets.size(); ++i) {
      const auto q = static_cast<std::int32_t>(targets[i]);
      if (i > 0 && targets[i - 1] == q) return Errc::position_collision;
      if ((q < lo || q >= hi) && q < len && table_.cell(seq, q) >= 0) return Errc::position_collision;
    }
    if (fresh > available) return Errc::out_of_cells;
    std::vector<Write> writes;
    for (const Move& m : moves) writes.push_back({m.from, -1});
    for (const Move& m : moves)
      if (m.to >= 0) writes.push_back({static_cast<std::int32_t>(m.to), m.cell});
    std::int32_t new_len = hi < len ? len : table_.last_below(seq, lo) + 1;
    if (!targets.empty()) new_len = std::max(new_len, static_cast<std::int32_t>(targets.back()) + 1);
    if (table_.pages_needed(seq, writes, new_len) > table_.free_pages()) return Errc::out_of_pages;

    std::size_t w = moves.size();  // writes[w..] are the moved cells' new entries, in move order
    for (const Move& m : moves) {
      if (m.to < 0) {
        release(m.cell, seq);
        continue;
      }
      writes[w++].cell = move_cell(seq, m.cell, static_cast<std::int32_t>(m.to));
    }
    table_.apply(seq, writes, new_len);
    ends_at(seq);
    return new_len;
  }

  // Cell c of seq goes to position q: in place when seq is its only owner, else a fresh cell for
  // seq (copy on write). Lists the copy and the re-rotation; returns the cell seq now has there.
  std::int32_t move_cell(std::int32_t seq, std::int32_t c, std::int32_t q) {
    const std::int32_t encoded = encoded_pos(c);
    auto& owners = owners_[static_cast<std::size_t>(c)];
    if (owners.count() == 1) {
      cell_pos_[static_cast<std::size_t>(c)] = q;
      note_rotation(c, encoded, q);
      return c;
    }
    owners.reset(seq);
    const std::int32_t fresh = claim(seq, q);
    copies_.push_back(RowCopy{c, fresh, 1});
    ++changes_epoch_;
    note_rotation(fresh, encoded, q);
    return fresh;
  }

  // The position cell c's K encodes once the pending copies have run.
  [[nodiscard]] std::int32_t encoded_pos(std::int32_t c) const noexcept {
    const std::int32_t i = rotation_at_[static_cast<std::size_t>(c)];
    return i >= 0 ? rotations_[static_cast<std::size_t>(i)].old_pos : cell_pos_[static_cast<std::size_t>(c)];
  }
  // Cell c (its K encoding position `encoded`) is now at q: listed for re-rotation unless equal.
  void note_rotation(std::int32_t c, std::int32_t encoded, std::int32_t q) {
    const std::int32_t i = rotation_at_[static_cast<std::size_t>(c)];
    if (encoded == q) {
      drop_rotation(c);
    } else if (i >= 0) {
      rotations_[static_cast<std::size_t>(i)].new_pos = q;
      ++changes_epoch_;
    } else {
      rotation_at_[static_cast<std::size_t>(c)] = static_cast<std::int32_t>(rotations_.size());
      rotations_.push_back(RowRotation{c, encoded, q});
      ++changes_epoch_;
    }
  }
  void drop_rotation(std::int32_t c) {
    const std::int32_t i = rotation_at_[static_cast<std::size_t>(c)];
    if (i < 0) return;
    rotations_[static_cast<std::size_t>(i)] = rotations_.back();
    rotation_at_[static_cast<std::size_t>(rotations_[static_cast<std::size_t>(i)].cell)] = i;
    rotations_.pop_back();
    rotation_at_[static_cast<std::size_t>(c)] = -1;
    ++changes_epoch_;
  }

  // The placement hears where seq now ends (after every rewind, removal and edit).
  void ends_at(std::int32_t seq) {
    const std::int32_t len = table_.length(seq);
    placement_.truncated(state(seq), len == 0 ? -1 : table_.cell(seq, len - 1));
  }

  void on_seq_created(std::int32_t seq) { state(seq) = typename P::SeqState{}; }

  void clear_rows() {
    this->live_sequences().for_each([&](std::int32_t s) { truncate_rows(s, 0); });
    if (!copies_.empty()) ++changes_epoch_;
    copies_.clear();  // every cell is free
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
    drop_rotation(c);
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
  std::vector<RowCopy> copies_;                       // copy-on-write copies not yet acknowledged
  std::uint64_t changes_epoch_ = 0;                   // see changes_epoch()
  std::vector<RowRotation> rotations_;                // re-rotations not yet acknowledged
  std::vector<std::int32_t> rotation_at_;             // [max_cells] index into rotations_, -1 = none
};

}  // namespace cellkv
