// Executor test material shared by the host and GPU suites: the sampling parameters of the seeded
// sessions, and the tokens sessions generated.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/batching/executor.hpp"

namespace cellkv::test {

// Sessions with different sampling parameters (greedy among them); the same list batched or solo.
inline const batching::SamplingParams kSessionSampling[] = {
    {.temperature = 0.8f, .top_k = 20, .top_p = 0.9f, .seed = 1},
    {.temperature = 1.2f, .seed = 2},
    {.temperature = 0.f},
    {.temperature = 1.f, .top_p = 0.7f, .min_p = 0.05f, .seed = 3, .logprobs = true},
    {.temperature = 0.6f, .top_k = 5, .seed = 4},
};

// A deterministic prompt of `len` tokens: token t is (t * step + salt * salt_step + offset) % vocab.
struct PromptRule {
  std::int32_t step, salt_step, offset;
};
inline std::vector<std::int32_t> make_prompt(std::int32_t len, std::int32_t salt, std::int32_t vocab, PromptRule r) {
  std::vector<std::int32_t> p;
  for (std::int32_t t = 0; t < len; ++t) p.push_back((t * r.step + salt * r.salt_step + r.offset) % vocab);
  return p;
}

// The tokens each session generated, in the order of `ids`.
template <class Exec>
std::vector<std::vector<std::int32_t>> outputs_of(const Exec& exec, std::span<const batching::SessionId> ids) {
  std::vector<std::vector<std::int32_t>> out;
  for (const batching::SessionId id : ids) {
    const auto o = exec.sessions().output(id).value();
    out.emplace_back(o.begin(), o.end());
  }
  return out;
}

}  // namespace cellkv::test
