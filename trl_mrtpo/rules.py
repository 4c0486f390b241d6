"""Credit rules, chosen by name, and credit terms, passed in (docs/method.md, "Credit rules and terms").

A **credit rule** turns one generation batch into token advantages (steps 5-8): it declares which contexts the
relevance provider replays for it (``removal``) and which per-token quantities it reads (``reads``: ``"relevance"``
is q from :mod:`trl_mrtpo.relevance`; the research room's trainer computes its own two). ``credit_assignment``
names the rule, from the one registry here (``mrtpo``, ``gdpo`` and ``grpo`` are registered by the core, and a name
is registered once) or by a dotted import path; the trainer resolves it once, at construction, before the model
loads (:func:`resolve_credit_rule`).

A **credit term** adds to whatever rule runs (response weighting, q adjusted, token advantages added or penalties
dropped, steps 6-8 replaced, the result rescaled). Every term reaches the rule one way, ``credit_terms=[...]``:
``process_rewards`` and ``failure_boundaries`` build the step term and the research room's trainer passes its own
there. What a term adds to a batch is a :class:`Contribution`.

A rule's or a term's state (running readings a resumed run needs) is its own object, written and read by the
trainer's one checkpoint mechanism (:mod:`trl_mrtpo.state`) through ``state_entries`` (and ``state`` and
``restore`` where an entry is not an attribute); nothing is kept at module level.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .credit import ReduceSum, TokenCredit, replayed_token_weights
from .state import Stateful
from .utils import import_path, public_name

Combine = Callable[..., TokenCredit]  # steps 6-8: (advantages, weights, mask, reward_weights, rho, reduce_sum, ...)


@dataclass
class CreditSetup:
    """What rules and terms are built from, once per trainer: the configuration, the reward names, and the
    trainer's keyword arguments that terms read (``process_rewards``, ``failure_boundaries``, ...)."""

    args: Any
    reward_names: list[str]
    options: dict[str, Any] = field(default_factory=dict)
    rule: type[CreditRule] | None = None  # the rule credit_assignment resolved to


@dataclass
class Contribution:
    """What a term adds to one local batch: token advantages added after the cap (``process``, ``[B, C]``), where a
    reward's negative credit is dropped (``failure_suffix``, ``[B, K, C]`` bool), and ``(name, value)`` pairs logged
    as ``mrtpo/term/<term>/<name>`` under the term's own name. ``parts`` names what ``process`` sums (``[B, C]``
    each, e.g. one per process reward) and ``steps`` where each part's steps end (per response, token positions),
    for inspection: the credit does not read them."""

    process: torch.Tensor | None = None
    failure_suffix: torch.Tensor | None = None
    logged: Sequence[tuple[str, float]] = ()
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: dict[str, list[list[int]]] = field(default_factory=dict)

    def joined(self, other: Contribution) -> Contribution:
        """Two terms' additions: process advantages add up, failure suffixes unite, parts and steps are kept by name
        (each term's figures are logged before they are joined)."""

        def join(a, b):
            if a is None or b is None:
                return b if a is None else a
            return a | b if a.dtype == torch.bool else a + b

        process, suffix = join(self.process, other.process), join(self.failure_suffix, other.failure_suffix)
        return Contribution(process, suffix, (), {**self.parts, **other.parts}, {**self.steps, **other.steps})


@dataclass
class CreditInputs:
    """One generation batch's local slice as a rule and a term read it."""

    batch: Any  # trl_mrtpo.batch.ScoredBatch
    relevance: torch.Tensor  # [B, K, C] q, read where ``replayed``
    replayed: torch.Tensor  # [B, K] bool
    quantities: dict[str, torch.Tensor]  # the other quantities the rule and the terms read
    beta: float  # beta_n of step 9
    betas: float | torch.Tensor  # step 5's beta: beta_n, or [K] with per-reward strength
    max_second_moment_ratio: float | None  # rho of step 7
    reduce_sum: ReduceSum | None  # the batch's sum over data-parallel processes (None on one)
    process: torch.Tensor | None = None  # [B, C] added token advantages (terms)
    failure_suffix: torch.Tensor | None = None  # [B, K, C] bool: negative credit dropped here (terms)

    @property
    def groups(self) -> torch.Tensor:
        """``[B, K]`` each reward's information group (docs/method.md step 2): rewards whose blocks carry one text
        share it, and their replayed q is one."""
        return self.batch.information_groups


class CreditRule(Stateful):
    """A rule's defaults are GDPO's: nothing replayed, every weight 1.

    ``removal``: the contexts the relevance provider replays (``"each"``: one per reward's block, ``"all"``: one
    without any block, None: none). ``reads``: the quantities the rule needs from the policy. ``full_strength``:
    beta ramps to 1 rather than to ``credit_beta``. ``capped``: step 7's cap bounds its weights' redistribution
    (``max_second_moment_ratio``; False: uncapped). ``keeps_trl_advantages``: TRL's own advantages are kept (plain
    GRPO). Steps 6-8 run on :meth:`weights` (the trainer calls them).
    """

    removal: ClassVar[str | None] = None
    reads: ClassVar[tuple[str, ...]] = ()
    full_strength: ClassVar[bool] = False
    capped: ClassVar[bool] = True
    keeps_trl_advantages: ClassVar[bool] = False

    def __init__(self, setup: CreditSetup):
        self.setup = setup

    def relevance(self, relevance: torch.Tensor, replayed: torch.Tensor, batch: Any) -> torch.Tensor:
        """q as the rule reads it, after the replay and the strength reading (as replayed here)."""
        return relevance

    def weights(self, inputs: CreditInputs) -> torch.Tensor:
        """Step 5: ``[B, K, C]`` token weights, 1 on pairs that were not replayed."""
        return replayed_token_weights(inputs.relevance, inputs.replayed, inputs.batch.mask, inputs.betas)

    def replayed(self, inputs: CreditInputs) -> torch.Tensor:
        """``[B, K]`` the pairs whose weights the rule computed from the policy (logged, shown by ``inspect``)."""
        return inputs.replayed


class MRTPO(CreditRule):
    """Each reward's block removed on its own; each reward's credit follows its own q."""

    removal = "each"
    reads = ("relevance",)


class GRPO(CreditRule):
    """Plain ``GRPOTrainer``: TRL's sequence-level advantages."""

    keeps_trl_advantages = True


class CreditTerm(Stateful):
    """A term changes nothing unless it overrides a step.

    ``name``: what logs, errors and checkpoints call it (its class name when empty).
    ``reads``: quantities it needs from the policy (computed every generation batch it is built for).
    ``token_credit``: what it makes differ between tokens, named for the start-up checks (a loss that would average
    it away is refused). ``policy_forwards``: options that run extra policy forwards, for the sharding checks.
    ``functions``: functions it calls that may bind to the trainer (``bind``) or run the policy.
    ``combine``: a replacement for steps 6-8 (None: the rule's).
    """

    name: ClassVar[str] = ""
    reads: tuple[str, ...] = ()
    token_credit: Sequence[str] = ()
    policy_forwards: Sequence[str] = ()
    functions: Sequence[Callable] = ()
    combine: Combine | None = None

    @classmethod
    def build(cls, setup: CreditSetup) -> CreditTerm | None:
        """The term for a run, when its class is given in ``credit_terms`` (None: the configuration does not select
        it)."""
        return cls()

    def weigh(
        self,
        rewards: torch.Tensor,
        advantages: torch.Tensor,
        reward_weights: torch.Tensor,
        num_generations: int,
        training: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Response-level weighting on the gathered batch: ``[N, K]`` advantages and reward weights."""
        return advantages, reward_weights

    def relevance(self, relevance: torch.Tensor, replayed: torch.Tensor, batch: Any) -> torch.Tensor:
        """q before the rule reads it."""
        return relevance

    def __call__(
        self, batch: Any, tokenizer: Any, num_generations: int, rank: int, trainer_state: Any = None
    ) -> Contribution:
        """What it adds to the local batch."""
        return Contribution()

    def finish(self, credit: TokenCredit, inputs: CreditInputs) -> TokenCredit:
        """The final token advantages (after step 8)."""
        return credit

    def card_lines(self, code: Callable[[str], str]) -> list[str]:
        """What the model card lists of the term under its settings (``code`` renders a name as a code span)."""
        return []


def rule_label(name: str) -> str:
    """What errors, the guard and the checkpoint call the rule ``credit_assignment`` names."""
    return f"the credit rule '{name}'"


def term_label(name: str) -> str:
    """What errors, the guard and the checkpoint call a credit term."""
    return f"the term '{name}'"


def given_terms(credit_terms: Any) -> list[CreditTerm | type[CreditTerm]]:
    """``MRTPOTrainer(credit_terms=...)`` as a list: None is none; one term alone, or anything but a list or tuple,
    is refused. An entry is a term, or a term class the trainer builds with ``build(setup)`` (None: not configured);
    each built term is checked by :func:`terms_by_name`."""
    if credit_terms is None:
        return []
    if not isinstance(credit_terms, (list, tuple)):
        raise TypeError(
            f"credit_terms takes a list of CreditTerm instances; got one {type(credit_terms).__name__}: pass "
            f"[{type(credit_terms).__name__}(...)]."
        )
    return list(credit_terms)


def built_terms(credit_terms: Any, setup: CreditSetup) -> dict[str, CreditTerm]:
    """A run's terms by name (:func:`terms_by_name`), every entry the same way: an instance as given, a
    :class:`CreditTerm` class built with ``build(setup)`` (None: the configuration does not select it)."""
    given = given_terms(credit_terms)
    built = [t.build(setup) if isinstance(t, type) and issubclass(t, CreditTerm) else t for t in given]
    return terms_by_name([term for term in built if term is not None])


def terms_by_name(terms: Sequence[CreditTerm]) -> dict[str, CreditTerm]:
    """A run's terms by name, in the order given; anything but a :class:`CreditTerm`, or two terms of one name, is
    refused."""
    named: dict[str, CreditTerm] = {}
    for term in terms:
        if not isinstance(term, CreditTerm):
            raise TypeError(
                f"credit_terms holds a {type(term).__name__} ({term!r:.60}); each entry is a CreditTerm instance "
                "(trl_mrtpo.rules.CreditTerm)."
            )
        name = term.name or type(term).__name__
        _checked_reads(f"the term {name!r}", term.reads)
        if name in named:
            raise ValueError(f"two credit terms are named {name!r}; give one another `name`.")
        named[name] = term
    return named


def steps_6_to_8(terms: dict[str, CreditTerm]) -> Combine | None:
    """The one term's replacement for steps 6-8 (None: the rule's own); two terms that each replace them are
    refused."""
    replacing = [name for name, term in terms.items() if term.combine is not None]
    if len(replacing) > 1:
        raise ValueError(f"The credit terms {', '.join(replacing)} each replace steps 6-8; at most one may.")
    return terms[replacing[0]].combine if replacing else None


@dataclass(frozen=True)
class RegisteredRule:
    rule: type[CreditRule]
    config_class: type | None  # the least configuration class that may select it (None: any)


_RULES: dict[str, RegisteredRule] = {}


def _checked_reads(owner: str, reads: Any) -> None:
    """``reads`` is a tuple of names (a string, its comma forgotten, would read as its letters)."""
    if not isinstance(reads, tuple) or not all(isinstance(name, str) for name in reads):
        raise TypeError(f"{owner}: reads must be a tuple of names, such as ('relevance',); got {reads!r}.")


def _checked_rule(name: str, rule: Any) -> type[CreditRule]:
    if not (isinstance(rule, type) and issubclass(rule, CreditRule)):
        raise TypeError(f"credit rule {name!r} must be a CreditRule subclass, got {rule!r}.")
    _checked_reads(f"credit rule {name!r}", rule.reads)
    if rule.removal not in (None, "each", "all"):
        raise ValueError(f"credit rule {name!r}: removal must be 'each', 'all' or None, got {rule.removal!r}.")
    if rule.removal is None and rule.reads:
        raise ValueError(f"credit rule {name!r} reads {', '.join(rule.reads)} but replays nothing (removal=None).")
    return rule


def register_credit_rule(name: str, rule: type[CreditRule], config_class: type | None = None) -> None:
    """Makes ``credit_assignment=name`` select ``rule`` in a configuration of ``config_class`` (or a subclass;
    None: any). A name is registered once: registering it again is refused (:func:`unregister_credit_rule` first)."""
    _checked_rule(name, rule)
    if name in _RULES:
        taken = _RULES[name].rule
        raise ValueError(
            f"credit rule {name!r} is registered already ({taken.__module__}.{taken.__qualname__}); choose another "
            f"name, or call unregister_credit_rule({name!r}) first."
        )
    _RULES[name] = RegisteredRule(rule, config_class)


def unregister_credit_rule(name: str) -> None:
    _RULES.pop(name, None)


def credit_rule_names(config: Any = None) -> list[str]:
    """The registered rule names a configuration (an instance or a class; None: any) may select."""
    config_class = config if isinstance(config, type) or config is None else type(config)
    return [
        name
        for name, entry in _RULES.items()
        if config_class is None or entry.config_class is None or issubclass(config_class, entry.config_class)
    ]


def registered_rules() -> dict[str, RegisteredRule]:
    return dict(_RULES)


def resolve_credit_rule(config: Any) -> type[CreditRule]:
    """The rule ``config.credit_assignment`` names: a name registered for this configuration's class, or a dotted
    import path (``my_pkg.rules.Sharpened``, the working directory searched too, as TRL's script resolves its reward
    functions), imported each time it is resolved. Anything else is refused, listing the names."""
    name = config.credit_assignment
    names = credit_rule_names(config)
    if name in names:
        return _RULES[name].rule
    entry = _RULES.get(name)
    if "." in name:
        rule = _checked_rule(name, import_path(name, "credit rule"))
        # a registered rule by its path is the rule by its name: it needs the same configuration
        entry = next((e for n, e in _RULES.items() if e.rule is rule and n not in names), None)
        if entry is None:
            return rule
    where = f" (it needs a {public_name(entry.config_class)})" if entry is not None else ""
    raise ValueError(
        f"credit_assignment={name!r} is unknown; choose one of {', '.join(names)}{where}, or a dotted import path."
    )


register_credit_rule("mrtpo", MRTPO)
register_credit_rule("gdpo", CreditRule)
register_credit_rule("grpo", GRPO)
