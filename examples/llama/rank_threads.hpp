// llama/rank_threads.hpp - one host thread per tensor-parallel rank, each with its device current
// for its whole life. run(work) runs work(rank) on every rank's thread at once and waits for all.
#pragma once

#include <cellkv/status.hpp>

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace llama {

class RankThreads {
 public:
  using Work = std::function<cellkv::Status(std::int32_t rank)>;

  explicit RankThreads(std::vector<int> devices) : results_(devices.size()) {
    for (std::size_t r = 0; r < devices.size(); ++r)
      threads_.emplace_back([this, r, device = devices[r]] { serve(static_cast<std::int32_t>(r), device); });
  }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;
  ~RankThreads() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }

  [[nodiscard]] std::int32_t ranks() const noexcept { return static_cast<std::int32_t>(threads_.size()); }

  // Runs work(r) on rank r's thread for every r; returns the first failure in rank order. An
  // exception in work counts as device_error. Not reentrant.
  cellkv::Status run(const Work& work) {
    std::unique_lock lock(mutex_);
    work_ = &work;
    pending_ = ranks();
    ++generation_;
    wake_.notify_all();
    done_.wait(lock, [this] { return pending_ == 0; });
    work_ = nullptr;
    for (const cellkv::Status s : results_)
      if (!s.ok()) return s;
    return {};
  }

 private:
  void serve(std::int32_t rank, int device) {
    const bool on_device = cudaSetDevice(device) == cudaSuccess;
    std::uint64_t seen = 0;
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const Work* work = work_;
      lock.unlock();
      cellkv::Status result = cellkv::Errc::device_error;
      if (on_device) {
        try {
          result = (*work)(rank);
        } catch (...) {
          result = cellkv::Errc::device_error;
        }
      }
      lock.lock();
      results_[static_cast<std::size_t>(rank)] = result;
      if (--pending_ == 0) done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const Work* work_ = nullptr;
  std::uint64_t generation_ = 0;
  std::int32_t pending_ = 0;
  bool stop_ = false;
  std::vector<cellkv::Status> results_;
  std::vector<std::thread> threads_;
};

}  // namespace llama
