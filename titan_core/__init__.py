"""titan-core: a PyTorch-native LLM trainer made of a small core and pip-installable plugins."""

from titan_core.errors import ConfigError
from titan_core.hookspecs import hookimpl
from titan_core.plan import Declaration, MeshDimension

__all__ = ["ConfigError", "Declaration", "MeshDimension", "hookimpl"]
__version__ = "0.1.0"
