// llama/gpu_rank.cuh - one GPU's part of the example decoder: the forward over its heads and MLP
// columns (the whole model when G = 1) and, on rank 0, the sampling of the step's logit rows on the
// device (cellkv::batching::launch_sampler), so that only sampled ids come back to the host. Ranks
// in processes of their own (a ProcessGroup) get rank 0's sampled ids broadcast within the step.
//
// Per layer: h = rmsnorm(x); q, k, v = h Wq_g, h Wk_g, h Wv_g; RoPE; attn = update_and_attend;
// x = all_reduce(x + attn Wo_g) (rank 0 adds the residual, other ranks contribute attn Wo_g only);
// h = rmsnorm(x); x = all_reduce(x + swiglu(h W1_g, h W3_g) W2_g), likewise. Logits on rank 0:
// rmsnorm(x) W_lm, then the sampler.
//
// Two ways to run a step of `width` rows (weights stored transposed and fused, gpu_kernels.cuh):
//  - width <= max_gemv_width: the skinny GEMV, with RMSNorm fused into the Q/K/V, W13 and LM-head
//    products, RoPE and the Q/K/V split into the first, SwiGLU into the second and the residual
//    into Wo and W2: 4 kernels a layer besides attention, each weight read once per step;
//  - wider: cuBLAS (fp32 accumulation) for the fused Q/K/V, Wo, W13, W2 and LM-head products, with
//    RoPE/split and SwiGLU kernels between them. The RMSNorm before Q/K/V and W13 is folded: its
//    gain into a second copy of those weights (W' = diag(gain) W), its 1 / rms(x) into the RoPE and
//    SwiGLU kernels, which scale each row of the product (rmsnorm(x) W = (x W') / rms(x)); the LM
//    head keeps an RMSNorm kernel. Both copies of Wqkv and W13 are kept (the GEMV reads the first).
//    In fp16, x W' is rms(x) times h W and a large residual stream could pass fp16's range.
//
// CUDA graphs: a step of T tokens runs at width 1 (T == 1) or the next power of two >= T up to
// max_graph_width; each width and kind of step (the cache's graph_key(): which attention kernels
// the step needs, GpuOptions::graph_per_step_kinds) is captured once (the forward reads only
// fixed-address buffers: the step block of token ids, positions, deferred-id sources and sampling
// rows, the ids sampled by the previous step, the cache's step buffers), then replayed for every
// later step of that width and kind, whatever the mix of sessions. Padding rows write the pool's
// scratch row and see nothing; their outputs are never read. Wider steps, and every step when the
// all-reduce cannot be captured, run eagerly.
//
// Per step, on the rank's stream: one copy of the step block up, the cache's upload, the forward
// (+ sampler), the cache's commit, one copy of the sampled ids down, an event. Nothing waits on the
// host: retire() waits for the oldest step's event (at most kSlots - 1 steps in flight). With
// GpuOptions::profile, events between the phases time each step (the sampler then runs outside
// the graph, so its time can be told apart).
//
// Every call runs on the calling thread's current device, which must be the rank's device.
#pragma once

#include <cellkv/batching/device_sampling.cuh>
#include <cellkv/batching/model.hpp>
#include <cellkv/gpu/graph.hpp>
#include <cellkv/gpu/memory.hpp>
#include <cellkv/gpu/stream.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "all_reduce.cuh"
#include "config.hpp"
#include "gpu_kernels.cuh"
#include "process_group.cuh"

namespace llama {

#define LLAMA_CUBLAS(expr)                                                                            \
  do {                                                                                                \
    if ((expr) != CUBLAS_STATUS_SUCCESS) return cellkv::Status(cellkv::Errc::device_error);          \
  } while (0)

struct GpuOptions {
  std::int32_t max_graph_width = 64;  // widths above run eagerly
  bool graphs = true;
  std::int32_t max_gemv_width = 16;   // widths up to this (<= 16) run the fused skinny GEMV; 0: cuBLAS only
  bool profile = false;               // time each step's phases (phase_times()); also set_profile()
  // The GEMVs and the RMSNorm, RoPE and SwiGLU kernels as dependent launches (sm_90 and later;
  // cellkv/gpu/kernels/dependent_launch.cuh): each is scheduled while the kernel before it still
  // runs, and the GEMVs fetch their weights then.
  bool dependent_launch = true;
  // One graph per width and kind of step (cellkv::gpu::GraphScope::step_kinds, set on the cache by
  // GpuLlama / TpLlama): a decode-only step replays a graph without the prefill and shared-prefix
  // launches. Off: one graph per width serves every step (GraphScope::every_step).
  bool graph_per_step_kinds = true;
  // Ranks in processes of their own (GpuLlama over a ProcessGroup): before each step, compare the
  // digest of its plan (cellkv::plan_digest) across ranks and refuse a step whose plans differ. It
  // waits for the previous steps, so it is off where NDEBUG is defined (meson -Db_ndebug=true or
  // if-release) and on otherwise; the tests turn it on.
#ifdef NDEBUG
  bool check_plans = false;
#else
  bool check_plans = true;
#endif
};

struct GraphStats {
  std::int64_t captures = 0, replays = 0, eager = 0;
};

// GPU time of the profiled steps, in milliseconds, summed: step block and cache upload; forward;
// sampling; the copy of the sampled ids; and the time the stream sat idle before a step began
// after the previous one ended (the host was late).
struct PhaseTimes {
  std::int64_t steps = 0;
  double upload_ms = 0, forward_ms = 0, sampling_ms = 0, copy_ms = 0, idle_ms = 0;
};

// Attention: what the rank attends through (a DeviceCache or one DeviceShard of a ShardedCache):
// update_and_attend(layer, q, k, v, out, width, heads_q, scale, stream) over this rank's heads.
template <class Attention>
class GpuRank {
 public:
  using T = typename Attention::Element;  // the arithmetic and the cache's K/V inputs (fp8 caches: bf16/fp16)
  static constexpr int kSlots = 3;     // steps whose staging, results and events are kept
  static constexpr int kGemvRows = 16;  // the widest GEMV step

  // config, weights: this rank's slice (shard_config / shard_weights; the whole model for G = 1).
  // reduce: the all-reduce over ranks, nullptr for one GPU. When it is a ProcessGroup (ranks in
  // processes of their own), rank 0's sampled ids are broadcast to every rank in the step (graphs
  // capture it), every rank's retire() returns them, and retire() waits through the group (bounded).
  // Throws on a CUDA or cuBLAS failure.
  GpuRank(const Config& config, const Weights& weights, const Attention& attention, std::int32_t rank,
          std::int32_t max_width, cudaStream_t stream, AllReduce<T>* reduce, GpuOptions options)
      : c_(config), attention_(attention), rank_(rank), max_width_(max_width),
        rows_(std::max(max_width, static_cast<std::int32_t>(kGemvRows))), stream_(stream), reduce_(reduce),
        group_(dynamic_cast<ProcessGroup<T>*>(reduce)), options_(options), block_(rows_) {
    if (reduce_ != nullptr && !reduce_->capturable()) options_.graphs = false;
    options_.max_gemv_width = std::clamp(options_.max_gemv_width, 0, static_cast<std::int32_t>(kGemvRows));
    options_.dependent_launch = options_.dependent_launch && cellkv::gpu::dependent_launch_supported();
    if (cublasCreate(&blas_) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
    workspace_ = cellkv::gpu::DeviceBuffer<std::byte>(32u << 20);
    if (cublasSetStream(blas_, stream_) != CUBLAS_STATUS_SUCCESS ||
        cublasSetWorkspace(blas_, workspace_.data(), workspace_.size()) != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error("cuBLAS setup failed");
    int device = 0;
    CELLKV_CUDA_THROW(cudaGetDevice(&device));
    CELLKV_CUDA_THROW(cudaDeviceGetAttribute(&smem_limit_, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    upload_weights(weights);
    allocate();
    // The uploads (cudaMemcpy from pageable memory may return before the data lands) and the
    // zeroing (cudaMemset) run on the legacy default stream, which the model's stream (non-blocking)
    // does not wait for: both must be done before the first forward.
    CELLKV_CUDA_THROW(cudaDeviceSynchronize());
  }
  GpuRank(const GpuRank&) = delete;
  GpuRank& operator=(const GpuRank&) = delete;
  // Waits for the steps in flight (their events, never the stream, which may be gone).
  ~GpuRank() {
    for (const cellkv::gpu::Event& e : done_) (void)e.synchronize();
    (void)cublasDestroy(blas_);
  }

  [[nodiscard]] const GraphStats& graph_stats() const { return stats_; }
  [[nodiscard]] const PhaseTimes& phase_times() const { return phases_; }
  void reset_phase_times() { phases_ = {}; }
  // Times the phases of the steps enqueued from now on (or stops). Profiled steps replay graphs
  // captured without the sampler, which then runs as its own launch between two events.
  void set_profile(bool on) { options_.profile = on; }
  [[nodiscard]] cudaStream_t stream() const { return stream_; }
  [[nodiscard]] std::int32_t in_flight() const { return static_cast<std::int32_t>(next_ - head_); }

  // The width a step of t tokens runs at (graph buckets; see the file comment).
  [[nodiscard]] std::int32_t width_for(std::int32_t t) const {
    if (!options_.graphs || t > options_.max_graph_width) return t;
    std::int32_t w = t == 1 ? 1 : 2;
    while (w < t) w *= 2;
    return std::min(w, max_width_) >= t ? std::min(w, max_width_) : t;
  }

  // Enqueues one step at `width`: the step block, upload(stream) (the cache's upload at this
  // width), the forward, the sampling of step.logit_rows (rank 0), commit(stream), the copy of the
  // sampled ids. Refuses (bad_argument, nothing enqueued) widths outside [T, max_width], sizes that
  // disagree, a deferred id whose source the previous step did not sample, or kSlots - 1 steps
  // already in flight; passes on the refusals of upload, commit and the forward.
  template <class Upload, class Commit>
  cellkv::Status step(const cellkv::batching::ForwardStep& step, std::int32_t width, Upload&& upload, Commit&& commit) {
    if (const cellkv::Status s = check(step, width); !s.ok()) return s;
    const std::size_t slot = next_ % kSlots;
    const auto samples = static_cast<std::int32_t>(step.logit_rows.size());
    if (options_.profile) CELLKV_CUDA_STATUS(cudaEventRecord(timing_[slot].begin.get(), stream_));
    stage(step, width, slot);
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(block_dev_.data(), staging_[slot].data(), block_.bytes_for(samples),
                                       cudaMemcpyHostToDevice, stream_));
    if (const cellkv::Status s = upload(::cuda::stream_ref(stream_)); !s.ok()) return s;
    if (options_.profile) CELLKV_CUDA_STATUS(cudaEventRecord(timing_[slot].uploaded.get(), stream_));
    if (const cellkv::Status s = run(width); !s.ok()) return s;
    if (options_.profile) {
      CELLKV_CUDA_STATUS(cudaEventRecord(timing_[slot].forward.get(), stream_));
      if (const cellkv::Status s = sample_and_share(width); !s.ok()) return s;
      CELLKV_CUDA_STATUS(cudaEventRecord(timing_[slot].sampled.get(), stream_));
    }
    if (const cellkv::Status s = commit(::cuda::stream_ref(stream_)); !s.ok()) return s;
    if ((rank_ == 0 || group_ != nullptr) && samples > 0)
      CELLKV_CUDA_STATUS(cudaMemcpyAsync(results_[slot].data(), sampled_.data(),
                                         static_cast<std::size_t>(samples) * sizeof(cellkv::batching::SampledOut),
                                         cudaMemcpyDeviceToHost, stream_));
    if (options_.profile) CELLKV_CUDA_STATUS(cudaEventRecord(timing_[slot].copied.get(), stream_));
    if (const cellkv::Status s = done_[slot].record(::cuda::stream_ref(stream_)); !s.ok()) return s;
    counts_[slot] = samples;
    profiled_[slot] = options_.profile;
    last_samples_ = samples;
    ++next_;
    return {};
  }

  // Waits for the oldest step in flight and writes its sampled ids and log-probs (rank 0, or every
  // rank of a ProcessGroup).
  // Refuses bad_argument when no step is in flight or a size differs from its sampled rows.
  cellkv::Status retire(std::span<std::int32_t> tokens, std::span<float> logprobs) {
    if (head_ == next_) return cellkv::Errc::bad_argument;
    const std::size_t slot = head_ % kSlots;
    const auto n = static_cast<std::size_t>(counts_[slot]);
    if (tokens.size() != n || logprobs.size() != n) return cellkv::Errc::bad_argument;
    if (const cellkv::Status s = group_ != nullptr ? group_->wait(done_[slot].get()) : done_[slot].synchronize(); !s.ok())
      return s;
    for (std::size_t i = 0; i < n; ++i) {
      tokens[i] = results_[slot].data()[i].token;
      logprobs[i] = results_[slot].data()[i].logprob;
    }
    if (profiled_[slot])
      if (const cellkv::Status s = time_step(slot); !s.ok()) return s;
    ++head_;
    return {};
  }

  // Waits for the stream and copies the logits of `row` of the last step (tests).
  cellkv::Status copy_logits(std::int32_t row, std::span<float> out) const {
    if (row < 0 || row >= max_width_ || out.size() != static_cast<std::size_t>(c_.vocab)) return cellkv::Errc::bad_argument;
    CELLKV_CUDA_STATUS(cudaStreamSynchronize(stream_));
    CELLKV_CUDA_STATUS(cudaMemcpy(out.data(), logits_.data() + static_cast<std::size_t>(row) * c_.vocab,
                                  out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return {};
  }

 private:
  struct Layer {
    cellkv::gpu::DeviceBuffer<T> attn_norm, wqkv, wo, ffn_norm, w13, w2;  // transposed [out, in]
    // The cuBLAS path's Wqkv and W13 with the RMSNorm gain folded in (row o: Wt[o, i] gain[i]).
    cellkv::gpu::DeviceBuffer<T> wqkv_gained, w13_gained;
  };

  // Byte offsets of the step block (the same on the host staging and the device copy), for W rows
  // (max_width, at least kGemvRows: GEMV padding rows read positions too):
  //   count int32 (R) | tokens [W] | positions [W] | from [W] (deferred source or -1) | rows [W] |
  //   params SampleRow [W]; a step copies up to params + R rows.
  struct BlockLayout {
    std::size_t tokens, positions, from, rows, params, bytes;
    explicit BlockLayout(std::int32_t w) {
      const auto n = static_cast<std::size_t>(w);
      tokens = 16;
      positions = tokens + 4 * n;
      from = positions + 4 * n;
      rows = from + 4 * n;
      params = (rows + 4 * n + 31) / 32 * 32;
      bytes = params + sizeof(cellkv::batching::SampleRow) * n;
    }
    [[nodiscard]] std::size_t bytes_for(std::int32_t samples) const {
      return params + sizeof(cellkv::batching::SampleRow) * static_cast<std::size_t>(samples);
    }
  };

  struct Timing {
    cellkv::gpu::Event begin{true}, uploaded{true}, forward{true}, sampled{true}, copied{true};
  };

  cellkv::Status check(const cellkv::batching::ForwardStep& step, std::int32_t width) const {
    const auto tokens = static_cast<std::int32_t>(step.tokens.size());
    if (tokens < 1 || width < tokens || width > max_width_ || step.positions.size() != step.tokens.size() ||
        step.sampling.size() != step.logit_rows.size() || step.logit_rows.size() > step.tokens.size())
      return cellkv::Errc::bad_argument;
    if (next_ - head_ >= kSlots - 1) return cellkv::Errc::bad_argument;
    for (const std::int32_t r : step.logit_rows)
      if (r < 0 || r >= tokens) return cellkv::Errc::bad_argument;
    for (const cellkv::batching::DeferredToken& d : step.deferred)
      if (d.row < 0 || d.row >= tokens || d.source < 0 || d.source >= last_samples_) return cellkv::Errc::bad_argument;
    return {};
  }

  // Fills staging slot `slot` (its previous step has been retired: at most kSlots - 1 in flight).
  void stage(const cellkv::batching::ForwardStep& step, std::int32_t width, std::size_t slot) {
    std::byte* base = staging_[slot].data();
    auto ints = [&](std::size_t offset) { return reinterpret_cast<std::int32_t*>(base + offset); };
    const auto tokens = static_cast<std::int32_t>(step.tokens.size());
    *ints(0) = static_cast<std::int32_t>(step.logit_rows.size());
    std::int32_t* ids = ints(block_.tokens);
    std::int32_t* pos = ints(block_.positions);
    std::int32_t* from = ints(block_.from);
    for (std::int32_t t = 0; t < width; ++t) {
      ids[t] = t < tokens ? step.tokens[static_cast<std::size_t>(t)] : 0;
      pos[t] = t < tokens ? step.positions[static_cast<std::size_t>(t)] : 0;
      from[t] = -1;
    }
    for (const cellkv::batching::DeferredToken& d : step.deferred) from[d.row] = d.source;
    std::copy(step.logit_rows.begin(), step.logit_rows.end(), ints(block_.rows));
    if (!step.sampling.empty())
      std::memcpy(base + block_.params, step.sampling.data(), step.sampling.size_bytes());
  }

  // Replays the graph of the width and the cache's graph_key() (capturing it the first time), or
  // runs eagerly. The step must be
  // uploaded to the attention's cache at this width.
  cellkv::Status run(std::int32_t width) {
    if (!options_.graphs || width > options_.max_graph_width) {
      ++stats_.eager;
      return forward_and_sample(width);
    }
    auto& graphs = graphs_[options_.profile ? 1 : 0];
    const GraphKey key{width, attention_.graph_key().bits};
    auto it = graphs.find(key);
    if (it == graphs.end()) {
      cellkv::Status inside;
      cellkv::gpu::GraphExec g =
          cellkv::gpu::capture(::cuda::stream_ref(stream_), [&] { inside = forward_and_sample(width); });
      if (!inside.ok()) return inside;
      it = graphs.emplace(key, std::move(g)).first;
      ++stats_.captures;
    }
    ++stats_.replays;
    return it->second.replay(::cuda::stream_ref(stream_));
  }

  cellkv::Status forward_and_sample(std::int32_t width) {
    if (const cellkv::Status s = layers(width); !s.ok()) return s;
    if (!options_.profile) return sample_and_share(width);
    return {};
  }

  // Rank 0 samples; a ProcessGroup hands the sampled ids of every row to every rank.
  cellkv::Status sample_and_share(std::int32_t width) {
    if (rank_ == 0)
      if (const cellkv::Status s = sample(width); !s.ok()) return s;
    if (group_ == nullptr) return {};
    return group_->broadcast(sampled_.data(), sampled_.size() * sizeof(cellkv::batching::SampledOut), stream_);
  }

  cellkv::Status sample(std::int32_t width) {
    const cellkv::batching::SamplerView v{logits_.data(),
                                          c_.vocab,
                                          c_.vocab,
                                          block_int(0),
                                          block_int(block_.rows),
                                          reinterpret_cast<const cellkv::batching::SampleRow*>(block_dev_.data() + block_.params),
                                          sampled_.data()};
    return cellkv::batching::launch_sampler(v, width, ::cuda::stream_ref(stream_));
  }

  [[nodiscard]] const std::int32_t* block_int(std::size_t offset) const {
    return reinterpret_cast<const std::int32_t*>(block_dev_.data() + offset);
  }

  cellkv::Status time_step(std::size_t slot) {
    const Timing& t = timing_[slot];
    float ms = 0.f;
    CELLKV_CUDA_STATUS(cudaEventElapsedTime(&ms, t.begin.get(), t.uploaded.get()));
    phases_.upload_ms += ms;
    CELLKV_CUDA_STATUS(cudaEventElapsedTime(&ms, t.uploaded.get(), t.forward.get()));
    phases_.forward_ms += ms;
    CELLKV_CUDA_STATUS(cudaEventElapsedTime(&ms, t.forward.get(), t.sampled.get()));
    phases_.sampling_ms += ms;
    CELLKV_CUDA_STATUS(cudaEventElapsedTime(&ms, t.sampled.get(), t.copied.get()));
    phases_.copy_ms += ms;
    if (head_ > 0 && phases_.steps > 0 && profiled_[(head_ - 1) % kSlots]) {
      CELLKV_CUDA_STATUS(cudaEventElapsedTime(&ms, timing_[(head_ - 1) % kSlots].copied.get(), t.begin.get()));
      phases_.idle_ms += std::max(ms, 0.f);
    }
    ++phases_.steps;
    return {};
  }

  // y [rows, n] = x [rows, k] Wt^T (+ y when accumulate); Wt [n, k]; fp32 accumulation.
  cellkv::Status gemm(const T* x, const T* wt, void* y, bool y_float, std::int32_t rows, std::int32_t k,
                      std::int32_t n, bool accumulate) {
    const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
    const cudaDataType t = std::is_same_v<T, float> ? CUDA_R_32F : std::is_same_v<T, __half> ? CUDA_R_16F : CUDA_R_16BF;
    LLAMA_CUBLAS(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &alpha, wt, t, k, x, t, k, &beta, y,
                              y_float ? CUDA_R_32F : t, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return {};
  }

  // x = sum over ranks of x_r (rank 0 holds x + its part, other ranks their part only).
  cellkv::Status reduce(T* x, std::int32_t width) {
    if (reduce_ == nullptr) return {};
    return reduce_->sum(rank_, x, static_cast<std::size_t>(width) * static_cast<std::size_t>(c_.dim), stream_);
  }

  // The GEMV row count of a width (a power of two >= width), or 0 when the step runs cuBLAS.
  [[nodiscard]] int gemv_rows(std::int32_t width) const {
    if (width > options_.max_gemv_width) return 0;
    int rows = 1;
    while (rows < width) rows *= 2;
    // k = dim for Q/K/V, W13 and the LM head (up to 4 weight rows per warp); q_width for Wo and ffn
    // for W2 (1 per warp).
    const std::int32_t widest = std::max(c_.q_width(), c_.ffn);
    return gemv::fits<T>(rows, widest, smem_limit_, gemv::kWarps) &&
                   gemv::fits<T>(rows, c_.dim, smem_limit_, gemv::kWarps * 4)
               ? rows
               : 0;
  }

  // The forward of `width` rows over every layer and the logits: fixed buffers only (capturable).
  cellkv::Status layers(std::int32_t width) {
    const std::int32_t dim = c_.dim, q_w = c_.q_width(), kv_w = c_.kv_width(), qkv_w = q_w + 2 * kv_w;
    const bool residual = rank_ == 0;  // the rank that carries x through the all-reduce
    const std::int32_t* positions = block_int(block_.positions);
    const int rows = gemv_rows(width);
    kernels::embed<T><<<width, kernels::kNormThreads, 0, stream_>>>(block_int(block_.tokens), block_int(block_.from), sampled_.data(),
                                                  max_width_, embed_.data(), x_.data(), dim, c_.vocab);
    for (std::int32_t l = 0; l < c_.layers; ++l) {
      Layer& lw = layers_[static_cast<std::size_t>(l)];
      if (rows > 0) {
        gemv::Args<T> a;
        a.x = x_.data();
        a.gain = lw.attn_norm.data();
        a.eps = c_.norm_eps;
        a.wt = lw.wqkv.data();
        a.n = qkv_w;
        a.k = dim;
        a.q = q_.data();
        a.kk = k_.data();
        a.v = v_.data();
        a.positions = positions;
        a.q_w = q_w;
        a.kv_w = kv_w;
        a.head_dim = c_.head_dim;
        a.theta = c_.rope_theta;
        CELLKV_CUDA_STATUS((gemv::launch<T, gemv::Out::qkv_rope, true>(a, rows, options_.dependent_launch, stream_)));
      } else {
        // RMSNorm folded: x W'qkv, each row then scaled by 1 / rms(x row) in rope_split.
        if (const auto s = gemm(x_.data(), lw.wqkv_gained.data(), qkv_.data(), false, width, dim, qkv_w, false);
            !s.ok())
          return s;
        const dim3 pairs((qkv_w / 2 + kernels::kRopeThreads - 1) / kernels::kRopeThreads, width);
        CELLKV_CUDA_STATUS(launch(kernels::rope_split<T>, pairs, kernels::kRopeThreads, qkv_.data(), q_.data(), k_.data(),
                                  v_.data(), positions, q_w, kv_w, c_.head_dim, c_.rope_theta, row_norm()));
      }
      if (const auto s = attention_.update_and_attend(l, q_.data(), k_.data(), v_.data(), attn_.data(), width,
                                                      c_.heads_q, 0.f, ::cuda::stream_ref(stream_));
          !s.ok())
        return s;
      if (rows > 0) {
        gemv::Args<T> a;
        a.x = attn_.data();
        a.wt = lw.wo.data();
        a.n = dim;
        a.k = q_w;
        a.y = x_.data();
        a.ld = dim;
        a.accumulate = residual;
        CELLKV_CUDA_STATUS((gemv::launch<T, gemv::Out::store, false>(a, rows, options_.dependent_launch, stream_)));
      } else if (const auto s = gemm(attn_.data(), lw.wo.data(), x_.data(), false, width, q_w, dim, residual); !s.ok()) {
        return s;
      }
      if (const auto s = reduce(x_.data(), width); !s.ok()) return s;
      if (rows > 0) {
        gemv::Args<T> a;
        a.x = x_.data();
        a.gain = lw.ffn_norm.data();
        a.eps = c_.norm_eps;
        a.wt = lw.w13.data();
        a.n = 2 * c_.ffn;
        a.k = dim;
        a.a = a_.data();
        a.ffn = c_.ffn;
        CELLKV_CUDA_STATUS((gemv::launch<T, gemv::Out::swiglu, true>(a, rows, options_.dependent_launch, stream_)));
        gemv::Args<T> b;
        b.x = a_.data();
        b.wt = lw.w2.data();
        b.n = dim;
        b.k = c_.ffn;
        b.y = x_.data();
        b.ld = dim;
        b.accumulate = residual;
        CELLKV_CUDA_STATUS((gemv::launch<T, gemv::Out::store, false>(b, rows, options_.dependent_launch, stream_)));
      } else {
        // RMSNorm folded: x W'13, each row then scaled by 1 / rms(x row) in swiglu_pairs.
        if (const auto s = gemm(x_.data(), lw.w13_gained.data(), h13_.data(), false, width, dim, 2 * c_.ffn, false);
            !s.ok())
          return s;
        const dim3 outputs((c_.ffn + kernels::kSwigluThreads - 1) / kernels::kSwigluThreads, width);
        CELLKV_CUDA_STATUS(launch(kernels::swiglu_pairs<T>, outputs, kernels::kSwigluThreads, h13_.data(), a_.data(),
                                  c_.ffn, row_norm()));
        if (const auto s = gemm(a_.data(), lw.w2.data(), x_.data(), false, width, c_.ffn, dim, residual); !s.ok())
          return s;
      }
      if (const auto s = reduce(x_.data(), width); !s.ok()) return s;
    }
    if (rank_ == 0) {
      if (rows > 0) {
        gemv::Args<T> a;
        a.x = x_.data();
        a.gain = final_norm_.data();
        a.eps = c_.norm_eps;
        a.wt = lm_head_.data();
        a.n = c_.vocab;
        a.k = dim;
        a.yf = logits_.data();
        a.ld = c_.vocab;
        CELLKV_CUDA_STATUS((gemv::launch<T, gemv::Out::store_float, true>(a, rows, options_.dependent_launch, stream_)));
      } else {
        CELLKV_CUDA_STATUS(launch(kernels::rmsnorm<T>, width, kernels::kNormThreads, x_.data(), final_norm_.data(),
                                  h_.data(), dim, c_.norm_eps));
        if (const auto s = gemm(h_.data(), lm_head_.data(), logits_.data(), true, width, dim, c_.vocab, false); !s.ok())
          return s;
      }
    }
    CELLKV_CUDA_STATUS(cudaGetLastError());
    return {};
  }

  // An elementwise kernel of the forward, on the rank's stream, as a dependent launch when the
  // options ask for them (each calls allow_dependent_grids and wait_for_prior_grids first).
  template <class... Params, class... Args>
  cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) const {
    return cellkv::gpu::launch_dependent(options_.dependent_launch, kernel, grid, block, 0, stream_,
                                         std::forward<Args>(args)...);
  }

  // Wt [out, in] of W [in, out] (row-major), in T; with `gain` [in], Wt[o, i] = W[i, o] gain[i]
  // (rounded once).
  static std::vector<T> transposed(const std::vector<float>& w, std::int32_t in, std::int32_t out,
                                   const std::vector<float>* gain = nullptr) {
    std::vector<T> t(w.size());
    for (std::int32_t i = 0; i < in; ++i) {
      const float g = gain == nullptr ? 1.f : (*gain)[static_cast<std::size_t>(i)];
      for (std::int32_t o = 0; o < out; ++o)
        t[static_cast<std::size_t>(o) * in + i] = to_t(w[static_cast<std::size_t>(i) * out + o] * g);
    }
    return t;
  }
  static T to_t(float v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else if constexpr (std::is_same_v<T, __half>) return __float2half(v);
    else return __float2bfloat16(v);
  }
  static cellkv::gpu::DeviceBuffer<T> to_device(const std::vector<T>& host) {
    cellkv::gpu::DeviceBuffer<T> d(host.size());
    CELLKV_CUDA_THROW(cudaMemcpy(d.data(), host.data(), d.bytes(), cudaMemcpyHostToDevice));
    return d;
  }
  static cellkv::gpu::DeviceBuffer<T> vector_to_device(const std::vector<float>& v) {
    std::vector<T> host(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) host[i] = to_t(v[i]);
    return to_device(host);
  }

  void upload_weights(const Weights& w) {
    const std::int32_t dim = c_.dim, q_w = c_.q_width(), kv_w = c_.kv_width(), ffn = c_.ffn;
    embed_ = vector_to_device(w.embed);
    final_norm_ = vector_to_device(w.final_norm);
    lm_head_ = to_device(transposed(w.lm_head, dim, c_.vocab));
    // [Wq | Wk | Wv] by output; W13: rows (w1 column j, w3 column j). `gain`: folded in (or nullptr).
    auto qkv_of = [&](const LayerWeights& l, const std::vector<float>* gain) {
      std::vector<T> qkv = transposed(l.wq, dim, q_w, gain);
      const std::vector<T> k = transposed(l.wk, dim, kv_w, gain), v = transposed(l.wv, dim, kv_w, gain);
      qkv.insert(qkv.end(), k.begin(), k.end());
      qkv.insert(qkv.end(), v.begin(), v.end());
      return to_device(qkv);
    };
    auto w13_of = [&](const LayerWeights& l, const std::vector<float>* gain) {
      const std::vector<T> w1 = transposed(l.w1, dim, ffn, gain), w3 = transposed(l.w3, dim, ffn, gain);
      std::vector<T> w13(2 * w1.size());
      for (std::int32_t j = 0; j < ffn; ++j) {
        std::copy_n(w1.begin() + static_cast<std::ptrdiff_t>(j) * dim, dim, w13.begin() + static_cast<std::ptrdiff_t>(2 * j) * dim);
        std::copy_n(w3.begin() + static_cast<std::ptrdiff_t>(j) * dim, dim,
                    w13.begin() + static_cast<std::ptrdiff_t>(2 * j + 1) * dim);
      }
      return to_device(w13);
    };
    for (const LayerWeights& l : w.layers)
      layers_.push_back({vector_to_device(l.attn_norm), qkv_of(l, nullptr), to_device(transposed(l.wo, q_w, dim)),
                         vector_to_device(l.ffn_norm), w13_of(l, nullptr), to_device(transposed(l.w2, ffn, dim)),
                         qkv_of(l, &l.attn_norm), w13_of(l, &l.ffn_norm)});
  }

  // The RMSNorm the cuBLAS path folds into rope_split and swiglu_pairs: of the residual stream x.
  [[nodiscard]] kernels::RowNorm<T> row_norm() const { return {x_.data(), c_.dim, c_.norm_eps}; }

  template <class U>
  static cellkv::gpu::DeviceBuffer<U> zeroed(std::size_t n) {
    cellkv::gpu::DeviceBuffer<U> d(n);
    CELLKV_CUDA_THROW(cudaMemset(d.data(), 0, d.bytes()));
    return d;
  }

  void allocate() {
    const auto rows = static_cast<std::size_t>(rows_);
    x_ = zeroed<T>(rows * static_cast<std::size_t>(c_.dim));
    h_ = zeroed<T>(x_.size());
    q_ = zeroed<T>(rows * static_cast<std::size_t>(c_.q_width()));
    attn_ = zeroed<T>(q_.size());
    k_ = zeroed<T>(rows * static_cast<std::size_t>(c_.kv_width()));
    v_ = zeroed<T>(k_.size());
    qkv_ = zeroed<T>(rows * static_cast<std::size_t>(c_.q_width() + 2 * c_.kv_width()));
    a_ = zeroed<T>(rows * static_cast<std::size_t>(c_.ffn));
    h13_ = zeroed<T>(2 * a_.size());
    logits_ = zeroed<float>(rows * static_cast<std::size_t>(c_.vocab));
    block_dev_ = zeroed<std::byte>(block_.bytes);
    sampled_ = zeroed<cellkv::batching::SampledOut>(static_cast<std::size_t>(max_width_));
    for (std::size_t s = 0; s < kSlots; ++s) {
      staging_[s] = cellkv::gpu::PinnedBuffer<std::byte>(block_.bytes);
      std::memset(staging_[s].data(), 0, block_.bytes);
      results_[s] = cellkv::gpu::PinnedBuffer<cellkv::batching::SampledOut>(static_cast<std::size_t>(max_width_));
    }
  }

  Config c_;
  const Attention& attention_;
  std::int32_t rank_;
  std::int32_t max_width_;
  std::int32_t rows_;  // activation rows: max_width, at least kGemvRows
  cudaStream_t stream_;
  AllReduce<T>* reduce_;
  ProcessGroup<T>* group_;  // reduce_ when the ranks are processes, else nullptr
  GpuOptions options_;
  BlockLayout block_;
  int smem_limit_ = 0;
  cublasHandle_t blas_ = nullptr;
  cellkv::gpu::DeviceBuffer<std::byte> workspace_;
  cellkv::gpu::DeviceBuffer<T> embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  cellkv::gpu::DeviceBuffer<T> x_, h_, q_, attn_, k_, v_, qkv_, a_, h13_;
  cellkv::gpu::DeviceBuffer<float> logits_;
  cellkv::gpu::DeviceBuffer<std::byte> block_dev_;                     // the step block
  cellkv::gpu::DeviceBuffer<cellkv::batching::SampledOut> sampled_;   // [max_width] ids of the last step
  std::array<cellkv::gpu::PinnedBuffer<std::byte>, kSlots> staging_;
  std::array<cellkv::gpu::PinnedBuffer<cellkv::batching::SampledOut>, kSlots> results_;
  std::array<cellkv::gpu::Event, kSlots> done_;
  std::vector<Timing> timing_ = std::vector<Timing>(kSlots);
  std::array<bool, kSlots> profiled_{};  // the slot's step was profiled
  std::array<std::int32_t, kSlots> counts_{};
  std::int32_t last_samples_ = 0;  // sampled rows of the last step enqueued
  std::uint64_t head_ = 0, next_ = 0;  // steps retired, steps enqueued
  // A graph serves the steps of its width whose attention needs the same kernels (the cache's
  // graph_key(): always every kernel unless the cache's GraphScope is step_kinds).
  using GraphKey = std::pair<std::int32_t, std::uint32_t>;
  std::array<std::map<GraphKey, cellkv::gpu::GraphExec>, 2> graphs_;  // with the sampler, without
  GraphStats stats_;
  PhaseTimes phases_;
};

#undef LLAMA_CUBLAS

}  // namespace llama
