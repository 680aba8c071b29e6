// Sequence edits on the device: the kernels read around holes (table kernels, shared prefixes and
// the reference kernel's dense masks), copy-on-write copies and K re-rotations run at upload.
//   - random verbs with range removals, copies, keeps, shifts and divisions against the float64
//     host reference (its pools mirror the copies and re-rotate K with rope.hpp's float64 rotation);
//   - a context shift and a self-extend division against an independent oracle: float64 attention
//     over keys whose RoPE is computed directly at their new positions (a fresh cache's K);
//   - the key rotation's refusals and its none / custom forms.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/sharded_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/rope.hpp"
#include "../host/after_last_placement.hpp"
#include "forward_harness.cuh"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;

// ---- random verbs with edits, against the host reference ----

// One random edit (or none) on a live sequence, mostly in the forms runtimes use (a context shift:
// remove a range, slide the rest down; self-extend: a sparse tail divided by 2; the tail moved up,
// opening holes), some arbitrary; refusals (collisions, full sequences, no cells) are part of the
// traffic.
template <class Cache>
void random_edit(Cache& cache, std::mt19937_64& rng) {
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  std::vector<std::int32_t> live;
  cache.host().live_sequences().for_each([&](std::int32_t s) { live.push_back(s); });
  if (live.empty()) return;
  const std::int32_t s = live[static_cast<std::size_t>(pick(static_cast<std::int32_t>(live.size())))];
  const std::int32_t other = live[static_cast<std::size_t>(pick(static_cast<std::int32_t>(live.size())))];
  const std::int32_t end = cache.host().pos(s).value() + 1;
  const std::int32_t p0 = pick(end), p1 = p0 + pick(end - p0 + 1);
  auto shift = [&] {
    if (cache.seq_rm(s, p0, p1).ok()) (void)cache.seq_add(s, p1, -1, p0 - p1);
  };
  switch (pick(12)) {
    case 0: case 1: (void)cache.seq_rm(s, p0, p1); break;
    case 2: (void)cache.seq_cp(s, other, p0, p1); break;
    case 3: case 4: shift(); break;
    case 5:  // a fork, then a shift of the source: the cells it shares are copied on write
      if (cache.seq_clone(s).ok()) shift();
      break;
    case 6: (void)cache.seq_add(s, p0, -1, pick(20)); break;
    case 7:  // self-extend of a short tail
      if (end - p0 <= 64 && cache.seq_rm(s, p0 / 2, p0).ok()) {
        for (std::int32_t p = p0 | 1; p < end; p += 2) (void)cache.seq_rm(s, p, p + 1);
        (void)cache.seq_div(s, p0, -1, 2);
      }
      break;
    case 8: (void)cache.seq_add(s, p0, p1, pick(40) - 20); break;
    case 9: (void)cache.seq_div(s, p0, p1, 1 + pick(3)); break;
    case 10: if (pick(4) == 0) (void)cache.seq_keep(s); break;
    default: break;
  }
}

template <class Cache>
void random_edit_run(const RopeSpec& rope, std::int32_t heads_q, std::int32_t heads_kv, std::int32_t head_dim,
                     std::uint64_t seed, int steps, gpu::KernelChoice kernels = gpu::KernelChoice::automatic) {
  constexpr std::int32_t kMaxWrite = 40;
  Cache cache({.max_write = kMaxWrite, .max_cells = 1200, .max_seqs = 8},
              {.layers = Cache::Windows::kLayers, .heads_kv = heads_kv, .head_dim = head_dim, .heads_q = heads_q});
  cache.use_kernels(kernels);
  REQUIRE(cache.set_key_rotation(gpu::KeyRotation<typename Cache::Element>::rope(rope)).ok());
  ForwardHarness<Cache> harness(cache, heads_q, kMaxWrite);
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  std::int64_t rotated = 0, copied = 0, holes = 0;
  for (int step = 0; step < steps; ++step) {
    CAPTURE(seed);
    CAPTURE(step);
    for (int e = static_cast<int>(rng() % 3); e > 0; --e) random_edit(cache, rng);
    const std::int32_t T = random_step<typename Cache::Host>(cache, kMaxWrite, rng);
    const PendingChanges changes = cache.host().pending_changes();
    harness.mirror_copies({changes.copies.begin(), changes.copies.end()});
    harness.mirror_rotations({changes.rotations.begin(), changes.rotations.end()}, rope);
    rotated += static_cast<std::int64_t>(changes.rotations.size());
    copied += static_cast<std::int64_t>(changes.copies.size());
    cache.host().live_sequences().for_each([&](std::int32_t s) {
      holes += cache.host().pos(s).value() - static_cast<std::int32_t>(cache.host().held_positions(s).value().size());
    });
    CHECK(harness.checked_step(T, rng, stream) <= tolerance<typename Cache::Element>());
  }
  // The traffic did what it is for: cells moved, copied on write, sequences with holes.
  CHECK(rotated > 0);
  CHECK(copied > 0);
  CHECK(holes > 0);
  require_device_ok();
}

using Model = Windows<0, 40, 0>;
template <class T, class Placement>
using Cells = gpu::DeviceCache<layout::cell, T, Model, Placement, 8>;

// ---- a context shift and a division against float64 attention at the new positions ----

constexpr std::int32_t kHq = 8, kHkv = 2, kD = 128, kLayers = 2;
using ShiftModel = Windows<0, 64>;  // layer 1 sees a window of 64 positions
using ShiftCache = gpu::DeviceCache<layout::cell, __nv_bfloat16, ShiftModel, placement::lowest_free, 8>;
constexpr double kTheta = 10000.0;

// RoPE (half-split pairs, the whole head) of one head at position p, in float64, written directly.
std::vector<double> rope_head(const double* k, std::int32_t p) {
  std::vector<double> out(k, k + kD);
  for (std::int32_t i = 0; i < kD / 2; ++i) {
    const double a = p * std::pow(kTheta, -2.0 * i / kD), c = std::cos(a), s = std::sin(a);
    out[static_cast<std::size_t>(i)] = k[i] * c - k[i + kD / 2] * s;
    out[static_cast<std::size_t>(i + kD / 2)] = k[i] * s + k[i + kD / 2] * c;
  }
  return out;
}

// A token's unrotated K and its V, per layer: [layers][H_kv * D], V already rounded to bf16.
struct Token {
  std::vector<std::vector<double>> k, v;
};

Token random_token(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  Token t;
  for (std::int32_t l = 0; l < kLayers; ++l) {
    std::vector<double> k(kHkv * kD), v(kHkv * kD);
    for (auto& x : k) x = u(rng);
    for (auto& x : v) x = to_double(from_double<__nv_bfloat16>(u(rng)));
    t.k.push_back(k);
    t.v.push_back(v);
  }
  return t;
}

// K of a token at position p in layer l, [H_kv * D], RoPE applied in float64.
std::vector<double> rotated_k(const Token& t, std::int32_t l, std::int32_t p) {
  std::vector<double> out;
  for (std::int32_t h = 0; h < kHkv; ++h) {
    const std::vector<double> r = rope_head(t.k[static_cast<std::size_t>(l)].data() + h * kD, p);
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

// One step on the cache: tokens (seq, position, Token); K rotated at the position and rounded to
// bf16 as a model would write it. Returns the outputs [layers][T, H_q, D] for queries q [T][H_q D].
std::vector<std::vector<double>> run_step(ShiftCache& cache, const std::vector<std::int32_t>& seqs,
                                          const std::vector<const Token*>& tokens,
                                          const std::vector<std::vector<double>>& q, gpu::Stream& stream) {
  const auto T = static_cast<std::int32_t>(seqs.size());
  REQUIRE(cache.declare_step(seqs).ok());
  REQUIRE(cache.upload(stream).ok());
  const auto positions = cache.host().step().positions;
  std::vector<std::vector<double>> outs;
  for (std::int32_t l = 0; l < kLayers; ++l) {
    std::vector<__nv_bfloat16> hq, hk, hv;
    for (std::int32_t t = 0; t < T; ++t) {
      for (const double x : q[static_cast<std::size_t>(t)]) hq.push_back(from_double<__nv_bfloat16>(x));
      for (const double x : rotated_k(*tokens[static_cast<std::size_t>(t)], l, positions[static_cast<std::size_t>(t)]))
        hk.push_back(from_double<__nv_bfloat16>(x));
      for (const double x : tokens[static_cast<std::size_t>(t)]->v[static_cast<std::size_t>(l)])
        hv.push_back(from_double<__nv_bfloat16>(x));
    }
    DeviceArray<__nv_bfloat16> dq(hq), dk(hk), dv(hv), dout(hq.size());
    REQUIRE(cache.update_and_attend(l, dq.data(), dk.data(), dv.data(), dout.data(), T, kHq, 0.f, stream).ok());
    stream.synchronize();
    outs.push_back(as_double(dout.download()));
  }
  REQUIRE(cache.commit(stream).ok());
  stream.synchronize();
  return outs;
}

// Writes `tokens` for seq in steps of up to 64 (outputs ignored).
void fill(ShiftCache& cache, std::int32_t seq, const std::vector<Token>& tokens, gpu::Stream& stream) {
  for (std::size_t first = 0; first < tokens.size(); first += 64) {
    const std::size_t n = std::min<std::size_t>(64, tokens.size() - first);
    std::vector<const Token*> chunk;
    std::vector<std::vector<double>> q;
    for (std::size_t i = 0; i < n; ++i) {
      chunk.push_back(&tokens[first + i]);
      q.emplace_back(kHq * kD, 0.25);  // any query: the outputs are not checked
    }
    (void)run_step(cache, std::vector<std::int32_t>(n, seq), chunk, q, stream);
  }
}

// Float64 attention of one query row q [H_q D] at position qpos through window w over `keys`
// (position -> token): [H_q D].
std::vector<double> oracle(const std::vector<double>& q, std::int32_t qpos, std::int32_t w, std::int32_t l,
                           const std::map<std::int32_t, const Token*>& keys) {
  std::vector<double> out(kHq * kD, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  for (std::int32_t hq = 0; hq < kHq; ++hq) {
    const std::int32_t hk = hq / (kHq / kHkv);
    std::vector<double> scores, weights;
    std::vector<const double*> values;
    double top = -INFINITY;
    for (const auto& [p, tok] : keys) {
      if (p > qpos || (w > 0 && p <= qpos - w)) continue;
      const std::vector<double> k = rotated_k(*tok, l, p);
      double s = 0;
      for (std::int32_t d = 0; d < kD; ++d)
        s += to_double(from_double<__nv_bfloat16>(q[static_cast<std::size_t>(hq * kD + d)])) *
             k[static_cast<std::size_t>(hk * kD + d)];
      scores.push_back(s * scale);
      values.push_back(tok->v[static_cast<std::size_t>(l)].data() + hk * kD);
      top = std::max(top, scores.back());
    }
    double sum = 0;
    for (const double s : scores) sum += std::exp(s - top);
    for (std::size_t i = 0; i < scores.size(); ++i)
      for (std::int32_t d = 0; d < kD; ++d)
        out[static_cast<std::size_t>(hq * kD + d)] += std::exp(scores[i] - top) / sum * values[i][d];
  }
  return out;
}

void shift_and_divide(gpu::KernelChoice kernels) {
  ShiftCache cache({.max_write = 64, .max_cells = 2048, .max_seqs = 8},
                   {.layers = kLayers, .heads_kv = kHkv, .head_dim = kD, .heads_q = kHq});
  cache.use_kernels(kernels);
  gpu::Stream stream;
  std::mt19937_64 rng(77);
  std::vector<Token> prompt_a(300), prompt_c(192);
  for (auto& t : prompt_a) t = random_token(rng);
  for (auto& t : prompt_c) t = random_token(rng);
  const std::int32_t a = cache.seq_new().value();
  fill(cache, a, prompt_a, stream);
  const std::int32_t b = cache.seq_clone(a).value();  // shares all 300 cells: a's shift copies them on write

  // Without a key rotation the cell layout refuses to move cells, and nothing changes.
  CHECK(cache.seq_add(a, 120, -1, -100) == Errc::no_key_rotation);
  CHECK(cache.host().pos(a).value() == 300);
  CHECK(cache.host().pending_changes().rotations.empty());
  REQUIRE(cache.set_key_rotation(gpu::KeyRotation<__nv_bfloat16>::rope(RopeSpec{.theta = kTheta})).ok());

  // Context shift of a: keep 20, drop 100, slide the rest down.
  REQUIRE(cache.seq_rm(a, 20, 120).ok());
  REQUIRE(cache.seq_add(a, 120, -1, -100).ok());
  CHECK(cache.host().pos(a).value() == 200);
  CHECK(cache.host().pending_changes().copies.size() == 180);  // shared with b: copied on write
  // Self-extend of c: [0, 32) and the even positions of [64, 192) held; [64, ...) divided by 2.
  const std::int32_t c = cache.seq_new().value();
  fill(cache, c, prompt_c, stream);
  REQUIRE(cache.seq_rm(c, 32, 64).ok());
  for (std::int32_t p = 65; p < 192; p += 2) REQUIRE(cache.seq_rm(c, p, p + 1).ok());
  REQUIRE(cache.seq_div(c, 64, -1, 2).ok());
  CHECK(cache.host().pos(c).value() == 96);

  // What each sequence holds now: new position -> token.
  std::map<std::int32_t, const Token*> keys_a, keys_b, keys_c;
  for (std::int32_t p = 0; p < 300; ++p) keys_b[p] = &prompt_a[static_cast<std::size_t>(p)];
  for (std::int32_t p = 0; p < 20; ++p) keys_a[p] = &prompt_a[static_cast<std::size_t>(p)];
  for (std::int32_t p = 120; p < 300; ++p) keys_a[p - 100] = &prompt_a[static_cast<std::size_t>(p)];
  for (std::int32_t p = 0; p < 32; ++p) keys_c[p] = &prompt_c[static_cast<std::size_t>(p)];
  for (std::int32_t p = 64; p < 192; p += 2) keys_c[p / 2] = &prompt_c[static_cast<std::size_t>(p)];

  // One step: a prompt chunk of a (prefill rows), one decode token each of b and c.
  const std::vector<std::int32_t> seqs{a, a, a, b, c};
  std::vector<Token> fresh(seqs.size());
  std::vector<const Token*> tokens;
  std::vector<std::vector<double>> q;
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (auto& t : fresh) {
    t = random_token(rng);
    tokens.push_back(&t);
    q.emplace_back(kHq * kD);
    for (auto& x : q.back()) x = u(rng);
  }
  const std::vector<std::vector<double>> got = run_step(cache, seqs, tokens, q, stream);
  const std::vector<std::int32_t> qpos{200, 201, 202, 300, 96};
  double worst = 0;
  for (std::int32_t l = 0; l < kLayers; ++l) {
    std::map<std::int32_t, const Token*> ka = keys_a, kb = keys_b, kc = keys_c;
    for (std::size_t t = 0; t < seqs.size(); ++t) {
      auto& keys = seqs[t] == a ? ka : seqs[t] == b ? kb : kc;
      keys[qpos[t]] = tokens[t];
      const std::vector<double> want = oracle(q[t], qpos[t], ShiftModel::window_of_layer(l), l, keys);
      const std::vector<double> row(got[static_cast<std::size_t>(l)].begin() + static_cast<std::ptrdiff_t>(t * kHq * kD),
                                    got[static_cast<std::size_t>(l)].begin() + static_cast<std::ptrdiff_t>((t + 1) * kHq * kD));
      worst = std::max(worst, max_relative_difference(row, want, kD));
    }
  }
  CAPTURE(worst);
  CHECK(worst <= tolerance<__nv_bfloat16>());
  require_device_ok();
}

}  // namespace

TEST_CASE("sequence edits: random holes, copies, shifts and divisions match the float64 host reference") {
  const RopeSpec half{.theta = 10000.0};
  const RopeSpec partial{.theta = 500000.0, .rotary_dims = 32, .pairs = RopePairs::interleaved,
                         .scaling = RopeScaling::linear, .factor = 4.0};
  random_edit_run<Cells<__nv_bfloat16, placement::lowest_free>>(half, 32, 8, 128, 301, 40);
  random_edit_run<Cells<__half, placement::clustered<64>>>(partial, 16, 2, 64, 302, 40);
  random_edit_run<Cells<__nv_bfloat16, test::after_last>>(half, 4, 4, 256, 303, 25);
  random_edit_run<Cells<__nv_bfloat16, placement::clustered<16>>>(partial, 8, 2, 128, 304, 30,
                                                                   gpu::KernelChoice::reference);
}

TEST_CASE("seq_add / seq_div: attention equals float64 attention over K computed at the new positions") {
  SUBCASE("table kernels") { shift_and_divide(gpu::KernelChoice::automatic); }
  SUBCASE("reference kernel") { shift_and_divide(gpu::KernelChoice::reference); }
}

TEST_CASE("key rotation: refusals change nothing; none leaves K alone; a caller kernel runs once per layer") {
  using Cache = gpu::DeviceCache<layout::cell, __nv_bfloat16, Windows<0, 0>, placement::lowest_free, 8>;
  using Rotation = gpu::KeyRotation<__nv_bfloat16>;
  Cache cache({.max_write = 16, .max_cells = 256, .max_seqs = 4}, {.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 4});
  gpu::Stream stream;
  const std::int32_t s = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>(10, s)).ok());
  REQUIRE(cache.upload(stream).ok());
  DeviceArray<__nv_bfloat16> k(std::vector<__nv_bfloat16>(10 * 2 * 64, from_double<__nv_bfloat16>(0.5)));
  for (std::int32_t l = 0; l < 2; ++l) REQUIRE(cache.write(l, k.data(), k.data(), 10, stream).ok());
  REQUIRE(cache.commit(stream).ok());
  stream.synchronize();

  CHECK(cache.set_key_rotation(Rotation{}) == Errc::bad_argument);                           // unset
  CHECK(cache.set_key_rotation(Rotation::rope(RopeSpec{.theta = 0.5})) == Errc::bad_argument);  // theta <= 1
  CHECK(cache.set_key_rotation(Rotation::rope(RopeSpec{.rotary_dims = 3})) == Errc::bad_argument);
  CHECK(cache.set_key_rotation(Rotation::rope(RopeSpec{.rotary_dims = 66})) == Errc::bad_argument);
  CHECK(cache.set_key_rotation(Rotation::rope(RopeSpec{.scaling = RopeScaling::linear, .factor = 0.5})) ==
        Errc::bad_argument);
  CHECK(cache.set_key_rotation(Rotation::rope(std::vector<RopeSpec>(3))) == Errc::bad_argument);  // 2 layers
  CHECK(cache.set_key_rotation(Rotation::custom({})) == Errc::bad_argument);
  CHECK(cache.seq_add(s, 5, -1, 3) == Errc::no_key_rotation);  // still unset
  CHECK(cache.host().pos(s).value() == 10);

  SUBCASE("none: positions move, K stays as written") {
    REQUIRE(cache.set_key_rotation(Rotation::none()).ok());
    REQUIRE(cache.seq_add(s, 5, -1, 3).ok());
    CHECK(cache.host().pos(s).value() == 13);
    REQUIRE(cache.declare_step(std::vector<std::int32_t>{s}).ok());
    REQUIRE(cache.upload(stream).ok());
    REQUIRE(cache.commit(stream).ok());
    stream.synchronize();
    std::vector<__nv_bfloat16> pool(static_cast<std::size_t>(cache.pool().rows()) * 2 * 64);
    REQUIRE(cudaMemcpy(pool.data(), cache.pool().view(1).k, pool.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
    for (const std::int32_t p : {8, 12}) {
      const std::int64_t row = cache.host().row_of(s, p);
      for (std::int32_t i = 0; i < 2 * 64; ++i) CHECK(to_double(pool[static_cast<std::size_t>(row * 128 + i)]) == 0.5);
    }
  }
  SUBCASE("custom: called once per layer with the moved cells; a refusal stops the upload, which resumes there") {
    std::vector<std::pair<std::int32_t, std::int32_t>> calls;  // (layer, count)
    std::int32_t refuse_layer = -1;
    REQUIRE(cache.set_key_rotation(Rotation::custom([&](std::int32_t layer, const PoolView<__nv_bfloat16>& pool,
                                                        const RowRotation* rotations, std::int32_t count,
                                                        ::cuda::stream_ref) -> Status {
              CHECK(pool.k == cache.pool().view(layer).k);
              CHECK(rotations != nullptr);
              calls.emplace_back(layer, count);
              return layer == refuse_layer ? Status{Errc::bad_argument} : Status{};
            })).ok());
    REQUIRE(cache.seq_add(s, 5, -1, 3).ok());
    REQUIRE(cache.declare_step(std::vector<std::int32_t>{s}).ok());
    refuse_layer = 1;  // layer 0 is rotated, layer 1 refuses
    CHECK(cache.upload(stream) == Errc::bad_argument);
    CHECK(calls == std::vector<std::pair<std::int32_t, std::int32_t>>{{0, 5}, {1, 5}});
    CHECK(cache.holds_applied_changes());
    // Until the upload completes, verbs that could change the pending rotations are refused.
    CHECK(cache.seq_add(s, 0, 2, 1) == Errc::upload_incomplete);
    CHECK(cache.seq_rm(s, 0, 1) == Errc::upload_incomplete);
    CHECK(cache.rewind(s, 3) == Errc::upload_incomplete);
    CHECK(cache.seq_clone(s).status() == Errc::upload_incomplete);
    CHECK(cache.host().pos(s).value() == 14);  // 13 after the move, then the declared token
    refuse_layer = -1;
    calls.clear();
    REQUIRE(cache.upload(stream).ok());
    CHECK(calls == std::vector<std::pair<std::int32_t, std::int32_t>>{{1, 5}});  // layer 0 is not rotated twice
    CHECK_FALSE(cache.holds_applied_changes());
    REQUIRE(cache.commit(stream).ok());
    CHECK(cache.seq_rm(s, 0, 1).ok());
  }
  require_device_ok();
}

TEST_CASE("key rotation: the sequence layout refuses moves for its own reason, with or without a rotation") {
  using Cache = gpu::DeviceCache<layout::sequence, __nv_bfloat16, Windows<0>, placement::none, 4>;
  Cache cache({.max_write = 8, .max_seqs = 2, .max_len = 64}, {.layers = 1, .heads_kv = 1, .head_dim = 64, .heads_q = 1});
  const std::int32_t s = cache.seq_new().value();
  CHECK(cache.seq_add(s, 0, -1, 1) == Errc::unsupported_by_layout);
  CHECK(cache.seq_div(s, 0, -1, 2) == Errc::unsupported_by_layout);
  CHECK(cache.seq_rm(s, 0, -1).ok());  // a suffix: served
}

TEST_CASE("key rotation on a sharded cache: every shard re-rotates its heads as the single-GPU cache does") {
  using T = __nv_bfloat16;
  using W = Windows<0, 0>;
  const CacheConfig config{.max_write = 32, .max_cells = 512, .max_seqs = 4};
  const gpu::PoolShape shape{.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 4};
  gpu::DeviceCache<layout::cell, T, W, placement::lowest_free, 8> single(config, shape);
  gpu::ShardedCache<layout::cell, T, W, placement::lowest_free, 8> sharded(config, shape, std::vector<int>{0, 0});
  gpu::Stream s0, s1;
  const std::vector<::cuda::stream_ref> refs{s0.ref(), s1.ref()};
  std::mt19937_64 rng(11);
  const std::vector<T> k = random_values<T>(20 * 2 * 64, rng), v = random_values<T>(20 * 2 * 64, rng);
  DeviceArray<T> dk(k), dv(v), dk_head[2] = {DeviceArray<T>(20 * 64), DeviceArray<T>(20 * 64)},
                               dv_head[2] = {DeviceArray<T>(20 * 64), DeviceArray<T>(20 * 64)};
  for (int g = 0; g < 2; ++g) {  // shard g's KV head g: [20, 1, 64]
    std::vector<T> kh, vh;
    for (int t = 0; t < 20; ++t) {
      kh.insert(kh.end(), k.begin() + (t * 2 + g) * 64, k.begin() + (t * 2 + g + 1) * 64);
      vh.insert(vh.end(), v.begin() + (t * 2 + g) * 64, v.begin() + (t * 2 + g + 1) * 64);
    }
    dk_head[g].upload(kh);
    dv_head[g].upload(vh);
  }
  const std::int32_t s = single.seq_new().value();
  REQUIRE(sharded.seq_new().value() == s);
  const std::vector<std::int32_t> prompt(20, s);
  REQUIRE(single.declare_step(prompt).ok());
  REQUIRE(sharded.declare_step(prompt).ok());
  REQUIRE(single.upload(s0).ok());
  REQUIRE(sharded.upload(refs).ok());
  for (std::int32_t l = 0; l < 2; ++l) {
    REQUIRE(single.write(l, dk.data(), dv.data(), 20, s0).ok());
    for (int g = 0; g < 2; ++g) REQUIRE(sharded.shard(g).write(l, dk_head[g].data(), dv_head[g].data(), 20, refs[g]).ok());
  }
  REQUIRE(single.commit(s0).ok());
  REQUIRE(sharded.commit(refs).ok());

  CHECK(sharded.seq_add(s, 6, -1, -4) == Errc::no_key_rotation);
  const auto rope = gpu::KeyRotation<T>::rope(RopeSpec{.theta = 10000.0, .pairs = RopePairs::interleaved});
  CHECK(sharded.set_key_rotation(gpu::KeyRotation<T>::rope(RopeSpec{.rotary_dims = 65})) == Errc::bad_argument);
  REQUIRE(single.set_key_rotation(rope).ok());
  REQUIRE(sharded.set_key_rotation(rope).ok());
  auto edit = [&](auto& c) {  // the same verbs on both caches
    const std::int32_t f = c.seq_clone(s).value();  // shares s's cells: the shift copies them on write
    REQUIRE(c.seq_rm(s, 2, 6).ok());
    REQUIRE(c.seq_add(s, 6, -1, -4).ok());
    REQUIRE(c.declare_step(std::vector<std::int32_t>{s, f}).ok());
  };
  edit(single);
  edit(sharded);
  REQUIRE(single.upload(s0).ok());
  REQUIRE(sharded.upload(refs).ok());
  REQUIRE(single.commit(s0).ok());
  REQUIRE(sharded.commit(refs).ok());
  s0.synchronize();
  s1.synchronize();
  // Every row both hosts placed alike: shard g's K of head g equals the single cache's, bit for bit.
  const auto rows = static_cast<std::size_t>(single.pool().rows());
  for (std::int32_t l = 0; l < 2; ++l) {
    std::vector<T> whole(rows * 2 * 64);
    REQUIRE(cudaMemcpy(whole.data(), single.pool().view(l).k, whole.size() * sizeof(T), cudaMemcpyDeviceToHost) ==
            cudaSuccess);
    for (int g = 0; g < 2; ++g) {
      std::vector<T> part(rows * 64);
      REQUIRE(cudaMemcpy(part.data(), sharded.shard(g).pool().view(l).k, part.size() * sizeof(T),
                         cudaMemcpyDeviceToHost) == cudaSuccess);
      for (std::int32_t p = 0; p < 16; ++p) {
        const std::int64_t row = single.host().row_of(s, p);
        REQUIRE(row == sharded.host().row_of(s, p));
        CHECK(std::memcmp(&whole[static_cast<std::size_t>(row) * 128 + static_cast<std::size_t>(g) * 64],
                          &part[static_cast<std::size_t>(row) * 64], 64 * sizeof(T)) == 0);
      }
    }
  }
  // And the moved rows did change (a rotation ran): position 6 of s now holds token 10's K re-rotated.
  std::vector<T> moved(2 * 64);
  REQUIRE(cudaMemcpy(moved.data(), single.pool().view(0).k + single.host().row_of(s, 6) * 128, moved.size() * sizeof(T),
                     cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::memcmp(moved.data(), &k[10 * 128], 128 * sizeof(T)) != 0);
  require_device_ok();
}

TEST_CASE("key rotation on a sharded cache: a shard that uploaded does not rotate again when another shard retries") {
  using T = __nv_bfloat16;
  using C = gpu::ShardedCache<layout::cell, T, Windows<0, 0>, placement::lowest_free, 8>;
  C cache({.max_write = 16, .max_cells = 256, .max_seqs = 4}, {.layers = 2, .heads_kv = 2, .head_dim = 64, .heads_q = 4},
          std::vector<int>{0, 0});
  gpu::Stream s0, s1;
  const std::vector<::cuda::stream_ref> refs{s0.ref(), s1.ref()};
  std::vector<std::pair<const T*, std::int32_t>> calls;  // (pool K of the shard's layer, layer)
  bool refuse_shard1 = false;
  REQUIRE(cache.set_key_rotation(gpu::KeyRotation<T>::custom([&](std::int32_t layer, const PoolView<T>& pool,
                                                                  const RowRotation*, std::int32_t,
                                                                  ::cuda::stream_ref) -> Status {
            calls.emplace_back(pool.k, layer);
            return refuse_shard1 && pool.k == cache.shard(1).pool().view(layer).k ? Status{Errc::bad_argument} : Status{};
          })).ok());
  const std::int32_t s = cache.seq_new().value();
  REQUIRE(cache.declare_step(std::vector<std::int32_t>(10, s)).ok());
  REQUIRE(cache.upload(refs).ok());
  REQUIRE(cache.commit(refs).ok());
  REQUIRE(cache.seq_add(s, 5, -1, 3).ok());
  REQUIRE(cache.declare_step(std::vector<std::int32_t>{s}).ok());
  refuse_shard1 = true;
  CHECK(cache.upload(refs) == Errc::bad_argument);  // shard 0 rotated both layers, shard 1 refused at layer 0
  CHECK(calls.size() == 3);
  CHECK(cache.seq_add(s, 0, 2, 1) == Errc::upload_incomplete);
  refuse_shard1 = false;
  calls.clear();
  REQUIRE(cache.upload(refs).ok());  // shard 0 applies nothing again; shard 1 both layers
  REQUIRE(calls.size() == 2);
  for (const auto& [k, layer] : calls) CHECK(k == cache.shard(1).pool().view(layer).k);
  REQUIRE(cache.commit(refs).ok());
  CHECK(cache.seq_add(s, 12, -1, 1).ok());  // acknowledged at this verb: every shard uploaded
  require_device_ok();
}
