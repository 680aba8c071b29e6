// cellkv/batching/device_sampling.cuh - the sampling rule of sampling.hpp on the device: one block
// per sampled row, the same token as sample_row() for bitwise identical logits.
//
//   cellkv::batching::SamplerView v{logits, vocab, vocab, d_count, d_rows, d_params, d_out};
//   cellkv::batching::launch_sampler(v, max_rows, stream);   // capturable: the grid is max_rows
//
// The number of rows to sample is read on the device (*count), so one launch captured in a CUDA
// graph serves every later step; blocks past *count exit at once. For each sampled row j: the
// logits l = logits + rows[j] * stride, its SampleRow params[j], and out[j] = {token, log-prob}.
//
// How a row is sampled (512 threads): one pass finds the largest logit and its lowest index
// (greedy rows stop there). A sampling row computes each candidate's order key and integer mass
// once (kept in shared memory when 8 * vocab bytes fit, else recomputed from global memory), then
// finds the top-k and top-p thresholds by binary search on the key (a block-wide count or mass sum
// per probe; ties resolved by a second search on the index), and draws by a block-wide scan of the
// kept masses over contiguous index ranges, one per thread, in ascending index order. Integer sums
// are exact in any order, so the order of the reductions does not change the result.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "cellkv/batching/philox.hpp"
#include "cellkv/batching/sampling.hpp"
#include "cellkv/gpu/error.hpp"
#include "cellkv/status.hpp"

namespace cellkv::batching {

// One sampled row's result.
struct SampledOut {
  std::int32_t token;
  float logprob;  // log softmax of the raw logits at token, when the row asked; else 0
};

// What the sampler reads and writes; trivially copyable, device pointers.
struct SamplerView {
  const float* logits = nullptr;        // [rows of the forward, stride]
  std::int64_t stride = 0;              // floats between two logit rows
  std::int32_t vocab = 0;               // logits per row
  const std::int32_t* count = nullptr;  // [1] R: rows to sample
  const std::int32_t* rows = nullptr;   // [R] logit row of each sample
  const SampleRow* params = nullptr;    // [R]
  SampledOut* out = nullptr;            // [R]
};

struct SamplerOptions {
  bool cache_in_shared = true;  // false: recompute keys and masses from global memory (tests)
};

namespace kernels {

inline constexpr int kSamplerThreads = 512;
inline constexpr int kSamplerWarps = kSamplerThreads / 32;

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of v over the block, in every thread. `scratch` holds kSamplerWarps values.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  T total = 0;
#pragma unroll
  for (int w = 0; w < kSamplerWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// The sum of v over the threads before this one (block-wide exclusive scan, thread order).
__device__ __forceinline__ std::uint64_t block_exclusive_sum(std::uint64_t v, std::uint64_t* scratch) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  std::uint64_t inclusive = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const std::uint64_t up = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  std::uint64_t before = 0;
  for (int w = 0; w < warp; ++w) before += scratch[w];
  __syncthreads();
  return before + inclusive - v;
}

// Largest key with the lowest index on a tie, in every thread.
__device__ __forceinline__ void block_argmax(std::uint32_t& key, std::int32_t& index, std::uint32_t* keys,
                                             std::int32_t* indices) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const std::uint32_t k = __shfl_xor_sync(0xffffffffu, key, o);
    const std::int32_t i = __shfl_xor_sync(0xffffffffu, index, o);
    if (k > key || (k == key && i < index)) {
      key = k;
      index = i;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    keys[threadIdx.x >> 5] = key;
    indices[threadIdx.x >> 5] = index;
  }
  __syncthreads();
  key = keys[0];
  index = indices[0];
  for (int w = 1; w < kSamplerWarps; ++w)
    if (keys[w] > key || (keys[w] == key && indices[w] < index)) {
      key = keys[w];
      index = indices[w];
    }
  __syncthreads();
}

// A row's candidates: order key and integer mass of each logit, cached or recomputed.
struct RowCandidates {
  const float* logits;
  const std::uint32_t* keys;    // shared memory, or nullptr
  const std::uint32_t* masses;  // shared memory, or nullptr
  float lmax;
  float inv_temperature;
  __device__ __forceinline__ std::uint32_t key(std::int32_t i) const {
    return keys != nullptr ? keys[i] : sampling::order_key(logits[i]);
  }
  __device__ __forceinline__ std::uint32_t mass(std::int32_t i) const {
    return masses != nullptr ? masses[i] : sampling::mass_of(logits[i], lmax, inv_temperature);
  }
};

struct SamplerShared {
  std::uint64_t u64[kSamplerWarps];
  std::uint32_t u32[kSamplerWarps];
  std::int32_t i32[kSamplerWarps];
  float f32[kSamplerWarps];
  std::int32_t token;
};

// Candidates with key >= v (and rank key >= bound), counted.
__device__ __forceinline__ std::uint32_t count_at_least(const RowCandidates& c, std::int32_t n, std::uint32_t v,
                                                        SamplerShared& sh) {
  std::uint32_t k = 0;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += kSamplerThreads) k += c.key(i) >= v;
  return block_sum(k, sh.u32);
}

// The mass of the candidates with key >= v and rank key >= bound.
__device__ __forceinline__ std::uint64_t mass_at_least(const RowCandidates& c, std::int32_t n, std::uint32_t v,
                                                       std::uint64_t bound, SamplerShared& sh) {
  std::uint64_t m = 0;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += kSamplerThreads) {
    const std::uint32_t k = c.key(i);
    if (k >= v && sampling::rank_key(k, i) >= bound) m += c.mass(i);
  }
  return block_sum(m, sh.u64);
}

// The rank key of the top_k-th candidate (0 < top_k < n).
__device__ inline std::uint64_t top_k_bound(const RowCandidates& c, std::int32_t n, std::uint32_t kmax, std::int32_t top_k,
                                     SamplerShared& sh) {
  const auto want = static_cast<std::uint32_t>(top_k);
  std::uint64_t lo = 0, hi = kmax;  // largest v with count(key >= v) >= top_k
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo + 1) / 2;
    if (count_at_least(c, n, static_cast<std::uint32_t>(mid), sh) >= want) lo = mid;
    else hi = mid - 1;
  }
  const auto v = static_cast<std::uint32_t>(lo);
  const std::uint32_t above = v == 0xffffffffu ? 0u : count_at_least(c, n, v + 1, sh);
  const std::uint32_t need = want - above;  // >= 1 candidates of key v, lowest indices first
  std::uint32_t ties = 0;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += kSamplerThreads) ties += c.key(i) == v;
  ties = block_sum(ties, sh.u32);
  if (ties == need) return static_cast<std::uint64_t>(v) << 32;
  std::int32_t a = 0, b = n - 1;  // smallest j with count(key == v, i <= j) >= need
  while (a < b) {
    const std::int32_t mid = a + (b - a) / 2;
    std::uint32_t k = 0;
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i <= mid; i += kSamplerThreads) k += c.key(i) == v;
    if (block_sum(k, sh.u32) >= need) b = mid;
    else a = mid + 1;
  }
  return sampling::rank_key(v, a);
}

// The rank key of the first candidate, in rank order among those >= bound, at which the running
// mass reaches target (<= the mass of the candidates >= bound).
__device__ inline std::uint64_t top_p_bound(const RowCandidates& c, std::int32_t n, std::uint32_t kmax, std::uint64_t bound,
                                     std::uint64_t target, SamplerShared& sh) {
  std::uint64_t lo = bound >> 32, hi = kmax;  // largest v with mass(key >= v) >= target
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo + 1) / 2;
    if (mass_at_least(c, n, static_cast<std::uint32_t>(mid), bound, sh) >= target) lo = mid;
    else hi = mid - 1;
  }
  const auto v = static_cast<std::uint32_t>(lo);
  const std::uint64_t above = v == 0xffffffffu ? 0u : mass_at_least(c, n, v + 1, bound, sh);
  std::uint32_t ties = 0;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += kSamplerThreads) {
    const std::uint32_t k = c.key(i);
    ties += k == v && sampling::rank_key(k, i) >= bound;
  }
  ties = block_sum(ties, sh.u32);
  if (ties == 1) return static_cast<std::uint64_t>(v) << 32;
  std::int32_t a = 0, b = n - 1;  // smallest j with above + mass(key == v, >= bound, i <= j) >= target
  while (a < b) {
    const std::int32_t mid = a + (b - a) / 2;
    std::uint64_t m = 0;
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i <= mid; i += kSamplerThreads) {
      const std::uint32_t k = c.key(i);
      if (k == v && sampling::rank_key(k, i) >= bound) m += c.mass(i);
    }
    if (above + block_sum(m, sh.u64) >= target) b = mid;
    else a = mid + 1;
  }
  return sampling::rank_key(v, a);
}

// One block per sampled row (see the file comment). Dynamic shared memory: 8 * vocab bytes when
// cached, else none.
template <bool kCached>
__global__ void __launch_bounds__(kSamplerThreads) sample_rows(SamplerView v) {
  const auto j = static_cast<std::int32_t>(blockIdx.x);
  if (j >= *v.count) return;
  extern __shared__ std::uint32_t cached[];
  __shared__ SamplerShared sh;
  const std::int32_t n = v.vocab;
  const float* l = v.logits + static_cast<std::int64_t>(v.rows[j]) * v.stride;
  const SampleRow p = v.params[j];

  std::uint32_t kmax = 0;
  std::int32_t imax = 0x7fffffff;
  for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += kSamplerThreads) {
    const std::uint32_t k = sampling::order_key(l[i]);
    if constexpr (kCached) cached[i] = k;
    if (k > kmax || (k == kmax && i < imax) || imax == 0x7fffffff) {
      kmax = k;
      imax = i;
    }
  }
  block_argmax(kmax, imax, sh.u32, sh.i32);
  const float lmax = l[imax];
  std::int32_t token = imax;
  if (!sampling::greedy(p, lmax)) {
    if constexpr (kCached)
      for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += kSamplerThreads)
        cached[n + i] = sampling::mass_of(l[i], lmax, p.inv_temperature);
    __syncthreads();
    const RowCandidates c{l, kCached ? cached : nullptr, kCached ? cached + n : nullptr, lmax, p.inv_temperature};
    std::uint64_t bound = 0;
    if (p.top_k > 0 && p.top_k < n) bound = top_k_bound(c, n, kmax, p.top_k, sh);
    if (p.top_p < 1.f) {
      const std::uint64_t w_k = mass_at_least(c, n, 0u, bound, sh);
      const std::uint64_t b = top_p_bound(c, n, kmax, bound, sampling::top_p_target(p.top_p, w_k), sh);
      bound = b > bound ? b : bound;
    }
    if (p.min_p_offset > -std::numeric_limits<float>::infinity()) {
      const std::uint64_t b = sampling::min_p_bound(lmax, p.min_p_offset);
      bound = b > bound ? b : bound;
    }
    const std::uint64_t kept = mass_at_least(c, n, 0u, bound, sh);
    const std::uint64_t target = sampling::scale_draw(kept, philox_draw(p.seed, p.counter));
    const std::int32_t chunk = (n + kSamplerThreads - 1) / kSamplerThreads;
    const std::int32_t begin = static_cast<std::int32_t>(threadIdx.x) * chunk;
    const std::int32_t end = begin + chunk < n ? begin + chunk : n;
    if (threadIdx.x == 0) sh.token = imax;  // read after the scan's barriers
    std::uint64_t mine = 0;
    for (std::int32_t i = begin; i < end; ++i)
      if (sampling::rank_key(c.key(i), i) >= bound) mine += c.mass(i);
    const std::uint64_t before = block_exclusive_sum(mine, sh.u64);
    if (before <= target && target < before + mine) {
      std::uint64_t run = before;
      for (std::int32_t i = begin; i < end; ++i) {
        if (sampling::rank_key(c.key(i), i) < bound) continue;
        run += c.mass(i);
        if (run > target) {
          sh.token = i;
          break;
        }
      }
    }
    __syncthreads();
    token = sh.token;
  }
  float logprob = 0.f;
  if ((p.flags & kWantLogprob) != 0u) {
    float s = 0.f;
    for (std::int32_t i = static_cast<std::int32_t>(threadIdx.x); i < n; i += kSamplerThreads) s += expf(l[i] - lmax);
    s = block_sum(s, sh.f32);
    logprob = l[token] - lmax - logf(s);
  }
  if (threadIdx.x == 0) v.out[j] = {token, logprob};
}

}  // namespace kernels

namespace detail {
// The opt-in shared-memory limit of one block on the current device, in bytes.
inline Status shared_memory_limit(int& limit) {
  int device = 0;
  CELLKV_CUDA_STATUS(cudaGetDevice(&device));
  CELLKV_CUDA_STATUS(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return {};
}
}  // namespace detail

// Whether the sampler keeps a row's keys and masses in shared memory for this vocabulary on the
// current device.
inline Result<bool> sampler_caches(std::int32_t vocab, SamplerOptions options = {}) {
  if (!options.cache_in_shared) return false;
  int limit = 0;
  if (const Status s = detail::shared_memory_limit(limit); !s.ok()) return s.code();
  return 8 * static_cast<std::int64_t>(vocab) + static_cast<std::int64_t>(sizeof(kernels::SamplerShared)) <= limit;
}

// Samples rows [0, *v.count) of v into v.out, one block each, on `stream`; max_rows (>= *count) is
// the grid. Refuses bad_argument for an empty vocabulary or max_rows < 1.
inline Status launch_sampler(const SamplerView& v, std::int32_t max_rows, ::cuda::stream_ref stream,
                             SamplerOptions options = {}) {
  if (v.vocab < 1 || max_rows < 1 || v.stride < v.vocab) return Errc::bad_argument;
  const Result<bool> cache = sampler_caches(v.vocab, options);
  if (!cache.ok()) return cache.status();
  if (cache.value()) {
    const auto bytes = static_cast<std::size_t>(8) * static_cast<std::size_t>(v.vocab);
    CELLKV_CUDA_STATUS(cudaFuncSetAttribute(kernels::sample_rows<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(bytes)));
    kernels::sample_rows<true><<<static_cast<unsigned>(max_rows), kernels::kSamplerThreads, bytes, stream.get()>>>(v);
  } else {
    kernels::sample_rows<false><<<static_cast<unsigned>(max_rows), kernels::kSamplerThreads, 0, stream.get()>>>(v);
  }
  CELLKV_CUDA_STATUS(cudaGetLastError());
  return {};
}

}  // namespace cellkv::batching
