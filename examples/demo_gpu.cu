// The main demo: on the GPU when there is one (CUDA graphs, cuBLAS, cellkv's device cache), else
// on the host reference path. Exits 1 when a solo re-run does not match the batch.
//   build/examples/cellkv-demo [--kv fp32 | bf16 | fp8]
// --kv picks the GPU cache's K/V storage and with it the model's arithmetic: fp32 (the default:
// fp32 storage and arithmetic), bf16 (bf16 storage and arithmetic), fp8 (bf16 arithmetic, K/V
// stored as E4M3 codes with an fp32 scale per row-head, gpu::Fp8<bf16>). The host path is fp32 only.
#include <cellkv/batching/executor.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cstdio>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "demo.hpp"
#include "demo_host.hpp"
#include "llama/gpu_llama.cuh"

namespace demo {

// S: the cache's element parameter (float, __nv_bfloat16 or gpu::Fp8<__nv_bfloat16>). fp32 by
// default, so that a session alone and the same session in a batch produce the same tokens (bf16
// rounding of different batch shapes could flip a near-tie of two logits). With fp8 the quantization
// itself is batch-invariant (each row-head's scale comes from that row-head alone), so a solo re-run
// differs from the batch only where the bf16 arithmetic of the model does (compare --kv bf16): a
// wide batch runs cuBLAS, a session alone the skinny GEMV, and their roundings differ. In bf16 the
// check therefore asks for the batch's context shifts and length and reports the tokens' agreement
// (demo.hpp check_solo); in fp32 it asks for the same tokens.
template <class S>
int run_gpu(const char* kv_name) {
  // Gemma-style: 5 sliding-window layers to 1 full-attention layer, the window scaled to the demo's
  // contexts (up to 256 positions) so that windows fill and window storage lets old rows go. A
  // context shift keeps positions 0..31, which window pools have let go of by then, and drops half
  // of the rest: the next token (position 144) must not see them through its window, so the window
  // is at most 144 - 32 = 112 (a larger one is refused with window_evicted; docs/design.md).
  constexpr std::int32_t kWindow = 64;
  using Model = cellkv::Windows<kWindow, kWindow, kWindow, kWindow, kWindow, 0>;
  using Cache = cellkv::gpu::DeviceCache<cellkv::layout::cell, S, Model, cellkv::placement::clustered<64>, 64>;
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
  // The batch keeps the windowed layers' K/V in a window pool (the concurrent sessions x (window
  // + a page of 64 + a step of 64) cells); the solo re-runs store every layer in full, so matching
  // tokens show that window storage changes nothing a query sees.
  const cellkv::CacheConfig full_config{.max_write = s.limits.max_write, .max_cells = 16384, .max_seqs = 64};
  cellkv::CacheConfig cache_config = full_config;
  cache_config.window_cells = s.concurrency * (kWindow + 64 + s.limits.max_write);
  const cellkv::gpu::PoolShape shape{.layers = config.layers, .heads_kv = config.heads_kv, .head_dim = config.head_dim,
                                     .heads_q = config.heads_q};
  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  const bool fp32 = std::is_same_v<S, float>;
  std::printf("cellkv demo on the GPU (%s): a %d-layer decoder in %s through cuBLAS, K/V cache %s, windows {%d x 5, "
              "0}, cell layout, %d cells; window layers stored in a pool of %d cells; CUDA graphs per step width\n",
              prop.name, config.layers, fp32 ? "fp32" : "bf16", kv_name, kWindow, cache_config.max_cells,
              cache_config.window_cells);
  cellkv::gpu::Stream stream;
  Cache cache(cache_config, shape);
  const auto footprint = Cache::Shard::footprint(cache_config, shape);
  const auto full_footprint = Cache::Shard::footprint(full_config, shape);
  if (footprint.ok() && full_footprint.ok())
    std::printf("  K/V pools: %.1f MiB with window storage, %.1f MiB storing every layer in full (%zu bytes per cell)\n",
                static_cast<double>(footprint.value().kv_pools) / (1024.0 * 1024.0),
                static_cast<double>(full_footprint.value().kv_pools) / (1024.0 * 1024.0),
                cellkv::pool_bytes_per_cell(shape, cellkv::gpu::kv_storage_of<S>()).value_or(0));
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
    Cache solo_cache(full_config, shape);
    llama::GpuLlama<Cache> solo_model(config, weights, solo_cache, stream.get());
    cellkv::batching::Executor solo(solo_model, solo_cache, s.limits);
    return generate_alone(solo, prompt, max_new, sampling);
  }, /*exact=*/fp32);
  std::printf("%s\n", mismatches != 0 ? "FAILED: solo re-runs differ"
                       : fp32     ? "OK: every solo re-run (full storage) matched the batch (window storage)"
                                  : "OK: every solo re-run (full storage) matched the batch's (window storage) context "
                                    "shifts and length");
  return mismatches == 0 ? 0 : 1;
}

}  // namespace demo

int main(int argc, char** argv) {
  std::string_view kv = "fp32";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--kv") == 0 && i + 1 < argc) {
      kv = argv[++i];
    } else {
      std::printf("usage: cellkv-demo [--kv fp32 | bf16 | fp8]\n");
      return 2;
    }
  }
  if (kv != "fp32" && kv != "bf16" && kv != "fp8") {
    std::printf("cellkv demo: --kv takes fp32, bf16 or fp8, not %.*s\n", static_cast<int>(kv.size()), kv.data());
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    if (kv != "fp32") std::printf("cellkv demo: --kv %.*s needs a CUDA device; the host path runs in fp32\n",
                                  static_cast<int>(kv.size()), kv.data());
    return demo::run_host();
  }
  try {
    if (kv == "fp8") return demo::run_gpu<cellkv::gpu::Fp8<__nv_bfloat16>>("fp8 e4m3 (fp32 scale per row-head)");
    if (kv == "bf16") return demo::run_gpu<__nv_bfloat16>("bf16");
    return demo::run_gpu<float>("fp32");
  } catch (const std::exception& e) {
    std::printf("cellkv demo: %s\n", e.what());
    return 1;
  }
}
