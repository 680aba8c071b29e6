// Differential driver: applies random operations to a CellCache and to the oracle (oracle.hpp)
// and checks that both agree after every one.
//
// The random source is an `Entropy`: `GeneratorEntropy` wraps a std::mt19937_64 (the doctest
// suite), `ByteEntropy` reads fuzz input bytes (the libFuzzer harness) and reports exhaustion.
//
// Per operation the driver checks: the status (refusals in docs/design.md's order); on a refusal, that
// the cache compares == to a copy taken before the call (strong guarantee); on a placed step, the
// tokens' positions and rows (exact for lowest_free and the sequence layout, free + distinct for
// clustered placements), read_len and the serial. After every operation it checks the whole
// observable state: capacity, free_cells, used_end, live ids, pos of every id (in range or not),
// the placed step, every mask row of every distinct window of the window set against the oracle's
// visibility over [0, read_len), visible() on random rows, and per layout: for the cell layout the
// cell metadata (cell_pos, cell_owners, cell_of) and the position table as a device would hold it
// (a copy that only ever received the pending table writes, each listed once, must map every
// owner's position to the oracle's row; the live pages stay within their bound); for the sequence
// layout the visible row range and the pending fork copies.
//
// Sequence edits (seq_rm of a range, seq_cp, seq_keep, seq_add, seq_div, seq_pos_min/max) are
// checked the same way; the cell layout's pending copy-on-write copies and re-rotations are
// compared with the oracle's, and the device table must read -1 at every hole. The oracle does
// not model table pages: a step or fork refused with out_of_pages must need more pages than the
// table has free (computed exactly from lengths), an edit refused so must find fewer free pages
// than the pages it touches, plus one.
//
// A mismatch is returned as a message (operation number, operation, expected vs got, the last
// few operations); the driver never aborts, so the caller can print its seed.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <limits>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "after_last_placement.hpp"
#include "cellkv/attention_plan.hpp"
#include "cellkv/kv_cache.hpp"
#include "oracle.hpp"

namespace cellkv::test {

// ---- random sources ----

class Entropy {
 public:
  virtual ~Entropy() = default;
  // A value in [0, n); n >= 1.
  virtual std::uint32_t below(std::uint32_t n) = 0;
  // True once a finite source is used up (draws then return 0); a generator never is.
  [[nodiscard]] virtual bool exhausted() const { return false; }

  // A value in [lo, hi]; lo <= hi.
  std::int32_t range(std::int32_t lo, std::int32_t hi) {
    return lo + static_cast<std::int32_t>(below(static_cast<std::uint32_t>(hi - lo) + 1));
  }

 protected:
  Entropy() = default;
  Entropy(const Entropy&) = default;
  Entropy& operator=(const Entropy&) = default;
};

class GeneratorEntropy final : public Entropy {
 public:
  explicit GeneratorEntropy(std::uint64_t seed) : rng_(seed) {}
  std::uint32_t below(std::uint32_t n) override { return n <= 1 ? 0 : static_cast<std::uint32_t>(rng_() % n); }

 private:
  std::mt19937_64 rng_;
};

// Reads as few bytes as a draw needs (one for n <= 256), so every fuzz byte steers a choice.
class ByteEntropy final : public Entropy {
 public:
  ByteEntropy(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint32_t below(std::uint32_t n) override {
    if (n <= 1) return 0;
    std::uint32_t v = 0;
    for (std::uint32_t rest = n - 1; rest != 0; rest >>= 8) v = (v << 8) | next_byte();
    return v % n;
  }
  [[nodiscard]] bool exhausted() const override { return at_ >= size_; }
  std::uint8_t next_byte() { return at_ < size_ ? data_[at_++] : std::uint8_t{0}; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

// ---- formatting ----

inline std::string_view errc_name(Errc e) {
  switch (e) {
    case Errc::ok: return "ok";
    case Errc::empty_step: return "empty_step";
    case Errc::step_too_wide: return "step_too_wide";
    case Errc::bad_sequence_id: return "bad_sequence_id";
    case Errc::sequence_not_live: return "sequence_not_live";
    case Errc::out_of_cells: return "out_of_cells";
    case Errc::sequence_full: return "sequence_full";
    case Errc::no_free_sequence: return "no_free_sequence";
    case Errc::bad_position: return "bad_position";
    case Errc::no_step_declared: return "no_step_declared";
    case Errc::bad_argument: return "bad_argument";
    case Errc::position_collision: return "position_collision";
    case Errc::unsupported_by_layout: return "unsupported_by_layout";
    case Errc::out_of_pages: return "out_of_pages";
    default: return describe(e);
  }
}

template <class Range>
std::string list_str(const Range& r) {
  std::ostringstream out;
  out << '[';
  bool first = true;
  for (const auto& x : r) {
    out << (first ? "" : ",") << x;
    first = false;
  }
  out << ']';
  return out.str();
}

inline std::string bits_str(std::span<const std::uint8_t> bits) {
  std::string s;
  for (const std::uint8_t b : bits) s += b ? '1' : '0';
  return s;
}

// ---- counters a test can assert on (that refusals and forks really happened) ----

enum class OpKind : std::uint8_t {
  declare_step, seq_new, seq_clone, seq_rm, rewind, query, acknowledge, copy, clear,
  seq_rm_range, seq_cp, seq_keep, seq_add, seq_div, pos_range, restore
};
inline constexpr std::size_t kOpKinds = 16;
inline constexpr std::size_t kCodes = 32;

struct DriverStats {
  std::array<std::int64_t, kOpKinds> ops{};
  std::array<std::int64_t, kCodes> codes{};  // by Errc value, over every status-returning operation
  std::int64_t tokens_placed = 0;
  std::int64_t mask_rows_checked = 0;
  std::int64_t max_read_len = 0;
  std::int32_t max_owners = 0;  // most owners one row had (cell layout: > 1 after a fork)
  std::int32_t max_live = 0;
  std::int32_t max_pages = 0;   // most position-table pages in use (cell layout)
  std::int32_t max_seq_len = 0;  // longest sequence, in positions
  std::int64_t holes = 0;        // states checked with at least one hole (cell layout)
  std::int64_t cow_copies = 0;   // copy-on-write copies seen pending (cell layout)
  std::int64_t rotations = 0;    // re-rotations seen pending (cell layout)
  std::int64_t edits_ok = 0;     // range edits (seq_rm range, seq_cp, seq_add, seq_div) that succeeded

  [[nodiscard]] std::int64_t count(Errc e) const { return codes[static_cast<std::size_t>(e)]; }
  [[nodiscard]] std::int64_t total_ops() const {
    std::int64_t n = 0;
    for (const auto x : ops) n += x;
    return n;
  }
  void add(const DriverStats& o) {
    for (std::size_t i = 0; i < kOpKinds; ++i) ops[i] += o.ops[i];
    for (std::size_t i = 0; i < kCodes; ++i) codes[i] += o.codes[i];
    tokens_placed += o.tokens_placed;
    mask_rows_checked += o.mask_rows_checked;
    max_read_len = std::max(max_read_len, o.max_read_len);
    max_owners = std::max(max_owners, o.max_owners);
    max_live = std::max(max_live, o.max_live);
    max_pages = std::max(max_pages, o.max_pages);
    max_seq_len = std::max(max_seq_len, o.max_seq_len);
    holes += o.holes;
    cow_copies += o.cow_copies;
    rotations += o.rotations;
    edits_ok += o.edits_ok;
  }
  [[nodiscard]] std::int64_t op(OpKind k) const { return ops[static_cast<std::size_t>(k)]; }
};

// Relative weights of the operations the driver draws (any non-negative values, not all zero).
struct OpMix {
  std::uint32_t declare_step = 420, seq_new = 100, seq_clone = 90, seq_rm = 70, rewind = 110, query = 80,
                acknowledge = 115, copy = 10, clear = 5;
  std::uint32_t seq_rm_range = 45, seq_cp = 40, seq_keep = 3, seq_add = 60, seq_div = 25, pos_range = 20, restore = 25;
};

// ---- the driver ----

template <class Cache>
class OpDriver {
 public:
  static constexpr bool kCellLayout = std::is_same_v<typename Cache::Layout, layout::cell>;
  static constexpr oracle::Kind kKind =
      !kCellLayout ? oracle::Kind::sequence_slots
                   : (std::is_same_v<typename Cache::PlacementPolicy, placement::lowest_free>
                          ? oracle::Kind::cell_lowest_free
                      : std::is_same_v<typename Cache::PlacementPolicy, test::after_last>
                          ? oracle::Kind::cell_after_last
                          : oracle::Kind::cell_any_free);
  using Windows = typename Cache::Windows;

  explicit OpDriver(const CacheConfig& config, const OpMix& mix = {})
      : config_(config), mix_(mix), cache_(config), model_(oracle_config(config)) {
    if constexpr (kCellLayout) device_table_.assign(cache_.table().flat().size(), -1);
  }

  // One random operation on both; "" when they agree, else a description of the mismatch.
  std::string step(Entropy& e) {
    err_.clear();
    desc_.clear();
    ++op_number_;
    const std::array<std::uint32_t, kOpKinds> w{mix_.declare_step, mix_.seq_new, mix_.seq_clone, mix_.seq_rm, mix_.rewind,
                                                 mix_.query, mix_.acknowledge, mix_.copy, mix_.clear,
                                                 mix_.seq_rm_range, mix_.seq_cp, mix_.seq_keep, mix_.seq_add,
                                                 mix_.seq_div, mix_.pos_range, mix_.restore};
    std::uint32_t total = 0;
    for (const std::uint32_t x : w) total += x;
    std::uint32_t r = e.below(std::max<std::uint32_t>(total, 1));
    std::size_t kind = 0;
    while (kind + 1 < w.size() && r >= w[kind]) r -= w[kind++];
    bool ok = false;
    switch (static_cast<OpKind>(kind)) {
      case OpKind::declare_step: ok = op_declare(e); break;
      case OpKind::seq_new: ok = op_seq_new(); break;
      case OpKind::seq_clone: ok = op_seq_clone(e); break;
      case OpKind::seq_rm: ok = op_seq_rm(e); break;
      case OpKind::rewind: ok = op_rewind(e); break;
      case OpKind::query: ok = op_query(e); break;
      case OpKind::acknowledge: ok = op_acknowledge(); break;
      case OpKind::copy: ok = op_copy(); break;
      case OpKind::clear: ok = op_clear(); break;
      case OpKind::seq_rm_range: ok = op_seq_rm_range(e); break;
      case OpKind::seq_cp: ok = op_seq_cp(e); break;
      case OpKind::seq_keep: ok = op_seq_keep(e); break;
      case OpKind::seq_add: ok = op_seq_move(e, false); break;
      case OpKind::seq_div: ok = op_seq_move(e, true); break;
      case OpKind::pos_range: ok = op_pos_range(e); break;
      case OpKind::restore: ok = op_restore(e); break;
    }
    remember(desc_);
    if (ok) ok = check_state(e);
    return ok ? std::string{} : report();
  }

  // Scripted operations, checked as the random ones are (the fuzz harness fills big caches fast with
  // them): a new sequence; a step of the given ids.
  std::string scripted_seq_new(Entropy& e) {
    return scripted([&] { return op_seq_new(); }, e);
  }
  std::string scripted_declare(const std::vector<std::int32_t>& ids, Entropy& e) {
    return scripted([&] { return declare_ids(ids); }, e);
  }

  // Up to `max_ops` operations, stopping at the first mismatch or when the source runs dry.
  std::string run(Entropy& e, std::int64_t max_ops) {
    for (std::int64_t i = 0; i < max_ops && !e.exhausted(); ++i)
      if (std::string m = step(e); !m.empty()) return m;
    return {};
  }

  [[nodiscard]] std::int64_t ops() const { return op_number_; }
  [[nodiscard]] const DriverStats& stats() const { return stats_; }
  [[nodiscard]] const Cache& cache() const { return cache_; }
  [[nodiscard]] const oracle::Model& model() const { return model_; }

 private:
  struct CellState {
    std::int32_t pos = -1;
    std::set<std::int32_t> owners;
    friend bool operator==(const CellState&, const CellState&) = default;
  };

  static oracle::Config oracle_config(const CacheConfig& c) {
    oracle::Config o;
    o.kind = kKind;
    o.max_write = c.max_write;
    o.max_seqs = c.max_seqs == 0 ? Cache::kMaxSeqs : c.max_seqs;
    o.max_cells = c.max_cells;
    o.max_len = c.max_len;
    return o;
  }

  [[nodiscard]] std::int32_t max_seqs() const { return model_.config().max_seqs; }

  // ---- choosing arguments ----

  // Out of range on either side, including the extremes of int32.
  std::int32_t out_of_range_id(Entropy& e) const {
    const std::array<std::int32_t, 7> bad{-1, -2, max_seqs(), max_seqs() + 1, Cache::kMaxSeqs,
                                          std::numeric_limits<std::int32_t>::max(),
                                          std::numeric_limits<std::int32_t>::min()};
    return bad[e.below(bad.size())];
  }
  // Mostly a live id; sometimes any in-range id (often dead); sometimes out of range.
  std::int32_t pick_id(Entropy& e) const {
    const std::uint32_t r = e.below(10);
    const auto& live = model_.live();
    if (r < 8 && !live.empty()) return *std::next(live.begin(), static_cast<std::ptrdiff_t>(e.below(static_cast<std::uint32_t>(live.size()))));
    if (r < 9) return e.range(0, max_seqs() - 1);
    return out_of_range_id(e);
  }
  // An id a step must refuse: dead in range when there is one, else out of range.
  std::int32_t bad_id(Entropy& e) const {
    if (e.below(2) == 0 && model_.live().size() < static_cast<std::size_t>(max_seqs())) {
      for (std::int32_t id = e.range(0, max_seqs() - 1);; id = (id + 1) % max_seqs())
        if (!model_.is_live(id)) return id;
    }
    return out_of_range_id(e);
  }

  std::vector<std::int32_t> step_ids(Entropy& e) const {
    const std::int32_t W = config_.max_write;
    std::vector<std::int32_t> ids;
    const std::uint32_t r = e.below(100);
    if (r < 3) return ids;  // T == 0
    const std::vector<std::int32_t> live(model_.live().begin(), model_.live().end());
    if (r < 6) {  // T > max_write
      const std::int32_t T = W + e.range(1, 3);
      for (std::int32_t t = 0; t < T; ++t) ids.push_back(live.empty() ? pick_id(e) : live[e.below(static_cast<std::uint32_t>(live.size()))]);
      return ids;
    }
    if (live.empty()) {
      const std::int32_t T = e.range(1, W);
      for (std::int32_t t = 0; t < T; ++t) ids.push_back(pick_id(e));
      return ids;
    }
    if (r < 30) {  // decode: one token per live sequence, rotated, at most max_write
      const auto n = live.size();
      const std::size_t start = e.below(static_cast<std::uint32_t>(n));
      for (std::size_t i = 0; i < n && ids.size() < static_cast<std::size_t>(W); ++i) ids.push_back(live[(start + i) % n]);
    } else {  // prefill / mixed: 1..3 sequences interleaved
      const std::int32_t T = e.range(1, W);
      const auto k = std::min<std::size_t>(live.size(), 1 + e.below(3));
      std::vector<std::int32_t> chosen;
      for (std::size_t i = 0; i < k; ++i) chosen.push_back(live[e.below(static_cast<std::uint32_t>(live.size()))]);
      for (std::int32_t t = 0; t < T; ++t) ids.push_back(chosen[e.below(static_cast<std::uint32_t>(chosen.size()))]);
    }
    if (e.below(100) < 8) ids[e.below(static_cast<std::uint32_t>(ids.size()))] = bad_id(e);
    return ids;
  }

  // ---- operations ----

  template <class Op>
  std::string scripted(Op&& op, Entropy& e) {
    err_.clear();
    desc_.clear();
    ++op_number_;
    bool ok = op();
    remember(desc_);
    if (ok) ok = check_state(e);
    return ok ? std::string{} : report();
  }

  bool op_declare(Entropy& e) { return declare_ids(step_ids(e)); }

  bool declare_ids(const std::vector<std::int32_t>& ids) {
    desc_ = "declare_step(" + list_str(ids) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::declare_step)];
    const Cache before = cache_;
    oracle::Verdict verdict = model_.admit(ids);
    if constexpr (kCellLayout)  // pages for the positions that start one, against the free pages
      if (verdict.code == Errc::ok && step_pages(ids) > cache_.table().free_pages()) verdict = {Errc::out_of_pages};
    const Result<StepPlan> result = cache_.declare_step(ids);
    const Errc got = result.status().code();
    note(got);
    if (!verdict.accepts(got)) {
      std::string want(errc_name(verdict.code));
      if (verdict.alternative != Errc::ok) want += " or " + std::string(errc_name(verdict.alternative));
      return fail("status", want, errc_name(got));
    }
    if (!result.ok()) return unchanged(before);

    const StepPlan plan = result.value();
    const auto T = static_cast<std::int32_t>(ids.size());
    const std::vector<std::int32_t> want_pos = model_.positions(ids);
    const std::vector<std::int64_t> rows(plan.rows.begin(), plan.rows.end());
    if (plan.tokens != T) return fail("plan.tokens", T, plan.tokens);
    if (plan.seqs.size() != ids.size() || !std::equal(ids.begin(), ids.end(), plan.seqs.begin()))
      return fail("plan.seqs", list_str(ids), list_str(plan.seqs));
    if (plan.positions.size() != want_pos.size() || !std::equal(want_pos.begin(), want_pos.end(), plan.positions.begin()))
      return fail("plan.positions", list_str(want_pos), list_str(plan.positions));
    if (const std::string why = model_.check_rows(ids, rows); !why.empty())
      return fail("plan.rows " + list_str(rows), "a valid placement", why);
    if (!check_settled(plan, want_pos, rows)) return false;
    model_.commit_step(ids, rows);
    placed_ = true;
    ++serial_;
    step_ids_ = ids;
    step_pos_ = want_pos;
    step_rows_ = rows;
    step_read_len_ = model_.read_len();
    stats_.tokens_placed += T;
    stats_.max_read_len = std::max(stats_.max_read_len, step_read_len_);
    if (plan.read_len != step_read_len_) return fail("plan.read_len", step_read_len_, plan.read_len);
    if (plan.serial != serial_) return fail("plan.serial", serial_, plan.serial);
    return true;
  }

  // settled_end (attention_plan.hpp), what the decode kernel reads before its wait: below it, a
  // segment's sequence holds only rows from before the step (the model's, not yet committed), none
  // of which the step writes, and the step places none of that sequence's tokens there.
  bool check_settled(const StepPlan& plan, const std::vector<std::int32_t>& positions, const std::vector<std::int64_t>& rows) {
    const std::set<std::int64_t> written(rows.begin(), rows.end());
    for (const Segment& seg : plan.segments) {
      const std::int32_t end = settled_end(seg);
      for (const oracle::Entry& e : model_.entries())
        if (e.pos < end && e.owners.count(seg.seq) != 0 && written.count(e.row) != 0)
          return fail("settled_end of the segment at token " + std::to_string(seg.tok0), "rows the step does not write",
                      "the step writes row " + std::to_string(e.row) + " (position " + std::to_string(e.pos) + ")");
      for (std::size_t t = 0; t < positions.size(); ++t)
        if (plan.seqs[t] == seg.seq && positions[t] < end)
          return fail("settled_end of the segment at token " + std::to_string(seg.tok0), "<= " + std::to_string(positions[t]),
                      end);
    }
    return true;
  }

  bool op_seq_new() {
    desc_ = "seq_new()";
    ++stats_.ops[static_cast<std::size_t>(OpKind::seq_new)];
    const Cache before = cache_;
    std::int32_t want_id = -1;
    const Errc want = model_.seq_new(want_id);
    const Result<std::int32_t> got = cache_.seq_new();
    return verb_outcome(before, want, got.status().code(), got.ok() ? got.value() : -1, want_id);
  }

  bool op_seq_clone(Entropy& e) {
    const std::int32_t src = pick_id(e);
    const std::int32_t len = model_.is_live(src) ? model_.length(src) : e.range(0, 4);
    std::int32_t upto = -1;
    switch (e.below(10)) {
      case 0: case 1: case 2: case 3: upto = -1; break;
      case 4: case 5: case 6: case 7: upto = e.range(0, len); break;
      case 8: upto = len + e.range(1, 3); break;
      default: {
        const std::array<std::int32_t, 4> bad{-2, -100, std::numeric_limits<std::int32_t>::min(),
                                              std::numeric_limits<std::int32_t>::max()};
        upto = bad[e.below(bad.size())];
      }
    }
    desc_ = "seq_clone(" + std::to_string(src) + ", " + std::to_string(upto) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::seq_clone)];
    const Cache before = cache_;
    std::int32_t want_id = -1;
    // A fork copies its partial last page: with no free page it is refused (after the other checks).
    bool no_page = false;
    if constexpr (kCellLayout)
      if (model_.is_live(src)) {
        const std::int32_t u = upto == -1 ? model_.length(src) : upto;
        no_page = u >= 0 && u <= model_.length(src) && (model_.last_held(src, u) + 1) % kPagePositions != 0 &&
                  cache_.table().free_pages() == 0;
      }
    oracle::Model saved = model_;
    Errc want = model_.seq_clone(src, upto, want_id);
    if (want == Errc::ok && no_page) {
      model_ = std::move(saved);
      want = Errc::out_of_pages;
    }
    const Result<std::int32_t> got = cache_.seq_clone(src, upto);
    return verb_outcome(before, want, got.status().code(), got.ok() ? got.value() : -1, want_id);
  }

  bool op_seq_rm(Entropy& e) {
    const std::int32_t id = pick_id(e);
    desc_ = "seq_rm(" + std::to_string(id) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::seq_rm)];
    const Cache before = cache_;
    const Errc want = model_.seq_rm(id);
    const Status got = cache_.seq_rm(id);
    return verb_outcome(before, want, got.code(), 0, 0);
  }

  bool op_rewind(Entropy& e) {
    const std::int32_t id = pick_id(e);
    const std::int32_t len = model_.is_live(id) ? model_.length(id) : e.range(0, 4);
    std::int32_t pos = 0;
    const std::uint32_t r = e.below(10);
    if (r < 8) pos = e.range(0, len);
    else if (r == 8) pos = len + e.range(1, 2);
    else pos = e.below(2) == 0 ? -1 : std::numeric_limits<std::int32_t>::min();
    desc_ = "rewind(" + std::to_string(id) + ", " + std::to_string(pos) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::rewind)];
    const Cache before = cache_;
    const std::int32_t bound = model_.is_live(id) ? touched_pages(id, pos, -1, {}) : 0;
    oracle::Model saved = model_;
    const Errc want = model_.rewind(id, pos);
    const Status got = cache_.rewind(id, pos);
    return edit_outcome(before, std::move(saved), want, got.code(), bound, /*edit=*/false);
  }

  // ---- sequence edits ----

  // [p0, p1) arguments: often the whole sequence or a suffix (-1), sometimes empty or reversed.
  std::pair<std::int32_t, std::int32_t> pick_range(Entropy& e, std::int32_t len) const {
    const std::int32_t p0 = e.below(5) == 0 ? -1 : e.range(0, len + 1);
    std::int32_t p1 = -1;
    const std::uint32_t r = e.below(8);
    if (r < 3) p1 = -1;
    else if (r < 7) p1 = e.range(std::max(p0, 0), len + 2);
    else p1 = e.below(2) == 0 ? std::max(p0, 0) : e.range(0, len + 1);  // empty or maybe reversed
    return {p0, p1};
  }
  [[nodiscard]] std::int32_t len_or_small(std::int32_t id, Entropy& e) const {
    return model_.is_live(id) ? model_.length(id) : e.range(0, 4);
  }
  static std::string args_str(std::initializer_list<std::int32_t> a) {
    std::string s = "(";
    bool first = true;
    for (const std::int32_t x : a) {
      s += (first ? "" : ", ") + std::to_string(x);
      first = false;
    }
    return s + ")";
  }

  // Distinct table pages the edit of id's range [p0, p1) touches (held positions and the targets
  // given), plus one: an upper bound of the pages it may need.
  [[nodiscard]] std::int32_t touched_pages(std::int32_t id, std::int32_t p0, std::int32_t p1,
                                           const std::vector<std::int64_t>& targets) const {
    const auto [lo, hi] = model_.edit_range(id, p0, p1);
    std::set<std::int64_t> pages;
    for (const oracle::Entry& en : model_.entries())
      if (en.owners.count(id) != 0 && en.pos >= lo && en.pos < hi) pages.insert(en.pos / kPagePositions);
    for (const std::int64_t t : targets)
      if (t >= 0) pages.insert(t / kPagePositions);
    return static_cast<std::int32_t>(pages.size()) + 1;
  }

  bool op_seq_rm_range(Entropy& e) {
    const std::int32_t id = pick_id(e);
    const auto [p0, p1] = pick_range(e, len_or_small(id, e));
    desc_ = "seq_rm" + args_str({id, p0, p1});
    ++stats_.ops[static_cast<std::size_t>(OpKind::seq_rm_range)];
    const Cache before = cache_;
    const std::int32_t bound = model_.is_live(id) ? touched_pages(id, p0, p1, {}) : 0;
    oracle::Model saved = model_;
    const Errc want = model_.seq_rm_range(id, p0, p1);
    const Status got = cache_.seq_rm(id, p0, p1);
    return edit_outcome(before, std::move(saved), want, got.code(), bound);
  }

  bool op_seq_cp(Entropy& e) {
    const std::int32_t src = pick_id(e), dst = e.below(8) == 0 ? src : pick_id(e);
    const auto [p0, p1] = pick_range(e, len_or_small(src, e));
    desc_ = "seq_cp" + args_str({src, dst, p0, p1});
    ++stats_.ops[static_cast<std::size_t>(OpKind::seq_cp)];
    const Cache before = cache_;
    std::int32_t bound = 0;
    if (model_.is_live(src) && model_.is_live(dst)) {
      const auto [lo, hi] = model_.edit_range(src, p0, p1);
      std::vector<std::int64_t> targets;
      for (std::int32_t p = lo; p < hi; ++p) targets.push_back(p);
      bound = touched_pages(dst, 0, 0, targets);
    }
    oracle::Model saved = model_;
    const Errc want = model_.seq_cp(src, dst, p0, p1);
    const Status got = cache_.seq_cp(src, dst, p0, p1);
    return edit_outcome(before, std::move(saved), want, got.code(), bound);
  }

  bool op_seq_keep(Entropy& e) {
    const std::int32_t id = pick_id(e);
    desc_ = "seq_keep(" + std::to_string(id) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::seq_keep)];
    const Cache before = cache_;
    const Errc want = model_.seq_keep(id);
    const Status got = cache_.seq_keep(id);
    return verb_outcome(before, want, got.code(), 0, 0);
  }

  // seq_add: deltas that fill the holes just below p0 (a context shift), move a suffix up, or
  // anything (collisions, drops below 0, int32 extremes). seq_div: divisors 1..4, or < 1.
  bool op_seq_move(Entropy& e, bool div) {
    const std::int32_t id = pick_id(e);
    const std::int32_t len = len_or_small(id, e);
    auto [p0, p1] = pick_range(e, len);
    std::int32_t arg = 0;
    const std::uint32_t r = e.below(6);
    if (div) {
      arg = r == 0 ? e.range(-2, 0) : e.range(1, 4);
    } else if (r < 2 && model_.is_live(id)) {
      std::int32_t holes = 0;
      for (std::int32_t p = std::max(p0, 0) - 1; p >= 0 && model_.row_at(id, p) < 0; --p) ++holes;
      arg = -holes;
      p1 = -1;
    } else if (r == 2) {
      arg = e.range(1, 200);
      p1 = -1;
    } else if (r == 3) {
      const std::array<std::int32_t, 4> extreme{std::numeric_limits<std::int32_t>::min(),
                                                std::numeric_limits<std::int32_t>::max(), -100000, 100000};
      arg = extreme[e.below(extreme.size())];
    } else {
      arg = e.range(-len - 2, len + 2);
    }
    desc_ = std::string(div ? "seq_div" : "seq_add") + args_str({id, p0, p1, arg});
    ++stats_.ops[static_cast<std::size_t>(div ? OpKind::seq_div : OpKind::seq_add)];
    const Cache before = cache_;
    std::vector<oracle::Move> moves;
    const Errc want = model_.plan_move(id, p0, p1, div ? 0 : arg, arg, div, moves);
    const Status got = div ? cache_.seq_div(id, p0, p1, arg) : cache_.seq_add(id, p0, p1, arg);
    std::vector<std::int64_t> targets;
    for (const oracle::Move& m : moves) targets.push_back(m.to);
    const std::int32_t bound = model_.is_live(id) ? touched_pages(id, p0, p1, targets) : 0;
    if (!edit_refusal_ok(want, got.code(), bound)) return false;
    if (got.code() != Errc::ok) return unchanged(before);
    placed_ = false;
    edited_ = true;
    ++stats_.edits_ok;
    std::vector<std::int64_t> chosen;  // the cache's fresh cells, in move order
    if constexpr (kCellLayout)
      for (const oracle::Move& m : moves)
        if (m.to >= 0 && m.shared) chosen.push_back(cache_.cell_of(id, static_cast<std::int32_t>(m.to)));
    if (const std::string why = model_.commit_move(id, moves, chosen); !why.empty())
      return fail("copy-on-write cells " + list_str(chosen), "valid", why);
    return true;
  }

  // restore_positions: a live sequence's held positions (a saved state restored beside it), or a
  // random list (sometimes unsorted, negative or past the limit).
  bool op_restore(Entropy& e) {
    std::vector<std::int32_t> positions;
    const std::uint32_t r = e.below(10);
    if (r < 6 && !model_.live().empty()) {
      const std::int32_t src = pick_id(e);
      if (model_.is_live(src)) positions = cache_.held_positions(src).value();
    } else {
      const std::int32_t n = e.range(0, 6);
      std::int32_t p = e.range(-1, 3);
      for (std::int32_t i = 0; i < n; ++i, p += e.range(r == 9 ? 0 : 1, 40)) positions.push_back(p);
      if (r == 9 && n > 1) std::swap(positions.front(), positions.back());
    }
    desc_ = "restore_positions(" + list_str(positions) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::restore)];
    const Cache before = cache_;
    Errc want = model_.restore_verdict(positions);
    if constexpr (kCellLayout)
      if (want == Errc::ok) {
        std::set<std::int32_t> pages;
        for (const std::int32_t p : positions) pages.insert(p / kPagePositions);
        if (static_cast<std::int32_t>(pages.size()) > cache_.table().free_pages()) want = Errc::out_of_pages;
      }
    const Result<std::int32_t> got = cache_.restore_positions(positions);
    note(got.status().code());
    if (got.status().code() != want) return fail("status", errc_name(want), errc_name(got.status().code()));
    if (!got.ok()) return unchanged(before);
    placed_ = false;
    edited_ = true;
    std::vector<std::int64_t> chosen;
    for (const std::int32_t p : positions) chosen.push_back(cache_.row_of(got.value(), p));
    std::int32_t want_id = -1;
    if (const std::string why = model_.commit_restore(positions, chosen, want_id); !why.empty())
      return fail("restored rows " + list_str(chosen), "valid", why);
    if (got.value() != want_id) return fail("restored id", want_id, got.value());
    return true;
  }

  bool op_pos_range(Entropy& e) {
    const std::int32_t id = pick_id(e);
    desc_ = "seq_pos_min/max(" + std::to_string(id) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::pos_range)];
    std::int32_t want_min = 0, want_max = 0;
    const Errc want = model_.seq_pos_min(id, want_min);
    (void)model_.seq_pos_max(id, want_max);
    const Result<std::int32_t> lo = cache_.seq_pos_min(id), hi = cache_.seq_pos_max(id);
    note(lo.status().code());
    if (lo.status().code() != want) return fail("seq_pos_min status", errc_name(want), errc_name(lo.status().code()));
    if (hi.status().code() != want) return fail("seq_pos_max status", errc_name(want), errc_name(hi.status().code()));
    if (want != Errc::ok) return true;
    if (lo.value() != want_min) return fail("seq_pos_min", want_min, lo.value());
    if (hi.value() != want_max) return fail("seq_pos_max", want_max, hi.value());
    return true;
  }

  // An edit's status: the oracle's, or out_of_pages where the oracle allows it and the table has
  // fewer free pages than the edit may need (`bound`, cell layout).
  bool edit_refusal_ok(Errc want, Errc got, std::int32_t bound) {
    note(got);
    if (got == want) return true;
    if constexpr (kCellLayout)
      if (want == Errc::ok && got == Errc::out_of_pages) {
        if (cache_.table().free_pages() < bound) return true;
        return fail("out_of_pages with " + std::to_string(cache_.table().free_pages()) + " free pages", "< " + std::to_string(bound) + " free pages", "more");
      }
    return fail("status", errc_name(want), errc_name(got));
  }
  // The model was already changed on its ok; a page refusal puts it back.
  bool edit_outcome(const Cache& before, oracle::Model saved, Errc want, Errc got, std::int32_t bound,
                    bool edit = true) {
    if (!edit_refusal_ok(want, got, bound)) return false;
    if (got != Errc::ok) {
      if (want == Errc::ok) model_ = std::move(saved);
      return unchanged(before);
    }
    placed_ = false;
    edited_ = edited_ || edit;
    if (edit) ++stats_.edits_ok;
    return true;
  }

  // Pages an admitted step adds: one per position that starts a page.
  [[nodiscard]] std::int64_t step_pages(const std::vector<std::int32_t>& ids) const {
    std::int64_t n = 0;
    for (const std::int32_t s : model_.live()) {
      const auto k = static_cast<std::int32_t>(std::count(ids.begin(), ids.end(), s));
      n += PositionTable::pages_for(model_.length(s) + k) - PositionTable::pages_for(model_.length(s));
    }
    return n;
  }

  bool op_query(Entropy& e) {
    const std::int32_t id = pick_id(e);
    desc_ = "pos(" + std::to_string(id) + ")";
    ++stats_.ops[static_cast<std::size_t>(OpKind::query)];
    const Result<std::int32_t> got = cache_.pos(id);
    const Errc want = model_.check_id(id);
    if (got.status().code() != want) return fail("status", errc_name(want), errc_name(got.status().code()));
    if (got.ok() && got.value() != model_.length(id)) return fail("pos value", model_.length(id), got.value());
    if (cache_.is_live(id) != model_.is_live(id)) return fail("is_live", model_.is_live(id), cache_.is_live(id));
    return true;
  }

  bool op_acknowledge() {
    desc_ = "acknowledge_changes()";
    ++stats_.ops[static_cast<std::size_t>(OpKind::acknowledge)];
    if constexpr (kCellLayout) device_table_ = with_pending_writes();  // what an upload writes
    cache_.acknowledge_changes();
    model_.acknowledge();
    const PendingChanges p = cache_.pending_changes();
    if (!p.table.indices.empty() || !p.copies.empty() || !p.rotations.empty())
      return fail("pending_changes after acknowledge", "nothing",
                  std::to_string(p.table.indices.size()) + " table entries, " + std::to_string(p.copies.size()) +
                      " copies, " + std::to_string(p.rotations.size()) + " rotations");
    return true;
  }

  // The cache is a value: a copy, moved through a fresh cache, must carry on identically.
  bool op_copy() {
    desc_ = "copy and move the cache";
    ++stats_.ops[static_cast<std::size_t>(OpKind::copy)];
    Cache copy = cache_;
    if (!(copy == cache_)) return fail("copy == original", true, false);
    cache_ = Cache(config_);
    cache_ = std::move(copy);
    return true;
  }

  bool op_clear() {
    desc_ = "clear()";
    ++stats_.ops[static_cast<std::size_t>(OpKind::clear)];
    const std::vector<RowCopy> copies_before = model_.copies();
    cache_.clear();
    model_.clear();
    placed_ = false;
    edited_ = false;
    if constexpr (!kCellLayout) {
      // docs/design.md is silent on fork copies pending across clear(): every slot is empty afterwards,
      // so dropping them and keeping them are both correct. Anything else is not.
      const PendingChanges p = cache_.pending_changes();
      const std::vector<RowCopy> got(p.copies.begin(), p.copies.end());
      if (got == copies_before) model_.set_copies(copies_before);
      else if (!got.empty()) return fail("pending copies after clear", "none or the earlier ones", copies_str(got));
    }
    return true;
  }

  // Status (and id) of a verb; a refusal must leave the cache as it was, a success drops the step.
  bool verb_outcome(const Cache& before, Errc want, Errc got, std::int32_t got_id, std::int32_t want_id) {
    note(got);
    if (got != want) return fail("status", errc_name(want), errc_name(got));
    if (got != Errc::ok) return unchanged(before);
    placed_ = false;
    if (got_id != want_id) return fail("new sequence id", want_id, got_id);
    return true;
  }

  bool unchanged(const Cache& before) {
    if (!(cache_ == before)) return fail("state after a refusal", "unchanged (== copy taken before the call)", "changed");
    return true;
  }

  // ---- the whole observable state against the oracle ----

  bool check_state(Entropy& e) {
    stats_.max_live = std::max(stats_.max_live, static_cast<std::int32_t>(model_.live().size()));
    for (const std::int32_t id : model_.live()) stats_.max_seq_len = std::max(stats_.max_seq_len, model_.length(id));
    if (cache_.capacity() != model_.capacity()) return fail("capacity()", model_.capacity(), cache_.capacity());
    if (cache_.free_cells() != model_.free_cells()) return fail("free_cells()", model_.free_cells(), cache_.free_cells());
    if (cache_.used_end() != model_.read_len()) return fail("used_end()", model_.read_len(), cache_.used_end());
    if (cache_.max_seqs() != max_seqs()) return fail("max_seqs()", max_seqs(), cache_.max_seqs());
    if (cache_.max_write() != config_.max_write) return fail("max_write()", config_.max_write, cache_.max_write());
    if (cache_.live_count() != static_cast<std::int32_t>(model_.live().size()))
      return fail("live_count()", model_.live().size(), cache_.live_count());
    std::vector<std::int32_t> live_got;
    cache_.live_sequences().for_each([&](std::int32_t s) { live_got.push_back(s); });
    if (!std::equal(live_got.begin(), live_got.end(), model_.live().begin(), model_.live().end()))
      return fail("live_sequences()", list_str(model_.live()), list_str(live_got));
    for (std::int32_t id = -2; id < max_seqs() + 2; ++id) {
      if (cache_.is_live(id) != model_.is_live(id)) return fail("is_live(" + std::to_string(id) + ")", model_.is_live(id), cache_.is_live(id));
      const Result<std::int32_t> p = cache_.pos(id);
      const Errc want = model_.check_id(id);
      if (p.status().code() != want) return fail("pos(" + std::to_string(id) + ") status", errc_name(want), errc_name(p.status().code()));
      if (p.ok() && p.value() != model_.length(id)) return fail("pos(" + std::to_string(id) + ")", model_.length(id), p.value());
    }
    if (cache_.step_placed() != placed_) return fail("step_placed()", placed_, cache_.step_placed());
    const Errc gate = cache_.require_step().code();
    const Errc want_gate = placed_ ? Errc::ok : Errc::no_step_declared;
    if (gate != want_gate) return fail("require_step()", errc_name(want_gate), errc_name(gate));
    if (cache_.step_serial() != serial_) return fail("step_serial()", serial_, cache_.step_serial());
    if (placed_ && !check_placed_step(e)) return false;
    if (!check_query_refusals(e)) return false;
    if constexpr (kCellLayout) return check_cells();
    else return check_copies();
  }

  bool check_placed_step(Entropy& e) {
    const StepPlan plan = cache_.step();
    if (plan.tokens != static_cast<std::int32_t>(step_ids_.size())) return fail("step().tokens", step_ids_.size(), plan.tokens);
    if (!std::equal(step_ids_.begin(), step_ids_.end(), plan.seqs.begin(), plan.seqs.end()))
      return fail("step().seqs", list_str(step_ids_), list_str(plan.seqs));
    if (!std::equal(step_pos_.begin(), step_pos_.end(), plan.positions.begin(), plan.positions.end()))
      return fail("step().positions", list_str(step_pos_), list_str(plan.positions));
    if (!std::equal(step_rows_.begin(), step_rows_.end(), plan.rows.begin(), plan.rows.end()))
      return fail("step().rows", list_str(step_rows_), list_str(plan.rows));
    if (plan.read_len != step_read_len_) return fail("step().read_len", step_read_len_, plan.read_len);
    if (plan.serial != serial_) return fail("step().serial", serial_, plan.serial);

    // Every token, every distinct window: the full mask row over [0, read_len).
    const std::int64_t width = step_read_len_;
    std::vector<std::uint8_t> got;
    for (const std::int32_t window : Windows::kDistinctWindows) {
      for (std::size_t t = 0; t < step_ids_.size(); ++t) {
        const auto pad = static_cast<std::size_t>((op_number_ + static_cast<std::int64_t>(t)) % 3);  // out.size() >= read_len
        got.assign(static_cast<std::size_t>(width) + pad, std::uint8_t{0xA5});
        if (const Status s = cache_.mask_row(window, static_cast<std::int32_t>(t), got); !s.ok())
          return fail("mask_row(window=" + std::to_string(window) + ", t=" + std::to_string(t) + ") status", "ok",
                      errc_name(s.code()));
        const std::vector<std::uint8_t> want = model_.visibility_row(step_ids_[t], step_pos_[t], window, width);
        ++stats_.mask_rows_checked;
        if (!std::equal(want.begin(), want.end(), got.begin())) {
          std::ostringstream what;
          what << "mask_row(window=" << window << ", t=" << t << " seq=" << step_ids_[t] << " pos=" << step_pos_[t]
               << ") over [0, " << width << ")";
          return fail(what.str(), bits_str(want), bits_str(std::span<const std::uint8_t>(got.data(), want.size())));
        }
        if constexpr (!kCellLayout) {
          // What a token sees is the contiguous range [begin, end) of its slot.
          const Result<RowRange> range = cache_.visible_range(static_cast<std::int32_t>(t), window);
          if (!range.ok()) return fail("visible_range status", "ok", errc_name(range.status().code()));
          const auto [range_begin, range_end] = row_range(range.value());
          const std::int64_t first = std::find(want.begin(), want.end(), std::uint8_t{1}) - want.begin();
          const std::int64_t last = want.rend() - std::find(want.rbegin(), want.rend(), std::uint8_t{1});
          if (range_begin != first || range_end != last) {
            std::ostringstream what, w, g;
            what << "visible_range(t=" << t << ", window=" << window << ")";
            w << '[' << first << ", " << last << ')';
            g << '[' << range_begin << ", " << range_end << ')';
            return fail(what.str(), w.str(), g.str());
          }
        }
      }
    }

    // visible(t, row, W) on a few random rows, windows from the set and arbitrary ones.
    const auto T = static_cast<std::uint32_t>(step_ids_.size());
    const std::int64_t span_rows = std::min<std::int64_t>(model_.capacity(), width + 3);
    for (int k = 0; k < 3; ++k) {
      const auto t = e.below(T);
      const auto row = static_cast<std::int64_t>(e.below(static_cast<std::uint32_t>(span_rows)));
      const std::int32_t window = e.below(2) == 0 ? Windows::kDistinctWindows[e.below(Windows::kDistinctWindows.size())]
                                                  : e.range(0, 6);
      const bool want = model_.visible(step_ids_[t], step_pos_[t], row, window);
      const Result<bool> got_r = cache_.visible(static_cast<std::int32_t>(t), row, window);
      if (!got_r.ok()) return fail("visible status", "ok", errc_name(got_r.status().code()));
      const bool got_v = got_r.value();
      if (want != got_v) {
        std::ostringstream what;
        what << "visible(t=" << t << " seq=" << step_ids_[t] << " pos=" << step_pos_[t] << ", row=" << row
             << ", window=" << window << ")";
        return fail(what.str(), want, got_v);
      }
    }
    return true;
  }

  // The step queries refuse, writing nothing: everything (no_step_declared) when no step is placed
  // or a verb ran since, and the step() handed out is empty; with a step placed, a token outside
  // [0, T), a negative window, a row outside [0, capacity) (bad_argument) and a mask row shorter than
  // read_len (bad_shape). Arguments include int32 and int64 extremes.
  bool check_query_refusals(Entropy& e) {
    constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min(), kMax = std::numeric_limits<std::int32_t>::max();
    const auto T = placed_ ? static_cast<std::int32_t>(step_ids_.size()) : 0;
    const std::array<std::int32_t, 6> tokens{0, T - 1, -1, T, kMin, kMax};
    const std::array<std::int32_t, 5> windows{0, 1, kMax, -1, kMin};
    const std::array<std::int64_t, 6> rows{0, model_.capacity() - 1, -1, model_.capacity(),
                                           std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()};
    const std::int32_t t = tokens[e.below(tokens.size())], window = windows[e.below(windows.size())];
    const std::int64_t row = rows[e.below(rows.size())];
    const bool t_ok = t >= 0 && t < T, window_ok = window >= 0, row_ok = row >= 0 && row < model_.capacity();
    const auto want = [&](bool args_ok) { return !placed_ ? Errc::no_step_declared : args_ok ? Errc::ok : Errc::bad_argument; };
    const std::string args = "(t=" + std::to_string(t) + ", row=" + std::to_string(row) + ", window=" + std::to_string(window) + ")";

    if (!placed_) {
      const StepPlan plan = cache_.step();
      if (plan.tokens != 0 || !plan.rows.empty() || !plan.seqs.empty() || !plan.positions.empty() ||
          !plan.segments.empty() || plan.read_len != 0)
        return fail("step() with no step placed", "empty", std::to_string(plan.tokens) + " tokens");
    }
    const Errc got_visible = cache_.visible(t, row, window).status().code();
    if (got_visible != want(t_ok && window_ok && row_ok)) return fail("visible" + args, errc_name(want(t_ok && window_ok && row_ok)), errc_name(got_visible));
    if constexpr (!kCellLayout) {
      const Errc got_range = cache_.visible_range(t, window).status().code();
      if (got_range != want(t_ok && window_ok)) return fail("visible_range" + args, errc_name(want(t_ok && window_ok)), errc_name(got_range));
    }
    // A row one short of read_len (when there is one) is refused too; a refusal writes nothing.
    const bool short_row = placed_ && step_read_len_ > 0 && e.below(4) == 0;
    std::vector<std::uint8_t> out(static_cast<std::size_t>(placed_ ? step_read_len_ - (short_row ? 1 : 0) : 3), std::uint8_t{0xA5});
    const Errc want_mask = want(t_ok && window_ok) == Errc::ok && short_row ? Errc::bad_shape : want(t_ok && window_ok);
    const Errc got_mask = cache_.mask_row(window, t, out).code();
    if (got_mask != want_mask) return fail("mask_row" + args + " of " + std::to_string(out.size()), errc_name(want_mask), errc_name(got_mask));
    if (got_mask != Errc::ok && std::any_of(out.begin(), out.end(), [](std::uint8_t b) { return b != 0xA5; }))
      return fail("mask_row" + args + " refused", "nothing written", "a row written");
    return true;
  }

  // visible_range's [begin, end) as int64, whether it comes as a RowRange or a pair.
  template <class R>
  static std::pair<std::int64_t, std::int64_t> row_range(const R& r) {
    if constexpr (requires { r.first; }) return {static_cast<std::int64_t>(r.first), static_cast<std::int64_t>(r.second)};
    else return {static_cast<std::int64_t>(r.begin), static_cast<std::int64_t>(r.end)};
  }

  [[nodiscard]] std::vector<CellState> current_cells() const {
    std::vector<CellState> cells(static_cast<std::size_t>(model_.capacity()));
    for (const oracle::Entry& en : model_.entries()) cells[static_cast<std::size_t>(en.row)] = CellState{en.pos, en.owners};
    return cells;
  }

  static std::string cell_str(const CellState& c) {
    return "(pos " + std::to_string(c.pos) + ", owners " + list_str(c.owners) + ")";
  }

  // The device copy of the position table after an upload of the pending writes.
  [[nodiscard]] std::vector<std::int32_t> with_pending_writes() const {
    std::vector<std::int32_t> copy = device_table_;
    const TableChanges t = cache_.pending_changes().table;
    for (const std::int32_t i : t.indices) copy[static_cast<std::size_t>(i)] = t.values[static_cast<std::size_t>(i)];
    return copy;
  }

  bool check_cells() {
    const std::vector<CellState> now = current_cells();
    const auto n = static_cast<std::int32_t>(now.size());
    for (std::int32_t c = 0; c < n; ++c) {
      const CellState& want = now[static_cast<std::size_t>(c)];
      stats_.max_owners = std::max(stats_.max_owners, static_cast<std::int32_t>(want.owners.size()));
      CellState got{cache_.cell_pos(c), {}};
      const auto& owners = cache_.cell_owners(c);
      for (std::int32_t s = 0; s < max_seqs(); ++s)
        if (owners.test(s)) got.owners.insert(s);
      if (!(got == want) || owners.count() != static_cast<std::int32_t>(want.owners.size())) {
        std::string g = cell_str(got);
        if (owners.count() != static_cast<std::int32_t>(got.owners.size()))
          g += " plus " + std::to_string(owners.count() - static_cast<std::int32_t>(got.owners.size())) + " owner(s) >= max_seqs";
        return fail("cell " + std::to_string(c) + " metadata", cell_str(want), g);
      }
    }
    for (const oracle::Entry& en : model_.entries())
      for (const std::int32_t s : en.owners)
        if (cache_.cell_of(s, en.pos) != en.row)
          return fail("cell_of(" + std::to_string(s) + ", " + std::to_string(en.pos) + ")", en.row, cache_.cell_of(s, en.pos));

    const PendingChanges p = cache_.pending_changes();
    const std::vector<RowCopy> copies(p.copies.begin(), p.copies.end());
    if (copies != model_.copies()) return fail("pending_changes().copies", copies_str(model_.copies()), copies_str(copies));
    std::vector<RowRotation> rot(p.rotations.begin(), p.rotations.end());
    std::sort(rot.begin(), rot.end(), [](const RowRotation& a, const RowRotation& b) { return a.cell < b.cell; });
    if (rot != model_.rotations()) return fail("pending_changes().rotations", rotations_str(model_.rotations()), rotations_str(rot));
    stats_.cow_copies += static_cast<std::int64_t>(copies.size());
    stats_.rotations += static_cast<std::int64_t>(rot.size());
    return check_table(p.table);
  }

  // The position table as the device holds it: the acknowledged copy plus the pending writes
  // (each listed once) maps every owner's position to the oracle's row, and the live pages stay
  // within ceil(cells in use / 64) + 2 live sequences.
  bool check_table(const TableChanges& t) {
    const PositionTable& table = cache_.table();
    std::vector<std::uint8_t> listed(device_table_.size(), 0);
    for (const std::int32_t i : t.indices) {
      if (i < 0 || static_cast<std::size_t>(i) >= listed.size())
        return fail("pending table entry", "in [0, " + std::to_string(listed.size()) + ")", i);
      if (listed[static_cast<std::size_t>(i)]++ != 0) return fail("pending table entries", "each listed once", i);
    }
    const std::vector<std::int32_t> device = with_pending_writes();
    const PositionTableView view{device.data(), device.data() + table.directory_entries(), table.dir_stride()};
    // Every position below every live sequence's length: the oracle's row, or -1 for a hole.
    std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(max_seqs()));
    for (const std::int32_t s : model_.live()) rows[static_cast<std::size_t>(s)].assign(static_cast<std::size_t>(model_.length(s)), -1);
    for (const oracle::Entry& en : model_.entries())
      for (const std::int32_t s : en.owners) rows[static_cast<std::size_t>(s)][static_cast<std::size_t>(en.pos)] = en.row;
    bool holes = false;
    for (const std::int32_t s : model_.live())
      for (std::int32_t p = 0; p < model_.length(s); ++p) {
        const std::int64_t want = rows[static_cast<std::size_t>(s)][static_cast<std::size_t>(p)];
        holes = holes || want < 0;
        if (view.cell(s, p) != want)
          return fail("device table (" + std::to_string(s) + ", " + std::to_string(p) + ")", want, view.cell(s, p));
      }
    if (holes) ++stats_.holes;
    // A page of only holes is not kept: every page a sequence's directory names holds a cell.
    for (const std::int32_t s : model_.live())
      for (std::int32_t k = 0; k < PositionTable::pages_for(model_.length(s)); ++k) {
        if (view.page_of(s, k * kPagePositions) < 0) continue;
        bool held = false;
        for (std::int32_t p = k * kPagePositions; p < std::min(model_.length(s), (k + 1) * kPagePositions); ++p)
          held = held || rows[static_cast<std::size_t>(s)][static_cast<std::size_t>(p)] >= 0;
        if (!held) return fail("page " + std::to_string(k) + " of sequence " + std::to_string(s), "absent (only holes)", "kept");
      }
    // Without edits since the last clear, the live pages stay within their bound (position_table.hpp).
    const auto cells_in_use = static_cast<std::int32_t>(model_.entries().size());
    const std::int32_t bound = PositionTable::pages_for(cells_in_use) + 2 * static_cast<std::int32_t>(model_.live().size());
    if (!edited_ && table.pages_in_use() > bound) return fail("pages in use", "<= " + std::to_string(bound), table.pages_in_use());
    if (table.pages_in_use() + table.free_pages() != table.page_capacity())
      return fail("pages in use + free", table.page_capacity(), table.pages_in_use() + table.free_pages());
    stats_.max_pages = std::max(stats_.max_pages, table.pages_in_use());
    return true;
  }

  static std::string rotations_str(const std::vector<RowRotation>& rot) {
    std::string s = "[";
    for (const RowRotation& r : rot)
      s += "{" + std::to_string(r.cell) + ": " + std::to_string(r.old_pos) + "->" + std::to_string(r.new_pos) + "}";
    return s + "]";
  }

  static std::string copies_str(const std::vector<RowCopy>& copies) {
    std::string s = "[";
    for (const RowCopy& c : copies)
      s += "{" + std::to_string(c.src_row) + "->" + std::to_string(c.dst_row) + " x" + std::to_string(c.rows) + "}";
    return s + "]";
  }

  bool check_copies() {
    const PendingChanges p = cache_.pending_changes();
    if (!p.table.indices.empty()) return fail("pending_changes().table (sequence layout)", "none", list_str(p.table.indices));
    const std::vector<RowCopy> got(p.copies.begin(), p.copies.end());
    if (got != model_.copies()) return fail("pending_changes().copies", copies_str(model_.copies()), copies_str(got));
    return true;
  }

  // ---- reporting ----

  void note(Errc code) { ++stats_.codes[static_cast<std::size_t>(code)]; }

  template <class A, class B>
  bool fail(const std::string& what, const A& want, const B& got) {
    std::ostringstream out;
    out << std::boolalpha << what << ": expected " << want << ", got " << got;
    err_ = out.str();
    return false;
  }

  void remember(const std::string& desc) {
    recent_.push_back("#" + std::to_string(op_number_) + " " + desc);
    if (recent_.size() > 12) recent_.pop_front();
  }

  std::string report() const {
    std::ostringstream out;
    out << "cache and oracle disagree at operation #" << op_number_ << ": " << desc_ << "\n  " << err_
        << "\n  config: max_write=" << config_.max_write << " max_cells=" << config_.max_cells
        << " max_seqs=" << config_.max_seqs << " (effective " << max_seqs() << ", MaxSeqs " << Cache::kMaxSeqs
        << ") max_len=" << config_.max_len << " windows=" << list_str(Windows::kDistinctWindows)
        << "\n  live " << list_str(model_.live()) << ", last operations:";
    for (const std::string& r : recent_) out << "\n    " << r;
    return out.str();
  }

  CacheConfig config_;
  OpMix mix_;
  Cache cache_;
  oracle::Model model_;
  DriverStats stats_;
  std::int64_t op_number_ = 0;
  std::string desc_, err_;
  std::deque<std::string> recent_;

  // the placed step, as the oracle predicted it
  bool placed_ = false;
  std::uint64_t serial_ = 0;
  std::vector<std::int32_t> step_ids_, step_pos_;
  std::vector<std::int64_t> step_rows_;
  std::int64_t step_read_len_ = 0;

  std::vector<std::int32_t> device_table_;  // cell layout: the table as acknowledged uploads left it
  bool edited_ = false;                     // a range edit succeeded since the last clear
};

}  // namespace cellkv::test
