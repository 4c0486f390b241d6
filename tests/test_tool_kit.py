"""Tool-calling kit: parsing, rewards with real cases and fuzzed junk, info blocks, BFCL and RLLA adapters."""

import json

import pytest
from hypothesis import given, settings

from tests.conftest import MALFORMED_COMPLETIONS
from trl_mrtpo.kits.tool_calling import (
    call_score,
    extract_calls,
    load_bfcl,
    load_rlla,
    make_tool_dataset,
    tool_correctness_reward,
    tool_format_reward,
    tool_reference_block,
)

REFERENCE = [
    {"name": "get_weather", "arguments": {"city": "Lima"}},
    {"name": "get_weather", "arguments": {"city": "Cairo"}},
]


def answer(calls, think="I should look it up."):
    return [{"role": "assistant", "content": f"<think>{think}</think>\n<tool_call>\n{calls}\n</tool_call>"}]


def test_format_reward_real_cases():
    good = answer(json.dumps(REFERENCE))
    json_lines = answer("\n".join(json.dumps(c) for c in REFERENCE))
    single = answer(json.dumps(REFERENCE[0]))
    cases = [
        good,
        json_lines,
        single,
        answer("not json"),
        answer(json.dumps([{"name": "f"}])),  # no arguments
        answer(json.dumps([{"name": "f", "arguments": "city=Lima"}])),  # arguments not an object
        [{"role": "assistant", "content": f"<tool_call>{json.dumps(REFERENCE)}</tool_call>"}],  # no think
        [{"role": "assistant", "content": "<tool_call>[]</tool_call><think>x</think>"}],  # wrong order
        answer(json.dumps(REFERENCE) + "</tool_call><tool_call>[]"),  # tag twice
        answer("[]"),  # no call
    ]
    assert tool_format_reward(cases) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]


def test_correctness_partial_credit():
    ref = json.dumps(REFERENCE)
    exact = answer(json.dumps(REFERENCE))
    reordered = answer(json.dumps(REFERENCE[::-1]))
    one_of_two = answer(json.dumps(REFERENCE[:1]))
    wrong_value = answer(
        json.dumps(
            [
                {"name": "get_weather", "arguments": {"city": "Lima"}},
                {"name": "get_weather", "arguments": {"city": "Paris"}},
            ]
        )
    )
    wrong_name = answer(json.dumps([{"name": "set_timer", "arguments": {"minutes": 3}}]))
    scores = tool_correctness_reward(
        [exact, reordered, one_of_two, wrong_value, wrong_name, answer("junk")], [ref] * 6
    )
    assert scores[0] == scores[1] == 1.0
    # one of two: names 1/2, keys (1 + 0)/2, values (1 + 0)/2 -> 0.5
    assert scores[2] == pytest.approx(0.5)
    # right names and keys, one value wrong: (1 + 1 + 0.5) / 3
    assert scores[3] == pytest.approx(2.5 / 3)
    assert scores[4] == 0.0 and scores[5] == 0.0


def test_value_comparison_is_lenient_on_case_and_number_type():
    ref = [{"name": "convert", "arguments": {"amount": 60, "to": "EUR"}}]
    assert call_score([{"name": "convert", "arguments": {"amount": 60.0, "to": "eur"}}], ref) == 1.0
    assert call_score([{"name": "convert", "arguments": {"amount": True, "to": "EUR"}}], ref) < 1.0


@settings(max_examples=300, deadline=None)
@given(MALFORMED_COMPLETIONS)
def test_malformed_input_never_raises(junk):
    for completion in (
        junk,
        answer(junk if isinstance(junk, str) else "x"),
        [{"role": "assistant", "content": f"<think>a</think><tool_call>{junk}</tool_call>"}],
    ):
        assert tool_format_reward([completion]) in ([0.0], [1.0])
        assert 0.0 <= tool_correctness_reward([completion], [json.dumps(REFERENCE)])[0] <= 1.0


def test_deeply_nested_json_is_rejected_not_crashing():
    nested = "[" * 100000 + "]" * 100000
    assert extract_calls(f"<think>x</think><tool_call>{nested}</tool_call>") is None


def test_reference_block_and_builtin_data():
    dataset = make_tool_dataset()
    assert len(dataset) == 12
    for row in dataset:
        block = tool_reference_block(prompt=row["prompt"], completion="", row=row, score=0.0)
        calls = json.loads(block.split("\n", 1)[1])
        # the reference is a perfect answer
        assert tool_correctness_reward([answer(json.dumps(calls))], [row["tool_calls"]]) == [1.0]
        for call in calls:  # every reference function is documented in the prompt
            assert f'"name": "{call["name"]}"' in row["prompt"][0]["content"]


def test_bfcl_adapter_reads_package_data():
    rows = load_bfcl("simple_python", limit=5)
    assert len(rows) == 5 and rows[0]["id"] == "simple_python_0"
    assert rows[0]["possible_answer"][0]["calculate_triangle_area"]["base"] == [10]
    assert "calculate_triangle_area" in rows[0]["prompt"][0]["content"]
    assert len(load_bfcl("live_simple", limit=3)) == 3
    with pytest.raises(ValueError, match="unknown BFCL category"):
        load_bfcl("nope")


def test_rlla_adapter_from_local_file(tmp_path):
    path = tmp_path / "rlla.jsonl"
    rows = [
        {
            "prompt": [{"role": "user", "content": "weather in Oslo"}],
            "answer": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        },
        {
            "prompt": [{"role": "user", "content": "timer"}],
            "answer": '[{"name": "set_timer", "arguments": {"minutes": 2}}]',
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    dataset = load_rlla(str(path))
    assert json.loads(dataset[0]["tool_calls"]) == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    with pytest.raises(ValueError, match="no column"):
        load_rlla(str(path), answer_column="gold")
    path.write_text(json.dumps({"prompt": "x", "answer": "garbage"}))
    with pytest.raises(ValueError, match="row 0"):
        load_rlla(str(path))


def test_call_boundary_is_the_end_of_the_first_wrong_call():
    from trl_mrtpo.kits.tool_calling import tool_call_boundary

    row = {"tool_calls": json.dumps(REFERENCE)}
    good, wrong = json.dumps(REFERENCE[0]), json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    completion = answer(f"[{good}, {wrong}, {good}]")
    text = completion[0]["content"]
    end = tool_call_boundary(prompt=None, completion=completion, row=row, score=0.5)
    assert text[:end].endswith(wrong) and text.index(wrong) + len(wrong) == end
    # JSON lines, the second call wrong
    completion = answer(f"{json.dumps(REFERENCE[1])}\n{wrong}")
    end = tool_call_boundary(prompt=None, completion=completion, row=row, score=0.5)
    assert completion[0]["content"][:end].endswith(wrong)
    # every call right but one missing: the omission comes after the last call
    completion = answer(f"[{good}]")
    assert completion[0]["content"][
        : tool_call_boundary(prompt=None, completion=completion, row=row, score=0.5)
    ].endswith(good)
    # no call block, or one that does not parse: no boundary
    assert tool_call_boundary(prompt=None, completion="no calls", row=row, score=0.0) is None
    assert tool_call_boundary(prompt=None, completion=answer("[{oops"), row=row, score=0.0) is None


@given(MALFORMED_COMPLETIONS)
@settings(max_examples=100)
def test_call_boundary_never_raises_on_junk(junk):
    from trl_mrtpo.kits.tool_calling import tool_call_boundary

    completion = answer(junk) if isinstance(junk, str) else junk
    end = tool_call_boundary(prompt=None, completion=completion, row={"tool_calls": json.dumps(REFERENCE)}, score=0.0)
    assert end is None or 0 < end
