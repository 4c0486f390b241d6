"""Credit gym: a synthetic multi-constraint task where the tokens each reward depends on are known.

A prompt lists ``K`` constraints on a response of ``length`` words drawn from a small vocabulary; one 0/1 reward
per constraint. Because the language is built in code, every (response, reward) pair has a ground truth: the
positions whose word, changed alone, can flip the reward (:func:`relevant_positions`). That is what lets the gym
check where MRTPO's q lands and whether landing there makes learning faster than uniform credit.

Constraint kinds, chosen so their relevant positions differ:

========  ===================  ==============================================
kind      prompt text          relevant positions
========  ===================  ==============================================
first     ``first red``        position-bound: the first word
last      ``last red``         position-bound: the last word
has       ``has red``          free: where ``red`` stands (or every word)
pair      ``red before cat``   spans several tokens: an ordered pair
twice     ``twice red``        spans several tokens: a count
========  ===================  ==============================================

Variants make the task closer to a real model's (:data:`VARIANTS`): responses of varying length that end when the
policy emits its end token (``last`` is then the last word before the end, wherever that falls); filler drawn from
a distribution that depends on the prompt's key words (removing any constraint then shifts every filler position:
a background that is not specific to one reward); key words that also appear as stray filler, with constraints
stated only rarely met (the policy then meets a constraint only slightly more often when it is stated).

Info blocks are either each constraint's own span of the prompt (``in_prompt``, as in instruction following) or
a ``note`` restating it, appended only in the replay (``appended``, as with a rule text or a reference answer).
The policy is a tiny Llama taught by a short supervised phase to satisfy each constraint only part of the time
(and more often when it is noted), so it conditions on the constraints but has much to learn.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..info_blocks import InfoBlock

KEY_WORDS = (
    "red", "blue", "green", "gold", "pink", "gray", "black", "white",
    "cat", "dog", "fox", "owl", "bee", "cow", "elk", "ant",
    "sun", "moon", "star", "rain", "snow", "wind", "fog", "ice",
)  # fmt: skip
FILLER_WORDS = (
    "tree", "leaf", "rock", "sand", "lake", "hill", "cave", "reef",
    "road", "door", "wall", "roof", "boat", "ship", "cart", "bell",
)  # fmt: skip
CONTENT_WORDS = KEY_WORDS + FILLER_WORDS
KINDS = ("first", "last", "has", "pair", "twice")
PLACEMENTS = ("in_prompt", "appended")
SPECIAL_TOKENS = ("<pad>", "<eos>", "<user>", "<assistant>")
STRUCTURE_WORDS = ("first", "last", "has", "before", "twice", "note", ";")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@dataclass(frozen=True)
class Constraint:
    """One checkable constraint on a response's words."""

    kind: str
    word: str
    other: str = ""  # the second word of a ``pair``

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        if (self.kind == "pair") != bool(self.other):
            raise ValueError(f"a {self.kind!r} constraint takes {'two words' if self.kind == 'pair' else 'one word'}")

    @property
    def text(self) -> str:
        """How the prompt states it."""
        if self.kind == "pair":
            return f"{self.word} before {self.other}"
        return f"{self.kind} {self.word}"

    @property
    def span(self) -> str:
        """The constraint's span of the prompt (its in-prompt info block)."""
        return f"{self.text} ;"

    def satisfied(self, words: Sequence[str]) -> bool:
        if not words:
            return False
        if self.kind == "first":
            return words[0] == self.word
        if self.kind == "last":
            return words[-1] == self.word
        if self.kind == "has":
            return self.word in words
        if self.kind == "twice":
            return sum(w == self.word for w in words) == 2
        first_a = next((i for i, w in enumerate(words) if w == self.word), None)
        return first_a is not None and self.other in words[first_a + 1 :]


def relevant_positions(constraint: Constraint, words: Sequence[str]) -> list[int]:
    """Ground truth: the positions where replacing the word alone (by any vocabulary word) flips the reward."""
    before = constraint.satisfied(words)
    relevant = []
    for t in range(len(words)):
        edited = list(words)
        for replacement in CONTENT_WORDS:
            if replacement == words[t]:
                continue
            edited[t] = replacement
            if constraint.satisfied(edited) != before:
                relevant.append(t)
                break
    return relevant


def sample_constraints(rng: random.Random, num_constraints: int) -> list[Constraint]:
    """``K`` compatible constraints on distinct words: at most one ``first`` and one ``last``; kinds are balanced
    (the pool is every kind in turn, the position-bound ones once)."""
    if not 1 <= num_constraints <= 12:
        raise ValueError(f"the gym supports 1 to 12 constraints per prompt, got {num_constraints}")
    pool = ["first", "last"] + [("has", "pair", "twice")[i % 3] for i in range(num_constraints)]
    kinds = rng.sample(pool, num_constraints)
    words = rng.sample(KEY_WORDS, num_constraints + kinds.count("pair"))
    out = []
    for kind in kinds:
        other = words.pop() if kind == "pair" else ""
        out.append(Constraint(kind, words.pop(), other))
    return out


def parse_constraints(text: str) -> list[Constraint]:
    """The constraints a prompt's text states (inverse of :func:`prompt_text`; notes are ignored)."""
    out = []
    for part in text.split(";"):
        tokens = part.split()
        if not tokens or tokens[0] == "note":
            continue
        if len(tokens) == 3 and tokens[1] == "before":
            out.append(Constraint("pair", tokens[0], tokens[2]))
        elif len(tokens) == 2:
            out.append(Constraint(tokens[0], tokens[1]))
        else:
            raise ValueError(f"cannot read a constraint from {part.strip()!r}")
    return out


def prompt_text(constraints: Sequence[Constraint]) -> str:
    return " ".join(c.span for c in constraints)


def note_text(constraint: Constraint) -> str:
    """The appended info block of a constraint."""
    return f"note {constraint.text} ;"


def build_tokenizer(words: Sequence[str] = (*STRUCTURE_WORDS, *CONTENT_WORDS)):
    """A word-level tokenizer over the gym's language (or another list of ``words``), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *words))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        additional_special_tokens=["<user>", "<assistant>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the generation prompt, as TRL builds them."""
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def response_words(text: str) -> list[str]:
    """A completion's words (anything after an end token is not part of it)."""
    return text.split("<eos>")[0].split()


def topic(word: str) -> tuple[str, ...]:
    """The four filler words a key word makes likely (topical filler): a fixed, overlapping share of the fillers."""
    i = KEY_WORDS.index(word)
    return tuple(FILLER_WORDS[(5 * i + j) % len(FILLER_WORDS)] for j in range(4))


def filler_pool(constraints: Sequence[Constraint]) -> tuple[str, ...]:
    """The filler words a prompt makes likely: the topics of its constraints' first words."""
    return tuple(dict.fromkeys(w for c in constraints for w in topic(c.word)))


@dataclass(frozen=True)
class GymSpec:
    """What defines one gym task and its supervised policy."""

    num_constraints: int = 3
    length: int = 8  # words per response (the most, when ``min_length`` is set)
    min_length: int = 0  # > 0: responses have min_length..length words and end when the policy emits its end token
    topical_filler: float = 0.0  # share of filler words drawn from the prompt's topics (:func:`filler_pool`)
    stray_rate: float = 0.0  # share of filler positions holding a random key word instead
    placement: str = "in_prompt"
    hidden_size: int = 64
    num_layers: int = 2
    # Share of supervised responses meeting a stated constraint, per kind (KINDS order): the two-word kinds are
    # harder for the tiny policy, so they are shown more often to start RL near the others.
    sft_rates: tuple[float, ...] = (0.25, 0.25, 0.25, 0.5, 0.5)
    sft_noted_rate: float = 0.75  # ... for a constraint that is also noted (appended placement)
    sft_teach_steps: int = 800  # supervised steps at high rates: the policy learns what each constraint asks
    sft_calibrate_steps: int = 300  # ... then at sft_rates: it meets them only part of the time

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.length < 3:
            raise ValueError(f"responses need at least 3 words, got length={self.length}")
        if self.min_length and not 3 <= self.min_length <= self.length:
            raise ValueError(f"min_length must be 0 (fixed length) or in [3, length], got {self.min_length}")
        for name in ("topical_filler", "stray_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def identity(self) -> dict:
        """The fields that define the task: the variant fields only where set, so the default task keeps the key
        (and the cached policies and runs) it had before variants existed."""
        fields = asdict(self)
        for name, default in VARIANT_DEFAULTS.items():
            if fields[name] == default:
                del fields[name]
        return fields

    def key(self) -> str:
        return hashlib.sha1(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:10]

    def response_length(self, rng: random.Random) -> int:
        return rng.randint(self.min_length, self.length) if self.min_length else self.length


VARIANT_DEFAULTS = {"min_length": 0, "topical_filler": 0.0, "stray_rate": 0.0}
VARIANTS: dict[str, dict] = {
    "default": {},
    "variable_length": {"min_length": 4, "length": 10},
    "topical_filler": {"topical_filler": 0.8},
    "weak": {"stray_rate": 0.5, "sft_rates": (0.15, 0.15, 0.15, 0.3, 0.3)},
}
VARIANTS["realistic"] = {**VARIANTS["variable_length"], **VARIANTS["topical_filler"], **VARIANTS["weak"]}


def variant_spec(variant: str, **fields) -> GymSpec:
    """The gym task of a named variant (:data:`VARIANTS`), with any other field changed."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown gym variant {variant!r}; variants are {', '.join(VARIANTS)}")
    return GymSpec(**{**VARIANTS[variant], **fields})


def supervised_response(
    rng: random.Random,
    constraints: Sequence[Constraint],
    length: int,
    rates: Sequence[float],
    topical_filler: float = 0.0,
    stray_rate: float = 0.0,
) -> list[str]:
    """A response that meets constraint i with probability ``rates[i]`` (where the positions allow). The other
    words are filler: a share ``topical_filler`` from the prompt's topics, and with ``stray_rate`` a random key
    word (with both at 0, key words appear only where a constraint placed them)."""
    pool = filler_pool(constraints) if topical_filler else FILLER_WORDS
    words = [_filler_word(rng, pool, topical_filler, stray_rate) for _ in range(length)]
    free = list(range(1, length - 1))  # middle positions not yet claimed
    rng.shuffle(free)
    for constraint, rate in zip(constraints, rates):
        if rng.random() >= rate:
            continue
        if constraint.kind == "first":
            words[0] = constraint.word
        elif constraint.kind == "last":
            words[-1] = constraint.word
        elif constraint.kind == "has" and free:
            words[free.pop()] = constraint.word
        elif constraint.kind in ("twice", "pair") and len(free) >= 2:
            a, b = sorted((free.pop(), free.pop()))
            words[a] = constraint.word
            words[b] = constraint.other or constraint.word
    return words


def _filler_word(rng: random.Random, pool: Sequence[str], topical: float, stray_rate: float) -> str:
    # Random draws only for the variants that are on, so the default task's stream of draws is unchanged.
    if stray_rate and rng.random() < stray_rate:
        return rng.choice(KEY_WORDS)
    if topical and rng.random() < topical:
        return rng.choice(pool)
    return rng.choice(FILLER_WORDS)


def build_policy(tokenizer, spec: GymSpec, seed: int):
    """A tiny Llama-style causal LM over the gym's vocabulary (``spec``: anything with ``hidden_size`` and
    ``num_layers``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def gym_example(rng: random.Random, spec: GymSpec) -> dict:
    """One prompt: its conversational prompt and its constraints (as the dataset row the rewards read)."""
    constraints = sample_constraints(rng, spec.num_constraints)
    return {
        "prompt": [{"role": "user", "content": prompt_text(constraints)}],
        "constraints": [[c.kind, c.word, c.other] for c in constraints],
    }


def row_constraints(row_value: Sequence[Sequence[str]]) -> list[Constraint]:
    return [Constraint(*item) for item in row_value]


def _sft_batch(rng: random.Random, spec: GymSpec, tokenizer, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + response token ids with labels on the response only (-100 elsewhere)."""
    sequences, labels = [], []
    for _ in range(size):
        example = gym_example(rng, spec)
        constraints = row_constraints(example["constraints"])
        messages = example["prompt"]
        rates = [spec.sft_rates[KINDS.index(c.kind)] for c in constraints]
        if spec.placement == "appended":  # each constraint noted half the time, and then met more often
            noted = [rng.random() < 0.5 for _ in constraints]
            rates = [max(spec.sft_noted_rate, r) if n else r for n, r in zip(noted, rates)]
            notes = [note_text(c) for c, n in zip(constraints, noted) if n]
            if notes:
                messages = [{"role": "user", "content": messages[0]["content"] + " " + " ".join(notes)}]
        prompt_ids = chat_prompt_ids(tokenizer, messages)
        length = spec.response_length(rng)
        words = supervised_response(rng, constraints, length, rates, spec.topical_filler, spec.stray_rate)
        response_ids = tokenizer.convert_tokens_to_ids(words) + [tokenizer.eos_token_id]
        sequences.append(list(prompt_ids) + response_ids)
        labels.append([-100] * len(prompt_ids) + response_ids)
    return padded_batch(sequences, labels, tokenizer.pad_token_id)


def padded_batch(
    sequences: list[list[int]], labels: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels right-padded to the longest sequence (ids with ``pad_id``, labels with -100)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id)
    target = torch.full((len(sequences), width), -100)
    for i, (s, y) in enumerate(zip(sequences, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        target[i, : len(y)] = torch.tensor(y)
    return ids, target


def cached_policy(cache_dir: str | Path | None, name: str, train: Callable[[], torch.nn.Module], device: str = "cpu"):
    """The policy ``train()`` returns, trained once per ``name`` and cached in ``cache_dir`` (None: not cached), in
    eval mode. Written beside and renamed: an interrupted save never looks like a cached policy."""
    from transformers import LlamaForCausalLM

    folder = Path(cache_dir) / name if cache_dir is not None else None
    if folder is not None and (folder / "config.json").exists():
        return LlamaForCausalLM.from_pretrained(folder).to(device).eval()
    model = train().eval()
    if folder is not None:  # renamed into place: processes that train the same policy at once keep the first
        from ..outputs import build_folder

        build_folder(folder, model.save_pretrained, lambda built: (built / "config.json").exists())
    return model


def supervised_policy(
    spec: GymSpec, seed: int, cache_dir: str | Path | None = None, batch_size: int = 64, device: str = "cpu"
):
    """``(policy, tokenizer)`` after the supervised phase, trained once per (spec, seed) and cached in ``cache_dir``.

    Two stages: at high rates (0.9, noted 0.95) the policy learns what each constraint asks, which it would not
    from rare examples alone; then at ``spec.sft_rates`` it learns to meet them only part of the time.
    """
    tokenizer = build_tokenizer()

    def train():
        model = build_policy(tokenizer, spec, seed).to(device)
        rng = random.Random(f"sft-{seed}")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        teach = replace(spec, sft_rates=(0.9,) * len(KINDS), sft_noted_rate=0.95)
        model.train()
        for stage, steps, lr in ((teach, spec.sft_teach_steps, 3e-3), (spec, spec.sft_calibrate_steps, 1e-3)):
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(steps):
                ids, labels = (t.to(device) for t in _sft_batch(rng, stage, tokenizer, batch_size))
                attention = (ids != tokenizer.pad_token_id).long()
                model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        return model

    return cached_policy(cache_dir, f"sft-{spec.key()}-seed{seed}", train, device), tokenizer


def constraint_rewards(num_constraints: int) -> list[Callable]:
    """One 0/1 reward per constraint slot, named ``constraint_<i>``; each reads the row's ``constraints``."""

    def make(slot: int):
        def reward(completions, constraints, **kwargs) -> list[float]:
            out = []
            for completion, row in zip(completions, constraints):
                text = completion[-1]["content"] if isinstance(completion, list) else completion
                out.append(float(Constraint(*row[slot]).satisfied(response_words(text))))
            return out

        reward.__name__ = f"constraint_{slot}"
        return reward

    return [make(i) for i in range(num_constraints)]


def constraint_blocks(num_constraints: int, placement: str) -> list[Callable]:
    """One info block builder per constraint slot: its span of the prompt, or its appended note."""

    def make(slot: int):
        def block(*, row, **kwargs) -> InfoBlock:
            constraint = Constraint(*row["constraints"][slot])
            if placement == "in_prompt":
                return InfoBlock(constraint.span, placement="in_prompt")
            return InfoBlock(note_text(constraint))

        return block

    return [make(i) for i in range(num_constraints)]


def prefix_feasible(constraint: Constraint, prefix: Sequence[str], length: int) -> bool:
    """Whether a response that starts with ``prefix`` can still meet ``constraint`` when it may run to ``length``
    words (more room never hurts any kind, so the longest response decides)."""
    room = max(length - len(prefix), 0)
    word = constraint.word
    if constraint.kind == "first":
        return not prefix or prefix[0] == word
    if constraint.kind == "last":
        return room > 0 or (bool(prefix) and prefix[-1] == word)
    if constraint.kind == "has":
        return word in prefix or room > 0
    if constraint.kind == "twice":
        count = sum(w == word for w in prefix)
        return count <= 2 and count + room >= 2
    first_a = next((i for i, w in enumerate(prefix) if w == word), None)
    if first_a is None:
        return room >= 2
    return constraint.other in prefix[first_a + 1 :] or room > 0


def word_spans(text: str) -> list[tuple[int, int]]:
    """The ``[start, end)`` character spans of a completion's words (:func:`response_words`): one step each."""
    spans, cursor = [], 0
    for word in response_words(text):
        start = text.index(word, cursor)
        spans.append((start, start + len(word)))
        cursor = start + len(word)
    return spans


def oracle_process_reward(length: int) -> Callable:
    """A process reward that knows the task (the gym's oracle PRM): each word is a step, scored 1 while the
    response so far can still meet every constraint of its prompt within ``length`` words, else 0."""

    def oracle_prm(completions, constraints, **kwargs) -> list[list[tuple[int, int, float]]]:
        out = []
        for completion, row in zip(completions, constraints):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            owned, words = row_constraints(row), response_words(text)
            out.append(
                [
                    (start, end, float(all(prefix_feasible(c, words[: t + 1], length) for c in owned)))
                    for t, (start, end) in enumerate(word_spans(text))
                ]
            )
        return out

    return oracle_prm


def all_constraints_met(prompt, completion: str, row: dict) -> bool:
    """The gym's outcome verifier (Math-Shepherd's check of a finished response): every constraint is met."""
    words = response_words(completion)
    return all(c.satisfied(words) for c in row_constraints(row["constraints"]))


def constraint_failure_boundaries(num_constraints: int) -> list[Callable]:
    """One failure-boundary builder per constraint slot: for a failing response, the end of the last word that,
    changed alone, would make it pass (the last relevant position); None when the response passes."""

    def make(slot: int):
        def boundary(*, completion, row, score, **kwargs) -> int | None:
            if score >= 1.0:
                return None
            positions = relevant_positions(Constraint(*row["constraints"][slot]), response_words(completion))
            return word_spans(completion)[max(positions)][1] if positions else None

        return boundary

    return [make(i) for i in range(num_constraints)]
