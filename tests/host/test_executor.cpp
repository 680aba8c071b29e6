// The executor on the host reference path with the example decoder: batched generation equals solo
// generation token for token (different prompt lengths, a fork), a hand-made schedule of widths 20,
// 1, 4, 2, 4, 7, 3 with partial prefills uses both methods and still matches, and cells reused
// across rounds of sessions leak nothing; seeded sampling is the same batched, solo, with or
// without overlap; n samples of a prompt (add_samples) each equal a solo run with the sample's
// seed, and hold the leader's prompt cells; stop tokens end sessions (the token after is discarded
// and rewound); tokens come back one step behind; a step whose tokens are lost (the model's retire
// fails) is drawn again, so outputs still equal solo generation; refusals at add (budgets, ids,
// sampling) and at step time (naming the session) change nothing. The host path computes in fp32
// with a fixed summation order per row, so equality is exact up to float ties.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cellkv/batching/executor.hpp"
#include "cellkv/kv_cache.hpp"
#include "llama/host_llama.hpp"
#include "batch_checks.hpp"
#include "executor_cases.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using test::kSessionSampling;
using Model = Windows<0, 6>;  // a full-history layer and a sliding-window layer
using Cells = CellCache<Model, placement::lowest_free, 16>;
using Slots = SequenceCache<Model, 16>;

const llama::Config kConfig{.vocab = 64, .dim = 32, .layers = Model::kLayers, .heads_q = 4, .heads_kv = 2, .head_dim = 8,
                            .ffn = 48, .seed = 7};
const SessionLimits kLimits{.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = 96};
const CacheConfig kCacheConfig{.max_write = 24, .max_cells = 600, .max_seqs = 8, .max_len = 96};

const llama::Weights& weights() {
  static const llama::Weights w = llama::generate(kConfig);
  return w;
}

std::vector<std::int32_t> prompt_of(std::int32_t len, std::int32_t salt) {
  return test::make_prompt(len, salt, kConfig.vocab, {17, 5, 3});
}

// The tokens one session generates alone in a fresh cache.
template <class Cache>
std::vector<std::int32_t> solo(const std::vector<std::int32_t>& prompt, std::int32_t max_new) {
  Cache cache(kCacheConfig);
  llama::HostLlama<Cache> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const SessionId id = exec.sessions().add(prompt, max_new).value();
  REQUIRE(exec.run_until_idle().ok());
  const auto out = exec.sessions().output(id).value();
  return {out.begin(), out.end()};
}

template <class Cache>
std::vector<std::int32_t> output_of(const Executor<llama::HostLlama<Cache>, Cache>& exec, SessionId id) {
  const auto out = exec.sessions().output(id).value();
  return {out.begin(), out.end()};
}

template <class Cache>
void batched_equals_solo() {
  Cache cache(kCacheConfig);
  llama::HostLlama<Cache> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const std::int32_t lengths[] = {1, 3, 9, 17, 30};
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 5; ++i) ids.push_back(exec.sessions().add(prompt_of(lengths[i], i), 12).value());
  for (int s = 0; s < 3; ++s) REQUIRE(exec.step().ok());
  const SessionId fork = exec.sessions().clone(ids[2], 12).value();  // shares session 2's prompt cells
  REQUIRE(exec.run_until_idle().ok());
  for (std::int32_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(output_of(exec, ids[static_cast<std::size_t>(i)]) == solo<Cache>(prompt_of(lengths[i], i), 12));
  }
  CHECK(output_of(exec, fork) == solo<Cache>(prompt_of(9, 2), 12));
  CHECK(exec.stats().decode_steps + exec.stats().prefill_steps == exec.stats().steps);
}

}  // namespace

TEST_CASE("host executor: batched generation equals solo generation (cell layout)") { batched_equals_solo<Cells>(); }

TEST_CASE("host executor: batched generation equals solo generation (sequence layout)") { batched_equals_solo<Slots>(); }

TEST_CASE("host executor: a hand-made schedule of widths 20, 1, 4, 2, 4, 7, 3 matches solo generation") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const SessionId a = exec.sessions().add(prompt_of(26, 1), 10).value();  // prefills 20, then partial
  const SessionId b = exec.sessions().add(prompt_of(5, 2), 10).value();
  const std::int32_t widths[] = {20, 1, 4, 2, 4, 7, 3};
  std::vector<std::int32_t> ran;
  for (const std::int32_t w : widths) {
    const auto r = exec.step(w);
    REQUIRE(r.ok());
    CHECK(r.value() <= w);
    ran.push_back(r.value());
  }
  CHECK(ran.front() == 20);  // the first step is a's 20-token prefill
  CHECK(exec.stats().decode_steps > 0);
  CHECK(exec.stats().prefill_steps > 0);
  REQUIRE(exec.run_until_idle().ok());
  CHECK(output_of(exec, a) == solo<Cells>(prompt_of(26, 1), 10));
  CHECK(output_of(exec, b) == solo<Cells>(prompt_of(5, 2), 10));
  CHECK(exec.step(25).status() == Errc::bad_argument);  // wider than max_write
}

TEST_CASE("host executor: cells reused across rounds of sessions leak no K/V") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    std::vector<SessionId> ids;
    for (std::int32_t i = 0; i < 4; ++i) ids.push_back(exec.sessions().add(prompt_of(6 + 7 * i, 10 * round + i), 8).value());
    REQUIRE(exec.run_until_idle().ok());
    for (std::int32_t i = 0; i < 4; ++i)
      CHECK(output_of(exec, ids[static_cast<std::size_t>(i)]) == solo<Cells>(prompt_of(6 + 7 * i, 10 * round + i), 8));
    for (const SessionId id : ids) REQUIRE(exec.sessions().finish(id).ok());
    CHECK(cache.free_cells() == cache.capacity());  // every cell back, to be reused next round
  }
}

TEST_CASE("host executor: a step that cannot be placed is refused, names the session and changes nothing") {
  const CacheConfig tiny{.max_write = 24, .max_cells = 30, .max_seqs = 8};
  Cells cache(tiny);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const SessionId a = exec.sessions().add(prompt_of(12, 3), 4).value();
  const SessionId b = exec.sessions().add(prompt_of(12, 4), 4).value();
  REQUIRE(exec.step().ok());  // a's 12 and b's 12 tokens: 24 cells
  const SessionId c = exec.sessions().add(prompt_of(10, 5), 2).value();
  const Cells before = cache;
  const auto table_before = exec.sessions();
  // a and b decode (2 tokens), c's 10 prompt tokens: 12 > 6 free cells; the first token past them
  // is c's.
  const auto refused = exec.step();
  CHECK(refused.status() == Errc::out_of_cells);
  CHECK(refused.status() == SessionErrc::no_room);
  CHECK(refused.status().session() == c);
  CHECK(refused.status().message().find("session 3") != std::string::npos);
  CHECK(cache == before);
  CHECK(exec.sessions() == table_before);
  CHECK(exec.step(6).ok());  // a narrower step fits: a, b and 4 of c's tokens
  CHECK(exec.sessions().cached_tokens(c).value() == 4);
  CHECK(exec.sessions().is_live(a));
  CHECK(exec.sessions().is_live(b));
}

TEST_CASE("host executor: impossible budgets and bad input are refused at add, changing nothing") {
  Slots cache(kCacheConfig);  // max_len 96
  llama::HostLlama<Slots> model(kConfig, weights(), cache);
  Executor exec(model, cache, {.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = 200});
  CHECK(exec.sessions().limits().vocab == kConfig.vocab);  // taken from the model
  const Slots before = cache;
  const auto table_before = exec.sessions();
  auto refused = [&](SessionResult<SessionId> r, Errc code, SessionErrc detail) {
    CHECK(r.status() == code);
    CHECK(r.status() == detail);
    CHECK(cache == before);
    CHECK(exec.sessions() == table_before);
  };
  refused(exec.sessions().add(prompt_of(90, 1), 8), Errc::bad_argument, SessionErrc::exceeds_sequence);  // 97 > 96
  CHECK(exec.sessions().add(prompt_of(90, 1), 7).ok());  // 96 tokens held at most: fits
  const Slots after_one = cache;
  const auto table_one = exec.sessions();
  auto refused_now = [&](SessionResult<SessionId> r, Errc code, SessionErrc detail) {
    CHECK(r.status() == code);
    CHECK(r.status() == detail);
    CHECK(cache == after_one);
    CHECK(exec.sessions() == table_one);
  };
  std::vector<std::int32_t> bad = prompt_of(5, 1);
  bad[2] = kConfig.vocab;
  refused_now(exec.sessions().add(bad, 4), Errc::bad_argument, SessionErrc::token_out_of_vocab);
  bad[2] = -7;
  refused_now(exec.sessions().add(bad, 4), Errc::bad_argument, SessionErrc::token_out_of_vocab);
  refused_now(exec.sessions().add(prompt_of(5, 1), 4, {.temperature = -1.f}), Errc::bad_argument, SessionErrc::bad_temperature);
  refused_now(exec.sessions().add(prompt_of(5, 1), 4, {.top_k = -2}), Errc::bad_argument, SessionErrc::bad_top_k);
  refused_now(exec.sessions().add(prompt_of(5, 1), 4, {.top_p = 0.f}), Errc::bad_argument, SessionErrc::bad_top_p);
  refused_now(exec.sessions().add(prompt_of(5, 1), 4, {.top_p = 1.5f}), Errc::bad_argument, SessionErrc::bad_top_p);
  refused_now(exec.sessions().add(prompt_of(5, 1), 4, {.min_p = 2.f}), Errc::bad_argument, SessionErrc::bad_min_p);
  refused_now(exec.sessions().add(prompt_of(5, 1), 4, {.stop_tokens = {kConfig.vocab}}), Errc::bad_argument,
              SessionErrc::bad_stop_token);
  const SessionId first = exec.sessions().sessions().front();
  refused_now(exec.sessions().clone(first, 8), Errc::bad_argument, SessionErrc::exceeds_sequence);
  refused_now(exec.sessions().clone(first, 4, {.top_p = 2.f}), Errc::bad_argument, SessionErrc::bad_top_p);
  CHECK_THROWS_AS(Executor(model, cache, {.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = 96,
                                          .vocab = kConfig.vocab + 1}),
                  std::invalid_argument);
}

TEST_CASE("host executor: the model refuses token ids outside its vocabulary") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  const std::int32_t seq = cache.seq_new().value();
  const std::int32_t seqs[] = {seq, seq};
  const auto plan = cache.declare_step(seqs);
  REQUIRE(plan.ok());
  const std::int32_t rows[] = {1};
  const SampleRow sampling[] = {SampleRow{}};
  for (const std::int32_t bad : {kConfig.vocab, -1, 1 << 30}) {
    const std::int32_t tokens[] = {3, bad};
    CHECK(model.forward({tokens, plan.value().positions, rows, sampling, {}, Method::prefill}) == Errc::bad_argument);
  }
  std::int32_t out[1];
  float lp[1];
  CHECK(model.retire(out, lp) == Errc::bad_argument);  // nothing was run
  const std::int32_t good[] = {3, kConfig.vocab - 1};
  CHECK(model.forward({good, plan.value().positions, rows, sampling, {}, Method::prefill}).ok());
  CHECK(model.retire(out, lp).ok());
  CHECK(out[0] == argmax(model.last_logits()));
}

namespace {


template <class Cache>
std::vector<std::int32_t> solo_sampled(const std::vector<std::int32_t>& prompt, std::int32_t max_new,
                                       const SamplingParams& p, ExecutorOptions options = {}) {
  Cache cache(kCacheConfig);
  llama::HostLlama<Cache> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits, options);
  const SessionId id = exec.sessions().add(prompt, max_new, p).value();
  REQUIRE(exec.run_until_idle().ok());
  return output_of(exec, id);
}

}  // namespace

TEST_CASE("host executor: seeded sampling is the same batched, solo, and with or without overlap") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 5; ++i) ids.push_back(exec.sessions().add(prompt_of(3 + 6 * i, i), 14, kSessionSampling[i]).value());
  for (const std::int32_t w : {7, 24, 3, 1, 24}) REQUIRE(exec.step(w).ok());  // an odd mix of widths
  const SessionId fork = exec.sessions().clone(ids[1], 10, {.temperature = 1.f, .seed = 77}).value();
  REQUIRE(exec.run_until_idle().ok());
  std::int32_t greedy_differs = 0;
  for (std::int32_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    const auto got = output_of(exec, ids[static_cast<std::size_t>(i)]);
    CHECK(got == solo_sampled<Cells>(prompt_of(3 + 6 * i, i), 14, kSessionSampling[i]));
    CHECK(got == solo_sampled<Cells>(prompt_of(3 + 6 * i, i), 14, kSessionSampling[i], {.overlap = false}));
    CHECK(got == solo_sampled<Slots>(prompt_of(3 + 6 * i, i), 14, kSessionSampling[i]));
    greedy_differs += got != solo_sampled<Cells>(prompt_of(3 + 6 * i, i), 14, {});
  }
  CHECK(greedy_differs >= 3);  // the sampled sessions really sample
  CHECK(output_of(exec, fork) == solo_sampled<Cells>(prompt_of(9, 1), 10, {.temperature = 1.f, .seed = 77}));
  // log-probs of the session that asked: one per token, each a log-probability.
  const auto lp = exec.sessions().logprobs(ids[3]).value();
  CHECK(lp.size() == 14);
  for (const float x : lp) CHECK((x <= 0.f && x > -30.f));
  CHECK(exec.sessions().logprobs(ids[0]).value().empty());
}

TEST_CASE("host executor: a stop token ends a session; the token after it is discarded and rewound") {
  const std::vector<std::int32_t> prompt = prompt_of(7, 9);
  const auto free_run = solo<Cells>(prompt, 12);
  // The first token that did not appear before it: stopping there keeps exactly that prefix.
  std::size_t at = 2;
  while (at < free_run.size() && std::find(free_run.begin(), free_run.begin() + static_cast<std::ptrdiff_t>(at),
                                           free_run[at]) != free_run.begin() + static_cast<std::ptrdiff_t>(at))
    ++at;
  REQUIRE(at < free_run.size());
  const std::vector<std::int32_t> want(free_run.begin(), free_run.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  for (const bool overlap : {true, false}) {
    CAPTURE(overlap);
    Cells cache(kCacheConfig);
    llama::HostLlama<Cells> model(kConfig, weights(), cache);
    Executor exec(model, cache, kLimits, {.overlap = overlap});
    const SessionId id = exec.sessions().add(prompt, 12, {.stop_tokens = {free_run[at], kConfig.vocab - 1}}).value();
    const SessionId other = exec.sessions().add(prompt_of(5, 2), 12).value();
    REQUIRE(exec.run_until_idle().ok());
    CHECK(output_of(exec, id) == want);
    CHECK(exec.sessions().state(id).value() == SessionState::done);
    CHECK(exec.sessions().cached_tokens(id).value() == static_cast<std::int32_t>(prompt.size() + want.size()) - 1);
    CHECK(cache.pos(exec.sessions().sequence_of(id).value()).value() == exec.sessions().cached_tokens(id).value());
    CHECK(output_of(exec, other) == solo<Cells>(prompt_of(5, 2), 12));
    CHECK(exec.stats().tokens_discarded == (overlap ? 1 : 0));
    CHECK(exec.stats().tokens_generated - exec.stats().tokens_discarded ==
          static_cast<std::int64_t>(want.size()) + 12);
  }
}

namespace {

// The example decoder whose fail_at-th retire reports a device fault: that step's tokens are lost.
template <class Cache>
struct FaultyRetire {
  llama::HostLlama<Cache>& inner;
  int fail_at = 0;
  int retires = 0;
  std::int32_t vocab() const { return inner.vocab(); }
  std::int32_t min_prefill_tokens() const { return inner.min_prefill_tokens(); }
  Status forward(const ForwardStep& step) { return inner.forward(step); }
  Status retire(std::span<std::int32_t> tokens, std::span<float> logprobs) {
    if (const Status s = inner.retire(tokens, logprobs); !s.ok()) return s;
    return ++retires == fail_at ? Status(Errc::device_error) : Status{};
  }
};

// Sessions of several prompt lengths (one fed in chunks) run to the end while the step whose
// tokens come back fail_at-th is lost: each session draws the lost tokens again (its first one by
// feeding its last prompt token again), so every output equals solo generation.
template <class Cache>
void lost_step_is_drawn_again(int fail_at, bool overlap) {
  Cache cache(kCacheConfig);
  llama::HostLlama<Cache> host(kConfig, weights(), cache);
  FaultyRetire<Cache> model{host, fail_at};
  Executor exec(model, cache, kLimits, {.overlap = overlap});
  const std::int32_t lengths[] = {1, 9, 30};
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 3; ++i) ids.push_back(exec.sessions().add(prompt_of(lengths[i], i), 6).value());
  int faults = 0;
  for (int guard = 0; guard < 100; ++guard) {
    const auto r = exec.step();
    if (r.ok()) continue;
    if (r.status() == Errc::empty_step) break;
    CHECK(r.status() == Errc::device_error);
    ++faults;
  }
  CHECK(faults == 1);
  for (std::int32_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    const SessionId id = ids[static_cast<std::size_t>(i)];
    const auto out = exec.sessions().output(id).value();
    CHECK(std::vector<std::int32_t>(out.begin(), out.end()) == solo<Cache>(prompt_of(lengths[i], i), 6));
    CHECK(cache.pos(exec.sessions().sequence_of(id).value()).value() == exec.sessions().cached_tokens(id).value());
  }
  CHECK(exec.stats().tokens_discarded > 0);
}

}  // namespace

TEST_CASE("host executor: a step whose tokens are lost (the model's retire fails) is drawn again") {
  for (const bool overlap : {true, false})
    for (const int fail_at : {1, 2, 3, 5}) {
      CAPTURE(overlap);
      CAPTURE(fail_at);
      lost_step_is_drawn_again<Cells>(fail_at, overlap);
      lost_step_is_drawn_again<Slots>(fail_at, overlap);
    }
}

TEST_CASE("host executor: with overlap, tokens come back one step behind; drain brings in the rest") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const SessionId id = exec.sessions().add(prompt_of(4, 1), 5).value();
  REQUIRE(exec.step().ok());  // the prompt; its first token is sampled, not back yet
  CHECK(exec.steps_in_flight() == 1);
  CHECK(exec.sessions().output(id).value().empty());
  CHECK(exec.sessions().state(id).value() == SessionState::generating);
  REQUIRE(exec.step().ok());  // feeds that token from the model's own samples; the first comes back
  CHECK(exec.sessions().output(id).value().size() == 1);
  CHECK(exec.sessions().cached_tokens(id).value() == 5);
  REQUIRE(exec.drain().ok());
  CHECK(exec.steps_in_flight() == 0);
  CHECK(exec.sessions().output(id).value().size() == 2);
  REQUIRE(exec.run_until_idle().ok());
  CHECK(output_of(exec, id) == solo<Cells>(prompt_of(4, 1), 5));
  CHECK(exec.step().status() == Errc::empty_step);
}

namespace {

// Sample i of add_samples(prompt, max_new, p, n) draws with seed p.seed + i.
SamplingParams with_seed(SamplingParams p, std::uint64_t seed) {
  p.seed = seed;
  return p;
}

// Two groups of samples (a prompt longer than a step, whose leader feeds in chunks, and a one-token
// prompt) beside a plain session, run to the end; each sample must equal a solo run of its prompt
// with its own seed on a fresh cache.
template <class Cache>
void samples_equal_solo(ExecutorOptions options) {
  Cache cache(kCacheConfig);
  llama::HostLlama<Cache> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits, options);
  const SamplingParams hot{.temperature = 1.f, .top_p = 0.9f, .seed = 100};
  const SamplingParams warm{.temperature = 0.7f, .top_k = 12, .seed = 7, .logprobs = true};
  const SessionId plain = exec.sessions().add(prompt_of(11, 4), 10, kSessionSampling[0]).value();
  const auto long_ids = exec.sessions().add_samples(prompt_of(40, 5), 12, hot, 4).value();
  const auto short_ids = exec.sessions().add_samples(prompt_of(1, 6), 9, warm, 3).value();
  REQUIRE(long_ids.size() == 4);
  REQUIRE(short_ids.size() == 3);
  // The long prompt's samples wait while its leader feeds; then they hold its prompt's cells.
  std::int32_t steps = 0;
  while (exec.sessions().leader_of(long_ids[1]).value() != 0) {
    CHECK(exec.sessions().cached_tokens(long_ids[1]).value() == 0);
    REQUIRE(exec.step().ok());
    ++steps;
  }
  CHECK(steps >= 2);  // 40 prompt tokens, at most 24 a step
  if constexpr (std::is_same_v<typename Cache::Layout, layout::cell>) {
    const std::int32_t leader_seq = exec.sessions().sequence_of(long_ids[0]).value();
    for (std::size_t i = 1; i < long_ids.size(); ++i) {
      const std::int32_t seq = exec.sessions().sequence_of(long_ids[i]).value();
      for (std::int32_t p = 0; p < 39; ++p) CHECK(cache.cell_of(seq, p) == cache.cell_of(leader_seq, p));
    }
  }
  REQUIRE(exec.run_until_idle().ok());
  CHECK(output_of(exec, plain) == solo_sampled<Cache>(prompt_of(11, 4), 10, kSessionSampling[0]));
  std::vector<std::vector<std::int32_t>> outputs;
  for (std::size_t i = 0; i < long_ids.size(); ++i) {
    CAPTURE(i);
    outputs.push_back(output_of(exec, long_ids[i]));
    CHECK(outputs.back() == solo_sampled<Cells>(prompt_of(40, 5), 12, with_seed(hot, 100 + i)));
  }
  for (std::size_t i = 0; i < short_ids.size(); ++i) {
    CAPTURE(i);
    outputs.push_back(output_of(exec, short_ids[i]));
    CHECK(outputs.back() == solo_sampled<Cells>(prompt_of(1, 6), 9, with_seed(warm, 7 + i)));
    CHECK(exec.sessions().logprobs(short_ids[i]).value().size() == 9);
  }
  // The samples of one prompt differ from each other: each has its own seed.
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = i + 1; j < outputs.size(); ++j) CHECK(outputs[i] != outputs[j]);
}

}  // namespace

TEST_CASE("host executor: n samples of a prompt equal each sample run alone with its seed") {
  SUBCASE("cell layout") { samples_equal_solo<Cells>({}); }
  SUBCASE("cell layout, no overlap") { samples_equal_solo<Cells>({.overlap = false}); }
  SUBCASE("sequence layout") { samples_equal_solo<Slots>({}); }
}
