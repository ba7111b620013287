"""Tools around runs, each a command of its own (``python -m titan_core.compare``)."""
