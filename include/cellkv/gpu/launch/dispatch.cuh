// cellkv/gpu/launch/dispatch.cuh - the one place runtime values become template instantiations.
//
// Supported instantiations (every kernel is built for each):
//   element type T: __nv_bfloat16, __half, float     (fp32 accumulation throughout)
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
