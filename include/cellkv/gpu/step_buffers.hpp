// cellkv/gpu/step_buffers.hpp - owners of the runtime-bound buffers (step_views.hpp lists them),
// allocated once at fixed device addresses, and the pinned staging they are uploaded from.
//
// A step is uploaded in one host-to-device copy of the "step block" (step_block.hpp): the
// per-token arrays, the segments, every window's attention work, the sequence layout's row ranges,
// the step's shared prefixes (cell layout), then the pending position-table writes (cell layout).
// Staging is double-buffered: the next upload fills the other slot while the previous copy may
// still be in flight.
//
// The fault words: kFaultWords words of mapped pinned host memory that device code sets when it
// meets a bad index (kFaultBadRow: write_kv met a row outside the pool) or a replayed graph lacks a
// kernel the step needs (kFaultMissingKernel, graph_scope.hpp). The host reads them without a copy
// or a synchronisation; take_fault() reports and clears them (docs/design.md section 5).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/gpu/step_views.hpp"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/position_table.hpp"
#include "cellkv/step_block.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

// A position table's geometry on the device: ints of its flat array, of its directory, and the
// directory's row stride (PositionTable).
struct TableGeometry {
  std::int64_t entries = 0;
  std::int64_t dir_entries = 0;
  std::int32_t dir_stride = 0;
};

// The device side of the step: the step block at a fixed address, the position tables' device
// copies (cell layout: the main pool's, then each window pool's, in one array), and two pinned
// staging slots. Masks are owned by the shard (allocated on first request).
class StepBuffers {
 public:
  // tables: the main pool's table, then each window pool's (shape.window_pools of them); empty for
  // the sequence layout (no table).
  StepBuffers(const StepBlockShape& shape, std::span<const TableGeometry> tables)
      : shape_(shape), layout_(shape), block_(layout_.bytes), table_(total_entries(tables)) {
    for (auto& s : slots_) {
      s.block = PinnedBuffer<std::byte>(block_.size());
      std::memset(s.block.data(), 0, s.block.bytes());
    }
    std::byte* base = block_.data();
    b_.cells = reinterpret_cast<std::int64_t*>(base + layout_.cells);
    b_.read_len = reinterpret_cast<std::int64_t*>(base + layout_.read_len);
    b_.token_seq = reinterpret_cast<std::int32_t*>(base + layout_.token_seq);
    b_.token_pos = reinterpret_cast<std::int32_t*>(base + layout_.token_pos);
    b_.tokens = reinterpret_cast<std::int32_t*>(base + layout_.tokens);
    b_.num_segments = reinterpret_cast<std::int32_t*>(base + layout_.num_segments);
    b_.segments = reinterpret_cast<Segment*>(base + layout_.segments);
    for (std::int32_t w = 0; w < shape.windows; ++w) b_.work[w] = layout_.work_at(base, w, shape.max_write);
    b_.ranges = shape.ranges ? reinterpret_cast<RowRange*>(base + layout_.ranges) : nullptr;
    b_.shared = layout_.shared_at(base, shape);
    std::int64_t at = 0;
    for (const TableGeometry& t : tables) {
      table_offset_.push_back(static_cast<std::int32_t>(at));
      table_views_.push_back(PositionTableView{table_.data() + at, table_.data() + at + t.dir_entries, t.dir_stride});
      at += t.entries;
    }
    b_.table_flat = table_.data();
    if (!tables.empty()) b_.table = table_views_[0];
    b_.max_write = shape.max_write;
    b_.windows = shape.windows;
    b_.fault = fault_.device_data();
    CELLKV_CUDA_THROW(cudaMemset(block_.data(), 0, block_.bytes()));
    if (table_.size() > 0) CELLKV_CUDA_THROW(cudaMemset(table_.data(), 0xff, table_.bytes()));  // every entry -1
    CELLKV_CUDA_THROW(cudaDeviceSynchronize());
  }

  [[nodiscard]] const StepBindings& bindings() const noexcept { return b_; }
  [[nodiscard]] StepBindings& bindings() noexcept { return b_; }
  // The bindings of the layers of pool p (0: the main pool; 1 + i: window pool i): the main
  // bindings with that pool's written rows, read_len and table, and no shared prefixes (window
  // pools read their positions themselves: at most their window, docs/design.md).
  [[nodiscard]] StepBindings pool_bindings(std::int32_t p) const noexcept {
    if (p == 0) return b_;
    StepBindings b = b_;
    std::byte* base = block_.data();
    b.cells = reinterpret_cast<std::int64_t*>(base + layout_.window_cells) + static_cast<std::int64_t>(p - 1) * shape_.max_write;
    b.read_len = reinterpret_cast<std::int64_t*>(base + layout_.window_read_len) + (p - 1);
    b.table = table_views_[static_cast<std::size_t>(p)];
    b.shared = SharedWork{};
    return b;
  }
  // Where pool p's table starts in the flat array that table writes index (TableWrite::index).
  [[nodiscard]] std::int32_t table_offset(std::int32_t p) const noexcept {
    return table_offset_[static_cast<std::size_t>(p)];
  }
  [[nodiscard]] const StepBlockLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] const StepBlockShape& shape() const noexcept { return shape_; }
  [[nodiscard]] std::byte* device_block() const noexcept { return block_.data(); }
  [[nodiscard]] TableWrite* device_table_writes() const noexcept {
    return reinterpret_cast<TableWrite*>(block_.data() + layout_.table_writes);
  }
  // Bytes to upload for a step block carrying `writes` table writes.
  [[nodiscard]] std::size_t upload_bytes(std::size_t writes) const noexcept {
    return layout_.table_writes + sizeof(TableWrite) * writes;
  }

  // A staging slot; `done` is recorded after the copy that read it.
  struct Slot {
    PinnedBuffer<std::byte> block;
    Event done;
    [[nodiscard]] TableWrite* table_writes(const StepBlockLayout& l) const {
      return reinterpret_cast<TableWrite*>(block.data() + l.table_writes);
    }
  };
  // The staging slot for the next copy (alternates); the caller waits on its `done` first.
  [[nodiscard]] Slot& next_slot() noexcept {
    next_ ^= 1;
    return slots_[next_ ^ 1];
  }
  // The faults device code reported since the last call (kFault* bits of every word), cleared. A
  // fault set by work still running may show at a later call.
  [[nodiscard]] std::uint32_t take_fault() noexcept {
    std::uint32_t faults = 0;
    for (int i = 0; i < kFaultWords; ++i) {
      std::atomic_ref<std::uint32_t> word(fault_.data()[i]);
      if (word.load(std::memory_order_acquire) != 0) faults |= word.exchange(0, std::memory_order_acq_rel);
    }
    return faults;
  }

  // Blocks until every copy that read staging memory is done (destruction, tests).
  [[nodiscard]] Status wait_idle() const {
    for (const auto& s : slots_)
      if (const Status st = s.done.synchronize(); !st.ok()) return st;
    return {};
  }

 private:
  StepBlockShape shape_;
  StepBlockLayout layout_;
  DeviceBuffer<std::byte> block_;
  static std::size_t total_entries(std::span<const TableGeometry> tables) {
    std::int64_t n = 0;
    for (const TableGeometry& t : tables) n += t.entries;
    return static_cast<std::size_t>(n);
  }

  DeviceBuffer<std::int32_t> table_;  // the position tables' device copies (cell layout)
  std::vector<std::int32_t> table_offset_;  // [pools] where each pool's table starts in table_
  std::vector<PositionTableView> table_views_;  // [pools]
  Slot slots_[2];
  MappedBuffer<std::uint32_t> fault_{kFaultWords};  // the fault words
  int next_ = 0;
  StepBindings b_;
};

}  // namespace cellkv::gpu
