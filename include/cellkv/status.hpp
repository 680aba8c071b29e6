// cellkv/status.hpp - the status every refusal returns, and Result<T> for verbs that produce a value.
//
// Contract: a call that returns a non-ok Status changed nothing (strong guarantee). Nothing in the
// core aborts or throws on bad input; owners of device memory may throw at construction only.
#pragma once

#include <cstdint>
#include <exception>
#include <string_view>
#include <utility>

namespace cellkv {

// Why a call of the cache, its planners or its kernels was refused; `describe` names each one for a
// human. The batching layer adds its own details on top of these (batching/session_status.hpp).
enum class Errc : std::uint8_t {
  ok = 0,
  // step admission (docs/design.md section 4)
  empty_step,         // T == 0
  step_too_wide,      // T > max_write
  bad_sequence_id,    // id outside [0, max_seqs)
  sequence_not_live,  // id in range but not created by seq_new / seq_clone, or already removed
  out_of_cells,       // cell layout: fewer free cells than tokens in the step
  sequence_full,      // a position would pass max_len (sequence layout) or position_limit() (cell layout)
  // verbs
  no_free_sequence,   // seq_new / seq_clone: every sequence id is live
  bad_position,       // rewind / seq_clone `upto` outside [0, pos(id)]
  no_step_declared,   // a forward or upload without a placed step (or after a verb invalidated it)
  // launchers and device bindings
  bad_shape,          // a tensor shape disagrees with the pool or the step, or does not split
                      // evenly over tensor-parallel shards
  bad_head_ratio,     // H_q is not a positive multiple of H_kv
  unsupported_head_dim,
  unsupported_dtype,
  misaligned_pointer,  // a pointer is not 16-byte aligned where a kernel needs vector access
  bad_argument,        // any other argument outside its documented range
  device_error,        // a CUDA call failed; gpu::last_cuda_failure() says which (cuda/error.hpp)
  // sizes and device faults
  size_overflow,       // a configuration's sizes overflow what cellkv can index or count (size_t, int32)
  bad_device_row,      // a device write met a row outside the pool (its data went to the scratch row)
  out_of_memory,       // a configuration needs more host memory than the budget it was checked against
  // sequence edits (seq_rm / seq_cp / seq_add / seq_div over a position range)
  position_collision,     // the edit would give one sequence two cells at one position
  unsupported_by_layout,  // the layout cannot make this edit (docs/design.md section 4, "Sequence edits")
  out_of_pages,           // cell layout: the position table has too few free pages for the edit or step
  // saved sequence state (sequence_state.hpp)
  state_truncated,     // the bytes end before the header or payload they declare
  state_bad_magic,     // not a cellkv sequence state
  state_bad_version,   // a format version this build does not read
  state_mismatch,      // saved from a pool of another shape, element type or window set
  state_corrupt,       // the checksum or the header's own fields disagree with the bytes
  state_too_large,     // more positions than the cache could ever hold
  io_error,            // a state file could not be opened, read or written
  // device caches
  no_key_rotation,     // seq_add / seq_div on a device cache whose key rotation is not set
  rows_pending,        // a save/restore before the pool holds a sequence's rows (sequence_state.hpp, gpu/sequence_state.cuh)
  upload_incomplete,   // a verb that could change the pending copies or re-rotations while a device
                       // applied part of them (a failed or partial upload)
  missing_step_kernels,  // a replayed graph lacks an attention kernel the step needs (gpu/graph_scope.hpp)
  // window storage (CacheConfig::window_cells)
  out_of_window_cells,  // a window pool has fewer free cells than the step or edit needs
  window_evicted,       // the result would need positions a window pool has let go of (recompute them)
};

[[nodiscard]] constexpr std::string_view describe(Errc e) noexcept {
  switch (e) {
    case Errc::ok: return "ok";
    case Errc::empty_step: return "empty step: a step needs at least one token";
    case Errc::step_too_wide: return "step too wide: more tokens than max_write";
    case Errc::bad_sequence_id: return "bad sequence id: outside [0, max_seqs)";
    case Errc::sequence_not_live: return "sequence not live: the id was never created or was removed";
    case Errc::out_of_cells: return "out of cells: fewer free cells than tokens in the step";
    case Errc::sequence_full:
      return "sequence full: a position would pass the sequence's limit (max_len, or the cell layout's position_limit())";
    case Errc::no_free_sequence: return "no free sequence id: every id is live";
    case Errc::bad_position: return "bad position: outside [0, pos(id)]";
    case Errc::no_step_declared: return "no step declared: call declare_step before the forward";
    case Errc::bad_shape:
      return "bad shape: a tensor shape disagrees with the pool or the step, or does not split evenly over the shards";
    case Errc::bad_head_ratio: return "bad head ratio: H_q must be a positive multiple of H_kv";
    case Errc::unsupported_head_dim: return "unsupported head dim: cellkv supports 64, 128 and 256";
    case Errc::unsupported_dtype: return "unsupported dtype: cellkv supports bf16, fp16 and fp32";
    case Errc::misaligned_pointer: return "misaligned pointer: tensors must be 16-byte aligned";
    case Errc::bad_argument: return "bad argument: a value outside its documented range";
    case Errc::device_error: return "device error: a CUDA call failed";
    case Errc::size_overflow: return "size overflow: the configuration's sizes overflow size_t or int32";
    case Errc::bad_device_row:
      return "bad device row: a device write met a row outside the pool; the write went to the scratch row";
    case Errc::out_of_memory: return "out of memory: the configuration needs more host memory than the budget";
    case Errc::position_collision:
      return "position collision: the edit would give a sequence two cells at one position";
    case Errc::unsupported_by_layout:
      return "unsupported by layout: this layout cannot make the edit (the sequence layout keeps rows at their "
             "positions, so it removes only a suffix and never copies or moves positions)";
    case Errc::out_of_pages:
      return "out of pages: the position table has too few free pages for the edit or step (holes spread "
             "positions over more pages)";
    case Errc::state_truncated: return "state truncated: the bytes end before the header or payload they declare";
    case Errc::state_bad_magic: return "state bad magic: not a cellkv sequence state";
    case Errc::state_bad_version: return "state bad version: a format version this build does not read";
    case Errc::state_mismatch:
      return "state mismatch: saved from a pool of another shape, element type or window set";
    case Errc::state_corrupt: return "state corrupt: the checksum or the header's fields disagree with the bytes";
    case Errc::state_too_large: return "state too large: more positions than the cache could ever hold";
    case Errc::io_error: return "I/O error: a state file could not be opened, read or written";
    case Errc::no_key_rotation:
      return "no key rotation: seq_add / seq_div move cells whose K must be re-rotated; set the device cache's key "
             "rotation first (set_key_rotation: RoPE, a caller kernel, or none)";
    case Errc::rows_pending:
      return "rows pending: the pool does not hold the sequence's rows yet (a step writing it is not committed, or "
             "row copies or K re-rotations wait for the next upload or HostPool::sync)";
    case Errc::upload_incomplete:
      return "upload incomplete: a device applied part of the pending copies and key re-rotations (a failed or partial "
             "upload); upload the placed step on every device before a verb that could change them";
    case Errc::missing_step_kernels:
      return "missing step kernels: a replayed graph was captured (GraphScope::step_kinds) without an attention "
             "kernel this step needs, so its attention was not computed; replay the graph of the step's graph_key()";
    case Errc::out_of_window_cells:
      return "out of window cells: a window pool (CacheConfig::window_cells) has fewer free cells than the step or "
             "edit needs";
    case Errc::window_evicted:
      return "window evicted: the result would need positions a window pool has let go of (they fell out of the "
             "window); recompute them instead";
  }
  return "unknown status";
}

// The outcome of a call that produces no value. Cheap to copy; compare with Errc directly.
class [[nodiscard]] Status {
 public:
  constexpr Status() noexcept = default;
  constexpr Status(Errc code) noexcept : code_(code) {}  // NOLINT: implicit by design

  [[nodiscard]] constexpr bool ok() const noexcept { return code_ == Errc::ok; }
  [[nodiscard]] constexpr Errc code() const noexcept { return code_; }
  [[nodiscard]] constexpr std::string_view message() const noexcept { return describe(code_); }
  constexpr explicit operator bool() const noexcept { return ok(); }

  friend constexpr bool operator==(Status a, Status b) noexcept { return a.code_ == b.code_; }
  friend constexpr bool operator==(Status a, Errc b) noexcept { return a.code_ == b; }

 private:
  Errc code_ = Errc::ok;
};

// What value() throws on a refused result (as std::expected::value throws bad_expected_access).
class BadResultAccess : public std::exception {
 public:
  explicit BadResultAccess(Errc code) noexcept : code_(code) {}
  [[nodiscard]] Errc code() const noexcept { return code_; }
  [[nodiscard]] const char* what() const noexcept override {
    return "cellkv::Result::value() on a refused result (status() says why)";
  }

 private:
  Errc code_;
};

// A value or the reason there is none. `value()` on a refused result throws BadResultAccess, so a
// refusal can never pass for a value (a sequence id 0, say); check ok() or use value_or().
template <class T>
class [[nodiscard]] Result {
 public:
  constexpr Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  constexpr Result(Errc code) noexcept : status_(code) {}  // NOLINT: implicit by design

  [[nodiscard]] constexpr bool ok() const noexcept { return status_.ok(); }
  [[nodiscard]] constexpr Status status() const noexcept { return status_; }
  [[nodiscard]] constexpr const T& value() const& {
    if (!ok()) throw BadResultAccess(status_.code());
    return value_;
  }
  [[nodiscard]] constexpr T& value() & {
    if (!ok()) throw BadResultAccess(status_.code());
    return value_;
  }
  [[nodiscard]] constexpr T value_or(T fallback) const { return ok() ? value_ : fallback; }
  constexpr explicit operator bool() const noexcept { return ok(); }

 private:
  T value_{};
  Status status_{};
};

}  // namespace cellkv
