// cellkv/gpu/kernels/decode_attention.cuh - decode attention read through the position tables.
//
// Work: the decode segments of one window buffer (attention_plan.hpp). A pair is (decode segment,
// KV head): its <= kDecodeRows query rows (token x GQA head of the group, packed as MMA rows) see
// the positions [visible_begin(W, first token), last token] of their sequence, which are
// tiles(seg) KV tiles of kPositions positions. Each KV head's tiles, in (segment, tile) order, are
// cut into equal chunks, one per worker (a warp) of the head's share (even_split_part,
// attention_plan.hpp: the same cut for every head, so the heads read the same cells at once): every
// worker streams the same number of tiles whatever the lengths and wherever the cells are. Steps
// of no more pairs than workers run as teams instead where that costs no more (decode_assignment):
// the warps of a block share out its pairs, a pair's tiles split among its team, whose parts merge
// in shared memory after one block barrier (a team of one: the pair whole, no merge).
//
// A warp streams its chunk through its own ring of `Stages` shared-memory stages (16-byte cp.async
// copies of the rows the table names, gathered row by row; a hole's row is zero-filled and its
// column masked) with no block-wide barrier; the table
// is read ahead (the page of the tile two ahead, the row ids of the tile one ahead), and a pair's
// queries go straight to registers. Throughput comes from many independent warps per SM (small
// tiles), not from one warp's depth. Before the kernel's wait for the kernels before it (a
// dependent launch) a warp already copies its first tiles, and brings the next into L2, where their
// rows are settled (settled_end, attention_plan.hpp: rows the step's write_kv does not write), so
// the start of its stream runs under the end of the kernels before. At the end of a pair's part
// the warp writes the output, or, for a pair cut by a chunk boundary, a partial (o, lse) that the
// last part to finish merges: groups of kMergeFanIn parts merge into their first part's slot, level
// by level, and the last level writes the output. A chunk's last pair looks at its group's count
// first: when every other part of a pair merged in one level is in, the warp merges their partials
// into its registers and writes the output, without storing its own partial (merge_in_registers).
// Counters return to zero, so the next launch (and a graph replay) starts clean. Rows of the
// padding tokens [tokens, width) are written as zeros.
//
// Block: Warps x 32 threads, one worker per warp; grid: any fixed size of at least H_kv warps
// (decode_min_blocks: every KV head needs a worker), persistent; dynamic smem:
// decode_smem_bytes<D, Stages, Warps>().
#pragma once

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/kernels/attention_tiles.cuh"
#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/kernels/fp8_columns.cuh"
#include "cellkv/gpu/kernels/fp8_tiles.cuh"
#include "cellkv/gpu/kernels/layer_args.cuh"
#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/pool_view.hpp"
#include "cellkv/position_table_view.hpp"
#include "cellkv/step_plan.hpp"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

inline constexpr int kMergeFanIn = kDecodeMergeFanIn;  // parts one merge combines (attention_plan.hpp)
inline constexpr int kMergeLevels = 4;  // up to 8^4 parts per pair

// fp8: the fp16 tiles a warp converts codes into for head dim D (DecodeTile::kDirectK, kDirectV): K and
// V for D = 256, V for D = 64, none for D = 128.
constexpr int fp8_converted_tiles(int head_dim) { return head_dim == 128 ? 0 : head_dim < 128 ? 1 : 2; }

// Geometry of a decode tile for head dim D and stored elements of Bytes bytes (2: bf16 / fp16; 1:
// fp8 codes): decode_tile_positions(D, Bytes) positions of K and of V.
template <int D, int Bytes = 2>
struct DecodeTile {
  static constexpr bool kFp8 = Bytes == 1;
  static constexpr int kPositions = decode_tile_positions(D, Bytes);
  static constexpr int kChunks = D * Bytes / 16;                   // 16-byte chunks per stored row-head
  static constexpr int kIds = (kPositions + 31) / 32;              // row ids each lane holds
  static constexpr int kLoads = kPositions * kChunks / 32;         // copies per lane per tensor
  static constexpr int kRowStep = 32 / kChunks;                    // rows between a lane's copies
  static constexpr std::uint32_t kBytes = kPositions * D * Bytes;  // one tensor's staged tile
  static constexpr std::uint32_t kScaleBytes = kFp8 ? kPositions * 4 : 0;  // one tensor's scales
  static constexpr std::uint32_t kStageBytes = 2 * (kBytes + kScaleBytes);
  // fp8, D <= 128: the score MMA reads its K operands straight from the staged codes (permuted head
  // dimension, kernels/fp8_tiles.cuh qk_codes); D = 128: the value MMA its V operands too
  // (pv_codes). What is not read in place is converted to fp16 tiles first.
  static constexpr bool kDirectK = kFp8 && D <= 128;
  static constexpr bool kDirectV = kFp8 && D == 128;
  static constexpr std::uint32_t kComputeBytes = kFp8 ? fp8_converted_tiles(D) * kPositions * D * 2 : 0;  // fp16 tiles
  static constexpr int kNT = kPositions / 8;                       // MMA n-tiles of the scores
  static_assert(kPagePositions % kPositions == 0 && kPositions % 16 == 0 && kLoads * 32 == kPositions * kChunks);
};

#ifndef CELLKV_DECODE_L2_AHEAD
#define CELLKV_DECODE_L2_AHEAD 2
#endif
// Tiles a warp brings into L2 before its wait, after the first Stages - 1 it copies there (when all
// of those and these are settled): CELLKV_DECODE_L2_AHEAD (0 to 2), fewer where RowFetch::start
// does not know that many tiles (it knows three).
template <int Stages>
inline constexpr int kL2Ahead = CELLKV_DECODE_L2_AHEAD < 4 - Stages ? CELLKV_DECODE_L2_AHEAD : 4 - Stages;
static_assert(CELLKV_DECODE_L2_AHEAD >= 0 && CELLKV_DECODE_L2_AHEAD <= 2, "the row ids of two tiles are read ahead");

// Whether a pair's query fragments live in registers (D <= 128) or in a shared tile (D = 256).
template <int D>
inline constexpr bool kQueryInRegisters = D <= 128;

// Per warp: `stages` x (K tile, V tile; fp8: then the K scales and V scales), for fp8 the fp16 tiles
// the codes are converted into (fp8_converted_tiles), and for D = 256 the query tile; 128-byte
// aligned.
constexpr int decode_warp_smem_bytes(int head_dim, int stages, int element_bytes = 2) {
  const int positions = decode_tile_positions(head_dim, element_bytes);
  const bool fp8 = element_bytes == 1;
  const int stage = 2 * (positions * head_dim * element_bytes + (fp8 ? positions * 4 : 0));
  const int compute = fp8 ? fp8_converted_tiles(head_dim) * positions * head_dim * 2 : 0;
  const int query = head_dim <= 128 ? 0 : kDecodeRows * head_dim * 2;
  return (stages * stage + compute + query + 127) / 128 * 128;
}
template <int D, int Stages, int Warps, int Bytes = 2>
constexpr int decode_smem_bytes() {
  return Warps * decode_warp_smem_bytes(D, Stages, Bytes);
}

template <class T, class Rows, class S = T>
struct DecodeArgs : LayerArgs<T, Rows, S> {
  const std::int32_t* tokens = nullptr;  // T on the device
  std::int32_t width = 0;
  float* partial_o = nullptr;            // [slots][kDecodeRows][D]
  float* partial_lse = nullptr;          // [slots][kDecodeRows]
  std::int32_t* merge_counts = nullptr;  // [kMergeLevels][slots], zero between launches
  std::int32_t slots = 0;                // 2 x workers
};

// Where a worker is in the flat tiles (attention_plan.hpp: tile x of head h at h * stride + x).
struct PairCursor {
  std::int64_t g = 0;      // flat tile index
  std::int64_t begin = 0;  // flat index of the pair's first tile
  std::int32_t d = 0, h = 0, t = 0;  // decode segment, KV head, tile of the pair
  std::int32_t tiles = 0;  // tiles of the pair
  std::int32_t tile0 = 0;  // first KV tile (positions tile0 * kPositions ...)
  std::int32_t own_begin = 0;  // positions below are read by shared items (prefix_sharing.hpp)
  Segment seg;

  template <class A>
  __device__ void load_segment(const A& a, int positions) {
    const int index = a.work.decode_seg[d];
    seg = a.segments[index];
    own_begin = a.shared.own_begin_of(index);
    const TileSpan span = tiles_seen(a.window, seg.pos0, seg.pos0 + seg.len - 1, positions, own_begin);
    tile0 = span.first;
    tiles = span.count;
  }
  // Positions the pair's rows read, as a whole: own_positions(W, first, last, own_begin).
  __device__ PositionRange seen(int window) const {
    return own_positions(window, seg.pos0, seg.pos0 + seg.len - 1, own_begin);
  }
  // Positions the cursor at flat tile `flat` (heads `stride` flat tiles apart) of decode segment
  // `seg` (-1: found by a 32-way search by the whole warp, a few dependent reads, not
  // log2(segments)).
  template <class A>
  __device__ void seek(const A& a, std::int64_t flat, std::int64_t stride, int seg, int positions, int lane) {
    h = static_cast<int>(flat / stride);
    const auto x = static_cast<std::int32_t>(flat - h * stride);  // the head's tile
    // The last segment whose first tile is <= x.
    int lo = seg < 0 ? 0 : seg, hi = seg < 0 ? a.work.decode_count() - 1 : seg;
    while (lo < hi) {
      const int step = (hi - lo + 32) / 32;
      const int at = lo + lane * step;
      const bool before = at <= hi && a.work.decode_prefix[at] <= x;
      const int last = 31 - __clz(__ballot_sync(0xffffffffu, before));  // lane 0 (at = lo) always qualifies
      lo += last * step;
      hi = min(hi, lo + step - 1);
    }
    d = lo;
    load_segment(a, positions);
    t = x - a.work.decode_prefix[d];
    g = flat;
    begin = flat - t;
  }
  // Next tile; precondition: g + 1 is a tile of the same head (a worker's tiles are).
  template <class A>
  __device__ void next(const A& a, int positions) {
    ++g;
    if (++t < tiles) return;
    t = 0;
    begin = g;
    ++d;
    load_segment(a, positions);
  }
};

// The rows of a pair: row r is token tok0 + r / group, query head h * group + r % group.
struct PairRows {
  Segment seg;
  int group, h, rows;
  __device__ int token(int r) const { return seg.tok0 + r / group; }
  __device__ int head(int r) const { return h * group + r % group; }
  __device__ int qpos(int r) const { return seg.pos0 + r / group; }
};

// The flat tiles [g0, g1) warp `warp` of block `block` computes (decode_assignment,
// attention_plan.hpp; g0 >= g1: nothing): its chunk of the even split, or its share of its team's
// pair. `mode` says which, in the one value the decode loop keeps (every register counts there):
// > 0 the even split's chunk (this warp part g0 / mode of it); 0 a team of one (the pair whole);
// < 0 a team of -mode warps (warp w member w % -mode). stride: flat tiles between heads; seg: the
// team's decode segment (-1: not known, the even split).
struct WorkerTiles {
  std::int64_t g0 = 0, g1 = 0, mode = 1, stride = 1;
  int seg = -1;
};

// head_tiles: the work's decode_head_tiles().
__device__ inline WorkerTiles worker_tiles(const WindowWork& work, int n, int heads_kv, int longest, int head_tiles,
                                           int block, int warp, int blocks, int warps) {
  const std::int64_t pairs = static_cast<std::int64_t>(n) * heads_kv;
  const std::int64_t workers = static_cast<std::int64_t>(blocks) * warps;
  const DecodeAssignment as = decode_assignment(pairs, blocks, warps, longest, head_tiles, heads_kv);
  WorkerTiles w;
  w.stride = head_tiles > 0 ? head_tiles : 1;
  if (as.even) {
    const std::int64_t worker = static_cast<std::int64_t>(block) * warps + warp;
    const EvenPart part = even_split_part(worker, workers, heads_kv, head_tiles);
    return {part.begin, part.end, part.chunk, part.stride, -1};
  }
  w.mode = as.team == 1 ? 0 : -as.team;
  const int slot = warp / as.team, member = warp % as.team;
  const std::int64_t pair = static_cast<std::int64_t>(block) * as.per_block + slot;
  if (slot >= as.per_block || pair >= pairs) return w;
  const int d = static_cast<int>(pair / heads_kv), h = static_cast<int>(pair % heads_kv);
  const std::int32_t first = work.decode_prefix[d], tiles = work.decode_prefix[d + 1] - first;
  const std::int32_t share = team_share(tiles, as.team);
  const std::int64_t base = static_cast<std::int64_t>(h) * head_tiles + first;
  w.g0 = base + min(tiles, member * share);
  w.g1 = base + min(tiles, (member + 1) * share);
  w.seg = d;
  return w;
}

// A tile to fetch: KV head h, positions [key0, key0 + kPositions) of seq, of which key0 + [lo, hi]
// are read (lo > hi: none), unless it lies past the worker's chunk (not valid). Packed into one
// word, h << 17 | valid << 16 | hi << 8 | lo, so the read-ahead of three tiles takes few registers.
struct TileRef {
  int seq = 0, key0 = 0;
  std::uint32_t bits = 1;  // not valid, reads nothing
  __device__ __forceinline__ int h() const { return static_cast<int>(bits >> 17); }
  __device__ __forceinline__ bool valid() const { return (bits >> 16) & 1u; }
  __device__ __forceinline__ int lo() const { return static_cast<int>(bits & 0xffu); }
  __device__ __forceinline__ int hi() const { return static_cast<int>((bits >> 8) & 0xffu); }
};

// The row ids of the tiles a warp issues, read ahead in two steps so neither read stalls the warp:
// the page (a directory read) of the tile two ahead, then the row ids (page entries) of the tile
// one ahead; `ids[0]` belongs to `next[0]`, the tile to issue now. Register arrays only, indexed
// by constants (the pipeline shifts by copies).
template <int D, class Rows, int Bytes>
struct RowFetch {
  using G = DecodeTile<D, Bytes>;
  static_assert(G::kPositions <= 255, "tile offsets fit a TileRef's bytes");
  TileRef next[3];
  int ids[2][G::kIds];
  typename Rows::Tile page2;  // page of next[2]
  PairCursor at;              // cursor of next[2]

  template <class A>
  __device__ __forceinline__ void fill_ref(const A& a, std::int64_t g1, TileRef& ref) const {
    const int key0 = (at.tile0 + at.t) * G::kPositions;
    const PositionRange seen = at.seen(a.window);
    const int lo = max(seen.begin - key0, 0), hi = min(seen.end - key0, G::kPositions - 1);
    const bool valid = at.g < g1;
    const std::uint32_t range = valid && lo <= hi ? static_cast<std::uint32_t>(hi << 8 | lo) : 1u;
    ref.seq = at.seg.seq;
    ref.key0 = key0;
    ref.bits = static_cast<std::uint32_t>(at.h) << 17 | (valid ? 1u << 16 : 0u) | range;
  }
  __device__ __forceinline__ void load_ids(const Rows& rows, const TileRef& ref, const typename Rows::Tile& page,
                                           int lane, int (&out)[G::kIds]) const {
    const int lo = ref.lo(), hi = ref.hi();
#pragma unroll
    for (int j = 0; j < G::kIds; ++j) {
      const int i = lane + 32 * j;
      out[j] = -1;  // a predicated read: nothing waits for it until the issue
      if (i >= lo && i <= hi) out[j] = rows.row(page, i);
    }
  }
  // Moves `at` one tile on (or past the chunk's end).
  template <class A>
  __device__ __forceinline__ void step_cursor(const A& a, std::int64_t g1) {
    if (at.g + 1 < g1) at.next(a, G::kPositions);
    else at.g = g1;
  }
  template <class A>
  __device__ __forceinline__ typename Rows::Tile page_of(const A& a, const TileRef& ref) const {
    return ref.valid() ? a.rows.tile(ref.seq, ref.key0) : typename Rows::Tile{};
  }
  // Whether tile `ref` of the cursor's pair reads only rows written before the step (settled_end),
  // or nothing.
  __device__ __forceinline__ bool settled(const TileRef& ref) const {
    return !ref.valid() || ref.lo() > ref.hi() || ref.key0 + ref.hi() < settled_end(at.seg);
  }
  // Starts at cursor c (the worker's first tile): pages of three tiles, ids of two, in parallel.
  // Returns how many of the first Early tiles (next[0], next[1], ...) read only settled rows, in a
  // run from the first: the kernel may issue those before it waits for the kernels before it.
  template <int Early, class A>
  __device__ int start(const A& a, const PairCursor& c, std::int64_t g1, int lane) {
    static_assert(Early <= 3, "three tiles are known at the start");
    at = c;
    typename Rows::Tile pages[2];
    int leading = 0;
    auto count = [&](int k) {  // after fill_ref(next[k]), while `at` is its tile's cursor
      if (k < Early && leading == k && settled(next[k])) ++leading;
    };
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      fill_ref(a, g1, next[k]);
      count(k);
      pages[k] = page_of(a, next[k]);
      step_cursor(a, g1);
    }
    fill_ref(a, g1, next[2]);
    count(2);
    page2 = page_of(a, next[2]);
    load_ids(a.rows, next[0], pages[0], lane, ids[0]);
    load_ids(a.rows, next[1], pages[1], lane, ids[1]);
    return leading;
  }
  // After issuing next[0]: everything moves up one tile.
  template <class A>
  __device__ __forceinline__ void advance(const A& a, std::int64_t g1, int lane) {
    next[0] = next[1];
#pragma unroll
    for (int j = 0; j < G::kIds; ++j) ids[0][j] = ids[1][j];
    next[1] = next[2];
    load_ids(a.rows, next[1], page2, lane, ids[1]);
    step_cursor(a, g1);
    fill_ref(a, g1, next[2]);
    page2 = page_of(a, next[2]);
  }
};

// One warp's ring of KV stages in shared memory, filled by 16-byte cp.async copies gathered
// through the tile's row ids (-1: a row nobody sees, zero-filled); one commit group per ring slot,
// in ring order. bf16 / fp16: swizzled tiles the MMA reads. fp8: rows of codes (D bytes each) and
// each row's K and V scale; for D <= 128 the score MMA reads the K codes where they landed (16-byte
// chunks swizzled by CodeTile, so its 4-byte reads are free of bank conflicts), for D = 128 the value
// MMA the V codes (ValueCodeTile); convert_codes turns the others into fp16 tiles after the stages.
template <int D, int Stages, int Bytes = 2, bool Columns = false>
struct StageRing {
  using G = DecodeTile<D, Bytes>;
  std::uint32_t base;  // shared address of stage 0's K tile

  __device__ std::uint32_t k(int s) const { return base + static_cast<std::uint32_t>(s) * G::kStageBytes; }
  __device__ std::uint32_t v(int s) const { return k(s) + G::kBytes; }
  __device__ std::uint32_t k_scales(int s) const { return k(s) + 2 * G::kBytes; }  // fp8: [kPositions] fp32
  __device__ std::uint32_t v_scales(int s) const { return k_scales(s) + G::kScaleBytes; }
  // fp8: the fp16 tiles a stage's codes are converted into, after the stages (V only with kDirectK,
  // none with kDirectV).
  __device__ std::uint32_t k_half() const { return base + Stages * G::kStageBytes; }
  __device__ std::uint32_t v_half() const { return k_half() + (G::kDirectK ? 0 : G::kComputeBytes / 2); }
  // The query tile (D = 256), after everything else.
  __device__ std::uint32_t query() const { return base + Stages * G::kStageBytes + G::kComputeBytes; }

  template <class Pool>
  __device__ __forceinline__ void issue(int s, const Pool& pool, int hk, const int (&ids)[G::kIds], int lane) const {
    const std::uint64_t policy = evict_first_policy();  // K/V is read once per step
    if constexpr (Columns) issue_column_rows(s, pool, hk, ids[0], lane, policy);
    else issue_rows(s, pool, hk, ids, lane, policy);
    if constexpr (G::kFp8) {
#pragma unroll
      for (int j = 0; j < G::kIds; ++j) {
        const int r = lane + 32 * j, id = ids[j];
        if (r >= G::kPositions) break;
        const std::int64_t off = id >= 0 ? pool.scale_offset(id, hk) : 0;
        const std::uint32_t slot = 4 * static_cast<std::uint32_t>(Columns ? column_scale_slot(r) : r);
        cp_async_4(k_scales(s) + slot, pool.k_scale + off, id >= 0);
        cp_async_4(v_scales(s) + slot, pool.v_scale + off, id >= 0);
      }
    }
    cp_async_commit();
  }
  // The rows of a tile: lane l copies chunk l % kChunks of rows l / kChunks + i kRowStep, K and V.
  // A copy's source: this lane's head and chunk of the tile (once per tile), plus row id x row
  // bytes (one 32 x 32 -> 64-bit multiply-add a copy: row ids and a row's bytes fit 32 bits).
  template <class Pool>
  __device__ __forceinline__ void issue_rows(int s, const Pool& pool, int hk, const int (&ids)[G::kIds], int lane,
                                             std::uint64_t policy) const {
    const int chunk = lane % G::kChunks;
    const auto row_bytes = static_cast<std::uint32_t>(pool.row_elems() * Bytes);
    const std::uint64_t lane_off = static_cast<std::uint64_t>(hk) * (D * Bytes) + static_cast<std::uint32_t>(chunk * 16);
    const char* k_base = reinterpret_cast<const char*>(pool.k) + lane_off;
    const char* v_base = reinterpret_cast<const char*>(pool.v) + lane_off;
#pragma unroll
    for (int i = 0; i < G::kLoads; ++i) {
      const int r = lane / G::kChunks + i * G::kRowStep;
      const int id = __shfl_sync(0xffffffffu, ids[i / G::kChunks], r % 32);
      const std::uint64_t off = static_cast<std::uint64_t>(static_cast<std::uint32_t>(max(id, 0))) * row_bytes;
      const std::uint32_t dst = G::kFp8 ? static_cast<std::uint32_t>(r * D + chunk * 16) : SwizzledTile<D>::offset(r, chunk);
      std::uint32_t k_dst = dst, v_dst = dst;
      if constexpr (G::kDirectK) k_dst = CodeTile<D>::offset(r, chunk);
      if constexpr (G::kDirectV) v_dst = ValueCodeTile<D>::offset(r, chunk);
      cp_async_16_row(k(s) + k_dst, k_base + off, id, policy);
      cp_async_16_row(v(s) + v_dst, v_base + off, id, policy);
    }
  }
  // Columns (fp8 codes, D = 128, 32 rows a tile; `id`: lane l's is row l's): lane l copies chunk
  // l % 8 of rows l / 8 + 4 i (i < 8), K and V. Row l / 8 + 4 i lands 512 bytes past row
  // l / 8 + 4 (i - 1) in both tiles, with the K swizzle of row l / 8 and the V swizzle of row l / 8
  // (even i) or l / 8 + 4 (odd i): a copy's destination is a lane constant plus an immediate.
  template <class Pool>
  __device__ __forceinline__ void issue_column_rows(int s, const Pool& pool, int hk, int id, int lane,
                                                    std::uint64_t policy) const {
    static_assert(G::kChunks == 8 && G::kPositions == 32 && G::kIds == 1, "a K row of 128 codes, 32 rows a tile");
    const int chunk = lane % 8, row = lane / 8;
    const auto row_bytes = static_cast<std::uint32_t>(pool.row_elems());  // one byte an element
    const std::uint64_t lane_off = static_cast<std::uint64_t>(hk) * D + static_cast<std::uint32_t>(chunk * 16);
    const std::uint64_t k_lane = reinterpret_cast<std::uint64_t>(pool.k) + lane_off;
    const std::uint64_t v_lane = reinterpret_cast<std::uint64_t>(pool.v) + lane_off;
    const std::uint32_t k_dst = k(s) + KeyColumnTile::offset(row, chunk);
    const std::uint32_t v_dst[2] = {v(s) + ValueCodeTile<D>::offset(row, chunk),
                                    v(s) + ValueCodeTile<D>::offset(row + 4, chunk) - 512u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int from = __shfl_sync(0xffffffffu, id, row + 4 * i);
      const auto at = static_cast<std::uint32_t>(max(from, 0));
      cp_async_16_row(k_dst + 512u * i, row_address(k_lane, at, row_bytes), from, policy);
      cp_async_16_row(v_dst[i & 1] + 512u * i, row_address(v_lane, at, row_bytes), from, policy);
    }
  }
  // The K and V rows of a tile (ids as issue's) brought into L2, nothing staged.
  template <class Pool>
  __device__ __forceinline__ void prefetch_rows(const Pool& pool, int hk, const int (&ids)[G::kIds], int lane) const {
    constexpr int kLines = (D * Bytes + 127) / 128;  // 128-byte lines of a row-head
    const auto row_bytes = static_cast<std::uint32_t>(pool.row_elems() * Bytes);
    const std::uint64_t head = static_cast<std::uint64_t>(hk) * (D * Bytes);
#pragma unroll
    for (int j = 0; j < G::kIds; ++j) {
      if (lane + 32 * j >= G::kPositions || ids[j] < 0) continue;
      const auto at = static_cast<std::uint32_t>(ids[j]);
#pragma unroll
      for (int l = 0; l < kLines; ++l) {
        prefetch_l2(row_address(reinterpret_cast<std::uint64_t>(pool.k) + head + 128u * l, at, row_bytes));
        prefetch_l2(row_address(reinterpret_cast<std::uint64_t>(pool.v) + head + 128u * l, at, row_bytes));
      }
    }
  }
  // Nothing to issue for this slot of the ring (keeps the group count in step).
  __device__ __forceinline__ void skip() const { cp_async_commit(); }
  // Blocks until the oldest issued stage has landed, and every lane sees it.
  __device__ __forceinline__ void wait() const {
    cp_async_wait<Stages - 2>();
    __syncwarp();
  }
};

// A pair's query rows [0, kDecodeRows) (zeros past rows), as the A operands of the score MMA.
// D <= 128: straight from global memory into the fragments' registers (call before the wait for
// the tile, so the latency overlaps it). D = 256: through a swizzled shared tile the fragments
// read at each use (register budget), half the rows at a time, after the wait.
// Permuted (fp8 with kDirectK): the head dimension in qk_codes' order, a0 (g, 2c..2c+1), a2
// (g, 2c+2..2c+3) of each 16-column block (fp8_tiles.cuh), so K's operands are 4 consecutive codes.
template <int D, bool Permuted = false, class T>
__device__ __forceinline__ void load_query_registers(QFragments<D>& q, const T* src, int heads_q, const PairRows& p,
                                                     int lane) {
  const int g = lane >> 2, c = (lane & 3) * 2;
  const T* rows[2];
  bool valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    valid[h] = r < p.rows;
    rows[h] = src + (valid[h] ? (static_cast<std::int64_t>(p.token(r)) * heads_q + p.head(r)) * D : 0);
  }
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a0 (g, c), a1 (g + 8, c), a2 (g, c + 8), a3 (g + 8, c + 8)
      const int h = i & 1, col = 16 * kk + (Permuted ? 2 * c + (i >> 1) * 2 : c + (i >> 1) * 8);
      q.regs[kk][i] = valid[h] ? *reinterpret_cast<const std::uint32_t*>(rows[h] + col) : 0u;
    }
}

template <int D, class T>
__device__ void load_query_shared(std::uint32_t tile, const T* src, int heads_q, const PairRows& p, int lane) {
  constexpr int kPerLane = kDecodeRows * (D / 8) / 32, kHalf = kPerLane / 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint4 v[kHalf];
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int idx = lane + 32 * (half * kHalf + i), r = idx / (D / 8), chunk = idx % (D / 8);
      v[i] = r < p.rows ? *reinterpret_cast<const uint4*>(
                              src + (static_cast<std::int64_t>(p.token(r)) * heads_q + p.head(r)) * D + chunk * 8)
                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const int idx = lane + 32 * (half * kHalf + i);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       tile + SwizzledTile<D>::offset(idx / (D / 8), idx % (D / 8))),
                   "r"(v[i].x), "r"(v[i].y), "r"(v[i].z), "r"(v[i].w));
    }
  }
  __syncwarp();
}

// fp8 pools, D <= 128: the pair's query rows as fp16 fragments of q x 2^shift(row) (fp8_tiles.cuh).
// unshift[h] = 2^-shift of this lane's row lane / 4 + 8 h.
template <int D, bool Permuted, class T>
__device__ __forceinline__ void load_query_fp16_registers(QFragments<D>& q, const T* src, int heads_q, const PairRows& p,
                                                          int lane, float (&unshift)[2]) {
  load_query_registers<D, Permuted>(q, src, heads_q, p, lane);
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a0, a2: row g; a1, a3: row g + 8
      const float2 f = unpack2<T>(q.regs[kk][i]);
      amax[i & 1] = fmaxf(amax[i & 1], finite_amax2(f.x, f.y));
    }
  float mul[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int shift = query_shift(quad_max(amax[h]));
    mul[h] = exp2_int(shift);
    unshift[h] = exp2_int(-shift);
  }
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = unpack2<T>(q.regs[kk][i]);
      q.regs[kk][i] = pack2<__half>(f.x * mul[i & 1], f.y * mul[i & 1]);
    }
}

// fp8 pools, D = 256: the pair's query rows as a swizzled fp16 tile of q x 2^shift(row); each lane
// holds chunk `lane` (8 elements) of every row. unshift as above.
template <int D, class T>
__device__ void load_query_fp16_shared(std::uint32_t tile, const T* src, int heads_q, const PairRows& p, int lane,
                                       float (&unshift)[2]) {
  static_assert(D / 8 == 32, "one 8-element chunk of each row per lane");
  const int g = lane >> 2;
#pragma unroll
  for (int r = 0; r < kDecodeRows; ++r) {
    const uint4 raw = r < p.rows ? *reinterpret_cast<const uint4*>(
                                       src + (static_cast<std::int64_t>(p.token(r)) * heads_q + p.head(r)) * D + lane * 8)
                                 : make_uint4(0, 0, 0, 0);
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    float2 f[4];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[j] = unpack2<T>(w[j]);
      amax = fmaxf(amax, finite_amax2(f[j].x, f[j].y));
    }
    const int shift = query_shift(warp_max(amax));
    const float mul = exp2_int(shift);
    if (r == g) unshift[0] = exp2_int(-shift);
    if (r == g + 8) unshift[1] = exp2_int(-shift);
    std::uint32_t h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = pack2<__half>(f[j].x * mul, f[j].y * mul);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(tile + SwizzledTile<D>::offset(r, lane)), "r"(h[0]),
                 "r"(h[1]), "r"(h[2]), "r"(h[3]));
  }
  __syncwarp();
}

// Row r of a pair's output: [D] elements of the layer output [width, H_q, D].
template <int D, class T, class Rows, class S>
__device__ __forceinline__ T* output_row(const DecodeArgs<T, Rows, S>& a, const PairRows& p, int r) {
  return a.out + (static_cast<std::int64_t>(p.token(r)) * a.heads_q + p.head(r)) * D;
}

// Four outputs at dst (8-byte aligned: a quad of columns) as one 8-byte store.
template <class T>
__device__ __forceinline__ void store_quad(T* dst, float x, float y, float z, float w) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(x, y), pack2<T>(z, w));
}

// Columns [4 c, 4 c + 4) of row r of a pair's output from its merged values v (normalized) and
// log2-sum-exp lse: folded with the token's shared-prefix partials, then stored.
template <class T, int D, class Rows, class S>
__device__ __forceinline__ void write_output_quad(const DecodeArgs<T, Rows, S>& a, const PairRows& p, int r, int c,
                                                  float4 v, float lse) {
  a.shared.template fold<D, 4, 8, 4>(p.token(r), p.head(r), a.heads_q, lse, [&](int e) { return 4 * c + e; },
                                     [&](int e) -> float& { return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w; });
  store_quad<T>(output_row<D>(a, p, r) + 4 * c, v.x, v.y, v.z, v.w);
}

// Rows [0, rows) of partial slot `slot`, read for the last time by every lane of the warp (each
// lane's loads consumed, then a warp barrier): dropped from L2 unwritten (discard_l2), so they
// cost no DRAM write. Used where a chunk's last pair merges the other parts in its registers (the
// even split of many short pairs, where most pairs are cut once); in the tree merges (few long
// pairs) the discards measured slower (2026-12-05, H100: 4x4k -4%).
template <int D>
__device__ __forceinline__ void discard_partial(float* partial_o, int slot, int rows, int lane) {
  static_assert(D * 4 % 128 == 0, "a row is whole lines");
  const float* first = partial_o + static_cast<std::int64_t>(slot) * kDecodeRows * D;
  for (int i = lane; i < rows * D * 4 / 128; i += 32) discard_l2(first + 32 * i);
}

// The output of a pair whose parts were merged into partial slot `slot`. A loop of its own (not
// inside the merge's unrolled rounds), so the decode loop keeps its registers.
template <class T, int D, class Rows, class S>
__device__ void write_merged(const DecodeArgs<T, Rows, S>& a, const PairRows& p, int slot, int lane) {
  constexpr int kPerRow = D / 4;  // float4 per row
  for (int idx = lane; idx < p.rows * kPerRow; idx += 32) {
    const int r = idx / kPerRow, c = idx % kPerRow;
    const std::int64_t row = static_cast<std::int64_t>(slot) * kDecodeRows + r;
    write_output_quad<T, D>(a, p, r, c, __ldcg(reinterpret_cast<const float4*>(a.partial_o + row * D) + c),
                            __ldcg(a.partial_lse + row));
  }
}

// A team's part of a pair in shared memory (the warp's own region of the block's dynamic shared
// memory, once its stages are drained): o [kDecodeRows][D] fp32, normalized, then lse
// [kDecodeRows], then (member 0 of the team) which pair the team computed.
struct TeamPair {
  Segment seg;
  int h = 0;
  int members = 0;  // parts to merge (team_members); 0: the team has no pair
  __device__ int rows(int group) const { return members > 0 ? seg.len * group : 0; }
};
template <int D>
struct TeamPart {
  static constexpr int kBytes = kDecodeRows * (D + 1) * 4 + static_cast<int>(sizeof(TeamPair));
  float* o;
  __device__ float* lse() const { return o + kDecodeRows * D; }
  __device__ TeamPair& pair() const { return *reinterpret_cast<TeamPair*>(lse() + kDecodeRows); }
};

// A finished state's lane shares: RowHalf of a RowState, ColumnHalf of a ColumnState.
template <class State>
struct HalfOf;
template <int D>
struct HalfOf<RowState<D>> {
  using type = RowHalf<D>;
};
template <int D>
struct HalfOf<ColumnState<D>> {
  using type = ColumnHalf<D>;
};

// Stores this warp's part (rows < rows) into its TeamPart.
template <int D, class State>
__device__ void store_team_part(const TeamPart<D>& part, State& st, int rows, int lane) {
  using R = typename HalfOf<State>::type;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = R::row(h, lane);
    const R res(st, h);  // every lane: the sums over the lanes of its row
    if (r < rows) res.store_partial(part.o + r * D, part.lse() + r, lane);
  }
}

// Outputs [4 c0, 4 c0 + 4 Per) of row r of a team's pair (its parts in the TeamParts `stride` floats
// apart from `first`): the parts merged by log-sum-exp, folded with the token's shared-prefix
// partials (64 / N slots' log2-sum-exps and partials a round trip: this runs after the decode
// loop, whose registers are free), stored.
template <class T, int D, int Per, class Rows, class S>
__device__ void write_team_columns(const DecodeArgs<T, Rows, S>& a, const TeamPart<D>& first, int stride, int group,
                                   int r, int c0) {
  constexpr int N = 4 * Per;
  const TeamPair& pair = first.pair();
  const PairRows p{pair.seg, group, pair.h, pair.seg.len * group};
  // The members' loops stay rolled: this code runs once per thread, cold, and a team merges few parts.
  float top = -INFINITY;
#pragma unroll 1
  for (int m = 0; m < pair.members; ++m) top = fmaxf(top, first.lse()[m * stride + r]);
  float sum = 0.f, v[N] = {};
#pragma unroll 1
  for (int m = 0; m < pair.members; ++m) {
    const float e = top == -INFINITY ? 0.f : fast_exp2(first.lse()[m * stride + r] - top);
    const float4* src = reinterpret_cast<const float4*>(first.o + m * stride + r * D) + c0;
    sum += e;
#pragma unroll
    for (int k = 0; k < Per; ++k) {
      const float4 x = src[k];
      v[4 * k] += e * x.x, v[4 * k + 1] += e * x.y, v[4 * k + 2] += e * x.z, v[4 * k + 3] += e * x.w;
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] *= inv;
  constexpr int kBatch = 64 / N;  // slots whose partials load at once: 64 floats a thread
  a.shared.template fold<D, N, kBatch, 4>(p.token(r), p.head(r), a.heads_q, sum > 0.f ? top + log2f(sum) : -INFINITY,
                                          [&](int j) { return 4 * c0 + j; }, [&](int j) -> float& { return v[j]; });
  T* dst = output_row<D>(a, p, r) + 4 * c0;
#pragma unroll
  for (int k = 0; k < Per; ++k) store_quad<T>(dst + 4 * k, v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

// The block epilogue of teams (after the block barrier): the block's threads share out the outputs
// of every team's pair, Per quads of columns a thread (the fewest Per that gives every thread at
// most one unit, up to 4), so the fold's round trips are paid per thread, not per quad.
template <class T, int D, int Warps, int Per, class Rows, class S>
__device__ void write_team_units(const DecodeArgs<T, Rows, S>& a, unsigned char* smem, int warp_bytes, int team,
                                 int group, int quads) {
  constexpr int kQuads = D / 4;  // quads of a row (Per divides it: a unit stays in its row)
  static_assert(kQuads % Per == 0);
#pragma unroll 1
  for (int u = threadIdx.x; u < quads / Per; u += Warps * 32) {
    int q = u * Per, j = 0;
#pragma unroll 1
    for (;; j += team) {  // the team whose pair holds quad q
      const int n = TeamPart<D>{reinterpret_cast<float*>(smem + j * warp_bytes)}.pair().rows(group) * kQuads;
      if (q < n) break;
      q -= n;
    }
    write_team_columns<T, D, Per>(a, TeamPart<D>{reinterpret_cast<float*>(smem + j * warp_bytes)}, warp_bytes / 4, group,
                                  q / kQuads, q % kQuads);
  }
}
template <class T, int D, int Warps, class Rows, class S>
__device__ void write_block_outputs(const DecodeArgs<T, Rows, S>& a, unsigned char* smem, int warp_bytes, int team,
                                    int group) {
  int quads = 0;
#pragma unroll 1
  for (int j = 0; j < Warps; j += team)
    quads += TeamPart<D>{reinterpret_cast<float*>(smem + j * warp_bytes)}.pair().rows(group) * (D / 4);
  if (quads <= Warps * 32) write_team_units<T, D, Warps, 1>(a, smem, warp_bytes, team, group, quads);
  else if (quads <= 2 * Warps * 32) write_team_units<T, D, Warps, 2>(a, smem, warp_bytes, team, group, quads);
  else write_team_units<T, D, Warps, 4>(a, smem, warp_bytes, team, group, quads);
}

// Merges `members` partials (slots slot_of(i)) of a pair's rows into slot_of(0); the final merge
// then writes the output. One warp; partials of other warps are read through L2.
template <class T, int D, class Rows, class S, class SlotOf>
__device__ void merge_parts(const DecodeArgs<T, Rows, S>& a, const PairRows& p, int members, SlotOf&& slot_of, bool final,
                            int lane) {
  float w[kDecodeRows] = {};  // this lane's member's weight per row (0 for lanes >= members)
  float lse[kDecodeRows];
#pragma unroll
  for (int r = 0; r < kDecodeRows; ++r)
    lse[r] = r < p.rows && lane < members ? __ldcg(a.partial_lse + static_cast<std::int64_t>(slot_of(lane)) * kDecodeRows + r)
                                          : -INFINITY;
#pragma unroll
  for (int r = 0; r < kDecodeRows; ++r) {
    if (r >= p.rows) break;
    float top = lse[r];
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    const float e = top == -INFINITY ? 0.f : exp2f(lse[r] - top);
    float sum = e;
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    w[r] = sum > 0.f ? e / sum : 0.f;
    lse[r] = sum > 0.f ? top + log2f(sum) : -INFINITY;  // the merged lse (same in every lane)
  }
  // Every lane owns kOut float4 outputs of each round of rows, so all its loads of all members of a
  // round are independent and in flight together.
  constexpr int kPerRow = D / 4;                      // float4 per row
  constexpr int kOut = 4;                             // float4 outputs per lane per round
  constexpr int kRowsPerRound = kOut * 32 / kPerRow;  // 8 (D = 64), 4 (D = 128), 2 (D = 256)
  const int dst_slot = slot_of(0);
#pragma unroll
  for (int r0 = 0; r0 < kDecodeRows; r0 += kRowsPerRound) {
    if (r0 >= p.rows) break;
    float4 acc[kOut];
    int row[kOut], col[kOut];
#pragma unroll
    for (int j = 0; j < kOut; ++j) {
      const int idx = lane + 32 * j;
      row[j] = r0 + idx / kPerRow;
      col[j] = idx % kPerRow;
      acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int m = 0; m < kMergeFanIn; ++m) {
      if (m >= members) break;
      float wr[kRowsPerRound];  // member m's weight of each row of the round, in every lane
#pragma unroll
      for (int i = 0; i < kRowsPerRound; ++i) wr[i] = __shfl_sync(0xffffffffu, w[r0 + i < kDecodeRows ? r0 + i : 0], m);
      const float* part = a.partial_o + static_cast<std::int64_t>(slot_of(m)) * kDecodeRows * D;
#pragma unroll
      for (int j = 0; j < kOut; ++j) {
        if (row[j] >= p.rows) continue;
        const float4 v = __ldcg(reinterpret_cast<const float4*>(part + row[j] * D) + col[j]);
        float wm = wr[0];
#pragma unroll
        for (int i = 1; i < kRowsPerRound; ++i) wm = row[j] - r0 == i ? wr[i] : wm;
        acc[j].x += wm * v.x, acc[j].y += wm * v.y, acc[j].z += wm * v.z, acc[j].w += wm * v.w;
      }
    }
#pragma unroll
    for (int j = 0; j < kOut; ++j)
      if (row[j] < p.rows)
        reinterpret_cast<float4*>(a.partial_o + (static_cast<std::int64_t>(dst_slot) * kDecodeRows + row[j]) * D)[col[j]] =
            acc[j];
  }
  if (lane < p.rows) {  // the merged lse of row `lane` (every lane holds every row's)
#pragma unroll
    for (int r = 0; r < kDecodeRows; ++r)
      if (r == lane) a.partial_lse[static_cast<std::int64_t>(dst_slot) * kDecodeRows + r] = lse[r];
  }
  if (final) {
    __syncwarp();  // the merged partial, written by every lane, read back by every lane
    write_merged<T, D>(a, p, dst_slot, lane);
  }
}

// After worker `worker` wrote its partial of the pair at `c`: merges up the tree while this warp
// is the last of its group to finish.
template <class T, int D, class Rows, class S>
__device__ void merge_up(const DecodeArgs<T, Rows, S>& a, const PairCursor& c, const PairRows& p, int worker,
                         std::int64_t chunk, int lane) {
  const PartRange parts = parts_of(c.begin, c.begin + c.tiles, chunk);
  const int n = parts.count();
  int part = worker - parts.first;
  int span = 1;
  for (int level = 0; level < kMergeLevels; ++level, span *= kMergeFanIn) {
    const int first = part / (span * kMergeFanIn) * (span * kMergeFanIn);
    const int members = min(kMergeFanIn, (n - first + span - 1) / span);
    const bool final = first == 0 && span * kMergeFanIn >= n;
    auto slot_of = [&](int i) { return part_slot(parts.first + first + i * span, c.begin, chunk); };
    if (members > 1) {
      // Every lane's partial stores are ordered before lane 0's release by the warp barrier (a
      // device-scope release is cumulative, as in a grid sync); the last part in acquires the
      // others' partials with the same read-modify-write and hands them to its lanes by the
      // second barrier.
      __syncwarp();
      int last = 0;
      std::int32_t* count = a.merge_counts + static_cast<std::int64_t>(level) * a.slots + slot_of(0);
      if (lane == 0)
        last = ::cuda::atomic_ref<std::int32_t, ::cuda::thread_scope_device>{*count}.fetch_add(
                   1, ::cuda::memory_order_acq_rel) == members - 1;
      if (!__shfl_sync(0xffffffffu, last, 0)) return;
      __syncwarp();
      if (lane == 0) *count = 0;
    }
    if (members > 1 || final) merge_parts<T, D>(a, p, members, slot_of, final, lane);
    if (final) return;
    part = first;
  }
}

// Whether this part of the pair at `c` may merge the others in its registers: the pair's parts
// merge in one level (at most kMergeFanIn) and every other part has counted itself in, so their
// partials are visible (their release count, this acquire) and no part counts again. Then the
// count returns to zero here. One round trip (lane 0's acquire load); every lane gets the answer.
template <class T, class Rows, class S>
__device__ bool others_all_in(const DecodeArgs<T, Rows, S>& a, const PartRange& parts, std::int64_t begin,
                              std::int64_t chunk, int lane) {
  const int n = parts.count();
  if (n > kMergeFanIn) return false;
  std::int32_t* count = a.merge_counts + part_slot(parts.first, begin, chunk);  // level 0
  int in = 0;
  if (lane == 0) in = ::cuda::atomic_ref<std::int32_t, ::cuda::thread_scope_device>{*count}.load(::cuda::memory_order_acquire);
  if (__shfl_sync(0xffffffffu, in, 0) != n - 1) return false;
  if (lane == 0) *count = 0;
  return true;
}

// Row r of this lane's share `res` (normalized values, lse) with the partials of the pair's other
// parts merged in by log-sum-exp, one part at a time: its lse, then (unless neither part saw a
// position) its values in batches of 16 loads (at D 256 fewer registers at once).
template <class R, class T, int D, class Rows, class S>
__device__ void merge_in_registers(const DecodeArgs<T, Rows, S>& a, R& res, int r, const PartRange& parts, int own,
                                   std::int64_t begin, std::int64_t chunk, int lane) {
  constexpr int kBatch = R::kValues < 16 ? R::kValues : 16;
  static_assert(R::kValues % kBatch == 0);
#pragma unroll 1
  for (int m = 0; m < parts.count(); ++m) {
    if (m == own) continue;
    const std::int64_t row = static_cast<std::int64_t>(part_slot(parts.first + m, begin, chunk)) * kDecodeRows + r;
    const float lse = __ldcg(a.partial_lse + row);
    const float top = fmaxf(res.lse, lse);
    if (top == -INFINITY) continue;  // neither saw a position
    const float mine = exp2f(res.lse - top), theirs = exp2f(lse - top), sum = mine + theirs;
    const float wm = mine / sum, wt = theirs / sum;
#pragma unroll
    for (int j0 = 0; j0 < R::kValues; j0 += kBatch) {
      float v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = __ldcg(a.partial_o + row * D + R::column(j0 + j, lane));
#pragma unroll
      for (int j = 0; j < kBatch; ++j) res.v(j0 + j) = wm * res.v(j0 + j) + wt * v[j];
    }
    res.lse = top + log2f(sum);
  }
}

// The end of a pair's part in this worker: the output when the pair is whole here (always when
// chunk is 0: a team of one, WorkerTiles), else this part's partial (o / l, lse per row), then the
// merge. Peek (the chunk's last pair, after the decode loop): first merge_in_registers where the
// other parts are all in (others_all_in).
template <bool Peek, class T, int D, class Rows, class S, class State>
__device__ void finish_pair(const DecodeArgs<T, Rows, S>& a, const PairCursor& c, const PairRows& p, State& st,
                            int worker, std::int64_t chunk, int lane) {
  const PartRange parts = chunk == 0 ? PartRange{} : parts_of(c.begin, c.begin + c.tiles, chunk);  // {}: one part
  const bool whole = parts.count() == 1;
  const bool merged = Peek && !whole && others_all_in(a, parts, c.begin, chunk, lane);
  const int slot = whole ? 0 : part_slot(worker, c.begin, chunk);
  using R = typename HalfOf<State>::type;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = R::row(h, lane);
    R res(st, h);
    const bool mine = r < p.rows;  // this lane's row is one of the pair's
    if (whole || merged) {  // warp-uniform: every lane meets the row store (RowHalf's shuffles)
      if (mine) {
        if constexpr (Peek) {
          if (merged) merge_in_registers<R, T, D>(a, res, r, parts, worker - parts.first, c.begin, chunk, lane);
        }
        a.shared.template fold<D, R::kValues>(p.token(r), p.head(r), a.heads_q, res.lse,
                                              [&](int j) { return R::column(j, lane); },
                                              [&](int j) -> float& { return res.v(j); });
      }
      res.template store_row<T>(mine ? output_row<D>(a, p, r) : nullptr, lane);
    } else if (mine) {
      const std::int64_t row = static_cast<std::int64_t>(slot) * kDecodeRows + r;
      res.store_partial(a.partial_o + row * D, a.partial_lse + row, lane);
    }
  }
  if constexpr (Peek) {
    if (merged) {  // the other parts' partials, consumed by every lane
      __syncwarp();
#pragma unroll 1
      for (int m = 0; m < parts.count(); ++m)
        if (m != worker - parts.first) discard_partial<D>(a.partial_o, part_slot(parts.first + m, c.begin, chunk), p.rows, lane);
    }
  }
  if (!whole && !merged) merge_up<T, D>(a, c, p, worker, chunk, lane);
}

// Rows [tokens, width) of the output: zeros (tokens: *a.tokens, read by the caller together with
// the work counts, so neither read waits for the other).
template <class T, int D, class Rows, class S>
__device__ void zero_padding_rows(const DecodeArgs<T, Rows, S>& a, std::int32_t tokens) {
  const std::int64_t row = static_cast<std::int64_t>(a.heads_q) * D;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = tokens * row + blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < a.width * row; i += stride)
    a.out[i] = from_float<T>(0.f);
}

// fp8 tiles: the K (or V) scales of this lane's columns of a tile (columns 8 n + 2 (lane % 4) + {0, 1}).
template <int NT>
__device__ __forceinline__ void column_scales(std::uint32_t scales, float (&c)[NT][2], int lane) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                 : "=f"(c[n][0]), "=f"(c[n][1])
                 : "r"(scales + static_cast<std::uint32_t>(4 * (8 * n + 2 * (lane & 3)))));
}

// fp8 tiles: scores (log2 units) -> the fp16 operands of the PV MMA, w' = p x v_scale(col) / ref
// (fp8_tiles.cuh), with the softmax state, the refs and o brought up to date.
template <int D, int NT>
__device__ __forceinline__ void weigh_values(float (&s)[NT][4], RowState<D>& st, ValueRef& vref, std::uint32_t v_scales,
                                             int lane) {
  float corr[2];
  st.to_probabilities(s, corr);
  float vs[NT][2];
  column_scales<NT>(v_scales, vs, lane);
  float tile_max[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] *= vs[n][e & 1];
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) tile_max[h] = quad_max(tile_max[h]);
  float inv[2];
  vref.settle(corr, tile_max, st, inv);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n][2 * h] *= inv[h], s[n][2 * h + 1] *= inv[h];
}

// S: the pool's stored element (T, or Fp8E4M3: codes converted to fp16 per tile, fp8_tiles.cuh).
// Columns: the tile work with positions on the MMA's M side (fp8_columns.cuh; fp8, D = 128, pairs
// of at most kDecodeColumnRows rows: the plan's decode items are that small).
template <class T, int D, int Stages, int Warps, class Rows, class S = T, bool Columns = false>
__global__ void __launch_bounds__(Warps * 32, 1) decode_attention(DecodeArgs<T, Rows, S> a) {
  constexpr bool kFp8 = std::is_same_v<S, Fp8E4M3>;
  constexpr int kBytes = kFp8 ? 1 : 2;
  using G = DecodeTile<D, kBytes>;
  using M = std::conditional_t<kFp8, __half, T>;  // the MMA operand type
  using State = std::conditional_t<Columns, ColumnState<D>, RowState<D>>;
  static_assert(!Columns || (kFp8 && G::kPositions == kColumnPositions), "columns tiles: fp8 codes, D = 128");
  extern __shared__ __align__(128) unsigned char smem[];
  allow_dependent_grids();
  // Up to wait_for_prior_grids (a dependent launch), only the step's plan is read (the work, the
  // segments and the position tables, which no kernel of the forward changes) and the first tiles'
  // rows where they are settled (settled_end: written before the step, so no kernel of the forward
  // writes them either).
  const int n = a.work.decode_count(), longest = a.work.longest_decode_pair(), head_tiles = a.work.decode_head_tiles();
  const std::int32_t tokens = *a.tokens;
  auto begin_writes = [&] {  // once per thread, before it reads q or the pool or writes out
    wait_for_prior_grids();
    a.guard.check(a.work);
    zero_padding_rows<T, D>(a, tokens);
  };
  if (n == 0) return begin_writes();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int heads_kv = a.pool.heads_kv, group = a.heads_q / heads_kv;
  const WorkerTiles mine = worker_tiles(a.work, n, heads_kv, longest, head_tiles, static_cast<int>(blockIdx.x), warp,
                                        static_cast<int>(gridDim.x), Warps);
  const std::int64_t g0 = mine.g0, g1 = mine.g1, mode = mine.mode;
  const int worker = mode > 0 ? static_cast<int>(g0 / mode) : 0;  // the even split's part (merge slots)
  // Teams (mode < 0) store their parts for the block's epilogue (write_block_outputs); a team of one
  // (mode 0) writes its pair from registers right away, with no block barrier (measured: through
  // the epilogue, the step of 128 forks, 1,024 one-token pairs 8 a block, took 18% longer). mode < 0
  // is block-uniform: then every warp meets the barrier there.
  if (mode >= 0 && g0 >= g1) return begin_writes();
  constexpr int kWarpBytes = decode_warp_smem_bytes(D, Stages, kBytes);
  static_assert(TeamPart<D>::kBytes <= kWarpBytes, "a team's part fits its warp's stages");
  auto part = [&] { return TeamPart<D>{reinterpret_cast<float*>(smem + threadIdx.x / 32 * kWarpBytes)}; };  // this warp's

  PairCursor cc;  // the tile being computed
  {  // the stream of tiles [g0, g1); with an empty range (a team member without tiles) it reads
     // nothing of the pool and computes nothing (a branch here would cost the loop registers)
    const StageRing<D, Stages, kBytes, Columns> ring{smem_addr(smem) + warp * kWarpBytes};
    const std::uint32_t q_tile = ring.query();  // D = 256 only
    cc.seek(a, g0, mine.stride, mine.seg, G::kPositions, lane);
    RowFetch<D, Rows, kBytes> fetch;
    constexpr int kAhead = kL2Ahead<Stages>;
    const int settled = fetch.template start<Stages - 1 + kAhead>(a, cc, g1, lane);
    // Issues the next tile into stage s (or an empty group past the chunk's end); returns the tile's
    // absent columns (holes, positions no row reads).
    auto issue_next = [&](int s) -> std::uint64_t {
      if (!fetch.next[0].valid()) {
        ring.skip();
        return 0;
      }
      // Bits of the tile's columns only: a tile of fewer than 64 positions is then whole (absent
      // 0) when nothing in it is missing, and its masking is skipped.
      constexpr std::uint64_t kColumns = G::kPositions >= 64 ? ~0ull : (1ull << G::kPositions) - 1;
      const std::uint64_t absent =
          absent_columns(fetch.ids[0][0], G::kIds > 1 ? fetch.ids[0][G::kIds - 1] : -1) & kColumns;
      ring.issue(s, a.pool, fetch.next[0].h(), fetch.ids[0], lane);
      fetch.advance(a, g1, lane);
      return absent;
    };
    AbsentMasks<Stages> absent;
    // The first tiles whose rows the step does not write are copied before the wait, so their
    // latency runs under the kernels before this one; the others after it. begin_writes runs once:
    // before the first unsettled tile, or after them all. (Each tile is issued from one place: a
    // second copy of the issue cost the fp8 columns kernel spills.)
#pragma unroll
    for (int s = 0; s < Stages - 1; ++s) {
      if (s == settled) begin_writes();
      absent.set(s, issue_next(s));
    }
    if (settled >= Stages - 1) {  // all of them: the next kAhead tiles, where settled, into L2
#pragma unroll
      for (int k = 0; k < kAhead; ++k)
        if (settled >= Stages + k) ring.prefetch_rows(a.pool, fetch.next[k].h(), fetch.ids[k], lane);
      begin_writes();
    }

    QFragments<D> q;
    q.tile = q_tile;
    q.row0 = 0;
    ColumnQuery qc;  // Columns: the query rows as B operands
    State st;
    float unshift[2] = {1.f, 1.f};  // fp8: 2^-shift of this lane's two rows (Columns: query columns)
    ValueRef vref;                  // fp8: the pair's value references
    int cur = 0;
    for (std::int64_t g = g0; g < g1; ++g) {
      const bool starts = cc.t == 0 || g == g0;
      const PairRows p{cc.seg, group, cc.h, cc.seg.len * group};
      if constexpr (kQueryInRegisters<D>) {
        if (starts) {
          if constexpr (Columns) {
            const int r = lane >> 2;
            qc.load(r < p.rows ? a.q + (static_cast<std::int64_t>(p.token(r)) * a.heads_q + p.head(r)) * D : nullptr, lane,
                    unshift);
          } else if constexpr (kFp8) {
            load_query_fp16_registers<D, G::kDirectK>(q, a.q, a.heads_q, p, lane, unshift);
          } else {
            load_query_registers<D>(q, a.q, a.heads_q, p, lane);
          }
        }
      }
      ring.wait();
      if constexpr (!kQueryInRegisters<D>) {
        if (starts) {
          if constexpr (kFp8) load_query_fp16_shared<D>(q_tile, a.q, a.heads_q, p, lane, unshift);
          else load_query_shared<D>(q_tile, a.q, a.heads_q, p, lane);
        }
      }
      absent.push(issue_next(cur + Stages - 1 < Stages ? cur + Stages - 1 : cur - 1));  // the stage computed last iteration

      const int key0 = (cc.tile0 + cc.t) * G::kPositions;
      // Every row sees every position of the tile: the last row's window starts at or below it, and
      // the first row (at pos0) is at or past its end.
      const bool full =
          key0 >= visible_begin(a.window, cc.seg.pos0 + cc.seg.len - 1) && key0 + G::kPositions - 1 <= cc.seg.pos0;
      auto qpos = [&](int r) { return p.qpos(r); };
      if constexpr (Columns) {
        float s[2][4];
        column_scores(s, qc, ring.k(cur), lane);
        const uint4 raw = ld_shared_v4(ring.k_scales(cur) + 16 * (lane >> 2));  // positions g + 8 j
        const float ks[4] = {__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z), __uint_as_float(raw.w)};
        const float column_factor[2] = {unshift[0] * a.scale_log2, unshift[1] * a.scale_log2};
        const auto absent_bits = static_cast<std::uint32_t>(absent.pop());  // 32 positions
        mask_columns(s, p.rows, qpos, key0, a.window, full && absent_bits == 0, absent_bits,
                     [&](int e, int j) { return column_factor[e] * ks[j]; }, lane);
        weigh_columns<D>(s, st, vref, ring.v_scales(cur), lane);
        column_values<D>(st.o, s, ring.v(cur), lane);
      } else if constexpr (kFp8) {
        float s[G::kNT][4];
        if constexpr (G::kDirectV) {
          qk_codes<D, G::kNT>(s, q, ring.k(cur), lane);
        } else if constexpr (G::kDirectK) {
          convert_codes<D, G::kPositions>({ring.v(cur)}, {ring.v_half()}, lane);
          qk_codes<D, G::kNT>(s, q, ring.k(cur), lane);
          __syncwarp();  // the V tile, written by every lane, before pv reads it
        } else {
          convert_codes<D, G::kPositions>({ring.k(cur), ring.v(cur)}, {ring.k_half(), ring.v_half()}, lane);
          __syncwarp();
          qk<D, G::kNT, M>(s, q, ring.k_half(), 0, lane);
        }
        float ks[G::kNT][2];
        column_scales<G::kNT>(ring.k_scales(cur), ks, lane);
        const float row_factor[2] = {unshift[0] * a.scale_log2, unshift[1] * a.scale_log2};
        mask_tile<G::kNT>(s, p.rows, qpos, key0, a.window, full, absent.pop(),
                          [&](int h, int n, int e) { return row_factor[h] * ks[n][e & 1]; }, lane);
        weigh_values<D, G::kNT>(s, st, vref, ring.v_scales(cur), lane);
        if constexpr (G::kDirectV) pv_codes<D, G::kNT>(st.o, s, ring.v(cur), lane);
        else pv<D, G::kNT, M>(st.o, s, ring.v_half(), 0, lane);
      } else {
        float s[G::kNT][4];
        qk<D, G::kNT, M>(s, q, ring.k(cur), 0, lane);
        mask_tile<G::kNT>(s, p.rows, qpos, key0, a.window, full, absent.pop(), a.scale_log2, lane);
        st.absorb(s);
        pv<D, G::kNT, M>(st.o, s, ring.v(cur), 0, lane);
      }

      if (cc.t == cc.tiles - 1 || g == g1 - 1) {
        if constexpr (G::kDirectV && !Columns) unpermute_values<D>(st.o, lane);
        if constexpr (kFp8) {  // o x ref: the true weighted sum of the values (fp8_tiles.cuh)
#pragma unroll
          for (int h = 0; h < 2; ++h) st.rescale(h, vref.ref[h]);
        }
        if (mode < 0) {
          cp_async_wait<0>();
          __syncwarp();  // every lane's last reads of the stages, before the part overwrites them
          store_team_part<D>(part(), st, p.rows, lane);
        } else if (g == g1 - 1) {
          break;  // the range's last pair: finished after the loop, where registers are free
        } else {
          finish_pair<false, T, D>(a, cc, p, st, worker, mode, lane);
        }
        st = State{};  // the next pair's (here, not at its first tile: no per-tile selects)
        vref = ValueRef{};
      }
      if (g + 1 < g1) cc.next(a, G::kPositions);
      cur = cur + 1 == Stages ? 0 : cur + 1;
    }
    cp_async_wait<0>();
    if (mode >= 0) finish_pair<true, T, D>(a, cc, PairRows{cc.seg, group, cc.h, cc.seg.len * group}, st, worker, mode, lane);
  }
  if (mode < 0) {
    const int team = static_cast<int>(-mode);
    if (warp % team == 0 && lane == 0)  // member 0, after the loop over its share of pair cc
      part().pair() = g0 < g1 ? TeamPair{cc.seg, cc.h, team_members(cc.tiles, team)} : TeamPair{};
    __syncthreads();  // every part and pair of every team of the block stored
    write_block_outputs<T, D, Warps>(a, smem, kWarpBytes, team, group);
  }
}

}  // namespace cellkv::gpu::kernels
