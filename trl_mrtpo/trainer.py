"""MRTPOTrainer: GRPOTrainer whose advantages are token-level and reward-specific (docs/method.md).

Orchestration only: TRL generates and scores; this class keeps the per-reward rewards, builds the info blocks,
asks :mod:`trl_mrtpo.replay` for q and :mod:`trl_mrtpo.credit` for the ``[B, C]`` advantages, and logs.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from functools import cached_property

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer

from ._trl import (
    get_config_model_id,
    log_completion_column,
    log_metric,
    replace_logged_advantages,
    sharding_engine,
    tokenize_prompts,
    whole_policy,
)
from .batch import Scored, ScoredBatch, credit_mask, local_slice
from .config import MRTPOConfig
from .credit import TokenCredit, group_advantages, short_run_warning, warmup_beta, warmup_steps
from .credit_state import CheckpointedState, write_credit_state
from .diagnostics import (
    CollapseMonitor,
    CreditRecord,
    credit_summaries,
    process_means,
    q_statistics,
)
from .extension_outputs import check_tensor, checked_contribution, checked_credit, checked_relevance, checked_weighting
from .finite_credit import NEGATIVE_Q_TOLERANCE, CreditGuard, credit_parts
from .hub_ids import local_copies, write_hub_ids
from .info_blocks import (
    InfoBlock,
    assistant_header,
    check_builders,
    check_builders_on_first_row,
    check_context_length,
    for_environment_rewards,
    replay_contexts,
)
from .relevance import RelevanceProvider, ReplayRecord, ReplayRelevance
from .replay import causal_lm_parts, replay_settings
from .rules import CreditInputs, CreditSetup, CreditTerm, given_terms, terms_by_name
from .strength import RewardStrength, generation_batch_index
from .utils import completion_text, function_name
from .validation import (
    check_config_class,
    check_credit_rule,
    check_dataset,
    check_environment_arguments,
    check_finite_rewards,
    check_loss_keeps_token_credit,
    check_observations,
    check_reward_columns,
    check_sharded_replay,
    checked_reward,
    checked_rollout,
    reset_refusal,
)

logger = logging.get_logger(__name__)


PAPER_TITLE = "Each Reward to Its Relevant Tokens: Reward-Specific Token-Level Credit Assignment for Multi-Reward RL"


class MRTPOTrainer(GRPOTrainer):
    """Trainer for MRTPO: each reward's advantage lands on the tokens that reward is about.

    Takes every argument of [`trl.GRPOTrainer`] plus `info_blocks`: one builder (or None) per reward function, see
    [`trl_mrtpo.info_blocks`]. `args.credit_assignment` names the credit rule ([`trl_mrtpo.rules`]); with `"grpo"` it
    behaves exactly like `GRPOTrainer`.

    Two credit terms stack with every rule (see [`trl_mrtpo.steps.process_rewards`]): `process_rewards`, functions that
    score steps of each completion (character spans), turned into token advantages by GRPO's process-supervision
    rule; and `failure_boundaries`, one builder (or None) per reward that returns where a failing response's
    unrecovered error ends, after which that reward's negative credit is dropped. `relevance_provider` replaces the
    replay that computes q ([`trl_mrtpo.relevance`]). `recipe` (the recipe file a run came from) and `data_source`
    (the data in words, when it is not a Hub dataset) go to the model card.

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
        if model == "embedded":  # the command's name for it; the trainer takes a Hub id or a folder, as TRL's
            raise ValueError(
                "model='embedded' is the trl-mrtpo command's name for the embedded SmolLM2-135M-Instruct; in Python "
                "pass its folder: from trl_mrtpo.scripts.embedded import embedded_model_path; "
                "MRTPOTrainer(model=embedded_model_path(), ...)."
            )
        config = self.config_class
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = config(f"{model_name.split('/')[-1]}-{self._name}")
        check_config_class(args, config, type(self).__name__)
        # an environment may own the data (its reset() gives the prompt) and the reward (get_reward), as in TRL
        environments = kwargs.get("environment_factory") is not None
        check_dataset(train_dataset, "train", environments)
        check_dataset(eval_dataset, "eval", environments)
        check_environment_arguments(kwargs)
        # a copy: TRL appends environments' rewards to the list it is given, which would be the user's
        funcs = list(reward_funcs or []) if isinstance(reward_funcs, (list, type(None))) else [reward_funcs]
        names = [f.split("/")[-1] if isinstance(f, str) else function_name(f) for f in funcs]
        check_reward_columns(funcs, names, train_dataset)
        # a builder's mistake is refused before the model loads, not at the first step (the builders of environments'
        # rewards, which TRL adds while loading, at the first step)
        builders = info_blocks if environments else check_builders(info_blocks, names)
        tools = bool(kwargs.get("tools")) or environments
        check_builders_on_first_row(builders, names, train_dataset, tools, environments)
        # what the user's functions return is checked where it returns, naming them: wrapped once, before TRL has them
        checked = [
            func if isinstance(func, (str, torch.nn.Module)) else checked_reward(func, name)
            for func, name in zip(funcs, names)
        ]
        if kwargs.get("rollout_func") is not None:
            kwargs["rollout_func"] = checked_rollout(kwargs["rollout_func"])
        super().__init__(
            model,
            None if reward_funcs is None else checked,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        rewards = (len(funcs), len(self.reward_funcs))  # TRL adds environments' get_reward after the functions
        for k in range(len(funcs), len(self.reward_funcs)):  # checked where they return, as the user's functions are
            self.reward_funcs[k] = checked_reward(self.reward_funcs[k], f"{self.reward_func_names[k]}.get_reward")
        given = for_environment_rewards(info_blocks, *rewards)
        self.info_block_builders = check_builders(given, self.reward_func_names)
        setup = CreditSetup(
            args,
            list(self.reward_func_names),
            {
                "process_rewards": process_rewards,
                "failure_boundaries": for_environment_rewards(failure_boundaries, *rewards),
            },
        )
        self.credit_rule = check_credit_rule(args).rule(setup)
        steps = []
        if process_rewards is not None or failure_boundaries is not None:
            from .steps.process_rewards import StepCredit  # loaded only for the runs that ask for it

            steps.append(StepCredit.build(setup))
        terms = [*self._configured_terms(setup), *steps, *given_terms(credit_terms)]
        self.credit_terms: dict[str, CreditTerm] = terms_by_name(terms)
        replacing = [name for name, term in self.credit_terms.items() if term.combine is not None]
        if len(replacing) > 1:
            raise ValueError(f"The credit terms {', '.join(replacing)} each replace steps 6-8; at most one may.")
        self._combine = self.credit_terms[replacing[0]].combine if replacing else None  # None: the rule's own
        term_functions = [func for term in self.credit_terms.values() for func in term.functions]
        own = [func for func in funcs if not isinstance(func, (str, torch.nn.Module))]  # as the user gave them
        for func in [*term_functions, *own]:  # one that samples from or reads the policy binds
            if callable(getattr(func, "bind", None)):
                func.bind(self)
        named = [*zip(names, funcs), *((type(f).__name__, f) for f in term_functions)]
        runs_policy = [f"'{name}'" for name, f in named if getattr(f, "runs_policy_forwards", False)]
        removal = self.credit_rule.removal
        provider = (
            f"the relevance provider {function_name(relevance_provider)!r}" if relevance_provider else "the replay"
        )
        if relevance_provider is not None and "relevance" not in self.credit_rule.reads:
            raise ValueError(
                f"{provider} was given, but credit_assignment={args.credit_assignment!r} reads no q: it would never "
                "be called. Choose a rule that reads q (mrtpo), or drop the provider."
            )
        # a provider of one's own may know the relevant tokens without any info block: it is called all the same
        blocks = any(b is not None for b in self.info_block_builders)
        self._replays = removal is not None and (blocks or relevance_provider is not None)
        if self._replays and relevance_provider is None:
            if self._is_vlm:
                raise ValueError("MRTPO replay does not support vision-language models yet.")
            causal_lm_parts(self.accelerator.unwrap_model(self.model))  # fail now, not inside a training step
        # what gives tokens different advantages, and what runs extra forwards of the policy, named for the errors
        replay = [f"credit_assignment='{args.credit_assignment}'"] if self._replays else []
        extra = [label for term in self.credit_terms.values() for label in term.policy_forwards]
        token_credit = [label for term in self.credit_terms.values() for label in term.token_credit]
        check_loss_keeps_token_credit(args.loss_type, args.importance_sampling_level, [*replay, *token_credit])
        check_sharded_replay(sharding_engine(self), [*replay, *extra], runs_policy, args.ds3_gather_for_generation)
        # Replays apply the lm_head themselves: a model that scales its logits in forward is replayed at T / m; the
        # divergence backend ("auto" included) is settled here, once, on every process.
        self._replay_temperature, self._replay_backend = self.temperature, args.divergence_backend
        if self._replays or extra or runs_policy:
            policy = self.accelerator.unwrap_model(self.model)
            self._replay_temperature, self._replay_backend = replay_settings(
                policy, self.temperature, args.divergence_backend
            )
        self.relevance_provider = relevance_provider or ReplayRelevance(args.replay_batch_size)
        self._provider = provider  # how errors name it, and the rule
        self._rule = f"the credit rule '{args.credit_assignment}'"
        self._credit_parts = credit_parts(provider, args.credit_assignment, list(self.credit_terms))
        self._guard: CreditGuard | None = None  # this generation batch's finiteness check
        self._scored: Scored | None = None
        self._replay_seconds = 0.0
        self._announced = False  # the first training step has been announced
        self._warned_warmup = False
        self.last_credit: CreditRecord | None = None
        self._collapse_monitor = CollapseMonitor(args.collapse_warning_steps)
        floor = args.reward_strength_floor if self._replays and removal == "each" else None  # each reward's own q
        self.reward_strength = RewardStrength(floor, len(self.reward_funcs))
        self.recipe = recipe  # the recipe file a run came from, for the model card
        self.data_source = data_source  # the training data in words when it is not a Hub dataset, for the card

    def _configured_terms(self, setup: CreditSetup) -> list[CreditTerm]:
        """The terms the configuration selects (none here: the research room's trainer has some)."""
        return []

    def _quantity(self, name: str, batch: ScoredBatch):
        """A per-token quantity a rule or term reads besides q (none here: the research room's trainer has two)."""
        raise ValueError(f"no quantity {name!r} is computed by {type(self).__name__}; a rule or term read it.")

    def _stateful(self) -> dict:
        """The collapse monitor, per-reward strength, the rule and the terms, by name: what the checkpoint keeps."""
        return {
            "the collapse monitor": self._collapse_monitor,
            "per-reward strength": self.reward_strength,
            self._rule: self.credit_rule,
            **{f"the term '{name}'": term for name, term in self.credit_terms.items()},
        }

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Saves as transformers does, then this run's model card beside the weights (``save_model``, checkpoints: it
        replaces PEFT's blank template); an adapter of a local copy of a Hub model names the Hub id
        (:mod:`.hub_ids`)."""
        folder = output_dir or self.args.output_dir
        super()._save(output_dir, state_dict)
        write_hub_ids(local_copies(self.accelerator.unwrap_model(self.model)), folder)
        self._write_model_card(folder)

    def _checkpointed(self) -> CheckpointedState:
        """MRTPO's state in a checkpoint, for the run it was written by (a resume under another setup is refused)."""
        run = {"reward_names": list(self.reward_func_names), "credit_assignment": self.args.credit_assignment}
        return CheckpointedState(run, self._stateful())

    def _save_checkpoint(self, model, trial) -> None:
        """Checkpoints MRTPO's own state beside TRL's, where TRL checkpoints its own extra state (with
        ``push_to_hub``, :meth:`_push_from_checkpoint` has written it already, before the upload). It is checked and
        serialised first: a state that cannot be saved stops before transformers writes the checkpoint."""
        self._state_payload = None if self.args.save_only_model else self._checkpointed().serialised()
        super()._save_checkpoint(model, trial)
        if not self.args.push_to_hub:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            self._write_credit_state(folder)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Every process writes MRTPO's state here, inside ``_save_checkpoint`` and before transformers uploads the
        checkpoint (``hub_strategy`` ``"checkpoint"`` or ``"all_checkpoints"``), so that a resume from the Hub
        continues it."""
        self._write_credit_state(checkpoint_folder)
        super()._push_from_checkpoint(checkpoint_folder)

    def _write_credit_state(self, folder: str) -> None:
        if self._state_payload is not None:  # None with save_only_model: no optimizer either, never resumed from
            write_credit_state(folder, self.accelerator.process_index, self._state_payload)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Reads MRTPO's state back on resume, where TRL reads its own extra state."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._checkpointed().read(checkpoint, self.accelerator.process_index)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        if self.environments and not self._is_vlm:
            check_observations(inputs, prompts, self.environments)
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        check_finite_rewards(rewards, self.reward_func_names)
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
            refusal = reset_refusal(error, self.environments, self._is_vlm) if self.environment_factories else None
            if refusal is None:
                raise
            raise TypeError(refusal) from error
        if self.credit_rule.keeps_trl_advantages:
            return output
        scored, self._scored = self._scored, None
        mode = "train" if self.model.training else "eval"
        reduce_sum = self._reduce_sum()
        rank, processes = self.accelerator.process_index, self.accelerator.num_processes
        self._guard = CreditGuard(self._credit_parts, self.reward_func_names, rank, processes, reduce_sum)
        batch = self._weighted_batch(scored, output, mode)
        if "tool_mask" in output:  # every tool batch, whether or not a view of it is built
            from .trajectories import check_tool_results

            check_tool_results(batch.completions, multimodal=self._is_vlm)
        beta = self._beta()
        self._replay_seconds = 0.0
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        added = {"process": None, "failure_suffix": None}
        for name, term in self.credit_terms.items():
            returned = term(batch, tokenizer, num_generations, rank, self.state)
            contribution, logged = checked_contribution(f"the term '{name}'", returned, batch.shape, batch.mask.device)
            if contribution["process"] is not None:
                self._guard.note_non_finite(f"added:{name}", contribution["process"], batch.mask, per_reward=False)
            added = {key: _joined(added[key], contribution[key]) for key in added}
            for metric, value in logged:
                log_metric(self, mode, f"mrtpo/{metric}", value)
        credit, relevance, replayed = self._token_credit(batch, beta, added)
        self._guard.note_non_finite("final", credit.advantages, batch.mask, per_reward=False)
        self._guard.raise_if_bad()  # every process raises alike: the flags rode in steps 7-8's sums
        output["advantages"] = credit.advantages
        # The local batch's credit, kept for inspection (heatmaps, localisation) until the next generation.
        self.last_credit = CreditRecord.of(batch, credit, relevance, replayed, beta, self.reward_strength.betas(beta))
        total_seconds = time.perf_counter() - started
        self._log_credit(mode, credit, relevance, replayed, batch.mask, beta, self._replay_seconds, total_seconds)
        return output

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
        steps = warmup_steps(self.args.credit_warmup_steps, self.state.max_steps)
        if not self._warned_warmup and 0 < self.state.max_steps < 2 * steps:
            self._warned_warmup = True
            message = short_run_warning(self.state.max_steps, self.args.credit_warmup_steps, steps, target)
            warnings.warn(message, UserWarning, stacklevel=2)
        return warmup_beta(target, self.state.global_step, steps)

    def _weighted_batch(self, scored: Scored, output: dict, mode: str) -> ScoredBatch:
        """Steps 1-2 and the response-level weighting on the whole gathered batch, so that every process decides
        alike; then this process's slice."""
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = scored.rewards
        group_adv, varying = group_advantages(rewards, num_generations)
        reward_weights = self.reward_weights.to(group_adv)  # step 2's c_k, reweighed by any term
        training = mode == "train"
        local = local_slice(scored, self.accelerator.process_index)
        self._note_weighting("weighting", group_adv[local], reward_weights)
        for name, term in self.credit_terms.items():
            weighed = term.weigh(rewards, group_adv, reward_weights, num_generations, training)
            group_adv, reward_weights = checked_weighting(f"the term '{name}'", weighed, group_adv, reward_weights)
            self._note_weighting(f"weighting:{name}", group_adv[local], reward_weights)
        return ScoredBatch(
            inputs=scored.inputs,
            prompts=scored.prompts,
            completions=scored.completions,
            completion_ids=scored.completion_ids,
            rewards=rewards[local],
            group_advantages=group_adv[local],
            varying=varying[local],
            reward_weights=reward_weights,
            mask=credit_mask(output),
            output=output,
        )

    def _note_weighting(self, part: str, advantages: torch.Tensor, reward_weights: torch.Tensor) -> None:
        """The local ``[B, K]`` per-reward advantages and the ``[K]`` reward weights, for the finiteness check."""
        values = advantages * reward_weights.to(advantages)  # NaN or inf in either gives NaN or inf here
        self._guard.note(part, ~torch.isfinite(values), per_reward=True)

    def _token_credit(
        self, batch: ScoredBatch, beta: float, added: dict
    ) -> tuple[TokenCredit, torch.Tensor, torch.Tensor]:
        """Steps 3-8: the quantities the rule reads (none at beta 0: uniform weights whatever q is), then its token
        advantages with each reward's beta and the terms' additions (``added``: process advantages, failure
        suffixes), then each term's finish."""
        rule, terms = self.credit_rule, self.credit_terms.values()
        relevance = batch.mask.new_zeros(batch.shape, dtype=torch.float32)
        replayed = torch.zeros_like(batch.varying)
        reads = [*(rule.reads if self._replays and beta > 0 else ()), *(name for term in terms for name in term.reads)]
        reads = list(dict.fromkeys(reads))  # each quantity computed once, however many read it
        quantities = {}
        if reads:  # the policy's time for credit: logged as replay seconds
            started = time.perf_counter()
            for name in reads:
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
            self._guard.sum_over_processes,
            **added,
            combine=self._combine,
            check_weights=lambda weights: self._check_weights(weights, batch),
        )
        credit = checked_credit(self._rule, rule.advantages(inputs), batch, "advantages()")
        for name, term in self.credit_terms.items():
            credit = checked_credit(f"the term '{name}'", term.finish(credit, inputs), batch, "finish()")
        return credit, relevance, rule.replayed(inputs)

    def _check_weights(self, weights: torch.Tensor, batch: ScoredBatch) -> None:
        """The rule's step-5 weights where they enter steps 6-8: ``[B, K, C]`` float on the batch's device, finite."""
        check_tensor(self._rule, "token weights", weights, batch.shape, "float", batch.mask.device)
        self._guard.note_non_finite("rule", weights, batch.mask[:, None, :], per_reward=True)

    def _reduce_sum(self):
        """Sum over data-parallel processes for steps 7 and 8 (None on one process)."""
        if self.accelerator.num_processes == 1:
            return None
        return lambda tensor: self.accelerator.reduce(tensor, reduction="sum")

    def _replay_inputs(self, batch: ScoredBatch, joint: bool) -> tuple[list[list[int]], list, list[list[int]]]:
        """Step 2 on the local batch, tokenised as TRL tokenises prompts. Returns ``(wanted, context_ids,
        completion_ids)``: per response, the replayed rewards, the contexts' token ids ``[P_all, P_removed...]``
        (empty when nothing is replayed) and the completion's token ids."""
        args, strength = self.args, self.reward_strength
        batch_index = generation_batch_index(
            self.state.global_step, args.gradient_accumulation_steps, args.steps_per_generation, self.num_iterations
        )
        wanted, blocks, contexts = replay_contexts(
            self.info_block_builders,
            self.reward_func_names,
            batch.prompts,
            [completion_text(c) for c in batch.completions],
            batch.inputs,
            batch.rewards,
            batch.varying,
            batch.views,
            batch.mask.any(-1).tolist(),
            joint=joint,
            only_varying=args.replay_only_varying,
            resting=strength.resting(self.state.global_step, args.credit_warmup_steps, batch_index),
            separator=args.info_block_separator,
            header=self._assistant_header,
            special_tokens=self._special_tokens,
        )
        flat = [context for sample in contexts for context in sample]
        owners = [i for i, sample in enumerate(contexts) for _ in sample]
        flat_ids = iter(tokenize_prompts(self, flat, owners) if flat else [])
        context_ids = [[next(flat_ids) for _ in sample] for sample in contexts]
        completion_ids = batch.completion_ids
        prompt_lengths = batch.output["prompt_mask"].sum(-1).tolist()
        limit = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
        check_context_length(context_ids, completion_ids, blocks, prompt_lengths, self.reward_func_names, limit)
        return wanted, context_ids, completion_ids

    def _replay_record(self, batch: ScoredBatch) -> ReplayRecord:
        """What the relevance provider reads: step 2's contexts and the replay's settings."""
        joint = self.credit_rule.removal == "all"
        wanted, context_ids, completion_ids = self._replay_inputs(batch, joint)
        return ReplayRecord(
            completions=[completion_text(c) for c in batch.completions],
            completion_ids=completion_ids,
            mask=batch.mask,
            varying=batch.varying,
            wanted=wanted,
            context_ids=context_ids,
            rows=batch.inputs,
            joint=joint,
            temperature=self._replay_temperature,
            backend=self._replay_backend,
            chunk_size=self.args.replay_chunk_size,
            process_index=self.accelerator.process_index,
        )

    @cached_property
    def _assistant_header(self) -> str | None:
        return assistant_header(self.processing_class)

    @cached_property
    def _special_tokens(self) -> list[str]:
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        return [token for token in getattr(tokenizer, "all_special_tokens", []) if token]

    def _replay(self, batch: ScoredBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 3-4 from the relevance provider; on a train batch, step 5's strength reading of the placed q; then
        q as the terms and the rule read it."""
        record = self._replay_record(batch)
        # every process enters (collectives under sharding and in the reading), even one with nothing to replay
        with whole_policy(self) as policy:
            result = self.relevance_provider(policy, record)
        relevance, replayed, any_replayed = checked_relevance(self._provider, result, batch.shape, batch.mask.device)
        read = replayed[..., None] & batch.mask[:, None, :].bool()  # q is read on replayed pairs' tokens only
        self._guard.note_non_finite("q", relevance, read, per_reward=True)
        self._guard.note("q_negative", (relevance < -NEGATIVE_Q_TOLERANCE) & read, per_reward=True)
        # nothing off the credit mask (padding, tool results) reaches the weights or the strength reading
        relevance = relevance.masked_fill(~read, 0.0).clamp(min=0.0)  # [-1e-6, 0) is rounding
        if self.model.training:
            self.reward_strength.read(relevance, replayed, self._guard.sum_over_processes)
        if any_replayed:
            parts = [
                *((f"the term '{name}'", term) for name, term in self.credit_terms.items()),
                (self._rule, self.credit_rule),
            ]
            for name, part in parts:
                relevance = part.relevance(relevance, replayed, batch)
                check_tensor(name, "relevance()", relevance, batch.shape, "float", batch.mask.device)
                self._guard.note(f"q_negative:{name}", (relevance < -NEGATIVE_Q_TOLERANCE) & read, per_reward=True)
            self._guard.note_non_finite("q_adjusted", relevance, read, per_reward=True)
        return relevance, replayed

    def _log_credit(self, mode, credit, relevance, replayed, mask, beta, replay_seconds, total_seconds):
        # a rule that replays without reading q (a log-likelihood contrast, say) has no q statistics
        with_q = replayed if "relevance" in self.credit_rule.reads else torch.zeros_like(replayed)
        q_means, concentration = q_statistics(relevance, with_q, mask, self.reward_func_names)
        local = {
            "mrtpo/beta": beta,
            **self.reward_strength.logged_betas(beta, self.reward_func_names),
            "mrtpo/replayed_fraction": replayed.float().mean().item(),
            "mrtpo/cap_factor": credit.cap_factor,
            "mrtpo/replay_seconds": replay_seconds,
            "mrtpo/replay_share": replay_seconds / total_seconds if total_seconds > 0 else 0.0,
            **{f"mrtpo/q_mean/{name}": value for name, value in q_means.items()},
            **{f"mrtpo/q_mass80_token_share/{name}": value for name, value in concentration.items()},
        }
        # one collective per generation batch, entered by every process: each logs the processes' mean
        metrics = process_means(gather_object([local]))
        for key, value in metrics.items():
            log_metric(self, mode, key, value)

        if mode == "train":  # every process reads the same q means
            prefix = "mrtpo/q_mean/"
            means = {key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}
            for warning in self._collapse_monitor.warnings(means):
                logger.warning(warning)

        # A readable line per response in TRL's completions table (console, W&B, trackio): where credit went.
        # Decoding every token costs time each step, so only when that table is logged.
        if self.log_completions:
            ids, names = self.last_credit.completion_ids, self.reward_func_names
            summaries = credit_summaries(self.processing_class, ids, mask, credit.advantages, relevance, with_q, names)
            log_completion_column(self, "mrtpo_credit", gather_object(summaries))

        # TRL logged the sequence-level advantages it computed; replace them with what the loss will see.
        per_response = (credit.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        replace_logged_advantages(self, self.accelerator.gather(per_response).tolist())

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The model card (``README.md`` in ``output_dir``): TRL's, with the real base model, the data, and the
        MRTPO settings, rewards, info blocks and recipe in the training procedure (:mod:`trl_mrtpo.model_card`)."""
        self._write_model_card(self.args.output_dir, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def _write_model_card(self, folder: str, **details) -> None:
        if not self.is_world_process_zero():
            return
        from .model_card import build_model_card

        build_model_card(self, **details).save(os.path.join(folder, "README.md"))


def _joined(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    """Two terms' additions: process advantages add up, failure suffixes (bool) unite."""
    if total is None or part is None:
        return part if total is None else total
    return total | part if total.dtype == torch.bool else total + part
