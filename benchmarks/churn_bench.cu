// churn_bench: decode over a cache that has served continuous batching at full occupancy, against
// the same lengths in a fresh cache (bf16, H_q 32, H_kv 8, D 128, one layer).
//
// Churn: a cell pool sized for ~170 sessions; every step, sessions arrive while a prompt fits
// (64-1024 tokens, placed in a step of its own), every live session decodes one token (one step),
// a session leaves at its target length (512-4096), and when the decode step does not fit the
// longest session is preempted (removed). After >= 10,000 steps: one decode step over every live
// session is timed (attention of one layer), then the same lengths in a fresh cache (each
// sequence's positions placed in order, a sequence at a time) are timed the same way.
//
// Printed per placement: occupancy, the share of occupied 64-cell tiles holding cells of more
// than one sequence, both times and effective TB/s, and the ratio fresh time / churned time
// (1.0 = placement does not matter). JSON lines: work decode_after_churn, impl
// cellkv_cell_<placement>, metric = that ratio, unit ratio.
//
//   build/benchmarks/cellkv-bench-churn [--steps N] [--out FILE]
#include <cellkv/cellkv.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.cuh"

namespace {

using namespace cellkv;
using bf16 = __nv_bfloat16;
using Model = Windows<0>;
constexpr std::int32_t kHq = 32, kHkv = 8, kD = 128;
constexpr std::int32_t kCells = 262144, kMaxWrite = 1024;
constexpr std::int32_t kMaxSeqs = 512;

template <class P>
using Cache = gpu::DeviceCache<layout::cell, bf16, Model, P, kMaxSeqs>;

struct Session {
  std::int32_t seq = 0;
  std::int32_t target = 0;  // leaves at this length
};

// Declares a step of `ids`; on out_of_cells preempts the longest session and retries.
template <class C>
void decode_step(C& cache, std::vector<Session>& live) {
  for (;;) {
    std::vector<std::int32_t> ids;
    for (const Session& s : live) ids.push_back(s.seq);
    if (ids.empty()) return;
    const auto plan = cache.declare_step(ids);
    if (plan.ok()) return;
    if (plan.status() != Errc::out_of_cells) throw std::runtime_error("decode step refused");
    const auto longest = std::max_element(live.begin(), live.end(), [&](const Session& a, const Session& b) {
      return cache.host().pos(a.seq).value() < cache.host().pos(b.seq).value();
    });
    if (!cache.seq_rm(longest->seq).ok()) throw std::runtime_error("seq_rm refused");
    live.erase(longest);
  }
}

// Places `len` positions of a new sequence, in steps of up to kMaxWrite tokens.
template <class C>
bool prefill(C& cache, std::int32_t seq, std::int32_t len) {
  for (std::int32_t done = 0; done < len;) {
    const std::int32_t n = std::min(kMaxWrite, len - done);
    if (!cache.declare_step(std::vector<std::int32_t>(static_cast<std::size_t>(n), seq)).ok()) return false;
    done += n;
  }
  return true;
}

template <class C>
void churn(C& cache, std::vector<Session>& live, int steps, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> prompt(64, 1024), target(512, 4096);
  std::int32_t next_prompt = prompt(rng);
  for (int step = 0; step < steps; ++step) {
    while (cache.host().free_cells() >= next_prompt && cache.host().live_count() < kMaxSeqs) {
      const std::int32_t seq = cache.seq_new().value();
      if (!prefill(cache, seq, next_prompt)) throw std::runtime_error("prompt refused");
      live.push_back({seq, std::max(next_prompt + 1, target(rng))});
      next_prompt = prompt(rng);
    }
    decode_step(cache, live);
    for (auto it = live.begin(); it != live.end();) {
      if (cache.host().pos(it->seq).value() >= it->target) {
        (void)cache.seq_rm(it->seq);
        it = live.erase(it);
      } else {
        ++it;
      }
    }
  }
}

// Share of occupied 64-cell tiles whose cells belong to more than one owner set.
template <class Host>
double mixed_tile_share(const Host& host) {
  std::int64_t occupied = 0, mixed = 0;
  for (std::int32_t t = 0; t * 64 < kCells; ++t) {
    std::set<std::int32_t> owners_seen;
    for (std::int32_t c = t * 64; c < std::min(kCells, t * 64 + 64); ++c)
      if (host.cell_pos(c) >= 0) owners_seen.insert(host.cell_owners(c).first());
    occupied += owners_seen.empty() ? 0 : 1;
    mixed += owners_seen.size() > 1 ? 1 : 0;
  }
  return occupied == 0 ? 0.0 : static_cast<double>(mixed) / static_cast<double>(occupied);
}

// Milliseconds of one attention call of a decode step of every live session (the step is declared
// and uploaded here; the pool holds random values).
template <class C>
double time_decode(C& cache, const std::vector<std::int32_t>& seqs, gpu::Stream& stream) {
  if (!cache.declare_step(seqs).ok()) throw std::runtime_error("timed decode step refused");
  const auto T = static_cast<std::int32_t>(seqs.size());
  gpu::DeviceBuffer<bf16> q(static_cast<std::size_t>(T) * kHq * kD), out(q.size()), kv(static_cast<std::size_t>(T) * kHkv * kD);
  bench::randomize(q.data(), q.size(), 1);
  bench::randomize(kv.data(), kv.size(), 2);
  if (!cache.upload(stream).ok()) throw std::runtime_error("upload refused");
  if (!cache.write(0, kv.data(), kv.data(), T, stream).ok()) throw std::runtime_error("write refused");
  return bench::time_ms([&] { (void)cache.attend(0, q.data(), out.data(), T, kHq, 0.f, stream); }, stream.get(), 20, 15);
}

template <class P>
void run(const char* impl, int steps, std::FILE* out) {
  std::mt19937_64 rng(2026);
  Cache<P> churned({.max_write = kMaxWrite, .max_cells = kCells}, {.layers = 1, .heads_kv = kHkv, .head_dim = kD, .heads_q = kHq});
  bench::randomize(churned.pool().storage().data(), churned.pool().storage().size(), 3);
  std::vector<Session> live;
  churn(churned, live, steps, rng);
  std::vector<std::int32_t> seqs, lengths;
  std::int64_t live_positions = 0;
  for (const Session& s : live) {
    seqs.push_back(s.seq);
    lengths.push_back(churned.host().pos(s.seq).value());
    live_positions += lengths.back();
  }
  const double occupancy = 1.0 - static_cast<double>(churned.host().free_cells()) / kCells;
  const double mixed = mixed_tile_share(churned.host());
  gpu::Stream stream;
  const double t_churned = time_decode(churned, seqs, stream);

  Cache<P> fresh({.max_write = kMaxWrite, .max_cells = kCells}, {.layers = 1, .heads_kv = kHkv, .head_dim = kD, .heads_q = kHq});
  bench::randomize(fresh.pool().storage().data(), fresh.pool().storage().size(), 3);
  std::vector<std::int32_t> fresh_seqs;
  for (const std::int32_t len : lengths) {
    fresh_seqs.push_back(fresh.seq_new().value());
    if (!prefill(fresh, fresh_seqs.back(), len)) throw std::runtime_error("fresh fill refused");
  }
  const double t_fresh = time_decode(fresh, fresh_seqs, stream);

  const double bytes = static_cast<double>(live_positions + static_cast<std::int64_t>(seqs.size())) * kHkv * kD * 2 * 2;
  std::fprintf(stderr,
               "  %-26s %d steps, %zu live sessions (%lld positions), occupancy %.2f%%, mixed 64-cell tiles %.1f%%\n"
               "  %-26s churned %.4f ms (%.2f TB/s), fresh %.4f ms (%.2f TB/s), churned speed / fresh speed %.3f\n",
               impl, steps, seqs.size(), static_cast<long long>(live_positions), 100 * occupancy, 100 * mixed, "",
               t_churned, bytes / (t_churned * 1e-3) / 1e12, t_fresh, bytes / (t_fresh * 1e-3) / 1e12, t_fresh / t_churned);
  const std::string shape = std::to_string(seqs.size()) + "_sessions";
  bench::emit(out, "decode_after_churn", shape, impl, t_churned, t_fresh / t_churned, "ratio");
  bench::emit(out, "decode_churned", shape, impl, t_churned, bytes / (t_churned * 1e-3) / 1e12, "TB/s");
  bench::emit(out, "decode_fresh", shape, impl, t_fresh, bytes / (t_fresh * 1e-3) / 1e12, "TB/s");
  std::fprintf(out, "{\"work\": \"churn_state\", \"impl\": \"%s\", \"steps\": %d, \"sessions\": %zu, \"occupancy\": %.4f, "
               "\"mixed_tile_share\": %.4f}\n", impl, steps, seqs.size(), occupancy, mixed);
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 10000;
  std::FILE* out = stdout;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) out = std::fopen(argv[++i], "w");
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || out == nullptr) {
    std::fprintf(stderr, "cellkv-bench-churn: needs a CUDA device (and a writable --out)\n");
    return 1;
  }
  std::fprintf(stderr, "cellkv churn benchmark: bf16, H_q %d, H_kv %d, D %d, %d cells\n", kHq, kHkv, kD, kCells);
  try {
    run<placement::lowest_free>("cellkv_cell_lowest_free", steps, out);
    run<placement::clustered<64>>("cellkv_cell_clustered", steps, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv-bench-churn: %s\n", e.what());
    return 1;
  }
  return 0;
}
