#!/usr/bin/env bash
# run_fuzz.sh FUZZER SEED_CORPUS WORK_DIR [libFuzzer flags...]: runs every seed input, then fuzzes;
# new inputs go to WORK_DIR (in the build tree), never into the committed seed corpus.
set -eu
fuzzer=$1 seeds=$2 work=$3
shift 3
mkdir -p "$work"
exec "$fuzzer" "$@" "$work" "$seeds"
