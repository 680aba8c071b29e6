// cellkv/gpu/kernels/pool_maps.cuh - TMA descriptors of a layer's K and V pool, so the Hopper
// prefill kernels copy a run of consecutive pool rows with one bulk tensor copy instead of a gather.
//
// A pool tensor (K or V: [rows, H_kv, D] of T, 2-byte elements) is described to the TMA unit as a
// 3-D tensor {64 elements, H_kv x D / 64 column blocks, rows}, strides {128 B, row bytes}: element
// e of row r, head h lands at (e % 64, h D / 64 + e / 64, r). A box is {64, 1, kMapRows}: 64
// columns of kMapRows consecutive rows, written to shared memory as kMapRows rows of 128 bytes
// with the 128-byte swizzle, which is one column block of an Sw128Tile (wgmma.cuh) at a 1024-byte
// aligned row. Built on the host for each launch (a pure function of the pool's address and
// shape); passed to the kernels as a __grid_constant__ parameter, whose address the copies take.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "cellkv/pool_view.hpp"

namespace cellkv::gpu::kernels {

inline constexpr int kMapRows = 32;  // rows of one TMA box: a producer warp's rows of a tile

// valid == 0: no descriptors (the kernels gather every row).
struct PoolMaps {  // 128-byte aligned (CUtensorMap)
  CUtensorMap k;
  CUtensorMap v;
  int valid = 0;
};

namespace detail {

// cuTensorMapEncodeTiled from the driver (the runtime links no driver symbols); nullptr where the
// driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

template <class T>
bool encode_pool_tensor(CUtensorMap& map, const T* base, const PoolView<const T>& pool) {
  static_assert(sizeof(T) == 2, "bf16 / fp16 pools");
  const auto encode = tensor_map_encoder();
  if (encode == nullptr || pool.head_dim % 64 != 0 || pool.rows <= 0) return false;
  const cuuint64_t dims[3] = {64, static_cast<cuuint64_t>(pool.heads_kv) * (pool.head_dim / 64),
                              static_cast<cuuint64_t>(pool.rows)};
  const cuuint64_t strides[2] = {128, static_cast<cuuint64_t>(pool.row_elems()) * sizeof(T)};
  const cuuint32_t box[3] = {64, 1, kMapRows};
  const cuuint32_t unit[3] = {1, 1, 1};
  return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<T*>(base), dims, strides, box, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace detail

// The descriptors of `pool` (T: bf16 or fp16), or none (valid 0) where the driver cannot make them.
template <class T>
PoolMaps pool_maps(const PoolView<const T>& pool) {
  PoolMaps maps{};
  maps.valid = detail::encode_pool_tensor(maps.k, pool.k, pool) && detail::encode_pool_tensor(maps.v, pool.v, pool);
  return maps;
}

}  // namespace cellkv::gpu::kernels
