// cellkv/batching/session_table.hpp - sessions (a prompt plus a generation budget) packed into steps.
//
//   cellkv::CellCache<cellkv::layout::cell, cellkv::Windows<0>> cache({.max_write = 8, .max_cells = 4096});
//   cellkv::batching::SessionTable table(cache, {.max_write = 8, .min_prefill_tokens = 2,
//                                                .max_tokens_per_session = 1024});
//   const auto id = table.add(prompt, 16).value();
//   while (auto batch = table.next_step()) {          // Errc::empty_step: nothing left to run
//     auto plan = cache.declare_step(batch.value().seqs);
//     ... forward, logits of batch.value().logit_rows, sample ...
//     if (forward_ok) (void)table.accept(sampled); else table.abandon();
//     for (SessionId done : table.reap()) ...;
//   }
//
// A session owns one cache sequence from add/clone until finish/reap. Its life:
//   feeding     its prompt goes in, after the `shared` prompt tokens it got from a clone source (0
//               for add), one slice per step; each slice is planned when a step is packed, against
//               the room left in that step (next_step), so a long prompt joins running sessions in
//               chunks that fill the step;
//   generating  one token per step: its last sampled token;
//   done        it holds max_new_tokens generated tokens (the last one is never fed). It stays in
//               the table, holding its sequence, until finish() or reap().
// Between steps the cache sequence of a session holds exactly its prompt tokens fed so far, then its
// generated tokens but the last: cached_tokens(id) == cache.pos(sequence_of(id)).
//
// The step protocol: next_step() packs a batch and marks it in flight; the executor declares it to
// the cache (cache.declare_step(batch.seqs)), runs the forward and calls accept(sampled), or
// abandon() when the forward failed. While a batch is in flight the verbs add, clone and finish are
// refused with Errc::bad_argument, reap() removes nothing and next_step() is refused with
// Errc::bad_argument: a verb would invalidate the cache's placed step or the batch.
//
// Every refusal returns a Status naming the reason and changes nothing, in the table or the cache
// (strong guarantee); a cache verb is the last thing a table verb does before it commits. The table
// assumes it alone adds and removes the sequences of its sessions. Copies of a table are for
// snapshots (compare with ==, which ignores which cache a table drives).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellkv/batching/slices.hpp"
#include "cellkv/status.hpp"

namespace cellkv::batching {

// Monotonic from 1 within one table, never reused. 0 is never a session.
using SessionId = std::uint64_t;

// Fixed at construction. max_tokens_per_session bounds prompt + max_new_tokens of every session.
struct SessionLimits {
  std::int32_t max_write = 0;               // widest step, in tokens; <= the cache's max_write
  std::int32_t min_prefill_tokens = 1;      // shortest prefill slice (plan_slices)
  std::int32_t max_tokens_per_session = 0;  // prompt + generated budget of one session
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

// One step: token t is tokens[t] of cache sequence seqs[t]. Each session's tokens are one
// contiguous run in position order ending at its logit row; logit_rows ascend by row.
struct StepBatch {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> seqs;
  std::vector<LogitRow> logit_rows;
  [[nodiscard]] std::int32_t size() const noexcept { return static_cast<std::int32_t>(tokens.size()); }
  friend bool operator==(const StepBatch&, const StepBatch&) = default;
};

// Keep positions < pos of cache sequence seq: undoes an abandoned step (cache.rewind(seq, pos)).
struct RewindPoint {
  std::int32_t seq = 0;
  std::int32_t pos = 0;
  friend bool operator==(const RewindPoint&, const RewindPoint&) = default;
};

// The verbs a table needs: cellkv::CellCache and cellkv::gpu::DeviceCache have them.
template <class C>
concept SessionCache = requires(C& c, std::int32_t s) {
  { c.seq_new() } -> std::same_as<Result<std::int32_t>>;
  { c.seq_clone(s, s) } -> std::same_as<Result<std::int32_t>>;
  { c.seq_rm(s) } -> std::same_as<Status>;
};

// A cache abandon() can rewind itself.
template <class C>
concept RewindableCache = SessionCache<C> && requires(C& c, std::int32_t s) {
  { c.rewind(s, s) } -> std::same_as<Status>;
};

namespace detail {

// The object that answers a cache's queries: cache.host() for a device wrapper, else the cache.
template <class C>
[[nodiscard]] const auto& queries_of(const C& cache) noexcept {
  if constexpr (requires { cache.host(); })
    return cache.host();
  else
    return cache;
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

  // bad_argument unless max_write >= 1, min_prefill_tokens >= 1, max_tokens_per_session >= 1 and
  // (when the cache, or its host(), reports it) max_write <= max_write().
  [[nodiscard]] static Status validate(const SessionLimits& l, const Cache& cache) {
    if (l.max_write < 1 || l.min_prefill_tokens < 1 || l.max_tokens_per_session < 1) return Errc::bad_argument;
    if constexpr (requires { detail::queries_of(cache).max_write(); })
      if (l.max_write > detail::queries_of(cache).max_write()) return Errc::bad_argument;
    return {};
  }

  // ---- verbs (between steps) ----

  // A new session feeding `prompt`, then generating max_new_tokens tokens. Refuses, in this order:
  // an empty prompt or max_new_tokens < 0 (bad_argument), a batch in flight (bad_argument),
  // prompt.size() + max_new_tokens > max_tokens_per_session (over_budget), no free cache sequence
  // (too_many_sessions; any other refusal of cache.seq_new is passed on).
  Result<SessionId> add(std::span<const std::int32_t> prompt, std::int32_t max_new_tokens) {
    if (prompt.empty() || max_new_tokens < 0 || in_flight_) return Errc::bad_argument;
    if (over_budget(prompt.size(), max_new_tokens)) return Errc::over_budget;
    Session s = make_session(std::vector<std::int32_t>(prompt.begin(), prompt.end()), max_new_tokens, 0);
    sessions_.reserve(sessions_.size() + 1);  // commit cannot throw once the cache has changed
    const Result<std::int32_t> seq = cache_->seq_new();
    if (!seq.ok()) return cache_refusal(seq.status());
    return commit(std::move(s), seq.value());
  }

  // A new session with src's prompt and its own budget of max_new_tokens, sharing src's cache
  // positions < shared = min(prompt tokens src has fed, prompt.size() - 1) through
  // cache.seq_clone(src_seq, shared). The clone feeds the rest of the prompt itself (at least the
  // last prompt token, whose logits give its own first token), then generates independently.
  // Refuses, in this order: unknown src (unknown_session), max_new_tokens < 0 or a batch in flight
  // (bad_argument), over_budget, too_many_sessions (as add).
  Result<SessionId> clone(SessionId src, std::int32_t max_new_tokens) {
    const Session* from = find(src);
    if (from == nullptr) return Errc::unknown_session;
    if (max_new_tokens < 0 || in_flight_) return Errc::bad_argument;
    if (over_budget(from->prompt.size(), max_new_tokens)) return Errc::over_budget;
    const std::int32_t shared = std::min(from->fed, prompt_size(*from) - 1);
    const std::int32_t src_seq = from->seq;
    Session s = make_session(from->prompt, max_new_tokens, shared);
    sessions_.reserve(sessions_.size() + 1);  // invalidates `from`; not used below
    const Result<std::int32_t> seq = cache_->seq_clone(src_seq, shared);
    if (!seq.ok()) return cache_refusal(seq.status());
    return commit(std::move(s), seq.value());
  }

  // Ends a live session in any state: removes its cache sequence and drops it from the table.
  // Refuses: unknown_session; a batch in flight (bad_argument); a refusal of cache.seq_rm.
  Status finish(SessionId id) {
    const auto it = locate(id);
    if (it == sessions_.end()) return Errc::unknown_session;
    if (in_flight_) return Errc::bad_argument;
    if (const Status s = cache_->seq_rm(it->seq); !s.ok()) return s;
    sessions_.erase(it);
    return {};
  }

  // Finishes every done session; returns their ids, ascending. Removes nothing while a batch is in
  // flight; a session whose cache.seq_rm is refused stays in the table.
  std::vector<SessionId> reap() {
    std::vector<SessionId> reaped;
    if (in_flight_) return reaped;
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

  // Packs one step of at most max_write tokens and marks it in flight. `room` starts at max_write;
  //  1. one token of every generating session, oldest first, while room > 0 (room -= 1 each);
  //  2. then one prompt slice of every feeding session, oldest first, planned now against the room
  //     left: first_slice(r, room, min_prefill_tokens), i.e. plan_slices(r, room,
  //     min_prefill_tokens).front(), where r = its prompt tokens not yet fed. That is a prefill of
  //     L = min(r, room) tokens when L > 1 and L >= min_prefill_tokens, else one (decode) token.
  //     Waiting: when 0 < room < min_prefill_tokens <= max_write and r >= min_prefill_tokens (the
  //     room, not the prompt, makes the slice one token, and a later step can give a prefill), the
  //     session is fed its one token only if the step holds no prompt token yet; otherwise it waits
  //     for the next step. Packing stops at the first feeding session that gets nothing (room == 0,
  //     or it waits): feeding is first in, first out, a younger session never passes an older one.
  // No starvation: a step in which fewer than max_write sessions generate feeds the oldest feeding
  // session at least one token. So when that holds throughout (e.g. a cache of at most max_write
  // sequences), a session is fed completely within T accepted steps, T = the prompt tokens left to
  // feed when it was added, its own and those of the older feeding sessions.
  // `width` (0: max_write) packs a narrower step, as if max_write were width: schedules of chosen
  // widths (tests, latency caps).
  // Refuses: a batch in flight or width outside [0, max_write] (bad_argument); no session with
  // work (empty_step). Does not call cache.declare_step.
  Result<StepBatch> next_step(std::int32_t width = 0) {
    if (in_flight_ || width < 0 || width > limits_.max_write) return Errc::bad_argument;
    StepBatch batch;
    std::vector<Entry> entries;
    std::int32_t room = width == 0 ? limits_.max_write : width;
    for (const Session& s : sessions_) {
      if (room == 0) break;
      if (state_of(s) != SessionState::generating) continue;
      append(batch, entries, s, std::span<const std::int32_t>(&s.output.back(), 1), false, true);
      --room;
    }
    bool fed_prompt = false;  // the step holds a prompt token
    for (const Session& s : sessions_) {
      if (state_of(s) != SessionState::feeding) continue;
      if (room == 0 || (fed_prompt && waits(s, room))) break;
      const std::int32_t length = slice_length(s, room);
      append(batch, entries, s, std::span<const std::int32_t>(s.prompt).subspan(static_cast<std::size_t>(s.fed),
                                                                                static_cast<std::size_t>(length)),
             true, slice_samples(s, length));
      room -= length;
      fed_prompt = true;
    }
    if (batch.tokens.empty()) return Errc::empty_step;
    inflight_ = std::move(entries);
    in_flight_ = true;
    return batch;
  }

  // Completes the batch in flight: `sampled` holds one token per logit row with samples == true,
  // in row order. Advances each session of the batch (prompt fed, tokens generated); a session
  // that reaches max_new_tokens becomes done. Refuses (bad_argument): no batch in flight, or a
  // count that does not match.
  Status accept(std::span<const std::int32_t> sampled) {
    if (!in_flight_ || sampled.size() != samples_in_flight()) return Errc::bad_argument;
    std::size_t k = 0;
    for (const Entry& e : inflight_) {
      Session& s = *locate(e.id);
      if (e.prompt) s.fed += e.length;
      if (e.samples) s.output.push_back(sampled[k++]);
    }
    end_flight();
    return {};
  }

  // Drops the batch in flight (the forward failed); every session stays where it was. Returns, for
  // each session of the batch in row order, the position its cache sequence must be rewound to; when
  // the cache has rewind(seq, pos) (RewindableCache) abandon() has already done it, so the cache is
  // as before cache.declare_step(batch.seqs) (a no-op when the step was never declared). Returns
  // nothing and changes nothing when no batch is in flight.
  std::vector<RewindPoint> abandon() {
    std::vector<RewindPoint> points;
    if (!in_flight_) return points;
    for (const Entry& e : inflight_) {
      const Session& s = *find(e.id);
      points.push_back({s.seq, cached(s)});
    }
    if constexpr (RewindableCache<Cache>)
      for (const RewindPoint& p : points) (void)cache_->rewind(p.seq, p.pos);
    end_flight();
    return points;
  }

  // Whether `batch` is a step this table could run now. Refuses, in this order: no tokens
  // (empty_step); more than max_write tokens (step_too_wide); seqs or a logit row outside the batch,
  // or logit rows not strictly ascending (bad_argument); a sequence or logit-row session that is no
  // live session's (unknown_session); a logit row naming another session than its token's
  // (bad_argument); a session with two runs of tokens, or a run holding two logit rows, i.e. two
  // slices (overlapping_input); a run not ending at a logit row, a run whose length is not the
  // session's next input (1 token generating; feeding, the slice next_step plans for it where the
  // run begins: first_slice(r, max_write - row of its first token, min_prefill_tokens); nothing
  // done) or a samples flag that disagrees with the session (bad_argument). Token values, which
  // sessions the batch leaves out, their order and the waiting rule of next_step are not checked.
  // `width`: the width the batch was packed for (next_step(width); 0: max_write).
  [[nodiscard]] Status check_batch(const StepBatch& batch, std::int32_t width = 0) const {
    if (width < 0 || width > limits_.max_write) return Errc::bad_argument;
    const std::int32_t room = width == 0 ? limits_.max_write : width;
    if (batch.tokens.empty()) return Errc::empty_step;
    if (batch.tokens.size() > static_cast<std::size_t>(room)) return Errc::step_too_wide;
    if (batch.seqs.size() != batch.tokens.size()) return Errc::bad_argument;
    if (const Status s = check_logit_rows(batch); !s.ok()) return s;
    return check_runs(batch, room);
  }

  // ---- queries ----

  [[nodiscard]] bool is_live(SessionId id) const noexcept { return find(id) != nullptr; }
  [[nodiscard]] Result<SessionState> state(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return Errc::unknown_session;
    return state_of(*s);
  }
  // Tokens generated so far; the span is valid until the next accept, finish or reap.
  [[nodiscard]] Result<std::span<const std::int32_t>> output(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return Errc::unknown_session;
    return std::span<const std::int32_t>(s->output);
  }
  [[nodiscard]] Result<std::span<const std::int32_t>> prompt(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return Errc::unknown_session;
    return std::span<const std::int32_t>(s->prompt);
  }
  [[nodiscard]] Result<std::int32_t> sequence_of(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return Errc::unknown_session;
    return s->seq;
  }
  // Tokens the session's cache sequence holds between steps (shared prefix included): what
  // cache.pos(sequence_of(id)) is outside a step.
  [[nodiscard]] Result<std::int32_t> cached_tokens(SessionId id) const {
    const Session* s = find(id);
    if (s == nullptr) return Errc::unknown_session;
    return cached(*s);
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
  [[nodiscard]] bool in_flight() const noexcept { return in_flight_; }
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

  // Same sessions, states, outputs, id counter, limits and batch in flight; the cache is not compared.
  friend bool operator==(const SessionTable& a, const SessionTable& b) {
    return a.limits_ == b.limits_ && a.next_id_ == b.next_id_ && a.sessions_ == b.sessions_ &&
           a.in_flight_ == b.in_flight_ && a.inflight_ == b.inflight_;
  }

 private:
  struct Session {
    SessionId id = 0;
    std::int32_t seq = 0;
    std::vector<std::int32_t> prompt;
    std::int32_t max_new = 0;
    std::int32_t shared = 0;       // prompt tokens inherited from a clone source
    std::int32_t fed = 0;          // prompt tokens in the cache, shared ones included
    std::vector<std::int32_t> output;
    friend bool operator==(const Session&, const Session&) = default;
  };
  // One session's share of the batch in flight.
  struct Entry {
    SessionId id = 0;
    std::int32_t length = 0;
    bool prompt = false;
    bool samples = false;
    friend bool operator==(const Entry&, const Entry&) = default;
  };

  [[nodiscard]] static std::int32_t prompt_size(const Session& s) noexcept {
    return static_cast<std::int32_t>(s.prompt.size());
  }
  [[nodiscard]] static SessionState state_of(const Session& s) noexcept {
    if (s.fed < prompt_size(s)) return SessionState::feeding;
    return static_cast<std::int32_t>(s.output.size()) < s.max_new ? SessionState::generating : SessionState::done;
  }
  // The prompt fed so far, then the generated tokens but the last (never fed).
  [[nodiscard]] static std::int32_t cached(const Session& s) noexcept {
    return s.fed + std::max(0, static_cast<std::int32_t>(s.output.size()) - 1);
  }
  // Length of a feeding session's next prompt slice when `room` (>= 1) tokens are left in the step.
  [[nodiscard]] std::int32_t slice_length(const Session& s, std::int32_t room) const noexcept {
    return first_slice(prompt_size(s) - s.fed, room, limits_.min_prefill_tokens).length;
  }
  // Whether the logits of a feeding session's slice of `length` tokens give a generated token.
  [[nodiscard]] static bool slice_samples(const Session& s, std::int32_t length) noexcept {
    return s.fed + length == prompt_size(s) && s.max_new > 0;
  }
  // next_step's waiting rule: only the short room makes the slice one token, and a later step can
  // give a prefill.
  [[nodiscard]] bool waits(const Session& s, std::int32_t room) const noexcept {
    const std::int32_t min = limits_.min_prefill_tokens;
    return room < min && min <= limits_.max_write && prompt_size(s) - s.fed >= min;
  }
  // Tokens the session takes in its next step when `room` (>= 1) tokens are left (0 when done).
  [[nodiscard]] std::int32_t next_input(const Session& s, std::int32_t room) const noexcept {
    switch (state_of(s)) {
      case SessionState::feeding: return slice_length(s, room);
      case SessionState::generating: return 1;
      case SessionState::done: return 0;
    }
    return 0;
  }
  // Whether the logits of the session's next input, `length` tokens, give a generated token.
  [[nodiscard]] static bool next_samples(const Session& s, std::int32_t length) noexcept {
    if (state_of(s) != SessionState::feeding) return state_of(s) == SessionState::generating;
    return slice_samples(s, length);
  }

  [[nodiscard]] bool over_budget(std::size_t prompt_tokens, std::int32_t max_new_tokens) const noexcept {
    const auto budget = static_cast<std::size_t>(limits_.max_tokens_per_session);
    return prompt_tokens > budget || static_cast<std::size_t>(max_new_tokens) > budget - prompt_tokens;
  }
  // The table's reason for a refused cache verb: no_free_sequence becomes too_many_sessions.
  [[nodiscard]] static Errc cache_refusal(Status s) noexcept {
    return s == Errc::no_free_sequence ? Errc::too_many_sessions : s.code();
  }

  // A session without id or sequence yet, feeding the prompt after the shared prefix.
  [[nodiscard]] static Session make_session(std::vector<std::int32_t> prompt, std::int32_t max_new, std::int32_t shared) {
    Session s;
    s.prompt = std::move(prompt);
    s.max_new = max_new;
    s.shared = shared;
    s.fed = shared;
    return s;
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
  [[nodiscard]] std::size_t samples_in_flight() const noexcept {
    return static_cast<std::size_t>(std::count_if(inflight_.begin(), inflight_.end(), [](const Entry& e) { return e.samples; }));
  }
  void end_flight() noexcept {
    inflight_.clear();
    in_flight_ = false;
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
  // Index in sessions_ of the live session holding cache sequence seq, or -1.
  [[nodiscard]] std::ptrdiff_t index_of_seq(std::int32_t seq) const noexcept {
    for (std::size_t i = 0; i < sessions_.size(); ++i)
      if (sessions_[i].seq == seq) return static_cast<std::ptrdiff_t>(i);
    return -1;
  }
  [[nodiscard]] std::int32_t count(SessionState st) const noexcept {
    return static_cast<std::int32_t>(
        std::count_if(sessions_.begin(), sessions_.end(), [st](const Session& s) { return state_of(s) == st; }));
  }

  // check_batch, part 1: logit rows in range, ascending, and naming the session of their token.
  [[nodiscard]] Status check_logit_rows(const StepBatch& batch) const {
    std::int32_t prev = -1;
    for (const LogitRow& r : batch.logit_rows) {
      if (r.row <= prev || r.row >= batch.size()) return Errc::bad_argument;
      prev = r.row;
    }
    for (const std::int32_t seq : batch.seqs)
      if (index_of_seq(seq) < 0) return Errc::unknown_session;
    for (const LogitRow& r : batch.logit_rows) {
      const Session* s = find(r.session);
      if (s == nullptr) return Errc::unknown_session;
      if (s->seq != batch.seqs[static_cast<std::size_t>(r.row)]) return Errc::bad_argument;
    }
    return {};
  }

  // check_batch, part 2: each session's tokens are one run holding at most one logit row
  // (overlapping_input otherwise); then each run ends at a logit row and has the length and samples
  // flag of the session's next input with the room left where the run begins (bad_argument
  // otherwise). Preconditions: check_logit_rows passed and the batch holds <= room tokens.
  [[nodiscard]] Status check_runs(const StepBatch& batch, std::int32_t room) const {
    std::vector<const LogitRow*> row_at(batch.tokens.size(), nullptr);
    for (const LogitRow& r : batch.logit_rows) row_at[static_cast<std::size_t>(r.row)] = &r;
    std::vector<char> seen(sessions_.size(), 0);
    for (std::size_t begin = 0, end = 0; begin < batch.seqs.size(); begin = end) {
      end = run_end(batch, begin);
      const auto index = static_cast<std::size_t>(index_of_seq(batch.seqs[begin]));
      if (seen[index]) return Errc::overlapping_input;
      seen[index] = 1;
      for (std::size_t t = begin; t + 1 < end; ++t)
        if (row_at[t] != nullptr) return Errc::overlapping_input;
    }
    for (std::size_t begin = 0, end = 0; begin < batch.seqs.size(); begin = end) {
      end = run_end(batch, begin);
      const Session& s = sessions_[static_cast<std::size_t>(index_of_seq(batch.seqs[begin]))];
      const LogitRow* last = row_at[end - 1];
      const std::int32_t length = next_input(s, room - static_cast<std::int32_t>(begin));
      if (last == nullptr || static_cast<std::int32_t>(end - begin) != length || last->samples != next_samples(s, length))
        return Errc::bad_argument;
    }
    return {};
  }
  // One past the last token of the run of equal sequences starting at `begin`.
  [[nodiscard]] static std::size_t run_end(const StepBatch& batch, std::size_t begin) noexcept {
    std::size_t end = begin;
    while (end < batch.seqs.size() && batch.seqs[end] == batch.seqs[begin]) ++end;
    return end;
  }

  Cache* cache_;
  SessionLimits limits_;
  SessionId next_id_ = 1;
  std::vector<Session> sessions_;  // live sessions, ascending id (= oldest first)
  std::vector<Entry> inflight_;    // the batch in flight, one entry per session in row order
  bool in_flight_ = false;
};

}  // namespace cellkv::batching
