// tp_bench: decode throughput of the example model split over G GPUs (tensor parallelism: heads
// and MLP columns per GPU, NCCL all-reduce twice per layer, CUDA graphs per step width) at 64
// sessions, against the same model on one GPU without NCCL (GpuLlama) in the same run. Each session
// feeds a 128-token prompt (untimed), then decode steps are timed, one token per session per step.
// Prints JSON lines and a table on stderr. Not a test.
//
//   build/benchmarks/cellkv-bench-tp [--sessions N] [--model small | 3b] [--procs G] [--out FILE]
//
// Rows: one_gpu_no_nccl; tp_g1_nccl and tp_g2_nccl (TpLlama: one host thread per GPU, one
// process); with --procs G, tp_g<G>_procs: G rank processes of this program (one GPU each, started
// by it through llama::launch_ranks, NCCL's id handed down in the environment), each a GpuLlama over
// a llama::NcclGroup, plus the time of one step's all-reduces measured eagerly in those processes
// (2 x layers all-reduces of sessions x dim elements). --model 3b: 16 layers, dim 4096, H_q 32,
// H_kv 8, ffn 11008 (about 3 B parameters) instead of the small default (8 layers, dim 2048, 0.45 B).
#include <cellkv/batching/executor.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/sharded_cache.cuh>
#include <cellkv/gpu/stream.hpp>
#include <cellkv/sharding.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama/gpu_llama.cuh"
#include "llama/nccl_group.cuh"
#include "llama/nccl_reduce.cuh"
#include "llama/rank_launcher.hpp"
#include "llama/rank_world.hpp"
#include "llama/tp_llama.cuh"
#include "decode_timing.hpp"

namespace {

using T = __nv_bfloat16;
constexpr std::int32_t kPrompt = 128, kDecode = 48, kMaxLen = 256;

// A model's layer count is part of its cache type (one window per layer, all full attention).
struct Small {
  using Windows = cellkv::Windows<0, 0, 0, 0, 0, 0, 0, 0>;
  static constexpr llama::Config config{.vocab = 16384, .dim = 2048, .layers = Windows::kLayers, .heads_q = 16,
                                        .heads_kv = 8, .head_dim = 128, .ffn = 5632};
};
// About 3 B parameters (the host generates every process's weights in fp32 first: about 11 GB each).
struct Large {
  using Windows = cellkv::Windows<0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0>;
  static constexpr llama::Config config{.vocab = 16384, .dim = 4096, .layers = Windows::kLayers, .heads_q = 32,
                                        .heads_kv = 8, .head_dim = 128, .ffn = 11008};
};

struct Args {
  std::int32_t sessions = 64;
  std::string model = "small";
  std::int32_t procs = 0;  // 0: no process rows
  std::string out;          // JSON lines (stdout when empty)
  llama::RankWorld world;   // a rank process (started by --procs)
  bool rank = false;
};

cellkv::CacheConfig cache_config(std::int32_t sessions) {
  return {.max_write = 256, .max_cells = sessions * kMaxLen + 256, .max_seqs = sessions, .max_len = kMaxLen};
}

template <class M>
cellkv::gpu::PoolShape model_shape() {
  return {.layers = M::config.layers, .heads_kv = M::config.heads_kv, .head_dim = M::config.head_dim,
          .heads_q = M::config.heads_q};
}

template <class M>
using Single = cellkv::gpu::DeviceCache<cellkv::layout::cell, T, typename M::Windows, cellkv::placement::clustered<64>>;
template <class M>
using Sharded = cellkv::gpu::ShardedCache<cellkv::layout::cell, T, typename M::Windows, cellkv::placement::clustered<64>>;

template <class M, class Model, class C>
double decode_tokens_per_second(Model& model, C& cache, std::int32_t sessions) {
  cellkv::batching::Executor exec(model, cache, {.max_write = 256, .min_prefill_tokens = 2, .max_tokens_per_session = kMaxLen});
  return bench::decode_tokens_per_second(exec, sessions, kPrompt, kDecode - 8, M::config.vocab);
}

template <class M>
double single_gpu(const llama::Weights& w, std::int32_t sessions) {
  cellkv::gpu::Stream stream;
  Single<M> cache(cache_config(sessions), model_shape<M>());
  llama::GpuLlama<Single<M>> model(M::config, w, cache, stream.get(), {.max_graph_width = 256});
  return decode_tokens_per_second<M>(model, cache, sessions);
}

template <class M>
double tensor_parallel(const llama::Weights& w, std::int32_t sessions, const std::vector<int>& devices) {
  Sharded<M> cache(cache_config(sessions), model_shape<M>(), devices);
  llama::NcclReduce<T> reduce(devices);
  llama::TpLlama<Sharded<M>> model(M::config, w, cache, reduce, {.max_graph_width = 256});
  return decode_tokens_per_second<M>(model, cache, sessions);
}

// Milliseconds of one decode step's all-reduces (2 per layer, sessions x dim elements each), eager,
// the mean over 20 steps after 3 warm-up steps; every rank calls it at the same point.
double all_reduce_ms_per_step(llama::ProcessGroup<T>& group, std::int32_t layers, std::size_t count, cudaStream_t stream) {
  cellkv::gpu::DeviceBuffer<T> x(count);
  CELLKV_CUDA_THROW(cudaMemset(x.data(), 0, count * sizeof(T)));
  cellkv::gpu::Event begin(true), end(true);
  auto step = [&] {
    for (std::int32_t i = 0; i < 2 * layers; ++i)
      if (!group.sum(group.rank(), x.data(), count, stream).ok()) throw std::runtime_error(group.failure());
  };
  for (int i = 0; i < 3; ++i) step();
  CELLKV_CUDA_THROW(cudaEventRecord(begin.get(), stream));
  for (int i = 0; i < 20; ++i) step();
  CELLKV_CUDA_THROW(cudaEventRecord(end.get(), stream));
  if (!group.wait(end.get()).ok()) throw std::runtime_error(group.failure());
  float ms = 0;
  CELLKV_CUDA_THROW(cudaEventElapsedTime(&ms, begin.get(), end.get()));
  return ms / 20.0;
}

void report(std::FILE* out, const char* model, std::int32_t sessions, const std::string& impl, double tps, double base,
            double all_reduce_ms = -1) {
  std::fprintf(out, "{\"work\": \"tp_decode\", \"shape\": \"%s, %d sessions\", \"impl\": \"%s\", \"metric\": %.1f, "
                    "\"unit\": \"tokens/s\"",
               model, sessions, impl.c_str(), tps);
  if (all_reduce_ms >= 0) std::fprintf(out, ", \"all_reduce_ms_per_step\": %.3f", all_reduce_ms);
  std::fprintf(out, "}\n");
  std::fflush(out);
  std::fprintf(stderr, "  %-6s %4d sessions  %-28s %10.1f tokens/s  %5.2fx one GPU", model, sessions, impl.c_str(), tps,
               tps / base);
  if (all_reduce_ms >= 0) std::fprintf(stderr, "  (all-reduces %.3f ms a step)", all_reduce_ms);
  std::fprintf(stderr, "\n");
}

// A rank process of the tp_g<G>_procs row: its shard through a NcclGroup; rank 0 prints the row.
template <class M>
int run_rank(const Args& a) {
  const llama::RankWorld& w = a.world;
  CELLKV_CUDA_THROW(cudaSetDevice(w.local_rank));
  const llama::Weights weights = llama::generate(M::config);
  const cellkv::gpu::PoolShape model = model_shape<M>();
  const cellkv::HeadShard heads = cellkv::head_shard(model.heads_q, model.heads_kv, w.world, w.rank).value();
  llama::NcclGroup<T> group(w, llama::Rendezvous(w.rendezvous), std::chrono::seconds(120));
  cellkv::gpu::Stream stream;
  Single<M> cache(cache_config(a.sessions), {.layers = model.layers, .heads_kv = heads.kv.count,
                                             .head_dim = model.head_dim, .heads_q = heads.q.count});
  double tps = 0, reduce_ms = 0;
  {
    llama::GpuLlama<Single<M>> rank(M::config, weights, cache, stream.get(), group,
                                    {.max_graph_width = 256, .check_plans = false});
    tps = decode_tokens_per_second<M>(rank, cache, a.sessions);
  }
  reduce_ms = all_reduce_ms_per_step(group, model.layers, static_cast<std::size_t>(a.sessions) * M::config.dim, stream.get());
  if (w.rank == 0) {
    std::FILE* out = std::fopen(a.out.c_str(), "a");
    if (out == nullptr) return 1;
    std::fprintf(out, "%.3f %.4f\n", tps, reduce_ms);
    std::fclose(out);
  }
  return 0;
}

// The tp_g<G>_procs row: G ranks of this program, NCCL's id in the environment (this process hosts
// NCCL's bootstrap root). Returns tokens/s and all-reduce ms per step.
std::pair<double, double> processes(const Args& a, const char* self) {
  (void)llama::publish_nccl_job_id(llama::Rendezvous("env"));
  char tmpl[] = "/tmp/cellkv-bench-tp-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) throw std::runtime_error("mkstemp failed");
  close(fd);
  const std::string result = tmpl;
  const auto exits = llama::launch_ranks(self, a.procs, [&](std::int32_t r) {
    return std::vector<std::string>{"--model", a.model, "--sessions", std::to_string(a.sessions), "--rank",
                                    std::to_string(r), "--world", std::to_string(a.procs), "--rendezvous", "env",
                                    "--out", result};
  }, std::chrono::seconds(150));
  std::ifstream in(result);
  double tps = 0, ms = 0;
  const bool read = static_cast<bool>(in >> tps >> ms);
  std::remove(result.c_str());
  for (const llama::RankExit& e : exits)
    if (!e.ok()) throw std::runtime_error("a rank process failed (" + e.describe() + ")");
  if (!read) throw std::runtime_error("rank 0 wrote no result");
  return {tps, ms};
}

template <class M>
int run(const Args& a, int devices, const char* self) {
  std::FILE* out = a.out.empty() ? stdout : std::fopen(a.out.c_str(), "w");
  if (out == nullptr) return 1;
  const llama::Config& c = M::config;
  std::fprintf(stderr, "cellkv tensor-parallel benchmark: bf16 decoder '%s', %d layers, dim %d, H_q %d, H_kv %d, D %d, "
                       "ffn %d, vocab %d; %d sessions, prompt %d, decode steps timed; %d GPU(s)\n",
               a.model.c_str(), c.layers, c.dim, c.heads_q, c.heads_kv, c.head_dim, c.ffn, c.vocab, a.sessions, kPrompt,
               devices);
  const char* name = a.model.c_str();
  double base = 0;
  {
    const llama::Weights weights = llama::generate(c);
    base = single_gpu<M>(weights, a.sessions);
    report(out, name, a.sessions, "one_gpu_no_nccl", base, base);
    report(out, name, a.sessions, "tp_g1_nccl", tensor_parallel<M>(weights, a.sessions, {0}), base);
    if (devices >= 2) report(out, name, a.sessions, "tp_g2_nccl", tensor_parallel<M>(weights, a.sessions, {0, 1}), base);
    else std::fprintf(stderr, "  G = 2 not run: one GPU\n");
  }
  if (a.procs > 0) {
    if (a.procs > devices) {
      std::fprintf(stderr, "  %d processes not run: %d GPU(s)\n", a.procs, devices);
    } else {
      const auto [tps, ms] = processes(a, self);
      report(out, name, a.sessions, "tp_g" + std::to_string(a.procs) + "_procs", tps, base, ms);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i];
    const char* value = argv[i + 1];
    const auto n = llama::parse_int32(value);
    if (flag == "--sessions" && n && *n > 0) a.sessions = *n;
    else if (flag == "--procs" && n && *n > 0) a.procs = *n;
    else if (flag == "--rank" && n) a.world.rank = *n, a.rank = true;
    else if (flag == "--world" && n) a.world.world = *n;
    else if (flag == "--rendezvous") a.world.rendezvous = value;
    else if (flag == "--out") a.out = value;
    else if (flag == "--model" && (std::string_view(value) == "small" || std::string_view(value) == "3b")) a.model = value;
    else {
      std::fprintf(stderr, "usage: cellkv-bench-tp [--sessions N] [--model small|3b] [--procs G] [--out FILE]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cellkv-bench-tp: needs a CUDA device\n");
    return 1;
  }
  try {
    if (a.rank) {
      a.world.local_rank = a.world.rank;
      a.world.check();
      return a.model == "3b" ? run_rank<Large>(a) : run_rank<Small>(a);
    }
    return a.model == "3b" ? run<Large>(a, devices, "/proc/self/exe") : run<Small>(a, devices, "/proc/self/exe");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv-bench-tp: %s\n", e.what());
    return 1;
  }
}
