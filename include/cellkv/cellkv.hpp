// cellkv/cellkv.hpp - every tier-0 header (plain C++20, no CUDA header reachable).
#pragma once

#include "cellkv/attention_plan.hpp"
#include "cellkv/cell_cache.hpp"
#include "cellkv/host_device.hpp"
#include "cellkv/host_pool.hpp"
#include "cellkv/layout.hpp"
#include "cellkv/placement.hpp"
#include "cellkv/position_table.hpp"
#include "cellkv/position_table_view.hpp"
#include "cellkv/pool_view.hpp"
#include "cellkv/reference.hpp"
#include "cellkv/seq_set.hpp"
#include "cellkv/sharding.hpp"
#include "cellkv/status.hpp"
#include "cellkv/step_plan.hpp"
#include "cellkv/visibility.hpp"
#include "cellkv/windows.hpp"
