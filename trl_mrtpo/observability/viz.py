"""Token-credit heatmaps: where each reward's advantage lands, as one self-contained HTML page."""

from __future__ import annotations

import html
import math
import statistics
from collections.abc import Sequence

import torch

from ..diagnostics import CreditRecord
from ..outputs import GENERATOR_META
from .summaries import token_strings

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}.resp{border:1px solid #ddd;border-radius:6px;padding:12px;margin:16px 0}
.prompt{color:#555;font-size:13px;white-space:pre-wrap;margin-bottom:8px}
.row{margin:8px 0}.label{font-size:12px;color:#444;margin-bottom:2px}
.tokens{font-family:ui-monospace,monospace;font-size:13px;white-space:pre-wrap;line-height:1.9}
.tok{border-radius:2px;padding-bottom:2px}.legend{font-size:12px;color:#555}
.bar{display:inline-block;width:90px;height:10px;vertical-align:middle;margin:0 4px;border:1px solid #bbb}
.scale{font-size:11px;color:#666;margin-left:10px;white-space:nowrap}
"""
# Two encodings that cannot be confused: signed credit is the token's background (green +, red -), where a reward
# looks (its q profile) is a blue bar under the token. Both are scaled per row, each with its own colour bar.
_POSITIVE, _NEGATIVE, _Q = "0,150,60", "210,40,40", "40,70,220"
_Q_BAR_PX = 5
TREND_WINDOW = 5  # steps of the moving mean drawn as each reward's trend


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving mean of ``values`` over ``window`` entries (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _alpha(value: float, scale: float) -> float:
    return 0.0 if scale <= 0 or not math.isfinite(value) else min(1.0, abs(value) / scale)


def _token_style(credit: float, credit_scale: float, q: float | None, q_scale: float) -> str:
    rgb = _POSITIVE if credit >= 0 else _NEGATIVE
    style = f"background:rgba({rgb},{_alpha(credit, credit_scale):.3f})"
    if q is not None:
        style += f";box-shadow:inset 0 -{_Q_BAR_PX}px 0 rgba({_Q},{_alpha(q, q_scale):.3f})"
    return style


def _token_row(
    tokens: Sequence[str], credits: Sequence[float], hovers: Sequence[str], q: Sequence[float] | None = None
) -> tuple[str, float, float]:
    """A row of tokens (HTML, credit scale, q scale): background = signed credit scaled to the row's largest
    ``|credit|``; with ``q``, a bar under each token scaled to the row's largest q."""
    credit_scale = max((abs(c) for c in credits if math.isfinite(c)), default=0.0)
    q_scale = max(q, default=0.0) if q is not None else 0.0
    spans = [
        f'<span class="tok" style="{_token_style(c, credit_scale, None if q is None else q[t], q_scale)}" '
        f'title="{html.escape(h)}">{html.escape(token)}</span>'
        for t, (token, c, h) in enumerate(zip(tokens, credits, hovers))
    ]
    return f'<div class="tokens">{"".join(spans)}</div>', credit_scale, q_scale


def _colour_bars(credit_scale: float, q_scale: float | None) -> str:
    """The row's scales: signed credit from -s (red) to +s (green), and q from 0 to its maximum (blue)."""
    credit_bar = (
        f'credit <span class="bar" style="background:linear-gradient(to right,rgb({_NEGATIVE}),#fff,'
        f'rgb({_POSITIVE}))"></span>{-credit_scale:+.3g} … {credit_scale:+.3g}'
        if credit_scale > 0
        else "credit 0 on every token"
    )
    q_bar = ""
    if q_scale is not None:
        q_bar = (
            f' · q <span class="bar" style="background:linear-gradient(to right,#fff,rgb({_Q}))"></span>'
            f"0 … {q_scale:.3g}"
        )
    return f'<span class="scale">{credit_bar}{q_bar}</span>'


def _reward_betas_text(record: CreditRecord, reward_names: Sequence[str]) -> str:
    """Each reward's beta, when per-reward strength made them differ from beta_n."""
    betas = record.reward_betas.tolist()
    if all(abs(b - record.beta) < 1e-9 for b in betas):
        return ""
    listed = ", ".join(f"{html.escape(name)} {b:.3g}" for name, b in zip(reward_names, betas))
    return f" (per reward, after per-reward strength: {listed})"


def _contribution_rows(
    record: CreditRecord, j: int, tokens: Sequence[str], reward_names: Sequence[str], per_reward: torch.Tensor
) -> list[str]:
    """Response ``j``'s rows of what the terms added: each part of the final advantages as the loss sees it (a
    process reward's steps, each token hovered with its step), and per reward the negative credit its failure
    suffix dropped."""
    rows, length = [], len(tokens)
    for name, part in record.contributions.items():
        values = part[j, :length].tolist()
        ends = [end for end in (record.steps.get(name) or [[]] * (j + 1))[j] if end < length]
        step_of = [sum(end < t for end in ends) for t in range(length)]  # a step ends on its last token
        hovers = [f"step {step_of[t] + 1} of {len(ends)}: {v:+.4f}" for t, v in enumerate(values)]
        row, credit_scale, _ = _token_row(tokens, values, hovers)
        label = f"{html.escape(name)}: {len(ends)} steps, added after the cap{_colour_bars(credit_scale, None)}"
        rows.append(f'<div class="row"><div class="label">{label}</div>{row}</div>')
    suffix = record.failure_suffix
    for k, name in enumerate(reward_names if suffix is not None else ()):
        dropped = (per_reward[j, k, :length].clamp(max=0) * suffix[j, k, :length]).tolist()
        if any(dropped):
            row, credit_scale, _ = _token_row(tokens, dropped, [f"dropped {v:+.4f}" for v in dropped])
            label = f"{html.escape(name)}: penalty dropped by its failure suffix{_colour_bars(credit_scale, None)}"
            rows.append(f'<div class="row"><div class="label">{label}</div>{row}</div>')
    return rows


def credit_heatmap_html(
    record: CreditRecord,
    tokenizer,
    reward_names: Sequence[str],
    title: str = "MRTPO token credit",
    max_responses: int | None = None,
) -> str:
    """One page: per response, a row per reward, a row per term's contribution (each process reward's part, each
    reward's dropped penalty), then the summed token advantage row (what the loss receives, after the cap and batch
    rescale).

    In a reward's row each token's background is that reward's signed token advantage ``A_k * w_k,t`` (green
    positive, red negative) and, when the reward was replayed, a blue bar under the token is its q: where that
    reward looks, visible even when its advantage is 0. Every row is scaled to its own largest value, stated by the
    row's colour bars; hover a token for the exact q, w and ``A * w``, and a reward's label for its info block.
    """
    count = len(record.completions) if max_responses is None else min(max_responses, len(record.completions))
    per_reward = record.group_advantages[:, :, None] * record.weights  # [B, K, C]
    mask = record.mask.bool()
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'>{GENERATOR_META}<title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        f'<p class="legend">credit_beta in effect: {record.beta:.3g}{_reward_betas_text(record, reward_names)}. '
        "Background: signed token credit A·w (green "
        "positive, red negative). Blue bar under a token: that reward's q (where its information changes the "
        "policy's prediction), shown for replayed rewards even when their advantage is 0. Each row is scaled to its "
        "own largest value (colour bars on the right). Hover a token for q, w and A·w, a reward's name for its info "
        "block.</p>",
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
            row, credit_scale, q_scale = _token_row(tokens, values, hovers, q if replayed else None)
            bars = _colour_bars(credit_scale, q_scale if replayed else None)
            block = record.info_blocks[j][k] if record.info_blocks else None
            hover = "" if block is None else f' title="{html.escape(f"info block: {block}")}"'
            parts.append(f'<div class="row"><div class="label"{hover}>{label}{bars}</div>{row}</div>')
        parts.extend(_contribution_rows(record, j, tokens, reward_names, per_reward))
        final = record.advantages[j, :length].tolist()
        row, credit_scale, _ = _token_row(tokens, final, [f"A_t={v:+.4f}" for v in final])
        label = f"<b>summed token advantage (to the loss)</b>{_colour_bars(credit_scale, None)}"
        parts.append(f'<div class="row"><div class="label">{label}</div>{row}</div>')
        uniform = [uniform_advantage(record, j)] * length
        row, credit_scale, _ = _token_row(tokens, uniform, [f"sum A_k={v:+.4f}" for v in uniform])
        label = f"reference: uniform GDPO spread (every token gets the summed A_k){_colour_bars(credit_scale, None)}"
        parts.append(f'<div class="row"><div class="label">{label}</div>{row}</div></div>')
    parts.append("</body></html>")
    return "".join(parts)


def uniform_advantage(record: CreditRecord, response: int) -> float:
    """What GDPO gives every token of a response: its rewards' group advantages summed (None rewards count 0)."""
    return record.group_advantages[response].nan_to_num().sum().item()


def _reward_axes(axis, logs: list[dict], reward_names: Sequence[str], style: str = "-", label: str = "") -> None:
    """Each reward's per-step mean (faint points) and its smoothed trend (a line) on ``axis``."""
    for index, name in enumerate(reward_names):
        key = f"rewards/{name}/mean"
        points = [(h["step"], h[key]) for h in logs if isinstance(h.get(key), (int, float))]
        if not points:
            continue
        steps, values = zip(*points)
        colour = f"C{index}"
        axis.plot(steps, values, "o", markersize=3, alpha=0.35, color=colour)
        axis.plot(steps, moving_mean(values, TREND_WINDOW), style, color=colour, label=f"{name}{label}")


def _pyplot():
    """matplotlib's pyplot on the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_credit_curves(
    log_history: list[dict], reward_names: Sequence[str], path: str, warmup_steps: int | None = None
) -> str | None:
    """Two panels per run: each reward's mean per step with its smoothed trend, and the share of tokens holding 80 %
    of its q mass; a dotted line marks the end of the credit warm-up (``warmup_steps``).

    Returns the path written, or None when there is nothing to plot.
    """
    plt = _pyplot()
    logs = [h for h in log_history if "mrtpo/beta" in h]
    if not logs:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    _reward_axes(top, logs, reward_names)
    for index, name in enumerate(reward_names):
        key = f"mrtpo/q_mass80_token_share/{name}"
        points = [(h["step"], h[key]) for h in logs if isinstance(h.get(key), (int, float))]
        if points:
            bottom.plot(*zip(*points), marker="o", markersize=3, color=f"C{index}", label=name)
    if warmup_steps:
        for axis in (top, bottom):
            axis.axvline(warmup_steps, linestyle=":", color="gray")
        top.annotate("credit warm-up ends", (warmup_steps, 1.0), fontsize=7, color="gray", va="top")
    top.set_ylabel("reward mean\n(points: per step; line: trend)")
    bottom.set_ylabel("token share holding\n80 % of q mass")
    bottom.set_xlabel("step")
    top.legend(fontsize=7, loc="best")
    top.set_title("MRTPO: rewards and credit concentration")
    _save(plt, fig, path)
    return path


def plot_comparison(histories: dict[str, list[dict]], reward_names: Sequence[str], path: str) -> str:
    """One panel per method (same scale), each reward's per-step mean and smoothed trend: the demo's side-by-side
    plot of runs on the same task and seed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(histories), figsize=(6 * len(histories), 4), sharey=True, squeeze=False)
    for axis, (method, history) in zip(axes[0], histories.items()):
        _reward_axes(axis, [h for h in history if "mrtpo/beta" in h], reward_names)
        axis.set_title(method)
        axis.set_xlabel("step")
    axes[0][0].set_ylabel("reward mean")
    axes[0][0].legend(fontsize=7, loc="best")
    _save(plt, fig, path)
    return path


def credit_heatmap_png(
    record: CreditRecord, tokenizer, reward_names: Sequence[str], path: str, max_responses: int = 3
) -> str:
    """The heatmap as an image for terminals without a browser: per response, one row per reward (its token credit
    ``A_k * w_k,t``), the uniform GDPO spread and the summed advantage, tokens along the x axis; colour is signed
    credit on one scale per response (green +, red -)."""
    plt = _pyplot()
    count = min(max_responses, len(record.completions))
    per_reward = record.group_advantages[:, :, None] * record.weights
    lengths = record.mask.sum(-1).long().tolist()
    width = max(4.0, min(24.0, 0.28 * max(lengths[:count] or [1])))
    fig, axes = plt.subplots(count, 1, figsize=(width, 1.1 + 0.45 * (len(reward_names) + 2) * count), squeeze=False)
    for j, axis in enumerate(axes[:, 0]):
        length = lengths[j]
        rows = [per_reward[j, k, :length].tolist() for k in range(len(reward_names))]
        rows += [[uniform_advantage(record, j)] * length, record.advantages[j, :length].tolist()]
        scale = max((abs(v) for row in rows for v in row), default=0.0) or 1.0
        axis.imshow(rows, cmap="RdYlGn", vmin=-scale, vmax=scale, aspect="auto", interpolation="nearest")
        axis.set_yticks(range(len(rows)), [*reward_names, "uniform (GDPO)", "summed (to the loss)"], fontsize=7)
        tokens = [t.replace("\n", "\\n") for t in token_strings(tokenizer, record.completion_ids[j, :length].tolist())]
        axis.set_xticks(range(length), tokens, rotation=90, fontsize=6)
        axis.set_title(f"response {j}: credit per token (scale +/-{scale:.2g})", fontsize=8)
    _save(plt, fig, path)
    return path
