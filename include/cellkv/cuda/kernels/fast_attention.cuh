// cellkv/cuda/kernels/fast_attention.cuh - tensor-core attention over tile lists (bf16 / fp16
// storage, fp32 accumulation). Both kernels compute, for each query row (token, head) of a
// segment, softmax(scale q.k) v over the cells of the segment's tile list that are visible to it
// (DESIGN.md section 3), reading visibility from metadata and never a dense mask.
//
//   decode_attention   work item = (decode item, KV head): the <= 16 rows (token x head, GQA heads
//                      packed as rows) of a short segment; 4 warps split each 64-cell tile in
//                      quarters; split-KV items write partial (o, lse) merged by merge_splits.
//   prefill_attention  work item = (prefill item, KV head): 128 rows, 8 warps of 16 rows each.
//
// K/V tiles stream through shared memory with cp.async, `Stages` deep. Cells that no row of the
// item may see are zero-filled instead of loaded (their contents may be stale or never written).
// Grids are persistent and fixed; item counts are read on the device, so a captured graph serves
// any step.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cellkv/cuda/kernels/mma.cuh"
#include "cellkv/cuda/kernels/tile_meta.cuh"
#include "cellkv/cuda/kernels/tile_plan.cuh"
#include "cellkv/cuda/numeric.cuh"
#include "cellkv/pool_view.hpp"

namespace cellkv::gpu::kernels {

inline constexpr float kLog2e = 1.4426950408889634f;

// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp; -inf -> 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <class T>
struct FastArgs {
  const T* q = nullptr;  // [tokens, heads_q, D]
  T* out = nullptr;      // [tokens, heads_q, D]
  PoolView<const T> pool;
  std::int32_t heads_q = 0;
  float scale_log2 = 0;  // scale * log2(e)
  std::int32_t window = 0;
  const Segment* segments = nullptr;
  const std::int32_t* num_segments = nullptr;
  const std::int32_t* tokens = nullptr;  // T: rows [T, width) of out are padding
  WindowPlan plan;
  std::int32_t max_tiles = 0;
  float* partial_o = nullptr;    // [slots][heads_kv][16][D]
  float* partial_lse = nullptr;  // [slots][heads_kv][16]
};

// Shared-memory stage ring of K and V tiles, 64 rows x D each.
template <int D, int Stages>
struct KVStages {
  static constexpr std::uint32_t kTileBytes = kTileRows * D * 2;
  std::uint32_t base;  // shared address of stage 0's K tile
  __device__ std::uint32_t k(int s) const { return base + static_cast<std::uint32_t>(s) * 2 * kTileBytes; }
  __device__ std::uint32_t v(int s) const { return k(s) + kTileBytes; }
};

// The rows an item covers: rows [row0, row0 + rows) of its segment; row r is token r / group,
// head r % group of the KV head's group.
struct ItemRows {
  Segment seg;
  int row0 = 0, rows = 0, group = 1;
  __device__ int token(int r) const { return seg.tok0 + (row0 + r) / group; }
  __device__ int head(int hk, int r) const { return hk * group + (row0 + r) % group; }
  __device__ int qpos(int r) const { return seg.pos0 + (row0 + r) / group; }
  __device__ int first() const { return qpos(0); }
  __device__ int last() const { return qpos(rows - 1); }
};

// Shared-memory state of the tile stream: a chunk of the item's tile list, classified and
// compacted (skip tiles dropped), and what each pipeline stage holds.
template <int Threads, int Stages>
struct TileQueue {
  int tile[Threads];
  int cls[Threads];
  TileView view[Threads];
  int warp_count[Threads / 32];
  int stage_tile[Stages];
  int stage_cls[Stages];
  TileView stage_view[Stages];
  int cpos[Stages][kTileRows];  // position of each cell for the item's sequence, -1: not its (partial tiles)
};

// Issues the copies of tile `tile` for KV head hk into a stage. Threads split the 64 rows x D/8
// chunks of K and V. Rows no query of the item may see are zero-filled, and (partial tiles) each
// row's position for the item's sequence goes to cpos.
// Called by every thread of the block (it synchronizes on partial tiles).
template <int D, int Threads, class T, class Meta>
__device__ void load_tile(const Meta& meta, const PoolView<const T>& pool, int hk, int tile, int cls, int seq, int last,
                          std::uint32_t k_dst, std::uint32_t v_dst, int* cpos) {
  constexpr int kChunks = D / 8;
  if (cls != kFull) {  // each row's position, read once, before the copies that depend on it
    for (int row = threadIdx.x; row < kTileRows; row += Threads)
      cpos[row] = meta.pos_for(static_cast<std::int64_t>(tile) * kTileRows + row, seq);
    __syncthreads();
  }
  for (int i = threadIdx.x; i < kTileRows * kChunks; i += Threads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const std::int64_t c = static_cast<std::int64_t>(tile) * kTileRows + row;
    const bool valid = cls == kFull || (cpos[row] >= 0 && cpos[row] <= last);
    const std::int64_t off = valid ? pool.offset(c, hk) + chunk * 8 : 0;
    const std::uint32_t dst = SwizzledTile<D>::offset(row, chunk);
    cp_async_16(k_dst + dst, pool.k + off, valid);
    cp_async_16(v_dst + dst, pool.v + off, valid);
  }
}

// Loads the item's query rows [0, Rows) (zeros past `rows`) into a swizzled shared tile.
template <int D, int Rows, int Threads, class T>
__device__ void load_queries(const FastArgs<T>& a, const ItemRows& it, int hk, std::uint32_t q_dst) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < Rows * kChunks; i += Threads) {
    const int r = i / kChunks, chunk = i % kChunks;
    const bool valid = r < it.rows;
    const std::int64_t off =
        valid ? (static_cast<std::int64_t>(it.token(r)) * a.heads_q + it.head(hk, r)) * D + chunk * 8 : 0;
    cp_async_16(q_dst + SwizzledTile<D>::offset(r, chunk), a.q + off, valid);
  }
}

// The stage pipeline over an item's tile list [begin, end). The list is classified Threads entries
// at a time, all in parallel, and compacted in shared memory, so skipped tiles cost nothing and the
// loop reads no global metadata per tile. Calls compute(stage, tile, cls) for each tile, in order.
template <int D, int Stages, int Threads, class T, class Meta, class Compute>
__device__ void stream_tiles(const FastArgs<T>& a, const Meta& meta, const std::int32_t* list, int begin, int end,
                             const ItemRows& it, int hk, KVStages<D, Stages> kv, TileQueue<Threads, Stages>& q,
                             Compute&& compute) {
  int next = begin, count = 0, taken = 0;
  const int seq = it.seg.seq, first = it.first(), last = it.last();
  auto refill = [&] {
    __syncthreads();  // every thread is done with the previous chunk
    const int j = next + static_cast<int>(threadIdx.x), lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int t = -1, c = kSkip;
    TileView v = TileView::none();
    if (j < end) {
      t = list[j];
      v = meta.view(t, seq);
      c = classify_view(v, first, last, a.window);
    }
    const unsigned keep = __ballot_sync(0xffffffffu, c != kSkip);
    if (lane == 0) q.warp_count[warp] = __popc(keep);
    __syncthreads();
    int at = __popc(keep & ((1u << lane) - 1u)), total = 0;
    for (int w = 0; w < Threads / 32; ++w) {
      at += w < warp ? q.warp_count[w] : 0;
      total += q.warp_count[w];
    }
    if (c != kSkip) q.tile[at] = t, q.cls[at] = c, q.view[at] = v;
    __syncthreads();
    next += Threads;
    count = total;
    taken = 0;
  };
  auto issue = [&](int stage) {
    while (taken == count && next < end) refill();
    int tile = -1, cls = kSkip;
    TileView v = TileView::none();
    if (taken < count) tile = q.tile[taken], cls = q.cls[taken], v = q.view[taken], ++taken;
    if (tile >= 0) load_tile<D, Threads>(meta, a.pool, hk, tile, cls, seq, last, kv.k(stage), kv.v(stage), q.cpos[stage]);
    if (threadIdx.x == 0) q.stage_tile[stage] = tile, q.stage_cls[stage] = cls, q.stage_view[stage] = v;
    cp_async_commit();
  };
  for (int s = 0; s < Stages - 1; ++s) issue(s);
  for (int cur = 0;; cur = (cur + 1) % Stages) {
    cp_async_wait<Stages - 2>();
    __syncthreads();
    const int tile = q.stage_tile[cur], cls = q.stage_cls[cur];
    if (tile < 0) break;
    issue((cur + Stages - 1) % Stages);
    compute(cur, tile, cls);
  }
  cp_async_wait<0>();
  __syncthreads();
}

// Query fragments (A operands) of 16 rows of a swizzled query tile: held in registers for
// D <= 128, read from shared memory at each use for D = 256 (register budget).
template <int D>
struct QFragments {
  static constexpr bool kInRegs = D <= 128;
  std::uint32_t regs[kInRegs ? D / 16 : 1][4];
  std::uint32_t tile;
  int row0;

  __device__ __forceinline__ void load_one(std::uint32_t (&f)[4], int kk, int lane) const {
    const int row = row0 + (lane & 7) + (((lane >> 3) & 1) << 3), chunk = 2 * kk + (lane >> 4);
    ldmatrix_x4(f, tile + SwizzledTile<D>::offset(row, chunk));
  }
  __device__ __forceinline__ void init(std::uint32_t q_tile, int first_row, int lane) {
    tile = q_tile;
    row0 = first_row;
    if constexpr (kInRegs) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) load_one(regs[kk], kk, lane);
    }
  }
  // Fragment kk (columns [16 kk, 16 kk + 16)).
  __device__ __forceinline__ void get(std::uint32_t (&f)[4], int kk, int lane) const {
    if constexpr (kInRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) f[i] = regs[kk][i];
    } else {
      load_one(f, kk, lane);
    }
  }
};

// S (16 rows x 8 NT cells starting at cell0 of the stage) = Q K^T.
template <int D, int NT, class T>
__device__ __forceinline__ void qk(float (&s)[NT][4], const QFragments<D>& q, std::uint32_t k_tile, int cell0, int lane) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[4];
    q.get(a, kk, lane);
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      std::uint32_t b[4];
      const int row = cell0 + 8 * n + (lane & 7) + ((lane >> 4) << 3), chunk = 2 * kk + ((lane >> 3) & 1);
      ldmatrix_x4(b, k_tile + SwizzledTile<D>::offset(row, chunk));
      mma_16816<T>(s[n], a, b[0], b[1]);
      mma_16816<T>(s[n + 1], a, b[2], b[3]);
    }
  }
}

// o (16 rows x D) += P (16 rows x 8 NT cells starting at cell0) V.
template <int D, int NT, class T>
__device__ __forceinline__ void pv(float (&o)[D / 8][4], const float (&p)[NT][4], std::uint32_t v_tile, int cell0,
                                   int lane) {
#pragma unroll
  for (int ks = 0; ks < NT / 2; ++ks) {
    const std::uint32_t a[4] = {pack2<T>(p[2 * ks][0], p[2 * ks][1]), pack2<T>(p[2 * ks][2], p[2 * ks][3]),
                                pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]),
                                pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3])};
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      std::uint32_t b[4];
      const int row = cell0 + 16 * ks + (lane & 7) + (((lane >> 3) & 1) << 3), chunk = 2 * dd + (lane >> 4);
      ldmatrix_x4_trans(b, v_tile + SwizzledTile<D>::offset(row, chunk));
      mma_16816<T>(o[2 * dd], a, b[0], b[1]);
      mma_16816<T>(o[2 * dd + 1], a, b[2], b[3]);
    }
  }
}

// Online-softmax state of the two rows (lane / 4 and lane / 4 + 8) a lane holds in a 16-row tile.
template <int D>
struct RowState {
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // per lane; quad-summed at the end
  float o[D / 8][4] = {};

  // Scores s (in log2 units, -inf where invisible) -> probabilities in place; rescales o.
  template <int NT>
  __device__ __forceinline__ void absorb(float (&s)[NT][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
      const float m_new = fmaxf(m[h], quad_max(mx));
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen nothing yet
      const float corr = fast_exp2(m[h] - base);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[n][e] = fast_exp2(s[n][e] - base);
          sum += s[n][e];
        }
      l[h] = l[h] * corr + sum;
      m[h] = m_new;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) o[d][2 * h] *= corr, o[d][2 * h + 1] *= corr;
    }
  }
};

// Scales scores to log2 units and applies visibility: rows >= it.rows, and (partial tiles) cells
// the row's position may not see, become -inf. cpos: positions of the stage's 64 cells for the
// item's sequence; col0: the first column (cell of the tile) of the 8 NT-column slice.
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], const int* cpos, const ItemRows& it, int col0, int cls,
                                            int window, float scale_log2, int lane) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = (lane >> 2) + (e >= 2 ? 8 : 0);
      bool ok = r < it.rows;
      if (ok && cls != kFull) ok = visible_at(cpos[col0 + n * 8 + (lane & 3) * 2 + (e & 1)], it.qpos(r), window);
      s[n][e] = ok ? s[n][e] * scale_log2 : -INFINITY;
    }
}

template <int D, int Stages>
constexpr int decode_smem_bytes() {
  return kDecodeRows * D * 2 + Stages * 2 * kTileRows * D * 2;
}

// Grid: persistent (fixed); block: 128 threads; dynamic smem: decode_smem_bytes<D, Stages>().
template <class T, int D, int Stages, class Meta>
__global__ void __launch_bounds__(128) decode_attention(FastArgs<T> a, Meta meta) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ TileQueue<128, Stages> queue;
  __shared__ float sm_m[4][kDecodeRows], sm_l[4][kDecodeRows];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t q_tile = smem_addr(smem);
  const KVStages<D, Stages> kv{q_tile + kDecodeRows * D * 2};
  float* sm_o = reinterpret_cast<float*>(smem + kDecodeRows * D * 2);  // [4][16][D], reuses the stages
  const int heads_kv = a.pool.heads_kv, group = a.heads_q / heads_kv;
  const int items = a.plan.counts[0] * heads_kv;

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const DecodeWork w = a.plan.decode[item / heads_kv];
    const int hk = item % heads_kv;
    ItemRows it{a.segments[w.seg], 0, 0, group};
    it.rows = it.seg.len * group;
    load_queries<D, kDecodeRows, 128>(a, it, hk, q_tile);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    QFragments<D> q;
    q.init(q_tile, 0, lane);
    RowState<D> st;
    const std::int32_t* list = a.plan.tile_list + static_cast<std::int64_t>(w.seg) * a.max_tiles;
    stream_tiles<D, Stages, 128>(a, meta, list, w.tile_begin, w.tile_end, it, hk, kv, queue,
                                 [&](int stage, int, int cls) {
                                   float s[2][4];  // this warp's quarter: cells [16 warp, 16 warp + 16)
                                   qk<D, 2, T>(s, q, kv.k(stage), 16 * warp, lane);
                                   mask_scores<2>(s, queue.cpos[stage], it, 16 * warp, cls, a.window, a.scale_log2, lane);
                                   st.absorb(s);
                                   pv<D, 2, T>(st.o, s, kv.v(stage), 16 * warp, lane);
                                 });
    // Merge the four warps' partial softmaxes through shared memory.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      st.l[h] = quad_sum(st.l[h]);
      const int r = (lane >> 2) + 8 * h;
      if ((lane & 3) == 0) sm_m[warp][r] = st.m[h], sm_l[warp][r] = st.l[h];
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        float* row = sm_o + (warp * kDecodeRows + r) * D + d * 8 + (lane & 3) * 2;
        row[0] = st.o[d][2 * h];
        row[1] = st.o[d][2 * h + 1];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < it.rows * D; i += 128) {
      const int r = i / D, d = i % D;
      float top = -INFINITY;
      for (int x = 0; x < 4; ++x) top = fmaxf(top, sm_m[x][r]);
      float num = 0.f, den = 0.f;
      if (top != -INFINITY)
        for (int x = 0; x < 4; ++x) {
          const float f = exp2f(sm_m[x][r] - top);
          den += sm_l[x][r] * f;
          num += sm_o[(x * kDecodeRows + r) * D + d] * f;
        }
      const float val = den > 0.f ? num / den : 0.f;
      if (w.slot < 0) {
        a.out[(static_cast<std::int64_t>(it.token(r)) * a.heads_q + it.head(hk, r)) * D + d] = from_float<T>(val);
      } else {
        const std::int64_t row = (static_cast<std::int64_t>(w.slot) * heads_kv + hk) * kDecodeRows + r;
        a.partial_o[row * D + d] = val;
        if (d == 0) a.partial_lse[row] = den > 0.f ? top + log2f(den) : -INFINITY;
      }
    }
    __syncthreads();
  }
}

template <int D, int Stages, int Warps>
constexpr int prefill_smem_bytes() {
  return 16 * Warps * D * 2 + Stages * 2 * kTileRows * D * 2;
}

// Grid: persistent (fixed); block: Warps x 32 threads, 16 query rows per warp (an item covers
// 16 Warps rows); dynamic smem: prefill_smem_bytes<D, Stages, Warps>(). Each warp also skips
// tiles its own 16 rows cannot see.
template <class T, int D, int Stages, int Warps, class Meta>
__global__ void __launch_bounds__(Warps * 32) prefill_attention(FastArgs<T> a, Meta meta) {
  constexpr int kRows = 16 * Warps, kThreads = 32 * Warps;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ TileQueue<kThreads, Stages> queue;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t q_tile = smem_addr(smem);
  const KVStages<D, Stages> kv{q_tile + kRows * D * 2};
  const int heads_kv = a.pool.heads_kv, group = a.heads_q / heads_kv;
  const int items = a.plan.counts[1] * heads_kv;

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const PrefillWork w = a.plan.prefill[item / heads_kv];
    const int hk = item % heads_kv;
    ItemRows it{a.segments[w.seg], w.m_tile * kRows, 0, group};
    it.rows = min(kRows, it.seg.len * group - it.row0);
    load_queries<D, kRows, kThreads>(a, it, hk, q_tile);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // This warp's rows: [16 warp, 16 warp + 16) of the item.
    ItemRows mine = it;
    mine.row0 = it.row0 + 16 * warp;
    mine.rows = max(0, min(16, it.rows - 16 * warp));
    QFragments<D> q;
    q.init(q_tile, 16 * warp, lane);
    RowState<D> st;
    const std::int32_t* list = a.plan.tile_list + static_cast<std::int64_t>(w.seg) * a.max_tiles;
    stream_tiles<D, Stages, kThreads>(
        a, meta, list, 0, a.plan.tile_count[w.seg], it, hk, kv, queue, [&](int stage, int, int) {
          if (mine.rows == 0) return;
          const int cls = classify_view(queue.stage_view[stage], mine.first(), mine.last(), a.window);
          if (cls == kSkip) return;
          float s[8][4];  // 16 rows x 64 cells
          qk<D, 8, T>(s, q, kv.k(stage), 0, lane);
          mask_scores<8>(s, queue.cpos[stage], mine, 0, cls, a.window, a.scale_log2, lane);
          st.absorb(s);
          pv<D, 8, T>(st.o, s, kv.v(stage), 0, lane);
        });
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(st.l[h]);
      const int r = (lane >> 2) + 8 * h;
      if (r >= mine.rows) continue;
      T* dst = a.out + (static_cast<std::int64_t>(mine.token(r)) * a.heads_q + mine.head(hk, r)) * D + (lane & 3) * 2;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        dst[d * 8] = from_float<T>(st.o[d][2 * h] * inv);
        dst[d * 8 + 1] = from_float<T>(st.o[d][2 * h + 1] * inv);
      }
    }
    __syncthreads();
  }
}

}  // namespace cellkv::gpu::kernels
