"""MRTPO's extra cost per optimizer step: MRTPO vs GDPO (and GRPO) step time on the embedded model, on CPU.

Every method runs in its own subprocess (same seed, same data order, torch pinned to ``--threads``), with
``learning_rate=0`` by default so that all methods sample exactly the same completions at every step and the only
difference is the credit assignment (the replay, for MRTPO). ``credit_warmup_steps=0`` so MRTPO replays from the
first step. The first step (start-up) is dropped from the means. Writes
``benchmarks/results/replay_overhead_cpu.csv`` (one row per method and step) and prints a table.

    python benchmarks/replay_overhead.py                          # basic and if tasks, 6 steps
    python benchmarks/replay_overhead.py --tasks if --steps 4 --methods gdpo mrtpo
    python benchmarks/replay_overhead.py --methods gdpo mrtpo mrtpo+strength   # with per-reward strength (resting)

``mrtpo`` is the published rule; a method ``mrtpo+<option>`` is MRTPO with an option on: ``strength`` (per-reward
strength, the default of ``MRTPOConfig``), ``null``, ``preserve``.

``--variable-length`` measures the replay alone, packed (the default: sequences of one context side by side in one
row) against one sequence per row right-padded (what a model without a custom mask runs), in one run: decoder
positions per needed position at a GPU step's shape (64 completions of 256-1,024 tokens after 512-token prompts,
three blocks each removed, every pair replayed; counted on a tiny model, the count does not depend on its size; its
seconds are not a CPU step's), and
CPU seconds per replayed token on a SmolLM2-135M-shaped random model at a CPU step's shape (16 completions of 32-128
tokens after 128-token prompts). Writes ``benchmarks/results/replay_packing_cpu.csv`` and prints a table.

    OMP_NUM_THREADS=1 python benchmarks/replay_overhead.py --variable-length --threads 1
    python benchmarks/replay_overhead.py --variable-length --quick --output /tmp/packing.csv   # a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).parent))
from js_kernel import write_csv  # noqa: E402

OPTIONS = {
    "strength": "reward_strength",
    "null": "relevance_null_correction",
    "preserve": "preserve_reward_totals",
}


def run_method(task: str, method: str, steps: int, seed: int, args: argparse.Namespace) -> list[dict]:
    """Runs in the child process: per-step wall time and MRTPO metrics."""
    import time

    import torch
    from transformers import TrainerCallback

    from trl_mrtpo.kits import get_kit
    from trl_mrtpo.research.config import arm_settings
    from trl_mrtpo.scripts.demo import cpu_run_config, embedded_lora_trainer

    torch.set_num_threads(args.threads)
    kit = get_kit(task)
    rewards, info_blocks, dataset = kit.rewards, kit.info_blocks, kit.dataset(num_prompts=max(8, steps * 2), seed=seed)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.started = [], 0.0

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.started)

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        config = cpu_run_config(
            output_dir,
            max_steps=steps,
            per_device_train_batch_size=args.batch_size,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            learning_rate=args.learning_rate,
            seed=seed,
            credit_assignment=method.split("+")[0],
            **arm_settings({OPTIONS[option]: True for option in method.split("+")[1:]}),
            credit_warmup_steps=0,
            disable_tqdm=True,
            use_cpu=args.device == "cpu",
            bf16=args.device == "cuda",  # bf16 on the GPU, like a real run
        )
        trainer = embedded_lora_trainer(rewards, info_blocks, config, dataset, callbacks=[timer], model=args.model)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    return [
        {
            "task": task,
            "method": method,
            "step": step,
            "seconds": seconds,
            "mean_length": log.get("completions/mean_length"),
            "replay_seconds": log.get("mrtpo/replay_seconds", 0.0),
            "replayed_fraction": log.get("mrtpo/replayed_fraction", 0.0),
        }
        for step, (seconds, log) in enumerate(zip(timer.seconds, logs))
    ]


def variable_length_batch(prompts: int, group: int, prompt_tokens: int, block: int, lengths: tuple[int, int],
                          seed: int) -> tuple[list, list]:  # fmt: skip
    """Per response, ``[P_all, P_not_1, P_not_2, P_not_3]`` (three appended blocks of ``block`` tokens, each removed
    once; identical across a prompt's ``group`` responses) and a completion of ``lengths`` tokens (uniform)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 300, (n,), generator=gen).tolist()  # noqa: E731
    contexts, completions = [], []
    for _ in range(prompts):
        prompt, blocks = ids(prompt_tokens - 3 * block), [ids(block) for _ in range(3)]
        full = prompt + [t for b in blocks for t in b]
        removed = [prompt + [t for i, b in enumerate(blocks) if i != k for t in b] for k in range(3)]
        for length in torch.randint(lengths[0], lengths[1] + 1, (group,), generator=gen).tolist():
            contexts.append([full, *removed])
            completions.append(ids(length))
    return contexts, completions


def replay_cost(model, contexts, completions, packed: bool, repeats: int) -> tuple[int, float]:
    """``(decoder positions computed, best seconds of repeats)`` of one replay of the batch, packed or padded."""
    import functools
    import time

    import torch

    from trl_mrtpo import replay

    decoder, _ = replay.causal_lm_parts(model)
    original, positions = decoder.forward, []

    @functools.wraps(original)
    def counted(*a, input_ids, **kw):
        positions.append(input_ids.numel())
        return original(*a, input_ids=input_ids, **kw)

    decoder.forward = counted
    packs = replay._Decoder.packs
    if not packed:
        replay._Decoder.packs = lambda self, cached, width: False
    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None
    try:
        seconds = []
        for _ in range(repeats):
            positions.clear()
            synchronize()
            start = time.perf_counter()
            replay.replay_relevance(model, contexts, completions, 1.0, min_shared_prefix=1, backend="torch")
            synchronize()
            seconds.append(time.perf_counter() - start)
    finally:
        replay._Decoder.packs, decoder.forward = packs, original
    return sum(positions), min(seconds)


def variable_length(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    shapes = {  # case -> (model shape, batch, replays timed)
        "gpu_step_positions": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=512), (8, 8, 512, 32, (256, 1024)), 1),
        "cpu_step_seconds": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, vocab_size=49152), (4, 4, 128, 16, (32, 128)), args.repeats),
    }  # fmt: skip
    if args.quick:  # the plumbing only (CI's benchmarks tier): one tiny model, short sequences
        tiny = shapes["gpu_step_positions"][0]
        shapes = {case: (tiny, (2, 4, 48, 8, (4, 40)), 1) for case in shapes}
    rows = []
    for case, (shape, batch, repeats) in shapes.items():
        torch.manual_seed(args.seed)
        config = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=True, **shape)
        model = LlamaForCausalLM(config).eval()
        contexts, completions = variable_length_batch(*batch, seed=args.seed)
        sequences = [(c, comp) for ctx, comp in zip(contexts, completions) for c in ctx]
        distinct = {tuple(c[:n]) for c, _ in sequences for n in range(1, len(c))}
        needed = len(distinct) + sum(1 + len(comp) for _, comp in sequences)
        replayed = sum(len(comp) * len(ctx) for ctx, comp in zip(contexts, completions))
        for path in ("padded", "packed"):
            computed, seconds = replay_cost(model, contexts, completions, path == "packed", repeats)
            per_token = round(1e6 * seconds / replayed, 2)
            rows.append({"case": case, "path": path, "positions": computed, "needed": needed,
                         "positions_per_needed": round(computed / needed, 4), "seconds": round(seconds, 4),
                         "replayed_tokens": replayed, "us_per_replayed_token": per_token})  # fmt: skip
            print(rows[-1], flush=True)
    write_csv(rows, RESULTS / "replay_packing_cpu.csv" if args.output is None else Path(args.output))
    print("| case | path | positions / needed | s per replay | µs per replayed token |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['path']} | {r['positions_per_needed']:.3f} | {r['seconds']:.3f} | "
              f"{r['us_per_replayed_token']:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["basic", "if"])
    parser.add_argument("--methods", nargs="+", default=["grpo", "gdpo", "mrtpo"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", default=None, help="a model folder instead of the embedded SmolLM2 (same tokenizer)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--output", default=None, help="the CSV written (default: results/replay_overhead_cpu.csv)")
    parser.add_argument("--variable-length", action="store_true", help="the replay alone, packed against padded")
    parser.add_argument("--repeats", type=int, default=2, help="replays timed per path (--variable-length; best)")
    parser.add_argument("--quick", action="store_true", help="--variable-length on a tiny model and batch (a dry run)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variable_length:
        return variable_length(args)
    args.output = args.output or str(RESULTS / "replay_overhead_cpu.csv")
    if args.child:
        print(json.dumps(run_method(*args.child, args.steps, args.seed, args)))
        return

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    for task in args.tasks:
        for method in args.methods:
            child = [sys.executable, __file__, "--child", task, method, *sys.argv[1:]]
            out = subprocess.run(child, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{task}/{method} failed:\n{out.stderr[-3000:]}")
            steps = json.loads(out.stdout.strip().splitlines()[-1])
            rows.extend(steps)
            timed = steps[1:]
            print(
                f"{task:>6} {method:>6}: {statistics.mean(r['seconds'] for r in timed):6.2f} s/step "
                f"(replay {statistics.mean(r['replay_seconds'] for r in timed):5.2f} s)",
                flush=True,
            )
    write_csv(rows, Path(args.output))
    print("| task | method | s/step (mean over steps 2..n) | replay s/step | pairs replayed | vs GDPO |")
    print("|---|---|---|---|---|---|")
    for task in args.tasks:
        timed = {m: [r for r in rows if r["task"] == task and r["method"] == m][1:] for m in args.methods}
        mean = {m: statistics.mean(r["seconds"] for r in timed[m]) for m in args.methods}
        for method in args.methods:
            replay = statistics.mean(r["replay_seconds"] for r in timed[method])
            replayed = statistics.mean(r["replayed_fraction"] for r in timed[method])
            ratio = f"{mean[method] / mean['gdpo']:.3f}x" if "gdpo" in mean else "-"
            print(f"| {task} | {method} | {mean[method]:.2f} | {replay:.2f} | {replayed:.0%} | {ratio} |")


if __name__ == "__main__":
    main()
