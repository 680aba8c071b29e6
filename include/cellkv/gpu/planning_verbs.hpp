// cellkv/gpu/planning_verbs.hpp - the host cache of a device cache and its planning verbs,
// written once for DeviceCache and ShardedCache (the one layer between a caller and the host cache).
//
// `Owner` (CRTP) is told before every planning verb through `before_planning()`, where it may
// acknowledge changes every device has uploaded (docs/design.md section 5). Verbs and refusals are
// the host cache's own (docs/design.md section 4); the owner's device state is never touched here.
#pragma once

#include <cstdint>
#include <span>

#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"

namespace cellkv::gpu {

template <class Host, class Owner>
class PlanningVerbs {
 public:
  [[nodiscard]] const Host& host() const noexcept { return host_; }

  Result<StepPlan> declare_step(std::span<const std::int32_t> seq_ids) {
    owner().before_planning();
    return host_.declare_step(seq_ids);
  }
  Result<std::int32_t> seq_new() {
    owner().before_planning();
    return host_.seq_new();
  }
  Result<std::int32_t> seq_clone(std::int32_t src, std::int32_t upto = -1) {
    owner().before_planning();
    return host_.seq_clone(src, upto);
  }
  Status seq_rm(std::int32_t id) {
    owner().before_planning();
    return host_.seq_rm(id);
  }
  Status rewind(std::int32_t id, std::int32_t pos) {
    owner().before_planning();
    return host_.rewind(id, pos);
  }
  void clear() {
    owner().before_planning();
    host_.clear();
  }

 protected:
  // Throws std::invalid_argument when the host cache refuses the config.
  explicit PlanningVerbs(const CacheConfig& config) : host_(config) {}
  PlanningVerbs(const PlanningVerbs&) = delete;
  PlanningVerbs& operator=(const PlanningVerbs&) = delete;
  ~PlanningVerbs() = default;

  // The owner's host cache. A data member, so the owner's device bases can be given it while the
  // owner is still being constructed (no member function may be called then).
  Host host_;

 private:
  Owner& owner() noexcept { return static_cast<Owner&>(*this); }
};

}  // namespace cellkv::gpu
