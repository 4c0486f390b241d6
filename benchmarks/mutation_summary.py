"""Summarise ``mutmut results --all true`` for the selected functions as a markdown table (kill rate per function)."""

import fnmatch
import re
import sys
from collections import Counter, defaultdict


def main(results_path: str, patterns: list[str]) -> None:
    by_function: dict[str, Counter] = defaultdict(Counter)
    for line in open(results_path, encoding="utf-8"):
        match = re.match(r"\s*(\S+)__mutmut_\d+: (.+)$", line)
        if match and any(fnmatch.fnmatchcase(match[1] + "__mutmut_", p) for p in patterns):
            by_function[match[1]][match[2].strip()] += 1
    total: Counter = Counter()
    print("| function | mutants | run | killed | survived | other | kill rate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, counts in sorted(by_function.items()):
        total.update(counts)
        print(_row(name.replace("ǁ", "."), counts))
    print(_row("**all**", total))


def _row(name: str, counts: Counter) -> str:
    done = sum(n for status, n in counts.items() if status != "not checked")
    other = done - counts["killed"] - counts["survived"]
    rate = f"{counts['killed'] / done:.1%}" if done else "–"
    total = sum(counts.values())
    return f"| {name} | {total} | {done} | {counts['killed']} | {counts['survived']} | {other} | {rate} |"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
