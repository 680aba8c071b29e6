#!/usr/bin/env bash
# Builds and runs tests/consumer, a project that uses cellkv as a Meson subproject.
# Usage: check.sh MESON SOURCE_DIR BUILD_DIR
set -euo pipefail
meson="$1" src="$2" build="$3"
rm -rf "$build"
"$meson" setup "$build" "$src" >"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
"$meson" compile -C "$build" >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
"$build/consumer"
