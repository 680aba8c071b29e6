// cellkv/gpu/kernels/reference_attention.cuh - the reference attention kernel: correct first,
// reasonably efficient, any visibility policy. Fast kernels are checked against it.
//
//   out[t, h] = softmax_c(scale * q[t, h] . k[c, h / g]) v[c, h / g]  over rows c visible to t
//
// q, out: [tokens, H_q, D]; pool K/V: [rows, H_kv, D]; g = H_q / H_kv. fp32 accumulation.
// Grid: x = token, y = KV head x chunk of up to kRefHeads query heads of its group. Block: 4 warps;
// warp w sweeps rows begin + w, begin + w + 4, ...; each lane holds D / 32 elements of every query
// head, a row's dot product is a warp reduction, and each warp keeps an online softmax that the
// block merges at the end. A token that sees nothing writes zeros.
//
// fp8 pools (S = Fp8E4M3): K and V elements read decode(code) x the row-head's scale, in fp32
// (fp8.hpp dequantize_row_head), so the kernel stays the oracle of the fp8 table kernels.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/fp8.hpp"
#include "cellkv/gpu/kv_views.hpp"
#include "cellkv/pool_view.hpp"

namespace cellkv::gpu::kernels {

inline constexpr int kRefWarps = 4;
inline constexpr int kRefHeads = 8;

// T: queries and outputs; S: the pool's elements (T, or Fp8E4M3 codes with scales).
template <class T, class S = T>
struct AttentionArgs {
  const T* q = nullptr;        // [tokens, heads_q, D]
  ReadView<S> pool;            // [rows, heads_kv, D] each
  T* out = nullptr;            // [tokens, heads_q, D]
  std::int32_t tokens = 0;
  std::int32_t heads_q = 0;
  float scale = 0;
};

// E elements [d0, d0 + E) of K and V of (row, head) as floats.
template <int E, class T>
__device__ __forceinline__ void load_kv(const PoolView<const T>& pool, std::int64_t row, int head, int d0, float (&k)[E],
                                        float (&v)[E]) {
  const std::int64_t off = pool.offset(row, head) + d0;
#pragma unroll
  for (int e = 0; e < E; ++e) k[e] = to_float(pool.k[off + e]), v[e] = to_float(pool.v[off + e]);
}
template <int E>
__device__ __forceinline__ void load_kv(const Fp8PoolView<const Fp8E4M3>& pool, std::int64_t row, int head, int d0,
                                        float (&k)[E], float (&v)[E]) {
  const std::int64_t off = pool.offset(row, head) + d0, so = pool.scale_offset(row, head);
  dequantize_row_head(pool.k + off, E, pool.k_scale[so], k);
  dequantize_row_head(pool.v + off, E, pool.v_scale[so], v);
}

template <class T, int D, class Vis, class S = T>
__global__ void __launch_bounds__(kRefWarps * 32) reference_attention(AttentionArgs<T, S> a, Vis vis) {
  constexpr int E = D / 32;  // elements per lane
  allow_dependent_grids();
  const int t = blockIdx.x;
  const int group = a.heads_q / a.pool.heads_kv;
  const int chunks = (group + kRefHeads - 1) / kRefHeads;
  const int hk = blockIdx.y / chunks, chunk = blockIdx.y % chunks;
  const int h0 = hk * group + chunk * kRefHeads;
  const int nh = min(kRefHeads, group - chunk * kRefHeads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  float q[kRefHeads][E], acc[kRefHeads][E], m[kRefHeads], l[kRefHeads];
#pragma unroll
  for (int h = 0; h < kRefHeads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const std::int64_t qi = (static_cast<std::int64_t>(t) * a.heads_q + h0 + h) * D + lane * E + e;
      q[h][e] = h < nh ? to_float(a.q[qi]) * a.scale : 0.f;
      acc[h][e] = 0.f;
    }
  }

  const std::int64_t hi = vis.end(t);
  for (std::int64_t c = vis.begin(t) + warp; c < hi; c += kRefWarps) {
    if (!vis.visible(t, c)) continue;
    float kf[E], vf[E];
    load_kv<E>(a.pool, c, hk, lane * E, kf, vf);
#pragma unroll
    for (int h = 0; h < kRefHeads; ++h) {
      if (h >= nh) break;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) s += q[h][e] * kf[e];
      s = warp_sum(s);
      const float m_new = fmaxf(m[h], s);
      const float corr = expf(m[h] - m_new);  // 0 while m[h] is still -inf
      const float p = expf(s - m_new);
      l[h] = l[h] * corr + p;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[h][e] = acc[h][e] * corr + p * vf[e];
      m[h] = m_new;
    }
  }

  // Merge the warps' partial softmaxes.
  __shared__ float sm_m[kRefWarps][kRefHeads], sm_l[kRefWarps][kRefHeads];
  __shared__ float sm_acc[kRefWarps][kRefHeads][D];
#pragma unroll
  for (int h = 0; h < kRefHeads; ++h) {
    if (lane == 0) {
      sm_m[warp][h] = m[h];
      sm_l[warp][h] = l[h];
    }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_acc[warp][h][lane * E + e] = acc[h][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nh * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float top = -INFINITY;
    for (int w = 0; w < kRefWarps; ++w) top = fmaxf(top, sm_m[w][h]);
    float sum = 0.f, o = 0.f;
    if (top != -INFINITY) {
      for (int w = 0; w < kRefWarps; ++w) {
        const float f = expf(sm_m[w][h] - top);
        sum += sm_l[w][h] * f;
        o += sm_acc[w][h][d] * f;
      }
    }
    a.out[(static_cast<std::int64_t>(t) * a.heads_q + h0 + h) * D + d] = from_float<T>(sum > 0.f ? o / sum : 0.f);
  }
}

}  // namespace cellkv::gpu::kernels
