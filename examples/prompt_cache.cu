// prompt_cache: prompt caching with saved sequence state (gpu/sequence_state.cuh). The example
// decoder (examples/llama, bf16 on the GPU) prefills a shared system prompt once and saves that
// sequence's state to a file; a fresh cache and model then restore the file for each of several
// sessions, append the session's own prompt and greedy-decode a few tokens. A third cache and model
// compute every session from scratch (the system prompt, then the session's prompt, then the same
// decode steps: the same step shapes, so the two paths run the same arithmetic), and the tokens
// must be equal. Prints OK, or FAILED and exits 1; without a CUDA device says so and exits 0.
//
//   build/examples/cellkv-prompt-cache [state file]     (default: cellkv_prompt_cache.state)
//
// The model is driven step by step without the executor: declare_step places the tokens, then
// forward / retire (cellkv::batching::Model) run the step and return the sampled ids.
#include <cellkv/batching/model.hpp>
#include <cellkv/batching/sampling.hpp>
#include <cellkv/cellkv.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/sequence_state.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "llama/gpu_llama.cuh"

namespace {

using Model = cellkv::Windows<0, 0, 0, 0>;
using Cache = cellkv::gpu::DeviceCache<cellkv::layout::cell, __nv_bfloat16, Model, cellkv::placement::clustered<16>, 16>;
using Llama = llama::GpuLlama<Cache>;
const llama::Config kConfig{.vocab = 512, .dim = 256, .layers = Model::kLayers, .heads_q = 8, .heads_kv = 2,
                            .head_dim = 128, .ffn = 512, .seed = 3};
const cellkv::CacheConfig kCacheConfig{.max_write = 64, .max_cells = 1024, .max_seqs = 8};
const cellkv::gpu::PoolShape kShape{.layers = Model::kLayers, .heads_kv = kConfig.heads_kv, .head_dim = kConfig.head_dim,
                                    .heads_q = kConfig.heads_q};
constexpr std::int32_t kSystemTokens = 48, kSessions = 3, kNewTokens = 6;

// A cache and the model attending through it, on one stream.
struct Engine {
  cellkv::gpu::Stream stream;
  Cache cache{kCacheConfig, kShape};
  Llama model;
  explicit Engine(const llama::Weights& w) : model(kConfig, w, cache, stream.get()) {}

  // One step of `tokens` for sequence id; returns the greedy token after the last one (-1 on a refusal).
  std::int32_t step(std::int32_t id, const std::vector<std::int32_t>& tokens) {
    const std::vector<std::int32_t> seqs(tokens.size(), id);
    const auto plan = cache.declare_step(seqs);
    if (!plan.ok()) return -1;
    const std::vector<std::int32_t> rows{static_cast<std::int32_t>(tokens.size()) - 1};
    const std::vector<cellkv::batching::SampleRow> sampling{cellkv::batching::make_sample_row({}, 0)};  // greedy
    const auto method = tokens.size() == 1 ? cellkv::batching::Method::decode : cellkv::batching::Method::prefill;
    if (!model.forward({tokens, plan.value().positions, rows, sampling, {}, method}).ok()) return -1;
    std::vector<std::int32_t> out(1);
    std::vector<float> logprob(1);
    if (!model.retire(out, logprob).ok()) return -1;
    return out[0];
  }

  // The session's prompt after what sequence id holds, then kNewTokens greedy tokens.
  std::vector<std::int32_t> continue_session(std::int32_t id, const std::vector<std::int32_t>& prompt) {
    std::vector<std::int32_t> generated{step(id, prompt)};
    while (static_cast<std::int32_t>(generated.size()) < kNewTokens && generated.back() >= 0)
      generated.push_back(step(id, {generated.back()}));
    return generated;
  }
};

std::vector<std::int32_t> tokens(std::int32_t n, std::int32_t salt) {
  std::vector<std::int32_t> out;
  for (std::int32_t i = 0; i < n; ++i) out.push_back((i * 131 + salt * 71 + 7) % kConfig.vocab);
  return out;
}

void print(const char* what, const std::vector<std::int32_t>& ids) {
  std::printf("  %s:", what);
  for (const std::int32_t t : ids) std::printf(" %d", t);
  std::printf("\n");
}

int run(const std::string& path) {
  const llama::Weights weights = llama::generate(kConfig);
  const std::vector<std::int32_t> system = tokens(kSystemTokens, 0);
  std::vector<std::vector<std::int32_t>> prompts;
  for (std::int32_t s = 0; s < kSessions; ++s) prompts.push_back(tokens(5 + 3 * s, s + 1));

  {  // Prefill the system prompt once and save it.
    Engine first(weights);
    const std::int32_t id = first.cache.seq_new().value();
    if (first.step(id, system) < 0) return std::printf("FAILED: the system prompt's prefill was refused\n"), 1;
    const auto state = cellkv::gpu::save_sequence(first.cache, id, first.stream);
    if (!state.ok()) return std::printf("FAILED: save_sequence: %s\n", std::string(state.status().message()).c_str()), 1;
    if (!cellkv::write_state_file(path, state.value()).ok()) return std::printf("FAILED: cannot write %s\n", path.c_str()), 1;
    std::printf("saved the %d-token system prompt's state: %zu bytes in %s\n", kSystemTokens, state.value().size(),
                path.c_str());
  }

  // A fresh cache and model: every session starts from the saved state.
  std::vector<std::vector<std::int32_t>> restored;
  {
    Engine engine(weights);
    const auto bytes = cellkv::read_state_file(path, std::uint64_t{1} << 30);
    if (!bytes.ok()) return std::printf("FAILED: cannot read %s\n", path.c_str()), 1;
    for (std::int32_t s = 0; s < kSessions; ++s) {
      const auto id = cellkv::gpu::restore_sequence(engine.cache, bytes.value(), engine.stream);
      if (!id.ok()) return std::printf("FAILED: restore_sequence: %s\n", std::string(id.status().message()).c_str()), 1;
      restored.push_back(engine.continue_session(id.value(), prompts[static_cast<std::size_t>(s)]));
    }
  }
  std::remove(path.c_str());

  // From scratch, for the comparison.
  int mismatches = 0;
  Engine scratch(weights);
  for (std::int32_t s = 0; s < kSessions; ++s) {
    const std::int32_t id = scratch.cache.seq_new().value();
    const bool ok = scratch.step(id, system) >= 0;
    const std::vector<std::int32_t> want =
        ok ? scratch.continue_session(id, prompts[static_cast<std::size_t>(s)]) : std::vector<std::int32_t>{};
    std::printf("session %d (%zu-token prompt):\n", s, prompts[static_cast<std::size_t>(s)].size());
    print("restored    ", restored[static_cast<std::size_t>(s)]);
    print("from scratch", want);
    if (want != restored[static_cast<std::size_t>(s)] || want.empty() || want.back() < 0) ++mismatches;
  }
  std::printf("%s\n", mismatches == 0 ? "OK: every restored session generated what the full computation does"
                                      : "FAILED: restored sessions differ from the full computation");
  return mismatches == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cellkv-prompt-cache: no CUDA device; nothing to run\n");
    return 0;
  }
  try {
    return run(argc > 1 ? argv[1] : "cellkv_prompt_cache.state");
  } catch (const std::exception& e) {
    std::printf("cellkv-prompt-cache: %s\n", e.what());
    return 1;
  }
}
