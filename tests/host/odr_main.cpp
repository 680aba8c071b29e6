// Links odr_a.cpp and odr_b.cpp (and every header's own unit) and runs both.
#include <cstdint>
#include <cstdio>

std::int64_t odr_unit_a();
std::int64_t odr_unit_b();

int main() {
  const bool ok = odr_unit_a() == 1 && odr_unit_b() == 1;
  std::puts(ok ? "two units linked and ran" : "unexpected result");
  return ok ? 0 : 1;
}
