// cellkv/gpu/launch/dispatch.cuh - the one place runtime values become template instantiations.
//
// Instantiations the dispatch produces (fp32 accumulation throughout):
//   element type T: __nv_bfloat16, __half, float     (the reference and write kernels; the table
//                   kernels serve bf16 / fp16 and their fp8 storage only, table_kernels_support in
//                   launch/table_attention.cuh, and fp32 pools use the reference kernel)
//   head dim D:     64, 128, 256
#pragma once

#include <cstdint>
#include <type_traits>

#include "cellkv/gpu/dtype.hpp"
#include "cellkv/status.hpp"

namespace cellkv::gpu {

template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(std::integral_constant<int, D>{}) for a supported head dim D; refuses the others.
template <class F>
Status dispatch_head_dim(std::int32_t head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: return Errc::unsupported_head_dim;
  }
}

// Calls f(TypeTag<T>{}) for the element type of a runtime dtype.
template <class F>
Status dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16: return f(TypeTag<__nv_bfloat16>{});
    case DType::fp16: return f(TypeTag<__half>{});
    case DType::fp32: return f(TypeTag<float>{});
  }
  return Errc::unsupported_dtype;
}

}  // namespace cellkv::gpu
