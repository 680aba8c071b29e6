// Uses cellkv through the subproject dependency: one sequence, one step, its read_len.
#include <cellkv/cellkv.hpp>
#include <cstdio>

int main() {
  cellkv::CellCache<cellkv::Windows<0>> cache({.max_write = 4, .max_cells = 16});
  const std::int32_t a = cache.seq_new().value();
  const std::int32_t ids[] = {a, a, a};
  const auto plan = cache.declare_step(ids);
  std::printf("consumer: read_len %lld\n", static_cast<long long>(plan.value().read_len));
  return plan.ok() && plan.value().read_len == 3 ? 0 : 1;
}
