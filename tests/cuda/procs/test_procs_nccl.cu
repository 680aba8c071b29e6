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
    for (const char* layout : {"cell", "sequence"})
      for (const char* mode : {"", "--eager"}) {
        const Run r = demo(std::string("--ranks 2 --check-plans on --layout ") + layout + " " + mode, env);
        INFO(env << " " << layout << " " << mode << ": " << r.output);
        CHECK(r.exit_status == 0);
        CHECK(has(r, kOk));
        CHECK(has(r, "2 ranks over NCCL"));
      }
}

TEST_CASE("procs nccl: ranks started by hand meet through tcp:HOST:PORT and file:DIR") {
  const std::string tcp = std::string(CELLKV_TP_DEMO) + " --world 2 --rendezvous tcp:127.0.0.1:" + free_port();
  ranks_by_hand_agree({tcp + " --rank 1", tcp + " --rank 0"}, 1);
  const RendezvousDir dir;
  const std::string file = std::string(CELLKV_TP_DEMO) + " --world 2 --layout sequence --rendezvous " + dir.spec();
  ranks_by_hand_agree({file + " --rank 0", file + " --rank 1"}, 0);
}

TEST_CASE("procs nccl: a rank that dies makes the other fail within its timeout") {
  const Run r = demo("--ranks 2 --die-at-step 6 --timeout-ms 5000");
  INFO(r.output);
  CHECK(r.exit_status == 1);
  CHECK(has(r, "cellkv tp demo: rank 1: killed by signal 9"));
  CHECK(has(r, "rank 0: a step failed"));
  CHECK(!has(r, "killed by the launcher"));
  CHECK(!has(r, kOk));
}

TEST_CASE("procs nccl: a rank that hangs makes the other abort its communicator and fail after its timeout") {
  const Run r = demo("--ranks 2 --hang-at-step 6 --timeout-ms 5000");
  INFO(r.output);
  CHECK(r.exit_status == 1);
  CHECK(has(r, "rank 0: a step failed"));
  CHECK(has(r, "communicator aborted"));
  CHECK(has(r, "cellkv tp demo: rank 1: killed by the launcher"));
  CHECK(!has(r, kOk));
}
