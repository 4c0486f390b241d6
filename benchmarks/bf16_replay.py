"""How noisy is q in bf16? The replay on the path users run (bf16 weights) against fp32, on CPU.

For each model (the embedded SmolLM2-135M-Instruct; a tiny random Llama with its tokenizer) and task kit, one batch
is sampled and scored by ``trl_mrtpo.scripts.inspection.sample_credit`` in fp32, and its replay's inputs (contexts
and completion ids) are recorded. The same replay then runs again:

- ``fp32`` and ``bf16`` (the model cast to bfloat16; the replay's lm_head and JS stay fp32, as they always are):
  q of every replayed (response, reward) pair;
- the **noise floor**: the ``P_all`` context of every response replayed along two routes that must give the same
  distribution, the prefix tree in batches of 8 vs each sequence alone without prefix reuse (different batch shapes,
  paddings and cached prefixes); ``JS(route 1 || route 2)`` is the q an identical context gets from arithmetic alone.

Reported per model, task and reward (``results/bf16_replay.csv``, ``bf16_replay.md``): the mean signal q (fp32),
the noise floor in fp32 and bf16, bf16 q against fp32 q (max and mean |diff|, correlation), and the token advantages
computed from bf16 q against those from fp32 q (relative L2 difference, at beta 0.5, the cap at 2, with a random
group-centred advantage for every reward, so that every replayed q reaches A).

    OMP_NUM_THREADS=1 python benchmarks/bf16_replay.py                       # both models, tasks short and if
    OMP_NUM_THREADS=1 python benchmarks/bf16_replay.py --models tiny --tasks short --prompts 2   # smoke run
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from provenance import write_provenance  # noqa: E402

from trl_mrtpo import trainer as trainer_module  # noqa: E402
from trl_mrtpo.credit import replayed_token_weights, weighted_token_advantages  # noqa: E402
from trl_mrtpo.ops import replay_divergence  # noqa: E402
from trl_mrtpo.replay import completion_hidden_states, lm_head_parameters, replay_relevance  # noqa: E402
from trl_mrtpo.scripts.inspection import sample_credit  # noqa: E402


def steps_5_to_8(group_advantages, relevance, record, reward_weights):
    """The token advantages of the ``mrtpo`` rule (rho 2, beta 0.5) for ``relevance``."""
    weights = replayed_token_weights(relevance, record.replayed, record.mask, 0.5)
    return weighted_token_advantages(group_advantages, weights, record.mask, reward_weights, 2.0).advantages


COLUMNS = [
    "model",
    "task",
    "reward",
    "pairs",
    "tokens",
    "signal_q_fp32",
    "noise_q_fp32",
    "noise_q_bf16",
    "noise_max_bf16",
    "bf16_vs_fp32_max_abs",
    "bf16_vs_fp32_mean_abs",
    "bf16_vs_fp32_corr",
    "advantage_rel_l2",
    "signal_q_median_fp32",
    "noise_over_median_bf16",
    "advantage_rel_l2_routes_bf16",
]


def build_model(name: str, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from trl_mrtpo.scripts.embedded import embedded_model_path

    if name == "smollm2":
        return AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def recorded_batch(
    model_name: str, task: str, prompts: int, generations: int, tokens: int, seed: int, force_length: bool = False
):
    """Sample, score and replay one batch in fp32; return the trainer, its credit record and the replay's inputs."""
    from transformers import AutoTokenizer

    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits import get_kit
    from trl_mrtpo.scripts.demo import cpu_run_config
    from trl_mrtpo.scripts.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    kit = get_kit(task)
    dataset = kit.dataset(prompts, seed, None)
    args = cpu_run_config(
        "bf16_replay_out",
        per_device_train_batch_size=generations,
        num_generations=generations,
        max_completion_length=tokens,
        temperature=0.7,
        seed=seed,
        credit_warmup_steps=0,
        replay_only_varying=False,
        # the recipes' lengths: a completion may not stop before ``tokens`` (the embedded model's answers are short)
        generation_kwargs={"min_new_tokens": tokens} if force_length else None,
    )
    trainer = MRTPOTrainer(
        model=build_model(model_name, tokenizer),
        reward_funcs=kit.rewards,
        info_blocks=kit.info_blocks,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    calls = []
    original = trainer_module.replay_relevance

    def recording(model, contexts, completions, temperature, **kwargs):
        calls.append((contexts, completions, temperature))
        return original(model, contexts, completions, temperature, **kwargs)

    trainer_module.replay_relevance = recording
    try:
        records = [sample_credit(trainer, [dataset[i]], generations) for i in range(prompts)]
    finally:
        trainer_module.replay_relevance = original
    return trainer, records, calls


def wanted_pairs(record) -> list[list[int]]:
    """Per response, the reward indices replayed, in the order the contexts were built."""
    return [[k for k in range(record.replayed.shape[1]) if record.replayed[j, k]] for j in range(len(record.mask))]


def relevance_tensor(record, q: list[torch.Tensor]) -> torch.Tensor:
    """``[B, K, C]`` q placed like the trainer places it."""
    out = torch.zeros_like(record.relevance)
    for j, rewards in enumerate(wanted_pairs(record)):
        for row, k in enumerate(rewards):
            out[j, k, : q[j].shape[1]] = q[j][row]
    return out


@torch.no_grad()  # the routes' activations would otherwise be kept for a backward that never comes (GBs at 1,024)
def noise_floor(model, contexts, completions, temperature) -> list[torch.Tensor]:
    """Per response, JS between ``P_all``'s distributions along two routes that must agree."""
    alls = [c[0] for c in contexts if len(c) >= 2]
    owned = [comp for c, comp in zip(contexts, completions) if len(c) >= 2]
    tree = completion_hidden_states(model, alls, owned, batch_size=8, min_shared_prefix=1)
    alone = completion_hidden_states(model, alls, owned, batch_size=1, min_shared_prefix=None)
    with lm_head_parameters(model) as (weight, bias):
        return [replay_divergence(a, b[None], weight, bias, temperature)[0] for a, b in zip(tree, alone)]


def measure(model_name: str, task: str, args) -> list[dict]:
    trainer, records, calls = recorded_batch(
        model_name, task, args.prompts, args.generations, args.tokens, args.seed, args.force_length
    )
    fp32 = trainer.accelerator.unwrap_model(trainer.model).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16).eval()
    names = trainer.reward_func_names
    per_reward = {
        k: {"signal": [], "noise32": [], "noise16": [], "diff": [], "a": [], "b": []} for k in range(len(names))
    }
    adv_diff, adv_norm, route_diff, route_norm = 0.0, 0.0, 0.0, 0.0
    generator = torch.Generator().manual_seed(args.seed)
    for record, (contexts, completions, temperature) in zip(records, calls):
        q32 = replay_relevance(fp32, contexts, completions, temperature)
        q16 = replay_relevance(bf16, contexts, completions, temperature)
        # the same bf16 q along the second route (each sequence alone, no prefix reuse): what arithmetic alone moves
        q16_alone = replay_relevance(bf16, contexts, completions, temperature, batch_size=1, min_shared_prefix=None)
        noise32 = noise_floor(fp32, contexts, completions, temperature)
        noise16 = noise_floor(bf16, contexts, completions, temperature)
        replayed_rows = [j for j, c in enumerate(contexts) if len(c) >= 2]
        for position, j in enumerate(replayed_rows):
            for row, k in enumerate(wanted_pairs(record)[j]):
                entry = per_reward[k]
                entry["signal"].append(q32[j][row])
                entry["diff"].append((q16[j][row] - q32[j][row]).abs())
                entry["a"].append(q32[j][row])
                entry["b"].append(q16[j][row])
                entry["noise32"].append(noise32[position])
                entry["noise16"].append(noise16[position])
        rel32, rel16 = relevance_tensor(record, q32), relevance_tensor(record, q16)
        rel16_alone = relevance_tensor(record, q16_alone)
        weights = torch.ones(len(names))
        # every reward varying (a random, group-centred advantage): how q's error reaches A, whichever rewards vary
        group = torch.randn(record.group_advantages.shape, generator=generator)
        group = group - group.mean(0, keepdim=True)
        a32 = steps_5_to_8(group, rel32, record, weights)
        a16 = steps_5_to_8(group, rel16, record, weights)
        a16_alone = steps_5_to_8(group, rel16_alone, record, weights)
        adv_diff += float(((a16 - a32) ** 2).sum())
        adv_norm += float((a32**2).sum())
        route_diff += float(((a16_alone - a16) ** 2).sum())
        route_norm += float((a16**2).sum())
    advantage_rel = (adv_diff / adv_norm) ** 0.5 if adv_norm > 0 else float("nan")
    route_rel = (route_diff / route_norm) ** 0.5 if route_norm > 0 else float("nan")
    rows = []
    for k, entry in per_reward.items():
        if not entry["signal"]:
            continue
        signal, a, b = torch.cat(entry["signal"]), torch.cat(entry["a"]), torch.cat(entry["b"])
        diff, noise32, noise16 = torch.cat(entry["diff"]), torch.cat(entry["noise32"]), torch.cat(entry["noise16"])
        corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1]) if a.numel() > 1 else float("nan")
        rows.append(
            {
                "model": model_name,
                "task": task,
                "reward": names[k],
                "pairs": len(entry["signal"]),
                "tokens": signal.numel(),
                "signal_q_fp32": f"{signal.mean():.3e}",
                "noise_q_fp32": f"{noise32.mean():.3e}",
                "noise_q_bf16": f"{noise16.mean():.3e}",
                "noise_max_bf16": f"{noise16.max():.3e}",
                "bf16_vs_fp32_max_abs": f"{diff.max():.3e}",
                "bf16_vs_fp32_mean_abs": f"{diff.mean():.3e}",
                "bf16_vs_fp32_corr": f"{corr:.4f}",
                "advantage_rel_l2": f"{advantage_rel:.4f}",
                "signal_q_median_fp32": f"{signal.median():.3e}",
                "noise_over_median_bf16": f"{noise16.mean() / signal.median():.4f}",
                "advantage_rel_l2_routes_bf16": f"{route_rel:.4f}",
            }
        )
    return rows


def write_rows(rows: list[dict], output: Path, argv) -> None:
    """Written after every (model, task), so that a long run keeps what it finished."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    write_provenance(output, " ".join(["python", "benchmarks/bf16_replay.py", *(argv or sys.argv[1:])]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "tiny"], choices=["smollm2", "tiny"])
    parser.add_argument("--tasks", nargs="+", default=["short", "if"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--force-length", action="store_true", help="every completion is exactly --tokens long (min_new_tokens)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=str(HERE / "results" / "bf16_replay.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for model_name in args.models:
        for task in args.tasks:
            rows.extend(measure(model_name, task, args))
            print(f"{model_name}/{task}: done", flush=True)
            write_rows(rows, Path(args.output), argv)
    output = Path(args.output)
    ratios = [float(r["noise_q_bf16"]) / float(r["signal_q_fp32"]) for r in rows if float(r["signal_q_fp32"]) > 0]
    print(f"wrote {output}; bf16 noise floor / signal, median over rewards: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
