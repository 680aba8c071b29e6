// benchmarks/decode_timing.hpp - the decode measurement the serving benchmarks share: add the
// sessions, feed every prompt (untimed; each session's budget covers the tokens it generates while
// later prompts are fed), run warm-up steps (each decode width's graph captured), then time decode
// steps in which every session generates: one token per session per step, steps overlapped as the
// executor runs them. Returns tokens/s, the mean tokens per timed step (the session count, checked)
// and the host time per step of each part of Executor::step.
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

struct DecodeRun {
  double tokens_per_second = 0;
  double tokens_per_step = 0;    // mean over the timed steps
  double ms_per_step = 0;        // wall time
  double mean_context = 0;       // tokens each session's sequence holds, mean over sessions, mid-run
  std::int32_t steps = 0;
  // Host milliseconds per timed step (ExecutorStats): packing and placement, enqueue, waiting for
  // the step before, resolving its tokens.
  double plan_ms = 0, enqueue_ms = 0, wait_ms = 0, resolve_ms = 0;
};

// Adds `sessions` sessions (prompt `prompt_len`, as many new tokens as max_tokens_per_session
// allows) and feeds them. Throws std::runtime_error on any refusal.
template <class Exec>
void start_sessions(Exec& exec, std::int32_t sessions, std::int32_t prompt_len, std::int32_t vocab) {
  const std::int32_t max_new = exec.sessions().limits().max_tokens_per_session - prompt_len;
  for (std::int32_t s = 0; s < sessions; ++s) {
    const auto id = exec.sessions().add(prompt_of(s, prompt_len, vocab), max_new);
    if (!id.ok()) throw std::runtime_error("add refused: " + id.status().message());
  }
  while (exec.sessions().feeding_count() > 0) {
    const auto r = exec.step();
    if (!r.ok()) throw std::runtime_error("prefill step refused: " + r.status().message());
  }
}

// `warmup` then `steps` decode steps of the sessions started by start_sessions; throws when a
// step is refused or when a timed step does not carry one token of every session.
template <class Exec>
DecodeRun time_decode(Exec& exec, std::int32_t warmup, std::int32_t steps) {
  const std::int32_t sessions = exec.sessions().live_count();
  for (std::int32_t i = 0; i < warmup; ++i) {
    const auto r = exec.step();
    if (!r.ok()) throw std::runtime_error("warm-up step refused: " + r.status().message());
  }
  auto mean_context = [&] {
    double sum = 0;
    for (const auto id : exec.sessions().sessions()) sum += exec.sessions().cached_tokens(id).value();
    return sum / sessions;
  };
  const double context_before = mean_context();
  const cellkv::batching::ExecutorStats before = exec.stats();
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t tokens = 0;
  for (std::int32_t i = 0; i < steps; ++i) {
    const auto r = exec.step();
    if (!r.ok()) throw std::runtime_error("decode step refused: " + r.status().message());
    tokens += r.value();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const cellkv::batching::ExecutorStats& after = exec.stats();
  DecodeRun run;
  run.steps = steps;
  run.tokens_per_second = static_cast<double>(tokens) / secs;
  run.tokens_per_step = static_cast<double>(tokens) / steps;
  run.ms_per_step = 1e3 * secs / steps;
  run.mean_context = 0.5 * (context_before + mean_context());
  run.plan_ms = 1e3 * (after.plan_seconds - before.plan_seconds) / steps;
  run.enqueue_ms = 1e3 * (after.enqueue_seconds - before.enqueue_seconds) / steps;
  run.wait_ms = 1e3 * (after.wait_seconds - before.wait_seconds) / steps;
  run.resolve_ms = 1e3 * (after.resolve_seconds - before.resolve_seconds) / steps;
  if (tokens != static_cast<std::int64_t>(sessions) * steps)
    throw std::runtime_error("a timed step did not carry one token of each of the " + std::to_string(sessions) +
                             " sessions (" + std::to_string(run.tokens_per_step) + " per step): budgets too small");
  return run;
}

// start_sessions, 3 warm-up steps, `steps` timed decode steps: tokens/s.
template <class Exec>
double decode_tokens_per_second(Exec& exec, std::int32_t sessions, std::int32_t prompt_len, std::int32_t steps,
                                std::int32_t vocab) {
  start_sessions(exec, sessions, prompt_len, vocab);
  return time_decode(exec, 3, steps).tokens_per_second;
}

}  // namespace bench
