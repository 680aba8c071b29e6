// The sampled tokens of the steps a host-sampling model ran and the executor has not retired yet
// (HostLlama samples on the host; TpLlama hands its ids back synchronously): the tokens one step
// behind, which later steps read as their deferred input tokens, and the queue retire() drains.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

#include <cellkv/batching/model.hpp>
#include <cellkv/status.hpp>

namespace llama {

class SampledSteps {
 public:
  struct Step {
    std::vector<std::int32_t> tokens;  // one per sampled logit row
    std::vector<float> logprobs;
  };

  // step.tokens with every deferred token replaced by the last pushed step's sample. Refuses
  // (bad_argument, tokens unspecified) a deferred token that step did not sample.
  [[nodiscard]] cellkv::Status resolve(const cellkv::batching::ForwardStep& step, std::vector<std::int32_t>& tokens) const {
    tokens.assign(step.tokens.begin(), step.tokens.end());
    for (const cellkv::batching::DeferredToken& d : step.deferred) {
      if (d.row < 0 || static_cast<std::size_t>(d.row) >= tokens.size() || d.source < 0 ||
          static_cast<std::size_t>(d.source) >= last_.size())
        return cellkv::Errc::bad_argument;
      tokens[static_cast<std::size_t>(d.row)] = last_[static_cast<std::size_t>(d.source)];
    }
    return {};
  }

  // A step's samples, newest last.
  void push(Step step) {
    last_ = step.tokens;
    queue_.push_back(std::move(step));
  }

  // The oldest step's samples into tokens and logprobs (sizes must match), then forgets it.
  [[nodiscard]] cellkv::Status retire(std::span<std::int32_t> tokens, std::span<float> logprobs) {
    if (queue_.empty() || tokens.size() != queue_.front().tokens.size() || logprobs.size() != tokens.size())
      return cellkv::Errc::bad_argument;
    std::copy(queue_.front().tokens.begin(), queue_.front().tokens.end(), tokens.begin());
    std::copy(queue_.front().logprobs.begin(), queue_.front().logprobs.end(), logprobs.begin());
    queue_.pop_front();
    return {};
  }

 private:
  std::deque<Step> queue_;
  std::vector<std::int32_t> last_;  // tokens of the last pushed step
};

}  // namespace llama
