// fp8 (E4M3) KV storage on the device (gpu::Fp8<In> caches), each case against a host oracle:
// - write: the pool's codes and scales equal the host quantization (fp8.hpp quantize_row_head) of
//   the same inputs bit for bit, special row-heads included (+-inf, NaN, zeros, values near the
//   E4M3 subnormals, 1e30, float-subnormal amax), per-row and static per-layer scaling, every head
//   dim; a bad row goes to the scratch row and is reported once;
// - set_fp8_config refusals change nothing (later writes keep the previous scaling), on a device
//   cache and on every shard of a sharded cache;
// - attention (the reference kernel, and the automatic choice, which runs the fp8 table kernels
//   where they exist) against the float64 reference over a host fp8 pool driven by the same host
//   cache: prompts, decode steps, forks, a hole, two windows, both layouts, GQA 1 / 4 / 8;
// - copies (copy-on-write, the sequence layout's fork) move codes and scales;
// - the RoPE re-rotation of fp8 K rows equals the host's dequantize / rotate / quantize bit for bit;
// - footprint: kv_pools is pool_bytes_per_cell x (rows + 1), and is what the pool allocates.
#include <doctest/doctest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

#include "cellkv/footprint.hpp"
#include "cellkv/fp8.hpp"
#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/gpu/sharded_cache.cuh"
#include "cellkv/gpu/stream.hpp"
#include "cellkv/host_fp8_pool.hpp"
#include "cellkv/reference.hpp"
#include "cellkv/rope.hpp"
#include "support.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test;
using bf16 = __nv_bfloat16;

// Layer 0 sees everything, layer 1 the last 16 positions.
using Fp8Windows = Windows<0, 16>;
template <class In, class P = placement::lowest_free>
using Cells = gpu::DeviceCache<layout::cell, gpu::Fp8<In>, Fp8Windows, P, 8>;
template <class In>
using Slots = gpu::DeviceCache<layout::sequence, gpu::Fp8<In>, Fp8Windows, typename layout::sequence::default_placement, 8>;

// 2 layers, 2 KV heads of 64, 4 query heads.
constexpr gpu::PoolShape kSmall{.layers = Fp8Windows::kLayers, .heads_kv = 2, .head_dim = 64, .heads_q = 4};
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- a host image of a device fp8 pool ---------------------------------------------------------

// Every code and every scale of a device pool (scratch rows included), and where each layer's K / V
// codes and K / V scales start in them (taken from the pool's own views).
struct PoolImage {
  std::vector<Fp8E4M3> codes;
  std::vector<float> scales;
  std::vector<std::size_t> k, v, ks, vs;  // per layer
  std::int32_t heads_kv = 0, head_dim = 0;

  [[nodiscard]] std::size_t row_elems() const {
    return static_cast<std::size_t>(heads_kv) * static_cast<std::size_t>(head_dim);
  }
  Fp8E4M3* code(bool of_v, std::int32_t layer, std::int64_t row, std::int32_t h) {
    const std::size_t base = (of_v ? v : k)[static_cast<std::size_t>(layer)];
    return codes.data() + base + static_cast<std::size_t>(row) * row_elems() +
           static_cast<std::size_t>(h) * static_cast<std::size_t>(head_dim);
  }
  float& scale(bool of_v, std::int32_t layer, std::int64_t row, std::int32_t h) {
    const std::size_t base = (of_v ? vs : ks)[static_cast<std::size_t>(layer)];
    return scales[base + static_cast<std::size_t>(row) * static_cast<std::size_t>(heads_kv) + static_cast<std::size_t>(h)];
  }
};

template <class Pool>
PoolImage image_of(const Pool& pool) {
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  PoolImage im;
  const auto codes = pool.storage();
  const auto scales = pool.scale_storage();
  im.codes.resize(codes.size());
  im.scales.resize(scales.size());
  REQUIRE(cudaMemcpy(im.codes.data(), codes.data(), codes.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(im.scales.data(), scales.data(), scales.size() * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  im.heads_kv = pool.shape().heads_kv;
  im.head_dim = pool.shape().head_dim;
  for (std::int32_t l = 0; l < pool.shape().layers; ++l) {
    const auto view = pool.view(l);
    im.k.push_back(static_cast<std::size_t>(view.k - codes.data()));
    im.v.push_back(static_cast<std::size_t>(view.v - codes.data()));
    im.ks.push_back(static_cast<std::size_t>(view.k_scale - scales.data()));
    im.vs.push_back(static_cast<std::size_t>(view.v_scale - scales.data()));
  }
  return im;
}

// Codes and scales (by bit pattern: NaN scales compare too) that differ between two images.
std::size_t differences(const PoolImage& got, const PoolImage& want) {
  REQUIRE(got.codes.size() == want.codes.size());
  REQUIRE(got.scales.size() == want.scales.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < got.codes.size(); ++i) n += got.codes[i] == want.codes[i] ? 0 : 1;
  for (std::size_t i = 0; i < got.scales.size(); ++i)
    n += std::memcmp(&got.scales[i], &want.scales[i], sizeof(float)) == 0 ? 0 : 1;
  return n;
}

// The host's quantization of one token's K (or V) row, x [H_kv, D], into `row` of `layer`.
void quantize_into(PoolImage& im, bool of_v, std::int32_t layer, std::int64_t row, const float* x, float static_scale) {
  for (std::int32_t h = 0; h < im.heads_kv; ++h)
    im.scale(of_v, layer, row, h) = quantize_row_head(x + static_cast<std::ptrdiff_t>(h) * im.head_dim, im.head_dim,
                                                      static_scale, im.code(of_v, layer, row, h));
}

// A copy of every layer's K and V rows: codes and scales.
void copy_in_image(PoolImage& im, const RowCopy& c, std::int32_t layers) {
  for (std::int32_t l = 0; l < layers; ++l)
    for (const bool of_v : {false, true}) {
      std::memmove(im.code(of_v, l, c.dst_row, 0), im.code(of_v, l, c.src_row, 0),
                   static_cast<std::size_t>(c.rows) * im.row_elems());
      std::memmove(&im.scale(of_v, l, c.dst_row, 0), &im.scale(of_v, l, c.src_row, 0),
                   static_cast<std::size_t>(c.rows) * static_cast<std::size_t>(im.heads_kv) * sizeof(float));
    }
}

// The scale a write passes to quantize_row_head: the layer's static scale, or 0 (per row).
float write_scale(const Fp8Config& config, std::int32_t layer, bool of_v) {
  if (config.scaling != Fp8Scaling::static_per_layer) return 0.0f;
  const Fp8LayerScales& s = config.static_scales[static_cast<std::size_t>(layer)];
  return of_v ? s.v : s.k;
}

// ---- inputs ---------------------------------------------------------------------------------

// Row-heads [tokens, H_kv, D] of In covering the quantizer's cases, one kind per row-head in turn:
// random magnitudes; +-inf and NaN among finite values; all zeros (and -0); 448 beside values near
// and below the E4M3 subnormals (scale 1, so x / scale lands on them); 1e30 (inf in fp16); values
// near 1e-38 (bf16: an amax / 448 that is a float subnormal; fp16: zeros); NaN and inf only.
template <class In>
std::vector<In> special_rows(std::int32_t tokens, std::int32_t heads_kv, std::int32_t D, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<In> out(static_cast<std::size_t>(tokens) * static_cast<std::size_t>(heads_kv) * static_cast<std::size_t>(D));
  const auto kind_offset = static_cast<std::int32_t>(rng() % 7);
  for (std::int32_t rh = 0; rh < tokens * heads_kv; ++rh) {
    In* x = out.data() + static_cast<std::ptrdiff_t>(rh) * D;
    const std::int32_t kind = (rh + kind_offset) % 7;
    const double magnitude = std::pow(10.0, 3.0 * u(rng));
    for (std::int32_t d = 0; d < D; ++d) {
      double value = u(rng);
      switch (kind) {
        case 0: value *= magnitude; break;
        case 1: value = d == 1 ? kInf : d == 5 ? -kInf : d == 9 ? kNaN : value * 3.0; break;
        case 2: value = d % 3 == 0 ? -0.0 : 0.0; break;
        case 3: value = d == 0 ? 448.0 : value * 0.03125; break;  // |x| < 2^-5: subnormal codes, zeros
        case 4: value *= 1e30; break;
        case 5: value *= 1e-38; break;
        default: value = d % 2 == 0 ? kNaN : (d % 4 == 1 ? kInf : -kInf); break;
      }
      x[d] = from_double<In>(value);
    }
  }
  return out;
}

template <class In>
std::vector<float> as_float(const std::vector<In>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(to_double(v[i]));
  return out;
}

// One step of `ids` on the device cache that writes special_rows into every layer (no attention),
// and the same quantization into `want` at the rows the host placed. Returns those rows.
template <class Cache>
std::vector<std::int64_t> write_step(Cache& cache, const std::vector<std::int32_t>& ids, const Fp8Config& config,
                                     PoolImage& want, std::mt19937_64& rng, gpu::Stream& stream) {
  using In = typename Cache::Element;
  const gpu::PoolShape shape = cache.pool().shape();
  const StepPlan plan = cache.declare_step(ids).value();
  const std::vector<std::int64_t> rows(plan.rows.begin(), plan.rows.end());
  for (const RowCopy& c : cache.host().pending_changes().copies) copy_in_image(want, c, shape.layers);
  REQUIRE(cache.upload(stream).ok());
  const auto T = static_cast<std::int32_t>(ids.size());
  const auto row = static_cast<std::size_t>(shape.heads_kv) * static_cast<std::size_t>(shape.head_dim);
  for (std::int32_t l = 0; l < shape.layers; ++l) {
    const std::vector<In> k = special_rows<In>(T, shape.heads_kv, shape.head_dim, rng);
    const std::vector<In> v = special_rows<In>(T, shape.heads_kv, shape.head_dim, rng);
    const DeviceArray<In> dk(k), dv(v);
    REQUIRE(cache.write(l, dk.data(), dv.data(), T, stream).ok());
    stream.synchronize();  // dk, dv leave scope
    const std::vector<float> kf = as_float(k), vf = as_float(v);
    for (std::size_t t = 0; t < rows.size(); ++t) {
      quantize_into(want, false, l, rows[t], kf.data() + t * row, write_scale(config, l, false));
      quantize_into(want, true, l, rows[t], vf.data() + t * row, write_scale(config, l, true));
    }
  }
  REQUIRE(cache.commit(stream).ok());
  stream.synchronize();
  return rows;
}

const Fp8Config kStatic{Fp8Scaling::static_per_layer, {{0.01f, 0.02f}, {0.5f, 3e-3f}}};

template <class Cache>
void write_case(std::int32_t head_dim, const Fp8Config& config, std::uint64_t seed) {
  CAPTURE(head_dim);
  CAPTURE(seed);
  Cache cache({.max_write = 8, .max_cells = 24, .max_seqs = 3, .max_len = 12},
              {.layers = Fp8Windows::kLayers, .heads_kv = 2, .head_dim = head_dim, .heads_q = 4});
  REQUIRE(cache.set_fp8_config(config).ok());
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  PoolImage want = image_of(cache.pool());
  for (const Fp8E4M3 c : want.codes) REQUIRE(c.code == 0);  // a new pool: codes 0, scales 0
  for (const float s : want.scales) REQUIRE(s == 0.0f);
  const std::int32_t a = cache.seq_new().value(), b = cache.seq_new().value();
  (void)write_step(cache, {a, a, a, a, b, b, b}, config, want, rng, stream);
  (void)write_step(cache, {b, a, a, b, a, b, a, b}, config, want, rng, stream);
  CHECK(differences(image_of(cache.pool()), want) == 0);
  require_device_ok();
}

}  // namespace

TEST_CASE("fp8 write: the device's codes and scales equal the host quantization bit for bit (special values too)") {
  for (const std::int32_t d : {64, 128, 256}) {
    for (const Fp8Config& config : {Fp8Config{}, kStatic}) {
      CAPTURE(static_cast<int>(config.scaling));
      write_case<Cells<bf16>>(d, config, 100 + static_cast<std::uint64_t>(d));
      write_case<Cells<__half>>(d, config, 200 + static_cast<std::uint64_t>(d));
      write_case<Slots<bf16>>(d, config, 300 + static_cast<std::uint64_t>(d));
      write_case<Slots<__half>>(d, config, 400 + static_cast<std::uint64_t>(d));
    }
  }
}

TEST_CASE("fp8 write: a bad row in the step block lands in the scratch row, codes and scale; the commit reports it once") {
  using Cache = Cells<bf16>;
  constexpr std::int32_t kRows = 32;
  Cache cache({.max_write = 4, .max_cells = kRows}, kSmall);
  gpu::Stream stream;
  std::mt19937_64 rng(5);
  // Poison: 0xFF codes (NaN) and NaN scales everywhere, so any stray write shows.
  REQUIRE(cudaMemset(cache.pool().storage().data(), 0xff, cache.pool().storage().size()) == cudaSuccess);
  REQUIRE(cudaMemset(cache.pool().scale_storage().data(), 0xff, cache.pool().scale_storage().size() * sizeof(float)) ==
          cudaSuccess);
  PoolImage want = image_of(cache.pool());
  const std::int32_t a = cache.seq_new().value();
  const std::vector<std::int32_t> ids{a, a, a};
  const StepPlan plan = cache.declare_step(ids).value();
  const std::vector<std::int64_t> rows(plan.rows.begin(), plan.rows.end());
  REQUIRE(cache.upload(stream).ok());
  stream.synchronize();
  const std::int64_t bad = kRows + 7;  // past the scratch row
  REQUIRE(cudaMemcpy(cache.bindings().cells + 1, &bad, sizeof bad, cudaMemcpyHostToDevice) == cudaSuccess);
  const std::vector<bf16> k = special_rows<bf16>(3, 2, 64, rng), v = special_rows<bf16>(3, 2, 64, rng);
  const DeviceArray<bf16> dk(k), dv(v);
  REQUIRE(cache.write(0, dk.data(), dv.data(), 3, stream).ok());
  stream.synchronize();
  CHECK(cache.commit(stream) == Errc::bad_device_row);
  CHECK(cache.commit(stream).ok());  // reported once
  const std::vector<float> kf = as_float(k), vf = as_float(v);
  const std::vector<std::int64_t> lands{rows[0], kRows, rows[2]};  // token 1: the scratch row
  for (std::size_t t = 0; t < 3; ++t) {
    quantize_into(want, false, 0, lands[t], kf.data() + t * 128, 0.0f);
    quantize_into(want, true, 0, lands[t], vf.data() + t * 128, 0.0f);
  }
  CHECK(differences(image_of(cache.pool()), want) == 0);
  require_device_ok();
}

namespace {

// Configs check_fp8_config refuses, each next to a valid one of 2 layers.
std::vector<Fp8Config> refused_configs() {
  std::vector<Fp8Config> out;
  for (const float bad : {0.0f, -0.0f, -1.0f, kInf, -kInf, kNaN}) {
    Fp8Config k = kStatic, v = kStatic;
    k.static_scales[1].k = bad;
    v.static_scales[0].v = bad;
    out.push_back(k);
    out.push_back(v);
  }
  Fp8Config one = kStatic, three = kStatic, none = kStatic, unknown = kStatic;
  one.static_scales.pop_back();
  three.static_scales.push_back({1.0f, 1.0f});
  none.static_scales.clear();
  unknown.scaling = static_cast<Fp8Scaling>(7);
  out.insert(out.end(), {one, three, none, unknown});
  return out;
}

bool same_config(const Fp8Config& a, const Fp8Config& b) {
  if (a.scaling != b.scaling) return false;
  return a.scaling == Fp8Scaling::per_row || a.static_scales == b.static_scales;
}

}  // namespace

TEST_CASE("fp8 set_fp8_config: refusals are bad_argument and change nothing; later writes keep the previous scaling") {
  Cells<bf16> cache({.max_write = 8, .max_cells = 40}, kSmall);
  gpu::Stream stream;
  std::mt19937_64 rng(17);
  PoolImage want = image_of(cache.pool());
  const std::int32_t a = cache.seq_new().value();
  // Per-row scaling (the default) survives every refusal.
  for (const Fp8Config& bad : refused_configs()) {
    CHECK(cache.set_fp8_config(bad) == Errc::bad_argument);
    CHECK(same_config(cache.pool().fp8_config(), Fp8Config{}));
  }
  (void)write_step(cache, {a, a, a, a}, Fp8Config{}, want, rng, stream);
  CHECK(differences(image_of(cache.pool()), want) == 0);
  // Static scales survive every refusal too; the rows written before keep their codes and scales.
  REQUIRE(cache.set_fp8_config(kStatic).ok());
  for (const Fp8Config& bad : refused_configs()) {
    CHECK(cache.set_fp8_config(bad) == Errc::bad_argument);
    CHECK(same_config(cache.pool().fp8_config(), kStatic));
  }
  (void)write_step(cache, {a, a, a}, kStatic, want, rng, stream);
  CHECK(differences(image_of(cache.pool()), want) == 0);
  // And back to per-row scaling.
  REQUIRE(cache.set_fp8_config(Fp8Config{}).ok());
  (void)write_step(cache, {a, a}, Fp8Config{}, want, rng, stream);
  CHECK(differences(image_of(cache.pool()), want) == 0);
  require_device_ok();
}

TEST_CASE("fp8 set_fp8_config on a sharded cache (2 shards on one GPU): refused for every shard or set on every one") {
  using Sharded = gpu::ShardedCache<layout::cell, gpu::Fp8<bf16>, Fp8Windows, placement::lowest_free, 8>;
  Sharded cache({.max_write = 4, .max_cells = 16}, kSmall, std::vector<int>{0, 0});
  REQUIRE(cache.shards() == 2);
  for (const Fp8Config& bad : refused_configs()) {
    CHECK(cache.set_fp8_config(bad) == Errc::bad_argument);
    for (std::int32_t g = 0; g < 2; ++g) CHECK(same_config(cache.shard(g).pool().fp8_config(), Fp8Config{}));
  }
  REQUIRE(cache.set_fp8_config(kStatic).ok());
  for (std::int32_t g = 0; g < 2; ++g) CHECK(same_config(cache.shard(g).pool().fp8_config(), kStatic));
  for (const Fp8Config& bad : refused_configs()) {
    CHECK(cache.set_fp8_config(bad) == Errc::bad_argument);
    for (std::int32_t g = 0; g < 2; ++g) CHECK(same_config(cache.shard(g).pool().fp8_config(), kStatic));
  }
  // A shard's own set_fp8_config refuses the same way.
  CHECK(cache.shard(1).set_fp8_config(refused_configs().front()) == Errc::bad_argument);
  CHECK(same_config(cache.shard(1).pool().fp8_config(), kStatic));
  // Every shard's later writes (its own KV head) use the static scales.
  gpu::Stream s0, s1;
  const std::vector<::cuda::stream_ref> refs{s0.ref(), s1.ref()};
  std::mt19937_64 rng(29);
  const std::int32_t a = cache.seq_new().value();
  const std::vector<std::int32_t> ids{a, a, a};
  const StepPlan plan = cache.declare_step(ids).value();
  const std::vector<std::int64_t> rows(plan.rows.begin(), plan.rows.end());
  REQUIRE(cache.upload(refs).ok());
  std::vector<PoolImage> want;
  for (std::int32_t g = 0; g < 2; ++g) {
    const auto& shard = cache.shard(g);
    REQUIRE(shard.pool().shape().heads_kv == 1);
    want.push_back(image_of(shard.pool()));
    for (std::int32_t l = 0; l < Fp8Windows::kLayers; ++l) {
      const std::vector<bf16> k = special_rows<bf16>(3, 1, 64, rng), v = special_rows<bf16>(3, 1, 64, rng);
      const DeviceArray<bf16> dk(k), dv(v);
      REQUIRE(shard.write(l, dk.data(), dv.data(), 3, refs[static_cast<std::size_t>(g)]).ok());
      REQUIRE(cudaStreamSynchronize(refs[static_cast<std::size_t>(g)].get()) == cudaSuccess);
      const std::vector<float> kf = as_float(k), vf = as_float(v);
      for (std::size_t t = 0; t < 3; ++t) {
        quantize_into(want.back(), false, l, rows[t], kf.data() + t * 64, write_scale(kStatic, l, false));
        quantize_into(want.back(), true, l, rows[t], vf.data() + t * 64, write_scale(kStatic, l, true));
      }
    }
  }
  REQUIRE(cache.commit(refs).ok());
  for (std::int32_t g = 0; g < 2; ++g)
    CHECK(differences(image_of(cache.shard(g).pool()), want[static_cast<std::size_t>(g)]) == 0);
  require_device_ok();
}

// ---- attention against the float64 reference over a host fp8 pool --------------------------

namespace {

// The device cache and, driven by its own host cache, a host fp8 pool of the same rows: each step
// writes and attends on both (reference::update_and_attend quantizes as the device write does and
// attends in double over the dequantized rows) and compares the outputs.
template <class Cache>
class Fp8Twin {
 public:
  using In = typename Cache::Element;
  using W = typename Cache::Windows;

  Fp8Twin(Cache& cache, std::int32_t heads_q, std::int32_t max_width)
      : cache_(cache),
        heads_q_(heads_q),
        shape_(cache.pool().shape()),
        host_(W::kLayers, cache.pool().rows(), shape_.heads_kv, shape_.head_dim),
        q_(static_cast<std::size_t>(max_width * heads_q * shape_.head_dim)),
        k_(static_cast<std::size_t>(max_width) * kv_row()),
        v_(k_.buf.size()),
        out_(static_cast<std::size_t>(W::kLayers) * q_.buf.size()) {}

  HostFp8Pool& host_pool() { return host_; }

  // One step of `ids` (fresh random inputs) on both, uploaded `width` wide (0: the step's T; the
  // padding tokens [T, width) write the scratch row and must output zeros); returns the worst
  // relative error of the device outputs against the reference (compare_outputs: per token and
  // head, relative to the head's largest reference value).
  double step(const std::vector<std::int32_t>& ids, std::mt19937_64& rng, gpu::Stream& stream, std::int32_t width = 0) {
    REQUIRE(cache_.declare_step(ids).ok());
    const PendingChanges& changes = cache_.host().pending_changes();
    REQUIRE(changes.rotations.empty());
    for (const RowCopy& c : changes.copies) host_.copy_rows(c);
    const auto T = static_cast<std::int32_t>(ids.size());
    if (width == 0) width = T;
    const auto qn = static_cast<std::size_t>(T * heads_q_ * shape_.head_dim);
    const auto kn = static_cast<std::size_t>(T) * kv_row();
    const auto qw = static_cast<std::size_t>(width * heads_q_ * shape_.head_dim);
    const auto kw = static_cast<std::size_t>(width) * kv_row();
    std::vector<In> q = random_values<In>(qw, rng), k = random_values<In>(kw, rng), v = random_values<In>(kw, rng);
    REQUIRE(cudaMemcpy(q_.data(), q.data(), qw * sizeof(In), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(k_.data(), k.data(), kw * sizeof(In), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(v_.data(), v.data(), kw * sizeof(In), cudaMemcpyHostToDevice) == cudaSuccess);
    out_.fill(poison<In>());
    // The host side, on the placed step's T tokens.
    q.resize(qn), k.resize(kn), v.resize(kn);
    const std::vector<double> qd = as_double(q);
    const std::vector<float> kf = as_float(k), vf = as_float(v);
    std::vector<std::vector<double>> want(static_cast<std::size_t>(W::kLayers), std::vector<double>(qn));
    for (std::int32_t l = 0; l < W::kLayers; ++l)
      REQUIRE(reference::update_and_attend(cache_.host(), W::window_of_layer(l), host_.view(l), std::span<const double>(qd),
                                           std::span<const float>(kf), std::span<const float>(vf),
                                           std::span<double>(want[static_cast<std::size_t>(l)]), heads_q_,
                                           reference::default_scale(shape_.head_dim))
                  .ok());
    // The device side.
    REQUIRE(cache_.upload(stream, width).ok());
    for (std::int32_t l = 0; l < W::kLayers; ++l)
      REQUIRE(cache_.update_and_attend(l, q_.data(), k_.data(), v_.data(), out_.data() + out_offset(l), width, heads_q_, 0.f,
                                       stream)
                  .ok());
    REQUIRE(cache_.commit(stream).ok());
    stream.synchronize();
    const std::vector<In> got = out_.download();
    double worst = 0;
    for (std::int32_t l = 0; l < W::kLayers; ++l) {
      CAPTURE(l);
      const auto first = got.begin() + static_cast<std::ptrdiff_t>(out_offset(l));
      for (std::size_t i = qn; i < qw; ++i) CHECK(to_double(first[static_cast<std::ptrdiff_t>(i)]) == 0.0);  // padding
      worst = std::max(worst, compare_outputs(std::vector<In>(first, first + static_cast<std::ptrdiff_t>(qn)),
                                              want[static_cast<std::size_t>(l)], shape_.head_dim));
    }
    return worst;
  }

  // The device pool's rows [0, rows) of every layer equal the host pool's, codes and scales.
  std::size_t pool_differences() const {
    PoolImage got = image_of(cache_.pool());
    std::size_t n = 0;
    for (std::int32_t l = 0; l < W::kLayers; ++l) {
      const auto h = host_.view(l);
      for (std::int64_t r = 0; r < host_.rows(); ++r)
        for (std::int32_t head = 0; head < shape_.heads_kv; ++head)
          for (const bool of_v : {false, true}) {
            const Fp8E4M3* want = (of_v ? h.v : h.k) + h.offset(r, head);
            const Fp8E4M3* codes = got.code(of_v, l, r, head);
            for (std::int32_t d = 0; d < shape_.head_dim; ++d) n += codes[d] == want[d] ? 0 : 1;
            const float ws = (of_v ? h.v_scale : h.k_scale)[h.scale_offset(r, head)];
            const float gs = got.scale(of_v, l, r, head);
            n += std::memcmp(&ws, &gs, sizeof(float)) == 0 ? 0 : 1;
          }
    }
    return n;
  }

 private:
  [[nodiscard]] std::size_t kv_row() const { return static_cast<std::size_t>(shape_.heads_kv * shape_.head_dim); }
  [[nodiscard]] std::size_t out_offset(std::int32_t layer) const { return static_cast<std::size_t>(layer) * q_.buf.size(); }

  Cache& cache_;
  std::int32_t heads_q_;
  gpu::PoolShape shape_;
  HostFp8Pool host_;
  DeviceArray<In> q_, k_, v_, out_;  // out_: [layers][max_width, H_q, D]
};

// Tolerance of fp8 attention against the float64 reference over the SAME codes and scales (the
// write is bit-exact, checked above and by pool_differences below), so quantization error is common
// to both sides and does not count. What remains: the device dequantizes decode(code) x scale in
// fp32 (relative 2^-24 per element), accumulates the softmax and P.V in fp32 (relative ~1e-6 for
// these lengths), and rounds the output to In (bf16: relative 2^-9 of the element, at most 2^-9 of
// the head's largest output; fp16: 2^-12). A table kernel that rounds dequantized K / V or P to
// bf16 for its MMAs adds a few 2^-9 more, relative to the output's magnitude. tolerance<In>() (1e-2
// relative to the head's largest reference output, compare_outputs) covers both with margin, as it
// does for the bf16 / fp16 caches; a wrong scale, code or visible row errs by O(1).
template <class In>
double fp8_tolerance() {
  return tolerance<In>();
}

// Prompts in chunks (mixed sequences per step, T from 1 to max_write), a fork, a hole in the middle
// of a sequence (cell layout; the sequence layout refuses it), decode steps past the 16-position
// window of layer 1.
template <class Cache>
void attention_run(std::int32_t heads_q, std::int32_t heads_kv, std::int32_t head_dim, gpu::KernelChoice kernels,
                   const Fp8Config& config, std::uint64_t seed) {
  using Host = typename Cache::Host;
  constexpr bool kCell = std::is_same_v<typename Host::Layout, layout::cell>;
  constexpr std::int32_t kMaxWrite = 16;
  CAPTURE(heads_q);
  CAPTURE(heads_kv);
  CAPTURE(head_dim);
  CAPTURE(static_cast<int>(kernels));
  CAPTURE(static_cast<int>(config.scaling));
  CAPTURE(kCell);
  Cache cache({.max_write = kMaxWrite, .max_cells = 160, .max_seqs = 4, .max_len = 48},
              {.layers = Fp8Windows::kLayers, .heads_kv = heads_kv, .head_dim = head_dim, .heads_q = heads_q});
  cache.use_kernels(kernels);
  REQUIRE(cache.set_fp8_config(config).ok());
  Fp8Twin<Cache> twin(cache, heads_q, kMaxWrite);
  REQUIRE(twin.host_pool().set_config(config).ok());
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  const std::int32_t a = cache.seq_new().value(), b = cache.seq_new().value();
  auto run = [&](std::vector<std::int32_t> ids, std::int32_t width = 0) {
    CAPTURE(ids.size());
    CAPTURE(width);
    const double worst = twin.step(ids, rng, stream, width);
    CAPTURE(worst);
    CHECK(worst <= fp8_tolerance<typename Cache::Element>());
  };
  auto repeat = [](std::int32_t s, std::int32_t n) { return std::vector<std::int32_t>(static_cast<std::size_t>(n), s); };
  // Prompts: a 36 tokens, b 10, in chunks.
  {
    std::vector<std::int32_t> ids = repeat(a, 13);
    ids.insert(ids.end(), {b, b, b});
    run(ids);  // T = max_write
  }
  run(repeat(a, 16));
  {
    std::vector<std::int32_t> ids = repeat(b, 7);
    ids.push_back(a);
    run(ids);
  }
  run({a});  // T = 1
  // A fork of a (the cell layout shares its cells, the sequence layout copies its rows).
  const std::int32_t c = cache.seq_clone(a).value();
  run({c, a, b});
  // A hole in the middle of a.
  if constexpr (kCell) REQUIRE(cache.seq_rm(a, 5, 12).ok());
  run({a, a, c});
  for (int step = 0; step < 5; ++step) run({a, b, c});
  run({b});
  run({a, c}, 5);  // a graph-width step: 3 padding tokens
  CHECK(twin.pool_differences() == 0);
  require_device_ok();
}

}  // namespace

TEST_CASE("fp8 attention: the reference kernel and the automatic choice against float64 attention over a host fp8 pool") {
  using gpu::KernelChoice;
  for (const KernelChoice kernels : {KernelChoice::reference, KernelChoice::automatic}) {
    attention_run<Cells<bf16>>(2, 2, 64, kernels, Fp8Config{}, 11);                         // GQA 1
    attention_run<Cells<bf16>>(4, 1, 128, kernels, kStatic, 12);                            // GQA 4, static scales
    attention_run<Cells<__half, placement::clustered<64>>>(8, 1, 256, kernels, Fp8Config{}, 13);  // GQA 8
    attention_run<Cells<bf16, placement::clustered<64>>>(16, 2, 128, kernels, Fp8Config{}, 14);  // GQA 8
    // D 128 runs the columns decode kernel up to GQA 8 (items of 8 rows: T >= 3 at GQA 4 is
    // prefilled); GQA 16 the row form with items of 16 rows.
    attention_run<Cells<bf16>>(16, 1, 128, kernels, Fp8Config{}, 18);  // GQA 16
    attention_run<Slots<bf16>>(8, 2, 64, kernels, Fp8Config{}, 15);
    attention_run<Slots<__half>>(4, 1, 256, kernels, kStatic, 16);
    attention_run<Slots<bf16>>(2, 2, 128, kernels, Fp8Config{}, 17);
  }
}

// ---- copies -------------------------------------------------------------------------------------

TEST_CASE("fp8 copies: copy-on-write cells (cell layout) and the fork copy (sequence layout) carry codes and scales") {
  gpu::Stream stream;
  std::mt19937_64 rng(23);
  SUBCASE("cell layout: seq_add on a forked sequence copies the shared cells on write") {
    Cells<bf16> cache({.max_write = 8, .max_cells = 48}, kSmall);
    REQUIRE(cache.set_key_rotation(gpu::KeyRotation<gpu::Fp8<bf16>>::none()).ok());
    PoolImage want = image_of(cache.pool());
    const std::int32_t a = cache.seq_new().value();
    (void)write_step(cache, std::vector<std::int32_t>(8, a), Fp8Config{}, want, rng, stream);
    (void)write_step(cache, std::vector<std::int32_t>(4, a), Fp8Config{}, want, rng, stream);
    const std::int32_t b = cache.seq_clone(a).value();
    REQUIRE(cache.seq_add(a, 6, -1, 3).ok());  // positions 6..11 -> 9..14, shared with b
    const std::vector<RowCopy> copies(cache.host().pending_changes().copies.begin(),
                                      cache.host().pending_changes().copies.end());
    CHECK(copies.size() == 6);
    for (const RowCopy& c : copies) copy_in_image(want, c, Fp8Windows::kLayers);
    const PoolImage before = image_of(cache.pool());
    CHECK(differences(before, want) > 0);  // the copies change the pool: the check below is not vacuous
    const std::vector<std::int32_t> ids{b};
    REQUIRE(cache.declare_step(ids).ok());
    REQUIRE(cache.upload(stream).ok());  // runs the copies (the rotation is none)
    stream.synchronize();
    PoolImage got = image_of(cache.pool());
    CHECK(differences(got, want) == 0);
    for (const RowCopy& c : copies)  // the copied rows hold the source's codes and scales
      for (std::int32_t l = 0; l < Fp8Windows::kLayers; ++l)
        for (const bool of_v : {false, true}) {
          CHECK(std::memcmp(got.code(of_v, l, c.dst_row, 0), got.code(of_v, l, c.src_row, 0), got.row_elems()) == 0);
          CHECK(std::memcmp(&got.scale(of_v, l, c.dst_row, 0), &got.scale(of_v, l, c.src_row, 0), 2 * sizeof(float)) == 0);
        }
    REQUIRE(cache.commit(stream).ok());
  }
  SUBCASE("sequence layout: a fork copies the source's rows into its slot") {
    Slots<bf16> cache({.max_write = 8, .max_seqs = 3, .max_len = 16},
                      {.layers = Fp8Windows::kLayers, .heads_kv = 2, .head_dim = 128, .heads_q = 2});
    REQUIRE(cache.set_fp8_config(kStatic).ok());
    PoolImage want = image_of(cache.pool());
    const std::int32_t a = cache.seq_new().value();
    (void)write_step(cache, std::vector<std::int32_t>(8, a), kStatic, want, rng, stream);
    (void)write_step(cache, std::vector<std::int32_t>(3, a), kStatic, want, rng, stream);
    const std::int32_t b = cache.seq_clone(a).value();
    const std::vector<RowCopy> copies(cache.host().pending_changes().copies.begin(),
                                      cache.host().pending_changes().copies.end());
    REQUIRE(copies.size() == 1);
    CHECK(copies[0].rows == 11);
    copy_in_image(want, copies[0], Fp8Windows::kLayers);
    CHECK(differences(image_of(cache.pool()), want) > 0);  // not vacuous
    const std::vector<std::int32_t> ids{b};
    REQUIRE(cache.declare_step(ids).ok());
    REQUIRE(cache.upload(stream).ok());
    stream.synchronize();
    CHECK(differences(image_of(cache.pool()), want) == 0);
    REQUIRE(cache.commit(stream).ok());
  }
  require_device_ok();
}

// ---- key rotation -------------------------------------------------------------------------------

namespace {

// The host's re-rotation of one moved fp8 K row-head: dequantized in double (exact), each pair
// rotated in double (rope.hpp), rounded to float, quantized again with a fresh per-row scale or
// the layer's static one. Bit for bit with the device: the dequantization is exact on both, and
// quantize_row_head is the same function on the same floats. The rotation itself may differ in the
// last ulps of a double (the device's sin / cos / pow, and its fused multiply-adds in rotate_pair),
// which changes the float it rounds to only near a float rounding boundary (~1e-9 per element), and
// changes a code only if that float also sits on an E4M3 rounding boundary or is the row-head's
// amax: far below one expected mismatch over the ~3e4 elements rotated here.
void rotate_in_image(PoolImage& im, std::int32_t layer, const RowRotation& r, const RopeSpec& spec, float static_k) {
  const std::int32_t D = im.head_dim;
  for (std::int32_t h = 0; h < im.heads_kv; ++h) {
    Fp8E4M3* codes = im.code(false, layer, r.cell, h);
    float& scale = im.scale(false, layer, r.cell, h);
    std::vector<double> x(static_cast<std::size_t>(D));
    dequantize_row_head(codes, D, scale, x.data());
    for (std::int32_t i = 0; i < spec.dims(D) / 2; ++i) {
      std::int32_t a = 0, b = 0;
      rope_elements(spec, D, i, a, b);
      rotate_pair(x[static_cast<std::size_t>(a)], x[static_cast<std::size_t>(b)],
                  static_cast<double>(r.new_pos - r.old_pos) * rope_frequency(spec, D, i));
    }
    std::vector<float> rounded(x.begin(), x.end());
    scale = quantize_row_head(rounded.data(), D, static_k, codes);
  }
}

// Random finite K / V rows of magnitudes 1e-2..1e2 (no special values: a rotation mixes a pair's
// elements, and inf / NaN would only propagate).
void rotation_case(std::int32_t head_dim, const RopeSpec& spec, const Fp8Config& config, std::uint64_t seed) {
  CAPTURE(head_dim);
  CAPTURE(static_cast<int>(config.scaling));
  Cells<bf16> cache({.max_write = 12, .max_cells = 64},
                    {.layers = Fp8Windows::kLayers, .heads_kv = 2, .head_dim = head_dim, .heads_q = 4});
  REQUIRE(cache.set_fp8_config(config).ok());
  REQUIRE(cache.set_key_rotation(gpu::KeyRotation<gpu::Fp8<bf16>>::rope(spec)).ok());
  gpu::Stream stream;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const std::int32_t a = cache.seq_new().value();
  for (int chunk = 0; chunk < 2; ++chunk) {
    const std::vector<std::int32_t> ids(12, a);
    REQUIRE(cache.declare_step(ids).ok());
    REQUIRE(cache.upload(stream).ok());
    const std::size_t n = 12 * 2 * static_cast<std::size_t>(head_dim);
    for (std::int32_t l = 0; l < Fp8Windows::kLayers; ++l) {
      std::vector<bf16> k(n), v(n);
      for (std::size_t i = 0; i < n; ++i) {
        k[i] = from_double<bf16>(u(rng) * std::pow(10.0, 2.0 * u(rng)));
        v[i] = from_double<bf16>(u(rng) * std::pow(10.0, 2.0 * u(rng)));
      }
      const DeviceArray<bf16> dk(k), dv(v);
      REQUIRE(cache.write(l, dk.data(), dv.data(), 12, stream).ok());
      stream.synchronize();
    }
    REQUIRE(cache.commit(stream).ok());
  }
  // A context shift: drop positions [4, 10), slide [10, 24) down by 6.
  REQUIRE(cache.seq_rm(a, 4, 10).ok());
  REQUIRE(cache.seq_add(a, 10, -1, -6).ok());
  const PendingChanges& changes = cache.host().pending_changes();
  CHECK(changes.copies.empty());
  const std::vector<RowRotation> rotations(changes.rotations.begin(), changes.rotations.end());
  CHECK(rotations.size() == 14);
  PoolImage want = image_of(cache.pool());
  for (std::int32_t l = 0; l < Fp8Windows::kLayers; ++l)
    for (const RowRotation& r : rotations) rotate_in_image(want, l, r, spec, write_scale(config, l, false));
  CHECK(differences(image_of(cache.pool()), want) > 0);  // the rotation changes K: the check below is not vacuous
  const std::vector<std::int32_t> ids{a};
  REQUIRE(cache.declare_step(ids).ok());
  REQUIRE(cache.upload(stream).ok());  // runs the re-rotation
  stream.synchronize();
  CHECK(differences(image_of(cache.pool()), want) == 0);  // moved K re-rotated; V, its scales and the rest unchanged
  REQUIRE(cache.commit(stream).ok());
  require_device_ok();
}

}  // namespace

TEST_CASE("fp8 key rotation: RoPE of moved fp8 K rows equals the host's dequantize, rotate, quantize bit for bit") {
  const RopeSpec half{.theta = 10000.0};
  const RopeSpec partial{.theta = 500000.0, .rotary_dims = 32, .pairs = RopePairs::interleaved,
                         .scaling = RopeScaling::linear, .factor = 4.0};
  rotation_case(64, half, Fp8Config{}, 31);
  rotation_case(128, partial, Fp8Config{}, 32);
  rotation_case(256, half, kStatic, 33);
  rotation_case(64, partial, kStatic, 34);
}

// ---- footprint ----------------------------------------------------------------------------------

TEST_CASE("fp8 footprint: kv_pools is pool_bytes_per_cell x (rows + 1), scales included, and what the pool allocates") {
  const gpu::PoolShape shape{.layers = 2, .heads_kv = 2, .head_dim = 128, .heads_q = 8};
  const std::size_t per_cell = pool_bytes_per_cell(shape, KvStorage::fp8_e4m3).value();
  CHECK(per_cell == 2 * 2 * 2 * (128 * 1 + 4));  // K and V, layers, heads: D codes and an fp32 scale
  auto check = [&](const auto& cache, const CacheConfig& config, std::int64_t rows) {
    using Cache = std::remove_cvref_t<decltype(cache)>;
    const auto f = Cache::footprint(config, shape);
    REQUIRE(f.ok());
    CHECK(f.value().kv_pools == per_cell * static_cast<std::size_t>(rows + 1));  // + the scratch row
    CHECK(cache.pool().rows() == rows);
    CHECK(cache.pool().storage().size_bytes() + cache.pool().scale_storage().size_bytes() == f.value().kv_pools);
  };
  const CacheConfig cells{.max_write = 8, .max_cells = 100};
  check(Cells<bf16>(cells, shape), cells, 100);
  const CacheConfig slots{.max_write = 8, .max_seqs = 3, .max_len = 20};
  check(Slots<__half>(slots, shape), slots, 60);
  require_device_ok();
}
