// cellkv/gpu/planning_verbs.hpp - the host cache of a device cache and its planning verbs,
// written once for DeviceCache and ShardedCache (the one layer between a caller and the host cache).
//
// `Owner` (CRTP) is told before every planning verb through `before_planning()`, where it may
// acknowledge changes every device has uploaded (docs/design.md section 5), is asked
// `check_key_rotation()` before a verb that moves cells, and `holds_applied_changes()` before a
// verb that could change the pending copies or re-rotations. Verbs and refusals are
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
    prepare_planning();
    return host_.declare_step(seq_ids);
  }
  Result<std::int32_t> seq_new() {
    prepare_planning();
    return host_.seq_new();
  }
  // The verbs below that can change the pending copies or re-rotations (clone, removals,
  // rewind, keep, moves) are refused with upload_incomplete while a device has applied part of
  // them and not every device has uploaded the placed step (a failed or partial upload): upload it
  // on every device first (DeviceShard::holds_applied_changes).
  Result<std::int32_t> seq_clone(std::int32_t src, std::int32_t upto = -1) {
    if (const Status s = begin_changes(); !s.ok()) return s.code();
    return host_.seq_clone(src, upto);
  }
  Status seq_rm(std::int32_t id) {
    if (const Status s = begin_changes(); !s.ok()) return s;
    return host_.seq_rm(id);
  }
  Status rewind(std::int32_t id, std::int32_t pos) {
    if (const Status s = begin_changes(); !s.ok()) return s;
    return host_.rewind(id, pos);
  }
  void clear() {
    prepare_planning();
    host_.clear();
  }

  // Sequence edits (docs/design.md section 4, "Sequence edits"). seq_add and seq_div move cells
  // whose K the device re-rotates at the next upload: on the cell layout they are refused
  // (no_key_rotation, before any other check) until the owner's key rotation is set.
  Status seq_rm(std::int32_t id, std::int32_t p0, std::int32_t p1) {
    if (const Status s = begin_changes(); !s.ok()) return s;
    return host_.seq_rm(id, p0, p1);
  }
  Status seq_cp(std::int32_t src, std::int32_t dst, std::int32_t p0, std::int32_t p1) {
    prepare_planning();
    return host_.seq_cp(src, dst, p0, p1);
  }
  Status seq_keep(std::int32_t id) {
    if (const Status s = begin_changes(); !s.ok()) return s;
    return host_.seq_keep(id);
  }
  Status seq_add(std::int32_t id, std::int32_t p0, std::int32_t p1, std::int32_t delta) {
    if (const Status s = owner().check_key_rotation(); !s.ok()) return s;
    if (const Status s = begin_changes(); !s.ok()) return s;
    return host_.seq_add(id, p0, p1, delta);
  }
  Status seq_div(std::int32_t id, std::int32_t p0, std::int32_t p1, std::int32_t d) {
    if (const Status s = owner().check_key_rotation(); !s.ok()) return s;
    if (const Status s = begin_changes(); !s.ok()) return s;
    return host_.seq_div(id, p0, p1, d);
  }
  // A new sequence holding exactly `positions`, in fresh rows the caller fills (the device
  // restore of gpu/sequence_state.cuh does); the host cache's refusals.
  Result<std::int32_t> restore_positions(std::span<const std::int32_t> positions) {
    prepare_planning();
    return host_.restore_positions(positions);
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

  // before_planning; then, with window storage, the host's window pools keep the pages of cells
  // whose K re-rotation is pending while a device holds part of the pending changes: declare_step
  // and seq_cp run then (a failed upload resumes at the next one) and their drops must not change
  // what the device resumes (detail/cell_pool.hpp, keep_pending_pages).
  void prepare_planning() {
    owner().before_planning();
    if constexpr (requires { host_.keep_pending_pages(true); }) host_.keep_pending_pages(owner().holds_applied_changes());
  }

  // prepare_planning, then upload_incomplete while a device holds part of the pending changes.
  Status begin_changes() {
    prepare_planning();
    return owner().holds_applied_changes() ? Status{Errc::upload_incomplete} : Status{};
  }
};

}  // namespace cellkv::gpu
