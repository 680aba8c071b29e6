// llama/config.hpp - a Llama-style decoder's sizes and its weights, generated deterministically
// from a seed (the same floats on the host and on the GPU). Matrices are row-major [in, out]:
// y = x W.
#pragma once

#include <cellkv/rope.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace llama {

struct Config {
  std::int32_t vocab = 256;
  std::int32_t dim = 128;
  std::int32_t layers = 4;
  std::int32_t heads_q = 4;
  std::int32_t heads_kv = 2;
  std::int32_t head_dim = 64;
  std::int32_t ffn = 256;
  float rope_theta = 10000.f;
  float norm_eps = 1e-5f;
  std::uint64_t seed = 1;

  [[nodiscard]] std::int32_t q_width() const { return heads_q * head_dim; }
  [[nodiscard]] std::int32_t kv_width() const { return heads_kv * head_dim; }
};

struct LayerWeights {
  std::vector<float> attn_norm, wq, wk, wv, wo;  // [dim], [dim, Hq D], [dim, Hkv D] x2, [Hq D, dim]
  std::vector<float> ffn_norm, w1, w3, w2;       // [dim], [dim, ffn] x2, [ffn, dim]
};

struct Weights {
  std::vector<float> embed;       // [vocab, dim]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [dim]
  std::vector<float> lm_head;     // [dim, vocab]
};

namespace detail {
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// n values uniform in [-limit, limit), stream `id` of the seed.
inline std::vector<float> uniform(std::size_t n, float limit, std::uint64_t seed, std::uint64_t id) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = splitmix64(seed * 0x100000001b3ull ^ (id << 40) ^ i);
    out[i] = limit * (static_cast<float>(r >> 40) / static_cast<float>(1ull << 23) - 1.f);
  }
  return out;
}
// A matrix [in, out] scaled so activations keep their size: limit sqrt(3 / in).
inline std::vector<float> matrix(std::int32_t in, std::int32_t out, std::uint64_t seed, std::uint64_t id) {
  return uniform(static_cast<std::size_t>(in) * static_cast<std::size_t>(out), std::sqrt(3.f / static_cast<float>(in)),
                 seed, id);
}
inline std::vector<float> norm_gain(std::int32_t n, std::uint64_t seed, std::uint64_t id) {
  auto g = uniform(static_cast<std::size_t>(n), 0.1f, seed, id);
  for (auto& x : g) x += 1.f;
  return g;
}
}  // namespace detail

inline Weights generate(const Config& c) {
  using namespace detail;
  Weights w;
  w.embed = uniform(static_cast<std::size_t>(c.vocab) * static_cast<std::size_t>(c.dim), 1.f, c.seed, 1);
  for (std::int32_t l = 0; l < c.layers; ++l) {
    const std::uint64_t id = 100 + 16 * static_cast<std::uint64_t>(l);
    w.layers.push_back({norm_gain(c.dim, c.seed, id), matrix(c.dim, c.q_width(), c.seed, id + 1),
                        matrix(c.dim, c.kv_width(), c.seed, id + 2), matrix(c.dim, c.kv_width(), c.seed, id + 3),
                        matrix(c.q_width(), c.dim, c.seed, id + 4), norm_gain(c.dim, c.seed, id + 5),
                        matrix(c.dim, c.ffn, c.seed, id + 6), matrix(c.dim, c.ffn, c.seed, id + 7),
                        matrix(c.ffn, c.dim, c.seed, id + 8)});
  }
  w.final_norm = norm_gain(c.dim, c.seed, 2);
  w.lm_head = matrix(c.dim, c.vocab, c.seed, 3);
  for (auto& x : w.lm_head) x *= 4.f;  // sharper next-token distributions
  return w;
}

// RoPE angle of pair i (elements 2i, 2i + 1) of a head at position pos.
inline float rope_angle(const Config& c, std::int32_t pos, std::int32_t i) {
  return static_cast<float>(pos) * std::pow(c.rope_theta, -2.f * static_cast<float>(i) / static_cast<float>(c.head_dim));
}

// The same RoPE described for cellkv's key re-rotation (rope.hpp): interleaved pairs over the
// whole head, theta = rope_theta, no scaling. The host path passes it to HostPool::sync, the GPU
// models to their device cache's KeyRotation.
inline cellkv::RopeSpec rope_spec(const Config& c) {
  return {.theta = static_cast<double>(c.rope_theta), .rotary_dims = c.head_dim, .pairs = cellkv::RopePairs::interleaved};
}

}  // namespace llama
