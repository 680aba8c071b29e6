// serve_bench: end-to-end decode throughput of the example model (bf16, skinny GEMV or cuBLAS,
// CUDA graphs, cellkv's fast attention, greedy sampling on the device, steps overlapped) against
// the number of concurrent sessions, for both layouts. Each session first feeds a 128-token prompt
// (untimed; the executor's steps are wide enough, max(256, 2 N) tokens, that every prompt is in
// within about 128 steps, and each session's budget covers what it generates meanwhile); then
// decode steps are timed in which all N sessions generate, one token each per step (checked).
// A second timed pass with per-phase events gives the breakdown of a step. Not a test.
//
// --parallel-sampling runs the parallel-sampling job instead (parallel_sampling.hpp): 16 prompts of
// 2,048 tokens x 8 samples (SessionTable::add_samples), 256 new tokens each, on the cell layout
// (clustered<64>, steps of up to 2,048 tokens), once with the kernels reading each shared prefix
// once per step (DeviceCache::share_prefixes(true), the default) and once with share_prefixes(false).
// Each: one untimed job (graph captures), then 3 timed jobs (1 with --quick); the job with the
// median time is reported. --sampling-shape P,L,S,N picks another shape.
//
// --kv fp8 runs the sessions mode on an fp8 (E4M3) KV cache instead: the cell layout only,
// DeviceCache<cell, gpu::Fp8<bf16>, ...> (bf16 arithmetic, K/V stored as codes with an fp32 scale
// per row-head), impl cellkv_cell_fp8; its floor counts the fp8 bytes of K/V (scales included).
//
// --window-storage runs the Gemma-style model instead (serve_model.hpp: 5 layers of window 1,024 to
// 1 full-attention layer, the serve model's other dims) with prompts of 4,096 tokens, so every
// windowed layer's window is full: decode throughput with every layer storing every position
// (impl cellkv_full_storage) and with the windowed layers in window pools of N x (1,024 + 64) +
// max_write cells (CacheConfig::window_cells; impl cellkv_window_storage), cell layout,
// clustered<64>; then one row work "kv_memory", shape "5:1 W=1024, 32k context, 8 sessions",
// impl cellkv_window_storage, metric = the K/V pool bytes of window storage / full storage, unit
// "ratio" (DeviceShard::footprint of both configs, cross-checked against the pools a cache of
// the window config allocates).
//
// Output: JSON lines on stdout or --out FILE, and a table on stderr. Sessions mode: work "serve",
// shape "N sessions", impl cellkv_cell_clustered or cellkv_sequence (cellkv_cell_fp8 with --kv
// fp8), metric tokens/s, plus the breakdown fields, "kv" (bf16 or fp8), "kv_bytes_per_cell" (K and
// V of every layer, scales included: footprint.hpp pool_bytes_per_cell) and "kv_pool_bytes" (the
// cache's K/V pools, DeviceShard::footprint). Parallel sampling: work "serve_parallel_sampling",
// impl cellkv_cell_clustered (sharing on) or cellkv_cell_clustered_no_sharing, metric = generated
// tokens / wall time of the whole job (prompts fed on the way), plus the decode phase (steps in
// which every sample generates) and the fraction of samples whose tokens equal the sharing run's.
// --weights-out FILE writes the weights (bf16, the order of llama::Weights) and FILE.json the
// config, for the PyTorch peer (serve_peer.py).
//
//   build/benchmarks/cellkv-bench-serve [--quick] [--out FILE] [--weights-out FILE] [--sessions 1,16,...]
//                                       [--max-gemv-width N]   (default 16; 0: cuBLAS at every width)
//   build/benchmarks/cellkv-bench-serve --kv fp8 [--quick] [--out FILE] [--sessions 1,16,...]
//   build/benchmarks/cellkv-bench-serve --parallel-sampling [--quick] [--out FILE] [--sampling-shape 16,2048,8,256]
//   build/benchmarks/cellkv-bench-serve --window-storage [--quick] [--out FILE] [--sessions 16,64]
#include <cellkv/batching/executor.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "llama/gpu_llama.cuh"
#include "decode_timing.hpp"
#include "parallel_sampling.hpp"
#include "serve_model.hpp"

namespace {

using Model = bench::ServeWindows;
constexpr std::int32_t kPrompt = 128, kMaxLen = 384, kWarmup = 3, kTimed = 64, kProfiled = 32;
constexpr double kCopyTBs = 4.2, kGemmTFLOPs = 780.0;  // the H200's measured ceilings
std::int32_t g_max_gemv_width = 16;  // --max-gemv-width: widths up to this run the skinny GEMV, above cuBLAS

const llama::Config& kConfig = bench::kServeConfig;
const cellkv::gpu::PoolShape kShape{.layers = kConfig.layers, .heads_kv = kConfig.heads_kv,
                                    .head_dim = kConfig.head_dim, .heads_q = kConfig.heads_q};

// What a sessions run serves: the model, the prompts, and how the cache stores the windowed
// layers (window_cells: 0 for every position in the main pool).
struct RunSpec {
  const llama::Config* model = &kConfig;
  std::int32_t prompt = kPrompt, max_len = kMaxLen, max_write = 0;  // max_write 0: max(256, 2 N)
  std::int32_t window_cells = 0;
  [[nodiscard]] cellkv::gpu::PoolShape shape() const {
    return {.layers = model->layers, .heads_kv = model->heads_kv, .head_dim = model->head_dim, .heads_q = model->heads_q};
  }
  [[nodiscard]] cellkv::CacheConfig cache_config(std::int32_t sessions) const {
    const std::int32_t width = max_write > 0 ? max_write : std::max(256, 2 * sessions);
    return {.max_write = width, .max_cells = sessions * max_len + width, .max_seqs = sessions, .max_len = max_len,
            .window_cells = window_cells};
  }
};

struct Row {
  bench::DecodeRun run;
  llama::PhaseTimes phases;  // of the profiled pass
  double profiled_ms_per_step = 0;
  const char* kv = "bf16";             // the K/V storage
  std::size_t kv_bytes_per_cell = 0;   // K and V of every layer, scales included
  std::size_t kv_pool_bytes = 0;       // the cache's K/V pools
  const llama::Config* model = &kConfig;
  std::int32_t windowed_layers = 0, window = 0;  // layers that attend through `window` positions at most
};

// The K/V bytes one cell takes in a cache of type Cache (every layer, K and V, scales included).
template <class Cache>
std::size_t bytes_per_cell(const cellkv::gpu::PoolShape& shape = kShape) {
  return cellkv::pool_bytes_per_cell(shape, cellkv::gpu::kv_storage_of<typename Cache::Storage>()).value();
}

template <class Cache>
Row measure(const llama::Weights& weights, std::int32_t sessions, const RunSpec& spec = {}) {
  const cellkv::CacheConfig config = spec.cache_config(sessions);
  const cellkv::gpu::PoolShape shape = spec.shape();
  cellkv::gpu::Stream stream;
  Cache cache(config, shape);
  llama::GpuLlama<Cache> model(*spec.model, weights, cache, stream.get(),
                                {.max_graph_width = 256, .max_gemv_width = g_max_gemv_width});
  cellkv::batching::Executor exec(
      model, cache, {.max_write = config.max_write, .min_prefill_tokens = 2, .max_tokens_per_session = spec.max_len});
  bench::start_sessions(exec, sessions, spec.prompt, spec.model->vocab);
  Row row;
  row.kv = cellkv::gpu::kFp8Kv<typename Cache::Storage> ? "fp8" : "bf16";
  row.kv_bytes_per_cell = bytes_per_cell<Cache>(shape);
  row.kv_pool_bytes = Cache::Shard::footprint(config, shape).value().kv_pools;
  row.model = spec.model;
  row.run = bench::time_decode(exec, kWarmup, kTimed);
  model.set_profile(true);
  (void)bench::time_decode(exec, 2, 2);  // captures the profiled graph
  model.reset_phase_times();
  row.profiled_ms_per_step = bench::time_decode(exec, 0, kProfiled).ms_per_step;
  if (!exec.drain().ok()) throw std::runtime_error("drain refused");
  row.phases = model.phase_times();
  return row;
}

// The physical floor of one decode step of n sessions holding `context` tokens each: the bytes
// that must move (bf16 weights read once, every K/V row a query sees read once: `kv_bytes_per_cell`
// bytes each over every layer, bf16 or fp8 with its scales; windowed layers see at most their
// window) at the copy rate, plus the FLOPs (2 x parameters per token, attention) at the GEMM rate.
// The roofline (the larger of the two, as if both overlapped perfectly) is reported beside it.
struct Floor {
  double bytes = 0, flops = 0, memory_ms = 0, compute_ms = 0;
  [[nodiscard]] double ms() const { return memory_ms + compute_ms; }
  [[nodiscard]] double roofline_ms() const { return std::max(memory_ms, compute_ms); }
};
Floor floor_of(std::int32_t n, double context, const Row& r) {
  const llama::Config& c = *r.model;
  // Positions every layer's attention reads per token, summed over the layers.
  const double seen = (c.layers - r.windowed_layers) * context +
                      r.windowed_layers * (r.window > 0 ? std::min<double>(context, r.window) : context);
  const double per_layer = static_cast<double>(c.dim) * (c.q_width() + 2 * c.kv_width()) +
                           static_cast<double>(c.q_width()) * c.dim + 3.0 * c.dim * c.ffn;
  const double params = c.layers * per_layer + static_cast<double>(c.dim) * c.vocab;
  const double kv_bytes = n * seen / c.layers * static_cast<double>(r.kv_bytes_per_cell);  // K and V
  Floor f;
  f.bytes = 2.0 * params + kv_bytes + n * 2.0 * c.dim;                          // + the embedding rows
  f.flops = n * (2.0 * params + 4.0 * seen * c.q_width());                       // GEMMs + attention
  f.memory_ms = f.bytes / (kCopyTBs * 1e12) * 1e3;
  f.compute_ms = f.flops / (kGemmTFLOPs * 1e12) * 1e3;
  return f;
}

void report(std::FILE* out, std::int32_t n, const char* impl, const Row& r) {
  const bench::DecodeRun& d = r.run;
  const llama::PhaseTimes& p = r.phases;
  const double steps = static_cast<double>(std::max<std::int64_t>(p.steps, 1));
  const Floor f = floor_of(n, d.mean_context, r);
  std::fprintf(out,
               "{\"work\": \"serve\", \"shape\": \"%d sessions\", \"impl\": \"%s\", \"metric\": %.1f, \"unit\": \"tokens/s\", "
               "\"tokens_per_step\": %.2f, \"ms_per_step\": %.4f, \"mean_context\": %.1f, "
               "\"host_plan_ms\": %.4f, \"host_enqueue_ms\": %.4f, \"host_wait_ms\": %.4f, \"host_resolve_ms\": %.4f, "
               "\"gpu_upload_ms\": %.4f, \"gpu_forward_ms\": %.4f, \"gpu_sampling_ms\": %.4f, \"gpu_copy_ms\": %.4f, "
               "\"gpu_idle_ms\": %.4f, \"profiled_ms_per_step\": %.4f, \"floor_ms\": %.4f, \"floor_memory_ms\": %.4f, "
               "\"floor_compute_ms\": %.4f, \"fraction_of_floor\": %.3f, \"floor_roofline_ms\": %.4f, "
               "\"fraction_of_roofline\": %.3f, \"kv\": \"%s\", \"kv_bytes_per_cell\": %zu, \"kv_pool_bytes\": %zu}\n",
               n, impl, d.tokens_per_second, d.tokens_per_step, d.ms_per_step, d.mean_context, d.plan_ms, d.enqueue_ms,
               d.wait_ms, d.resolve_ms, p.upload_ms / steps, p.forward_ms / steps, p.sampling_ms / steps,
               p.copy_ms / steps, p.idle_ms / steps, r.profiled_ms_per_step, f.ms(), f.memory_ms, f.compute_ms,
               f.ms() / d.ms_per_step, f.roofline_ms(), f.roofline_ms() / d.ms_per_step, r.kv, r.kv_bytes_per_cell,
               r.kv_pool_bytes);
  std::fflush(out);
  std::fprintf(stderr,
               "  %4d %-22s %10.0f tok/s %6.1f tok/step %7.3f ms/step | host plan %.3f enq %.3f wait %.3f res %.3f | "
               "gpu up %.3f fwd %.3f smp %.3f cpy %.3f idle %.3f | floor %.3f ms (%.0f%%)\n",
               n, impl, d.tokens_per_second, d.tokens_per_step, d.ms_per_step, d.plan_ms, d.enqueue_ms, d.wait_ms,
               d.resolve_ms, p.upload_ms / steps, p.forward_ms / steps, p.sampling_ms / steps, p.copy_ms / steps,
               p.idle_ms / steps, f.ms(), 100.0 * f.ms() / d.ms_per_step);
}

// ---- window storage ----

using Gemma = cellkv::gpu::DeviceCache<cellkv::layout::cell, __nv_bfloat16, bench::GemmaWindows,
                                       cellkv::placement::clustered<64>>;

// The Gemma-style model at N sessions of 4,096-token prompts, full storage then window storage.
void run_window_storage(std::FILE* out, const llama::Weights& weights, std::int32_t sessions) {
  constexpr std::int32_t kLongPrompt = 4096;
  const RunSpec full{.model = &bench::kGemmaConfig, .prompt = kLongPrompt, .max_len = kLongPrompt + 512, .max_write = 1024};
  const RunSpec windowed = [&] {
    RunSpec w = full;
    w.window_cells = sessions * (bench::kGemmaWindow + 64) + full.max_write;
    return w;
  }();
  for (const auto& [spec, impl] : {std::pair{&full, "cellkv_full_storage"}, std::pair{&windowed, "cellkv_window_storage"}}) {
    Row row = measure<Gemma>(weights, sessions, *spec);
    row.windowed_layers = bench::GemmaWindows::kLayers - 1;
    row.window = bench::kGemmaWindow;
    report(out, sessions, impl, row);
    std::fprintf(stderr, "       %s: K/V pools %.1f MiB\n", impl, static_cast<double>(row.kv_pool_bytes) / (1 << 20));
  }
}

// The kv_memory row: K/V pool bytes of window storage over full storage for the Gemma-style model
// at 32k context, 8 sessions (footprints), checked against what a cache of the window config
// allocates. False when the two disagree.
bool report_kv_memory(std::FILE* out) {
  constexpr std::int32_t kSessions = 8, kContext = 32768, kWidth = 256;
  const cellkv::gpu::PoolShape shape = RunSpec{.model = &bench::kGemmaConfig}.shape();
  const cellkv::CacheConfig full{.max_write = kWidth, .max_cells = kSessions * kContext + kWidth, .max_seqs = kSessions};
  cellkv::CacheConfig windowed = full;
  windowed.window_cells = kSessions * (bench::kGemmaWindow + 64) + kWidth;
  const std::size_t full_bytes = Gemma::Shard::footprint(full, shape).value().kv_pools;
  const std::size_t window_bytes = Gemma::Shard::footprint(windowed, shape).value().kv_pools;
  std::size_t allocated = 0;
  {
    const Gemma cache(windowed, shape);
    for (std::int32_t p = 0; p < cache.pools().count(); ++p) allocated += cache.pools().pool(p)->storage().size_bytes();
  }
  const double ratio = static_cast<double>(window_bytes) / static_cast<double>(full_bytes);
  std::fprintf(out,
               "{\"work\": \"kv_memory\", \"shape\": \"5:1 W=1024, 32k context, 8 sessions\", \"impl\": "
               "\"cellkv_window_storage\", \"metric\": %.4f, \"unit\": \"ratio\", \"window_kv_pool_bytes\": %zu, "
               "\"full_kv_pool_bytes\": %zu, \"allocated_kv_pool_bytes\": %zu, \"window_cells\": %d, \"max_cells\": %d}\n",
               ratio, window_bytes, full_bytes, allocated, windowed.window_cells, full.max_cells);
  std::fflush(out);
  std::fprintf(stderr, "  kv_memory at 32k context, 8 sessions: window storage %.1f MiB / full storage %.1f MiB = %.4f "
                       "(allocated %.1f MiB)\n",
               static_cast<double>(window_bytes) / (1 << 20), static_cast<double>(full_bytes) / (1 << 20), ratio,
               static_cast<double>(allocated) / (1 << 20));
  return allocated == window_bytes;
}

// ---- parallel sampling ----

struct SamplingRow {
  bench::SamplingJob job;  // the timed job with the median time
  double slowest_seconds = 0, fastest_seconds = 0;
  std::int32_t runs = 0;
};

// One cache, model and executor; one untimed job, then `runs` timed ones.
template <class Cache>
SamplingRow measure_sampling(const llama::Weights& weights, const bench::SamplingShape& shape, bool share,
                             std::int32_t runs) {
  const std::int32_t max_write = std::max(2048, shape.sessions());
  const std::int32_t max_len = shape.prompt_len + shape.new_tokens;
  // Prompts once, then each sample's own tokens in blocks of 64 (clustered<64>), and a step's room.
  const std::int32_t cells = shape.prompts * shape.prompt_len + shape.sessions() * (shape.new_tokens + 128) + max_write;
  const cellkv::CacheConfig config{.max_write = max_write, .max_cells = cells, .max_seqs = shape.sessions(),
                                   .max_len = max_len};
  cellkv::gpu::Stream stream;
  Cache cache(config, kShape);
  cache.share_prefixes(share);
  llama::GpuLlama<Cache> model(kConfig, weights, cache, stream.get(), {.max_graph_width = 256});
  cellkv::batching::Executor exec(model, cache,
                                  {.max_write = max_write, .min_prefill_tokens = 2, .max_tokens_per_session = max_len});
  (void)bench::run_sampling_job(exec, shape, kConfig.vocab);  // graph captures, cuBLAS heuristics
  std::vector<bench::SamplingJob> jobs;
  for (std::int32_t r = 0; r < runs; ++r) jobs.push_back(bench::run_sampling_job(exec, shape, kConfig.vocab));
  std::sort(jobs.begin(), jobs.end(), [](const auto& a, const auto& b) { return a.seconds < b.seconds; });
  SamplingRow row;
  row.fastest_seconds = jobs.front().seconds;
  row.slowest_seconds = jobs.back().seconds;
  row.runs = runs;
  row.job = std::move(jobs[jobs.size() / 2]);
  return row;
}

void report_sampling(std::FILE* out, const bench::SamplingShape& shape, const char* impl, bool share,
                     const SamplingRow& r, double same_as_sharing) {
  const bench::SamplingJob& j = r.job;
  const double generated = static_cast<double>(j.generated);
  std::fprintf(out,
               "{\"work\": \"serve_parallel_sampling\", \"shape\": \"%s\", \"impl\": \"%s\", \"metric\": %.1f, "
               "\"unit\": \"tokens/s\", \"share_prefixes\": %s, \"prompts\": %d, \"prompt_len\": %d, \"samples\": %d, "
               "\"new_tokens\": %d, \"generated_tokens\": %lld, \"seconds\": %.4f, \"steps\": %d, "
               "\"decode_tokens_per_s\": %.1f, \"decode_ms_per_step\": %.4f, \"decode_steps\": %d, "
               "\"runs\": %d, \"metric_min\": %.1f, \"metric_max\": %.1f, \"same_tokens_as_sharing\": %.3f}\n",
               shape.name().c_str(), impl, j.tokens_per_second(), share ? "true" : "false", shape.prompts,
               shape.prompt_len, shape.samples, shape.new_tokens, static_cast<long long>(j.generated), j.seconds,
               j.steps, j.decode_tokens_per_second(), j.decode_ms_per_step(), j.decode_steps, r.runs,
               generated / r.slowest_seconds, generated / r.fastest_seconds, same_as_sharing);
  std::fflush(out);
  std::fprintf(stderr,
               "  %-34s %10.0f tok/s (%.0f-%.0f) | job %.3f s, %d steps | decode %10.0f tok/s, %.3f ms/step over %d "
               "steps | same tokens as sharing %.0f%%\n",
               impl, j.tokens_per_second(), generated / r.slowest_seconds, generated / r.fastest_seconds, j.seconds,
               j.steps, j.decode_tokens_per_second(), j.decode_ms_per_step(), j.decode_steps, 100.0 * same_as_sharing);
}

// "P,L,S,N" into a shape; false when it is not four positive numbers.
bool parse_shape(const char* text, bench::SamplingShape& shape) {
  std::int32_t v[4] = {};
  const char* p = text;
  for (std::int32_t& x : v) {
    char* end = nullptr;
    x = static_cast<std::int32_t>(std::strtol(p, &end, 10));
    if (end == p || x < 1) return false;
    p = *end == ',' ? end + 1 : end;
  }
  if (*p != '\0') return false;
  shape = {v[0], v[1], v[2], v[3]};
  return true;
}

// The weights in bf16, the order of llama::Weights (embed; per layer attn_norm, wq, wk, wv, wo,
// ffn_norm, w1, w3, w2; final_norm; lm_head), each matrix row-major [in, out]; FILE.json the config.
bool write_weights(const std::string& path, const llama::Weights& w) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  std::vector<__nv_bfloat16> buf;
  bool ok = true;
  auto put = [&](const std::vector<float>& v) {
    buf.resize(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) buf[i] = __float2bfloat16(v[i]);
    ok = ok && std::fwrite(buf.data(), sizeof(__nv_bfloat16), buf.size(), f) == buf.size();
  };
  put(w.embed);
  for (const llama::LayerWeights& l : w.layers)
    for (const auto* m : {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w1, &l.w3, &l.w2}) put(*m);
  put(w.final_norm);
  put(w.lm_head);
  ok = std::fclose(f) == 0 && ok;
  std::FILE* j = std::fopen((path + ".json").c_str(), "w");
  if (j == nullptr) return false;
  const llama::Config& c = kConfig;
  std::fprintf(j,
               "{\"vocab\": %d, \"dim\": %d, \"layers\": %d, \"heads_q\": %d, \"heads_kv\": %d, \"head_dim\": %d, "
               "\"ffn\": %d, \"rope_theta\": %g, \"norm_eps\": %g, \"prompt\": %d, \"max_len\": %d, \"warmup\": %d, "
               "\"timed\": %d}\n",
               c.vocab, c.dim, c.layers, c.heads_q, c.heads_kv, c.head_dim, c.ffn, static_cast<double>(c.rope_theta),
               static_cast<double>(c.norm_eps), kPrompt, kMaxLen, kWarmup, kTimed);
  return std::fclose(j) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, parallel_sampling = false, window_storage = false;
  std::string kv = "bf16";
  bench::SamplingShape sampling_shape;
  std::FILE* out = stdout;
  std::string weights_out;
  std::vector<std::int32_t> counts = {1, 16, 64, 256};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) out = std::fopen(argv[++i], "w");
    if (std::strcmp(argv[i], "--weights-out") == 0 && i + 1 < argc) weights_out = argv[++i];
    if (std::strcmp(argv[i], "--parallel-sampling") == 0) parallel_sampling = true;
    if (std::strcmp(argv[i], "--window-storage") == 0) window_storage = true;
    if (std::strcmp(argv[i], "--kv") == 0 && i + 1 < argc) kv = argv[++i];
    if (std::strcmp(argv[i], "--max-gemv-width") == 0 && i + 1 < argc) g_max_gemv_width = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--sampling-shape") == 0 && i + 1 < argc && !parse_shape(argv[++i], sampling_shape)) {
      std::fprintf(stderr, "cellkv-bench-serve: --sampling-shape takes P,L,S,N (prompts, prompt tokens, samples, "
                           "new tokens)\n");
      return 1;
    }
    if (std::strcmp(argv[i], "--sessions") == 0 && i + 1 < argc) {
      counts.clear();
      for (const char* p = argv[++i]; *p != '\0';) {
        counts.push_back(static_cast<std::int32_t>(std::strtol(p, const_cast<char**>(&p), 10)));
        if (*p == ',') ++p;
      }
    }
  }
  if (kv != "bf16" && kv != "fp8") {
    std::fprintf(stderr, "cellkv-bench-serve: --kv takes bf16 or fp8, not %s\n", kv.c_str());
    return 1;
  }
  if (kv == "fp8" && (parallel_sampling || window_storage)) {
    std::fprintf(stderr, "cellkv-bench-serve: --kv fp8 runs the sessions mode only (not --parallel-sampling or "
                         "--window-storage)\n");
    return 1;
  }
  if (parallel_sampling && window_storage) {
    std::fprintf(stderr, "cellkv-bench-serve: --parallel-sampling and --window-storage are separate runs\n");
    return 1;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || out == nullptr) {
    std::fprintf(stderr, "cellkv-bench-serve: needs a CUDA device\n");
    return 1;
  }
  using Cells = cellkv::gpu::DeviceCache<cellkv::layout::cell, __nv_bfloat16, Model, cellkv::placement::clustered<64>>;
  using Slots = cellkv::gpu::DeviceCache<cellkv::layout::sequence, __nv_bfloat16, Model>;
  using CellsFp8 = cellkv::gpu::DeviceCache<cellkv::layout::cell, cellkv::gpu::Fp8<__nv_bfloat16>, Model,
                                            cellkv::placement::clustered<64>>;
  const llama::Weights weights = llama::generate(kConfig);
  if (!weights_out.empty() && !write_weights(weights_out, weights)) {
    std::fprintf(stderr, "cellkv-bench-serve: cannot write %s\n", weights_out.c_str());
    return 1;
  }
  std::fprintf(stderr,
               "cellkv serve benchmark: bf16 decoder, %d layers, dim %d, H_q %d, H_kv %d, D %d, ffn %d, vocab %d; "
               "K/V cache %s; ",
               kConfig.layers, kConfig.dim, kConfig.heads_q, kConfig.heads_kv, kConfig.head_dim, kConfig.ffn,
               kConfig.vocab, kv == "fp8" ? "fp8 e4m3 (fp32 scale per row-head), cell layout" : "bf16");
  if (parallel_sampling)
    std::fprintf(stderr,
                 "parallel sampling, %s; temperature 0.8, top-p 0.95 on the device; cell layout, clustered<64>; "
                 "steps overlapped; median of %d timed jobs\n",
                 sampling_shape.name().c_str(), quick ? 1 : 3);
  else
    std::fprintf(stderr,
                 "prompt %d, max_len %d; %d timed decode steps (all sessions generating), greedy on the device, steps "
                 "overlapped; breakdown per step from %d profiled steps (host ms from the timed pass)\n",
                 kPrompt, kMaxLen, kTimed, kProfiled);
  try {
    if (window_storage) {
      std::fprintf(stderr,
                   "window storage: the Gemma-style model (windows 1024 x 5, 0; dim %d, H_q %d, H_kv %d, D %d), "
                   "prompts of 4096 tokens, cell layout, clustered<64>\n",
                   bench::kGemmaConfig.dim, bench::kGemmaConfig.heads_q, bench::kGemmaConfig.heads_kv,
                   bench::kGemmaConfig.head_dim);
      const llama::Weights gemma = llama::generate(bench::kGemmaConfig);
      for (const std::int32_t n : counts) {
        if (quick && n > 16) break;
        run_window_storage(out, gemma, n);
      }
      return report_kv_memory(out) ? 0 : 1;
    }
    if (parallel_sampling) {
      const std::int32_t runs = quick ? 1 : 3;
      const SamplingRow shared = measure_sampling<Cells>(weights, sampling_shape, true, runs);
      report_sampling(out, sampling_shape, "cellkv_cell_clustered", true, shared, 1.0);
      const SamplingRow unshared = measure_sampling<Cells>(weights, sampling_shape, false, runs);
      report_sampling(out, sampling_shape, "cellkv_cell_clustered_no_sharing", false, unshared,
                      bench::same_outputs(shared.job, unshared.job));
      return 0;
    }
    for (const std::int32_t n : counts) {
      if (quick && n > 16) break;
      if (kv == "fp8") {
        report(out, n, "cellkv_cell_fp8", measure<CellsFp8>(weights, n));
        continue;
      }
      report(out, n, "cellkv_cell_clustered", measure<Cells>(weights, n));
      report(out, n, "cellkv_sequence", measure<Slots>(weights, n));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv-bench-serve: %s\n", e.what());
    return 1;
  }
  return 0;
}
