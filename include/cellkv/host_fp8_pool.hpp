// cellkv/host_fp8_pool.hpp - every layer's fp8 K and V pool in host memory, with their scales: the
// fp8 counterpart of HostPool (host_pool.hpp), read by the host reference (reference.hpp).
//
// Per layer: K and V codes each [rows, H_kv, D] (Fp8E4M3), K and V scales each [rows, H_kv] fp32
// (fp8_pool_view.hpp). A new pool holds codes 0 and scales 0: every row reads as zeros. Writes go
// through reference::write (or update_and_attend) on view(layer), which quantize each row-head with
// the pool's scaling (fp8.hpp); copies move codes and scales together.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cellkv/fp8.hpp"
#include "cellkv/fp8_pool_view.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv {

class HostFp8Pool {
 public:
  // A pool with per-row scaling (no calibration); set_config switches to static per-layer scales.
  HostFp8Pool(std::int32_t layers, std::int64_t rows, std::int32_t heads_kv, std::int32_t head_dim)
      : rows_(rows), heads_kv_(heads_kv), head_dim_(head_dim) {
    const auto n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(row_elems());
    const auto heads = static_cast<std::size_t>(rows) * static_cast<std::size_t>(heads_kv);
    k_.assign(static_cast<std::size_t>(layers), std::vector<Fp8E4M3>(n, Fp8E4M3{0}));
    v_ = k_;
    k_scale_.assign(static_cast<std::size_t>(layers), std::vector<float>(heads, 0.0f));
    v_scale_ = k_scale_;
  }

  [[nodiscard]] std::int64_t row_elems() const noexcept { return static_cast<std::int64_t>(heads_kv_) * head_dim_; }
  [[nodiscard]] std::int32_t layers() const noexcept { return static_cast<std::int32_t>(k_.size()); }
  [[nodiscard]] std::int32_t heads_kv() const noexcept { return heads_kv_; }
  [[nodiscard]] std::int32_t head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] std::int64_t rows() const noexcept { return rows_; }
  [[nodiscard]] const Fp8Config& config() const noexcept { return config_; }

  // The scaling of later writes; rows written before keep their codes and scales. Refuses what
  // check_fp8_config refuses (bad_argument: a static scale <= 0 or not finite, or not one {k, v}
  // per layer), changing nothing.
  Status set_config(Fp8Config config) {
    if (const Status s = check_fp8_config(config, layers()); !s.ok()) return s;
    config_ = std::move(config);
    return {};
  }

  [[nodiscard]] Fp8PoolView<Fp8E4M3> view(std::int32_t layer) {
    const auto l = static_cast<std::size_t>(layer);
    return {k_[l].data(), v_[l].data(), k_scale_[l].data(), v_scale_[l].data(), rows_, heads_kv_, head_dim_,
            config_.scaling, layer_scales(l)};
  }
  [[nodiscard]] Fp8PoolView<const Fp8E4M3> view(std::int32_t layer) const {
    const auto l = static_cast<std::size_t>(layer);
    return {k_[l].data(), v_[l].data(), k_scale_[l].data(), v_scale_[l].data(), rows_, heads_kv_, head_dim_,
            config_.scaling, layer_scales(l)};
  }

  // Copies `rows` rows src_row.. -> dst_row.. in K and V of every layer: codes and scales.
  void copy_rows(const RowCopy& c) {
    copy_runs(k_, c, row_elems());
    copy_runs(v_, c, row_elems());
    copy_runs(k_scale_, c, heads_kv_);
    copy_runs(v_scale_, c, heads_kv_);
  }

  // Applies what the cache changed since the last sync (fork and copy-on-write copies), then
  // acknowledges it. Refused, nothing applied or acknowledged: no_key_rotation while K
  // re-rotations are pending (fp8 host pools do not re-rotate moved keys); bad_argument for a
  // cache with window storage.
  template <class Cache>
  [[nodiscard]] Status sync(Cache& cache) {
    if (has_window_storage(cache)) return Errc::bad_argument;
    if (!cache.pending_changes().rotations.empty()) return Errc::no_key_rotation;
    for (const RowCopy& c : cache.pending_changes().copies) copy_rows(c);
    cache.acknowledge_changes();
    return {};
  }

 private:
  [[nodiscard]] Fp8LayerScales layer_scales(std::size_t layer) const {
    return config_.scaling == Fp8Scaling::static_per_layer ? config_.static_scales[layer] : Fp8LayerScales{};
  }
  template <class E>
  static void copy_runs(std::vector<std::vector<E>>& pools, const RowCopy& c, std::int64_t per_row) {
    const auto n = static_cast<std::ptrdiff_t>(c.rows * per_row);
    for (auto& p : pools)
      std::copy_n(p.begin() + static_cast<std::ptrdiff_t>(c.src_row * per_row), n,
                  p.begin() + static_cast<std::ptrdiff_t>(c.dst_row * per_row));
  }

  std::int64_t rows_;
  std::int32_t heads_kv_, head_dim_;
  Fp8Config config_{};
  std::vector<std::vector<Fp8E4M3>> k_, v_;        // [layer][rows * H_kv * D]
  std::vector<std::vector<float>> k_scale_, v_scale_;  // [layer][rows * H_kv]
};

}  // namespace cellkv
