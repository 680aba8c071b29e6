// Window storage on the device (CacheConfig::window_cells > 0): the layers of each nonzero window
// keep a window-sized pool, table and rows of their own.
//   - random traffic with forks, removals, rewinds, context shifts and refusals against the float64
//     host reference (its pools sized and written as the host cache's pools; each pool's copies and
//     K re-rotations mirrored), table kernels with shared prefixes and the reference kernel, padded
//     widths, a captured graph replayed across steps;
//   - a twin with full storage, fed the same steps and inputs: the table kernels read positions in
//     the same order from either, so outputs match bit for bit (bf16, fp16, fp8 with a static scale
//     per layer, which each pool takes for its own layers);
//   - the pools allocated are the footprint's; refusals.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/graph.hpp"
#include "cellkv/gpu/sequence_state.cuh"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/rope.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;

const RopeSpec kRope{.theta = 10000.0};

template <class Cache>
std::vector<std::int32_t> live_ids(const Cache& cache) {
  std::vector<std::int32_t> ids;
  cache.host().live_sequences().for_each([&](std::int32_t s) { ids.push_back(s); });
  return ids;
}

// One random verb or none; refusals (window_evicted, no cells, no free sequence) are traffic too.
template <class Cache>
void random_verb(Cache& cache, std::mt19937_64& rng) {
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  const std::vector<std::int32_t> ids = live_ids(cache);
  if (ids.empty()) return;
  const std::int32_t s = ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))];
  const std::int32_t other = ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))];
  const std::int32_t end = cache.host().pos(s).value();
  const std::int32_t p0 = pick(end + 1), p1 = p0 + pick(end - p0 + 1);
  const std::int32_t recent = end - pick(std::min(end, 24) + 1);  // a position still in every window pool
  switch (pick(15)) {
    case 0: case 1: (void)cache.seq_new(); break;
    case 2: case 3: (void)cache.seq_clone(s); break;           // a fork at the end: shares everything
    case 4: (void)cache.seq_clone(s, p0); break;               // may need released positions
    case 5: if (ids.size() > 1) (void)cache.seq_rm(s); break;
    case 6: (void)cache.rewind(s, std::max(0, end - pick(12))); break;
    case 7: (void)cache.seq_rm(s, p0, p1); break;
    case 8:  // a context shift: drop a range, slide the rest down
      if (cache.seq_rm(s, p0, p1).ok()) (void)cache.seq_add(s, p1, -1, p0 - p1);
      break;
    case 9: (void)cache.seq_cp(s, other, p0, p1); break;
    case 10: (void)cache.seq_add(s, p0, -1, pick(20)); break;
    case 11:  // a fork, then a shift of the source's recent positions: shared cells are copied on write
      if (cache.seq_clone(s).ok() && cache.seq_rm(s, recent, std::min(end, recent + 4)).ok())
        (void)cache.seq_add(s, std::min(end, recent + 4), -1, recent - std::min(end, recent + 4));
      break;
    default: break;
  }
}

// Declares a step of 1..max_width tokens of live sequences, removing sequences until one fits
// (window pools refuse steps they lack cells for). Returns T.
template <class Cache>
std::int32_t declare_random_step(Cache& cache, std::int32_t max_width, std::mt19937_64& rng) {
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  for (;;) {
    if (live_ids(cache).empty()) REQUIRE(cache.seq_new().ok());
    const std::vector<std::int32_t> ids = live_ids(cache);
    std::vector<std::int32_t> step(static_cast<std::size_t>(1 + pick(max_width)));
    for (auto& s : step) s = ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))];
    if (cache.declare_step(step).ok()) return static_cast<std::int32_t>(step.size());
    REQUIRE(cache.seq_rm(ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))]).ok());
  }
}

// Positions the live sequences hold in the main pool: past window_cells, the window pools could
// not hold them all without releasing cells.
template <class Cache>
std::int64_t held_positions(const Cache& cache) {
  std::int64_t n = 0;
  for (const std::int32_t s : live_ids(cache)) n += static_cast<std::int64_t>(cache.host().held_positions(s).value().size());
  return n;
}

constexpr std::int32_t kMaxWrite = 32;
const CacheConfig kConfig{.max_write = kMaxWrite, .max_cells = 1600, .max_seqs = 8, .window_cells = 400};

struct RunOptions {
  gpu::KernelChoice kernels = gpu::KernelChoice::automatic;
  bool padded = false;  // widths past T (padding rows write the scratch rows and must come out zero)
  bool graph = false;   // one graph captured at max_write, replayed for every later step
  bool long_run = true;  // checks that the traffic filled the window pools and copied / moved their cells
};

template <class Cache>
void random_run(std::int32_t heads_q, std::int32_t heads_kv, std::int32_t head_dim, std::uint64_t seed, int steps,
                RunOptions options = {}) {
  using T = typename Cache::Element;
  Cache cache(kConfig, {.layers = Cache::Windows::kLayers, .heads_kv = heads_kv, .head_dim = head_dim, .heads_q = heads_q});
  cache.use_kernels(options.kernels);
  REQUIRE(cache.set_key_rotation(gpu::KeyRotation<typename Cache::Storage>::rope(kRope)).ok());
  ForwardHarness<Cache> harness(cache, heads_q, kMaxWrite);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  std::optional<gpu::GraphExec> graph;
  std::int64_t most_held = 0, copies = 0, rotations = 0;
  for (int step = 0; step < steps; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    for (int v = static_cast<int>(rng() % 3); v > 0; --v) random_verb(cache, rng);
    const std::int32_t T_tokens = declare_random_step(cache, kMaxWrite, rng);
    for (const std::int32_t w : Cache::Windows::kWindowed) {
      copies += static_cast<std::int64_t>(cache.host().pool(w).pending_changes().copies.size());
      rotations += static_cast<std::int64_t>(cache.host().pool(w).pending_changes().rotations.size());
    }
    harness.mirror_pending_changes(&kRope);
    const std::int32_t width = options.graph ? kMaxWrite
                               : options.padded ? T_tokens + static_cast<std::int32_t>(rng() % (kMaxWrite - T_tokens + 1))
                                                : T_tokens;
    harness.new_inputs(width, rng);
    REQUIRE(cache.upload(stream, width).ok());
    if (options.graph && !graph) graph.emplace(gpu::capture(stream, [&] { harness.device_forward(width, stream); }));
    if (graph) REQUIRE(graph->replay(stream).ok());
    else harness.device_forward(width, stream);
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    CHECK(harness.check_against_reference() <= tolerance<T>());
    CHECK(harness.padding_rows_are_zero(width));
    most_held = std::max(most_held, held_positions(cache));
  }
  // The traffic did what it is for: more positions held than a window pool has cells, and the
  // window pools' own copies on write and re-rotations ran.
  if (options.long_run) {
    CHECK(most_held > kConfig.window_cells);
    CHECK(copies > 0);
    CHECK(rotations > 0);
  }
  require_device_ok();
}

template <class T, class W, class P = placement::clustered<64>>
using Cells = gpu::DeviceCache<layout::cell, T, W, P, 8>;
using TwoPools = Windows<0, 40, 0, 16, 40>;  // a full layer first, windows 40 and 16 interleaved
using AllWindowed = Windows<24, 24>;        // no full-attention layer: the main pool has no device rows

}  // namespace

TEST_CASE("window storage on the device: random forks, edits and refusals match the float64 host reference") {
  SUBCASE("bf16, D 128, GQA 4, table kernels") { random_run<Cells<__nv_bfloat16, TwoPools>>(16, 4, 128, 1601, 60); }
  SUBCASE("fp16, D 64, GQA 8, lowest_free, padded widths") {
    random_run<Cells<__half, TwoPools, placement::lowest_free>>(16, 2, 64, 1602, 50, {.padded = true});
  }
  SUBCASE("bf16, D 256, every layer windowed") { random_run<Cells<__nv_bfloat16, AllWindowed>>(4, 4, 256, 1603, 60); }
  SUBCASE("the reference kernel (dense masks per pool)") {
    random_run<Cells<__nv_bfloat16, TwoPools>>(8, 2, 128, 1604, 40, {.kernels = gpu::KernelChoice::reference});
  }
  SUBCASE("one graph replayed across steps") { random_run<Cells<__nv_bfloat16, TwoPools>>(8, 2, 128, 1605, 50, {.graph = true}); }
}

TEST_CASE("window storage on the device: a short run of each kernel path (the sanitizers' case)") {
  random_run<Cells<__nv_bfloat16, TwoPools>>(8, 2, 128, 1606, 8, {.padded = true, .long_run = false});
  random_run<Cells<__nv_bfloat16, TwoPools>>(8, 2, 64, 1607, 6, {.kernels = gpu::KernelChoice::reference, .long_run = false});
}

namespace {

// Two caches fed the same verbs, steps and inputs: `windowed` keeps window pools, `full` does not.
// Shared prefixes off in both (a windowed layer of a full-storage cache would fold shared partials).
template <class Cache>
void twin_run(std::int32_t heads_q, std::int32_t heads_kv, std::int32_t head_dim, std::uint64_t seed, int steps) {
  using In = typename Cache::Element;
  using W = typename Cache::Windows;
  const gpu::PoolShape shape{.layers = W::kLayers, .heads_kv = heads_kv, .head_dim = head_dim, .heads_q = heads_q};
  CacheConfig full_config = kConfig;
  full_config.window_cells = 0;
  Cache windowed(kConfig, shape), full(full_config, shape);
  REQUIRE(windowed.runs_table_kernels());
  for (Cache* c : {&windowed, &full}) c->share_prefixes(false);
  if constexpr (gpu::kFp8Kv<typename Cache::Storage>) {
    Fp8Config scales{Fp8Scaling::static_per_layer, {}};
    for (std::int32_t l = 0; l < W::kLayers; ++l) scales.static_scales.push_back({0.004f * (l + 1), 0.003f * (l + 2)});
    for (Cache* c : {&windowed, &full}) REQUIRE(c->set_fp8_config(scales).ok());
  }
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  const auto row = static_cast<std::size_t>(heads_q) * static_cast<std::size_t>(head_dim);
  const auto kv_row = static_cast<std::size_t>(heads_kv) * static_cast<std::size_t>(head_dim);
  DeviceArray<In> q(kMaxWrite * row), k(kMaxWrite * kv_row), v(kMaxWrite * kv_row);
  DeviceArray<In> out_w(W::kLayers * kMaxWrite * row), out_f(out_w.buf.size());
  std::int64_t compared = 0;
  for (int step = 0; step < steps; ++step) {
    CAPTURE(step);
    std::vector<std::int32_t> ids = live_ids(windowed);
    // The same verb on both, always accepted by both: new, a fork at the end, a whole removal.
    const std::int32_t verb = pick(6);
    if (ids.empty() || verb == 0) {
      const Result<std::int32_t> a = windowed.seq_new(), b = full.seq_new();  // both out of ids, or the same id
      REQUIRE(a.ok() == b.ok());
      if (a.ok()) REQUIRE(a.value() == b.value());
    } else if (verb == 1) {
      const std::int32_t s = ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))];
      const Result<std::int32_t> a = windowed.seq_clone(s), b = full.seq_clone(s);
      REQUIRE(a.ok() == b.ok());
    } else if (verb == 2 && ids.size() > 1) {
      const std::int32_t s = ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))];
      REQUIRE(windowed.seq_rm(s).ok());
      REQUIRE(full.seq_rm(s).ok());
    }
    ids = live_ids(windowed);
    std::vector<std::int32_t> seqs(static_cast<std::size_t>(1 + pick(kMaxWrite)));
    for (auto& s : seqs) s = ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))];
    if (!windowed.declare_step(seqs).ok()) {  // a window pool without room: start over with fewer sequences
      REQUIRE(windowed.seq_rm(ids.front()).ok());
      REQUIRE(full.seq_rm(ids.front()).ok());
      continue;
    }
    REQUIRE(full.declare_step(seqs).ok());
    const auto T_tokens = static_cast<std::int32_t>(seqs.size());
    q.upload(random_values<In>(q.buf.size(), rng));
    k.upload(random_values<In>(k.buf.size(), rng));
    v.upload(random_values<In>(v.buf.size(), rng));
    for (auto [cache, out] : {std::pair{&windowed, &out_w}, std::pair{&full, &out_f}}) {
      REQUIRE(cache->upload(stream).ok());
      for (std::int32_t l = 0; l < W::kLayers; ++l)
        REQUIRE(cache->update_and_attend(l, q.data(), k.data(), v.data(), out->data() + l * kMaxWrite * row, T_tokens,
                                         heads_q, 0.f, stream)
                    .ok());
      REQUIRE(cache->commit(stream).ok());
    }
    stream.synchronize();
    const std::vector<In> a = out_w.download(), b = out_f.download();
    for (std::int32_t l = 0; l < W::kLayers; ++l) {
      CAPTURE(l);
      const std::size_t at = static_cast<std::size_t>(l) * kMaxWrite * row;
      CHECK(std::memcmp(a.data() + at, b.data() + at, static_cast<std::size_t>(T_tokens) * row * sizeof(In)) == 0);
    }
    compared += T_tokens;
  }
  CHECK(held_positions(windowed) > 0);
  CHECK(compared > 0);
  require_device_ok();
}

}  // namespace

TEST_CASE("window storage on the device: the table kernels' outputs equal full storage's bit for bit") {
  SUBCASE("bf16, D 128, GQA 4") { twin_run<Cells<__nv_bfloat16, TwoPools>>(16, 4, 128, 1611, 80); }
  SUBCASE("fp16, D 64, GQA 1, lowest_free") { twin_run<Cells<__half, TwoPools, placement::lowest_free>>(4, 4, 64, 1612, 60); }
  SUBCASE("fp8 codes with a static scale per layer") {
    twin_run<Cells<gpu::Fp8<__nv_bfloat16>, TwoPools>>(16, 4, 128, 1613, 60);
  }
}

TEST_CASE("window storage on the device: a failed upload resumes its re-rotations after a new declaration") {
  // Layer 0 reads the main pool, layer 1 a window pool of window 10. Positions 128, 129 move to
  // 130, 131 (held in both pools): each pool lists 2 re-rotations. The upload rotates layer 0, then
  // layer 1 refuses. The step is declared again with the 64 tokens of the failed one placed: the
  // window pool would let go of page 2 (128..191) and with it its moved cells, which would change
  // the pending re-rotations; it keeps the page while the device holds part of them, so the next
  // upload resumes at layer 1 and layer 0 is not rotated twice.
  using Cache = Cells<__nv_bfloat16, Windows<0, 10>, placement::lowest_free>;
  Cache cache({.max_write = 64, .max_cells = 1024, .max_seqs = 8, .window_cells = 256},
              {.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 4});
  gpu::Stream stream;
  std::vector<std::pair<std::int32_t, std::int32_t>> calls;  // (layer, count)
  std::int32_t refuse_layer = -1;
  REQUIRE(cache.set_key_rotation(gpu::KeyRotation<__nv_bfloat16>::custom(
                                     [&](std::int32_t layer, const PoolView<__nv_bfloat16>& pool, const RowRotation*,
                                         std::int32_t count, ::cuda::stream_ref) -> Status {
                                       CHECK(pool.k == cache.view(layer).k);
                                       calls.emplace_back(layer, count);
                                       return layer == refuse_layer ? Status{Errc::bad_argument} : Status{};
                                     }))
              .ok());
  const std::int32_t s = cache.seq_new().value();
  for (const std::int32_t n : {64, 64, 12}) {
    REQUIRE(cache.declare_step(std::vector<std::int32_t>(static_cast<std::size_t>(n), s)).ok());
    REQUIRE(cache.upload(stream).ok());
    REQUIRE(cache.commit(stream).ok());
  }
  REQUIRE(cache.seq_rm(s, 130, 132).ok());
  REQUIRE(cache.seq_add(s, 128, 130, 2).ok());
  REQUIRE(cache.host().pool(10).pending_changes().rotations.size() == 2);
  REQUIRE(cache.host().pending_changes().rotations.size() == 2);
  REQUIRE(cache.declare_step(std::vector<std::int32_t>(64, s)).ok());
  refuse_layer = 1;
  CHECK(cache.upload(stream) == Errc::bad_argument);
  CHECK(calls == std::vector<std::pair<std::int32_t, std::int32_t>>{{0, 2}, {1, 2}});
  CHECK(cache.holds_applied_changes());
  const std::uint64_t epoch = cache.host().changes_epoch();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{s}).ok());  // at 204 the window sees from 195
  CHECK(cache.host().changes_epoch() == epoch);
  CHECK(cache.host().pool(10).pending_changes().rotations.size() == 2);
  CHECK(cache.host().pool(10).cell_of(s, 130) >= 0);  // page 2 kept for now
  refuse_layer = -1;
  calls.clear();
  REQUIRE(cache.upload(stream).ok());
  CHECK(calls == std::vector<std::pair<std::int32_t, std::int32_t>>{{1, 2}});  // layer 0 is not rotated twice
  REQUIRE(cache.commit(stream).ok());
  // Acknowledged at the next verb; then the page goes with the next step's drops.
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{s}).ok());
  CHECK_FALSE(cache.holds_applied_changes());
  CHECK(cache.host().pool(10).cell_of(s, 130) < 0);
  require_device_ok();
}

TEST_CASE("window storage on the device: the pools allocated are the footprint's, window-sized") {
  using Cache = Cells<__nv_bfloat16, TwoPools>;
  const gpu::PoolShape shape{.layers = TwoPools::kLayers, .heads_kv = 2, .head_dim = 128, .heads_q = 8};
  const Footprint f = Cache::footprint(kConfig, shape).value();
  CacheConfig full_config = kConfig;
  full_config.window_cells = 0;
  const Footprint full = Cache::footprint(full_config, shape).value();
  Cache cache(kConfig, shape);
  const gpu::PoolSet<layout::cell, __nv_bfloat16, TwoPools>& pools = cache.pools();
  REQUIRE(pools.count() == 3);  // main, window 40, window 16
  std::size_t bytes = 0;
  for (std::int32_t p = 0; p < pools.count(); ++p) bytes += pools.pool(p)->storage().size_bytes();
  CHECK(bytes == f.kv_pools);
  // Per layer: the full layers max_cells + 1 rows, the windowed ones window_cells + 1.
  const std::size_t row = 2 * std::size_t{2} * 128 * sizeof(__nv_bfloat16);
  CHECK(f.kv_pools == row * (2 * (1600 + 1) + 3 * (400 + 1)));
  CHECK(full.kv_pools == row * 5 * (1600 + 1));
  for (std::int32_t l = 0; l < TwoPools::kLayers; ++l)
    CHECK(cache.view(l).rows == (TwoPools::window_of_layer(l) == 0 ? 1600 : 400));
  require_device_ok();
}

TEST_CASE("window storage on the device: refusals change nothing") {
  using Cache = Cells<__nv_bfloat16, TwoPools>;
  const gpu::PoolShape shape{.layers = TwoPools::kLayers, .heads_kv = 2, .head_dim = 64, .heads_q = 4};
  gpu::Stream stream;
  Cache cache(kConfig, shape);
  const std::int32_t s = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>(8, s)).ok());
  REQUIRE(cache.upload(stream).ok());
  REQUIRE(cache.commit(stream).ok());
  stream.synchronize();
  SUBCASE("saved sequence state: its layers' rows live in several pools") {
    CHECK(gpu::save_sequence(cache, s, stream).status() == Errc::bad_argument);
    CacheConfig full_config = kConfig;
    full_config.window_cells = 0;
    Cache full(full_config, shape);
    const std::int32_t f = full.seq_new().value();
    REQUIRE(full.declare_step(std::vector<std::int32_t>(8, f)).ok());
    REQUIRE(full.upload(stream).ok());
    REQUIRE(full.commit(stream).ok());
    const std::vector<std::byte> state = gpu::save_sequence(full, f, stream).value();
    const auto live_before = live_ids(cache);
    CHECK(gpu::restore_sequence(cache, state, stream).status() == Errc::bad_argument);
    CHECK(live_ids(cache) == live_before);
  }
  SUBCASE("a rewind below what a window pool holds") {
    REQUIRE(cache.declare_step(std::vector<std::int32_t>(32, s)).ok());
    REQUIRE(cache.upload(stream).ok());
    REQUIRE(cache.commit(stream).ok());
    for (int i = 0; i < 4; ++i) {  // 8 + 5 x 32 = 168 positions: page 0 let go
      REQUIRE(cache.declare_step(std::vector<std::int32_t>(32, s)).ok());
      REQUIRE(cache.upload(stream).ok());
      REQUIRE(cache.commit(stream).ok());
    }
    CHECK(cache.rewind(s, 10) == Errc::window_evicted);
    CHECK(cache.host().pos(s).value() == 168);
  }
  SUBCASE("the sequence layout has no window storage") {
    using Slots = gpu::DeviceCache<layout::sequence, __nv_bfloat16, TwoPools, typename layout::sequence::default_placement, 8>;
    const CacheConfig slots{.max_write = 8, .max_seqs = 4, .max_len = 256, .window_cells = 64};
    CHECK(Slots::footprint(slots, shape).status() == Errc::unsupported_by_layout);
    CHECK_THROWS_AS(Slots(slots, shape), std::invalid_argument);
  }
  require_device_ok();
}
