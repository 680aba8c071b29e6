// cellkv/batching/batching.hpp - the tier-0 batching layer (plain C++20, no CUDA header):
// plan_slices (how a prompt is cut into steps), SessionTable (sessions packed into steps), the
// Model concept and the Executor that drives a model through a cache.
#pragma once

#include "cellkv/batching/executor.hpp"
#include "cellkv/batching/model.hpp"
#include "cellkv/batching/session_table.hpp"
#include "cellkv/batching/slices.hpp"
