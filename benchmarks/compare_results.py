"""Compares every number of two length-extrapolation results.json files.

    python benchmarks/compare_results.py OLD/results.json NEW/results.json [--tolerance 1e-6]

Walks both trees together and prints, per key path (list indices collapsed to `[]`), the largest
absolute difference of the numbers found at that path in both; keys present in only one file are
listed apart (keys a newer version added, or dropped). Keys that describe the run rather than
its numbers (timing, provenance, dates, the config, code hashes) are skipped. Exits 1 when any
difference exceeds the tolerance, or a number is None in one file and not the other.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

SKIP = {
    "timing",
    "provenance",
    "row_provenance",
    "config",
    "python_version",
    "seconds",
    "eval_seconds",
    "total_seconds",
    "eval_settings_sha256",
}


def walk(a, b, path, diffs, only, mismatched):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key in SKIP:
                continue
            sub = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                only.append((sub, "old" if key in a else "new"))
                continue
            walk(a[key], b[key], sub, diffs, only, mismatched)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            mismatched.append(f"{path}: lengths {len(a)} != {len(b)}")
            return
        for x, y in zip(a, b, strict=True):
            walk(x, y, f"{path}[]", diffs, only, mismatched)
        return
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str):
        if a != b:
            mismatched.append(f"{path}: {a!r} != {b!r}")
        return
    if a is None or b is None:
        if (a is None) != (b is None):
            mismatched.append(f"{path}: {a!r} vs {b!r}")
        return
    if isinstance(a, numbers) and isinstance(b, numbers):
        if math.isnan(a) and math.isnan(b):
            d = 0.0
        else:
            d = abs(float(a) - float(b))
        diffs[path] = max(diffs.get(path, 0.0), d)
        return
    mismatched.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--tolerance", type=float, default=1e-6)
    args = parser.parse_args(argv)
    old, new = (json.load(open(p)) for p in (args.old, args.new))
    diffs, only, mismatched = {}, [], []
    walk(old, new, "", diffs, only, mismatched)
    width = max((len(k) for k in diffs), default=10)
    for key in sorted(diffs):
        print(f"{key:<{width}}  {diffs[key]:.3g}")
    worst = max(diffs.values(), default=0.0)
    print(f"\n{len(diffs)} numeric keys compared; largest difference {worst:.3g}")
    for key, side in only:
        print(f"only in {side}: {key}")
    for line in mismatched:
        print(f"mismatch: {line}")
    return 1 if worst > args.tolerance or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
