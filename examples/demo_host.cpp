// The main demo, built without CUDA: the host reference path.
//   build/examples/cellkv-demo
#include "demo_host.hpp"

int main() { return demo::run_host(); }
