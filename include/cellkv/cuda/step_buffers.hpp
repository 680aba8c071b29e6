// cellkv/cuda/step_buffers.hpp - owners of the runtime-bound buffers (step_views.hpp lists them),
// allocated once at fixed device addresses, and the pinned staging they are uploaded from.
//
// A step is uploaded in one host-to-device copy of the "step block": the per-token arrays, the
// segments, every window's attention work, the sequence layout's row ranges, the step's shared
// prefixes (cell layout), then the pending position-table writes (cell layout). Staging is double-buffered: the next upload fills the other
// slot while the previous copy may still be in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cellkv/attention_plan.hpp"
#include "cellkv/cuda/memory.hpp"
#include "cellkv/cuda/step_views.hpp"
#include "cellkv/cuda/stream.hpp"
#include "cellkv/position_table.hpp"
#include "cellkv/prefix_sharing.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

// Sizes of a step block, fixed at construction.
struct StepBlockShape {
  std::int32_t max_write = 0;
  std::int32_t windows = 0;
  std::int32_t max_prefill = 0;   // prefill items per window
  bool ranges = false;            // sequence layout: per-window row ranges
  std::int32_t max_table_writes = 0;  // position-table writes one upload carries (cell layout)
  std::int32_t max_runs = 0;      // shared-prefix runs per step (cell layout; 0: no sharing)
  std::int32_t shared_slots = 0;  // shared-prefix partial slots (and run tokens, items) per step
};

// Byte offsets of the step block's parts (identical on host staging and device).
struct StepBlockLayout {
  std::size_t cells = 0, read_len = 0, tokens = 0, num_segments = 0, token_seq = 0, token_pos = 0, segments = 0,
              work = 0, work_bytes = 0, ranges = 0, shared = 0, table_writes = 0, bytes = 0;
  // Inside the shared part: counts [2], own_begin [max_write], token_slots [max_write], runs
  // [max_runs], run_tokens [slots], run_slot [slots], run_extra [slots], items [slots].
  std::size_t own_begin = 0, token_slots = 0, runs = 0, run_tokens = 0, run_slot = 0, run_extra = 0, items = 0;

  explicit StepBlockLayout(const StepBlockShape& s) {
    const auto w = static_cast<std::size_t>(s.max_write);
    read_len = cells + 8 * w;
    tokens = read_len + 8;
    num_segments = tokens + 4;
    token_seq = num_segments + 4;
    token_pos = token_seq + 4 * w;
    segments = align16(token_pos + 4 * w);
    work = align16(segments + sizeof(Segment) * w);
    // per window: counts [2], decode_seg [w], decode_prefix [w + 1], prefill items
    work_bytes = align16(4 * (2 + w + w + 1) + sizeof(PrefillItem) * static_cast<std::size_t>(s.max_prefill));
    ranges = work + work_bytes * static_cast<std::size_t>(s.windows);
    shared = align16(ranges + (s.ranges ? sizeof(RowRange) * w * static_cast<std::size_t>(s.windows) : 0));
    const auto slots = static_cast<std::size_t>(s.shared_slots);
    own_begin = shared + 16;
    token_slots = align16(own_begin + 4 * w);
    runs = align16(token_slots + sizeof(SlotRange) * w);
    run_tokens = align16(runs + sizeof(SharedRun) * static_cast<std::size_t>(s.max_runs));
    run_slot = run_tokens + 4 * slots;
    run_extra = run_slot + 4 * slots;
    items = align16(run_extra + 4 * slots);
    const std::size_t shared_end = items + sizeof(SharedItem) * slots;
    table_writes = align16(s.shared_slots > 0 ? shared_end : shared);
    bytes = table_writes + sizeof(TableWrite) * static_cast<std::size_t>(s.max_table_writes);
  }

  // The shared-prefix arrays inside a block at `base` (all null without sharing).
  [[nodiscard]] SharedWork shared_at(std::byte* base, const StepBlockShape& s) const {
    if (s.shared_slots == 0) return {};
    auto ints = [&](std::size_t at) { return reinterpret_cast<std::int32_t*>(base + at); };
    return SharedWork{ints(shared),    reinterpret_cast<SharedRun*>(base + runs),
                      ints(run_tokens), ints(run_slot),
                      ints(run_extra),  reinterpret_cast<SharedItem*>(base + items),
                      ints(own_begin),  reinterpret_cast<SlotRange*>(base + token_slots)};
  }

  // Window buffer b's work arrays inside a block at `base`.
  [[nodiscard]] WindowWork work_at(std::byte* base, std::int32_t b, std::int32_t max_write) const {
    std::byte* at = base + work + work_bytes * static_cast<std::size_t>(b);
    auto* ints = reinterpret_cast<std::int32_t*>(at);
    const auto w = static_cast<std::size_t>(max_write);
    return WindowWork{ints, ints + 2, ints + 2 + w,
                      reinterpret_cast<PrefillItem*>(at + align16(4 * (2 + w + w + 1)))};
  }

 private:
  static constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }
};

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
  int next_ = 0;
  StepBindings b_;
};

}  // namespace cellkv::gpu
