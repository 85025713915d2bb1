"""Per-round ratios of benchmarks/run_served_ab.sh: side B's output tokens/s over side A's at each
concurrency, and their geometric mean over rounds.

usage: python benchmarks/served_ab.py served_ab_A_round1.json served_ab_B_round1.json ...
(`rayspec bench serve --output-json` files, one endpoint each, labelled A or B; the round is read
from the file name's `_round<i>`).
"""

import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path


def main(paths: list[str]) -> None:
    tput: dict[tuple[int, str, int], float] = {}
    for p in paths:
        rnd = int(re.search(r"_round(\d+)", Path(p).name).group(1))
        for r in json.loads(Path(p).read_text())["results"]:
            tput[(rnd, r["label"], r["concurrency"])] = r["output_throughput"]
    ratios: dict[int, list[float]] = defaultdict(list)
    print("| round | concurrency | A tok/s | B tok/s | B / A |")
    print("|---|---|---|---|---|")
    for rnd, label, conc in sorted(k for k in tput if k[1] == "A"):
        a, b = tput[(rnd, "A", conc)], tput.get((rnd, "B", conc))
        if b is None:
            continue
        ratios[conc].append(b / a)
        print(f"| {rnd} | {conc} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    for conc, rs in sorted(ratios.items()):
        mean = math.exp(sum(math.log(r) for r in rs) / len(rs))
        print(f"concurrency {conc}: B / A geometric mean {mean:.3f} over {len(rs)} rounds (min {min(rs):.3f}, "
              f"max {max(rs):.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
