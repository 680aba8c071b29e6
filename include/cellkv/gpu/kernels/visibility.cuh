// cellkv/gpu/kernels/visibility.cuh - how an attention kernel learns which rows token t sees.
//
// A policy gives, for token t, a row interval [begin(t), end(t)) to sweep and a per-row test
// visible(t, row). Both read device memory only, so a captured graph sees each step's contents.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {
namespace kernels {

// The mask contract (docs/design.md section 5): an explicit bool mask [tokens, row_stride] and a device-side bound kv_len;
// the sweep covers [0, min(kv_len, row_stride, rows)).
struct MaskVisibility {
  const bool* mask = nullptr;
  std::int64_t row_stride = 0;
  const std::int64_t* kv_len = nullptr;
  std::int64_t rows = 0;  // rows of the pool: a bound the sweep never passes

  __device__ std::int64_t begin(std::int32_t) const { return 0; }
  __device__ std::int64_t end(std::int32_t) const {
    const std::int64_t n = *kv_len;
    return n < row_stride ? (n < rows ? n : rows) : (row_stride < rows ? row_stride : rows);
  }
  __device__ bool visible(std::int32_t t, std::int64_t row) const { return mask[t * row_stride + row]; }
};

// The sequence layout: token t sees rows [ranges[t].begin, ranges[t].end), clamped to
// [0, min(kv_len, rows)): the sweep never leaves the pool, whatever the device data says.
struct RangeVisibility {
  const RowRange* ranges = nullptr;
  const std::int64_t* kv_len = nullptr;
  std::int64_t rows = 0;  // rows of the pool: a bound the sweep never passes

  __device__ std::int64_t begin(std::int32_t t) const {
    const std::int64_t b = ranges[t].begin;
    return b > 0 ? b : 0;
  }
  __device__ std::int64_t end(std::int32_t t) const {
    const std::int64_t e = ranges[t].end, n = *kv_len;
    const std::int64_t bound = n < rows ? n : rows;
    return e < bound ? e : bound;
  }
  __device__ bool visible(std::int32_t, std::int64_t) const { return true; }
};

}  // namespace kernels
}  // namespace cellkv::gpu
