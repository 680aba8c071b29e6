// benchmarks/parallel_sampling.hpp - the parallel-sampling job the serving benchmark times: P
// prompts of L tokens, S samples of each (SessionTable::add_samples: a prompt's samples share its
// cells), N new tokens per sample, run by an executor from the first add until every token is back.
// Reported: the whole job (generated tokens / wall time, prompts fed on the way) and its decode
// phase (the steps in which every sample generates one token). Sampling: temperature 0.8, top-p
// 0.95, prompt p's samples drawing with seeds 1000 + p S + i; no stop tokens, so every sample
// generates exactly N tokens.
#pragma once

#include <cellkv/batching/executor.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_timing.hpp"

namespace bench {

struct SamplingShape {
  std::int32_t prompts = 16;
  std::int32_t prompt_len = 2048;
  std::int32_t samples = 8;      // per prompt
  std::int32_t new_tokens = 256;  // per sample
  [[nodiscard]] std::int32_t sessions() const { return prompts * samples; }
  [[nodiscard]] std::string name() const {
    return std::to_string(prompts) + " prompts x " + std::to_string(prompt_len) + " tokens x " +
           std::to_string(samples) + " samples, " + std::to_string(new_tokens) + " new";
  }
};

struct SamplingJob {
  double seconds = 0;             // first add to the last token back
  std::int64_t generated = 0;     // tokens sampled and brought back
  std::int32_t steps = 0;         // executor steps that ran a forward
  double decode_seconds = 0;      // the steps in which every sample generated one token
  std::int64_t decode_tokens = 0;
  std::int32_t decode_steps = 0;
  std::vector<std::vector<std::int32_t>> outputs;  // per sample, prompt by prompt, sample by sample
  // 0 when nothing was timed (a shape without such steps).
  [[nodiscard]] double tokens_per_second() const { return seconds > 0 ? static_cast<double>(generated) / seconds : 0; }
  [[nodiscard]] double decode_tokens_per_second() const {
    return decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds : 0;
  }
  [[nodiscard]] double decode_ms_per_step() const { return decode_steps > 0 ? 1e3 * decode_seconds / decode_steps : 0; }
};

// Runs the job on an idle executor and reaps its sessions. Throws std::runtime_error on any
// refusal, or when a sample does not generate exactly shape.new_tokens tokens.
template <class Exec>
SamplingJob run_sampling_job(Exec& exec, const SamplingShape& shape, std::int32_t vocab) {
  using Clock = std::chrono::steady_clock;
  using cellkv::batching::SessionId;
  SamplingJob job;
  std::vector<SessionId> ids;
  const std::int64_t generated_before = exec.stats().tokens_generated;
  const auto t0 = Clock::now();
  for (std::int32_t p = 0; p < shape.prompts; ++p) {
    const cellkv::batching::SamplingParams sampling{
        .temperature = 0.8f, .top_p = 0.95f, .seed = 1000 + static_cast<std::uint64_t>(p) * shape.samples};
    const auto got = exec.sessions().add_samples(prompt_of(p, shape.prompt_len, vocab), shape.new_tokens, sampling,
                                                 shape.samples);
    if (!got.ok()) throw std::runtime_error("add_samples refused: " + got.status().message());
    ids.insert(ids.end(), got.value().begin(), got.value().end());
  }
  const auto sessions = static_cast<std::int32_t>(ids.size());
  for (;;) {
    const bool all_generate = exec.sessions().generating_count() == sessions;
    const auto s0 = Clock::now();
    const auto r = exec.step();
    if (!r.ok()) {
      if (r.status() == cellkv::Errc::empty_step) break;
      throw std::runtime_error("step refused: " + r.status().message());
    }
    if (r.value() == 0) continue;  // only brought the last step's tokens back
    ++job.steps;
    if (all_generate && r.value() == sessions) {
      job.decode_seconds += std::chrono::duration<double>(Clock::now() - s0).count();
      job.decode_tokens += r.value();
      ++job.decode_steps;
    }
  }
  job.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  job.generated = exec.stats().tokens_generated - generated_before;
  for (const SessionId id : ids) {
    const auto out = exec.sessions().output(id).value();
    if (static_cast<std::int32_t>(out.size()) != shape.new_tokens)
      throw std::runtime_error("a sample generated " + std::to_string(out.size()) + " tokens, not " +
                               std::to_string(shape.new_tokens));
    job.outputs.emplace_back(out.begin(), out.end());
  }
  if (exec.sessions().reap().size() != ids.size()) throw std::runtime_error("the job's sessions did not all end");
  return job;
}

// The fraction of samples whose tokens are the same in both jobs.
inline double same_outputs(const SamplingJob& a, const SamplingJob& b) {
  if (a.outputs.empty() || a.outputs.size() != b.outputs.size()) return 0;
  std::size_t same = 0;
  for (std::size_t i = 0; i < a.outputs.size(); ++i) same += a.outputs[i] == b.outputs[i] ? 1 : 0;
  return static_cast<double>(same) / static_cast<double>(a.outputs.size());
}

}  // namespace bench
