"""Checks at the edges: what a user passes in (configuration, dataset, reward values, info blocks) is refused early
with a message naming the field, row, reward or sample, instead of turning into wrong numbers or a crash deep inside
a training step (docs/behaviour.md lists what is refused and what falls back)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import numbers
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._trl import get_config_model_id
from ..constants import DIVERGENCE_BACKENDS
from ..rules import credit_rule_names, registered_rules, resolve_credit_rule
from ..utils import function_name
from .blocks import check_builders, check_builders_on_first_row

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def within_float32(value: numbers.Real) -> bool:
    """Whether a real number is finite and within float32's range (an int too large for any float is not)."""
    try:
        return abs(float(value)) <= FLOAT32_MAX
    except OverflowError:  # an int beyond any float (10**400)
        return False


def _finite(value: numbers.Real) -> bool:
    """Whether a real number is finite as a float (an int too large for any float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float (10**400)
        return False


def _has_type(value: Any, kind: Any) -> bool:
    """Whether ``value`` fits a field's declared type (``float``, ``int | None``, ``list[float] | None``, ...); a bool
    is not a number, an int is a float; a type this check does not read is left to the field's own validation."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, option) for option in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(kind) or (Any,)
        return isinstance(value, (list, tuple)) and all(_has_type(element, item) for element in value)
    if kind is bool:
        return isinstance(value, bool)
    if kind in (float, int):
        return isinstance(value, numbers.Real if kind is float else numbers.Integral) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return True


def check_field_types(config: Any, names: Sequence[str]) -> None:
    """Refuse a field whose value does not have its declared type (a scalar where a list is expected, text where a
    number is, None where the field takes none), naming the field: a YAML recipe or a Python call hands values over
    unconverted, and a wrong type would otherwise fail deep inside a step, or silently (text iterated as a list)."""
    hints = typing.get_type_hints(type(config))  # the declared types (argument parsers rewrite the fields' own)
    for name in names:
        value = getattr(config, name)
        if not _has_type(value, hints[name]):
            kind = hints[name].__name__ if isinstance(hints[name], type) else str(hints[name]).replace("typing.", "")
            raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r:.60}.")


def check_config_ranges(config: Any) -> None:
    """Each MRTPO setting in its range, and TRL's settings that credit assignment replaces at their defaults (after
    GRPOConfig's own ``__post_init__``, which normalises them)."""
    iterations = config.max_tool_calling_iterations
    # TRL compares it with a counter: -1 runs no tool at all and 2.5 runs three rounds, without a word
    if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0):
        raise ValueError(
            f"max_tool_calling_iterations must be None (no limit) or an integer >= 0, got {iterations!r}."
        )
    if not isinstance(config.credit_assignment, str) or not config.credit_assignment:
        raise ValueError(f"credit_assignment must name a rule, got {config.credit_assignment!r}.")
    if not 0.0 <= config.credit_beta <= 1.0:
        raise ValueError(f"credit_beta must be in [0, 1], got {config.credit_beta}.")
    if config.credit_warmup_steps < 0:
        raise ValueError(f"credit_warmup_steps must be >= 0, got {config.credit_warmup_steps}.")
    if config.credit_warmup_steps >= 1 and config.credit_warmup_steps != int(config.credit_warmup_steps):
        raise ValueError(
            f"credit_warmup_steps must be a whole number of steps, or a share of max_steps below 1, got "
            f"{config.credit_warmup_steps}."
        )
    if config.max_second_moment_ratio < 1.0:
        raise ValueError(
            "max_second_moment_ratio must be >= 1 (1 forbids any redistribution), "
            f"got {config.max_second_moment_ratio}."
        )
    if config.credit_assignment != "grpo":
        # MRTPO's pipeline normalises each reward per group itself (method step 1) and rescales by the
        # token-weighted batch std (step 8): TRL's own aggregation and scaling never run.
        for name, default in (("scale_rewards", "group"), ("multi_objective_aggregation", "sum_then_normalize")):
            if getattr(config, name) != default:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} only applies to credit_assignment='grpo' (plain "
                    f"GRPOTrainer). In {config.credit_assignment!r} mode every reward is normalised per group and "
                    f"the token advantages are rescaled by the batch std; leave {name} at {default!r}, or use "
                    "credit_assignment='grpo' for TRL's own behaviour."
                )
    floor = config.reward_strength_floor
    if floor is not None and not 0.0 < floor <= 0.5:
        raise ValueError(f"reward_strength_floor must be in (0, 0.5] or None, got {floor}.")
    if config.replay_batch_size < 1:
        raise ValueError(f"replay_batch_size must be >= 1, got {config.replay_batch_size}.")
    if config.collapse_warning_steps < 0:
        raise ValueError(f"collapse_warning_steps must be >= 0, got {config.collapse_warning_steps}.")
    if config.divergence_backend not in DIVERGENCE_BACKENDS:
        raise ValueError(
            f"divergence_backend must be one of {', '.join(DIVERGENCE_BACKENDS)}, got {config.divergence_backend!r}."
        )
    if config.replay_chunk_size is not None and config.replay_chunk_size < 1:
        raise ValueError(f"replay_chunk_size must be >= 1 or None, got {config.replay_chunk_size}.")


def check_finite_fields(config: Any, names: Sequence[str]) -> None:
    """Refuse a non-finite value (NaN or infinity) in any of the named numeric fields, or in a list of weights
    (``reward_weights``, ``process_reward_weights``)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and not _finite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r:.40}.")
    for name in ("reward_weights", "process_reward_weights"):
        for i, weight in enumerate(getattr(config, name, None) or ()):
            if not isinstance(weight, numbers.Real) or isinstance(weight, bool) or not _finite(weight):
                raise ValueError(f"{name}[{i}] must be a finite number, got {weight!r:.40}.")
            if not within_float32(weight):
                raise ValueError(f"{name}[{i}]={weight!r:.40} is beyond float32's range.")


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


def _reward_value(name: str, index: int, value: Any) -> float | None:
    """One reward value as a float (None stays None), or a TypeError/ValueError naming the reward and sample."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(
                f"reward function '{name}' returned a tensor of shape {tuple(value.shape)} and dtype {value.dtype} "
                f"for sample {index}; each reward must be one real number (or None where it does not apply)."
            )
        value = value.item()
    elif hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():  # numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward function '{name}' returned {type(value).__name__} {value!r:.60} for sample {index}; each reward "
            "must be a real number (int, float, bool, numpy scalar or 0-d tensor) or None where it does not apply."
        )
    if value == value and not within_float32(value):  # NaN passes: it means "does not apply"
        raise ValueError(
            f"reward function '{name}' returned {value!r:.40} for sample {index}; rewards must be finite and "
            "within float32's range (return None where a reward does not apply, and rescale scores beyond 3.4e38)."
        )
    return float(value)


def check_reward_values(name: str, values: Any, expected: int) -> list[float | None]:
    """What a reward function returned for ``expected`` completions, as floats (None: does not apply; NaN counts as
    None), or an error naming the function and the sample."""
    if (
        isinstance(values, (str, bytes, dict))
        or not isinstance(values, (Sequence, torch.Tensor))
        and not hasattr(values, "__array__")
    ):
        raise TypeError(
            f"reward function '{name}' returned a {type(values).__name__}; it must return a list with one reward per "
            f"completion ({expected} here)."
        )
    values = list(values)
    if len(values) != expected:
        raise ValueError(
            f"reward function '{name}' returned {len(values)} rewards for {expected} completions; it must return "
            "exactly one per completion."
        )
    return [_reward_value(name, i, v) for i, v in enumerate(values)]


def own_copies(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A user function's keyword arguments with its own copies of the prompts, completions and trajectories."""
    own = ("prompts", "completions", "trajectories")
    return {key: copy.deepcopy(value) if key in own else value for key, value in kwargs.items()}


def checked_reward(func: Callable, name: str) -> Callable:
    """``func`` with its return value checked by :func:`check_reward_values` (sync or async, name kept). It gets
    copies of the prompts and completions: a function that edits them changes nothing the next reward, the info
    blocks or the replay see. A first batch scored None throughout, or early batches giving one value, is warned about
    (:func:`_early_batches_check`)."""
    early_batches = _early_batches_check(name)
    # one value per completion (per environment, for an environment's reward called with ``environments`` alone)
    owed = lambda kwargs: len(kwargs.get("completions", kwargs.get("environments")))  # noqa: E731
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):

        @functools.wraps(func)
        async def checked_async(*args, **kwargs):
            values = await func(*args, **own_copies(kwargs))
            return early_batches(check_reward_values(name, values, owed(kwargs)))

        checked_async.__name__ = name  # TRL names a reward by it (a callable object's class name otherwise)
        checked_async.early_batches = early_batches.seen
        return checked_async

    @functools.wraps(func)
    def checked(*args, **kwargs):
        return early_batches(check_reward_values(name, func(*args, **own_copies(kwargs)), owed(kwargs)))

    checked.__name__ = name
    checked.early_batches = early_batches.seen
    return checked


def early_batches_of(func: Callable) -> dict | None:
    """What :func:`checked_reward`'s check has seen of ``func``'s early batches (None for a function it does not
    wrap): ``sample_credit`` puts it back."""
    return getattr(func, "early_batches", None)


# Generation batches after which a reward that gave every sample one value is warned about.
CONSTANT_REWARD_BATCHES = 10


def _early_batches_check(name: str) -> Callable[[list], list]:
    """Passes a reward's values through, warning once when the first batch is None (NaN) throughout (a forgotten
    ``return`` trains as a reward that never applies), and once when the first :data:`CONSTANT_REWARD_BATCHES`
    batches gave every sample one value (a wrong path or column scores everything alike: no advantage anywhere)."""
    seen = {"batches": 0, "values": set()}

    def check(values: list) -> list:
        seen["batches"] += 1
        if seen["batches"] == 1 and values and all(v is None or v != v for v in values):
            warnings.warn(
                f"The reward function '{name}' returned None for every sample of the first generation batch: "
                "those samples get no advantage from it. Ignore this if the reward does not apply to those "
                "samples (TRL's convention for None); otherwise check that it returns its scores.",
                UserWarning,
                stacklevel=2,
            )
        if seen["batches"] <= CONSTANT_REWARD_BATCHES:
            seen["values"].update(v for v in values if v is not None and v == v)
        if seen["batches"] == CONSTANT_REWARD_BATCHES and len(seen["values"]) == 1:
            (value,) = seen["values"]
            warnings.warn(
                f"The reward function '{name}' gave every sample the same value, {value:g}, over the first "
                f"{CONSTANT_REWARD_BATCHES} generation batches: a constant reward gives no advantage anywhere. Check "
                "what it reads (a database path, a dataset column); a strict reward that is right in none of a "
                "group's samples is normal, one that is the same for every sample of every group is not.",
                UserWarning,
                stacklevel=2,
            )
        return values

    check.seen = seen
    return check


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


def check_batch_rewards(rewards: torch.Tensor, names: Sequence[str], num_generations: int, warned: set) -> None:
    """``[N, K]`` rewards of a generation batch, in groups of ``num_generations``, with one host sync: each is finite
    or NaN ("does not apply"), since an infinity would silently turn its group's advantages to 0 (it stops the step
    naming the reward and the sample); a reward that is NaN for some samples of a group and scored for others is
    warned about once (its name joins ``warned``): those samples get advantage 0 from it, not a penalty."""
    nan = torch.isnan(rewards).view(-1, num_generations, rewards.shape[1])
    partly = nan.any(1) & ~nan.all(1)  # [groups, K]
    flags = torch.cat([torch.isinf(rewards), partly]).tolist()
    infinite = [(i, k) for i, row in enumerate(flags[: len(rewards)]) for k, bad in enumerate(row) if bad]
    if infinite:
        sample, k = infinite[0]
        raise ValueError(
            f"reward function '{names[k]}' returned {rewards[sample, k].item()} for sample {sample} of the "
            "generation batch; rewards must be finite (return None where a reward does not apply)."
        )
    for group, row in enumerate(flags[len(rewards) :]):
        for k in (k for k, bad in enumerate(row) if bad and names[k] not in warned):
            warned.add(names[k])
            warnings.warn(
                f"The reward function '{names[k]}' returned None for some samples of group {group} (prompt "
                f"{group} of the generation batch) and a score for the others: None means 'does not apply', so "
                "those samples get advantage 0 from it, not a penalty. Return 0.0 (or the reward's lowest score) "
                "for an answer it cannot parse, and None only where the reward does not apply to the prompt.",
                UserWarning,
                stacklevel=3,
            )


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


def before_model(
    model: Any, args: Any, reward_funcs: Any, info_blocks: Any, datasets: tuple, kwargs: dict, trainer: Any
) -> tuple[Any, type, list, list]:
    """Everything checked before the model loads (the trainer's first point): the model argument, the config's class
    (``trainer``'s default one when None), the credit rule it names and the settings it asks of it, the datasets,
    environments, reward columns and builders (:func:`checked_inputs`). Returns ``(args, rule, reward functions as
    given, as TRL gets them)``."""
    check_model_argument(model)
    if args is None:
        model_name = model if isinstance(model, str) else get_config_model_id(model.config)
        args = trainer.config_class(f"{model_name.split('/')[-1]}-{trainer._name}")
    check_config_class(args, trainer.config_class, type(trainer).__name__)
    rule = resolve_credit_rule(args)  # a name or a dotted path, resolved once
    check_credit_settings(args, rule)
    return (args, rule, *checked_inputs(reward_funcs, info_blocks, *datasets, kwargs))


def checked_inputs(
    reward_funcs: Any, info_blocks: Any, train_dataset: Any, eval_dataset: Any, kwargs: dict[str, Any]
) -> tuple[list, list]:
    """The trainer's inputs checked before the model loads: the datasets (an environment may own the data: its
    ``reset()`` gives the prompt, as in TRL), the environment arguments, the reward columns and the info-block
    builders (those of environments' rewards, which TRL adds while loading, at the first step). Returns the reward
    functions as given (a copy: TRL appends environments' rewards to the list it is given) and as TRL gets them,
    each wrapped by :func:`checked_reward`; a ``rollout_func`` in ``kwargs`` is wrapped by :func:`checked_rollout`."""
    environments = kwargs.get("environment_factory") is not None
    check_dataset(train_dataset, "train", environments)
    check_dataset(eval_dataset, "eval", environments)
    if environments or kwargs.get("tools") or kwargs.get("rollout_func") is not None:
        from .environments import check_environment_arguments, checked_rollout  # loaded by the runs that have them

        check_environment_arguments(kwargs)
        if kwargs.get("rollout_func") is not None:
            kwargs["rollout_func"] = checked_rollout(kwargs["rollout_func"])
    funcs = list(reward_funcs or []) if isinstance(reward_funcs, (list, type(None))) else [reward_funcs]
    names = distinct([f.split("/")[-1] if isinstance(f, str) else function_name(f) for f in funcs])
    check_reward_columns(funcs, names, train_dataset)
    check_reward_columns(funcs, names, eval_dataset, "eval")
    builders = info_blocks if environments else check_builders(info_blocks, names)
    tools = bool(kwargs.get("tools")) or environments
    check_builders_on_first_row(builders, names, train_dataset, tools, environments)
    checked = [f if isinstance(f, (str, torch.nn.Module)) else checked_reward(f, n) for f, n in zip(funcs, names)]
    return funcs, checked


def check_credit_use(
    args: Any,
    rule: type,
    terms: Mapping[str, Any],
    functions: Sequence[tuple[str, Any]],
    relevance_provider: Any,
    blocks: bool,
    engine: str | None,
) -> tuple[bool, list[str]]:
    """Start-up checks of what the run's credit needs from the policy: a provider given to a rule that reads no q, a
    loss that would average token credit away (:func:`check_loss_keeps_token_credit`), sharding that cannot run the
    replay or the terms' forwards (:func:`check_sharded_replay`; ``functions``: the user's reward functions and the
    terms', by name). Returns whether the rule replays, and the options that run extra policy forwards."""
    if relevance_provider is not None and "relevance" not in rule.reads:
        raise ValueError(
            f"the relevance provider {function_name(relevance_provider)!r} was given, but "
            f"credit_assignment={args.credit_assignment!r} reads no q: it would never be called. Choose a rule that "
            "reads q (mrtpo), or drop the provider."
        )
    # a provider of one's own may know the relevant tokens without any info block: it is called all the same
    replays = rule.removal is not None and (blocks or relevance_provider is not None)
    replay = [f"credit_assignment='{args.credit_assignment}'"] if replays else []
    extra = [label for term in terms.values() for label in term.policy_forwards]
    token_credit = [label for term in terms.values() for label in term.token_credit]
    check_loss_keeps_token_credit(args.loss_type, args.importance_sampling_level, [*replay, *token_credit])
    runs_policy = [f"'{name}'" for name, f in functions if getattr(f, "runs_policy_forwards", False)]
    check_sharded_replay(engine, [*replay, *extra], runs_policy, args.ds3_gather_for_generation)
    return replays, [*extra, *runs_policy]
