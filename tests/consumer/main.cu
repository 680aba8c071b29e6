// Uses cellkv's CUDA tier through the subproject's cellkv-cuda dependency: write_kv of one token
// into a pool of two rows (plus the scratch row), read back. Without a device it says so and passes.
#include <cellkv/gpu/launch/ops.cuh>
#include <cellkv/gpu/memory.hpp>
#include <cellkv/gpu/stream.hpp>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("consumer-cuda: built against cellkv-cuda; no device, nothing run\n");
    return 0;
  }
  constexpr std::int32_t kHeads = 1, kDim = 64, kRows = 2;
  using cellkv::gpu::DeviceBuffer;
  DeviceBuffer<__half> pool_k((kRows + 1) * kHeads * kDim), pool_v(pool_k.size()), k(kHeads * kDim), v(k.size());
  DeviceBuffer<std::int64_t> cells(1);
  const std::vector<__half> ones(k.size(), __float2half(1.f));
  const std::int64_t row = 1;
  cudaMemcpy(k.data(), ones.data(), k.bytes(), cudaMemcpyHostToDevice);
  cudaMemcpy(v.data(), ones.data(), v.bytes(), cudaMemcpyHostToDevice);
  cudaMemset(pool_k.data(), 0, pool_k.bytes());
  cudaMemcpy(cells.data(), &row, sizeof row, cudaMemcpyHostToDevice);
  const cellkv::gpu::Stream stream;
  const cellkv::Status s = cellkv::gpu::write_kv<__half>({pool_k.data(), pool_v.data(), kRows, kHeads, kDim}, k.data(),
                                                         v.data(), cells.data(), 1, stream);
  stream.synchronize();
  std::vector<__half> back(pool_k.size());
  cudaMemcpy(back.data(), pool_k.data(), pool_k.bytes(), cudaMemcpyDeviceToHost);
  const bool ok = s.ok() && __half2float(back[kDim]) == 1.f && __half2float(back[0]) == 0.f;
  std::printf("consumer-cuda: write_kv %s\n", ok ? "ok" : "wrong");
  return ok ? 0 : 1;
}
