"""What the replay adds to a GRPO step's memory: a model, checked against measured peaks on CPU, and its figures at
the recipes' scales.

The replay runs after generation, without gradients, between TRL's generation and its loss; its peak beyond the
model's weights is (docs/method.md step 4; ``trl_mrtpo.replay``, ``trl_mrtpo.ops``):

- **kept states**: the last hidden states of every replayed sequence's completion tokens, held until the JS
  (``sequences x completion x H`` in the model's dtype), plus the larger of
- **a decoder forward**: ``batch`` sequences of ``width`` new tokens after a cached prefix: the prefix's and the
  batch's key/value cache, the widest layer's activations (the MLP's gate and up projections and their product) and,
  for the attention, the keys and values repeated to every head and one layer's scores and weights
  (``batch x heads x width x (prefix + width)`` each), and the batch's last hidden states;
- **the divergence**: one token chunk's fp32 log-probabilities for the ``M + 1`` contexts with the JS's three
  temporaries, over the whole vocabulary for an fp32 model, and over one vocabulary tile (``VOCAB_TILE`` rows, with
  that tile of the lm_head cast to fp32) for a bf16 / fp16 one: never an fp32 copy of the whole lm_head.

On CUDA (``Replay.usable`` set: the bytes the run found usable when it first replayed) the replay is sized from that
headroom (``trl_mrtpo.ops.device_rule``'s budget): the kept states are one stream's (``[tokens, M + 1, H]``, written
once, at most ``REPLAY_STATES_SHARE`` of it), a forward takes as many sequences as keep its new tokens'
activations and cache within ``REPLAY_FORWARD_SHARE`` (attention fused: its output only), and the divergence holds one
chunk of ``budget_chunk_rows`` fp32 vocabulary rows. ``tests/test_replay_memory.py`` counts the same replays on
``meta`` tensors at Qwen2.5-7B's shape and holds this model within 10 % of the count (measured: within 1 %).

``--measure`` checks the model on CPU: random-weight models of the real hidden size and vocabulary at reduced depth,
one replay in a fresh process each, the peak resident memory above the loaded model (``/proc``'s high-water mark,
reset before the replay) against the model's figure. The recipes' figures use the full depth.

    OMP_NUM_THREADS=1 python benchmarks/replay_memory.py --measure      # CPU check + the recipes' table
    python benchmarks/replay_memory.py                                  # the recipes' table only (seconds)
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from provenance import write_provenance  # noqa: E402

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes (its config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Qwen2.5's configs (the recipes' models); SmolLM2-135M's for the CPU runs
SHAPES = {
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 151936),
    "qwen2.5-3b": Shape(2048, 36, 16, 2, 11008, 151936),
    "qwen2.5-7b": Shape(3584, 28, 28, 4, 18944, 152064),
}


@dataclass(frozen=True)
class Replay:
    """One generation batch's replay: responses, contexts per replayed response (P_all and M removed), tokens."""

    responses: int
    removed: int
    prompt: int
    completion: int
    block: int = 40  # tokens an info block adds after the shared prompt
    batch: int = 8  # sequences per replay forward (replay_batch_size)
    dtype_bytes: int = 2
    usable: int | None = None  # bytes usable on the GPU when the run first replays; None: the CPU rules


def replay_peak_bytes(shape: Shape, replay: Replay) -> dict[str, float]:
    """The replay's peak memory beyond the weights, by part (bytes)."""
    from trl_mrtpo.constants import DEFAULT_CHUNK_ELEMENTS, MIN_CHUNK_TOKENS, VOCAB_TILE

    b = replay.dtype_bytes
    sequences = replay.responses * (1 + replay.removed)
    batch = min(replay.batch, sequences)  # a forward holds at most the sequences there are
    kept = sequences * replay.completion * shape.hidden * b
    width = replay.block + replay.completion  # new tokens per sequence after the shared prompt's cache
    total = replay.prompt + width
    kv_per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * b
    forward = (
        replay.prompt * kv_per_token  # the shared prefix's cache
        + batch * total * kv_per_token  # its copy for the batch, grown by the batch's tokens
        + batch * width * (3 * shape.intermediate + 4 * shape.hidden) * b  # the MLP's gate, up, their product
        + 2 * batch * shape.heads * total * shape.head_dim * b  # keys and values repeated to every head
        + 2 * batch * shape.heads * width * total * b  # one layer's attention scores and weights
        + batch * width * shape.hidden * b  # the batch's last hidden states
    )
    contexts = replay.removed + 1
    if replay.usable is not None:  # CUDA: streams, forwards and chunks sized from the usable bytes
        from trl_mrtpo.ops.device_rule import budget_chunk_rows, budget_forward_tokens, budget_states_bytes

        per_response = contexts * replay.completion * shape.hidden * b
        kept = max(per_response, budget_states_bytes(replay.usable) // per_response * per_response)
        kept = min(kept, replay.responses * per_response)
        config = SimpleNamespace(hidden_size=shape.hidden, num_attention_heads=shape.heads, head_dim=shape.head_dim,
                                 num_key_value_heads=shape.kv_heads, intermediate_size=shape.intermediate,
                                 num_hidden_layers=shape.layers)  # fmt: skip
        tokens = budget_forward_tokens(replay.usable, config, b)
        batch = min(replay.batch, sequences, max(1, tokens // width))
        forward = (
            replay.prompt * kv_per_token  # the shared prefix's cache
            + batch * total * kv_per_token  # its copy for the batch, grown by the batch's tokens
            + batch * width * (3 * shape.intermediate + 4 * shape.hidden) * b  # the MLP's gate, up, their product
            + batch * width * shape.hidden * b  # the batch's last hidden states
        )
        divergence = budget_chunk_rows(replay.usable, shape.vocab) * shape.vocab * 4
        return {
            "kept_states": kept,
            "forward": forward,
            "divergence": divergence,
            "peak": kept + max(forward, divergence),
        }
    # fp32 weights: token chunks over the whole vocabulary; a low-precision lm_head: vocabulary tiles cast to fp32
    # one at a time (one fp32 tile, never the whole lm_head), token chunks within a tile
    columns = shape.vocab if b == 4 else min(VOCAB_TILE, shape.vocab)
    chunk = max(MIN_CHUNK_TOKENS, DEFAULT_CHUNK_ELEMENTS // (contexts * columns))
    weight_tile = 0 if b == 4 else columns * shape.hidden * 4
    divergence = (
        weight_tile + (contexts + 3 * replay.removed) * chunk * columns * 4 + contexts * chunk * shape.hidden * (4 + b)
    )
    return {"kept_states": kept, "forward": forward, "divergence": divergence, "peak": kept + max(forward, divergence)}


RECIPE_REPLAYS = [
    # (recipe, model shape, replay): 32 completions per generation (2 per device x 16 accumulation steps)
    # IF: up to 5 constraints replayed per response, ~250-token prompts, 1024-token completions, replay batch 4
    ("if/qwen2.5-7b-instruct-qlora-24gb", "qwen2.5-7b", Replay(32, 5, 250, 1024, batch=4)),
    # SQL: format, error and reference blocks, ~1200-token prompts (a schema), 1024-token completions
    ("sql/qwen2.5-coder-7b-instruct-qlora-24gb", "qwen2.5-7b", Replay(32, 3, 1200, 1024, block=150, batch=4)),
    # tools: format and reference blocks, ~600-token prompts (the tool schemas), 512-token completions
    ("tools/qwen2.5-3b-instruct-lora-24gb", "qwen2.5-3b", Replay(16, 2, 600, 512, block=80, batch=4)),
]


def measured_peak(shape: Shape, replay: Replay, layers: int) -> float:
    """The replay's measured peak resident memory above the loaded model (bytes), in a fresh process."""
    child = [sys.executable, __file__, "--child", json.dumps([asdict(shape), asdict(replay), layers])]
    out = subprocess.run(child, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _child(spec: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_mrtpo.replay import replay_relevance

    shape_fields, replay_fields, layers = json.loads(spec)
    shape, replay = Shape(**shape_fields), Replay(**replay_fields)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    dtype = torch.bfloat16 if replay.dtype_bytes == 2 else torch.float32
    model = LlamaForCausalLM(config).to(dtype).eval()
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(10, shape.vocab, (n,), generator=gen).tolist()

    contexts, completions = [], []
    prompt = ids(replay.prompt)
    for _ in range(replay.responses):
        blocks = [ids(replay.block) for _ in range(replay.removed + 1)]
        contexts.append([prompt + blocks[0]] + [prompt + block for block in blocks[1:]])
        completions.append(ids(replay.completion))
    if replay.usable is not None:  # the device rule, forced on CPU (fp32 weights: no CPU-only casts)
        from trl_mrtpo.ops import divergence

        divergence._DEVICE_RULE_ON_CPU = True
    # one tiny replay first: lazy imports and first-call allocations are not the replay's peak
    replay_relevance(model, [[prompt[:4] + ids(2), prompt[:4] + ids(2)]], [ids(2)], 1.0, batch_size=replay.batch)
    before = _resident("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current resident size
    replay_relevance(model, contexts, completions, 1.0, batch_size=replay.batch, usable_bytes=replay.usable)
    print(_resident("VmHWM") - before)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="check the model against measured CPU peaks")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(HERE / "results" / "replay_memory.csv"))
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return
    import torch

    torch.set_num_threads(1)
    rows = []
    if args.measure:
        # the real hidden size and vocabulary, reduced depth: the parts that scale with V and H are the real ones
        checks = [
            ("smollm2-135m", Replay(8, 3, 120, 64, dtype_bytes=4), 4),
            ("smollm2-135m", Replay(16, 4, 200, 128, dtype_bytes=2), 4),
            ("qwen2.5-1.5b", Replay(8, 3, 200, 96, dtype_bytes=2), 2),
            ("qwen2.5-1.5b", Replay(4, 8, 300, 64, dtype_bytes=4), 2),
            # the replay at the recipes' shapes: 1,024-token completions at Qwen2.5-1.5B's width, and the 7B's
            # lm_head (V 152,064 x H 3,584), both bf16
            ("qwen2.5-1.5b", Replay(2, 1, 200, 1024, dtype_bytes=2), 1),
            ("qwen2.5-7b", Replay(4, 2, 100, 64, dtype_bytes=2), 1),
            # the CUDA device rule forced on CPU, fp32, 4 GiB usable (chunks of 1,766 rows at V = 151,936)
            ("qwen2.5-1.5b", Replay(4, 3, 200, 256, dtype_bytes=4, usable=4 * 2**30), 1),
        ]
        for name, replay, layers in checks:
            shape = SHAPES[name]
            reduced = Shape(shape.hidden, layers, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab)
            predicted = replay_peak_bytes(reduced, replay)["peak"]
            measured = measured_peak(shape, replay, layers)
            rows.append(
                {"kind": "measured", "model": f"{name} ({layers} layers)", **asdict(replay),
                 "predicted_gb": round(predicted / GB, 3), "measured_gb": round(measured / GB, 3),
                 "measured_over_predicted": round(measured / predicted, 2)}
            )  # fmt: skip
            print(rows[-1], flush=True)
    # the 24 GB recipes' shapes: the generation batch (per-device batch x accumulation steps), their replay batch,
    # completion length and dtype; prompt lengths and replayed rewards per response are typical of their kits
    # ... on CPU's chunk rule, and on a 24 GB GPU with 6 GiB usable when the replay starts
    for recipe, name, replay in RECIPE_REPLAYS:
        for rule in (replay, replace(replay, usable=6 * 2**30)):
            parts = replay_peak_bytes(SHAPES[name], rule)
            rows.append(
                {"kind": "computed", "model": f"{name} ({recipe})", **asdict(rule),
                 "predicted_gb": round(parts["peak"] / GB, 3),
                 **{f"{part}_gb": round(value / GB, 3) for part, value in parts.items() if part != "peak"}}
            )  # fmt: skip
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(output, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    write_provenance(output, " ".join(["python", "benchmarks/replay_memory.py", *(argv or sys.argv[1:])]))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
