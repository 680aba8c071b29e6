// cellkv/gpu/step_views.hpp - device addresses of a cache's runtime-bound buffers, as trivially
// copyable views: what kernels and launchers receive (the owners live in step_buffers.hpp).
//
// Fixed for the cache's life, so a CUDA graph captured over a forward replays for any later step:
//   cells      int64 [max_write]            row written by token t (the scratch row for padding)
//   read_len   int64 [1]                    1 + highest occupied row after placement
//   token_seq  int32 [max_write]            sequence of token t, -1 for padding
//   token_pos  int32 [max_write]            position of token t
//   tokens     int32 [1]                    T (real tokens; the rest of the width is padding)
//   segments   Segment [max_write], num_segments int32 [1]
//   work       per window buffer: WindowWork (attention_plan.hpp)
//   ranges     RowRange [windows][max_write] sequence layout: rows token t sees (reference kernel)
//   shared     SharedWork: the step's shared-prefix runs, items, partial slots (cell layout)
//   table      the position table (cell layout; PositionTableView)
//   masks      bool [windows][max_write][max_cells] mask_w{W} = masks + buffer * max_write * max_cells
//   fault      uint32 [kFaultWords], mapped host memory: word i holds the faults of reporter i
//              (kFault* bits, set by device code; step_buffers.hpp)
// With window storage, the layers of a window pool get the same bindings with that pool's cells,
// read_len and table (StepBuffers::pool_bindings; the step block's window_cells, window_read_len)
// and no shared prefixes.
#pragma once

#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/host_device.hpp"
#include "cellkv/position_table_view.hpp"
#include "cellkv/prefix_sharing.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

inline constexpr std::int32_t kMaxWindows = 8;

// Bits of the fault words. Each reporter stores into its own word (a plain store, no atomics on
// mapped host memory), so one fault never overwrites another.
inline constexpr std::uint32_t kFaultBadRow = 1;         // word 0: write_kv met a row outside [0, rows]
inline constexpr std::uint32_t kFaultMissingKernel = 2;  // word 1: a replayed graph lacks a kernel
inline constexpr int kFaultWordMissingKernel = 1;        // the word kFaultMissingKernel is stored in
inline constexpr int kFaultWords = 2;

// The distinct windows of a window set, by buffer index, passed to kernels by value.
struct WindowList {
  std::int32_t w[kMaxWindows] = {};
};

struct StepBindings {
  std::int64_t* cells = nullptr;
  std::int64_t* read_len = nullptr;
  std::int32_t* token_seq = nullptr;
  std::int32_t* token_pos = nullptr;
  std::int32_t* tokens = nullptr;
  std::int32_t* num_segments = nullptr;
  Segment* segments = nullptr;
  WindowWork work[kMaxWindows] = {};
  RowRange* ranges = nullptr;   // sequence layout
  SharedWork shared;            // cell layout: the step's shared prefixes (prefix_sharing.hpp)
  PositionTableView table;      // cell layout
  std::int32_t* table_flat = nullptr;  // the table's flat array (directory, then pages)
  bool* masks = nullptr;        // cell layout; nullptr until a caller asks for masks
  std::uint32_t* fault = nullptr;  // the fault words (device address of mapped host memory)
  std::int32_t max_write = 0;
  std::int64_t max_cells = 0;  // mask row stride; 0 for the sequence layout
  std::int32_t windows = 0;

  CELLKV_HOST_DEVICE bool* mask(std::int32_t buffer) const {
    return masks + static_cast<std::int64_t>(buffer) * max_write * max_cells;
  }
  CELLKV_HOST_DEVICE RowRange* ranges_of(std::int32_t buffer) const { return ranges + buffer * max_write; }
};

}  // namespace cellkv::gpu
