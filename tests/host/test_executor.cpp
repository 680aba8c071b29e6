// The executor on the host reference path with the example decoder: batched generation equals
// solo generation token for token (different prompt lengths, a fork), a hand-made schedule of
// widths 20, 1, 4, 2, 4, 7, 3 with partial prefills uses both methods and still matches, and cells
// reused across rounds of sessions leak nothing. The host path computes in fp32 with a fixed
// summation order per row, so equality is exact up to float ties.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "cellkv/batching/executor.hpp"
#include "cellkv/cell_cache.hpp"
#include "llama/host_llama.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using Model = Windows<0, 6>;  // a full-history layer and a sliding-window layer
using Cells = CellCache<layout::cell, Model, placement::lowest_free, 16>;
using Slots = CellCache<layout::sequence, Model, placement::lowest_free, 16>;

const llama::Config kConfig{.vocab = 64, .dim = 32, .layers = Model::kLayers, .heads_q = 4, .heads_kv = 2, .head_dim = 8,
                            .ffn = 48, .seed = 7};
const SessionLimits kLimits{.max_write = 24, .min_prefill_tokens = 2, .max_tokens_per_session = 96};
const CacheConfig kCacheConfig{.max_write = 24, .max_cells = 600, .max_seqs = 8, .max_len = 96};

const llama::Weights& weights() {
  static const llama::Weights w = llama::generate(kConfig);
  return w;
}

std::vector<std::int32_t> prompt_of(std::int32_t len, std::int32_t salt) {
  std::vector<std::int32_t> p;
  for (std::int32_t t = 0; t < len; ++t) p.push_back((t * 17 + salt * 5 + 3) % kConfig.vocab);
  return p;
}

// The tokens one session generates alone in a fresh cache.
template <class Cache>
std::vector<std::int32_t> solo(const std::vector<std::int32_t>& prompt, std::int32_t max_new) {
  Cache cache(kCacheConfig);
  llama::HostLlama<Cache> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const SessionId id = exec.sessions().add(prompt, max_new).value();
  REQUIRE(exec.run_until_idle().ok());
  const auto out = exec.sessions().output(id).value();
  return {out.begin(), out.end()};
}

template <class Cache>
std::vector<std::int32_t> output_of(const Executor<llama::HostLlama<Cache>, Cache>& exec, SessionId id) {
  const auto out = exec.sessions().output(id).value();
  return {out.begin(), out.end()};
}

template <class Cache>
void batched_equals_solo() {
  Cache cache(kCacheConfig);
  llama::HostLlama<Cache> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const std::int32_t lengths[] = {1, 3, 9, 17, 30};
  std::vector<SessionId> ids;
  for (std::int32_t i = 0; i < 5; ++i) ids.push_back(exec.sessions().add(prompt_of(lengths[i], i), 12).value());
  for (int s = 0; s < 3; ++s) REQUIRE(exec.step().ok());
  const SessionId fork = exec.sessions().clone(ids[2], 12).value();  // shares session 2's prompt cells
  REQUIRE(exec.run_until_idle().ok());
  for (std::int32_t i = 0; i < 5; ++i) {
    CAPTURE(i);
    CHECK(output_of(exec, ids[static_cast<std::size_t>(i)]) == solo<Cache>(prompt_of(lengths[i], i), 12));
  }
  CHECK(output_of(exec, fork) == solo<Cache>(prompt_of(9, 2), 12));
  CHECK(exec.stats().decode_steps + exec.stats().prefill_steps == exec.stats().steps);
}

}  // namespace

TEST_CASE("host executor: batched generation equals solo generation (cell layout)") { batched_equals_solo<Cells>(); }

TEST_CASE("host executor: batched generation equals solo generation (sequence layout)") { batched_equals_solo<Slots>(); }

TEST_CASE("host executor: a hand-made schedule of widths 20, 1, 4, 2, 4, 7, 3 matches solo generation") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const SessionId a = exec.sessions().add(prompt_of(26, 1), 10).value();  // prefills 20, then partial
  const SessionId b = exec.sessions().add(prompt_of(5, 2), 10).value();
  const std::int32_t widths[] = {20, 1, 4, 2, 4, 7, 3};
  std::vector<std::int32_t> ran;
  for (const std::int32_t w : widths) {
    const auto r = exec.step(w);
    REQUIRE(r.ok());
    CHECK(r.value() <= w);
    ran.push_back(r.value());
  }
  CHECK(ran.front() == 20);  // the first step is a's 20-token prefill
  CHECK(exec.stats().decode_steps > 0);
  CHECK(exec.stats().prefill_steps > 0);
  REQUIRE(exec.run_until_idle().ok());
  CHECK(output_of(exec, a) == solo<Cells>(prompt_of(26, 1), 10));
  CHECK(output_of(exec, b) == solo<Cells>(prompt_of(5, 2), 10));
  CHECK(exec.step(25).status() == Errc::bad_argument);  // wider than max_write
}

TEST_CASE("host executor: cells reused across rounds of sessions leak no K/V") {
  Cells cache(kCacheConfig);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    std::vector<SessionId> ids;
    for (std::int32_t i = 0; i < 4; ++i) ids.push_back(exec.sessions().add(prompt_of(6 + 7 * i, 10 * round + i), 8).value());
    REQUIRE(exec.run_until_idle().ok());
    for (std::int32_t i = 0; i < 4; ++i)
      CHECK(output_of(exec, ids[static_cast<std::size_t>(i)]) == solo<Cells>(prompt_of(6 + 7 * i, 10 * round + i), 8));
    for (const SessionId id : ids) REQUIRE(exec.sessions().finish(id).ok());
    CHECK(cache.free_cells() == cache.capacity());  // every cell back, to be reused next round
  }
}

TEST_CASE("host executor: a step that cannot be placed is refused and changes nothing") {
  const CacheConfig tiny{.max_write = 24, .max_cells = 12, .max_seqs = 8};
  Cells cache(tiny);
  llama::HostLlama<Cells> model(kConfig, weights(), cache);
  Executor exec(model, cache, kLimits);
  const SessionId id = exec.sessions().add(prompt_of(20, 3), 4).value();
  const Cells before = cache;
  CHECK(exec.step().status() == Errc::out_of_cells);  // 20 prompt tokens, 12 cells
  CHECK(cache == before);
  CHECK(exec.sessions().cached_tokens(id).value() == 0);
  CHECK(exec.step(10).ok());  // a narrower step fits
}
