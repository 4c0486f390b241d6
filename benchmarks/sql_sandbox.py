"""The SQL sandbox's cost per query: a query answered by the reused sandbox child, a query that starts a fresh child
(what follows a time-out kill), and the same query on an in-process SQLite connection, medians over ``--repeats``.

    OMP_NUM_THREADS=1 python benchmarks/sql_sandbox.py --output benchmarks/results/sql_sandbox.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # this tree's package, ahead of an installed one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--output", default="benchmarks/results/sql_sandbox.csv")
    args = parser.parse_args()

    from trl_mrtpo.kits.sql import build_demo_databases
    from trl_mrtpo.kits.sql_sandbox import _WORKER, run_query
    from trl_mrtpo.kits.sql_sandbox_child import execute_query

    db = build_demo_databases(tempfile.mkdtemp())["shop"]
    query = "SELECT c.name, count(o.id) FROM customers c LEFT JOIN orders o ON o.customer_id = c.id GROUP BY c.id"

    def timed(run) -> float:
        times = []
        for i in range(args.repeats):
            started = time.perf_counter()
            run(i)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    run_query(db, "SELECT 1")  # the child is up
    arms = {
        # a distinct query text each time: the result cache must not answer
        "reused child": timed(lambda i: run_query(db, f"{query} -- {i}")),
        "fresh child": timed(lambda i: (_WORKER._stop(), run_query(db, f"{query} -- fresh {i}"))),
        "in process (no sandbox)": timed(lambda i: execute_query(db, query, 5.0, 10_000, 1_000_000)),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["arm", "median_ms", "repeats"])
        for arm, seconds in arms.items():
            writer.writerow([arm, f"{seconds * 1000:.2f}", args.repeats])
            print(f"{arm:<26}{seconds * 1000:8.2f} ms")


if __name__ == "__main__":
    main()
