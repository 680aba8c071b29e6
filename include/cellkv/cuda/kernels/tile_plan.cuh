// cellkv/cuda/kernels/tile_plan.cuh - per-step planning on the device for the fast kernels:
//   tile_stats      per 64-cell tile: position range, occupied count, OR / AND of owner words
//   tile_lists      per window and segment: the tiles with at least one candidate cell, ascending
//   schedule        per window: decode work items (split-KV when few segments are long) and
//                   prefill work items (one per 128-row query tile)
//   merge_splits    per layer: log-sum-exp merge of a split segment's partial outputs
// All launched with grids that depend only on the cache's sizes; counts are read on the device.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cellkv/cuda/kernels/tile_meta.cuh"
#include "cellkv/cuda/numeric.cuh"
#include "cellkv/cuda/step_buffers.hpp"

namespace cellkv::gpu {

inline constexpr int kDecodeRows = 16;    // query rows (token x head) of a decode work item
inline constexpr int kPlanThreads = 256;
inline constexpr int kMaxSplits = 64;  // schedule never cuts a decode segment into more parts

struct DecodeWork {
  std::int32_t seg = 0;
  std::int32_t tile_begin = 0;  // range in the segment's tile list
  std::int32_t tile_end = 0;
  std::int32_t slot = -1;  // partial-output slot of a split segment, -1: write the output
};
struct PrefillWork {
  std::int32_t seg = 0;
  std::int32_t m_tile = 0;  // query rows [128 m_tile, 128 m_tile + 128) of the segment
};
struct SplitInfo {
  std::int32_t slot_base = 0;
  std::int32_t splits = 0;  // > 1: merge_splits combines slots [slot_base, slot_base + splits)
};

// Device addresses of one window's plan (fixed for the cache's life).
struct WindowPlan {
  std::int32_t* tile_list = nullptr;   // [max_write][max_tiles]
  std::int32_t* tile_count = nullptr;  // [max_write]
  DecodeWork* decode = nullptr;        // [max_decode]
  PrefillWork* prefill = nullptr;      // [max_prefill]
  SplitInfo* splits = nullptr;         // [max_write]
  std::int32_t* counts = nullptr;      // [2]: decode items, prefill items
};

// Limits the scheduler keeps to (sizes of the buffers above and of the partial outputs).
struct PlanLimits {
  std::int32_t max_tiles = 0;
  std::int32_t max_decode = 0;  // also the number of partial slots
  std::int32_t max_prefill = 0;
  std::int32_t target_items = 0;  // decode items x heads wanted to fill the GPU
  std::int32_t heads_kv = 0;
  std::int32_t group = 0;         // H_q / H_kv
  std::int32_t prefill_rows = 0;  // query rows of a prefill work item (16 x the prefill kernel's warps)
};

namespace kernels {

// One window's work items (one block of kPlanThreads threads). A segment whose rows (len x group)
// fit kDecodeRows is decoded: its tile list is cut into `splits` ranges so that all segments
// together give about target_items items; larger segments are prefilled in query tiles of
// prefill_rows rows, last tiles first (they see the most). tile_count is read through L2 (other
// blocks of the same launch wrote it).
inline __device__ void schedule_window(const Segment* __restrict__ segments, int n, const WindowPlan& plan, const PlanLimits& lim) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  using Reduce = cub::BlockReduce<long long, kPlanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int base_decode, base_prefill, base_slot;
  __shared__ long long total_tiles;
  auto is_decode = [&](int s) { return segments[s].len * lim.group <= kDecodeRows; };
  auto tiles_of = [&](int s) { return __ldcg(plan.tile_count + s); };

  long long mine = 0;
  for (int s = threadIdx.x; s < n; s += kPlanThreads) mine += is_decode(s) ? tiles_of(s) : 0;
  __syncthreads();
  const long long sum = Reduce(tmp.reduce).Sum(mine);
  if (threadIdx.x == 0) total_tiles = sum, base_decode = base_prefill = base_slot = 0;
  __syncthreads();
  // Tiles per decode item: spread the work over target_items, at least 4 tiles, at most kMaxSplits parts.
  const long long want = (total_tiles * lim.heads_kv + lim.target_items - 1) / lim.target_items;
  const int chunk = static_cast<int>(want < 4 ? 4 : want);

  for (int s0 = 0; s0 < n; s0 += kPlanThreads) {
    const int s = s0 + static_cast<int>(threadIdx.x);
    int splits = 0, m_tiles = 0, tiles = 0, my_chunk = chunk;
    if (s < n) {
      tiles = tiles_of(s);
      if (is_decode(s)) {  // about tiles / chunk parts of equal size (rounded, so a lone extra tile adds no part)
        my_chunk = max(chunk, (tiles + kMaxSplits - 1) / kMaxSplits);
        splits = min(kMaxSplits, max(1, (tiles + my_chunk / 2) / my_chunk));
      } else {
        m_tiles = (segments[s].len * lim.group + lim.prefill_rows - 1) / lim.prefill_rows;
      }
    }
    int at_d = 0, tot_d = 0, at_p = 0, tot_p = 0, at_s = 0, tot_s = 0;
    Scan(tmp.scan).ExclusiveSum(splits, at_d, tot_d);
    __syncthreads();
    Scan(tmp.scan).ExclusiveSum(m_tiles, at_p, tot_p);
    __syncthreads();
    Scan(tmp.scan).ExclusiveSum(splits > 1 ? splits : 0, at_s, tot_s);
    const bool fits = base_decode + tot_d <= lim.max_decode && base_prefill + tot_p <= lim.max_prefill;
    if (s < n && fits) {
      for (int i = 0; i < splits; ++i) {
        const int b = static_cast<int>(static_cast<long long>(tiles) * i / splits);
        const int e = static_cast<int>(static_cast<long long>(tiles) * (i + 1) / splits);
        plan.decode[base_decode + at_d + i] = DecodeWork{s, b, e, splits > 1 ? base_slot + at_s + i : -1};
      }
      for (int i = 0; i < m_tiles; ++i) plan.prefill[base_prefill + at_p + i] = PrefillWork{s, m_tiles - 1 - i};
      plan.splits[s] = SplitInfo{base_slot + at_s, splits};
    }
    __syncthreads();
    if (threadIdx.x == 0 && fits) base_decode += tot_d, base_prefill += tot_p, base_slot += tot_s;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    plan.counts[0] = base_decode;
    plan.counts[1] = base_prefill;
  }
  __syncthreads();
}

// The candidate tiles of every segment for every window, in ascending tile order; then the last
// block to finish schedules every window's work items (so planning is one launch). Grid:
// (segments, windows); block: kPlanThreads. `done` is zero between launches.
template <class Meta>
__global__ void plan_tiles(Meta meta, const Segment* __restrict__ segments, const std::int32_t* __restrict__ num_segments,
                           const std::int64_t* __restrict__ read_len, const WindowPlan* plans, const std::int32_t* windows,
                           PlanLimits lim, unsigned* done) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int base;
  __shared__ bool last_block;
  const int s = blockIdx.x, n = *num_segments;
  if (s < n) {
    const WindowPlan plan = plans[blockIdx.y];
    const int window = windows[blockIdx.y];
    const Segment seg = segments[s];
    const int first = seg.pos0, last = seg.pos0 + seg.len - 1;
    const auto tiles = static_cast<int>((*read_len + kTileRows - 1) / kTileRows);
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (int t0 = 0; t0 < tiles; t0 += kPlanThreads) {
      const int t = t0 + static_cast<int>(threadIdx.x);
      const int keep = t < tiles && meta.classify(t, seg.seq, first, last, window) != kSkip;
      int at = 0, total = 0;
      Scan(scan).ExclusiveSum(keep, at, total);
      if (keep) plan.tile_list[static_cast<std::int64_t>(s) * lim.max_tiles + base + at] = t;
      __syncthreads();
      if (threadIdx.x == 0) base += total;
      __syncthreads();
    }
    if (threadIdx.x == 0) plan.tile_count[s] = base;
  }
  if (threadIdx.x == 0) {
    __threadfence();
    last_block = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  for (unsigned w = 0; w < gridDim.y; ++w) schedule_window(segments, n, plans[w], lim);
  if (threadIdx.x == 0) *done = 0;
}

// After the decode kernel: merges every split segment, and writes zeros to the padding rows
// [*tokens, width) (padding tokens see nothing). A block takes one (segment, KV head) at a time:
//   out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M), M = max_i lse_i (log2 domain); zeros when
//   every part saw nothing. Grid: any fixed size; block 128.
template <class T, int D>
__global__ void merge_splits(T* __restrict__ out, const float* __restrict__ partial_o, const float* __restrict__ partial_lse,
                             const Segment* __restrict__ segments, const std::int32_t* __restrict__ num_segments,
                             const SplitInfo* __restrict__ splits, const std::int32_t* __restrict__ tokens,
                             std::int32_t width, std::int32_t heads_q, std::int32_t heads_kv) {
  __shared__ float weight[kDecodeRows][kMaxSplits];
  __shared__ float inv_sum[kDecodeRows];
  const std::int64_t row_elems = static_cast<std::int64_t>(heads_q) * D;
  for (std::int64_t i = *tokens * row_elems + blockIdx.x * blockDim.x + threadIdx.x; i < width * row_elems;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(0.f);
  const int group = heads_q / heads_kv;
  for (int pair = blockIdx.x; pair < *num_segments * heads_kv; pair += gridDim.x) {
    const int s = pair / heads_kv, hk = pair % heads_kv;
    const SplitInfo info = splits[s];
    if (info.splits <= 1) continue;
    const Segment seg = segments[s];
    const int rows = seg.len * group, parts = info.splits;
    auto slot_row = [&](int p, int r) {
      return (static_cast<std::int64_t>(info.slot_base + p) * heads_kv + hk) * kDecodeRows + r;
    };
    __syncthreads();
    for (int i = threadIdx.x; i < rows * parts; i += blockDim.x) weight[i / parts][i % parts] = partial_lse[slot_row(i % parts, i / parts)];
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
      float top = -INFINITY, sum = 0.f;
      for (int p = 0; p < parts; ++p) top = fmaxf(top, weight[r][p]);
      for (int p = 0; p < parts; ++p) {
        weight[r][p] = top == -INFINITY ? 0.f : exp2f(weight[r][p] - top);
        sum += weight[r][p];
      }
      inv_sum[r] = sum > 0.f ? 1.f / sum : 0.f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
      const int r = i / D, d = i % D;
      float num[4] = {0.f, 0.f, 0.f, 0.f};  // four independent sums: loads of four parts in flight
      for (int p0 = 0; p0 < parts; p0 += 4) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (p0 + j < parts) num[j] += weight[r][p0 + j] * partial_o[slot_row(p0 + j, r) * D + d];
      }
      const int token = seg.tok0 + r / group, head = hk * group + r % group;
      out[(static_cast<std::int64_t>(token) * heads_q + head) * D + d] =
          from_float<T>((num[0] + num[1] + num[2] + num[3]) * inv_sum[r]);
    }
  }
}

}  // namespace kernels
}  // namespace cellkv::gpu
