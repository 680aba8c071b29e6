// cellkv/batching/batching.hpp - the tier-0 batching primitives (plain C++20, no CUDA header):
// plan_slices (how a prompt is cut into steps) and SessionTable (sessions packed into steps).
#pragma once

#include "cellkv/batching/session_table.hpp"
#include "cellkv/batching/slices.hpp"
