#!/usr/bin/env python3
"""Writes the fuzz harness's seed corpus (tests/fuzz/corpus): for every cache type of
fuzz_cache.cpp, inputs with and without warm-up, small and large sizes, followed by operation bytes
from a fixed pseudo-random stream. Deterministic: running it again rewrites the same files.

    python3 tests/fuzz/make_corpus.py [OUT_DIR]
"""
import os
import random
import sys

TYPES = 11  # kTypes in fuzz_cache.cpp; the last one draws its sizes from int32 edges


def seeds():
    for kind in range(TYPES):
        for variant in range(6):
            rng = random.Random(1000 * kind + variant)
            sizes = rng.randrange(256) if variant % 3 else (0xFF if variant else 0x00)
            warm = variant % 2
            max_seqs = (variant * 3) % 9
            flags = warm | (max_seqs << 1)
            ops = bytes(rng.randrange(256) for _ in range((64, 700, 3000)[variant % 3]))
            yield f"type{kind:02d}-v{variant}", bytes([kind, sizes, flags]) + ops


def main(out):
    os.makedirs(out, exist_ok=True)
    for stale in os.listdir(out):
        if stale.startswith("type"):
            os.remove(os.path.join(out, stale))
    for name, data in seeds():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus"))
