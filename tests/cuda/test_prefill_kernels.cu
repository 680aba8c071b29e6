// The two prefill kernels of the table path (the Hopper wgmma kernel, and the mma.sync kernel kept
// for other architectures and forced with CELLKV_PREFILL_KERNEL=mma) against the reference kernel
// (itself checked against the float64 host reference in test_table_attention.cu, where the table
// kernels meet holes and random fork trees on short steps): long ragged prompt chunks (1 to 3,701
// tokens in one step) beside decode tokens, a window that cuts through them, a fork and a rewind,
// both layouts, bf16 and fp16, head dims 64 / 128 / 256 (the wgmma kernel reads 64-position tiles
// at 256, 128-position ones below), GQA 1, 4 and 8. Every layer of every step launches the
// prefill kernel on the same item-claim counters (item_claims.cuh), so a launch that left them
// other than zero would leave the next one's items undone, and its outputs wrong.
#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using Model = Windows<0, 300, 0>;

// The same verbs on every cache of `caches` (so the same sequence ids and positions).
template <class Cache, class Verb>
void on_all(std::vector<Cache*>& caches, Verb&& verb) {
  for (Cache* c : caches) verb(*c);
}

// (tokens of seqs[0], [1], [2]) per step: long chunks, a single token, a chunk ending in a
// partial tile, a decode token beside prompt chunks; before step 3 a fork (seqs[3], 40 tokens a
// step after) that prefills past its parent's prefix, and a rewind that leaves positions to rewrite.
using Steps = std::vector<std::vector<std::int32_t>>;
const Steps kLongSteps{{3000, 1, 700}, {1, 1000, 63}, {65, 1, 129}, {600, 1, 1}, {1, 1, 2000}, {17, 333, 2}};
// The same shapes at a size the sanitizers get through.
const Steps kShortSteps{{300, 1, 70}, {1, 100, 63}, {65, 1, 129}, {60, 1, 1}, {1, 1, 200}};

// Prefill items a step of one segment per sequence of `lens` tokens needs with items of `rows`
// query rows (AttentionShape::prefill_rows): ceil(len x group / rows) per segment of more than 16
// rows (kDecodeRows; the others are decoded).
std::int32_t prefill_items(const std::vector<std::int32_t>& lens, std::int32_t group, std::int32_t rows) {
  std::int32_t items = 0;
  for (const std::int32_t len : lens)
    if (len * group > 16) items += (len * group + rows - 1) / rows;
  return items;
}

// Three caches (wgmma where it runs, mma.sync, reference kernel) fed identical steps: ragged prompt
// chunks of up to max_write tokens beside decode tokens. Every output is compared with the
// reference kernel's. Each table cache plans prefill items of its kernel's size: 128 rows for the
// wgmma kernel, 64 for the mma.sync kernel.
template <class Cache>
void ragged_prefill(std::int32_t heads_q, std::int32_t heads_kv, std::int32_t head_dim, std::uint64_t seed,
                    const Steps& steps = kLongSteps, double key_ramp = 0) {
  CAPTURE(heads_q);
  CAPTURE(heads_kv);
  CAPTURE(head_dim);
  constexpr std::int32_t kMaxWrite = 4096;
  const CacheConfig config{.max_write = kMaxWrite, .max_cells = 12288, .max_seqs = 4, .max_len = 8192};
  const gpu::PoolShape shape{.layers = Model::kLayers, .heads_kv = heads_kv, .head_dim = head_dim, .heads_q = heads_q};
  Cache fast(config, shape), ref(config, shape);
  std::optional<Cache> mma_cache;
  make_mma_cache(mma_cache, config, shape);
  Cache& mma = *mma_cache;
  ref.use_kernels(gpu::KernelChoice::reference);
  const bool hopper = compute_major() == 9 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
  CHECK(fast.runs_wgmma_prefill() == hopper);  // the build's default gpu_arch is 90a
  CHECK_FALSE(mma.runs_wgmma_prefill());
  REQUIRE(mma.runs_table_kernels());
  std::vector<Cache*> caches{&fast, &mma, &ref};
  ForwardHarness<Cache> hf(fast, heads_q, kMaxWrite), hm(mma, heads_q, kMaxWrite), hr(ref, heads_q, kMaxWrite);
  hf.key_ramp = hm.key_ramp = hr.key_ramp = key_ramp;
  gpu::Stream stream;
  std::mt19937_64 df(seed), dm(seed), dr(seed);
  std::vector<std::int32_t> seqs;
  on_all(caches, [&](Cache& c) { seqs = {c.seq_new().value(), c.seq_new().value(), c.seq_new().value()}; });
  const std::int32_t fork_at = steps[0][0] * 2 / 3 + 3;  // inside a tile of seqs[0]'s prefix
  const std::int32_t seq1_before_fork = steps[0][1] + steps[1][1] + steps[2][1];
  const std::int32_t rewind_to = seq1_before_fork - seq1_before_fork / 10;
  for (std::size_t step = 0; step < steps.size(); ++step) {
    CAPTURE(step);
    if (step == 3) {  // fork seqs[0] at a position inside a tile; rewind seqs[1]
      on_all(caches, [&](Cache& c) {
        const std::int32_t fork = c.seq_clone(seqs[0], fork_at).value();
        if (seqs.size() == 3) seqs.push_back(fork);
        REQUIRE(c.rewind(seqs[1], rewind_to).ok());
      });
    }
    std::vector<std::int32_t> ids;
    for (std::size_t s = 0; s < 3; ++s) ids.insert(ids.end(), static_cast<std::size_t>(steps[step][s]), seqs[s]);
    if (seqs.size() > 3) ids.insert(ids.end(), 40, seqs[3]);
    const auto T = static_cast<std::int32_t>(ids.size());
    REQUIRE(T <= kMaxWrite);
    on_all(caches, [&](Cache& c) { REQUIRE(c.declare_step(ids).ok()); });
    hf.new_inputs(T, df);
    hm.new_inputs(T, dm);
    hr.new_inputs(T, dr);
    for (auto [c, h] : {std::pair{&fast, &hf}, std::pair{&mma, &hm}, std::pair{&ref, &hr}}) {
      REQUIRE(c->upload(stream).ok());
      h->device_forward(T, stream);
      REQUIRE(c->commit(stream).ok());
    }
    stream.synchronize();
    CHECK(fast.shard().work_counts(0).value().prefill > 0);
    std::vector<std::int32_t> lens(steps[step].begin(), steps[step].end());
    if (seqs.size() > 3) lens.push_back(40);
    const std::int32_t group = heads_q / heads_kv;
    CHECK(fast.shard().work_counts(0).value().prefill == prefill_items(lens, group, fast.runs_wgmma_prefill() ? 128 : 64));
    CHECK(mma.shard().work_counts(0).value().prefill == prefill_items(lens, group, 64));
    const std::vector<double> want = hr.outputs();
    CHECK(max_relative_difference(hf.outputs(), want, head_dim) <= tolerance<typename Cache::Element>());
    CHECK(max_relative_difference(hm.outputs(), want, head_dim) <= tolerance<typename Cache::Element>());
  }
  require_device_ok();
}

template <class T, class Placement>
using Cells = gpu::DeviceCache<layout::cell, T, Model, Placement, 8>;
template <class T>
using Slots = gpu::DeviceCache<layout::sequence, T, Model, placement::none, 8>;

}  // namespace

TEST_CASE("prefill kernels: wgmma and mma.sync agree with the reference on long ragged chunks, cell layout") {
  ragged_prefill<Cells<__nv_bfloat16, placement::lowest_free>>(32, 8, 128, 1);
  ragged_prefill<Cells<__half, placement::clustered<64>>>(16, 2, 64, 2);
  ragged_prefill<Cells<__nv_bfloat16, placement::clustered<16>>>(4, 4, 256, 3);
}

TEST_CASE("prefill kernels: wgmma and mma.sync agree with the reference on long ragged chunks, sequence layout") {
  ragged_prefill<Slots<__nv_bfloat16>>(8, 1, 128, 4);
  ragged_prefill<Slots<__half>>(8, 8, 64, 5);
  ragged_prefill<Slots<__half>>(16, 2, 256, 8);
}

TEST_CASE("prefill kernels: short ragged steps (the sanitizers' case)") {
  ragged_prefill<Cells<__nv_bfloat16, placement::lowest_free>>(8, 2, 128, 6, kShortSteps);
  ragged_prefill<Slots<__half>>(4, 4, 64, 7, kShortSteps);
  ragged_prefill<Cells<__nv_bfloat16, placement::lowest_free>>(16, 4, 256, 9, kShortSteps);
}

// Keys scaled by 1 + 0.06 t (token t of the step): a row's largest score grows from one
// 128-position tile to the next by amounts on both sides of the 8 (log2 units) the wgmma kernel's
// online softmax lets its exponent base lag behind (kLazyRescaleLog2), so both paths are taken: the
// base moves (o rescaled), or stays with probabilities above 1. (A host model of the first step's
// 300-token chunk at D 128, every third row: 18 moves, 53 tiles that keep the base, 38 of them with
// a probability above 1.)
TEST_CASE("prefill kernels: scores that jump from tile to tile") {
  ragged_prefill<Cells<__nv_bfloat16, placement::lowest_free>>(8, 2, 128, 10, kShortSteps, 0.06);
  ragged_prefill<Slots<__half>>(4, 4, 64, 11, kShortSteps, 0.06);
}
