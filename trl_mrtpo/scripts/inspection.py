"""``trl-mrtpo inspect``: sample, score and replay a few prompts, then show and measure where credit lands.

The localisation report (the paper's Table 4) measures, for a reward whose verifier checks a visible span of the
response (an end phrase, a keyword, the SQL fence, the tool-call tags...), ``Dist`` = share of that reward's q
mass on the span's tokens, ``Tok`` = the span's share of tokens and ``Ratio = Dist / Tok``. Beside it stands a
**control**: the same responses replayed with an irrelevant sentence of the prompt removed instead of the info
block, so a reader can tell a specific effect from rare words attracting q anyway. Both are aggregated over
responses by summing q mass and token counts (a mass-weighted mean).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .._trl import tokenize_prompts
from ..config import MRTPOConfig
from ..diagnostics import CreditRecord, mass_shares
from ..info_blocks import InfoBlock
from ..kits import KIT_NAMES, Kit, get_kit
from ..observability.summaries import token_strings

CONTROL_SENTENCE = "The museum on the corner opens at nine on Sundays."
CONTROL_NAME = "control_irrelevant_sentence"


def control_reward(completions: list, **kwargs) -> list[float]:
    """Constant 0: the control slot never changes an advantage; it only exists to be replayed."""
    return [0.0] * len(completions)


control_reward.__name__ = CONTROL_NAME


def control_block(*, prompt, completion, row, score) -> InfoBlock:
    """The irrelevant sentence, appended to the training prompt in the control replay."""
    return InfoBlock(CONTROL_SENTENCE)


def with_control(record: CreditRecord, control: CreditRecord) -> CreditRecord:
    """``record`` (the task's rewards) with the control replay's slot added last, on the same responses. The control
    pass's completions may be shorter (padding): its per-token rows are padded with q 0 and weight 1."""
    import dataclasses

    length = record.relevance.shape[-1]

    def padded(tensor: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(tensor[..., :length], (0, length - min(tensor.shape[-1], length)), value=value)

    return dataclasses.replace(
        record,
        rewards=torch.cat([record.rewards, control.rewards], 1),
        group_advantages=torch.cat([record.group_advantages, control.group_advantages], 1),
        relevance=torch.cat([record.relevance, padded(control.relevance, 0.0)], 1),
        replayed=torch.cat([record.replayed, control.replayed], 1),
        weights=torch.cat([record.weights, padded(control.weights, 1.0)], 1),
        reward_betas=torch.cat([record.reward_betas, control.reward_betas]),
        groups=None
        if record.groups is None
        else torch.cat(
            [record.groups, record.groups.new_tensor([[record.groups.shape[1]]]).expand(record.groups.shape[0], 1)], 1
        ),
        info_blocks=None
        if record.info_blocks is None
        else [
            own + (control.info_blocks[j] if control.info_blocks else [None])
            for j, own in enumerate(record.info_blocks)
        ],
        failure_suffix=None
        if record.failure_suffix is None
        else torch.nn.functional.pad(record.failure_suffix, (0, 0, 0, 1), value=False),
    )


def model_token_ids(record: CreditRecord) -> list[list[int]]:
    """Each response's completion ids up to its last model token (a tool result after it changes no q before it)."""
    ids = []
    for j in range(record.mask.shape[0]):
        where = record.mask[j].nonzero()
        ids.append(record.completion_ids[j, : int(where[-1]) + 1 if len(where) else 1].tolist())
    return ids


def load_completions(path: str) -> tuple[list[dict], list[str | list[dict]], int, list[str]]:
    """Existing completions from a JSONL file: one line per response with ``prompt``, ``completion`` and the row
    fields the task's rewards read. A completion is a string, or a recorded tool trajectory: the list of messages
    TRL's tool loop produces (assistant turns, with their ``tool_calls``, and ``tool`` results). Returns ``(rows,
    completions, group_size, lines)``, ``lines`` naming each completion's file and line; every prompt needs the same
    number of responses, and completions come back grouped by prompt in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{path} line {number} is a JSON {type(entry).__name__}, not an object")
            completion = entry.get("completion")
            trajectory = isinstance(completion, list) and all(isinstance(m, dict) and "role" in m for m in completion)
            if "prompt" not in entry or not (isinstance(completion, str) or trajectory):
                raise ValueError(
                    f"{path} line {number}: needs 'prompt' and a 'completion': a string, or the list of messages "
                    "TRL's tool loop produces ({'role': 'assistant', 'tool_calls': [...]}, {'role': 'tool', ...})"
                )
            if trajectory and not any(m["role"] == "assistant" for m in completion):
                raise ValueError(f"{path} line {number}: the trajectory holds no assistant turn")
            for call in (c for m in completion if trajectory for c in m.get("tool_calls") or ()):
                function = call.get("function", call) if isinstance(call, dict) else None
                if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
                    raise ValueError(
                        f"{path} line {number}: a tool call is {call!r:.80}; it is {{'function': {{'name': ..., "
                        "'arguments': {...}}}} (or the function's name and arguments alone), as TRL records them"
                    )
            groups.setdefault(json.dumps(entry["prompt"], sort_keys=True), []).append((entry, f"{path} line {number}"))
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(f"{path}: every prompt needs the same number of completions, found {sorted(sizes)}")
    if sizes == {1}:
        raise ValueError(
            f"{path}: one completion per prompt; credit compares the responses to a prompt, so give each prompt at "
            "least 2 (the same prompt on several lines)"
        )
    rows = [{k: v for k, v in group[0][0].items() if k != "completion"} for group in groups.values()]
    completions = [entry["completion"] for group in groups.values() for entry, _ in group]
    return rows, completions, sizes.pop(), [line for group in groups.values() for _, line in group]


def with_task_fields(rows: list[dict], dataset) -> list[dict]:
    """Rows of a completions file given the fields they leave out from the task's own row with the same prompt (a
    task's built-in prompt: the file need not copy its columns, nor a path that only holds on the machine that
    wrote it, such as a database's). A field the file gives is kept."""
    own = {json.dumps(row["prompt"], sort_keys=True): row for row in dataset}
    return [{**own.get(json.dumps(row["prompt"], sort_keys=True), {}), **row} for row in rows]


def recorded_turns(tokenizer, trajectories: list[list[dict]]):
    """A ``_generate_single_turn`` for a trainer class that serves recorded tool trajectories instead of sampling:
    each call answers every sequence TRL asks about with its trajectory's next assistant turn, rendered by the chat
    template as the model would have written it (an empty reasoning block the template adds is left out). TRL's
    tool loop parses the calls, runs them in the row's environment (so the tool results are the environment's) and
    masks them, as in training. Sequences are matched to their trajectory by the ids served so far; one asking
    beyond its recorded turns gets the end of turn. Returns it and each trajectory's count of turns served."""
    turns = [[m for m in trajectory if m["role"] == "assistant"] for trajectory in trajectories]
    served: list[list[int] | None] = [None] * len(trajectories)  # each trajectory's ids so far (prompt + turns)
    taken = [0] * len(trajectories)
    asked = [{"role": "user", "content": "."}]  # a turn is rendered after a stand-in question, then cut from it
    before = tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)

    def render(message: dict) -> list[int]:
        functions = [call.get("function", call) for call in message.get("tool_calls") or []]
        calls = [{"type": "function", "function": {"name": f["name"], "arguments": f.get("arguments", {})}}
                 for f in functions]  # fmt: skip
        turn = {
            "role": "assistant",
            "content": message.get("content") or "",
            **({"tool_calls": calls} if calls else {}),
        }
        text = tokenizer.apply_chat_template([*asked, turn], tokenize=False)
        written = re.sub(r"^<think>\s*</think>\s*", "", text[len(before) :])  # an empty reasoning block left out
        return tokenizer(written.rstrip("\n"), add_special_tokens=False)["input_ids"]

    def generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        replies, first = [], all(s is None for s in served)
        for position, ids in enumerate(prompt_ids):
            ids = list(ids)
            if first:  # the first turn: the batch in order
                j = position
            else:
                waiting = (j for j, s in enumerate(served) if s and ids[: len(s)] == s and taken[j] < len(turns[j]))
                j = next(waiting, None)
            if j is None or taken[j] >= len(turns[j]):
                reply = [tokenizer.eos_token_id]
            else:
                reply = render(turns[j][taken[j]])
                taken[j] += 1
                served[j] = ids + reply
            replies.append(reply)
        return replies, None

    return generate_single_turn, taken


def replaying_class(trainer_class: type, trajectories: list[list[dict]], tokenizer) -> tuple[type, list, list[int]]:
    """``trainer_class`` with the recorded ``trajectories``' turns served in place of sampling (see
    :func:`recorded_turns`); returns it, the list that the message lists TRL's tool loop ends with are appended to,
    and the turns served."""
    serve, served = recorded_turns(tokenizer, trajectories)
    replayed: list[list[dict]] = []

    def tool_call_loop(self, *args):
        result = super(replaying, self)._tool_call_loop(*args)
        replayed.extend(result[1])  # each sample's messages, the environment's tool results among them
        return result

    methods = {"_generate_single_turn": serve, "_tool_call_loop": tool_call_loop}
    replaying = type(f"Replaying{trainer_class.__name__}", (trainer_class,), methods)
    return replaying, replayed, served


def check_as_recorded(trajectories: list, replayed: list, served: list[int], lines: list[str], args) -> None:
    """Refuses a recorded trajectory that TRL's tool loop did not replay as recorded, naming its line: one stopped
    before its last turn (the recipe's ``max_tool_calling_iterations``, or its length), or one whose tool results the
    row's environment does not return (a recorded error, a row lacking what ``reset()`` reads): inspect would score
    another trajectory than the one recorded."""
    for trajectory, messages, taken, line in zip(trajectories, replayed, served, lines, strict=True):
        turns = sum(m["role"] == "assistant" for m in trajectory)
        if taken < turns:
            raise ValueError(
                f"{line}: {taken} of its {turns} assistant turns were replayed: TRL's tool loop stops it at "
                f"max_tool_calling_iterations ({args.max_tool_calling_iterations}) or max_completion_length "
                f"({args.max_completion_length} tokens), as training would; inspect scores a trajectory as recorded."
            )
        returned = [str(m.get("content")) for m in messages if m["role"] == "tool"]
        recorded = [str(m.get("content")) for m in trajectory if m["role"] == "tool"]
        for i, (kept, given) in enumerate(zip(recorded, returned), 1):
            if kept != given:
                raise ValueError(
                    f"{line}: its tool result {i} is recorded as {kept!r:.80} but the row's environment returns "
                    f"{given!r:.80}; inspect runs the calls again in the row's environment and would score its "
                    "result. Give the row the fields the environment's reset() reads, or record against it."
                )


def fixed_rollout(completions: list[str] | list[list[int]]):
    """A TRL ``rollout_func`` that serves ``completions`` (texts, or token ids as they were sampled) in order instead
    of sampling (for replaying existing responses)."""
    queue = list(completions)

    def rollout(prompts, trainer):
        if len(prompts) > len(queue):
            raise ValueError(f"{len(prompts)} prompts to answer but only {len(queue)} completions left")
        served = [queue.pop(0) for _ in prompts]
        tokenizer = trainer.processing_class
        completion_ids = [
            tokenizer(item, add_special_tokens=False)["input_ids"] if isinstance(item, str) else list(item)
            for item in served
        ]
        return {
            "prompt_ids": tokenize_prompts(trainer, prompts),
            "completion_ids": completion_ids,
            "logprobs": None,
        }

    return rollout


# ------------------------------------------------------------------------------------------------ the report
def token_mask(tokens: list[str], spans: list[tuple[int, int]]) -> torch.Tensor:
    """Tokens overlapping any character span (token offsets from the concatenated per-token strings)."""
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    position = 0
    for i, token in enumerate(tokens):
        start, end = position, position + len(token)
        mask[i] = any(s < end and start < e for s, e in spans)
        position = end
    return mask


def mass_share(relevance: torch.Tensor, mass: float = 0.8) -> float:
    """:func:`mass_shares` of one profile."""
    values = relevance.flatten()[None]
    return mass_shares(values, torch.ones_like(values, dtype=torch.bool), mass).item()


def model_positions(mask: torch.Tensor) -> list[torch.Tensor]:
    """Per response, the positions of the model's own tokens: where ``mask`` (``[B, C]``: the completion mask, times
    TRL's tool mask in tool rollouts) is 1. Never the first ``mask.sum()`` positions, which on a tool rollout hold
    tool results and miss the later turns. Two host syncs for the whole batch."""
    columns = mask.bool().nonzero(as_tuple=True)[1]
    return list(columns.split(mask.bool().sum(-1).tolist()))


@dataclass
class LocalisationRow:
    reward: str
    span: str
    responses: int
    dist: float
    tok: float
    ratio: float
    control_dist: float
    control_ratio: float


def localisation_report(
    record: CreditRecord, tokenizer, rows: list[dict], kit: Kit, reward_names: list[str], num_generations: int
) -> list[LocalisationRow]:
    """Dist / Tok / Ratio per (reward, span kind), beside the control replay's ratio on the same spans.

    Spans come from ``kit.spans``. Only responses where the span occurs and both the reward and the control were
    replayed with non-zero q count. A kit with a ``report_label`` (instruction following: slot k is a different
    constraint per prompt) has its rewards pooled by span kind.
    """
    if kit.spans is None:
        return []
    control = reward_names.index(CONTROL_NAME)
    totals = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])  # responses, q on span, q in all, span tokens, tokens
    control_totals = defaultdict(lambda: [0.0, 0.0])
    for j, text in enumerate(record.completions):
        row = rows[j // num_generations]
        length = int(record.mask[j].sum())
        if length == 0:
            continue
        tokens = token_strings(tokenizer, record.completion_ids[j, :length].tolist())
        for name, (kind, spans) in kit.spans(row, text).items():
            k = reward_names.index(name)
            span = token_mask(tokens, spans)
            if not span.any() or not (record.replayed[j, k] and record.replayed[j, control]):
                continue
            q = record.relevance[j, k, :length]
            q_control = record.relevance[j, control, :length]
            if q.sum() <= 0 or q_control.sum() <= 0:
                continue
            key = (kit.report_label or name, kind)
            entry = totals[key]
            entry[0] += 1
            entry[1] += q[span].sum().item()
            entry[2] += q.sum().item()
            entry[3] += span.sum().item()
            entry[4] += length
            control_totals[key][0] += q_control[span].sum().item()
            control_totals[key][1] += q_control.sum().item()
    report = []
    for (reward, kind), (count, q_span, q_all, tok_span, tok_all) in sorted(totals.items()):
        dist, tok = q_span / q_all, tok_span / tok_all
        control_dist = control_totals[(reward, kind)][0] / control_totals[(reward, kind)][1]
        report.append(LocalisationRow(reward, kind, count, dist, tok, dist / tok, control_dist, control_dist / tok))
    return report


REPORT_HEADER = ["reward", "span", "responses", "dist", "tok", "ratio", "control_dist", "control_ratio"]


def report_is_ours(path) -> bool:
    """A localisation report this package wrote (its header row)."""
    with open(path, newline="", errors="replace") as f:
        return next(csv.reader(f), None) == REPORT_HEADER


def write_report(report: list[LocalisationRow], path: str) -> None:
    from ..outputs import write_output

    rows = io.StringIO()
    writer = csv.writer(rows)
    writer.writerow(REPORT_HEADER)
    for r in report:
        writer.writerow([r.reward, r.span, r.responses, f"{r.dist:.4f}", f"{r.tok:.4f}", f"{r.ratio:.3f}",
                         f"{r.control_dist:.4f}", f"{r.control_ratio:.3f}"])  # fmt: skip
    write_output(path, rows.getvalue())


def format_report(report: list[LocalisationRow]) -> str:
    lines = [f"{'reward':<24}{'span':<16}{'n':>4}{'Dist':>8}{'Tok':>8}{'Ratio':>8}{'ctrl Ratio':>12}"]
    for r in report:
        lines.append(
            f"{r.reward:<24}{r.span:<16}{r.responses:>4}{r.dist:>8.3f}{r.tok:>8.3f}{r.ratio:>7.2f}x{r.control_ratio:>11.2f}x"
        )
    return "\n".join(lines)


def sample_credit(trainer, rows: list[dict], num_generations: int) -> CreditRecord:
    """Generate ``num_generations`` responses per row with ``trainer``'s policy, score, replay, and return the batch's
    :class:`~trl_mrtpo.diagnostics.CreditRecord` (:meth:`~trl_mrtpo.MRTPOTrainer.sample_credit`, which leaves the
    run as it was), without training; the module's mode is as it was."""
    was_training = trainer.model.training
    trainer.model.train()  # TRL picks the train-mode group size and sampling from the module's mode
    try:
        return trainer.sample_credit([dict(row) for row in rows for _ in range(num_generations)])
    finally:
        trainer.model.train(was_training)


def inspect_credit(
    model: str = "embedded",
    adapter: str | None = None,
    task: str = "basic",
    completions: str | None = None,
    num_prompts: int = 4,
    num_generations: int = 4,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    beta: float | None = None,
    seed: int = 0,
    output: str | None = None,
    report: str | None = None,
    reward_funcs: list | None = None,
    info_blocks: list | None = None,
    dataset=None,
    return_verdicts: bool = False,
    reward_strength_floor: float | None = MRTPOConfig.reward_strength_floor,
    recipe_args: MRTPOConfig | None = None,
    trainer_class: type | None = None,
    process_rewards: list | None = None,
    chat_template: str | None = None,
    environment_factory=None,
    verbose: bool = False,
    overwrite: bool = False,
) -> tuple:
    """Sample (or, with ``completions``, replay existing responses of) a few prompts of the training data, score and
    replay them exactly as training does, replay the control on the same responses, and return the credit record
    (the control last) and the localisation report. Writes the heatmap page to ``output`` and the report as CSV to
    ``report`` only when they are given (their folders are created before any work; a file there that trl-mrtpo did
    not write is refused then, unless ``overwrite``); ``verbose`` prints the verdicts and the report before the files
    are written.

    The task is ``task``'s kit, or your own: ``reward_funcs`` and ``info_blocks`` (functions and builders, as
    ``MRTPOTrainer`` takes them) with ``dataset`` (rows with a ``prompt``); the localisation report needs a kit's
    spans. With ``return_verdicts`` the result has a third entry, :func:`reward_verdicts` of the record (what token
    credit would do with each reward, per-reward strength read with ``reward_strength_floor``). ``model``: a hub id,
    a folder, ``"embedded"`` or ``"embedded-agent"``; ``adapter``: a LoRA adapter folder to apply.

    ``chat_template`` replaces the tokenizer's: named as a recipe's ``chat_template_path`` names it (a template TRL
    ships, e.g. ``"qwen3"``, a Jinja file, or a folder with a tokenizer), or Jinja text. ``environment_factory``
    (TRL's) gives a multi-turn tool task its tools (a kit's own environment is used when ``task`` names it).
    ``recipe_args`` (a recipe's config),
    ``trainer_class`` and ``process_rewards`` score as that recipe trains: its credit settings (every field
    MRTPOConfig, or the research room's config, adds to GRPOConfig), reward weights and temperature;
    ``temperature`` and ``beta`` given here win, and default to the recipe's (else 1.0 and 0.5).
    """
    from ..outputs import distinct_outputs, page_is_ours, writable_file
    from .policy import load_policy

    distinct_outputs(output=output, report=report)  # the page, then the CSV over it
    for path, ours in ((output, page_is_ours), (report, report_is_ours)):  # refused now, not after the sampling
        if path:
            writable_file(path, overwrite, ours)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    print(f"Loading {model}{f' with adapter {adapter}' if adapter else ''}...", flush=True)
    policy, tokenizer = load_policy(model, adapter)
    if chat_template is not None:
        from ..chat_templates import chat_template as named_template

        is_text = "{%" in chat_template or "{{" in chat_template
        tokenizer.chat_template = chat_template if is_text else named_template(chat_template)
    inspected = inspected_responses(
        task, reward_funcs, info_blocks, dataset, completions, num_prompts, num_generations, max_new_tokens, seed,
        environment_factory, trainer_class, policy, tokenizer,
    )  # fmt: skip
    credit = recipe_credit_settings(recipe_args) if recipe_args is not None else {}
    if temperature is not None or "temperature" not in credit:
        credit["temperature"] = 1.0 if temperature is None else temperature
    if beta is not None or "credit_beta" not in credit:
        credit["credit_beta"] = 0.5 if beta is None else beta
    config_class = type(recipe_args) if recipe_args is not None else MRTPOConfig
    record, names, leaks = sampled_record(policy, tokenizer, inspected, config_class, credit, process_rewards, seed)
    rows, kit, group = inspected.rows, inspected.kit, inspected.num_generations
    located = localisation_report(record, tokenizer, rows, kit, names, group) if kit else []
    verdicts = reward_verdicts(record, tokenizer, names, group, reward_strength_floor, leaks, bool(completions))
    write_inspection(record, tokenizer, names, located, verdicts, inspected.label, output, report, verbose)
    return (record, located, verdicts) if return_verdicts else (record, located)


@dataclass
class InspectedResponses:
    """What an inspection replays: the task's rewards and blocks (and its kit, for the localisation report's spans),
    the rows, how many responses per row, and how they arrive (sampled; served by ``rollout``; or recorded tool
    trajectories served by ``trainer_class``, checked against ``recorded`` after)."""

    label: str
    kit: Kit | None
    reward_funcs: list
    info_blocks: list
    rows: list[dict]
    num_generations: int
    max_new_tokens: int
    trainer_class: type
    environment_factory: Callable | None = None
    rollout: Callable | None = None
    recorded: tuple = ()  # (trajectories, replayed, served, lines) for check_as_recorded


def inspected_responses(
    task: str, reward_funcs, info_blocks, dataset, completions: str | None, num_prompts: int, num_generations: int,
    max_new_tokens: int, seed: int, environment_factory, trainer_class: type | None, policy, tokenizer,
) -> InspectedResponses:  # fmt: skip
    """What reads the task: a kit's (``task``) or your own rewards, blocks and ``dataset``; the rows sampled from, or
    the responses of a ``completions`` file (strings served by a fixed rollout, or recorded tool trajectories
    served through TRL's tool loop, which ``environment_factory`` runs again). Loads nothing but the file."""
    from ..trainer import MRTPOTrainer

    if reward_funcs is None:
        kit = get_kit(task)
        reward_funcs, info_blocks = kit.rewards, kit.info_blocks
        environment_factory = environment_factory or kit.environment
        dataset = dataset if dataset is not None else kit.dataset(num_prompts, seed, None)
    else:
        # a kit's own rewards (a recipe's task, say) keep its spans for the localisation report
        kit = get_kit(task) if task in KIT_NAMES and list(reward_funcs) == list(get_kit(task).rewards) else None
        task = task if kit is not None else "your"
        info_blocks = info_blocks if info_blocks is not None else [None] * len(reward_funcs)
        if dataset is None and not completions:
            raise ValueError("inspect_credit with your own reward_funcs needs a dataset (rows with a 'prompt').")
    inspected = InspectedResponses(
        task, kit, list(reward_funcs), list(info_blocks), [], num_generations, max_new_tokens,
        trainer_class or MRTPOTrainer, environment_factory,
    )  # fmt: skip
    if not completions:
        inspected.rows = [dict(dataset[i]) for i in range(min(num_prompts, len(dataset)))]
        return inspected
    inspected.rows, texts, inspected.num_generations, lines = load_completions(completions)
    if dataset is not None:
        inspected.rows = with_task_fields(inspected.rows, dataset)
    recorded = [text for text in texts if isinstance(text, list)]
    if recorded and (len(recorded) < len(texts) or environment_factory is None):
        raise ValueError(
            f"{completions}: recorded tool trajectories are replayed through TRL's tool loop, all of them (not "
            "mixed with strings) and with the task's environment (a kit's, or environment_factory=)."
        )
    if recorded:  # the recorded turns served in place of sampling; the environment runs the calls again
        inspected.trainer_class, replayed, served = replaying_class(inspected.trainer_class, recorded, tokenizer)
        inspected.recorded = (recorded, replayed, served, lines)
        # as long as the model reads: a recorded trajectory is scored whole, or refused (check_as_recorded)
        inspected.max_new_tokens = max(max_new_tokens, getattr(policy.config, "max_position_embeddings", 0))
    else:
        inspected.rollout = fixed_rollout(texts)
    return inspected


def sampled_record(
    policy, tokenizer, inspected: InspectedResponses, config_class: type, credit: dict, process_rewards, seed: int
) -> tuple[CreditRecord, list[str], dict[str, str]]:
    """What samples: the responses scored and replayed exactly as training does (``credit``: the recipe's settings),
    then the control (an irrelevant sentence appended to the training prompt) on the same responses. Returns the
    record with the control last, the names (the control's last) and the blocks whose text survives their removal."""
    import tempfile
    import warnings

    from datasets import Dataset

    from ..trainer import MRTPOTrainer

    rows, group = inspected.rows, inspected.num_generations
    inspecting = {
        "per_device_train_batch_size": len(rows) * group,  # one generation batch holds them all
        "num_generations": group,
        "max_completion_length": inspected.max_new_tokens,
        "credit_warmup_steps": 0,
        "replay_only_varying": False,  # show q for every reward with a block, varying or not
        "use_cpu": not torch.cuda.is_available(),
        "bf16": False,
        "report_to": "none",
        "seed": seed,
    }
    served = inspected.rollout is not None or inspected.recorded
    what = "Replaying the given" if served else "Sampling, scoring and replaying"
    environment = {"environment_factory": inspected.environment_factory} if inspected.environment_factory else {}
    with tempfile.TemporaryDirectory(prefix="trl-mrtpo-inspect-") as scratch, warnings.catch_warnings():
        # TRL calls rollout_func experimental; here it only serves responses already sampled
        warnings.filterwarnings("ignore", message=".*rollout_func.*")
        trainer = inspected.trainer_class(
            model=policy,
            reward_funcs=inspected.reward_funcs,
            info_blocks=inspected.info_blocks,
            args=config_class(**{**credit, **inspecting, "output_dir": scratch}),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            rollout_func=inspected.rollout,
            process_rewards=process_rewards or None,
            **environment,
        )
        print(f"{what} {len(rows) * group} responses to {len(rows)} prompts (nothing is trained)...")
        record = sample_credit(trainer, rows, group)
        if inspected.recorded:
            check_as_recorded(*inspected.recorded, trainer.args)
        # the control: the same responses, the training prompt against it with an irrelevant sentence appended
        control_config = MRTPOConfig(  # the recipe's context: its prompt rendering and its blocks' separator
            **{name: credit[name] for name in ("temperature", "credit_beta", *CONTEXT_FIELDS) if name in credit},
            **inspecting,
            output_dir=scratch,
            reward_strength_floor=None,
        )
        control = MRTPOTrainer(
            model=policy,
            reward_funcs=[control_reward],
            info_blocks=[control_block],
            args=control_config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            rollout_func=fixed_rollout(model_token_ids(record)),
        )
        record = with_control(record, sample_credit(control, rows, group))
    return record, [*trainer.reward_func_names, CONTROL_NAME], trainer.information_leaks


def write_inspection(
    record: CreditRecord, tokenizer, names: list[str], located: list, verdicts: list, label: str,
    output: str | None, report: str | None, verbose: bool,
) -> None:  # fmt: skip
    """What writes: the verdicts and the report printed (``verbose``), the heatmap page (``output``) and the report
    as CSV (``report``), each where given."""
    from ..outputs import write_output

    if verbose:
        print(format_report(located) if located else NO_REPORT)
        print(format_verdicts(verdicts))
    if output:
        from ..observability.viz import credit_heatmap_html

        write_output(output, credit_heatmap_html(record, tokenizer, names, title=f"MRTPO token credit: {label} task"))
        print(f"Heatmap written to {output}")
    if report:
        write_report(located, report)
        print(f"Localisation report written to {report}")


NO_REPORT = (
    "No localisation report: it needs the spans a task kit declares (which tokens of a response each reward's "
    "verifier checks); rewards of your own declare none. The verdicts below read q without them."
)


# ------------------------------------------------------------------------------------------------ the verdicts
VERDICT_RATIO = 2.0  # a reward's mean q at least this many times the control's: its block moves the credit


@dataclass
class Verdict:
    """What inspecting one reward found: how often it varies within a group (the pairs training replays), its q
    against the control sentence's on the same responses, how concentrated its q is, its per-reward strength at this
    batch's reading (``g_k``, 1: the full redistribution, 0: it would rest), what that means, and the share of
    responses whose q peaks on another token than the control's (reported, not judged: see docs/inspect.md)."""

    reward: str
    varying: float
    q_over_control: float
    concentration: float
    tokens: list[str]
    strength: float
    verdict: str
    peaks_apart: float = math.nan
    pairs: int = 0  # pairs of responses to one prompt it scores differently that differ in a few tokens
    pair_hits: int = 0  # of those, the pairs where its q peaks on the tokens they differ in
    control_hits: int = 0  # the same for the control's q, on the same pairs
    deciding_share: float = math.nan  # the share of its q on those tokens, over its pairs
    deciding_tokens: float = math.nan  # the share of the pairs' tokens they are (q spread evenly would put there)
    mixed_pairs: int = 0  # its pairs that another reward scores differently too


def reward_verdicts(
    record: CreditRecord,
    tokenizer,
    reward_names: list[str],
    num_generations: int,
    strength_floor: float | None = MRTPOConfig.reward_strength_floor,
    leaks: dict[str, str] | None = None,
    completions_given: bool = False,
) -> list[Verdict]:
    """One :class:`Verdict` per reward of an inspected record (the last name is the control).

    The rule (docs/inspect.md): a reward that never varies within a group is never replayed in training (its credit
    stays uniform); one whose mean q is at least ``VERDICT_RATIO`` times the control sentence's on the same
    responses will have its credit moved onto the tokens where its q is largest, unless per-reward strength
    (``strength_floor``, None: off) reads its q as shaped like the other rewards' and rests it; otherwise token
    credit still moves its credit to where its q peaks, but nothing shows those are the tokens its verifier decides
    on (an irrelevant sentence moves the policy as much). The strength is this batch's reading over the task's
    rewards (the control slot left out), not training's running mean. A reward in ``leaks`` (the trainer's
    ``information_leaks``) is told that its block's text survives its removal. Every figure reads the model's tokens
    (:func:`model_positions`: tool results left out).
    Where the batch holds pairs of responses to one prompt that the reward scores differently and that differ in a few
    tokens (:func:`deciding_pairs`), the verdict is the pair test's (:func:`pair_verdict`); q/control stays a
    column. A term's contribution (a process reward's) gets a row of its own (:func:`contribution_verdict`). With
    ``completions_given`` the advice never asks for ``--completions``.
    """
    from ..credit import group_advantages, relevance_specificity, reward_strength

    control = reward_names.index(CONTROL_NAME)
    positions = model_positions(record.mask)
    _, in_group = group_advantages(record.rewards, num_generations)  # [B, K]: varies within the response's group
    task = [k for k in range(len(reward_names)) if k != control]
    groups = None if record.groups is None else record.groups[:, task]
    specificity = relevance_specificity(record.relevance[:, task], record.replayed[:, task], groups=groups)
    strengths = torch.ones(len(task)) if strength_floor is None else reward_strength(specificity, strength_floor)
    # tool results inside a response (model positions with a gap): recorded trajectories, not hand-written text
    tool_rollouts = any(len(where) and where[-1] - where[0] + 1 > len(where) for where in positions)
    verdicts = []
    for k, name in enumerate(reward_names):
        if k == control:
            continue
        varying = in_group[::num_generations, k].float().mean().item()  # share of groups where it varies
        both = [
            j
            for j, where in enumerate(positions)
            if record.replayed[j, k] and record.replayed[j, control] and len(where)
        ]
        own = {j: record.relevance[j, k, positions[j]] for j in both}
        controls = {j: record.relevance[j, control, positions[j]] for j in both}
        q = sum(own[j].sum().item() for j in both)
        q_control = sum(controls[j].sum().item() for j in both)
        ratio = q / q_control if q_control > 0 else (math.inf if q > 0 else math.nan)
        shares = [mass_share(own[j]) for j in both]
        shares = [x for x in shares if x == x]
        concentration = sum(shares) / len(shares) if shares else math.nan
        apart = [float(own[j].argmax() != controls[j].argmax()) for j in both]
        peaks = sorted(
            ((value, j, positions[j][i].item()) for j in both for i, value in enumerate(own[j].tolist())),
            reverse=True,
        )[:3]
        tokens = [token_strings(tokenizer, [record.completion_ids[j, t].item()])[0] for _, j, t in peaks]
        strength = strengths[task.index(k)].item()
        aligned = deciding_pairs(record, k, num_generations, positions)
        pairs = [p for p in aligned if all(record.replayed[j, c] for j in p[:2] for c in (k, control))]
        # a feedback block (a failure's error message) is replayed on one side of each pair only: no pair test
        unpaired = ONE_SIDED.format(len(aligned)) if aligned and not pairs else NO_PAIRS
        others = [c for c in task if c != k]
        mixed = sum(any(differ(record.rewards[[a, b], c]) for c in others) for a, b, *_ in pairs)
        (hits, share, even, pair_peaks), (control_hits, *_) = (
            pair_test(record, c, pairs, positions) for c in (k, control)
        )
        shown = [(j, t) for j, t, hit in pair_peaks if hit == (2 * hits >= len(pairs))]  # the peaks the verdict names
        pair_tokens = list(
            dict.fromkeys(token_strings(tokenizer, [record.completion_ids[j, t].item()])[0] for j, t in shown)
        )
        if not both:
            text = (
                "replayed for no response here (it has no info block, or none applied): its credit stays uniform, "
                "as GDPO spreads it."
            )
        elif name in (leaks or {}):
            text = (
                f"its info block's text is still in the context that removes it, inside {leaks[name]}: its q cannot "
                "measure that information. Rewards that judge with one piece of information should be given the "
                "same block text, which they then share as one information group."
            )
        elif varying == 0:
            text = (
                "never varies within a group here: training would replay nothing for it and keep its credit "
                "uniform; more generations per prompt, or a graded reward, would let it vary."
            )
        elif strength == 0:  # whatever q shows, training keeps this reward's credit uniform while it rests
            stands_out = "stands out from the control but " if ratio >= VERDICT_RATIO else ""
            text = (
                f"q {stands_out}has the shape of the other rewards' q (specificity "
                f"{specificity[task.index(k)].item():.3f}, at or under the floor {strength_floor}): per-reward "
                "strength would rest it and keep its credit uniform. A block that names what only this reward's "
                "verifier checks would set it apart."
            )
        elif pairs:
            text = pair_verdict(hits, control_hits, len(pairs), share, even, pair_tokens, mixed)
        elif ratio >= VERDICT_RATIO:
            text = f"token credit will move this reward's credit onto these tokens: {', '.join(map(repr, tokens))}"
            text += f"{unpaired}."
        else:
            action = UNDER_TWICE_ACTION["one-sided" if aligned else "given" if completions_given else tool_rollouts]
            text = (
                f"q is under twice the control's: its credit still moves to where its q peaks "
                f"({', '.join(map(repr, tokens))}); {action} (note below){unpaired}."
            )
        peaks_apart = sum(apart) / len(apart) if apart else math.nan
        verdicts.append(
            Verdict(
                name,
                varying,
                ratio,
                concentration,
                tokens,
                strength,
                text,
                peaks_apart,
                len(pairs),
                hits,
                control_hits,
                share,
                even,
                mixed,
            )  # fmt: skip
        )
    return verdicts + [contribution_verdict(record, name, tokenizer, positions) for name in record.contributions]


PAIR_OVERLAP = 0.5  # a pair's token alignment keeps at least this share of the longer response


def differ(scores: torch.Tensor) -> bool:
    """Whether a reward scores two responses differently (None, read as NaN, differs from nothing)."""
    return not scores.isnan().any().item() and scores[0].item() != scores[1].item()


def deciding_pairs(
    record: CreditRecord, k: int, num_generations: int, positions: list[torch.Tensor]
) -> list[tuple[int, int, list[int], list[int]]]:
    """Pairs of responses to one prompt that reward ``k`` scores differently and whose model tokens align (their
    longest common blocks, :class:`difflib.SequenceMatcher`) on at least :data:`PAIR_OVERLAP` of the longer one:
    ``(a, b, a's deciding tokens, b's)``, the tokens outside the common blocks (indices into ``positions``), where
    the pair differs and so where the reward decides."""
    import difflib
    import itertools

    pairs = []
    for start in range(0, len(positions), num_generations):
        for a, b in itertools.combinations(range(start, min(start + num_generations, len(positions))), 2):
            if not differ(record.rewards[[a, b], k]):
                continue
            ids = [record.completion_ids[j, positions[j]].tolist() for j in (a, b)]
            blocks = difflib.SequenceMatcher(None, *ids, autojunk=False).get_matching_blocks()
            if sum(block.size for block in blocks) < PAIR_OVERLAP * max(map(len, ids)):
                continue
            common = [{i for block in blocks for i in range(block[side], block[side] + block.size)} for side in (0, 1)]
            deciding = [[i for i in range(len(ids[side])) if i not in common[side]] for side in (0, 1)]
            if deciding[0] or deciding[1]:
                pairs.append((a, b, *deciding))
    return pairs


def pair_test(
    record: CreditRecord, column: int, pairs: list, positions: list[torch.Tensor]
) -> tuple[int, float, float, list[tuple[int, int, bool]]]:
    """In how many ``pairs`` the q of ``column`` (a reward, or the control) peaks on a deciding token (over both
    responses' tokens), the share of its q mass on them, the share of the pairs' tokens they are (what an even
    spread of q would put there), and each pair's peak: ``(response, token, deciding)``."""
    hits, inside, total, peaks, decisive, tokens = 0, 0.0, 0.0, [], 0, 0
    for a, b, deciding_a, deciding_b in pairs:
        q = [record.relevance[j, column, positions[j]].double() for j in (a, b)]
        both = torch.cat(q)
        deciding = torch.zeros(len(both), dtype=torch.bool)
        deciding[deciding_a] = True
        deciding[[len(q[0]) + i for i in deciding_b]] = True
        peak = int(both.argmax())
        j, t = (a, peak) if peak < len(q[0]) else (b, peak - len(q[0]))
        hit = bool(both.max() > 0) and bool(deciding[peak])
        hits, peaks = hits + hit, [*peaks, (j, positions[j][t].item(), hit)]
        inside, total = inside + both[deciding].sum().item(), total + both.sum().item()
        decisive, tokens = decisive + int(deciding.sum()), tokens + len(both)
    return hits, inside / total if total > 0 else math.nan, decisive / tokens if tokens else math.nan, peaks


def pair_verdict(hits: int, control: int, count: int, share: float, even: float, tokens: list[str], mixed: int) -> str:
    """The verdict the pair test gives (docs/inspect.md, "The pair test"); ``even``: the share of the pairs' tokens
    that decide them, which q spread evenly would put there; ``mixed``: the pairs another reward scores differently
    too, whose deciding tokens may be that reward's."""
    peaks = ", ".join(map(repr, tokens))
    found = f"in {hits} of {count} pairs of responses it scores differently its q peaks on the tokens they differ in"
    if 2 * hits >= count and not share > even:
        return (
            f"pair test: {found} ({peaks}), but those are {even:.0%} of their tokens and hold {share:.0%} of its q, "
            "no more than an even spread would: the pairs differ in too much to show what decides it; responses that "
            "differ only where it decides would."
        )
    if 2 * hits >= count and hits > control:
        there = f"{share:.0%} of its q there, on {even:.0%} of their tokens; the control: {control}"
        caveat = (
            f" {mixed} of the {count} pairs differ in another reward's score too: a peak on their differing tokens "
            "may be on what decides that reward."
            if mixed
            else ""
        )
        return f"pair test: {found} ({there}): its credit lands where it is decided ({peaks}).{caveat}"
    if 2 * hits >= count:
        return (
            f"pair test: {found}, so its credit moves onto them ({peaks}), but so does the control's ({control}): any "
            "change of context moves those tokens; nothing shows that this reward's information is what moves them."
        )
    return (
        f"pair test: in {count - hits} of {count} pairs of responses it scores differently its q peaks outside the "
        f"tokens they differ in (on {peaks}): its credit would move onto tokens that do not decide it; make the block "
        "carry what the verifier decides with (an example in a block can prime the tokens it names), or give the "
        "reward no block."
    )


def contribution_verdict(record: CreditRecord, name: str, tokenizer, positions: list[torch.Tensor]) -> Verdict:
    """A row for a term's part of the final advantages (a process reward's): how many steps it found and scored,
    and the step where the largest blame (the most negative advantage, after the rescale) lands."""
    part, ends = record.contributions[name], record.steps.get(name) or [[] for _ in positions]
    found, responses = sum(map(len, ends)), sum(1 for e in ends if e)
    values = [(part[j, t].item(), j, t) for j, where in enumerate(positions) for t in where.tolist()]
    value, j, t = min(values, default=(0.0, 0, 0))
    counted = f"{found} steps found and scored in {responses} of {len(positions)} responses"
    if value >= 0:
        return Verdict(name, math.nan, math.nan, math.nan, [], math.nan, f"{counted}; no step is blamed here.")
    start = max((end + 1 for end in ends[j] if end < t), default=0)
    end = min((end for end in ends[j] if end >= t), default=t)
    span = tokenizer.decode(record.completion_ids[j, start : end + 1].tolist())
    step = sum(e < t for e in ends[j]) + 1
    text = f"{counted}; the largest blame lands on step {step} of response {j}, {span!r} ({value:+.2f} to the loss)."
    return Verdict(name, math.nan, math.nan, math.nan, [span], math.nan, text)


# What to do about a reward whose q is under twice the control's, by the kind of rollout (one line per reward), and
# why, said once under the table.
UNDER_TWICE_ACTION = {
    False: "replay a few responses that pass and a few that fail with --completions",
    True: "compare its q on trajectories whose calls pass and fail; check that its block carries the tools' feedback",
    "given": "add to the --completions file two responses to one prompt that differ only where this reward decides, "
    "one passing and one failing, for the pair test",
    "one-sided": "read its q on the failing responses in the heatmap, against what their feedback names",
}
NO_PAIRS = " (judged by q/control: no two responses to one prompt that it scores differently differ in a few tokens)"
ONE_SIDED = (
    " (judged by q/control: its block applies to at most one response of each of its {} pairs, as feedback on a "
    "failure does, and the pair test reads q on both)"
)
UNDER_TWICE_NOTE = (
    "Note: q under twice the control's (an irrelevant sentence appended) has two causes this batch cannot tell "
    "apart: the model does not read the block at this size, or the block lacks what decides the reward. If q lands on "
    "what decides the reward in responses that pass and fail, the block is sound; if not, make it carry what the "
    "verifier decides with, or give the reward no block (uniform credit)."
)
VERDICT_COLUMNS = (
    "varies: share of prompt groups in which the reward varies (training replays only those pairs)",
    "q/control: the reward's summed q over the control's (the irrelevant sentence appended), on the same responses",
    "80% mass in: mean share of a response's tokens holding 80% of the reward's q",
    "peak apart: share of responses whose q peaks on another token than the control's",
    "pairs hit: pairs of responses to one prompt it scores differently (differing in a few tokens) where its q peaks "
    "on the tokens they differ in, of all such pairs (the pair test decides the verdict where there are pairs)",
    "strength: per-reward strength g_k read on this batch (1: full redistribution, 0: the reward rests)",
)


def _cell(value: float, form: str, width: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}{form}}"


def format_verdicts(verdicts: list[Verdict]) -> str:
    lines = [
        f"{'reward':<28}{'varies':>8}{'q/control':>11}{'80% mass in':>13}{'peak apart':>12}{'pairs hit':>11}"
        f"{'strength':>10}  verdict"
    ]
    for v in verdicts:
        pairs = f"{v.pair_hits}/{v.pairs}" if v.pairs else "-"
        ratio = _cell(v.q_over_control, ".2f", 10) + ("x" if not math.isnan(v.q_over_control) else " ")
        lines.append(
            f"{v.reward:<28}{_cell(v.varying, '.0%', 8)}{ratio}{_cell(v.concentration, '.0%', 13)}"
            f"{_cell(v.peaks_apart, '.0%', 12)}{pairs:>11}{_cell(v.strength, '.2f', 10)}   {v.verdict}"
        )
    note = [UNDER_TWICE_NOTE, ""] if any(v.verdict.startswith("q is under twice") for v in verdicts) else []
    return "\n".join([*lines, "", *note, *VERDICT_COLUMNS])


# GRPOConfig's fields that shape a rollout, and those of the context it is replayed in (the control's too)
ROLLOUT_FIELDS = ("reward_weights", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "generation_kwargs", "max_tool_calling_iterations")  # fmt: skip
CONTEXT_FIELDS = ("chat_template_kwargs", "info_block_separator")


def recipe_credit_settings(args: MRTPOConfig) -> dict:
    """The fields of a recipe's config that decide its rollouts and credit: those its config class adds to
    GRPOConfig (MRTPO's and the research room's) and GRPOConfig's :data:`ROLLOUT_FIELDS` and :data:`CONTEXT_FIELDS`."""
    import dataclasses

    from trl import GRPOConfig

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    names = [f.name for f in dataclasses.fields(args) if f.init and f.name not in grpo]
    return {name: getattr(args, name) for name in dict.fromkeys([*names, *ROLLOUT_FIELDS, *CONTEXT_FIELDS])}


def inspected_task(config: str | None, model: str, task: str, adapter: str | None, completions: str | None) -> dict:
    """What ``trl-mrtpo inspect`` inspects: the recipe's (``config``) or ``task`` and ``model``, its policy folders
    checked, and ``completions`` (``"example"``: the task kit's pass/fail pairs, :attr:`Kit.examples_path`). Loads
    no model: a mistake raises here, naming it."""
    from .policy import check_policy_folders

    inspected = recipe_inspection(config) if config else {"model": model, "task": task}
    check_policy_folders(inspected["model"], adapter)
    if completions == "example":
        kit = inspected.get("task")
        completions = get_kit(kit).examples_path if kit in KIT_NAMES else None
        if completions is None:
            raise ValueError(
                f"--completions example: the {kit or 'recipe'!s} task ships no pass/fail examples; give a JSONL file "
                f"of your own (docs/inspect.md, 'The pair test'), or a task that ships them."
            )
    return {**inspected, "completions": completions}


def recipe_inspection(config: str) -> dict:
    """What ``inspect_credit`` takes from a training recipe (the YAML ``trl-mrtpo train --config`` reads: its model and
    chat template; ``task`` or ``reward_funcs`` / ``info_blocks``; the task's environment and tools; process rewards;
    its dataset or mixture; its credit settings and trainer). Reads the recipe and its data, loads no model: a mistake
    in it raises here, naming it."""
    import tempfile
    from pathlib import Path

    from .train import (
        check_recipe,
        load_datasets,
        parse_recipe,
        recipe_model,
        recipe_process_rewards,
        recipe_rewards,
    )

    if not Path(config).is_file():
        raise FileNotFoundError(f"--config {config}: no such file.")
    # nothing is trained: the recipe's precision and device settings are not what inspect runs with
    overrides = ["--bf16", "false", "--use_cpu", str(not torch.cuda.is_available()).lower()]
    with tempfile.TemporaryDirectory(prefix="trl-mrtpo-inspect-") as scratch:
        script_args, training_args, model_args, dataset_args = parse_recipe(
            ["--config", config, "--output_dir", scratch, *overrides]
        )
    trainer_class, template = check_recipe(script_args, training_args)
    if trainer_class is None:
        raise ValueError("trainer: opsd has no token credit to inspect; inspect the recipe with trainer: mrtpo.")
    kit, rewards, blocks = recipe_rewards(script_args)
    training_args.eval_strategy = "no"
    dataset, _ = load_datasets(script_args, training_args, dataset_args)
    return {
        "model": recipe_model(model_args),
        "reward_funcs": rewards,
        "info_blocks": blocks,
        "dataset": dataset,
        "recipe_args": training_args,
        "trainer_class": trainer_class,
        "process_rewards": recipe_process_rewards(script_args),
        "chat_template": template,
        **({"task": script_args.task} if script_args.task else {}),
        "environment_factory": kit.environment if kit is not None else None,
        "reward_strength_floor": training_args.reward_strength_floor,
        "max_new_tokens": training_args.max_completion_length,  # a tool rollout's turns and results fit as trained
    }
