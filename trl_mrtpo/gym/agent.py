"""Agent gym: multi-turn tool rollouts where the call, argument and answer that decide each reward are known.

A prompt asks ``first A last B``: look up entity A first and entity B last (any calls in between), then answer
with B's value. The policy writes one turn at a time, ``call X ;`` or ``answer V <eos>``; after each call the
environment writes ``=> V ;`` (X's value in this row's table), which the rollout masks (``env_mask`` 0), as TRL
masks tool results. Rewards, each decided by one known token of one known turn:

=================  ========================================  ================================================
reward             1 when                                    relevant token (turn)
=================  ========================================  ================================================
``first_call``     the first call looks up A                 the first call's entity (turn 1)
``last_call``      the last call looks up B                  the last call's entity (the last call's turn)
``answer``         the answer is B's value                   the answer's value (the answer turn)
=================  ========================================  ================================================

Info blocks: ``first A`` and ``last B`` are spans of the prompt (``in_prompt``); the answer's is the environment's
feedback, ``note B => V ;`` (appended). The policy is a tiny Llama taught by a short supervised phase to do each
part right only part of the time, on trajectories of 2-4 calls, so RL has something to learn on every reward.
Rollouts go through TRL's ``rollout_func`` with an ``env_mask``, the path TRL offers custom environments.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..info_blocks import InfoBlock
from .task import build_policy, build_tokenizer, cached_policy, chat_prompt_ids, padded_batch

ENTITIES = ("ann", "bob", "cal", "dan", "eve", "fay", "gil", "hal")
VALUES = ("zero", "one", "two", "three", "four", "five", "six", "seven")
STRUCTURE = ("first", "last", "note", "call", "answer", "=>", ";")
REWARD_NAMES = ("first_call", "last_call", "answer")
MAX_CALLS = 4
NOTED_RATE = 0.9  # how often the supervised answer is right when the answer's note is in the prompt
MAX_TURN_TOKENS = 3  # "call X ;" or "answer V <eos>"
MAX_COMPLETION = MAX_CALLS * 6 + MAX_TURN_TOKENS


@dataclass(frozen=True)
class AgentGymSpec:
    """The agent gym's policy and supervised phase. ``sft_rate``: how often the supervised policy does each part
    right (first call, last call, answer); ``hidden_size``/``num_layers``: the tiny Llama."""

    sft_rate: float = 0.5
    sft_steps: int = 300
    hidden_size: int = 64
    num_layers: int = 2

    def key(self) -> str:
        return f"agent-r{self.sft_rate}-s{self.sft_steps}-h{self.hidden_size}-l{self.num_layers}"


def build_agent_tokenizer():
    """A word-level tokenizer over the agent gym's language, with the gym's chat template."""
    return build_tokenizer((*STRUCTURE, *ENTITIES, *VALUES))


def agent_example(rng: random.Random) -> dict:
    """One task: the two entities to look up and this row's table of values (every entity has one)."""
    first, last = rng.sample(ENTITIES, 2)
    table = dict(zip(ENTITIES, rng.choices(VALUES, k=len(ENTITIES))))
    table = " ".join(f"{e}={v}" for e, v in table.items())
    # the table rides in the message too (the chat template ignores it): a rollout_func sees only the prompts
    return {
        "prompt": [{"role": "user", "content": f"first {first} last {last}", "table": table}],
        "first": first,
        "last": last,
        "table": table,
    }


def parse_table(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split())


@dataclass(frozen=True)
class Parsed:
    """A trajectory read back from its words: the calls (entity, position of the entity word), and the answer
    (value, its position), None when the trajectory did not answer."""

    calls: tuple[tuple[str, int], ...]
    answer: tuple[str, int] | None


def parse_trajectory(words: Sequence[str]) -> Parsed:
    """Calls are ``call X ;`` followed by the environment's ``=> V ;``; the answer is ``answer V``. Anything else
    ends the reading (what follows is not a well-formed trajectory)."""
    calls, answer, i = [], None, 0
    while i < len(words):
        if words[i] == "call" and i + 2 < len(words) and words[i + 1] in ENTITIES and words[i + 2] == ";":
            calls.append((words[i + 1], i + 1))
            i += 3
            if words[i : i + 3][:1] == ["=>"]:
                i += 3
            continue
        if words[i] == "answer" and i + 1 < len(words) and words[i + 1] in VALUES:
            answer = (words[i + 1], i + 1)
        break
    return Parsed(tuple(calls), answer)


def relevant_token(name: str, parsed: Parsed) -> int | None:
    """The position of the one word that decides reward ``name`` (None when the trajectory lacks it)."""
    if name == "first_call":
        return parsed.calls[0][1] if parsed.calls else None
    if name == "last_call":
        return parsed.calls[-1][1] if parsed.calls else None
    return parsed.answer[1] if parsed.answer else None


def turn_of(position: int, parsed: Parsed) -> str:
    """Which turn a position falls in: ``first call``, ``middle calls``, ``last call`` (a single call is the first)
    or ``answer``; the environment's words count with the call they answer."""
    starts = [p - 1 for _, p in parsed.calls] + ([parsed.answer[1] - 1] if parsed.answer else [])
    index = max((i for i, s in enumerate(starts) if s <= position), default=0)
    if index == len(parsed.calls):
        return "answer"
    return "first call" if index == 0 else ("last call" if index == len(parsed.calls) - 1 else "middle calls")


def _words(completion) -> list[str]:
    text = completion if isinstance(completion, str) else completion[-1]["content"]
    return text.replace("<eos>", " ").split()


def agent_rewards() -> list[Callable]:
    def first_call(completions, first, **_):
        return [float(bool(p.calls) and p.calls[0][0] == f) for p, f in zip(map(_parse, completions), first)]

    def last_call(completions, last, **_):
        return [float(bool(p.calls) and p.calls[-1][0] == b) for p, b in zip(map(_parse, completions), last)]

    def answer(completions, last, table, **_):
        parsed = map(_parse, completions)
        return [
            float(p.answer is not None and p.answer[0] == parse_table(t)[b]) for p, b, t in zip(parsed, last, table)
        ]

    return [first_call, last_call, answer]


def _parse(completion) -> Parsed:
    return parse_trajectory(_words(completion))


def agent_blocks() -> list[Callable]:
    def first_block(*, row, **_):
        return InfoBlock(f"first {row['first']}", placement="in_prompt")

    def last_block(*, row, **_):
        return InfoBlock(f"last {row['last']}", placement="in_prompt")

    def answer_block(*, row, **_):  # the environment's feedback for B: what the answer's verifier checks against
        return f"note {row['last']} => {parse_table(row['table'])[row['last']]} ;"

    return [first_block, last_block, answer_block]


def supervised_trajectory(rng: random.Random, row: dict, rate: float, noted: bool) -> list[str]:
    """A trajectory of 2-4 calls that does each part right with probability ``rate`` (else a random choice); the
    answer is right more often (``NOTED_RATE``) when the prompt carries the answer's note."""
    table = parse_table(row["table"])
    pick = lambda right: right if rng.random() < rate else rng.choice(ENTITIES)  # noqa: E731
    calls = [pick(row["first"])] + [rng.choice(ENTITIES) for _ in range(rng.randint(0, 2))] + [pick(row["last"])]
    words = [w for entity in calls for w in ("call", entity, ";", "=>", table[entity], ";")]
    value = table[row["last"]] if noted and rng.random() < NOTED_RATE else None
    value = value or (table[calls[-1]] if rng.random() < rate else rng.choice(VALUES))
    return words + ["answer", value, "<eos>"]


def supervised_agent_policy(spec: AgentGymSpec, seed: int, cache_dir: str | Path | None = None, batch_size: int = 64):
    """``(policy, tokenizer)`` after the supervised phase (environment words are context: no loss on them), trained
    once per (spec, seed) and cached in ``cache_dir``."""
    tokenizer = build_agent_tokenizer()

    def train():
        model = build_policy(tokenizer, spec, seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        rng = random.Random(f"agent-sft-{seed}")
        model.train()
        for _ in range(spec.sft_steps):
            sequences, labels = [], []
            for _ in range(batch_size):
                row = agent_example(rng)
                noted = rng.random() < 0.5  # the answer's note half the time, so that the policy learns to read it
                messages = row["prompt"]
                if noted:
                    messages = [{"role": "user", "content": f"{messages[0]['content']} {agent_blocks()[2](row=row)}"}]
                prompt = chat_prompt_ids(tokenizer, messages)
                words = supervised_trajectory(rng, row, spec.sft_rate, noted)
                ids = tokenizer.convert_tokens_to_ids(words)
                sequences.append(prompt + ids)
                labels.append([-100] * len(prompt) + [t if m else -100 for t, m in zip(ids, env_mask_of(words))])
            batch, target = padded_batch(sequences, labels, tokenizer.pad_token_id)
            attention = (batch != tokenizer.pad_token_id).long()
            model(input_ids=batch, attention_mask=attention, labels=target).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return model

    return cached_policy(cache_dir, f"sft-{spec.key()}-seed{seed}", train), tokenizer


def env_mask_of(words: Sequence[str]) -> list[int]:
    """0 on what the environment wrote (``=> V ;`` after each call), 1 on the model's words."""
    mask, i = [], 0
    while i < len(words):
        if words[i] == "=>":
            mask += [0] * len(words[i : i + 3])
            i += 3
        else:
            mask.append(1)
            i += 1
    return mask


@torch.no_grad()
def sample_trajectories(model, tokenizer, prompts: list[list[dict]], temperature: float) -> dict:
    """Each prompt's trajectory sampled turn by turn from ``model``, the environment (the table carried in the
    prompt's message) answering each well-formed call. Returns what a ``rollout_func`` returns: ``prompt_ids``,
    ``completion_ids``, ``logprobs`` (None) and the ``env_mask``. A trajectory ends at its answer, at a malformed
    turn, or after ``MAX_CALLS + 1`` turns."""
    stops = tokenizer.convert_tokens_to_ids([";", "<eos>"])
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    tables = [parse_table(p[-1]["table"]) for p in prompts]
    completions = [[] for _ in prompts]
    masks = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _ in range(MAX_CALLS + 1):
        if not active:
            break
        sequences = [prompt_ids[i] + completions[i] for i in active]
        width = max(map(len, sequences))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
        starts = torch.tensor([width - len(s) for s in sequences])
        sampled = model.generate(
            ids,
            attention_mask=(torch.arange(width)[None] >= starts[:, None]).long(),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_TURN_TOKENS,
            eos_token_id=stops,
            pad_token_id=pad,
        )[:, width:].tolist()
        still = []
        for i, turn in zip(active, sampled):
            turn = turn[: next((n + 1 for n, t in enumerate(turn) if t in stops), len(turn))]
            words = tokenizer.convert_ids_to_tokens(turn)
            completions[i] += turn
            masks[i] += [1] * len(turn)
            if words[:1] == ["call"] and len(words) == 3 and words[1] in ENTITIES and words[2] == ";":
                completions[i] += tokenizer.convert_tokens_to_ids(["=>", tables[i][words[1]], ";"])
                masks[i] += [0, 0, 0]
                still.append(i)
        active = still
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None, "env_mask": masks}


def agent_rollout(tokenizer) -> Callable:
    """TRL's ``rollout_func``: :func:`sample_trajectories` with the trainer's policy at its temperature."""

    def rollout(prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        return sample_trajectories(model, tokenizer, prompts, trainer.temperature)

    return rollout


def agent_dataset(num_prompts: int, seed: int):
    """``num_prompts`` tasks drawn from ``seed`` (identical for every method run with that seed)."""
    from datasets import Dataset

    rng = random.Random(f"agent-prompts-{seed}")
    return Dataset.from_list([agent_example(rng) for _ in range(num_prompts)])


@dataclass(frozen=True)
class AgentRunSettings:
    """One RL run's settings on the agent gym (everything else is ``MRTPOConfig``'s default). ``mrtpo`` runs the
    published rule unless ``reward_strength`` (per-reward strength at its frozen floor, MRTPO's default credit)."""

    method: str
    steps: int = 60
    prompts_per_step: int = 8
    num_generations: int = 4
    learning_rate: float = 1e-3
    temperature: float = 1.0
    reward_strength: bool = False


def train_agent_run(
    spec: AgentGymSpec, settings: AgentRunSettings, seed: int, cache_dir: str | Path, output_dir: str | Path
) -> list[dict]:
    """One RL run of ``MRTPOTrainer`` (``gdpo`` or ``mrtpo``) from the seed's supervised policy, rollouts through
    ``rollout_func``; one record per step: each reward's mean and their mean."""
    from transformers import set_seed

    from ..config import MRTPOConfig
    from ..research.config import arm_settings
    from ..trainer import MRTPOTrainer
    from .runs import QUIET_RUN

    class Recording(MRTPOTrainer):
        def record_rewards(self, inputs, rewards):
            self.scored.append(rewards.detach().cpu().clone())

    model, tokenizer = supervised_agent_policy(spec, seed, cache_dir)
    config = MRTPOConfig(
        output_dir=str(output_dir),
        credit_assignment=settings.method,
        max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations,
        max_completion_length=MAX_COMPLETION,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        temperature=settings.temperature,
        seed=seed,
        use_cpu=True,
        bf16=False,
        **QUIET_RUN,
        info_block_separator=" ",
        **arm_settings({"reward_strength": settings.reward_strength}),
    )
    set_seed(seed)
    trainer = Recording(
        model=model,
        reward_funcs=agent_rewards(),
        info_blocks=agent_blocks(),
        args=config,
        train_dataset=agent_dataset(settings.steps * settings.prompts_per_step, seed),
        processing_class=tokenizer,
        rollout_func=agent_rollout(tokenizer),
    )
    trainer.scored = []
    trainer.train()
    return [
        {
            "step": step,
            "mean_reward": r.mean().item(),
            **{n: r[:, k].mean().item() for k, n in enumerate(REWARD_NAMES)},
        }
        for step, r in enumerate(trainer.scored)
    ]


def agent_localisation(spec: AgentGymSpec, seed: int, cache_dir: str | Path, num_prompts: int = 32) -> list[dict]:
    """Where the supervised policy's q lands on its own trajectories, against the truth, per reward and per turn.

    For each trajectory and reward whose deciding word exists: the mass ratio of q on that word (share of q mass
    over share of the model's tokens; 1 = no localisation), the same ratio for the q of another reward (the
    control), and the share of the reward's q mass in each turn (``call 1`` ... ``answer``) beside the turn the
    truth is in.
    """
    from ..info_blocks import build_contexts
    from ..replay import replay_relevance
    from .runs import mass_ratio

    model, tokenizer = supervised_agent_policy(spec, seed, cache_dir)
    rows = agent_dataset(num_prompts, seed + 1_000_000).to_list()  # prompts no run trains on
    torch.manual_seed(seed)
    prompts = [row["prompt"] for row in rows for _ in range(4)]
    sampled = sample_trajectories(model, tokenizer, prompts, temperature=1.0)
    blocks = agent_blocks()
    contexts, completions, owners = [], [], []
    for i, (ids, mask) in enumerate(zip(sampled["completion_ids"], sampled["env_mask"])):
        row = rows[i // 4]
        info = [block(row=row) for block in blocks]
        info = [b if isinstance(b, InfoBlock) else InfoBlock(b) for b in info]
        p_all, removed = build_contexts(row["prompt"], info, [[k] for k in range(len(info))], " ")
        contexts.append([chat_prompt_ids(tokenizer, p) for p in (p_all, *removed)])
        completions.append(ids)
        owners.append(mask)
    q = replay_relevance(model, contexts, completions, temperature=1.0, batch_size=64, min_shared_prefix=4)
    records = []
    for profiles, ids, mask in zip(q, completions, owners):
        words = tokenizer.convert_ids_to_tokens(ids)
        parsed = parse_trajectory(words)
        own = [t for t, m in enumerate(mask) if m]
        for k, name in enumerate(REWARD_NAMES):
            position = relevant_token(name, parsed)
            if position is None or len(own) < 2:
                continue
            profile = profiles[k][own]
            at = own.index(position)
            control = profiles[(k + 1) % len(REWARD_NAMES)][own]
            turns: dict[str, float] = {}
            total = profile.sum().item()
            for t, value in zip(own, profile.tolist()):
                turn = turn_of(t, parsed)
                turns[turn] = turns.get(turn, 0.0) + (value / total if total > 0 else float("nan"))
            records.append(
                {
                    "seed": seed,
                    "reward": name,
                    "calls": len(parsed.calls),
                    "truth_turn": turn_of(position, parsed),
                    "ratio": mass_ratio(profile, [at]),
                    "control": mass_ratio(control, [at]),
                    **{f"share/{turn}": value for turn, value in turns.items()},
                }
            )
    return records


def supervised_trajectories(work_dir: str | Path, num_prompts: int = 8, generations: int = 4) -> tuple:
    """``(policy folder, rows, trajectories file, words)``: the supervised policy (seed 0) saved in ``work_dir`` and
    ``generations`` trajectories it samples for each of ``num_prompts`` prompts, written as the completions file
    ``inspect_credit`` replays (``words`` per trajectory): where ``inspect``'s verdicts are checked against the
    deciding words (docs/inspect.md)."""
    import json

    work_dir = Path(work_dir)
    torch.manual_seed(0)
    model, tokenizer = supervised_agent_policy(AgentGymSpec(), 0, work_dir / "cache")
    model.save_pretrained(work_dir / "policy")
    tokenizer.save_pretrained(work_dir / "policy")
    rows = agent_dataset(num_prompts, 5).to_list()
    prompts = [row["prompt"] for row in rows for _ in range(generations)]
    sampled = sample_trajectories(model, tokenizer, prompts, 1.0)
    words = [tokenizer.convert_ids_to_tokens(ids) for ids in sampled["completion_ids"]]
    lines = [{**rows[i // generations], "completion": " ".join(w)} for i, w in enumerate(words)]
    path = work_dir / "trajectories.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return str(work_dir / "policy"), rows, str(path), [line["completion"].split() for line in lines]


def deciding_word_peaks(record, words: Sequence[Sequence[str]]) -> dict[str, tuple[int, int]]:
    """Per reward: in how many replayed trajectories that have its deciding word its q peaks there (over the model's
    words), of how many."""
    peaks = {}
    for k, name in enumerate(REWARD_NAMES):
        hits = total = 0
        for j, trajectory_words in enumerate(words):
            position = relevant_token(name, parse_trajectory(trajectory_words))
            if position is None or not record.replayed[j, k]:
                continue
            own = [t for t, m in enumerate(env_mask_of(trajectory_words)) if m]  # the fixed replay has no mask
            total += 1
            hits += int(own[record.relevance[j, k, own].argmax().item()] == position)
        peaks[name] = (hits, total)
    return peaks
