// cellkv/batching/session_table.hpp - sessions (a prompt, a generation budget, a way to sample)
// packed into steps.
//
//   cellkv::CellCache<cellkv::Windows<0>> cache({.max_write = 8, .max_cells = 4096});
//   cellkv::batching::SessionTable table(cache, {.max_write = 8, .min_prefill_tokens = 2,
//                                                .max_tokens_per_session = 1024, .vocab = 32000});
//   const auto id = table.add(prompt, 16, {.temperature = 0.7f, .top_p = 0.9f, .seed = 42}).value();
//   const auto ids = table.add_samples(prompt, 16, {.temperature = 0.7f, .seed = 7}, 4).value();  // seeds 7..10
//   while (auto batch = table.next_step()) {          // Errc::empty_step: nothing left to run
//     auto plan = cache.declare_step(batch.value().seqs);
//     ... forward, sample the rows of batch.value().logit_rows ...
//     if (forward_ok) (void)table.accept(sampled); else table.abandon();
//     for (SessionId done : table.reap()) ...;
//   }
//
// A session owns one cache sequence from add/add_samples/clone until finish/reap. Its life:
//   feeding     its prompt goes in, after the `shared` prompt tokens it got from a clone source (0
//               for add), one slice per step; each slice is planned when a step is packed, against
//               the room left in that step (next_step), so a long prompt joins running sessions in
//               chunks that fill the step. A sample waiting for its leader (Samples, below) is
//               feeding too;
//   generating  one token per step: its last sampled token;
//   done        it holds max_new_tokens generated tokens, or its last token is one of its stop
//               tokens (the last token is never fed), no token of it is still on its way, and no
//               sample waits for its prompt cells. It stays in the table, holding its sequence,
//               until finish() or reap().
// Between steps the cache sequence of a session holds exactly its prompt tokens fed so far, then its
// generated tokens but the last, less the positions context shifts dropped: cached_tokens(id) ==
// cache.pos(sequence_of(id)).
//
// Context shift (SessionLimits::context_shift, off by default; docs/design.md section 4, "Context
// shift"): a session's budget B = max_tokens_per_session then bounds its prompt and the positions
// its sequence holds, not what it generates (max_new_tokens may pass B). When next_step packs a
// generating session whose sequence holds B positions (its token would go in at position B), the
// table first shifts it, by llama.cpp's rule: with pos = B and n_discard = (pos - keep) / 2,
//   cache.seq_rm(seq, keep, keep + n_discard); cache.seq_add(seq, keep + n_discard, -1, -n_discard);
// so the sequence keeps positions [0, keep), drops the oldest half of the rest, slides the newer
// half down and holds pos - n_discard positions. The cache re-rotates the moved K rows before the
// next attention (PendingChanges::rotations: HostPool::sync with a RopeSpec on the host path, the
// device cache's key rotation on the GPU), and copies on write the cells it shares with another
// sequence (a clone's or a sample's prompt cells), so no other session changes. A shift depends
// only on the session's position count, never on token values or on the other sessions of a
// batch: it is the same under overlap, and a session run alone shifts at the same tokens (one
// difference changes no token: under overlap, a stop token packed before it is resolved may have
// had its session shifted for it; the shift stays, the token is rewound as usual). Clones
// and waiting samples share only a shifted source's first min(keep, prompt.size() - 1) positions
// (the others no longer hold the prompt). A shift stays done when the step is abandoned or refused
// later. The cell layout only: the sequence layout cannot move rows (validate refuses).
//
// Samples: add_samples(prompt, max_new_tokens, sampling, n) adds n sessions of one prompt, sample i
// drawing with seed sampling.seed + i. The first, the leader, feeds the prompt as add's session
// does. Each other sample *waits*: leader_of(id) names the leader; it holds an empty cache
// sequence, reserved at add_samples so it can never lack one, and takes no tokens. At the start of
// the first next_step after the leader has fed prompt.size() - 1 prompt tokens, the reserved
// sequence is removed and replaced by cache.seq_clone(leader's sequence, prompt.size() - 1): the
// prompt's cells, shared with zero copy on the cell layout (cloning earlier would share only what
// the leader had fed). From then on the sample is a clone like any other: it feeds the last prompt
// token itself (its logits give its own first token) and generates on its own. A leader that is
// finished while samples still wait hands them on: the oldest becomes their leader and feeds the
// prompt itself.
//
// The step protocol: next_step() packs a batch and opens it; the caller declares it to the cache
// (cache.declare_step(batch.seqs)), runs the forward and closes the batch with accept(sampled), or
// with abandon() when the forward failed. While a batch is open the verbs add, add_samples, clone and
// finish are refused with Errc::bad_argument, reap() removes nothing and next_step() is refused with
// Errc::bad_argument: a verb would invalidate the cache's placed step or the batch.
//
// Tokens one step behind (how the executor overlaps steps): accept_pending() closes the open batch
// without the sampled tokens, which stay on the device; each sampled session gets a placeholder.
// The next batch may then feed such a session its placeholder token: StepBatch::deferred names the
// step row and the sampled row of the previous accepted step that holds the id (the forward reads
// it on the device). resolve(sampled) later fills in the placeholders of the oldest accepted step.
// A resolved stop token ends its session; a token sampled for it in a later, already accepted step
// is discarded, and its cache sequence is rewound over the stop token that step fed. output() shows
// resolved tokens only, and a session is done only once nothing of it is on its way.
//
// Every refusal returns a status naming the reason and changes nothing, in the table or the cache
// (strong guarantee); a cache verb is the last thing a table verb does before it commits (next_step
// gives waiting samples their cells only once it can no longer refuse). The table assumes it alone
// adds and removes the sequences of its sessions. Copies of a table are for snapshots (compare with
// ==, which ignores which cache a table drives).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cellkv/batching/sampling.hpp"
#include "cellkv/batching/session_status.hpp"
#include "cellkv/batching/slices.hpp"
#include "cellkv/layout.hpp"
#include "cellkv/position_table_view.hpp"
#include "cellkv/status.hpp"

namespace cellkv::batching {

// Context shift (see "Context shift" above): a generating session whose sequence holds
// max_tokens_per_session positions drops the oldest half of its positions after the first `keep`
// before its next token goes in, and generates on.
struct ContextShift {
  bool enabled = false;
  std::int32_t keep = 0;  // leading positions never dropped (llama.cpp's n_keep: a system prompt)
  friend bool operator==(const ContextShift&, const ContextShift&) = default;
};

// Fixed at construction. max_tokens_per_session bounds prompt + max_new_tokens of every session;
// with a context shift it bounds the prompt and the positions a session's sequence holds instead.
struct SessionLimits {
  std::int32_t max_write = 0;               // widest step, in tokens; <= the cache's max_write
  std::int32_t min_prefill_tokens = 1;      // shortest prefill slice (plan_slices)
  std::int32_t max_tokens_per_session = 0;  // prompt + generated budget of one session
  std::int32_t vocab = 0;  // prompt and stop token ids must lie in [0, vocab); 0: no upper bound
  ContextShift context_shift{};             // off by default
  friend bool operator==(const SessionLimits&, const SessionLimits&) = default;
};

enum class SessionState : std::uint8_t { feeding, generating, done };

// The last token of one session's slice in a step. samples: that row's logits give the session's
// next generated token (its last prompt token when max_new_tokens > 0, or a generating token).
struct LogitRow {
  std::int32_t row = 0;
  SessionId session = 0;
  bool samples = false;
  friend bool operator==(const LogitRow&, const LogitRow&) = default;
};

// The id a batch holds for a token that is still on the device (see DeferredToken).
inline constexpr std::int32_t kPendingToken = -1;

// Token `row` of a step is the token sampled for sampled row number `source` (counting the logit
// rows with samples == true, in row order) of the previous accepted step; tokens[row] holds
// kPendingToken.
struct DeferredToken {
  std::int32_t row = 0;
  std::int32_t source = 0;
  friend bool operator==(const DeferredToken&, const DeferredToken&) = default;
};

// One step: token t is tokens[t] of cache sequence seqs[t]. Each session's tokens are one
// contiguous run in position order ending at its logit row; logit_rows ascend by row; deferred
// ascends by row and is empty when every id is known on the host.
struct StepBatch {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> seqs;
  std::vector<LogitRow> logit_rows;
  std::vector<DeferredToken> deferred{};
  [[nodiscard]] std::int32_t size() const noexcept { return static_cast<std::int32_t>(tokens.size()); }
  friend bool operator==(const StepBatch&, const StepBatch&) = default;
};

// Keep positions < pos of cache sequence seq: undoes an abandoned step or a token fed after a stop
// token (cache.rewind(seq, pos)).
struct RewindPoint {
  std::int32_t seq = 0;
  std::int32_t pos = 0;
  friend bool operator==(const RewindPoint&, const RewindPoint&) = default;
};

// The verbs a table needs: cellkv::KVCache and cellkv::gpu::DeviceCache have them.
template <class C>
concept SessionCache = requires(C& c, std::int32_t s) {
  { c.seq_new() } -> std::same_as<Result<std::int32_t>>;
  { c.seq_clone(s, s) } -> std::same_as<Result<std::int32_t>>;
  { c.seq_rm(s) } -> std::same_as<Status>;
};

// A cache the table can rewind itself (abandon, tokens fed after a stop).
template <class C>
concept RewindableCache = SessionCache<C> && requires(C& c, std::int32_t s) {
  { c.rewind(s, s) } -> std::same_as<Status>;
};

// A cache whose sequences can drop a range of positions and slide the rest down (context shift).
template <class C>
concept ShiftableCache = SessionCache<C> && requires(C& c, std::int32_t s) {
  { c.seq_rm(s, s, s) } -> std::same_as<Status>;
  { c.seq_add(s, s, s, s) } -> std::same_as<Status>;
};

// Why `params` cannot sample from a vocabulary of `vocab` ids (0: no upper bound), or none.
[[nodiscard]] inline SessionErrc check_sampling(const SamplingParams& p, std::int32_t vocab) noexcept {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature)) return SessionErrc::bad_temperature;
  if (p.top_k < 0) return SessionErrc::bad_top_k;
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) return SessionErrc::bad_top_p;
  if (!(p.min_p >= 0.f && p.min_p <= 1.f)) return SessionErrc::bad_min_p;
  for (const std::int32_t t : p.stop_tokens)
    if (t < 0 || (vocab > 0 && t >= vocab)) return SessionErrc::bad_stop_token;
  return SessionErrc::none;
}

namespace detail {

// The object that answers a cache's queries: cache.host() for a device wrapper, else the cache.
template <class C>
[[nodiscard]] const auto& queries_of(const C& cache) noexcept {
  if constexpr (requires { cache.host(); })
    return cache.host();
  else
    return cache;
}

// The most tokens one sequence of the cache can hold, and the refusal detail past it: max_len on
// the sequence layout, the capacity on the cell layout, no bound for a cache that says neither.
struct SequenceRoom {
  std::int64_t tokens = std::numeric_limits<std::int64_t>::max();
  SessionErrc detail = SessionErrc::none;
};
template <class C>
[[nodiscard]] SequenceRoom sequence_room(const C& cache) {
  const auto& q = queries_of(cache);
  using Q = std::remove_cvref_t<decltype(q)>;
  if constexpr (requires { typename Q::Layout; q.config(); q.capacity(); }) {
    if constexpr (requires { q.max_len(); })  // a layout of fixed-length slots
      return {q.max_len(), SessionErrc::exceeds_sequence};
    else
      return {static_cast<std::int64_t>(q.capacity()), SessionErrc::exceeds_cache};
  } else {
    return {};
  }
}

}  // namespace detail

template <SessionCache Cache>
class SessionTable {
 public:
  // Throws std::invalid_argument when validate(limits, cache) refuses.
  SessionTable(Cache& cache, SessionLimits limits) : cache_(&cache), limits_(limits) {
    if (const Status s = validate(limits, cache); !s.ok())
      throw std::invalid_argument("cellkv::batching::SessionTable: invalid SessionLimits (" +
                                  std::string(s.message()) + ")");
  }

  // bad_argument unless max_write >= 1, min_prefill_tokens >= 1, max_tokens_per_session >= 1,
  // vocab >= 0 and (when the cache, or its host(), reports it) max_write <= max_write(). With a
  // context shift, in this order: bad_argument unless 0 <= keep <= max_tokens_per_session - 2 (a
  // shift must drop at least one position) and the cache has seq_rm(id, p0, p1) and seq_add;
  // unsupported_by_layout on the sequence layout (its slots cannot move rows: it refuses seq_add);
  // no_key_rotation for a device cache (or a sharded cache with a shard) whose key rotation is not
  // set (set_key_rotation).
  [[nodiscard]] static Status validate(const SessionLimits& l, const Cache& cache) {
    if (l.max_write < 1 || l.min_prefill_tokens < 1 || l.max_tokens_per_session < 1 || l.vocab < 0)
      return Errc::bad_argument;
    if constexpr (requires { detail::queries_of(cache).max_write(); })
      if (l.max_write > detail::queries_of(cache).max_write()) return Errc::bad_argument;
    if (!l.context_shift.enabled) return {};
    if (l.context_shift.keep < 0 || l.context_shift.keep > l.max_tokens_per_session - 2) return Errc::bad_argument;
    if constexpr (!ShiftableCache<Cache>) {
      return Errc::bad_argument;
    } else {
      if constexpr (requires { detail::queries_of(cache).max_len(); }) return Errc::unsupported_by_layout;
      if constexpr (requires { cache.key_rotation_set(); }) {
        if (!cache.key_rotation_set()) return Errc::no_key_rotation;
      } else if constexpr (requires { cache.shard(0).key_rotation_set(); cache.shards(); }) {  // every shard's
        for (std::int32_t g = 0; g < cache.shards(); ++g)
          if (!cache.shard(g).key_rotation_set()) return Errc::no_key_rotation;
      }
      return {};
    }
  }

  // ---- verbs (between steps) ----

  // A new session feeding `prompt`, then generating up to max_new_tokens tokens drawn as `sampling`
  // says (greedy by default). Refuses, in this order: an empty prompt, max_new_tokens < 0 or an
  // open batch (bad_argument); a prompt token id outside [0, vocab) (bad_argument,
  // token_out_of_vocab); bad sampling parameters (bad_argument, check_sampling's detail);
  // prompt.size() + max_new_tokens > max_tokens_per_session (bad_argument, over_budget; with a
  // context shift prompt.size() > max_tokens_per_session); a session the cache can never hold,
  // prompt.size() + max_new_tokens - 1 tokens (with a context shift at most max_tokens_per_session)
  // past max_len (sequence layout) or the capacity (cell layout) (bad_argument, exceeds_sequence /
  // exceeds_cache); no free cache sequence (no_free_sequence, too_many_sessions; any other refusal
  // of cache.seq_new is passed on).
  SessionResult<SessionId> add(std::span<const std::int32_t> prompt, std::int32_t max_new_tokens,
                               SamplingParams sampling = {}) {
    if (const SessionStatus s = check_new(prompt, max_new_tokens, sampling); !s.ok()) return s;
    Session s = make_session(std::vector<std::int32_t>(prompt.begin(), prompt.end()), max_new_tokens, 0,
                             std::move(sampling));
    sessions_.reserve(sessions_.size() + 1);  // commit cannot throw once the cache has changed
    const Result<std::int32_t> seq = cache_->seq_new();
    if (!seq.ok()) return cache_refusal(seq.status());
    return commit(std::move(s), seq.value());
  }

  // `samples` new sessions of one prompt (parallel sampling), each generating up to max_new_tokens
  // tokens: sample i (i = 0 .. samples - 1) draws as `sampling` says but with seed sampling.seed + i
  // (mod 2^64), so seeded samples differ (greedy ones do not). Returns their ids, ascending, sample 0
  // first. Sample 0, the leader, is the session add(prompt, max_new_tokens, sampling) would make;
  // the others wait for its prompt cells (see "Samples" above), each in a cache sequence reserved
  // now. samples == 1 is add. Refuses, in this order: samples < 1 (bad_argument,
  // bad_sample_count); what add refuses, in add's order; fewer than `samples` free cache sequences
  // (no_free_sequence, too_many_sessions). Needs a cache that reports max_seqs() and live_count() (itself or its
  // host()), so that it refuses before it creates any sequence.
  SessionResult<std::vector<SessionId>> add_samples(std::span<const std::int32_t> prompt, std::int32_t max_new_tokens,
                                                    const SamplingParams& sampling, std::int32_t samples)
    requires requires(const Cache& c) {
      detail::queries_of(c).max_seqs();
      detail::queries_of(c).live_count();
    }
  {
    if (samples < 1) return SessionStatus(Errc::bad_argument, SessionErrc::bad_sample_count);
    if (const SessionStatus s = check_new(prompt, max_new_tokens, sampling); !s.ok()) return s;
    if (free_sequences() < samples) return SessionStatus(Errc::no_free_sequence, SessionErrc::too_many_sessions);
    const auto n = static_cast<std::size_t>(samples);
    std::vector<Session> made;
    made.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      SamplingParams own = sampling;
      own.seed += i;
      made.push_back(make_session(std::vector<std::int32_t>(prompt.begin(), prompt.end()), max_new_tokens, 0,
                                  std::move(own)));
      if (i > 0) made[i].leader = next_id_;  // the id commit gives sample 0
    }
    made[0].waiting = samples - 1;
    std::vector<std::int32_t> seqs;
    std::vector<SessionId> ids;
    seqs.reserve(n);
    ids.reserve(n);
    sessions_.reserve(sessions_.size() + n);  // nothing below throws once the cache has changed
    for (std::size_t i = 0; i < n; ++i) {
      const Result<std::int32_t> seq = cache_->seq_new();
      if (!seq.ok()) {  // not expected: `samples` sequences were free
        for (const std::int32_t made_seq : seqs) (void)cache_->seq_rm(made_seq);
        return cache_refusal(seq.status());
      }
      seqs.push_back(seq.value());
    }
    for (std::size_t i = 0; i < n; ++i) ids.push_back(commit(std::move(made[i]), seqs[i]));
    return ids;
  }

  // A new session with src's prompt, its own budget of max_new_tokens and `sampling` (src's when
  // not given), sharing src's cache positions < shared = min(prompt tokens src has fed,
  // prompt.size() - 1) through cache.seq_clone(src_seq, shared). The clone feeds the rest of the
  // prompt itself (at least the last prompt token, whose logits give its own first token), then
  // generates independently. With window storage (CacheConfig::window_cells), when src's window
  // pools have let go of positions the clone's next token would see (the cache refuses the fork
  // with window_evicted: src generated past its window), no shorter prefix could be shared either:
  // the clone shares nothing and feeds the whole prompt itself, as a session added with it would.
  // Refuses, in this order: unknown src (bad_argument, unknown_session), max_new_tokens < 0 or an
  // open batch (bad_argument), bad sampling parameters, budgets as add, too_many_sessions (as add).
  SessionResult<SessionId> clone(SessionId src, std::int32_t max_new_tokens) {
    const Session* from = find(src);
    if (from == nullptr) return unknown(src);
    return clone(src, max_new_tokens, from->sampling);
  }
  SessionResult<SessionId> clone(SessionId src, std::int32_t max_new_tokens, SamplingParams sampling) {
    const Session* from = find(src);
    if (from == nullptr) return unknown(src);
    if (max_new_tokens < 0 || batch_open()) return Errc::bad_argument;
    if (const SessionErrc e = check_sampling(sampling, limits_.vocab); e != SessionErrc::none)
      return SessionStatus(Errc::bad_argument, e);
    if (const SessionStatus s = check_budget(from->prompt.size(), max_new_tokens); !s.ok()) return s;
    const std::int32_t shared = intact_prefix(*from, std::min(from->fed, prompt_size(*from) - 1));
    const std::int32_t src_seq = from->seq;
    Session s = make_session(from->prompt, max_new_tokens, shared, std::move(sampling));
    sessions_.reserve(sessions_.size() + 1);  // invalidates `from`; not used below
    Result<std::int32_t> seq = cache_->seq_clone(src_seq, shared);
    if (seq.status() == Errc::window_evicted) {
      s.shared = s.fed = 0;
      seq = cache_->seq_new();
    }
    if (!seq.ok()) return cache_refusal(seq.status());
    return commit(std::move(s), seq.value());
  }

  // Ends a live session in any state: removes its cache sequence and drops it from the table (its
  // tokens still on their way are dropped when they are resolved). A leader whose samples still
  // wait hands them on: the oldest of them stops waiting and feeds the prompt itself, in its
  // reserved sequence, and the others wait for it. Refuses: an unknown id (bad_argument,
  // unknown_session); an open batch (bad_argument); a refusal of cache.seq_rm.
  SessionStatus finish(SessionId id) {
    const auto it = locate(id);
    if (it == sessions_.end()) return unknown(id);
    if (batch_open()) return Errc::bad_argument;
    if (const Status s = cache_->seq_rm(it->seq); !s.ok()) return s;
    detach(*it);
    sessions_.erase(it);
    return {};
  }

  // Finishes every done session; returns their ids, ascending. Removes nothing while a batch is
  // open; a session whose cache.seq_rm is refused stays in the table.
  std::vector<SessionId> reap() {
    std::vector<SessionId> reaped;
    if (batch_open()) return reaped;
    std::vector<Session> kept;
    kept.reserve(sessions_.size());
    reaped.reserve(sessions_.size());
    for (Session& s : sessions_) {
      if (state_of(s) == SessionState::done && cache_->seq_rm(s.seq).ok())
        reaped.push_back(s.id);
      else
        kept.push_back(std::move(s));
    }
    sessions_ = std::move(kept);
    return reaped;
  }

  // ---- the step ----

  // Packs one step of at most max_write tokens and opens it. `room` starts at max_write;
  //  1. one token of every generating session with tokens left to generate (fewer than
  //     max_new_tokens generated or on their way, no stop token), oldest first, while room > 0
  //     (room -= 1 each); a token still on the device goes in as a DeferredToken; then each of
  //     them whose sequence holds max_tokens_per_session positions is shifted (context shift);
  //  2. every sample waiting for a leader that has fed prompt.size() - 1 prompt tokens gets its
  //     cells: its reserved sequence is removed, then cache.seq_clone(leader's sequence,
  //     prompt.size() - 1) takes its place (abandon() does not undo this);
  //  3. then one prompt slice of every feeding session not waiting for its leader, oldest first,
  //     planned now against the room left: first_slice(r, room, min_prefill_tokens), i.e.
  //     plan_slices(r, room, min_prefill_tokens).front(), where r = its prompt tokens not yet fed.
  //     That is a prefill of L = min(r, room) tokens when L > 1 and L >= min_prefill_tokens, else
  //     one (decode) token. Short room: when 0 < room < min_prefill_tokens <= max_write and
  //     r >= min_prefill_tokens (the room, not the prompt, makes the slice one token, and a later
  //     step can give a prefill), the session is fed its one token only if the step holds no prompt
  //     token yet; otherwise it waits for the next step. Packing stops at the first feeding session
  //     that gets nothing (room == 0, or it waits for the next step): feeding is first in, first
  //     out, a younger session never passes an older one.
  // No starvation: a step in which fewer than max_write sessions generate feeds the oldest feeding
  // session not waiting for its leader at least one token. So when that holds throughout (e.g. a
  // cache of at most max_write sequences), a session is fed completely within T accepted steps,
  // T = the prompt tokens left to feed when it was added, its own and those of the older feeding
  // sessions (a sample's leader is older than it).
  // `width` (0: max_write) packs a narrower step, as if max_write were width: schedules of chosen
  // widths (tests, latency caps).
  // Refuses, before step 1's shifts change anything: an open batch, width outside [0, max_write],
  // or a token to feed that is on its way from an accepted step older than the last (resolve that
  // step first) (bad_argument); then a shift the cache cannot make (out_of_cells: the copies on
  // write of shared cells do not fit; out_of_pages: the position table's free pages may not
  // suffice; any refusal of the cache's seq_rm), before that session's
  // shift changes anything (earlier sessions' shifts stay done); no session with work (empty_step;
  // never after a sample got its cells). Does not call cache.declare_step.
  Result<StepBatch> next_step(std::int32_t width = 0) {
    if (batch_open() || width < 0 || width > limits_.max_write) return Errc::bad_argument;
    StepBatch batch;
    std::vector<Entry> entries;
    std::int32_t room = width == 0 ? limits_.max_write : width;
    for (const Session& s : sessions_) {
      if (room == 0) break;
      if (!decodes(s)) continue;
      if (on_its_way(s)) {
        if (s.source_step != accepted_steps_) return Errc::bad_argument;
        batch.deferred.push_back({batch.size(), s.source_row});
      }
      append(batch, entries, s, std::span<const std::int32_t>(&s.output.back(), 1), false, true);
      --room;
    }
    if (limits_.context_shift.enabled)
      for (const Entry& e : entries) {
        Session& s = *locate(e.id);
        if (needs_shift(s))
          if (const Status st = shift(s); !st.ok()) return st.code();
      }
    adopt_waiting_samples();  // a sample that gets its cells feeds now: no refusal below
    bool fed_prompt = false;  // the step holds a prompt token
    for (const Session& s : sessions_) {
      if (state_of(s) != SessionState::feeding || s.leader != 0) continue;
      if (room == 0 || (fed_prompt && waits_for_room(s, room))) break;
      const std::int32_t length = slice_length(s, room);
      append(batch, entries, s, std::span<const std::int32_t>(s.prompt).subspan(static_cast<std::size_t>(s.fed),
                                                                                static_cast<std::size_t>(length)),
             true, slice_samples(s, length));
      room -= length;
      fed_prompt = true;
    }
    if (batch.tokens.empty()) return Errc::empty_step;
    open_batch_ = std::move(entries);
    return batch;
  }

  // The SampleRow of every logit row of the open batch with samples == true, in row order (the
  // session's sampling and the index of the token drawn). Call between next_step and accept.
  void sample_rows(const StepBatch& batch, std::vector<SampleRow>& out) const {
    out.clear();
    for (const LogitRow& r : batch.logit_rows) {
      if (!r.samples) continue;
      const Session* s = find(r.session);
      out.push_back(s == nullptr ? SampleRow{} : with_counter(s->sample_row, s->output.size()));
    }
  }

  // Closes the open batch with its sampled tokens: `sampled` holds one token per logit row with
  // samples == true, in row order (`logprobs` the same count, or empty). Advances each session of
  // the batch (prompt fed, tokens generated); a session that reaches max_new_tokens or samples a
  // stop token becomes done. Refuses (bad_argument): no open batch, an accepted step not yet
  // resolved, a count that does not match, or a token outside [0, vocab).
  Status accept(std::span<const std::int32_t> sampled, std::span<const float> logprobs = {}) {
    if (!batch_open() || !pending_.empty() || sampled.size() != samples_in_batch()) return Errc::bad_argument;
    if (const Status s = check_sampled(sampled, logprobs); !s.ok()) return s;
    (void)accept_pending();
    return resolve(sampled, logprobs);
  }

  // Closes the open batch without its tokens: they stay on their way (placeholders) until
  // resolve(). Refuses (bad_argument) when no batch is open.
  Status accept_pending() {
    if (!batch_open()) return Errc::bad_argument;
    ++accepted_steps_;
    PendingStep step;
    std::int32_t k = 0;
    for (const Entry& e : open_batch_) {
      Session& s = *locate(e.id);
      if (e.prompt) s.fed += e.length;
      if (!e.samples) continue;
      step.samples.push_back({s.id, static_cast<std::int32_t>(s.output.size())});
      s.output.push_back(kPendingToken);
      if (s.sampling.logprobs) s.logprobs.push_back(0.f);
      s.source_step = accepted_steps_;
      s.source_row = k++;
    }
    pending_.push_back(std::move(step));
    open_batch_.clear();
    return {};
  }

  // Fills in the tokens of the oldest accepted step still on its way: `sampled` (and `logprobs`,
  // or empty) hold one entry per sampled row of that step, in row order. A session finished since
  // is skipped. A stop token ends its session: the token sampled for it in a later accepted step
  // is discarded and its sequence rewound over the stop token that step fed (by the table on a
  // RewindableCache; returned by rewind_points() otherwise). Refuses (bad_argument): nothing on its
  // way, a count that does not match, or a token outside [0, vocab).
  Status resolve(std::span<const std::int32_t> sampled, std::span<const float> logprobs = {}) {
    if (pending_.empty() || sampled.size() != pending_.front().samples.size()) return Errc::bad_argument;
    if (const Status s = check_sampled(sampled, logprobs); !s.ok()) return s;
    rewinds_.clear();
    const PendingStep step = std::move(pending_.front());
    pending_.erase(pending_.begin());
    for (std::size_t k = 0; k < step.samples.size(); ++k) {
      const auto it = locate(step.samples[k].session);
      const auto index = static_cast<std::size_t>(step.samples[k].index);
      if (it == sessions_.end() || index >= it->output.size()) continue;
      Session& s = *it;
      s.output[index] = sampled[k];
      if (s.sampling.logprobs && !logprobs.empty()) s.logprobs[index] = logprobs[k];
      s.resolved = static_cast<std::int32_t>(index) + 1;
      if (!s.stopped && is_stop(s, sampled[k])) cut_after(s, index + 1);
    }
    return {};
  }

  // Drops the tokens of the oldest accepted step still on its way (they were lost: the device
  // failed): each session of it loses that token and any later one (a later accepted step's
  // entries for it are forgotten, so their resolve skips them), and is rewound to match, as after
  // a stop token. A session that loses its first generated token goes back to feeding its last
  // prompt token, whose logits gave it (the prompt tokens before it stay fed). Nothing when
  // nothing is on its way.
  void discard_pending() {
    if (pending_.empty()) return;
    rewinds_.clear();
    const PendingStep step = std::move(pending_.front());
    pending_.erase(pending_.begin());
    for (const PendingSample& p : step.samples) {
      const auto it = locate(p.session);
      if (it != sessions_.end() && static_cast<std::size_t>(p.index) < it->output.size())
        cut_after(*it, static_cast<std::size_t>(p.index));
    }
  }

  // Drops the open batch (the forward failed); every session stays where it was. Returns, for
  // each session of the batch in row order, the position its cache sequence must be rewound to; when
  // the cache has rewind(seq, pos) (RewindableCache) abandon() has already done it, so the cache is
  // as before cache.declare_step(batch.seqs) (a no-op when the step was never declared). Returns
  // nothing and changes nothing when no batch is open.
  std::vector<RewindPoint> abandon() {
    std::vector<RewindPoint> points;
    if (!batch_open()) return points;
    for (const Entry& e : open_batch_) {
      const Session& s = *find(e.id);
      points.push_back({s.seq, cached(s)});
    }
    if constexpr (RewindableCache<Cache>)
      for (const RewindPoint& p : points) (void)cache_->rewind(p.seq, p.pos);
    open_batch_.clear();
    return points;
  }

  // ---- queries ----
  // Each refuses an id that is no live session's with (bad_argument, unknown_session).

  [[nodiscard]] bool is_live(SessionId id) const noexcept { return find(id) != nullptr; }
  [[nodiscard]] SessionResult<SessionState> state(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return state_of(*s);
  }
  // Tokens generated so far and resolved; the span is valid until the next accept, resolve,
  // finish or reap.
  [[nodiscard]] SessionResult<std::span<const std::int32_t>> output(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return std::span<const std::int32_t>(s->output).first(static_cast<std::size_t>(s->resolved));
  }
  // The log-probabilities of output(id), when its sampling asked for them (else empty).
  [[nodiscard]] SessionResult<std::span<const float>> logprobs(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    if (!s->sampling.logprobs) return std::span<const float>();
    return std::span<const float>(s->logprobs).first(static_cast<std::size_t>(s->resolved));
  }
  [[nodiscard]] SessionResult<std::span<const std::int32_t>> prompt(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return std::span<const std::int32_t>(s->prompt);
  }
  [[nodiscard]] SessionResult<std::int32_t> max_new_tokens(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return s->max_new;
  }
  [[nodiscard]] SessionResult<SamplingParams> sampling(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return s->sampling;
  }
  [[nodiscard]] SessionResult<std::int32_t> sequence_of(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return s->seq;
  }
  // Tokens the session's cache sequence holds between steps (shared prefix included): what
  // cache.pos(sequence_of(id)) is outside a step.
  [[nodiscard]] SessionResult<std::int32_t> cached_tokens(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return cached(*s);
  }
  // The leader whose prompt cells a waiting sample will share (add_samples); 0 when the session
  // does not wait (a leader, a sample that has its cells, any other session).
  [[nodiscard]] SessionResult<SessionId> leader_of(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return s->leader;
  }
  // The live session holding cache sequence `seq`, or 0.
  [[nodiscard]] SessionId session_of_sequence(std::int32_t seq) const noexcept {
    for (const Session& s : sessions_)
      if (s.seq == seq) return s.id;
    return 0;
  }
  // Live session ids, oldest first.
  [[nodiscard]] std::vector<SessionId> sessions() const {
    std::vector<SessionId> ids;
    for (const Session& s : sessions_) ids.push_back(s.id);
    return ids;
  }
  [[nodiscard]] std::int32_t live_count() const noexcept { return static_cast<std::int32_t>(sessions_.size()); }
  [[nodiscard]] std::int32_t feeding_count() const noexcept { return count(SessionState::feeding); }
  [[nodiscard]] std::int32_t generating_count() const noexcept { return count(SessionState::generating); }
  [[nodiscard]] std::int32_t done_count() const noexcept { return count(SessionState::done); }
  // Samples waiting for their leader (counted in feeding_count()).
  [[nodiscard]] std::int32_t waiting_count() const noexcept {
    return static_cast<std::int32_t>(
        std::count_if(sessions_.begin(), sessions_.end(), [](const Session& s) { return s.leader != 0; }));
  }
  // A batch is open: between next_step and accept, accept_pending or abandon.
  [[nodiscard]] bool in_flight() const noexcept { return batch_open(); }
  // Accepted steps whose tokens are still on their way, and the sampled rows of the oldest one.
  [[nodiscard]] std::int32_t pending_steps() const noexcept { return static_cast<std::int32_t>(pending_.size()); }
  [[nodiscard]] std::int32_t pending_samples() const noexcept {
    return pending_.empty() ? 0 : static_cast<std::int32_t>(pending_.front().samples.size());
  }
  // Context shifts of one session so far, and of every session since the table was made.
  [[nodiscard]] SessionResult<std::int32_t> context_shifts(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return unknown(id);
    return s->shifts;
  }
  [[nodiscard]] std::int64_t context_shifts() const noexcept { return shifts_; }
  // Tokens sampled after their session's stop token and discarded, since the table was made.
  [[nodiscard]] std::int64_t discarded_tokens() const noexcept { return discarded_; }
  // The rewinds of the last resolve or discard_pending (done already on a RewindableCache).
  [[nodiscard]] const std::vector<RewindPoint>& rewind_points() const noexcept { return rewinds_; }
  [[nodiscard]] const SessionLimits& limits() const noexcept { return limits_; }
  // Cache sequences not live (held by this table or anyone else), when the cache (or its host())
  // reports max_seqs() and live_count().
  [[nodiscard]] std::int32_t free_sequences() const
    requires requires(const Cache& c) {
      detail::queries_of(c).max_seqs();
      detail::queries_of(c).live_count();
    }
  {
    const auto& q = detail::queries_of(*cache_);
    return q.max_seqs() - q.live_count();
  }

  // Same sessions, states, outputs, id counter, limits, open batch and tokens on their way; the
  // cache is not compared.
  friend bool operator==(const SessionTable& a, const SessionTable& b) {
    return a.limits_ == b.limits_ && a.next_id_ == b.next_id_ && a.sessions_ == b.sessions_ &&
           a.open_batch_ == b.open_batch_ && a.pending_ == b.pending_ && a.accepted_steps_ == b.accepted_steps_ &&
           a.discarded_ == b.discarded_ && a.shifts_ == b.shifts_;
  }

 private:
  struct Session {
    SessionId id = 0;
    std::int32_t seq = 0;
    std::vector<std::int32_t> prompt;
    std::int32_t max_new = 0;
    std::int32_t shared = 0;  // prompt tokens inherited from a clone source
    std::int32_t fed = 0;     // prompt tokens in the cache, shared ones included
    std::vector<std::int32_t> output;  // generated; [resolved, size) are placeholders on their way
    std::vector<float> logprobs;       // parallel to output when sampling.logprobs
    std::int32_t resolved = 0;
    std::int32_t dropped = 0;          // positions context shifts removed from the sequence
    std::int32_t shifts = 0;           // context shifts so far
    bool stopped = false;              // output.back() is a stop token
    std::uint64_t source_step = 0;     // the accepted step that sampled output.back()
    std::int32_t source_row = 0;       // ... and its sampled row there
    SamplingParams sampling;
    SampleRow sample_row;              // make_sample_row(sampling, 0)
    SessionId leader = 0;              // a waiting sample: whose prompt cells it will share; else 0
    std::int32_t waiting = 0;          // samples waiting for this session's prompt cells
    friend bool operator==(const Session&, const Session&) = default;
  };
  // One session's share of the open batch.
  struct Entry {
    SessionId id = 0;
    std::int32_t length = 0;
    bool prompt = false;
    bool samples = false;
    friend bool operator==(const Entry&, const Entry&) = default;
  };
  // A token on its way: output[index] of a session.
  struct PendingSample {
    SessionId session = 0;
    std::int32_t index = 0;
    friend bool operator==(const PendingSample&, const PendingSample&) = default;
  };
  // An accepted step whose tokens are on their way, one entry per sampled row in row order.
  struct PendingStep {
    std::vector<PendingSample> samples;
    friend bool operator==(const PendingStep&, const PendingStep&) = default;
  };

  [[nodiscard]] bool batch_open() const noexcept { return !open_batch_.empty(); }
  [[nodiscard]] bool in_vocab(std::int32_t t) const noexcept { return t >= 0 && (limits_.vocab == 0 || t < limits_.vocab); }
  [[nodiscard]] static std::int32_t prompt_size(const Session& s) noexcept {
    return static_cast<std::int32_t>(s.prompt.size());
  }
  [[nodiscard]] static std::int32_t generated(const Session& s) noexcept {
    return static_cast<std::int32_t>(s.output.size());
  }
  [[nodiscard]] static bool on_its_way(const Session& s) noexcept { return s.resolved < generated(s); }
  // Fed completely, no stop token, fewer than max_new tokens generated or on their way.
  [[nodiscard]] static bool decodes(const Session& s) noexcept {
    return s.fed >= prompt_size(s) && !s.stopped && generated(s) < s.max_new;
  }
  [[nodiscard]] static SessionState state_of(const Session& s) noexcept {
    if (s.fed < prompt_size(s)) return SessionState::feeding;
    return decodes(s) || on_its_way(s) || s.waiting > 0 ? SessionState::generating : SessionState::done;
  }
  // The prompt fed so far, then the generated tokens but the last (never fed), less the positions
  // context shifts dropped.
  [[nodiscard]] static std::int32_t cached(const Session& s) noexcept {
    return s.fed + std::max(0, generated(s) - 1) - s.dropped;
  }
  // The leading positions of s's sequence that still hold its prompt's first tokens, of `upto`
  // wanted: a shifted sequence keeps only its first `keep`.
  [[nodiscard]] std::int32_t intact_prefix(const Session& s, std::int32_t upto) const noexcept {
    return s.shifts > 0 ? std::min(upto, limits_.context_shift.keep) : upto;
  }
  // A generating session whose next token would pass its budget.
  [[nodiscard]] bool needs_shift(const Session& s) const noexcept {
    return limits_.context_shift.enabled && cached(s) >= limits_.max_tokens_per_session;
  }
  [[nodiscard]] static bool is_stop(const Session& s, std::int32_t token) noexcept {
    return std::find(s.sampling.stop_tokens.begin(), s.sampling.stop_tokens.end(), token) != s.sampling.stop_tokens.end();
  }
  [[nodiscard]] static SampleRow with_counter(SampleRow r, std::size_t counter) noexcept {
    r.counter = static_cast<std::uint32_t>(counter);
    return r;
  }
  // Length of a feeding session's next prompt slice when `room` (>= 1) tokens are left in the step.
  [[nodiscard]] std::int32_t slice_length(const Session& s, std::int32_t room) const noexcept {
    return first_slice(prompt_size(s) - s.fed, room, limits_.min_prefill_tokens).length;
  }
  // Whether the logits of a feeding session's slice of `length` tokens give a generated token.
  [[nodiscard]] static bool slice_samples(const Session& s, std::int32_t length) noexcept {
    return s.fed + length == prompt_size(s) && s.max_new > 0;
  }
  // next_step's short-room rule: only the short room makes the slice one token, and a later step can
  // give a prefill.
  [[nodiscard]] bool waits_for_room(const Session& s, std::int32_t room) const noexcept {
    const std::int32_t min = limits_.min_prefill_tokens;
    return room < min && min <= limits_.max_write && prompt_size(s) - s.fed >= min;
  }

  // add's refusals but the cache's, in add's order.
  [[nodiscard]] SessionStatus check_new(std::span<const std::int32_t> prompt, std::int32_t max_new_tokens,
                                        const SamplingParams& sampling) const {
    if (prompt.empty() || max_new_tokens < 0 || batch_open()) return Errc::bad_argument;
    for (const std::int32_t t : prompt)
      if (!in_vocab(t)) return SessionStatus(Errc::bad_argument, SessionErrc::token_out_of_vocab);
    if (const SessionErrc e = check_sampling(sampling, limits_.vocab); e != SessionErrc::none)
      return SessionStatus(Errc::bad_argument, e);
    return check_budget(prompt.size(), max_new_tokens);
  }
  // Budgets: past max_tokens_per_session (the prompt alone with a context shift), or more tokens
  // than one sequence of the cache holds (at most the budget with a context shift).
  [[nodiscard]] SessionStatus check_budget(std::size_t prompt_tokens, std::int32_t max_new_tokens) const {
    const auto budget = static_cast<std::size_t>(limits_.max_tokens_per_session);
    const bool shifts = limits_.context_shift.enabled;
    if (prompt_tokens > budget || (!shifts && static_cast<std::size_t>(max_new_tokens) > budget - prompt_tokens))
      return SessionStatus(Errc::bad_argument, SessionErrc::over_budget);
    const detail::SequenceRoom room = detail::sequence_room(*cache_);
    auto held = static_cast<std::int64_t>(prompt_tokens) + std::max(0, max_new_tokens - 1);
    if (shifts) held = std::min<std::int64_t>(held, limits_.max_tokens_per_session);
    if (held > room.tokens) return SessionStatus(Errc::bad_argument, room.detail);
    return {};
  }
  // The table's reason for a refused cache verb: no_free_sequence gains the detail too_many_sessions.
  [[nodiscard]] static SessionStatus cache_refusal(Status s) noexcept {
    if (s == Errc::no_free_sequence) return {Errc::no_free_sequence, SessionErrc::too_many_sessions};
    return s;
  }
  [[nodiscard]] static SessionStatus unknown(SessionId id) noexcept {
    return {Errc::bad_argument, SessionErrc::unknown_session, id};
  }
  [[nodiscard]] Status check_sampled(std::span<const std::int32_t> sampled, std::span<const float> logprobs) const {
    if (!logprobs.empty() && logprobs.size() != sampled.size()) return Errc::bad_argument;
    for (const std::int32_t t : sampled)
      if (!in_vocab(t)) return Errc::bad_argument;
    return {};
  }

  // Keeps output[0, keep) of s: drops the later tokens (resolved or on their way) and the accepted
  // steps' entries for them, marks s stopped when its last kept token is a stop token, and rewinds
  // its sequence over the dropped tokens it fed. Keeping none of at least one token unfeeds the
  // last prompt token too (the next step feeds it again to sample token 0 anew).
  void cut_after(Session& s, std::size_t keep) {
    const std::int32_t before = cached(s);
    if (keep == 0 && !s.output.empty()) --s.fed;  // output[0] came from the last prompt token's logits
    discarded_ += static_cast<std::int64_t>(s.output.size() - keep);
    forget_pending(s.id, keep);
    s.output.resize(keep);
    if (s.sampling.logprobs) s.logprobs.resize(keep);
    s.resolved = std::min(s.resolved, static_cast<std::int32_t>(keep));
    s.stopped = keep > 0 && static_cast<std::int32_t>(keep) == s.resolved && is_stop(s, s.output.back());
    const std::int32_t after = cached(s);
    if (after == before) return;
    rewinds_.push_back({s.seq, after});
    if constexpr (RewindableCache<Cache>) (void)cache_->rewind(s.seq, after);
  }

  // Makes the pending steps' entries for output[keep, ...) of session `id` point at no session (id 0:
  // ids start at 1), so resolve skips them (a step's row count never changes) even once the output
  // grows again.
  void forget_pending(SessionId id, std::size_t keep) {
    for (PendingStep& step : pending_)
      for (PendingSample& p : step.samples)
        if (p.session == id && static_cast<std::size_t>(p.index) >= keep) p.session = 0;
  }

  // The context shift of s (see "Context shift" above): pos = cached(s), n_discard = (pos - keep) / 2
  // (>= 1: validate keeps keep <= budget - 2). Refuses, changing nothing, what room_for_shift
  // refuses (out_of_pages, out_of_cells) or the cache's refusal of seq_rm. The seq_add after it
  // cannot be refused then (a logic_error if it is).
  Status shift(Session& s) {
    if constexpr (ShiftableCache<Cache>) {
      const std::int32_t pos = cached(s), keep = limits_.context_shift.keep, n_discard = (pos - keep) / 2;
      if (const Status st = room_for_shift(s.seq, keep, keep + n_discard, pos); !st.ok()) return st;
      if (const Status st = cache_->seq_rm(s.seq, keep, keep + n_discard); !st.ok()) return st;
      if (!cache_->seq_add(s.seq, keep + n_discard, -1, -n_discard).ok())
        throw std::logic_error("cellkv::batching::SessionTable: the cache refused a context shift's seq_add");
      s.dropped += n_discard;
      ++s.shifts;
      ++shifts_;
      return {};
    } else {
      return Errc::bad_argument;  // unreachable: validate refuses a context shift on such a cache
    }
  }
  // Whether the cache has the fresh cells seq_add needs after seq_rm(seq, keep, moved) released the
  // cells only seq held: one per cell in [moved, pos) that seq shares (copy on write); and, where
  // the cache reports its position table, free pages for a private copy of every page of [keep,
  // pos) and a split for each verb (an upper bound: out_of_pages may refuse a shift that would
  // have fit). A cache that does not report its cells is trusted.
  [[nodiscard]] Status room_for_shift(std::int32_t seq, std::int32_t keep, std::int32_t moved, std::int32_t pos) const {
    const auto& q = detail::queries_of(*cache_);
    if constexpr (requires { q.table().free_pages(); }) {
      if (shift_pages(keep, pos) > q.table().free_pages()) return Errc::out_of_pages;
    }
    if constexpr (requires { q.cell_of(seq, pos); q.cell_owners(seq).count(); q.free_cells(); }) {
      if (!room_for_copies(q, seq, keep, moved, pos)) return Errc::out_of_cells;
    }
    if constexpr (requires { q.pool(0); }) {
      // Window storage: each window pool must hold what the shifted sequence's next token sees (the
      // kept positions below `keep` it sees are not moved) and have the pages and the copies' cells.
      using Windows = typename std::remove_cvref_t<decltype(q)>::Windows;
      const std::int32_t len = pos - (moved - keep);
      for (const std::int32_t w : Windows::kWindowed) {
        if (!has_window_storage(q)) break;
        const auto& pool = q.pool(w);
        for (std::int32_t p = std::max(0, std::min(len - w + 1, len - 1)); p < len; ++p) {
          const std::int32_t from = p < keep ? p : p + (moved - keep);
          if (q.cell_of(seq, from) >= 0 && pool.cell_of(seq, from) < 0) return Errc::window_evicted;
        }
        if (shift_pages(keep, pos) > pool.table().free_pages()) return Errc::out_of_pages;
        if (!room_for_copies(pool, seq, keep, moved, pos)) return Errc::out_of_window_cells;
      }
    }
    return {};
  }
  // Pages a shift of [keep, pos) may need in a position table: a private copy of each page of the
  // range and a split for each verb (an upper bound).
  [[nodiscard]] static std::int32_t shift_pages(std::int32_t keep, std::int32_t pos) {
    return (pos - 1) / kPagePositions - keep / kPagePositions + 1 + 2;
  }
  // Whether `pool` (a cache's, or one of its window pools) has a cell for every cell of seq in
  // [moved, pos) that seq shares (copied on write by the shift's seq_add), counting the cells of
  // [keep, moved) only seq holds (freed by its seq_rm first).
  template <class Pool>
  [[nodiscard]] static bool room_for_copies(const Pool& pool, std::int32_t seq, std::int32_t keep, std::int32_t moved,
                                            std::int32_t pos) {
    std::int64_t available = pool.free_cells(), fresh = 0;
    for (std::int32_t p = keep; p < pos; ++p) {
      const std::int32_t c = pool.cell_of(seq, p);
      if (c < 0) continue;
      const bool shared = pool.cell_owners(c).count() > 1;
      if (p < moved && !shared) ++available;
      if (p >= moved && shared) ++fresh;
    }
    return fresh <= available;
  }

  // A session without id or sequence yet, feeding the prompt after the shared prefix.
  [[nodiscard]] static Session make_session(std::vector<std::int32_t> prompt, std::int32_t max_new, std::int32_t shared,
                                            SamplingParams sampling) {
    Session s;
    s.prompt = std::move(prompt);
    s.max_new = max_new;
    s.shared = shared;
    s.fed = shared;
    s.sample_row = make_sample_row(sampling, 0);
    s.sampling = std::move(sampling);
    return s;
  }
  // Gives each waiting sample whose leader has fed prompt.size() - 1 prompt tokens its share of the
  // leader's cells: its reserved, empty sequence is removed, then replaced by a clone of the
  // leader's positions < prompt.size() - 1 (the leader's sequence holds at least the prompt tokens
  // it fed). The freed id leaves the clone a sequence; a cache that refuses the clone anyway gets
  // the reservation back and the sample waits another step, unless the refusal is window_evicted
  // (window storage: the leader generated past its window, and no later clone could share the
  // prompt either): then the sample stops waiting and feeds the whole prompt itself.
  void adopt_waiting_samples() {
    for (Session& s : sessions_) {
      if (s.leader == 0) continue;
      Session& leader = *locate(s.leader);
      const std::int32_t shared = intact_prefix(leader, prompt_size(leader) - 1);
      if (leader.fed < shared) continue;
      (void)cache_->seq_rm(s.seq);
      const Result<std::int32_t> seq = cache_->seq_clone(leader.seq, shared);
      if (!seq.ok()) {
        s.seq = reserve_again();
        if (seq.status() == Errc::window_evicted) {
          s.leader = 0;
          --leader.waiting;
        }
        continue;
      }
      s.seq = seq.value();
      s.shared = shared;
      s.fed = shared;
      s.leader = 0;
      --leader.waiting;
    }
  }
  // A new reservation for a sample whose clone the cache refused.
  [[nodiscard]] std::int32_t reserve_again() {
    const Result<std::int32_t> seq = cache_->seq_new();
    if (!seq.ok())
      throw std::logic_error("cellkv::batching::SessionTable: the cache refused a sequence it had just freed");
    return seq.value();
  }
  // Unlinks a session that leaves the table from its leader or its waiting samples: a leaving
  // leader's oldest waiting sample stops waiting (it feeds the prompt itself) and leads the others.
  void detach(const Session& gone) {
    if (gone.leader != 0) --locate(gone.leader)->waiting;
    if (gone.waiting == 0) return;
    Session* heir = nullptr;
    for (Session& s : sessions_) {
      if (s.leader != gone.id) continue;
      if (heir == nullptr) {
        heir = &s;
        s.leader = 0;
        s.waiting = gone.waiting - 1;
      } else {
        s.leader = heir->id;
      }
    }
  }

  SessionId commit(Session s, std::int32_t seq) {
    s.id = next_id_++;
    s.seq = seq;
    sessions_.push_back(std::move(s));
    return sessions_.back().id;
  }

  static void append(StepBatch& batch, std::vector<Entry>& entries, const Session& s,
                     std::span<const std::int32_t> tokens, bool prompt, bool samples) {
    batch.tokens.insert(batch.tokens.end(), tokens.begin(), tokens.end());
    batch.seqs.insert(batch.seqs.end(), tokens.size(), s.seq);
    batch.logit_rows.push_back({batch.size() - 1, s.id, samples});
    entries.push_back({s.id, static_cast<std::int32_t>(tokens.size()), prompt, samples});
  }
  [[nodiscard]] std::size_t samples_in_batch() const noexcept {
    return static_cast<std::size_t>(std::count_if(open_batch_.begin(), open_batch_.end(), [](const Entry& e) { return e.samples; }));
  }

  // Sessions are kept in id order (ids only grow), so lookups are binary searches.
  [[nodiscard]] typename std::vector<Session>::iterator locate(SessionId id) noexcept {
    const auto it = std::lower_bound(sessions_.begin(), sessions_.end(), id,
                                     [](const Session& s, SessionId v) { return s.id < v; });
    return it != sessions_.end() && it->id == id ? it : sessions_.end();
  }
  [[nodiscard]] const Session* find(SessionId id) const noexcept {
    const auto it = std::lower_bound(sessions_.begin(), sessions_.end(), id,
                                     [](const Session& s, SessionId v) { return s.id < v; });
    return it != sessions_.end() && it->id == id ? &*it : nullptr;
  }
  [[nodiscard]] std::int32_t count(SessionState st) const noexcept {
    return static_cast<std::int32_t>(
        std::count_if(sessions_.begin(), sessions_.end(), [st](const Session& s) { return state_of(s) == st; }));
  }

  Cache* cache_;
  SessionLimits limits_;
  SessionId next_id_ = 1;
  std::vector<Session> sessions_;       // live sessions, ascending id (= oldest first)
  std::vector<Entry> open_batch_;       // the open batch: one entry per session in row order; empty when none
  std::vector<PendingStep> pending_;    // accepted steps whose tokens are on their way, oldest first
  std::uint64_t accepted_steps_ = 0;    // steps accepted so far (serial of the last one)
  std::int64_t discarded_ = 0;
  std::int64_t shifts_ = 0;             // context shifts since the table was made
  std::vector<RewindPoint> rewinds_;    // of the last resolve or discard_pending
};

}  // namespace cellkv::batching
