import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

# Property tests draw the same examples on every run (CI included): a failure is reproducible, never a flake.
# HYPOTHESIS_PROFILE=explore draws fresh examples when hunting for new edge cases.
settings.register_profile("deterministic", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# Two cores: without a pin, torch's threads fight the other test worker and slow down 20-50x.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

# torch 2.13's bf16 scaled-dot-product attention on CPU calls an AVX-512 packing routine whenever the hardware has
# AVX-512, even when ATEN_CPU_CAPABILITY forces a lower float path ("pack_vnni2 is only supported when avx512 is
# supported"): the bf16 model tests cannot run under that emulation (CI's second float path), only on real hardware.
BF16_ATTENTION_EMULATED = torch.cpu._is_avx512_supported() and torch.backends.cpu.get_cpu_capability() != "AVX512"
needs_bf16_attention = pytest.mark.skipif(
    BF16_ATTENTION_EMULATED, reason="bf16 attention fails under an emulated lower ATEN_CPU_CAPABILITY (torch 2.13)"
)

# What a reward function may be handed instead of a well-formed completion.
MALFORMED_COMPLETIONS = st.one_of(
    st.text(max_size=300),
    st.none(),
    st.integers(),
    st.lists(st.dictionaries(st.text(max_size=5), st.one_of(st.text(max_size=30), st.none())), max_size=2),
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "End your reply with the phrase: is there anything else? Use the keyword ocean. Answer in lowercase.",
    "Write a short poem about the sea and the sky. The quick brown fox jumps over the lazy dog.",
    "SELECT name FROM users WHERE id = 3; the query must be wrapped in ```sql fences.",
    "Call the tool get_weather with arguments city and unit, as a JSON list of calls.",
]


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(tokenizer, **fields):
    """A tiny Llama configuration for ``tokenizer``; ``fields`` change any of it."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,  # room for the kits' prompts with their info blocks
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**settings, **fields})


def tiny_model_of(
    config_name: str, tokenizer, tie_word_embeddings: bool, seed: int = 0, max_positions: int = 4096, **fields
):
    """A random 2-layer model of a real family's architecture (``config_name``: ``Qwen2Config``, ...) for
    ``tokenizer``, with the family's ``tie_word_embeddings`` and its vocabulary padded past the tokenizer's (Qwen's
    configs hold 152,064 rows for 151,665 tokens); ``fields`` set any other of the config's fields."""
    import transformers

    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer) + 64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
        **fields,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def build_tiny_model(tokenizer, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tokenizer))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return build_tiny_model(tiny_tokenizer)


@pytest.fixture
def embedded_model_in_hub_cache(tmp_path, monkeypatch):
    """The embedded model resolvable by its Hub id, offline: a Hub cache whose snapshot links to the embedded folder.
    What a shared adapter records (``HuggingFaceTB/SmolLM2-135M-Instruct``) then loads as on a machine with the
    model cached, with no network."""
    import huggingface_hub.constants

    from trl_mrtpo.scripts.embedded import EMBEDDED_HUB_ID, embedded_model_path

    revision = "0" * 40
    repo = tmp_path / "hub" / ("models--" + EMBEDDED_HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in Path(embedded_model_path()).iterdir():
        (snapshot / path.name).symlink_to(path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return EMBEDDED_HUB_ID


def random_ids(gen, n):
    return torch.randint(5, 300, (n,), generator=gen).tolist()


@pytest.fixture
def batch():
    """Two groups: four responses to one 40-token prompt (2 or 3 contexts each), one to another prompt."""
    gen = torch.Generator().manual_seed(0)
    prompt, other = random_ids(gen, 40), random_ids(gen, 30)
    contexts = [[prompt + random_ids(gen, n) for n in sizes] for sizes in ((3, 7, 1), (3, 7, 1), (3, 2), (5, 1, 4))]
    contexts.append([other + random_ids(gen, 6), other + random_ids(gen, 2)])
    completions = [random_ids(gen, n) for n in (5, 9, 1, 12, 7)]
    return contexts, completions


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny model and its tokenizer saved in a folder, loadable by path as a recipe's model."""
    folder = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tiny_tokenizer).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def local_data(tmp_path_factory):
    """Small stand-ins for Spider, HIR-16K and RLLA in their real layouts."""
    from trl_mrtpo.kits.sql import build_demo_databases

    root = tmp_path_factory.mktemp("data")
    dbs = build_demo_databases(root / "built")
    (root / "spider" / "database" / "shop").mkdir(parents=True)
    shutil.copy(dbs["shop"], root / "spider" / "database" / "shop" / "shop.sqlite")
    examples = [{"db_id": "shop", "question": "How many customers?", "query": "SELECT count(*) FROM customers"}] * 8
    (root / "spider" / "train_spider.json").write_text(json.dumps(examples))
    hir = {
        "instruction": "Describe the sea.",
        "constraints": [{"instruction_id": "punctuation:no_comma", "kwargs": {}}],
    }
    (root / "hir.jsonl").write_text("\n".join(json.dumps(hir) for _ in range(8)))
    rlla = {"prompt": [{"role": "user", "content": "weather in Oslo"}], "answer": '[{"name": "w", "arguments": {}}]'}
    (root / "rlla.jsonl").write_text("\n".join(json.dumps(rlla) for _ in range(8)))
    return {"spider": str(root / "spider"), "hir": str(root / "hir.jsonl"), "rlla": str(root / "rlla.jsonl")}
