// cellkv/gpu/kernels/item_claims.cuh - the items of a persistent grid claimed one at a time, in the
// plan's order (by segment, each segment's heaviest first: plan_window), from a device counter: a
// block that is done early takes the next item, so the blocks end within about one item of each
// other whatever each item turns out to cost. Without counters the items are dealt in rounds
// (dealt_item), which balances the planned tile counts but not the time they take.
//
// Counters (words, zero at first; the launcher owns them): [0] the next item to claim, [1] the
// blocks of the grid that are done claiming. A block's claiming thread takes items by fetch_add on
// [0] until it gets one past the count, then counts its block on [1] (acq_rel); the block that
// counts last has seen every claim of the grid and returns both words to zero for the next launch.
// Launches that use the same words must not overlap (on one stream each waits for the grid before
// it: its first read follows wait_for_prior_grids).
#pragma once

#include <cuda/atomic>

#include <cstdint>

#include "cellkv/gpu/kernels/prefill_attention.cuh"

namespace cellkv::gpu::kernels {

struct ItemClaims {
  std::uint32_t* words = nullptr;  // [2]; nullptr: items dealt in rounds

  // The item of the block's round n of `items` (-1: none left). Called once per round, in order, by
  // one thread of the block.
  __device__ int take(int n, int items) const {
    if (words == nullptr) return dealt_item(n, items);
    const std::uint32_t item = ::cuda::atomic_ref<std::uint32_t, ::cuda::thread_scope_device>{words[0]}.fetch_add(
        1u, ::cuda::memory_order_relaxed);
    return item < static_cast<std::uint32_t>(items) ? static_cast<int>(item) : -1;
  }
  // After the block's last take (the one that gave -1), by the same thread.
  __device__ void done() const {
    if (words == nullptr) return;
    ::cuda::atomic_ref<std::uint32_t, ::cuda::thread_scope_device> blocks{words[1]};
    if (blocks.fetch_add(1u, ::cuda::memory_order_acq_rel) + 1u != gridDim.x) return;
    ::cuda::atomic_ref<std::uint32_t, ::cuda::thread_scope_device>{words[0]}.store(0u, ::cuda::memory_order_relaxed);
    blocks.store(0u, ::cuda::memory_order_relaxed);
  }
};

}  // namespace cellkv::gpu::kernels
