// cellkv/gpu/kernels/shared_fold.cuh - how the kernels that read a segment's own positions meet
// the shared-prefix partials (prefix_sharing.hpp): where the segment's own positions begin, and
// the log-sum-exp fold of a token's partial slots into its output.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cellkv/prefix_sharing.hpp"

namespace cellkv::gpu::kernels {

// Shared-prefix results of the current layer, written by the shared-prefix kernel
// (shared_prefix_attention or shared_prefix_wgmma) before the consumer kernels run. All null when
// the cache does not share (sequence layout).
struct SharedFold {
  const std::int32_t* own_begin = nullptr;  // [segments] first position a segment reads itself
  const SlotRange* token_slots = nullptr;   // [T] each token's partial slots: every split of every run
  const float* o = nullptr;                 // [slots][H_q][D] partial outputs, normalized
  const float* lse = nullptr;               // [slots][H_q] log2-sum-exp of the partial's scores (-inf: empty)

  __device__ __forceinline__ int own_begin_of(int seg) const { return own_begin == nullptr ? 0 : own_begin[seg]; }

  // Folds token `token`'s partials of query head `head` into its own result, in place: v(j)
  // (float&) holds the own normalized output at column col(j) of the row, j < N, N even, and for
  // even j col(j) is even and col(j + 1) = col(j) + 1 (pairs are read as aligned float2); lse_own
  // its log2-sum-exp. Afterwards v is the output over everything the row sees. Partials of weight
  // 0 (an empty split) are not read into v. A token can hold 16 slots and more, so the loads come in batches with no
  // branch between them (one round trip per batch): the slots' lse kLseBatch at a time, then the
  // partials kBatch at a time. The defaults suit a fold inside a kernel's main loop, whose registers
  // the loop needs (8 for a few columns a lane, 1 or 2 for a lane's share of an MMA row); an
  // epilogue passes wider batches (kernels/decode_attention.cuh write_team_columns).
  template <int D, int N, int kBatch = (N <= 8 ? 8 : N <= 16 ? 2 : 1), int kLseBatch = 8, class Col, class V>
  __device__ __forceinline__ void fold(int token, int head, int heads_q, float lse_own, Col&& col, V&& v) const {
    static_assert(N % 2 == 0, "columns in pairs");
    if (token_slots == nullptr) return;
    const SlotRange slots = token_slots[token];
    if (slots.count == 0) return;
    const std::int64_t first = static_cast<std::int64_t>(slots.first) * heads_q + head;  // slot i: + i heads_q
    auto row_of = [&](int i) { return first + static_cast<std::int64_t>(i) * heads_q; };
    float top = lse_own;
    for (int i0 = 0; i0 < slots.count; i0 += kLseBatch) {
      float l[kLseBatch];
#pragma unroll
      for (int k = 0; k < kLseBatch; ++k) l[k] = i0 + k < slots.count ? __ldcg(lse + row_of(i0 + k)) : -INFINITY;
#pragma unroll
      for (int k = 0; k < kLseBatch; ++k) top = fmaxf(top, l[k]);
    }
    if (top == -INFINITY) return;
    float sum = exp2f(lse_own - top);
#pragma unroll
    for (int j = 0; j < N; ++j) v(j) *= sum;
    for (int i0 = 0; i0 < slots.count; i0 += kBatch) {
      float w[kBatch];
      float2 x[kBatch][N / 2];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const bool valid = i0 + k < slots.count;
        const std::int64_t row = row_of(valid ? i0 + k : 0);
        w[k] = valid ? exp2f(__ldcg(lse + row) - top) : 0.f;
#pragma unroll
        for (int j = 0; j < N; j += 2)
          x[k][j / 2] = valid ? __ldcg(reinterpret_cast<const float2*>(o + row * D + col(j))) : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        sum += w[k];
#pragma unroll
        for (int j = 0; j < N; j += 2) {
          v(j) += w[k] == 0.f ? 0.f : w[k] * x[k][j / 2].x;
          v(j + 1) += w[k] == 0.f ? 0.f : w[k] * x[k][j / 2].y;
        }
      }
    }
    const float inv = 1.f / sum;
#pragma unroll
    for (int j = 0; j < N; ++j) v(j) *= inv;
  }
};

}  // namespace cellkv::gpu::kernels
