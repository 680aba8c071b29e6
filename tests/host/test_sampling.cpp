// The sampling rule on the host: Philox4x32-10 against its published known answers; the order keys
// and the deterministic exp against float and float64 arithmetic; greedy against max_element;
// temperature 0, top-k 1, tiny top-p and min-p 1 against greedy; every parameter combination
// against an independent float64 oracle (sort, softmax, filters, inverse CDF) away from rounding
// boundaries; drawn frequencies against the distribution; log-probs against float64; and the
// refusals of bad parameters.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "batch_checks.hpp"
#include "cellkv/batching/philox.hpp"
#include "cellkv/batching/sampling.hpp"
#include "cellkv/batching/session_table.hpp"

namespace {

using namespace cellkv::batching;
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> random_logits(std::mt19937_64& rng, std::int32_t n, double spread) {
  std::normal_distribution<double> d(0.0, spread);
  std::vector<float> l(static_cast<std::size_t>(n));
  for (auto& x : l) x = static_cast<float>(d(rng));
  return l;
}

// The rule of sampling.hpp in float64 with plain sorting: what sample_row must pick, or -1 when the
// draw or a filter lands within `margin` (relative to the kept mass) of a boundary, where the
// integer masses of the real rule may round the other way.
struct Oracle {
  std::int32_t token = -1;
};
Oracle oracle(const std::vector<float>& l, const SampleRow& row, double margin) {
  const auto n = static_cast<std::int32_t>(l.size());
  std::vector<std::int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return l[static_cast<std::size_t>(a)] > l[static_cast<std::size_t>(b)];
  });
  const double lmax = l[static_cast<std::size_t>(order[0])];
  const double t = 1.0 / static_cast<double>(row.inv_temperature);
  std::vector<double> p(l.size());
  for (std::size_t i = 0; i < l.size(); ++i) p[i] = std::exp((static_cast<double>(l[i]) - lmax) / t);
  std::int32_t kept = row.top_k > 0 && row.top_k < n ? row.top_k : n;
  if (row.top_p < 1.f) {
    double w = 0;
    for (std::int32_t j = 0; j < kept; ++j) w += p[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])];
    const double goal = static_cast<double>(row.top_p) * w;
    double run = 0;
    for (std::int32_t j = 0; j < kept; ++j) {
      run += p[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])];
      if (std::abs(run - goal) < margin * w) return {};
      if (run >= goal) {
        kept = j + 1;
        break;
      }
    }
  }
  if (row.min_p_offset > -kInf) {
    const double thr = lmax + static_cast<double>(row.min_p_offset);
    std::int32_t m = 0;
    while (m < n && static_cast<double>(l[static_cast<std::size_t>(order[static_cast<std::size_t>(m)])]) >= thr) ++m;
    for (std::int32_t j = 0; j < n; ++j)
      if (std::abs(static_cast<double>(l[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])]) - thr) < 1e-4)
        return {};
    kept = std::min(kept, std::max(m, 1));
  }
  std::vector<bool> in(l.size(), false);
  double w = 0;
  for (std::int32_t j = 0; j < kept; ++j) {
    in[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])] = true;
    w += p[static_cast<std::size_t>(order[static_cast<std::size_t>(j)])];
  }
  const double u = static_cast<double>(philox_draw(row.seed, row.counter)) / 4294967296.0;
  const double goal = u * w;
  double run = 0;
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (!in[i]) continue;
    run += p[i];
    if (std::abs(run - goal) < margin * w) return {};
    if (run > goal) return {static_cast<std::int32_t>(i)};
  }
  return {};
}

SampleRow row_of(float temperature, std::int32_t top_k, float top_p, float min_p, std::uint64_t seed,
                 std::uint32_t counter) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = seed;
  return make_sample_row(p, counter);
}

}  // namespace

TEST_CASE("philox4x32-10: the published known answers") {
  const Philox4 zero = philox4x32_10({{0, 0, 0, 0}}, {{0, 0}});
  CHECK(zero.x[0] == 0x6627e8d5u);
  CHECK(zero.x[1] == 0xe169c58du);
  CHECK(zero.x[2] == 0xbc57ac4cu);
  CHECK(zero.x[3] == 0x9b00dbd8u);
  const Philox4 ones = philox4x32_10({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, {{0xffffffffu, 0xffffffffu}});
  CHECK(ones.x[0] == 0x408f276du);
  CHECK(ones.x[1] == 0x41c83b0eu);
  CHECK(ones.x[2] == 0xa20bc7c6u);
  CHECK(ones.x[3] == 0x6d5451fdu);
  const Philox4 pi = philox4x32_10({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, {{0xa4093822u, 0x299f31d0u}});
  CHECK(pi.x[0] == 0xd16cfe09u);
  CHECK(pi.x[1] == 0x94fdccebu);
  CHECK(pi.x[2] == 0x5001e420u);
  CHECK(pi.x[3] == 0x24126ea1u);
  static_assert(philox_draw(0, 0) == 0x6627e8d5u);  // a constant expression too
  CHECK(philox_draw(0x299f31d0a4093822ull, 0x243f6a88u) != philox_draw(0x299f31d0a4093822ull, 0x243f6a89u));
}

TEST_CASE("sampling: order keys order floats; -0 ties +0; NaN is lowest") {
  std::vector<float> v = {-kInf, -1e30f, -2.5f, -1e-40f, -0.f, 0.f, 1e-40f, 1.f, 3e38f, kInf};
  for (std::size_t i = 0; i + 1 < v.size(); ++i) {
    CAPTURE(i);
    if (v[i] == v[i + 1]) CHECK(sampling::order_key(v[i]) == sampling::order_key(v[i + 1]));
    else CHECK(sampling::order_key(v[i]) < sampling::order_key(v[i + 1]));
  }
  CHECK(sampling::order_key(std::numeric_limits<float>::quiet_NaN()) == 0u);
  CHECK(sampling::order_key(-kInf) > 0u);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(-100.f, 100.f);
  for (int i = 0; i < 10000; ++i) {
    const float a = u(rng), b = u(rng);
    CHECK((a < b) == (sampling::order_key(a) < sampling::order_key(b)));
  }
}

TEST_CASE("sampling: the deterministic exp is exp to 1e-6, exactly 1 at 0, and masses fit 2^31") {
  CHECK(sampling::exp_det(0.f) == 1.f);
  CHECK(sampling::exp_det(-0.f) == 1.f);
  double worst = 0;
  for (int i = 0; i <= 230000; ++i) {
    const float x = -static_cast<float>(i) * 1e-4f;
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(static_cast<double>(sampling::exp_det(x)) - want) / want);
  }
  CHECK(worst < 1e-6);
  CHECK(sampling::mass_of(3.f, 3.f, 1.f) == 0x80000000u);
  CHECK(sampling::mass_of(-kInf, 3.f, 1.f) == 0u);
  CHECK(sampling::mass_of(std::numeric_limits<float>::quiet_NaN(), 3.f, 1.f) == 0u);
  CHECK(sampling::mass_of(3.f - 30.f, 3.f, 1.f) == 0u);
  CHECK(sampling::scale_draw(0x7fffffffffffull, 0xffffffffu) < 0x7fffffffffffull);
  CHECK(sampling::scale_draw(1ull << 40, 1u << 31) == 1ull << 39);
}

TEST_CASE("sampling: greedy is max_element, the lowest index on ties") {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    auto l = random_logits(rng, 1 + trial * 7 % 300, 2.0);
    if (trial % 3 == 0) l[l.size() / 2] = l[l.size() - 1] = *std::max_element(l.begin(), l.end()) + 1.f;  // a tie
    const auto want = static_cast<std::int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    CHECK(argmax(l) == want);
    CHECK(sample_row(l, row_of(0.f, 0, 1.f, 0.f, 9, 0)).token == want);
  }
  const std::vector<float> zeros = {-0.f, 0.f, -0.f};
  CHECK(argmax(zeros) == 0);
  const std::vector<float> with_inf = {1.f, kInf, 2.f, kInf};
  CHECK(sample_row(with_inf, row_of(1.f, 0, 1.f, 0.f, 1, 0)).token == 1);  // a row with +inf is greedy
}

TEST_CASE("sampling: temperature 0, top-k 1, a tiny top-p and min-p 1 all equal greedy") {
  std::mt19937_64 rng(6);
  for (int trial = 0; trial < 100; ++trial) {
    const auto l = random_logits(rng, 257, 1.5);
    const std::int32_t g = argmax(l);
    const auto seed = static_cast<std::uint64_t>(trial);
    CHECK(sample_row(l, row_of(0.f, 50, 0.5f, 0.1f, seed, 3)).token == g);
    CHECK(sample_row(l, row_of(1.3f, 1, 1.f, 0.f, seed, 3)).token == g);
    CHECK(sample_row(l, row_of(5.f, 0, 1e-9f, 0.f, seed, 3)).token == g);
    CHECK(sample_row(l, row_of(5.f, 0, 1.f, 1.f, seed, 3)).token == g);
    CHECK(make_sample_row({.temperature = 1.3f, .top_k = 1}, 0).inv_temperature == 0.f);
  }
}

TEST_CASE("sampling: every parameter combination matches a float64 oracle away from boundaries") {
  std::mt19937_64 rng(7);
  const float temperatures[] = {0.3f, 1.f, 2.5f};
  const std::int32_t top_ks[] = {0, 2, 17, 1000};
  const float top_ps[] = {1.f, 0.9f, 0.5f, 0.05f};
  const float min_ps[] = {0.f, 0.05f, 0.5f};
  std::int32_t compared = 0, skipped = 0, not_greedy = 0;
  for (int trial = 0; trial < 6; ++trial) {
    const auto l = random_logits(rng, 100 + 97 * trial, 1.0 + trial);
    const std::int32_t g = argmax(l);
    std::uint32_t counter = 0;
    for (const float t : temperatures)
      for (const std::int32_t k : top_ks)
        for (const float p : top_ps)
          for (const float m : min_ps)
            for (int draw = 0; draw < 4; ++draw) {
              const SampleRow row = row_of(t, k, p, m, 1234 + static_cast<std::uint64_t>(trial), counter++);
              const Oracle want = oracle(l, row, 1e-5);
              const Sampled got = sample_row(l, row);
              if (want.token < 0) {
                ++skipped;
                continue;
              }
              CAPTURE(t);
              CAPTURE(k);
              CAPTURE(p);
              CAPTURE(m);
              CHECK(got.token == want.token);
              ++compared;
              not_greedy += got.token != g;
            }
  }
  MESSAGE("compared ", compared, ", skipped near a boundary ", skipped, ", not the argmax ", not_greedy);
  CHECK(compared > 20 * skipped);
  CHECK(not_greedy > compared / 4);  // the draws really sample
}

TEST_CASE("sampling: drawn frequencies follow the filtered distribution") {
  // logits ln(p) of p = {0.4, 0.3, 0.15, 0.1, 0.05}; top-k 4 renormalizes the first four.
  const std::vector<float> l = {std::log(0.4f), std::log(0.3f), std::log(0.15f), std::log(0.1f), std::log(0.05f)};
  const double want_all[] = {0.4, 0.3, 0.15, 0.1, 0.05};
  const double want_k4[] = {0.4 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.1 / 0.95, 0.0};
  const double want_p[] = {0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0};  // top-p 0.8: 0.4 + 0.3 + 0.15
  constexpr int kDraws = 40000;
  auto frequencies = [&](const SampleRow& base) {
    std::vector<double> f(l.size(), 0.0);
    for (std::uint32_t n = 0; n < kDraws; ++n) {
      SampleRow r = base;
      r.counter = n;
      f[static_cast<std::size_t>(sample_row(l, r).token)] += 1.0 / kDraws;
    }
    return f;
  };
  const auto all = frequencies(row_of(1.f, 0, 1.f, 0.f, 99, 0));
  const auto k4 = frequencies(row_of(1.f, 4, 1.f, 0.f, 99, 0));
  const auto p8 = frequencies(row_of(1.f, 0, 0.8f, 0.f, 99, 0));
  for (std::size_t i = 0; i < l.size(); ++i) {
    CAPTURE(i);
    const double sigma = 0.5 / std::sqrt(static_cast<double>(kDraws));  // largest binomial deviation
    CHECK(std::abs(all[i] - want_all[i]) < 5 * sigma);
    CHECK(std::abs(k4[i] - want_k4[i]) < 5 * sigma);
    CHECK(std::abs(p8[i] - want_p[i]) < 5 * sigma);
  }
  CHECK(k4[4] == 0.0);
  CHECK(p8[3] == 0.0);
}

TEST_CASE("sampling: a draw depends on the seed and the counter only; log-probs match float64") {
  std::mt19937_64 rng(8);
  const auto l = random_logits(rng, 1000, 2.0);
  SampleRow r = row_of(1.f, 0, 0.95f, 0.f, 42, 0);
  r.flags = kWantLogprob;
  std::vector<std::int32_t> first;
  for (std::uint32_t n = 0; n < 50; ++n) {
    r.counter = n;
    first.push_back(sample_row(l, r).token);
  }
  for (std::uint32_t n = 0; n < 50; ++n) {
    r.counter = n;
    const Sampled s = sample_row(l, r);
    CHECK(s.token == first[n]);
    double sum = 0;
    const double lmax = *std::max_element(l.begin(), l.end());
    for (const float x : l) sum += std::exp(static_cast<double>(x) - lmax);
    CHECK(std::abs(static_cast<double>(s.logprob) - (static_cast<double>(l[static_cast<std::size_t>(s.token)]) - lmax - std::log(sum))) < 1e-4);
  }
  r.seed = 43;
  std::int32_t differ = 0;
  for (std::uint32_t n = 0; n < 50; ++n) {
    r.counter = n;
    differ += sample_row(l, r).token != first[n];
  }
  CHECK(differ > 10);
}

TEST_CASE("sampling: check_sampling names each bad parameter") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(check_sampling({}, 100) == SessionErrc::none);
  CHECK(check_sampling({.temperature = 0.7f, .top_k = 5, .top_p = 1.f, .min_p = 1.f, .stop_tokens = {0, 99}}, 100) ==
        SessionErrc::none);
  CHECK(check_sampling({.temperature = -0.1f}, 100) == SessionErrc::bad_temperature);
  CHECK(check_sampling({.temperature = nan}, 100) == SessionErrc::bad_temperature);
  CHECK(check_sampling({.temperature = kInf}, 100) == SessionErrc::bad_temperature);
  CHECK(check_sampling({.top_k = -1}, 100) == SessionErrc::bad_top_k);
  CHECK(check_sampling({.top_p = 0.f}, 100) == SessionErrc::bad_top_p);
  CHECK(check_sampling({.top_p = -0.5f}, 100) == SessionErrc::bad_top_p);
  CHECK(check_sampling({.top_p = 1.0001f}, 100) == SessionErrc::bad_top_p);
  CHECK(check_sampling({.top_p = nan}, 100) == SessionErrc::bad_top_p);
  CHECK(check_sampling({.min_p = -0.01f}, 100) == SessionErrc::bad_min_p);
  CHECK(check_sampling({.min_p = 1.5f}, 100) == SessionErrc::bad_min_p);
  CHECK(check_sampling({.stop_tokens = {3, 100}}, 100) == SessionErrc::bad_stop_token);
  CHECK(check_sampling({.stop_tokens = {-1}}, 0) == SessionErrc::bad_stop_token);
  CHECK(check_sampling({.stop_tokens = {1 << 30}}, 0) == SessionErrc::none);  // no vocabulary: no upper bound
}
