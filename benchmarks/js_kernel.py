"""Per-token JS between P_all and K removed contexts: naive full logits vs TRL's chunked op vs ours (CPU part).

Each measurement runs in a fresh subprocess pinned to one thread, so peak memory (max RSS above the inputs) and
time are not disturbed by the others. Writes ``benchmarks/results/js_kernel_cpu.csv`` and prints a table.

    python benchmarks/js_kernel.py                      # N=512, H=576, V in {49152, 152064}, K in {1, 3}
    python benchmarks/js_kernel.py --vocab 49152 --k 1 3 8
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

METHODS = ("naive", "trl", "ours")


def measure(method: str, tokens: int, hidden: int, vocab: int, contexts: int) -> dict:
    """Runs in the child process: one warm-up-free timed call, peak RSS growth over the inputs."""
    import resource
    import time

    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h_all = torch.randn(tokens, hidden, generator=gen)
    h_removed = torch.randn(contexts, tokens, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    if method == "naive":
        from trl_mrtpo.ops import js_divergence

        lp_all = torch.log_softmax(h_all @ weight.T, -1)
        q = torch.stack([js_divergence(lp_all, torch.log_softmax(h @ weight.T, -1)) for h in h_removed])
    elif method == "trl":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        # beta = 0.5 is TRL's generalised JSD with m = (p + q) / 2, i.e. JS in nats.
        q = torch.stack(
            [ChunkedDivergenceFunction.apply(h, weight, None, h_all, weight, None, 0.5)[0] for h in h_removed]
        ) / torch.log(torch.tensor(2.0))
    else:
        from trl_mrtpo.ops import replay_divergence

        q = replay_divergence(h_all, h_removed, weight)
    seconds = time.perf_counter() - started
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"seconds": seconds, "peak_extra_mb": max(peak_mb, 0.0), "checksum": float(q.double().sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 152064])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "js_kernel_cpu.csv"))
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, *sizes = args.child
        print(json.dumps(measure(method, *map(int, sizes))))
        return

    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for vocab in args.vocab:
        for k in args.k:
            for method in METHODS:
                child = [
                    sys.executable,
                    __file__,
                    "--child",
                    method,
                    str(args.tokens),
                    str(args.hidden),
                    str(vocab),
                    str(k),
                ]
                out = subprocess.run(child, capture_output=True, text=True, env=env, check=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                rows.append({"vocab": vocab, "k": k, "method": method, **result})
                print(
                    f"V={vocab:>6} K={k} {method:<6} {result['seconds']:8.2f} s {result['peak_extra_mb']:8.0f} MB",
                    flush=True,
                )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nN={args.tokens} H={args.hidden}, 1 thread; ratios within each (V, K):")
    for vocab in args.vocab:
        for k in args.k:
            by = {r["method"]: r for r in rows if r["vocab"] == vocab and r["k"] == k}
            print(
                f"V={vocab:>6} K={k}: ours {by['ours']['seconds']:.2f} s, TRL x{k} {by['trl']['seconds']:.2f} s "
                f"({by['trl']['seconds'] / by['ours']['seconds']:.1f}x), naive {by['naive']['seconds']:.2f} s; "
                f"extra memory ours {by['ours']['peak_extra_mb']:.0f} MB, "
                f"naive {by['naive']['peak_extra_mb']:.0f} MB"
            )
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
