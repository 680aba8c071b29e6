// cellkv/gpu/graph_scope.hpp - which attention kernels a step needs, and which ones a CUDA graph
// captured over a step records (GraphScope).
//
// A layer's attention (table kernels) is up to three launches: the shared-prefix kernel (runs that
// several sequences of the step share, cell layout), the prefill kernel (segments too long for a
// decode item) and the decode kernel (short segments; it also zeroes the padding rows of a step
// narrower than its width). A step needs a kernel when it has that kind of work in some window.
//
// GraphScope::every_step (the default): a capture records all three, so one graph per width serves
// every later step of that width; the launches without work return at once but still cost their
// launch and their place in the stream. GraphScope::step_kinds: a capture records only the kernels
// the captured step needs, and the graph serves the later steps of that width whose graph_key()
// is the same; key graphs by (width, graph_key()). A replay for a step that needs a kernel the
// graph lacks is caught on the device (kFaultMissingKernel): its attention is not computed, and the
// cache's next commit or upload refuses with Errc::missing_step_kernels.
#pragma once

#include <cstdint>

#include "cellkv/host_device.hpp"

namespace cellkv::gpu {

enum class GraphScope : std::uint8_t { every_step, step_kinds };

// A set of the layer's attention kernels, as bits.
struct StepKernels {
  static constexpr std::uint32_t kDecode = 1, kPrefill = 2, kShared = 4, kAll = 7;
  std::uint32_t bits = 0;

  [[nodiscard]] static constexpr StepKernels all() noexcept { return {kAll}; }
  [[nodiscard]] CELLKV_HOST_DEVICE constexpr bool has(std::uint32_t kernel) const noexcept {
    return (bits & kernel) != 0;
  }
  // Whether every kernel of `need` is in this set.
  [[nodiscard]] CELLKV_HOST_DEVICE constexpr bool covers(StepKernels need) const noexcept {
    return (need.bits & ~bits) == 0;
  }
  friend constexpr StepKernels operator|(StepKernels a, StepKernels b) noexcept { return {a.bits | b.bits}; }
  friend constexpr bool operator==(StepKernels a, StepKernels b) noexcept = default;
};

// The kernels one window of a step needs: decode segments or padding rows (tokens < width) need
// the decode kernel, prefill items the prefill kernel, shared-prefix items the shared kernel.
[[nodiscard]] CELLKV_HOST_DEVICE constexpr StepKernels needed_kernels(std::int32_t decode_segments,
                                                                     std::int32_t prefill_items, bool padding,
                                                                     std::int32_t shared_items) noexcept {
  return {(decode_segments > 0 || padding ? StepKernels::kDecode : 0u) |
          (prefill_items > 0 ? StepKernels::kPrefill : 0u) | (shared_items > 0 ? StepKernels::kShared : 0u)};
}

}  // namespace cellkv::gpu
