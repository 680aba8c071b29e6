// demo_host.hpp - the main demo on the host reference path: a small model in fp32, plain loops.
#pragma once

#include <cellkv/batching/executor.hpp>
#include <cellkv/kv_cache.hpp>

#include <cstdio>

#include "demo.hpp"
#include "llama/host_llama.hpp"

namespace demo {

inline int run_host() {
  using Model = cellkv::Windows<0, 32, 0, 32>;  // two sliding-window layers: two mask buffers
  using Cache = cellkv::CellCache<Model, cellkv::placement::clustered<16>, 64>;
  const llama::Config config{.vocab = 256, .dim = 128, .layers = Model::kLayers, .heads_q = 4, .heads_kv = 2,
                             .head_dim = 64, .ffn = 256};
  const llama::Weights weights = llama::generate(config);
  Settings s;
  // The batch keeps the windowed layers' K/V in a window pool (16 sequences x (window 32 + a page
  // of 64 + a step of 64) cells); the solo re-runs store every layer in full, so matching tokens
  // show that window storage changes nothing a query sees.
  const cellkv::CacheConfig full_config{.max_write = s.limits.max_write, .max_cells = 4096, .max_seqs = 16};
  cellkv::CacheConfig cache_config = full_config;
  cache_config.window_cells = 16 * (32 + 64 + s.limits.max_write);
  std::printf("cellkv demo on the host reference path (no CUDA device here): a %d-layer decoder in fp32, "
              "windows {0, 32, 0, 32}, cell layout, %d cells; window layers stored in a pool of %d cells\n",
              config.layers, cache_config.max_cells, cache_config.window_cells);
  Cache cache(cache_config);
  llama::HostLlama<Cache> model(config, weights, cache);
  cellkv::batching::Executor exec(model, cache, s.limits);
  const auto requests = make_requests(s, config.vocab);
  const Outcome out = serve(exec, cache, requests, s, [] {});
  const int mismatches = check_solo(requests, out, s, [&](const std::vector<std::int32_t>& prompt, std::int32_t max_new,
                                                          const cellkv::batching::SamplingParams& sampling) {
    Cache solo_cache(full_config);
    llama::HostLlama<Cache> solo_model(config, weights, solo_cache);
    cellkv::batching::Executor solo(solo_model, solo_cache, s.limits);
    return generate_alone(solo, prompt, max_new, sampling);
  });
  std::printf("%s\n", mismatches == 0 ? "OK: every solo re-run (full storage) matched the batch (window storage)"
                                      : "FAILED: solo re-runs differ");
  return mismatches == 0 ? 0 : 1;
}

}  // namespace demo
