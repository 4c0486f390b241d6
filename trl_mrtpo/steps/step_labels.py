"""Where step scores come from: a process reward model, or Math-Shepherd's rollouts from the policy.

Both are process rewards for :class:`~trl_mrtpo.MRTPOTrainer` (its ``process_rewards`` argument): called with the
prompts and completions, they split each completion into steps at ``step_separator`` and return one
:class:`~trl_mrtpo.steps.process_rewards.Step` per step. Both also label text offline, without a trainer.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..info_blocks import Prompt
from ..replay import padded
from ..utils import completion_text, function_name
from .process_rewards import Step, step_spans, token_positions


def _prompt_text(prompt: Prompt) -> str:
    """A prompt as one string: itself, or its last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def check_separator(step_separator: Any, owner: str) -> None:
    """A step separator is non-empty text (an empty one would split nowhere, or everywhere)."""
    if not isinstance(step_separator, str) or not step_separator:
        raise ValueError(f"{owner}: step_separator must be non-empty text, got {step_separator!r}.")


def check_token_classifier(model: torch.nn.Module, positive_label: Any) -> None:
    """Refuse a PRM that is not a token-classification model with ``positive_label`` among its labels (a causal LM
    would be read as "the probability of vocabulary token ``positive_label``")."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    kind = type(base).__name__
    if not kind.endswith("ForTokenClassification"):
        raise TypeError(
            f"ProcessRewardModel needs a token-classification model (AutoModelForTokenClassification, the format of "
            f"TRL's former PRMTrainer), got {kind}."
        )
    labels = getattr(base.config, "num_labels", None)
    if not isinstance(positive_label, int) or isinstance(positive_label, bool) or not 0 <= positive_label < labels:
        raise ValueError(
            f"positive_label={positive_label!r} is not one of the PRM's {labels} labels (0-{labels - 1})."
        )


class ProcessRewardModel:
    """Step scores from a process reward model: a token-classification model that predicts, at the end of each step
    (the step's text followed by ``step_separator``), whether the step is good. The input is exactly that of TRL's
    former ``PRMTrainer`` (and common open PRMs trained with it): the BOS token when the tokenizer has one, the prompt
    tokenised without special tokens, then each step's tokens followed by the separator's; the score is the softmax
    probability of ``positive_label`` at the last token of each step's separator, where ``PRMTrainer`` put the label.

    Args:
        model: a path or Hub id (loaded with ``AutoModelForTokenClassification``), or a loaded model.
        tokenizer: the PRM's tokenizer (loaded from ``model`` when it is a path or id).
        step_separator: what ends a step, in the completion and in the PRM's input.
        positive_label: the class index meaning "good step".
        batch_size: sequences per forward.
        device: where to run; by default the policy's device once a trainer binds it, else the model's.
        name: the name the trainer logs this process reward under.
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        tokenizer=None,
        step_separator: str = "\n",
        positive_label: int = 1,
        batch_size: int = 8,
        device: str | torch.device | None = None,
        name: str = "prm",
    ):
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        if isinstance(model, str):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForTokenClassification.from_pretrained(model)
        if tokenizer is None:
            raise ValueError("ProcessRewardModel needs the PRM's tokenizer when the model is passed loaded.")
        check_token_classifier(model, positive_label)
        check_separator(step_separator, "ProcessRewardModel")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.step_separator, self.positive_label, self.batch_size = step_separator, positive_label, batch_size
        self.__name__ = name
        if device is not None:
            self.model.to(device)

    def bind(self, trainer) -> ProcessRewardModel:
        """Run on the policy's device."""
        self.model.to(trainer.accelerator.device)
        return self

    def _encode(self, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """TRL's PRM input for one (prompt, steps) pair and the position of each step's label."""
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        ids = bos + (self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else [])
        separator = self.tokenizer.encode(self.step_separator, add_special_tokens=False)
        positions = []
        for step in steps:
            ids = ids + self.tokenizer.encode(step, add_special_tokens=False) + separator
            positions.append(len(ids) - 1)
        return ids, positions

    @torch.no_grad()
    def score_steps(self, prompts: Sequence[str], steps: Sequence[Sequence[str]]) -> list[list[float]]:
        """The probability of a good step at each step of each (prompt, steps) pair, batched."""
        encoded = [self._encode(prompt, texts) for prompt, texts in zip(prompts, steps)]
        device = next(self.model.parameters()).device
        scores: list[list[float]] = []
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start : start + self.batch_size]
            input_ids, attention = padded([ids for ids, _ in chunk], device)
            logits = self.model(input_ids=input_ids, attention_mask=attention).logits
            probabilities = logits.float().softmax(-1)[..., self.positive_label].cpu()
            scores.extend(probabilities[row, positions].tolist() for row, (_, positions) in enumerate(chunk))
        return scores

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[list[Step]]:
        texts = [completion_text(c) for c in completions]
        spans = [step_spans(text, self.step_separator) for text in texts]
        scores = self.score_steps(
            [_prompt_text(p) for p in prompts], [[text[a:b] for a, b in s] for text, s in zip(texts, spans)]
        )
        return [[Step(a, b, score) for (a, b), score in zip(s, values)] for s, values in zip(spans, scores)]


class MathShepherd:
    """Math-Shepherd step labels from the policy itself: from each step's prefix of a response, sample
    ``num_rollouts`` continuations and score each finished response with ``verifier``. A step's label is the
    fraction of its continuations that are correct (``label="soft"``) or whether any is (``"hard"``); the last
    step's label is the verdict on the response itself (no rollouts).

    Cost: ``num_rollouts * (S - 1)`` sampled continuations per response of ``S`` steps, each at most
    ``max_new_tokens`` long (by default what the trainer's ``max_completion_length`` leaves after the prefix).

    Args:
        verifier: ``verifier(prompt, completion, row) -> bool | float``, the outcome check; a response is correct
            when its verdict is at least ``threshold``.
        num_rollouts: continuations per step prefix.
        label: ``"soft"`` or ``"hard"``.
        step_separator: what ends a step.
        max_new_tokens: the longest continuation; ``None``: the trainer's ``max_completion_length`` minus the
            prefix (needed when labelling offline).
        temperature: sampling temperature of the continuations (``None``: the trainer's).
        threshold: the verdict at or above which a response is correct.
        batch_size: step prefixes per batched generation (each sampled ``num_rollouts`` times).
        model, tokenizer: the policy and its tokenizer when labelling offline; a trainer binds its own.
    """

    runs_policy_forwards = True  # it samples continuations from the policy (refused under parameter sharding)

    def __init__(
        self,
        verifier: Callable[[Prompt, str, dict[str, Any]], bool | float],
        num_rollouts: int = 4,
        label: str = "soft",
        step_separator: str = "\n",
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        threshold: float = 1.0,
        batch_size: int = 64,
        model=None,
        tokenizer=None,
        name: str = "math_shepherd",
    ):
        if label not in ("soft", "hard"):
            raise ValueError(f"label must be 'soft' or 'hard', got {label!r}")
        if num_rollouts < 1:
            raise ValueError(f"num_rollouts must be >= 1, got {num_rollouts}")
        check_separator(step_separator, "MathShepherd")
        if not callable(verifier):
            raise TypeError(f"MathShepherd's verifier must be callable, got {type(verifier).__name__}.")
        if not isinstance(threshold, numbers.Real) or isinstance(threshold, bool) or not math.isfinite(threshold):
            raise ValueError(f"MathShepherd's threshold must be a finite number, got {threshold!r}.")
        self.verifier, self.num_rollouts, self.label_type = verifier, num_rollouts, label
        self.step_separator, self.max_new_tokens, self.threshold = step_separator, max_new_tokens, threshold
        self.temperature, self.model, self.tokenizer = temperature, model, tokenizer
        self.batch_size = batch_size
        self.__name__ = name
        self._trainer = None

    def bind(self, trainer) -> MathShepherd:
        """Sample from ``trainer``'s policy with its tokenizer, temperature and completion length."""
        self._trainer = trainer
        return self

    def _setup(self) -> tuple[Any, Any, float, int | None]:
        trainer = self._trainer
        if trainer is None:
            if self.model is None or self.tokenizer is None or self.max_new_tokens is None:
                raise RuntimeError(
                    "MathShepherd samples from the policy: use it with MRTPOTrainer (which binds it), or pass "
                    "model, tokenizer and max_new_tokens to label offline."
                )
            return self.model, self.tokenizer, self.temperature or 1.0, self.max_new_tokens
        model = trainer.accelerator.unwrap_model(trainer.model)
        temperature = self.temperature or trainer.temperature
        return model, trainer.processing_class, temperature, self.max_new_tokens or trainer.max_completion_length

    def _prompt_ids(self, tokenizer, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)

    def _correct(self, prompt: Prompt, text: str, row: dict, sample: int) -> bool:
        """The verifier's verdict on one finished response, checked: a bool or a finite number (an error naming
        the verifier and the sample otherwise, also for an exception it raises); it gets copies of the prompt and
        row."""
        where = f"{self.__name__}'s verifier {function_name(self.verifier)!r} on sample {sample}"
        try:
            verdict = self.verifier(copy.deepcopy(prompt), text, copy.deepcopy(row))
        except Exception as raised:
            raise RuntimeError(f"{where} raised {type(raised).__name__}: {raised}") from raised
        if hasattr(verdict, "item") and getattr(verdict, "shape", None) in ((), torch.Size([])):
            verdict = verdict.item()
        if not isinstance(verdict, numbers.Real) or not math.isfinite(verdict):
            raise TypeError(
                f"{where} returned {type(verdict).__name__} {verdict!r:.60}; a verdict is a bool or a finite number."
            )
        return float(verdict) >= self.threshold

    @torch.no_grad()
    def label(
        self,
        prompts: Sequence[Prompt],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        rows: Sequence[dict] | None = None,
    ) -> list[list[Step]]:
        """Step labels of each response (usable offline: pass ``model``, ``tokenizer``, ``max_new_tokens``). Every
        step prefix of the batch is continued in one batched, left-padded generation per ``batch_size`` prefixes."""
        model, tokenizer, temperature, budget = self._setup()
        texts = [completion_text(c) for c in completions]
        if completion_ids is None:
            completion_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        rows = rows if rows is not None else [{} for _ in texts]
        spans = [step_spans(text, self.step_separator) for text in texts]
        verdicts: dict[tuple[int, int], list[bool]] = {}
        prefixes = []  # (response, step, prompt ids, prefix ids) of every step with room left to continue
        for i, (prompt, text, ids) in enumerate(zip(prompts, texts, completion_ids)):
            ends = token_positions(tokenizer, ids, text, [b for _, b in spans[i]], f"{self.__name__} on sample {i}")
            prompt_ids = list(self._prompt_ids(tokenizer, prompt))
            for s, last_token in enumerate(ends):
                prefix = list(ids[: last_token + 1])
                if s == len(ends) - 1 or budget - len(prefix) < 1:  # the response (or prefix) is its own ending
                    ending = text if s == len(ends) - 1 else tokenizer.decode(prefix, skip_special_tokens=True)
                    verdicts[i, s] = [self._correct(prompt, ending, rows[i], i)]
                else:
                    prefixes.append((i, s, prompt_ids, prefix))
        was_training = model.training
        model.eval()
        try:
            for start in range(0, len(prefixes), self.batch_size):
                chunk = prefixes[start : start + self.batch_size]
                endings = self._continue(model, tokenizer, chunk, budget, temperature)
                for (i, s, _, _), rollouts in zip(chunk, endings):
                    verdicts[i, s] = [self._correct(prompts[i], ending, rows[i], i) for ending in rollouts]
        finally:
            model.train(was_training)
        labels = []
        for i, response_spans in enumerate(spans):
            steps = []
            for s, (start, end) in enumerate(response_spans):
                votes = verdicts[i, s]
                score = sum(votes) / len(votes) if self.label_type == "soft" else float(any(votes))
                steps.append(Step(start, end, score))
            labels.append(steps)
        return labels

    def _continue(self, model, tokenizer, chunk, budget: int, temperature: float) -> list[list[str]]:
        """``num_rollouts`` sampled endings (decoded prefix + continuation) of each prefix of ``chunk``, each
        continuation cut to what the budget leaves after its own prefix."""
        input_ids, attention = padded(
            [prompt_ids + prefix for _, _, prompt_ids, prefix in chunk], next(model.parameters()).device, left=True
        )
        width = input_ids.shape[1]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        longest = max(budget - len(prefix) for _, _, _, prefix in chunk)
        sampled = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=longest,
            num_return_sequences=self.num_rollouts,
            pad_token_id=pad,
        )[:, width:].cpu()
        endings = []
        for row, (_, _, _, prefix) in enumerate(chunk):
            room = budget - len(prefix)
            rollouts = sampled[row * self.num_rollouts : (row + 1) * self.num_rollouts, :room]
            endings.append([tokenizer.decode(prefix + r.tolist(), skip_special_tokens=True) for r in rollouts])
        return endings

    def __call__(self, prompts: list, completions: list, completion_ids: list | None = None, **kwargs):
        columns = [k for k in kwargs if k != "trainer_state"]
        rows = [{key: kwargs[key][i] for key in columns} for i in range(len(completions))]
        return self.label(prompts, completions, completion_ids, rows)
