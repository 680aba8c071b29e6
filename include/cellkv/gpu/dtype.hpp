// cellkv/gpu/dtype.hpp - the element types cellkv stores: bf16, fp16 (fp32 accumulation) and fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <concepts>
#include <cstdint>
#include <string_view>

namespace cellkv::gpu {

enum class DType : std::uint8_t { bf16, fp16, fp32 };

template <class T>
concept Element = std::same_as<T, __nv_bfloat16> || std::same_as<T, __half> || std::same_as<T, float>;

template <Element T>
inline constexpr DType kDTypeOf = std::same_as<T, __nv_bfloat16> ? DType::bf16
                                  : std::same_as<T, __half>      ? DType::fp16
                                                                 : DType::fp32;

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
