"""Token-credit heatmaps: where each reward's advantage lands, as one self-contained HTML page."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from .diagnostics import CreditRecord

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}.resp{border:1px solid #ddd;border-radius:6px;padding:12px;margin:16px 0}
.prompt{color:#555;font-size:13px;white-space:pre-wrap;margin-bottom:8px}
.row{margin:6px 0}.label{font-size:12px;color:#444;margin-bottom:2px}
.tokens{font-family:ui-monospace,monospace;font-size:13px;white-space:pre-wrap;line-height:1.7}
.tok{border-radius:2px}.legend{font-size:12px;color:#555}
"""


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """One display string per token (each id decoded alone)."""
    return [tokenizer.decode([int(i)]) for i in ids]


def credit_summary(
    tokens: Sequence[str], advantages: Sequence[float], relevance: Sequence[Sequence[float]], names: Sequence[str]
) -> str:
    """One line per response for the completions table: the tokens with the largest token advantages, and where
    each replayed reward's q peaks (``relevance`` holds one profile per name; empty profiles are skipped)."""
    order = sorted(range(len(tokens)), key=lambda t: -abs(advantages[t]))[:3]
    parts = ["top |A_t|: " + ", ".join(f"{tokens[t]!r} {advantages[t]:+.2f}" for t in order)]
    for name, q in zip(names, relevance):
        if len(q) and max(q) > 0:
            peak = max(range(len(q)), key=lambda t: q[t])
            parts.append(f"{name} q peaks at {tokens[peak]!r} ({q[peak]:.3f})")
    return " | ".join(parts)


def _colour(value: float, scale: float) -> str:
    alpha = 0.0 if scale <= 0 or not math.isfinite(value) else min(1.0, abs(value) / scale)
    rgb = "0,150,60" if value >= 0 else "210,40,40"
    return f"rgba({rgb},{alpha:.3f})"


def _token_row(tokens: Sequence[str], values: Sequence[float], hovers: Sequence[str], scale: float) -> str:
    spans = [
        f'<span class="tok" style="background:{_colour(v, scale)}" title="{html.escape(h)}">{html.escape(t)}</span>'
        for t, v, h in zip(tokens, values, hovers)
    ]
    return f'<div class="tokens">{"".join(spans)}</div>'


def credit_heatmap_html(
    record: CreditRecord,
    tokenizer,
    reward_names: Sequence[str],
    title: str = "MRTPO token credit",
    max_responses: int | None = None,
) -> str:
    """One page: per response, a row per reward with every token coloured by that reward's token advantage
    ``A_k * w_k,t`` (green positive, red negative; hover shows q, w and A), then the summed token advantage row
    (what the loss receives, after the cap and batch rescale)."""
    count = len(record.completions) if max_responses is None else min(max_responses, len(record.completions))
    per_reward = record.group_advantages[:, :, None] * record.weights  # [B, K, C]
    mask = record.mask.bool()
    reward_scale = (
        per_reward[:count][mask[:count, None, :].expand_as(per_reward[:count])].abs().max().item() if count else 0
    )
    final_scale = record.advantages[:count][mask[:count]].abs().max().item() if count else 0
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        f'<p class="legend">credit_beta in effect: {record.beta:.3g}. Green: positive advantage, red: negative; '
        "colour strength is relative to the largest value on the page. Hover a token for q, w and A.</p>",
    ]
    for j in range(count):
        length = int(mask[j].sum())
        tokens = token_strings(tokenizer, record.completion_ids[j, :length].tolist())
        prompt = record.prompts[j] if isinstance(record.prompts[j], str) else record.prompts[j][-1].get("content", "")
        parts.append(
            f'<div class="resp"><div class="prompt"><b>Response {j}</b> — {html.escape(str(prompt)[:400])}</div>'
        )
        for k, name in enumerate(reward_names):
            reward = record.rewards[j, k].item()
            advantage = record.group_advantages[j, k].item()
            replayed = bool(record.replayed[j, k])
            label = (
                f"{html.escape(name)}: reward {'None' if math.isnan(reward) else f'{reward:.3g}'}, "
                f"A = {advantage:+.3f}, {'replayed' if replayed else 'uniform (not replayed)'}"
            )
            q = record.relevance[j, k, :length].tolist()
            w = record.weights[j, k, :length].tolist()
            values = per_reward[j, k, :length].tolist()
            hovers = [f"q={qi:.4f} w={wi:.3f} A*w={vi:+.4f}" for qi, wi, vi in zip(q, w, values)]
            parts.append(f'<div class="row"><div class="label">{label}</div>')
            parts.append(_token_row(tokens, values, hovers, reward_scale) + "</div>")
        final = record.advantages[j, :length].tolist()
        parts.append('<div class="row"><div class="label"><b>summed token advantage (to the loss)</b></div>')
        parts.append(_token_row(tokens, final, [f"A_t={v:+.4f}" for v in final], final_scale) + "</div></div>")
    parts.append("</body></html>")
    return "".join(parts)


def plot_credit_curves(log_history: list[dict], reward_names: Sequence[str], path: str) -> str | None:
    """Two panels per run: each reward's mean per step, and the share of tokens holding 80 % of its q mass.

    Returns the path written, or None when there is nothing to plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = [h for h in log_history if "mrtpo/beta" in h]
    if not logs:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name in reward_names:
        for axis, key in ((top, f"rewards/{name}/mean"), (bottom, f"mrtpo/q_mass80_token_share/{name}")):
            points = [(h["step"], h[key]) for h in logs if isinstance(h.get(key), (int, float))]
            if points:
                axis.plot(*zip(*points), marker="o", markersize=3, label=name)
    top.set_ylabel("reward mean")
    bottom.set_ylabel("token share holding\n80 % of q mass")
    bottom.set_xlabel("step")
    top.legend(fontsize=7, loc="best")
    top.set_title("MRTPO: rewards and credit concentration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_curves(log_history: list[dict], reward_names: Sequence[str]) -> str:
    """Per-step reward means and MRTPO metrics of a run as a plain-text table."""
    columns = [f"rewards/{name}/mean" for name in reward_names] + [
        "mrtpo/beta",
        "mrtpo/replayed_fraction",
        "mrtpo/cap_factor",
        "mrtpo/replay_share",
    ]
    headers = ["step"] + [c.split("/")[1] for c in columns]
    lines = ["  ".join(f"{h:>16}" for h in headers)]
    for h in (h for h in log_history if "mrtpo/beta" in h):
        cells = [f"{h.get('step', 0):>16}"]
        for c in columns:
            value = h.get(c)
            cells.append(f"{value:>16.3f}" if isinstance(value, (int, float)) else f"{'n/a':>16}")
        lines.append("  ".join(cells))
    return "\n".join(lines)
