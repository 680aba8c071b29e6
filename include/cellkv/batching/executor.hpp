// cellkv/batching/executor.hpp - batched generation: the session table packs each step, the cache
// places it, the model runs it and samples each session's next token where it runs (on the device
// for a GPU model); only the sampled ids come back.
//
//   Executor exec(model, cache, {.max_write = 64, .min_prefill_tokens = model.min_prefill_tokens(),
//                                .max_tokens_per_session = 512});
//   auto id = exec.sessions().add(prompt, 32, {.temperature = 0.8f, .top_p = 0.95f, .seed = 1}).value();
//   auto ids = exec.sessions().add_samples(prompt, 32, {.temperature = 0.8f, .seed = 2}, 8).value();
//   while (exec.step().ok()) {}                   // continuous batching: add sessions between steps
//   auto tokens = exec.sessions().output(id).value();
//
// Sessions are added, sampled n times (add_samples: n samples of one prompt that share its cells,
// each with its own seed), cloned and finished through sessions(), the SessionTable, between steps.
//
// Overlap (ExecutorOptions::overlap, on by default): step() packs and places step n + 1 and
// enqueues it (model.forward) while the model still runs step n, and only then waits for step n's
// sampled ids (model.retire), one step behind. Positions and placement do not depend on token
// values, so a session's next token can go in before it is known on the host: the model reads it on
// the device (DeferredToken). A session that sampled a stop token at step n already has a token fed
// and one sampled at step n + 1: that token is discarded and its sequence rewound when step n is
// resolved. So after step() returns, output(id) shows the tokens up to the step before; drain()
// (or run_until_idle(), or a step() with no work left) brings every token in. The host reference
// path runs each forward at once; overlap changes nothing there but the order of the calls.
//
// Context shift (SessionLimits::context_shift; session_table.hpp, "Context shift"): a session
// whose sequence reaches max_tokens_per_session positions keeps its first `keep`, drops the oldest
// half of the rest and generates on, up to its max_new_tokens, instead of being refused at add:
//
//   Executor exec(model, cache, {.max_write = 64, .min_prefill_tokens = 2, .max_tokens_per_session = 512,
//                                .context_shift = {.enabled = true, .keep = 32}});
//
// The table shifts a session when it packs the session's next token, between steps; positions do
// not depend on token values, so the shift is the same with overlap on or off, batched or alone.
// The model must re-rotate the moved K rows (HostPool::sync with the model's RopeSpec; a device
// cache's set_key_rotation, without which the executor refuses the option with no_key_rotation).
// Cell layout only (the sequence layout is refused with unsupported_by_layout).
//
// Sessions join and finish between steps; a finished session's sequence is freed by reap() or
// finish(), and its cells are reused by later sessions. The executor is the same on the host
// reference path and on the GPU: the model decides how a forward runs (and, on the GPU, whether it
// replays a captured graph).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellkv/batching/model.hpp"
#include "cellkv/batching/sampling.hpp"
#include "cellkv/batching/session_status.hpp"
#include "cellkv/batching/session_table.hpp"
#include "cellkv/status.hpp"

namespace cellkv::batching {

struct ExecutorOptions {
  bool overlap = true;  // enqueue step n + 1 before waiting for step n's tokens
};

struct ExecutorStats {
  std::int64_t steps = 0;
  std::int64_t decode_steps = 0;      // one-token steps
  std::int64_t prefill_steps = 0;     // wider steps
  std::int64_t tokens_fed = 0;        // tokens through the model (prompt and generated)
  std::int64_t tokens_generated = 0;  // tokens sampled and brought back
  std::int64_t tokens_discarded = 0;  // of those, sampled after their session's stop token
  std::int64_t context_shifts = 0;    // context shifts so far (SessionLimits::context_shift)
  // Host time, in seconds, of the parts of step():
  double plan_seconds = 0;     // packing (next_step), placement (declare_step), the forward's inputs
  double enqueue_seconds = 0;  // model.forward: staging, upload, launches (the whole forward on the host path)
  double wait_seconds = 0;     // model.retire: blocked until a step's tokens are back
  double resolve_seconds = 0;  // filling in the tokens, stop tokens
};

template <Model M, class Cache>
class Executor {
  using Clock = std::chrono::steady_clock;

 public:
  // limits.vocab 0 takes the model's vocabulary. Throws std::invalid_argument when the session
  // limits are invalid for the cache (SessionTable::validate: a context shift on the sequence
  // layout, or on a device cache without a key rotation, among them) or name another vocabulary
  // than the model's.
  Executor(M& model, Cache& cache, const SessionLimits& limits, ExecutorOptions options = {})
      : model_(model), cache_(cache), table_(cache, with_vocab(limits, model.vocab())), options_(options) {}
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  // Waits for the steps still running (their tokens are dropped with the executor).
  ~Executor() { (void)drain(); }

  [[nodiscard]] SessionTable<Cache>& sessions() noexcept { return table_; }
  [[nodiscard]] const SessionTable<Cache>& sessions() const noexcept { return table_; }
  [[nodiscard]] const ExecutorStats& stats() const noexcept { return stats_; }
  [[nodiscard]] const ExecutorOptions& options() const noexcept { return options_; }
  [[nodiscard]] M& model() noexcept { return model_; }
  // Forwards enqueued whose tokens are not back yet (0 or 1 between calls with overlap on).
  [[nodiscard]] std::int32_t steps_in_flight() const noexcept { return unretired_; }

  // Enqueues one step of at most max_tokens tokens (0: the limits' max_write) and brings back the
  // tokens of the step before it (with overlap; of this step without). Returns the step's width,
  // or 0 when no session had work and it only brought back the last step's tokens.
  // Refuses with empty_step when no session has work and nothing is in flight; with a context
  // shift the cache cannot make (out_of_cells, from next_step: earlier sessions' shifts stay done);
  // with the cache's refusal (out_of_cells, sequence_full: the status names the first session
  // whose tokens do not fit) or the model's when placement or the forward fails: the step is then
  // abandoned (rolled back) and nothing changes in the sessions but the tokens of earlier steps
  // coming back (and the cells the step's packing gave waiting samples, which they keep, and the
  // context shifts of its packing, which stay).
  SessionResult<std::int32_t> step(std::int32_t max_tokens = 0) {
    const auto t0 = Clock::now();
    auto batch = table_.next_step(max_tokens);
    stats_.context_shifts = table_.context_shifts();  // shifts stay done when the step is refused
    if (!batch.ok()) {
      if (batch.status() != Errc::empty_step || unretired_ == 0) return SessionStatus(batch.status());
      const SessionStatus s = drain();
      if (!s.ok()) return s;
      return 0;
    }
    const StepBatch& b = batch.value();
    const auto plan = cache_.declare_step(b.seqs);
    if (!plan.ok()) {
      const SessionStatus why = name_refusal(b, plan.status());
      (void)table_.abandon();
      return why;
    }
    rows_.clear();
    for (const LogitRow& r : b.logit_rows)
      if (r.samples) rows_.push_back(r.row);
    table_.sample_rows(b, sample_rows_);
    const ForwardStep step{b.tokens, plan.value().positions, rows_, sample_rows_, b.deferred,
                           b.size() == 1 ? Method::decode : Method::prefill};
    const auto t1 = Clock::now();
    stats_.plan_seconds += seconds(t0, t1);
    if (const Status s = model_.forward(step); !s.ok()) {
      (void)table_.abandon();
      (void)drain();
      return SessionStatus(s);
    }
    stats_.enqueue_seconds += seconds(t1, Clock::now());
    (void)table_.accept_pending();
    ++unretired_;
    count(b);
    const std::int32_t keep = options_.overlap ? 1 : 0;
    while (unretired_ > keep)
      if (const SessionStatus s = retire_one(); !s.ok()) return s;
    return b.size();
  }

  // Brings back the tokens of every step in flight; returns the first failure.
  SessionStatus drain() {
    SessionStatus first;
    while (unretired_ > 0)
      if (const SessionStatus s = retire_one(); !s.ok() && first.ok()) first = s;
    return first;
  }

  // Steps until no session has work and every token is back; returns the number of steps, or the
  // first refusal other than empty_step.
  SessionResult<std::int64_t> run_until_idle() {
    std::int64_t n = 0;
    for (;;) {
      const auto r = step();
      if (r.ok()) {
        n += r.value() > 0 ? 1 : 0;
        continue;
      }
      if (r.status() == Errc::empty_step) return n;
      return r.status();
    }
  }

 private:
  static SessionLimits with_vocab(SessionLimits limits, std::int32_t vocab) {
    if (limits.vocab != 0 && limits.vocab != vocab)
      throw std::invalid_argument("cellkv::batching::Executor: SessionLimits::vocab is not the model's vocabulary");
    limits.vocab = vocab;
    return limits;
  }
  static double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

  // Waits for the oldest forward in flight and resolves its tokens in the table; when the model
  // fails, its tokens are discarded (the sessions step back as if the step had not sampled).
  SessionStatus retire_one() {
    const auto t0 = Clock::now();
    const auto n = static_cast<std::size_t>(table_.pending_samples());
    retired_tokens_.resize(n);
    retired_logprobs_.resize(n);
    const Status got = model_.retire(retired_tokens_, retired_logprobs_);
    --unretired_;
    const auto t1 = Clock::now();
    stats_.wait_seconds += seconds(t0, t1);
    const std::int64_t discarded = table_.discarded_tokens();
    Status s = got;
    if (s.ok()) s = table_.resolve(retired_tokens_, retired_logprobs_);
    if (!s.ok()) table_.discard_pending();
    else stats_.tokens_generated += static_cast<std::int64_t>(n);
    stats_.tokens_discarded += table_.discarded_tokens() - discarded;
    stats_.resolve_seconds += seconds(t1, Clock::now());
    return SessionStatus(s);
  }

  // The cache's refusal of a step, naming the first session whose tokens do not fit: for
  // out_of_cells the session of the first token past the free cells, for sequence_full the first
  // session whose sequence would pass the layout's position limit (max_len; on the cell layout
  // max_cells rounded up to whole table pages).
  SessionStatus name_refusal(const StepBatch& b, Status why) const {
    const auto& host = detail::queries_of(cache_);
    SessionId who = 0;
    if (why == Errc::out_of_cells) {
      if constexpr (requires { host.free_cells(); }) {
        const auto free = static_cast<std::int64_t>(host.free_cells());
        for (const LogitRow& r : b.logit_rows)
          if (r.row >= free) {
            who = r.session;
            break;
          }
      }
    } else if (why == Errc::sequence_full) {
      if constexpr (requires { host.pos(0); host.position_limit(); }) {
        std::int32_t begin = 0;
        for (const LogitRow& r : b.logit_rows) {
          const std::int32_t seq = b.seqs[static_cast<std::size_t>(r.row)];
          if (host.pos(seq).value_or(0) + (r.row + 1 - begin) > host.position_limit()) {
            who = r.session;
            break;
          }
          begin = r.row + 1;
        }
      }
    }
    return SessionStatus(why.code(), who != 0 ? SessionErrc::no_room : SessionErrc::none, who);
  }

  void count(const StepBatch& b) {
    ++stats_.steps;
    ++(b.size() == 1 ? stats_.decode_steps : stats_.prefill_steps);
    stats_.tokens_fed += b.size();
  }

  M& model_;
  Cache& cache_;
  SessionTable<Cache> table_;
  ExecutorOptions options_;
  ExecutorStats stats_;
  std::int32_t unretired_ = 0;
  std::vector<std::int32_t> rows_, retired_tokens_;
  std::vector<SampleRow> sample_rows_;
  std::vector<float> retired_logprobs_;
};

}  // namespace cellkv::batching
