// Tensor-parallel sharding on the host: head_shard partitions the heads and keeps every query
// head with its KV head (checked by brute force against the GQA formula h / group); the example
// model's weight split reproduces the unsplit products (column splits exactly, row splits as a sum,
// against a float64 product); and one host plan drives G shard pools whose attention equals the
// unsharded attention's columns, for both layouts, through forks and removals.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/reference.hpp"
#include "cellkv/sharding.hpp"
#include "llama/shard_weights.hpp"
#include "support.hpp"

namespace {

using namespace cellkv;

std::vector<float> random_floats(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// y [rows, out] = x [rows, in] W [in, out] in float64.
std::vector<double> product64(const std::vector<float>& x, const std::vector<float>& w, std::int32_t in,
                              std::int32_t out) {
  const std::size_t rows = x.size() / static_cast<std::size_t>(in);
  std::vector<double> y(rows * static_cast<std::size_t>(out), 0.0);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::int32_t i = 0; i < in; ++i)
      for (std::int32_t o = 0; o < out; ++o)
        y[r * static_cast<std::size_t>(out) + static_cast<std::size_t>(o)] +=
            static_cast<double>(x[r * static_cast<std::size_t>(in) + static_cast<std::size_t>(i)]) *
            w[static_cast<std::size_t>(i) * static_cast<std::size_t>(out) + static_cast<std::size_t>(o)];
  return y;
}

}  // namespace

TEST_CASE("head_shard: shards partition the heads and every query head sits with its KV head") {
  for (std::int32_t heads_kv = 1; heads_kv <= 16; ++heads_kv)
    for (std::int32_t group = 1; group <= 4; ++group)
      for (std::int32_t shards = 1; shards <= 8; ++shards) {
        const std::int32_t heads_q = heads_kv * group;
        if (heads_kv % shards != 0) {
          CHECK(head_shard(heads_q, heads_kv, shards, 0).status() == Errc::bad_shape);
          continue;
        }
        std::vector<int> q_owner(static_cast<std::size_t>(heads_q), -1), kv_owner(static_cast<std::size_t>(heads_kv), -1);
        for (std::int32_t g = 0; g < shards; ++g) {
          const Result<HeadShard> s = head_shard(heads_q, heads_kv, shards, g);
          REQUIRE(s.ok());
          CHECK(s.value().q.count * shards == heads_q);
          for (std::int32_t h = s.value().q.first; h < s.value().q.end(); ++h) {
            CHECK(q_owner[static_cast<std::size_t>(h)] == -1);
            q_owner[static_cast<std::size_t>(h)] = g;
            // The shard's local query head h - q.first reads local KV head (h - q.first) / group,
            // which must be the model's KV head h / group renumbered from kv.first.
            CHECK((h - s.value().q.first) / group == h / group - s.value().kv.first);
          }
          for (std::int32_t h = s.value().kv.first; h < s.value().kv.end(); ++h) {
            CHECK(kv_owner[static_cast<std::size_t>(h)] == -1);
            kv_owner[static_cast<std::size_t>(h)] = g;
          }
        }
        for (std::int32_t h = 0; h < heads_q; ++h) {
          CHECK(q_owner[static_cast<std::size_t>(h)] >= 0);
          CHECK(q_owner[static_cast<std::size_t>(h)] == kv_owner[static_cast<std::size_t>(h / group)]);
        }
      }
}

TEST_CASE("head_shard and even_part refuse what does not split") {
  CHECK(head_shard(8, 4, 0, 0).status() == Errc::bad_argument);   // no shards
  CHECK(head_shard(8, 4, 2, 2).status() == Errc::bad_argument);   // g past the last shard
  CHECK(head_shard(8, 4, 2, -1).status() == Errc::bad_argument);  // negative g
  CHECK(head_shard(8, 4, 3, 0).status() == Errc::bad_shape);  // 4 KV heads over 3
  CHECK(head_shard(6, 4, 2, 0).status() == Errc::bad_head_ratio); // H_q not a multiple of H_kv
  CHECK(head_shard(8, 0, 2, 0).status() == Errc::bad_head_ratio);
  CHECK(even_part(10, 4, 0).status() == Errc::bad_shape);
  CHECK(even_part(0, 1, 0).status() == Errc::bad_argument);
  CHECK(even_part(12, 4, 3).value() == ShardRange{9, 3});
  llama::Config c;
  c.ffn = 250;  // 250 hidden columns over 4 shards
  CHECK(llama::shard_plan(c, 4, 0).status() == Errc::bad_shape);
  CHECK(llama::shard_plan(c, 2, 1).ok());
}

TEST_CASE("shard_weights: column splits reproduce the model's columns, row splits sum to its product") {
  llama::Config c;
  c.dim = 32, c.heads_q = 8, c.heads_kv = 4, c.head_dim = 8, c.ffn = 64, c.layers = 1, c.vocab = 16;
  const llama::Weights w = llama::generate(c);
  const llama::LayerWeights& full = w.layers[0];
  std::mt19937 rng(7);
  const std::int32_t rows = 3;
  const auto h = random_floats(static_cast<std::size_t>(rows * c.dim), rng);
  const auto attn = random_floats(static_cast<std::size_t>(rows * c.q_width()), rng);
  const auto hidden = random_floats(static_cast<std::size_t>(rows * c.ffn), rng);
  const auto q_full = product64(h, full.wq, c.dim, c.q_width());
  const auto k_full = product64(h, full.wk, c.dim, c.kv_width());
  const auto up_full = product64(h, full.w1, c.dim, c.ffn);
  const auto o_full = product64(attn, full.wo, c.q_width(), c.dim);
  const auto down_full = product64(hidden, full.w2, c.ffn, c.dim);
  for (const std::int32_t G : {1, 2, 4}) {
    CAPTURE(G);
    std::vector<double> o_sum(o_full.size(), 0.0), down_sum(down_full.size(), 0.0);
    for (std::int32_t g = 0; g < G; ++g) {
      const auto plan = llama::shard_plan(c, G, g);
      REQUIRE(plan.ok());
      const llama::Config sc = llama::shard_config(c, plan.value());
      const llama::Weights sw = llama::shard_weights(c, w, plan.value());
      const llama::LayerWeights& part = sw.layers[0];
      const std::int32_t D = c.head_dim;
      CHECK(product64(h, part.wq, c.dim, sc.q_width()) ==
            test::columns(q_full, c.q_width(), plan.value().heads.q.first * D, sc.q_width()));
      CHECK(product64(h, part.wk, c.dim, sc.kv_width()) ==
            test::columns(k_full, c.kv_width(), plan.value().heads.kv.first * D, sc.kv_width()));
      CHECK(product64(h, part.w1, c.dim, sc.ffn) == test::columns(up_full, c.ffn, plan.value().ffn.first, sc.ffn));
      const auto o = product64(test::columns(attn, c.q_width(), plan.value().heads.q.first * D, sc.q_width()), part.wo,
                               sc.q_width(), c.dim);
      const auto down = product64(test::columns(hidden, c.ffn, plan.value().ffn.first, sc.ffn), part.w2, sc.ffn, c.dim);
      for (std::size_t i = 0; i < o.size(); ++i) o_sum[i] += o[i];
      for (std::size_t i = 0; i < down.size(); ++i) down_sum[i] += down[i];
      CHECK(sw.embed == w.embed);
      CHECK(sw.lm_head == w.lm_head);
    }
    for (std::size_t i = 0; i < o_full.size(); ++i) CHECK(o_sum[i] == doctest::Approx(o_full[i]).epsilon(1e-12));
    for (std::size_t i = 0; i < down_full.size(); ++i)
      CHECK(down_sum[i] == doctest::Approx(down_full[i]).epsilon(1e-12));
  }
}

TEST_CASE_TEMPLATE("one host plan drives every shard: shard attention equals the model's columns", L, layout::cell,
                   layout::sequence) {
  using Cache = KVCache<L, Windows<0, 3>>;  // layer 0 full attention, layer 1 a window of 3
  const CacheConfig config{8, 96, 6, 16};
  constexpr std::int32_t kHeadsQ = 8, kHeadsKv = 4, kD = 4, kShards = 2, kGroup = kHeadsQ / kHeadsKv;
  Cache cache(config);
  HostPool<float> full(2, cache.capacity(), kHeadsKv, kD);
  std::vector<HostPool<float>> shards;
  for (std::int32_t g = 0; g < kShards; ++g) shards.emplace_back(2, cache.capacity(), kHeadsKv / kShards, kD);
  std::mt19937 rng(11);
  std::vector<std::int32_t> live;
  for (int i = 0; i < 3; ++i) live.push_back(cache.seq_new().value());
  for (int step = 0; step < 24; ++step) {
    CAPTURE(step);
    if (step % 6 == 5) live.push_back(cache.seq_clone(live[0]).value());  // a fork (a row copy in the sequence layout)
    if (step == 13) {
      REQUIRE(cache.seq_rm(live[1]).ok());
      live.erase(live.begin() + 1);
    }
    std::vector<std::int32_t> ids;
    for (const std::int32_t id : live)
      for (std::uint32_t n = rng() % 3; n > 0 && ids.size() < 8; --n) ids.push_back(id);
    if (ids.empty()) ids.push_back(live[0]);
    if (!cache.declare_step(ids).ok()) break;  // full: the comparison so far stands
    for (const RowCopy& copy : cache.pending_changes().copies) {  // what each device applies on upload
      full.copy_rows(copy);
      for (auto& s : shards) s.copy_rows(copy);
    }
    cache.acknowledge_changes();  // once, after every shard saw the changes
    const auto T = ids.size();
    for (std::int32_t layer = 0; layer < 2; ++layer) {
      const auto q = random_floats(T * kHeadsQ * kD, rng), k = random_floats(T * kHeadsKv * kD, rng),
                 v = random_floats(T * kHeadsKv * kD, rng);
      std::vector<float> out(q.size());
      const std::int32_t window = Cache::Windows::window_of_layer(layer);
      REQUIRE(reference::update_and_attend(cache, window, full.view(layer), std::span<const float>(q),
                                           std::span<const float>(k), std::span<const float>(v), std::span<float>(out),
                                           kHeadsQ, 0.5f)
                  .ok());
      for (std::int32_t g = 0; g < kShards; ++g) {
        const HeadShard heads = head_shard(kHeadsQ, kHeadsKv, kShards, g).value();
        const auto q_g = test::columns(q, kHeadsQ * kD, heads.q.first * kD, heads.q.count * kD);
        const auto k_g = test::columns(k, kHeadsKv * kD, heads.kv.first * kD, heads.kv.count * kD);
        const auto v_g = test::columns(v, kHeadsKv * kD, heads.kv.first * kD, heads.kv.count * kD);
        std::vector<float> out_g(q_g.size());
        REQUIRE(reference::update_and_attend(cache, window, shards[static_cast<std::size_t>(g)].view(layer),
                                             std::span<const float>(q_g), std::span<const float>(k_g),
                                             std::span<const float>(v_g), std::span<float>(out_g), heads.q.count,
                                             0.5f)
                    .ok());
        CHECK(out_g == test::columns(out, kHeadsQ * kD, heads.q.first * kD, heads.q.count * kD));
        CHECK(heads.q.count / heads.kv.count == kGroup);
      }
    }
  }
}
