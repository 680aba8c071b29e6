// cellkv/gpu/kernels/fp8_tiles.cuh - what the decode kernel adds to read an fp8 pool (E4M3 codes
// and an fp32 scale per row-head, fp8_pool_view.hpp), one warp per tile:
//   convert_codes  staged tiles of codes [P][D] -> swizzled fp16 tiles (exact: every E4M3 value is
//                  an fp16 value, so K and V enter the MMA unrounded)
//   qk_codes       the score MMA reading K codes where they landed (D <= 128), no fp16 K tile
//   pv_codes       the value MMA reading V codes where they landed (D = 128), no fp16 V tile;
//                  unpermute_values puts its accumulator columns back in the usual order
//   query_shift    the power of two that brings a query row into fp16 range
//   ValueRef       the running reference of the weights p x v_scale a pair's rows have seen
//
// The MMA runs in fp16 on unscaled codes; the scales stay outside it:
//   score(r, c) = (q'(r) . code_k(c)) x 2^-shift(r) x k_scale(c)      q'(r) = fp16(q(r) x 2^shift(r))
//   o(r)        = sum_c p(r, c) x v_scale(c) x code_v(c) = ref(r) x sum_c w'(r, c) code_v(c)
// with w' = p x v_scale / ref(r) and ref(r) a reference weight of row r: the largest weight
// p x v_scale of the row at the last tile that raised it. A tile raises ref only when one of its
// weights passes kValueHeadroom (256) x ref, so the fp16 operand w' lies in [0, 256] and the row's
// dominant terms keep full fp16 precision whatever the scales span (a weight below 2^-24 of the
// reference is lost, as fp16 probabilities lose it). When a tile raises ref, the accumulated o is
// rescaled by old ref / new ref, together with the softmax's own rescaling; between raises it is
// left alone. The output is o x ref / l.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cellkv/gpu/kernels/attention_tiles.cuh"
#include "cellkv/gpu/kernels/mma.cuh"

namespace cellkv::gpu::kernels {

// Four E4M3 codes (a 32-bit word, low byte first) as four fp16 values in two registers (low
// half first): two hardware conversions, exact. NaN codes give an fp16 NaN.
__device__ __forceinline__ void e4m3x4_to_half2x2(std::uint32_t codes, std::uint32_t& lo, std::uint32_t& hi) {
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(codes));
}
// Two E4M3 codes (the low 16 bits, low byte first) as two fp16 values (low half first).
__device__ __forceinline__ std::uint32_t e4m3x2_to_half2(std::uint32_t codes) {
  std::uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"(static_cast<unsigned short>(codes)));
  return h;
}

// Converts staged tiles of P rows x D codes (rows of D bytes, unswizzled) at `codes[t]` into the
// swizzled fp16 tiles at `tiles[t]` (SwizzledTile<D>), t < N (K, or K and V at once); one warp.
// Each lane converts 16 codes at a time and stores the two 16-byte halves in an order that keeps
// every group of 8 lanes on distinct bank groups.
template <int D, int P, int N>
__device__ __forceinline__ void convert_codes(const std::uint32_t (&codes)[N], const std::uint32_t (&tiles)[N], int lane) {
  constexpr int kChunks = D / 16;  // 16-code chunks per row
  static_assert((P * kChunks) % 32 == 0, "a tile is a whole number of warp-wide passes");
#pragma unroll
  for (int i = 0; i < P * kChunks / 32; ++i) {
    const int idx = lane + 32 * i, row = idx / kChunks, chunk = idx % kChunks;
    const bool swap = D >= 128 && ((chunk >> 2) & 1) != 0;  // this lane stores its second half first
#pragma unroll
    for (int t = 0; t < N; ++t) {
      std::uint32_t w[4];
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                   : "r"(codes[t] + static_cast<std::uint32_t>(idx * 16)));
      std::uint32_t h[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) e4m3x4_to_half2x2(w[j], h[2 * j], h[2 * j + 1]);
      std::uint32_t a[4], b[4];  // the halves in store order (selects: no runtime index into h)
#pragma unroll
      for (int j = 0; j < 4; ++j) a[j] = swap ? h[4 + j] : h[j], b[j] = swap ? h[j] : h[4 + j];
      const int first = swap ? 1 : 0;
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(tiles[t] + SwizzledTile<D>::offset(row, 2 * chunk + first)),
                   "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]));
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(tiles[t] + SwizzledTile<D>::offset(row, 2 * chunk + 1 - first)),
                   "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]));
    }
  }
}

// Staged K codes the score MMA reads in place (D <= 128): rows of D bytes whose 16-byte chunks are
// swizzled so that the 8 rows an MMA n-block reads at one chunk sit in 8 distinct bank groups.
template <int D>
struct CodeTile {
  static_assert(D == 64 || D == 128, "K codes are read in place for D = 64 and 128");
  static constexpr int kChunks = D / 16;
  static __device__ __forceinline__ int swizzle(int row) { return D == 128 ? row & 7 : (row >> 1) & 3; }
  static __device__ __forceinline__ std::uint32_t offset(int row, int chunk) {
    return static_cast<std::uint32_t>(row * D + ((chunk ^ swizzle(row)) * 16));
  }
};

// S (16 rows x 8 NT positions) = Q K^T with K read as codes from a CodeTile: in each 16-column
// block of the head dimension, the MMA's k index 2c + j (c = lane % 4, j < 2) stands for head
// element 4c + j and k index 2c + 8 + j for 4c + 2 + j, so a lane's B operands of an n-block are the
// 4 consecutive codes [4c, 4c + 4) of its row, one 32-bit read; the query fragments were loaded in
// the same order (load_query_registers<D, true>). Unscaled codes, fp16 MMA.
template <int D, int NT, class Q>
__device__ __forceinline__ void qk_codes(float (&s)[NT][4], const Q& q, std::uint32_t k_codes, int lane) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[4];
    q.get(a, kk, lane);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int row = 8 * n + g;
      std::uint32_t word, b0, b1;
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(word) : "r"(k_codes + CodeTile<D>::offset(row, kk) + 4 * c));
      e4m3x4_to_half2x2(word, b0, b1);
      mma_16816<__half>(s[n], a, b0, b1);
    }
  }
}

// Staged V codes the value MMA reads in place (D = 128): rows of D bytes whose 16-byte chunks are
// swizzled (chunk ^ 2 ((row / 2) % 4)) so that the rows 2c + {0, 1, 8, 9} of a 16-position block the
// four lanes c of a quad read at one word sit in distinct bank groups.
template <int D>
struct ValueCodeTile {
  static_assert(D == 128, "V codes are read in place for D = 128");
  static __device__ __forceinline__ std::uint32_t offset(int row, int chunk) {
    return static_cast<std::uint32_t>(row * D + ((chunk ^ (2 * ((row >> 1) & 3))) * 16));
  }
};

// o (16 rows x D, value-permuted columns) += P (16 rows x 8 NT positions) V, V read as codes from a
// ValueCodeTile. The B operands of an MMA n-tile pair k indices (positions) 2c, 2c + 1 and 2c + 8,
// 2c + 9 of one column; here n-tile 4 b + j, column n stands for head element 4 (n + 8 b) + j, so a
// lane (column g = lane / 4, c = lane % 4) reads one 32-bit word (elements [4 (g + 8 b), + 4)) of
// each of its four rows and pairs the rows' bytes per element (byte permutes) into the operands of
// four n-tiles. Accumulator column 2c + e of n-tile 4 b + j is then head element
// 32 b + 8 c + 4 e + j; unpermute_values brings o back to column 8 m + 2 c + e of n-tile m.
template <int D, int NT>
__device__ __forceinline__ void pv_codes(float (&o)[D / 8][4], const float (&p)[NT][4], std::uint32_t v_codes, int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int ks = 0; ks < NT / 2; ++ks) {
    std::uint32_t a[4];
    probability_operands<__half>(a, p, ks);
#pragma unroll
    for (int b = 0; b < D / 32; ++b) {
      std::uint32_t w[4];  // rows 16 ks + 2c, + 1, + 8, + 9 at word g + 8 b
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 16 * ks + 2 * c + (i & 1) + 8 * (i >> 1);
        asm volatile("ld.shared.u32 %0, [%1];\n"
                     : "=r"(w[i])
                     : "r"(v_codes + ValueCodeTile<D>::offset(row, (g >> 2) + 2 * b) + 4 * (g & 3)));
      }
      std::uint32_t b0[4], b1[4];  // element j's operands: rows (2c, 2c + 1) and (2c + 8, 2c + 9)
      e4m3x4_to_half2x2(__byte_perm(w[0], w[1], 0x5140), b0[0], b0[1]);
      e4m3x4_to_half2x2(__byte_perm(w[0], w[1], 0x7362), b0[2], b0[3]);
      e4m3x4_to_half2x2(__byte_perm(w[2], w[3], 0x5140), b1[0], b1[1]);
      e4m3x4_to_half2x2(__byte_perm(w[2], w[3], 0x7362), b1[2], b1[3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_16816<__half>(o[4 * b + j], a, b0[j], b1[j]);
    }
  }
}

// o accumulated by pv_codes -> the usual accumulator order (column 8 m + 2 c + e of n-tile m). Per
// row half h and 32-column block b, lane c holds the column pairs 32 b + 8 c + 2 q + {0, 1}, q < 4
// (slot q), and needs the pairs 32 b + 8 m + 2 c + {0, 1}, m < 4 (slot m): a 4 x 4 transpose
// within the quad, two rounds of exchanges with lane c ^ 1 and c ^ 2.
template <int D>
__device__ __forceinline__ void unpermute_values(float (&o)[D / 8][4], int lane) {
  const int c = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int b = 0; b < D / 32; ++b) {
      float2 x[4];  // slot q: (e, j) = (q / 2, 2 (q % 2)) and (q / 2, 2 (q % 2) + 1)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        x[q] = make_float2(o[4 * b + 2 * (q & 1)][2 * h + (q >> 1)], o[4 * b + 2 * (q & 1) + 1][2 * h + (q >> 1)]);
#pragma unroll
      for (int k = 1; k <= 2; k *= 2) {
        const bool up = (c & k) != 0;  // keeps the slots with bit k set, sends the others
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (q & k) continue;
          const float2 send = up ? x[q] : x[q | k];
          const float2 got = make_float2(__shfl_xor_sync(0xffffffffu, send.x, k), __shfl_xor_sync(0xffffffffu, send.y, k));
          if (up) x[q] = got;
          else x[q | k] = got;
        }
      }
#pragma unroll
      for (int m = 0; m < 4; ++m) o[4 * b + m][2 * h] = x[m].x, o[4 * b + m][2 * h + 1] = x[m].y;
    }
}

// Two T (bf16 or fp16) in one register as floats.
template <class T>
__device__ __forceinline__ float2 unpack2(std::uint32_t u) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
  else return __half22float2(*reinterpret_cast<const __half2*>(&u));
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float exp2_int(int e) { return __uint_as_float(static_cast<std::uint32_t>(e + 127) << 23); }

// The power of two s for a query row whose largest finite |q| is amax: amax x 2^s lands in
// [2^14, 2^15) (fp16 holds up to 65504), clamped so 2^s and 2^-s are normal floats; 0 for amax 0.
__device__ __forceinline__ int query_shift(float amax) {
  if (!(amax > 0.f)) return 0;
  const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF) - 127;  // floor(log2(amax)); -127 for subnormals
  return max(-125, min(125, 14 - e));
}

// Largest finite |x| of two values (0 when neither is finite).
__device__ __forceinline__ float finite_amax2(float a, float b) {
  const float fa = fabsf(a), fb = fabsf(b);
  return fmaxf(fa <= 3.4e38f ? fa : 0.f, fb <= 3.4e38f ? fb : 0.f);
}

// How far a tile's weights may pass the value reference before it is raised: w' stays in
// [0, kValueHeadroom], well inside fp16, and o is rescaled only when a row's weights grow by more.
inline constexpr float kValueHeadroom = 256.f;

// The value reference of this lane's two rows (lane / 4 + 8 h) of a pair (the columns form: its two
// query columns): a weight p x v_scale of a column seen so far, in the units of the row's current
// softmax maximum, no lower than 1 / kValueHeadroom of every weight seen; the accumulated o holds
// sum(p x v_scale x code_v) / ref. Every lane of a quad holds the same refs.
struct ValueRef {
  float ref[2] = {0.f, 0.f};
  // After a tile's probabilities (corr[h]: the softmax's factor for what came before, tile_max[h]:
  // the tile's largest weight, quad-wide): the new ref of row h, and in f[h] the factor o's row
  // takes, (old ref x corr) / new ref <= 1 (corr while nothing has weight yet). The carried
  // reference stays while it is a normal float and the tile's weights are within the headroom.
  __device__ __forceinline__ void raise(const float (&corr)[2], const float (&tile_max)[2], float (&f)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float carried = ref[h] * corr[h];
      // At least the smallest normal float: 1 / ref stays finite (a weight of a row whose every
      // weight is below 2^-126 then enters the MMA below 1, still exact to fp16's precision).
      constexpr float kMinNormal = 1.17549435e-38f;
      const bool keep = carried >= kMinNormal && tile_max[h] <= carried * kValueHeadroom;
      const float top = fmaxf(carried, tile_max[h]);
      const float next = keep ? carried : top > 0.f ? fmaxf(top, kMinNormal) : 0.f;
      // Exactly 1 while the reference holds (the usual tile: o is then left alone); next is normal.
      f[h] = next == carried ? 1.f : next > 0.f ? carried * fast_rcp(next) : corr[h];
      ref[h] = next;
    }
  }
  // raise, then o brought along (st.rescale(h, f[h]) for both halves, skipped by the whole warp
  // while every f is 1, as it is once the maxima settle), and the factors of the tile's weights:
  // inv[h] = inverse(h). State: RowState or ColumnState.
  template <class State>
  __device__ __forceinline__ void settle(const float (&corr)[2], const float (&tile_max)[2], State& st, float (&inv)[2]) {
    float f[2];
    raise(corr, tile_max, f);
    if (__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) st.rescale(h, f[h]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) inv[h] = inverse(h);
  }
  // The factor of a weight in row h: 1 / ref (0 while the row has no weight: every V is 0 so far).
  __device__ __forceinline__ float inverse(int h) const { return ref[h] > 0.f ? fast_rcp(ref[h]) : 0.f; }
};

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

}  // namespace cellkv::gpu::kernels
