// cellkv/gpu/launch/ops.cuh - launchers: check arguments, then launch. A refusal launches and writes
// nothing and names the problem; the stream is always the last parameter.
//
//   write_kv      pool[cells[t]] = k[t], v[t]                       (one launch for K and V; a row
//                 outside the pool goes to the scratch row and sets the fault word)
//   masked_sdpa   attention with an explicit bool mask [tokens, row_stride] and a device kv_len
//   range_sdpa    attention over per-token row ranges (the sequence layout)
//
// Shapes: q, out [tokens, heads_q, D]; k, v [tokens, heads_kv, D]; pools [rows, heads_kv, D].
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cellkv/gpu/launch/dispatch.cuh"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/kernels/dependent_launch.cuh"
#include "cellkv/gpu/kernels/reference_attention.cuh"
#include "cellkv/gpu/kernels/visibility.cuh"
#include "cellkv/gpu/kernels/write_kv.cuh"

namespace cellkv::gpu {

// Arguments of an attention launch; scale 0 means 1 / sqrt(head_dim). S: the pool's elements (T,
// or Fp8E4M3 for an fp8 pool).
template <class T, class S = T>
using AttentionArgs = kernels::AttentionArgs<T, S>;

namespace detail {

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

inline bool supported_head_dim(std::int32_t d) { return d == 64 || d == 128 || d == 256; }

template <class T>
Status check_pool(const PoolView<T>& pool) {
  if (pool.heads_kv < 1 || pool.rows < 1) return Errc::bad_shape;
  if (!supported_head_dim(pool.head_dim)) return Errc::unsupported_head_dim;
  if (pool.k == nullptr || pool.v == nullptr) return Errc::bad_argument;
  if (!aligned16(pool.k) || !aligned16(pool.v)) return Errc::misaligned_pointer;
  return {};
}

template <class C>
Status check_pool(const Fp8PoolView<C>& pool) {
  if (const Status s = check_pool(PoolView<C>{pool.k, pool.v, pool.rows, pool.heads_kv, pool.head_dim}); !s.ok()) return s;
  return pool.k_scale == nullptr || pool.v_scale == nullptr ? Status{Errc::bad_argument} : Status{};
}

template <class T, class S>
Status check_attention(const AttentionArgs<T, S>& a) {
  if (a.tokens < 1) return Errc::bad_shape;
  if (a.heads_q < 1 || a.pool.heads_kv < 1 || a.heads_q % a.pool.heads_kv != 0) return Errc::bad_head_ratio;
  if (const Status s = check_pool(a.pool); !s.ok()) return s;
  if (a.q == nullptr || a.out == nullptr) return Errc::bad_argument;
  if (!aligned16(a.q) || !aligned16(a.out)) return Errc::misaligned_pointer;
  if (!std::isfinite(a.scale)) return Errc::bad_argument;
  return {};
}

// Blocks of the reference kernel along y: every KV head times the chunks of kRefHeads query heads
// of its group, in int64 (a CUDA grid's y dimension holds at most 65535).
inline std::int64_t reference_grid_y(std::int32_t heads_q, std::int32_t heads_kv) {
  const std::int64_t group = heads_q / heads_kv;
  return heads_kv * ((group + kernels::kRefHeads - 1) / kernels::kRefHeads);
}
inline constexpr std::int64_t kMaxGridY = 65535;

template <class T, class S, class Vis>
Status launch_reference_attention(AttentionArgs<T, S> a, Vis vis, ::cuda::stream_ref stream) {
  if (a.scale == 0.f) a.scale = 1.f / std::sqrt(static_cast<float>(a.pool.head_dim));
  const std::int64_t blocks_y = reference_grid_y(a.heads_q, a.pool.heads_kv);
  if (blocks_y > kMaxGridY) return Errc::bad_shape;
  const dim3 grid(static_cast<unsigned>(a.tokens), static_cast<unsigned>(blocks_y));
  return dispatch_head_dim(a.pool.head_dim, [&](auto d) {
    kernels::reference_attention<T, decltype(d)::value, Vis, S><<<grid, kernels::kRefWarps * 32, 0, stream.get()>>>(a, vis);
    return last_launch();
  });
}

// Blocks of 256 threads write_kv launches for `tokens` rows of `row_bytes` bytes in K and in V:
// one per 256 16-byte vectors, at most 4096 (the kernel is grid-stride). In int64 throughout.
inline unsigned write_kv_blocks(std::int32_t tokens, std::int64_t row_bytes) {
  const std::int64_t vectors = 2 * static_cast<std::int64_t>(tokens) * (row_bytes / 16);
  return static_cast<unsigned>(std::clamp<std::int64_t>((vectors + 255) / 256, 1, 4096));
}

}  // namespace detail

// pool.k[cells[t]] = k[t] and pool.v[cells[t]] = v[t] for t < tokens, in one launch. cells is a
// device array; cells[t] may be pool.rows (the scratch row). A cells[t] outside [0, pool.rows]
// writes the scratch row instead and sets kFaultBadRow in *fault (a device-writable word; nullptr:
// not reported).
template <Element T>
Status write_kv(PoolView<T> pool, const T* k, const T* v, const std::int64_t* cells, std::int32_t tokens,
                std::uint32_t* fault, ::cuda::stream_ref stream) {
  if (tokens < 1) return Errc::bad_shape;
  if (const Status s = detail::check_pool(pool); !s.ok()) return s;
  if (k == nullptr || v == nullptr || cells == nullptr) return Errc::bad_argument;
  if (!detail::aligned16(k) || !detail::aligned16(v)) return Errc::misaligned_pointer;
  const unsigned blocks = detail::write_kv_blocks(tokens, pool.row_elems() * static_cast<std::int64_t>(sizeof(T)));
  auto* kernel = kernels::write_kv<T>;
  CELLKV_CUDA_STATUS(
      launch_dependent(dependent_launch_supported(), kernel, blocks, 256, 0, stream.get(), pool, k, v, cells, tokens, fault));
  return {};
}

// write_kv into an fp8 pool: each row-head of k and v ([tokens, H_kv, D] of T) quantized with the
// pool's scaling (fp8.hpp), its codes and scale stored at row cells[t]; rows as write_kv above.
template <Element T>
Status write_kv(Fp8PoolView<Fp8E4M3> pool, const T* k, const T* v, const std::int64_t* cells, std::int32_t tokens,
                std::uint32_t* fault, ::cuda::stream_ref stream) {
  if (tokens < 1) return Errc::bad_shape;
  if (const Status s = detail::check_pool(pool); !s.ok()) return s;
  if (k == nullptr || v == nullptr || cells == nullptr) return Errc::bad_argument;
  if (!detail::aligned16(k) || !detail::aligned16(v)) return Errc::misaligned_pointer;
  const std::int64_t warps = 2 * static_cast<std::int64_t>(tokens) * pool.heads_kv;
  const auto blocks = static_cast<unsigned>(std::clamp<std::int64_t>((warps + 7) / 8, 1, 4096));
  return dispatch_head_dim(pool.head_dim, [&](auto d) {
    auto* kernel = kernels::write_kv_fp8<decltype(d)::value, T>;
    CELLKV_CUDA_STATUS(launch_dependent(dependent_launch_supported(), kernel, blocks, 256, 0, stream.get(), pool, k,
                                        v, cells, tokens, fault));
    return Status{};
  });
}

// write_kv without a fault word: a row outside the pool still goes to the scratch row, unreported.
template <Element T>
Status write_kv(PoolView<T> pool, const T* k, const T* v, const std::int64_t* cells, std::int32_t tokens,
                ::cuda::stream_ref stream) {
  return write_kv<T>(pool, k, v, cells, tokens, nullptr, stream);
}

// The mask contract (docs/design.md section 6): token t sees row c iff mask[t * mask_row_stride + c], for c below
// the device-side bound *kv_len (read on the device, so it may change under graph replay).
template <Element T, class S = T>
Status masked_sdpa(const AttentionArgs<T, S>& args, const bool* mask, std::int64_t mask_row_stride,
                   const std::int64_t* kv_len, ::cuda::stream_ref stream) {
  if (const Status s = detail::check_attention(args); !s.ok()) return s;
  if (mask == nullptr || kv_len == nullptr) return Errc::bad_argument;
  if (mask_row_stride < 1) return Errc::bad_shape;
  return detail::launch_reference_attention(args, kernels::MaskVisibility{mask, mask_row_stride, kv_len, args.pool.rows},
                                            stream);
}

// Attention over per-token row ranges: token t sees rows [max(ranges[t].begin, 0),
// min(ranges[t].end, *kv_len, pool.rows)) (ranges and kv_len are device data, clamped on the device).
template <Element T, class S = T>
Status range_sdpa(const AttentionArgs<T, S>& args, const RowRange* ranges, const std::int64_t* kv_len,
                  ::cuda::stream_ref stream) {
  if (const Status s = detail::check_attention(args); !s.ok()) return s;
  if (ranges == nullptr || kv_len == nullptr) return Errc::bad_argument;
  return detail::launch_reference_attention(args, kernels::RangeVisibility{ranges, kv_len, args.pool.rows}, stream);
}

// masked_sdpa for a dtype known at run time (pointers to elements of that dtype).
inline Status masked_sdpa(DType dtype, const void* q, PoolView<const void> pool, void* out, std::int32_t tokens,
                          std::int32_t heads_q, float scale, const bool* mask, std::int64_t mask_row_stride,
                          const std::int64_t* kv_len, ::cuda::stream_ref stream) {
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const AttentionArgs<T> a{static_cast<const T*>(q),
                             {static_cast<const T*>(pool.k), static_cast<const T*>(pool.v), pool.rows, pool.heads_kv,
                              pool.head_dim},
                             static_cast<T*>(out), tokens, heads_q, scale};
    return masked_sdpa<T>(a, mask, mask_row_stride, kv_len, stream);
  });
}

}  // namespace cellkv::gpu
