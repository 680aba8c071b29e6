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
    for (std::size_t t = 0; t < ids.size(); ++t) entries_.push_back(Entry{rows[t], pos[t], {ids[t]}});
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
    set_length(id, upto);
    set_last(last_, id, -1);  // a fork starts with no last cell of its own
    if (cell_layout()) {
      for (Entry& e : entries_)
        if (e.owners.count(src) != 0 && e.pos < upto) e.owners.insert(id);
    } else {
      for (std::int32_t p = 0; p < upto; ++p)
        entries_.push_back(Entry{std::int64_t{id} * c_.max_len + p, p, {id}});
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
    set_length(id, pos);
    std::int64_t kept = -1;  // the cell of the last kept position
    for (const Entry& e : entries_)
      if (e.owners.count(id) != 0 && e.pos == pos - 1) kept = e.row;
    set_last(last_, id, kept);
    return Errc::ok;
  }

  void clear() {
    entries_.clear();
    live_.clear();
    len_.clear();
    copies_.clear();
    last_.clear();
  }

  void acknowledge() { copies_.clear(); }
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
    entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const Entry& e) { return e.owners.empty(); }),
                   entries_.end());
  }

  Config c_;
  std::vector<Entry> entries_;  // occupied rows, in no particular order
  std::set<std::int32_t> live_;
  std::vector<std::pair<std::int32_t, std::int32_t>> len_;  // (live id, pos(id))
  std::vector<RowCopy> copies_;
  std::vector<std::pair<std::int32_t, std::int64_t>> last_;  // after_last: (id, its last cell)
};

}  // namespace cellkv::oracle
