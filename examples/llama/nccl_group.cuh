// llama/nccl_group.cuh - tensor-parallel ranks in processes of their own, one GPU each, on one
// machine or several, over NCCL: ncclCommInitRank with the id from the rendezvous (rank 0's
// ncclGetUniqueId through file:DIR or env; with tcp:HOST:PORT NCCL's own bootstrap, NCCL_COMM_ID).
// NVLink multicast stays off (NCCL_NVLS_ENABLE=0 before the communicator exists; cuMulticastCreate
// is never called).
//
// The communicator is nonblocking (ncclConfig_t::blocking = 0), so no call can wait forever: the
// join polls until every rank is in or the timeout passes, wait() polls the step's event and
// ncclCommGetAsyncError (NCCL's report of a peer whose connection broke) and, when the timeout
// passes first, aborts the communicator (ncclCommAbort: NCCL's kernels waiting on a dead peer
// return), after which every collective fails at once.
#pragma once

#include <cellkv/gpu/memory.hpp>
#include <cellkv/status.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "process_group.cuh"
#include "rank_world.hpp"
#include "rendezvous.hpp"

namespace llama {

// Makes a job's NCCL id and publishes it as "nccl-id" (file:DIR or env). The process that calls
// it hosts NCCL's bootstrap root for the job, so it must live until every rank has joined: rank 0,
// or the launcher that hands the id down to its ranks in the environment. Throws std::runtime_error.
inline ncclUniqueId publish_nccl_job_id(const Rendezvous& rendezvous) {
  ncclUniqueId id{};
  if (ncclGetUniqueId(&id) != ncclSuccess) throw std::runtime_error("llama::publish_nccl_job_id: ncclGetUniqueId failed");
  std::vector<std::byte> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  rendezvous.publish("nccl-id", bytes);
  return id;
}

// The job's NCCL id on rank `rank`: with tcp:HOST:PORT every rank derives it from NCCL_COMM_ID
// (rank 0's ncclCommInitRank then listens there); with file:DIR rank 0 makes and publishes it and
// the others fetch it (up to `timeout`); with env every rank reads what the launcher published.
// Throws std::runtime_error.
inline ncclUniqueId nccl_job_id(const Rendezvous& rendezvous, std::int32_t rank, std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  if (rendezvous.kind() == Rendezvous::Kind::tcp) {
    setenv("NCCL_COMM_ID", rendezvous.where().c_str(), 1);
    if (ncclGetUniqueId(&id) != ncclSuccess) throw std::runtime_error("llama::nccl_job_id: ncclGetUniqueId failed");
    return id;
  }
  if (rank == 0 && rendezvous.kind() == Rendezvous::Kind::file) return publish_nccl_job_id(rendezvous);
  const auto bytes = rendezvous.fetch("nccl-id", sizeof id, timeout);
  std::memcpy(&id, bytes.data(), sizeof id);
  return id;
}

template <class T>
class NcclGroup final : public ProcessGroup<T> {
 public:
  // Joins the job's communicator on the current device. Throws std::runtime_error when the id
  // cannot be had, NCCL refuses, or not every rank joins within `timeout` (then aborts).
  NcclGroup(const RankWorld& world, const Rendezvous& rendezvous, std::chrono::milliseconds timeout)
      : rank_(world.rank), ranks_(world.world), timeout_(timeout), digests_(static_cast<std::size_t>(world.world)) {
    world.check();
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    const ncclUniqueId id = nccl_job_id(rendezvous, rank_, timeout_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, ranks_, id, rank_, &config);
    if (!settle(r, "ncclCommInitRankConfig").ok()) {
      const std::string why = failure();
      abort();
      throw std::runtime_error("llama::NcclGroup: rank " + std::to_string(rank_) + " of " + std::to_string(ranks_) +
                               ": " + why);
    }
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  // A healthy communicator is finalized (bounded by the timeout) and destroyed, a failed one aborted.
  ~NcclGroup() override {
    if (comm_ == nullptr) return;
    if (!failed_ && settle(ncclCommFinalize(comm_), "ncclCommFinalize").ok()) {
      (void)ncclCommDestroy(comm_);
      comm_ = nullptr;
    } else {
      abort();
    }
  }

  [[nodiscard]] std::int32_t rank() const override { return rank_; }
  [[nodiscard]] std::int32_t ranks() const override { return ranks_; }
  [[nodiscard]] bool capturable() const override { return true; }

  cellkv::Status sum(std::int32_t, T* data, std::size_t count, cudaStream_t stream) override {
    if (failed_) return cellkv::Errc::device_error;
    return settle(ncclAllReduce(data, data, count, type(), ncclSum, comm_, stream), "ncclAllReduce");
  }

  cellkv::Status broadcast(void* data, std::size_t bytes, cudaStream_t stream) override {
    if (failed_) return cellkv::Errc::device_error;
    return settle(ncclBroadcast(data, data, bytes, ncclUint8, 0, comm_, stream), "ncclBroadcast");
  }

  cellkv::Status wait(cudaEvent_t done) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (failed_) return cellkv::Errc::device_error;
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess) return {};
      if (e != cudaErrorNotReady) return fail(std::string("the device: ") + cudaGetErrorString(e));
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess || (async != ncclSuccess && async != ncclInProgress))
        return fail_and_abort(std::string("NCCL reports ") + ncclGetErrorString(async) + " (a peer rank failed?)");
      if (std::chrono::steady_clock::now() >= deadline)
        return fail_and_abort("a step did not finish within " + std::to_string(timeout_.count()) +
                              " ms (a peer rank died or hangs); communicator aborted");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  cellkv::Result<bool> agree(std::uint64_t digest, cudaStream_t stream) override {
    if (failed_) return cellkv::Errc::device_error;
    std::uint64_t* slots = digests_.data();
    if (cudaMemcpyAsync(slots + rank_, &digest, sizeof digest, cudaMemcpyHostToDevice, stream) != cudaSuccess)
      return cellkv::Errc::device_error;
    if (const cellkv::Status s = settle(ncclAllGather(slots + rank_, slots, 1, ncclUint64, comm_, stream), "ncclAllGather");
        !s.ok())
      return s.code();
    if (const cellkv::Status s = this->wait_for(stream); !s.ok()) return s.code();
    std::vector<std::uint64_t> all(static_cast<std::size_t>(ranks_));  // copied once the gather is done: no unbounded wait
    if (cudaMemcpy(all.data(), slots, all.size() * sizeof digest, cudaMemcpyDeviceToHost) != cudaSuccess)
      return cellkv::Errc::device_error;
    for (const std::uint64_t d : all)
      if (d != digest) return false;
    return true;
  }

  [[nodiscard]] std::string failure() const override {
    const std::lock_guard lock(mutex_);
    return failure_;
  }

 private:
  static constexpr ncclDataType_t type() {
    if constexpr (std::is_same_v<T, float>) return ncclFloat32;
    else if constexpr (std::is_same_v<T, __half>) return ncclFloat16;
    else return ncclBfloat16;
  }

  // A call's result, waiting (bounded) while the nonblocking communicator reports it in progress.
  cellkv::Status settle(ncclResult_t r, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() >= deadline)
        return fail(std::string(what) + " did not complete within " + std::to_string(timeout_.count()) +
                    " ms (does every rank run, with the same rendezvous?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) r = ncclInternalError;
    }
    if (r == ncclSuccess) return {};
    return fail(std::string(what) + ": " + ncclGetErrorString(r) + " (" + ncclGetLastError(comm_) + ")");
  }

  cellkv::Status fail(const std::string& why) {
    const std::lock_guard lock(mutex_);
    if (failure_.empty()) failure_ = "rank " + std::to_string(rank_) + ": " + why;
    failed_ = true;
    return cellkv::Errc::device_error;
  }

  cellkv::Status fail_and_abort(const std::string& why) {
    const cellkv::Status s = fail(why);
    abort();
    return s;
  }

  void abort() noexcept {
    if (comm_ != nullptr) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    failed_ = true;
  }

  std::int32_t rank_, ranks_;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  cellkv::gpu::DeviceBuffer<std::uint64_t> digests_;  // [ranks] for agree()
  bool failed_ = false;
  mutable std::mutex mutex_;
  std::string failure_;
};

}  // namespace llama
