#!/usr/bin/env bash
# Runs cellkv's attention benchmark and the PyTorch peers in one session on a CUDA machine, then
# prints one table with the ratios cellkv / best peer and draws it as a PNG.
# Usage: benchmarks/run_device.sh BUILD_DIR OUT_DIR [--quick]
set -uo pipefail
build="$1" out="$2" quick="${3:-}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
"$build/benchmarks/cellkv-bench-attention" $quick --out "$out/cellkv.jsonl" 2> "$out/cellkv.log" || echo "cellkv bench failed"
PYTHONUNBUFFERED=1 python3 "$here/peers.py" $quick --out "$out/peers.jsonl" 2> "$out/peers.log" || echo "peers failed"
python3 "$here/report.py" --cellkv "$out/cellkv.jsonl" --peers "$out/peers.jsonl" \
  --markdown "$out/results.md" --png "$out/results.png"
