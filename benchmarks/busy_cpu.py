"""The demo's wall time on a CPU, alone and beside one busy single-threaded process, with torch's old thread count
(every core) and the CLI's default (the free cores, ``trl_mrtpo.scripts.default_threads``).

    python benchmarks/busy_cpu.py --steps 3

Each case runs ``trl-mrtpo demo --steps N`` in a fresh process and times it end to end (model load included).
The busy process is a pure-Python loop at the priority ``--nice`` gives (19: a background job; 0: an equal one),
started a minute before the demo so that the load average the default reads has seen it. A case that runs past
``--timeout`` is stopped and reported as such. Writes ``results/busy_cpu.csv`` (a ``--busy-only`` run adds its rows)
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]


def run_demo(steps: int, threads: int | None, timeout: float) -> tuple[float, bool]:
    """Seconds the demo took, and whether it finished within ``timeout``."""
    with tempfile.TemporaryDirectory() as out:
        command = ["trl-mrtpo", "demo", "--steps", str(steps), "--output-dir", out]
        if threads is not None:
            command += ["--threads", str(threads)]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        started = time.perf_counter()
        try:
            subprocess.run(command, env=env, check=True, timeout=timeout, capture_output=True)
            return time.perf_counter() - started, True
        except subprocess.TimeoutExpired:
            return time.perf_counter() - started, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--settle", type=float, default=75.0, help="seconds the busy loop runs before the demo")
    parser.add_argument("--nice", type=int, default=19, help="the busy loop's niceness")
    parser.add_argument("--busy-only", action="store_true", help="skip the cases with nothing beside the demo")
    parser.add_argument("--output", default=str(HERE / "results" / "busy_cpu.csv"))
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for busy in (True,) if args.busy_only else (False, True):
        loop = subprocess.Popen(["nice", "-n", str(args.nice), *BUSY_LOOP]) if busy else None
        try:
            if loop is not None:
                time.sleep(args.settle)
            for label, threads in (("every core (the old default)", cores), ("free cores (default)", None)):
                seconds, finished = run_demo(args.steps, threads, args.timeout)
                rows.append(
                    {
                        "beside": f"one busy process (nice {args.nice})" if busy else "nothing",
                        "threads": label,
                        "steps": args.steps,
                        "seconds": round(seconds, 1),
                        "finished": finished,
                    }
                )
                print(rows[-1], flush=True)
        finally:
            if loop is not None:
                loop.kill()
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    appending = output.exists() and args.busy_only  # a busy-only run adds its rows to the full run's
    with open(output, "a" if appending else "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        if not appending:
            writer.writeheader()
        writer.writerows(rows)
    flags = f"--steps {args.steps} --nice {args.nice}" + (" --busy-only" if args.busy_only else "")
    print(f"\n{cores} cores, `python benchmarks/busy_cpu.py {flags}`\n")
    print("| beside | threads | demo seconds |\n|---|---|---|")
    for row in rows:
        seconds = f"{row['seconds']}" if row["finished"] else f"> {row['seconds']} (stopped)"
        print(f"| {row['beside']} | {row['threads']} | {seconds} |")


if __name__ == "__main__":
    main()
