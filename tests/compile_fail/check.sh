#!/usr/bin/env bash
# check.sh SOURCE INCLUDE_DIR MAX_SEQS EXPECT COMPILER... : compiles SOURCE with -DCELLKV_MAX_SEQS=MAX_SEQS.
# EXPECT = pass: the compile must succeed. Otherwise the compile must fail and its output must
# contain EXPECT (the static_assert's message), so an unrelated error does not pass for the check.
set -u
src=$1 inc=$2 value=$3 expect=$4
shift 4
out=$("$@" -std=c++20 -fsyntax-only -I"$inc" -DCELLKV_MAX_SEQS="$value" "$src" 2>&1)
rc=$?
if [ "$expect" = pass ]; then
  [ $rc -eq 0 ] && exit 0
  echo "MaxSeqs=$value: expected to compile, failed:"; echo "$out" | head -20; exit 1
fi
if [ $rc -eq 0 ]; then echo "MaxSeqs=$value: compiled, expected a failure naming '$expect'"; exit 1; fi
if grep -qF -- "$expect" <<<"$out"; then echo "MaxSeqs=$value: refused at compile time as expected"; exit 0; fi
echo "MaxSeqs=$value: failed to compile, but not with '$expect':"; echo "$out" | head -20
exit 1
