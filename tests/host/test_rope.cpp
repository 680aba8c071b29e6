// rope.hpp on the host: rerotate_keys moves a key computed at old_pos to new_pos, and equals the
// key RoPE'd directly at new_pos by an independent float64 RoPE written from the definition
// (pairs, frequencies, linear and NTK scaling), for half-split and interleaved pairs, partial
// rotary dims (the other elements untouched), several heads and rows, in double and float pools;
// V is never touched. check_rope refuses what it documents. Random edit sequences (steps, seq_add,
// seq_div, seq_rm, seq_cp, seq_clone, sequences added and removed, several edits between syncs):
// after each HostPool::sync every held K row equals its token's key RoPE'd directly at the
// position a brute-force model says it holds now.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/kv_cache.hpp"
#include "cellkv/rope.hpp"

namespace {

using namespace cellkv;

// The pairs' element indices and frequencies from the definition, not from rope.hpp's helpers.
struct Direct {
  RopeSpec spec;
  std::int32_t head_dim;

  [[nodiscard]] std::int32_t r() const { return spec.rotary_dims == 0 ? head_dim : spec.rotary_dims; }
  [[nodiscard]] double freq(std::int32_t i) const {
    const double rd = r();
    double base = spec.theta;
    if (spec.scaling == RopeScaling::ntk) base *= std::pow(spec.factor, rd / (rd - 2.0));
    double f = std::pow(base, -2.0 * i / rd);
    if (spec.scaling == RopeScaling::linear) f /= spec.factor;
    return f;
  }
  // One head RoPE'd at position p.
  [[nodiscard]] std::vector<double> at(const std::vector<double>& x, std::int32_t p) const {
    std::vector<double> y = x;
    for (std::int32_t i = 0; i < r() / 2; ++i) {
      const std::int32_t a = spec.pairs == RopePairs::interleaved ? 2 * i : i;
      const std::int32_t b = spec.pairs == RopePairs::interleaved ? 2 * i + 1 : i + r() / 2;
      const double t = p * freq(i);
      y[static_cast<std::size_t>(a)] = x[static_cast<std::size_t>(a)] * std::cos(t) - x[static_cast<std::size_t>(b)] * std::sin(t);
      y[static_cast<std::size_t>(b)] = x[static_cast<std::size_t>(a)] * std::sin(t) + x[static_cast<std::size_t>(b)] * std::cos(t);
    }
    return y;
  }
};

double value(std::int32_t row, std::int32_t h, std::int32_t e) {
  return std::sin(0.7 * row + 1.3 * h + 0.37 * e + 0.1) + 0.25 * std::cos(3.1 * e);
}

// rows x heads x head_dim pool; row c holds the raw key RoPE'd at old[c]; rerotate rows 1 and 3 to
// new positions; each moved row equals the raw key RoPE'd at its new position, the others are
// unchanged, V untouched. Tolerance relative to the row's largest element.
template <class T>
void check_rerotation(const RopeSpec& spec, std::int32_t head_dim, double tol) {
  CAPTURE(static_cast<int>(spec.pairs));
  CAPTURE(spec.rotary_dims);
  CAPTURE(static_cast<int>(spec.scaling));
  REQUIRE(check_rope(spec, head_dim).ok());
  const Direct direct{spec, head_dim};
  const std::int32_t rows = 4, heads = 3;
  const std::int32_t old_pos[rows] = {5, 40, 7, 1000};
  const std::vector<RowRotation> moves = {{1, 40, 12}, {3, 1000, 3}};
  std::vector<T> k(static_cast<std::size_t>(rows * heads * head_dim)), v(k.size());
  const PoolView<T> pool{k.data(), v.data(), rows, heads, head_dim};
  for (std::int32_t c = 0; c < rows; ++c)
    for (std::int32_t h = 0; h < heads; ++h) {
      std::vector<double> x(static_cast<std::size_t>(head_dim));
      for (std::int32_t e = 0; e < head_dim; ++e) x[static_cast<std::size_t>(e)] = value(c, h, e);
      const std::vector<double> y = direct.at(x, old_pos[c]);
      for (std::int32_t e = 0; e < head_dim; ++e) {
        k[static_cast<std::size_t>(pool.offset(c, h) + e)] = static_cast<T>(y[static_cast<std::size_t>(e)]);
        v[static_cast<std::size_t>(pool.offset(c, h) + e)] = static_cast<T>(x[static_cast<std::size_t>(e)]);
      }
    }
  const std::vector<T> k_before = k, v_before = v;
  rerotate_keys(pool, std::span<const RowRotation>(moves), spec);
  CHECK(v == v_before);
  for (std::int32_t c = 0; c < rows; ++c) {
    std::int32_t pos = old_pos[c];
    for (const RowRotation& m : moves)
      if (m.cell == c) pos = m.new_pos;
    for (std::int32_t h = 0; h < heads; ++h) {
      std::vector<double> x(static_cast<std::size_t>(head_dim));
      for (std::int32_t e = 0; e < head_dim; ++e) x[static_cast<std::size_t>(e)] = value(c, h, e);
      const std::vector<double> want = direct.at(x, pos);
      double scale = 0;
      for (const double w : want) scale = std::max(scale, std::abs(w));
      for (std::int32_t e = 0; e < head_dim; ++e) {
        CAPTURE(c);
        CAPTURE(h);
        CAPTURE(e);
        const auto i = static_cast<std::size_t>(pool.offset(c, h) + e);
        CHECK(std::abs(static_cast<double>(k[i]) - want[static_cast<std::size_t>(e)]) <= tol * scale);
        if (e >= direct.r()) CHECK(k[i] == k_before[i]);  // past the rotary dims: untouched
        if (pos == old_pos[c]) CHECK(k[i] == k_before[i]);  // rows not moved: untouched
      }
    }
  }
}

const RopeSpec kSpecs[] = {
    {.theta = 10000.0},
    {.theta = 10000.0, .pairs = RopePairs::interleaved},
    {.theta = 500000.0, .rotary_dims = 8},
    {.theta = 10000.0, .rotary_dims = 6, .pairs = RopePairs::interleaved},
    {.theta = 10000.0, .scaling = RopeScaling::linear, .factor = 4.0},
    {.theta = 10000.0, .rotary_dims = 12, .pairs = RopePairs::interleaved, .scaling = RopeScaling::linear, .factor = 2.5},
    {.theta = 10000.0, .scaling = RopeScaling::ntk, .factor = 8.0},
    {.theta = 1000000.0, .rotary_dims = 8, .scaling = RopeScaling::ntk, .factor = 2.0},
};

}  // namespace

TEST_CASE("rope: rerotate_keys equals a direct float64 RoPE at the new position (double pools)") {
  for (const RopeSpec& s : kSpecs) check_rerotation<double>(s, 16, 1e-12);
}

TEST_CASE("rope: rerotate_keys equals a direct float64 RoPE at the new position (float pools)") {
  for (const RopeSpec& s : kSpecs) check_rerotation<float>(s, 16, 2e-6);
}

TEST_CASE("rope: moving back and forth restores the key; an empty list changes nothing") {
  const RopeSpec spec{.theta = 10000.0, .pairs = RopePairs::interleaved};
  std::vector<double> k(2 * 8), v(k.size(), 0.0);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = value(static_cast<std::int32_t>(i), 0, 1);
  const std::vector<double> before = k;
  const PoolView<double> pool{k.data(), v.data(), 2, 1, 8};
  rerotate_keys(pool, std::span<const RowRotation>(), spec);
  CHECK(k == before);
  const std::vector<RowRotation> there = {{0, 3, 77}, {1, 9, 2}}, back = {{0, 77, 3}, {1, 2, 9}};
  rerotate_keys(pool, std::span<const RowRotation>(there), spec);
  CHECK(k != before);
  rerotate_keys(pool, std::span<const RowRotation>(back), spec);
  for (std::size_t i = 0; i < k.size(); ++i) CHECK(k[i] == doctest::Approx(before[i]).epsilon(1e-12));
}

TEST_CASE("rope: check_rope refuses a bad theta, rotary dims, or scaling factor") {
  const std::int32_t d = 16;
  CHECK(check_rope({}, d).ok());
  CHECK(check_rope({.rotary_dims = 2}, d).ok());
  CHECK(check_rope({.rotary_dims = 16}, d).ok());
  CHECK(check_rope({.scaling = RopeScaling::ntk, .factor = 1.0}, d).ok());
  CHECK(check_rope({.theta = 1.0}, d) == Errc::bad_argument);
  CHECK(check_rope({.theta = 0.5}, d) == Errc::bad_argument);
  CHECK(check_rope({.theta = std::nan("")}, d) == Errc::bad_argument);
  CHECK(check_rope({.theta = INFINITY}, d) == Errc::bad_argument);
  CHECK(check_rope({.rotary_dims = 7}, d) == Errc::bad_argument);    // odd
  CHECK(check_rope({.rotary_dims = 18}, d) == Errc::bad_argument);   // past the head
  CHECK(check_rope({.rotary_dims = -2}, d) == Errc::bad_argument);
  CHECK(check_rope({}, 1) == Errc::bad_argument);                    // a head of one element
  CHECK(check_rope({}, 7) == Errc::bad_argument);                    // whole odd head
  CHECK(check_rope({.scaling = RopeScaling::linear, .factor = 0.5}, d) == Errc::bad_argument);
  CHECK(check_rope({.scaling = RopeScaling::linear, .factor = INFINITY}, d) == Errc::bad_argument);
  CHECK(check_rope({.scaling = RopeScaling::ntk, .factor = std::nan("")}, d) == Errc::bad_argument);
  CHECK(check_rope({.rotary_dims = 2, .scaling = RopeScaling::ntk, .factor = 2.0}, d) == Errc::bad_argument);
  CHECK(check_rope({.rotary_dims = 2, .scaling = RopeScaling::linear, .factor = 2.0}, d).ok());
  CHECK(check_rope({.factor = 0.0}, d).ok());  // the factor is ignored without scaling
}

TEST_CASE("host pools refuse to drop pending K re-rotations unless told the keys carry no position") {
  KVCache<layout::cell, Windows<0>, placement::lowest_free, 4> cache({.max_write = 16, .max_cells = 64, .max_seqs = 2});
  HostPool<float> pool(1, 64, 1, 8);
  HostFp8Pool fp8(1, 64, 1, 8);
  const std::int32_t s = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>(10, s)).ok());
  REQUIRE(pool.sync(cache).ok());  // nothing moved: copies (none), then acknowledged
  REQUIRE(cache.seq_add(s, 5, -1, 3).ok());
  REQUIRE(cache.pending_changes().rotations.size() == 5);
  const std::uint64_t epoch = cache.changes_epoch();
  CHECK(pool.sync(cache) == Errc::no_key_rotation);
  CHECK(fp8.sync(cache) == Errc::no_key_rotation);
  CHECK(cache.pending_changes().rotations.size() == 5);  // nothing acknowledged
  CHECK(cache.changes_epoch() == epoch);
  REQUIRE(pool.sync_keys_without_position(cache).ok());
  CHECK(cache.pending_changes().rotations.empty());
  CHECK(cache.changes_epoch() != epoch);
  CHECK(pool.sync(cache).ok());
  CHECK(fp8.sync(cache).ok());
}

namespace {

// Which token each (sequence, position) holds, from the verbs' definitions alone.
using HeldModel = std::map<std::int32_t, std::map<std::int32_t, std::int32_t>>;

// Whether position p lies in an edit's range [p0, p1) (p0 < 0: from 0; p1 < 0: to the end).
bool in_range(std::int32_t p, std::int32_t p0, std::int32_t p1) { return p >= std::max(p0, 0) && (p1 < 0 || p < p1); }

// The model's positions of `held` in [p0, p1) moved by `move`; positions moved below 0 are
// dropped, the others kept.
template <class Move>
void edit_range(std::map<std::int32_t, std::int32_t>& held, std::int32_t p0, std::int32_t p1, Move&& move) {
  std::map<std::int32_t, std::int32_t> next;
  for (const auto& [p, t] : held)
    if (!in_range(p, p0, p1)) next[p] = t;
  for (const auto& [p, t] : held)
    if (in_range(p, p0, p1) && move(p) >= 0) next[move(p)] = t;
  held = std::move(next);
}

}  // namespace

TEST_CASE("rope: after random edits and syncs every held K row equals its token RoPE'd at its position now") {
  constexpr std::int32_t D = 8, kCells = 64;
  const RopeSpec spec{.theta = 100.0, .pairs = RopePairs::interleaved};
  const Direct direct{spec, D};
  auto raw = [](std::int32_t token) {
    std::vector<double> x(D);
    for (std::int32_t e = 0; e < D; ++e) x[static_cast<std::size_t>(e)] = value(token, 0, e);
    return x;
  };
  std::int64_t rotating_edits = 0;
  for (std::uint32_t seed = 0; seed < 60; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    auto rnd = [&](std::int32_t lo, std::int32_t hi) { return std::uniform_int_distribution<std::int32_t>(lo, hi)(rng); };
    KVCache<layout::cell, Windows<0>, placement::lowest_free, 4> cache({.max_write = 8, .max_cells = kCells, .max_seqs = 4});
    HostPool<double> pool(1, kCells, 1, D);
    HeldModel model;
    std::int32_t next_token = 0;
    auto verify = [&] {
      REQUIRE(pool.sync(cache, spec).ok());
      for (const auto& [s, held] : model) {
        std::vector<std::int32_t> positions;
        for (const auto& [p, t] : held) positions.push_back(p);
        REQUIRE(cache.held_positions(s).value() == positions);
        for (const auto& [p, t] : held) {
          const std::vector<double> want = direct.at(raw(t), p);
          const double* k = pool.view(0).k + cache.row_of(s, p) * D;
          for (std::int32_t e = 0; e < D; ++e) CHECK(std::abs(k[e] - want[static_cast<std::size_t>(e)]) < 1e-9);
        }
      }
    };
    model[cache.seq_new().value()];
    for (int op = 0; op < 60; ++op) {
      std::vector<std::int32_t> live;
      for (const auto& [s, held] : model) live.push_back(s);
      if (live.empty()) {
        model[cache.seq_new().value()];
        continue;
      }
      const std::int32_t s = live[static_cast<std::size_t>(rnd(0, static_cast<std::int32_t>(live.size()) - 1))];
      const std::int32_t len = cache.pos(s).value();
      const std::int32_t p0 = rnd(-1, len), p1 = rnd(-1, len + 2);
      switch (rnd(0, 9)) {
        case 0: case 1: case 2: {  // a step of 1-4 tokens, each K written RoPE'd at its position
          const auto plan = cache.declare_step(std::vector<std::int32_t>(static_cast<std::size_t>(rnd(1, 4)), s));
          if (!plan.ok()) break;
          REQUIRE(pool.sync(cache, spec).ok());
          for (std::int32_t t = 0; t < plan.value().tokens; ++t) {
            const std::int32_t token = next_token++, p = plan.value().positions[static_cast<std::size_t>(t)];
            model[s][p] = token;
            const std::vector<double> k = direct.at(raw(token), p);
            std::copy(k.begin(), k.end(), pool.view(0).k + plan.value().rows[static_cast<std::size_t>(t)] * D);
          }
          break;
        }
        case 3: {
          const std::int32_t delta = rnd(-20, 20);
          if (!cache.seq_add(s, p0, p1, delta).ok()) break;
          rotating_edits += cache.pending_changes().rotations.empty() ? 0 : 1;
          edit_range(model[s], p0, p1, [&](std::int32_t p) { return p + delta; });
          break;
        }
        case 4: {
          const std::int32_t d = rnd(1, 4);
          if (!cache.seq_div(s, p0, p1, d).ok()) break;
          rotating_edits += cache.pending_changes().rotations.empty() ? 0 : 1;
          edit_range(model[s], p0, p1, [&](std::int32_t p) { return p / d; });
          break;
        }
        case 5:
          if (cache.seq_rm(s, p0, p1).ok()) edit_range(model[s], p0, p1, [](std::int32_t) { return -1; });
          break;
        case 6:
          if (const auto fork = cache.seq_clone(s, rnd(0, len)); fork.ok()) {
            const std::int32_t upto = cache.pos(fork.value()).value();
            auto& copy = model[fork.value()];
            for (const auto& [p, t] : model[s])
              if (p < upto) copy[p] = t;
          }
          break;
        case 7: {
          const std::int32_t d = live[static_cast<std::size_t>(rnd(0, static_cast<std::int32_t>(live.size()) - 1))];
          if (!cache.seq_cp(s, d, p0, p1).ok()) break;
          const std::map<std::int32_t, std::int32_t> from = model[s];
          for (const auto& [p, t] : from)
            if (in_range(p, p0, p1)) model[d][p] = t;
          break;
        }
        case 8:
          if (live.size() > 1 && rnd(0, 2) == 0) {
            REQUIRE(cache.seq_rm(s).ok());
            model.erase(s);
          } else if (const auto fresh = cache.seq_new(); fresh.ok()) {
            model[fresh.value()];
          }
          break;
        default:
          verify();
      }
    }
    verify();
  }
  CHECK(rotating_edits > 50);  // the edits did leave rotations to sync
}
