// llama/process_group.cuh - the collectives of tensor-parallel ranks that each run in a process
// of their own (one per GPU over NCCL: nccl_group.cuh; several sharing one GPU for smoke tests:
// ipc_group.cuh). Besides the sum every AllReduce has:
//  - broadcast: rank 0's sampled ids reach every rank's device, so every process's executor plans
//    the same next step from them (and deferred ids resolve on every device);
//  - agree: the ranks compare a digest of each step's plan (cellkv::plan_digest), so a rank whose
//    verbs diverged is caught at the step where it did;
//  - bounded waits: a rank that died or hangs makes the others fail within the group's timeout with
//    an error that names it (failure()), never wait forever.
#pragma once

#include <cellkv/gpu/error.hpp>
#include <cellkv/status.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "all_reduce.cuh"

namespace llama {

template <class T>
class ProcessGroup : public AllReduce<T> {
 public:
  [[nodiscard]] virtual std::int32_t rank() const = 0;
  [[nodiscard]] virtual std::int32_t ranks() const = 0;
  // Copies rank 0's `bytes` at data to every rank's data, ordered on `stream` (captured into CUDA
  // graphs like sum()). bad_argument when bytes exceeds what the group was built for.
  virtual cellkv::Status broadcast(void* data, std::size_t bytes, cudaStream_t stream) = 0;
  // Blocks until `done` (an event recorded on the rank's stream) has completed, for at most the
  // group's timeout. device_error when a rank failed or did not keep up in time, or the device
  // failed; failure() then says which.
  virtual cellkv::Status wait(cudaEvent_t done) = 0;
  // Waits for `stream`, then for every rank's digest (bounded like wait()); true when all equal
  // this rank's, false when some differ (the ranks' plans diverged).
  virtual cellkv::Result<bool> agree(std::uint64_t digest, cudaStream_t stream) = 0;
  // What failed, for the error message; empty while nothing has.
  [[nodiscard]] virtual std::string failure() const = 0;

 protected:
  // wait() for everything enqueued on `stream` so far.
  cellkv::Status wait_for(cudaStream_t stream) {
    cudaEvent_t done = nullptr;
    CELLKV_CUDA_STATUS(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    const cellkv::Status s =
        cudaEventRecord(done, stream) == cudaSuccess ? wait(done) : cellkv::Status(cellkv::Errc::device_error);
    (void)cudaEventDestroy(done);
    return s;
  }
};

}  // namespace llama
