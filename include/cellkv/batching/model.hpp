// cellkv/batching/model.hpp - the small concept a model satisfies so the executor can drive it.
//
// The executor places each step in the cache (declare_step) and then calls model.forward(step,
// logits): a forward over the step's tokens at their positions through the cache (the model
// holds the cache it was built with: host pools or a gpu::DeviceCache, and its own stream),
// writing the logits of the rows the executor asks for. Steps of one token run the decode
// method, wider ones the prefill method; a model that cannot run a prefill below
// min_prefill_tokens() gets such steps padded (padding rows write a scratch row, see nothing, and
// their outputs are ignored).
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "cellkv/batching/slices.hpp"
#include "cellkv/status.hpp"

namespace cellkv::batching {

struct ForwardStep {
  std::span<const std::int32_t> tokens;      // [T] token ids of the placed step, in step order
  std::span<const std::int32_t> positions;   // [T] their positions (from the cache's placement)
  std::span<const std::int32_t> logit_rows;  // rows whose logits are wanted, ascending
  Method method = Method::prefill;           // decode iff T == 1
};

template <class M>
concept Model = requires(M& m, const M& cm, const ForwardStep& step, std::span<float> logits) {
  // Vocabulary size: logits has logit_rows.size() * vocab() floats, row by row.
  { cm.vocab() } -> std::convertible_to<std::int32_t>;
  // The narrowest step the prefill method serves (>= 2).
  { cm.min_prefill_tokens() } -> std::convertible_to<std::int32_t>;
  { m.forward(step, logits) } -> std::same_as<Status>;
};

}  // namespace cellkv::batching
