"""The user's journey on the embedded model, as one path: train from a recipe, push to the Hub (up to the upload, no
network), load what would be uploaded back into a model that generates what the trained one generates, and
evaluate it."""

import concurrent.futures
import json
import shutil
import types
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


class FakeHub:
    """Stands in for huggingface_hub's HfApi at transformers' upload boundary: keeps a copy of each upload."""

    def __init__(self, root: Path):
        self.root, self.uploads = root, []

    def create_repo(self, repo_id, **kwargs):
        return types.SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, **kwargs):
        copy = self.root / f"upload{len(self.uploads)}"
        ignored = shutil.ignore_patterns(*kwargs.get("ignore_patterns", []))
        shutil.copytree(folder_path, copy, ignore=ignored)
        self.uploads.append((repo_id, copy))
        done = concurrent.futures.Future()  # what `run_as_future=True` returns: here already finished
        done.set_result(None)
        return done


def test_recipe_run_pushes_a_card_and_an_adapter_that_load_back(tmp_path, monkeypatch, embedded_model_in_hub_cache):
    import transformers.trainer
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from trl_mrtpo.scripts.embedded import EMBEDDED_HUB_ID
    from trl_mrtpo.scripts.train import run

    hub = FakeHub(tmp_path)
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    torch.manual_seed(0)
    trainer = run(
        ["--config", "recipes/cpu/basic-smollm2.yaml", "--max_steps", "1", "--max_completion_length", "16",
         "--output_dir", str(tmp_path / "out"), "--push_to_hub", "true", "--hub_model_id", "me/smol-mrtpo"]
    )  # fmt: skip
    repo_id, pushed = hub.uploads[-1]
    assert repo_id == "me/smol-mrtpo"
    files = {p.name for p in pushed.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= files
    assert json.loads((pushed / "adapter_config.json").read_text())["base_model_name_or_path"] == EMBEDDED_HUB_ID

    card = (pushed / "README.md").read_text()
    assert "None" not in card
    assert f"fine-tuned version of [{EMBEDDED_HUB_ID}](https://huggingface.co/{EMBEDDED_HUB_ID})" in card
    assert "trl-mrtpo's built-in `basic` task data" in card and "huggingface.co/datasets" not in card
    # the quick start loads the embedded base by name (offline), then the pushed adapter
    assert (
        'base = local_model("embedded")' in card
        and "PeftModel.from_pretrained(" in card
        and '"me/smol-mrtpo")' in card
    )
    procedure, citations = card.index("## Training procedure"), card.index("## Citations")
    settings = card.index("### MRTPO settings")
    assert procedure < settings < citations  # the MRTPO section is part of the training procedure
    for line in ["credit assignment: `mrtpo`", "credit_warmup_steps: 5", "learning_rate: 5e-05",
                 "| `end_phrase_reward` | 1 | `end_phrase_block` |", "| `length_reward` | 1 | none (uniform credit) |",
                 "Recipe: `recipes/cpu/basic-smollm2.yaml`", "- trl-mrtpo: 0.2.0"]:  # fmt: skip
        assert line in card, line

    # What was uploaded loads back (base model + adapter) and generates the trained policy's greedy tokens.
    tokenizer = AutoTokenizer.from_pretrained(pushed)
    messages = [{"role": "user", "content": "Write two sentences about rain."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    # the adapter names its base by Hub id (resolved from the Hub cache, offline)
    loaded = AutoPeftModelForCausalLM.from_pretrained(pushed).eval()
    with torch.no_grad():
        expected = trained.generate(**inputs, max_new_tokens=12, do_sample=False)
        got = loaded.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, expected)

    # ... and evaluates like any adapter (`trl-mrtpo eval --model embedded --adapter <folder>`).
    from trl_mrtpo.scripts.evaluation import run_evaluation

    (result,) = run_evaluation(model="embedded", adapter=str(pushed), benchmarks=["ifeval"], limit=2, max_new_tokens=8)
    assert result.count == 2 and 0.0 <= result.metrics["instruction_loose"] <= 1.0


def test_saving_an_embedded_adapter_asks_no_hub_and_records_the_hub_id(tmp_path):
    """PEFT looks the base model's config up by the adapter's recorded base to decide whether to save embeddings;
    for the embedded model it must read the local folder instead of warning that the Hub cannot be reached."""
    import warnings

    from datasets import Dataset

    from tests.helpers import graded_length
    from trl_mrtpo.scripts.demo import cpu_run_config, embedded_lora_trainer
    from trl_mrtpo.scripts.embedded import EMBEDDED_HUB_ID, embedded_model_path

    trainer = embedded_lora_trainer(
        [graded_length], [None], cpu_run_config(str(tmp_path / "out")), Dataset.from_list([{"prompt": "hi"}] * 4)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.save_model(str(tmp_path / "saved"))
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "Could not find a config file" in m or "Unable to fetch remote file" in m]
    written = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == EMBEDDED_HUB_ID
    model = trainer.accelerator.unwrap_model(trainer.model)
    # the Hub id goes into the saved files only: the user's live model keeps naming the folder it was loaded from
    assert model.peft_config["default"].base_model_name_or_path == embedded_model_path() != EMBEDDED_HUB_ID
    card = (tmp_path / "saved" / "README.md").read_text()
    assert f"base_model: {EMBEDDED_HUB_ID}" in card and embedded_model_path() not in card
    assert "de-quantised copy of its Q4_1 GGUF" in card  # what the run really trained on


def test_a_local_copy_names_its_hub_id_in_adapters_and_cards(tmp_path, tiny_model, tiny_tokenizer):
    """A local model folder with a ``hub_id.txt`` (as the embedded model's conversion writes) is a copy of that Hub
    model: the saved adapter and the card name the Hub id; a folder without one is named by nobody."""
    from peft import LoraConfig

    from tests.helpers import graded_length, make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import make_basic_dataset
    from trl_mrtpo.model_card import base_model_id

    copy = tmp_path / "copy"
    tiny_model.save_pretrained(copy)
    tiny_tokenizer.save_pretrained(copy)
    assert base_model_id(str(copy)) is None  # a plain local folder: nobody else could load it
    (copy / "hub_id.txt").write_text("someone/tiny-llama\n")
    assert base_model_id(str(copy)) == "someone/tiny-llama"
    assert base_model_id("someone/else") == "someone/else"

    trainer = MRTPOTrainer(
        model=str(copy),
        reward_funcs=[graded_length],
        args=make_args(tmp_path / "out", max_steps=1),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
        peft_config=LoraConfig(r=2, target_modules=["q_proj"]),
    )
    trainer.save_model(str(tmp_path / "saved"))
    written = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == "someone/tiny-llama"
    assert "base_model: someone/tiny-llama" in (tmp_path / "saved" / "README.md").read_text()


@pytest.mark.parametrize("hub_strategy", ["checkpoint", "all_checkpoints"])
def test_a_checkpoint_pushed_to_the_hub_carries_mrtpo_state_and_resumes_it(
    hub_strategy, tmp_path, monkeypatch, tiny_model, tiny_tokenizer
):
    """transformers uploads the checkpoint inside ``_save_checkpoint``; MRTPO's state used to be written after it,
    so a resume from the Hub restarted per-reward strength from scratch."""
    import transformers.trainer

    from tests.helpers import make_args, make_basic_dataset
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits import get_kit

    hub = FakeHub(tmp_path / "hub")
    (tmp_path / "hub").mkdir()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    monkeypatch.setattr(transformers.trainer, "create_repo", hub.create_repo, raising=False)
    kit = get_kit("basic")

    def trainer(max_steps, output):
        args = make_args(
            tmp_path / output, max_steps=max_steps, save_strategy="steps", save_steps=2, push_to_hub=True,
            hub_model_id="me/run", hub_strategy=hub_strategy, reward_strength_floor=0.5,
        )  # fmt: skip
        return MRTPOTrainer(
            model=tiny_model, reward_funcs=kit.rewards, info_blocks=kit.info_blocks, args=args,
            train_dataset=make_basic_dataset(12), processing_class=tiny_tokenizer,
        )  # fmt: skip

    first = trainer(2, "first")
    first.train()
    (uploaded,) = [path for _, path in hub.uploads if (path / "trainer_state.json").exists()]
    assert (uploaded / "mrtpo_state_0.pt").exists(), sorted(p.name for p in uploaded.iterdir())
    saved = first.reward_strength.specificity.clone()
    assert not saved.isnan().all()  # the run read its rewards' strength before checkpointing it
    from trl_mrtpo.strength import RewardStrength

    restored = []
    original = RewardStrength.restore
    monkeypatch.setattr(RewardStrength, "restore", lambda self, state: (restored.append(state), original(self, state)))
    trainer(3, "second").train(resume_from_checkpoint=str(uploaded))  # the uploaded folder, as downloaded
    torch.testing.assert_close(restored[0]["specificity"], saved, equal_nan=True)


def test_save_model_from_python_writes_the_mrtpo_card(tmp_path, monkeypatch, tiny_model, tiny_tokenizer):
    """A Python run's ``trainer.save_model()`` writes the run's card beside the adapter (it left PEFT's blank template,
    "[More Information Needed]", tagged with a local path): the method, the rewards with their blocks, the credit
    settings, and a base model that is a Hub id, never a local folder; ``push_to_hub()`` uploads the same card."""
    import transformers.trainer
    from peft import LoraConfig

    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    copy = tmp_path / "copy"
    tiny_model.save_pretrained(copy)
    tiny_tokenizer.save_pretrained(copy)
    (copy / "hub_id.txt").write_text("someone/tiny-llama\n")
    trainer = MRTPOTrainer(
        model=str(copy),
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path / "out", max_steps=1),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
        peft_config=LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "[More Information Needed]" not in card and "MRTPO" in card
    assert "base_model: someone/tiny-llama" in card and str(copy) not in card
    for name, builder in zip(trainer.reward_func_names, BASIC.info_blocks):
        assert name in card
        assert builder is None or builder.__name__ in card
    assert "credit_beta" in card
    assert "de-quantised" not in card  # only the embedded model's copy is one
    live = trainer.accelerator.unwrap_model(trainer.model).peft_config["default"]
    assert live.base_model_name_or_path == str(copy)  # the user's model is not renamed

    # a Python push uploads the same card and an adapter naming the Hub id
    hub = FakeHub(tmp_path / "hub")
    (tmp_path / "hub").mkdir()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    monkeypatch.setattr(transformers.trainer, "create_repo", hub.create_repo, raising=False)
    trainer.push_to_hub()
    ((repo_id, pushed),) = hub.uploads
    pushed_card = (pushed / "README.md").read_text()
    assert "### MRTPO settings" in pushed_card and "base_model: someone/tiny-llama" in pushed_card
    assert str(tmp_path) not in pushed_card
    assert json.loads((pushed / "adapter_config.json").read_text())["base_model_name_or_path"] == "someone/tiny-llama"
