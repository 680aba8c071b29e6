// cellkv/detail/bitmap.hpp - a two-level bitmap: finding the lowest or highest set bit costs
// O(n / 4096) word reads at worst, so planning a step never rescans all cells.
//
// Level 0: one bit per element. Level 1: bit w is set iff level-0 word w is non-zero.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace cellkv::detail {

class Bitmap {
 public:
  Bitmap() = default;
  // n bits, all equal to `value`.
  Bitmap(std::int64_t n, bool value) { assign(n, value); }

  void assign(std::int64_t n, bool value) {
    size_ = n;
    words_.assign(static_cast<std::size_t>((n + 63) / 64), value ? ~std::uint64_t{0} : 0);
    if (value && n % 64 != 0) words_.back() = (std::uint64_t{1} << (n % 64)) - 1;
    summary_.assign((words_.size() + 63) / 64, 0);
    for (std::size_t w = 0; w < words_.size(); ++w)
      if (words_[w] != 0) summary_[w >> 6] |= std::uint64_t{1} << (w & 63);
  }

  // Heap bytes of a bitmap of n bits (both levels).
  static constexpr std::size_t bytes(std::int64_t n) noexcept {
    const auto words = static_cast<std::size_t>((n + 63) / 64);
    return 8 * (words + (words + 63) / 64);
  }

  [[nodiscard]] std::int64_t size() const noexcept { return size_; }
  [[nodiscard]] bool test(std::int64_t i) const noexcept { return (words_[word(i)] >> (i & 63)) & 1; }

  void set(std::int64_t i) noexcept {
    const auto w = word(i);
    words_[w] |= std::uint64_t{1} << (i & 63);
    summary_[w >> 6] |= std::uint64_t{1} << (w & 63);
  }
  void reset(std::int64_t i) noexcept {
    const auto w = word(i);
    words_[w] &= ~(std::uint64_t{1} << (i & 63));
    if (words_[w] == 0) summary_[w >> 6] &= ~(std::uint64_t{1} << (w & 63));
  }

  // Lowest set bit at index >= from, or -1.
  [[nodiscard]] std::int64_t find_first(std::int64_t from = 0) const noexcept {
    if (from >= size_) return -1;
    if (from < 0) from = 0;
    std::size_t w = word(from);
    const std::uint64_t head = words_[w] & (~std::uint64_t{0} << (from & 63));
    if (head != 0) return static_cast<std::int64_t>(w * 64) + std::countr_zero(head);
    const std::size_t next = next_nonzero_word(w + 1);
    return next == words_.size() ? -1 : static_cast<std::int64_t>(next * 64) + std::countr_zero(words_[next]);
  }

  // Highest set bit, or -1.
  [[nodiscard]] std::int64_t find_last() const noexcept {
    for (std::size_t s = summary_.size(); s-- > 0;) {
      if (summary_[s] == 0) continue;
      const std::size_t w = s * 64 + 63 - static_cast<std::size_t>(std::countl_zero(summary_[s]));
      return static_cast<std::int64_t>(w * 64) + 63 - std::countl_zero(words_[w]);
    }
    return -1;
  }

  // The 64 bits of word w (bits [64w, 64w + 64)).
  [[nodiscard]] std::uint64_t word_bits(std::int64_t w) const noexcept { return words_[static_cast<std::size_t>(w)]; }

  friend bool operator==(const Bitmap&, const Bitmap&) = default;

 private:
  static std::size_t word(std::int64_t i) noexcept { return static_cast<std::size_t>(i >> 6); }

  // First word index >= w whose bits are non-zero, or words_.size().
  [[nodiscard]] std::size_t next_nonzero_word(std::size_t w) const noexcept {
    if (w >= words_.size()) return words_.size();
    std::size_t s = w >> 6;
    std::uint64_t bits = summary_[s] & (~std::uint64_t{0} << (w & 63));
    while (bits == 0) {
      if (++s == summary_.size()) return words_.size();
      bits = summary_[s];
    }
    return s * 64 + static_cast<std::size_t>(std::countr_zero(bits));
  }

  std::int64_t size_ = 0;
  std::vector<std::uint64_t> words_;
  std::vector<std::uint64_t> summary_;
};

}  // namespace cellkv::detail
