// cellkv/gpu/kv_pool.hpp - every layer's K and V pool on the device, allocated once.
//
// Per layer, K and V are each [1, rows, H_kv, D] (BSHD) with rows = max_cells (cell layout) or
// max_seqs * max_len (sequence layout). Storage holds one extra row per pool, row `rows`: the
// scratch row that padding tokens of a graph-width step write to; nothing ever reads it.
// Addresses never change for the pool's life.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <type_traits>

#include "cellkv/gpu/dtype.hpp"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/layout.hpp"
#include "cellkv/pool_view.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

using cellkv::PoolShape;  // pool_view.hpp

template <Layout L, Element T>
class KVPool {
 public:
  // Rows per layer for a cache of this layout and config.
  static std::int64_t rows_for(const CacheConfig& c) { return L::rows(c); }

  // Throws std::invalid_argument on a non-positive size and cellkv::gpu::Error when allocation fails.
  KVPool(const CacheConfig& config, PoolShape shape) : shape_(shape), rows_(rows_for(config)) {
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
    if (copy.rows < 0 || copy.src_row < 0 || copy.dst_row < 0 || copy.src_row + copy.rows > rows_ ||
        copy.dst_row + copy.rows > rows_)
      return Errc::bad_argument;
    const std::size_t bytes = static_cast<std::size_t>(copy.rows * row_elems()) * sizeof(T);
    for (std::int32_t l = 0; l < shape_.layers; ++l) {
      const PoolView<T> p = view(l);
      CELLKV_CUDA_STATUS(cudaMemcpyAsync(p.k + copy.dst_row * row_elems(), p.k + copy.src_row * row_elems(), bytes,
                                         cudaMemcpyDeviceToDevice, stream.get()));
      CELLKV_CUDA_STATUS(cudaMemcpyAsync(p.v + copy.dst_row * row_elems(), p.v + copy.src_row * row_elems(), bytes,
                                         cudaMemcpyDeviceToDevice, stream.get()));
    }
    return {};
  }

 private:
  [[nodiscard]] std::int64_t pool_elems() const noexcept { return (rows_ + 1) * row_elems(); }

  PoolShape shape_;
  std::int64_t rows_;
  DeviceBuffer<T> storage_;
};

}  // namespace cellkv::gpu
