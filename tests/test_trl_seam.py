"""The one seam to TRL: every private name the package relies on exists in the installed TRL, and no other module
reaches TRL's private helpers directly."""

import re
from pathlib import Path

import torch

from trl_mrtpo import _trl

PACKAGE = Path(_trl.__file__).parent


def test_installed_trl_has_every_name_we_use():
    missing = _trl.missing_names()
    assert not missing, f"the installed TRL lacks {missing}: update trl_mrtpo/_trl.py for this TRL version"


def test_only_the_seam_reaches_trl_private_helpers():
    private = re.compile(r"from trl\.(kernels|trainer\.utils)|\._tokenize_prompts\(|ChunkedLogProbFunction\.apply")
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "_trl.py" and private.search(path.read_text())
    ]
    assert not offenders, offenders


def test_sampled_token_logprobs_match_log_softmax():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 8, generator=gen), torch.randn(50, 8, generator=gen)
    ids = torch.randint(0, 50, (5,), generator=gen)
    got = _trl.sampled_token_logprobs(hidden, weight, None, ids, 0.7, 16)
    expected = torch.log_softmax((hidden.double() @ weight.double().T) / 0.7, -1).gather(-1, ids[:, None])[:, 0]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_core_imports_no_application():
    """Importing the trainer and its configuration loads nothing of ``trl_mrtpo.scripts`` (commands, the embedded
    demo model, evaluation): the core stands alone."""
    import subprocess
    import sys

    code = (
        "import sys, trl_mrtpo\n"
        "from trl_mrtpo import MRTPOConfig, MRTPOTrainer\n"
        "from trl_mrtpo.kits import get_kit\n"
        "import trl_mrtpo.model_card, trl_mrtpo.opsd, trl_mrtpo.step_labels\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('trl_mrtpo.scripts'))\n"
        "assert not loaded, loaded\n"
        "from trl_mrtpo.scripts.inspection import inspect_credit\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_top_level_is_the_trainers_and_moved_names_warn():
    """Four names at the top level, as TRL's trainers export theirs; the names that moved to their modules still
    resolve for one minor release, with a FutureWarning naming the new import."""
    import pytest

    import trl_mrtpo
    from trl_mrtpo.step_labels import MathShepherd

    assert sorted(n for n in trl_mrtpo.__all__ if n != "__version__") == [
        "InfoBlock",
        "InfoBlockError",
        "MRTPOConfig",
        "MRTPOTrainer",
    ]
    with pytest.warns(FutureWarning, match="trl_mrtpo.MathShepherd` moved to `trl_mrtpo.step_labels.MathShepherd"):
        assert trl_mrtpo.MathShepherd is MathShepherd
    with pytest.raises(AttributeError):
        trl_mrtpo.no_such_name  # noqa: B018
