// libFuzzer harness: the fuzz input drives the differential driver (tests/host/op_driver.hpp), the
// cache against the brute-force oracle (tests/host/oracle.hpp), until the bytes run out.
//
//   byte 0     configuration: cache type (low bits), max_seqs (high bits)
//   byte 1     sizes: max_write, max_cells / max_len
//   bytes 2..  every operation and its arguments (ByteEntropy: one byte per choice of <= 256):
//              steps, seq_new / clone / rm / rewind / clear, the sequence edits (seq_rm of a
//              range, seq_cp, seq_keep, seq_add, seq_div, seq_pos_min / max), acknowledgements
//
// A disagreement prints the driver's message and traps, so libFuzzer saves the input.
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Itests/host \
//       tests/fuzz/fuzz_cache.cpp -o fuzz_cache && ./fuzz_cache -max_total_time=60
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "cellkv/cell_cache.hpp"
#include "op_driver.hpp"

namespace {

using namespace cellkv;

template <class Cache>
void drive(const CacheConfig& config, test::ByteEntropy& bytes) {
  test::OpDriver<Cache> driver(config);
  const std::string mismatch = driver.run(bytes, 1 << 16);
  if (!mismatch.empty()) {
    std::fprintf(stderr, "cellkv fuzz: %s\n", mismatch.c_str());
    std::fflush(stderr);
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const std::uint8_t kind = data[0];
  const std::uint8_t sizes = data[1];
  test::ByteEntropy bytes(data + 2, size - 2);

  CacheConfig c;
  c.max_write = 1 + (sizes & 7);                  // 1..8
  c.max_seqs = (kind >> 3) % 9;                   // 0 (= MaxSeqs) or 1..8
  const std::int32_t n = 1 + (sizes >> 3);        // 1..32
  switch (kind % 7) {
    case 0:
      c.max_cells = n;
      drive<CellCache<layout::cell, Windows<0, 3>, placement::lowest_free, 8>>(c, bytes);
      break;
    case 1:
      c.max_cells = 2 * n;
      drive<CellCache<layout::cell, Windows<5, 0, 2>, placement::clustered<4>, 8>>(c, bytes);
      break;
    case 2:
      c.max_cells = 2 * n;
      if (c.max_seqs == 0) c.max_seqs = 8;
      drive<CellCache<layout::cell, Windows<0>, placement::clustered<8>, 256>>(c, bytes);
      break;
    case 3:
      c.max_len = n;
      drive<CellCache<layout::sequence, Windows<0, 3>, placement::lowest_free, 8>>(c, bytes);
      break;
    case 4:
      c.max_len = 1 + n / 4;  // 1..9, with all 70 ids: many slots
      c.max_seqs = 0;
      drive<CellCache<layout::sequence, Windows<5, 0, 2>, placement::lowest_free, 70>>(c, bytes);
      break;
    case 5:
      c.max_cells = 64 + 4 * n;  // 68..192: more than one bitmap word
      c.max_write = 1 + (sizes & 31);
      drive<CellCache<layout::cell, Windows<0, 2>, placement::lowest_free, 70>>(c, bytes);
      break;
    default:
      c.max_cells = 64 + 4 * n;
      c.max_write = 1 + (sizes & 31);
      drive<CellCache<layout::cell, Windows<3, 0>, placement::clustered<4>, 64>>(c, bytes);
      break;
  }
  return 0;
}
