// tp_bench: decode throughput of the example model split over G GPUs (tensor parallelism: heads
// and MLP columns per GPU, NCCL all-reduce twice per layer, one host thread per GPU, CUDA graphs
// per step width) at 64 sessions, against the same model on one GPU without NCCL (GpuLlama) in
// the same run. Each session feeds a 128-token prompt (untimed), then decode steps are timed, one
// token per session per step. Prints JSON lines and a table on stderr. Not a test.
//
//   build/benchmarks/cellkv-bench-tp [--sessions N] [--out FILE]
#include <cellkv/batching/executor.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/sharded_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "llama/gpu_llama.cuh"
#include "llama/nccl_reduce.cuh"
#include "llama/tp_llama.cuh"
#include "decode_timing.hpp"

namespace {

using T = __nv_bfloat16;
using Model = cellkv::Windows<0, 0, 0, 0, 0, 0, 0, 0>;
using Single = cellkv::gpu::DeviceCache<cellkv::layout::cell, T, Model, cellkv::placement::clustered<64>>;
using Sharded = cellkv::gpu::ShardedCache<cellkv::layout::cell, T, Model, cellkv::placement::clustered<64>>;
constexpr std::int32_t kPrompt = 128, kDecode = 48, kMaxLen = 256;

const llama::Config kConfig{.vocab = 16384, .dim = 2048, .layers = Model::kLayers, .heads_q = 16, .heads_kv = 8,
                            .head_dim = 128, .ffn = 5632};

cellkv::CacheConfig cache_config(std::int32_t sessions) {
  return {.max_write = 256, .max_cells = sessions * kMaxLen + 256, .max_seqs = sessions, .max_len = kMaxLen};
}
const cellkv::gpu::PoolShape kShape{.layers = kConfig.layers, .heads_kv = kConfig.heads_kv,
                                    .head_dim = kConfig.head_dim, .heads_q = kConfig.heads_q};

template <class M, class C>
double decode_tokens_per_second(M& model, C& cache, std::int32_t sessions) {
  cellkv::batching::Executor exec(model, cache, {.max_write = 256, .min_prefill_tokens = 2, .max_tokens_per_session = kMaxLen});
  return bench::decode_tokens_per_second(exec, sessions, kPrompt, kDecode - 8, kConfig.vocab);
}

double single_gpu(const llama::Weights& w, std::int32_t sessions) {
  cellkv::gpu::Stream stream;
  Single cache(cache_config(sessions), kShape);
  llama::GpuLlama<Single> model(kConfig, w, cache, stream.get(), {.max_graph_width = 256});
  return decode_tokens_per_second(model, cache, sessions);
}

double tensor_parallel(const llama::Weights& w, std::int32_t sessions, const std::vector<int>& devices) {
  Sharded cache(cache_config(sessions), kShape, devices);
  llama::NcclReduce<T> reduce(devices);
  llama::TpLlama<Sharded> model(kConfig, w, cache, reduce, {.max_graph_width = 256});
  return decode_tokens_per_second(model, cache, sessions);
}

void report(std::FILE* out, std::int32_t sessions, const char* impl, double tps, double base) {
  std::fprintf(out, "{\"work\": \"tp_decode\", \"shape\": \"%d sessions\", \"impl\": \"%s\", \"metric\": %.1f, \"unit\": \"tokens/s\"}\n",
               sessions, impl, tps);
  std::fprintf(stderr, "  %4d sessions  %-28s %10.1f tokens/s  %5.2fx one GPU\n", sessions, impl, tps, tps / base);
}

}  // namespace

int main(int argc, char** argv) {
  std::int32_t sessions = 64;
  std::FILE* out = stdout;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sessions") == 0 && i + 1 < argc) sessions = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) out = std::fopen(argv[++i], "w");
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || out == nullptr) {
    std::fprintf(stderr, "cellkv-bench-tp: needs a CUDA device\n");
    return 1;
  }
  std::fprintf(stderr, "cellkv tensor-parallel benchmark: bf16 decoder, %d layers, dim %d, H_q %d, H_kv %d, D %d, "
                       "ffn %d, vocab %d; %d sessions, prompt %d, decode steps timed; %d GPU(s)\n",
               kConfig.layers, kConfig.dim, kConfig.heads_q, kConfig.heads_kv, kConfig.head_dim, kConfig.ffn,
               kConfig.vocab, sessions, kPrompt, devices);
  try {
    const llama::Weights weights = llama::generate(kConfig);
    const double base = single_gpu(weights, sessions);
    report(out, sessions, "one_gpu_no_nccl", base, base);
    report(out, sessions, "tp_g1_nccl", tensor_parallel(weights, sessions, {0}), base);
    if (devices >= 2) report(out, sessions, "tp_g2_nccl", tensor_parallel(weights, sessions, {0, 1}), base);
    else std::fprintf(stderr, "  G = 2 not run: one GPU\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv-bench-tp: %s\n", e.what());
    return 1;
  }
  return 0;
}
