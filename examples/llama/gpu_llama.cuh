// llama/gpu_llama.cuh - the example decoder on one GPU: a DeviceCache and one GpuRank holding the
// whole model (gpu_rank.cuh has the forward, the device sampler and the CUDA-graph policy).
// Satisfies cellkv::batching::Model: forward() enqueues a step on the model's stream and returns;
// retire() waits for the oldest step's sampled ids. tp_llama.cuh is the same model split over
// several GPUs driven by threads of one process; GpuLlama over a ProcessGroup is one rank of it in
// a process of its own (one process per GPU, cellkv-tp-demo). The model computes in Cache::Element
// (fp32, bf16 or fp16); the cache stores K/V as Cache::Storage: that same type, or
// gpu::Fp8<Element> (E4M3 codes, quantized by the cache's write).
#pragma once

#include <cellkv/batching/model.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/key_rotation.cuh>
#include <cellkv/plan_digest.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "config.hpp"
#include "gpu_rank.cuh"
#include "process_group.cuh"
#include "shard_weights.hpp"

namespace llama {

template <class Cache>
class GpuLlama {
 public:
  using T = typename Cache::Element;  // the model's arithmetic

  // Uploads the weights and sets the cache's key rotation to the model's RoPE (rope_spec), so that
  // seq_add / seq_div (the executor's context shift) re-rotate K as the model computes it; throws
  // on a CUDA or cuBLAS failure, std::invalid_argument when the cache refuses the rotation. The
  // cache's pool must match the config (layers, H_kv, D) and its max_write bounds the step width.
  GpuLlama(const Config& c, const Weights& w, Cache& cache, cudaStream_t stream, GpuOptions options = {})
      : c_(c), cache_(cache), stream_(stream), rank_(c, w, cache, 0, cache.host().max_write(), stream, nullptr, options) {
    configure_cache(options);
  }

  // One rank of the model split over the processes of `group` (tensor parallelism, one process per
  // GPU): `cache` holds this rank's heads (shard group.rank() of group.ranks(), cellkv::head_shard),
  // the rank computes them and its MLP columns (shard_weights.hpp) and sums through the group, and
  // every rank's retire() returns rank 0's sampled ids, so each process's executor, replaying the
  // same verbs, plans the same next step. With options.check_plans, forward() first compares the
  // step's cellkv::plan_digest across ranks and refuses (bad_argument) a step whose plans differ.
  // Throws std::invalid_argument when the model does not split over the group's ranks.
  GpuLlama(const Config& c, const Weights& w, Cache& cache, cudaStream_t stream, ProcessGroup<T>& group,
           GpuOptions options = {})
      : c_(c), cache_(cache), stream_(stream), group_(&group), check_plans_(options.check_plans),
        rank_(shard_config(c, plan_of(c, group)), shard_weights(c, w, plan_of(c, group)), cache, group.rank(),
              cache.host().max_write(), stream, &group, options) {
    configure_cache(options);
  }

  [[nodiscard]] std::int32_t vocab() const { return c_.vocab; }
  [[nodiscard]] std::int32_t min_prefill_tokens() const { return 2; }
  [[nodiscard]] const GraphStats& graph_stats() const { return rank_.graph_stats(); }
  // GPU time per phase of the steps retired so far (GpuOptions::profile), and its reset.
  [[nodiscard]] const PhaseTimes& phase_times() const { return rank_.phase_times(); }
  void reset_phase_times() { rank_.reset_phase_times(); }
  void set_profile(bool on) { rank_.set_profile(on); }

  // Enqueues the step (token ids and sampling rows up, the cache's upload, the forward and the
  // sampler, the cache's commit, the sampled ids down); does not wait for it.
  cellkv::Status forward(const cellkv::batching::ForwardStep& step) {
    if (group_ != nullptr && check_plans_) {
      const cellkv::Result<bool> same = group_->agree(cellkv::plan_digest(cache_.host()), stream_);
      if (!same.ok()) return same.status();
      if (!same.value()) return cellkv::Errc::bad_argument;  // the ranks' verbs diverged
    }
    const std::int32_t width = rank_.width_for(static_cast<std::int32_t>(step.tokens.size()));
    return rank_.step(
        step, width, [&](::cuda::stream_ref s) { return cache_.upload(s, width); },
        [&](::cuda::stream_ref s) { return cache_.commit(s); });
  }

  cellkv::Status retire(std::span<std::int32_t> tokens, std::span<float> logprobs) {
    return rank_.retire(tokens, logprobs);
  }

  // The logits of row `row` of the last step; waits for the stream (tests).
  cellkv::Status copy_logits(std::int32_t row, std::span<float> out) const { return rank_.copy_logits(row, out); }

 private:
  static ShardPlan plan_of(const Config& c, const ProcessGroup<T>& group) {
    const cellkv::Result<ShardPlan> plan = shard_plan(c, group.ranks(), group.rank());
    if (!plan.ok())
      throw std::invalid_argument("llama::GpuLlama: the model does not split over " + std::to_string(group.ranks()) +
                                  " ranks (" + std::string(plan.status().message()) + ")");
    return plan.value();
  }

  // The model's RoPE for the K rows seq_add / seq_div move (fp8 caches re-quantize moved K), and
  // the scope of the captured graphs.
  void configure_cache(const GpuOptions& options) {
    using Rotation = cellkv::gpu::KeyRotation<typename Cache::Storage>;
    if (const cellkv::Status s = cache_.set_key_rotation(Rotation::rope(rope_spec(c_))); !s.ok())
      throw std::invalid_argument("llama::GpuLlama: the cache refused the model's key rotation (" +
                                  std::string(s.message()) + ")");
    cache_.set_graph_scope(options.graph_per_step_kinds ? cellkv::gpu::GraphScope::step_kinds
                                                        : cellkv::gpu::GraphScope::every_step);
  }

  Config c_;
  Cache& cache_;
  cudaStream_t stream_;
  ProcessGroup<T>* group_ = nullptr;
  bool check_plans_ = false;
  GpuRank<Cache> rank_;
};

}  // namespace llama
