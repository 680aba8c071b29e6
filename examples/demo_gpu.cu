// The main demo: on the GPU when there is one (CUDA graphs, cuBLAS, cellkv's device cache), else
// on the host reference path. Exits 1 when a solo re-run does not match the batch.
//   build/examples/cellkv-demo
#include <cellkv/batching/executor.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cstdio>

#include "demo.hpp"
#include "demo_host.hpp"
#include "llama/gpu_llama.cuh"

namespace demo {

// fp32 storage and arithmetic, so that a session alone and the same session in a batch produce
// the same tokens (bf16 rounding of different batch shapes could flip a near-tie of two logits).
int run_gpu() {
  using Model = cellkv::Windows<0, 128, 0, 128, 0, 128>;
  using Cache = cellkv::gpu::DeviceCache<cellkv::layout::cell, float, Model, cellkv::placement::clustered<64>, 64>;
  const llama::Config config{.vocab = 2048, .dim = 512, .layers = Model::kLayers, .heads_q = 8, .heads_kv = 2,
                             .head_dim = 64, .ffn = 1024};
  const llama::Weights weights = llama::generate(config);
  Settings s;
  s.sessions = 48;
  s.concurrency = 24;
  s.max_prompt = 200;
  s.max_new = 32;
  s.long_max_new = 320;  // past the budget of 256 positions: these sessions shift, some twice
  s.limits.max_tokens_per_session = 256;
  s.limits.context_shift.keep = 32;
  const cellkv::CacheConfig cache_config{.max_write = s.limits.max_write, .max_cells = 16384, .max_seqs = 64};
  const cellkv::gpu::PoolShape shape{.layers = config.layers, .heads_kv = config.heads_kv, .head_dim = config.head_dim,
                                     .heads_q = config.heads_q};
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  std::printf("cellkv demo on the GPU (%s): a %d-layer decoder in fp32 through cuBLAS, windows {0, 128} x 3, "
              "cell layout, %d cells, CUDA graphs per step width\n",
              prop.name, config.layers, cache_config.max_cells);
  cellkv::gpu::Stream stream;
  Cache cache(cache_config, shape);
  llama::GpuLlama<Cache> model(config, weights, cache, stream.get());
  cellkv::batching::Executor exec(model, cache, s.limits);
  const auto requests = make_requests(s, config.vocab);
  const Outcome out = serve(exec, cache.host(), requests, s, [&] {
    const auto& g = model.graph_stats();
    std::printf("  CUDA graphs: %lld captures, %lld replays, %lld eager steps\n", static_cast<long long>(g.captures),
                static_cast<long long>(g.replays), static_cast<long long>(g.eager));
  });
  const int mismatches = check_solo(requests, out, s, [&](const std::vector<std::int32_t>& prompt, std::int32_t max_new,
                                                          const cellkv::batching::SamplingParams& sampling) {
    Cache solo_cache(cache_config, shape);
    llama::GpuLlama<Cache> solo_model(config, weights, solo_cache, stream.get());
    cellkv::batching::Executor solo(solo_model, solo_cache, s.limits);
    return generate_alone(solo, prompt, max_new, sampling);
  });
  std::printf("%s\n", mismatches == 0 ? "OK: every solo re-run matched the batch" : "FAILED: solo re-runs differ");
  return mismatches == 0 ? 0 : 1;
}

}  // namespace demo

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return demo::run_host();
  try {
    return demo::run_gpu();
  } catch (const std::exception& e) {
    std::printf("cellkv demo: %s\n", e.what());
    return 1;
  }
}
