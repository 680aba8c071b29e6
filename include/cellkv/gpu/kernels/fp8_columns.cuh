// cellkv/gpu/kernels/fp8_columns.cuh - the decode kernel's tile work with positions on the MMA's M
// side, for fp8 pools at D = 128 and pairs of at most kDecodeColumnRows query rows (one warp):
//   S^T [positions x queries] = K Q^T      K codes are the A operands, read where they landed
//   O^T [D x queries]        += V^T P^T    V codes are the A operands, P^T the B operands
// A pair's 8 query rows are the MMA's N = 8 columns, so a 32-position tile takes 16 + 16 MMAs and a
// lane holds 8 scores and 32 output values (the row form, kernels/fp8_tiles.cuh, takes 32 + 32
// MMAs over 16 rows and holds 16 and 64). The fp8 numerics are the row form's (fp8_tiles.cuh):
// unscaled codes in fp16 MMAs, queries shifted by a power of two per row, K scales on the scores,
// V scales folded into the weights with the running reference ValueRef.
//
// Lane layout (g = lane / 4, c = lane % 4; MMA fragments as in mma.cuh):
//   scores s[i][2h + e]  position 16 i + g + 8 h of the tile, query column 2c + e
//   output o[m][2h + e]  head element 16 g + 2 m + h, query column 2c + e
// so a lane's output of a column is 16 consecutive head elements.
//
// Head-dimension order of the score MMA (any order works that Q and K share): in k-step kk, the
// k indices 2c + j and 2c + 8 + j (j < 2) stand for head elements 32c + 4kk + j and 32c + 4kk + 2 + j,
// so a lane's A operands of a K row are the 32 consecutive codes [32c, 32c + 32) (two 16-byte
// reads) and its B operands the 32 consecutive query elements of the same range.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cellkv/attention_plan.hpp"
#include "cellkv/gpu/kernels/fp8_tiles.cuh"
#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

// Positions of a columns tile: 32 (two M tiles of 16), the row form's fp8 tile at D = 128.
inline constexpr int kColumnPositions = 32;

// Staged K codes (rows of 128 bytes): the 16-byte chunk c of row r lives at chunk c ^ (r % 2), so
// the 8 lanes of a quarter warp (rows g, g + 1; chunks 2c or 2c + 1) read 8 distinct bank groups.
struct KeyColumnTile {
  static __device__ __forceinline__ std::uint32_t offset(int row, int chunk) {
    return static_cast<std::uint32_t>(row * 128 + ((chunk ^ (row & 1)) * 16));
  }
};

// Where the scale of position p of a tile is staged: lane g reads the scales of its positions g,
// g + 8, g + 16, g + 24 (its rows of both M tiles) as one 16-byte read.
__device__ __forceinline__ int column_scale_slot(int p) { return (p & 7) * 4 + (p >> 3); }

// The 8 x 8 matrix of 16-bit pairs a warp holds in one register per lane (lane g, c: row g,
// columns 2c, 2c + 1), transposed.
__device__ __forceinline__ std::uint32_t transpose_8x8(std::uint32_t x) {
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Max and sum over the 8 lanes of a column (same c, every g).
__device__ __forceinline__ float column_max(float x) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float column_sum(float x) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ uint4 ld_shared_v4(std::uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ std::uint32_t word_of(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// The B operands of the score MMA: query row g (lane / 4) of the pair, head elements
// [32c, 32c + 32) as fp16 of q x 2^shift(row) (fp8_tiles.cuh query_shift), k-step kk's pair
// (32c + 4kk, + 1) in regs[kk][0] and (32c + 4kk + 2, + 3) in regs[kk][1]; zeros for rows past the
// pair's. unshift[e] = 2^-shift of the lane's query column 2c + e.
struct ColumnQuery {
  std::uint32_t regs[8][2];

  // src_row: the lane's query row g [128] (nullptr: a row past the pair's).
  template <class T>
  __device__ __forceinline__ void load(const T* src_row, int lane, float (&unshift)[2]) {
    const int c = lane & 3;
    uint4 raw[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      raw[i] = src_row != nullptr ? reinterpret_cast<const uint4*>(src_row + 32 * c)[i] : make_uint4(0, 0, 0, 0);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = unpack2<T>(word_of(raw[i], k));
        amax = fmaxf(amax, finite_amax2(f.x, f.y));
      }
    const int shift = query_shift(quad_max(amax));
    const float mul = exp2_int(shift), mine = exp2_int(-shift);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // word k of chunk i: elements 8i + 2k, + 1 = k-step 2i + k / 2
        const float2 f = unpack2<T>(word_of(raw[i], k));
        regs[2 * i + k / 2][k % 2] = pack2<__half>(f.x * mul, f.y * mul);
      }
#pragma unroll
    for (int e = 0; e < 2; ++e) unshift[e] = __shfl_sync(0xffffffffu, mine, 4 * (2 * c + e));
  }
};

// S^T (32 positions x 8 query columns) = K Q^T over a KeyColumnTile of codes; unscaled, fp16 MMA.
__device__ __forceinline__ void column_scores(float (&s)[2][4], const ColumnQuery& q, std::uint32_t k_codes, int lane) {
  const int g = lane >> 2, c = lane & 3;
  // Two accumulators per M tile (even and odd k-steps): four chains of 4 dependent MMAs, not two of 8.
  float acc[2][2][4] = {};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint4 rows[2][2];  // rows 16 i + g (+ 8), chunks 2c and 2c + 1
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 2; ++j) rows[h][j] = ld_shared_v4(k_codes + KeyColumnTile::offset(16 * i + g + 8 * h, 2 * c + j));
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      std::uint32_t a[4];  // a0 (g, 2c..), a1 (g + 8, 2c..), a2 (g, 2c + 8..), a3 (g + 8, 2c + 8..)
      e4m3x4_to_half2x2(word_of(rows[0][kk / 4], kk % 4), a[0], a[2]);
      e4m3x4_to_half2x2(word_of(rows[1][kk / 4], kk % 4), a[1], a[3]);
      mma_16816<__half>(acc[i][kk % 2], a, q.regs[kk][0], q.regs[kk][1]);
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[i][e] = acc[i][0][e] + acc[i][1][e];
}

// Scores of a tile -> log2 units: x factor(e, j), the factor of column 2c + e at the lane's position
// g + 8 j; -inf where the column may not see the position or the position is absent (bit p of
// `absent`). Query column r (< rows) sits at position qpos(r); position p of the tile is key0 + p.
// `whole` (the same in every lane): every column < rows sees every position of the tile and none is
// absent, so nothing is masked (columns past rows are zero queries whose results nobody reads; they
// are masked only on the other tiles). The masking path runs on a pair's edge tiles alone, so it
// derives the columns' positions there rather than keeping them in registers.
template <class QPos, class Factor>
__device__ __forceinline__ void mask_columns(float (&s)[2][4], int rows, QPos&& qpos, int key0, int window, bool whole,
                                             std::uint32_t absent, Factor&& factor, int lane) {
  if (whole) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) s[j / 2][2 * (j % 2) + e] *= factor(e, j);
    return;
  }
  const int g = lane >> 2, c = lane & 3;
  const std::uint32_t mine = absent >> g;  // bit 8 j: the lane's position g + 8 j
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * c + e;
    int lo = 1, hi = 0;  // the positions [lo, hi] of the tile column r sees, less g
    if (r < rows) {
      const PositionRange seen = visible_positions(window, qpos(r));
      lo = seen.begin - key0 - g, hi = seen.end - key0 - g;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // position g + 8 j: M tile j / 2, row half j % 2
      const bool ok = 8 * j >= lo && 8 * j <= hi && ((mine >> (8 * j)) & 1u) == 0;
      float& x = s[j / 2][2 * (j % 2) + e];
      x = ok ? x * factor(e, j) : -INFINITY;
    }
  }
}

// Online-softmax state of a lane's two query columns (2c, 2c + 1) and its O^T accumulators.
template <int D>
struct ColumnState {
  static_assert(D == 128, "columns tiles at D = 128");
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // per lane (its positions); column-summed at the end
  float o[D / 16][4] = {};

  // Scores (log2 units, -inf where masked) -> probabilities in place; corr[e]: the factor what column
  // e accumulated before must take (the old maximum's weight under the new one).
  __device__ __forceinline__ void to_probabilities(float (&s)[2][4], float (&corr)[2]) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float mx = column_max(fmaxf(fmaxf(s[0][e], s[0][e + 2]), fmaxf(s[1][e], s[1][e + 2])));
      const float m_new = fmaxf(m[e], mx);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a column that has seen nothing yet
      corr[e] = fast_exp2(m[e] - base);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& x = s[i][2 * h + e];
          x = fast_exp2(x - base);
          sum += x;
        }
      l[e] = l[e] * corr[e] + sum;
      m[e] = m_new;
    }
  }
  // Column e of o times f.
  __device__ __forceinline__ void rescale(int e, float f) {
#pragma unroll
    for (int d = 0; d < D / 16; ++d) o[d][e] *= f, o[d][e + 2] *= f;
  }
};

// fp8: probabilities -> the fp16 weights w' = p x v_scale(position) / ref of the value MMA
// (fp8_tiles.cuh ValueRef, one reference per query column), with the softmax state, the references
// and o brought up to date. v_scales: the tile's V scales (column_scale_slot order).
template <int D>
__device__ __forceinline__ void weigh_columns(float (&s)[2][4], ColumnState<D>& st, ValueRef& vref, std::uint32_t v_scales,
                                              int lane) {
  float corr[2];
  st.to_probabilities(s, corr);
  const uint4 raw = ld_shared_v4(v_scales + 16 * (lane >> 2));
  const float vs[4] = {__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z), __uint_as_float(raw.w)};
  float tile_max[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s[j / 2][2 * (j % 2) + e];
      x *= vs[j];
      tile_max[e] = fmaxf(tile_max[e], x);
    }
#pragma unroll
  for (int e = 0; e < 2; ++e) tile_max[e] = column_max(tile_max[e]);
  float inv[2];
  vref.settle(corr, tile_max, st, inv);
#pragma unroll
  for (int e = 0; e < 2; ++e)
#pragma unroll
    for (int i = 0; i < 2; ++i) s[i][e] *= inv[e], s[i][e + 2] *= inv[e];
}

// O^T (D x 8 query columns) += V^T P^T over a ValueCodeTile of codes: k-step ks covers positions
// [16 ks, 16 ks + 16); a lane reads chunk g of rows 16 ks + 2c + {0, 1, 8, 9} (one 16-byte read
// each, 4 bank groups apart by the tile's swizzle), pairs the rows' bytes per head element, and
// feeds M tile m = 2k + j the elements 16g + 4k + 2j (row g) and + 1 (row g + 8) of word k.
template <int D>
__device__ __forceinline__ void column_values(float (&o)[D / 16][4], const float (&p)[2][4], std::uint32_t v_codes, int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    // P^T's B operands: the transposes of the score layout's 8 x 8 blocks (positions x columns).
    const std::uint32_t b0 = transpose_8x8(pack2<__half>(p[ks][0], p[ks][1]));
    const std::uint32_t b1 = transpose_8x8(pack2<__half>(p[ks][2], p[ks][3]));
    uint4 w[4];  // rows 16 ks + 2c, + 1, + 8, + 9 at chunk g
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = ld_shared_v4(v_codes + ValueCodeTile<D>::offset(16 * ks + 2 * c + (i & 1) + 8 * (i >> 1), g));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t x0 = word_of(w[0], k), x1 = word_of(w[1], k), x8 = word_of(w[2], k), x9 = word_of(w[3], k);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const std::uint32_t sel = j == 0 ? 0x5140 : 0x7362;  // elements 2j, 2j + 1 of the word, rows paired
        std::uint32_t a[4];  // a0 (element 2j: positions 2c, 2c + 1), a1 (2j + 1), a2, a3 (positions + 8)
        e4m3x4_to_half2x2(__byte_perm(x0, x1, sel), a[0], a[1]);
        e4m3x4_to_half2x2(__byte_perm(x8, x9, sel), a[2], a[3]);
        mma_16816<__half>(o[2 * k + j], a, b0, b1);
      }
    }
  }
}

// A lane's share of query column 2c + e of a finished state, normalized in place (the state is
// dead after its rows are written): v(j) is the output at head element column(j, lane), lse the
// column's log2-sum-exp (-inf when it saw nothing). The interface of RowHalf (attention_tiles.cuh).
template <int D>
struct ColumnHalf {
  static constexpr int kValues = D / 8;  // values a lane holds of one row: 16 consecutive elements
  ColumnState<D>& st;
  int e;
  float lse;
  __device__ __forceinline__ ColumnHalf(ColumnState<D>& state, int half) : st(state), e(half) {
    const float l = column_sum(st.l[e]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    lse = l > 0.f ? st.m[e] + log2f(l) : -INFINITY;
    st.rescale(e, inv);
  }
  // The pair's row (query column) of half h of this lane.
  __device__ static __forceinline__ int row(int h, int lane) { return 2 * (lane & 3) + h; }
  __device__ __forceinline__ float& v(int j) const { return st.o[j / 2][2 * (j & 1) + e]; }
  __device__ static __forceinline__ int column(int j, int lane) { return 16 * (lane >> 2) + j; }
  // Stores this lane's share of the row (its kValues consecutive columns; dst: the row's D elements
  // of T, 16-byte aligned; nullptr: nothing stored) in 16-byte pieces. RowHalf::store_row's interface.
  template <class T>
  __device__ __forceinline__ void store_row(T* dst, int lane) const {
    if (dst == nullptr) return;
#pragma unroll
    for (int j = 0; j < kValues; j += 8)
      *reinterpret_cast<uint4*>(dst + column(j, lane)) = make_uint4(pack2<T>(v(j), v(j + 1)), pack2<T>(v(j + 2), v(j + 3)),
                                                                    pack2<T>(v(j + 4), v(j + 5)), pack2<T>(v(j + 6), v(j + 7)));
  }
  // Stores this lane's share as a partial: o_row [D] fp32, *lse_row (one lane of the column writes it).
  __device__ __forceinline__ void store_partial(float* o_row, float* lse_row, int lane) const {
#pragma unroll
    for (int j = 0; j < kValues; j += 4)
      *reinterpret_cast<float4*>(o_row + column(j, lane)) = make_float4(v(j), v(j + 1), v(j + 2), v(j + 3));
    if ((lane >> 2) == 0) *lse_row = lse;
  }
};

}  // namespace cellkv::gpu::kernels
