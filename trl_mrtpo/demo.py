"""A small built-in instruction-following task and the ``trl-mrtpo demo`` run on the embedded model.

Each prompt asks for a short answer on a topic under three verifiable constraints; each constraint is one 0/1
reward whose info block is its own sentence in the prompt (*in-prompt* placement), and a fourth reward (length)
has no block and keeps uniform credit.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from .info_blocks import InfoBlock
from .utils import completion_text

TOPICS = ["the ocean", "autumn", "a library", "coffee", "the moon", "bicycles", "rain", "a garden", "trains", "bread"]
END_PHRASES = ["Is there anything else?", "Hope this helps.", "That is all."]
KEYWORDS = ["blue", "quiet", "light", "warm", "small", "green"]
MAX_WORDS = 60


def make_demo_dataset(num_prompts: int = 32, seed: int = 0) -> Dataset:
    """Conversational prompts with three constraint sentences each; the sentences are kept in the row."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        topic, end_phrase, keyword = rng.choice(TOPICS), rng.choice(END_PHRASES), rng.choice(KEYWORDS)
        constraints = {
            "end_phrase": f'End your reply with the exact phrase "{end_phrase}"',
            "keyword": f'Use the word "{keyword}" at least once.',
            "lowercase": "Write everything in lowercase letters.",
        }
        order = list(constraints)
        rng.shuffle(order)
        text = f"Write two sentences about {topic}. " + " ".join(constraints[name] for name in order)
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}],
                "end_phrase": end_phrase,
                "keyword": keyword,
                "constraints": constraints,
            }
        )
    return Dataset.from_list(rows)


def end_phrase_reward(completions: list, end_phrase: list[str], **kwargs) -> list[float]:
    """1 when the reply ends with the requested phrase (trailing whitespace ignored)."""
    return [float(completion_text(c).rstrip().endswith(p)) for c, p in zip(completions, end_phrase)]


def keyword_reward(completions: list, keyword: list[str], **kwargs) -> list[float]:
    """1 when the requested word occurs as a whole word (case-insensitive)."""
    return [
        float(re.search(rf"\b{re.escape(k)}\b", completion_text(c), re.IGNORECASE) is not None)
        for c, k in zip(completions, keyword)
    ]


def lowercase_reward(completions: list, **kwargs) -> list[float]:
    """1 when the reply has letters and none of them is upper case."""
    return [
        float(any(ch.isalpha() for ch in completion_text(c)) and completion_text(c) == completion_text(c).lower())
        for c in completions
    ]


def length_reward(completions: list, **kwargs) -> list[float]:
    """1 for a non-empty reply of at most MAX_WORDS words (no info block: uniform credit)."""
    return [float(0 < len(completion_text(c).split()) <= MAX_WORDS) for c in completions]


def constraint_block(name: str):
    """An in-prompt info block builder: the sentence ``row["constraints"][name]`` of the prompt."""

    def builder(*, prompt, completion, row, score) -> InfoBlock:
        return InfoBlock(row["constraints"][name], placement="in_prompt")

    builder.__name__ = f"{name}_block"
    return builder


DEMO_REWARDS = [end_phrase_reward, keyword_reward, lowercase_reward, length_reward]
DEMO_INFO_BLOCKS = [
    constraint_block("end_phrase"),
    constraint_block("keyword"),
    constraint_block("lowercase"),
    None,
]


DEMO_TASKS = ("basic", "sql", "if", "tools", "short")


def _check_task(name: str) -> None:
    if name not in DEMO_TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(DEMO_TASKS)}")


def task_kit(name: str) -> tuple[list, list]:
    """``(reward_funcs, info_blocks)`` of a built-in task: ``basic`` (above), ``sql``, ``if``, ``tools`` or ``short``
    (short answers under four constraints, the real-model convergence benchmark's task)."""
    _check_task(name)
    if name == "short":
        from .reward_funcs.short_answers import SHORT_ANSWER_INFO_BLOCKS, SHORT_ANSWER_REWARDS

        return SHORT_ANSWER_REWARDS, SHORT_ANSWER_INFO_BLOCKS
    if name == "sql":
        from .reward_funcs.sql import SQL_INFO_BLOCKS, SQL_REWARDS

        return SQL_REWARDS, SQL_INFO_BLOCKS
    if name == "if":
        from .reward_funcs.instruction_following import make_if_info_blocks, make_if_rewards

        return make_if_rewards(13), make_if_info_blocks(13)
    if name == "tools":
        from .reward_funcs.tool_calling import TOOL_INFO_BLOCKS, TOOL_REWARDS

        return TOOL_REWARDS, TOOL_INFO_BLOCKS
    return DEMO_REWARDS, DEMO_INFO_BLOCKS


def builtin_dataset(name: str, num_prompts: int, seed: int, cache_dir: str | None = None):
    """The built-in training data of a task (the SQL databases are created in ``cache_dir``, by default in the
    trl-mrtpo cache folder)."""
    _check_task(name)
    if name == "sql":
        from .embedded import cache_root
        from .reward_funcs.sql import make_sql_dataset

        return make_sql_dataset(cache_dir or cache_root() / "sql_data").shuffle(seed=seed)
    if name == "if":
        from .reward_funcs.instruction_following import make_if_dataset

        return make_if_dataset(num_prompts, seed=seed)
    if name == "short":
        from .reward_funcs.short_answers import make_short_answer_dataset

        return make_short_answer_dataset(num_prompts, seed=seed)
    if name == "tools":
        from .reward_funcs.tool_calling import make_tool_dataset

        return make_tool_dataset().shuffle(seed=seed)
    return make_demo_dataset(num_prompts, seed)


def demo_task(name: str, num_prompts: int, seed: int, cache_dir: str | None = None):
    """``(reward_funcs, info_blocks, train_dataset)`` of a built-in task."""
    return (*task_kit(name), builtin_dataset(name, num_prompts, seed, cache_dir))


def cpu_run_config(output_dir: str, **overrides):
    """The MRTPOConfig of the CPU runs on the embedded model (demo, benchmarks): LoRA-sized learning rate, fp32
    (bf16 autocast on CPU runs the matmuls several times slower), per-step logging, no checkpoints, no reporting.
    Keyword arguments override any field."""
    from .config import MRTPOConfig

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
    return MRTPOConfig(**settings)


def embedded_lora_trainer(reward_funcs: list, info_blocks: list, args, train_dataset, **kwargs):
    """An MRTPOTrainer of the CPU runs: the embedded SmolLM2-135M-Instruct with a rank-8 LoRA adapter on the
    attention projections (never on lm_head: the replay reads its weight). ``kwargs`` go to the trainer."""
    from peft import LoraConfig

    from .embedded import embedded_model_path
    from .trainer import MRTPOTrainer

    return MRTPOTrainer(
        model=embedded_model_path(),
        reward_funcs=reward_funcs,
        info_blocks=info_blocks,
        args=args,
        train_dataset=train_dataset,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        **kwargs,
    )
