// cellkv/cuda/fast_path.cuh - the fast attention path of a cache: per-step planning buffers at
// fixed addresses (tile stats, per-window tile lists and work items, split-KV partials) and the
// launchers of the planning and attention kernels.
//
// Per step (eager, in DeviceCache::upload):  plan_tiles (tile lists, then work items; one launch)
// Per layer (capturable: fixed grids):        decode_attention + prefill_attention -> merge_splits
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cellkv/cuda/dispatch.cuh"
#include "cellkv/cuda/error.hpp"
#include "cellkv/cuda/kernels/fast_attention.cuh"
#include "cellkv/cuda/kernels/tile_plan.cuh"
#include "cellkv/cuda/memory.hpp"
#include "cellkv/cuda/step_buffers.hpp"

namespace cellkv::gpu {

// The fast path serves, written out: element types __nv_bfloat16 and __half (fp32 accumulation),
// head dims 64, 128 and 256, any H_q that is a multiple of H_kv. fp32 storage and other head dims
// use the reference kernel.
template <class T>
inline constexpr bool kFastElement = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

template <class T>
bool fast_path_supports(std::int32_t head_dim, std::int32_t heads_q, std::int32_t heads_kv) {
  return kFastElement<T> && (head_dim == 64 || head_dim == 128 || head_dim == 256) && heads_kv > 0 && heads_q > 0 &&
         heads_q % heads_kv == 0;
}

// Pipeline depths by head dim (shared memory per block stays <= ~200 KB).
template <int D>
inline constexpr int kDecodeStages = D == 64 ? 4 : D == 128 ? 3 : 2;
template <int D>
inline constexpr int kPrefillStages = 2;
#ifndef CELLKV_PREFILL_WARPS
#define CELLKV_PREFILL_WARPS 4
#endif
// Warps of the prefill kernel (16 query rows each): 4 gives 64-row items and two blocks per SM.
inline constexpr int kPrefillWarps = CELLKV_PREFILL_WARPS;

struct FastShape {
  std::int64_t rows = 0;  // pool rows
  std::int32_t max_write = 0;
  std::int32_t windows = 0;  // distinct windows
  std::int32_t heads_q = 0, heads_kv = 0, head_dim = 0;
  std::int32_t max_len = 0;  // sequence layout: rows per slot; 0: cell layout
};

template <class T, std::int32_t Words, bool Cells>
class FastPath {
  using Meta = std::conditional_t<Cells, kernels::CellMeta, kernels::SlotMeta>;

 public:
  // Throws cellkv::gpu::Error when allocation or a CUDA query fails. Precondition: supported shape.
  FastPath(const FastShape& shape, const WindowList& windows) : shape_(shape) {
    max_tiles_ = static_cast<std::int32_t>((shape.rows + kTileRows - 1) / kTileRows);
    int device = 0, sms = 0;
    CELLKV_CUDA_THROW(cudaGetDevice(&device));
    CELLKV_CUDA_THROW(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    (void)dispatch_head_dim(shape.head_dim, [&](auto d) {
      return drive<decltype(d)::value>(nullptr, nullptr, 0, nullptr, &grids_, sms);
    });
    const std::int32_t group = shape.heads_q / shape.heads_kv, rows = 16 * kPrefillWarps;
    // Decode items x heads to aim for: one wave of the persistent decode grid.
    limits_ = PlanLimits{max_tiles_,
                         grids_.decode / shape.heads_kv + shape.max_write + 1,
                         (shape.max_write * group + rows - 1) / rows + shape.max_write,
                         grids_.decode,
                         shape.heads_kv,
                         group,
                         rows};
    allocate(windows);
  }

  // Builds every window's tile lists and work items for the uploaded step (eager; one launch).
  // Precondition: num_segments >= 1 (a placed step has a token).
  Status plan(const StepBindings& b, std::int32_t num_segments, ::cuda::stream_ref stream) const {
    kernels::plan_tiles<Meta><<<dim3(static_cast<unsigned>(num_segments), static_cast<unsigned>(shape_.windows)),
                                kPlanThreads, 0, stream.get()>>>(meta(b), b.segments, b.num_segments, b.read_len,
                                                                 plans_.data(), windows_.data(), limits_, done_.data());
    return detail::last_launch();
  }

  // Attention of one layer through window buffer `buffer`: q, out [width, H_q, D]; padding rows
  // of out are zeros. Capturable: grids depend on the cache's sizes only.
  Status attend(std::int32_t buffer, std::int32_t window, const T* q, T* out, PoolView<const T> pool,
                const StepBindings& b, std::int32_t width, float scale, ::cuda::stream_ref stream) const {
    if (scale == 0.f) scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
    const kernels::FastArgs<T> a{q, out, pool, shape_.heads_q, scale * kernels::kLog2e, window, b.segments,
                                 b.num_segments, b.tokens, host_plans_[static_cast<std::size_t>(buffer)], max_tiles_,
                                 partial_o_.data(), partial_lse_.data()};
    const Meta m = meta(b);
    Grids grids = grids_;
    return dispatch_head_dim(shape_.head_dim, [&](auto d) {
      return drive<decltype(d)::value>(&a, &m, width, stream.get(), &grids, 0);
    });
  }

  // Host copy of a window's work-item counts {decode, prefill} of the last plan (tests, tools).
  Status item_counts(std::int32_t buffer, std::int32_t (&counts)[2]) const {
    CELLKV_CUDA_STATUS(cudaMemcpy(counts, host_plans_[static_cast<std::size_t>(buffer)].counts, sizeof(counts),
                                 cudaMemcpyDeviceToHost));
    return {};
  }

 private:
  static constexpr unsigned kMergeBlocks = 132;

  struct Grids {
    int decode = 0, prefill = 0;
  };

  // The attention kernels of head dim D: configures them (a == nullptr: sizes the persistent grids
  // from occupancy) or launches them. The dynamic shared-memory limit is raised right before use,
  // in the same code as the launch, every time (as FlashAttention does): a template kernel
  // instantiated in several translation units has one registration per unit, and an attribute set
  // through one unit's kernel pointer does not reach a launch made through another's.
  template <int D>
  static Status drive(const kernels::FastArgs<T>* a, const Meta* m, std::int32_t width, cudaStream_t stream,
                      Grids* grids, int sms) {
    constexpr int dec_smem = kernels::decode_smem_bytes<D, kDecodeStages<D>>();
    constexpr int pre_smem = kernels::prefill_smem_bytes<D, kPrefillStages<D>, kPrefillWarps>();
    auto* dec = kernels::decode_attention<T, D, kDecodeStages<D>, Meta>;
    auto* pre = kernels::prefill_attention<T, D, kPrefillStages<D>, kPrefillWarps, Meta>;
    CELLKV_CUDA_STATUS(cudaFuncSetAttribute(dec, cudaFuncAttributeMaxDynamicSharedMemorySize, dec_smem));
    CELLKV_CUDA_STATUS(cudaFuncSetAttribute(pre, cudaFuncAttributeMaxDynamicSharedMemorySize, pre_smem));
    if (a == nullptr) {
      int dec_blocks = 0, pre_blocks = 0;
      CELLKV_CUDA_STATUS(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&dec_blocks, dec, 128, dec_smem));
      CELLKV_CUDA_STATUS(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&pre_blocks, pre, 32 * kPrefillWarps, pre_smem));
      grids->decode = sms * (dec_blocks > 0 ? dec_blocks : 1);
      grids->prefill = sms * (pre_blocks > 0 ? pre_blocks : 1);
      return {};
    }
    dec<<<grids->decode, 128, dec_smem, stream>>>(*a, *m);
    pre<<<grids->prefill, 32 * kPrefillWarps, pre_smem, stream>>>(*a, *m);
    kernels::merge_splits<T, D><<<kMergeBlocks, 128, 0, stream>>>(a->out, a->partial_o, a->partial_lse, a->segments,
                                                                  a->num_segments, a->plan.splits, a->tokens, width,
                                                                  a->heads_q, a->pool.heads_kv);
    return detail::last_launch();
  }

  void allocate(const WindowList& windows) {
    const auto w = static_cast<std::size_t>(shape_.windows), mw = static_cast<std::size_t>(shape_.max_write);
    lists_ = DeviceBuffer<std::int32_t>(w * mw * static_cast<std::size_t>(max_tiles_));
    tile_counts_ = DeviceBuffer<std::int32_t>(w * mw);
    decode_ = DeviceBuffer<DecodeWork>(w * static_cast<std::size_t>(limits_.max_decode));
    prefill_ = DeviceBuffer<PrefillWork>(w * static_cast<std::size_t>(limits_.max_prefill));
    splits_ = DeviceBuffer<SplitInfo>(w * mw);
    counts_ = DeviceBuffer<std::int32_t>(2 * w);
    CELLKV_CUDA_THROW(cudaMemset(counts_.data(), 0, counts_.bytes()));
    done_ = DeviceBuffer<unsigned>(1);
    CELLKV_CUDA_THROW(cudaMemset(done_.data(), 0, done_.bytes()));
    for (std::size_t i = 0; i < w; ++i)
      host_plans_.push_back(WindowPlan{lists_.data() + i * mw * static_cast<std::size_t>(max_tiles_),
                                       tile_counts_.data() + i * mw, decode_.data() + i * static_cast<std::size_t>(limits_.max_decode),
                                       prefill_.data() + i * static_cast<std::size_t>(limits_.max_prefill), splits_.data() + i * mw,
                                       counts_.data() + 2 * i});
    plans_ = DeviceBuffer<WindowPlan>(w);
    CELLKV_CUDA_THROW(cudaMemcpy(plans_.data(), host_plans_.data(), plans_.bytes(), cudaMemcpyHostToDevice));
    windows_ = DeviceBuffer<std::int32_t>(w);
    CELLKV_CUDA_THROW(cudaMemcpy(windows_.data(), windows.w, windows_.bytes(), cudaMemcpyHostToDevice));
    const auto slots = static_cast<std::size_t>(limits_.max_decode) * static_cast<std::size_t>(shape_.heads_kv) * kDecodeRows;
    partial_o_ = DeviceBuffer<float>(slots * static_cast<std::size_t>(shape_.head_dim));
    partial_lse_ = DeviceBuffer<float>(slots);
  }

  [[nodiscard]] Meta meta(const StepBindings& b) const {
    if constexpr (Cells)
      return Meta::of(b.tiles);
    else
      return Meta{shape_.max_len};
  }

  FastShape shape_;
  std::int32_t max_tiles_ = 0;
  Grids grids_;
  PlanLimits limits_;
  DeviceBuffer<std::int32_t> lists_, tile_counts_, counts_, windows_;
  DeviceBuffer<DecodeWork> decode_;
  DeviceBuffer<PrefillWork> prefill_;
  DeviceBuffer<SplitInfo> splits_;
  DeviceBuffer<WindowPlan> plans_;
  std::vector<WindowPlan> host_plans_;
  DeviceBuffer<float> partial_o_, partial_lse_;
  DeviceBuffer<unsigned> done_;  // blocks of plan_tiles done; its last block schedules, then resets it
};

}  // namespace cellkv::gpu
