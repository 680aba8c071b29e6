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
#include "cellkv/gpu/graph_scope.hpp"
#include "cellkv/gpu/step_views.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu::kernels {

// The check a layer's launches make when they replay a graph captured for fewer kernels than all
// (GraphScope::step_kinds, graph_scope.hpp): the first thread of each launched kernel sets
// kFaultMissingKernel when the uploaded step needs, in this window, a kernel the graph lacks.
struct LaunchGuard {
  StepKernels launched = StepKernels::all();  // all: nothing to check (eager launches, every_step graphs)
  std::uint32_t* fault = nullptr;             // the guard's fault word (step_views.hpp)
  const std::int32_t* tokens = nullptr;       // T on the device
  std::int32_t width = 0;
  const std::int32_t* shared_counts = nullptr;  // SharedWork::counts; nullptr without sharing

  // Call after the kernel's wait for prior grids, from every thread.
  __device__ void check(const WindowWork& work) const {
    if (launched == StepKernels::all() || blockIdx.x != 0 || threadIdx.x != 0) return;
    const StepKernels need = needed_kernels(work.decode_count(), work.prefill_count(), *tokens < width,
                                            shared_counts == nullptr ? 0 : shared_counts[1]);
    if (!launched.covers(need)) *reinterpret_cast<volatile std::uint32_t*>(fault) = kFaultMissingKernel;
  }
};

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
  LaunchGuard guard;
};

}  // namespace cellkv::gpu::kernels
