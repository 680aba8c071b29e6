// The sharded cache and the tensor-parallel model on one GPU: G shards share device 0 (separate
// pools, step buffers and streams, one host thread per rank) and a plain device sum stands in
// for NCCL's all-reduce, which refuses two ranks on one device. tests/cuda/nccl runs the same
// checks with one shard per GPU over NCCL. Also: every refusal of ShardedCache changes nothing;
// the executor's context shift is refused until every shard has a key rotation.
#include <doctest/doctest.h>

#include <stdexcept>
#include <vector>

#include "cellkv/gpu/key_rotation.cuh"
#include "cellkv/rope.hpp"
#include "tp_checks.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test::tp;

}  // namespace

TEST_CASE("sharded cache, 2 shards on one GPU: step buffers, pools and attention equal the single cache (cells)") {
  sharded_buffers_equal_single<layout::cell>({0, 0});
}

TEST_CASE("sharded cache, 2 shards on one GPU: step buffers, pools and attention equal the single cache (sequence)") {
  sharded_buffers_equal_single<layout::sequence>({0, 0});
}

TEST_CASE("sharded cache, 2 shards on one GPU, window storage: step buffers, window pools and attention equal the single cache") {
  sharded_buffers_equal_single<layout::cell>({0, 0}, 400);
}

TEST_CASE("sharded cache, 1 shard: the degenerate split equals the single cache") {
  sharded_buffers_equal_single<layout::cell>({0});
}

TEST_CASE_TEMPLATE("tensor-parallel model on one GPU: G = 1 and G = 2 generate what the single-GPU model does", L,
                   layout::cell, layout::sequence) {
  const auto want = single_gpu_outputs<L, placement::clustered<64>>();
  llama::DeviceSumReduce<float> one(1), two(2);
  CHECK(tensor_parallel_outputs<L, placement::clustered<64>>({0}, one) == want);
  CHECK(tensor_parallel_outputs<L, placement::clustered<64>>({0, 0}, two) == want);
}

TEST_CASE("sharded cache refusals: bad construction throws; bad calls return a status and change nothing") {
  using C = gpu::ShardedCache<layout::cell, float, Layers, placement::lowest_free, 16>;
  CHECK_THROWS_AS(C(kCacheConfig, kShape, std::vector<int>{}), std::invalid_argument);
  CHECK_THROWS_AS(C(kCacheConfig, kShape, std::vector<int>{0, 0, 0}), std::invalid_argument);  // 2 KV heads over 3
  CHECK_THROWS_AS(C(CacheConfig{}, kShape, std::vector<int>{0}), std::invalid_argument);

  C cache(kCacheConfig, kShape, std::vector<int>{0, 0});
  const auto streams = shard_streams(cache);
  const std::vector<::cuda::stream_ref> refs{streams[0]->ref(), streams[1]->ref()};
  CHECK(cache.upload(refs) == Errc::no_step_declared);
  const std::int32_t id = cache.seq_new().value();
  const std::vector<std::int32_t> ids{id, id, id};
  REQUIRE(cache.declare_step(ids).ok());
  CHECK(cache.upload(std::span(refs).first(1)) == Errc::bad_shape);  // one stream for two shards
  CHECK(cache.upload(refs, 2) == Errc::bad_shape);                    // narrower than the step
  CHECK(cache.upload(refs, kCacheConfig.max_write + 1) == Errc::bad_shape);
  CHECK(cache.upload_shard(2, refs[0]) == Errc::bad_argument);
  CHECK(cache.upload_shard(-1, refs[0]) == Errc::bad_argument);
  CHECK(cache.commit(refs) == Errc::no_step_declared);
  for (std::int32_t g = 0; g < 2; ++g) CHECK(cache.shard(g).width() == 0);  // nothing was uploaded

  REQUIRE(cache.upload_shard(0, refs[0]).ok());
  CHECK(cache.commit(refs) == Errc::no_step_declared);  // shard 1 has not uploaded: nothing ends
  CHECK(cache.shard(0).width() == 3);
  REQUIRE(cache.upload_shard(1, refs[1], 4).ok());
  CHECK(cache.commit(std::span(refs).first(1)) == Errc::bad_shape);
  REQUIRE(cache.commit(refs).ok());
  CHECK(cache.commit(refs) == Errc::no_step_declared);  // already ended

  llama::DeviceSumReduce<float> two(2);
  llama::Config uneven = kConfig;
  uneven.ffn = 97;  // MLP columns do not split over 2 ranks
  CHECK_THROWS_AS(llama::TpLlama<C>(uneven, llama::generate(uneven), cache, two), std::invalid_argument);
  CHECK_THROWS_AS(llama::DeviceSumReduce<float>(0), std::invalid_argument);
  CHECK_THROWS_AS(llama::DeviceSumReduce<float>(-1), std::invalid_argument);
  CHECK_THROWS_AS(llama::DeviceSumReduce<float>(9), std::invalid_argument);
  test::require_device_ok();
}

TEST_CASE("sharded cache: a bad row in one shard's step block is reported once by the next commit, then upload") {
  using C = gpu::ShardedCache<layout::cell, __nv_bfloat16, Layers, placement::lowest_free, 16>;
  C cache(kCacheConfig, kShape, std::vector<int>{0, 0});
  const auto streams = shard_streams(cache);
  const std::vector<::cuda::stream_ref> refs{streams[0]->ref(), streams[1]->ref()};
  const std::int32_t id = cache.seq_new().value();
  const std::vector<std::int32_t> ids{id, id, id};
  // Shard 1 holds one KV head of D = 64: k, v [3, 1, 64].
  test::DeviceArray<__nv_bfloat16> k(3 * 64), v(3 * 64);
  k.fill(__float2bfloat16(1.f));
  v.fill(__float2bfloat16(2.f));
  const std::int64_t bad = kCacheConfig.max_cells + 1 + 100;  // past the scratch row: layer 0's V row 100
  const auto storage = cache.shard(1).pool().storage();
  REQUIRE(cudaMemset(storage.data(), 0xff, storage.size_bytes()) == cudaSuccess);
  auto plant_and_write = [&] {
    REQUIRE(cache.declare_step(ids).ok());
    REQUIRE(cache.upload(refs).ok());
    for (const auto& s : streams) s->synchronize();
    REQUIRE(cudaMemcpy(cache.shard(1).bindings().cells + 2, &bad, sizeof bad, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cache.shard(1).write(0, k.data(), v.data(), 3, refs[1]).ok());
    streams[1]->synchronize();
  };

  plant_and_write();
  CHECK(cache.commit(refs) == Errc::bad_device_row);
  for (std::int32_t g = 0; g < 2; ++g) CHECK(cache.shard(g).width() == 3);  // no shard ended the step
  REQUIRE(cache.commit(refs).ok());  // reported once

  plant_and_write();
  REQUIRE(cache.declare_step(ids).ok());
  CHECK(cache.upload(refs) == Errc::bad_device_row);
  for (std::int32_t g = 0; g < 2; ++g) CHECK(cache.shard(g).width() == 0);  // no shard uploaded
  REQUIRE(cache.upload(refs).ok());
  REQUIRE(cache.commit(refs).ok());

  // The bad token's K and V went to the scratch rows of layer 0; layer 0's V row 100, where the
  // unchecked K write would have landed, is still poison (no token of the test wrote it).
  std::vector<__nv_bfloat16> all(storage.size());
  REQUIRE(cudaMemcpy(all.data(), storage.data(), all.size() * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  const std::size_t per_tensor = static_cast<std::size_t>(kCacheConfig.max_cells + 1) * 64;
  const std::size_t scratch = static_cast<std::size_t>(kCacheConfig.max_cells) * 64;
  CHECK(__bfloat162float(all[scratch]) == 1.f);               // layer 0 K, scratch row
  CHECK(__bfloat162float(all[per_tensor + scratch]) == 2.f);  // layer 0 V, scratch row
  const std::size_t landing = per_tensor + static_cast<std::size_t>(bad - kCacheConfig.max_cells - 1) * 64;
  for (std::size_t i = landing; i < landing + 64; ++i) CHECK(test::is_poison(all[i]));
  test::require_device_ok();
}

TEST_CASE("sharded cache: the executor's context shift is refused until the shards have a key rotation") {
  using C = gpu::ShardedCache<layout::cell, float, Layers, placement::lowest_free, 16>;
  C cache(kCacheConfig, kShape, std::vector<int>{0, 0});
  const batching::SessionLimits limits{.max_write = kCacheConfig.max_write, .min_prefill_tokens = 2,
                                       .max_tokens_per_session = 40, .context_shift = {.enabled = true, .keep = 4}};
  CHECK(batching::SessionTable<C>::validate(limits, cache) == Errc::no_key_rotation);
  REQUIRE(cache.set_key_rotation(gpu::KeyRotation<float>::rope(RopeSpec{.pairs = RopePairs::interleaved})).ok());
  CHECK(batching::SessionTable<C>::validate(limits, cache).ok());
}
