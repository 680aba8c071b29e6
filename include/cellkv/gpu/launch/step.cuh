// cellkv/gpu/launch/step.cuh - launchers of the per-step kernels of the cell layout (upload):
//   write_table   the uploaded position-table writes into the table's device copy
//   build_masks   the dense mask rows of every window buffer, from the table
#pragma once

#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cellkv/gpu/error.hpp"
#include "cellkv/gpu/kernels/step_kernels.cuh"
#include "cellkv/gpu/step_views.hpp"
#include "cellkv/step_block.hpp"

namespace cellkv::gpu {

// flat[w.index] = w.value for the `count` device-resident writes (each index once).
inline Status write_table(const TableWrite* writes, std::int32_t count, std::int32_t* flat, ::cuda::stream_ref stream) {
  if (count <= 0) return {};
  if (writes == nullptr || flat == nullptr) return Errc::bad_argument;
  const auto blocks = static_cast<unsigned>(std::min<std::int32_t>((count + 255) / 256, 1024));
  kernels::apply_table_writes<<<blocks, 256, 0, stream.get()>>>(writes, count, flat);
  return detail::last_launch();
}

// Mask rows [0, width) x [0, read_len) of every window buffer (b.masks must be allocated).
inline Status build_masks(const StepBindings& b, const WindowList& windows, std::int32_t width, std::int64_t read_len,
                          ::cuda::stream_ref stream) {
  if (b.masks == nullptr || width < 1 || width > b.max_write || read_len < 0 || read_len > b.max_cells)
    return Errc::bad_argument;
  const dim3 grid(static_cast<unsigned>(width), static_cast<unsigned>(b.windows));
  if (b.max_cells % 16 == 0) kernels::build_masks<true><<<grid, 256, 0, stream.get()>>>(b, windows, read_len);
  else kernels::build_masks<false><<<grid, 256, 0, stream.get()>>>(b, windows, read_len);
  return detail::last_launch();
}

}  // namespace cellkv::gpu
