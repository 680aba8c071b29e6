// host_bytes(config) bounds what a cache holds on the host (docs/design.md section 4), checked
// against the allocator itself: this program replaces the global operator new and delete and
// counts the bytes live while a cache exists, exercises the cache until its lists are at their
// longest, and after construction and after every verb what the cache holds must stay within
// host_bytes (a verb's own working memory, freed when it returns, is not held). A program of its
// own: the replacement would count every other test's allocations too.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "cellkv/kv_cache.hpp"
#include "cellkv/placement/clustered.hpp"

namespace {

// Bytes the program allocated and has not freed while `counting`.
std::size_t g_live = 0;
bool g_counting = false;
constexpr std::size_t kHeader = 16;  // the size of each block, before it (keeps 16-byte alignment)

// The block before a pointer operator new handed out (through an integer: the compiler's bounds
// analysis would read p - kHeader as outside the object p points to).
void* block_of(void* p) { return reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(p) - kHeader); }

}  // namespace

void* operator new(std::size_t n) {
  void* block = std::malloc(n + kHeader);
  if (block == nullptr) throw std::bad_alloc();
  std::memcpy(block, &n, sizeof n);
  if (g_counting) g_live += n;
  return static_cast<char*>(block) + kHeader;
}
void operator delete(void* p) noexcept {
  if (p == nullptr) return;
  void* block = block_of(p);
  std::size_t n = 0;
  std::memcpy(&n, block, sizeof n);
  if (g_counting) g_live -= n;
  std::free(block);
}
void operator delete(void* p, std::size_t) noexcept { operator delete(p); }

namespace {

using namespace cellkv;

// The most a cache of `config` holds (its object included) once built and after each verb of
// `exercise(cache, held)` (which calls held() after each), against host_bytes(config).
template <class Cache, class Exercise>
void stays_within_host_bytes(const CacheConfig& config, Exercise exercise) {
  const std::size_t bound = Cache::host_bytes(config).value();
  std::size_t most = 0;
  auto held = [&] { most = std::max(most, g_live); };
  g_live = 0;
  g_counting = true;
  auto cache = std::make_unique<Cache>(config);
  held();
  exercise(*cache, held);
  cache.reset();
  g_counting = false;
  INFO("held at most ", most, " bytes, host_bytes ", bound);
  CHECK(most <= bound);
  CHECK(most > 0);
}

// Steps of `width` tokens over every sequence until the cells run out (the position table's
// changed list grows to its longest).
template <class Cache, class Held>
void fill_with_steps(Cache& cache, Held& held, std::int32_t seqs, std::int32_t width) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(width));
  for (std::int32_t i = 0; i < width; ++i) ids[static_cast<std::size_t>(i)] = i % seqs;
  for (std::int32_t s = 0; s < seqs; ++s) REQUIRE(cache.seq_new().ok());
  while (cache.free_cells() >= width && cache.declare_step(ids).ok()) held();
}

}  // namespace

TEST_CASE("host_bytes bounds a cache with window storage and many sequence slots (each window pool's object)") {
  using Cache = CellCache<Windows<0, 8, 16, 32, 64>, placement::clustered<64>, 65536>;
  stays_within_host_bytes<Cache>({.max_write = 1, .max_cells = 64, .max_seqs = 1, .window_cells = 1},
                                 [](Cache&, auto&) {});
  stays_within_host_bytes<Cache>({.max_write = 4, .max_cells = 256, .max_seqs = 8, .window_cells = 64},
                                 [](Cache& c, auto& held) { fill_with_steps(c, held, 8, 4); });
}

TEST_CASE("host_bytes bounds a cache whose whole position table is listed as changed") {
  using Cache = CellCache<Windows<0>, placement::lowest_free, 8>;
  for (const std::int32_t cells : {100, 1000, 5000})
    stays_within_host_bytes<Cache>({.max_write = 64, .max_cells = cells, .max_seqs = 8},
                                   [](Cache& c, auto& held) { fill_with_steps(c, held, 8, 64); });
}

TEST_CASE("host_bytes bounds a cache with a K re-rotation pending for every cell, and a copy of it") {
  using Cache = CellCache<Windows<0>, placement::lowest_free, 4>;
  for (const std::int32_t cells : {64, 1000}) {
    CAPTURE(cells);
    const CacheConfig config{.max_write = 8, .max_cells = cells, .max_seqs = 4};
    // Every cell moves, one rotation each; the copy starts with capacities as its sizes and grows.
    auto move_every_cell = [&](Cache& c, auto& held, std::int32_t first_seq) {
      for (std::int32_t s = first_seq; s < 4; ++s) {
        REQUIRE(c.seq_add(s, 0, -1, 3).ok());
        held();
      }
      CHECK(static_cast<std::int64_t>(c.pending_changes().rotations.size()) == cells - c.free_cells());
    };
    stays_within_host_bytes<Cache>(config, [&](Cache& c, auto& held) {
      fill_with_steps(c, held, 4, 8);
      move_every_cell(c, held, 0);
    });
    stays_within_host_bytes<Cache>(config, [&](Cache& c, auto& held) {
      fill_with_steps(c, held, 4, 8);
      REQUIRE(c.seq_add(0, 0, -1, 3).ok());
      c = Cache(c);  // the copy's vectors hold their sizes, not the original's capacities
      held();
      move_every_cell(c, held, 1);
    });
  }
}
