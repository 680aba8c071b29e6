// cellkv/gpu/key_rotation.cuh - how a device cache re-rotates the K rows that seq_add / seq_div
// moved (PendingChanges::rotations, RowRotation{cell, old_pos, new_pos}), at the next upload,
// after the copy-on-write copies and before the step's writes (docs/design.md section 4).
//
// A device cache starts with no key rotation; seq_add and seq_div are refused (no_key_rotation)
// until one is set:
//   KeyRotation<T>::none()            positions are not encoded in K (ALiBi, NoPE): nothing runs
//   KeyRotation<T>::rope(spec)        the built-in RoPE re-rotation (rope.hpp), every layer
//   KeyRotation<T>::rope(specs)       one RopeSpec per layer (e.g. local and global bases)
//   KeyRotation<T>::custom(kernel)    the caller's kernel, called once per layer and batch of up to
//                                     4096 moved cells
// T is the cache's element parameter (dtype.hpp). For Fp8<In> caches the built-in RoPE dequantizes
// each moved row-head (codes x scale, in double), rotates it in double, rounds it to float and
// quantizes it again with a fresh scale (per-row scaling; the layer's static scale otherwise), and a
// custom kernel receives the layer's Fp8PoolView.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "cellkv/gpu/dtype.hpp"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/kv_views.hpp"
#include "cellkv/gpu/launch/dispatch.cuh"
#include "cellkv/gpu/numeric.cuh"
#include "cellkv/pool_view.hpp"
#include "cellkv/rope.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

// A caller's re-rotation of one layer: `rotations` is a device array of RowRotation (count <= 4096
// entries, each cell at most once); K of row r, head h is pool.k + pool.offset(r, h), [head_dim]
// elements (an fp8 pool: codes and the row-head's scale, fp8_pool_view.hpp). Runs on `stream`; a refusal must change nothing: it stops the upload (which reports
// it), and the next upload of the shard resumes with this call (the calls that succeeded are not
// repeated).
template <KvElement T>
using RotationKernel = std::function<Status(std::int32_t layer, const WriteView<StoredOf<T>>& pool,
                                            const RowRotation* rotations, std::int32_t count, ::cuda::stream_ref stream)>;

namespace kernels {

// x rounded once to T.
template <Element T>
__device__ __forceinline__ T round_from_double(double x) {
  if constexpr (std::is_same_v<T, float>) return static_cast<float>(x);
  else if constexpr (std::is_same_v<T, __half>) return __double2half(x);
  else return __double2bfloat16(x);
}

// One thread per (rotation, KV head, pair): K's pair rotated by (new_pos - old_pos) * f_i.
template <Element T>
__global__ void rerotate_keys(PoolView<T> pool, const RowRotation* rotations, std::int32_t count, RopeSpec spec) {
  const std::int32_t pairs = spec.dims(pool.head_dim) / 2;
  const std::int64_t per_row = static_cast<std::int64_t>(pool.heads_kv) * pairs;
  const std::int64_t total = per_row * count;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const RowRotation r = rotations[i / per_row];
    const auto h = static_cast<std::int32_t>(i % per_row / pairs), pair = static_cast<std::int32_t>(i % pairs);
    std::int32_t a = 0, b = 0;
    rope_elements(spec, pool.head_dim, pair, a, b);
    T* head = pool.k + pool.offset(r.cell, h);
    double xa = to_float(head[a]), xb = to_float(head[b]);
    rotate_pair(xa, xb, static_cast<double>(r.new_pos - r.old_pos) * rope_frequency(spec, pool.head_dim, pair));
    head[a] = round_from_double<T>(xa), head[b] = round_from_double<T>(xb);
  }
}

// One thread per (rotation, KV head) of an fp8 pool: the row-head dequantized, rotated and quantized again.
template <int D>
__global__ void rerotate_keys_fp8(Fp8PoolView<Fp8E4M3> pool, const RowRotation* rotations, std::int32_t count,
                                  RopeSpec spec) {
  const std::int32_t pairs = spec.dims(D) / 2;
  const std::int64_t total = static_cast<std::int64_t>(count) * pool.heads_kv;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const RowRotation r = rotations[i / pool.heads_kv];
    const auto h = static_cast<std::int32_t>(i % pool.heads_kv);
    Fp8E4M3* codes = pool.k + pool.offset(r.cell, h);
    float& scale = pool.k_scale[pool.scale_offset(r.cell, h)];
    double x[D];
    dequantize_row_head(codes, D, scale, x);
    for (std::int32_t pair = 0; pair < pairs; ++pair) {
      std::int32_t a = 0, b = 0;
      rope_elements(spec, D, pair, a, b);
      rotate_pair(x[a], x[b], static_cast<double>(r.new_pos - r.old_pos) * rope_frequency(spec, D, pair));
    }
    float rounded[D];
    for (int d = 0; d < D; ++d) rounded[d] = static_cast<float>(x[d]);
    scale = quantize_row_head(rounded, D, pool.write_scale(false), codes);
  }
}

}  // namespace kernels

template <KvElement T>
class KeyRotation {
 public:
  KeyRotation() = default;  // not set: seq_add / seq_div are refused

  static KeyRotation none() { return KeyRotation(Kind::none); }
  static KeyRotation rope(const RopeSpec& spec) { return rope(std::vector<RopeSpec>{spec}); }
  // One spec per layer, or one for every layer.
  static KeyRotation rope(std::vector<RopeSpec> specs) {
    KeyRotation k(Kind::rope);
    k.specs_ = std::move(specs);
    return k;
  }
  static KeyRotation custom(RotationKernel<T> kernel) {
    KeyRotation k(Kind::custom);
    k.kernel_ = std::move(kernel);
    return k;
  }

  [[nodiscard]] bool set() const noexcept { return kind_ != Kind::unset; }

  // bad_argument for an unset rotation, a RoPE whose spec count is neither 1 nor `layers`, a spec
  // check_rope refuses for head_dim, or an empty custom kernel.
  [[nodiscard]] Status check(std::int32_t layers, std::int32_t head_dim) const {
    if (kind_ == Kind::unset || (kind_ == Kind::custom && !kernel_)) return Errc::bad_argument;
    if (kind_ != Kind::rope) return {};
    if (specs_.size() != 1 && specs_.size() != static_cast<std::size_t>(layers)) return Errc::bad_argument;
    for (const RopeSpec& s : specs_)
      if (const Status st = check_rope(s, head_dim); !st.ok()) return st;
    return {};
  }

  // Re-rotates layer `layer`'s K rows named by the device array `rotations` (count entries).
  [[nodiscard]] Status run(std::int32_t layer, const WriteView<StoredOf<T>>& pool, const RowRotation* rotations,
                           std::int32_t count, ::cuda::stream_ref stream) const {
    if (count == 0 || kind_ == Kind::none) return {};
    if (kind_ == Kind::custom) return kernel_(layer, pool, rotations, count, stream);
    if (kind_ != Kind::rope) return Errc::no_key_rotation;
    const RopeSpec& spec = specs_.size() == 1 ? specs_[0] : specs_[static_cast<std::size_t>(layer)];
    if constexpr (kFp8Kv<T>) {
      const std::int64_t threads = static_cast<std::int64_t>(count) * pool.heads_kv;
      const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((threads + 127) / 128, 4096));
      return dispatch_head_dim(pool.head_dim, [&](auto d) -> Status {
        kernels::rerotate_keys_fp8<decltype(d)::value><<<blocks, 128, 0, stream.get()>>>(pool, rotations, count, spec);
        CELLKV_CUDA_STATUS(cudaGetLastError());
        return {};
      });
    } else {
      const std::int64_t threads = static_cast<std::int64_t>(count) * pool.heads_kv * (spec.dims(pool.head_dim) / 2);
      const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((threads + 255) / 256, 4096));
      kernels::rerotate_keys<T><<<blocks, 256, 0, stream.get()>>>(pool, rotations, count, spec);
      CELLKV_CUDA_STATUS(cudaGetLastError());
      return {};
    }
  }

 private:
  enum class Kind : std::uint8_t { unset, none, rope, custom };
  explicit KeyRotation(Kind kind) : kind_(kind) {}

  Kind kind_ = Kind::unset;
  std::vector<RopeSpec> specs_;
  RotationKernel<T> kernel_;
};

}  // namespace cellkv::gpu
