// benchmarks/serve_model.hpp - the example decoder the serving benchmark runs (serve_bench.cu) and
// the fp8 model accuracy measures (fp8_model_accuracy.cu): 8 full-attention layers, dim 1024,
// H_q 16, H_kv 4, D 64, ffn 2816, vocab 16384, weights from llama::generate (seed 1). serve_peer.py
// holds the same config for the PyTorch peer. The Gemma-style model of the window-storage run
// (serve_bench.cu --window-storage): 5 layers of window 1,024 to 1 full-attention layer, the same
// other dims.
#pragma once

#include <cellkv/windows.hpp>

#include "llama/config.hpp"

namespace bench {

using ServeWindows = cellkv::Windows<0, 0, 0, 0, 0, 0, 0, 0>;  // every layer sees the whole context

inline const llama::Config kServeConfig{.vocab = 16384, .dim = 1024, .layers = ServeWindows::kLayers, .heads_q = 16,
                                        .heads_kv = 4, .head_dim = 64, .ffn = 2816};

using GemmaWindows = cellkv::Windows<1024, 1024, 1024, 1024, 1024, 0>;  // 5 local : 1 global
inline constexpr std::int32_t kGemmaWindow = 1024;

inline const llama::Config kGemmaConfig{.vocab = 16384, .dim = 1024, .layers = GemmaWindows::kLayers, .heads_q = 16,
                                        .heads_kv = 4, .head_dim = 64, .ffn = 2816};

}  // namespace bench
