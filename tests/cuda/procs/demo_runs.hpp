// Runs of cellkv-tp-demo (CELLKV_TP_DEMO, its path in the build tree) for the multi-process
// tensor-parallel tests: a run's exit status and everything it printed (stdout and stderr of the
// launcher and of every rank), and ranks started one by one as a user would start them by hand.
// The demo itself checks every session's tokens against the whole model on one GPU (rank 0 prints
// "OK: every session's tokens equal the single-GPU model's" only when they all match).
#pragma once

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace cellkv::test::procs {

inline constexpr const char* kOk = "OK: every session's tokens equal the single-GPU model's";

struct Run {
  int exit_status = -1;  // the shell's: the demo's exit status, or 128 + a signal
  std::string output;
};

// Starts `command` under /bin/sh (stderr joined to stdout) without waiting for it.
inline std::FILE* start(const std::string& command) {
  std::FILE* p = popen((command + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  return p;
}

inline Run finish(std::FILE* p) {
  Run r;
  char buffer[4096];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, p)) > 0;) r.output.append(buffer, n);
  const int status = pclose(p);
  r.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// cellkv-tp-demo with `args` (and environment assignments `env`, "NAME=value ..."), waited for.
inline Run demo(const std::string& args, const std::string& env = "") {
  return finish(start(env + (env.empty() ? "" : " ") + CELLKV_TP_DEMO + " " + args));
}

// Several commands at once (ranks started by hand), each waited for.
inline std::vector<Run> demos_at_once(const std::vector<std::string>& commands) {
  std::vector<std::FILE*> running;
  for (const std::string& c : commands) running.push_back(start(c));
  std::vector<Run> out;
  for (std::FILE* p : running) out.push_back(finish(p));
  return out;
}

inline bool has(const Run& r, const std::string& text) { return r.output.find(text) != std::string::npos; }

// cellkv-tp-demo with `args` (and `env` assignments) ends with exit status `status` and prints
// every text of `printed` and none of `absent`; a run that ends in failure never prints the OK line.
inline void check_ends(const std::string& args, int status, const std::vector<std::string>& printed,
                       const std::vector<std::string>& absent = {}, const std::string& env = "") {
  const Run r = demo(args, env);
  INFO(env << " " << args << ": " << r.output);
  CHECK(r.exit_status == status);
  for (const std::string& text : printed) {
    INFO("printed: " << text);
    CHECK(has(r, text));
  }
  for (const std::string& text : absent) {
    INFO("not printed: " << text);
    CHECK(!has(r, text));
  }
  if (status != 0) CHECK(!has(r, kOk));
}

// Ranks started at once by hand, one command each: every one exits 0 and rank 0 (commands[zero])
// prints the OK line.
inline void ranks_by_hand_agree(const std::vector<std::string>& commands, std::size_t zero) {
  const std::vector<Run> runs = demos_at_once(commands);
  for (const Run& r : runs) {
    INFO(r.output);
    CHECK(r.exit_status == 0);
  }
  CHECK(has(runs[zero], kOk));
}

// A TCP port for a tcp:HOST:PORT rendezvous that nothing listens on now (bound and released).
inline std::string free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof a;
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                     getsockname(fd, reinterpret_cast<sockaddr*>(&a), &size) == 0;
  close(fd);
  REQUIRE(bound);
  return std::to_string(ntohs(a.sin_port));
}

// An empty directory for a file:DIR rendezvous, removed at the end of the scope.
struct RendezvousDir {
  std::filesystem::path path;
  RendezvousDir() {
    char tmpl[] = "/tmp/cellkv-procs-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~RendezvousDir() { std::filesystem::remove_all(path); }
  [[nodiscard]] std::string spec() const { return "file:" + path.string(); }
};

}  // namespace cellkv::test::procs
