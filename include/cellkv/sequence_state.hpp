// cellkv/sequence_state.hpp - one sequence's saved state as bytes: its positions and the K and V
// rows of every layer (and, for an fp8 pool, the rows' scales), restorable into a new sequence of a
// cache whose pool has the same shape, storage, element type and window set (the placement, the
// layout's sizes and the cache may differ).
//
// Format, version 2 (little-endian; the header is 72 bytes):
//
//   offset  type      field
//   0       char[8]   magic "CELLKVSQ"
//   8       u32       version (2)
//   12      u32       header bytes (72)
//   16      u32 x 4   layers, heads_kv, head_dim, element bytes (1 for fp8 codes)
//   32      u32       dtype tag (the caller's; e.g. gpu::state_dtype<S>())
//   36      u32       window digest (window_digest<W>(): FNV-1a of the per-layer windows)
//   40      u32       held: positions the sequence holds
//   44      u32       length: one past the highest held position (0 when none)
//   48      u64       payload bytes: 4 held + 2 layers held (row_bytes + scale_row_bytes),
//                     row_bytes = heads_kv head_dim element bytes, scale_row_bytes = 4 heads_kv for
//                     fp8 storage, 0 for elements
//   56      u64       checksum: FNV-1a 64 over bytes [0, 56), then every byte from 64 on (the
//                     header's tail and the payload)
//   64      u32       storage (StateStorage): 0 elements, 1 fp8 E4M3 codes with an fp32 scale per
//                     row-head
//   68      u32       reserved, 0
//   72      payload   int32 positions[held], strictly ascending; then the rows: per layer l, K rows
//                     [held][row_bytes], V rows [held][row_bytes] (row i is position positions[i]);
//                     then, fp8 storage only, the scales: per layer l, K scales [held][heads_kv]
//                     fp32, V scales [held][heads_kv] fp32 (head h of row i scales the codes of
//                     head h of that row: fp8_pool_view.hpp)
//
// Every row holds every KV head (head h at bytes [h head_dim elem, (h + 1) head_dim elem) of a row,
// at [4 h, 4 h + 4) of a scale row), so a tensor-parallel shard's slice of heads is a column range
// of both: a sharded cache and a one-GPU cache write the same bytes.
//
// Version 1 (written before fp8 storage existed) is still read: the same header without its tail
// (64 bytes, version 1, header bytes 64, storage elements), its checksum over [0, 56) and the
// payload, the payload as version 2's without scales. Writers write version 2.
//
// parse_state refuses, changing nothing and naming the reason: fewer bytes than the header or
// payload declares (state_truncated), another magic (state_bad_magic), a version other than 1 or 2
// (state_bad_version), a header size, storage, reserved field, payload size, trailing bytes,
// checksum or position list that disagrees (state_corrupt: fp8 storage with an element size other
// than 1 or an unknown storage too), another shape, element size, storage, dtype or window set
// (state_mismatch: an fp8 state into a pool of elements and the reverse), more positions or a
// longer length than the target can ever hold (state_too_large). Checks run in that order but for
// the mismatch, checked after the checksum, so a corrupted shape field reads as corruption.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "cellkv/fp8.hpp"
#include "cellkv/fp8_pool_view.hpp"
#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"
#include "cellkv/windows.hpp"

namespace cellkv {

static_assert(std::endian::native == std::endian::little,
              "cellkv/sequence_state.hpp: the state format is little-endian; this host is not");

inline constexpr std::array<char, 8> kStateMagic{'C', 'E', 'L', 'L', 'K', 'V', 'S', 'Q'};
inline constexpr std::uint32_t kStateVersion = 2;      // the version written
inline constexpr std::size_t kStateHeaderBytes = 72;     // version 2's header
inline constexpr std::size_t kStateHeaderBytesV1 = 64;   // version 1's (read, never written)

// What a pool stores per row-head: D elements, or D fp8 E4M3 codes and one fp32 scale.
enum class StateStorage : std::uint32_t { elements = 0, fp8_e4m3 = 1 };

// What a state must match to be restored into a pool.
struct StateShape {
  std::int32_t layers = 0;
  std::int32_t heads_kv = 0;
  std::int32_t head_dim = 0;
  std::int32_t elem_bytes = 0;  // of an element, or of a code (1)
  std::uint32_t dtype = 0;      // the caller's tag for the element type
  std::uint32_t windows = 0;    // window_digest<W>()
  StateStorage storage = StateStorage::elements;
  [[nodiscard]] std::uint64_t row_bytes() const noexcept {
    return static_cast<std::uint64_t>(heads_kv) * static_cast<std::uint64_t>(head_dim) *
           static_cast<std::uint64_t>(elem_bytes);
  }
  // Bytes of one row's scales: 4 heads_kv for fp8 storage, 0 for elements.
  [[nodiscard]] std::uint64_t scale_row_bytes() const noexcept {
    return storage == StateStorage::fp8_e4m3 ? sizeof(float) * static_cast<std::uint64_t>(heads_kv) : 0;
  }
  friend bool operator==(const StateShape&, const StateShape&) = default;
};

namespace detail {
constexpr std::uint64_t kFnvBasis = 0xCBF2'9CE4'8422'2325ULL, kFnvPrime = 0x0000'0100'0000'01B3ULL;
constexpr std::uint64_t fnv1a(std::uint64_t h, std::span<const std::byte> bytes) noexcept {
  for (const std::byte b : bytes) h = (h ^ static_cast<std::uint64_t>(b)) * kFnvPrime;
  return h;
}
template <class T>
void put(std::vector<std::byte>& out, std::size_t at, T value) {
  std::memcpy(out.data() + at, &value, sizeof(T));
}
template <class T>
T get(std::span<const std::byte> in, std::size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  return value;
}
}  // namespace detail

// FNV-1a (32-bit) of the layer count and every layer's window: equal window sets, equal digests.
template <WindowSet W>
constexpr std::uint32_t window_digest() noexcept {
  std::uint32_t h = 0x811C'9DC5U;
  auto mix = [&](std::int32_t v) {
    for (int i = 0; i < 4; ++i) h = (h ^ ((static_cast<std::uint32_t>(v) >> (8 * i)) & 0xFFU)) * 0x0100'0193U;
  };
  mix(W::kLayers);
  for (std::int32_t l = 0; l < W::kLayers; ++l) mix(W::window_of_layer(l));
  return h;
}

// A parsed state: views into the bytes it was parsed from (valid while they are).
struct SavedState {
  StateShape shape;
  std::int32_t length = 0;               // one past the highest position (0 when none)
  std::vector<std::int32_t> positions;   // strictly ascending
  std::span<const std::byte> rows;       // [layers][2][held][row_bytes]
  std::span<const std::byte> scales;     // [layers][2][held][scale_row_bytes]: fp8 storage; empty otherwise
  // K (kv = 0) or V (kv = 1) row of positions[i] in `layer`.
  [[nodiscard]] std::span<const std::byte> row(std::int32_t layer, std::int32_t kv, std::size_t i) const {
    return part(rows, shape.row_bytes(), layer, kv, i);
  }
  // The scales ([heads_kv] fp32) of that row: fp8 storage only.
  [[nodiscard]] std::span<const std::byte> scale_row(std::int32_t layer, std::int32_t kv, std::size_t i) const {
    return part(scales, shape.scale_row_bytes(), layer, kv, i);
  }

 private:
  [[nodiscard]] std::span<const std::byte> part(std::span<const std::byte> all, std::uint64_t rb, std::int32_t layer,
                                                std::int32_t kv, std::size_t i) const {
    const std::uint64_t held = positions.size();
    const std::uint64_t at = ((static_cast<std::uint64_t>(layer) * 2 + static_cast<std::uint64_t>(kv)) * held + i) * rb;
    return all.subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(rb));
  }
};

// The bytes of a state holding `positions` (strictly ascending): the header and the positions
// written, the rows (state_rows) and scales (state_scales) left zero and the checksum unset until
// seal_state. The device save (gpu/sequence_state.cuh) copies the rows and scales straight into them.
inline std::vector<std::byte> state_frame(const StateShape& shape, std::span<const std::int32_t> positions) {
  const std::uint64_t held = positions.size();
  const std::uint64_t payload = 4 * held + 2 * static_cast<std::uint64_t>(shape.layers) * held * (shape.row_bytes() + shape.scale_row_bytes());
  std::vector<std::byte> out(kStateHeaderBytes + static_cast<std::size_t>(payload));
  std::memcpy(out.data(), kStateMagic.data(), kStateMagic.size());
  detail::put<std::uint32_t>(out, 8, kStateVersion);
  detail::put<std::uint32_t>(out, 12, static_cast<std::uint32_t>(kStateHeaderBytes));
  detail::put<std::int32_t>(out, 16, shape.layers);
  detail::put<std::int32_t>(out, 20, shape.heads_kv);
  detail::put<std::int32_t>(out, 24, shape.head_dim);
  detail::put<std::int32_t>(out, 28, shape.elem_bytes);
  detail::put<std::uint32_t>(out, 32, shape.dtype);
  detail::put<std::uint32_t>(out, 36, shape.windows);
  detail::put<std::uint32_t>(out, 40, static_cast<std::uint32_t>(held));
  // In 64 bits, then modulo 2^32: a last position of INT32_MAX gives a length no parse accepts.
  detail::put<std::int32_t>(out, 44, positions.empty() ? 0 : static_cast<std::int32_t>(std::int64_t{positions.back()} + 1));
  detail::put<std::uint64_t>(out, 48, payload);
  detail::put<std::uint32_t>(out, 64, static_cast<std::uint32_t>(shape.storage));
  detail::put<std::uint32_t>(out, 68, 0);
  if (held != 0) std::memcpy(out.data() + kStateHeaderBytes, positions.data(), 4 * positions.size());
  return out;
}

// The rows of a state framed for `shape`: [layers][2][held][row_bytes] (K then V of each layer).
inline std::span<std::byte> state_rows(std::vector<std::byte>& frame, const StateShape& shape) {
  const std::size_t held = detail::get<std::uint32_t>(std::span<const std::byte>(frame), 40);
  const std::size_t bytes = 2 * static_cast<std::size_t>(shape.layers) * held * static_cast<std::size_t>(shape.row_bytes());
  return std::span<std::byte>(frame).subspan(kStateHeaderBytes + 4 * held, bytes);
}
// Its scales, after the rows: [layers][2][held][scale_row_bytes] (empty for element storage).
inline std::span<std::byte> state_scales(std::vector<std::byte>& frame, const StateShape& shape) {
  const std::span<std::byte> rows = state_rows(frame, shape);
  return std::span<std::byte>(frame).subspan(static_cast<std::size_t>(rows.data() + rows.size() - frame.data()));
}

namespace detail {
// The checksum of a state: bytes [0, 56), then every byte from 64 on (version 2's header tail and
// the payload; version 1's payload).
inline std::uint64_t state_checksum(std::span<const std::byte> bytes) noexcept {
  return fnv1a(fnv1a(kFnvBasis, bytes.first(56)), bytes.subspan(kStateHeaderBytesV1));
}
}  // namespace detail

// Writes the checksum of a framed state whose rows (and scales) are filled.
inline void seal_state(std::vector<std::byte>& frame) {
  detail::put<std::uint64_t>(frame, 56, detail::state_checksum(frame));
}

namespace detail {
template <bool Scales, class RowFn, class ScaleFn>
std::vector<std::byte> encode_state(const StateShape& shape, std::span<const std::int32_t> positions, RowFn&& row,
                                    ScaleFn&& scale_row) {
  std::vector<std::byte> out = state_frame(shape, positions);
  auto fill = [&](std::span<std::byte> part, std::size_t rb, auto&& source) {
    std::byte* at = part.data();
    for (std::int32_t l = 0; l < shape.layers; ++l)
      for (std::int32_t kv = 0; kv < 2; ++kv)
        for (std::size_t i = 0; i < positions.size(); ++i, at += rb) std::memcpy(at, source(l, kv, i), rb);
  };
  fill(state_rows(out, shape), static_cast<std::size_t>(shape.row_bytes()), row);
  if constexpr (Scales) fill(state_scales(out, shape), static_cast<std::size_t>(shape.scale_row_bytes()), scale_row);
  seal_state(out);
  return out;
}
}  // namespace detail

// Bytes of a state of fp8 storage holding `positions` (strictly ascending); row(layer, kv, i)
// returns a pointer to the row_bytes() bytes of position positions[i]'s K (kv 0) or V (kv 1) codes
// in that layer, scale_row(layer, kv, i) to the scale_row_bytes() bytes of that row's scales.
template <class RowFn, class ScaleFn>
std::vector<std::byte> encode_state(const StateShape& shape, std::span<const std::int32_t> positions, RowFn&& row,
                                    ScaleFn&& scale_row) {
  return detail::encode_state<true>(shape, positions, row, scale_row);
}
// The same for element storage: row(layer, kv, i) points to the row's row_bytes() bytes (a shape of
// fp8 storage needs the form above: this one leaves its scales zero).
template <class RowFn>
std::vector<std::byte> encode_state(const StateShape& shape, std::span<const std::int32_t> positions, RowFn&& row) {
  return detail::encode_state<false>(shape, positions, row, 0);
}

// Parses and checks a state against the pool it is for (`expect`) and the target's limits: at
// most `max_held` positions and a length of at most `max_length`.
inline Result<SavedState> parse_state(std::span<const std::byte> bytes, const StateShape& expect, std::int64_t max_held,
                                      std::int64_t max_length) {
  if (bytes.size() < kStateMagic.size()) return Errc::state_truncated;
  if (std::memcmp(bytes.data(), kStateMagic.data(), kStateMagic.size()) != 0) return Errc::state_bad_magic;
  if (bytes.size() < 12) return Errc::state_truncated;
  const std::uint32_t version = detail::get<std::uint32_t>(bytes, 8);
  if (version != 1 && version != kStateVersion) return Errc::state_bad_version;
  if (bytes.size() < 16) return Errc::state_truncated;
  const std::size_t header = version == 1 ? kStateHeaderBytesV1 : kStateHeaderBytes;
  if (detail::get<std::uint32_t>(bytes, 12) != header) return Errc::state_corrupt;
  if (bytes.size() < header) return Errc::state_truncated;
  SavedState s;
  s.shape = StateShape{detail::get<std::int32_t>(bytes, 16), detail::get<std::int32_t>(bytes, 20),
                       detail::get<std::int32_t>(bytes, 24), detail::get<std::int32_t>(bytes, 28),
                       detail::get<std::uint32_t>(bytes, 32), detail::get<std::uint32_t>(bytes, 36)};
  if (version != 1) {
    const std::uint32_t storage = detail::get<std::uint32_t>(bytes, 64);
    if (storage > static_cast<std::uint32_t>(StateStorage::fp8_e4m3) || detail::get<std::uint32_t>(bytes, 68) != 0)
      return Errc::state_corrupt;
    s.shape.storage = static_cast<StateStorage>(storage);
  }
  const std::uint64_t held = detail::get<std::uint32_t>(bytes, 40);
  s.length = detail::get<std::int32_t>(bytes, 44);
  const std::uint64_t payload = detail::get<std::uint64_t>(bytes, 48);
  // The declared payload must be the one the header's own fields give (no overflow: each factor is
  // below 2^32, and a product past the payload bound is corruption).
  const StateShape& h = s.shape;
  if (h.layers < 0 || h.heads_kv < 0 || h.head_dim < 0 || h.elem_bytes < 0) return Errc::state_corrupt;
  if (h.storage == StateStorage::fp8_e4m3 && h.elem_bytes != static_cast<std::int32_t>(sizeof(Fp8E4M3)))
    return Errc::state_corrupt;
  std::uint64_t want = 0;
  bool overflow = __builtin_mul_overflow(static_cast<std::uint64_t>(h.heads_kv), static_cast<std::uint64_t>(h.head_dim), &want);
  overflow = overflow || __builtin_mul_overflow(want, static_cast<std::uint64_t>(h.elem_bytes), &want);
  overflow = overflow || __builtin_add_overflow(want, h.scale_row_bytes(), &want);
  overflow = overflow || __builtin_mul_overflow(want, held, &want);
  overflow = overflow || __builtin_mul_overflow(want, 2 * static_cast<std::uint64_t>(h.layers), &want);
  overflow = overflow || __builtin_add_overflow(want, 4 * held, &want);
  if (overflow || want != payload) return Errc::state_corrupt;
  if (bytes.size() - header < payload) return Errc::state_truncated;
  if (bytes.size() - header > payload) return Errc::state_corrupt;  // trailing bytes
  if (detail::state_checksum(bytes) != detail::get<std::uint64_t>(bytes, 56)) return Errc::state_corrupt;
  if (!(s.shape == expect)) return Errc::state_mismatch;
  if (static_cast<std::int64_t>(held) > max_held || s.length > max_length) return Errc::state_too_large;
  s.positions.resize(static_cast<std::size_t>(held));
  if (held != 0) std::memcpy(s.positions.data(), bytes.data() + header, 4 * static_cast<std::size_t>(held));
  for (std::size_t i = 0; i < s.positions.size(); ++i)
    if (s.positions[i] < 0 || (i > 0 && s.positions[i] <= s.positions[i - 1])) return Errc::state_corrupt;
  // In 64 bits: the last position may be INT32_MAX.
  const std::int64_t length = s.positions.empty() ? 0 : std::int64_t{s.positions.back()} + 1;
  if (s.length != length) return Errc::state_corrupt;
  const std::size_t rows_at = header + 4 * static_cast<std::size_t>(held);
  const auto rows_bytes = static_cast<std::size_t>(2 * static_cast<std::uint64_t>(h.layers) * held * h.row_bytes());
  s.rows = bytes.subspan(rows_at, rows_bytes);
  s.scales = bytes.subspan(rows_at + rows_bytes);
  return s;
}

// ---- files ----

inline Status write_state_file(const std::string& path, std::span<const std::byte> bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return Errc::io_error;
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return f ? Status{} : Status{Errc::io_error};
}
// The file's bytes; a file longer than max_bytes is refused (state_too_large) before reading it.
inline Result<std::vector<std::byte>> read_state_file(const std::string& path, std::uint64_t max_bytes) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) return Errc::io_error;
  const std::streamoff size = f.tellg();
  if (size < 0) return Errc::io_error;
  if (static_cast<std::uint64_t>(size) > max_bytes) return Errc::state_too_large;
  std::vector<std::byte> out(static_cast<std::size_t>(size));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(out.data()), size);
  if (!f) return Errc::io_error;
  return out;
}

// ---- a host cache and its host pool (host_pool.hpp) ----
// A cache with window storage (CacheConfig::window_cells > 0) keeps its layers' rows in several
// pools, which one HostPool does not describe: saving and restoring refuse it (bad_argument).

// What a state of `Cache` with pools of `shape` (layers, H_kv, D) and elements (or codes) of
// elem_bytes must match (the host pools' below; the device caches' in gpu/sequence_state.cuh).
template <class Cache>
StateShape state_shape(const PoolShape& shape, std::int32_t elem_bytes, std::uint32_t dtype,
                       StateStorage storage = StateStorage::elements) {
  return {shape.layers, shape.heads_kv, shape.head_dim, elem_bytes, dtype, window_digest<typename Cache::Windows>(), storage};
}
template <class Cache, class T>
StateShape state_shape(const HostPool<T>& pool, std::uint32_t dtype) {
  return state_shape<Cache>(PoolShape{pool.layers(), pool.heads_kv(), pool.head_dim()}, static_cast<std::int32_t>(sizeof(T)),
                            dtype);
}

template <class Cache>
StateShape state_shape(const HostFp8Pool& pool, std::uint32_t dtype) {
  return state_shape<Cache>(PoolShape{pool.layers(), pool.heads_kv(), pool.head_dim()},
                            static_cast<std::int32_t>(sizeof(Fp8E4M3)), dtype, StateStorage::fp8_e4m3);
}

// parse_state against the limits of `cache` (a host cache): at most min(capacity, position limit)
// positions, a length of at most the position limit.
template <class Cache>
Result<SavedState> parse_state_for(const Cache& cache, std::span<const std::byte> bytes, const StateShape& expect) {
  return parse_state(bytes, expect, std::min<std::int64_t>(cache.capacity(), cache.position_limit()),
                     cache.position_limit());
}

namespace detail {
// Whether a pending row copy writes into, or a pending K re-rotation rewrites, one of `rows`
// (sorted ascending): such rows hold their final contents only once the changes are applied
// (HostPool::sync on the host, the next upload on a device).
inline bool rows_pending(const PendingChanges& pending, std::span<const std::int64_t> rows) {
  auto held = [&](std::int64_t first, std::int64_t count) {  // any row of [first, first + count) in rows
    const auto it = std::lower_bound(rows.begin(), rows.end(), first);
    return it != rows.end() && *it < first + count;
  };
  return std::any_of(pending.copies.begin(), pending.copies.end(),
                     [&](const RowCopy& c) { return held(c.dst_row, c.rows); }) ||
         std::any_of(pending.rotations.begin(), pending.rotations.end(),
                     [&](const RowRotation& r) { return held(r.cell, 1); });
}

// What every host save reads: the held positions of sequence id, refused (bad_argument) for a cache
// with window storage, then for held_positions' reasons, then with rows_pending while a pending copy
// or K re-rotation (a copy-on-write seq_add, a fork of the sequence layout) would still change
// one of its rows: HostPool::sync first.
template <class Cache>
Result<std::vector<std::int32_t>> final_held_positions(const Cache& cache, std::int32_t id) {
  if (has_window_storage(cache)) return Errc::bad_argument;  // its layers' rows live in several pools
  Result<std::vector<std::int32_t>> held = cache.held_positions(id);
  if (!held.ok()) return held;
  std::vector<std::int64_t> rows;
  rows.reserve(held.value().size());
  for (const std::int32_t p : held.value()) rows.push_back(cache.row_of(id, p));
  std::sort(rows.begin(), rows.end());
  if (rows_pending(cache.pending_changes(), rows)) return Errc::rows_pending;
  return held;
}

// What every host restore does: parse `bytes` against `shape` and the cache's limits, place a new
// sequence at the saved positions, then write_row(state, layer, i, pool row) for every layer and
// held position i. Refused, changing nothing, for parse_state_for's reasons, then with
// rows_pending while row copies wait for HostPool::sync (a fresh row could be the source of one),
// then for restore_positions' reasons.
template <class Cache, class WriteRow>
Result<std::int32_t> restore_rows(Cache& cache, std::span<const std::byte> bytes, const StateShape& shape,
                                  WriteRow&& write_row) {
  if (has_window_storage(cache)) return Errc::bad_argument;  // its layers' rows live in several pools
  const Result<SavedState> parsed = parse_state_for(cache, bytes, shape);
  if (!parsed.ok()) return parsed.status().code();
  const SavedState& s = parsed.value();
  if (!cache.pending_changes().copies.empty()) return Errc::rows_pending;
  const Result<std::int32_t> id = cache.restore_positions(s.positions);
  if (!id.ok()) return id;
  for (std::int32_t l = 0; l < s.shape.layers; ++l)
    for (std::size_t i = 0; i < s.positions.size(); ++i) write_row(s, l, i, cache.row_of(id.value(), s.positions[i]));
  return id;
}
}  // namespace detail

// The state of sequence id: its held positions and their K and V rows in `pool`. Refused for
// final_held_positions' reasons (rows_pending: HostPool::sync first).
template <class Cache, class T>
Result<std::vector<std::byte>> save_sequence(const Cache& cache, HostPool<T>& pool, std::int32_t id,
                                             std::uint32_t dtype) {
  const Result<std::vector<std::int32_t>> held = detail::final_held_positions(cache, id);
  if (!held.ok()) return held.status().code();
  const std::vector<std::int32_t>& positions = held.value();
  return encode_state(state_shape<Cache>(pool, dtype), positions, [&](std::int32_t l, std::int32_t kv, std::size_t i) {
    const PoolView<T> v = pool.view(l);
    const std::int64_t row = cache.row_of(id, positions[i]);
    return reinterpret_cast<const std::byte*>((kv == 0 ? v.k : v.v) + row * pool.row_elems());
  });
}

// A new sequence holding the saved positions, its rows written into `pool`. Refused, changing
// neither the cache nor the pool: parse_state's reasons, rows_pending (row copies wait for
// HostPool::sync), then restore_positions' (no free id, cells, pages; the sequence layout refuses a
// state with holes).
template <class Cache, class T>
Result<std::int32_t> restore_sequence(Cache& cache, HostPool<T>& pool, std::span<const std::byte> bytes,
                                      std::uint32_t dtype) {
  return detail::restore_rows(cache, bytes, state_shape<Cache>(pool, dtype),
                              [&](const SavedState& s, std::int32_t l, std::size_t i, std::int64_t row) {
                                const PoolView<T> v = pool.view(l);
                                const std::span<const std::byte> k = s.row(l, 0, i), vv = s.row(l, 1, i);
                                std::memcpy(v.k + row * pool.row_elems(), k.data(), k.size());
                                std::memcpy(v.v + row * pool.row_elems(), vv.data(), vv.size());
                              });
}

// ---- a host cache and its fp8 pool (host_fp8_pool.hpp): codes and scales ----

// The state of sequence id: its held positions, the K and V codes of their rows in `pool` and the
// rows' scales (fp8 storage). The dtype tag is the caller's, as for a HostPool; refused as there.
template <class Cache>
Result<std::vector<std::byte>> save_sequence(const Cache& cache, HostFp8Pool& pool, std::int32_t id, std::uint32_t dtype) {
  const Result<std::vector<std::int32_t>> held = detail::final_held_positions(cache, id);
  if (!held.ok()) return held.status().code();
  const std::vector<std::int32_t>& positions = held.value();
  auto row_of = [&](std::size_t i) { return cache.row_of(id, positions[i]); };
  return encode_state(
      state_shape<Cache>(pool, dtype), positions,
      [&](std::int32_t l, std::int32_t kv, std::size_t i) {
        const Fp8PoolView<Fp8E4M3> v = pool.view(l);
        return reinterpret_cast<const std::byte*>((kv == 0 ? v.k : v.v) + v.offset(row_of(i), 0));
      },
      [&](std::int32_t l, std::int32_t kv, std::size_t i) {
        const Fp8PoolView<Fp8E4M3> v = pool.view(l);
        return reinterpret_cast<const std::byte*>((kv == 0 ? v.k_scale : v.v_scale) + v.scale_offset(row_of(i), 0));
      });
}

// A new sequence holding the saved positions, its rows' codes and scales written into `pool`.
// Refused as restore_sequence into a HostPool, changing neither the cache nor the pool (a state of
// element storage into this pool, or the reverse: state_mismatch).
template <class Cache>
Result<std::int32_t> restore_sequence(Cache& cache, HostFp8Pool& pool, std::span<const std::byte> bytes, std::uint32_t dtype) {
  return detail::restore_rows(cache, bytes, state_shape<Cache>(pool, dtype),
                              [&](const SavedState& s, std::int32_t l, std::size_t i, std::int64_t row) {
                                const Fp8PoolView<Fp8E4M3> v = pool.view(l);
                                for (std::int32_t kv = 0; kv < 2; ++kv) {
                                  const std::span<const std::byte> codes = s.row(l, kv, i), scales = s.scale_row(l, kv, i);
                                  std::memcpy((kv == 0 ? v.k : v.v) + v.offset(row, 0), codes.data(), codes.size());
                                  std::memcpy((kv == 0 ? v.k_scale : v.v_scale) + v.scale_offset(row, 0), scales.data(),
                                              scales.size());
                                }
                              });
}

}  // namespace cellkv
