// cellkv/batching/batching.hpp - the tier-0 batching layer (plain C++20, no CUDA header):
// plan_slices (how a prompt is cut into steps), SessionTable (sessions packed into steps), the
// sampling rule and its counter-based generator, the Model concept and the Executor that drives a
// model through a cache. The device sampler is tier 2: cellkv/batching/device_sampling.cuh.
#pragma once

#include "cellkv/batching/executor.hpp"
#include "cellkv/batching/model.hpp"
#include "cellkv/batching/philox.hpp"
#include "cellkv/batching/sampling.hpp"
#include "cellkv/batching/session_status.hpp"
#include "cellkv/batching/session_table.hpp"
#include "cellkv/batching/slices.hpp"
