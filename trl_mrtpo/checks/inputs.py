"""Checks that run once, before the model loads (the trainer's arguments: its configuration's class, the rule's
settings, the datasets, the reward functions' columns, the info-block builders) and once it has loaded (what the
run's credit needs of the policy): each refuses with a message naming the field, row, reward or sample, instead
of wrong numbers or a crash deep inside a training step (docs/behaviour.md). They decide nothing: the trainer does."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..info_blocks import InfoBlockError, SpanNotFound, accepts_trajectory, build_block, per_reward
from ..rules import credit_rule_names, registered_rules
from ..utils import function_name
from .batch import checked_reward

# Losses whose gradient flows through each token's log-probability, not through the importance ratio: a sequence-level
# ratio leaves their per-token advantages in the gradient (measured: tests/test_loss_options.py).
TOKEN_GRADIENT_LOSSES = ("cispo", "vespo")


def check_loss_keeps_token_credit(loss_type: str, importance_sampling_level: str, token_credit: Sequence[str]) -> None:
    """Refuse a sequence-level importance ratio (GSPO, LUSPO) with a loss whose gradient flows through that ratio when
    the run gives tokens different advantages (``token_credit``: what makes them differ): the ratio is one number per
    response, so the token advantages would reach the gradient only through their mean over the response, and the
    run would silently train as GDPO."""
    if importance_sampling_level != "sequence" or loss_type in TOKEN_GRADIENT_LOSSES or not token_credit:
        return
    raise ValueError(
        f"importance_sampling_level='sequence' with loss_type='{loss_type}' multiplies every token of a response by "
        f"one ratio, so the token advantages of {' and '.join(token_credit)} would reach the gradient only through "
        "their mean over the response (the run would train as uniform GDPO). Use importance_sampling_level='token', "
        f"or a loss whose gradient is per token ({', '.join(repr(loss) for loss in TOKEN_GRADIENT_LOSSES)}), or "
        "credit_assignment='gdpo' without step rules for uniform credit with a sequence-level ratio."
    )


def options_beyond(config: Any, config_class: type) -> list[str]:
    """What ``config`` asks for that ``config_class`` does not have: a credit rule registered for a subclass, and
    every field of its own set away from its default."""
    settings = [
        f"{item.name}={getattr(config, item.name)!r}"
        for item in dataclasses.fields(config)
        if item.name not in config_class.__dataclass_fields__ and getattr(config, item.name) != item.default
    ]
    name = config.credit_assignment
    if name in registered_rules() and name not in credit_rule_names(config_class):
        settings.insert(0, f"credit_assignment={config.credit_assignment!r}")
    return settings


def check_config_class(args: Any, config_class: type, trainer_name: str) -> None:
    """``args`` is a ``config_class``; a subclass whose own options are set is refused (this trainer would ignore
    them), naming the trainer that reads them when the subclass says (its ``room`` and ``room_trainer``)."""
    if not isinstance(args, config_class):
        raise TypeError(
            f"args must be a {config_class.__name__}, got {type(args).__name__}; {config_class.__name__} accepts "
            f"every {config_class.__mro__[1].__name__} field."
        )
    beyond = options_beyond(args, config_class)
    if beyond:
        room = getattr(args, "room", f"{type(args).__name__}")
        trainer = getattr(args, "room_trainer", f"the trainer made for {type(args).__name__}")
        raise ValueError(
            f"{', '.join(beyond)} belong to {room}: train with {trainer} ({trainer_name} would ignore them)."
        )


def check_sharded_replay(
    engine: str | None, replay: Sequence[str], policy_rewards: Sequence[str], gathers_for_generation: bool = True
) -> None:
    """Refuse what sharding cannot run exactly and without deadlock (docs/recipes-eval-sharing.md, "Scaling out").

    The replay (``replay``: what needs it) runs on the policy gathered whole, so its forwards are local and processes
    may replay different amounts; that needs ZeRO-3's gather for generation (``ds3_gather_for_generation``) or FSDP2.
    FSDP1's units cannot run a direct decoder call, and rewards that run the policy themselves (``policy_rewards``)
    run forwards outside the gathered context, where each is a collective and processes run different numbers.
    """
    if engine is None:
        return
    if policy_rewards:
        raise ValueError(
            f"{', '.join(policy_rewards)} run the policy inside the reward computation, which {engine} does not "
            f"support: under {engine} every such forward gathers parameters from all processes, and processes run "
            "different numbers of them, so training would deadlock. Use DDP or DeepSpeed ZeRO-1/2 (`zero1`, `zero2`)."
        )
    if not replay:
        return
    if engine == "FSDP1":
        raise ValueError(
            f"{' and '.join(replay)} replay completions with the policy, which is not supported under FSDP1 (its "
            "units cannot run the decoder alone). Use FSDP2 (`fsdp_version: 2` in the accelerate config), DeepSpeed "
            "ZeRO-2/3 or DDP."
        )
    if engine == "DeepSpeed ZeRO-3" and not gathers_for_generation:
        raise ValueError(
            f"{' and '.join(replay)} replay completions with the policy gathered whole, as TRL generates under "
            "ZeRO-3; with ds3_gather_for_generation=False the policy is never gathered. Set "
            "ds3_gather_for_generation=True, or use credit_assignment='gdpo' (no replay)."
        )


def _check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where} is an empty string; each prompt must be non-empty text or a list of messages.")
        return
    if not isinstance(prompt, list) or not prompt:
        described = "an empty list" if isinstance(prompt, list) else f"a {type(prompt).__name__}"
        raise ValueError(
            f"{where} is {described}; each prompt must be non-empty text or a non-empty list of messages."
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {i} of {where} is not a dict with 'role' and 'content': {message!r:.80}")
        content = message["content"]
        typed_parts = isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content)
        if not (isinstance(content, str) or typed_parts or (content is None and message.get("tool_calls"))):
            raise ValueError(
                f"message {i} of {where} has content {content!r:.60}; a message's content is text (or a list of "
                "typed parts), None only beside tool_calls."
            )


def check_dataset(dataset: Any, split: str, environments: bool = False) -> None:
    """Before the first step: the dataset has a ``prompt`` column (unless ``environments``: an environment's
    ``reset()`` may give the prompt, as TRL reads it) and every prompt is non-empty text or a non-empty list of
    ``{"role", "content"}`` messages. Streaming datasets are checked on their first row."""
    if dataset is None:
        return
    if isinstance(dataset, dict):  # several evaluation datasets
        for key, part in dataset.items():
            check_dataset(part, f"{split} '{key}'", environments)
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and hasattr(dataset, "__len__"):  # a datasets.Dataset: read the column at once
        rows = None
    elif isinstance(dataset, Sequence):  # a list of rows
        rows = list(dataset)
        columns = list(dict.fromkeys(key for row in rows for key in row))
    else:  # streaming: its first row
        rows = [next(iter(dataset))]
        columns = list(rows[0])
    if "prompt" not in columns:
        if environments:  # TRL starts from an empty user message and appends what reset() returns
            return
        raise ValueError(
            f"the {split} dataset has no 'prompt' column (columns: {', '.join(map(str, columns))}); MRTPOTrainer "
            "samples completions for each row's 'prompt' (only an environment_factory's reset() may give it instead)."
        )
    prompts = dataset["prompt"] if rows is None else [row.get("prompt") for row in rows]
    for i, prompt in enumerate(prompts):
        _check_prompt(prompt, f"the prompt of row {i} of the {split} dataset")


def check_reward_columns(funcs: Sequence[Any], names: Sequence[str], dataset: Any, split: str = "train") -> None:
    """Before the model loads: each reward function's required keyword arguments are what TRL passes it, the
    ``split`` dataset's columns (TRL withholds ``prompt``, ``completion`` and ``completion_ids``) and the arguments
    TRL supplies; one the data lacks is named with the function (TRL's bare ``TypeError`` came after a generation, or
    at the first evaluation)."""
    from .._trl import REWARD_SUPPLIED_ARGUMENTS, REWARD_WITHHELD_COLUMNS

    if isinstance(dataset, dict):  # several evaluation datasets
        for key, part in dataset.items():
            check_reward_columns(funcs, names, part, f"{split} '{key}'")
        return
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, list):  # no dataset (an environment's data), or one streamed without a schema
        return
    available = {*REWARD_SUPPLIED_ARGUMENTS, *(c for c in columns if c not in REWARD_WITHHELD_COLUMNS)}
    for func, name in zip(funcs, names):
        if isinstance(func, (str, torch.nn.Module)):  # a reward model: TRL feeds it tokens, not columns
            continue
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # a callable without a signature to read
            continue
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        required = [p.name for p in parameters if p.kind in keyword and p.default is inspect.Parameter.empty]
        missing = [argument for argument in required if argument not in available]
        if missing:
            raise ValueError(
                f"reward function '{name}' needs the column {missing[0]!r}, which the {split} dataset lacks (TRL "
                f"passes a reward function the dataset's columns, less {', '.join(REWARD_WITHHELD_COLUMNS)}, and "
                f"{', '.join(REWARD_SUPPLIED_ARGUMENTS)}); the dataset's columns: {', '.join(columns)}."
            )


def check_model_argument(model: Any) -> None:
    """``model="embedded"`` is the command's name for the embedded model; the trainer takes a Hub id or a folder, as
    TRL's does."""
    if model == "embedded":
        raise ValueError(
            "model='embedded' is the trl-mrtpo command's name for the embedded SmolLM2-135M-Instruct; in Python "
            "pass its folder: from trl_mrtpo.scripts.embedded import embedded_model_path; "
            "MRTPOTrainer(model=embedded_model_path(), ...)."
        )


def check_credit_settings(args: Any, rule: type) -> None:
    """Before the model loads, what the configuration asks of the rule ``credit_assignment`` resolved to and of its
    divergence backend: a reward-strength floor set for a rule that has no per-reward q, a backend that cannot run
    here (Triton not installed)."""
    floor = args.reward_strength_floor
    default_floor = type(args).__dataclass_fields__["reward_strength_floor"].default
    if floor not in (None, default_floor) and rule.removal != "each":
        modes = [name for name, entry in registered_rules().items() if entry.rule.removal == "each"]
        raise ValueError(
            f"reward_strength_floor={floor!r} has no effect unless credit_assignment is one of "
            f"{', '.join(name for name in modes if name in credit_rule_names(args))} (it reads each reward's own q "
            f"profile); got credit_assignment={args.credit_assignment!r}. Remove it."
        )
    if args.divergence_backend not in ("auto", "torch"):
        from ..ops.divergence import divergence_backend

        missing = divergence_backend(args.divergence_backend).missing()
        if missing:
            raise ValueError(f"divergence_backend={args.divergence_backend!r} {missing}.")


def distinct(names: Sequence[str]) -> list[str]:
    """Names made unique as TRL's logs make them: a name met again gets ``_2``, ``_3``, ... (two lambdas are
    ``<lambda>`` and ``<lambda>_2``), so that no two rewards share a metric, a monitor or a checkpoint entry."""
    taken, unique = set(names), []
    for name in names:
        if name in unique:
            suffix = 2
            while f"{name}_{suffix}" in taken:
                suffix += 1
            name = f"{name}_{suffix}"
            taken.add(name)
        unique.append(name)
    return unique


def checked_inputs(
    reward_funcs: Any, info_blocks: Any, train_dataset: Any, eval_dataset: Any, kwargs: dict[str, Any]
) -> tuple[list, list]:
    """Before the model loads: the datasets (an environment's ``reset()`` may give the prompt), the environment
    arguments (a ``rollout_func`` wrapped by :func:`checked_rollout`), the reward columns and the builders. Returns the
    reward functions as given (a copy) and as TRL gets them, each wrapped by :func:`checked_reward`."""
    environments = kwargs.get("environment_factory") is not None
    if environments or kwargs.get("tools") or kwargs.get("rollout_func") is not None:
        from .environments import check_environment_arguments, checked_rollout  # loaded by the runs that have them

        check_environment_arguments(kwargs)
        if kwargs.get("rollout_func") is not None:
            kwargs["rollout_func"] = checked_rollout(kwargs["rollout_func"])
    funcs = list(reward_funcs or []) if isinstance(reward_funcs, (list, type(None))) else [reward_funcs]
    names = distinct([f.split("/")[-1] if isinstance(f, str) else function_name(f) for f in funcs])
    for split, dataset in (("train", train_dataset), ("eval", eval_dataset)):
        check_dataset(dataset, split, environments)
        check_reward_columns(funcs, names, dataset, split)
    if not environments:  # the rewards environments bring are added while TRL loads
        check_builders(info_blocks, names)
    builders = info_blocks if environments else per_reward(info_blocks, len(names))
    tools = bool(kwargs.get("tools")) or environments
    check_builders_on_first_row(builders, names, train_dataset, tools, environments)
    checked = [f if isinstance(f, (str, torch.nn.Module)) else checked_reward(f, n) for f, n in zip(funcs, names)]
    return funcs, checked


def check_credit_use(
    args: Any, rule: type, terms: Mapping, replays: bool, runs_policy: Sequence[str], provider: Any, engine: str | None
) -> None:
    """What the run's credit needs of the policy (``replays`` and ``runs_policy``, the functions that run it: the
    trainer's findings): a ``provider`` given to a rule that reads no q, a loss that would average token credit away
    (:func:`check_loss_keeps_token_credit`), sharding that cannot run the replay or the terms' forwards."""
    if provider is not None and "relevance" not in rule.reads:
        raise ValueError(
            f"the relevance provider {function_name(provider)!r} was given, but "
            f"credit_assignment={args.credit_assignment!r} reads no q: it would never be called. Choose a rule that "
            "reads q (mrtpo), or drop the provider."
        )
    replay = [f"credit_assignment='{args.credit_assignment}'"] if replays else []
    extra = [label for term in terms.values() for label in term.policy_forwards]
    token_credit = [label for term in terms.values() for label in term.token_credit]
    check_loss_keeps_token_credit(args.loss_type, args.importance_sampling_level, [*replay, *token_credit])
    check_sharded_replay(engine, [*replay, *extra], runs_policy, args.ds3_gather_for_generation)


def check_builders(
    builders: Sequence[Callable[..., Any] | None] | Callable | None,
    reward_names: Sequence[str],
    argument: str = "info_blocks",
) -> None:
    """Validate a per-reward builder argument of the trainer (``info_blocks``, ``failure_boundaries``): one builder
    (or None) per reward function, as :func:`~trl_mrtpo.info_blocks.per_reward` reads it."""
    builders = per_reward(builders, len(reward_names))
    if len(builders) != len(reward_names):
        raise ValueError(
            f"{argument} has {len(builders)} entries but there are {len(reward_names)} reward functions "
            f"({', '.join(reward_names)}); pass one builder or None per reward, in the same order."
        )
    for builder, name in zip(builders, reward_names):
        if builder is not None and not callable(builder):
            raise TypeError(
                f"{argument} entry for reward '{name}' is a {type(builder).__name__}, not a callable or None."
            )


BUILDER_SIGNATURE = "(*, prompt, completion, row, score)"


def check_builders_on_first_row(
    builders: Any, reward_names: Sequence[str], dataset: Any, tools: bool, environments: bool = False
) -> None:
    """Before the model loads: each builder bound to ``BUILDER_SIGNATURE`` and called once on the dataset's first row
    with an empty completion (and trajectory view where tools are used). A signature that does not bind, a
    ``KeyError`` on the row or a return value :func:`build_block` refuses is refused here; any other exception is a
    warning (it may only fail on the empty stand-in). Rows without a ``prompt`` (an environment's) are not checked.
    With ``environments``, an in-prompt span is looked for in the prompts TRL builds, at the first batch: an
    environment's ``reset()`` may add it.
    """
    columns = getattr(dataset, "column_names", None)
    if not isinstance(builders, (list, tuple)) or columns is None or "prompt" not in columns:
        return
    if not hasattr(dataset, "__len__") or not len(dataset):
        return
    row = dict(dataset[0])
    view = None
    if tools:
        from ..trajectories import Trajectory

        view = Trajectory(turns=(), results=())
    for builder, name in zip(builders, reward_names):
        if builder is None or not callable(builder):  # refused by check_builders
            continue
        label = f"info block builder {function_name(builder)!r} of reward {name!r}"
        extra = {"trajectory": view} if accepts_trajectory(builder) else {}
        try:
            inspect.signature(builder).bind(prompt=None, completion="", row=row, score=0.0, **extra)
        except TypeError as mismatch:
            raise TypeError(
                f"The {label} cannot be called as training calls it ({mismatch}): a builder takes "
                f"{BUILDER_SIGNATURE}, by keyword (plus `trajectory` in tool rollouts), and returns a str, an "
                "InfoBlock or None."
            ) from None
        except ValueError:  # a callable without a signature to read: its call below tells
            pass
        try:
            build_block(builder, name, 0, row["prompt"], "", row, 0.0, view)
        except SpanNotFound:
            if not environments:
                raise
        except InfoBlockError as refused:
            cause = refused.__cause__
            checked = "(checked on the train dataset's first row, with an empty completion, before the model loads)"
            if cause is None:
                raise InfoBlockError(f"{refused} {checked}") from None
            if isinstance(cause, KeyError):
                raise InfoBlockError(
                    f"{refused}: the row has no such field {checked}; the dataset's columns: {', '.join(columns)}."
                ) from cause
            warnings.warn(
                f"The {label} raised {type(cause).__name__} ({cause}) on the train dataset's first row with an empty "
                "stand-in completion. If it only fails on an empty completion, ignore this; otherwise training stops "
                "at the first step with this error.",
                UserWarning,
                stacklevel=3,
            )
