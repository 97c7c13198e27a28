"""Usage: python tools/ab_ratios.py HOST_AB_LOG

The median after/before ratio of host time per case over the alternating process pairs that
``tools/device.sh host-ab`` logged (lines ``after 2: <case>  host  1.523 ms ...``): one process's
times drift 20-40% from another's, so the pairs' ratios, not the runs' times, compare the trees.
"""

from __future__ import annotations

import collections
import re
import statistics
import sys

LINE = re.compile(r"(after|before) (\d+): (\S+)\s+host\s+([\d.]+) ms")


def pair_ratios(lines) -> dict[str, list[float]]:
    """Case -> the after/before host-time ratio of each pair that has both."""
    times: dict[tuple[str, str], dict[str, float]] = collections.defaultdict(dict)
    for line in lines:
        match = LINE.match(line)
        if match:
            tree, pair, case, ms = match.groups()
            times[(case, pair)][tree] = float(ms)
    ratios: dict[str, list[float]] = collections.defaultdict(list)
    for (case, _), both in times.items():
        if len(both) == 2:
            ratios[case].append(both["after"] / both["before"])
    return ratios


def main() -> None:
    with open(sys.argv[1]) as log:
        ratios = pair_ratios(log)
    for case, values in ratios.items():
        print(f"{case}: after/before host time, median of {len(values)} pairs {statistics.median(values):.3f} "
              f"(pairs {min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
