"""Every causal-LM family transformers ships is replayed exactly or refused by name at start-up: the family sweep
(tests/model_families.py) over transformers' own auto mapping, q at the replay's defaults against plain forwards; the
start-up check on the user's own model (a remote-code ALiBi model the config rule cannot see falls back to one
sequence per row); and a planted fault (packing forced on for an ALiBi family) that the sweep reports wrong."""

import json
import textwrap

import pytest
import torch
import transformers

from tests.conftest import needs_bf16_attention
from tests.helpers import time_limit
from tests.model_families import (
    EXPECTATIONS_VERSION,
    MUST_RUN,
    NOT_BUILT,
    SKIPPED,
    bf16_packing_problem,
    causal_lm_families,
    sweep_batch,
    sweep_family,
    tiny_model,
)
from tests.reference import full_logits_relevance
from trl_mrtpo import replay
from trl_mrtpo.replay import ReplayPath, check_replay_path, replay_path, replay_relevance, replay_settings, rule_path

FAMILY_SECONDS = 120  # a family's whole verdict, fp32 and bf16 (the slowest, Falcon-H1, takes about 10 s)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(causal_lm_families()))
def test_every_causal_lm_family_replays_exactly_or_is_refused_by_name(family):
    with time_limit(FAMILY_SECONDS):
        verdict = sweep_family(family)
    name = causal_lm_families()[family]
    if verdict.outcome in ("not tiny", "not built"):
        assert family not in MUST_RUN, verdict
        # on the release the expectations were written for, only the listed families; a later release's reported
        assert family in NOT_BUILT or transformers.__version__ != EXPECTATIONS_VERSION, verdict
        assert family not in NOT_BUILT or NOT_BUILT[family] in verdict.detail, verdict
        pytest.skip(f"{family} cannot be built tiny: {verdict.detail}")
    assert family not in NOT_BUILT, f"{family} builds now: remove its NOT_BUILT entry"
    if verdict.outcome == "skipped":
        assert family in SKIPPED and family not in MUST_RUN, verdict
        assert verdict.detail.startswith(f"its plain forward fails: {SKIPPED[family]}"), verdict.detail
        pytest.skip(verdict.detail)
    assert family not in SKIPPED, f"{family}'s plain forward runs now: remove its SKIPPED entry"
    if verdict.outcome == "refused":
        assert name in verdict.detail and "MRTPO" in verdict.detail, verdict.detail
    else:
        assert verdict.outcome == "exact", verdict


def test_the_named_families_are_never_skipped():
    assert set(MUST_RUN) <= set(causal_lm_families())
    assert not set(MUST_RUN) & (set(SKIPPED) | set(NOT_BUILT))


def test_a_planted_fault_packing_an_alibi_family_fails_the_sweep(monkeypatch):
    """Packing forced on for MPT, past the rule and the start-up check: its ALiBi bias follows a key's column in the
    packed row, and the sweep reports its q wrong (Bloom's forward crashes on the packed row's 4-D mask)."""
    monkeypatch.setattr(replay, "rule_path", lambda model: ReplayPath())
    monkeypatch.setattr(replay, "probe_mismatch", lambda model, multiplier: 0.0)
    monkeypatch.setattr(replay._Decoder, "__init__", forced_positions(replay._Decoder.__init__))
    verdict = sweep_family("mpt")
    assert verdict.outcome == "wrong" and verdict.error > 0.01 * verdict.peak, verdict
    with pytest.raises(ValueError):
        sweep_family("bloom")


@needs_bf16_attention
def test_the_planted_fault_fails_the_sweeps_bf16_comparison_too(monkeypatch):
    monkeypatch.setattr(replay, "rule_path", lambda model: ReplayPath())
    monkeypatch.setattr(replay, "probe_mismatch", lambda model, multiplier: 0.0)
    monkeypatch.setattr(replay._Decoder, "__init__", forced_positions(replay._Decoder.__init__))
    assert "of the packed states are off" in bf16_packing_problem("mpt", ReplayPath())


def forced_positions(init):
    def forced(self, model, path):
        init(self, model, path)
        self.takes_positions = True  # as a model whose forward swallows position_ids in **kwargs

    return forced


@pytest.mark.parametrize("family", ["mpt", "bloom", "falcon"])
def test_alibi_families_are_exact_at_the_defaults_and_without_prefix_sharing(family):
    extra = {"alibi": True} if family == "falcon" else {}
    model = tiny_model(family, **extra)
    temperature, _ = replay_settings(model, 1.0, "torch")
    reason = replay_path(model).reason
    assert not replay_path(model).packs and ("ALiBi" in reason or "position_ids" in reason), reason
    contexts, completions = sweep_batch()
    for min_shared_prefix in (16, None):
        q = replay_relevance(model, contexts, completions, temperature, min_shared_prefix=min_shared_prefix)
        for context, completion, got in zip(contexts, completions, q):
            reference = full_logits_relevance(model, context, completion, 1.0)
            torch.testing.assert_close(got.double(), reference, atol=1e-3 * reference.max().item(), rtol=0)


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "falcon_h1", "jamba"])
def test_state_space_and_hybrid_models_replay_without_prefix_sharing(family):
    model = tiny_model(family)
    replay_settings(model, 1.0, "torch")
    path = replay_path(model)
    # transformers 5.25 returns their state-space cache (its layers named), 5.17 returns none under `cache`
    assert (path.packs, path.shares_prefix) == (False, False) and "state" in path.reason, path


def test_a_model_whose_forward_the_replay_cannot_reproduce_is_refused_by_name():
    with pytest.raises(ValueError, match="cannot reproduce CpmAntForCausalLM's own forward"):
        replay_settings(tiny_model("cpmant"), 1.0, "torch")


REMOTE_MODELING = '''
from transformers import MptConfig, MptForCausalLM, MptModel


class RemoteAlibiConfig(MptConfig):
    model_type = "remote_alibi"


class RemoteAlibiModel(MptModel):
    """Takes position_ids and ignores them: its ALiBi bias follows the key's column, as MPT's."""

    def forward(self, input_ids=None, cache=None, attention_mask=None, position_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, cache=cache, attention_mask=attention_mask, **kwargs)


class RemoteAlibiForCausalLM(MptForCausalLM):
    config_class = RemoteAlibiConfig

    def __init__(self, config):
        super().__init__(config)
        self.transformer = RemoteAlibiModel(config)
        self.post_init()
'''


def test_a_remote_code_alibi_model_the_rule_cannot_see_falls_back_to_one_sequence_per_row(tmp_path, monkeypatch):
    """A model loaded with ``trust_remote_code`` whose config declares no ALiBi and whose decoder takes position_ids:
    the config rule would pack it, the start-up check sees its packed logits disagree with its own forward and
    replays it one sequence per row, which is exact."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "remote-alibi"
    folder.mkdir()
    (folder / "modeling_remote.py").write_text(textwrap.dedent(REMOTE_MODELING))
    mpt = tiny_model("mpt")
    config = mpt.config.to_dict()
    config["attn_config"]["alibi"] = False  # the flag an old checkpoint's config does not carry
    config.update(
        model_type="remote_alibi",
        architectures=["RemoteAlibiForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_remote.RemoteAlibiConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteAlibiForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(mpt.state_dict(), folder / "pytorch_model.bin")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__name__ == "RemoteAlibiForCausalLM"
    assert rule_path(model).packs  # the rule cannot see it
    temperature, _ = replay_settings(model, 1.0, "torch")
    path = replay_path(model)
    # one sequence per row; transformers 5.17's MPT also disagrees through a shared prefix, and the check drops it
    assert not path.packs and "disagree with its forward" in path.reason, path
    contexts, completions = sweep_batch()
    q = replay_relevance(model, contexts, completions, temperature)
    for context, completion, got in zip(contexts, completions, q):
        reference = full_logits_relevance(model, context, completion, 1.0)
        torch.testing.assert_close(got.double(), reference, atol=1e-3 * reference.max().item(), rtol=0)


def test_the_check_keeps_the_rules_path_on_a_model_it_reproduces(tiny_model):
    assert check_replay_path(tiny_model) == ReplayPath() == replay_path(tiny_model)


def family_trainer(family: str, tokenizer, tmp_path):
    """A trainer of the basic kit on the family's tiny model, sized to the tiny tokenizer."""
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    model = tiny_model(family, vocab_size=len(tokenizer) + 64, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return MRTPOTrainer(
        model=model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, max_steps=2),
        train_dataset=make_basic_dataset(8),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon_mamba"])
def test_the_trainer_replays_families_that_cannot_pack(family, tiny_tokenizer, tmp_path):
    """Bloom's first replay crashed on the packed row's mask, MPT's trained on wrong credit, and Falcon-Mamba's
    crashed sharing its cache: each now trains two replaying steps on the path its start-up check settled."""
    trainer = family_trainer(family, tiny_tokenizer, tmp_path)
    assert not replay_path(trainer.model).packs
    trainer.train()
    assert trainer.state.log_history[-2]["mrtpo/replayed_fraction"] > 0


def test_the_trainer_refuses_a_model_it_cannot_replay_before_training(tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="CpmAntForCausalLM's own forward"):
        family_trainer("cpmant", tiny_tokenizer, tmp_path)
