"""What a plan costs before launch: memory per rank by category, FLOPs, collectives and step time.

A room beside the core: training never imports it. This package's root is its front door for a plugin's pricing
module (``titan_<name>/costs.py``, registered under ``titan_core.costs``): the planner's hooks
(:mod:`titan_core.planner.hookspecs`), the ledger a plugin writes its costs in (:class:`Ledger`), the layout model
the first-party parallelisms change (:class:`Estimate`), the accelerator profile (:class:`Hardware`) and
:func:`evaluated`.

``facts.py`` measures the model (parameters, kept activations) on the meta device (``cuda_autocast.py``: under
the core's autocast, as a GPU's autocast would run it); ``ledger.py`` is a plugin's surface, ``estimate.py`` the
layout model behind it; ``costs.py`` loads each plugin's pricing, runs the hooks and prints the sum;
``hardware.py`` adds to each datasheet (:mod:`titan_core.devices`) the shares of its peaks that training reaches;
``cli.py`` is ``python -m titan_core.planner``.
"""

from titan_core.planner.estimate import ACROSS_JOBS, Estimate, evaluated
from titan_core.planner.hardware import Hardware
from titan_core.planner.hookspecs import COSTS_GROUP
from titan_core.planner.ledger import Amount, Ledger

__all__ = ["ACROSS_JOBS", "Amount", "Estimate", "Hardware", "Ledger", "evaluated", "COSTS_GROUP"]
