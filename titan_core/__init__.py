"""titan-core: a PyTorch-native LLM trainer made of a small core and pip-installable plugins."""

from titan_core.errors import ConfigError
from titan_core.hookspecs import hookimpl

__all__ = ["ConfigError", "Declaration", "MeshDimension", "hookimpl"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Loaded on first use, so that `python -m titan_core.plan` runs the module it imports, not a copy of it.
    if name in ("Declaration", "MeshDimension"):
        from titan_core import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'titan_core' has no attribute {name!r}")
