// cellkv/gpu/kernels/shared_fold.cuh - how the kernels that read a segment's own positions meet
// the shared-prefix partials (prefix_sharing.hpp): where the segment's own positions begin, and
// the log-sum-exp fold of a token's partial slots into its output.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cellkv/prefix_sharing.hpp"

namespace cellkv::gpu::kernels {

// Shared-prefix results of the current layer, written by shared_prefix_attention before the
// consumer kernels run. All null when the cache does not share (sequence layout).
struct SharedFold {
  const std::int32_t* own_begin = nullptr;  // [segments] first position a segment reads itself
  const SlotRange* token_slots = nullptr;   // [T] each token's partial slots: every split of every run
  const float* o = nullptr;                 // [slots][H_q][D] partial outputs, normalized
  const float* lse = nullptr;               // [slots][H_q] log2-sum-exp of the partial's scores (-inf: empty)

  __device__ __forceinline__ int own_begin_of(int seg) const { return own_begin == nullptr ? 0 : own_begin[seg]; }

  // Folds token `token`'s partials of query head `head` into its own result, in place: v(j)
  // (float&) holds the own normalized output at column col(j) of the row, j < N; lse_own its
  // log2-sum-exp. Afterwards v is the output over everything the row sees.
  template <int D, int N, class Col, class V>
  __device__ __forceinline__ void fold(int token, int head, int heads_q, float lse_own, Col&& col, V&& v) const {
    if (token_slots == nullptr) return;
    const SlotRange slots = token_slots[token];
    if (slots.count == 0) return;
    float top = lse_own;
    for (int i = 0; i < slots.count; ++i)
      top = fmaxf(top, lse[static_cast<std::int64_t>(slots.first + i) * heads_q + head]);
    if (top == -INFINITY) return;
    float sum = exp2f(lse_own - top);
    for (int i = 0; i < slots.count; ++i) sum += exp2f(lse[static_cast<std::int64_t>(slots.first + i) * heads_q + head] - top);
    const float own = exp2f(lse_own - top) / sum;
#pragma unroll
    for (int j = 0; j < N; ++j) v(j) *= own;
    for (int i = 0; i < slots.count; ++i) {
      const std::int64_t row = static_cast<std::int64_t>(slots.first + i) * heads_q + head;
      const float w = exp2f(lse[row] - top) / sum;
      if (w == 0.f) continue;
      const float* part = o + row * D;
#pragma unroll
      for (int j = 0; j < N; ++j) v(j) += w * part[col(j)];
    }
  }
};

}  // namespace cellkv::gpu::kernels
