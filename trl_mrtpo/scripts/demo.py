"""``trl-mrtpo demo``: a LoRA run of a task kit on the embedded SmolLM2-135M-Instruct, on CPU, in a few minutes."""

from __future__ import annotations

import os

from ..config import MRTPOConfig


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


def run_demo(
    task: str = "basic",
    output_dir: str = "mrtpo-demo",
    steps: int = 20,
    num_generations: int = 4,
    max_completion_length: int = 48,
    learning_rate: float = 5e-5,
    warmup_steps: int = 5,
    seed: int = 0,
):
    """Train a LoRA adapter on ``task``'s kit, print the per-step curves, save the adapter and its model card in
    ``output_dir``; returns the trainer."""
    from ..kits import get_kit
    from ..viz import format_curves
    from .embedded import embedded_model_path

    print("Loading the embedded SmolLM2-135M-Instruct (first run converts the GGUF, ~30 s)...", flush=True)
    model_path = embedded_model_path()
    kit = get_kit(task)
    config = cpu_run_config(
        output_dir,
        max_steps=steps,
        per_device_train_batch_size=num_generations,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        learning_rate=learning_rate,
        seed=seed,
        credit_warmup_steps=warmup_steps,
        disable_tqdm=False,
    )
    dataset = kit.dataset(max(steps, 8), seed, None)
    trainer = embedded_lora_trainer(
        kit.rewards, kit.info_blocks, config, dataset, data_source=f"trl-mrtpo's built-in `{task}` task data"
    )
    trainer.train()
    print("\nPer-step rewards and MRTPO metrics:")
    print(format_curves(trainer.state.log_history, trainer.reward_func_names))
    trainer.save_model(output_dir)
    trainer.create_model_card(model_name=f"{os.path.basename(model_path)}-MRTPO-demo-{task}")
    print(f"\nAdapter and model card saved to {output_dir}")
    return trainer
