// cellkv/gpu/kernels/mma.cuh - tensor-core and async-copy building blocks (sm_80+ PTX; used on
// sm_90): cp.async 16-byte copies, ldmatrix, mma.sync m16n8k16 with fp32 accumulation, and the
// XOR swizzle that keeps ldmatrix free of shared-memory bank conflicts.
//
// Fragment layouts of mma.m16n8k16 (lane = threadIdx.x % 32, g = lane / 4, q = lane % 4):
//   A 16x16 (4 regs of 2 elements): a0 (g, 2q..2q+1), a1 (g+8, 2q..), a2 (g, 2q+8..), a3 (g+8, 2q+8..)
//   B 16x8  (2 regs):               b0 (k = 2q..2q+1, n = g), b1 (k = 2q+8.., n = g)
//   C 16x8  (4 floats):             c0,c1 (g, 2q..2q+1), c2,c3 (g+8, 2q..2q+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace cellkv::gpu::kernels {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; when `valid` is false the destination is zero-filled
// and nothing is read from global memory.
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, bool valid = true) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// An L2 cache policy that evicts first what it tags: K/V rows streamed once per step, so the small
// data read again (position tables, queries, partial results) stays in L2.
__device__ __forceinline__ std::uint64_t evict_first_policy() {
  std::uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
// cp_async_16 of a gathered row with an L2 cache policy (evict_first_policy()): `row_id` < 0 (a
// hole, or a position nobody reads) zero-fills and reads nothing. The sign test is the copy's
// ignore-src predicate itself, one instruction.
__device__ __forceinline__ void cp_async_16_row(std::uint32_t dst, const void* src, int row_id, std::uint64_t policy) {
  asm volatile("{\n .reg .pred ignore;\n setp.lt.s32 ignore, %2, 0;\n"
               " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, ignore, %3;\n}\n" ::"r"(dst), "l"(src),
               "r"(row_id), "l"(policy));
}
// base + row x row_bytes as one 32 x 32 -> 64-bit multiply-add (mad.wide.u32), which the compiler
// would otherwise split into a multiply shared between bases and a 64-bit add per base.
__device__ __forceinline__ const void* row_address(std::uint64_t base, std::uint32_t row, std::uint32_t row_bytes) {
  std::uint64_t address;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(address) : "r"(row), "r"(row_bytes), "l"(base));
  return reinterpret_cast<const void*>(address);
}
// Brings the 128-byte line at p into L2 (no register or shared memory written).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
// Drops the 128-byte line at p (128-byte aligned) from L2 without writing it back: its contents
// become undefined. For scratch read for the last time, so it never costs a DRAM write.
__device__ __forceinline__ void discard_l2(const void* p) { asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory"); }
// 4 bytes global -> shared asynchronously (cp.async.ca: the 4-byte form goes through L1);
// zero-filled when `valid` is false, nothing read.
__device__ __forceinline__ void cp_async_4(std::uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a * b for one m16n8k16 tile; T is __nv_bfloat16 or __half.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of two T (low half = lo).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&v);
  }
}

// Shared-memory tile of Rows x D elements of 2 bytes, rows of D*2 bytes, 16-byte chunks swizzled:
// logical chunk c of row r lives at physical chunk c ^ (r % 8). Eight consecutive rows read at
// one logical chunk hit eight distinct 16-byte bank groups.
template <int D>
struct SwizzledTile {
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  static __device__ __forceinline__ std::uint32_t offset(int row, int chunk) {
    return static_cast<std::uint32_t>(row * D * 2 + ((chunk ^ (row & 7)) * 16));
  }
};

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cellkv::gpu::kernels
