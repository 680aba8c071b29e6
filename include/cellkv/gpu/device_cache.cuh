// cellkv/gpu/device_cache.cuh - the cache on one GPU: the host KVCache with its planning verbs
// (PlanningVerbs) and one DeviceShard holding every head (the KV pools of every layer, one per
// pool of the host cache with window storage; the step buffers at fixed addresses), whose device
// verbs it is: nothing is forwarded twice.
//
// Step protocol (docs/design.md section 4) on the caller's stream:
//   cache.declare_step(seq_ids);                  // host: admission + placement
//   cache.upload(stream);                         // step data, position-table writes, masks or ranges
//   for each layer l: cache.update_and_attend(l, q, k, v, out, T, H_q, scale, stream);
//   cache.commit(stream);                         // records the step's event
// A forward captured into a CUDA graph reads only the fixed buffers, so a graph captured once
// replays for any later step uploaded with the same width (pad narrower steps: upload(stream, width)).
// Padding tokens write to each pool's scratch row and see nothing.
//
// Streams: each upload first waits on the previous upload or commit, so a step on another stream
// is ordered after the last one. The destructor waits on the cache's own events only; it never
// touches a stream the caller may have destroyed.
#pragma once

#include <cuda/stream_ref>

#include <cstdint>

#include "cellkv/kv_cache.hpp"
#include "cellkv/gpu/device_shard.cuh"
#include "cellkv/gpu/planning_verbs.hpp"

namespace cellkv::gpu {

// Planning verbs (declare_step, seq_new, seq_clone, seq_rm, rewind, clear, the sequence edits,
// restore_positions, host()) from PlanningVerbs; device verbs and state (upload, write, attend,
// update_and_attend, commit, set_key_rotation, holds_applied_changes, pool(), pools(), view(), bindings(), mask(),
// width(), runs_table_kernels(), use_kernels(), share_prefixes(), set_graph_scope(),
// step_kernels(), graph_key(), work_counts(), footprint()) from DeviceShard.
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P = typename L::default_placement, std::int32_t MaxSeqs = 256>
class DeviceCache : public PlanningVerbs<KVCache<L, W, P, MaxSeqs>, DeviceCache<L, T, W, P, MaxSeqs>>,
                    public DeviceShard<L, T, W, P, MaxSeqs> {
  using Planning = PlanningVerbs<KVCache<L, W, P, MaxSeqs>, DeviceCache>;
  friend Planning;

 public:
  using Shard = DeviceShard<L, T, W, P, MaxSeqs>;
  using Host = typename Shard::Host;
  using Element = InputOf<T>;  // queries, K/V inputs, outputs
  using Storage = T;           // Element, or Fp8<Element> (dtype.hpp)
  using Windows = W;

  // Builds the host cache, then the shard (which checks its footprint against the device's free
  // memory before allocating). Throws std::invalid_argument on a bad config or shape,
  // OutOfDeviceMemory when the footprint passes the free memory, cellkv::gpu::Error on a CUDA failure.
  DeviceCache(const CacheConfig& config, PoolShape shape) : Planning(config), Shard(Planning::host_, shape) {}

  // The device half, every head of the model.
  [[nodiscard]] const Shard& shard() const noexcept { return *this; }

  // Uploads the placed step padded to `width` tokens (0: exactly T), then acknowledges the host's
  // pending changes (this one device has them); see DeviceShard::upload for the refusals.
  Status upload(::cuda::stream_ref stream, std::int32_t width = 0, Masks masks = Masks::if_needed) {
    if (const Status s = Shard::upload(stream, width, masks); !s.ok()) return s;
    Planning::host_.acknowledge_changes();
    return {};
  }

 private:
  void before_planning() noexcept {}  // upload acknowledges the changes of its one device
  // seq_add / seq_div wait for a key rotation where cells move (the cell layout).
  [[nodiscard]] Status check_key_rotation() const noexcept {
    return !L::kPositionTable || Shard::key_rotation_set() ? Status{} : Status{Errc::no_key_rotation};
  }
};

}  // namespace cellkv::gpu
