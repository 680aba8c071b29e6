// cellkv/pool_view.hpp - the shape of a cache's pools, and a non-owning, trivially copyable view
// of one layer's K and V pool.
//
// K and V are each [rows, heads_kv, head_dim] row-major (BSHD with B = 1): a row's heads are
// contiguous. The same view type serves host pools (the reference) and device pools (kernels).
#pragma once

#include <cstdint>

#include "cellkv/host_device.hpp"

namespace cellkv {

// The heads a cache (or one shard of it) stores, for every layer.
struct PoolShape {
  std::int32_t layers = 0;
  std::int32_t heads_kv = 0;
  std::int32_t head_dim = 0;
  std::int32_t heads_q = 0;  // query heads of the model; the table kernels need it (0: unknown)
};

template <class T>
struct PoolView {
  T* k = nullptr;
  T* v = nullptr;
  std::int64_t rows = 0;
  std::int32_t heads_kv = 0;
  std::int32_t head_dim = 0;

  // Elements per row: heads_kv * head_dim.
  CELLKV_HOST_DEVICE constexpr std::int64_t row_elems() const noexcept {
    return static_cast<std::int64_t>(heads_kv) * head_dim;
  }
  // Offset of (row, head, 0) in k or v.
  CELLKV_HOST_DEVICE constexpr std::int64_t offset(std::int64_t row, std::int32_t head) const noexcept {
    return row * row_elems() + static_cast<std::int64_t>(head) * head_dim;
  }
};

}  // namespace cellkv
