// llama/gpu_kernels.cuh - the example decoder's kernels: embedding (with token ids sampled on the
// device by the previous step), RMSNorm, RoPE, SwiGLU, the fused skinny GEMV of narrow steps, and
// the sum that stands in for an all-reduce when every shard sits on one GPU.
//
// Weights are stored transposed, Wt [out, in] row-major (each output's weights contiguous), the
// layout both the GEMV below and cuBLAS (as a TN product) read. Fused weights interleave where an
// epilogue needs pairs: Wqkv = [Wq | Wk | Wv] by output, W13 = rows (w1 column j, w3 column j).
#pragma once

#include <cellkv/batching/device_sampling.cuh>
#include <cellkv/gpu/kernels/dependent_launch.cuh>
#include <cellkv/gpu/kernels/mma.cuh>
#include <cellkv/gpu/numeric.cuh>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace llama {

namespace kernels {

// x[t] = table[id of token t]: the staged id, or, where from[t] >= 0, the id the previous step
// sampled for its row from[t] (read on the device). Ids are checked on the host; one out of range
// here (never expected) is clamped, so the kernel never reads outside the table.
template <class T>
__global__ void embed(const std::int32_t* tokens, const std::int32_t* from, const cellkv::batching::SampledOut* prev,
                      std::int32_t max_rows, const T* table, T* x, std::int32_t dim, std::int32_t vocab) {
  const std::int32_t f = from[blockIdx.x];
  std::int32_t id = f >= 0 && f < max_rows ? prev[f].token : tokens[blockIdx.x];
  id = id < 0 ? 0 : id >= vocab ? vocab - 1 : id;
  const T* row = table + static_cast<std::int64_t>(id) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) x[static_cast<std::int64_t>(blockIdx.x) * dim + i] = row[i];
}

// The rotation of pair i of a head at position pos: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos),
// angle pos * theta^(-2i / D).
__device__ __forceinline__ void rope_pair(float x0, float x1, float pos, int i, int head_dim, float theta, float& y0,
                                          float& y1) {
  const float a = pos * powf(theta, -2.f * static_cast<float>(i) / static_cast<float>(head_dim));
  float sn = 0.f, cs = 0.f;
  sincosf(a, &sn, &cs);
  y0 = x0 * cs - x1 * sn;
  y1 = x0 * sn + x1 * cs;
}

// One (output pair, row) of the fused Q/K/V projection: columns n, n + 1 (n even) of row b, in
// [q (q_w) | k (kv_w) | v (kv_w)]; q and k rotated, each written to its own [rows, width] buffer.
template <class T>
__device__ __forceinline__ void store_qkv_pair(float y0, float y1, std::int32_t n, std::int32_t b, T* q, T* k, T* v,
                                               const std::int32_t* positions, std::int32_t q_w, std::int32_t kv_w,
                                               std::int32_t head_dim, float theta) {
  T* out = nullptr;
  std::int32_t col = n, width = q_w;
  bool rotate = true;
  if (n < q_w) {
    out = q;
  } else if (n < q_w + kv_w) {
    out = k;
    col = n - q_w;
    width = kv_w;
  } else {
    out = v;
    col = n - q_w - kv_w;
    width = kv_w;
    rotate = false;
  }
  if (rotate)
    rope_pair(y0, y1, static_cast<float>(positions[b]), (col % head_dim) / 2, head_dim, theta, y0, y1);
  out[static_cast<std::int64_t>(b) * width + col] = cellkv::gpu::from_float<T>(y0);
  out[static_cast<std::int64_t>(b) * width + col + 1] = cellkv::gpu::from_float<T>(y1);
}

// Two adjacent elements, read or written as one access (both buffers below hold pairs at even
// offsets of rows of even length).
template <class T>
struct alignas(2 * sizeof(T)) Pair {
  T first, second;
};

// 1 / rms(x_row) = rsqrt(mean(x_row^2) + eps), to every thread of a block of Threads threads (all
// of them must call it). The sum of squares: per thread over its elements, then per warp
// (butterfly), then the warps' sums in warp order, so a row's value does not depend on other rows.
template <int Threads, class T>
__device__ float row_inv_rms(const T* x_row, std::int32_t dim, float eps) {
  __shared__ float warp_sums[Threads / 32];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  float ss = 0.f;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < dim; i += Threads) {
    const float v = cellkv::gpu::to_float(x_row[i]);
    ss += v * v;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) warp_sums[warp] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < Threads / 32; ++w) total += warp_sums[w];
  return rsqrtf(total / static_cast<float>(dim) + eps);
}

// The RMSNorm of a row folded into the product after it: with the gain folded into the weights
// (W' = diag(gain) W, GpuRank::upload_weights), rmsnorm(x) W = (x W') / rms(x), so a kernel that
// reads the product scales each row by 1 / rms(x) and no kernel writes the normalized x.
template <class T>
struct RowNorm {
  const T* x = nullptr;  // [rows, dim], the product's input before normalization
  std::int32_t dim = 0;
  float eps = 0.f;
};

// qkv' [rows, q_w + 2 kv_w] = x W'qkv -> q, k (rotated), v, each row scaled by 1 / rms(x row).
// Grid (ceil(n / 2 / 128), rows), 128 threads: one thread per column pair.
inline constexpr int kRopeThreads = 128;
template <class T>
__global__ void __launch_bounds__(kRopeThreads)
    rope_split(const T* qkv, T* q, T* k, T* v, const std::int32_t* positions, std::int32_t q_w, std::int32_t kv_w,
               std::int32_t head_dim, float theta, RowNorm<T> norm) {
  cellkv::gpu::kernels::allow_dependent_grids();
  cellkv::gpu::kernels::wait_for_prior_grids();
  const std::int32_t n = q_w + 2 * kv_w, row = static_cast<std::int32_t>(blockIdx.y);
  const float inv = row_inv_rms<kRopeThreads>(norm.x + static_cast<std::int64_t>(row) * norm.dim,
                                              norm.dim, norm.eps);
  const std::int32_t c = 2 * static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (c >= n) return;
  const Pair<T> p = reinterpret_cast<const Pair<T>*>(qkv + static_cast<std::int64_t>(row) * n)[c / 2];
  store_qkv_pair(cellkv::gpu::to_float(p.first) * inv, cellkv::gpu::to_float(p.second) * inv, c, row, q, k, v,
                 positions, q_w, kv_w, head_dim, theta);
}

// h13' [rows, 2 ffn] = x W'13 (interleaved); a[r, j] = silu(g) * u with (g, u) = h13'[r, 2j .. 2j + 1]
// / rms(x row), for j < ffn: the SwiGLU of the normalized W13 output. Grid (ceil(ffn / 256), rows),
// 256 threads: one thread per output.
inline constexpr int kSwigluThreads = 256;
template <class T>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_pairs(const T* h13, T* a, std::int32_t ffn, RowNorm<T> norm) {
  cellkv::gpu::kernels::allow_dependent_grids();
  cellkv::gpu::kernels::wait_for_prior_grids();
  const std::int64_t row = blockIdx.y;
  const float inv = row_inv_rms<kSwigluThreads>(norm.x + row * norm.dim, norm.dim, norm.eps);
  const std::int32_t j = static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= ffn) return;
  const Pair<T> p = reinterpret_cast<const Pair<T>*>(h13 + row * 2 * ffn)[j];
  const float g = cellkv::gpu::to_float(p.first) * inv;
  a[row * ffn + j] = cellkv::gpu::from_float<T>(g / (1.f + __expf(-g)) * cellkv::gpu::to_float(p.second) * inv);
}

// y[row] = x[row] / rms(x[row]) * gain; one block of kNormThreads threads per row (row_inv_rms).
inline constexpr int kNormThreads = 256;
template <class T>
__global__ void __launch_bounds__(kNormThreads) rmsnorm(const T* x, const T* gain, T* y, std::int32_t dim, float eps) {
  cellkv::gpu::kernels::allow_dependent_grids();
  cellkv::gpu::kernels::wait_for_prior_grids();
  const std::int64_t base = static_cast<std::int64_t>(blockIdx.x) * dim;
  const float inv = row_inv_rms<kNormThreads>(x + base, dim, eps);
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < dim; i += kNormThreads)
    y[base + i] = cellkv::gpu::from_float<T>(cellkv::gpu::to_float(x[base + i]) * inv * cellkv::gpu::to_float(gain[i]));
}

// s[i] = sum over p of parts[p][i], for i < n, in rank order, accumulating in float; written to
// out[i], or with no out to parts[0..n_parts)[i] (the in-place all-reduce of buffers that share one
// device).
template <class T, int MaxParts>
struct Parts {
  T* p[MaxParts];
};
template <class T, int MaxParts>
__global__ void sum_parts(Parts<T, MaxParts> parts, std::int32_t n_parts, std::int64_t n, T* out = nullptr) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (std::int32_t r = 0; r < n_parts; ++r) s += cellkv::gpu::to_float(parts.p[r][i]);
    if (out != nullptr) {
      out[i] = cellkv::gpu::from_float<T>(s);
    } else {
      for (std::int32_t r = 0; r < n_parts; ++r) parts.p[r][i] = cellkv::gpu::from_float<T>(s);
    }
  }
}
}  // namespace kernels

// ---- the skinny GEMV of narrow steps ----
//
// y[b, n] = sum_k x'[b, k] Wt[n, k] for rows b < B (B <= 16) and outputs n < N, where x' is x, or
// rmsnorm(x) * gain (rounded to T, as the RMSNorm kernel does) when a gain is given. Two kernels,
// one block of 8 warps per group of consecutive outputs, both staging everything a block reads in
// shared memory first (stage): gemv_mma (16-bit T, B >= 4) runs mma.sync on 16 outputs; gemv (fp32,
// or B < 4) runs FFMA on 8 R outputs, each warp keeping R B sums. Either way a row's sums are
// accumulated in the same order whatever B is, so its result does not depend on the rows batched
// with it.
namespace gemv {

inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;

enum class Out : std::uint8_t {
  store,        // y[b, n] (+)= acc, T
  store_float,  // yf[b, n] = acc, float (logits)
  qkv_rope,     // pairs into q, k (rotated), v
  swiglu,       // pairs (w1, w3) -> a[b, n / 2]
};

// Weight rows per warp: several where N is long (W13, the LM head; Q/K/V), so that each row of x
// read from shared memory feeds several weight rows and fewer blocks stage the rows; 1 for the
// N = dim products (Wo, W2), which need their blocks to fill the GPU. Halved from 8 rows of x on
// (fp32), where the B R sums would keep a block per multiprocessor.
template <Out kOut, int B>
inline constexpr int kPerWarp = (kOut == Out::store_float || kOut == Out::swiglu ? 4 : kOut == Out::qkv_rope ? 2 : 1) /
                                (B >= 8 && kOut != Out::store ? 2 : 1);

template <class T>
struct Args {
  const T* x = nullptr;     // [B, k] rows, row stride k
  const T* gain = nullptr;  // [k] RMSNorm gain, or nullptr: x as it is
  float eps = 0.f;
  const T* wt = nullptr;    // [n, k]
  std::int32_t n = 0, k = 0;
  // store / store_float
  T* y = nullptr;
  float* yf = nullptr;
  std::int32_t ld = 0;      // row stride of y / yf
  bool accumulate = false;
  // qkv_rope
  T* q = nullptr;
  T* kk = nullptr;
  T* v = nullptr;
  const std::int32_t* positions = nullptr;
  std::int32_t q_w = 0, kv_w = 0, head_dim = 0;
  float theta = 0.f;
  // swiglu
  T* a = nullptr;
  std::int32_t ffn = 0;
};

template <class T>
inline constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load

template <class T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[kVec<T>]) {  // p: shared memory
  const int4 raw = *reinterpret_cast<const int4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < kVec<T>; ++j) out[j] = cellkv::gpu::to_float(e[j]);
}

// The block's operands in shared memory: rows [0, Rows) of x at stride ld (rows B.. zero, the first
// B normalized in place when kNorm), the gain, and `outputs` weight rows at stride ld (zeros past
// n). Everything is requested as asynchronous copies: the weights and the gain first, before the
// wait for the kernel before this one (a dependent launch, cellkv/gpu/kernels/dependent_launch.cuh:
// they do not depend on it, so their fetch overlaps its end), then the rows of x. Returns once
// every copy landed, after a block barrier.
template <class T>
struct Staged {
  T* xs;  // [Rows, ld]
  T* ws;  // [outputs, ld]
};

template <class T, int B, int Rows, bool kNorm>
__device__ Staged<T> stage(const Args<T>& a, int4* smem, std::int32_t ld, int outputs) {
  namespace ck = cellkv::gpu::kernels;
  __shared__ float inv_rms[B];
  const std::int32_t k = a.k, n0 = static_cast<std::int32_t>(blockIdx.x) * outputs;
  T* xs = reinterpret_cast<T*>(smem);
  T* gs = xs + Rows * ld;
  T* ws = gs + ld;
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x) * kVec<T>; i < outputs * k; i += kThreads * kVec<T>) {
    const std::int32_t n = n0 + i / k;
    const T* src = a.wt + (n < a.n ? static_cast<std::int64_t>(n) * k + i % k : 0);
    ck::cp_async_16(ck::smem_addr(ws + (i / k) * ld + i % k), src, n < a.n);
  }
  if constexpr (kNorm)
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x) * kVec<T>; i < k; i += kThreads * kVec<T>)
      ck::cp_async_16(ck::smem_addr(gs + i), a.gain + i);
  ck::cp_async_commit();
  ck::wait_for_prior_grids();  // x is the kernel before's output
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x) * kVec<T>; i < Rows * k; i += kThreads * kVec<T>) {
    const std::int32_t b = i / k;
    ck::cp_async_16(ck::smem_addr(xs + b * ld + i % k), a.x + (b < B ? i : 0), b < B);
  }
  ck::cp_async_commit();
  if constexpr (kNorm) {
    ck::cp_async_wait<0>();
    __syncthreads();
    for (int b = warp; b < B; b += kWarps) {
      const T* row = xs + b * ld;
      float ss = 0.f;
      for (std::int32_t i = lane; i < k; i += 32) ss += cellkv::gpu::to_float(row[i]) * cellkv::gpu::to_float(row[i]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) inv_rms[b] = rsqrtf(ss / static_cast<float>(k) + a.eps);
    }
    __syncthreads();
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x) * kVec<T>; i < B * k; i += kThreads * kVec<T>) {
      const std::int32_t b = i / k, c = i % k;
      float v[kVec<T>], g[kVec<T>];
      load_vec(xs + b * ld + c, v);
      load_vec(gs + c, g);
      alignas(16) T out[kVec<T>];
#pragma unroll
      for (int j = 0; j < kVec<T>; ++j) out[j] = cellkv::gpu::from_float<T>(v[j] * inv_rms[b] * g[j]);
      *reinterpret_cast<int4*>(xs + b * ld + c) = *reinterpret_cast<const int4*>(out);
    }
  }
  ck::cp_async_wait<0>();
  __syncthreads();
  return {xs, ws};
}

// The epilogue: outputs [n0, n0 + kOutputs) of rows b < B from tile[o][b] (any row width W >= B),
// stored, stored as float, rotated into q/k/v, or through SwiGLU.
template <class T, int B, Out kOut, int kOutputs, int W>
__device__ void write_outputs(const Args<T>& a, const float (&tile)[kOutputs][W], std::int32_t n0) {
  if constexpr (kOut == Out::store || kOut == Out::store_float) {
    for (int t = static_cast<int>(threadIdx.x); t < kOutputs * B; t += kThreads) {
      const int o = t % kOutputs, b = t / kOutputs;
      const std::int32_t nn = n0 + o;
      if (nn >= a.n) continue;
      const std::int64_t at = static_cast<std::int64_t>(b) * a.ld + nn;
      if constexpr (kOut == Out::store_float) {
        a.yf[at] = tile[o][b];
      } else {
        const float base = a.accumulate ? cellkv::gpu::to_float(a.y[at]) : 0.f;
        a.y[at] = cellkv::gpu::from_float<T>(base + tile[o][b]);
      }
    }
  } else {
    for (int t = static_cast<int>(threadIdx.x); t < (kOutputs / 2) * B; t += kThreads) {
      const int p = t % (kOutputs / 2), b = t / (kOutputs / 2);
      const std::int32_t nn = n0 + 2 * p;
      if (nn >= a.n) continue;  // n is even: a pair never straddles the end
      const float y0 = tile[2 * p][b], y1 = tile[2 * p + 1][b];
      if constexpr (kOut == Out::qkv_rope) {
        kernels::store_qkv_pair(y0, y1, nn, b, a.q, a.kk, a.v, a.positions, a.q_w, a.kv_w, a.head_dim, a.theta);
      } else {
        a.a[static_cast<std::int64_t>(b) * a.ffn + nn / 2] = cellkv::gpu::from_float<T>(y0 / (1.f + __expf(-y0)) * y1);
      }
    }
  }
}

template <class T, int B, Out kOut, bool kNorm>
__global__ void __launch_bounds__(kThreads, 2) gemv(Args<T> a) {
  cellkv::gpu::kernels::allow_dependent_grids();
  constexpr int R = kPerWarp<kOut, B>;
  constexpr int kOutputs = kWarps * R;  // outputs per block; warp w has outputs w, w + 8, ...
  extern __shared__ int4 gemv_smem[];
  const Staged<T> st = stage<T, B, B, kNorm>(a, gemv_smem, a.k, kOutputs);
  const T* xs = st.xs;
  const T* ws = st.ws;
  __shared__ float tile[kOutputs][B];
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const std::int32_t k = a.k;
  const std::int32_t n0 = static_cast<std::int32_t>(blockIdx.x) * kOutputs;
  float acc[R][B];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.f;
#pragma unroll 2
  for (std::int32_t c = lane * kVec<T>; c < k; c += 32 * kVec<T>) {
    float wv[R][kVec<T>];
#pragma unroll
    for (int r = 0; r < R; ++r) load_vec(ws + static_cast<std::int64_t>(warp + r * kWarps) * k + c, wv[r]);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float xv[kVec<T>];
      load_vec(xs + b * k + c, xv);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < kVec<T>; ++j) acc[r][b] = fmaf(xv[j], wv[r][j], acc[r][b]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][b] += __shfl_xor_sync(0xffffffffu, acc[r][b], o);
    }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < B; ++b) tile[warp + r * kWarps][b] = acc[r][b];
  }
  __syncthreads();
  write_outputs<T, B, kOut, kOutputs>(a, tile, n0);
}

// The tensor-core GEMV (16-bit T): one block of 8 warps computes 16 consecutive outputs for all B
// rows with mma.sync m16n8k16, A the 16 weight rows and B the rows of x (padded with zero rows to a
// multiple of 8), both staged in shared memory at a stride of k + 8 elements (conflict-free
// ldmatrix). Warp w takes the k steps w, w + 8, ... of 16; the warps' sums are added in warp order.
// Each row's result depends on its own x only, not on the rows batched with it.
inline constexpr int kMmaOutputs = 16;
template <int B>
inline constexpr int kMmaRows = B < 8 ? 8 : B;

__device__ __forceinline__ void ldmatrix_x2(std::uint32_t& r0, std::uint32_t& r1, std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

template <class T, int B, Out kOut, bool kNorm>
__global__ void __launch_bounds__(kThreads) gemv_mma(Args<T> a) {
  namespace ck = cellkv::gpu::kernels;
  ck::allow_dependent_grids();
  constexpr int kRows = kMmaRows<B>, kTiles = kRows / 8;
  extern __shared__ int4 gemv_smem[];
  const std::int32_t k = a.k, ld = k + 8;
  const Staged<T> st = stage<T, B, kRows, kNorm>(a, gemv_smem, ld, kMmaOutputs);
  __shared__ float tile[kMmaOutputs][kRows];
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int g = lane / 4, q = lane % 4, m = lane / 8, r8 = lane % 8;
  // ldmatrix row addresses: A x4 (rows r8 + 8 (m % 2), k + 8 (m / 2)); B x2 (row r8, k + 8 (m % 2)).
  const std::uint32_t a_row = ck::smem_addr(st.ws + (r8 + 8 * (m & 1)) * ld + 8 * (m >> 1));
  const std::uint32_t b_row = ck::smem_addr(st.xs + r8 * ld + 8 * (m & 1));
  float acc[kTiles][4] = {};
  for (std::int32_t step = warp; step < k / 16; step += kWarps) {
    std::uint32_t af[4];
    ck::ldmatrix_x4(af, a_row + static_cast<std::uint32_t>(step) * 32);
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      std::uint32_t b0, b1;
      ldmatrix_x2(b0, b1, b_row + static_cast<std::uint32_t>(j * 8 * ld * 2 + step * 32));
      ck::mma_16816<T>(acc[j], af, b0, b1);
    }
  }
  // The warps' sums [warp][output][row] reuse the staged operands once every warp is past them
  // (the launch sizes the dynamic shared memory for both), so the static shared memory stays small
  // enough for three blocks of W13's shape per multiprocessor (one wave at 16 rows).
  auto* part = reinterpret_cast<float(*)[kMmaOutputs][kRows]>(gemv_smem);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    part[warp][g][8 * j + 2 * q] = acc[j][0];
    part[warp][g][8 * j + 2 * q + 1] = acc[j][1];
    part[warp][g + 8][8 * j + 2 * q] = acc[j][2];
    part[warp][g + 8][8 * j + 2 * q + 1] = acc[j][3];
  }
  __syncthreads();
  for (int t = static_cast<int>(threadIdx.x); t < kMmaOutputs * kRows; t += kThreads) {
    const int o = t / kRows, b = t % kRows;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += part[w][o][b];
    tile[o][b] = sum;
  }
  __syncthreads();
  write_outputs<T, B, kOut, kMmaOutputs>(a, tile, static_cast<std::int32_t>(blockIdx.x) * kMmaOutputs);
}

// The tensor-core kernel serves 16-bit elements from 4 rows on (below, it would pad the rows to 8
// and run more blocks than the FFMA kernel, which measured faster there); fp32 runs the FFMA kernel.
template <class T>
constexpr bool tensor_cores(int rows) {
  return sizeof(T) == 2 && rows >= 4;
}

// Dynamic shared memory of `rows` staged rows, the gain and `weight_rows` weight rows, at stride ld.
template <class T>
constexpr std::size_t smem_bytes(int rows, std::int32_t ld, int weight_rows) {
  return static_cast<std::size_t>(rows + 1 + weight_rows) * static_cast<std::size_t>(ld) * sizeof(T);
}

// Dynamic shared memory of a launch for B rows of length k (ffma_weight_rows: 8 kPerWarp).
template <class T>
constexpr std::size_t launch_smem_bytes(int rows, std::int32_t k, int ffma_weight_rows) {
  if (tensor_cores<T>(rows))  // the staged operands, then the warps' sums over them
    return std::max(smem_bytes<T>(rows < 8 ? 8 : rows, k + 8, kMmaOutputs),
                    static_cast<std::size_t>(kWarps * kMmaOutputs * (rows < 8 ? 8 : rows)) * sizeof(float));
  return smem_bytes<T>(rows, k, ffma_weight_rows);
}

// Whether the GEMV serves k for `rows` rows with `weight_rows` weight rows per block of the FFMA
// kernel (8 kPerWarp) within `limit` bytes of shared memory (12 KB left for static memory).
template <class T>
constexpr bool fits(int rows, std::int32_t k, int limit, int weight_rows) {
  return k % 16 == 0 && launch_smem_bytes<T>(rows, k, weight_rows) + 12288 <= static_cast<std::size_t>(limit);
}

// dependent: a dependent launch (cellkv/gpu/kernels/dependent_launch.cuh), which fetches the block's
// weights while the kernel before it still runs.
template <class T, int B, Out kOut, bool kNorm>
cudaError_t launch_rows(const Args<T>& a, bool dependent, cudaStream_t stream) {
  constexpr int kOutputs = tensor_cores<T>(B) ? kMmaOutputs : kWarps * kPerWarp<kOut, B>;
  const std::size_t bytes = launch_smem_bytes<T>(B, a.k, kWarps * kPerWarp<kOut, B>);
  auto* kernel = [] {
    if constexpr (tensor_cores<T>(B)) return gemv_mma<T, B, kOut, kNorm>;
    else return gemv<T, B, kOut, kNorm>;
  }();
  // Always raised: the 48 KB default covers the static shared memory too.
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  const unsigned blocks = static_cast<unsigned>((a.n + kOutputs - 1) / kOutputs);
  return cellkv::gpu::launch_dependent(dependent, kernel, blocks, kThreads, bytes, stream, a);
}

// Launches the GEMV for `rows` rows (1, 2, 4, 8 or 16; rows past the step's are padding).
template <class T, Out kOut, bool kNorm>
cudaError_t launch(const Args<T>& a, int rows, bool dependent, cudaStream_t stream) {
  switch (rows) {
    case 1: return launch_rows<T, 1, kOut, kNorm>(a, dependent, stream);
    case 2: return launch_rows<T, 2, kOut, kNorm>(a, dependent, stream);
    case 4: return launch_rows<T, 4, kOut, kNorm>(a, dependent, stream);
    case 8: return launch_rows<T, 8, kOut, kNorm>(a, dependent, stream);
    case 16: return launch_rows<T, 16, kOut, kNorm>(a, dependent, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace gemv

}  // namespace llama
