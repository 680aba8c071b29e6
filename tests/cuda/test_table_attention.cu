// The table kernels (decode split evenly over warps and merged in-kernel, prefill by position
// ranges, both reading K/V rows through the position tables) against the float64 host reference
// and the reference kernel on random scenarios: both layouts, four placements (one of them,
// test::after_last, defined in the tests alone: tests/host/after_last_placement.hpp), forks, rewinds,
// removals, refilled holes, windows, long churn near full occupancy, T from 1 to max_write, bf16
// and fp16, head dims 64/128/256, GQA ratios 1, 4 and 8. Padding rows are zeros. Shared prefixes
// of fork trees (read once per step by the shared-prefix kernel) against the same oracles.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/graph.hpp"
#include "cellkv/gpu/stream.hpp"
#include "../host/after_last_placement.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using Model = Windows<0, 40, 0>;

struct Shape {
  std::int32_t heads_q, heads_kv, head_dim, max_write, max_cells;
};

template <class Cache>
Cache make_cache(const Shape& sh, std::int32_t max_seqs) {
  const CacheConfig config{.max_write = sh.max_write, .max_cells = sh.max_cells, .max_seqs = max_seqs,
                           .max_len = (sh.max_cells / max_seqs + 63) / 64 * 64};
  return Cache(config, {.layers = Model::kLayers, .heads_kv = sh.heads_kv, .head_dim = sh.head_dim, .heads_q = sh.heads_q});
}

// One checked step: upload (padded by 0-2 tokens), forward, compare with the host reference.
template <class Cache>
void checked_step(Cache& cache, ForwardHarness<Cache>& harness, std::int32_t T, std::int32_t max_write,
                  std::mt19937_64& rng, gpu::Stream& stream) {
  const std::int32_t width = std::min(max_write, T + static_cast<std::int32_t>(rng() % 3));
  harness.new_inputs(width, rng);
  REQUIRE(cache.upload(stream, width).ok());
  harness.device_forward(width, stream);
  REQUIRE(cache.commit(stream).ok());
  stream.synchronize();
  CHECK(harness.check_against_reference() <= tolerance<typename Cache::Element>());
  CHECK(harness.padding_rows_are_zero(width));
}

// Random steps; every step's outputs checked against the host reference.
template <class Cache>
void random_run(Shape sh, std::uint64_t seed, int steps) {
  Cache cache = make_cache<Cache>(sh, 6);
  REQUIRE(cache.runs_table_kernels());
  ForwardHarness<Cache> harness(cache, sh.heads_q, sh.max_write);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  for (int step = 0; step < steps; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    const std::int32_t T = random_step<typename Cache::Host>(cache, sh.max_write, rng);
    const auto copies = cache.host().pending_changes().copies;
    harness.mirror_copies({copies.begin(), copies.end()});
    checked_step(cache, harness, T, sh.max_write, rng, stream);
  }
  require_device_ok();
}

// Long churn near full occupancy: many cheap steps (K/V written, no attention) over sequences
// that arrive, fork, rewind and leave, with the step's sequences preempted (removed) while it
// does not fit, so every sequence's cells end up scattered over a nearly full pool; then checked
// steps.
template <class Cache>
void churn_run(Shape sh, std::uint64_t seed, int churn_steps, int checked_steps) {
  Cache cache = make_cache<Cache>(sh, 12);
  ForwardHarness<Cache> harness(cache, sh.heads_q, sh.max_write);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  std::int64_t fullest = 0;
  for (int step = 0; step < churn_steps + checked_steps; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    const auto& host = cache.host();
    std::vector<std::int32_t> live;
    host.live_sequences().for_each([&](std::int32_t s) { live.push_back(s); });
    const std::int32_t verb = pick(10);
    if (live.empty() || (verb == 0 && static_cast<std::int32_t>(live.size()) < 12)) live.push_back(cache.seq_new().value());
    else if (verb == 1 && static_cast<std::int32_t>(live.size()) < 12) {
      const std::int32_t src = live[static_cast<std::size_t>(pick(static_cast<std::int32_t>(live.size())))];
      live.push_back(cache.seq_clone(src, pick(host.pos(src).value() + 1)).value());
    } else if (verb == 2) {
      const std::int32_t s = live[static_cast<std::size_t>(pick(static_cast<std::int32_t>(live.size())))];
      REQUIRE(cache.rewind(s, pick(host.pos(s).value() + 1)).ok());
    }
    std::vector<std::int32_t> ids(static_cast<std::size_t>(1 + pick(sh.max_write)));
    for (;;) {
      for (auto& id : ids) id = live[static_cast<std::size_t>(pick(static_cast<std::int32_t>(live.size())))];
      if (cache.declare_step(ids).ok()) break;
      const auto victim = live.begin() + pick(static_cast<std::int32_t>(live.size()));  // preempt one
      REQUIRE(cache.seq_rm(*victim).ok());
      live.erase(victim);
      if (live.empty()) live.push_back(cache.seq_new().value());
    }
    fullest = std::max(fullest, host.capacity() - host.free_cells());
    const auto T = static_cast<std::int32_t>(ids.size());
    if (step < churn_steps) {
      REQUIRE(cache.upload(stream).ok());
      harness.write_step(T, rng, stream);
      REQUIRE(cache.commit(stream).ok());
    } else {
      checked_step(cache, harness, T, sh.max_write, rng, stream);
    }
  }
  CHECK(fullest * 100 >= cache.host().capacity() * 97);  // the churn ran the pool nearly full
  require_device_ok();
}

// Shared prefixes: random fork trees (depth up to 4, forks at any offset, inside a tile or at its
// edges, rewinds below the fork point, sources removed while forks live), then checked steps of
// decode tokens and prompt chunks of many forks at once. Windows 150 and 700 cut through shared
// runs. Returns the number of checked steps whose plan had shared items. mma: the cache made with
// CELLKV_PREFILL_KERNEL=mma (the mma.sync shared-prefix kernel); else the wgmma kernel runs on
// Hopper for D 64 and 128.
template <class Cache>
int fork_tree_run(Shape sh, std::uint64_t seed, int checked_steps, bool mma = false) {
  const CacheConfig config{.max_write = sh.max_write, .max_cells = sh.max_cells, .max_seqs = 48};
  const gpu::PoolShape shape{.layers = Cache::Windows::kLayers, .heads_kv = sh.heads_kv, .head_dim = sh.head_dim,
                             .heads_q = sh.heads_q};
  std::optional<Cache> made;
  if (mma) make_mma_cache(made, config, shape);
  else made.emplace(config, shape);
  Cache& cache = *made;
  REQUIRE(cache.runs_table_kernels());
  CHECK(cache.runs_wgmma_shared() == (!mma && compute_major() == 9 && (sh.head_dim == 64 || sh.head_dim == 128)));
  ForwardHarness<Cache> harness(cache, sh.heads_q, sh.max_write);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  auto fill = [&](std::int32_t seq, std::int32_t n) {  // n tokens of seq, K/V written, unchecked
    for (; n > 0; n -= sh.max_write) {
      const std::int32_t chunk = std::min(n, sh.max_write);
      REQUIRE(cache.declare_step(std::vector<std::int32_t>(static_cast<std::size_t>(chunk), seq)).ok());
      REQUIRE(cache.upload(stream).ok());
      harness.write_step(chunk, rng, stream);
      REQUIRE(cache.commit(stream).ok());
    }
  };
  std::vector<std::pair<std::int32_t, int>> live;  // (sequence, fork depth)
  const std::int32_t root = cache.seq_new().value();
  fill(root, 200 + pick(700));
  live.push_back({root, 0});
  int shared_steps = 0;
  for (int step = 0; step < checked_steps; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    for (int verbs = 1 + pick(3); verbs-- > 0;) {
      const std::size_t i = static_cast<std::size_t>(pick(static_cast<std::int32_t>(live.size())));
      const auto [s, depth] = live[i];
      const std::int32_t pos = cache.host().pos(s).value(), action = pick(10);
      if (action < 6 && depth < 4 && live.size() < 24) {
        const std::int32_t at_choices[] = {pos, pos / 64 * 64, pick(pos + 1), std::max(0, pos - pick(70))};
        const std::int32_t fork = cache.seq_clone(s, at_choices[pick(4)]).value();
        live.push_back({fork, depth + 1});
        fill(fork, pick(90));
      } else if (action < 8) {
        REQUIRE(cache.rewind(s, pick(pos + 1)).ok());
      } else if (live.size() > 2) {
        REQUIRE(cache.seq_rm(s).ok());
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    std::vector<std::int32_t> ids;
    for (const auto& [s, depth] : live) {
      const std::int32_t n = pick(4) == 0 ? 2 + pick(12) : 1;
      if (static_cast<std::int32_t>(ids.size()) + n > sh.max_write) break;
      ids.insert(ids.end(), static_cast<std::size_t>(n), s);
    }
    REQUIRE(cache.declare_step(ids).ok());
    checked_step(cache, harness, static_cast<std::int32_t>(ids.size()), sh.max_write, rng, stream);
    shared_steps += cache.shard().work_counts(0).value().shared > 0 ? 1 : 0;
  }
  require_device_ok();
  return shared_steps;
}

template <class T, class Placement>
using Cells = gpu::DeviceCache<layout::cell, T, Model, Placement, 16>;
using ForkModel = Windows<0, 150, 700>;
template <class T, class Placement>
using ForkCells = gpu::DeviceCache<layout::cell, T, ForkModel, Placement, 48>;
template <class T>
using Slots = gpu::DeviceCache<layout::sequence, T, Model, placement::none, 16>;

}  // namespace

TEST_CASE("table kernels, cell layout, clustered<64>: bf16, D 128, GQA 4, decode and prefill") {
  random_run<Cells<__nv_bfloat16, placement::clustered<64>>>({32, 8, 128, 48, 1200}, 101, 30);
}

TEST_CASE("table kernels, cell layout, lowest_free (interleaved cells): fp16, D 64, GQA 8") {
  random_run<Cells<__half, placement::lowest_free>>({16, 2, 64, 40, 700}, 102, 30);
}

TEST_CASE("table kernels, cell layout, clustered<16>: bf16, D 256, H_q = H_kv") {
  random_run<Cells<__nv_bfloat16, placement::clustered<16>>>({2, 2, 256, 33, 500}, 103, 20);
}

// A placement the library does not know: defined in the test tree alone, run unchanged through the
// random scenarios, churn and fork trees.
TEST_CASE("table kernels, cell layout, test::after_last: random steps, churn and fork trees") {
  random_run<Cells<__nv_bfloat16, test::after_last>>({32, 8, 128, 48, 1200}, 121, 30);
  random_run<Cells<__half, test::after_last>>({16, 2, 64, 40, 700}, 122, 20);
  churn_run<Cells<__nv_bfloat16, test::after_last>>({16, 4, 128, 64, 3000}, 123, 300, 10);
  CHECK(fork_tree_run<ForkCells<__nv_bfloat16, test::after_last>>({16, 4, 128, 64, 6000}, 124, 25) >= 5);
}

TEST_CASE("table kernels, sequence layout: bf16 D 128 GQA 4, fp16 D 64 GQA 1, bf16 D 256 GQA 8") {
  random_run<Slots<__nv_bfloat16>>({8, 2, 128, 40, 900}, 104, 25);
  random_run<Slots<__half>>({4, 4, 64, 17, 600}, 105, 20);
  random_run<Slots<__nv_bfloat16>>({8, 1, 256, 9, 400}, 106, 15);
}

TEST_CASE("table kernels after long churn near full occupancy: lowest_free and clustered<64>") {
  churn_run<Cells<__nv_bfloat16, placement::lowest_free>>({32, 8, 128, 64, 3000}, 111, 400, 12);
  churn_run<Cells<__half, placement::clustered<64>>>({16, 2, 64, 64, 3000}, 112, 400, 12);
  churn_run<Cells<__nv_bfloat16, placement::lowest_free>>({8, 8, 256, 32, 1500}, 113, 300, 8);
}

TEST_CASE("table kernels: one long sequence is split over many warps and merged, for every head dim") {
  using Cache = Cells<__nv_bfloat16, placement::lowest_free>;
  for (const std::int32_t D : {64, 128, 256}) {
    CAPTURE(D);
    Cache cache({.max_write = 64, .max_cells = 9000, .max_seqs = 4},
                {.layers = Model::kLayers, .heads_kv = 2, .head_dim = D, .heads_q = 8});
    ForwardHarness<Cache> harness(cache, 8, 64);
    gpu::Stream stream;
    std::mt19937_64 rng(7);
    const auto a = cache.seq_new().value();
    const auto other = cache.seq_new().value();  // interleaved with a, so a's cells are scattered
    const std::vector<std::int32_t> chunk{a, a, a, other, a, a, a, a};
    for (int i = 0; i < 1000; ++i) {
      REQUIRE(cache.declare_step(chunk).ok());
      REQUIRE(cache.upload(stream).ok());
      harness.write_step(8, rng, stream);
      REQUIRE(cache.commit(stream).ok());
    }
    const std::vector<std::int32_t> one{a};
    REQUIRE(cache.declare_step(one).ok());
    checked_step(cache, harness, 1, 64, rng, stream);
    CHECK(cache.shard().work_counts(0).value().decode == 1);  // one decode segment, 7001 positions
    CHECK(cache.shard().work_counts(0).value().prefill == 0);
    CHECK(cache.shard().work_counts(-1).status() == Errc::bad_argument);  // no such window buffer
    CHECK(cache.shard().work_counts(Model::kDistinct).status() == Errc::bad_argument);
    const std::vector<std::int32_t> mixed{a, a, a, a, a, a, a, a, other};  // a prefill segment (32 rows), a decode one
    REQUIRE(cache.declare_step(mixed).ok());
    checked_step(cache, harness, 9, 64, rng, stream);
    CHECK(cache.shard().work_counts(0).value().decode == 1);
    CHECK(cache.shard().work_counts(0).value().prefill == 1);
  }
  require_device_ok();
}

// Writes `len` prompt tokens of sequence `seq`, 64 a step (unchecked: the steps after check).
template <class Cache>
void write_prompt(Cache& cache, ForwardHarness<Cache>& harness, std::int32_t seq, std::int32_t len,
                  std::mt19937_64& rng, gpu::Stream& stream) {
  for (std::int32_t n = len; n > 0; n -= 64) {
    const std::int32_t chunk = std::min<std::int32_t>(n, 64);
    REQUIRE(cache.declare_step(std::vector<std::int32_t>(static_cast<std::size_t>(chunk), seq)).ok());
    REQUIRE(cache.upload(stream).ok());
    harness.write_step(chunk, rng, stream);
    REQUIRE(cache.commit(stream).ok());
  }
}

// Decode steps of 40 sequences of 1-1,500 positions, 4 KV heads (160 pairs, 16-position tiles at
// D 128; windows 0, 150 and 700): in the unwindowed layer the even split (decode_assignment: chunks
// of about 8 tiles a head over 264 workers a head beat teams of 4 streaming up to 24), so chunks
// hold several short segments and cut the longer pairs, every head's workers cut the same way
// (even_split_part), parts merged in global memory.
template <class Cache>
void even_split_steps() {
  Cache cache = make_cache<Cache>({16, 4, 128, 64, 64000}, 40);
  ForwardHarness<Cache> harness(cache, 16, 64);
  gpu::Stream stream;
  std::mt19937_64 rng(11);
  std::vector<std::int32_t> seqs;
  for (int i = 0; i < 40; ++i) {
    seqs.push_back(cache.seq_new().value());
    write_prompt(cache, harness, seqs.back(), 1 + static_cast<std::int32_t>(rng() % 1500), rng, stream);
  }
  for (int step = 0; step < 3; ++step) {
    REQUIRE(cache.declare_step(seqs).ok());
    checked_step(cache, harness, static_cast<std::int32_t>(seqs.size()), 64, rng, stream);
  }
  CHECK(cache.shard().work_counts(0).value().decode == 40);
  require_device_ok();
}

TEST_CASE("table kernels: the even split over 40 sequences of mixed lengths, every KV head cut the same way") {
  even_split_steps<ForkCells<__nv_bfloat16, test::after_last>>();  // cells scattered
  even_split_steps<ForkCells<__nv_bfloat16, placement::clustered<64>>>();
}

// Decode steps of 12 sequences of `min_len` + [0, spread) positions: 24 (sequence, KV head) pairs,
// fewer than the decode grid's blocks, so each pair runs as a team of the block's warps (8; 5 for
// D 256), its parts merged in shared memory (decode_assignment); a step of 2-token segments too.
// 20-105 positions: at most 7 tiles a pair, two tiles a warp. 400-600 (D 128, 16-position tiles):
// up to 38 tiles a pair, 5 a warp, where the even split would stream one tile a worker and merge
// the parts of a pair in global memory in two levels.
template <class Cache>
void team_steps(std::int32_t head_dim, std::int32_t min_len = 20, std::int32_t spread = 86) {
  CAPTURE(head_dim);
  CAPTURE(min_len);
  Cache cache = make_cache<Cache>({8, 2, head_dim, 64, 16 * (min_len + spread + 64)}, 16);  // max_len: cells / 16
  REQUIRE(cache.runs_table_kernels());
  ForwardHarness<Cache> harness(cache, 8, 64);
  gpu::Stream stream;
  std::mt19937_64 rng(static_cast<std::uint64_t>(head_dim));
  std::vector<std::int32_t> seqs;
  for (int i = 0; i < 12; ++i) {
    seqs.push_back(cache.seq_new().value());
    const std::int32_t len = min_len + static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(spread));
    write_prompt(cache, harness, seqs.back(), len, rng, stream);
  }
  for (int step = 0; step < 4; ++step) {
    REQUIRE(cache.declare_step(seqs).ok());
    checked_step(cache, harness, static_cast<std::int32_t>(seqs.size()), 64, rng, stream);
  }
  std::vector<std::int32_t> pairs_of_tokens;
  for (const std::int32_t s : seqs) pairs_of_tokens.insert(pairs_of_tokens.end(), {s, s});
  REQUIRE(cache.declare_step(pairs_of_tokens).ok());
  checked_step(cache, harness, static_cast<std::int32_t>(pairs_of_tokens.size()), 64, rng, stream);
  CHECK(cache.shard().work_counts(0).value().decode == 12);
  require_device_ok();
}

TEST_CASE("table kernels: steps of few short pairs run as teams of warps merged in shared memory") {
  for (const std::int32_t D : {64, 128, 256}) {
    team_steps<Cells<__nv_bfloat16, placement::clustered<64>>>(D);
    team_steps<Slots<__half>>(D);
  }
}

TEST_CASE("table kernels: steps of few long pairs run as teams too, several tiles a warp") {
  team_steps<Cells<__nv_bfloat16, placement::lowest_free>>(128, 400, 200);
  team_steps<Slots<__nv_bfloat16>>(128, 400, 200);
}

TEST_CASE("table kernels: graph replay across random mixes needs no recapture") {
  using Cache = Cells<__nv_bfloat16, placement::lowest_free>;
  constexpr std::int32_t kWidth = 24;
  Cache cache({.max_write = kWidth, .max_cells = 1500, .max_seqs = 6},
              {.layers = Model::kLayers, .heads_kv = 2, .head_dim = 128, .heads_q = 8});
  ForwardHarness<Cache> harness(cache, 8, kWidth);
  gpu::Stream stream;
  std::mt19937_64 rng(9);
  (void)random_step<Cache::Host>(cache, kWidth, rng);
  REQUIRE(cache.upload(stream, kWidth).ok());
  harness.new_inputs(kWidth, rng);
  const gpu::GraphExec graph = gpu::capture(stream, [&] { harness.device_forward(kWidth, stream); });
  REQUIRE(cache.commit(stream).ok());
  for (int step = 0; step < 100; ++step) {
    CAPTURE(step);
    (void)random_step<Cache::Host>(cache, kWidth, rng);
    harness.new_inputs(kWidth, rng);
    REQUIRE(cache.upload(stream, kWidth).ok());
    REQUIRE(graph.replay(stream).ok());
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    CHECK(harness.check_against_reference() <= tolerance<__nv_bfloat16>());
    CHECK(harness.padding_rows_are_zero(kWidth));
  }
}

TEST_CASE("table kernels and the reference kernel agree; masks on request equal the host's") {
  using Cache = Cells<__nv_bfloat16, placement::clustered<64>>;
  const CacheConfig config{.max_write = 20, .max_cells = 900, .max_seqs = 5};
  const gpu::PoolShape shape{.layers = Model::kLayers, .heads_kv = 2, .head_dim = 64, .heads_q = 8};
  Cache fast(config, shape), ref(config, shape);
  ref.use_kernels(gpu::KernelChoice::reference);
  CHECK(fast.runs_table_kernels());
  CHECK_FALSE(ref.runs_table_kernels());
  ForwardHarness<Cache> hf(fast, 8, 20), hr(ref, 8, 20);
  gpu::Stream stream;
  std::mt19937_64 rng_f(5), rng_r(5), data_f(6), data_r(6);
  for (int step = 0; step < 25; ++step) {
    CAPTURE(step);
    const std::int32_t T = random_step<Cache::Host>(fast, 20, rng_f);
    REQUIRE(random_step<Cache::Host>(ref, 20, rng_r) == T);
    hf.new_inputs(T, data_f);
    hr.new_inputs(T, data_r);
    REQUIRE(fast.upload(stream, T, gpu::Masks::always).ok());
    REQUIRE(ref.upload(stream).ok());
    hf.device_forward(T, stream);
    hr.device_forward(T, stream);
    REQUIRE(fast.commit(stream).ok());
    REQUIRE(ref.commit(stream).ok());
    stream.synchronize();
    const double ef = hf.check_against_reference(), er = hr.check_against_reference();
    CHECK(ef <= tolerance<__nv_bfloat16>());
    CHECK(er <= tolerance<__nv_bfloat16>());
    // The two device outputs agree with each other too.
    CHECK(max_relative_difference(hf.outputs(), hr.outputs(), 64) <= tolerance<__nv_bfloat16>());
    // The masks the table-kernel cache built on request equal the host's rows.
    const auto plan = fast.host().step();
    std::vector<std::uint8_t> want(static_cast<std::size_t>(plan.read_len)), got(want.size());
    for (std::int32_t t = 0; t < T; ++t) {
      REQUIRE(fast.host().mask_row(40, t, want).ok());
      REQUIRE(cudaMemcpy(got.data(), fast.mask(Model::buffer_of_window(40)) + t * fast.bindings().max_cells, got.size(),
                         cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(got == want);
    }
  }
}

TEST_CASE("shared prefixes: random fork trees read their shared runs once, same outputs as the host reference") {
  // bf16 D 128 GQA 4, clustered<64>; fp16 D 64 GQA 8, lowest_free (interleaved); bf16 D 256 GQA 1.
  CHECK(fork_tree_run<ForkCells<__nv_bfloat16, placement::clustered<64>>>({16, 4, 128, 64, 6000}, 201, 25) >= 5);
  CHECK(fork_tree_run<ForkCells<__half, placement::lowest_free>>({16, 2, 64, 48, 6000}, 202, 25) >= 5);
  CHECK(fork_tree_run<ForkCells<__nv_bfloat16, placement::clustered<16>>>({4, 4, 256, 40, 5000}, 203, 15) >= 5);
}

TEST_CASE("shared prefixes: a short fork tree on each shared-prefix kernel (the sanitizers' case)") {
  CHECK(fork_tree_run<ForkCells<__nv_bfloat16, placement::clustered<64>>>({16, 4, 128, 64, 3000}, 204, 8) >= 2);
  CHECK(fork_tree_run<ForkCells<__nv_bfloat16, placement::clustered<64>>>({16, 4, 128, 64, 3000}, 204, 8, true) >= 2);
}

TEST_CASE("shared prefixes: the mma.sync shared-prefix kernel (CELLKV_PREFILL_KERNEL=mma) on the same fork trees") {
  // On Hopper "random fork trees read their shared runs once" runs shared_prefix_wgmma for D 64
  // and 128; this case the kernel other devices run, on the same shapes.
  CHECK(fork_tree_run<ForkCells<__nv_bfloat16, placement::clustered<64>>>({16, 4, 128, 64, 6000}, 201, 25, true) >= 5);
  CHECK(fork_tree_run<ForkCells<__half, placement::lowest_free>>({16, 2, 64, 48, 6000}, 202, 25, true) >= 5);
}

namespace {

// One prompt of `prompt` tokens (64-token chunks), then `forks` sequences decoding off it: the root
// and forks - 1 clones at the lengths fork_at(f), `per_fork` tokens each per step, on a cache that
// shares prefixes and one that does not (the same verbs, the same data). Every step: the sharing
// cache plans at least `min_items` shared items, and both match the host reference and each other.
// all_finished: where shared_prefix_wgmma runs, every decode segment is finished by it (no decode
// work is left; prefix_sharing.hpp), else the decode kernel takes them all.
template <class ForkAt>
void forks_off_one_prompt(const CacheConfig& config, const gpu::PoolShape& shape, std::int32_t prompt, std::int32_t forks,
                          ForkAt&& fork_at, std::int32_t min_items, int steps, std::int32_t per_fork = 1,
                          bool all_finished = false) {
  using Cache = ForkCells<__nv_bfloat16, placement::clustered<64>>;
  Cache shared(config, shape), plain(config, shape);
  plain.share_prefixes(false);
  ForwardHarness<Cache> hs(shared, shape.heads_q, config.max_write), hp(plain, shape.heads_q, config.max_write);
  gpu::Stream stream;
  std::mt19937_64 data_s(3), data_p(3);
  std::vector<std::int32_t> ids;  // the root and its forks (the same ids in both caches: same verbs)
  for (Cache* c : {&shared, &plain}) {
    auto& h = c == &shared ? hs : hp;
    auto& data = c == &shared ? data_s : data_p;
    const std::int32_t root = c->seq_new().value();
    ids = {root};
    for (std::int32_t at = 0; at < prompt; at += 64) {
      REQUIRE(c->declare_step(std::vector<std::int32_t>(64, root)).ok());
      REQUIRE(c->upload(stream).ok());
      h.write_step(64, data, stream);
      REQUIRE(c->commit(stream).ok());
    }
    for (std::int32_t f = 1; f < forks; ++f) ids.push_back(c->seq_clone(root, fork_at(f)).value());
  }
  std::vector<std::int32_t> step_ids;  // each sequence's per_fork tokens together: one decode segment
  for (const std::int32_t id : ids) step_ids.insert(step_ids.end(), static_cast<std::size_t>(per_fork), id);
  ids = step_ids;
  const auto width = static_cast<std::int32_t>(ids.size());
  for (int step = 0; step < steps; ++step) {
    CAPTURE(step);
    REQUIRE(shared.declare_step(ids).ok());
    REQUIRE(plain.declare_step(ids).ok());
    hs.new_inputs(width, data_s);
    hp.new_inputs(width, data_p);
    REQUIRE(shared.upload(stream).ok());
    REQUIRE(plain.upload(stream).ok());
    CHECK(shared.shard().work_counts(0).value().shared >= min_items);
    CHECK(plain.shard().work_counts(0).value().shared == 0);
    if (all_finished) {
      const std::int32_t decode = shared.shard().work_counts(0).value().decode;
      if (shared.runs_wgmma_shared()) CHECK(decode == 0);
      else CHECK(decode == static_cast<std::int32_t>(ids.size()) / per_fork);
    }
    hs.device_forward(width, stream);
    hp.device_forward(width, stream);
    REQUIRE(shared.commit(stream).ok());
    REQUIRE(plain.commit(stream).ok());
    stream.synchronize();
    CHECK(hs.check_against_reference() <= tolerance<__nv_bfloat16>());
    CHECK(hp.check_against_reference() <= tolerance<__nv_bfloat16>());
    CHECK(max_relative_difference(hs.outputs(), hp.outputs(), 128) <= tolerance<__nv_bfloat16>());
  }
  require_device_ok();
}

}  // namespace

TEST_CASE("shared prefixes: forks decoding off one prompt give the same outputs with and without sharing") {
  // 40 sequences of a 1,280-token prompt, forked at and below its end.
  forks_off_one_prompt({.max_write = 64, .max_cells = 8000, .max_seqs = 48},
                       {.layers = ForkModel::kLayers, .heads_kv = 2, .head_dim = 128, .heads_q = 16}, 1280, 40,
                       [](std::int32_t f) { return 1280 - (f - 1) % 3 * 17; }, 1, 6);
}

TEST_CASE("shared prefixes: 16 forks of a 4,096-token prompt fold more than 8 partial slots a token, also of two nested runs") {
  // Every fork reads 1 to 3 positions itself: on Hopper the shared-prefix kernel finishes them all.
  // The benchmark's shape: one run of 64 rows (16 tokens x GQA 4) split to fill the device's SMs
  // (the wgmma kernel's grid / H_kv splits, at most 16), so each token folds a slot per split (16
  // on an H200; the fold loads its slots in batches of up to 16), on the full-attention layer; the
  // windowed layers' splits are mostly hidden (weight 0).
  int sms = 0;
  REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess);
  const CacheConfig config{.max_write = 64, .max_cells = 4096 + 1024, .max_seqs = 48};
  const gpu::PoolShape shape{.layers = ForkModel::kLayers, .heads_kv = 8, .head_dim = 128, .heads_q = 32};
  forks_off_one_prompt(config, shape, 4096, 16, [](std::int32_t) { return 4096; }, std::clamp(sms / 8, 2, 9), 3, 1, true);
  // Half the forks at 2,048: a run [0, 2,048) of all 16 and a nested run [2,048, 4,096) of the root
  // and the forks at 4,096, the splits shared out between the two (8 each on an H200), so those
  // tokens fold the slots of two runs (16) and the others one run's (8); at least one item a run.
  forks_off_one_prompt(config, shape, 4096, 16, [](std::int32_t f) { return f % 2 == 0 ? 2048 : 4096; }, 2, 3, 1, true);
}

TEST_CASE("shared prefixes: forks decoding 4 tokens a step (16-row pairs), the decode epilogue's 2- and 4-quad units") {
  // GQA 4 x 4 tokens: 16-row pairs, 512 quads of columns each. 8 forks: one pair a block (a team
  // of 8 warps), 2 quads a thread, 8 slots a token; 20 forks: two pairs a block, 4 quads a thread.
  const gpu::PoolShape shape{.layers = ForkModel::kLayers, .heads_kv = 8, .head_dim = 128, .heads_q = 32};
  forks_off_one_prompt({.max_write = 256, .max_cells = 2048 + 1024, .max_seqs = 48}, shape, 2048, 8,
                       [](std::int32_t f) { return 2048 - f % 2 * 40; }, 2, 3, 4);
  forks_off_one_prompt({.max_write = 128, .max_cells = 1024 + 1024, .max_seqs = 48}, shape, 1024, 20,
                       [](std::int32_t) { return 1024; }, 1, 3, 4);
}
