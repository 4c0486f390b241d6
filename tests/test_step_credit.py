"""Process rewards and failure-suffix masking: the maths against hand-worked groups and float64 references, the
character-span to token mapping under real tokenizers, and the trainer end to end."""

import math

import pytest
import torch

from tests.helpers import (
    graded_length,
    make_args,
    recording_trainer,
    token_advantages,
    token_advantages_preserving_totals,
)
from tests.reference import (
    reference_parts,
    reference_process_advantages,
    reference_step_credit_advantages,
    reference_token_advantages,
)
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.credit import group_advantages
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.steps.credit import failure_suffix_mask, process_advantages
from trl_mrtpo.steps.process_rewards import Step, checked_steps, step_spans, token_positions
from trl_mrtpo.utils import completion_text

EPS = 1e-4
NAN = float("nan")


def as_tensors(step_lists):
    width = max(1, max(len(steps) for steps in step_lists))
    scores = torch.full((len(step_lists), width), NAN, dtype=torch.float64)
    ends = torch.zeros((len(step_lists), width), dtype=torch.long)
    for j, steps in enumerate(step_lists):
        for s, (score, end) in enumerate(steps):
            scores[j, s], ends[j, s] = score, end
    return scores, ends


def test_process_advantages_hand_worked_group():
    # One group of two: response 0 has steps scored 1 (ending at token 1) and 0 (ending at token 3); response 1 one
    # step scored 1 ending at token 2. Step scores {1, 0, 1}: mean 2/3, std sqrt(1/3).
    scores, ends = as_tensors([[(1.0, 1), (0.0, 3)], [(1.0, 2)]])
    got = process_advantages(scores, ends, num_generations=2, num_positions=5)
    good = (1 / 3) / (math.sqrt(1 / 3) + EPS)
    bad = (-2 / 3) / (math.sqrt(1 / 3) + EPS)
    expected = torch.tensor(
        [[good + bad, good + bad, bad, bad, 0.0], [good, good, good, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_process_advantages_match_float64_loops_on_random_groups():
    gen = torch.Generator().manual_seed(0)
    step_lists = []
    for _ in range(12):
        count = int(torch.randint(0, 5, (1,), generator=gen))
        ends = sorted(torch.randint(0, 9, (count,), generator=gen).tolist())
        step_lists.append([(float(torch.rand(1, generator=gen)), end) for end in ends])
    step_lists[4:8] = [[(0.5, 2)], [(0.5, 3), (0.5, 6)], [], [(0.5, 1)]]  # a constant group
    scores, ends = as_tensors(step_lists)
    got = process_advantages(scores, ends, num_generations=4, num_positions=10)
    torch.testing.assert_close(got, reference_process_advantages(step_lists, 4, 10), rtol=0, atol=1e-12)
    assert (got[4:8] == 0).all()


def test_process_advantages_refuse_mismatched_shapes_and_groups():
    with pytest.raises(ValueError, match="must both be"):
        process_advantages(torch.zeros(4, 2), torch.zeros(4, 3, dtype=torch.long), 2, 5)
    with pytest.raises(ValueError, match="groups of num_generations=3"):
        process_advantages(torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.long), 3, 5)


def test_failure_suffix_mask_marks_positions_after_each_boundary():
    boundaries = torch.tensor([[1, -1], [4, 0]])
    mask = failure_suffix_mask(boundaries, 5)
    assert mask[0, 0].tolist() == [False, False, True, True, True]
    assert not mask[0, 1].any()  # no boundary: nothing masked
    assert not mask[1, 0].any()  # the error ends on the last token
    assert mask[1, 1].tolist() == [False, True, True, True, True]


def gdpo_case():
    """Two groups of two, two rewards, lengths 4, 3, 4, 2."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.5]])
    advantages, varying = group_advantages(rewards, 2)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    return rewards, advantages, varying, mask


def test_failure_suffix_drops_only_the_failing_rewards_negative_credit_and_keeps_the_std():
    rewards, advantages, varying, mask = gdpo_case()
    q = torch.zeros(4, 2, 4)
    plain = token_advantages(advantages, q, varying, mask, torch.ones(2), beta=0.0).advantages
    suffix = failure_suffix_mask(torch.tensor([[1, 1], [0, 2], [-1, -1], [0, 0]]), 4)
    masked = token_advantages(advantages, q, varying, mask, torch.ones(2), beta=0.0, failure_suffix=suffix).advantages
    scores = advantages.double().sum(-1)[:, None].expand(4, 4)
    values = scores[mask.bool()]
    std = values.std().item()  # step 8's std of the unmasked S, token-weighted (Bessel)
    expected = scores.clone()
    for j in range(4):
        for k in range(2):
            if advantages[j, k] < 0:  # a penalty: dropped on the positions after its boundary
                expected[j, suffix[j, k]] -= advantages[j, k].double()
    expected = expected * mask / std
    torch.testing.assert_close(masked.double(), expected, rtol=1e-6, atol=1e-7)
    # positive credit untouched: response 0's first reward (+) keeps its share on the masked positions
    assert advantages[0, 0] > 0 and advantages[0, 1] < 0
    assert masked[0, 2] == pytest.approx(advantages[0, 0].item() / std, rel=1e-6)
    # positions before every boundary unchanged
    torch.testing.assert_close(masked[:, :1], plain[:, :1])


def test_failure_suffix_with_replay_weights_and_cap_zeroes_a_lone_reward_after_its_boundary():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0], [1.0], [0.0]])
    advantages, varying = group_advantages(rewards, 3)
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[2, 5:] = 0
    q = torch.rand(6, 1, 7, generator=gen)
    suffix = failure_suffix_mask(torch.tensor([[2], [3], [1], [0], [6], [4]]), 7)
    plain = token_advantages(advantages, q, varying, mask, torch.ones(1), 0.8, max_second_moment_ratio=1.5)
    masked = token_advantages(
        advantages, q, varying, mask, torch.ones(1), 0.8, max_second_moment_ratio=1.5, failure_suffix=suffix
    )
    reference, _ = reference_token_advantages(rewards, q, mask, torch.ones(1), 0.8, 1.5, 3)
    torch.testing.assert_close(plain.advantages.double(), reference, rtol=1e-5, atol=1e-6)
    dropped = suffix[:, 0] & (advantages < 0)
    assert dropped.any()
    assert (masked.advantages[dropped] == 0).all()
    torch.testing.assert_close(masked.advantages[~dropped], plain.advantages[~dropped])


def test_failure_suffix_on_preserved_totals_keeps_everything_but_the_dropped_penalty():
    rewards, advantages, varying, mask = gdpo_case()
    q = torch.rand(4, 2, 4, generator=torch.Generator().manual_seed(2))
    suffix = failure_suffix_mask(torch.tensor([[0, 0], [0, 0], [0, 0], [0, 0]]), 4)
    preserving = token_advantages_preserving_totals
    plain = preserving(advantages, q, varying, mask, torch.ones(2), 0.5, 2.0).advantages
    masked = preserving(advantages, q, varying, mask, torch.ones(2), 0.5, 2.0, failure_suffix=suffix)
    # response 2 has no negative credit: identical; every response's first token is before every boundary
    torch.testing.assert_close(masked.advantages[2], plain[2])
    torch.testing.assert_close(masked.advantages[:, 0], plain[:, 0])
    assert not torch.allclose(masked.advantages[0], plain[0])


def test_failure_suffix_under_a_binding_cap_drops_the_capped_penalty():
    """Two rewards, replay weights and a cap that binds (s < 1): a dropped penalty is the reward's *capped* credit
    c_k A_k (1 + s (w - 1)) on the marked positions; the other reward and the std are those of the unmasked batch.
    Float64 loops (tests/reference.py), not credit.py."""
    gen = torch.Generator().manual_seed(3)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    mask = torch.ones(6, 6, dtype=torch.long)
    mask[1, 4:] = 0
    q = torch.rand(6, 2, 6, generator=gen) ** 4  # peaked profiles: a large redistribution, so the cap binds
    c, beta, rho = torch.tensor([1.0, 0.7]), 1.0, 1.2
    advantages, varying = group_advantages(rewards, 3)
    suffix = failure_suffix_mask(torch.tensor([[2, 1], [1, 0], [3, 2], [0, 4], [2, 2], [1, 3]]), 6)
    got = token_advantages(advantages, q, varying, mask, c, beta, rho, failure_suffix=suffix)
    _, _, s_cap, _, _ = reference_parts(rewards, q, mask, c, beta, rho, 3)
    assert s_cap < 0.9 and got.cap_factor == pytest.approx(s_cap, rel=1e-6)
    assert (suffix & (advantages * c < 0)[..., None] & mask.bool()[:, None]).any()  # a penalty is dropped
    expected = reference_step_credit_advantages(rewards, q, mask, c, beta, rho, 3, suffix=suffix)
    torch.testing.assert_close(got.advantages.double(), expected, rtol=1e-5, atol=1e-6)


def test_process_credit_with_preserved_totals_rescales_by_uniform_plus_process():
    """Preserved totals with replay weights (beta > 0) and process advantages: each reward capped on its own,
    the process part added after the caps, and step 8's std that of U plus the process part, not of S."""
    rewards, advantages, varying, mask = gdpo_case()
    q = torch.rand(4, 2, 4, generator=torch.Generator().manual_seed(4)) ** 3
    scores, ends = as_tensors([[(1.0, 1), (0.0, 3)], [(0.0, 2)], [(1.0, 3)], [(0.0, 0), (1.0, 1)]])
    process = 0.5 * process_advantages(scores, ends, 2, 4)
    beta, rho = 0.8, 1.3
    got = token_advantages_preserving_totals(
        advantages, q, varying, mask, torch.ones(2), beta, rho, process=process
    ).advantages
    # float64 loops: per-reward weights, per-reward cap factors, then the sums
    adv, weights, _, _, _ = reference_parts(rewards, q, mask, torch.ones(2), beta, rho, 2)
    lengths = [int(m.sum()) for m in mask]
    factors = []
    for k in range(2):
        uniform_moment = sum(lengths[j] * adv[j, k].item() ** 2 for j in range(4))
        spread = sum((adv[j, k].item() * (weights[j][k][t] - 1)) ** 2 for j in range(4) for t in range(lengths[j]))
        factors.append(
            1.0 if spread <= 1e-12 * uniform_moment else min(1.0, math.sqrt((rho - 1) * uniform_moment / spread))
        )
    assert min(factors) < 1.0  # the per-reward cap binds
    baseline, total = [], []
    for j in range(4):
        for t in range(lengths[j]):
            uniform = adv[j].sum().item() + process[j, t].item()
            baseline.append(uniform)
            total.append(uniform + sum(factors[k] * adv[j, k].item() * (weights[j][k][t] - 1) for k in range(2)))
    mean = sum(baseline) / len(baseline)
    std = math.sqrt(sum((v - mean) ** 2 for v in baseline) / (len(baseline) - 1))
    expected = torch.zeros(4, 4, dtype=torch.float64)
    cursor = 0
    for j in range(4):
        for t in range(lengths[j]):
            expected[j, t] = total[cursor] / std
            cursor += 1
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_process_advantages_join_at_step_six_and_enter_the_std():
    rewards, advantages, varying, mask = gdpo_case()
    scores, ends = as_tensors([[(1.0, 1), (0.0, 3)], [(0.0, 2)], [(1.0, 3)], [(0.0, 0), (1.0, 1)]])
    process = process_advantages(scores, ends, 2, 4)
    for combine in (token_advantages, token_advantages_preserving_totals):
        got = combine(
            advantages, torch.zeros(4, 2, 4), varying, mask, torch.ones(2), 0.0, process=0.5 * process
        ).advantages
        summed = (advantages.double().sum(-1)[:, None] + 0.5 * process) * mask
        expected = summed / summed[mask.bool()].std()
        torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-7)


# Character spans to tokens ------------------------------------------------------------------------------------------


def test_step_spans_split_at_the_separator_and_skip_blank_steps():
    text = "First, add.\n\nThen divide.\nAnswer: 4"
    spans = step_spans(text)
    assert [text[a:b] for a, b in spans] == ["First, add.", "Then divide.", "Answer: 4"]
    assert step_spans("one. two.", ". ") == [(0, 3), (5, 9)]


def test_checked_steps_name_the_function_and_sample():
    assert checked_steps([(0, 2, 1), Step(2, 3, 0.5)], "prm", 3, "abc") == [Step(0, 2, 1.0), Step(2, 3, 0.5)]
    assert checked_steps(None, "prm", 3, "abc") == []
    with pytest.raises(ValueError, match="process reward 'prm' on sample 3.*outside"):
        checked_steps([(0, 9, 1.0)], "prm", 3, "abc")
    with pytest.raises(ValueError, match="score nan"):
        checked_steps([(0, 2, NAN)], "prm", 3, "abc")
    with pytest.raises(TypeError, match="list of steps"):
        checked_steps(0.5, "prm", 3, "abc")
    with pytest.raises(TypeError, match=r"\(start, end, score\)"):
        checked_steps([(0, 2)], "prm", 3, "abc")


def brute_force_positions(tokenizer, ids, text, ends):
    """The token holding character e - 1: the first token count whose decoded prefix agrees with text on e chars."""
    out = []
    for end in ends:
        for count in range(1, len(ids) + 1):
            decoded = tokenizer.decode(ids[:count], skip_special_tokens=True)
            if decoded[:end] == text[:end] and len(decoded) >= end and "\ufffd" not in decoded[:end]:
                out.append(count - 1)
                break
    return out


def test_token_positions_across_multibyte_characters_under_a_byte_level_tokenizer(tiny_tokenizer):
    text = "Étape 1: café ☕ ok.\nÉtape 2: 日本 done."
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    # the multi-byte characters span several byte tokens: a prefix can end inside one
    partial = [n for n in range(1, len(ids)) if "\ufffd" in tiny_tokenizer.decode(ids[:n])]
    assert partial
    ends = list(range(1, len(text) + 1))
    got = token_positions(tiny_tokenizer, ids, text, ends)
    assert got == brute_force_positions(tiny_tokenizer, ids, text, ends)
    # the last byte token of "☕" holds it: its step ends there, not on the first byte
    cup = text.index("☕") + 1
    position = got[cup - 1]
    assert "☕" in tiny_tokenizer.decode(ids[: position + 1]) and "☕" not in tiny_tokenizer.decode(ids[:position])


def test_a_step_boundary_inside_a_token_ends_at_that_token(tiny_tokenizer):
    text = "The quick brown fox jumps"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [tiny_tokenizer.decode(ids[: n + 1]) for n in range(len(ids))]
    inside = next((n, len(pieces[n - 1]) + 1) for n in range(1, len(ids)) if len(pieces[n]) - len(pieces[n - 1]) >= 2)
    token, end = inside  # a step ending after the first character of a multi-character token
    assert token_positions(tiny_tokenizer, ids, text, [end]) == [token]
    assert token_positions(tiny_tokenizer, ids, text, [len(text)]) == [len(ids) - 1]


def reasoning_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with a Qwen3 chat template and TRL's response template for it: TRL's parser moves the
    reasoning out of the message content."""
    import copy

    from trl.chat_template_utils import add_response_schema, qwen3_chat_template

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = qwen3_chat_template
    return add_response_schema(tokenizer)


def test_step_ends_of_parsed_content_land_on_their_own_tokens(tiny_tokenizer):
    """The content TRL's parser leaves (reasoning stripped) is placed on the ids by where it sits in their decode."""
    from trl.chat_template_utils import parse_response

    tokenizer = reasoning_tokenizer(tiny_tokenizer)
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full = "<think>\nplan the sum\n</think>\n\nAnswer: 42\nDone"
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    content = parse_response(tokenizer, ids, prefix=prefix)["content"]
    assert content == "Answer: 42\nDone"  # what the reward sees is not the decode of the ids
    ends = [b for _, b in step_spans(content)]
    start = full.index(content)
    expected = brute_force_positions(tokenizer, ids, full, [start + end for end in ends])
    got = token_positions(tokenizer, ids, content, ends, "process reward 'steps' on sample 0")
    assert got == expected
    assert got[0] < len(ids) - 1 == got[1]  # "Answer: 42" ends on its own token, not on the last one


@pytest.mark.parametrize(
    "full, text",
    [
        ("Answer: 42\nDone", "Answer: 43\nDone"),  # rewritten: not in the decode at all
        ("42 is it.\n42", "42"),  # in the decode twice: which one the reward scored is unknowable
    ],
)
def test_a_text_that_cannot_be_placed_on_the_ids_is_refused(tiny_tokenizer, full, text):
    ids = tiny_tokenizer(full, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match=r"process reward 'steps' on sample 3.*cannot be placed on tokens"):
        token_positions(tiny_tokenizer, ids, text, [len(text)], "process reward 'steps' on sample 3")


def test_token_positions_with_invalid_utf8_in_the_ids(tiny_tokenizer):
    """A lone continuation-less lead byte decodes to U+FFFD in the text the reward sees; the offsets still map."""
    lead_byte = tiny_tokenizer.convert_tokens_to_ids("\u00e2")  # byte 0xE2, the start of a 3-byte character
    tail = tiny_tokenizer("ok done", add_special_tokens=False)["input_ids"]
    ids = [lead_byte, *tail]
    text = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "\ufffdok done"
    got = token_positions(tiny_tokenizer, ids, text, [1, 3, len(text)])
    assert got[0] == 0  # the replacement character is the lone byte's
    assert tiny_tokenizer.decode(ids[: got[1] + 1]).endswith("ok") and not tiny_tokenizer.decode(
        ids[: got[1]]
    ).endswith("ok")
    assert got[2] == len(ids) - 1


@pytest.mark.slow
def test_token_positions_under_the_real_smollm2_tokenizer():
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from trl_mrtpo.scripts.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    text = "Schritt 1: Grüße aus Köln 🙂.\nStep 2: 42 × 3 = 126 ✓\nAnswer: naïve"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    ends = [b for _, b in step_spans(text)] + list(range(1, len(text) + 1, 3))
    assert token_positions(tokenizer, ids, text, ends) == brute_force_positions(tokenizer, ids, text, ends)


# The trainer end to end ---------------------------------------------------------------------------------------------


def halves(prompts, completions, completion_ids, **_):
    """A process reward: two steps per completion (its halves), scored by how many 'e's each holds."""
    out = []
    for completion in completions:
        text = completion_text(completion)
        if len(text) < 2:
            out.append(None)
            continue
        middle = len(text) // 2
        out.append([(0, middle, text[:middle].count("e") / 3), (middle, len(text), float("o" in text[middle:]))])
    return out


def test_process_rewards_end_to_end_give_outcome_plus_process_credit(tiny_model, tiny_tokenizer, tmp_path):
    """The final advantages are the outcome's plus the process reward's, against a float64 reference; and its part of
    them is visible: trainer.last_credit records it as the loss sees it (after the rescale) with where its steps end,
    the heatmap shows it as a row of its own and the completions table's credit line names where it blames (none had
    a row for a process reward)."""
    from trl_mrtpo.observability.viz import credit_heatmap_html

    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=[graded_length],
        args=make_args(
            tmp_path, credit_assignment="gdpo", max_steps=1, process_reward_weights=[0.5], log_completions=True
        ),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
        process_rewards=[halves],
    )
    trainer.train()
    record = trainer.last_credit
    ids = [row[: int(m.sum())].tolist() for row, m in zip(record.completion_ids, record.mask)]
    step_lists = []
    for text, row_ids in zip(record.completions, ids):
        steps = checked_steps(halves(None, [text], None)[0], "halves", 0, text)
        ends = token_positions(tiny_tokenizer, row_ids, text, [s.end for s in steps])
        step_lists.append([(s.score, end) for s, end in zip(steps, ends)])
    process = reference_process_advantages(step_lists, 4, record.mask.shape[1])
    assert process.abs().max() > 0  # the process reward varies: the check below is not vacuous
    summed = (record.group_advantages.double().sum(-1)[:, None] + 0.5 * process) * record.mask
    std = summed[record.mask.bool()].std()
    torch.testing.assert_close(record.advantages.double(), summed / std, rtol=1e-5, atol=1e-6)
    (name,) = record.contributions
    assert name == "process reward 'halves'"
    torch.testing.assert_close(record.contributions[name].double(), 0.5 * process * record.mask / std)
    assert record.steps[name] == [[end for _, end in steps] for steps in step_lists]
    page = credit_heatmap_html(record, tiny_tokenizer, trainer.reward_func_names)
    assert f"process reward &#x27;halves&#x27;: {len(step_lists[0])} steps, added after the cap" in page
    assert any("process reward 'halves' blames" in line for line in trainer._logs["extra"]["mrtpo_credit"])
    assert "mrtpo/term/process/halves" in trainer.state.log_history[0]


def first_character(prompt, completion, row, score):
    """A failure boundary: the unrecovered error ends on the first character."""
    return 1


def original_lengths(completion_ids, eos_id):
    """TRL's completion mask rule, from the ids alone: up to and including the first EOS."""
    lengths = []
    for row in completion_ids.tolist():
        lengths.append(row.index(eos_id) + 1 if eos_id in row else len(row))
    return torch.tensor(lengths, dtype=torch.float64)


def test_failure_boundaries_end_to_end_keep_the_loss_denominator(tiny_model, tiny_tokenizer, tmp_path):
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=[graded_length],
        args=make_args(tmp_path, credit_assignment="gdpo", max_steps=1, loss_type="grpo", beta=0.0),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
        failure_boundaries=[first_character],
    )
    trainer.train()
    batch, record = trainer.batches[0], trainer.last_credit
    advantages, mask = batch["advantages"], batch["completion_mask"]
    negative = record.group_advantages[:, 0] < 0
    positive = record.group_advantages[:, 0] > 0
    assert negative.any() and positive.any()
    lengths = mask.sum(-1)
    for j in range(len(mask)):
        if negative[j] and lengths[j] > 1:  # one reward: after the first token, nothing is left of the penalty
            first = token_positions(tiny_tokenizer, batch["completion_ids"][j].tolist(), record.completions[j], [1])
            assert (advantages[j, first[0] + 1 :] == 0).all() and advantages[j, 0] < 0
        if positive[j]:  # positive credit stays uniform over the whole response
            values = advantages[j, mask[j].bool()]
            assert torch.allclose(values, values[0].expand_as(values))
    # TRL's loss divides each response by its full token count, as before the masking
    T = original_lengths(batch["completion_ids"], tiny_tokenizer.eos_token_id)
    torch.testing.assert_close(mask.sum(-1).double(), T)
    trainer.model.eval()
    loss = trainer._compute_loss(trainer.model, batch)
    expected = -((advantages.double() * mask).sum(-1) / T).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_step_rules_are_refused_in_grpo_mode_and_checked_by_count(tiny_model, tiny_tokenizer, tmp_path):
    common = dict(model=tiny_model, reward_funcs=[graded_length], train_dataset=make_basic_dataset(4))
    with pytest.raises(ValueError, match="process_rewards act on MRTPO's per-reward token credit"):
        MRTPOTrainer(
            **common,
            args=make_args(tmp_path, credit_assignment="grpo"),
            process_rewards=[halves],
            processing_class=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match="failure_boundaries has 2 entries but there are 1 reward functions"):
        MRTPOTrainer(
            **common,
            args=make_args(tmp_path),
            failure_boundaries=[first_character, None],
            processing_class=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match="process_reward_weights has 2 entries"):
        MRTPOTrainer(
            **common,
            args=make_args(tmp_path, process_reward_weights=[1.0, 2.0]),
            process_rewards=[halves],
            processing_class=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match=r"process_reward_weights\[0\] must be a finite number"):
        make_args(tmp_path, process_reward_weights=[float("nan")])


def too_far(prompts, completions, **_):
    return [[(0, 10_000, 1.0)] for _ in completions]


def wrong_count(prompts, completions, **_):
    return [None]


@pytest.mark.parametrize(
    "rules, message",
    [
        ({"process_rewards": [too_far]}, "process reward 'too_far' on sample 0"),
        ({"process_rewards": [wrong_count]}, "4 expected, got 1"),
        ({"failure_boundaries": [lambda **_: 10_000]}, "failure boundary builder of reward 'graded_length' on sample"),
        ({"failure_boundaries": [lambda **_: 1 / 0]}, "failure boundary builder .* raised ZeroDivisionError"),
    ],
)
def test_a_bad_process_reward_or_boundary_is_named(tiny_model, tiny_tokenizer, tmp_path, rules, message):
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=[graded_length],
        args=make_args(tmp_path, max_steps=1),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
        **rules,
    )
    with pytest.raises(ValueError, match=message):
        trainer.train()


def test_step_rules_on_truncated_completions_masked_by_trl(tiny_model, tiny_tokenizer, tmp_path):
    """With ``mask_truncated_completions`` TRL zeroes a truncated completion's mask: its process steps still count
    in its group's statistics and are placed on its own ids (not on an empty list, which cannot hold its text), and
    it gets no advantage."""
    seen_ids = []

    def recorded_halves(prompts, completions, completion_ids, **kwargs):
        seen_ids.extend(completion_ids)
        return halves(prompts, completions, completion_ids)

    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=[graded_length],
        args=make_args(tmp_path, credit_assignment="gdpo", max_steps=1, mask_truncated_completions=True),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
        process_rewards=[recorded_halves],
        failure_boundaries=[first_character],
    )
    trainer.train()
    batch = trainer.batches[0]
    truncated = batch["completion_mask"].sum(-1) == 0
    assert truncated.any()  # the tiny model rarely ends within 10 tokens
    for ids, row, cut in zip(seen_ids, batch["completion_ids"], truncated):
        assert ids == (row.tolist() if cut else row[: len(ids)].tolist()) and ids
    assert (batch["advantages"][truncated] == 0).all()


def test_step_spans_shifted_within_range_are_accepted():
    """What is checked is the scored text, not what a span points at: a span shifted by one character inside the
    completion is accepted and placed where it points, and docs/step-credit.md says so plainly (it read as if
    rewritten text were caught there too)."""
    from pathlib import Path

    text = "3 + 4 = 7\n7 * 2 = 14"
    exact, shifted = step_spans(text), [(1, 10), (11, 20)]
    assert exact == [(0, 9), (10, 20)]
    assert [step[:2] for step in checked_steps([(a, b, 1.0) for a, b in shifted], "eq", 0, text)] == shifted
    doc = " ".join((Path(__file__).parents[1] / "docs" / "step-credit.md").read_text().split())
    assert "a span shifted to other characters (an off-by-one in a reward's own parsing) passes without a word" in doc
