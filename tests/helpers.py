"""Helpers shared by the test modules: a trainer that records what the loss and the replay saw, the tiny-run
configuration, rewards with known orderings, and a time limit."""

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo.credit import TokenCredit, replayed_token_weights, token_weights, weighted_token_advantages
from trl_mrtpo.diagnostics import CreditRecord
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.research import ResearchConfig, ResearchTrainer, needs_research
from trl_mrtpo.research.credit import preserved_token_advantages


def token_advantages(
    advantages,
    relevance,
    replayed,
    mask,
    reward_weights,
    beta,
    max_second_moment_ratio=2.0,
    reduce_sum=None,
    process=None,
    failure_suffix=None,
    combine=weighted_token_advantages,
) -> TokenCredit:
    """Steps 5-8 as the ``mrtpo`` rule computes them: step 5's weights on the replayed pairs
    (:func:`~trl_mrtpo.credit.replayed_token_weights`), then steps 6-8 (``combine``)."""
    weights = replayed_token_weights(relevance, replayed, mask, beta)
    return combine(
        advantages, weights, mask, reward_weights, max_second_moment_ratio, reduce_sum, process, failure_suffix
    )


def token_advantages_preserving_totals(*args, **kwargs) -> TokenCredit:
    """:func:`token_advantages` with every reward's GDPO total kept (the research room's preserved totals)."""
    return token_advantages(*args, combine=preserved_token_advantages, **kwargs)


class Recording:
    """Keeps what the loss receives, what the replay produced, and every generation's credit record (rewards, q,
    replayed pairs, advantages)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches, self.replays, self.credits = [], [], []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.batches.append({k: v for k, v in output.items() if isinstance(v, torch.Tensor)})
        self.credits.append(self.last_credit)
        return output

    def _replay(self, batch):
        relevance, replayed = super()._replay(batch)
        self.replays.append(
            {"prompts": batch.prompts, "relevance": relevance, "replayed": replayed, "output": batch.output}
        )
        return relevance, replayed


class RecordingTrainer(Recording, MRTPOTrainer):
    pass


class ResearchRecordingTrainer(Recording, ResearchTrainer):
    pass


def recording_trainer(**kwargs) -> Recording:
    """A recording MRTPOTrainer, or a recording ResearchTrainer for a ResearchConfig."""
    research = isinstance(kwargs["args"], ResearchConfig)
    return (ResearchRecordingTrainer if research else RecordingTrainer)(**kwargs)


def make_args(tmp_path, research: bool | None = None, **overrides):
    """The tiny runs' configuration; a ResearchConfig when ``research`` (default: when ``overrides`` need one)."""
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=10,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        credit_warmup_steps=0,
        replay_only_varying=False,
        # The tiny random model's q profiles of different rewards look alike (1 - cos ~ 0.005): the default
        # per-reward strength would rest every reward after the first step. Tests of the replay's plumbing use the
        # published rule; tests/test_strength.py and the exactness tests set a floor.
        reward_strength_floor=None,
        seed=0,
    )
    values.update(overrides)
    research = needs_research(overrides) if research is None else research
    return (ResearchConfig if research else MRTPOConfig)(**values)


def train(
    tiny_model, tiny_tokenizer, tmp_path, rewards=BASIC.rewards, blocks=BASIC.info_blocks, dataset=None, **overrides
):
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=rewards,
        info_blocks=blocks,
        args=make_args(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    return trainer


def graded_length(completions, **_):
    """A fractional primary reward, so that CONCUR-A takes concordance readings (binary primaries give none)."""
    return [min(len(c if isinstance(c, str) else c[-1]["content"]) % 7 / 6, 1.0) for c in completions]


def graded_length_too(completions, **_):
    """An auxiliary reward that always orders responses like the primary: CONCUR-A comes to trust it."""
    return graded_length(completions)


class CharTokenizer:
    """Each id is a character code: token strings are exact, so spans map to tokens exactly."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def record_for(text, q_reward, q_control, advantage=1.0):
    length = len(text)
    ids = torch.tensor([[ord(c) for c in text]])
    relevance = torch.stack([torch.tensor(q_reward), torch.zeros(length), torch.tensor(q_control)])[None]
    weights = token_weights(relevance, torch.ones(1, 1, length), beta=0.5)
    weights[:, 1] = 1.0  # keyword reward not replayed: uniform
    return CreditRecord(
        prompts=[[{"role": "user", "content": "Say hi. End with OK."}]],
        completions=[text],
        completion_ids=ids,
        mask=torch.ones(1, length, dtype=torch.long),
        rewards=torch.tensor([[1.0, 0.0, 0.0]]),
        group_advantages=torch.tensor([[advantage, 0.0, 0.0]]),
        relevance=relevance,
        replayed=torch.tensor([[True, False, True]]),
        weights=weights,
        advantages=advantage * weights[:, 0],
        beta=0.5,
        reward_betas=torch.full((3,), 0.5),
    )


def word_steps(completions, **_):
    """A process reward for the CLI tests: each word a step, scored by its length parity."""
    import re

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [[(m.start(), m.end(), float(len(m.group()) % 2)) for m in re.finditer(r"\S+", t)] for t in texts]


def build_prm(tokenizer, folder, seed=0):
    """A tiny token-classification PRM (2 labels) saved with its tokenizer: loadable by path like a Hub one."""
    from transformers import LlamaForTokenClassification

    from tests.conftest import tiny_llama_config

    torch.manual_seed(seed)
    config = tiny_llama_config(tokenizer, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_labels=2)
    LlamaForTokenClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def merge_record(trainer, credit: CreditRecord) -> dict:
    """What one process saves of a generation's credit for :func:`check_merged_advantages`."""
    return {
        "group_advantages": credit.group_advantages,
        "relevance": credit.relevance,
        "replayed": credit.replayed,
        "mask": credit.mask,
        "advantages": credit.advantages,
        "beta": credit.reward_betas,
        "reward_weights": trainer.reward_weights,
        "rho": trainer.args.max_second_moment_ratio,
    }


def check_merged_advantages(parts: list[dict]) -> None:
    """Each process's token advantages (``parts``: what each rank recorded for one generation, in rank order) equal
    one process's on the merged batch: the cap and the means see the whole batch on every rank (with the process
    advantages and failure suffixes when the ranks recorded them)."""
    width = max(p["mask"].shape[1] for p in parts)

    def merged(key):
        tensors = [p[key] for p in parts]
        if key in ("relevance", "mask", "advantages", "process", "failure_suffix"):
            tensors = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors]
        return torch.cat(tensors)

    for part in parts[1:]:  # per-reward strength reads the whole batch: every rank uses the same betas
        torch.testing.assert_close(part["beta"], parts[0]["beta"], atol=0, rtol=0)
    single = token_advantages(
        merged("group_advantages"),
        merged("relevance"),
        merged("replayed"),
        merged("mask"),
        parts[0]["reward_weights"],
        parts[0]["beta"],
        parts[0]["rho"],
        **{key: merged(key) for key in ("process", "failure_suffix") if key in parts[0]},  # step rules, if recorded
    )
    assert merged("replayed").any()  # a real redistribution, not only the uniform part
    torch.testing.assert_close(merged("advantages"), single.advantages, atol=1e-5, rtol=1e-5)


def template_tokenizer(template: str, specials: list[str], corpus: list[str], eos: str, pad: str):
    """A byte-level BPE of a few hundred tokens trained on ``corpus``, with a family's special tokens and TRL's
    shipped chat template ``template`` (a file of ``trl/chat_templates``)."""
    from pathlib import Path

    import trl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        corpus * 4, trainers.BpeTrainer(vocab_size=500, special_tokens=specials, initial_alphabet=alphabet)
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad)
    fast.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    return fast


class DistinctProfiles:
    """A relevance provider that knows the answer: reward k's q is ``1 + peak`` on the model tokens at positions
    ``t % K == k`` and 1 elsewhere, for every pair whose reward has an info block (``has_block``). Each reward's
    profile then stands out from the others' mean by ``1 - cos`` ~0.4 (peak 3, three rewards), so the shipped floor
    (0.25) gives each reward a beta strictly between 0 and ``credit_beta``; the tiny random model's own profiles
    differ by ~0.005 and would rest every reward."""

    def __init__(self, has_block: list[bool], peak: float = 3.0):
        self.has_block, self.peak = has_block, peak

    def __call__(self, policy, record):
        from trl_mrtpo.relevance import Relevance

        blocks = torch.tensor(self.has_block)
        replayed = blocks[None, :] & record.mask.bool().any(-1, keepdim=True)
        num_rewards, width = replayed.shape[1], record.mask.shape[1]
        positions = torch.arange(width)
        peaks = (positions[None, :] % num_rewards == torch.arange(num_rewards)[:, None]).float()
        relevance = (1.0 + self.peak * peaks)[None] * record.mask[:, None, :] * replayed[..., None]
        return Relevance(relevance, replayed, bool(replayed.any()))


def observe_term(term, observe) -> None:
    """``observe(batch, contribution)`` after each call of a run's ``term``: this instance's class becomes a subclass
    whose ``__call__`` calls the term's, then ``observe`` (the trainer's guard adapter holds the instance itself)."""
    cls = type(term)

    def call(self, batch, *args):
        contribution = cls.__call__(self, batch, *args)
        observe(batch, contribution)
        return contribution

    term.__class__ = type(f"Observed{cls.__name__}", (cls,), {"__call__": call})


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """A TimeoutError after ``seconds`` (SIGALRM: the main thread, as pytest and its xdist workers run tests), so
    that a hang fails instead of blocking the suite."""

    def expired(*_):
        raise TimeoutError(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
