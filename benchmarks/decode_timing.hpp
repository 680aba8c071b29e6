// benchmarks/decode_timing.hpp - the decode measurement the serving benchmarks share: feed every
// session a prompt (untimed), run a few warm-up steps (each decode width's graph captured), then
// time `steps` decode steps. Returns tokens/s.
#pragma once

#include <cellkv/batching/executor.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

// Prompt of session s: `len` deterministic token ids below `vocab`.
inline std::vector<std::int32_t> prompt_of(std::int32_t s, std::int32_t len, std::int32_t vocab) {
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(len));
  for (std::int32_t t = 0; t < len; ++t) prompt[static_cast<std::size_t>(t)] = (s * 131 + t * 7) % vocab;
  return prompt;
}

// Adds `sessions` sessions (prompt `prompt_len`, up to `steps + 16` new tokens), feeds them, warms
// up 3 steps and times `steps` decode steps. Throws std::runtime_error on any refusal.
template <class Exec>
double decode_tokens_per_second(Exec& exec, std::int32_t sessions, std::int32_t prompt_len, std::int32_t steps,
                                std::int32_t vocab) {
  for (std::int32_t s = 0; s < sessions; ++s)
    if (!exec.sessions().add(prompt_of(s, prompt_len, vocab), steps + 16).ok()) throw std::runtime_error("add refused");
  while (exec.sessions().feeding_count() > 0)
    if (!exec.step().ok()) throw std::runtime_error("prefill step refused");
  for (int i = 0; i < 3; ++i)
    if (!exec.step().ok()) throw std::runtime_error("warm-up step refused");
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t tokens = 0;
  for (std::int32_t i = 0; i < steps; ++i) {
    const auto r = exec.step();
    if (!r.ok()) throw std::runtime_error("decode step refused: " + std::string(r.status().message()));
    tokens += r.value();
  }
  return static_cast<double>(tokens) / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace bench
