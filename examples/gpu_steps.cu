// gpu_steps: a few cell-layout steps on the GPU (two sequences, a fork, a removal, refilled holes),
// two layers with different windows, each step checked against the host reference. Exits 1 on a
// mismatch; exits 0 with a note when there is no CUDA device.
//
//   build/examples/cellkv-gpu-steps
#include <cellkv/cellkv.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using Model = cellkv::Windows<0, 4>;  // layer 0: full history; layer 1: sliding window of 4
using Cache = cellkv::gpu::DeviceCache<cellkv::layout::cell, __nv_bfloat16, Model>;
constexpr std::int32_t kHeadsQ = 8, kHeadsKv = 2, kDim = 128, kMaxWrite = 8;

struct HostPools {  // float copies of the device pools, for the reference
  std::vector<std::vector<float>> k, v;
};

std::vector<__nv_bfloat16> random_bf16(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<__nv_bfloat16> out(n);
  for (auto& x : out) x = __float2bfloat16(u(rng));
  return out;
}

std::vector<float> to_float(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// One step: device forward over both layers, then the host reference; returns the worst error.
float run_step(Cache& cache, HostPools& host, const std::vector<std::int32_t>& seqs, std::mt19937& rng,
               cudaStream_t stream) {
  if (!cache.declare_step(seqs).ok()) return INFINITY;
  const auto T = static_cast<std::int32_t>(seqs.size());
  const auto q = random_bf16(static_cast<std::size_t>(T * kHeadsQ * kDim), rng);
  const auto k = random_bf16(static_cast<std::size_t>(T * kHeadsKv * kDim), rng);
  const auto v = random_bf16(k.size(), rng);
  cellkv::gpu::DeviceBuffer<__nv_bfloat16> dq(q.size()), dk(k.size()), dv(v.size()), dout(q.size() * Model::kLayers);
  // On the cache's stream: a plain cudaMemcpy runs on the legacy default stream, which a
  // non-blocking stream does not wait for (q, k and v stay alive until the stream is synchronized).
  cudaMemcpyAsync(dq.data(), q.data(), q.size() * 2, cudaMemcpyHostToDevice, stream);
  cudaMemcpyAsync(dk.data(), k.data(), k.size() * 2, cudaMemcpyHostToDevice, stream);
  cudaMemcpyAsync(dv.data(), v.data(), v.size() * 2, cudaMemcpyHostToDevice, stream);
  if (!cache.upload(stream).ok()) return INFINITY;
  for (std::int32_t l = 0; l < Model::kLayers; ++l)
    if (!cache.update_and_attend(l, dq.data(), dk.data(), dv.data(), dout.data() + l * q.size(), T, kHeadsQ, 0.f, stream).ok())
      return INFINITY;
  if (!cache.commit(stream).ok()) return INFINITY;
  std::vector<__nv_bfloat16> got(dout.size());
  cudaMemcpyAsync(got.data(), dout.data(), got.size() * 2, cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);

  const auto qf = to_float(q), kf = to_float(k), vf = to_float(v);
  float worst = 0;
  for (std::int32_t l = 0; l < Model::kLayers; ++l) {
    std::vector<float> want(q.size());
    const cellkv::PoolView<float> pool{host.k[static_cast<std::size_t>(l)].data(), host.v[static_cast<std::size_t>(l)].data(),
                                       cache.pool().rows(), kHeadsKv, kDim};
    (void)cellkv::reference::update_and_attend(cache.host(), Model::window_of_layer(l), pool, std::span<const float>(qf),
                                               std::span<const float>(kf), std::span<const float>(vf),
                                               std::span<float>(want), kHeadsQ, cellkv::reference::default_scale(kDim));
    for (std::size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, std::abs(__bfloat162float(got[static_cast<std::size_t>(l) * q.size() + i]) - want[i]));
  }
  const auto plan = cache.host().step();
  std::printf("  step of %d tokens, read_len %3lld, cells", T, static_cast<long long>(plan.read_len));
  for (const auto c : plan.rows) std::printf(" %lld", static_cast<long long>(c));
  std::printf(": max |gpu - host| = %.4f\n", static_cast<double>(worst));
  return worst;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cellkv gpu_steps: no CUDA device here; nothing to run (the host example is cellkv-cell-map)\n");
    return 0;
  }
  std::printf("cellkv gpu_steps: bf16, H_q %d, H_kv %d, D %d, two layers (windows 0 and 4), cell layout\n", kHeadsQ,
              kHeadsKv, kDim);
  Cache cache({.max_write = kMaxWrite, .max_cells = 64}, {.layers = Model::kLayers, .heads_kv = kHeadsKv, .head_dim = kDim});
  const std::size_t pool_elems = static_cast<std::size_t>(cache.pool().rows()) * kHeadsKv * kDim;
  HostPools host{std::vector<std::vector<float>>(Model::kLayers, std::vector<float>(pool_elems)), {}};
  host.v = host.k;
  cellkv::gpu::Stream stream;
  std::mt19937 rng(7);
  const std::int32_t a = cache.seq_new().value(), b = cache.seq_new().value();
  float worst = 0;
  worst = std::max(worst, run_step(cache, host, {a, a, a, a, b, b, b}, rng, stream.get()));
  worst = std::max(worst, run_step(cache, host, {a, b}, rng, stream.get()));
  const std::int32_t c = cache.seq_clone(a, 3).value();
  worst = std::max(worst, run_step(cache, host, {c, c, a}, rng, stream.get()));
  (void)cache.seq_rm(b);
  worst = std::max(worst, run_step(cache, host, {c, a, a, a, a, a}, rng, stream.get()));
  const bool ok = worst < 2e-2f;
  std::printf("%s: worst difference %.4f (bf16 tolerance 0.02)\n", ok ? "OK" : "FAILED", static_cast<double>(worst));
  return ok ? 0 : 1;
}
