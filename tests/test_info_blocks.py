"""Info-block placement (appended / in-prompt) and builder validation."""

import pytest

from trl_mrtpo.checks.inputs import check_builders
from trl_mrtpo.info_blocks import InfoBlock, InfoBlockError, build_block, build_contexts, per_reward

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi. Use lowercase."}]


def test_appended_blocks_in_reward_order_and_removed_one_at_a_time():
    blocks = [InfoBlock("Rule A."), None, InfoBlock("Reference: B.")]
    p_all, removed = build_contexts("Question?", blocks, [[0], [2]], separator="\n\n")
    assert p_all == "Question?\n\nRule A.\n\nReference: B."
    assert removed == ["Question?\n\nReference: B.", "Question?\n\nRule A."]


def test_appended_blocks_go_to_last_user_message_without_mutating_prompt():
    original = [dict(m) for m in CHAT]
    p_all, (p_not_0,) = build_contexts(CHAT, [InfoBlock("Format: one line.")], [[0]])
    assert p_all[1]["content"] == "Say hi. Use lowercase.\n\nFormat: one line."
    assert p_all[0] == CHAT[0]
    assert p_not_0 == CHAT
    assert CHAT == original


def test_in_prompt_span_is_removed_only_in_its_own_context():
    blocks = [InfoBlock(" Use lowercase.", "in_prompt"), InfoBlock("Extra rule.")]
    p_all, (p_not_0, p_not_1, p_none) = build_contexts(CHAT, blocks, [[0], [1], [0, 1]])
    assert p_all[1]["content"] == "Say hi. Use lowercase.\n\nExtra rule."
    assert p_not_0[1]["content"] == "Say hi.\n\nExtra rule."
    assert p_not_1[1]["content"] == "Say hi. Use lowercase."
    assert p_none[1]["content"] == "Say hi."


def test_multimodal_content_gets_a_text_part():
    prompt = [{"role": "user", "content": [{"type": "text", "text": "Describe."}]}]
    p_all, _ = build_contexts(prompt, [InfoBlock("Rule.")], [])
    assert p_all[0]["content"][-1] == {"type": "text", "text": "\n\nRule."}


def _call(builder, prompt="Say hi. Use lowercase."):
    return build_block(builder, "fmt", 3, prompt, "hello", {"x": 1}, 1.0)


def test_builder_receives_documented_arguments():
    seen = {}

    def builder(*, prompt, completion, row, score):
        seen.update(prompt=prompt, completion=completion, row=row, score=score)
        return "Rule."

    assert _call(builder) == InfoBlock("Rule.")
    assert seen == {"prompt": "Say hi. Use lowercase.", "completion": "hello", "row": {"x": 1}, "score": 1.0}


def test_empty_text_means_no_block():
    assert _call(lambda **_: "  ") is None
    assert _call(lambda **_: None) is None


def test_builder_errors_name_reward_and_sample():
    def boom(**_):
        raise KeyError("reference")

    with pytest.raises(InfoBlockError, match=r"reward 'fmt' on sample 3.*KeyError"):
        _call(boom)
    with pytest.raises(InfoBlockError, match=r"reward 'fmt' on sample 3.*returned int"):
        _call(lambda **_: 5)
    with pytest.raises(InfoBlockError, match=r"reward 'fmt' on sample 3.*not a span"):
        _call(lambda **_: InfoBlock("Use uppercase.", "in_prompt"))


def test_info_block_validates_fields():
    with pytest.raises(ValueError, match="placement"):
        InfoBlock("x", placement="prefix")
    with pytest.raises(TypeError, match="string"):
        InfoBlock(3)


def test_check_builders():
    check_builders(None, ["a", "b"])
    assert per_reward(None, 2) == [None, None] and per_reward(len, 1) == [len]
    with pytest.raises(ValueError, match="3 entries but there are 2 reward functions"):
        check_builders([None, None, None], ["a", "b"])
    with pytest.raises(TypeError, match="reward 'b'"):
        check_builders([None, "not callable"], ["a", "b"])


def test_in_prompt_span_that_occurs_twice_is_refused():
    prompt = "Use lowercase. Write a poem. Use lowercase."
    with pytest.raises(InfoBlockError, match=r"reward 'fmt' on sample 3.*occurs 2 times"):
        _call(lambda **_: InfoBlock("Use lowercase.", "in_prompt"), prompt=prompt)
    chat = [{"role": "system", "content": "Use lowercase."}, {"role": "user", "content": "Hi. Use lowercase."}]
    with pytest.raises(InfoBlockError, match="occurs 2 times"):
        _call(lambda **_: InfoBlock("Use lowercase.", "in_prompt"), prompt=chat)


@pytest.mark.parametrize(
    "prompt, span, expected",
    [
        ("Say hi. Use lowercase. Be brief.", "Use lowercase.", "Say hi. Be brief."),
        ("Use lowercase. Say hi.", "Use lowercase.", "Say hi."),
        ("Say hi. Use lowercase.", "Use lowercase.", "Say hi."),
        ("Say hi.\nUse lowercase.\nBe brief.", "Use lowercase.", "Say hi.\nBe brief."),
        ("Say hi.\n\n- Use lowercase.\n- Be brief.", "- Use lowercase.", "Say hi.\n\n- Be brief."),
    ],
)
def test_removed_span_leaves_no_double_separator(prompt, span, expected):
    _, (removed,) = build_contexts(prompt, [InfoBlock(span, "in_prompt")], [[0]])
    assert removed == expected
