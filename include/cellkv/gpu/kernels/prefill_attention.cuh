// cellkv/gpu/kernels/prefill_attention.cuh - prefill attention read through the position tables.
//
// Work item = (prefill item, KV head): kPrefillBlockRows query rows of one segment (token x GQA
// head of the group; the host plans items of that size when this kernel runs: AttentionShape::
// prefill_rows, table_attention.cuh), taken by the block in one pass, 16 per warp. They read the positions
// [own_begin, last row] of their sequence that
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
// fp8 pools (S = Fp8E4M3): the stages hold the tiles as stored (codes and scales, Fp8Stage<D>);
// once a tile has landed the block converts it into one swizzled K/V pair of T (decode(code) x
// scale in fp32, rounded to T once), and the MMA code reads that pair as it reads a T stage.
// Each conversion serves up to kPrefillBlockRows query rows.
//
// Dynamic shared memory (prefill_smem_bytes<D, Stages, S>(), Stages = prefill_stages(D)):
//   S = T:       Q tile [kPrefillBlockRows x D] T | Stages x (K tile, V tile) [kPrefillTile x D] T
//   S = Fp8E4M3: Q tile [kPrefillBlockRows x D] T | K tile, V tile [kPrefillTile x D] T (converted)
//                | Stages x Fp8Stage<D> (K codes, V codes [kPrefillTile x D] bytes, row-major;
//                  K scales, V scales [kPrefillTile] fp32)
// All T tiles are swizzled (SwizzledTile<D>).
//
// Grid: persistent (fixed); block: kPrefillWarps x 32 threads. On sm_90a, prefill_wgmma.cuh serves
// T pools of head dim 64, 128 and 256 instead (items of kPrefillRows = 128 rows).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cellkv/attention_plan.hpp"
#include "cellkv/fp8.hpp"
#include "cellkv/gpu/kernels/attention_tiles.cuh"
#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/kernels/fp8_tiles.cuh"
#include "cellkv/gpu/kernels/layer_args.cuh"
#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/kv_views.hpp"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/pool_view.hpp"
#include "cellkv/step_plan.hpp"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

// Query rows the block attends at a time: one prefill item of this kernel (kMinPrefillRows, the
// smallest item the step block's capacity covers, attention_plan.hpp).
inline constexpr int kPrefillBlockRows = 64;
static_assert(kPrefillBlockRows == kMinPrefillRows, "an item of this kernel is one pass of its block");
inline constexpr int kPrefillWarps = kPrefillBlockRows / 16;
inline constexpr int kPrefillThreads = 32 * kPrefillWarps;

// One stage of an fp8 pool's tile as stored: byte offsets of its parts.
template <int D>
struct Fp8Stage {
  static constexpr int kKCodes = 0;                         // [kPrefillTile][D] codes
  static constexpr int kVCodes = kPrefillTile * D;          // [kPrefillTile][D] codes
  static constexpr int kKScales = 2 * kPrefillTile * D;     // [kPrefillTile] fp32 (0: absent row)
  static constexpr int kVScales = kKScales + 4 * kPrefillTile;
  static constexpr int kBytes = kVScales + 4 * kPrefillTile;
};

// Dynamic shared memory of the prefill block (layout above); S: the pool's stored element (the
// 2-byte T, or Fp8E4M3).
//   D            64     128     256
//   Stages        3       3       2
//   S = T     57344  114688  163840   (56 / 112 / 160 KB)
//   S = fp8   50688   99840  164864   (49.5 / 97.5 / 161 KB)
// Two blocks fit an SM (228 KB, 1 KB reserved per block) for D <= 128 either way; one for D = 256.
template <int D, int Stages, class S = __nv_bfloat16>
constexpr int prefill_smem_bytes() {
  static_assert(Element<S> || std::is_same_v<S, Fp8E4M3>, "S: what the pool stores");
  constexpr int kQ = kPrefillBlockRows * D * 2, kPair = 2 * kPrefillTile * D * 2;
  if constexpr (std::is_same_v<S, Fp8E4M3>) return kQ + kPair + Stages * Fp8Stage<D>::kBytes;
  else return kQ + Stages * kPair;
}

// KV stages of the prefill block for head dim D: three where two blocks of them still fit an SM
// (D <= 128: 112 KB each for T, 97.5 KB for fp8), else two.
constexpr int prefill_stages(int head_dim) { return head_dim <= 128 ? 3 : 2; }

template <class T, class Rows, class S = T>
using PrefillArgs = LayerArgs<T, Rows, S>;

// Rows [row0, row0 + rows) of a segment; row r is token r / group, head r % group of the group.
// Positions grow with the row, so a range of rows sees from first() to last().
struct ItemRows {
  Segment seg;
  int row0 = 0, rows = 0, group = 1;
  __device__ int member_token(int member) const { return seg.tok0 + member; }  // token of rows [member group, + group)
  __device__ int token(int r) const { return member_token((row0 + r) / group); }
  __device__ int head(int hk, int r) const { return hk * group + (row0 + r) % group; }
  __device__ int qpos(int r) const { return seg.pos0 + (row0 + r) / group; }
  __device__ int member_qpos(int member) const { return seg.pos0 + member; }  // position of rows [member group, + group)
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

// The item this block takes in its round n of `items` (-1: none left): dealt_item of
// attention_plan.hpp over the grid.
__device__ __forceinline__ int dealt_item(int n, int items) {
  return cellkv::dealt_item(n, items, static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x));
}

// Query rows [0, Rows) of `it` (zeros past it.rows) into a swizzled shared tile (Layout::offset(row,
// chunk): SwizzledTile for ldmatrix, Sw128Tile for wgmma), by threads [0, Threads) of the block
// (thread `thread`). A thread copies chunk thread % C of rows thread / C + i (Threads / C),
// C = D / 8; row r is member (row0 + r) / group, head (row0 + r) % group of the rows, walked from
// row to row without a division.
template <int D, int Rows, int Threads, class Layout = SwizzledTile<D>, class T, class QRows>
__device__ void load_queries(const T* q, int heads_q, const QRows& it, int hk, std::uint32_t q_dst, int thread) {
  constexpr int kChunks = D / 8, kRowStep = Threads / kChunks;
  static_assert(Threads % kChunks == 0 && Rows % kRowStep == 0, "every thread copies as many chunks");
  const int chunk = thread % kChunks, r0 = thread / kChunks;
  const int step_member = kRowStep / it.group, step_head = kRowStep % it.group;
  int member = (it.row0 + r0) / it.group, head = (it.row0 + r0) % it.group;
#pragma unroll 4
  for (int i = 0; i < Rows / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool valid = r < it.rows;
    const std::int64_t off =
        valid ? (static_cast<std::int64_t>(it.member_token(member)) * heads_q + hk * it.group + head) * D + chunk * 8 : 0;
    cp_async_16(q_dst + Layout::offset(r, chunk), q + off, valid);
    member += step_member, head += step_head;
    if (head >= it.group) head -= it.group, ++member;
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

// Issues the copies of one fp8 tile (row ids in shared memory) into a stage (Fp8Stage<D>): the
// codes in 16-byte chunks (a thread's chunk the same in every pass, its row kPrefillThreads /
// (D / 16) further on), the scales one fp32 each; absent rows (id -1) are zero-filled, codes and
// scales. D = 256 issues its passes one at a time: unrolled, the block spills (it holds 128
// accumulators a lane).
template <int D>
__device__ __forceinline__ void issue_fp8_tile(const Fp8PoolView<const Fp8E4M3>& pool, int hk, const int* ids,
                                               std::uint32_t stage) {
  using F = Fp8Stage<D>;
  constexpr int kChunks = D / 16, kRowStep = kPrefillThreads / kChunks, kPasses = kPrefillTile / kRowStep;
  static_assert(kPrefillThreads % kChunks == 0 && kPrefillTile % kRowStep == 0 && kPrefillThreads >= kPrefillTile);
  constexpr int kUnroll = D >= 256 ? 1 : kPasses;
  const int chunk = threadIdx.x % kChunks, row0 = threadIdx.x / kChunks;
#pragma unroll kUnroll
  for (int p = 0; p < kPasses; ++p) {
    const int row = row0 + p * kRowStep, id = ids[row];
    const bool valid = id >= 0;
    const std::int64_t off = valid ? pool.offset(id, hk) + chunk * 16 : 0;
    const auto dst = static_cast<std::uint32_t>(row * D + chunk * 16);
    cp_async_16(stage + F::kKCodes + dst, pool.k + off, valid);
    cp_async_16(stage + F::kVCodes + dst, pool.v + off, valid);
  }
  if (threadIdx.x < kPrefillTile) {
    const int id = ids[threadIdx.x];
    const bool valid = id >= 0;
    const std::int64_t off = valid ? pool.scale_offset(id, hk) : 0;
    cp_async_4(stage + F::kKScales + 4 * threadIdx.x, pool.k_scale + off, valid);
    cp_async_4(stage + F::kVScales + 4 * threadIdx.x, pool.v_scale + off, valid);
  }
}

// Two E4M3 codes (the low byte first) x scale as two T (the low half first): the codes decode
// exactly to f16 (cvt.rn.f16x2.e4m3x2: every E4M3 value is an f16 value; the NaN codes 0x7F and
// 0xFF give the f16 NaN 0x7FFF), then each is multiplied by the scale in fp32 and rounded to T
// once: T(decode_e4m3(code) x scale), fp8.hpp, clamped to +-65504 for fp16 (a static scale can
// put 448 x scale past it). A NaN code stays NaN; a zero-filled row (codes 0, scale 0) gives 0.
template <class T>
__device__ __forceinline__ std::uint32_t dequantize_e4m3x2(std::uint32_t codes, float scale) {
  const std::uint32_t h2 = e4m3x2_to_half2(codes);
  float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
  f.x *= scale, f.y *= scale;
  if constexpr (std::is_same_v<T, __half>) {  // a static scale can put 448 x scale past fp16's 65504
    auto clamp = [](float x) { return x > 65504.f ? 65504.f : x < -65504.f ? -65504.f : x; };  // NaN stays NaN
    f.x = clamp(f.x), f.y = clamp(f.y);
  }
  return pack2<T>(f.x, f.y);
}

// Converts the fp8 tile of a landed stage into the swizzled T tiles k_dst and v_dst. A thread
// converts one 8-code chunk (one 16-byte chunk of T) of K and the same of V per pass, its chunk
// the same in every pass and its row kPrefillThreads / (D / 8) further on; two passes at a time
// (with four, shared_prefix_attention<*, 64, 3, TableRows, Fp8E4M3> spills 4 bytes).
template <int D, class T>
__device__ __forceinline__ void convert_fp8_tile(std::uint32_t stage, std::uint32_t k_dst, std::uint32_t v_dst) {
  using F = Fp8Stage<D>;
  constexpr int kChunks = D / 8, kRowStep = kPrefillThreads / kChunks, kPasses = kPrefillTile / kRowStep;
  static_assert(kPrefillThreads % kChunks == 0 && kPrefillTile % kRowStep == 0, "every thread converts as many chunks");
  const int chunk = threadIdx.x % kChunks, row0 = threadIdx.x / kChunks;
#pragma unroll 2
  for (int p = 0; p < kPasses; ++p) {
    const int row = row0 + p * kRowStep;
    const auto codes = stage + static_cast<std::uint32_t>(row * D + chunk * 8);
    const auto scales = stage + static_cast<std::uint32_t>(4 * row);
    const std::uint32_t dst = SwizzledTile<D>::offset(row, chunk);
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      std::uint32_t c0, c1;
      float scale;
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                   : "=r"(c0), "=r"(c1)
                   : "r"(codes + (v ? F::kVCodes : F::kKCodes)));
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(scale) : "r"(scales + (v ? F::kVScales : F::kKScales)));
      const std::uint32_t x0 = dequantize_e4m3x2<T>(c0, scale), x1 = dequantize_e4m3x2<T>(c0 >> 16, scale),
                          x2 = dequantize_e4m3x2<T>(c1, scale), x3 = dequantize_e4m3x2<T>(c1 >> 16, scale);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"((v ? v_dst : k_dst) + dst), "r"(x0), "r"(x1),
                   "r"(x2), "r"(x3)
                   : "memory");
    }
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

// One block's attention of up to kPrefillBlockRows query rows `it` (QRows: ItemRows or SharedRows) over
// the tiles of `src`, streamed through `Stages` (2 or 3) shared-memory stages; finish(warp's rows,
// state, lane) writes each warp's result. The block leaves with every thread past its last use of
// the shared tiles. `ids` holds the row ids of two tiles: the next to issue and the one after.
// S = Fp8E4M3: the stages hold codes and scales, each landed tile is converted into the one T
// K/V pair before the warps read it (the layout at the top of this file).
template <class T, int D, int Stages, class Rows, class QRows, class Finish, class S = T>
__device__ void attend_block(const LayerArgs<T, Rows, S>& a, const QRows& it, const TileSource& src,
                             unsigned char* smem, int (&ids)[2][kPrefillTile], Finish&& finish) {
  static_assert(Stages == 2 || Stages == 3, "attend_block streams its KV tiles through 2 or 3 stages");
  constexpr bool kFp8 = std::is_same_v<S, Fp8E4M3>;
  static_assert(kFp8 || std::is_same_v<S, T>, "the pool stores T or fp8 codes");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t q_tile = smem_addr(smem);
  const std::uint32_t stages = q_tile + kPrefillBlockRows * D * 2;
  constexpr std::uint32_t kTileBytes = kPrefillTile * D * 2;
  // T: stage s's K tile (its V tile follows). fp8: the converted K tile is k_stage(0), and stage s
  // holds codes and scales at fp8_stage(s).
  auto k_stage = [&](int s) { return stages + static_cast<std::uint32_t>(s) * 2 * kTileBytes; };
  auto fp8_stage = [&](int s) { return stages + 2 * kTileBytes + static_cast<std::uint32_t>(s * Fp8Stage<D>::kBytes); };
  // The K tile the warps read tile j from.
  auto k_tile = [&](int j) {
    if constexpr (kFp8) return k_stage(0);
    else return k_stage(j % Stages);
  };
  auto issue = [&](const int* tile_ids, int s) {
    if constexpr (kFp8) issue_fp8_tile<D>(a.pool, src.hk, tile_ids, fp8_stage(s));
    else issue_prefill_tile<D>(a.pool, src.hk, tile_ids, k_stage(s), k_stage(s) + kTileBytes);
  };
  auto id_of = [&](int j) {
    return prefill_row_id(a.rows, src.seq, (src.span.first + j) * kPrefillTile, src.seen, threadIdx.x);
  };
  const int count = src.span.count;
  load_queries<D, kPrefillBlockRows, kPrefillThreads>(a.q, a.heads_q, it, src.hk, q_tile, threadIdx.x);
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
      issue(ids[j], j);
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
    if (ahead < count) issue(ids[ahead % 2], ahead % Stages);
    cp_async_commit();
    if constexpr (kFp8) {  // tile j's codes -> the T pair (the warps are past tile j - 1's reads)
      convert_fp8_tile<D, T>(fp8_stage(j % Stages), k_tile(j), k_tile(j) + kTileBytes);
      __syncthreads();
    }
    const std::uint64_t absent_j = absent.pop();
    const int next_id = ahead + 1 < count && threadIdx.x < kPrefillTile ? id_of(ahead + 1) : -1;
    const int key0 = (src.span.first + j) * kPrefillTile;
    if (mine.rows > 0 && key0 <= mine.last() && key0 + kPrefillTile - 1 >= visible_begin(a.window, mine.first())) {
      const bool full = key0 >= visible_begin(a.window, mine.last()) && key0 + kPrefillTile - 1 <= mine.first();
      float s[kPrefillTile / 8][4];
      qk<D, kPrefillTile / 8, T>(s, q, k_tile(j), 0, lane);
      mask_tile<kPrefillTile / 8>(s, mine.rows, [&](int r) { return mine.qpos(r); }, key0, a.window, full, absent_j,
                                  a.scale_log2, lane);
      st.absorb(s);
      pv<D, kPrefillTile / 8, T>(st.o, s, k_tile(j) + kTileBytes, 0, lane);
    }
    if (ahead + 1 < count && threadIdx.x < kPrefillTile) ids[(ahead + 1) % 2][threadIdx.x] = next_id;
  }
  finish(mine, st, lane);
  __syncthreads();  // before the next item reuses the query tile and the stages
}

// Where a query row's output goes: its token and query head.
struct RowPlace {
  int token = 0, head = 0;
};

// Writes a warp's rows to the layer output (token-major [T, H_q, D]), each folded with its token's
// shared-prefix partials when `folds` (the segment's own_begin > 0: exactly the segments whose
// tokens have partial slots, sharing_planner.hpp). The state is consumed. The output is 16-byte
// aligned (the launch checks it): the quad's lanes store 16-byte pieces (RowHalf::store_row).
// rows: the warp's rows (of its 16); place(h): the RowPlace of this lane's row lane / 4 + 8 h
// (called only for rows < rows). write_rows: the places from the warp's ItemRows.
template <class T, int D, class Rows, class Place, class S = T>
__device__ void write_rows_at(const LayerArgs<T, Rows, S>& a, int rows, Place&& place, RowState<D>& st, int lane,
                              bool folds) {
  using R = RowHalf<D>;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = (lane >> 2) + 8 * h;
    const R res(st, h, folds);
    T* row = nullptr;  // stays null for a row past the item's: the quad stores nothing
    if (r < rows) {
      const auto [token, head] = place(h);
      auto column = [&](int j) { return R::column(j, lane); };
      if (__builtin_expect(folds, 0))
        a.shared.template fold<D, R::kValues>(token, head, a.heads_q, res.lse, column, [&](int j) -> float& { return res.v(j); });
      row = a.out + (static_cast<std::int64_t>(token) * a.heads_q + head) * D;
    }
    res.store_row(row, lane);  // every lane: the quads exchange values
  }
}
template <class T, int D, class Rows, class QRows, class S = T>
__device__ void write_rows(const LayerArgs<T, Rows, S>& a, const QRows& mine, int hk, RowState<D>& st, int lane,
                           bool folds) {
  write_rows_at<T, D>(
      a, mine.rows,
      [&](int h) {
        const int r = (lane >> 2) + 8 * h;
        return RowPlace{mine.token(r), mine.head(hk, r)};
      },
      st, lane, folds);
}

// Prefill item `item` of the uploaded step's window work: its rows (kItemRows at most) and KV head.
// kItemRows: the rows of an item as the host planned them for the kernel that runs
// (AttentionShape::prefill_rows): kPrefillRows for prefill_wgmma, kPrefillBlockRows for prefill_attention.
struct PrefillWork {
  ItemRows rows;
  int hk = 0;
  int own_begin = 0;  // the first position the item's segment reads itself (shared_fold.cuh)
};
template <int kItemRows, class T, class Rows, class S>
__device__ PrefillWork prefill_work(const LayerArgs<T, Rows, S>& a, int item) {
  const int heads_kv = a.pool.heads_kv, group = a.heads_q / heads_kv;
  const PrefillItem w = a.work.prefill[item / heads_kv];
  ItemRows it{a.segments[w.seg], w.row0, 0, group};
  it.rows = min(kItemRows, it.seg.len * group - it.row0);
  return {it, item % heads_kv, a.shared.own_begin_of(w.seg)};
}

// The tiles rows `it` read of KV head hk through `window`, from own_begin on.
__device__ inline TileSource tile_source(const ItemRows& it, int hk, int window, int own_begin) {
  return {it.seg.seq, hk, tiles_seen(window, it.first(), it.last(), kPrefillTile, own_begin),
          own_positions(window, it.first(), it.last(), own_begin)};
}

// Rows [row0, row0 + count) of `it` (count clamped to what it has, possibly 0).
__device__ inline ItemRows sub_rows(ItemRows it, int row0, int count) {
  it.row0 += row0;
  it.rows = max(0, min(count, it.rows - row0));
  return it;
}

// S: what the pool stores (T, or Fp8E4M3); dynamic smem prefill_smem_bytes<D, Stages, S>().
template <class T, int D, int Stages, class Rows, class S = T>
__global__ void __launch_bounds__(kPrefillThreads) prefill_attention(PrefillArgs<T, Rows, S> a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int ids[2][kPrefillTile];
  allow_dependent_grids();
  wait_for_prior_grids();
  a.guard.check(a.work);
  const int items = a.work.prefill_count() * a.pool.heads_kv;
  for (int n = 0, item; (item = dealt_item(n, items)) >= 0; ++n) {
    const PrefillWork w = prefill_work<kPrefillBlockRows>(a, item);  // one pass of the block
    attend_block<T, D, Stages>(a, w.rows, tile_source(w.rows, w.hk, a.window, w.own_begin), smem, ids,
                               [&](const ItemRows& mine, RowState<D>& st, int lane) {
                                 write_rows<T, D>(a, mine, w.hk, st, lane, w.own_begin > 0);
                               });
  }
}

}  // namespace cellkv::gpu::kernels
