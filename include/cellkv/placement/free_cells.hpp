// cellkv/placement/free_cells.hpp - what a placement policy sees of the cell layout's free cells.
//
// A FreeCells is a short-lived view the cache hands to Placement::pick (placement.hpp) for one
// token: the free-cell bitmap of the pool and the cache's lowest-free hint. It is valid only
// during that call.
#pragma once

#include <cstdint>

#include "cellkv/detail/bitmap.hpp"

namespace cellkv {

class FreeCells {
 public:
  // free: bit c set iff cell c is free; hint: no free cell lies below *hint (the cache's, kept
  // up to date by lowest()); count: the number of free cells.
  FreeCells(const detail::Bitmap& free, std::int32_t& hint, std::int64_t count) noexcept
      : free_(&free), hint_(&hint), count_(count) {}

  // Cells in the pool (max_cells) and how many are free (>= 1 whenever pick is called).
  [[nodiscard]] std::int32_t size() const noexcept { return static_cast<std::int32_t>(free_->size()); }
  [[nodiscard]] std::int64_t count() const noexcept { return count_; }
  [[nodiscard]] bool is_free(std::int32_t c) const noexcept { return c >= 0 && c < size() && free_->test(c); }

  // The lowest free cell; precondition count() >= 1. A run of calls over a filling pool scans
  // each bitmap word once (the hint moves past the cell returned).
  [[nodiscard]] std::int32_t lowest() noexcept {
    const auto c = static_cast<std::int32_t>(free_->find_first(*hint_));
    *hint_ = c + 1;
    return c;
  }
  // The lowest free cell >= from, or -1 when none.
  [[nodiscard]] std::int32_t first_from(std::int32_t from) const noexcept {
    return static_cast<std::int32_t>(free_->find_first(from));
  }

 private:
  const detail::Bitmap* free_;
  std::int32_t* hint_;
  std::int64_t count_;
};

}  // namespace cellkv
