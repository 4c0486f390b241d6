"""What the checks and defensive copies cost per training step, against the step itself (one run, under cProfile).

Two batches: the demo task (the embedded SmolLM2-135M-Instruct, the basic kit, LoRA, the CPU run's settings), and a
tool-rollout batch of 1,024-token completions through TRL's own tool loop (a tiny random Llama with a scripted
policy and Qwen3's template: the step is cheap, so its ratio is an upper bound of a real model's). Reported per
batch: the step's time, the time inside MRTPO's checks (reward values, info blocks and their spans, tool results,
rollouts, context lengths; the reward-value wrapper's and the block builders' times include the wrapped functions'
own, so these are upper bounds), inside the defensive deep copies (what reward functions, builders and process rewards
receive), and inside the replay's KV-cache copies (part of the prefix tree, listed apart), each as a share of the
step. Written to ``results/check_cost.md``.

    OMP_NUM_THREADS=1 python benchmarks/check_cost.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

CHECKS = (
    {  # (module file, function) of MRTPO's checks on the step's path
        ("batch.py", name) for name in ("check_reward_values", "check_batch_rewards", "checked", "_rows")
    }
    | {("batch.py", name) for name in ("check_blocks", "check_context_length")}
    | {("info_blocks.py", "build_block"), ("environments.py", "check_tool_results")}
)
COPY_CALLERS = ("batch.py", "inputs.py", "info_blocks.py", "process_rewards.py", "step_labels.py")


def profiled(train) -> tuple[float, float, float, float]:
    """``(step seconds, checks, copies, KV-cache copies)`` of ``train()`` under cProfile."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(train)
    total = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    checks = copies = cache = 0.0
    for (filename, _, function), (_, _, _, cumulative, callers) in stats.items():
        if "trl_mrtpo" in filename and (Path(filename).name, function) in CHECKS:
            checks += cumulative
        if function == "deepcopy" and filename.endswith("copy.py"):
            for (caller_file, _, _), (_, _, _, caller_cumulative) in callers.items():
                if "trl_mrtpo" in caller_file and Path(caller_file).name in COPY_CALLERS:
                    copies += caller_cumulative
                elif "trl_mrtpo" in caller_file and Path(caller_file).name == "replay.py":
                    cache += caller_cumulative
    return total, checks, copies, cache


def demo_batch(steps: int):
    from trl_mrtpo.kits import get_kit
    from trl_mrtpo.scripts.demo import cpu_run_config, embedded_lora_trainer

    kit = get_kit("basic")
    args = cpu_run_config(tempfile.mkdtemp(), max_steps=steps, credit_warmup_steps=0, disable_tqdm=True)
    trainer = embedded_lora_trainer(kit.rewards, kit.info_blocks, args, kit.dataset(16, 0, None))
    return trainer.train


def tool_batch(steps: int):
    from tests.test_tool_templates import scripted_run

    def lookup(city: str) -> str:
        """Look up the code of a city.

        Args:
            city: the city's name.
        """
        return "The code of Paris is 42. " * 30

    return lambda: scripted_run("qwen3_instruct_2507", Path(tempfile.mkdtemp()), tool=lookup, length=1024, steps=steps)


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for name, batch in (
        ("demo task (embedded SmolLM2, LoRA)", demo_batch),
        ("tool rollouts, 1,024 tokens", tool_batch),
    ):
        total, checks, copies, cache = profiled(batch(2))
        shares = [f"{part / total:.2%}" for part in (checks, copies, checks + copies, cache)]
        rows.append(f"| {name} | {total / 2:.2f} | {' | '.join(shares)} |")
        print(rows[-1], flush=True)
    text = (
        "| batch | step (s, profiled) | checks | defensive copies | checks + copies | replay KV-cache copies |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    out = HERE / "results" / "check_cost.md"
    out.write_text(
        "Command: `OMP_NUM_THREADS=1 python benchmarks/check_cost.py` (2 steps each, shares of the step)\n\n" + text
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
