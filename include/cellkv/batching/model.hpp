// cellkv/batching/model.hpp - the small concept a model satisfies so the executor can drive it.
//
// The executor places each step in the cache (declare_step) and then calls model.forward(step): a
// forward over the step's tokens at their positions through the cache (the model holds the cache
// it was built with: host pools or a gpu::DeviceCache, and its own stream), then the sampling of
// each logit row the executor asks for, by the rule of sampling.hpp with that row's SampleRow. Only
// the sampled ids (and, for rows that ask, their log-probs) ever come back:
// model.retire(tokens, logprobs) waits for the oldest forward not yet retired and writes them.
//
// forward may return before the step has run (a GPU model enqueues it on its stream), so the
// executor overlaps steps: it calls forward(n + 1) before retire(n), and at most two forwards are
// ever un-retired. A token of step n + 1 whose id is still on the device is a DeferredToken: the
// model reads it from the ids it sampled in its previous successful forward (on the device,
// without a copy to the host). A forward that returns a refusal enqueued nothing that retire would
// return, and leaves the previous forward's sampled ids in place.
//
// Steps of one token run the decode method, wider ones the prefill method; a model that cannot run
// a prefill below min_prefill_tokens() gets such steps padded (padding rows write a scratch row,
// see nothing, and their outputs are ignored).
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "cellkv/batching/sampling.hpp"
#include "cellkv/batching/session_table.hpp"
#include "cellkv/batching/slices.hpp"
#include "cellkv/status.hpp"

namespace cellkv::batching {

struct ForwardStep {
  // [T] token ids of the placed step, in step order; kPendingToken where `deferred` names the row.
  std::span<const std::int32_t> tokens;
  std::span<const std::int32_t> positions;    // [T] their positions (from the cache's placement)
  std::span<const std::int32_t> logit_rows;   // [R] rows to sample, ascending
  std::span<const SampleRow> sampling;        // [R] how to sample each of them
  std::span<const DeferredToken> deferred;    // ids to read from the previous forward's samples
  Method method = Method::prefill;            // decode iff T == 1
};

template <class M>
concept Model = requires(M& m, const M& cm, const ForwardStep& step, std::span<std::int32_t> tokens,
                         std::span<float> logprobs) {
  // Vocabulary size: sampled ids lie in [0, vocab()).
  { cm.vocab() } -> std::convertible_to<std::int32_t>;
  // The narrowest step the prefill method serves (>= 2).
  { cm.min_prefill_tokens() } -> std::convertible_to<std::int32_t>;
  // Runs (or enqueues) the forward and the sampling of step.logit_rows.
  { m.forward(step) } -> std::same_as<Status>;
  // Waits for the oldest un-retired forward; tokens and logprobs have its R entries (logprobs are
  // written for rows whose SampleRow asks; the others are unspecified). bad_argument when no
  // forward is un-retired or a size differs.
  { m.retire(tokens, logprobs) } -> std::same_as<Status>;
};

}  // namespace cellkv::batching
