// cellkv/detail/cache_common.hpp - the step protocol and verbs shared by both layouts.
//
// `CacheCommon<Derived, W, MaxSeqs>` owns the sequence table (live ids and each sequence's length,
// i.e. pos(s)) and the placed step; the layout (Derived) decides where rows live through these hooks:
//
//   Status  room_for_step(span<const int32_t> seqs, span<const int32_t> count_per_seq)
//   void    before_placement(span<const int32_t> seqs)     // admission passed, nothing placed yet
//   int64_t claim_row(int32_t t, int32_t seq, int32_t pos) // a fresh row for token t at (seq, pos)
//   void    after_placement()                              // every token placed
//   span<const int64_t> window_rows(int32_t T), window_read_lens()  // StepPlan's window parts
//   void    truncate_rows(int32_t seq, int32_t keep)       // release positions >= keep of seq
//   Status  room_for_clone(int32_t src, int32_t upto)      // resources a fork needs, else why not
//   int32_t share_prefix(int32_t src, int32_t dst, int32_t upto)  // dst gets src's positions < upto;
//                                                          // returns dst's length
//   void    on_seq_created(int32_t seq)                    // a fresh id, before share_prefix
//   int64_t occupied_end()                                 // 1 + highest occupied row, 0 if none
//   void    clear_rows()                                   // release everything
//   void    for_each_visible_row(int32_t window, int32_t seq, int32_t lo_pos, int32_t hi_pos, F f)
//   int32_t row_pos(int32_t window, int64_t row), bool row_owned_by(int32_t window, int64_t row, int32_t seq)
//   int64_t rows_of_window(int32_t window), read_len_of_window(int32_t window)  // the pool a
//   span<const int64_t> step_rows_of_window(int32_t window)   // window's layers use, the step's rows there
//   static Status validate_rows(const CacheConfig&)      // the layout's sizes (max_seqs filled in)
//   static size_t layout_host_bytes(const CacheConfig&)  // the layout's host bytes, once valid
//   int32_t first_position(int32_t seq)                    // lowest held position, -1 when none
//   Result<int32_t> remove_positions(int32_t seq, int32_t lo, int32_t hi)
//   Result<int32_t> copy_positions(int32_t src, int32_t dst, int32_t lo, int32_t hi)
//   Result<int32_t> move_positions(int32_t seq, int32_t lo, int32_t hi, F to)  // to(int64 p) -> int64
//                    the edits of docs/design.md section 4 ("Sequence edits") on positions [lo, hi)
//                    (0 <= lo, hi <= pos(seq); src's for a copy), returning the edited sequence's new
//                    length, or the refusal, having changed nothing
//   Status  room_for_restore(span<const int32_t> positions) // resources for a restored sequence
//   void    restore_rows(int32_t seq, span<const int32_t> positions)  // fresh rows for them
//   int64_t row_at(int32_t seq, int32_t pos)              // row of a held position, -1 for a hole
//   void    for_each_held(int32_t seq, F f)               // f(pos, row) for held positions, ascending
//
// Invariant: sequence s holds positions in [0, pos(s)), position pos(s) - 1 among them; the
// positions below it it does not hold are holes (only a range edit makes them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>


#include "cellkv/seq_set.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"
#include "cellkv/visibility.hpp"
#include "cellkv/windows.hpp"

namespace cellkv::detail {

inline constexpr std::int64_t kInt32Max = 2147483647;

template <class Derived, WindowSet W, std::int32_t MaxSeqs>
class CacheCommon {
  static_assert(MaxSeqs >= 1 && MaxSeqs <= kMaxSeqsLimit,
                "cellkv::KVCache<..., MaxSeqs>: MaxSeqs must lie in [1, 65536]");

 public:
  using Windows = W;
  using Owners = SeqSet<MaxSeqs>;
  static constexpr std::int32_t kMaxSeqs = MaxSeqs;

  // ---- the step protocol (docs/design.md section 4) ----

  // Admission gate and placement. Refuses, changing nothing, on: T == 0, T > max_write, an id out
  // of range or not live, or no room. On success every token has a fresh row and a derived
  // position, read_len is updated, and the previous step (if any) is replaced.
  Result<StepPlan> declare_step(std::span<const std::int32_t> seq_ids) {
    if (const Status s = admit(seq_ids); !s.ok()) return s.code();
    const auto T = static_cast<std::int32_t>(seq_ids.size());
    self().before_placement(seq_ids);
    for (std::int32_t t = 0; t < T; ++t) {
      const std::int32_t s = seq_ids[t];
      const std::int32_t p = len_[s]++;
      step_seqs_[t] = s;
      step_pos_[t] = p;
      step_rows_[t] = self().claim_row(t, s, p);
    }
    self().after_placement();
    step_tokens_ = T;
    step_segment_count_ = split_segments(std::span<const std::int32_t>(step_seqs_.data(), static_cast<std::size_t>(T)),
                                         std::span<const std::int32_t>(step_pos_.data(), static_cast<std::size_t>(T)),
                                         step_segments_);
    read_len_ = self().occupied_end();
    placed_ = true;
    ++serial_;
    return step();
  }

  // The placed step, or an empty one (tokens 0, no rows, read_len 0, the last serial) when no step
  // is placed or a verb ran since: a stale step is never handed out. require_step() tells which.
  [[nodiscard]] StepPlan step() const noexcept {
    if (!placed_) return StepPlan{0, {}, {}, {}, {}, 0, serial_, {}, {}};
    const auto T = static_cast<std::size_t>(step_tokens_);
    return StepPlan{step_tokens_,
                    std::span<const std::int64_t>(step_rows_.data(), T),
                    std::span<const std::int32_t>(step_seqs_.data(), T),
                    std::span<const std::int32_t>(step_pos_.data(), T),
                    std::span<const Segment>(step_segments_.data(), static_cast<std::size_t>(step_segment_count_)),
                    read_len_,
                    serial_,
                    self().window_rows(step_tokens_),
                    self().window_read_lens()};
  }
  [[nodiscard]] bool step_placed() const noexcept { return placed_; }
  [[nodiscard]] std::uint64_t step_serial() const noexcept { return serial_; }
  // Ok when a step is placed and no verb ran since; the gate a forward checks.
  [[nodiscard]] Status require_step() const noexcept { return placed_ ? Status{} : Status{Errc::no_step_declared}; }

  // ---- verbs (run between steps; each successful verb invalidates a placed step) ----

  // A new, empty sequence with the lowest free id.
  Result<std::int32_t> seq_new() {
    const std::int32_t id = live_.first_absent(config_.max_seqs);
    if (id < 0) return Errc::no_free_sequence;
    live_.set(id);
    len_[id] = 0;
    self().on_seq_created(id);
    placed_ = false;
    return id;
  }

  // A new sequence sharing src's positions < upto (all of them when upto is omitted); its length
  // ends at src's highest held position below upto. The cell layout may refuse out_of_pages (a
  // copied partial page) after the id checks.
  Result<std::int32_t> seq_clone(std::int32_t src, std::int32_t upto = -1) {
    if (const Status s = check_live(src); !s.ok()) return s.code();
    if (upto == -1) upto = len_[src];
    if (upto < 0 || upto > len_[src]) return Errc::bad_position;
    const std::int32_t id = live_.first_absent(config_.max_seqs);
    if (id < 0) return Errc::no_free_sequence;
    if (const Status s = self().room_for_clone(src, upto); !s.ok()) return s.code();
    live_.set(id);
    self().on_seq_created(id);
    len_[id] = self().share_prefix(src, id, upto);
    placed_ = false;
    return id;
  }

  // Drops the sequence; its id becomes free, and rows no other sequence holds are released.
  Status seq_rm(std::int32_t id) {
    if (const Status s = check_live(id); !s.ok()) return s;
    self().truncate_rows(id, 0);
    len_[id] = 0;
    live_.reset(id);
    placed_ = false;
    return {};
  }

  // Keeps positions < pos of the sequence; 0 <= pos <= pos(id). The same as seq_rm(id, pos, -1),
  // save that pos is checked.
  Status rewind(std::int32_t id, std::int32_t pos) {
    if (const Status s = check_live(id); !s.ok()) return s;
    if (pos < 0 || pos > len_[id]) return Errc::bad_position;
    return finish_edit(id, self().remove_positions(id, pos, len_[id]));
  }

  // ---- sequence edits (docs/design.md section 4, "Sequence edits") ----
  //
  // Ranges are [p0, p1): p0 < 0 means 0, p1 < 0 means no end; an empty range is a successful
  // no-op for every sequence's positions and cells (the placement and the window pools still hear
  // of the edit: docs/design.md, "Sequence edits"). Refusals, in this order: the ids
  // (bad_sequence_id, sequence_not_live), the arguments (bad_argument), the layout
  // (unsupported_by_layout), the result (sequence_full: a position past the layout's limit;
  // position_collision), then resources (out_of_cells, out_of_pages).

  // Removes the positions [p0, p1) the sequence holds; holes stay, pos(id) becomes one past the
  // highest position left. The sequence layout removes only a suffix (p1 past the last position).
  Status seq_rm(std::int32_t id, std::int32_t p0, std::int32_t p1) {
    if (const Status s = check_live(id); !s.ok()) return s;
    const auto [lo, hi] = own_range(id, p0, p1);
    return finish_edit(id, self().remove_positions(id, lo, hi));
  }

  // dst also holds src's cells at their positions in [p0, p1) (zero copy); refused when dst holds
  // another cell at one of them (position_collision). src == dst is a no-op. Cell layout only.
  Status seq_cp(std::int32_t src, std::int32_t dst, std::int32_t p0, std::int32_t p1) {
    if (const Status s = check_live(src); !s.ok()) return s;
    if (const Status s = check_live(dst); !s.ok()) return s;
    const auto [lo, hi] = own_range(src, p0, p1);
    return finish_edit(dst, self().copy_positions(src, dst, lo, hi));
  }

  // Removes every live sequence but id.
  Status seq_keep(std::int32_t id) {
    if (const Status s = check_live(id); !s.ok()) return s;
    const Owners others = live_;
    others.for_each([&](std::int32_t s) {
      if (s != id) (void)seq_rm(s);
    });
    placed_ = false;
    return {};
  }

  // Positions p in [p0, p1) become p + delta; a cell moved below 0 leaves the sequence. A cell the
  // sequence shares is copied for it (copy on write), so no other sequence changes. Cell layout.
  Status seq_add(std::int32_t id, std::int32_t p0, std::int32_t p1, std::int32_t delta) {
    if (const Status s = check_live(id); !s.ok()) return s;
    const auto [lo, hi] = own_range(id, p0, p1);
    const std::int64_t d = delta;
    return finish_edit(id, self().move_positions(id, lo, hi, [d](std::int64_t p) { return p + d; }));
  }

  // Positions p in [p0, p1) become p / d (d >= 1, else bad_argument); refused when two cells would
  // meet at one position (position_collision). Copy on write as seq_add. Cell layout.
  Status seq_div(std::int32_t id, std::int32_t p0, std::int32_t p1, std::int32_t d) {
    if (const Status s = check_live(id); !s.ok()) return s;
    if (d < 1) return Errc::bad_argument;
    const auto [lo, hi] = own_range(id, p0, p1);
    const std::int64_t dd = d;
    return finish_edit(id, self().move_positions(id, lo, hi, [dd](std::int64_t p) { return p / dd; }));
  }

  // Lowest and highest position the sequence holds; -1 for both when it holds none (a new
  // sequence, or one whose positions were all removed). seq_pos_max(id) == pos(id) - 1.
  [[nodiscard]] Result<std::int32_t> seq_pos_min(std::int32_t id) const {
    if (const Status s = check_live(id); !s.ok()) return s.code();
    return self().first_position(id);
  }
  [[nodiscard]] Result<std::int32_t> seq_pos_max(std::int32_t id) const {
    if (const Status s = check_live(id); !s.ok()) return s.code();
    return len_[id] - 1;
  }

  // ---- saved state (sequence_state.hpp holds the byte format) ----

  // The positions the sequence holds, ascending, and the row of each (where its K and V live).
  [[nodiscard]] Result<std::vector<std::int32_t>> held_positions(std::int32_t id) const {
    if (const Status s = check_live(id); !s.ok()) return s.code();
    std::vector<std::int32_t> out;
    self().for_each_held(id, [&](std::int32_t p, std::int64_t) { out.push_back(p); });
    return out;
  }
  // Row of position pos of a live sequence, -1 for a hole; precondition 0 <= pos < pos(id).
  [[nodiscard]] std::int64_t row_of(std::int32_t id, std::int32_t pos) const { return self().row_at(id, pos); }

  // A new sequence (lowest free id) holding exactly `positions` (strictly ascending, >= 0), each
  // in a fresh row (the placement's pick, in order); the caller then fills the rows (row_of).
  // Refusals: bad_argument (positions not strictly ascending from >= 0), sequence_full (past the
  // layout's position limit), unsupported_by_layout (the sequence layout and a hole),
  // no_free_sequence, then out_of_cells / out_of_pages.
  Result<std::int32_t> restore_positions(std::span<const std::int32_t> positions) {
    for (std::size_t i = 0; i < positions.size(); ++i)
      if (positions[i] < 0 || (i > 0 && positions[i] <= positions[i - 1])) return Errc::bad_argument;
    if (!positions.empty() && positions.back() >= self().position_limit()) return Errc::sequence_full;
    if (!Derived::kHoles && !positions.empty() && positions.back() + 1 != static_cast<std::int32_t>(positions.size()))
      return Errc::unsupported_by_layout;
    const std::int32_t id = live_.first_absent(config_.max_seqs);
    if (id < 0) return Errc::no_free_sequence;
    if (const Status s = self().room_for_restore(positions); !s.ok()) return s.code();
    live_.set(id);
    len_[id] = 0;
    self().on_seq_created(id);
    self().restore_rows(id, positions);
    len_[id] = positions.empty() ? 0 : positions.back() + 1;
    placed_ = false;
    return id;
  }

  // Drops every sequence and releases every row.
  void clear() {
    self().clear_rows();
    live_.clear();
    std::fill(len_.begin(), len_.end(), 0);
    placed_ = false;
    read_len_ = 0;
  }

  // ---- queries ----

  // One past the highest position the sequence holds (0 when none): the next token's position.
  [[nodiscard]] Result<std::int32_t> pos(std::int32_t id) const {
    if (const Status s = check_live(id); !s.ok()) return s.code();
    return len_[id];
  }
  [[nodiscard]] bool is_live(std::int32_t id) const noexcept { return in_range(id) && live_.test(id); }
  [[nodiscard]] std::int32_t live_count() const noexcept { return live_.count(); }
  [[nodiscard]] const Owners& live_sequences() const noexcept { return live_; }
  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] std::int32_t max_write() const noexcept { return config_.max_write; }
  [[nodiscard]] std::int32_t max_seqs() const noexcept { return config_.max_seqs; }
  // 1 + highest occupied row now (0 if none); equals the step's read_len right after placement.
  [[nodiscard]] std::int64_t used_end() const { return self().occupied_end(); }

  // Visibility of `row` to token t of the placed step through a layer of window `window`
  // (docs/design.md section 3), computed from the row's metadata; `row` indexes the pool that
  // window's layers use (pool_rows(window) rows: the cache's, or with window storage the window's
  // own). Refuses no_step_declared when no step is placed (or a verb ran since), bad_argument for t
  // outside [0, T), a row outside [0, pool_rows(window)) or a negative window.
  [[nodiscard]] Result<bool> visible(std::int32_t t, std::int64_t row, std::int32_t window) const {
    if (const Status s = check_query(t, window); !s.ok()) return s.code();
    if (row < 0 || row >= self().rows_of_window(window)) return Errc::bad_argument;
    const std::int32_t s = step_seqs_[static_cast<std::size_t>(t)], p = step_pos_[static_cast<std::size_t>(t)];
    const std::int32_t rp = self().row_pos(window, row);
    return rp >= 0 && self().row_owned_by(window, row, s) && sees(window, p, rp);
  }

  // The placed step's rows in the pool that layers of window `window` use (StepPlan::rows, or
  // with window storage a window pool's StepPlan::window_rows), and that pool's read_len and rows.
  // Empty / 0 when no step is placed.
  [[nodiscard]] std::span<const std::int64_t> step_rows(std::int32_t window) const noexcept {
    return self().step_rows_of_window(window);
  }
  [[nodiscard]] std::int64_t read_len(std::int32_t window) const noexcept {
    return placed_ ? self().read_len_of_window(window) : 0;
  }
  [[nodiscard]] std::int64_t pool_rows(std::int32_t window) const noexcept { return self().rows_of_window(window); }

  // Mask row of token t for window `window` over columns [0, out.size()) (rows of that window's
  // pool); 1 = visible. Refuses, writing nothing, what visible() refuses and an `out` shorter than
  // read_len(window) (bad_shape).
  // Cost: O(out.size()) to clear plus O(visible rows).
  Status mask_row(std::int32_t window, std::int32_t t, std::span<std::uint8_t> out) const {
    if (const Status s = check_query(t, window); !s.ok()) return s;
    if (static_cast<std::int64_t>(out.size()) < self().read_len_of_window(window)) return Errc::bad_shape;
    std::fill(out.begin(), out.end(), std::uint8_t{0});
    const PositionRange seen = visible_positions(window, step_pos_[static_cast<std::size_t>(t)]);
    self().for_each_visible_row(window, step_seqs_[static_cast<std::size_t>(t)], seen.begin, seen.end,
                                [&](std::int64_t row) { out[static_cast<std::size_t>(row)] = 1; });
    return {};
  }

  // Validates sizes without building: the reason a config would be refused, or ok. bad_argument:
  // max_write < 1, max_seqs outside [0, MaxSeqs], max_cells < 1 (cell layout), max_len < 1
  // (sequence layout). size_overflow: an index past int32 (4 max_write table writes per step; the
  // cell layout's position table; the sequence layout's max_seqs x max_len rows plus the scratch row).
  static Status validate(const CacheConfig& c) {
    if (c.max_write < 1 || c.max_seqs < 0 || c.max_seqs > MaxSeqs) return Errc::bad_argument;
    if (c.max_write > kInt32Max / 4) return Errc::size_overflow;
    return Derived::validate_rows(normalized(c));
  }

  // Host bytes a cache of `config` holds at most: its own object, the step arrays, the per-sequence
  // arrays and the layout's (detail::*_layout_cache.hpp says what each counts). Refuses what
  // validate refuses. Check it, or fits_within, before building a cache from untrusted sizes.
  static Result<std::size_t> host_bytes(const CacheConfig& config) {
    if (const Status s = validate(config); !s.ok()) return s.code();
    const CacheConfig c = normalized(config);
    const auto step = static_cast<std::size_t>(c.max_write) * (8 + 4 + 4 + sizeof(Segment));
    const auto seqs = static_cast<std::size_t>(MaxSeqs) * 8;
    return sizeof(Derived) + step + seqs + Derived::layout_host_bytes(c);
  }

  // Ok when a cache of `config` holds at most `budget` host bytes (host_bytes); out_of_memory when
  // it would hold more, and what validate refuses.
  static Status fits_within(const CacheConfig& config, std::size_t budget) {
    const Result<std::size_t> bytes = host_bytes(config);
    if (!bytes.ok()) return bytes.status();
    return bytes.value() <= budget ? Status{} : Status{Errc::out_of_memory};
  }

  friend bool operator==(const CacheCommon&, const CacheCommon&) = default;

 protected:
  explicit CacheCommon(CacheConfig config) : config_(normalized(config)) {
    if (const Status s = validate(config_); !s.ok())
      throw std::invalid_argument("cellkv::KVCache: invalid CacheConfig (" + std::string(s.message()) + ")");
    const auto w = static_cast<std::size_t>(config_.max_write);
    step_rows_.assign(w, 0);
    step_seqs_.assign(w, 0);
    step_pos_.assign(w, 0);
    step_segments_.assign(w, Segment{});
    len_.assign(static_cast<std::size_t>(MaxSeqs), 0);
    step_count_.assign(static_cast<std::size_t>(MaxSeqs), 0);
  }

  [[nodiscard]] std::int32_t length(std::int32_t s) const noexcept { return len_[s]; }

  // The gate of every query about token t of the placed step (visible, mask_row, visible_range).
  [[nodiscard]] Status check_query(std::int32_t t, std::int32_t window) const noexcept {
    if (!placed_) return Errc::no_step_declared;
    if (t < 0 || t >= step_tokens_ || window < 0) return Errc::bad_argument;
    return {};
  }

 private:
  static CacheConfig normalized(CacheConfig c) {
    if (c.max_seqs == 0) c.max_seqs = MaxSeqs;
    return c;
  }
  [[nodiscard]] bool in_range(std::int32_t id) const noexcept { return id >= 0 && id < config_.max_seqs; }

  // [p0, p1) with p0 < 0 read as 0 and p1 < 0 as no end, clipped to the sequence's [0, pos(id)).
  struct Span {
    std::int32_t lo, hi;
  };
  [[nodiscard]] Span own_range(std::int32_t id, std::int32_t p0, std::int32_t p1) const noexcept {
    const std::int32_t hi = std::min(p1 < 0 ? std::numeric_limits<std::int32_t>::max() : p1, len_[id]);
    return {std::min(std::max(p0, 0), hi), hi};
  }
  // A layout edit's outcome: on success the sequence's new length, and the step is invalidated.
  Status finish_edit(std::int32_t id, Result<std::int32_t> len) {
    if (!len.ok()) return len.status();
    len_[id] = len.value();
    placed_ = false;
    return {};
  }
  [[nodiscard]] Status check_live(std::int32_t id) const noexcept {
    if (!in_range(id)) return Errc::bad_sequence_id;
    return live_.test(id) ? Status{} : Status{Errc::sequence_not_live};
  }

  // Every refusal of declare_step, in the order docs/design.md lists them; changes nothing.
  Status admit(std::span<const std::int32_t> seq_ids) {
    if (seq_ids.empty()) return Errc::empty_step;
    if (seq_ids.size() > static_cast<std::size_t>(config_.max_write)) return Errc::step_too_wide;
    for (const std::int32_t s : seq_ids)
      if (const Status st = check_live(s); !st.ok()) return st;
    for (const std::int32_t s : seq_ids) ++step_count_[s];
    const Status room = self().room_for_step(seq_ids, step_count_);
    for (const std::int32_t s : seq_ids) step_count_[s] = 0;
    return room;
  }

  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  CacheConfig config_;
  Owners live_{};
  std::vector<std::int32_t> len_;         // [MaxSeqs] pos(s)
  std::vector<std::int32_t> step_count_;  // [MaxSeqs] scratch, all zero between calls
  std::vector<std::int64_t> step_rows_;   // [max_write]
  std::vector<std::int32_t> step_seqs_;   // [max_write]
  std::vector<std::int32_t> step_pos_;    // [max_write]
  std::vector<Segment> step_segments_;     // [max_write]
  std::int32_t step_tokens_ = 0;
  std::int32_t step_segment_count_ = 0;
  std::int64_t read_len_ = 0;
  std::uint64_t serial_ = 0;
  bool placed_ = false;
};

}  // namespace cellkv::detail
