// cellkv/batching/session_status.hpp - the batching layer's refusals: the core reason (cellkv::Errc),
// a batching-level detail, and the session it concerns.
//
//   const auto id = table.add(prompt, 64, {.temperature = -1.f});
//   id.status() == cellkv::Errc::bad_argument;                   // the core reason
//   id.status() == cellkv::batching::SessionErrc::bad_temperature;  // the detail
//   id.status().message();  // "bad argument: ...: temperature must be finite and >= 0"
//
// The details live here, apart from cellkv::Errc (the cache's codes), each under one core code:
// bad_argument for bad input to add, add_samples, clone and the queries (an unknown session, a
// budget no cache could serve), no_free_sequence when every sequence of the cache holds a session,
// and the cache's own code (out_of_cells, sequence_full) for a step refused at placement, naming the
// session whose tokens did not fit. A SessionStatus converts to cellkv::Status (the
// core reason alone) and compares equal to its core code and to its detail.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "cellkv/status.hpp"

namespace cellkv::batching {

// Monotonic from 1 within one table, never reused. 0 is never a session.
using SessionId = std::uint64_t;

enum class SessionErrc : std::uint8_t {
  none = 0,
  unknown_session,     // bad_argument: no live session has this id
  too_many_sessions,   // no_free_sequence: every sequence of the cache holds a session
  over_budget,         // bad_argument: prompt + max_new_tokens pass max_tokens_per_session
  token_out_of_vocab,  // bad_argument: a prompt token id outside [0, vocab)
  bad_temperature,     // bad_argument: temperature negative or not finite
  bad_top_k,           // bad_argument: top_k < 0
  bad_top_p,           // bad_argument: top_p outside (0, 1]
  bad_min_p,           // bad_argument: min_p outside [0, 1]
  bad_stop_token,      // bad_argument: a stop token id outside [0, vocab)
  bad_sample_count,    // bad_argument: add_samples asked for fewer than one sample
  exceeds_sequence,    // bad_argument: prompt + max_new_tokens - 1 tokens pass the layout's max_len
  exceeds_cache,       // bad_argument: prompt + max_new_tokens - 1 tokens pass the cache's capacity
  no_room,             // the cache's code: the session's tokens of the step do not fit now
};

[[nodiscard]] constexpr std::string_view describe(SessionErrc e) noexcept {
  switch (e) {
    case SessionErrc::none: return "";
    case SessionErrc::unknown_session: return "no live session has this id";
    case SessionErrc::too_many_sessions: return "every sequence of the cache holds a session";
    case SessionErrc::over_budget: return "prompt + max_new_tokens would pass max_tokens_per_session";
    case SessionErrc::token_out_of_vocab: return "a prompt token id is outside [0, vocab)";
    case SessionErrc::bad_temperature: return "temperature must be finite and >= 0";
    case SessionErrc::bad_top_k: return "top_k must be >= 0";
    case SessionErrc::bad_top_p: return "top_p must lie in (0, 1]";
    case SessionErrc::bad_min_p: return "min_p must lie in [0, 1]";
    case SessionErrc::bad_stop_token: return "a stop token id is outside [0, vocab)";
    case SessionErrc::bad_sample_count: return "samples must be >= 1";
    case SessionErrc::exceeds_sequence:
      return "prompt + max_new_tokens - 1 tokens would pass the sequence layout's max_len";
    case SessionErrc::exceeds_cache: return "prompt + max_new_tokens - 1 tokens would pass the cache's capacity";
    case SessionErrc::no_room: return "its tokens of the step do not fit in the cache now";
  }
  return "unknown detail";
}

class [[nodiscard]] SessionStatus {
 public:
  constexpr SessionStatus() noexcept = default;
  constexpr SessionStatus(Errc code) noexcept : code_(code) {}      // NOLINT: implicit by design
  constexpr SessionStatus(Status s) noexcept : code_(s.code()) {}   // NOLINT: implicit by design
  constexpr SessionStatus(Errc code, SessionErrc detail, SessionId session = 0) noexcept
      : code_(code), detail_(detail), session_(session) {}

  [[nodiscard]] constexpr bool ok() const noexcept { return code_ == Errc::ok; }
  [[nodiscard]] constexpr Errc code() const noexcept { return code_; }
  [[nodiscard]] constexpr SessionErrc detail() const noexcept { return detail_; }
  // The session the refusal concerns; 0 when none.
  [[nodiscard]] constexpr SessionId session() const noexcept { return session_; }
  [[nodiscard]] constexpr Status status() const noexcept { return code_; }
  constexpr operator Status() const noexcept { return code_; }  // NOLINT: the core reason
  constexpr explicit operator bool() const noexcept { return ok(); }

  // "<core reason>[: session N][: <detail>]".
  [[nodiscard]] std::string message() const {
    std::string m(cellkv::describe(code_));
    if (session_ != 0) m += ": session " + std::to_string(session_);
    if (detail_ != SessionErrc::none) m += std::string(": ") + std::string(describe(detail_));
    return m;
  }

  friend constexpr bool operator==(const SessionStatus& a, const SessionStatus& b) noexcept {
    return a.code_ == b.code_ && a.detail_ == b.detail_ && a.session_ == b.session_;
  }
  friend constexpr bool operator==(const SessionStatus& a, Errc b) noexcept { return a.code_ == b; }
  friend constexpr bool operator==(const SessionStatus& a, SessionErrc b) noexcept { return a.detail_ == b; }

 private:
  Errc code_ = Errc::ok;
  SessionErrc detail_ = SessionErrc::none;
  SessionId session_ = 0;
};

// What SessionResult::value() throws on a refused result: a BadResultAccess (its code() is the core
// reason) that also carries the whole SessionStatus (detail and session).
class BadSessionResultAccess : public BadResultAccess {
 public:
  explicit BadSessionResultAccess(const SessionStatus& s) noexcept : BadResultAccess(s.code()), status_(s) {}
  [[nodiscard]] const SessionStatus& status() const noexcept { return status_; }
  [[nodiscard]] const char* what() const noexcept override {
    return "cellkv::batching::SessionResult::value() on a refused result (status() says why)";
  }

 private:
  SessionStatus status_;
};

// A value or the SessionStatus saying why there is none. value() on a refused result throws
// BadSessionResultAccess (as Result::value() does); check ok() or use value_or().
template <class T>
class [[nodiscard]] SessionResult {
 public:
  constexpr SessionResult(T value) : value_(std::move(value)) {}             // NOLINT: implicit by design
  constexpr SessionResult(Errc code) noexcept : status_(code) {}             // NOLINT: implicit by design
  constexpr SessionResult(SessionStatus s) noexcept : status_(s) {}          // NOLINT: implicit by design
  constexpr SessionResult(Result<T> r) : value_(r.ok() ? r.value() : T{}), status_(r.status()) {}  // NOLINT

  [[nodiscard]] constexpr bool ok() const noexcept { return status_.ok(); }
  [[nodiscard]] constexpr const SessionStatus& status() const noexcept { return status_; }
  [[nodiscard]] constexpr const T& value() const& {
    if (!ok()) throw BadSessionResultAccess(status_);
    return value_;
  }
  [[nodiscard]] constexpr T& value() & {
    if (!ok()) throw BadSessionResultAccess(status_);
    return value_;
  }
  [[nodiscard]] constexpr T value_or(T fallback) const { return ok() ? value_ : fallback; }
  constexpr explicit operator bool() const noexcept { return ok(); }

 private:
  T value_{};
  SessionStatus status_{};
};

}  // namespace cellkv::batching
