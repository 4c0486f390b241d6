"""Per-token JS between P_all and K removed contexts: naive full logits vs TRL's chunked op vs ours.

Methods, all returning the same ``[K, N]`` relevance (checksums, and the largest error against the float64 textbook
JS of ``tests/reference.py`` over the first 64 tokens, are written):

- ``naive``: full ``[N, V]`` logits per context, log-softmax, :func:`trl_mrtpo.ops.js_divergence`.
- ``trl``: TRL's ``ChunkedDivergenceFunction`` (``beta=0.5``, i.e. JS) called once per removed context; it
  recomputes ``P_all`` every call. On CUDA it runs TRL's Triton kernels.
- ``ours``: :func:`trl_mrtpo.ops.replay_divergence` with the torch backend (chunked, ``P_all`` shared).
- ``triton`` (CUDA only): the same entry point with the fused Triton backend.

Each measurement runs in a fresh subprocess (CPU: pinned to one thread), so peak memory and time are not disturbed
by the others. CPU memory is the peak resident set size above the one before the call (Linux: the peak is reset
through ``/proc/self/clear_refs``); CUDA memory is ``max_memory_allocated`` above the inputs. CUDA times are the
median of 5 calls after a warm-up; CPU times are one call. Writes ``benchmarks/results/js_kernel_<device>.csv``
and prints a table.

    python benchmarks/js_kernel.py                          # CPU: V in {49152, 152064}, K in {1, 3, 8}
    python benchmarks/js_kernel.py --device cuda --tokens 4096 --hidden 3584
    python benchmarks/js_kernel.py --sweep-chunk            # CPU chunk size of the torch backend
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]  # for tests/reference.py, the float64 reference the tests use


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ":"))


def measure(method: str, device: str, tokens: int, hidden: int, vocab: int, contexts: int, chunk: int) -> dict:
    """Runs in the child process; imports happen before the clock and the memory baseline."""
    import statistics
    import time

    import torch
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    from trl_mrtpo.ops import js_divergence, replay_divergence

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h_all = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    h_removed = torch.randn(contexts, tokens, hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device, dtype)

    def run():
        if method == "naive":
            lp_all = torch.log_softmax(h_all.float() @ weight.float().T, -1)
            return torch.stack(
                [js_divergence(lp_all, torch.log_softmax(h.float() @ weight.float().T, -1)) for h in h_removed]
            )
        if method == "trl":
            # beta = 0.5 is TRL's generalised JSD with m = (p + q) / 2, i.e. JS in nats.
            return torch.stack(
                [ChunkedDivergenceFunction.apply(h, weight, None, h_all, weight, None, 0.5)[0] for h in h_removed]
            ).float() / torch.log(torch.tensor(2.0))
        backend = "triton" if method == "triton" else "torch"
        chunk_size = max(1, chunk // ((contexts + 1) * vocab)) if chunk else None
        return replay_divergence(h_all, h_removed, weight, chunk_size=chunk_size, backend=backend)

    if device == "cuda":
        run()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(5):
            started = time.perf_counter()
            q = run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM) to the current one
        base = _status_mb("VmRSS")
        started = time.perf_counter()
        q = run()
        seconds = time.perf_counter() - started
        peak_mb = _status_mb("VmHWM") - base
    sys.path.insert(0, str(ROOT))
    from tests.reference import js_float64

    shown = slice(0, min(tokens, 64))  # float64 full logits of every token would dwarf the measured op
    full = [h[shown].double() @ weight.double().T for h in (h_all, *h_removed)]
    expected = torch.stack([js_float64(full[0], logits) for logits in full[1:]])
    error = (q[:, shown].double().cpu() - expected.cpu()).abs().max().item()
    return {
        "seconds": seconds,
        "peak_extra_mb": max(peak_mb, 0.0),
        "checksum": float(q.double().sum()),
        "max_error_vs_float64": error,
    }


def run_child(method: str, device: str, tokens: int, hidden: int, vocab: int, k: int, chunk: int = 0) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    child = [sys.executable, __file__, "--child", method, device, *map(str, (tokens, hidden, vocab, k, chunk))]
    out = subprocess.run(child, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 152064])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3, 8])
    parser.add_argument("--sweep-chunk", action="store_true", help="time the torch backend's chunk sizes instead")
    parser.add_argument("--output", help="CSV path (default: benchmarks/results/js_kernel_<device>.csv)")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        method, device, *sizes = args.child
        print(json.dumps(measure(method, device, *map(int, sizes))))
        return

    if args.sweep_chunk:
        rows = []
        for exponent in range(20, 26):
            result = run_child("ours", args.device, args.tokens, args.hidden, args.vocab[0], args.k[0], 1 << exponent)
            rows.append({"chunk_elements": f"2^{exponent}", "vocab": args.vocab[0], "k": args.k[0], **result})
            print(f"chunk 2^{exponent}: {result['seconds']:.2f} s, {result['peak_extra_mb']:.0f} MB", flush=True)
        write_csv(rows, Path(args.output or RESULTS / f"js_kernel_chunks_{args.device}.csv"))
        return

    methods = ("naive", "trl", "ours", "triton") if args.device == "cuda" else ("naive", "trl", "ours")
    rows = []
    for vocab in args.vocab:
        for k in args.k:
            for method in methods:
                result = run_child(method, args.device, args.tokens, args.hidden, vocab, k)
                rows.append({"vocab": vocab, "k": k, "method": method, **result})
                print(
                    f"V={vocab:>6} K={k} {method:<6} {result['seconds']:8.3f} s {result['peak_extra_mb']:8.0f} MB",
                    flush=True,
                )
    write_csv(rows, Path(args.output or RESULTS / f"js_kernel_{args.device}.csv"))
    fastest = "triton" if args.device == "cuda" else "ours"
    print(f"\n{args.device}, N={args.tokens} H={args.hidden}; within each (V, K), {fastest} against the others:")
    print("| V | K | ours s | TRL x K s | speed-up vs TRL | naive s | ours MB | naive MB | memory vs naive |")
    print("|---|---|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for k in args.k:
            by = {r["method"]: r for r in rows if r["vocab"] == vocab and r["k"] == k}
            ours, trl, naive = by[fastest], by["trl"], by["naive"]
            print(
                f"| {vocab} | {k} | {ours['seconds']:.2f} | {trl['seconds']:.2f} | "
                f"{trl['seconds'] / ours['seconds']:.1f}x | {naive['seconds']:.2f} | {ours['peak_extra_mb']:.0f} | "
                f"{naive['peak_extra_mb']:.0f} | {ours['peak_extra_mb'] / max(naive['peak_extra_mb'], 1e-9):.2f}x |"
            )


if __name__ == "__main__":
    main()
