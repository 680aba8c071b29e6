// The example model on the GPU against the same model on the host reference path (an oracle in
// plain fp32 loops): the logits of every sampled row, at step widths run by the fused skinny GEMV
// (1, 3, 8, 16) and by cuBLAS (16 with the GEMV off, 20, and a wide prefill), graphs and eager,
// both layouts; the sampled token is the host rule's on the GPU's own logits; deferred ids (read
// on the device from the previous step's samples) equal the ids the host feeds. fp32 storage and
// arithmetic on both sides: the comparison is to 1e-4 of the largest logit.
#include <doctest/doctest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cellkv/batching/model.hpp"
#include "cellkv/batching/sampling.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "llama/gpu_llama.cuh"
#include "llama/host_llama.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::batching;
using Layers = Windows<0, 6>;

const llama::Config kConfig{.vocab = 160, .dim = 64, .layers = Layers::kLayers, .heads_q = 4, .heads_kv = 2,
                            .head_dim = 64, .ffn = 96, .seed = 5};
const CacheConfig kCacheConfig{.max_write = 48, .max_cells = 2048, .max_seqs = 24, .max_len = 80};
const gpu::PoolShape kShape{.layers = Layers::kLayers, .heads_kv = 2, .head_dim = 64, .heads_q = 4};

const llama::Weights& weights() {
  static const llama::Weights w = llama::generate(kConfig);
  return w;
}

// One model on the GPU and the same on the host, each with its cache, driven step by step.
template <class L, class P>
struct Pair {
  using GpuCache = gpu::DeviceCache<L, float, Layers, P, 32>;
  using HostCache = KVCache<L, Layers, P, 32>;
  gpu::Stream stream;
  GpuCache gpu_cache{kCacheConfig, kShape};
  HostCache host_cache{kCacheConfig};
  llama::GpuLlama<GpuCache> gpu_model;
  llama::HostLlama<HostCache> host_model{kConfig, weights(), host_cache};
  std::vector<std::int32_t> last_gpu, last_host;  // sampled ids of the last step

  explicit Pair(llama::GpuOptions options) : gpu_model(kConfig, weights(), gpu_cache, stream.get(), options) {}

  void new_sequences(std::int32_t n) {
    for (std::int32_t i = 0; i < n; ++i) {
      REQUIRE(gpu_cache.seq_new().value() == host_cache.seq_new().value());
    }
  }

  // One step on both: tokens of `seqs`, the last token of each run sampled with `sampling`, the
  // tokens at `deferred` rows read from the previous step's samples. Returns the worst logit
  // difference relative to the largest logit.
  double step(const std::vector<std::int32_t>& seqs, std::vector<std::int32_t> tokens,
              const std::vector<DeferredToken>& deferred, const SamplingParams& sampling) {
    const auto gp = gpu_cache.declare_step(seqs);
    const auto hp = host_cache.declare_step(seqs);
    REQUIRE(gp.ok());
    REQUIRE(hp.ok());
    REQUIRE(std::equal(gp.value().positions.begin(), gp.value().positions.end(), hp.value().positions.begin()));
    std::vector<std::int32_t> rows;
    for (std::size_t t = 0; t < seqs.size(); ++t)
      if (t + 1 == seqs.size() || seqs[t + 1] != seqs[t]) rows.push_back(static_cast<std::int32_t>(t));
    std::vector<SampleRow> params;
    for (std::size_t i = 0; i < rows.size(); ++i) params.push_back(make_sample_row(sampling, static_cast<std::uint32_t>(i)));
    for (const DeferredToken& d : deferred) tokens[static_cast<std::size_t>(d.row)] = kPendingToken;
    const Method m = seqs.size() == 1 ? Method::decode : Method::prefill;
    REQUIRE(gpu_model.forward({tokens, gp.value().positions, rows, params, deferred, m}).ok());
    REQUIRE(host_model.forward({tokens, hp.value().positions, rows, params, deferred, m}).ok());
    std::vector<std::int32_t> gt(rows.size()), ht(rows.size());
    std::vector<float> glp(rows.size()), hlp(rows.size());
    REQUIRE(gpu_model.retire(gt, glp).ok());
    REQUIRE(host_model.retire(ht, hlp).ok());
    double worst = 0;
    std::vector<float> g(static_cast<std::size_t>(kConfig.vocab));
    for (std::size_t i = 0; i < rows.size(); ++i) {
      REQUIRE(gpu_model.copy_logits(rows[i], g).ok());
      const auto h = host_model.last_logits().subspan(i * static_cast<std::size_t>(kConfig.vocab),
                                                      static_cast<std::size_t>(kConfig.vocab));
      double scale = 0, err = 0;
      for (std::size_t c = 0; c < g.size(); ++c) {
        scale = std::max(scale, std::abs(static_cast<double>(h[c])));
        err = std::max(err, std::abs(static_cast<double>(g[c]) - static_cast<double>(h[c])));
      }
      worst = std::max(worst, err / scale);
      CHECK(gt[i] == sample_row(g, params[i]).token);  // the rule, on the GPU's own logits
    }
    last_gpu = gt;
    last_host = ht;
    test::require_device_ok();
    return worst;
  }
};

template <class L, class P>
void logits_match(llama::GpuOptions options, const std::vector<std::int32_t>& widths) {
  Pair<L, P> pair(options);
  const std::int32_t n = *std::max_element(widths.begin(), widths.end());
  pair.new_sequences(n);
  // A prefill: 3 tokens of each sequence, in runs (two steps when it does not fit).
  for (std::int32_t first = 0; first < n; first += 16) {
    std::vector<std::int32_t> seqs, tokens;
    for (std::int32_t s = first; s < std::min(n, first + 16); ++s)
      for (std::int32_t t = 0; t < 3; ++t) {
        seqs.push_back(s);
        tokens.push_back((s * 37 + t * 11 + 1) % kConfig.vocab);
      }
    CHECK(pair.step(seqs, tokens, {}, {}) < 1e-4);
  }
  // Decode steps of each width: sequences 0..w-1, one token each; even steps take the ids sampled
  // by the step before from the device (the sequences of the previous step, in the same order).
  std::int32_t previous = 0;
  for (std::size_t k = 0; k < widths.size(); ++k) {
    const std::int32_t w = widths[k];
    CAPTURE(w);
    std::vector<std::int32_t> seqs, tokens;
    std::vector<DeferredToken> deferred;
    for (std::int32_t s = 0; s < w; ++s) {
      seqs.push_back(s);
      tokens.push_back((s * 13 + static_cast<std::int32_t>(k)) % kConfig.vocab);
      if (k % 2 == 1 && s < previous && s < static_cast<std::int32_t>(pair.last_gpu.size())) {
        REQUIRE(pair.last_gpu[static_cast<std::size_t>(s)] == pair.last_host[static_cast<std::size_t>(s)]);
        deferred.push_back({s, s});
      }
    }
    const SamplingParams sampling = k % 3 == 2 ? SamplingParams{.temperature = 0.9f, .top_k = 30, .seed = 3} : SamplingParams{};
    CHECK(pair.step(seqs, tokens, deferred, sampling) < 1e-4);
    CHECK(pair.last_gpu == pair.last_host);
    previous = w;
  }
}

}  // namespace

TEST_CASE("gpu model: logits equal the host model's through the skinny GEMV, graphs (cell layout)") {
  logits_match<layout::cell, placement::clustered<64>>({}, {1, 3, 8, 16, 8, 1, 2, 4});
}

TEST_CASE("gpu model: logits equal the host model's through the skinny GEMV, eager (sequence layout)") {
  logits_match<layout::sequence, placement::lowest_free>({.graphs = false}, {1, 3, 5, 16, 7, 2});
}

TEST_CASE("gpu model: logits equal the host model's through cuBLAS") {
  logits_match<layout::cell, placement::clustered<64>>({.max_gemv_width = 0}, {1, 3, 16, 20, 24, 2});
  logits_match<layout::sequence, placement::lowest_free>({.max_graph_width = 8}, {20, 24, 17, 9});
}

TEST_CASE("gpu model: a profiled step records its phases; the sampler then runs outside the graph") {
  Pair<layout::cell, placement::clustered<64>> pair({.profile = true});
  pair.new_sequences(4);
  CHECK(pair.step({0, 0, 1, 2, 3}, {1, 2, 3, 4, 5}, {}, {}) < 1e-4);
  CHECK(pair.step({0, 1, 2, 3}, {0, 0, 0, 0}, {{0, 0}, {1, 1}, {2, 2}, {3, 3}}, {.temperature = 1.f, .seed = 2}) < 1e-4);
  CHECK(pair.last_gpu == pair.last_host);
  const llama::PhaseTimes& t = pair.gpu_model.phase_times();
  CHECK(t.steps == 2);
  CHECK((t.upload_ms >= 0 && t.forward_ms > 0 && t.sampling_ms > 0 && t.copy_ms >= 0 && t.idle_ms >= 0));
  pair.gpu_model.reset_phase_times();
  CHECK(pair.gpu_model.phase_times().steps == 0);
}

TEST_CASE("gpu model: refusals enqueue nothing") {
  Pair<layout::cell, placement::clustered<64>> pair({});
  pair.new_sequences(2);
  const std::int32_t seqs[] = {0, 1};
  REQUIRE(pair.gpu_cache.declare_step(seqs).ok());
  const auto plan = pair.gpu_cache.host().step();
  const std::int32_t tokens[] = {1, kPendingToken};
  const std::int32_t rows[] = {0, 1};
  const SampleRow params[] = {SampleRow{}, SampleRow{}};
  const DeferredToken no_source[] = {{1, 0}};  // no previous step sampled anything
  CHECK(pair.gpu_model.forward({tokens, plan.positions, rows, params, no_source, Method::prefill}) == Errc::bad_argument);
  CHECK(pair.gpu_model.forward({tokens, plan.positions, rows, std::span<const SampleRow>(params, 1), {}, Method::prefill}) ==
        Errc::bad_argument);
  std::int32_t out[2];
  float lp[2];
  CHECK(pair.gpu_model.retire(out, lp) == Errc::bad_argument);  // nothing in flight
  test::require_device_ok();
}

// bf16 through the tensor-core GEMV (widths 4 to 16, padded to 8 and 16 rows): logits against the
// fp32 host model within bf16 rounding. Tokens are fed explicitly: bf16 and fp32 may sample
// differently.
TEST_CASE("gpu model: bf16 through the tensor-core GEMV matches the fp32 host model within bf16 rounding") {
  using Cache = gpu::DeviceCache<layout::cell, __nv_bfloat16, Layers, placement::clustered<64>, 32>;
  using HostCache = KVCache<layout::cell, Layers, placement::clustered<64>, 32>;
  const llama::Config config{.vocab = 160, .dim = 256, .layers = Layers::kLayers, .heads_q = 4, .heads_kv = 2,
                             .head_dim = 64, .ffn = 512, .seed = 9};
  const llama::Weights w = llama::generate(config);
  gpu::Stream stream;
  Cache gpu_cache(kCacheConfig, kShape);
  HostCache host_cache(kCacheConfig);
  llama::GpuLlama<Cache> gpu(config, w, gpu_cache, stream.get());
  llama::HostLlama<HostCache> host(config, w, host_cache);
  for (int s = 0; s < 16; ++s) {
    REQUIRE(gpu_cache.seq_new().ok());
    REQUIRE(host_cache.seq_new().ok());
  }
  double worst = 0;
  for (const std::int32_t width : {16, 4, 8, 16, 12, 5}) {
    CAPTURE(width);
    std::vector<std::int32_t> seqs, tokens, rows;
    for (std::int32_t s = 0; s < width; ++s) {
      seqs.push_back(s);
      tokens.push_back((s * 31 + width * 7) % config.vocab);
      rows.push_back(s);
    }
    const std::vector<SampleRow> params(rows.size(), make_sample_row({}, 0));
    const auto g = gpu_cache.declare_step(seqs), h = host_cache.declare_step(seqs);
    REQUIRE((g.ok() && h.ok()));
    REQUIRE(gpu.forward({tokens, g.value().positions, rows, params, {}, Method::prefill}).ok());
    REQUIRE(host.forward({tokens, h.value().positions, rows, params, {}, Method::prefill}).ok());
    std::vector<std::int32_t> out(rows.size());
    std::vector<float> lp(rows.size());
    REQUIRE(gpu.retire(out, lp).ok());
    REQUIRE(host.retire(out, lp).ok());
    std::vector<float> gl(static_cast<std::size_t>(config.vocab));
    for (std::size_t i = 0; i < rows.size(); ++i) {
      REQUIRE(gpu.copy_logits(rows[i], gl).ok());
      const auto hl = host.last_logits().subspan(i * gl.size(), gl.size());
      double scale = 0, err = 0;
      for (std::size_t c = 0; c < gl.size(); ++c) {
        scale = std::max(scale, std::abs(static_cast<double>(hl[c])));
        err = std::max(err, std::abs(static_cast<double>(gl[c]) - static_cast<double>(hl[c])));
      }
      worst = std::max(worst, err / scale);
    }
  }
  CAPTURE(worst);
  CHECK(worst < 5e-2);  // bf16 weights and activations against fp32
  test::require_device_ok();
}
