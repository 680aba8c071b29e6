// cellkv/position_table.hpp - each sequence's cells by position, in pages shared between forks.
//
// Every live sequence of the cell layout holds at most one cell per position in [0, pos(s)) (none:
// a hole, see below), and one at pos(s) - 1. The table maps (sequence, position) to that cell
// through pages of kPagePositions positions:
//
//   directory  int32 [max_seqs][dir_stride]      page id of positions [64 k, 64 k + 64) of s
//   pages      int32 [page_capacity][64]         cell of each position of the page
//
// Both live in one flat int32 array (directory first, then pages), the same on the host and on
// the device, so the device copy is kept equal by writing the entries that changed
// (`changed()` indexes into `flat()`) and nothing else. Entries that no live position reads (the
// directory beyond a sequence's length, the tail of a partial page, freed pages) are stale and
// are never uploaded or read.
//
// Sharing: a fork shares the source's full pages (a reference count per page) and copies the
// entries of its last, partial page. A page shared by several sequences covers positions below
// every holder's length; a sequence that rewinds into a shared page, or edits an entry of one
// (`apply`), first takes a private copy (copy on write), so nobody else's positions change. Without
// holes every full page then ends in a cell that no other page holds, and every partial page is the
// last page of exactly one sequence, so the live pages never exceed ceil(cells in use / 64) +
// 2 max_seqs: `page_capacity` is that bound for max_cells cells, and the table's memory grows with
// the cells, not with max_seqs x max_len.
//
// Holes: a position below a sequence's length that it does not hold (after seq_rm of a range, a
// shift, a copy) has the entry -1; a page of only holes is not kept (directory entry -1). A
// sequence's length is one past its highest held position, so its last position is never a hole.
// Holes can spread a sequence's cells over more pages than the bound above counts: edits and
// steps that need more pages than are free are refused by the cache (Errc::out_of_pages), using
// pages_needed() / free_pages(); the table itself never grows.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "cellkv/detail/bounded_push.hpp"
#include "cellkv/position_table_view.hpp"

namespace cellkv {

class PositionTable {
 public:
  PositionTable() = default;
  // Room for max_seqs sequences over a pool of max_cells cells (a sequence holds at most
  // max_cells positions). Preconditions: both positive.
  PositionTable(std::int32_t max_seqs, std::int32_t max_cells) : PositionTable(max_seqs, max_cells, max_cells) {}
  // The same with positions reaching [0, 64 * pages_for(max_positions)) (max_positions >=
  // max_cells): a window pool's table, whose sequences hold only their last positions (the main
  // pool's table reaches max_positions). Its edits mirror the main table's on fewer positions, so
  // it keeps as many pages as the main table, and one more per sequence for the page a release
  // of its first pages (drop_pages) can leave before an edit's copy on write.
  PositionTable(std::int32_t max_seqs, std::int32_t max_cells, std::int32_t max_positions)
      : max_seqs_(max_seqs),
        dir_stride_(pages_for(max_positions)),
        page_capacity_(page_capacity_for(max_seqs, max_cells, max_positions)),
        length_(static_cast<std::size_t>(max_seqs), 0),
        refs_(static_cast<std::size_t>(page_capacity_), 0) {
    flat_.assign(static_cast<std::size_t>(flat_size(max_seqs, max_cells, max_positions)), -1);
    changed_flag_.assign(flat_.size(), 0);
    free_pages_.reserve(static_cast<std::size_t>(page_capacity_));
    for (std::int32_t p = page_capacity_; p-- > 0;) free_pages_.push_back(p);  // lowest id handed out first
  }

  // ---- geometry ----
  static constexpr std::int32_t pages_for(std::int32_t positions) noexcept {
    return positions <= 0 ? 0 : (positions - 1) / kPagePositions + 1;
  }
  // Pages a table of these sizes holds (see the header comment for the bound).
  static constexpr std::int32_t page_capacity_for(std::int32_t max_seqs, std::int32_t max_cells,
                                                  std::int32_t max_positions) noexcept {
    return max_positions > max_cells ? pages_for(max_positions) + 3 * max_seqs : pages_for(max_cells) + 2 * max_seqs;
  }
  // Entries of the flat array (directory + pages) for a cache of these sizes.
  static constexpr std::int64_t flat_size(std::int32_t max_seqs, std::int32_t max_cells) noexcept {
    return flat_size(max_seqs, max_cells, max_cells);
  }
  static constexpr std::int64_t flat_size(std::int32_t max_seqs, std::int32_t max_cells,
                                          std::int32_t max_positions) noexcept {
    const std::int64_t dir = static_cast<std::int64_t>(max_seqs) * pages_for(max_positions);
    return dir + static_cast<std::int64_t>(page_capacity_for(max_seqs, max_cells, max_positions)) * kPagePositions;
  }
  // Heap bytes of a table of these sizes with every entry listed as changed (the most it holds):
  // flat int32 + changed flag byte + changed index int32 per entry, lengths, page counts, free list.
  static constexpr std::int64_t host_bytes(std::int32_t max_seqs, std::int32_t max_cells) noexcept {
    return host_bytes(max_seqs, max_cells, max_cells);
  }
  static constexpr std::int64_t host_bytes(std::int32_t max_seqs, std::int32_t max_cells,
                                           std::int32_t max_positions) noexcept {
    const std::int64_t pages = page_capacity_for(max_seqs, max_cells, max_positions);
    return 9 * flat_size(max_seqs, max_cells, max_positions) + 4 * static_cast<std::int64_t>(max_seqs) + 8 * pages;
  }
  [[nodiscard]] std::int32_t dir_stride() const noexcept { return dir_stride_; }
  [[nodiscard]] std::int32_t page_capacity() const noexcept { return page_capacity_; }
  [[nodiscard]] std::int64_t directory_entries() const noexcept {
    return static_cast<std::int64_t>(max_seqs_) * dir_stride_;
  }
  [[nodiscard]] std::int32_t pages_in_use() const noexcept {
    return page_capacity_ - static_cast<std::int32_t>(free_pages_.size());
  }
  [[nodiscard]] std::int32_t free_pages() const noexcept { return static_cast<std::int32_t>(free_pages_.size()); }
  // Positions a sequence can reach: [0, position_limit()).
  [[nodiscard]] std::int32_t position_limit() const noexcept { return dir_stride_ * kPagePositions; }

  // ---- lookups ----
  // Sequences holding page `page` (0: free, or page < 0: no page); more than one means shared.
  [[nodiscard]] std::int32_t holders(std::int32_t page) const noexcept {
    return page < 0 ? 0 : refs_[static_cast<std::size_t>(page)];
  }
  [[nodiscard]] std::int32_t length(std::int32_t seq) const noexcept { return length_[static_cast<std::size_t>(seq)]; }
  // Cell of position pos of seq, -1 for a hole; precondition 0 <= pos < length(seq).
  [[nodiscard]] std::int32_t cell(std::int32_t seq, std::int32_t pos) const noexcept { return view().cell(seq, pos); }
  // Calls f(pos, cell) for the held positions in [begin, end) of seq, in order (holes skipped);
  // precondition end <= length(seq).
  template <class F>
  void for_each_position(std::int32_t seq, std::int32_t begin, std::int32_t end, F&& f) const {
    for (std::int32_t p = std::max(begin, 0); p < end;) {
      const std::int32_t page = dir(seq, p / kPagePositions);
      const std::int32_t stop = std::min(end, (p / kPagePositions + 1) * kPagePositions);
      if (page < 0) {
        p = stop;
        continue;
      }
      for (; p < stop; ++p)
        if (const std::int32_t c = flat_[page_entry(page, p % kPagePositions)]; c >= 0) f(p, c);
    }
  }
  // Calls f(cell) for the held positions in [begin, end) of seq, in order (holes skipped).
  template <class F>
  void for_each_cell(std::int32_t seq, std::int32_t begin, std::int32_t end, F&& f) const {
    for_each_position(seq, begin, end, [&](std::int32_t, std::int32_t c) { f(c); });
  }
  // Highest held position of seq below `end` (<= length(seq)), -1 when none.
  [[nodiscard]] std::int32_t last_below(std::int32_t seq, std::int32_t end) const noexcept {
    for (std::int32_t k = pages_for(end); k-- > 0;) {
      const std::int32_t page = dir(seq, k);
      if (page < 0) continue;
      for (std::int32_t p = std::min(end, (k + 1) * kPagePositions); p-- > k * kPagePositions;)
        if (flat_[page_entry(page, p % kPagePositions)] >= 0) return p;
    }
    return -1;
  }
  // Lowest held position of seq, -1 when none.
  [[nodiscard]] std::int32_t first_held(std::int32_t seq) const noexcept {
    std::int32_t first = -1;
    const std::int32_t len = length(seq);
    for (std::int32_t k = 0; k < pages_for(len) && first < 0; ++k) {
      const std::int32_t page = dir(seq, k);
      if (page < 0) continue;
      for (std::int32_t p = k * kPagePositions; p < std::min(len, (k + 1) * kPagePositions); ++p)
        if (flat_[page_entry(page, p % kPagePositions)] >= 0) {
          first = p;
          break;
        }
    }
    return first;
  }
  // A view of the host copy (the same layout as the device copy).
  [[nodiscard]] PositionTableView view() const noexcept {
    return {flat_.data(), flat_.data() + directory_entries(), dir_stride_};
  }

  // ---- edits (lengths are the table's own; the cache keeps them equal to pos(s)) ----

  // Position length(seq) of seq gets `cell`.
  void append(std::int32_t seq, std::int32_t cell) {
    std::int32_t& len = length_[static_cast<std::size_t>(seq)];
    const std::int32_t k = len / kPagePositions, slot = len % kPagePositions;
    if (slot == 0) set_dir(seq, k, allocate());  // a new page; a partial last page is always private
    set(page_entry(dir(seq, k), slot), cell);
    ++len;
  }

  // dst (empty) gets src's positions [0, upto): full pages shared, the partial tail copied (a page
  // of only holes stays absent). upto - 1 may be a hole; the caller then truncates dst.
  void share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    const std::int32_t full = upto / kPagePositions, tail = upto % kPagePositions;
    for (std::int32_t k = 0; k < full; ++k) {
      const std::int32_t page = dir(src, k);
      if (page >= 0) ++refs_[static_cast<std::size_t>(page)];
      set_dir(dst, k, page);
    }
    if (tail != 0) {
      const std::int32_t page = dir(src, full);
      set_dir(dst, full, page < 0 ? -1 : copy_of(page, tail));
    }
    length_[static_cast<std::size_t>(dst)] = upto;
  }

  // One entry of an edit: position pos of the sequence gets `cell` (-1: becomes a hole).
  struct Write {
    std::int32_t pos = 0;
    std::int32_t cell = -1;
  };
  // Page k of the sequence becomes `page` (shared with its holders); see apply.
  struct Share {
    std::int32_t k = 0;
    std::int32_t page = 0;
  };

  // Pages apply(seq, writes, new_len) may allocate (an upper bound): one per page it writes a cell
  // into that is absent or shared, one per shared page it clears an entry of, one if the final
  // truncation splits a shared page.
  [[nodiscard]] std::int32_t pages_needed(std::int32_t seq, std::span<const Write> writes, std::int32_t new_len) const {
    const std::int32_t old_pages = pages_for(length(seq));
    std::vector<std::int32_t> ks;
    for (const Write& w : writes) {
      if (w.pos >= new_len) continue;  // truncated anyway
      const std::int32_t k = w.pos / kPagePositions;
      const std::int32_t page = k < old_pages ? dir(seq, k) : -1;
      if (page < 0 ? w.cell >= 0 : holders(page) > 1) ks.push_back(k);
    }
    std::sort(ks.begin(), ks.end());
    auto n = static_cast<std::int32_t>(std::unique(ks.begin(), ks.end()) - ks.begin());
    const std::int32_t k = new_len / kPagePositions;
    if (new_len % kPagePositions != 0 && k < old_pages && holders(dir(seq, k)) > 1) ++n;
    return n;
  }

  // Applies writes (in order) to seq and sets its length to new_len; positions between the old
  // length and new_len that no write fills become holes, pages left with only holes are released.
  // Writes at or past new_len are skipped (a rewind writes nothing but the truncation).
  // Preconditions: every write's pos < max(length(seq), new_len); position new_len - 1 holds a cell
  // afterwards (or new_len == 0); free_pages() >= pages_needed(seq, writes, new_len). `shares`
  // names pages the sequence takes as they are (seq_cp of whole pages): each page k absent for the
  // sequence, untouched by the writes, and ending below new_len.
  void apply(std::int32_t seq, std::span<const Write> writes, std::int32_t new_len,
             std::span<const Share> shares = {}) {
    const std::int32_t ext = std::max(length(seq), new_len);
    extend(seq, ext);
    for (const Share& sh : shares) {
      ++refs_[static_cast<std::size_t>(sh.page)];
      set_dir(seq, sh.k, sh.page);
    }
    std::vector<std::int32_t> touched;
    for (const Write& w : writes) {
      if (w.pos >= new_len) continue;  // past the final length: truncated, never read
      const std::int32_t k = w.pos / kPagePositions;
      std::int32_t page = dir(seq, k);
      if (page < 0) {
        if (w.cell < 0) continue;
        page = allocate();
        for (std::int32_t i = 0; i < kPagePositions; ++i) set(page_entry(page, i), -1);
        set_dir(seq, k, page);
      } else if (holders(page) > 1) {
        const std::int32_t copy = copy_of(page, std::min(kPagePositions, ext - k * kPagePositions));
        release(page);
        set_dir(seq, k, page = copy);
      }
      set(page_entry(page, w.pos % kPagePositions), w.cell);
      touched.push_back(k);
    }
    truncate(seq, new_len);
    for (const std::int32_t k : touched) release_if_empty(seq, k);
  }

  // Drops pages [k_begin, k_end) of seq (their positions become holes, the length stays), calling
  // f(cell) for each position they held; a shared page loses this holder only, so nothing is
  // allocated. Precondition: 64 k_end <= length(seq) - 1 (the last position stays held).
  template <class F>
  void drop_pages(std::int32_t seq, std::int32_t k_begin, std::int32_t k_end, F&& f) {
    assert(k_end == 0 || static_cast<std::int64_t>(k_end) * kPagePositions <= length(seq) - 1);
    for (std::int32_t k = k_begin; k < k_end; ++k) {
      const std::int32_t page = dir(seq, k);
      if (page < 0) continue;
      for (std::int32_t i = 0; i < kPagePositions; ++i)
        if (const std::int32_t c = flat_[page_entry(page, i)]; c >= 0) f(c);
      release(page);
      set_dir(seq, k, -1);
    }
  }

  // Keeps positions [0, keep) of seq; releases the rest.
  void truncate(std::int32_t seq, std::int32_t keep) {
    std::int32_t& len = length_[static_cast<std::size_t>(seq)];
    if (keep >= len) return;
    for (std::int32_t k = pages_for(keep); k < pages_for(len); ++k) {
      if (dir(seq, k) >= 0) release(dir(seq, k));
      flat_[dir_entry(seq, k)] = -1;  // stale on the device: nothing reads past the length
    }
    const std::int32_t k = keep / kPagePositions, tail = keep % kPagePositions;
    if (tail != 0 && holders(dir(seq, k)) > 1) {  // copy on write
      const std::int32_t shared = dir(seq, k);
      set_dir(seq, k, copy_of(shared, tail));
      release(shared);
    }
    len = keep;
  }

  // Every sequence empty, every page free.
  void clear() {
    for (std::int32_t s = 0; s < max_seqs_; ++s) truncate(s, 0);
  }

  // ---- the device copy ----
  // The whole flat array (directory, then pages).
  [[nodiscard]] std::span<const std::int32_t> flat() const noexcept { return flat_; }
  // Indices into flat() written since the last acknowledge(), each listed once; the device copy
  // equals flat() on every live entry once these are written.
  [[nodiscard]] std::span<const std::int32_t> changed() const noexcept { return changed_; }
  void acknowledge() noexcept {
    for (const std::int32_t i : changed_) changed_flag_[static_cast<std::size_t>(i)] = 0;
    changed_.clear();
  }

  friend bool operator==(const PositionTable&, const PositionTable&) = default;

 private:
  [[nodiscard]] std::size_t dir_entry(std::int32_t seq, std::int32_t k) const noexcept {
    return static_cast<std::size_t>(static_cast<std::int64_t>(seq) * dir_stride_ + k);
  }
  [[nodiscard]] std::size_t page_entry(std::int32_t page, std::int32_t slot) const noexcept {
    return static_cast<std::size_t>(directory_entries() + static_cast<std::int64_t>(page) * kPagePositions + slot);
  }
  [[nodiscard]] std::int32_t dir(std::int32_t seq, std::int32_t k) const noexcept { return flat_[dir_entry(seq, k)]; }

  void set(std::size_t i, std::int32_t value) {
    flat_[i] = value;
    if (changed_flag_[i] != 0) return;
    changed_flag_[i] = 1;
    detail::push_within(changed_, static_cast<std::int32_t>(i), flat_.size());  // each index listed once
  }
  void set_dir(std::int32_t seq, std::int32_t k, std::int32_t page) { set(dir_entry(seq, k), page); }

  // Length becomes ext (>= length): the new positions are holes, written as such (entries of the
  // last page, directory entries of the pages past it) so the device copy reads them right. The
  // last page is private (it holds position length - 1, or is absent).
  void extend(std::int32_t seq, std::int32_t ext) {
    std::int32_t& len = length_[static_cast<std::size_t>(seq)];
    if (ext <= len) return;
    if (len % kPagePositions != 0) {
      const std::int32_t k = len / kPagePositions, page = dir(seq, k);
      if (page >= 0)
        for (std::int32_t p = len; p < std::min(ext, (k + 1) * kPagePositions); ++p)
          set(page_entry(page, p % kPagePositions), -1);
    }
    for (std::int32_t k = pages_for(len); k < pages_for(ext); ++k) set_dir(seq, k, -1);
    len = ext;
  }

  // Releases page k of seq when it holds only holes below the length (such a page was written,
  // so it is private).
  void release_if_empty(std::int32_t seq, std::int32_t k) {
    const std::int32_t len = length(seq);
    if (k >= pages_for(len)) return;
    const std::int32_t page = dir(seq, k);
    if (page < 0) return;
    for (std::int32_t p = k * kPagePositions; p < std::min(len, (k + 1) * kPagePositions); ++p)
      if (flat_[page_entry(page, p % kPagePositions)] >= 0) return;
    release(page);
    set_dir(seq, k, -1);
  }

  // A private page holding the first `count` entries of `page`.
  std::int32_t copy_of(std::int32_t page, std::int32_t count) {
    const std::int32_t copy = allocate();
    for (std::int32_t i = 0; i < count; ++i) set(page_entry(copy, i), flat_[page_entry(page, i)]);
    return copy;
  }

  std::int32_t allocate() {
    if (free_pages_.empty())  // unreachable: page_capacity bounds the live pages (header comment)
      throw std::logic_error("cellkv::PositionTable: out of pages (page capacity bound broken)");
    const std::int32_t page = free_pages_.back();
    free_pages_.pop_back();
    refs_[static_cast<std::size_t>(page)] = 1;
    return page;
  }
  void release(std::int32_t page) {
    if (--refs_[static_cast<std::size_t>(page)] == 0) free_pages_.push_back(page);
  }

  std::int32_t max_seqs_ = 0;
  std::int32_t dir_stride_ = 0;
  std::int32_t page_capacity_ = 0;
  std::vector<std::int32_t> flat_;            // directory, then pages; -1 where never written
  std::vector<std::int32_t> length_;          // [max_seqs] positions held
  std::vector<std::int32_t> refs_;            // [page_capacity] sequences holding each page
  std::vector<std::int32_t> free_pages_;      // stack; the lowest free id on top after construction
  std::vector<std::int32_t> changed_;         // flat indices written since the last acknowledge
  std::vector<std::uint8_t> changed_flag_;    // [flat size] 1 when listed in changed_
};

}  // namespace cellkv
