// cellkv/gpu/kernels/shared_prefix_attention.cuh - the shared prefixes of a step, each K/V tile
// read once for every sequence that shares it (prefix_sharing.hpp).
//
// Work item = (shared item, KV head): kSharedRows query rows of a run (its member tokens x the GQA
// heads of the KV head, 16 per warp) over one split of the run's positions, read through the
// position table of one member (every member holds the same pages there). Every query of a run
// lies past the run, so only a window can hide a held position from a row; mask_tile applies it per
// row, and masks the holes the shared pages hold for every member (absent columns).
// Each row's result goes to its token's partial slot for (run, split): the output normalized over
// what the split showed it, and the log2-sum-exp of its scores (-inf when it saw nothing).
// merge_shared_splits then merges the splits of every (run, token) into the slot of split 0, in
// parallel over tokens and heads; the kernels that read the tokens' own positions fold the split-0
// slots into the outputs (shared_fold.cuh).
//
// Runs before those kernels on the same stream. Grid: persistent (fixed); block: kPrefillWarps x
// 32 threads; dynamic smem: prefill_smem_bytes<D, Stages, S>(), Stages = prefill_stages(D), S what
// the pool stores (T, or Fp8E4M3: attend_block converts each fp8 tile, prefill_attention.cuh).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cellkv/gpu/kernels/prefill_attention.cuh"
#include "cellkv/prefix_sharing.hpp"

namespace cellkv::gpu::kernels {

static_assert(kSharedRows == kPrefillRows && kSharedTile == kPrefillTile, "shared items run the prefill block");

template <class T, class Rows, class S = T>
struct SharedArgs : LayerArgs<T, Rows, S> {
  SharedWork sharing;                       // the step's runs and items
  const std::int32_t* token_pos = nullptr;  // [T] position of each step token
  float* partial_o = nullptr;               // [slots][H_q][D]
  float* partial_lse = nullptr;             // [slots][H_q]
};

// Rows [row0, row0 + rows) of a run; row r is member token r / group (step token tokens[r / group],
// whose partial slot of split 0 is slots[r / group]), head r % group of the KV head's group.
// [lo, hi]: the lowest and highest query position of these rows.
struct SharedRows {
  const std::int32_t* tokens = nullptr;
  const std::int32_t* slots = nullptr;
  const std::int32_t* extra = nullptr;  // slot of split 1 of each member token
  const std::int32_t* token_pos = nullptr;
  int row0 = 0, rows = 0, group = 1;
  int lo = 0, hi = -1;
  __device__ int token(int r) const { return tokens[(row0 + r) / group]; }
  // Partial slot of row r's token for split k.
  __device__ int slot(int r, int k) const { return k == 0 ? slots[(row0 + r) / group] : extra[(row0 + r) / group] + k - 1; }
  __device__ int head(int hk, int r) const { return hk * group + (row0 + r) % group; }
  __device__ int qpos(int r) const { return token_pos[token(r)]; }
  __device__ int first() const { return lo; }
  __device__ int last() const { return hi; }
  // Rows [16 warp, 16 warp + 16) of these, with their own [lo, hi] (the whole warp calls it).
  __device__ SharedRows for_warp(int warp, int lane) const {
    SharedRows w = *this;
    w.row0 = row0 + 16 * warp;
    w.rows = max(0, min(16, rows - 16 * warp));
    const bool valid = lane < w.rows;
    const int q = valid ? w.qpos(lane) : 0;
    w.lo = __reduce_min_sync(0xffffffffu, valid ? q : INT_MAX);
    w.hi = __reduce_max_sync(0xffffffffu, valid ? q : -1);
    return w;
  }
};

// Writes a warp's rows as partials of split `split`. The state is consumed.
template <int D, class QRows>
__device__ void write_partials(float* partial_o, float* partial_lse, int heads_q, const QRows& mine, int hk, int split,
                               RowState<D>& st, int lane) {
  using R = RowHalf<D>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (lane >> 2) + 8 * h;
    const R res(st, h);
    if (r >= mine.rows) continue;
    const std::int64_t row = static_cast<std::int64_t>(mine.slot(r, split)) * heads_q + mine.head(hk, r);
    res.store_partial(partial_o + row * D, partial_lse + row, lane);
  }
}

template <class T, int D, int Stages, class Rows, class S = T>
__global__ void __launch_bounds__(kPrefillThreads) shared_prefix_attention(SharedArgs<T, Rows, S> a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int ids[2][kPrefillTile];
  __shared__ int bounds[2];
  allow_dependent_grids();
  wait_for_prior_grids();
  const int heads_kv = a.pool.heads_kv, group = a.heads_q / heads_kv;
  const int items = a.sharing.item_count() * heads_kv;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const SharedItem w = a.sharing.items[item / heads_kv];
    const int hk = item % heads_kv;
    const SharedRun run = a.sharing.runs[w.run];
    SharedRows it{a.sharing.run_tokens + run.token0, a.sharing.run_slot + run.token0, a.sharing.run_extra + run.token0,
                  a.token_pos, w.row0, 0, group};
    it.rows = min(kSharedRows, run.tokens * group - w.row0);
    if (threadIdx.x == 0) bounds[0] = INT_MAX, bounds[1] = -1;
    __syncthreads();
    if (threadIdx.x < it.rows) {
      atomicMin(&bounds[0], it.qpos(threadIdx.x));
      atomicMax(&bounds[1], it.qpos(threadIdx.x));
    }
    __syncthreads();
    it.lo = bounds[0];
    it.hi = bounds[1];
    // What any row of the item sees of the split: from the lowest row's window start on.
    const TileSpan split = split_tiles(run, w.split);
    const int begin = max(split.first * kSharedTile, visible_begin(a.window, it.lo));
    const PositionRange seen{begin, (split.first + split.count) * kSharedTile - 1};
    const TileSpan span = seen.empty() ? TileSpan{0, 0} : TileSpan{seen.begin / kSharedTile, seen.end / kSharedTile - seen.begin / kSharedTile + 1};
    attend_block<T, D, Stages>(a, it, TileSource{run.seq, hk, span, seen}, smem, ids,
                       [&](const SharedRows& mine, RowState<D>& st, int lane) {
                         write_partials<D>(a.partial_o, a.partial_lse, a.heads_q, mine, hk, w.split, st, lane);
                       });
  }
}

// Merges the splits of every (run, member token) into the slot of split 0, after
// shared_prefix_attention: a block per (run token, group of up to 8 query heads), first the
// weights of each head (a thread per head, every split's lse in flight together), then every
// 4 columns of every head over the splits (a thread each).
//
// Grid: persistent (fixed); block: kMergeThreads.
inline constexpr int kMergeHeads = 8;
template <int D>
inline constexpr int kMergeThreads = kMergeHeads * D / 4;

struct MergeArgs {
  SharedWork sharing;
  float* partial_o = nullptr;    // [slots][H_q][D]
  float* partial_lse = nullptr;  // [slots][H_q]
  std::int32_t heads_q = 0;
};

template <int D>
__global__ void __launch_bounds__(kMergeThreads<D>) merge_shared_splits(MergeArgs a) {
  __shared__ float weights[kMergeHeads][kMaxSplits];
  __shared__ int unit_run;
  allow_dependent_grids();
  wait_for_prior_grids();
  const int groups = (a.heads_q + kMergeHeads - 1) / kMergeHeads;
  const int units = a.sharing.run_token_count() * groups;
  for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const int entry = unit / groups, head0 = unit % groups * kMergeHeads;
    if (threadIdx.x == 0) {  // the run holding entry: the last whose token0 <= entry
      int lo = 0, hi = a.sharing.run_count() - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (a.sharing.runs[mid].token0 <= entry) lo = mid;
        else hi = mid - 1;
      }
      unit_run = lo;
    }
    __syncthreads();
    const int splits = a.sharing.runs[unit_run].splits;
    if (splits > 1) {
      const int heads = min(kMergeHeads, a.heads_q - head0);
      auto row_of = [&](int h, int k) {
        const int slot = k == 0 ? a.sharing.run_slot[entry] : a.sharing.run_extra[entry] + k - 1;
        return static_cast<std::int64_t>(slot) * a.heads_q + head0 + h;
      };
      if (threadIdx.x < heads) {
        const int h = threadIdx.x;
        float lse[kMaxSplits];
        float top = -INFINITY;
#pragma unroll
        for (int k = 0; k < kMaxSplits; ++k) {
          lse[k] = k < splits ? a.partial_lse[row_of(h, k)] : -INFINITY;
          top = fmaxf(top, lse[k]);
        }
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < kMaxSplits; ++k) sum += lse[k] = top == -INFINITY ? 0.f : exp2f(lse[k] - top);
#pragma unroll
        for (int k = 0; k < kMaxSplits; ++k) weights[h][k] = sum > 0.f ? lse[k] / sum : 0.f;
        a.partial_lse[row_of(h, 0)] = sum > 0.f ? top + log2f(sum) : -INFINITY;  // read above by this thread only
      }
      __syncthreads();
      const int h = threadIdx.x / (D / 4), c = threadIdx.x % (D / 4);
      if (h < heads) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int k = 0; k < splits; ++k) {
          const float w = weights[h][k];
          const float4 v = reinterpret_cast<const float4*>(a.partial_o + row_of(h, k) * D)[c];
          acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
        }
        reinterpret_cast<float4*>(a.partial_o + row_of(h, 0) * D)[c] = acc;  // this thread's element alone
      }
    }
    __syncthreads();  // before the next unit's unit_run and weights
  }
}

}  // namespace cellkv::gpu::kernels
