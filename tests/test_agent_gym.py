"""The agent gym: trajectories read back by hand, the deciding word of each reward and its turn, the rollout's ids
and env_mask, and a tiny run of the pre-registered benchmark (resumable, report written)."""

import json
import re

import pytest

from trl_mrtpo.gym.agent import (
    REWARD_NAMES,
    AgentGymSpec,
    AgentRunSettings,
    Parsed,
    agent_blocks,
    agent_example,
    agent_rewards,
    agent_rollout,
    env_mask_of,
    parse_table,
    parse_trajectory,
    relevant_token,
    supervised_agent_policy,
    train_agent_run,
    turn_of,
)

WORDS = "call ann ; => two ; call bob ; => six ; call cal ; => one ; answer one".split()


def test_a_trajectory_read_back_by_hand():
    parsed = parse_trajectory(WORDS)
    assert parsed == Parsed(calls=(("ann", 1), ("bob", 7), ("cal", 13)), answer=("one", 19))
    assert [relevant_token(n, parsed) for n in REWARD_NAMES] == [1, 13, 19]
    assert [turn_of(t, parsed) for t in (0, 5, 6, 11, 13, 17, 18, 19)] == [
        "first call", "first call", "middle calls", "middle calls", "last call", "last call", "answer", "answer",
    ]  # fmt: skip
    assert env_mask_of(WORDS) == [1, 1, 1, 0, 0, 0] * 3 + [1, 1]
    # malformed turns end the reading; a trajectory without calls has no deciding word for the call rewards
    assert parse_trajectory("call zed ; answer one".split()) == Parsed((), None)
    assert relevant_token("first_call", parse_trajectory(["answer", "two"])) is None


def test_rewards_and_blocks_by_hand():
    import random

    row = agent_example(random.Random(0))
    table = parse_table(row["table"])
    good = (
        " ".join(f"call {e} ; => {table[e]} ;" for e in (row["first"], "hal", row["last"]))
        + f" answer {table[row['last']]}"
    )
    bad = f"call {row['last']} ; => {table[row['last']]} ; answer {table[row['last']]}"
    columns = {"first": [row["first"]] * 2, "last": [row["last"]] * 2, "table": [row["table"]] * 2}
    completions = [[{"role": "assistant", "content": good}], [{"role": "assistant", "content": bad}]]
    scores = [reward(completions, **columns) for reward in agent_rewards()]
    assert scores == [[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    first, last, answer = (block(row=row) for block in agent_blocks())
    assert first.text == f"first {row['first']}" and first.placement == "in_prompt"
    assert last.text in row["prompt"][0]["content"] and answer == f"note {row['last']} => {table[row['last']]} ;"


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    cache = tmp_path_factory.mktemp("agent_gym")
    spec = AgentGymSpec(sft_steps=30)
    return spec, cache, supervised_agent_policy(spec, 0, cache)


def test_the_rollout_returns_ids_and_an_env_mask_that_fit(tiny_policy):
    import random
    from types import SimpleNamespace

    _, _, (model, tokenizer) = tiny_policy
    rows = [agent_example(random.Random(i)) for i in range(6)]
    trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m), model=model, temperature=1.0)
    out = agent_rollout(tokenizer)([row["prompt"] for row in rows], trainer)  # TRL's call: (prompts, trainer)
    for row, ids, mask in zip(rows, out["completion_ids"], out["env_mask"]):
        words = tokenizer.convert_ids_to_tokens(ids)
        assert len(mask) == len(ids) and mask == env_mask_of(words)
        table = parse_table(row["table"])
        for i, word in enumerate(words):  # every environment answer is the table's value of the call before it
            if word == "=>":
                assert words[i + 1] == table[words[i - 2]] and mask[i : i + 3] == [0, 0, 0]
        assert words.count("call") <= 5


def test_a_short_run_records_every_step(tiny_policy, tmp_path):
    spec, cache, _ = tiny_policy
    records = train_agent_run(spec, AgentRunSettings("mrtpo", steps=3, prompts_per_step=2), 0, cache, tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0 <= r[n] <= 1 for r in records for n in REWARD_NAMES)


def test_the_benchmark_resumes_and_writes_its_report(tiny_policy, tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, "benchmarks")
    import agent_gym

    spec, cache, _ = tiny_policy
    monkeypatch.setattr(agent_gym, "AgentGymSpec", lambda: spec)
    monkeypatch.setattr(agent_gym, "SETTINGS", {**agent_gym.SETTINGS, "steps": 2, "prompts_per_step": 2})
    args = ["--work-dir", str(tmp_path / "runs"), "--cache-dir", str(cache), "--seeds", "0", "1"]
    agent_gym.main([*args, "--report", str(tmp_path / "report.md")])
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == sorted(f"{kind}-seed{s}.json" for kind in ("gdpo", "mrtpo", "localisation") for s in (0, 1))
    stamp = (tmp_path / "runs" / "mrtpo-seed0.json").stat().st_mtime_ns
    agent_gym.main([*args, "--report", str(tmp_path / "again.md")])  # nothing recomputed
    assert (tmp_path / "runs" / "mrtpo-seed0.json").stat().st_mtime_ns == stamp
    text = (tmp_path / "report.md").read_text()
    assert "| auc |" in text and "| answer |" in text and text == (tmp_path / "again.md").read_text()
    rows = (tmp_path / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("seed,method,auc") and len(rows) == 5
    assert json.loads((tmp_path / "runs" / "localisation-seed0.json").read_text())[0]["reward"] in REWARD_NAMES
    # the second comparison adds only the strength arm's runs, beside the stored ones
    agent_gym.main([*args, "--strength", "--report", str(tmp_path / "strength.md")])
    assert (tmp_path / "runs" / "mrtpo-seed0.json").stat().st_mtime_ns == stamp
    added = sorted(p.name for p in (tmp_path / "runs").iterdir() if p.name not in runs)
    assert added == ["reproduced-seed0.json", "strength-seed0.json", "strength-seed1.json"]
    check = json.loads((tmp_path / "runs" / "reproduced-seed0.json").read_text())
    assert check["gdpo"] is True and check["mrtpo"] is True  # the stored runs recompute identically
    text = (tmp_path / "strength.md").read_text()
    assert "| measure | gdpo | strength |" in text and "| measure | mrtpo | strength |" in text
    assert len((tmp_path / "summary_strength.csv").read_text().splitlines()) == 7


@pytest.mark.slow
def test_inspect_verdicts_match_the_gyms_deciding_words(tmp_path):
    """On the agent gym, where the word that decides each reward is known: inspecting the supervised policy's own
    trajectories, the verdict says token credit will move a reward's credit only for rewards whose q peaks on their
    deciding word (the first call's entity, the last call's entity, the answer's value) in at least 3 of 4
    trajectories, on every CPU float path."""
    from trl_mrtpo.gym.agent import agent_blocks, agent_rewards, deciding_word_peaks, supervised_trajectories
    from trl_mrtpo.scripts.inspection import inspect_credit

    policy, rows, trajectories, words = supervised_trajectories(tmp_path)
    record, _, verdicts = inspect_credit(
        model=policy, reward_funcs=agent_rewards(), info_blocks=agent_blocks(), dataset=rows,
        completions=trajectories, output=None, return_verdicts=True,
    )  # fmt: skip
    assert [v.reward for v in verdicts] == list(REWARD_NAMES)
    peaks = deciding_word_peaks(record, words)
    # The supervised policy differs with the CPU's float path (ATEN_CPU_CAPABILITY default / avx2 / avx512, seed 0).
    # Replayed as training replays them, q peaks on the deciding word for the first call in 31, 31, 32 of 31-32
    # trajectories, the answer in 28/29, 27/29, 31/31, the last call in 7, 18, 7 of 31-32; but the control (the
    # irrelevant sentence appended: ten unknown words to this word-level policy, right before the response) moves the
    # policy more than any block (q / control 0.16-0.77x), and where trajectories form pairs that a reward scores
    # differently the control's q peaks where they differ as often as the reward's (8 of 10 for the first call on
    # avx2): the pair test then says that nothing shows the block is what moves the credit (docs/inspect.md). What
    # holds on every path: "will move" or "lands where it is decided" is said only for a reward whose q peaks on its
    # deciding word in most trajectories, never for the last call, and a reward whose q peaks there in nearly every
    # trajectory is told where its credit moves.
    for verdict in verdicts:
        hits, total = peaks[verdict.reward]
        assert total >= 8
        if verdict.verdict.startswith("token credit will move") or "lands where it is decided" in verdict.verdict:
            assert hits / total >= 0.75, (verdict, peaks)
        # a reward whose q peaks on its deciding word in nearly every trajectory is never told its credit will not
        # move: the verdict says where it moves (with or without evidence that its block is what moves it)
        if hits / total >= 0.9:
            assert re.match(
                r"(token credit will move|q is under twice .*: its credit still moves|pair test: .*its credit (lands|"
                r"moves))",
                verdict.verdict,
            ), (
                verdict,
                peaks,
            )
    by_name = {v.reward: v.verdict for v in verdicts}
    assert not by_name["last_call"].startswith("token credit will move"), (by_name, peaks)
    assert "lands where it is decided" not in by_name["last_call"], (by_name, peaks)
