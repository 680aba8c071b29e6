// cellkv/gpu/sequence_state.cuh - one sequence's saved state (the format of sequence_state.hpp)
// from and into a device cache: DeviceCache, or ShardedCache (shard g holds a slice of the KV
// heads; the state holds every head, so a state moves between a sharded cache, a one-GPU cache
// and a host pool alike).
//
//   std::vector<std::byte> bytes = gpu::save_sequence(cache, id, gpu::state_dtype<T>(), stream).value();
//   const std::int32_t copy = gpu::restore_sequence(other, bytes, gpu::state_dtype<T>(), stream).value();
//   // or, with the natural tag: gpu::save_sequence(cache, id, stream), gpu::restore_sequence(other, bytes, stream)
//
// The state's shape is the cache's model shape (layers, H_kv, D), the size of a stored element,
// the storage (elements, or fp8 codes with scales), the caller's dtype tag and the window set; the
// format, the checks and the order of the refusals are the host functions' (sequence_state.hpp,
// docs/design.md section 4 "Saved sequence state"). A host pool of the same storage and element
// type with the same tag reads and writes the same bytes (HostPool<T>; HostFp8Pool for Fp8<In>).
//
// fp8 caches (Fp8<In>, dtype.hpp): the state holds the E4M3 codes of every held row-head (element
// size 1) and, after the rows, their fp32 scales (StateStorage::fp8_e4m3); a shard's scale columns
// are its slice of heads, as its code columns are. An fp8 state restores only into an fp8 cache (or
// HostFp8Pool) and an element state only into an element cache: state_mismatch otherwise. The
// restored rows read back exactly as saved whatever the target's Fp8Config (every row carries its
// scales); later writes scale with the target's config.
//
// dtype tag: the caller's, as on the host. state_dtype<S>() (KvStorage's value: bf16 0, fp16 1,
// fp32 2, as gpu::DType's; Fp8<bf16> and Fp8<fp16> both 3) is the natural tag (the overloads
// without a tag use it); host code storing the same element type (e.g. a HostPool of
// __nv_bfloat16, or a HostFp8Pool) passes the same number. The element size and the storage are
// checked besides the tag, but only the tag tells bf16 from fp16. Fp8<bf16> and Fp8<fp16> store
// the same thing (codes and fp32 scales), so their states move between them under the natural tag.
//
// Device traffic: per shard, the sequence's row numbers go to the device in one copy; per layer
// one small kernel (kernels/move_rows.cuh) gathers (save) or scatters (restore) the K and V rows of
// every held position into a packed staging block; one copy moves the block between device and
// host (a 2D copy where a shard holds a slice of the heads). An fp8 cache does the same again for
// the scales (rows of H_kv floats). Staging holds at most `staging_bytes`
// (default kStateStagingBytes, 256 MiB) of layers at a time (at least one layer), so a long
// sequence takes a few copies, not one per row. Temporaries are DeviceBuffers allocated per call.
//
// Streams. save_sequence gathers on `stream` (shard g on streams[g]), which must be ordered after
// the writes of the sequence's rows (the stream of the forwards, or one that waited on them), and
// synchronizes it before returning: the bytes are complete. restore_sequence writes the new rows on
// `stream` and synchronizes it before returning, so any later upload, on any stream, sees them;
// `stream` must be ordered after every earlier step's kernels (a fresh row may be one an earlier
// step read before its cell was freed): the stream of the forwards, or one that waited on them.
//
// Refusals, each changing nothing (neither the host cache nor any pool):
// - both: bad_argument for a cache with window storage (CacheConfig::window_cells > 0), as on the
//   host: its layers' rows live in several pools, which the state format does not describe.
// - save: bad_shape for a stream count other than the shard count (ShardedCache), then the host's
//   (bad_sequence_id, sequence_not_live); rows_pending while the device does not yet hold the sequence's
//   rows: a declared step with tokens of it is not committed, or copies or K re-rotations of its
//   rows (a copy-on-write seq_add, a fork of the sequence layout) wait for the next upload;
//   device_error on a CUDA failure (gpu::last_cuda_failure() names it).
// - restore: bad_shape (stream count), then parse_state's reasons (state_truncated, ..., state_mismatch,
//   state_too_large), rows_pending while row copies wait for the next upload (a fresh row could be
//   the source of one), device_error when the staging memory cannot be allocated, then
//   restore_positions' (no_free_sequence, out_of_cells, out_of_pages, unsupported_by_layout). A CUDA
//   failure after the new sequence exists removes it again (seq_rm) and returns device_error.
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/device_guard.hpp"
#include "cellkv/gpu/dtype.hpp"
#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/kernels/move_rows.cuh"
#include "cellkv/gpu/kv_views.hpp"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/gpu/sharded_cache.cuh"
#include "cellkv/sequence_state.hpp"

namespace cellkv::gpu {

// The natural dtype tag of a state of a cache of element parameter S: KvStorage's value (bf16 0,
// fp16 1, fp32 2: gpu::DType's; fp8_e4m3 3 for Fp8<bf16> and Fp8<fp16> alike).
template <KvElement S>
constexpr std::uint32_t state_dtype() noexcept {
  return static_cast<std::uint32_t>(kv_storage_of<S>());
}
static_assert(state_dtype<__nv_bfloat16>() == static_cast<std::uint32_t>(DType::bf16) &&
              state_dtype<__half>() == static_cast<std::uint32_t>(DType::fp16) &&
              state_dtype<float>() == static_cast<std::uint32_t>(DType::fp32));

// What a state of `Cache` (element parameter S) with pools of `shape` must match.
template <class Cache, KvElement S>
StateShape device_state_shape(const PoolShape& shape, std::uint32_t dtype) {
  return state_shape<Cache>(shape, static_cast<std::int32_t>(sizeof(StoredOf<S>)), dtype,
                            kFp8Kv<S> ? StateStorage::fp8_e4m3 : StateStorage::elements);
}

// Device memory a save or restore stages rows through, per shard, by default (at least one layer's
// rows are staged whatever the budget).
inline constexpr std::size_t kStateStagingBytes = std::size_t{256} << 20;

namespace detail {

// One shard's share of a state: its pool, its device (-1: the caller's current one), the first of
// the model's KV heads it holds, and the stream it works on.
template <class Shard>
struct StateSlice {
  const Shard* shard;
  int device;
  std::int32_t head_first;
  ::cuda::stream_ref stream;
};

// Makes a slice's device current for a scope (nothing for -1). Throws gpu::Error.
class SliceDevice {
 public:
  explicit SliceDevice(int device) {
    if (device >= 0) guard_.emplace(device);
  }

 private:
  std::optional<DeviceGuard> guard_;
};

template <class U, bool Gather>
Status launch_move_rows(void* k, void* v, const std::int64_t* rows, std::int64_t count, std::int64_t row_bytes,
                        std::byte* packed, ::cuda::stream_ref stream) {
  const std::int64_t row_units = row_bytes / static_cast<std::int64_t>(sizeof(U));
  constexpr int kThreads = 256;
  const std::int64_t blocks = std::min<std::int64_t>((2 * count * row_units + kThreads - 1) / kThreads, 65536);
  kernels::move_rows<U, Gather><<<static_cast<unsigned>(blocks), kThreads, 0, stream.get()>>>(
      static_cast<U*>(k), static_cast<U*>(v), rows, count, row_units, reinterpret_cast<U*>(packed));
  return last_launch();
}

// Gather (packed <- pool rows) or scatter (pool rows <- packed) of one layer's K and V tensors
// (k, v: rows of row_bytes bytes; element rows, fp8 code rows or fp8 scale rows): packed is
// [2][count][row_bytes], rows a device array of count rows. Copies in the widest unit that divides
// the row and aligns every pointer.
template <bool Gather>
Status move_layer_rows(void* k, void* v, std::int64_t row_bytes, const std::int64_t* rows, std::int64_t count,
                       std::byte* packed, ::cuda::stream_ref stream) {
  if (count == 0) return {};
  const auto bits = reinterpret_cast<std::uintptr_t>(k) | reinterpret_cast<std::uintptr_t>(v) |
                    reinterpret_cast<std::uintptr_t>(packed) | static_cast<std::uintptr_t>(row_bytes);
  if (bits % 16 == 0) return launch_move_rows<uint4, Gather>(k, v, rows, count, row_bytes, packed, stream);
  if (bits % 8 == 0) return launch_move_rows<uint2, Gather>(k, v, rows, count, row_bytes, packed, stream);
  if (bits % 4 == 0) return launch_move_rows<std::uint32_t, Gather>(k, v, rows, count, row_bytes, packed, stream);
  if (bits % 2 == 0) return launch_move_rows<std::uint16_t, Gather>(k, v, rows, count, row_bytes, packed, stream);
  return launch_move_rows<std::uint8_t, Gather>(k, v, rows, count, row_bytes, packed, stream);
}

// Bytes of a shard's row of K (or V) and of its scales (0 for element storage): the shard's heads.
template <class Shard>
std::size_t shard_row_bytes(const Shard& shard) {
  return static_cast<std::size_t>(shard.pool().row_elems()) * sizeof(StoredOf<typename Shard::Storage>);
}
template <class Shard>
std::size_t shard_scale_row_bytes(const Shard& shard) {
  return kFp8Kv<typename Shard::Storage> ? sizeof(float) * static_cast<std::size_t>(shard.pool().shape().heads_kv) : 0;
}

// A slice's device temporaries: the row list and the staging block (`layers` layers at a time),
// freed with their device current.
struct SliceStaging {
  int device = -1;
  DeviceBuffer<std::int64_t> rows;
  DeviceBuffer<std::byte> block;
  std::int32_t layers = 0;

  SliceStaging() = default;
  SliceStaging(SliceStaging&&) noexcept = default;
  SliceStaging& operator=(SliceStaging&&) = delete;
  ~SliceStaging() {
    int previous = 0;
    if (device < 0 || (rows.size() == 0 && block.size() == 0) || cudaGetDevice(&previous) != cudaSuccess) return;
    (void)cudaSetDevice(device);
    rows = {};
    block = {};
    (void)cudaSetDevice(previous);
  }
};

// Throws gpu::Error when the device memory cannot be had. The block holds `layers` layers of the
// wider of the shard's rows and scale rows (the rows and the scales pass through it in turn).
template <class Shard>
SliceStaging make_staging(const StateSlice<Shard>& slice, std::int64_t held, std::size_t budget) {
  const SliceDevice on(slice.device);
  const PoolShape& shape = slice.shard->pool().shape();
  const std::uint64_t row = std::max(shard_row_bytes(*slice.shard), shard_scale_row_bytes(*slice.shard));
  const std::uint64_t layer_bytes = 2 * static_cast<std::uint64_t>(held) * row;
  SliceStaging s;
  s.device = slice.device;
  s.layers = static_cast<std::int32_t>(
      std::clamp<std::uint64_t>(budget / std::max<std::uint64_t>(layer_bytes, 1), 1, static_cast<std::uint64_t>(shape.layers)));
  s.rows = DeviceBuffer<std::int64_t>(static_cast<std::size_t>(held));
  s.block = DeviceBuffer<std::byte>(static_cast<std::size_t>(layer_bytes) * static_cast<std::size_t>(s.layers));
  return s;
}

// One part of a state (its rows, or an fp8 state's scales) as one slice sees it: the part's bytes,
// [layers][2][held][state_row], of which the slice holds the columns [column, column + slice_row)
// of every row (its heads).
struct StatePart {
  std::byte* bytes;
  std::size_t state_row;
  std::size_t slice_row;
  std::size_t column;
};

// Moves a part between the slice's tensors (tensors(l): layer l's K and V, rows of slice_row bytes)
// and the state, staging.layers layers at a time through the staging block. staging.rows holds the
// pool rows of the held positions.
template <bool Save, class Tensors>
Status move_part(std::int32_t layers, SliceStaging& staging, std::int64_t held, const StatePart& part,
                 Tensors&& tensors, ::cuda::stream_ref stream) {
  const std::size_t layer_rows = 2 * static_cast<std::size_t>(held);  // K and V rows of one layer
  for (std::int32_t l0 = 0; l0 < layers; l0 += staging.layers) {
    const std::int32_t n = std::min(staging.layers, layers - l0);
    std::byte* host = part.bytes + static_cast<std::size_t>(l0) * layer_rows * part.state_row + part.column;
    std::byte* block = staging.block.data();
    if constexpr (!Save)
      CELLKV_CUDA_STATUS(cudaMemcpy2DAsync(block, part.slice_row, host, part.state_row, part.slice_row,
                                           static_cast<std::size_t>(n) * layer_rows, cudaMemcpyHostToDevice, stream.get()));
    for (std::int32_t l = l0; l < l0 + n; ++l) {
      std::byte* packed = block + static_cast<std::size_t>(l - l0) * layer_rows * part.slice_row;
      const auto [k, v] = tensors(l);
      if (const Status s = move_layer_rows<Save>(k, v, static_cast<std::int64_t>(part.slice_row), staging.rows.data(), held,
                                                 packed, stream);
          !s.ok())
        return s;
    }
    if constexpr (Save)
      CELLKV_CUDA_STATUS(cudaMemcpy2DAsync(host, part.state_row, block, part.slice_row, part.slice_row,
                                           static_cast<std::size_t>(n) * layer_rows, cudaMemcpyDeviceToHost, stream.get()));
  }
  return {};
}

// Moves the rows of one slice between its pool and the state: `state_rows` the state's rows
// ([layers][2][held][shape.row_bytes()]), and for an fp8 cache `state_scales` its scales
// ([layers][2][held][shape.scale_row_bytes()]); the slice's heads start head_first heads into each
// row and each scale row. Then synchronizes the slice's stream. `rows`: the pool rows of the held
// positions, in order.
template <bool Save, class Shard>
Status move_slice(const StateSlice<Shard>& slice, SliceStaging& staging, std::span<const std::int64_t> rows,
                  std::byte* state_rows, std::byte* state_scales, const StateShape& shape) {
  using S = typename Shard::Storage;
  try {
    const SliceDevice on(slice.device);
    const auto& pool = slice.shard->pool();
    const auto held = static_cast<std::int64_t>(rows.size());
    const auto head_first = static_cast<std::size_t>(slice.head_first);
    const ::cuda::stream_ref stream = slice.stream;
    CELLKV_CUDA_STATUS(cudaMemcpyAsync(staging.rows.data(), rows.data(), rows.size_bytes(), cudaMemcpyHostToDevice, stream.get()));
    const StatePart codes{state_rows, static_cast<std::size_t>(shape.row_bytes()), shard_row_bytes(*slice.shard),
                          head_first * static_cast<std::size_t>(pool.shape().head_dim) * sizeof(StoredOf<S>)};
    auto kv = [&](std::int32_t l) {
      const auto v = pool.view(l);
      return std::pair<void*, void*>(v.k, v.v);
    };
    if (const Status s = move_part<Save>(pool.shape().layers, staging, held, codes, kv, stream); !s.ok()) return s;
    if constexpr (kFp8Kv<S>) {
      const StatePart scales{state_scales, static_cast<std::size_t>(shape.scale_row_bytes()), shard_scale_row_bytes(*slice.shard),
                             head_first * sizeof(float)};
      auto kv_scales = [&](std::int32_t l) {
        const auto v = pool.view(l);
        return std::pair<void*, void*>(v.k_scale, v.v_scale);
      };
      if (const Status s = move_part<Save>(pool.shape().layers, staging, held, scales, kv_scales, stream); !s.ok()) return s;
    }
    CELLKV_CUDA_STATUS(cudaStreamSynchronize(stream.get()));
    return {};
  } catch (const Error&) {
    return Errc::device_error;
  }
}

// True when every shard holds the host's pending changes: a placed step every shard uploaded.
template <class Host, class Shard>
bool changes_uploaded(const Host& host, std::span<const StateSlice<Shard>> slices) {
  if (!host.step_placed()) return false;
  return std::all_of(slices.begin(), slices.end(),
                     [&](const StateSlice<Shard>& s) { return s.shard->uploaded_serial() == host.step_serial(); });
}

// rows_pending when the device does not yet hold the rows of sequence id (`rows`, sorted):
// a placed step writing the sequence not committed by every shard, or pending copies into or
// re-rotations of its rows that no upload has run.
template <class Host, class Shard>
Status check_rows_final(const Host& host, std::span<const StateSlice<Shard>> slices, std::int32_t id,
                        std::span<const std::int64_t> rows) {
  if (host.step_placed()) {
    const StepPlan plan = host.step();
    const bool writes_id = std::find(plan.seqs.begin(), plan.seqs.end(), id) != plan.seqs.end();
    const bool committed = std::all_of(slices.begin(), slices.end(), [&](const StateSlice<Shard>& s) {
      return s.shard->uploaded_serial() == host.step_serial() && s.shard->width() == 0;
    });
    if (writes_id && !committed) return Errc::rows_pending;
  }
  if (changes_uploaded(host, slices)) return {};
  return cellkv::detail::rows_pending(host.pending_changes(), rows) ? Status{Errc::rows_pending} : Status{};
}

template <class Cache, class Shard>
Result<std::vector<std::byte>> save_slices(const Cache& cache, std::span<const StateSlice<Shard>> slices, std::int32_t id,
                                           const StateShape& shape, std::size_t budget) {
  const auto& host = cache.host();
  if (has_window_storage(host)) return Errc::bad_argument;  // its layers' rows live in several pools
  const Result<std::vector<std::int32_t>> held = host.held_positions(id);
  if (!held.ok()) return held.status().code();
  const std::vector<std::int32_t>& positions = held.value();
  std::vector<std::int64_t> rows(positions.size());
  for (std::size_t i = 0; i < positions.size(); ++i) rows[i] = host.row_of(id, positions[i]);
  std::vector<std::int64_t> sorted = rows;
  std::sort(sorted.begin(), sorted.end());
  if (const Status s = check_rows_final(host, slices, id, sorted); !s.ok()) return s.code();
  std::vector<std::byte> out = state_frame(shape, positions);
  if (!rows.empty()) {
    for (const StateSlice<Shard>& slice : slices) {
      std::optional<SliceStaging> staging;
      try {
        staging.emplace(make_staging(slice, static_cast<std::int64_t>(rows.size()), budget));
      } catch (const Error&) {
        return Errc::device_error;
      }
      if (const Status s = move_slice<true>(slice, *staging, rows, state_rows(out, shape).data(), state_scales(out, shape).data(), shape);
          !s.ok())
        return s.code();
    }
  }
  seal_state(out);
  return out;
}

template <class Cache, class Shard>
Result<std::int32_t> restore_slices(Cache& cache, std::span<const StateSlice<Shard>> slices, std::span<const std::byte> bytes,
                                    const StateShape& shape, std::size_t budget) {
  if (has_window_storage(cache.host())) return Errc::bad_argument;  // its layers' rows live in several pools
  const Result<SavedState> parsed = parse_state_for(cache.host(), bytes, shape);
  if (!parsed.ok()) return parsed.status().code();
  const SavedState& s = parsed.value();
  if (!changes_uploaded(cache.host(), slices) && !cache.host().pending_changes().copies.empty()) return Errc::rows_pending;
  std::vector<SliceStaging> staging;
  if (!s.positions.empty()) {
    try {
      for (const StateSlice<Shard>& slice : slices) staging.push_back(make_staging(slice, static_cast<std::int64_t>(s.positions.size()), budget));
    } catch (const Error&) {
      return Errc::device_error;
    }
  }
  const Result<std::int32_t> id = cache.restore_positions(s.positions);
  if (!id.ok() || s.positions.empty()) return id;
  std::vector<std::int64_t> rows(s.positions.size());
  for (std::size_t i = 0; i < s.positions.size(); ++i) rows[i] = cache.host().row_of(id.value(), s.positions[i]);
  // The parsed rows and scales are read only (the copies read them); move_slice takes one pointer
  // for both ways.
  auto* state_rows = const_cast<std::byte*>(s.rows.data());
  auto* state_scales = const_cast<std::byte*>(s.scales.data());
  for (std::size_t g = 0; g < slices.size(); ++g) {
    if (const Status st = move_slice<false>(slices[g], staging[g], rows, state_rows, state_scales, shape); !st.ok()) {
      (void)cache.seq_rm(id.value());
      return st.code();
    }
  }
  return id;
}

}  // namespace detail

// ---- one GPU ----

// The state of sequence id of a DeviceCache (its host cache's positions, its pool's rows), with
// the caller's dtype tag. See the file comment for the streams and the refusals.
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P, std::int32_t MaxSeqs>
Result<std::vector<std::byte>> save_sequence(const DeviceCache<L, T, W, P, MaxSeqs>& cache, std::int32_t id,
                                             std::uint32_t dtype, ::cuda::stream_ref stream,
                                             std::size_t staging_bytes = kStateStagingBytes) {
  using Cache = DeviceCache<L, T, W, P, MaxSeqs>;
  const detail::StateSlice<typename Cache::Shard> slice{&cache.shard(), -1, 0, stream};
  return detail::save_slices(cache, std::span(&slice, 1),
                             id, device_state_shape<Cache, T>(cache.pools().shape(), dtype), staging_bytes);
}

// A new sequence of a DeviceCache (lowest free id) holding the saved positions, each in a fresh
// row its placement picks, with the saved K and V rows written there.
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P, std::int32_t MaxSeqs>
Result<std::int32_t> restore_sequence(DeviceCache<L, T, W, P, MaxSeqs>& cache, std::span<const std::byte> bytes,
                                      std::uint32_t dtype, ::cuda::stream_ref stream,
                                      std::size_t staging_bytes = kStateStagingBytes) {
  using Cache = DeviceCache<L, T, W, P, MaxSeqs>;
  const detail::StateSlice<typename Cache::Shard> slice{&cache.shard(), -1, 0, stream};
  return detail::restore_slices(cache, std::span(&slice, 1), bytes,
                                device_state_shape<Cache, T>(cache.pools().shape(), dtype), staging_bytes);
}

// The same with the natural tag, state_dtype<T>().
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P, std::int32_t MaxSeqs>
Result<std::vector<std::byte>> save_sequence(const DeviceCache<L, T, W, P, MaxSeqs>& cache, std::int32_t id,
                                             ::cuda::stream_ref stream) {
  return save_sequence(cache, id, state_dtype<T>(), stream);
}
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P, std::int32_t MaxSeqs>
Result<std::int32_t> restore_sequence(DeviceCache<L, T, W, P, MaxSeqs>& cache, std::span<const std::byte> bytes,
                                      ::cuda::stream_ref stream) {
  return restore_sequence(cache, bytes, state_dtype<T>(), stream);
}

// ---- several GPUs (tensor parallelism) ----

namespace detail {
// Shard g's slice of a sharded cache, on streams[g]; precondition: one stream per shard.
template <class Sharded>
std::vector<StateSlice<typename Sharded::Shard>> shard_slices(const Sharded& cache,
                                                              std::span<const ::cuda::stream_ref> streams) {
  std::vector<StateSlice<typename Sharded::Shard>> slices;
  for (std::int32_t g = 0; g < cache.shards(); ++g)
    slices.push_back({&cache.shard(g), cache.device(g), cache.heads(g).kv.first, streams[static_cast<std::size_t>(g)]});
  return slices;
}
}  // namespace detail

// As above for a ShardedCache: shard g gathers its heads on streams[g] (a stream of device g) into
// their place in every row of the state. bad_shape for a stream count other than shards().
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P, std::int32_t MaxSeqs>
Result<std::vector<std::byte>> save_sequence(const ShardedCache<L, T, W, P, MaxSeqs>& cache, std::int32_t id,
                                             std::uint32_t dtype, std::span<const ::cuda::stream_ref> streams,
                                             std::size_t staging_bytes = kStateStagingBytes) {
  using Cache = ShardedCache<L, T, W, P, MaxSeqs>;
  if (static_cast<std::int32_t>(streams.size()) != cache.shards()) return Errc::bad_shape;
  const auto slices = detail::shard_slices(cache, streams);
  return detail::save_slices(cache, std::span<const detail::StateSlice<typename Cache::Shard>>(slices), id,
                             device_state_shape<Cache, T>(cache.model_shape(), dtype), staging_bytes);
}

// As above for a ShardedCache: shard g writes its heads of every row on streams[g].
template <Layout L, KvElement T, WindowSet W, PlacementFor<L> P, std::int32_t MaxSeqs>
Result<std::int32_t> restore_sequence(ShardedCache<L, T, W, P, MaxSeqs>& cache, std::span<const std::byte> bytes,
                                      std::uint32_t dtype, std::span<const ::cuda::stream_ref> streams,
                                      std::size_t staging_bytes = kStateStagingBytes) {
  using Cache = ShardedCache<L, T, W, P, MaxSeqs>;
  if (static_cast<std::int32_t>(streams.size()) != cache.shards()) return Errc::bad_shape;
  const auto slices = detail::shard_slices(cache, streams);
  return detail::restore_slices(cache, std::span<const detail::StateSlice<typename Cache::Shard>>(slices), bytes,
                                device_state_shape<Cache, T>(cache.model_shape(), dtype), staging_bytes);
}

}  // namespace cellkv::gpu
