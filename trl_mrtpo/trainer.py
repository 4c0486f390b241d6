"""MRTPOTrainer: GRPOTrainer whose advantages are token-level and reward-specific (docs/method.md).

Orchestration only: TRL generates and scores; this class keeps the per-reward rewards, builds the info blocks,
asks :mod:`trl_mrtpo.replay` for q and :mod:`trl_mrtpo.credit` for the ``[B, C]`` advantages, and logs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer

from ._trl import (
    gathered_for_probe,
    get_config_model_id,
    log_completion_column,
    log_metric,
    replace_logged_advantages,
    sharding_engine,
    tokenize_prompts,
    whole_policy,
)
from .callbacks import CreditPlotCallback
from .config import MRTPOConfig
from .constants import MIN_SHARED_PREFIX
from .credit import (
    TokenCredit,
    group_advantages,
    token_advantages,
    warmup_beta,
)
from .diagnostics import CollapseMonitor, CreditRecord, mass_share
from .hub_ids import name_hub_ids, saving_with_hub_ids
from .info_blocks import (
    InfoBlock,
    assistant_header,
    build_block,
    build_contexts,
    check_appendable,
    check_blocks,
    check_builders,
    check_context_length,
)
from .process_rewards import check_process_rewards, failure_suffix, process_credit
from .replay import causal_lm_parts, logit_multiplier, replay_relevance
from .trajectories import trajectory
from .utils import completion_text, function_name, reward_columns
from .validation import (
    CORE_STATE_ENTRIES,
    STATE_VERSION,
    StateCheck,
    check_dataset,
    check_loss_keeps_token_credit,
    check_sharded_replay,
    checked_reward,
    read_credit_state,
)
from .viz import credit_summary, token_strings

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class CreditMode:
    """How a credit assignment mode builds its token weights.

    ``removal``: the replayed contexts: ``"each"`` removes one reward's block per context, ``"all"`` removes every
    block in one context, None replays nothing. ``shuffled``: q is permuted within each response (ablation).
    ``contrast``: CoRT's log-likelihood contrast instead of q.
    """

    removal: str | None
    shuffled: bool = False
    contrast: bool = False


CREDIT_MODES = {"mrtpo": CreditMode("each"), "gdpo": CreditMode(None)}


@dataclass
class Scored:
    """What TRL scored for one generation batch (rewards gathered over processes), until MRTPO uses it."""

    inputs: list[dict]
    prompts: list
    completions: list
    rewards: torch.Tensor


@dataclass
class ScoredBatch:
    """This process's slice of a scored batch, with its response-level advantages and TRL's generation output."""

    inputs: list[dict]
    prompts: list
    completions: list
    rewards: torch.Tensor  # [B, K]
    group_advantages: torch.Tensor  # [B, K], after any response-level weighting
    varying: torch.Tensor  # [B, K] bool: the reward varies within the response's group
    reward_weights: torch.Tensor  # [K] or [B, K]
    mask: torch.Tensor  # [B, C] completion (and tool) mask
    output: dict


PAPER_TITLE = "Each Reward to Its Relevant Tokens: Reward-Specific Token-Level Credit Assignment for Multi-Reward RL"


def completion_token_lists(output: dict) -> list[list[int]]:
    """Each completion's token ids without padding, from TRL's generation output."""
    lengths = output["completion_mask"].sum(-1).tolist()
    return [ids[:length].tolist() for ids, length in zip(output["completion_ids"], lengths)]


class MRTPOTrainer(GRPOTrainer):
    """Trainer for MRTPO: each reward's advantage lands on the tokens that reward is about.

    Takes every argument of [`trl.GRPOTrainer`] plus `info_blocks`: one builder (or None) per reward function, see
    [`trl_mrtpo.info_blocks`]. With `args.credit_assignment="grpo"` it behaves exactly like `GRPOTrainer`.

    Two further credit rules stack with every other mode (see [`trl_mrtpo.process_rewards`]): `process_rewards`,
    functions that score steps of each completion (character spans), turned into token advantages by GRPO's
    process-supervision rule; and `failure_boundaries`, one builder (or None) per reward that returns where a failing
    response's unrecovered error ends, after which that reward's negative credit is dropped. `recipe` (the recipe file
    a run came from) and `data_source` (the data in words, when it is not a Hub dataset) go to the model card.

    Example:

    ```python
    from trl_mrtpo import MRTPOConfig, MRTPOTrainer

    trainer = MRTPOTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        reward_funcs=[format_reward, correctness_reward],
        info_blocks=[format_block, reference_block],
        args=MRTPOConfig(output_dir="out", num_generations=8),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    _tag_names = ["trl", "grpo", "mrtpo"]
    credit_modes: dict[str, CreditMode] = CREDIT_MODES  # the research room registers its own
    accepts_research = False  # a ResearchConfig's options are refused, not ignored
    config_class = MRTPOConfig
    _name = "MRTPO"
    _paper = {
        "title": PAPER_TITLE,
        "id": None,  # no arXiv id known to us yet
        "citation": f"@misc{{mrtpo,\n    title = {{{{{PAPER_TITLE}}}}},\n    note  = {{MRTPO}}\n}}",
    }

    def __init__(
        self,
        model,
        reward_funcs,
        args: MRTPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *,
        info_blocks: Sequence[Callable[..., str | InfoBlock | None] | None] | Callable | None = None,
        process_rewards: Sequence[Callable] | Callable | None = None,
        failure_boundaries: Sequence[Callable[..., int | None] | None] | Callable | None = None,
        recipe: str | None = None,
        data_source: str | None = None,
        **kwargs,
    ):
        config = self.config_class
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = config(f"{model_name.split('/')[-1]}-{self._name}")
        elif not isinstance(args, config):
            raise TypeError(
                f"args must be a {config.__name__}, got {type(args).__name__}; {config.__name__} accepts every "
                f"{config.__mro__[1].__name__} field."
            )
        research = getattr(args, "research_settings", list)()
        if research and not self.accepts_research:
            raise ValueError(
                f"{', '.join(research)} belong to the research room: train with "
                "trl_mrtpo.research.ResearchTrainer (MRTPOTrainer would ignore them)."
            )
        check_dataset(train_dataset, "train")
        check_dataset(eval_dataset, "eval")
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        self.info_block_builders = check_builders(info_blocks, self.reward_func_names)
        self.failure_boundary_builders = check_builders(
            failure_boundaries, self.reward_func_names, "failure_boundaries"
        )
        self.process_rewards = check_process_rewards(process_rewards)
        self.process_reward_names = [function_name(func) for func in self.process_rewards]
        weights = args.process_reward_weights
        if weights is not None and len(weights) != len(self.process_rewards):
            raise ValueError(
                f"process_reward_weights has {len(weights)} entries but there are {len(self.process_rewards)} "
                "process rewards; pass one weight per process reward, in the same order."
            )
        self.process_reward_weights = list(weights) if weights is not None else [1.0] * len(self.process_rewards)
        step_rules = [
            name
            for name, on in (
                ("process_rewards", self.process_rewards),
                ("failure_boundaries", any(self.failure_boundary_builders)),
            )
            if on
        ]
        if step_rules and args.credit_assignment == "grpo":
            raise ValueError(
                f"{' and '.join(step_rules)} act on MRTPO's per-reward token credit; credit_assignment='grpo' is "
                "plain GRPOTrainer. Use 'gdpo' for uniform credit with them."
            )
        for func in self.process_rewards:  # a process reward that samples from the policy binds to it
            if callable(getattr(func, "bind", None)):
                func.bind(self)
        for reward_func in self.reward_funcs:  # a reward that reads the policy (e.g. self-certainty) binds to it
            if callable(getattr(reward_func, "bind", None)):
                reward_func.bind(self)
        # every value a reward function returns is checked where it returns, naming the function and the sample
        self.reward_funcs = [
            func if isinstance(func, torch.nn.Module) else checked_reward(func, name)
            for func, name in zip(self.reward_funcs, self.reward_func_names)
        ]
        modes = self.credit_modes
        removal = modes[args.credit_assignment].removal if args.credit_assignment in modes else None
        self._replays = removal is not None and any(b is not None for b in self.info_block_builders)
        if self._replays:
            if self._is_vlm:
                raise ValueError("MRTPO replay does not support vision-language models yet.")
            causal_lm_parts(self.accelerator.unwrap_model(self.model))  # fail now, not inside a training step
        # what gives tokens different advantages, and what runs extra forwards of the policy, named for the errors
        replay = [f"credit_assignment='{args.credit_assignment}'"] if self._replays else []
        extra = self._extra_policy_forwards()
        named = [*zip(self.reward_func_names, self.reward_funcs)]
        named += [(type(f).__name__, f) for f in self.process_rewards]
        runs_policy = [f"'{name}'" for name, f in named if getattr(f, "runs_policy_forwards", False)]
        check_loss_keeps_token_credit(args.loss_type, args.importance_sampling_level, [*replay, *step_rules, *extra])
        check_sharded_replay(sharding_engine(self), [*replay, *extra], runs_policy, args.ds3_gather_for_generation)
        # Replays apply the lm_head themselves: a model that scales its logits in forward is replayed at T / m.
        self._replay_temperature = self.temperature
        if self._replays or extra:
            policy = self.accelerator.unwrap_model(self.model)
            with gathered_for_probe(policy):
                self._replay_temperature = self.temperature / logit_multiplier(policy)
        self._scored: Scored | None = None
        self._replay_seconds = 0.0
        self._announced = False  # the first training step has been announced
        self.last_credit: CreditRecord | None = None
        patience = args.collapse_warning_steps
        self._collapse_monitor = CollapseMonitor(patience) if patience > 0 else None
        if args.save_credit_plots:
            self.add_callback(CreditPlotCallback(self.reward_func_names))
        self.recipe = recipe  # the recipe file a run came from, for the model card
        self.data_source = data_source  # the training data in words when it is not a Hub dataset, for the card
        self._local_copies = name_hub_ids(self.accelerator.unwrap_model(self.model))

    def _extra_policy_forwards(self) -> list[str]:
        """Options beyond the replay that run forwards of the policy and make the credit per token, named for the
        start-up checks (none in the core)."""
        return []

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Saves as transformers does; an adapter of a local copy of a Hub model names the Hub id
        (:mod:`trl_mrtpo.hub_ids`)."""
        if not self._local_copies:
            return super()._save(output_dir, state_dict)
        with saving_with_hub_ids(self._local_copies, output_dir or self.args.output_dir):
            super()._save(output_dir, state_dict)

    def _credit_state_path(self, checkpoint: str) -> str:
        return os.path.join(checkpoint, f"mrtpo_state_{self.accelerator.process_index}.pt")

    def _state_identity(self) -> dict:
        """What a checkpointed MRTPO state was written for; a resume under another setup is refused."""
        return {"reward_names": list(self.reward_func_names), "credit_assignment": self.args.credit_assignment}

    def _credit_state(self) -> tuple[dict, dict[str, StateCheck]]:
        """The state a resumed run needs to continue exactly, and how each entry is checked on reading."""
        streaks = dict(self._collapse_monitor.streaks) if self._collapse_monitor else {}
        return {"collapse_streaks": streaks}, CORE_STATE_ENTRIES

    def _restore_credit_state(self, state: dict) -> None:
        if self._collapse_monitor is not None:
            self._collapse_monitor.streaks = dict(state["collapse_streaks"])

    def _save_checkpoint(self, model, trial) -> None:
        """Checkpoint MRTPO's own state beside TRL's, as TRL checkpoints its own extra state (each process its own
        file), so that a resumed run continues exactly. Plain tensors, numbers and strings only: it loads with
        ``weights_only=True``."""
        super()._save_checkpoint(model, trial)
        if self.args.save_only_model:  # no optimizer either: such a checkpoint is not resumed from
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state, _ = self._credit_state()
        torch.save({"version": STATE_VERSION, **self._state_identity(), **state}, self._credit_state_path(folder))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Reads MRTPO's state back on resume, where TRL reads its own extra state."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = self._credit_state_path(checkpoint)
        if not os.path.isfile(path):
            logger.warning(
                f"{path} is missing: MRTPO's own state (collapse monitor, and any research option's) starts afresh, "
                "so the resumed run will not continue exactly as an uninterrupted one."
            )
            return
        _, entries = self._credit_state()
        self._restore_credit_state(read_credit_state(path, self._state_identity(), entries))

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = torch.isinf(rewards).nonzero().tolist()
        if infinite:  # NaN means "does not apply"; an infinity would silently turn its group's advantages to 0
            sample, k = infinite[0]
            raise ValueError(
                f"reward function '{self.reward_func_names[k]}' returned {rewards[sample, k].item()} for sample "
                f"{sample} of the generation batch; rewards must be finite (return None where a reward does not "
                "apply)."
            )
        # TRL does not expose per-reward advantages: keep what they are computed from.
        self._scored = Scored(inputs, prompts, completions, rewards)
        return rewards

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        self._announce_first_generation(inputs)
        output = super()._generate_and_score_completions(inputs)
        if self.args.credit_assignment == "grpo":
            return output
        scored, self._scored = self._scored, None
        mode = "train" if self.model.training else "eval"
        batch = self._weighted_batch(scored, output, mode)
        beta = self._beta()
        self._replay_seconds = 0.0
        step_credit = {
            "process": self._process_credit(batch, mode),
            "failure_suffix": self._failure_suffix(batch),
        }
        credit, relevance, replayed = self._token_credit(batch, beta, step_credit)
        output["advantages"] = credit.advantages
        # The local batch's credit, kept for inspection (heatmaps, localisation) until the next generation.
        self.last_credit = CreditRecord(
            prompts=batch.prompts,
            completions=[completion_text(c) for c in batch.completions],
            completion_ids=output["completion_ids"],
            mask=batch.mask,
            rewards=batch.rewards,
            group_advantages=batch.group_advantages,
            relevance=relevance,
            replayed=replayed,
            weights=credit.weights,
            advantages=credit.advantages,
            beta=beta,
        )
        total_seconds = time.perf_counter() - started
        self._log_credit(mode, credit, relevance, replayed, batch.mask, beta, self._replay_seconds, total_seconds)
        return output

    def sample_credit(self, rows: list[dict], num_generations: int) -> CreditRecord:
        """Generate ``num_generations`` responses per row with the policy, score, replay, and return the batch's
        :class:`~trl_mrtpo.diagnostics.CreditRecord`, without training (what ``trl-mrtpo inspect`` shows)."""
        inputs = [dict(row) for row in rows for _ in range(num_generations)]
        self.model.train()  # TRL picks the train-mode group size and sampling from the module's mode
        self._generate_and_score_completions(inputs)
        return self.last_credit

    def _announce_first_generation(self, inputs) -> None:
        """One line before the first generation of training (not of ``inspect`` or an evaluation before it): the
        progress bar only moves when a step ends, which on a CPU can take minutes, so say what is running (once, on
        the main process, unless progress bars are off)."""
        if self._announced or not self.is_in_train or self.state.global_step > 0 or self.args.disable_tqdm:
            return
        self._announced = True
        replay = ", replaying the info blocks" if self._replays and self._beta() > 0 else ""
        self.accelerator.print(
            f"Step 1: sampling {len(inputs)} responses per process ({self.num_generations} per prompt), scoring "
            f"{len(self.reward_funcs)} rewards{replay}; the progress bar moves when the step ends."
        )

    @contextmanager
    def _replay_clock(self):
        """Adds the time spent in the block to this step's replay seconds (logged as ``mrtpo/replay_seconds``)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._replay_seconds += time.perf_counter() - started

    @property
    def _credit_mode(self) -> CreditMode:
        return self.credit_modes[self.args.credit_assignment]

    def _beta(self) -> float:
        """Step 9: the warmed-up beta of this step; for CoRT, its ramp lambda_n from 0 to 1; 0 for GDPO."""
        if self._credit_mode.removal is None:
            return 0.0
        target = 1.0 if self._credit_mode.contrast else self.args.credit_beta
        return warmup_beta(target, self.state.global_step, self.args.credit_warmup_steps)

    def _weighted_batch(self, scored: Scored, output: dict, mode: str) -> ScoredBatch:
        """Steps 1-2 and the response-level weighting on the whole gathered batch, so that every process decides
        alike; then this process's slice."""
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = scored.rewards
        group_adv, varying = group_advantages(rewards, num_generations)
        group_adv, reward_weights = self._response_weighting(rewards, group_adv, num_generations, mode)
        rank, size = self.accelerator.process_index, len(scored.prompts)
        local = slice(rank * size, (rank + 1) * size)
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        return ScoredBatch(
            inputs=scored.inputs,
            prompts=scored.prompts,
            completions=scored.completions,
            rewards=rewards[local],
            group_advantages=group_adv[local],
            varying=varying[local],
            reward_weights=reward_weights,
            mask=mask,
            output=output,
        )

    def _response_weighting(
        self, rewards: torch.Tensor, group_adv: torch.Tensor, num_generations: int, mode: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """How much each reward counts (docs/method.md, step 2): TRL's ``reward_weights``; the research room's
        response-level weightings replace this."""
        return group_adv, self.reward_weights.to(group_adv)

    def _token_credit(
        self, batch: ScoredBatch, beta: float, step_credit: dict
    ) -> tuple[TokenCredit, torch.Tensor, torch.Tensor]:
        """Steps 3-8: q from the replay (none at beta 0, where the weights are uniform whatever q is), then the
        token advantages (with ``step_credit``: the process advantages and failure suffixes)."""
        relevance = batch.mask.new_zeros((*batch.varying.shape, batch.mask.shape[1]), dtype=torch.float32)
        replayed = torch.zeros_like(batch.varying)
        if self._replays and beta > 0:
            with self._replay_clock():
                relevance, replayed = self._replay(batch)
        credit = self._advantages(batch, relevance, replayed, beta, step_credit)
        return credit, relevance, replayed

    def _advantages(self, batch: ScoredBatch, relevance, replayed, beta: float, step_credit: dict) -> TokenCredit:
        """Steps 5-8 (:func:`~trl_mrtpo.credit.token_advantages`)."""
        return token_advantages(
            batch.group_advantages,
            relevance,
            replayed,
            batch.mask,
            batch.reward_weights,
            beta,
            self.args.max_second_moment_ratio,
            self._reduce_sum(),
            **step_credit,
        )

    @cached_property
    def _text_tokenizer(self):
        return getattr(self.processing_class, "tokenizer", self.processing_class)

    def _process_credit(self, batch: ScoredBatch, mode: str) -> torch.Tensor | None:
        """``[B, C]`` the weighted sum of the process rewards' token advantages (docs/method.md, "Process rewards"),
        or None without process rewards; each process reward's mean step score is logged."""
        if not self.process_rewards:
            return None
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        total, means = process_credit(
            self.process_rewards,
            self.process_reward_names,
            self.process_reward_weights,
            batch.prompts,
            batch.completions,
            completion_token_lists(batch.output),
            reward_columns(batch.inputs),
            batch.mask,
            self._text_tokenizer,
            num_generations,
            self.accelerator.process_index,
            trainer_state=self.state,
        )
        for name, value in means:
            log_metric(self, mode, f"mrtpo/process/{name}", value)
        return total

    def _failure_suffix(self, batch: ScoredBatch) -> torch.Tensor | None:
        """``[B, K, C]`` the positions after each failing pair's error boundary (docs/method.md, "Failure-suffix
        masking"), or None when no reward has a boundary builder."""
        if not any(self.failure_boundary_builders):
            return None
        credit = batch.group_advantages * batch.reward_weights.to(batch.group_advantages)
        return failure_suffix(
            self.failure_boundary_builders,
            self.reward_func_names,
            credit,
            batch.rewards,
            batch.prompts,
            batch.completions,
            batch.inputs,
            completion_token_lists(batch.output),
            self._text_tokenizer,
            batch.mask.shape[1],
        ).to(batch.mask.device)

    def _reduce_sum(self):
        """Sum over data-parallel processes for steps 7 and 8 (None on one process)."""
        if self.accelerator.num_processes == 1:
            return None
        return lambda tensor: self.accelerator.reduce(tensor, reduction="sum")

    def _replay_inputs(self, batch: ScoredBatch, joint: bool):
        """Info blocks, replayed pairs and token ids of the local batch's replay.

        Returns ``(wanted, context_ids, completion_ids)``: per response, the reward indices whose pair is replayed,
        the contexts ``[P_all, P_removed...]`` (one removal per wanted reward, or a single removal of every block
        when ``joint``; empty when nothing is replayed) and the completion token ids.
        """
        num_samples, num_rewards = batch.varying.shape
        prompts, rewards = batch.prompts, batch.rewards
        resting = self._resting_rewards() if not joint else set()
        views = [None] * num_samples  # the structured view of each tool rollout, for builders that take it
        if "tool_mask" in batch.output:
            lengths = batch.output["completion_mask"].sum(-1).tolist()
            tool_mask = batch.output["tool_mask"].tolist()
            views = [trajectory(c, m[:n]) for c, m, n in zip(batch.completions, tool_mask, lengths)]
        blocks = [
            [
                build_block(
                    builder,
                    name,
                    i,
                    prompts[i],
                    completion_text(batch.completions[i]),
                    batch.inputs[i],
                    rewards[i, k].item(),
                    views[i],
                )
                if builder is not None
                else None
                for k, (builder, name) in enumerate(zip(self.info_block_builders, self.reward_func_names))
            ]
            for i in range(num_samples)
        ]
        check_appendable(prompts, blocks, self.reward_func_names, self._assistant_header)
        check_blocks(prompts, blocks, self.reward_func_names, self._special_tokens)
        wanted = [
            [
                k
                for k in range(num_rewards)
                # a reward that is None for this response gives it no advantage: nothing to place
                if blocks[i][k] is not None
                and not torch.isnan(rewards[i, k])
                and (batch.varying[i, k] or not self.args.replay_only_varying)
                and k not in resting
            ]
            for i in range(num_samples)
        ]
        if joint:
            removals = [
                [[k for k, b in enumerate(blocks[i]) if b is not None]] if wanted[i] else []
                for i in range(num_samples)
            ]
        else:
            removals = [[[k] for k in wanted[i]] for i in range(num_samples)]

        # Only responses with a replayed pair are tokenized and replayed; the others keep no contexts.
        contexts = [
            build_contexts(prompts[i], blocks[i], removals[i], self.args.info_block_separator) if removals[i] else None
            for i in range(num_samples)
        ]
        flat = [p for c in contexts if c is not None for p in (c[0], *c[1])]
        owners = [i for i, c in enumerate(contexts) if c is not None for _ in range(1 + len(c[1]))]
        flat_ids = tokenize_prompts(self, flat, owners) if flat else []
        context_ids, cursor = [], 0
        for removed in removals:
            count = 1 + len(removed) if removed else 0
            context_ids.append(flat_ids[cursor : cursor + count])
            cursor += count
        completion_ids = completion_token_lists(batch.output)
        prompt_lengths = batch.output["prompt_mask"].sum(-1).tolist()
        limit = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
        check_context_length(context_ids, completion_ids, blocks, prompt_lengths, self.reward_func_names, limit)
        return wanted, context_ids, completion_ids

    def _resting_rewards(self) -> set[int]:
        """Rewards not replayed this step (none in the core; the research room's per-reward strength rests some)."""
        return set()

    @cached_property
    def _assistant_header(self) -> str | None:
        return assistant_header(self.processing_class)

    @cached_property
    def _special_tokens(self) -> list[str]:
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return [token for token in getattr(tokenizer, "all_special_tokens", []) if token]

    def _replay_options(self) -> dict:
        return {"batch_size": self.args.replay_batch_size, "min_shared_prefix": MIN_SHARED_PREFIX}

    def _replay(self, batch: ScoredBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 3-4: replay the local batch and place q per (response, reward)."""
        joint = self._credit_mode.removal == "all"
        wanted, context_ids, completion_ids = self._replay_inputs(batch, joint)
        mask = batch.mask
        relevance = torch.zeros(*batch.varying.shape, mask.shape[1], device=mask.device)
        replayed = torch.zeros_like(batch.varying)
        # every process enters (a collective under sharding), even one with nothing to replay
        with whole_policy(self) as policy:
            if not any(wanted):
                return relevance, replayed
            q = replay_relevance(
                policy,
                context_ids,
                completion_ids,
                self._replay_temperature,
                backend=self.args.divergence_backend,
                chunk_size=self.args.replay_chunk_size,
                **self._replay_options(),
            )
        for i, ids in enumerate(completion_ids):
            length = len(ids)
            if length == 0:
                continue
            for row, k in enumerate(wanted[i]):
                relevance[i, k, :length] = q[i][0 if joint else row].to(mask.device)
                replayed[i, k] = True
        # tool results are context, not the model's decisions: no q there (the mask is 0 on them)
        relevance = relevance * mask[:, None, :].to(relevance.dtype)
        return self._placed_relevance(relevance, replayed, batch), replayed

    def _placed_relevance(self, relevance: torch.Tensor, replayed: torch.Tensor, batch: ScoredBatch) -> torch.Tensor:
        """q as step 5 reads it (as replayed in the core; the research room's options and ablations act here)."""
        return relevance

    def _log_credit(self, mode, credit, relevance, replayed, mask, beta, replay_seconds, total_seconds):
        log_metric(self, mode, "mrtpo/beta", beta)
        log_metric(self, mode, "mrtpo/replayed_fraction", replayed.float().mean().item())
        log_metric(self, mode, "mrtpo/cap_factor", credit.cap_factor)
        log_metric(self, mode, "mrtpo/replay_seconds", replay_seconds)
        log_metric(self, mode, "mrtpo/replay_share", replay_seconds / total_seconds if total_seconds > 0 else 0.0)
        lengths = mask.sum(-1).long()
        q_means = {}
        # CoRT replays without computing q (its weights come from a log-likelihood contrast): no q statistics.
        with_q = torch.zeros_like(replayed) if self._credit_mode.contrast else replayed
        for k, name in enumerate(self.reward_func_names):
            rows = with_q[:, k].nonzero(as_tuple=True)[0].tolist()
            if not rows:
                continue
            profiles = [relevance[i, k, : lengths[i]] for i in rows]
            q_means[name] = torch.cat(profiles).mean().item()
            log_metric(self, mode, f"mrtpo/q_mean/{name}", q_means[name])
            shares = [mass_share(p) for p in profiles]
            shares = [s for s in shares if s == s]  # drop all-zero profiles (NaN)
            if shares:
                log_metric(self, mode, f"mrtpo/q_mass80_token_share/{name}", sum(shares) / len(shares))

        if mode == "train" and self._collapse_monitor is not None:
            for name in self._collapse_monitor.update(q_means):
                logger.warning(
                    f"Reward '{name}': its replayed q has stayed below {self._collapse_monitor.threshold:g} for "
                    f"{self._collapse_monitor.patience} steps. Its info block no longer changes the policy's "
                    "predictions, so its credit is uniform (plain GDPO). Check that the block carries the information "
                    "its verifier uses."
                )

        # A readable line per response in TRL's completions table (console, W&B, trackio): where credit went.
        # Decoding every token costs time each step, so only when that table is logged.
        if self.log_completions:
            summaries = []
            for j in range(mask.shape[0]):
                length = int(lengths[j])
                tokens = token_strings(self.processing_class, self.last_credit.completion_ids[j, :length].tolist())
                profiles = [
                    relevance[j, k, :length].tolist() if with_q[j, k] else [] for k in range(relevance.shape[1])
                ]
                advantages = credit.advantages[j, :length].tolist()
                summaries.append(credit_summary(tokens, advantages, profiles, self.reward_func_names))
            log_completion_column(self, "mrtpo_credit", gather_object(summaries))

        # TRL logged the sequence-level advantages it computed; replace them with what the loss will see.
        per_response = (credit.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        replace_logged_advantages(self, self.accelerator.gather(per_response).tolist())

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The model card (``README.md`` in ``output_dir``): TRL's, with the real base model, the data, and the
        MRTPO settings, rewards, info blocks and recipe in the training procedure (:mod:`trl_mrtpo.model_card`)."""
        if not self.is_world_process_zero():
            return
        from .model_card import build_model_card

        card = build_model_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags)
        card.save(os.path.join(self.args.output_dir, "README.md"))
