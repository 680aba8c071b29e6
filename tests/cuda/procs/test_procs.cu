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
  for (const char* layout : {"cell", "sequence"})
    for (const char* mode : {"", "--eager"}) {
      const Run r = demo(std::string("--ranks 2 --comm ipc --check-plans on --layout ") + layout + " " + mode);
      INFO(r.output);
      CHECK(r.exit_status == 0);
      CHECK(has(r, kOk));
      CHECK(has(r, std::string("2 ranks over CUDA IPC on one GPU, ") + layout + " layout"));
      if (std::string(mode).empty()) {
        CHECK(has(r, "CUDA graphs; "));
        CHECK(!has(r, " 0 replays"));  // steps replayed captured graphs (the broadcast and meetings inside)
      } else {
        CHECK(has(r, "eager; "));
      }
    }
}

TEST_CASE("procs: 4 ranks on one GPU generate what the single-GPU model does") {
  const Run r = demo("--ranks 4 --comm ipc --check-plans on");
  INFO(r.output);
  CHECK(r.exit_status == 0);
  CHECK(has(r, kOk));
  CHECK(has(r, "4 ranks over CUDA IPC"));
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
  const Run r = demo("--ranks 2 --comm ipc --die-at-step 6 --timeout-ms 5000");
  INFO(r.output);
  CHECK(r.exit_status == 1);
  CHECK(has(r, "cellkv tp demo: rank 1: killed by signal 9"));
  CHECK(has(r, "rank 0: a step failed"));
  CHECK(has(r, "rank 1 (pid"));  // rank 0 names the rank whose process is gone
  CHECK(!has(r, "killed by the launcher"));  // rank 0 ended on its own
  CHECK(!has(r, kOk));
}

TEST_CASE("procs: a rank that hangs makes the others fail after their timeout; the launcher then kills it") {
  const Run r = demo("--ranks 2 --comm ipc --hang-at-step 6 --timeout-ms 3000");
  INFO(r.output);
  CHECK(r.exit_status == 1);
  CHECK(has(r, "rank 0: a step failed"));
  CHECK(has(r, "within 3000 ms"));
  CHECK(has(r, "cellkv tp demo: rank 0: exit 1"));
  CHECK(has(r, "cellkv tp demo: rank 1: killed by the launcher"));
  CHECK(!has(r, kOk));
}

TEST_CASE("procs: a rank that is never started makes the others fail after their timeout") {
  const RendezvousDir dir;
  const Run r = demo("--comm ipc --rank 0 --world 2 --timeout-ms 1500 --rendezvous " + dir.spec());
  INFO(r.output);
  CHECK(r.exit_status == 1);
  CHECK(has(r, "rank 0: could not join the group"));
  CHECK(has(r, "after 1500 ms"));
}

TEST_CASE("procs: an NCCL rank whose peer never starts fails to join after its timeout (the join is aborted)") {
  const RendezvousDir dir;
  const Run r = demo("--rank 0 --world 2 --timeout-ms 3000 --rendezvous " + dir.spec());
  INFO(r.output);
  CHECK(r.exit_status == 1);
  CHECK(has(r, "rank 0: could not join the group"));
  CHECK(has(r, "ncclCommInitRankConfig did not complete within 3000 ms"));
  CHECK(std::filesystem::exists(dir.path / "nccl-id"));  // it published NCCL's id for the peer
}

TEST_CASE("procs: ranks whose plans diverge are stopped at that step by the plan digest") {
  const Run r = demo("--ranks 2 --comm ipc --check-plans on --diverge-at-step 5");
  INFO(r.output);
  CHECK(r.exit_status == 1);
  CHECK(has(r, "rank 0: the ranks' step plans differ"));
  CHECK(has(r, "rank 1: the ranks' step plans differ"));
  CHECK(!has(r, kOk));
}

TEST_CASE("procs: NCCL with one rank: the launcher's env rendezvous, file:DIR and tcp:HOST:PORT") {
  const Run launched = demo("--ranks 1 --check-plans on");
  INFO(launched.output);
  CHECK(launched.exit_status == 0);
  CHECK(has(launched, "1 ranks over NCCL"));
  CHECK(has(launched, kOk));
  const RendezvousDir dir;
  const Run by_file = demo("--rank 0 --world 1 --layout sequence --rendezvous " + dir.spec());
  INFO(by_file.output);
  CHECK(by_file.exit_status == 0);
  CHECK(has(by_file, kOk));
  CHECK(std::filesystem::exists(dir.path / "nccl-id"));  // rank 0 published NCCL's id there
  const Run by_tcp = demo("--rank 0 --world 1 --eager --rendezvous tcp:127.0.0.1:" + free_port());
  INFO(by_tcp.output);
  CHECK(by_tcp.exit_status == 0);
  CHECK(has(by_tcp, kOk));
}

TEST_CASE("procs: bad arguments and worlds the machine or the model cannot hold are refused") {
  for (const char* bad : {"", "--ranks 0", "--ranks 65", "--ranks x", "--comm mpi --ranks 2", "--layout paged --ranks 2",
                          "--rank 2 --world 2 --rendezvous env", "--rank 0 --world 2", "--rank 0 --world 2 --rendezvous nfs:/x",
                          "--ranks 2 --rank 0 --world 2", "--timeout-ms 0 --ranks 2", "--check-plans maybe --ranks 2"}) {
    const Run r = demo(bad);
    INFO(bad << ": " << r.output);
    CHECK(r.exit_status == 2);
    CHECK(has(r, "usage: cellkv-tp-demo"));
  }
  // 3 ranks do not split the model's 4 KV heads: every rank refuses, the launcher reports it.
  const Run three = demo("--ranks 3 --comm ipc");
  INFO(three.output);
  CHECK(three.exit_status == 1);
  CHECK(has(three, "3 ranks do not split 4 KV heads"));
  CHECK(has(three, "rank 0: exit 2"));
  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  if (devices < 2) {  // NCCL needs a GPU per rank
    const Run nccl = demo("--ranks 2");
    INFO(nccl.output);
    CHECK(nccl.exit_status == 77);
    CHECK(has(nccl, "need 2 GPUs"));
  }
}
