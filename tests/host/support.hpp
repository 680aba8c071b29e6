// Helpers shared by the host tests: read a placed step and its mask rows as plain vectors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include <doctest/doctest.h>

#include <string>

#include "cellkv/kv_cache.hpp"

// Failed checks print a Status by its name.
template <>
struct doctest::StringMaker<cellkv::Status> {
  static doctest::String convert(cellkv::Status s) { return std::string(s.message()).c_str(); }
};
template <>
struct doctest::StringMaker<cellkv::Errc> {
  static doctest::String convert(cellkv::Errc e) { return std::string(cellkv::describe(e)).c_str(); }
};

namespace cellkv::test {

// Rows whose mask bit is set for token t through `window`, ascending.
template <class Cache>
std::vector<std::int64_t> visible_rows(const Cache& cache, std::int32_t window, std::int32_t t) {
  std::vector<std::uint8_t> row(static_cast<std::size_t>(cache.step().read_len));
  REQUIRE(cache.mask_row(window, t, row).ok());
  std::vector<std::int64_t> out;
  for (std::size_t c = 0; c < row.size(); ++c)
    if (row[c]) out.push_back(static_cast<std::int64_t>(c));
  return out;
}

template <class Cache>
std::vector<std::int64_t> step_rows(const Cache& cache) {
  const auto plan = cache.step();
  return {plan.rows.begin(), plan.rows.end()};
}

template <class Cache>
std::vector<std::int32_t> step_positions(const Cache& cache) {
  const auto plan = cache.step();
  return {plan.positions.begin(), plan.positions.end()};
}

// Declares a step and returns its status (tests check rows and masks through the cache).
template <class Cache>
Status declare(Cache& cache, std::initializer_list<std::int32_t> seqs) {
  const std::vector<std::int32_t> ids(seqs);
  return cache.declare_step(ids).status();
}

// Columns [first, first + count) of every row of a row-major matrix with n_cols columns: a shard's
// slice of a [tokens, heads * D] activation or of a pool's rows (an oracle independent of the
// example's weight split).
template <class T>
std::vector<T> columns(const std::vector<T>& m, std::int64_t n_cols, std::int64_t first, std::int64_t count) {
  std::vector<T> out;
  for (std::size_t r = 0; r < m.size() / static_cast<std::size_t>(n_cols); ++r) {
    const auto row = m.begin() + static_cast<std::ptrdiff_t>(r) * n_cols;
    out.insert(out.end(), row + first, row + first + count);
  }
  return out;
}

using Rows = std::vector<std::int64_t>;
using Positions = std::vector<std::int32_t>;

}  // namespace cellkv::test
