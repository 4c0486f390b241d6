"""``trl-mrtpo demo``: a LoRA run of a task kit on the embedded SmolLM2-135M-Instruct, on CPU, in a few minutes."""

from __future__ import annotations

import importlib.util
import math
import os
import warnings

from transformers import TrainerCallback

from ..config import MRTPOConfig
from ..observability.callbacks import CreditPlotCallback
from . import DEMO_SETTINGS


def cpu_run_config(output_dir: str, **overrides) -> MRTPOConfig:
    """The MRTPOConfig of the CPU runs on the embedded model (demo, benchmarks): LoRA-sized learning rate, fp32
    (bf16 autocast on CPU runs the matmuls several times slower), per-step logging, no checkpoints, no reporting.
    Keyword arguments override any field; a research room's field or mode makes it a ResearchConfig."""
    from ..research import ResearchConfig, needs_research

    settings = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 48,
        "learning_rate": 5e-5,
        "temperature": 1.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        **overrides,
    }
    return (ResearchConfig if needs_research(overrides) else MRTPOConfig)(**settings)


def embedded_lora_config():
    """The CPU runs' adapter: rank 8 on the attention projections (never on lm_head: the replay reads its weight)."""
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def embedded_lora_trainer(
    reward_funcs: list, info_blocks: list, args: MRTPOConfig, train_dataset, model: str | None = None, **kwargs
):
    """An MRTPOTrainer of the CPU runs (a ResearchTrainer for a ResearchConfig): the embedded SmolLM2-135M-Instruct
    (or the ``model`` folder) with :func:`embedded_lora_config`'s adapter. ``kwargs`` go to the trainer."""
    from ..research import ResearchConfig, ResearchTrainer
    from ..trainer import MRTPOTrainer
    from .embedded import embedded_model_path

    return (ResearchTrainer if isinstance(args, ResearchConfig) else MRTPOTrainer)(
        model=model or embedded_model_path(),
        reward_funcs=reward_funcs,
        info_blocks=info_blocks,
        args=args,
        train_dataset=train_dataset,
        peft_config=embedded_lora_config(),
        **kwargs,
    )


class StepLines(TrainerCallback):
    """One compact console line per training step (step, seconds, each reward's mean, the replayed share) in place of
    TRL's log dictionary; the full logs still go to ``trainer_state.json`` and the configured trackers."""

    def __init__(self, reward_names: list[str], write=print):
        self.names = list(reward_names)
        self.write = write

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "mrtpo/beta" not in logs:
            return
        means = " ".join(f"{short_name(n)} {logs.get(f'rewards/{n}/mean', math.nan):.2f}" for n in self.names)
        replayed = 100 * logs.get("mrtpo/replayed_fraction", 0.0)
        seconds = logs.get("step_time", math.nan)
        self.write(
            f"step {state.global_step:>3}/{state.max_steps} | {seconds:5.1f} s | {means} | replayed {replayed:3.0f}%"
        )


def short_name(reward_name: str) -> str:
    """A reward's name without the ``_reward`` suffix, for narrow console columns."""
    return reward_name.removesuffix("_reward")


def quiet_console(trainer) -> None:
    """Transformers' per-step printing of the log dictionary (progress bar, printer) replaced by :class:`StepLines`."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepLines(trainer.reward_func_names))


def reward_trend(log_history: list[dict], reward_names: list[str], window: int = 5) -> list[tuple[str, float, float]]:
    """Each reward's mean over the first and the last ``window`` logged training steps."""
    logs = [h for h in log_history if "mrtpo/beta" in h]
    trend = []
    for name in reward_names:
        values = [h[f"rewards/{name}/mean"] for h in logs if isinstance(h.get(f"rewards/{name}/mean"), (int, float))]
        if values:
            span = min(window, len(values))
            trend.append((name, sum(values[:span]) / span, sum(values[-span:]) / span))
    return trend


def save_credit_views(trainer, output_dir: str, max_responses: int = 4) -> list[str]:
    """The last step's token credit as ``credit_heatmap.html`` (and ``credit_heatmap.png`` where matplotlib is
    installed) in ``output_dir``: a few responses, each reward's credit and the uniform GDPO spread beside it."""
    from ..observability.viz import credit_heatmap_html, credit_heatmap_png

    record = trainer.last_credit
    if record is None:
        return []
    names = trainer.reward_func_names
    path = os.path.join(output_dir, "credit_heatmap.html")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(credit_heatmap_html(record, trainer.processing_class, names, max_responses=max_responses))
    paths = [path]
    if importlib.util.find_spec("matplotlib") is not None:
        paths.append(
            credit_heatmap_png(record, trainer.processing_class, names, os.path.join(output_dir, "credit_heatmap.png"))
        )
    return paths


def demo_device() -> tuple[dict, str]:
    """The config fields and a sentence for the device present: a GPU in bf16 where there is one, else the CPU in
    fp32 (bf16 autocast runs a CPU's matmuls several times slower)."""
    import torch

    if torch.cuda.is_available():
        return {"use_cpu": False, "bf16": True}, f"GPU ({torch.cuda.get_device_name(0)}), bf16"
    return {"use_cpu": True, "bf16": False}, "CPU, fp32"


def check_causal_lm(model: str) -> None:
    """Refuses, naming ``--model``, a checkpoint that is not a causal language model (an encoder, a classifier): the
    demo samples from it and replays its lm_head."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model)
    architectures = config.architectures or []
    generative = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        architectures and not any(name.endswith(generative) for name in architectures)
    ):
        raise ValueError(
            f"--model {model!r} is a {config.model_type} checkpoint ({', '.join(architectures) or 'no architecture'}),"
            " not a causal language model: the demo samples responses from it and replays its lm_head. Pass a causal"
            " LM (a *ForCausalLM checkpoint) or 'embedded'."
        )


def demo_model(model: str) -> tuple[str, str]:
    """``(path or id, display name)``: ``embedded`` is the packaged SmolLM2-135M-Instruct (offline); anything else
    is a Hub id or a local folder, loaded as ``from_pretrained`` loads it."""
    if model != "embedded":
        check_causal_lm(model)
        return model, model.rstrip("/").split("/")[-1]
    from .embedded import embedded_model_path

    print("Loading the embedded SmolLM2-135M-Instruct (first run converts the GGUF, ~30 s)...", flush=True)
    path = embedded_model_path()
    return path, os.path.basename(path)


def run_demo(
    task: str = DEMO_SETTINGS["task"],
    output_dir: str = "mrtpo-demo",
    steps: int = DEMO_SETTINGS["steps"],
    num_generations: int = DEMO_SETTINGS["num_generations"],
    max_completion_length: int = DEMO_SETTINGS["max_completion_length"],
    learning_rate: float = DEMO_SETTINGS["learning_rate"],
    warmup_steps: int = DEMO_SETTINGS["warmup_steps"],
    seed: int = 0,
    method: str = "mrtpo",
    model: str = "embedded",
    report_to: str = "none",
    prompts_per_step: int = DEMO_SETTINGS["prompts_per_step"],
    temperature: float = DEMO_SETTINGS["temperature"],
    overwrite: bool = False,
):
    """Train a LoRA adapter on ``task``'s kit with ``method`` (``mrtpo`` or ``gdpo``): one console line per step, then
    a summary; saves the adapter, its model card, the curves and the last step's credit heatmap in ``output_dir``,
    which must be new or empty unless ``overwrite`` (checked before anything loads). Returns the trainer."""
    from ..kits import get_kit
    from ..outputs import writable_folder

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:  # max_steps=0 would train an epoch
        raise ValueError(f"run_demo: steps must be an integer >= 1, got {steps!r}.")
    writable_folder(output_dir, overwrite, own=lambda entry: False)
    path, model_name = demo_model(model)
    device, device_text = demo_device()
    print(f"Device: {device_text}. Task: {task}. Credit: {method}.", flush=True)
    kit = get_kit(task)
    config = cpu_run_config(
        output_dir,
        credit_assignment=method,
        max_steps=steps,
        per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        temperature=temperature,
        seed=seed,
        credit_warmup_steps=warmup_steps,
        report_to=report_to,
        disable_tqdm=True,  # one line per step instead (StepLines)
        activation_checkpointing=False,  # a 135M model's activations are small; recomputing them costs a third
        # of each backward on a CPU
        **device,
    )
    dataset = kit.dataset(max(steps * prompts_per_step, 8), seed, None)
    with warnings.catch_warnings():  # transformers' deprecation notices about methods TRL and PEFT call
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
        trainer = embedded_lora_trainer(
            kit.rewards,
            kit.info_blocks,
            config,
            dataset,
            model=path,
            data_source=f"trl-mrtpo's built-in `{task}` task data",
            callbacks=[CreditPlotCallback()],
        )
        quiet_console(trainer)
        print(
            f"Training {steps} steps, one line each (a step samples, scores and replays "
            f"{config.per_device_train_batch_size} responses).",
            flush=True,
        )
        trainer.train()
    trainer.save_model(output_dir)
    trainer.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))  # every step's full logs
    trainer.create_model_card(model_name=f"{model_name}-MRTPO-demo-{task}")
    views = save_credit_views(trainer, output_dir)
    send_to_trackers(trainer, views)
    print(run_summary(trainer, output_dir))
    return trainer


def run_summary(trainer, output_dir: str) -> str:
    """What the run showed (each reward's first and last steps) and what it left in ``output_dir``."""
    lines = ["", "Each reward's mean, first 5 steps -> last 5 steps:"]
    for name, first, last in reward_trend(trainer.state.log_history, trainer.reward_func_names):
        lines.append(f"  {short_name(name):<16} {first:.2f} -> {last:.2f}")
    described = {
        "adapter_model.safetensors": "the LoRA adapter",
        "README.md": "its model card",
        "mrtpo_curves.png": "reward curves",
        "credit_heatmap.html": "where each reward's credit landed, last step (open in a browser)",
        "credit_heatmap.png": "the same as an image",
        "trainer_state.json": "every step's full logs",
    }
    lines.append(f"Saved in {output_dir}:")
    for name, what in described.items():
        if os.path.exists(os.path.join(output_dir, name)):
            lines.append(f"  {name:<26} {what}")
    return "\n".join(lines)


def send_to_trackers(trainer, paths: list[str]) -> None:
    """The heatmap image to the trackers of ``report_to`` that take images (TensorBoard, W&B, trackio); the metrics
    already went through transformers' own integrations."""
    image = next((p for p in paths if p.endswith(".png")), None)
    if image is None:
        return
    from transformers.integrations import TensorBoardCallback

    step = trainer.state.global_step
    for callback in trainer.callback_handler.callbacks:
        # transformers closes its writer when training ends: write beside it, in the run's own log folder
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is not None:
            import numpy as np
            from PIL import Image
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(log_dir=callback.logging_dir) as writer:
                pixels = np.asarray(Image.open(image).convert("RGB"))
                writer.add_image("mrtpo/credit_heatmap", pixels, step, dataformats="HWC")
    reporting = trainer.args.report_to or []
    if "wandb" in reporting:
        import wandb

        wandb.log({"mrtpo/credit_heatmap": wandb.Image(image)}, step=step)
    if "trackio" in reporting:
        import trackio

        trackio.log({"mrtpo/credit_heatmap": trackio.Image(image)}, step=step)


def compare_demo(output_dir: str = "mrtpo-demo", overwrite: bool = False, **settings) -> dict:
    """The same task and seed with ``gdpo`` then ``mrtpo`` (``output_dir/gdpo``, ``output_dir/mrtpo``), ending with
    one side-by-side plot (``comparison.png``) and table; ``output_dir`` must be new or empty unless ``overwrite``.
    One seed shows what each run did, not which method is better: that takes many seeds (``benchmarks/``)."""
    from ..observability.viz import plot_comparison
    from ..outputs import writable_folder

    writable_folder(output_dir, overwrite, own=lambda entry: False)
    histories = {}
    for method in ("gdpo", "mrtpo"):
        print(f"\n=== {method} ===", flush=True)
        folder = os.path.join(output_dir, method)
        trainer = run_demo(output_dir=folder, method=method, overwrite=overwrite, **settings)
        histories[method] = trainer.state.log_history
    names = trainer.reward_func_names
    lines = ["", f"{'reward':<16} " + "  ".join(f"{m + ' first->last':>20}" for m in histories)]
    trends = {m: {n: (a, b) for n, a, b in reward_trend(h, names)} for m, h in histories.items()}
    for name in names:
        cells = [
            f"{trends[m][name][0]:.2f} -> {trends[m][name][1]:.2f}" if name in trends[m] else "n/a" for m in histories
        ]
        lines.append(f"{short_name(name):<16} " + "  ".join(f"{c:>20}" for c in cells))
    plot = plot_comparison(histories, names, os.path.join(output_dir, "comparison.png"))
    lines.append(f"Side-by-side curves: {plot}. One seed shows what each run did, not which method learns faster.")
    print("\n".join(lines))
    return histories
