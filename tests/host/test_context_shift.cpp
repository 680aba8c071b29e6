// The executor's context shift (SessionLimits::context_shift) on the host reference path with the
// example decoder. Oracles:
//  - positions: a brute-force model of llama.cpp's rule (a list of which token each position
//    holds: prompt fed, then generated tokens but the last; before a generated token goes in at
//    position B, erase the oldest half after the first `keep`) gives, after every step, the
//    positions the cache sequence holds (exactly [0, n)), seq_pos_min / seq_pos_max, the table's
//    cached_tokens and the number of shifts;
//  - rotation: layer 0's K of a token depends on the token alone, RoPE'd at its position; after
//    shifts every K row of layer 0 the sequence holds equals K computed from its token by a float64
//    RoPE at the position it holds now (1e-4 of the row's largest element), V equals V computed
//    from the token;
//  - a session shifts the same batched (with forks sharing prompt cells that are copied on write,
//    seeded sampling, overlap) as alone: every output equals a solo run's;
//  - refusals: the sequence layout, keep outside [0, B - 2], a device cache with no key rotation,
//    prompts past the budget, a shift whose copies on write do not fit (nothing changes);
//  - a stop token packed (and shifted for) under overlap before it is resolved: the same tokens as
//    without overlap, the sequence rewound to exactly [0, pos).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "cellkv/batching/executor.hpp"
#include "cellkv/kv_cache.hpp"
#include "executor_cases.hpp"
#include "llama/host_llama.hpp"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using Model = Windows<0, 6>;  // a full-history layer and a sliding-window layer
using Cells = CellCache<Model, placement::lowest_free, 16>;
using Slots = SequenceCache<Model, 16>;

const llama::Config kConfig{.vocab = 64, .dim = 32, .layers = Model::kLayers, .heads_q = 4, .heads_kv = 2, .head_dim = 8,
                            .ffn = 48, .seed = 7};
constexpr std::int32_t kBudget = 24, kKeep = 5;
const SessionLimits kShift{.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = kBudget,
                           .context_shift = {.enabled = true, .keep = kKeep}};
const CacheConfig kCacheConfig{.max_write = 24, .max_cells = 600, .max_seqs = 8, .max_len = 96};

const llama::Weights& weights() {
  static const llama::Weights w = llama::generate(kConfig);
  return w;
}

std::vector<std::int32_t> prompt_of(std::int32_t len, std::int32_t salt) {
  return test::make_prompt(len, salt, kConfig.vocab, {13, 7, 1});
}

// The brute-force rule: which token (index into prompt ++ output) each position holds once the
// prompt of `prompt` tokens and `generated` generated tokens (the last not fed) went in.
struct Held {
  std::vector<std::int32_t> token_index;  // [positions held]
  std::int32_t shifts = 0;
};
Held brute_force(std::int32_t prompt, std::int32_t generated, std::int32_t budget, std::int32_t keep) {
  Held h;
  for (std::int32_t i = 0; i < prompt; ++i) h.token_index.push_back(i);
  for (std::int32_t j = 0; j + 1 < generated; ++j) {
    const auto n = static_cast<std::int32_t>(h.token_index.size());
    if (n >= budget) {
      const std::int32_t discard = (n - keep) / 2;
      h.token_index.erase(h.token_index.begin() + keep, h.token_index.begin() + keep + discard);
      ++h.shifts;
    }
    h.token_index.push_back(prompt + j);
  }
  return h;
}

// Layer 0's K and V of one token at position pos: rmsnorm(embed) Wk, Wv in float as the model
// computes them, K RoPE'd in double (interleaved pairs, rope_theta).
void layer0_kv(std::int32_t token, std::int32_t pos, std::vector<double>& k, std::vector<float>& v) {
  const llama::Weights& w = weights();
  const auto dim = static_cast<std::size_t>(kConfig.dim);
  std::vector<float> x(w.embed.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(token) * dim),
                       w.embed.begin() + static_cast<std::ptrdiff_t>((static_cast<std::size_t>(token) + 1) * dim));
  std::vector<float> h(dim), kf(static_cast<std::size_t>(kConfig.kv_width()));
  v.assign(kf.size(), 0.f);
  llama::rmsnorm(x, w.layers[0].attn_norm, h, kConfig.norm_eps);
  llama::matmul(h, w.layers[0].wk, kf, kConfig.dim, kConfig.kv_width(), false);
  llama::matmul(h, w.layers[0].wv, v, kConfig.dim, kConfig.kv_width(), false);
  k.assign(kf.begin(), kf.end());
  for (std::int32_t head = 0; head < kConfig.heads_kv; ++head)
    for (std::int32_t i = 0; i < kConfig.head_dim / 2; ++i) {
      double* p = k.data() + head * kConfig.head_dim + 2 * i;
      const double a = pos * std::pow(static_cast<double>(kConfig.rope_theta), -2.0 * i / kConfig.head_dim);
      const double x0 = p[0], x1 = p[1];
      p[0] = x0 * std::cos(a) - x1 * std::sin(a);
      p[1] = x0 * std::sin(a) + x1 * std::cos(a);
    }
}

using Exec = Executor<llama::HostLlama<Cells>, Cells>;

// Checks one session against the brute-force rule: positions, shifts, and layer 0's K / V rows.
void check_session(Exec& exec, const Cells& cache, SessionId id) {
  CAPTURE(id);
  const auto prompt = exec.sessions().prompt(id).value();
  const auto output = exec.sessions().output(id).value();
  REQUIRE(exec.steps_in_flight() == 0);
  // A session still feeding holds the prompt tokens fed so far (no shift yet); one that generates
  // has fed its whole prompt.
  const std::int32_t fed = output.empty() ? exec.sessions().cached_tokens(id).value() : static_cast<std::int32_t>(prompt.size());
  REQUIRE(fed <= static_cast<std::int32_t>(prompt.size()));
  const Held want = brute_force(fed, static_cast<std::int32_t>(output.size()), kBudget, kKeep);
  const auto n = static_cast<std::int32_t>(want.token_index.size());
  const std::int32_t seq = exec.sessions().sequence_of(id).value();
  CHECK(exec.sessions().context_shifts(id).value() == want.shifts);
  CHECK(exec.sessions().cached_tokens(id).value() == n);
  CHECK(cache.pos(seq).value() == n);
  CHECK(cache.seq_pos_min(seq).value() == (n > 0 ? 0 : -1));
  CHECK(cache.seq_pos_max(seq).value() == n - 1);
  std::vector<std::int32_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  CHECK(cache.held_positions(seq).value() == all);
  const PoolView<float> pool = exec.model().pool().view(0);
  std::vector<double> k;
  std::vector<float> v;
  for (std::int32_t p = 0; p < n; ++p) {
    CAPTURE(p);
    const std::int32_t index = want.token_index[static_cast<std::size_t>(p)];
    const std::int32_t token = index < static_cast<std::int32_t>(prompt.size())
                                   ? prompt[static_cast<std::size_t>(index)]
                                   : output[static_cast<std::size_t>(index) - prompt.size()];
    layer0_kv(token, p, k, v);
    const std::int64_t row = cache.row_of(seq, p);
    REQUIRE(row >= 0);
    double scale = 0, v_scale = 0, k_err = 0, v_err = 0;
    for (const double x : k) scale = std::max(scale, std::abs(x));
    for (const float x : v) v_scale = std::max(v_scale, static_cast<double>(std::abs(x)));
    for (std::size_t e = 0; e < k.size(); ++e) {
      const auto at = static_cast<std::size_t>(row * pool.row_elems()) + e;
      k_err = std::max(k_err, std::abs(static_cast<double>(pool.k[at]) - k[e]));
      v_err = std::max(v_err, static_cast<double>(std::abs(pool.v[at] - v[e])));
    }
    CHECK(k_err <= 1e-4 * scale);
    CHECK(v_err <= 1e-6 * v_scale);
  }
}

// The tokens of a session run alone (overlap off) in a fresh cache with the shift limits.
std::vector<std::int32_t> solo(const std::vector<std::int32_t>& prompt, std::int32_t max_new, const SamplingParams& s = {}) {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Exec exec(model, cache, kShift, {.overlap = false});
  const SessionId id = exec.sessions().add(prompt, max_new, s).value();
  REQUIRE(exec.run_until_idle().ok());
  const auto out = exec.sessions().output(id).value();
  return {out.begin(), out.end()};
}

}  // namespace

TEST_CASE("context shift: after every step the sequence holds what the brute-force rule says, K re-rotated") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Exec exec(model, cache, kShift, {.overlap = false});
  const SessionId a = exec.sessions().add(prompt_of(9, 1), 60).value();
  const SessionId b = exec.sessions().add(prompt_of(kBudget, 2), 20).value();  // a prompt of the whole budget
  std::int32_t steps = 0;
  for (;;) {
    const auto r = exec.step();
    if (!r.ok()) {
      REQUIRE(r.status() == Errc::empty_step);
      break;
    }
    ++steps;
    check_session(exec, cache, a);
    check_session(exec, cache, b);
  }
  CHECK(exec.sessions().output(a).value().size() == 60);
  CHECK(exec.sessions().output(b).value().size() == 20);
  CHECK(exec.sessions().context_shifts(a).value() >= 3);
  CHECK(exec.sessions().context_shifts(b).value() >= 1);
  CHECK(exec.stats().context_shifts ==
        exec.sessions().context_shifts(a).value() + exec.sessions().context_shifts(b).value());
  CHECK(exec.stats().context_shifts == exec.sessions().context_shifts());
  CHECK(steps >= 60);
}

TEST_CASE("context shift: batched with forks, sampling and overlap, every session equals its solo run") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Exec exec(model, cache, kShift);  // overlap on
  const std::int32_t lengths[] = {3, 11, 17, 24};
  const std::int32_t max_new[] = {50, 40, 30, 1};
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 4; ++i)
    ids.push_back(exec.sessions().add(prompt_of(lengths[i], i), max_new[i], test::kSessionSampling[i]).value());
  for (int s = 0; s < 3; ++s) REQUIRE(exec.step().ok());
  REQUIRE(exec.sessions().cached_tokens(ids[3]).value() == 24);
  // Forks sharing the prompt cells of sessions 2 and 3 (positions up to 16 and 23, past kKeep): their
  // shifts copy the shared cells they move, and the sources' cells stay as they were.
  const SessionId fork2 = exec.sessions().clone(ids[2], 45, test::kSessionSampling[4]).value();
  const SessionId fork3 = exec.sessions().clone(ids[3], 35).value();  // samples as session 3 does
  REQUIRE(exec.run_until_idle().ok());
  for (std::int32_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    const auto out = exec.sessions().output(ids[static_cast<std::size_t>(i)]).value();
    CHECK(std::vector<std::int32_t>(out.begin(), out.end()) ==
          solo(prompt_of(lengths[i], i), max_new[i], test::kSessionSampling[i]));
    check_session(exec, cache, ids[static_cast<std::size_t>(i)]);
  }
  const auto f2 = exec.sessions().output(fork2).value();
  const auto f3 = exec.sessions().output(fork3).value();
  CHECK(std::vector<std::int32_t>(f2.begin(), f2.end()) == solo(prompt_of(17, 2), 45, test::kSessionSampling[4]));
  CHECK(std::vector<std::int32_t>(f3.begin(), f3.end()) == solo(prompt_of(24, 3), 35, test::kSessionSampling[3]));  // the source's sampling
  check_session(exec, cache, fork2);
  check_session(exec, cache, fork3);
  CHECK(exec.sessions().context_shifts(fork2).value() >= 2);
  CHECK(exec.sessions().context_shifts(ids[3]).value() == 0);  // one token generated: never fed
  // Only the first kKeep prompt positions are still shared by session 3 and its fork.
  const std::int32_t s3 = exec.sessions().sequence_of(ids[3]).value(), sf = exec.sessions().sequence_of(fork3).value();
  for (std::int32_t p = 0; p < kBudget - 1 && p < cache.pos(sf).value(); ++p) {
    CAPTURE(p);
    CHECK((cache.row_of(s3, p) == cache.row_of(sf, p)) == (p < kKeep));
  }
}

TEST_CASE("context shift: overlap on and off give the same tokens and the same shifts") {
  std::vector<std::vector<std::int32_t>> outs[2];
  std::int64_t shifts[2] = {0, 0};
  for (const bool overlap : {false, true}) {
    Cells cache(kCacheConfig);
    llama::HostLlama<Cells> model(kConfig, weights(), cache);
    Exec exec(model, cache, kShift, {.overlap = overlap});
    std::vector<SessionId> ids;
    for (std::int32_t i = 0; i < 5; ++i)
      ids.push_back(exec.sessions().add(prompt_of(4 + 4 * i, 10 + i), 30 + 3 * i, test::kSessionSampling[i]).value());
    REQUIRE(exec.run_until_idle().ok());
    outs[overlap ? 1 : 0] = test::outputs_of(exec, ids);
    shifts[overlap ? 1 : 0] = exec.stats().context_shifts;
    for (const SessionId id : ids) check_session(exec, cache, id);
  }
  CHECK(outs[0] == outs[1]);
  CHECK(shifts[0] == shifts[1]);
  CHECK(shifts[0] >= 5);
}

TEST_CASE("context shift: refused on the sequence layout, for keep outside [0, B - 2], without a key rotation") {
  Cells cells(kCacheConfig);
  Slots slots(kCacheConfig);
  CHECK(SessionTable<Cells>::validate(kShift, cells).ok());
  CHECK(SessionTable<Slots>::validate(kShift, slots) == Errc::unsupported_by_layout);
  llama::HostLlama<Slots> slot_model(kConfig, weights(), slots);
  CHECK_THROWS_AS(Executor(slot_model, slots, kShift), std::invalid_argument);
  SessionLimits off = kShift;
  off.context_shift.enabled = false;
  CHECK(SessionTable<Slots>::validate(off, slots).ok());  // the keep of a disabled shift is ignored
  off.context_shift.keep = -3;
  CHECK(SessionTable<Slots>::validate(off, slots).ok());
  SessionLimits l = kShift;
  for (const std::int32_t keep : {-1, kBudget - 1, kBudget, kBudget + 5}) {
    CAPTURE(keep);
    l.context_shift.keep = keep;
    CHECK(SessionTable<Cells>::validate(l, cells) == Errc::bad_argument);
    llama::HostLlama<Cells> model(kConfig, weights(), cells);
    CHECK_THROWS_AS(Executor(model, cells, l), std::invalid_argument);
  }
  for (const std::int32_t keep : {0, kBudget - 2}) {
    l.context_shift.keep = keep;
    CHECK(SessionTable<Cells>::validate(l, cells).ok());
  }
  // A cache that reports a key rotation (a device cache) must have one set.
  struct Rotating : Cells {
    using Cells::Cells;
    bool set = false;
    [[nodiscard]] bool key_rotation_set() const noexcept { return set; }
  };
  Rotating rotating(kCacheConfig);
  CHECK(SessionTable<Rotating>::validate(kShift, rotating) == Errc::no_key_rotation);
  CHECK(SessionTable<Rotating>::validate(off, rotating).ok());
  rotating.set = true;
  CHECK(SessionTable<Rotating>::validate(kShift, rotating).ok());
}

TEST_CASE("context shift: budgets at add bound the prompt and the positions held, not max_new") {
  Cells cache({.max_write = 24, .max_cells = 30, .max_seqs = 8});
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Exec exec(model, cache, kShift);
  const Cells before = cache;
  const auto table_before = exec.sessions();
  const auto over = exec.sessions().add(prompt_of(kBudget + 1, 1), 4);
  CHECK(over.status() == Errc::bad_argument);
  CHECK(over.status() == SessionErrc::over_budget);
  CHECK(cache == before);
  CHECK(exec.sessions() == table_before);
  CHECK(exec.sessions().add(prompt_of(kBudget, 1), 1000).ok());  // max_new past the budget
  // Without the shift, the same budget refuses prompt + max_new > B.
  Cells plain_cache(kCacheConfig);
  llama::HostLlama<Cells> plain_model(kConfig, weights(), plain_cache);
  SessionLimits off = kShift;
  off.context_shift.enabled = false;
  Exec plain(plain_model, plain_cache, off);
  CHECK(plain.sessions().add(prompt_of(10, 1), kBudget - 9).status() == SessionErrc::over_budget);
  CHECK(plain.sessions().add(prompt_of(10, 1), kBudget - 10).ok());
  // With the shift a session holds at most B positions: a cache of fewer cells than B refuses a
  // session that would fill B, and takes one that stops short of it.
  Cells small({.max_write = 24, .max_cells = 20, .max_seqs = 8});
  llama::HostLlama<Cells> small_model(kConfig, weights(), small);
  Exec tight(small_model, small, kShift);
  CHECK(tight.sessions().add(prompt_of(10, 1), 12).status() == SessionErrc::exceeds_cache);  // min(21, 24) > 20
  CHECK(tight.sessions().add(prompt_of(10, 1), 11).ok());                                    // 20 held
}

TEST_CASE("context shift: a shift whose copies on write do not fit is refused and changes nothing") {
  // a holds its 20 prompt cells; its fork b shares 19 of them and owns the rest. b's shift at 24
  // positions drops [2, 13) (shared: frees nothing) and moves [13, 24), whose 6 shared cells need
  // fresh ones: with none free the step is refused.
  SessionLimits limits = kShift;
  limits.context_shift.keep = 2;
  Cells cache({.max_write = 24, .max_cells = 25, .max_seqs = 8});
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Exec exec(model, cache, limits, {.overlap = false});
  const SessionId a = exec.sessions().add(prompt_of(20, 4), 1).value();
  REQUIRE(exec.step().ok());
  const SessionId b = exec.sessions().clone(a, 30).value();
  while (exec.sessions().cached_tokens(b).value() < kBudget) REQUIRE(exec.step().ok());
  REQUIRE(cache.free_cells() == 0);
  const Cells before = cache;
  const auto table_before = exec.sessions();
  const auto refused = exec.step();
  CHECK(refused.status() == Errc::out_of_cells);
  CHECK(cache == before);
  CHECK(exec.sessions() == table_before);
  CHECK(exec.stats().context_shifts == 0);
  // Once a leaves, b's cells are its own: the shift frees 11 cells and b generates on.
  REQUIRE(exec.sessions().finish(a).ok());
  REQUIRE(exec.run_until_idle().ok());
  CHECK(exec.sessions().context_shifts(b).value() >= 1);
  const auto out = exec.sessions().output(b).value();
  CHECK(out.size() == 30);
}

TEST_CASE("context shift: a stop token resolved after its session shifted for the token after it") {
  // Prompt P = 9: generated token j goes in at position P + j until the first shift, which comes
  // before token B - P = 15. With that token as the stop token, overlap packs (and shifts for) it
  // before it is resolved; the table then discards what came after and rewinds. The tokens are
  // those without overlap (which never shifts); the sequence still holds exactly [0, pos).
  constexpr std::int32_t kP = 9, kJ = kBudget - kP;
  std::vector<std::int32_t> prompt, free_run;
  for (std::int32_t salt = 0; salt < 40 && prompt.empty(); ++salt) {
    const auto p = prompt_of(kP, 100 + salt);
    const auto out = solo(p, kJ + 4);
    if (std::find(out.begin(), out.begin() + kJ, out[kJ]) == out.begin() + kJ) prompt = p, free_run = out;
  }
  REQUIRE(!prompt.empty());  // a prompt whose token kJ does not occur before it
  const std::vector<std::int32_t> want(free_run.begin(), free_run.begin() + kJ + 1);
  for (const bool overlap : {false, true}) {
    CAPTURE(overlap);
    Cells cache(kCacheConfig);
    llama::HostLlama<Cells> model(kConfig, weights(), cache);
    Exec exec(model, cache, kShift, {.overlap = overlap});
    const SessionId id = exec.sessions().add(prompt, kJ + 4, {.stop_tokens = {free_run[kJ]}}).value();
    REQUIRE(exec.run_until_idle().ok());
    const auto out = exec.sessions().output(id).value();
    CHECK(std::vector<std::int32_t>(out.begin(), out.end()) == want);
    const std::int32_t seq = exec.sessions().sequence_of(id).value();
    const std::int32_t n = exec.sessions().cached_tokens(id).value();
    CHECK(cache.pos(seq).value() == n);
    std::vector<std::int32_t> all(static_cast<std::size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    CHECK(cache.held_positions(seq).value() == all);
    const std::int32_t shifts = exec.sessions().context_shifts(id).value();
    CHECK(shifts == (overlap ? 1 : 0));
    CHECK(n == (overlap ? kBudget - (kBudget - kKeep) / 2 : kBudget));
    CHECK(exec.stats().tokens_discarded == (overlap ? 1 : 0));
  }
}

TEST_CASE("context shift: samples waiting for a leader that shifted share only its kept positions") {
  // A prompt of the whole budget: the leader feeds it in one step; in the next it shifts for its
  // first generated token before its samples take their cells, so they share its first kKeep
  // positions only and feed the rest of the prompt themselves.
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Exec exec(model, cache, kShift);
  const auto prompt = prompt_of(kBudget, 9);
  const SamplingParams sampling{.temperature = 0.9f, .seed = 50};
  const std::vector<SessionId> ids = exec.sessions().add_samples(prompt, 30, sampling, 3).value();
  REQUIRE(exec.step().ok());
  REQUIRE(exec.step().ok());
  REQUIRE(exec.sessions().context_shifts(ids[0]).value() == 1);
  const std::int32_t lead = exec.sessions().sequence_of(ids[0]).value();
  for (const std::size_t i : {std::size_t{1}, std::size_t{2}}) {
    CAPTURE(i);
    CHECK(exec.sessions().leader_of(ids[i]).value() == 0);
    const std::int32_t seq = exec.sessions().sequence_of(ids[i]).value();
    for (std::int32_t p = 0; p < std::min(cache.pos(seq).value(), cache.pos(lead).value()); ++p) {
      CAPTURE(p);
      CHECK((cache.row_of(seq, p) == cache.row_of(lead, p)) == (p < kKeep));
    }
  }
  REQUIRE(exec.run_until_idle().ok());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    CAPTURE(i);
    SamplingParams own = sampling;
    own.seed += i;
    const auto out = exec.sessions().output(ids[i]).value();
    CHECK(std::vector<std::int32_t>(out.begin(), out.end()) == solo(prompt, 30, own));
    check_session(exec, cache, ids[i]);
  }
}

TEST_CASE("context shift with window storage: batched sessions and forks equal their solo runs with full storage") {
  CacheConfig config = kCacheConfig;
  config.max_cells = 800;
  config.window_cells = 8 * (6 + 64 + 24);
  Cells cache(config);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Exec exec(model, cache, kShift);  // overlap on
  const std::int32_t lengths[] = {3, 11, 17};
  const std::int32_t max_new[] = {90, 70, 60};
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 3; ++i)
    ids.push_back(exec.sessions().add(prompt_of(lengths[i], i), max_new[i], test::kSessionSampling[i]).value());
  for (int s = 0; s < 3; ++s) REQUIRE(exec.step().ok());
  const SessionId fork = exec.sessions().clone(ids[2], 80, test::kSessionSampling[4]).value();
  REQUIRE(exec.run_until_idle().ok());
  for (std::int32_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    const auto out = exec.sessions().output(ids[static_cast<std::size_t>(i)]).value();
    CHECK(std::vector<std::int32_t>(out.begin(), out.end()) ==
          solo(prompt_of(lengths[i], i), max_new[i], test::kSessionSampling[i]));
    CHECK(exec.sessions().context_shifts(ids[static_cast<std::size_t>(i)]).value() >= 2);
  }
  const auto f = exec.sessions().output(fork).value();
  CHECK(std::vector<std::int32_t>(f.begin(), f.end()) == solo(prompt_of(17, 2), 80, test::kSessionSampling[4]));
}

TEST_CASE("context shift with window storage: a shift that would need positions a window pool let go of is refused") {
  // Window 50, budget 120, keep 30: at 120 positions the window pool has let go of page 0
  // (positions 0..63); the shift keeps [0, 30) and slides [75, 120) down to [30, 75), so the next
  // token (at 75) would see 26..29 of the kept part through the window: refused, nothing changed.
  using Wide = CellCache<Windows<0, 50>, placement::lowest_free, 16>;
  SessionLimits limits = kShift;
  limits.max_tokens_per_session = 120;
  limits.context_shift.keep = 30;
  Wide cache({.max_write = 24, .max_cells = 600, .max_seqs = 4, .window_cells = 4 * (50 + 64 + 24)});
  llama::HostLlama<Wide> model(kConfig, weights(), cache);
  Executor<llama::HostLlama<Wide>, Wide> exec(model, cache, limits, {.overlap = false});
  const SessionId a = exec.sessions().add(prompt_of(20, 5), 150).value();
  while (exec.sessions().cached_tokens(a).value() < 120) REQUIRE(exec.step().ok());
  const std::int32_t seq = exec.sessions().sequence_of(a).value();
  REQUIRE(cache.pool(50).cell_of(seq, 29) < 0);
  const Wide before = cache;
  const auto table_before = exec.sessions();
  CHECK(exec.step().status() == Errc::window_evicted);
  CHECK(cache == before);
  CHECK(exec.sessions() == table_before);
  CHECK(exec.stats().context_shifts == 0);
}
