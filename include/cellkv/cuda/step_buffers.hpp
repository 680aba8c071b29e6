// cellkv/cuda/step_buffers.hpp - the runtime-bound buffers of DESIGN.md section 5, allocated once
// at fixed device addresses, and the pinned staging they are uploaded from.
//
// Device "step block" (one upload per step):
//   cells      int64 [max_write]            row written by token t (scratch row for padding)
//   read_len   int64 [1]                    1 + highest occupied row after placement
//   token_seq  int32 [max_write]            sequence of token t, -1 for padding
//   token_pos  int32 [max_write]            position of token t
//   tokens     int32 [1]                    T (real tokens; the rest of the width is padding)
//   num_segments int32 [1], segments Segment [max_write]   runs of tokens of one sequence
//   ranges     RowRange [windows][max_write] sequence layout: rows token t sees per window
// Cell layout only:
//   masks      bool [windows][max_write][max_cells]   mask_w{W} = masks + buffer * max_write * max_cells
//   cell_pos   int32 [max_cells]            metadata mirror: position, -1 = free
//   owner_words uint64 [Words][max_cells]   metadata mirror: word w of each cell's owner bitset
//   tile stats (TileStatsView)              per 64-cell tile: positions, count, owner OR / AND
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cellkv/cuda/memory.hpp"
#include "cellkv/cuda/stream.hpp"
#include "cellkv/host_device.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

inline constexpr std::int32_t kMaxWindows = 8;
inline constexpr int kTileRows = 64;  // cells per KV tile of the fast kernels; clustered<64> fills whole tiles

// Per 64-cell tile: smallest and largest position among occupied cells, occupied count.
struct TileStats {
  std::int32_t pmin;
  std::int32_t pmax;
  std::int32_t count;
  std::int32_t unused;
};

// The changed cells of one tile: entries [first, first + count) of the step's mirror entries.
struct TileGroup {
  std::int32_t tile;
  std::int32_t first;
  std::int32_t count;
};

// The cell layout's metadata on the device: the per-cell mirror and per-tile stats (with the OR
// and AND of the owner words over each tile's occupied cells, [Words][max_tiles]).
struct TileStatsView {
  std::int32_t* cell_pos = nullptr;
  std::uint64_t* owner_words = nullptr;
  std::int64_t max_cells = 0;
  TileStats* stats = nullptr;
  std::uint64_t* tile_or = nullptr;
  std::uint64_t* tile_and = nullptr;
  std::int32_t max_tiles = 0;
};

// The distinct windows of a window set, by buffer index, passed to kernels by value.
struct WindowList {
  std::int32_t w[kMaxWindows] = {};
};

// One changed cell for the metadata mirror.
template <std::int32_t Words>
struct MirrorEntry {
  std::int32_t cell = 0;
  std::int32_t pos = -1;
  std::uint64_t owners[Words] = {};
};

// Device addresses of the step buffers; trivially copyable, fixed for the cache's life.
struct StepBindings {
  std::int64_t* cells = nullptr;
  std::int64_t* read_len = nullptr;
  std::int32_t* token_seq = nullptr;
  std::int32_t* token_pos = nullptr;
  std::int32_t* tokens = nullptr;
  std::int32_t* num_segments = nullptr;
  Segment* segments = nullptr;
  RowRange* ranges = nullptr;
  bool* masks = nullptr;
  std::int32_t* cell_pos = nullptr;
  std::uint64_t* owner_words = nullptr;
  TileStatsView tiles;  // cell layout
  std::int32_t max_write = 0;
  std::int64_t max_cells = 0;  // mask row stride; 0 for the sequence layout
  std::int32_t windows = 0;

  CELLKV_HOST_DEVICE bool* mask(std::int32_t buffer) const { return masks + buffer * max_write * max_cells; }
  CELLKV_HOST_DEVICE RowRange* ranges_of(std::int32_t buffer) const { return ranges + buffer * max_write; }
};

// Byte offsets of the step block's parts (identical on host staging and device).
struct StepBlockLayout {
  std::size_t cells = 0, read_len = 0, tokens = 0, num_segments = 0, token_seq = 0, token_pos = 0, segments = 0,
              ranges = 0, bytes = 0;

  StepBlockLayout(std::int32_t max_write, std::int32_t windows, bool with_ranges) {
    const auto w = static_cast<std::size_t>(max_write);
    read_len = cells + 8 * w;
    tokens = read_len + 8;
    num_segments = tokens + 4;
    token_seq = num_segments + 4;
    token_pos = token_seq + 4 * w;
    segments = (token_pos + 4 * w + 15) / 16 * 16;
    ranges = segments + sizeof(Segment) * w;
    bytes = ranges + (with_ranges ? sizeof(RowRange) * w * static_cast<std::size_t>(windows) : 0);
  }
};

// Host staging of one step, page-locked, reused every other step (double buffering): the step
// block, then the changed cells' mirror entries (sorted by cell), then their tile groups, uploaded
// in one copy. `done` is recorded after the upload that read it.
template <std::int32_t Words>
struct StepStaging {
  PinnedBuffer<std::byte> block;
  MirrorEntry<Words>* entries = nullptr;  // inside `block`, after the step block
  Event done;
};

// The device side of the step: buffers at fixed addresses plus two staging slots.
template <std::int32_t Words>
class StepBuffers {
 public:
  // max_cells = 0 (sequence layout) allocates ranges instead of masks and mirror.
  StepBuffers(std::int32_t max_write, std::int64_t max_cells, std::int32_t windows)
      : layout_(max_write, windows, max_cells == 0),
        entries_at_((layout_.bytes + 15) / 16 * 16),
        block_(entries_at_ + (sizeof(MirrorEntry<Words>) + sizeof(TileGroup)) * static_cast<std::size_t>(max_cells)),
        masks_(static_cast<std::size_t>(windows) * static_cast<std::size_t>(max_write) * static_cast<std::size_t>(max_cells)),
        cell_pos_(static_cast<std::size_t>(max_cells)),
        owner_words_(static_cast<std::size_t>(max_cells) * Words),
        max_tiles_(static_cast<std::int32_t>((max_cells + kTileRows - 1) / kTileRows)),
        stats_(static_cast<std::size_t>(max_tiles_)),
        tile_words_(2 * static_cast<std::size_t>(max_tiles_) * Words) {
    for (auto& s : slots_) {
      s.block = PinnedBuffer<std::byte>(block_.size());
      s.entries = reinterpret_cast<MirrorEntry<Words>*>(s.block.data() + entries_at_);
    }
    std::byte* base = block_.data();
    b_.cells = reinterpret_cast<std::int64_t*>(base + layout_.cells);
    b_.read_len = reinterpret_cast<std::int64_t*>(base + layout_.read_len);
    b_.token_seq = reinterpret_cast<std::int32_t*>(base + layout_.token_seq);
    b_.token_pos = reinterpret_cast<std::int32_t*>(base + layout_.token_pos);
    b_.tokens = reinterpret_cast<std::int32_t*>(base + layout_.tokens);
    b_.num_segments = reinterpret_cast<std::int32_t*>(base + layout_.num_segments);
    b_.segments = reinterpret_cast<Segment*>(base + layout_.segments);
    b_.ranges = max_cells == 0 ? reinterpret_cast<RowRange*>(base + layout_.ranges) : nullptr;
    b_.masks = masks_.data();
    b_.cell_pos = cell_pos_.data();
    b_.owner_words = owner_words_.data();
    b_.tiles = TileStatsView{cell_pos_.data(), owner_words_.data(), max_cells, stats_.data(), tile_words_.data(),
                             tile_words_.data() + static_cast<std::size_t>(max_tiles_) * Words, max_tiles_};
    b_.max_write = max_write;
    b_.max_cells = max_cells;
    b_.windows = windows;
    if (max_cells > 0) {  // an empty mirror: every cell free
      CELLKV_CUDA_THROW(cudaMemset(cell_pos_.data(), 0xff, cell_pos_.bytes()));
      CELLKV_CUDA_THROW(cudaMemset(owner_words_.data(), 0, owner_words_.bytes()));
      CELLKV_CUDA_THROW(cudaMemset(stats_.data(), 0, stats_.bytes()));  // count 0: every tile empty
      CELLKV_CUDA_THROW(cudaMemset(tile_words_.data(), 0, tile_words_.bytes()));
    }
    CELLKV_CUDA_THROW(cudaMemset(block_.data(), 0, block_.bytes()));
    for (auto& slot : slots_) std::memset(slot.block.data(), 0, slot.block.bytes());
    CELLKV_CUDA_THROW(cudaDeviceSynchronize());
  }

  [[nodiscard]] const StepBindings& bindings() const noexcept { return b_; }
  [[nodiscard]] const StepBlockLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::byte* device_block() const noexcept { return block_.data(); }
  [[nodiscard]] MirrorEntry<Words>* device_entries() const noexcept {
    return reinterpret_cast<MirrorEntry<Words>*>(block_.data() + entries_at_);
  }
  // Bytes to upload for a step with `changed` mirror entries in `groups` tile groups.
  [[nodiscard]] std::size_t upload_bytes(std::size_t changed, std::size_t groups) const noexcept {
    return changed == 0 ? layout_.bytes : entries_at_ + sizeof(MirrorEntry<Words>) * changed + sizeof(TileGroup) * groups;
  }
  // The staging slot for the next upload (alternates); the caller waits on its `done` first.
  [[nodiscard]] StepStaging<Words>& next_slot() noexcept {
    next_ ^= 1;
    return slots_[next_ ^ 1];
  }
  // Blocks until every upload that read staging memory is done (destruction, tests).
  [[nodiscard]] Status wait_idle() const {
    for (const auto& s : slots_)
      if (const Status st = s.done.synchronize(); !st.ok()) return st;
    return {};
  }

 private:
  StepBlockLayout layout_;
  std::size_t entries_at_;         // byte offset of the mirror entries in the block
  DeviceBuffer<std::byte> block_;  // step block, then up to max_cells mirror entries
  DeviceBuffer<bool> masks_;
  DeviceBuffer<std::int32_t> cell_pos_;
  DeviceBuffer<std::uint64_t> owner_words_;
  std::int32_t max_tiles_;
  DeviceBuffer<TileStats> stats_;
  DeviceBuffer<std::uint64_t> tile_words_;  // tile OR words, then tile AND words
  StepStaging<Words> slots_[2];
  int next_ = 0;
  StepBindings b_;
};

}  // namespace cellkv::gpu
