// fp8_model_accuracy: what an fp8 (E4M3) KV cache does to the example model's next-token
// distributions, against a bf16 cache. Not a test and not a timing: it prints a table (stderr) and
// JSON lines (stdout or --out FILE) for benchmarks/RESULTS.md.
//
// The model: the serving benchmark's decoder (serve_model.hpp; bf16 arithmetic in both runs, so
// the only difference is the cache's K/V storage), on one cell-layout cache of each kind:
// DeviceCache<cell, __nv_bfloat16, ...> and DeviceCache<cell, gpu::Fp8<__nv_bfloat16>, ...> (an
// fp32 scale per row-head, written from the row's amax). 16 deterministic prompts of 64 to 512
// tokens (prompt i: 64 + 448 i / 15 tokens). Per prompt, the bf16 run feeds the prompt in one
// prefill step, then decodes 64 tokens greedily (the argmax of its own logits, lowest id on a
// tie); the fp8 run is teacher-forced with the SAME tokens in the SAME steps (one prefill step,
// then 64 decode steps of one token), so both runs see identical inputs at every position. At
// every position (each prompt row and each decode step) the next-token distributions are
// p = softmax(bf16 logits), q = softmax(fp8 logits), in float64, and the position gives
// KL(p || q) = sum p (log p - log q) in nats, and whether argmax p == argmax q. Each cache runs
// the kernels it would pick (KernelChoice::automatic), so the numbers hold what a caller gets;
// --kernels reference runs both on the reference kernel, so that they hold the storage alone.
//
// Output: per prompt a table line; JSON lines {"work": "fp8_model_accuracy", "shape": "all positions"
// | "prompt positions" | "generated positions", "impl": "cellkv_cell_fp8" (with --kernels reference:
// "cellkv_cell_fp8_reference_kernel"), "metric": mean KL, "unit": "nats", "max_kl",
// "greedy_agreement" (share of positions whose argmax agrees), "positions", "prompts",
// "prompt_tokens", "new_tokens", "kv_bytes_per_cell_bf16", "kv_bytes_per_cell_fp8", "kernels"}.
// Exits 0 with a message when there is no CUDA device.
//
//   build/benchmarks/cellkv-bench-fp8-model [--out FILE] [--prompts N] [--new-tokens N] [--kernels reference]
#include <cellkv/batching/sampling.hpp>
#include <cellkv/batching/session_table.hpp>
#include <cellkv/footprint.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "llama/gpu_llama.cuh"
#include "serve_model.hpp"

namespace {

using Bf16 = __nv_bfloat16;
using Fp8 = cellkv::gpu::Fp8<Bf16>;
template <class S>
using Cache = cellkv::gpu::DeviceCache<cellkv::layout::cell, S, bench::ServeWindows, cellkv::placement::clustered<64>>;

constexpr std::int32_t kMinPrompt = 64, kMaxPrompt = 512;
const llama::Config& kConfig = bench::kServeConfig;
const cellkv::gpu::PoolShape kShape{.layers = kConfig.layers, .heads_kv = kConfig.heads_kv,
                                    .head_dim = kConfig.head_dim, .heads_q = kConfig.heads_q};

// Prompt i of n: 64 + 448 i / (n - 1) deterministic token ids below the vocabulary.
std::vector<std::int32_t> prompt_of(std::int32_t i, std::int32_t n) {
  const std::int32_t len = kMinPrompt + (n > 1 ? (kMaxPrompt - kMinPrompt) * i / (n - 1) : 0);
  std::vector<std::int32_t> p(static_cast<std::size_t>(len));
  std::uint64_t x = 0x5eedULL + static_cast<std::uint64_t>(i);
  for (std::int32_t& t : p) t = static_cast<std::int32_t>((x = llama::detail::splitmix64(x)) >> 33) % kConfig.vocab;
  return p;
}

[[noreturn]] void refused(const char* verb, const cellkv::Status& s) {
  throw std::runtime_error(std::string(verb) + " refused: " + std::string(s.message()));
}

// A cache of element parameter S and the model on it; runs one sequence at a time.
template <class S>
class Runner {
 public:
  Runner(const llama::Weights& weights, std::int32_t max_len, cellkv::gpu::KernelChoice kernels)
      : cache_({.max_write = kMaxPrompt, .max_cells = (max_len + 2 * kMaxPrompt + 63) / 64 * 64, .max_seqs = 4,
                .max_len = max_len},
               kShape),
        model_(kConfig, weights, cache_, stream_.get()) {
    cache_.use_kernels(kernels);
  }

  void begin() {
    const auto id = cache_.seq_new();
    if (!id.ok()) refused("seq_new", id.status());
    seq_ = id.value();
  }
  void end() {
    if (const cellkv::Status s = cache_.seq_rm(seq_); !s.ok()) refused("seq_rm", s);
  }

  // One step of `tokens` (all of the sequence); logits [tokens.size(), vocab] of every row.
  std::vector<float> step(std::span<const std::int32_t> tokens) {
    const std::vector<std::int32_t> seqs(tokens.size(), seq_);
    const auto plan = cache_.declare_step(seqs);
    if (!plan.ok()) refused("declare_step", plan.status());
    const auto t = static_cast<std::int32_t>(tokens.size());
    const std::int32_t rows[1] = {t - 1};
    const cellkv::batching::SampleRow sampling[1] = {cellkv::batching::make_sample_row({}, 0)};
    const auto method = t == 1 ? cellkv::batching::Method::decode : cellkv::batching::Method::prefill;
    if (const cellkv::Status s = model_.forward({tokens, plan.value().positions, rows, sampling, {}, method}); !s.ok())
      refused("forward", s);
    std::int32_t sampled[1] = {};
    float logprob[1] = {};
    if (const cellkv::Status s = model_.retire(sampled, logprob); !s.ok()) refused("retire", s);
    const auto vocab = static_cast<std::size_t>(kConfig.vocab);
    std::vector<float> logits(tokens.size() * vocab);
    for (std::int32_t r = 0; r < t; ++r) {
      const std::span<float> row = std::span(logits).subspan(static_cast<std::size_t>(r) * vocab, vocab);
      if (const cellkv::Status s = model_.copy_logits(r, row); !s.ok()) refused("copy_logits", s);
    }
    return logits;
  }

 private:
  cellkv::gpu::Stream stream_;
  Cache<S> cache_;
  llama::GpuLlama<Cache<S>> model_;
  std::int32_t seq_ = -1;
};

// log softmax of one row, in float64.
std::vector<double> log_softmax(std::span<const float> logits) {
  double top = -INFINITY;
  for (const float l : logits) top = std::max(top, static_cast<double>(l));
  double sum = 0;
  for (const float l : logits) sum += std::exp(static_cast<double>(l) - top);
  const double lse = top + std::log(sum);
  std::vector<double> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
  return out;
}

// The first index of the largest value.
std::int32_t argmax(std::span<const float> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

struct Stats {
  double kl_sum = 0, kl_max = 0;
  std::int64_t positions = 0, agree = 0;
  void add(double kl, bool same) {
    kl_sum += kl;
    kl_max = std::max(kl_max, kl);
    ++positions;
    agree += same ? 1 : 0;
  }
  void add(const Stats& o) {
    kl_sum += o.kl_sum;
    kl_max = std::max(kl_max, o.kl_max);
    positions += o.positions;
    agree += o.agree;
  }
  [[nodiscard]] double mean() const { return positions > 0 ? kl_sum / static_cast<double>(positions) : 0.0; }
  [[nodiscard]] double agreement() const {
    return positions > 0 ? static_cast<double>(agree) / static_cast<double>(positions) : 0.0;
  }
};

// Compares the rows of two logit blocks [rows, vocab]: KL(p_bf16 || p_fp8) and argmax agreement.
void compare(const std::vector<float>& bf16, const std::vector<float>& fp8, Stats& stats) {
  const auto vocab = static_cast<std::size_t>(kConfig.vocab);
  for (std::size_t r = 0; r < bf16.size() / vocab; ++r) {
    const std::span<const float> a(bf16.data() + r * vocab, vocab), b(fp8.data() + r * vocab, vocab);
    const std::vector<double> lp = log_softmax(a), lq = log_softmax(b);
    double kl = 0;
    for (std::size_t i = 0; i < vocab; ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
    if (!std::isfinite(kl)) throw std::runtime_error("non-finite logits (KL " + std::to_string(kl) + ")");
    stats.add(std::max(kl, 0.0), argmax(a) == argmax(b));
  }
}

void emit(std::FILE* out, const char* shape, const Stats& s, std::int32_t prompts, std::int32_t new_tokens,
          bool reference) {
  const std::size_t bf16_cell = cellkv::pool_bytes_per_cell(kShape, cellkv::KvStorage::bf16).value_or(0);
  const std::size_t fp8_cell = cellkv::pool_bytes_per_cell(kShape, cellkv::KvStorage::fp8_e4m3).value_or(0);
  std::fprintf(out,
               "{\"work\": \"fp8_model_accuracy\", \"shape\": \"%s\", \"impl\": \"%s\", \"metric\": %.6g, "
               "\"unit\": \"nats\", \"max_kl\": %.6g, \"greedy_agreement\": %.6f, \"positions\": %lld, \"prompts\": %d, "
               "\"prompt_tokens\": \"%d-%d\", \"new_tokens\": %d, \"kv_bytes_per_cell_bf16\": %zu, "
               "\"kv_bytes_per_cell_fp8\": %zu, \"kernels\": \"%s\"}\n",
               shape, reference ? "cellkv_cell_fp8_reference_kernel" : "cellkv_cell_fp8", s.mean(), s.kl_max, s.agreement(), static_cast<long long>(s.positions), prompts, kMinPrompt,
               kMaxPrompt, new_tokens, bf16_cell, fp8_cell, reference ? "reference" : "automatic");
  std::fflush(out);
}

bool parse_count(const char* text, std::int32_t& value) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 1 || v > 1024) return false;
  value = static_cast<std::int32_t>(v);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::FILE* out = stdout;
  std::int32_t prompts = 16, new_tokens = 64;
  bool reference = false;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (std::strcmp(argv[i], "--out") == 0 && has_value) {
      out = std::fopen(argv[++i], "w");
      if (out == nullptr) {
        std::fprintf(stderr, "cellkv-bench-fp8-model: cannot write %s\n", argv[i]);
        return 1;
      }
    } else if (std::strcmp(argv[i], "--prompts") == 0 && has_value && parse_count(argv[i + 1], prompts)) {
      ++i;
    } else if (std::strcmp(argv[i], "--new-tokens") == 0 && has_value && parse_count(argv[i + 1], new_tokens)) {
      ++i;
    } else if (std::strcmp(argv[i], "--kernels") == 0 && has_value && std::strcmp(argv[i + 1], "reference") == 0) {
      reference = true;
      ++i;
    } else {
      std::fprintf(stderr, "usage: cellkv-bench-fp8-model [--out FILE] [--prompts 1..1024] [--new-tokens 1..1024] "
                           "[--kernels reference]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cellkv-bench-fp8-model: no CUDA device here; nothing measured (it runs the model on a GPU)\n");
    return 0;
  }
  std::fprintf(stderr,
               "fp8 KV cache accuracy on the example model (bf16 decoder, %d layers, dim %d, H_q %d, H_kv %d, D %d, "
               "vocab %d): %d prompts of %d-%d tokens + %d greedy tokens of the bf16-cache run, teacher-forced into "
               "the fp8-cache run; KL(p_bf16 || p_fp8) in nats, float64 softmax; %s kernels\n",
               kConfig.layers, kConfig.dim, kConfig.heads_q, kConfig.heads_kv, kConfig.head_dim, kConfig.vocab, prompts,
               kMinPrompt, kMaxPrompt, new_tokens, reference ? "reference" : "each cache's own");
  try {
    const llama::Weights weights = llama::generate(kConfig);
    const std::int32_t max_len = kMaxPrompt + new_tokens + 1;
    const auto kernels = reference ? cellkv::gpu::KernelChoice::reference : cellkv::gpu::KernelChoice::automatic;
    Runner<Bf16> bf16(weights, max_len, kernels);
    Runner<Fp8> fp8(weights, max_len, kernels);
    Stats all, prompt_part, generated_part;
    std::fprintf(stderr, "  %6s %7s %12s %12s %10s\n", "prompt", "tokens", "mean KL", "max KL", "argmax =");
    for (std::int32_t p = 0; p < prompts; ++p) {
      const std::vector<std::int32_t> prompt = prompt_of(p, prompts);
      Stats one;
      bf16.begin();
      fp8.begin();
      std::vector<float> a = bf16.step(prompt), b = fp8.step(prompt);
      Stats part;
      compare(a, b, part);
      prompt_part.add(part);
      one.add(part);
      const auto vocab = static_cast<std::size_t>(kConfig.vocab);
      std::int32_t next = argmax(std::span<const float>(a).last(vocab));
      for (std::int32_t g = 0; g < new_tokens; ++g) {
        const std::int32_t token[1] = {next};
        a = bf16.step(token);
        b = fp8.step(token);
        Stats step;
        compare(a, b, step);
        generated_part.add(step);
        one.add(step);
        next = argmax(a);
      }
      bf16.end();
      fp8.end();
      all.add(one);
      std::fprintf(stderr, "  %6d %7zu %12.4g %12.4g %9.1f%%\n", p, prompt.size(), one.mean(), one.kl_max,
                   100.0 * one.agreement());
    }
    std::fprintf(stderr, "  %-14s %12.4g %12.4g %9.1f%%  (%lld positions)\n", "all", all.mean(), all.kl_max,
                 100.0 * all.agreement(), static_cast<long long>(all.positions));
    std::fprintf(stderr, "  %-14s %12.4g %12.4g %9.1f%%  (%lld positions)\n", "prompt", prompt_part.mean(),
                 prompt_part.kl_max, 100.0 * prompt_part.agreement(), static_cast<long long>(prompt_part.positions));
    std::fprintf(stderr, "  %-14s %12.4g %12.4g %9.1f%%  (%lld positions)\n", "generated", generated_part.mean(),
                 generated_part.kl_max, 100.0 * generated_part.agreement(),
                 static_cast<long long>(generated_part.positions));
    emit(out, "all positions", all, prompts, new_tokens, reference);
    emit(out, "prompt positions", prompt_part, prompts, new_tokens, reference);
    emit(out, "generated positions", generated_part, prompts, new_tokens, reference);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv-bench-fp8-model: %s\n", e.what());
    return 1;
  }
  return 0;
}
