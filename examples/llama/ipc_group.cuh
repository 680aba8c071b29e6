// llama/ipc_group.cuh - tensor-parallel ranks in processes of their own that share ONE GPU: the
// smoke test of the multi-process path on a machine with one GPU (NCCL refuses two ranks on one
// device). Not for speed: every collective meets on the host.
//
// Each rank allocates an exchange buffer of max_bytes on the device, exports it through CUDA IPC
// and maps every other rank's; the ranks meet through a small file mapped by all of them in the
// rendezvous directory (file:DIR only). A meeting is a host function on the rank's stream (CUDA
// graphs capture it), so it runs once the work before it is done:
//   sum(data):       copy data to my buffer; meet; data = the sum of every rank's buffer, in rank
//                    order (the same bytes on every rank); meet (no buffer is refilled before
//                    every rank has read it).
//   broadcast(data): rank 0 copies data to its buffer; meet; the others copy it out; meet.
//   agree(digest):   each rank's digest in the shared file; meet; compare; meet.
// A meeting that some rank does not reach within the timeout, or whose process is gone, fails: the
// failure is recorded (failure() names the rank), every later meeting returns at once, and wait()
// and agree() report device_error. Kernels after a failed meeting compute what nobody reads.
#pragma once

#include <cellkv/gpu/memory.hpp>
#include <cellkv/status.hpp>

#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gpu_kernels.cuh"
#include "process_group.cuh"
#include "rank_world.hpp"
#include "rendezvous.hpp"

namespace llama {

template <class T>
class IpcGroup final : public ProcessGroup<T> {
 public:
  static constexpr std::int32_t kMaxRanks = 8;

  // Joins the group of world.world ranks on the current device. max_bytes bounds sum() (count *
  // sizeof(T)) and broadcast(). Throws std::invalid_argument unless world.world <= kMaxRanks and the
  // rendezvous is file:DIR, std::runtime_error when a rank does not show up within `timeout` or a
  // CUDA call fails.
  IpcGroup(const RankWorld& world, const Rendezvous& rendezvous, std::size_t max_bytes,
           std::chrono::milliseconds timeout)
      : rank_(world.rank), ranks_(world.world), max_bytes_(max_bytes), timeout_(timeout) {
    world.check();
    if (ranks_ > kMaxRanks) throw std::invalid_argument("llama::IpcGroup: at most 8 ranks");
    if (rendezvous.kind() != Rendezvous::Kind::file)
      throw std::invalid_argument("llama::IpcGroup: needs a file:DIR rendezvous (the ranks map a file there)");
    map_shared(rendezvous);
    shared_->pids[rank_] = getpid();
    mine_ = cellkv::gpu::DeviceBuffer<std::byte>(max_bytes_);
    cudaIpcMemHandle_t handle{};
    if (cudaIpcGetMemHandle(&handle, mine_.data()) != cudaSuccess)
      throw std::runtime_error("llama::IpcGroup: cudaIpcGetMemHandle failed");
    rendezvous.publish("ipc-buffer-" + std::to_string(rank_), as_bytes(handle));
    buffers_[static_cast<std::size_t>(rank_)] = mine_.data();
    for (std::int32_t r = 0; r < ranks_; ++r) {
      if (r == rank_) continue;
      const auto bytes = rendezvous.fetch("ipc-buffer-" + std::to_string(r), sizeof(handle), timeout_);
      std::memcpy(&handle, bytes.data(), sizeof(handle));
      void* peer = nullptr;
      if (cudaIpcOpenMemHandle(&peer, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
        close_peers();
        throw std::runtime_error("llama::IpcGroup: cudaIpcOpenMemHandle of rank " + std::to_string(r) + " failed");
      }
      buffers_[static_cast<std::size_t>(r)] = static_cast<std::byte*>(peer);
    }
    meet();  // every rank has mapped every buffer
    if (failed_) {
      close_peers();
      throw std::runtime_error("llama::IpcGroup: " + failure());
    }
  }
  IpcGroup(const IpcGroup&) = delete;
  IpcGroup& operator=(const IpcGroup&) = delete;
  ~IpcGroup() override {
    close_peers();
    if (shared_ != nullptr) (void)munmap(shared_, sizeof(Shared));
  }

  [[nodiscard]] std::int32_t rank() const override { return rank_; }
  [[nodiscard]] std::int32_t ranks() const override { return ranks_; }
  [[nodiscard]] bool capturable() const override { return true; }

  cellkv::Status sum(std::int32_t, T* data, std::size_t count, cudaStream_t stream) override {
    const std::size_t bytes = count * sizeof(T);
    if (bytes > max_bytes_) return cellkv::Errc::bad_argument;
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(mine_.data(), data, bytes, cudaMemcpyDeviceToDevice, stream));
    if (const cellkv::Status s = meet_on(stream); !s.ok()) return s;
    kernels::Parts<T, kMaxRanks> parts{};
    for (std::int32_t r = 0; r < ranks_; ++r) parts.p[r] = reinterpret_cast<T*>(buffers_[static_cast<std::size_t>(r)]);
    kernels::sum_parts<T, kMaxRanks><<<264, 256, 0, stream>>>(parts, ranks_, static_cast<std::int64_t>(count), data);
    CELLKV_CUDA_STATUS(cudaGetLastError());
    return meet_on(stream);
  }

  cellkv::Status broadcast(void* data, std::size_t bytes, cudaStream_t stream) override {
    if (bytes > max_bytes_) return cellkv::Errc::bad_argument;
    if (rank_ == 0) CELLKV_CUDA_STATUS(cudaMemcpyAsync(mine_.data(), data, bytes, cudaMemcpyDeviceToDevice, stream));
    if (const cellkv::Status s = meet_on(stream); !s.ok()) return s;
    if (rank_ != 0) CELLKV_CUDA_STATUS(cudaMemcpyAsync(data, buffers_[0], bytes, cudaMemcpyDeviceToDevice, stream));
    return meet_on(stream);
  }

  cellkv::Status wait(cudaEvent_t done) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (failed_) return cellkv::Errc::device_error;
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess) return failed_ ? cellkv::Status(cellkv::Errc::device_error) : cellkv::Status{};
      if (e != cudaErrorNotReady) return fail("rank " + std::to_string(rank_) + ": " + cudaGetErrorString(e));
      if (std::chrono::steady_clock::now() >= deadline)
        return fail("rank " + std::to_string(rank_) + ": a step did not finish within " +
                    std::to_string(timeout_.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  cellkv::Result<bool> agree(std::uint64_t digest, cudaStream_t stream) override {
    if (const cellkv::Status s = this->wait_for(stream); !s.ok()) return s.code();
    shared_->digests[rank_] = digest;
    meet();
    bool same = true;
    for (std::int32_t r = 0; r < ranks_; ++r) same = same && shared_->digests[r] == digest;
    meet();
    if (failed_) return cellkv::Errc::device_error;
    return same;
  }

  [[nodiscard]] std::string failure() const override {
    const std::lock_guard lock(mutex_);
    return failure_;
  }

 private:
  // The file every rank maps: lock-free atomics, so they work across processes.
  struct Shared {
    std::atomic<std::uint64_t> arrived;  // meetings reached, summed over ranks
    std::atomic<std::int32_t> failed;    // 1 + the rank that saw a meeting fail, or 0
    std::int32_t pids[kMaxRanks];
    std::uint64_t digests[kMaxRanks];
  };

  template <class H>
  static std::vector<std::byte> as_bytes(const H& h) {
    std::vector<std::byte> out(sizeof(H));
    std::memcpy(out.data(), &h, sizeof(H));
    return out;
  }

  // Rank 0 creates DIR/ipc-shared (exclusively: a previous job's file is refused) and publishes
  // that it is ready; the others wait for that, then map it.
  void map_shared(const Rendezvous& rendezvous) {
    const std::string path = rendezvous.where() + "/ipc-shared";
    int fd = -1;
    if (rank_ == 0) {
      fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd < 0 || ftruncate(fd, sizeof(Shared)) != 0) {
        if (fd >= 0) close(fd);
        throw std::runtime_error("llama::IpcGroup: cannot create " + path + " (a previous job's? use an empty directory)");
      }
    } else {
      (void)rendezvous.fetch("ipc-shared-ready", 0, timeout_);
      fd = open(path.c_str(), O_RDWR);
      if (fd < 0) throw std::runtime_error("llama::IpcGroup: cannot open " + path);
    }
    void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("llama::IpcGroup: cannot map " + path);
    shared_ = static_cast<Shared*>(p);  // zero-filled by ftruncate: no meeting reached, none failed
    if (rank_ == 0) rendezvous.publish("ipc-shared-ready", {});
  }

  void close_peers() noexcept {
    for (std::int32_t r = 0; r < ranks_; ++r) {
      std::byte*& b = buffers_[static_cast<std::size_t>(r)];
      if (r != rank_ && b != nullptr) (void)cudaIpcCloseMemHandle(b);
      b = nullptr;
    }
  }

  cellkv::Status meet_on(cudaStream_t stream) {
    CELLKV_CUDA_STATUS(cudaLaunchHostFunc(stream, [](void* self) { static_cast<IpcGroup*>(self)->meet(); }, this));
    return {};
  }

  // Arrives at the next meeting and waits until every rank has (or it fails). Runs on the host
  // thread CUDA runs host functions on, or on the caller's (agree, construction); never both at once.
  void meet() noexcept {
    if (failed_) return;
    const std::uint64_t target = ++meetings_ * static_cast<std::uint64_t>(ranks_);
    shared_->arrived.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (std::uint32_t spins = 0; shared_->arrived.load() < target; ++spins) {
      if (const std::int32_t f = shared_->failed.load(); f != 0) {
        (void)fail("rank " + std::to_string(f - 1) + " saw a meeting fail: it or another rank is gone");
        return;
      }
      if (spins % 64 == 63) {
        if (const std::int32_t gone = missing_rank(); gone >= 0) {
          (void)fail("rank " + std::to_string(gone) + " (pid " + std::to_string(shared_->pids[gone]) +
                     ") has exited; rank " + std::to_string(rank_) + " cannot go on");
          return;
        }
        if (std::chrono::steady_clock::now() >= deadline) {
          (void)fail("a rank did not reach meeting " + std::to_string(meetings_) + " within " +
                     std::to_string(timeout_.count()) + " ms (rank " + std::to_string(rank_) + " waited)");
          return;
        }
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // A rank whose process has ended (gone, or a zombie not yet reaped), or -1.
  [[nodiscard]] std::int32_t missing_rank() const {
    for (std::int32_t r = 0; r < ranks_; ++r) {
      const std::int32_t pid = shared_->pids[r];
      if (r == rank_ || pid == 0) continue;
      std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
      if (f == nullptr) return r;
      char line[512] = {};
      const bool read = std::fgets(line, sizeof line, f) != nullptr;
      std::fclose(f);
      const char* paren = read ? std::strrchr(line, ')') : nullptr;
      if (paren == nullptr || paren[1] == '\0' || paren[2] == 'Z' || paren[2] == 'X') return r;
    }
    return -1;
  }

  cellkv::Status fail(const std::string& why) {
    {
      const std::lock_guard lock(mutex_);
      if (failure_.empty()) failure_ = why;
    }
    failed_ = true;
    std::int32_t none = 0;
    (void)shared_->failed.compare_exchange_strong(none, rank_ + 1);
    return cellkv::Errc::device_error;
  }

  std::int32_t rank_, ranks_;
  std::size_t max_bytes_;
  std::chrono::milliseconds timeout_;
  Shared* shared_ = nullptr;
  cellkv::gpu::DeviceBuffer<std::byte> mine_;
  std::array<std::byte*, kMaxRanks> buffers_{};  // every rank's exchange buffer, mapped here
  std::atomic<std::uint64_t> meetings_{0};
  std::atomic<bool> failed_{false};
  mutable std::mutex mutex_;
  std::string failure_;
};

}  // namespace llama
