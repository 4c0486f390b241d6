"""Does MRTPO's token credit, trained on generated instruction-following prompts, transfer to IFEval? GDPO against
MRTPO's default (per-reward strength) on the embedded SmolLM2-135M-Instruct, LoRA, CPU.

Stages, each resumable (a finished stage leaves a JSON in ``--work-dir`` that later invocations reuse):

- ``train``: one LoRA run per (arm, seed) on the IF kit's generator with 2-6 constraints per prompt (data seeded by
  the run's seed), timed; every reward's batch mean per step.
- ``evaluate``: the base model and every finished adapter, greedy, at the training length: on the first
  ``--ifeval-limit`` IFEval prompts (instruction-level loose on the 14 types the generator trains and on the other 11,
  prompt-level strict), and on a held-out generated set (generator seed ``--heldout-seed``, never trained on) scored
  per constraint type. Timed per prompt, so a full-IFEval cost can be read off.

``pilot`` runs both on the development seed (100) and writes ``benchmarks/results/if_transfer/pilot.json`` and
``pilot.md``: the cost per run, the arms' difference, and the gate of ``benchmarks/if_transfer_protocol.md``.

    OMP_NUM_THREADS=1 python benchmarks/if_transfer.py pilot            # about 2 h on one core
    OMP_NUM_THREADS=1 python benchmarks/if_transfer.py pilot --work-dir benchmarks/results/if_transfer
                                                          # the committed stages, reused: the report in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "if_transfer"
ARMS = {"gdpo": {"credit_assignment": "gdpo"}, "mrtpo": {"credit_assignment": "mrtpo"}}  # mrtpo: the config default
DEVELOPMENT_SEEDS = (100,)
# Frozen for the pilot before any run (development seed only): 2-6 constraints, one length in training and evaluation.
SETTINGS = {
    "min_constraints": 2,
    "max_constraints": 6,
    "steps": 30,
    "prompts_per_step": 2,
    "num_generations": 4,
    "max_completion_length": 160,
    "learning_rate": 5e-5,
    "temperature": 1.0,
    "credit_warmup_steps": 5,
    "heldout_seed": 9001,
    "heldout_prompts": 48,
    "ifeval_limit": 48,
}


def _stage(work_dir: Path, name: str, compute) -> dict:
    """A resumable stage: the stored JSON if the stage finished, else computed, then stored in the work dir and
    copied under ``benchmarks/results/if_transfer/`` (committed as it lands)."""
    path = work_dir / name
    if path.exists():
        return json.loads(path.read_text())
    result = compute()
    for target in (path, RESULTS / name):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result, indent=1))
    return result


def train(arm: str, seed: int, work_dir: Path) -> dict:
    """One LoRA run of ``arm`` on the 2-6-constraint generator, data and sampling seeded by ``seed``; timed."""

    def compute() -> dict:
        from trl_mrtpo.kits.instruction_following import make_if_dataset, make_if_info_blocks, make_if_rewards
        from trl_mrtpo.scripts.demo import cpu_run_config, embedded_lora_trainer

        s = SETTINGS
        slots = s["max_constraints"]
        dataset = make_if_dataset(
            s["steps"] * s["prompts_per_step"], s["min_constraints"], s["max_constraints"], seed=seed
        )
        run_dir = work_dir / arm / f"seed{seed}"
        config = cpu_run_config(
            str(run_dir),
            max_steps=s["steps"],
            per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"],
            num_generations=s["num_generations"],
            max_completion_length=s["max_completion_length"],
            learning_rate=s["learning_rate"],
            temperature=s["temperature"],
            credit_warmup_steps=s["credit_warmup_steps"],
            seed=seed,
            disable_tqdm=True,
            save_strategy="steps",
            save_steps=5,
            **ARMS[arm],
        )
        trainer = embedded_lora_trainer(make_if_rewards(slots), make_if_info_blocks(slots), config, dataset)
        resume = any(run_dir.glob("checkpoint-*"))
        start = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume or None)
        seconds = time.perf_counter() - start
        if resume:  # this process trained only the last steps: count every step's logged time
            seconds = sum(e["step_time"] for e in trainer.state.log_history if "step_time" in e)
        # the adapter is committed beside the stage's JSON, so a later session evaluates it without retraining
        adapter = RESULTS / arm / f"seed{seed}" / "adapter"
        trainer.save_model(str(adapter))
        for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "training_args.bin"):
            (adapter / extra).unlink(missing_ok=True)  # the evaluation loads the embedded model's tokenizer
        rewards = [
            {
                k[len("rewards/") : -len("/mean")]: v
                for k, v in entry.items()
                if k.startswith("rewards/") and k.endswith("/mean")
            }
            for entry in trainer.state.log_history
            if any(k.startswith("rewards/") for k in entry)
        ]
        return {
            "arm": arm,
            "seed": seed,
            "train_seconds": seconds,
            "rewards": rewards,
            "adapter": str(adapter.relative_to(Path(__file__).parent.parent)),
            "resumed": resume,
        }

    return _stage(work_dir, f"{arm}/seed{seed}/train.json", compute)


def _load(adapter: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_mrtpo.scripts.embedded import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def evaluate(name: str, adapter: str | None, work_dir: Path) -> dict:
    """IFEval's first prompts and the held-out generated set, greedy, at the training length; timed."""

    def compute() -> dict:
        from trl_mrtpo.kits.instruction_following import GENERATOR_POOL, check_constraint, make_if_dataset
        from trl_mrtpo.scripts.evaluation import evaluate_instruction_following, transformers_generator

        s = SETTINGS
        model, tokenizer = _load(adapter)
        generate = transformers_generator(model, tokenizer, max_new_tokens=s["max_completion_length"])
        start = time.perf_counter()
        ifeval = evaluate_instruction_following(generate, "ifeval", limit=s["ifeval_limit"])
        ifeval_seconds = time.perf_counter() - start
        trained = set(GENERATOR_POOL)
        per_instruction = [(i, loose) for d in ifeval.details for i, _strict, loose in d["instructions"]]
        heldout = make_if_dataset(s["heldout_prompts"], s["min_constraints"], s["max_constraints"], s["heldout_seed"])
        start = time.perf_counter()
        outputs = generate([row["prompt"] for row in heldout])
        heldout_seconds = time.perf_counter() - start
        per_type: dict[str, list[float]] = {}
        for row, text in zip(heldout, outputs):
            for constraint in json.loads(row["constraints"]):
                per_type.setdefault(constraint["id"], []).append(check_constraint(text, constraint))
        return {
            "model": name,
            "ifeval_prompts": ifeval.count,
            "ifeval_seconds_per_prompt": ifeval_seconds / max(len(ifeval.details), 1),
            "ifeval": ifeval.metrics,
            "ifeval_trained_types_loose": _share([v for i, v in per_instruction if i in trained]),
            "ifeval_other_types_loose": _share([v for i, v in per_instruction if i not in trained]),
            "ifeval_instructions": [[d["key"], *map(list, d["instructions"])] for d in ifeval.details],
            "heldout_seconds_per_prompt": heldout_seconds / len(heldout),
            "heldout_per_type": {k: statistics.fmean(v) for k, v in sorted(per_type.items())},
            "heldout_mean": statistics.fmean(v for vs in per_type.values() for v in vs),
        }

    return _stage(work_dir, f"eval/{name}.json", compute)


def _share(values: list) -> float:
    return statistics.fmean(float(v) for v in values) if values else math.nan


def pilot(work_dir: Path) -> dict:
    """Both arms on the development seed, trained and evaluated with the base model; the cost and the gate."""
    base = evaluate("base", None, work_dir)
    runs, evals = {}, {}
    for arm in ARMS:
        for seed in DEVELOPMENT_SEEDS:
            runs[arm] = train(arm, seed, work_dir)
            evals[arm] = evaluate(f"{arm}-seed{seed}", runs[arm]["adapter"], work_dir)
    ifeval_full = 541
    cost = {
        arm: runs[arm]["train_seconds"]
        + ifeval_full * evals[arm]["ifeval_seconds_per_prompt"]
        + SETTINGS["heldout_prompts"] * evals[arm]["heldout_seconds_per_prompt"]
        for arm in ARMS
    }
    summary = {
        "settings": SETTINGS,
        "train_seconds": {arm: runs[arm]["train_seconds"] for arm in ARMS},
        "ifeval_seconds_per_prompt": {k: v["ifeval_seconds_per_prompt"] for k, v in {"base": base, **evals}.items()},
        "seconds_per_run_with_full_ifeval": cost,
        "ifeval_trained_types_loose": {k: v["ifeval_trained_types_loose"] for k, v in {"base": base, **evals}.items()},
        "heldout_mean": {k: v["heldout_mean"] for k, v in {"base": base, **evals}.items()},
    }
    summary["gate"] = gate(
        summary, trained_instructions(), base_seconds=ifeval_full * base["ifeval_seconds_per_prompt"]
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pilot.json").write_text(json.dumps(summary, indent=1))
    (RESULTS / "pilot.md").write_text(pilot_table(summary))
    report(base, runs, evals, summary["gate"])
    return summary


# the protocol's prediction (benchmarks/if_transfer_protocol.md), committed before any run
LOCAL_TYPES = ("startend:end_checker", "keywords:existence", "keywords:frequency", "detectable_format:title")
GLOBAL_TYPES = (
    "punctuation:no_comma",
    "change_case:english_lowercase",
    "length_constraints:number_words",
    "length_constraints:number_sentences",
    "keywords:letter_frequency",
)


def report(base: dict, runs: dict, evals: dict, gate_result: dict) -> None:
    """``benchmarks/if_transfer.md`` and ``results/if_transfer/curves.png`` from the stage results."""
    models = {"base": base, **evals}
    lines = [
        "# IF transfer to IFEval (generated by `benchmarks/if_transfer.py`)",
        "",
        "Protocol, settings and the per-type prediction: [if_transfer_protocol.md](if_transfer_protocol.md)",
        "(committed before any run). Development seed 100 only: the pilot. Every figure below is one seed: a",
        "direction, not a test.",
        "",
        "    OMP_NUM_THREADS=1 python benchmarks/if_transfer.py pilot",
        "",
        f"## IFEval, first {SETTINGS['ifeval_limit']} prompts, greedy, {SETTINGS['max_completion_length']} new tokens",
        "",
        "| model | prompt strict | instruction loose | trained types, instr. loose | other types, instr. loose |",
        "|---|---|---|---|---|",
    ]
    for name, result in models.items():
        lines.append(
            f"| {name} | {result['ifeval']['prompt_strict']:.3f} | {result['ifeval']['instruction_loose']:.3f} "
            f"| {result['ifeval_trained_types_loose']:.3f} | {result['ifeval_other_types_loose']:.3f} |"
        )
    verdict = "passes" if gate_result["passes"] else "fails"
    lines += [
        "",
        f"**The gate {verdict}** ([results/if_transfer/pilot.md](results/if_transfer/pilot.md)): the comparison on 8 "
        f"evaluation seeds would need {gate_result['hours_for_the_comparison']:.1f} h of one core (budget "
        f"{gate_result['budget_hours']:.0f} h) and could detect {gate_result['detectable_effect_points']:.1f} points "
        "(the protocol asks for about 1.5).",
        "",
        f"## The mechanism: held-out generated set ({SETTINGS['heldout_prompts']} prompts, generator seed "
        f"{SETTINGS['heldout_seed']}), pass rate per constraint type",
        "",
        "| constraint type | predicted | base | gdpo | mrtpo | mrtpo - gdpo |",
        "|---|---|---|---|---|---|",
    ]
    types = sorted(base["heldout_per_type"])
    for kind in types:
        predicted = "moves most" if kind in LOCAL_TYPES else "no more than gdpo" if kind in GLOBAL_TYPES else "-"
        values = [models[m]["heldout_per_type"].get(kind, math.nan) for m in ("base", "gdpo", "mrtpo")]
        lines.append(
            f"| `{kind}` | {predicted} | "
            + " | ".join(f"{v:.3f}" for v in values)
            + f" | {values[2] - values[1]:+.3f} |"
        )

    def gap(kinds) -> float:
        present = [k for k in kinds if k in base["heldout_per_type"]]
        return statistics.fmean(
            evals["mrtpo"]["heldout_per_type"][k] - evals["gdpo"]["heldout_per_type"][k] for k in present
        )

    local, global_ = gap(LOCAL_TYPES), gap(GLOBAL_TYPES)
    holds = "holds" if local > global_ else "does not hold"
    lines += [
        "",
        f"Prediction: mean (mrtpo - gdpo) on the local types {local:+.3f}, on the global types {global_:+.3f}: it "
        f"**{holds}** on this seed.",
        "",
        "## Training",
        "",
        "![mean constraint reward per step](results/if_transfer/curves.png)",
        "",
        "| arm | training seconds (one core) | mean constraint reward, first 5 steps | last 5 steps |",
        "|---|---|---|---|",
    ]
    for arm, run in runs.items():
        curve = _curve(run)
        lines.append(
            f"| {arm} | {run['train_seconds']:.0f} | {statistics.fmean(curve[:5]):.3f} | "
            f"{statistics.fmean(curve[-5:]):.3f} |"
        )
    lines += [
        "",
        "What this says about larger models: nothing yet. At 135M, 30 LoRA steps on 240 sampled responses, one seed,",
        "the pilot measures cost and noise; transfer at the recipes' scale is `benchmarks/paper_task.sh` on a GPU.",
        "",
    ]
    (Path(__file__).parent / "if_transfer.md").write_text("\n".join(lines))
    _plot(runs, RESULTS / "curves.png")


def _curve(run: dict) -> list[float]:
    """The mean of the constraint slots' batch means per step (a slot no prompt of the batch has is left out)."""
    return [statistics.fmean(v for v in step.values() if v is not None) for step in run["rewards"]]


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, run in runs.items():
        ax.plot(range(1, len(run["rewards"]) + 1), _curve(run), label=arm)
    ax.set_xlabel("step")
    ax.set_ylabel("mean constraint reward")
    ax.set_title("IF kit, 2-6 constraints, development seed 100")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


BUDGET_HOURS = 24.0  # the protocol's background budget for the comparison: one core
EVALUATION_SEEDS = 8


def trained_instructions() -> int:
    """How many of IFEval's instructions are of the 14 types the generator trains (the primary measure's count)."""
    from trl_mrtpo.kits.instruction_following import GENERATOR_POOL, load_ifeval

    return sum(c["id"] in GENERATOR_POOL for row in load_ifeval() for c in json.loads(row["constraints"]))


def gate(summary: dict, instructions: int, base_seconds: float) -> dict:
    """The protocol's two conditions from the pilot's figures: the budget (16 runs at the dearer arm's cost plus one
    base evaluation, against :data:`BUDGET_HOURS`) and the smallest effect 8 seeds detect (2.5 x the paired
    difference's standard deviation / sqrt(8); that deviation from the binomial noise of two adapters' scores on the
    full IFEval's trained-type instructions and the development seed's |gdpo - mrtpo| / sqrt(2))."""
    runs = 2 * EVALUATION_SEEDS
    hours = (runs * max(summary["seconds_per_run_with_full_ifeval"].values()) + base_seconds) / 3600
    scores = summary["ifeval_trained_types_loose"]
    rate = statistics.fmean(scores[arm] for arm in ARMS)
    binomial = math.sqrt(2 * rate * (1 - rate) / instructions)
    spread = abs(scores["mrtpo"] - scores["gdpo"]) / math.sqrt(2)
    deviation = math.sqrt(binomial**2 + spread**2)
    detectable = 2.5 * deviation / math.sqrt(EVALUATION_SEEDS)
    return {
        "hours_for_the_comparison": hours,
        "budget_hours": BUDGET_HOURS,
        "budget_fits": hours <= BUDGET_HOURS,
        "trained_type_instructions": instructions,
        "binomial_sd": binomial,
        "training_spread_sd": spread,
        "detectable_effect_points": 100 * detectable,
        "sensitivity_fits": 100 * detectable <= 1.5,
        "passes": hours <= BUDGET_HOURS and 100 * detectable <= 1.5,
    }


def pilot_table(summary: dict) -> str:
    """``pilot.md``: the pilot's cost and scores per model, and the gate's verdict."""
    g, models = summary["gate"], ["base", *ARMS]
    lines = [
        "# IF transfer pilot (development seed 100)",
        "",
        "    OMP_NUM_THREADS=1 python benchmarks/if_transfer.py pilot",
        "",
        "| model | training (s) | IFEval s/prompt | IFEval trained types, instruction loose (first "
        f"{SETTINGS['ifeval_limit']}) | held-out generated set, mean pass |",
        "|---|---|---|---|---|",
    ]
    for model in models:
        train = f"{summary['train_seconds'][model]:.0f}" if model in ARMS else "-"
        lines.append(
            f"| {model} | {train} | {summary['ifeval_seconds_per_prompt'][model]:.2f} "
            f"| {summary['ifeval_trained_types_loose'][model]:.3f} | {summary['heldout_mean'][model]:.3f} |"
        )
    verdict = (
        "passes: the comparison runs" if g["passes"] else "fails: the comparison does not run; the mechanism test does"
    )
    lines += [
        "",
        f"Gate ({verdict}): 16 runs and the base evaluation need {g['hours_for_the_comparison']:.1f} h of one core "
        f"(budget {g['budget_hours']:.0f} h: {'fits' if g['budget_fits'] else 'does not fit'}); the smallest effect "
        f"8 seeds detect is {g['detectable_effect_points']:.2f} points (binomial sd {g['binomial_sd']:.4f} over "
        f"{g['trained_type_instructions']} instructions, training spread sd {g['training_spread_sd']:.4f}; "
        f"{'within' if g['sensitivity_fits'] else 'above'} 1.5 points).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["pilot"])
    parser.add_argument("--work-dir", default="if_transfer_runs", help="checkpoints, adapters and stage results")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    print(json.dumps(pilot(Path(args.work_dir)), indent=1))


if __name__ == "__main__":
    sys.exit(main())
