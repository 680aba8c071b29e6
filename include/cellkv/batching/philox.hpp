// cellkv/batching/philox.hpp - Philox4x32-10, the counter-based generator of the samplers: a pure
// function of (counter, key), the same 128 bits on the host and in a kernel.
//
//   const cellkv::batching::Philox4 r = cellkv::batching::philox4x32_10({n, 0, 0, 0}, {seed_lo, seed_hi});
//
// Ten rounds of the Philox-4x32 bijection (multipliers 0xD2511F53 and 0xCD9E8D57, key increments
// 0x9E3779B9 and 0xBB67AE85 between rounds); output word 0 is r.x[0]. Integer arithmetic only, so
// host and device agree bit for bit.
#pragma once

#include <cstdint>

#include "cellkv/host_device.hpp"

namespace cellkv::batching {

struct Philox4 {
  std::uint32_t x[4];
};

struct PhiloxKey {
  std::uint32_t k[2];
};

namespace detail {

CELLKV_HOST_DEVICE constexpr void philox_round(std::uint32_t (&c)[4], const std::uint32_t (&k)[2]) {
  const std::uint64_t p0 = static_cast<std::uint64_t>(0xD2511F53u) * c[0];
  const std::uint64_t p1 = static_cast<std::uint64_t>(0xCD9E8D57u) * c[2];
  const auto hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
  const auto hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
  const std::uint32_t c1 = c[1], c3 = c[3];
  c[0] = hi1 ^ c1 ^ k[0];
  c[1] = lo1;
  c[2] = hi0 ^ c3 ^ k[1];
  c[3] = lo0;
}

}  // namespace detail

// Philox4x32 with 10 rounds of `counter` under `key`.
CELLKV_HOST_DEVICE constexpr Philox4 philox4x32_10(Philox4 counter, PhiloxKey key) {
  std::uint32_t c[4] = {counter.x[0], counter.x[1], counter.x[2], counter.x[3]};
  std::uint32_t k[2] = {key.k[0], key.k[1]};
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
    detail::philox_round(c, k);
  }
  return {{c[0], c[1], c[2], c[3]}};
}

// The 32-bit draw number `counter` of the stream `seed`: word 0 of Philox4x32-10 with counter
// {counter, 0, 0, 0} and key {low, high word of seed}.
CELLKV_HOST_DEVICE constexpr std::uint32_t philox_draw(std::uint64_t seed, std::uint32_t counter) {
  return philox4x32_10({{counter, 0u, 0u, 0u}},
                       {{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)}})
      .x[0];
}

}  // namespace cellkv::batching
