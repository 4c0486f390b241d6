"""The multi-turn tool kit (``agent``): its store environment refuses every malformed or hostile call by name and
leaves its state untouched, its rewards and feedback blocks read the trajectory, and on TRL's own tool loop its
failure boundaries are turns: a reward's blame ends with the turn whose call failed."""

import json
import math

import pytest
import torch
from datasets import Dataset

from tests.helpers import observe_term
from tests.test_agent_credit import tool_tokenizer
from trl_mrtpo import _trl
from trl_mrtpo.kits import get_kit
from trl_mrtpo.kits.tool_agent import (
    MAX_QUANTITY,
    ShopEnvironment,
    agent_answer_block,
    agent_answer_reward,
    agent_call_reward,
    agent_failure_turn,
    agent_format_block,
    agent_format_reward,
    agent_turn_calls,
    make_agent_dataset,
)
from trl_mrtpo.trajectories import trajectory

ROW = {"stock": json.dumps({"apple": 3, "pear": 1}), "answer": "2.40"}
REFERENCE = json.dumps(
    [
        {"name": "check_stock", "arguments": {"item": "apple"}},
        {"name": "add_to_cart", "arguments": {"item": "apple", "quantity": 2}},
        {"name": "checkout", "arguments": {}},
    ]
)


def shop() -> ShopEnvironment:
    env = ShopEnvironment()
    env.reset(prompt="ignored", **ROW)
    return env


def test_a_row_without_its_stock_is_refused_not_an_empty_store():
    """TRL passes the row to reset(): one lacking 'stock' was an empty store, where every call failed unnamed."""
    with pytest.raises(ValueError, match=r"starts from the row's 'stock' .* this row has only \['prompt'\]"):
        ShopEnvironment().reset(prompt="a row of another task")


def state(env: ShopEnvironment):
    return dict(env.stock), dict(env.cart), env.paid


def test_the_tools_trl_exposes_are_exactly_the_three_declared_functions():
    """TRL builds an environment's tools from its public functions except ``reset``: nothing else is callable."""
    import inspect

    exposed = [
        name
        for name, _ in inspect.getmembers(ShopEnvironment, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]
    assert sorted(exposed) == ["add_to_cart", "check_stock", "checkout"]


def test_a_well_formed_order_by_hand():
    env = shop()
    assert env.check_stock(item="Apple") == "apple: 3 in stock at 1.20 each"
    assert env.add_to_cart(item="apple", quantity=2) == "cart: 2 apple"
    assert env.checkout() == "order placed, total paid 2.40"


HOSTILE_CALLS = [
    ("check_stock", {"item": "durian"}, "unknown item 'durian'"),
    ("check_stock", {"item": "__import__('os').system('rm -rf /')"}, "unknown item"),  # a name, never code
    ("check_stock", {"item": "x" * 10**6}, "at most 40 characters"),
    ("check_stock", {"item": ""}, "non-empty string"),
    ("check_stock", {"item": ["apple"]}, "non-empty string"),
    ("check_stock", {"item": {"$ne": None}}, "non-empty string"),
    ("check_stock", {"item": "apple'; DROP TABLE stock;--"}, "unknown item"),
    ("add_to_cart", {"item": "apple", "quantity": 4}, "only 3 apple in stock"),
    ("add_to_cart", {"item": "apple", "quantity": 0}, "integer from 1 to 99"),
    ("add_to_cart", {"item": "apple", "quantity": -2}, "integer from 1 to 99"),
    ("add_to_cart", {"item": "apple", "quantity": 2.0}, "integer from 1 to 99"),
    ("add_to_cart", {"item": "apple", "quantity": "2"}, "integer from 1 to 99"),
    ("add_to_cart", {"item": "apple", "quantity": True}, "integer from 1 to 99"),
    ("add_to_cart", {"item": "apple", "quantity": 10**400}, "integer from 1 to 99"),
    ("add_to_cart", {"item": "apple", "quantity": float("nan")}, "integer from 1 to 99"),
    ("add_to_cart", {"item": "fig", "quantity": 1}, "unknown item 'fig'"),  # in the catalogue, not in this store
    ("checkout", {}, "the cart is empty"),
]


@pytest.mark.parametrize(
    "name, arguments, message", HOSTILE_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(HOSTILE_CALLS)]
)
def test_hostile_and_malformed_calls_are_refused_by_name_and_change_nothing(name, arguments, message):
    env = shop()
    before = state(env)
    with pytest.raises(ValueError, match=message):
        getattr(env, name)(**arguments)
    assert state(env) == before


def test_extra_or_missing_arguments_fail_as_python_calls_do():
    """TRL calls ``method(**arguments)``: an argument the schema does not declare, or a missing one, is a TypeError
    that TRL turns into the tool's error result."""
    env = shop()
    with pytest.raises(TypeError):
        env.check_stock(item="apple", code="print(1)")
    with pytest.raises(TypeError):
        env.add_to_cart(item="apple")


def test_an_order_cannot_be_changed_or_paid_twice_after_checkout():
    env = shop()
    env.add_to_cart(item="apple", quantity=1)
    env.checkout()
    with pytest.raises(ValueError, match="already checked out"):
        env.add_to_cart(item="apple", quantity=1)
    with pytest.raises(ValueError, match="already checked out"):
        env.checkout()
    assert env.paid == 120 and MAX_QUANTITY == 99


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


FAILED_THEN_RECOVERED = [
    {"role": "assistant", "content": "", "tool_calls": [call("add_to_cart", item="apple", quantity=9)]},
    {"role": "tool", "name": "add_to_cart", "content": "{'error': 'only 3 apple in stock'}"},
    {"role": "assistant", "content": "", "tool_calls": [call("add_to_cart", item="apple", quantity=2)]},
    {"role": "tool", "name": "add_to_cart", "content": "cart: 2 apple"},
    {"role": "assistant", "content": "", "tool_calls": [call("checkout")]},
    {"role": "tool", "name": "checkout", "content": "order placed, total paid 2.40"},
    {"role": "assistant", "content": "Total: 2.40"},
]
CLEAN = FAILED_THEN_RECOVERED[2:]  # the same order without the failing first call


def test_rewards_by_hand():
    completions = [FAILED_THEN_RECOVERED, CLEAN, CLEAN[:-1], [{"role": "assistant", "content": "Total: 12.40"}]]
    assert agent_format_reward(completions) == [0.0, 1.0, 0.0, 1.0]
    assert agent_answer_reward(completions, answer=["2.40"] * 4) == [1.0, 1.0, 0.0, 0.0]
    calls = agent_call_reward(completions, reference_calls=[REFERENCE] * 4)
    assert calls[3] == 0.0 and 0 < calls[0] < calls[1] < 1  # check_stock skipped; the failed call counts against
    perfect = [{"role": "assistant", "content": "", "tool_calls": [call("check_stock", item="apple")]}] + CLEAN
    assert agent_call_reward([perfect], reference_calls=[REFERENCE]) == [1.0]


def test_feedback_blocks_and_the_failure_turn_read_the_trajectory():
    view = trajectory(FAILED_THEN_RECOVERED, [1] * 4 + [0] * 3 + [1] * 4 + [0] * 2 + [1] * 3 + [0] * 3 + [1] * 5)
    row = {**ROW, "reference_calls": REFERENCE}
    fields = dict(prompt=None, completion="", row=row, score=0.0)
    block = agent_format_block(**fields, trajectory=view)
    assert 'add_to_cart({"item": "apple", "quantity": 9}) failed with: only 3 apple in stock' in block
    assert agent_answer_block(**fields, trajectory=view).startswith("Checkout returned: order placed, total paid 2.40")
    assert agent_failure_turn(**fields, trajectory=view) is view.turns[0]
    assert agent_failure_turn(**fields, trajectory=None) is None
    clean = trajectory(CLEAN, [1] * 4 + [0] * 2 + [1] * 3 + [0] * 3 + [1] * 5)
    assert agent_failure_turn(**fields, trajectory=clean) is None and "failed" not in agent_format_block(**fields)


def test_the_dataset_is_solvable_by_its_reference_calls():
    """Replaying each row's reference calls in a fresh store succeeds and pays the row's answer."""
    for row in make_agent_dataset(24, seed=3):
        env = ShopEnvironment()
        env.reset(**row)
        for reference in json.loads(row["reference_calls"]):
            result = getattr(env, reference["name"])(**reference["arguments"])
        assert result == f"order placed, total paid {row['answer']}"
        assert 2 <= len(json.loads(row["reference_calls"])) - 1 <= 4


def scripted_agent(tokenizer):
    """Row i: even rows first ask for 9 apples (the call fails), then recover; every row then checks out and
    answers, the total right on rows 0 and 1 mod 4."""

    def reply(text: str, i: int) -> str:
        results = text.count("<tool_response>")
        last = text.rsplit("<tool_response>", 1)[-1] if results else ""
        if results == 0:
            quantity = 9 if i % 2 == 0 else 2
            body = json.dumps({"name": "add_to_cart", "arguments": {"item": "apple", "quantity": quantity}})
        elif "error" in last:
            body = json.dumps({"name": "add_to_cart", "arguments": {"item": "apple", "quantity": 2}})
        elif "cart:" in last:
            body = json.dumps({"name": "checkout", "arguments": {}})
        else:
            return ("Total: 2.40" if i % 4 < 2 else "Total: 3.60") + "<|im_end|>\n"
        return f"<tool_call>\n{body}\n</tool_call><|im_end|>\n"

    def scripted_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        replies = [reply(tokenizer.decode(ids), i) for i, ids in enumerate(prompt_ids)]
        return [tokenizer(r, add_special_tokens=False)["input_ids"] for r in replies], None

    return scripted_turn


def test_the_agent_kit_on_trls_tool_loop_ends_blame_at_the_failing_turn(tiny_tokenizer, tmp_path):
    from transformers import LlamaForCausalLM

    from tests.conftest import tiny_llama_config
    from tests.helpers import RecordingTrainer, make_args

    tokenizer = tool_tokenizer(tiny_tokenizer)
    kit = get_kit("agent")
    row = {"prompt": [{"role": "user", "content": "Please buy 2 apple."}], **ROW, "reference_calls": REFERENCE}
    recorded = []

    class Scripted(RecordingTrainer):
        _generate_single_turn = scripted_agent(tokenizer)

    trainer = Scripted(
        # the three tools' schema makes a long prompt in the tiny tokenizer's tokens
        model=LlamaForCausalLM(tiny_llama_config(tokenizer, max_position_embeddings=4096)),
        reward_funcs=kit.rewards,
        info_blocks=kit.info_blocks,
        failure_boundaries=kit.failure_boundaries,
        process_rewards=[agent_turn_calls],
        environment_factory=kit.environment,
        args=make_args(tmp_path, max_steps=1, max_completion_length=1000, per_device_train_batch_size=4),
        train_dataset=Dataset.from_list([row] * 4),
        processing_class=tokenizer,
    )
    observe_term(
        trainer.credit_terms["process"],
        lambda batch, credit: recorded.append((batch, credit.failure_suffix, credit.process)),
    )
    trainer.train()
    ((batch, suffix, process),) = recorded
    views = [trajectory(c, m) for c, m in zip(batch.completions, batch.output["tool_mask"].tolist())]
    formats = batch.rewards[:, 0].tolist()
    assert formats == [0.0, 1.0, 0.0, 1.0]  # even rows' first call failed
    for i, view in enumerate(views):
        assert len(view.turns) == (4 if i % 2 == 0 else 3)
        end = view.turns[0].tokens[1]
        for k in (0, 1):  # format and call rewards: blame ends with the failing turn
            expected = torch.zeros(suffix.shape[-1], dtype=torch.bool)
            if i % 2 == 0 and batch.group_advantages[i, k] < 0:
                expected[end:] = True
            assert suffix[i, k].tolist() == expected.tolist(), (i, k)
        assert not suffix[i, 2].any()  # the answer reward has no boundary
        # the process reward: the failing first turn scores 0 of the group's 1s, so its tokens carry a penalty
        first = process[i, : view.turns[0].tokens[1]]
        assert (first < 0).all() if i % 2 == 0 else (first > 0).all()
        assert (process[i, view.turns[-2].tokens[1] :] == 0).all()  # after the last calling turn: nothing
    assert (batch.group_advantages[0::2, 0] < 0).all()
    assert (batch.output["advantages"][batch.mask == 0] == 0).all()
    assert trainer.replays[0]["replayed"].any()
    assert not math.isnan(trainer.state.log_history[-1]["train_loss"])
    # the seam's environment attributes are TRL's; the environments TRL built are the kit's own, not wrapped
    assert all(hasattr(trainer, name) for name in _trl.GRPO_ENVIRONMENT_ATTRIBUTES)
    assert trainer.environments and all("reset" not in vars(e) for e in trainer.environments)


def test_a_call_the_rollout_never_ran_is_in_the_view_without_a_result():
    """A rollout cut by the length limit (or the iteration limit) after a call: the call is there, ``result`` None."""
    view = trajectory(CLEAN[:3], [1] * 4 + [0] * 2 + [1] * 3)
    (last,) = view.turns[-1].calls
    assert (last.name, last.result, last.error) == ("checkout", None, None) and view.failed == []
    assert agent_answer_block(prompt=None, completion="", row=ROW, score=0.0, trajectory=view).startswith(
        "The correct"
    )


def test_a_character_offset_in_a_tool_rollout_is_refused_by_name():
    from trl_mrtpo.steps.process_rewards import failure_boundary

    view = trajectory(CLEAN, [1] * 4 + [0] * 2 + [1] * 3 + [0] * 3 + [1] * 5)
    with pytest.raises(ValueError, match="reward 'calls' on sample 3 .* must return one of trajectory.turns"):
        failure_boundary(lambda **_: 5, "calls", 3, None, "text", {}, -1.0, view)
    foreign = trajectory(FAILED_THEN_RECOVERED, [1] * 23).turns[0]
    with pytest.raises(ValueError, match="trajectory.turns"):
        failure_boundary(lambda **_: foreign, "calls", 3, None, "text", {}, -1.0, view)
    assert (
        failure_boundary(lambda **kw: kw["trajectory"].turns[1], "calls", 3, None, "t", {}, -1.0, view)
        == view.turns[1]
    )


@pytest.mark.parametrize(
    "env_mask, message",
    [
        ([[1, 1, 0]], "1 rows for 2 completions"),
        ([[1, 1, 0], [1, 1]], "completion 1 .* as long as its 3 completion ids \\(found 2 entries"),
        ([[1, 1, 0], [1, 2, 1]], "completion 1 .*found 3 entries: \\[1, 2, 1\\]"),
        ([[1, 1, 0], [1.0, 0.0, 1.0]], "completion 1"),
        ([[1, 1, 0], "110"], "completion 1 .*found str"),
    ],
)
def test_a_rollout_funcs_env_mask_that_does_not_fit_its_ids_is_refused_by_name(env_mask, message):
    from trl_mrtpo.checks.environments import checked_rollout

    def my_rollout(prompts, trainer):
        return {
            "prompt_ids": [[1], [1]],
            "completion_ids": [[5, 6, 7], [5, 6, 7]],
            "logprobs": None,
            "env_mask": env_mask,
        }

    with pytest.raises(ValueError, match=f"rollout_func 'my_rollout' returned .*{message}"):
        checked_rollout(my_rollout)(["a", "b"], None)
    fine = {"prompt_ids": [[1]], "completion_ids": [[5, 6]], "logprobs": None, "env_mask": [[1, 0]]}
    assert checked_rollout(lambda prompts, trainer: fine)(["a"], None) is fine


def test_a_builder_reading_a_turn_that_does_not_exist_is_named():
    from trl_mrtpo.info_blocks import InfoBlockError, build_block

    view = trajectory(CLEAN, [1] * 4 + [0] * 2 + [1] * 3 + [0] * 3 + [1] * 5)

    def sixth_turn(*, prompt, completion, row, score, trajectory):
        return trajectory.turns[5].text

    with pytest.raises(InfoBlockError, match="builder of reward 'calls' on sample 2 .* raised IndexError"):
        build_block(sixth_turn, "calls", 2, "Please buy 2 apple.", "", ROW, 0.0, view)


def test_the_turn_process_reward_by_hand():
    view = trajectory(FAILED_THEN_RECOVERED, [1] * 4 + [0] * 3 + [1] * 4 + [0] * 2 + [1] * 3 + [0] * 3 + [1] * 5)
    assert agent_turn_calls([FAILED_THEN_RECOVERED, "text"], trajectories=[view, None]) == [
        [(view.turns[0], 0.0), (view.turns[1], 1.0), (view.turns[2], 1.0)],
        None,
    ]


@pytest.mark.parametrize(
    "step, message",
    [
        ((0, 4, 1.0), "is \\(0, 4, 1.0\\); in a tool rollout a step is \\(turn, score\\)"),
        ("foreign", "is \\(Turn\\(.*one of trajectories\\[i\\].turns"),
        ((None, 1.0), "is \\(None, 1.0\\)"),
        ("array", "is \\(array\\(\\[1, 2\\]\\), 1.0\\)"),
        ("nan", "has score nan"),
        ("bool", "has score True"),
    ],
)
def test_a_turn_step_that_is_not_a_turn_of_the_rollout_is_refused_by_name(step, message):
    """On a tool rollout a process reward's steps are (turn, score) pairs of that rollout: character spans, another
    rollout's turn and bad scores are refused naming the function and the sample."""
    import numpy

    from trl_mrtpo.steps.process_rewards import checked_turn_steps

    view = trajectory(CLEAN, [1] * 4 + [0] * 2 + [1] * 3 + [0] * 3 + [1] * 5)
    foreign = trajectory(FAILED_THEN_RECOVERED, [1] * 23).turns[0]
    drawn = {"foreign": (foreign, 1.0), "nan": (view.turns[0], math.nan), "bool": (view.turns[0], True)}
    step = (numpy.array([1, 2]), 1.0) if step == "array" else drawn.get(step, step)  # == gives an array
    with pytest.raises((ValueError, TypeError), match=f"Step 0 of the process reward 'turns' on sample 3 {message}"):
        checked_turn_steps([step], "turns", 3, view)
    assert checked_turn_steps([(view.turns[1], 0.5), (view.turns[0], 1)], "turns", 3, view) == [
        (1.0, view.turns[0].tokens[1] - 1),
        (0.5, view.turns[1].tokens[1] - 1),
    ]


def test_calls_read_defensively_from_messages():
    """Arguments that are not a dict count as none (the view used to fail on a string); entries that are not calls
    are skipped."""
    from trl_mrtpo.trajectories import message_calls

    message = {
        "role": "assistant",
        "tool_calls": [call("checkout"), {"function": {"name": "x", "arguments": "{oops"}}, 7],
    }
    assert message_calls(message) == [{"name": "checkout", "arguments": {}}, {"name": "x", "arguments": {}}]
    view = trajectory([message, {"role": "tool", "name": "checkout", "content": "ok"}], [1, 1, 0])
    assert [c.name for c in view.calls] == ["checkout", "x"] and view.calls[1].result is None


def test_the_warm_start_demonstrations_score_as_their_faults_say():
    """A clean demonstration scores 1 on the kit's three rewards; each fault costs the reward it is meant to vary:
    a malformed call the format, a wrong item the calls, a wrong total the answer."""
    import random

    from trl_mrtpo.kits.tool_agent import (
        agent_answer_reward,
        agent_call_reward,
        agent_format_reward,
        make_agent_dataset,
    )
    from trl_mrtpo.scripts.agent_warm_start import FAULT_RATES, demonstration

    rows = make_agent_dataset(64, 5).to_list()
    rng = random.Random(5)
    seen = set()
    for row in rows:
        messages, faults = demonstration(row, rng)
        completion = messages[len(row["prompt"]) :]
        # TRL's parsed completion: tool calls as {"name", "arguments"} in the assistant message
        parsed = [
            {**m, "tool_calls": [c["function"] for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in completion
        ]
        scores = [
            agent_format_reward([parsed])[0],
            agent_call_reward([parsed], [row["reference_calls"]])[0],
            agent_answer_reward([parsed], [row["answer"]])[0],
        ]
        seen.update(faults)
        if not faults:
            assert scores == [1.0, 1.0, 1.0], (messages, scores)
        if "malformed_call" in faults:
            assert scores[0] == 0.0
        elif "wrong_total" in faults:
            assert scores[2] == 0.0
        if "wrong_item" in faults:
            assert scores[1] < 1.0
    assert seen == set(FAULT_RATES)  # every fault is drawn in 64 rows


def test_the_shipped_warm_start_is_what_its_provenance_says():
    """The demonstrations regenerate byte for byte (their hash is the shipped adapter's), and the adapter is small
    (r 8 on every linear layer of the 135M model, fp32: 9.4 MiB; the attention-only adapter before it was 3.5 MiB
    and never made a call that passed)."""
    import json

    from trl_mrtpo.scripts.agent_warm_start import ADAPTER_DIR, data_hash, demonstrations

    provenance = json.loads((ADAPTER_DIR / "provenance.json").read_text())
    assert data_hash(demonstrations(provenance["demonstrations"], provenance["seed"])) == provenance["data_sha256"]
    assert (ADAPTER_DIR / "adapter_model.safetensors").stat().st_size < 10 << 20
