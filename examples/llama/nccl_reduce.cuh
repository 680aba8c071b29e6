// llama/nccl_reduce.cuh - the tensor-parallel all-reduce over NCCL: one communicator per GPU,
// created together (ncclCommInitAll) for ranks driven by threads of one process. NVLink
// multicast (NVLS) is forced off before the communicators exist: on shared machines it can take
// GPUs out of service.
#pragma once

#include <cellkv/status.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <nccl.h>

#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "all_reduce.cuh"

namespace llama {

template <class T>
class NcclReduce final : public AllReduce<T> {
 public:
  // One rank per entry of `devices` (distinct devices). Throws std::runtime_error when NCCL fails.
  explicit NcclReduce(std::span<const int> devices) : comms_(devices.size()) {
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    const ncclResult_t r = ncclCommInitAll(comms_.data(), static_cast<int>(devices.size()), devices.data());
    if (r != ncclSuccess) {
      comms_.clear();
      throw std::runtime_error(std::string("ncclCommInitAll: ") + ncclGetErrorString(r));
    }
  }
  NcclReduce(const NcclReduce&) = delete;
  NcclReduce& operator=(const NcclReduce&) = delete;
  ~NcclReduce() override {
    for (ncclComm_t c : comms_) (void)ncclCommDestroy(c);
  }

  cellkv::Status sum(std::int32_t rank, T* data, std::size_t count, cudaStream_t stream) override {
    if (ncclAllReduce(data, data, count, type(), ncclSum, comms_[static_cast<std::size_t>(rank)], stream) != ncclSuccess)
      return cellkv::Errc::device_error;
    return {};
  }
  [[nodiscard]] bool capturable() const override { return true; }

 private:
  static constexpr ncclDataType_t type() {
    if constexpr (std::is_same_v<T, float>) return ncclFloat32;
    else if constexpr (std::is_same_v<T, __half>) return ncclFloat16;
    else return ncclBfloat16;
  }

  std::vector<ncclComm_t> comms_;
};

}  // namespace llama
