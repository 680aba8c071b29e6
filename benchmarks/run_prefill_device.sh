#!/usr/bin/env bash
# The prefill kernels' checks and timings on a fresh Hopper machine, in one go (about 6 minutes on
# an H200, most of it the two builds):
#   1. two builds side by side: BUILD_DIR (the default, consumer warpgroups taking turns) and
#      BUILD_DIR-free (CELLKV_PREFILL_PING_PONG=0, issuing freely; the benchmark only);
#   2. the prefill test cases, then compute-sanitizer memcheck, racecheck and synccheck on the
#      short prefill steps and on the short shared-prefix fork tree, each with its own log;
#   3. cellkv-bench-attention --only prefill twice in each build, --only mixed once, and the
#      per-sequence SDPA peers (peers.py --only prefill) in the same session;
#   4. Nsight Compute on the wgmma kernel at 8x1k (ncu, when installed): its sections, then the
#      stall reasons (cycles a warp spends stalled for each reason, per issued instruction);
#   5. summary.txt: the checks, then one row per shape with every run and the ratios to cuDNN.
# OUT_DIR gets summary.txt, cellkv.jsonl, peers.jsonl, ncu.txt and logs.tgz (five files: the
# device tool brings back at most eight).
#
#   benchmarks/run_prefill_device.sh BUILD_DIR OUT_DIR      (BUILD_DIR need not exist)
#   FREE=0 benchmarks/run_prefill_device.sh ...             (the default build alone, a minute less)
set -uo pipefail
build="${1:?usage: run_prefill_device.sh BUILD_DIR OUT_DIR}"
out="${2:?usage: run_prefill_device.sh BUILD_DIR OUT_DIR}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
logs="$(mktemp -d)"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
start=$SECONDS

note "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1) $(git -C "$root" rev-parse --short HEAD 2>/dev/null) $(date -u +%F)"
[ -d "$build" ] || meson setup "$build" "$root" >"$logs/setup.log" 2>&1
free="${FREE:-1}"
[ "$free" = 0 ] || [ -d "$build-free" ] || meson setup "$build-free" "$root" -Dtests=false -Dexamples=false \
  -Dcuda_args=-DCELLKV_PREFILL_PING_PONG=0 >>"$logs/setup.log" 2>&1
# Two builds at once; `wait` names them (a bare wait would also wait for tee's process substitutions).
ninja -C "$build" -j"$([ "$free" = 0 ] && echo 16 || echo 12)" tests/cuda/cellkv-gpu-tests benchmarks/cellkv-bench-attention >"$logs/build.log" 2>&1 &
default_build=$!
free_build=
if [ "$free" != 0 ]; then
  ninja -C "$build-free" -j4 benchmarks/cellkv-bench-attention >"$logs/build-free.log" 2>&1 &
  free_build=$!
fi
wait "$default_build" || note "default build failed ($logs/build.log)"
[ -z "$free_build" ] || wait "$free_build" || note "free-issue build failed"
note "built in $((SECONDS - start)) s; ptxas serialization warnings (C7518): $(cat "$logs"/build*.log | grep -c C7518)"

suite="$build/tests/cuda/cellkv-gpu-tests"
bench="$build/benchmarks/cellkv-bench-attention"
bench_free="$build-free/benchmarks/cellkv-bench-attention"
check() {  # name, command...: one line per check, the log kept
  local name="$1"; shift
  "$@" >"$logs/$name.log" 2>&1
  note "$(printf '%-28s rc=%d  %s' "$name" $? "$(grep -E 'test cases:|ERROR SUMMARY|RACECHECK SUMMARY' "$logs/$name.log" | tr -s ' ' | tr '\n' ' ')")"
}
check prefill-cases timeout 300 "$suite" -tc="prefill kernels*"
for tool in memcheck racecheck synccheck; do
  args=(--tool "$tool" --error-exitcode 1)
  [ "$tool" = memcheck ] && args+=(--leak-check full)
  [ "$tool" = racecheck ] && args+=(--racecheck-report all)
  check "prefill-short-$tool" timeout 300 compute-sanitizer "${args[@]}" "$suite" -tc="prefill kernels: short*"
  check "fork-tree-$tool" timeout 300 compute-sanitizer "${args[@]}" "$suite" -tc="shared prefixes: a short fork tree*"
done

: >"$out/cellkv.jsonl"
for run in 1 2; do
  "$bench" --only prefill --out "$logs/default-$run.jsonl" 2>>"$logs/bench.log"
  [ "$free" = 0 ] || "$bench_free" --only prefill --out "$logs/free-$run.jsonl" 2>>"$logs/bench.log"
done
"$bench" --only mixed --out "$logs/default-mixed.jsonl" 2>>"$logs/bench.log"
PYTHONUNBUFFERED=1 python3 "$here/peers.py" --only prefill --impls sdpa_cudnn_per_seq,sdpa_flash_per_seq \
  --out "$out/peers.jsonl" 2>"$logs/peers.log" || note "peers failed ($logs/peers.log)"
if command -v ncu >/dev/null; then
  profile() { ncu --kernel-name regex:prefill_wgmma --launch-skip 3 --launch-count 1 "$@" "$bench" --quick --only prefill:8x1k; }
  profile --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section LaunchStats >"$out/ncu.txt" 2>&1
  # A run of its own, so that a metric this ncu lacks costs only these lines.
  profile --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' >>"$out/ncu.txt" 2>&1
fi

# Every run's rows into cellkv.jsonl (with "run": the build and the run), then the table.
python3 - "$logs" "$out" <<'PY' | tee -a "$summary"
import glob, json, os, sys
logs, out = sys.argv[1], sys.argv[2]
runs = {}
with open(os.path.join(out, "cellkv.jsonl"), "w") as rows:
    for path in sorted(glob.glob(os.path.join(logs, "*.jsonl"))):
        run = os.path.basename(path)[:-len(".jsonl")]
        for line in open(path):
            row = json.loads(line)
            row["run"] = run
            rows.write(json.dumps(row) + "\n")
            runs.setdefault((row["work"], row["shape"], row["impl"]), []).append(f'{run} {row["metric"]:.4g}')
peers = {}
peer_path = os.path.join(out, "peers.jsonl")
if os.path.exists(peer_path):
    for line in open(peer_path):
        row = json.loads(line)
        peers[(row["shape"], row["impl"])] = row["metric"]
for (work, shape, impl), values in sorted(runs.items()):
    cudnn = peers.get((shape, "sdpa_cudnn_per_seq"))
    best = max(float(v.split()[1]) for v in values)
    ratio = f"  best / cuDNN {best / cudnn:.2f}x (cuDNN {cudnn:.1f})" if cudnn and work == "prefill" else ""
    print(f"{work:8} {shape:12} {impl:28} {' | '.join(values)}{ratio}")
PY
grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Eligible Warps|Warp Cycles Per Issued|Achieved Active Warps|issue_stalled" \
  "$out/ncu.txt" 2>/dev/null | tee -a "$summary"
note "done in $((SECONDS - start)) s"
tar -czf "$out/logs.tgz" -C "$logs" .
