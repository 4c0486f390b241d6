"""Example reward functions and info-block builders: plain TRL reward functions to copy into your project, or to
name by dotted path in a recipe when you run from the repository root, e.g.

```yaml
reward_funcs: [reward_funcs.structured.json_schema_reward, reward_funcs.reference.answer_matches_reference]
info_blocks: [reward_funcs.structured.schema_block, reward_funcs.reference.reference_block]
```

Each reward takes ``completions`` (strings or chat messages) and the dataset columns it reads as keyword arguments,
returns one float per completion (or None where it does not apply) and never raises on malformed model output.
Each info-block builder returns the information its reward's verifier decides with (see ``trl_mrtpo.InfoBlock``).
The built-in task kits (SQL, instruction following, tool calling) live in the installed package,
``trl_mrtpo.kits``.
"""
