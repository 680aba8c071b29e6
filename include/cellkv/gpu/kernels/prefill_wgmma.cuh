// cellkv/gpu/kernels/prefill_wgmma.cuh - prefill attention on Hopper (sm_90a): warpgroup MMAs fed
// by a producer warpgroup, read through the position tables.
//
// Work item = (prefill item, KV head), as prefill_attention.cuh: kPrefillRows (128) query rows of
// one segment (token x GQA head of the group). The block's loop is written for any work (Work:
// the items, each item's rows, KV head and tiles, where its rows' results go, and what the consumer
// threads do before and after all their items): PrefillItems here, the shared-prefix items of
// shared_prefix_attention.cuh (shared_prefix_wgmma). The persistent blocks take the items one at a
// time from a device counter in the plan's order (by segment, each segment's items heaviest first:
// plan_window; item_claims.cuh; the shared-prefix items: dealt in rounds). Block: three warpgroups.
//   producer  (warpgroup 0, kProducerRegisters a thread): per item, the item's queries into the
//             query tile and the item itself (WgmmaItem) into a slot for the consumers, so they
//             start it without a global read; then every KV tile the item reads (kTile = 128
//             positions, 64 for D = 256; gathered row by row through the position table with
//             cp.async, holes and unread positions zero-filled; an item reads up to its segment's
//             last position, PrefillItems::at) into a ring of Stages stages, with
//             the tile's absent columns beside it. A stage's K and V halves are handed over and
//             back on their own: the K half is refilled once S has read it, the V half once P V
//             has, so the next K tiles load while the consumers still hold the V tiles before
//             them. Each warp gathers 32 rows of a tile: of K, then V, where it has 128 rows; of K
//             (warps 0, 1) or V (warps 2, 3), each pair at its own pace, where it has 64. Where a
//             warp's 32 rows are consecutive pool rows, all present and seen (a clustered
//             placement's interior tiles), its lane 0 copies them instead with one TMA box per 64
//             columns (pool_maps.cuh; the kernel's `maps` parameter, valid 0: always gathered).
//   consumers (warpgroups 1 and 2, kConsumerRegisters): rows [64 c, 64 c + 64) of the item each;
//             per tile S = Q K^T (wgmma, the queries and K from shared memory), mask and online
//             softmax in registers (attention_tiles.cuh: the accumulator layout is mma.sync's),
//             O += P V (wgmma, P from registers, V from the stage). A consumer whose rows cannot
//             see a tile skips its MMAs (causal and window by position ranges; tiles wholly inside
//             every row's range are not masked). The two warpgroups take turns to issue their
//             MMAs (PingPong: named barriers; CELLKV_PREFILL_PING_PONG=0 builds without the
//             turns), so one's softmax runs under the other's MMAs.
// Hand-over, by mbarriers, one pair for each half of a stage: full_k[s] completes when the
// copies of K into stage s have landed (cp.async.mbarrier.arrive) and the lane 0 of each warp
// that copied them has written its rows' absent bits; empty_k[s] when all 256 consumer threads
// are done with the K tile (S complete, the absent bits read); full_v[s] and empty_v[s] the same
// for the V tile (P V complete). q_full when the queries have landed and the item slot is
// written; q_empty when both consumer warpgroups' last S of the item is done (S reads the query
// tile), so the next item's queries load while the consumers finish the current one. The
// consumers fence the async proxy before their wgmmas read what cp.async (generic proxy) wrote.
//
// Dynamic shared memory (WgmmaPrefill<D>, 1024-byte aligned inside the allocation):
//   Stages x (K tile, V tile) [kTile x D] T (Sw128Tile) | Q tile [kPrefillRows x D] T
//   (Sw128Tile) | absent [Stages][2] u64 | item slots [2] (by item parity, kItemBytes each) |
//   barriers full_k[Stages], empty_k[Stages], full_v[Stages], empty_v[Stages], q_full, q_empty |
//   claimed [2] int (the producer's items, RoundItems)
// Grid: persistent, one block per SM. Only pools of T (not fp8), D = 64, 128 and 256 (the
// shared-prefix items: D = 64 and 128).
#pragma once

#include <cuda/ptx>
#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/kernels/attention_tiles.cuh"
#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/kernels/item_claims.cuh"
#include "cellkv/gpu/kernels/layer_args.cuh"
#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/kernels/pool_maps.cuh"
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
inline constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
inline constexpr int kWgmmaRegisterNeed = kWarpgroup * (kProducerRegisters + 2 * kConsumerRegisters);
static_assert(kPrefillRows == 2 * kConsumerRows, "two consumer warpgroups cover an item");
// Key positions of a KV tile for head dims up to 128 (the shared-prefix items' split unit): two of
// the position table's kPrefillTile tiles, so S is one m64n128 wgmma group and the per-tile work
// (barriers, softmax reductions, rescale) is spread over 128 keys.
inline constexpr int kWideTile = 2 * kPrefillTile;

// Head dims the prefill kernel serves, and the shared-prefix kernel (whose finished tokens,
// shared_finish.cuh, are written for D <= 128).
constexpr bool wgmma_prefill_supports(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }
constexpr bool wgmma_shared_supports(int head_dim) { return head_dim == 64 || head_dim == 128; }

// The barriers, in shared memory from `first` (one pointer, so that a producer thread keeps one):
//   full_k[Stages]   count: the threads of the warps gathering K (async arrivals) + their lane 0s
//   empty_k[Stages]  count: consumer threads
//   full_v[Stages]   count: the same for V
//   empty_v[Stages]  count: consumer threads
//   q_full           count: producer threads (async arrivals) + producer thread 0 (the item slot)
//   q_empty          count: consumer threads
template <int Stages>
struct PrefillBarriers {
  static constexpr int kCount = 4 * Stages + 2;
  std::uint64_t* first;
  // The ring barriers of the K tiles (v: of the V tiles).
  __device__ __forceinline__ std::uint64_t* full(bool v) const { return first + (v ? 2 * Stages : 0); }
  __device__ __forceinline__ std::uint64_t* empty(bool v) const { return full(v) + Stages; }
  __device__ __forceinline__ std::uint64_t* q_full() const { return first + 4 * Stages; }
  __device__ __forceinline__ std::uint64_t* q_empty() const { return first + 4 * Stages + 1; }
};

// Shared-memory layout for head dim D (byte offsets from the 1024-aligned base). D = 256 reads KV
// tiles of one table tile (64 positions): its 128 KB stage of two 128-position tiles would leave no
// room for a second stage beside its 64 KB query tile.
//   D         64      128     256
//   kTile    128      128      64
//   kStages    6        3       2
template <int D>
struct WgmmaPrefill {
  static constexpr int kTile = D <= 128 ? kWideTile : kPrefillTile;  // key positions of a KV tile
  static constexpr int kN = kTile / 8;                               // 8-column blocks of S a thread holds
  static constexpr int kStages = D <= 64 ? 6 : D <= 128 ? 3 : 2;
  using KV = Sw128Tile<kTile, D>;
  static constexpr int kStageBytes = 2 * KV::kBytes;  // K tile, then V tile
  using QTile = Sw128Tile<kPrefillRows, D>;  // read by the wgmmas as A, K-major like K
  static constexpr int kQ = kStages * kStageBytes;
  static constexpr int kAbsent = kQ + kPrefillRows * D * 2;
  static constexpr int kItemBytes = 128;  // one slot of the item descriptors (WgmmaItem)
  static constexpr int kItems = kAbsent + 16 * kStages;
  static constexpr int kBarriers = kItems + 2 * kItemBytes;
  static constexpr int kClaimed = kBarriers + 8 * PrefillBarriers<kStages>::kCount;  // int [2], by round parity
  static constexpr int kBytes = kClaimed + 2 * 4;
  static constexpr int kAllocation = kBytes + 1024;  // room to align the base
  static_assert(kAllocation <= 232448, "fits the opt-in shared memory of a Hopper block (227 KB)");
};

// Named barriers of the consumer warpgroups' ping-pong (PingPong); 0 is __syncthreads, 1 the
// shared finish's (shared_prefix_attention.cuh).
inline constexpr int kPingPongBarrier = 2;
// Named barrier of the producer warpgroup: the item of a round handed from its thread 0 to its warps.
inline constexpr int kProducerBarrier = 4;
// Whether the consumer warpgroups take turns (PingPong) or issue freely; CELLKV_PREFILL_PING_PONG=0
// at build time turns the turns off. On by default since 2026-12-07: together with the cheaper
// output (the first P V sets o, rcp.approx, the log-sum-exp only where partials fold) they gained
// 2-3% at 8x1k in the cell layout (1-2% in the sequence layout) and 1-3% at 4x4k, on the H200 and
// the H100 (benchmarks/RESULTS.md). Both builds pass compute-sanitizer's memcheck, racecheck and
// synccheck.
#ifndef CELLKV_PREFILL_PING_PONG
#define CELLKV_PREFILL_PING_PONG 1
#endif
inline constexpr bool kPingPong = CELLKV_PREFILL_PING_PONG != 0;

// The order of the two consumer warpgroups' MMAs: warpgroup c issues a tile's MMAs (an "issue")
// only once the other has made its previous issue, so one warpgroup's softmax runs while the
// other's MMAs keep the tensor cores busy. Warpgroup c waits on barrier kPingPongBarrier + c (both
// warpgroups' 256 threads: its own wait, the other's pass). Warpgroup 1 passes once first, so
// warpgroup 0 issues first; both make the same issues (consume_tiles walks every tile of an item's
// span, MMAs or not), and warpgroup 0 takes the last pass at the end (finish()), so every phase of
// both barriers completes. Both walk the tiles in the same order of waits, so neither waits for a
// tile the other holds back.
struct PingPong {
  int c;
  __device__ __forceinline__ void wait() const {
    if constexpr (kPingPong) asm volatile("bar.sync %0, %1;" ::"r"(kPingPongBarrier + c), "n"(2 * kWarpgroup) : "memory");
  }
  __device__ __forceinline__ void pass() const {
    if constexpr (kPingPong)
      asm volatile("bar.arrive %0, %1;" ::"r"(kPingPongBarrier + 1 - c), "n"(2 * kWarpgroup) : "memory");
  }
  __device__ __forceinline__ void start() const {
    if (c == 1) pass();
  }
  __device__ __forceinline__ void finish() const {
    if (c == 0) wait();
  }
};

// x, the same in every lane of the warp, as lane 0's: the compiler then knows it is warp-uniform and
// keeps what derives from it (the wgmma descriptors of a stage or a query tile) in uniform
// registers, instead of moving each descriptor there (R2UR) before every wgmma.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

__device__ __forceinline__ void wait_phase(std::uint64_t* bar, std::uint32_t parity) {
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

// Where a loop is in the ring of stages: the stage of a tile and its phase parity.
template <int Stages>
struct RingCursor {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == Stages) stage = 0, phase ^= 1u;
  }
};

// The item's KV tiles in tiles of Tile positions: tile first + j covers positions [Tile (first + j),
// Tile (first + j + 1)), the position-table tiles of `span` and, for Tile = 2 kPrefillTile, at most
// one more at each end (its positions outside what the item reads are absent).
struct WideSpan {
  int first = 0, count = 0;
};
template <int Tile>
__device__ __forceinline__ WideSpan wide_span(const TileSpan& span) {
  constexpr int kRatio = Tile / kPrefillTile;
  if (span.count <= 0) return {};
  const int first = span.first / kRatio, last = (span.first + span.count - 1) / kRatio;
  return {first, last - first + 1};
}

// What a producer lane copies of every tile (D / 8 16-byte chunks a row; lane l copies chunk
// l % C of rows l / C + p (32 / C), p = 0, 1, ..: C = D / 8), fixed per item so that a copy costs a
// shuffle, two multiply-adds and the cp.async. Each warp gathers 32 rows (rows_of(warp)): of K
// and V both where a tile has 128 rows, K first; of K (warps 0, 1) or V (warps 2, 3) where it has
// 64 (kSplitKV), the two pairs then each at its own pace.
template <class T, int D>
struct ProducerLane {
  static constexpr int kChunks = D / 8, kRowStep = 32 / kChunks, kPasses = 32 / kRowStep;
  static constexpr bool kSplitKV = WgmmaPrefill<D>::kTile == kProducerWarps / 2 * 32;  // two warps a tensor
  static_assert(kSplitKV || WgmmaPrefill<D>::kTile == kWarpgroup, "32 rows a warp");
  static_assert(32 % kChunks == 0 && kPrefillTile % 32 == 0, "whole rows per pass; a warp's rows in one table tile");
  static constexpr int kTensorWarps = kSplitKV ? kProducerWarps / 2 : kProducerWarps;  // warps that gather a tensor
  // The first of the 32 tile rows warp `warp` gathers.
  static __device__ __forceinline__ int rows_of(int warp) { return 32 * (kSplitKV ? warp % 2 : warp); }
  // Whether warp `warp` gathers V alone (the V warps when kSplitKV).
  static __device__ __forceinline__ bool v_only(int warp) { return kSplitKV && warp >= 2; }
  const char* k;             // K of (row 0, the item's KV head), this lane's chunk (V for the V warps when kSplitKV)
  const char* v;             // the same in V (unused when kSplitKV)
  std::uint32_t row_bytes;   // bytes from one pool row to the next
  std::uint32_t dst;         // this lane's chunk in its pass-0 row (rows_of + sub) of a stage's K tile (V tile: V
                             // warps when kSplitKV), less its swizzle
  std::uint32_t swizzle;     // ((chunk & 7) ^ (row & 7)) << 4 of pass 0's row
  __device__ ProducerLane(const PoolView<const T>& pool, int hk, int warp, int lane) {
    using KV = typename WgmmaPrefill<D>::KV;
    const int chunk = lane % kChunks, sub = lane / kChunks;  // sub: the lane's row within a pass
    const std::int64_t head = static_cast<std::int64_t>(hk) * pool.head_dim + chunk * 8;
    k = reinterpret_cast<const char*>((v_only(warp) ? pool.v : pool.k) + head);
    v = reinterpret_cast<const char*>(pool.v + head);
    row_bytes = static_cast<std::uint32_t>(pool.row_elems() * sizeof(T));
    dst = static_cast<std::uint32_t>((v_only(warp) ? KV::kBytes : 0) + (chunk >> 3) * KV::kBlockBytes +
                                     (rows_of(warp) + sub) * 128);
    swizzle = static_cast<std::uint32_t>(((chunk & 7) ^ sub) << 4);
  }
  // Stage offset of pass p's chunk: rows advance by kRowStep, and (p kRowStep + sub) & 7 =
  // ((p kRowStep) & 7) ^ sub as sub < kRowStep, a power of two.
  __device__ __forceinline__ std::uint32_t offset(int p) const {
    return dst + static_cast<std::uint32_t>(p * kRowStep * 128) + (swizzle ^ static_cast<std::uint32_t>(((p * kRowStep) & 7) << 4));
  }
};

// The warp's 32 rows of one tensor of a tile into stage `stage` (V: pl.v into the V tile, else pl.k
// into the warp's tile): `id` is the row id of the lane's row rows_of(warp) + lane (-1: absent,
// zero-filled), each copy's row id shuffled from its lane.
template <class T, int D, bool V>
__device__ __forceinline__ void copy_rows(const ProducerLane<T, D>& pl, int id, std::uint32_t stage, int lane) {
  using KV = typename WgmmaPrefill<D>::KV;
  using PL = ProducerLane<T, D>;
  const int sub = lane / PL::kChunks;
  const char* const src = V ? pl.v : pl.k;
#pragma unroll
  for (int p = 0; p < PL::kPasses; ++p) {
    const int from = __shfl_sync(0xffffffffu, id, p * PL::kRowStep + sub);
    const std::uint64_t row = static_cast<std::uint64_t>(static_cast<std::uint32_t>(max(from, 0))) * pl.row_bytes;
    cp_async_16(stage + pl.offset(p) + (V ? KV::kBytes : 0u), src + row, from >= 0);
  }
}

// The warp's 32 rows of one tensor of a tile when they are the pool rows [first_id, first_id + 32),
// all present and seen: D / 64 TMA boxes (pool_maps.cuh), issued by lane 0, counted by `full`'s
// transaction bytes. tile_rows: the shared address of the warp's first row in the stage's K or V tile.
template <class T, int D>
__device__ __forceinline__ void copy_rows_tma(const CUtensorMap* map, int first_id, int hk, std::uint32_t tile_rows,
                                              std::uint64_t* full, int lane) {
  using KV = typename WgmmaPrefill<D>::KV;
  static_assert(kMapRows == 32, "a warp's rows are one box");
  if (lane != 0) return;
  ::cuda::ptx::mbarrier_expect_tx(::cuda::ptx::sem_relaxed, ::cuda::ptx::scope_cta, ::cuda::ptx::space_shared, full,
                                  static_cast<std::uint32_t>(kMapRows * D * sizeof(T)));
#pragma unroll
  for (int b = 0; b < D / 64; ++b) {
    const std::int32_t coords[3] = {0, hk * (D / 64) + b, first_id};
    void* dst = reinterpret_cast<void*>(__cvta_shared_to_generic(tile_rows + static_cast<std::uint32_t>(b * KV::kBlockBytes)));
    ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, dst, map, coords, full);
  }
}

// What one item of a Work gives the block: its query rows (QRows: ItemRows, or SharedRows of a
// shared run), its KV head, the tiles it reads, and the split it covers (shared items).
template <class QRows>
struct WgmmaItem {
  QRows rows;
  int hk = 0;
  TileSource src;
  int split = 0;
  bool folds = false;  // prefill items: whether the rows fold in shared-prefix partials (write_rows)
};

// The prefill items of the uploaded step (Work of the wgmma block): item i is prefill item
// i / H_kv, KV head i % H_kv; results to the layer output, folded with the shared partials.
template <class T, class Rows>
struct PrefillItems {
  const PrefillArgs<T, Rows>& a;
  __device__ int count() const { return a.work.prefill_count() * a.pool.heads_kv; }
  __device__ WgmmaItem<ItemRows> at(int item, int /*lane*/) const {
    const PrefillWork w = prefill_work<kPrefillRows>(a, item);
    TileSource src = tile_source(w.rows, w.hk, a.window, w.own_begin);
    // The positions past the item's last query up to its segment's last, which this step wrote,
    // are read too (the mask hides them by position): a causal diagonal tile whose segment goes on
    // then keeps its rows consecutive, copied by TMA rather than gathered, with no absent columns.
    src.seen.end = max(src.seen.end, w.rows.seg.pos0 + w.rows.seg.len - 1);
    return {w.rows, w.hk, src, 0, w.own_begin > 0};
  }
  // mine: the warp's WarpRows<ItemRows> (the places of the lane's rows, worked out once an item).
  template <int D, class Mine>
  __device__ void finish(const WgmmaItem<ItemRows>& it, const Mine& mine, RowState<D>& st, int lane) const {
    write_rows_at<T, D>(
        a, mine.rows.rows,
        [&](int h) { return RowPlace{mine.rows.member_token(mine.member[h]), it.hk * mine.rows.group + mine.in_group[h]}; },
        st, lane, it.folds);
  }
  // Work of the consumer threads (thread: 0 to 255) before and after all their items: none here.
  template <int D>
  __device__ void before_items(int /*thread*/) const {}
  template <int D>
  __device__ void after_items(int /*thread*/) const {}
};

// The item of each round of the producer: thread 0 takes it (ItemClaims) a round ahead, so a claim's
// latency hides behind the round before, and hands it to the producer's warps through
// claimed[round parity] and named barrier kProducerBarrier (a thread reads round n's word before
// it arrives for round n + 1, which thread 0 passes before it writes round n + 2's).
struct RoundItems {
  ItemClaims claims;
  int items;
  int* claimed;  // shared [2]
  int ahead = -1;  // thread 0: the item of the next round
  __device__ RoundItems(ItemClaims c, int count, int* words, int t) : claims(c), items(count), claimed(words) {
    if (t == 0) ahead = claims.take(0, items);
  }
  // Round n's item (-1: the block's items are done), in every producer thread.
  __device__ int next(int n, int t) {
    if (t == 0) claimed[n & 1] = ahead;
    asm volatile("bar.sync %0, %1;" ::"n"(kProducerBarrier), "n"(kWarpgroup) : "memory");
    const int item = claimed[n & 1];
    if (t == 0 && item >= 0) ahead = claims.take(n + 1, items);
    return item;
  }
};

// The producer warpgroup (thread t = threadIdx.x in [0, 128)): the queries of every item the block
// takes (RoundItems), then its KV tiles through the ring, each half of a stage once the consumers
// have released it (ProducerLane: which warps gather which rows); after the last item an item slot
// with KV head -1, which ends the consumers' loop. The row ids of the next tile are read before
// the current tile's copies, so their latency hides behind them.
template <class T, int D, class Rows, class Work, class Item>
__device__ void produce_tiles(const LayerArgs<T, Rows>& a, const PoolMaps* maps, const Work& work, ItemClaims claims,
                              std::uint32_t base, std::uint32_t* absent, Item* item_slots, int* claimed,
                              const PrefillBarriers<WgmmaPrefill<D>::kStages>& bar) {
  using L = WgmmaPrefill<D>;
  using PL = ProducerLane<T, D>;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const bool v_warp = PL::v_only(warp);
  RoundItems round(claims, work.count(), claimed, t);
  // The lane's row of a tile: rows_of(warp) + lane, in the table tile at `table_tile`.
  const int first_row = PL::rows_of(warp);
  const int table_tile = first_row / kPrefillTile * kPrefillTile, in_table_tile = first_row - table_tile + lane;
  RingCursor<L::kStages> ring;  // the next stage to fill
  const bool tma = maps != nullptr && maps->valid != 0;
  using KV = typename L::KV;
  for (int n = 0;; ++n) {
    const int item = round.next(n, t);
    if (item < 0) {  // the end slot, handed over as an item's
      wait_phase(bar.q_empty(), (n & 1) ^ 1);
      ::cuda::ptx::cp_async_mbarrier_arrive_noinc(bar.q_full());
      if (t == 0) {
        Item end{};
        end.hk = -1;
        item_slots[n & 1] = end;
        (void)::cuda::ptx::mbarrier_arrive(bar.q_full());
        claims.done();
      }
      break;
    }
    const auto w = work.at(item, lane);
    const TileSource& src = w.src;
    const WideSpan span = wide_span<L::kTile>(src.span);
    const PL pl(a.pool, w.hk, warp, lane);
    auto row_id = [&](int j) {  // the lane's row id in tile j
      return j < span.count ? prefill_row_id(a.rows, src.seq, (span.first + j) * L::kTile + table_tile, src.seen,
                                             in_table_tile)
                            : -1;
    };
    int id = row_id(0);
    wait_phase(bar.q_empty(), (n & 1) ^ 1);
    load_queries<D, kPrefillRows, kWarpgroup, typename L::QTile>(a.q, a.heads_q, w.rows, w.hk, base + L::kQ, t);
    ::cuda::ptx::cp_async_mbarrier_arrive_noinc(bar.q_full());
    if (t == 0) {  // the item for the consumers, who then need no global reads to start it
      item_slots[n & 1] = w;
      (void)::cuda::ptx::mbarrier_arrive(bar.q_full());
    }
    for (int j = 0; j < span.count; ++j, ring.next()) {
      const int next = row_id(j + 1);
      const std::uint32_t stage = base + static_cast<std::uint32_t>(ring.stage * L::kStageBytes);
      // The warp's 32 rows by TMA when they are consecutive pool rows, all present and seen.
      const int first_id = __shfl_sync(0xffffffffu, id, 0);
      const bool run = tma && __all_sync(0xffffffffu, id >= 0 && id == first_id + lane);
      const std::uint32_t rows_at = stage + static_cast<std::uint32_t>(first_row * 128);  // the warp's rows, K tile
      auto by_tma = [&](bool v) {
        copy_rows_tma<T, D>(v ? &maps->v : &maps->k, first_id, w.hk, rows_at + (v ? KV::kBytes : 0u),
                            bar.full(v) + ring.stage, lane);
      };
      // One tensor's rows of tile j (by TMA, else gather()), once the consumers are done with that
      // half of the stage; the K warps' lane 0s write the rows' absent bits first.
      auto fill = [&](bool v, auto gather) {
        wait_phase(bar.empty(v) + ring.stage, ring.phase ^ 1u);
        const std::uint32_t missing = __ballot_sync(0xffffffffu, id < 0);
        if (lane == 0 && !v) absent[4 * ring.stage + warp] = missing;
        if (run) by_tma(v);
        else gather();
        ::cuda::ptx::cp_async_mbarrier_arrive_noinc(bar.full(v) + ring.stage);
        if (lane == 0) (void)::cuda::ptx::mbarrier_arrive(bar.full(v) + ring.stage);  // after the absent bits
      };
      if constexpr (PL::kSplitKV) {
        fill(v_warp, [&] { copy_rows<T, D, false>(pl, id, stage, lane); });
      } else {
        fill(false, [&] { copy_rows<T, D, false>(pl, id, stage, lane); });
        fill(true, [&] { copy_rows<T, D, true>(pl, id, stage, lane); });
      }
      id = next;
    }
  }
  cp_async_wait<0>();
}

// Issues S (64 x Tile, this thread's share) = Q K^T, one group: the warpgroup's 64 query rows from
// q_rows (rows of the Q tile, QTile), the K tile at k_tile.
template <class T, int D, int Tile = WgmmaPrefill<D>::kTile>
__device__ __forceinline__ void issue_scores(float (&s)[Tile / 8][4], std::uint32_t q_rows, std::uint32_t k_tile) {
  const std::uint64_t q0 = k_operand<kPrefillRows, D>(q_rows, 0), k0 = k_operand<Tile, D>(k_tile, 0);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, Tile>(s, advance(q0, k_step_bytes<kPrefillRows, D>(kk)), advance(k0, k_step_bytes<Tile, D>(kk)), kk > 0);
  wgmma_commit();
}

// Probabilities (a tile of scores after the softmax) as the A fragments of O += P V.
template <class T, int N>
__device__ __forceinline__ void pack_probabilities(std::uint32_t (&a)[N / 2][4], const float (&p)[N][4]) {
#pragma unroll
  for (int ks = 0; ks < N / 2; ++ks) probability_operands<T>(a[ks], p, ks);
}

// Issues o (64 x D, this thread's share) += P V over the V tile at v_tile, one group; a: P packed.
template <class T, int D, int Tile = WgmmaPrefill<D>::kTile>
__device__ __forceinline__ void issue_values(float (&o)[D / 8][4], const std::uint32_t (&a)[Tile / 16][4],
                                             std::uint32_t v_tile, bool accumulate) {
  const std::uint64_t v0 = v_operand<Tile, D>(v_tile, 0);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Tile / 16; ++ks) wgmma_rs<T, D, true>(o, a[ks], advance(v0, 2048u * ks), accumulate || ks > 0);
  wgmma_commit();
}

// A warp's 16 rows of an item as the consumer's tile loop needs them, computed once per item.
// The lane's two rows r = lane / 4 + 8 h are member[h] (rows [member group, + group) share a token)
// and in_group[h] (the query head within the KV head's group), at query position qpos[h]: one
// division an item instead of one a masked tile and a row written.
template <class QRows>
struct WarpRows {
  QRows rows;
  int first = 0, last = 0;     // lowest and highest query position of the rows
  int last_sees_from = 0;      // visible_begin(window, last): tiles from here to first need no mask
  int member[2], in_group[2], qpos[2];
  __device__ WarpRows(const QRows& mine, int window, int lane)
      : rows(mine), first(mine.first()), last(mine.last()), last_sees_from(visible_begin(window, last)) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (lane >> 2) + 8 * h, at = mine.row0 + r;
      member[h] = at / mine.group;
      in_group[h] = at - member[h] * mine.group;
      qpos[h] = r < mine.rows ? mine.member_qpos(member[h]) : 0;
    }
  }
  // Query position of row r, one of the lane's two (mask_tile's rows).
  __device__ __forceinline__ int qpos_of(int r) const { return r < 8 ? qpos[0] : qpos[1]; }
  // Whether every row sees every position of [key0, key0 + keys).
  __device__ __forceinline__ bool sees_all(int key0, int keys) const {
    return key0 >= last_sees_from && key0 + keys - 1 <= first;
  }
};

// Columns [64 h, 64 h + 64) of a tile's scores (mask_tile takes 64 columns at a time).
template <int N>
__device__ __forceinline__ float (&table_tile_of(float (&s)[N][4], int h))[8][4] {
  return *reinterpret_cast<float(*)[8][4]>(&s[h * 8]);
}

// Raw scores of a warp's rows over the tile (N 8-column blocks) at key0: -inf where a row may not
// see a column's position or the column is absent (absent[h]: columns [64 h, 64 h + 64));
// untouched when every row sees every column.
template <int N, class QRows>
__device__ __forceinline__ void mask_scores(float (&s)[N][4], const WarpRows<QRows>& w, int key0, int window,
                                            const std::uint64_t* absent, int lane) {
  constexpr int kHalves = N / 8;  // 64-column parts
  std::uint64_t any = 0;
#pragma unroll
  for (int h = 0; h < kHalves; ++h) any |= absent[h];
  if (w.rows.rows == 16 && any == 0 && w.sees_all(key0, 8 * N)) return;
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    const int from = key0 + h * kPrefillTile;
    mask_tile<8>(table_tile_of(s, h), w.rows.rows, [&](int r) { return w.qpos_of(r); }, from, window,
                 w.sees_all(from, kPrefillTile), absent[h], [](int, int, int) { return 1.f; }, lane);
  }
}

// Masked raw scores -> probabilities (RowState's online softmax, scale_log2 folded into the
// exponent when positive); corr: the factors o's rows must take. The softmax is lazy (a row's
// exponent base moves only when a tile's maximum passes it by more than kLazyRescaleLog2), so most
// tiles leave o as it is: the consumer warpgroups take turns, and o's rescale sat on the path from
// one warpgroup's MMAs to its next issue (2026-12-07, H100: +1.2% at 8x1k alone, +3-6% with the
// rows' places worked out once an item, WarpRows).
template <int D, int N>
__device__ __forceinline__ void softmax_tile(RowState<D>& st, float (&s)[N][4], float scale_log2, float (&corr)[2]) {
  if (scale_log2 > 0.f) {
    st.template to_probabilities_scaled<true>(s, scale_log2, corr);
    return;
  }
#pragma unroll
  for (int n = 0; n < N; ++n)
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

// Wide tiles [lo, hi) of `span` that rows `rows` see (causal and window by position ranges): the
// consumer's MMAs skip the others. Empty when the rows are none.
struct TileRange {
  int lo = 0, hi = 0;
};
template <int Tile, class QRows>
__device__ inline TileRange tiles_of(const QRows& rows, const WideSpan& span, int window) {
  if (rows.rows <= 0) return {};
  // Clamped to the span: an empty span (a shared split the window hides from every row) has no
  // tile to skip either.
  const int lo = min(span.count, max(0, visible_begin(window, rows.first()) / Tile - span.first));
  const int hi = min(span.count, rows.last() / Tile - span.first + 1);
  return {lo, max(lo, hi)};
}

// A consumer warpgroup (c = 0 or 1): rows [64 c, 64 c + 64) of every item the block takes, the
// item read from the producer's slot. It walks every tile of the item's span with one issue each
// plus one at the end (PingPong), the same walk for both warpgroups whatever their rows see:
// tiles its rows do not see are taken and released at once with no MMA; at the first tile they
// see it issues S; at each further one S of that tile and P V of the one before, running the
// softmax of the new tile while that P V runs (the accumulators of O are rescaled once it is
// done); one issue later the last P V. A K tile is released once its S is complete and masked, a
// V tile once its P V is. Each kind of issue is straight-line code: ptxas serializes wgmmas issued
// under run-time conditions within a loop body (warning C7518).
template <class T, int D, class Rows, class Work, class Item>
__device__ void consume_tiles(const LayerArgs<T, Rows>& a, const Work& work, int c, std::uint32_t base,
                              const std::uint64_t* absent, const Item* item_slots,
                              const PrefillBarriers<WgmmaPrefill<D>::kStages>& bar) {
  using L = WgmmaPrefill<D>;
  using Cursor = RingCursor<L::kStages>;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const PingPong turn{c};
  Cursor next_k, next_v;  // the next K and V tiles to consume
  // A tile taken is known by its stage.
  auto k_tile = [&](int stage) { return base + static_cast<std::uint32_t>(stage * L::kStageBytes); };
  auto v_tile = [&](int stage) { return k_tile(stage) + static_cast<std::uint32_t>(L::KV::kBytes); };
  auto take = [&](Cursor& next, std::uint64_t* full) {  // the next tile of a ring, once the producer filled it
    const int stage = warp_uniform(next.stage);
    wait_phase(full + stage, next.phase);
    next.next();
    return stage;
  };
  // Before wgmmas read tiles just taken: cp.async's writes (generic proxy) to the async proxy.
  auto fence_copies = [] { ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared); };
  auto take_k = [&] { return take(next_k, bar.full(false)); };
  auto take_v = [&] { return take(next_v, bar.full(true)); };
  auto release = [](std::uint64_t* empty, int stage) { (void)::cuda::ptx::mbarrier_arrive(empty + stage); };
  turn.start();
  for (int n = 0;; ++n) {
    wait_phase(bar.q_full(), n & 1);
    const Item w = item_slots[n & 1];
    if (w.hk < 0) break;  // the producer's end slot
    const WideSpan span = wide_span<L::kTile>(w.src.span);
    const auto rows = sub_rows(w.rows, kConsumerRows * c, kConsumerRows);  // the warpgroup's
    const WarpRows mine(rows.for_warp(warp, lane), a.window, lane);
    // The warpgroup's rows of the Q tile: 64 rows down its 64-column blocks (8-row atoms keep their
    // 1024-byte alignment, so the swizzle holds).
    const std::uint32_t q_rows = base + L::kQ + static_cast<std::uint32_t>(kConsumerRows * c * 128);
    // The producer may load the next item's queries once both warpgroups' last S is done.
    auto queries_done = [&] { (void)::cuda::ptx::mbarrier_arrive(bar.q_empty()); };
    const TileRange seen = tiles_of<L::kTile>(rows, span, a.window);
    if (seen.lo == seen.hi) queries_done();
    RowState<D> st{RowState<D>::kUnset};  // o set by the item's first P V, or zeroed below
    float s[L::kN][4] = {};
    float corr[2];
    std::uint32_t p[L::kN / 2][4];
    // Tile j (if j < span.count), which the warpgroup's rows do not see: both halves taken and
    // released at once.
    auto skip = [&](int j) {
      if (j >= span.count) return;
      release(bar.empty(false), take_k());
      release(bar.empty(true), take_v());
    };
    auto idle = [&](int j) {  // issue j with no MMA
      skip(j);
      turn.wait();
      turn.pass();
    };
    // Once S of tile j (K tile in stage k) is complete: masked (the K tile is then released), then
    // probabilities.
    auto softmax_of = [&](int j, int k) {
      fence_accumulators(s);
      if (j + 1 == seen.hi) queries_done();
      mask_scores(s, mine, (span.first + j) * L::kTile, a.window, absent + 2 * k, lane);
      release(bar.empty(false), k);
      softmax_tile(st, s, a.scale_log2, corr);
    };
    for (int j = 0; j < seen.lo; ++j) idle(j);
    if (seen.lo < seen.hi) {
      const int first = take_k();  // the first seen tile: S alone
      fence_copies();
      turn.wait();
      issue_scores<T, D>(s, q_rows, k_tile(first));
      turn.pass();
      wgmma_wait<0>();
      softmax_of(seen.lo, first);
      pack_probabilities<T>(p, s);
      for (int j = seen.lo + 1; j < seen.hi; ++j) {  // S of tile j, P V of tile j - 1
        const int k = take_k(), v = take_v();
        fence_copies();
        turn.wait();
        issue_scores<T, D>(s, q_rows, k_tile(k));
        issue_values<T, D>(st.o, p, v_tile(v), j > seen.lo + 1);  // the first P V sets o
        turn.pass();
        wgmma_wait<1>();  // S of tile j
        softmax_of(j, k);
        wgmma_wait<0>();  // P V of tile j - 1
        fence_accumulators(st.o);
        rescale_rows(st, corr);
        release(bar.empty(true), v);
        pack_probabilities<T>(p, s);
      }
      const int v = take_v();  // issue seen.hi: the last P V, and tile seen.hi (if any) skipped
      skip(seen.hi);
      fence_copies();
      turn.wait();
      issue_values<T, D>(st.o, p, v_tile(v), seen.hi > seen.lo + 1);
      turn.pass();
      wgmma_wait<0>();
      fence_accumulators(st.o);
      release(bar.empty(true), v);
      for (int j = seen.hi + 1; j <= span.count; ++j) idle(j);
    } else {
      st.zero_o();
      for (int j = seen.lo; j <= span.count; ++j) idle(j);
    }
    work.template finish<D>(w, mine, st, lane);
  }
  turn.finish();
}

// The block of the wgmma kernels over the items of `work` (shared memory laid out as
// WgmmaPrefill<D>): barriers set up, then the producer and the two consumer warpgroups. Built
// without sm_90a code it traps: the dispatch never launches it there (sm90a_probe).
template <class T, int D, class Rows, class Work>
__device__ __forceinline__ void wgmma_block(const LayerArgs<T, Rows>& a, const PoolMaps* maps, const Work& work,
                                            ItemClaims claims) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaPrefill<D>;
  extern __shared__ __align__(128) unsigned char smem[];  // aligned to 1024 below
  const std::uint32_t raw = smem_addr(smem), base = (raw + 1023u) & ~1023u;
  unsigned char* aligned = smem + (base - raw);
  auto* absent = reinterpret_cast<std::uint64_t*>(aligned + L::kAbsent);  // [Stages][2]
  auto* barriers = reinterpret_cast<std::uint64_t*>(aligned + L::kBarriers);
  using Item = decltype(work.at(0, 0));
  static_assert(sizeof(Item) <= L::kItemBytes && alignof(Item) <= 16, "an item fits its slot");
  auto* item_slots = reinterpret_cast<Item*>(aligned + L::kItems);  // [2], by item parity
  auto* claimed = reinterpret_cast<int*>(aligned + L::kClaimed);     // [2], by round parity
  const PrefillBarriers<L::kStages> bar{barriers};
  if (threadIdx.x == 0) {
    constexpr int kWarps = ProducerLane<T, D>::kTensorWarps;  // the producer warps of one tensor
    for (int s = 0; s < L::kStages; ++s)
      for (const bool v : {false, true}) {
        ::cuda::ptx::mbarrier_init(bar.full(v) + s, 32 * kWarps + kWarps);  // the copies, each warp's lane 0
        ::cuda::ptx::mbarrier_init(bar.empty(v) + s, 2 * kWarpgroup);
      }
    ::cuda::ptx::mbarrier_init(bar.q_full(), kWarpgroup + 1);
    ::cuda::ptx::mbarrier_init(bar.q_empty(), 2 * kWarpgroup);
    // The initialized barriers made visible to the async proxy: the TMA copies complete on them.
    ::cuda::ptx::fence_proxy_async(::cuda::ptx::space_shared);
  }
  __syncthreads();
  allow_dependent_grids();
  wait_for_prior_grids();
  a.guard.check(a.work);
  if (threadIdx.x < kWarpgroup) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    produce_tiles<T, D>(a, maps, work, claims, base, reinterpret_cast<std::uint32_t*>(absent), item_slots, claimed, bar);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    work.template before_items<D>(static_cast<int>(threadIdx.x) - kWarpgroup);
    consume_tiles<T, D>(a, work, warp_uniform(static_cast<int>(threadIdx.x) / kWarpgroup - 1), base, absent, item_slots,
                        bar);
    work.template after_items<D>(static_cast<int>(threadIdx.x) - kWarpgroup);
  }
#else
  (void)a, (void)maps, (void)work, (void)claims;
  __trap();
#endif
}

// T: bf16 or fp16 pool and queries; dynamic smem WgmmaPrefill<D>::kAllocation; kWgmmaPrefillThreads.
// maps: the TMA descriptors of a.pool (pool_maps; valid 0: every row gathered). claims: the
// counters the blocks take their items from (item_claims.cuh; words null: dealt in rounds).
template <class T, int D, class Rows>
__global__ void __launch_bounds__(kWgmmaPrefillThreads, 1)
    prefill_wgmma(PrefillArgs<T, Rows> a, const __grid_constant__ PoolMaps maps, ItemClaims claims) {
  wgmma_block<T, D>(a, &maps, PrefillItems<T, Rows>{a}, claims);
}

}  // namespace cellkv::gpu::kernels
