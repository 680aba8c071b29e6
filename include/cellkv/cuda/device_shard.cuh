// cellkv/cuda/device_shard.cuh - the device half of a cache on one GPU: the KV pool of its heads
// for every layer, the step buffers at fixed addresses and the fast path, fed by a host CellCache
// that plans each step (owned elsewhere: DeviceCache for one GPU, ShardedCache for several).
//
// A shard never changes the host cache: upload reads the placed step and the pending changes, and
// the owner acknowledges those once every shard has uploaded them. Shards of one host cache may
// upload concurrently from different threads (const reads of the host only).
//
// Every call runs on the caller's current device, which must be the shard's device.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "cellkv/cell_cache.hpp"
#include "cellkv/cuda/fast_path.cuh"
#include "cellkv/cuda/kernels/step_prep.cuh"
#include "cellkv/cuda/kv_pool.hpp"
#include "cellkv/cuda/ops.cuh"
#include "cellkv/cuda/step_buffers.hpp"

namespace cellkv::gpu {

// Which attention kernels a cache runs: the fast path where it applies (automatic), or always
// the reference kernel (tests and comparisons).
enum class KernelChoice : std::uint8_t { automatic, reference };

// Whether upload builds the dense masks of the cell layout: only when the reference kernel will
// read them (if_needed), always (a caller wants them), or never (attend then refuses on the
// reference path).
enum class Masks : std::uint8_t { if_needed, always, skip };

template <Layout L, Element T, WindowSet W, Placement P = placement::lowest_free, std::int32_t MaxSeqs = 256>
class DeviceShard {
  static_assert(W::kDistinct <= kMaxWindows, "cellkv::gpu::DeviceShard: at most 8 distinct windows per model");
  static constexpr bool kCells = std::is_same_v<L, layout::cell>;

 public:
  using Host = CellCache<L, W, P, MaxSeqs>;
  using Element = T;
  using Windows = W;
  static constexpr std::int32_t kWords = SeqSet<MaxSeqs>::kWords;

  // `host` must outlive the shard. shape: this shard's heads (H_kv and H_q of its slice).
  // Throws std::invalid_argument on a bad shape, cellkv::gpu::Error on a CUDA failure.
  DeviceShard(const Host& host, PoolShape shape)
      : host_(host),
        pool_(host.config(), shape),
        buffers_(host.config().max_write, kCells ? host.config().max_cells : 0, W::kDistinct) {
    if (shape.layers != W::kLayers)
      throw std::invalid_argument("cellkv::gpu::DeviceShard: the pool needs one layer per layer of the window set");
    if (fast_path_supports<T>(shape.head_dim, shape.heads_q, shape.heads_kv))
      fast_.emplace(FastShape{pool_.rows(), host.max_write(), W::kDistinct, shape.heads_q, shape.heads_kv,
                              shape.head_dim, kCells ? 0 : host.config().max_len},
                    window_list());
  }
  DeviceShard(const DeviceShard&) = delete;
  DeviceShard& operator=(const DeviceShard&) = delete;
  ~DeviceShard() {
    (void)last_.synchronize();
    (void)buffers_.wait_idle();
  }

  [[nodiscard]] const KVPool<L, T>& pool() const noexcept { return pool_; }
  [[nodiscard]] const StepBindings& bindings() const noexcept { return buffers_.bindings(); }
  // Device mask of window buffer b (cell layout): [max_write, max_cells] bool, row stride max_cells.
  [[nodiscard]] const bool* mask(std::int32_t buffer) const noexcept { return bindings().mask(buffer); }
  // Width of the uploaded step (tokens + padding), 0 when no step is uploaded.
  [[nodiscard]] std::int32_t width() const noexcept { return ready() ? width_ : 0; }
  // True when attend runs the fast path (tile lists, tensor cores) rather than the reference.
  [[nodiscard]] bool fast() const noexcept { return fast_.has_value() && choice_ == KernelChoice::automatic; }
  // Picks the kernels of later uploads and forwards (applies from the next upload).
  void use_kernels(KernelChoice choice) noexcept { choice_ = choice; }
  [[nodiscard]] const std::optional<FastPath<T, kWords, kCells>>& fast_path() const noexcept { return fast_; }
  // Serial of the last step this shard uploaded (0: none).
  [[nodiscard]] std::uint64_t uploaded_serial() const noexcept { return uploaded_serial_; }

  // Uploads the host's placed step padded to `width` tokens (0: exactly T), runs the fork copies
  // and metadata changes not yet acknowledged, plans the fast path (tile lists, work items) when it
  // applies, and builds the dense masks (cell layout, per `masks`) or row ranges (sequence
  // layout). Refuses when no step is placed or width is outside [T, max_write].
  Status upload(::cuda::stream_ref stream, std::int32_t width = 0, Masks masks = Masks::if_needed) {
    if (const Status s = check_upload(width); !s.ok()) return s;
    const StepPlan plan = host_.step();
    if (width == 0) width = plan.tokens;
    if (const Status s = last_.wait_on(stream); !s.ok()) return s;
    StepStaging<kWords>& slot = buffers_.next_slot();
    if (const Status s = slot.done.synchronize(); !s.ok()) return s;
    if (const Status s = run_copies(stream); !s.ok()) return s;
    fill_block(slot.block.data(), plan, width);
    const MirrorUpload changed = stage_mirror(slot);
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(buffers_.device_block(), slot.block.data(),
                                       buffers_.upload_bytes(changed.entries, changed.groups), cudaMemcpyHostToDevice,
                                       stream.get()));
    const bool fill_masks = kCells && (masks == Masks::always || (masks == Masks::if_needed && !fast()));
    if constexpr (kCells) {
      if (const Status s = scatter_mirror(changed, stream); !s.ok()) return s;
      if (fill_masks)
        if (const Status s = launch_masks(plan.read_len, width, stream); !s.ok()) return s;
    }
    if (fast())
      if (const Status s = fast_->plan(bindings(), segments_, stream); !s.ok()) return s;
    if (const Status s = slot.done.record(stream); !s.ok()) return s;
    if (const Status s = last_.record(stream); !s.ok()) return s;
    uploaded_serial_ = plan.serial;
    width_ = width;
    masks_filled_ = fill_masks;
    uploaded_fast_ = fast();
    return {};
  }

  // What upload(stream, width) would refuse, without touching anything.
  [[nodiscard]] Status check_upload(std::int32_t width) const {
    if (const Status s = host_.require_step(); !s.ok()) return s;
    const std::int32_t tokens = host_.step().tokens;
    return (width != 0 && width < tokens) || width > host_.max_write() ? Status{Errc::bad_shape} : Status{};
  }

  // Writes the step's K and V rows of `layer`: k, v [width, H_kv, D].
  Status write(std::int32_t layer, const T* k, const T* v, std::int32_t tokens, ::cuda::stream_ref stream) const {
    if (const Status s = check_layer_call(layer, tokens); !s.ok()) return s;
    return write_kv<T>(pool_.view(layer), k, v, bindings().cells, tokens, stream);
  }

  // Attention of `layer` through its window: q, out [width, H_q, D]; scale 0 = 1/sqrt(D).
  Status attend(std::int32_t layer, const T* q, T* out, std::int32_t tokens, std::int32_t heads_q, float scale,
                ::cuda::stream_ref stream) const {
    if (const Status s = check_attend_args(layer, q, out, tokens, heads_q); !s.ok()) return s;
    return attend_buffer(W::buffer_of_layer(layer), layer, q, out, tokens, heads_q, scale, stream);
  }

  // write then attend: the operation every attention layer lowers to.
  Status update_and_attend(std::int32_t layer, const T* q, const T* k, const T* v, T* out, std::int32_t tokens,
                           std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    if (const Status s = check_attend_args(layer, q, out, tokens, heads_q); !s.ok()) return s;
    if (const Status s = write(layer, k, v, tokens, stream); !s.ok()) return s;
    return attend(layer, q, out, tokens, heads_q, scale, stream);
  }

  // update_and_attend for a layer whose window is Window (checked at compile time to be in the
  // set, and at run time to be the layer's).
  template <std::int32_t Window>
  Status update_and_attend(std::int32_t layer, const T* q, const T* k, const T* v, T* out, std::int32_t tokens,
                           std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    static_assert(W::buffer_of_window(Window) >= 0, "cellkv: no layer of this window set uses this window");
    if (layer < 0 || layer >= W::kLayers || W::window_of_layer(layer) != Window) return Errc::bad_argument;
    return update_and_attend(layer, q, k, v, out, tokens, heads_q, scale, stream);
  }

  // Ends the step: records its event. Later calls for this step are refused until the next declaration.
  Status commit(::cuda::stream_ref stream) {
    if (!ready()) return Errc::no_step_declared;
    if (const Status s = last_.record(stream); !s.ok()) return s;
    committed_serial_ = uploaded_serial_;
    return {};
  }

 private:
  [[nodiscard]] bool ready() const noexcept {
    return host_.step_placed() && uploaded_serial_ == host_.step_serial() && committed_serial_ != uploaded_serial_;
  }

  [[nodiscard]] Status check_layer_call(std::int32_t layer, std::int32_t tokens) const {
    if (!ready()) return Errc::no_step_declared;
    if (layer < 0 || layer >= W::kLayers) return Errc::bad_argument;
    return tokens == width_ ? Status{} : Status{Errc::bad_shape};
  }

  // Everything attend would refuse, checked before write so a refusal writes nothing.
  [[nodiscard]] Status check_attend_args(std::int32_t layer, const T* q, const T* out, std::int32_t tokens,
                                         std::int32_t heads_q) const {
    if (const Status s = check_layer_call(layer, tokens); !s.ok()) return s;
    if (uploaded_fast_ && heads_q != pool_.shape().heads_q) return Errc::bad_shape;
    if (kCells && !uploaded_fast_ && !masks_filled_) return Errc::no_step_declared;
    const AttentionArgs<T> a{q, const_view(layer), const_cast<T*>(out), tokens, heads_q, 0.f};
    return detail::check_attention(a);
  }

  [[nodiscard]] PoolView<const T> const_view(std::int32_t layer) const noexcept {
    const PoolView<T> p = pool_.view(layer);
    return {p.k, p.v, p.rows, p.heads_kv, p.head_dim};
  }

  Status attend_buffer(std::int32_t buffer, std::int32_t layer, const T* q, T* out, std::int32_t tokens,
                       std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    if (uploaded_fast_)
      return fast_->attend(buffer, W::kDistinctWindows[static_cast<std::size_t>(buffer)], q, out, const_view(layer),
                           bindings(), tokens, scale, stream);
    const AttentionArgs<T> a{q, const_view(layer), out, tokens, heads_q, scale};
    if constexpr (kCells) return masked_sdpa<T>(a, mask(buffer), bindings().max_cells, bindings().read_len, stream);
    else return range_sdpa<T>(a, bindings().ranges_of(buffer), bindings().read_len, stream);
  }

  // Fork copies of the sequence layout, in order, before this step's writes.
  Status run_copies(::cuda::stream_ref stream) const {
    if constexpr (!kCells) {
      for (const RowCopy& c : host_.pending_changes().copies)
        if (const Status s = pool_.copy_rows(c, stream); !s.ok()) return s;
    }
    return {};
  }

  // Staging image of the step block: real tokens, then padding (scratch row, sequence -1), and
  // the step's segments.
  void fill_block(std::byte* block, const StepPlan& plan, std::int32_t width) {
    const StepBlockLayout& lay = buffers_.layout();
    auto* segments = reinterpret_cast<Segment*>(block + lay.segments);
    segments_ = split_segments(plan, std::span<Segment>(segments, static_cast<std::size_t>(host_.max_write())));
    *reinterpret_cast<std::int32_t*>(block + lay.num_segments) = segments_;
    *reinterpret_cast<std::int32_t*>(block + lay.tokens) = plan.tokens;
    auto* cells = reinterpret_cast<std::int64_t*>(block + lay.cells);
    auto* seq = reinterpret_cast<std::int32_t*>(block + lay.token_seq);
    auto* pos = reinterpret_cast<std::int32_t*>(block + lay.token_pos);
    *reinterpret_cast<std::int64_t*>(block + lay.read_len) = plan.read_len;
    for (std::int32_t t = 0; t < width; ++t) {
      const bool real = t < plan.tokens;
      const auto i = static_cast<std::size_t>(t);
      cells[t] = real ? plan.rows[i] : pool_.scratch_row();
      seq[t] = real ? plan.seqs[i] : -1;
      pos[t] = real ? plan.positions[i] : 0;
    }
    if constexpr (!kCells) {
      auto* ranges = reinterpret_cast<RowRange*>(block + lay.ranges);
      for (std::int32_t b = 0; b < W::kDistinct; ++b)
        for (std::int32_t t = 0; t < width; ++t)
          ranges[b * host_.max_write() + t] =
              t < plan.tokens ? host_.visible_range(t, W::kDistinctWindows[static_cast<std::size_t>(b)]) : RowRange{};
    }
  }

  struct MirrorUpload {
    std::size_t entries = 0, groups = 0;
  };

  // Changed cells (cell layout) -> mirror entries in staging after the step block, sorted by cell,
  // then one TileGroup per touched tile.
  MirrorUpload stage_mirror(StepStaging<kWords>& slot) {
    if constexpr (!kCells) {
      (void)slot;
      return {};
    } else {
      const auto changed = host_.pending_changes().cells;
      sorted_.assign(changed.begin(), changed.end());
      std::sort(sorted_.begin(), sorted_.end());
      auto* groups = reinterpret_cast<TileGroup*>(slot.entries + sorted_.size());
      std::size_t g = 0;
      for (std::size_t i = 0; i < sorted_.size(); ++i) {
        const std::int32_t c = sorted_[i];
        slot.entries[i].cell = c;
        slot.entries[i].pos = host_.cell_pos(c);
        for (std::int32_t w = 0; w < kWords; ++w) slot.entries[i].owners[w] = host_.cell_owners(c).word_at(w);
        if (g > 0 && groups[g - 1].tile == c / kTileRows) ++groups[g - 1].count;
        else groups[g++] = TileGroup{c / kTileRows, static_cast<std::int32_t>(i), 1};
      }
      return {sorted_.size(), g};
    }
  }

  // The uploaded entries -> the device mirror and the touched tiles' stats.
  Status scatter_mirror(const MirrorUpload& m, ::cuda::stream_ref stream) const {
    if (m.entries == 0) return {};
    kernels::scatter_tiles<kWords><<<static_cast<unsigned>((m.groups + 7) / 8), 256, 0, stream.get()>>>(
        buffers_.device_entries(), static_cast<std::int32_t>(m.entries), static_cast<std::int32_t>(m.groups),
        bindings().tiles);
    return detail::last_launch();
  }

  static WindowList window_list() {
    WindowList windows;
    for (std::int32_t b = 0; b < W::kDistinct; ++b) windows.w[b] = W::kDistinctWindows[static_cast<std::size_t>(b)];
    return windows;
  }

  Status launch_masks(std::int64_t read_len, std::int32_t width, ::cuda::stream_ref stream) const {
    if (read_len == 0) return {};
    const WindowList windows = window_list();
    const auto chunks = static_cast<unsigned>(std::min<std::int64_t>((read_len + 16 * 256 - 1) / (16 * 256), 64));
    const dim3 grid(chunks, static_cast<unsigned>(width), static_cast<unsigned>(W::kDistinct));
    if (bindings().max_cells % 16 == 0)
      kernels::build_masks<true><<<grid, 256, 0, stream.get()>>>(bindings(), windows, read_len);
    else
      kernels::build_masks<false><<<grid, 256, 0, stream.get()>>>(bindings(), windows, read_len);
    return detail::last_launch();
  }

  const Host& host_;
  KVPool<L, T> pool_;
  StepBuffers<kWords> buffers_;
  std::optional<FastPath<T, kWords, kCells>> fast_;
  KernelChoice choice_ = KernelChoice::automatic;
  std::int32_t segments_ = 0;        // segments of the uploaded step
  std::vector<std::int32_t> sorted_;  // staging scratch: changed cells, sorted
  bool uploaded_fast_ = false;
  Event last_;  // the last upload or commit: the next upload waits on it
  std::uint64_t uploaded_serial_ = 0;
  std::uint64_t committed_serial_ = 0;
  std::int32_t width_ = 0;
  bool masks_filled_ = false;
};

}  // namespace cellkv::gpu
