"""The research room: what did not earn a place in MRTPO's core, kept runnable and tested.

- :class:`ResearchConfig` / :class:`ResearchTrainer`: MRTPO plus the sibling methods the benchmarks compare against
  (CoRT, SAW, CONCUR, TACO), the ablations (``joint``, ``shuffled``) and our calibrated-credit options (null
  correction, preserved reward totals), each with its evidence in ``benchmarks/``.
- :mod:`trl_mrtpo.research.rules`: each of them as a credit rule (registered on import) or a term
  (:mod:`trl_mrtpo.rules`).
- :mod:`trl_mrtpo.research.credit`, :mod:`trl_mrtpo.research.weighting`: their pure tensor maths.
"""

from .config import ResearchConfig, needs_research
from .trainer import ResearchTrainer

__all__ = ["ResearchConfig", "ResearchTrainer", "needs_research"]
