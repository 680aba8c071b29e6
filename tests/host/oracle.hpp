// A brute-force model of the cache, written from docs/design.md sections 2-4 and nothing else.
//
// State: a plain list of occupied rows (row, position, owner ids), the set of live sequence ids
// and each live sequence's length pos(s). Every query is answered by scanning that list; nothing
// here shares code or data structures with include/cellkv/detail (no bitmaps, no per-sequence
// row tables, no free lists), so a bug in the cache cannot hide in the oracle too.
//
// The oracle decides, for every operation, whether it must be refused and with which Errc, what
// positions a step's tokens get, and what each token sees (the rule of docs/design.md section 3):
//
//   visible(t, row, W)  iff  row occupied, s_t owns row, pos(row) <= p_t, (W == 0 or p_t - pos(row) < W)
//
// Placement: the sequence layout's rows are predicted exactly (seq * max_len + pos), and so are
// the cell layout's under lowest_free (each token in order takes the lowest free cell) and under
// the tests' own after_last (after_last_placement.hpp: the first free cell after the sequence's
// last one, else the lowest free; a new or forked sequence has no last cell, a rewind keeps the
// cell of the last kept position). Under any other placement (clustered<B>) the oracle only
// verifies the cells the cache chose: in range, free before the step, distinct within it;
// capacity is never lost because admission depends on the free count alone.
//
// Sequence edits (docs/design.md section 4, "Sequence edits"): a sequence's length is one past its
// highest held position; positions below it that it does not hold are holes. Each row records the
// position its K was computed at (`enc`); a row with enc != pos needs re-rotation. seq_add /
// seq_div copy a row shared with another sequence to a fresh row (in ascending position order,
// after the dropped rows are let go), which the placement picks as a step's token would; every
// successful edit then leaves the after_last placement at the cell of the sequence's last
// position. The oracle does not model the cell layout's position-table pages: the driver checks
// out_of_pages refusals against the table's free pages (op_driver.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::oracle {

enum class Kind {
  cell_lowest_free,  // cell layout, rows predicted exactly
  cell_any_free,     // cell layout, rows verified (free, distinct, in range)
  cell_after_last,   // cell layout under test::after_last, rows predicted exactly
  sequence_slots,    // sequence layout: row = seq * max_len + pos
};

struct Config {
  Kind kind = Kind::cell_lowest_free;
  std::int32_t max_write = 1;
  std::int32_t max_seqs = 1;   // effective (already normalized: never 0)
  std::int32_t max_cells = 0;  // cell layout
  std::int32_t max_len = 0;    // sequence layout
};

struct Entry {
  std::int64_t row = 0;
  std::int32_t pos = 0;
  std::set<std::int32_t> owners;  // never empty: a row without owners is not in the list
  std::int32_t enc = 0;           // the position the row's K encodes (after pending copies)
};

// One held position of a sequence that seq_add / seq_div moves.
struct Move {
  std::int32_t from = 0;
  std::int64_t row = 0;
  std::int64_t to = 0;  // < 0: dropped
  bool shared = false;  // another sequence owns the row too: copied on write
};

// What a refused declare_step must return. docs/design.md lists "a sequence id is out of range or not
// live" as one clause; when a step holds both an out-of-range id and a dead one the contract does
// not say which code wins, so `alternative` names the other acceptable one (Errc::ok when none).
struct Verdict {
  Errc code = Errc::ok;
  Errc alternative = Errc::ok;
  [[nodiscard]] bool accepts(Errc got) const { return got == code || (alternative != Errc::ok && got == alternative); }
};

class Model {
 public:
  explicit Model(const Config& c) : c_(c) {}

  [[nodiscard]] const Config& config() const { return c_; }
  [[nodiscard]] bool cell_layout() const { return c_.kind != Kind::sequence_slots; }

  // ---- queries ----
  [[nodiscard]] std::int64_t capacity() const {
    return cell_layout() ? std::int64_t{c_.max_cells} : std::int64_t{c_.max_seqs} * c_.max_len;
  }
  [[nodiscard]] std::int64_t occupied() const { return static_cast<std::int64_t>(entries_.size()); }
  [[nodiscard]] std::int64_t free_cells() const { return capacity() - occupied(); }
  // 1 + highest occupied row, 0 when none.
  [[nodiscard]] std::int64_t read_len() const {
    std::int64_t end = 0;
    for (const Entry& e : entries_) end = std::max(end, e.row + 1);
    return end;
  }
  [[nodiscard]] bool in_range(std::int32_t id) const { return id >= 0 && id < c_.max_seqs; }
  [[nodiscard]] bool is_live(std::int32_t id) const { return live_.count(id) != 0; }
  [[nodiscard]] Errc check_id(std::int32_t id) const {
    if (!in_range(id)) return Errc::bad_sequence_id;
    return is_live(id) ? Errc::ok : Errc::sequence_not_live;
  }
  // pos(id): precondition is_live(id).
  [[nodiscard]] std::int32_t length(std::int32_t id) const {
    for (const auto& [s, n] : len_)
      if (s == id) return n;
    return 0;
  }
  [[nodiscard]] const std::set<std::int32_t>& live() const { return live_; }
  [[nodiscard]] const std::vector<Entry>& entries() const { return entries_; }
  // Sequence layout: the fork copies reported since the last acknowledge.
  [[nodiscard]] const std::vector<RowCopy>& copies() const { return copies_; }

  [[nodiscard]] const Entry* find_row(std::int64_t row) const {
    for (const Entry& e : entries_)
      if (e.row == row) return &e;
    return nullptr;
  }

  // docs/design.md section 3, literally.
  [[nodiscard]] bool visible(std::int32_t seq, std::int32_t pos, std::int64_t row, std::int32_t window) const {
    const Entry* e = find_row(row);
    if (e == nullptr) return false;                       // 1. occupied
    if (e->owners.count(seq) == 0) return false;          // 2. owned by the token's sequence
    if (e->pos > pos) return false;                       // 3. pos(row) <= p_t
    return window == 0 || pos - e->pos < window;          // 4. window
  }

  // Visibility of columns [0, width) to a token (seq, pos) through `window`.
  [[nodiscard]] std::vector<std::uint8_t> visibility_row(std::int32_t seq, std::int32_t pos, std::int32_t window,
                                                         std::int64_t width) const {
    std::vector<std::uint8_t> out(static_cast<std::size_t>(width), 0);
    for (const Entry& e : entries_)
      if (e.row < width && e.owners.count(seq) != 0 && e.pos <= pos && (window == 0 || pos - e.pos < window))
        out[static_cast<std::size_t>(e.row)] = 1;
    return out;
  }

  // ---- declare_step ----

  // Refusals in the order of docs/design.md section 4: empty, too wide, ids (range / liveness), room.
  [[nodiscard]] Verdict admit(std::span<const std::int32_t> ids) const {
    if (ids.empty()) return {Errc::empty_step};
    if (ids.size() > static_cast<std::size_t>(c_.max_write)) return {Errc::step_too_wide};
    bool out_of_range = false, dead = false;
    for (const std::int32_t s : ids) {
      if (!in_range(s)) out_of_range = true;
      else if (!is_live(s)) dead = true;
    }
    if (out_of_range && dead) return {Errc::bad_sequence_id, Errc::sequence_not_live};
    if (out_of_range) return {Errc::bad_sequence_id};
    if (dead) return {Errc::sequence_not_live};
    if (cell_layout()) {
      if (free_cells() < static_cast<std::int64_t>(ids.size())) return {Errc::out_of_cells};
      for (const std::int32_t s : live_) {
        const auto n = std::count(ids.begin(), ids.end(), s);
        if (length(s) + n > position_limit()) return {Errc::sequence_full};
      }
    } else {
      for (const std::int32_t s : live_) {
        const auto n = std::count(ids.begin(), ids.end(), s);
        if (length(s) + n > c_.max_len) return {Errc::sequence_full};
      }
    }
    return {};
  }

  // Positions of the tokens of an admitted step: pos(s), pos(s) + 1, ... in token order per s.
  [[nodiscard]] std::vector<std::int32_t> positions(std::span<const std::int32_t> ids) const {
    std::vector<std::int32_t> out;
    for (std::size_t t = 0; t < ids.size(); ++t) {
      const auto earlier = std::count(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(t), ids[t]);
      out.push_back(length(ids[t]) + static_cast<std::int32_t>(earlier));
    }
    return out;
  }

  // The rows an admitted step must get, for the layouts that fix them (not cell_any_free).
  [[nodiscard]] std::vector<std::int64_t> predicted_rows(std::span<const std::int32_t> ids) const {
    std::vector<std::int64_t> out;
    if (c_.kind == Kind::sequence_slots) {
      const auto pos = positions(ids);
      for (std::size_t t = 0; t < ids.size(); ++t)
        out.push_back(std::int64_t{ids[t]} * c_.max_len + pos[t]);
      return out;
    }
    std::vector<bool> taken(static_cast<std::size_t>(capacity()), false);
    for (const Entry& e : entries_) taken[static_cast<std::size_t>(e.row)] = true;
    std::vector<std::pair<std::int32_t, std::int64_t>> last = last_;  // after_last: updated per token
    for (std::size_t t = 0; t < ids.size(); ++t) {
      std::size_t c = 0;
      if (c_.kind == Kind::cell_after_last) {
        c = static_cast<std::size_t>(last_row(last, ids[t]) + 1);
        while (c < taken.size() && taken[c]) ++c;
        if (c == taken.size()) c = 0;  // nothing free past the last cell: wrap
      }
      while (taken[c]) ++c;  // admitted: at least T free cells, so c stays in range
      out.push_back(static_cast<std::int64_t>(c));
      taken[c] = true;
      set_last(last, ids[t], static_cast<std::int64_t>(c));
    }
    return out;
  }

  // "" when `rows` is an acceptable placement of the admitted step `ids`, else why not.
  [[nodiscard]] std::string check_rows(std::span<const std::int32_t> ids, std::span<const std::int64_t> rows) const {
    std::ostringstream why;
    if (rows.size() != ids.size()) {
      why << "step has " << rows.size() << " rows for " << ids.size() << " tokens";
      return why.str();
    }
    if (c_.kind != Kind::cell_any_free) {
      const auto want = predicted_rows(ids);
      for (std::size_t t = 0; t < rows.size(); ++t)
        if (rows[t] != want[t]) {
          why << "token " << t << " got row " << rows[t] << ", expected row " << want[t];
          return why.str();
        }
      return {};
    }
    for (std::size_t t = 0; t < rows.size(); ++t) {
      if (rows[t] < 0 || rows[t] >= capacity()) {
        why << "token " << t << " got row " << rows[t] << " outside [0, " << capacity() << ")";
        return why.str();
      }
      if (find_row(rows[t]) != nullptr) {
        why << "token " << t << " got row " << rows[t] << ", which was occupied before the step";
        return why.str();
      }
      for (std::size_t u = 0; u < t; ++u)
        if (rows[u] == rows[t]) {
          why << "tokens " << u << " and " << t << " both got row " << rows[t];
          return why.str();
        }
    }
    return {};
  }

  // Applies an admitted step placed at `rows` (checked with check_rows).
  void commit_step(std::span<const std::int32_t> ids, std::span<const std::int64_t> rows) {
    const auto pos = positions(ids);
    for (std::size_t t = 0; t < ids.size(); ++t) entries_.push_back(Entry{rows[t], pos[t], {ids[t]}, pos[t]});
    for (const std::int32_t s : ids) set_length(s, length(s) + 1);
    for (std::size_t t = 0; t < ids.size(); ++t) set_last(last_, ids[t], rows[t]);
  }

  // ---- verbs: each returns the code the cache must return and applies itself when ok ----

  Errc seq_new(std::int32_t& id) {
    id = lowest_free_id();
    if (id < 0) return Errc::no_free_sequence;
    live_.insert(id);
    set_length(id, 0);
    set_last(last_, id, -1);
    return Errc::ok;
  }

  // Argument errors (source, then upto) before the resource error (no free id), as declare_step
  // checks its ids before room.
  Errc seq_clone(std::int32_t src, std::int32_t upto, std::int32_t& id) {
    if (const Errc e = check_id(src); e != Errc::ok) return e;
    if (upto == -1) upto = length(src);
    if (upto < 0 || upto > length(src)) return Errc::bad_position;
    id = lowest_free_id();
    if (id < 0) return Errc::no_free_sequence;
    live_.insert(id);
    set_length(id, last_held(src, upto) + 1);  // a trailing hole is not forked
    set_last(last_, id, -1);  // a fork starts with no last cell of its own
    if (cell_layout()) {
      for (Entry& e : entries_)
        if (e.owners.count(src) != 0 && e.pos < upto) e.owners.insert(id);
    } else {
      for (std::int32_t p = 0; p < upto; ++p)
        entries_.push_back(Entry{std::int64_t{id} * c_.max_len + p, p, {id}, p});
      if (upto > 0)
        copies_.push_back(RowCopy{std::int64_t{src} * c_.max_len, std::int64_t{id} * c_.max_len, upto});
    }
    return Errc::ok;
  }

  Errc seq_rm(std::int32_t id) {
    if (const Errc e = check_id(id); e != Errc::ok) return e;
    drop_positions(id, 0);
    live_.erase(id);
    len_.erase(std::remove_if(len_.begin(), len_.end(), [&](const auto& l) { return l.first == id; }), len_.end());
    return Errc::ok;
  }

  Errc rewind(std::int32_t id, std::int32_t pos) {
    if (const Errc e = check_id(id); e != Errc::ok) return e;
    if (pos < 0 || pos > length(id)) return Errc::bad_position;
    drop_positions(id, pos);
    settle(id);
    return Errc::ok;
  }

  // ---- sequence edits ----

  // Positions a sequence can reach: the cell layout's table spans 64 * ceil(max_cells / 64).
  [[nodiscard]] std::int32_t position_limit() const { return (c_.max_cells + 63) / 64 * 64; }
  // Row sequence id holds at pos, -1 when none.
  [[nodiscard]] std::int64_t row_at(std::int32_t id, std::int64_t pos) const {
    for (const Entry& e : entries_)
      if (e.pos == pos && e.owners.count(id) != 0) return e.row;
    return -1;
  }
  // Highest position id holds below `below`, -1 when none.
  [[nodiscard]] std::int32_t last_held(std::int32_t id, std::int32_t below = 2147483647) const {
    std::int32_t best = -1;
    for (const Entry& e : entries_)
      if (e.owners.count(id) != 0 && e.pos < below) best = std::max(best, e.pos);
    return best;
  }
  [[nodiscard]] std::int32_t first_held(std::int32_t id) const {
    std::int32_t best = -1;
    for (const Entry& e : entries_)
      if (e.owners.count(id) != 0 && (best < 0 || e.pos < best)) best = e.pos;
    return best;
  }
  // [p0, p1) as the verbs read it (p0 < 0: 0, p1 < 0: no end), within [0, length(id)).
  [[nodiscard]] std::pair<std::int32_t, std::int32_t> edit_range(std::int32_t id, std::int32_t p0, std::int32_t p1) const {
    const std::int64_t hi = std::min<std::int64_t>(p1 < 0 ? std::int64_t{1} << 40 : p1, length(id));
    const std::int64_t lo = std::min<std::int64_t>(std::max(p0, 0), hi);
    return {static_cast<std::int32_t>(lo), static_cast<std::int32_t>(hi)};
  }

  Errc seq_pos_min(std::int32_t id, std::int32_t& out) const {
    if (const Errc e = check_id(id); e != Errc::ok) return e;
    out = first_held(id);
    return Errc::ok;
  }
  Errc seq_pos_max(std::int32_t id, std::int32_t& out) const {
    if (const Errc e = check_id(id); e != Errc::ok) return e;
    out = last_held(id);
    return Errc::ok;
  }

  // seq_rm(id, p0, p1). The sequence layout serves an empty range or one reaching the end.
  Errc seq_rm_range(std::int32_t id, std::int32_t p0, std::int32_t p1) {
    if (const Errc e = check_id(id); e != Errc::ok) return e;
    const auto [lo, hi] = edit_range(id, p0, p1);
    if (!cell_layout() && lo < hi && hi < length(id)) return Errc::unsupported_by_layout;
    for (Entry& e : entries_)
      if (e.pos >= lo && e.pos < hi) e.owners.erase(id);
    erase_unowned();
    settle(id);
    return Errc::ok;
  }

  Errc seq_cp(std::int32_t src, std::int32_t dst, std::int32_t p0, std::int32_t p1) {
    if (const Errc e = check_id(src); e != Errc::ok) return e;
    if (const Errc e = check_id(dst); e != Errc::ok) return e;
    if (!cell_layout()) return Errc::unsupported_by_layout;
    const auto [lo, hi] = edit_range(src, p0, p1);
    for (const Entry& e : entries_)
      if (e.owners.count(src) != 0 && e.pos >= lo && e.pos < hi) {
        const std::int64_t have = row_at(dst, e.pos);
        if (have >= 0 && have != e.row) return Errc::position_collision;
      }
    for (Entry& e : entries_)
      if (e.owners.count(src) != 0 && e.pos >= lo && e.pos < hi) e.owners.insert(dst);
    settle(dst);
    return Errc::ok;
  }

  Errc seq_keep(std::int32_t id) {
    if (const Errc e = check_id(id); e != Errc::ok) return e;
    const std::set<std::int32_t> others = live_;
    for (const std::int32_t s : others)
      if (s != id) (void)seq_rm(s);
    return Errc::ok;
  }

  // seq_add (divisor 0) or seq_div (divisor >= 1; delta ignored): the verdict, and the moves in
  // ascending position order when ok. Changes nothing; commit_move applies.
  Errc plan_move(std::int32_t id, std::int32_t p0, std::int32_t p1, std::int32_t delta, std::int32_t divisor,
                 bool div, std::vector<Move>& moves) const {
    moves.clear();
    if (const Errc e = check_id(id); e != Errc::ok) return e;
    if (div && divisor < 1) return Errc::bad_argument;
    if (!cell_layout()) return Errc::unsupported_by_layout;
    const auto [lo, hi] = edit_range(id, p0, p1);
    for (const Entry& e : entries_)
      if (e.owners.count(id) != 0 && e.pos >= lo && e.pos < hi)
        moves.push_back(Move{e.pos, e.row, div ? std::int64_t{e.pos} / divisor : std::int64_t{e.pos} + delta,
                             e.owners.size() > 1});
    std::sort(moves.begin(), moves.end(), [](const Move& a, const Move& b) { return a.from < b.from; });
    for (const Move& m : moves)
      if (m.to >= position_limit()) return Errc::sequence_full;
    for (const Move& m : moves) {
      if (m.to < 0) continue;
      for (const Move& n : moves)
        if (&n != &m && n.to == m.to) return Errc::position_collision;
      if ((m.to < lo || m.to >= hi) && row_at(id, m.to) >= 0) return Errc::position_collision;
    }
    std::int64_t fresh = 0, freed = 0;
    for (const Move& m : moves) {
      if (m.to >= 0 && m.shared) ++fresh;
      if (m.to < 0 && !m.shared) ++freed;
    }
    if (fresh > free_cells() + freed) return Errc::out_of_cells;
    return Errc::ok;
  }

  // Applies planned moves. The fresh rows of shared moves (in order) are predicted for
  // lowest_free / after_last, else taken from `chosen` and verified (free, distinct). "" when
  // fine, else why not.
  std::string commit_move(std::int32_t id, const std::vector<Move>& moves, const std::vector<std::int64_t>& chosen) {
    std::int64_t last = last_row(last_, id);  // after_last: moves with each pick
    std::size_t k = 0;
    for (const Move& m : moves) {
      const auto i = index_of(m.row);
      if (m.to < 0) {
        entries_[i].owners.erase(id);
        erase_unowned();
        continue;
      }
      if (!m.shared) {
        entries_[i].pos = static_cast<std::int32_t>(m.to);
        continue;
      }
      std::int64_t fresh = -1;
      if (c_.kind == Kind::cell_any_free) {
        if (k >= chosen.size()) return "fewer fresh rows than shared moves";
        fresh = chosen[k++];
        if (fresh < 0 || fresh >= capacity() || find_row(fresh) != nullptr)
          return "fresh row " + std::to_string(fresh) + " was not free";
      } else {
        fresh = lowest_free_row(c_.kind == Kind::cell_after_last ? last + 1 : 0);
        if (fresh < 0) fresh = lowest_free_row(0);
        last = fresh;
      }
      entries_[i].owners.erase(id);
      const std::int32_t enc = entries_[i].enc;
      entries_.push_back(Entry{fresh, static_cast<std::int32_t>(m.to), {id}, enc});
      copies_.push_back(RowCopy{m.row, fresh, 1});
    }
    settle(id);
    return {};
  }

  // restore_positions: the verdict (pages aside) for a new sequence holding `positions`.
  [[nodiscard]] Errc restore_verdict(const std::vector<std::int32_t>& positions) const {
    for (std::size_t i = 0; i < positions.size(); ++i)
      if (positions[i] < 0 || (i > 0 && positions[i] <= positions[i - 1])) return Errc::bad_argument;
    const std::int32_t limit = cell_layout() ? position_limit() : c_.max_len;
    if (!positions.empty() && positions.back() >= limit) return Errc::sequence_full;
    if (!cell_layout() && !positions.empty() && positions.back() + 1 != static_cast<std::int32_t>(positions.size()))
      return Errc::unsupported_by_layout;
    if (lowest_free_id() < 0) return Errc::no_free_sequence;
    if (cell_layout() && static_cast<std::int64_t>(positions.size()) > free_cells()) return Errc::out_of_cells;
    return Errc::ok;
  }
  // Applies an admitted restore: the lowest free id, a fresh row per position in order (predicted
  // as a step's tokens are, or taken from `chosen` and verified for cell_any_free). "" when fine.
  std::string commit_restore(const std::vector<std::int32_t>& positions, const std::vector<std::int64_t>& chosen,
                             std::int32_t& id) {
    id = lowest_free_id();
    live_.insert(id);
    std::int64_t last = -1;
    for (std::size_t i = 0; i < positions.size(); ++i) {
      const std::int32_t p = positions[i];
      std::int64_t row = -1;
      if (!cell_layout()) {
        row = std::int64_t{id} * c_.max_len + p;
      } else if (c_.kind == Kind::cell_any_free) {
        if (i >= chosen.size()) return "fewer rows than positions";
        row = chosen[i];
        if (row < 0 || row >= capacity() || find_row(row) != nullptr) return "row " + std::to_string(row) + " was not free";
      } else {
        row = lowest_free_row(c_.kind == Kind::cell_after_last ? last + 1 : 0);
        if (row < 0) row = lowest_free_row(0);
        last = row;
      }
      entries_.push_back(Entry{row, p, {id}, p});
    }
    settle(id);
    return {};
  }

  // Rows whose K must be re-rotated: (row, enc, pos) with enc != pos, by row.
  [[nodiscard]] std::vector<RowRotation> rotations() const {
    std::vector<RowRotation> out;
    for (const Entry& e : entries_)
      if (e.enc != e.pos) out.push_back(RowRotation{static_cast<std::int32_t>(e.row), e.enc, e.pos});
    std::sort(out.begin(), out.end(), [](const RowRotation& a, const RowRotation& b) { return a.cell < b.cell; });
    return out;
  }

  void clear() {
    entries_.clear();
    live_.clear();
    len_.clear();
    copies_.clear();
    last_.clear();
  }

  // The device ran the copies and the rotations.
  void acknowledge() {
    copies_.clear();
    for (Entry& e : entries_) e.enc = e.pos;
  }
  // Adopts the cache's pending copies (used where the contract leaves them open, e.g. after clear).
  void set_copies(std::vector<RowCopy> copies) { copies_ = std::move(copies); }

 private:
  [[nodiscard]] std::int32_t lowest_free_id() const {
    for (std::int32_t id = 0; id < c_.max_seqs; ++id)
      if (!is_live(id)) return id;
    return -1;
  }

  // after_last: the last cell of sequence id in `last`, -1 when none.
  static std::int64_t last_row(const std::vector<std::pair<std::int32_t, std::int64_t>>& last, std::int32_t id) {
    for (const auto& [s, row] : last)
      if (s == id) return row;
    return -1;
  }
  static void set_last(std::vector<std::pair<std::int32_t, std::int64_t>>& last, std::int32_t id, std::int64_t row) {
    for (auto& [s, r] : last)
      if (s == id) {
        r = row;
        return;
      }
    last.emplace_back(id, row);
  }

  void set_length(std::int32_t id, std::int32_t n) {
    for (auto& [s, len] : len_)
      if (s == id) {
        len = n;
        return;
      }
    len_.emplace_back(id, n);
  }

  // The sequence lets go of its positions >= keep; a row whose last owner leaves is freed.
  void drop_positions(std::int32_t id, std::int32_t keep) {
    for (Entry& e : entries_)
      if (e.pos >= keep) e.owners.erase(id);
    erase_unowned();
  }
  void erase_unowned() {
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.owners.empty(); }),
                   entries_.end());
  }
  // After an edit of id: its length is one past its highest position, and after_last restarts
  // from the row of that position.
  void settle(std::int32_t id) {
    const std::int32_t last = last_held(id);
    set_length(id, last + 1);
    set_last(last_, id, last < 0 ? -1 : row_at(id, last));
  }
  [[nodiscard]] std::size_t index_of(std::int64_t row) const {
    for (std::size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].row == row) return i;
    return entries_.size();
  }
  // Lowest free row >= from, -1 when none.
  [[nodiscard]] std::int64_t lowest_free_row(std::int64_t from) const {
    for (std::int64_t r = std::max<std::int64_t>(from, 0); r < capacity(); ++r)
      if (find_row(r) == nullptr) return r;
    return -1;
  }

  Config c_;
  std::vector<Entry> entries_;  // occupied rows, in no particular order
  std::set<std::int32_t> live_;
  std::vector<std::pair<std::int32_t, std::int32_t>> len_;  // (live id, pos(id))
  std::vector<RowCopy> copies_;
  std::vector<std::pair<std::int32_t, std::int64_t>> last_;  // after_last: (id, its last cell)
};

}  // namespace cellkv::oracle
