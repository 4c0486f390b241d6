"""trl-mrtpo: reward-specific token-level credit assignment (MRTPO) for multi-reward RL with TRL."""

from .config import MRTPOConfig
from .info_blocks import InfoBlock, InfoBlockError
from .trainer import MRTPOTrainer

__version__ = "0.2.0"

__all__ = ["InfoBlock", "InfoBlockError", "MRTPOConfig", "MRTPOTrainer", "__version__"]
