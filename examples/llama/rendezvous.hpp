// llama/rendezvous.hpp - how the processes of a tensor-parallel job find each other: a rank
// publishes a few bytes under a name (NCCL's unique id, a CUDA IPC handle) and the others fetch
// them, through nothing beyond what the machines already have. A spec names the way:
//   file:DIR        a directory every rank can read (one machine, or a file system the machines
//                   share, with hard links). A value is written to a temporary file and linked into
//                   place, so a reader never sees part of one. Give each job an empty directory:
//                   publishing a name that is already there is refused (a previous job's value, or
//                   another publisher's that got there first).
//   env             values handed down in the environment, as hex in CELLKV_TP_<NAME> (NAME upper-
//                   cased, '-' as '_'): a launcher publishes before it starts its ranks, which
//                   inherit them (cellkv-tp-demo --ranks G hands NCCL's id down this way).
//   tcp:HOST:PORT   NCCL's own bootstrap, for several machines: every rank sets
//                   NCCL_COMM_ID=HOST:PORT, rank 0 listens there and every rank's ncclGetUniqueId
//                   yields the same id. It carries NCCL's id only (publish and fetch refuse).
// Names are 1 to 64 characters of [A-Za-z0-9_-].
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace llama {

// Lower-case hex of bytes, and back (from_hex throws std::invalid_argument on a bad digit or an
// odd length).
inline std::string to_hex(const std::vector<std::byte>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (const std::byte b : bytes) {
    out.push_back(kDigits[static_cast<unsigned>(b) >> 4]);
    out.push_back(kDigits[static_cast<unsigned>(b) & 15u]);
  }
  return out;
}

inline std::vector<std::byte> from_hex(std::string_view hex) {
  auto digit = [](char c) -> unsigned {
    if (c >= '0' && c <= '9') return static_cast<unsigned>(c - '0');
    if (c >= 'a' && c <= 'f') return static_cast<unsigned>(c - 'a' + 10);
    if (c >= 'A' && c <= 'F') return static_cast<unsigned>(c - 'A' + 10);
    throw std::invalid_argument("llama::from_hex: not a hex digit");
  };
  if (hex.size() % 2 != 0) throw std::invalid_argument("llama::from_hex: odd number of digits");
  std::vector<std::byte> out;
  for (std::size_t i = 0; i < hex.size(); i += 2) out.push_back(std::byte((digit(hex[i]) << 4) | digit(hex[i + 1])));
  return out;
}

class Rendezvous {
 public:
  enum class Kind { file, env, tcp };

  // Throws std::invalid_argument on a spec that is none of the above (an empty DIR, a tcp address
  // without ':' and a port in [1, 65535]).
  explicit Rendezvous(std::string_view spec) : spec_(spec) {
    if (spec.starts_with("file:") && spec.size() > 5) {
      kind_ = Kind::file;
      where_ = std::string(spec.substr(5));
    } else if (spec == "env") {
      kind_ = Kind::env;
    } else if (spec.starts_with("tcp:") && valid_address(spec.substr(4))) {
      kind_ = Kind::tcp;
      where_ = std::string(spec.substr(4));
    } else {
      throw std::invalid_argument("llama::Rendezvous: '" + std::string(spec) +
                                  "' is none of file:DIR, env, tcp:HOST:PORT");
    }
  }

  [[nodiscard]] Kind kind() const noexcept { return kind_; }
  [[nodiscard]] const std::string& spec() const noexcept { return spec_; }
  // file: the directory; tcp: HOST:PORT; env: empty.
  [[nodiscard]] const std::string& where() const noexcept { return where_; }

  // Makes `bytes` fetchable under `name`. Throws std::invalid_argument on a bad name or a tcp
  // rendezvous, std::runtime_error when the file cannot be written or the name is already published.
  void publish(std::string_view name, const std::vector<std::byte>& bytes) const {
    check_name(name);
    if (kind_ == Kind::tcp) throw std::invalid_argument("llama::Rendezvous: tcp: carries NCCL's id only");
    if (kind_ == Kind::env) {
      setenv(env_name(name).c_str(), to_hex(bytes).c_str(), 1);
      return;
    }
    const std::string path = where_ + "/" + std::string(name);
    auto exists_already = [&] {
      return std::runtime_error("llama::Rendezvous: " + path +
                                " exists already (a previous job's? use an empty directory)");
    };
    if (access(path.c_str(), F_OK) == 0) throw exists_already();
    // A temporary of its own (mkstemp: no other publisher, thread or machine writes it), then
    // link(2) into place: unlike rename it fails when the name exists, so of publishers racing for
    // a name exactly one succeeds and the value never changes once published.
    std::string temporary = path + ".part.XXXXXX";
    const int fd = mkstemp(temporary.data());
    if (fd < 0) throw std::runtime_error("llama::Rendezvous: cannot write " + temporary);
    (void)fchmod(fd, 0644);  // readable as a file fopen made would be, not mkstemp's 0600
    bool written = true;
    for (std::size_t done = 0; written && done < bytes.size();) {
      const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
      if (n > 0) done += static_cast<std::size_t>(n);
      else written = n < 0 && errno == EINTR;
    }
    written = close(fd) == 0 && written;
    const bool linked = written && link(temporary.c_str(), path.c_str()) == 0;
    const int link_error = errno;
    (void)unlink(temporary.c_str());
    if (!linked && written && link_error == EEXIST) throw exists_already();
    if (!linked) throw std::runtime_error("llama::Rendezvous: cannot publish " + path);
  }

  // The `size` bytes published under `name`, waiting up to `timeout` for them (file). Throws
  // std::invalid_argument on a bad name or a tcp rendezvous, std::runtime_error when nothing of that
  // size is published in time (env: when the variable is missing or malformed, at once).
  [[nodiscard]] std::vector<std::byte> fetch(std::string_view name, std::size_t size,
                                             std::chrono::milliseconds timeout) const {
    check_name(name);
    if (kind_ == Kind::tcp) throw std::invalid_argument("llama::Rendezvous: tcp: carries NCCL's id only");
    if (kind_ == Kind::env) return fetch_env(name, size);
    const std::string path = where_ + "/" + std::string(name);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (auto bytes = read_file(path); bytes && bytes->size() == size) return *bytes;
      if (std::chrono::steady_clock::now() >= deadline)
        throw std::runtime_error("llama::Rendezvous: nothing of " + std::to_string(size) + " bytes at " + path +
                                 " after " + std::to_string(timeout.count()) + " ms (has the rank that publishes it started?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  // CELLKV_TP_<NAME> of the env rendezvous.
  static std::string env_name(std::string_view name) {
    std::string out = "CELLKV_TP_";
    for (const char c : name) out.push_back(c == '-' ? '_' : (c >= 'a' && c <= 'z') ? static_cast<char>(c - 32) : c);
    return out;
  }

 private:
  static bool valid_address(std::string_view a) {
    const std::size_t colon = a.rfind(':');
    if (colon == std::string_view::npos || colon == 0 || colon + 1 == a.size() || a.size() - colon - 1 > 5) return false;
    std::int32_t port = 0;
    for (const char c : a.substr(colon + 1)) {
      if (c < '0' || c > '9') return false;
      port = port * 10 + (c - '0');
    }
    return port >= 1 && port <= 65535;
  }

  static void check_name(std::string_view name) {
    bool ok = !name.empty() && name.size() <= 64;
    for (const char c : name)
      ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-');
    if (!ok) throw std::invalid_argument("llama::Rendezvous: a name is 1 to 64 of [A-Za-z0-9_-]");
  }

  static std::optional<std::vector<std::byte>> read_file(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return std::nullopt;
    std::vector<std::byte> bytes;
    std::byte buffer[256];
    for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, f)) > 0;) bytes.insert(bytes.end(), buffer, buffer + n);
    std::fclose(f);
    return bytes;
  }

  static std::vector<std::byte> fetch_env(std::string_view name, std::size_t size) {
    const std::string var = env_name(name);
    const char* hex = std::getenv(var.c_str());
    if (hex == nullptr) throw std::runtime_error("llama::Rendezvous: " + var + " is not set");
    std::vector<std::byte> bytes;
    try {
      bytes = from_hex(hex);
    } catch (const std::invalid_argument&) {
      throw std::runtime_error("llama::Rendezvous: " + var + " is not hex");
    }
    if (bytes.size() != size)
      throw std::runtime_error("llama::Rendezvous: " + var + " holds " + std::to_string(bytes.size()) + " bytes, not " +
                               std::to_string(size));
    return bytes;
  }

  std::string spec_;
  Kind kind_ = Kind::file;
  std::string where_;
};

}  // namespace llama
