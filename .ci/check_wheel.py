"""Run in a fresh venv where only the built wheel (and its dependencies) is installed, outside the source tree:
every kit imports, one reward of each runs, and the package data is there."""

import json
from importlib import resources

import trl_mrtpo
from trl_mrtpo.kits import KIT_NAMES, get_kit

assert "site-packages" in trl_mrtpo.__file__, f"imported from the source tree: {trl_mrtpo.__file__}"
completion = [{"role": "assistant", "content": "```sql\nSELECT 1\n```"}]
columns = {
    "basic": {"end_phrase": ["That is all."], "keyword": ["blue"]},
    "sql": {},
    "if": {"constraints": [json.dumps([{"id": "punctuation:no_comma", "kwargs": {}, "text": "No commas."}])]},
    "tools": {},
    "short": {"opening": ["The"]},
    "agent": {},
}
for name in KIT_NAMES:
    kit = get_kit(name)
    scores = kit.rewards[0]([completion], **columns[name])
    assert len(scores) == 1, (name, scores)
    print(f"{name}: {kit.rewards[0].__name__} -> {scores}")
# NLTK's sentence splitter, from the data shipped inside the wheel (NLTK itself would try to download it)
sentences = json.dumps([{"id": "length_constraints:number_sentences", "text": "x",
                         "kwargs": {"num_sentences": 2, "relation": "at least"}}])  # fmt: skip
slot = get_kit("if").rewards[0]
assert slot(["One sentence here. And a second one.", "Only one."], constraints=[sentences] * 2) == [1.0, 0.0]
package = resources.files("trl_mrtpo")
for data in [
    "kits/nltk_data/corpora/stopwords/english",
    "templates/mrtpo_model_card.md",
    "adapters/agent-smollm2/adapter_model.safetensors",  # the agent kit's warm start (embedded-agent)
]:
    assert package.joinpath(data).is_file(), data
import trl_mrtpo.scripts.cli  # noqa: E402  the trl-mrtpo command's module is in the wheel

assert callable(trl_mrtpo.scripts.cli.main)
print("wheel OK")
