// llama/tp_llama.cuh - the example decoder split over G GPUs (tensor parallelism): rank g holds the
// query and KV heads of shard g (cellkv::head_shard) and MLP columns [g ffn / G, (g + 1) ffn / G)
// (shard_weights.hpp), attends through shard g of a cellkv::gpu::ShardedCache, and the ranks sum
// their partial outputs with one all-reduce after the attention output projection and one after the
// MLP. One host thread per rank; the host plans each step once (ShardedCache), every rank uploads
// it to its own shard. Satisfies cellkv::batching::Model: an Executor drives it like GpuLlama,
// but each forward waits for every rank (rank 0 samples on its device), so retire() returns at
// once; ids sampled by the previous step go in from the host.
// Refusals (the cache's, before any rank computes) leave every rank as it was; a CUDA failure on
// one rank mid-step can leave the others waiting in the all-reduce (as with NCCL itself), after
// which the model must be rebuilt.
#pragma once

#include <cellkv/batching/model.hpp>
#include <cellkv/gpu/sharded_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "all_reduce.cuh"
#include "config.hpp"
#include "gpu_rank.cuh"
#include "rank_threads.hpp"
#include "sampled_steps.hpp"
#include "shard_weights.hpp"

namespace llama {

template <class Sharded>
class TpLlama {
  using Shard = typename Sharded::Shard;
  using T = typename Sharded::Element;  // the model's arithmetic and the cache's K/V inputs

 public:
  // Splits the weights over the cache's shards and uploads each slice to its device. reduce must
  // span cache.shards() ranks (NcclReduce over the cache's devices, or DeviceSumReduce when they
  // are all one GPU). Throws std::invalid_argument when the model does not split over the shards,
  // std::runtime_error on a CUDA, cuBLAS or NCCL failure. Sets the cache's key rotation to the
  // model's RoPE (rope_spec), as GpuLlama does.
  TpLlama(const Config& c, const Weights& w, Sharded& cache, AllReduce<T>& reduce, GpuOptions options = {})
      : c_(c), cache_(cache), threads_(devices_of(cache)), ranks_(static_cast<std::size_t>(cache.shards())),
        streams_(static_cast<std::size_t>(cache.shards())) {
    const cellkv::Status built = threads_.run([&](std::int32_t g) -> cellkv::Status {
      const auto plan = shard_plan(c, cache.shards(), g);
      if (!plan.ok()) return plan.status();
      const auto r = static_cast<std::size_t>(g);
      streams_[r] = std::make_unique<cellkv::gpu::Stream>();
      ranks_[r] = std::make_unique<GpuRank<Shard>>(shard_config(c, plan.value()), shard_weights(c, w, plan.value()),
                                                    cache.shard(g), g, cache.host().max_write(), streams_[r]->get(),
                                                    &reduce, options);
      return {};
    });
    if (!built.ok()) {
      release();
      const std::string what = "llama::TpLlama: " + std::string(built.message());
      if (built.code() == cellkv::Errc::bad_shape || built.code() == cellkv::Errc::bad_head_ratio ||
          built.code() == cellkv::Errc::bad_argument)
        throw std::invalid_argument(what);
      throw std::runtime_error(what);
    }
    // The model's RoPE for the K rows seq_add / seq_div move (the executor's context shift).
    if (const cellkv::Status s = cache.set_key_rotation(cellkv::gpu::KeyRotation<typename Sharded::Storage>::rope(rope_spec(c))); !s.ok()) {
      release();
      throw std::invalid_argument("llama::TpLlama: the cache refused the model's key rotation (" +
                                  std::string(s.message()) + ")");
    }
    cache.set_graph_scope(options.graph_per_step_kinds ? cellkv::gpu::GraphScope::step_kinds
                                                       : cellkv::gpu::GraphScope::every_step);
  }
  TpLlama(const TpLlama&) = delete;
  TpLlama& operator=(const TpLlama&) = delete;
  ~TpLlama() { release(); }

  [[nodiscard]] std::int32_t vocab() const { return c_.vocab; }
  [[nodiscard]] std::int32_t min_prefill_tokens() const { return 2; }
  [[nodiscard]] const GraphStats& graph_stats() const { return ranks_.front()->graph_stats(); }

  // One step on every rank at once; rank 0 samples. Refuses (bad_argument) a deferred id the
  // previous step did not sample.
  cellkv::Status forward(const cellkv::batching::ForwardStep& step) {
    if (const cellkv::Status s = sampled_.resolve(step, tokens_); !s.ok()) return s;
    cellkv::batching::ForwardStep resolved = step;
    resolved.tokens = tokens_;
    resolved.deferred = {};
    const std::size_t samples = step.logit_rows.size();
    for (auto& r : scratch_) {
      r.tokens.resize(samples);
      r.logprobs.resize(samples);
    }
    const std::int32_t width = ranks_.front()->width_for(static_cast<std::int32_t>(step.tokens.size()));
    const cellkv::Status s = threads_.run([&](std::int32_t g) { return rank_step(g, resolved, width); });
    if (!s.ok()) return s;
    sampled_.push(scratch_.front());
    return {};
  }

  cellkv::Status retire(std::span<std::int32_t> tokens, std::span<float> logprobs) {
    return sampled_.retire(tokens, logprobs);
  }

 private:
  static std::vector<int> devices_of(const Sharded& cache) {
    std::vector<int> devices;
    for (std::int32_t g = 0; g < cache.shards(); ++g) devices.push_back(cache.device(g));
    return devices;
  }

  // Rank g's part of a step, on its own thread and device, waited for.
  cellkv::Status rank_step(std::int32_t g, const cellkv::batching::ForwardStep& step, std::int32_t width) {
    GpuRank<Shard>& rank = *ranks_[static_cast<std::size_t>(g)];
    SampledSteps::Step& out = scratch_[static_cast<std::size_t>(g)];
    if (const cellkv::Status s = rank.step(
            step, width, [&](::cuda::stream_ref st) { return cache_.upload_shard(g, st, width); },
            [&](::cuda::stream_ref st) { return cache_.shard(g).commit(st); });
        !s.ok())
      return s;
    return rank.retire(out.tokens, out.logprobs);
  }

  // Frees each rank's device objects on its own thread (its device current).
  void release() {
    (void)threads_.run([&](std::int32_t g) -> cellkv::Status {
      ranks_[static_cast<std::size_t>(g)].reset();
      streams_[static_cast<std::size_t>(g)].reset();
      return {};
    });
  }

  Config c_;
  Sharded& cache_;
  RankThreads threads_;
  std::vector<std::unique_ptr<GpuRank<Shard>>> ranks_;
  std::vector<std::unique_ptr<cellkv::gpu::Stream>> streams_;
  std::vector<SampledSteps::Step> scratch_ = std::vector<SampledSteps::Step>(static_cast<std::size_t>(ranks_.size()));  // per rank
  SampledSteps sampled_;
  std::vector<std::int32_t> tokens_;
};

}  // namespace llama
