"""What this project can only measure on a GPU, in one command of at most 5 minutes (``bash benchmarks/gpu_check.sh``).

Five parts, in order of value, each in its own process under its own time limit (:data:`LIMITS`). Each part rewrites
``<part>.json`` whenever it has measured something more, and its one-line summary goes to ``summary.txt`` (and the
console) as soon as it ends, so a part that fails or is cut short leaves the others' files and its own figures so far.

1. ``step``: training steps that replay, timed. GDPO against MRTPO (the published rule, replaying from step 1) with
   ``MRTPOTrainer`` on a random model of SmolLM2-1.7B's shape (no weights travel; the embedded model's tokenizer),
   LoRA, bf16, 16 completions of 256 tokens a step, three rewards forced to vary (bits of a hash of the completion)
   with the basic kit's prompts and info blocks. Per method and step: seconds, the replay's seconds and its JS op's
   seconds synchronised with the device, the replayed fraction, and peak allocated and reserved memory.
2. ``packing``: the replay alone on 16 completions of 64-512 tokens after 256-token prompts with three removed blocks
   (a random model of SmolLM2-1.7B's shape, bf16, SDPA), packed against one sequence per row right-padded: decoder
   positions computed and seconds synchronised with the device (``benchmarks/replay_overhead.py``'s batch and count).
3. ``phases``: one step's phases at Qwen2.5-7B's shape (random, full depth, gradient checkpointing, LoRA, bf16;
   16 completions of 1,024 tokens after 512-token prompts holding 3 info blocks): the old log-probabilities, the
   forward-backward, and the replay forced to 1.5, 2 and 4 contexts per response, each with seconds, peak allocated
   and reserved memory and the JS op's synchronised seconds. From them, the modelled MRTPO/GDPO step ratio at 12 % and
   33 % of pairs replayed, for generation times stated as assumptions (no vLLM there; see :func:`modelled_ratios`).
4. ``correctness``: q from the torch rule and the Triton kernel on the device's tensors against float64 logits
   projected through the same head in vocabulary tiles, token by token: K 1, 3, 8 on far and near contexts; an fp32
   head with TF32 off and on; bf16 states with an fp32 head; a softcap with a bias at V 256,000; and one chunk of
   more than 2^31 logits. Then the registers and spills of each compiled variant of the row kernel, and
   ``tests/test_device_rule.py`` and ``tests/test_triton_divergence.py`` run on CUDA tensors.
5. ``js_table``: the JS op at Qwen2.5-7B's head (H 3,584, V 152,064, 16,384 tokens, bf16): the kernel, the torch
   rule, TRL's chunked divergence called K times and Liger's fused linear JSD called K times, K 1, 3, 8, in seconds
   and peak MB above the inputs; the kernel and the torch rule with an fp32 head; a sweep of the chunk's tokens, and
   of ``BLOCK_V`` with ``num_warps``.

    bash benchmarks/prepare_gpu_wheels.sh                 # here, once: .whl/ (wheels and the tokenizer)
    bash benchmarks/gpu_check.sh [OUTPUT_DIR]             # there (device `run`, carry [".whl"])
    python benchmarks/gpu_check.py OUTPUT_DIR --parts correctness js_table   # some parts only
    DRY=1 bash benchmarks/gpu_check.sh OUTPUT_DIR         # the dry run: CPU, toy sizes, Triton's interpreter

Without CUDA it stops at once (exit code 2), unless dry. The dry run checks the plumbing, not the GPU: every part at
toy sizes (:data:`SIZES`), the test files collected only (the fast tier runs them on CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("step", "packing", "phases", "correctness", "js_table")
# Seconds per part on the GPU (each part's process start-up included): 260 in all, under the wrapper's 290 with the
# wheels' installation.
LIMITS = {
    "cuda": {"step": 95, "packing": 25, "phases": 55, "correctness": 45, "js_table": 40},
    "cpu": dict.fromkeys(PARTS, 300),
}

# SmolLM2-135M-Instruct's shape (its config.json); the models here are random.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)  # fmt: skip
# SmolLM2-1.7B-Instruct's: the same tokenizer, 24 layers of width 2,048.
SMOLLM2_1_7B = {**SMOLLM2, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                "num_attention_heads": 32, "num_key_value_heads": 32,
                "rope_parameters": {"rope_theta": 130000.0, "rope_type": "default"}}  # fmt: skip
# Qwen2.5-7B-Instruct's.
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)  # fmt: skip
TINY = dict(num_hidden_layers=2, intermediate_size=64, hidden_size=72, num_attention_heads=9, num_key_value_heads=3)

# The sizes of each part: on the GPU, and in the dry run on CPU (toy sizes, same code).
SIZES = {
    "cuda": {
        "step": dict(model=SMOLLM2_1_7B, steps=3, batch=16, length=256),
        "packing": dict(model=SMOLLM2_1_7B, batch=(4, 4, 256, 32, (64, 512)), repeats=3),
        "phases": dict(model=QWEN25_7B, responses=16, prompt=512, block=64, length=1024, micro_batch=4),
        "correctness": dict(tokens=256, hidden=3584, vocab=152064, gemma_vocab=256000, big_tokens=4096,
                            big_elements=2**31, tile=16384),
        "js_table": dict(tokens=16384, hidden=3584, vocab=152064, ks=(1, 3, 8), chunks=(1024, 2048, 4096, 8192),
                         blocks=(1024, 2048, 4096, 8192), warps=(4, 8)),
    },
    "cpu": {
        "step": dict(model={**SMOLLM2, **TINY}, steps=2, batch=4, length=8),
        "packing": dict(model={**SMOLLM2, **TINY}, batch=(2, 4, 48, 8, (4, 40)), repeats=1),
        "phases": dict(model={**QWEN25_7B, **TINY, "vocab_size": 300, "num_key_value_heads": 1}, responses=4,
                       prompt=24, block=3, length=8, micro_batch=2),
        "correctness": dict(tokens=8, hidden=16, vocab=300, gemma_vocab=520, big_tokens=16, big_elements=2**12,
                            tile=128),
        "js_table": dict(tokens=16, hidden=16, vocab=300, ks=(1, 3), chunks=(4, 16), blocks=(128, 512), warps=(4,)),
    },
}  # fmt: skip
# Step 1's bounds of the kernel tests against float64, in bits: far contexts absolute, near relative to each
# token's own q (tests/test_triton_divergence.py).
FAR_ATOL = 2e-6
NEAR_RTOL = 6e-3
# Generation seconds assumed for the modelled step ratio, as multiples of the measured forward-backward.
GENERATION_MULTIPLES = (0.0, 1.0, 3.0)


class Record:
    """A part's JSON file, rewritten whenever it grows: a part cut short keeps what it measured."""

    def __init__(self, output: Path, part: str):
        self.path, self.data = output / f"{part}.json", {}

    def __setitem__(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1))

    def append(self, key: str, row: dict) -> None:
        self[key] = [*self.data.get(key, []), row]


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def measured(into: dict):
    """Writes into ``into`` the synchronised seconds and the peak allocated and reserved MB of what runs inside."""
    import torch

    synchronize()
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    yield
    synchronize()
    into["seconds"] = time.perf_counter() - started
    into["peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20 if cuda() else 0.0
    into["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20 if cuda() else 0.0


class JSClock:
    """The replay's JS op timed with the device synchronised around each call (the replay module's name for it is
    wrapped for this process)."""

    def __init__(self):
        from trl_mrtpo import replay

        self.seconds, self.original = 0.0, replay.stacked_divergence
        replay.stacked_divergence = self.timed

    def timed(self, *args, **kwargs):
        synchronize()
        started = time.perf_counter()
        out = self.original(*args, **kwargs)
        synchronize()
        self.seconds += time.perf_counter() - started
        return out


def random_model(folder: Path, tokenizer: Path, config: dict, device: str = "cpu") -> str:
    """A randomly initialised Llama of ``config`` (SmolLM2's family) with the embedded model's tokenizer, saved in
    ``folder``: built on ``device``, saved in bf16 on CUDA (as the recipes load their models)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config))
    (model.to(torch.bfloat16) if device == "cuda" else model).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    return str(folder)


def random_smollm2(folder: Path, tokenizer: Path, **shape) -> str:
    """A random model of SmolLM2-135M's shape (``shape`` changes any of it): the benchmarks' tests' small model."""
    return random_model(folder, tokenizer, {**SMOLLM2, **shape})


def hash_bit_reward(bit: int):
    """A 0/1 reward that varies from completion to completion: bit ``bit`` of the SHA-256 of its text."""
    from trl_mrtpo.utils import completion_text

    def reward(completions: list, **kwargs) -> list[float]:
        return [float(hashlib.sha256(completion_text(c).encode()).digest()[0] >> bit & 1) for c in completions]

    reward.__name__ = f"hash_bit_{bit}_reward"
    return reward


def part_step(record: Record, device: str, tokenizer: Path) -> str:
    import torch
    from transformers import TrainerCallback

    from trl_mrtpo.kits.basic import constraint_block, make_basic_dataset
    from trl_mrtpo.research.config import arm_settings
    from trl_mrtpo.scripts.demo import cpu_run_config, embedded_lora_trainer
    from trl_mrtpo.trainer import MRTPOTrainer

    sizes = SIZES[device]["step"]
    clock, replay = JSClock(), {"seconds": 0.0}
    original_replay = MRTPOTrainer._replay

    def timed_replay(self, batch):
        synchronize()
        started = time.perf_counter()
        out = original_replay(self, batch)
        synchronize()
        replay["seconds"] += time.perf_counter() - started
        return out

    MRTPOTrainer._replay = timed_replay

    class StepClock(TrainerCallback):
        def __init__(self):
            self.rows, self.current = [], {}

        def on_step_begin(self, *_, **__):
            clock.seconds = replay["seconds"] = 0.0
            self.context = measured(self.current)
            self.context.__enter__()

        def on_step_end(self, *_, **__):
            self.context.__exit__(None, None, None)
            self.rows.append({**self.current, "replay_seconds": replay["seconds"], "js_seconds": clock.seconds})

    rewards = [hash_bit_reward(bit) for bit in range(3)]
    blocks = [constraint_block(name) for name in ("end_phrase", "keyword", "lowercase")]
    record["setup"] = {**sizes, "model": "random, SmolLM2-1.7B's shape" if device == "cuda" else "random, tiny",
                       "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        model = random_model(Path(folder) / "model", tokenizer, sizes["model"], device)
        for method in ("gdpo", "mrtpo"):
            step_clock = StepClock()
            config = cpu_run_config(
                str(Path(folder) / method), max_steps=sizes["steps"], per_device_train_batch_size=sizes["batch"],
                num_generations=4, max_completion_length=sizes["length"], learning_rate=0.0, seed=0,
                credit_assignment=method, credit_warmup_steps=0, disable_tqdm=True, use_cpu=device == "cpu",
                bf16=device == "cuda", model_init_kwargs={"dtype": "bfloat16" if device == "cuda" else "float32"},
                **arm_settings({}),
            )  # fmt: skip
            dataset = make_basic_dataset(num_prompts=sizes["batch"] * sizes["steps"] // 4, seed=0)
            trainer = embedded_lora_trainer(rewards, blocks, config, dataset, model=model, callbacks=[step_clock])
            trainer.train()
            logs = [entry for entry in trainer.state.log_history if "mrtpo/replayed_fraction" in entry]
            rows = [
                {"step": step, **row, "replayed_fraction": log["mrtpo/replayed_fraction"]}
                for step, (row, log) in enumerate(zip(step_clock.rows, logs), start=1)
            ]
            record[method] = rows
            del trainer
            torch.cuda.empty_cache() if device == "cuda" else None
    means = {
        m: {k: statistics.mean(r[k] for r in record.data[m][1:]) for k in record.data[m][0]} for m in ("gdpo", "mrtpo")
    }  # fmt: skip  (step 1 is the warm-up)
    record["means_after_step_1"] = means
    gdpo, mrtpo = means["gdpo"], means["mrtpo"]
    return (
        f"MRTPO/GDPO step {mrtpo['seconds'] / gdpo['seconds']:.2f}x "
        f"({mrtpo['seconds']:.2f} / {gdpo['seconds']:.2f} s), "
        f"replay {mrtpo['replay_seconds']:.2f} s (JS {mrtpo['js_seconds']:.3f} s), replayed "
        f"{mrtpo['replayed_fraction']:.0%}, peak allocated {mrtpo['peak_allocated_mb']:.0f} / "
        f"{gdpo['peak_allocated_mb']:.0f} MB, reserved {mrtpo['peak_reserved_mb']:.0f} / "
        f"{gdpo['peak_reserved_mb']:.0f} MB"
    )


def replay_contexts(prompts: list[list[int]], block: int, contexts: float) -> list[list[list[int]]]:
    """Per response (its prompt ``prompts[j]``), its ``[P_all, P_not_k, ...]`` for an average of ``contexts`` contexts
    per response: 4 is every response with each of its 3 blocks removed, 2 every response with one block removed,
    1.5 every other response with two (the others are not replayed). The blocks are the prompt's tokens
    ``[b, b + block)`` at ``b = block, 3 block, 5 block``."""
    if contexts not in (1.5, 2, 4):
        raise ValueError(f"contexts per response must be 1.5, 2 or 4, got {contexts}")
    rows = []
    for j, prompt in enumerate(prompts):
        removed = [prompt[:b] + prompt[b + block :] for b in (block, 3 * block, 5 * block)]
        if contexts == 4:
            rows.append([prompt, *removed])
        elif contexts == 2:
            rows.append([prompt, removed[j % 3]])
        else:
            rows.append([prompt, *removed[:2]] if j % 2 == 0 else [prompt])
    return rows


def modelled_ratios(phases: dict, replay: dict[float, float], fractions=(0.12, 0.33)) -> list[dict]:
    """MRTPO/GDPO step time at each fraction ``p`` of (response, reward) pairs replayed, K = 3. A GDPO step is
    generation + old log-probabilities + forward-backward; MRTPO adds the replay of ``c(p) = 1 - (1 - p)^3 + 3 p``
    contexts per response (``P_all`` where any of a response's pairs is replayed, the pairs independent, then one
    context per replayed pair), its seconds interpolated linearly between the measured ``replay`` (contexts per
    response: seconds) and 0 s at 0 contexts. Generation is not measured (no vLLM there): it is assumed at
    :data:`GENERATION_MULTIPLES` times the forward-backward."""
    points = [(0.0, 0.0), *sorted(replay.items())]

    def replay_seconds(contexts: float) -> float:
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if contexts <= x1:
                return y0 + (y1 - y0) * (contexts - x0) / (x1 - x0)
        raise ValueError(f"{contexts} contexts per response is beyond the measured {points[-1][0]}")

    rows = []
    for multiple in GENERATION_MULTIPLES:
        generation = multiple * phases["forward_backward"]
        gdpo = generation + phases["old_logprobs"] + phases["forward_backward"]
        for p in fractions:
            contexts = 1 - (1 - p) ** 3 + 3 * p
            seconds = replay_seconds(contexts)
            rows.append({"generation_assumed_s": generation, "replayed_fraction": p, "contexts": contexts,
                         "replay_s": seconds, "mrtpo_over_gdpo": (gdpo + seconds) / gdpo})  # fmt: skip
    return rows


def part_packing(record: Record, device: str) -> str:
    """The replay alone on completions of varying length, packed (one row per prefix-tree node, a block mask) against
    one sequence per row right-padded: decoder positions computed and seconds synchronised with the device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from replay_overhead import replay_cost, variable_length_batch

    sizes = SIZES[device]["packing"]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16 if device == "cuda" else torch.float32)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**sizes["model"])).eval()
    torch.set_default_dtype(torch.float32)
    prompts, group, prompt, block, lengths = sizes["batch"]
    record["setup"] = {"model": "random, SmolLM2-1.7B's shape, bf16, SDPA" if device == "cuda" else "random, tiny",
                       "responses": prompts * group, "prompt_tokens": prompt, "removed_blocks": 3,
                       "block_tokens": block, "completion_tokens": lengths, "repeats": sizes["repeats"]}  # fmt: skip
    contexts, completions = variable_length_batch(prompts, group, prompt, block, lengths, seed=0)
    paths = {}
    for path in ("padded", "packed"):
        positions, seconds = replay_cost(model, contexts, completions, path == "packed", sizes["repeats"])
        paths[path] = {"positions": positions, "seconds": round(seconds, 4)}
        record["paths"] = paths
    packed, padded = paths["packed"], paths["padded"]
    ratio = packed["seconds"] / padded["seconds"]
    return (
        f"replay of {prompts * group} completions of {lengths[0]}-{lengths[1]} tokens: packed "
        f"{packed['seconds']:.3f} s against padded {padded['seconds']:.3f} s ({ratio:.2f}x), decoder positions "
        f"{packed['positions']:,} against {padded['positions']:,}"
    )


def part_phases(record: Record, device: str) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import selective_log_softmax

    from trl_mrtpo.ops.device_rule import usable_memory
    from trl_mrtpo.replay import replay_relevance, replay_settings

    sizes = SIZES[device]["phases"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**sizes["model"]))
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"]))  # fmt: skip
    record["setup"] = {k: v for k, v in sizes.items() if k != "model"} | {
        "model": "random, Qwen2.5-7B's shape" if device == "cuda" else "random, tiny"
    }
    vocab, length, responses = sizes["model"]["vocab_size"], sizes["length"], sizes["responses"]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(vocab, (sizes["prompt"],), generator=generator).tolist() for _ in range(responses // 4)]
    completions = [torch.randint(vocab, (length,), generator=generator).tolist() for _ in range(responses)]
    sequences = torch.tensor([prompts[j // 4] + completions[j] for j in range(responses)], device=device)
    targets = sequences[:, -length:]

    def logprobs(rows: slice) -> torch.Tensor:
        logits = model(input_ids=sequences[rows], logits_to_keep=length + 1).logits[:, :-1]
        return selective_log_softmax(logits, targets[rows])

    micro = [slice(s, s + sizes["micro_batch"]) for s in range(0, responses, sizes["micro_batch"])]
    phases, seconds = {}, {}
    model.train()  # TRL's old log-probabilities run in train mode, without gradients
    for name in ("old_logprobs", "forward_backward"):
        phases[name] = {}
        with measured(phases[name]):
            for rows in micro:
                if name == "old_logprobs":
                    with torch.no_grad():
                        logprobs(rows)
                else:
                    (-logprobs(rows).mean()).backward()
        seconds[name] = phases[name]["seconds"]
        record["phases"] = phases
    model.zero_grad(set_to_none=True)
    temperature, backend = replay_settings(model, 1.0, "auto", 3)
    usable = usable_memory(torch.device(device)) if device == "cuda" else None  # as the trainer sizes its replay
    record["replay_backend"], record["usable_bytes"] = backend, usable
    clock, replay = JSClock(), {}
    for contexts in (1.5, 2, 4):
        per_response = replay_contexts([prompts[j // 4] for j in range(responses)], sizes["block"], contexts)
        name = f"replay_{contexts}_contexts"
        phases[name] = {}
        clock.seconds = 0.0
        with measured(phases[name]):
            replay_relevance(model, per_response, completions, temperature, backend=backend, usable_bytes=usable)
        phases[name]["js_seconds"] = clock.seconds
        replay[contexts] = phases[name]["seconds"]
        record["phases"] = phases
    record["modelled"] = rows = modelled_ratios(seconds, replay)
    at = {(r["generation_assumed_s"], r["replayed_fraction"]): r["mrtpo_over_gdpo"] for r in rows}
    fb = seconds["forward_backward"]
    return (
        f"old log-probs {seconds['old_logprobs']:.2f} s, forward-backward {fb:.2f} s, replay at 1.5/2/4 contexts "
        + "/".join(f"{replay[c]:.2f}" for c in (1.5, 2, 4))
        + f" s ({backend}); modelled MRTPO/GDPO at 12-33 % replayed: {at[(fb, 0.12)]:.2f}-{at[(fb, 0.33)]:.2f}x with "
        f"generation assumed = forward-backward, {at[(0.0, 0.12)]:.2f}-{at[(0.0, 0.33)]:.2f}x without"
    )


def float64_q(hidden_all, hidden_removed, weight, bias, temperature: float, softcap: float | None, tile: int):
    """``[K, N]`` float64 JS / ln 2, the textbook formula over logits projected in float64 through ``weight`` (and
    ``bias``) in vocabulary tiles of ``tile`` rows: each context's log-normaliser, then the JS terms tile by tile."""
    import torch

    def logits(hidden, rows: slice):
        z = hidden.double() @ weight[rows].double().T + (0.0 if bias is None else bias[rows].double())
        return (softcap * torch.tanh(z / softcap) if softcap else z) / temperature

    contexts = [hidden_all, *hidden_removed]
    tiles = [slice(s, s + tile) for s in range(0, weight.shape[0], tile)]
    normaliser = [
        torch.logsumexp(torch.stack([torch.logsumexp(logits(h, t), -1) for t in tiles]), 0) for h in contexts
    ]
    total = torch.zeros(len(hidden_removed), hidden_all.shape[0], dtype=torch.float64, device=hidden_all.device)
    for t in tiles:
        p = torch.exp(logits(hidden_all, t) - normaliser[0][:, None])
        for m, h in enumerate(hidden_removed, start=1):
            q = torch.exp(logits(h, t) - normaliser[m][:, None])
            mixture = 0.5 * (p + q)
            kl_p = torch.where(p > 0, p * (p.log() - mixture.log()), 0.0).sum(-1)
            kl_q = torch.where(q > 0, q * (q.log() - mixture.log()), 0.0).sum(-1)
            total[m - 1] += 0.5 * (kl_p + kl_q)
    return total / math.log(2)


def correctness_inputs(k: int, tokens: int, hidden: int, vocab: int, near: bool, device: str, seed: int = 0):
    """States and a head whose logits spread by about 3 (fp32): far contexts independent (q about 0.9 bits), near
    ones ``P_all``'s state plus 1 % noise (median q 1e-4 to 1e-3 bits), and a bias."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    hidden_all = torch.randn(tokens, hidden, generator=generator, device=device)
    noise = torch.randn(k, tokens, hidden, generator=generator, device=device)
    hidden_removed = hidden_all + 0.01 * noise if near else noise
    weight = torch.randn(vocab, hidden, generator=generator, device=device) * (3 / hidden**0.5)
    return hidden_all, hidden_removed, weight, torch.randn(vocab, generator=generator, device=device)


def compiled_variants() -> list[dict]:
    """Registers, spills and warps of each compiled variant of the row kernel (Triton's per-device kernel cache)."""
    from trl_mrtpo.ops import triton_divergence

    variants = []
    for caches in getattr(triton_divergence._js_rows_kernel, "device_caches", {}).values():
        for key, kernel in caches[0].items():
            getattr(kernel, "_init_handles", lambda: None)()
            metadata = getattr(kernel, "metadata", None)
            variants.append({"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
                             "num_warps": getattr(metadata, "num_warps", None), "key": str(key)[:300]})  # fmt: skip
    return variants


def part_correctness(record: Record, device: str, output: Path) -> str:
    import torch

    from trl_mrtpo.ops import replay_divergence, triton_divergence

    sizes = SIZES[device]["correctness"]
    tokens, hidden, vocab, tile = sizes["tokens"], sizes["hidden"], sizes["vocab"], sizes["tile"]
    bf16 = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dots are wrong
    # (name, K, vocabulary, states' dtype, head's dtype, TF32, softcap, tokens, chunk)
    cases = [(f"K{k} bf16", k, vocab, bf16, bf16, False, None, tokens, None) for k in (1, 3, 8)]
    cases += [
        ("K3 fp32 TF32 off", 3, vocab, torch.float32, torch.float32, False, None, tokens, None),
        ("K3 fp32 TF32 on", 3, vocab, torch.float32, torch.float32, True, None, tokens, None),
        ("K3 bf16 states, fp32 head", 3, vocab, bf16, torch.float32, False, None, tokens, None),
        ("K3 softcap 30 with bias", 3, sizes["gemma_vocab"], bf16, bf16, False, 30.0, tokens, None),
    ]
    big = sizes["big_tokens"]
    cases.append((f"K3 one chunk of {big * 4 * vocab:.3g} logits", 3, vocab, bf16, bf16, False, None, big, big))
    assert big * 4 * vocab > sizes["big_elements"]
    backends = ("torch", "triton") if triton_divergence.is_available() else ("torch",)
    worst = {}
    for name, k, v, states, head, tf32, softcap, n, chunk in cases:
        for regime in ("far", "near"):
            if chunk is not None and regime == "far":
                continue  # the long chunk: the near regime, where q is small and rounding shows
            h_all, h_removed, weight, bias = correctness_inputs(k, n, hidden, v, regime == "near", device)
            h_all, h_removed, weight = h_all.to(states), h_removed.to(states), weight.to(head)
            expected = float64_q(h_all, h_removed, weight, bias, 0.7, softcap, tile)
            for backend in backends:
                torch.backends.cuda.matmul.allow_tf32 = tf32
                q = replay_divergence(h_all, h_removed, weight, bias, 0.7, chunk, backend, softcap).double()
                torch.backends.cuda.matmul.allow_tf32 = False
                error = (q - expected).abs()
                relative = (error / (1e-9 + expected)).max().item()  # the tests' atol of 1e-9 bits
                within = error.max().item() <= FAR_ATOL if regime == "far" else relative <= NEAR_RTOL
                row = {"case": name, "regime": regime, "backend": backend, "tokens": n, "vocab": v,
                       "max_abs_error_bits": error.max().item(), "max_relative_error": relative,
                       "median_q": expected.median().item(), "within_bounds": within}  # fmt: skip
                record.append("cases", row)
                worst[(name, regime, backend)] = within
            del h_all, h_removed, weight, bias, expected
    record["bounds"] = {"far_abs_bits": FAR_ATOL, "near_relative": NEAR_RTOL}
    record["compiled_variants"] = compiled_variants() if device == "cuda" else "interpreter: nothing compiled"
    try:
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device_rule.py",
             "tests/test_triton_divergence.py", *(["--collect-only"] if device == "cpu" else [])],
            cwd=ROOT, capture_output=True, text=True, timeout=40,
        )  # fmt: skip
        (output / "correctness_tests.log").write_text(tests.stdout + tests.stderr)
        record["tests"] = {"returncode": tests.returncode, "last_line": tests.stdout.strip().splitlines()[-1]}
    except subprocess.TimeoutExpired:
        record["tests"] = {"returncode": None, "last_line": "cut at 40 s"}
    failed = [f"{n} {r} {b}" for (n, r, b), ok in worst.items() if not ok]
    spills = [v["n_spills"] for v in record.data["compiled_variants"] if isinstance(v, dict)]
    return (
        f"{len(worst) - len(failed)}/{len(worst)} within bounds"
        + (f" (outside: {'; '.join(failed)})" if failed else "")
        + (f"; spills per variant {spills}" if spills else "")
        + f"; tests: {record.data['tests']['last_line']}"
    )


def timed(function, repeats: int = 3) -> dict:
    """The median synchronised seconds of ``repeats`` calls after a warm-up, and the peak MB allocated above what
    was allocated before (0 off CUDA)."""
    import torch

    function()
    synchronize()
    base = torch.cuda.memory_allocated() if cuda() else 0
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        function()
        synchronize()
        times.append(time.perf_counter() - started)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda() else 0.0
    return {"seconds": statistics.median(times), "peak_mb": peak}


def trl_divergence(h_all, h_removed, weight):
    """TRL's chunked divergence at beta 0.5 (JS) called once per removed context, in bits."""
    import torch
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    with torch.no_grad():
        return torch.stack(
            [ChunkedDivergenceFunction.apply(h, weight, None, h_all, weight, None, 0.5)[0] for h in h_removed]
        ).float() / math.log(2)


def liger_divergence(h_all, h_removed, weight):
    """Liger's fused linear JSD at beta 0.5, once per removed context (its API: student input and weight, teacher
    input and weight, ``shift_labels``; it returns a reduced loss, so only its time and memory compare)."""
    import torch
    from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

    jsd = LigerFusedLinearJSD(jsd_beta=0.5)
    labels = torch.zeros(h_all.shape[0], dtype=torch.long, device=h_all.device)  # no position ignored
    return [jsd(h, weight, h_all, weight, labels) for h in h_removed]


@contextmanager
def kernel_launch(block_v: int, num_warps: int):
    """The row kernel launched with at most ``block_v`` vocabulary columns per block and ``num_warps`` warps."""
    from trl_mrtpo.ops import triton_divergence

    saved = triton_divergence.MAX_BLOCK_V, triton_divergence.NUM_WARPS
    triton_divergence.MAX_BLOCK_V, triton_divergence.NUM_WARPS = block_v, num_warps
    try:
        yield
    finally:
        triton_divergence.MAX_BLOCK_V, triton_divergence.NUM_WARPS = saved


def part_js_table(record: Record, device: str) -> str:
    import torch

    from trl_mrtpo.ops import replay_divergence, triton_divergence

    sizes = SIZES[device]["js_table"]
    tokens, hidden, vocab = sizes["tokens"], sizes["hidden"], sizes["vocab"]
    bf16 = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dots are wrong
    record["setup"] = {k: v for k, v in sizes.items()}
    generator = torch.Generator(device=device).manual_seed(0)
    has_triton = triton_divergence.is_available()

    def inputs(k: int, dtype):
        h = torch.randn(k + 1, tokens, hidden, generator=generator, device=device).to(dtype)
        weight = (torch.randn(vocab, hidden, generator=generator, device=device) / hidden**0.5).to(dtype)
        return h[0], h[1:], weight

    methods = {
        "kernel": lambda h_all, h_removed, weight: replay_divergence(h_all, h_removed, weight, backend="triton"),
        "torch_rule": lambda h_all, h_removed, weight: replay_divergence(h_all, h_removed, weight, backend="torch"),
        "trl_x_k": trl_divergence,
        "liger_x_k": liger_divergence,
    }
    if not has_triton:
        del methods["kernel"]
    seconds = {}
    for head, ks in (("bf16", sizes["ks"]), ("fp32", (3,))):
        for k in ks:
            arguments = inputs(k, bf16 if head == "bf16" else torch.float32)
            for method, function in methods.items():
                if head == "fp32" and method not in ("kernel", "torch_rule"):
                    continue
                try:
                    row = {"head": head, "k": k, "method": method, **timed(partial(function, *arguments))}
                except Exception as error:  # noqa: BLE001 - recorded; the other rows go on
                    row = {"head": head, "k": k, "method": method, "error": f"{type(error).__name__}: {error}"[:500]}
                seconds[(head, k, method)] = row.get("seconds")
                record.append("table", row)
            del arguments
            if cuda():
                torch.cuda.empty_cache()
    arguments = inputs(3, bf16)
    reference = replay_divergence(*arguments, backend="triton" if has_triton else "torch")

    def sweep_row(**options) -> dict:
        """The kernel or the rule at K = 3 with ``options``: its time and its largest difference from the default."""
        function = partial(replay_divergence, *arguments, **options)
        return {"max_diff_from_default_bits": (function() - reference).abs().max().item(), **timed(function)}

    for chunk in sizes["chunks"]:
        for backend in ("triton", "torch") if has_triton else ("torch",):
            row = sweep_row(chunk_size=chunk, backend=backend)
            record.append("chunk_sweep", {"chunk_tokens": chunk, "backend": backend, **row})
    for block in sizes["blocks"] if has_triton else ():
        for warps in sizes["warps"]:
            with kernel_launch(block, warps):
                row = sweep_row(backend="triton")
            record.append("block_sweep", {"block_v": block, "num_warps": warps, **row})
    ratios = []
    for k in sizes["ks"]:
        kernel, rule, trl = (seconds.get(("bf16", k, m)) for m in ("kernel", "torch_rule", "trl_x_k"))
        if kernel and rule and trl:
            ratios.append(
                f"K{k}: kernel {kernel * 1e3:.1f} ms, torch rule {rule / kernel:.2f}x, TRL {trl / kernel:.2f}x"
            )
    fastest = min(record.data["block_sweep"], key=lambda r: r["seconds"]) if has_triton else {}
    return "; ".join(ratios) + (
        f"; fastest BLOCK_V {fastest['block_v']} x {fastest['num_warps']} warps" if fastest else ""
    )


def run_part(name: str, output: Path, device: str, tokenizer: Path) -> None:
    """One part in this process: writes ``<name>.json``; its summary line is the last line of stdout."""
    if device == "cpu":
        import torch

        torch.set_num_threads(1)
    record = Record(output, name)
    if name == "step":
        line = part_step(record, device, tokenizer)
    elif name == "packing":
        line = part_packing(record, device)
    elif name == "phases":
        line = part_phases(record, device)
    elif name == "correctness":
        line = part_correctness(record, device, output)
    else:
        line = part_js_table(record, device)
    record["summary"] = line


def main(output: Path, parts: list[str], dry_run: bool, tokenizer: Path) -> int:
    import torch

    if not dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu_check.sh needs a CUDA device; none is available here.", file=sys.stderr)
        return 2
    device = "cpu" if dry_run else "cuda"
    output.mkdir(parents=True, exist_ok=True)
    summary = {"device": "cpu (dry run)" if dry_run else torch.cuda.get_device_name(), "torch": torch.__version__,
               "parts": {}}  # fmt: skip
    lines = output / "summary.txt"
    lines.write_text(f"{summary['device']}, torch {torch.__version__}\n")
    env = {**os.environ, **({"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"} if dry_run else {})}
    for name in parts:
        command = [sys.executable, __file__, str(output), "--part", name, "--tokenizer", str(tokenizer)]
        started = time.perf_counter()
        with open(output / f"{name}.log", "w") as log:
            try:
                returncode = subprocess.run(
                    command + (["--dry-run"] if dry_run else []), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                    env=env, timeout=LIMITS[device][name],
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                returncode = f"cut at {LIMITS[device][name]} s"
        seconds = round(time.perf_counter() - started, 1)
        written = output / f"{name}.json"
        if returncode == 0:
            line = json.loads(written.read_text())["summary"]
        else:
            error = (output / f"{name}.log").read_text().strip().splitlines()
            kept = " (its figures so far are kept)" if written.is_file() else ""
            line = f"FAILED ({returncode}): {error[-1] if error else 'no output'}{kept}; see {name}.log"
        summary["parts"][name] = {"returncode": returncode, "seconds": seconds, "summary": line}
        (output / "summary.json").write_text(json.dumps(summary, indent=1))
        with lines.open("a") as handle:
            handle.write(f"{name} ({seconds} s): {line}\n")
        print(f"{name} ({seconds} s): {line}", flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", nargs="?", default=str(ROOT / "benchmarks" / "results" / "gpu_check"))
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to run, in order")
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, Triton's interpreter")
    parser.add_argument("--tokenizer", help="the SmolLM2 tokenizer's folder (default: .whl/smollm2-tokenizer, "
                        "else the embedded model's)")  # fmt: skip
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one part, in the child process
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is first imported
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else ROOT / ".whl" / "smollm2-tokenizer"
    if not tokenizer_dir.is_dir() and args.part in (None, "step"):
        from trl_mrtpo.scripts.embedded import embedded_model_path

        tokenizer_dir = Path(embedded_model_path())
    if args.part:
        run_part(args.part, Path(args.output), "cpu" if args.dry_run else "cuda", tokenizer_dir)
        sys.exit(0)
    sys.exit(main(Path(args.output), args.parts, args.dry_run, tokenizer_dir))
