// cellkv/gpu/kernels/prefill_attention.cuh - prefill attention read through the position tables.
//
// Work item = (prefill item, KV head): kPrefillRows query rows of one segment (token x GQA head of
// the group), 16 per warp. They read the positions [own_begin, last row] of their sequence that
// they see (own_positions: the shared prefix below own_begin was read by shared items): KV tiles of
// kPrefillTile positions, each inside one page of the position table. The block streams the tiles
// through 2 or 3 shared-memory stages (cp.async, rows gathered through the table; the row ids of
// the tile after the next issued are read while the current tile computes); each warp skips the tiles its own
// rows cannot see and masks only the tiles at the edges of its range. The output of a row folds
// in its token's shared-prefix partials.
//
// attend_block is the block's work for any set of query rows; shared_prefix_attention.cuh runs it
// over the rows of a shared run.
//
// Grid: persistent (fixed); block: kPrefillWarps x 32 threads; dynamic smem:
// prefill_smem_bytes<D, Stages>(), Stages = prefill_stages(D).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/kernels/attention_tiles.cuh"
#include "cellkv/gpu/kernels/layer_args.cuh"
#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/pool_view.hpp"
#include "cellkv/step_plan.hpp"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

inline constexpr int kPrefillWarps = kPrefillRows / 16;
inline constexpr int kPrefillThreads = 32 * kPrefillWarps;

template <int D, int Stages>
constexpr int prefill_smem_bytes() {
  return kPrefillRows * D * 2 + Stages * 2 * kPrefillTile * D * 2;
}

// KV stages of the prefill block for head dim D: three where two blocks of them still fit an SM
// (D <= 128: 112 KB each), else two.
constexpr int prefill_stages(int head_dim) { return head_dim <= 128 ? 3 : 2; }

template <class T, class Rows>
using PrefillArgs = LayerArgs<T, Rows>;

// Rows [row0, row0 + rows) of a segment; row r is token r / group, head r % group of the group.
// Positions grow with the row, so a range of rows sees from first() to last().
struct ItemRows {
  Segment seg;
  int row0 = 0, rows = 0, group = 1;
  __device__ int token(int r) const { return seg.tok0 + (row0 + r) / group; }
  __device__ int head(int hk, int r) const { return hk * group + (row0 + r) % group; }
  __device__ int qpos(int r) const { return seg.pos0 + (row0 + r) / group; }
  __device__ int first() const { return qpos(0); }
  __device__ int last() const { return qpos(rows - 1); }
  // Rows [16 warp, 16 warp + 16) of these.
  __device__ ItemRows for_warp(int warp, int /*lane*/) const {
    ItemRows w = *this;
    w.row0 = row0 + 16 * warp;
    w.rows = max(0, min(16, rows - 16 * warp));
    return w;
  }
};

// The item's query rows [0, kPrefillRows) (zeros past `rows`) into a swizzled shared tile.
template <int D, class T, class QRows>
__device__ void load_queries(const T* q, int heads_q, const QRows& it, int hk, std::uint32_t q_dst) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kPrefillRows * kChunks; i += kPrefillThreads) {
    const int r = i / kChunks, chunk = i % kChunks;
    const bool valid = r < it.rows;
    const std::int64_t off = valid ? (static_cast<std::int64_t>(it.token(r)) * heads_q + it.head(hk, r)) * D + chunk * 8 : 0;
    cp_async_16(q_dst + SwizzledTile<D>::offset(r, chunk), q + off, valid);
  }
}

// Row id of position base + i of the item's sequence (i < kPrefillTile), -1 where no row sees it.
template <class Rows>
__device__ __forceinline__ int prefill_row_id(const Rows& rows, int seq, int base, const PositionRange& seen, int i) {
  if (!seen.contains(base + i)) return -1;
  return rows.row(rows.tile(seq, base), i);
}

// Issues the copies of one tile (row ids in shared memory) into a stage.
template <int D, class T>
__device__ __forceinline__ void issue_prefill_tile(const PoolView<const T>& pool, int hk, const int* ids,
                                                   std::uint32_t k_dst, std::uint32_t v_dst) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < kPrefillTile * kChunks; i += kPrefillThreads) {
    const int row = i / kChunks, chunk = i % kChunks, id = ids[row];
    const bool valid = id >= 0;
    const std::int64_t off = valid ? pool.offset(id, hk) + chunk * 8 : 0;
    const std::uint32_t dst = SwizzledTile<D>::offset(row, chunk);
    cp_async_16(k_dst + dst, pool.k + off, valid);
    cp_async_16(v_dst + dst, pool.v + off, valid);
  }
}

// Where a block's tiles are read: KV head hk, tiles `span` of sequence seq, of which the positions
// `seen` are gathered (the rest, and holes, zero-filled; every row masks what it does not see and
// every absent column).
struct TileSource {
  int seq = 0, hk = 0;
  TileSpan span;
  PositionRange seen;
};

// One block's attention of up to kPrefillRows query rows `it` (QRows: ItemRows or SharedRows) over
// the tiles of `src`, streamed through `Stages` (2 or 3) shared-memory stages; finish(warp's rows,
// state, lane) writes each warp's result. The block leaves with every thread past its last use of
// the shared tiles. `ids` holds the row ids of two tiles: the next to issue and the one after.
template <class T, int D, int Stages, class Rows, class QRows, class Finish>
__device__ void attend_block(const LayerArgs<T, Rows>& a, const QRows& it, const TileSource& src, unsigned char* smem,
                             int (&ids)[2][kPrefillTile], Finish&& finish) {
  static_assert(Stages == 2 || Stages == 3, "attend_block streams its KV tiles through 2 or 3 stages");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t q_tile = smem_addr(smem);
  const std::uint32_t stages = q_tile + kPrefillRows * D * 2;
  constexpr std::uint32_t kTileBytes = kPrefillTile * D * 2;
  auto k_stage = [&](int s) { return stages + static_cast<std::uint32_t>(s) * 2 * kTileBytes; };
  auto id_of = [&](int j) {
    return prefill_row_id(a.rows, src.seq, (src.span.first + j) * kPrefillTile, src.seen, threadIdx.x);
  };
  const int count = src.span.count;
  load_queries<D>(a.q, a.heads_q, it, src.hk, q_tile);
  cp_async_commit();
  if (threadIdx.x < kPrefillTile) {
    ids[0][threadIdx.x] = count > 0 ? id_of(0) : -1;
    ids[1][threadIdx.x] = count > 1 ? id_of(1) : -1;
  }
  const auto mine = it.for_warp(warp, lane);
  cp_async_wait<0>();
  __syncthreads();
  QFragments<D> q;
  q.init(q_tile, 16 * warp, lane);
  RowState<D> st;
  // Each warp's copy of the absent columns of the tiles in flight, read off the ids at each issue.
  auto absent_of = [&](const int* tile_ids) { return absent_columns(tile_ids[lane], tile_ids[lane + 32]); };
  static_assert(kPrefillTile == 64, "absent_of reads 64 row ids");
  AbsentMasks<Stages> absent;
#pragma unroll
  for (int j = 0; j < Stages - 1; ++j) {  // tiles [0, Stages - 1), a commit group each
    if (j < count) {
      absent.set(j, absent_of(ids[j]));
      issue_prefill_tile<D>(a.pool, src.hk, ids[j], k_stage(j), k_stage(j) + kTileBytes);
    }
    cp_async_commit();
  }
  if constexpr (Stages == 3) {  // tile 2's ids replace tile 0's, once every thread issued tile 0
    __syncthreads();
    if (threadIdx.x < kPrefillTile) ids[0][threadIdx.x] = count > 2 ? id_of(2) : -1;
  }
  for (int j = 0; j < count; ++j) {
    cp_async_wait<Stages - 2>();
    __syncthreads();  // tile j landed; ids of tile j + Stages - 1 visible; its stage free
    const int ahead = j + Stages - 1;
    absent.push(ahead < count ? absent_of(ids[ahead % 2]) : 0);
    if (ahead < count)
      issue_prefill_tile<D>(a.pool, src.hk, ids[ahead % 2], k_stage(ahead % Stages), k_stage(ahead % Stages) + kTileBytes);
    cp_async_commit();
    const std::uint64_t absent_j = absent.pop();
    const int next_id = ahead + 1 < count && threadIdx.x < kPrefillTile ? id_of(ahead + 1) : -1;
    const int key0 = (src.span.first + j) * kPrefillTile;
    if (mine.rows > 0 && key0 <= mine.last() && key0 + kPrefillTile - 1 >= visible_begin(a.window, mine.first())) {
      const bool full = key0 >= visible_begin(a.window, mine.last()) && key0 + kPrefillTile - 1 <= mine.first();
      float s[kPrefillTile / 8][4];
      qk<D, kPrefillTile / 8, T>(s, q, k_stage(j % Stages), 0, lane);
      mask_tile<kPrefillTile / 8>(s, mine.rows, [&](int r) { return mine.qpos(r); }, key0, a.window, full, absent_j,
                                  a.scale_log2, lane);
      st.absorb(s);
      pv<D, kPrefillTile / 8, T>(st.o, s, k_stage(j % Stages) + kTileBytes, 0, lane);
    }
    if (ahead + 1 < count && threadIdx.x < kPrefillTile) ids[(ahead + 1) % 2][threadIdx.x] = next_id;
  }
  finish(mine, st, lane);
  __syncthreads();  // before the next item reuses the query tile and the stages
}

// Writes a warp's rows to the layer output (token-major [T, H_q, D]), each folded with its token's
// shared-prefix partials. The state is consumed.
template <class T, int D, class Rows, class QRows>
__device__ void write_rows(const LayerArgs<T, Rows>& a, const QRows& mine, int hk, RowState<D>& st, int lane) {
  using R = RowHalf<D>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (lane >> 2) + 8 * h;
    const R res(st, h);
    if (r >= mine.rows) continue;
    const int token = mine.token(r), head = mine.head(hk, r);
    auto column = [&](int j) { return R::column(j, lane); };
    a.shared.template fold<D, R::kValues>(token, head, a.heads_q, res.lse, column, [&](int j) -> float& { return res.v(j); });
    T* dst = a.out + (static_cast<std::int64_t>(token) * a.heads_q + head) * D;
#pragma unroll
    for (int j = 0; j < R::kValues; ++j) dst[column(j)] = from_float<T>(res.v(j));
  }
}

template <class T, int D, int Stages, class Rows>
__global__ void __launch_bounds__(kPrefillThreads) prefill_attention(PrefillArgs<T, Rows> a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int ids[2][kPrefillTile];
  const int heads_kv = a.pool.heads_kv, group = a.heads_q / heads_kv;
  const int items = a.work.prefill_count() * heads_kv;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const PrefillItem w = a.work.prefill[item / heads_kv];
    const int hk = item % heads_kv;
    ItemRows it{a.segments[w.seg], w.row0, 0, group};
    it.rows = min(kPrefillRows, it.seg.len * group - it.row0);
    const int own_begin = a.shared.own_begin_of(w.seg);
    const TileSource src{it.seg.seq, hk, tiles_seen(a.window, it.first(), it.last(), kPrefillTile, own_begin),
                         own_positions(a.window, it.first(), it.last(), own_begin)};
    attend_block<T, D, Stages>(a, it, src, smem, ids,
                       [&](const ItemRows& mine, RowState<D>& st, int lane) { write_rows<T, D>(a, mine, hk, st, lane); });
  }
}

}  // namespace cellkv::gpu::kernels
