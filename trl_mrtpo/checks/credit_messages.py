"""The words of a non-finite credit refusal (:class:`~trl_mrtpo.checks.guard.CreditGuard`): what each
checked part is and what to do, loaded only when a batch is refused."""

from __future__ import annotations

from collections.abc import Sequence

from ..constants import NEGATIVE_Q_TOLERANCE
from ..rules import rule_label, term_label


def credit_parts(provider: str, rule: str, terms: Sequence[str]) -> dict[str, tuple[str, str]]:
    """The parts of a batch's credit that are checked: key -> (what it is, what to do). ``provider`` names the
    relevance provider (``"the replay"``: the built-in one), ``rule`` the credit rule, ``terms`` the credit terms."""
    replay = provider == "the replay"
    hint_q = (
        "The policy's logits are not finite: the policy has diverged, or fp16 overflowed (train in bf16)."
        if replay
        else f"Check what {provider} returns."
    )
    term_hint = "Check the term's inputs (its reward functions' values) and its arithmetic."
    labels = [*map(term_label, terms), rule_label(rule)]  # in the order q passes them
    own_hint = {label: term_hint for label in labels[:-1]} | {labels[-1]: "Check the rule's relevance()."}
    # in the order the trainer meets them: the first part flagged is named (what follows inherits its NaN)
    return {
        "q": (f"non-finite q (NaN or inf) from {provider}", hint_q),
        "q_negative": (f"q below -{NEGATIVE_Q_TOLERANCE:g} from {provider}", "q is a divergence in [0, 1]."),
        "weighting": (
            "non-finite per-reward advantages or reward weights",
            "Check the configuration's reward_weights.",
        ),
        **{
            f"weighting:{t}": (f"non-finite per-reward advantages or reward weights from the term '{t}'", term_hint)
            for t in terms
        },
        **{f"added:{t}": (f"non-finite added token advantages from the term '{t}'", term_hint) for t in terms},
        **{
            key: value
            for part in labels
            for key, value in (
                (f"q:{part}", (f"non-finite q (NaN or inf) returned by relevance() of {part}", own_hint[part])),
                (
                    f"q_negative:{part}",
                    (
                        f"{part}: relevance() returned q below 0",
                        "q is a divergence in [0, 1]; below 0 "
                        "it would push token weights under the floor 1 - beta, or make every pair uniform.",
                    ),
                ),
            )
        },
        "rule": (f"non-finite token weights from the credit rule '{rule}'", "Check the rule's weights()."),
        **{
            f"finish:{t}": (f"non-finite token advantages returned by finish() of the term '{t}'", term_hint)
            for t in terms
        },  # fmt: skip
        "final": (
            "non-finite token advantages after steps 5-8",
            "Check the credit rule's advantages() and any combine a term gives it.",
        ),
    }
