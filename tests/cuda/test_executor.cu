// The executor on the GPU with the example decoder (skinny GEMV or cuBLAS, CUDA graphs per step
// width, sampling on the device, steps overlapped): batched generation equals solo generation
// token for token for sessions with different prompt lengths and a fork, greedy and with seeded
// sampling; graph replay equals eager execution; overlap equals no overlap; the skinny GEMV equals
// cuBLAS; the GPU equals the host reference path; a hand-made schedule of widths 20, 1, 4, 2, 4,
// 7, 3 with partial prefills matches; a stop token ends its session and the token after it is
// discarded and rewound; cells reused across rounds leak nothing; n samples of a prompt
// (add_samples) share the leader's prompt cells and each equals a solo run with its own seed. The
// model computes in fp32 (storage and GEMMs), so a session alone and in a batch agree up to fp32
// rounding: the comparison is in fp32, as bf16 rounding of different batch shapes could flip a
// near-tie. Context shift: sessions (and a fork sharing prompt cells) that outgrow their budget
// shift, their K re-rotated on the device by the key rotation the model set, and generate the
// same tokens as on the host reference path, without overlap and alone; a device cache without a
// key rotation, and the sequence layout, refuse the option.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "cellkv/batching/executor.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "llama/gpu_llama.cuh"
#include "llama/host_llama.hpp"
#include "../host/executor_cases.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using test::kSessionSampling;
using test::outputs_of;
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
  explicit Rig(llama::GpuOptions options = {}, ExecutorOptions exec_options = {}, const SessionLimits& limits = kLimits)
      : model(kConfig, weights(), cache, stream.get(), options), exec(model, cache, limits, exec_options) {}
  std::vector<std::int32_t> output(SessionId id) const {
    const auto out = exec.sessions().output(id).value();
    return {out.begin(), out.end()};
  }
};

template <class C>
std::vector<std::int32_t> solo(const std::vector<std::int32_t>& prompt, std::int32_t max_new,
                               const SamplingParams& sampling = {}) {
  Rig<C> rig;
  const SessionId id = rig.exec.sessions().add(prompt, max_new, sampling).value();
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

namespace {

const std::int32_t kLengths[] = {1, 4, 13, 31, 50};

// Five sessions with kSessionSampling's parameters run to the end through `exec`; their tokens.
template <class E>
std::vector<std::vector<std::int32_t>> run_sampled(E& exec) {
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 5; ++i)
    ids.push_back(exec.sessions().add(prompt_of(kLengths[i], i), 16, kSessionSampling[i]).value());
  for (const std::int32_t w : {5, 24, 2}) REQUIRE(exec.step(w).ok());
  REQUIRE(exec.run_until_idle().ok());
  return outputs_of(exec, std::span<const SessionId>(ids));
}

using HostCells = CellCache<Model, placement::clustered<64>, 16>;

}  // namespace

TEST_CASE("gpu executor: seeded sampling equals solo, no overlap, cuBLAS, and the host reference path") {
  Rig<Cells> rig;
  const auto batched = run_sampled(rig.exec);
  Rig<Cells> no_overlap({}, {.overlap = false});
  CHECK(run_sampled(no_overlap.exec) == batched);
  Rig<Slots> cublas({.max_gemv_width = 0});
  CHECK(run_sampled(cublas.exec) == batched);
  HostCells host_cache(kCacheConfig);
  llama::HostLlama<HostCells> host_model(kConfig, weights(), host_cache);
  Executor host(host_model, host_cache, kLimits);
  CHECK(run_sampled(host) == batched);
  std::int32_t greedy_differs = 0;
  for (std::int32_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(batched[static_cast<std::size_t>(i)] == solo<Cells>(prompt_of(kLengths[i], i), 16, kSessionSampling[i]));
    greedy_differs += batched[static_cast<std::size_t>(i)] != solo<Cells>(prompt_of(kLengths[i], i), 16);
  }
  CHECK(greedy_differs >= 3);
  CHECK(rig.model.graph_stats().replays > 0);
  cellkv::test::require_device_ok();
}

TEST_CASE("gpu executor: a stop token ends a session; the token sampled after it is discarded and rewound") {
  const auto free_run = solo<Cells>(prompt_of(9, 4), 12);
  std::size_t at = 2;  // the first token that did not appear before it
  while (at < free_run.size() && std::find(free_run.begin(), free_run.begin() + static_cast<std::ptrdiff_t>(at),
                                           free_run[at]) != free_run.begin() + static_cast<std::ptrdiff_t>(at))
    ++at;
  REQUIRE(at < free_run.size());
  Rig<Cells> rig;
  const SessionId id = rig.exec.sessions().add(prompt_of(9, 4), 12, {.stop_tokens = {free_run[at]}}).value();
  const SessionId other = rig.exec.sessions().add(prompt_of(6, 1), 12).value();
  REQUIRE(rig.exec.run_until_idle().ok());
  CHECK(rig.output(id) == std::vector<std::int32_t>(free_run.begin(), free_run.begin() + static_cast<std::ptrdiff_t>(at) + 1));
  CHECK(rig.output(other) == solo<Cells>(prompt_of(6, 1), 12));
  CHECK(rig.exec.stats().tokens_discarded == 1);
  const std::int32_t seq = rig.exec.sessions().sequence_of(id).value();
  CHECK(rig.cache.host().pos(seq).value() == rig.exec.sessions().cached_tokens(id).value());
  CHECK(rig.exec.sessions().cached_tokens(id).value() == 9 + static_cast<std::int32_t>(at));
  cellkv::test::require_device_ok();
}

TEST_CASE("gpu executor: n samples of a prompt equal each sample run alone with its seed") {
  const SamplingParams hot{.temperature = 1.f, .top_p = 0.9f, .seed = 31};
  Rig<Cells> rig;
  const SessionId plain = rig.exec.sessions().add(prompt_of(13, 2), 12).value();
  const auto ids = rig.exec.sessions().add_samples(prompt_of(50, 3), 16, hot, 4).value();
  REQUIRE(ids.size() == 4);
  while (rig.exec.sessions().leader_of(ids[1]).value() != 0) REQUIRE(rig.exec.step().ok());
  // Every sample holds the leader's cells for the prompt but its last token.
  const auto& host = rig.cache.host();
  const std::int32_t leader_seq = rig.exec.sessions().sequence_of(ids[0]).value();
  for (std::size_t i = 1; i < ids.size(); ++i) {
    const std::int32_t seq = rig.exec.sessions().sequence_of(ids[i]).value();
    for (std::int32_t p = 0; p < 49; ++p) CHECK(host.cell_of(seq, p) == host.cell_of(leader_seq, p));
  }
  REQUIRE(rig.exec.run_until_idle().ok());
  CHECK(rig.output(plain) == solo<Cells>(prompt_of(13, 2), 12));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    CAPTURE(i);
    SamplingParams own = hot;
    own.seed = 31 + i;
    CHECK(rig.output(ids[i]) == solo<Cells>(prompt_of(50, 3), 16, own));
  }
  CHECK(rig.model.graph_stats().replays > 0);
  cellkv::test::require_device_ok();
}

namespace {

const SessionLimits kShiftLimits{.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = 40,
                                 .context_shift = {.enabled = true, .keep = 6}};
const std::int32_t kShiftLengths[] = {5, 19, 33};

// Three sessions and a fork of the third (sharing its prompt cells past `keep`), each generating
// far past the budget of 40 positions; returns their tokens.
template <class Exec>
std::vector<std::vector<std::int32_t>> run_shifting(Exec& exec) {
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 3; ++i)
    ids.push_back(exec.sessions().add(prompt_of(kShiftLengths[i], 20 + i), 70, kSessionSampling[i]).value());
  for (int s = 0; s < 3; ++s) REQUIRE(exec.step().ok());
  ids.push_back(exec.sessions().clone(ids[2], 60, kSessionSampling[3]).value());
  REQUIRE(exec.run_until_idle().ok());
  CHECK(exec.stats().context_shifts >= 8);
  for (const SessionId id : ids) CHECK(exec.sessions().context_shifts(id).value() >= 1);
  return outputs_of(exec, std::span<const SessionId>(ids));
}

}  // namespace

TEST_CASE("gpu executor: context shift equals the host reference path, no overlap and solo runs") {
  Rig<Cells> rig({}, {}, kShiftLimits);
  const auto batched = run_shifting(rig.exec);
  Rig<Cells> no_overlap({}, {.overlap = false}, kShiftLimits);
  CHECK(run_shifting(no_overlap.exec) == batched);
  HostCells host_cache(kCacheConfig);
  llama::HostLlama<HostCells> host_model(kConfig, weights(), host_cache);
  Executor host(host_model, host_cache, kShiftLimits);
  CHECK(run_shifting(host) == batched);
  for (std::int32_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    Rig<Cells> alone({}, {}, kShiftLimits);
    const SessionId id = alone.exec.sessions().add(prompt_of(kShiftLengths[i], 20 + i), 70, kSessionSampling[i]).value();
    REQUIRE(alone.exec.run_until_idle().ok());
    CHECK(alone.output(id) == batched[static_cast<std::size_t>(i)]);
  }
  CHECK(rig.model.graph_stats().replays > 0);
  cellkv::test::require_device_ok();
}

TEST_CASE("gpu executor: context shift is refused without a key rotation and on the sequence layout") {
  Cells bare(kCacheConfig, kShape);
  CHECK(SessionTable<Cells>::validate(kShiftLimits, bare) == Errc::no_key_rotation);
  CHECK(SessionTable<Cells>::validate(kLimits, bare).ok());
  gpu::Stream stream;
  llama::GpuLlama<Cells> model(kConfig, weights(), bare, stream.get());  // sets the model's RoPE
  CHECK(bare.key_rotation_set());
  CHECK(SessionTable<Cells>::validate(kShiftLimits, bare).ok());
  Slots slots(kCacheConfig, kShape);
  llama::GpuLlama<Slots> slot_model(kConfig, weights(), slots, stream.get());
  CHECK(SessionTable<Slots>::validate(kShiftLimits, slots) == Errc::unsupported_by_layout);
  CHECK_THROWS_AS(Executor(slot_model, slots, kShiftLimits), std::invalid_argument);
  cellkv::test::require_device_ok();
}
