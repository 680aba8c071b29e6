// One of two translation units that include every tier-0 header and instantiate the caches; the
// link with odr_a.cpp fails on any non-inline definition in a header.
#include "cellkv/batching/batching.hpp"
#include "cellkv/cellkv.hpp"

std::int64_t odr_unit_b() {
  cellkv::CellCache<cellkv::Windows<0, 4>, cellkv::placement::clustered<8>> cache(
      {.max_write = 4, .max_cells = 32});
  const std::int32_t ids[] = {cache.seq_new().value()};
  return cache.declare_step(ids).value().read_len + static_cast<std::int64_t>(cellkv::reference::default_scale(64));
}
