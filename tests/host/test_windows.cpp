// Compile-time window sets (distinct windows, buffer indices, per-layer windows) and the position
// rule of visibility.
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <limits>

#include "cellkv/visibility.hpp"
#include "cellkv/windows.hpp"

namespace {

using Gemma = cellkv::Windows<512, 512, 512, 512, 512, 0>;
static_assert(Gemma::kLayers == 6);
static_assert(Gemma::kDistinct == 2);
static_assert(Gemma::kDistinctWindows[0] == 512 && Gemma::kDistinctWindows[1] == 0);
static_assert(Gemma::buffer_of_layer(0) == 0 && Gemma::buffer_of_layer(5) == 1);
static_assert(Gemma::buffer_of<0>() == 1);
static_assert(Gemma::window_of_layer(5) == 0);

inline constexpr std::array<int, 5> kMixed{0, 8, 0, 8, 16};
using Mixed = cellkv::WindowsOf<kMixed>;
static_assert(std::is_same_v<Mixed, cellkv::Windows<0, 8, 0, 8, 16>>);
static_assert(cellkv::WindowSet<Mixed>);
static_assert(!cellkv::WindowSet<int>);

}  // namespace

TEST_CASE("layers sharing a window share a buffer") {
  CHECK(Mixed::kDistinct == 3);
  const std::array<std::int32_t, 5> expected_buffer{0, 1, 0, 1, 2};
  for (std::int32_t l = 0; l < Mixed::kLayers; ++l) {
    CHECK(Mixed::buffer_of_layer(l) == expected_buffer[static_cast<std::size_t>(l)]);
    CHECK(Mixed::kDistinctWindows[static_cast<std::size_t>(Mixed::buffer_of_layer(l))] == Mixed::window_of_layer(l));
  }
  CHECK(Mixed::buffer_of_window(4) == -1);
}

TEST_CASE("the position rule of visibility: rules 3 and 4, against a brute-force formula") {
  // W == 0: everything at or before the query; W > 0: the query and its W-1 predecessors.
  CHECK(cellkv::sees(0, 1000, 0));
  CHECK(cellkv::sees(1, 7, 7));
  CHECK_FALSE(cellkv::sees(1, 7, 6));
  CHECK(cellkv::sees(3, 7, 5));
  CHECK_FALSE(cellkv::sees(3, 7, 4));
  CHECK_FALSE(cellkv::sees(0, 7, 8));   // never the future
  CHECK_FALSE(cellkv::sees(0, 7, -1));  // -1: a free cell
  for (std::int32_t w = 0; w <= 9; ++w)
    for (std::int32_t q = 0; q <= 20; ++q) {
      const cellkv::PositionRange r = cellkv::visible_positions(w, q);
      for (std::int32_t c = -2; c <= 22; ++c) {
        const bool want = c >= 0 && c <= q && (w == 0 || q - c < w);
        CHECK(cellkv::sees(w, q, c) == want);
        CHECK(r.contains(c) == want);
      }
    }
  // Extremes do not overflow.
  constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
  CHECK(cellkv::visible_begin(kMax, kMax) == 1);
  CHECK(cellkv::visible_begin(1, kMax) == kMax);
  CHECK(cellkv::visible_begin(kMax, 0) == 0);
  CHECK(cellkv::visible_begin(std::numeric_limits<std::int32_t>::min(), 5) == 0);
}
