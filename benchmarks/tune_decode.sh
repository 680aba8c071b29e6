#!/usr/bin/env bash
# Builds the attention benchmark once per decode-kernel configuration (warps per block, stages per
# warp, tile bytes: CELLKV_DECODE_WARPS, CELLKV_DECODE_STAGES, CELLKV_DECODE_TILE_BYTES) and times
# the decode shapes of each, every placement, in one run. Prints one line per configuration.
# Usage: benchmarks/tune_decode.sh OUT_DIR "W,S,TILE W,S,TILE ..."   (a CUDA machine; nvcc on PATH)
set -uo pipefail
out="$1" configs="${2:-4,3,8192}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
mkdir -p "$out"
cccl="$(dirname "$(dirname "$(command -v nvcc)")")/include/cccl"
name() { echo "w$1_s$2_t$3"; }
for c in $configs; do
  IFS=, read -r w s t <<< "$c"
  n=$(name "$w" "$s" "$t")
  nvcc -std=c++20 --expt-relaxed-constexpr -O3 -gencode=arch=compute_90,code=sm_90 -I"$root/include" \
    -isystem "$cccl" -DCELLKV_DECODE_WARPS="$w" -DCELLKV_DECODE_STAGES="$s" -DCELLKV_DECODE_TILE_BYTES="$t" \
    "$here/attention_bench.cu" -o "$out/bench_$n" > "$out/build_$n.log" 2>&1 &
done
wait
for c in $configs; do
  IFS=, read -r w s t <<< "$c"
  n=$(name "$w" "$s" "$t")
  if [ ! -x "$out/bench_$n" ]; then echo "$n: build failed"; tail -5 "$out/build_$n.log"; continue; fi
  "$out/bench_$n" --quick --only decode --out "$out/decode_$n.jsonl" 2> "$out/decode_$n.log"
  python3 - "$out/decode_$n.jsonl" "$n" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(sys.argv[2] + ": " + "  ".join(f"{r['shape']} {r['impl'].replace('cellkv_', '').replace('cell_', '')} {r['metric']:.2f}" for r in rows))
PY
done
