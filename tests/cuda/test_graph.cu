// Graph replay: a forward over three layers with two windows (write + attend per layer) is
// captured once at a fixed width; 120 steps of random mixes (new sequences, forks, removals,
// refilled holes, varying read_len) replay it without recapture, and every step matches the host
// reference. Narrower steps are padded: padding rows write the scratch row, see nothing (zeros),
// and never disturb real tokens.
//
// GraphScope::step_kinds: one graph per width and graph_key(); the key names exactly the kernels
// the host plan needs (the oracle: each segment's rows against a decode item, padding, shared
// items), every replay matches the host reference, and a graph replayed for a step that needs a
// kernel it lacks is refused at commit (missing_step_kernels) with nothing else changed.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/graph.hpp"
#include "cellkv/gpu/stream.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using Model = Windows<0, 6, 0>;

template <class Cache>
void replay_run(std::uint64_t seed) {
  constexpr std::int32_t kWidth = 16;
  Cache cache({.max_write = kWidth, .max_cells = 257, .max_seqs = 6, .max_len = 48},
              {.layers = Model::kLayers, .heads_kv = 2, .head_dim = 128});
  ForwardHarness<Cache> harness(cache, 8, kWidth);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);

  // Capture once, over a first step padded to the graph width.
  (void)random_step<typename Cache::Host>(cache, kWidth, rng);
  REQUIRE(cache.upload(stream, kWidth).ok());
  harness.new_inputs(kWidth, rng);
  const gpu::GraphExec graph = gpu::capture(stream, [&] { harness.device_forward(kWidth, stream); });
  REQUIRE(cache.commit(stream).ok());

  std::int64_t max_read_len = 0, min_read_len = 1 << 30;
  for (int step = 0; step < 120; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    (void)random_step<typename Cache::Host>(cache, kWidth, rng);
    const auto copies = cache.host().pending_changes().copies;
    harness.mirror_copies({copies.begin(), copies.end()});
    harness.new_inputs(kWidth, rng);
    REQUIRE(cache.upload(stream, kWidth).ok());
    REQUIRE(graph.replay(stream).ok());
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    CHECK(harness.check_against_reference() <= tolerance<typename Cache::Element>());
    CHECK(harness.padding_rows_are_zero(kWidth));
    max_read_len = std::max(max_read_len, cache.host().step().read_len);
    min_read_len = std::min(min_read_len, cache.host().step().read_len);
  }
  CHECK(max_read_len > min_read_len);  // read_len really varied under one graph
  require_device_ok();
}

// The attention kernels the placed step needs, from the host's plan: a segment whose rows (tokens x
// group) fit a decode item needs the decode kernel, a longer one the prefill kernel; padding rows
// need the decode kernel (it zeroes them); shared items the shared-prefix kernel.
template <class Cache>
gpu::StepKernels kernels_from_plan(const Cache& cache, std::int32_t width, std::int32_t group) {
  const StepPlan plan = cache.host().step();
  std::uint32_t bits = plan.tokens < width ? gpu::StepKernels::kDecode : 0u;
  for (const Segment& s : plan.segments)
    bits |= static_cast<std::int64_t>(s.len) * group <= kDecodeRows ? gpu::StepKernels::kDecode
                                                                    : gpu::StepKernels::kPrefill;
  if (cache.work_counts(0).value().shared > 0) bits |= gpu::StepKernels::kShared;
  return {bits};
}

template <class Cache>
void per_kind_run(std::uint64_t seed) {
  constexpr std::int32_t kWidth = 16, kHeadsQ = 8, kHeadsKv = 2;
  Cache cache({.max_write = kWidth, .max_cells = 257, .max_seqs = 6, .max_len = 48},
              {.layers = Model::kLayers, .heads_kv = kHeadsKv, .head_dim = 128, .heads_q = kHeadsQ});
  REQUIRE(cache.runs_table_kernels());
  cache.set_graph_scope(gpu::GraphScope::step_kinds);
  ForwardHarness<Cache> harness(cache, kHeadsQ, kWidth);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  std::map<std::uint32_t, gpu::GraphExec> graphs;
  for (int step = 0; step < 120; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    // Every third step decodes one token of each of up to kWidth live sequences.
    if (step % 3 == 0 && cache.host().live_sequences().count() > 0) {
      std::vector<std::int32_t> ids;
      cache.host().live_sequences().for_each([&](std::int32_t s) { if (ids.size() < kWidth) ids.push_back(s); });
      if (!cache.declare_step(ids).ok()) (void)random_step<typename Cache::Host>(cache, kWidth, rng);
    } else {
      (void)random_step<typename Cache::Host>(cache, kWidth, rng);
    }
    const auto copies = cache.host().pending_changes().copies;
    harness.mirror_copies({copies.begin(), copies.end()});
    harness.new_inputs(kWidth, rng);
    REQUIRE(cache.upload(stream, kWidth).ok());
    const gpu::StepKernels key = cache.graph_key();
    CHECK(key == kernels_from_plan(cache, kWidth, kHeadsQ / kHeadsKv));
    auto it = graphs.find(key.bits);
    if (it == graphs.end())
      it = graphs.emplace(key.bits, gpu::capture(stream, [&] { harness.device_forward(kWidth, stream); })).first;
    REQUIRE(it->second.replay(stream).ok());
    stream.synchronize();
    REQUIRE(cache.commit(stream).ok());
    CHECK(harness.check_against_reference() <= tolerance<typename Cache::Element>());
    CHECK(harness.padding_rows_are_zero(kWidth));
  }
  // Decode steps had a graph without the prefill kernel, and other steps graphs of their own.
  CHECK(std::any_of(graphs.begin(), graphs.end(),
                    [](const auto& g) { return !gpu::StepKernels{g.first}.has(gpu::StepKernels::kPrefill); }));
  CHECK(graphs.size() >= 2);
  require_device_ok();
}

// A graph captured over a decode-only step, replayed for a step with a long segment (prefill only):
// the commit refuses, the host's step stays placed, and the graph of the step's key then runs it.
template <class Cache>
void missing_kernel_run() {
  constexpr std::int32_t kWidth = 8, kHeadsQ = 8;
  Cache cache({.max_write = kWidth, .max_cells = 257, .max_seqs = 6, .max_len = 48},
              {.layers = Model::kLayers, .heads_kv = 2, .head_dim = 128, .heads_q = kHeadsQ});
  REQUIRE(cache.runs_table_kernels());
  cache.set_graph_scope(gpu::GraphScope::step_kinds);
  ForwardHarness<Cache> harness(cache, kHeadsQ, kWidth);
  gpu::Stream stream;
  std::mt19937_64 rng(5);
  const std::int32_t a = cache.seq_new().value(), b = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{a, b}).ok());
  harness.new_inputs(kWidth, rng);
  REQUIRE(cache.upload(stream, kWidth).ok());
  CHECK(cache.graph_key() == gpu::StepKernels{gpu::StepKernels::kDecode});
  const gpu::GraphExec decode_only = gpu::capture(stream, [&] { harness.device_forward(kWidth, stream); });
  REQUIRE(decode_only.replay(stream).ok());
  stream.synchronize();
  REQUIRE(cache.commit(stream).ok());
  CHECK(harness.check_against_reference() <= tolerance<typename Cache::Element>());

  REQUIRE(cache.declare_step(std::vector<std::int32_t>(kWidth, a)).ok());  // 8 tokens x group 4 > a decode item
  harness.new_inputs(kWidth, rng);
  REQUIRE(cache.upload(stream, kWidth).ok());
  CHECK(cache.graph_key() == gpu::StepKernels{gpu::StepKernels::kPrefill});
  const std::int32_t pos_a = cache.host().pos(a).value();
  REQUIRE(decode_only.replay(stream).ok());
  stream.synchronize();
  CHECK(cache.commit(stream) == Errc::missing_step_kernels);
  CHECK(cache.host().pos(a).value() == pos_a);  // the step stays placed; nothing moved
  CHECK(cache.host().step().tokens == kWidth);
  const gpu::GraphExec prefill = gpu::capture(stream, [&] { harness.device_forward(kWidth, stream); });
  REQUIRE(prefill.replay(stream).ok());
  stream.synchronize();
  CHECK(cache.commit(stream).ok());
  CHECK(harness.check_against_reference() <= tolerance<typename Cache::Element>());
  require_device_ok();
}

}  // namespace

TEST_CASE("graphs per step kinds across random mixes, cell layout, bf16") {
  per_kind_run<gpu::DeviceCache<layout::cell, __nv_bfloat16, Model, placement::lowest_free, 8>>(41);
}

TEST_CASE("graphs per step kinds across random mixes, sequence layout, fp16") {
  per_kind_run<gpu::DeviceCache<layout::sequence, __half, Model, placement::lowest_free, 8>>(42);
}

TEST_CASE("a graph replayed for a step that needs a kernel it lacks is refused: missing_step_kernels") {
  missing_kernel_run<gpu::DeviceCache<layout::cell, __nv_bfloat16, Model, placement::lowest_free, 8>>();
  missing_kernel_run<gpu::DeviceCache<layout::sequence, __half, Model, placement::lowest_free, 8>>();
}

TEST_CASE("graph replay across random mixes, cell layout, bf16") {
  replay_run<gpu::DeviceCache<layout::cell, __nv_bfloat16, Model, placement::lowest_free, 8>>(31);
}

TEST_CASE("graph replay across random mixes, cell layout clustered, fp32") {
  replay_run<gpu::DeviceCache<layout::cell, float, Model, placement::clustered<8>, 8>>(32);
}

TEST_CASE("graph replay across random mixes, sequence layout, fp16") {
  replay_run<gpu::DeviceCache<layout::sequence, __half, Model, placement::lowest_free, 8>>(33);
}
