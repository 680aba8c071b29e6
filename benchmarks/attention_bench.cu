// attention_bench: cellkv's attention on the reference shapes (bf16, H_q 32, H_kv 8, D 128
// unless a shape says otherwise), one layer, timed with CUDA events: warm-up, then the median over
// samples of many back-to-back calls. Prints JSON lines (benchmarks/report.py merges them with
// peers.py's) and a table on stderr. Not a test.
//
//   decode  N x L: N sequences holding L cells each, one new token per sequence; effective TB/s =
//           live K+V bytes (N L H_kv D 2 bytes x 2) / time of one attention call (write excluded);
//           for the fp8 cache (impls cellkv_cell_fp8, cellkv_sequence_fp8) the same bf16 bytes:
//           bf16-equivalent TB/s
//   prefill N x L: one step of N sequences x L tokens, causal; useful TFLOP/s = 4 N L(L+1)/2 H_q D / time
//           (shapes 1x8k_d64 and 1x8k_d256: the same at head dim 64 / 256, clustered<64> only)
//   decode_forks N x 4k_shared: one 4,096-token prompt and N - 1 forks, one new token each; logical
//           TB/s = N x 4,097 rows of K+V / time (with and without prefix sharing)
//   mixed 128x2k+2x1k: one continuous-batching step of 128 decode tokens (128 sequences holding
//           2,048 cells each, one new token each) and 2 prompt chunks of 1,024 tokens (two fresh
//           sequences, positions 0..1023), clustered<64>; ms of the mixed step (cellkv_mixed), of
//           its 128 decode tokens alone (cellkv_decode_part) and of its two chunks alone
//           (cellkv_prefill_part), each on the same cache contents, and mixed / (decode + prefill)
//           (cellkv_mixed_over_parts, unit x)
//   overhead: declare + upload (step block, each window's work, position-table writes) of 256 decode tokens
//           over 256k cells, wall time from declare to the stream being idle
//
// Placement of the decode caches: tokens are placed as decode places them, round-robin over the
// sequences (one token of each per step), so lowest_free interleaves every tile and clustered<64>
// keeps each sequence in aligned blocks of its own. The table kernels read both at the same speed
// (cellkv-bench-churn measures a cache after long serving churn).
//
//   build/benchmarks/cellkv-bench-attention [--quick] [--out FILE] [--only WORK | --only WORK:SHAPE]
//                                           [--decode-shapes NxL,NxL,..]
//   (e.g. --only decode, --only decode:16x4k, --only prefill:1x8k_d64, --only mixed; --decode-shapes
//   256x128,256x512,16x1k: decode at these shapes instead of the four reference ones, L in tokens
//   or with a k suffix, e.g. to fit time = fixed cost + bytes / rate over a series of lengths)
#include <cellkv/cellkv.hpp>
#include <cellkv/gpu/device_cache.cuh>
#include <cellkv/gpu/stream.hpp>

#include "bench_util.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace cellkv;
using bench::randomize;
using bench::shape_name;
using bench::time_ms;
using bf16 = __nv_bfloat16;
using Model = Windows<0>;
constexpr std::int32_t kHq = 32, kHkv = 8, kD = 128;

struct Options {
  bool quick = false;
  std::FILE* out = stdout;
  std::string only;  // "decode" or "decode:16x4k": just that work or measurement; empty: all
  std::vector<std::pair<std::int32_t, std::int32_t>> decode_shapes;  // empty: the reference shapes

  [[nodiscard]] bool wants(const char* work, const std::string& shape) const {
    return only.empty() || only == work || only == std::string(work) + ":" + shape;
  }
};

// Declares `step` (each of its sequences grows by its tokens there; nothing is committed or
// rewound), uploads it, writes random K/V for its tokens, then times one attention layer over it
// with random queries (q [T, H_q, D], D the cache's head dim): the attend calls alone.
template <class Cache>
double time_step(Cache& cache, const std::vector<std::int32_t>& step, gpu::Stream& stream, int reps, int samples) {
  if (!cache.declare_step(step).ok()) throw std::runtime_error("declare_step refused");
  const auto T = static_cast<std::int32_t>(step.size());
  const std::int32_t d = cache.pool().shape().head_dim;
  gpu::DeviceBuffer<bf16> q(static_cast<std::size_t>(T) * kHq * d), out(q.size()),
      kv(static_cast<std::size_t>(T) * kHkv * d);
  randomize(q.data(), q.size(), 1);
  randomize(kv.data(), kv.size(), 2);
  if (!cache.upload(stream).ok()) throw std::runtime_error("upload refused");
  if (!cache.write(0, kv.data(), kv.data(), T, stream).ok()) throw std::runtime_error("write refused");
  // A refused or failed launch ends the benchmark: a kernel that did not run would time as fast.
  return time_ms([&] {
    if (const Status s = cache.attend(0, q.data(), out.data(), T, kHq, 0.f, stream); !s.ok())
      throw std::runtime_error("attend failed: " + std::string(s.message()));
  }, stream.get(), reps, samples);
}

// A one-layer cache of the benchmark's shape (head dim `head_dim`) whose pool holds random values.
template <class Cache>
struct BenchCache {
  Cache cache;
  BenchCache(std::int32_t max_write, std::int32_t max_cells, std::int32_t seqs, std::int32_t max_len,
             std::int32_t head_dim = kD)
      : cache({.max_write = max_write, .max_cells = max_cells, .max_seqs = seqs, .max_len = max_len},
              {.layers = 1, .heads_kv = kHkv, .head_dim = head_dim, .heads_q = kHq}) {
    const auto storage = cache.pool().storage();
    randomize(storage.data(), storage.size(), 3);
    if constexpr (gpu::kFp8Kv<typename Cache::Storage>) {
      const auto scales = cache.pool().scale_storage();
      bench::fill_scales(scales.data(), scales.size(), 0.5f);  // values below 1, as the bf16 pools hold
    }
  }
};

// Decode: N sequences filled round-robin with L tokens, then one step of one token each.
template <class Cache>
void bench_decode(const Options& o, const char* impl, std::int32_t n, std::int32_t len, bool reference = false) {
  if (!o.wants("decode", shape_name(n, len))) return;
  BenchCache<Cache> bench(std::max(n, 1), n * (len + 128), n, len + 64);
  Cache& cache = bench.cache;
  if (reference) cache.use_kernels(gpu::KernelChoice::reference);
  std::vector<std::int32_t> ids;
  for (std::int32_t s = 0; s < n; ++s) ids.push_back(cache.seq_new().value());
  for (std::int32_t t = 0; t < len; ++t)
    if (!cache.declare_step(ids).ok()) throw std::runtime_error("fill refused");
  gpu::Stream stream;
  const double ms = time_step(cache, ids, stream, reference ? 1 : 20, reference ? 3 : (o.quick ? 5 : 15));
  const double bytes = static_cast<double>(n) * len * kHkv * kD * 2 * 2;
  bench::emit(o.out, "decode", shape_name(n, len), impl, ms, bytes / (ms * 1e-3) / 1e12, "TB/s");
}

// Prefill: one step holding every token of N sequences of L tokens (sequence by sequence), head
// dim d; a head dim other than kD names the shape "NxL_dD" (1x8k_d64).
template <class Cache>
void bench_prefill(const Options& o, const char* impl, std::int32_t n, std::int32_t len, std::int32_t d = kD) {
  const std::string shape = shape_name(n, len) + (d == kD ? "" : "_d" + std::to_string(d));
  if (!o.wants("prefill", shape)) return;
  BenchCache<Cache> bench(n * len, n * len + 64, n, len + 64, d);
  Cache& cache = bench.cache;
  std::vector<std::int32_t> step;
  for (std::int32_t s = 0; s < n; ++s) {
    const std::int32_t id = cache.seq_new().value();
    step.insert(step.end(), static_cast<std::size_t>(len), id);
  }
  gpu::Stream stream;
  const double ms = time_step(cache, step, stream, 5, o.quick ? 3 : 10);
  const double flops = 4.0 * n * (static_cast<double>(len) * (len + 1) / 2) * kHq * d;
  bench::emit(o.out, "prefill", shape, impl, ms, flops / (ms * 1e-3) / 1e12, "TFLOP/s");
}

// The same with the mma.sync prefill kernel (the one kept for GPUs without wgmma), which
// CELLKV_PREFILL_KERNEL=mma selects for caches made while it is set.
template <class Cache>
void bench_prefill_mma(const Options& o, const char* impl, std::int32_t n, std::int32_t len) {
  setenv("CELLKV_PREFILL_KERNEL", "mma", 1);
  bench_prefill<Cache>(o, impl, n, len);
  unsetenv("CELLKV_PREFILL_KERNEL");
}

// Forks: one 4,096-token prompt and n - 1 forks of it (n sequences holding the same 4,096 cells),
// one new token each. Logical TB/s = n x 4,097 rows of K+V / time (what each fork sees); with
// prefix sharing the shared rows are read once for all forks.
template <class Cache>
void bench_forks(const Options& o, const char* impl, std::int32_t n, bool share) {
  const std::string shape = shape_name(n, 4096) + "_shared";
  if (!o.wants("decode_forks", shape)) return;
  BenchCache<Cache> bench(512, 4096 + 64 * n + 1024, n, 0);
  Cache& cache = bench.cache;
  cache.share_prefixes(share);
  const std::int32_t root = cache.seq_new().value();
  for (int chunk = 0; chunk < 8; ++chunk)
    if (!cache.declare_step(std::vector<std::int32_t>(512, root)).ok()) throw std::runtime_error("prompt refused");
  std::vector<std::int32_t> ids{root};
  for (std::int32_t f = 1; f < n; ++f) ids.push_back(cache.seq_clone(root, 4096).value());
  gpu::Stream stream;
  const double ms = time_step(cache, ids, stream, 20, o.quick ? 5 : 15);
  const double bytes = static_cast<double>(n) * 4097 * kHkv * kD * 2 * 2;
  bench::emit(o.out, "decode_forks", shape, impl, ms, bytes / (ms * 1e-3) / 1e12, "TB/s");
}

// Mixed step (continuous batching): `decodes` sequences holding `context` cells each (filled
// round-robin, as bench_decode fills them) and `chunks` fresh sequences. Three steps are timed on
// the same cache contents, each followed (untimed) by rewinding every sequence to where it was, so
// at each timed call the decode sequences hold `context` cells and the chunk sequences none:
//   mixed         one token of each decode sequence, then `chunk` tokens of each fresh sequence
//                 (positions 0..chunk-1, causal), in one step
//   decode part   the decode tokens alone
//   prefill part  the chunks alone
// Emits the three times (ms) and mixed / (decode part + prefill part) (unit x; ms: the mixed step's).
void bench_mixed(const Options& o, std::int32_t decodes, std::int32_t context, std::int32_t chunks,
                 std::int32_t chunk) {
  const std::string shape = shape_name(decodes, context) + "+" + shape_name(chunks, chunk);
  if (!o.wants("mixed", shape)) return;
  using Cache = gpu::DeviceCache<layout::cell, bf16, Model, placement::clustered<64>>;
  BenchCache<Cache> bench(decodes + chunks * chunk, decodes * (context + 128) + chunks * (chunk + 128),
                          decodes + chunks, context + chunk);
  Cache& cache = bench.cache;
  std::vector<std::int32_t> decode_ids, chunk_ids;
  for (std::int32_t s = 0; s < decodes; ++s) decode_ids.push_back(cache.seq_new().value());
  for (std::int32_t s = 0; s < chunks; ++s) chunk_ids.push_back(cache.seq_new().value());
  for (std::int32_t t = 0; t < context; ++t)
    if (!cache.declare_step(decode_ids).ok()) throw std::runtime_error("fill refused");
  std::vector<std::int32_t> prefill_step;
  for (const std::int32_t id : chunk_ids) prefill_step.insert(prefill_step.end(), static_cast<std::size_t>(chunk), id);
  std::vector<std::int32_t> mixed_step = decode_ids;
  mixed_step.insert(mixed_step.end(), prefill_step.begin(), prefill_step.end());

  gpu::Stream stream;
  const int reps = 10, samples = o.quick ? 5 : 15;
  // Times `step`, then puts every sequence back: decode sequences at `context`, chunks empty.
  auto timed = [&](const std::vector<std::int32_t>& step) {
    const double ms = time_step(cache, step, stream, reps, samples);
    stream.synchronize();
    for (const std::int32_t id : decode_ids)
      if (!cache.rewind(id, context).ok()) throw std::runtime_error("rewind refused");
    for (const std::int32_t id : chunk_ids)
      if (!cache.rewind(id, 0).ok()) throw std::runtime_error("rewind refused");
    return ms;
  };
  const double mixed = timed(mixed_step);
  const double decode = timed(decode_ids);
  const double prefill = timed(prefill_step);
  bench::emit(o.out, "mixed", shape, "cellkv_mixed", mixed, mixed, "ms");
  bench::emit(o.out, "mixed", shape, "cellkv_decode_part", decode, decode, "ms");
  bench::emit(o.out, "mixed", shape, "cellkv_prefill_part", prefill, prefill, "ms");
  bench::emit(o.out, "mixed", shape, "cellkv_mixed_over_parts", mixed, mixed / (decode + prefill), "x");
}

// Per-step overhead: 256 decode tokens over 256k cells (256 sequences of ~1000 tokens).
void bench_overhead(const Options& o) {
  if (!o.only.empty()) return;
  using Cache = gpu::DeviceCache<layout::cell, bf16, Model, placement::clustered<64>>;
  BenchCache<Cache> bench(256, 262144, 256, 0);
  Cache& cache = bench.cache;
  std::vector<std::int32_t> ids;
  for (std::int32_t s = 0; s < 256; ++s) ids.push_back(cache.seq_new().value());
  for (int t = 0; t < 1000; ++t) (void)cache.declare_step(ids);
  gpu::Stream stream;
  (void)cache.declare_step(ids);
  (void)cache.upload(stream);
  stream.synchronize();
  std::vector<double> wall, host;
  for (int i = 0; i < (o.quick ? 20 : 200); ++i) {
    for (const std::int32_t s : ids) (void)cache.rewind(s, 1000);  // back to 1000 positions, untimed
    const auto t0 = std::chrono::steady_clock::now();
    (void)cache.declare_step(ids);
    (void)cache.upload(stream);
    const auto t1 = std::chrono::steady_clock::now();
    stream.synchronize();
    const auto t2 = std::chrono::steady_clock::now();
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    wall.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
  }
  std::sort(host.begin(), host.end());
  std::sort(wall.begin(), wall.end());
  const double h = host[host.size() / 2], w = wall[wall.size() / 2];
  bench::emit(o.out, "overhead", "256tok_256kcells", "cellkv_step_overhead", w * 1e-3, w, "us");
  bench::emit(o.out, "overhead", "256tok_256kcells", "cellkv_step_overhead_host", h * 1e-3, h, "us");
}

// "NxL,NxL,.." (L a count of tokens, or of 1,024 with a k suffix) -> the shapes; throws on a bad list.
std::vector<std::pair<std::int32_t, std::int32_t>> parse_shapes(const std::string& list) {
  std::vector<std::pair<std::int32_t, std::int32_t>> shapes;
  std::size_t at = 0;
  while (at < list.size()) {
    const std::size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    char* rest = nullptr;
    const long n = std::strtol(item.c_str(), &rest, 10);
    long len = *rest == 'x' ? std::strtol(rest + 1, &rest, 10) : 0;
    if (*rest == 'k') len *= 1024, ++rest;
    if (n <= 0 || len <= 0 || *rest != '\0' || n > 4096 || len > (1 << 20))
      throw std::runtime_error("bad decode shape '" + item + "' (want NxL, e.g. 16x4k)");
    shapes.emplace_back(static_cast<std::int32_t>(n), static_cast<std::int32_t>(len));
    at = end + 1;
  }
  return shapes;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) o.quick = true;
    if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) o.out = std::fopen(argv[++i], "w");
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) o.only = argv[++i];
    if (std::strcmp(argv[i], "--decode-shapes") == 0 && i + 1 < argc) {
      try {
        o.decode_shapes = parse_shapes(argv[++i]);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "cellkv-bench-attention: %s\n", e.what());
        return 2;
      }
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 || o.out == nullptr) {
    std::fprintf(stderr, "cellkv-bench-attention: needs a CUDA device (and a writable --out)\n");
    return 1;
  }
  using Clustered = gpu::DeviceCache<layout::cell, bf16, Model, placement::clustered<64>>;
  using Lowest = gpu::DeviceCache<layout::cell, bf16, Model, placement::lowest_free>;
  using Slots = gpu::DeviceCache<layout::sequence, bf16, Model>;
  using Fp8Clustered = gpu::DeviceCache<layout::cell, gpu::Fp8<bf16>, Model, placement::clustered<64>>;
  using Fp8Slots = gpu::DeviceCache<layout::sequence, gpu::Fp8<bf16>, Model>;
  const std::vector<std::pair<std::int32_t, std::int32_t>> decode =
      o.decode_shapes.empty() ? std::vector<std::pair<std::int32_t, std::int32_t>>{{1, 32768}, {16, 4096}, {64, 2048}, {256, 1024}}
                              : o.decode_shapes;
  const std::pair<std::int32_t, std::int32_t> prefill[] = {{1, 8192}, {8, 1024}, {4, 4096}};
  std::fprintf(stderr, "cellkv attention benchmark: bf16, H_q %d, H_kv %d, D %d (unless a shape says _dD), one layer\n",
               kHq, kHkv, kD);
  try {
    for (const auto& [n, len] : decode) {
      bench_decode<Clustered>(o, "cellkv_cell_clustered", n, len);
      bench_decode<Slots>(o, "cellkv_sequence", n, len);
      bench_decode<Lowest>(o, "cellkv_cell_lowest_free", n, len);
      bench_decode<Fp8Clustered>(o, "cellkv_cell_fp8", n, len);
      bench_decode<Fp8Slots>(o, "cellkv_sequence_fp8", n, len);  // the same kernel with no table reads
      if (!o.quick) bench_decode<Clustered>(o, "cellkv_cell_masked_reference", n, len, true);
    }
    for (const std::int32_t n : {16, 64, 128}) {
      bench_forks<Clustered>(o, "cellkv_cell_clustered", n, true);
      bench_forks<Clustered>(o, "cellkv_cell_clustered_unshared", n, false);
    }
    for (const auto& [n, len] : prefill) {
      bench_prefill<Clustered>(o, "cellkv_cell_clustered", n, len);
      bench_prefill_mma<Clustered>(o, "cellkv_cell_clustered_mma", n, len);
      bench_prefill<Slots>(o, "cellkv_sequence", n, len);
      bench_prefill<Fp8Clustered>(o, "cellkv_cell_fp8", n, len);
    }
    for (const std::int32_t d : {64, 256}) bench_prefill<Clustered>(o, "cellkv_cell_clustered", 1, 8192, d);
    bench_mixed(o, 128, 2048, 2, 1024);
    bench_overhead(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cellkv-bench-attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
