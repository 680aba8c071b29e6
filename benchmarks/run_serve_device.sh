#!/usr/bin/env bash
# The serving run on a fresh GPU machine, in one go (about 6 minutes on an H200):
#   1. the PyTorch peer (serve_peer.py) starts at once in the background: it makes the weights,
#      compiles and warms its decode step for every batch size, then waits;
#   2. meanwhile the needed targets build: the GPU serving tests, the demo, cellkv-bench-serve,
#      cellkv-bench-fp8-model;
#   3. the GPU serving tests (sampler, model against the host model, executor) and the GPU demo;
#   4. once the peer is warm (or after a deadline), cellkv-bench-serve alone on the GPU, which also
#      writes its weights for the peer's check;
#   5. the peer's timed steps alone on the GPU;
#   6. cellkv-bench-serve --parallel-sampling alone on the GPU: 16 prompts of 2,048 tokens x 8
#      samples, 256 new tokens each, with shared prefixes read once per step and without;
#   7. the fp8 KV cache: the GPU demo with --kv fp8, its accuracy on the example model
#      (cellkv-bench-fp8-model: KL of next-token distributions against a bf16 cache, into
#      results-fp8-model.jsonl), cellkv-bench-serve --kv fp8 (rows cellkv_cell_fp8);
#   8. one table: cellkv against the peer, the step breakdown, the floor, the targets, fp8 against
#      bf16, then the parallel-sampling rows.
# Logs, results-serve.jsonl and results-fp8-model.jsonl go to OUT_DIR (12 files); the weights file
# goes to $TMPDIR.
#
#   benchmarks/run_serve_device.sh BUILD_DIR OUT_DIR      (after: meson setup BUILD_DIR; gpu_arch defaults to 90a)
set -uo pipefail
build="${1:?usage: run_serve_device.sh BUILD_DIR OUT_DIR}"
out="${2:?usage: run_serve_device.sh BUILD_DIR OUT_DIR}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"
tmp="$(mktemp -d)"
weights="${TMPDIR:-/tmp}/cellkv-serve-weights.bin"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
summary="$out/summary.md"
note() { printf '[%4ds] %s\n' "$SECONDS" "$*" | tee -a "$summary"; }
: > "$summary"
note "$(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 | head -1)"

# 1. the peer, in the background
rm -f "$weights"
python3 "$here/serve_peer.py" --sessions 1,16,64,256 --out "$tmp/peer.jsonl" --ready "$tmp/peer.ready" \
  --go "$tmp/peer.go" --wait 240 --check-weights "$weights" > "$out/peer.log" 2>&1 &
peer=$!

# 2. the build
jobs=$(nproc 2>/dev/null || echo 8)
[ "$jobs" -gt 4 ] && jobs=$((jobs - 2))
timeout 180 ninja -C "$build" -j"$jobs" tests/cuda/cellkv-gpu-serving-tests examples/cellkv-demo \
  benchmarks/cellkv-bench-serve benchmarks/cellkv-bench-fp8-model > "$out/build.log" 2>&1
note "build: rc=$? ($(grep -c 'Compiling\|Linking' "$out/build.log") steps)"

# 3. tests and demo
timeout 120 "$build/tests/cuda/cellkv-gpu-serving-tests" > "$out/tests.log" 2>&1
note "gpu serving tests: rc=$? $(grep -E 'test cases:' "$out/tests.log" | tail -1)"
timeout 60 "$build/examples/cellkv-demo" > "$out/demo.log" 2>&1
note "gpu demo: rc=$? $(grep -E '^OK|^FAILED|tokens/s$' "$out/demo.log" | tail -2 | tr '\n' ' ')"

# 4. cellkv's benchmark once the peer is warm (it waits at most until 180 s into the run)
while [ ! -e "$tmp/peer.ready" ] && kill -0 "$peer" 2>/dev/null && [ "$SECONDS" -lt 180 ]; do sleep 1; done
note "peer warm: $([ -e "$tmp/peer.ready" ] && echo yes || echo no)"
timeout 90 "$build/benchmarks/cellkv-bench-serve" --out "$tmp/cellkv.jsonl" --weights-out "$weights" \
  > "$out/bench.log" 2>&1
note "cellkv-bench-serve: rc=$?"

# 5. the peer's timed steps
touch "$tmp/peer.go"
( sleep 90; kill "$peer" 2>/dev/null ) & guard=$!
wait "$peer"
note "peer: rc=$? $(grep -E 'weights against' "$out/peer.log" | tail -1)"
kill "$guard" 2>/dev/null

# 6. parallel sampling, sharing on and off
timeout 120 "$build/benchmarks/cellkv-bench-serve" --parallel-sampling --out "$tmp/sampling.jsonl" \
  > "$out/sampling.log" 2>&1
note "cellkv-bench-serve --parallel-sampling: rc=$?"

# 7. the fp8 KV cache: demo, accuracy on the model, serving rows
timeout 60 "$build/examples/cellkv-demo" --kv fp8 > "$out/demo-fp8.log" 2>&1
note "gpu demo --kv fp8: rc=$? $(grep -E '^OK|^FAILED|tokens/s$' "$out/demo-fp8.log" | tail -2 | tr '\n' ' ')"
timeout 120 "$build/benchmarks/cellkv-bench-fp8-model" --out "$out/results-fp8-model.jsonl" > "$out/fp8-model.log" 2>&1
note "cellkv-bench-fp8-model: rc=$? $(grep -E '^  all ' "$out/fp8-model.log" | tr -s ' ')"
timeout 90 "$build/benchmarks/cellkv-bench-serve" --kv fp8 --out "$tmp/cellkv-fp8.jsonl" > "$out/bench-fp8.log" 2>&1
note "cellkv-bench-serve --kv fp8: rc=$?"

# 8. the table
cat "$tmp/cellkv.jsonl" "$tmp/cellkv-fp8.jsonl" "$tmp/peer.jsonl" "$tmp/sampling.jsonl" > "$out/results-serve.jsonl" 2>/dev/null
python3 "$here/serve_peer.py" --report "$out/results-serve.jsonl" | tee -a "$summary"
note "done"
rm -rf "$tmp" "$weights"
