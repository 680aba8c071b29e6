// cellkv/gpu/kv_pool.hpp - every layer's K and V pool on the device, allocated once.
//
// Per layer, K and V are each [1, rows, H_kv, D] (BSHD) with rows = max_cells (cell layout) or
// max_seqs * max_len (sequence layout), or window_cells for a window pool (a cache with window
// storage keeps one KVPool per pool: gpu/pool_set.hpp). Storage holds one extra row per pool, row `rows`: the
// scratch row that padding tokens of a graph-width step write to; nothing ever reads it.
// Addresses never change for the pool's life.
//
// KVPool<L, Fp8<In>> stores E4M3 codes instead (K and V each [rows + 1, H_kv, D] bytes per layer)
// and, in arrays of their own, one fp32 scale per row-head (K and V each [rows + 1, H_kv]); its
// view is an Fp8PoolView (fp8_pool_view.hpp). A new fp8 pool holds codes 0 and scales 0.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "cellkv/gpu/dtype.hpp"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/fp8.hpp"
#include "cellkv/fp8_pool_view.hpp"
#include "cellkv/layout.hpp"
#include "cellkv/pool_view.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

using cellkv::PoolShape;  // pool_view.hpp

template <Layout L, KvElement T>
class KVPool;

namespace detail {
// Copies `copy.rows` rows (of `row_bytes` bytes) src_row -> dst_row within one tensor of `rows` rows.
inline Status copy_tensor_rows(std::byte* base, std::size_t row_bytes, const RowCopy& copy, ::cuda::stream_ref stream) {
  CELLKV_CUDA_STATUS(cudaMemcpyAsync(base + static_cast<std::size_t>(copy.dst_row) * row_bytes,
                                     base + static_cast<std::size_t>(copy.src_row) * row_bytes,
                                     static_cast<std::size_t>(copy.rows) * row_bytes, cudaMemcpyDeviceToDevice,
                                     stream.get()));
  return {};
}
inline bool copy_in_bounds(const RowCopy& copy, std::int64_t rows) {
  return copy.rows >= 0 && copy.src_row >= 0 && copy.dst_row >= 0 && copy.src_row + copy.rows <= rows &&
         copy.dst_row + copy.rows <= rows;
}
}  // namespace detail

template <Layout L, Element T>
class KVPool<L, T> {
 public:
  // Rows per layer for a cache of this layout and config.
  static std::int64_t rows_for(const CacheConfig& c) { return L::rows(c); }

  // Throws std::invalid_argument on a non-positive size and cellkv::gpu::Error when allocation fails.
  KVPool(const CacheConfig& config, PoolShape shape) : KVPool(rows_for(config), shape) {}
  // A pool of `rows` rows per layer (a window pool: CacheConfig::window_cells).
  KVPool(std::int64_t rows, PoolShape shape) : shape_(shape), rows_(rows) {
    if (shape.layers < 1 || shape.heads_kv < 1 || shape.head_dim < 1 || rows_ < 1)
      throw std::invalid_argument("cellkv::gpu::KVPool: layers, heads_kv, head_dim and rows must be positive");
    storage_ = DeviceBuffer<T>(static_cast<std::size_t>(pool_elems()) * 2 * static_cast<std::size_t>(shape.layers));
  }

  [[nodiscard]] const PoolShape& shape() const noexcept { return shape_; }
  [[nodiscard]] std::int64_t rows() const noexcept { return rows_; }
  [[nodiscard]] std::int64_t scratch_row() const noexcept { return rows_; }
  [[nodiscard]] std::int64_t row_elems() const noexcept {
    return static_cast<std::int64_t>(shape_.heads_kv) * shape_.head_dim;
  }

  // Layer l's K and V (rows() rows; the scratch row follows them in storage).
  [[nodiscard]] PoolView<T> view(std::int32_t layer) const noexcept {
    T* k = storage_.data() + static_cast<std::int64_t>(layer) * 2 * pool_elems();
    return {k, k + pool_elems(), rows_, shape_.heads_kv, shape_.head_dim};
  }
  // All storage, K and V of every layer, scratch rows included (tests fill it with poison).
  [[nodiscard]] std::span<T> storage() const noexcept { return storage_.span(); }

  // Copies `copy.rows` rows from src_row to dst_row in K and V of every layer, on `stream`.
  [[nodiscard]] Status copy_rows(const RowCopy& copy, ::cuda::stream_ref stream) const {
    if (!detail::copy_in_bounds(copy, rows_)) return Errc::bad_argument;
    const std::size_t row_bytes = static_cast<std::size_t>(row_elems()) * sizeof(T);
    for (std::int32_t l = 0; l < shape_.layers; ++l) {
      const PoolView<T> p = view(l);
      for (T* tensor : std::array<T*, 2>{p.k, p.v})
        if (const Status s = detail::copy_tensor_rows(reinterpret_cast<std::byte*>(tensor), row_bytes, copy, stream); !s.ok())
          return s;
    }
    return {};
  }

 private:
  [[nodiscard]] std::int64_t pool_elems() const noexcept { return (rows_ + 1) * row_elems(); }

  PoolShape shape_;
  std::int64_t rows_;
  DeviceBuffer<T> storage_;
};

// The fp8 pool: per layer, K codes, V codes ([rows + 1, H_kv, D] each), then K scales and V scales
// ([rows + 1, H_kv] fp32 each) in a second allocation. Writes quantize with the pool's Fp8Config
// (per-row scales by default; set_fp8_config for calibrated static per-layer scales).
template <Layout L, class In>
class KVPool<L, Fp8<In>> {
 public:
  static std::int64_t rows_for(const CacheConfig& c) { return L::rows(c); }

  KVPool(const CacheConfig& config, PoolShape shape) : KVPool(rows_for(config), shape) {}
  KVPool(std::int64_t rows, PoolShape shape) : shape_(shape), rows_(rows) {
    if (shape.layers < 1 || shape.heads_kv < 1 || shape.head_dim < 1 || rows_ < 1)
      throw std::invalid_argument("cellkv::gpu::KVPool: layers, heads_kv, head_dim and rows must be positive");
    const auto layers2 = 2 * static_cast<std::size_t>(shape.layers);
    codes_ = DeviceBuffer<Fp8E4M3>(static_cast<std::size_t>(code_elems()) * layers2);
    scales_ = DeviceBuffer<float>(static_cast<std::size_t>(scale_elems()) * layers2);
    CELLKV_CUDA_THROW(cudaMemset(codes_.data(), 0, codes_.bytes()));
    CELLKV_CUDA_THROW(cudaMemset(scales_.data(), 0, scales_.bytes()));
  }

  [[nodiscard]] const PoolShape& shape() const noexcept { return shape_; }
  [[nodiscard]] std::int64_t rows() const noexcept { return rows_; }
  [[nodiscard]] std::int64_t scratch_row() const noexcept { return rows_; }
  [[nodiscard]] std::int64_t row_elems() const noexcept {
    return static_cast<std::int64_t>(shape_.heads_kv) * shape_.head_dim;
  }
  [[nodiscard]] const Fp8Config& fp8_config() const noexcept { return config_; }

  // The scaling of later writes (rows written before keep their codes and scales). Refuses what
  // check_fp8_config refuses (bad_argument), changing nothing.
  [[nodiscard]] Status set_fp8_config(Fp8Config config) {
    if (const Status s = check_fp8_config(config, shape_.layers); !s.ok()) return s;
    config_ = std::move(config);
    return {};
  }

  // Layer l's codes and scales (rows() rows; the scratch row follows them).
  [[nodiscard]] Fp8PoolView<Fp8E4M3> view(std::int32_t layer) const noexcept {
    Fp8E4M3* k = codes_.data() + static_cast<std::int64_t>(layer) * 2 * code_elems();
    float* ks = scales_.data() + static_cast<std::int64_t>(layer) * 2 * scale_elems();
    const bool fixed = config_.scaling == Fp8Scaling::static_per_layer;
    return {k,
            k + code_elems(),
            ks,
            ks + scale_elems(),
            rows_,
            shape_.heads_kv,
            shape_.head_dim,
            config_.scaling,
            fixed ? config_.static_scales[static_cast<std::size_t>(layer)] : Fp8LayerScales{}};
  }
  // All codes and all scales, scratch rows included (tests fill them).
  [[nodiscard]] std::span<Fp8E4M3> storage() const noexcept { return codes_.span(); }
  [[nodiscard]] std::span<float> scale_storage() const noexcept { return scales_.span(); }

  // Copies `copy.rows` rows src_row -> dst_row in K and V of every layer: codes and scales.
  [[nodiscard]] Status copy_rows(const RowCopy& copy, ::cuda::stream_ref stream) const {
    if (!detail::copy_in_bounds(copy, rows_)) return Errc::bad_argument;
    const auto code_row = static_cast<std::size_t>(row_elems());
    const std::size_t scale_row = sizeof(float) * static_cast<std::size_t>(shape_.heads_kv);
    for (std::int32_t l = 0; l < shape_.layers; ++l) {
      const Fp8PoolView<Fp8E4M3> p = view(l);
      for (Fp8E4M3* tensor : std::array<Fp8E4M3*, 2>{p.k, p.v})
        if (const Status s = detail::copy_tensor_rows(reinterpret_cast<std::byte*>(tensor), code_row, copy, stream); !s.ok())
          return s;
      for (float* tensor : std::array<float*, 2>{p.k_scale, p.v_scale})
        if (const Status s = detail::copy_tensor_rows(reinterpret_cast<std::byte*>(tensor), scale_row, copy, stream); !s.ok())
          return s;
    }
    return {};
  }

 private:
  [[nodiscard]] std::int64_t code_elems() const noexcept { return (rows_ + 1) * row_elems(); }
  [[nodiscard]] std::int64_t scale_elems() const noexcept { return (rows_ + 1) * shape_.heads_kv; }

  PoolShape shape_;
  std::int64_t rows_;
  Fp8Config config_;
  DeviceBuffer<Fp8E4M3> codes_;
  DeviceBuffer<float> scales_;
};

}  // namespace cellkv::gpu
