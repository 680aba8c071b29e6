// cellkv/footprint.hpp - the device memory a device cache of one configuration allocates on each
// device it spans (one shard), known before anything is allocated (docs/design.md section 5).
//
//   kv_pools        2 x layers x (rows + 1) x H_kv x (D x element bytes + scale bytes)
//                   K and V of every layer, rows = max_cells (cell layout) or max_seqs x max_len
//                   (sequence layout), + scratch row; scale bytes: the fp32 scale of each row-head
//                   of an fp8 pool (4), 0 for bf16 / fp16 / fp32 pools (docs/design.md section 5).
//                   With window storage (window_cells > 0) a layer of nonzero window has
//                   window_cells rows instead (+ scratch row), and the position tables of the
//                   window pools, PositionTable::flat_size(max_seqs, window_cells, max_cells)
//                   entries each, join the position table's
//   step_block      StepBlockLayout(step_block_shape(...)).bytes          (step_block.hpp; with the
//                   shared-prefix part when the cache shares prefixes)
//   position_table  4 x PositionTable::flat_size(max_seqs, max_cells)    cell layout
//   masks           windows x max_write x max_cells (bool)                cell layout, when built
//
// Not counted: the table kernels' scratch (partial softmax results: of the decode kernel, sized
// from the device, 2 x SMs x resident decode blocks per SM x warps x 16 x (D + 1) floats, about
// 17 MB on an H200 for bf16 / fp16 at D = 128 (8 warps), 26 MB for the fp8 columns kernel (12
// warps); of the shared-prefix kernel,
// shared_slot_capacity(max_write) x H_q x (D + 1) floats, at most 2048 x H_q x (D + 1) x 4 bytes),
// and host memory (the pinned staging of two step blocks, the fault word).
// Every size is computed in size_t; a configuration whose sizes overflow is refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>

#include "cellkv/layout.hpp"
#include "cellkv/pool_view.hpp"
#include "cellkv/position_table.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_block.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv {

// Device bytes of one shard of a device cache, by part.
struct Footprint {
  std::size_t kv_pools = 0;
  std::size_t step_block = 0;
  std::size_t position_table = 0;
  std::size_t masks = 0;
  std::size_t total = 0;  // the sum of the parts
  friend bool operator==(const Footprint&, const Footprint&) = default;
};

// What the device side of a cache builds besides its pools and position table; the device cache
// type decides it (DeviceShard::footprint).
struct DeviceParts {
  std::size_t element_bytes = 0;  // bytes of one K or V element
  bool masks = false;             // the dense masks (cell layout)
  bool shared_prefixes = false;   // the step block's shared-prefix part (cell layout)
  std::size_t scale_bytes = 0;    // bytes of the scale beside each row-head of K and of V (fp8: 4)
};

// How a pool stores K and V, and what that costs per element and per row-head.
enum class KvStorage : std::uint8_t { bf16, fp16, fp32, fp8_e4m3 };

struct StorageBytes {
  std::size_t element = 0;  // one K or V element
  std::size_t scale = 0;    // the scale of one row-head of K or V (fp8: fp32, fp8.hpp)
};

constexpr StorageBytes storage_bytes(KvStorage s) noexcept {
  switch (s) {
    case KvStorage::bf16:
    case KvStorage::fp16: return {2, 0};
    case KvStorage::fp32: return {4, 0};
    case KvStorage::fp8_e4m3: return {1, 4};
  }
  return {};
}

namespace detail {
// The product of the factors, or nothing when it overflows size_t.
inline std::optional<std::size_t> size_product(std::initializer_list<std::size_t> factors) noexcept {
  std::size_t p = 1;
  for (const std::size_t f : factors) {
    if (f != 0 && p > std::numeric_limits<std::size_t>::max() / f) return std::nullopt;
    p *= f;
  }
  return p;
}
// The sum of the terms, or nothing when it overflows size_t.
inline std::optional<std::size_t> size_sum(std::initializer_list<std::size_t> terms) noexcept {
  std::size_t s = 0;
  for (const std::size_t t : terms) {
    if (t > std::numeric_limits<std::size_t>::max() - s) return std::nullopt;
    s += t;
  }
  return s;
}
}  // namespace detail

// The pool bytes one cell (one row) takes, over K and V of every layer of `shape`, scales included:
// 2 x layers x H_kv x (D x element + scale). What a cache's kv_pools grow by per cell of capacity.
// Refuses a non-positive layer, head or head-dim count (bad_shape) and a size that overflows
// (size_overflow).
inline Result<std::size_t> pool_bytes_per_cell(const PoolShape& shape, KvStorage storage) noexcept {
  if (shape.layers < 1 || shape.heads_kv < 1 || shape.head_dim < 1) return Errc::bad_shape;
  const StorageBytes b = storage_bytes(storage);
  const auto size = [](std::int32_t n) { return static_cast<std::size_t>(n); };
  const std::optional<std::size_t> head = detail::size_product({size(shape.head_dim), b.element});
  if (!head || *head > std::numeric_limits<std::size_t>::max() - b.scale) return Errc::size_overflow;
  const std::optional<std::size_t> cell = detail::size_product({2, size(shape.layers), size(shape.heads_kv), *head + b.scale});
  if (!cell) return Errc::size_overflow;
  return *cell;
}

// Layers of window set W whose window is `window`.
template <class W>
[[nodiscard]] constexpr std::int32_t windows_layers_of(std::int32_t window) noexcept {
  std::int32_t n = 0;
  for (const std::int32_t w : W::kPerLayer) n += w == window ? 1 : 0;
  return n;
}

// The device bytes a shard of `shape` (its own heads) of a device cache planned by `Host` (a
// KVCache) allocates for `config`, with the parts `parts` says it builds. Refuses what
// Host::validate refuses, a non-positive layer, head or head-dim count (bad_shape), an element
// size of 0 (bad_argument), and sizes that overflow (size_overflow).
template <class Host>
Result<Footprint> device_footprint(const CacheConfig& config, const PoolShape& shape, const DeviceParts& parts) {
  using L = typename Host::Layout;
  if (const Status s = Host::validate(config); !s.ok()) return s.code();
  if (shape.layers < 1 || shape.heads_kv < 1 || shape.head_dim < 1 || shape.heads_q < 0) return Errc::bad_shape;
  if (parts.element_bytes == 0) return Errc::bad_argument;
  const Result<StepBlockShape> block = step_block_shape<Host>(config, shape, parts.shared_prefixes);
  if (!block.ok()) return block.status().code();

  CacheConfig normal = config;
  if (normal.max_seqs == 0) normal.max_seqs = Host::kMaxSeqs;
  const std::int32_t seqs = normal.max_seqs;
  const auto size = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  // With window storage the layers of each nonzero window keep window_cells rows, the others the
  // layout's rows; the shard's layers are then the window set's.
  using W = typename Host::Windows;
  const bool windowed = config.window_cells > 0;
  if (windowed && shape.layers != W::kLayers) return Errc::bad_shape;
  const std::int32_t windowed_layers = windowed ? W::kLayers - windows_layers_of<W>(0) : 0;
  const std::optional<std::size_t> head = detail::size_product({size(shape.head_dim), parts.element_bytes});
  const std::optional<std::size_t> row = head && *head <= std::numeric_limits<std::size_t>::max() - parts.scale_bytes
                                             ? detail::size_product({2, size(shape.heads_kv), *head + parts.scale_bytes})
                                             : std::nullopt;
  const std::optional<std::size_t> main_rows =
      row ? detail::size_product({size(shape.layers - windowed_layers), size(L::rows(normal)) + 1, *row}) : std::nullopt;
  const std::optional<std::size_t> window_rows =
      row ? detail::size_product({size(windowed_layers), size(config.window_cells) + 1, *row}) : std::nullopt;
  const std::optional<std::size_t> kv =
      main_rows && window_rows ? detail::size_sum({*main_rows, *window_rows}) : std::nullopt;
  const std::int64_t table_entries =
      PositionTable::flat_size(seqs, config.max_cells) +
      (windowed ? W::kWindowedCount * PositionTable::flat_size(seqs, config.window_cells, config.max_cells) : 0);
  // The device keeps every pool's table in one array that table writes index by int32.
  if (L::kPositionTable && table_entries > std::numeric_limits<std::int32_t>::max()) return Errc::size_overflow;
  const std::optional<std::size_t> table =
      L::kPositionTable ? detail::size_product({sizeof(std::int32_t), size(table_entries)}) : std::optional<std::size_t>{0};
  const std::optional<std::size_t> mask_bytes =
      L::kPositionTable && parts.masks
          ? detail::size_product({size(Host::Windows::kDistinct), size(config.max_write), size(config.max_cells)})
          : std::optional<std::size_t>{0};
  if (!kv || !table || !mask_bytes) return Errc::size_overflow;

  Footprint f{*kv, StepBlockLayout(block.value()).bytes, *table, *mask_bytes, 0};
  const std::optional<std::size_t> total = detail::size_sum({f.kv_pools, f.step_block, f.position_table, f.masks});
  if (!total) return Errc::size_overflow;
  f.total = *total;
  return f;
}

}  // namespace cellkv
