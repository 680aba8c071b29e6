// cellkv/gpu/kernels/layer_args.cuh - the arguments both table-driven attention kernels take for
// one layer: queries and outputs, the layer's pool, where its rows live, the window and the
// window's work in the uploaded step, and the shared-prefix results to fold into the outputs.
// Trivially copyable; passed by value.
//
// S is what the pool stores: T itself, or Fp8E4M3 codes with an fp32 scale per row-head
// (Fp8PoolView, fp8_pool_view.hpp); queries and outputs are T either way.
#pragma once

#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/kernels/shared_fold.cuh"
#include "cellkv/gpu/kv_views.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu::kernels {

// Rows: TableRows (cell layout) or SlotRows (sequence layout), tile_rows.cuh. S: T or Fp8E4M3.
template <class T, class Rows, class S = T>
struct LayerArgs {
  const T* q = nullptr;  // [width, heads_q, D]
  T* out = nullptr;      // [width, heads_q, D]
  ReadView<S> pool;      // PoolView<const T>, or Fp8PoolView<const Fp8E4M3>
  Rows rows;
  std::int32_t heads_q = 0;
  float scale_log2 = 0;  // scale * log2(e)
  std::int32_t window = 0;
  const Segment* segments = nullptr;
  WindowWork work;
  SharedFold shared;  // the shared-prefix partials to fold in (prefix_sharing.hpp)
};

}  // namespace cellkv::gpu::kernels
