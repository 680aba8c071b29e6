// llama/gpu_rank.cuh - one GPU's part of the example decoder: cuBLAS GEMMs (T inputs, fp32
// accumulation), the small kernels of gpu_kernels.cuh and cellkv's update_and_attend per layer, on
// the heads and MLP columns of its shard (the whole model when G = 1).
//
// Per layer: h = rmsnorm(x); q, k, v = h Wq_g, h Wk_g, h Wv_g; RoPE; attn = update_and_attend;
// x = all_reduce(x + attn Wo_g) (rank 0 adds the residual, other ranks contribute attn Wo_g only);
// h = rmsnorm(x); x = all_reduce(x + swiglu(h W1_g, h W3_g) W2_g), likewise. Logits on rank 0.
//
// CUDA graphs: a step of T tokens runs at width 1 (T == 1) or the next power of two >= T up to
// max_graph_width; each width is captured once (the forward reads only fixed-address buffers:
// token ids, positions, the cache's step buffers), then replayed for every later step of that
// width, whatever the mix of sessions. Padding rows write the pool's scratch row and see nothing;
// their logits are never read. Wider steps, and every step when the all-reduce cannot be captured,
// run eagerly.
//
// Every call runs on the calling thread's current device, which must be the rank's device.
#pragma once

#include <cellkv/batching/model.hpp>
#include <cellkv/cuda/graph.hpp>
#include <cellkv/cuda/memory.hpp>
#include <cellkv/cuda/stream.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "all_reduce.cuh"
#include "config.hpp"
#include "gpu_kernels.cuh"

namespace llama {

#define LLAMA_CUBLAS(expr)                                                                            \
  do {                                                                                                \
    if ((expr) != CUBLAS_STATUS_SUCCESS) return cellkv::Status(cellkv::Errc::device_error);          \
  } while (0)

struct GpuOptions {
  std::int32_t max_graph_width = 64;  // widths above run eagerly
  bool graphs = true;
};

struct GraphStats {
  std::int64_t captures = 0, replays = 0, eager = 0;
};

// Attention: what the rank attends through (a DeviceCache or one DeviceShard of a ShardedCache):
// update_and_attend(layer, q, k, v, out, width, heads_q, scale, stream) over this rank's heads.
template <class Attention>
class GpuRank {
 public:
  using T = typename Attention::Element;

  // config, weights: this rank's slice (shard_config / shard_weights; the whole model for G = 1).
  // reduce: the all-reduce over ranks, nullptr for one GPU. Throws on a CUDA or cuBLAS failure.
  GpuRank(const Config& config, const Weights& weights, const Attention& attention, std::int32_t rank,
          std::int32_t max_width, cudaStream_t stream, AllReduce<T>* reduce, GpuOptions options)
      : c_(config), attention_(attention), rank_(rank), max_width_(max_width), stream_(stream), reduce_(reduce),
        options_(options) {
    if (reduce_ != nullptr && !reduce_->capturable()) options_.graphs = false;
    if (cublasCreate(&blas_) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
    workspace_ = cellkv::gpu::DeviceBuffer<std::byte>(32u << 20);
    if (cublasSetStream(blas_, stream_) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(blas_, workspace_.data(), workspace_.size()) != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("cuBLAS setup failed");
    upload_weights(weights);
    allocate();
  }
  GpuRank(const GpuRank&) = delete;
  GpuRank& operator=(const GpuRank&) = delete;
  ~GpuRank() { (void)cublasDestroy(blas_); }

  [[nodiscard]] const GraphStats& graph_stats() const { return stats_; }
  [[nodiscard]] cudaStream_t stream() const { return stream_; }

  // The width a step of t tokens runs at (graph buckets; see the file comment).
  [[nodiscard]] std::int32_t width_for(std::int32_t t) const {
    if (!options_.graphs || t > options_.max_graph_width) return t;
    std::int32_t w = t == 1 ? 1 : 2;
    while (w < t) w *= 2;
    return std::min(w, max_width_) >= t ? std::min(w, max_width_) : t;
  }

  // Enqueues the copy of the step's token ids and positions (padding rows: token 0, position 0).
  cellkv::Status stage(const cellkv::batching::ForwardStep& step, std::int32_t width) {
    const auto tokens = static_cast<std::int32_t>(step.tokens.size());
    for (std::int32_t t = 0; t < width; ++t) {
      staging_ids_.data()[t] = t < tokens ? step.tokens[static_cast<std::size_t>(t)] : 0;
      staging_ids_.data()[max_width_ + t] = t < tokens ? step.positions[static_cast<std::size_t>(t)] : 0;
    }
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(ids_.data(), staging_ids_.data(), ids_.bytes(), cudaMemcpyHostToDevice, stream_));
    return {};
  }

  // Replays the width's graph (capturing it the first time), or runs eagerly. The step must be
  // uploaded to the attention's cache at this width.
  cellkv::Status run(std::int32_t width) {
    if (!options_.graphs || width > options_.max_graph_width) {
      ++stats_.eager;
      return layers(width);
    }
    auto it = graphs_.find(width);
    if (it == graphs_.end()) {
      cellkv::Status inside;
      cellkv::gpu::GraphExec g = cellkv::gpu::capture(::cuda::stream_ref(stream_), [&] { inside = layers(width); });
      if (!inside.ok()) return inside;
      it = graphs_.emplace(width, std::move(g)).first;
      ++stats_.captures;
    }
    ++stats_.replays;
    return it->second.replay(::cuda::stream_ref(stream_));
  }

  // Enqueues the copy of logit rows `rows` (rank 0) to host staging, read by logits() once the
  // stream is synchronized.
  cellkv::Status fetch_logits(std::span<const std::int32_t> rows) {
    const auto row_bytes = static_cast<std::size_t>(c_.vocab) * sizeof(float);
    for (std::size_t i = 0; i < rows.size(); ++i)
      CELLKV_CUDA_STATUS(cudaMemcpyAsync(staging_logits_.data() + i * static_cast<std::size_t>(c_.vocab),
                                         logits_.data() + static_cast<std::size_t>(rows[i]) * c_.vocab, row_bytes,
                                         cudaMemcpyDeviceToHost, stream_));
    return {};
  }
  [[nodiscard]] const float* logits() const { return staging_logits_.data(); }

 private:
  struct Layer {
    cellkv::gpu::DeviceBuffer<T> attn_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2;
  };

  // y [rows, out] = x [rows, in] W [in, out] (+ y when accumulate); fp32 accumulation.
  cellkv::Status gemm(const T* x, const T* w, void* y, bool y_float, std::int32_t rows, std::int32_t in,
                      std::int32_t out, bool accumulate) {
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    const cudaDataType t = std::is_same_v<T, float> ? CUDA_R_32F : std::is_same_v<T, __half> ? CUDA_R_16F : CUDA_R_16BF;
    LLAMA_CUBLAS(cublasGemmEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, &alpha, w, t, out, x, t, in, &beta, y,
                              y_float ? CUDA_R_32F : t, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return {};
  }

  // x = sum over ranks of x_r (rank 0 holds x + its part, other ranks their part only).
  cellkv::Status reduce(T* x, std::int32_t width) {
    if (reduce_ == nullptr) return {};
    return reduce_->sum(rank_, x, static_cast<std::size_t>(width) * static_cast<std::size_t>(c_.dim), stream_);
  }

  // The forward of `width` rows over every layer and the logits: fixed buffers only (capturable).
  cellkv::Status layers(std::int32_t width) {
    const std::int32_t dim = c_.dim, q_w = c_.q_width(), kv_w = c_.kv_width();
    const bool residual = rank_ == 0;  // the rank that carries x through the all-reduce
    const std::int32_t* tokens = ids_.data();
    const std::int32_t* positions = ids_.data() + max_width_;
    kernels::embed<T><<<width, 256, 0, stream_>>>(tokens, embed_.data(), x_.data(), dim);
    for (std::int32_t l = 0; l < c_.layers; ++l) {
      Layer& lw = layers_[static_cast<std::size_t>(l)];
      kernels::rmsnorm<T><<<width, 256, 0, stream_>>>(x_.data(), lw.attn_norm.data(), h_.data(), dim, c_.norm_eps);
      if (const auto s = gemm(h_.data(), lw.wq.data(), q_.data(), false, width, dim, q_w, false); !s.ok()) return s;
      if (const auto s = gemm(h_.data(), lw.wk.data(), k_.data(), false, width, dim, kv_w, false); !s.ok()) return s;
      if (const auto s = gemm(h_.data(), lw.wv.data(), v_.data(), false, width, dim, kv_w, false); !s.ok()) return s;
      kernels::rope<T><<<width, 128, 0, stream_>>>(q_.data(), positions, c_.heads_q, c_.head_dim, c_.rope_theta);
      kernels::rope<T><<<width, 128, 0, stream_>>>(k_.data(), positions, c_.heads_kv, c_.head_dim, c_.rope_theta);
      if (const auto s = attention_.update_and_attend(l, q_.data(), k_.data(), v_.data(), attn_.data(), width,
                                                      c_.heads_q, 0.f, ::cuda::stream_ref(stream_));
          !s.ok())
        return s;
      if (const auto s = gemm(attn_.data(), lw.wo.data(), x_.data(), false, width, q_w, dim, residual); !s.ok()) return s;
      if (const auto s = reduce(x_.data(), width); !s.ok()) return s;
      kernels::rmsnorm<T><<<width, 256, 0, stream_>>>(x_.data(), lw.ffn_norm.data(), h_.data(), dim, c_.norm_eps);
      if (const auto s = gemm(h_.data(), lw.w1.data(), a_.data(), false, width, dim, c_.ffn, false); !s.ok()) return s;
      if (const auto s = gemm(h_.data(), lw.w3.data(), b_.data(), false, width, dim, c_.ffn, false); !s.ok()) return s;
      kernels::swiglu<T><<<256, 256, 0, stream_>>>(a_.data(), b_.data(), static_cast<std::int64_t>(width) * c_.ffn);
      if (const auto s = gemm(a_.data(), lw.w2.data(), x_.data(), false, width, c_.ffn, dim, residual); !s.ok()) return s;
      if (const auto s = reduce(x_.data(), width); !s.ok()) return s;
    }
    if (rank_ == 0) {
      kernels::rmsnorm<T><<<width, 256, 0, stream_>>>(x_.data(), final_norm_.data(), h_.data(), dim, c_.norm_eps);
      if (const auto s = gemm(h_.data(), lm_head_.data(), logits_.data(), true, width, dim, c_.vocab, false); !s.ok())
        return s;
    }
    CELLKV_CUDA_STATUS(cudaGetLastError());
    return {};
  }

  cellkv::gpu::DeviceBuffer<T> to_device(const std::vector<float>& v) {
    std::vector<T> host(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      if constexpr (std::is_same_v<T, float>) host[i] = v[i];
      else if constexpr (std::is_same_v<T, __half>) host[i] = __float2half(v[i]);
      else host[i] = __float2bfloat16(v[i]);
    }
    cellkv::gpu::DeviceBuffer<T> d(v.size());
    CELLKV_CUDA_THROW(cudaMemcpy(d.data(), host.data(), d.bytes(), cudaMemcpyHostToDevice));
    return d;
  }

  void upload_weights(const Weights& w) {
    embed_ = to_device(w.embed);
    final_norm_ = to_device(w.final_norm);
    lm_head_ = to_device(w.lm_head);
    for (const LayerWeights& l : w.layers)
      layers_.push_back({to_device(l.attn_norm), to_device(l.wq), to_device(l.wk), to_device(l.wv), to_device(l.wo),
                         to_device(l.ffn_norm), to_device(l.w1), to_device(l.w3), to_device(l.w2)});
  }

  void allocate() {
    const auto rows = static_cast<std::size_t>(max_width_);
    x_ = cellkv::gpu::DeviceBuffer<T>(rows * static_cast<std::size_t>(c_.dim));
    h_ = cellkv::gpu::DeviceBuffer<T>(x_.size());
    q_ = cellkv::gpu::DeviceBuffer<T>(rows * static_cast<std::size_t>(c_.q_width()));
    attn_ = cellkv::gpu::DeviceBuffer<T>(q_.size());
    k_ = cellkv::gpu::DeviceBuffer<T>(rows * static_cast<std::size_t>(c_.kv_width()));
    v_ = cellkv::gpu::DeviceBuffer<T>(k_.size());
    a_ = cellkv::gpu::DeviceBuffer<T>(rows * static_cast<std::size_t>(c_.ffn));
    b_ = cellkv::gpu::DeviceBuffer<T>(a_.size());
    logits_ = cellkv::gpu::DeviceBuffer<float>(rows * static_cast<std::size_t>(c_.vocab));
    ids_ = cellkv::gpu::DeviceBuffer<std::int32_t>(2 * rows);
    staging_ids_ = cellkv::gpu::PinnedBuffer<std::int32_t>(2 * rows);
    staging_logits_ = cellkv::gpu::PinnedBuffer<float>(rows * static_cast<std::size_t>(c_.vocab));
  }

  Config c_;
  const Attention& attention_;
  std::int32_t rank_;
  std::int32_t max_width_;
  cudaStream_t stream_;
  AllReduce<T>* reduce_;
  GpuOptions options_;
  cublasHandle_t blas_ = nullptr;
  cellkv::gpu::DeviceBuffer<std::byte> workspace_;
  cellkv::gpu::DeviceBuffer<T> embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  cellkv::gpu::DeviceBuffer<T> x_, h_, q_, attn_, k_, v_, a_, b_;
  cellkv::gpu::DeviceBuffer<float> logits_;
  cellkv::gpu::DeviceBuffer<std::int32_t> ids_;  // [tokens (max_width) | positions (max_width)]
  cellkv::gpu::PinnedBuffer<std::int32_t> staging_ids_;
  cellkv::gpu::PinnedBuffer<float> staging_logits_;
  std::map<std::int32_t, cellkv::gpu::GraphExec> graphs_;
  GraphStats stats_;
};

#undef LLAMA_CUBLAS

}  // namespace llama
