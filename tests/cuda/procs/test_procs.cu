// Tensor parallelism with one process per rank, on one GPU: the ranks of cellkv-tp-demo share GPU 0
// through CUDA IPC (NCCL refuses two ranks on one device), so every piece but NCCL's transport runs
// here: the launcher, the file rendezvous, rank 0's sampled ids broadcast to every rank, the plan
// digest compared across ranks each step, bounded waits. Each run's tokens are checked by the demo
// against the whole model on one GPU (the oracle); graphs and eager, both layouts, a fork, 2 and 4
// ranks; ranks started by hand and by a job launcher's environment; a rank that dies, one that
// hangs, and ranks whose plans diverge end with the expected errors. NCCL itself runs with one rank (the env, file
// and tcp rendezvous); two NCCL ranks need two GPUs (test_procs_nccl.cu).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <string>

#include "demo_runs.hpp"

namespace {

using namespace cellkv::test::procs;

}  // namespace

TEST_CASE("procs: 2 ranks on one GPU (CUDA IPC) generate what the single-GPU model does") {
  for (const std::string layout : {"cell", "sequence"}) {
    const std::string ranks = "2 ranks over CUDA IPC on one GPU, " + layout + " layout, ";
    // Graphs: steps replay captured graphs, the broadcast and the meetings inside them.
    check_ends("--ranks 2 --comm ipc --check-plans on --layout " + layout, 0, {kOk, ranks + "CUDA graphs; "},
               {" 0 replays"});
    check_ends("--ranks 2 --comm ipc --check-plans on --eager --layout " + layout, 0, {kOk, ranks + "eager; "});
  }
}

TEST_CASE("procs: 4 ranks on one GPU generate what the single-GPU model does") {
  check_ends("--ranks 4 --comm ipc --check-plans on", 0, {kOk, "4 ranks over CUDA IPC"});
}

TEST_CASE("procs: ranks started by hand, and from an mpirun-style environment, meet through file:DIR") {
  {
    const RendezvousDir dir;
    const std::string common = std::string(CELLKV_TP_DEMO) + " --comm ipc --world 2 --rendezvous " + dir.spec();
    ranks_by_hand_agree({common + " --rank 1", common + " --rank 0"}, 1);
  }
  {
    const RendezvousDir dir;
    auto rank = [&](int r) {
      return "OMPI_COMM_WORLD_RANK=" + std::to_string(r) + " OMPI_COMM_WORLD_SIZE=2 CELLKV_TP_RENDEZVOUS=" + dir.spec() +
             " " + CELLKV_TP_DEMO + " --comm ipc --layout sequence";
    };
    ranks_by_hand_agree({rank(0), rank(1)}, 0);
  }
}

TEST_CASE("procs: a rank that dies makes the others fail within their timeout, with an error naming it") {
  // Rank 0 names the rank whose process is gone and ends on its own (the launcher kills nobody).
  check_ends("--ranks 2 --comm ipc --die-at-step 6 --timeout-ms 5000", 1,
             {"cellkv tp demo: rank 1: killed by signal 9", "rank 0: a step failed", "rank 1 (pid"},
             {"killed by the launcher"});
}

TEST_CASE("procs: a rank that hangs makes the others fail after their timeout; the launcher then kills it") {
  check_ends("--ranks 2 --comm ipc --hang-at-step 6 --timeout-ms 3000", 1,
             {"rank 0: a step failed", "within 3000 ms", "cellkv tp demo: rank 0: exit 1",
              "cellkv tp demo: rank 1: killed by the launcher"});
}

TEST_CASE("procs: a rank that is never started makes the others fail after their timeout") {
  const RendezvousDir dir;
  check_ends("--comm ipc --rank 0 --world 2 --timeout-ms 1500 --rendezvous " + dir.spec(), 1,
             {"rank 0: could not join the group", "after 1500 ms"});
  // Over NCCL: rank 0 publishes NCCL's id for its peer, then aborts the join when the timeout passes.
  const RendezvousDir nccl_dir;
  check_ends("--rank 0 --world 2 --timeout-ms 3000 --rendezvous " + nccl_dir.spec(), 1,
             {"rank 0: could not join the group", "ncclCommInitRankConfig did not complete within 3000 ms"});
  CHECK(std::filesystem::exists(nccl_dir.path / "nccl-id"));
}

TEST_CASE("procs: ranks whose plans diverge are stopped at that step by the plan digest") {
  check_ends("--ranks 2 --comm ipc --check-plans on --diverge-at-step 5", 1,
             {"rank 0: the ranks' step plans differ", "rank 1: the ranks' step plans differ"});
}

TEST_CASE("procs: NCCL with one rank: the launcher's env rendezvous, file:DIR and tcp:HOST:PORT") {
  check_ends("--ranks 1 --check-plans on", 0, {kOk, "1 ranks over NCCL"});
  const RendezvousDir dir;
  check_ends("--rank 0 --world 1 --layout sequence --rendezvous " + dir.spec(), 0, {kOk});
  CHECK(std::filesystem::exists(dir.path / "nccl-id"));  // rank 0 published NCCL's id there
  check_ends("--rank 0 --world 1 --eager --rendezvous tcp:127.0.0.1:" + free_port(), 0, {kOk});
}

TEST_CASE("procs: bad arguments and worlds the machine or the model cannot hold are refused") {
  for (const char* bad : {"", "--ranks 0", "--ranks 65", "--ranks x", "--comm mpi --ranks 2", "--layout paged --ranks 2",
                          "--rank 2 --world 2 --rendezvous env", "--rank 0 --world 2", "--rank 0 --world 2 --rendezvous nfs:/x",
                          "--ranks 2 --rank 0 --world 2", "--timeout-ms 0 --ranks 2", "--check-plans maybe --ranks 2"})
    check_ends(bad, 2, {"usage: cellkv-tp-demo"});
  // 3 ranks do not split the model's 4 KV heads: every rank refuses, the launcher reports it.
  check_ends("--ranks 3 --comm ipc", 1, {"3 ranks do not split 4 KV heads", "rank 0: exit 2"});
  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  if (devices < 2) check_ends("--ranks 2", 77, {"need 2 GPUs"});  // NCCL needs a GPU per rank
}
