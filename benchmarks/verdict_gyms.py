"""Where `inspect`'s verdicts stand against the truth: both gyms, where the token each reward decides on is known.

For the agent gym's supervised policy (32 sampled trajectories, as `tests/test_agent_gym.py` inspects them) and the
credit gym's (8 prompts x 4 responses, default task), per reward: how often its q peaks on its deciding token (the
call's entity, the answer's value; a constraint's relevant positions), the verdict's figures (q against the control,
the share of responses whose q peaks on another token than the control's), the pair test's (pairs hit, the
control's hits, the pairs another reward scores differently too, the share of q on the pairs' deciding tokens and
the share of their tokens those are) and its verdict. Run it under each CPU
float path (the supervised policies differ with it):

    OMP_NUM_THREADS=1 python benchmarks/verdict_gyms.py
    ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 python benchmarks/verdict_gyms.py
    ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 python benchmarks/verdict_gyms.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from trl_mrtpo.scripts.inspection import inspect_credit


def agent_gym(tmp: Path) -> list[tuple[str, int, int, object]]:
    from trl_mrtpo.gym.agent import agent_blocks, agent_rewards, deciding_word_peaks, supervised_trajectories

    policy, rows, trajectories, words = supervised_trajectories(tmp)
    record, _, verdicts = inspect_credit(
        model=policy, reward_funcs=agent_rewards(), info_blocks=agent_blocks(), dataset=rows,
        completions=trajectories, output=None, return_verdicts=True,
    )  # fmt: skip
    peaks = deciding_word_peaks(record, words)
    return [("agent", *peaks[v.reward], v) for v in verdicts]


def credit_gym(tmp: Path) -> list[tuple[str, int, int, object]]:
    from trl_mrtpo.gym.runs import gym_dataset
    from trl_mrtpo.gym.task import (
        GymSpec,
        constraint_blocks,
        constraint_rewards,
        relevant_positions,
        row_constraints,
        supervised_policy,
    )

    spec = GymSpec()
    model, tokenizer = supervised_policy(spec, 0, tmp / "cache")
    model.save_pretrained(tmp / "credit")
    tokenizer.save_pretrained(tmp / "credit")
    rows = gym_dataset(spec, 8, 1_000_000).to_list()
    torch.manual_seed(0)
    record, _, verdicts = inspect_credit(
        model=str(tmp / "credit"), reward_funcs=constraint_rewards(spec.num_constraints),
        info_blocks=constraint_blocks(spec.num_constraints, spec.placement), dataset=rows, num_prompts=8,
        num_generations=4, max_new_tokens=spec.length + 1, output=None, return_verdicts=True,
    )  # fmt: skip
    out = []
    for k in range(spec.num_constraints):
        hits = total = 0
        for j in range(record.mask.shape[0]):
            ids = record.completion_ids[j, : int(record.mask[j].sum())].tolist()
            words = [w for w in tokenizer.convert_ids_to_tokens(ids) if w != tokenizer.eos_token]
            positions = relevant_positions(row_constraints(rows[j // 4]["constraints"])[k], words)
            # a constraint every word decides on (or none) says nothing about placement
            if not record.replayed[j, k] or not positions or len(positions) == len(words):
                continue
            total += 1
            hits += int(record.relevance[j, k, : len(words)].argmax().item() in positions)
        out.append(("credit", hits, total, verdicts[k]))
    return out


PAIR_OUTCOMES = (
    "no more than an even spread would",
    "lands where it is decided",
    "but so does the control's",
    "peaks outside the tokens they differ in",
)


def verdict_label(text: str) -> str:
    """The verdict's rule: the pair test's outcome, or the sentence's opening."""
    outcome = next((o for o in PAIR_OUTCOMES if o in text), None)
    return f"pair test: {outcome}" if text.startswith("pair test") and outcome else text.split(":")[0]


def deciding_q(v) -> str:
    """The share of its q on the pairs' deciding tokens, and the share of their tokens those are ('-': no pair)."""
    return f"{v.deciding_share:.0%} on {v.deciding_tokens:.0%}" if v.pairs else "-"


def main() -> None:
    torch.set_num_threads(1)
    path = os.environ.get("ATEN_CPU_CAPABILITY", torch.backends.cpu.get_cpu_capability().lower())
    columns = ["path", "gym", "reward", "q peaks on its deciding token", "q / control", "peak apart"]
    print(f"| {' | '.join(columns)} | pairs hit (control) | pairs another reward decides | q on their deciding tokens "
          "| verdict |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for gym, hits, total, v in [*agent_gym(Path(tmp)), *credit_gym(Path(tmp))]:
            print(
                f"| {path} | {gym} | {v.reward} | {hits}/{total} | {v.q_over_control:.2f}x | {v.peaks_apart:.0%} "
                f"| {v.pair_hits}/{v.pairs} ({v.control_hits}) | {v.mixed_pairs} | {deciding_q(v)} "
                f"| {verdict_label(v.verdict)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
