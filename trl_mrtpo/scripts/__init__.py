"""The applications built on the core: the ``trl-mrtpo`` command (``cli``) and its verbs (``train``, ``demo``,
``inspection``, ``evaluation``), and what only they need (``embedded``: the embedded demo model; ``policy``:
loading a model to evaluate or inspect). The core never imports this package."""

import os

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


def default_threads() -> int:
    """torch threads for a CPU run when none is given: the cores this process may use, less those already busy
    (the 1-minute load average, rounded), at least 1. With torch's default of every core, one busy core stalls each
    parallel region on it: a demo step beside one busy single-threaded process took 115-400 s instead of 15-21 s."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        busy = 0.0
    return max(1, min(cores, cores - round(busy)))
