// cellkv/gpu/kernels/wgmma.cuh - Hopper warpgroup MMA (wgmma, sm_90a) for the attention kernels:
// shared-memory matrix descriptors of the 128-byte swizzled layout, the tile layout they describe,
// and m64nNk16 MMAs (N = 64, 128, 256) with A in registers and B in shared memory, or both in shared
// memory (N = 64, 128), bf16 / fp16 operands, fp32 accumulation. Every function here is issued by all 128 threads of a warpgroup.
//
// Fragment layouts (warp w = 0..3 of the warpgroup, lane, g = lane / 4, q = lane % 4):
//   A 64x16 in registers: warp w holds rows [16 w, 16 w + 16) as mma.m16n8k16's A (mma.cuh)
//   D 64xN fp32, d[N / 8][4]: d[n] is the 16x8 block (rows 16 w.., columns 8 n..) in mma.m16n8k16's
//   C layout: d[n][0..1] row g, columns 8 n + 2 q + {0, 1}; d[n][2..3] row g + 8
// so the online softmax of attention_tiles.cuh (RowState, mask_tile) runs on them unchanged.
//
// Sw128Tile<Rows, D>: Rows x D elements of 2 bytes as D / 64 column blocks of [Rows][64], each row
// of a block 128 bytes with its 16-byte chunk c stored at chunk c ^ (row % 8), every block
// 1024-byte aligned: the canonical 128-byte swizzle of wgmma. The same tile serves as
//   Q of S = Q K^T: A "K-major" (the reduction dim D contiguous), 64 rows from an 8-row atom on;
//   K of S = Q K^T: B "K-major", no transpose;
//   V of O = P V:   B "MN-major" (the output dim D contiguous), transposed.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace cellkv::gpu::kernels {

// Byte offset of 16-byte chunk `chunk` (D / 8 per row) of row `row` of an Sw128Tile.
template <int Rows, int D>
struct Sw128Tile {
  static_assert(D % 64 == 0 && Rows % 8 == 0, "whole 64-column blocks of whole 8-row swizzle atoms");
  static constexpr int kBlockBytes = Rows * 128;  // one 64-column block
  static constexpr int kBytes = D / 64 * kBlockBytes;
  static __device__ __forceinline__ std::uint32_t offset(int row, int chunk) {
    return static_cast<std::uint32_t>((chunk >> 3) * kBlockBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
  }
};

// A shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (all in 16-byte units).
__device__ __forceinline__ std::uint64_t sw128_descriptor(std::uint32_t addr, std::uint32_t leading, std::uint32_t stride) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<std::uint64_t>((leading >> 4) & 0x3FFF) << 16 |
         static_cast<std::uint64_t>((stride >> 4) & 0x3FFF) << 32 | std::uint64_t{1} << 62;
}

// A descriptor `bytes` further into shared memory: a 32-bit add to the low word, whose address
// field takes no carry out (shared addresses stay below 256 KB).
__device__ __forceinline__ std::uint64_t advance(std::uint64_t descriptor, std::uint32_t bytes) {
  const std::uint32_t low = static_cast<std::uint32_t>(descriptor) + (bytes >> 4);
  return (descriptor & 0xFFFFFFFF00000000ull) | low;
}

// A = Q or B = K^T for k-step kk (D columns [16 kk, 16 kk + 16)) of a Q or K tile [Rows][D]
// (Sw128Tile): K-major, 8-row atoms 1024 bytes apart; a k-step is 32 bytes into its column block.
template <int Rows, int D>
__host__ __device__ constexpr std::uint32_t k_step_bytes(int kk) {
  return static_cast<std::uint32_t>((kk >> 2) * Sw128Tile<Rows, D>::kBlockBytes + (kk & 3) * 32);
}
// k_operand(tile, kk) = advance(k_operand(tile, 0), k_step_bytes(kk)).
template <int Rows, int D>
__device__ __forceinline__ std::uint64_t k_operand(std::uint32_t tile, int kk) {
  return sw128_descriptor(tile + k_step_bytes<Rows, D>(kk), 16, 1024);
}

// B = V for k-step ks (tile rows [16 ks, 16 ks + 16)) of a V tile [Rows][D] (Sw128Tile): MN-major,
// 64-column blocks kBlockBytes apart (leading), 8-row atoms 1024 bytes apart (stride).
// v_operand(tile, ks) = advance(v_operand(tile, 0), 2048 ks).
template <int Rows, int D>
__device__ __forceinline__ std::uint64_t v_operand(std::uint32_t tile, int ks) {
  return sw128_descriptor(tile + ks * 16 * 128, Sw128Tile<Rows, D>::kBlockBytes, 1024);
}

// Orders this thread's register and shared-memory accesses before the wgmmas issued after it.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the group of wgmmas issued since the last commit.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most `Pending` committed groups are still running.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// Pins accumulator registers at this point of the program, so the compiler moves no access to them
// across an issue or a wait (the asm reads and writes every one).
template <int M>
__device__ __forceinline__ void fence_accumulators(float (&d)[M][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}

// Register-name lists and operand tails of the MMA below, by N (%0.. the accumulators, then the
// four A registers, the B descriptor and the accumulate flag).
#define CELLKV_WGMMA_D64 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define CELLKV_WGMMA_TAIL64 ", {%32, %33, %34, %35}, %36, p, 1, 1, "
#define CELLKV_WGMMA_SCALE64 "%37"
#define CELLKV_WGMMA_D128 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63" \
  "}"
#define CELLKV_WGMMA_TAIL128 ", {%64, %65, %66, %67}, %68, p, 1, 1, "
#define CELLKV_WGMMA_SCALE128 "%69"
#define CELLKV_WGMMA_D256 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, " \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, " \
  "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, " \
  "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
  "%123, %124, %125, %126, %127" \
  "}"
#define CELLKV_WGMMA_TAIL256 ", {%128, %129, %130, %131}, %132, p, 1, 1, "
#define CELLKV_WGMMA_SCALE256 "%133"

#define CELLKV_ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define CELLKV_ACC16(i) CELLKV_ACC4(i), CELLKV_ACC4(i + 1), CELLKV_ACC4(i + 2), CELLKV_ACC4(i + 3)
#define CELLKV_WGMMA_OPS64 CELLKV_ACC16(0), CELLKV_ACC16(4)
#define CELLKV_WGMMA_OPS128 CELLKV_WGMMA_OPS64, CELLKV_ACC16(8), CELLKV_ACC16(12)
#define CELLKV_WGMMA_OPS256 \
  CELLKV_WGMMA_OPS128, CELLKV_ACC16(16), CELLKV_ACC16(20), CELLKV_ACC16(24), CELLKV_ACC16(28)

#define CELLKV_WGMMA_RS(N, TYPE, TRANS)                                                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " CELLKV_WGMMA_SCALE##N ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " CELLKV_WGMMA_D##N               \
                   CELLKV_WGMMA_TAIL##N TRANS ";\n}\n"                                                             \
               : CELLKV_WGMMA_OPS##N                                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)))
#define CELLKV_WGMMA_RS_TYPES(N)                                                                                   \
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {                                                                \
    if constexpr (TransB) CELLKV_WGMMA_RS(N, "bf16", "1");                                                         \
    else CELLKV_WGMMA_RS(N, "bf16", "0");                                                                          \
  } else {                                                                                                         \
    if constexpr (TransB) CELLKV_WGMMA_RS(N, "f16", "1");                                                          \
    else CELLKV_WGMMA_RS(N, "f16", "0");                                                                           \
  }

// d (64 x N, this thread's share) = A (64 x 16, registers) x B (16 x N, descriptor b) + (accumulate ?
// d : 0), issued asynchronously: d is undefined until a wgmma_wait covers the group. TransB: B is
// MN-major (v_operand) rather than K-major (k_operand). Only on sm_90a.
template <class T, int N, bool TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const std::uint32_t (&a)[4], std::uint64_t b,
                                         bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or fp16 operands");
  static_assert(N == 64 || N == 128 || N == 256, "N: 64, 128 or 256");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (N == 64) {
    CELLKV_WGMMA_RS_TYPES(64)
  } else if constexpr (N == 128) {
    CELLKV_WGMMA_RS_TYPES(128)
  } else {
    CELLKV_WGMMA_RS_TYPES(256)
  }
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap();  // wgmma exists on sm_90a only; callers dispatch on sm90a_probe
#endif
}

// d (64 x N, this thread's share) = A (64 x 16, descriptor a) x B (16 x N, descriptor b) +
// (accumulate ? d : 0), N = 64 or 128, both K-major (k_operand), issued asynchronously as
// wgmma_rs. Only on sm_90a.
#define CELLKV_WGMMA_SS(N, A, B, SCALE, TYPE)                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " CELLKV_WGMMA_D##N              \
               ", " A ", " B ", p, 1, 1, 0, 0;\n}\n"                                                               \
               : CELLKV_WGMMA_OPS##N                                                                               \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
#define CELLKV_WGMMA_SS64(TYPE) CELLKV_WGMMA_SS(64, "%32", "%33", "%34", TYPE)
#define CELLKV_WGMMA_SS128(TYPE) CELLKV_WGMMA_SS(128, "%64", "%65", "%66", TYPE)
template <class T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], std::uint64_t a, std::uint64_t b, bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or fp16 operands");
  static_assert(N == 64 || N == 128, "N: 64 or 128");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64) {
    if constexpr (kBf16) CELLKV_WGMMA_SS64("bf16");
    else CELLKV_WGMMA_SS64("f16");
  } else {
    if constexpr (kBf16) CELLKV_WGMMA_SS128("bf16");
    else CELLKV_WGMMA_SS128("f16");
  }
#else
  (void)d, (void)a, (void)b, (void)accumulate;
  __trap();
#endif
}

#undef CELLKV_WGMMA_SS128
#undef CELLKV_WGMMA_SS64
#undef CELLKV_WGMMA_SS
#undef CELLKV_WGMMA_RS_TYPES
#undef CELLKV_WGMMA_RS
#undef CELLKV_WGMMA_OPS256
#undef CELLKV_WGMMA_OPS128
#undef CELLKV_WGMMA_OPS64
#undef CELLKV_ACC16
#undef CELLKV_ACC4
#undef CELLKV_WGMMA_D64
#undef CELLKV_WGMMA_D128
#undef CELLKV_WGMMA_D256
#undef CELLKV_WGMMA_TAIL64
#undef CELLKV_WGMMA_TAIL128
#undef CELLKV_WGMMA_TAIL256
#undef CELLKV_WGMMA_SCALE64
#undef CELLKV_WGMMA_SCALE128
#undef CELLKV_WGMMA_SCALE256

// Writes 1 to *out when the code running on this device was built for sm_90a (wgmma), else 0.
// (A template only so that every translation unit may define it.)
template <int = 0>
__global__ void sm90a_probe(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

}  // namespace cellkv::gpu::kernels
