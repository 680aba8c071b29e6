// cellkv/detail/bounded_push.hpp - push_back onto a vector whose size never passes a known bound,
// its capacity grown by doubling but never past that bound, so that what a cache reports it holds
// at most (host_bytes: the bound's elements) also bounds what the vector allocates.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace cellkv::detail {

// v.push_back(value) where v.size() < bound (past it, the vector grows as usual).
template <class T>
void push_within(std::vector<T>& v, T value, std::size_t bound) {
  if (v.size() == v.capacity() && v.size() < bound) v.reserve(std::min(bound, std::max<std::size_t>(8, 2 * v.size())));
  v.push_back(std::move(value));
}

}  // namespace cellkv::detail
