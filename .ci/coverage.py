#!/usr/bin/env python3
"""Tier-0 line coverage of a host suite built with gcc --coverage (meson -Db_coverage=true).

    python3 .ci/coverage.py BUILD_DIR MIN_PERCENT OUT_LOG

Runs gcovr over the plain C++ headers of the library (include/cellkv/*.hpp, detail/, and the
batching .hpp headers; not include/cellkv/gpu/, not .cuh), prints the per-file table and the
total, and writes OUT_LOG: one meson-testlog-style JSON line, result OK when the total is at least
MIN_PERCENT, so .ci/summarize.py counts it as one test passed or failed.
"""
import json
import os
import subprocess
import sys

FILTERS = [r"include/cellkv/[^/]+\.hpp$", r"include/cellkv/detail/[^/]+\.hpp$", r"include/cellkv/batching/[^/]+\.hpp$"]


def main(build, minimum, out_log):
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    args = ["gcovr", "--root", root, "--object-directory", os.path.abspath(build)]
    for f in FILTERS:
        args += ["--filter", f]
    summary_path = os.path.join(build, "coverage-summary.json")
    res = subprocess.run(args + ["--txt", "--json-summary", summary_path], capture_output=True, text=True)
    report = res.stdout + res.stderr
    percent = None
    if res.returncode == 0 and os.path.exists(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
        covered, total = summary.get("line_covered", 0), summary.get("line_total", 0)
        percent = 100.0 * covered / total if total else 0.0
        line = f"tier-0 line coverage: {percent:.1f}% ({covered} of {total} lines), required >= {minimum}%"
    else:
        line = f"tier-0 line coverage: gcovr failed (exit {res.returncode})"
    print(report)
    print(line)
    ok = percent is not None and percent >= minimum
    with open(out_log, "w", encoding="utf-8") as f:
        f.write(json.dumps({"name": "tier-0 line coverage", "result": "OK" if ok else "FAIL", "stdout": line + "\n"}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), sys.argv[3]))
