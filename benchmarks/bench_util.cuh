// Helpers the GPU benchmarks share: random device data, event timing, JSON lines and the shape
// names of the report. Benchmarks are timing programs, never tests.
#pragma once

#include <cellkv/fp8.hpp>
#include <cellkv/gpu/error.hpp>
#include <cellkv/gpu/stream.hpp>

#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace cellkv::bench {

__global__ void fill_random_kernel(__nv_bfloat16* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    p[i] = __float2bfloat16(static_cast<float>(x & 0xffff) / 32768.f - 1.f);
  }
}

// n bf16 values in [-1, 1), a hash of (index, seed): never zeros, no host round trip.
inline void randomize(__nv_bfloat16* p, std::size_t n, std::uint32_t seed) {
  fill_random_kernel<<<1024, 256>>>(p, n, seed);
  CELLKV_CUDA_THROW(cudaGetLastError());
}

__global__ void fill_codes_kernel(Fp8E4M3* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
    const auto code = static_cast<std::uint8_t>(x & 0xBF);  // |value| < 2 (exponent field < 8): never NaN
    p[i] = Fp8E4M3{code};
  }
}

// n E4M3 codes of magnitude below 2, a hash of (index, seed), and their scales set to `scale`.
inline void randomize(Fp8E4M3* p, std::size_t n, std::uint32_t seed) {
  fill_codes_kernel<<<1024, 256>>>(p, n, seed);
  CELLKV_CUDA_THROW(cudaGetLastError());
}
inline void fill_scales(float* p, std::size_t n, float scale) {
  std::vector<float> host(n, scale);
  CELLKV_CUDA_THROW(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
}

// Median milliseconds of one call of f(): `samples` samples of `reps` back-to-back calls, after
// warm-up calls for at least `warm_ms` of wall time (eight calls at least): an idle GPU runs at
// a low clock and takes milliseconds of load to reach its boost clock, so a few calls of a short
// step would be timed at the wrong clock.
template <class F>
double time_ms(F&& f, cudaStream_t stream, int reps, int samples, double warm_ms = 25.0) {
  gpu::Event start(true), stop(true);
  const auto warm_start = std::chrono::steady_clock::now();
  for (int calls = 0;; ++calls) {
    f();
    if (calls % 8 != 7) continue;
    CELLKV_CUDA_THROW(cudaStreamSynchronize(stream));
    const std::chrono::duration<double, std::milli> spent = std::chrono::steady_clock::now() - warm_start;
    if (spent.count() >= warm_ms) break;
  }
  std::vector<float> ms;
  for (int s = 0; s < samples; ++s) {
    (void)start.record(stream);
    for (int r = 0; r < reps; ++r) f();
    (void)stop.record(stream);
    CELLKV_CUDA_THROW(cudaEventSynchronize(stop.get()));
    float t = 0;
    CELLKV_CUDA_THROW(cudaEventElapsedTime(&t, start.get(), stop.get()));
    ms.push_back(t / static_cast<float>(reps));
  }
  std::nth_element(ms.begin(), ms.begin() + samples / 2, ms.end());
  return ms[static_cast<std::size_t>(samples / 2)];
}

// One JSON line (report.py reads these) and a line of the human table on stderr.
inline void emit(std::FILE* out, const char* work, const std::string& shape, const char* impl, double ms, double metric,
                 const char* unit) {
  std::fprintf(out, "{\"work\": \"%s\", \"shape\": \"%s\", \"impl\": \"%s\", \"ms\": %.6f, \"metric\": %.4f, \"unit\": \"%s\"}\n",
               work, shape.c_str(), impl, ms, metric, unit);
  std::fflush(out);
  std::fprintf(stderr, "  %-18s %-12s %-28s %10.4f ms %10.3f %s\n", work, shape.c_str(), impl, ms, metric, unit);
}

// "16x4k", "1x32k", "3x700".
inline std::string shape_name(std::int32_t n, std::int32_t len) {
  return std::to_string(n) + "x" + (len % 1024 == 0 ? std::to_string(len / 1024) + "k" : std::to_string(len));
}

}  // namespace cellkv::bench
