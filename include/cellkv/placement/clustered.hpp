// cellkv/placement/clustered.hpp - a sequence appends into aligned blocks of its own.
//
// clustered<Block>: a sequence appends into its open block of `Block` cells (cells
// [b*Block, (b+1)*Block)). When that block is full it opens the lowest fully free block; when no
// block is fully free it falls back to the lowest free cell anywhere (whose block becomes its open
// block), so capacity is never lost. A Placement (cellkv/placement.hpp). The cells past the last
// full block (max_cells % Block) are only reached by the fallback.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cellkv/detail/bitmap.hpp"
#include "cellkv/placement/free_cells.hpp"

namespace cellkv::placement {

template <std::int32_t Block>
class clustered {
  static_assert(Block > 0 && (Block & (Block - 1)) == 0,
                "cellkv::placement::clustered<Block>: Block must be a power of two (match the KV tile, "
                "e.g. 64 or 128)");

 public:
  static constexpr std::int32_t kBlock = Block;

  struct SeqState {
    std::int32_t open = -1;  // the sequence's open block, -1 when none
    friend bool operator==(const SeqState&, const SeqState&) = default;
  };

  clustered() = default;
  explicit clustered(std::int32_t max_cells)
      : used_(static_cast<std::size_t>(max_cells / Block), 0), free_blocks_(max_cells / Block, true) {}

  // The next free cell of the open block, else the lowest fully free block's first cell, else
  // the lowest free cell. The cell is claimed on return.
  std::int32_t pick(SeqState& s, FreeCells free) {
    const std::int32_t c = choose(s, free);
    note_use(c, +1);
    return c;
  }
  void freed(std::int32_t cell) { note_use(cell, -1); }
  // The sequence now ends at last_cell (-1: holds nothing); its open block is that cell's.
  void truncated(SeqState& s, std::int32_t last_cell) noexcept { s.open = last_cell < 0 ? -1 : last_cell / Block; }

  friend bool operator==(const clustered&, const clustered&) = default;

  // The host memory clustered(max_cells) allocates: a count and a bit per full block.
  static constexpr std::size_t host_bytes(std::int32_t max_cells) noexcept {
    const std::int32_t blocks = max_cells / Block;
    return static_cast<std::size_t>(blocks) * sizeof(std::int32_t) + detail::Bitmap::bytes(blocks);
  }

 private:
  std::int32_t choose(SeqState& s, FreeCells& free) {
    if (s.open >= 0) {
      const std::int32_t c = free.first_from(s.open * Block);
      if (c >= 0 && c < (s.open + 1) * Block) return c;
    }
    if (const std::int64_t b = free_blocks_.find_first(0); b >= 0) {
      s.open = static_cast<std::int32_t>(b);
      return s.open * Block;
    }
    const std::int32_t c = free.lowest();  // fallback: any free cell
    s.open = c / Block;
    return c;
  }

  void note_use(std::int32_t c, std::int32_t delta) {
    const std::int32_t b = c / Block;
    if (b >= static_cast<std::int32_t>(used_.size())) return;  // the partial tail block
    auto& used = used_[static_cast<std::size_t>(b)];
    if (used == 0) free_blocks_.reset(b);
    used += delta;
    if (used == 0) free_blocks_.set(b);
  }

  std::vector<std::int32_t> used_;  // [max_cells / Block] used cells per full block
  detail::Bitmap free_blocks_;      // bit b = full block b is entirely free
};

}  // namespace cellkv::placement
