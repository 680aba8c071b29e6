// cellkv/host_pool.hpp - every layer's K and V pool in host memory: the host reference path's
// counterpart of gpu::KVPool. K and V are each [rows, H_kv, D] per layer.
//
// Before a step's forward, sync(cache) runs the copies reported since the last sync
// (cache.pending_changes().copies: the sequence layout's forks, the cell layout's copies on write)
// and acknowledges the cache's changes, as the device cache's upload does; sync(cache, rope) also
// re-rotates the K rows seq_add / seq_div moved (pending_changes().rotations) by the model's RoPE.
// sync serves a cache whose layers all use one pool; with window storage each pool's HostPool
// runs apply(cache.pool(w).pending_changes()), and the caller then acknowledges once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "cellkv/pool_view.hpp"
#include "cellkv/status.hpp"
#include "cellkv/rope.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv {

template <class T>
class HostPool {
 public:
  HostPool(std::int32_t layers, std::int64_t rows, std::int32_t heads_kv, std::int32_t head_dim)
      : rows_(rows), heads_kv_(heads_kv), head_dim_(head_dim) {
    const auto n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(row_elems());
    k_.assign(static_cast<std::size_t>(layers), std::vector<T>(n, T{}));
    v_ = k_;
  }

  [[nodiscard]] std::int64_t row_elems() const noexcept { return static_cast<std::int64_t>(heads_kv_) * head_dim_; }
  [[nodiscard]] std::int32_t layers() const noexcept { return static_cast<std::int32_t>(k_.size()); }
  [[nodiscard]] std::int32_t heads_kv() const noexcept { return heads_kv_; }
  [[nodiscard]] std::int32_t head_dim() const noexcept { return head_dim_; }
  [[nodiscard]] std::int64_t rows() const noexcept { return rows_; }
  [[nodiscard]] PoolView<T> view(std::int32_t layer) {
    return {k_[static_cast<std::size_t>(layer)].data(), v_[static_cast<std::size_t>(layer)].data(), rows_, heads_kv_,
            head_dim_};
  }

  // Copies `rows` rows src_row.. -> dst_row.. in K and V of every layer.
  void copy_rows(const RowCopy& c) {
    const auto n = static_cast<std::ptrdiff_t>(c.rows * row_elems());
    for (auto* pools : {&k_, &v_})
      for (auto& p : *pools)
        std::copy_n(p.begin() + static_cast<std::ptrdiff_t>(c.src_row * row_elems()), n,
                    p.begin() + static_cast<std::ptrdiff_t>(c.dst_row * row_elems()));
  }

  // Runs the copies of `changes` (one pool's: cache.pending_changes(), or with window storage
  // cache.pool(w).pending_changes() for the pool of window w's layers); acknowledges nothing. With
  // `rope`, then re-rotates the K rows `changes.rotations` names, in every layer.
  void apply(const PendingChanges& changes) {
    for (const RowCopy& c : changes.copies) copy_rows(c);
  }
  void apply(const PendingChanges& changes, const RopeSpec& rope) {
    apply(changes);
    for (std::int32_t l = 0; l < layers(); ++l) rerotate_keys(view(l), changes.rotations, rope);
  }

  // Applies what the cache changed since the last sync (fork and copy-on-write copies), then
  // acknowledges it. Refused, nothing applied or acknowledged: bad_argument for a cache with
  // window storage (its pools are synced one by one with apply), then no_key_rotation while K
  // re-rotations are pending (seq_add / seq_div moved cells): use sync(cache, rope), or
  // sync_keys_without_position for a model whose keys carry no position (ALiBi, NoPE).
  template <class Cache>
  [[nodiscard]] Status sync(Cache& cache) {
    if (has_window_storage(cache)) return Errc::bad_argument;
    if (!cache.pending_changes().rotations.empty()) return Errc::no_key_rotation;
    return sync_keys_without_position(cache);
  }
  // The copies, then the acknowledgement of everything, re-rotations included (not applied).
  template <class Cache>
  [[nodiscard]] Status sync_keys_without_position(Cache& cache) {
    if (has_window_storage(cache)) return Errc::bad_argument;
    apply(cache.pending_changes());
    cache.acknowledge_changes();
    return {};
  }
  // The same, then the K rows of every layer named by pending_changes().rotations re-rotated from
  // old_pos to new_pos by `rope` (rerotate_keys; the spec passed check_rope for head_dim()), as a
  // device cache's upload does with its KeyRotation.
  template <class Cache>
  [[nodiscard]] Status sync(Cache& cache, const RopeSpec& rope) {
    if (has_window_storage(cache)) return Errc::bad_argument;
    apply(cache.pending_changes(), rope);
    cache.acknowledge_changes();
    return {};
  }

 private:
  std::int64_t rows_;
  std::int32_t heads_kv_, head_dim_;
  std::vector<std::vector<T>> k_, v_;  // [layer][rows * H_kv * D]
};

}  // namespace cellkv
