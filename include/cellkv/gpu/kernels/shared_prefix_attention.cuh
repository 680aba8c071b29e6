// cellkv/gpu/kernels/shared_prefix_attention.cuh - the shared prefixes of a step, each K/V tile
// read once for every sequence that shares it (prefix_sharing.hpp).
//
// Work item = (shared item, KV head): the query rows of a run (its member tokens x the GQA heads of
// the KV head) over one split of the run's positions, read through the position table of one
// member (every member holds the same pages there). Two kernels, as for prefill:
//   shared_prefix_wgmma      on sm_90a for T pools of D 64 and 128 (the conditions of
//                            prefill_wgmma, its register fit checked for this kernel): items of
//                            kPrefillRows rows, splits aligned to its 128-position tiles
//                            (SharingShape rows / split_unit), the block of prefill_wgmma.cuh
//   shared_prefix_attention  elsewhere: items of kSharedRows rows, 16 per warp, attend_block
// Every query of a run lies past the run, so only a window can hide a held position from a row;
// the masks apply it per row, and mask the holes the shared pages hold for every member (absent
// columns).
// Each row's result goes to its token's partial slot for (run, split): the output normalized over
// what the split showed it, and the log2-sum-exp of its scores (-inf when it saw nothing). The
// kernels that read the tokens' own positions fold every slot of a token, each split of each of
// its runs, into its output (shared_fold.cuh): the splits need no merge kernel of their own.
// shared_prefix_wgmma also finishes the finished tokens of the step (shared_finish.cuh: own
// positions, then the fold), so their decode needs no other kernel; the planner lists them only
// when this kernel runs (SharingShape::finish_own).
//
// Runs before those kernels on the same stream. Grid: persistent (fixed); block: kPrefillWarps x
// 32 threads; dynamic smem: prefill_smem_bytes<D, Stages, S>(), Stages = prefill_stages(D), S what
// the pool stores (T, or Fp8E4M3: attend_block converts each fp8 tile, prefill_attention.cuh).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cellkv/gpu/kernels/prefill_attention.cuh"
#include "cellkv/gpu/kernels/prefill_wgmma.cuh"
#include "cellkv/gpu/kernels/shared_finish.cuh"
#include "cellkv/prefix_sharing.hpp"

namespace cellkv::gpu::kernels {

static_assert(kSharedRows == kPrefillBlockRows && kSharedTile == kPrefillTile, "shared items run the prefill block");

template <class T, class Rows, class S = T>
struct SharedArgs : LayerArgs<T, Rows, S> {
  SharedWork sharing;                       // the step's runs and items
  const std::int32_t* token_pos = nullptr;  // [T] position of each step token
  float* partial_o = nullptr;               // [slots][H_q][D]
  float* partial_lse = nullptr;             // [slots][H_q]
  FinishSync finish;                        // the counters of the finished tokens (shared_finish.cuh)
};

// Rows [row0, row0 + rows) of a run; row r is member token r / group (step token tokens[r / group],
// whose partial slot of split k is slots[r / group] + k), head r % group of the KV head's group.
// [lo, hi]: the lowest and highest query position of these rows.
struct SharedRows {
  const std::int32_t* tokens = nullptr;
  const std::int32_t* slots = nullptr;
  const std::int32_t* token_pos = nullptr;
  int row0 = 0, rows = 0, group = 1;
  int lo = 0, hi = -1;
  __device__ int member_token(int member) const { return tokens[member]; }  // token of rows [member group, + group)
  __device__ int token(int r) const { return member_token((row0 + r) / group); }
  // Partial slot of row r's token for split k.
  __device__ int slot(int r, int k) const { return slots[(row0 + r) / group] + k; }
  __device__ int head(int hk, int r) const { return hk * group + (row0 + r) % group; }
  __device__ int qpos(int r) const { return token_pos[token(r)]; }
  __device__ int member_qpos(int member) const { return token_pos[member_token(member)]; }
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

// Rows [row0, row0 + count) of `it` (count clamped to what it has, possibly 0); lo and hi stay the
// item's (a bound for any subset; for_warp narrows them).
__device__ inline SharedRows sub_rows(SharedRows it, int row0, int count) {
  it.row0 += row0;
  it.rows = max(0, min(count, it.rows - row0));
  return it;
}

// The rows of shared item `w` of KV group size `group`, at most `max_rows`, with the item's lo and
// hi from the planner, which computed them over SharingShape::rows rows: max_rows must be that
// (TableAttention::sharing_shape takes it from the kernel that runs).
template <class T, class Rows, class S>
__device__ SharedRows shared_rows(const SharedArgs<T, Rows, S>& a, const SharedItem& w, const SharedRun& run, int max_rows) {
  const int group = a.heads_q / a.pool.heads_kv;
  return SharedRows{a.sharing.run_tokens + run.token0, a.sharing.run_slot + run.token0, a.token_pos, w.row0,
                    min(max_rows, run.tokens * group - w.row0), group, w.lo, w.hi};
}

// Where the rows of a shared item read: KV head hk, split `split` of the run, from the lowest
// row's window start on (lo: the lowest query position of the rows).
__device__ inline TileSource shared_source(const SharedRun& run, int split, int hk, int window, int lo) {
  const TileSpan tiles = split_tiles(run, split);
  const int begin = max(tiles.first * kSharedTile, visible_begin(window, lo));
  const PositionRange seen{begin, (tiles.first + tiles.count) * kSharedTile - 1};
  const TileSpan span = seen.empty() ? TileSpan{0, 0}
                                     : TileSpan{seen.begin / kSharedTile, seen.end / kSharedTile - seen.begin / kSharedTile + 1};
  return {run.seq, hk, span, seen};
}

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
  allow_dependent_grids();
  wait_for_prior_grids();
  a.guard.check(a.work);
  const int heads_kv = a.pool.heads_kv;
  const int items = a.sharing.item_count() * heads_kv;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const SharedItem w = a.sharing.items[item / heads_kv];
    const int hk = item % heads_kv;
    const SharedRun run = a.sharing.runs[w.run];
    const SharedRows it = shared_rows(a, w, run, kSharedRows);
    attend_block<T, D, Stages>(a, it, shared_source(run, w.split, hk, a.window, it.lo), smem, ids,
                       [&](const SharedRows& mine, RowState<D>& st, int lane) {
                         write_partials<D>(a.partial_o, a.partial_lse, a.heads_q, mine, hk, w.split, st, lane);
                       });
  }
}

// The shared items of the uploaded step as a Work of the wgmma block (prefill_wgmma.cuh): item i is
// shared item i / H_kv, KV head i % H_kv, of up to kPrefillRows rows; results to the partial slots.
template <class T, class Rows>
struct SharedItems {
  const SharedArgs<T, Rows>& a;
  __device__ int count() const { return a.sharing.item_count() * a.pool.heads_kv; }
  __device__ WgmmaItem<SharedRows> at(int item, int /*lane*/) const {
    const SharedItem w = a.sharing.items[item / a.pool.heads_kv];
    const int hk = item % a.pool.heads_kv;
    const SharedRun run = a.sharing.runs[w.run];
    const SharedRows it = shared_rows(a, w, run, kPrefillRows);
    return {it, hk, shared_source(run, w.split, hk, a.window, it.lo), w.split};
  }
  template <int D, class Mine>
  __device__ void finish(const WgmmaItem<SharedRows>& it, const Mine& mine, RowState<D>& st, int lane) const {
    write_partials<D>(a.partial_o, a.partial_lse, a.heads_q, mine.rows, it.hk, it.split, st, lane);
  }
  // The finished tokens (shared_finish.cuh) by the consumer threads (thread: 0 to 255): their own
  // parts before the items, their outputs after every block's items.
  static constexpr int kConsumerWarps = 2 * kWarpgroup / 32;
  static_assert(kFinishRowsPerBlock == 2 * kConsumerWarps, "two finished rows a consumer warp");
  template <int D>
  __device__ void before_items(int thread) const {
    const int n = a.sharing.finished_count();
    if (n > 0)
      own_parts<D>(a, a.sharing.finished, n, a.partial_o, a.partial_lse,
                   static_cast<int>(blockIdx.x) * kConsumerWarps + thread / 32, static_cast<int>(gridDim.x) * kConsumerWarps,
                   thread % 32);
  }
  template <int D>
  __device__ void after_items(int thread) const {
    const int n = a.sharing.finished_count();
    if (n > 0) finish_rows<D>(a, a.sharing.finished, n, a.finish, kFinishBarrier, 2 * kWarpgroup, thread);
  }
  static constexpr int kFinishBarrier = 1;  // named barrier of the consumer threads (0: __syncthreads)
};

// T: bf16 or fp16 pool and queries (not fp8); D 64 or 128 (wgmma_shared_supports); dynamic smem WgmmaPrefill<D>::kAllocation;
// kWgmmaPrefillThreads; grid: one block per SM.
template <class T, int D, class Rows>
__global__ void __launch_bounds__(kWgmmaPrefillThreads, 1)
    shared_prefix_wgmma(SharedArgs<T, Rows> a, const __grid_constant__ PoolMaps maps) {
  wgmma_block<T, D>(a, &maps, SharedItems<T, Rows>{a}, ItemClaims{});  // dealt: the finish counts on every block
}

}  // namespace cellkv::gpu::kernels
