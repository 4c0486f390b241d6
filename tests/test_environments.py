"""TRL 1.16's environment features under MRTPO credit, on TRL's own tool loop with a scripted policy: an environment
that owns its reward (``get_reward``), alone or beside reward functions, with or without an info block; an
environment that owns its data (``reset()`` gives the prompt: a dataset without a ``prompt`` column, or none); and no
reward source at all (TRL's own error). Credit is checked against the float64 reference on the model's tokens."""

import pytest
from datasets import Dataset

from tests.test_agent_credit import BLOCKS, QUESTION, Atlas, answered, check_credit_on_model_tokens, scripted_trainer
from tests.test_agent_credit import tool_tokenizer as qwen3_tokenizer


class Ledger:
    """Owns its reward: 1 when the policy looked the code up in this rollout."""

    def reset(self, **kwargs):
        self.looked_up = False
        return None

    def lookup(self, city: str) -> str:
        """Look up the code of a city.

        Args:
            city: the city's name.
        """
        self.looked_up = True
        return f"The code of {city} is 42."

    def get_reward(self) -> float:
        return float(self.looked_up)


class Quiz(Ledger):
    """Owns its data too: ``reset()`` gives the question, appended to the (empty) prompt TRL starts from."""

    def reset(self, **kwargs):
        super().reset()
        return "What is the code of Paris?"


@pytest.fixture
def tokenizer(tiny_tokenizer):
    return qwen3_tokenizer(tiny_tokenizer)


def test_an_environment_reward_beside_a_reward_function(tokenizer, tmp_path):
    """The environment's reward is TRL's extra reward column, named after its class; without an entry of its own in
    ``info_blocks`` it has no block (uniform credit); the reward function's block is replayed."""
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, reward_funcs=[answered], info_blocks=[BLOCKS[0]],
                               environment_factory=Ledger)  # fmt: skip
    trainer.train()
    assert trainer.reward_func_names == ["answered", "Ledger"]
    assert trainer.info_block_builders == [BLOCKS[0], None]
    rewards = trainer.credits[0].rewards[:, 1]
    assert set(rewards.tolist()) == {0.0, 1.0}  # the environment's reward varies: the even rows looked it up
    assert not trainer.credits[0].replayed[:, 1].any()
    check_credit_on_model_tokens(trainer)


def test_an_environment_reward_alone_with_its_own_block(tokenizer, tmp_path):
    """No reward function: the environment owns the only reward, and ``info_blocks`` gives it a block (one entry
    per reward, the environments' after the functions', in TRL's order)."""
    trainer = scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8),
                               reward_funcs=None, info_blocks=[BLOCKS[1]], environment_factory=Ledger)  # fmt: skip
    trainer.train()
    assert trainer.reward_func_names == ["Ledger"]
    assert trainer.credits[0].replayed[:, 0].any()
    check_credit_on_model_tokens(trainer)


def test_no_reward_source_is_trls_error(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="No reward source provided"):
        scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8), reward_funcs=None,
                         info_blocks=None)  # fmt: skip


def test_environments_own_the_data_and_one_owns_its_reward(tokenizer, tmp_path):
    """A dict ``environment_factory`` routed by an ``environment`` column (no ``prompt`` column, as TRL allows):
    ``reset()`` gives each rollout its question, the replay's contexts carry it, and the environment that owns a reward
    scores only its own rollouts (None for the others)."""

    class AtlasQuiz(Atlas):  # a tool only: its rollouts get None from Quiz's reward
        def reset(self, **kwargs):
            return "What is the code of Paris?"

    dataset = Dataset.from_list([{"environment": name} for name in ("quiz", "atlas")] * 4)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, reward_funcs=[answered], info_blocks=[BLOCKS[0]],
                               environment_factory={"quiz": Quiz, "atlas": AtlasQuiz},
                               config={"shuffle_dataset": False})  # fmt: skip
    trainer.train()
    assert trainer.reward_func_names == ["answered", "Quiz"]
    quiz, atlas = (credit.rewards[:, 1] for credit in trainer.credits)  # one prompt (group) per step, in order
    assert not quiz.isnan().any() and atlas.isnan().all()  # None for the atlas rollouts
    assert all("What is the code of Paris?" in str(prompt) for c in trainer.credits for prompt in c.prompts)
    check_credit_on_model_tokens(trainer)


def test_one_environment_owns_the_data_without_a_dataset(tokenizer, tmp_path):
    trainer = scripted_trainer(tokenizer, tmp_path, None, reward_funcs=[answered], info_blocks=[BLOCKS[0]],
                               environment_factory=Quiz)  # fmt: skip
    trainer.train()
    assert trainer.reward_func_names == ["answered", "Quiz"]
    check_credit_on_model_tokens(trainer)


class Instructed(Ledger):
    """States its instruction in ``reset()``: TRL appends it to the prompt, where an in-prompt block finds it."""

    RULE = "Always look the code up first."

    def reset(self, **kwargs):
        super().reset()
        return self.RULE


def test_an_in_prompt_span_that_reset_adds_is_found_in_the_prompts_trl_builds(tokenizer, tmp_path):
    """The span is not in the dataset's prompt, only in what TRL builds after ``reset()``: construction accepts it and
    the first batch replays it (it was refused at construction as 'not a span of the prompt')."""
    from trl_mrtpo import InfoBlock

    def rule(**_):
        return InfoBlock(Instructed.RULE, placement="in_prompt")

    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, reward_funcs=[answered], info_blocks=[rule],
                               environment_factory=Instructed)  # fmt: skip
    trainer.train()
    assert trainer.credits[0].replayed[:, 0].any()


def _returns(value):
    class Returning(Ledger):
        def get_reward(self):
            return value

    return Returning


@pytest.mark.parametrize("value", ["1.0", [1.0, 0.0], {"score": 1.0}])
def test_what_get_reward_returns_is_checked_naming_the_environment(tokenizer, tmp_path, value):
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, reward_funcs=[answered], info_blocks=None,
                               environment_factory=_returns(value))  # fmt: skip
    with pytest.raises(TypeError, match=r"reward function 'Returning.get_reward' returned .* for sample 0"):
        trainer.train()


def test_get_reward_that_is_none_for_every_rollout_is_warned_about_once(tokenizer, tmp_path):
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, reward_funcs=[answered], info_blocks=None,
                               environment_factory=_returns(None))  # fmt: skip
    with pytest.warns(UserWarning, match=r"'Returning.get_reward' returned None for every sample"):
        trainer.train()


def test_a_reward_looking_method_without_get_reward_is_warned_about(tokenizer, tmp_path):
    class Scorer(Atlas):
        def reward(self) -> float:
            """The reward of this rollout (meant as get_reward).

            Returns:
                the reward.
            """
            return 1.0

    with pytest.warns(UserWarning, match=r"Scorer has a method 'reward' but no get_reward"):
        scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8),
                         reward_funcs=[answered], info_blocks=None, environment_factory=Scorer)  # fmt: skip


def test_the_model_card_names_the_environment_tools_and_template(tokenizer, tmp_path):
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, reward_funcs=[answered], info_blocks=[BLOCKS[0]],
                               environment_factory=Ledger)  # fmt: skip
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "environment (TRL's `environment_factory`): `Ledger`" in card
    assert "tools: `lookup`" in card
    assert "chat template: TRL's `qwen3` (`chat_template_path: qwen3`)" in card


def test_a_get_reward_that_is_not_a_method_is_refused_naming_the_environment(tokenizer, tmp_path):
    """TRL takes an environment's reward from a plain ``get_reward`` method only: a property would drop the reward
    without a word."""

    class Scored(Atlas):
        @property
        def get_reward(self) -> float:
            return 1.0

    with pytest.raises(TypeError, match=r"Scored.get_reward is a property; TRL reads .* would be dropped"):
        scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8),
                         reward_funcs=[answered], info_blocks=None, environment_factory=Scored)  # fmt: skip


def test_a_reset_returning_a_list_of_strings_is_refused_naming_the_environment(tokenizer, tmp_path):
    class Listing(Ledger):
        def reset(self, **kwargs):
            super().reset()
            return ["What is the code of Paris?"]

    trainer = scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8),
                               reward_funcs=[answered], info_blocks=None, environment_factory=Listing)  # fmt: skip
    with pytest.raises(TypeError, match=r"Listing.reset\(\) returned a list of strings; it returns None or the text"):
        trainer.train()
