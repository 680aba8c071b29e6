// cellkv/cuda/device_cache.cuh - the cache on one GPU: the host CellCache (planning) and one
// DeviceShard holding every head (the KV pool of every layer, the step buffers at fixed addresses).
//
// Step protocol (docs/design.md section 4) on the caller's stream:
//   cache.declare_step(seq_ids);                  // host: admission + placement
//   cache.upload(stream);                         // step data, position-table writes, masks or ranges
//   for each layer l: cache.update_and_attend(l, q, k, v, out, T, H_q, scale, stream);
//   cache.commit(stream);                         // records the step's event
// A forward captured into a CUDA graph reads only the fixed buffers, so a graph captured once
// replays for any later step uploaded with the same width (pad narrower steps: upload(stream, width)).
// Padding tokens write to the pool's scratch row and see nothing.
//
// Streams: each upload first waits on the previous upload or commit, so a step on another stream
// is ordered after the last one. The destructor waits on the cache's own events only; it never
// touches a stream the caller may have destroyed.
#pragma once

#include <cuda/stream_ref>

#include <cstdint>
#include <optional>
#include <span>

#include "cellkv/cell_cache.hpp"
#include "cellkv/cuda/device_shard.cuh"

namespace cellkv::gpu {

template <Layout L, Element T, WindowSet W, Placement P = placement::lowest_free, std::int32_t MaxSeqs = 256>
class DeviceCache {
 public:
  using Shard = DeviceShard<L, T, W, P, MaxSeqs>;
  using Host = typename Shard::Host;
  using Element = T;
  using Windows = W;

  // Throws std::invalid_argument on a bad config or shape, cellkv::gpu::Error on a CUDA failure.
  DeviceCache(const CacheConfig& config, PoolShape shape) : host_(config), shard_(host_, shape) {}
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;

  // ---- planning (host) ----
  [[nodiscard]] const Host& host() const noexcept { return host_; }
  Result<StepPlan> declare_step(std::span<const std::int32_t> seq_ids) { return host_.declare_step(seq_ids); }
  Result<std::int32_t> seq_new() { return host_.seq_new(); }
  Result<std::int32_t> seq_clone(std::int32_t src, std::int32_t upto = -1) { return host_.seq_clone(src, upto); }
  Status seq_rm(std::int32_t id) { return host_.seq_rm(id); }
  Status rewind(std::int32_t id, std::int32_t pos) { return host_.rewind(id, pos); }
  void clear() { host_.clear(); }

  // ---- device state ----
  [[nodiscard]] const Shard& shard() const noexcept { return shard_; }
  [[nodiscard]] const KVPool<L, T>& pool() const noexcept { return shard_.pool(); }
  [[nodiscard]] const StepBindings& bindings() const noexcept { return shard_.bindings(); }
  // Device mask of window buffer b (cell layout): [max_write, max_cells] bool, row stride max_cells.
  [[nodiscard]] const bool* mask(std::int32_t buffer) const noexcept { return shard_.mask(buffer); }
  // Width of the uploaded step (tokens + padding), 0 when no step is uploaded.
  [[nodiscard]] std::int32_t width() const noexcept { return shard_.width(); }
  // True when attend runs the table kernels (tensor cores, position ranges) rather than the reference.
  [[nodiscard]] bool fast() const noexcept { return shard_.fast(); }
  // Picks the kernels of later uploads and forwards (applies from the next upload).
  void use_kernels(KernelChoice choice) noexcept { shard_.use_kernels(choice); }
  void share_prefixes(bool on) noexcept { shard_.share_prefixes(on); }

  // Uploads the placed step padded to `width` tokens (0: exactly T); see DeviceShard::upload.
  // Refuses when no step is placed or width is outside [T, max_write].
  Status upload(::cuda::stream_ref stream, std::int32_t width = 0, Masks masks = Masks::if_needed) {
    if (const Status s = shard_.upload(stream, width, masks); !s.ok()) return s;
    host_.acknowledge_changes();
    return {};
  }

  // Writes the step's K and V rows of `layer`: k, v [width, H_kv, D].
  Status write(std::int32_t layer, const T* k, const T* v, std::int32_t tokens, ::cuda::stream_ref stream) const {
    return shard_.write(layer, k, v, tokens, stream);
  }

  // Attention of `layer` through its window: q, out [width, H_q, D]; scale 0 = 1/sqrt(D).
  Status attend(std::int32_t layer, const T* q, T* out, std::int32_t tokens, std::int32_t heads_q, float scale,
                ::cuda::stream_ref stream) const {
    return shard_.attend(layer, q, out, tokens, heads_q, scale, stream);
  }

  // write then attend: the operation every attention layer lowers to.
  Status update_and_attend(std::int32_t layer, const T* q, const T* k, const T* v, T* out, std::int32_t tokens,
                           std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    return shard_.update_and_attend(layer, q, k, v, out, tokens, heads_q, scale, stream);
  }

  // update_and_attend for a layer whose window is Window (checked at compile time to be in the
  // set, and at run time to be the layer's).
  template <std::int32_t Window>
  Status update_and_attend(std::int32_t layer, const T* q, const T* k, const T* v, T* out, std::int32_t tokens,
                           std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    return shard_.template update_and_attend<Window>(layer, q, k, v, out, tokens, heads_q, scale, stream);
  }

  // Ends the step: records its event. Later calls for this step are refused until the next declaration.
  Status commit(::cuda::stream_ref stream) { return shard_.commit(stream); }

 private:
  Host host_;
  Shard shard_;
};

}  // namespace cellkv::gpu
