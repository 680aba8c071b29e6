// Tensor parallelism over NCCL, one shard per GPU (needs 2 devices; skipped otherwise): the
// sharded step buffers equal the single-device ones, and the tensor-parallel model with NCCL's
// all-reduce (G = 1 and G = 2, CUDA graphs on and off) generates what the single-GPU model does,
// token for token. NCCL's NVLink multicast stays off (NcclReduce sets NCCL_NVLS_ENABLE=0).
#include <doctest/doctest.h>

#include <vector>

#include "llama/nccl_reduce.cuh"
#include "tp_checks.cuh"

namespace {

using namespace cellkv;
using namespace cellkv::test::tp;

}  // namespace

TEST_CASE("nccl: sharded step buffers, pools and attention on 2 GPUs equal the single cache (cells)") {
  sharded_buffers_equal_single<layout::cell>({0, 1});
}

TEST_CASE("nccl: sharded step buffers, pools and attention on 2 GPUs equal the single cache (sequence)") {
  sharded_buffers_equal_single<layout::sequence>({0, 1});
}

TEST_CASE_TEMPLATE("nccl: the tensor-parallel model on 1 and 2 GPUs generates what the single-GPU model does", L,
                   layout::cell, layout::sequence) {
  const auto want = single_gpu_outputs<L, placement::clustered<64>>();
  const std::vector<int> one{0}, two{0, 1};
  llama::NcclReduce<float> reduce_one(one), reduce_two(two);
  CHECK(tensor_parallel_outputs<L, placement::clustered<64>>(one, reduce_one) == want);
  CHECK(tensor_parallel_outputs<L, placement::clustered<64>>(two, reduce_two) == want);                     // graphs
  CHECK(tensor_parallel_outputs<L, placement::clustered<64>>(two, reduce_two, {.graphs = false}) == want);  // eager
}
