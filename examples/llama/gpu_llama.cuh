// llama/gpu_llama.cuh - the example decoder on the GPU: cuBLAS GEMMs (T inputs, fp32
// accumulation), small kernels for embedding, RMSNorm, RoPE and SwiGLU, and cellkv's
// update_and_attend per layer. Satisfies cellkv::batching::Model.
//
// CUDA graphs: a step of T tokens runs at width 1 (T == 1) or the next power of two >= T up to
// max_graph_width; each width is captured once (the forward reads only fixed-address buffers:
// token ids, positions, the cache's step buffers), then replayed for every later step of that
// width, whatever the mix of sessions. Padding rows write the pool's scratch row and see nothing;
// their logits are never read. Wider steps run eagerly.
#pragma once

#include <cellkv/batching/model.hpp>
#include <cellkv/cuda/device_cache.cuh>
#include <cellkv/cuda/graph.hpp>
#include <cellkv/cuda/memory.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "config.hpp"

namespace llama {

namespace kernels {
template <class T>
__global__ void embed(const std::int32_t* tokens, const T* table, T* x, std::int32_t dim) {
  const T* row = table + static_cast<std::int64_t>(tokens[blockIdx.x]) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) x[static_cast<std::int64_t>(blockIdx.x) * dim + i] = row[i];
}

// y[row] = x[row] / rms(x[row]) * gain; one block of 256 threads per row.
template <class T>
__global__ void rmsnorm(const T* x, const T* gain, T* y, std::int32_t dim, float eps) {
  __shared__ float partial[256];
  const T* xr = x + static_cast<std::int64_t>(blockIdx.x) * dim;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += cellkv::gpu::to_float(xr[i]) * cellkv::gpu::to_float(xr[i]);
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float inv = rsqrtf(partial[0] / static_cast<float>(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x)
    y[static_cast<std::int64_t>(blockIdx.x) * dim + i] =
        cellkv::gpu::from_float<T>(cellkv::gpu::to_float(xr[i]) * inv * cellkv::gpu::to_float(gain[i]));
}

// Rotates pairs (2i, 2i + 1) of every head of row blockIdx.x by position * theta^(-2i / D).
template <class T>
__global__ void rope(T* x, const std::int32_t* positions, std::int32_t heads, std::int32_t head_dim, float theta) {
  const float pos = static_cast<float>(positions[blockIdx.x]);
  for (int j = threadIdx.x; j < heads * head_dim / 2; j += blockDim.x) {
    const int h = j / (head_dim / 2), i = j % (head_dim / 2);
    T* p = x + (static_cast<std::int64_t>(blockIdx.x) * heads + h) * head_dim + 2 * i;
    const float a = pos * powf(theta, -2.f * static_cast<float>(i) / static_cast<float>(head_dim));
    float sn = 0.f, cs = 0.f;
    sincosf(a, &sn, &cs);
    const float x0 = cellkv::gpu::to_float(p[0]), x1 = cellkv::gpu::to_float(p[1]);
    p[0] = cellkv::gpu::from_float<T>(x0 * cs - x1 * sn);
    p[1] = cellkv::gpu::from_float<T>(x0 * sn + x1 * cs);
  }
}

// a = silu(a) * b, elementwise over n.
template <class T>
__global__ void swiglu(T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = cellkv::gpu::to_float(a[i]);
    a[i] = cellkv::gpu::from_float<T>(v / (1.f + __expf(-v)) * cellkv::gpu::to_float(b[i]));
  }
}
}  // namespace kernels

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

template <class Cache>
class GpuLlama {
  using T = typename Cache::Element;
  using W = typename Cache::Windows;

 public:
  // Uploads the weights; throws on a CUDA or cuBLAS failure. The cache's pool must match the
  // config (layers, H_kv, D) and its max_write bounds the step width.
  GpuLlama(const Config& c, const Weights& w, Cache& cache, cudaStream_t stream, GpuOptions options = {})
      : c_(c), cache_(cache), stream_(stream), options_(options), max_width_(cache.host().max_write()) {
    if (cublasCreate(&blas_) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
    workspace_ = cellkv::gpu::DeviceBuffer<std::byte>(32u << 20);
    if (cublasSetStream(blas_, stream_) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(blas_, workspace_.data(), workspace_.size()) != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("cuBLAS setup failed");
    upload_weights(w);
    allocate();
  }
  GpuLlama(const GpuLlama&) = delete;
  GpuLlama& operator=(const GpuLlama&) = delete;
  ~GpuLlama() { (void)cublasDestroy(blas_); }

  [[nodiscard]] std::int32_t vocab() const { return c_.vocab; }
  [[nodiscard]] std::int32_t min_prefill_tokens() const { return 2; }
  [[nodiscard]] const GraphStats& graph_stats() const { return stats_; }

  cellkv::Status forward(const cellkv::batching::ForwardStep& step, std::span<float> logits) {
    const auto T_tokens = static_cast<std::int32_t>(step.tokens.size());
    const std::int32_t width = width_for(T_tokens);
    for (std::int32_t t = 0; t < width; ++t) {
      staging_ids_.data()[t] = t < T_tokens ? step.tokens[static_cast<std::size_t>(t)] : 0;
      staging_ids_.data()[max_width_ + t] = t < T_tokens ? step.positions[static_cast<std::size_t>(t)] : 0;
    }
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(ids_.data(), staging_ids_.data(), ids_.bytes(), cudaMemcpyHostToDevice, stream_));
    if (const cellkv::Status s = cache_.upload(stream_, width); !s.ok()) return s;
    if (const cellkv::Status s = run(width); !s.ok()) return s;
    if (const cellkv::Status s = cache_.commit(stream_); !s.ok()) return s;
    const auto row_bytes = static_cast<std::size_t>(c_.vocab) * sizeof(float);
    for (std::size_t i = 0; i < step.logit_rows.size(); ++i)
      CELLKV_CUDA_STATUS(cudaMemcpyAsync(staging_logits_.data() + i * static_cast<std::size_t>(c_.vocab),
                                         logits_.data() + static_cast<std::size_t>(step.logit_rows[i]) * c_.vocab, row_bytes,
                                         cudaMemcpyDeviceToHost, stream_));
    CELLKV_CUDA_STATUS(cudaStreamSynchronize(stream_));
    std::memcpy(logits.data(), staging_logits_.data(), step.logit_rows.size() * row_bytes);
    return {};
  }

 private:
  struct Layer {
    cellkv::gpu::DeviceBuffer<T> attn_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2;
  };

  [[nodiscard]] std::int32_t width_for(std::int32_t t) const {
    if (!options_.graphs || t > options_.max_graph_width) return t;
    std::int32_t w = t == 1 ? 1 : 2;
    while (w < t) w *= 2;
    return std::min(w, max_width_) >= t ? std::min(w, max_width_) : t;
  }

  // Replays the width's graph (capturing it the first time), or runs eagerly.
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

  // y [rows, out] = x [rows, in] W [in, out] (+ y when accumulate); fp32 accumulation.
  cellkv::Status gemm(const T* x, const T* w, void* y, bool y_float, std::int32_t rows, std::int32_t in,
                      std::int32_t out, bool accumulate) {
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    const cudaDataType t = std::is_same_v<T, float> ? CUDA_R_32F : std::is_same_v<T, __half> ? CUDA_R_16F : CUDA_R_16BF;
    LLAMA_CUBLAS(cublasGemmEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, &alpha, w, t, out, x, t, in, &beta, y,
                              y_float ? CUDA_R_32F : t, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return {};
  }

  // The forward of `width` rows over every layer and the logits: fixed buffers only (capturable).
  cellkv::Status layers(std::int32_t width) {
    const std::int32_t dim = c_.dim, q_w = c_.q_width(), kv_w = c_.kv_width();
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
      if (const auto s = cache_.update_and_attend(l, q_.data(), k_.data(), v_.data(), attn_.data(), width, c_.heads_q, 0.f,
                                                  ::cuda::stream_ref(stream_));
          !s.ok())
        return s;
      if (const auto s = gemm(attn_.data(), lw.wo.data(), x_.data(), false, width, q_w, dim, true); !s.ok()) return s;
      kernels::rmsnorm<T><<<width, 256, 0, stream_>>>(x_.data(), lw.ffn_norm.data(), h_.data(), dim, c_.norm_eps);
      if (const auto s = gemm(h_.data(), lw.w1.data(), a_.data(), false, width, dim, c_.ffn, false); !s.ok()) return s;
      if (const auto s = gemm(h_.data(), lw.w3.data(), b_.data(), false, width, dim, c_.ffn, false); !s.ok()) return s;
      kernels::swiglu<T><<<256, 256, 0, stream_>>>(a_.data(), b_.data(), static_cast<std::int64_t>(width) * c_.ffn);
      if (const auto s = gemm(a_.data(), lw.w2.data(), x_.data(), false, width, c_.ffn, dim, true); !s.ok()) return s;
    }
    kernels::rmsnorm<T><<<width, 256, 0, stream_>>>(x_.data(), final_norm_.data(), h_.data(), dim, c_.norm_eps);
    if (const auto s = gemm(h_.data(), lm_head_.data(), logits_.data(), true, width, dim, c_.vocab, false); !s.ok())
      return s;
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
  Cache& cache_;
  cudaStream_t stream_;
  GpuOptions options_;
  std::int32_t max_width_;
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
