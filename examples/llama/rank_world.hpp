// llama/rank_world.hpp - which rank of how many this process is, which GPU of its machine it
// drives, and where the ranks meet (llama/rendezvous.hpp). A process started by hand gets these
// from its command line (cellkv-tp-demo --rank R --world G --rendezvous SPEC); one started by a job
// launcher from the environment the launcher sets:
//   mpirun (Open MPI)   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
//   srun (Slurm)        SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//   MPICH / Intel MPI   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID
// and the rendezvous from CELLKV_TP_RENDEZVOUS (tcp:HOST:PORT across machines).
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace llama {

struct RankWorld {
  std::int32_t rank = 0;
  std::int32_t world = 1;
  std::int32_t local_rank = 0;  // the rank's index among the ranks of its machine: its GPU
  std::string rendezvous;       // a llama::Rendezvous spec

  static constexpr std::int32_t kMaxWorld = 64;

  // Throws std::invalid_argument unless 1 <= world <= kMaxWorld, 0 <= rank < world and
  // 0 <= local_rank <= rank.
  void check() const {
    if (world < 1 || world > kMaxWorld || rank < 0 || rank >= world || local_rank < 0 || local_rank > rank)
      throw std::invalid_argument("llama::RankWorld: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                                  " (local " + std::to_string(local_rank) + ") is not a rank of a world of 1 to " +
                                  std::to_string(kMaxWorld));
  }
};

// A decimal int32, or nullopt (anything else: signs other than '-', spaces, overflow).
inline std::optional<std::int32_t> parse_int32(std::string_view text) {
  std::int32_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
}

// The rank a job launcher describes in the environment, read through getenv(name) (std::getenv,
// or a table in tests); nullopt when no launcher's variables are set. The first launcher whose
// rank variable is set counts. Throws std::invalid_argument when its variables are missing or
// malformed, or describe no rank of a world (RankWorld::check); the rendezvous is left empty when
// CELLKV_TP_RENDEZVOUS is not set.
template <class Getenv>
std::optional<RankWorld> world_from_environment(Getenv getenv) {
  struct Names {
    const char *rank, *size, *local;
  };
  static constexpr Names kLaunchers[] = {{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
                                         {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
                                         {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"}};
  for (const Names& n : kLaunchers) {
    const char* rank = getenv(n.rank);
    if (rank == nullptr) continue;
    auto number = [&](const char* name, const char* value) {
      const std::optional<std::int32_t> v = value != nullptr ? parse_int32(value) : std::nullopt;
      if (!v) throw std::invalid_argument(std::string("llama::world_from_environment: ") + name + " is " +
                                          (value != nullptr ? "not a number" : "not set"));
      return *v;
    };
    RankWorld w;
    w.rank = number(n.rank, rank);
    w.world = number(n.size, getenv(n.size));
    w.local_rank = getenv(n.local) != nullptr ? number(n.local, getenv(n.local)) : w.rank;
    if (const char* spec = getenv("CELLKV_TP_RENDEZVOUS")) w.rendezvous = spec;
    w.check();
    return w;
  }
  return std::nullopt;
}

}  // namespace llama
