// cellkv/detail/cell_pool.hpp - one pool of cells of the cell layout: the cells' metadata, the
// free cells, the placement's state and every sequence's cells by position.
//
// Per cell: pos (int32, -1 = free) and owners (SeqSet). Per sequence: the cell of each position, in
// a PositionTable (pages of positions shared between forks; the device keeps a copy of it, which
// the attention kernels read). Free cells are a two-level bitmap, so placement and every operation
// cost time proportional to the tokens or rows they touch. Which free cell a token claims is the
// placement policy's choice (P::pick, placement.hpp); the pool tells the policy of every freed
// cell and where a sequence ends after every rewind or edit, and never branches on which policy
// it holds.
//
// The cell cache (cell_layout_cache.hpp) holds one pool for every layer it stores in full and, with
// window storage, one per distinct attention window (CacheConfig::window_cells). A window pool
// holds only the last positions of each sequence: drop_below() lets go of whole pages that no
// query of the sequence can see any more. Every other operation is the same in both kinds.
//
// Edits (docs/design.md section 4, "Sequence edits") come in two halves so that the cache can
// check every pool before it changes any: plan_remove / plan_copy / plan_move check the edit and
// return an Edit (or the refusal, having changed nothing), commit() carries it out. seq_rm of a
// range leaves holes (table entries -1); seq_cp adds owners (zero copy); seq_add / seq_div move
// cells, copying a shared one for the moved sequence (a fresh cell picked by the placement, a
// RowCopy of one row) and listing every moved cell's K re-rotation (RowRotation: the position its
// K encodes -> its position now).
#pragma once

#include <algorithm>
#include <array>
#include <cassert>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/detail/bitmap.hpp"
#include "cellkv/detail/bounded_push.hpp"
#include "cellkv/placement.hpp"
#include "cellkv/position_table.hpp"
#include "cellkv/seq_set.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::detail {

template <Placement P, std::int32_t MaxSeqs>
class CellPool {
 public:
  using Owners = SeqSet<MaxSeqs>;
  using Write = PositionTable::Write;

  // A checked edit of one sequence's positions, ready to commit.
  struct Edit {
    enum class Kind : std::uint8_t { remove, copy, move };
    struct Move {
      std::int32_t from = 0, cell = 0;
      std::int64_t to = 0;  // < 0: the cell leaves the sequence
    };
    Kind kind = Kind::remove;
    std::int32_t seq = 0;            // the edited sequence (dst of a copy)
    std::int32_t old_len = 0;        // its length before
    std::int32_t new_len = 0;        // and after
    std::vector<Write> writes;       // every entry the edit changes, in order (the last write wins)
    std::vector<Write> table_writes;  // copy: the writes the shared pages do not cover
    std::vector<PositionTable::Share> shares;  // copy: whole pages taken as they are
    std::vector<Move> moves;         // move: in ascending from
    std::vector<std::int32_t> released;  // remove: the cells the sequence lets go of
  };

  // `cells` cells for max_seqs sequences whose positions reach [0, 64 ceil(position_cells / 64))
  // (position_cells >= cells: a window pool takes the main pool's cell count).
  CellPool(std::int32_t cells, std::int32_t max_seqs, std::int32_t position_cells)
      : placement_(cells),
        cell_pos_(static_cast<std::size_t>(cells), -1),
        owners_(static_cast<std::size_t>(cells), Owners{}),
        free_count_(cells),
        table_(max_seqs, cells, position_cells),
        rotation_at_(static_cast<std::size_t>(cells), -1),
        dropped_below_(static_cast<std::size_t>(MaxSeqs), 0) {
    free_.assign(cells, true);
    used_.assign(cells, false);
  }

  // Host bytes a pool of these sizes holds at most: per cell its position, owners, rotation index,
  // at most one pending rotation and two bitmap bits; the position table at its fullest; the
  // placement's own state. The pending copy-on-write copies are not counted (they grow with the
  // edits until acknowledged, as fork copies do).
  static std::size_t host_bytes(std::int32_t cells, std::int32_t max_seqs, std::int32_t position_cells) {
    const auto n = static_cast<std::size_t>(cells);
    return n * (2 * sizeof(std::int32_t) + sizeof(Owners) + sizeof(RowRotation)) + 2 * Bitmap::bytes(cells) +
           static_cast<std::size_t>(PositionTable::host_bytes(max_seqs, cells, position_cells)) +
           placement_host_bytes<P>(cells) + static_cast<std::size_t>(MaxSeqs) * sizeof(std::int32_t);
  }

  // ---- queries ----
  [[nodiscard]] std::int64_t capacity() const noexcept { return static_cast<std::int64_t>(cell_pos_.size()); }
  [[nodiscard]] std::int64_t free_cells() const noexcept { return free_count_; }
  [[nodiscard]] std::int32_t cell_pos(std::int32_t c) const noexcept { return cell_pos_[static_cast<std::size_t>(c)]; }
  [[nodiscard]] const Owners& cell_owners(std::int32_t c) const noexcept { return owners_[static_cast<std::size_t>(c)]; }
  [[nodiscard]] std::int32_t cell_of(std::int32_t seq, std::int32_t p) const noexcept { return table_.cell(seq, p); }
  [[nodiscard]] const PositionTable& table() const noexcept { return table_; }
  [[nodiscard]] const P& placement() const noexcept { return placement_; }
  [[nodiscard]] const typename P::SeqState& placement_state(std::int32_t s) const noexcept {
    return seq_state_[static_cast<std::size_t>(s)];
  }
  [[nodiscard]] std::int32_t position_limit() const noexcept { return table_.position_limit(); }
  [[nodiscard]] std::int64_t occupied_end() const noexcept { return used_.find_last() + 1; }
  // Cell of a held position, -1 for a hole or a position at or past the sequence's length.
  [[nodiscard]] std::int32_t held_cell(std::int32_t seq, std::int32_t p) const noexcept {
    return p >= 0 && p < table_.length(seq) ? table_.cell(seq, p) : -1;
  }

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
  [[nodiscard]] std::uint64_t changes_epoch() const noexcept { return changes_epoch_; }

  friend bool operator==(const CellPool&, const CellPool&) = default;

  // ---- steps ----
  // Room for `tokens` fresh cells (with `credit` more cells free by then) and for the pages of the
  // positions [len(s), len(s) + count[s]) of each distinct s of seqs; out_of_cells / sequence_full
  // / out_of_pages.
  Status room_for_step(std::span<const std::int32_t> seqs, std::span<const std::int32_t> count, std::int64_t credit) const {
    if (static_cast<std::int64_t>(seqs.size()) > free_count_ + credit) return Errc::out_of_cells;
    std::int64_t pages = 0;
    Owners seen{};
    for (const std::int32_t s : seqs) {
      if (seen.test(s)) continue;
      seen.set(s);
      const std::int32_t len = table_.length(s), n = count[static_cast<std::size_t>(s)];
      if (static_cast<std::int64_t>(len) + n > position_limit()) return Errc::sequence_full;
      pages += PositionTable::pages_for(len + n) - PositionTable::pages_for(len);
    }
    return pages <= table_.free_pages() ? Status{} : Status{Errc::out_of_pages};
  }

  // Position len(seq) of seq gets a fresh cell.
  std::int32_t append(std::int32_t seq, std::int32_t pos) {
    const std::int32_t c = claim(seq, pos);
    table_.append(seq, c);
    return c;
  }

  // Cells that drop_below(s, cut_of(s)) for every s of seqs would free (a cell several of them
  // share is freed when all its owners drop it).
  template <class Cut>
  [[nodiscard]] std::int64_t freed_by_drops(std::span<const std::int32_t> seqs, Cut&& cut_of) const {
    std::vector<std::int32_t> cells;
    Owners seen{};
    for (const std::int32_t s : seqs) {
      if (seen.test(s)) continue;
      seen.set(s);
      const std::int32_t end = drop_stop(s, cut_of(s));
      for (std::int32_t k = dropped_below_[static_cast<std::size_t>(s)]; k < end; ++k)
        table_.for_each_cell(s, k * kPagePositions, (k + 1) * kPagePositions, [&](std::int32_t c) { cells.push_back(c); });
    }
    std::sort(cells.begin(), cells.end());
    std::int64_t freed = 0;
    for (std::size_t i = 0; i < cells.size();) {
      std::size_t j = i;
      while (j < cells.size() && cells[j] == cells[i]) ++j;
      if (static_cast<std::int32_t>(j - i) == owners_[static_cast<std::size_t>(cells[i])].count()) ++freed;
      i = j;
    }
    return freed;
  }
  // Lets go of seq's pages below page k_end (positions below 64 k_end; 64 k_end <= len(seq) - 1),
  // up to drop_stop: never of a cell whose K re-rotation is pending.
  void drop_below(std::int32_t seq, std::int32_t k_end) {
    std::int32_t& done = dropped_below_[static_cast<std::size_t>(seq)];
    k_end = drop_stop(seq, k_end);
    if (k_end <= done) return;
    table_.drop_pages(seq, done, k_end, [&](std::int32_t c) { release(c, seq); });
    done = k_end;
  }

  // While on (keep_pending_pages), drops stop at the first page holding a cell whose K re-rotation
  // is pending: letting go of that cell would change the pending rotations, which a device has
  // applied in part when an upload failed and resumes at the next one (gpu/planning_verbs.hpp turns
  // it on for declare_step and seq_cp while a device holds part of the changes). Off by default.
  void keep_pending_pages(bool on) noexcept { keep_pending_ = on; }

  // The first of seq's pages in [its drop mark, k_end) that holds a cell whose K re-rotation is
  // pending when keep_pending_pages is on, else k_end: drops stop there.
  [[nodiscard]] std::int32_t drop_stop(std::int32_t seq, std::int32_t k_end) const {
    if (!keep_pending_ || rotations_.empty()) return k_end;
    for (std::int32_t k = dropped_below_[static_cast<std::size_t>(seq)]; k < k_end; ++k) {
      bool pending = false;
      table_.for_each_cell(seq, k * kPagePositions, (k + 1) * kPagePositions,
                           [&](std::int32_t c) { pending = pending || rotation_at_[static_cast<std::size_t>(c)] >= 0; });
      if (pending) return k;
    }
    return k_end;
  }

  // ---- whole sequences ----
  void on_seq_created(std::int32_t seq) {
    seq_state_[static_cast<std::size_t>(seq)] = typename P::SeqState{};
    dropped_below_[static_cast<std::size_t>(seq)] = 0;
  }
  void remove_all(std::int32_t seq) {
    table_.for_each_cell(seq, 0, table_.length(seq), [&](std::int32_t c) { release(c, seq); });
    table_.truncate(seq, 0);
    ends_at(seq);
  }
  void clear(const Owners& live) {
    live.for_each([&](std::int32_t s) { remove_all(s); });
    if (!copies_.empty()) ++changes_epoch_;
    copies_.clear();  // every cell is free
  }

  // A fork of src over positions < upto: its length is one past src's highest held position below
  // upto; its partial last page is a copy, so it needs a free page.
  [[nodiscard]] std::int32_t fork_length(std::int32_t src, std::int32_t upto) const {
    return table_.last_below(src, upto) + 1;
  }
  [[nodiscard]] Status room_for_clone(std::int32_t src, std::int32_t upto) const {
    const bool copies_page = fork_length(src, upto) % kPagePositions != 0;
    return copies_page && table_.free_pages() == 0 ? Status{Errc::out_of_pages} : Status{};
  }
  std::int32_t share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    const std::int32_t len = fork_length(src, upto);
    table_.share_prefix(src, dst, len);
    table_.for_each_cell(dst, 0, len, [&](std::int32_t c) { owners_[static_cast<std::size_t>(c)].set(dst); });
    return len;
  }

  // A restored sequence holding `positions` (strictly ascending) in fresh cells.
  [[nodiscard]] Status room_for_restore(std::span<const std::int32_t> positions) const {
    if (static_cast<std::int64_t>(positions.size()) > free_count_) return Errc::out_of_cells;
    std::int32_t pages = 0;  // one per distinct page, all fresh
    for (std::size_t i = 0; i < positions.size(); ++i)
      if (i == 0 || positions[i] / kPagePositions != positions[i - 1] / kPagePositions) ++pages;
    return pages <= table_.free_pages() ? Status{} : Status{Errc::out_of_pages};
  }
  void restore(std::int32_t seq, std::span<const std::int32_t> positions, std::int32_t len) {
    std::vector<Write> writes;
    for (const std::int32_t p : positions) writes.push_back({p, claim(seq, p)});
    table_.apply(seq, writes, len);
    ends_at(seq);
  }

  // ---- edits ----
  // Removes the held positions [lo, hi) of seq (0 <= lo <= hi <= len).
  Result<Edit> plan_remove(std::int32_t seq, std::int32_t lo, std::int32_t hi) const {
    Edit e{Edit::Kind::remove, seq, table_.length(seq), 0, {}, {}, {}, {}, {}};
    table_.for_each_position(seq, lo, hi, [&](std::int32_t p, std::int32_t c) {
      e.writes.push_back({p, -1});
      e.released.push_back(c);
    });
    e.new_len = hi < e.old_len ? e.old_len : table_.last_below(seq, lo) + 1;
    if (table_.pages_needed(seq, e.writes, e.new_len) > table_.free_pages()) return Errc::out_of_pages;
    return e;
  }

  // dst also holds src's cells at their held positions in [lo, hi) (hi <= len(src)).
  Result<Edit> plan_copy(std::int32_t src, std::int32_t dst, std::int32_t lo, std::int32_t hi) const {
    Edit e{Edit::Kind::copy, dst, table_.length(dst), table_.length(dst), {}, {}, {}, {}, {}};
    if (src == dst) return e;
    bool collision = false;
    table_.for_each_position(src, lo, hi, [&](std::int32_t p, std::int32_t c) {
      const std::int32_t have = held_cell(dst, p);
      if (have == c) return;  // already shared
      if (have >= 0) collision = true;
      e.writes.push_back({p, c});
    });
    if (collision) return Errc::position_collision;
    if (!e.writes.empty()) e.new_len = std::max(e.old_len, e.writes.back().pos + 1);
    // A whole page of src inside the range, ending in a held position, where dst has no page: dst
    // shares it (as a fork does) instead of writing its entries.
    for (std::size_t i = 0; i < e.writes.size();) {
      const std::int32_t k = e.writes[i].pos / kPagePositions, first = k * kPagePositions;
      std::size_t j = i;
      while (j < e.writes.size() && e.writes[j].pos / kPagePositions == k) ++j;
      const bool whole = first >= lo && first + kPagePositions <= hi && table_.cell(src, first + kPagePositions - 1) >= 0;
      const bool absent = k >= PositionTable::pages_for(e.old_len) || table_.view().page_of(dst, first) < 0;
      if (whole && absent) e.shares.push_back({k, table_.view().page_of(src, first)});
      else e.table_writes.insert(e.table_writes.end(), e.writes.begin() + static_cast<std::ptrdiff_t>(i),
                                 e.writes.begin() + static_cast<std::ptrdiff_t>(j));
      i = j;
    }
    if (table_.pages_needed(dst, e.table_writes, e.new_len) > table_.free_pages()) return Errc::out_of_pages;
    return e;
  }

  // Moves the held positions p in [lo, hi) of seq to to(p) (int64); below 0 leaves the sequence.
  // Cells are handled in ascending p: dropped, moved in place (sole owner), or copied to a fresh cell.
  template <class F>
  Result<Edit> plan_move(std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& to) const {
    Edit e{Edit::Kind::move, seq, table_.length(seq), 0, {}, {}, {}, {}, {}};
    table_.for_each_position(seq, lo, hi, [&](std::int32_t p, std::int32_t c) { e.moves.push_back({p, c, to(p)}); });
    std::vector<std::int64_t> targets;
    std::int64_t fresh = 0, available = free_count_;
    for (const auto& m : e.moves) {
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
      if ((q < lo || q >= hi) && held_cell(seq, q) >= 0) return Errc::position_collision;
    }
    if (fresh > available) return Errc::out_of_cells;
    for (const auto& m : e.moves) e.writes.push_back({m.from, -1});
    for (const auto& m : e.moves)
      if (m.to >= 0) e.writes.push_back({static_cast<std::int32_t>(m.to), m.cell});
    e.new_len = hi < e.old_len ? e.old_len : table_.last_below(seq, lo) + 1;
    if (!targets.empty()) e.new_len = std::max(e.new_len, static_cast<std::int32_t>(targets.back()) + 1);
    if (table_.pages_needed(seq, e.writes, e.new_len) > table_.free_pages()) return Errc::out_of_pages;
    return e;
  }

  // Cells of positions [from, e.new_len) of e.seq once e is committed (-1: none); from >= 0.
  [[nodiscard]] std::vector<std::int32_t> cells_after(const Edit& e, std::int32_t from) const {
    std::vector<std::int32_t> out(static_cast<std::size_t>(std::max(e.new_len - from, 0)), -1);
    for (std::int32_t p = from; p < std::min(e.new_len, e.old_len); ++p)
      out[static_cast<std::size_t>(p - from)] = held_cell(e.seq, p);
    for (const Write& w : e.writes)
      if (w.pos >= from && w.pos < e.new_len) out[static_cast<std::size_t>(w.pos - from)] = w.cell;
    return out;
  }

  // Carries out a planned edit (planned on this pool, nothing changed since).
  void commit(Edit& e) {
    switch (e.kind) {
      case Edit::Kind::remove:
        for (const std::int32_t c : e.released) release(c, e.seq);
        table_.apply(e.seq, e.writes, e.new_len);
        break;
      case Edit::Kind::copy:
        for (const Write& w : e.writes) owners_[static_cast<std::size_t>(w.cell)].set(e.seq);
        table_.apply(e.seq, e.table_writes, e.new_len, e.shares);
        break;
      case Edit::Kind::move: {
        std::size_t w = e.moves.size();  // e.writes[w..] are the moved cells' new entries, in move order
        for (const auto& m : e.moves) {
          if (m.to < 0) release(m.cell, e.seq);
          else e.writes[w++].cell = move_cell(e.seq, m.cell, static_cast<std::int32_t>(m.to));
        }
        table_.apply(e.seq, e.writes, e.new_len);
        break;
      }
    }
    dropped_below_[static_cast<std::size_t>(e.seq)] = 0;  // held pages may lie below the old mark
    ends_at(e.seq);
  }

  // ---- visibility ----
  template <class F>
  void for_each_visible_row(std::int32_t seq, std::int32_t lo, std::int32_t hi, F&& f) const {
    table_.for_each_cell(seq, lo, hi + 1, [&](std::int32_t c) { f(static_cast<std::int64_t>(c)); });
  }
  [[nodiscard]] std::int32_t row_pos(std::int64_t row) const noexcept { return cell_pos_[static_cast<std::size_t>(row)]; }
  [[nodiscard]] bool row_owned_by(std::int64_t row, std::int32_t seq) const noexcept {
    return owners_[static_cast<std::size_t>(row)].test(seq);
  }

 private:
  typename P::SeqState& state(std::int32_t seq) noexcept { return seq_state_[static_cast<std::size_t>(seq)]; }

  // A free cell, picked by the placement, now at position pos of seq alone.
  std::int32_t claim(std::int32_t seq, std::int32_t pos) {
    const std::int32_t c = placement_.pick(state(seq), FreeCells(free_, free_hint_, free_count_));
    assert(c >= 0 && c < capacity() && free_.test(c) && "Placement::pick must return a free cell");
    free_.reset(c);
    used_.set(c);
    --free_count_;
    cell_pos_[static_cast<std::size_t>(c)] = pos;
    owners_[static_cast<std::size_t>(c)].set(seq);
    return c;
  }

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

  // The placement hears where seq now ends (after every rewind, removal and edit).
  void ends_at(std::int32_t seq) {
    const std::int32_t len = table_.length(seq);
    placement_.truncated(state(seq), len == 0 ? -1 : table_.cell(seq, len - 1));
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
      push_within(rotations_, RowRotation{c, encoded, q}, cell_pos_.size());  // a cell at most once
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

  P placement_;                                       // the policy's own state
  std::vector<std::int32_t> cell_pos_;                // [cells] position, -1 = free
  std::vector<Owners> owners_;                        // [cells]
  Bitmap free_;                                       // bit c = cell c is free
  Bitmap used_;                                       // complement of free_, for occupied_end
  std::int64_t free_count_ = 0;
  std::int32_t free_hint_ = 0;                        // no free cell below it
  PositionTable table_;                               // [sequence][position] -> cell
  std::array<typename P::SeqState, static_cast<std::size_t>(MaxSeqs)> seq_state_{};  // [MaxSeqs]
  std::vector<RowCopy> copies_;                       // copy-on-write copies not yet acknowledged
  std::uint64_t changes_epoch_ = 0;                   // counts changes of the pending copies/rotations
  std::vector<RowRotation> rotations_;                // re-rotations not yet acknowledged
  std::vector<std::int32_t> rotation_at_;             // [cells] index into rotations_, -1 = none
  std::vector<std::int32_t> dropped_below_;           // [MaxSeqs] drop_below's mark: no held page below
  bool keep_pending_ = false;                         // keep_pending_pages
};

}  // namespace cellkv::detail
