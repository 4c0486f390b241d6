"""trl-mrtpo: reward-specific token-level credit assignment (MRTPO) for multi-reward RL with TRL."""

import importlib
import warnings

from . import steps  # noqa: F401  registers the step credit term (process rewards, failure suffixes)
from .config import MRTPOConfig
from .info_blocks import InfoBlock, InfoBlockError
from .trainer import MRTPOTrainer

__version__ = "0.2.0"

# Exported here until 0.3, each from its own module now (a FutureWarning says where); the top level is TRL's size.
_MOVED = {
    "CreditRecord": "diagnostics",
    "Kit": "kits",
    "get_kit": "kits",
    "Step": "steps.process_rewards",
    "step_spans": "steps.process_rewards",
    "SelfCertaintyReward": "baselines.self_certainty",
    "MathShepherd": "steps.step_labels",
    "ProcessRewardModel": "steps.step_labels",
    "credit_heatmap_html": "observability.viz",
    "inspect_credit": "scripts.inspection",
}


def __getattr__(name: str):
    if name in _MOVED:
        module = f"{__name__}.{_MOVED[name]}"
        warnings.warn(
            f"`trl_mrtpo.{name}` moved to `{module}.{name}` and leaves the top level in 0.3; import it from there.",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'trl_mrtpo' has no attribute {name!r}")


__all__ = ["InfoBlock", "InfoBlockError", "MRTPOConfig", "MRTPOTrainer", "__version__"]
