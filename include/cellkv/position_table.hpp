// cellkv/position_table.hpp - each sequence's cells by position, in pages shared between forks.
//
// Every live sequence of the cell layout holds exactly one cell per position in [0, pos(s)). The
// table maps (sequence, position) to that cell through pages of kPagePositions positions:
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
// entries of its last, partial page. A page shared by several sequences is full for all of them;
// a sequence that rewinds into a shared page first takes a private copy of the part it keeps
// (copy on write), so nobody else's positions change. Because every full page then ends in a cell
// that no other page holds, and every partial page is the last page of exactly one sequence, the
// live pages never exceed ceil(cells in use / 64) + 2 max_seqs: `page_capacity` is that bound for
// max_cells cells, and the table's memory grows with the cells, not with max_seqs x max_len.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "cellkv/position_table_view.hpp"

namespace cellkv {

class PositionTable {
 public:
  PositionTable() = default;
  // Room for max_seqs sequences over a pool of max_cells cells (a sequence holds at most
  // max_cells positions). Preconditions: both positive.
  PositionTable(std::int32_t max_seqs, std::int32_t max_cells)
      : max_seqs_(max_seqs),
        dir_stride_(pages_for(max_cells)),
        page_capacity_(pages_for(max_cells) + 2 * max_seqs),
        length_(static_cast<std::size_t>(max_seqs), 0),
        refs_(static_cast<std::size_t>(page_capacity_), 0) {
    flat_.assign(static_cast<std::size_t>(flat_size(max_seqs, max_cells)), -1);
    changed_flag_.assign(flat_.size(), 0);
    free_pages_.reserve(static_cast<std::size_t>(page_capacity_));
    for (std::int32_t p = page_capacity_; p-- > 0;) free_pages_.push_back(p);  // lowest id handed out first
  }

  // ---- geometry ----
  static constexpr std::int32_t pages_for(std::int32_t positions) noexcept {
    return positions <= 0 ? 0 : (positions - 1) / kPagePositions + 1;
  }
  // Entries of the flat array (directory + pages) for a cache of these sizes.
  static constexpr std::int64_t flat_size(std::int32_t max_seqs, std::int32_t max_cells) noexcept {
    const std::int64_t dir = static_cast<std::int64_t>(max_seqs) * pages_for(max_cells);
    const std::int64_t pages = static_cast<std::int64_t>(pages_for(max_cells)) + 2 * static_cast<std::int64_t>(max_seqs);
    return dir + pages * kPagePositions;
  }
  // Heap bytes of a table of these sizes with every entry listed as changed (the most it holds):
  // flat int32 + changed flag byte + changed index int32 per entry, lengths, page counts, free list.
  static constexpr std::int64_t host_bytes(std::int32_t max_seqs, std::int32_t max_cells) noexcept {
    const std::int64_t pages = static_cast<std::int64_t>(pages_for(max_cells)) + 2 * static_cast<std::int64_t>(max_seqs);
    return 9 * flat_size(max_seqs, max_cells) + 4 * static_cast<std::int64_t>(max_seqs) + 8 * pages;
  }
  [[nodiscard]] std::int32_t dir_stride() const noexcept { return dir_stride_; }
  [[nodiscard]] std::int32_t page_capacity() const noexcept { return page_capacity_; }
  [[nodiscard]] std::int64_t directory_entries() const noexcept {
    return static_cast<std::int64_t>(max_seqs_) * dir_stride_;
  }
  [[nodiscard]] std::int32_t pages_in_use() const noexcept {
    return page_capacity_ - static_cast<std::int32_t>(free_pages_.size());
  }

  // ---- lookups ----
  // Sequences holding page `page` (0: free); more than one means the page is shared by forks.
  [[nodiscard]] std::int32_t holders(std::int32_t page) const noexcept { return refs_[static_cast<std::size_t>(page)]; }
  [[nodiscard]] std::int32_t length(std::int32_t seq) const noexcept { return length_[static_cast<std::size_t>(seq)]; }
  // Cell of position pos of seq; precondition 0 <= pos < length(seq).
  [[nodiscard]] std::int32_t cell(std::int32_t seq, std::int32_t pos) const noexcept { return view().cell(seq, pos); }
  // Calls f(cell) for positions [begin, end) of seq, in order; precondition end <= length(seq).
  template <class F>
  void for_each_cell(std::int32_t seq, std::int32_t begin, std::int32_t end, F&& f) const {
    for (std::int32_t p = begin; p < end;) {
      const std::int32_t page = dir(seq, p / kPagePositions);
      const std::int32_t stop = std::min(end, (p / kPagePositions + 1) * kPagePositions);
      for (; p < stop; ++p) f(flat_[page_entry(page, p % kPagePositions)]);
    }
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

  // dst (empty) gets src's positions [0, upto): full pages shared, the partial tail copied.
  void share_prefix(std::int32_t src, std::int32_t dst, std::int32_t upto) {
    const std::int32_t full = upto / kPagePositions, tail = upto % kPagePositions;
    for (std::int32_t k = 0; k < full; ++k) {
      const std::int32_t page = dir(src, k);
      ++refs_[static_cast<std::size_t>(page)];
      set_dir(dst, k, page);
    }
    if (tail != 0) set_dir(dst, full, copy_of(dir(src, full), tail));
    length_[static_cast<std::size_t>(dst)] = upto;
  }

  // Keeps positions [0, keep) of seq; releases the rest.
  void truncate(std::int32_t seq, std::int32_t keep) {
    std::int32_t& len = length_[static_cast<std::size_t>(seq)];
    if (keep >= len) return;
    for (std::int32_t k = pages_for(keep); k < pages_for(len); ++k) {
      release(dir(seq, k));
      flat_[dir_entry(seq, k)] = -1;  // stale on the device: nothing reads past the length
    }
    const std::int32_t k = keep / kPagePositions, tail = keep % kPagePositions;
    if (tail != 0 && refs_[static_cast<std::size_t>(dir(seq, k))] > 1) {  // copy on write
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
    changed_.push_back(static_cast<std::int32_t>(i));
  }
  void set_dir(std::int32_t seq, std::int32_t k, std::int32_t page) { set(dir_entry(seq, k), page); }

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
