// demo.hpp - the main demo, for any backend: a few dozen prompts of varied lengths served through
// the executor with continuous batching (sessions join as others finish; some sessions are forks
// of others, sharing their prompt's cells; every third session samples with a temperature, top-p
// and its own seed, the others are greedy), a live progress line, a summary with a picture of the
// cell map at its fullest, and a solo re-run of a sample of sessions that must produce the same
// tokens as in the batch (exit 1 otherwise): a seeded session draws the same tokens whoever it is
// batched with (in fp32 arithmetic; in bf16 the re-run must match the batch's context shifts and
// length, and the tokens' agreement is reported: check_solo). Context shift: every long_every-th request generates long_max_new tokens, past the
// per-session budget of positions; when its sequence fills the budget the executor keeps the first
// `keep` positions, drops the oldest half of the rest (K of the moved cells re-rotated) and
// generates on. A solo re-run of a shifting session shifts at the same tokens.
#pragma once

#include <cellkv/batching/executor.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <unistd.h>
#include <string>
#include <vector>

#include "llama/config.hpp"

namespace demo {

struct Settings {
  std::int32_t sessions = 36;
  std::int32_t concurrency = 12;  // live sessions at most
  std::int32_t min_prompt = 8, max_prompt = 96;
  std::int32_t max_new = 24;
  std::int32_t long_every = 5;     // requests i with i % long_every == 2 generate long_max_new tokens
  std::int32_t long_max_new = 160;  // past the budget of positions: these sessions shift, some twice
  std::int32_t fork_every = 6;  // every n-th session forks an earlier one
  std::int32_t solo_checks = 6;
  cellkv::batching::SessionLimits limits{.max_write = 64, .min_prefill_tokens = 2, .max_tokens_per_session = 128,
                                         .context_shift = {.enabled = true, .keep = 16}};
};

struct Request {
  std::vector<std::int32_t> prompt;
  std::int32_t max_new = 0;
  std::int32_t fork_of = -1;  // index of the request whose session it forks, or -1
  cellkv::batching::SamplingParams sampling;  // greedy, or seeded sampling
};

// Deterministic prompts of varied lengths; every fork_every-th request forks an earlier one.
inline std::vector<Request> make_requests(const Settings& s, std::int32_t vocab) {
  std::vector<Request> out;
  std::uint64_t x = 12345;
  auto next = [&] { return static_cast<std::int32_t>((x = llama::detail::splitmix64(x)) >> 33); };
  for (std::int32_t i = 0; i < s.sessions; ++i) {
    Request r;
    if (i > 0 && i % s.fork_every == 0) r.fork_of = i - 1 - next() % std::min(i, 4);
    const std::int32_t len = s.min_prompt + next() % (s.max_prompt - s.min_prompt + 1);
    for (std::int32_t t = 0; t < len; ++t) r.prompt.push_back(next() % vocab);
    if (i % 3 == 1) r.sampling = {.temperature = 0.8f, .top_p = 0.9f, .seed = 1000 + static_cast<std::uint64_t>(i)};
    r.max_new = i % s.long_every == 2 ? s.long_max_new : s.max_new;
    out.push_back(std::move(r));
  }
  return out;
}

inline char glyph(std::int32_t seq) {
  static const char kGlyphs[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  return kGlyphs[seq % 62];
}

// The first rows of the cell map: one character per cell (its sequence, '*' when shared, '.' free).
template <class Host>
std::string cell_map(const Host& host, std::int32_t rows) {
  std::string out;
  const auto cells = static_cast<std::int32_t>(std::min<std::int64_t>(host.capacity(), 64LL * rows));
  for (std::int32_t c = 0; c < cells; ++c) {
    if (c % 64 == 0) out += "    ";
    const auto& owners = host.cell_owners(c);
    out += owners.empty() ? '.' : owners.count() > 1 ? '*' : glyph(owners.first());
    if (c % 64 == 63) out += '\n';
  }
  return out;
}

// The live progress line: rewritten in place on a terminal, one line every 25 steps otherwise.
template <class Exec>
void progress(const Exec& exec, std::size_t done, std::size_t total, std::chrono::steady_clock::time_point t0, bool last) {
  static const bool tty = isatty(fileno(stdout)) != 0;
  if (!tty && !last && exec.stats().steps % 25 != 0) return;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s  running %2d  finished %3zu/%zu  steps %5lld  tokens %6lld  %8.0f tokens/s%s", tty ? "\r" : "",
              exec.sessions().live_count(), done, total, static_cast<long long>(exec.stats().steps),
              static_cast<long long>(exec.stats().tokens_generated),
              static_cast<double>(exec.stats().tokens_generated) / secs, tty ? "" : "\n");
  std::fflush(stdout);
}

struct Outcome {
  std::vector<std::vector<std::int32_t>> tokens;  // generated tokens per request
  std::vector<std::int32_t> shifts;               // context shifts per request
};

// What one session alone produced: its tokens and its context shifts.
struct Solo {
  std::vector<std::int32_t> tokens;
  std::int32_t shifts = 0;
};

// Whether a request's session outgrows its budget and shifts.
inline bool shifts(const Request& r, const std::vector<Request>& requests, const Settings& s) {
  const auto& prompt = r.fork_of >= 0 ? requests[static_cast<std::size_t>(r.fork_of)].prompt : r.prompt;
  return s.limits.context_shift.enabled &&
         static_cast<std::int32_t>(prompt.size()) + r.max_new - 1 > s.limits.max_tokens_per_session;
}

// Serves every request through one executor; prints progress and a summary.
template <class Exec, class Host, class Extra>
Outcome serve(Exec& exec, const Host& host, const std::vector<Request>& requests, const Settings& s, Extra&& extra) {
  using cellkv::batching::SessionId;
  Outcome out;
  out.tokens.resize(requests.size());
  out.shifts.resize(requests.size(), 0);
  std::vector<SessionId> id_of(requests.size(), 0);
  std::vector<bool> finished(requests.size(), false);
  std::size_t next = 0, done = 0;
  std::int64_t fullest = -1;
  std::string picture;
  const auto t0 = std::chrono::steady_clock::now();
  while (done < requests.size()) {
    while (next < requests.size() && exec.sessions().live_count() < s.concurrency) {
      const Request& r = requests[next];
      const bool fork = r.fork_of >= 0 && id_of[static_cast<std::size_t>(r.fork_of)] != 0 &&
                        exec.sessions().is_live(id_of[static_cast<std::size_t>(r.fork_of)]);
      // A fork whose source already left runs as a fresh session with the source's prompt.
      const auto& prompt = r.fork_of >= 0 ? requests[static_cast<std::size_t>(r.fork_of)].prompt : r.prompt;
      const auto id = fork ? exec.sessions().clone(id_of[static_cast<std::size_t>(r.fork_of)], r.max_new, r.sampling)
                           : exec.sessions().add(prompt, r.max_new, r.sampling);
      if (!id.ok()) break;
      id_of[next++] = id.value();
    }
    const auto step = exec.step();
    if (!step.ok() && step.status() != cellkv::Errc::empty_step) {
      std::printf("\nstep refused: %s\n", step.status().message().c_str());
      break;
    }
    if (host.capacity() - host.free_cells() > fullest) {
      fullest = host.capacity() - host.free_cells();
      picture = cell_map(host, 8);
    }
    for (std::size_t i = 0; i < requests.size(); ++i) {
      if (finished[i] || id_of[i] == 0) continue;
      const auto state = exec.sessions().state(id_of[i]);
      if (!state.ok() || state.value() != cellkv::batching::SessionState::done) continue;
      const auto toks = exec.sessions().output(id_of[i]).value();
      out.tokens[i].assign(toks.begin(), toks.end());
      out.shifts[i] = exec.sessions().context_shifts(id_of[i]).value();
      (void)exec.sessions().finish(id_of[i]);
      finished[i] = true;
      ++done;
    }
    progress(exec, done, requests.size(), t0, done == requests.size());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& st = exec.stats();
  std::printf("\nsummary\n  %lld steps (%lld of one token: decode method; %lld wider: prefill method) generated %lld tokens and fed %lld, in %.2f s: %.0f tokens/s\n",
              static_cast<long long>(st.steps), static_cast<long long>(st.decode_steps),
              static_cast<long long>(st.prefill_steps), static_cast<long long>(st.tokens_generated),
              static_cast<long long>(st.tokens_fed), secs, static_cast<double>(st.tokens_generated) / secs);
  std::printf("  cells in use at the fullest: %lld of %lld; now %lld\n", static_cast<long long>(fullest),
              static_cast<long long>(host.capacity()), static_cast<long long>(host.capacity() - host.free_cells()));
  if (s.limits.context_shift.enabled) {
    const auto shifted = std::count_if(out.shifts.begin(), out.shifts.end(), [](std::int32_t n) { return n > 0; });
    std::printf("  context shift (budget %d positions, keep %d): %lld shifts in %lld sessions (the long ones generate %d tokens)\n",
                s.limits.max_tokens_per_session, s.limits.context_shift.keep, static_cast<long long>(st.context_shifts),
                static_cast<long long>(shifted), s.long_max_new);
  }
  extra();
  std::printf("  cell map at the fullest (first cells; letter = sequence, * = shared by a fork, . = free):\n%s", picture.c_str());
  return out;
}

// The tokens (and context shifts) of one session run alone through `exec` (a fresh executor).
template <class Exec>
Solo generate_alone(Exec& exec, const std::vector<std::int32_t>& prompt, std::int32_t max_new,
                    const cellkv::batching::SamplingParams& sampling = {}) {
  const auto id = exec.sessions().add(prompt, max_new, sampling);
  if (!id.ok() || !exec.run_until_idle().ok()) return {};
  const auto toks = exec.sessions().output(id.value()).value();
  return {{toks.begin(), toks.end()}, exec.sessions().context_shifts(id.value()).value()};
}

// Re-runs a sample of requests one at a time (solo) and compares with the batched tokens and
// context shifts; a fork runs solo as a fresh session with its source's prompt. The sample holds a
// fork, a sampled session, the first session that shifts, the first fork that shifts, and a spread.
// exact (fp32 arithmetic): a re-run must give the same tokens and shifts. Otherwise (bf16
// arithmetic, where a step's width changes the rounding: cuBLAS in a wide batch, the skinny GEMV
// alone, so a near-tie may flip a token and everything after it) it must give the same number of
// tokens and the same shifts (these depend on positions only), and the tokens' agreement (equal
// tokens up to the first difference) is reported. Returns the number of mismatches.
template <class RunSolo>
int check_solo(const std::vector<Request>& requests, const Outcome& batched, const Settings& s, RunSolo&& run_solo,
               bool exact = true) {
  int mismatches = 0;
  std::printf("\nsolo re-runs (each session alone in a fresh cache):\n");
  const auto n = static_cast<std::int32_t>(requests.size());
  auto first_shifting = [&](bool fork) {
    for (std::int32_t i = 0; i < n; ++i)
      if (shifts(requests[static_cast<std::size_t>(i)], requests, s) && (requests[static_cast<std::size_t>(i)].fork_of >= 0) == fork)
        return i;
    return (5 * n) / 7;
  };
  std::vector<std::int32_t> chosen;
  std::size_t agreed = 0, total = 0;
  for (std::int32_t k = 0; k < std::min(s.solo_checks, n); ++k) {
    std::int32_t i = k == 0 ? s.fork_every : k == 1 ? 1 : k == 2 ? first_shifting(false) : k == 3 ? first_shifting(true)
                                                                                                 : (k * 7 + 1) % n;
    while (std::find(chosen.begin(), chosen.end(), i) != chosen.end()) i = (i + 1) % n;  // each session once
    chosen.push_back(i);
    const Request& r = requests[static_cast<std::size_t>(i)];
    const std::vector<std::int32_t>& prompt = r.fork_of >= 0 ? requests[static_cast<std::size_t>(r.fork_of)].prompt : r.prompt;
    const Solo solo = run_solo(prompt, r.max_new, r.sampling);
    const std::vector<std::int32_t>& in_batch = batched.tokens[static_cast<std::size_t>(i)];
    const bool same_tokens = solo.tokens == in_batch;
    const bool same_shape = solo.tokens.size() == in_batch.size() && solo.shifts == batched.shifts[static_cast<std::size_t>(i)];
    const auto prefix = static_cast<std::size_t>(
        std::mismatch(solo.tokens.begin(), solo.tokens.end(), in_batch.begin(), in_batch.end()).first - solo.tokens.begin());
    agreed += prefix;
    total += in_batch.size();
    const bool ok = same_shape && (same_tokens || !exact);
    mismatches += ok ? 0 : 1;
    char agreement[96] = "";
    if (ok && !same_tokens)
      std::snprintf(agreement, sizeof agreement, "same shifts; tokens equal up to token %zu of %zu", prefix, in_batch.size());
    std::printf("  session %2d%s %s prompt %3zu tokens, %3d generated, %d context shifts: %s\n", i,
                r.fork_of >= 0 ? " (fork)" : "       ", r.sampling.temperature > 0.f ? "sampled" : "greedy ", prompt.size(),
                r.max_new, solo.shifts, !ok ? "MISMATCH" : same_tokens ? "same tokens and shifts as in the batch" : agreement);
  }
  if (!exact)
    std::printf("  tokens equal to the batch's up to the first difference: %zu of %zu (bf16 arithmetic: exact equality "
                "is not promised)\n", agreed, total);
  return mismatches;
}

}  // namespace demo
