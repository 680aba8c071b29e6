// The executor on the GPU with the example decoder (cuBLAS, CUDA graphs per step width): batched
// generation equals solo generation token for token for sessions with different prompt lengths
// and a fork; graph replay equals eager execution; a hand-made schedule of widths 20, 1, 4, 2, 4,
// 7, 3 with partial prefills matches; cells reused across rounds leak nothing. The model computes
// in fp32 (storage and GEMMs), so a session alone and in a batch agree up to fp32 rounding: the
// comparison is in fp32, as bf16 rounding of different batch shapes could flip a near-tie.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "cellkv/batching/executor.hpp"
#include "cellkv/cuda/device_cache.cuh"
#include "cellkv/cuda/stream.hpp"
#include "llama/gpu_llama.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using Model = Windows<0, 6>;
template <class L, class P>
using Cache = gpu::DeviceCache<L, float, Model, P, 16>;
using Cells = Cache<layout::cell, placement::clustered<64>>;
using Slots = Cache<layout::sequence, placement::lowest_free>;

const llama::Config kConfig{.vocab = 128, .dim = 64, .layers = Model::kLayers, .heads_q = 4, .heads_kv = 2, .head_dim = 64,
                            .ffn = 96, .seed = 11};
const SessionLimits kLimits{.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = 96};
const CacheConfig kCacheConfig{.max_write = 24, .max_cells = 1024, .max_seqs = 8, .max_len = 128};
const gpu::PoolShape kShape{.layers = Model::kLayers, .heads_kv = 2, .head_dim = 64, .heads_q = 4};

const llama::Weights& weights() {
  static const llama::Weights w = llama::generate(kConfig);
  return w;
}

std::vector<std::int32_t> prompt_of(std::int32_t len, std::int32_t salt) {
  std::vector<std::int32_t> p;
  for (std::int32_t t = 0; t < len; ++t) p.push_back((t * 29 + salt * 11 + 5) % kConfig.vocab);
  return p;
}

// A cache, its model and an executor on one stream.
template <class C>
struct Rig {
  gpu::Stream stream;
  C cache{kCacheConfig, kShape};
  llama::GpuLlama<C> model;
  Executor<llama::GpuLlama<C>, C> exec;
  explicit Rig(llama::GpuOptions options = {}) : model(kConfig, weights(), cache, stream.get(), options), exec(model, cache, kLimits) {}
  std::vector<std::int32_t> output(SessionId id) const {
    const auto out = exec.sessions().output(id).value();
    return {out.begin(), out.end()};
  }
};

template <class C>
std::vector<std::int32_t> solo(const std::vector<std::int32_t>& prompt, std::int32_t max_new) {
  Rig<C> rig;
  const SessionId id = rig.exec.sessions().add(prompt, max_new).value();
  REQUIRE(rig.exec.run_until_idle().ok());
  return rig.output(id);
}

template <class C>
void batched_equals_solo() {
  Rig<C> rig;
  const std::int32_t lengths[] = {1, 4, 13, 31, 50};
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 5; ++i) ids.push_back(rig.exec.sessions().add(prompt_of(lengths[i], i), 16).value());
  for (int s = 0; s < 4; ++s) REQUIRE(rig.exec.step().ok());
  const SessionId fork = rig.exec.sessions().clone(ids[2], 16).value();
  REQUIRE(rig.exec.run_until_idle().ok());
  for (std::int32_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(rig.output(ids[static_cast<std::size_t>(i)]) == solo<C>(prompt_of(lengths[i], i), 16));
  }
  CHECK(rig.output(fork) == solo<C>(prompt_of(13, 2), 16));
  CHECK(rig.model.graph_stats().replays > 0);
  cellkv::test::require_device_ok();
}

}  // namespace

TEST_CASE("gpu executor: batched generation equals solo generation (cell layout)") { batched_equals_solo<Cells>(); }

TEST_CASE("gpu executor: batched generation equals solo generation (sequence layout)") { batched_equals_solo<Slots>(); }

TEST_CASE("gpu executor: graph replay equals eager execution; captures happen once per width") {
  Rig<Cells> graphs;
  Rig<Cells> eager({.graphs = false});
  std::vector<SessionId> a, b;
  for (std::int32_t i = 0; i < 6; ++i) {
    a.push_back(graphs.exec.sessions().add(prompt_of(3 + 5 * i, i), 12).value());
    b.push_back(eager.exec.sessions().add(prompt_of(3 + 5 * i, i), 12).value());
  }
  REQUIRE(graphs.exec.run_until_idle().ok());
  REQUIRE(eager.exec.run_until_idle().ok());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(graphs.output(a[i]) == eager.output(b[i]));
  const auto& g = graphs.model.graph_stats();
  CHECK(g.captures > 0);
  CHECK(g.captures <= 6);  // widths 1, 2, 4, 8, 16, 32 at most: mixes change, captures do not
  CHECK(g.replays == graphs.exec.stats().steps);
  CHECK(eager.model.graph_stats().captures == 0);
}

TEST_CASE("gpu executor: a hand-made schedule of widths 20, 1, 4, 2, 4, 7, 3 matches solo generation") {
  Rig<Cells> rig;
  const SessionId a = rig.exec.sessions().add(prompt_of(26, 1), 10).value();
  const SessionId b = rig.exec.sessions().add(prompt_of(5, 2), 10).value();
  for (const std::int32_t w : {20, 1, 4, 2, 4, 7, 3}) REQUIRE(rig.exec.step(w).ok());
  CHECK(rig.exec.stats().decode_steps > 0);
  CHECK(rig.exec.stats().prefill_steps > 0);
  REQUIRE(rig.exec.run_until_idle().ok());
  CHECK(rig.output(a) == solo<Cells>(prompt_of(26, 1), 10));
  CHECK(rig.output(b) == solo<Cells>(prompt_of(5, 2), 10));
}

TEST_CASE("gpu executor: cells reused across rounds of sessions leak no K/V") {
  Rig<Cells> rig;
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    std::vector<SessionId> ids;
    for (std::int32_t i = 0; i < 4; ++i) ids.push_back(rig.exec.sessions().add(prompt_of(6 + 9 * i, 10 * round + i), 8).value());
    REQUIRE(rig.exec.run_until_idle().ok());
    for (std::int32_t i = 0; i < 4; ++i)
      CHECK(rig.output(ids[static_cast<std::size_t>(i)]) == solo<Cells>(prompt_of(6 + 9 * i, 10 * round + i), 8));
    for (const SessionId id : ids) REQUIRE(rig.exec.sessions().finish(id).ok());
    CHECK(rig.cache.host().free_cells() == rig.cache.host().capacity());
  }
}
