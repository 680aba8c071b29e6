#!/usr/bin/env bash
# Builds and runs tests/consumer, a project that uses cellkv as a Meson subproject, and checks that
# nothing it builds links cuBLAS (cellkv-cuda is the CUDA runtime only).
# Usage: check.sh MESON SOURCE_DIR BUILD_DIR
set -euo pipefail
meson="$1" src="$2" build="$3"
rm -rf "$build"
"$meson" setup "$build" "$src" >"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
"$meson" compile -C "$build" >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
if grep -qi cublas "$build/build.ninja"; then
  echo "consumer: a target links cuBLAS, which cellkv's dependencies must not bring:"
  grep -i cublas "$build/build.ninja" | head -5
  exit 1
fi
"$build/consumer"
if [ -x "$build/consumer-cuda" ]; then "$build/consumer-cuda"; fi
