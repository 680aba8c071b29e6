// cellkv/gpu/sharded_cache.cuh - the cache of a tensor-parallel model: one host KVCache plans
// every step once (its planning verbs from PlanningVerbs), and G DeviceShards, one per GPU, hold
// the KV heads of their slice (cellkv/sharding.hpp: shard g holds KV heads
// [g H_kv / G, (g + 1) H_kv / G) and the query heads that read them). Every shard receives the same step: the same rows, positions, segments, work,
// position-table writes, masks or ranges, so no shard's bookkeeping can drift from another's.
//
// Step protocol, with stream g belonging to device g:
//   cache.declare_step(seq_ids);                        // host, once
//   cache.upload(streams);                              // every shard (or upload_shard(g, ...) per rank thread)
//   per shard g, per layer l (on device g):
//     cache.shard(g).update_and_attend(l, q_g, k_g, v_g, out_g, T, H_q / G, scale, streams[g]);
//   cache.commit(streams);                              // or shard(g).commit(stream) per rank thread
// q_g, out_g are [width, H_q / G, D] and k_g, v_g [width, H_kv / G, D]: the shard's columns of the
// model's projections.
//
// Engines that drive each GPU from its own thread call upload_shard(g, ...) and shard(g) from rank
// g's thread, concurrently for different g; the planning verbs (declare_step, seq_*, rewind,
// clear) stay on one thread, between steps. Every shard must upload every declared step: the host's
// pending changes are acknowledged once all shards have uploaded them (at the next planning verb).
// A device fault of shard g (docs/design.md section 5) is reported by upload(streams) or
// commit(streams) before any shard is touched, or by shard g's own upload_shard or commit.
// Several shards may share one device (tests run G = 2 on one GPU this way).
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <span>
#include <stdexcept>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/gpu/device_guard.hpp"
#include "cellkv/gpu/device_shard.cuh"
#include "cellkv/gpu/planning_verbs.hpp"
#include "cellkv/footprint.hpp"
#include "cellkv/sharding.hpp"

namespace cellkv::gpu {

template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P = typename L::default_placement, std::int32_t MaxSeqs = 256>
class ShardedCache : public PlanningVerbs<KVCache<L, W, P, MaxSeqs>, ShardedCache<L, T, W, P, MaxSeqs>> {
  using Planning = PlanningVerbs<KVCache<L, W, P, MaxSeqs>, ShardedCache>;
  friend Planning;

 public:
  using Shard = DeviceShard<L, T, W, P, MaxSeqs>;
  using Host = typename Shard::Host;
  using Element = InputOf<T>;  // queries, K/V inputs, outputs
  using Storage = T;           // Element, or Fp8<Element> (dtype.hpp)
  using Windows = W;

  // devices: the device of each shard (G = devices.size(); a device may repeat). model: the whole
  // model's heads; shard g gets head_shard(H_q, H_kv, G, g). Before allocating any shard, checks
  // on every device the footprints of the shards it holds against its free memory. Throws
  // std::invalid_argument on a bad config, no devices, heads that do not split evenly or sizes that
  // overflow, OutOfDeviceMemory when a device lacks the memory, cellkv::gpu::Error on a CUDA failure.
  ShardedCache(const CacheConfig& config, PoolShape model, std::span<const int> devices)
      : Planning(config), model_(model), devices_(devices.begin(), devices.end()) {
    if (devices_.empty()) throw std::invalid_argument("cellkv::gpu::ShardedCache: needs at least one device");
    for (std::int32_t g = 0; g < shards(); ++g) {
      const Result<HeadShard> heads = head_shard(model.heads_q, model.heads_kv, shards(), g);
      if (!heads.ok())
        throw std::invalid_argument(std::string("cellkv::gpu::ShardedCache: ") +
                                    std::string(heads.status().message()));
      heads_.push_back(heads.value());
    }
    require_memory_on_every_device();
    for (std::int32_t g = 0; g < shards(); ++g) {
      const DeviceGuard on(devices_[static_cast<std::size_t>(g)]);
      shards_.push_back(std::make_unique<Shard>(this->host_, shard_shape(g)));
    }
  }
  ShardedCache(const ShardedCache&) = delete;
  ShardedCache& operator=(const ShardedCache&) = delete;
  // Frees each shard with its device current (never throws), then restores the caller's device.
  ~ShardedCache() {
    int previous = 0;
    const bool restore = cudaGetDevice(&previous) == cudaSuccess;
    for (std::size_t g = 0; g < shards_.size(); ++g) {
      (void)cudaSetDevice(devices_[g]);
      shards_[g].reset();
    }
    if (restore) (void)cudaSetDevice(previous);
  }

  // ---- shards ----
  [[nodiscard]] std::int32_t shards() const noexcept { return static_cast<std::int32_t>(devices_.size()); }
  [[nodiscard]] int device(std::int32_t g) const { return devices_.at(static_cast<std::size_t>(g)); }
  // The model's heads on shard g (query heads and KV heads, model numbering).
  [[nodiscard]] HeadShard heads(std::int32_t g) const { return heads_.at(static_cast<std::size_t>(g)); }
  [[nodiscard]] const PoolShape& model_shape() const noexcept { return model_; }
  [[nodiscard]] Shard& shard(std::int32_t g) { return *shards_.at(static_cast<std::size_t>(g)); }
  [[nodiscard]] const Shard& shard(std::int32_t g) const { return *shards_.at(static_cast<std::size_t>(g)); }

  // The device bytes each shard of a cache of `model`'s heads split over `shards` devices allocates
  // (shards split the heads evenly, so every shard has the same footprint; footprint.hpp).
  // bad_shape when the heads do not split.
  static Result<Footprint> shard_footprint(const CacheConfig& config, const PoolShape& model, std::int32_t shards,
                                           Masks masks = Masks::if_needed) {
    const Result<HeadShard> heads = head_shard(model.heads_q, model.heads_kv, shards, 0);
    if (!heads.ok()) return heads.status().code();
    return Shard::footprint(config, PoolShape{model.layers, heads.value().kv.count, model.head_dim, heads.value().q.count},
                            masks);
  }

  // ---- planning (host, once for every shard): declare_step, seq_*, rewind, clear, host() from
  // PlanningVerbs; each first acknowledges the changes every shard has uploaded ----
  // Picks the kernels of every shard (applies from the next upload).
  void share_prefixes(bool on) noexcept {
    for (auto& s : shards_) s->share_prefixes(on);
  }
  void use_kernels(KernelChoice choice) noexcept {
    for (auto& s : shards_) s->use_kernels(choice);
  }
  // What graphs captured over later forwards record, on every shard (DeviceShard::set_graph_scope);
  // every shard uploads the same step, so their graph_key() agree.
  void set_graph_scope(GraphScope scope) noexcept {
    for (auto& s : shards_) s->set_graph_scope(scope);
  }
  // The key rotation of every shard (DeviceShard::set_key_rotation); refused for all or none.
  Status set_key_rotation(const KeyRotation<T>& rotation) {
    if (const Status s = rotation.check(model_.layers, model_.head_dim); !s.ok()) return s;
    for (auto& s : shards_) (void)s->set_key_rotation(rotation);
    return {};
  }

  // fp8 caches: the scaling of every shard's later writes (DeviceShard::set_fp8_config); refused
  // (bad_argument) for all or none.
  Status set_fp8_config(const Fp8Config& config)
    requires kFp8Kv<T>
  {
    if (const Status s = check_fp8_config(config, model_.layers); !s.ok()) return s;
    for (auto& s : shards_) (void)s->set_fp8_config(config);
    return {};
  }

  // ---- device steps ----
  // Uploads the placed step to every shard, shard g on streams[g] (a stream of device g). Checks
  // everything first: a refusal (bad_shape for a stream count other than G or a width outside
  // [T, max_write], no_step_declared) uploads nothing. A CUDA failure midway returns device_error.
  Status upload(std::span<const ::cuda::stream_ref> streams, std::int32_t width = 0,
                Masks masks = Masks::if_needed) {
    if (static_cast<std::int32_t>(streams.size()) != shards()) return Errc::bad_shape;
    if (const Status s = shards_.front()->check_upload(width); !s.ok()) return s;
    if (const Status s = take_device_faults(); !s.ok()) return s;
    for (std::int32_t g = 0; g < shards(); ++g)
      if (const Status s = upload_shard(g, streams[static_cast<std::size_t>(g)], width, masks); !s.ok()) return s;
    return {};
  }

  // Uploads the placed step to shard g alone, on `stream` of device g (makes device g current for
  // the call). Safe to call concurrently for different g. Refuses a bad g with bad_argument.
  Status upload_shard(std::int32_t g, ::cuda::stream_ref stream, std::int32_t width = 0,
                      Masks masks = Masks::if_needed) {
    if (g < 0 || g >= shards()) return Errc::bad_argument;
    try {
      const DeviceGuard on(devices_[static_cast<std::size_t>(g)]);
      return shards_[static_cast<std::size_t>(g)]->upload(stream, width, masks);
    } catch (const Error&) {
      return Errc::device_error;
    }
  }

  // Ends the step on every shard (shard g's event on streams[g]). Refuses a stream count other
  // than G (bad_shape), a step not uploaded to every shard (no_step_declared) and, once, a device
  // fault of any shard (bad_device_row, missing_step_kernels), ending none.
  Status commit(std::span<const ::cuda::stream_ref> streams) {
    if (static_cast<std::int32_t>(streams.size()) != shards()) return Errc::bad_shape;
    for (const auto& s : shards_)
      if (s->width() == 0) return Errc::no_step_declared;
    if (const Status s = take_device_faults(); !s.ok()) return s;
    for (std::int32_t g = 0; g < shards(); ++g) {
      try {
        const DeviceGuard on(devices_[static_cast<std::size_t>(g)]);
        if (const Status s = shards_[static_cast<std::size_t>(g)]->commit(streams[static_cast<std::size_t>(g)]);
            !s.ok())
          return s;
      } catch (const Error&) {
        return Errc::device_error;
      }
    }
    return {};
  }

 private:
  // Some shard applied the pending changes and not every shard uploaded (planning_verbs.hpp).
  [[nodiscard]] bool holds_applied_changes() const noexcept {
    for (const auto& s : shards_)
      if (s->holds_applied_changes()) return true;
    return false;
  }
  // seq_add / seq_div wait for a key rotation where cells move (the cell layout).
  [[nodiscard]] Status check_key_rotation() const noexcept {
    if constexpr (L::kPositionTable)
      for (const auto& s : shards_)
        if (!s->key_rotation_set()) return Errc::no_key_rotation;
    return {};
  }

  // Acknowledges the host's pending changes once every shard has uploaded the placed step.
  void before_planning() {
    Host& host = this->host_;
    if (!host.step_placed() || acknowledged_ == host.step_serial()) return;
    for (const auto& s : shards_)
      if (s->uploaded_serial() != host.step_serial()) return;
    host.acknowledge_changes();
    acknowledged_ = host.step_serial();
  }

  [[nodiscard]] PoolShape shard_shape(std::int32_t g) const {
    const HeadShard& heads = heads_[static_cast<std::size_t>(g)];
    return PoolShape{model_.layers, heads.kv.count, model_.head_dim, heads.q.count};
  }

  // Every device's free memory against the footprints of all its shards, before any allocation.
  void require_memory_on_every_device() const {
    std::map<int, std::size_t> bytes;  // device -> footprint of its shards
    for (std::int32_t g = 0; g < shards(); ++g) {
      const Result<Footprint> f = Shard::footprint(this->host_.config(), shard_shape(g));
      if (!f.ok())
        throw std::invalid_argument(std::string("cellkv::gpu::ShardedCache: ") + std::string(f.status().message()));
      std::size_t& sum = bytes[devices_[static_cast<std::size_t>(g)]];
      const std::optional<std::size_t> total = cellkv::detail::size_sum({sum, f.value().total});
      if (!total)
        throw std::invalid_argument(std::string("cellkv::gpu::ShardedCache: ") + std::string(describe(Errc::size_overflow)));
      sum = *total;
    }
    for (const auto& [device, total] : bytes) {
      const DeviceGuard on(device);
      require_free_memory(total, "cellkv::gpu::ShardedCache");
    }
  }

  // A fault of any shard (Errc::bad_device_row, Errc::missing_step_kernels), each shard's report
  // taken once; ok when none.
  Status take_device_faults() {
    Status first{};
    for (const auto& s : shards_)
      if (const Status f = s->take_device_fault(); !f.ok() && first.ok()) first = f;
    return first;
  }

  PoolShape model_;
  std::vector<int> devices_;
  std::vector<HeadShard> heads_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::uint64_t acknowledged_ = 0;
};

}  // namespace cellkv::gpu
