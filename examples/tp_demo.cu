// cellkv-tp-demo: the example decoder split over G processes, one tensor-parallel rank each (the
// shape vLLM, SGLang and Megatron deploy, and the only one that reaches past one machine), with
// every rank's tokens checked against the same model on one GPU. Exits 0 when they match, 1 when
// they do not or a rank failed, 2 on bad arguments, 77 when the machine lacks the GPUs.
//
//   cellkv-tp-demo --ranks G [options]              starts G ranks on this machine and waits for them
//   cellkv-tp-demo --rank R --world G --rendezvous SPEC [options]
//                                                   one rank, started by hand on its machine; under
//                                                   mpirun or srun, rank and world come from their
//                                                   environment (llama/rank_world.hpp)
// SPEC: file:DIR (an empty directory the ranks share), env (CELLKV_TP_NCCL_ID, set by a launcher)
// or tcp:HOST:PORT (NCCL's bootstrap at rank 0's machine: several machines); llama/rendezvous.hpp.
// Options:
//   --comm nccl | ipc     NCCL, one GPU per rank (the default; GPU = the rank's local index modulo
//                         the machine's GPUs; by hand, the local index is the rank), or
//                         every rank on GPU 0 through CUDA IPC (a smoke test for one-GPU machines)
//   --layout cell | sequence
//   --eager               no CUDA graphs (each step's kernels launched one by one)
//   --timeout-ms N        how long a rank waits for the others to join, or for a step, before it
//                         fails with an error naming what it waited for (default 30000)
//   --check-plans on|off  compare each step's plan digest across ranks (default: on unless NDEBUG)
//   --die-at-step N       (tests) the last rank kills itself (SIGKILL) before step N
//   --hang-at-step N      (tests) the last rank stops (sleeps for ever) before step N
//   --diverge-at-step N   (tests) the last rank adds a session of its own before step N, so its
//                         plans differ from the others'
//
// Every rank runs the same executor over the same requests (sessions of varied prompt lengths,
// greedy and seeded sampling, a fork of a running session); rank 0 samples on its device and
// broadcasts the ids, so every rank's executor plans the same next step (GpuLlama over a
// llama::ProcessGroup). The launcher hands NCCL's id to its ranks in the environment (env) or, for
// --comm ipc, makes a temporary directory for them to meet in (file:DIR).
#include <cellkv/batching/executor.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>
#include <cellkv/sharding.hpp>

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "llama/gpu_llama.cuh"
#include "llama/ipc_group.cuh"
#include "llama/nccl_group.cuh"
#include "llama/rank_launcher.hpp"
#include "llama/rank_world.hpp"
#include "llama/rendezvous.hpp"

namespace {

using Tokens = std::vector<std::vector<std::int32_t>>;

// Four layers, two of them windowed; 8 query and 4 KV heads of 64: splits over 1, 2 or 4 ranks.
using ModelWindows = cellkv::Windows<0, 16, 0, 16>;
const llama::Config kConfig{.vocab = 256, .dim = 128, .layers = ModelWindows::kLayers, .heads_q = 8, .heads_kv = 4,
                            .head_dim = 64, .ffn = 256, .seed = 7};
const cellkv::batching::SessionLimits kLimits{.max_write = 32, .min_prefill_tokens = 2, .max_tokens_per_session = 128};
const cellkv::CacheConfig kCacheConfig{.max_write = 32, .max_cells = 2048, .max_seqs = 16, .max_len = 160};

struct Options {
  std::optional<std::int32_t> ranks;  // launcher mode
  llama::RankWorld world;
  bool world_given = false;
  std::string comm = "nccl";
  std::string layout = "cell";
  bool eager = false;
  std::int32_t timeout_ms = 30000;
  std::optional<bool> check_plans;
  std::int32_t die_at_step = -1, hang_at_step = -1, diverge_at_step = -1;
  std::vector<std::string> passed_on;  // what every rank gets from the launcher
};

int usage(const char* why) {
  std::fprintf(stderr,
               "cellkv-tp-demo: %s\nusage: cellkv-tp-demo --ranks G | --rank R --world G --rendezvous SPEC\n"
               "       [--comm nccl|ipc] [--layout cell|sequence] [--eager] [--timeout-ms N]\n"
               "       [--check-plans on|off] [--die-at-step N] [--hang-at-step N] [--diverge-at-step N]\n",
               why);
  return 2;
}

std::optional<Options> parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const bool has_value = i + 1 < argc;
    auto number = [&]() -> std::optional<std::int32_t> { return has_value ? llama::parse_int32(argv[++i]) : std::nullopt; };
    auto passed = [&](int from) { o.passed_on.insert(o.passed_on.end(), argv + from, argv + i + 1); };
    const int start = i;
    if (a == "--ranks") {
      o.ranks = number();
      if (!o.ranks || *o.ranks < 1 || *o.ranks > llama::RankWorld::kMaxWorld) return std::nullopt;
    } else if (a == "--rank" || a == "--world") {
      const auto n = number();
      if (!n) return std::nullopt;
      (a == "--rank" ? o.world.rank : o.world.world) = *n;
      o.world_given = true;
    } else if (a == "--rendezvous" && has_value) {
      o.world.rendezvous = argv[++i];
    } else if ((a == "--comm" || a == "--layout") && has_value) {
      (a == "--comm" ? o.comm : o.layout) = argv[++i];
      passed(start);
    } else if (a == "--eager") {
      o.eager = true;
      passed(start);
    } else if (a == "--check-plans" && has_value) {
      const std::string_view v = argv[++i];
      if (v != "on" && v != "off") return std::nullopt;
      o.check_plans = v == "on";
      passed(start);
    } else if (a == "--timeout-ms" || a == "--die-at-step" || a == "--hang-at-step" || a == "--diverge-at-step") {
      const auto n = number();
      if (!n || *n < (a == "--timeout-ms" ? 1 : 0)) return std::nullopt;
      (a == "--timeout-ms"     ? o.timeout_ms
       : a == "--die-at-step"  ? o.die_at_step
       : a == "--hang-at-step" ? o.hang_at_step
                               : o.diverge_at_step) = *n;
      passed(start);
    } else {
      return std::nullopt;
    }
  }
  if ((o.comm != "nccl" && o.comm != "ipc") || (o.layout != "cell" && o.layout != "sequence")) return std::nullopt;
  return o;
}

// The requests every rank serves: eight sessions of varied prompt lengths (every third samples
// with a temperature and its own seed, the others are greedy) and, after four steps, a fork of the
// third. Returns every session's tokens in order.
// The faults the tests inject into one rank: before step die_at it kills itself, before step
// hang_at it stops for ever, before step diverge_at it adds a session the other ranks do not have.
struct Faults {
  std::int32_t die_at = -1, hang_at = -1, diverge_at = -1;
};

template <class Model, class Cache>
cellkv::Result<Tokens> serve(Model& model, Cache& cache, Faults faults) {
  cellkv::batching::Executor exec(model, cache, kLimits);
  const std::int32_t lengths[] = {3, 9, 17, 30, 45, 64, 5, 21};
  std::vector<cellkv::batching::SessionId> ids;
  for (std::int32_t i = 0; i < 8; ++i) {
    std::vector<std::int32_t> prompt;
    for (std::int32_t t = 0; t < lengths[i]; ++t) prompt.push_back((t * 37 + i * 13 + 1) % kConfig.vocab);
    cellkv::batching::SamplingParams sampling;
    if (i % 3 == 1) sampling = {.temperature = 0.8f, .top_p = 0.9f, .seed = 100 + static_cast<std::uint64_t>(i)};
    ids.push_back(exec.sessions().add(prompt, 24, sampling).value());
  }
  for (std::int32_t step = 0;; ++step) {
    if (step == faults.die_at) raise(SIGKILL);
    while (step == faults.hang_at) sleep(3600);
    if (step == faults.diverge_at) (void)exec.sessions().add(std::vector<std::int32_t>{1, 2, 3, 4}, 4);
    if (step == 4) ids.push_back(exec.sessions().clone(ids[2], 24).value());
    const auto r = exec.step();
    if (r.ok()) continue;
    if (r.status() == cellkv::Errc::empty_step) break;
    return r.status().code();
  }
  Tokens out;
  for (const auto id : ids) {
    const auto tokens = exec.sessions().output(id).value();
    out.emplace_back(tokens.begin(), tokens.end());
  }
  return out;
}

template <class L>
using Cache = cellkv::gpu::DeviceCache<L, float, ModelWindows, typename L::default_placement, 16>;

cellkv::gpu::PoolShape model_shape() {
  return {.layers = kConfig.layers, .heads_kv = kConfig.heads_kv, .head_dim = kConfig.head_dim, .heads_q = kConfig.heads_q};
}

// The whole model on the current GPU: the oracle.
template <class L>
Tokens single_gpu(const llama::Weights& weights) {
  cellkv::gpu::Stream stream;
  Cache<L> cache(kCacheConfig, model_shape());
  llama::GpuLlama<Cache<L>> model(kConfig, weights, cache, stream.get());
  return serve(model, cache, Faults{}).value();
}

std::unique_ptr<llama::ProcessGroup<float>> join(const Options& o) {
  const llama::Rendezvous rendezvous(o.world.rendezvous);
  const std::chrono::milliseconds timeout(o.timeout_ms);
  if (o.comm == "ipc") {
    const std::size_t max_bytes = static_cast<std::size_t>(kLimits.max_write) *
                                  std::max<std::size_t>(kConfig.dim * sizeof(float), sizeof(cellkv::batching::SampledOut));
    return std::make_unique<llama::IpcGroup<float>>(o.world, rendezvous, max_bytes, timeout);
  }
  return std::make_unique<llama::NcclGroup<float>>(o.world, rendezvous, timeout);
}

// This process's rank: its shard of the model through the group, then (rank 0) the oracle.
template <class L>
int run_rank(const Options& o) {
  const llama::RankWorld& w = o.world;
  int devices = 1;
  (void)cudaGetDeviceCount(&devices);
  const int device = o.comm == "ipc" ? 0 : w.local_rank % devices;
  if (cudaSetDevice(device) != cudaSuccess) {
    std::fprintf(stderr, "rank %d: no CUDA device %d\n", w.rank, device);
    return 1;
  }
  const llama::Weights weights = llama::generate(kConfig);
  const cellkv::gpu::PoolShape model = model_shape();
  const auto heads = cellkv::head_shard(model.heads_q, model.heads_kv, w.world, w.rank);
  if (!heads.ok()) {
    std::fprintf(stderr, "rank %d: %d ranks do not split %d KV heads\n", w.rank, w.world, model.heads_kv);
    return 2;
  }
  Tokens got;
  llama::GraphStats graphs;
  {
    std::unique_ptr<llama::ProcessGroup<float>> group;
    try {
      group = join(o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: could not join the group: %s\n", w.rank, e.what());
      return 1;
    }
    cellkv::gpu::Stream stream;
    Cache<L> cache(kCacheConfig, {.layers = model.layers, .heads_kv = heads.value().kv.count,
                                  .head_dim = model.head_dim, .heads_q = heads.value().q.count});
    llama::GpuOptions options{.graphs = !o.eager};
    if (o.check_plans) options.check_plans = *o.check_plans;
    llama::GpuLlama<Cache<L>> model_rank(kConfig, weights, cache, stream.get(), *group, options);
    const bool last = w.rank == w.world - 1;
    const auto served = serve(model_rank, cache, last ? Faults{o.die_at_step, o.hang_at_step, o.diverge_at_step} : Faults{});
    if (!served.ok()) {
      const std::string why = group->failure();
      std::fprintf(stderr, "rank %d: a step failed (%s)%s%s\n", w.rank, std::string(served.status().message()).c_str(),
                   why.empty() ? "" : ": ", why.c_str());
      if (served.status().code() == cellkv::Errc::bad_argument && why.empty())
        std::fprintf(stderr, "rank %d: the ranks' step plans differ (their verbs diverged)\n", w.rank);
      return 1;
    }
    got = served.value();
    graphs = model_rank.graph_stats();
  }
  if (w.rank != 0) return 0;
  const Tokens want = single_gpu<L>(weights);
  std::int64_t tokens = 0, same = 0;
  for (std::size_t s = 0; s < want.size(); ++s)
    for (std::size_t t = 0; t < want[s].size(); ++t, ++tokens) same += t < got[s].size() && got[s][t] == want[s][t];
  const bool ok = got == want;
  std::printf("cellkv tp demo: %d ranks over %s, %s layout, %s; %zu sessions (one a fork), %lld tokens; CUDA graphs: "
              "%lld captures, %lld replays, %lld eager steps\n",
              w.world, o.comm == "ipc" ? "CUDA IPC on one GPU" : "NCCL", o.layout.c_str(),
              o.eager ? "eager" : "CUDA graphs", want.size(), static_cast<long long>(tokens),
              static_cast<long long>(graphs.captures), static_cast<long long>(graphs.replays),
              static_cast<long long>(graphs.eager));
  std::printf("%s (%lld of %lld tokens agree)\n",
              ok ? "OK: every session's tokens equal the single-GPU model's" : "FAILED: the ranks' tokens differ from the single-GPU model's",
              static_cast<long long>(same), static_cast<long long>(tokens));
  return ok ? 0 : 1;
}

// Starts G ranks of this program on this machine and reports how each ended.
int launch(const Options& o) {
  int devices = 0;
  (void)cudaGetDeviceCount(&devices);
  const std::int32_t G = *o.ranks;
  if (o.comm == "nccl" && devices < G) {
    std::printf("cellkv tp demo: %d ranks over NCCL need %d GPUs, this machine has %d (--comm ipc runs them on one): "
                "skipped\n", G, G, devices);
    return 77;
  }
  std::string spec = "env";
  std::filesystem::path dir;
  try {
    if (o.comm == "ipc") {
      char tmpl[] = "/tmp/cellkv-tp-XXXXXX";
      if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
      dir = tmpl;
      spec = "file:" + dir.string();
    } else {
      (void)llama::publish_nccl_job_id(llama::Rendezvous("env"));  // this process hosts NCCL's bootstrap root
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv tp demo: %s\n", e.what());
    return 1;
  }
  const auto exits = llama::launch_ranks("/proc/self/exe", G, [&](std::int32_t r) {
    std::vector<std::string> args = o.passed_on;
    for (const std::string& a : {std::string("--rank"), std::to_string(r), std::string("--world"), std::to_string(G),
                                 std::string("--rendezvous"), spec})
      args.push_back(a);
    return args;
  }, std::chrono::milliseconds(std::int64_t{o.timeout_ms} + 5000));
  if (!dir.empty()) std::filesystem::remove_all(dir);
  bool ok = true;
  for (const llama::RankExit& e : exits) {
    ok = ok && e.ok();
    if (!e.ok()) std::printf("cellkv tp demo: %s\n", e.describe().c_str());
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<Options> o = parse(argc, argv);
  if (!o) return usage("bad arguments");
  try {
    if (!o->world_given && !o->ranks) {
      if (auto from_env = llama::world_from_environment([](const char* n) { return std::getenv(n); })) {
        o->world = *from_env;
        o->world_given = true;
      }
    } else if (o->world_given) {
      o->world.local_rank = o->world.rank;  // started by hand: the GPU is the rank modulo the machine's GPUs
    }
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::printf("cellkv tp demo: needs a CUDA device: skipped\n");
      return 77;
    }
    if (o->ranks) return o->world_given ? usage("--ranks starts the ranks itself: no --rank/--world") : launch(*o);
    if (!o->world_given) return usage("give --ranks G, or --rank R --world G --rendezvous SPEC");
    if (o->world.rendezvous.empty()) return usage("a rank needs --rendezvous SPEC (or CELLKV_TP_RENDEZVOUS)");
    (void)llama::Rendezvous(o->world.rendezvous);  // a bad spec is a usage error
    o->world.check();
    return o->layout == "cell" ? run_rank<cellkv::layout::cell>(*o) : run_rank<cellkv::layout::sequence>(*o);
  } catch (const std::invalid_argument& e) {
    return usage(e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv tp demo: %s\n", e.what());
    return 1;
  }
}
