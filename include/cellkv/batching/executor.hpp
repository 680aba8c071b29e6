// cellkv/batching/executor.hpp - batched generation: the session table packs each step, the cache
// places it, the model runs it, greedy sampling picks each session's next token.
//
//   Executor exec(model, cache, {.max_write = 64, .min_prefill_tokens = model.min_prefill_tokens(),
//                                .max_tokens_per_session = 512});
//   auto id = exec.sessions().add(prompt, 32).value();
//   while (exec.step().ok()) {}                   // continuous batching: add sessions between steps
//   auto tokens = exec.sessions().output(id).value();
//
// Sessions join and finish between steps; a finished session's sequence is freed by reap() or
// finish(), and its cells are reused by later sessions. The executor is the same on the host
// reference path and on the GPU: the model decides how a forward runs (and, on the GPU, whether it
// replays a captured graph).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/batching/model.hpp"
#include "cellkv/batching/session_table.hpp"
#include "cellkv/status.hpp"

namespace cellkv::batching {

struct ExecutorStats {
  std::int64_t steps = 0;
  std::int64_t decode_steps = 0;   // one-token steps
  std::int64_t prefill_steps = 0;  // wider steps
  std::int64_t tokens_fed = 0;     // tokens through the model (prompt and generated)
  std::int64_t tokens_generated = 0;
};

// The greedy choice: the index of the largest logit, the lowest index on a tie.
inline std::int32_t argmax(std::span<const float> logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

template <Model M, class Cache>
class Executor {
 public:
  // Throws std::invalid_argument when the session limits are invalid for the cache.
  Executor(M& model, Cache& cache, const SessionLimits& limits) : model_(model), cache_(cache), table_(cache, limits) {}

  [[nodiscard]] SessionTable<Cache>& sessions() noexcept { return table_; }
  [[nodiscard]] const SessionTable<Cache>& sessions() const noexcept { return table_; }
  [[nodiscard]] const ExecutorStats& stats() const noexcept { return stats_; }
  [[nodiscard]] M& model() noexcept { return model_; }

  // One step of at most max_tokens tokens (0: the limits' max_write). Returns the step's width.
  // Refuses with empty_step when no session has work, and with the cache's or the model's refusal
  // when placement or the forward fails; the step is then abandoned (rolled back) and nothing
  // changes in the sessions.
  Result<std::int32_t> step(std::int32_t max_tokens = 0) {
    auto batch = table_.next_step(max_tokens);
    if (!batch.ok()) return batch.status().code();
    const StepBatch& b = batch.value();
    const auto plan = cache_.declare_step(b.seqs);
    if (!plan.ok()) return abandon(plan.status());
    rows_.clear();
    for (const LogitRow& r : b.logit_rows)
      if (r.samples) rows_.push_back(r.row);
    logits_.resize(rows_.size() * static_cast<std::size_t>(model_.vocab()));
    const ForwardStep step{b.tokens, plan.value().positions, rows_, b.size() == 1 ? Method::decode : Method::prefill};
    if (const Status s = model_.forward(step, logits_); !s.ok()) return abandon(s);
    sampled_.clear();
    for (std::size_t i = 0; i < rows_.size(); ++i)
      sampled_.push_back(argmax(std::span<const float>(logits_).subspan(i * static_cast<std::size_t>(model_.vocab()),
                                                                         static_cast<std::size_t>(model_.vocab()))));
    if (const Status s = table_.accept(sampled_); !s.ok()) return abandon(s);
    count(b);
    return b.size();
  }

  // Steps until no session has work; returns the number of steps, or the first refusal other
  // than empty_step.
  Result<std::int64_t> run_until_idle() {
    std::int64_t n = 0;
    for (;;) {
      const auto r = step();
      if (r.ok()) {
        ++n;
        continue;
      }
      if (r.status() == Errc::empty_step) return n;
      return r.status().code();
    }
  }

 private:
  Errc abandon(Status why) {
    (void)table_.abandon();
    return why.code();
  }

  void count(const StepBatch& b) {
    ++stats_.steps;
    ++(b.size() == 1 ? stats_.decode_steps : stats_.prefill_steps);
    stats_.tokens_fed += b.size();
    stats_.tokens_generated += static_cast<std::int64_t>(sampled_.size());
  }

  M& model_;
  Cache& cache_;
  SessionTable<Cache> table_;
  ExecutorStats stats_;
  std::vector<std::int32_t> rows_, sampled_;
  std::vector<float> logits_;
};

}  // namespace cellkv::batching
