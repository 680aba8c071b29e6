// llama/gpu_llama.cuh - the example decoder on one GPU: a DeviceCache and one GpuRank holding the
// whole model (gpu_rank.cuh has the forward and the CUDA-graph policy). Satisfies
// cellkv::batching::Model. tp_llama.cuh is the same model split over several GPUs.
#pragma once

#include <cellkv/batching/model.hpp>
#include <cellkv/cuda/device_cache.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <span>

#include "config.hpp"
#include "gpu_rank.cuh"

namespace llama {

template <class Cache>
class GpuLlama {
 public:
  // Uploads the weights; throws on a CUDA or cuBLAS failure. The cache's pool must match the
  // config (layers, H_kv, D) and its max_write bounds the step width.
  GpuLlama(const Config& c, const Weights& w, Cache& cache, cudaStream_t stream, GpuOptions options = {})
      : c_(c), cache_(cache), rank_(c, w, cache, 0, cache.host().max_write(), stream, nullptr, options) {}

  [[nodiscard]] std::int32_t vocab() const { return c_.vocab; }
  [[nodiscard]] std::int32_t min_prefill_tokens() const { return 2; }
  [[nodiscard]] const GraphStats& graph_stats() const { return rank_.graph_stats(); }

  cellkv::Status forward(const cellkv::batching::ForwardStep& step, std::span<float> logits) {
    const std::int32_t width = rank_.width_for(static_cast<std::int32_t>(step.tokens.size()));
    const ::cuda::stream_ref stream(rank_.stream());
    if (const cellkv::Status s = rank_.stage(step, width); !s.ok()) return s;
    if (const cellkv::Status s = cache_.upload(stream, width); !s.ok()) return s;
    if (const cellkv::Status s = rank_.run(width); !s.ok()) return s;
    if (const cellkv::Status s = cache_.commit(stream); !s.ok()) return s;
    if (const cellkv::Status s = rank_.fetch_logits(step.logit_rows); !s.ok()) return s;
    CELLKV_CUDA_STATUS(cudaStreamSynchronize(rank_.stream()));
    std::memcpy(logits.data(), rank_.logits(), step.logit_rows.size() * static_cast<std::size_t>(c_.vocab) * sizeof(float));
    return {};
  }

 private:
  Config c_;
  Cache& cache_;
  GpuRank<Cache> rank_;
};

}  // namespace llama
