// Test-only checks of the batching layer, written against the public API of SessionTable (an
// oracle apart from the code that packs steps): check_batch says whether a StepBatch is one the
// table could run now; plan_slices_checked refuses what plan_slices turns into an empty plan.
// Also doctest printers for the batching statuses.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cellkv/batching/session_status.hpp"
#include "cellkv/batching/session_table.hpp"
#include "cellkv/batching/slices.hpp"
#include "cellkv/status.hpp"

template <>
struct doctest::StringMaker<cellkv::batching::SessionStatus> {
  static doctest::String convert(const cellkv::batching::SessionStatus& s) { return s.message().c_str(); }
};
template <>
struct doctest::StringMaker<cellkv::batching::SessionErrc> {
  static doctest::String convert(cellkv::batching::SessionErrc e) {
    return std::string(cellkv::batching::describe(e)).c_str();
  }
};

namespace cellkv::test {

// check_batch's verdict: the core code, and which batching rule a bad_argument broke.
enum class BatchFault : std::uint8_t { none, unknown_session, overlapping_input };
struct BatchVerdict {
  Errc code = Errc::ok;
  BatchFault fault = BatchFault::none;
  BatchVerdict() = default;
  BatchVerdict(Errc c) : code(c) {}  // NOLINT: implicit, as Status
  BatchVerdict(Status s) : code(s.code()) {}  // NOLINT
  BatchVerdict(BatchFault f) : code(Errc::bad_argument), fault(f) {}  // NOLINT
  [[nodiscard]] bool ok() const { return code == Errc::ok; }
  friend bool operator==(const BatchVerdict& v, Errc c) { return v.code == c && v.fault == BatchFault::none; }
  friend bool operator==(const BatchVerdict& v, BatchFault f) { return v.fault == f; }
};

// plan_slices, refusing invalid arguments with Errc::bad_argument.
[[nodiscard]] inline Result<std::vector<batching::Slice>> plan_slices_checked(std::int32_t total,
                                                                              std::int32_t max_step_tokens,
                                                                              std::int32_t min_prefill_tokens) {
  if (!batching::valid_slice_arguments(total, max_step_tokens, min_prefill_tokens)) return Errc::bad_argument;
  return batching::plan_slices(total, max_step_tokens, min_prefill_tokens);
}

namespace detail {

using batching::LogitRow;
using batching::SessionId;
using batching::SessionState;
using batching::StepBatch;

// Tokens the session takes in its next step when `room` (>= 1) tokens are left (0 when done).
template <class Table>
std::int32_t next_input(const Table& table, SessionId id, std::int32_t room) {
  switch (table.state(id).value()) {
    case SessionState::feeding: {
      const auto left = static_cast<std::int32_t>(table.prompt(id).value().size()) - table.cached_tokens(id).value();
      return batching::first_slice(left, room, table.limits().min_prefill_tokens).length;
    }
    case SessionState::generating: return 1;
    case SessionState::done: return 0;
  }
  return 0;
}

// Whether the logits of the session's next input, `length` tokens, give a generated token.
template <class Table>
bool next_samples(const Table& table, SessionId id, std::int32_t length) {
  const SessionState st = table.state(id).value();
  if (st != SessionState::feeding) return st == SessionState::generating;
  return table.cached_tokens(id).value() + length == static_cast<std::int32_t>(table.prompt(id).value().size()) &&
         table.max_new_tokens(id).value() > 0;
}

// Logit rows in range, ascending, and naming the session of their token.
template <class Table>
BatchVerdict check_logit_rows(const Table& table, const StepBatch& batch) {
  std::int32_t prev = -1;
  for (const LogitRow& r : batch.logit_rows) {
    if (r.row <= prev || r.row >= batch.size()) return Errc::bad_argument;
    prev = r.row;
  }
  for (const std::int32_t seq : batch.seqs)
    if (table.session_of_sequence(seq) == 0) return BatchFault::unknown_session;
  for (const LogitRow& r : batch.logit_rows) {
    if (!table.is_live(r.session)) return BatchFault::unknown_session;
    if (table.sequence_of(r.session).value() != batch.seqs[static_cast<std::size_t>(r.row)]) return Errc::bad_argument;
  }
  return {};
}

// One past the last token of the run of equal sequences starting at `begin`.
inline std::size_t run_end(const StepBatch& batch, std::size_t begin) {
  std::size_t end = begin;
  while (end < batch.seqs.size() && batch.seqs[end] == batch.seqs[begin]) ++end;
  return end;
}

// Each session's tokens are one run holding at most one logit row (BatchFault::overlapping_input otherwise);
// then each run ends at a logit row and has the length and samples flag of the session's next input
// with the room left where the run begins (bad_argument otherwise).
template <class Table>
BatchVerdict check_runs(const Table& table, const StepBatch& batch, std::int32_t room) {
  std::vector<const LogitRow*> row_at(batch.tokens.size(), nullptr);
  for (const LogitRow& r : batch.logit_rows) row_at[static_cast<std::size_t>(r.row)] = &r;
  std::vector<SessionId> seen;
  for (std::size_t begin = 0, end = 0; begin < batch.seqs.size(); begin = end) {
    end = run_end(batch, begin);
    const SessionId id = table.session_of_sequence(batch.seqs[begin]);
    for (const SessionId s : seen)
      if (s == id) return BatchFault::overlapping_input;
    seen.push_back(id);
    for (std::size_t t = begin; t + 1 < end; ++t)
      if (row_at[t] != nullptr) return BatchFault::overlapping_input;
  }
  for (std::size_t begin = 0, end = 0; begin < batch.seqs.size(); begin = end) {
    end = run_end(batch, begin);
    const SessionId id = table.session_of_sequence(batch.seqs[begin]);
    const LogitRow* last = row_at[end - 1];
    const std::int32_t length = next_input(table, id, room - static_cast<std::int32_t>(begin));
    if (last == nullptr || static_cast<std::int32_t>(end - begin) != length ||
        last->samples != next_samples(table, id, length))
      return Errc::bad_argument;
  }
  return {};
}

}  // namespace detail

// Whether `batch` is a step `table` could run now. Refuses, in this order: no tokens (empty_step);
// more than max_write tokens (step_too_wide); seqs or a logit row outside the batch, or logit rows
// not strictly ascending (bad_argument); a sequence or logit-row session that is no live session's
// (BatchFault::unknown_session); a logit row naming another session than its token's (bad_argument); a
// session with two runs of tokens, or a run holding two logit rows, i.e. two slices
// (BatchFault::overlapping_input); a run not ending at a logit row, a run whose length is not the session's
// next input (1 token generating; feeding, the slice next_step plans for it where the run begins:
// first_slice(r, max_write - row of its first token, min_prefill_tokens); nothing done) or a
// samples flag that disagrees with the session (bad_argument). Token values, which sessions the
// batch leaves out, their order and the waiting rule of next_step are not checked. `width`: the
// width the batch was packed for (next_step(width); 0: max_write). Tables whose tokens are all
// resolved (accept, not accept_pending).
template <class Table>
[[nodiscard]] BatchVerdict check_batch(const Table& table, const batching::StepBatch& batch, std::int32_t width = 0) {
  const std::int32_t max_write = table.limits().max_write;
  if (width < 0 || width > max_write) return Errc::bad_argument;
  const std::int32_t room = width == 0 ? max_write : width;
  if (batch.tokens.empty()) return Errc::empty_step;
  if (batch.tokens.size() > static_cast<std::size_t>(room)) return Errc::step_too_wide;
  if (batch.seqs.size() != batch.tokens.size()) return Errc::bad_argument;
  if (const BatchVerdict v = detail::check_logit_rows(table, batch); !v.ok()) return v;
  return detail::check_runs(table, batch, room);
}

}  // namespace cellkv::test

template <>
struct doctest::StringMaker<cellkv::test::BatchVerdict> {
  static doctest::String convert(const cellkv::test::BatchVerdict& v) {
    static constexpr const char* kFaults[] = {"", ": unknown session", ": overlapping input"};
    return (std::string(cellkv::describe(v.code)) + kFaults[static_cast<int>(v.fault)]).c_str();
  }
};
