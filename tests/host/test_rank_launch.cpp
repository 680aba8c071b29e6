// Starting tensor-parallel ranks as processes, on the host: the rendezvous (file:DIR values appear
// whole or not at all, a second publish of a name is refused, also between processes publishing at
// once, a missing value times out; env values round-trip as hex; tcp carries nothing itself; bad
// specs and names are refused), the rank and world a job launcher's environment describes (Open
// MPI, Slurm, PMI; malformed or inconsistent values refused), and the launcher, run over /bin/sh
// children whose exits are known in advance: every exit status and signal reported per rank, a rank
// still running after another failed killed once the grace period ends, a program that cannot be
// executed reported as exit 127, no rank left running when args throws, and ignored SIGCHLD refused.
#include <doctest/doctest.h>

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "llama/rank_launcher.hpp"
#include "llama/rank_world.hpp"
#include "llama/rendezvous.hpp"

namespace {

using namespace std::chrono_literals;

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> out;
  for (const char c : s) out.push_back(static_cast<std::byte>(c));
  return out;
}

// An empty directory, removed at the end of the scope.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/cellkv-rendezvous-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("rendezvous: hex round-trips every byte value; malformed hex is refused") {
  std::vector<std::byte> all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<std::byte>(b));
  const std::string hex = llama::to_hex(all);
  CHECK(hex.size() == 512);
  CHECK(hex.substr(0, 6) == "000102");
  CHECK(hex.substr(506) == "fdfeff");
  CHECK(llama::from_hex(hex) == all);
  CHECK(llama::from_hex("ABcd") == std::vector<std::byte>{std::byte{0xab}, std::byte{0xcd}});
  CHECK_THROWS_AS(llama::from_hex("abc"), std::invalid_argument);
  CHECK_THROWS_AS(llama::from_hex("zz"), std::invalid_argument);
}

TEST_CASE("rendezvous: specs are parsed or refused") {
  CHECK(llama::Rendezvous("file:/x/y").kind() == llama::Rendezvous::Kind::file);
  CHECK(llama::Rendezvous("file:/x/y").where() == "/x/y");
  CHECK(llama::Rendezvous("env").kind() == llama::Rendezvous::Kind::env);
  CHECK(llama::Rendezvous("tcp:10.0.0.1:29500").where() == "10.0.0.1:29500");
  CHECK(llama::Rendezvous("tcp:node-1:1").kind() == llama::Rendezvous::Kind::tcp);
  for (const char* bad : {"", "file:", "files:/x", "env:", "tcp:", "tcp:host", "tcp::29500", "tcp:host:", "tcp:host:0",
                          "tcp:host:65536", "tcp:host:12a", "tcp:host:123456", "nfs:/x"})
    CHECK_THROWS_AS(llama::Rendezvous{bad}, std::invalid_argument);
}

TEST_CASE("rendezvous: file:DIR publishes whole values once and times out on missing ones") {
  const TempDir dir;
  const llama::Rendezvous r("file:" + dir.path.string());
  const auto id = bytes_of("the id of the job, 32 bytes long");
  r.publish("nccl-id", id);
  CHECK(r.fetch("nccl-id", id.size(), 0ms) == id);
  CHECK(std::filesystem::exists(dir.path / "nccl-id"));
  // Nothing temporary is left behind, and a second publish (a previous job's value) is refused.
  CHECK(std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator{}) == 1);
  CHECK_THROWS_AS(r.publish("nccl-id", id), std::runtime_error);
  CHECK(r.fetch("nccl-id", id.size(), 0ms) == id);
  // An empty value is a value (a "ready" mark).
  r.publish("ready", {});
  CHECK(r.fetch("ready", 0, 0ms).empty());
  // Missing, or of another size: refused after the timeout.
  CHECK_THROWS_AS((void)r.fetch("missing", 4, 50ms), std::runtime_error);
  CHECK_THROWS_AS((void)r.fetch("nccl-id", id.size() + 1, 0ms), std::runtime_error);
  // A value published while a fetch waits is found.
  std::thread late([&] {
    std::this_thread::sleep_for(20ms);
    r.publish("late", bytes_of("abc"));
  });
  CHECK(r.fetch("late", 3, 5000ms) == bytes_of("abc"));
  late.join();
  // Names: 1 to 64 of [A-Za-z0-9_-].
  for (const std::string& bad : {std::string(), std::string("a/b"), std::string("../x"), std::string("a b"),
                                std::string(65, 'a')}) {
    CHECK_THROWS_AS(r.publish(bad, id), std::invalid_argument);
    CHECK_THROWS_AS((void)r.fetch(bad, 1, 0ms), std::invalid_argument);
  }
  r.publish(std::string(64, 'a'), id);
  // A directory that does not exist cannot be published to.
  CHECK_THROWS_AS(llama::Rendezvous("file:" + (dir.path / "no" / "such").string()).publish("x", id), std::runtime_error);
}

TEST_CASE("rendezvous: env values go to CELLKV_TP_<NAME> as hex; missing or malformed ones are refused") {
  const llama::Rendezvous r("env");
  CHECK(llama::Rendezvous::env_name("nccl-id") == "CELLKV_TP_NCCL_ID");
  const auto id = bytes_of("\x01\x02\xfe");
  r.publish("test-value", id);
  CHECK(std::string(std::getenv("CELLKV_TP_TEST_VALUE")) == "0102fe");
  CHECK(r.fetch("test-value", 3, 0ms) == id);
  CHECK_THROWS_AS((void)r.fetch("test-value", 4, 0ms), std::runtime_error);  // another size
  setenv("CELLKV_TP_TEST_VALUE", "01x2", 1);
  CHECK_THROWS_AS((void)r.fetch("test-value", 2, 0ms), std::runtime_error);
  unsetenv("CELLKV_TP_TEST_VALUE");
  CHECK_THROWS_AS((void)r.fetch("test-value", 3, 0ms), std::runtime_error);
}

TEST_CASE("rendezvous: tcp carries NCCL's id only: publish and fetch are refused") {
  const llama::Rendezvous r("tcp:127.0.0.1:29500");
  CHECK_THROWS_AS(r.publish("nccl-id", bytes_of("x")), std::invalid_argument);
  CHECK_THROWS_AS((void)r.fetch("nccl-id", 1, 0ms), std::invalid_argument);
}

TEST_CASE("rank world: parse_int32 takes decimal int32s only") {
  CHECK(llama::parse_int32("0") == 0);
  CHECK(llama::parse_int32("-7") == -7);
  CHECK(llama::parse_int32("2147483647") == 2147483647);
  for (const char* bad : {"", " 1", "1 ", "+1", "0x10", "2147483648", "1.0", "one"}) CHECK(!llama::parse_int32(bad));
}

TEST_CASE("rank world: the environment of mpirun, srun and PMI launchers") {
  using Env = std::map<std::string, std::string>;
  auto from = [](const Env& env) {
    return llama::world_from_environment([&](const char* name) -> const char* {
      const auto it = env.find(name);
      return it == env.end() ? nullptr : it->second.c_str();
    });
  };
  CHECK(!from({}));
  CHECK(!from({{"RANK", "1"}, {"WORLD_SIZE", "2"}}));  // not a launcher this reads
  const auto ompi = from({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"CELLKV_TP_RENDEZVOUS", "tcp:head:29500"}});
  REQUIRE(ompi);
  CHECK(ompi->rank == 3);
  CHECK(ompi->world == 4);
  CHECK(ompi->local_rank == 1);
  CHECK(ompi->rendezvous == "tcp:head:29500");
  const auto slurm = from({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}});
  REQUIRE(slurm);
  CHECK(slurm->rank == 1);
  CHECK(slurm->world == 2);
  CHECK(slurm->local_rank == 1);  // no local id: the rank
  CHECK(slurm->rendezvous.empty());
  const auto pmi = from({{"PMI_RANK", "0"}, {"PMI_SIZE", "1"}, {"MPI_LOCALRANKID", "0"}});
  REQUIRE(pmi);
  CHECK(pmi->world == 1);
  // Open MPI's variables win over Slurm's when both are set (mpirun under an allocation).
  CHECK(from({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"SLURM_PROCID", "5"},
              {"SLURM_NTASKS", "8"}})->world == 2);
  // Refused: a missing size, non-numbers, a rank outside the world, a local rank above the rank,
  // worlds of 0 or above 64.
  for (const Env& bad : {Env{{"SLURM_PROCID", "0"}}, Env{{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}},
                         Env{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}}, Env{{"SLURM_PROCID", "-1"}, {"SLURM_NTASKS", "2"}},
                         Env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}},
                         Env{{"PMI_RANK", "0"}, {"PMI_SIZE", "0"}}, Env{{"PMI_RANK", "0"}, {"PMI_SIZE", "65"}}})
    CHECK_THROWS_AS((void)from(bad), std::invalid_argument);
}

TEST_CASE("launcher: every rank's exit status and signal, in rank order") {
  // Rank r exits with status r; rank 2 kills itself.
  const auto exits = llama::launch_ranks("/bin/sh", 4, [](std::int32_t r) {
    return std::vector<std::string>{"-c", r == 2 ? "kill -9 $$" : "exit " + std::to_string(r)};
  }, 5000ms);
  REQUIRE(exits.size() == 4);
  for (std::int32_t r = 0; r < 4; ++r) CHECK(exits[static_cast<std::size_t>(r)].rank == r);
  CHECK(exits[0].ok());
  CHECK(exits[0].describe() == "rank 0: exit 0");
  CHECK(!exits[1].ok());
  CHECK(exits[1].describe() == "rank 1: exit 1");
  CHECK(!exits[2].ok());
  CHECK(exits[2].describe() == "rank 2: killed by signal 9");
  CHECK(exits[3].describe() == "rank 3: exit 3");
}

TEST_CASE("launcher: a rank still running `grace` after another failed is killed and reported so") {
  // Rank 2 execs sleep, so the process the launcher kills is the sleep itself: a shell's child would
  // outlive its shell (the launcher kills rank processes, not their descendants) and hold the test's
  // stdout open for its 600 s, which a test runner waiting for end of output would wait out.
  const auto exits = llama::launch_ranks("/bin/sh", 3, [](std::int32_t r) {
    return std::vector<std::string>{"-c", r == 1 ? "exit 5" : r == 0 ? "sleep 0.05; exit 0" : "exec sleep 600"};
  }, 200ms);
  REQUIRE(exits.size() == 3);
  CHECK(exits[0].ok());
  CHECK(exits[1].describe() == "rank 1: exit 5");
  CHECK(exits[2].killed_by_launcher);
  CHECK(!exits[2].ok());
  CHECK(exits[2].describe().starts_with("rank 2: killed by the launcher"));
}

TEST_CASE("launcher: ranks that all succeed are all waited for; bad counts and programs are refused") {
  const auto exits = llama::launch_ranks("/bin/sh", 2, [](std::int32_t) {
    return std::vector<std::string>{"-c", "sleep 0.1"};
  }, 0ms);
  REQUIRE(exits.size() == 2);
  CHECK((exits[0].ok() && exits[1].ok()));
  const auto missing = llama::launch_ranks("/no/such/program", 1, [](std::int32_t) { return std::vector<std::string>{}; }, 0ms);
  REQUIRE(missing.size() == 1);
  CHECK(missing[0].describe() == "rank 0: exit 127");
  auto none = [](std::int32_t) { return std::vector<std::string>{}; };
  CHECK_THROWS_AS((void)llama::launch_ranks("/bin/true", 0, none, 0ms), std::invalid_argument);
  CHECK_THROWS_AS((void)llama::launch_ranks("/bin/true", 65, none, 0ms), std::invalid_argument);
}

TEST_CASE("rendezvous: of processes publishing one file:DIR name at once, exactly one succeeds, with its value") {
  // The oracle is the contract: a name already published is refused, so of kProcs publishers
  // released together exactly one returns, the others throw, and the file holds the winner's bytes.
  constexpr int kProcs = 6, kRounds = 30;
  int rounds_not_one_winner = 0, rounds_wrong_value = 0, rounds_with_leftovers = 0;
  auto value_of = [](int k) { return bytes_of("the value of publisher " + std::to_string(k)); };  // one length
  for (int round = 0; round < kRounds; ++round) {
    const TempDir dir;
    const llama::Rendezvous r("file:" + dir.path.string());
    int gate[2];
    REQUIRE(pipe(gate) == 0);
    std::vector<pid_t> publishers;
    std::fflush(nullptr);  // nothing buffered is written again by a child
    for (int k = 0; k < kProcs; ++k) {
      const pid_t pid = fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        (void)close(gate[1]);
        char c = 0;
        (void)!read(gate[0], &c, 1);  // end of file once the parent closes its end: all start together
        try {
          r.publish("nccl-id", value_of(k));
        } catch (const std::runtime_error&) {
          _exit(1);
        } catch (...) {
          _exit(2);
        }
        _exit(0);
      }
      publishers.push_back(pid);
    }
    (void)close(gate[0]);
    (void)close(gate[1]);
    int winners = 0, winner = -1;
    for (int k = 0; k < kProcs; ++k) {
      int status = 0;
      REQUIRE(waitpid(publishers[static_cast<std::size_t>(k)], &status, 0) == publishers[static_cast<std::size_t>(k)]);
      REQUIRE(WIFEXITED(status));
      REQUIRE(WEXITSTATUS(status) != 2);
      if (WEXITSTATUS(status) == 0) ++winners, winner = k;
    }
    if (winners != 1) ++rounds_not_one_winner;
    if (winner >= 0 && r.fetch("nccl-id", value_of(winner).size(), 0ms) != value_of(winner)) ++rounds_wrong_value;
    if (std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator{}) != 1)
      ++rounds_with_leftovers;
  }
  CHECK(rounds_not_one_winner == 0);
  CHECK(rounds_wrong_value == 0);
  CHECK(rounds_with_leftovers == 0);
}

TEST_CASE("launcher: an exception from args passes on only after the ranks already started are killed and reaped") {
  const TempDir dir;
  auto pid_file = [&](std::int32_t r) { return dir.path / ("pid" + std::to_string(r)); };
  auto pid_of = [&](std::int32_t r) -> pid_t {
    std::ifstream f(pid_file(r));
    long pid = 0;
    return (f >> pid) ? static_cast<pid_t>(pid) : 0;
  };
  CHECK_THROWS_AS((void)llama::launch_ranks("/bin/sh", 3, [&](std::int32_t r) {
    if (r == 2) {  // once ranks 0 and 1 run (and said which processes they are)
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      while ((pid_of(0) == 0 || pid_of(1) == 0) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(5ms);
      throw std::runtime_error("no arguments for rank 2");
    }
    const std::string file = pid_file(r).string();
    return std::vector<std::string>{"-c",
                                    "echo $$ > " + file + ".part && mv " + file + ".part " + file + "; exec sleep 600"};
  }, 0ms), std::runtime_error);
  for (std::int32_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    const pid_t pid = pid_of(r);
    REQUIRE(pid > 0);
    // Gone, not even a zombie: kill(pid, 0) fails with ESRCH.
    const bool gone = kill(pid, 0) == -1 && errno == ESRCH;
    CHECK(gone);
    if (!gone) {  // left running by the launcher: end it here
      (void)kill(pid, SIGKILL);
      (void)waitpid(pid, nullptr, 0);
    }
  }
}

TEST_CASE("launcher: with SIGCHLD ignored (no exit status to collect) it refuses at once instead of waiting forever") {
  std::fflush(nullptr);  // nothing buffered is written again by the child
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // a process of its own, so the disposition changes nothing of the test runner's
    (void)signal(SIGCHLD, SIG_IGN);
    (void)alarm(5);  // a launcher that waits forever dies of SIGALRM
    try {
      auto exit_0 = [](std::int32_t) { return std::vector<std::string>{"-c", "exit 0"}; };
      (void)llama::launch_ranks("/bin/sh", 2, exit_0, 0ms);
    } catch (const std::runtime_error&) {
      _exit(0);
    } catch (...) {
      _exit(2);
    }
    _exit(1);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
