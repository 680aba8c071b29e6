// llama/gpu_llama.cuh - the example decoder on one GPU: a DeviceCache and one GpuRank holding the
// whole model (gpu_rank.cuh has the forward, the device sampler and the CUDA-graph policy).
// Satisfies cellkv::batching::Model: forward() enqueues a step on the model's stream and returns;
// retire() waits for the oldest step's sampled ids. tp_llama.cuh is the same model split over
// several GPUs. The model computes in Cache::Element (fp32, bf16 or fp16); the cache stores K/V as
// Cache::Storage: that same type, or gpu::Fp8<Element> (E4M3 codes, quantized by the cache's write).
#pragma once

#include <cellkv/batching/model.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/key_rotation.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

#include "config.hpp"
#include "gpu_rank.cuh"

namespace llama {

template <class Cache>
class GpuLlama {
 public:
  // Uploads the weights and sets the cache's key rotation to the model's RoPE (rope_spec), so that
  // seq_add / seq_div (the executor's context shift) re-rotate K as the model computes it; throws
  // on a CUDA or cuBLAS failure, std::invalid_argument when the cache refuses the rotation. The
  // cache's pool must match the config (layers, H_kv, D) and its max_write bounds the step width.
  GpuLlama(const Config& c, const Weights& w, Cache& cache, cudaStream_t stream, GpuOptions options = {})
      : c_(c), cache_(cache), rank_(c, w, cache, 0, cache.host().max_write(), stream, nullptr, options) {
    using Rotation = cellkv::gpu::KeyRotation<typename Cache::Storage>;  // fp8 caches re-quantize moved K
    if (const cellkv::Status s = cache.set_key_rotation(Rotation::rope(rope_spec(c))); !s.ok())
      throw std::invalid_argument("llama::GpuLlama: the cache refused the model's key rotation (" +
                                  std::string(s.message()) + ")");
    cache.set_graph_scope(options.graph_per_step_kinds ? cellkv::gpu::GraphScope::step_kinds
                                                       : cellkv::gpu::GraphScope::every_step);
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
  Config c_;
  Cache& cache_;
  GpuRank<Cache> rank_;
};

}  // namespace llama
