"""trl-mrtpo: reward-specific token-level credit assignment (MRTPO) for multi-reward RL with TRL."""

from . import steps  # noqa: F401  registers the step credit term (process rewards, failure suffixes)
from ._moved import moved_attributes
from .config import MRTPOConfig
from .info_blocks import InfoBlock, InfoBlockError
from .trainer import MRTPOTrainer

__version__ = "0.2.0"

# Exported here until 0.3, each from its own module now (a FutureWarning says where); the top level is TRL's size.
__getattr__ = moved_attributes(
    __name__,
    {
        "CreditRecord": "trl_mrtpo.diagnostics",
        "Kit": "trl_mrtpo.kits",
        "get_kit": "trl_mrtpo.kits",
        "Step": "trl_mrtpo.steps.process_rewards",
        "step_spans": "trl_mrtpo.steps.process_rewards",
        "SelfCertaintyReward": "trl_mrtpo.baselines.self_certainty",
        "MathShepherd": "trl_mrtpo.steps.step_labels",
        "ProcessRewardModel": "trl_mrtpo.steps.step_labels",
        "credit_heatmap_html": "trl_mrtpo.observability.viz",
        "inspect_credit": "trl_mrtpo.scripts.inspection",
    },
)

__all__ = ["InfoBlock", "InfoBlockError", "MRTPOConfig", "MRTPOTrainer", "__version__"]
