// Tensor parallelism with one process per rank over NCCL, one GPU each (needs 2 GPUs; skipped with
// fewer): cellkv-tp-demo's ranks generate what the whole model does on one GPU (the demo checks
// every token) with NCCL's defaults and with P2P disabled, graphs and eager, both layouts, with a
// fork; ranks started by hand meet through tcp:HOST:PORT (NCCL's own bootstrap) and file:DIR; a
// rank that dies or hangs makes the other abort its communicator and fail within its timeout.
#include <doctest/doctest.h>

#include <string>

#include "demo_runs.hpp"

namespace {

using namespace cellkv::test::procs;

}  // namespace

TEST_CASE("procs nccl: 2 processes, one GPU each, generate what the single-GPU model does") {
  for (const char* env : {"", "NCCL_P2P_DISABLE=1"})
    for (const std::string layout : {"cell", "sequence"})
      for (const std::string mode : {"", " --eager"})
        check_ends("--ranks 2 --check-plans on --layout " + layout + mode, 0, {kOk, "2 ranks over NCCL"}, {}, env);
}

TEST_CASE("procs nccl: ranks started by hand meet through tcp:HOST:PORT and file:DIR") {
  const std::string tcp = std::string(CELLKV_TP_DEMO) + " --world 2 --rendezvous tcp:127.0.0.1:" + free_port();
  ranks_by_hand_agree({tcp + " --rank 1", tcp + " --rank 0"}, 1);
  const RendezvousDir dir;
  const std::string file = std::string(CELLKV_TP_DEMO) + " --world 2 --layout sequence --rendezvous " + dir.spec();
  ranks_by_hand_agree({file + " --rank 0", file + " --rank 1"}, 0);
}

TEST_CASE("procs nccl: a rank that dies makes the other fail within its timeout") {
  check_ends("--ranks 2 --die-at-step 6 --timeout-ms 5000", 1,
             {"cellkv tp demo: rank 1: killed by signal 9", "rank 0: a step failed"}, {"killed by the launcher"});
}

TEST_CASE("procs nccl: a rank that hangs makes the other abort its communicator and fail after its timeout") {
  check_ends("--ranks 2 --hang-at-step 6 --timeout-ms 5000", 1,
             {"rank 0: a step failed", "communicator aborted", "cellkv tp demo: rank 1: killed by the launcher"});
}
