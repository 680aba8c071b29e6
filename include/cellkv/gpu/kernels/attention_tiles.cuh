// cellkv/gpu/kernels/attention_tiles.cuh - the tensor-core pieces both table-driven attention
// kernels are made of (bf16 / fp16 operands, fp32 accumulation), for one warp and 16 query rows:
//   QFragments  the A operands of 16 query rows of a swizzled shared tile
//   qk          S [16 x 8 NT] = Q K^T over a swizzled K tile
//   pv          O [16 x D] += P V over a swizzled V tile
//   RowState    the online softmax of the warp's 16 rows (two per lane)
//   RowHalf     a lane's share of a finished row: normalized output and log2-sum-exp
//   mask_tile   scores -> log2 units, -inf where a row may not see a column's position or the
//               column is absent (a hole, or a position no row of the tile reads)
//   AbsentMasks the absent columns of the tiles in flight, oldest first
// Lane layout of accumulators (mma.cuh): lane holds rows lane / 4 and lane / 4 + 8, columns
// 2 (lane % 4) and 2 (lane % 4) + 1 of every 8-wide block.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

inline constexpr float kLog2e = 1.4426950408889634f;

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

// S (16 rows x 8 NT cells starting at cell0 of the stage) = Q K^T. KTile: the K tile's layout
// (SwizzledTile or PaddedTile).
template <int D, int NT, class T, class KTile = SwizzledTile<D>>
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
      ldmatrix_x4(b, k_tile + KTile::offset(row, chunk));
      mma_16816<T>(s[n], a, b[0], b[1]);
      mma_16816<T>(s[n + 1], a, b[2], b[3]);
    }
  }
}

// The A operands of O += P V for positions [16 ks, 16 ks + 16) of a tile, from its probabilities in
// the accumulator layout (8-column blocks 2 ks and 2 ks + 1), as T.
template <class T, int NT>
__device__ __forceinline__ void probability_operands(std::uint32_t (&a)[4], const float (&p)[NT][4], int ks) {
  a[0] = pack2<T>(p[2 * ks][0], p[2 * ks][1]);
  a[1] = pack2<T>(p[2 * ks][2], p[2 * ks][3]);
  a[2] = pack2<T>(p[2 * ks + 1][0], p[2 * ks + 1][1]);
  a[3] = pack2<T>(p[2 * ks + 1][2], p[2 * ks + 1][3]);
}

// o (16 rows x D) += P (16 rows x 8 NT cells starting at cell0) V. VTile: the V tile's layout.
template <int D, int NT, class T, class VTile = SwizzledTile<D>>
__device__ __forceinline__ void pv(float (&o)[D / 8][4], const float (&p)[NT][4], std::uint32_t v_tile, int cell0,
                                   int lane) {
#pragma unroll
  for (int ks = 0; ks < NT / 2; ++ks) {
    std::uint32_t a[4];
    probability_operands<T>(a, p, ks);
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      std::uint32_t b[4];
      const int row = cell0 + 16 * ks + (lane & 7) + (((lane >> 3) & 1) << 3), chunk = 2 * dd + (lane >> 4);
      ldmatrix_x4_trans(b, v_tile + VTile::offset(row, chunk));
      mma_16816<T>(o[2 * dd], a, b[0], b[1]);
      mma_16816<T>(o[2 * dd + 1], a, b[2], b[3]);
    }
  }
}

// How far (log2 units) a row's scores may pass its exponent base before a lazy online softmax
// moves the base (RowState::online_softmax<true>): probabilities stay <= 2^8.
inline constexpr float kLazyRescaleLog2 = 8.f;

// Online-softmax state of the two rows (lane / 4 and lane / 4 + 8) a lane holds in a 16-row tile.
template <int D>
struct RowState {
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // per lane; quad-summed at the end
  float o[D / 8][4];
  enum Unset { kUnset };
  __device__ __forceinline__ RowState() { zero_o(); }
  // o left unset: the caller's first P V writes it rather than adds to it.
  __device__ __forceinline__ explicit RowState(Unset) {}
  __device__ __forceinline__ void zero_o() {
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[d][e] = 0.f;
  }

  // Scores s (in log2 units, -inf where invisible) -> probabilities in place; rescales o.
  template <int NT>
  __device__ __forceinline__ void absorb(float (&s)[NT][4]) {
    float corr[2];
    to_probabilities(s, corr);
#pragma unroll
    for (int h = 0; h < 2; ++h) rescale(h, corr[h]);
  }
  // absorb without touching o: corr[h] is the factor o's row h must take (the old maximum's weight
  // under the new one).
  template <int NT>
  __device__ __forceinline__ void to_probabilities(float (&s)[NT][4], float (&corr)[2]) {
    online_softmax(s, corr, [](float x) { return x; }, [](float x, float base) { return x - base; });
  }
  // to_probabilities for raw scores (-inf where masked) and a factor scale_log2 > 0 folded into the
  // exponent: p = 2^(s scale_log2 - m), one FFMA and one exp2 a score.
  template <bool Lazy = false, int NT>
  __device__ __forceinline__ void to_probabilities_scaled(float (&s)[NT][4], float scale_log2, float (&corr)[2]) {
    online_softmax<Lazy>(s, corr, [=](float x) { return x * scale_log2; },
                         [=](float x, float base) { return fmaf(x, scale_log2, -base); });
  }
  // The online softmax step of both: the row maxima of the scores in log2 units (to_log2 of a raw
  // maximum: the scale is positive, so it keeps the order), p = 2^exponent(s, new maximum).
  template <bool Lazy = false, int NT, class ToLog2, class Exponent>
  __device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&corr)[2], ToLog2&& to_log2,
                                                 Exponent&& exponent) {
    // Four independent partial maxima and sums a row: short dependency chains for wide tiles.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < NT; ++n) mx[n % 4] = fmaxf(mx[n % 4], fmaxf(s[n][2 * h], s[n][2 * h + 1]));
      const float tile_max = to_log2(quad_max(fmaxf(fmaxf(mx[0], mx[1]), fmaxf(mx[2], mx[3]))));
      float m_new = fmaxf(m[h], tile_max);
      // Lazy: the base stays while the tile's maximum passes it by at most kLazyRescaleLog2 (so p <=
      // 2^8, exact enough in T and summed in fp32), and corr is then 1: o is rescaled only when a
      // row's maximum jumps. A row's first finite maximum always becomes its base.
      if constexpr (Lazy)
        if (!(tile_max > m[h] + kLazyRescaleLog2)) m_new = m[h];
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen nothing yet
      corr[h] = fast_exp2(m[h] - base);
      float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[n][e] = fast_exp2(exponent(s[n][e], base));
          sum[n % 4] += s[n][e];
        }
      l[h] = l[h] * corr[h] + ((sum[0] + sum[1]) + (sum[2] + sum[3]));
      m[h] = m_new;
    }
  }
  // o's row h (this lane's row lane / 4 + 8 h) times f.
  __device__ __forceinline__ void rescale(int h, float f) {
#pragma unroll
    for (int d = 0; d < D / 8; ++d) o[d][2 * h] *= f, o[d][2 * h + 1] *= f;
  }
};

// A 4 x 4 block of words over a quad, transposed: on entry lane q of the quad holds row q (w[t]:
// element (q, t)), on return column q (w[t]: element (t, q)). Two butterfly exchanges: with lane
// q ^ 1 the two words whose index differs from q in bit 0, then with lane q ^ 2 the two whose index
// differs from q in bit 1. After the first, slot t holds element (row (q & 2) | (t & 1), column
// (t & 2) | (q & 1)); after the second, element (t, q).
__device__ __forceinline__ void quad_transpose(std::uint32_t (&w)[4], int lane) {
  const bool odd = (lane & 1) != 0, high = (lane & 2) != 0;
#pragma unroll
  for (int hi = 0; hi < 4; hi += 2) {  // slots hi, hi + 1: keep the one of q's parity, trade the other
    const std::uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[hi] : w[hi + 1], 1);
    (odd ? w[hi] : w[hi + 1]) = got;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // slots i, 2 + i: keep the pair of q's bit 1, trade the other
    const std::uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[i] : w[2 + i], 2);
    (high ? w[i] : w[2 + i]) = got;
  }
}

// A lane's share of row (lane / 4) + 8 h of a finished state, normalized in place (no copy: the
// state is dead after its rows are written): v(j) is the output at column column(j, lane), lse the
// row's log2-sum-exp of its scores (-inf when it saw nothing).
template <int D>
struct RowHalf {
  static constexpr int kValues = D / 4;  // values a lane holds of one row
  RowState<D>& st;
  int h;
  float lse;
  __device__ __forceinline__ RowHalf(RowState<D>& state, int half, bool with_lse = true) : st(state), h(half) {
    const float l = quad_sum(st.l[h]);
    const float inv = l > 0.f ? fast_rcp(l) : 0.f;  // l >= 1 when > 0: the maximum's own term is 1
    lse = -INFINITY;
    if (with_lse && l > 0.f) lse = st.m[h] + log2f(l);
#pragma unroll
    for (int d = 0; d < D / 8; ++d) st.o[d][2 * h] *= inv, st.o[d][2 * h + 1] *= inv;
  }
  // The row of half h of this lane (of a 16-row tile).
  __device__ static __forceinline__ int row(int h, int lane) { return (lane >> 2) + 8 * h; }
  __device__ __forceinline__ float& v(int j) const { return st.o[j / 2][2 * h + (j & 1)]; }
  __device__ static __forceinline__ int column(int j, int lane) { return (j / 2) * 8 + (lane & 3) * 2 + (j & 1); }
  // Stores the row (the quad's four lanes together; dst: the row's D elements of T, 16-byte
  // aligned, the same in the quad's lanes; nullptr: nothing stored) in 16-byte pieces: each
  // quad_transpose of four 8-column blocks leaves a lane one whole block (8 columns), so a warp's
  // store covers 64 bytes of each of its 8 rows, not 16. Every lane of the warp must call it (it
  // shuffles), whether its quad stores or not.
  template <class T>
  __device__ __forceinline__ void store_row(T* dst, int lane) const {
    static_assert(D % 32 == 0, "whole groups of four 8-column blocks");
#pragma unroll
    for (int g = 0; g < D / 32; ++g) {
      std::uint32_t w[4];  // w[t]: columns 8 (4 g + t) + 2 (lane % 4), + 1
#pragma unroll
      for (int t = 0; t < 4; ++t) w[t] = pack2<T>(v(8 * g + 2 * t), v(8 * g + 2 * t + 1));
      quad_transpose(w, lane);  // w[t]: columns 8 (4 g + lane % 4) + 2 t, + 1
      if (dst != nullptr) *reinterpret_cast<uint4*>(dst + 8 * (4 * g + (lane & 3))) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  // Stores this lane's share as a partial: o_row [D] fp32, *lse_row (one lane of the quad writes it).
  __device__ __forceinline__ void store_partial(float* o_row, float* lse_row, int lane) const {
#pragma unroll
    for (int j = 0; j < kValues; j += 2) *reinterpret_cast<float2*>(o_row + column(j, lane)) = make_float2(v(j), v(j + 1));
    if ((lane & 3) == 0) *lse_row = lse;
  }
};

// Bit c set: column c of a tile is absent (its row id is -1: a hole of the sequence, or a position
// no row of the tile reads; its K and V were zero-filled). From the row ids of positions
// [32 j, 32 j + 32), one per lane: ids_j of lane l is column 32 j + l (lanes past the tile: -1).
__device__ __forceinline__ std::uint64_t absent_columns(int id0, int id1) {
  const std::uint32_t lo = __ballot_sync(0xffffffffu, id0 < 0), hi = __ballot_sync(0xffffffffu, id1 < 0);
  return static_cast<std::uint64_t>(hi) << 32 | lo;
}

// The absent masks of the N tiles a ring has in flight, oldest first: push() at each issue (0 for an
// empty slot), pop() at each compute. Constant indices only, so the masks stay in registers.
template <int N>
struct AbsentMasks {
  std::uint64_t m[N] = {};
  // Slot k of a prologue that fills slots [0, N - 1) in order (k a compile-time constant after unrolling).
  __device__ __forceinline__ void set(int k, std::uint64_t mask) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i == k) m[i] = mask;
  }
  __device__ __forceinline__ void push(std::uint64_t mask) { m[N - 1] = mask; }
  __device__ __forceinline__ std::uint64_t pop() {
    const std::uint64_t oldest = m[0];
#pragma unroll
    for (int i = 0; i + 1 < N; ++i) m[i] = m[i + 1];
    return oldest;
  }
};

// Scores of a tile -> log2 units; -inf where the row may not see the column or the column is
// absent (bit c of `absent`). Row r of the 16 sits at query position qpos(r) (rows >= `rows` see
// nothing); column c holds key position key0 + c. With `full`, every row < rows sees every column's
// position (the caller checked the tile's range). scale(h, n, e): the factor of score s[n][e], whose
// row is lane / 4 + 8 h (fp8 tiles: a row and a column scale; else scale * log2(e)).
template <int NT, class QPos, class Scale>
__device__ __forceinline__ void mask_tile(float (&s)[NT][4], int rows, QPos&& qpos, int key0, int window, bool full,
                                          std::uint64_t absent, Scale&& scale, int lane) {
  static_assert(NT * 8 <= 64, "absent masks cover 64 columns");
  const bool whole = full && absent == 0;  // every row < rows sees every column
  const int lane_col = (lane & 3) * 2;     // the lane's first column of each 8-column block
#pragma unroll
  for (int e2 = 0; e2 < 2; ++e2) {
    const int r = (lane >> 2) + 8 * e2;
    const bool row_ok = r < rows;
    // The columns [lo, hi] the row sees, less the lane's column offset, so that a column's test
    // is two compares with constants (n 8 + (e & 1)): none for a row past `rows`.
    int lo = 1, hi = 0;
    if (row_ok && whole) {
      lo = 0, hi = NT * 8 - 1;
    } else if (row_ok) {
      const PositionRange seen = visible_positions(window, qpos(r));
      lo = seen.begin - key0, hi = seen.end - key0;
    }
    lo -= lane_col, hi -= lane_col;
    auto apply = [&](auto holes) {  // holes: whether absent columns must be tested (the tile's, so warp-uniform)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 2 * e2; e < 2 * e2 + 2; ++e) {
          const int c = n * 8 + (e & 1);
          const bool ok = c >= lo && c <= hi && (!holes || ((absent >> (c + lane_col)) & 1) == 0);
          s[n][e] = ok ? s[n][e] * scale(e2, n, e) : -INFINITY;
        }
    };
    if (absent == 0) apply(std::false_type{});
    else apply(std::true_type{});
  }
}
template <int NT, class QPos>
__device__ __forceinline__ void mask_tile(float (&s)[NT][4], int rows, QPos&& qpos, int key0, int window, bool full,
                                          std::uint64_t absent, float scale_log2, int lane) {
  mask_tile<NT>(s, rows, qpos, key0, window, full, absent, [=](int, int, int) { return scale_log2; }, lane);
}

}  // namespace cellkv::gpu::kernels
