// A multi-layer forward for the GPU suite: each layer is write + attend through the layer's window,
// on the device (DeviceCache) and on the host (reference::update_and_attend over double pools that
// mirror the device pools). Inputs are fresh random values for every step.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "cellkv/gpu/device_cache.cuh"
#include "cellkv/reference.hpp"
#include "cellkv/rope.hpp"
#include "support.cuh"

namespace cellkv::test {

template <class Cache>
class ForwardHarness {
 public:
  using T = typename Cache::Element;
  using W = typename Cache::Windows;

  ForwardHarness(Cache& cache, std::int32_t heads_q, std::int32_t max_width)
      : cache_(cache),
        heads_q_(heads_q),
        shape_(cache.pools().shape()),
        q_(static_cast<std::size_t>(max_width * heads_q * shape_.head_dim)),
        k_(static_cast<std::size_t>(max_width) * kv_row()),
        v_(k_.buf.size()),
        out_(static_cast<std::size_t>(W::kLayers) * q_.buf.size()) {
    for (std::int32_t l = 0; l < W::kLayers; ++l)
      host_k_.emplace_back(static_cast<std::size_t>(rows_of(l)) * kv_row(), 0.0);
    host_v_ = host_k_;
  }

  // Device forward of `width` tokens for every layer (capturable: fixed buffers only).
  void device_forward(std::int32_t width, ::cuda::stream_ref stream) {
    for (std::int32_t l = 0; l < W::kLayers; ++l)
      REQUIRE(cache_.update_and_attend(l, q_.data(), k_.data(), v_.data(), out_.data() + out_offset(l), width, heads_q_, 0.f, stream)
                  .ok());
  }

  // Writes the step's K/V rows (fresh random values) on the device and in the host pools, with no
  // attention: cheap steps that fill a cache (the uploaded width; the real tokens are the first T).
  void write_step(std::int32_t width, std::mt19937_64& rng, ::cuda::stream_ref stream) {
    new_inputs(width, rng);
    for (std::int32_t l = 0; l < W::kLayers; ++l) REQUIRE(cache_.write(l, k_.data(), v_.data(), width, stream).ok());
    const auto& host = cache_.host();
    const auto kn = static_cast<std::size_t>(host.step().tokens) * kv_row();
    const std::vector<double> k = as_double(std::vector<T>(hk_.begin(), hk_.begin() + static_cast<std::ptrdiff_t>(kn)));
    const std::vector<double> v = as_double(std::vector<T>(hv_.begin(), hv_.begin() + static_cast<std::ptrdiff_t>(kn)));
    for (std::int32_t l = 0; l < W::kLayers; ++l) reference::write<double>(host_pool(l), k, v, host.step_rows(W::window_of_layer(l)));
  }

  // Keys of the step's token t drawn from [-1, 1) and scaled by 1 + key_ramp t: scores that grow
  // along a prompt, so that a row's maximum jumps from one KV tile to the next.
  double key_ramp = 0;

  // New random inputs for the step (width rows; the real tokens are the first T).
  void new_inputs(std::int32_t width, std::mt19937_64& rng) {
    const auto qn = static_cast<std::size_t>(width * heads_q_ * shape_.head_dim);
    const auto kn = static_cast<std::size_t>(width) * kv_row();
    hq_ = random_values<T>(qn, rng);
    hk_ = random_values<T>(kn, rng);
    if (key_ramp > 0)
      for (std::size_t i = 0; i < kn; ++i)
        hk_[i] = from_double<T>(to_double(hk_[i]) * (1.0 + key_ramp * static_cast<double>(i / kv_row())));
    hv_ = random_values<T>(kn, rng);
    // DeviceArray waits for the device first: the last step's kernels may still read q, k and v.
    q_.upload(hq_);
    k_.upload(hk_);
    v_.upload(hv_);
    out_.fill(poison<T>());
  }

  // One checked step of the placed T tokens: new inputs, upload, forward, commit, wait. Returns
  // the worst relative error against the host reference.
  double checked_step(std::int32_t T, std::mt19937_64& rng, ::cuda::stream_ref stream) {
    new_inputs(T, rng);
    REQUIRE(cache_.upload(stream).ok());
    device_forward(T, stream);
    REQUIRE(cache_.commit(stream).ok());
    REQUIRE(cudaStreamSynchronize(stream.get()) == cudaSuccess);
    return check_against_reference();
  }

  // The host reference of the placed step (T real tokens) for every layer; compares with the
  // device outputs of those tokens. Returns the worst relative error.
  double check_against_reference() {
    const auto& host = cache_.host();
    const std::int32_t T_tokens = host.step().tokens;
    const auto qn = static_cast<std::size_t>(T_tokens * heads_q_ * shape_.head_dim);
    const auto kn = static_cast<std::size_t>(T_tokens) * kv_row();
    const std::vector<double> q = as_double(std::vector<T>(hq_.begin(), hq_.begin() + static_cast<std::ptrdiff_t>(qn)));
    const std::vector<double> k = as_double(std::vector<T>(hk_.begin(), hk_.begin() + static_cast<std::ptrdiff_t>(kn)));
    const std::vector<double> v = as_double(std::vector<T>(hv_.begin(), hv_.begin() + static_cast<std::ptrdiff_t>(kn)));
    const std::vector<T> got_all = out_.download();
    double worst = 0;
    for (std::int32_t l = 0; l < W::kLayers; ++l) {
      std::vector<double> want(qn);
      REQUIRE(reference::update_and_attend<std::remove_cvref_t<decltype(host)>, double>(
                  host, W::window_of_layer(l), host_pool(l), q, k, v, want, heads_q_, reference::default_scale(shape_.head_dim))
                  .ok());
      const auto first = got_all.begin() + static_cast<std::ptrdiff_t>(out_offset(l));
      worst = std::max(worst, compare_outputs(std::vector<T>(first, first + static_cast<std::ptrdiff_t>(qn)), want,
                                              shape_.head_dim));
    }
    return worst;
  }

  // The device outputs of the step's real tokens, every layer: [layers][T, H_q, D] as double.
  std::vector<double> outputs() const {
    const auto n = static_cast<std::size_t>(cache_.host().step().tokens * heads_q_ * shape_.head_dim);
    const std::vector<T> all = out_.download();
    std::vector<double> out;
    for (std::int32_t l = 0; l < W::kLayers; ++l)
      for (std::size_t i = 0; i < n; ++i) out.push_back(to_double(all[out_offset(l) + i]));
    return out;
  }

  // Outputs of the padding rows [T, width) of every layer: must be exactly zero.
  bool padding_rows_are_zero(std::int32_t width) {
    const std::int32_t T_tokens = cache_.host().step().tokens;
    const std::vector<T> got_all = out_.download();
    const auto row = static_cast<std::size_t>(heads_q_ * shape_.head_dim);
    for (std::int32_t l = 0; l < W::kLayers; ++l)
      for (std::size_t i = static_cast<std::size_t>(T_tokens) * row; i < static_cast<std::size_t>(width) * row; ++i)
        if (to_double(got_all[out_offset(l) + i]) != 0.0) return false;
    return true;
  }

  // K re-rotations of moved cells (after the copies), applied to the host pools too: the host's
  // float64 rotation of rope.hpp, the oracle of the device's.
  void mirror_rotations(const std::vector<RowRotation>& rotations, const RopeSpec& spec) {
    for (std::int32_t l = 0; l < W::kLayers; ++l) rerotate_keys<double>(host_pool(l), rotations, spec);
  }

  // Every pool's pending copies, then its K re-rotations (with `spec`; none without), applied to
  // the host pools of that pool's layers (window storage: each window pool's changes its own).
  void mirror_pending_changes(const RopeSpec* spec) {
    const auto& host = cache_.host();
    for (std::int32_t l = 0; l < W::kLayers; ++l) {
      const std::int32_t w = W::window_of_layer(l);
      const PendingChanges c = host.pool(w).pending_changes();  // the main pool's for window 0 or full storage
      for (const RowCopy& copy : c.copies) copy_rows(l, copy);
      if (spec != nullptr) rerotate_keys<double>(host_pool(l), c.rotations, *spec);
    }
  }

  // Fork copies of the sequence layout (and copy-on-write cells of the cell layout), applied to
  // the host pools too.
  void mirror_copies(const std::vector<RowCopy>& copies) {
    for (const RowCopy& c : copies)
      for (std::int32_t l = 0; l < W::kLayers; ++l) copy_rows(l, c);
  }

 private:
  // Rows of layer l's pool (window storage: its window's pool).
  std::int64_t rows_of(std::int32_t l) const { return cache_.host().pool_rows(W::window_of_layer(l)); }
  PoolView<double> host_pool(std::int32_t l) {
    return {host_k_[static_cast<std::size_t>(l)].data(), host_v_[static_cast<std::size_t>(l)].data(), rows_of(l),
            shape_.heads_kv, shape_.head_dim};
  }
  void copy_rows(std::int32_t l, const RowCopy& c) {
    for (auto* pool : {&host_k_[static_cast<std::size_t>(l)], &host_v_[static_cast<std::size_t>(l)]})
      std::copy_n(pool->begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(c.src_row) * kv_row()),
                  static_cast<std::size_t>(c.rows) * kv_row(),
                  pool->begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(c.dst_row) * kv_row()));
  }

  std::size_t kv_row() const { return static_cast<std::size_t>(shape_.heads_kv * shape_.head_dim); }
  std::size_t out_offset(std::int32_t layer) const { return static_cast<std::size_t>(layer) * q_.buf.size(); }

  Cache& cache_;
  std::int32_t heads_q_;
  gpu::PoolShape shape_;
  DeviceArray<T> q_, k_, v_, out_;  // out_: [layers][max_width, H_q, D]
  std::vector<T> hq_, hk_, hv_;
  std::vector<std::vector<double>> host_k_, host_v_;  // [layer][rows * H_kv * D]
};

// Random traffic for a cache: occasionally a verb (new, clone, remove, rewind), then a declared
// step over live sequences of 1..max_width tokens. Removes sequences until the step fits.
// Returns the placed step's token count.
template <class Host, class Cache>
std::int32_t random_step(Cache& cache, std::int32_t max_width, std::mt19937_64& rng) {
  auto pick = [&](std::int32_t n) { return static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(n)); };
  const Host& host = cache.host();
  auto live = [&] {
    std::vector<std::int32_t> ids;
    host.live_sequences().for_each([&](std::int32_t s) { ids.push_back(s); });
    return ids;
  };
  auto any_live = [&] { const auto ids = live(); return ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))]; };
  if (live().empty()) REQUIRE(cache.seq_new().ok());
  switch (pick(8)) {
    case 0: (void)cache.seq_new(); break;
    case 1: { const auto s = any_live(); (void)cache.seq_clone(s, pick(host.pos(s).value() + 1)); break; }
    case 2: if (live().size() > 1) REQUIRE(cache.seq_rm(any_live()).ok()); break;
    case 3: { const auto s = any_live(); REQUIRE(cache.rewind(s, pick(host.pos(s).value() + 1)).ok()); break; }
    default: break;
  }
  for (;;) {
    const auto ids = live();
    std::vector<std::int32_t> step(static_cast<std::size_t>(1 + pick(max_width)));
    for (auto& s : step) s = ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))];
    if (cache.declare_step(step).ok()) return static_cast<std::int32_t>(step.size());
    REQUIRE(cache.seq_rm(ids[static_cast<std::size_t>(pick(static_cast<std::int32_t>(ids.size())))]).ok());
    if (live().empty()) REQUIRE(cache.seq_new().ok());
  }
}

}  // namespace cellkv::test
