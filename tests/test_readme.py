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
    cut = {"num_generations": 2, "per_device_train_batch_size": 2, "max_steps": 1, "num_rollouts": 2,
           "num_prompts": 2, "max_completion_length": 8, "max_new_tokens": 4}  # fmt: skip
    for name, value in cut.items():
        code = re.sub(rf"{name}=\d+", f"{name}={value}", code)
    cpu = {"use_cpu": "True", "bf16": "False", "max_completion_length": "8", "report_to": '"none"'}
    added = "".join(f"{name}={value}, " for name, value in cpu.items() if f"{name}=" not in code)  # a page's own win
    return re.sub(r"\b(MRTPOConfig|ResearchConfig)\(", rf"\1({added}", code)


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


OFFLINE_RUN = """
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo.scripts.embedded import embedded_model_path

torch.manual_seed(0)
trainer = MRTPOTrainer(
    model=embedded_model_path(),
    reward_funcs=[lambda completions, **kwargs: [float(len(c[0]["content"])) for c in completions]],
    args=MRTPOConfig(output_dir="qwen-coder-mrtpo", use_cpu=True, num_generations=2, per_device_train_batch_size=2,
                     max_steps=1, max_completion_length=4, report_to="none"),
    train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "Say hi."}]}] * 2),
    peft_config=LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"),
)
trainer.train()
trainer.save_model()
trained = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()  # no autocast
"""


def test_the_offline_load_back_block_runs_with_the_hub_unreachable(tmp_path):
    """README's offline block loads a run on the embedded model back with ``HF_HUB_OFFLINE=1`` and an empty Hugging
    Face cache (the adapter itself names the Hub id), into the policy that was trained, and so does the quick start
    of the run's model card; nothing is written into the cache under a Hub id, by the run or by the loads."""
    import os
    import subprocess
    import sys

    (block,) = [b for b in python_blocks(ROOT / "README.md") if "PeftModel.from_pretrained(base" in b]
    check = """
import json
assert json.load(open("qwen-coder-mrtpo/adapter_config.json"))["base_model_name_or_path"] == (
    "HuggingFaceTB/SmolLM2-135M-Instruct")
ids = torch.tensor([[1, 2, 3, 4]])
with torch.no_grad():
    torch.testing.assert_close(policy.eval()(ids).logits, trained(ids).logits)
# the run's model card: its quick start loads the embedded base by name, offline too
card = open("qwen-coder-mrtpo/README.md").read()
quick_start = card.split("```python\\n", 1)[1].split("```", 1)[0]
assert 'local_model("embedded")' in quick_start, quick_start
exec(quick_start.replace("max_new_tokens=128", "max_new_tokens=8"))
"""
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", OFFLINE_RUN + block + check], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    cached = sorted(str(p.relative_to(hf_home)) for p in hf_home.rglob("*"))
    assert not [p for p in cached if "models--" in p or "datasets--" in p], cached
