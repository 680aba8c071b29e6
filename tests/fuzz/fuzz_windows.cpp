// libFuzzer harness for window storage: the fuzz input drives the window driver
// (tests/host/window_driver.hpp), a cache with window storage against a twin storing every layer
// in full, until the bytes run out.
//
//   byte 0     cache type (below, modulo 3): window sets {0, 16, 0, 100}, {24, 24}, {1, 0}
//   bytes 1..   sizes: max_write (1..12), max_cells (200..3000), max_seqs (2..8), window_cells
//              (max_write .. min(max_cells, max_seqs x 200))
//   bytes 4..  every operation and its arguments (ByteEntropy: one byte per choice of <= 256)
//
// A disagreement prints the driver's message and traps, so libFuzzer saves the input.
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Itests/host \
//       tests/fuzz/fuzz_windows.cpp -o fuzz_windows && ./fuzz_windows -max_total_time=60
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "cellkv/kv_cache.hpp"
#include "window_driver.hpp"

namespace {

using namespace cellkv;

template <class Cache>
void drive(test::ByteEntropy& bytes) {
  CacheConfig full{.max_write = bytes.range(1, 12), .max_cells = bytes.range(200, 3000), .max_seqs = bytes.range(2, 8)};
  CacheConfig windowed = full;
  windowed.window_cells = std::min(full.max_cells, bytes.range(full.max_write, full.max_seqs * 200));
  test::WindowDriver<Cache> driver(windowed, full);
  for (std::int32_t op = 0; op < 2000 && !bytes.exhausted(); ++op) {
    const std::string m = driver.step(bytes);
    if (!m.empty()) {
      std::fprintf(stderr, "cellkv window fuzz: %s\n", m.c_str());
      std::fflush(stderr);
      __builtin_trap();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  test::ByteEntropy bytes(data, size);
  switch (bytes.next_byte() % 3) {
    case 0: drive<CellCache<Windows<0, 16, 0, 100>, placement::lowest_free, 8>>(bytes); break;
    case 1: drive<CellCache<Windows<24, 24>, placement::clustered<64>, 8>>(bytes); break;
    default: drive<CellCache<Windows<1, 0>, placement::lowest_free, 8>>(bytes); break;
  }
  return 0;
}
