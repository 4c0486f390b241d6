"""MRTPOTrainer: GRPOTrainer whose advantages are token-level and reward-specific (docs/method.md).

Orchestration only: TRL generates and scores; this class keeps the per-reward rewards, builds the info blocks,
asks :mod:`trl_mrtpo.replay` for q and :mod:`trl_mrtpo.credit` for the ``[B, C]`` advantages, and logs.
"""

from __future__ import annotations

import copy
import os
import random
import time
import warnings
from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np
import torch
from accelerate.utils import gather_object
from transformers.utils import logging
from trl import GRPOTrainer

from . import _trl
from .batch import Scored, ScoredBatch, local_slice
from .checks import validation
from .checks.blocks import assistant_header, check_blocks, check_builders, check_context_length, special_tokens
from .checks.guards import guarded
from .config import MRTPOConfig
from .credit import TokenCredit, group_advantages, short_run_warning, warmup_beta, warmup_steps
from .diagnostics import CollapseMonitor, CreditRecord, credit_metrics, process_means
from .hub_ids import local_copies, write_hub_ids
from .info_blocks import InfoBlock, ReplayContexts, build_blocks, for_environment_rewards, replay_contexts
from .relevance import RelevanceProvider, ReplayRecord, ReplayRelevance
from .replay import ReplayMemory, causal_lm_parts, replay_settings
from .rules import (
    Contribution,
    CreditInputs,
    CreditSetup,
    CreditTerm,
    built_terms,
    given_terms,
    steps_6_to_8,
)
from .strength import RewardStrength, generation_batch_index
from .utils import completion_text, function_name

logger = logging.get_logger(__name__)


PAPER_TITLE = "Each Reward to Its Relevant Tokens: Reward-Specific Token-Level Credit Assignment for Multi-Reward RL"


class CreditCheckpoints:
    """MRTPO's state in TRL's checkpoints (:mod:`trl_mrtpo.credit_state`): serialised before transformers writes the
    checkpoint, written beside each process's RNG state (so before a Hub upload), read back where TRL reads its own."""

    def _credit_state(self):
        from .credit_state import CheckpointedState

        run = {"reward_names": list(self.reward_func_names), "credit_assignment": self.args.credit_assignment}
        return CheckpointedState(run, self._stateful())

    def _save_checkpoint(self, model, trial) -> None:
        self._state_payload = None if self.args.save_only_model else self._credit_state().serialised()
        super()._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)  # only when the optimizer is saved too: never with save_only_model
        self._credit_state().write(output_dir, self.accelerator.process_index, self._state_payload)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        restored = (
            None if checkpoint is None else self._credit_state().read(checkpoint, self.accelerator.process_index)
        )
        if restored and not self.args.disable_tqdm:  # said where the first step is announced
            self.accelerator.print(restored)


class MRTPOTrainer(CreditCheckpoints, GRPOTrainer):
    """Trainer for MRTPO: each reward's advantage lands on the tokens that reward is about.

    Takes every argument of [`trl.GRPOTrainer`] plus `info_blocks`, one builder (or None) per reward function
    ([`trl_mrtpo.info_blocks`]). `args.credit_assignment` names the credit rule ([`trl_mrtpo.rules`]); `"grpo"` is
    `GRPOTrainer` itself. `process_rewards` (steps of each completion scored) and `failure_boundaries` (where a failing
    response's unrecovered error ends, one builder or None per reward) build the step term
    ([`trl_mrtpo.steps.process_rewards`]); `credit_terms` adds terms of one's own; `relevance_provider` replaces the
    replay that computes q ([`trl_mrtpo.relevance`]). `recipe` and `data_source` (the data in words, when it is not a
    Hub dataset) go to the model card.

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
    config_class = MRTPOConfig  # a subclass's own options are refused, not ignored
    _name = "MRTPO"
    _paper = {
        "title": PAPER_TITLE,
        "id": None,  # no arXiv id known to us yet
        "citation": f"@misc{{mrtpo,\n    title = {{{{{PAPER_TITLE}}}}},\n    note  = {{MRTPO}}\n}}",
    }

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: MRTPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *,
        info_blocks: Sequence[Callable[..., str | InfoBlock | None] | None] | Callable | None = None,
        process_rewards: Sequence[Callable] | Callable | None = None,
        failure_boundaries: Sequence[Callable[..., int | None] | None] | Callable | None = None,
        relevance_provider: RelevanceProvider | None = None,
        credit_terms: Sequence[CreditTerm] | None = None,
        recipe: str | None = None,
        data_source: str | None = None,
        **kwargs,
    ):
        args, rule, funcs, checked = validation.before_model(
            model, args, reward_funcs, info_blocks, (train_dataset, eval_dataset), kwargs, self
        )
        _trl.without_mixed_precision(model)
        super().__init__(
            model,
            None if reward_funcs is None else checked,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        named = self._set_up_credit(args, rule, funcs, info_blocks, process_rewards, failure_boundaries, credit_terms)
        self._set_up_replay(args, rule, named, relevance_provider)
        self.recipe = recipe  # the recipe file a run came from, for the model card
        self.data_source = data_source  # the training data in words when it is not a Hub dataset, for the card

    def _set_up_credit(
        self, args, rule, funcs, info_blocks, process_rewards, failure_boundaries, credit_terms
    ) -> list:
        """The parts of credit built once TRL has loaded the model and its rewards: the info-block builders (an
        environment's reward included), the rule, the terms, and what binds to the policy. Returns the user's
        functions and the terms' by name."""
        rewards = (len(funcs), len(self.reward_funcs))  # TRL adds environments' get_reward after the functions
        for k in range(len(funcs), len(self.reward_funcs)):  # checked where they return, as the user's functions are
            name = f"{self.reward_func_names[k]}.get_reward"
            self.reward_funcs[k] = validation.checked_reward(self.reward_funcs[k], name)
        builders = for_environment_rewards(info_blocks, *rewards)
        self.info_block_builders = check_builders(builders, self.reward_func_names)
        boundaries = for_environment_rewards(failure_boundaries, *rewards)
        options = {"process_rewards": process_rewards, "failure_boundaries": boundaries}
        setup = CreditSetup(args, list(self.reward_func_names), options, rule)
        self.credit_rule = rule(setup)
        if process_rewards is not None or failure_boundaries is not None:
            from .steps.process_rewards import StepCredit  # loaded only for the runs that ask for it

            credit_terms = [*given_terms(credit_terms), StepCredit]
        self.credit_terms: dict[str, CreditTerm] = built_terms(credit_terms, setup)
        self._combine = steps_6_to_8(self.credit_terms)  # None: the rule's own
        term_functions = [func for term in self.credit_terms.values() for func in term.functions]
        own = [func for func in funcs if not isinstance(func, (str, torch.nn.Module))]  # as the user gave them
        for func in [*term_functions, *own]:  # one that samples from or reads the policy binds
            if callable(getattr(func, "bind", None)):
                func.bind(self)
        return [*zip((function_name(f) for f in own), own), *((type(f).__name__, f) for f in term_functions)]

    def _set_up_replay(self, args, rule, named: list, relevance_provider) -> None:
        """What replays and how (its temperature, backend and memory), the provider, and the one guard layer around
        the rule, the terms and the provider (the trainer's second point of checks); the state kept across batches."""
        blocks = any(b is not None for b in self.info_block_builders)
        self._replays, self._policy_forwards = validation.check_credit_use(
            args, rule, self.credit_terms, named, relevance_provider, blocks, _trl.sharding_engine(self)
        )
        if self._replays and relevance_provider is None:
            if self._is_vlm:
                raise ValueError("MRTPO replay does not support vision-language models yet.")
            causal_lm_parts(self.accelerator.unwrap_model(self.model))  # fail now, not inside a training step
        # Replays apply the lm_head themselves: a model that scales its logits in forward is replayed at T / m; the
        # divergence backend ("auto" included) is settled here, once, on every process.
        self._replay_temperature, self._replay_backend = self.temperature, args.divergence_backend
        if self._replays or self._policy_forwards:
            policy = self.accelerator.unwrap_model(self.model)
            removed = 1 if rule.removal == "all" else len(self.reward_funcs)  # removed contexts per response, at most
            self._replay_temperature, self._replay_backend = replay_settings(
                policy, self.temperature, args.divergence_backend, removed
            )
        self.relevance_provider = relevance_provider or self._replay_relevance(args)
        # the one guard layer: what the rule, the terms and the provider return is checked where it enters
        self._guard, self._checked_rule, self._checked_terms, self._checked_provider = guarded(
            self.credit_rule,
            args.credit_assignment,
            self.credit_terms,
            self.relevance_provider,
            self.reward_func_names,
        )
        self._scored: Scored | None = None
        self._announced = False  # the first training step has been announced
        self._warned_warmup = False
        self._partly_none: set[str] = set()  # rewards warned about returning None within a group
        self._empty_blocks: set[str] = set()  # rewards warned about an empty info block
        self.information_leaks: dict[str, str] = {}  # reward -> what still holds its block's text (warned once)
        self.last_credit: CreditRecord | None = None
        self._collapse_monitor = CollapseMonitor(args.collapse_warning_steps)
        self._replay_memory = ReplayMemory()
        floor = args.reward_strength_floor if self._replays and rule.removal == "each" else None  # each reward's q
        self.reward_strength = RewardStrength(floor, len(self.reward_funcs))
        from .credit_state import declaration_problems

        if problems := declaration_problems(self._stateful()):  # named now, not at the first checkpoint
            raise ValueError(f"This run's state could not be checkpointed: {'; '.join(problems)}.")

    def _replay_relevance(self, args: MRTPOConfig) -> RelevanceProvider:
        """The built-in provider of q: the replay (the research room's replays with its prefix option)."""
        return ReplayRelevance(args.replay_batch_size)

    def _quantity(self, name: str, batch: ScoredBatch):
        """A per-token quantity a rule or term reads besides q (none here: the research room's trainer has two)."""
        raise ValueError(f"no quantity {name!r} is computed by {type(self).__name__}; a rule or term read it.")

    def _stateful(self) -> dict:
        """The collapse monitor, per-reward strength, the rule and the terms, by name: what the checkpoint keeps."""
        return {
            "the collapse monitor": self._collapse_monitor,
            "the replay's memory": self._replay_memory,
            "per-reward strength": self.reward_strength,
            self._checked_rule.label: self.credit_rule,
            **{term.label: term.part for term in self._checked_terms},
        }

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Saves as transformers does, then this run's model card beside the weights (``save_model``, checkpoints: it
        replaces PEFT's blank template); an adapter of a local copy of a Hub model names the Hub id
        (:mod:`.hub_ids`)."""
        folder = output_dir or self.args.output_dir
        super()._save(output_dir, state_dict)
        write_hub_ids(local_copies(self.accelerator.unwrap_model(self.model)), folder)
        self._write_model_card(folder)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.tools or self.environments:  # what tools and environments brought, refused before a reward reads it
            from .checks.environments import check_observations, check_tool_results

            check_tool_results(completions, multimodal=self._is_vlm)
            if self.environments and not self._is_vlm:
                check_observations(inputs, prompts, self.environments)
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        validation.check_batch_rewards(rewards, self.reward_func_names, num_generations, self._partly_none)
        # TRL does not expose per-reward advantages: keep what they are computed from.
        self._scored = Scored(inputs, prompts, completions, [list(ids) for ids in completion_ids_list], rewards)
        self.record_rewards(inputs, rewards)
        return rewards

    def record_rewards(self, inputs: list[dict], rewards: torch.Tensor) -> None:
        """A no-op hook called once per generation batch (training and evaluation) with its rows and ``[N, K]``
        rewards, gathered over processes (NaN: the reward does not apply); the credit gym overrides it."""

    @torch.no_grad()  # nothing of a rule's or a term's graph reaches TRL's loss
    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        self._announce_first_generation(inputs)
        try:
            output = super()._generate_and_score_completions(inputs)
        except TypeError as error:  # an environment's reset() returned what TRL cannot append to the prompt
            from .checks.environments import reset_refusal

            refusal = reset_refusal(error, self.environments, self._is_vlm) if self.environment_factories else None
            if refusal is None:
                raise
            raise TypeError(refusal) from error
        if self.credit_rule.keeps_trl_advantages:
            return output
        scored, self._scored = self._scored, None
        mode = "train" if self.model.training else "eval"
        processes = self.accelerator.num_processes  # steps 7-8 sum over them
        reduce_sum = None if processes == 1 else (lambda tensor: self.accelerator.reduce(tensor, reduction="sum"))
        self._guard.start(self.accelerator.process_index, processes, reduce_sum)
        batch = self._weighted_batch(scored, output, mode)  # steps 1-2
        beta = self._beta()  # step 9
        self._replay_seconds = 0.0
        added = self._contributions(batch, mode)  # what the terms add: process advantages, failure suffixes
        credit, relevance, replayed = self._token_credit(batch, beta, added)  # steps 3-8
        self._guard.final(credit, batch.mask)
        output["advantages"] = credit.advantages
        # The local batch's credit, kept for inspection (heatmaps, localisation) until the next generation.
        self.last_credit = CreditRecord.of(batch, credit, relevance, replayed, beta, self.reward_strength.betas(beta))
        total_seconds = time.perf_counter() - started
        self._log_credit(mode, credit, relevance, replayed, batch.mask, beta, self._replay_seconds, total_seconds)
        return output

    def sample_credit(self, inputs: list[dict]) -> CreditRecord:
        """Samples, scores and assigns credit to ``inputs`` (rows, each once per generation) as a training step does,
        without its optimizer step; returns the batch's :class:`CreditRecord` (``trl-mrtpo inspect``). The run is
        left as it was: every part's state (per-reward strength, the collapse streaks, the rule's and the terms'),
        the reward checks' early batches, TRL's metrics, logs and token count, and every random generator, so that a
        ``train()`` after it is the ``train()`` without it."""
        parts = [(part, copy.deepcopy(part.state())) for part in self._stateful().values()]
        windows = [(w, copy.deepcopy(w)) for w in map(validation.early_batches_of, self.reward_funcs) if w]
        kept = copy.deepcopy((self._metrics, self._logs, self.state.num_input_tokens_seen))
        generators = random.getstate(), np.random.get_state()
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):  # torch's generators, the CPU's and this process's card
                self._generate_and_score_completions(inputs)
            return self.last_credit
        finally:
            for part, state in parts:
                part.restore(state)
            for window, before in windows:
                window.clear()
                window.update(before)
            self._metrics, self._logs, self.state.num_input_tokens_seen = kept
            random.setstate(generators[0])
            np.random.set_state(generators[1])

    def _announce_first_generation(self, inputs) -> None:
        """One line before training's first generation (once, on the main process, unless progress bars are off):
        the progress bar only moves when a step ends, which on a CPU can take minutes."""
        if self._announced or not self.is_in_train or self.state.global_step > 0 or self.args.disable_tqdm:
            return
        self._announced = True
        replay = ", replaying the info blocks" if self._replays and self._beta() > 0 else ""
        self.accelerator.print(
            f"Step 1: sampling {len(inputs)} responses per process ({self.num_generations} per prompt), scoring "
            f"{len(self.reward_funcs)} rewards{replay}; the progress bar moves when the step ends."
        )

    def _beta(self) -> float:
        """Step 9: the warmed-up beta of this step (a rule at full strength ramps to 1); 0 for a rule that replays
        nothing. A warm-up below 1 is a share of ``max_steps``; a run shorter than twice it is warned about once."""
        if self.credit_rule.removal is None:
            return 0.0
        target = 1.0 if self.credit_rule.full_strength else self.args.credit_beta
        steps = self._warmup_steps
        if not self._warned_warmup and 0 < self.state.max_steps < 2 * steps:
            self._warned_warmup = True
            message = short_run_warning(self.state.max_steps, self.args.credit_warmup_steps, steps, target)
            warnings.warn(message, UserWarning, stacklevel=2)
        return warmup_beta(target, self.state.global_step, steps)

    @property
    def _warmup_steps(self) -> float:
        """Step 9's warm-up in steps (a share resolved against ``max_steps``): beta's ramp and the strength's rest."""
        return warmup_steps(self.args.credit_warmup_steps, self.state.max_steps)

    def _weighted_batch(self, scored: Scored, output: dict, mode: str) -> ScoredBatch:
        """Steps 1-2 and the terms' response-level weighting on the whole gathered batch, so that every process
        decides alike; then this process's slice."""
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = scored.rewards
        group_adv, varying = group_advantages(rewards, num_generations)
        reward_weights = self.reward_weights.to(group_adv)  # step 2's c_k, reweighed by any term
        local = local_slice(scored, self.accelerator.process_index)
        self._guard.weighting("weighting", group_adv[local], reward_weights)
        for term in self._checked_terms:
            group_adv, reward_weights = term.weigh(
                rewards, group_adv, reward_weights, num_generations, mode == "train", local
            )
        return ScoredBatch.local(scored, local, group_adv, varying, reward_weights, output)

    def _contributions(self, batch: ScoredBatch, mode: str) -> Contribution:
        """What the terms add to the local batch, joined; their figures logged as ``mrtpo/term/<term>/<figure>``."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        added = Contribution()
        for term in self._checked_terms:
            own = term(batch, tokenizer, num_generations, self.accelerator.process_index, self.state)
            for metric, value in own.logged:
                _trl.log_metric(self, mode, f"mrtpo/term/{term.name}/{metric}", value)
            added = added.joined(own)
        return added

    def _token_credit(
        self, batch: ScoredBatch, beta: float, added: Contribution
    ) -> tuple[TokenCredit, torch.Tensor, torch.Tensor]:
        """Steps 3-8: the quantities the rule reads (none at beta 0: uniform weights whatever q is), then its token
        advantages with each reward's beta and the terms' additions, then each term's finish."""
        rule, terms = self._checked_rule, self._checked_terms
        relevance = batch.mask.new_zeros(batch.shape, dtype=torch.float32)
        replayed = torch.zeros_like(batch.varying)
        reads = [*(rule.part.reads if self._replays and beta > 0 else ()), *(n for t in terms for n in t.part.reads)]
        quantities = {}
        if reads:  # the policy's time for credit: logged as replay seconds
            started = time.perf_counter()
            for name in dict.fromkeys(reads):  # each quantity computed once, however many read it
                if name == "relevance":
                    relevance, replayed = self._replay(batch)
                else:
                    quantities[name] = self._quantity(name, batch)
            self._replay_seconds += time.perf_counter() - started
        inputs = CreditInputs(
            batch,
            relevance,
            replayed,
            quantities,
            beta,
            self.reward_strength.betas(beta),
            self.args.max_second_moment_ratio,
            self._guard.current.sum_over_processes,
            added.process,
            added.failure_suffix,
            combine=self._combine,
        )
        credit = rule.advantages(inputs)
        for term in terms:
            credit = term.finish(credit, inputs)
        return credit, relevance, rule.part.replayed(inputs)

    def _replay_inputs(self, batch: ScoredBatch, joint: bool) -> tuple[ReplayContexts, list, list[list[int]]]:
        """Step 2 on the local batch, its blocks checked, tokenised as TRL tokenises prompts. Returns ``(step_two,
        context_ids, completion_ids)``: :func:`~trl_mrtpo.info_blocks.replay_contexts`'s output, per response the
        contexts' token ids ``[P_all, P_removed...]`` (empty when nothing is replayed) and the completion's ids."""
        args, strength = self.args, self.reward_strength
        batch_index = generation_batch_index(
            self.state.global_step, args.gradient_accumulation_steps, args.steps_per_generation, self.num_iterations
        )
        names = self.reward_func_names
        scores = batch.rewards.tolist()  # one host sync for step 2
        batch.info_blocks = blocks = build_blocks(self.info_block_builders, names, batch, scores, self._empty_blocks)
        check_blocks(batch.prompts, blocks, names, *self._context_format)
        step_two = replay_contexts(
            blocks,
            names,
            batch,
            scores,
            joint=joint,
            only_varying=args.replay_only_varying,
            resting=strength.resting(self.state.global_step, self._warmup_steps, batch_index),
            separator=args.info_block_separator,
        )
        self._warn_leaks(step_two.leaks)
        context_ids = _trl.tokenize_contexts(self, step_two.contexts)
        completion_ids = batch.completion_ids
        prompt_lengths = batch.output["prompt_mask"].sum(-1).tolist()
        limit = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
        check_context_length(context_ids, completion_ids, blocks, prompt_lengths, names, limit)
        return step_two, context_ids, completion_ids

    def _warn_leaks(self, leaks: dict[str, str]) -> None:
        """Once per reward: its block's text survives its removal, so its q cannot measure that information."""
        for name, holder in leaks.items():
            if name not in self.information_leaks:
                warnings.warn(
                    f"Reward {name!r}: its info block's text is still in the context that removes it, inside "
                    f"{holder}, so its q cannot measure that information (a block contained in another, or repeating "
                    "prompt text). Give rewards that judge with the same information the same block text: they "
                    "then share it as one information group (docs/kits.md).",
                    UserWarning,
                    stacklevel=3,
                )
            self.information_leaks[name] = holder

    def _replay_record(self, batch: ScoredBatch) -> ReplayRecord:
        """What the relevance provider reads: step 2's contexts and the replay's settings."""
        joint = self.credit_rule.removal == "all"
        step_two, context_ids, completion_ids = self._replay_inputs(batch, joint)
        policy = self.accelerator.unwrap_model(self.model)
        return ReplayRecord(
            completions=[completion_text(c) for c in batch.completions],
            completion_ids=completion_ids,
            mask=batch.mask,
            varying=batch.varying,
            wanted=step_two.wanted,
            groups=step_two.groups,
            context_ids=context_ids,
            rows=batch.inputs,
            joint=joint,
            temperature=self._replay_temperature,
            backend=self._replay_backend,
            chunk_size=self.args.replay_chunk_size,
            usable_bytes=self._replay_memory.decide(self.accelerator.device, policy),
            process_index=self.accelerator.process_index,
        )

    @cached_property
    def _context_format(self) -> tuple[str | None, list[str]]:
        """The chat template's assistant header and the special tokens, which step 2's contexts are checked for."""
        return assistant_header(self.processing_class), special_tokens(self.processing_class)

    def _replay(self, batch: ScoredBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 3-4 from the relevance provider; on a train batch, step 5's strength reading of the placed q; then
        q as the terms and the rule read it."""
        record = self._replay_record(batch)
        batch.groups = torch.tensor(record.groups, dtype=torch.long, device=batch.varying.device).view(batch.shape[:2])
        # every process enters (collectives under sharding and in the reading), even one with nothing to replay
        with _trl.whole_policy(self) as policy:
            relevance, replayed, any_replayed = self._checked_provider(policy, record, batch)
        if self.model.training:
            reduce_sum = self._guard.current.sum_over_processes
            self.reward_strength.read(relevance, replayed, reduce_sum, batch.information_groups)
        for part in [*self._checked_terms, self._checked_rule] if any_replayed else ():
            relevance = part.relevance(relevance, replayed, batch)
        return relevance, replayed

    def _log_credit(self, mode, credit, relevance, replayed, mask, beta, replay_seconds, total_seconds):
        # a rule that replays without reading q (a log-likelihood contrast, say) has no q statistics
        with_q = replayed if "relevance" in self.credit_rule.reads else torch.zeros_like(replayed)
        names, betas = self.reward_func_names, self.reward_strength.logged_betas(beta, self.reward_func_names)
        betas = {k: v for (k, v), b in zip(betas.items(), self.info_block_builders) if b is not None}  # never replayed
        seconds = (replay_seconds, total_seconds)
        local = credit_metrics(credit, relevance, replayed, with_q, mask, names, beta, betas, seconds)
        # one collective per generation batch, entered by every process: each logs the processes' mean
        metrics = process_means(gather_object([local]))
        for key, value in metrics.items():
            _trl.log_metric(self, mode, key, value)

        for warning in (
            self._collapse_monitor.warnings(metrics) if mode == "train" else ()
        ):  # the same on every process
            logger.warning(warning)

        # A readable line per response in TRL's completions table (console, W&B, trackio): where credit went.
        # Decoding every token costs time each step, so only when that table is logged.
        if self.log_completions:
            from .observability.summaries import credit_summaries

            ids, names = self.last_credit.completion_ids, self.reward_func_names
            summaries = credit_summaries(self.processing_class, ids, mask, credit.advantages, relevance, with_q, names)
            _trl.log_completion_column(self, "mrtpo_credit", gather_object(summaries))

        # TRL logged the sequence-level advantages it computed; replace them with what the loss will see.
        per_response = (credit.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        _trl.replace_logged_advantages(self, self.accelerator.gather(per_response).tolist())

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The model card (``README.md`` in ``output_dir``): TRL's, with the real base model, the data, and the
        MRTPO settings, rewards, info blocks and recipe in the training procedure (:mod:`trl_mrtpo.model_card`)."""
        self._write_model_card(self.args.output_dir, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def _write_model_card(self, folder: str, **details) -> None:
        if not self.is_world_process_zero():
            return
        from .model_card import build_model_card

        build_model_card(self, **details).save(os.path.join(folder, "README.md"))
