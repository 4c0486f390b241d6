"""The applications built on the core: the ``trl-mrtpo`` command (``cli``) and its verbs (``train``, ``demo``,
``inspection``, ``evaluation``), and what only they need (``embedded``: the embedded demo model; ``policy``:
loading a model to evaluate or inspect). The core never imports this package."""

# `trl-mrtpo demo`: the short-answers task, whose four rewards all vary from the first steps (benchmarks/demo.md)
DEMO_SETTINGS = {
    "task": "short",
    "steps": 14,
    "prompts_per_step": 2,
    "num_generations": 4,
    "max_completion_length": 24,
    "learning_rate": 3e-4,  # constant: a linear decay over the demo's steps would halve the 60-step runs' start rate
    "temperature": 0.7,
    "warmup_steps": 4,
}
