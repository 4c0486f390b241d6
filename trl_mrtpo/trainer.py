"""MRTPOTrainer: GRPOTrainer whose advantages are token-level and reward-specific (docs/method.md).

Orchestration only: TRL generates and scores; this class keeps the per-reward rewards, builds the info blocks,
asks :mod:`trl_mrtpo.replay` for q and :mod:`trl_mrtpo.credit` for the ``[B, C]`` advantages, and logs.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence

import torch
from transformers.utils import logging
from trl import GRPOTrainer

from . import _trl
from .batch import ProcessSum, Scored, ScoredBatch, local_slice
from .checks import batch as batch_checks
from .checks import inputs
from .checks.guard import BatchGuard
from .config import MRTPOConfig
from .credit import (
    TokenCredit,
    group_advantages,
    read_relevance,
    short_run_warning,
    warmup_beta,
    warmup_steps,
    weighted_token_advantages,
)
from .diagnostics import CollapseMonitor, CreditRecord, first_step_line, log_credit
from .info_blocks import (
    InfoBlock,
    ReplayContexts,
    build_blocks,
    for_environment_rewards,
    per_reward,
    replay_contexts,
    warn_leaks,
)
from .model_card import ModelCards
from .relevance import RelevanceProvider, ReplayRecord, ReplayRelevance, provider_name
from .replay import ReplayMemory, causal_lm_parts, replay_settings
from .rules import (
    Contribution,
    CreditInputs,
    CreditSetup,
    CreditTerm,
    built_terms,
    given_terms,
    resolve_credit_rule,
    rule_label,
    steps_6_to_8,
    term_label,
)
from .state import CreditCheckpoints, declaration_problems, left_as_it_was
from .strength import RewardStrength, generation_batch_index
from .utils import completion_text, function_name

logger = logging.get_logger(__name__)


PAPER_TITLE = "Each Reward to Its Relevant Tokens: Reward-Specific Token-Level Credit Assignment for Multi-Reward RL"


class MRTPOTrainer(CreditCheckpoints, ModelCards, GRPOTrainer):
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

    _scored: Scored | None = None  # TRL's scored batch, until the credit reads it
    _announced = _warned_warmup = False  # the first training step announced, a short run warned about
    last_credit: CreditRecord | None = None  # the last generation batch's credit (inspection, heatmaps)
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
        inputs.check_model_argument(model)
        if args is None:
            model_name = model if isinstance(model, str) else _trl.get_config_model_id(model.config)
            args = self.config_class(f"{model_name.split('/')[-1]}-{self._name}")
        inputs.check_config_class(args, self.config_class, type(self).__name__)
        rule = resolve_credit_rule(args)  # a name or a dotted path, resolved once, before the model loads
        inputs.check_credit_settings(args, rule)
        funcs, checked = inputs.checked_inputs(reward_funcs, info_blocks, train_dataset, eval_dataset, kwargs)
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
        # the parts of credit, once TRL has loaded the model and its rewards (an environment's after the user's
        # functions, checked where they return as those are): the builders, the rule, the terms, what binds
        rewards, names = (len(funcs), len(self.reward_funcs)), self.reward_func_names
        for k in range(*rewards):
            self.reward_funcs[k] = batch_checks.checked_reward(self.reward_funcs[k], f"{names[k]}.get_reward")
        builders = for_environment_rewards(info_blocks, *rewards)
        inputs.check_builders(builders, names)
        self.info_block_builders = per_reward(builders, rewards[1])
        options = {"process_rewards": process_rewards}
        options["failure_boundaries"] = for_environment_rewards(failure_boundaries, *rewards)
        setup = CreditSetup(args, list(names), options, rule)
        self.credit_rule = rule(setup)
        if process_rewards is not None or failure_boundaries is not None:
            from .steps.process_rewards import StepCredit  # loaded only for the runs that ask for it

            credit_terms = [*given_terms(credit_terms), StepCredit]
        self.credit_terms: dict[str, CreditTerm] = built_terms(credit_terms, setup)
        self._combine = steps_6_to_8(self.credit_terms) or weighted_token_advantages
        own = [func for func in funcs if not isinstance(func, (str, torch.nn.Module))]  # as the user gave them
        term_functions = [func for term in self.credit_terms.values() for func in term.functions]
        for func in [*term_functions, *own]:  # one that samples from or reads the policy binds
            if callable(getattr(func, "bind", None)):
                func.bind(self)
        named = [*zip((function_name(f) for f in own), own), *((type(f).__name__, f) for f in term_functions)]
        # what replays and how (its temperature, backend and memory), the provider and the guard; the state kept
        # across batches. A provider of one's own may know the relevant tokens without any info block: it replays.
        blocks = any(b is not None for b in self.info_block_builders)
        self._replays = rule.removal is not None and (blocks or relevance_provider is not None)
        runs_policy = [f"'{name}'" for name, f in named if getattr(f, "runs_policy_forwards", False)]
        extra = [label for term in self.credit_terms.values() for label in term.policy_forwards]
        self._policy_forwards = [*extra, *runs_policy]
        engine = _trl.sharding_engine(self)
        inputs.check_credit_use(args, rule, self.credit_terms, self._replays, runs_policy, relevance_provider, engine)
        if self._replays and relevance_provider is None:
            if self._is_vlm:
                raise ValueError("MRTPO replay does not support vision-language models yet.")
            causal_lm_parts(self.accelerator.unwrap_model(self.model))  # fail now, not inside a training step
        # Replays apply the lm_head themselves: a model that scales its logits in forward is replayed at T / m; the
        # divergence backend ("auto" included) is settled here, once, on every process.
        self._replay_temperature, self._replay_backend = self.temperature, args.divergence_backend
        if self._replays or self._policy_forwards:
            removed = 1 if rule.removal == "all" else len(self.reward_funcs)  # removed contexts per response, at most
            self._replay_temperature, self._replay_backend = replay_settings(
                self.accelerator.unwrap_model(self.model), self.temperature, args.divergence_backend, removed
            )
        self.relevance_provider = relevance_provider or self._replay_relevance(args)
        provider = provider_name(self.relevance_provider)
        self._guard = BatchGuard(provider, args.credit_assignment, self.credit_terms, self.reward_func_names)
        self._context_format = batch_checks.context_format(self.processing_class)
        self._partly_none, self._empty_blocks = set(), set()  # rewards warned about None within a group, empty blocks
        self.information_leaks: dict[str, str] = {}  # reward -> what still holds its block's text (warned once)
        self._collapse_monitor = CollapseMonitor(args.collapse_warning_steps)
        self._replay_memory = ReplayMemory()
        floor = args.reward_strength_floor if self._replays and rule.removal == "each" else None  # each reward's q
        self.reward_strength = RewardStrength(floor, len(self.reward_funcs))
        if problems := declaration_problems(self._stateful()):  # named now, not at the first checkpoint
            raise ValueError(f"This run's state could not be checkpointed: {'; '.join(problems)}.")
        self.recipe = recipe  # the recipe file a run came from, for the model card
        self.data_source = data_source  # the training data in words when it is not a Hub dataset, for the card

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
            rule_label(self.args.credit_assignment): self.credit_rule,
            **{term_label(name): term for name, term in self.credit_terms.items()},
        }

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.tools or self.environments:  # what tools and environments brought, refused before a reward reads it
            from .checks.environments import check_observations, check_tool_results

            check_tool_results(completions, multimodal=self._is_vlm)
            if self.environments and not self._is_vlm:
                check_observations(inputs, prompts, self.environments)
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        batch_checks.check_batch_rewards(rewards, self.reward_func_names, num_generations, self._partly_none)
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
        if not self._announced and (line := first_step_line(self, len(inputs))):  # once, on the main process
            self._announced = True
            self.accelerator.print(line)
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
        processes = self.accelerator.num_processes  # steps 7-8 and the strength reading sum over them, once each
        reduction = None if processes == 1 else ProcessSum(lambda t: self.accelerator.reduce(t, reduction="sum"))
        batch = self._weighted_batch(scored, output, mode, reduction)  # steps 1-2
        beta = self._beta()  # step 9
        self._replay_seconds = 0.0
        added = self._contributions(batch, mode)  # what the terms add: process advantages, failure suffixes
        credit, relevance, replayed = self._token_credit(batch, beta, added)  # steps 3-8
        self._guard.final(credit, batch.mask)
        output["advantages"] = credit.advantages
        # The local batch's credit, kept for inspection (heatmaps, localisation) until the next generation.
        betas = self.reward_strength.betas(beta)
        self.last_credit = CreditRecord.of(batch, credit, relevance, replayed, beta, betas, added)
        total_seconds = time.perf_counter() - started
        log_credit(self, mode, credit, relevance, replayed, batch.mask, beta, (self._replay_seconds, total_seconds))
        return output

    def sample_credit(self, inputs: list[dict]) -> CreditRecord:
        """Samples, scores and assigns credit to ``inputs`` (rows, each once per generation) as a training step does,
        without its optimizer step; returns the batch's :class:`CreditRecord` (``trl-mrtpo inspect``). The run is
        left as it was: every part's state (per-reward strength, the collapse streaks, the rule's and the terms'),
        the reward checks' early batches, TRL's metrics, logs and token count, and every random generator, so that a
        ``train()`` after it is the ``train()`` without it."""
        windows = [w for w in map(batch_checks.early_batches_of, self.reward_funcs) if w]
        with left_as_it_was(self, windows):
            self._generate_and_score_completions(inputs)
        return self.last_credit

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

    def _weighted_batch(self, scored: Scored, output: dict, mode: str, reduction: ProcessSum | None) -> ScoredBatch:
        """Steps 1-2 and the terms' response-level weighting on the whole gathered batch, so that every process
        decides alike; then this process's slice. The batch's guard begins here, riding on ``reduction``."""
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = scored.rewards
        group_adv, varying = group_advantages(rewards, num_generations)
        reward_weights = self.reward_weights.to(group_adv)  # step 2's c_k, reweighed by any term
        local = local_slice(scored, self.accelerator.process_index)
        rank, processes = self.accelerator.process_index, self.accelerator.num_processes
        self._guard.begin(rank, processes, reduction, group_adv[local], reward_weights)
        for name, term in self.credit_terms.items():
            weighed = term.weigh(rewards, group_adv, reward_weights, num_generations, mode == "train")
            self._guard.weighed(name, weighed, group_adv, reward_weights, local)
            group_adv, reward_weights = weighed
        batch = ScoredBatch.local(scored, local, group_adv, varying, reward_weights, output)
        batch.reduction = reduction
        return batch

    def _contributions(self, batch: ScoredBatch, mode: str) -> Contribution:
        """What the terms add to the local batch, joined; their figures logged as ``mrtpo/term/<term>/<figure>``."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        added = Contribution()
        for name, term in self.credit_terms.items():
            own = term(batch, tokenizer, num_generations, self.accelerator.process_index, self.state)
            self._guard.contributed(name, own, batch)
            for metric, value in own.logged:
                _trl.log_metric(self, mode, f"mrtpo/term/{name}/{metric}", value)
            added = added.joined(own)
        return added

    def _token_credit(
        self, batch: ScoredBatch, beta: float, added: Contribution
    ) -> tuple[TokenCredit, torch.Tensor, torch.Tensor]:
        """Steps 3-8: the quantities the rule reads (none at beta 0: uniform weights whatever q is), the rule's
        step-5 weights, steps 6-8 (a term's replacement, or the method's) with each reward's beta and the terms'
        additions, then each term's finish."""
        rule, terms = self.credit_rule, self.credit_terms
        relevance = batch.mask.new_zeros(batch.shape, dtype=torch.float32)
        replayed = torch.zeros_like(batch.varying)
        reads = [*(rule.reads if self._replays and beta > 0 else ()), *(n for t in terms.values() for n in t.reads)]
        quantities = {}
        if reads:  # the policy's time for credit: logged as replay seconds
            started = time.perf_counter()
            for name in dict.fromkeys(reads):  # each quantity computed once, however many read it
                if name == "relevance":
                    relevance, replayed = self._replay(batch)
                else:
                    quantities[name] = self._quantity(name, batch)
            self._replay_seconds += time.perf_counter() - started
        betas, rho, reduction = self.reward_strength.betas(beta), self.args.max_second_moment_ratio, batch.reduction
        inputs = CreditInputs(
            batch, relevance, replayed, quantities, beta, betas, rho, reduction, added.process, added.failure_suffix
        )
        weights = rule.weights(inputs)
        self._guard.weights(weights, batch)
        credit = self._combine(
            batch.group_advantages,
            weights,
            batch.mask,
            batch.reward_weights,
            rho if rule.capped else None,
            reduction,
            process=added.process,
            failure_suffix=added.failure_suffix,
        )
        for name, term in terms.items():
            credit = term.finish(credit, inputs)
            self._guard.finished(name, credit, batch)
        return credit, relevance, rule.replayed(inputs)

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
        batch_checks.check_blocks(batch.prompts, blocks, names, *self._context_format)
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
        warn_leaks(step_two.leaks, self.information_leaks)
        context_ids = _trl.tokenize_contexts(self, step_two.contexts)
        completion_ids = batch.completion_ids
        prompt_lengths = batch.output["prompt_mask"].sum(-1).tolist()
        limit = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
        batch_checks.check_context_length(context_ids, completion_ids, blocks, prompt_lengths, names, limit)
        return step_two, context_ids, completion_ids

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

    def _replay(self, batch: ScoredBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 3-4 from the relevance provider, read where replayed; on a train batch, step 5's strength reading of
        the placed q; then q as the terms and the rule read it."""
        record = self._replay_record(batch)
        batch.groups = torch.tensor(record.groups, dtype=torch.long, device=batch.varying.device).view(batch.shape[:2])
        # every process enters (collectives under sharding and in the reading), even one with nothing to replay
        with _trl.whole_policy(self) as policy:
            provided = self.relevance_provider(policy, record)
        self._guard.provided(provided, batch)
        relevance, replayed, any_replayed = provided
        relevance = read_relevance(relevance, replayed, batch.mask)
        if self.model.training:
            self.reward_strength.read(relevance, replayed, batch.reduction, batch.information_groups)
        parts = [*map(term_label, self.credit_terms), rule_label(self.args.credit_assignment)]
        for label, part in zip(parts, [*self.credit_terms.values(), self.credit_rule]) if any_replayed else ():
            relevance = part.relevance(relevance, replayed, batch)
            self._guard.adjusted(label, relevance, replayed, batch)
        return relevance, replayed
