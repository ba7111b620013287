"""What a plan costs before launch: memory per rank by category, FLOPs, collectives and step time.

``facts.py`` measures the model (parameters, kept activations) on the meta device (``cuda_autocast.py``: under
the core's autocast, as a GPU's autocast would run it); ``estimate.py`` is the
ledger the plugins change through their ``estimate_costs`` hook; ``costs.py`` runs the hooks and prints the
sum; ``hardware.py`` holds the accelerator profiles, which the training metrics' MFU reads too; ``cli.py`` is
``python -m titan_core.planner``.
"""
