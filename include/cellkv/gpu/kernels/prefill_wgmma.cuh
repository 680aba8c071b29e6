// cellkv/gpu/kernels/prefill_wgmma.cuh - prefill attention on Hopper (sm_90a): warpgroup MMAs fed
// by a producer warpgroup, read through the position tables.
//
// Work item = (prefill item, KV head), as prefill_attention.cuh: kPrefillRows (128) query rows of
// one segment (token x GQA head of the group). Block: three warpgroups.
//   producer  (warpgroup 0, 56 registers a thread): per item, the item's queries into the query
//             tile, then every KV tile the item reads (kPrefillTile positions, gathered row by row
//             through the position table with cp.async, holes and unread positions zero-filled)
//             into a ring of Stages stages, with the tile's absent columns beside it; tile k by
//             producer warp k % 4.
//   consumers (warpgroups 1 and 2, 224 registers): rows [64 c, 64 c + 64) of the item each; the
//             queries as register A fragments, then per tile S = Q K^T (wgmma, K from the stage),
//             mask and online softmax in registers (attention_tiles.cuh: the accumulator layout is
//             mma.sync's), O += P V (wgmma, P from registers, V from the stage). A consumer whose
//             rows cannot see a tile skips its MMAs (causal and window by position ranges; tiles
//             wholly inside every row's range are not masked).
// Hand-over, by mbarriers: full[s] completes when the producer warp's copies into stage s have
// landed (cp.async.mbarrier.arrive) and its lane 0 has written the absent mask; empty[s] when all
// 256 consumer threads are done with it. q_full / q_empty do the same for
// the query tile, so the next item's queries load while the consumers finish the current one. The
// consumers fence the async proxy before their wgmmas read what cp.async (generic proxy) wrote.
//
// Dynamic shared memory (WgmmaPrefill<D>, 1024-byte aligned inside the allocation):
//   Stages x (K tile, V tile) [kPrefillTile x D] T (Sw128Tile) | Q tile [kPrefillRows x D] T
//   (SwizzledTile) | absent [Stages] u64 | barriers full[Stages], empty[Stages], q_full, q_empty
// Grid: persistent, one block per SM. Only pools of T (not fp8), D = 64 and 128.
#pragma once

#include <cuda/ptx>
#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/kernels/attention_tiles.cuh"
#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/kernels/layer_args.cuh"
#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/kernels/prefill_attention.cuh"
#include "cellkv/gpu/kernels/wgmma.cuh"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

inline constexpr int kWarpgroup = 128;
inline constexpr int kWgmmaPrefillThreads = 3 * kWarpgroup;
inline constexpr int kConsumerRows = 64;  // query rows of a consumer warpgroup
inline constexpr int kProducerWarps = kWarpgroup / 32;
// Registers a thread of the producer and of the consumers keep (setmaxnreg). Together they must not
// pass what the block is launched with (kWgmmaRegisterNeed <= registers per thread x 384, which
// the dispatch checks): the increase could otherwise wait on registers another block holds (a
// dependent launch's, itself waiting on this kernel). With 64 + 224 (the whole register file) the
// kernel hung on 2026-12-02.
inline constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;
inline constexpr int kWgmmaRegisterNeed = kWarpgroup * (kProducerRegisters + 2 * kConsumerRegisters);
static_assert(kPrefillRows == 2 * kConsumerRows, "two consumer warpgroups cover an item");

// Head dims the kernel serves.
constexpr bool wgmma_prefill_supports(int head_dim) { return head_dim == 64 || head_dim == 128; }

// Shared-memory layout for head dim D (byte offsets from the 1024-aligned base).
template <int D>
struct WgmmaPrefill {
  static constexpr int kStages = D <= 64 ? 8 : 5;
  // A producer warp waits on empty[s] by parity only: its previous tile (k - 4) must be at most one
  // phase behind, which needs at least as many stages as producer warps.
  static_assert(kStages >= kProducerWarps, "the ring needs a stage per producer warp at least");
  using KV = Sw128Tile<kPrefillTile, D>;
  static constexpr int kStageBytes = 2 * KV::kBytes;  // K tile, then V tile
  static constexpr int kQ = kStages * kStageBytes;
  static constexpr int kAbsent = kQ + kPrefillRows * D * 2;
  static constexpr int kBarriers = kAbsent + 8 * kStages;
  static constexpr int kBytes = kBarriers + 8 * (2 * kStages + 2);
  static constexpr int kAllocation = kBytes + 1024;  // room to align the base
};

// The four barriers' roles, in shared memory.
struct PrefillBarriers {
  std::uint64_t* full;   // [Stages] count: a producer warp's lanes (async arrivals) + its lane 0
  std::uint64_t* empty;  // [Stages] count: consumer threads
  std::uint64_t* q_full;   // count: producer threads (async arrivals)
  std::uint64_t* q_empty;  // count: consumer threads
};

__device__ __forceinline__ void wait_phase(std::uint64_t* bar, std::uint32_t parity) {
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

// One KV tile into stage `stage`, by one producer warp: the row ids of its kPrefillTile positions
// (lane l reads positions l and l + 32), the absent mask from them, then every 16-byte chunk of K
// and V (lane l copies chunk l % C of rows l / C, l / C + 32 / C, ..: C = D / 8 chunks a row), the
// row id of each row passed from the lane that read it.
template <class T, int D, class Rows>
__device__ __forceinline__ void produce_tile(const PrefillArgs<T, Rows>& a, const TileSource& src, int j,
                                             std::uint32_t stage, std::uint64_t& absent, int lane) {
  constexpr int kChunks = D / 8, kRowStep = 32 / kChunks;
  static_assert(32 % kChunks == 0 && kPrefillTile == 64, "whole rows per pass; two positions a lane");
  const int base = (src.span.first + j) * kPrefillTile;
  const int id0 = prefill_row_id(a.rows, src.seq, base, src.seen, lane);
  const int id1 = prefill_row_id(a.rows, src.seq, base, src.seen, lane + 32);
  const std::uint64_t missing = absent_columns(id0, id1);
  if (lane == 0) absent = missing;
  const int chunk = lane % kChunks;
#pragma unroll 4
  for (int row = lane / kChunks; row < kPrefillTile; row += kRowStep) {
    const int from0 = __shfl_sync(0xffffffffu, id0, row % 32), from1 = __shfl_sync(0xffffffffu, id1, row % 32);
    const int id = row < 32 ? from0 : from1;
    const std::int64_t off = id >= 0 ? a.pool.offset(id, src.hk) + chunk * 8 : 0;
    const std::uint32_t dst = stage + WgmmaPrefill<D>::KV::offset(row, chunk);
    cp_async_16(dst, a.pool.k + off, id >= 0);
    cp_async_16(dst + WgmmaPrefill<D>::KV::kBytes, a.pool.v + off, id >= 0);
  }
}

// The producer warpgroup (thread t = threadIdx.x in [0, 128)): the queries of every item the block
// takes (all four warps), and its KV tiles, tile k by warp k % 4, so four tiles' table reads and
// copies are under way at once.
template <class T, int D, class Rows>
__device__ void produce_prefill(const PrefillArgs<T, Rows>& a, std::uint32_t base, std::uint64_t* absent,
                                const PrefillBarriers& bar) {
  using L = WgmmaPrefill<D>;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int items = a.work.prefill_count() * a.pool.heads_kv;
  int k = 0, n = 0;  // tiles and items issued so far
  for (int item = blockIdx.x; item < items; item += gridDim.x, ++n) {
    const PrefillWork w = prefill_work(a, item);
    const TileSource src = tile_source(w.rows, w.hk, a.window, w.own_begin);
    wait_phase(bar.q_empty, (n & 1) ^ 1);
    load_queries<D, kPrefillRows, kWarpgroup>(a.q, a.heads_q, w.rows, w.hk, base + L::kQ, t);
    ::cuda::ptx::cp_async_mbarrier_arrive_noinc(bar.q_full);
    for (int j = 0; j < src.span.count; ++j, ++k) {
      if (k % kProducerWarps != warp) continue;
      const int s = k % L::kStages;
      wait_phase(bar.empty + s, ((k / L::kStages) & 1) ^ 1);
      produce_tile<T, D>(a, src, j, base + static_cast<std::uint32_t>(s * L::kStageBytes), absent[s], lane);
      ::cuda::ptx::cp_async_mbarrier_arrive_noinc(bar.full + s);
      if (lane == 0) (void)::cuda::ptx::mbarrier_arrive(bar.full + s);  // after writing absent[s]
    }
  }
  cp_async_wait<0>();
}

// Issues S (64 x kPrefillTile, this thread's share) = Q K^T over the K tile at k_tile, one group.
template <class T, int D>
__device__ __forceinline__ void issue_scores(float (&s)[kPrefillTile / 8][4], const QFragments<D>& q,
                                             std::uint32_t k_tile, int lane) {
  const std::uint64_t k0 = k_operand<kPrefillTile, D>(k_tile, 0);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[4];
    q.get(a, kk, lane);
    wgmma_rs<T, kPrefillTile, false>(s, a, advance(k0, k_step_bytes<kPrefillTile, D>(kk)), kk > 0);
  }
  wgmma_commit();
}

// Probabilities (a tile of scores after the softmax) as the A fragments of O += P V.
template <class T>
__device__ __forceinline__ void pack_probabilities(std::uint32_t (&a)[kPrefillTile / 16][4],
                                                   const float (&p)[kPrefillTile / 8][4]) {
#pragma unroll
  for (int ks = 0; ks < kPrefillTile / 16; ++ks) {
    a[ks][0] = pack2<T>(p[2 * ks][0], p[2 * ks][1]);
    a[ks][1] = pack2<T>(p[2 * ks][2], p[2 * ks][3]);
    a[ks][2] = pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]);
    a[ks][3] = pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3]);
  }
}

// Issues o (64 x D, this thread's share) += P V over the V tile at v_tile, one group; a: P packed.
template <class T, int D>
__device__ __forceinline__ void issue_values(float (&o)[D / 8][4], const std::uint32_t (&a)[kPrefillTile / 16][4],
                                             std::uint32_t v_tile) {
  const std::uint64_t v0 = v_operand<kPrefillTile, D>(v_tile, 0);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kPrefillTile / 16; ++ks) wgmma_rs<T, D, true>(o, a[ks], advance(v0, 2048u * ks), true);
  wgmma_commit();
}

// A warp's 16 rows of an item as the consumer's tile loop needs them, computed once per item.
struct WarpRows {
  ItemRows rows;
  int first = 0, last = 0;     // query positions of the first and last row
  int last_sees_from = 0;      // visible_begin(window, last): tiles from here to first need no mask
  __device__ WarpRows(const ItemRows& mine, int window)
      : rows(mine), first(mine.first()), last(mine.last()), last_sees_from(visible_begin(window, last)) {}
};

// Raw scores of a warp's rows over the tile at key0: -inf where a row may not see a column's
// position or the column is absent; untouched when every row sees every column.
__device__ __forceinline__ void mask_scores(float (&s)[kPrefillTile / 8][4], const WarpRows& w, int key0, int window,
                                            std::uint64_t absent, int lane) {
  const bool full = key0 >= w.last_sees_from && key0 + kPrefillTile - 1 <= w.first;
  if (full && absent == 0 && w.rows.rows == 16) return;
  mask_tile<kPrefillTile / 8>(s, w.rows.rows, [&](int r) { return w.rows.qpos(r); }, key0, window, full, absent,
                              [](int, int, int) { return 1.f; }, lane);
}

// Masked raw scores -> probabilities (RowState's online softmax, scale_log2 folded into the
// exponent when positive); corr: the factors o's rows must take.
template <int D>
__device__ __forceinline__ void softmax_tile(RowState<D>& st, float (&s)[kPrefillTile / 8][4], float scale_log2,
                                             float (&corr)[2]) {
  if (scale_log2 > 0.f) {
    st.to_probabilities_scaled(s, scale_log2, corr);
    return;
  }
#pragma unroll
  for (int n = 0; n < kPrefillTile / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;  // -inf x a negative scale: +inf; no user does this
  st.to_probabilities(s, corr);
}

// o's rows times corr, skipped when every row of the warp keeps its maximum.
template <int D>
__device__ __forceinline__ void rescale_rows(RowState<D>& st, const float (&corr)[2]) {
  if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
  st.rescale(0, corr[0]);
  st.rescale(1, corr[1]);
}

// Where the consumers are in the ring of stages: the stage of a tile and its phase parity.
template <int Stages>
struct RingCursor {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == Stages) stage = 0, phase ^= 1u;
  }
};

// Tiles [lo, hi) of src that rows `rows` see (causal and window by position ranges): the
// consumer's MMAs skip the others. Empty when the rows are none.
struct TileRange {
  int lo = 0, hi = 0;
};
__device__ inline TileRange tiles_of(const ItemRows& rows, const TileSource& src, int window) {
  if (rows.rows <= 0) return {};
  const int lo = max(0, visible_begin(window, rows.first()) / kPrefillTile - src.span.first);
  const int hi = min(src.span.count, rows.last() / kPrefillTile - src.span.first + 1);
  return {lo, max(lo, hi)};
}

// A consumer warpgroup (c = 0 or 1): rows [64 c, 64 c + 64) of every item the block takes. Over the
// tiles its rows see, S of tile j + 1 and P V of tile j run on the tensor cores while the softmax of
// tile j + 1 runs (the accumulators of O are rescaled once P V of tile j is done).
template <class T, int D, class Rows>
__device__ void consume_prefill(const PrefillArgs<T, Rows>& a, int c, std::uint32_t base, const std::uint64_t* absent,
                                const PrefillBarriers& bar) {
  using L = WgmmaPrefill<D>;
  using Cursor = RingCursor<L::kStages>;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int items = a.work.prefill_count() * a.pool.heads_kv;
  Cursor ring;  // the next tile to consume
  auto take = [&] {  // waits for the next tile; returns its place
    const Cursor t = ring;
    wait_phase(bar.full + t.stage, t.phase);
    ring.next();
    return t;
  };
  auto release = [&](const Cursor& t) { (void)::cuda::ptx::mbarrier_arrive(bar.empty + t.stage); };
  auto k_tile = [&](const Cursor& t) { return base + static_cast<std::uint32_t>(t.stage * L::kStageBytes); };
  for (int item = blockIdx.x, n = 0; item < items; item += gridDim.x, ++n) {
    const PrefillWork w = prefill_work(a, item);
    const TileSource src = tile_source(w.rows, w.hk, a.window, w.own_begin);
    const ItemRows rows = sub_rows(w.rows, kConsumerRows * c, kConsumerRows);  // the warpgroup's
    const WarpRows mine(rows.for_warp(warp, lane), a.window);
    wait_phase(bar.q_full, n & 1);
    QFragments<D> q;
    q.init(base + L::kQ, kConsumerRows * c + 16 * warp, lane);
    (void)::cuda::ptx::mbarrier_arrive(bar.q_empty);
    auto scores = [&](float (&s)[kPrefillTile / 8][4], int j, const Cursor& t) {  // once S of tile j is done
      mask_scores(s, mine, (src.span.first + j) * kPrefillTile, a.window, absent[t.stage], lane);
    };
    RowState<D> st;
    const TileRange seen = tiles_of(rows, src, a.window);
    for (int j = 0; j < seen.lo; ++j) release(take());
    if (seen.lo < seen.hi) {
      float s[kPrefillTile / 8][4] = {};
      float corr[2];
      std::uint32_t p[kPrefillTile / 16][4];
      Cursor prev = take();
      ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared);  // cp.async's writes, to the wgmma reads
      issue_scores<T, D>(s, q, k_tile(prev), lane);
      wgmma_wait<0>();
      fence_accumulators(s);
      scores(s, seen.lo, prev);
      softmax_tile(st, s, a.scale_log2, corr);  // o is still zero
      pack_probabilities<T>(p, s);
      for (int j = seen.lo + 1; j < seen.hi; ++j) {
        const Cursor t = take();
        ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared);
        issue_scores<T, D>(s, q, k_tile(t), lane);
        issue_values<T, D>(st.o, p, k_tile(prev) + L::KV::kBytes);
        wgmma_wait<1>();  // S of tile j
        fence_accumulators(s);
        scores(s, j, t);
        softmax_tile(st, s, a.scale_log2, corr);
        wgmma_wait<0>();  // P V of tile j - 1
        fence_accumulators(st.o);
        release(prev);
        rescale_rows(st, corr);
        pack_probabilities<T>(p, s);
        prev = t;
      }
      issue_values<T, D>(st.o, p, k_tile(prev) + L::KV::kBytes);
      wgmma_wait<0>();
      fence_accumulators(st.o);
      release(prev);
    }
    for (int j = seen.hi; j < src.span.count; ++j) release(take());
    write_rows<T, D>(a, mine.rows, w.hk, st, lane);
  }
}

// T: bf16 or fp16 pool and queries; dynamic smem WgmmaPrefill<D>::kAllocation; kWgmmaPrefillThreads.
template <class T, int D, class Rows>
__global__ void __launch_bounds__(kWgmmaPrefillThreads, 1) prefill_wgmma(PrefillArgs<T, Rows> a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaPrefill<D>;
  extern __shared__ __align__(128) unsigned char smem[];  // aligned to 1024 below
  const std::uint32_t raw = smem_addr(smem), base = (raw + 1023u) & ~1023u;
  unsigned char* aligned = smem + (base - raw);
  auto* absent = reinterpret_cast<std::uint64_t*>(aligned + L::kAbsent);
  auto* barriers = reinterpret_cast<std::uint64_t*>(aligned + L::kBarriers);
  const PrefillBarriers bar{barriers, barriers + L::kStages, barriers + 2 * L::kStages, barriers + 2 * L::kStages + 1};
  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      ::cuda::ptx::mbarrier_init(bar.full + s, 32 + 1);  // one producer warp's copies, and its lane 0
      ::cuda::ptx::mbarrier_init(bar.empty + s, 2 * kWarpgroup);
    }
    ::cuda::ptx::mbarrier_init(bar.q_full, kWarpgroup);
    ::cuda::ptx::mbarrier_init(bar.q_empty, 2 * kWarpgroup);
  }
  __syncthreads();
  allow_dependent_grids();
  wait_for_prior_grids();
  a.guard.check(a.work);
  if (threadIdx.x < kWarpgroup) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    produce_prefill<T, D>(a, base, absent, bar);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    consume_prefill<T, D>(a, threadIdx.x / kWarpgroup - 1, base, absent, bar);
  }
#else
  (void)a;
  __trap();  // built without sm_90a code: the dispatch never launches it (sm90a_probe)
#endif
}

}  // namespace cellkv::gpu::kernels
