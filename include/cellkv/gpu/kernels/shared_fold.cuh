// cellkv/gpu/kernels/shared_fold.cuh - how the kernels that read a segment's own positions meet
// the shared-prefix partials (prefix_sharing.hpp): where the segment's own positions begin, and
// the log-sum-exp fold of a token's partial slots into its output.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cellkv/gpu/numeric.cuh"
#include "cellkv/prefix_sharing.hpp"

namespace cellkv::gpu::kernels {

// Component i of a float2 / float4 (i a constant once the caller's loop is unrolled).
__device__ __forceinline__ float component(const float2& x, int i) { return i == 0 ? x.x : x.y; }
__device__ __forceinline__ float component(const float4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

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
  // (float&) holds the own normalized output at column col(j) of the row, j < N, and lse_own its
  // log2-sum-exp. Columns come in groups of kVec (2 or 4; N a multiple): for j % kVec == 0, col(j)
  // is a multiple of kVec and col(j + i) = col(j) + i (a group is read as one aligned float2 /
  // float4). Afterwards v is the output over everything the row sees; when nothing is (every lse
  // -inf) v is left as it was. Partials of weight 0 (an empty split) are not read into v.
  // One pass, kBatch slots a round trip (their lse and partials loaded together, no branch between
  // the loads), the running maximum rescaling v between batches: a token can hold 16 slots and
  // more. The default suits a fold inside a kernel's main loop, whose registers the loop needs (8
  // for a few columns a lane, 1 or 2 for a lane's share of an MMA row); an epilogue passes a wider
  // batch (kernels/decode_attention.cuh write_team_columns).
  template <int D, int N, int kBatch = (N <= 8 ? 8 : N <= 16 ? 2 : 1), int kVec = 2, class Col, class V>
  __device__ __forceinline__ void fold(int token, int head, int heads_q, float lse_own, Col&& col, V&& v) const {
    static_assert((kVec == 2 || kVec == 4) && N % kVec == 0, "columns in aligned groups");
    using Vec = std::conditional_t<kVec == 4, float4, float2>;
    if (token_slots == nullptr) return;
    const SlotRange slots = token_slots[token];
    if (slots.count == 0) return;
    const std::int64_t first = static_cast<std::int64_t>(slots.first) * heads_q + head;  // slot i: + i heads_q
    float top = lse_own, sum = lse_own == -INFINITY ? 0.f : 1.f;
    for (int i0 = 0; i0 < slots.count; i0 += kBatch) {
      float l[kBatch];
      Vec x[kBatch][N / kVec];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const bool valid = i0 + k < slots.count;
        const std::int64_t row = first + static_cast<std::int64_t>(valid ? i0 + k : 0) * heads_q;
        l[k] = valid ? __ldcg(lse + row) : -INFINITY;
#pragma unroll
        for (int g = 0; g < N / kVec; ++g)
          x[k][g] = valid ? __ldcg(reinterpret_cast<const Vec*>(o + row * D + col(g * kVec))) : Vec{};
      }
      float m = top;
#pragma unroll
      for (int k = 0; k < kBatch; ++k) m = fmaxf(m, l[k]);
      if (m == -INFINITY) continue;  // nothing seen so far
      const float rescale = fast_exp2(top - m);  // 0 when top is -inf: the own part is empty
      top = m;
      sum *= rescale;
#pragma unroll
      for (int j = 0; j < N; ++j) v(j) *= rescale;
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const float w = fast_exp2(l[k] - top);
        sum += w;
#pragma unroll
        for (int g = 0; g < N / kVec; ++g)
#pragma unroll
          for (int i = 0; i < kVec; ++i) v(g * kVec + i) += w == 0.f ? 0.f : w * component(x[k][g], i);
      }
    }
    if (top == -INFINITY) return;
    const float inv = 1.f / sum;
#pragma unroll
    for (int j = 0; j < N; ++j) v(j) *= inv;
  }
};

}  // namespace cellkv::gpu::kernels
