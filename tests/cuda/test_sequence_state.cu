// Saved sequence state on the device (gpu/sequence_state.cuh): a sequence saved from a device
// cache (holes included) and restored into a fresh cache of another placement and size attends
// bit for bit as the source does; every refusal changes neither the host cache nor the pool;
// states move between host pools, one-GPU caches and sharded caches byte for byte. fp8 caches
// carry their codes and scales the same way, and refuse states of the other storage.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/sequence_state.cuh"
#include "cellkv/gpu/sharded_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/fp8.hpp"
#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/sequence_state.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using Bf = __nv_bfloat16;
using Model = Windows<0, 6>;  // layer 0: whole history; layer 1: the last 6 positions
constexpr std::int32_t kHeadsQ = 8, kHeadsKv = 2, kDim = 128;
constexpr gpu::PoolShape kShape{.layers = Model::kLayers, .heads_kv = kHeadsKv, .head_dim = kDim, .heads_q = kHeadsQ};
const std::uint32_t kTag = gpu::state_dtype<Bf>();

using CellLowest = gpu::DeviceCache<layout::cell, Bf, Model, placement::lowest_free, 8>;
using CellClustered = gpu::DeviceCache<layout::cell, Bf, Model, placement::clustered<16>, 16>;
using Slots = gpu::DeviceCache<layout::sequence, Bf, Model, placement::lowest_free, 8>;

// A step's inputs: q [T, H_q, D], k and v [T, H_kv, D], random bf16.
struct Inputs {
  std::vector<Bf> q, k, v;
  Inputs(std::int32_t tokens, std::mt19937_64& rng)
      : q(random_values<Bf>(static_cast<std::size_t>(tokens * kHeadsQ * kDim), rng)),
        k(random_values<Bf>(static_cast<std::size_t>(tokens * kHeadsKv * kDim), rng)),
        v(random_values<Bf>(k.size(), rng)) {}
};

// One step of `seqs` on the device: every layer's update_and_attend with `in`; returns every
// layer's output [layers][T][H_q][D] as bits.
template <class Cache>
std::vector<std::uint16_t> run_step(Cache& cache, const std::vector<std::int32_t>& seqs, const Inputs& in,
                                    const gpu::Stream& stream) {
  const auto T = static_cast<std::int32_t>(seqs.size());
  REQUIRE(cache.declare_step(seqs).ok());
  REQUIRE(cache.upload(stream).ok());
  DeviceArray<Bf> q(in.q), k(in.k), v(in.v), out(in.q.size() * Model::kLayers);
  out.fill(poison<Bf>());
  for (std::int32_t l = 0; l < Model::kLayers; ++l)
    REQUIRE(cache.update_and_attend(l, q.data(), k.data(), v.data(), out.data() + l * in.q.size(), T, kHeadsQ, 0.f, stream)
                .ok());
  REQUIRE(cache.commit(stream).ok());
  stream.synchronize();
  const std::vector<Bf> got = out.download();
  std::vector<std::uint16_t> bits(got.size());
  std::memcpy(bits.data(), got.data(), got.size() * sizeof(Bf));
  for (const Bf x : got) REQUIRE(std::isfinite(to_double(x)));  // written, not poison
  return bits;
}

// All of a device pool's storage (every layer's K and V, scratch rows included), as bytes.
template <class Pool>
std::vector<std::byte> pool_bits(const Pool& pool) {
  const auto storage = pool.storage();
  std::vector<std::byte> out(storage.size_bytes());
  REQUIRE(cudaMemcpy(out.data(), storage.data(), storage.size_bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
  return out;
}

// Fills a pool with noise so that rows no step wrote differ from any saved row.
template <class Pool>
void fill_noise(const Pool& pool, std::mt19937_64& rng) {
  const auto storage = pool.storage();
  DeviceArray<Bf> noise(random_values<Bf>(storage.size(), rng));
  REQUIRE(cudaMemcpy(storage.data(), noise.data(), storage.size_bytes(), cudaMemcpyDeviceToDevice) == cudaSuccess);
}

// Row `row` of layer l's K (kv 0) or V (kv 1) of a device cache, as bits.
template <class Cache>
std::vector<std::uint16_t> device_row(const Cache& cache, std::int32_t layer, std::int32_t kv, std::int64_t row) {
  const auto view = cache.pool().view(layer);
  const auto n = static_cast<std::size_t>(view.row_elems());
  std::vector<std::uint16_t> out(n);
  REQUIRE(cudaMemcpy(out.data(), (kv == 0 ? view.k : view.v) + row * view.row_elems(), n * 2, cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  return out;
}

// A cell cache whose sequence `seq` holds 0..3 and 8..15 (seq_rm of the middle range 4..7), its
// tokens interleaved with those of another sequence; every row written by real steps, the rest of
// the pool `fill`ed with noise first.
template <class Cache>
struct SourceWithHole {
  Cache cache{{.max_write = 16, .max_cells = 96}, kShape};
  gpu::Stream stream;
  std::mt19937_64 rng;
  std::int32_t other = -1, seq = -1;
  template <class Fill>
  SourceWithHole(std::uint64_t seed, Fill&& fill) : rng(seed) {
    fill(cache.pool(), rng);
    other = cache.seq_new().value();
    seq = cache.seq_new().value();
    const std::vector<std::int32_t> first{other, seq, seq, other, seq, seq, seq, other, seq, seq};
    run_step(cache, first, Inputs(static_cast<std::int32_t>(first.size()), rng), stream);
    const std::vector<std::int32_t> second{seq, seq, seq, other, seq, seq, seq, seq, seq, seq};
    run_step(cache, second, Inputs(static_cast<std::int32_t>(second.size()), rng), stream);  // seq: 7 + 9 tokens, 0..15
    REQUIRE(cache.seq_rm(seq, 4, 8).ok());
    REQUIRE(cache.host().held_positions(seq).value() ==
            std::vector<std::int32_t>{0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15});
  }
};
struct CellSource : SourceWithHole<CellLowest> {
  CellSource() : SourceWithHole(7, [](const auto& pool, std::mt19937_64& rng) { fill_noise(pool, rng); }) {}
};

// The next steps of `a` in cache x and `b` in cache y (a decode token, then a 3-token chunk) with
// equal inputs give equal outputs, bit for bit.
template <class X, class Y>
void same_attention(X& x, std::int32_t a, Y& y, std::int32_t b, const gpu::Stream& stream, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Inputs decode(1, rng);
  CHECK(run_step(x, {a}, decode, stream) == run_step(y, {b}, decode, stream));
  const Inputs chunk(3, rng);
  CHECK(run_step(x, {a, a, a}, chunk, stream) == run_step(y, {b, b, b}, chunk, stream));
}

// The restore of `bytes` into `cache` is refused with `want`, and neither the host cache nor the
// pool changes.
template <class Cache>
void check_refused(Cache& cache, std::span<const std::byte> bytes, Errc want, const gpu::Stream& stream,
                   std::uint32_t tag = kTag) {
  const auto before = cache.host();
  const auto pool_before = pool_bits(cache.pool());
  CHECK(gpu::restore_sequence(cache, bytes, tag, stream).status() == want);
  CHECK(cache.host() == before);
  CHECK(pool_bits(cache.pool()) == pool_before);
}

}  // namespace

TEST_CASE("device state: a cell sequence with holes restores into a fresh cache of another placement; attention is bit-identical") {
  CellSource src;
  const auto bytes = gpu::save_sequence(src.cache, src.seq, kTag, src.stream).value();
  CHECK(bytes.size() == kStateHeaderBytes + 4 * 12 + 2 * Model::kLayers * 12 * kHeadsKv * kDim * sizeof(Bf));
  // The saved rows are the pool's rows of the held positions, in order.
  const SavedState parsed = parse_state(bytes, state_shape<CellLowest>(kShape, 2, kTag), 96, 96).value();
  for (std::int32_t l = 0; l < Model::kLayers; ++l)
    for (std::int32_t kv = 0; kv < 2; ++kv)
      for (std::size_t i = 0; i < parsed.positions.size(); ++i) {
        const auto row = device_row(src.cache, l, kv, src.cache.host().row_of(src.seq, parsed.positions[i]));
        CHECK(std::memcmp(parsed.row(l, kv, i).data(), row.data(), row.size() * 2) == 0);
      }

  // Staged one layer at a time (the smallest budget): the same bytes, the same rows.
  CHECK(gpu::save_sequence(src.cache, src.seq, kTag, src.stream, 1).value() == bytes);
  CellLowest layered({.max_write = 8, .max_cells = 64}, kShape);
  const std::int32_t by_layer = gpu::restore_sequence(layered, bytes, kTag, src.stream, 1).value();
  CHECK(gpu::save_sequence(layered, by_layer, kTag, src.stream).value() == bytes);

  CellClustered dst({.max_write = 8, .max_cells = 200}, kShape);
  std::mt19937_64 rng(11);
  fill_noise(dst.pool(), rng);
  const std::int32_t busy = dst.seq_new().value();
  run_step(dst, {busy, busy, busy, busy, busy}, Inputs(5, rng), src.stream);
  const std::int32_t id = gpu::restore_sequence(dst, bytes, kTag, src.stream).value();
  CHECK(id == 1);
  CHECK(dst.host().held_positions(id).value() == src.cache.host().held_positions(src.seq).value());
  CHECK(dst.host().pos(id).value() == 16);
  CHECK(gpu::save_sequence(dst, id, kTag, src.stream).value() == bytes);  // the same rows, byte for byte
  CHECK(gpu::save_sequence(dst, id, src.stream).value() == bytes);        // the natural tag is bf16's
  same_attention(src.cache, src.seq, dst, id, src.stream, 21);
  require_device_ok();
}

TEST_CASE("device state: a sequence-layout sequence restores into another sequence cache (bit-identical attention) and a cell cache") {
  gpu::Stream stream;
  std::mt19937_64 rng(5);
  Slots src({.max_write = 16, .max_seqs = 4, .max_len = 40}, kShape);
  fill_noise(src.pool(), rng);
  const std::int32_t a = src.seq_new().value(), b = src.seq_new().value();
  const std::vector<std::int32_t> first{a, b, b, a, b, b, b, b, b, b, b};
  run_step(src, first, Inputs(static_cast<std::int32_t>(first.size()), rng), stream);
  run_step(src, {b, b, b, b}, Inputs(4, rng), stream);  // b: 0..12
  const auto bytes = gpu::save_sequence(src, b, kTag, stream).value();

  using OtherSlots = gpu::DeviceCache<layout::sequence, Bf, Model, placement::lowest_free, 16>;
  OtherSlots dst({.max_write = 8, .max_seqs = 6, .max_len = 24}, kShape);
  fill_noise(dst.pool(), rng);
  const std::int32_t busy = dst.seq_new().value();
  run_step(dst, {busy, busy}, Inputs(2, rng), stream);
  const std::int32_t id = gpu::restore_sequence(dst, bytes, kTag, stream).value();
  CHECK(dst.host().pos(id).value() == 13);
  CHECK(gpu::save_sequence(dst, id, kTag, stream).value() == bytes);
  same_attention(src, b, dst, id, stream, 31);

  // Into the cell layout: the same positions and rows.
  CellClustered cells({.max_write = 8, .max_cells = 64}, kShape);
  const std::int32_t c = gpu::restore_sequence(cells, bytes, kTag, stream).value();
  CHECK(cells.host().pos(c).value() == 13);
  CHECK(gpu::save_sequence(cells, c, kTag, stream).value() == bytes);
  // An empty sequence round-trips too (no device work).
  const std::int32_t empty = src.seq_new().value();
  const auto none = gpu::save_sequence(src, empty, kTag, stream).value();
  CHECK(none.size() == kStateHeaderBytes);
  const std::int32_t e = gpu::restore_sequence(cells, none, kTag, stream).value();
  CHECK(cells.host().pos(e).value() == 0);
  require_device_ok();
}

TEST_CASE("device state: refusals change neither the host cache nor the pool") {
  CellSource src;
  const auto bytes = gpu::save_sequence(src.cache, src.seq, kTag, src.stream).value();
  const gpu::Stream& stream = src.stream;
  std::mt19937_64 rng(3);
  CellClustered dst({.max_write = 8, .max_cells = 64}, kShape);
  fill_noise(dst.pool(), rng);
  const std::int32_t busy = dst.seq_new().value();
  run_step(dst, {busy, busy, busy}, Inputs(3, rng), stream);

  SUBCASE("truncated") {
    for (const std::size_t n : {std::size_t{0}, std::size_t{7}, std::size_t{12}, std::size_t{63}, std::size_t{64},
                                std::size_t{64 + 4 * 12}, bytes.size() - 1})
      check_refused(dst, std::span<const std::byte>(bytes.data(), n), Errc::state_truncated, stream);
  }
  SUBCASE("corrupted: magic, version, a position, a row byte, the checksum, trailing bytes") {
    auto bad = bytes;
    bad[0] = std::byte{'X'};
    check_refused(dst, bad, Errc::state_bad_magic, stream);
    bad = bytes;
    bad[8] = std::byte{9};
    check_refused(dst, bad, Errc::state_bad_version, stream);
    for (const std::size_t at : {std::size_t{20}, kStateHeaderBytes + 4, bytes.size() / 2, bytes.size() - 1, std::size_t{57}}) {
      bad = bytes;
      bad[at] ^= std::byte{0x04};
      CAPTURE(at);
      check_refused(dst, bad, Errc::state_corrupt, stream);
    }
    bad = bytes;
    bad.push_back(std::byte{0});
    check_refused(dst, bad, Errc::state_corrupt, stream);
  }
  SUBCASE("mismatched shape, element type, dtype tag, windows") {
    check_refused(dst, bytes, Errc::state_mismatch, stream, gpu::state_dtype<__half>());
    gpu::DeviceCache<layout::cell, __half, Model, placement::lowest_free, 8> half({.max_write = 8, .max_cells = 64}, kShape);
    check_refused(half, bytes, Errc::state_mismatch, stream, gpu::state_dtype<__half>());  // same size; the tag differs
    const auto half_before = half.host();
    CHECK(gpu::restore_sequence(half, bytes, stream).status() == Errc::state_mismatch);  // the natural tag: fp16's
    CHECK(half.host() == half_before);
    gpu::DeviceCache<layout::cell, float, Model, placement::lowest_free, 8> wide({.max_write = 8, .max_cells = 64}, kShape);
    check_refused(wide, bytes, Errc::state_mismatch, stream, kTag);  // 4-byte elements
    CellLowest narrow({.max_write = 8, .max_cells = 64}, {.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 8});
    check_refused(narrow, bytes, Errc::state_mismatch, stream);
    CellLowest fewer({.max_write = 8, .max_cells = 64}, {.layers = 2, .heads_kv = 1, .head_dim = 128, .heads_q = 8});
    check_refused(fewer, bytes, Errc::state_mismatch, stream);
    gpu::DeviceCache<layout::cell, Bf, Windows<0, 5>, placement::lowest_free, 8> windows({.max_write = 8, .max_cells = 64},
                                                                                         kShape);
    check_refused(windows, bytes, Errc::state_mismatch, stream);
  }
  SUBCASE("too large, no free sequence, no free cells, holes in the sequence layout") {
    CellLowest small({.max_write = 8, .max_cells = 10}, kShape);  // 12 positions never fit
    check_refused(small, bytes, Errc::state_too_large, stream);
    Slots short_slots({.max_write = 8, .max_seqs = 2, .max_len = 15}, kShape);  // length 16 > 15
    check_refused(short_slots, bytes, Errc::state_too_large, stream);
    Slots slots({.max_write = 8, .max_seqs = 2, .max_len = 20}, kShape);
    check_refused(slots, bytes, Errc::unsupported_by_layout, stream);
    gpu::DeviceCache<layout::cell, Bf, Model, placement::lowest_free, 8> one({.max_write = 8, .max_cells = 64, .max_seqs = 1},
                                                                             kShape);
    REQUIRE(one.seq_new().ok());
    check_refused(one, bytes, Errc::no_free_sequence, stream);
    CellLowest full({.max_write = 8, .max_cells = 16}, kShape);
    const std::int32_t f = full.seq_new().value();
    run_step(full, {f, f, f, f, f, f, f, f}, Inputs(8, rng), stream);  // 8 free cells < 12
    check_refused(full, bytes, Errc::out_of_cells, stream);
  }
  SUBCASE("rows the device does not hold yet: an open step, a pending fork copy") {
    REQUIRE(src.cache.declare_step(std::vector<std::int32_t>{src.seq}).ok());
    CHECK(gpu::save_sequence(src.cache, src.seq, kTag, stream).status() == Errc::rows_pending);  // declared
    REQUIRE(src.cache.upload(stream).ok());
    CHECK(gpu::save_sequence(src.cache, src.seq, kTag, stream).status() == Errc::rows_pending);  // not committed
    CHECK(gpu::save_sequence(src.cache, src.other, kTag, stream).ok());  // the step does not write `other`
    REQUIRE(src.cache.commit(stream).ok());
    CHECK(gpu::save_sequence(src.cache, src.seq, kTag, stream).ok());
    // Moved cells wait for their K re-rotation until the next upload.
    REQUIRE(src.cache.set_key_rotation(gpu::KeyRotation<Bf>::none()).ok());
    REQUIRE(src.cache.seq_add(src.seq, 8, -1, 4).ok());  // 8..16 -> 12..20
    CHECK(gpu::save_sequence(src.cache, src.seq, kTag, stream).status() == Errc::rows_pending);
    CHECK(gpu::save_sequence(src.cache, src.other, kTag, stream).ok());
    run_step(src.cache, {src.other}, Inputs(1, rng), stream);
    CHECK(gpu::save_sequence(src.cache, src.seq, kTag, stream).ok());

    Slots slots({.max_write = 8, .max_seqs = 4, .max_len = 20}, kShape);
    const std::int32_t a = slots.seq_new().value();
    run_step(slots, {a, a, a, a}, Inputs(4, rng), stream);
    const auto dense = gpu::save_sequence(slots, a, kTag, stream).value();
    const std::int32_t fork = slots.seq_clone(a).value();  // its rows are copied by the next upload
    CHECK(gpu::save_sequence(slots, fork, kTag, stream).status() == Errc::rows_pending);
    check_refused(slots, dense, Errc::rows_pending, stream);
    run_step(slots, {a}, Inputs(1, rng), stream);
    CHECK(gpu::save_sequence(slots, fork, kTag, stream).value() == dense);
    CHECK(gpu::restore_sequence(slots, dense, kTag, stream).ok());
  }
  SUBCASE("save: ids") {
    CHECK(gpu::save_sequence(dst, 5, kTag, stream).status() == Errc::sequence_not_live);
    CHECK(gpu::save_sequence(dst, 99, kTag, stream).status() == Errc::bad_sequence_id);
  }
  require_device_ok();
}

TEST_CASE("device state: host-pool states restore on the device and device states on the host, byte for byte") {
  gpu::Stream stream;
  std::mt19937_64 rng(9);
  // Host: a cell cache and a bf16 host pool of random rows; sequence s holds 0..2 and 5..9.
  CellCache<Model, placement::lowest_free, 8> hcache({.max_write = 16, .max_cells = 40});
  HostPool<Bf> hpool(Model::kLayers, 40, kHeadsKv, kDim);
  for (std::int32_t l = 0; l < Model::kLayers; ++l) {
    const PoolView<Bf> v = hpool.view(l);
    const auto k_rows = random_values<Bf>(static_cast<std::size_t>(40 * hpool.row_elems()), rng);
    const auto v_rows = random_values<Bf>(k_rows.size(), rng);
    std::copy(k_rows.begin(), k_rows.end(), v.k);
    std::copy(v_rows.begin(), v_rows.end(), v.v);
  }
  const std::int32_t a = hcache.seq_new().value(), s = hcache.seq_new().value();
  REQUIRE(test::declare(hcache, {a, s, s, a, s, s, s, s, s, s, s, s}).ok());
  REQUIRE(hcache.seq_rm(s, 3, 5).ok());
  const auto host_bytes = cellkv::save_sequence(hcache, hpool, s, kTag).value();

  CellClustered device({.max_write = 8, .max_cells = 64}, kShape);
  fill_noise(device.pool(), rng);
  const std::int32_t d = gpu::restore_sequence(device, host_bytes, kTag, stream).value();
  const std::vector<std::int32_t> host_held = hcache.held_positions(s).value();
  for (const std::int32_t p : host_held)
    for (std::int32_t l = 0; l < Model::kLayers; ++l)
      for (std::int32_t kv = 0; kv < 2; ++kv) {
        const PoolView<Bf> v = hpool.view(l);
        const Bf* want = (kv == 0 ? v.k : v.v) + hcache.row_of(s, p) * hpool.row_elems();
        const auto got = device_row(device, l, kv, device.host().row_of(d, p));
        CAPTURE(p);
        CHECK(std::memcmp(got.data(), want, got.size() * 2) == 0);
      }
  CHECK(gpu::save_sequence(device, d, kTag, stream).value() == host_bytes);

  // Device -> host: the rows a device step wrote come back in a host pool.
  CellSource src;
  const auto device_bytes = gpu::save_sequence(src.cache, src.seq, kTag, src.stream).value();
  SequenceCache<Model, 8> hslots({.max_write = 8, .max_len = 16});
  HostPool<Bf> spool(Model::kLayers, hslots.capacity(), kHeadsKv, kDim);
  CHECK(cellkv::restore_sequence(hslots, spool, device_bytes, kTag).status() == Errc::unsupported_by_layout);  // holes
  CellCache<Model, placement::clustered<4>, 8> hcells({.max_write = 8, .max_cells = 32});
  HostPool<Bf> cpool(Model::kLayers, 32, kHeadsKv, kDim);
  const std::int32_t h = cellkv::restore_sequence(hcells, cpool, device_bytes, kTag).value();
  const std::vector<std::int32_t> restored_held = hcells.held_positions(h).value();
  for (const std::int32_t p : restored_held)
    for (std::int32_t l = 0; l < Model::kLayers; ++l) {
      const PoolView<Bf> v = cpool.view(l);
      const auto want = device_row(src.cache, l, 0, src.cache.host().row_of(src.seq, p));
      CAPTURE(p);
      CHECK(std::memcmp(v.k + hcells.row_of(h, p) * cpool.row_elems(), want.data(), want.size() * 2) == 0);
    }
  CHECK(cellkv::save_sequence(hcells, cpool, h, kTag).value() == device_bytes);
  require_device_ok();
}

TEST_CASE("device state: a sharded cache (2 shards on one GPU) saves and restores every head") {
  using Sharded = gpu::ShardedCache<layout::cell, Bf, Model, placement::clustered<16>, 8>;
  CellSource src;
  const auto bytes = gpu::save_sequence(src.cache, src.seq, kTag, src.stream).value();
  Sharded sharded({.max_write = 8, .max_cells = 64}, kShape, std::vector<int>{0, 0});
  std::vector<std::unique_ptr<gpu::Stream>> streams;
  for (int g = 0; g < 2; ++g) streams.push_back(std::make_unique<gpu::Stream>());
  const std::vector<::cuda::stream_ref> refs{streams[0]->ref(), streams[1]->ref()};
  CHECK(gpu::restore_sequence(sharded, bytes, kTag, std::span(refs).first(1)).status() == Errc::bad_shape);
  const std::int32_t id = gpu::restore_sequence(sharded, bytes, kTag, refs).value();
  // Shard g holds KV head g of every row.
  const std::vector<std::int32_t> held = sharded.host().held_positions(id).value();
  for (const std::int32_t p : held)
    for (std::int32_t g = 0; g < 2; ++g)
      for (std::int32_t l = 0; l < Model::kLayers; ++l)
        for (std::int32_t kv = 0; kv < 2; ++kv) {
          const auto whole = device_row(src.cache, l, kv, src.cache.host().row_of(src.seq, p));
          const auto part = device_row(sharded.shard(g), l, kv, sharded.host().row_of(id, p));
          CAPTURE(p);
          CHECK(std::equal(part.begin(), part.end(), whole.begin() + g * kDim));
        }
  CHECK(gpu::save_sequence(sharded, id, kTag, std::span(refs).first(1)).status() == Errc::bad_shape);
  CHECK(gpu::save_sequence(sharded, id, kTag, refs).value() == bytes);
  CHECK(gpu::save_sequence(sharded, id, kTag, refs, 1).value() == bytes);  // one layer at a time
  const std::int32_t again = gpu::restore_sequence(sharded, bytes, kTag, refs, 1).value();
  CHECK(gpu::save_sequence(sharded, again, kTag, refs).value() == bytes);
  // And back into a one-GPU cache.
  CellLowest one({.max_write = 8, .max_cells = 64}, kShape);
  const std::int32_t back = gpu::restore_sequence(one, gpu::save_sequence(sharded, id, kTag, refs).value(), kTag, src.stream).value();
  CHECK(gpu::save_sequence(one, back, kTag, src.stream).value() == bytes);
  require_device_ok();
}

// ---- fp8 caches (Fp8<bf16>): codes and scales ----

namespace {

using Fp8Bf = gpu::Fp8<Bf>;
using Fp8Cell = gpu::DeviceCache<layout::cell, Fp8Bf, Model, placement::lowest_free, 8>;
using Fp8Clustered = gpu::DeviceCache<layout::cell, Fp8Bf, Model, placement::clustered<16>, 16>;
const std::uint32_t kFp8Tag = gpu::state_dtype<Fp8Bf>();

// Every code and every scale of an fp8 device pool (scratch rows included), as bytes.
template <class Pool>
std::vector<std::byte> fp8_pool_bits(const Pool& pool) {
  const auto codes = pool.storage();
  const auto scales = pool.scale_storage();
  std::vector<std::byte> out(codes.size_bytes() + scales.size_bytes());
  REQUIRE(cudaMemcpy(out.data(), codes.data(), codes.size_bytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(out.data() + codes.size_bytes(), scales.data(), scales.size_bytes(), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  return out;
}

// Fills an fp8 pool with noise: finite codes (no 0x7F / 0xFF) and scales in [0.01, 2), so rows no
// step wrote differ from any saved row.
template <class Pool>
void fill_fp8_noise(const Pool& pool, std::mt19937_64& rng) {
  const auto codes = pool.storage();
  const auto scales = pool.scale_storage();
  std::vector<Fp8E4M3> c(codes.size());
  for (Fp8E4M3& x : c) x = Fp8E4M3{static_cast<std::uint8_t>((rng() % 0x7F) | (rng() % 2 != 0 ? 0x80 : 0))};
  std::uniform_real_distribution<float> u(0.01f, 2.0f);
  std::vector<float> s(scales.size());
  for (float& x : s) x = u(rng);
  REQUIRE(cudaMemcpy(codes.data(), c.data(), codes.size_bytes(), cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(scales.data(), s.data(), scales.size_bytes(), cudaMemcpyHostToDevice) == cudaSuccess);
}

// Row `row` of layer l's K (kv 0) or V (kv 1) codes, and of its scales, in a device cache or shard.
template <class Cache>
std::vector<std::uint8_t> code_row(const Cache& cache, std::int32_t layer, std::int32_t kv, std::int64_t row) {
  const auto view = cache.pool().view(layer);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(view.row_elems()));
  REQUIRE(cudaMemcpy(out.data(), (kv == 0 ? view.k : view.v) + view.offset(row, 0), out.size(), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  return out;
}
template <class Cache>
std::vector<float> scale_row(const Cache& cache, std::int32_t layer, std::int32_t kv, std::int64_t row) {
  const auto view = cache.pool().view(layer);
  std::vector<float> out(static_cast<std::size_t>(view.heads_kv));
  REQUIRE(cudaMemcpy(out.data(), (kv == 0 ? view.k_scale : view.v_scale) + view.scale_offset(row, 0),
                     out.size() * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  return out;
}

// SourceWithHole over an fp8 cache: every row of `seq` quantized by real steps.
struct Fp8Source : SourceWithHole<Fp8Cell> {
  Fp8Source() : SourceWithHole(17, [](const auto& pool, std::mt19937_64& rng) { fill_fp8_noise(pool, rng); }) {}
};

// Position p's codes and scales in x (sequence a) equal those in y (sequence b), every layer, bit for bit.
template <class X, class Y>
void same_fp8_rows(const X& x, std::int32_t a, const Y& y, std::int32_t b) {
  const std::vector<std::int32_t> held = x.host().held_positions(a).value();
  REQUIRE(y.host().held_positions(b).value() == held);
  for (const std::int32_t p : held)
    for (std::int32_t l = 0; l < Model::kLayers; ++l)
      for (std::int32_t kv = 0; kv < 2; ++kv) {
        CAPTURE(p);
        CHECK(code_row(x, l, kv, x.host().row_of(a, p)) == code_row(y, l, kv, y.host().row_of(b, p)));
        const auto sx = scale_row(x, l, kv, x.host().row_of(a, p)), sy = scale_row(y, l, kv, y.host().row_of(b, p));
        CHECK(std::memcmp(sx.data(), sy.data(), sx.size() * sizeof(float)) == 0);
      }
}

// The next steps of `a` in x and `b` in y (a decode token, then a 3-token chunk) with equal inputs
// give outputs within 2% of each other: the placements differ, and with them where the decode
// kernel's parts split a sequence's tiles.
template <class X, class Y>
void close_attention(X& x, std::int32_t a, Y& y, std::int32_t b, const gpu::Stream& stream, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto close = [](const std::vector<std::uint16_t>& p, const std::vector<std::uint16_t>& q) {
    REQUIRE(p.size() == q.size());
    auto value = [](std::uint16_t bits) { return static_cast<double>(std::bit_cast<float>(std::uint32_t{bits} << 16)); };
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double du = value(p[i]), dw = value(q[i]);
      CAPTURE(i);
      REQUIRE(std::abs(du - dw) <= 2e-2 * std::max(std::abs(dw), 1e-2));
    }
  };
  const Inputs decode(1, rng);
  close(run_step(x, {a}, decode, stream), run_step(y, {b}, decode, stream));
  const Inputs chunk(3, rng);
  close(run_step(x, {a, a, a}, chunk, stream), run_step(y, {b, b, b}, chunk, stream));
}

// The restore is refused with `want`; neither the host cache nor the codes and scales change.
template <class Cache>
void check_fp8_refused(Cache& cache, std::span<const std::byte> bytes, Errc want, const gpu::Stream& stream,
                       std::uint32_t tag) {
  const auto before = cache.host();
  const auto pool_before = fp8_pool_bits(cache.pool());
  CHECK(gpu::restore_sequence(cache, bytes, tag, stream).status() == want);
  CHECK(cache.host() == before);
  CHECK(fp8_pool_bits(cache.pool()) == pool_before);
}

}  // namespace

TEST_CASE("device state fp8: codes and scales of a sequence with holes restore bit for bit; attention agrees; host fp8 pools read and write the same bytes") {
  Fp8Source src;
  CHECK(kFp8Tag == 3);
  CHECK(gpu::state_dtype<gpu::Fp8<__half>>() == kFp8Tag);
  const auto bytes = gpu::save_sequence(src.cache, src.seq, kFp8Tag, src.stream).value();
  const std::size_t held = 12;
  CHECK(bytes.size() == kStateHeaderBytes + 4 * held + 2 * Model::kLayers * held * (kHeadsKv * kDim + sizeof(float) * kHeadsKv));
  // The saved codes and scales are the pool's, position by position (the state's own layout).
  const StateShape shape = gpu::device_state_shape<Fp8Cell, Fp8Bf>(kShape, kFp8Tag);
  CHECK(shape.storage == StateStorage::fp8_e4m3);
  CHECK(shape.elem_bytes == 1);
  const SavedState parsed = parse_state(bytes, shape, 96, 96).value();
  for (std::int32_t l = 0; l < Model::kLayers; ++l)
    for (std::int32_t kv = 0; kv < 2; ++kv)
      for (std::size_t i = 0; i < parsed.positions.size(); ++i) {
        const std::int64_t row = src.cache.host().row_of(src.seq, parsed.positions[i]);
        const auto codes = code_row(src.cache, l, kv, row);
        const auto scales = scale_row(src.cache, l, kv, row);
        CHECK(std::memcmp(parsed.row(l, kv, i).data(), codes.data(), codes.size()) == 0);
        CHECK(std::memcmp(parsed.scale_row(l, kv, i).data(), scales.data(), scales.size() * sizeof(float)) == 0);
      }
  CHECK(gpu::save_sequence(src.cache, src.seq, src.stream).value() == bytes);         // the natural tag
  CHECK(gpu::save_sequence(src.cache, src.seq, kFp8Tag, src.stream, 1).value() == bytes);  // one layer at a time

  Fp8Clustered dst({.max_write = 8, .max_cells = 200}, kShape);
  std::mt19937_64 rng(13);
  fill_fp8_noise(dst.pool(), rng);
  const std::int32_t busy = dst.seq_new().value();
  run_step(dst, {busy, busy, busy, busy, busy}, Inputs(5, rng), src.stream);
  const std::int32_t id = gpu::restore_sequence(dst, bytes, kFp8Tag, src.stream).value();
  CHECK(dst.host().pos(id).value() == 16);
  same_fp8_rows(src.cache, src.seq, dst, id);
  CHECK(gpu::save_sequence(dst, id, kFp8Tag, src.stream).value() == bytes);
  Fp8Cell layered({.max_write = 8, .max_cells = 64}, kShape);
  const std::int32_t by_layer = gpu::restore_sequence(layered, bytes, kFp8Tag, src.stream, 1).value();
  same_fp8_rows(src.cache, src.seq, layered, by_layer);

  // Device -> host fp8 pool -> device: the same codes, scales and bytes.
  CellCache<Model, placement::clustered<4>, 8> hcells({.max_write = 8, .max_cells = 32});
  HostFp8Pool hpool(Model::kLayers, 32, kHeadsKv, kDim);
  const std::int32_t h = cellkv::restore_sequence(hcells, hpool, bytes, kFp8Tag).value();
  const std::vector<std::int32_t> host_held = hcells.held_positions(h).value();
  for (const std::int32_t p : host_held)
    for (std::int32_t l = 0; l < Model::kLayers; ++l) {
      const Fp8PoolView<Fp8E4M3> v = hpool.view(l);
      const std::int64_t row = hcells.row_of(h, p);
      const auto codes = code_row(src.cache, l, 1, src.cache.host().row_of(src.seq, p));
      const auto scales = scale_row(src.cache, l, 1, src.cache.host().row_of(src.seq, p));
      CAPTURE(p);
      CHECK(std::memcmp(v.v + v.offset(row, 0), codes.data(), codes.size()) == 0);
      CHECK(std::memcmp(v.v_scale + v.scale_offset(row, 0), scales.data(), scales.size() * sizeof(float)) == 0);
    }
  const auto host_bytes = cellkv::save_sequence(hcells, hpool, h, kFp8Tag).value();
  CHECK(host_bytes == bytes);
  Fp8Cell back({.max_write = 8, .max_cells = 64}, kShape);
  const std::int32_t b = gpu::restore_sequence(back, host_bytes, kFp8Tag, src.stream).value();
  same_fp8_rows(src.cache, src.seq, back, b);
  close_attention(src.cache, src.seq, dst, id, src.stream, 41);  // last: it moves both sequences on
  require_device_ok();
}

TEST_CASE("device state fp8: a sharded cache (2 shards on one GPU) carries each shard's codes and scales; the bytes equal a one-GPU cache's") {
  using Sharded = gpu::ShardedCache<layout::cell, Fp8Bf, Model, placement::clustered<16>, 8>;
  Fp8Source src;
  const auto bytes = gpu::save_sequence(src.cache, src.seq, kFp8Tag, src.stream).value();
  Sharded sharded({.max_write = 8, .max_cells = 64}, kShape, std::vector<int>{0, 0});
  std::mt19937_64 rng(19);
  for (std::int32_t g = 0; g < 2; ++g) fill_fp8_noise(sharded.shard(g).pool(), rng);
  std::vector<std::unique_ptr<gpu::Stream>> streams;
  for (int g = 0; g < 2; ++g) streams.push_back(std::make_unique<gpu::Stream>());
  const std::vector<::cuda::stream_ref> refs{streams[0]->ref(), streams[1]->ref()};
  const std::int32_t id = gpu::restore_sequence(sharded, bytes, kFp8Tag, refs).value();
  // Shard g holds KV head g of every row: its codes and its scale.
  const std::vector<std::int32_t> held = sharded.host().held_positions(id).value();
  for (const std::int32_t p : held)
    for (std::int32_t g = 0; g < 2; ++g)
      for (std::int32_t l = 0; l < Model::kLayers; ++l)
        for (std::int32_t kv = 0; kv < 2; ++kv) {
          const std::int64_t whole_row = src.cache.host().row_of(src.seq, p), part_row = sharded.host().row_of(id, p);
          const auto whole = code_row(src.cache, l, kv, whole_row);
          const auto part = code_row(sharded.shard(g), l, kv, part_row);
          const auto whole_scales = scale_row(src.cache, l, kv, whole_row);
          const auto part_scales = scale_row(sharded.shard(g), l, kv, part_row);
          CAPTURE(p);
          REQUIRE(part.size() == static_cast<std::size_t>(kDim));
          REQUIRE(part_scales.size() == 1);
          CHECK(std::equal(part.begin(), part.end(), whole.begin() + g * kDim));
          CHECK(std::memcmp(&part_scales[0], &whole_scales[static_cast<std::size_t>(g)], sizeof(float)) == 0);
        }
  CHECK(gpu::save_sequence(sharded, id, kFp8Tag, refs).value() == bytes);
  CHECK(gpu::save_sequence(sharded, id, kFp8Tag, refs, 1).value() == bytes);  // one layer at a time
  const std::int32_t again = gpu::restore_sequence(sharded, bytes, kFp8Tag, refs, 1).value();
  CHECK(gpu::save_sequence(sharded, again, kFp8Tag, refs).value() == bytes);
  // And back into a one-GPU cache.
  Fp8Cell one({.max_write = 8, .max_cells = 64}, kShape);
  const std::int32_t back = gpu::restore_sequence(one, gpu::save_sequence(sharded, id, kFp8Tag, refs).value(), kFp8Tag, src.stream).value();
  same_fp8_rows(src.cache, src.seq, one, back);
  CHECK(gpu::save_sequence(one, back, kFp8Tag, src.stream).value() == bytes);
  require_device_ok();
}

TEST_CASE("device state fp8: a state of the other storage is refused (state_mismatch), changing nothing") {
  Fp8Source src;
  const auto fp8_bytes = gpu::save_sequence(src.cache, src.seq, kFp8Tag, src.stream).value();
  CellSource bf16_src;
  const auto bf16_bytes = gpu::save_sequence(bf16_src.cache, bf16_src.seq, kTag, bf16_src.stream).value();
  const gpu::Stream& stream = src.stream;
  std::mt19937_64 rng(23);

  // A bf16 state into an fp8 cache: under bf16's tag, fp8's tag, and the natural overload.
  Fp8Clustered fp8({.max_write = 8, .max_cells = 64}, kShape);
  fill_fp8_noise(fp8.pool(), rng);
  const std::int32_t busy = fp8.seq_new().value();
  run_step(fp8, {busy, busy, busy}, Inputs(3, rng), stream);
  check_fp8_refused(fp8, bf16_bytes, Errc::state_mismatch, stream, kTag);
  check_fp8_refused(fp8, bf16_bytes, Errc::state_mismatch, stream, kFp8Tag);
  {
    const auto before = fp8.host();
    const auto pool_before = fp8_pool_bits(fp8.pool());
    CHECK(gpu::restore_sequence(fp8, bf16_bytes, stream).status() == Errc::state_mismatch);
    CHECK(fp8.host() == before);
    CHECK(fp8_pool_bits(fp8.pool()) == pool_before);
  }
  // An fp8 state into a bf16 cache, the same three ways.
  CellClustered bf16({.max_write = 8, .max_cells = 64}, kShape);
  fill_noise(bf16.pool(), rng);
  const std::int32_t b = bf16.seq_new().value();
  run_step(bf16, {b, b, b}, Inputs(3, rng), stream);
  check_refused(bf16, fp8_bytes, Errc::state_mismatch, stream, kTag);
  check_refused(bf16, fp8_bytes, Errc::state_mismatch, stream, kFp8Tag);
  {
    const auto before = bf16.host();
    const auto pool_before = pool_bits(bf16.pool());
    CHECK(gpu::restore_sequence(bf16, fp8_bytes, stream).status() == Errc::state_mismatch);
    CHECK(bf16.host() == before);
    CHECK(pool_bits(bf16.pool()) == pool_before);
  }
  // Another tag, shape or window set; a flipped scale byte.
  check_fp8_refused(fp8, fp8_bytes, Errc::state_mismatch, stream, kTag);
  Fp8Cell narrow({.max_write = 8, .max_cells = 64}, {.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 8});
  check_fp8_refused(narrow, fp8_bytes, Errc::state_mismatch, stream, kFp8Tag);
  gpu::DeviceCache<layout::cell, Fp8Bf, Windows<0, 5>, placement::lowest_free, 8> windows({.max_write = 8, .max_cells = 64},
                                                                                            kShape);
  check_fp8_refused(windows, fp8_bytes, Errc::state_mismatch, stream, kFp8Tag);
  auto bad = fp8_bytes;
  bad[bad.size() - 2] ^= std::byte{0x04};  // inside the last V scale
  check_fp8_refused(fp8, bad, Errc::state_corrupt, stream, kFp8Tag);
  check_fp8_refused(fp8, std::span<const std::byte>(fp8_bytes.data(), fp8_bytes.size() - 1), Errc::state_truncated, stream,
                    kFp8Tag);

  // Fp8<fp16> stores what Fp8<bf16> stores: the natural tag moves the state between them.
  gpu::DeviceCache<layout::cell, gpu::Fp8<__half>, Model, placement::lowest_free, 8> half({.max_write = 8, .max_cells = 64},
                                                                                          kShape);
  const std::int32_t h = gpu::restore_sequence(half, fp8_bytes, stream).value();
  same_fp8_rows(src.cache, src.seq, half, h);
  CHECK(gpu::save_sequence(half, h, stream).value() == fp8_bytes);
  // And the fp8 cache takes it once the storage agrees.
  CHECK(gpu::restore_sequence(fp8, fp8_bytes, kFp8Tag, stream).ok());
  require_device_ok();
}
