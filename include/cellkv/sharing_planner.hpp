// cellkv/sharing_planner.hpp - plans the shared prefixes of a step (prefix_sharing.hpp) from its
// segments and the host position table.
//
// Depth-first over the classes of segments that hold the same pages: a class's run spans the pages
// all its members agree on, then the class splits by its members' next page (a member whose
// queries start in that page leaves it). Runs come out parent before child. Splits are chosen so
// the shared kernel's items fill its grid; when the runs need more slots or items than the step
// block holds, splits fall to one and then the last (deepest) runs are dropped: their members
// read those positions themselves, so the plan is always complete. Then, where the kernel offers
// it (SharingShape::finish_own), the decode segments of kept runs with few own positions become
// finished segments (prefix_sharing.hpp), while the slots last.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/position_table.hpp"
#include "cellkv/prefix_sharing.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv {

// Plans the sharing of a step. Reusable: keeps its scratch between steps.
class SharingPlanner {
 public:
  // segments: the step's; table: the host position table after placement. Writes `out` (with
  // own_begin 0 and no slots for every segment and token outside a run; out.finished may be null
  // when shape.finish_own is 0).
  void plan(std::span<const Segment> segments, const PositionTable& table, const SharingShape& shape,
            const SharedWork& out) {
    segments_ = segments;
    table_ = &table;
    runs_.clear();
    members_.clear();
    for (std::size_t i = 0; i < segments.size(); ++i) out.own_begin[i] = 0;
    std::vector<std::int32_t> candidates;
    for (std::size_t i = 0; i < segments.size(); ++i)  // only segments whose first page is shared
      if (full_pages(static_cast<std::int32_t>(i)) > 0 && table.holders(page(static_cast<std::int32_t>(i), 0)) > 1)
        candidates.push_back(static_cast<std::int32_t>(i));
    if (candidates.size() > 1) split(candidates, 0, out);
    choose_splits(shape, out);
    choose_finished(shape, out);
    write(shape, out);
  }

  // Per segment of the last plan: 1 when the shared-prefix kernel finishes it (its tokens are not
  // decode work: plan_window skips them).
  [[nodiscard]] std::span<const std::uint8_t> finished_segments() const noexcept { return finished_; }

 private:
  struct Run {
    std::int32_t begin_page, end_page, member0, members, splits;
  };

  [[nodiscard]] std::int32_t full_pages(std::int32_t s) const noexcept {
    return segments_[static_cast<std::size_t>(s)].pos0 / kPagePositions;  // pages wholly below its queries
  }
  [[nodiscard]] std::int32_t page(std::int32_t s, std::int32_t k) const noexcept {
    return table_->view().page_of(segments_[static_cast<std::size_t>(s)].seq, k * kPagePositions);
  }
  // `segs` agree on pages [0, k): groups them by their page k; groups of two or more extend a run.
  void split(std::span<const std::int32_t> segs, std::int32_t k, const SharedWork& out) {
    std::vector<std::int32_t> alive;
    for (const std::int32_t s : segs) {
      if (full_pages(s) > k && page(s, k) >= 0) alive.push_back(s);  // an absent page (holes) is not shared
      else out.own_begin[s] = k * kPagePositions;
    }
    std::sort(alive.begin(), alive.end(), [&](std::int32_t a, std::int32_t b) {
      const std::int32_t pa = page(a, k), pb = page(b, k);
      return pa != pb ? pa < pb : a < b;
    });
    for (std::size_t i = 0; i < alive.size();) {
      std::size_t j = i + 1;
      while (j < alive.size() && page(alive[j], k) == page(alive[i], k)) ++j;
      if (j - i == 1) out.own_begin[alive[i]] = k * kPagePositions;
      else extend(std::span<const std::int32_t>(alive.data() + i, j - i), k, out);
      i = j;
    }
  }

  // `group` (two or more) agree on pages [0, k0 + 1): a run from k0 to where they stop agreeing.
  void extend(std::span<const std::int32_t> group, std::int32_t k0, const SharedWork& out) {
    std::int32_t k = k0 + 1;
    for (;; ++k) {
      bool same = true;
      for (const std::int32_t s : group) same = same && full_pages(s) > k && page(s, k) >= 0 && page(s, k) == page(group[0], k);
      if (!same) break;
    }
    runs_.push_back(Run{k0, k, static_cast<std::int32_t>(members_.size()), static_cast<std::int32_t>(group.size()), 1});
    members_.insert(members_.end(), group.begin(), group.end());
    split(group, k, out);
  }

  [[nodiscard]] std::int64_t tokens_of(const Run& r) const {
    std::int64_t n = 0;
    for (std::int32_t m = 0; m < r.members; ++m) n += segments_[static_cast<std::size_t>(members_[static_cast<std::size_t>(r.member0 + m)])].len;
    return n;
  }

  // Splits so that items x H_kv fill the shared kernel in one wave, within the capacities; then drops the
  // last runs (deepest first: runs are in depth-first order) while they do not fit.
  void choose_splits(const SharingShape& shape, const SharedWork& out) {
    std::int64_t blocks = 0;
    for (const Run& r : runs_) blocks += (tokens_of(r) * shape.group + shape.rows - 1) / shape.rows;
    // As many splits as still give every item x KV head a worker of its own (one wave).
    const std::int64_t want = blocks == 0 ? 1 : std::max<std::int64_t>(1, shape.workers / (blocks * shape.heads_kv));
    // At most tiles / kMinSplitTiles splits, so at most as many as the run has split_unit blocks
    // (split_unit <= kMinSplitTiles, table_attention.cuh asserts it): every split is non-empty.
    // Fewer where the slots would not leave room for the own slots of the segments to finish.
    const std::int64_t reserve = finish_reserve(shape, out);
    for (std::int64_t splits = std::min<std::int64_t>(want, kMaxSplits);; --splits) {
      for (Run& r : runs_)
        r.splits = static_cast<std::int32_t>(std::clamp<std::int64_t>(
            std::min<std::int64_t>(splits, (r.end_page - r.begin_page) / kMinSplitTiles), 1, kMaxSplits));
      if (splits <= 1 || fits(shape, reserve)) break;
    }
    if (!fits(shape))
      for (Run& r : runs_) r.splits = 1;
    while (!runs_.empty() && (!fits(shape) || static_cast<std::int32_t>(runs_.size()) > shape.max_runs)) {
      const Run& r = runs_.back();
      for (std::int32_t m = 0; m < r.members; ++m) {
        std::int32_t& own = out.own_begin[members_[static_cast<std::size_t>(r.member0 + m)]];
        own = std::min(own, r.begin_page * kPagePositions);
      }
      runs_.pop_back();
    }
  }
  // Whether the runs' slots and `reserve` more, and their items, fit the step block.
  [[nodiscard]] bool fits(const SharingShape& shape, std::int64_t reserve = 0) const {
    std::int64_t items = 0;
    for (const Run& r : runs_) items += (tokens_of(r) * shape.group + shape.rows - 1) / shape.rows * r.splits;
    return run_slots() + reserve <= shape.slots && items <= shape.slots;
  }
  [[nodiscard]] std::int64_t run_slots() const {
    std::int64_t slots = 0;
    for (const Run& r : runs_) slots += tokens_of(r) * r.splits;
    return slots;
  }

  // Whether segment i may be finished: a decode segment of a run (own_begin > 0) reading at most
  // shape.finish_own positions itself.
  [[nodiscard]] bool finishable(std::size_t i, const SharingShape& shape, const SharedWork& out) const {
    const Segment& s = segments_[i];
    const std::int32_t own = s.pos0 + s.len - out.own_begin[i];  // positions [own_begin, last query]
    return out.finished != nullptr && is_decode(s, shape.group, shape.decode_rows) && out.own_begin[i] > 0 &&
           own <= std::min(shape.finish_own, kMaxFinishOwn);
  }
  // The tokens of the finishable segments (their own slots), 0 when their rows would pass
  // shape.finish_rows: then none is finished.
  [[nodiscard]] std::int64_t finish_reserve(const SharingShape& shape, const SharedWork& out) const {
    std::int64_t n = 0;
    for (std::size_t i = 0; i < segments_.size(); ++i) n += finishable(i, shape, out) ? segments_[i].len : 0;
    return n * shape.group * shape.heads_kv > shape.finish_rows ? 0 : n;
  }

  // Marks the finishable segments as finished, in segment order while their own slots fit; none
  // when their rows would pass shape.finish_rows.
  void choose_finished(const SharingShape& shape, const SharedWork& out) {
    finished_.assign(segments_.size(), 0);
    if (finish_reserve(shape, out) == 0) return;
    std::int64_t slots = run_slots();
    for (std::size_t i = 0; i < segments_.size(); ++i) {
      if (!finishable(i, shape, out) || slots + segments_[i].len > shape.slots) continue;
      finished_[i] = 1;
      slots += segments_[i].len;
    }
  }

  // The kept runs into `out`: each token's slots consecutive, its runs in depth order and each
  // run's splits in split order, then a finished token's own slot; the finished tokens.
  void write(const SharingShape& shape, const SharedWork& out) {
    const std::size_t tokens = segments_.empty() ? 0 : static_cast<std::size_t>(segments_.back().tok0 + segments_.back().len);
    std::vector<std::int32_t>& level = scratch_count_;  // per token: its slots so far
    level.assign(tokens, 0);
    for (const Run& r : runs_)
      for_each_member_token(r, [&](std::int32_t t, std::int32_t) { level[static_cast<std::size_t>(t)] += r.splits; });
    std::int32_t finished = 0;
    for (std::size_t i = 0; i < segments_.size(); ++i) {
      if (finished_[i] == 0) continue;
      const Segment& s = segments_[i];
      for (std::int32_t j = 0; j < s.len; ++j) {
        out.finished[finished++] = FinishedToken{s.tok0 + j, s.seq, s.pos0 + j, out.own_begin[i]};
        ++level[static_cast<std::size_t>(s.tok0 + j)];  // the own slot, after the runs' slots
      }
    }
    out.counts[3] = finished;
    std::int32_t next = 0;
    for (std::size_t t = 0; t < tokens; ++t) {
      out.token_slots[t] = SlotRange{next, level[t]};
      next += level[t];
      level[t] = 0;
    }
    std::int32_t token_at = 0, items = 0;
    std::vector<std::int32_t>& position = scratch_position_;  // per run token: its query position
    for (std::size_t i = 0; i < runs_.size(); ++i) {
      const Run& r = runs_[i];
      const std::int32_t token0 = token_at;
      position.clear();
      for_each_member_token(r, [&](std::int32_t t, std::int32_t pos) {
        out.run_tokens[token_at] = t;
        out.run_slot[token_at++] = out.token_slots[t].first + level[static_cast<std::size_t>(t)];
        level[static_cast<std::size_t>(t)] += r.splits;
        position.push_back(pos);
      });
      const std::int32_t seq = segments_[static_cast<std::size_t>(members_[static_cast<std::size_t>(r.member0)])].seq;
      out.runs[i] = SharedRun{seq, r.begin_page * kPagePositions, r.end_page * kPagePositions, token0, token_at - token0,
                              r.splits, shape.split_unit};
      const std::int32_t rows = (token_at - token0) * shape.group;
      for (std::int32_t row0 = 0; row0 < rows; row0 += shape.rows) {
        const auto first = position.begin() + row0 / shape.group;
        const auto last = position.begin() + (std::min(rows, row0 + shape.rows) - 1) / shape.group + 1;
        const auto [lo, hi] = std::minmax_element(first, last);
        for (std::int32_t k = 0; k < r.splits; ++k)
          out.items[items++] = SharedItem{static_cast<std::int32_t>(i), k, row0, *lo, *hi};
      }
    }
    out.counts[0] = static_cast<std::int32_t>(runs_.size());
    out.counts[1] = items;
    out.counts[2] = token_at;
  }
  // f(token, its query position) for every member token of r, member by member.
  template <class F>
  void for_each_member_token(const Run& r, F&& f) const {
    for (std::int32_t m = 0; m < r.members; ++m) {
      const Segment& s = segments_[static_cast<std::size_t>(members_[static_cast<std::size_t>(r.member0 + m)])];
      for (std::int32_t t = 0; t < s.len; ++t) f(s.tok0 + t, s.pos0 + t);
    }
  }

  std::span<const Segment> segments_;
  const PositionTable* table_ = nullptr;
  std::vector<Run> runs_;
  std::vector<std::int32_t> members_;  // segment indices of every run, run by run
  std::vector<std::uint8_t> finished_;  // per segment: finished by the shared-prefix kernel
  std::vector<std::int32_t> scratch_count_;
  std::vector<std::int32_t> scratch_position_;
};

}  // namespace cellkv
