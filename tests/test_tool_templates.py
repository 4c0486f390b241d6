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


def reply(family: str, text: str, row: int) -> str:
    """The scripted policy's next turn for row ``row`` after the conversation ``text``: by row, two calls in one
    turn (Llama: one), a failing call then a good one in a second turn, a malformed call, a plain answer, an
    over-long result, or a turn the length limit cuts."""
    llama = family == "llama3_1"
    end = "<|eot_id|>" if llama else "<|im_end|>\n"
    results = text.count(FAMILIES[family][4])

    def call(city: str) -> str:
        if llama:
            return json.dumps({"name": "lookup", "parameters": {"city": city}})
        return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"city": city}}) + "\n</tool_call>"

    kind = row % 6
    if kind == 0 and results == 0:  # two calls in one turn
        return (call("Paris") if llama else call("Paris") + "\n" + call("Rome")) + end
    if kind == 1 and results < 2:  # a failing call, then a good one in a second turn
        return call("Oz" if results == 0 else "Paris") + end
    if kind == 2:  # malformed: the call is never closed (Llama: broken JSON)
        return ('{"name": "lookup", "parameters": {"city": ' if llama else '<tool_call>\n{"name": "lookup", ') + end
    if kind == 4 and results == 0:  # a result longer than the rollout has room for
        return call("Long") + end
    if kind == 5:  # cut by the length limit
        return "The code is " + "very " * 200 + end
    return ("The code is 42." if row % 2 == 0 else "I do not know.") + end


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_rollouts_in_the_familys_template(family, tmp_path):
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config

    tokenizer = family_tokenizer(family)
    contexts = []

    class Scripted(RecordingTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            texts = [reply(family, tokenizer.decode(ids), i) for i, ids in enumerate(prompt_ids)]
            limit = self.max_completion_length  # as generation stops there
            return [tokenizer(t, add_special_tokens=False)["input_ids"][:limit] for t in texts], None

        def _replay_inputs(self, batch, joint):
            wanted, context_ids, completion_ids = super()._replay_inputs(batch, joint)
            contexts.append((context_ids, batch.completions))
            return wanted, context_ids, completion_ids

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.credits = [*getattr(self, "credits", []), self.last_credit]
            return output

    args = make_args(tmp_path, max_steps=1, max_completion_length=700, per_device_train_batch_size=12,
                     num_generations=6, max_tool_calling_iterations=3)  # fmt: skip
    trainer = Scripted(
        model=LlamaForCausalLM(tiny_llama_config(tokenizer, max_position_embeddings=8192)),
        reward_funcs=[answered, used_tool],
        info_blocks=[lambda **_: BLOCK, None],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 12),
        processing_class=tokenizer,
        tools=[lookup],
    )
    trainer.train()
    check_credit_on_model_tokens(trainer)
    (batch,) = trainer.batches
    ((context_ids, completions),) = contexts
    mask = (batch["completion_mask"] * batch["tool_mask"]).tolist()
    ids = batch["completion_ids"].tolist()
    seen = set()
    for i, completion in enumerate(completions):
        view = trajectory(completion, batch["tool_mask"][i].tolist())
        kind = i % 6
        if kind in (2, 3, 5):  # a malformed call is text, as the template's parser reads it; a cut turn has no call
            assert view is None, (i, view)
            assert kind != 5 or sum(mask[i]) == args.max_completion_length
            continue
        seen.add(kind)
        if kind == 0:
            assert len(view.turns[0].calls) == (1 if family == "llama3_1" else 2)
        if kind == 4:  # TRL dropped the result that did not fit: the call is in the view, never run
            assert [c.result for c in view.calls] == [None] and view.results == ()
        for turn in view.turns:
            start, end = turn.tokens
            if turn.text and end > start:
                assert turn.text.strip() in tokenizer.decode(ids[i][start:end]), (i, turn)
        for turn, (start, end) in zip(view.turns, view.results):  # the results after a turn, in one range
            rendered = tokenizer.decode(ids[i][start:end])
            for call in turn.calls:
                if call.result is not None:  # Llama-3.1's template renders a result through tojson: quoted, escaped
                    shown = json.dumps(call.result) if family == "llama3_1" else call.result
                    assert shown in rendered, (i, call, rendered)
        assert all(m == 0 for start, end in view.results for m in mask[i][start:end])
        if i % 6 == 1:
            assert view.failed and view.failed[0].arguments == {"city": "Oz"}
    assert seen == {0, 1, 4}
    # the appended block: once per replayed context, in the last user message (after the tool schemas Llama puts in
    # the first), before the assistant header that starts the completion
    header = "<|start_header_id|>assistant" if family == "llama3_1" else "<|im_start|>assistant"
    for sample in context_ids:
        if not sample:
            continue
        text = tokenizer.decode(sample[0])
        assert text.count(BLOCK) == 1 and text.index(BLOCK) > text.rindex("What is the code of Paris?")
        assert text.rindex(header) > text.index(BLOCK) and text.endswith(text[text.rindex(header) :])
