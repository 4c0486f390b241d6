"""A roofline model of the replay divergence (modelled, not measured): bytes and GEMM FLOPs at real heads.

For a 64 x 1,024-token batch with K = 3 removed contexts in chunks of 2,048 fp32 vocabulary rows:

- the torch device rule (``ops.device_rule.device_divergence``): run on ``meta`` tensors; every aten operator's
  bytes are counted as the sizes of its tensor inputs read plus its outputs written, and each GEMM's FLOPs;
- the Triton kernel (``ops.triton_divergence``): its byte formula ``modelled_bytes`` (the GEMM's operands and fp32
  logits, the row kernel's two reads of them; tests hold the formula against the interpreter's loads);
- the floor: the GEMM's operands read once, the fp32 logits written once and read twice.

Roofline seconds = max(bytes / bandwidth, FLOPs / bf16 rate) on the stated datasheet figures. Writes
``benchmarks/replay_roofline.md``.

    python benchmarks/replay_roofline.py
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trl_mrtpo.constants import REPLAY_CHUNK_ROWS
from trl_mrtpo.ops.device_rule import chunk_tokens, device_divergence
from trl_mrtpo.ops.triton_divergence import modelled_bytes

HEADS = {"Qwen2.5-7B": (152_064, 3_584), "Qwen2.5-3B": (151_936, 2_048), "Llama-3.1-8B": (128_256, 4_096)}
# (memory in bytes, bandwidth in bytes/s, dense bf16 FLOP/s with fp32 accumulation): vendors' datasheets
DEVICES = {"H200": (141e9, 4.8e12, 989e12), "A100 80GB": (80e9, 2.0e12, 312e12), "A10 24GB": (24e9, 0.6e12, 125e12)}
TOKENS, REMOVED = 64 * 1024, 3


class CountingBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in ("view", "slice", "t", "transpose", "unsqueeze", "_unsafe_view", "detach"):  # no data moved
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            outputs = out if isinstance(out, (tuple, list)) else [out]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.bytes += sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
        if name in ("mm", "addmm"):
            first, second = [a for a in args if isinstance(a, torch.Tensor)][-2:]
            self.flops += 2 * first.shape[0] * first.shape[1] * second.shape[1]
        return out


def main() -> None:
    setting = f"{TOKENS:,} tokens, K = {REMOVED}, bf16 head, no bias, temperature 0.7."
    lines = [__doc__.split("\n\n")[0], "", setting, ""]
    columns = "torch rule TB | kernel TB | floor TB | GEMM TFLOP | torch rule s | kernel s | floor s"
    lines += [f"| head | device | {columns} |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for head, (vocab, hidden) in HEADS.items():
        for device, (_, bandwidth, rate) in DEVICES.items():
            counted = CountingBytes()
            stacked = torch.empty(TOKENS, REMOVED + 1, hidden, device="meta", dtype=torch.bfloat16)
            weight = torch.empty(vocab, hidden, device="meta", dtype=torch.bfloat16)
            with counted:
                device_divergence(stacked, weight, None, 0.7, chunk_rows=REPLAY_CHUNK_ROWS)
            chunk = chunk_tokens(REPLAY_CHUNK_ROWS, REMOVED + 1)
            kernel = modelled_bytes(TOKENS, REMOVED, vocab, hidden, chunk)
            flops = 2 * TOKENS * (REMOVED + 1) * hidden * vocab
            seconds = [max(b / bandwidth, flops / rate) for b in (counted.bytes, kernel["total"], kernel["floor"])]
            terabytes = [counted.bytes / 1e12, kernel["total"] / 1e12, kernel["floor"] / 1e12]
            cells = [*(f"{t:.2f}" for t in terabytes), f"{flops / 1e12:.0f}", *(f"{s:.2f}" for s in seconds)]
            lines.append(f"| {head} | {device} | " + " | ".join(cells) + " |")
            assert math.isclose(counted.flops, flops, rel_tol=1e-9)
    Path(__file__).with_name("replay_roofline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
