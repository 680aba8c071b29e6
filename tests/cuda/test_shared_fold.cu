// SharedFold::fold (kernels/shared_fold.cuh) against a float64 log-sum-exp merge, on hand-made
// slots: counts around every batch size, slots of weight 0 whose partials hold NaN, own parts
// that saw nothing, and maxima that jump by 2^100 between batches.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cellkv/gpu/kernels/shared_fold.cuh"
#include "support.cuh"

namespace cellkv::test {
namespace {

constexpr int kD = 64;     // columns of a row
constexpr int kHeads = 2;  // query heads

// One thread per (token, head, group of N columns): v starts as the own output, then folds.
template <int N, int kBatch, int kVec>
__global__ void fold_rows(gpu::kernels::SharedFold fold, const float* own_o, const float* own_lse, float* out,
                          int tokens) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int groups = kD / N;
  if (i >= tokens * kHeads * groups) return;
  const int row = i / groups, c0 = (i % groups) * N;
  float v[N];
  for (int j = 0; j < N; ++j) v[j] = own_o[row * kD + c0 + j];
  fold.template fold<kD, N, kBatch, kVec>(row / kHeads, row % kHeads, kHeads, own_lse[row],
                                          [&](int j) { return c0 + j; }, [&](int j) -> float& { return v[j]; });
  for (int j = 0; j < N; ++j) out[row * kD + c0 + j] = v[j];
}

struct FoldCase {
  std::vector<SlotRange> token_slots;       // [tokens]
  std::vector<float> lse, o;                // [slots][kHeads], [slots][kHeads][kD]
  std::vector<float> own_lse, own_o;        // [tokens][kHeads], [tokens][kHeads][kD]
};

// Tokens with `counts[t]` slots each; lse drawn from a range that grows with the slot index when
// `climbing` (every batch raises the maximum by about 2^100), a quarter of the slots -inf with NaN
// partials, every third token's own part empty (lse -inf).
FoldCase make_case(const std::vector<std::int32_t>& counts, bool climbing, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> quarter(0, 3);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  FoldCase c;
  std::int32_t first = 0;
  for (std::size_t t = 0; t < counts.size(); ++t) {
    c.token_slots.push_back({first, counts[t]});
    for (std::int32_t s = 0; s < counts[t]; ++s)
      for (int h = 0; h < kHeads; ++h) {
        const bool empty = quarter(rng) == 0;
        c.lse.push_back(empty ? -inf : (climbing ? 100.f * static_cast<float>(s / 4) : 0.f) + 4.f * normal(rng));
        for (int d = 0; d < kD; ++d) c.o.push_back(empty ? nan : normal(rng));
      }
    first += counts[t];
    for (int h = 0; h < kHeads; ++h) {
      const bool empty = t % 3 == 2;
      c.own_lse.push_back(empty ? -inf : 4.f * normal(rng));
      for (int d = 0; d < kD; ++d) c.own_o.push_back(empty ? 0.f : normal(rng));
    }
  }
  return c;
}

// The float64 merge: v over the own part and every slot of finite lse, by weights 2^(lse - max);
// the own output unchanged when nothing is finite.
std::vector<double> merged(const FoldCase& c) {
  std::vector<double> want;
  for (std::size_t t = 0; t < c.token_slots.size(); ++t)
    for (int h = 0; h < kHeads; ++h) {
      const std::size_t row = t * kHeads + static_cast<std::size_t>(h);
      std::vector<std::pair<double, const float*>> parts;  // (lse, o row)
      if (std::isfinite(c.own_lse[row])) parts.emplace_back(c.own_lse[row], &c.own_o[row * kD]);
      for (std::int32_t s = 0; s < c.token_slots[t].count; ++s) {
        const std::size_t slot_row = static_cast<std::size_t>(c.token_slots[t].first + s) * kHeads + static_cast<std::size_t>(h);
        if (std::isfinite(c.lse[slot_row])) parts.emplace_back(c.lse[slot_row], &c.o[slot_row * kD]);
      }
      double top = -INFINITY;
      for (const auto& p : parts) top = std::max(top, p.first);
      for (int d = 0; d < kD; ++d) {
        if (parts.empty()) {
          want.push_back(c.own_o[row * kD + static_cast<std::size_t>(d)]);
          continue;
        }
        double sum = 0, acc = 0;
        for (const auto& p : parts) {
          const double w = std::exp2(p.first - top);
          sum += w;
          acc += w * p.second[d];
        }
        want.push_back(acc / sum);
      }
    }
  return want;
}

template <int N, int kBatch, int kVec>
void check_fold(const FoldCase& c) {
  const auto tokens = static_cast<int>(c.token_slots.size());
  DeviceArray<SlotRange> slots(c.token_slots);
  DeviceArray<float> lse(c.lse), o(c.o), own_lse(c.own_lse), own_o(c.own_o), out(c.own_o.size());
  const gpu::kernels::SharedFold fold{nullptr, slots.data(), o.data(), lse.data()};
  const int threads = tokens * kHeads * (kD / N);
  fold_rows<N, kBatch, kVec><<<(threads + 127) / 128, 128>>>(fold, own_o.data(), own_lse.data(), out.data(), tokens);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  const std::vector<float> got = out.download();
  const std::vector<double> want = merged(c);
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::isfinite(got[i]));  // no NaN of a weight-0 partial got in
    worst = std::max(worst, std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i])));
  }
  CHECK(worst <= 1e-5);
}

}  // namespace

TEST_CASE("shared fold: one pass over batches equals the float64 log-sum-exp merge, weight-0 slots never read in") {
  // Counts around every batch size (1, 2, 8, 16), and none.
  const std::vector<std::int32_t> counts{0, 1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 33, 40};
  for (const bool climbing : {false, true}) {
    CAPTURE(climbing);
    const FoldCase c = make_case(counts, climbing, climbing ? 7 : 3);
    check_fold<2, 1, 2>(c);    // a lane's share of an MMA row (pairs of columns), one slot a batch
    check_fold<4, 8, 4>(c);    // a quad, 8 slots a batch (the decode kernel's merged pairs)
    check_fold<4, 16, 4>(c);   // the decode epilogue's 1-quad units
    check_fold<8, 8, 4>(c);    // 2-quad units
    check_fold<16, 4, 4>(c);   // 4-quad units
    check_fold<8, 8, 2>(c);    // pairs, 8 slots a batch
  }
  require_device_ok();
}

}  // namespace cellkv::test
