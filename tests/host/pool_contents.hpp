// Test helper shared by the host suite and the state-loader fuzzer: every K and V element of a
// host pool, layer by layer, to compare a pool before and after a call.
#pragma once

#include <cstdint>
#include <vector>

#include "cellkv/host_pool.hpp"

namespace cellkv::test {

template <class T>
std::vector<T> pool_contents(HostPool<T>& pool) {
  std::vector<T> out;
  for (std::int32_t l = 0; l < pool.layers(); ++l) {
    const PoolView<T> v = pool.view(l);
    out.insert(out.end(), v.k, v.k + pool.rows() * pool.row_elems());
    out.insert(out.end(), v.v, v.v + pool.rows() * pool.row_elems());
  }
  return out;
}

}  // namespace cellkv::test
