// cellkv/gpu/device_layout.cuh - what the device side asks of a layout (layout.hpp): the one
// specialization a new layout adds here (docs/design.md, "How to add a layout, a placement, a
// kernel").
//
//   DeviceLayout<L>::Rows                 where the rows of a tile of positions live
//                                         (kernels/tile_rows.cuh): the attention kernels'
//                                         template argument, trivially copyable
//   DeviceLayout<L>::rows(host, bindings) that policy for a host cache of L and a shard's bound
//                                         step buffers
//
// Everything else the device side does differently per layout follows L::kPositionTable: with a
// table, the step uploads table writes, plans shared prefixes and the reference kernel reads dense
// masks; without, the reference kernel reads each token's row range and fork copies run before
// the step's writes.
#pragma once

#include <concepts>
#include <type_traits>

#include "cellkv/gpu/kernels/tile_rows.cuh"
#include "cellkv/gpu/step_views.hpp"
#include "cellkv/layout.hpp"

namespace cellkv::gpu {

template <class L>
struct DeviceLayout;

template <>
struct DeviceLayout<layout::cell> {
  using Rows = kernels::TableRows;
  template <class Host>
  static Rows rows(const Host&, const StepBindings& b) noexcept {
    return Rows{b.table};
  }
};

template <>
struct DeviceLayout<layout::sequence> {
  using Rows = kernels::SlotRows;
  template <class Host>
  static Rows rows(const Host& host, const StepBindings&) noexcept {
    return Rows{host.config().max_len};
  }
};

// L is a layout with a device side.
template <class L>
concept DeviceLayoutFor = Layout<L> && requires { typename DeviceLayout<L>::Rows; } &&
                          std::is_trivially_copyable_v<typename DeviceLayout<L>::Rows>;

}  // namespace cellkv::gpu
