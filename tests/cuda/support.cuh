// Helpers for the GPU suite: device arrays, random data, host copies as double, tolerances.
#pragma once

#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cellkv/gpu/dtype.hpp"
#include "cellkv/gpu/memory.hpp"
#include "cellkv/status.hpp"
#include "../host/support.hpp"  // Status printing, step helpers


namespace cellkv::test {

inline double to_double(float x) { return x; }
inline double to_double(__half x) { return static_cast<double>(__half2float(x)); }
inline double to_double(__nv_bfloat16 x) { return static_cast<double>(__bfloat162float(x)); }

template <class T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, float>) return static_cast<float>(x);
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(static_cast<float>(x));
  else return __float2bfloat16_rn(static_cast<float>(x));
}

// A bit pattern that reads as NaN in every element type: poison for "was this written?".
template <class T>
T poison() {
  if constexpr (sizeof(T) == 2) return std::bit_cast<T>(std::uint16_t{0xffff});
  else return std::bit_cast<T>(std::uint32_t{0xffffffff});
}

template <class T>
bool is_poison(T x) {
  const T p = poison<T>();
  return std::memcmp(&x, &p, sizeof(T)) == 0;
}

// Relative tolerance of an output against a float64 reference.
template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-2;
}

// Host values drawn uniformly from [-1, 1), already rounded to T.
template <class T>
std::vector<T> random_values(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> out(n);
  for (auto& x : out) x = from_double<T>(u(rng));
  return out;
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_double(v[i]);
  return out;
}

// A device array with host round trips (tests only), synchronous with every stream: each round
// trip first waits for the whole device. cudaMemcpy runs on the legacy default stream, which the
// caches' non-blocking streams do not wait for, so without that wait an upload could overwrite
// inputs a kernel queued on a cache's stream has not read yet (a loop of steps that never waits,
// on a slow or instrumented GPU: under racecheck the fork tests' prompts were written wrong).
template <class T>
struct DeviceArray {
  gpu::DeviceBuffer<T> buf;
  explicit DeviceArray(std::size_t n) : buf(n) {}
  explicit DeviceArray(const std::vector<T>& host) : buf(host.size()) { upload(host); }
  void upload(const std::vector<T>& host) {
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaMemcpy(buf.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<T> download() const {
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<T> host(buf.size());
    REQUIRE(cudaMemcpy(host.data(), buf.data(), host.size() * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return host;
  }
  void fill(T value) { upload(std::vector<T>(buf.size(), value)); }
  T* data() const { return buf.data(); }
};

// Compares attention outputs [tokens, heads, D] with a float64 reference: per (token, head), the
// largest error relative to the largest reference value (absolute when the row is all zeros), and
// no poison left. Returns the worst relative error.
template <class T>
double compare_outputs(const std::vector<T>& got, const std::vector<double>& want, std::int32_t head_dim) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t r = 0; r < got.size(); r += static_cast<std::size_t>(head_dim)) {
    double scale = 0, err = 0;
    for (std::int32_t d = 0; d < head_dim; ++d) {
      const std::size_t i = r + static_cast<std::size_t>(d);
      REQUIRE_FALSE(is_poison(got[i]));
      REQUIRE(std::isfinite(to_double(got[i])));
      scale = std::max(scale, std::abs(want[i]));
      err = std::max(err, std::abs(to_double(got[i]) - want[i]));
    }
    if (scale == 0) REQUIRE(err == 0);  // a row that sees nothing is exactly zero
    worst = std::max(worst, scale == 0 ? err : err / scale);
  }
  return worst;
}

// Largest per-row difference of two outputs [rows, head_dim], relative to the row's largest value
// in `b` (absolute for an all-zero row).
inline double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b, std::int32_t head_dim) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t r = 0; r < a.size(); r += static_cast<std::size_t>(head_dim)) {
    double scale = 0, err = 0;
    for (std::size_t i = r; i < r + static_cast<std::size_t>(head_dim); ++i) {
      scale = std::max(scale, std::abs(b[i]));
      err = std::max(err, std::abs(a[i] - b[i]));
    }
    worst = std::max(worst, scale == 0 ? err : err / scale);
  }
  return worst;
}

inline void require_device_ok() {
  REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

// The compute capability's major number of the current device (9: Hopper, where an sm_90a build
// runs the wgmma kernels).
inline int compute_major() {
  int device = 0, major = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess);
  return major;
}

// Constructs cache.emplace(args...) with CELLKV_PREFILL_KERNEL=mma set (the mma.sync prefill and
// shared-prefix kernels on every device); the variable unset after.
template <class Cache, class... Args>
void make_mma_cache(std::optional<Cache>& cache, Args&&... args) {
  REQUIRE(setenv("CELLKV_PREFILL_KERNEL", "mma", 1) == 0);
  cache.emplace(std::forward<Args>(args)...);
  REQUIRE(unsetenv("CELLKV_PREFILL_KERNEL") == 0);
}

}  // namespace cellkv::test
