"""Every Python block of README.md and of the docs pages runs as written, with the hub model swapped for the embedded
SmolLM2 and the step counts cut (CPU)."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    # fences at the start of a line: the code itself may hold ``` in strings
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.DOTALL | re.MULTILINE)


PAGES_WITH_CODE = [page for page in PAGES if python_blocks(page)]


def for_cpu(code: str, model_path: str, prm_path: str = "") -> str:
    """The hub ids become the embedded model and a PRM built in the test; the run becomes 1 step of 2 short answers
    on CPU (Math-Shepherd with 2 rollouts per step)."""
    code = code.replace('"Qwen/Qwen2.5-Coder-3B-Instruct"', repr(model_path)).replace(
        '"your-org/your-prm"', repr(prm_path)
    )
    cut = {"num_generations": 2, "per_device_train_batch_size": 2, "max_steps": 1, "num_rollouts": 2}
    for name, value in cut.items():
        code = re.sub(rf"{name}=\d+", f"{name}={value}", code)
    cpu = 'use_cpu=True, bf16=False, max_completion_length=8, report_to="none", '
    code = re.sub(r"\b(MRTPOConfig|ResearchConfig)\(", rf"\1({cpu}", code)
    return code.replace("max_new_tokens=32", "max_new_tokens=4")


def test_readme_has_the_lora_quickstart_and_the_load_back_example():
    blocks = python_blocks(ROOT / "README.md")
    assert any("peft_config=LoraConfig" in b and "trainer.train()" in b for b in blocks)
    assert any("AutoPeftModelForCausalLM" in b and "merge_and_unload" in b for b in blocks)


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[page.name for page in PAGES_WITH_CODE])
def test_every_python_block_runs(page, tmp_path, monkeypatch, embedded_model_in_hub_cache):
    """A page's blocks run in order in one namespace (a later block may use an earlier one's names)."""
    from transformers import AutoTokenizer

    from tests.helpers import build_prm
    from trl_mrtpo.scripts.embedded import embedded_model_path

    blocks = python_blocks(page)
    prm = build_prm(AutoTokenizer.from_pretrained(embedded_model_path()), tmp_path / "prm")
    # the saved adapter records the embedded model's Hub id, which the load-back block resolves from the Hub cache
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(for_cpu(block, embedded_model_path(), prm), page.name, "exec"), namespace)
    if page.name == "README.md":
        assert (tmp_path / "qwen-coder-mrtpo" / "adapter_config.json").is_file()
        assert (tmp_path / "qwen-coder-mrtpo-merged" / "config.json").is_file()
