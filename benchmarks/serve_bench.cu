// serve_bench: end-to-end decode throughput of the example model (bf16, cuBLAS, CUDA graphs,
// cellkv's fast attention) against the number of concurrent sessions, for both layouts. Each
// session first feeds a 128-token prompt (untimed); then 64 decode steps are timed, one token per
// session per step. Prints JSON lines and a table on stderr. Not a test.
//
//   build/benchmarks/cellkv-bench-serve [--quick] [--out FILE]
#include <cellkv/batching/executor.hpp>
#include <cellkv/cuda/device_cache.cuh>
#include <cellkv/cuda/stream.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../examples/llama/gpu_llama.cuh"
#include "decode_timing.hpp"

namespace {

using Model = cellkv::Windows<0, 0, 0, 0, 0, 0, 0, 0>;
constexpr std::int32_t kPrompt = 128, kDecode = 64;

const llama::Config kConfig{.vocab = 16384, .dim = 1024, .layers = 8, .heads_q = 16, .heads_kv = 4, .head_dim = 64,
                            .ffn = 2816};

template <class Cache>
double tokens_per_second(const llama::Weights& weights, std::int32_t sessions, std::int32_t max_len_per_seq) {
  const cellkv::CacheConfig config{.max_write = 256, .max_cells = sessions * max_len_per_seq + 256, .max_seqs = sessions,
                                   .max_len = max_len_per_seq};
  cellkv::gpu::Stream stream;
  Cache cache(config, {.layers = kConfig.layers, .heads_kv = kConfig.heads_kv, .head_dim = kConfig.head_dim,
                       .heads_q = kConfig.heads_q});
  llama::GpuLlama<Cache> model(kConfig, weights, cache, stream.get(), {.max_graph_width = 256});
  cellkv::batching::Executor exec(model, cache,
                                  {.max_write = 256, .min_prefill_tokens = 2, .max_tokens_per_session = max_len_per_seq});
  return bench::decode_tokens_per_second(exec, sessions, kPrompt, kDecode - 8, kConfig.vocab);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::FILE* out = stdout;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) out = std::fopen(argv[++i], "w");
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || out == nullptr) {
    std::fprintf(stderr, "cellkv-bench-serve: needs a CUDA device\n");
    return 1;
  }
  using Cells = cellkv::gpu::DeviceCache<cellkv::layout::cell, __nv_bfloat16, Model, cellkv::placement::clustered<64>>;
  using Slots = cellkv::gpu::DeviceCache<cellkv::layout::sequence, __nv_bfloat16, Model>;
  const llama::Weights weights = llama::generate(kConfig);
  std::fprintf(stderr, "cellkv serve benchmark: bf16 decoder, %d layers, dim %d, H_q %d, H_kv %d, D %d, vocab %d; "
                       "prompt %d, decode steps timed\n",
               kConfig.layers, kConfig.dim, kConfig.heads_q, kConfig.heads_kv, kConfig.head_dim, kConfig.vocab, kPrompt);
  const std::int32_t counts[] = {1, 4, 16, 64, 256};
  try {
    for (const std::int32_t n : counts) {
      if (quick && n > 16) break;
      const double cells = tokens_per_second<Cells>(weights, n, 256);
      const double slots = tokens_per_second<Slots>(weights, n, 256);
      std::fprintf(out, "{\"work\": \"serve\", \"shape\": \"%d sessions\", \"impl\": \"cellkv_cell_clustered\", \"metric\": %.1f, \"unit\": \"tokens/s\"}\n", n, cells);
      std::fprintf(out, "{\"work\": \"serve\", \"shape\": \"%d sessions\", \"impl\": \"cellkv_sequence\", \"metric\": %.1f, \"unit\": \"tokens/s\"}\n", n, slots);
      std::fprintf(stderr, "  %4d sessions   cell layout %10.1f tokens/s   sequence layout %10.1f tokens/s\n", n, cells, slots);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv-bench-serve: %s\n", e.what());
    return 1;
  }
  return 0;
}
