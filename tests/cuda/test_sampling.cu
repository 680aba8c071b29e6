// The device sampler against the host rule (cellkv::batching::sample_row, itself checked against a
// float64 oracle in the host suite): for bitwise identical logits the same token for every
// parameter combination (greedy, temperature, top-k with ties, top-p, min-p), vocabularies from 1
// to past what fits in shared memory, both the shared-memory and the global path, only the rows
// below the device-side count written, log-probs within fp32 rounding; and one launch captured in
// a CUDA graph serving later rows, counts and parameters.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cellkv/batching/device_sampling.cuh"
#include "cellkv/batching/sampling.hpp"
#include "cellkv/gpu/graph.hpp"
#include "cellkv/gpu/stream.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using test::DeviceArray;

// Rows of logits: normal values, or values on a coarse grid (many ties), with a -inf here and there.
std::vector<float> make_logits(std::mt19937_64& rng, std::int32_t rows, std::int32_t vocab, bool ties) {
  std::normal_distribution<float> d(0.f, 2.f);
  std::vector<float> l(static_cast<std::size_t>(rows) * static_cast<std::size_t>(vocab));
  for (std::size_t i = 0; i < l.size(); ++i) {
    float x = d(rng);
    if (ties) x = std::round(x * 2.f) / 2.f;
    if (i % 97 == 13) x = -std::numeric_limits<float>::infinity();
    l[i] = x;
  }
  return l;
}

SampleRow params_of(std::uint32_t k, std::int32_t vocab) {
  SamplingParams p;
  const float temperatures[] = {0.f, 0.5f, 1.f, 1.7f};
  const std::int32_t top_ks[] = {0, 1, 3, 40};
  const float top_ps[] = {1.f, 0.92f, 0.5f, 1e-6f};
  const float min_ps[] = {0.f, 0.02f, 0.3f};
  p.temperature = temperatures[k % 4];
  p.top_k = top_ks[(k / 4) % 4] % (vocab + 1);
  p.top_p = top_ps[(k / 16) % 4];
  p.min_p = min_ps[(k / 64) % 3];
  p.seed = 0x1234567ull * (k + 1);
  p.logprobs = k % 2 == 0;
  return make_sample_row(p, k * 7 + 1);
}

// Samples `count` of `rows` logit rows (every other row, backwards) on the device and on the host.
void compare(std::int32_t vocab, std::int32_t rows, bool ties, SamplerOptions options, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<float> logits = make_logits(rng, rows, vocab, ties);
  const std::int32_t count = (rows + 1) / 2;
  std::vector<std::int32_t> pick(static_cast<std::size_t>(count));
  std::vector<SampleRow> params(static_cast<std::size_t>(count));
  for (std::int32_t j = 0; j < count; ++j) {
    pick[static_cast<std::size_t>(j)] = rows - 1 - 2 * j;
    params[static_cast<std::size_t>(j)] = params_of(static_cast<std::uint32_t>(j + seed * 31), vocab);
  }
  DeviceArray<float> d_logits(logits);
  DeviceArray<std::int32_t> d_count(std::vector<std::int32_t>{count});
  DeviceArray<std::int32_t> d_rows(pick);
  DeviceArray<SampleRow> d_params(params);
  DeviceArray<SampledOut> d_out(static_cast<std::size_t>(rows));
  d_out.fill({-7, 99.f});
  gpu::Stream stream;
  const SamplerView v{d_logits.data(), vocab, vocab, d_count.data(), d_rows.data(), d_params.data(), d_out.data()};
  REQUIRE(launch_sampler(v, rows, stream, options).ok());
  stream.synchronize();
  const std::vector<SampledOut> got = d_out.download();
  std::int32_t sampled = 0;
  for (std::int32_t j = 0; j < count; ++j) {
    CAPTURE(vocab);
    CAPTURE(j);
    const SampleRow& p = params[static_cast<std::size_t>(j)];
    CAPTURE(p.top_k);
    CAPTURE(p.top_p);
    CAPTURE(p.inv_temperature);
    CAPTURE(p.min_p_offset);
    const auto row = std::span<const float>(logits).subspan(
        static_cast<std::size_t>(pick[static_cast<std::size_t>(j)]) * static_cast<std::size_t>(vocab),
        static_cast<std::size_t>(vocab));
    const Sampled want = sample_row(row, p);
    CHECK(got[static_cast<std::size_t>(j)].token == want.token);
    if ((p.flags & kWantLogprob) != 0u)
      CHECK(std::abs(got[static_cast<std::size_t>(j)].logprob - want.logprob) < 1e-4f + 1e-5f * std::abs(want.logprob));
    sampled += want.token != argmax(row);
  }
  for (std::int32_t j = count; j < rows; ++j) CHECK(got[static_cast<std::size_t>(j)].token == -7);  // not written
  if (vocab > 8 && count > 16) CHECK(sampled > 0);
  test::require_device_ok();
}

}  // namespace

TEST_CASE("device sampler: the host rule's token for every parameter mix, shared-memory path") {
  for (const std::int32_t vocab : {1, 2, 7, 100, 1000, 4099, 16384}) {
    CAPTURE(vocab);
    compare(vocab, 97, false, {}, 1);
    compare(vocab, 97, true, {}, 2);
  }
}

TEST_CASE("device sampler: the global-memory path and a vocabulary past shared memory") {
  for (const std::int32_t vocab : {3, 1000, 16384}) {
    CAPTURE(vocab);
    compare(vocab, 64, true, {.cache_in_shared = false}, 3);
  }
  compare(40000, 24, false, {}, 4);  // 320 KB of keys and masses: recomputed from global memory
  CHECK_FALSE(sampler_caches(40000).value());
  CHECK(sampler_caches(16384).value());
}

TEST_CASE("device sampler: one captured launch serves later counts, rows and parameters") {
  constexpr std::int32_t kVocab = 3000, kRows = 12;
  std::mt19937_64 rng(9);
  DeviceArray<float> d_logits(static_cast<std::size_t>(kRows) * kVocab);
  DeviceArray<std::int32_t> d_count(1), d_rows(static_cast<std::size_t>(kRows));
  DeviceArray<SampleRow> d_params(static_cast<std::size_t>(kRows));
  DeviceArray<SampledOut> d_out(static_cast<std::size_t>(kRows));
  gpu::Stream stream;
  const SamplerView v{d_logits.data(), kVocab, kVocab, d_count.data(), d_rows.data(), d_params.data(), d_out.data()};
  Status inside;
  const gpu::GraphExec graph = gpu::capture(stream, [&] { inside = launch_sampler(v, kRows, stream); });
  REQUIRE(inside.ok());
  for (std::int32_t round = 0; round < 4; ++round) {
    CAPTURE(round);
    const std::vector<float> logits = make_logits(rng, kRows, kVocab, round % 2 == 1);
    const std::int32_t count = 3 + 3 * round;
    std::vector<std::int32_t> rows(static_cast<std::size_t>(kRows), 0);
    std::vector<SampleRow> params(static_cast<std::size_t>(kRows));
    for (std::int32_t j = 0; j < count; ++j) {
      rows[static_cast<std::size_t>(j)] = (j * 5 + round) % kRows;
      params[static_cast<std::size_t>(j)] = params_of(static_cast<std::uint32_t>(j + 11 * round), kVocab);
    }
    d_logits.upload(logits);
    d_count.upload({count});
    d_rows.upload(rows);
    d_params.upload(params);
    REQUIRE(graph.replay(stream).ok());
    stream.synchronize();
    const std::vector<SampledOut> got = d_out.download();
    for (std::int32_t j = 0; j < count; ++j) {
      const auto row = std::span<const float>(logits).subspan(
          static_cast<std::size_t>(rows[static_cast<std::size_t>(j)]) * kVocab, kVocab);
      CHECK(got[static_cast<std::size_t>(j)].token == sample_row(row, params[static_cast<std::size_t>(j)]).token);
    }
  }
  test::require_device_ok();
}

TEST_CASE("device sampler: bad launches are refused") {
  const SamplerView empty{};
  gpu::Stream stream;
  CHECK(launch_sampler(empty, 4, stream) == Errc::bad_argument);
  SamplerView v{};
  v.vocab = 10;
  v.stride = 10;
  CHECK(launch_sampler(v, 0, stream) == Errc::bad_argument);
  v.stride = 9;
  CHECK(launch_sampler(v, 4, stream) == Errc::bad_argument);
}
