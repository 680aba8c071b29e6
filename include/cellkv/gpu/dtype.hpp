// cellkv/gpu/dtype.hpp - the element types cellkv stores: bf16, fp16 (fp32 accumulation) and fp32,
// and Fp8<In>: K and V stored as fp8 E4M3 codes with an fp32 scale per row-head (fp8.hpp), while
// queries, new K/V rows and outputs stay In (bf16 or fp16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <concepts>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "cellkv/fp8.hpp"

namespace cellkv::gpu {

enum class DType : std::uint8_t { bf16, fp16, fp32 };

template <class T>
concept Element = std::same_as<T, __nv_bfloat16> || std::same_as<T, __half> || std::same_as<T, float>;

template <Element T>
inline constexpr DType kDTypeOf = std::same_as<T, __nv_bfloat16> ? DType::bf16
                                  : std::same_as<T, __half>      ? DType::fp16
                                                                 : DType::fp32;

// The KV storage of a cache whose queries, K/V inputs and outputs are In: E4M3 codes and an fp32
// scale per row-head, quantized by write (docs/design.md section 5, "fp8 KV cache").
template <class In>
  requires std::same_as<In, __nv_bfloat16> || std::same_as<In, __half>
struct Fp8 {};

// What a cache's element parameter S means: In (the type of q, k, v and out) and Stored (the
// type of the pool's elements: In itself, or Fp8E4M3 codes for Fp8<In>).
template <class S>
struct KvTraits {
  using In = S;
  using Stored = S;
  static constexpr bool kFp8 = false;
};
template <class I>
struct KvTraits<Fp8<I>> {
  using In = I;
  using Stored = Fp8E4M3;
  static constexpr bool kFp8 = true;
};
template <class S>
using InputOf = typename KvTraits<S>::In;
template <class S>
using StoredOf = typename KvTraits<S>::Stored;
template <class S>
inline constexpr bool kFp8Kv = KvTraits<S>::kFp8;

// A cache's element parameter: an Element (stored as itself) or Fp8<bf16 | fp16>.
template <class S>
concept KvElement = Element<S> || (kFp8Kv<S> && Element<InputOf<S>>);

constexpr std::string_view name_of(DType d) noexcept {
  switch (d) {
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
    case DType::fp32: return "fp32";
  }
  return "?";
}

constexpr std::int32_t size_of(DType d) noexcept { return d == DType::fp32 ? 4 : 2; }

}  // namespace cellkv::gpu
