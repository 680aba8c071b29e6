// llama/rank_launcher.hpp - starts the G rank processes of a one-machine tensor-parallel job and
// waits for all of them. Rank r runs `program` (cellkv-tp-demo passes itself, /proc/self/exe) with
// the arguments args(r), started by fork and exec, so that nothing of the parent's state (CUDA is
// not fork-safe) runs in a rank. Ranks inherit the parent's environment, stdout and stderr.
//
// A rank that fails (exits non-zero or dies of a signal) does not take the others down at once: they
// get `grace` to notice it through their own collectives' timeouts and end with their own error
// (which is what a rank started by hand on another machine would do); whoever is still running
// after that is killed (SIGKILL) and reported so. The launcher kills the rank processes it started,
// not processes they start in turn: a rank that runs children must end them itself.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace llama {

struct RankExit {
  std::int32_t rank = 0;
  int status = 0;                   // waitpid's status
  bool killed_by_launcher = false;  // still running `grace` after another rank failed

  [[nodiscard]] bool ok() const noexcept { return !killed_by_launcher && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
  // "rank 1: exit 0", "rank 1: exit 3", "rank 1: killed by signal 9", "rank 1: killed by the launcher".
  [[nodiscard]] std::string describe() const {
    const std::string who = "rank " + std::to_string(rank) + ": ";
    if (killed_by_launcher) return who + "killed by the launcher (still running after another rank failed)";
    if (WIFEXITED(status)) return who + "exit " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return who + "killed by signal " + std::to_string(WTERMSIG(status));
    return who + "ended with status " + std::to_string(status);
  }
};

// Runs ranks 0 .. ranks - 1 as above and returns how each ended, in rank order. Throws
// std::invalid_argument unless 1 <= ranks <= 64, std::runtime_error when SIGCHLD is ignored (the
// ranks' exit statuses could not be collected; nothing is started) or a process cannot be started;
// that, and any exception from args, passes on only after the ranks already started are killed and
// reaped. A rank whose exec fails exits 127.
inline std::vector<RankExit> launch_ranks(const std::string& program, std::int32_t ranks,
                                          const std::function<std::vector<std::string>(std::int32_t)>& args,
                                          std::chrono::milliseconds grace) {
  if (ranks < 1 || ranks > 64) throw std::invalid_argument("llama::launch_ranks: 1 to 64 ranks");
  // With SIGCHLD ignored (or SA_NOCLDWAIT) the kernel reaps the ranks itself and waitpid never
  // returns them: the loop below would wait forever.
  struct sigaction chld {};
  if (sigaction(SIGCHLD, nullptr, &chld) == 0 && (chld.sa_handler == SIG_IGN || (chld.sa_flags & SA_NOCLDWAIT) != 0))
    throw std::runtime_error("llama::launch_ranks: SIGCHLD is ignored, so the ranks' exit statuses cannot be "
                             "collected");
  std::vector<pid_t> pids;
  pids.reserve(static_cast<std::size_t>(ranks));
  std::vector<RankExit> exits(static_cast<std::size_t>(ranks));
  auto kill_all = [&] {
    for (const pid_t p : pids) {
      (void)kill(p, SIGKILL);
      (void)waitpid(p, nullptr, 0);
    }
  };
  for (std::int32_t r = 0; r < ranks; ++r) {
    std::vector<std::string> a;
    std::vector<char*> argv;
    try {
      a = args(r);
      a.insert(a.begin(), program);
      for (std::string& s : a) argv.push_back(s.data());
      argv.push_back(nullptr);
    } catch (...) {
      kill_all();
      throw;
    }
    std::fflush(nullptr);  // nothing buffered is written twice
    const pid_t pid = fork();
    if (pid < 0) {
      kill_all();
      throw std::runtime_error(std::string("llama::launch_ranks: fork: ") + std::strerror(errno));
    }
    if (pid == 0) {
      execv(program.c_str(), argv.data());
      _exit(127);
    }
    pids.push_back(pid);
    exits[static_cast<std::size_t>(r)].rank = r;
  }
  std::vector<bool> running(pids.size(), true);
  std::size_t left = pids.size();
  std::optional<std::chrono::steady_clock::time_point> give_up;  // set when a rank fails
  while (left > 0) {
    bool reaped = false;
    for (std::size_t r = 0; r < pids.size(); ++r) {
      if (!running[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      running[r] = false;
      --left;
      reaped = true;
      exits[r].status = status;
      if (!exits[r].ok() && !give_up) give_up = std::chrono::steady_clock::now() + grace;
    }
    if (give_up && std::chrono::steady_clock::now() >= *give_up) {
      for (std::size_t r = 0; r < pids.size(); ++r) {
        if (!running[r]) continue;
        (void)kill(pids[r], SIGKILL);
        (void)waitpid(pids[r], &exits[r].status, 0);
        exits[r].killed_by_launcher = true;
        running[r] = false;
        --left;
      }
    }
    if (!reaped && left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return exits;
}

}  // namespace llama
