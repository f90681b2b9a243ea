"""Print the busiest functions of each cProfile dump in a directory (see minisgl.utils.profiling).

python benchmarks/print_profiles.py DIR [--top 25]
"""

from __future__ import annotations

import argparse
import io
import pstats
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=25)
    ns = ap.parse_args()
    for path in sorted(Path(ns.dir).glob("*.prof")):
        text = io.StringIO()
        stats = pstats.Stats(str(path), stream=text).strip_dirs()
        print(f"===== {path.name}: {stats.total_tt:.2f} s profiled")
        stats.sort_stats("tottime").print_stats(ns.top)
        stats.sort_stats("cumulative").print_stats(ns.top)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
