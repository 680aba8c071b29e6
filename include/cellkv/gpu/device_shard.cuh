// cellkv/gpu/device_shard.cuh - the device half of a cache on one GPU: the KV pool of its heads
// for every layer, the step buffers at fixed addresses (with the position table's device copy)
// and the attention kernels, fed by a host KVCache that plans each step (owned elsewhere:
// DeviceCache for one GPU, ShardedCache for several).
//
// A shard never changes the host cache: upload reads the placed step (StepPlan) and the pending
// changes (PendingChanges) and nothing else, and the owner acknowledges those once every shard has
// uploaded them. Shards of one host cache may upload concurrently from different threads (const
// reads of the host only).
//
// Every call runs on the caller's current device, which must be the shard's device.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cellkv/attention_plan.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/sharing_planner.hpp"
#include "cellkv/gpu/device_layout.cuh"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/key_rotation.cuh"
#include "cellkv/gpu/kernels/tile_rows.cuh"
#include "cellkv/gpu/kv_pool.hpp"
#include "cellkv/gpu/pool_set.hpp"
#include "cellkv/gpu/kv_views.hpp"
#include "cellkv/gpu/launch/ops.cuh"
#include "cellkv/gpu/launch/row_copies.cuh"
#include "cellkv/gpu/launch/step.cuh"
#include "cellkv/gpu/launch/table_attention.cuh"
#include "cellkv/gpu/step_buffers.hpp"
#include "cellkv/gpu/graph_scope.hpp"
#include "cellkv/footprint.hpp"
#include "cellkv/step_block.hpp"

namespace cellkv::gpu {

// Which attention kernels a cache runs: the table kernels where they apply (automatic), or always
// the reference kernel (tests and comparisons).
enum class KernelChoice : std::uint8_t { automatic, reference };

// Whether upload builds the dense masks of the cell layout: only when the reference kernel will
// read them (if_needed), always (a caller wants them), or never (attend then refuses on the
// reference path). The mask buffers are allocated by the first upload that builds them.
enum class Masks : std::uint8_t { if_needed, always, skip };

// T: the element type of queries, K/V inputs and outputs, stored as is, or Fp8<In> (dtype.hpp):
// inputs and outputs In, K and V stored as E4M3 codes with a scale per row-head.
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P = typename L::default_placement, std::int32_t MaxSeqs = 256>
class DeviceShard {
  static_assert(W::kDistinct <= kMaxWindows, "cellkv::gpu::DeviceShard: at most 8 distinct windows per model");
  static_assert(DeviceLayoutFor<L>, "cellkv::gpu::DeviceShard: the layout needs a gpu::DeviceLayout specialization");
  // A position table: table writes, shared prefixes, dense masks for the reference kernel; else
  // row ranges for it (device_layout.cuh).
  static constexpr bool kTable = L::kPositionTable;
  using Rows = typename DeviceLayout<L>::Rows;
  struct NoTableKernels {};  // fp32 storage: the reference kernel only
  using TableKernels = std::conditional_t<kTableKernelElement<T>, TableAttention<T, Rows>, NoTableKernels>;
  using In = InputOf<T>;

 public:
  using Host = KVCache<L, W, P, MaxSeqs>;
  using Element = In;  // queries, K/V inputs, outputs
  using Storage = T;   // Element, or Fp8<Element>
  using Windows = W;

  // `host` must outlive the shard. shape: this shard's heads (H_kv and H_q of its slice).
  // Checks footprint(host.config(), shape) against the device's free memory before allocating.
  // Throws std::invalid_argument on a bad shape or sizes that overflow, OutOfDeviceMemory when the
  // footprint passes the free memory, cellkv::gpu::Error on a CUDA failure.
  DeviceShard(const Host& host, PoolShape shape)
      : host_(host), pools_(config_that_fits(host.config(), shape), shape), buffers_(make_buffers(host, shape)) {
    if (kTable) buffers_.bindings().max_cells = host.config().max_cells;
    if constexpr (kTableKernelElement<T>)
      if (table_kernels_support<T>(shape.head_dim, shape.heads_q, shape.heads_kv))
        table_.emplace(TableShape{shape.heads_q, shape.heads_kv, shape.head_dim, buffers_.shape().shared_slots});
    // The pool's and the step buffers' initial contents (and the table kernels' merge counters)
    // were written with cudaMemset on the legacy default stream, which a non-blocking stream (the
    // caller's may be one) does not wait for: they must have landed before the first step's work.
    CELLKV_CUDA_THROW(cudaDeviceSynchronize());
  }
  DeviceShard(const DeviceShard&) = delete;
  DeviceShard& operator=(const DeviceShard&) = delete;
  ~DeviceShard() {
    (void)last_.synchronize();
    (void)buffers_.wait_idle();
  }

  // The main pool: every layer's, or with window storage the full-attention layers' (precondition
  // then: the set has one; an fp8 pool's fp8_config() lists those layers' static scales). pools()
  // holds every pool; view(layer) is a layer's K and V.
  [[nodiscard]] const KVPool<L, T>& pool() const noexcept {
    assert(pools_.pool(0) != nullptr && "cellkv::gpu::DeviceShard::pool(): every layer is windowed; use view(layer)");
    return *pools_.pool(0);
  }
  [[nodiscard]] const PoolSet<L, T, W>& pools() const noexcept { return pools_; }
  [[nodiscard]] auto view(std::int32_t layer) const noexcept { return pools_.view(layer); }
  [[nodiscard]] const StepBindings& bindings() const noexcept { return buffers_.bindings(); }
  // Device mask of window buffer b (cell layout): [max_write, max_cells] bool, row stride max_cells;
  // nullptr until an upload built masks.
  [[nodiscard]] const bool* mask(std::int32_t buffer) const noexcept {
    return bindings().masks == nullptr ? nullptr : bindings().mask(buffer);
  }
  // Width of the uploaded step (tokens + padding), 0 when no step is uploaded.
  [[nodiscard]] std::int32_t width() const noexcept { return ready() ? width_ : 0; }
  // True when attend runs the table kernels (tensor cores, position ranges) rather than the reference.
  [[nodiscard]] bool runs_table_kernels() const noexcept { return table_.has_value() && choice_ == KernelChoice::automatic; }
  // True when the table kernels' prefill is the Hopper (wgmma) kernel: an sm_90a build on an sm_90
  // device, bf16 / fp16 storage, D 64 or 128, the kernel's launch registers cover its warpgroups'
  // split, and CELLKV_PREFILL_KERNEL=mma not set when the cache was made (table_attention.cuh).
  [[nodiscard]] bool runs_wgmma_prefill() const noexcept { return runs_table_kernels() && table_->wgmma_prefill(); }
  // True when the shared prefixes run on the Hopper kernel too (shared_prefix_wgmma: the same
  // conditions, checked for that kernel; items of 128 rows, splits of whole 128-position tiles).
  [[nodiscard]] bool runs_wgmma_shared() const noexcept { return runs_table_kernels() && table_->wgmma_shared(); }
  // Picks the kernels of later uploads and forwards (applies from the next upload).
  void use_kernels(KernelChoice choice) noexcept { choice_ = choice; }
  // Whether later uploads look for prefixes that sequences of the step share (cell layout, table
  // kernels), so each shared tile is read once per step (on by default; off for comparisons).
  void share_prefixes(bool on) noexcept { share_prefixes_ = on; }
  // What a CUDA graph captured over later forwards records (graph_scope.hpp): every attention
  // kernel (GraphScope::every_step, the default: one graph per width), or only those the captured
  // step needs (GraphScope::step_kinds: one graph per width and graph_key()). Applies at once:
  // graph_key() and the next capture follow it.
  void set_graph_scope(GraphScope scope) noexcept { scope_ = scope; }
  // The attention kernels the uploaded step needs, over all its windows (table kernels; every
  // kernel on the reference kernel's path, which has one launch whatever the step).
  [[nodiscard]] StepKernels step_kernels() const noexcept { return step_kernels_; }
  // The attention kernels a capture of a forward over the uploaded step records: the key of the
  // graph that serves this step, besides its width.
  [[nodiscard]] StepKernels graph_key() const noexcept {
    return scope_ == GraphScope::every_step ? StepKernels::all() : step_kernels_;
  }
  // Bytes of the step block the kernels read (the table writes staged behind them excluded).
  [[nodiscard]] std::size_t step_block_bytes() const noexcept { return buffers_.layout().table_writes; }
  // Serial of the last step this shard uploaded (0: none).
  [[nodiscard]] std::uint64_t uploaded_serial() const noexcept { return uploaded_serial_; }
  // Decode segments and prefill items of window buffer b in the uploaded step (table kernels);
  // bad_argument for a buffer outside [0, W::kDistinct).
  [[nodiscard]] Result<WorkCounts> work_counts(std::int32_t buffer) const noexcept {
    if (buffer < 0 || buffer >= W::kDistinct) return Errc::bad_argument;
    return counts_[static_cast<std::size_t>(buffer)];
  }

  // The device bytes a shard of `shape` allocates for `config` (footprint.hpp), the dense masks
  // counted when uploads build them: Masks::always, or if_needed on the reference kernel's path
  // (fp32 storage, shapes the table kernels do not serve; cell layout only). With window storage
  // (CacheConfig::window_cells > 0) the windowed layers' pools and tables are window-sized.
  static Result<Footprint> footprint(const CacheConfig& config, const PoolShape& shape, Masks masks = Masks::if_needed) {
    const bool reference = !table_kernels_support<T>(shape.head_dim, shape.heads_q, shape.heads_kv);
    const bool built = masks == Masks::always || (masks == Masks::if_needed && reference);
    const StorageBytes bytes = storage_bytes(kv_storage_of<T>());
    return device_footprint<Host>(config, shape, {bytes.element, kTable && built, kTableKernelElement<T>, bytes.scale});
  }

  // How upload re-rotates the K rows seq_add / seq_div moved (key_rotation.cuh); bad_argument when
  // rotation.check refuses it for this shard's shape (nothing changes). Applies from the next upload.
  Status set_key_rotation(KeyRotation<T> rotation) {
    if (const Status s = rotation.check(pools_.shape().layers, pools_.shape().head_dim); !s.ok()) return s;
    rotation_ = std::move(rotation);
    return {};
  }
  [[nodiscard]] bool key_rotation_set() const noexcept { return rotation_.set(); }

  // fp8 caches: the scaling of later writes (fp8.hpp; per-row scales by default). bad_argument,
  // nothing changed, for what check_fp8_config refuses (a static scale <= 0 or not finite, or not
  // one {k, v} per layer). Rows written before keep their codes and scales. A write launch takes
  // the scaling when it is enqueued: a graph captured before keeps the scaling it was captured
  // with (capture again after changing it).
  Status set_fp8_config(Fp8Config config)
    requires kFp8Kv<T>
  {
    return pools_.set_fp8_config(config);
  }

  // True while this shard has applied (all or part of) the host's pending copies and re-rotations
  // and the host has not acknowledged them: a later upload of this shard does not run them again
  // (it resumes where a failed one stopped), so the owner refuses verbs that could change them
  // (Errc::upload_incomplete) until every shard has uploaded.
  [[nodiscard]] bool holds_applied_changes() const noexcept {
    bool pending = false;
    for (std::int32_t p = 0; p < pools_.count(); ++p) {
      const PendingChanges c = changes_of_pool(p);
      pending = pending || !(c.copies.empty() && c.rotations.empty());
    }
    return applied_.epoch == host_.changes_epoch() && applied_.copies && pending;
  }

  // Reports and clears the faults device code set since the last report (docs/design.md section
  // 5): a write_kv of this shard met a row outside the pool (Errc::bad_device_row), or a replayed
  // graph lacked an attention kernel its step needed (Errc::missing_step_kernels); the first when
  // both.
  [[nodiscard]] Status take_device_fault() noexcept {
    const std::uint32_t faults = buffers_.take_fault();
    if ((faults & kFaultBadRow) != 0) return Errc::bad_device_row;
    if ((faults & kFaultMissingKernel) != 0) return Errc::missing_step_kernels;
    return {};
  }

  // Uploads the host's placed step padded to `width` tokens (0: exactly T): runs the pending row
  // copies (forks of the sequence layout, copy-on-write cells of the cell layout), then the K
  // re-rotations of moved cells (key_rotation.cuh), writes the pending position-table entries (cell layout), copies the step
  // block (tokens, segments, every window's work; row ranges for the sequence layout's reference
  // kernel) and builds the dense masks (cell layout, per `masks`). Refuses when no step is placed
  // or width is outside [T, max_write], and with bad_device_row or missing_step_kernels once after
  // a device fault.
  Status upload(::cuda::stream_ref stream, std::int32_t width = 0, Masks masks = Masks::if_needed) {
    if (const Status s = check_upload(width); !s.ok()) return s;
    if (const Status s = take_device_fault(); !s.ok()) return s;
    const StepPlan plan = host_.step();
    if (width == 0) width = plan.tokens;
    if (const Status s = last_.wait_on(stream); !s.ok()) return s;
    if (const Status s = apply_changes(stream); !s.ok()) return s;
    gather_table_writes();
    std::size_t first = 0;  // table writes beyond one block's room go first, in batches
    const auto room = static_cast<std::size_t>(buffers_.shape().max_table_writes);
    for (; table_writes_.size() - first > room; first += room)
      if (const Status s = send_table_writes(first, room, stream); !s.ok()) return s;
    StepBuffers::Slot& slot = buffers_.next_slot();
    if (const Status s = slot.done.synchronize(); !s.ok()) return s;
    fill_block(slot.block.data(), plan, width);
    const std::size_t writes = stage_table_writes(slot, first, table_writes_.size() - first);
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(buffers_.device_block(), slot.block.data(), buffers_.upload_bytes(writes),
                                       cudaMemcpyHostToDevice, stream.get()));
    if (const Status s = slot.done.record(stream); !s.ok()) return s;
    if (const Status s = write_table(buffers_.device_table_writes(), static_cast<std::int32_t>(writes),
                                     bindings().table_flat, stream);
        !s.ok())
      return s;
    const bool fill_masks = kTable && (masks == Masks::always || (masks == Masks::if_needed && !runs_table_kernels()));
    if (fill_masks)
      if (const Status s = make_masks(plan, width, stream); !s.ok()) return s;
    if (const Status s = last_.record(stream); !s.ok()) return s;
    uploaded_serial_ = plan.serial;
    width_ = width;
    tokens_ = plan.tokens;
    masks_filled_ = fill_masks;
    uploaded_table_kernels_ = runs_table_kernels();
    return {};
  }

  // What upload(stream, width) would refuse, without touching anything.
  [[nodiscard]] Status check_upload(std::int32_t width) const {
    if (const Status s = host_.require_step(); !s.ok()) return s;
    const std::int32_t tokens = host_.step().tokens;
    return (width != 0 && width < tokens) || width > host_.max_write() ? Status{Errc::bad_shape} : Status{};
  }

  // Writes the step's K and V rows of `layer`: k, v [width, H_kv, D].
  Status write(std::int32_t layer, const In* k, const In* v, std::int32_t tokens, ::cuda::stream_ref stream) const {
    if (const Status s = check_layer_call(layer, tokens); !s.ok()) return s;
    return write_kv(pools_.view(layer), k, v, buffers_.pool_bindings(pools_.pool_of(layer)).cells, tokens,
                    bindings().fault, stream);
  }

  // Attention of `layer` through its window: q, out [width, H_q, D]; scale 0 = 1/sqrt(D).
  Status attend(std::int32_t layer, const In* q, In* out, std::int32_t tokens, std::int32_t heads_q, float scale,
                ::cuda::stream_ref stream) const {
    if (const Status s = check_attend_args(layer, q, out, tokens, heads_q); !s.ok()) return s;
    return attend_buffer(W::buffer_of_layer(layer), layer, q, out, tokens, heads_q, scale, stream);
  }

  // write then attend: the operation every attention layer lowers to.
  Status update_and_attend(std::int32_t layer, const In* q, const In* k, const In* v, In* out, std::int32_t tokens,
                           std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    if (const Status s = check_attend_args(layer, q, out, tokens, heads_q); !s.ok()) return s;
    if (const Status s = write(layer, k, v, tokens, stream); !s.ok()) return s;
    return attend(layer, q, out, tokens, heads_q, scale, stream);
  }

  // update_and_attend for a layer whose window is Window (checked at compile time to be in the
  // set, and at run time to be the layer's).
  template <std::int32_t Window>
  Status update_and_attend(std::int32_t layer, const In* q, const In* k, const In* v, In* out, std::int32_t tokens,
                           std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    static_assert(W::buffer_of_window(Window) >= 0, "cellkv: no layer of this window set uses this window");
    if (layer < 0 || layer >= W::kLayers || W::window_of_layer(layer) != Window) return Errc::bad_argument;
    return update_and_attend(layer, q, k, v, out, tokens, heads_q, scale, stream);
  }

  // Ends the step: records its event. Later calls for this step are refused until the next
  // declaration. Refuses with bad_device_row or missing_step_kernels once after a device fault (the
  // step stays open).
  Status commit(::cuda::stream_ref stream) {
    if (!ready()) return Errc::no_step_declared;
    if (const Status s = take_device_fault(); !s.ok()) return s;
    if (const Status s = last_.record(stream); !s.ok()) return s;
    committed_serial_ = uploaded_serial_;
    return {};
  }

 private:
  // `config`, once this shard's footprint is known to fit the current device's free memory.
  static const CacheConfig& config_that_fits(const CacheConfig& config, const PoolShape& shape) {
    if (shape.layers != W::kLayers)
      throw std::invalid_argument("cellkv::gpu::DeviceShard: the pool needs one layer per layer of the window set");
    const Result<Footprint> f = footprint(config, shape);
    if (!f.ok())
      throw std::invalid_argument(std::string("cellkv::gpu::DeviceShard: ") + std::string(f.status().message()));
    require_free_memory(f.value().total, "cellkv::gpu::DeviceShard");
    return config;
  }

  static StepBuffers make_buffers(const Host& host, const PoolShape& shape) {
    // Refusals were checked by footprint() before the pool was allocated.
    const StepBlockShape s = step_block_shape<Host>(host.config(), shape, kTableKernelElement<T>).value();
    std::vector<TableGeometry> tables;
    if constexpr (kTable) {
      auto add = [&](const PositionTable& t) {
        tables.push_back({static_cast<std::int64_t>(t.flat().size()), t.directory_entries(), t.dir_stride()});
      };
      add(host.table());
      if (host.window_storage())
        for (const std::int32_t w : W::kWindowed) add(host.pool(w).table());
    }
    return StepBuffers(s, tables);
  }

  [[nodiscard]] bool ready() const noexcept {
    return host_.step_placed() && uploaded_serial_ == host_.step_serial() && committed_serial_ != uploaded_serial_;
  }

  [[nodiscard]] Status check_layer_call(std::int32_t layer, std::int32_t tokens) const {
    if (!ready()) return Errc::no_step_declared;
    if (layer < 0 || layer >= W::kLayers) return Errc::bad_argument;
    return tokens == width_ ? Status{} : Status{Errc::bad_shape};
  }

  // Everything attend would refuse, checked before write so a refusal writes nothing.
  [[nodiscard]] Status check_attend_args(std::int32_t layer, const In* q, const In* out, std::int32_t tokens,
                                         std::int32_t heads_q) const {
    if (const Status s = check_layer_call(layer, tokens); !s.ok()) return s;
    if (uploaded_table_kernels_ && heads_q != pools_.shape().heads_q) return Errc::bad_shape;
    if (kTable && !uploaded_table_kernels_ && !masks_filled_) return Errc::no_step_declared;
    const AttentionArgs<In, StoredOf<T>> a{q, const_view(layer), const_cast<In*>(out), tokens, heads_q, 0.f};
    return detail::check_attention(a);
  }

  [[nodiscard]] ReadView<StoredOf<T>> const_view(std::int32_t layer) const noexcept {
    return read_only(pools_.view(layer));
  }

  // Pool p's pending changes (p: PoolSet's numbering; the host's main pool or window pool p - 1).
  [[nodiscard]] PendingChanges changes_of_pool(std::int32_t p) const noexcept {
    if constexpr (kTable)
      if (p > 0) return host_.pool(W::kWindowed[static_cast<std::size_t>(p - 1)]).pending_changes();
    return host_.pending_changes();
  }

  // The table kernels' geometry (decode tile, rows of a prefill item for the prefill kernel the
  // cache runs: runs_wgmma_prefill()) that plan_window plans each upload with.
  [[nodiscard]] AttentionShape plan_shape() const noexcept {
    if constexpr (kTableKernelElement<T>) return table_->plan_shape();
    else return {};
  }

  // Layers of window buffer `buffer` read their pool through that pool's bindings (pool_bindings).
  Status attend_buffer(std::int32_t buffer, std::int32_t layer, const In* q, In* out, std::int32_t tokens,
                       std::int32_t heads_q, float scale, ::cuda::stream_ref stream) const {
    const StepBindings b = buffers_.pool_bindings(pools_.pool_of(layer));
    if constexpr (kTableKernelElement<T>)
      if (uploaded_table_kernels_)
        return table_->attend(buffer, W::kDistinctWindows[static_cast<std::size_t>(buffer)], q, out, const_view(layer),
                              DeviceLayout<L>::rows(host_, b), b, tokens_, tokens,
                              counts_[static_cast<std::size_t>(buffer)], graph_key(), scale, stream);
    const AttentionArgs<In, StoredOf<T>> a{q, const_view(layer), out, tokens, heads_q, scale};
    if constexpr (kTable) return masked_sdpa(a, mask(buffer), b.max_cells, b.read_len, stream);
    else return range_sdpa(a, bindings().ranges_of(buffer), bindings().read_len, stream);
  }

  // The pending row copies (forks of the sequence layout, copy-on-write cells of the cell layout),
  // in order (row_copies.cuh), then the K re-rotations of moved cells, before this step's writes;
  // each at most once per shard: what a failed upload applied is not applied again (applied_).
  Status apply_changes(::cuda::stream_ref stream) {
    if (applied_.epoch != host_.changes_epoch()) applied_ = Applied{host_.changes_epoch(), false, 0};
    if (!applied_.copies) {  // copies alone are idempotent: a failed run is simply run again
      for (std::int32_t p = 0; p < pools_.count(); ++p)
        if (pools_.pool(p) != nullptr)
          if (const Status s = copier_.run(*pools_.pool(p), changes_of_pool(p).copies, stream); !s.ok()) return s;
      applied_.copies = true;
    }
    std::int64_t call = 0;  // (pool, batch, layer) in order
    for (std::int32_t p = 0; p < pools_.count(); ++p)
      if (pools_.pool(p) != nullptr)
        if (const Status s = run_rotations(p, call, stream); !s.ok()) return s;
    return {};
  }

  // Pool p's K re-rotations, each of its layers, in batches through a device list allocated by the
  // first upload that has any (the host list is pageable: each copy is staged before it returns);
  // the calls this shard already made for the same pending changes (applied_.rotation_calls, calls
  // numbered from `call` on) are skipped.
  Status run_rotations(std::int32_t p, std::int64_t& call, ::cuda::stream_ref stream) {
    const std::span<const RowRotation> all = changes_of_pool(p).rotations;
    if (all.empty()) return {};
    if (!rotation_.set()) return Errc::no_key_rotation;
    constexpr std::size_t kBatch = 4096;
    if (rotation_list_.size() == 0) {
      try {
        rotation_list_ = DeviceBuffer<RowRotation>(kBatch);
      } catch (const Error&) {
        return Errc::device_error;
      }
    }
    const std::int32_t layers = pools_.pool(p)->shape().layers;
    for (std::size_t first = 0; first < all.size(); first += kBatch) {
      if (call + layers <= applied_.rotation_calls) {  // the whole batch ran before
        call += layers;
        continue;
      }
      const std::span<const RowRotation> batch = all.subspan(first, std::min(kBatch, all.size() - first));
      CELLKV_CUDA_STATUS(cudaMemcpyAsync(rotation_list_.data(), batch.data(), batch.size_bytes(), cudaMemcpyHostToDevice,
                                         stream.get()));
      for (std::int32_t l = 0; l < W::kLayers; ++l) {
        if (pools_.pool_of(l) != p) continue;
        if (call++ < applied_.rotation_calls) continue;
        if (const Status s = rotation_.run(l, pools_.view(l), rotation_list_.data(), static_cast<std::int32_t>(batch.size()),
                                           stream);
            !s.ok())
          return s;
        applied_.rotation_calls = call;
      }
    }
    return {};
  }

  // Staging image of the step block: real tokens, then padding (scratch row, sequence -1); the
  // segments; every window's work (table kernels) or row ranges (the sequence layout's reference).
  void fill_block(std::byte* block, const StepPlan& plan, std::int32_t width) {
    const StepBlockLayout& lay = buffers_.layout();
    const auto segments = static_cast<std::int32_t>(plan.segments.size());
    std::memcpy(block + lay.segments, plan.segments.data(), plan.segments.size_bytes());
    std::memcpy(block + lay.num_segments, &segments, 4);
    std::memcpy(block + lay.tokens, &plan.tokens, 4);
    std::memcpy(block + lay.read_len, &plan.read_len, 8);
    auto* cells = reinterpret_cast<std::int64_t*>(block + lay.cells);
    auto* seq = reinterpret_cast<std::int32_t*>(block + lay.token_seq);
    auto* pos = reinterpret_cast<std::int32_t*>(block + lay.token_pos);
    const auto T_tokens = static_cast<std::size_t>(plan.tokens);
    std::copy_n(plan.rows.data(), T_tokens, cells);
    std::copy_n(plan.seqs.data(), T_tokens, seq);
    std::copy_n(plan.positions.data(), T_tokens, pos);
    for (std::int32_t t = plan.tokens; t < width; ++t)
      cells[t] = KVPool<L, T>::rows_for(host_.config()), seq[t] = -1, pos[t] = 0;  // the main pool's scratch row
    fill_window_rows(block, plan, width);
    const SharedWork shared = lay.shared_at(block, buffers_.shape());
    const std::int32_t shared_items = runs_table_kernels() ? plan_sharing(plan, shared) : 0;
    step_kernels_ = runs_table_kernels() ? StepKernels{} : StepKernels::all();
    for (std::int32_t b = 0; b < W::kDistinct; ++b) {
      const std::int32_t window = W::kDistinctWindows[static_cast<std::size_t>(b)];
      if (runs_table_kernels()) {
        const WindowWork work = lay.work_at(block, b, host_.max_write());
        const bool main_pool = pools_.pool_of_window(window) == 0;  // window pools share no prefixes
        const std::int32_t items = main_pool ? shared_items : 0;
        plan_window(plan.segments, main_pool ? shared.own_begin : nullptr, window, plan_shape(), work,
                    main_pool && shared_items > 0 ? planner_.finished_segments() : std::span<const std::uint8_t>{});
        counts_[static_cast<std::size_t>(b)] = WorkCounts{work.decode_count(), work.prefill_count(), items};
        step_kernels_ = step_kernels_ | needed_kernels(work.decode_count(), work.prefill_count(), plan.tokens < width, items);
      } else if constexpr (!kTable) {
        auto* ranges = reinterpret_cast<RowRange*>(block + lay.ranges) + b * host_.max_write();
        for (std::int32_t t = 0; t < width; ++t) ranges[t] = t < plan.tokens ? host_.visible_range(t, window).value_or(RowRange{}) : RowRange{};
      }
    }
  }

  // Window storage: each window pool's rows of the step's tokens (its scratch row for padding) and
  // its read_len, into the staging block.
  void fill_window_rows(std::byte* block, const StepPlan& plan, std::int32_t width) const {
    const StepBlockLayout& lay = buffers_.layout();
    const std::int32_t pools = buffers_.shape().window_pools;
    if (pools == 0) return;
    std::memcpy(block + lay.window_read_len, plan.window_read_len.data(), plan.window_read_len.size_bytes());
    for (std::int32_t i = 0; i < pools; ++i) {
      auto* cells = reinterpret_cast<std::int64_t*>(block + lay.window_cells) + static_cast<std::int64_t>(i) * host_.max_write();
      std::copy_n(plan.window_rows.data() + static_cast<std::ptrdiff_t>(i) * plan.tokens, plan.tokens, cells);
      std::fill(cells + plan.tokens, cells + width, std::int64_t{host_.config().window_cells});  // the scratch row
    }
  }

  // The step's shared prefixes into the staging block (cell layout; none when sharing is off);
  // returns the shared items.
  std::int32_t plan_sharing(const StepPlan& plan, const SharedWork& out) {
    if (out.counts == nullptr) return 0;
    if constexpr (kTable && kTableKernelElement<T>) {
      if (share_prefixes_) {
        planner_.plan(plan.segments, host_.table(), table_->sharing_shape(buffers_.shape().max_runs), out);
        return out.item_count();
      }
    }
    out.counts[0] = out.counts[1] = out.counts[2] = out.counts[3] = 0;
    std::fill_n(out.own_begin, plan.segments.size(), 0);
    std::fill_n(out.token_slots, plan.tokens, SlotRange{});
    return 0;
  }

  // Every pool's pending table writes into table_writes_, each index moved to where its pool's
  // table starts in the device's one array of tables (StepBuffers::table_offset).
  void gather_table_writes() {
    table_writes_.clear();
    if constexpr (kTable) {
      for (std::int32_t p = 0; p < buffers_.shape().window_pools + 1; ++p) {
        const TableChanges changes = changes_of_pool(p).table;
        const std::int32_t offset = buffers_.table_offset(p);
        for (const std::int32_t index : changes.indices)
          table_writes_.push_back(TableWrite{offset + index, changes.values[static_cast<std::size_t>(index)]});
      }
    }
  }

  // Table writes [first, first + count) of table_writes_ into a staging slot; returns count.
  std::size_t stage_table_writes(const StepBuffers::Slot& slot, std::size_t first, std::size_t count) const {
    std::copy_n(table_writes_.data() + first, count, slot.table_writes(buffers_.layout()));
    return count;
  }

  // One batch of table writes ahead of the step block (a verb-heavy gap between steps).
  Status send_table_writes(std::size_t first, std::size_t count, ::cuda::stream_ref stream) {
    StepBuffers::Slot& slot = buffers_.next_slot();
    if (const Status s = slot.done.synchronize(); !s.ok()) return s;
    stage_table_writes(slot, first, count);
    const std::size_t at = buffers_.layout().table_writes;
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(buffers_.device_block() + at, slot.block.data() + at, sizeof(TableWrite) * count,
                                       cudaMemcpyHostToDevice, stream.get()));
    if (const Status s = slot.done.record(stream); !s.ok()) return s;
    return write_table(buffers_.device_table_writes(), static_cast<std::int32_t>(count), bindings().table_flat, stream);
  }

  static WindowList window_list() {
    WindowList windows;
    for (std::int32_t b = 0; b < W::kDistinct; ++b) windows.w[b] = W::kDistinctWindows[static_cast<std::size_t>(b)];
    return windows;
  }

  // The dense masks, allocated by the first upload that builds them; with window storage each
  // window pool's buffer from that pool's table, over its rows.
  Status make_masks(const StepPlan& plan, std::int32_t width, ::cuda::stream_ref stream) {
    if (masks_.size() == 0) {
      try {
        masks_ = DeviceBuffer<bool>(static_cast<std::size_t>(W::kDistinct) * static_cast<std::size_t>(host_.max_write()) *
                                    static_cast<std::size_t>(host_.config().max_cells));
      } catch (const Error&) {
        return Errc::device_error;
      }
      buffers_.bindings().masks = masks_.data();
    }
    if (pools_.count() == 1) return build_masks(bindings(), window_list(), width, plan.read_len, stream);
    for (std::int32_t b = 0; b < W::kDistinct; ++b) {
      const std::int32_t window = W::kDistinctWindows[static_cast<std::size_t>(b)];
      const std::int32_t p = pools_.pool_of_window(window);
      StepBindings one = buffers_.pool_bindings(p);
      one.masks = one.mask(b);  // this buffer's mask as buffer 0 of a one-window list
      one.windows = 1;
      WindowList list;
      list.w[0] = window;
      const std::int64_t read_len = p == 0 ? plan.read_len : plan.window_read_len[static_cast<std::size_t>(p - 1)];
      if (const Status s = build_masks(one, list, width, read_len, stream); !s.ok()) return s;
    }
    return {};
  }

  const Host& host_;
  PoolSet<L, T, W> pools_;
  StepBuffers buffers_;
  DeviceBuffer<bool> masks_;
  RowCopier copier_;
  // What this shard applied of the host's pending changes of `epoch` (changes_epoch()).
  struct Applied {
    std::uint64_t epoch = 0;
    bool copies = false;
    std::int64_t rotation_calls = 0;  // (batch, layer) calls of the key rotation that succeeded
  };
  Applied applied_;
  KeyRotation<T> rotation_;
  DeviceBuffer<RowRotation> rotation_list_;  // kBatch entries once a rotation ran
  std::optional<TableKernels> table_;
  std::array<WorkCounts, kMaxWindows> counts_{};  // work of each window in the uploaded step
  StepKernels step_kernels_ = StepKernels::all();  // what the uploaded step needs (step_kernels())
  GraphScope scope_ = GraphScope::every_step;
  KernelChoice choice_ = KernelChoice::automatic;
  bool share_prefixes_ = true;
  SharingPlanner planner_;
  std::vector<TableWrite> table_writes_;  // the upload's table writes, every pool's (gather_table_writes)
  bool uploaded_table_kernels_ = false;
  Event last_;  // the last upload or commit: the next upload waits on it
  std::uint64_t uploaded_serial_ = 0;
  std::uint64_t committed_serial_ = 0;
  std::int32_t width_ = 0;
  std::int32_t tokens_ = 0;
  bool masks_filled_ = false;
};

}  // namespace cellkv::gpu
