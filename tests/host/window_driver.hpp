// Window storage differential driver: one cell cache with window storage (CacheConfig::
// window_cells > 0) against a twin that stores every layer in full, under the same random
// operations. The full twin is the oracle here: test_differential.cpp checks it against the
// brute-force model (oracle.hpp), and what a token sees is the same whatever pool holds it.
//
// Per operation:
//   - the windowed cache refuses exactly what the full one refuses, with the same code, or one of
//     its own two: window_evicted (justified: a position the edited sequence's next token would see
//     is held in full but not by the window pool; checked for rewinds, range removals, forks and
//     copies, where positions do not move) or out_of_window_cells (justified: the step has more
//     tokens than the window pool has free cells before its drops); a refusal changes nothing
//     (== a copy taken before);
//   - on success both agree on every id's pos and held positions;
//   - after a placed step: the same tokens and positions; for every token and every window of the
//     set, the positions of the rows its mask row marks (mask_row over the pool of that window,
//     cell_pos of that pool) are the same in both caches; and the attention outputs of the host
//     reference (double pools, the same random K/V/Q in both) agree to 1e-12 (the rows are read in
//     another order, so the sums round differently);
//   - after every operation, per window pool: cell metadata agrees with the tables (positions,
//     owners, free count: nothing leaks), a sequence's window-held positions are main-held ones, and
//     every main-held position its next token can see is window-held; after a step, no sequence of
//     the step holds a window-pool page wholly below what its first token saw (eviction happens).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cellkv/host_pool.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/reference.hpp"
#include "op_driver.hpp"

namespace cellkv::test {

template <class Cache>
class WindowDriver {
  using W = typename Cache::Windows;
  static constexpr std::int32_t kHeadsKv = 1, kHeadsQ = 2, kDim = 4;

 public:
  // `windowed` has window_cells > 0; `full` is the same config with window_cells = 0.
  WindowDriver(const CacheConfig& windowed, const CacheConfig& full)
      : win_(windowed), full_(full), full_pool_(W::kLayers, full_.capacity(), kHeadsKv, kDim) {
    win_pools_.emplace_back(W::kLayers, win_.capacity(), kHeadsKv, kDim);
    for (const std::int32_t w : W::kWindowed) win_pools_.emplace_back(W::kLayers, win_.pool(w).capacity(), kHeadsKv, kDim);
  }

  [[nodiscard]] const Cache& windowed() const { return win_; }
  [[nodiscard]] std::int64_t steps() const { return steps_; }
  [[nodiscard]] std::int64_t window_refusals() const { return window_refusals_; }

  // One random operation; an empty string when everything agreed, else what did not.
  std::string step(Entropy& e) {
    ++op_;
    const std::vector<std::int32_t> live = live_ids();
    const std::int32_t pick = e.range(0, 99);
    if (live.empty() || pick < 6) return run("seq_new", [](Cache& c) { return c.seq_new().status(); });
    const std::int32_t s = live[e.below(static_cast<std::uint32_t>(live.size()))];
    const std::int32_t len = full_.pos(s).value();
    if (pick < 60) return declare(e, live);
    if (pick < 66) {
      const std::int32_t upto = e.range(0, len);
      return run("seq_clone", [&](Cache& c) { return c.seq_clone(s, upto).status(); }, {-1, {s}});
    }
    if (pick < 72) {
      const std::int32_t to = e.range(std::max(0, len - 80), len);
      return run("rewind", [&](Cache& c) { return c.rewind(s, to); }, {s, {s}});
    }
    if (pick < 76) return run("seq_rm", [&](Cache& c) { return c.seq_rm(s); });
    if (pick < 82) {
      const std::int32_t p0 = e.range(0, len), p1 = e.range(p0, len + 2);
      return run("seq_rm range", [&](Cache& c) { return c.seq_rm(s, p0, p1); }, {s, {s}});
    }
    if (pick < 88) {
      const std::int32_t p0 = e.range(0, len), p1 = e.range(p0, len + 2), delta = e.range(-70, 70);
      return run("seq_add", [&](Cache& c) { return c.seq_add(s, p0, p1, delta); });
    }
    if (pick < 91) {
      const std::int32_t p0 = e.range(0, len), d = e.range(1, 3);
      return run("seq_div", [&](Cache& c) { return c.seq_div(s, p0, -1, d); });
    }
    if (pick < 96) {
      const std::int32_t dst = live[e.below(static_cast<std::uint32_t>(live.size()))];
      const std::int32_t p0 = e.range(0, len), p1 = e.range(p0, len);
      return run("seq_cp", [&](Cache& c) { return c.seq_cp(s, dst, p0, p1); }, {dst, {dst, s}});
    }
    if (pick < 99) {
      const std::vector<std::int32_t> held = full_.held_positions(s).value();
      std::int32_t id = -1;  // the same lowest free id in both caches
      std::string m = run("restore_positions", [&](Cache& c) {
        const Result<std::int32_t> r = c.restore_positions(held);
        id = r.ok() ? r.value() : -1;
        return r.status();
      });
      if (m.empty() && id >= 0) fill_restored(id, held);
      return m;
    }
    return run("clear", [](Cache& c) {
      c.clear();
      return Status{};
    });
  }

 private:
  [[nodiscard]] std::vector<std::int32_t> live_ids() const {
    std::vector<std::int32_t> out;
    full_.live_sequences().for_each([&](std::int32_t s) { out.push_back(s); });
    return out;
  }

  static std::string fail(std::int64_t op, const std::string& what) {
    std::ostringstream o;
    o << "op " << op << ": " << what;
    return o.str();
  }

  // The first position the next token of a sequence of length len sees through w, or its last
  // position if earlier (what a window pool keeps, cell_layout_cache.hpp).
  static std::int32_t keep_from(std::int32_t w, std::int32_t len) { return std::max(0, std::min(len - w + 1, len - 1)); }

  // What a window_evicted refusal of an edit is checked against: the edited sequence (-1: the id
  // a fork gets) and the sequences whose window-held positions it would hold (none: not checked,
  // for moves, whose positions change).
  struct Evicted {
    std::int32_t edited = -1;
    std::vector<std::int32_t> sources;
  };

  // Whether the full twin after the same edit (`after`) justifies window_evicted: the edited
  // sequence holds a position its next token sees that no source's window pool held.
  bool evicted_justified(const Cache& after, std::int32_t edited, const std::vector<std::int32_t>& sources) const {
    const std::int32_t len = after.pos(edited).value();
    for (std::size_t i = 0; i < W::kWindowed.size(); ++i) {
      const auto& pool = win_.pool(W::kWindowed[i]);
      for (std::int32_t p = keep_from(W::kWindowed[i], len); p < len; ++p) {
        bool held_window = false;
        for (const std::int32_t s : sources) held_window |= p < pool.table().length(s) && pool.cell_of(s, p) >= 0;
        if (after.cell_of(edited, p) >= 0 && !held_window) return true;
      }
    }
    return false;
  }

  // Runs op on both caches; `evicted` says how a window_evicted refusal is justified.
  template <class Op>
  std::string run(const char* name, Op&& op, const Evicted& evicted = {}) {
    const Cache before = win_;
    const Status sw = op(win_);
    if (sw.code() == Errc::window_evicted || sw.code() == Errc::out_of_window_cells) {
      ++window_refusals_;
      if (!(win_ == before)) return fail(op_, std::string(name) + ": a refusal changed the windowed cache");
      if (sw.code() == Errc::out_of_window_cells) return {};  // edits: a copy on write that found no cell
      Cache trial = full_;
      const std::int32_t next_id = trial.live_sequences().first_absent(trial.max_seqs());
      const Status sf = op(trial);
      if (!sf.ok()) return fail(op_, std::string(name) + ": window_evicted where the full cache refuses " + std::string(sf.message()));
      if (evicted.sources.empty()) return {};
      if (!evicted_justified(trial, evicted.edited < 0 ? next_id : evicted.edited, evicted.sources))
        return fail(op_, std::string(name) + ": window_evicted, yet the window pool keeps what the next token sees");
      return {};
    }
    const Status sf = op(full_);
    if (sw.code() != sf.code())
      return fail(op_, std::string(name) + ": windowed " + std::string(sw.message()) + ", full " + std::string(sf.message()));
    if (!sw.ok() && !(win_ == before)) return fail(op_, std::string(name) + ": a refusal changed the windowed cache");
    sync_pools();
    return check_state();
  }

  // A restored sequence's rows get K = V = position + layer / 8 in every pool and layer, the same
  // in both caches (restore_positions leaves filling them to the caller).
  void fill_restored(std::int32_t id, const std::vector<std::int32_t>& positions) {
    const auto fill = [&](HostPool<double>& pool, std::int64_t row, std::int32_t p) {
      if (row < 0) return;
      for (std::int32_t l = 0; l < W::kLayers; ++l) {
        const PoolView<double> v = pool.view(l);
        for (std::int64_t i = 0; i < pool.row_elems(); ++i) v.k[row * pool.row_elems() + i] = v.v[row * pool.row_elems() + i] = p + l / 8.0;
      }
    };
    for (const std::int32_t p : positions) {
      fill(full_pool_, full_.cell_of(id, p), p);
      fill(win_pools_[0], win_.cell_of(id, p), p);
      for (std::size_t i = 0; i < W::kWindowed.size(); ++i) fill(win_pools_[i + 1], win_.pool(W::kWindowed[i]).cell_of(id, p), p);
    }
  }

  // The pending copies (copy on write) of every pool run on its host pool; keys carry no position.
  void sync_pools() {
    full_pool_.apply(full_.pending_changes());
    win_pools_[0].apply(win_.pending_changes());
    for (std::size_t i = 0; i < W::kWindowed.size(); ++i) win_pools_[i + 1].apply(win_.pool(W::kWindowed[i]).pending_changes());
    full_.acknowledge_changes();
    win_.acknowledge_changes();
  }

  std::string declare(Entropy& e, const std::vector<std::int32_t>& live) {
    const std::int32_t T = e.range(1, win_.max_write());
    std::vector<std::int32_t> ids;
    const std::int32_t a = live[e.below(static_cast<std::uint32_t>(live.size()))];
    for (std::int32_t t = 0; t < T; ++t)  // runs of one sequence (a prompt chunk) or a mix (decode)
      ids.push_back(e.below(2) == 0 ? a : live[e.below(static_cast<std::uint32_t>(live.size()))]);
    bool short_somewhere = false;
    for (const std::int32_t w : W::kWindowed) short_somewhere |= room_for(w, ids) < T;
    const Cache before = win_;
    const Status sw = win_.declare_step(ids).status();
    if (sw.code() == Errc::out_of_window_cells) {
      ++window_refusals_;
      if (!(win_ == before)) return fail(op_, "declare_step: a refusal changed the windowed cache");
      return short_somewhere ? std::string{} : fail(op_, "out_of_window_cells though every window pool had room for T cells");
    }
    const Status sf = full_.declare_step(ids).status();
    if (sw.code() != sf.code())
      return fail(op_, "declare_step: windowed " + std::string(sw.message()) + ", full " + std::string(sf.message()));
    if (sw.ok() && short_somewhere) return fail(op_, "declare_step placed more tokens than a window pool had room for");
    if (!sw.ok()) return win_ == before ? check_state() : fail(op_, "declare_step: a refusal changed the windowed cache");
    ++steps_;
    if (std::string m = check_step(); !m.empty()) return m;
    if (std::string m = attend(e); !m.empty()) return m;
    return check_state();
  }

  // Cells window pool w can give a step of `ids`: its free cells, and the cells the step's releases
  // free (held by a sequence of the step on a page wholly below what its first token sees, once
  // every owner of the cell lets go of it).
  std::int64_t room_for(std::int32_t w, const std::vector<std::int32_t>& ids) const {
    const auto& pool = win_.pool(w);
    std::map<std::int32_t, std::int32_t> drops;  // cell -> sequences of the step letting go of it
    for (const std::int32_t s : std::set<std::int32_t>(ids.begin(), ids.end())) {
      if (!win_.is_live(s)) continue;
      const std::int32_t len = win_.pos(s).value(), cut = keep_from(w, len) / kPagePositions * kPagePositions;
      for (std::int32_t p = 0; p < cut; ++p)
        if (const std::int32_t c = pool.cell_of(s, p); c >= 0) ++drops[c];
    }
    std::int64_t room = pool.free_cells();
    for (const auto& [c, n] : drops) room += n == pool.cell_owners(c).count() ? 1 : 0;
    return room;
  }

  // Positions of the rows token t sees through window w, from the mask row of that window's pool.
  static std::vector<std::int32_t> seen_positions(const Cache& c, std::int32_t w, std::int32_t t) {
    std::vector<std::uint8_t> row(static_cast<std::size_t>(c.read_len(w)));
    if (!c.mask_row(w, t, row).ok()) return {-2};
    std::vector<std::int32_t> out;
    for (std::size_t r = 0; r < row.size(); ++r)
      if (row[r] != 0) out.push_back(c.pool(w).cell_pos(static_cast<std::int32_t>(r)));
    std::sort(out.begin(), out.end());
    return out;
  }

  std::string check_step() const {
    const StepPlan pw = win_.step(), pf = full_.step();
    if (!std::equal(pw.positions.begin(), pw.positions.end(), pf.positions.begin(), pf.positions.end()))
      return fail(op_, "declare_step: positions differ");
    if (pw.window_rows.size() != W::kWindowed.size() * static_cast<std::size_t>(pw.tokens))
      return fail(op_, "declare_step: the plan lacks a window pool's rows");
    for (std::int32_t t = 0; t < pw.tokens; ++t)
      for (const std::int32_t w : W::kDistinctWindows) {
        if (seen_positions(win_, w, t) != seen_positions(full_, w, t)) {
          std::ostringstream o;
          o << "token " << t << " (seq " << pw.seqs[static_cast<std::size_t>(t)] << ", pos "
            << pw.positions[static_cast<std::size_t>(t)] << ") sees other positions through window " << w;
          return fail(op_, o.str());
        }
        const std::int64_t row = win_.step_rows(w)[static_cast<std::size_t>(t)];
        if (win_.pool(w).cell_pos(static_cast<std::int32_t>(row)) != pw.positions[static_cast<std::size_t>(t)])
          return fail(op_, "a token's row in a window pool holds another position");
      }
    // Eviction: a sequence of the step holds no window-pool page below what its first token sees.
    for (std::size_t i = 0; i < W::kWindowed.size(); ++i) {
      const std::int32_t w = W::kWindowed[i];
      std::set<std::int32_t> done;
      for (std::int32_t t = 0; t < pw.tokens; ++t) {
        const std::int32_t s = pw.seqs[static_cast<std::size_t>(t)];
        if (!done.insert(s).second) continue;
        const std::int32_t first = keep_from(w, pw.positions[static_cast<std::size_t>(t)]) / kPagePositions * kPagePositions;
        for (std::int32_t p = 0; p < first; ++p)
          if (win_.pool(w).cell_of(s, p) >= 0) return fail(op_, "a window pool kept a page no query of its sequence sees");
      }
    }
    return {};
  }

  // Random K, V, Q for every token and layer; the reference writes and attends in both caches.
  std::string attend(Entropy& e) {
    const StepPlan plan = win_.step();
    const auto kv = static_cast<std::size_t>(plan.tokens) * kHeadsKv * kDim;
    const auto qn = static_cast<std::size_t>(plan.tokens) * kHeadsQ * kDim;
    for (std::int32_t l = 0; l < W::kLayers; ++l) {
      const std::int32_t w = W::window_of_layer(l);
      std::vector<double> k(kv), v(kv), q(qn), out_w(qn), out_f(qn);
      for (auto* x : {&k, &v, &q})
        for (double& d : *x) d = static_cast<double>(e.range(-1000, 1000)) / 250.0;
      const std::size_t pool_index = static_cast<std::size_t>(W::windowed_index(w) + 1);
      const Status a = reference::update_and_attend<Cache, double>(win_, w, win_pools_[pool_index].view(l), q, k, v, out_w, kHeadsQ,
                                                                  0.5f);
      const Status b = reference::update_and_attend<Cache, double>(full_, w, full_pool_.view(l), q, k, v, out_f, kHeadsQ, 0.5f);
      if (!a.ok() || !b.ok()) return fail(op_, "reference refused: " + std::string(a.message()) + " / " + std::string(b.message()));
      for (std::size_t i = 0; i < qn; ++i)
        if (std::abs(out_w[i] - out_f[i]) > 1e-12 * std::max(1.0, std::abs(out_f[i]))) {
          std::ostringstream o;
          o << "layer " << l << " (window " << w << "): attention output " << out_w[i] << " vs full " << out_f[i];
          return fail(op_, o.str());
        }
    }
    return {};
  }

  // Every id's pos and held positions agree; each window pool's metadata matches its tables, holds
  // only main-held positions and every main-held one the next token sees.
  std::string check_state() const {
    for (std::int32_t s = 0; s < full_.max_seqs(); ++s) {
      if (full_.is_live(s) != win_.is_live(s)) return fail(op_, "live ids differ");
      if (!full_.is_live(s)) continue;
      if (full_.pos(s).value() != win_.pos(s).value()) return fail(op_, "pos differs");
      if (full_.held_positions(s).value() != win_.held_positions(s).value()) return fail(op_, "held positions differ");
    }
    for (const std::int32_t w : W::kWindowed) {
      const auto& pool = win_.pool(w);
      std::map<std::int32_t, std::set<std::int32_t>> owners;  // cell -> sequences holding it
      std::string bad;
      win_.live_sequences().for_each([&](std::int32_t s) {
        const std::int32_t len = win_.pos(s).value();
        if (pool.table().length(s) != len) bad = "a window table's length differs from pos";
        for (std::int32_t p = 0; p < len && bad.empty(); ++p) {
          const std::int32_t c = pool.cell_of(s, p);
          const bool main_held = win_.cell_of(s, p) >= 0;
          if (c >= 0) {
            owners[c].insert(s);
            if (pool.cell_pos(c) != p) bad = "a window cell's position disagrees with its table";
            if (!main_held) bad = "a window pool holds a position the main pool does not";
          } else if (main_held && p >= keep_from(w, len)) {
            bad = "a window pool lacks a position the next token sees";
          }
        }
      });
      if (!bad.empty()) return fail(op_, bad);
      if (static_cast<std::int64_t>(owners.size()) + pool.free_cells() != pool.capacity())
        return fail(op_, "a window pool's free count disagrees with the cells its tables hold (a leak)");
      for (const auto& [c, seqs] : owners) {
        std::int32_t n = 0;
        for (const std::int32_t s : seqs) n += pool.cell_owners(c).test(s) ? 1 : 0;
        if (n != static_cast<std::int32_t>(seqs.size()) || pool.cell_owners(c).count() != n)
          return fail(op_, "a window cell's owners disagree with the tables holding it");
      }
    }
    return {};
  }

  Cache win_, full_;
  HostPool<double> full_pool_;
  std::vector<HostPool<double>> win_pools_;  // [0] main, [1 + i] window pool i
  std::int64_t op_ = 0, steps_ = 0, window_refusals_ = 0;
};

}  // namespace cellkv::test
