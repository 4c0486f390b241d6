"""Slow end-to-end tests on the real embedded SmolLM2-135M-Instruct (run by .ci/run as well)."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_embedded_model_loads_as_plain_trainable_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_mrtpo.embedded import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model.config, "_is_quantized", False)
    assert model.config.model_type == "llama" and model.num_parameters() > 100_000_000
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert len(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()) > 0


def test_demo_trains_two_mrtpo_steps_with_lora(tmp_path):
    from trl_mrtpo.cli import build_parser, run_demo

    torch.manual_seed(0)
    args = build_parser().parse_args(
        ["demo", "--steps", "2", "--warmup-steps", "0", "--max-completion-length", "24", "--output-dir", str(tmp_path)]
    )
    trainer = run_demo(args)
    logs = [h for h in trainer.state.log_history if "mrtpo/beta" in h]
    assert len(logs) == 2 and all(h["mrtpo/beta"] == 0.5 for h in logs)
    assert all(h["loss"] == h["loss"] for h in trainer.state.log_history if "loss" in h)  # not NaN
    assert (tmp_path / "adapter_model.safetensors").is_file()
    card = (tmp_path / "README.md").read_text()
    assert "mrtpo" in card and "MRTPO" in card
