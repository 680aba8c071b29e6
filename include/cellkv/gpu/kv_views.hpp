// cellkv/gpu/kv_views.hpp - the views of one layer's pool for each storage a cache's element
// parameter S names (dtype.hpp): PoolView<T> for an Element T, Fp8PoolView (codes and scales) for
// Fp8<In>; the read-only views kernels take, and the storage's KvStorage (footprint.hpp).
#pragma once

#include <type_traits>

#include "cellkv/footprint.hpp"
#include "cellkv/fp8_pool_view.hpp"
#include "cellkv/gpu/dtype.hpp"
#include "cellkv/pool_view.hpp"

namespace cellkv::gpu {

namespace detail {
template <class Stored>
struct Views {
  using Write = PoolView<Stored>;
  using Read = PoolView<const Stored>;
};
template <>
struct Views<Fp8E4M3> {
  using Write = Fp8PoolView<Fp8E4M3>;
  using Read = Fp8PoolView<const Fp8E4M3>;
};
}  // namespace detail

// The view of a layer's pool whose elements are Stored (StoredOf<S>): writable, and read-only.
template <class Stored>
using WriteView = typename detail::Views<Stored>::Write;
template <class Stored>
using ReadView = typename detail::Views<Stored>::Read;

// The read-only view of a writable one.
template <class T>
constexpr PoolView<const T> read_only(const PoolView<T>& p) noexcept {
  return {p.k, p.v, p.rows, p.heads_kv, p.head_dim};
}
constexpr Fp8PoolView<const Fp8E4M3> read_only(const Fp8PoolView<Fp8E4M3>& p) noexcept { return p.read_only(); }

// What a cache of element parameter S stores.
template <KvElement S>
constexpr KvStorage kv_storage_of() noexcept {
  if constexpr (kFp8Kv<S>) return KvStorage::fp8_e4m3;
  else if constexpr (std::is_same_v<S, __nv_bfloat16>) return KvStorage::bf16;
  else if constexpr (std::is_same_v<S, __half>) return KvStorage::fp16;
  else return KvStorage::fp32;
}

}  // namespace cellkv::gpu
