#!/usr/bin/env python3
"""Sums meson test logs into one line: 'N passed, N failed, N skipped'.

doctest suites count their test cases (a suite that exits 77 because there is no GPU counts
every case it would have run as skipped); every other meson test counts as one.
"""
import json
import re
import sys

CASES = re.compile(r"\[doctest\] test cases:\s*(\d+)\s*\|\s*(\d+) passed\s*\|\s*(\d+) failed\s*\|\s*(\d+) skipped")
WOULD_RUN = re.compile(r"\[doctest\] unskipped test cases passing the current filters:\s*(\d+)")


def count(entry):
    out = (entry.get("stdout") or "") + (entry.get("stderr") or "")
    result = entry.get("result", "")
    if result == "SKIP":
        m = WOULD_RUN.search(out)
        return (0, 0, int(m.group(1)) if m else 1)
    m = CASES.search(out)
    if m:
        total, passed, failed, skipped = map(int, m.groups())
        if result not in ("OK", "EXPECTEDFAIL") and failed == 0:
            failed = 1  # crashed or timed out after doctest's summary
        return (passed, failed, skipped)
    return (1, 0, 0) if result in ("OK", "EXPECTEDFAIL") else (0, 1, 0)


def main(paths):
    passed = failed = skipped = 0
    for path in paths:
        try:
            lines = open(path, encoding="utf-8").read().splitlines()
        except OSError:
            print(f"{path}: missing (its build or test run failed)", file=sys.stderr)
            failed += 1
            continue
        for line in lines:
            if line.strip():
                p, f, s = count(json.loads(line))
                passed, failed, skipped = passed + p, failed + f, skipped + s
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
