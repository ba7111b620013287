"""``python -m titan_core.planner``: see :mod:`titan_core.planner.cli`."""

from titan_core.planner.cli import main

main()
