// libFuzzer harness: the fuzz input drives the differential driver (tests/host/op_driver.hpp), the
// cache against the brute-force oracle (tests/host/oracle.hpp), until the bytes run out. After
// every operation the driver checks the whole observable state, the mask rows of a placed step and
// the refusals of every step query (with int32 and int64 extremes), placed or not.
//
//   byte 0     cache type (below, modulo kTypes)
//   byte 1     sizes: max_write, max_cells / max_len
//   byte 2     bit 0: warm-up (the big types fill their cache past 4096 rows first);
//              bits 1..: max_seqs (0 = MaxSeqs, or 1..8)
//   bytes 3..  every operation and its arguments (ByteEntropy: one byte per choice of <= 256):
//              steps, seq_new / clone / rm / rewind / clear, the sequence edits (seq_rm of a
//              range, seq_cp, seq_keep, seq_add, seq_div, seq_pos_min / max, restore_positions),
//              acknowledgements
//
// Type kExtremes draws every CacheConfig field from int32 extremes and edges, checks validate,
// host_bytes and the constructor against the contract's formula, and drives the cache when it is
// valid and small. A disagreement prints a message and traps, so libFuzzer saves the input.
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Itests/host \
//       tests/fuzz/fuzz_cache.cpp -o fuzz_cache && ./fuzz_cache -max_total_time=60 tests/fuzz/corpus
// The seed corpus (tests/fuzz/corpus) is written by tests/fuzz/make_corpus.py.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "op_driver.hpp"

namespace {

using namespace cellkv;

constexpr std::int32_t kTypes = 11;
constexpr std::int32_t kExtremes = 10;
constexpr std::size_t kHostBudget = std::size_t{64} << 20;  // extreme configs built only below this

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "cellkv fuzz: %s\n", what.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

void check(const std::string& mismatch) {
  if (!mismatch.empty()) fail(mismatch);
}

// Warm-up: up to `seqs` new sequences, then decode rounds (every live sequence, max_write tokens
// a step, halved when a step is refused, so the last free rows fill too) until the cache's rows in
// use pass `rows` or a one-token step is refused.
template <class Cache>
void warm_up(test::OpDriver<Cache>& driver, std::int32_t seqs, std::int64_t rows, test::Entropy& bytes) {
  for (std::int32_t i = 0; i < seqs; ++i) check(driver.scripted_seq_new(bytes));
  const std::vector<std::int32_t> live(driver.model().live().begin(), driver.model().live().end());
  if (live.empty()) return;
  auto width = static_cast<std::size_t>(driver.cache().max_write());
  for (std::size_t next = 0; driver.cache().used_end() <= rows;) {
    std::vector<std::int32_t> ids;
    for (std::size_t t = 0; t < width; ++t) ids.push_back(live[(next + t) % live.size()]);
    const std::int64_t before = driver.stats().tokens_placed;
    check(driver.scripted_declare(ids, bytes));
    if (driver.stats().tokens_placed != before) next += width;
    else if (width == 1) return;  // refused: full
    else width /= 2;
  }
}

template <class Cache>
void drive(const CacheConfig& config, test::ByteEntropy& bytes, std::int32_t warm_seqs = 0, std::int64_t warm_rows = 0) {
  test::OpDriver<Cache> driver(config);
  if (warm_seqs > 0) {
    warm_up(driver, warm_seqs, warm_rows, bytes);
    if (driver.cache().used_end() <= 4096) fail("the warm-up left every row below 4096 in use");
  }
  check(driver.run(bytes, 1 << 16));
}

// ---- int32 extremes in the configuration ----

constexpr std::int32_t kMin = std::numeric_limits<std::int32_t>::min();
constexpr std::int32_t kMax = std::numeric_limits<std::int32_t>::max();
constexpr std::array<std::int32_t, 16> kEdges{kMin, -1, 0, 1, 2, 3, 63, 64, 65, 4097,
                                              kMax / 4, kMax / 4 + 1, kMax / 64, kMax - 8, kMax - 1, kMax};

// What validate must answer (docs/design.md: sizes), computed in 64 bits from the formula.
template <class Cache>
Errc expected_verdict(const CacheConfig& c) {
  constexpr bool kCells = std::is_same_v<typename Cache::Layout, layout::cell>;
  if (c.max_write < 1 || c.max_seqs < 0 || c.max_seqs > Cache::kMaxSeqs) return Errc::bad_argument;
  if (std::int64_t{c.max_write} * 4 > kMax) return Errc::size_overflow;
  const std::int64_t seqs = c.max_seqs == 0 ? Cache::kMaxSeqs : c.max_seqs;
  if (kCells) {
    if (c.max_cells < 1) return Errc::bad_argument;
    const std::int64_t pages = (std::int64_t{c.max_cells} + 63) / 64;
    return seqs * pages + (pages + 2 * seqs) * 64 > kMax ? Errc::size_overflow : Errc::ok;
  }
  if (c.max_len < 1) return Errc::bad_argument;
  return seqs * c.max_len + c.max_write > kMax ? Errc::size_overflow : Errc::ok;
}

// A valid cache too large for the oracle's sweeps (sequence slots up to INT32_MAX rows): a full
// step on the highest sequence id gets the rows and positions of the formula, and its queries stay
// in range.
template <class Cache>
void probe_far_rows(Cache& cache, const std::string& config) {
  std::int32_t last = -1;
  while (true) {
    const Result<std::int32_t> id = cache.seq_new();
    if (!id.ok()) break;
    last = id.value();
  }
  if (last != cache.max_seqs() - 1) fail("seq_new did not reach id max_seqs - 1: " + config);
  const std::vector<std::int32_t> ids(static_cast<std::size_t>(cache.max_write()), last);
  const Result<StepPlan> plan = cache.declare_step(ids);
  constexpr bool kCells = std::is_same_v<typename Cache::Layout, layout::cell>;
  if (!plan.ok()) {
    const Errc room = kCells ? Errc::out_of_cells : Errc::sequence_full;
    if (plan.status() != room) fail("a full step on the last sequence: " + std::string(plan.status().message()) + ": " + config);
    return;
  }
  for (std::int32_t t = 0; t < plan.value().tokens; ++t) {
    const auto i = static_cast<std::size_t>(t);
    if (plan.value().positions[i] != t) fail("far position: " + config);
    if (plan.value().rows[i] < 0 || plan.value().rows[i] >= cache.capacity()) fail("far row out of range: " + config);
    if (cache.visible(t, plan.value().rows[i], kMax).value_or(false) != true) fail("far row not visible to itself: " + config);
    if constexpr (!kCells) {
      const RowRange r = cache.visible_range(t, kMax).value();
      if (r.begin != cache.slot_begin(last) || r.end != cache.slot_begin(last) + t + 1) fail("far visible_range: " + config);
    }
  }
}

template <class Cache>
void drive_extreme(const CacheConfig& c, test::ByteEntropy& bytes) {
  const Errc want = expected_verdict<Cache>(c);
  const Status got = Cache::validate(c);
  const std::string config = "max_write=" + std::to_string(c.max_write) + " max_cells=" + std::to_string(c.max_cells) +
                             " max_seqs=" + std::to_string(c.max_seqs) + " max_len=" + std::to_string(c.max_len);
  if (got != want) fail("validate(" + config + "): expected " + std::string(describe(want)) + ", got " + std::string(got.message()));
  const Result<std::size_t> host = Cache::host_bytes(c);
  if (host.status() != got) fail("host_bytes(" + config + ") status differs from validate");
  if (!got.ok()) {
    try {
      Cache cache(c);
      fail("constructor accepted a refused config: " + config);
    } catch (const std::invalid_argument&) {
    }
    return;
  }
  const Status fits = Cache::fits_within(c, kHostBudget);
  if (fits.ok() != (host.value() <= kHostBudget) || (!fits.ok() && fits != Errc::out_of_memory))
    fail("fits_within(" + config + ") disagrees with host_bytes");
  if (!fits.ok()) return;
  Cache probe(c);
  if (probe.capacity() <= (1 << 16)) return drive<Cache>(c, bytes);  // the oracle sweeps every row
  probe_far_rows(probe, config);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 4) return 0;
  const std::int32_t type = data[0] % kTypes;
  const std::uint8_t sizes = data[1];
  const bool warm = (data[2] & 1) != 0;
  test::ByteEntropy bytes(data + 3, size - 3);

  CacheConfig c;
  c.max_write = 1 + (sizes & 7);                  // 1..8
  c.max_seqs = (data[2] >> 1) % 9;                // 0 (= MaxSeqs) or 1..8
  const std::int32_t n = 1 + (sizes >> 3);        // 1..32
  switch (type) {
    case 0:
      c.max_cells = n;
      drive<CellCache<Windows<0, 3>, placement::lowest_free, 8>>(c, bytes);
      break;
    case 1:
      c.max_cells = 2 * n;
      drive<CellCache<Windows<5, 0, 2>, placement::clustered<4>, 8>>(c, bytes);
      break;
    case 2:
      c.max_cells = 2 * n;
      if (c.max_seqs == 0) c.max_seqs = 8;
      drive<CellCache<Windows<0>, placement::clustered<8>, 256>>(c, bytes);
      break;
    case 3:
      c.max_len = n;
      drive<SequenceCache<Windows<0, 3>, 8>>(c, bytes);
      break;
    case 4:
      c.max_len = 1 + n / 4;  // 1..9, with all 70 ids: many slots
      c.max_seqs = 0;
      drive<SequenceCache<Windows<5, 0, 2>, 70>>(c, bytes);
      break;
    case 5:
      c.max_cells = 64 + 4 * n;  // 68..192: more than one bitmap word
      c.max_write = 1 + (sizes & 31);
      drive<CellCache<Windows<0, 2>, placement::lowest_free, 70>>(c, bytes);
      break;
    case 6:
      c.max_cells = 64 + 4 * n;
      c.max_write = 1 + (sizes & 31);
      drive<CellCache<Windows<3, 0>, placement::clustered<4>, 64>>(c, bytes);
      break;
    case 7:  // past 4096 cells (the bitmap's second summary word), lowest free: filled by warm-up
      c.max_cells = 4096 + 32 * n;  // 4128..5120
      c.max_write = 64 * (1 + (sizes & 3));
      c.max_seqs = 0;
      drive<CellCache<Windows<0, 7>, placement::lowest_free, 40>>(c, bytes, warm ? 40 : 0, 4200);
      break;
    case 8:  // clustered<64>: each new sequence opens its own block, so 70 sequences reach row 4416
      c.max_cells = 64 * 72 + n;
      c.max_write = 72;
      c.max_seqs = 0;
      drive<CellCache<Windows<0, 5>, placement::clustered<64>, 72>>(c, bytes, warm ? 70 : 0, 4100);
      break;
    case 9:  // sequence slots past row 4096
      c.max_len = 600 + 16 * n;  // 616..1112: slot 7 starts past 4096
      c.max_seqs = 0;
      drive<SequenceCache<Windows<0, 9>, 8>>(c, bytes, warm ? 8 : 0, 4100);
      break;
    default: {  // kExtremes: every size from the int32 edges
      const auto edge = [&] { return kEdges[bytes.below(kEdges.size())]; };
      c.max_write = edge();
      c.max_seqs = edge();
      if ((sizes & 1) == 0) {
        c.max_cells = edge();
        drive_extreme<CellCache<Windows<0, 3>, placement::lowest_free, 8>>(c, bytes);
      } else {
        c.max_len = edge();
        drive_extreme<SequenceCache<Windows<0, 3>, 8>>(c, bytes);
      }
      break;
    }
  }
  static_assert(kExtremes == kTypes - 1);
  return 0;
}
