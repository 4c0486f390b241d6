"""Independent float64 references, written from docs/method.md without the code under test: plain loops and
textbook formulas. Used by the tests and by the benchmarks that report accuracy (``benchmarks/js_kernel.py``)."""

import math

import torch


def js_float64(logits_p, logits_q):
    """Textbook JS / ln 2 in float64 probability space."""
    p = torch.softmax(logits_p.double(), -1)
    q = torch.softmax(logits_q.double(), -1)
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (a.log() - b.log()), torch.zeros_like(a)).sum(-1)

    return (0.5 * kl(p, m) + 0.5 * kl(q, m)) / math.log(2)


def reference_parts(rewards, q, mask, c, beta, rho, G, eps=1e-4):
    """Plain loops in float64, written from docs/method.md without using credit.py: the group advantages ``[n, K]``,
    each reward's token weights ``w[j][k][t]``, the cap factor, the capped scores ``[j][t]`` and step 8's std.
    ``beta`` is one number, or one per reward (per-reward strength)."""
    n, k_count = rewards.shape
    betas = [float(b) for b in beta] if isinstance(beta, (list, tuple, torch.Tensor)) else [float(beta)] * k_count
    rewards, q, c = rewards.double(), q.double(), c.double()
    adv = torch.zeros(n, k_count, dtype=torch.float64)
    varying = torch.zeros(n, k_count, dtype=torch.bool)
    for g in range(n // G):
        for k in range(k_count):
            vals = [rewards[g * G + j, k].item() for j in range(G)]
            valid = [v for v in vals if not math.isnan(v)]
            if len(valid) < 2:
                continue
            mean = sum(valid) / len(valid)
            std = math.sqrt(sum((v - mean) ** 2 for v in valid) / (len(valid) - 1))
            for j in range(G):
                if not math.isnan(vals[j]):
                    adv[g * G + j, k] = (vals[j] - mean) / (std + eps)
                varying[g * G + j, k] = std > 0
    return (adv, *reference_weighted_parts(adv, varying, q, mask, c, betas, rho))


def reference_weighted_parts(adv, weighted, q, mask, c, betas, rho):
    """Steps 5-8 of :func:`reference_parts` from given ``[n, K]`` advantages, the pairs whose weights follow q
    (``weighted``) and one beta per reward: the weights, the cap factor, the capped scores and step 8's std."""
    n, k_count = adv.shape
    adv, q, c, varying = adv.double(), q.double(), c.double(), weighted
    lengths = [int(m.sum()) for m in mask]
    scores, uniforms, weights = [], [], []
    for j in range(n):
        length = lengths[j]
        u = sum(c[k] * adv[j, k] for k in range(k_count)).item()
        s_row = [0.0] * length
        w_rows = []
        for k in range(k_count):
            qs = q[j, k, :length].tolist()
            qbar = sum(qs) / length if length else 0.0
            w_row = []
            for t in range(length):
                w = 1.0
                if varying[j, k] and qbar >= 1e-8:
                    w = (1 - betas[k]) + betas[k] * qs[t] / qbar
                w_row.append(w)
                s_row[t] += c[k].item() * adv[j, k].item() * w
            w_rows.append(w_row)
        scores.append(s_row)
        uniforms.append(u)
        weights.append(w_rows)
    uni_moment = sum(lengths[j] * uniforms[j] ** 2 for j in range(n))
    red_moment = sum((s - uniforms[j]) ** 2 for j in range(n) for s in scores[j])
    # As in credit.py, a redistribution below float rounding of the uniform part (relative 1e-12) is none.
    s_cap = 1.0 if red_moment <= 1e-12 * uni_moment else min(1.0, math.sqrt((rho - 1) * uni_moment / red_moment))
    capped = [[uniforms[j] + s_cap * (s - uniforms[j]) for s in scores[j]] for j in range(n)]
    flat = [v for row in capped for v in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)) if len(flat) > 1 else 0.0
    return weights, s_cap, capped, std


def reference_advantages_from(adv, weighted, q, mask, c, beta, rho):
    """Steps 5-8 in float64 loops from given ``[n, K]`` advantages (a response weighting's, say): ``[n, T]``."""
    betas = [float(b) for b in beta] if isinstance(beta, (list, tuple, torch.Tensor)) else [float(beta)] * adv.shape[1]
    _, _, capped, std = reference_weighted_parts(adv, weighted, q, mask, c, betas, rho)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for j, row in enumerate(capped):
        for t, v in enumerate(row):
            out[j, t] = v / std if std > 0 else v
    return out


def reference_token_advantages(rewards, q, mask, c, beta, rho, G, eps=1e-4):
    """Steps 1-8 in float64 loops: the token advantages ``[n, T]`` and the cap factor."""
    _, _, s_cap, capped, std = reference_parts(rewards, q, mask, c, beta, rho, G, eps)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for j, row in enumerate(capped):
        for t, v in enumerate(row):
            out[j, t] = v / std if std > 0 else v
    return out, s_cap


def reference_process_advantages(step_lists, num_generations, num_positions, eps=1e-4):
    """GRPO's process supervision written out in float64 loops: step_lists[j] = [(score, end_token), ...]."""
    out = torch.zeros(len(step_lists), num_positions, dtype=torch.float64)
    for start in range(0, len(step_lists), num_generations):
        group = step_lists[start : start + num_generations]
        scores = [score for steps in group for score, _ in steps]
        if len(scores) < 2 or len(set(scores)) == 1:
            continue
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1))
        for j, steps in enumerate(group):
            for t in range(num_positions):
                out[start + j, t] = sum((s - mean) / (std + eps) for s, end in steps if end >= t)
    return out


def reference_step_credit_advantages(rewards, q, mask, c, beta, rho, G, process=None, suffix=None, eps=1e-4):
    """Steps 1-8 with process advantages (``[n, T]``, added after the cap, inside the std) and failure suffixes
    (``[n, K, T]`` bool: a reward's negative capped credit dropped where marked, after the std), float64 loops over
    each response's unmasked positions; the mask may have holes (tool results), which take part in nothing."""
    n, k_count, width = q.shape
    positions = [[t for t in range(width) if mask[j, t]] for j in range(n)]
    compact_q = torch.zeros(n, k_count, width, dtype=torch.float64)
    compact_mask = torch.zeros(n, width)
    for j, where in enumerate(positions):
        compact_q[j, :, : len(where)] = q[j][:, where].double()
        compact_mask[j, : len(where)] = 1
    adv, weights, s_cap, capped, _ = reference_parts(rewards, compact_q, compact_mask, c, beta, rho, G, eps)
    values = [
        [capped[j][i] + (float(process[j, t]) if process is not None else 0.0) for i, t in enumerate(where)]
        for j, where in enumerate(positions)
    ]
    flat = [v for row in values for v in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)) if len(flat) > 1 else 0.0
    out = torch.zeros(n, width, dtype=torch.float64)
    for j, where in enumerate(positions):
        for i, t in enumerate(where):
            value = values[j][i]
            for k in range(k_count):
                credit = float(c[k]) * adv[j, k].item()
                if suffix is not None and credit < 0 and suffix[j, k, t]:
                    value -= credit * (1 + s_cap * (weights[j][k][i] - 1))
            out[j, t] = value / std if std > 0 else value
    return out


def reference_specificity(q, replayed, groups=None):
    """Per reward, float64 loops: the mean over responses where it and another information group were replayed (and
    its q has mass) of ``1 - cos(q_k, mean of one replayed profile per other group)``, clamped to [0, 1]; NaN without
    any such response. ``groups[j][k]``: reward k's group on response j (None: each reward its own)."""
    n, k_count, _ = q.shape
    out = []
    for k in range(k_count):
        values = []
        for j in range(n):
            group = list(groups[j]) if groups is not None else list(range(k_count))
            others, seen = [], {group[k]}
            for i in range(k_count):
                if replayed[j, i] and group[i] not in seen:
                    seen.add(group[i])
                    others.append(i)
            if not replayed[j, k] or not others or q[j, k].double().sum() <= 0:
                continue
            own = q[j, k].double()
            control = sum(q[j, i].double() for i in others) / len(others)
            if control.norm() == 0:
                values.append(1.0)
                continue
            cosine = (own @ control).item() / (own.norm() * control.norm()).item()
            values.append(min(1.0, max(0.0, 1.0 - cosine)))
        out.append(sum(values) / len(values) if values else math.nan)
    return out


def reference_strength_betas(readings, betas, floor, num_rewards, momentum=0.9):
    """Each step's per-reward beta ``beta_n * g_k`` (docs/method.md, step 5): ``readings`` are each step's
    ``(q, replayed)`` (None: no reading that step), ``betas`` each step's beta_n. ``m_k`` is the running mean of the
    readings (the first taken as is), ``g_k = clip(m_k / floor - 1, 0, 1)``, 1 before any reading."""
    running, out = [math.nan] * num_rewards, []
    for reading, beta in zip(readings, betas):
        for k, value in enumerate(reference_specificity(*reading) if reading is not None else []):
            if not math.isnan(value):
                running[k] = value if math.isnan(running[k]) else momentum * running[k] + (1 - momentum) * value
        out.append([beta * (1.0 if math.isnan(m) else min(max(m / floor - 1, 0.0), 1.0)) for m in running])
    return out


def reference_saw(rewards):
    """SAW weights in float64 loops: K * CV_k / sum CV with CV = std (Bessel) / |mean| over non-NaN values."""
    cvs = []
    for k in range(rewards.shape[1]):
        values = [v for v in rewards[:, k].tolist() if not math.isnan(v)]
        mean = sum(values) / len(values) if values else 0.0
        if len(values) < 2 or abs(mean) < 1e-6:
            cvs.append(0.0)
            continue
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        cvs.append(std / abs(mean))
    total = sum(cvs)
    return torch.tensor([len(cvs) * cv / total if total else 1.0 for cv in cvs], dtype=torch.float64)


@torch.no_grad()
def full_logits_relevance(model, contexts, completion, temperature):
    """q by hand: one plain forward of the model per context (no cache, no packing), its full logits at
    ``temperature``, textbook JS in float64, in bits."""
    logprobs = []
    for ctx in contexts:
        logits = model(input_ids=torch.tensor([ctx + completion]), use_cache=False).logits
        logits = logits[0, len(ctx) - 1 : len(ctx) - 1 + len(completion)]
        logprobs.append(torch.log_softmax(logits.double() / temperature, -1))
    rows = []
    for other in logprobs[1:]:
        mixture = torch.logaddexp(logprobs[0], other) - math.log(2)
        kl = (logprobs[0].exp() * (logprobs[0] - mixture)).sum(-1) + (other.exp() * (other - mixture)).sum(-1)
        rows.append(0.5 * kl / math.log(2))
    return torch.stack(rows)
