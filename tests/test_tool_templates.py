"""Tool rollouts through TRL's own tool loop in the chat formats of the families users train: Qwen2.5 (consecutive
tool results in one user turn of <tool_response> blocks), Qwen3-Instruct-2507, and Llama-3.1 (tool schemas in the
first user message, results under ``ipython``, one bare-JSON call per turn). Each tokenizer is a tiny byte-level
BPE with the family's special tokens and TRL's shipped template; a scripted policy writes the turns (two calls in one
turn, two turns, a failing call, a malformed call, a plain answer, and rollouts cut by the length limit). Asserted
on every trajectory: each result range decodes to the view's results, each turn range to the turn's text, q and the
advantages are 0 on results and equal the float64 reference elsewhere, and the replay's appended info blocks land in
the last user message, after the results' turns."""

import json

import pytest
from datasets import Dataset

from tests.helpers import RecordingTrainer, make_args, template_tokenizer
from tests.test_agent_credit import check_credit_on_model_tokens
from trl_mrtpo.trajectories import trajectory

QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>", "<|finetune_right_pad_id|>"]  # fmt: skip
CORPUS = [
    'Call the tool lookup with {"name": "lookup", "arguments": {"city": "Paris"}} or "parameters": {"city": "Oz"}.',
    "What is the code of Paris? The code of Paris is 42. I do not know. Environment: ipython. Cutting Knowledge",
    "You are a helpful assistant with tool calling capabilities. Given the following functions, respond with JSON.",
]
# family: (template, special tokens, eos, pad, where a tool result starts in the rendered text)
FAMILIES = {
    "qwen2_5": ("qwen2_5", QWEN, "<|im_end|>", "<|endoftext|>", "<tool_response>"),
    "qwen3_instruct_2507": (
        "qwen3_instruct_2507", [*QWEN, "<tool_response>", "</tool_response>", "<think>", "</think>"], "<|im_end|>",
        "<|endoftext|>", "<tool_response>",
    ),
    "llama3_1": ("llama3_1", LLAMA, "<|eot_id|>", "<|finetune_right_pad_id|>", "ipython<|end_header_id|>"),
}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the code of Paris?"}]
BLOCK = "The code of Paris is 42."


def lookup(city: str) -> str:
    """Look up the code of a city.

    Args:
        city: the city's name.
    """
    if city == "Oz":
        raise KeyError(city)
    return ("The code of Paris is 42. " * 200) if city == "Long" else f"The code of {city} is 42."


def answered(completions, **_):
    return [float("42" in completion[-1]["content"]) for completion in completions]


def used_tool(completions, **_):
    return [float(any(message.get("tool_calls") for message in completion)) for completion in completions]


def family_tokenizer(family: str):
    from trl.chat_template_utils import add_response_schema

    template, specials, eos, pad, _ = FAMILIES[family]
    return add_response_schema(template_tokenizer(template, specials, CORPUS, eos=eos, pad=pad))


def reply(family: str, text: str, index: int) -> str:
    """The scripted policy's next turn after the conversation ``text``. In the first round ``index`` is the row, and
    the case is ``row % 6``: two calls in one turn (Llama: one), a failing call, a malformed call, a plain answer, a
    call whose result is too long for the rollout, a turn the length limit cuts. TRL asks again only for the rows
    that called, indexed among them, so later rounds read the case from the conversation: after the failing call a
    second turn calls again, else the answer."""
    llama = family == "llama3_1"
    end = "<|eot_id|>" if llama else "<|im_end|>\n"
    results = text.count(FAMILIES[family][4])

    def call(city: str) -> str:
        if llama:
            return json.dumps({"name": "lookup", "parameters": {"city": city}})
        return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"city": city}}) + "\n</tool_call>"

    if results:
        return (call("Paris") if results == 1 and '"Oz"' in text else "The code is 42.") + end
    kind = index % 6
    if kind == 0:
        return (call("Paris") if llama else call("Paris") + "\n" + call("Rome")) + end
    if kind == 1:
        return call("Oz") + end
    if kind == 2:  # malformed: the call is never closed (Llama: broken JSON)
        return ('{"name": "lookup", "parameters": {"city": ' if llama else '<tool_call>\n{"name": "lookup", ') + end
    if kind == 4:
        return call("Long") + end
    if kind == 5:
        return "The code is " + "very " * 200 + end
    return ("The code is 42." if index % 2 == 0 else "I do not know.") + end


def scripted_run(
    family: str, tmp_path, tool=lookup, policy=reply, rows: int = 12, iterations: int = 3, length: int = 700, steps=1
):
    """One step of TRL's tool loop in ``family``'s format with the scripted ``policy``; returns the trainer, its
    tokenizer and the replay's contexts with the completions they were built for."""
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    tokenizer = family_tokenizer(family)
    contexts = []

    class Scripted(RecordingTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            texts = [policy(family, tokenizer.decode(ids), i) for i, ids in enumerate(prompt_ids)]
            limit = self.max_completion_length  # as generation stops there
            return [tokenizer(t, add_special_tokens=False)["input_ids"][:limit] for t in texts], None

        def _replay_inputs(self, batch, joint):
            step_two, context_ids, completion_ids = super()._replay_inputs(batch, joint)
            contexts.append((context_ids, batch.completions))
            return step_two, context_ids, completion_ids

    args = make_args(tmp_path, max_steps=steps, max_completion_length=length, per_device_train_batch_size=rows,
                     num_generations=6, max_tool_calling_iterations=iterations)  # fmt: skip
    trainer = Scripted(
        model=LlamaForCausalLM(tiny_llama_config(tokenizer, max_position_embeddings=8192)),
        reward_funcs=[answered, used_tool],
        info_blocks=[lambda **_: BLOCK, None],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": QUESTION}] * rows),
        processing_class=tokenizer,
        tools=[tool],
    )
    trainer.train()
    return trainer, tokenizer, contexts


def check_views(family: str, tokenizer, batch: dict, completions: list) -> list:
    """Each view's turn ranges decode to the turns' text and its result ranges to the results the turns' calls got
    (as the template renders them); results carry no credit. Returns the views."""
    mask = (batch["completion_mask"] * batch["tool_mask"]).tolist()
    ids = batch["completion_ids"].tolist()
    views = []
    for i, completion in enumerate(completions):
        length = int(batch["completion_mask"][i].sum())  # the view reads the unpadded mask, as the trainer does
        view = trajectory(completion, batch["tool_mask"][i, :length].tolist())
        views.append(view)
        if view is None:
            continue
        for turn in view.turns:
            start, end = turn.tokens
            if turn.text.strip() and end > start:
                assert turn.text.strip() in tokenizer.decode(ids[i][start:end]), (i, turn)
        for turn, (start, end) in zip(view.turns, view.results):  # the results after a turn, in one range
            rendered = tokenizer.decode(ids[i][start:end])
            for call in turn.calls:
                if call.result is not None:  # Llama-3.1's template renders a result through tojson: quoted, escaped
                    shown = json.dumps(call.result, ensure_ascii=False) if family == "llama3_1" else call.result
                    assert shown in rendered, (i, call, rendered)
        assert all(m == 0 for start, end in view.results for m in mask[i][start:end])
    return views


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_rollouts_in_the_familys_template(family, tmp_path):
    trainer, tokenizer, contexts = scripted_run(family, tmp_path)
    check_credit_on_model_tokens(trainer)
    (batch,) = trainer.batches
    ((context_ids, completions),) = contexts
    views = check_views(family, tokenizer, batch, completions)
    mask = (batch["completion_mask"] * batch["tool_mask"]).tolist()
    for i, view in enumerate(views):
        kind = i % 6
        if kind in (2, 3, 5):  # a malformed call is text, as the template's parser reads it; a cut turn has no call
            assert view is None, (i, view)
            assert kind != 5 or sum(mask[i]) == trainer.args.max_completion_length
        elif kind == 0:
            assert len(view.turns[0].calls) == (1 if family == "llama3_1" else 2)
        elif kind == 1:
            assert len(view.turns) == 3 and view.failed and view.failed[0].arguments == {"city": "Oz"}
        elif kind == 4:  # TRL dropped the result that did not fit: the call is in the view, never run
            assert [c.result for c in view.calls] == [None] and view.results == ()
    # the appended block: once per replayed context, in the last user message (after the tool schemas Llama puts in
    # the first), before the assistant header that starts the completion
    header = "<|start_header_id|>assistant" if family == "llama3_1" else "<|im_start|>assistant"
    for sample in context_ids:
        if not sample:
            continue
        text = tokenizer.decode(sample[0])
        assert text.count(BLOCK) == 1 and text.index(BLOCK) > text.rindex("What is the code of Paris?")
        assert text.rindex(header) > text.index(BLOCK) and text.endswith(text[text.rindex(header) :])


def test_calls_trl_never_ran_are_in_the_view_with_no_result(tmp_path):
    """``max_tool_calling_iterations=0`` on TRL's loop: the calling turns' views hold their calls, ``result=None``."""
    trainer, tokenizer, contexts = scripted_run("qwen2_5", tmp_path, rows=6, iterations=0)
    ((_, completions),) = contexts
    views = check_views("qwen2_5", tokenizer, trainer.batches[0], completions)
    assert [len(views[k].calls) for k in (0, 1, 4)] == [2, 1, 1]
    assert all(call.result is None for k in (0, 1, 4) for call in views[k].calls)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_instruct_2507", "llama3_1"])
def test_any_tool_result_is_where_the_view_says(family):
    """A property over tool return values drawn by hypothesis (any text, empty included, with the templates' own
    markup characters): on TRL's own loop, every result range decodes to hold its calls' results and every turn range
    its turn's text."""
    import tempfile
    from pathlib import Path

    from hypothesis import given, settings
    from hypothesis import strategies as st

    text = st.text(st.characters(max_codepoint=0x2FF, exclude_categories=("Cs",)), max_size=40)

    @settings(max_examples=4, deadline=None, derandomize=True)
    @given(st.lists(text, min_size=1, max_size=3))
    def check(returns):
        calls = iter(range(1_000))

        def lookup(city: str) -> str:
            """Look up the code of a city.

            Args:
                city: the city's name.
            """
            return returns[next(calls) % len(returns)]

        with tempfile.TemporaryDirectory() as folder:
            trainer, tokenizer, contexts = scripted_run(family, Path(folder), tool=lookup, rows=6)
        check_credit_on_model_tokens(trainer)
        ((_, completions),) = contexts
        views = check_views(family, tokenizer, trainer.batches[0], completions)
        assert sum(c.result is not None for view in views if view for c in view.calls) >= 2

    check()
