// llama/all_reduce.cuh - the sum over tensor-parallel ranks that follows the attention output
// projection and the MLP: NCCL across GPUs, or a plain device sum when every rank shares one GPU
// (NCCL refuses two ranks on one device; tests use this stand-in to run G = 2 on one GPU).
//
// Every rank calls sum() from its own thread, with its own buffer and stream, in the same order.
#pragma once

#include <cellkv/gpu/stream.hpp>
#include <cellkv/status.hpp>

#include <cuda_runtime.h>

#include <barrier>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "gpu_kernels.cuh"

namespace llama {

template <class T>
class AllReduce {
 public:
  virtual ~AllReduce() = default;
  // data [count] of rank `rank` becomes the sum of every rank's data, ordered on `stream` (a stream
  // of the rank's device, current on the calling thread).
  virtual cellkv::Status sum(std::int32_t rank, T* data, std::size_t count, cudaStream_t stream) = 0;
  // Whether sum() may be captured into a CUDA graph.
  [[nodiscard]] virtual bool capturable() const = 0;
};

// G ranks on one device: the ranks meet on the host, rank 0's stream waits for every rank's data,
// sums them into every buffer, and every other stream waits for that sum. Eager only.
template <class T>
class DeviceSumReduce final : public AllReduce<T> {
 public:
  static constexpr int kMaxRanks = 8;

  // Throws std::invalid_argument unless 1 <= ranks <= kMaxRanks.
  explicit DeviceSumReduce(std::int32_t ranks)
      : ranks_(checked(ranks)), ready_(static_cast<std::size_t>(ranks_)), data_(static_cast<std::size_t>(ranks_)),
        meet_(ranks_) {}

  cellkv::Status sum(std::int32_t rank, T* data, std::size_t count, cudaStream_t stream) override {
    const auto r = static_cast<std::size_t>(rank);
    data_[r] = data;
    cellkv::Status status = ready_[r].record(stream);
    meet_.arrive_and_wait();  // every rank's data is recorded
    if (rank == 0 && status.ok()) status = sum_on(stream, count);
    meet_.arrive_and_wait();  // the sum is enqueued
    if (rank != 0 && status.ok()) status = summed_.wait_on(stream);
    return status;
  }
  [[nodiscard]] bool capturable() const override { return false; }

 private:
  static std::int32_t checked(std::int32_t ranks) {
    if (ranks < 1 || ranks > kMaxRanks) throw std::invalid_argument("llama::DeviceSumReduce: 1 to 8 ranks");
    return ranks;
  }

  cellkv::Status sum_on(cudaStream_t stream, std::size_t count) {
    kernels::Parts<T, kMaxRanks> parts{};
    for (std::int32_t r = 0; r < ranks_; ++r) {
      if (const auto s = ready_[static_cast<std::size_t>(r)].wait_on(stream); !s.ok()) return s;
      parts.p[r] = data_[static_cast<std::size_t>(r)];
    }
    kernels::sum_parts<T, kMaxRanks><<<264, 256, 0, stream>>>(parts, ranks_, static_cast<std::int64_t>(count));
    CELLKV_CUDA_STATUS(cudaGetLastError());
    return summed_.record(stream);
  }

  std::int32_t ranks_;
  std::vector<cellkv::gpu::Event> ready_;
  std::vector<T*> data_;
  cellkv::gpu::Event summed_;
  std::barrier<> meet_;
};

}  // namespace llama
