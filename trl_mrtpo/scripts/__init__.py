"""The applications built on the core: the ``trl-mrtpo`` command (``cli``) and its verbs (``train``, ``demo``,
``inspection``, ``evaluation``), and what only they need (``embedded``: the embedded demo model; ``policy``:
loading a model to evaluate or inspect). The core never imports this package."""
