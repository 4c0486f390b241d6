"""Slow end-to-end tests on the real embedded SmolLM2-135M-Instruct (run by .ci/run as well)."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_embedded_model_loads_as_plain_trainable_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_mrtpo.scripts.embedded import embedded_model_path

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


def test_demo_trains_two_mrtpo_steps_with_lora(tmp_path, capsys):
    """Two steps: one console line per step (no log dictionary), a summary naming what was saved, the heatmap (HTML
    with the GDPO reference row, and a PNG), the curves, the adapter and its card; the metrics and the heatmap image
    reach TensorBoard."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trl_mrtpo.scripts.demo import run_demo

    torch.manual_seed(0)
    trainer = run_demo(
        steps=2, warmup_steps=0, max_completion_length=24, output_dir=str(tmp_path), report_to="tensorboard"
    )
    logs = [h for h in trainer.state.log_history if "mrtpo/beta" in h]
    assert len(logs) == 2 and all(h["mrtpo/beta"] == 0.5 for h in logs)
    assert all(h["loss"] == h["loss"] for h in trainer.state.log_history if "loss" in h)  # not NaN
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split("|")[0].strip() for line in lines] == ["step   1/2", "step   2/2"]
    assert "replayed" in lines[0] and "{'loss'" not in out and "'rewards/" not in out
    assert "first 5 steps -> last 5 steps" in out and "credit_heatmap.html" in out and "Device: CPU, fp32" in out
    page = (tmp_path / "credit_heatmap.html").read_text()
    assert page.count('class="resp"') == 4 and "uniform GDPO spread" in page
    assert json.loads((tmp_path / "trainer_state.json").read_text())["log_history"][0]["step"] == 1
    for image in ("credit_heatmap.png", "mrtpo_curves.png"):
        assert (tmp_path / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "adapter_model.safetensors").is_file()
    card = (tmp_path / "README.md").read_text()
    assert "None" not in card and "Model Card for SmolLM2-135M-Instruct-MRTPO-demo-short" in card
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "built-in `short` task data" in card
    events = EventAccumulator(str(next(tmp_path.glob("runs/*")))).Reload()
    assert "mrtpo/credit_heatmap" in events.Tags()["images"]
    assert any(tag.startswith("train/rewards/") for tag in events.Tags()["scalars"])


def test_demo_compare_writes_both_runs_and_one_plot(tmp_path, capsys):
    from trl_mrtpo.scripts.cli import main

    main(["demo", "--compare", "--steps", "1", "--warmup-steps", "0", "--max-completion-length", "12",
          "--output-dir", str(tmp_path), "--threads", "1"])  # fmt: skip
    for method in ("gdpo", "mrtpo"):
        assert (tmp_path / method / "adapter_model.safetensors").is_file()
        assert (tmp_path / method / "credit_heatmap.html").is_file()
    assert (tmp_path / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "=== gdpo ===" in out and "=== mrtpo ===" in out and "gdpo first->last" in out
    assert "not which method learns faster" in out


def test_eval_command_on_the_embedded_model(tmp_path):
    import json

    from trl_mrtpo.scripts.cli import main

    output = tmp_path / "eval.json"
    main(
        ["eval", "--benchmarks", "bfcl_simple_python", "ifeval", "--limit", "2", "--max-new-tokens", "16",
         "--output", str(output)]
    )  # fmt: skip
    results = {r["name"]: r for r in json.loads(output.read_text())["results"]}
    assert results["bfcl_simple_python"]["count"] == 2 and "ast_accuracy" in results["bfcl_simple_python"]["metrics"]
    assert results["ifeval"]["count"] == 2 and 0.0 <= results["ifeval"]["metrics"]["instruction_loose"] <= 1.0


def test_train_command_from_the_cpu_recipe(tmp_path):
    from trl_mrtpo.scripts.cli import main

    main(
        ["train", "--config", "recipes/cpu/basic-smollm2.yaml", "--max_steps", "1", "--max_completion_length", "16",
         "--output_dir", str(tmp_path)]
    )  # fmt: skip
    card = (tmp_path / "README.md").read_text()
    assert (
        "Recipe: `recipes/cpu/basic-smollm2.yaml`" in card
        and "None" not in card
        and (tmp_path / "adapter_model.safetensors").is_file()
    )
