// cellkv/batching/slices.hpp - how a prompt of `total` tokens is cut into step-sized slices.
//
//   plan_slices(10, 8, 2)  ->  {0, 8, prefill}, {8, 2, prefill}
//   plan_slices( 9, 8, 2)  ->  {0, 8, prefill}, {8, 1, decode}
//   plan_slices(11, 8, 5)  ->  {0, 8, prefill}, {8, 1, decode}, {9, 1, decode}, {10, 1, decode}
//   first_slice(11, 8, 5)  ->  {0, 8, prefill}     (plan_slices(...).front(), without the plan)
//
// Contract (total >= 0, max_step_tokens >= 1, min_prefill_tokens >= 1):
// - the slices are in order and cover [0, total) exactly: slice i+1 begins where slice i ends;
// - a prefill slice has length L with min_prefill_tokens <= L <= max_step_tokens and L > 1;
// - a decode slice has length 1;
// - the prompt is cut into floor(total / max_step_tokens) full chunks of max_step_tokens tokens
//   and a remainder r = total % max_step_tokens; a full chunk runs as one prefill slice, the
//   remainder as one prefill slice of r tokens; a chunk or remainder that cannot be a prefill slice
//   (fewer than min_prefill_tokens tokens, or a single token) runs as one-token decode slices.
//   So max_step_tokens == 1 makes every token a decode slice, and max_step_tokens <
//   min_prefill_tokens makes every token a decode slice too.
// Invalid arguments (valid_slice_arguments false) and total == 0 give an empty plan.
#pragma once

#include <cstdint>
#include <vector>


namespace cellkv::batching {

// How a slice runs: prefill = several tokens in one step; decode = one token in one step.
enum class Method : std::uint8_t { prefill, decode };

// Tokens [begin, begin + length) of a prompt, relative to the first token being planned.
struct Slice {
  std::int32_t begin = 0;
  std::int32_t length = 0;
  Method method = Method::prefill;
  friend bool operator==(const Slice&, const Slice&) = default;
};

// True when plan_slices accepts the arguments.
[[nodiscard]] constexpr bool valid_slice_arguments(std::int32_t total, std::int32_t max_step_tokens,
                                                   std::int32_t min_prefill_tokens) noexcept {
  return total >= 0 && max_step_tokens >= 1 && min_prefill_tokens >= 1;
}

namespace detail {

// Appends [begin, begin + length) as one prefill slice when allowed, else as one-token decodes.
inline void append_run(std::vector<Slice>& out, std::int32_t begin, std::int32_t length,
                       std::int32_t min_prefill_tokens) {
  if (length > 1 && length >= min_prefill_tokens) {
    out.push_back({begin, length, Method::prefill});
    return;
  }
  for (std::int32_t i = 0; i < length; ++i) out.push_back({begin + i, 1, Method::decode});
}

}  // namespace detail

// The slices of a prompt of `total` tokens (see the contract above); empty on invalid arguments.
[[nodiscard]] inline std::vector<Slice> plan_slices(std::int32_t total, std::int32_t max_step_tokens,
                                                    std::int32_t min_prefill_tokens) {
  std::vector<Slice> out;
  if (!valid_slice_arguments(total, max_step_tokens, min_prefill_tokens)) return out;
  const std::int32_t full = total / max_step_tokens;
  for (std::int32_t c = 0; c < full; ++c)
    detail::append_run(out, c * max_step_tokens, max_step_tokens, min_prefill_tokens);
  detail::append_run(out, full * max_step_tokens, total % max_step_tokens, min_prefill_tokens);
  return out;
}

// The first slice of plan_slices(total, max_step_tokens, min_prefill_tokens), without building the
// plan: {0, L, prefill} with L = min(total, max_step_tokens) when L > 1 and L >= min_prefill_tokens,
// else {0, 1, decode}. Slice{} (length 0) when total == 0 or the arguments are invalid.
[[nodiscard]] constexpr Slice first_slice(std::int32_t total, std::int32_t max_step_tokens,
                                          std::int32_t min_prefill_tokens) noexcept {
  if (!valid_slice_arguments(total, max_step_tokens, min_prefill_tokens) || total == 0) return {};
  const std::int32_t length = total < max_step_tokens ? total : max_step_tokens;
  if (length > 1 && length >= min_prefill_tokens) return {0, length, Method::prefill};
  return {0, 1, Method::decode};
}

}  // namespace cellkv::batching
