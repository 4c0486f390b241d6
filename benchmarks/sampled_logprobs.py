"""Sampled-token log-probabilities from last hidden states: TRL's ``ChunkedLogProbFunction`` (what
:func:`trl_mrtpo.research.token_scores.sampled_logprobs` calls) against a token-chunked fp32 ``log_softmax``, both
against float64.

CPU, one thread, one call each after a warm-up, same inputs. Writes ``benchmarks/results/sampled_logprobs_cpu.csv``.

    python benchmarks/sampled_logprobs.py
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def chunked_log_softmax(hidden, token_ids, weight, bias, temperature, chunk_tokens=32):
    out = torch.empty(hidden.shape[0])
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        logprobs = (torch.nn.functional.linear(hidden[rows], weight, bias) / temperature).log_softmax(-1)
        out[rows] = logprobs.gather(-1, token_ids[rows, None])[:, 0]
    return out


def main() -> None:
    from trl_mrtpo.ops import sampled_logprobs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 152064])
    parser.add_argument("--output", default=str(RESULTS / "sampled_logprobs_cpu.csv"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for vocab in args.vocab:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen)
        weight = torch.randn(vocab, args.hidden, generator=gen) / args.hidden**0.5
        bias = torch.randn(vocab, generator=gen) * 0.1
        token_ids = torch.randint(0, vocab, (args.tokens,), generator=gen)
        logits = torch.nn.functional.linear(hidden.double(), weight.double(), bias.double()) / 0.7
        expected = logits.log_softmax(-1).gather(-1, token_ids[:, None])[:, 0]
        del logits
        for method, function in [
            ("trl_chunked_logprob", sampled_logprobs),
            ("chunked_log_softmax", chunked_log_softmax),
        ]:
            function(hidden[:8], token_ids[:8], weight, bias, 0.7)  # warm-up
            started = time.perf_counter()
            got = function(hidden, token_ids, weight, bias, 0.7)
            seconds = time.perf_counter() - started
            error = (got.double() - expected).abs().max().item()
            rows.append(
                {"vocab": vocab, "tokens": args.tokens, "method": method, "seconds": seconds, "max_error": error}
            )
            print(f"V={vocab:>6} {method:<20} {seconds:6.3f} s  max |error| vs float64 {error:.2e}", flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
