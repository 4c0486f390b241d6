"""trl-mrtpo: reward-specific token-level credit assignment (MRTPO) for multi-reward RL with TRL."""

from .config import MRTPOConfig
from .diagnostics import CreditRecord
from .info_blocks import InfoBlock, InfoBlockError
from .kits import Kit, get_kit
from .process_rewards import Step, step_spans
from .self_certainty import SelfCertaintyReward
from .step_labels import MathShepherd, ProcessRewardModel
from .trainer import MRTPOTrainer
from .viz import credit_heatmap_html

__version__ = "0.2.0"


def __getattr__(name: str):
    # inspect_credit is an application (trl_mrtpo.scripts): imported on first use, never with the core
    if name == "inspect_credit":
        from .scripts.inspection import inspect_credit

        return inspect_credit
    raise AttributeError(f"module 'trl_mrtpo' has no attribute {name!r}")


__all__ = [
    "CreditRecord",
    "InfoBlock",
    "InfoBlockError",
    "Kit",
    "MRTPOConfig",
    "MRTPOTrainer",
    "MathShepherd",
    "ProcessRewardModel",
    "SelfCertaintyReward",
    "Step",
    "__version__",
    "credit_heatmap_html",
    "get_kit",
    "inspect_credit",
    "step_spans",
]
