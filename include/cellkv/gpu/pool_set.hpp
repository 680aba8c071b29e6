// cellkv/gpu/pool_set.hpp - the KV pools of a device shard, one per pool of its host cache.
//
// Without window storage one KVPool holds every layer (rows: the layout's). With window storage
// (CacheConfig::window_cells > 0, cell layout) pool 0 holds the full-attention layers (window 0;
// max_cells rows) and pool 1 + i the layers of window W::kWindowed[i] (window_cells rows each), as
// the host cache keeps a main pool and one pool per distinct nonzero window. A layer's rows are its
// pool's; view(layer) is the layer's K and V wherever it lives.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cellkv/gpu/kv_pool.hpp"
#include "cellkv/windows.hpp"

namespace cellkv::gpu {

template <Layout L, KvElement T, WindowSet W>
class PoolSet {
 public:
  using Pool = KVPool<L, T>;

  // shape: every layer of W (shape.layers == W::kLayers); each pool gets the layers of its class.
  // Throws as KVPool does.
  PoolSet(const CacheConfig& config, const PoolShape& shape) {
    const bool windowed = config.window_cells > 0;
    const std::int32_t pools = windowed ? 1 + W::kWindowedCount : 1;
    std::vector<std::int32_t> layers(static_cast<std::size_t>(pools), 0);
    for (std::int32_t l = 0; l < W::kLayers; ++l) {
      const std::int32_t p = pool_index(windowed, W::window_of_layer(l));
      pool_of_[static_cast<std::size_t>(l)] = p;
      local_[static_cast<std::size_t>(l)] = layers[static_cast<std::size_t>(p)]++;
    }
    for (std::int32_t p = 0; p < pools; ++p) {
      const std::int32_t n = layers[static_cast<std::size_t>(p)];
      if (n == 0) {  // a set whose every layer is windowed has no full-attention layer
        pools_.push_back(nullptr);
        continue;
      }
      PoolShape s = shape;
      s.layers = n;
      pools_.push_back(p == 0 ? std::make_unique<Pool>(config, s) : std::make_unique<Pool>(config.window_cells, s));
    }
    shape_ = shape;
  }

  // Every layer's heads and dims (layers: W::kLayers).
  [[nodiscard]] const PoolShape& shape() const noexcept { return shape_; }
  // Pools: 1, or 1 + W::kWindowedCount with window storage.
  [[nodiscard]] std::int32_t count() const noexcept { return static_cast<std::int32_t>(pools_.size()); }
  // Pool p; nullptr for a main pool that no layer uses (every layer windowed).
  [[nodiscard]] const Pool* pool(std::int32_t p) const noexcept { return pools_[static_cast<std::size_t>(p)].get(); }
  [[nodiscard]] std::int32_t pool_of(std::int32_t layer) const noexcept {
    return pool_of_[static_cast<std::size_t>(layer)];
  }
  // The pool of the layers of window `window` (0 for full attention, and for every window without
  // window storage).
  [[nodiscard]] std::int32_t pool_of_window(std::int32_t window) const noexcept { return pool_index(count() > 1, window); }
  [[nodiscard]] auto view(std::int32_t layer) const noexcept {
    return pool(pool_of(layer))->view(local_[static_cast<std::size_t>(layer)]);
  }

  // fp8 pools: the scaling of later writes, every layer's (a static config lists W::kLayers
  // scales; each pool takes those of its layers). Refuses what check_fp8_config refuses
  // (bad_argument), changing nothing.
  [[nodiscard]] Status set_fp8_config(const Fp8Config& config)
    requires kFp8Kv<T>
  {
    if (const Status s = check_fp8_config(config, W::kLayers); !s.ok()) return s;
    for (std::int32_t p = 0; p < count(); ++p) {
      if (pools_[static_cast<std::size_t>(p)] == nullptr) continue;
      Fp8Config part{config.scaling, {}};
      if (config.scaling == Fp8Scaling::static_per_layer)
        for (std::int32_t l = 0; l < W::kLayers; ++l)
          if (pool_of(l) == p) part.static_scales.push_back(config.static_scales[static_cast<std::size_t>(l)]);
      if (const Status s = pools_[static_cast<std::size_t>(p)]->set_fp8_config(std::move(part)); !s.ok()) return s;
    }
    return {};
  }

 private:
  // Pool of the layers of `window`: 0 without window storage or for window 0 (windowed_index -1).
  static constexpr std::int32_t pool_index(bool windowed, std::int32_t window) noexcept {
    return windowed ? 1 + W::windowed_index(window) : 0;
  }

  PoolShape shape_;
  std::vector<std::unique_ptr<Pool>> pools_;
  std::array<std::int32_t, static_cast<std::size_t>(W::kLayers)> pool_of_{}, local_{};
};

}  // namespace cellkv::gpu
