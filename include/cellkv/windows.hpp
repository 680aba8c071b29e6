// cellkv/windows.hpp - compile-time window sets: one mask buffer per distinct attention window.
//
// A window is per layer: 0 = full causal history, W > 0 = the query plus its W-1 previous
// positions. `Windows<w0, w1, ...>` lists a model's per-layer windows; everything below is a
// constant expression, and there is no runtime registry of windows.
//
//   using Gemma = cellkv::Windows<512, 512, 512, 512, 512, 0>;
//   static_assert(Gemma::kDistinct == 2);
//   static_assert(Gemma::buffer_of_layer(5) == 1);
//
//   inline constexpr std::array<std::int32_t, 3> kModel{0, 128, 0};
//   using Model = cellkv::WindowsOf<kModel>;     // the same set built from a constexpr list
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace cellkv {

template <std::int32_t... PerLayer>
struct Windows {
  static_assert(sizeof...(PerLayer) > 0, "cellkv::Windows: list the window of at least one layer");
  static_assert(((PerLayer >= 0) && ...),
                "cellkv::Windows: a window is 0 (full causal history) or a positive number of positions");

  static constexpr std::int32_t kLayers = static_cast<std::int32_t>(sizeof...(PerLayer));
  static constexpr std::array<std::int32_t, sizeof...(PerLayer)> kPerLayer{PerLayer...};

 private:
  static constexpr bool seen_before(std::size_t i) {
    for (std::size_t j = 0; j < i; ++j)
      if (kPerLayer[j] == kPerLayer[i]) return true;
    return false;
  }
  static constexpr std::int32_t count_distinct() {
    std::int32_t n = 0;
    for (std::size_t i = 0; i < kPerLayer.size(); ++i) n += seen_before(i) ? 0 : 1;
    return n;
  }

 public:
  // Number of distinct windows = number of mask buffers.
  static constexpr std::int32_t kDistinct = count_distinct();

  // The distinct windows in order of first appearance; buffer i serves window kDistinctWindows[i].
  static constexpr std::array<std::int32_t, static_cast<std::size_t>(kDistinct)> kDistinctWindows = [] {
    std::array<std::int32_t, static_cast<std::size_t>(kDistinct)> out{};
    std::size_t n = 0;
    for (std::size_t i = 0; i < kPerLayer.size(); ++i)
      if (!seen_before(i)) out[n++] = kPerLayer[i];
    return out;
  }();

  // Buffer index of window `w`, or -1 when no layer uses it.
  static constexpr std::int32_t buffer_of_window(std::int32_t w) {
    for (std::size_t i = 0; i < kDistinctWindows.size(); ++i)
      if (kDistinctWindows[i] == w) return static_cast<std::int32_t>(i);
    return -1;
  }

  // The distinct nonzero windows in order of first appearance: with window storage
  // (CacheConfig::window_cells) each has a pool of its own, pool i for kWindowed[i].
  static constexpr std::int32_t kWindowedCount = [] {
    std::int32_t n = 0;
    for (const std::int32_t w : kDistinctWindows) n += w > 0 ? 1 : 0;
    return n;
  }();
  static constexpr std::array<std::int32_t, static_cast<std::size_t>(kWindowedCount)> kWindowed = [] {
    std::array<std::int32_t, static_cast<std::size_t>(kWindowedCount)> out{};
    std::size_t n = 0;
    for (const std::int32_t w : kDistinctWindows)
      if (w > 0) out[n++] = w;
    return out;
  }();
  // Index of window `w` in kWindowed, or -1 for 0 and for a window no layer uses.
  static constexpr std::int32_t windowed_index(std::int32_t w) {
    if (w <= 0) return -1;
    std::int32_t i = 0;
    for (const std::int32_t d : kDistinctWindows) {  // (kWindowed may be empty)
      if (d == w) return i;
      i += d > 0 ? 1 : 0;
    }
    return -1;
  }

  // Window of layer `l`, for 0 <= l < kLayers.
  static constexpr std::int32_t window_of_layer(std::int32_t l) { return kPerLayer[static_cast<std::size_t>(l)]; }

  // Buffer index of layer `l`: layers sharing a window share a buffer.
  static constexpr std::int32_t buffer_of_layer(std::int32_t l) { return buffer_of_window(window_of_layer(l)); }

  // Compile-time buffer index of window W, refused at compile time when no layer uses W.
  template <std::int32_t W>
  static constexpr std::int32_t buffer_of() {
    static_assert(buffer_of_window(W) >= 0, "cellkv::Windows::buffer_of<W>: no layer of this set uses window W");
    return buffer_of_window(W);
  }
};

namespace detail {
template <auto List, class Idx>
struct windows_from_list;
template <auto List, std::size_t... I>
struct windows_from_list<List, std::index_sequence<I...>> {
  using type = Windows<static_cast<std::int32_t>(List[I])...>;
};
}  // namespace detail

// The window set of a model given as a constexpr list (std::array of integers), one per layer.
template <auto List>
using WindowsOf = typename detail::windows_from_list<List, std::make_index_sequence<List.size()>>::type;

namespace detail {
template <class T>
struct is_windows : std::false_type {};
template <std::int32_t... W>
struct is_windows<Windows<W...>> : std::true_type {};
}  // namespace detail

template <class W>
concept WindowSet = detail::is_windows<W>::value;

}  // namespace cellkv
