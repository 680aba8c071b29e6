// cellkv/gpu/kernels/shared_finish.cuh - the decode tokens the shared-prefix kernel finishes itself
// (finished tokens, prefix_sharing.hpp): their few own positions, and once every item of the step
// is done, the fold of all their slots into their outputs. A step of forks decoding one token each
// is then one kernel, not the shared-prefix kernel and then the decode kernel.
//
// A warp takes one (finished token, query head) row at a time; lane l holds columns
// [l N, l N + N), N = D / 32.
//   own_part     before the block's items: the token's own positions [max(own_begin,
//                visible_begin(W, pos)), pos] (at most kMaxFinishOwn: one lane reads each one's row
//                id; holes skipped), scored in fp32 from the pool's rows; the normalized output and
//                the log2-sum-exp of its scores go to the token's last slot. Rows are dealt out by
//                the warp's index in the grid.
//   finish_rows  after the block's items: the block arrives at the launch's count. A block that
//                sees every block of the grid arrive within kFinishWaitNs, and the last block to
//                arrive, then claim rows one at a time from the launch's claim counter and fold
//                each row's slots (shared_fold.cuh) into its output. A block that waits longer
//                leaves: the finish needs no block to be resident beside another (no deadlock
//                when other work holds SMs), it is only fastest when they all are.
// The counters (FinishSync) live across launches of one kernel instance's grid: `arrivals` grows by
// the grid size in each launch that has finished tokens (launch generation g = arrivals / grid), the
// claim counter of generation g is claims[g % 2], and the last block of generation g zeroes
// claims[(g + 1) % 2] for the next (launches on one stream never overlap there: each waits for the
// one before it). Ordering: each block's partial stores, then a barrier of its consumer threads,
// then one thread's acq_rel arrival; readers acquire the count before they read the partials.
#pragma once

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cellkv/gpu/kernels/layer_args.cuh"
#include "cellkv/gpu/kernels/mma.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/prefix_sharing.hpp"
#include "cellkv/visibility.hpp"

namespace cellkv::gpu::kernels {

// Device counters of the finish, zero at first (TableAttention owns them).
struct FinishSync {
  unsigned long long* arrivals = nullptr;  // [1]
  unsigned long long* claims = nullptr;    // [2]
};

inline constexpr unsigned long long kFinishWaitNs = 200000;  // how long an early block waits for the grid
// Finished rows a block of the grid takes at most (SharingShape::finish_rows): two per consumer
// warp. Measured on the H200 (bf16, H_q 32, D 128, 132 blocks): 64 forks (2,048 rows) finished in
// one kernel took 0.0268 ms for the step, 128 forks (4,096 rows) 0.0435 ms, slower than the
// shared-prefix kernel and then the decode kernel (0.0411 ms).
inline constexpr int kFinishRowsPerBlock = 2 * 8;

using DeviceCounter = ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device>;

// Named barrier `barrier` of `threads` threads that also tells each of them whether `pred` held in
// any of them (bar.red.or).
__device__ __forceinline__ bool named_barrier_any(int barrier, int threads, bool pred) {
  std::uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<std::uint32_t>(pred)), "r"(barrier), "r"(threads)
      : "memory");
  return any != 0;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// N consecutive elements of T at p (N = 2 or 4; p aligned to N elements) as floats.
template <int N, class T>
__device__ __forceinline__ void load_row_part(const T* p, float (&x)[N]) {
  static_assert(sizeof(T) == 2 && (N == 2 || N == 4));
  using Raw = std::conditional_t<N == 4, uint2, std::uint32_t>;
  const Raw raw = __ldg(reinterpret_cast<const Raw*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = to_float(e[i]);
}
template <int N, class T>
__device__ __forceinline__ void store_row_part(T* p, const float (&x)[N]) {
  if constexpr (N == 4) *reinterpret_cast<uint2*>(p) = make_uint2(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]));
  else *reinterpret_cast<std::uint32_t*>(p) = pack2<T>(x[0], x[1]);
}

// The own part of finished token f, query head `head`, into its last slot (one warp; every lane).
// Rows: TableRows. partial_o / partial_lse: the shared slots, [slots][H_q][D] and [slots][H_q].
template <int D, class T, class Rows, class S>
__device__ void own_part(const LayerArgs<T, Rows, S>& a, const FinishedToken& f, int head, float* partial_o,
                         float* partial_lse, int lane) {
  constexpr int N = D / 32, kBatch = 8;
  const int hk = head / (a.heads_q / a.pool.heads_kv);
  const int lo = max(f.own_begin, visible_begin(a.window, f.pos));
  const int count = f.pos - lo + 1;  // in [1, kMaxFinishOwn]: the planner's bound
  const int id = lane < count ? a.rows.row(a.rows.tile(f.seq, lo + lane), 0) : -1;
  float q[N];
  load_row_part<N>(a.q + (static_cast<std::int64_t>(f.token) * a.heads_q + head) * D + lane * N, q);
  float top = -INFINITY, sum = 0.f, o[N] = {};
  for (int j0 = 0; j0 < count; j0 += kBatch) {
    int ids[kBatch];
    float k[kBatch][N], v[kBatch][N];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {  // every load of the batch in flight together
      ids[b] = __shfl_sync(0xffffffffu, id, (j0 + b) & 31);
      if (j0 + b >= count) ids[b] = -1;
      const std::int64_t at = a.pool.offset(ids[b] < 0 ? 0 : ids[b], hk) + lane * N;
      if (ids[b] >= 0) load_row_part<N>(a.pool.k + at, k[b]), load_row_part<N>(a.pool.v + at, v[b]);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (ids[b] < 0) continue;  // warp-uniform
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) dot = fmaf(q[i], k[b][i], dot);
      const float x = warp_sum(dot) * a.scale_log2;
      const float m = fmaxf(top, x);
      const float keep = fast_exp2(top - m), w = fast_exp2(x - m);
      sum = sum * keep + w;
#pragma unroll
      for (int i = 0; i < N; ++i) o[i] = fmaf(o[i], keep, w * v[b][i]);
      top = m;
    }
  }
  const SlotRange slots = a.shared.token_slots[f.token];
  const std::int64_t row = static_cast<std::int64_t>(slots.first + slots.count - 1) * a.heads_q + head;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
  for (int i = 0; i < N; i += 2)
    *reinterpret_cast<float2*>(partial_o + row * D + lane * N + i) = make_float2(o[i] * inv, o[i + 1] * inv);
  if (lane == 0) partial_lse[row] = sum > 0.f ? top + log2f(sum) : -INFINITY;
}

// Row r of the finished rows (token r / H_q, head r % H_q): every slot folded, the output stored.
template <int D, class T, class Rows, class S>
__device__ void finish_row(const LayerArgs<T, Rows, S>& a, const FinishedToken& f, int head, int lane) {
  constexpr int N = D / 32;
  float v[N] = {};
  a.shared.template fold<D, N, 16, N>(f.token, head, a.heads_q, -INFINITY, [&](int j) { return lane * N + j; },
                                      [&](int j) -> float& { return v[j]; });
  store_row_part<N>(a.out + (static_cast<std::int64_t>(f.token) * a.heads_q + head) * D + lane * N, v);
}

// The own parts of the finished rows dealt to global warp `warp` of `warps`.
template <int D, class T, class Rows, class S>
__device__ void own_parts(const LayerArgs<T, Rows, S>& a, const FinishedToken* finished, int count, float* partial_o,
                          float* partial_lse, int warp, int warps, int lane) {
  const int rows = count * a.heads_q;
  for (int r = warp; r < rows; r += warps) own_part<D>(a, finished[r / a.heads_q], r % a.heads_q, partial_o, partial_lse, lane);
}

// After the block's items, by its `threads` threads that computed them (named barrier `barrier`):
// the arrival, then the claimed rows folded into the outputs (see the top of this file).
template <int D, class T, class Rows, class S>
__device__ void finish_rows(const LayerArgs<T, Rows, S>& a, const FinishedToken* finished, int count, FinishSync sync,
                            int barrier, int threads, int thread) {
  asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(threads) : "memory");  // every thread's partials stored
  bool all = false;  // thread 0: every block arrived (or this one is the last)
  bool odd = false;  // thread 0: the generation's claim counter is claims[1]
  if (thread == 0) {
    const unsigned long long grid = gridDim.x;
    DeviceCounter arrivals(*sync.arrivals);
    const unsigned long long ticket = arrivals.fetch_add(1, ::cuda::memory_order_acq_rel);
    const unsigned long long generation = ticket / grid, target = (generation + 1) * grid;
    all = ticket + 1 == target;
    if (all) DeviceCounter(sync.claims[(generation + 1) % 2]).store(0, ::cuda::memory_order_relaxed);
    const unsigned long long until = global_ns() + kFinishWaitNs;
    while (!all && global_ns() < until) all = arrivals.load(::cuda::memory_order_acquire) >= target;
    odd = generation % 2 == 1;
  }
  // Thread 0's answers to every thread, through the barrier's own reduction (no shared memory).
  if (!named_barrier_any(barrier, threads, all)) return;
  DeviceCounter claims(sync.claims[named_barrier_any(barrier, threads, odd) ? 1 : 0]);
  const int lane = thread % 32;
  const unsigned long long rows = static_cast<unsigned long long>(count) * a.heads_q;
  for (;;) {
    unsigned long long r = 0;
    if (lane == 0) r = claims.fetch_add(1, ::cuda::memory_order_relaxed);
    r = __shfl_sync(0xffffffffu, r, 0);
    if (r >= rows) return;
    const int row = static_cast<int>(r);
    finish_row<D>(a, finished[row / a.heads_q], row % a.heads_q, lane);
  }
}

}  // namespace cellkv::gpu::kernels
