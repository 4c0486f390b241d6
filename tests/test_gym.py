"""The credit gym: its ground truth, rewards, supervised policy, statistics and CLI."""

import csv
import json
import math
import random
import statistics
from dataclasses import replace

import pytest
import torch

from trl_mrtpo.gym import (
    KINDS,
    Constraint,
    GymSpec,
    build_tokenizer,
    constraint_blocks,
    constraint_rewards,
    mass_ratio,
    parse_constraints,
    prompt_text,
    relevant_positions,
    sample_constraints,
    steps_to_threshold,
    supervised_response,
    wilcoxon_signed_rank,
)
from trl_mrtpo.gym.stats import paired
from trl_mrtpo.gym.task import chat_prompt_ids, supervised_policy
from trl_mrtpo.info_blocks import InfoBlock, build_contexts

W = "red cat tree rock cat sand lake dog".split()  # 8 words; 'cat' twice, 'red' first, 'dog' last


@pytest.mark.parametrize(
    "constraint, words, satisfied, positions",
    [
        (Constraint("first", "red"), W, True, [0]),
        (Constraint("first", "dog"), W, False, [0]),
        (Constraint("last", "dog"), W, True, [7]),
        (Constraint("last", "red"), W, False, [7]),
        # once: only where it stands; never: any word could become it; three times: no single change flips it
        (Constraint("has", "sand"), W, True, [5]),
        (Constraint("has", "fox"), W, False, list(range(8))),
        (Constraint("has", "cat"), "cat cat cat tree".split(), True, []),
        # exactly two: removing either flips it, and so does adding a third anywhere else
        (Constraint("twice", "cat"), W, True, list(range(8))),
        (Constraint("twice", "cat"), "cat tree tree tree".split(), False, [1, 2, 3]),
        # red (0) before dog (7): either end flips it
        (Constraint("pair", "red", "dog"), W, True, [0, 7]),
        # dog only last, red only first: no single change puts a dog before a red
        (Constraint("pair", "dog", "red"), W, False, []),
        (Constraint("pair", "dog", "red"), "tree dog rock sand".split(), False, [2, 3]),
        (Constraint("pair", "cat", "lake"), W, True, [6]),
    ],
)
def test_rewards_and_relevant_positions_by_hand(constraint, words, satisfied, positions):
    assert constraint.satisfied(words) is satisfied
    assert relevant_positions(constraint, words) == positions


def test_constraint_text_round_trip_and_errors():
    constraints = [Constraint("first", "red"), Constraint("pair", "cat", "dog"), Constraint("twice", "sun")]
    text = prompt_text(constraints)
    assert text == "first red ; cat before dog ; twice sun ;"
    assert parse_constraints(text + " note first red ;") == constraints
    with pytest.raises(ValueError, match="unknown constraint kind"):
        Constraint("often", "red")
    with pytest.raises(ValueError, match="two words"):
        Constraint("pair", "red")
    with pytest.raises(ValueError, match="1 to 12"):
        sample_constraints(random.Random(0), 13)


@pytest.mark.parametrize("k", [3, 6, 12])
def test_sampled_constraints_are_compatible(k):
    rng = random.Random(k)
    for _ in range(50):
        constraints = sample_constraints(rng, k)
        kinds = [c.kind for c in constraints]
        assert len(constraints) == k and kinds.count("first") <= 1 and kinds.count("last") <= 1
        words = [c.word for c in constraints] + [c.other for c in constraints if c.other]
        assert len(words) == len(set(words))  # every constraint on its own words


def test_reward_functions_score_completions_by_slot():
    rewards = constraint_rewards(2)
    row = [["first", "red", ""], ["has", "owl", ""]]
    completions = ["red cat owl <eos>", "cat red tree", [{"role": "assistant", "content": "owl red"}]]
    assert [r.__name__ for r in rewards] == ["constraint_0", "constraint_1"]
    assert rewards[0](completions, constraints=[row] * 3) == [1.0, 0.0, 0.0]
    assert rewards[1](completions, constraints=[row] * 3) == [1.0, 0.0, 1.0]


def test_info_blocks_are_the_span_or_a_note():
    row = {"constraints": [["first", "red", ""], ["pair", "cat", "dog"]]}
    prompt = [{"role": "user", "content": prompt_text(parse_constraints("first red ; cat before dog ;"))}]
    in_prompt = [b(row=row) for b in constraint_blocks(2, "in_prompt")]
    assert in_prompt[1] == InfoBlock("cat before dog ;", placement="in_prompt")
    p_all, (without_pair,) = build_contexts(prompt, in_prompt, [[1]], " ")
    assert parse_constraints(without_pair[0]["content"]) == [Constraint("first", "red")]
    appended = [b(row=row) for b in constraint_blocks(2, "appended")]
    p_all, (without_first,) = build_contexts(prompt, appended, [[0]], " ")
    assert p_all[0]["content"].endswith("; note first red ; note cat before dog ;")
    assert "note first red" not in without_first[0]["content"]


def test_tokenizer_is_word_level_with_a_chat_template():
    tokenizer = build_tokenizer()
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "first red ;"}])
    assert tokenizer.convert_ids_to_tokens(ids) == ["<user>", "first", "red", ";", "<assistant>"]
    assert tokenizer.decode(tokenizer("red cat dog").input_ids) == "red cat dog"


def test_supervised_responses_meet_constraints_at_their_rates():
    rng = random.Random(0)
    spec = GymSpec()
    met = {kind: [] for kind in KINDS}
    for _ in range(3000):
        constraints = sample_constraints(rng, 3)
        rates = [spec.sft_rates[KINDS.index(c.kind)] for c in constraints]
        words = supervised_response(rng, constraints, spec.length, rates)
        for c in constraints:
            met[c.kind].append(c.satisfied(words))
        # never met by chance: with rate 0, key words do not appear
        assert not any(c.satisfied(supervised_response(rng, [c], spec.length, [0.0])) for c in constraints)
    for kind, rate in zip(KINDS, spec.sft_rates):
        assert abs(sum(met[kind]) / len(met[kind]) - rate) < 0.05, kind


def _first_word_probability(model, tokenizer, constraints, kept):
    """Probability that the first response word is the ``first`` constraint's word, with or without it stated."""
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt_text(kept)}])
    target = tokenizer.convert_tokens_to_ids(next(c.word for c in constraints if c.kind == "first"))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].softmax(-1)[target].item()


def test_supervised_policy_conditions_on_its_constraints(tmp_path):
    spec = GymSpec(sft_teach_steps=400, sft_calibrate_steps=60)
    model, tokenizer = supervised_policy(spec, seed=0, cache_dir=tmp_path)
    rng = random.Random(1)
    stated, removed = [], []
    while len(stated) < 40:
        constraints = sample_constraints(rng, 3)
        if not any(c.kind == "first" for c in constraints):
            continue
        others = [c for c in constraints if c.kind != "first"]
        stated.append(_first_word_probability(model, tokenizer, constraints, constraints))
        removed.append(_first_word_probability(model, tokenizer, constraints, others))
    # stated: near its supervised rate; removed: a key word never opens a reply
    assert sum(stated) / len(stated) > 0.12
    assert sum(removed) / len(removed) < 0.03
    # cached: the second call loads the same weights
    again, _ = supervised_policy(spec, seed=0, cache_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_wilcoxon_exact_p_values():
    assert wilcoxon_signed_rank([1, 2, 3, 4, 5, 6, 7, 8]) == pytest.approx(2 / 256)
    assert wilcoxon_signed_rank([0, 0]) == 1.0
    # ranks 1..4, observed positive sum 1+2+4 = 7 (centre 5): 10 of the 16 subset sums are <= 3 or >= 7
    assert wilcoxon_signed_rank([0.1, 0.2, -0.3, 0.4]) == pytest.approx(10 / 16)
    # ties take the average rank and the test stays symmetric
    assert wilcoxon_signed_rank([1, -1, 1, -1]) == pytest.approx(1.0)


def test_threshold_mass_ratio_and_pairing():
    values = [0.0] * 5 + [1.0] * 10
    assert steps_to_threshold(values, 0.5, window=10) == 9  # mean of steps 0..9 = 0.5
    assert steps_to_threshold(values, 1.01, window=10) is None
    q = torch.tensor([0.6, 0.2, 0.2, 0.0])
    assert mass_ratio(q, [0]) == pytest.approx(0.6 / 0.25)
    assert math.isnan(mass_ratio(torch.zeros(4), [0]))
    rows = [
        {"method": "gdpo", "seed": 0, "final_reward": 0.5, "steps_to_threshold": 40},
        {"method": "gdpo", "seed": 1, "final_reward": 0.6, "steps_to_threshold": ""},
        {"method": "mrtpo", "seed": 0, "final_reward": 0.7, "steps_to_threshold": 20},
        {"method": "mrtpo", "seed": 1, "final_reward": 0.6, "steps_to_threshold": 30},
    ]
    final = paired(rows, "mrtpo", "gdpo", "final_reward")
    assert (final["wins"], final["ties"], final["losses"]) == (1, 1, 0)
    assert final["mean_difference"] == pytest.approx(0.1)
    speed = paired(rows, "mrtpo", "gdpo", "steps_to_threshold", missing=100.0)
    assert speed["mean_difference"] == pytest.approx((-20 - 70) / 2)


def test_same_seed_same_run(tmp_path):
    from trl_mrtpo.gym import RunSettings, train_run

    spec = GymSpec(sft_teach_steps=20, sft_calibrate_steps=5)
    settings = RunSettings(method="mrtpo", steps=3, prompts_per_step=2, num_generations=4, credit_warmup_steps=0)
    first = train_run(spec, settings, 3, tmp_path / "cache", tmp_path / "a")
    second = train_run(spec, settings, 3, tmp_path / "cache", tmp_path / "b")
    other = train_run(spec, settings, 4, tmp_path / "cache", tmp_path / "c")
    # JSON text: a kind absent from a batch is NaN, which never equals itself
    assert len(first) == 3 and json.dumps(first) == json.dumps(second)
    assert json.dumps(first) != json.dumps(other)


@pytest.mark.slow
def test_gym_quick_cli_writes_every_result(tmp_path):
    from trl_mrtpo.scripts.cli import main

    out = tmp_path / "results"
    main(["gym", "--quick", "--jobs", "1", "--work-dir", str(tmp_path / "work"), "--output-dir", str(out)])
    files = ("runs.csv", "summary.csv", "comparison.csv", "localisation.csv", "supervised_policy.csv", "curves.png")
    for name in (*files, "results.md"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "summary.csv") as handle:
        summary = list(csv.DictReader(handle))
    assert {"method", "seed", "steps_to_threshold", "final_reward"} <= set(summary[0])
    assert sorted((r["method"], r["seed"]) for r in summary) == sorted(
        (m, str(s)) for m in ("grpo", "gdpo", "mrtpo") for s in (0, 1)
    )
    with open(out / "comparison.csv") as handle:
        comparison = {r["method"]: r for r in csv.DictReader(handle)}
    assert set(comparison) == {"grpo", "mrtpo"} and 0 < float(comparison["mrtpo"]["final_p_value"]) <= 1
    # resumable: a second invocation recomputes nothing (the stored runs are reused as they are)
    stored = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "work" / "runs").iterdir()}
    main(["gym", "--quick", "--jobs", "1", "--work-dir", str(tmp_path / "work"), "--output-dir", str(out)])
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "work" / "runs").iterdir()} == stored


def test_spec_validation():
    with pytest.raises(ValueError, match="placement"):
        GymSpec(placement="inline")
    with pytest.raises(ValueError, match="at least 3 words"):
        GymSpec(length=2)
    assert GymSpec().key() != replace(GymSpec(), num_constraints=6).key()


def test_gpu_script_fails_fast_without_cuda(tmp_path):
    import os
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run the grid")
    result = subprocess.run(
        ["bash", "benchmarks/gpu_gym.sh", str(tmp_path)], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert result.returncode == 2 and "needs a CUDA device" in result.stderr
    assert not any(tmp_path.iterdir())


def test_default_task_and_run_keep_their_keys():
    """Variants and options are keyed only where set: the default task's cached policies and runs stay valid."""
    from trl_mrtpo.gym import RunSettings, variant_spec
    from trl_mrtpo.gym.grid import Run

    assert GymSpec().key() == "2f43cee80e" == variant_spec("default").key()
    assert Run(GymSpec(), RunSettings(), 0).key() == "3ea843d9b3529ec9"  # as before variants existed
    assert len({variant_spec(name).key() for name in ("default", "variable_length", "topical_filler", "weak")}) == 4
    with_option = RunSettings(options=(("preserve_reward_totals", True),))
    assert Run(GymSpec(), with_option, 0).key() != Run(GymSpec(), RunSettings(), 0).key()
    step_rules = [RunSettings(process="oracle"), RunSettings(process="shepherd"), RunSettings(failure_masking=True)]
    keys = {Run(GymSpec(), settings, 0).key() for settings in [RunSettings(), *step_rules]}
    assert len(keys) == 4


def test_variant_responses():
    from trl_mrtpo.gym import variant_spec
    from trl_mrtpo.gym.task import FILLER_WORDS, KEY_WORDS, filler_pool

    rng = random.Random(0)
    spec = variant_spec("realistic")
    lengths, topical, stray, met = [], [], [], []
    for _ in range(2000):
        constraints = sample_constraints(rng, 3)
        length = spec.response_length(rng)
        words = supervised_response(rng, constraints, length, [0.0] * 3, spec.topical_filler, spec.stray_rate)
        lengths.append(len(words))
        keys = {c.word for c in constraints} | {c.other for c in constraints}
        fillers = [w for w in words if w in FILLER_WORDS]
        topical += [w in filler_pool(constraints) for w in fillers]
        stray += [w in KEY_WORDS for w in words]
        met += [c.satisfied(words) for c in constraints if c.kind == "has"]
        assert all(w in FILLER_WORDS or w in KEY_WORDS for w in words) and keys
    assert set(lengths) == set(range(4, 11))  # every length from min_length to length
    # a filler word comes from the prompt's topics 80 % of the time, plus its share of the uniform draws
    pool_share = statistics.fmean(len(filler_pool(sample_constraints(rng, 3))) / 16 for _ in range(500))
    assert statistics.fmean(topical) == pytest.approx(0.8 + 0.2 * pool_share, abs=0.03)
    assert statistics.fmean(stray) == pytest.approx(0.5, abs=0.02)
    assert 0.05 < statistics.fmean(met) < 0.3  # met by stray words alone, with no constraint met on purpose
    with pytest.raises(ValueError, match="min_length"):
        GymSpec(min_length=2)
    with pytest.raises(ValueError, match="unknown gym variant"):
        variant_spec("hard")


def test_oracle_relevance_is_the_ground_truth():
    from trl_mrtpo.gym import oracle_relevance

    rows = [{"constraints": [["first", "red", ""], ["has", "fox", ""], ["last", "dog", ""]]}]
    relevance = oracle_relevance([" ".join(W)], rows, 10)
    assert relevance[0, 0].tolist() == [1.0] + [0.0] * 9  # first: the first word
    assert relevance[0, 1].tolist() == [1.0] * 8 + [0.0] * 2  # has fox, failing: any word could become fox
    assert relevance[0, 2].tolist() == [0.0] * 7 + [1.0, 0.0, 0.0]  # last: the last word, not the end token


def test_localisation_rows_split_passing_and_failing():
    from trl_mrtpo.gym.report import localisation_rows

    records = [
        {"kind": "first", "satisfied": s, "relevant_share": 0.1, "ratio": r, "control": 1.0, "specificity": 0.5}
        for s, r in ((1, 4.0), (0, 2.0), (0, 1.0))
    ]
    rows = {r["responses"]: r for r in localisation_rows(records)}
    assert rows["all"]["pairs"] == 3 and rows["satisfied"]["mass_ratio"] == 4.0
    assert rows["failing"]["pairs"] == 2 and rows["failing"]["mass_ratio"] == 1.5


def brute_force_feasible(constraint, prefix, length, vocabulary):
    """Whether some completion of ``prefix`` to at most ``length`` words (from ``vocabulary``) meets the constraint."""
    import itertools

    for total in range(len(prefix), length + 1):
        for suffix in itertools.product(vocabulary, repeat=total - len(prefix)):
            if constraint.satisfied([*prefix, *suffix]):
                return True
    return False


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_feasible_matches_brute_force(kind):
    from trl_mrtpo.gym.task import prefix_feasible

    constraint = Constraint(kind, "cat", "dog" if kind == "pair" else "")
    vocabulary = ["cat", "dog", "sand"]
    rng = random.Random(kind)
    for _ in range(120):
        prefix = [rng.choice(vocabulary) for _ in range(rng.randint(1, 5))]
        length = rng.randint(len(prefix), 6)
        # longest-only completions are what the gym's fixed-length responses allow; more room never hurts
        assert prefix_feasible(constraint, prefix, length) == brute_force_feasible(
            constraint, prefix, length, vocabulary
        ), (prefix, length)


def test_oracle_process_reward_scores_each_word_while_every_constraint_can_still_be_met():
    from trl_mrtpo.gym.task import oracle_process_reward

    prm = oracle_process_reward(length=8)
    row = [["first", "red", ""], ["has", "lake", ""], ["last", "dog", ""]]
    text = " ".join(W)
    (steps,) = prm(completions=[text], constraints=[row])
    assert [text[a:b] for a, b, _ in steps] == W
    assert [score for _, _, score in steps] == [1.0] * 8
    wrong_start = "cat " + " ".join(W[1:])
    (steps,) = prm(completions=[wrong_start], constraints=[row])
    assert [score for _, _, score in steps] == [0.0] * 8  # the first word already broke "first red"
    wrong_end = " ".join(W[:-1]) + " cat"
    (steps,) = prm(completions=[wrong_end], constraints=[row])
    assert [score for _, _, score in steps] == [1.0] * 7 + [0.0]


def test_failure_boundary_is_the_end_of_the_last_relevant_word():
    from trl_mrtpo.gym.task import constraint_failure_boundaries

    first, twice = constraint_failure_boundaries(2)
    row = {"constraints": [["first", "dog", ""], ["twice", "cat", ""]]}
    text = " ".join(W)
    assert first(completion=text, row=row, score=0.0) == len("red")  # only the first word can fix it
    assert first(completion=text, row=row, score=1.0) is None  # a passing response has no boundary
    three = "red cat tree cat cat sand lake dog"  # three cats: changing any of them fixes it, the last ends at 20
    assert twice(completion=three, row=row, score=0.0) == three.index("cat sand") + 3


def test_step_rule_arms_run_on_the_gym(tmp_path):
    from trl_mrtpo.gym import RunSettings, train_run

    spec = GymSpec(hidden_size=16, sft_teach_steps=20, sft_calibrate_steps=10)
    for settings in (
        RunSettings(method="gdpo", steps=2, process="oracle"),
        RunSettings(method="gdpo", steps=2, process="shepherd", shepherd_rollouts=2),
        RunSettings(method="mrtpo", steps=2, failure_masking=True),
        RunSettings(method="opsd", steps=2),
    ):
        records = train_run(spec, settings, 0, tmp_path / "policies", tmp_path / "out")
        assert len(records) == 2 and all(0.0 <= r["mean_reward"] <= 1.0 for r in records)


def test_the_oracle_arm_is_a_relevance_provider_that_never_replays_the_policy(tmp_path, monkeypatch):
    """``method="oracle"`` passes :func:`~trl_mrtpo.gym.runs.oracle_provider` as the trainer's relevance provider: the
    policy is never replayed, and the credit is computed from the ground-truth q on every varying pair."""
    import trl_mrtpo.gym.runs as runs
    import trl_mrtpo.relevance
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.gym import RunSettings, train_run

    def no_replay(*args, **kwargs):
        raise AssertionError("the oracle arm replayed the policy")

    monkeypatch.setattr(trl_mrtpo.relevance, "replay_relevance", no_replay)
    oracle_q, credits = [], []
    ground_truth = runs.oracle_relevance
    monkeypatch.setattr(runs, "oracle_relevance", lambda *args: oracle_q.append(ground_truth(*args)) or oracle_q[-1])
    generate = MRTPOTrainer._generate_and_score_completions

    def recording(self, inputs):
        output = generate(self, inputs)
        credits.append(self.last_credit)
        return output

    monkeypatch.setattr(MRTPOTrainer, "_generate_and_score_completions", recording)
    spec = GymSpec(hidden_size=16, sft_teach_steps=20, sft_calibrate_steps=10)
    settings = RunSettings(method="oracle", steps=2, credit_warmup_steps=0)
    records = train_run(spec, settings, 0, tmp_path / "policies", tmp_path / "out")
    assert len(records) == 2 and len(credits) == len(oracle_q) == 2
    for credit, q in zip(credits, oracle_q):
        groups = credit.rewards.view(-1, settings.num_generations, spec.num_constraints)
        varying = (groups.amax(1) > groups.amin(1)).repeat_interleave(settings.num_generations, dim=0)
        assert credit.replayed.any() and torch.equal(credit.replayed, varying)
        read = credit.replayed[..., None] & credit.mask[:, None, :].bool()  # q is kept where credit may land only
        torch.testing.assert_close(credit.relevance, q * read, rtol=0, atol=0)
