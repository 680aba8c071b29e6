// cellkv/gpu/launch/row_copies.cuh - the pending row copies of an upload (PendingChanges::copies),
// run in their order on the upload's stream:
//   - a copy of several rows (a fork of the sequence layout) as one cudaMemcpyAsync per layer and
//     tensor (KVPool::copy_rows);
//   - a run of one-row copies (copy-on-write cells of seq_add / seq_div, cell layout) in which no
//     copy reads or writes a row an earlier copy of the run writes, or writes a row an earlier copy
//     reads, as one kernel launch for every layer and both tensors: a context shift of a forked
//     sequence copies thousands of cells, which would otherwise be 2 x layers API calls each.
// An fp8 pool's scales move with its codes (a second launch over the scale tensors).
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <unordered_set>
#include <vector>

#include "cellkv/gpu/dtype.hpp"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/kv_pool.hpp"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

namespace kernels {

// copies[c] (rows == 1) in every tensor: tensor t (layer t / 2, K or V) starts at
// storage + t * tensor_elems; rows are row_elems elements.
template <class T>
__global__ void copy_single_rows(T* storage, std::int64_t tensor_elems, std::int32_t tensors, std::int64_t row_elems,
                                 const RowCopy* copies, std::int32_t count) {
  const std::int64_t per_copy = tensors * row_elems;
  const std::int64_t total = per_copy * count;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const RowCopy c = copies[i / per_copy];
    const std::int64_t in_copy = i % per_copy, e = in_copy % row_elems;
    T* tensor = storage + in_copy / row_elems * tensor_elems;
    tensor[c.dst_row * row_elems + e] = tensor[c.src_row * row_elems + e];
  }
}

}  // namespace kernels

class RowCopier {
 public:
  static constexpr std::size_t kWave = 4096;  // one-row copies per launch at most

  // Runs `copies` in order on `stream`; bad_argument (nothing run) for a copy outside the pool.
  template <Layout L, KvElement T>
  Status run(const KVPool<L, T>& pool, std::span<const RowCopy> copies, ::cuda::stream_ref stream) {
    for (const RowCopy& c : copies)
      if (c.rows < 0 || c.src_row < 0 || c.dst_row < 0 || c.src_row + c.rows > pool.rows() ||
          c.dst_row + c.rows > pool.rows())
        return Errc::bad_argument;
    for (std::size_t i = 0; i < copies.size();) {
      if (copies[i].rows != 1) {
        if (const Status s = pool.copy_rows(copies[i++], stream); !s.ok()) return s;
        continue;
      }
      const std::size_t end = wave_end(copies, i);
      if (const Status s = launch(pool, copies.subspan(i, end - i), stream); !s.ok()) return s;
      i = end;
    }
    return {};
  }

 private:
  // One past the last copy of the wave that starts at `first` (a one-row copy).
  std::size_t wave_end(std::span<const RowCopy> copies, std::size_t first) {
    reads_.clear();
    writes_.clear();
    std::size_t i = first;
    for (; i < copies.size() && i - first < kWave && copies[i].rows == 1; ++i) {
      const RowCopy& c = copies[i];
      if (writes_.contains(c.src_row) || writes_.contains(c.dst_row) || reads_.contains(c.dst_row)) break;
      reads_.insert(c.src_row);
      writes_.insert(c.dst_row);
    }
    return i;
  }

  template <Layout L, KvElement T>
  Status launch(const KVPool<L, T>& pool, std::span<const RowCopy> wave, ::cuda::stream_ref stream) {
    if (list_.size() == 0) {
      try {
        list_ = DeviceBuffer<RowCopy>(kWave);
      } catch (const Error&) {
        return Errc::device_error;
      }
    }
    // Pageable source: the copy is staged before cudaMemcpyAsync returns, so the host list may change.
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(list_.data(), wave.data(), wave.size_bytes(), cudaMemcpyHostToDevice, stream.get()));
    const auto first = pool.view(0);
    const std::int32_t tensors = 2 * pool.shape().layers;
    const auto count = static_cast<std::int32_t>(wave.size());
    if (const Status s = copy_wave(first.k, first.v - first.k, tensors, pool.row_elems(), count, stream); !s.ok()) return s;
    if constexpr (kFp8Kv<T>)
      return copy_wave(first.k_scale, first.v_scale - first.k_scale, tensors, pool.shape().heads_kv, count, stream);
    return {};
  }

  // The wave's copies in every tensor of `tensors` (first at `storage`, `stride` elements apart).
  template <class E>
  Status copy_wave(E* storage, std::int64_t stride, std::int32_t tensors, std::int64_t row_elems, std::int32_t count,
                   ::cuda::stream_ref stream) const {
    const std::int64_t elems = static_cast<std::int64_t>(count) * tensors * row_elems;
    const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((elems + 255) / 256, 4096));
    kernels::copy_single_rows<E><<<blocks, 256, 0, stream.get()>>>(storage, stride, tensors, row_elems, list_.data(), count);
    CELLKV_CUDA_STATUS(cudaGetLastError());
    return {};
  }

  DeviceBuffer<RowCopy> list_;  // kWave entries once a wave ran
  std::unordered_set<std::int64_t> reads_, writes_;
};

}  // namespace cellkv::gpu
