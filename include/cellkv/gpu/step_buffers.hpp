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

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/gpu/step_views.hpp"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/position_table.hpp"
#include "cellkv/step_block.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

// The device side of the step: the step block at a fixed address, the position table's device
// copy (cell layout), and two pinned staging slots. Masks are owned by the shard (allocated on
// first request).
class StepBuffers {
 public:
  // table_entries: ints of the position table's flat array (0: sequence layout, no table).
  StepBuffers(const StepBlockShape& shape, std::int64_t table_entries, std::int32_t dir_entries,
              std::int32_t dir_stride)
      : shape_(shape), layout_(shape), block_(layout_.bytes), table_(static_cast<std::size_t>(table_entries)) {
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
    b_.table_flat = table_.data();
    b_.table = PositionTableView{table_.data(), table_.data() + dir_entries, dir_stride};
    b_.max_write = shape.max_write;
    b_.windows = shape.windows;
    b_.fault = fault_.device_data();
    CELLKV_CUDA_THROW(cudaMemset(block_.data(), 0, block_.bytes()));
    if (table_.size() > 0) CELLKV_CUDA_THROW(cudaMemset(table_.data(), 0xff, table_.bytes()));  // every entry -1
    CELLKV_CUDA_THROW(cudaDeviceSynchronize());
  }

  [[nodiscard]] const StepBindings& bindings() const noexcept { return b_; }
  [[nodiscard]] StepBindings& bindings() noexcept { return b_; }
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
  DeviceBuffer<std::int32_t> table_;  // the position table's device copy (cell layout)
  Slot slots_[2];
  MappedBuffer<std::uint32_t> fault_{kFaultWords};  // the fault words
  int next_ = 0;
  StepBindings b_;
};

}  // namespace cellkv::gpu
