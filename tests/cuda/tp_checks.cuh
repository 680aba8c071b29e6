// Tensor-parallel checks shared by the one-GPU suite (G shards on device 0, a device sum standing
// in for the all-reduce) and the NCCL suite (one shard per GPU):
//  - sharded step buffers equal the single-device ones byte for byte, every shard's pool holds the
//    model pool's columns of its KV heads, and shard attention equals the model's attention columns;
//  - batched generation of the tensor-parallel model equals the single-GPU model token for token.
#pragma once

#include <doctest/doctest.h>

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cellkv/batching/executor.hpp"
#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/device_guard.hpp"
#include "cellkv/gpu/sharded_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "llama/gpu_llama.cuh"
#include "llama/tp_llama.cuh"
#include "../host/executor_cases.hpp"
#include "support.cuh"

namespace cellkv::test::tp {

using namespace cellkv::batching;

inline std::vector<std::byte> bytes_at(const void* device, std::size_t n) {
  std::vector<std::byte> host(n);
  REQUIRE(cudaMemcpy(host.data(), device, n, cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

// Every step buffer a kernel reads: the step block, and for the cell layout the masks and the
// position table's device copy.
template <class Shard>
std::vector<std::vector<std::byte>> step_buffers(const Shard& s, std::size_t table_entries) {
  const gpu::StepBindings& b = s.bindings();
  std::vector<std::vector<std::byte>> out{bytes_at(b.cells, s.step_block_bytes())};
  if (b.max_cells > 0) {
    REQUIRE(b.masks != nullptr);
    out.push_back(bytes_at(b.masks, static_cast<std::size_t>(b.windows) * static_cast<std::size_t>(b.max_write) *
                                        static_cast<std::size_t>(b.max_cells)));
    out.push_back(bytes_at(b.table_flat, table_entries * sizeof(std::int32_t)));
  }
  return out;
}

// Ints of the host's position tables: the main one and with window storage each window pool's, as
// the device keeps them in one array (0: the sequence layout has none).
template <class Host>
std::size_t table_entries(const Host& host) {
  if constexpr (requires { host.table(); }) {
    std::size_t n = host.table().flat().size();
    if (host.window_storage())
      for (const std::int32_t w : Host::Windows::kWindowed) n += host.pool(w).table().flat().size();
    return n;
  } else {
    return 0;
  }
}

// One stream per shard, each created on its shard's device.
template <class Sharded>
std::vector<std::unique_ptr<gpu::Stream>> shard_streams(const Sharded& cache) {
  std::vector<std::unique_ptr<gpu::Stream>> streams;
  for (std::int32_t g = 0; g < cache.shards(); ++g) {
    const gpu::DeviceGuard on(cache.device(g));
    streams.push_back(std::make_unique<gpu::Stream>());
  }
  return streams;
}

// A single-device cache and a sharded one driven through the same random steps (new sequences,
// forks, removals, padded widths): after every upload the shards' step buffers equal the single
// cache's; each layer's shard attention equals the single attention's columns (bf16, table kernels
// where it applies); at the end each shard's pools are the single pools' columns of its KV heads.
// window_cells > 0 (cell layout): both caches keep the windowed layer in a window pool.
template <class L>
void sharded_buffers_equal_single(const std::vector<int>& devices, std::int32_t window_cells = 0) {
  using T = __nv_bfloat16;
  using W = Windows<0, 5>;
  using Single = gpu::DeviceCache<L, T, W, placement::clustered<64>, 64>;
  using Sharded = gpu::ShardedCache<L, T, W, placement::clustered<64>, 64>;
  constexpr std::int32_t Hq = 8, Hkv = 4, D = 64;
  const CacheConfig config{.max_write = 16, .max_cells = 640, .max_seqs = 8, .max_len = 80, .window_cells = window_cells};
  const gpu::PoolShape shape{.layers = W::kLayers, .heads_kv = Hkv, .head_dim = D, .heads_q = Hq};
  Single single(config, shape);
  Sharded sharded(config, shape, devices);
  const std::int32_t G = sharded.shards();
  gpu::Stream stream;
  const auto streams = shard_streams(sharded);
  std::vector<::cuda::stream_ref> refs;
  for (const auto& s : streams) refs.push_back(s->ref());
  std::mt19937_64 rng(5);
  std::vector<std::int32_t> live;
  for (int i = 0; i < 3; ++i) {
    live.push_back(single.seq_new().value());
    REQUIRE(sharded.seq_new().value() == live.back());
  }
  for (int step = 0; step < 16; ++step) {
    CAPTURE(step);
    if (step % 5 == 4) {
      live.push_back(single.seq_clone(live[0]).value());
      REQUIRE(sharded.seq_clone(live[0]).value() == live.back());
    }
    if (step == 9) {
      REQUIRE(single.seq_rm(live[1]).ok());
      REQUIRE(sharded.seq_rm(live[1]).ok());
      live.erase(live.begin() + 1);
    }
    std::vector<std::int32_t> ids;
    for (const std::int32_t id : live)
      for (auto n = rng() % 4; n > 0 && ids.size() < 12; --n) ids.push_back(id);
    if (ids.empty()) ids.push_back(live[0]);
    const auto plan = single.declare_step(ids);
    if (!plan.ok()) break;
    REQUIRE(sharded.declare_step(ids).ok());
    const auto T_tokens = static_cast<std::int32_t>(ids.size());
    const std::int32_t width = T_tokens + static_cast<std::int32_t>(rng() % 3);  // padded like a graph bucket
    REQUIRE(single.upload(stream, width, gpu::Masks::always).ok());
    REQUIRE(sharded.upload(refs, width, gpu::Masks::always).ok());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    const std::size_t entries = table_entries(single.host());
    const auto want = step_buffers(single.shard(), entries);
    for (std::int32_t g = 0; g < G; ++g) CHECK(step_buffers(sharded.shard(g), entries) == want);
    for (std::int32_t layer = 0; layer < W::kLayers; ++layer) {
      const auto w = static_cast<std::size_t>(width);
      const auto q = random_values<T>(w * Hq * D, rng), k = random_values<T>(w * Hkv * D, rng),
                 v = random_values<T>(w * Hkv * D, rng);
      DeviceArray<T> dq(q), dk(k), dv(v), dout(q.size());
      REQUIRE(single.update_and_attend(layer, dq.data(), dk.data(), dv.data(), dout.data(), width, Hq, 0.f, stream).ok());
      stream.synchronize();
      const auto out = as_double(dout.download());
      for (std::int32_t g = 0; g < G; ++g) {
        const HeadShard heads = sharded.heads(g);
        const gpu::DeviceGuard on(sharded.device(g));
        DeviceArray<T> sq(columns(q, Hq * D, heads.q.first * D, heads.q.count * D));
        DeviceArray<T> sk(columns(k, Hkv * D, heads.kv.first * D, heads.kv.count * D));
        DeviceArray<T> sv(columns(v, Hkv * D, heads.kv.first * D, heads.kv.count * D));
        DeviceArray<T> sout(static_cast<std::size_t>(width * heads.q.count * D));
        REQUIRE(sharded.shard(g)
                    .update_and_attend(layer, sq.data(), sk.data(), sv.data(), sout.data(), width, heads.q.count, 0.f,
                                       refs[static_cast<std::size_t>(g)])
                    .ok());
        streams[static_cast<std::size_t>(g)]->synchronize();
        const auto got = sout.download();
        const auto want_cols = columns(out, Hq * D, heads.q.first * D, heads.q.count * D);
        // Real tokens only: padding rows are never read.
        const std::vector<T> got_real(got.begin(), got.begin() + T_tokens * heads.q.count * D);
        const std::vector<double> want_real(want_cols.begin(), want_cols.begin() + T_tokens * heads.q.count * D);
        CHECK(compare_outputs(got_real, want_real, D) < tolerance<T>());
      }
    }
    REQUIRE(single.commit(stream).ok());
    REQUIRE(sharded.commit(refs).ok());
  }
  // Pools: shard g's rows are the single pool's rows restricted to its KV heads.
  for (std::int32_t layer = 0; layer < W::kLayers; ++layer) {
    const auto view = single.view(layer);
    const std::int64_t rows = view.rows;
    const auto k_all = bytes_at(view.k, static_cast<std::size_t>(rows * Hkv * D) * sizeof(T));
    for (std::int32_t g = 0; g < G; ++g) {
      const HeadShard heads = sharded.heads(g);
      const auto sview = sharded.shard(g).view(layer);
      CHECK(sview.rows == rows);
      CHECK(bytes_at(sview.k, static_cast<std::size_t>(rows * heads.kv.count * D) * sizeof(T)) ==
            columns(k_all, Hkv * D * sizeof(T), heads.kv.first * D * sizeof(T), heads.kv.count * D * sizeof(T)));
    }
  }
  require_device_ok();
}

// ---- the tensor-parallel example model against the single-GPU one ----
using Layers = Windows<0, 6>;
inline const llama::Config kConfig{.vocab = 128, .dim = 64, .layers = Layers::kLayers, .heads_q = 4, .heads_kv = 2,
                                   .head_dim = 64, .ffn = 96, .seed = 11};
inline const SessionLimits kLimits{.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = 96};
inline const CacheConfig kCacheConfig{.max_write = 24, .max_cells = 1024, .max_seqs = 8, .max_len = 128};
inline const gpu::PoolShape kShape{.layers = Layers::kLayers, .heads_kv = 2, .head_dim = 64, .heads_q = 4};

inline const llama::Weights& weights() {
  static const llama::Weights w = llama::generate(kConfig);
  return w;
}

// Five sessions of different prompt lengths and a fork of the third after four steps, run to the
// end: every session's generated tokens, the fork's last.
template <class M, class C>
std::vector<std::vector<std::int32_t>> generate_all(M& model, C& cache) {
  Executor<M, C> exec(model, cache, kLimits);
  const std::int32_t lengths[] = {1, 4, 13, 31, 50};
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 5; ++i) {
    std::vector<std::int32_t> prompt;
    for (std::int32_t t = 0; t < lengths[i]; ++t) prompt.push_back((t * 29 + i * 11 + 5) % kConfig.vocab);
    ids.push_back(exec.sessions().add(prompt, 16).value());
  }
  for (int s = 0; s < 4; ++s) REQUIRE(exec.step().ok());
  ids.push_back(exec.sessions().clone(ids[2], 16).value());
  REQUIRE(exec.run_until_idle().ok());
  return outputs_of(exec, std::span<const SessionId>(ids));
}

template <class L, class P>
std::vector<std::vector<std::int32_t>> single_gpu_outputs() {
  using C = gpu::DeviceCache<L, float, Layers, P, 16>;
  gpu::Stream stream;
  C cache(kCacheConfig, kShape);
  llama::GpuLlama<C> model(kConfig, weights(), cache, stream.get());
  return generate_all(model, cache);
}

template <class L, class P>
std::vector<std::vector<std::int32_t>> tensor_parallel_outputs(const std::vector<int>& devices,
                                                               llama::AllReduce<float>& reduce,
                                                               llama::GpuOptions options = {}) {
  using C = gpu::ShardedCache<L, float, Layers, P, 16>;
  C cache(kCacheConfig, kShape, devices);
  llama::TpLlama<C> model(kConfig, weights(), cache, reduce, options);
  auto out = generate_all(model, cache);
  CHECK((model.graph_stats().replays > 0) == (options.graphs && reduce.capturable()));
  return out;
}

}  // namespace cellkv::test::tp
