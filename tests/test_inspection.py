"""Heatmap page and localisation report: exact numbers on a hand-made record, and the inspect command end to end."""

import math
import re

import pytest
import torch

from tests.helpers import CharTokenizer, record_for
from trl_mrtpo.kits import KIT_NAMES, get_kit
from trl_mrtpo.observability.viz import credit_heatmap_html
from trl_mrtpo.scripts.inspection import (
    CONTROL_NAME,
    format_verdicts,
    inspect_credit,
    localisation_report,
    reward_verdicts,
    token_mask,
)


def test_localisation_numbers_by_hand():
    # "hi OK": the end phrase "OK" is tokens 3-4 of 5 (Tok = 0.4). The reward puts 0.6 of its q mass there
    # (Dist = 0.6, Ratio = 1.5); the control puts 0.2 there (control ratio 0.5).
    text = "hi OK"
    q_reward = [0.1, 0.1, 0.2, 0.3, 0.3]
    q_control = [0.4, 0.2, 0.2, 0.1, 0.1]
    record = record_for(text, q_reward, q_control)
    rows = [{"end_phrase": "OK", "keyword": "zzz"}]
    names = ["end_phrase_reward", "keyword_reward", CONTROL_NAME]
    (row,) = localisation_report(record, CharTokenizer(), rows, get_kit("basic"), names, num_generations=1)
    assert (row.reward, row.span, row.responses) == ("end_phrase_reward", "end phrase", 1)
    assert abs(row.dist - 0.6) < 1e-6 and abs(row.tok - 0.4) < 1e-6 and abs(row.ratio - 1.5) < 1e-6
    assert abs(row.control_dist - 0.2) < 1e-6 and abs(row.control_ratio - 0.5) < 1e-6


def test_spans_and_token_mask():
    text = "Sure:\n```sql\nSELECT 1\n```"
    spans = get_kit("sql").spans({}, text)
    assert spans["sql_format_reward"][0] == "code fences" and len(spans["sql_format_reward"][1]) == 2
    kind, ((start, end),) = spans["sql_execution_reward"]
    assert kind == "query body" and text[start:end] == "SELECT 1\n"
    tools = get_kit("tools").spans({}, '<think>x</think><tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>')
    assert len(tools["tool_format_reward"][1]) == 4 and tools["tool_correctness_reward"][1]
    assert token_mask(["ab", "cd", "ef"], [(3, 5)]).tolist() == [False, True, True]


def test_heatmap_page_lists_every_reward_and_escapes_text():
    record = record_for("<b>&", [0.2, 0.3, 0.5, 0.0], [0.1] * 4)
    page = credit_heatmap_html(record, CharTokenizer(), ["end_phrase_reward", "keyword_reward", CONTROL_NAME])
    assert page.startswith("<!doctype html>") and page.endswith("</html>")
    assert "end_phrase_reward" in page and "uniform (not replayed)" in page and "summed token advantage" in page
    assert "&lt;" in page and "<b>&" not in page
    assert 'title="q=0.5000 w=1.500 A*w=+1.5000"' in page  # w = 0.5 + 0.5 * 0.5 / 0.25


def test_inspect_command_end_to_end(tmp_path, tiny_tokenizer):
    from tests.conftest import build_tiny_model

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    record, _ = inspect_credit(
        model=str(model_dir),
        num_prompts=2,
        num_generations=2,
        max_new_tokens=8,
        output=str(tmp_path / "credit.html"),
        report=str(tmp_path / "loc.csv"),
    )
    page = (tmp_path / "credit.html").read_text()
    assert page.count('class="resp"') == 4 and CONTROL_NAME in page
    assert record.replayed[:, -1].all()  # the control is replayed for every response
    assert (tmp_path / "loc.csv").read_text().startswith("reward,span,responses")


def test_credit_summary_line():
    from trl_mrtpo.observability.summaries import credit_summary

    line = credit_summary(["a", "b", "c"], [0.1, -0.9, 0.5], [[0.0, 0.2, 0.7], []], ["end", "kw"])
    assert line == "top |A_t|: 'b' -0.90, 'c' +0.50, 'a' +0.10 | end q peaks at 'c' (0.700)"


def test_inspect_replays_existing_completions(tmp_path, tiny_tokenizer, monkeypatch):
    import json

    from tests.conftest import build_tiny_model
    from trl_mrtpo.kits.basic import make_basic_dataset

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    texts = ["the sea is blue. hope this helps.", "The Sea Is Blue", "quiet rain falls. that is all.", "Rain."]
    lines = [{**row, "completion": texts[2 * i + g]} for i, row in enumerate(make_basic_dataset(2)) for g in range(2)]
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    record, _ = inspect_credit(model=str(model_dir), completions=str(path), output=str(tmp_path / "c.html"))
    assert record.completions == texts  # replayed as given, not sampled
    assert record.rewards[1, 2].item() == 0.0 and record.rewards[0, 2].item() == 1.0  # lowercase reward


def test_load_completions_rejects_uneven_groups(tmp_path):
    import json

    import pytest

    from trl_mrtpo.scripts.inspection import load_completions

    path = tmp_path / "r.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"prompt": "a", "completion": "x"},
                {"prompt": "a", "completion": "y"},
                {"prompt": "b", "completion": "z"},
            ]
        )
    )
    with pytest.raises(ValueError, match="same number of completions"):
        load_completions(str(path))


def test_if_slots_are_pooled_by_span_kind():
    import json

    record = record_for("hi OK", [0.1, 0.1, 0.2, 0.3, 0.3], [0.4, 0.2, 0.2, 0.1, 0.1])
    rows = [{"constraints": json.dumps([{"id": "startend:end_checker", "kwargs": {"end_phrase": "OK"}}])}]
    names = ["if_constraint_1", "if_constraint_2", CONTROL_NAME]
    (row,) = localisation_report(record, CharTokenizer(), rows, get_kit("if"), names, num_generations=1)
    assert (row.reward, row.span) == ("if_constraint_*", "end phrase") and abs(row.ratio - 1.5) < 1e-6


def says_red(completions, **_):
    """A user's reward for the recipe test (resolved by dotted path)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float("red" in t) for t in texts]


def red_block(**_):
    return "The answer must contain the word red."


def test_verdicts_by_hand():
    """Four responses in two groups of two. 'located' varies and its q is 10x the control's, peaking on 'c';
    'noise' varies with q equal to the control's; 'flat' never varies within a group."""
    import math

    import torch

    from trl_mrtpo.diagnostics import CreditRecord
    from trl_mrtpo.scripts.inspection import reward_verdicts

    names = ["located", "noise", "flat", CONTROL_NAME]
    control = torch.full((4, 4), 0.01)
    located = torch.tensor([0.01, 0.02, 0.3, 0.07]).repeat(4, 1)
    relevance = torch.stack([located, control, control, control], dim=1)
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    record = CreditRecord(
        prompts=["p"] * 4,
        completions=["abcd"] * 4,
        completion_ids=torch.tensor([[ord(c) for c in "abcd"]] * 4),
        mask=torch.ones(4, 4, dtype=torch.long),
        rewards=rewards,
        group_advantages=torch.zeros(4, 4),
        relevance=relevance,
        replayed=torch.ones(4, 4, dtype=torch.bool),
        weights=torch.ones(4, 4, 4),
        advantages=torch.zeros(4, 4),
        beta=0.5,
        reward_betas=torch.full((4,), 0.5),
    )
    verdicts = {v.reward: v for v in reward_verdicts(record, CharTokenizer(), names, num_generations=2)}
    assert list(verdicts) == ["located", "noise", "flat"]
    assert math.isclose(verdicts["located"].q_over_control, 10.0, rel_tol=1e-5) and verdicts["located"].varying == 1
    assert verdicts["located"].verdict.startswith("token credit will move") and verdicts["located"].tokens[0] == "c"
    # q under twice the control's: the credit still moves to where q peaks, and the verdict says so, naming them
    assert math.isclose(verdicts["noise"].q_over_control, 1.0)
    noise = verdicts["noise"]
    assert noise.verdict.startswith("q is under twice the control's") and all(
        repr(t) in noise.verdict for t in noise.tokens
    )
    # one line per reward: the move that tells the causes apart (hand-written passing and failing responses); the
    # causes themselves once, under the table
    assert "replay a few responses that pass and a few that fail with --completions" in noise.verdict
    table = format_verdicts(list(verdicts.values()))
    assert table.count("the model does not read the block at this size, or the block lacks what decides") == 1
    assert verdicts["flat"].varying == 0.5 and verdicts["flat"].verdict.startswith("q is under twice the control's")
    # every profile's argmax is its first token where it ties (the flat control): located peaks on 'c', apart always
    assert verdicts["located"].peaks_apart == 1.0 and verdicts["noise"].peaks_apart == 0.0
    # per-reward strength at this reading, by hand: located's 1 - cos against the mean of the other two (flat)
    # profiles is 1 - 0.2 / (0.3088 * 1) = 0.3524, so g = 0.3524 / 0.25 - 1
    located_profile = torch.tensor([0.01, 0.02, 0.3, 0.07], dtype=torch.float64)
    cosine = located_profile.sum() * 0.5 / located_profile.norm()
    assert math.isclose(verdicts["located"].strength, (1 - cosine.item()) / 0.25 - 1, rel_tol=1e-5)
    # a reward replayed for no response (no info block): its credit is uniform, and the verdict says so, not "q is
    # under twice the control's" with no token to name
    record.replayed[:, 1] = False
    unreplayed = reward_verdicts(record, CharTokenizer(), names, num_generations=2)[1]
    assert unreplayed.verdict.startswith("replayed for no response here") and unreplayed.tokens == []
    record.replayed[:, 1] = True
    record.rewards[:, 2] = torch.tensor([1.0, 1.0, 0.0, 0.0])
    flat = reward_verdicts(record, CharTokenizer(), names, num_generations=2)[2]
    assert flat.varying == 0 and flat.verdict.startswith("never varies")
    # a second reward with located's shape: both stand out from the control, neither from the other, so both rest
    record.relevance[:, 1] = located
    twins = reward_verdicts(record, CharTokenizer(), names, num_generations=2)
    assert [v.strength for v in twins[:2]] == [0.0, 0.0] and twins[0].q_over_control > 2
    assert all("per-reward strength would rest it" in v.verdict for v in twins[:2])
    assert reward_verdicts(record, CharTokenizer(), names, 2, strength_floor=None)[0].verdict.startswith(
        "token credit will move"
    )
    # the same two as one information group (one block's text): each is read against the other groups, here none
    # but the flat one, so neither rests the other
    record.groups = torch.tensor([0, 0, 2]).expand(4, 3).clone()
    grouped = reward_verdicts(record, CharTokenizer(), names, num_generations=2)
    assert [v.strength for v in grouped[:2]] == pytest.approx([verdicts["located"].strength] * 2) and grouped[
        0
    ].strength > 0
    assert all(v.verdict.startswith("token credit will move") for v in grouped[:2])
    # a block whose text survives its removal: the verdict names the cause and where the text is
    leaky = reward_verdicts(record, CharTokenizer(), names, 2, leaks={"noise": "the info block of reward 'located'"})
    assert "still in the context that removes it, inside the info block of reward 'located'" in leaky[1].verdict


def tiny_recipe(tmp_path, tokenizer, num_prompts: int, rewards: str):
    """A recipe of a tiny model saved in ``tmp_path``, ``rewards`` (its YAML lines) and a JSONL of colour prompts."""
    import json

    from tests.conftest import build_tiny_model

    model_dir = tmp_path / "tiny"
    build_tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Name a colour {i}."}]} for i in range(num_prompts)]
    data.write_text("\n".join(map(json.dumps, rows)))
    recipe = tmp_path / "recipe.yaml"
    datasets = f"datasets:\n  - path: json\n    data_files: {data}\n    split: train\n"
    recipe.write_text(f"model_name_or_path: {model_dir}\n{rewards}{datasets}")
    return recipe


def test_inspect_a_recipe_with_dotted_path_rewards(tmp_path, tiny_tokenizer, capsys):
    """`trl-mrtpo inspect --config` reads the recipe `train` reads: its model, its own rewards and info blocks by
    dotted path, its data (a mixture); prints one verdict per reward and writes the heatmap."""
    from trl_mrtpo.scripts.cli import main

    recipe = tiny_recipe(
        tmp_path,
        tiny_tokenizer,
        3,
        "reward_funcs: [tests.test_inspection.says_red, trl_mrtpo.kits.basic.lowercase_reward]\n"
        "info_blocks: [tests.test_inspection.red_block, none]\n",
    )
    main(["inspect", "--config", str(recipe), "--num-prompts", "2", "--num-generations", "2", "--max-new-tokens", "6",
          "--output", str(tmp_path / "credit.html"), "--threads", "1"])  # fmt: skip
    out = capsys.readouterr().out
    page = (tmp_path / "credit.html").read_text()
    assert page.count('class="resp"') == 4
    # hovering a reward's name shows its info block; a reward without one has no hover
    assert page.count('class="label" title="info block: The answer must contain the word red."') == 4
    assert re.search(r'class="label">lowercase_reward', page)
    lines = [line for line in out.splitlines() if line.startswith(("says_red", "lowercase_reward"))]
    verdicts = ("token credit will move", "never varies", "under twice the control's", "would rest it",
                "replayed for no response")  # fmt: skip
    assert len(lines) == 2 and all(any(v in line for v in verdicts) for line in lines)


def test_inspecting_a_kit_recipe_keeps_the_kits_spans_for_the_report(tmp_path, tiny_tokenizer, monkeypatch):
    """A recipe whose rewards are its task kit's: the localisation report gets the kit (its spans); a recipe with
    rewards of its own gets none (their names are not the kit's). Before, every recipe read as rewards of one's own."""
    from tests.conftest import build_tiny_model
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.scripts import inspection

    build_tiny_model(tiny_tokenizer).save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    given = []
    monkeypatch.setattr(
        inspection, "localisation_report", lambda record, tok, rows, kit, *rest: given.append(kit) or []
    )
    for own in ("", "reward_funcs: [tests.test_inspection.says_red]\n"):  # the kit's built-in data, either way
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"model_name_or_path: {tmp_path / 'tiny'}\ntask: basic\n{own}")
        settings = {**inspection.recipe_inspection(str(recipe)), "num_generations": 2, "max_new_tokens": 4}
        inspection.inspect_credit(num_prompts=1, return_verdicts=True, **settings)
    assert given == [BASIC]  # the second recipe's rewards are its own: no report is attempted


def test_verdicts_read_the_model_tokens_of_a_tool_rollout():
    """A tool result in the middle of the completion (mask 0 there): the reward's q on the last turn's tokens counts
    (the verdict sliced the first mask.sum() positions, so it missed them and read a tool result instead)."""
    import math

    import torch

    from trl_mrtpo.diagnostics import CreditRecord
    from trl_mrtpo.scripts.inspection import reward_verdicts

    names = ["located", CONTROL_NAME]
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * 4)
    located = torch.tensor([0.01, 0.01, 0.0, 0.0, 0.01, 0.5]).repeat(4, 1)
    control = torch.tensor([0.02, 0.02, 0.0, 0.0, 0.02, 0.02]).repeat(4, 1)
    record = CreditRecord(
        prompts=["p"] * 4,
        completions=["abcdef"] * 4,
        completion_ids=torch.tensor([[ord(c) for c in "abcdef"]] * 4),
        mask=mask,
        rewards=torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]),
        group_advantages=torch.zeros(4, 2),
        relevance=torch.stack([located, control], dim=1),
        replayed=torch.ones(4, 2, dtype=torch.bool),
        weights=torch.ones(4, 2, 6),
        advantages=torch.zeros(4, 6),
        beta=0.5,
        reward_betas=torch.full((2,), 0.5),
    )
    (verdict,) = reward_verdicts(record, CharTokenizer(), names, num_generations=2, strength_floor=None)
    assert math.isclose(verdict.q_over_control, 0.53 / 0.08, rel_tol=1e-5)
    assert verdict.verdict.startswith("token credit will move") and verdict.tokens[0] == "f"
    assert verdict.concentration == 0.25  # one of its 4 model tokens holds 80 % of the mass


def test_inspect_samples_the_training_prompt_and_leaves_nothing_behind(tmp_path, tiny_tokenizer, monkeypatch):
    """The responses are sampled from the training prompts (no control sentence in them); the Python call writes no
    file unasked and leaves no temporary folder; TRL's experimental rollout_func warning is not shown; an output
    folder that does not exist is created."""
    import os
    import tempfile
    import warnings

    from tests.conftest import build_tiny_model
    from trl_mrtpo.kits.basic import make_basic_dataset
    from trl_mrtpo.scripts.inspection import CONTROL_SENTENCE

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    work, scratch = tmp_path / "work", tmp_path / "scratch"
    work.mkdir()
    scratch.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.delenv("TRL_EXPERIMENTAL_SILENCE", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record, _ = inspect_credit(model=str(model_dir), num_prompts=2, num_generations=2, max_new_tokens=6)
    assert record.prompts == [row["prompt"] for row in make_basic_dataset(2) for _ in range(2)]
    assert not any(CONTROL_SENTENCE in str(prompt) for prompt in record.prompts)
    assert record.replayed[:, -1].all() and (record.relevance[:, -1].sum(-1) > 0).all()  # the control, replayed
    assert os.listdir(work) == [] and os.listdir(scratch) == []
    assert not [w for w in caught if "experimental" in str(w.message)]

    inspect_credit(model=str(model_dir), num_prompts=1, num_generations=2, max_new_tokens=4,
                   output=str(tmp_path / "new" / "folder" / "credit.html"))  # fmt: skip
    assert (tmp_path / "new" / "folder" / "credit.html").is_file()


def test_inspect_gives_the_q_training_gives_on_the_same_responses(tmp_path, tiny_tokenizer):
    """Each reward's q in inspect is the trainer's on the same responses: the same training prompts, info blocks,
    replay contexts and temperature (checked on every pair both replay; inspect replays non-varying pairs too)."""
    import json

    import torch

    from tests.conftest import build_tiny_model
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset
    from trl_mrtpo.scripts.inspection import fixed_rollout, sample_credit

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    texts = ["the sea is blue. hope this helps.", "The Sea Is Blue", "quiet rain falls. that is all.", "Rain."]
    rows = make_basic_dataset(2).to_list()
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(json.dumps({**rows[i // 2], "completion": t}) for i, t in enumerate(texts)))
    inspected, _ = inspect_credit(model=str(model_dir), completions=str(path), beta=0.5)

    from transformers import AutoModelForCausalLM

    trainer = MRTPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(
            tmp_path / "train",
            num_generations=2,
            per_device_train_batch_size=4,
            temperature=1.0,
            credit_warmup_steps=0,
        ),  # fmt: skip
        train_dataset=make_basic_dataset(2),
        processing_class=tiny_tokenizer,
        rollout_func=fixed_rollout(texts),
    )
    trained = sample_credit(trainer, rows, 2)
    both = trained.replayed & inspected.replayed[:, :-1]
    assert both.any()
    for j, k in both.nonzero().tolist():
        torch.testing.assert_close(inspected.relevance[j, k], trained.relevance[j, k], rtol=0, atol=1e-6)


def test_inspect_config_replays_with_the_recipes_separator(tmp_path, tiny_tokenizer, monkeypatch):
    """The contexts inspect --config replays are the training run's for the recipe, the control's too: its
    info_block_separator joins the appended blocks (they were joined with the default blank line, and the control's
    always were), its chat_template_kwargs render the prompts, and its rollout settings (max_tool_calling_iterations,
    top_p) reach the trainer (they were dropped)."""
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.scripts import inspection
    from trl_mrtpo.scripts.cli import main

    recipe = tiny_recipe(
        tmp_path,
        tiny_tokenizer,
        2,
        "reward_funcs: [tests.test_inspection.says_red, tests.test_inspection.says_red]\n"
        "info_blocks: [tests.test_inspection.red_block, tests.test_inspection.red_block]\n"
        "info_block_separator: ' || '\nmax_tool_calling_iterations: 1\ntop_p: 0.9\n"
        "chat_template_kwargs: {reasoning_effort: low}\n",
    )
    contexts, configs = [], []
    replay_record, sample_credit = MRTPOTrainer._replay_record, inspection.sample_credit

    def recording(self, batch):
        record = replay_record(self, batch)
        contexts.extend(self.processing_class.decode(ids[0]) for ids in record.context_ids if ids)
        return record

    def sampling(trainer, rows, num_generations):
        configs.append(trainer.args)
        return sample_credit(trainer, rows, num_generations)

    monkeypatch.setattr(MRTPOTrainer, "_replay_record", recording)
    monkeypatch.setattr(inspection, "sample_credit", sampling)
    main(["inspect", "--config", str(recipe), "--num-prompts", "2", "--num-generations", "2", "--max-new-tokens", "4",
          "--output", str(tmp_path / "credit.html"), "--threads", "1"])  # fmt: skip
    assert len(contexts) > 2 and all(" || " in context for context in contexts), contexts[:1]
    assert [c.chat_template_kwargs for c in configs] == [{"reasoning_effort": "low"}] * 2  # the recipe's, the control
    assert (configs[0].max_tool_calling_iterations, configs[0].top_p) == (1, 0.9)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--adapter", "{empty}"], r"--adapter .*: no adapter_config.json"),
        (["--model", "{empty}"], r"a folder without config.json"),
        (["--config", "{tmp}/missing.yaml"], r"--config .*missing.yaml: no such file"),
        (["--config", "{tmp}/unknown.yaml"], r"no_such_block"),
    ],
    ids=["empty-adapter", "empty-model", "missing-config", "unknown-block"],
)
def test_inspect_mistakes_end_in_the_usage_line_and_exit_2(tmp_path, capsys, flags, message):
    """Before any model loads (they ended in tracebacks, or in 'You need to have sentencepiece or tiktoken
    installed' for an empty folder)."""
    from trl_mrtpo.scripts.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "unknown.yaml").write_text(
        "model_name_or_path: embedded\ntask: basic\ninfo_blocks: [no_such_block, none]\n"
    )
    flags = [flag.format(empty=empty, tmp=tmp_path) for flag in flags]
    with pytest.raises(SystemExit) as stopped:
        main(["inspect", *flags, "--threads", "1"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and re.search(message, err), err


def test_inspect_credit_takes_a_template_by_the_name_a_recipe_uses(tmp_path, tiny_tokenizer, monkeypatch):
    """``chat_template="qwen3"`` is TRL's shipped template, as ``chat_template_path: qwen3`` is in a recipe (it was
    taken as the template's text)."""
    from pathlib import Path

    import trl

    from tests.conftest import build_tiny_model
    from trl_mrtpo.scripts import inspection

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    seen = []

    def inspected(trainer, rows, num_generations):
        seen.append(trainer.processing_class.chat_template)
        raise KeyboardInterrupt

    monkeypatch.setattr(inspection, "sample_credit", inspected)
    with pytest.raises(KeyboardInterrupt):
        inspect_credit(model=str(model_dir), chat_template="qwen3", num_prompts=1, num_generations=2)
    assert seen == [(Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()]


def test_inspect_replays_recorded_tool_trajectories_through_trls_tool_loop(tmp_path, tiny_tokenizer, monkeypatch):
    """``--completions`` takes the messages TRL's tool loop produces: each recorded assistant turn is served in turn,
    TRL parses its calls and runs them in the row's environment, and the record scores and replays them as training
    does (tool results masked out of the credit). A correct trajectory and one with a wrong total differ in the
    answer reward only."""
    import json
    import random

    import torch
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config
    from trl_mrtpo.kits.tool_agent import make_agent_dataset
    from trl_mrtpo.scripts.agent_warm_start import demonstration

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr("trl_mrtpo.scripts.agent_warm_start.FAULT_RATES", {})  # every demonstration correct
    model_dir = tmp_path / "tiny"
    torch.manual_seed(0)  # the tiny tokenizer spells the tools' schema out in ~1,200 tokens: room for the turns
    LlamaForCausalLM(tiny_llama_config(tiny_tokenizer, max_position_embeddings=8192)).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    row = make_agent_dataset(1, seed=3).to_list()[0]
    messages, _ = demonstration(row, random.Random(0))
    correct = messages[len(row["prompt"]) :]
    wrong = [*correct[:-1], {"role": "assistant", "content": "Total: 0.01"}]
    path = tmp_path / "trajectories.jsonl"
    path.write_text("\n".join(json.dumps({**row, "completion": c}) for c in (correct, wrong)))
    record, _ = inspect_credit(
        model=str(model_dir), task="agent", chat_template="qwen3", completions=str(path), beta=0.5
    )
    for text in record.completions[:2]:  # the environment's results, run again, in the scored responses
        assert all(m["content"] in text for m in correct if m["role"] == "tool")
    names = ["agent_format_reward", "agent_call_reward", "agent_answer_reward"]
    rewards = dict(zip(names, record.rewards[:2].T.tolist()))
    # every recorded call parsed by TRL from the served turns and run: the call reward is full for both
    assert rewards["agent_call_reward"] == [1.0, 1.0] and rewards["agent_answer_reward"] == [1.0, 0.0]
    assert (record.mask[:2] == 0).any(-1).all()  # tool results are context, not the model's tokens
    with pytest.raises(ValueError, match="recorded tool trajectories are replayed through TRL's tool loop"):
        inspect_credit(model=str(model_dir), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                       completions=str(path))  # fmt: skip


def test_tokens_that_share_a_characters_bytes_show_it_whole():
    """A byte-level vocabulary splits 日 and 本 into three tokens each: each character shows whole on its last token
    (the others empty), not as U+FFFD pieces; a token that is a whole character is itself."""
    from trl_mrtpo.observability.summaries import token_strings

    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("日本a".encode())
    assert token_strings(Bytes(), ids) == ["", "", "日", "", "", "本", "a"]
    assert "".join(token_strings(Bytes(), ids)) == "日本a"


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a", "completion": "x"}', '{"prompt": "a", "completion": '], r"r.jsonl line 2 is not JSON \("),
        (['["a", "x"]'], r"r.jsonl line 1 is a JSON list, not an object"),
        (
            ['{"prompt": "a", "completion": [{"role": "assistant", "tool_calls": ["lookup"]}]}'],
            r"r.jsonl line 1: a tool call is 'lookup'; it is \{'function'",
        ),
        (
            ['{"prompt": "a", "completion": "x"}', '{"prompt": "b", "completion": "y"}'],
            r"one completion per prompt; .* at least 2",
        ),
    ],
    ids=["not-json", "not-an-object", "tool-call-shape", "one-per-prompt"],
)
def test_recorded_completions_are_named_by_file_and_line(tmp_path, lines, message):
    """What inspect reads is refused where it is wrong, naming the file and the line (TRL's errors, a bare
    JSONDecodeError or "GRPO requires at least 2 generations", came from deep inside before)."""
    from trl_mrtpo.scripts.inspection import load_completions

    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        load_completions(str(path))


class Counter:
    """A one-tool environment whose result depends on the row (``start``): a short schema, so a tool trajectory
    replays in well under a second on the tiny model."""

    def reset(self, **row):
        self.start = int(row["start"])

    def add(self, n: int) -> str:
        """Add n to the counter.

        Args:
            n: how much to add.
        """
        return str(self.start + n)


def said_total(completions, start, **kwargs):
    """1 when the last turn names start + 2 (the recorded trajectories add 2)."""
    return [float(f"is {s + 2}." in c[-1]["content"]) for c, s in zip(completions, start)]


def counter_trajectory(result: str, answer: str, rounds: int = 1) -> list[dict]:
    add = {"type": "function", "function": {"name": "add", "arguments": {"n": 2}}}
    call = {"role": "assistant", "tool_calls": [add]}
    return [*[m for _ in range(rounds) for m in (call, {"role": "tool", "name": "add", "content": result})],
            {"role": "assistant", "content": answer}]  # fmt: skip


@pytest.fixture
def counter_model(tmp_path, tiny_tokenizer):
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny"
    LlamaForCausalLM(tiny_llama_config(tiny_tokenizer, max_position_embeddings=4096)).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    return str(model_dir)


def replay_recorded(tmp_path, model, trajectories, **settings):
    import json

    path = tmp_path / "recorded.jsonl"
    row = {"prompt": [{"role": "user", "content": "Add 2 to the counter."}], "start": 3}
    path.write_text("\n".join(json.dumps({**row, "completion": c}) for c in trajectories))
    return inspect_credit(model=model, reward_funcs=[said_total], info_blocks=[None], completions=str(path),
                          environment_factory=Counter, chat_template="qwen3", beta=0.5, **settings)  # fmt: skip


def test_a_recorded_trajectory_is_scored_whole_whatever_its_length(tmp_path, counter_model, monkeypatch):
    """A trajectory longer than 1,024 tokens keeps its last turn (it was cut there without a word, and its answer
    reward fell from 1 to 0)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    long_answer = "Let me think. " * 300 + "The counter is 5."
    record, _ = replay_recorded(tmp_path, counter_model, [counter_trajectory("5", long_answer)] * 2)
    assert record.rewards[:2, 0].tolist() == [1.0, 1.0]


def test_a_recorded_tool_result_the_environment_does_not_give_is_refused_by_line(tmp_path, counter_model, monkeypatch):
    """A recorded result is the trajectory's evidence: one that the row's environment does not return (a recorded
    error, or a row lacking what reset() reads) is refused naming the line, not scored on the environment's."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    recorded = [counter_trajectory("5", "The counter is 5."), counter_trajectory("error: no counter", "It failed.")]
    with pytest.raises(ValueError, match=r"recorded.jsonl line 2: its tool result 1 is recorded as 'error: no counter'"
                                         r" but the row's environment returns '5'"):  # fmt: skip
        replay_recorded(tmp_path, counter_model, recorded)


def test_a_trajectory_the_recipes_tool_rounds_would_cut_is_refused_by_line(tmp_path, counter_model, monkeypatch):
    """The recipe's max_tool_calling_iterations reaches inspect's trainer: a recorded trajectory with more tool rounds
    than training allows is refused, naming the line and the setting (it was replayed with 3 rounds whatever the
    recipe said)."""
    from trl_mrtpo import MRTPOConfig

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    recorded = [counter_trajectory("5", "The counter is 5.", rounds=2)] * 2
    recipe = MRTPOConfig(str(tmp_path), max_tool_calling_iterations=1, bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match=r"recorded.jsonl line 1: 2 of its 3 assistant turns were replayed: .*"
                                         r"max_tool_calling_iterations \(1\)"):  # fmt: skip
        replay_recorded(tmp_path, counter_model, recorded, recipe_args=recipe)


def pair_record(texts, rewards, relevance, contributions=None, steps=None):
    """A synthetic record of one prompt's responses (character tokens), every pair replayed."""
    from trl_mrtpo.diagnostics import CreditRecord

    length = max(map(len, texts))
    ids = torch.tensor([[ord(c) for c in text.ljust(length)] for text in texts])
    mask = torch.tensor([[1] * len(text) + [0] * (length - len(text)) for text in texts])
    rewards = torch.tensor(rewards, dtype=torch.float32)
    B, K = rewards.shape
    return CreditRecord(
        prompts=[[{"role": "user", "content": "What is 3 + 4?"}]] * B,
        completions=list(texts),
        completion_ids=ids,
        mask=mask,
        rewards=rewards,
        group_advantages=torch.zeros(B, K),
        relevance=relevance,
        replayed=torch.ones(B, K, dtype=torch.bool),
        weights=torch.ones(B, K, length),
        advantages=torch.zeros(B, length),
        beta=0.5,
        reward_betas=torch.full((K,), 0.5),
        contributions=contributions or {},
        steps=steps or {},
    )


def test_verdicts_on_pairs_that_pass_and_fail():
    """Two responses to one prompt that differ in their last character ("= 7" passes, "= 8" fails): a reward whose q
    peaks on that character is told its credit lands where it is decided; one whose block primes '+' (outside the
    deciding span) is told its credit would move onto tokens that do not decide it; where the control's q peaks on
    the deciding character too, nothing shows the block moves it; a reward that scores both alike has no pair and
    keeps the q/control sentence, saying so, and never asks for --completions when they were given. A process
    reward's contribution gets a row naming its steps and where the largest blame lands."""
    texts = ["3 + 4 = 7", "3 + 4 = 8"]
    names = ["correct", "primed", "same", CONTROL_NAME]

    def profile(peak: int, height: float = 0.9) -> list[float]:
        return [height if t == peak else 0.01 for t in range(9)]

    relevance = torch.tensor(
        [[profile(8), profile(2), profile(0, 0.05), profile(4, 0.2)] for _ in texts], dtype=torch.float32
    )
    blame = torch.tensor([[0.1] * 9, [0.1] * 4 + [-0.7] * 5])
    process = "process reward 'equations'"
    record = pair_record(texts, [[1, 1, 1, 0], [0, 0, 1, 0]], relevance, {process: blame}, {process: [[3, 8], [3, 8]]})
    verdicts = {v.reward: v for v in reward_verdicts(record, CharTokenizer(), names, 2, None, completions_given=True)}
    correct, primed, same = verdicts["correct"], verdicts["primed"], verdicts["same"]
    assert (correct.pairs, correct.pair_hits, correct.control_hits) == (1, 1, 0)
    assert (
        correct.verdict.startswith("pair test: in 1 of 1 pairs")
        and "lands where it is decided ('7')" in correct.verdict
    )
    assert math.isclose(correct.deciding_share, 1.8 / (2 * (0.9 + 8 * 0.01)), rel_tol=1e-5)
    # 'primed' scores the pair differently too: the differing tokens may decide it, and the verdict says so
    assert correct.mixed_pairs == 1 and "1 of the 1 pairs differ in another reward's score too" in correct.verdict
    alone = pair_record(texts, [[1, 1, 0], [0, 1, 0]], relevance[:, [0, 2, 3]])
    (only, _) = reward_verdicts(alone, CharTokenizer(), ["correct", "same", CONTROL_NAME], 2, None)
    assert "lands where it is decided ('7')." in only.verdict and "another reward" not in only.verdict
    assert (primed.pairs, primed.pair_hits) == (1, 0)
    assert "peaks outside the tokens they differ in (on '+'" in primed.verdict
    assert same.pairs == 0 and same.verdict.startswith("never varies")
    # responses that share too few tokens to align form no pair: the q/control sentence, and what would give a pair
    loud = torch.tensor([[profile(8), profile(2), profile(0, 0.05), profile(4)]] * 2)  # the control moves as much
    apart = pair_record(["3 + 4 = 7", "seven: 7!"], [[1, 1, 1, 0], [0, 0, 1, 0]], loud)
    (unpaired, *_) = reward_verdicts(apart, CharTokenizer(), names, 2, None, completions_given=True)
    assert unpaired.pairs == 0 and "no two responses to one prompt that it scores differently" in unpaired.verdict
    assert "--completions file" in unpaired.verdict and "with --completions" not in unpaired.verdict
    assert verdicts[process].verdict == (
        "4 steps found and scored in 2 of 2 responses; the largest blame lands on step 2 of response 1, "
        "'4 = 8' (-0.70 to the loss)."
    )
    record.relevance[:, 3] = torch.tensor(profile(8, 0.5))  # the control moves on the deciding character as well
    (control_too, *_) = reward_verdicts(record, CharTokenizer(), names, 2, None)
    assert "but so does the control's (1)" in control_too.verdict and "lands where" not in control_too.verdict
    table = format_verdicts(list(verdicts.values()))
    assert "1/1" in table and process in table


def test_a_peak_on_pairs_that_differ_in_much_is_not_called_where_the_reward_decides():
    """Its q peaks on a token where the two responses differ, but holds no more of its q on those tokens than an even
    spread would: responses that differ in much (sampled ones) say nothing of what decides the reward."""
    texts = ["3 + 4 = 7", "3 + 5 = 8"]  # 4 of the 18 characters differ
    names = ["diffuse", CONTROL_NAME]
    diffuse = [0.1, 0.1, 0.1, 0.1, 0.0, 0.1, 0.1, 0.1, 0.15]  # peaks on the last character, 18% of q on the four
    record = pair_record(texts, [[1, 0], [0, 0]], torch.tensor([[diffuse, [0.01] * 8 + [0.02]]] * 2))
    (verdict,) = reward_verdicts(record, CharTokenizer(), names, 2, None, completions_given=True)
    assert (verdict.pairs, verdict.pair_hits) == (1, 1)
    assert math.isclose(verdict.deciding_tokens, 4 / 18) and math.isclose(
        verdict.deciding_share, 0.3 / 1.7, rel_tol=1e-6
    )
    assert "but those are 22% of their tokens and hold 18% of its q, no more than an even spread" in verdict.verdict
    assert "lands where it is decided" not in verdict.verdict


def test_a_feedback_block_on_failures_only_is_told_why_it_has_no_pair_test():
    """A block only failing responses get (an error message) is replayed on one side of each pair: the verdict says
    the pair test cannot read it, and does not ask for pairs the file already holds."""
    texts = ["3 + 4 = 7", "3 + 4 = 8"]
    names = ["executes", CONTROL_NAME]
    relevance = torch.tensor([[[0.01] * 9, [0.2] + [0.01] * 8], [[0.3] + [0.01] * 8, [0.2] + [0.01] * 8]])
    record = pair_record(texts, [[1, 0], [0, 0]], relevance)
    record.replayed[0, 0] = False  # the passing response has no error to show
    (verdict,) = reward_verdicts(record, CharTokenizer(), names, 2, None, completions_given=True)
    assert verdict.pairs == 0
    assert "its block applies to at most one response of each of its 1 pairs" in verdict.verdict
    assert "add to the --completions file" not in verdict.verdict


def math_text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def math_correct(completions, answer, **kwargs):
    """1 when the line '#### <n>' holds the gold answer."""
    found = [re.search(r"^#### (\d+)\s*$", math_text(c), re.M) for c in completions]
    return [float(m is not None and m.group(1) == a) for m, a in zip(found, answer)]


def math_format(completions, **kwargs):
    """1 when the last line is '#### ' and a number."""
    return [float(re.search(r"\n#### \d+\s*$", math_text(c)) is not None) for c in completions]


def math_equations(completions, **kwargs):
    """A process reward: each line 'a op b = c' is a step, scored 1 when it is right."""
    scored = []
    for text in map(math_text, completions):
        steps = []
        for line in re.finditer(r"[^\n]+", text):
            eq = re.fullmatch(r"\s*(\d+)\s*([*+-])\s*(\d+)\s*=\s*(\d+)\s*", line.group())
            if eq:
                a, b, result = int(eq[1]), int(eq[3]), int(eq[4])
                steps.append((line.start(), line.end(), float({"*": a * b, "+": a + b, "-": a - b}[eq[2]] == result)))
        scored.append(steps)
    return scored


@pytest.mark.slow
def test_inspect_on_a_math_task_reads_pairs_and_shows_the_step_credit(tmp_path):
    """Hand-written responses to one grade-school problem (tests/fixtures/math_pairs.jsonl): right; wrong final
    answer; a wrong step and answer; no '####' line. The embedded model without an adapter, measured before this
    test was written: the correctness reward's q peaks on '\\n' before the answer line in two of its three pairs and
    on the wrong final digit of the wrong step's response (q 0.63) in the third, so its verdict is the pair test's
    (1 of 3); the process reward's row puts the largest blame on the wrong step, '3 * 4 = 13' (-0.93 to the loss),
    and its row is in the heatmap."""
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "math_pairs.jsonl"
    page = tmp_path / "math.html"
    record, _, verdicts = inspect_credit(
        model="embedded", reward_funcs=[math_correct, math_format], completions=str(fixture), output=str(page),
        info_blocks=[lambda row, **_: f"Reference answer: #### {row['answer']}",
                     lambda **_: "Format: the last line is '#### ' and the number."],
        process_rewards=[math_equations], return_verdicts=True,
    )  # fmt: skip
    by_name = {v.reward: v for v in verdicts}
    correct = by_name["math_correct"]
    assert (correct.pairs, correct.pair_hits) == (3, 1) and correct.verdict.startswith("pair test:"), correct
    steps = by_name["process reward 'math_equations'"]
    assert steps.verdict.startswith("4 steps found and scored in 4 of 4 responses; the largest blame lands on step 1 "
                                    "of response 2, '3 * 4 = 13'"), steps  # fmt: skip
    assert "process reward &#x27;math_equations&#x27;: 1 steps, added after the cap" in page.read_text()
    assert record.contributions["process reward 'math_equations'"][2].min() < -0.5


@pytest.mark.parametrize("kit", [name for name in KIT_NAMES if get_kit(name).examples])
def test_each_kit_example_gives_every_reward_a_pair_that_passes_and_fails(kit):
    """`inspect --completions example` runs the pair test on the kit's hand-written responses: every reward that
    applies to them is scored differently on two responses whose tokens (the embedded model's) align on at least half
    of the longer one, so each reward is judged by the pair test, not by q/control (a reward without a block is
    never replayed: its credit stays uniform, nothing to judge; one whose block only failing responses get, an error
    message, cannot have a pair and is told so). A row takes what it leaves out (the SQL database's path on this
    machine) from the kit's own row with its prompt."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from trl_mrtpo.scripts.embedded import embedded_model_path
    from trl_mrtpo.scripts.inspection import deciding_pairs, load_completions, with_task_fields

    rows, texts, group, _ = load_completions(get_kit(kit).examples_path)
    rows = [row for row in with_task_fields(rows, get_kit(kit).dataset(4, 0, None)) for _ in range(group)]
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != "completion"}
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    length = max(map(len, ids))
    completion_ids = torch.tensor([row + [0] * (length - len(row)) for row in ids])
    positions = [torch.arange(len(row)) for row in ids]
    for reward, block in zip(get_kit(kit).rewards, get_kit(kit).info_blocks, strict=True):
        if block is None:
            continue
        scores = reward(prompts=columns["prompt"], completions=completions, **columns)
        if all(score is None for score in scores):
            continue  # an instruction-following slot the example's prompt does not fill
        record = SimpleNamespace(
            rewards=torch.tensor([[math.nan if s is None else s] for s in scores]), completion_ids=completion_ids
        )
        blocks = [
            block(prompt=row["prompt"], completion=completion, row=row, score=score)
            for row, completion, score in zip(rows, completions, scores, strict=True)
        ]
        pairs = [p for p in deciding_pairs(record, 0, group, positions) if blocks[p[0]] and blocks[p[1]]]
        if not pairs:  # a feedback block (a failure's error message) is replayed on failing responses only
            best = max(s for s in scores if s is not None)
            assert not any(b for b, s in zip(blocks, scores) if s == best), (
                f"{kit}: {reward.__name__} has no pair of responses that it scores differently, that align and that "
                "its block applies to"
            )
