// Links the units that each include one CUDA-tier header on its own (an ODR break fails the link).
#include <cstdio>

int main() {
  std::puts("every CUDA-tier header compiled on its own; the units linked together");
  return 0;
}
