// cellkv/seq_set.hpp - a fixed-size set of sequence ids: the owners of a cell.
//
// MaxSeqs bits in ceil(MaxSeqs / 64) words; bit s is set when sequence s owns the cell. The word
// layout: word w holds ids [64w, 64w + 64).
#pragma once

#include <array>
#include <bit>
#include <cstdint>

namespace cellkv {

// The most sequence ids a cache (and a SeqSet) may have: a SeqSet is stored inline per cell, so
// its size (MaxSeqs / 8 bytes) stays small, and id arithmetic stays far from int32's limit.
inline constexpr std::int32_t kMaxSeqsLimit = 65536;

template <std::int32_t MaxSeqs = 256>
class SeqSet {
  static_assert(MaxSeqs >= 1 && MaxSeqs <= kMaxSeqsLimit, "cellkv::SeqSet<MaxSeqs>: MaxSeqs must lie in [1, 65536]");

 public:
  static constexpr std::int32_t kMaxSeqs = MaxSeqs;
  static constexpr std::int32_t kWords = (MaxSeqs + 63) / 64;

  constexpr void set(std::int32_t s) noexcept { words_[word(s)] |= bit(s); }
  constexpr void reset(std::int32_t s) noexcept { words_[word(s)] &= ~bit(s); }
  constexpr void clear() noexcept { words_ = {}; }
  [[nodiscard]] constexpr bool test(std::int32_t s) const noexcept { return (words_[word(s)] & bit(s)) != 0; }

  [[nodiscard]] constexpr bool empty() const noexcept {
    for (auto w : words_)
      if (w != 0) return false;
    return true;
  }
  [[nodiscard]] constexpr std::int32_t count() const noexcept {
    std::int32_t n = 0;
    for (auto w : words_) n += std::popcount(w);
    return n;
  }
  // Lowest member, or -1 when empty.
  [[nodiscard]] constexpr std::int32_t first() const noexcept {
    for (std::int32_t i = 0; i < kWords; ++i)
      if (words_[i] != 0) return i * 64 + std::countr_zero(words_[i]);
    return -1;
  }
  // Highest member, or -1 when empty.
  [[nodiscard]] constexpr std::int32_t last() const noexcept {
    for (std::int32_t i = kWords; i-- > 0;)
      if (words_[i] != 0) return i * 64 + 63 - std::countl_zero(words_[i]);
    return -1;
  }
  // Lowest id in [0, limit) that is not a member, or -1 when all are members.
  [[nodiscard]] constexpr std::int32_t first_absent(std::int32_t limit = MaxSeqs) const noexcept {
    for (std::int32_t i = 0; i * 64 < limit; ++i) {
      const std::uint64_t absent = ~words_[i];
      if (absent == 0) continue;
      const std::int32_t s = i * 64 + std::countr_zero(absent);
      return s < limit ? s : -1;
    }
    return -1;
  }
  // Calls f(s) for every member s in ascending order.
  template <class F>
  constexpr void for_each(F&& f) const {
    for (std::int32_t i = 0; i < kWords; ++i)
      for (std::uint64_t w = words_[i]; w != 0; w &= w - 1) f(i * 64 + std::countr_zero(w));
  }

  [[nodiscard]] constexpr std::uint64_t word_at(std::int32_t i) const noexcept { return words_[i]; }
  [[nodiscard]] constexpr const std::array<std::uint64_t, kWords>& words() const noexcept { return words_; }

  friend constexpr bool operator==(const SeqSet&, const SeqSet&) = default;

 private:
  static constexpr std::int32_t word(std::int32_t s) noexcept { return s >> 6; }
  static constexpr std::uint64_t bit(std::int32_t s) noexcept { return std::uint64_t{1} << (s & 63); }

  std::array<std::uint64_t, kWords> words_{};
};

}  // namespace cellkv
