"""How the replay's cost grows: one thing varied at a time from a base point, on the embedded SmolLM2-135M-Instruct.

Each point builds one group of G responses to a prompt with K in-prompt info blocks (spans spread evenly over the
prompt), replays a share of the (response, reward) pairs with :func:`trl_mrtpo.replay.replay_relevance` (prefix-tree
replay, torch JS backend) and records the replay time, the decoder tokens computed (cached positions excluded), the
JS work (replayed pairs x completion tokens; each costs one V-wide divergence) and the peak memory above the start.
A least-squares model ``seconds ~ a * decoder tokens + b * JS pairs-tokens`` is fitted to all points. CPU, one
thread, one process per point (so peak memory is per point). Writes ``benchmarks/results/replay_scaling_cpu.csv``
and ``.png`` and prints a markdown table and the model.

    python benchmarks/replay_scaling.py            # the sweep (about 15 minutes on one core)
    python benchmarks/replay_scaling.py --quick    # a smoke run (tests)
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
BASE = {"num_rewards": 3, "completion_length": 128, "group_size": 4, "varying_share": 1.0, "prompt_length": 160}
SWEEPS = {
    "num_rewards": [1, 2, 4, 8, 12],
    "completion_length": [64, 256, 512, 1024],
    "group_size": [8, 16],
    "varying_share": [0.25, 0.5],
}
QUICK_BASE = {"num_rewards": 2, "completion_length": 8, "group_size": 2, "varying_share": 1.0, "prompt_length": 24}
QUICK_SWEEPS = {"num_rewards": [3], "completion_length": [12]}


def _status_mb(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(point: dict, model_path: str | None) -> dict:
    """Runs in the child process."""
    import random
    import time

    import torch

    from trl_mrtpo.replay import causal_lm_parts, replay_relevance

    torch.set_num_threads(1)
    if model_path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    else:  # the smoke run: a tiny random Llama
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        model = LlamaForCausalLM(config)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    k, length, group = point["num_rewards"], point["completion_length"], point["group_size"]
    prompt = [rng.randrange(10, vocab) for _ in range(point["prompt_length"])]
    span = max(2, point["prompt_length"] // (2 * k + 1))
    starts = [(2 * i + 1) * point["prompt_length"] // (2 * k + 1) for i in range(k)]
    removed = [prompt[:s] + prompt[s + span :] for s in starts]
    replayed = max(1, round(point["varying_share"] * k))
    contexts = [[prompt, *removed[:replayed]] for _ in range(group)]
    completions = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(group)]

    decoder, _ = causal_lm_parts(model)
    original, counted = decoder.forward, []

    def counting(*args, input_ids, attention_mask=None, **kwargs):
        mask = attention_mask[:, -input_ids.shape[1] :] if attention_mask is not None else input_ids
        counted.append(int((mask != 0).sum()))
        return original(*args, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    decoder.forward = counting
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (VmHWM) to the current one
    base = _status_mb("VmRSS")
    started = time.perf_counter()
    replay_relevance(model, contexts, completions, 1.0, backend="torch")
    seconds = time.perf_counter() - started
    return {
        **point,
        "seconds": seconds,
        "decoder_tokens": sum(counted),
        "js_pair_tokens": group * replayed * length,
        "vocab": vocab,
        "peak_extra_mb": max(_status_mb("VmHWM") - base, 0.0),
    }


def run_child(point: dict, model_path: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    child = [sys.executable, __file__, "--child", json.dumps(point), model_path or ""]
    out = subprocess.run(child, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def fit(rows: list[dict]) -> tuple[float, float, float]:
    """Least squares ``seconds ~ a * decoder_tokens + b * js_pair_tokens`` (no intercept); returns a, b, R^2."""
    import torch

    x = torch.tensor([[r["decoder_tokens"], r["js_pair_tokens"]] for r in rows], dtype=torch.float64)
    y = torch.tensor([r["seconds"] for r in rows], dtype=torch.float64)
    (a, b) = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].tolist()
    residual = y - x @ torch.tensor([a, b], dtype=torch.float64)
    r2 = 1 - float((residual**2).sum() / ((y - y.mean()) ** 2).sum())
    return a, b, r2


def plot(rows: list[dict], sweeps: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(4 * len(sweeps), 3.4), squeeze=False)
    for axis, name in zip(axes[0], sweeps):
        points = sorted((r[name], r["seconds"], r["decoder_tokens"]) for r in rows if r["varied"] in (name, "base"))
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label="replay seconds")
        twin = axis.twinx()
        twin.plot(
            [p[0] for p in points], [p[2] for p in points], marker="s", color="tab:orange", label="decoder tokens"
        )
        axis.set_xlabel(name)
        axis.set_ylabel("seconds")
        twin.set_ylabel("decoder tokens", color="tab:orange")
    fig.suptitle("MRTPO replay cost, one thing varied at a time (CPU, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random model, two points per sweep")
    parser.add_argument("--output", default=str(RESULTS / "replay_scaling_cpu.csv"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child[0]), args.child[1] or None)))
        return
    base, sweeps = (QUICK_BASE, QUICK_SWEEPS) if args.quick else (BASE, SWEEPS)
    model_path = None
    if not args.quick:
        from trl_mrtpo.scripts.embedded import embedded_model_path

        model_path = embedded_model_path()
    points = [("base", base)] + [(name, {**base, name: value}) for name, values in sweeps.items() for value in values]
    rows = []
    for varied, point in points:
        row = {"varied": varied, **run_child(point, model_path)}
        rows.append(row)
        print(f"{varied:>18}: {json.dumps({k: row[k] for k in base})} -> {row['seconds']:.2f} s, "
              f"{row['decoder_tokens']} decoder tokens, {row['peak_extra_mb']:.0f} MB", flush=True)  # fmt: skip
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, sweeps, output.with_suffix(".png"))
    a, b, r2 = fit(rows)
    vocab = rows[0]["vocab"]
    print("\n| varied | K | L | G | varying share | replay s | decoder tokens | JS pair-tokens | peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['varied']} | {r['num_rewards']} | {r['completion_length']} | {r['group_size']} | "
              f"{r['varying_share']} | {r['seconds']:.2f} | {r['decoder_tokens']} | {r['js_pair_tokens']} | "
              f"{r['peak_extra_mb']:.0f} |")  # fmt: skip
    print(f"\nmodel: seconds ~ {a * 1e3:.3f} ms x decoder tokens + {b * 1e3:.3f} ms x JS pair-tokens "
          f"(V = {vocab}; {b / vocab * 1e9:.2f} ns per pair-token per vocabulary entry), R^2 = {r2:.3f}")  # fmt: skip
    print(f"written to {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
