// host_plan: host cost of step planning and of every verb, at two capacities, to show that the
// cost follows the work (tokens, rows touched), not the capacity. Not a test: it prints a table.
//
//   build/benchmarks/cellkv-bench-host-plan
#include <cellkv/cellkv.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

using Model = cellkv::Windows<0, 1024>;
using Clock = std::chrono::steady_clock;

// Median of `reps` timings of f(), in microseconds; undo() runs untimed after each.
template <class F, class U>
double median_us(int reps, F&& f, U&& undo) {
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    const auto t1 = Clock::now();
    undo();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::nth_element(us.begin(), us.begin() + reps / 2, us.end());
  return us[static_cast<std::size_t>(reps / 2)];
}

template <class Cache>
void bench(const char* name, const cellkv::CacheConfig& config, std::int32_t fill_per_seq) {
  Cache cache(config);
  constexpr std::int32_t kSeqs = 256;
  std::vector<std::int32_t> decode(kSeqs);
  for (auto& s : decode) s = cache.seq_new().value();
  // Fill: sequences interleave in steps of 256 tokens, as decode does.
  std::vector<std::int32_t> chunk;
  for (std::int32_t round = 0; round < fill_per_seq; ++round) (void)cache.declare_step(decode);
  cache.acknowledge_changes();
  const std::int32_t probe = decode[7];
  const std::int32_t len = cache.pos(probe).value();

  auto nothing = [] {};
  auto undo_decode = [&] {
    for (const std::int32_t s : decode) (void)cache.rewind(s, len);
    cache.acknowledge_changes();
  };
  const std::vector<std::int32_t> prefill(256, probe);
  const double t_decode = median_us(200, [&] { (void)cache.declare_step(decode); }, undo_decode);
  const double t_prefill = median_us(200, [&] { (void)cache.declare_step(prefill); }, [&] {
    (void)cache.rewind(probe, len);
    cache.acknowledge_changes();
  });
  std::int32_t made = -1;
  (void)cache.seq_rm(decode.back());
  const double t_new = median_us(200, [&] { made = cache.seq_new().value(); }, [&] { (void)cache.seq_rm(made); });
  const double t_clone = median_us(50, [&] { made = cache.seq_clone(probe).value(); }, [&] {
    (void)cache.seq_rm(made);
    cache.acknowledge_changes();
  });
  const double t_rm = median_us(50, [&] { (void)cache.seq_rm(made); }, [&] {
    made = cache.seq_clone(probe).value();
    cache.acknowledge_changes();
  });
  (void)cache.seq_rm(made);
  const double t_rewind = median_us(200, [&] { (void)cache.rewind(probe, len - 1); }, [&] {
    const std::int32_t one[] = {probe};
    (void)cache.declare_step(one);
    cache.acknowledge_changes();
  });
  volatile std::int64_t sink = 0;
  const double t_query = median_us(1000, [&] { sink = sink + cache.pos(probe).value() + cache.free_cells() + cache.used_end(); }, nothing);
  const double t_clear = median_us(1, [&] { cache.clear(); }, nothing);
  std::printf("%-34s %9lld %9.2f %9.2f %7.2f %8.2f %8.2f %8.2f %7.3f %9.1f\n", name,
              static_cast<long long>(cache.capacity()), t_decode, t_prefill, t_new, t_clone, t_rm, t_rewind, t_query,
              t_clear);
}

}  // namespace

int main() {
  std::printf("cellkv host planning cost, median microseconds (256 live sequences, ~88%% of cells used)\n");
  std::printf("decode = declare+place 256 tokens of 256 sequences; prefill = 256 tokens of one sequence;\n");
  std::printf("clone/rm act on a sequence of ~900 (or ~56) positions; query = pos + free_cells + used_end\n\n");
  std::printf("%-34s %9s %9s %9s %7s %8s %8s %8s %7s %9s\n", "cache", "cells", "decode", "prefill", "new", "clone",
              "rm", "rewind", "query", "clear");
  using namespace cellkv;
  bench<CellCache<Model>>("cell, lowest_free", {.max_write = 256, .max_cells = 16384}, 56);
  bench<CellCache<Model>>("cell, lowest_free", {.max_write = 256, .max_cells = 262144}, 900);
  bench<CellCache<Model, placement::clustered<64>>>("cell, clustered<64>",
                                                                  {.max_write = 256, .max_cells = 16384}, 56);
  bench<CellCache<Model, placement::clustered<64>>>("cell, clustered<64>",
                                                                  {.max_write = 256, .max_cells = 262144}, 900);
  bench<SequenceCache<Model>>("sequence", {.max_write = 256, .max_seqs = 256, .max_len = 64}, 56);
  bench<SequenceCache<Model>>("sequence", {.max_write = 256, .max_seqs = 256, .max_len = 1024}, 900);
  return 0;
}
